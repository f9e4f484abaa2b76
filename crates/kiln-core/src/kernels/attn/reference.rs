//! The scalar reference for decode attention, and the rounding bound the fast paths are
//! held to.
//!
//! [`attend`] is the textbook two-pass softmax in f64 over the very values the cache
//! holds (an f16 cache's values are exact in f32 and f64), so its result is exact to far
//! below f32 rounding and independent of the online formulation the kernels use.
//! [`error_bound`] is what f32 arithmetic may cost a kernel on the same input.

use crate::math::EXP_REL_ERROR;

use super::DecodeShape;

/// f32 unit roundoff, `2^-24`.
const U: f64 = 1.0 / 16_777_216.0;

/// `gamma(n) = n u / (1 - n u)`: the relative error bound of an n-term f32 sum or dot
/// product in any order.
fn gamma(n: usize) -> f64 {
    let nu = n as f64 * U;
    nu / (1.0 - nu)
}

/// The scores `scale * q_j . k_t` in f64, `[group, n]`.
fn scores(shape: &DecodeShape, q: &[f32], keys: &[f32]) -> Vec<f64> {
    let hd = shape.head_dim;
    let n = keys.len() / hd;
    let mut s = Vec::with_capacity(shape.group * n);
    for qj in q.chunks_exact(hd).take(shape.group) {
        for kt in keys.chunks_exact(hd) {
            let d: f64 = qj.iter().zip(kt).map(|(&a, &b)| a as f64 * b as f64).sum();
            s.push(shape.scale as f64 * d);
        }
    }
    s
}

/// Softmax-weighted values: `out[j, d] = sum_t p_jt v_td / sum_t p_jt` with
/// `p_jt = e^(s_jt - max_t s_jt)`, for queries `q` (`[group, head_dim]`) over `keys` and
/// `values` (`[n, head_dim]` each, `n >= 1`). Returns `[group, head_dim]`.
pub fn attend(shape: &DecodeShape, q: &[f32], keys: &[f32], values: &[f32]) -> Vec<f64> {
    let hd = shape.head_dim;
    let n = keys.len() / hd;
    assert!(n >= 1 && values.len() == keys.len(), "reference::attend: needs n >= 1 keys and as many values");
    let s = scores(shape, q, keys);
    let mut out = vec![0f64; shape.group * hd];
    for (j, sj) in s.chunks_exact(n).enumerate() {
        let mx = sj.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = sj.iter().map(|&x| (x - mx).exp()).collect();
        let total: f64 = p.iter().sum();
        let o = &mut out[j * hd..(j + 1) * hd];
        for (pt, vt) in p.iter().zip(values.chunks_exact(hd)) {
            for (od, &v) in o.iter_mut().zip(vt) {
                *od += pt * v as f64;
            }
        }
        for od in o {
            *od /= total;
        }
    }
    out
}

/// Per output value, how far an f32 kernel may land from [`attend`] on the same input,
/// when each query head's weights went through at most `rescales` corrections (tiles
/// folded plus states merged).
///
/// Derivation, first order in the unit roundoff `u = 2^-24`. A score is a `head_dim`-term
/// dot product and a scaling, so its absolute error is at most
/// `E_t = gamma(head_dim + 1) * scale * sum_i |q_i k_ti|`, which becomes a relative error
/// `e^(E_t) - 1` of its weight. Each weight also passes through at most `1 + rescales`
/// evaluations of `exp`, each off by [`EXP_REL_ERROR`] plus `u` times its argument (a
/// difference of scores, at most the score range `D`), and a product rounding `u`. So
/// every weight is within a relative `rho` of exact, and the normalised sum
/// `sum_t p_t v_t / sum_t p_t` within `2 rho A_d`, where `A_d = sum_t p_t |v_td| / sum_t p_t`;
/// the two n-term sums add `gamma(n + rescales) A_d` each and the final division `u |o_d|`.
pub fn error_bound(
    shape: &DecodeShape,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    rescales: usize,
) -> Vec<f64> {
    let hd = shape.head_dim;
    let n = keys.len() / hd;
    let s = scores(shape, q, keys);
    let exact = attend(shape, q, keys, values);
    let mut bound = vec![0f64; shape.group * hd];
    for (j, sj) in s.chunks_exact(n).enumerate() {
        let qj = &q[j * hd..(j + 1) * hd];
        let score_err = keys
            .chunks_exact(hd)
            .map(|kt| {
                let mag: f64 = qj.iter().zip(kt).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                (gamma(hd + 1) * shape.scale as f64 * mag).exp_m1()
            })
            .fold(0f64, f64::max);
        let mx = sj.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let mn = sj.iter().cloned().fold(f64::INFINITY, f64::min);
        let range = mx - mn;
        let per_exp = EXP_REL_ERROR + U * range + U;
        let rho = score_err + (1 + rescales) as f64 * per_exp;
        let p: Vec<f64> = sj.iter().map(|&x| (x - mx).exp()).collect();
        let total: f64 = p.iter().sum();
        for d in 0..hd {
            let a: f64 =
                p.iter().zip(values.chunks_exact(hd)).map(|(pt, vt)| pt * (vt[d] as f64).abs()).sum::<f64>()
                    / total;
            let o = exact[j * hd + d].abs();
            bound[j * hd + d] = (2.0 * rho + 2.0 * gamma(n + rescales)) * a + U * o;
        }
    }
    bound
}
