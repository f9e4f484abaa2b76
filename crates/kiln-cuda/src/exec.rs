//! Where kiln's kernels run: an [`Exec`] is one GPU through the driver (feature `cuda`) or
//! the host execution of the same kernel source (feature `host-exec`), behind one
//! interface: allocate device memory counted in a [`DevicePool`] under a tag, copy to and
//! from it, and run a [`Launch`]. The device forward pass ([`crate::model`]) is written
//! against this alone, so what the tests run on the CPU is the forward the GPU runs,
//! launch for launch. The host execution runs one block after another on the calling
//! thread: it is for tests and for `KILN_CUDA_EMULATE`, not for speed.

use kiln_core::{Lease, PoolStats, Tag};

use crate::error::CudaError;
use crate::launch::Launch;
use crate::pool::DevicePool;

/// One place kernels run.
pub enum Exec {
    /// A GPU.
    #[cfg(feature = "cuda")]
    Cuda(crate::device::Device),
    /// The host execution: host memory, the kernels compiled by the host C++ compiler.
    #[cfg(feature = "host-exec")]
    Host(HostExec),
    /// A plan: allocations are counted in the pool and nothing is stored or run, so a
    /// run's allocations made here give its peak without a device ([`crate::model::plan`]).
    Plan(DevicePool),
}

/// The host execution's memory accounting.
#[cfg(feature = "host-exec")]
pub struct HostExec {
    pool: DevicePool,
}

/// Memory of an [`Exec`], counted in its pool until dropped. Drop every `Mem` before its
/// `Exec` (a device's memory is freed through its context).
pub struct Mem {
    addr: u64,
    bytes: usize,
    kind: MemKind,
    _lease: Lease,
}

enum MemKind {
    Counted,
    #[cfg(feature = "cuda")]
    Device,
    /// 16-byte words, as the kernels read 16 bytes at a time.
    #[cfg(feature = "host-exec")]
    Host(#[allow(dead_code)] Box<[u128]>),
}

impl Mem {
    /// The address, for a [`Launch`] argument.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// The address `offset` bytes in; panics past the end.
    pub fn at(&self, offset: usize) -> u64 {
        assert!(offset <= self.bytes, "offset {offset} past a buffer of {} bytes", self.bytes);
        self.addr + offset as u64
    }

    /// Bytes allocated.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Copies `bytes` bytes of `src` from `src_offset` into this buffer at `dst_offset`,
    /// on the device that holds both (the executor that made them; its context current
    /// on this thread). Panics when either range lies outside its buffer.
    pub fn copy_range_from(
        &mut self,
        dst_offset: usize,
        src: &Mem,
        src_offset: usize,
        bytes: usize,
    ) -> Result<(), CudaError> {
        let fits = |at: usize, len: usize| at.checked_add(bytes).is_some_and(|end| end <= len);
        assert!(
            fits(src_offset, src.bytes) && fits(dst_offset, self.bytes),
            "a copy of {bytes} bytes from {src_offset} of {} into {dst_offset} of {}",
            src.bytes,
            self.bytes
        );
        if bytes == 0 {
            return Ok(());
        }
        match (&mut self.kind, &src.kind) {
            #[cfg(feature = "cuda")]
            (MemKind::Device, MemKind::Device) => crate::device::Device::dtod(
                self.addr + dst_offset as u64,
                src.addr + src_offset as u64,
                bytes,
            ),
            #[cfg(feature = "host-exec")]
            (MemKind::Host(d), MemKind::Host(s)) => {
                let from: &[u8] = bytemuck::cast_slice(&s[..]);
                let to: &mut [u8] = bytemuck::cast_slice_mut(&mut d[..]);
                to[dst_offset..dst_offset + bytes].copy_from_slice(&from[src_offset..src_offset + bytes]);
                Ok(())
            }
            (MemKind::Counted, MemKind::Counted) => Ok(()),
            #[allow(unreachable_patterns)]
            _ => unreachable!("a copy between buffers of two executors"),
        }
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        match &self.kind {
            #[cfg(feature = "cuda")]
            MemKind::Device => crate::device::Device::free_raw(self.addr),
            #[cfg(feature = "host-exec")]
            MemKind::Host(_) => {}
            MemKind::Counted => {}
        }
    }
}

impl Exec {
    /// The host execution with a pool refusing anything above `limit` bytes live.
    #[cfg(feature = "host-exec")]
    pub fn host(limit: u64) -> Exec {
        Exec::Host(HostExec { pool: DevicePool::with_limit(limit) })
    }

    /// A plan whose pool refuses anything above `limit` bytes live.
    pub fn plan(limit: u64) -> Exec {
        Exec::Plan(DevicePool::with_limit(limit))
    }

    /// GPU `ordinal`, its pool limited by its free memory or `KILN_MEMORY_LIMIT`.
    #[cfg(feature = "cuda")]
    pub fn cuda(ordinal: usize) -> Result<Exec, CudaError> {
        Ok(Exec::Cuda(crate::device::Device::open(ordinal)?))
    }

    /// GPU `ordinal`, its pool limited by its free memory or `limit` when smaller (`None`:
    /// `KILN_MEMORY_LIMIT`).
    #[cfg(feature = "cuda")]
    pub fn cuda_limited(ordinal: usize, limit: Option<u64>) -> Result<Exec, CudaError> {
        Ok(Exec::Cuda(crate::device::Device::open_limited(ordinal, limit)?))
    }

    /// What runs the kernels: the GPU's name, or `host execution`.
    pub fn name(&self) -> String {
        match self {
            #[cfg(feature = "cuda")]
            Exec::Cuda(d) => d.name().to_string(),
            #[cfg(feature = "host-exec")]
            Exec::Host(_) => "host execution".into(),
            Exec::Plan(_) => "plan".into(),
        }
    }

    /// Whether this is the host execution.
    pub fn is_host(&self) -> bool {
        match self {
            #[cfg(feature = "cuda")]
            Exec::Cuda(_) => false,
            #[cfg(feature = "host-exec")]
            Exec::Host(_) => true,
            Exec::Plan(_) => false,
        }
    }

    /// The pool every allocation is counted in.
    pub fn pool(&self) -> &DevicePool {
        match self {
            #[cfg(feature = "cuda")]
            Exec::Cuda(d) => d.pool(),
            #[cfg(feature = "host-exec")]
            Exec::Host(h) => &h.pool,
            Exec::Plan(p) => p,
        }
    }

    /// The pool's counters.
    pub fn stats(&self) -> PoolStats {
        self.pool().stats()
    }

    /// Allocates `bytes` counted under `tag`, or refuses with `out of memory:` (the pool's
    /// limit, or the driver's own refusal).
    pub fn alloc(&self, tag: Tag, bytes: usize) -> Result<Mem, CudaError> {
        match self {
            #[cfg(feature = "cuda")]
            Exec::Cuda(d) => {
                let (addr, lease) = d.alloc_raw(tag, bytes)?;
                Ok(Mem { addr, bytes, kind: MemKind::Device, _lease: lease })
            }
            #[cfg(feature = "host-exec")]
            Exec::Host(h) => {
                let lease = h.pool.reserve(tag, bytes as u64)?;
                let words = vec![0u128; bytes.div_ceil(16).max(1)].into_boxed_slice();
                let addr = words.as_ptr() as u64;
                Ok(Mem { addr, bytes, kind: MemKind::Host(words), _lease: lease })
            }
            Exec::Plan(p) => {
                let lease = p.reserve(tag, bytes as u64)?;
                Ok(Mem { addr: 0, bytes, kind: MemKind::Counted, _lease: lease })
            }
        }
    }

    /// Allocates and fills a buffer with `data`'s bytes.
    pub fn upload<T: bytemuck::Pod>(&self, tag: Tag, data: &[T]) -> Result<Mem, CudaError> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let mut m = self.alloc(tag, bytes.len())?;
        self.write(&mut m, 0, bytes)?;
        Ok(m)
    }

    /// Copies `data` into `m` at byte `offset`.
    pub fn write(&self, m: &mut Mem, offset: usize, data: &[u8]) -> Result<(), CudaError> {
        assert!(
            offset + data.len() <= m.bytes,
            "a write of {} bytes at {offset} into a buffer of {}",
            data.len(),
            m.bytes
        );
        match (self, &mut m.kind) {
            #[cfg(feature = "cuda")]
            (Exec::Cuda(_), MemKind::Device) => crate::device::Device::htod(m.addr + offset as u64, data),
            #[cfg(feature = "host-exec")]
            (Exec::Host(_), MemKind::Host(words)) => {
                let all: &mut [u8] = bytemuck::cast_slice_mut(&mut words[..]);
                all[offset..offset + data.len()].copy_from_slice(data);
                Ok(())
            }
            (Exec::Plan(_), MemKind::Counted) => Ok(()),
            #[allow(unreachable_patterns)]
            _ => unreachable!("a buffer is used only with the executor that made it"),
        }
    }

    /// Copies `out.len()` values from the start of `m`.
    pub fn read<T: bytemuck::Pod>(&self, m: &Mem, offset: usize, out: &mut [T]) -> Result<(), CudaError> {
        let out: &mut [u8] = bytemuck::cast_slice_mut(out);
        assert!(
            offset + out.len() <= m.bytes,
            "a read of {} bytes at {offset} from a buffer of {}",
            out.len(),
            m.bytes
        );
        self.synchronize()?;
        match (self, &m.kind) {
            #[cfg(feature = "cuda")]
            (Exec::Cuda(_), MemKind::Device) => crate::device::Device::dtoh(m.addr + offset as u64, out),
            #[cfg(feature = "host-exec")]
            (Exec::Host(_), MemKind::Host(words)) => {
                let all: &[u8] = bytemuck::cast_slice(&words[..]);
                out.copy_from_slice(&all[offset..offset + out.len()]);
                Ok(())
            }
            (Exec::Plan(_), MemKind::Counted) => {
                out.fill(0);
                Ok(())
            }
            #[allow(unreachable_patterns)]
            _ => unreachable!("a buffer is used only with the executor that made it"),
        }
    }

    /// Copies all of `src` into `dst` (which holds at least as many bytes) on the device.
    pub fn copy(&self, dst: &mut Mem, src: &Mem) -> Result<(), CudaError> {
        assert!(src.bytes <= dst.bytes, "a copy of {} bytes into a buffer of {}", src.bytes, dst.bytes);
        match (self, &mut dst.kind, &src.kind) {
            #[cfg(feature = "cuda")]
            (Exec::Cuda(_), MemKind::Device, MemKind::Device) => {
                crate::device::Device::dtod(dst.addr, src.addr, src.bytes)
            }
            #[cfg(feature = "host-exec")]
            (Exec::Host(_), MemKind::Host(d), MemKind::Host(s)) => {
                let n = src.bytes;
                let from: &[u8] = bytemuck::cast_slice(&s[..]);
                let to: &mut [u8] = bytemuck::cast_slice_mut(&mut d[..]);
                to[..n].copy_from_slice(&from[..n]);
                Ok(())
            }
            (Exec::Plan(_), MemKind::Counted, MemKind::Counted) => Ok(()),
            #[allow(unreachable_patterns)]
            _ => unreachable!("a buffer is used only with the executor that made it"),
        }
    }

    /// Makes this executor usable from the calling thread (a GPU's context made current
    /// there; nothing for the host execution or a plan).
    pub fn bind_to_thread(&self) -> Result<(), CudaError> {
        match self {
            #[cfg(feature = "cuda")]
            Exec::Cuda(d) => d.make_current(),
            #[cfg(feature = "host-exec")]
            Exec::Host(_) => Ok(()),
            Exec::Plan(_) => Ok(()),
        }
    }

    /// Queues `launch` (the host execution runs it at once).
    ///
    /// # Safety
    /// Every pointer argument must lie inside a live [`Mem`] of this executor holding the
    /// bytes the kernel reads or writes for the launch's shape ([`crate::launch`] gives
    /// them), and buffers a kernel takes as `__restrict__` must not overlap.
    pub unsafe fn launch(&self, launch: &Launch) -> Result<(), CudaError> {
        match self {
            // SAFETY: the caller's promise, as `Device::launch` asks it.
            #[cfg(feature = "cuda")]
            Exec::Cuda(d) => unsafe { d.launch(launch) },
            // SAFETY: the caller's promise, as `host::run` asks it.
            #[cfg(feature = "host-exec")]
            Exec::Host(_) => unsafe { crate::host::run(launch) },
            Exec::Plan(_) => Err(CudaError::Unsupported {
                what: format!("{}: a plan counts memory and runs nothing", launch.kernel),
            }),
        }
    }

    /// Runs `launches`, a decode step, through `graph`: on a GPU as one CUDA graph (built
    /// on the first step or when the structure changes, else its changed nodes updated in
    /// place, [`crate::graph::diff`]); on the host execution launch by launch.
    ///
    /// # Safety
    /// As for [`Exec::launch`], for every launch in the list.
    pub unsafe fn replay(
        &self,
        graph: &mut crate::graph::StepGraph,
        launches: Vec<Launch>,
    ) -> Result<(), CudaError> {
        use crate::graph::{Change, diff};
        let change =
            if graph.stats.replays == 0 { Change::Structure } else { diff(&graph.launches, &launches) };
        match self {
            #[cfg(feature = "cuda")]
            Exec::Cuda(d) => {
                match (&change, graph.device.as_ref()) {
                    (Change::Structure, _) | (_, None) => {
                        graph.device = None;
                        // SAFETY: the caller's promise for every launch.
                        graph.device = Some(unsafe { d.build_graph(&launches) }?);
                        graph.stats.builds += 1;
                    }
                    (Change::Params(idx), Some(g)) => {
                        for &i in idx {
                            // SAFETY: as above.
                            unsafe { d.update_node(g, i, &launches[i]) }?;
                        }
                        graph.stats.node_updates += idx.len() as u64;
                    }
                    (Change::None, Some(_)) => {}
                }
                d.launch_graph(graph.device.as_ref().expect("built above"))?;
            }
            _ => {
                match &change {
                    Change::Structure => graph.stats.builds += 1,
                    Change::Params(idx) => graph.stats.node_updates += idx.len() as u64,
                    Change::None => {}
                }
                for l in &launches {
                    // SAFETY: the caller's promise for every launch.
                    unsafe { self.launch(l) }?;
                }
            }
        }
        graph.launches = launches;
        graph.stats.replays += 1;
        Ok(())
    }

    /// Waits for every queued launch.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        match self {
            #[cfg(feature = "cuda")]
            Exec::Cuda(d) => d.synchronize(),
            #[cfg(feature = "host-exec")]
            Exec::Host(_) | Exec::Plan(_) => Ok(()),
        }
    }
}

#[cfg(all(test, feature = "host-exec"))]
mod tests {
    use super::*;

    #[test]
    fn host_memory_is_counted_refused_over_the_limit_and_round_trips() {
        let e = Exec::host(1000);
        let m = e.upload(Tag::Weights, &[1.5f32, -2.0, 3.25]).unwrap();
        assert_eq!((m.bytes(), m.addr() % 16), (12, 0));
        let mut back = [0f32; 2];
        e.read(&m, 4, &mut back).unwrap();
        assert_eq!(back, [-2.0, 3.25]);
        let mut twin = e.alloc(Tag::Scratch, 12).unwrap();
        e.copy(&mut twin, &m).unwrap();
        e.read(&twin, 0, &mut back).unwrap();
        assert_eq!(back, [1.5, -2.0]);
        drop(twin);
        let err = e.alloc(Tag::Kv, 989).err().expect("over the limit");
        assert!(err.is_out_of_memory() && err.to_string().starts_with("out of memory:"), "{err}");
        let kv = e.alloc(Tag::Kv, 988).unwrap();
        let st = e.stats();
        assert_eq!((st.live_bytes, st.peak_bytes), (1000, 1000));
        drop((m, kv));
        assert_eq!(e.stats().live_bytes, 0);
        assert_eq!(e.name(), "host execution");
    }
}
