//! Unaligned SIMD loads and stores over checked slices, and the aligned halves of an
//! activation block.

use std::arch::x86_64::*;

use half::{bf16, f16};

use crate::kernels::tile::Block;

// Loads and stores. Each takes a reference whose length the slicing has checked, so the
// pointer it dereferences is valid for exactly the bytes read or written.

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn load32(b: &[u8]) -> __m256i {
    assert!(b.len() >= 32);
    // SAFETY: `b` has at least 32 readable bytes (asserted); the load is unaligned.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn load16(b: &[u8]) -> __m128i {
    assert!(b.len() >= 16);
    // SAFETY: `b` has at least 16 readable bytes (asserted); the load is unaligned.
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

/// 16 bytes in the low half, zeros in the high half.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn load16z(b: &[u8]) -> __m256i {
    _mm256_zextsi128_si256(load16(b))
}

/// Bytes `0..32` of an activation block.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn load_lo(b: &Block) -> __m256i {
    // SAFETY: a `Block` is 64 bytes aligned to 64, so bytes 0..32 are readable and
    // 32-byte aligned.
    unsafe { _mm256_load_si256(b.0.as_ptr().cast()) }
}

/// Bytes `32..64` of an activation block.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn load_hi(b: &Block) -> __m256i {
    // SAFETY: a `Block` is 64 bytes aligned to 64, so bytes 32..64 are readable and
    // 32-byte aligned.
    unsafe { _mm256_load_si256(b.0[32..].as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn load8i(v: &[i32]) -> __m256i {
    assert!(v.len() >= 8);
    // SAFETY: `v` has at least 8 readable i32 (asserted); the load is unaligned.
    unsafe { _mm256_loadu_si256(v.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn load8f(v: &[f32]) -> __m256 {
    assert!(v.len() >= 8);
    // SAFETY: `v` has at least 8 readable f32 (asserted); the load is unaligned.
    unsafe { _mm256_loadu_ps(v.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn load_f16x8(h: &[f16]) -> __m128i {
    assert!(h.len() >= 8);
    // SAFETY: `h` has at least 8 f16, 16 readable bytes (asserted); unaligned load.
    unsafe { _mm_loadu_si128(h.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn load_bf16x8(h: &[bf16]) -> __m128i {
    assert!(h.len() >= 8);
    // SAFETY: `h` has at least 8 bf16, 16 readable bytes (asserted); unaligned load.
    unsafe { _mm_loadu_si128(h.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn store8f_into(o: &mut [f32], v: __m256) {
    assert!(o.len() >= 8);
    // SAFETY: `o` has at least 8 writable f32 (asserted); the store is unaligned.
    unsafe { _mm256_storeu_ps(o.as_mut_ptr(), v) }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn store8f(v: __m256) -> [f32; 8] {
    let mut out = [0f32; 8];
    store8f_into(&mut out, v);
    out
}
