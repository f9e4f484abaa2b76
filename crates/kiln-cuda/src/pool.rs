//! Device memory accounting: the same tags and the same refusal as
//! [`kiln_core::MemoryPool`], whose counters the device pool reuses, with the device's
//! limit rule: the free device memory at start, or `KILN_MEMORY_LIMIT` when that is
//! smaller. The driver's own refusal (`CUDA_ERROR_OUT_OF_MEMORY`) becomes
//! [`CudaError::DeviceOutOfMemory`], whose message starts `out of memory:` too.

use kiln_core::pool::LimitError;
use kiln_core::{Lease, MemoryPool, PoolStats, Tag};

use crate::error::CudaError;

/// `CUDA_ERROR_OUT_OF_MEMORY`'s value in the driver API.
pub const CUDA_ERROR_OUT_OF_MEMORY: u32 = 2;

/// The device pool's limit: `free` bytes of device memory, or `env_limit` when smaller.
pub fn device_limit(free: u64, env_limit: Option<u64>) -> u64 {
    env_limit.map_or(free, |l| l.min(free))
}

/// What a failed device allocation means: out of memory for the driver's
/// `CUDA_ERROR_OUT_OF_MEMORY`, a driver failure otherwise.
pub fn alloc_failure(code: u32, detail: String, requested: u64, tag: Tag, in_use: u64) -> CudaError {
    if code == CUDA_ERROR_OUT_OF_MEMORY {
        CudaError::DeviceOutOfMemory { requested, tag, in_use }
    } else {
        CudaError::Driver { call: "cuMemAlloc", detail }
    }
}

/// The accounting of one device's memory.
#[derive(Clone, Debug)]
pub struct DevicePool {
    pool: MemoryPool,
}

impl DevicePool {
    /// A pool limited by [`device_limit`] of `free` and `KILN_MEMORY_LIMIT`.
    pub fn from_env(free: u64) -> Result<DevicePool, LimitError> {
        Ok(Self::with_limit(device_limit(free, MemoryPool::limit_from_env()?)))
    }

    /// A pool refusing anything above `limit` bytes live.
    pub fn with_limit(limit: u64) -> DevicePool {
        DevicePool { pool: MemoryPool::with_limit(limit) }
    }

    /// Counts `bytes` under `tag`, or refuses with `out of memory:`.
    pub fn reserve(&self, tag: Tag, bytes: u64) -> Result<Lease, CudaError> {
        Ok(self.pool.reserve(tag, bytes)?)
    }

    /// The limit in bytes.
    pub fn limit(&self) -> u64 {
        self.pool.limit()
    }

    /// Live and peak counters, per tag.
    pub fn stats(&self) -> PoolStats {
        self.pool.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_is_free_memory_or_the_smaller_env_limit() {
        assert_eq!(device_limit(80 << 30, None), 80 << 30);
        assert_eq!(device_limit(80 << 30, Some(1 << 30)), 1 << 30);
        assert_eq!(device_limit(1 << 30, Some(80 << 30)), 1 << 30, "never above the free memory");
    }

    #[test]
    fn refusals_are_out_of_memory_with_tags_and_peaks() {
        let p = DevicePool::with_limit(1000);
        let w = p.reserve(Tag::Weights, 600).unwrap();
        let kv = p.reserve(Tag::Kv, 300).unwrap();
        let e = p.reserve(Tag::Scratch, 200).unwrap_err();
        assert!(e.is_out_of_memory());
        assert!(e.to_string().starts_with("out of memory:"), "{e}");
        assert!(e.to_string().contains("scratch"), "{e}");
        drop(kv);
        let _s = p.reserve(Tag::Scratch, 200).unwrap();
        let st = p.stats();
        assert_eq!((st.live_bytes, st.peak_bytes, st.limit_bytes), (800, 900, Some(1000)));
        assert_eq!(st.by_tag["kv"].peak, 300);
        drop(w);
    }

    #[test]
    fn the_drivers_refusal_is_out_of_memory_and_other_failures_are_not() {
        let e =
            alloc_failure(CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY".into(), 1 << 20, Tag::Kv, 5);
        assert!(e.is_out_of_memory());
        let m = e.to_string();
        assert!(m.starts_with("out of memory:") && m.contains("1048576 bytes for kv"), "{m}");
        let e = alloc_failure(1, "CUDA_ERROR_INVALID_VALUE".into(), 1, Tag::Kv, 0);
        assert!(!e.is_out_of_memory());
        assert!(e.to_string().contains("cuMemAlloc"), "{e}");
    }
}
