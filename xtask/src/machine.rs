//! What a record says about where and from what it was measured: host, CPU, GPU, memory,
//! the commit (with `-dirty`), and the inherited `KILN_*` environment.

use std::collections::BTreeMap;
use std::fs;
use std::process::Command;

use serde::Serialize;

/// The machine the harness runs on.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    /// Host name.
    pub host: String,
    /// CPU model name.
    pub cpu: String,
    /// Logical CPUs.
    pub cpus: usize,
    /// Physical memory in bytes, when known.
    pub memory_bytes: Option<u64>,
    /// GPUs as `name (memory)`, from nvidia-smi when present.
    pub gpus: Vec<String>,
    /// Whether an NVIDIA driver is loaded (Linux).
    pub nvidia_driver: bool,
    /// `linux`, `macos`, ...
    pub os: String,
}

impl Machine {
    /// Probes this machine. Every probe degrades to "unknown" rather than failing.
    pub fn probe() -> Machine {
        let host = rustix::system::uname().nodename().to_string_lossy().into_owned();
        let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let os = std::env::consts::OS.to_string();
        let nvidia_driver =
            os == "linux" && (fs::metadata("/proc/driver/nvidia/version").is_ok() || nvidia_smi_present());
        Machine {
            host: if host.is_empty() { "unknown-host".into() } else { host },
            cpu: cpu_name().unwrap_or_else(|| "unknown CPU".into()),
            cpus,
            memory_bytes: memory_bytes(),
            gpus: if nvidia_driver { nvidia_gpus() } else { Vec::new() },
            nvidia_driver,
            os,
        }
    }

    /// The device string for a backend: what a record line is scoped to. It names the
    /// processor and its memory, and the memory limit when one was set, because an OOM
    /// under a 1 GiB limit says nothing about the same machine without it.
    pub fn device(&self, backend: &str, memory_limit: Option<&str>) -> String {
        let base = match backend {
            "cuda" if !self.gpus.is_empty() => format!("cuda:{}", self.gpus[0]),
            // The CPU's memory, or the unified memory an Apple GPU shares with it.
            other => match self.memory_bytes {
                Some(b) => format!("{other}:{} ({})", self.cpu, gib(b)),
                None => format!("{other}:{}", self.cpu),
            },
        };
        match memory_limit {
            Some(limit) => format!("{base} limit {limit}"),
            None => base,
        }
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.0} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn cpu_name() -> Option<String> {
    if let Ok(text) = fs::read_to_string("/proc/cpuinfo") {
        let name = text.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            matches!(k.trim(), "model name" | "Processor" | "cpu model").then(|| v.trim().to_string())
        });
        if name.is_some() {
            return name;
        }
    }
    let out = Command::new("sysctl").args(["-n", "machdep.cpu.brand_string"]).output().ok()?;
    let s = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !s.is_empty()).then_some(s)
}

fn memory_bytes() -> Option<u64> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        let info = rustix::system::sysinfo();
        Some(info.totalram as u64 * u64::from(info.mem_unit))
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        let out = Command::new("sysctl").args(["-n", "hw.memsize"]).output().ok()?;
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    }
}

fn nvidia_smi_present() -> bool {
    Command::new("nvidia-smi").arg("-L").output().is_ok_and(|o| o.status.success())
}

fn nvidia_gpus() -> Vec<String> {
    let Ok(out) =
        Command::new("nvidia-smi").args(["--query-gpu=name,memory.total", "--format=csv,noheader"]).output()
    else {
        return Vec::new();
    };
    if !out.status.success() {
        return Vec::new();
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let (name, mem) = l.rsplit_once(',')?;
            Some(format!("{} ({})", name.trim(), mem.trim()))
        })
        .collect()
}

/// The short commit of the tree at `root`, with `-dirty` when a tracked file differs
/// from it (untracked files, such as earlier result CSVs, do not count). `unknown`
/// outside a git checkout.
pub fn commit(root: &std::path::Path) -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let Some(sha) = git(&["rev-parse", "--short", "HEAD"]).filter(|s| !s.is_empty()) else {
        return "unknown".into();
    };
    match git(&["status", "--porcelain", "--untracked-files=no"]) {
        Some(s) if s.is_empty() => sha,
        _ => format!("{sha}-dirty"),
    }
}

/// Every inherited variable whose name starts with `KILN_`, sorted.
pub fn kiln_env() -> BTreeMap<String, String> {
    std::env::vars_os()
        .filter_map(|(k, v)| {
            let k = k.into_string().ok()?;
            k.starts_with("KILN_").then(|| (k, v.to_string_lossy().into_owned()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine() -> Machine {
        Machine {
            host: "h".into(),
            cpu: "Some CPU".into(),
            cpus: 2,
            memory_bytes: Some(24 << 30),
            gpus: vec!["NVIDIA H200 (143771 MiB)".into()],
            nvidia_driver: true,
            os: "linux".into(),
        }
    }

    #[test]
    fn devices_name_processor_memory_and_limit() {
        let m = machine();
        assert_eq!(m.device("cpu", None), "cpu:Some CPU (24 GiB)");
        assert_eq!(m.device("cpu", Some("4MiB")), "cpu:Some CPU (24 GiB) limit 4MiB");
        assert_eq!(m.device("cuda", None), "cuda:NVIDIA H200 (143771 MiB)");
        assert_eq!(m.device("metal", None), "metal:Some CPU (24 GiB)");
    }

    #[test]
    fn probing_this_machine_and_tree_works() {
        let m = Machine::probe();
        assert!(!m.host.is_empty() && m.cpus >= 1);
        let c = commit(std::path::Path::new(env!("CARGO_MANIFEST_DIR")));
        assert!(c == "unknown" || c.chars().take(7).all(|ch| ch.is_ascii_hexdigit()), "{c}");
        assert!(commit(std::path::Path::new("/")).eq("unknown"));
    }
}
