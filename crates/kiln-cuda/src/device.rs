//! The driver-API runtime (feature `cuda`), through cudarc with the driver loaded at run
//! time: a binary built with `cuda` starts on a host without a driver, and [`Device::open`]
//! then says "no CUDA driver was found" instead of failing to load.
//!
//! A [`Device`] holds the primary context of one GPU, the embedded modules loaded for its
//! compute capability ([`crate::modules::pick_image`]), and a [`DevicePool`] whose limit is
//! the free device memory at open, or `KILN_MEMORY_LIMIT` when smaller. Every
//! [`DeviceBuffer`] is counted in it under a tag; the driver's `CUDA_ERROR_OUT_OF_MEMORY`
//! is [`CudaError::DeviceOutOfMemory`]. Launches run the same [`Launch`] descriptions the
//! host execution runs. No kernel has run on a GPU yet (docs/cuda.md).

use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::marker::PhantomData;
use std::sync::Mutex;

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;
use kiln_core::{Lease, Tag};

use crate::error::CudaError;
use crate::launch::Launch;
use crate::modules::{Image, MODULES, pick_image};
use crate::pool::{DevicePool, alloc_failure};

/// The driver library names tried, in order (cudarc's loader finds the same files).
pub const DRIVER_LIBRARIES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// Checks that one of `names` loads as a shared library, so that no driver call is made
/// (cudarc's loader panics when it finds none) on a host without a driver.
pub fn probe_driver(names: &[&str]) -> Result<(), CudaError> {
    for name in names {
        // SAFETY: loading the driver library runs its initialisers, which need nothing
        // of the caller; the handle is dropped at once, and cudarc opens it again.
        if unsafe { libloading::Library::new(*name) }.is_ok() {
            return Ok(());
        }
    }
    Err(CudaError::NoDriver { tried: names.join(", ") })
}

fn driver(call: &'static str) -> impl Fn(DriverError) -> CudaError {
    move |e| CudaError::Driver { call, detail: e.to_string() }
}

/// One GPU, ready to run kiln's kernels.
pub struct Device {
    ordinal: i32,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    name: String,
    capability: (i32, i32),
    image: Image,
    total_bytes: u64,
    pool: DevicePool,
    modules: Vec<(&'static str, sys::CUmodule)>,
    functions: Mutex<HashMap<String, sys::CUfunction>>,
}

impl Device {
    /// Opens GPU `ordinal`: probes for the driver, initialises it, retains the device's
    /// primary context and loads every module.
    pub fn open(ordinal: usize) -> Result<Device, CudaError> {
        Self::open_limited(ordinal, None)
    }

    /// Opens GPU `ordinal` as [`Device::open`] does, its pool limited by the free device
    /// memory or `limit` when smaller; `None` reads `KILN_MEMORY_LIMIT` instead.
    pub fn open_limited(ordinal: usize, limit: Option<u64>) -> Result<Device, CudaError> {
        probe_driver(&DRIVER_LIBRARIES)?;
        result::init().map_err(driver("cuInit"))?;
        let count = result::device::get_count().map_err(driver("cuDeviceGetCount"))?;
        let ordinal =
            i32::try_from(ordinal).ok().filter(|&o| o < count).ok_or(CudaError::NoDevice { count })?;
        let dev = result::device::get(ordinal).map_err(driver("cuDeviceGet"))?;
        let attr = |a| {
            // SAFETY: `dev` came from cuDeviceGet.
            unsafe { result::device::get_attribute(dev, a) }.map_err(driver("cuDeviceGetAttribute"))
        };
        let capability = (
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        let image = pick_image(capability.0, capability.1)?;
        let name = result::device::get_name(dev).map_err(driver("cuDeviceGetName"))?;
        // SAFETY: `dev` came from cuDeviceGet; the context is released in Drop.
        let ctx = unsafe { result::primary_ctx::retain(dev) }.map_err(driver("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: `ctx` is the live primary context retained above.
        unsafe { result::ctx::set_current(ctx) }.map_err(driver("cuCtxSetCurrent"))?;
        let (free, total) = result::mem_get_info().map_err(driver("cuMemGetInfo"))?;
        let pool = match limit {
            Some(l) => DevicePool::with_limit(crate::pool::device_limit(free as u64, Some(l))),
            None => DevicePool::from_env(free as u64)
                .map_err(|e| CudaError::Shape { kernel: "device pool", what: e.to_string() })?,
        };
        let mut device = Device {
            ordinal,
            dev,
            ctx,
            name,
            capability,
            image,
            total_bytes: total as u64,
            pool,
            modules: Vec::new(),
            functions: Mutex::new(HashMap::new()),
        };
        for m in MODULES {
            let bytes = m.image(image);
            // SAFETY: `bytes` is a complete cubin or NUL-terminated PTX image that lives
            // for the call; the driver copies what it keeps.
            let module = unsafe { result::module::load_data(bytes.as_ptr().cast()) }
                .map_err(driver("cuModuleLoadData"))?;
            device.modules.push((m.name, module));
        }
        Ok(device)
    }

    /// Makes the device's context current on the calling thread: a thread other than the
    /// one that opened it (`kiln serve`'s scheduler) calls this before its first launch.
    pub fn make_current(&self) -> Result<(), CudaError> {
        // SAFETY: `ctx` is the primary context retained at open and released in Drop.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(driver("cuCtxSetCurrent"))
    }

    /// The device's name, as the driver reports it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compute capability, major and minor.
    pub fn capability(&self) -> (i32, i32) {
        self.capability
    }

    /// Which compiled form was loaded.
    pub fn image(&self) -> Image {
        self.image
    }

    /// The device's memory in bytes.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// The ordinal it was opened with.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The device pool.
    pub fn pool(&self) -> &DevicePool {
        &self.pool
    }

    /// Allocates `bytes` of device memory counted under `tag`.
    pub fn alloc(&self, tag: Tag, bytes: usize) -> Result<DeviceBuffer<'_>, CudaError> {
        let lease = self.pool.reserve(tag, bytes as u64)?;
        // SAFETY: this device's context is current on the thread (set at open; kiln
        // drives a device from one thread).
        match unsafe { result::malloc_sync(bytes.max(1)) } {
            Ok(ptr) => Ok(DeviceBuffer { device: PhantomData, ptr, bytes, _lease: lease }),
            Err(e) => {
                let in_use = self.pool.stats().live_bytes - bytes as u64;
                Err(alloc_failure(e.0 as u32, e.to_string(), bytes as u64, tag, in_use))
            }
        }
    }

    /// Allocates `bytes` of device memory counted under `tag`, returned as its address and
    /// lease; [`Device::free_raw`] frees it. For owners that cannot borrow the device
    /// ([`crate::exec::Mem`]).
    pub(crate) fn alloc_raw(&self, tag: Tag, bytes: usize) -> Result<(u64, Lease), CudaError> {
        let lease = self.pool.reserve(tag, bytes as u64)?;
        // SAFETY: as in `alloc`.
        match unsafe { result::malloc_sync(bytes.max(1)) } {
            Ok(ptr) => Ok((ptr, lease)),
            Err(e) => {
                let in_use = self.pool.stats().live_bytes - bytes as u64;
                Err(alloc_failure(e.0 as u32, e.to_string(), bytes as u64, tag, in_use))
            }
        }
    }

    /// Frees an address from [`Device::alloc_raw`].
    pub(crate) fn free_raw(ptr: u64) {
        // SAFETY: `ptr` came from cuMemAlloc and its owner frees it once, while the device
        // that made it is alive (the executor drops its buffers before the device).
        let _ = unsafe { result::free_sync(ptr) };
    }

    /// Copies `data` to device address `dst`, which holds at least its bytes.
    pub(crate) fn htod(dst: u64, data: &[u8]) -> Result<(), CudaError> {
        // SAFETY: the caller's allocation holds `data.len()` bytes at `dst`; the context is
        // current on this thread.
        unsafe { result::memcpy_htod_sync(dst, data) }.map_err(driver("cuMemcpyHtoD"))
    }

    /// Copies `bytes` from device address `src` to `dst` on the device.
    pub(crate) fn dtod(dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        // SAFETY: both allocations hold `bytes` bytes (the caller's check); the context is
        // current on this thread.
        unsafe { result::memcpy_dtod_sync(dst, src, bytes) }.map_err(driver("cuMemcpyDtoD"))
    }

    /// Copies `out.len()` bytes from device address `src` into `out`.
    pub(crate) fn dtoh(src: u64, out: &mut [u8]) -> Result<(), CudaError> {
        // SAFETY: as for htod.
        unsafe { result::memcpy_dtoh_sync(out, src) }.map_err(driver("cuMemcpyDtoH"))
    }

    fn function(&self, kernel: &str, module: &str) -> Result<sys::CUfunction, CudaError> {
        let mut cache = self.functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&f) = cache.get(kernel) {
            return Ok(f);
        }
        let &(_, m) = self
            .modules
            .iter()
            .find(|(n, _)| *n == module)
            .ok_or_else(|| CudaError::UnknownKernel(kernel.into()))?;
        let name = CString::new(kernel).map_err(|_| CudaError::UnknownKernel(kernel.into()))?;
        // SAFETY: `m` is a module loaded at open and unloaded only in Drop.
        let f = unsafe { result::module::get_function(m, name) }.map_err(driver("cuModuleGetFunction"))?;
        cache.insert(kernel.to_string(), f);
        Ok(f)
    }

    /// Queues `launch` on the default stream.
    ///
    /// # Safety
    /// Every pointer argument must be a live allocation of this device holding the bytes
    /// the kernel reads or writes for the launch's shape ([`crate::launch`] gives them).
    pub unsafe fn launch(&self, launch: &Launch) -> Result<(), CudaError> {
        let f = self.function(&launch.kernel, launch.module())?;
        let mut params: Vec<*mut c_void> = launch.args.iter().map(|a| a.as_param()).collect();
        let [gx, gy, gz] = launch.grid;
        let [bx, by, bz] = launch.block;
        // SAFETY: `f` is a kernel of a loaded module; `params` holds one pointer per
        // parameter to a value of its size, alive for the call (the driver copies them);
        // the buffers are the caller's promise.
        unsafe { result::launch_kernel(f, (gx, gy, gz), (bx, by, bz), 0, std::ptr::null_mut(), &mut params) }
            .map_err(driver("cuLaunchKernel"))
    }

    fn node_params(
        &self,
        l: &Launch,
        params: &mut [*mut c_void],
    ) -> Result<sys::CUDA_KERNEL_NODE_PARAMS, CudaError> {
        let func = self.function(&l.kernel, l.module())?;
        let [gx, gy, gz] = l.grid;
        let [bx, by, bz] = l.block;
        Ok(sys::CUDA_KERNEL_NODE_PARAMS {
            func,
            gridDimX: gx,
            gridDimY: gy,
            gridDimZ: gz,
            blockDimX: bx,
            blockDimY: by,
            blockDimZ: bz,
            sharedMemBytes: 0,
            kernelParams: params.as_mut_ptr(),
            extra: std::ptr::null_mut(),
            kern: std::ptr::null_mut(),
            ctx: std::ptr::null_mut(),
        })
    }

    /// Builds and instantiates a graph of `launches`, each node after the one before.
    ///
    /// # Safety
    /// As for [`Device::launch`], for every launch, whenever the graph is launched.
    pub(crate) unsafe fn build_graph(&self, launches: &[Launch]) -> Result<CudaGraph, CudaError> {
        let mut g = CudaGraph { graph: std::ptr::null_mut(), exec: std::ptr::null_mut(), nodes: Vec::new() };
        // SAFETY: creates an empty graph owned by `g` (destroyed in its Drop).
        unsafe { sys::cuGraphCreate(&mut g.graph, 0) }.result().map_err(driver("cuGraphCreate"))?;
        for l in launches {
            let mut params: Vec<*mut c_void> = l.args.iter().map(|a| a.as_param()).collect();
            let p = self.node_params(l, &mut params)?;
            let mut node = std::ptr::null_mut();
            let deps = g.nodes.last().map_or(std::ptr::null(), |n| n as *const sys::CUgraphNode);
            let n_deps = usize::from(!g.nodes.is_empty());
            // SAFETY: `g.graph` is live; `deps` points at `n_deps` nodes of it; `p` and
            // the parameter values it points to (in `l.args`) live for the call, which
            // copies them.
            unsafe { sys::cuGraphAddKernelNode_v2(&mut node, g.graph, deps, n_deps, &p) }
                .result()
                .map_err(driver("cuGraphAddKernelNode"))?;
            g.nodes.push(node);
        }
        // SAFETY: `g.graph` is complete; the executable graph is owned by `g`.
        unsafe { sys::cuGraphInstantiateWithFlags(&mut g.exec, g.graph, 0) }
            .result()
            .map_err(driver("cuGraphInstantiate"))?;
        Ok(g)
    }

    /// Sets node `i` of `g` to `l` (same kernel, new grid and arguments).
    ///
    /// # Safety
    /// As for [`Device::build_graph`].
    pub(crate) unsafe fn update_node(&self, g: &CudaGraph, i: usize, l: &Launch) -> Result<(), CudaError> {
        let mut params: Vec<*mut c_void> = l.args.iter().map(|a| a.as_param()).collect();
        let p = self.node_params(l, &mut params)?;
        // SAFETY: `g.exec` was instantiated from the graph holding `g.nodes[i]`; `p` lives
        // for the call, which copies it.
        unsafe { sys::cuGraphExecKernelNodeSetParams_v2(g.exec, g.nodes[i], &p) }
            .result()
            .map_err(driver("cuGraphExecKernelNodeSetParams"))
    }

    /// Queues `g` on the default stream.
    pub(crate) fn launch_graph(&self, g: &CudaGraph) -> Result<(), CudaError> {
        // SAFETY: `g.exec` is a live executable graph of this context.
        unsafe { sys::cuGraphLaunch(g.exec, std::ptr::null_mut()) }.result().map_err(driver("cuGraphLaunch"))
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        result::ctx::synchronize().map_err(driver("cuCtxSynchronize"))
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        for &(_, m) in &self.modules {
            // SAFETY: each module was loaded at open and is unloaded once; no buffer or
            // function outlives the device (buffers borrow it).
            let _ = unsafe { result::module::unload(m) };
        }
        // SAFETY: the context was retained once at open.
        let _ = unsafe { result::primary_ctx::release(self.dev) };
    }
}

/// An instantiated CUDA graph of one decode step and its nodes, in launch order.
pub(crate) struct CudaGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    nodes: Vec<sys::CUgraphNode>,
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: each handle was made once by build_graph (or is null when it failed
        // before) and is destroyed once here.
        unsafe {
            if !self.exec.is_null() {
                let _ = sys::cuGraphExecDestroy(self.exec);
            }
            if !self.graph.is_null() {
                let _ = sys::cuGraphDestroy(self.graph);
            }
        }
    }
}

/// Device memory counted in its device's pool, freed on drop.
pub struct DeviceBuffer<'d> {
    device: PhantomData<&'d Device>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
    _lease: Lease,
}

impl DeviceBuffer<'_> {
    /// The device address, for a [`Launch`] argument.
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    /// Bytes allocated.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Copies `data` to the start of the buffer.
    pub fn upload<T: Copy>(&mut self, data: &[T]) -> Result<(), CudaError> {
        assert!(size_of_val(data) <= self.bytes, "upload of {} bytes into {}", size_of_val(data), self.bytes);
        // SAFETY: the buffer holds at least `data`'s bytes (checked above) and the
        // device's context is current.
        unsafe { result::memcpy_htod_sync(self.ptr, data) }.map_err(driver("cuMemcpyHtoD"))
    }

    /// Copies the start of the buffer into `out`.
    pub fn download<T: Copy>(&self, out: &mut [T]) -> Result<(), CudaError> {
        assert!(size_of_val(out) <= self.bytes, "download of {} bytes from {}", size_of_val(out), self.bytes);
        // SAFETY: as for upload; every bit pattern the kernels write is a valid T for the
        // plain numeric types callers use.
        unsafe { result::memcpy_dtoh_sync(out, self.ptr) }.map_err(driver("cuMemcpyDtoH"))
    }
}

impl Drop for DeviceBuffer<'_> {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuMemAlloc and is freed once; the device (and so its
        // context) outlives the buffer.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_driver_library_is_a_clear_error() {
        let e = probe_driver(&["/nonexistent/kiln-test/libcuda.so.1"]).unwrap_err();
        assert!(matches!(e, CudaError::NoDriver { .. }));
        assert_eq!(
            e.to_string(),
            "no CUDA driver was found: none of /nonexistent/kiln-test/libcuda.so.1 could be loaded"
        );
    }

    #[test]
    fn opening_without_a_driver_fails_cleanly() {
        // On a host with a driver this opens the GPU instead; either way nothing panics.
        match Device::open(0) {
            Err(CudaError::NoDriver { tried }) => {
                assert!(probe_driver(&DRIVER_LIBRARIES).is_err());
                assert!(tried.contains("libcuda.so.1"), "{tried}");
            }
            Err(e) => assert!(probe_driver(&DRIVER_LIBRARIES).is_ok(), "{e}"),
            Ok(d) => assert!(!d.name().is_empty()),
        }
    }
}
