//! Activations quantized per weight group for the integer kernels (AVX2, NEON).
//!
//! Each group of `group_size` activations of one row gets one f32 scale `sx` and integer
//! codes `xq` with `x ~= sx * xq`, rounded to nearest: 8-bit codes in `[-127, 127]` for
//! 4-bit weights (so `u4 * i8` products fit `maddubs`), 16-bit codes in `[-32767, 32767]`
//! for 8-bit weights (`u8 * i16` pairs fit `madd`). The exact f32 sum of each group's
//! activations is kept beside it for the bias term, so a product is
//! `sum_g s_g * sx_g * sum_j q_j xq_j + b_g * xsum_g` with an exact integer inner sum.
//!
//! [`XRows`] holds the codes in element order (NEON, portable); the AVX2 kernels lay them
//! out in blocks (`tile.rs`). [`Lanes`] fixes the float order every integer kernel follows.

/// Largest 8-bit activation code: symmetric, so `-128` never occurs.
pub(crate) const I8_MAX: f32 = 127.0;
/// Largest 16-bit activation code.
pub(crate) const I16_MAX: f32 = 32767.0;

/// Activation rows a kernel handles per pass over a weight group, at most.
pub(crate) const TILE_ROWS: usize = 8;

/// Which code width the weights' width calls for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActCodes {
    /// 8-bit codes, even/odd de-interleaved per 64-element block (4-bit weights).
    I8Deinterleaved,
    /// 16-bit codes in element order (8-bit weights).
    I16,
}

impl ActCodes {
    /// The code width the integer kernels use for `bits`-bit weights, if they have one.
    pub fn for_weight_bits(bits: u32) -> Option<Self> {
        match bits {
            4 => Some(ActCodes::I8Deinterleaved),
            8 => Some(ActCodes::I16),
            _ => None,
        }
    }

    /// Largest code magnitude.
    pub fn max_code(self) -> f32 {
        match self {
            ActCodes::I8Deinterleaved => I8_MAX,
            ActCodes::I16 => I16_MAX,
        }
    }
}

// `quantize_group` is `inline(always)` so that a caller compiled for a wider ISA (the AVX2
// kernels wrap the quantizer in a `#[target_feature]` function) gets it compiled for that
// ISA too.
#[inline(always)]
pub(crate) fn quantize_group(xs: &[f32], qmax: f32, codes: &mut [i16]) -> (f32, f32) {
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
        return (f32::NAN, xsum);
    }
    if amax == 0.0 {
        codes.fill(0);
        return (0.0, xsum);
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
    (sx, xsum)
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
}

impl XRows {
    /// Quantizes `m` rows of `k` activations per group of `g`.
    pub fn new(x: &[f32], m: usize, k: usize, g: usize, codes: ActCodes) -> XRows {
        assert_eq!(x.len(), m * k);
        let gpr = k / g;
        let mut out = XRows { codes: vec![0; m * k], sx: vec![0.0; m * gpr], xsum: vec![0.0; m * gpr] };
        for (i, (xs, cs)) in x.chunks_exact(g).zip(out.codes.chunks_exact_mut(g)).enumerate() {
            let (sx, xsum) = quantize_group(xs, codes.max_code(), cs);
            out.sx[i] = sx;
            out.xsum[i] = xsum;
        }
        out
    }
}

/// The float half of an integer-scheme dot product, in the one order every integer
/// kernel follows (AVX2 in vector lanes, NEON and portable with this type), so that all of
/// them, and `qmv`, `qmv_wide` and `qmm` alike, round every output the same way.
///
/// Group `g` goes to lane `g % 8`: `lane = fma(tot, s * sx, lane)` then
/// `lane = fma(b, xsum, lane)`; the lanes are summed as
/// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`.
#[derive(Clone, Copy, Default)]
pub(crate) struct Lanes(pub [f32; 8]);

impl Lanes {
    /// Adds group `g` with integer dot `tot`, weight scale and bias `s`, `b`, activation
    /// scale `sx` and exact activation sum `xsum`.
    #[inline]
    pub fn add_group(&mut self, g: usize, tot: i32, s: f32, b: f32, sx: f32, xsum: f32) {
        let l = &mut self.0[g % 8];
        *l = (tot as f32).mul_add(s * sx, *l);
        *l = b.mul_add(xsum, *l);
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
    fn codes_round_to_nearest_even_and_clamp() {
        for (v, want) in
            [(2.5f32, 2), (3.5, 4), (-2.5, -2), (-0.5, 0), (126.7, 127), (127.4, 127), (-200.0, -127)]
        {
            assert_eq!(round_code(v, I8_MAX), want, "{v}");
        }
        let mut q = [0i16; 32];
        let xs: Vec<f32> = (0..32).map(|i| i as f32 - 10.0).collect();
        let (sx, xsum) = quantize_group(&xs, I8_MAX, &mut q);
        assert_eq!(sx, 21.0 / I8_MAX);
        assert_eq!(xsum, xs.iter().sum::<f32>());
        assert_eq!(q[31], 127);
        assert!(quantize_group(&[f32::NAN; 32], I8_MAX, &mut q).0.is_nan());
        assert_eq!(quantize_group(&[0.0; 32], I8_MAX, &mut q), (0.0, 0.0));
    }
}
