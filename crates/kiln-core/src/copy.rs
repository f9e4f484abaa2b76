//! Copying a set of large byte ranges at memory speed: all the bytes split once, evenly,
//! into [`RUNS_PER_THREAD`] contiguous runs per worker thread (runs cross range
//! boundaries), each run written with non-temporal stores on x86-64 when the copy is
//! large.
//!
//! A plain store to a line not in cache first reads that line (read-for-ownership), so a
//! plain copy moves three bytes over the memory bus per byte copied; a non-temporal
//! store writes the line without reading it, so a streamed copy moves two. Streaming
//! also leaves the caches to the data that will be reused (the destination of a large
//! copy would not fit in them anyway). Small copies stay on the calling thread with
//! plain stores: dispatching them to the pool costs more than it saves.

use rayon::prelude::*;

/// Copies of at least this many bytes in total are split across the pool's threads.
pub const PARALLEL_MIN: usize = 256 << 10;

/// Copies of at least this many bytes in total use non-temporal stores where the target
/// has them: beyond a core's L2, where the destination could not stay cached anyway.
pub const STREAM_MIN: usize = 1 << 20;

/// Runs per worker thread: a few, so that on a shared machine a thread that is
/// descheduled holds up only its current run while the others take the rest.
pub const RUNS_PER_THREAD: usize = 4;

/// How stores are issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stores {
    /// Ordinary stores (`copy_from_slice`).
    Plain,
    /// Non-temporal stores on x86-64 (SSE2, present on every x86-64 CPU); plain stores
    /// elsewhere.
    Streaming,
}

impl Stores {
    /// What [`copy_ranges`] uses for a copy of `total` bytes.
    pub fn for_bytes(total: usize) -> Stores {
        if total >= STREAM_MIN { Stores::Streaming } else { Stores::Plain }
    }
}

/// Copies each `(from, to)` pair (equal lengths) on the current rayon pool, with the
/// stores [`Stores::for_bytes`] picks for the total.
///
/// # Panics
/// When a pair's lengths differ.
pub fn copy_ranges(pairs: Vec<(&[u8], &mut [u8])>) {
    let total = pairs.iter().map(|(f, _)| f.len()).sum();
    copy_ranges_with(pairs, Stores::for_bytes(total));
}

/// [`copy_ranges`] with the stores chosen by the caller (benchmarks compare the two).
///
/// # Panics
/// When a pair's lengths differ.
pub fn copy_ranges_with(pairs: Vec<(&[u8], &mut [u8])>, stores: Stores) {
    for (f, t) in &pairs {
        assert_eq!(f.len(), t.len(), "copy_ranges: source and destination lengths differ");
    }
    let total: usize = pairs.iter().map(|(f, _)| f.len()).sum();
    let threads = rayon::current_num_threads();
    if total < PARALLEL_MIN || threads == 1 {
        for (f, t) in pairs {
            copy_one(f, t, stores);
        }
        if stores == Stores::Streaming {
            fence();
        }
        return;
    }
    // Equal runs, cut on cache-line multiples of the running offset.
    let count = threads * RUNS_PER_THREAD;
    let per = total.div_ceil(count).next_multiple_of(64);
    let mut runs: Vec<Vec<(&[u8], &mut [u8])>> = (0..count).map(|_| Vec::new()).collect();
    let (mut run, mut room) = (0, per);
    for (mut f, mut t) in pairs {
        while !f.is_empty() {
            let n = f.len().min(room);
            let (fh, ft) = f.split_at(n);
            let (th, tt) = std::mem::take(&mut t).split_at_mut(n);
            runs[run].push((fh, th));
            (f, t) = (ft, tt);
            room -= n;
            if room == 0 {
                // per x count >= total, so only the last run can fill exactly at the end.
                run = (run + 1).min(count - 1);
                room = per;
            }
        }
    }
    runs.into_par_iter().for_each(|run| {
        for (f, t) in run {
            copy_one(f, t, stores);
        }
        if stores == Stores::Streaming {
            // Each thread orders its own streamed stores before the join publishes them.
            fence();
        }
    });
}

fn copy_one(from: &[u8], to: &mut [u8], stores: Stores) {
    match stores {
        Stores::Plain => to.copy_from_slice(from),
        Stores::Streaming => copy_streaming(from, to),
    }
}

#[cfg(target_arch = "x86_64")]
fn copy_streaming(from: &[u8], to: &mut [u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    // Plain stores up to the destination's first 16-byte boundary, then 64 bytes per
    // step (four unaligned loads, four aligned streamed stores), then the tail.
    let head = to.as_ptr().align_offset(16).min(to.len());
    to[..head].copy_from_slice(&from[..head]);
    let body = (to.len() - head) / 64 * 64;
    let (src, dst) = (&from[head..head + body], &mut to[head..head + body]);
    for (s, d) in src.chunks_exact(64).zip(dst.chunks_exact_mut(64)) {
        let (s, d) = (s.as_ptr() as *const __m128i, d.as_mut_ptr() as *mut __m128i);
        // SAFETY: `s` and `d` each point at 64 valid bytes (one chunk of slices of equal
        // length), which do not overlap (`&` and `&mut`); loads are unaligned, and every
        // store address is 16-byte aligned because `d` starts at a 16-byte boundary
        // (`head`) plus a multiple of 64. SSE2 is part of the x86-64 baseline.
        unsafe {
            let v = [
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            ];
            _mm_stream_si128(d, v[0]);
            _mm_stream_si128(d.add(1), v[1]);
            _mm_stream_si128(d.add(2), v[2]);
            _mm_stream_si128(d.add(3), v[3]);
        }
    }
    to[head + body..].copy_from_slice(&from[head + body..]);
}

#[cfg(not(target_arch = "x86_64"))]
fn copy_streaming(from: &[u8], to: &mut [u8]) {
    to.copy_from_slice(from);
}

/// Orders this thread's streamed stores before any later store: non-temporal stores are
/// weakly ordered, so without it another thread could read a slot's old bytes.
fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no operands and no preconditions; SSE is part of x86-64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8).collect()
    }

    /// Every byte arrives, for both store kinds, with lengths and offsets that leave heads
    /// and tails unaligned, serial and split across threads.
    #[test]
    fn copies_are_identical_to_the_source() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        for stores in [Stores::Plain, Stores::Streaming] {
            for lens in [vec![0, 1, 63, 64, 65], vec![1000, 3], vec![PARALLEL_MIN + 7, 129, 300_001]] {
                for offset in [0, 1, 5, 16] {
                    let src: Vec<Vec<u8>> =
                        lens.iter().enumerate().map(|(i, &n)| bytes(n, i as u8)).collect();
                    let mut backing: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0xAA; n + offset]).collect();
                    let pairs: Vec<(&[u8], &mut [u8])> =
                        src.iter().zip(backing.iter_mut()).map(|(s, d)| (&s[..], &mut d[offset..])).collect();
                    pool.install(|| copy_ranges_with(pairs, stores));
                    for (s, d) in src.iter().zip(&backing) {
                        assert!(d[..offset].iter().all(|&b| b == 0xAA), "{stores:?} {lens:?} wrote before");
                        assert!(d[offset..] == s[..], "{stores:?} {lens:?} offset {offset}");
                    }
                }
            }
        }
    }

    #[test]
    fn large_copies_stream_and_small_ones_do_not() {
        assert_eq!(Stores::for_bytes(STREAM_MIN), Stores::Streaming);
        assert_eq!(Stores::for_bytes(STREAM_MIN - 1), Stores::Plain);
        let src = bytes(3 * STREAM_MIN + 13, 9);
        let mut dst = vec![0u8; src.len()];
        copy_ranges(vec![(&src[..], &mut dst[..])]);
        assert!(dst == src);
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn mismatched_lengths_are_refused() {
        copy_ranges(vec![(&[1u8, 2][..], &mut [0u8; 3][..])]);
    }
}
