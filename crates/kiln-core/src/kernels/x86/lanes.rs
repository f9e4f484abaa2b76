//! The float work after the integer dots: centring, scaling and accumulating eight lanes,
//! and their final horizontal sum.

use std::arch::x86_64::*;

use super::loads::{load8f, load8i};
use crate::kernels::tile::XTile;

/// [`crate::kernels::act::Lanes::add_group`] for eight lanes: with `t = tot - c * qsum` and
/// `bc = fma(s, c, b)` (`c = 2^(BITS - 1)`), `acc = fma(t, s * sx, acc)` then
/// `acc = fma(bc, xsum, acc)`. `x` holds the eight groups' activation scales, sums and
/// code sums.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn lanes_step<const BITS: u32>(
    acc: __m256,
    tot: __m256i,
    s: __m256,
    b: __m256,
    x: XGroups<'_>,
) -> __m256 {
    let centred = _mm256_sub_epi32(tot, times_center::<BITS>(load8i(x.qsum)));
    let bc = _mm256_fmadd_ps(s, _mm256_set1_ps(center_of(BITS) as f32), b);
    let ss = _mm256_mul_ps(s, load8f(x.sx));
    let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), ss, acc);
    _mm256_fmadd_ps(bc, load8f(x.xsum), acc)
}

/// The eight groups' activation scales, exact sums and code sums (eight values each).
#[derive(Clone, Copy)]
pub(super) struct XGroups<'a> {
    pub(super) sx: &'a [f32],
    pub(super) xsum: &'a [f32],
    pub(super) qsum: &'a [i32],
}

impl<'a> XGroups<'a> {
    /// Groups `g0 .. g0 + 8` of a tile's lane-per-group layout starting at `base`.
    pub(super) fn at(xt: &'a XTile, base: usize) -> XGroups<'a> {
        XGroups { sx: &xt.sx[base..base + 8], xsum: &xt.xsum[base..base + 8], qsum: &xt.qsum[base..base + 8] }
    }
}

/// The weight code products are centred on: `2^(bits - 1)`.
pub(super) const fn center_of(bits: u32) -> i32 {
    1 << (bits - 1)
}

/// `v * 2^(BITS - 1)` (exact: at most 128 * 128 * 32767 in magnitude).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn times_center<const BITS: u32>(v: __m256i) -> __m256i {
    if BITS == 4 { _mm256_slli_epi32::<3>(v) } else { _mm256_slli_epi32::<7>(v) }
}

/// The eight lanes summed as [`crate::kernels::act::Lanes::finish`] does.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn hsum(acc: __m256) -> f32 {
    let s1 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
    let s2 = _mm_add_ps(s1, _mm_movehl_ps(s1, s1));
    let s3 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
    _mm_cvtss_f32(s3)
}
