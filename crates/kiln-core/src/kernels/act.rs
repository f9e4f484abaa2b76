//! Activations quantized per weight group for the integer kernels (AVX2, NEON).
//!
//! Each group of `group_size` activations of one row gets one f32 scale `sx` and integer
//! codes `xq` with `x ~= sx * xq`, rounded to nearest ([`ActCodes`] says which range):
//! - 4-bit weights, `int16` scheme (the default): codes in `[-32512, 32512]`, 32512 =
//!   127 * 256. AVX2 splits each code exactly as `xq = 256 * hi + lo` with
//!   `hi = (xq + 128) >> 8` in `[-127, 127]` and `lo` in `[-128, 127]`, two 8-bit planes
//!   that `maddubs` multiplies against the same unpacked weights; the group's dot is then
//!   `256 * dot(q, hi) + dot(q, lo)`, the same exact integer as `dot(q, xq)`.
//! - 4-bit weights, `int8` scheme: codes in `[-127, 127]` (one `maddubs` plane).
//! - 8-bit weights, both schemes: codes in `[-32767, 32767]` (`u8 * i16` pairs fit `madd`).
//!
//! The exact f32 sum of each group's activations and the integer sum of its codes are
//! kept beside it.
//!
//! A product is `sum_g s_g * sx_g * (sum_j q_j xq_j - c * sum_j xq_j) + (b_g + c s_g) * xsum_g`
//! with `c = 2^(bits - 1)`: the same value as `sum_g s_g * sum_j q_j x_j + b_g * xsum_g`, but
//! the activations' rounding now meets `q - c` (at most `c` in magnitude, centred) instead
//! of `q` (up to `2c - 1`, mean near `c`), which halves the error it causes. The integer
//! inner sum stays exact.
//!
//! [`XRows`] holds the codes in element order (NEON, portable); the AVX2 kernels lay them
//! out in blocks (`tile.rs`). [`Lanes`] fixes the float order every integer kernel follows.

use crate::act_precision::ActScheme;

/// Largest 8-bit activation code: symmetric, so `-128` never occurs.
pub(crate) const I8_MAX: f32 = 127.0;
/// Largest 16-bit activation code.
pub(crate) const I16_MAX: f32 = 32767.0;
/// Largest 16-bit code for 4-bit weights: `127 * 256`, so the high 8-bit plane of a split
/// code stays in `[-127, 127]`.
pub(crate) const I16_SPLIT_MAX: f32 = 32512.0;

/// Activation rows a kernel handles per pass over a weight group, at most.
pub(crate) const TILE_ROWS: usize = 8;

/// Which codes the weights' width and the activation scheme call for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActCodes {
    /// 8-bit codes, even/odd de-interleaved per 64-element block (4-bit weights, `int8`).
    I8Deinterleaved,
    /// 16-bit codes up to [`I16_SPLIT_MAX`], on AVX2 as two de-interleaved 8-bit planes
    /// (4-bit weights, `int16`).
    I16Split,
    /// 16-bit codes in element order (8-bit weights).
    I16,
}

impl ActCodes {
    /// The codes the integer kernels use for `bits`-bit weights under `scheme`, if they
    /// have an integer path (`None` for other widths and for `f32`). `int16-wide8` gives
    /// one row's codes (`int16`); the wide kernel asks with [`ActScheme::rows_scheme`].
    pub fn for_weight_bits(bits: u32, scheme: ActScheme) -> Option<Self> {
        match (bits, scheme.rows_scheme(1)) {
            (_, ActScheme::F32) => None,
            (4, ActScheme::Int8) => Some(ActCodes::I8Deinterleaved),
            (4, ActScheme::Int16) => Some(ActCodes::I16Split),
            (8, _) => Some(ActCodes::I16),
            _ => None,
        }
    }

    /// Largest code magnitude.
    pub fn max_code(self) -> f32 {
        match self {
            ActCodes::I8Deinterleaved => I8_MAX,
            ActCodes::I16Split => I16_SPLIT_MAX,
            ActCodes::I16 => I16_MAX,
        }
    }

    /// The weight code the products are centred on, `2^(bits - 1)`: 8 for 4-bit weights,
    /// 128 for 8-bit ones.
    pub const fn center(self) -> i32 {
        match self {
            ActCodes::I8Deinterleaved | ActCodes::I16Split => 8,
            ActCodes::I16 => 128,
        }
    }
}

/// Splits a code of [`ActCodes::I16Split`] into its planes: `xq = 256 * hi + lo`, `hi` in
/// `[-127, 127]`, `lo` in `[-128, 127]`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // the split planes are AVX2's; the unit test runs everywhere
#[inline(always)]
pub(crate) fn split_code(xq: i16) -> (i8, i8) {
    let hi = (i32::from(xq) + 128) >> 8;
    let lo = i32::from(xq) - 256 * hi;
    (hi as i8, lo as i8)
}

/// One group's activation scale, exact sum, and the integer sum of its codes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct GroupQuant {
    /// `max|x| / qmax` (0 for an all-zero group, NaN for a non-finite one).
    pub sx: f32,
    /// The group's sum, computed in f64 and rounded once.
    pub xsum: f32,
    /// The sum of the codes (exact).
    pub qsum: i32,
}

// `quantize_group` is `inline(always)` so that a caller compiled for a wider ISA (the AVX2
// kernels wrap the quantizer in a `#[target_feature]` function) gets it compiled for that
// ISA too.
#[inline(always)]
pub(crate) fn quantize_group(xs: &[f32], qmax: f32, codes: &mut [i16]) -> GroupQuant {
    debug_assert_eq!(xs.len(), codes.len());
    // The sum in f64 (eight lanes, in a fixed order, so it vectorises), rounded once to
    // f32: the bias term sees the group sum to half an ulp.
    let mut lanes = [0f64; 8];
    for c in xs.chunks_exact(8) {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += f64::from(v);
        }
    }
    let l = lanes;
    let xsum = (((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))) as f32;
    // Branch-free so the compiler vectorises it. A NaN or infinity makes `xsum`
    // non-finite, which is caught below.
    let amax = xs.iter().fold(0f32, |a, &v| if v.abs() > a { v.abs() } else { a });
    if !xsum.is_finite() || !amax.is_finite() {
        // A non-finite activation makes the scale NaN, so the output is non-finite too,
        // as an f32 product would be.
        codes.fill(0);
        return GroupQuant { sx: f32::NAN, xsum, qsum: 0 };
    }
    if amax == 0.0 {
        codes.fill(0);
        return GroupQuant { sx: 0.0, xsum, qsum: 0 };
    }
    let sx = amax / qmax;
    let inv = qmax / amax;
    if inv.is_finite() {
        for (c, &v) in codes.iter_mut().zip(xs) {
            *c = round_code(v * inv, qmax);
        }
    } else {
        // A subnormal amax: the reciprocal overflows, so divide instead.
        for (c, &v) in codes.iter_mut().zip(xs) {
            *c = round_code(v / sx, qmax);
        }
    }
    let qsum = codes.iter().map(|&c| i32::from(c)).sum();
    GroupQuant { sx, xsum, qsum }
}

/// Clamps `v` to `[-qmax, qmax]` (qmax <= 32767) and rounds it to the nearest integer,
/// ties to even, as `round_ties_even` would. Adding 1.5 * 2^23 rounds any |v| < 2^22 to an
/// integer in the default rounding mode and leaves that integer in the low mantissa bits,
/// so the code is an integer subtraction of bit patterns: no library call, and the loop
/// vectorises.
#[inline]
fn round_code(v: f32, qmax: f32) -> i16 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    let y = v.clamp(-qmax, qmax) + MAGIC;
    (y.to_bits() as i32 - MAGIC.to_bits() as i32) as i16
}

/// Activation rows quantized per group with codes in element order, for kernels that
/// read them one element at a time (portable, NEON's scalar tails).
pub(crate) struct XRows {
    /// `[row][k]` codes.
    pub codes: Vec<i16>,
    /// `[row][group]` scales.
    pub sx: Vec<f32>,
    /// `[row][group]` exact sums.
    pub xsum: Vec<f32>,
    /// `[row][group]` sums of the codes.
    pub qsum: Vec<i32>,
}

impl XRows {
    /// Quantizes `m` rows of `k` activations per group of `g`.
    pub fn new(x: &[f32], m: usize, k: usize, g: usize, codes: ActCodes) -> XRows {
        assert_eq!(x.len(), m * k);
        let gpr = k / g;
        let mut out = XRows {
            codes: vec![0; m * k],
            sx: vec![0.0; m * gpr],
            xsum: vec![0.0; m * gpr],
            qsum: vec![0; m * gpr],
        };
        for (i, (xs, cs)) in x.chunks_exact(g).zip(out.codes.chunks_exact_mut(g)).enumerate() {
            let q = quantize_group(xs, codes.max_code(), cs);
            out.sx[i] = q.sx;
            out.xsum[i] = q.xsum;
            out.qsum[i] = q.qsum;
        }
        out
    }
}

/// The float half of an integer-scheme dot product, in the one order every integer
/// kernel follows (AVX2 in vector lanes, NEON and portable with this type), so that all of
/// them, and `qmv`, `qmv_wide` and `qmm` alike, round every output the same way.
///
/// Group `g` goes to lane `g % 8`: with the centred integer dot `t = tot - c * qsum` and the
/// centred bias `bc = fma(s, c, b)`, `lane = fma(t, s * sx, lane)` then
/// `lane = fma(bc, xsum, lane)`; the lanes are summed as
/// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`.
#[derive(Clone, Copy, Default)]
pub(crate) struct Lanes(pub [f32; 8]);

/// One group's inputs to [`Lanes::add_group`].
#[derive(Clone, Copy)]
pub(crate) struct GroupTerms {
    /// `sum_j q_j xq_j`, exact.
    pub tot: i32,
    /// The weight group's scale and bias.
    pub s: f32,
    /// See `s`.
    pub b: f32,
    /// The activation group's quantization.
    pub x: GroupQuant,
}

impl Lanes {
    /// Adds group `g`, its weight codes centred on `center` ([`ActCodes::center`]).
    #[inline]
    pub fn add_group(&mut self, g: usize, center: i32, t: GroupTerms) {
        let l = &mut self.0[g % 8];
        let centred = t.tot - center * t.x.qsum;
        let bc = t.s.mul_add(center as f32, t.b);
        *l = (centred as f32).mul_add(t.s * t.x.sx, *l);
        *l = bc.mul_add(t.x.xsum, *l);
    }

    /// The dot product.
    #[inline]
    pub fn finish(&self) -> f32 {
        let a = &self.0;
        ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_codes_recombine_exactly_within_their_planes() {
        let m = I16_SPLIT_MAX as i16;
        for xq in -m..=m {
            let (hi, lo) = split_code(xq);
            assert_eq!(256 * i32::from(hi) + i32::from(lo), i32::from(xq), "{xq}");
            assert!((-127..=127).contains(&hi), "{xq}: hi {hi}");
        }
    }

    #[test]
    fn codes_round_to_nearest_even_and_clamp() {
        for (v, want) in
            [(2.5f32, 2), (3.5, 4), (-2.5, -2), (-0.5, 0), (126.7, 127), (127.4, 127), (-200.0, -127)]
        {
            assert_eq!(round_code(v, I8_MAX), want, "{v}");
        }
        let mut q = [0i16; 32];
        let xs: Vec<f32> = (0..32).map(|i| i as f32 - 10.0).collect();
        let gq = quantize_group(&xs, I8_MAX, &mut q);
        assert_eq!(gq.sx, 21.0 / I8_MAX);
        assert_eq!(gq.xsum, xs.iter().sum::<f32>());
        assert_eq!(gq.qsum, q.iter().map(|&c| i32::from(c)).sum::<i32>());
        assert_eq!(q[31], 127);
        assert!(quantize_group(&[f32::NAN; 32], I8_MAX, &mut q).sx.is_nan());
        assert_eq!(quantize_group(&[0.0; 32], I8_MAX, &mut q), GroupQuant { sx: 0.0, xsum: 0.0, qsum: 0 });
    }
}
