//! Host execution of the kernels (feature `host-exec`): the `.cu` sources compiled by the
//! host C++ compiler through `kernels/host_shim.h`, which runs each block's threads as
//! fibers with `__syncthreads` and warp shuffles emulated. [`run`] takes the same
//! [`Launch`] the driver would, with host addresses for the buffers, so the tests run
//! the kernels' own code on the CPU. Blocks run one after another on the calling thread.

use std::ffi::{CStr, CString, c_char, c_void};

use crate::error::CudaError;
use crate::launch::Launch;

unsafe extern "C" {
    fn kiln_host_launch(
        name: *const c_char,
        gx: u32,
        gy: u32,
        gz: u32,
        bx: u32,
        by: u32,
        bz: u32,
        args: *mut *mut c_void,
    ) -> i32;
    fn kiln_host_kernel_count() -> u32;
    fn kiln_host_kernel_name(i: u32) -> *const c_char;
}

/// Runs `launch` on the host.
///
/// # Safety
/// Every pointer argument must be the address of host memory holding at least the bytes
/// the kernel reads or writes for this shape (the builders in [`crate::launch`] say how
/// many), writable where the kernel writes, and not aliased against the kernel's
/// `__restrict__` parameters.
pub unsafe fn run(launch: &Launch) -> Result<(), CudaError> {
    let name =
        CString::new(launch.kernel.as_str()).map_err(|_| CudaError::UnknownKernel(launch.kernel.clone()))?;
    let mut params: Vec<*mut c_void> = launch.args.iter().map(|a| a.as_param()).collect();
    let [gx, gy, gz] = launch.grid;
    let [bx, by, bz] = launch.block;
    // SAFETY: `name` is NUL-terminated; `params` holds one pointer per kernel parameter,
    // each to a value of the parameter's size that lives until the call returns (the
    // launch is synchronous); the buffers are the caller's promise.
    let rc = unsafe { kiln_host_launch(name.as_ptr(), gx, gy, gz, bx, by, bz, params.as_mut_ptr()) };
    if rc != 0 {
        return Err(CudaError::UnknownKernel(launch.kernel.clone()));
    }
    Ok(())
}

/// The names of the kernels the host execution holds, sorted.
pub fn kernels() -> Vec<String> {
    // SAFETY: both functions only read the registration table, which static
    // initialisers filled before main; each name is a NUL-terminated string literal.
    let mut v: Vec<String> = unsafe {
        (0..kiln_host_kernel_count())
            .map(|i| CStr::from_ptr(kiln_host_kernel_name(i)).to_string_lossy().into_owned())
            .collect()
    };
    v.sort();
    v
}
