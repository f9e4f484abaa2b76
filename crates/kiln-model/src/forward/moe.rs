//! The mixture-of-experts MLP of one layer: the router's softmax over the experts, the
//! top-k per row (renormalised with `norm_topk_prob`, always for Mixtral), each chosen
//! expert run once over the rows routed to it (M = those rows, through kiln-core's
//! quantized kernels), the outputs mixed by the routing weights, and Qwen2-MoE's shared
//! expert added behind its sigmoid gate.
//!
//! Experts run in ascending index order and each row's contributions are added in that
//! order, whether an expert comes from the backing store or from a cache slot, so the
//! cache never changes a result.

use kiln_core::quantized_matmul;

use crate::forward::expert_cache::ExpertCache;
use crate::forward::experts::{Expert, ExpertStore};
use crate::forward::ops::{add_in_place, silu_mul};
use crate::forward::weights::{DenseMlp, MoeMlp};
use crate::loading::config::MoeConfig;

/// Buffers one MoE MLP pass uses, each sized for the forward's rows.
pub(crate) struct MoeBufs<'a> {
    /// Router logits, then probabilities `[rows, experts]`.
    pub router: &'a mut [f32],
    /// The rows routed to one expert, gathered `[rows, hidden]`.
    pub xe: &'a mut [f32],
    /// One expert's output `[rows, hidden]`; then the shared expert's.
    pub ye: &'a mut [f32],
    /// Inner activations `[rows, mlp_width]`.
    pub gate: &'a mut [f32],
    /// Inner activations `[rows, mlp_width]`.
    pub up: &'a mut [f32],
}

/// The routing of one row: its top-k experts, ascending by index, and their weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    /// Expert indices, ascending.
    pub experts: Vec<usize>,
    /// The weight of each.
    pub weights: Vec<f32>,
}

/// Softmax over `logits`, the `top_k` largest probabilities (ties to the lower index),
/// renormalised to sum to one when `norm` is set.
pub fn route(logits: &[f32], top_k: usize, norm: bool) -> Route {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut p: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = p.iter().sum();
    for v in &mut p {
        *v /= sum;
    }
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    let mut experts: Vec<usize> = order[..top_k].to_vec();
    experts.sort_unstable();
    let mut weights: Vec<f32> = experts.iter().map(|&e| p[e]).collect();
    if norm {
        let s: f32 = weights.iter().sum();
        for w in &mut weights {
            *w /= s;
        }
    }
    Route { experts, weights }
}

/// Runs the MoE MLP of `layer` on `xn` (`[rows, hidden]`) into `out`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    mlp: &MoeMlp,
    cfg: &MoeConfig,
    store: &ExpertStore,
    mut cache: Option<&mut ExpertCache>,
    layer: usize,
    xn: &[f32],
    rows: usize,
    hidden: usize,
    out: &mut [f32],
    b: MoeBufs<'_>,
) {
    let e_count = cfg.experts;
    let router = &mut b.router[..rows * e_count];
    mlp.router.forward(xn, rows, router);
    let routes: Vec<Route> =
        router.chunks_exact(e_count).map(|l| route(l, cfg.top_k, cfg.norm_topk_prob)).collect();
    out[..rows * hidden].fill(0.0);
    let inter = cfg.expert_intermediate_size;
    let mut members: Vec<(usize, f32)> = Vec::with_capacity(rows);
    for e in 0..e_count {
        members.clear();
        for (r, route) in routes.iter().enumerate() {
            if let Some(j) = route.experts.iter().position(|&x| x == e) {
                members.push((r, route.weights[j]));
            }
        }
        if members.is_empty() {
            continue;
        }
        let m = members.len();
        for (i, &(r, _)) in members.iter().enumerate() {
            b.xe[i * hidden..(i + 1) * hidden].copy_from_slice(&xn[r * hidden..(r + 1) * hidden]);
        }
        let expert: &Expert = match cache.as_deref_mut() {
            Some(c) => c.get(store, layer, e),
            None => store.get(layer, e),
        };
        let (gate, up, ye) = (&mut b.gate[..m * inter], &mut b.up[..m * inter], &mut b.ye[..m * hidden]);
        quantized_matmul(&b.xe[..m * hidden], m, &expert.gate_proj, gate);
        quantized_matmul(&b.xe[..m * hidden], m, &expert.up_proj, up);
        silu_mul(gate, up);
        quantized_matmul(gate, m, &expert.down_proj, ye);
        for (i, &(r, w)) in members.iter().enumerate() {
            let dst = &mut out[r * hidden..(r + 1) * hidden];
            for (d, &y) in dst.iter_mut().zip(&ye[i * hidden..(i + 1) * hidden]) {
                *d += w * y;
            }
        }
    }
    if let (Some(shared), Some(gate_w)) = (&mlp.shared_expert, &mlp.shared_expert_gate) {
        let width = cfg.shared_expert_intermediate_size.unwrap_or(0);
        let ye = &mut b.ye[..rows * hidden];
        run_dense(shared, xn, rows, &mut b.gate[..rows * width], &mut b.up[..rows * width], ye);
        let g = &mut b.router[..rows];
        gate_w.forward(xn, rows, g);
        for (r, &gv) in g.iter().enumerate() {
            let s = 1.0 / (1.0 + (-gv).exp());
            for v in &mut ye[r * hidden..(r + 1) * hidden] {
                *v *= s;
            }
        }
        add_in_place(&mut out[..rows * hidden], ye);
    }
}

fn run_dense(mlp: &DenseMlp, x: &[f32], rows: usize, gate: &mut [f32], up: &mut [f32], out: &mut [f32]) {
    mlp.gate_proj.forward(x, rows, gate);
    mlp.up_proj.forward(x, rows, up);
    silu_mul(gate, up);
    mlp.down_proj.forward(gate, rows, out);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_pick_the_top_k_ascending_and_renormalise() {
        let r = route(&[0.0, 3.0, 1.0, 2.0], 2, false);
        assert_eq!(r.experts, vec![1, 3]);
        let z: f32 = [0.0f32, 3.0, 1.0, 2.0].iter().map(|v| (v - 3.0).exp()).sum();
        assert!((r.weights[0] - 1.0 / z).abs() < 1e-6);
        let n = route(&[0.0, 3.0, 1.0, 2.0], 2, true);
        assert!((n.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(n.weights[0] > n.weights[1]);
        // Ties go to the lower index.
        assert_eq!(route(&[1.0, 1.0, 1.0], 2, true).experts, vec![0, 1]);
    }
}
