//! Scales and biases: dtype tags, eight-at-a-time loads in the stored dtype, and rows
//! widened to f32 for the tiled kernels.

use std::arch::x86_64::*;
use std::ops::Range;

use half::{bf16, f16};

use super::loads::{load_bf16x8, load_f16x8, load16, store8f};
use crate::matrix::{QuantizedMatrix, ScaleData};

/// The packed bytes of every row (x86-64 is little-endian, so byte `i` of a row holds
/// bits `8i .. 8i + 8` of its stream).
pub(super) fn packed_bytes(w: &QuantizedMatrix) -> &[u8] {
    bytemuck::cast_slice(w.packed())
}

/// Scales and biases of a range of rows widened to f32 in one pass (rows stay contiguous,
/// `gpr` apart), with eight zeros after the last row so an 8-lane load at any group of
/// any row stays in bounds.
pub(super) struct RowScales {
    pub(super) gpr: usize,
    pub(super) s: Vec<f32>,
    pub(super) b: Vec<f32>,
}

impl RowScales {
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn new(w: &QuantizedMatrix, rows: Range<usize>) -> RowScales {
        let gpr = w.spec().groups_per_row(w.k());
        let len = rows.len() * gpr;
        // Widened straight into the vectors' capacity: zeroing them first was a second
        // write pass over both, a tenth of `qmv_wide`'s instructions at M = 2.
        let (mut s, mut b) = (Vec::with_capacity(len + 8), Vec::with_capacity(len + 8));
        widen(w.scales(), rows.start * gpr, len, &mut s);
        widen(w.biases(), rows.start * gpr, len, &mut b);
        s.extend_from_slice(&[0.0; 8]);
        b.extend_from_slice(&[0.0; 8]);
        RowScales { gpr, s, b }
    }

    /// Row `i`'s scales and biases, followed by whatever comes next (at least 8 values).
    pub(super) fn row(&self, i: usize) -> (&[f32], &[f32]) {
        (&self.s[i * self.gpr..], &self.b[i * self.gpr..])
    }
}

/// Scale storage dtypes as const tags: the `qmv` loop reads scales and biases in their
/// stored form, eight at a time, widening them in registers.
pub(super) const F16: u8 = 0;
pub(super) const BF16: u8 = 1;
pub(super) const F32: u8 = 2;

/// Bytes of one scale in dtype `D`.
pub(super) const fn scale_size(d: u8) -> usize {
    if d == F32 { 4 } else { 2 }
}

/// The raw bytes of a scale or bias tensor.
pub(super) fn scale_bytes(sd: &ScaleData) -> &[u8] {
    match sd {
        ScaleData::F16(v) => bytemuck::cast_slice(v),
        ScaleData::Bf16(v) => bytemuck::cast_slice(v),
        ScaleData::F32(v) => bytemuck::cast_slice(v),
    }
}

/// Eight scales of dtype `D` (`b` holds exactly their bytes) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn load_scales8<const D: u8>(b: &[u8]) -> __m256 {
    match D {
        F16 => _mm256_cvtph_ps(load16(b)),
        BF16 => bf16x8_to_f32(load16(b)),
        _ => {
            assert!(b.len() >= 32);
            // SAFETY: `b` has at least 32 readable bytes (asserted): eight f32.
            unsafe { _mm256_loadu_ps(b.as_ptr().cast()) }
        }
    }
}

/// Appends `n` scales or biases from `start`, widened with the dtype's own conversion, to
/// `out`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn widen(sd: &ScaleData, start: usize, n: usize, out: &mut Vec<f32>) {
    match sd {
        ScaleData::F16(v) => {
            let mut sc = v[start..start + n].chunks_exact(8);
            for h in &mut sc {
                out.extend_from_slice(&store8f(_mm256_cvtph_ps(load_f16x8(h))));
            }
            let mut tail = [f16::ZERO; 8];
            let r = sc.remainder().len();
            tail[..r].copy_from_slice(sc.remainder());
            out.extend_from_slice(&store8f(_mm256_cvtph_ps(load_f16x8(&tail)))[..r]);
        }
        ScaleData::Bf16(v) => {
            let mut sc = v[start..start + n].chunks_exact(8);
            for h in &mut sc {
                out.extend_from_slice(&store8f(bf16x8_to_f32(load_bf16x8(h))));
            }
            let mut tail = [bf16::ZERO; 8];
            let r = sc.remainder().len();
            tail[..r].copy_from_slice(sc.remainder());
            out.extend_from_slice(&store8f(bf16x8_to_f32(load_bf16x8(&tail)))[..r]);
        }
        ScaleData::F32(v) => out.extend_from_slice(&v[start..start + n]),
    }
}

/// bf16 is the high half of an f32: widen to 32 bits and shift left by 16.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn bf16x8_to_f32(v: __m128i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)))
}
