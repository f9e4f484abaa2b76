//! One weight row against an eight-row activation tile (lane = activation row).

use std::arch::x86_64::*;

use super::lanes::{center_of, times_center};
use super::loads::{load_hi, load_lo};
use super::reduce::{fold16, fold16b, fold32b, nib_dot, quad_split, reduce8};
use super::traits::{Dots, PairTotals};
use crate::kernels::act::TILE_ROWS;
use crate::kernels::tile::{Block, XTile};

/// One weight row against a tile of `T` activation rows: lane `r` of the result is the
/// output for row `r`. The float work runs per group with lane = row, kept in eight
/// accumulators by group modulo 8 so that every lane rounds as `qmv`'s lane does.
///
/// `dots` picks the integer dots of a 4-bit row: AVX-512's ([`super::avx512`]) give
/// the same exact totals as AVX2's, so the same bits.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn wide_row<const BITS: u32, const G: usize, const T: usize>(
    wrow: &[u8],
    s: &[f32],
    b: &[f32],
    xt: &XTile,
    gpr: usize,
    dots: Dots,
) -> __m256 {
    let gb = G * BITS as usize / 8;
    let xblocks = (gpr * gb).div_ceil(32) * T;
    assert!(
        xt.slots == T
            && wrow.len() == gpr * gb
            && s.len() >= gpr
            && b.len() >= gpr
            && xt.blocks.len() >= xblocks
            && (!xt.split() || (BITS == 4 && xt.lo.len() == xt.blocks.len()))
            && xt.sx.len() >= gpr * TILE_ROWS
            && xt.xsum.len() >= gpr * TILE_ROWS
            && xt.qsum.len() >= gpr * TILE_ROWS,
        "wide_row: inputs shorter than the row's {gpr} groups"
    );
    let args = WideRow {
        w: wrow.as_ptr(),
        x: xt.blocks.as_ptr(),
        xlo: if xt.split() { xt.lo.as_ptr() } else { std::ptr::null() },
        s: s.as_ptr(),
        b: b.as_ptr(),
        sx: xt.sx.as_ptr(),
        xsum: xt.xsum.as_ptr(),
        qsum: xt.qsum.as_ptr(),
        gpr,
    };
    // SAFETY: the assertion above gives every extent `wide_row_raw` requires: the row's
    // `gpr * gb` packed bytes, `ceil(gpr * gb / 32) * T` activation blocks (and as many
    // low-plane blocks when the codes are split, 4-bit only), `gpr` scales and biases, and
    // `gpr * 8` activation scales, sums and code sums. The AVX-512 dots run only when
    // `dots` names them, which its caller derives from the detected path.
    unsafe {
        match dots {
            Dots::Avx512Vnni if BITS == 4 => wide_row_raw_avx512_vnni::<BITS, G, T>(args),
            Dots::Avx512 if BITS == 4 => wide_row_raw_avx512::<BITS, G, T>(args),
            _ => wide_row_raw::<BITS, G, T>(args),
        }
    }
}

/// AVX2's totals ([`q4_tile_tot`], [`q4_tile_tot_split`]).
pub(super) struct Avx2Pairs;

impl PairTotals for Avx2Pairs {
    #[inline(always)]
    unsafe fn pair<const T: usize>(wv: __m256i, x: *const Block, xlo: *const Block) -> (__m256i, __m256i) {
        // SAFETY: forwarded from the caller.
        unsafe {
            let zero = _mm256_setzero_si256();
            if xlo.is_null() {
                q4_tile_tot::<32, T>(wv, zero, x, 0)
            } else {
                q4_tile_tot_split::<32, T>(wv, zero, x, xlo, 0)
            }
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
        // SAFETY: forwarded from the caller.
        unsafe {
            let (lo, hi) = if xlo.is_null() {
                q4_tile_tot::<G, T>(w0, w1, x, stride)
            } else {
                q4_tile_tot_split::<G, T>(w0, w1, x, xlo, stride)
            };
            _mm256_add_epi32(lo, hi)
        }
    }
}

/// The inputs of [`wide_row_raw`] for one weight row: the row's packed codes, the tile's
/// activation blocks (and their low planes, or null when the codes are not split), the
/// row's widened scales and biases, the tile's transposed activation scales, sums and
/// code sums, and the row's group count.
#[derive(Clone, Copy)]
pub(super) struct WideRow {
    pub(super) w: *const u8,
    pub(super) x: *const Block,
    pub(super) xlo: *const Block,
    pub(super) s: *const f32,
    pub(super) b: *const f32,
    pub(super) sx: *const f32,
    pub(super) xsum: *const f32,
    pub(super) qsum: *const i32,
    pub(super) gpr: usize,
}

/// [`wide_row`]'s loop over raw pointers, so no bounds check or spilled slice sits in the
/// hot path, compiled for one feature set (`$features`) with one [`PairTotals`]
/// (`$pairs`) as `$name`: the totals are `inline(always)`, and the loop's closures inherit
/// the function's features, so each feature set gets a loop of its own.
///
/// # Safety (of each generated function)
/// `$features` are available, and with `gb = G * BITS / 8`: `w` is readable for
/// `gpr * gb` bytes, `x` (and `xlo` unless null, which only 4-bit rows may pass) for
/// `ceil(gpr * gb / 32) * T` blocks, `s` and `b` for `gpr` values, `sx`, `xsum` and
/// `qsum` for `gpr * 8`.
macro_rules! wide_row_loop {
    ($(#[$doc:meta])* $name:ident, $features:tt, $pairs:ty) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $name<const BITS: u32, const G: usize, const T: usize>(a: WideRow) -> __m256 {
            let gb = G * BITS as usize / 8;
            let bpg = gb.div_ceil(32);
            let mut acc = [_mm256_setzero_ps(); 8];
            // SAFETY: group `g < gpr` reads `w[g * gb .. (g + 1) * gb]` (4-bit g32: pair `g / 2`
            // reads 32 bytes, or 16 for a last lone group), blocks `[g * bpg * T, (g + 1) * bpg * T)`
            // (4-bit g32: `[p * T, (p + 1) * T)`) of `x` and of a non-null `xlo`, `s[g]`, `b[g]`,
            // and `sx`, `xsum`, `qsum` at `[8g .. 8g + 8]`: all inside the extents this function's
            // contract gives.
            unsafe {
                let split = !a.xlo.is_null();
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
                        let xlo = if split { a.xlo.add(p * T) } else { std::ptr::null() };
                        let (ta, tb) = <$pairs>::pair::<T>(wv, a.x.add(p * T), xlo);
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
                            let w0 = _mm256_loadu_si256(wg.cast());
                            let xlo = if split { a.xlo.add(g * bpg * T) } else { std::ptr::null() };
                            <$pairs>::group::<G, T>(w0, w1, xg, xlo, T)
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
    };
}

wide_row_loop!(
    /// The loop with AVX2's dots.
    wide_row_raw,
    "avx2,fma,f16c",
    Avx2Pairs
);
wide_row_loop!(
    /// The loop with AVX-512BW's dots for 4-bit rows.
    wide_row_raw_avx512,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl",
    super::avx512::Avx512Pairs<false>
);
wide_row_loop!(
    /// The loop with AVX-512 VNNI's dots for 4-bit rows.
    wide_row_raw_avx512_vnni,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    super::avx512::Avx512Pairs<true>
);

/// Row totals of one 4-bit group (or g32 pair) for `T` activation rows, reduced as the
/// rows are computed so few registers stay live. `w0` is the group's first 32-byte block,
/// `w1` its second at g128; `x[r]` is row `r`'s first block and, at g128,
/// `x[stride + r]` its second. Returns `(lo, hi)` halves as [`reduce8`] does.
///
/// # Safety
/// AVX2 is available and `x` is readable for `T` blocks (`stride + T` at g128).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn q4_tile_tot<const G: usize, const T: usize>(
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

/// [`q4_tile_tot`] against both planes of split codes (`xh` the high planes, `xl` the low
/// ones, laid out as `x` is there): each weight block is unpacked once for both planes, and
/// the planes' i16 partials are folded apart and joined exactly where they widen to i32
/// ([`widen_planes`]), so one widening and one permute serve both. Returns the exact dots
/// with the codes, `(lo, hi)` halves as [`q4_tile_tot`] does.
///
/// # Safety
/// AVX2 is available and `xh` and `xl` are each readable for `T` blocks (`stride + T` at
/// g128).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn q4_tile_tot_split<const G: usize, const T: usize>(
    w0: __m256i,
    w1: __m256i,
    xh: *const Block,
    xl: *const Block,
    stride: usize,
) -> (__m256i, __m256i) {
    let mask = _mm256_set1_epi8(0x0F);
    let (lo0, hi0) = (_mm256_and_si256(w0, mask), _mm256_and_si256(_mm256_srli_epi16::<4>(w0), mask));
    let (lo1, hi1) = (_mm256_and_si256(w1, mask), _mm256_and_si256(_mm256_srli_epi16::<4>(w1), mask));
    let zero = _mm256_setzero_si256();
    let mut q = [zero; 2];
    for (half, qh) in q.iter_mut().enumerate().take(T.div_ceil(4)) {
        let (mut h, mut l) = ([zero; 4], [zero; 4]);
        for t in 0..4 {
            let r = 4 * half + t;
            if r < T {
                // SAFETY: row `r < T` reads blocks `r` (and at g128 `stride + r`) of `xh`
                // and `xl`, inside this function's contract.
                let (bh, bl) = unsafe { (&*xh.add(r), &*xl.add(r)) };
                (h[t], l[t]) = (nib_dot(lo0, hi0, bh), nib_dot(lo0, hi0, bl));
                if G == 128 {
                    // SAFETY: as above.
                    let (bh, bl) = unsafe { (&*xh.add(stride + r), &*xl.add(stride + r)) };
                    h[t] = _mm256_add_epi16(h[t], nib_dot(lo1, hi1, bh));
                    l[t] = _mm256_add_epi16(l[t], nib_dot(lo1, hi1, bl));
                }
            }
        }
        *qh = quad_split::<G>(h, l);
    }
    (_mm256_permute2x128_si256::<0x20>(q[0], q[1]), _mm256_permute2x128_si256::<0x31>(q[0], q[1]))
}

/// Row totals (lane `r`) of one 8-bit group of `bpg` blocks for `T` activation rows;
/// `x[blk * T + r]` is block `blk` of row `r`.
///
/// # Safety
/// AVX2 is available, `w` is readable for `32 * bpg` bytes and `x` for `bpg * T` blocks.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn q8_tile_tot<const T: usize>(w: *const u8, x: *const Block, bpg: usize) -> __m256i {
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
