//! `qmv`'s integer dots on AVX-512 (F, BW, VL; with VNNI where the CPU has it), and the
//! tiles'.
//!
//! They compute exactly the sums AVX2's [`super::row::chunk8`] and
//! [`super::row::chunk8_split`] do (lane `j` = group `j`'s dot with the activation
//! codes): integer sums are exact in any order, so the float work after them, shared
//! with AVX2, gives bit-identical outputs.
//!
//! `qmv` reads 4-bit codes 64 bytes (128 codes) at a time: `and 0x0F` gives the even
//! elements' codes, `>> 4` and `and` the odd ones', each multiplied against the matching
//! half of a pair of activation blocks put in that order once per vector
//! ([`pair_blocks`]), so lane `l` holds the dot of elements `8l .. 8l + 8` and a group is
//! a run of lanes (4 at g32, 8 at g64, a register at g128). The tiles, whose activation
//! blocks are shared with AVX2's, broadcast a 32-byte block to both halves of a register
//! and shift by 0 in the low half and 4 in the high one ([`nibbles`]), which after
//! `and 0x0F` holds the even elements' codes beside the odd ones', the layout of its
//! 64-byte activation block ([`Block`]). 8-bit codes are widened 32 at a time against a
//! block of 32 16-bit activations. Without VNNI the products are `vpmaddubsw` (u4 * i8
//! pairs, at most 2 * 15 * 128 per i16 lane, no saturation) widened by `vpmaddwd` with
//! ones (or with 256 for the high plane of split codes), and `vpmaddwd` for 8-bit codes;
//! with VNNI `vpdpbusd` and `vpdpwssd` sum four (two) products straight into i32 lanes.

use std::arch::x86_64::*;

use super::loads::{load16z, load32};
use super::reduce::{fold32, fold32b, reduce8};
use super::traits::RowDots as Dots;
use crate::kernels::tile::{Block, XTile};

/// AVX-512's dots; `VNNI` picks `vpdpbusd` / `vpdpwssd`.
pub(in crate::kernels) struct Avx512Dots<const VNNI: bool>;

impl<const VNNI: bool> Dots for Avx512Dots<VNNI> {
    #[inline(always)]
    unsafe fn chunk8<const BITS: u32, const G: usize>(w: &[u8], x: &[Block], ng: usize) -> __m256i {
        let gb = G * BITS as usize / 8;
        let bpg = gb.div_ceil(32);
        assert!(ng <= 8 && w.len() == ng * gb && x.len() == 8 * gb / 32);
        // SAFETY: the caller guarantees AVX-512F/BW/VL (and VNNI when `VNNI`); every
        // load is of a checked slice.
        unsafe {
            if BITS == 4 {
                return q4_chunks::<G, false, VNNI>(w, x, x, ng);
            }
            let zero = _mm512_setzero_si512();
            let mut v = [zero; 8];
            for (j, vj) in v.iter_mut().enumerate() {
                if j < ng {
                    *vj = group_dot::<BITS, G, VNNI>(&w[j * gb..(j + 1) * gb], &x[j * bpg..(j + 1) * bpg]);
                }
            }
            groups_to_lanes(v)
        }
    }

    #[inline(always)]
    unsafe fn chunk8_split<const G: usize>(w: &[u8], xh: &[Block], xl: &[Block], ng: usize) -> __m256i {
        let gb = G / 2;
        assert!(ng <= 8 && w.len() == ng * gb && xh.len() == 8 * gb / 32 && xl.len() == xh.len());
        // SAFETY: as in `chunk8`.
        unsafe { q4_chunks::<G, true, VNNI>(w, xh, xl, ng) }
    }
}

/// Puts a vector's 4-bit activation blocks in the order [`Avx512Dots`] reads them: each
/// pair of 64-element blocks `[even | odd]`, `[even' | odd']` becomes `[even | even']`,
/// `[odd | odd']`, the 128 elements' even codes then their odd ones, so that one 64-byte
/// load of packed weights (128 codes) meets them with an `and` and a shift, and no
/// permute. `blocks` (a vector's, padded to whole steps of eight groups) has an even
/// length.
pub(super) fn pair_blocks(blocks: &mut [Block]) {
    assert!(blocks.len().is_multiple_of(2), "{} blocks do not pair", blocks.len());
    for p in blocks.chunks_exact_mut(2) {
        let (a, b) = (p[0].0, p[1].0);
        p[0].0[..32].copy_from_slice(&a[..32]);
        p[0].0[32..].copy_from_slice(&b[..32]);
        p[1].0[..32].copy_from_slice(&a[32..]);
        p[1].0[32..].copy_from_slice(&b[32..]);
    }
}

/// The integer dots of `ng <= 8` consecutive 4-bit groups against paired blocks
/// ([`pair_blocks`]; `xl` the low planes when `SPLIT`), lane `j` = group `j`, zero from
/// `ng` on. `w` holds the `ng` groups' packed bytes.
///
/// Each 64 bytes of `w` (128 codes, a "chunk") are loaded once: `and 0x0F` gives the even
/// elements' codes in the order of the pair's first block, `>> 4` the odd ones' in that
/// of its second, so two multiplies (four for split codes) leave lane `l` of the chunk
/// holding the dot of its elements `8l .. 8l + 8`. A group is then 4 (g32), 8 (g64) or 16
/// (g128) lanes of one chunk, summed by unpacks and adds.
///
/// # Safety
/// The CPU must support AVX-512F/BW/VL, and VNNI when `VNNI`.
#[inline(always)]
unsafe fn q4_chunks<const G: usize, const SPLIT: bool, const VNNI: bool>(
    w: &[u8],
    xh: &[Block],
    xl: &[Block],
    ng: usize,
) -> __m256i {
    // SAFETY: the caller guarantees the features; every full load is of a checked slice,
    // and the masked load of a last, short chunk reads only its bytes of `w`.
    unsafe {
        let chunks = 8 * G / 128;
        let bytes = ng * G / 2;
        assert!(w.len() == bytes && xh.len() == 2 * chunks && (!SPLIT || xl.len() == xh.len()));
        let zero = _mm512_setzero_si512();
        let low4 = _mm512_set1_epi8(0x0F);
        let mut t = [zero; 8];
        for (c, tc) in t.iter_mut().enumerate().take(chunks) {
            let at = 64 * c;
            if at >= bytes {
                continue;
            }
            let wv = if at + 64 <= bytes {
                _mm512_loadu_si512(w[at..at + 64].as_ptr().cast())
            } else {
                let mask: __mmask64 = (1u64 << (bytes - at)) - 1;
                _mm512_maskz_loadu_epi8(mask, w[at..].as_ptr().cast())
            };
            let even = _mm512_and_si512(wv, low4);
            let odd = _mm512_and_si512(_mm512_srli_epi16::<4>(wv), low4);
            let (e, o) = (&xh[2 * c], &xh[2 * c + 1]);
            let h = dot_u4_i8::<VNNI>(dot_u4_i8::<VNNI>(zero, even, load_block(e)), odd, load_block(o));
            *tc = if SPLIT {
                // At most 8 * 15 * 128 * 256 + 8 * 15 * 255 per lane.
                let (e, o) = (&xl[2 * c], &xl[2 * c + 1]);
                let l = dot_u4_i8::<VNNI>(_mm512_slli_epi32::<8>(h), even, load_block(e));
                dot_u4_i8::<VNNI>(l, odd, load_block(o))
            } else {
                h
            };
        }
        match G {
            32 => {
                // Chunk c's quarter q is group 4c + q.
                let x = fold512(t[0], t[1]);
                // Per 128 bits: [chunk 0's group, chunk 1's, the same again].
                let y = _mm512_add_epi32(x, _mm512_shuffle_epi32::<0b01_00_11_10>(x));
                let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
                _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, y))
            }
            64 => {
                // Chunk c's quarters 0 and 1 are group 2c, 2 and 3 group 2c + 1; quarter q
                // of `y` holds each chunk's sum of its quarter q.
                let y = fold512b(fold512(t[0], t[1]), fold512(t[2], t[3]));
                // Quarter 0: [g0, g2, g4, g6]; quarter 2: [g1, g3, g5, g7].
                let z = _mm512_add_epi32(y, _mm512_shuffle_i64x2::<0b10_11_00_01>(y, y));
                let order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
                _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, z))
            }
            _ => groups_to_lanes(t),
        }
    }
}

/// A block's 64 4-bit codes in its activation block's order: the even elements' codes
/// (low nibbles) in bytes `0..32`, the odd ones' (high nibbles) in bytes `32..64`.
#[inline(always)]
unsafe fn nibbles(wv: __m256i) -> __m512i {
    // SAFETY: the caller guarantees AVX-512F/BW.
    unsafe {
        let both = _mm512_broadcast_i64x4(wv);
        let shifts = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
        _mm512_and_si512(_mm512_srlv_epi16(both, shifts), _mm512_set1_epi8(0x0F))
    }
}

/// The activation block as one register.
#[inline(always)]
unsafe fn load_block(b: &Block) -> __m512i {
    // SAFETY: a `Block` is 64 bytes aligned to 64; the caller guarantees AVX-512F.
    unsafe { _mm512_load_si512(b.0.as_ptr().cast()) }
}

/// u4 codes times i8 activations, every four neighbouring products summed into an i32
/// lane (`vpdpbusd` with VNNI; else `vpmaddubsw`, pairs of at most 2 * 15 * 128, no
/// saturation, widened by `vpmaddwd` with ones).
///
/// # Safety
/// The CPU must support AVX-512BW, and VNNI when `VNNI`.
#[inline(always)]
pub(super) unsafe fn dot_u4_i8<const VNNI: bool>(acc: __m512i, nib: __m512i, x: __m512i) -> __m512i {
    // SAFETY: the caller guarantees AVX-512BW, and VNNI when `VNNI`.
    unsafe {
        if VNNI {
            _mm512_dpbusd_epi32(acc, nib, x)
        } else {
            _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(nib, x), _mm512_set1_epi16(1)))
        }
    }
}

/// A 4-bit block ([`nibbles`]) against both planes of split codes, joined exactly as
/// `256 * high + low`: i32 lanes whose 128-bit quarter `q` sums to the dot of the block's
/// bytes `16 * (q % 2)..` (g32: quarters 0 and 2 are the block's first group, 1 and 3 its
/// second).
#[inline(always)]
unsafe fn q4_block_split<const VNNI: bool>(nib: __m512i, xh: &Block, xl: &Block) -> __m512i {
    // SAFETY: forwarded from the caller.
    unsafe {
        if VNNI {
            let h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), nib, load_block(xh));
            let l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), nib, load_block(xl));
            _mm512_add_epi32(_mm512_slli_epi32::<8>(h), l)
        } else {
            let h = _mm512_maddubs_epi16(nib, load_block(xh));
            let l = _mm512_maddubs_epi16(nib, load_block(xl));
            _mm512_add_epi32(
                _mm512_madd_epi16(h, _mm512_set1_epi16(256)),
                _mm512_madd_epi16(l, _mm512_set1_epi16(1)),
            )
        }
    }
}

/// One group (4-bit g64 or g128, or 8-bit) against its activation blocks: i32 lanes
/// summing to the group's dot.
#[inline(always)]
unsafe fn group_dot<const BITS: u32, const G: usize, const VNNI: bool>(w: &[u8], x: &[Block]) -> __m512i {
    // SAFETY: forwarded from the caller; every load is of a checked slice.
    unsafe {
        let mut acc = _mm512_setzero_si512();
        for (blk, xb) in x.iter().enumerate() {
            let wb = load32(&w[32 * blk..32 * blk + 32]);
            acc = if BITS == 4 {
                dot_u4_i8::<VNNI>(acc, nibbles(wb), load_block(xb))
            } else {
                // u8 codes times i16 activations, pairs summed into i32 (at most
                // 2 * 255 * 32767).
                let w16 = _mm512_cvtepu8_epi16(wb);
                if VNNI {
                    _mm512_dpwssd_epi32(acc, w16, load_block(xb))
                } else {
                    _mm512_add_epi32(acc, _mm512_madd_epi16(w16, load_block(xb)))
                }
            };
        }
        acc
    }
}

/// Four g32 block results ([`q4_block_split`]) to the eight groups' sums in order.
#[inline(always)]
unsafe fn pairs_to_groups(p: [__m512i; 4]) -> __m256i {
    // SAFETY: the caller guarantees AVX-512F (and with it AVX2).
    unsafe {
        // Quarters 0 + 2 and 1 + 3: [first group | second group], four i32 partials each.
        // Loops, not closures: a closure has no target features of its own, so the
        // intrinsics in it are calls unless the inliner happens to fold it first (it did
        // not once the tile kernels below joined this codegen unit: decode ran at a third
        // of its speed).
        let mut t = [_mm256_setzero_si256(); 4];
        for (ti, &v) in t.iter_mut().zip(&p) {
            let s = _mm512_add_epi32(v, _mm512_shuffle_i64x2::<0b01_00_11_10>(v, v));
            *ti = _mm512_castsi512_si256(s);
        }
        // Per 128 bits: [g0, g2, g4, g6 | g1, g3, g5, g7].
        let q = fold32b(fold32(t[0], t[1]), fold32(t[2], t[3]));
        _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }
}

/// Eight groups' i32 partial vectors to their sums, lane = group.
#[inline(always)]
unsafe fn groups_to_lanes(v: [__m512i; 8]) -> __m256i {
    // SAFETY: the caller guarantees AVX-512F (and with it AVX2).
    unsafe {
        let mut y = [_mm256_setzero_si256(); 8];
        for (yi, &g) in y.iter_mut().zip(&v) {
            *yi = _mm256_add_epi32(_mm512_castsi512_si256(g), _mm512_extracti64x4_epi64::<1>(g));
        }
        let (lo, hi) = reduce8::<8, 32>(y);
        _mm256_add_epi32(lo, hi)
    }
}

/// AVX-512's totals of 4-bit groups against a tile's rows (lane = row), for the
/// eight-row tiles of `qmv_wide` and `qmm` ([`super::tile8`]): the same exact sums as
/// AVX2's `q4_tile_tot`, so the same bits. Each 32 bytes of codes are unpacked once into
/// one register ([`nibbles`]) that meets each row's 64-byte block in one multiply (two for
/// split codes, joined as `256 * high + low` before any reduction); the eight rows' 16
/// lanes are then folded by unpacks into one register of row sums per 128-bit quarter
/// (for a g32 pair quarters 0 and 2 hold the first group, 1 and 3 the second; g64 and
/// g128 groups fill all four).
pub(super) struct Avx512Pairs<const VNNI: bool>;

impl<const VNNI: bool> super::traits::PairTotals for Avx512Pairs<VNNI> {
    #[inline(always)]
    unsafe fn pair<const T: usize>(wv: __m256i, x: *const Block, xlo: *const Block) -> (__m256i, __m256i) {
        // SAFETY: the caller guarantees AVX-512F/BW/VL (and VNNI when `VNNI`) and `T`
        // readable blocks at `x` and at a non-null `xlo`.
        unsafe {
            let nib = nibbles(wv);
            let zero = _mm512_setzero_si512();
            let mut v = [zero; 8];
            for (r, vr) in v.iter_mut().enumerate().take(T) {
                let xh = load_block(&*x.add(r));
                *vr = if xlo.is_null() {
                    dot_u4_i8::<VNNI>(zero, nib, xh)
                } else if VNNI {
                    // The high plane's sums shifted, then the low plane's added on: at most
                    // 4 * 15 * 128 * 256 + 4 * 15 * 255 per lane.
                    let h = _mm512_slli_epi32::<8>(_mm512_dpbusd_epi32(zero, nib, xh));
                    _mm512_dpbusd_epi32(h, nib, load_block(&*xlo.add(r)))
                } else {
                    let h = _mm512_madd_epi16(_mm512_maddubs_epi16(nib, xh), _mm512_set1_epi16(256));
                    let l = _mm512_maddubs_epi16(nib, load_block(&*xlo.add(r)));
                    _mm512_add_epi32(h, _mm512_madd_epi16(l, _mm512_set1_epi16(1)))
                };
            }
            // Quarter q of r03 holds rows 0..3's sums of their blocks' quarter q.
            let r03 = fold512b(fold512(v[0], v[1]), fold512(v[2], v[3]));
            let r47 = fold512b(fold512(v[4], v[5]), fold512(v[6], v[7]));
            // [first r0-3, second r0-3, first r4-7, second r4-7].
            let s = _mm512_add_epi32(
                _mm512_shuffle_i64x2::<0b01_00_01_00>(r03, r47),
                _mm512_shuffle_i64x2::<0b11_10_11_10>(r03, r47),
            );
            let t = _mm512_shuffle_i64x2::<0b11_01_10_00>(s, s);
            (_mm512_castsi512_si256(t), _mm512_extracti64x4_epi64::<1>(t))
        }
    }

    #[inline(always)]
    unsafe fn group<const G: usize, const T: usize>(
        w0: __m256i,
        w1: __m256i,
        x: *const Block,
        xlo: *const Block,
        stride: usize,
    ) -> __m256i {
        // SAFETY: the caller guarantees AVX-512F/BW/VL (and VNNI when `VNNI`) and `T`
        // readable blocks at `x` and at a non-null `xlo` (`stride + T` at g128).
        unsafe {
            let two = G == 128;
            let nib0 = nibbles(w0);
            let nib1 = if two { nibbles(w1) } else { _mm512_setzero_si512() };
            let zero = _mm512_setzero_si512();
            let mut v = [zero; 8];
            for (r, vr) in v.iter_mut().enumerate().take(T) {
                let mut h = dot_u4_i8::<VNNI>(zero, nib0, load_block(&*x.add(r)));
                if two {
                    h = dot_u4_i8::<VNNI>(h, nib1, load_block(&*x.add(stride + r)));
                }
                *vr = if xlo.is_null() {
                    h
                } else {
                    // At most 8 * 15 * 128 * 256 + 8 * 15 * 255 per lane.
                    let mut l = dot_u4_i8::<VNNI>(zero, nib0, load_block(&*xlo.add(r)));
                    if two {
                        l = dot_u4_i8::<VNNI>(l, nib1, load_block(&*xlo.add(stride + r)));
                    }
                    _mm512_add_epi32(_mm512_slli_epi32::<8>(h), l)
                };
            }
            let r03 = fold512b(fold512(v[0], v[1]), fold512(v[2], v[3]));
            let r47 = fold512b(fold512(v[4], v[5]), fold512(v[6], v[7]));
            // [r0-3 over quarters 0 + 2, 1 + 3, r4-7 over 0 + 2, 1 + 3], then each half's
            // two quarters added: rows 0..3 in quarter 0, 4..7 in quarter 2.
            let s = _mm512_add_epi32(
                _mm512_shuffle_i64x2::<0b01_00_01_00>(r03, r47),
                _mm512_shuffle_i64x2::<0b11_10_11_10>(r03, r47),
            );
            let t = _mm512_add_epi32(s, _mm512_shuffle_i64x2::<0b10_11_00_01>(s, s));
            _mm512_castsi512_si256(_mm512_shuffle_i64x2::<0b00_00_10_00>(t, t))
        }
    }
}

/// One fold of i32 partials of two vectors: per 128 bits `[a0 + a2, b0 + b2, a1 + a3,
/// b1 + b3]`.
#[inline(always)]
unsafe fn fold512(a: __m512i, b: __m512i) -> __m512i {
    // SAFETY: the caller guarantees AVX-512F.
    unsafe { _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b)) }
}

/// The second fold: two [`fold512`] results to per 128 bits `[a, b, c, d]`, each the sum
/// of its input's four lanes in that quarter.
#[inline(always)]
unsafe fn fold512b(ab: __m512i, cd: __m512i) -> __m512i {
    // SAFETY: the caller guarantees AVX-512F.
    unsafe { _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd)) }
}

/// AVX-512's dots for the small tiles (up to four rows, lane = group) of `qmv_wide`: for
/// each row the integer sums `qmv`'s AVX-512 loop computes for one chunk of eight groups
/// ([`Avx512Dots::chunk8`]), with each block of codes unpacked once for all the tile's
/// rows. Exact integer sums, so the same bits as AVX2's `chunk_rows`. Only 4-bit g32 and
/// g64 rows (whose groups are one 64-byte block or half of one) under `int16`'s split
/// planes take them ([`small_tiles_take`]); the dispatcher runs AVX2's for the others.
pub(super) struct Avx512Small<const VNNI: bool>;

/// Whether the small tiles of `bits`-bit weights at group size `g` take [`Avx512Small`],
/// for activations in two planes (`split`, `int16`) or one (`int8`). With one plane
/// AVX2's dots are faster: `qmv_wide` on 4-bit g64 4864 x 896 at 2 threads under `int8`
/// took 0.273 ms at M = 2 and 0.386 ms at M = 4 on AVX-512's, 0.242 and 0.311 on AVX2's
/// (Xeon family 6 model 207, medians of three interleaved runs).
pub(super) const fn small_tiles_take(bits: u32, g: usize, split: bool) -> bool {
    bits == 4 && g <= 64 && split
}

impl<const VNNI: bool> super::traits::SmallTotals for Avx512Small<VNNI> {
    #[inline(always)]
    unsafe fn rows<const BITS: u32, const G: usize, const T: usize>(
        wrow: &[u8],
        xt: &XTile,
        g0: usize,
        ng: usize,
    ) -> [__m256i; T] {
        assert!(
            small_tiles_take(BITS, G, xt.split())
                && ng <= 8
                && xt.slots == T
                && xt.lo.len() == xt.blocks.len()
        );
        // SAFETY: the caller guarantees AVX-512F/BW/VL (and VNNI when `VNNI`); every load
        // is of a checked slice or an indexed block.
        unsafe {
            let zero = _mm512_setzero_si512();
            let mut out = [_mm256_setzero_si256(); T];
            if G == 32 {
                // Pair `p = g / 2` holds groups 2p and 2p + 1; a last lone group is half a
                // block.
                let mut nib = [zero; 4];
                let mut pair = [usize::MAX; 4];
                for (i, (ni, pi)) in nib.iter_mut().zip(pair.iter_mut()).enumerate() {
                    let g = g0 + 2 * i;
                    if g < g0 + ng {
                        let p = g / 2;
                        let wb = &wrow[32 * p..(32 * p + 32).min(wrow.len())];
                        *ni = nibbles(if wb.len() == 32 { load32(wb) } else { load16z(wb) });
                        *pi = p;
                    }
                }
                for (r, o) in out.iter_mut().enumerate() {
                    let mut acc = [zero; 4];
                    for ((a, &ni), &p) in acc.iter_mut().zip(&nib).zip(&pair) {
                        if p != usize::MAX {
                            let i = p * T + r;
                            *a = q4_block_split::<VNNI>(ni, &xt.blocks[i], &xt.lo[i]);
                        }
                    }
                    *o = pairs_to_groups(acc);
                }
            } else {
                // g64: group `g` is one 32-byte block against block `g` of each row.
                let mut nib = [zero; 8];
                for (j, nj) in nib.iter_mut().enumerate().take(ng) {
                    let g = g0 + j;
                    *nj = nibbles(load32(&wrow[32 * g..32 * g + 32]));
                }
                for (r, o) in out.iter_mut().enumerate() {
                    let mut v = [zero; 8];
                    for (j, (vj, &nj)) in v.iter_mut().zip(&nib).enumerate().take(ng) {
                        let i = (g0 + j) * T + r;
                        *vj = q4_block_split::<VNNI>(nj, &xt.blocks[i], &xt.lo[i]);
                    }
                    *o = groups_to_lanes(v);
                }
            }
            out
        }
    }
}
