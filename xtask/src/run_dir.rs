//! What every run directory holds and how it is made: a fresh
//! `benchmarks/runs/<stamp>-<command>` claimed atomically, the machine fingerprint
//! every `env.json` carries, and the `kiln` binary a server-driving task boots (with
//! [`BootArgs`], the flags that choose it and the run directory).

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{Value, json};

use crate::child::Shutdown;
use crate::kiln_build::{self, Backend, BackendArg, BackendFeatures, EnginePackage};
use crate::machine::{self, Machine};

/// The flags every task that boots `kiln serve` takes: extra server arguments, the
/// binary, and where run directories go.
#[derive(clap::Args, Debug)]
pub struct BootArgs {
    /// An extra argument for every kiln serve boot (repeatable), e.g. --serve-arg=--prefill-chunk=512.
    #[arg(long = "serve-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub serve_args: Vec<String>,
    /// The kiln binary to boot instead of building one (also KILN_BENCH_KILN_BIN).
    #[arg(long, value_name = "PATH")]
    pub kiln_bin: Option<PathBuf>,
    /// Do not build kiln; boot the release binary already built.
    #[arg(long)]
    pub no_build: bool,
    /// Where run directories go [default: benchmarks/runs].
    #[arg(long, value_name = "DIR")]
    runs_dir: Option<PathBuf>,
}

impl BootArgs {
    /// The kiln binary to boot, as [`engine`] finds or builds it.
    pub fn engine(&self, root: &Path, shutdown: &Shutdown) -> Result<Result<Engine, i32>> {
        engine(root, self.kiln_bin.as_deref(), self.no_build, shutdown)
    }

    /// `--runs-dir`, or `benchmarks/runs` under `root`.
    pub fn runs_dir(&self, root: &Path) -> Result<PathBuf> {
        match &self.runs_dir {
            Some(d) => crate::args::user_path(d),
            None => Ok(root.join("benchmarks/runs")),
        }
    }
}

/// Claims `runs_dir/<UTC stamp>-<command>[-N]`. `create_dir` claims the name atomically,
/// so two runs started in the same second get two directories.
pub fn create_run_dir(runs_dir: &Path, command: &str) -> Result<PathBuf> {
    check_dir_flag(runs_dir, "--runs-dir (--shared-dir for a Slurm run)", "run directories")?;
    fs::create_dir_all(runs_dir).with_context(|| {
        format!("creating --runs-dir (--shared-dir for a Slurm run) {}", runs_dir.display())
    })?;
    let stamp = chrono::Utc::now().format("%Y%m%dT%H%M%SZ");
    for i in 0..1000 {
        let suffix = if i == 0 { String::new() } else { format!("-{i}") };
        let dir = runs_dir.join(format!("{stamp}-{command}{suffix}"));
        match fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("creating {}", dir.display())),
        }
    }
    anyhow::bail!("no free run directory name in {}", runs_dir.display())
}

/// The engine binary a task drives and what is known of its build.
#[derive(Clone, Debug)]
pub struct Engine {
    /// The binary.
    pub bin: PathBuf,
    /// Its backend.
    pub backend: Backend,
    /// Build features, `None` for a binary the harness did not build.
    pub features: Option<Vec<String>>,
    /// The package version, when read.
    pub version: String,
}

/// `--kiln-bin` (or `KILN_BENCH_KILN_BIN`) when given, checked to exist; otherwise the
/// release build (built unless `no_build`). `Ok(Err(signal))` when a signal ended the build.
pub fn engine(
    root: &Path,
    kiln_bin: Option<&Path>,
    no_build: bool,
    shutdown: &Shutdown,
) -> Result<Result<Engine, i32>> {
    let given = kiln_bin
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os("KILN_BENCH_KILN_BIN").filter(|v| !v.is_empty()).map(PathBuf::from));
    let version = EnginePackage::read(root).map(|p| p.version).unwrap_or_default();
    if let Some(bin) = given {
        let bin = crate::args::user_path(&bin)?;
        if !bin.is_file() {
            crate::console::usage!(
                "--kiln-bin (or KILN_BENCH_KILN_BIN) {}: no such file: expected a built kiln binary",
                bin.display()
            );
        }
        return Ok(Ok(Engine { bin, backend: Backend::Cpu, features: None, version }));
    }
    let pkg = EnginePackage::read(root)?;
    let choice = kiln_build::choose_for(&Machine::probe(), BackendArg::Auto, &pkg)?;
    if let Some(note) = &choice.note {
        eprintln!("note: {note}");
    }
    if !no_build && let Some(sig) = kiln_build::build_release(root, choice.backend, shutdown)? {
        return Ok(Err(sig));
    }
    let bin = pkg.binary("release");
    if !bin.is_file() {
        anyhow::bail!("no kiln binary at {}: run without --no-build to build it", bin.display());
    }
    Ok(Ok(Engine { bin, backend: choice.backend, features: Some(choice.backend.features()), version }))
}

/// The fingerprint every env.json carries (the same keys as the sweeps' env.json):
/// command line, time, commit, build, machine, device and the inherited `KILN_*`.
pub fn fingerprint(root: &Path, engine: Option<&Engine>) -> (Value, String) {
    let m = Machine::probe();
    let backend = engine.map_or("cpu", |e| e.backend.as_str());
    let kiln_env = machine::kiln_env();
    let device = m.device(backend, kiln_env.get("KILN_MEMORY_LIMIT").map(String::as_str));
    let v = json!({
        "command": std::env::args().collect::<Vec<_>>(),
        "started": chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string(),
        "commit": machine::commit(root),
        "backend": backend,
        "features": engine.and_then(|e| e.features.clone()),
        "kiln_bin": engine.map(|e| e.bin.clone()),
        "kiln_version": engine.map(|e| e.version.clone()),
        "host": m.host,
        "os": m.os,
        "cpu": m.cpu,
        "cpus": m.cpus,
        "memory_bytes": m.memory_bytes,
        "gpus": m.gpus,
        "driver_version": m.driver_version,
        "cuda_version": m.cuda_version,
        "device": device,
        "kiln_env": kiln_env,
    });
    (v, device)
}

/// Writes `value` as `dir/env.json`.
pub fn write_env_json(dir: &Path, value: &Value) -> Result<()> {
    let path = dir.join("env.json");
    fs::write(&path, serde_json::to_string_pretty(value)? + "\n")
        .with_context(|| format!("writing {}", path.display()))
}

/// Refuses `dir`, which `flag` named as a directory to hold `what`, when it or a directory
/// above it is something else (a file, or a link to one): a usage error naming the flag,
/// instead of the bare "File exists" of mkdir. Creates nothing, so a task calls it before
/// it creates anything.
pub fn check_dir_flag(dir: &Path, flag: &str, what: &str) -> Result<()> {
    refuse_a_non_directory(dir, dir, flag, &format!("a directory to hold {what}"))
}

/// Same for `file`, which `flag` named as a file to write: the directories above it.
pub fn check_file_flag(file: &Path, flag: &str) -> Result<()> {
    let dir = file.parent().unwrap_or(Path::new(""));
    refuse_a_non_directory(file, dir, flag, "a file in a directory")
}

fn refuse_a_non_directory(given: &Path, dir: &Path, flag: &str, expected: &str) -> Result<()> {
    if let Some(bad) = dir.ancestors().find(|a| a.exists() && !a.is_dir()) {
        crate::console::usage!(
            "{flag} {}: {} is not a directory: expected {expected}",
            given.display(),
            bad.display()
        );
    }
    Ok(())
}

/// Checks that `dir` exists (creating it) and takes a file: before anything is measured.
pub fn check_writable(dir: &Path, what: &str) -> Result<()> {
    if let Err(e) = fs::create_dir_all(dir) {
        crate::console::usage!("{what} {}: cannot create it: {e}", dir.display());
    }
    let probe = dir.join(format!(".kiln-write-check-{}", std::process::id()));
    if let Err(e) = fs::write(&probe, b"") {
        crate::console::usage!("{what} {}: not writable: {e}", dir.display());
    }
    let _ = fs::remove_file(probe);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_directories_are_never_shared() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        fs::write(&file, "").unwrap();
        for bad in [file.clone(), file.join("below")] {
            let e = create_run_dir(&bad, "serve-bench").unwrap_err();
            assert!(e.downcast_ref::<crate::console::UsageError>().is_some(), "{e:#}");
            let e = e.to_string();
            assert!(e.contains("--runs-dir") && e.contains("a-file is not a directory"), "{e}");
        }
        let a = create_run_dir(dir.path(), "serve-bench").unwrap();
        let b = create_run_dir(dir.path(), "serve-bench").unwrap();
        assert_ne!(a, b);
        assert!(a.file_name().unwrap().to_string_lossy().ends_with("-serve-bench"));
        let (fp, device) = fingerprint(dir.path(), None);
        assert_eq!(fp["device"], device);
        assert_eq!(fp["commit"], "unknown");
        check_writable(&dir.path().join("new/deeper"), "--runs-dir").unwrap();
    }
}
