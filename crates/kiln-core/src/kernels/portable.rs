//! Portable kernels: plain Rust the compiler can vectorise, parallel over output rows.
//! Used where no ISA-specific path exists, and for widths without one.

use rayon::prelude::*;

use crate::format::read_code;
use crate::matrix::QuantizedMatrix;

/// Output rows per rayon task.
const ROWS_PER_TASK: usize = 16;

/// `qmv` for any width.
pub fn qmv(x: &[f32], w: &QuantizedMatrix, y: &mut [f32]) {
    y.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(c, ys)| {
        for (i, out) in ys.iter_mut().enumerate() {
            *out = row_dot(x, w, c * ROWS_PER_TASK + i);
        }
    });
}

/// `qmv_wide` for any width: each weight row is read once for all M activation rows.
pub fn qmv_wide(x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32]) {
    let (n, k) = (w.n(), w.k());
    let mut yt = vec![0f32; m * n];
    yt.par_chunks_mut(ROWS_PER_TASK * m).enumerate().for_each(|(c, block)| {
        let mut deq = vec![0f32; k];
        for (i, outs) in block.chunks_exact_mut(m).enumerate() {
            w.dequantize_row(c * ROWS_PER_TASK + i, &mut deq);
            for (j, o) in outs.iter_mut().enumerate() {
                *o = deq.iter().zip(&x[j * k..(j + 1) * k]).map(|(a, b)| a * b).sum();
            }
        }
    });
    for r in 0..n {
        for j in 0..m {
            y[j * n + r] = yt[r * m + j];
        }
    }
}

/// One output: per group, `scale * sum(q * x) + bias * sum(x)`.
fn row_dot(x: &[f32], w: &QuantizedMatrix, r: usize) -> f32 {
    let spec = w.spec();
    let (g, bits) = (spec.group_size(), spec.bits());
    let gpr = spec.groups_per_row(w.k());
    let words = w.row_words(r);
    let mut acc = 0f32;
    for gi in 0..gpr {
        let xs = &x[gi * g..(gi + 1) * g];
        let mut qx = 0f32;
        let mut sx = 0f32;
        for (j, &xv) in xs.iter().enumerate() {
            qx += read_code(words, gi * g + j, bits) as f32 * xv;
            sx += xv;
        }
        acc += w.scales().get(r * gpr + gi) * qx + w.biases().get(r * gpr + gi) * sx;
    }
    acc
}
