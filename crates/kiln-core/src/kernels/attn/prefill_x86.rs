//! The x86 lanes of the tiled prefill attention ([`super::prefill`]): 16 f32 lanes on
//! AVX-512 (register tiles of 8 keys by 3 vectors of rows, 24 of the 32 registers) and 8
//! on AVX2 (6 by 2, 12 of the 16). AVX2's exponential is the decode path's `exp8`
//! ([`crate::math::exp`]'s bits); AVX-512's fuses its operations.

use std::arch::x86_64::*;

use super::prefill_tile::{Job, Lanes, Scratch, task};
use super::tile::KvSource;

/// Keys (and widths) per register tile on AVX-512: 8 by 3 vectors of rows (24
/// accumulators, 3 loads and 8 broadcasts per step), so heads of 64 and 128 and tiles of
/// 64 keys need no padding.
pub(super) const R512: usize = 8;

/// Keys (and widths) per register tile on AVX2: 6 by 2 vectors (12 accumulators, 2 loads
/// and a broadcast: 15 of the 16 registers).
pub(super) const R256: usize = 6;

/// One prefill task on AVX-512.
///
/// # Safety
/// The CPU must have AVX-512F/BW/VL, AVX2, FMA and F16C; `scratch` was made for the
/// job's shape and [`R512`]; `out` holds the job's rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn task512<S: KvSource>(job: &Job<'_, S>, scratch: &mut Scratch, out: &mut [f32]) {
    // SAFETY: this function's features are the ones `V16` needs; the caller holds the rest.
    unsafe { task::<V16, 3, R512, S>(job, scratch, out) }
}

/// One prefill task on AVX2.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; otherwise as [`task512`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn task256<S: KvSource>(job: &Job<'_, S>, scratch: &mut Scratch, out: &mut [f32]) {
    // SAFETY: this function's features are the ones `V8` needs; the caller holds the rest.
    unsafe { task::<V8, 2, R256, S>(job, scratch, out) }
}

/// Sixteen lanes of AVX-512.
#[derive(Clone, Copy)]
struct V16(__m512);

/// Eight lanes of AVX2.
#[derive(Clone, Copy)]
struct V8(__m256);

// SAFETY (every method of both impls): the trait's contract makes the caller guarantee
// the features and that a pointer addresses a whole vector.
impl Lanes for V16 {
    const N: usize = 16;

    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: see the impl.
        V16(unsafe { _mm512_loadu_ps(p) })
    }

    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: see the impl.
        unsafe { _mm512_storeu_ps(p, self.0) }
    }

    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        // SAFETY: see the impl.
        V16(unsafe { _mm512_set1_ps(x) })
    }

    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        // SAFETY: see the impl.
        V16(unsafe { _mm512_fmadd_ps(a.0, b.0, c.0) })
    }

    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        // SAFETY: see the impl.
        V16(unsafe { _mm512_mul_ps(a.0, b.0) })
    }

    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        // SAFETY: see the impl.
        V16(unsafe { _mm512_add_ps(a.0, b.0) })
    }

    #[inline(always)]
    unsafe fn max(a: Self, b: Self) -> Self {
        // SAFETY: see the impl.
        V16(unsafe { _mm512_max_ps(a.0, b.0) })
    }

    /// [`crate::math::exp`]'s range reduction and polynomial with fused operations
    /// (`t` and `r` from FMAs, Horner's rule in FMAs) and `vscalefps` for the power of two:
    /// 14 operations a vector instead of 26, each as exact as the unfused one or more, so
    /// within [`crate::math::EXP_REL_ERROR`] (a test below checks it).
    #[inline(always)]
    unsafe fn exp_sub(a: Self, b: Self) -> Self {
        use crate::math::{EXP_LN2_HI, EXP_LN2_LO, EXP_MAX, EXP_MIN, EXP_POLY, EXP_ROUNDER};
        // SAFETY: see the impl.
        unsafe {
            let x = _mm512_sub_ps(a.0, b.0);
            let x = _mm512_min_ps(_mm512_set1_ps(EXP_MAX), _mm512_max_ps(_mm512_set1_ps(EXP_MIN), x));
            let rounder = _mm512_set1_ps(EXP_ROUNDER);
            let t = _mm512_fmadd_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E), rounder);
            let n = _mm512_sub_ps(t, rounder);
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
            let mut p = _mm512_set1_ps(EXP_POLY[0]);
            for &c in &EXP_POLY[1..] {
                p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(c));
            }
            V16(_mm512_scalef_ps(p, n))
        }
    }

    #[inline(always)]
    unsafe fn keep_ge(x: Self, pos: Self, key: Self, other: Self) -> Self {
        // SAFETY: see the impl.
        unsafe { V16(_mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_GE_OQ>(pos.0, key.0), other.0, x.0)) }
    }
}

impl Lanes for V8 {
    const N: usize = 8;

    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: see the impl.
        V8(unsafe { _mm256_loadu_ps(p) })
    }

    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: see the impl.
        unsafe { _mm256_storeu_ps(p, self.0) }
    }

    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        // SAFETY: see the impl.
        V8(unsafe { _mm256_set1_ps(x) })
    }

    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        // SAFETY: see the impl.
        V8(unsafe { _mm256_fmadd_ps(a.0, b.0, c.0) })
    }

    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        // SAFETY: see the impl.
        V8(unsafe { _mm256_mul_ps(a.0, b.0) })
    }

    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        // SAFETY: see the impl.
        V8(unsafe { _mm256_add_ps(a.0, b.0) })
    }

    #[inline(always)]
    unsafe fn max(a: Self, b: Self) -> Self {
        // SAFETY: see the impl.
        V8(unsafe { _mm256_max_ps(a.0, b.0) })
    }

    #[inline(always)]
    unsafe fn exp_sub(a: Self, b: Self) -> Self {
        // SAFETY: see the impl.
        V8(unsafe { super::x86::exp8(_mm256_sub_ps(a.0, b.0)) })
    }

    #[inline(always)]
    unsafe fn keep_ge(x: Self, pos: Self, key: Self, other: Self) -> Self {
        // SAFETY: see the impl.
        unsafe { V8(_mm256_blendv_ps(other.0, x.0, _mm256_cmp_ps::<_CMP_GE_OQ>(pos.0, key.0))) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Isa;
    use crate::math::EXP_REL_ERROR;

    #[test]
    fn avx512_exponential_stays_within_the_bound_the_tests_charge() {
        if !Isa::Avx512.is_available() {
            eprintln!("no AVX-512 on this CPU: its exponential was not checked");
            return;
        }
        let one = |x: f32| {
            let mut out = [0f32; 16];
            // SAFETY: AVX-512 was detected above; both arrays hold 16 values.
            unsafe {
                let v = <V16 as Lanes>::exp_sub(V16::splat(x), V16::splat(0.0));
                v.store(out.as_mut_ptr());
            }
            out[0]
        };
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            worst = worst.max(((one(x) as f64 - want) / want).abs());
            x += 0.0013;
        }
        assert!(worst < EXP_REL_ERROR, "relative error {worst}");
        assert_eq!(one(0.0), 1.0);
        assert!(one(f32::NEG_INFINITY) < 1e-37 && one(-1000.0) >= 0.0);
        assert!(one(100.0) > 1e38);
    }
}
