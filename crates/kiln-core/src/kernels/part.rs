//! One product of a `qmv_many` call and its bias epilogue: what the dispatcher and every
//! path's many-product loop share.

use crate::matrix::QuantizedMatrix;

/// One product of a `qmv_many` call: `y = W x + bias`.
pub struct QmvPart<'a> {
    /// The weights `[n, k]`.
    pub w: &'a QuantizedMatrix,
    /// The output, `n` values.
    pub y: &'a mut [f32],
    /// Added to `y` (`n` values) by the task that computes each row.
    pub bias: Option<&'a [f32]>,
}

/// `out[i] += bias[rows][i]`, when there is a bias: the epilogue of `qmv_many`.
pub(crate) fn add_bias(bias: Option<&[f32]>, rows: std::ops::Range<usize>, out: &mut [f32]) {
    if let Some(b) = bias {
        for (o, &bv) in out.iter_mut().zip(&b[rows]) {
            *o += bv;
        }
    }
}
