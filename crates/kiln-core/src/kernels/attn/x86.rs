//! The AVX2 decode attention path (AVX2, FMA, F16C; head sizes a multiple of 8), and the
//! AVX-512 one built on it (heads of 64 and 128).
//!
//! Scores go eight keys at a time: the eight keys are converted to f32 once into a small
//! buffer that stays in L1 (an f32 cache is read in place), then each head of the group
//! runs eight independent accumulators over the head's width, one per key, and a
//! horizontal-add tree turns them into one vector of eight scores. Values go eight keys at
//! a time too, converted in registers (`vcvtph2ps`), and every head's accumulator slice
//! takes eight broadcast-weight FMAs per eight lanes of width. The softmax's exponentials
//! go eight at a time ([`exp8`], the scalar `exp`'s bits).
//!
//! The AVX-512 path keeps those scores and instead holds a tile of heads' whole
//! accumulators in registers over all of a tile's positions ([`accumulate_tile`]).

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use super::tile::{DecodeShape, KvRun, MAX_HEAD_DIM, TILE_KEYS, TileOps, drive};

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

/// [`crate::math::exp`] of eight lanes: its constants, and its operations in its order (a
/// multiply then an add wherever it multiplies and adds, never a fused one), so its bits;
/// the clamp keeps a NaN as `f32::clamp` does (`max` and `min` return their second operand
/// when one is NaN).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn exp8(x: __m256) -> __m256 {
    use crate::math::{EXP_LN2_HI, EXP_LN2_LO, EXP_MAX, EXP_MIN, EXP_POLY, EXP_ROUNDER};
    let x = _mm256_min_ps(_mm256_set1_ps(EXP_MAX), _mm256_max_ps(_mm256_set1_ps(EXP_MIN), x));
    let rounder = _mm256_set1_ps(EXP_ROUNDER);
    let t = _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)), rounder);
    let n = _mm256_sub_ps(t, rounder);
    let r = _mm256_sub_ps(
        _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_HI))),
        _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_LO)),
    );
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm256_add_ps(_mm256_set1_ps(c), _mm256_mul_ps(r, p));
    }
    let ni = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(EXP_ROUNDER.to_bits() as i32));
    let two_n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(ni, _mm256_set1_epi32(127))));
    _mm256_mul_ps(p, two_n)
}

/// [`super::exp_sum`] eight lanes at a time with [`exp8`], finished by the same
/// [`super::exp_sum_finish`], so the same bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn exp_sum8(x: &mut [f32], shift: f32) -> f32 {
    let sh = _mm256_set1_ps(shift);
    let mut lanes = _mm256_setzero_ps();
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: `c` holds exactly eight values; AVX2 is enabled here.
        unsafe {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), sh));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            lanes = _mm256_add_ps(lanes, e);
        }
    }
    let mut l = [0f32; 8];
    // SAFETY: `l` holds eight values.
    unsafe { _mm256_storeu_ps(l.as_mut_ptr(), lanes) };
    super::tile::exp_sum_finish(l, chunks.into_remainder(), shift)
}

impl TileOps for Avx2 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn exp_sum(x: &mut [f32], shift: f32) -> f32 {
        exp_sum8(x, shift)
    }

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
                        // Only a short chunk has any (a call per chunk of eight cost a
                        // call and the registers it clobbers).
                        if nt < 8 {
                            std::ptr::write_bytes(part.add(nt * hd), 0, (8 - nt) * hd);
                        }
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

/// Folds a run into `state` on the AVX-512 path: AVX2's scores, and values accumulated in
/// registers ([`Avx512`]).
///
/// # Safety
/// The CPU must have AVX2, FMA, F16C and AVX-512F/BW/VL; `head_dim` must be 64 or 128
/// (see [`fold512_takes`]), `q` hold `group * head_dim` values and `state` a whole state.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn fold512(
    shape: &DecodeShape,
    q: &[f32],
    keys: KvRun<'_>,
    values: KvRun<'_>,
    state: &mut [f32],
) {
    // SAFETY: this function's features are the ones `Avx512` needs; the caller holds the rest.
    unsafe { drive::<Avx512>(shape, q, keys, values, state) }
}

/// Whether [`fold512`] takes heads of `head_dim`: whole registers of 16 lanes, at most
/// 8 of them, so a head's accumulators fit a register tile.
pub(super) fn fold512_takes(head_dim: usize) -> bool {
    head_dim == 64 || head_dim == 128
}

struct Avx512;

/// Accumulator registers one tile of [`accumulate_tile`] holds: heads times registers per
/// head (16 lanes each), leaving the rest of the 32 for a position's values.
const ACC_REGISTERS: usize = 24;

/// `acc_j += sum_t p[j * TILE_KEYS + t] v_t` for the `JB` heads from `j0`, each head's
/// `16 * CB` accumulators held in registers over all `nk` positions: per position the
/// values are converted once (`CB` registers) and each head takes a broadcast weight and
/// `CB` independent FMAs, so no chain of FMAs waits on itself (AVX2's path runs eight
/// dependent FMAs per accumulator and reloads it every eight positions). The order of the
/// additions into each accumulator (position by position from its stored value) is
/// AVX2's, so the outputs are the same bits.
///
/// # Safety
/// AVX-512F and F16C; `hd == 16 * CB`; `values` holds `nk` positions; `p`'s entries
/// `j * TILE_KEYS + t` for the tile's heads and `t < nk` are initialised; `acc` holds the
/// heads `j0..j0 + JB`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn accumulate_tile<const CB: usize, const JB: usize>(
    p: &[MaybeUninit<f32>],
    values: KvRun<'_>,
    nk: usize,
    acc: &mut [f32],
    j0: usize,
) {
    let hd = 16 * CB;
    debug_assert!(values.len() >= nk * hd && acc.len() >= (j0 + JB) * hd);
    // SAFETY: every load and store below is of 16 lanes inside `acc` (heads
    // `j0..j0 + JB`, width `hd`), inside `values` (positions below `nk`) or at an
    // initialised weight of `p`, by the caller's contract.
    unsafe {
        let dst = acc.as_mut_ptr();
        let mut a = [[_mm512_setzero_ps(); CB]; JB];
        for (j, aj) in a.iter_mut().enumerate() {
            for (c, ajc) in aj.iter_mut().enumerate() {
                *ajc = _mm512_loadu_ps(dst.add((j0 + j) * hd + 16 * c));
            }
        }
        let w = p.as_ptr().cast::<f32>();
        for t in 0..nk {
            prefetch(values, (t + AHEAD) * hd, hd);
            let mut v = [_mm512_setzero_ps(); CB];
            for (c, vc) in v.iter_mut().enumerate() {
                let i = t * hd + 16 * c;
                *vc = match values {
                    KvRun::F16(s) => _mm512_cvtph_ps(_mm256_loadu_si256(s.as_ptr().add(i).cast())),
                    KvRun::F32(s) => _mm512_loadu_ps(s.as_ptr().add(i)),
                };
            }
            for (j, aj) in a.iter_mut().enumerate() {
                let wj = _mm512_set1_ps(*w.add((j0 + j) * TILE_KEYS + t));
                for (ajc, &vc) in aj.iter_mut().zip(&v) {
                    *ajc = _mm512_fmadd_ps(wj, vc, *ajc);
                }
            }
        }
        for (j, aj) in a.iter().enumerate() {
            for (c, &ajc) in aj.iter().enumerate() {
                _mm512_storeu_ps(dst.add((j0 + j) * hd + 16 * c), ajc);
            }
        }
    }
}

/// [`accumulate_tile`] over all `g` heads, [`ACC_REGISTERS`]` / CB` heads at a time.
///
/// # Safety
/// As [`accumulate_tile`], for heads `0..g`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn accumulate_heads<const CB: usize>(
    g: usize,
    p: &[MaybeUninit<f32>],
    values: KvRun<'_>,
    nk: usize,
    acc: &mut [f32],
) {
    let most = ACC_REGISTERS / CB;
    let mut j0 = 0;
    while j0 < g {
        let jb = (g - j0).min(most);
        // SAFETY: forwarded from the caller, for heads `j0..j0 + jb` of `0..g`.
        unsafe {
            match jb {
                1 => accumulate_tile::<CB, 1>(p, values, nk, acc, j0),
                2 => accumulate_tile::<CB, 2>(p, values, nk, acc, j0),
                3 => accumulate_tile::<CB, 3>(p, values, nk, acc, j0),
                4 => accumulate_tile::<CB, 4>(p, values, nk, acc, j0),
                5 => accumulate_tile::<CB, 5>(p, values, nk, acc, j0),
                _ => accumulate_tile::<CB, 6>(p, values, nk, acc, j0),
            }
        }
        j0 += jb;
    }
}

impl TileOps for Avx512 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn exp_sum(x: &mut [f32], shift: f32) -> f32 {
        exp_sum8(x, shift)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn scores(shape: &DecodeShape, q: &[f32], keys: KvRun<'_>, nk: usize, s: &mut [MaybeUninit<f32>]) {
        // SAFETY: AVX2's features are a subset of this path's; the rest is the caller's.
        unsafe { <Avx2 as TileOps>::scores(shape, q, keys, nk, s) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn accumulate(
        shape: &DecodeShape,
        p: &[MaybeUninit<f32>],
        values: KvRun<'_>,
        nk: usize,
        acc: &mut [f32],
    ) {
        let (g, hd) = (shape.group, shape.head_dim);
        // SAFETY: `fold512_takes` admitted `hd` (the dispatcher checks it); the rest is
        // the caller's.
        unsafe {
            match hd {
                64 => accumulate_heads::<4>(g, p, values, nk, acc),
                _ => accumulate_heads::<8>(g, p, values, nk, acc),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Isa;

    #[test]
    fn vector_exp_sum_gives_the_scalar_bits() {
        if !Isa::Avx2.is_available() {
            return;
        }
        // Scores from far below the clamp to above it, NaN and infinities among them, at
        // every tail length.
        let mut seed = 0x9e37_79b9_u32;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            (seed as f32 / u32::MAX as f32) * 240.0 - 120.0
        };
        for n in 0..=67 {
            let mut x: Vec<f32> = (0..n).map(|_| next()).collect();
            if n > 10 {
                (x[3], x[7], x[9]) = (f32::NAN, f32::INFINITY, f32::NEG_INFINITY);
            }
            for shift in [0.0, 3.5, -40.0, 87.0] {
                let (mut a, mut b) = (x.clone(), x.clone());
                let want = super::super::tile::exp_sum(&mut a, shift);
                // SAFETY: AVX2 (with FMA and F16C) was detected above.
                let got = unsafe { exp_sum8(&mut b, shift) };
                assert_eq!(got.to_bits(), want.to_bits(), "sum of {n} at shift {shift}");
                for (i, (g, w)) in b.iter().zip(&a).enumerate() {
                    assert_eq!(g.to_bits(), w.to_bits(), "value {i} of {n} at shift {shift}");
                }
            }
        }
    }
}
