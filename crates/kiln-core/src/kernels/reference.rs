//! Scalar references for every quantized kernel: plain loops that dequantize with
//! [`QuantizedMatrix::dequantize_row`] and accumulate in order. The fast kernels are
//! tested against these and against [`matmul_f64`], the exact answer. [`qmv_int`] defines
//! the integer scheme the 4- and 8-bit kernels compute, to the bit.

use super::act::{ActCodes, GroupTerms, Lanes, quantize_group};
use crate::act_precision::ActScheme;
use crate::format::read_code;
use crate::matrix::{Layout, QuantizedMatrix};

/// The integer scheme of the 4- and 8-bit kernels under `scheme`, for `m` activation rows,
/// in plain loops: per row and weight group, the activations are quantized to codes
/// (`int16`: up to 32512 for 4-bit weights, 32767 for 8-bit; `int8`: up to 127 for 4-bit
/// weights), the group's dot with the weight codes is an exact integer, and the float
/// terms are accumulated in the order of [`Lanes`]. Every fast kernel (`qmv`, `qmv_wide`,
/// `qmm`, on every ISA) gives these bits. Returns `None` when `scheme` and the width have
/// no integer path (other widths, `f32`). Under `int16-wide8` these are the bits of `qmv`
/// and `qmm` (one row's codes, `int16`); [`qmv_wide_int`] gives those of `qmv_wide`.
pub fn qmv_int(x: &[f32], m: usize, w: &QuantizedMatrix, scheme: ActScheme) -> Option<Vec<f32>> {
    if w.layout() != Layout::RowMajor {
        // The definition reads rows.
        return qmv_int(x, m, &w.to_row_major(), scheme);
    }
    let (n, k, g, bits) = (w.n(), w.k(), w.spec().group_size(), w.spec().bits());
    assert_eq!(x.len(), m * k);
    let codes = ActCodes::for_weight_bits(bits, scheme)?;
    let gpr = k / g;
    let mut y = vec![0f32; m * n];
    let mut xq = vec![0i16; g];
    for i in 0..m {
        let quant: Vec<_> = x[i * k..(i + 1) * k]
            .chunks_exact(g)
            .map(|xs| {
                let q = quantize_group(xs, codes.max_code(), &mut xq);
                (q, xq.clone())
            })
            .collect();
        for r in 0..n {
            let row = w.row_words(r);
            let mut lanes = Lanes::default();
            for (gi, (q, xc)) in quant.iter().enumerate() {
                let tot: i32 = xc
                    .iter()
                    .enumerate()
                    .map(|(j, &c)| read_code(row, gi * g + j, bits) as i32 * i32::from(c))
                    .sum();
                let (s, b) = (w.scales().get(r * gpr + gi), w.biases().get(r * gpr + gi));
                lanes.add_group(gi, codes.center(), GroupTerms { tot, s, b, x: *q });
            }
            y[i * n + r] = lanes.finish();
        }
    }
    Some(y)
}

/// The exact integer group sums `sum_j q_j xq_j` of [`qmv_int`] under `scheme`, in order
/// `[row][output][group]`: what another backend's integer products (kiln-wgpu's) must
/// reproduce bit for bit. `None` where [`qmv_int`] is `None`.
pub fn qmv_int_group_sums(x: &[f32], m: usize, w: &QuantizedMatrix, scheme: ActScheme) -> Option<Vec<i32>> {
    if w.layout() != Layout::RowMajor {
        return qmv_int_group_sums(x, m, &w.to_row_major(), scheme);
    }
    let (n, k, g, bits) = (w.n(), w.k(), w.spec().group_size(), w.spec().bits());
    assert_eq!(x.len(), m * k);
    let codes = ActCodes::for_weight_bits(bits, scheme)?;
    let mut xq = vec![0i16; k];
    let mut sums = Vec::with_capacity(m * n * (k / g));
    for i in 0..m {
        for (xs, cs) in x[i * k..(i + 1) * k].chunks_exact(g).zip(xq.chunks_exact_mut(g)) {
            quantize_group(xs, codes.max_code(), cs);
        }
        for r in 0..n {
            let row = w.row_words(r);
            for gi in 0..k / g {
                let tot =
                    (gi * g..(gi + 1) * g).map(|j| read_code(row, j, bits) as i32 * i32::from(xq[j])).sum();
                sums.push(tot);
            }
        }
    }
    Some(sums)
}

/// One activation group's quantization under an integer scheme ([`act_groups`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ActGroup {
    /// The scale `max |x| / qmax` (0 for an all-zero group, NaN for a non-finite one).
    pub sx: f32,
    /// The group's sum, computed in f64 and rounded once.
    pub xsum: f32,
    /// The sum of its codes.
    pub qsum: i32,
}

/// How [`qmv_int`] quantizes `m` rows of `k` activations in groups of `g` for `bits`-bit
/// weights under `scheme`, per row and group: what another backend's quantizer (kiln-wgpu's)
/// must reproduce bit for bit. `None` where [`qmv_int`] is `None`.
pub fn act_groups(
    x: &[f32],
    m: usize,
    k: usize,
    g: usize,
    bits: u32,
    scheme: ActScheme,
) -> Option<Vec<ActGroup>> {
    assert_eq!(x.len(), m * k);
    let codes = ActCodes::for_weight_bits(bits, scheme)?;
    let mut xq = vec![0i16; g];
    Some(
        x.chunks_exact(g)
            .map(|xs| {
                let q = quantize_group(xs, codes.max_code(), &mut xq);
                ActGroup { sx: q.sx, xsum: q.xsum, qsum: q.qsum }
            })
            .collect(),
    )
}

/// The bits `qmv_wide` gives for `m` rows under `scheme`: [`qmv_int`] under
/// [`ActScheme::rows_scheme`]`(m)`, which differs from [`qmv_int`] under `scheme` only for
/// `int16-wide8` (`int8` codes from two rows on).
pub fn qmv_wide_int(x: &[f32], m: usize, w: &QuantizedMatrix, scheme: ActScheme) -> Option<Vec<f32>> {
    qmv_int(x, m, w, scheme.rows_scheme(m))
}

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
