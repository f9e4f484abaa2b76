//! The weights of a Llama-family decoder (dense or mixture-of-experts), as loaders
//! produce them and the forward pass consumes them. Every linear layer is either an MLX-quantized matrix or a dense f32
//! one, and runs through kiln-core's kernels, so the wide switch and the pool govern it.

use kiln_core::dense::{self, DenseMatrix};
use kiln_core::{Buffer, QuantizedMatrix, quantized_matmul};

use crate::forward::experts::ExpertStore;

/// The matrix of a linear layer, `W[N, K]`.
#[derive(Debug)]
pub enum LinearWeight {
    /// MLX affine quantized.
    Quantized(QuantizedMatrix),
    /// Unquantized, widened to f32.
    Dense(DenseMatrix),
}

impl LinearWeight {
    /// Output features.
    pub fn n(&self) -> usize {
        match self {
            LinearWeight::Quantized(q) => q.n(),
            LinearWeight::Dense(d) => d.n(),
        }
    }

    /// Input features.
    pub fn k(&self) -> usize {
        match self {
            LinearWeight::Quantized(q) => q.k(),
            LinearWeight::Dense(d) => d.k(),
        }
    }

    /// Bytes one full pass over the weights reads.
    pub fn bytes_read(&self) -> usize {
        match self {
            LinearWeight::Quantized(q) => q.bytes_read(),
            LinearWeight::Dense(d) => d.bytes_read(),
        }
    }

    /// `y[m, n] = x[m, k] W^T`.
    pub fn matmul(&self, x: &[f32], m: usize, y: &mut [f32]) {
        match self {
            LinearWeight::Quantized(q) => quantized_matmul(x, m, q, y),
            LinearWeight::Dense(d) => dense::matmul(x, m, d, y),
        }
    }

    /// Stores a quantized matrix as the CPU backend's kernels read it fastest
    /// (`kiln_core::kernels::store_for_cpu`); returns whether it is now in the lane-row
    /// layout.
    pub fn store_for_cpu(&mut self) -> bool {
        match self {
            LinearWeight::Quantized(q) => kiln_core::kernels::store_for_cpu(q),
            LinearWeight::Dense(_) => false,
        }
    }

    /// Row `r` of W, dequantized (an embedding lookup).
    pub fn row(&self, r: usize, out: &mut [f32]) {
        match self {
            LinearWeight::Quantized(q) => q.dequantize_row(r, out),
            LinearWeight::Dense(d) => out.copy_from_slice(d.row(r)),
        }
    }
}

/// A linear layer: `y = x W^T + b`.
#[derive(Debug)]
pub struct Linear {
    /// The matrix.
    pub weight: LinearWeight,
    /// Optional bias of length N.
    pub bias: Option<Buffer<f32>>,
}

impl Linear {
    /// `y[m, n] = x[m, k] W^T + b`.
    pub fn forward(&self, x: &[f32], m: usize, y: &mut [f32]) {
        self.weight.matmul(x, m, y);
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(b.len()) {
                for (v, &bv) in row.iter_mut().zip(b.iter()) {
                    *v += bv;
                }
            }
        }
    }

    /// Bytes one pass reads (weights and bias).
    pub fn bytes_read(&self) -> usize {
        self.weight.bytes_read() + self.bias.as_ref().map_or(0, |b| b.byte_len())
    }
}

/// RMSNorm with a learned per-channel weight.
#[derive(Debug)]
pub struct RmsNorm {
    /// Per-channel weight.
    pub weight: Buffer<f32>,
    /// Added to the mean square before the square root.
    pub eps: f32,
}

/// A SwiGLU MLP: `down(silu(gate(x)) * up(x))`.
#[derive(Debug)]
pub struct DenseMlp {
    /// SwiGLU gate.
    pub gate_proj: Linear,
    /// SwiGLU up.
    pub up_proj: Linear,
    /// SwiGLU down.
    pub down_proj: Linear,
}

impl DenseMlp {
    /// Bytes one pass reads.
    pub fn bytes_read(&self) -> usize {
        self.gate_proj.bytes_read() + self.up_proj.bytes_read() + self.down_proj.bytes_read()
    }
}

/// The resident part of a mixture-of-experts MLP; the routed experts themselves live in
/// the model's [`ExpertStore`].
#[derive(Debug)]
pub struct MoeMlp {
    /// The router `[experts, hidden]` (`mlp.gate`).
    pub router: Linear,
    /// Qwen2-MoE's shared expert, which every token runs.
    pub shared_expert: Option<DenseMlp>,
    /// The shared expert's sigmoid gate `[1, hidden]` (`mlp.shared_expert_gate`).
    pub shared_expert_gate: Option<Linear>,
}

/// The MLP of a layer.
// One per layer, built once and read in place: boxing either variant would add a
// pointer chase to every forward and save nothing worth having.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Mlp {
    /// One SwiGLU MLP.
    Dense(DenseMlp),
    /// A router over routed experts, plus an optional shared expert.
    Moe(MoeMlp),
}

impl Mlp {
    /// The dense MLP, when this is one.
    pub fn dense(&self) -> Option<&DenseMlp> {
        match self {
            Mlp::Dense(d) => Some(d),
            Mlp::Moe(_) => None,
        }
    }

    /// The dense MLP, mutably, when this is one.
    pub fn dense_mut(&mut self) -> Option<&mut DenseMlp> {
        match self {
            Mlp::Dense(d) => Some(d),
            Mlp::Moe(_) => None,
        }
    }

    /// Bytes one token reads from the resident part (the routed experts are counted by
    /// [`ModelWeights::bytes_read_per_token`]).
    pub fn bytes_read(&self) -> usize {
        match self {
            Mlp::Dense(d) => d.bytes_read(),
            Mlp::Moe(m) => {
                m.router.bytes_read()
                    + m.shared_expert.as_ref().map_or(0, DenseMlp::bytes_read)
                    + m.shared_expert_gate.as_ref().map_or(0, Linear::bytes_read)
            }
        }
    }
}

/// One decoder layer.
#[derive(Debug)]
pub struct Layer {
    /// Norm before attention.
    pub input_layernorm: RmsNorm,
    /// Query projection.
    pub q_proj: Linear,
    /// Key projection.
    pub k_proj: Linear,
    /// Value projection.
    pub v_proj: Linear,
    /// Attention output projection.
    pub o_proj: Linear,
    /// Per-head RMSNorm of the queries before RoPE (Qwen3), `[head_dim]`.
    pub q_norm: Option<RmsNorm>,
    /// Per-head RMSNorm of the keys before RoPE (Qwen3), `[head_dim]`.
    pub k_norm: Option<RmsNorm>,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm,
    /// The MLP.
    pub mlp: Mlp,
}

/// All weights of a decoder.
#[derive(Debug)]
pub struct ModelWeights {
    /// Token embedding `[vocab, hidden]`; also the LM head when `lm_head` is `None`.
    pub embed_tokens: LinearWeight,
    /// Decoder layers.
    pub layers: Vec<Layer>,
    /// Final norm.
    pub norm: RmsNorm,
    /// Separate LM head, or `None` when tied to the embedding.
    pub lm_head: Option<Linear>,
    /// The routed experts of a MoE model, every layer's, in their backing store.
    pub experts: Option<ExpertStore>,
}

impl ModelWeights {
    /// Stores every resident quantized matrix (every layer's projections, a MoE layer's
    /// router and shared expert, the LM head and the embedding) as the CPU backend's
    /// kernels read it fastest ([`LinearWeight::store_for_cpu`]), in place; returns how
    /// many are now in the lane-row layout. The routed experts stay row-major: their store
    /// copies them between tiers as rows.
    pub fn store_for_cpu(&mut self) -> usize {
        let mut ws: Vec<&mut LinearWeight> = vec![&mut self.embed_tokens];
        if let Some(h) = &mut self.lm_head {
            ws.push(&mut h.weight);
        }
        for l in &mut self.layers {
            for p in [&mut l.q_proj, &mut l.k_proj, &mut l.v_proj, &mut l.o_proj] {
                ws.push(&mut p.weight);
            }
            let (dense, router, gate) = match &mut l.mlp {
                Mlp::Dense(d) => (Some(d), None, None),
                Mlp::Moe(m) => (m.shared_expert.as_mut(), Some(&mut m.router), m.shared_expert_gate.as_mut()),
            };
            if let Some(d) = dense {
                for p in [&mut d.gate_proj, &mut d.up_proj, &mut d.down_proj] {
                    ws.push(&mut p.weight);
                }
            }
            ws.extend(router.into_iter().chain(gate).map(|p| &mut p.weight));
        }
        ws.into_iter().map(LinearWeight::store_for_cpu).filter(|&stored| stored).count()
    }

    /// Bytes one decode step reads from weights: every layer (for a MoE model, the
    /// top-k routed experts of each), the final norm, the LM head and one embedding row.
    pub fn bytes_read_per_token(&self) -> usize {
        let routed = self.experts.as_ref().map_or(0, |e| e.top_k() * e.expert_bytes());
        let per_layer: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj].iter().map(|p| p.bytes_read()).sum::<usize>()
                    + l.mlp.bytes_read()
                    + routed
                    + l.input_layernorm.weight.byte_len()
                    + l.post_attention_layernorm.weight.byte_len()
            })
            .sum();
        let head = match &self.lm_head {
            Some(h) => h.bytes_read(),
            None => self.embed_tokens.bytes_read(),
        };
        let embed_row = self.embed_tokens.bytes_read() / self.embed_tokens.n().max(1);
        per_layer + self.norm.weight.byte_len() + head + embed_row
    }
}
