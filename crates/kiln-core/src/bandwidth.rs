//! The machine's read bandwidth, measured by summing a buffer much larger than the
//! last-level cache. Kernel reports and decode benchmarks divide by this figure, taken in
//! the same run, so a noisy shared machine still yields honest ratios.

use std::time::Instant;

use rayon::prelude::*;

/// Default buffer: far beyond any last-level cache kiln runs on.
pub const DEFAULT_BYTES: usize = 1 << 30;

/// One measurement.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Bandwidth {
    /// Bytes read per pass.
    pub bytes: usize,
    /// Best pass, in bytes per second.
    pub bytes_per_s: f64,
    /// Threads that read.
    pub threads: usize,
}

impl Bandwidth {
    /// GB/s (10^9 bytes per second).
    pub fn gb_s(&self) -> f64 {
        self.bytes_per_s / 1e9
    }
}

/// A buffer to measure over, filled so its pages are resident.
pub struct ReadBuffer {
    data: Vec<u64>,
}

impl ReadBuffer {
    /// Allocates and touches `bytes` (rounded down to 8).
    pub fn new(bytes: usize) -> Self {
        let mut data = vec![0u64; bytes / 8];
        data.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
            for (j, v) in c.iter_mut().enumerate() {
                *v = (i as u64) << 20 | j as u64;
            }
        });
        ReadBuffer { data }
    }

    /// Bytes in the buffer.
    pub fn bytes(&self) -> usize {
        self.data.len() * 8
    }

    /// Sums the whole buffer once on the current rayon pool; returns the sum so the
    /// reads cannot be optimised away.
    pub fn sum(&self) -> u64 {
        self.data.par_chunks(1 << 18).map(sum_chunk).reduce(|| 0, u64::wrapping_add)
    }
}

/// Measures the best of `passes` full reads of `buf` on the current rayon pool.
pub fn measure(buf: &ReadBuffer, passes: usize) -> Bandwidth {
    let mut best = f64::INFINITY;
    let mut sink = 0u64;
    for _ in 0..passes.max(1) {
        let t = Instant::now();
        sink = sink.wrapping_add(buf.sum());
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(sink);
    Bandwidth {
        bytes: buf.bytes(),
        bytes_per_s: buf.bytes() as f64 / best,
        threads: rayon::current_num_threads(),
    }
}

fn sum_chunk(c: &[u64]) -> u64 {
    // The kernels' dispatcher detects the CPU's features, once, for the whole crate.
    #[cfg(target_arch = "x86_64")]
    {
        if crate::kernels::Isa::Avx2.is_available() {
            // SAFETY: the dispatcher detected AVX2 (with FMA and F16C) at run time.
            return unsafe { sum_chunk_avx2(c) };
        }
    }
    sum_chunk_portable(c)
}

fn sum_chunk_portable(c: &[u64]) -> u64 {
    // Four independent accumulators so the adds do not serialise on one register.
    let mut acc = [0u64; 4];
    let mut it = c.chunks_exact(4);
    for q in &mut it {
        for i in 0..4 {
            acc[i] = acc[i].wrapping_add(q[i]);
        }
    }
    it.remainder().iter().fold(acc.iter().fold(0, |a, &b| a.wrapping_add(b)), |a, &b| a.wrapping_add(b))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn sum_chunk_avx2(c: &[u64]) -> u64 {
    // The same loop compiled with AVX2 enabled: the compiler widens it to 256-bit adds.
    sum_chunk_portable(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_every_element() {
        let buf = ReadBuffer::new(8 * 1000);
        let want = buf.data.iter().fold(0u64, |a, &b| a.wrapping_add(b));
        assert_eq!(buf.sum(), want);
        let bw = measure(&buf, 2);
        assert!(bw.bytes_per_s > 0.0 && bw.bytes == 8000);
    }
}
