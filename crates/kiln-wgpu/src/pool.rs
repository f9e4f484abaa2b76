//! Device memory accounting: the same tags and the same refusal as
//! [`kiln_core::MemoryPool`], whose counters the device pool reuses, with the device's
//! limit rule: the device's memory (the Vulkan device-local heap; on Metal the device's
//! recommended working set), or `KILN_MEMORY_LIMIT` or an explicit limit when smaller.
//! wgpu's own refusal becomes [`WgpuError::DeviceOutOfMemory`], whose message starts
//! `out of memory:` too.

use kiln_core::pool::LimitError;
use kiln_core::{Lease, MemoryPool, PoolStats, Tag};

use crate::error::WgpuError;

/// The device pool's limit: `device` bytes, or the smallest of the limits given.
pub fn device_limit(device: u64, limits: &[Option<u64>]) -> u64 {
    limits.iter().flatten().fold(device, |a, &l| a.min(l))
}

/// The accounting of one device's memory.
#[derive(Clone, Debug)]
pub struct DevicePool {
    pool: MemoryPool,
}

impl DevicePool {
    /// A pool limited by [`device_limit`] of `device`, `limit` and `KILN_MEMORY_LIMIT`.
    pub fn from_env(device: u64, limit: Option<u64>) -> Result<DevicePool, LimitError> {
        Ok(Self::with_limit(device_limit(device, &[limit, MemoryPool::limit_from_env()?])))
    }

    /// A pool refusing anything above `limit` bytes live.
    pub fn with_limit(limit: u64) -> DevicePool {
        DevicePool { pool: MemoryPool::with_limit(limit) }
    }

    /// Counts `bytes` under `tag`, or refuses with `out of memory:`.
    pub fn reserve(&self, tag: Tag, bytes: u64) -> Result<Lease, WgpuError> {
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
    fn the_limit_is_the_devices_memory_or_the_smallest_limit_given() {
        assert_eq!(device_limit(80 << 30, &[None, None]), 80 << 30);
        assert_eq!(device_limit(80 << 30, &[Some(1 << 30), None]), 1 << 30);
        assert_eq!(device_limit(80 << 30, &[Some(4 << 30), Some(2 << 30)]), 2 << 30);
        assert_eq!(device_limit(1 << 30, &[Some(80 << 30)]), 1 << 30, "never above the device");
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
    fn the_devices_refusal_reads_as_out_of_memory() {
        let e = WgpuError::DeviceOutOfMemory {
            requested: 1 << 20,
            tag: Tag::Kv,
            in_use: 5,
            detail: "Out of Memory".into(),
        };
        assert!(e.is_out_of_memory());
        let m = e.to_string();
        assert!(m.starts_with("out of memory:") && m.contains("1048576 bytes for kv"), "{m}");
    }
}
