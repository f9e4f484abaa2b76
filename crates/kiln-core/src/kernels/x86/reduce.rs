//! Integer dot products of weight groups against activation blocks, and the transposing
//! reductions that turn eight partial vectors into eight sums.

use std::arch::x86_64::*;

use super::loads::{load_hi, load_lo, load16, load16z, load32};
use crate::kernels::tile::Block;

/// Four `[A | B]` i16 pair partials of 4-bit g32 codes (pair `i` = groups `2i`, `2i + 1`)
/// to eight group sums in order. Lanes start at 4 products; two pairwise levels reach 16,
/// at most 16 * 15 * 128 = 30720, inside i16.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn pairs_to_groups(p: [__m256i; 4]) -> __m256i {
    // [g0, g2, g4, g6 | g1, g3, g5, g7]
    let q = _mm256_madd_epi16(fold16b(fold16(p[0], p[1]), fold16(p[2], p[3])), _mm256_set1_epi16(1));
    _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// [`pairs_to_groups`] for both planes of split codes, joined where the i16 sums widen:
/// `madd` by 256 widens the high plane's sums already shifted, so the two planes share
/// one widening add and one permute. Lane `j` = group `j`'s exact dot with the codes.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn pairs_to_groups_split(h: [__m256i; 4], l: [__m256i; 4]) -> __m256i {
    let fh = fold16b(fold16(h[0], h[1]), fold16(h[2], h[3]));
    let fl = fold16b(fold16(l[0], l[1]), fold16(l[2], l[3]));
    let q = widen_planes(fh, fl);
    _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// i16 pair sums of the high and low planes to i32 lanes `256 * high + low` (exact: a
/// lane pair sums at most 32 products of 15 * 128).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn widen_planes(h: __m256i, l: __m256i) -> __m256i {
    _mm256_add_epi32(_mm256_madd_epi16(h, _mm256_set1_epi16(256)), _mm256_madd_epi16(l, _mm256_set1_epi16(1)))
}

/// Four 4-bit groups' partials against both planes of split codes (`h[t]`, `l[t]` of group
/// `t`) to i32 lanes `[g0, g1, g2, g3 | g0, g1, g2, g3]`, each the exact dot of its group's
/// low or high 128 bits with the codes: the planes are folded in i16 as [`reduce8`] folds
/// one plane, then joined by [`widen_planes`] where they widen.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn quad_split<const G: usize>(h: [__m256i; 4], l: [__m256i; 4]) -> __m256i {
    let (h01, h23, l01, l23) =
        (fold16(h[0], h[1]), fold16(h[2], h[3]), fold16(l[0], l[1]), fold16(l[2], l[3]));
    if G <= 64 {
        widen_planes(fold16b(h01, h23), fold16b(l01, l23))
    } else {
        fold32b(widen_planes(h01, l01), widen_planes(h23, l23))
    }
}

/// Reduces eight partial vectors (i16 lanes for 4-bit codes, i32 for 8-bit) to
/// `(lo, hi)`: lane `j` of `lo` is the sum of the low 128 bits of `v[j]`, of `hi` that of
/// the high 128 bits.
///
/// A transpose by unpacks and adds (`hadd` costs two cycles here, an unpack a third of
/// one). 4-bit partials start at 4 products per i16 lane (8 at g128, two blocks added);
/// i16 folds run while a lane stays at or below 16 products (16 * 15 * 127 = 30480), then
/// `madd` by ones widens to i32: two `madd`s for eight vectors instead of eight.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn reduce8<const BITS: u32, const G: usize>(v: [__m256i; 8]) -> (__m256i, __m256i) {
    let (q0, q1) = if BITS == 4 {
        let ones = _mm256_set1_epi16(1);
        let (s01, s23, s45, s67) =
            (fold16(v[0], v[1]), fold16(v[2], v[3]), fold16(v[4], v[5]), fold16(v[6], v[7]));
        if G <= 64 {
            (_mm256_madd_epi16(fold16b(s01, s23), ones), _mm256_madd_epi16(fold16b(s45, s67), ones))
        } else {
            (
                fold32b(_mm256_madd_epi16(s01, ones), _mm256_madd_epi16(s23, ones)),
                fold32b(_mm256_madd_epi16(s45, ones), _mm256_madd_epi16(s67, ones)),
            )
        }
    } else {
        (fold32b(fold32(v[0], v[1]), fold32(v[2], v[3])), fold32b(fold32(v[4], v[5]), fold32(v[6], v[7])))
    };
    // q0 = [v0 lo, v1 lo, v2 lo, v3 lo | v0 hi, v1 hi, v2 hi, v3 hi], q1 likewise for v4..v7.
    (_mm256_permute2x128_si256::<0x20>(q0, q1), _mm256_permute2x128_si256::<0x31>(q0, q1))
}

/// One fold of i16 partials of two vectors: per 128 bits `[a a b b a a b b]`, each lane the
/// sum of two, and each adjacent pair from one input, so `madd` by ones never mixes them.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn fold16(a: __m256i, b: __m256i) -> __m256i {
    _mm256_add_epi16(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b))
}

/// The second fold of i16 partials: two [`fold16`] results to per 128 bits
/// `[a a b b c c d d]`.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn fold16b(ab: __m256i, cd: __m256i) -> __m256i {
    _mm256_add_epi16(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd))
}

/// One fold of i32 partials: per 128 bits `[a b a b]`.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn fold32(a: __m256i, b: __m256i) -> __m256i {
    _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b))
}

/// The second fold of i32 partials (`[a b a b]`, `[c d c d]`): per 128 bits `[a b c d]`.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn fold32b(ab: __m256i, cd: __m256i) -> __m256i {
    _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd))
}

/// The even/odd nibble products of one 32-byte block of 4-bit codes, summed in i16 lanes.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn q4_dot16(wv: __m256i, x: &Block) -> __m256i {
    let mask = _mm256_set1_epi8(0x0F);
    let lo = _mm256_and_si256(wv, mask);
    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(wv), mask);
    _mm256_add_epi16(_mm256_maddubs_epi16(lo, load_lo(x)), _mm256_maddubs_epi16(hi, load_hi(x)))
}

/// [`q4_dot16`] against both planes of split codes, the nibbles unpacked once:
/// `(high plane, low plane)` partials.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn q4_dot16_split(wv: __m256i, xh: &Block, xl: &Block) -> (__m256i, __m256i) {
    let mask = _mm256_set1_epi8(0x0F);
    let lo = _mm256_and_si256(wv, mask);
    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(wv), mask);
    (nib_dot(lo, hi, xh), nib_dot(lo, hi, xl))
}

/// Integer partials of one 4-bit group (g64 or g128) against both planes of split codes
/// of one activation row, as [`group_partials`] computes each: `(high, low)`.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn q4_group_partials_split<const G: usize>(
    w: &[u8],
    xh: &[Block],
    xl: &[Block],
) -> (__m256i, __m256i) {
    let (mut ah, mut al) = (_mm256_setzero_si256(), _mm256_setzero_si256());
    for blk in 0..G / 64 {
        let (dh, dl) = q4_dot16_split(load32(&w[blk * 32..blk * 32 + 32]), &xh[blk], &xl[blk]);
        (ah, al) = (_mm256_add_epi16(ah, dh), _mm256_add_epi16(al, dl));
    }
    (ah, al)
}

/// [`group_partials`] of one 4-bit group (g32: of a pair, or of a last lone group when `w`
/// is 16 bytes) against both planes of split codes of `T` activation rows, the nibbles
/// unpacked once: `(high, low)` i16 partials per row. `xh[blk * T + r]` and
/// `xl[blk * T + r]` are block `blk` of row `r`'s planes.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn q4_group_partials_rows<const G: usize, const T: usize>(
    w: &[u8],
    xh: &[Block],
    xl: &[Block],
) -> ([__m256i; T], [__m256i; T]) {
    let (mut ah, mut al) = ([_mm256_setzero_si256(); T], [_mm256_setzero_si256(); T]);
    for blk in 0..(G / 2).div_ceil(32) {
        let wv = if w.len() == 16 { load16z(w) } else { load32(&w[blk * 32..blk * 32 + 32]) };
        let mask = _mm256_set1_epi8(0x0F);
        let lo = _mm256_and_si256(wv, mask);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(wv), mask);
        for r in 0..T {
            let (dh, dl) = (nib_dot(lo, hi, &xh[blk * T + r]), nib_dot(lo, hi, &xl[blk * T + r]));
            (ah[r], al[r]) = (_mm256_add_epi16(ah[r], dh), _mm256_add_epi16(al[r], dl));
        }
    }
    (ah, al)
}

/// One activation block's i16 partials against a weight block's even (`lo`) and odd
/// (`hi`) nibbles, 4 products per lane.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn nib_dot(lo: __m256i, hi: __m256i, x: &Block) -> __m256i {
    _mm256_add_epi16(_mm256_maddubs_epi16(lo, load_lo(x)), _mm256_maddubs_epi16(hi, load_hi(x)))
}

/// Integer partials of one group (4-bit g32: of a pair of groups, or of a last lone group
/// when `w` is 16 bytes) against `T` activation rows: the lanes of `out[r]` sum to the
/// group's dot with row `r` (4-bit g32: low 128 bits the first group, high the second).
/// 4-bit partials are i16 lanes (see [`reduce8`] for their bounds), 8-bit ones i32.
/// `x[blk * T + r]` is block `blk` of the group for row `r`.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn group_partials<const BITS: u32, const G: usize, const T: usize>(
    w: &[u8],
    x: &[Block],
) -> [__m256i; T] {
    let mut acc = [_mm256_setzero_si256(); T];
    let nblk = (G * BITS as usize / 8).div_ceil(32);
    if BITS == 4 {
        for blk in 0..nblk {
            let wv = if w.len() == 16 { load16z(w) } else { load32(&w[blk * 32..blk * 32 + 32]) };
            let mask = _mm256_set1_epi8(0x0F);
            let lo = _mm256_and_si256(wv, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(wv), mask);
            let xb = &x[blk * T..blk * T + T];
            for r in 0..T {
                let d = _mm256_add_epi16(
                    _mm256_maddubs_epi16(lo, load_lo(&xb[r])),
                    _mm256_maddubs_epi16(hi, load_hi(&xb[r])),
                );
                acc[r] = if blk == 0 { d } else { _mm256_add_epi16(acc[r], d) };
            }
        }
    } else {
        for blk in 0..nblk {
            let wb = &w[blk * 32..blk * 32 + 32];
            let w0 = _mm256_cvtepu8_epi16(load16(&wb[..16]));
            let w1 = _mm256_cvtepu8_epi16(load16(&wb[16..]));
            let xb = &x[blk * T..blk * T + T];
            for r in 0..T {
                let d = _mm256_add_epi32(
                    _mm256_madd_epi16(w0, load_lo(&xb[r])),
                    _mm256_madd_epi16(w1, load_hi(&xb[r])),
                );
                acc[r] = if blk == 0 { d } else { _mm256_add_epi32(acc[r], d) };
            }
        }
    }
    acc
}
