//! Where kiln-wgpu's kernels run: a [`WgpuExec`] is one wgpu device on the backend asked
//! for (Vulkan or Metal), or a plan that only counts. Behind one interface: allocate device
//! memory counted in a [`DevicePool`] under a tag, copy to and from it, and queue a
//! [`Dispatch`]. The forward pass ([`crate::model`]) is written against this alone, so
//! [`WgpuExec::plan`] makes the very allocations a run makes.
//!
//! Dispatches are recorded into one command encoder and submitted together when the host
//! next writes, reads or waits (or when the parameter ring below is full), so a forward is
//! one submission. Each dispatch's parameters (a few `u32`) go to a slot of a 256-byte
//! stride in one uniform buffer, bound with a dynamic offset. That ring
//! ([`PARAM_RING_BYTES`]) and the staging buffers of reads are wgpu's transfer memory, not
//! counted in the pool; everything a forward's size depends on is.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use kiln_core::{Lease, PoolStats, Tag};

use crate::error::WgpuError;
use crate::pool::DevicePool;
use crate::shaders::Kernel;

/// Bytes between two dispatches' parameters in the ring (wgpu's largest uniform offset
/// alignment).
const PARAM_STRIDE: u64 = 256;
/// Bytes a dispatch's parameters may take (16 words).
pub const PARAM_BYTES: u64 = 64;
/// Dispatches recorded before a submission is forced.
const PARAM_SLOTS: u64 = 2048;
/// The uniform buffer holding queued dispatches' parameters.
pub const PARAM_RING_BYTES: u64 = PARAM_STRIDE * PARAM_SLOTS;

/// The wgpu backend a [`WgpuExec`] is forced to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Vulkan: Linux and Windows GPUs, and lavapipe (Mesa's CPU driver) in the tests.
    Vulkan,
    /// Metal: Apple GPUs on macOS.
    Metal,
}

impl Backend {
    /// The name users give (`vulkan`, `metal`).
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Vulkan => "vulkan",
            Backend::Metal => "metal",
        }
    }

    fn backends(self) -> wgpu::Backends {
        match self {
            Backend::Vulkan => wgpu::Backends::VULKAN,
            Backend::Metal => wgpu::Backends::METAL,
        }
    }
}

/// What runs the kernels, for the harness's fingerprint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterDesc {
    /// The adapter's name (`llvmpipe (LLVM 15.0.6, 256 bits)`, `Apple M1 Ultra`, ...).
    pub name: String,
    /// The driver's name.
    pub driver: String,
    /// The driver's version text.
    pub driver_info: String,
    /// The backend (`vulkan`, `metal`).
    pub backend: &'static str,
    /// wgpu's device type (`DiscreteGpu`, `IntegratedGpu`, `Cpu`, ...).
    pub device_type: String,
    /// The device's memory in bytes, the pool's limit before any lower limit.
    pub memory_bytes: u64,
    /// Where [`AdapterDesc::memory_bytes`] came from.
    pub memory_source: &'static str,
    /// Whether the adapter has packed 4 x 8-bit integer dot products, so the integer
    /// products use WGSL's `dot4I8Packed`/`dot4U8Packed` ([`packed_dot_products`]).
    pub packed_dot: bool,
}

/// One place kernels run.
pub struct WgpuExec {
    inner: Inner,
}

enum Inner {
    Gpu(Box<Gpu>),
    Plan(DevicePool),
}

struct Gpu {
    device: wgpu::Device,
    queue: wgpu::Queue,
    pool: DevicePool,
    adapter: AdapterDesc,
    limits: wgpu::Limits,
    /// Bind group layouts by the number of storage buffers a kernel binds (index 0: one).
    layouts: Vec<(wgpu::BindGroupLayout, wgpu::PipelineLayout)>,
    pipelines: RefCell<HashMap<Kernel, wgpu::ComputePipeline>>,
    params: wgpu::Buffer,
    pending: RefCell<Pending>,
    binds: Arc<BindCache>,
    errors: Arc<Mutex<Vec<String>>>,
    dispatches: Cell<u64>,
    /// The integer products' plain path forced ([`WgpuExec::force_plain_dot`]).
    plain_dot: Cell<bool>,
}

#[derive(Default)]
struct Pending {
    encoder: Option<wgpu::CommandEncoder>,
    /// The compute pass every dispatch since the last copy or submission is recorded
    /// into (wgpu synchronizes dispatches within a pass); ended before a copy.
    pass: Option<wgpu::ComputePass<'static>>,
    params: Vec<u8>,
}

impl Pending {
    /// The encoder, the open compute pass ended first so a copy lands after its dispatches.
    fn encoder(&mut self, device: &wgpu::Device) -> &mut wgpu::CommandEncoder {
        self.pass = None;
        self.encoder.get_or_insert_with(|| device.create_command_encoder(&Default::default()))
    }

    /// The open compute pass, begun when there is none.
    fn pass(&mut self, device: &wgpu::Device) -> &mut wgpu::ComputePass<'static> {
        if self.pass.is_none() {
            let enc = self.encoder(device);
            let pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("kiln"),
                timestamp_writes: None,
            });
            self.pass = Some(pass.forget_lifetime());
        }
        self.pass.as_mut().expect("a pass was just begun")
    }
}

/// Bind groups by the storage buffers they bind (their [`Mem`] ids, in binding order):
/// made once and bound again by every dispatch with the same buffers (a decode step binds
/// the same weights, caches and scratch as the step before). wgpu cannot replay a recorded
/// compute command buffer; this is the part of a step it lets a caller keep. A buffer's
/// groups are dropped with it, so a freed buffer is not kept alive here.
type BindCache = Mutex<HashMap<Vec<u64>, wgpu::BindGroup>>;

/// Bind groups kept before the cache is emptied (a forward binds a few hundred sets).
const BIND_CACHE_MAX: usize = 4096;

/// The next [`Mem`] id.
static NEXT_MEM: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Memory of a [`WgpuExec`], counted in its pool until dropped.
pub struct Mem {
    buf: Option<wgpu::Buffer>,
    bytes: usize,
    /// Unique among every exec's buffers: the bind cache's key.
    id: u64,
    /// The bind cache of the exec that made it, which forgets its groups when it drops.
    binds: std::sync::Weak<BindCache>,
    _lease: Lease,
}

impl Drop for Mem {
    fn drop(&mut self) {
        if let Some(cache) = self.binds.upgrade() {
            cache.lock().unwrap_or_else(|p| p.into_inner()).retain(|k, _| !k.contains(&self.id));
        }
    }
}

impl Mem {
    fn new(buf: Option<wgpu::Buffer>, bytes: usize, binds: std::sync::Weak<BindCache>, lease: Lease) -> Mem {
        let id = NEXT_MEM.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Mem { buf, bytes, id, binds, _lease: lease }
    }

    /// Bytes allocated (as asked; the buffer itself is rounded up to 4 bytes).
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// A kernel run: its parameters (at most 16 words, the layout of the kernel's `Params`
/// struct), its storage buffers in binding order and its workgroup counts.
pub struct Dispatch<'a> {
    /// The kernel.
    pub kernel: Kernel,
    /// The `Params` words.
    pub params: Vec<u32>,
    /// The storage buffers, bindings 1.. .
    pub buffers: Vec<&'a Mem>,
    /// Workgroups in x, y, z.
    pub groups: [u32; 3],
}

/// Runs a wgpu future to completion on this thread. wgpu's native futures are ready when
/// made or after a device poll, so this spins only until the driver answers.
fn block_on<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::yield_now();
    }
}

fn device_err(call: &'static str, detail: impl ToString) -> WgpuError {
    WgpuError::Device { call, detail: detail.to_string() }
}

/// The device-local heap of a Vulkan adapter, the largest if several.
#[cfg(not(target_vendor = "apple"))]
fn vulkan_device_local_bytes(adapter: &wgpu::Adapter) -> Option<u64> {
    // SAFETY: the hal adapter is only read (its instance and physical device handles) while
    // `adapter` is alive; nothing it returns outlives this function.
    unsafe {
        let hal = adapter.as_hal::<wgpu::hal::api::Vulkan>()?;
        let instance = hal.shared_instance().raw_instance();
        let props = instance.get_physical_device_memory_properties(hal.raw_physical_device());
        // VK_MEMORY_HEAP_DEVICE_LOCAL_BIT = 1.
        props.memory_heaps_as_slice().iter().filter(|h| h.flags.as_raw() & 1 != 0).map(|h| h.size).max()
    }
}

/// The Metal device's recommended working set: what it can use with good performance.
#[cfg(target_vendor = "apple")]
fn metal_working_set_bytes(adapter: &wgpu::Adapter) -> Option<u64> {
    use objc2_metal::MTLDevice;
    // SAFETY: the hal adapter is only read (its device's working-set size) while `adapter`
    // is alive; nothing it returns outlives this function.
    unsafe {
        let hal = adapter.as_hal::<wgpu::hal::api::Metal>()?;
        Some(hal.raw_device().recommendedMaxWorkingSetSize())
    }
}

/// Whether a Vulkan adapter has integer dot products: Vulkan 1.3, or the
/// `VK_KHR_shader_integer_dot_product` extension (either makes the `shaderIntegerDotProduct`
/// feature required). That is wgpu's own condition for enabling the SPIR-V capabilities,
/// under which naga writes `dot4I8Packed` as one `OpSDot` (and otherwise expands it).
#[cfg(not(target_vendor = "apple"))]
fn vulkan_integer_dot_product(adapter: &wgpu::Adapter) -> bool {
    // VK_MAKE_API_VERSION(0, 1, 3, 0).
    const VULKAN_1_3: u32 = (1 << 22) | (3 << 12);
    // SAFETY: the hal adapter is only read (its properties and extension list) while
    // `adapter` is alive; nothing it returns outlives this function.
    unsafe {
        adapter.as_hal::<wgpu::hal::api::Vulkan>().is_some_and(|hal| {
            let caps = hal.physical_device_capabilities();
            caps.properties().api_version >= VULKAN_1_3
                || caps.supports_extension(c"VK_KHR_shader_integer_dot_product")
        })
    }
}

/// Whether `adapter` runs WGSL's packed 4 x 8-bit dot products as such: the instance
/// implements the `packed_4x8_integer_dot_product` language feature and, on Vulkan, the
/// device has integer dot products ([`vulkan_integer_dot_product`]); Metal has them as
/// `char4`/`uchar4` dot products (never run here).
fn packed_dot_products(instance: &wgpu::Instance, adapter: &wgpu::Adapter, backend: Backend) -> bool {
    if !instance.wgsl_language_features().contains(wgpu::WgslLanguageFeatures::Packed4x8IntegerDotProduct) {
        return false;
    }
    match backend {
        #[cfg(not(target_vendor = "apple"))]
        Backend::Vulkan => vulkan_integer_dot_product(adapter),
        #[cfg(target_vendor = "apple")]
        Backend::Vulkan => {
            let _ = adapter;
            false
        }
        Backend::Metal => true,
    }
}

/// The device's memory and where it was read: the Vulkan device-local heap, or Metal's
/// recommended working set, else the adapter's largest buffer.
fn device_memory(adapter: &wgpu::Adapter, limits: &wgpu::Limits) -> (u64, &'static str) {
    #[cfg(not(target_vendor = "apple"))]
    if let Some(b) = vulkan_device_local_bytes(adapter) {
        return (b, "the Vulkan device-local heap");
    }
    #[cfg(target_vendor = "apple")]
    if let Some(b) = metal_working_set_bytes(adapter) {
        return (b, "the Metal device's recommended working set");
    }
    (limits.max_buffer_size, "the adapter's largest buffer")
}

/// The first adapter of `backend`, as [`WgpuExec::open`] picks it.
fn request_adapter(backend: Backend) -> Result<(wgpu::Instance, wgpu::Adapter), WgpuError> {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = backend.backends();
    let instance = wgpu::Instance::new(desc);
    let adapter = block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
        power_preference: wgpu::PowerPreference::HighPerformance,
        force_fallback_adapter: false,
        compatible_surface: None,
        apply_limit_buckets: false,
    }))
    .map_err(|e| WgpuError::NoAdapter { backend: backend.as_str(), detail: e.to_string() })?;
    Ok((instance, adapter))
}

/// What the driver says of `adapter`, with the memory the pool is limited by.
fn describe(
    instance: &wgpu::Instance,
    adapter: &wgpu::Adapter,
    backend: Backend,
    limits: &wgpu::Limits,
) -> AdapterDesc {
    let info = adapter.get_info();
    let (memory_bytes, memory_source) = device_memory(adapter, limits);
    AdapterDesc {
        name: info.name,
        driver: info.driver,
        driver_info: info.driver_info,
        backend: backend.as_str(),
        device_type: format!("{:?}", info.device_type),
        memory_bytes,
        memory_source,
        packed_dot: packed_dot_products(instance, adapter, backend),
    }
}

impl AdapterDesc {
    /// The adapter [`WgpuExec::open`] would run on, without opening a device: what
    /// `kiln estimate` prices a plan against and the harness records as the device.
    pub fn probe(backend: Backend) -> Result<AdapterDesc, WgpuError> {
        let (instance, adapter) = request_adapter(backend)?;
        Ok(describe(&instance, &adapter, backend, &adapter.limits()))
    }
}

impl WgpuExec {
    /// The first adapter of `backend`, its pool limited by the device's memory, `limit`
    /// and `KILN_MEMORY_LIMIT`, whichever is smallest.
    pub fn open(backend: Backend, limit: Option<u64>) -> Result<WgpuExec, WgpuError> {
        let (instance, adapter) = request_adapter(backend)?;
        let limits = adapter.limits();
        let desc = describe(&instance, &adapter, backend, &limits);
        let (device, queue) = block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("kiln"),
            required_features: wgpu::Features::empty(),
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| device_err("request_device", e))?;
        let errors = Arc::new(Mutex::new(Vec::new()));
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            sink.lock().unwrap_or_else(|p| p.into_inner()).push(e.to_string());
        }));
        let pool = DevicePool::from_env(desc.memory_bytes, limit)
            .map_err(|e| WgpuError::Input { what: "KILN_MEMORY_LIMIT".into(), message: e.to_string() })?;
        let layouts = (1..=5).map(|n| layout(&device, n)).collect();
        let params = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln params"),
            size: PARAM_RING_BYTES,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let adapter = desc;
        Ok(WgpuExec {
            inner: Inner::Gpu(Box::new(Gpu {
                device,
                queue,
                pool,
                adapter,
                limits,
                layouts,
                pipelines: RefCell::new(HashMap::new()),
                params,
                pending: RefCell::new(Pending::default()),
                binds: Arc::new(Mutex::new(HashMap::new())),
                errors,
                dispatches: Cell::new(0),
                plain_dot: Cell::new(false),
            })),
        })
    }

    /// A plan whose pool refuses anything above `limit` bytes live: allocations are
    /// counted and nothing is stored or run ([`crate::model::plan`]).
    pub fn plan(limit: u64) -> WgpuExec {
        WgpuExec { inner: Inner::Plan(DevicePool::with_limit(limit)) }
    }

    /// The adapter, or `None` for a plan.
    pub fn adapter(&self) -> Option<&AdapterDesc> {
        match &self.inner {
            Inner::Gpu(g) => Some(&g.adapter),
            Inner::Plan(_) => None,
        }
    }

    /// What runs the kernels: the adapter's name and backend, or `plan`.
    pub fn name(&self) -> String {
        match &self.inner {
            Inner::Gpu(g) => format!("{} ({})", g.adapter.name, g.adapter.backend),
            Inner::Plan(_) => "plan".into(),
        }
    }

    /// The pool every allocation is counted in.
    pub fn pool(&self) -> &DevicePool {
        match &self.inner {
            Inner::Gpu(g) => &g.pool,
            Inner::Plan(p) => p,
        }
    }

    /// The pool's counters.
    pub fn stats(&self) -> PoolStats {
        self.pool().stats()
    }

    /// Dispatches queued so far.
    pub fn dispatches(&self) -> u64 {
        match &self.inner {
            Inner::Gpu(g) => g.dispatches.get(),
            Inner::Plan(_) => 0,
        }
    }

    /// Bind groups kept for reuse ([`BindCache`]): as many as the distinct buffer sets
    /// bound since the buffers were made, never growing with the steps that bind them again.
    pub fn bind_groups(&self) -> usize {
        match &self.inner {
            Inner::Gpu(g) => g.binds.lock().unwrap_or_else(|p| p.into_inner()).len(),
            Inner::Plan(_) => 0,
        }
    }

    /// `qmv`'s lanes per output feature of a K-wide row on this adapter
    /// ([`crate::shaders::qmv_lanes`]).
    pub fn qmv_lanes(&self, k: usize) -> usize {
        let cpu = self.adapter().is_some_and(|a| a.device_type == "Cpu");
        crate::shaders::qmv_lanes(k, cpu)
    }

    /// Whether the integer products use WGSL's packed dot products: the adapter has them
    /// ([`AdapterDesc::packed_dot`]) and [`WgpuExec::force_plain_dot`] has not turned them
    /// off. `false` for a plan.
    pub fn packed_dot(&self) -> bool {
        match &self.inner {
            Inner::Gpu(g) => g.adapter.packed_dot && !g.plain_dot.get(),
            Inner::Plan(_) => false,
        }
    }

    /// Makes the integer products take their plain i32 path even where the adapter has
    /// packed dot products (`true`), or the adapter's choice again (`false`): for the
    /// tests, which run both paths on one adapter, and for measuring what the packed path
    /// gains. The two give the same integers.
    pub fn force_plain_dot(&self, plain: bool) {
        if let Inner::Gpu(g) = &self.inner {
            g.plain_dot.set(plain);
        }
    }

    /// The largest storage buffer a kernel may bind, in bytes (`u64::MAX` for a plan).
    pub fn max_binding_bytes(&self) -> u64 {
        match &self.inner {
            Inner::Gpu(g) => g.limits.max_storage_buffer_binding_size.min(g.limits.max_buffer_size),
            Inner::Plan(_) => u64::MAX,
        }
    }

    /// Allocates `bytes` counted under `tag`, or refuses with `out of memory:` (the pool's
    /// limit, wgpu's own refusal, or a buffer larger than the adapter binds).
    pub fn alloc(&self, tag: Tag, bytes: usize) -> Result<Mem, WgpuError> {
        let lease = self.pool().reserve(tag, bytes as u64)?;
        let g = match &self.inner {
            Inner::Plan(_) => return Ok(Mem::new(None, bytes, std::sync::Weak::new(), lease)),
            Inner::Gpu(g) => g,
        };
        let max = self.max_binding_bytes();
        if bytes as u64 > max {
            // The device cannot hold it as one buffer: for a caller that is the device's
            // memory running out (exit 3), as a larger device would take it.
            return Err(WgpuError::DeviceOutOfMemory {
                requested: bytes as u64,
                tag,
                in_use: g.pool.stats().live_bytes - bytes as u64,
                detail: format!("above the adapter's largest storage buffer binding, {max} bytes"),
            });
        }
        let oom = g.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let valid = g.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let buf = g.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(tag.as_str()),
            size: bytes.max(4).next_multiple_of(4) as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let invalid = block_on(valid.pop());
        let refused = block_on(oom.pop());
        if let Some(e) = refused {
            let in_use = g.pool.stats().live_bytes - bytes as u64;
            return Err(WgpuError::DeviceOutOfMemory {
                requested: bytes as u64,
                tag,
                in_use,
                detail: e.to_string(),
            });
        }
        if let Some(e) = invalid {
            return Err(device_err("create_buffer", e));
        }
        Ok(Mem::new(Some(buf), bytes, Arc::downgrade(&g.binds), lease))
    }

    /// Allocates and fills a buffer with `data`'s bytes.
    pub fn upload<T: bytemuck::Pod>(&self, tag: Tag, data: &[T]) -> Result<Mem, WgpuError> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let mut m = self.alloc(tag, bytes.len())?;
        self.write(&mut m, 0, bytes)?;
        Ok(m)
    }

    /// Copies `data` into `m` at byte `offset` (a multiple of 4), after the dispatches
    /// queued so far.
    pub fn write(&self, m: &mut Mem, offset: usize, data: &[u8]) -> Result<(), WgpuError> {
        assert!(
            offset + data.len() <= m.bytes,
            "a write of {} bytes at {offset} into a buffer of {}",
            data.len(),
            m.bytes
        );
        assert!(offset.is_multiple_of(4), "a write at {offset}, not a multiple of 4");
        let Inner::Gpu(g) = &self.inner else { return Ok(()) };
        if data.is_empty() {
            return Ok(());
        }
        // A write lands before the next submission's commands: submit what is queued first.
        self.flush()?;
        let buf = m.buf.as_ref().expect("a device buffer");
        if data.len().is_multiple_of(4) {
            g.queue.write_buffer(buf, offset as u64, data);
        } else {
            let mut padded = data.to_vec();
            padded.resize(data.len().next_multiple_of(4), 0);
            g.queue.write_buffer(buf, offset as u64, &padded);
        }
        Ok(())
    }

    /// Copies `out.len()` values from `m` at byte `offset` (a multiple of 4), after every
    /// queued dispatch.
    pub fn read<T: bytemuck::Pod>(&self, m: &Mem, offset: usize, out: &mut [T]) -> Result<(), WgpuError> {
        let out: &mut [u8] = bytemuck::cast_slice_mut(out);
        assert!(
            offset + out.len() <= m.bytes,
            "a read of {} bytes at {offset} from a buffer of {}",
            out.len(),
            m.bytes
        );
        assert!(offset.is_multiple_of(4), "a read at {offset}, not a multiple of 4");
        let g = match &self.inner {
            Inner::Plan(_) => {
                out.fill(0);
                return Ok(());
            }
            Inner::Gpu(g) => g,
        };
        if out.is_empty() {
            return Ok(());
        }
        let size = out.len().next_multiple_of(4) as u64;
        let staging = g.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln read"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        {
            let mut p = g.pending.borrow_mut();
            let enc = p.encoder(&g.device);
            enc.copy_buffer_to_buffer(
                m.buf.as_ref().expect("a device buffer"),
                offset as u64,
                &staging,
                0,
                size,
            );
        }
        self.flush()?;
        let done = Arc::new(Mutex::new(None));
        let flag = done.clone();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            *flag.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        });
        g.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| device_err("poll", e))?;
        let r = done.lock().unwrap_or_else(|p| p.into_inner()).take();
        match r {
            Some(Ok(())) => {}
            Some(Err(e)) => return Err(device_err("map_async", e)),
            None => return Err(device_err("map_async", "the mapping did not complete after a wait")),
        }
        {
            let view = staging.get_mapped_range(..).map_err(|e| device_err("get_mapped_range", e))?;
            out.copy_from_slice(&view[..out.len()]);
        }
        staging.unmap();
        self.check_errors("read")
    }

    /// Copies all of `src` into `dst` (which holds at least as many bytes) on the device.
    pub fn copy(&self, dst: &mut Mem, src: &Mem) -> Result<(), WgpuError> {
        assert!(src.bytes <= dst.bytes, "a copy of {} bytes into a buffer of {}", src.bytes, dst.bytes);
        let Inner::Gpu(g) = &self.inner else { return Ok(()) };
        let size = src.bytes.next_multiple_of(4) as u64;
        let mut p = g.pending.borrow_mut();
        let enc = p.encoder(&g.device);
        enc.copy_buffer_to_buffer(
            src.buf.as_ref().expect("a device buffer"),
            0,
            dst.buf.as_ref().expect("a device buffer"),
            0,
            size,
        );
        Ok(())
    }

    /// Copies `bytes` bytes of `src` from `src_offset` into `dst` at `dst_offset`, on the
    /// device, in order with the dispatches queued before it. Offsets and length are
    /// multiples of 4 (wgpu's copy alignment); panics when a range lies outside its buffer.
    pub fn copy_range(
        &self,
        dst: &mut Mem,
        dst_offset: usize,
        src: &Mem,
        src_offset: usize,
        bytes: usize,
    ) -> Result<(), WgpuError> {
        let fits = |at: usize, len: usize| at.checked_add(bytes).is_some_and(|end| end <= len);
        assert!(
            fits(src_offset, src.bytes) && fits(dst_offset, dst.bytes),
            "a copy of {bytes} bytes from {src_offset} of {} into {dst_offset} of {}",
            src.bytes,
            dst.bytes
        );
        assert!(
            (dst_offset | src_offset | bytes).is_multiple_of(4),
            "a copy of {bytes} bytes at {src_offset} into {dst_offset}: wgpu copies whole 4-byte words"
        );
        let Inner::Gpu(g) = &self.inner else { return Ok(()) };
        if bytes == 0 {
            return Ok(());
        }
        let mut p = g.pending.borrow_mut();
        let enc = p.encoder(&g.device);
        enc.copy_buffer_to_buffer(
            src.buf.as_ref().expect("a device buffer"),
            src_offset as u64,
            dst.buf.as_ref().expect("a device buffer"),
            dst_offset as u64,
            bytes as u64,
        );
        Ok(())
    }

    fn pipeline(&self, g: &Gpu, kernel: Kernel) -> Result<wgpu::ComputePipeline, WgpuError> {
        if let Some(p) = g.pipelines.borrow().get(&kernel) {
            return Ok(p.clone());
        }
        let scope = g.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = g.device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(kernel.name()),
            source: wgpu::ShaderSource::Wgsl(kernel.source().into()),
        });
        let pipeline = g.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(kernel.name()),
            layout: Some(&g.layouts[kernel.storage_buffers() - 1].1),
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
        if let Some(e) = block_on(scope.pop()) {
            return Err(device_err("create_compute_pipeline", format!("{}: {e}", kernel.name())));
        }
        g.pipelines.borrow_mut().insert(kernel, pipeline.clone());
        Ok(pipeline)
    }

    /// Queues `d` after the dispatches queued so far (each sees the writes of those
    /// before it).
    pub fn dispatch(&self, d: &Dispatch<'_>) -> Result<(), WgpuError> {
        let g = match &self.inner {
            Inner::Plan(_) => {
                return Err(WgpuError::Unsupported {
                    what: format!("{}: a plan counts memory and runs nothing", d.kernel.name()),
                });
            }
            Inner::Gpu(g) => g,
        };
        assert_eq!(d.buffers.len(), d.kernel.storage_buffers(), "{}: storage buffers", d.kernel.name());
        assert!(d.params.len() as u64 * 4 <= PARAM_BYTES, "{}: parameters", d.kernel.name());
        let max = g.limits.max_compute_workgroups_per_dimension;
        if let Some(&n) = d.groups.iter().find(|&&n| n > max) {
            return Err(WgpuError::shape(
                d.kernel.name(),
                format!("{n} workgroups in one dimension: the adapter takes at most {max}"),
            ));
        }
        if d.groups.contains(&0) {
            return Ok(());
        }
        let pipeline = self.pipeline(g, d.kernel)?;
        if g.pending.borrow().params.len() as u64 >= PARAM_RING_BYTES {
            self.flush()?;
        }
        let mut p = g.pending.borrow_mut();
        let offset = p.params.len() as u64;
        let mut words = [0u32; (PARAM_STRIDE / 4) as usize];
        words[..d.params.len()].copy_from_slice(&d.params);
        p.params.extend_from_slice(bytemuck::cast_slice(&words));
        let key: Vec<u64> = d.buffers.iter().map(|m| m.id).collect();
        let group = {
            let mut cache = g.binds.lock().unwrap_or_else(|p| p.into_inner());
            if cache.len() >= BIND_CACHE_MAX {
                cache.clear();
            }
            cache.entry(key).or_insert_with(|| bind_group(g, d)).clone()
        };
        let pass = p.pass(&g.device);
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &group, &[offset as u32]);
        pass.dispatch_workgroups(d.groups[0], d.groups[1], d.groups[2]);
        g.dispatches.set(g.dispatches.get() + 1);
        Ok(())
    }

    /// Submits every queued dispatch and copy.
    pub fn flush(&self) -> Result<(), WgpuError> {
        let Inner::Gpu(g) = &self.inner else { return Ok(()) };
        let (encoder, params) = {
            let mut p = g.pending.borrow_mut();
            p.pass = None;
            (p.encoder.take(), std::mem::take(&mut p.params))
        };
        if !params.is_empty() {
            g.queue.write_buffer(&g.params, 0, &params);
        }
        if let Some(enc) = encoder {
            g.queue.submit([enc.finish()]);
        }
        self.check_errors("submit")
    }

    /// Submits every queued dispatch and waits for the device to finish them.
    pub fn synchronize(&self) -> Result<(), WgpuError> {
        self.flush()?;
        let Inner::Gpu(g) = &self.inner else { return Ok(()) };
        g.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| device_err("poll", e))?;
        self.check_errors("poll")
    }

    fn check_errors(&self, call: &'static str) -> Result<(), WgpuError> {
        let Inner::Gpu(g) = &self.inner else { return Ok(()) };
        let mut errs = g.errors.lock().unwrap_or_else(|p| p.into_inner());
        if errs.is_empty() {
            return Ok(());
        }
        let detail = errs.join("; ");
        errs.clear();
        Err(device_err(call, detail))
    }
}

/// The bind group of `d`'s buffers after the parameter ring (bound at each dispatch's
/// dynamic offset).
fn bind_group(g: &Gpu, d: &Dispatch<'_>) -> wgpu::BindGroup {
    let mut entries = vec![wgpu::BindGroupEntry {
        binding: 0,
        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: &g.params,
            offset: 0,
            size: std::num::NonZeroU64::new(PARAM_BYTES),
        }),
    }];
    for (i, m) in d.buffers.iter().enumerate() {
        entries.push(wgpu::BindGroupEntry {
            binding: i as u32 + 1,
            resource: m.buf.as_ref().expect("a device buffer").as_entire_binding(),
        });
    }
    g.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some(d.kernel.name()),
        layout: &g.layouts[d.kernel.storage_buffers() - 1].0,
        entries: &entries,
    })
}

fn layout(device: &wgpu::Device, storage: usize) -> (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
    let mut entries = vec![wgpu::BindGroupLayoutEntry {
        binding: 0,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Uniform,
            has_dynamic_offset: true,
            min_binding_size: std::num::NonZeroU64::new(PARAM_BYTES),
        },
        count: None,
    }];
    for i in 0..storage {
        entries.push(wgpu::BindGroupLayoutEntry {
            binding: i as u32 + 1,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only: false },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        });
    }
    let bgl = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: Some("kiln"),
        entries: &entries,
    });
    let pl = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
        label: Some("kiln"),
        bind_group_layouts: &[Some(&bgl)],
        immediate_size: 0,
    });
    (bgl, pl)
}
