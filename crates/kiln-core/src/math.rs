//! Scalar maths shared by the model's element-wise operations and the attention kernels,
//! written branch-free so loops over it vectorise for whatever target they are compiled
//! for (the baseline, or inside a `#[target_feature]` kernel that inlines it).

/// `e^x` for f32 within 4 ulp, branch-free and without float-to-int conversions so loops
/// over it vectorise: `x = n ln2 + r` with `|r| <= ln2 / 2`, a degree-7 polynomial for
/// `e^r`, and `2^n` built in the exponent bits. Inputs below -87.3 give about 1e-38 (0
/// for any softmax purpose); inputs above 88.3 give about 2.2e38. The vector forms (the
/// attention kernels' `exp8`) take the constants below and run the same operations in the
/// same order, so they give the same bits.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(EXP_MIN, EXP_MAX);
    let t = x * std::f32::consts::LOG2_E + EXP_ROUNDER;
    let n = t - EXP_ROUNDER;
    let r = x - n * EXP_LN2_HI - n * EXP_LN2_LO;
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = c + r * p;
    }
    let ni = (t.to_bits() as i32).wrapping_sub(EXP_ROUNDER.to_bits() as i32);
    p * f32::from_bits(((ni + 127) as u32) << 23)
}

/// [`exp`]'s clamp: `n` stays in [-126, 127], so `2^n` is a normal float.
pub(crate) const EXP_MIN: f32 = -87.336_55;
/// See [`EXP_MIN`].
pub(crate) const EXP_MAX: f32 = 88.3;
/// ln 2 split in two so `n * EXP_LN2_HI` is exact.
pub(crate) const EXP_LN2_HI: f32 = 0.693_359_4;
/// See [`EXP_LN2_HI`].
pub(crate) const EXP_LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5 * 2^23: adding it rounds to the nearest integer (ties to even), and leaves that
/// integer in the low bits of the sum, where `round` and `as i32` would be library calls
/// or saturating conversions on the baseline target.
pub(crate) const EXP_ROUNDER: f32 = 12_582_912.0;
/// Taylor coefficients of `e^r` from the highest power down, enough for `|r| <= 0.347`,
/// evaluated by Horner's rule (`p = c + r * p`).
pub(crate) const EXP_POLY: [f32; 8] =
    [1.984_127e-4, 1.388_888_9e-3, 8.333_334e-3, 4.166_666_8e-2, 1.666_666_7e-1, 0.5, 1.0, 1.0];

/// The largest value (negative infinity for an empty slice; NaN is skipped), with eight
/// independent lanes so it vectorises.
#[inline(always)]
pub fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder().iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for c in chunks {
        for i in 0..8 {
            acc[i] = acc[i].max(c[i]);
        }
    }
    acc.iter().fold(tail, |a, &b| a.max(b))
}

/// The relative error bound of [`exp`] over its unclamped range, as the attention tests
/// charge it: 4 ulp of the result, `4 * 2^-23`.
pub const EXP_REL_ERROR: f64 = 4.0 / 8_388_608.0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate_and_saturates() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < EXP_REL_ERROR, "relative error {worst}");
        assert!(exp(-1000.0) < 1e-37);
        assert!(exp(100.0) > 1e38);
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(f32::NEG_INFINITY) < 1e-37);
    }
}
