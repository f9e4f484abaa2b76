//! AVX2 + FMA + F16C kernels for 4- and 8-bit weights at group sizes 32, 64 and 128, and
//! the AVX-512 paths. These replace integer dots (`avx512`): all of `qmv`'s, the eight-row
//! tiles' of 4-bit weights, where one 512-bit multiply meets a whole 64-element block of a
//! row, and the small tiles' (up to four rows) for 4-bit g32 and g64 weights; on the 2-vCPU
//! AVX-512 Xeon those dots took prefill 3-4% faster at one thread on g32 weights and 49% on
//! g64. And `qmv_wide` and `qmm` on AVX-512 take their own kernel for 4-bit weights with
//! `K` a multiple of 64 (`lanerows`: 16 weight rows transposed into the lanes of a
//! register, so no partial sums are folded), the tiles for the rest.
//!
//! They follow the integer scheme (see [`super::act`]): activations quantized per group,
//! one exact integer dot per weight group, then the float work of [`super::act::Lanes`]
//! done for eight groups (`qmv`) or eight activation rows (`qmv_wide`, `qmm`) at once.
//!
//! - 4-bit: a 32-byte block of packed weights holds 64 codes; `and 0x0F` gives the even
//!   elements, `>> 4` the odd ones, each multiplied against the de-interleaved 8-bit
//!   activations with `maddubs` (u4 * i8 pairs cannot saturate), the two i16 results
//!   added (at most 8 products of 15 * 128 per lane over a 128-group) and widened with
//!   `madd` by ones. Under `int16` the activation codes come as two 8-bit planes
//!   (`xq = 256 * hi + lo`): every path unpacks each weight block once for both planes,
//!   folds the planes' i16 partials apart (their lanes cannot hold `256 * hi`), and joins
//!   them where they widen, `madd` by 256 plus `madd` by 1, exact in i32.
//! - 8-bit: `cvtepu8_epi16` widens 16 codes, `madd` multiplies them against 16-bit
//!   activations into i32 pairs (u8 * i16 products, which `maddubs` would saturate).
//! - The eight partials of eight groups (or of eight rows) are reduced at once by a
//!   transpose of unpacks and adds, so one `cvt` and three FMAs serve eight outputs; the
//!   centring (`- c * qsum`) is one shift and subtract per eight.
//!
//! Scales and biases are read in their stored dtype and widened a row at a time: f16
//! with `vcvtph2ps`, bf16 by a 16-bit left shift, f32 as is.
//!
//! This file holds the entry points and the dispatch on geometry and scale dtype; the
//! work is in `row` (the `qmv` row loop, once per path), `avx512` (the 512-bit dots),
//! `lanerows` (the AVX-512 kernel of `qmv_wide` and `qmm` with a weight row per lane),
//! `tiled` (the tiled loop and tiles of up to
//! four rows), `tile8` (eight-row tiles), `reduce` (integer dots and their reductions),
//! `lanes` (the float work per group), `scales` (scale and bias loads and widening),
//! `prefetch` (the prefetch policy) and `loads` (checked SIMD loads and stores).

macro_rules! by_geometry {
    ($w:expr, $f:ident, ($($arg:expr),*)) => {
        match ($w.spec().bits(), $w.spec().group_size()) {
            (4, 32) => $f::<4, 32>($($arg),*),
            (4, 64) => $f::<4, 64>($($arg),*),
            (4, 128) => $f::<4, 128>($($arg),*),
            (8, 32) => $f::<8, 32>($($arg),*),
            (8, 64) => $f::<8, 64>($($arg),*),
            (8, 128) => $f::<8, 128>($($arg),*),
            (bits, g) => unreachable!("no x86 kernel for {bits}-bit g{g}: the dispatcher routes it elsewhere"),
        }
    };
}

mod avx512;
pub(super) mod lanerows;
mod lanes;
mod loads;
mod prefetch;
mod reduce;
mod row;
mod scales;
mod tile8;
mod tiled;
mod traits;

use std::ops::Range;

use super::act::{ActCodes, TILE_ROWS};
use super::drive;
use super::tile::XTile;
use crate::matrix::QuantizedMatrix;
use tiled::tiled_rows;
pub(super) use traits::Dots;
use traits::{Order, PARALLEL_QUANTIZE_ROWS};

/// `qmv` rows of `w` against `xt` with `dots`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and the features of `dots`; `xt` is
/// [`qmv_vector`]'s for `dots`.
pub(crate) unsafe fn qmv_rows_with(
    dots: Dots,
    w: &QuantizedMatrix,
    xt: &XTile,
    rows: Range<usize>,
    out: &mut [f32],
) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        match dots {
            Dots::Avx2 => row::avx2::qmv_rows_any(w, xt, rows, out),
            Dots::Avx512 => row::avx512::qmv_rows_any(w, xt, rows, out),
            Dots::Avx512Vnni => row::avx512_vnni::qmv_rows_any(w, xt, rows, out),
        }
    }
}

/// `y[n] = W x` for one activation row, activations quantized to `codes`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and the features of `dots`.
pub(super) unsafe fn qmv(dots: Dots, x: &[f32], w: &QuantizedMatrix, y: &mut [f32], codes: ActCodes) {
    // SAFETY: this function's caller guarantees AVX2, FMA and F16C.
    let xt = unsafe { qmv_vector(dots, x, w.spec().group_size(), codes) };
    let rpt = drive::rows_per_task(w.n(), w.bytes_read() / w.n());
    drive::rows(y, rpt, |rows, out| {
        // SAFETY: this function's caller guarantees the features; every core rayon runs
        // this closure on is the same CPU.
        unsafe { qmv_rows_with(dots, w, &xt, rows, out) }
    });
}

/// Several `qmv`s of one activation row (every part of the same group size and codes) in
/// one parallel region, each task adding its rows' bias.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and the features of `dots`.
pub(super) unsafe fn qmv_many(
    dots: Dots,
    x: &[f32],
    parts: &mut [super::part::QmvPart<'_>],
    codes: ActCodes,
) {
    let Some(first) = parts.first() else { return };
    // SAFETY: this function's caller guarantees AVX2, FMA and F16C.
    let xt = unsafe { qmv_vector(dots, x, first.w.spec().group_size(), codes) };
    drive::parts(parts, |w, bias, rows, out| {
        // SAFETY: this function's caller guarantees the features; every core rayon runs
        // this closure on is the same CPU.
        unsafe { qmv_rows_with(dots, w, &xt, rows.clone(), out) };
        super::part::add_bias(bias, rows, out);
    });
}

/// `y[m, n] = x[m, k] W^T` with each weight row read once for every activation row.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and the features of `dots`.
pub(super) unsafe fn qmv_wide(
    dots: Dots,
    x: &[f32],
    m: usize,
    w: &QuantizedMatrix,
    y: &mut [f32],
    codes: ActCodes,
) {
    // SAFETY: forwarded from this function's contract.
    unsafe { tiled(dots, x, m, w, y, codes, Order::RowOuter) }
}

/// `y[m, n] = x[m, k] W^T` for large `m`, blocked so weights are read from memory once and
/// from L2 for every further tile of activation rows.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and the features of `dots`.
pub(super) unsafe fn qmm(
    dots: Dots,
    x: &[f32],
    m: usize,
    w: &QuantizedMatrix,
    y: &mut [f32],
    codes: ActCodes,
) {
    // SAFETY: forwarded from this function's contract.
    unsafe { tiled(dots, x, m, w, y, codes, Order::TileOuter) }
}

/// The lane-row kernel where an AVX-512 path takes it (it picks its own loop order by M),
/// else the tiles in `order`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and the features of `dots`.
unsafe fn tiled(
    dots: Dots,
    x: &[f32],
    m: usize,
    w: &QuantizedMatrix,
    y: &mut [f32],
    codes: ActCodes,
    order: Order,
) {
    if dots != Dots::Avx2 && lanerows::takes(w, m, codes) {
        // SAFETY: the AVX-512 path's features are this function's contract.
        return unsafe { lanerows::matmul(dots == Dots::Avx512Vnni, x, m, w, y, codes) };
    }
    let spec = w.spec();
    // SAFETY: this function's caller guarantees AVX2, FMA and F16C.
    let tiles = unsafe { quantize_tiles(x, m, w.k(), spec.group_size(), codes) };
    let rpt = drive::rows_per_task(w.n(), w.bytes_read() / w.n());
    drive::rows_multi(y, m, w.n(), rpt, |rows, outs| {
        // SAFETY: this function's caller guarantees AVX2, FMA and F16C; every core rayon
        // runs this closure on is the same CPU.
        unsafe { tiled_rows_any(w, &tiles, rows, outs, order, dots) }
    });
}

/// A tile's inputs prepared for [`tile_rows_with`]: the rows quantized into one tile and
/// the matrix's scales widened, both natively with AVX2, so the loop itself allocates
/// nothing (an emulator runs it, see [`super::emulated`]).
pub(crate) struct PreparedTile {
    pub(crate) xt: XTile,
    sc: scales::RowScales,
}

impl PreparedTile {
    /// `rows` (1 to 8) activation rows of `x` for `w` under `codes`: a small tile (lane =
    /// group) up to four rows, an eight-slot one (lane = row) from five.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    pub(crate) unsafe fn new(x: &[f32], rows: usize, w: &QuantizedMatrix, codes: ActCodes) -> PreparedTile {
        assert!((1..=TILE_ROWS).contains(&rows), "a tile holds 1 to 8 rows, got {rows}");
        // SAFETY: forwarded from this function's contract.
        unsafe {
            PreparedTile {
                xt: quantize_tile(x, rows, w.k(), w.spec().group_size(), codes),
                sc: scales::RowScales::new(w, 0..w.n()),
            }
        }
    }
}

/// Every weight row of `w` against the tile of `p` with `dots`, as `qmv_wide` runs it (the
/// small-tile loop up to four rows, the eight-row one from five): `out[r * 8 + i]` is
/// activation row `i`'s output for weight row `r` (lanes past the tile's rows are not
/// outputs). Allocates nothing.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and the features of `dots`; `p` was prepared
/// for `w`, and `out` holds `8 * w.n()` values.
pub(crate) unsafe fn tile_rows_with(dots: Dots, w: &QuantizedMatrix, p: &PreparedTile, out: &mut [f32]) {
    assert_eq!(out.len(), TILE_ROWS * w.n());
    // SAFETY: forwarded from this function's contract.
    unsafe { tile_rows_any(dots, w, p, out) }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn tile_rows_any(dots: Dots, w: &QuantizedMatrix, p: &PreparedTile, out: &mut [f32]) {
    by_geometry!(w, tile_rows, (dots, w, p, out))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn tile_rows<const BITS: u32, const G: usize>(
    dots: Dots,
    w: &QuantizedMatrix,
    p: &PreparedTile,
    out: &mut [f32],
) {
    let (gpr, row_bytes) = (w.k() / G, w.k() * BITS as usize / 8);
    let packed = scales::packed_bytes(w);
    for (r, o) in out.chunks_exact_mut(TILE_ROWS).enumerate() {
        let (s, b) = p.sc.row(r);
        let wrow = &packed[r * row_bytes..(r + 1) * row_bytes];
        o.copy_from_slice(&tiled::row_against_tile::<BITS, G>(dots, wrow, s, b, &p.xt, gpr, false));
    }
}

/// The activation quantizer compiled for AVX2 (its functions are `inline(always)`).
#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_vector(x: &[f32], g: usize, codes: ActCodes) -> XTile {
    XTile::vector(x, g, codes)
}

/// One activation row quantized for `qmv`'s row loop with `dots`: AVX-512's dots read
/// 4-bit codes in pairs of blocks ([`avx512::pair_blocks`]), AVX2's as quantized.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
pub(crate) unsafe fn qmv_vector(dots: Dots, x: &[f32], g: usize, codes: ActCodes) -> XTile {
    // SAFETY: this function's caller guarantees AVX2, FMA and F16C.
    let mut xt = unsafe { quantize_vector(x, g, codes) };
    if dots != Dots::Avx2 && matches!(codes, ActCodes::I8Deinterleaved | ActCodes::I16Split) {
        avx512::pair_blocks(&mut xt.blocks);
        avx512::pair_blocks(&mut xt.lo);
    }
    xt
}

/// The tile quantizer compiled for AVX2: one tile of up to eight rows.
#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_tile(x: &[f32], rows: usize, k: usize, g: usize, codes: ActCodes) -> XTile {
    XTile::tile(x, rows, k, g, codes)
}

/// `m` rows of `x` quantized into tiles of at most eight rows, as [`XTile::tiles`] gives
/// them. A prefill's tiles are quantized on the pool, a tile per task: run on the caller
/// alone, quantizing a 512-row prompt was a tenth of a two-thread prefill, all of it
/// serial.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
unsafe fn quantize_tiles(x: &[f32], m: usize, k: usize, g: usize, codes: ActCodes) -> Vec<XTile> {
    use rayon::prelude::*;
    let one = |t: usize| {
        let r0 = t * TILE_ROWS;
        let rows = TILE_ROWS.min(m - r0);
        // SAFETY: this function's caller guarantees AVX2, FMA and F16C; every core rayon
        // runs this on is the same CPU.
        unsafe { quantize_tile(&x[r0 * k..(r0 + rows) * k], rows, k, g, codes) }
    };
    let tiles = m.div_ceil(TILE_ROWS);
    if m < PARALLEL_QUANTIZE_ROWS || rayon::current_num_threads() == 1 {
        (0..tiles).map(one).collect()
    } else {
        (0..tiles).into_par_iter().map(one).collect()
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn tiled_rows_any(
    w: &QuantizedMatrix,
    tiles: &[XTile],
    rows: Range<usize>,
    outs: &mut [&mut [f32]],
    order: Order,
    dots: Dots,
) {
    by_geometry!(w, tiled_rows, (w, tiles, rows, outs, order, dots))
}
