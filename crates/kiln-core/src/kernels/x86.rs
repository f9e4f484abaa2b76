//! AVX2 + FMA + F16C kernels for 4- and 8-bit weights at group sizes 32, 64 and 128.
//!
//! They follow the integer scheme (see [`super::act`]): activations quantized per group,
//! one exact integer dot per weight group, then the float work of [`super::act::Lanes`]
//! done for eight groups (`qmv`) or eight activation rows (`qmv_wide`, `qmm`) at once.
//!
//! - 4-bit: a 32-byte block of packed weights holds 64 codes; `and 0x0F` gives the even
//!   elements, `>> 4` the odd ones, each multiplied against the de-interleaved 8-bit
//!   activations with `maddubs` (u4 * i8 pairs cannot saturate), the two i16 results
//!   added (at most 8 products of 15 * 127 per lane over a 128-group) and widened with
//!   `madd` by ones.
//! - 8-bit: `cvtepu8_epi16` widens 16 codes, `madd` multiplies them against 16-bit
//!   activations into i32 pairs (u8 * i16 products, which `maddubs` would saturate).
//! - The eight partials of eight groups (or of eight rows) are reduced at once by a
//!   transpose of unpacks and adds, so one `cvt` and three FMAs serve eight outputs; the
//!   centring (`- c * qsum`) is one shift and subtract per eight.
//!
//! Scales and biases are read in their stored dtype and widened a row at a time: f16
//! with `vcvtph2ps`, bf16 by a 16-bit left shift, f32 as is.

use std::arch::x86_64::*;
use std::ops::Range;

use half::{bf16, f16};

use super::act::{ActCodes, TILE_ROWS};
use super::drive;
use super::tile::{Block, GROUP_LANE_ROWS, XTile};
use crate::matrix::{QuantizedMatrix, ScaleData};

/// The loop order of the tiled kernels.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Order {
    /// Each weight row once, every tile against it (`qmv_wide`): one pass over the
    /// weights with the row hot in L1.
    RowOuter,
    /// Each tile against a task's whole block of weight rows (`qmm`): the block stays in
    /// L2 while the activation tile is hot in L1.
    TileOuter,
}

/// `y[n] = W x` for one activation row.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
pub(super) unsafe fn qmv(x: &[f32], w: &QuantizedMatrix, y: &mut [f32]) {
    let spec = w.spec();
    let codes = codes_for(spec.bits());
    // SAFETY: this function's caller guarantees AVX2, FMA and F16C.
    let xt = unsafe { quantize_vector(x, spec.group_size(), codes) };
    let rpt = drive::rows_per_task(w.n(), w.bytes_read() / w.n());
    drive::rows(y, rpt, |rows, out| {
        // SAFETY: this function's caller guarantees AVX2, FMA and F16C; every core rayon
        // runs this closure on is the same CPU.
        unsafe { qmv_rows_any(w, &xt, rows, out) }
    });
}

/// `y[m, n] = x[m, k] W^T` with each weight row read once for every activation row.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
pub(super) unsafe fn qmv_wide(x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32]) {
    // SAFETY: forwarded from this function's contract.
    unsafe { tiled(x, m, w, y, Order::RowOuter) }
}

/// `y[m, n] = x[m, k] W^T` for large `m`, blocked so weights are read from memory once and
/// from L2 for every further tile of activation rows.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
pub(super) unsafe fn qmm(x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32]) {
    // SAFETY: forwarded from this function's contract.
    unsafe { tiled(x, m, w, y, Order::TileOuter) }
}

fn codes_for(bits: u32) -> ActCodes {
    ActCodes::for_weight_bits(bits).expect("the AVX2 kernels take 4- and 8-bit weights only")
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C.
unsafe fn tiled(x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32], order: Order) {
    let spec = w.spec();
    // SAFETY: this function's caller guarantees AVX2, FMA and F16C.
    let tiles = unsafe { quantize_tiles(x, m, w.k(), spec.group_size(), codes_for(spec.bits())) };
    let rpt = drive::rows_per_task(w.n(), w.bytes_read() / w.n());
    drive::rows_multi(y, m, w.n(), rpt, |rows, outs| {
        // SAFETY: this function's caller guarantees AVX2, FMA and F16C; every core rayon
        // runs this closure on is the same CPU.
        unsafe { tiled_rows_any(w, &tiles, rows, outs, order) }
    });
}

/// The activation quantizer compiled for AVX2 (its functions are `inline(always)`).
#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_vector(x: &[f32], g: usize, codes: ActCodes) -> XTile {
    XTile::vector(x, g, codes)
}

/// The tile quantizer compiled for AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_tiles(x: &[f32], m: usize, k: usize, g: usize, codes: ActCodes) -> Vec<XTile> {
    XTile::tiles(x, m, k, g, codes)
}

macro_rules! by_geometry {
    ($w:expr, $f:ident, ($($arg:expr),*)) => {
        match ($w.spec().bits(), $w.spec().group_size()) {
            (4, 32) => $f::<4, 32>($($arg),*),
            (4, 64) => $f::<4, 64>($($arg),*),
            (4, 128) => $f::<4, 128>($($arg),*),
            (8, 32) => $f::<8, 32>($($arg),*),
            (8, 64) => $f::<8, 64>($($arg),*),
            (8, 128) => $f::<8, 128>($($arg),*),
            (bits, g) => unreachable!("no AVX2 kernel for {bits}-bit g{g}: the dispatcher routes it elsewhere"),
        }
    };
}

#[target_feature(enable = "avx2,fma,f16c")]
fn qmv_rows_any(w: &QuantizedMatrix, xt: &XTile, rows: Range<usize>, out: &mut [f32]) {
    match w.scales() {
        ScaleData::F16(_) => by_geometry!(w, qmv_rows_f16, (w, xt, rows, out)),
        ScaleData::Bf16(_) => by_geometry!(w, qmv_rows_bf16, (w, xt, rows, out)),
        ScaleData::F32(_) => by_geometry!(w, qmv_rows_f32, (w, xt, rows, out)),
    }
}

// One monomorphic entry per scale dtype, so `by_geometry!` can name them.
#[target_feature(enable = "avx2,fma,f16c")]
fn qmv_rows_f16<const BITS: u32, const G: usize>(
    w: &QuantizedMatrix,
    xt: &XTile,
    rows: Range<usize>,
    out: &mut [f32],
) {
    qmv_rows::<BITS, G, F16>(w, xt, rows, out)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn qmv_rows_bf16<const BITS: u32, const G: usize>(
    w: &QuantizedMatrix,
    xt: &XTile,
    rows: Range<usize>,
    out: &mut [f32],
) {
    qmv_rows::<BITS, G, BF16>(w, xt, rows, out)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn qmv_rows_f32<const BITS: u32, const G: usize>(
    w: &QuantizedMatrix,
    xt: &XTile,
    rows: Range<usize>,
    out: &mut [f32],
) {
    qmv_rows::<BITS, G, F32>(w, xt, rows, out)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn tiled_rows_any(
    w: &QuantizedMatrix,
    tiles: &[XTile],
    rows: Range<usize>,
    outs: &mut [&mut [f32]],
    order: Order,
) {
    by_geometry!(w, tiled_rows, (w, tiles, rows, outs, order))
}

/// The packed bytes of every row (x86-64 is little-endian, so byte `i` of a row holds
/// bits `8i .. 8i + 8` of its stream).
fn packed_bytes(w: &QuantizedMatrix) -> &[u8] {
    bytemuck::cast_slice(w.packed())
}

/// Scales and biases of a range of rows widened to f32 in one pass (rows stay contiguous,
/// `gpr` apart), with eight zeros after the last row so an 8-lane load at any group of
/// any row stays in bounds.
struct RowScales {
    gpr: usize,
    s: Vec<f32>,
    b: Vec<f32>,
}

impl RowScales {
    #[target_feature(enable = "avx2,fma,f16c")]
    fn new(w: &QuantizedMatrix, rows: Range<usize>) -> RowScales {
        let gpr = w.spec().groups_per_row(w.k());
        let len = rows.len() * gpr;
        let mut s = vec![0f32; len + 8];
        let mut b = vec![0f32; len + 8];
        widen(w.scales(), rows.start * gpr, &mut s[..len]);
        widen(w.biases(), rows.start * gpr, &mut b[..len]);
        RowScales { gpr, s, b }
    }

    /// Row `i`'s scales and biases, followed by whatever comes next (at least 8 values).
    fn row(&self, i: usize) -> (&[f32], &[f32]) {
        (&self.s[i * self.gpr..], &self.b[i * self.gpr..])
    }
}

/// Scale storage dtypes as const tags: the `qmv` loop reads scales and biases in their
/// stored form, eight at a time, widening them in registers.
const F16: u8 = 0;
const BF16: u8 = 1;
const F32: u8 = 2;

/// Bytes of one scale in dtype `D`.
const fn scale_size(d: u8) -> usize {
    if d == F32 { 4 } else { 2 }
}

/// The raw bytes of a scale or bias tensor.
fn scale_bytes(sd: &ScaleData) -> &[u8] {
    match sd {
        ScaleData::F16(v) => bytemuck::cast_slice(v),
        ScaleData::Bf16(v) => bytemuck::cast_slice(v),
        ScaleData::F32(v) => bytemuck::cast_slice(v),
    }
}

/// Eight scales of dtype `D` (`b` holds exactly their bytes) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load_scales8<const D: u8>(b: &[u8]) -> __m256 {
    match D {
        F16 => _mm256_cvtph_ps(load16(b)),
        BF16 => bf16x8_to_f32(load16(b)),
        _ => {
            assert!(b.len() >= 32);
            // SAFETY: `b` has at least 32 readable bytes (asserted): eight f32.
            unsafe { _mm256_loadu_ps(b.as_ptr().cast()) }
        }
    }
}

/// Rows of packed weights ahead of the current one whose scales and biases are
/// prefetched (they stream beside the codes, an eighth of their bytes).
const SCALE_PREFETCH_ROWS: usize = 4;

#[target_feature(enable = "avx2,fma,f16c")]
fn qmv_rows<const BITS: u32, const G: usize, const D: u8>(
    w: &QuantizedMatrix,
    xt: &XTile,
    rows: Range<usize>,
    out: &mut [f32],
) {
    // The scheme is a type parameter of the row loop, so no branch on it runs per step.
    match Prefetch::for_qmv(w.k(), BITS) {
        Prefetch::L1 => qmv_rows_by::<BITS, G, D, false>(w, xt, rows, out),
        Prefetch::TwoLevel => qmv_rows_by::<BITS, G, D, true>(w, xt, rows, out),
    }
}

/// [`qmv_rows`] with the prefetch scheme fixed: [`Prefetch::TwoLevel`] when `TWO_LEVEL`.
#[target_feature(enable = "avx2,fma,f16c")]
fn qmv_rows_by<const BITS: u32, const G: usize, const D: u8, const TWO_LEVEL: bool>(
    w: &QuantizedMatrix,
    xt: &XTile,
    rows: Range<usize>,
    out: &mut [f32],
) {
    let k = w.k();
    let gpr = k / G;
    let row_bytes = k * BITS as usize / 8;
    let srow_bytes = gpr * scale_size(D);
    let packed = packed_bytes(w);
    let (sall, ball) = (scale_bytes(w.scales()), scale_bytes(w.biases()));
    for (r, o) in rows.zip(out) {
        let ahead = (r + SCALE_PREFETCH_ROWS) * srow_bytes;
        prefetch_line(sall, ahead);
        prefetch_line(ball, ahead);
        let (sb, wb) = (r * srow_bytes, r * row_bytes);
        *o = qmv_row::<BITS, G, D, TWO_LEVEL>(&packed[wb..], &sall[sb..], &ball[sb..], xt, gpr);
    }
}

/// One output of `qmv`: eight groups per step, lane = group. `w`, `s` and `b` start at
/// the row's packed codes, scales and biases (in their stored bytes) and run on to the
/// end of the matrix: the last, partial step of eight groups reads its scales past the
/// row when the matrix goes on, masking the lanes that are not the row's.
#[target_feature(enable = "avx2,fma,f16c")]
fn qmv_row<const BITS: u32, const G: usize, const D: u8, const TWO_LEVEL: bool>(
    w: &[u8],
    s: &[u8],
    b: &[u8],
    xt: &XTile,
    gpr: usize,
) -> f32 {
    let gb = G * BITS as usize / 8;
    let (cw, cx, cs) = (8 * gb, 8 * gb / 32, 8 * scale_size(D));
    let mut acc = _mm256_setzero_ps();
    let full = gpr / 8;
    for c in 0..full {
        prefetch_ahead::<TWO_LEVEL>(w, c * cw, cw);
        let tot = chunk8::<BITS, G>(&w[c * cw..(c + 1) * cw], &xt.blocks[c * cx..(c + 1) * cx], 8);
        let (sv, bv) =
            (load_scales8::<D>(&s[c * cs..(c + 1) * cs]), load_scales8::<D>(&b[c * cs..(c + 1) * cs]));
        acc = lanes_step::<BITS>(acc, tot, sv, bv, XGroups::at(xt, c * 8));
    }
    if !gpr.is_multiple_of(8) {
        let g0 = full * 8;
        let ng = gpr - g0;
        prefetch_ahead::<TWO_LEVEL>(w, full * cw, ng * gb);
        let tot =
            chunk8::<BITS, G>(&w[full * cw..full * cw + ng * gb], &xt.blocks[full * cx..(full + 1) * cx], ng);
        let st = &s[full * cs..];
        let (sv, bv) = if st.len() >= cs {
            // Zero the lanes that hold the next row's scales, so even a non-finite
            // neighbour cannot reach this output.
            let keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                _mm256_set1_epi32(ng as i32),
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            ));
            (
                _mm256_and_ps(load_scales8::<D>(&st[..cs]), keep),
                _mm256_and_ps(load_scales8::<D>(&b[full * cs..full * cs + cs]), keep),
            )
        } else {
            // The matrix's last row: a zero-padded copy.
            let (mut sp, mut bp) = ([0u8; 32], [0u8; 32]);
            let n = ng * scale_size(D);
            sp[..n].copy_from_slice(&st[..n]);
            bp[..n].copy_from_slice(&b[full * cs..full * cs + n]);
            (load_scales8::<D>(&sp[..cs]), load_scales8::<D>(&bp[..cs]))
        };
        acc = lanes_step::<BITS>(acc, tot, sv, bv, XGroups::at(xt, g0));
    }
    hsum(acc)
}

/// The integer dots of `ng <= 8` consecutive groups (`w` their `ng` groups of packed bytes,
/// `x` the activation blocks of eight groups): lane `j` = group `j`, zero from `ng` on.
/// Straight-line code, so the partials stay in registers; a whole step passes `ng = 8` as a
/// constant and its guards fold away.
#[inline]
#[target_feature(enable = "avx2")]
fn chunk8<const BITS: u32, const G: usize>(w: &[u8], x: &[Block], ng: usize) -> __m256i {
    let gb = G * BITS as usize / 8;
    let bpg = gb.div_ceil(32);
    assert!(ng <= 8 && w.len() == ng * gb && x.len() == 8 * gb / 32);
    let zero = _mm256_setzero_si256();
    if BITS == 4 && G == 32 {
        // Block `i` holds groups 2i and 2i + 1; a last lone group is a half block.
        let p = |i: usize| {
            if 2 * i + 1 < ng {
                q4_dot16(load32(&w[32 * i..32 * i + 32]), &x[i])
            } else if 2 * i < ng {
                q4_dot16(load16z(&w[32 * i..32 * i + 16]), &x[i])
            } else {
                zero
            }
        };
        pairs_to_groups([p(0), p(1), p(2), p(3)])
    } else {
        let g = |j: usize| {
            if j < ng {
                group_partials::<BITS, G, 1>(&w[j * gb..(j + 1) * gb], &x[j * bpg..(j + 1) * bpg])[0]
            } else {
                zero
            }
        };
        let (lo, hi) = reduce8::<BITS, G>([g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7)]);
        _mm256_add_epi32(lo, hi)
    }
}

/// Four `[A | B]` i16 pair partials of 4-bit g32 codes (pair `i` = groups `2i`, `2i + 1`)
/// to eight group sums in order. Lanes start at 4 products; two pairwise levels reach 16,
/// at most 16 * 15 * 127 = 30480, inside i16.
#[inline]
#[target_feature(enable = "avx2")]
fn pairs_to_groups(p: [__m256i; 4]) -> __m256i {
    // [g0, g2, g4, g6 | g1, g3, g5, g7]
    let q = _mm256_madd_epi16(fold16b(fold16(p[0], p[1]), fold16(p[2], p[3])), _mm256_set1_epi16(1));
    _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
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
fn reduce8<const BITS: u32, const G: usize>(v: [__m256i; 8]) -> (__m256i, __m256i) {
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
fn fold16(a: __m256i, b: __m256i) -> __m256i {
    _mm256_add_epi16(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b))
}

/// The second fold of i16 partials: two [`fold16`] results to per 128 bits
/// `[a a b b c c d d]`.
#[inline]
#[target_feature(enable = "avx2")]
fn fold16b(ab: __m256i, cd: __m256i) -> __m256i {
    _mm256_add_epi16(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd))
}

/// One fold of i32 partials: per 128 bits `[a b a b]`.
#[inline]
#[target_feature(enable = "avx2")]
fn fold32(a: __m256i, b: __m256i) -> __m256i {
    _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b))
}

/// The second fold of i32 partials (`[a b a b]`, `[c d c d]`): per 128 bits `[a b c d]`.
#[inline]
#[target_feature(enable = "avx2")]
fn fold32b(ab: __m256i, cd: __m256i) -> __m256i {
    _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd))
}

/// The even/odd nibble products of one 32-byte block of 4-bit codes, summed in i16 lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn q4_dot16(wv: __m256i, x: &Block) -> __m256i {
    let mask = _mm256_set1_epi8(0x0F);
    let lo = _mm256_and_si256(wv, mask);
    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(wv), mask);
    _mm256_add_epi16(_mm256_maddubs_epi16(lo, load_lo(x)), _mm256_maddubs_epi16(hi, load_hi(x)))
}

/// [`super::act::Lanes::add_group`] for eight lanes: with `t = tot - c * qsum` and
/// `bc = fma(s, c, b)` (`c = 2^(BITS - 1)`), `acc = fma(t, s * sx, acc)` then
/// `acc = fma(bc, xsum, acc)`. `x` holds the eight groups' activation scales, sums and
/// code sums.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn lanes_step<const BITS: u32>(acc: __m256, tot: __m256i, s: __m256, b: __m256, x: XGroups<'_>) -> __m256 {
    let centred = _mm256_sub_epi32(tot, times_center::<BITS>(load8i(x.qsum)));
    let bc = _mm256_fmadd_ps(s, _mm256_set1_ps(center_of(BITS) as f32), b);
    let ss = _mm256_mul_ps(s, load8f(x.sx));
    let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), ss, acc);
    _mm256_fmadd_ps(bc, load8f(x.xsum), acc)
}

/// The eight groups' activation scales, exact sums and code sums (eight values each).
#[derive(Clone, Copy)]
struct XGroups<'a> {
    sx: &'a [f32],
    xsum: &'a [f32],
    qsum: &'a [i32],
}

impl<'a> XGroups<'a> {
    /// Groups `g0 .. g0 + 8` of a tile's lane-per-group layout starting at `base`.
    fn at(xt: &'a XTile, base: usize) -> XGroups<'a> {
        XGroups { sx: &xt.sx[base..base + 8], xsum: &xt.xsum[base..base + 8], qsum: &xt.qsum[base..base + 8] }
    }
}

/// The weight code products are centred on: `2^(bits - 1)`.
const fn center_of(bits: u32) -> i32 {
    1 << (bits - 1)
}

/// `v * 2^(BITS - 1)` (exact: at most 128 * 128 * 32767 in magnitude).
#[inline]
#[target_feature(enable = "avx2")]
fn times_center<const BITS: u32>(v: __m256i) -> __m256i {
    if BITS == 4 { _mm256_slli_epi32::<3>(v) } else { _mm256_slli_epi32::<7>(v) }
}

/// The eight lanes summed as [`super::act::Lanes::finish`] does.
#[inline]
#[target_feature(enable = "avx2")]
fn hsum(acc: __m256) -> f32 {
    let s1 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
    let s2 = _mm_add_ps(s1, _mm_movehl_ps(s1, s1));
    let s3 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
    _mm_cvtss_f32(s3)
}

/// Integer partials of one group (4-bit g32: of a pair of groups, or of a last lone group
/// when `w` is 16 bytes) against `T` activation rows: the lanes of `out[r]` sum to the
/// group's dot with row `r` (4-bit g32: low 128 bits the first group, high the second).
/// 4-bit partials are i16 lanes (see [`reduce8`] for their bounds), 8-bit ones i32.
/// `x[blk * T + r]` is block `blk` of the group for row `r`.
#[inline]
#[target_feature(enable = "avx2")]
fn group_partials<const BITS: u32, const G: usize, const T: usize>(w: &[u8], x: &[Block]) -> [__m256i; T] {
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

#[target_feature(enable = "avx2,fma,f16c")]
fn tiled_rows<const BITS: u32, const G: usize>(
    w: &QuantizedMatrix,
    tiles: &[XTile],
    rows: Range<usize>,
    outs: &mut [&mut [f32]],
    order: Order,
) {
    let k = w.k();
    let gpr = k / G;
    let row_bytes = k * BITS as usize / 8;
    let packed = packed_bytes(w);
    let r0 = rows.start;
    let sc = RowScales::new(w, rows.clone());
    let two_level =
        matches!(Prefetch::for_tile(tiles.first().map_or(1, |t| t.slots), k, BITS), Prefetch::TwoLevel);
    let mut one = |r: usize, ti: usize, tile: &XTile| {
        let (s, b) = sc.row(r - r0);
        let wrow = &packed[r * row_bytes..(r + 1) * row_bytes];
        let lanes = match tile.slots {
            1 if two_level => group_lanes_row::<BITS, G, 1, true>(wrow, s, b, tile, gpr),
            1 => group_lanes_row::<BITS, G, 1, false>(wrow, s, b, tile, gpr),
            2 if two_level => group_lanes_row::<BITS, G, 2, true>(wrow, s, b, tile, gpr),
            2 => group_lanes_row::<BITS, G, 2, false>(wrow, s, b, tile, gpr),
            3 if two_level => group_lanes_row::<BITS, G, 3, true>(wrow, s, b, tile, gpr),
            3 => group_lanes_row::<BITS, G, 3, false>(wrow, s, b, tile, gpr),
            4 if two_level => group_lanes_row::<BITS, G, 4, true>(wrow, s, b, tile, gpr),
            4 => group_lanes_row::<BITS, G, 4, false>(wrow, s, b, tile, gpr),
            _ => store8f(wide_row::<BITS, G, 8>(wrow, s, b, tile, gpr)),
        };
        for (i, &l) in lanes.iter().enumerate().take(tile.rows) {
            outs[ti * TILE_ROWS + i][r - r0] = l;
        }
    };
    match order {
        Order::RowOuter => {
            // Tiles of up to four rows prefetch as they go; an eight-row tile, compute-bound,
            // asks for its next row at once.
            let burst = tiles.first().is_some_and(|t| t.slots > GROUP_LANE_ROWS);
            for r in rows {
                if burst {
                    prefetch_burst(packed, r * row_bytes, row_bytes);
                }
                for (ti, tile) in tiles.iter().enumerate() {
                    one(r, ti, tile);
                }
            }
        }
        Order::TileOuter => {
            for (ti, tile) in tiles.iter().enumerate() {
                for r in rows.clone() {
                    if ti == 0 && tile.slots > GROUP_LANE_ROWS {
                        prefetch_burst(packed, r * row_bytes, row_bytes);
                    }
                    one(r, ti, tile);
                }
            }
        }
    }
}

/// One weight row against `T <= 4` activation rows, computed row by row exactly as `qmv`
/// computes its one row (lane = group: the same integer sums, the same float order), with
/// each weight group unpacked once for all `T` rows. Small tiles take this path because
/// the lane = row kernel would leave most of its eight lanes empty. Returns the outputs in
/// lanes `0..T`.
#[target_feature(enable = "avx2,fma,f16c")]
fn group_lanes_row<const BITS: u32, const G: usize, const T: usize, const TWO_LEVEL: bool>(
    wrow: &[u8],
    s: &[f32],
    b: &[f32],
    xt: &XTile,
    gpr: usize,
) -> [f32; 8] {
    debug_assert_eq!(xt.slots, T);
    let gp = gpr.div_ceil(8) * 8;
    let gb = G * BITS as usize / 8;
    let mut acc = [_mm256_setzero_ps(); T];
    for c in 0..gpr.div_ceil(8) {
        let g0 = 8 * c;
        let ng = (gpr - g0).min(8);
        // Spread over the row as `qmv` does: a burst at the start of each row leaves these
        // memory-bound small tiles waiting on memory.
        prefetch_ahead::<TWO_LEVEL>(wrow, g0 * gb, ng * gb);
        let tots = chunk_rows::<BITS, G, T>(wrow, &xt.blocks, g0, ng);
        // `s` and `b` run on past the row (RowScales pads the last row with eight zeros):
        // zero the lanes past the row's groups, so even a non-finite neighbour cannot
        // reach this output.
        let keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_set1_epi32(ng as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        ));
        let sv = _mm256_and_ps(load8f(&s[g0..g0 + 8]), keep);
        let bv = _mm256_and_ps(load8f(&b[g0..g0 + 8]), keep);
        for (r, (a, tot)) in acc.iter_mut().zip(tots).enumerate() {
            let x0 = r * gp + g0;
            *a = lanes_step::<BITS>(*a, tot, sv, bv, XGroups::at(xt, x0));
        }
    }
    let mut out = [0f32; 8];
    for (o, a) in out.iter_mut().zip(acc) {
        *o = hsum(a);
    }
    out
}

/// For each of `T` activation rows, the integer dots of groups `g0 .. g0 + ng` (`ng <= 8`)
/// of one weight row, lane `j` = group `g0 + j` (zero beyond `ng`): the arithmetic of
/// [`chunk8`] and [`reduce8`], with each group's codes unpacked once for all rows.
#[inline]
#[target_feature(enable = "avx2")]
fn chunk_rows<const BITS: u32, const G: usize, const T: usize>(
    wrow: &[u8],
    x: &[Block],
    g0: usize,
    ng: usize,
) -> [__m256i; T] {
    let zero = _mm256_setzero_si256();
    let mut out = [zero; T];
    if BITS == 4 && G == 32 {
        // Block `p` holds groups 2p and 2p + 1.
        let mut v = [[zero; 4]; T];
        for i in 0..4 {
            let g = g0 + 2 * i;
            if g < g0 + ng {
                let p = g / 2;
                let wb = &wrow[32 * p..(32 * p + 32).min(wrow.len())];
                let part = group_partials::<4, 32, T>(wb, &x[p * T..p * T + T]);
                for (vr, pr) in v.iter_mut().zip(part) {
                    vr[i] = pr;
                }
            }
        }
        for (o, vr) in out.iter_mut().zip(v) {
            *o = pairs_to_groups(vr);
        }
        return out;
    }
    let gb = G * BITS as usize / 8;
    let bpg = gb / 32;
    let ones = _mm256_set1_epi16(1);
    macro_rules! part {
        ($j:expr) => {{
            let g = g0 + $j;
            if $j < ng {
                group_partials::<BITS, G, T>(&wrow[g * gb..(g + 1) * gb], &x[g * bpg * T..(g + 1) * bpg * T])
            } else {
                [zero; T]
            }
        }};
    }
    // The folds of `reduce8`, one pair of groups at a time so few vectors stay live.
    let fold_pair = |a: __m256i, b: __m256i| {
        if BITS != 4 {
            fold32(a, b)
        } else if G <= 64 {
            fold16(a, b)
        } else {
            _mm256_madd_epi16(fold16(a, b), ones)
        }
    };
    let fold_quad = |ab: __m256i, cd: __m256i| {
        if BITS == 4 && G <= 64 { _mm256_madd_epi16(fold16b(ab, cd), ones) } else { fold32b(ab, cd) }
    };
    let mut halves = [[zero; T]; 2];
    for (h, half) in halves.iter_mut().enumerate() {
        let (p0, p1) = (part!(4 * h), part!(4 * h + 1));
        let mut ab = [zero; T];
        for r in 0..T {
            ab[r] = fold_pair(p0[r], p1[r]);
        }
        let (p2, p3) = (part!(4 * h + 2), part!(4 * h + 3));
        for r in 0..T {
            half[r] = fold_quad(ab[r], fold_pair(p2[r], p3[r]));
        }
    }
    for (r, o) in out.iter_mut().enumerate() {
        let (q0, q1) = (halves[0][r], halves[1][r]);
        *o = _mm256_add_epi32(
            _mm256_permute2x128_si256::<0x20>(q0, q1),
            _mm256_permute2x128_si256::<0x31>(q0, q1),
        );
    }
    out
}

/// One weight row against a tile of `T` activation rows: lane `r` of the result is the
/// output for row `r`. The float work runs per group with lane = row, kept in eight
/// accumulators by group modulo 8 so that every lane rounds as `qmv`'s lane does.
#[target_feature(enable = "avx2,fma,f16c")]
fn wide_row<const BITS: u32, const G: usize, const T: usize>(
    wrow: &[u8],
    s: &[f32],
    b: &[f32],
    xt: &XTile,
    gpr: usize,
) -> __m256 {
    let gb = G * BITS as usize / 8;
    let xblocks = (gpr * gb).div_ceil(32) * T;
    assert!(
        xt.slots == T
            && wrow.len() == gpr * gb
            && s.len() >= gpr
            && b.len() >= gpr
            && xt.blocks.len() >= xblocks
            && xt.sx.len() >= gpr * TILE_ROWS
            && xt.xsum.len() >= gpr * TILE_ROWS
            && xt.qsum.len() >= gpr * TILE_ROWS,
        "wide_row: inputs shorter than the row's {gpr} groups"
    );
    let args = WideRow {
        w: wrow.as_ptr(),
        x: xt.blocks.as_ptr(),
        s: s.as_ptr(),
        b: b.as_ptr(),
        sx: xt.sx.as_ptr(),
        xsum: xt.xsum.as_ptr(),
        qsum: xt.qsum.as_ptr(),
        gpr,
    };
    // SAFETY: the assertion above gives every extent `wide_row_raw` requires: the row's
    // `gpr * gb` packed bytes, `ceil(gpr * gb / 32) * T` activation blocks, `gpr` scales
    // and biases, and `gpr * 8` activation scales, sums and code sums.
    unsafe { wide_row_raw::<BITS, G, T>(args) }
}

/// The inputs of [`wide_row_raw`] for one weight row: the row's packed codes, the tile's
/// activation blocks, the row's widened scales and biases, the tile's transposed
/// activation scales, sums and code sums, and the row's group count.
#[derive(Clone, Copy)]
struct WideRow {
    w: *const u8,
    x: *const Block,
    s: *const f32,
    b: *const f32,
    sx: *const f32,
    xsum: *const f32,
    qsum: *const i32,
    gpr: usize,
}

/// [`wide_row`]'s loop over raw pointers, so no bounds check or spilled slice sits in the
/// hot path.
///
/// # Safety
/// AVX2, FMA and F16C are available, and with `gb = G * BITS / 8`: `w` is readable for
/// `gpr * gb` bytes, `x` for `ceil(gpr * gb / 32) * T` blocks, `s` and `b` for `gpr`
/// values, `sx`, `xsum` and `qsum` for `gpr * 8`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn wide_row_raw<const BITS: u32, const G: usize, const T: usize>(a: WideRow) -> __m256 {
    let gb = G * BITS as usize / 8;
    let bpg = gb.div_ceil(32);
    let mut acc = [_mm256_setzero_ps(); 8];
    // SAFETY: group `g < gpr` reads `w[g * gb .. (g + 1) * gb]` (4-bit g32: pair `g / 2`
    // reads 32 bytes, or 16 for a last lone group), blocks `[g * bpg * T, (g + 1) * bpg * T)`
    // (4-bit g32: `[p * T, (p + 1) * T)`), `s[g]`, `b[g]`, and `sx`, `xsum`, `qsum` at
    // `[8g .. 8g + 8]`: all inside the extents this function's contract gives.
    unsafe {
        let center = _mm256_set1_ps(center_of(BITS) as f32);
        let step = |acc: &mut __m256, tot: __m256i, g: usize| {
            let qsum = _mm256_loadu_si256(a.qsum.add(g * TILE_ROWS).cast());
            let centred = _mm256_sub_epi32(tot, times_center::<BITS>(qsum));
            let s = _mm256_set1_ps(*a.s.add(g));
            let bc = _mm256_fmadd_ps(s, center, _mm256_set1_ps(*a.b.add(g)));
            let ss = _mm256_mul_ps(s, _mm256_loadu_ps(a.sx.add(g * TILE_ROWS)));
            let t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), ss, *acc);
            *acc = _mm256_fmadd_ps(bc, _mm256_loadu_ps(a.xsum.add(g * TILE_ROWS)), t);
        };
        if BITS == 4 && G == 32 {
            let mut g = 0;
            while g < a.gpr {
                let p = g / 2;
                let wv = if g + 1 < a.gpr {
                    _mm256_loadu_si256(a.w.add(32 * p).cast())
                } else {
                    _mm256_zextsi128_si256(_mm_loadu_si128(a.w.add(32 * p).cast()))
                };
                let (ta, tb) = q4_tile_tot::<32, T>(wv, _mm256_setzero_si256(), a.x.add(p * T), 0);
                step(&mut acc[g % 8], ta, g);
                if g + 1 < a.gpr {
                    step(&mut acc[(g + 1) % 8], tb, g + 1);
                }
                g += 2;
            }
        } else {
            let tot = |g: usize| {
                let wg = a.w.add(g * gb);
                let xg = a.x.add(g * bpg * T);
                if BITS == 4 {
                    let w1 =
                        if G == 128 { _mm256_loadu_si256(wg.add(32).cast()) } else { _mm256_setzero_si256() };
                    let (lo, hi) = q4_tile_tot::<G, T>(_mm256_loadu_si256(wg.cast()), w1, xg, T);
                    _mm256_add_epi32(lo, hi)
                } else {
                    q8_tile_tot::<T>(wg, xg, bpg)
                }
            };
            // Two groups per step: their independent work interleaves, so the serial tail
            // of one group's reduction overlaps the other's products.
            let mut g = 0;
            while g + 1 < a.gpr {
                let (t0, t1) = (tot(g), tot(g + 1));
                step(&mut acc[g % 8], t0, g);
                step(&mut acc[(g + 1) % 8], t1, g + 1);
                g += 2;
            }
            if g < a.gpr {
                step(&mut acc[g % 8], tot(g), g);
            }
        }
    }
    let t0 = _mm256_add_ps(acc[0], acc[4]);
    let t1 = _mm256_add_ps(acc[1], acc[5]);
    let t2 = _mm256_add_ps(acc[2], acc[6]);
    let t3 = _mm256_add_ps(acc[3], acc[7]);
    _mm256_add_ps(_mm256_add_ps(t0, t2), _mm256_add_ps(t1, t3))
}

/// Row totals of one 4-bit group (or g32 pair) for `T` activation rows, reduced as the
/// rows are computed so few registers stay live. `w0` is the group's first 32-byte block,
/// `w1` its second at g128; `x[r]` is row `r`'s first block and, at g128,
/// `x[stride + r]` its second. Returns `(lo, hi)` halves as [`reduce8`] does.
///
/// # Safety
/// AVX2 is available and `x` is readable for `T` blocks (`stride + T` at g128).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q4_tile_tot<const G: usize, const T: usize>(
    w0: __m256i,
    w1: __m256i,
    x: *const Block,
    stride: usize,
) -> (__m256i, __m256i) {
    let two = G == 128;
    let mask = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let (lo0, hi0) = (_mm256_and_si256(w0, mask), _mm256_and_si256(_mm256_srli_epi16::<4>(w0), mask));
    let (lo1, hi1) = (_mm256_and_si256(w1, mask), _mm256_and_si256(_mm256_srli_epi16::<4>(w1), mask));
    // SAFETY: rows `r < T` read blocks `x[r]` (and `x[stride + r]`), inside the contract.
    let p = |r: usize| unsafe {
        if r >= T {
            return _mm256_setzero_si256();
        }
        let xb = &*x.add(r);
        let d =
            _mm256_add_epi16(_mm256_maddubs_epi16(lo0, load_lo(xb)), _mm256_maddubs_epi16(hi0, load_hi(xb)));
        if two {
            let xb = &*x.add(stride + r);
            let e = _mm256_add_epi16(
                _mm256_maddubs_epi16(lo1, load_lo(xb)),
                _mm256_maddubs_epi16(hi1, load_hi(xb)),
            );
            _mm256_add_epi16(d, e)
        } else {
            d
        }
    };
    // i16 lanes hold 4 products (8 at g128); see `reduce8` for the bound.
    let (q0, q1) = if two {
        let q0 =
            fold32b(_mm256_madd_epi16(fold16(p(0), p(1)), ones), _mm256_madd_epi16(fold16(p(2), p(3)), ones));
        let q1 = if T > 4 {
            fold32b(_mm256_madd_epi16(fold16(p(4), p(5)), ones), _mm256_madd_epi16(fold16(p(6), p(7)), ones))
        } else {
            _mm256_setzero_si256()
        };
        (q0, q1)
    } else {
        let q0 = _mm256_madd_epi16(fold16b(fold16(p(0), p(1)), fold16(p(2), p(3))), ones);
        let q1 = if T > 4 {
            _mm256_madd_epi16(fold16b(fold16(p(4), p(5)), fold16(p(6), p(7))), ones)
        } else {
            _mm256_setzero_si256()
        };
        (q0, q1)
    };
    (_mm256_permute2x128_si256::<0x20>(q0, q1), _mm256_permute2x128_si256::<0x31>(q0, q1))
}

/// Row totals (lane `r`) of one 8-bit group of `bpg` blocks for `T` activation rows;
/// `x[blk * T + r]` is block `blk` of row `r`.
///
/// # Safety
/// AVX2 is available, `w` is readable for `32 * bpg` bytes and `x` for `bpg * T` blocks.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q8_tile_tot<const T: usize>(w: *const u8, x: *const Block, bpg: usize) -> __m256i {
    let mut acc = [_mm256_setzero_si256(); 8];
    // SAFETY: block `blk < bpg` reads `w[32 blk .. 32 blk + 32]` and `x[blk * T + r]` for
    // `r < T`, inside the contract.
    unsafe {
        for blk in 0..bpg {
            let w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(w.add(32 * blk).cast()));
            let w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(w.add(32 * blk + 16).cast()));
            for (r, a) in acc.iter_mut().enumerate().take(T) {
                let xb = &*x.add(blk * T + r);
                let d =
                    _mm256_add_epi32(_mm256_madd_epi16(w0, load_lo(xb)), _mm256_madd_epi16(w1, load_hi(xb)));
                *a = _mm256_add_epi32(*a, d);
            }
        }
    }
    let (lo, hi) = reduce8::<8, 32>(acc);
    _mm256_add_epi32(lo, hi)
}

/// Widens `out.len()` scales or biases from `start` with the dtype's own conversion.
#[target_feature(enable = "avx2,fma,f16c")]
fn widen(sd: &ScaleData, start: usize, out: &mut [f32]) {
    let n = out.len();
    match sd {
        ScaleData::F16(v) => {
            let src = &v[start..start + n];
            let mut oc = out.chunks_exact_mut(8);
            let mut sc = src.chunks_exact(8);
            for (o, h) in (&mut oc).zip(&mut sc) {
                store8f_into(o, _mm256_cvtph_ps(load_f16x8(h)));
            }
            let mut tail = [f16::ZERO; 8];
            tail[..sc.remainder().len()].copy_from_slice(sc.remainder());
            let o = oc.into_remainder();
            let v = store8f(_mm256_cvtph_ps(load_f16x8(&tail)));
            o.copy_from_slice(&v[..o.len()]);
        }
        ScaleData::Bf16(v) => {
            let src = &v[start..start + n];
            let mut oc = out.chunks_exact_mut(8);
            let mut sc = src.chunks_exact(8);
            for (o, h) in (&mut oc).zip(&mut sc) {
                store8f_into(o, bf16x8_to_f32(load_bf16x8(h)));
            }
            let mut tail = [bf16::ZERO; 8];
            tail[..sc.remainder().len()].copy_from_slice(sc.remainder());
            let o = oc.into_remainder();
            let v = store8f(bf16x8_to_f32(load_bf16x8(&tail)));
            o.copy_from_slice(&v[..o.len()]);
        }
        ScaleData::F32(v) => out.copy_from_slice(&v[start..start + n]),
    }
}

/// How the packed stream is prefetched while a kernel walks it.
///
/// The hardware prefetchers alone leave the kernels short of the bandwidth a plain sum
/// reaches, so the kernels ask for the lines ahead of the ones they read. Into L1 only (one
/// level, 2 KiB ahead, the best single distance measured) suits short rows. Long rows need
/// two levels: a line in flight from memory into L1 holds one of L1's few miss buffers,
/// and once the activation codes are too large to stay in L1 beside the weights
/// (K = 14336: 14 KiB of 8-bit codes, 28 KiB of 16-bit ones), each code line reloaded from
/// L2 waited behind those buffers, and such rows read at 45-60% of the bandwidth. Asking
/// for lines far ahead into L2 and near ahead into L1 (then a short L2 hit) lifted them to
/// 80-90% on the development machine, 8-bit K = 4096 by about a tenth, and left 4-bit
/// K = 4096 level or a little ahead. The far level costs an instruction per line, which
/// compute-bound loops cannot spare: it slowed `qmv` on 151936 x 896 (short rows, a fixed
/// cost per row) by 5-8% on one thread, and `qmv_wide` at M = 2 on 14336 x 4096 by 5-10%,
/// while it sped M = 2 on 4096 x 14336 (28 KiB of codes) by 10-20%.
#[derive(Clone, Copy)]
enum Prefetch {
    /// Into L1, [`PREFETCH_L1_ONLY`] ahead.
    L1,
    /// Into L2, [`PREFETCH_FAR`] ahead, and into L1, [`PREFETCH_NEAR`] ahead.
    TwoLevel,
}

/// Distance of the one-level scheme (1-2 KiB measured best; 4 KiB no better, 8 KiB worse).
const PREFETCH_L1_ONLY: usize = 2048;
/// Distances of the two-level scheme: 6-8 KiB into L2 (4 KiB was too close), about 1.5 KiB
/// into L1 (0.75-1.5 KiB measured alike).
const PREFETCH_FAR: usize = 8192;
/// See [`PREFETCH_FAR`].
const PREFETCH_NEAR: usize = 1536;
/// Bytes of activation codes from which `qmv` (memory-bound) takes the two-level scheme:
/// 4 KiB (4-bit K = 4096, 8-bit K = 2048) and up.
const QMV_TWO_LEVEL_CODE_BYTES: usize = 4 << 10;
/// The same for the tiles of up to four rows of `qmv_wide` and `qmm` (compute-bound): 24
/// KiB, three quarters of the L1 data cache.
const TILE_TWO_LEVEL_CODE_BYTES: usize = 24 << 10;

impl Prefetch {
    /// The scheme for `qmv` on rows of `k` `bits`-bit codes.
    fn for_qmv(k: usize, bits: u32) -> Prefetch {
        Prefetch::by_code_bytes(code_bytes(1, k, bits), QMV_TWO_LEVEL_CODE_BYTES)
    }

    /// The scheme for a tile of `slots` activation rows against rows of `k` `bits`-bit codes.
    fn for_tile(slots: usize, k: usize, bits: u32) -> Prefetch {
        Prefetch::by_code_bytes(code_bytes(slots, k, bits), TILE_TWO_LEVEL_CODE_BYTES)
    }

    fn by_code_bytes(bytes: usize, two_level_from: usize) -> Prefetch {
        if bytes >= two_level_from { Prefetch::TwoLevel } else { Prefetch::L1 }
    }
}

/// Asks for the cache lines ahead of `row[off .. off + len]` by [`Prefetch::TwoLevel`]
/// when `TWO_LEVEL`, else by [`Prefetch::L1`]; they may lie past the row (in the next
/// row, or past the matrix, where the hint is dropped).
#[inline]
#[target_feature(enable = "avx2")]
fn prefetch_ahead<const TWO_LEVEL: bool>(row: &[u8], off: usize, len: usize) {
    let at = row.as_ptr().wrapping_add(off);
    // A prefetch is a hint: it never faults, so an address past the end is fine.
    for line in (0..len).step_by(64) {
        if TWO_LEVEL {
            _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(PREFETCH_FAR + line).cast());
            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_NEAR + line).cast());
        } else {
            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_L1_ONLY + line).cast());
        }
    }
}

/// Bytes of activation codes for `slots` rows of `k` elements: 8-bit codes for 4-bit
/// weights, 16-bit ones for 8-bit weights.
fn code_bytes(slots: usize, k: usize, bits: u32) -> usize {
    slots * k * if bits == 4 { 1 } else { 2 }
}

/// Asks, into L1 and all at once, for the lines [`PREFETCH_L1_ONLY`] beyond
/// `row[off .. off + len]`: eight-row tiles, compute-bound, ask for a whole row's worth as
/// they start each row.
#[inline]
#[target_feature(enable = "avx2")]
fn prefetch_burst(row: &[u8], off: usize, len: usize) {
    let base = row.as_ptr().wrapping_add(off + PREFETCH_L1_ONLY);
    for line in (0..len).step_by(64) {
        // A hint: it never faults, so an address past the end is fine.
        _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(line).cast());
    }
}

/// Asks for the cache line holding `bytes[off]`, if `off` is in bounds.
#[inline]
#[target_feature(enable = "avx2")]
fn prefetch_line(bytes: &[u8], off: usize) {
    if let Some(p) = bytes.get(off) {
        _mm_prefetch::<_MM_HINT_T0>((p as *const u8).cast());
    }
}

/// bf16 is the high half of an f32: widen to 32 bits and shift left by 16.
#[inline]
#[target_feature(enable = "avx2")]
fn bf16x8_to_f32(v: __m128i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)))
}

// Loads and stores. Each takes a reference whose length the slicing has checked, so the
// pointer it dereferences is valid for exactly the bytes read or written.

#[inline]
#[target_feature(enable = "avx2")]
fn load32(b: &[u8]) -> __m256i {
    assert!(b.len() >= 32);
    // SAFETY: `b` has at least 32 readable bytes (asserted); the load is unaligned.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn load16(b: &[u8]) -> __m128i {
    assert!(b.len() >= 16);
    // SAFETY: `b` has at least 16 readable bytes (asserted); the load is unaligned.
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

/// 16 bytes in the low half, zeros in the high half.
#[inline]
#[target_feature(enable = "avx2")]
fn load16z(b: &[u8]) -> __m256i {
    _mm256_zextsi128_si256(load16(b))
}

/// Bytes `0..32` of an activation block.
#[inline]
#[target_feature(enable = "avx2")]
fn load_lo(b: &Block) -> __m256i {
    // SAFETY: a `Block` is 64 bytes aligned to 64, so bytes 0..32 are readable and
    // 32-byte aligned.
    unsafe { _mm256_load_si256(b.0.as_ptr().cast()) }
}

/// Bytes `32..64` of an activation block.
#[inline]
#[target_feature(enable = "avx2")]
fn load_hi(b: &Block) -> __m256i {
    // SAFETY: a `Block` is 64 bytes aligned to 64, so bytes 32..64 are readable and
    // 32-byte aligned.
    unsafe { _mm256_load_si256(b.0[32..].as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn load8i(v: &[i32]) -> __m256i {
    assert!(v.len() >= 8);
    // SAFETY: `v` has at least 8 readable i32 (asserted); the load is unaligned.
    unsafe { _mm256_loadu_si256(v.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn load8f(v: &[f32]) -> __m256 {
    assert!(v.len() >= 8);
    // SAFETY: `v` has at least 8 readable f32 (asserted); the load is unaligned.
    unsafe { _mm256_loadu_ps(v.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn load_f16x8(h: &[f16]) -> __m128i {
    assert!(h.len() >= 8);
    // SAFETY: `h` has at least 8 f16, 16 readable bytes (asserted); unaligned load.
    unsafe { _mm_loadu_si128(h.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn load_bf16x8(h: &[bf16]) -> __m128i {
    assert!(h.len() >= 8);
    // SAFETY: `h` has at least 8 bf16, 16 readable bytes (asserted); unaligned load.
    unsafe { _mm_loadu_si128(h.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn store8f_into(o: &mut [f32], v: __m256) {
    assert!(o.len() >= 8);
    // SAFETY: `o` has at least 8 writable f32 (asserted); the store is unaligned.
    unsafe { _mm256_storeu_ps(o.as_mut_ptr(), v) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn store8f(v: __m256) -> [f32; 8] {
    let mut out = [0f32; 8];
    store8f_into(&mut out, v);
    out
}
