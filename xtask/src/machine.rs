//! What a record says about where and from what it was measured: host, CPU, GPU, memory,
//! the NVIDIA driver and CUDA versions, the commit (with `-dirty`), and the inherited
//! `KILN_*` environment.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::path::Path;
use std::process::Command;

use kiln_protocol::DeviceDesc;
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
    /// The first GPU's memory in bytes (nvidia-smi's `memory.total`), when known.
    pub gpu_memory_bytes: Option<u64>,
    /// The NVIDIA driver's version (nvidia-smi's `driver_version`), when known.
    pub driver_version: Option<String>,
    /// The CUDA version the driver supports (`CUDA Version: X.Y` in nvidia-smi's
    /// header), when known.
    pub cuda_version: Option<String>,
    /// Whether an NVIDIA driver is loaded (Linux).
    pub nvidia_driver: bool,
    /// `KILN_CUDA_EMULATE` is set: `--backend cuda` runs the CUDA kernels through their
    /// host execution on the CPU, never on a GPU.
    pub cuda_emulated: bool,
    /// `linux`, `macos`, ...
    pub os: String,
    /// The wgpu adapter a `vulkan` or `metal` sweep runs on, as the engine found it
    /// (`sweep::adapter::find`); `None` until asked, and for every other backend.
    pub adapter: Option<DeviceDesc>,
}

/// What nvidia-smi says about this machine's GPUs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NvidiaFacts {
    /// Each GPU as `name (memory)`, in nvidia-smi's order.
    pub gpus: Vec<String>,
    /// The first GPU's memory in bytes.
    pub gpu_memory_bytes: Option<u64>,
    /// The driver's version (the first GPU's).
    pub driver_version: Option<String>,
    /// The CUDA version the driver supports.
    pub cuda_version: Option<String>,
}

/// The query the GPU facts come from, one line per GPU: `NVIDIA H200, 143771 MiB, 580.95.05`.
pub const GPU_QUERY: [&str; 2] = ["--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"];

impl Machine {
    /// Probes this machine. Every probe degrades to "unknown" rather than failing.
    pub fn probe() -> Machine {
        Machine::probe_with(OsStr::new("nvidia-smi"))
    }

    /// Probes this machine, asking `nvidia_smi` (a program name looked up on PATH, or a
    /// path) about its GPUs.
    pub fn probe_with(nvidia_smi: &OsStr) -> Machine {
        let host = rustix::system::uname().nodename().to_string_lossy().into_owned();
        let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let os = std::env::consts::OS.to_string();
        let nvidia = if os == "linux" { nvidia_facts(nvidia_smi) } else { None };
        let nvidia_driver =
            os == "linux" && (fs::metadata("/proc/driver/nvidia/version").is_ok() || nvidia.is_some());
        let nvidia = nvidia.unwrap_or_default();
        Machine {
            host: if host.is_empty() { "unknown-host".into() } else { host },
            cpu: cpu_name().unwrap_or_else(|| "unknown CPU".into()),
            cpus,
            memory_bytes: memory_bytes(),
            gpus: nvidia.gpus,
            gpu_memory_bytes: nvidia.gpu_memory_bytes,
            driver_version: nvidia.driver_version,
            cuda_version: nvidia.cuda_version,
            nvidia_driver,
            cuda_emulated: cuda_emulation(std::env::var_os("KILN_CUDA_EMULATE").as_deref()).unwrap_or(false),
            os,
            adapter: None,
        }
    }

    /// The adapter `backend` runs on, when the engine named one for it.
    fn adapter_of(&self, backend: &str) -> Option<&DeviceDesc> {
        self.adapter.as_ref().filter(|a| a.backend == backend)
    }

    /// Whether `backend` runs on this machine's NVIDIA GPU: `cuda`, with a GPU found and
    /// no host execution asked for.
    fn on_gpu(&self, backend: &str) -> bool {
        backend == "cuda" && !self.cuda_emulated && !self.gpus.is_empty()
    }

    /// Whether `backend`'s kernels run on a device rather than the CPU: a GPU backend,
    /// except `cuda` under `KILN_CUDA_EMULATE`, whose kernels run on the host (whether or
    /// not this machine has a GPU; a `cuda` run without one fails in the engine).
    pub fn on_device(&self, backend: &str) -> bool {
        match backend {
            "cuda" => !self.cuda_emulated,
            "metal" => true,
            // lavapipe is a Vulkan device on the CPU.
            "vulkan" => self.adapter_of(backend).is_some_and(|a| a.device_type != "Cpu"),
            _ => false,
        }
    }

    /// The device string for a backend: what a record line is scoped to. It names the
    /// processor and its memory, and the memory limit when one was set, because an OOM
    /// under a 1 GiB limit says nothing about the same machine without it. `cuda` under
    /// `KILN_CUDA_EMULATE` is the host execution on the CPU, never a GPU's name.
    pub fn device(&self, backend: &str, memory_limit: Option<&str>) -> String {
        let host = |name: String| match self.memory_bytes {
            Some(b) => format!("{name} ({})", gib(b)),
            None => name,
        };
        let base = match backend {
            "cuda" if self.on_gpu(backend) => format!("cuda:{}", self.gpus[0]),
            "cuda" if self.cuda_emulated => {
                format!("cuda:{}", host(format!("host execution on {}", self.cpu)))
            }
            // A wgpu adapter with its own memory; one on the CPU (lavapipe) says so.
            "vulkan" | "metal" if let Some(a) = self.adapter_of(backend) => {
                let on =
                    if a.device_type == "Cpu" { format!("{CPU_ADAPTER}{}", self.cpu) } else { String::new() };
                format!("{backend}:{} ({}){on}", a.name, gib(a.memory_bytes))
            }
            // The CPU's memory, or the unified memory an Apple GPU shares with it.
            other => format!("{other}:{}", host(self.cpu.clone())),
        };
        match memory_limit {
            Some(limit) => format!("{base} limit {limit}"),
            None => base,
        }
    }

    /// The GPU `backend` allocates from and its memory in bytes, when the harness knows
    /// them: the first GPU nvidia-smi lists and its `memory.total`, on `cuda`; `None` for
    /// the CPU, whose limit the engine prices itself, and for the host execution.
    pub fn device_memory(&self, backend: &str) -> Option<(&str, u64)> {
        if let Some(a) = self.adapter_of(backend) {
            return Some((a.name.as_str(), a.memory_bytes));
        }
        if !self.on_gpu(backend) {
            return None;
        }
        Some((self.gpus[0].as_str(), self.gpu_memory_bytes?))
    }

    /// The rows' `driver_version` and `cuda_version` for `backend`: the NVIDIA driver's
    /// and the CUDA version it supports when `backend` runs on a GPU, both empty
    /// otherwise (the CPU, Metal, or the host execution of the CUDA kernels).
    pub fn gpu_software(&self, backend: &str) -> (String, String) {
        if let Some(a) = self.adapter_of(backend) {
            return (a.driver_info.clone(), String::new());
        }
        if !self.on_gpu(backend) {
            return (String::new(), String::new());
        }
        (self.driver_version.clone().unwrap_or_default(), self.cuda_version.clone().unwrap_or_default())
    }
}

/// The line every summary of figures measured on `device` carries when that device is the
/// CUDA kernels' host execution (`cuda:host execution on CPU (memory)`, what
/// [`Machine::device`] says under `KILN_CUDA_EMULATE`) or a wgpu adapter on the CPU
/// (lavapipe: `vulkan:llvmpipe (...) (2 GiB), a CPU device on CPU`), so no figure of
/// either is read as a GPU's; `None` for any other device.
pub fn host_execution_note(device: &str) -> Option<String> {
    if let Some(on) = device.strip_prefix("cuda:host execution on ") {
        return Some(format!(
            "figures are the CUDA kernels' host execution on {on}, not a GPU (KILN_CUDA_EMULATE=1)"
        ));
    }
    let (backend, rest) = device.split_once(':')?;
    let (adapter, cpu) = rest.split_once(CPU_ADAPTER)?;
    let cpu = cpu.split_once(" limit ").map_or(cpu, |(c, _)| c);
    Some(format!("figures are {adapter}, a {backend} driver running on the CPU ({cpu}), not a GPU"))
}

/// What [`Machine::device`] puts between a CPU adapter's name and the CPU's.
const CPU_ADAPTER: &str = ", a CPU device on ";

/// The [`host_execution_note`] lines of `devices` (each device once, in order), each
/// ending in a newline; empty when none is the host execution.
pub fn host_execution_notes<'a>(devices: impl IntoIterator<Item = &'a str>) -> String {
    let mut seen: Vec<&str> = Vec::new();
    let mut s = String::new();
    for d in devices {
        if seen.contains(&d) {
            continue;
        }
        seen.push(d);
        if let Some(note) = host_execution_note(d) {
            s.push_str(&note);
            s.push('\n');
        }
    }
    s
}

/// Whether `KILN_CUDA_EMULATE`'s value asks for the host execution, by the protocol's
/// rule, the one the engine applies (it exits 2 on a bad value, so a sweep refuses it
/// before anything runs).
pub use kiln_protocol::cuda_emulation;

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

/// Asks `nvidia_smi` for the GPUs ([`GPU_QUERY`]) and, from its plain table's header, the
/// CUDA version. `None` when it cannot be run or the query fails: no driver answers.
pub fn nvidia_facts(nvidia_smi: &OsStr) -> Option<NvidiaFacts> {
    let run = |args: &[&str]| {
        Command::new(nvidia_smi)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
    };
    let query = run(&GPU_QUERY)?;
    let mut facts = parse_gpu_query(&query);
    facts.cuda_version = run(&[]).as_deref().and_then(parse_cuda_version);
    Some(facts)
}

/// The GPUs of [`GPU_QUERY`]'s answer, one `name, memory, driver` line each (a name
/// holding a comma keeps it: the last two fields are split off). Lines that are not
/// such a triple are left out.
pub fn parse_gpu_query(text: &str) -> NvidiaFacts {
    let mut facts = NvidiaFacts::default();
    for line in text.lines() {
        let mut fields = line.rsplitn(3, ',').map(str::trim);
        let (Some(driver), Some(mem), Some(name)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        if name.is_empty() || mem.is_empty() {
            continue;
        }
        if facts.gpus.is_empty() {
            facts.gpu_memory_bytes = mib_bytes(mem);
            facts.driver_version = Some(driver.to_string()).filter(|d| !d.is_empty());
        }
        facts.gpus.push(format!("{name} ({mem})"));
    }
    facts
}

/// `143771 MiB` in bytes; `None` for anything else (`[N/A]`).
fn mib_bytes(mem: &str) -> Option<u64> {
    let n: u64 = mem.strip_suffix("MiB")?.trim().parse().ok()?;
    n.checked_mul(1 << 20)
}

/// `13.0` from the `CUDA Version: 13.0` of plain nvidia-smi's header.
pub fn parse_cuda_version(text: &str) -> Option<String> {
    let (_, rest) = text.split_once("CUDA Version:")?;
    let v = rest.split_whitespace().next()?.trim_end_matches('|');
    (!v.is_empty() && v.chars().all(|c| c.is_ascii_digit() || c == '.')).then(|| v.to_string())
}

/// The short commit of the tree at `root`, with `-dirty` when a tracked file differs
/// from it (untracked files, such as earlier result CSVs, do not count). `unknown`
/// outside a git checkout.
pub fn commit(root: &Path) -> String {
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
pub(crate) mod tests {
    use super::*;

    /// nvidia-smi's answers for an H200 host (driver 580.95.05, CUDA 13.0), in the layout
    /// nvidia-smi 580 prints (see the fixtures' README for where they come from).
    const H200_QUERY: &str = include_str!("fixtures/nvidia-smi/h200-query.csv");
    const H200_TABLE: &str = include_str!("fixtures/nvidia-smi/h200.txt");

    fn machine() -> Machine {
        Machine {
            host: "h".into(),
            cpu: "Some CPU".into(),
            cpus: 2,
            memory_bytes: Some(24 << 30),
            gpus: vec!["NVIDIA H200 (143771 MiB)".into()],
            gpu_memory_bytes: Some(143771 << 20),
            driver_version: Some("580.95.05".into()),
            cuda_version: Some("13.0".into()),
            nvidia_driver: true,
            cuda_emulated: false,
            os: "linux".into(),
            adapter: None,
        }
    }

    fn lavapipe() -> DeviceDesc {
        DeviceDesc {
            name: "llvmpipe (LLVM 15.0.6, 256 bits)".into(),
            backend: "vulkan".into(),
            driver: "llvmpipe".into(),
            driver_info: "Mesa 22.3.6 (LLVM 15.0.6)".into(),
            device_type: "Cpu".into(),
            memory_bytes: 2 << 30,
            memory_source: "the Vulkan device-local heap".into(),
        }
    }

    #[test]
    fn a_wgpu_adapter_is_the_rows_device_its_memory_the_budget_and_a_cpu_one_says_so() {
        let before = machine();
        // Before the engine is asked, nothing is claimed for the adapter.
        assert_eq!(before.device_memory("vulkan"), None);
        assert!(!before.on_device("vulkan"));
        let m = Machine { adapter: Some(lavapipe()), ..machine() };
        let d = m.device("vulkan", None);
        assert_eq!(d, "vulkan:llvmpipe (LLVM 15.0.6, 256 bits) (2 GiB), a CPU device on Some CPU");
        assert_eq!(m.device_memory("vulkan"), Some(("llvmpipe (LLVM 15.0.6, 256 bits)", 2 << 30)));
        assert_eq!(m.gpu_software("vulkan"), ("Mesa 22.3.6 (LLVM 15.0.6)".into(), String::new()));
        assert!(!m.on_device("vulkan"), "lavapipe gets the CPU's ladder");
        let note = "figures are llvmpipe (LLVM 15.0.6, 256 bits) (2 GiB), a vulkan driver running on the CPU (Some CPU), not a GPU";
        assert_eq!(host_execution_note(&d).as_deref(), Some(note));
        assert_eq!(host_execution_note(&m.device("vulkan", Some("1MiB"))).as_deref(), Some(note));
        // The adapter is the vulkan backend's only: metal and cpu rows are unchanged.
        assert_eq!(m.device("metal", None), "metal:Some CPU (24 GiB)");
        assert_eq!(m.device("cpu", None), "cpu:Some CPU (24 GiB)");
        // A GPU adapter is named alone, with its memory, and is a device.
        let gpu = DeviceDesc {
            name: "AMD Radeon RX 7900 XTX".into(),
            device_type: "DiscreteGpu".into(),
            memory_bytes: 24 << 30,
            ..lavapipe()
        };
        let m = Machine { adapter: Some(gpu), ..machine() };
        assert_eq!(m.device("vulkan", Some("4GiB")), "vulkan:AMD Radeon RX 7900 XTX (24 GiB) limit 4GiB");
        assert_eq!(host_execution_note(&m.device("vulkan", None)), None);
        assert!(m.on_device("vulkan"));
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
    fn the_host_execution_is_never_named_as_the_gpu() {
        let m = Machine { cuda_emulated: true, ..machine() };
        assert_eq!(m.device("cuda", None), "cuda:host execution on Some CPU (24 GiB)");
        assert_eq!(m.device("cuda", Some("1GiB")), "cuda:host execution on Some CPU (24 GiB) limit 1GiB");
        assert_eq!(m.gpu_software("cuda"), (String::new(), String::new()));
        assert_eq!(m.device_memory("cuda"), None);
        assert!(!m.on_device("cuda") && machine().on_device("cuda") && !machine().on_device("cpu"));
        // Every summary of its figures says whose they are.
        assert_eq!(
            host_execution_note(&m.device("cuda", None)).as_deref(),
            Some(
                "figures are the CUDA kernels' host execution on Some CPU (24 GiB), not a GPU (KILN_CUDA_EMULATE=1)"
            )
        );
        assert_eq!(host_execution_note(&machine().device("cuda", None)), None);
        assert_eq!(host_execution_note(&m.device("cpu", None)), None);
        let emulated = m.device("cuda", None);
        assert_eq!(
            host_execution_notes(["cpu:x", emulated.as_str(), emulated.as_str()]).lines().count(),
            1,
            "one line per device"
        );
        assert_eq!(host_execution_notes(["cpu:x"]), "");
        // The CPU backend is the CPU either way.
        assert_eq!(m.device("cpu", None), "cpu:Some CPU (24 GiB)");
        // Without a GPU, emulated or not, cuda is the host's.
        let none = Machine { gpus: Vec::new(), cuda_emulated: true, ..machine() };
        assert_eq!(none.device("cuda", None), "cuda:host execution on Some CPU (24 GiB)");
        assert_eq!(cuda_emulation(Some(OsStr::new("1"))), Ok(true));
        assert_eq!(cuda_emulation(Some(OsStr::new("0"))), Ok(false));
        assert_eq!(cuda_emulation(Some(OsStr::new(""))), Ok(false));
        assert_eq!(cuda_emulation(None), Ok(false));
        assert_eq!(
            cuda_emulation(Some(OsStr::new("yes"))),
            Err("invalid KILN_CUDA_EMULATE \"yes\": accepted values are 0 and 1".to_string())
        );
    }

    #[test]
    fn the_gpu_software_is_the_drivers_on_cuda_only() {
        let m = machine();
        assert_eq!(m.gpu_software("cuda"), ("580.95.05".to_string(), "13.0".to_string()));
        assert_eq!(m.gpu_software("cpu"), (String::new(), String::new()));
        assert_eq!(m.device_memory("cuda"), Some(("NVIDIA H200 (143771 MiB)", 143771 << 20)));
        assert_eq!(m.device_memory("cpu"), None);
        assert_eq!(Machine { gpu_memory_bytes: None, ..machine() }.device_memory("cuda"), None);
    }

    #[test]
    fn nvidia_smi_answers_are_parsed() {
        let f = parse_gpu_query(H200_QUERY);
        assert_eq!(f.gpus, ["NVIDIA H200 (143771 MiB)"]);
        assert_eq!(f.gpu_memory_bytes, Some(143771 * 1024 * 1024));
        assert_eq!(f.driver_version.as_deref(), Some("580.95.05"));
        assert_eq!(parse_cuda_version(H200_TABLE).as_deref(), Some("13.0"));
        // Several GPUs: the first one's memory and driver; a name with a comma stays whole.
        let two = parse_gpu_query("NVIDIA A100-SXM4-80GB, 81920 MiB, 535.54.03\nA, B, 4096 MiB, 535.54.03\n");
        assert_eq!(two.gpus, ["NVIDIA A100-SXM4-80GB (81920 MiB)", "A, B (4096 MiB)"]);
        assert_eq!(two.gpu_memory_bytes, Some(81920 << 20));
        // Unknown memory and no header are unknowns, not errors.
        assert_eq!(parse_gpu_query("X, [N/A], 1.2\n").gpu_memory_bytes, None);
        assert_eq!(parse_gpu_query("garbage\n"), NvidiaFacts::default());
        assert_eq!(parse_cuda_version("NVIDIA-SMI has failed"), None);
        assert_eq!(parse_cuda_version("| CUDA Version: N/A |"), None);
    }

    /// A stand-in nvidia-smi in `dir` that prints the recorded H200 answers.
    pub(crate) fn fake_nvidia_smi(dir: &Path) -> std::path::PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let query = dir.join("query.csv");
        let table = dir.join("table.txt");
        fs::write(&query, H200_QUERY).unwrap();
        fs::write(&table, H200_TABLE).unwrap();
        let path = dir.join("nvidia-smi");
        let script = format!(
            "#!/bin/sh\ncase \"$1\" in\n  --query-gpu=name,memory.total,driver_version) cat '{}' ;;\n  '') cat '{}' ;;\n  *) exit 6 ;;\nesac\n",
            query.display(),
            table.display()
        );
        fs::write(&path, script).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[test]
    fn a_fake_nvidia_smi_is_run_and_read() {
        let dir = tempfile::tempdir().unwrap();
        let smi = fake_nvidia_smi(dir.path());
        let f = nvidia_facts(smi.as_os_str()).expect("the fake answered");
        assert_eq!(f.gpus, ["NVIDIA H200 (143771 MiB)"]);
        assert_eq!(f.driver_version.as_deref(), Some("580.95.05"));
        assert_eq!(f.cuda_version.as_deref(), Some("13.0"));
        let m = Machine::probe_with(smi.as_os_str());
        assert!(m.nvidia_driver, "an answering nvidia-smi is a driver");
        assert_eq!(m.gpu_memory_bytes, Some(143771 << 20));
        // No nvidia-smi: no GPU facts, and no driver unless /proc says so.
        assert_eq!(nvidia_facts(dir.path().join("missing").as_os_str()), None);
        let m = Machine::probe_with(dir.path().join("missing").as_os_str());
        assert!(m.gpus.is_empty() && m.driver_version.is_none() && m.cuda_version.is_none());
    }

    #[test]
    fn probing_this_machine_and_tree_works() {
        let m = Machine::probe();
        assert!(!m.host.is_empty() && m.cpus >= 1);
        let c = commit(Path::new(env!("CARGO_MANIFEST_DIR")));
        assert!(c == "unknown" || c.chars().take(7).all(|ch| ch.is_ascii_hexdigit()), "{c}");
        assert!(commit(Path::new("/")).eq("unknown"));
    }
}
