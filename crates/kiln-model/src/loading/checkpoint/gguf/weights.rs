//! A GGUF file's tensors to [`ModelWeights`]: 1-D tensors widened to f32, matrices in
//! their kiln form (dense f32, or MLX-affine groups of 32 repacked exactly from the
//! blocks, `tensors.rs`), llama's Q and K rows put back in Hugging Face's order.

use half::f16;
use kiln_core::{Buffer, DenseMatrix, MemoryPool, QuantSpec, QuantizedMatrix, ScaleData, SharedBytes, Tag};
use rayon::prelude::*;

use super::meta::{Gguf, Parsed};
use super::tensors::{self, Form, GROUP};
use crate::error::{ModelError, Result};
use crate::forward::weights::{DenseMlp, Layer, Linear, LinearWeight, Mlp, ModelWeights, RmsNorm};

/// Bytes a tensor of `form` with `n` rows of `k` takes in the pool.
pub(super) fn pool_bytes(form: Form, n: usize, k: usize) -> u64 {
    let (n, k) = (n as u64, k as u64);
    match form {
        Form::Dense => n * k * 4,
        Form::Quantized { bits, f32_scales } => {
            n * k * u64::from(bits) / 8 + 2 * (n * k / GROUP as u64) * if f32_scales { 4 } else { 2 }
        }
    }
}

/// Which rows of a stored matrix feed each row of kiln's: identity, or llama.cpp's Q/K
/// permutation undone for `heads` heads.
#[derive(Clone, Copy)]
pub(super) enum Rows {
    Same,
    Unpermute { heads: usize },
}

impl Rows {
    /// The stored row holding kiln's row `r` of `n`.
    fn source(self, r: usize, n: usize) -> usize {
        match self {
            Rows::Same => r,
            Rows::Unpermute { heads } => {
                // llama.cpp stores row h*hd + 2a + b where Hugging Face has h*hd + b*hd/2 + a.
                let hd = n / heads;
                let (h, i) = (r / hd, r % hd);
                let (b, a) = (i / (hd / 2), i % (hd / 2));
                h * hd + 2 * a + b
            }
        }
    }
}

/// Every weight of the decoder, repacked from the mapped file into pool-counted buffers.
pub(super) fn build(g: &Gguf, pool: &MemoryPool) -> Result<ModelWeights> {
    let c = &g.config;
    let permuted = c.architecture == crate::loading::config::Architecture::Llama;
    let (q_rows, k_rows) = if permuted {
        (Rows::Unpermute { heads: c.num_attention_heads }, Rows::Unpermute { heads: c.num_key_value_heads })
    } else {
        (Rows::Same, Rows::Same)
    };
    let matrix = |name: &str, rows: Rows| matrix(g, pool, name, rows);
    let vector = |name: &str, rows: Rows| vector(g, pool, name, rows);
    let norm = |name: &str| -> Result<RmsNorm> {
        Ok(RmsNorm { weight: vector(name, Rows::Same)?, eps: c.rms_norm_eps })
    };
    let linear = |base: &str, bias: bool, rows: Rows| -> Result<Linear> {
        Ok(Linear {
            weight: matrix(&format!("{base}.weight"), rows)?,
            bias: if bias { Some(vector(&format!("{base}.bias"), rows)?) } else { None },
        })
    };
    let embed_tokens = matrix("token_embd.weight", Rows::Same)?;
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for i in 0..c.num_hidden_layers {
        let b = |s: &str| format!("blk.{i}.{s}");
        layers.push(Layer {
            input_layernorm: norm(&b("attn_norm.weight"))?,
            q_proj: linear(&b("attn_q"), c.attention_bias, q_rows)?,
            k_proj: linear(&b("attn_k"), c.attention_bias, k_rows)?,
            v_proj: linear(&b("attn_v"), c.attention_bias, Rows::Same)?,
            o_proj: linear(&b("attn_output"), c.o_proj_bias, Rows::Same)?,
            q_norm: None,
            k_norm: None,
            post_attention_layernorm: norm(&b("ffn_norm.weight"))?,
            mlp: Mlp::Dense(DenseMlp {
                gate_proj: linear(&b("ffn_gate"), false, Rows::Same)?,
                up_proj: linear(&b("ffn_up"), false, Rows::Same)?,
                down_proj: linear(&b("ffn_down"), false, Rows::Same)?,
            }),
        });
    }
    let norm = norm("output_norm.weight")?;
    let lm_head = if g.tensors.contains_key("output.weight") {
        Some(Linear { weight: matrix("output.weight", Rows::Same)?, bias: None })
    } else {
        None
    };
    Ok(ModelWeights { embed_tokens, layers, norm, lm_head, experts: None })
}

/// A 1-D float tensor widened to f32, rows reordered by `rows`.
fn vector(g: &Parsed, pool: &MemoryPool, name: &str, rows: Rows) -> Result<Buffer<f32>> {
    let t = g.tensor(name)?;
    let n = t.dims[0] as usize;
    let mut flat = vec![0f32; n];
    tensors::widen_row(t.ty, &g.file.bytes()[t.start..t.end], &mut flat);
    let mut v = pool.alloc_zeroed::<f32>(Tag::Weights, n)?;
    for (r, o) in v.iter_mut().enumerate() {
        *o = flat[rows.source(r, n)];
    }
    Ok(Buffer::from_pool(v))
}

/// A matrix in its kiln form, rows reordered by `rows`.
pub(super) fn matrix(g: &Parsed, pool: &MemoryPool, name: &str, rows: Rows) -> Result<LinearWeight> {
    let t = g.tensor(name)?;
    let (k, n) = (t.dims[0] as usize, t.dims[1] as usize);
    let data = &g.file.bytes()[t.start..t.end];
    let row_bytes = data.len() / n;
    let src = |r: usize| &data[rows.source(r, n) * row_bytes..][..row_bytes];
    match t.ty.kiln_form().map_err(|m| g.error(format!("tensor {name}: {m}")))? {
        Form::Dense => {
            let mut v = pool.alloc_zeroed::<f32>(Tag::Weights, n * k)?;
            v.par_chunks_mut(k).enumerate().for_each(|(r, out)| tensors::widen_row(t.ty, src(r), out));
            Ok(LinearWeight::Dense(DenseMatrix::new(n, k, Buffer::from_pool(v))))
        }
        Form::Quantized { bits, f32_scales } => {
            let spec = QuantSpec::new(bits, GROUP)
                .map_err(|cause| ModelError::Geometry { tensor: name.to_string(), cause })?;
            let (wpr, gpr) = (spec.words_per_row(k), spec.groups_per_row(k));
            let mut packed = pool.alloc_zeroed::<u32>(Tag::Weights, n * wpr)?;
            // Scales and biases are decoded to f32 first (counted while they live), then
            // stored in their final dtype.
            let _transient = pool.reserve(Tag::Weights, (2 * n * gpr * 4) as u64)?;
            let mut row_scales = vec![0f32; n * gpr];
            let mut row_biases = vec![0f32; n * gpr];
            packed
                .par_chunks_mut(wpr)
                .zip(row_scales.par_chunks_mut(gpr))
                .zip(row_biases.par_chunks_mut(gpr))
                .enumerate()
                .for_each(|(r, ((words, sc), bi))| {
                    let mut codes = Vec::with_capacity(k);
                    let mut gi = 0;
                    tensors::decode_row(t.ty, src(r), |grp| {
                        codes.extend_from_slice(&grp.codes);
                        sc[gi] = grp.scale;
                        bi[gi] = grp.bias;
                        gi += 1;
                    });
                    tensors::pack_codes(codes.into_iter(), bits, words);
                });
            let (scales, biases) = if f32_scales {
                let mut scales = pool.alloc_zeroed::<f32>(Tag::Weights, n * gpr)?;
                let mut biases = pool.alloc_zeroed::<f32>(Tag::Weights, n * gpr)?;
                scales.copy_from_slice(&row_scales);
                biases.copy_from_slice(&row_biases);
                (ScaleData::F32(Buffer::from_pool(scales)), ScaleData::F32(Buffer::from_pool(biases)))
            } else {
                let mut scales = pool.alloc_zeroed::<f16>(Tag::Weights, n * gpr)?;
                let mut biases = pool.alloc_zeroed::<f16>(Tag::Weights, n * gpr)?;
                for (i, (&s, &b)) in row_scales.iter().zip(&row_biases).enumerate() {
                    let (hs, hb) = (f16::from_f32(s), f16::from_f32(b));
                    if hs.to_f32() != s || hb.to_f32() != b {
                        return Err(g.error(format!(
                            "tensor {name}: group {i}'s scale {s} or bias {b} is not exact in f16 \
                             (the block scale is too large for kiln's exact form)"
                        )));
                    }
                    scales[i] = hs;
                    biases[i] = hb;
                }
                (ScaleData::F16(Buffer::from_pool(scales)), ScaleData::F16(Buffer::from_pool(biases)))
            };
            let q = QuantizedMatrix::new(n, k, spec, Buffer::from_pool(packed), scales, biases)
                .map_err(|cause| ModelError::Geometry { tensor: name.to_string(), cause })?;
            Ok(LinearWeight::Quantized(q))
        }
    }
}
