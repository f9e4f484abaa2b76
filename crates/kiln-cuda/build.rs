//! Builds kiln-cuda's kernels: with `host-exec`, the CUDA C++ sources through the host C++
//! compiler and `kernels/host_shim.h` into a static library the tests run; with `cuda`,
//! each source to PTX with NVRTC and the PTX to cubin for sm_80 and sm_90 with ptxas,
//! written to OUT_DIR for `include_bytes!`. The toolkit is a system CUDA installation or
//! PyPI's wheels in a venv, found by `toolkit.rs`'s one rule (docs/cuda.md).

use std::env;
use std::path::{Path, PathBuf};

#[cfg(feature = "cuda")]
/// The kernel sources, each one module.
const KERNELS: [&str; 4] = ["qmv", "qmm", "elementwise", "attn"];

#[cfg(feature = "cuda")]
/// The machine code embedded beside the PTX.
const ARCHS: [&str; 2] = ["sm_80", "sm_90"];

/// The PTX's virtual architecture: the oldest one the cubins cover, so the driver can
/// compile it for any newer chip.
#[cfg(feature = "cuda")]
const PTX_ARCH: &str = "compute_80";

fn main() {
    let kernels =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR")).join("kernels");
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-changed=toolkit.rs");
    #[cfg(feature = "cuda")]
    for name in toolkit::WATCHED {
        println!("cargo:rerun-if-env-changed={name}");
    }
    if env::var_os("CARGO_FEATURE_HOST_EXEC").is_some() {
        build_host(&kernels);
    }
    if env::var_os("CARGO_FEATURE_CUDA").is_some() {
        build_device(&kernels);
    }
}

#[cfg(feature = "host-exec")]
fn build_host(kernels: &Path) {
    // One translation unit; no float contraction, so the host runs the kernels' exact
    // operations (common.cuh).
    cc::Build::new()
        .cpp(true)
        .file(kernels.join("host_exec.cpp"))
        .include(kernels)
        .std("c++17")
        .flag("-ffp-contract=off")
        .flag_if_supported("-Wno-unknown-pragmas")
        .warnings(true)
        .compile("kiln_cuda_host");
}

#[cfg(not(feature = "host-exec"))]
fn build_host(_: &Path) {}

#[cfg(feature = "cuda")]
fn build_device(kernels: &Path) {
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let workspace = manifest.parent().and_then(Path::parent).unwrap_or(&manifest);
    let toolkit = toolkit::find(&|name| env::var_os(name), workspace).unwrap_or_else(|e| panic!("{e}"));
    println!("cargo:rustc-env=KILN_CUDA_PTXAS={}", toolkit.ptxas.display());
    let lib = nvrtc::Nvrtc::open(&toolkit.nvrtc).unwrap_or_else(|e| panic!("{e}"));
    for name in KERNELS {
        let src_path = kernels.join(format!("{name}.cu"));
        let src = std::fs::read_to_string(&src_path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", src_path.display()));
        let include = format!("--include-path={}", kernels.display());
        let arch = format!("--gpu-architecture={PTX_ARCH}");
        let opts = [arch.as_str(), "--fmad=false", "--std=c++17", include.as_str()];
        let ptx = lib.compile(&src, &format!("{name}.cu"), &opts).unwrap_or_else(|e| panic!("{e}"));
        let ptx_path = out.join(format!("{name}.ptx"));
        std::fs::write(&ptx_path, &ptx)
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", ptx_path.display()));
        for sm in ARCHS {
            let cubin = out.join(format!("{name}.{sm}.cubin"));
            let status = std::process::Command::new(&toolkit.ptxas)
                .arg(format!("-arch={sm}"))
                .arg("-O3")
                .arg(&ptx_path)
                .arg("-o")
                .arg(&cubin)
                .status()
                .unwrap_or_else(|e| panic!("cannot run {}: {e}", toolkit.ptxas.display()));
            assert!(status.success(), "ptxas -arch={sm} failed on {} ({status})", ptx_path.display());
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn build_device(_: &Path) {}

#[cfg(feature = "cuda")]
#[path = "toolkit.rs"]
mod toolkit;

/// NVRTC, opened from the wheel's `libnvrtc.so.12` by path (a build script cannot
/// change the loader's search path for itself), and the toolkit's files.
#[cfg(feature = "cuda")]
mod nvrtc {
    use std::ffi::{CStr, CString, c_char, c_int, c_void};
    use std::path::Path;

    type Program = *mut c_void;
    type CreateFn = unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int;
    type CompileFn = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int;
    type SizeFn = unsafe extern "C" fn(Program, *mut usize) -> c_int;
    type GetFn = unsafe extern "C" fn(Program, *mut c_char) -> c_int;
    type DestroyFn = unsafe extern "C" fn(*mut Program) -> c_int;

    /// The handful of NVRTC entry points the build uses.
    pub struct Nvrtc {
        _lib: libloading::Library,
        create: CreateFn,
        compile: CompileFn,
        log_size: SizeFn,
        log: GetFn,
        ptx_size: SizeFn,
        ptx: GetFn,
        destroy: DestroyFn,
    }

    impl Nvrtc {
        pub fn open(path: &Path) -> Result<Nvrtc, String> {
            // SAFETY: loading NVRTC runs its initialisers, which have no preconditions.
            let lib = unsafe { libloading::Library::new(path) }
                .map_err(|e| format!("cannot load NVRTC from {}: {e}", path.display()))?;
            // SAFETY: each symbol is looked up with the signature nvrtc.h declares for it.
            unsafe {
                let sym = |name: &[u8]| -> Result<*const c_void, String> {
                    lib.get::<*const c_void>(name)
                        .map(|s| *s)
                        .map_err(|e| format!("NVRTC lacks a symbol: {e}"))
                };
                Ok(Nvrtc {
                    create: std::mem::transmute::<*const c_void, CreateFn>(sym(b"nvrtcCreateProgram\0")?),
                    compile: std::mem::transmute::<*const c_void, CompileFn>(sym(b"nvrtcCompileProgram\0")?),
                    log_size: std::mem::transmute::<*const c_void, SizeFn>(sym(b"nvrtcGetProgramLogSize\0")?),
                    log: std::mem::transmute::<*const c_void, GetFn>(sym(b"nvrtcGetProgramLog\0")?),
                    ptx_size: std::mem::transmute::<*const c_void, SizeFn>(sym(b"nvrtcGetPTXSize\0")?),
                    ptx: std::mem::transmute::<*const c_void, GetFn>(sym(b"nvrtcGetPTX\0")?),
                    destroy: std::mem::transmute::<*const c_void, DestroyFn>(sym(b"nvrtcDestroyProgram\0")?),
                    _lib: lib,
                })
            }
        }

        /// Compiles `src` to PTX; a failure carries NVRTC's log.
        pub fn compile(&self, src: &str, name: &str, opts: &[&str]) -> Result<Vec<u8>, String> {
            let c_src = CString::new(src).map_err(|_| format!("{name} contains a NUL byte"))?;
            let c_name = CString::new(name).expect("kernel names have no NUL");
            let c_opts: Vec<CString> =
                opts.iter().map(|o| CString::new(*o).expect("options have no NUL")).collect();
            let ptrs: Vec<*const c_char> = c_opts.iter().map(|o| o.as_ptr()).collect();
            let mut prog: Program = std::ptr::null_mut();
            // SAFETY: the pointers are valid NUL-terminated strings for the duration of the
            // calls; sizes come from NVRTC and the buffers are allocated to them; the program
            // is destroyed once, at the end.
            unsafe {
                let rc = (self.create)(
                    &mut prog,
                    c_src.as_ptr(),
                    c_name.as_ptr(),
                    0,
                    std::ptr::null(),
                    std::ptr::null(),
                );
                if rc != 0 {
                    return Err(format!("nvrtcCreateProgram failed for {name} (code {rc})"));
                }
                let rc = (self.compile)(prog, ptrs.len() as c_int, ptrs.as_ptr());
                let mut n = 0usize;
                (self.log_size)(prog, &mut n);
                let mut log = vec![0 as c_char; n.max(1)];
                (self.log)(prog, log.as_mut_ptr());
                let log = CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned();
                if rc != 0 {
                    (self.destroy)(&mut prog);
                    return Err(format!("NVRTC could not compile {name} (code {rc}):\n{log}"));
                }
                if !log.trim().is_empty() {
                    println!("cargo:warning=NVRTC on {name}: {}", log.trim());
                }
                (self.ptx_size)(prog, &mut n);
                let mut ptx = vec![0u8; n];
                (self.ptx)(prog, ptx.as_mut_ptr().cast());
                (self.destroy)(&mut prog);
                // The PTX comes NUL-terminated.
                while ptx.last() == Some(&0) {
                    ptx.pop();
                }
                Ok(ptx)
            }
        }
    }
}
