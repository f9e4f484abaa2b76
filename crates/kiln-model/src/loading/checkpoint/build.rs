//! Materializes a [`Plan`] into [`ModelWeights`], step by step in the plan's order, so the
//! pool's peak under the weights tag is exactly [`Plan::peak_bytes`].

use std::collections::VecDeque;

use half::{bf16, f16};
use kiln_core::quantize::quantize_as;
use kiln_core::{
    Buffer, DenseMatrix, MemoryPool, PoolVec, QuantSpec, QuantizedMatrix, ScaleData, ScaleDtype, Tag,
};
use rayon::prelude::*;

use super::plan::{LinearPlan, MatrixPlan, Plan, Step, chunk_rows};
use super::tensor::TensorReader;
use crate::error::{ModelError, Result};
use crate::forward::experts::{Expert, ExpertStore};
use crate::forward::weights::{DenseMlp, Layer, Linear, LinearWeight, Mlp, ModelWeights, MoeMlp, RmsNorm};
use crate::loading::config::ModelConfig;

/// Loads every step of `plan` and assembles the decoder.
pub(crate) fn build(plan: Plan, config: &ModelConfig, reader: &TensorReader<'_>) -> Result<ModelWeights> {
    let mut next = Assembler { linears: VecDeque::new(), vectors: VecDeque::new(), eps: config.rms_norm_eps };
    for step in &plan.steps {
        match step {
            Step::Vector(v) => next.vectors.push_back(reader.f32s(&v.name, &v.tensor)?),
            Step::Linear(l) => next.linears.push_back(linear(l, reader)?),
        }
    }
    let embed_tokens = next.linear()?.weight;
    let mut layers = Vec::with_capacity(config.num_hidden_layers);
    let mut experts = Vec::new();
    for _ in 0..config.num_hidden_layers {
        layers.push(Layer {
            input_layernorm: next.norm()?,
            q_proj: next.linear()?,
            k_proj: next.linear()?,
            v_proj: next.linear()?,
            o_proj: next.linear()?,
            q_norm: if config.qk_norm { Some(next.norm()?) } else { None },
            k_norm: if config.qk_norm { Some(next.norm()?) } else { None },
            post_attention_layernorm: next.norm()?,
            mlp: match &config.moe {
                None => Mlp::Dense(next.dense_mlp()?),
                Some(moe) => {
                    let mlp = MoeMlp {
                        router: next.linear()?,
                        shared_expert: match moe.shared_expert_intermediate_size {
                            Some(_) => Some(next.dense_mlp()?),
                            None => None,
                        },
                        shared_expert_gate: match moe.shared_expert_intermediate_size {
                            Some(_) => Some(next.linear()?),
                            None => None,
                        },
                    };
                    for _ in 0..moe.experts {
                        experts.push(Expert {
                            gate_proj: next.quantized()?,
                            up_proj: next.quantized()?,
                            down_proj: next.quantized()?,
                        });
                    }
                    Mlp::Moe(mlp)
                }
            },
        });
    }
    let norm = next.norm()?;
    let lm_head = if config.tie_word_embeddings { None } else { Some(next.linear()?) };
    let experts = match &config.moe {
        Some(moe) => Some(ExpertStore::new(config.num_hidden_layers, moe.experts, moe.top_k, experts)?),
        None => None,
    };
    Ok(ModelWeights { embed_tokens, layers, norm, lm_head, experts })
}

/// Hands out built layers and norm weights in plan order; running short would be a bug in
/// the plan (`plan_load`), reported rather than panicking.
struct Assembler {
    linears: VecDeque<Linear>,
    vectors: VecDeque<Buffer<f32>>,
    eps: f32,
}

impl Assembler {
    fn out_of_order() -> ModelError {
        ModelError::InvalidArgument {
            what: "load plan".into(),
            message: "fewer steps than the decoder has layers: this is a bug in kiln's checkpoint planner"
                .into(),
        }
    }

    fn linear(&mut self) -> Result<Linear> {
        self.linears.pop_front().ok_or_else(Self::out_of_order)
    }

    fn dense_mlp(&mut self) -> Result<DenseMlp> {
        Ok(DenseMlp { gate_proj: self.linear()?, up_proj: self.linear()?, down_proj: self.linear()? })
    }

    /// A routed expert's matrix, which the plan only ever makes quantized.
    fn quantized(&mut self) -> Result<QuantizedMatrix> {
        match self.linear()? {
            Linear { weight: LinearWeight::Quantized(q), bias: None } => Ok(q),
            _ => Err(Self::out_of_order()),
        }
    }

    fn norm(&mut self) -> Result<RmsNorm> {
        let weight = self.vectors.pop_front().ok_or_else(Self::out_of_order)?;
        Ok(RmsNorm { weight, eps: self.eps })
    }
}

fn linear(l: &LinearPlan, reader: &TensorReader<'_>) -> Result<Linear> {
    let w = |suffix: &str| format!("{}.{suffix}", l.module);
    let weight = match &l.matrix {
        MatrixPlan::Quantized { spec, weight, scales, biases } => {
            let packed = reader.u32s(&w("weight"), weight)?;
            let scales = reader.scales(&w("scales"), scales)?;
            let biases = reader.scales(&w("biases"), biases)?;
            let q = QuantizedMatrix::new(l.n, l.k, *spec, packed, scales, biases)
                .map_err(|cause| ModelError::Geometry { tensor: l.module.clone(), cause })?;
            LinearWeight::Quantized(q)
        }
        MatrixPlan::Dense { weight } => {
            LinearWeight::Dense(DenseMatrix::new(l.n, l.k, reader.f32s(&w("weight"), weight)?))
        }
        MatrixPlan::QuantizeOnLoad { weight, spec, scale_dtype } => {
            LinearWeight::Quantized(quantize_on_load(l, weight, *spec, *scale_dtype, reader)?)
        }
    };
    let bias = match &l.bias {
        Some(b) => Some(reader.f32s(&w("bias"), b)?),
        None => None,
    };
    Ok(Linear { weight, bias })
}

/// Quantizes a float matrix a chunk of rows at a time. MLX quantizes each row on its own,
/// so the result is the same as quantizing the whole matrix with `quantize_as`, which
/// reproduces `mlx.core.quantize` for the source dtype.
fn quantize_on_load(
    l: &LinearPlan,
    weight: &super::safetensors::TensorRef,
    spec: QuantSpec,
    dtype: ScaleDtype,
    reader: &TensorReader<'_>,
) -> Result<QuantizedMatrix> {
    let (n, k) = (l.n, l.k);
    let name = format!("{}.weight", l.module);
    let words_per_row = spec.words_per_row(k);
    let groups_per_row = spec.groups_per_row(k);
    let pool = reader.pool;
    let mut packed = pool.alloc_zeroed::<u32>(Tag::Weights, n * words_per_row)?;
    let mut scales = ScaleOut::new(pool, dtype, n * groups_per_row)?;
    let mut biases = ScaleOut::new(pool, dtype, n * groups_per_row)?;
    let rows = chunk_rows(n, k);
    // The widened rows and the quantizer's temporaries, as Plan::peak_bytes counts them.
    let _transient = pool.reserve(Tag::Weights, 2 * (rows * k * 4) as u64)?;
    let mut widened = vec![0f32; rows * k];
    let mut r0 = 0;
    while r0 < n {
        let r = rows.min(n - r0);
        let chunk = &mut widened[..r * k];
        reader.widen(&name, weight, r0 * k, chunk)?;
        // Rows quantize independently: split the chunk across threads.
        let per_task = r.div_ceil(rayon::current_num_threads()).max(1);
        let parts = chunk
            .par_chunks(per_task * k)
            .map(|rows| quantize_as(rows, rows.len() / k, k, spec, dtype))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|cause| ModelError::Geometry { tensor: l.module.clone(), cause })?;
        let mut at = r0;
        for q in &parts {
            packed[at * words_per_row..(at + q.n()) * words_per_row].copy_from_slice(q.packed());
            scales.fill(at * groups_per_row, q.scales());
            biases.fill(at * groups_per_row, q.biases());
            at += q.n();
        }
        r0 += r;
    }
    QuantizedMatrix::new(n, k, spec, Buffer::from_pool(packed), scales.into_data(), biases.into_data())
        .map_err(|cause| ModelError::Geometry { tensor: l.module.clone(), cause })
}

/// Pool-counted storage for scales or biases in their final dtype.
enum ScaleOut {
    F32(PoolVec<f32>),
    F16(PoolVec<f16>),
    Bf16(PoolVec<bf16>),
}

impl ScaleOut {
    fn new(pool: &MemoryPool, dtype: ScaleDtype, len: usize) -> Result<Self> {
        Ok(match dtype {
            ScaleDtype::F32 => ScaleOut::F32(pool.alloc_zeroed(Tag::Weights, len)?),
            ScaleDtype::F16 => ScaleOut::F16(pool.alloc_zeroed(Tag::Weights, len)?),
            ScaleDtype::Bf16 => ScaleOut::Bf16(pool.alloc_zeroed(Tag::Weights, len)?),
        })
    }

    /// Copies `src` (already in this dtype, so the round trip through f32 is exact) to
    /// positions `at..`.
    fn fill(&mut self, at: usize, src: &ScaleData) {
        let len = src.len();
        match self {
            ScaleOut::F32(v) => v[at..at + len].iter_mut().enumerate().for_each(|(i, o)| *o = src.get(i)),
            ScaleOut::F16(v) => {
                v[at..at + len].iter_mut().enumerate().for_each(|(i, o)| *o = f16::from_f32(src.get(i)))
            }
            ScaleOut::Bf16(v) => {
                v[at..at + len].iter_mut().enumerate().for_each(|(i, o)| *o = bf16::from_f32(src.get(i)))
            }
        }
    }

    fn into_data(self) -> ScaleData {
        match self {
            ScaleOut::F32(v) => ScaleData::F32(Buffer::from_pool(v)),
            ScaleOut::F16(v) => ScaleData::F16(Buffer::from_pool(v)),
            ScaleOut::Bf16(v) => ScaleData::Bf16(Buffer::from_pool(v)),
        }
    }
}
