//! The tiled loop of `qmv_wide` and `qmm`, and the small-tile kernel: one weight row
//! against up to four activation rows (lane = group, as `qmv`).

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx512::{Avx512Small, small_tiles_take};
use super::lanes::{XGroups, hsum, lanes_step};
use super::loads::{load8f, store8f};
use super::prefetch::{Prefetch, prefetch_ahead, prefetch_burst};
use super::reduce::{
    fold16, fold16b, fold32, fold32b, group_partials, pairs_to_groups, pairs_to_groups_split,
    q4_group_partials_rows, quad_split,
};
use super::scales::{RowScales, packed_bytes};
use super::tile8::wide_row;
use super::traits::{Dots, Order, SmallTotals};
use crate::kernels::act::TILE_ROWS;
use crate::kernels::tile::{Block, GROUP_LANE_ROWS, XTile};
use crate::matrix::QuantizedMatrix;

/// Weight rows `rows` against every activation tile in `order`; `outs[t * TILE_ROWS + i]`
/// receives activation row `i` of tile `t` at the offsets of `rows`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn tiled_rows<const BITS: u32, const G: usize>(
    w: &QuantizedMatrix,
    tiles: &[XTile],
    rows: Range<usize>,
    outs: &mut [&mut [f32]],
    order: Order,
    dots: Dots,
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
        let lanes = row_against_tile::<BITS, G>(dots, wrow, s, b, tile, gpr, two_level);
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

/// One weight row (its packed codes `wrow`, widened scales `s` and biases `b`, `gpr`
/// groups) against one activation tile on `dots`' path: the small-tile loop
/// ([`small_tile`]) up to four slots, the eight-row one ([`wide_row`]) otherwise, each on
/// AVX-512's dots where the path has them and the geometry takes them. Lanes `0..rows` of
/// the result are the tile's outputs. `two_level` picks the small tiles' prefetch.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn row_against_tile<const BITS: u32, const G: usize>(
    dots: Dots,
    wrow: &[u8],
    s: &[f32],
    b: &[f32],
    tile: &XTile,
    gpr: usize,
    two_level: bool,
) -> [f32; 8] {
    match tile.slots {
        1 if two_level => small_tile::<BITS, G, 1, true>(dots, wrow, s, b, tile, gpr),
        1 => small_tile::<BITS, G, 1, false>(dots, wrow, s, b, tile, gpr),
        2 if two_level => small_tile::<BITS, G, 2, true>(dots, wrow, s, b, tile, gpr),
        2 => small_tile::<BITS, G, 2, false>(dots, wrow, s, b, tile, gpr),
        3 if two_level => small_tile::<BITS, G, 3, true>(dots, wrow, s, b, tile, gpr),
        3 => small_tile::<BITS, G, 3, false>(dots, wrow, s, b, tile, gpr),
        4 if two_level => small_tile::<BITS, G, 4, true>(dots, wrow, s, b, tile, gpr),
        4 => small_tile::<BITS, G, 4, false>(dots, wrow, s, b, tile, gpr),
        _ => store8f(wide_row::<BITS, G, 8>(wrow, s, b, tile, gpr, dots)),
    }
}

/// One weight row against `T <= 4` activation rows, computed row by row exactly as `qmv`
/// computes its one row (lane = group: the same integer sums, the same float order), with
/// each weight group unpacked once for all `T` rows. Small tiles take this path because
/// the lane = row kernel would leave most of its eight lanes empty. Returns the outputs in
/// lanes `0..T`.
///
/// Compiled once per feature set as `$name`, the integer dots from `$totals`
/// ([`SmallTotals`]); [`small_tile`] picks the one for the path.
macro_rules! small_tile_loop {
    ($(#[$doc:meta])* $name:ident, $features:tt, $totals:ty) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// The CPU has the features named here.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $name<const BITS: u32, const G: usize, const T: usize, const TWO_LEVEL: bool>(
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
                // SAFETY: the function's features are those `$totals` needs.
                let tots = unsafe { <$totals>::rows::<BITS, G, T>(wrow, xt, g0, ng) };
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
    };
}

small_tile_loop!(
    /// The small-tile loop with AVX2's dots.
    group_lanes_row,
    "avx2,fma,f16c",
    Avx2Small
);
small_tile_loop!(
    /// The small-tile loop with AVX-512BW's dots (4-bit g32 and g64 under `int16` only).
    group_lanes_row_avx512,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl",
    Avx512Small<false>
);
small_tile_loop!(
    /// The small-tile loop with AVX-512 VNNI's dots (4-bit g32 and g64 under `int16` only).
    group_lanes_row_avx512_vnni,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    Avx512Small<true>
);

/// One weight row against a small tile on `dots`' path: [`group_lanes_row`] or its
/// AVX-512 twins, which give the same exact integer sums, so the same bits.
#[inline(always)]
pub(super) fn small_tile<const BITS: u32, const G: usize, const T: usize, const TWO_LEVEL: bool>(
    dots: Dots,
    wrow: &[u8],
    s: &[f32],
    b: &[f32],
    xt: &XTile,
    gpr: usize,
) -> [f32; 8] {
    // SAFETY: `dots` comes from the detected (or checked) path, so its features are
    // present; every x86 path has AVX2, FMA and F16C.
    unsafe {
        match dots {
            Dots::Avx512Vnni if small_tiles_take(BITS, G, xt.split()) => {
                group_lanes_row_avx512_vnni::<BITS, G, T, TWO_LEVEL>(wrow, s, b, xt, gpr)
            }
            Dots::Avx512 if small_tiles_take(BITS, G, xt.split()) => {
                group_lanes_row_avx512::<BITS, G, T, TWO_LEVEL>(wrow, s, b, xt, gpr)
            }
            _ => group_lanes_row::<BITS, G, T, TWO_LEVEL>(wrow, s, b, xt, gpr),
        }
    }
}

/// AVX2's small-tile dots ([`chunk_rows`], [`chunk_rows_split`]).
pub(super) struct Avx2Small;

impl SmallTotals for Avx2Small {
    #[inline(always)]
    unsafe fn rows<const BITS: u32, const G: usize, const T: usize>(
        wrow: &[u8],
        xt: &XTile,
        g0: usize,
        ng: usize,
    ) -> [__m256i; T] {
        // SAFETY: the caller guarantees AVX2.
        unsafe {
            if BITS == 4 && xt.split() {
                chunk_rows_split::<G, T>(wrow, &xt.blocks, &xt.lo, g0, ng)
            } else {
                chunk_rows::<BITS, G, T>(wrow, &xt.blocks, g0, ng)
            }
        }
    }
}

/// For each of `T` activation rows, the integer dots of groups `g0 .. g0 + ng` (`ng <= 8`)
/// of one weight row, lane `j` = group `g0 + j` (zero beyond `ng`): the arithmetic of
/// [`super::row::chunk8`] and [`super::reduce::reduce8`], with each group's codes unpacked once for all rows.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn chunk_rows<const BITS: u32, const G: usize, const T: usize>(
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

/// [`chunk_rows`] for 4-bit weights against split codes (`xh` the high planes, `xl` the
/// low ones): each group's codes are unpacked once for both planes and all `T` rows, and
/// the planes are joined where their i16 sums widen, so each row takes one reduction.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn chunk_rows_split<const G: usize, const T: usize>(
    wrow: &[u8],
    xh: &[Block],
    xl: &[Block],
    g0: usize,
    ng: usize,
) -> [__m256i; T] {
    let zero = _mm256_setzero_si256();
    let mut out = [zero; T];
    if G == 32 {
        // Block `p` holds groups 2p and 2p + 1.
        let (mut vh, mut vl) = ([[zero; 4]; T], [[zero; 4]; T]);
        for i in 0..4 {
            let g = g0 + 2 * i;
            if g < g0 + ng {
                let p = g / 2;
                let wb = &wrow[32 * p..(32 * p + 32).min(wrow.len())];
                let (h, l) =
                    q4_group_partials_rows::<32, T>(wb, &xh[p * T..p * T + T], &xl[p * T..p * T + T]);
                for r in 0..T {
                    (vh[r][i], vl[r][i]) = (h[r], l[r]);
                }
            }
        }
        for r in 0..T {
            out[r] = pairs_to_groups_split(vh[r], vl[r]);
        }
        return out;
    }
    let gb = G / 2;
    let bpg = gb / 32;
    let mut q = [[zero; T]; 2];
    for (half, qh) in q.iter_mut().enumerate() {
        let (mut vh, mut vl) = ([[zero; 4]; T], [[zero; 4]; T]);
        for t in 0..4 {
            let j = 4 * half + t;
            if j < ng {
                let g = g0 + j;
                let span = g * bpg * T..(g + 1) * bpg * T;
                let (h, l) =
                    q4_group_partials_rows::<G, T>(&wrow[g * gb..(g + 1) * gb], &xh[span.clone()], &xl[span]);
                for r in 0..T {
                    (vh[r][t], vl[r][t]) = (h[r], l[r]);
                }
            }
        }
        for r in 0..T {
            qh[r] = quad_split::<G>(vh[r], vl[r]);
        }
    }
    for (r, o) in out.iter_mut().enumerate() {
        let (q0, q1) = (q[0][r], q[1][r]);
        *o = _mm256_add_epi32(
            _mm256_permute2x128_si256::<0x20>(q0, q1),
            _mm256_permute2x128_si256::<0x31>(q0, q1),
        );
    }
    out
}
