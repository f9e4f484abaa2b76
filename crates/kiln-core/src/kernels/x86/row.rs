//! The `qmv` row loop: one activation row against a range of weight rows, eight groups
//! per step (lane = group), compiled once per x86 path (AVX2, AVX-512, AVX-512 VNNI)
//! around that path's integer dots.

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx512::Avx512Dots;
use super::lanes::{XGroups, hsum, lanes_step};
use super::loads::{load16z, load32};
use super::prefetch::{Prefetch, SCALE_PREFETCH_ROWS, prefetch_ahead, prefetch_line};
use super::reduce::{
    group_partials, pairs_to_groups, pairs_to_groups_split, q4_dot16, q4_dot16_split,
    q4_group_partials_split, quad_split, reduce8,
};
use super::scales::{BF16, F16, F32, load_scales8, packed_bytes, scale_bytes, scale_size};
use super::traits::RowDots as Dots;
use crate::kernels::tile::{Block, XTile};
use crate::matrix::{QuantizedMatrix, ScaleData};

/// AVX2's dots.
pub(super) struct Avx2Dots;

impl Dots for Avx2Dots {
    #[inline(always)]
    unsafe fn chunk8<const BITS: u32, const G: usize>(w: &[u8], x: &[Block], ng: usize) -> __m256i {
        // SAFETY: forwarded from this function's contract (AVX2 at least).
        unsafe { chunk8::<BITS, G>(w, x, ng) }
    }

    #[inline(always)]
    unsafe fn chunk8_split<const G: usize>(w: &[u8], xh: &[Block], xl: &[Block], ng: usize) -> __m256i {
        // SAFETY: forwarded from this function's contract (AVX2 at least).
        unsafe { chunk8_split::<G>(w, xh, xl, ng) }
    }
}

/// The `qmv` row loop compiled for one feature set (`$features`) with one [`Dots`]
/// (`$dots`), as module `$name`: the dots are `inline(always)`, so they compile into the
/// loop with its features, which is why each path has a loop of its own.
macro_rules! row_loop {
    ($name:ident, $features:tt, $dots:ty) => {
        pub(in crate::kernels) mod $name {
            // This file's items (`super::*` here, spelled so that it reads as this file).
            use crate::kernels::x86::row::*;

            /// `qmv` rows of `w` against `xt`, dispatched on scale dtype and geometry.
            #[target_feature(enable = $features)]
            pub(in crate::kernels) fn qmv_rows_any(
                w: &QuantizedMatrix,
                xt: &XTile,
                rows: Range<usize>,
                out: &mut [f32],
            ) {
                match w.scales() {
                    ScaleData::F16(_) => by_geometry!(w, qmv_rows_f16, (w, xt, rows, out)),
                    ScaleData::Bf16(_) => by_geometry!(w, qmv_rows_bf16, (w, xt, rows, out)),
                    ScaleData::F32(_) => by_geometry!(w, qmv_rows_f32, (w, xt, rows, out)),
                }
            }

            // One monomorphic entry per scale dtype, so `by_geometry!` can name them.
            #[target_feature(enable = $features)]
            fn qmv_rows_f16<const BITS: u32, const G: usize>(
                w: &QuantizedMatrix,
                xt: &XTile,
                rows: Range<usize>,
                out: &mut [f32],
            ) {
                qmv_rows::<BITS, G, F16>(w, xt, rows, out)
            }

            #[target_feature(enable = $features)]
            fn qmv_rows_bf16<const BITS: u32, const G: usize>(
                w: &QuantizedMatrix,
                xt: &XTile,
                rows: Range<usize>,
                out: &mut [f32],
            ) {
                qmv_rows::<BITS, G, BF16>(w, xt, rows, out)
            }

            #[target_feature(enable = $features)]
            fn qmv_rows_f32<const BITS: u32, const G: usize>(
                w: &QuantizedMatrix,
                xt: &XTile,
                rows: Range<usize>,
                out: &mut [f32],
            ) {
                qmv_rows::<BITS, G, F32>(w, xt, rows, out)
            }

            #[target_feature(enable = $features)]
            fn qmv_rows<const BITS: u32, const G: usize, const D: u8>(
                w: &QuantizedMatrix,
                xt: &XTile,
                rows: Range<usize>,
                out: &mut [f32],
            ) {
                // The prefetch scheme is a type parameter of the row loop, so no branch on it runs per
                // step.
                match Prefetch::for_qmv(w.k(), BITS) {
                    Prefetch::L1 => qmv_rows_by::<BITS, G, D, false>(w, xt, rows, out),
                    Prefetch::TwoLevel => qmv_rows_by::<BITS, G, D, true>(w, xt, rows, out),
                }
            }

            /// [`qmv_rows`] with the prefetch scheme fixed: [`Prefetch::TwoLevel`] when `TWO_LEVEL`.
            #[target_feature(enable = $features)]
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
            #[target_feature(enable = $features)]
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
                    let (wc, xr) = (&w[c * cw..(c + 1) * cw], c * cx..(c + 1) * cx);
                    // SAFETY: this function is compiled for the features the dots need.
                    let tot = unsafe {
                        if BITS == 4 && xt.split() {
                            <$dots>::chunk8_split::<G>(wc, &xt.blocks[xr.clone()], &xt.lo[xr], 8)
                        } else {
                            <$dots>::chunk8::<BITS, G>(wc, &xt.blocks[xr], 8)
                        }
                    };
                    let (sv, bv) = (
                        load_scales8::<D>(&s[c * cs..(c + 1) * cs]),
                        load_scales8::<D>(&b[c * cs..(c + 1) * cs]),
                    );
                    acc = lanes_step::<BITS>(acc, tot, sv, bv, XGroups::at(xt, c * 8));
                }
                if !gpr.is_multiple_of(8) {
                    let g0 = full * 8;
                    let ng = gpr - g0;
                    prefetch_ahead::<TWO_LEVEL>(w, full * cw, ng * gb);
                    let (wt, xr) = (&w[full * cw..full * cw + ng * gb], full * cx..(full + 1) * cx);
                    // SAFETY: this function is compiled for the features the dots need.
                    let tot = unsafe {
                        if BITS == 4 && xt.split() {
                            <$dots>::chunk8_split::<G>(wt, &xt.blocks[xr.clone()], &xt.lo[xr], ng)
                        } else {
                            <$dots>::chunk8::<BITS, G>(wt, &xt.blocks[xr], ng)
                        }
                    };
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
        }
    };
}

row_loop!(avx2, "avx2,fma,f16c", Avx2Dots);
row_loop!(avx512, "avx2,fma,f16c,avx512f,avx512bw,avx512vl", Avx512Dots<false>);
row_loop!(avx512_vnni, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni", Avx512Dots<true>);

/// The integer dots of `ng <= 8` consecutive groups (`w` their `ng` groups of packed bytes,
/// `x` the activation blocks of eight groups): lane `j` = group `j`, zero from `ng` on.
/// Plain loops of constant trip count and no closures, and `inline(always)` (which a
/// `#[target_feature]` function cannot be), so the step compiles into the AVX2 row loop
/// with its partials in registers; a whole step passes `ng = 8` as a constant and its
/// guards fold away.
///
/// # Safety
/// AVX2 must be available.
#[inline(always)]
pub(super) unsafe fn chunk8<const BITS: u32, const G: usize>(w: &[u8], x: &[Block], ng: usize) -> __m256i {
    // SAFETY: the caller guarantees AVX2; every load is of a checked slice.
    unsafe {
        let gb = G * BITS as usize / 8;
        let bpg = gb.div_ceil(32);
        assert!(ng <= 8 && w.len() == ng * gb && x.len() == 8 * gb / 32);
        let zero = _mm256_setzero_si256();
        if BITS == 4 && G == 32 {
            // Block `i` holds groups 2i and 2i + 1; a last lone group is a half block.
            let mut p = [zero; 4];
            for (i, pi) in p.iter_mut().enumerate() {
                if 2 * i + 1 < ng {
                    *pi = q4_dot16(load32(&w[32 * i..32 * i + 32]), &x[i]);
                } else if 2 * i < ng {
                    *pi = q4_dot16(load16z(&w[32 * i..32 * i + 16]), &x[i]);
                }
            }
            pairs_to_groups(p)
        } else {
            let mut v = [zero; 8];
            for (j, vj) in v.iter_mut().enumerate() {
                if j < ng {
                    *vj =
                        group_partials::<BITS, G, 1>(&w[j * gb..(j + 1) * gb], &x[j * bpg..(j + 1) * bpg])[0];
                }
            }
            let (lo, hi) = reduce8::<BITS, G>(v);
            _mm256_add_epi32(lo, hi)
        }
    }
}

/// [`chunk8`] for 4-bit weights against split codes (`xh` the high planes, `xl` the low
/// ones): each weight block is unpacked once for both planes, and the planes' i16 sums
/// are joined exactly where they widen to i32, so one widening serves both. Groups are
/// folded four at a time as they are computed, so few partials are live at once.
/// `inline(always)` as [`chunk8`] is.
///
/// # Safety
/// AVX2 must be available.
#[inline(always)]
pub(super) unsafe fn chunk8_split<const G: usize>(
    w: &[u8],
    xh: &[Block],
    xl: &[Block],
    ng: usize,
) -> __m256i {
    // SAFETY: the caller guarantees AVX2; every load is of a checked slice.
    unsafe {
        let gb = G / 2;
        let bpg = gb.div_ceil(32);
        assert!(ng <= 8 && w.len() == ng * gb && xh.len() == 8 * gb / 32 && xl.len() == xh.len());
        let zero = _mm256_setzero_si256();
        if G == 32 {
            let (mut h, mut l) = ([zero; 4], [zero; 4]);
            for i in 0..4 {
                if 2 * i + 1 < ng {
                    (h[i], l[i]) = q4_dot16_split(load32(&w[32 * i..32 * i + 32]), &xh[i], &xl[i]);
                } else if 2 * i < ng {
                    (h[i], l[i]) = q4_dot16_split(load16z(&w[32 * i..32 * i + 16]), &xh[i], &xl[i]);
                }
            }
            pairs_to_groups_split(h, l)
        } else {
            let mut q = [zero; 2];
            for (half, qh) in q.iter_mut().enumerate() {
                let (mut h, mut l) = ([zero; 4], [zero; 4]);
                for t in 0..4 {
                    let j = 4 * half + t;
                    if j < ng {
                        let span = j * bpg..(j + 1) * bpg;
                        (h[t], l[t]) = q4_group_partials_split::<G>(
                            &w[j * gb..(j + 1) * gb],
                            &xh[span.clone()],
                            &xl[span],
                        );
                    }
                }
                *qh = quad_split::<G>(h, l);
            }
            // q[0] = [g0..g3 of the low 128 bits | g0..g3 of the high], q[1] likewise g4..g7.
            _mm256_add_epi32(
                _mm256_permute2x128_si256::<0x20>(q[0], q[1]),
                _mm256_permute2x128_si256::<0x31>(q[0], q[1]),
            )
        }
    }
}
