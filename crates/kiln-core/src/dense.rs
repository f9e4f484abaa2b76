//! The unquantized twin of the quantized kernels: `y = x W^T` for an f32 `W[N, K]`, used
//! by checkpoints run as they are (f32, or f16/bf16 widened on load).

use rayon::prelude::*;

use crate::buffer::Buffer;

/// An f32 `W[N, K]`, row-major.
#[derive(Debug)]
pub struct DenseMatrix {
    n: usize,
    k: usize,
    data: Buffer<f32>,
}

impl DenseMatrix {
    /// Wraps row-major data of `n * k` values.
    ///
    /// # Panics
    /// When `data.len() != n * k`.
    pub fn new(n: usize, k: usize, data: Buffer<f32>) -> Self {
        assert_eq!(data.len(), n * k, "DenseMatrix::new: data must hold n * k values");
        DenseMatrix { n, k, data }
    }

    /// Output features.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Input features.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Row-major values.
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// Row `r`.
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.k..(r + 1) * self.k]
    }

    /// Bytes a full pass reads.
    pub fn bytes_read(&self) -> usize {
        self.data.len() * 4
    }
}

/// Output columns per parallel task: wide enough to amortise the GEMM's packing.
const COLUMN_BLOCK: usize = 256;

/// `y[m, n] = x[m, k] W^T`, parallel over blocks of output columns.
pub fn matmul(x: &[f32], m: usize, w: &DenseMatrix, y: &mut [f32]) {
    let (n, k) = (w.n, w.k);
    assert_eq!(x.len(), m * k, "dense::matmul: x must hold m * k values");
    assert_eq!(y.len(), m * n, "dense::matmul: y must hold m * n values");
    let blocks = n.div_ceil(COLUMN_BLOCK);
    // Each task writes a disjoint column range of y; collect per-block results and
    // scatter, because y's rows interleave the blocks.
    let parts: Vec<Vec<f32>> = (0..blocks)
        .into_par_iter()
        .map(|b| {
            let n0 = b * COLUMN_BLOCK;
            let nb = COLUMN_BLOCK.min(n - n0);
            let mut out = vec![0f32; m * nb];
            let wb = &w.data[n0 * k..(n0 + nb) * k];
            // SAFETY: a is x as [m, k] row-major (rsa = k, csa = 1); b is the block of W
            // read as W^T [k, nb] (rsb = 1, csb = k); c is out as [m, nb] row-major. All
            // three slices hold exactly the elements those strides address.
            unsafe {
                matrixmultiply::sgemm(
                    m,
                    k,
                    nb,
                    1.0,
                    x.as_ptr(),
                    k as isize,
                    1,
                    wb.as_ptr(),
                    1,
                    k as isize,
                    0.0,
                    out.as_mut_ptr(),
                    nb as isize,
                    1,
                );
            }
            out
        })
        .collect();
    for (b, part) in parts.iter().enumerate() {
        let n0 = b * COLUMN_BLOCK;
        let nb = part.len() / m.max(1);
        for r in 0..m {
            y[r * n + n0..r * n + n0 + nb].copy_from_slice(&part[r * nb..(r + 1) * nb]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_naive_product() {
        let (m, n, k) = (3, 300, 17);
        let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect();
        let mat = DenseMatrix::new(n, k, w.clone().into());
        let mut y = vec![0f32; m * n];
        matmul(&x, m, &mat, &mut y);
        for r in 0..m {
            for c in 0..n {
                let want: f64 = (0..k).map(|j| x[r * k + j] as f64 * w[c * k + j] as f64).sum();
                assert!((y[r * n + c] as f64 - want).abs() < 1e-4, "({r}, {c})");
            }
        }
    }
}
