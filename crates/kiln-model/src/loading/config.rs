//! Model configuration as Hugging Face's `config.json` describes it, for the Llama family
//! (`llama`, `qwen2`, `mistral`) and the mixture-of-experts decoders built on it
//! (`qwen2_moe`, `qwen3_moe`, `mixtral`), plus MLX's `quantization` block. Anything kiln
//! cannot run faithfully is refused with an error naming the field and what is accepted.

use std::collections::BTreeMap;

use kiln_core::QuantSpec;
use serde_json::{Map, Value};

use crate::error::ConfigError;

/// Largest `hidden_size`, `intermediate_size` and `head_dim` kiln accepts: 2^20, far above
/// any published model and small enough that every size kiln derives from a config (a
/// matrix, a layer, the whole model) fits in 64 bits.
pub const MAX_WIDTH: usize = 1 << 20;
/// Largest `num_hidden_layers`, `num_attention_heads` and `num_key_value_heads`: 4096.
pub const MAX_COUNT: usize = 4096;
/// Largest `vocab_size`: 2^24 (16.7M tokens; token ids are 32-bit).
pub const MAX_VOCAB: usize = 1 << 24;
/// Largest `max_position_embeddings` (and RoPE's original context): 2^28 positions.
pub const MAX_POSITIONS: usize = 1 << 28;

/// Decoder families kiln runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    /// Llama 2, 3, 3.1, 3.2.
    Llama,
    /// Qwen2 and Qwen2.5: biased q/k/v projections.
    Qwen2,
    /// Mistral.
    Mistral,
    /// Qwen2-MoE (Qwen1.5-MoE): biased q/k/v, top-k softmax router, a shared expert
    /// behind a sigmoid gate.
    #[serde(rename = "qwen2_moe")]
    Qwen2Moe,
    /// Qwen3-MoE: per-head RMSNorm of queries and keys, top-k softmax router.
    #[serde(rename = "qwen3_moe")]
    Qwen3Moe,
    /// Mixtral: Mistral's attention, a top-2 router over 8 experts.
    Mixtral,
}

/// The accepted `model_type` values, for messages.
pub const ACCEPTED_MODEL_TYPES: &str = "llama, qwen2, mistral, qwen2_moe, qwen3_moe, mixtral";

impl Architecture {
    /// The `model_type` string.
    pub fn as_str(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2Moe => "qwen2_moe",
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::Mixtral => "mixtral",
        }
    }

    /// Whether the MLP of every layer is a mixture of experts.
    pub fn is_moe(self) -> bool {
        matches!(self, Architecture::Qwen2Moe | Architecture::Qwen3Moe | Architecture::Mixtral)
    }
}

/// The mixture-of-experts block of a MoE decoder: a router picks `top_k` of `experts`
/// SwiGLU experts per token and mixes their outputs with the router's softmax weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MoeConfig {
    /// Routed experts per layer (`num_experts`, Mixtral's `num_local_experts`).
    pub experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub top_k: usize,
    /// Inner width of one routed expert (`moe_intermediate_size`; Mixtral's
    /// `intermediate_size`).
    pub expert_intermediate_size: usize,
    /// Renormalise the top-k weights to sum to one (`norm_topk_prob`; always for Mixtral).
    pub norm_topk_prob: bool,
    /// Inner width of the shared expert every token also runs, behind a sigmoid gate
    /// (Qwen2-MoE's `shared_expert_intermediate_size`), or `None`.
    pub shared_expert_intermediate_size: Option<usize>,
}

/// RoPE frequency scaling.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Positions divided by `factor` (frequencies divided by `factor`).
    Linear {
        /// Scaling factor.
        factor: f32,
    },
    /// Llama 3.1's piecewise frequency scaling.
    Llama3 {
        /// Scaling factor for low frequencies.
        factor: f32,
        /// Wavelength boundary factor for low frequencies.
        low_freq_factor: f32,
        /// Wavelength boundary factor for high frequencies.
        high_freq_factor: f32,
        /// The context length the model was pre-trained with.
        original_max_position_embeddings: usize,
    },
}

/// MLX affine quantization of a checkpoint: a default spec and per-module overrides.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct QuantizationConfig {
    /// Spec of every quantized module without an override.
    pub default: QuantSpec,
    /// Per-module overrides keyed by module path (`model.layers.0.mlp.down_proj`):
    /// `Some(spec)` for a different spec, `None` for a module left unquantized.
    pub overrides: BTreeMap<String, Option<QuantSpec>>,
}

impl QuantizationConfig {
    /// The spec for the module at `path`, or `None` when that module is not quantized.
    pub fn spec_for(&self, path: &str) -> Option<QuantSpec> {
        match self.overrides.get(path) {
            Some(o) => *o,
            None => Some(self.default),
        }
    }
}

/// Everything the forward pass needs to know about a model's shape.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ModelConfig {
    /// The decoder family.
    pub architecture: Architecture,
    /// Residual stream width.
    pub hidden_size: usize,
    /// MLP inner width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA when fewer than query heads).
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding and of the LM head).
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// RoPE scaling, if any.
    pub rope_scaling: Option<RopeScaling>,
    /// Longest sequence (prompt plus generated tokens) the model supports.
    pub max_position_embeddings: usize,
    /// The LM head reuses the embedding matrix.
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (always for qwen2).
    pub attention_bias: bool,
    /// o_proj carries a bias (llama's `attention_bias` covers it too).
    pub o_proj_bias: bool,
    /// gate/up/down projections carry a bias.
    pub mlp_bias: bool,
    /// Beginning-of-sequence token, if the config names one.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens.
    pub eos_token_ids: Vec<u32>,
    /// MLX quantization, when the checkpoint is quantized.
    pub quantization: Option<QuantizationConfig>,
    /// Queries and keys pass a per-head RMSNorm before RoPE (Qwen3).
    pub qk_norm: bool,
    /// The mixture of experts, for MoE architectures.
    pub moe: Option<MoeConfig>,
}

impl ModelConfig {
    /// Parses `config.json` text. `source` names the file in error messages.
    pub fn from_json_str(text: &str, source: &str) -> Result<Self, ConfigError> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| ConfigError::Json { source_name: source.to_string(), message: e.to_string() })?;
        let Value::Object(map) = value else {
            return Err(ConfigError::Json {
                source_name: source.to_string(),
                message: "expected a JSON object".to_string(),
            });
        };
        Self::from_map(&map)
    }

    fn from_map(m: &Map<String, Value>) -> Result<Self, ConfigError> {
        let model_type = str_field(m, "model_type")?.unwrap_or_default();
        let architecture = match model_type.as_str() {
            "llama" => Architecture::Llama,
            "qwen2" => Architecture::Qwen2,
            "mistral" => Architecture::Mistral,
            "qwen2_moe" => Architecture::Qwen2Moe,
            "qwen3_moe" => Architecture::Qwen3Moe,
            "mixtral" => Architecture::Mixtral,
            other => {
                return Err(ConfigError::Unsupported {
                    field: "model_type".into(),
                    value: format!("{other:?}"),
                    accepted: ACCEPTED_MODEL_TYPES.into(),
                });
            }
        };
        if let Some(act) = str_field(m, "hidden_act")?
            && act != "silu"
        {
            return Err(ConfigError::Unsupported {
                field: "hidden_act".into(),
                value: format!("{act:?}"),
                accepted: "silu".into(),
            });
        }
        if let Some(tp) = usize_field(m, "pretraining_tp")?
            && tp != 1
        {
            return Err(ConfigError::Unsupported {
                field: "pretraining_tp".into(),
                value: tp.to_string(),
                accepted: "1".into(),
            });
        }
        let hidden_size = required_usize(m, "hidden_size")?;
        let num_attention_heads = required_usize(m, "num_attention_heads")?;
        // Checked before head_dim is derived from them, so the error names them.
        check_count("hidden_size", hidden_size, MAX_WIDTH)?;
        check_count("num_attention_heads", num_attention_heads, MAX_COUNT)?;
        let num_key_value_heads = usize_field(m, "num_key_value_heads")?.unwrap_or(num_attention_heads);
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(ConfigError::Invalid {
                field: "num_key_value_heads".into(),
                message: format!(
                    "{num_key_value_heads} must divide num_attention_heads = {num_attention_heads}"
                ),
            });
        }
        let head_dim = usize_field(m, "head_dim")?.unwrap_or(hidden_size / num_attention_heads.max(1));
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(ConfigError::Invalid {
                field: "head_dim".into(),
                message: format!("{head_dim} must be a positive even number for RoPE"),
            });
        }
        let max_position_embeddings = usize_field(m, "max_position_embeddings")?.unwrap_or(2048);
        let max_position_embeddings = match architecture {
            Architecture::Llama => max_position_embeddings,
            _ => check_sliding_window(m, architecture, max_position_embeddings)?,
        };
        // transformers >= 5 moves rope settings into `rope_parameters`.
        let rope_params = match m.get("rope_parameters") {
            Some(Value::Object(p)) => Some(p),
            _ => None,
        };
        let rope_theta = match rope_params.and_then(|p| p.get("rope_theta")) {
            Some(v) => as_f32(v, "rope_parameters.rope_theta")?,
            None => f32_field(m, "rope_theta")?.unwrap_or(10000.0),
        };
        let rope_scaling = match rope_params {
            Some(p) => parse_rope_scaling(p, "rope_parameters")?,
            None => match m.get("rope_scaling") {
                Some(Value::Object(s)) => parse_rope_scaling(s, "rope_scaling")?,
                Some(Value::Null) | None => None,
                Some(other) => {
                    return Err(ConfigError::Invalid {
                        field: "rope_scaling".into(),
                        message: format!("expected an object or null, found {other}"),
                    });
                }
            },
        };
        let attention_bias = match architecture {
            Architecture::Qwen2 | Architecture::Qwen2Moe => true,
            _ => bool_field(m, "attention_bias")?.unwrap_or(false),
        };
        let o_proj_bias = match architecture {
            Architecture::Qwen2 | Architecture::Qwen2Moe | Architecture::Qwen3Moe => false,
            _ => attention_bias,
        };
        let moe = if architecture.is_moe() { Some(parse_moe(m, architecture)?) } else { None };
        let eos_token_ids = match m.get("eos_token_id") {
            Some(Value::Number(n)) => vec![as_u32(n, "eos_token_id")?],
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::Number(n) => as_u32(n, "eos_token_id"),
                    other => Err(ConfigError::Invalid {
                        field: "eos_token_id".into(),
                        message: format!("expected integers, found {other}"),
                    }),
                })
                .collect::<Result<_, _>>()?,
            _ => Vec::new(),
        };
        let bos_token_id = match m.get("bos_token_id") {
            Some(Value::Number(n)) => Some(as_u32(n, "bos_token_id")?),
            _ => None,
        };
        let quantization = match m.get("quantization").or_else(|| m.get("quantization_config")) {
            Some(Value::Object(q)) => Some(parse_quantization(q)?),
            Some(Value::Null) | None => None,
            Some(other) => {
                return Err(ConfigError::Invalid {
                    field: "quantization".into(),
                    message: format!("expected an object, found {other}"),
                });
            }
        };
        let config = ModelConfig {
            architecture,
            hidden_size,
            intermediate_size: required_usize(m, "intermediate_size")?,
            num_hidden_layers: required_usize(m, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size: required_usize(m, "vocab_size")?,
            rms_norm_eps: f32_field(m, "rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings: bool_field(m, "tie_word_embeddings")?.unwrap_or(false),
            attention_bias,
            o_proj_bias,
            mlp_bias: bool_field(m, "mlp_bias")?.unwrap_or(false),
            bos_token_id,
            eos_token_ids,
            quantization,
            qk_norm: architecture == Architecture::Qwen3Moe,
            moe,
        };
        config.check_ranges()?;
        Ok(config)
    }

    /// Refuses values that parse but that no model can have, before anything is sized
    /// from them: widths, counts and lengths from 1 up to [`MAX_WIDTH`], [`MAX_COUNT`],
    /// [`MAX_VOCAB`] and [`MAX_POSITIONS`]; `rms_norm_eps` and `rope_theta` finite and
    /// positive; RoPE scaling factors finite and positive, llama3's high frequency factor
    /// above its low one.
    fn check_ranges(&self) -> Result<(), ConfigError> {
        let counts = [
            ("hidden_size", self.hidden_size, MAX_WIDTH),
            ("intermediate_size", self.intermediate_size, MAX_WIDTH),
            ("head_dim", self.head_dim, MAX_WIDTH),
            ("num_hidden_layers", self.num_hidden_layers, MAX_COUNT),
            ("num_attention_heads", self.num_attention_heads, MAX_COUNT),
            ("num_key_value_heads", self.num_key_value_heads, MAX_COUNT),
            ("vocab_size", self.vocab_size, MAX_VOCAB),
            ("max_position_embeddings", self.max_position_embeddings, MAX_POSITIONS),
        ];
        for (field, value, max) in counts {
            check_count(field, value, max)?;
        }
        if let Some(moe) = &self.moe {
            check_count("num_experts", moe.experts, MAX_COUNT)?;
            check_count("moe_intermediate_size", moe.expert_intermediate_size, MAX_WIDTH)?;
            if moe.top_k == 0 || moe.top_k > moe.experts {
                return Err(ConfigError::Invalid {
                    field: "num_experts_per_tok".into(),
                    message: format!(
                        "{} is out of range: accepted values are 1 to num_experts = {}",
                        moe.top_k, moe.experts
                    ),
                });
            }
            if let Some(s) = moe.shared_expert_intermediate_size {
                check_count("shared_expert_intermediate_size", s, MAX_WIDTH)?;
            }
        }
        check_positive("rms_norm_eps", self.rms_norm_eps)?;
        check_positive("rope_theta", self.rope_theta)?;
        match self.rope_scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => check_positive("rope_scaling.factor", factor)?,
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                check_positive("rope_scaling.factor", factor)?;
                check_positive("rope_scaling.low_freq_factor", low_freq_factor)?;
                check_positive("rope_scaling.high_freq_factor", high_freq_factor)?;
                if high_freq_factor <= low_freq_factor {
                    return Err(ConfigError::Invalid {
                        field: "rope_scaling.high_freq_factor".into(),
                        message: format!(
                            "{high_freq_factor} must be greater than low_freq_factor = {low_freq_factor}"
                        ),
                    });
                }
                check_count(
                    "rope_scaling.original_max_position_embeddings",
                    original_max_position_embeddings,
                    MAX_POSITIONS,
                )?;
            }
        }
        Ok(())
    }

    /// Query heads per key/value head.
    pub fn gqa_group(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Width of the concatenated query heads.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Width of the concatenated key (or value) heads.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// The widest MLP inner activation a forward holds: the dense MLP's, or for a MoE
    /// model the larger of one expert's and the shared expert's.
    pub fn mlp_width(&self) -> usize {
        match &self.moe {
            None => self.intermediate_size,
            Some(m) => m.expert_intermediate_size.max(m.shared_expert_intermediate_size.unwrap_or(0)),
        }
    }
}

/// The MoE fields of a `qwen2_moe`, `qwen3_moe` or `mixtral` config. Layouts kiln does
/// not run (dense layers between sparse ones) are refused by name.
fn parse_moe(m: &Map<String, Value>, arch: Architecture) -> Result<MoeConfig, ConfigError> {
    let experts_field = if arch == Architecture::Mixtral { "num_local_experts" } else { "num_experts" };
    let experts = required_usize(m, experts_field)?;
    let top_k = required_usize(m, "num_experts_per_tok")?;
    if arch == Architecture::Mixtral {
        return Ok(MoeConfig {
            experts,
            top_k,
            expert_intermediate_size: required_usize(m, "intermediate_size")?,
            norm_topk_prob: true,
            shared_expert_intermediate_size: None,
        });
    }
    if let Some(step) = usize_field(m, "decoder_sparse_step")?
        && step != 1
    {
        return Err(ConfigError::Unsupported {
            field: "decoder_sparse_step".into(),
            value: step.to_string(),
            accepted: "1 (every layer a mixture of experts)".into(),
        });
    }
    match m.get("mlp_only_layers") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(other) => {
            return Err(ConfigError::Unsupported {
                field: "mlp_only_layers".into(),
                value: other.to_string(),
                accepted: "[] (every layer a mixture of experts)".into(),
            });
        }
    }
    let shared = match arch {
        Architecture::Qwen2Moe => match usize_field(m, "shared_expert_intermediate_size")? {
            Some(0) | None => None,
            Some(s) => Some(s),
        },
        _ => None,
    };
    Ok(MoeConfig {
        experts,
        top_k,
        expert_intermediate_size: required_usize(m, "moe_intermediate_size")?,
        norm_topk_prob: bool_field(m, "norm_topk_prob")?.unwrap_or(false),
        shared_expert_intermediate_size: shared,
    })
}

/// A sliding window shorter than the context changes attention; kiln does not implement
/// it, so such a model runs only up to its window (reported as its context length).
fn check_sliding_window(
    m: &Map<String, Value>,
    arch: Architecture,
    max_pos: usize,
) -> Result<usize, ConfigError> {
    let qwen = matches!(arch, Architecture::Qwen2 | Architecture::Qwen2Moe | Architecture::Qwen3Moe);
    if qwen && bool_field(m, "use_sliding_window")? != Some(true) {
        return Ok(max_pos);
    }
    match usize_field(m, "sliding_window")? {
        Some(0) => Err(ConfigError::Invalid {
            field: "sliding_window".into(),
            message: "0 is out of range: accepted values are 1 or more".into(),
        }),
        Some(w) if w < max_pos => Ok(w),
        _ => Ok(max_pos),
    }
}

fn parse_rope_scaling(s: &Map<String, Value>, field: &str) -> Result<Option<RopeScaling>, ConfigError> {
    let kind = match (s.get("rope_type"), s.get("type")) {
        (Some(Value::String(t)), _) | (None, Some(Value::String(t))) => t.clone(),
        _ => "default".to_string(),
    };
    let f = |name: &str| -> Result<f32, ConfigError> {
        match s.get(name) {
            Some(v) => as_f32(v, &format!("{field}.{name}")),
            None => Err(ConfigError::Missing { field: format!("{field}.{name}") }),
        }
    };
    match kind.as_str() {
        "default" => Ok(None),
        "linear" => Ok(Some(RopeScaling::Linear { factor: f("factor")? })),
        "llama3" => Ok(Some(RopeScaling::Llama3 {
            factor: f("factor")?,
            low_freq_factor: f("low_freq_factor")?,
            high_freq_factor: f("high_freq_factor")?,
            original_max_position_embeddings: positions(s, field)?,
        })),
        other => Err(ConfigError::Unsupported {
            field: format!("{field}.rope_type"),
            value: format!("{other:?}"),
            accepted: "default, linear, llama3".into(),
        }),
    }
}

/// llama3 scaling's `original_max_position_embeddings`: a positive integer (written as
/// one, or as a float with no fraction, as some converters do).
fn positions(s: &Map<String, Value>, field: &str) -> Result<usize, ConfigError> {
    let name = format!("{field}.original_max_position_embeddings");
    let v = s
        .get("original_max_position_embeddings")
        .ok_or_else(|| ConfigError::Missing { field: name.clone() })?;
    let n = v.as_u64().or_else(|| {
        v.as_f64().filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f <= MAX_POSITIONS as f64).map(|f| f as u64)
    });
    match n {
        Some(n) => Ok(usize::try_from(n).unwrap_or(usize::MAX)),
        None => Err(ConfigError::Invalid {
            field: name,
            message: format!("expected a positive integer, found {v}"),
        }),
    }
}

fn parse_quantization(q: &Map<String, Value>) -> Result<QuantizationConfig, ConfigError> {
    // Hugging Face's own quantizers (GPTQ, AWQ, bitsandbytes, fp8, ...) name themselves
    // here; their tensors are not MLX triples, so they must not be read as one.
    if let Some(method) = q.get("quant_method") {
        return Err(ConfigError::Unsupported {
            field: "quantization_config.quant_method".into(),
            value: method.to_string(),
            accepted: "MLX affine quantization as mlx-lm writes it (no quant_method)".into(),
        });
    }
    if let Some(mode) = str_field(q, "mode")?
        && mode != "affine"
    {
        return Err(ConfigError::Unsupported {
            field: "quantization.mode".into(),
            value: format!("{mode:?}"),
            accepted: "affine".into(),
        });
    }
    let spec_of = |obj: &Map<String, Value>, at: &str| -> Result<QuantSpec, ConfigError> {
        let bits = required_usize(obj, "bits").map_err(|e| e.within(at))?;
        // A width that does not fit 32 bits is refused as written, never truncated.
        let bits = u32::try_from(bits).unwrap_or(u32::MAX);
        let group = required_usize(obj, "group_size").map_err(|e| e.within(at))?;
        QuantSpec::new(bits, group).map_err(|e| {
            let field = match e {
                kiln_core::GeometryError::UnsupportedGroupSize { .. } => "group_size",
                _ => "bits",
            };
            ConfigError::Invalid { field: format!("{at}.{field}"), message: e.to_string() }
        })
    };
    let default = spec_of(q, "quantization")?;
    let mut overrides = BTreeMap::new();
    for (key, v) in q {
        match v {
            Value::Object(o) => {
                overrides.insert(key.clone(), Some(spec_of(o, &format!("quantization.{key}"))?));
            }
            Value::Bool(false) => {
                overrides.insert(key.clone(), None);
            }
            _ => {}
        }
    }
    Ok(QuantizationConfig { default, overrides })
}

/// `value` must be in `1..=max`.
fn check_count(field: &str, value: usize, max: usize) -> Result<(), ConfigError> {
    if value == 0 || value > max {
        return Err(ConfigError::Invalid {
            field: field.into(),
            message: format!("{value} is out of range: accepted values are 1 to {max}"),
        });
    }
    Ok(())
}

/// `value` must be finite and greater than 0.
fn check_positive(field: &str, value: f32) -> Result<(), ConfigError> {
    if !(value.is_finite() && value > 0.0) {
        return Err(ConfigError::Invalid {
            field: field.into(),
            message: format!("{value} is out of range: accepted values are finite and greater than 0"),
        });
    }
    Ok(())
}

fn str_field(m: &Map<String, Value>, name: &str) -> Result<Option<String>, ConfigError> {
    match m.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(ConfigError::Invalid {
            field: name.into(),
            message: format!("expected a string, found {other}"),
        }),
    }
}

fn usize_field(m: &Map<String, Value>, name: &str) -> Result<Option<usize>, ConfigError> {
    match m.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) if n.as_u64().is_some() => Ok(Some(n.as_u64().unwrap_or(0) as usize)),
        Some(other) => Err(ConfigError::Invalid {
            field: name.into(),
            message: format!("expected a non-negative integer, found {other}"),
        }),
    }
}

fn required_usize(m: &Map<String, Value>, name: &str) -> Result<usize, ConfigError> {
    usize_field(m, name)?.ok_or_else(|| ConfigError::Missing { field: name.into() })
}

fn f32_field(m: &Map<String, Value>, name: &str) -> Result<Option<f32>, ConfigError> {
    match m.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => as_f32(v, name).map(Some),
    }
}

fn bool_field(m: &Map<String, Value>, name: &str) -> Result<Option<bool>, ConfigError> {
    match m.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(ConfigError::Invalid {
            field: name.into(),
            message: format!("expected true or false, found {other}"),
        }),
    }
}

fn as_f32(v: &Value, name: &str) -> Result<f32, ConfigError> {
    v.as_f64().map(|f| f as f32).ok_or_else(|| ConfigError::Invalid {
        field: name.into(),
        message: format!("expected a number, found {v}"),
    })
}

fn as_u32(n: &serde_json::Number, name: &str) -> Result<u32, ConfigError> {
    n.as_u64().and_then(|v| u32::try_from(v).ok()).ok_or_else(|| ConfigError::Invalid {
        field: name.into(),
        message: format!("expected a token id, found {n}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA32_1B: &str = r#"{
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 128256, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "max_position_embeddings": 131072, "tie_word_embeddings": true,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
        "hidden_act": "silu", "attention_bias": false, "mlp_bias": false,
        "quantization": {"group_size": 64, "bits": 4,
                         "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8},
                         "lm_head": false}
    }"#;

    #[test]
    fn parses_llama_3_2_with_llama3_rope_and_mlx_quantization() {
        let c = ModelConfig::from_json_str(LLAMA32_1B, "config.json").unwrap();
        assert_eq!(c.architecture, Architecture::Llama);
        assert_eq!(c.gqa_group(), 4);
        assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
        assert!(matches!(
            c.rope_scaling,
            Some(RopeScaling::Llama3 { original_max_position_embeddings: 8192, .. })
        ));
        let q = c.quantization.unwrap();
        assert_eq!(q.spec_for("model.layers.1.mlp.down_proj"), Some(QuantSpec::new(4, 64).unwrap()));
        assert_eq!(q.spec_for("model.layers.0.mlp.down_proj"), Some(QuantSpec::new(8, 64).unwrap()));
        assert_eq!(q.spec_for("lm_head"), None);
    }

    #[test]
    fn qwen2_always_has_qkv_bias() {
        let text = r#"{"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
            "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "vocab_size": 151936, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
            "tie_word_embeddings": true, "use_sliding_window": false, "sliding_window": 32768,
            "eos_token_id": 151645}"#;
        let c = ModelConfig::from_json_str(text, "config.json").unwrap();
        assert!(c.attention_bias && !c.o_proj_bias);
        assert_eq!(c.head_dim, 64);
        assert_eq!(c.max_position_embeddings, 32768);
    }

    #[test]
    fn transformers_5_rope_parameters() {
        let text = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256,
            "rope_parameters": {"rope_theta": 50000.0, "rope_type": "linear", "factor": 2.0}}"#;
        let c = ModelConfig::from_json_str(text, "config.json").unwrap();
        assert_eq!(c.rope_theta, 50000.0);
        assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 2.0 }));
    }

    #[test]
    fn refusals_name_the_field_and_the_accepted_values() {
        let base = |extra: &str| {
            format!(
                r#"{{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256 {extra}}}"#
            )
        };
        let cases = [
            (
                r#", "rope_scaling": {"type": "yarn", "factor": 4.0}"#,
                ["rope_scaling.rope_type", "yarn", "llama3"],
            ),
            (r#", "hidden_act": "gelu""#, ["hidden_act", "gelu", "silu"]),
            (r#", "quantization": {"group_size": 64, "bits": 7}"#, ["quantization", "7", "2, 3, 4, 5, 6, 8"]),
            (
                r#", "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}"#,
                ["quant_method", "gptq", "MLX affine"],
            ),
        ];
        for (extra, needles) in cases {
            let msg = ModelConfig::from_json_str(&base(extra), "config.json").unwrap_err().to_string();
            for n in needles {
                assert!(msg.contains(n), "{msg:?} lacks {n:?}");
            }
        }
        let msg = ModelConfig::from_json_str(r#"{"model_type": "gpt2"}"#, "x").unwrap_err().to_string();
        assert!(msg.contains("model_type") && msg.contains("gpt2") && msg.contains(ACCEPTED_MODEL_TYPES));
        let msg = ModelConfig::from_json_str(r#"{"model_type": "llama"}"#, "x").unwrap_err().to_string();
        assert!(msg.contains("hidden_size"), "{msg}");
    }

    #[test]
    fn out_of_range_values_are_refused_at_parse_time() {
        let with = |field: &str, value: &str| {
            let mut m: Map<String, Value> = serde_json::from_str(
                r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}"#,
            )
            .unwrap();
            let v: Value = serde_json::from_str(value).unwrap();
            match field.split_once('.') {
                Some((outer, inner)) => {
                    let o = m.entry(outer).or_insert_with(|| Value::Object(Map::new()));
                    o.as_object_mut().unwrap().insert(inner.into(), v);
                }
                None => {
                    m.insert(field.into(), v);
                }
            }
            ModelConfig::from_json_str(&Value::Object(m).to_string(), "config.json")
        };
        let llama3 = r#"{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#;
        assert!(with("rope_scaling", llama3).is_ok());
        let cases = [
            ("num_hidden_layers", "1000000000"),
            ("num_hidden_layers", "0"),
            ("hidden_size", "0"),
            ("hidden_size", "1099511627776"),
            ("intermediate_size", "0"),
            ("intermediate_size", "4294967296"),
            ("vocab_size", "0"),
            ("vocab_size", "4294967296"),
            ("num_attention_heads", "100000"),
            ("head_dim", "4194304"),
            ("max_position_embeddings", "0"),
            ("max_position_embeddings", "18446744073709551615"),
            ("sliding_window", "0"),
            ("rope_theta", "-10000.0"),
            ("rope_theta", "0"),
            ("rope_theta", "1e300"),
            ("rms_norm_eps", "-1e-6"),
            ("rms_norm_eps", "0"),
            ("quantization.bits", "4294967300"),
            ("quantization.group_size", "18446744073709551615"),
        ];
        for (field, value) in cases {
            let text = if field.starts_with("quantization") {
                let other = if field.ends_with("bits") { "group_size" } else { "bits" };
                let other_v = if other == "bits" { "4" } else { "64" };
                format!(r#"{{"{}": {value}, "{other}": {other_v}}}"#, field.split_once('.').unwrap().1)
            } else {
                value.to_string()
            };
            let at = if field.starts_with("quantization") { "quantization" } else { field };
            let r = if field == "sliding_window" {
                let mistral = r#"{"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256,
                    "sliding_window": 0}"#;
                ModelConfig::from_json_str(mistral, "config.json").map(|_| ())
            } else {
                with(at, &text).map(|_| ())
            };
            let msg = r.expect_err(&format!("{field} = {value} was accepted")).to_string();
            let name = field.rsplit('.').next().unwrap();
            assert!(msg.contains(name), "{field} = {value}: {msg:?} does not name the field");
        }
        for (field, value) in [
            ("factor", "-8.0"),
            ("low_freq_factor", "0"),
            ("high_freq_factor", "0.5"),
            ("original_max_position_embeddings", "-1"),
            ("original_max_position_embeddings", "1.5"),
        ] {
            let mut s: Map<String, Value> = serde_json::from_str(llama3).unwrap();
            s.insert(field.into(), serde_json::from_str(value).unwrap());
            let msg = with("rope_scaling", &Value::Object(s).to_string()).unwrap_err().to_string();
            assert!(msg.contains(&format!("rope_scaling.{field}")), "{field} = {value}: {msg:?}");
        }
    }

    const QWEN3_30B_A3B: &str = r#"{"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": true, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "use_sliding_window": false, "tie_word_embeddings": false}"#;

    #[test]
    fn parses_the_moe_architectures() {
        let c = ModelConfig::from_json_str(QWEN3_30B_A3B, "config.json").unwrap();
        assert_eq!(c.architecture, Architecture::Qwen3Moe);
        assert!(c.qk_norm && !c.attention_bias);
        let moe = c.moe.unwrap();
        assert_eq!((moe.experts, moe.top_k, moe.expert_intermediate_size), (128, 8, 768));
        assert!(moe.norm_topk_prob && moe.shared_expert_intermediate_size.is_none());
        assert_eq!(c.mlp_width(), 768);

        let qwen2 = r#"{"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
            "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
            "num_hidden_layers": 24, "num_attention_heads": 16, "vocab_size": 151936,
            "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": false}"#;
        let c = ModelConfig::from_json_str(qwen2, "config.json").unwrap();
        assert!(c.attention_bias && !c.qk_norm);
        let moe = c.moe.unwrap();
        assert_eq!(moe.shared_expert_intermediate_size, Some(5632));
        assert!(!moe.norm_topk_prob);
        assert_eq!(c.mlp_width(), 5632);

        let mixtral = r#"{"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
            "sliding_window": null, "max_position_embeddings": 32768}"#;
        let c = ModelConfig::from_json_str(mixtral, "config.json").unwrap();
        let moe = c.moe.unwrap();
        assert_eq!((moe.experts, moe.top_k, moe.expert_intermediate_size), (8, 2, 14336));
        assert!(moe.norm_topk_prob);
    }

    #[test]
    fn moe_layouts_kiln_does_not_run_are_refused_by_name() {
        let with = |extra: &str| {
            let text = QWEN3_30B_A3B.trim_end().trim_end_matches('}').to_string() + extra + "}";
            ModelConfig::from_json_str(&text, "config.json").unwrap_err().to_string()
        };
        for (extra, needles) in [
            (r#", "decoder_sparse_step": 2"#, ["decoder_sparse_step", "2"]),
            (r#", "mlp_only_layers": [0, 47]"#, ["mlp_only_layers", "[0,47]"]),
            (r#", "num_experts_per_tok": 200"#, ["num_experts_per_tok", "128"]),
            (r#", "num_experts": 0"#, ["num_experts", "0"]),
        ] {
            let msg = with(extra);
            for n in needles {
                assert!(msg.contains(n), "{extra}: {msg:?} lacks {n:?}");
            }
        }
        let missing = QWEN3_30B_A3B.replace(r#""num_experts": 128,"#, "");
        let msg = ModelConfig::from_json_str(&missing, "config.json").unwrap_err().to_string();
        assert!(msg.contains("num_experts"), "{msg}");
    }
}
