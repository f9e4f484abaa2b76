//! The x86 lanes of the tiled prefill attention ([`super::prefill`]): 16 f32 lanes on
//! AVX-512 (register tiles of 6 by 4 vectors, 24 of the 32 registers) and 8 on AVX2 (6 by
//! 2, 12 of the 16). The exponential is [`crate::math::exp`]'s operations in its order, as
//! the decode path's `exp8` is.

use std::arch::x86_64::*;

use super::KvSource;
use super::prefill::{Job, Lanes, Scratch, task};

/// Keys (and widths) per register tile on both x86 paths.
pub(super) const R: usize = 6;

/// One prefill task on AVX-512.
///
/// # Safety
/// The CPU must have AVX-512F/BW/VL, AVX2, FMA and F16C; `scratch` was made for the
/// job's shape and [`R`]; `out` holds the job's rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn task512<S: KvSource>(job: &Job<'_, S>, scratch: &mut Scratch, out: &mut [f32]) {
    // SAFETY: this function's features are the ones `V16` needs; the caller holds the rest.
    unsafe { task::<V16, 4, R, S>(job, scratch, out) }
}

/// One prefill task on AVX2.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; otherwise as [`task512`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn task256<S: KvSource>(job: &Job<'_, S>, scratch: &mut Scratch, out: &mut [f32]) {
    // SAFETY: this function's features are the ones `V8` needs; the caller holds the rest.
    unsafe { task::<V8, 2, R, S>(job, scratch, out) }
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

    #[inline(always)]
    unsafe fn exp_sub(a: Self, b: Self) -> Self {
        use crate::math::{EXP_LN2_HI, EXP_LN2_LO, EXP_MAX, EXP_MIN, EXP_POLY, EXP_ROUNDER};
        // SAFETY: see the impl.
        unsafe {
            let x = _mm512_sub_ps(a.0, b.0);
            let x = _mm512_min_ps(_mm512_set1_ps(EXP_MAX), _mm512_max_ps(_mm512_set1_ps(EXP_MIN), x));
            let rounder = _mm512_set1_ps(EXP_ROUNDER);
            let t = _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)), rounder);
            let n = _mm512_sub_ps(t, rounder);
            let r = _mm512_sub_ps(
                _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(EXP_LN2_HI))),
                _mm512_mul_ps(n, _mm512_set1_ps(EXP_LN2_LO)),
            );
            let mut p = _mm512_set1_ps(EXP_POLY[0]);
            for &c in &EXP_POLY[1..] {
                p = _mm512_add_ps(_mm512_set1_ps(c), _mm512_mul_ps(r, p));
            }
            let ni = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(EXP_ROUNDER.to_bits() as i32));
            let two_n = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(ni, _mm512_set1_epi32(127))));
            V16(_mm512_mul_ps(p, two_n))
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
