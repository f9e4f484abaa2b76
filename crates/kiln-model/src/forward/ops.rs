//! Element-wise and row-wise operations of the forward pass: RMSNorm, SwiGLU, residual
//! adds, dot products and a vectorisable `exp`. Written so the compiler can vectorise
//! them for the baseline target (independent accumulators, no data-dependent branches);
//! CPU-feature dispatch belongs to kiln-core's kernels alone.

pub use kiln_core::math::{exp, max};
use rayon::prelude::*;

/// Rows per rayon task in row-parallel operations; below one task's worth, stay serial.
const ROWS_PER_TASK: usize = 8;

/// `out[r] = x[r] / rms(x[r]) * weight` for every row of width `weight.len()`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    debug_assert_eq!(x.len(), out.len());
    let one = |(xr, or): (&[f32], &mut [f32])| {
        let ss = sum_squares(xr);
        let inv = 1.0 / (ss / d as f32 + eps).sqrt();
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * inv * w;
        }
    };
    if x.len() > ROWS_PER_TASK * d {
        x.par_chunks(d).zip(out.par_chunks_mut(d)).for_each(one);
    } else {
        x.chunks(d).zip(out.chunks_mut(d)).for_each(one);
    }
}

/// `gate = silu(gate) * up`, element-wise.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    const SPAN: usize = 4096;
    let one = |(g, u): (&mut [f32], &[f32])| {
        for (g, &u) in g.iter_mut().zip(u) {
            let v = *g;
            *g = v / (1.0 + exp(-v)) * u;
        }
    };
    if gate.len() > 4 * SPAN {
        gate.par_chunks_mut(SPAN).zip(up.par_chunks(SPAN)).for_each(one);
    } else {
        one((gate, up));
    }
}

/// `x += y`, element-wise.
pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Sum of squares with eight independent accumulators.
pub fn sum_squares(x: &[f32]) -> f32 {
    dot(x, x)
}

/// `a . b` with eight independent accumulators (the order is fixed, so the result does not
/// depend on anything but the inputs).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ar.iter().zip(br) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `y += a * x`.
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// `x *= a`.
#[inline]
pub fn scale(x: &mut [f32], a: f32) {
    for v in x {
        *v *= a;
    }
}

/// A strided view of a matrix: element `(r, c)` of `data` is at `r * rs + c * cs`.
#[derive(Clone, Copy)]
pub struct Strided<'a> {
    /// The values.
    pub data: &'a [f32],
    /// Row stride.
    pub rs: usize,
    /// Column stride.
    pub cs: usize,
}

/// `c[m, n] = alpha * a[m, k] b[k, n] + beta * c[m, n]` over strided views (`c` row
/// stride `rsc`, column stride 1), through `matrixmultiply`'s packed kernels. With `beta`
/// 0, `c` is only written.
///
/// # Panics
/// When a view's strides reach outside its slice.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    m: usize,
    k: usize,
    n: usize,
    alpha: f32,
    a: Strided<'_>,
    b: Strided<'_>,
    beta: f32,
    c: &mut [f32],
    rsc: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    let last = |rows: usize, cols: usize, rs: usize, cs: usize| (rows - 1) * rs + (cols - 1) * cs;
    assert!(k == 0 || last(m, k, a.rs, a.cs) < a.data.len(), "gemm: a is too short for [{m}, {k}]");
    assert!(k == 0 || last(k, n, b.rs, b.cs) < b.data.len(), "gemm: b is too short for [{k}, {n}]");
    assert!(last(m, n, rsc, 1) < c.len(), "gemm: c is too short for [{m}, {n}]");
    let s = |x: usize| x as isize;
    // SAFETY: the assertions above show that every element the three strided views
    // address lies inside its slice (all strides are non-negative); `c` is borrowed
    // mutably and cannot alias `a` or `b`.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            a.data.as_ptr(),
            s(a.rs),
            s(a.cs),
            b.data.as_ptr(),
            s(b.rs),
            s(b.cs),
            beta,
            c.as_mut_ptr(),
            s(rsc),
            1,
        );
    }
}

/// Replaces every value by `e^(v - shift)` and returns their sum.
pub fn exp_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
    for v in x.iter_mut() {
        *v = exp(*v - shift);
    }
    let mut acc = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for i in 0..8 {
            acc[i] += c[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Index of the largest value; the first one on ties, NaN never wins (0 when every
/// value is NaN). Two passes, the first in vector lanes: faster than one branchy pass
/// over a 150k-entry vocabulary.
pub fn argmax(x: &[f32]) -> usize {
    let m = max(x);
    x.iter().position(|&v| v == m).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_normalises_each_row() {
        let x = [3.0, 4.0, 0.0, 0.0, 1.0, 1.0];
        let w = [1.0, 2.0];
        let mut out = [0f32; 6];
        rms_norm(&x, &w, 1e-6, &mut out);
        let inv = 1.0 / (12.5f32).sqrt();
        assert!((out[0] - 3.0 * inv).abs() < 1e-6 && (out[1] - 8.0 * inv).abs() < 1e-6);
        // eps keeps an all-zero row finite.
        assert!(out[2] == 0.0 && out[3] == 0.0);
        assert!((out[4] - 1.0).abs() < 1e-6 && (out[5] - 2.0).abs() < 1e-6);
    }

    #[test]
    fn dot_matches_f64_and_argmax_picks_first() {
        let a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.3).sin()).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32 * 0.7).cos()).collect();
        let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
        assert!((dot(&a, &b) as f64 - want).abs() < 1e-5);
        assert_eq!(argmax(&[1.0, 3.0, f32::NAN, 3.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN]), 0);
        let long: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1009) as f32).collect();
        let top = long.iter().cloned().fold(f32::MIN, f32::max);
        assert_eq!(argmax(&long), long.iter().position(|&v| v == top).unwrap());
    }

    #[test]
    fn max_and_exp_sum_cover_every_lane() {
        let mut x: Vec<f32> = (0..21).map(|i| (i as f32 * 1.7).sin()).collect();
        let want_max = x.iter().cloned().fold(f32::MIN, f32::max);
        assert_eq!(max(&x), want_max);
        assert_eq!(max(&[]), f32::NEG_INFINITY);
        let want: f64 = x.iter().map(|&v| ((v - want_max) as f64).exp()).sum();
        let got = exp_shifted_sum(&mut x, want_max);
        assert!((got as f64 - want).abs() < 1e-5, "{got} vs {want}");
        assert!(x.iter().all(|&v| v > 0.0 && v <= 1.0));
    }

    #[test]
    fn gemm_follows_the_strides() {
        // a = [[1, 2], [3, 4]] stored column-major; b = [[1, 0, 2], [0, 1, 3]] row-major.
        let a = [1.0, 3.0, 2.0, 4.0];
        let b = [1.0, 0.0, 2.0, 0.0, 1.0, 3.0];
        let mut c = [1.0f32; 8];
        let av = Strided { data: &a, rs: 1, cs: 2 };
        let bv = Strided { data: &b, rs: 3, cs: 1 };
        gemm(2, 2, 3, 1.0, av, bv, 1.0, &mut c, 4);
        assert_eq!(c, [2.0, 3.0, 9.0, 1.0, 4.0, 5.0, 19.0, 1.0]);
        gemm(2, 2, 3, 2.0, av, bv, 0.0, &mut c, 4);
        assert_eq!(c, [2.0, 4.0, 16.0, 1.0, 6.0, 8.0, 36.0, 1.0]);
    }

    #[test]
    fn silu_mul_matches_the_definition() {
        let mut g = [-2.0f32, 0.0, 1.5];
        silu_mul(&mut g, &[1.0, 5.0, 2.0]);
        let silu = |v: f32| v / (1.0 + (-v).exp());
        for (got, want) in g.iter().zip([silu(-2.0), 0.0, silu(1.5) * 2.0]) {
            assert!((got - want).abs() < 1e-6);
        }
    }
}
