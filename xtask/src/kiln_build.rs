//! Build integration: which backend this machine gets, which `kiln` features that takes
//! (read from the package with cargo_metadata), building `kiln` in release, and where the
//! binary is (cargo_metadata's target directory, never a hard-coded `target/`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use cargo_metadata::MetadataCommand;

use crate::child::{self, Shutdown, Waited};
use crate::machine::Machine;

/// `--backend`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendArg {
    /// Pick for this machine.
    Auto,
    /// The CPU backend (no feature).
    Cpu,
    /// NVIDIA GPUs (`cuda` feature).
    Cuda,
    /// Apple GPUs (`metal` feature).
    Metal,
    /// Vulkan GPUs through wgpu (`vulkan` feature); never chosen by `auto`.
    Vulkan,
}

/// A backend the engine is built for: the protocol's (`cpu`, `cuda`, `metal`, as the
/// reports' `backend` field says).
pub use kiln_protocol::Backend;

/// What building for a backend takes.
pub trait BackendFeatures {
    /// The features `kiln` is built with: the backend's name, except for the CPU.
    fn features(self) -> Vec<String>;
}

impl BackendFeatures for Backend {
    fn features(self) -> Vec<String> {
        match self {
            Backend::Cpu => Vec::new(),
            other => vec![other.as_str().to_string()],
        }
    }
}

/// The arguments that put a `kiln` engine command (`estimate`, `bench-decode`, `serve`,
/// `bench-expert-copy`, ...) on `backend`: none for the CPU, which is the engine's default
/// and all that a binary from before `--backend` knows (the older builds `bisect` and
/// `--kiln-bin` run), and `--backend NAME` for any other.
pub fn backend_args(backend: Backend) -> Vec<String> {
    match backend {
        Backend::Cpu => Vec::new(),
        other => vec!["--backend".to_string(), other.as_str().to_string()],
    }
}

/// [`backend_args`] unless `user_args` (the `--serve-arg`s a server-driving task passes
/// through) choose the backend themselves: `kiln serve` takes `--backend` once.
pub fn backend_args_unless_given(backend: Backend, user_args: &[String]) -> Vec<String> {
    if user_args.iter().any(|a| a == "--backend" || a.starts_with("--backend=")) {
        return Vec::new();
    }
    backend_args(backend)
}

/// The choice and, when the machine has a GPU kiln cannot use yet, the one line that says so.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendChoice {
    /// What the sweep uses.
    pub backend: Backend,
    /// Shown once on stderr.
    pub note: Option<String>,
}

/// Chooses the backend: CUDA on Linux with an NVIDIA driver, Metal on macOS, CPU otherwise,
/// each only when `kiln` declares the feature; an explicit request overrides.
pub fn choose_backend(
    requested: BackendArg,
    os: &str,
    nvidia_driver: bool,
    features: &BTreeSet<String>,
) -> Result<BackendChoice> {
    let declared = |b: Backend| features.contains(b.as_str());
    let explicit = |b: Backend| -> Result<BackendChoice> {
        if b == Backend::Cpu || declared(b) {
            return Ok(BackendChoice { backend: b, note: None });
        }
        let mut accepted = vec!["cpu"];
        accepted.extend(
            [Backend::Cuda, Backend::Metal, Backend::Vulkan]
                .into_iter()
                .filter(|&b| declared(b))
                .map(Backend::as_str),
        );
        bail!(
            "--backend {}: the kiln package declares no `{}` feature yet; accepted here: {}",
            b.as_str(),
            b.as_str(),
            accepted.join(", ")
        )
    };
    match requested {
        BackendArg::Cpu => explicit(Backend::Cpu),
        BackendArg::Cuda => explicit(Backend::Cuda),
        BackendArg::Metal => explicit(Backend::Metal),
        BackendArg::Vulkan => explicit(Backend::Vulkan),
        BackendArg::Auto => {
            let gpu = match os {
                "linux" if nvidia_driver => Some((Backend::Cuda, "an NVIDIA GPU")),
                "macos" => Some((Backend::Metal, "an Apple GPU")),
                _ => None,
            };
            Ok(match gpu {
                Some((b, what)) if declared(b) => BackendChoice {
                    backend: b,
                    note: Some(format!(
                        "this machine has {what}: using the {} backend (--backend cpu measures the CPU)",
                        b.as_str()
                    )),
                },
                Some((b, what)) => BackendChoice {
                    backend: Backend::Cpu,
                    note: Some(format!(
                        "this machine has {what} but kiln declares no `{}` feature yet: using the CPU backend",
                        b.as_str()
                    )),
                },
                None => BackendChoice { backend: Backend::Cpu, note: None },
            })
        }
    }
}

/// What cargo_metadata says about the `kiln` package and the workspace.
#[derive(Clone, Debug)]
pub struct EnginePackage {
    /// Features the package declares (`default` excluded).
    pub features: BTreeSet<String>,
    /// Its version.
    pub version: String,
    /// The workspace's target directory.
    pub target_dir: PathBuf,
}

impl EnginePackage {
    /// Reads the workspace at `root`.
    pub fn read(root: &Path) -> Result<EnginePackage> {
        let meta = MetadataCommand::new()
            .manifest_path(root.join("Cargo.toml"))
            .no_deps()
            .exec()
            .context("reading the workspace with cargo metadata")?;
        let pkg = meta
            .workspace_packages()
            .into_iter()
            .find(|p| p.name.as_str() == "kiln")
            .context("the workspace has no `kiln` package")?;
        Ok(EnginePackage {
            features: pkg.features.keys().filter(|f| f.as_str() != "default").cloned().collect(),
            version: pkg.version.to_string(),
            target_dir: meta.target_directory.into_std_path_buf(),
        })
    }

    /// The binary a `profile` build leaves.
    pub fn binary(&self, profile: &str) -> PathBuf {
        self.target_dir.join(profile).join(format!("kiln{}", std::env::consts::EXE_SUFFIX))
    }
}

/// How long cargo gets to end on SIGTERM before its group is killed.
const BUILD_GRACE: Duration = Duration::from_secs(5);

/// Builds `kiln` in release with `backend`'s features (for `cuda`, after making sure the
/// build will find a CUDA toolkit: [`crate::cuda_toolkit`]), with `$CARGO` (what `cargo xtask`
/// sets) or else the `cargo` on the PATH. The build runs in a process group of its own:
/// a SIGINT, SIGTERM or SIGHUP to the harness (the terminal's Ctrl-C included) stops cargo
/// and every rustc it started, not cargo alone. Returns the signal when interrupted.
pub fn build_release(root: &Path, backend: Backend, shutdown: &Shutdown) -> Result<Option<i32>> {
    if backend == Backend::Cuda {
        match crate::cuda_toolkit::ensure(root, shutdown)? {
            crate::cuda_toolkit::Found::There(from) | crate::cuda_toolkit::Found::Created(from) => {
                eprintln!("CUDA toolkit for the cuda build: {from}");
            }
            crate::cuda_toolkit::Found::Interrupted(sig) => return Ok(Some(sig)),
        }
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.current_dir(root).args(["build", "--release", "--package", "kiln"]);
    let features = backend.features();
    if !features.is_empty() {
        cmd.arg("--features").arg(features.join(","));
    }
    eprintln!("building kiln (release, backend {}): {cmd:?}", backend.as_str());
    if let Some(note) = EnginePackage::read(root).ok().and_then(|p| lock_held_note(&p.target_dir, "release"))
    {
        eprintln!("{note}");
    }
    let child = child::spawn(&mut cmd).with_context(|| format!("running {}", cargo.to_string_lossy()))?;
    match child.wait(shutdown, None, BUILD_GRACE)? {
        Waited::Exited(st) if st.success() => Ok(None),
        Waited::Exited(st) => bail!("building kiln failed ({st}); fix the build or pass --no-build"),
        Waited::Interrupted(sig) => Ok(Some(sig)),
        Waited::TimedOut => bail!("building kiln timed out"),
    }
}

/// The line to print when another cargo holds the build lock of `profile` under
/// `target_dir` (cargo's `.cargo-lock`, exclusive while a build, test or run writes
/// there): the build that follows waits for it, which would otherwise look like a hang.
/// `None` when the lock is free or was never taken.
fn lock_held_note(target_dir: &Path, profile: &str) -> Option<String> {
    use rustix::fs::{FlockOperation, flock};
    let dir = target_dir.join(profile);
    let file = std::fs::File::open(dir.join(".cargo-lock")).ok()?;
    // A shared lock conflicts only with cargo's exclusive one, and is released at once.
    match flock(&file, FlockOperation::NonBlockingLockShared) {
        Ok(()) => None,
        Err(e) if e == rustix::io::Errno::WOULDBLOCK => Some(format!(
            "waiting for another cargo: a build, test or run holds the lock on {} (the same target \
             directory); this build starts when it ends (a separate CARGO_TARGET_DIR avoids the wait)",
            dir.display()
        )),
        Err(_) => None,
    }
}

/// The machine's GPU facts `choose_backend` needs.
pub fn choose_for(machine: &Machine, requested: BackendArg, pkg: &EnginePackage) -> Result<BackendChoice> {
    choose_backend(requested, &machine.os, machine.nvidia_driver, &pkg.features)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feats(f: &[&str]) -> BTreeSet<String> {
        f.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn auto_picks_the_gpu_only_when_kiln_has_the_feature() {
        let c = choose_backend(BackendArg::Auto, "linux", true, &feats(&["cuda"])).unwrap();
        assert_eq!(c.backend, Backend::Cuda);
        assert_eq!(
            c.note.as_deref(),
            Some("this machine has an NVIDIA GPU: using the cuda backend (--backend cpu measures the CPU)")
        );
        let c = choose_backend(BackendArg::Auto, "linux", true, &feats(&[])).unwrap();
        assert_eq!(c.backend, Backend::Cpu);
        assert!(c.note.unwrap().contains("no `cuda` feature yet"));
        let c = choose_backend(BackendArg::Auto, "macos", false, &feats(&["metal"])).unwrap();
        assert_eq!(c.backend, Backend::Metal);
        assert_eq!(
            c.note.as_deref(),
            Some("this machine has an Apple GPU: using the metal backend (--backend cpu measures the CPU)"),
            "the harness says it picked the GPU"
        );
        let c = choose_backend(BackendArg::Auto, "macos", false, &feats(&["cuda"])).unwrap();
        assert_eq!(c.backend, Backend::Cpu);
        assert!(c.note.is_some());
        let c = choose_backend(BackendArg::Auto, "linux", false, &feats(&["cuda"])).unwrap();
        assert_eq!(c, BackendChoice { backend: Backend::Cpu, note: None });
    }

    #[test]
    fn an_explicit_backend_needs_its_feature() {
        assert_eq!(
            choose_backend(BackendArg::Cpu, "linux", true, &feats(&["cuda"])).unwrap().backend,
            Backend::Cpu
        );
        assert_eq!(
            choose_backend(BackendArg::Cuda, "linux", false, &feats(&["cuda"])).unwrap().backend,
            Backend::Cuda
        );
        let e = choose_backend(BackendArg::Metal, "linux", false, &feats(&["cuda"])).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--backend metal: the kiln package declares no `metal` feature yet; accepted here: cpu, cuda"
        );
        assert_eq!(Backend::Cuda.features(), ["cuda"]);
        assert!(Backend::Cpu.features().is_empty());
    }

    #[test]
    fn only_a_gpu_backend_adds_an_engine_argument() {
        assert!(backend_args(Backend::Cpu).is_empty(), "an older kiln knows no --backend");
        assert_eq!(backend_args(Backend::Cuda), ["--backend", "cuda"]);
        assert_eq!(backend_args(Backend::Metal), ["--backend", "metal"]);
        let given = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            backend_args_unless_given(Backend::Cuda, &given(&["--parallel", "4"])),
            ["--backend", "cuda"]
        );
        assert!(backend_args_unless_given(Backend::Cuda, &given(&["--backend=cpu"])).is_empty());
        assert!(backend_args_unless_given(Backend::Cuda, &given(&["--backend", "cpu"])).is_empty());
    }

    #[test]
    fn a_machine_whose_nvidia_smi_answers_gets_cuda_when_kiln_declares_it() {
        let dir = tempfile::tempdir().unwrap();
        let smi = crate::machine::tests::fake_nvidia_smi(dir.path());
        let machine = Machine::probe_with(smi.as_os_str());
        let pkg = |f: &[&str]| EnginePackage {
            features: feats(f),
            version: "0.1.0".into(),
            target_dir: dir.path().to_path_buf(),
        };
        let on_linux = std::env::consts::OS == "linux";
        let c = choose_for(&machine, BackendArg::Auto, &pkg(&["cuda"])).unwrap();
        if on_linux {
            assert_eq!(c.backend, Backend::Cuda);
            assert!(c.note.as_deref().is_some_and(|n| n.contains("using the cuda backend")));
            assert_eq!(c.backend.features(), ["cuda"], "the build takes --features cuda");
            assert_eq!(machine.device("cuda", None), "cuda:NVIDIA H200 (143771 MiB)");
        }
        // Without the feature, the GPU is said once and the CPU is used.
        let c = choose_for(&machine, BackendArg::Auto, &pkg(&[])).unwrap();
        assert_eq!(c.backend, Backend::Cpu);
        assert_eq!(c.note.is_some(), on_linux);
        // No nvidia-smi and no driver: the CPU, silently.
        let bare =
            Machine { nvidia_driver: false, ..Machine::probe_with(dir.path().join("none").as_os_str()) };
        assert_eq!(
            choose_for(&bare, BackendArg::Auto, &pkg(&["cuda"])).unwrap(),
            BackendChoice { backend: Backend::Cpu, note: None }
        );
    }

    #[test]
    fn the_kiln_package_is_found_through_cargo_metadata() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let pkg = EnginePackage::read(root).unwrap();
        assert!(!pkg.version.is_empty());
        assert!(pkg.binary("release").ends_with(format!("release/kiln{}", std::env::consts::EXE_SUFFIX)));
    }

    #[test]
    fn a_build_lock_held_by_another_cargo_is_named() {
        use rustix::fs::{FlockOperation, flock};
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(lock_held_note(dir.path(), "release"), None, "no lock file: no cargo built here");
        std::fs::create_dir_all(dir.path().join("release")).unwrap();
        let lock = dir.path().join("release/.cargo-lock");
        let held = std::fs::File::create(&lock).unwrap();
        assert_eq!(lock_held_note(dir.path(), "release"), None, "free");
        flock(&held, FlockOperation::LockExclusive).unwrap();
        let note = lock_held_note(dir.path(), "release").unwrap();
        assert!(note.starts_with("waiting for another cargo"), "{note}");
        assert!(note.contains(&dir.path().join("release").display().to_string()), "{note}");
        drop(held);
        assert_eq!(lock_held_note(dir.path(), "release"), None, "released");
    }
}
