//! Typed storage for weights and caches: [`PoolVec`] owns memory counted by a pool;
//! [`Buffer`] is read-only data that is either owned or a typed view into shared bytes
//! (a memory-mapped checkpoint), so large tensors are never copied just to be read.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use crate::arena::Slot;
use crate::pool::{Lease, MemoryPool, OutOfMemory, Tag};

/// Bytes that can be shared between threads and viewed as typed slices, such as a
/// memory map. kiln-model implements it for `memmap2::Mmap`.
pub trait SharedBytes: Send + Sync {
    /// The bytes.
    fn bytes(&self) -> &[u8];
}

impl SharedBytes for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// A vector whose bytes are counted by a [`crate::MemoryPool`] until it is dropped.
pub struct PoolVec<T> {
    store: Store<T>,
    lease: Lease,
}

/// Where a [`PoolVec`]'s elements live: an ordinary vector, or a slot of the pool's weight
/// arena (huge pages).
pub(crate) enum Store<T> {
    Vec(Vec<T>),
    Arena(Slot<T>),
}

impl<T> PoolVec<T> {
    pub(crate) fn new(store: Store<T>, lease: Lease) -> Self {
        PoolVec { store, lease }
    }

    /// Bytes counted for this vector.
    pub fn counted_bytes(&self) -> u64 {
        self.lease.bytes()
    }
}

impl<T> Deref for PoolVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.store {
            Store::Vec(v) => v,
            Store::Arena(s) => s.as_slice(),
        }
    }
}

impl<T> DerefMut for PoolVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.store {
            Store::Vec(v) => v,
            Store::Arena(s) => s.as_mut_slice(),
        }
    }
}

impl<T> fmt::Debug for PoolVec<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolVec").field("len", &self.len()).field("lease", &self.lease).finish()
    }
}

/// Why a typed view of shared bytes could not be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BufferError {
    /// The range runs past the end of the bytes.
    #[error("tensor bytes {start}..{end} lie outside a {len}-byte file")]
    OutOfBounds {
        /// First byte.
        start: usize,
        /// One past the last byte.
        end: usize,
        /// Bytes available.
        len: usize,
    },
    /// The range is not a whole number of elements.
    #[error("tensor of {bytes} bytes is not a whole number of {elem}-byte elements")]
    Ragged {
        /// Bytes in the range.
        bytes: usize,
        /// Element size.
        elem: usize,
    },
    /// The range does not start on the element's alignment.
    #[error("tensor at byte offset {offset} is not aligned to {align} bytes")]
    Misaligned {
        /// Address offset within the bytes.
        offset: usize,
        /// Alignment required.
        align: usize,
    },
}

/// Read-only typed data, owned or viewed in place.
pub struct Buffer<T: bytemuck::Pod> {
    repr: Repr<T>,
}

enum Repr<T> {
    Plain(Vec<T>),
    Pooled(PoolVec<T>),
    Shared { bytes: Arc<dyn SharedBytes>, start: usize, len: usize, _lease: Option<Lease> },
}

impl<T: bytemuck::Pod> Buffer<T> {
    /// Wraps a vector the pool does not count (small tensors, tests).
    pub fn from_vec(vec: Vec<T>) -> Self {
        Buffer { repr: Repr::Plain(vec) }
    }

    /// Wraps a pool-counted vector.
    pub fn from_pool(vec: PoolVec<T>) -> Self {
        Buffer { repr: Repr::Pooled(vec) }
    }

    /// A typed view of `bytes[start..end]`, which must be aligned for `T`. `lease`, when
    /// given, keeps the view's bytes counted by a pool for as long as it lives.
    pub fn from_shared(
        bytes: Arc<dyn SharedBytes>,
        start: usize,
        end: usize,
        lease: Option<Lease>,
    ) -> Result<Self, BufferError> {
        let all = bytes.bytes();
        if start > end || end > all.len() {
            return Err(BufferError::OutOfBounds { start, end, len: all.len() });
        }
        let elem = size_of::<T>();
        if !(end - start).is_multiple_of(elem) {
            return Err(BufferError::Ragged { bytes: end - start, elem });
        }
        let align = align_of::<T>();
        if !(all.as_ptr() as usize + start).is_multiple_of(align) {
            return Err(BufferError::Misaligned { offset: start, align });
        }
        let len = (end - start) / elem;
        Ok(Buffer { repr: Repr::Shared { bytes, start, len, _lease: lease } })
    }

    /// Whether the data is a view into shared bytes rather than owned.
    pub fn is_shared(&self) -> bool {
        matches!(self.repr, Repr::Shared { .. })
    }

    /// The data, writable, when it is owned (a plain or pool-counted vector); `None` for
    /// a view into shared bytes, which are read-only.
    pub fn owned_mut(&mut self) -> Option<&mut [T]> {
        match &mut self.repr {
            Repr::Plain(v) => Some(v),
            Repr::Pooled(v) => Some(v),
            Repr::Shared { .. } => None,
        }
    }

    /// Bytes of data.
    pub fn byte_len(&self) -> usize {
        self.len() * size_of::<T>()
    }
}

impl<T: bytemuck::Pod> Deref for Buffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.repr {
            Repr::Plain(v) => v,
            Repr::Pooled(v) => v,
            Repr::Shared { bytes, start, len, .. } => {
                let raw = &bytes.bytes()[*start..*start + *len * size_of::<T>()];
                // Alignment and length were checked in `from_shared`, and the bytes are
                // immutable for the lifetime of the Arc.
                bytemuck::cast_slice(raw)
            }
        }
    }
}

impl<T: bytemuck::Pod> fmt::Debug for Buffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer").field("len", &self.len()).field("shared", &self.is_shared()).finish()
    }
}

impl<T: bytemuck::Pod> From<Vec<T>> for Buffer<T> {
    fn from(v: Vec<T>) -> Self {
        Buffer::from_vec(v)
    }
}

/// The pool's allocations of typed storage (here, beside the storage, so the pool never
/// names the buffers it counts).
impl MemoryPool {
    /// Allocates `len` zeroed elements, counted under `tag`. [`Tag::Weights`] go to the
    /// pool's weight arena, in huge pages where the system gives them ([`crate::arena`]);
    /// its chunks are never reused, which suits memory allocated once per model.
    pub fn alloc_zeroed<T: bytemuck::Zeroable + Copy>(
        &self,
        tag: Tag,
        len: usize,
    ) -> Result<PoolVec<T>, OutOfMemory> {
        let bytes = (len as u64).saturating_mul(size_of::<T>() as u64);
        let lease = self.reserve(tag, bytes)?;
        let store = if tag == Tag::Weights {
            // Weights stream from memory on every decode step: huge pages ([`crate::arena`]).
            self.arena_slot::<T>(len).map(Store::Arena)
        } else {
            let mut vec = Vec::new();
            vec.try_reserve_exact(len).ok().map(|()| {
                vec.resize(len, T::zeroed());
                Store::Vec(vec)
            })
        };
        match store {
            Some(store) => Ok(PoolVec::new(store, lease)),
            None => {
                // The system refused: `lease` is still held, so the live bytes count it.
                let in_use = self.stats().live_bytes - bytes;
                Err(OutOfMemory { requested: bytes, tag, in_use, limit: u64::MAX })
            }
        }
    }

    /// Takes ownership of an existing vector, counting its length under `tag`.
    pub fn adopt<T: Copy>(&self, tag: Tag, vec: Vec<T>) -> Result<PoolVec<T>, OutOfMemory> {
        let bytes = (vec.len() * size_of::<T>()) as u64;
        let lease = self.reserve(tag, bytes)?;
        Ok(PoolVec::new(Store::Vec(vec), lease))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_views_check_bounds_and_alignment() {
        let mut raw = vec![0u8; 64];
        raw[8..12].copy_from_slice(&7u32.to_le_bytes());
        let shared: Arc<dyn SharedBytes> = Arc::new(raw);
        let base = shared.bytes().as_ptr() as usize;
        // Vec<u8> storage is at least 4-aligned on every allocator kiln runs on, but do
        // not assume it: pick an aligned start.
        let start = (4 - base % 4) % 4 + 8;
        let b = Buffer::<u32>::from_shared(Arc::clone(&shared), start, start + 16, None).unwrap();
        assert_eq!(b.len(), 4);
        assert!(matches!(
            Buffer::<u32>::from_shared(Arc::clone(&shared), start + 1, start + 5, None),
            Err(BufferError::Misaligned { .. })
        ));
        assert!(matches!(
            Buffer::<u32>::from_shared(Arc::clone(&shared), start, start + 6, None),
            Err(BufferError::Ragged { .. })
        ));
        assert!(matches!(
            Buffer::<u32>::from_shared(shared, 0, 65, None),
            Err(BufferError::OutOfBounds { .. })
        ));
    }
}
