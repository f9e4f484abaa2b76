//! The AVX2 decode attention path (AVX2, FMA, F16C; head sizes a multiple of 8).
//!
//! Scores go eight keys at a time: the eight keys are converted to f32 once into a small
//! buffer that stays in L1 (an f32 cache is read in place), then each head of the group
//! runs eight independent accumulators over the head's width, one per key, and a
//! horizontal-add tree turns them into one vector of eight scores. Values go eight keys at
//! a time too, converted in registers (`vcvtph2ps`), and every head's accumulator slice
//! takes eight broadcast-weight FMAs per eight lanes of width.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use super::{DecodeShape, KvRun, MAX_HEAD_DIM, TILE_KEYS, TileOps, drive};

/// Folds a run into `state` on the AVX2 path (see [`super::fold`]).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `head_dim` must be a multiple of 8, `q` hold
/// `group * head_dim` values and `state` a whole state.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn fold(
    shape: &DecodeShape,
    q: &[f32],
    keys: KvRun<'_>,
    values: KvRun<'_>,
    state: &mut [f32],
) {
    // SAFETY: this function's features are the ones `Avx2` needs; the caller holds the rest.
    unsafe { drive::<Avx2>(shape, q, keys, values, state) }
}

struct Avx2;

/// Eight f32 lanes of a run starting at value `i`.
///
/// # Safety
/// AVX2 and F16C; `i + 8 <= run.len()`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8(run: KvRun<'_>, i: usize) -> __m256 {
    debug_assert!(i + 8 <= run.len());
    // SAFETY: the caller guarantees the features and that eight values from `i` exist.
    unsafe {
        match run {
            KvRun::F16(s) => _mm256_cvtph_ps(_mm_loadu_si128(s.as_ptr().add(i).cast())),
            KvRun::F32(s) => _mm256_loadu_ps(s.as_ptr().add(i)),
        }
    }
}

/// Positions ahead of the eight being read whose keys (in `scores`) or values (in
/// `accumulate`) are asked for into L1. A decode step reads each layer's cache once, from
/// memory, and the hardware prefetchers left its loads waiting: on a 2-vCPU Zen 4 EPYC a
/// fifth of SmolLM2-135M's attention samples sat on the load that converts the keys. With
/// the prefetch its two-thread decode after a 1500-token prompt ran 1.10x as fast (six
/// interleaved pairs, medians 121 -> 133 tok/s); after 300 tokens, and on the Qwen2.5-0.5B
/// shape (two key/value heads), it was within 3% either way.
const AHEAD: usize = 16;

/// Asks for the lines of values `from..from + n` of `run` (past its end too: a prefetch is
/// a hint and never faults).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn prefetch(run: KvRun<'_>, from: usize, n: usize) {
    let base = match run {
        KvRun::F16(s) => s.as_ptr().cast::<i8>(),
        KvRun::F32(s) => s.as_ptr().cast::<i8>(),
    };
    let size = run.value_bytes();
    let at = base.wrapping_add(from * size);
    for line in (0..n * size).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(line));
    }
}

/// Lane `t` of the result is the sum of the lanes of `a[t]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sum8x8(a: &[__m256; 8]) -> __m256 {
    {
        let s01 = _mm256_hadd_ps(a[0], a[1]);
        let s23 = _mm256_hadd_ps(a[2], a[3]);
        let s45 = _mm256_hadd_ps(a[4], a[5]);
        let s67 = _mm256_hadd_ps(a[6], a[7]);
        // Lanes: low half [a0 a1 a2 a3] of key halves 0..4, high half of halves 4..8.
        let s0123 = _mm256_hadd_ps(s01, s23);
        let s4567 = _mm256_hadd_ps(s45, s67);
        let lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
        let hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
        _mm256_add_ps(lo, hi)
    }
}

impl TileOps for Avx2 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scores(shape: &DecodeShape, q: &[f32], keys: KvRun<'_>, nk: usize, s: &mut [MaybeUninit<f32>]) {
        let (g, hd) = (shape.group, shape.head_dim);
        let scale = _mm256_set1_ps(shape.scale);
        let mut buf = [MaybeUninit::<f32>::uninit(); 8 * MAX_HEAD_DIM];
        let mut t0 = 0;
        while t0 < nk {
            let nt = 8.min(nk - t0);
            prefetch(keys, (t0 + AHEAD) * hd, 8 * hd);
            // Eight keys as f32, `hd` apart: in place for a full chunk of an f32 run,
            // else converted (a short chunk padded with zeros, whose scores go unused).
            let k: &[f32] = match keys {
                KvRun::F32(run) if nt == 8 => &run[t0 * hd..(t0 + 8) * hd],
                _ => {
                    let part = buf.as_mut_ptr().cast::<f32>();
                    let mut i = 0;
                    while i < nt * hd {
                        // SAFETY: features from the caller; `i + 8 <= nt * hd` values of
                        // the chunk exist since `hd` is a multiple of 8, and `buf` holds
                        // `8 * hd >= i + 8` values.
                        unsafe { _mm256_storeu_ps(part.add(i), load8(keys, t0 * hd + i)) };
                        i += 8;
                    }
                    // SAFETY: the first `nt * hd` values were written above and the rest
                    // are zeroed here, so all `8 * hd` (inside `buf`) are initialised.
                    unsafe {
                        std::ptr::write_bytes(part.add(nt * hd), 0, (8 - nt) * hd);
                        std::slice::from_raw_parts(part, 8 * hd)
                    }
                }
            };
            for j in 0..g {
                let qj = &q[j * hd..(j + 1) * hd];
                // SAFETY: features from the caller; every load reads eight values at
                // `c < hd` of `qj` or of key row `t < 8` of `k` (`8 * hd` values), and the
                // store writes eight scores at `j * TILE_KEYS + t0`, inside `s` because
                // `t0 + 8 <= TILE_KEYS` (tiles are whole multiples of 8 keys).
                unsafe {
                    let mut a = [_mm256_setzero_ps(); 8];
                    let mut c = 0;
                    while c < hd {
                        let qc = _mm256_loadu_ps(qj.as_ptr().add(c));
                        for (t, at) in a.iter_mut().enumerate() {
                            *at = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k.as_ptr().add(t * hd + c)), *at);
                        }
                        c += 8;
                    }
                    let sc = _mm256_mul_ps(sum8x8(&a), scale);
                    _mm256_storeu_ps(s.as_mut_ptr().add(j * TILE_KEYS + t0).cast::<f32>(), sc);
                }
            }
            t0 += 8;
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn accumulate(
        shape: &DecodeShape,
        p: &[MaybeUninit<f32>],
        values: KvRun<'_>,
        nk: usize,
        acc: &mut [f32],
    ) {
        let (g, hd) = (shape.group, shape.head_dim);
        let mut t0 = 0;
        while t0 + 8 <= nk {
            prefetch(values, (t0 + AHEAD) * hd, 8 * hd);
            let mut c = 0;
            while c < hd {
                // SAFETY: features from the caller; the eight value loads read positions
                // `t0..t0 + 8 <= nk` at width `c + 8 <= hd`; the weights read are
                // `p[j * TILE_KEYS + t0 + t]` inside the tile's scores; the accumulator
                // loads and stores are lanes `c..c + 8` of head `j < g`; the weights of
                // keys below `nk` are initialised (the caller guarantees it).
                unsafe {
                    let mut v = [_mm256_setzero_ps(); 8];
                    for (t, vt) in v.iter_mut().enumerate() {
                        *vt = load8(values, (t0 + t) * hd + c);
                    }
                    for j in 0..g {
                        let dst = acc.as_mut_ptr().add(j * hd + c);
                        let w = p.as_ptr().add(j * TILE_KEYS + t0).cast::<f32>();
                        let mut a = _mm256_loadu_ps(dst);
                        for (t, vt) in v.iter().enumerate() {
                            a = _mm256_fmadd_ps(_mm256_broadcast_ss(&*w.add(t)), *vt, a);
                        }
                        _mm256_storeu_ps(dst, a);
                    }
                }
                c += 8;
            }
            t0 += 8;
        }
        for t in t0..nk {
            let mut c = 0;
            while c < hd {
                // SAFETY: as above, for the single position `t < nk`.
                unsafe {
                    let vt = load8(values, t * hd + c);
                    for j in 0..g {
                        let dst = acc.as_mut_ptr().add(j * hd + c);
                        let w = _mm256_set1_ps(p[j * TILE_KEYS + t].assume_init());
                        _mm256_storeu_ps(dst, _mm256_fmadd_ps(w, vt, _mm256_loadu_ps(dst)));
                    }
                }
                c += 8;
            }
        }
    }
}
