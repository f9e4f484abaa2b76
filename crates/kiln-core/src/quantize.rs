//! `quantize`: f32 weights to the MLX affine format, reproducing `mlx.core.quantize` bit
//! for bit (packed words, scales and biases).
//!
//! Per group, MLX picks the extreme of larger magnitude as the exact endpoint: the scale
//! is `(max - min) / (2^bits - 1)`, signed so that endpoint maps to code 0 or a whole
//! code, then refined to `edge / round(edge / scale)` with `bias = edge`. Scales can
//! therefore be negative. All arithmetic is f32, rounding halves to even like `rint`.

use crate::buffer::Buffer;
use crate::format::{GeometryError, QuantSpec, validate_geometry, write_code};
use crate::matrix::{QuantizedMatrix, ScaleData, ScaleDtype};

/// Quantizes `w` (row-major `[n, k]`) with scales and biases kept in f32, as
/// `mlx.core.quantize` does for an f32 input.
pub fn quantize(w: &[f32], n: usize, k: usize, spec: QuantSpec) -> Result<QuantizedMatrix, GeometryError> {
    quantize_as(w, n, k, spec, ScaleDtype::F32)
}

/// Quantizes `w`, then stores scales and biases as `dtype`. Codes are computed from the
/// unrounded f32 scale and bias, as MLX does when its input is f16 or bf16 (pass the
/// input already rounded to that dtype to match MLX exactly).
pub fn quantize_as(
    w: &[f32],
    n: usize,
    k: usize,
    spec: QuantSpec,
    dtype: ScaleDtype,
) -> Result<QuantizedMatrix, GeometryError> {
    validate_geometry(n, k, spec)?;
    assert_eq!(w.len(), n * k, "quantize: w must hold n * k = {} values", n * k);
    let g = spec.group_size();
    let bits = spec.bits();
    let n_bins = spec.max_code() as f32;
    let words_per_row = spec.words_per_row(k);
    let mut packed = vec![0u32; n * words_per_row];
    let mut scales = Vec::with_capacity(n * k / g);
    let mut biases = Vec::with_capacity(n * k / g);
    for (r, row) in w.chunks_exact(k).enumerate() {
        let out = &mut packed[r * words_per_row..(r + 1) * words_per_row];
        for (gi, group) in row.chunks_exact(g).enumerate() {
            let (scale, bias) = group_scale_bias(group, n_bins);
            for (j, &x) in group.iter().enumerate() {
                let q = ((x - bias) / scale).round_ties_even().clamp(0.0, n_bins);
                write_code(out, gi * g + j, bits, q as u32);
            }
            scales.push(scale);
            biases.push(bias);
        }
    }
    QuantizedMatrix::new(
        n,
        k,
        spec,
        Buffer::from_vec(packed),
        ScaleData::from_f32(&scales, dtype),
        ScaleData::from_f32(&biases, dtype),
    )
}

/// MLX's choice of scale and bias for one group.
fn group_scale_bias(group: &[f32], n_bins: f32) -> (f32, f32) {
    const EPS: f32 = 1e-7;
    let mut w_min = f32::INFINITY;
    let mut w_max = f32::NEG_INFINITY;
    for &x in group {
        w_max = w_max.max(x);
        w_min = w_min.min(x);
    }
    let mask = w_min.abs() > w_max.abs();
    let mut scale = ((w_max - w_min) / n_bins).max(EPS);
    if !mask {
        scale = -scale;
    }
    let edge = if mask { w_min } else { w_max };
    let q0 = (edge / scale).round_ties_even();
    let mut bias = 0.0;
    if q0 != 0.0 {
        scale = edge / q0;
        bias = edge;
    }
    (scale, bias)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_inside_the_grid_round_to_the_nearest_code() {
        // MLX rounds the edge's code, so the grid can stop short of the far extreme and
        // values beyond it clamp; inside the grid every value is within half a step.
        let k = 128;
        let w: Vec<f32> = (0..2 * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        for bits in [2, 3, 4, 5, 6, 8] {
            let spec = QuantSpec::new(bits, 32).unwrap();
            let q = quantize(&w, 2, k, spec).unwrap();
            let mut row = vec![0f32; k];
            for r in 0..2 {
                q.dequantize_row(r, &mut row);
                for (j, (&a, &b)) in w[r * k..(r + 1) * k].iter().zip(&row).enumerate() {
                    let gi = r * 4 + j / 32;
                    let (s, bias) = (q.scales().get(gi), q.biases().get(gi));
                    let (e0, e1) = (bias, s * spec.max_code() as f32 + bias);
                    let inside = a.clamp(e0.min(e1), e0.max(e1));
                    assert!(
                        (inside - b).abs() <= 0.5 * s.abs() * 1.0001,
                        "bits {bits} r {r} j {j}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_larger_magnitude_extreme_is_exact() {
        let mut w = vec![0.1f32; 64];
        w[5] = -3.0;
        w[9] = 1.0;
        let q = quantize(&w, 1, 64, QuantSpec::new(4, 64).unwrap()).unwrap();
        let mut row = vec![0f32; 64];
        q.dequantize_row(0, &mut row);
        assert_eq!(row[5], -3.0);
    }

    #[test]
    fn refuses_bad_geometry_before_touching_data() {
        let e = quantize(&[0.0; 100], 1, 100, QuantSpec::new(4, 64).unwrap()).unwrap_err();
        assert!(matches!(e, GeometryError::KNotMultipleOfGroup { .. }));
    }
}
