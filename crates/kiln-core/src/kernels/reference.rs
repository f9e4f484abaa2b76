//! Scalar references for every quantized kernel: plain loops that dequantize with
//! [`QuantizedMatrix::dequantize_row`] and accumulate in order. The fast kernels are
//! tested against these and against [`matmul_f64`], the exact answer.

use crate::matrix::QuantizedMatrix;

/// `y[n] = dot(dequantized W[n, :], x)` for one activation row, f32 accumulation.
pub fn qmv(x: &[f32], w: &QuantizedMatrix, y: &mut [f32]) {
    assert_eq!(x.len(), w.k());
    assert_eq!(y.len(), w.n());
    let mut row = vec![0f32; w.k()];
    for (r, out) in y.iter_mut().enumerate() {
        w.dequantize_row(r, &mut row);
        *out = dot(&row, x);
    }
}

/// `qmv` for M rows sharing each dequantized weight row: the shape of `qmv_wide`.
pub fn qmv_wide(x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32]) {
    let (n, k) = (w.n(), w.k());
    assert_eq!(x.len(), m * k);
    assert_eq!(y.len(), m * n);
    let mut row = vec![0f32; k];
    for r in 0..n {
        w.dequantize_row(r, &mut row);
        for i in 0..m {
            y[i * n + r] = dot(&row, &x[i * k..(i + 1) * k]);
        }
    }
}

/// Dequantize all of W, then multiply: the shape of `qmm`.
pub fn qmm(x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32]) {
    let (n, k) = (w.n(), w.k());
    assert_eq!(x.len(), m * k);
    assert_eq!(y.len(), m * n);
    let wd = dequantize(w);
    for i in 0..m {
        for r in 0..n {
            y[i * n + r] = dot(&wd[r * k..(r + 1) * k], &x[i * k..(i + 1) * k]);
        }
    }
}

/// The whole matrix dequantized, row-major `[n, k]`.
pub fn dequantize(w: &QuantizedMatrix) -> Vec<f32> {
    let k = w.k();
    let mut out = vec![0f32; w.n() * k];
    for (r, row) in out.chunks_exact_mut(k).enumerate() {
        w.dequantize_row(r, row);
    }
    out
}

/// The exact product in f64 of the dequantized matrix (whose values are exact in f32)
/// and `x`: the ground truth every kernel's error is measured from.
pub fn matmul_f64(x: &[f32], m: usize, w: &QuantizedMatrix) -> Vec<f64> {
    let (n, k) = (w.n(), w.k());
    assert_eq!(x.len(), m * k);
    let wd = dequantize(w);
    let mut y = vec![0f64; m * n];
    for i in 0..m {
        for r in 0..n {
            let xr = &x[i * k..(i + 1) * k];
            y[i * n + r] = wd[r * k..(r + 1) * k].iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64).sum();
        }
    }
    y
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |acc, (&p, &q)| acc + p * q)
}
