//! Where a pool puts weights: fresh anonymous memory, cut from chunks that start on a
//! 2 MiB boundary and are advised to the kernel as huge pages before anything touches
//! them.
//!
//! A decode step streams every weight from memory once. In 4 KiB pages that is one TLB
//! miss (and one restart of the hardware prefetchers, which stop at page boundaries)
//! every 4 KiB; in 2 MiB pages, one every 2 MiB. A GGUF model's tensors are loaded one
//! allocation each, mostly under 2 MiB (every matrix of SmolLM2-135M's layers, the
//! attention matrices of Qwen2.5-0.5B's), so advising each allocation alone would leave
//! most of them in small pages: they share chunks instead, one after another in load
//! order. The synthetic models already generate all their weights into one advised
//! arena.
//!
//! Chunks are never reused: an allocation's bytes stay mapped until every allocation of
//! its chunk is dropped (and the pool has moved on to another chunk), and new
//! allocations only ever take untouched, zero-filled memory. Weights are loaded once and
//! live as long as their model, which is what this suits.

use std::marker::PhantomData;
use std::sync::Arc;

/// The huge page size chunks align to (x86-64's and aarch64's usual 2 MiB).
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// Bytes of a shared chunk. Requests above [`OWN_CHUNK_FROM`] get a chunk of their own.
const CHUNK: usize = 16 << 20;

/// Requests from this size on get a chunk of their own, so a shared chunk never wastes
/// more than this at its end.
const OWN_CHUNK_FROM: usize = 4 << 20;

/// Alignment of every allocation inside a chunk: a cache line, more than any element
/// type the pool stores needs.
pub(crate) const ALIGN: usize = 64;

/// One anonymous mapping; `base..base + cap` is its part on huge page boundaries.
pub(crate) struct Chunk {
    /// Owns the mapping (unmapped on drop); never read through after creation.
    _map: memmap2::MmapMut,
    base: *mut u8,
    cap: usize,
}

// SAFETY: a chunk is only an owned mapping and its address. The bytes are reached
// through `Slot`s, each of which owns a disjoint range (`Arena::take` never hands out a
// byte twice), so sharing the chunk between threads shares no bytes.
unsafe impl Send for Chunk {}
// SAFETY: as above; `&Chunk` gives no access to the bytes at all.
unsafe impl Sync for Chunk {}

impl Chunk {
    /// A chunk of at least `bytes` (rounded up to whole huge pages), zero-filled and not
    /// yet touched, its first `advised` bytes (whole huge pages) advised as huge pages.
    /// `None` when the system refuses the mapping.
    fn new(bytes: usize, advised: usize) -> Option<Arc<Chunk>> {
        let cap = bytes.checked_next_multiple_of(HUGE_PAGE)?;
        // One huge page more than the chunk, so an aligned start lies inside.
        let mut map = memmap2::MmapOptions::new().len(cap.checked_add(HUGE_PAGE)?).map_anon().ok()?;
        let start = map.as_mut_ptr();
        let skip = (start as usize).next_multiple_of(HUGE_PAGE) - start as usize;
        // A hint: refused (an old kernel, THP disabled), the chunk is still ordinary memory.
        #[cfg(target_os = "linux")]
        if advised > 0 {
            let _ = map.advise_range(memmap2::Advice::HugePage, skip, advised.min(cap));
        }
        #[cfg(not(target_os = "linux"))]
        let _ = advised;
        // SAFETY: `skip < HUGE_PAGE`, so `skip..skip + cap` lies inside the mapping.
        let base = unsafe { start.add(skip) };
        Some(Arc::new(Chunk { _map: map, base, cap }))
    }
}

/// A pool's weight arena: the chunk being filled and how much of it is taken.
#[derive(Default)]
pub(crate) struct Arena {
    open: Option<(Arc<Chunk>, usize)>,
}

impl Arena {
    /// `len` zeroed elements of `T` no other slot shares; `None` when the system refuses
    /// the memory. `T`'s alignment must be at most [`ALIGN`].
    pub(crate) fn take<T>(&mut self, len: usize) -> Option<Slot<T>> {
        assert!(align_of::<T>() <= ALIGN, "arena: {}-byte alignment is over {ALIGN}", align_of::<T>());
        let bytes = len.checked_mul(size_of::<T>())?;
        if bytes >= OWN_CHUNK_FROM {
            // Only the huge pages the allocation fills: its last, partial one stays in small
            // pages, where a huge one would hold up to 2 MiB more than the allocation uses.
            let whole = bytes / HUGE_PAGE * HUGE_PAGE;
            return Some(Slot { chunk: Chunk::new(bytes, whole)?, off: 0, len, _t: PhantomData });
        }
        let room = |(c, used): &(Arc<Chunk>, usize)| used.next_multiple_of(ALIGN) + bytes <= c.cap;
        if !self.open.as_ref().is_some_and(room) {
            // A shared chunk is advised whole (what later allocations will take is not known),
            // so the huge page holding its last allocation's end is the most it holds unused.
            self.open = Some((Chunk::new(CHUNK, CHUNK)?, 0));
        }
        let (chunk, used) = self.open.as_mut()?;
        let off = used.next_multiple_of(ALIGN);
        *used = off + bytes;
        Some(Slot { chunk: Arc::clone(chunk), off, len, _t: PhantomData })
    }
}

/// `len` elements of `T` at byte `off` of a chunk, owned by this slot alone.
pub(crate) struct Slot<T> {
    chunk: Arc<Chunk>,
    off: usize,
    len: usize,
    _t: PhantomData<T>,
}

impl<T> Slot<T> {
    /// The elements.
    pub(crate) fn as_slice(&self) -> &[T] {
        // SAFETY: `off..off + len * size_of::<T>()` lies inside the chunk, is aligned for
        // `T` (a multiple of ALIGN from a huge page boundary), was zero-filled by the
        // system (all-zero bytes are a valid `T` for every type the pool stores, which are
        // `Zeroable`), and belongs to this slot alone.
        unsafe { std::slice::from_raw_parts(self.chunk.base.add(self.off).cast::<T>(), self.len) }
    }

    /// The elements, mutably.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only reference to the range.
        unsafe { std::slice::from_raw_parts_mut(self.chunk.base.add(self.off).cast::<T>(), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_zeroed_aligned_and_disjoint() {
        let mut arena = Arena::default();
        let mut a = arena.take::<u32>(1000).unwrap();
        let mut b = arena.take::<u16>(3).unwrap();
        let mut c = arena.take::<f32>(5 << 20).unwrap();
        assert!(a.as_slice().iter().all(|&x| x == 0) && b.as_slice().iter().all(|&x| x == 0));
        assert!(c.as_slice().iter().all(|&x| x == 0.0));
        for p in [a.as_slice().as_ptr() as usize, b.as_slice().as_ptr() as usize] {
            assert!(p.is_multiple_of(ALIGN));
        }
        // The large request has a chunk of its own, from a huge page boundary.
        assert!((c.as_slice().as_ptr() as usize).is_multiple_of(HUGE_PAGE));
        a.as_mut_slice().fill(7);
        b.as_mut_slice().fill(9);
        c.as_mut_slice().fill(1.5);
        assert!(a.as_slice().iter().all(|&x| x == 7));
        assert!(b.as_slice().iter().all(|&x| x == 9));
        // Filling the shared chunk moves on to a fresh one; earlier slots keep their bytes.
        let fill: Vec<Slot<u8>> =
            (0..CHUNK / (3 << 20) + 1).map(|_| arena.take::<u8>(3 << 20).unwrap()).collect();
        let chunks: std::collections::HashSet<usize> =
            fill.iter().map(|s| s.as_slice().as_ptr() as usize / CHUNK).collect();
        assert!(chunks.len() >= 2, "{} shared slots of 3 MiB stayed in one chunk", fill.len());
        assert!(fill.iter().all(|s| s.as_slice().iter().all(|&x| x == 0)));
        assert!(a.as_slice().iter().all(|&x| x == 7) && b.as_slice().iter().all(|&x| x == 9));
        drop(arena);
        assert!(c.as_slice().iter().all(|&x| x == 1.5));
    }

    /// The `VmFlags` of the mapping holding `addr`, from /proc/self/smaps.
    #[cfg(target_os = "linux")]
    fn vm_flags(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((a, b)) = range.split_once('-')
                && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
            {
                inside = (a..b).contains(&addr);
            } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.trim().to_string();
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    /// Whether `MADV_HUGEPAGE` shows in smaps here at all: qemu-user (CI's aarch64 run)
    /// accepts the call without passing it to the kernel.
    #[cfg(target_os = "linux")]
    fn advice_shows() -> bool {
        let map = memmap2::MmapOptions::new().len(2 * HUGE_PAGE).map_anon().unwrap();
        map.advise(memmap2::Advice::HugePage).is_ok()
            && vm_flags(map.as_ptr() as usize).split(' ').any(|f| f == "hg")
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn slots_lie_in_memory_advised_as_huge_pages() {
        if !advice_shows() {
            eprintln!("MADV_HUGEPAGE does not show in /proc/self/smaps here (an emulator?): nothing checked");
            return;
        }
        let mut arena = Arena::default();
        let small = arena.take::<u32>(1000).unwrap();
        let large = arena.take::<u8>(OWN_CHUNK_FROM + 12345).unwrap();
        for (what, p) in
            [("shared", small.as_slice().as_ptr() as usize), ("own", large.as_slice().as_ptr() as usize)]
        {
            let flags = vm_flags(p);
            // `hg`: MADV_HUGEPAGE was given for this mapping (whether or not the kernel
            // has huge pages to back it, which depends on the machine).
            assert!(flags.split(' ').any(|f| f == "hg"), "{what} chunk's mapping has flags {flags}");
        }
        // The own chunk's last, partial huge page is left in small pages.
        let tail = large.as_slice().as_ptr() as usize + OWN_CHUNK_FROM;
        let flags = vm_flags(tail);
        assert!(!flags.split(' ').any(|f| f == "hg"), "the partial last huge page is advised: {flags}");
    }

    #[test]
    fn an_empty_slot_is_empty() {
        let mut arena = Arena::default();
        assert!(arena.take::<u64>(0).unwrap().as_slice().is_empty());
    }
}
