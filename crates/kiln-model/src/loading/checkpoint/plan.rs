//! The load plan: which tensors a decoder needs (named as Hugging Face and mlx-lm write
//! them), how each is stored (an MLX-quantized triple, a float matrix run as is, or a
//! float matrix to quantize on load), checked against `config.json`, and the bytes each
//! will hold in the pool. `inspect` stops here; `load` materializes the plan in order, so
//! the estimate and the load agree by construction.

use kiln_core::{QuantSpec, ScaleDtype, validate_geometry};
use safetensors::Dtype;

use super::safetensors::{Checkpoint, TensorRef};
use crate::error::{ModelError, Result};
use crate::loading::config::ModelConfig;

/// Widened rows of a matrix quantized on load are processed this many bytes at a time, so
/// quantizing a large embedding never holds a full f32 copy of it.
pub(crate) const QUANTIZE_CHUNK_BYTES: usize = 4 << 20;

/// How a linear layer's matrix is stored and what kiln makes of it.
#[derive(Debug)]
pub(crate) enum MatrixPlan {
    /// An MLX-quantized `.weight` / `.scales` / `.biases` triple, used as stored.
    Quantized {
        /// Width and group size.
        spec: QuantSpec,
        /// Packed codes, U32 `[n, k * bits / 32]`.
        weight: TensorRef,
        /// Per-group scales `[n, k / group_size]`.
        scales: TensorRef,
        /// Per-group biases `[n, k / group_size]`.
        biases: TensorRef,
    },
    /// A float matrix widened to f32 (viewed in place when stored as aligned f32).
    Dense {
        /// The matrix `[n, k]`.
        weight: TensorRef,
    },
    /// A float matrix quantized on load, as `mlx.core.quantize` would for its dtype.
    QuantizeOnLoad {
        /// The matrix `[n, k]`.
        weight: TensorRef,
        /// Width and group size to quantize to.
        spec: QuantSpec,
        /// Dtype of the scales and biases: the source dtype, as MLX keeps it.
        scale_dtype: ScaleDtype,
    },
}

/// One linear layer (or the embedding, which is a linear layer read by rows).
#[derive(Debug)]
pub(crate) struct LinearPlan {
    /// Module path, such as `model.layers.0.self_attn.q_proj`.
    pub module: String,
    /// Output features.
    pub n: usize,
    /// Input features.
    pub k: usize,
    /// The matrix.
    pub matrix: MatrixPlan,
    /// The `.bias` vector of length n, when the layer has one.
    pub bias: Option<TensorRef>,
}

/// A vector widened to f32 (norm weights).
#[derive(Debug)]
pub(crate) struct VectorPlan {
    /// Tensor name.
    pub name: String,
    /// The stored tensor.
    pub tensor: TensorRef,
}

/// One step of the load, in the order `load` performs them.
#[derive(Debug)]
pub(crate) enum Step {
    /// A linear layer or the embedding.
    Linear(LinearPlan),
    /// A norm weight.
    Vector(VectorPlan),
}

/// Every step of loading a checkpoint, in order: embedding; per layer the input norm,
/// q, k, v, o, the q and k norms (Qwen3-MoE), the post-attention norm, then the dense
/// MLP's gate, up, down, or a mixture of experts' steps (`moe.rs`: the router, the shared
/// expert and its gate, and every routed expert's gate, up, down); the final norm; the
/// LM head when it is not tied to the embedding.
#[derive(Debug)]
pub(crate) struct Plan {
    /// The steps.
    pub steps: Vec<Step>,
    /// Bytes of one expert cache slot for the routed experts as they will load (packed
    /// words, scales and biases of gate, up and down, each part aligned as a slot aligns
    /// it); `None` for a dense model.
    pub expert_slot_bytes: Option<u64>,
}

impl Plan {
    /// The most bytes loading holds under the weights tag at once: what each step keeps,
    /// accumulated, plus the temporaries of the step in progress.
    pub(crate) fn peak_bytes(&self) -> u64 {
        let mut held = 0u64;
        let mut peak = 0u64;
        for s in &self.steps {
            peak = peak.max(held + s.kept_bytes() + s.transient_bytes());
            held += s.kept_bytes();
        }
        peak
    }
}

impl LinearPlan {
    /// Bytes an expert cache slot holds of this matrix: its packed words, scales and
    /// biases, each rounded up to `align`; `None` for a float matrix, which no slot holds.
    pub(crate) fn slot_bytes(&self, align: usize) -> Option<u64> {
        let (words, scales, biases) = match &self.matrix {
            MatrixPlan::Quantized { weight, scales, biases, .. } => {
                (weight.byte_len(), scales.byte_len(), biases.byte_len())
            }
            MatrixPlan::QuantizeOnLoad { spec, scale_dtype, .. } => {
                let groups = self.n * spec.groups_per_row(self.k) * scale_dtype.size();
                (self.n * spec.words_per_row(self.k) * 4, groups, groups)
            }
            MatrixPlan::Dense { .. } => return None,
        };
        Some([words, scales, biases].iter().map(|b| b.next_multiple_of(align) as u64).sum())
    }
}

impl Step {
    /// Bytes this step leaves in the pool.
    pub(crate) fn kept_bytes(&self) -> u64 {
        match self {
            Step::Vector(v) => f32_bytes(&v.tensor),
            Step::Linear(l) => {
                let m = match &l.matrix {
                    MatrixPlan::Quantized { weight, scales, biases, .. } => {
                        (weight.byte_len() + scales.byte_len() + biases.byte_len()) as u64
                    }
                    MatrixPlan::Dense { weight } => f32_bytes(weight),
                    MatrixPlan::QuantizeOnLoad { spec, scale_dtype, .. } => {
                        let words = l.n * spec.words_per_row(l.k);
                        let groups = l.n * spec.groups_per_row(l.k);
                        (words * 4 + 2 * groups * scale_dtype.size()) as u64
                    }
                };
                m + l.bias.as_ref().map_or(0, f32_bytes)
            }
        }
    }

    /// Bytes this step holds only while it runs: for a matrix quantized on load, one chunk
    /// of widened rows, counted twice to cover the quantizer's own temporaries (packed
    /// codes and f32 scales and biases, together less than the widened rows).
    pub(crate) fn transient_bytes(&self) -> u64 {
        match self {
            Step::Linear(LinearPlan { matrix: MatrixPlan::QuantizeOnLoad { .. }, n, k, .. }) => {
                2 * (chunk_rows(*n, *k) * k * 4) as u64
            }
            _ => 0,
        }
    }
}

/// Rows of an `[n, k]` matrix widened at once when quantizing on load.
pub(crate) fn chunk_rows(n: usize, k: usize) -> usize {
    (QUANTIZE_CHUNK_BYTES / (k * 4).max(1)).clamp(1, n.max(1))
}

fn f32_bytes(t: &TensorRef) -> u64 {
    t.elements() as u64 * 4
}

/// The scale dtype matching a float source dtype.
pub(crate) fn scale_dtype_of(d: Dtype) -> Option<ScaleDtype> {
    match d {
        Dtype::F32 => Some(ScaleDtype::F32),
        Dtype::F16 => Some(ScaleDtype::F16),
        Dtype::BF16 => Some(ScaleDtype::Bf16),
        _ => None,
    }
}

/// Finds and checks the tensors of each step.
pub(crate) struct Planner<'a> {
    pub(crate) config: &'a ModelConfig,
    pub(crate) ck: &'a Checkpoint,
    pub(crate) quantize: Option<QuantSpec>,
}

impl Planner<'_> {
    pub(crate) fn error(&self, t: &TensorRef, message: String) -> ModelError {
        ModelError::Checkpoint { path: self.ck.path(t).to_path_buf(), message }
    }

    pub(crate) fn require(&self, name: &str, what: &str) -> Result<TensorRef> {
        self.ck.get(name).cloned().ok_or_else(|| ModelError::Checkpoint {
            path: self.ck.origin().to_path_buf(),
            message: format!(
                "missing tensor {name} ({what}); the weights are in {}",
                self.ck.describe_files()
            ),
        })
    }

    pub(crate) fn expect_shape(&self, name: &str, t: &TensorRef, want: &[usize], why: &str) -> Result<()> {
        if t.shape != want {
            return Err(
                self.error(t, format!("tensor {name} has shape {:?}, expected {want:?} ({why})", t.shape))
            );
        }
        Ok(())
    }

    fn expect_float(&self, name: &str, t: &TensorRef, hint: &str) -> Result<()> {
        if scale_dtype_of(t.dtype).is_none() {
            return Err(self.error(
                t,
                format!("tensor {name} has dtype {:?}, expected F32, F16 or BF16{hint}", t.dtype),
            ));
        }
        Ok(())
    }

    pub(crate) fn vector(&self, name: &str, len: usize) -> Result<VectorPlan> {
        self.vector_of(name, len, "hidden_size in config.json")
    }

    /// A norm weight of `len` elements, `why` naming the config field that sets `len`.
    pub(crate) fn vector_of(&self, name: &str, len: usize, why: &str) -> Result<VectorPlan> {
        let tensor = self.require(name, &format!("a vector of {len} ({why})"))?;
        self.expect_float(name, &tensor, "")?;
        self.expect_shape(name, &tensor, &[len], why)?;
        Ok(VectorPlan { name: name.to_string(), tensor })
    }

    pub(crate) fn linear(&self, module: &str, n: usize, k: usize, has_bias: bool) -> Result<LinearPlan> {
        let weight_name = format!("{module}.weight");
        let weight = self.require(&weight_name, &format!("a [{n}, {k}] matrix"))?;
        let quant = |suffix: &str| self.ck.get(&format!("{module}.{suffix}")).cloned();
        let matrix = self.matrix(module, n, k, weight, quant("scales"), quant("biases"))?;
        let bias_name = format!("{module}.bias");
        let bias = if has_bias {
            let b = self.require(&bias_name, &format!("a bias of length {n}"))?;
            self.expect_float(&bias_name, &b, "")?;
            self.expect_shape(&bias_name, &b, &[n], "the layer's output features")?;
            Some(b)
        } else if let Some(b) = self.ck.get(&bias_name) {
            return Err(self.error(
                b,
                format!(
                    "tensor {bias_name} is present but config.json gives {module} no bias \
                     (attention_bias / mlp_bias, or the architecture's default): kiln would \
                     ignore it and compute something else"
                ),
            ));
        } else {
            None
        };
        Ok(LinearPlan { module: module.to_string(), n, k, matrix, bias })
    }

    /// How the `[n, k]` matrix of `module` is stored and what kiln makes of it: `weight`,
    /// with the `scales` and `biases` stored beside it, if any.
    pub(crate) fn matrix(
        &self,
        module: &str,
        n: usize,
        k: usize,
        weight: TensorRef,
        scales: Option<TensorRef>,
        biases: Option<TensorRef>,
    ) -> Result<MatrixPlan> {
        let weight_name = format!("{module}.weight");
        Ok(match &self.config.quantization {
            Some(q) => match (q.spec_for(module), scales) {
                // mlx-lm quantizes a module when config.json gives it a spec and the
                // checkpoint holds its scales; a module its quantization predicate
                // skipped is recorded nowhere and simply has no scales.
                (Some(spec), Some(scales)) => self.quantized(module, n, k, spec, weight, scales, biases)?,
                (Some(_), None) => self.dense(
                    &weight_name,
                    n,
                    k,
                    weight,
                    ", or a packed U32 weight with .scales and .biases",
                )?,
                (None, _) => {
                    let hint =
                        format!("; config.json's quantization sets {module} to false (left unquantized)");
                    self.dense(&weight_name, n, k, weight, &hint)?
                }
            },
            None => {
                let hint = if weight.dtype == Dtype::U32 {
                    "; a U32 weight is MLX-packed, but config.json has no quantization block"
                } else {
                    ""
                };
                match (self.quantize, self.dense(&weight_name, n, k, weight, hint)?) {
                    // As mlx-lm's quantizer, a matrix whose K is not a whole number of
                    // groups stays unquantized.
                    (Some(spec), MatrixPlan::Dense { weight }) if k.is_multiple_of(spec.group_size()) => {
                        let scale_dtype = scale_dtype_of(weight.dtype).unwrap_or(ScaleDtype::F32);
                        MatrixPlan::QuantizeOnLoad { weight, spec, scale_dtype }
                    }
                    (_, dense) => dense,
                }
            }
        })
    }

    fn dense(&self, name: &str, n: usize, k: usize, weight: TensorRef, hint: &str) -> Result<MatrixPlan> {
        self.expect_float(name, &weight, hint)?;
        self.expect_shape(name, &weight, &[n, k], "from config.json")?;
        Ok(MatrixPlan::Dense { weight })
    }

    #[allow(clippy::too_many_arguments)]
    fn quantized(
        &self,
        module: &str,
        n: usize,
        k: usize,
        spec: QuantSpec,
        weight: TensorRef,
        scales: TensorRef,
        biases: Option<TensorRef>,
    ) -> Result<MatrixPlan> {
        validate_geometry(n, k, spec).map_err(|cause| ModelError::Geometry {
            tensor: format!("{module} ({spec} per config.json's quantization)"),
            cause,
        })?;
        let weight_name = format!("{module}.weight");
        if weight.dtype != Dtype::U32 {
            return Err(self.error(
                &weight,
                format!(
                    "tensor {weight_name} has dtype {:?}, expected U32 packed codes ({module}.scales is present)",
                    weight.dtype
                ),
            ));
        }
        let why = format!(
            "{spec} per config.json's quantization: a [{n}, {k}] matrix packs K * bits / 32 = {} words per row",
            spec.words_per_row(k)
        );
        self.expect_shape(&weight_name, &weight, &[n, spec.words_per_row(k)], &why)?;
        let groups = [n, spec.groups_per_row(k)];
        let why = format!("one per group of {} in a [{n}, {k}] matrix", spec.group_size());
        let scales_name = format!("{module}.scales");
        let biases_name = format!("{module}.biases");
        let biases = match biases {
            Some(b) => b,
            None => self.require(&biases_name, "per-group biases")?,
        };
        for (name, t) in [(&scales_name, &scales), (&biases_name, &biases)] {
            self.expect_float(name, t, "")?;
            self.expect_shape(name, t, &groups, &why)?;
        }
        if scales.dtype != biases.dtype {
            return Err(self.error(
                &biases,
                format!(
                    "tensor {biases_name} has dtype {:?} but {scales_name} has {:?}: both must have the same dtype",
                    biases.dtype, scales.dtype
                ),
            ));
        }
        Ok(MatrixPlan::Quantized { spec, weight, scales, biases })
    }
}
