//! Where the CUDA toolchain the `cuda` feature builds with is (NVRTC's library and
//! `ptxas`): the one rule, shared by kiln-cuda's build script and the harness, which
//! includes this file to know before a build whether the build will find one.
//!
//! The search, first match wins: `KILN_CUDA_HOME` (when set it is the answer, or an
//! error naming it); a toolkit root in `CUDA_HOME` or `CUDA_PATH`; the active venv
//! (`VIRTUAL_ENV`) or the workspace's `target/ci-cuda-venv` holding PyPI's
//! `nvidia-cuda-nvrtc-cu12` and `nvidia-cuda-nvcc-cu12` wheels; the toolkit around the
//! `nvcc` on `PATH`; `/usr/local/cuda`. A root is a toolkit when it holds both NVRTC
//! (`lib64/libnvrtc.so*`, or the wheels' `cuda_nvrtc/lib/libnvrtc.so.12`) and `ptxas`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Variables the search reads that a build script reruns on. `PATH` is read too but not
/// watched: it changes with every shell and venv, and a rerun recompiles every kernel.
pub const WATCHED: [&str; 4] = ["KILN_CUDA_HOME", "CUDA_HOME", "CUDA_PATH", "VIRTUAL_ENV"];

/// The system's usual toolkit root, searched last.
pub const SYSTEM_ROOTS: [&str; 1] = ["/usr/local/cuda"];

/// The venv the harness creates, relative to the workspace root, when no toolkit exists.
pub const VENV: &str = "target/ci-cuda-venv";

/// The pinned wheels' requirements file, relative to the workspace root.
pub const REQUIREMENTS: &str = "scripts/cuda/requirements.txt";

/// Where NVRTC and ptxas are, and which rule found them.
#[derive(Clone, Debug, PartialEq)]
pub struct Toolkit {
    /// NVRTC's shared library.
    pub nvrtc: PathBuf,
    /// The `ptxas` program.
    pub ptxas: PathBuf,
    /// How it was found, such as `CUDA_HOME=/usr/local/cuda-13.0`.
    pub from: String,
}

/// The toolkit under `home`, in any layout kiln builds with.
pub fn at(home: &Path) -> Option<(PathBuf, PathBuf)> {
    let ptxas = [home.join("bin/ptxas"), home.join("cuda_nvcc/bin/ptxas")];
    let nvrtc = [
        home.join("cuda_nvrtc/lib/libnvrtc.so.12"),
        home.join("lib64/libnvrtc.so"),
        home.join("lib64/libnvrtc.so.13"),
        home.join("lib64/libnvrtc.so.12"),
        home.join("targets/x86_64-linux/lib/libnvrtc.so"),
        home.join("targets/sbsa-linux/lib/libnvrtc.so"),
        home.join("lib/libnvrtc.so"),
    ];
    let p = ptxas.into_iter().find(|p| p.is_file())?;
    let n = nvrtc.into_iter().find(|n| n.is_file())?;
    Some((n, p))
}

/// The wheels' `nvidia` folder in a venv (`lib/python3.*/site-packages/nvidia`).
fn venv_nvidia(venv: &Path) -> Option<PathBuf> {
    let mut pys: Vec<PathBuf> =
        std::fs::read_dir(venv.join("lib")).ok()?.flatten().map(|e| e.path()).collect();
    pys.sort();
    pys.into_iter().map(|py| py.join("site-packages/nvidia")).find(|n| at(n).is_some())
}

/// Searches as the module's documentation says; `var` reads a variable (the build
/// script's environment, or a test's), `workspace` is the workspace root.
pub fn find(var: &dyn Fn(&str) -> Option<OsString>, workspace: &Path) -> Result<Toolkit, String> {
    let roots: Vec<&Path> = SYSTEM_ROOTS.iter().map(Path::new).collect();
    find_in(var, workspace, &roots)
}

/// [`find`] with the last resort's roots given.
pub fn find_in(
    var: &dyn Fn(&str) -> Option<OsString>,
    workspace: &Path,
    system: &[&Path],
) -> Result<Toolkit, String> {
    let set = |name: &str| var(name).filter(|v| !v.is_empty());
    let found = |(nvrtc, ptxas): (PathBuf, PathBuf), from: String| Toolkit { nvrtc, ptxas, from };
    if let Some(home) = set("KILN_CUDA_HOME") {
        let home = PathBuf::from(home);
        return at(&home).map(|t| found(t, format!("KILN_CUDA_HOME={}", home.display()))).ok_or_else(|| {
            format!(
                "KILN_CUDA_HOME={} holds no NVRTC library and ptxas: accepted are the `nvidia` directory of a \
                 venv's site-packages with the nvidia-cuda-nvrtc-cu12 and nvidia-cuda-nvcc-cu12 wheels, or a \
                 CUDA toolkit root (lib64/libnvrtc.so*, bin/ptxas)",
                home.display()
            )
        });
    }
    let mut looked = Vec::new();
    for name in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = set(name) {
            let home = PathBuf::from(home);
            if let Some(t) = at(&home) {
                return Ok(found(t, format!("{name}={}", home.display())));
            }
            looked.push(format!("{name}={}", home.display()));
        }
    }
    let mut venvs: Vec<(String, PathBuf)> = Vec::new();
    if let Some(v) = set("VIRTUAL_ENV") {
        venvs.push(("the active venv".into(), PathBuf::from(v)));
    }
    venvs.push((VENV.into(), workspace.join(VENV)));
    for (what, venv) in venvs {
        if let Some(n) = venv_nvidia(&venv) {
            return Ok(found(at(&n).expect("checked"), format!("{what} ({})", venv.display())));
        }
        looked.push(format!("{what} {}", venv.display()));
    }
    if let Some(path) = var("PATH") {
        for dir in std::env::split_paths(&path) {
            let nvcc = dir.join("nvcc");
            if nvcc.is_file()
                && let Some(root) = dir.parent()
            {
                if let Some(t) = at(root) {
                    return Ok(found(t, format!("the nvcc on PATH ({})", nvcc.display())));
                }
                looked.push(format!("the nvcc on PATH's toolkit {}", root.display()));
                break;
            }
        }
    }
    for root in system {
        if let Some(t) = at(root) {
            return Ok(found(t, root.display().to_string()));
        }
        looked.push(root.display().to_string());
    }
    Err(format!(
        "no CUDA toolkit (NVRTC and ptxas) found: looked in {}; install the CUDA toolkit, point CUDA_HOME \
         or KILN_CUDA_HOME at one, or create the pinned venv: python3 -m venv {VENV} && {VENV}/bin/pip \
         install -r {REQUIREMENTS}",
        looked.join(", ")
    ))
}
