//! Before a `--features cuda` build: finds the CUDA toolkit by kiln-cuda's own rule
//! (`crates/kiln-cuda/toolkit.rs`, included here, so the harness and the build script
//! cannot disagree) and, where none exists, creates the pinned venv that rule then finds,
//! saying so. A GPU host with a driver and no toolkit, or a toolkit in `/usr/local/cuda`,
//! builds the cuda engine with no manual step.

use std::ffi::{OsStr, OsString};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::child::{self, Shutdown, Waited};

#[path = "../../crates/kiln-cuda/toolkit.rs"]
#[allow(dead_code)]
mod rule;

/// How long pip gets to end on a signal before its group is killed.
const GRACE: Duration = Duration::from_secs(5);

/// What [`ensure`] did.
#[derive(Debug, PartialEq)]
pub enum Found {
    /// A toolkit was there: how it was found.
    There(String),
    /// The venv was created and holds it.
    Created(String),
    /// A signal stopped the venv's creation.
    Interrupted(i32),
}

/// Makes sure the build will find a toolkit, with this process's environment, the system
/// roots and `python3` from PATH.
pub fn ensure(root: &Path, shutdown: &Shutdown) -> Result<Found> {
    let system: Vec<&Path> = rule::SYSTEM_ROOTS.iter().map(Path::new).collect();
    ensure_with(root, &|n| std::env::var_os(n), &system, OsStr::new("python3"), shutdown)
}

/// [`ensure`] with what it reads given: `var` the environment, `system` the last-resort
/// toolkit roots, `python` the interpreter that creates the venv.
pub fn ensure_with(
    root: &Path,
    var: &dyn Fn(&str) -> Option<OsString>,
    system: &[&Path],
    python: &OsStr,
    shutdown: &Shutdown,
) -> Result<Found> {
    let why = match rule::find_in(var, root, system) {
        Ok(t) => return Ok(Found::There(t.from)),
        Err(e) => e,
    };
    if var("KILN_CUDA_HOME").is_some_and(|v| !v.is_empty()) {
        // The user named the toolkit: never replace their choice with a download.
        bail!("{why}");
    }
    let venv = root.join(rule::VENV);
    let requirements = root.join(rule::REQUIREMENTS);
    eprintln!(
        "no CUDA toolkit on this machine for the cuda build ({why}).\ncreating the pinned venv {} with \
         NVRTC and ptxas from PyPI ({}, about 130 MB); kiln-cuda's build finds it there from now on",
        venv.display(),
        requirements.display()
    );
    let steps: [(OsString, Vec<OsString>); 2] = [
        (python.to_owned(), vec!["-m".into(), "venv".into(), venv.clone().into_os_string()]),
        (
            venv.join("bin/pip").into_os_string(),
            vec![
                "install".into(),
                "--disable-pip-version-check".into(),
                "-r".into(),
                requirements.clone().into_os_string(),
            ],
        ),
    ];
    for (program, args) in steps {
        let mut cmd = Command::new(&program);
        cmd.args(&args).current_dir(root);
        let shown = format!(
            "{} {}",
            program.to_string_lossy(),
            args.iter().map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" ")
        );
        let owned = child::spawn(&mut cmd).with_context(|| format!("running {shown}"))?;
        match owned.wait(shutdown, None, GRACE)? {
            Waited::Exited(st) if st.success() => {}
            Waited::Exited(st) => bail!(
                "creating the CUDA toolkit venv failed: `{shown}` exited with {st}; install the CUDA toolkit or \
                 point CUDA_HOME or KILN_CUDA_HOME at one"
            ),
            Waited::Interrupted(sig) => return Ok(Found::Interrupted(sig)),
            Waited::TimedOut => bail!("`{shown}` timed out"),
        }
    }
    match rule::find_in(var, root, system) {
        Ok(t) => Ok(Found::Created(t.from)),
        Err(e) => bail!(
            "the venv {} was created but the build would still not find the toolkit: {e}",
            venv.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn executable(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// A `python3` whose `-m venv DIR` makes a venv whose pip "installs" the two wheels'
    /// files, logging every call to `log`.
    fn fake_python(dir: &Path, log: &Path) -> std::path::PathBuf {
        let py = dir.join("python3");
        let pip = format!(
            "#!/bin/sh\necho \"pip $*\" >> '{log}'\nsp=\"$(dirname \"$0\")/../lib/python3.11/site-packages/nvidia\"\n\
             mkdir -p \"$sp/cuda_nvrtc/lib\" \"$sp/cuda_nvcc/bin\"\ntouch \"$sp/cuda_nvrtc/lib/libnvrtc.so.12\" \"$sp/cuda_nvcc/bin/ptxas\"\n",
            log = log.display()
        );
        let pip_path = dir.join("pip-template");
        std::fs::write(&pip_path, pip).unwrap();
        executable(
            &py,
            &format!(
                "#!/bin/sh\necho \"python $*\" >> '{log}'\n[ \"$1 $2\" = \"-m venv\" ] || exit 9\nmkdir -p \"$3/bin\"\n\
                 cp '{tpl}' \"$3/bin/pip\"\nchmod +x \"$3/bin/pip\"\n",
                log = log.display(),
                tpl = pip_path.display()
            ),
        );
        py
    }

    fn no_vars(_: &str) -> Option<OsString> {
        None
    }

    #[test]
    fn with_no_toolkit_anywhere_the_pinned_venv_is_created_then_found() {
        let root = tempfile::tempdir().unwrap();
        let tools = tempfile::tempdir().unwrap();
        let log = tools.path().join("log");
        let py = fake_python(tools.path(), &log);
        std::fs::create_dir_all(root.path().join("scripts/cuda")).unwrap();
        std::fs::write(root.path().join(rule::REQUIREMENTS), "nvidia-cuda-nvrtc-cu12==12.9.86\n").unwrap();
        let sd = Shutdown::install().unwrap();
        let empty = root.path().join("no-system-cuda");
        let got = ensure_with(root.path(), &no_vars, &[&empty], py.as_os_str(), &sd).unwrap();
        let Found::Created(from) = got else { panic!("{got:?}") };
        assert!(from.contains("target/ci-cuda-venv"), "{from}");
        let calls = std::fs::read_to_string(&log).unwrap();
        assert!(
            calls.starts_with("python -m venv ")
                && calls.contains("pip install --disable-pip-version-check -r "),
            "{calls}"
        );
        // The second time the venv is there: nothing is run.
        std::fs::remove_file(&log).unwrap();
        let again = ensure_with(root.path(), &no_vars, &[&empty], py.as_os_str(), &sd).unwrap();
        assert!(matches!(again, Found::There(_)), "{again:?}");
        assert!(!log.exists(), "nothing ran the second time");
    }

    #[test]
    fn a_system_toolkit_is_used_as_it_is_and_cuda_home_comes_first() {
        let root = tempfile::tempdir().unwrap();
        let sys = tempfile::tempdir().unwrap();
        for f in ["bin/ptxas", "lib64/libnvrtc.so.13"] {
            executable(&sys.path().join(f), "");
        }
        let sd = Shutdown::install().unwrap();
        let py = OsStr::new("/nonexistent/python3");
        let got = ensure_with(root.path(), &no_vars, &[sys.path()], py, &sd).unwrap();
        assert_eq!(got, Found::There(sys.path().display().to_string()));
        // CUDA_HOME and an nvcc on PATH are found the ecosystem's way.
        let home = sys.path().to_owned();
        let by_home = move |n: &str| (n == "CUDA_HOME").then(|| home.clone().into_os_string());
        let got = ensure_with(root.path(), &by_home, &[], py, &sd).unwrap();
        assert!(matches!(&got, Found::There(f) if f.starts_with("CUDA_HOME=")), "{got:?}");
        executable(&sys.path().join("bin/nvcc"), "");
        let path = sys.path().join("bin").into_os_string();
        let by_path = move |n: &str| (n == "PATH").then(|| path.clone());
        let got = ensure_with(root.path(), &by_path, &[], py, &sd).unwrap();
        assert!(matches!(&got, Found::There(f) if f.starts_with("the nvcc on PATH")), "{got:?}");
    }

    #[test]
    fn a_kiln_cuda_home_without_a_toolkit_is_an_error_never_a_download() {
        let root = tempfile::tempdir().unwrap();
        let sd = Shutdown::install().unwrap();
        let var = |n: &str| (n == "KILN_CUDA_HOME").then(|| OsString::from("/nonexistent/cuda"));
        let e = ensure_with(root.path(), &var, &[], OsStr::new("/nonexistent/python3"), &sd).unwrap_err();
        assert!(e.to_string().contains("KILN_CUDA_HOME=/nonexistent/cuda holds no NVRTC"), "{e}");
    }
}
