//! A GGUF file's metadata to a [`ModelConfig`]: the parsed file ([`Parsed`], [`Gguf`]),
//! typed reads whose errors name the key ([`Meta`]), and the mapping of `llama` and `qwen2`
//! metadata onto a `config.json` document, validated by the same parser, with every tensor
//! checked against the layout the config implies and its block type recorded as the
//! config's quantization.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

use kiln_core::{QuantSpec, SharedBytes};
use serde_json::json;

use super::header::{self, Header, TensorInfo, Value, as_strings};
use super::tensors::{Form, GROUP, GgmlType};
use crate::error::{ModelError, Result};
use crate::loading::checkpoint::mmap::MappedFile;
use crate::loading::config::{ModelConfig, QuantizationConfig};

/// Errors about metadata are [`ModelError`]s naming the file and the key.
pub(crate) type MetaError = ModelError;

/// Architectures kiln maps, for messages.
const ARCHITECTURES: &str = "llama, qwen2";

/// Metadata keys under the architecture's prefix that kiln reads or may ignore safely.
const ARCH_KEYS: &[&str] = &[
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "rope.scaling.finetuned",
    "vocab_size",
    "expert_count",
    "expert_used_count",
];

/// A GGUF file's metadata with the file's path, for typed reads whose errors name the key.
pub(crate) struct Meta<'a> {
    pub(super) map: &'a BTreeMap<String, Value>,
    pub(super) path: &'a Path,
}

impl Meta<'_> {
    fn error(&self, message: String) -> ModelError {
        ModelError::Checkpoint { path: self.path.to_path_buf(), message }
    }

    /// An error about `key`'s value.
    pub(crate) fn invalid(&self, key: &str, message: impl std::fmt::Display) -> ModelError {
        self.error(format!("metadata {key}: {message}"))
    }

    /// A refusal of `key`'s value; `message` names the value and what is accepted.
    pub(crate) fn unsupported(&self, key: &str, message: impl std::fmt::Display) -> ModelError {
        self.error(format!("metadata {key}: {message}"))
    }

    /// The raw value of `key`.
    pub(crate) fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key)
    }

    fn required(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| self.error(format!("missing metadata {key}")))
    }

    fn wrong_type(&self, key: &str, v: &Value, expected: &str) -> ModelError {
        self.invalid(key, format!("a {}, expected {expected}", v.kind()))
    }

    /// A string.
    pub(crate) fn str(&self, key: &str) -> Result<String> {
        match self.required(key)? {
            Value::Str(s) => Ok(s.clone()),
            v => Err(self.wrong_type(key, v, "a string")),
        }
    }

    /// A boolean.
    pub(crate) fn bool(&self, key: &str) -> Result<bool> {
        match self.required(key)? {
            Value::Bool(b) => Ok(*b),
            v => Err(self.wrong_type(key, v, "a bool")),
        }
    }

    /// A non-negative integer, if present.
    pub(crate) fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::U64(n)) => Ok(Some(*n)),
            Some(Value::I64(n)) if *n >= 0 => Ok(Some(*n as u64)),
            Some(v) => Err(self.wrong_type(key, v, "a non-negative integer")),
        }
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_u64(key)?.map(|n| n as usize).ok_or_else(|| self.error(format!("missing metadata {key}")))
    }

    /// A float, refused by key when it is NaN or infinite: a non-finite value would
    /// otherwise become JSON `null` in the config document, and so the default.
    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::F64(x)) if x.is_finite() => Ok(Some(*x)),
            Some(Value::F64(x)) => {
                Err(self.invalid(key, format!("{x} is not finite: expected a finite float")))
            }
            Some(v) => Err(self.wrong_type(key, v, "a float")),
        }
    }

    /// An array of strings.
    pub(crate) fn strings(&self, key: &str) -> Result<Vec<String>> {
        let v = self.required(key)?;
        as_strings(v).ok_or_else(|| self.wrong_type(key, v, "an array of strings"))
    }

    /// An array of integers.
    pub(crate) fn ints(&self, key: &str) -> Result<Vec<i64>> {
        match self.required(key)? {
            Value::Array(a) => a
                .iter()
                .map(|v| match v {
                    Value::I64(n) => Ok(*n),
                    Value::U64(n) => i64::try_from(*n).map_err(|_| self.invalid(key, "integer out of range")),
                    v => Err(self.wrong_type(key, v, "an array of integers")),
                })
                .collect(),
            v => Err(self.wrong_type(key, v, "an array of integers")),
        }
    }

    /// An array of floats; a NaN, which has no order, is refused by key and index.
    pub(crate) fn floats(&self, key: &str) -> Result<Vec<f64>> {
        match self.required(key)? {
            Value::Array(a) => a
                .iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::F64(x) if x.is_nan() => {
                        Err(self.invalid(key, format!("entry {i} is NaN: expected numbers")))
                    }
                    Value::F64(x) => Ok(*x),
                    v => Err(self.wrong_type(key, v, "an array of floats")),
                })
                .collect(),
            v => Err(self.wrong_type(key, v, "an array of floats")),
        }
    }
}

/// A parsed GGUF file: its map and header.
pub(super) struct Parsed {
    pub(super) file: Arc<MappedFile>,
    pub(super) header: Header,
    pub(super) tensors: BTreeMap<String, TensorInfo>,
}

impl Parsed {
    pub(super) fn open(path: &Path) -> Result<Self> {
        let file = MappedFile::open(path)?;
        let header = header::parse(file.bytes())
            .map_err(|e| ModelError::Checkpoint { path: path.to_path_buf(), message: e.0 })?;
        let tensors = header.tensors.iter().map(|t| (t.name.clone(), t.clone())).collect();
        Ok(Parsed { file, header, tensors })
    }

    pub(super) fn path(&self) -> &Path {
        self.file.path()
    }

    pub(super) fn meta(&self) -> Meta<'_> {
        Meta { map: &self.header.metadata, path: self.file.path() }
    }

    pub(super) fn error(&self, message: String) -> ModelError {
        ModelError::Checkpoint { path: self.path().to_path_buf(), message }
    }

    pub(super) fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors.get(name).ok_or_else(|| self.error(format!("missing tensor {name}")))
    }
}

/// A GGUF file with the model configuration its metadata describes.
pub(super) struct Gguf {
    pub(super) parsed: Parsed,
    pub(super) config: ModelConfig,
}

impl Gguf {
    pub(super) fn open(path: &Path) -> Result<Self> {
        let parsed = Parsed::open(path)?;
        let config = config(&parsed.meta(), &parsed.tensors)?;
        Ok(Gguf { parsed, config })
    }
}

impl std::ops::Deref for Gguf {
    type Target = Parsed;

    fn deref(&self) -> &Parsed {
        &self.parsed
    }
}

/// The GGUF name of every tensor the decoder needs, with its shape `[K, N]` (vectors `[N]`)
/// and whether it is a matrix; `None` for tensors that are optional and absent.
pub(super) fn layout(c: &ModelConfig, present: &BTreeMap<String, TensorInfo>) -> Vec<(String, Vec<usize>)> {
    let (h, q, kv, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let mut out = vec![("token_embd.weight".to_string(), vec![h, c.vocab_size])];
    for i in 0..c.num_hidden_layers {
        let b = |s: &str| format!("blk.{i}.{s}");
        out.push((b("attn_norm.weight"), vec![h]));
        out.push((b("attn_q.weight"), vec![h, q]));
        out.push((b("attn_k.weight"), vec![h, kv]));
        out.push((b("attn_v.weight"), vec![h, kv]));
        if c.attention_bias {
            out.push((b("attn_q.bias"), vec![q]));
            out.push((b("attn_k.bias"), vec![kv]));
            out.push((b("attn_v.bias"), vec![kv]));
        }
        out.push((b("attn_output.weight"), vec![q, h]));
        if c.o_proj_bias {
            out.push((b("attn_output.bias"), vec![h]));
        }
        out.push((b("ffn_norm.weight"), vec![h]));
        out.push((b("ffn_gate.weight"), vec![h, ff]));
        out.push((b("ffn_up.weight"), vec![h, ff]));
        out.push((b("ffn_down.weight"), vec![ff, h]));
    }
    out.push(("output_norm.weight".to_string(), vec![h]));
    if present.contains_key("output.weight") {
        out.push(("output.weight".to_string(), vec![h, c.vocab_size]));
    }
    out
}

/// Maps the metadata to a [`ModelConfig`], through the `config.json` parser so the same
/// rules apply, and records the tensors' kiln forms as its quantization.
fn config(meta: &Meta<'_>, tensors: &BTreeMap<String, TensorInfo>) -> Result<ModelConfig> {
    let arch = meta.str("general.architecture")?;
    if arch != "llama" && arch != "qwen2" {
        return Err(meta.unsupported(
            "general.architecture",
            format!("unsupported architecture {arch:?}: accepted architectures are {ARCHITECTURES}"),
        ));
    }
    for key in meta.map.keys() {
        if let Some(rest) = key.strip_prefix(&format!("{arch}."))
            && !ARCH_KEYS.contains(&rest)
        {
            return Err(
                meta.unsupported(key, "kiln does not implement this field; refusing rather than ignoring it")
            );
        }
    }
    let k = |s: &str| format!("{arch}.{s}");
    if meta.opt_u64(&k("expert_count"))?.unwrap_or(0) > 0 {
        return Err(meta.unsupported(
            &k("expert_count"),
            "mixture-of-experts models are not supported: accepted value is 0",
        ));
    }
    let hidden = meta.usize(&k("embedding_length"))?;
    let heads = meta.usize(&k("attention.head_count"))?;
    let kv_heads = meta.opt_u64(&k("attention.head_count_kv"))?.map_or(heads, |n| n as usize);
    let head_dim = match meta.opt_u64(&k("attention.key_length"))? {
        Some(d) => d as usize,
        None => hidden / heads.max(1),
    };
    if let Some(v) = meta.opt_u64(&k("attention.value_length"))?
        && v as usize != head_dim
    {
        return Err(meta.unsupported(
            &k("attention.value_length"),
            format!("{v} differs from the key length {head_dim}: accepted value is {head_dim}"),
        ));
    }
    if let Some(r) = meta.opt_u64(&k("rope.dimension_count"))?
        && r as usize != head_dim
    {
        return Err(meta.unsupported(
            &k("rope.dimension_count"),
            format!("partial rotary embedding ({r} of {head_dim} dimensions) is not supported: accepted value is {head_dim}"),
        ));
    }
    let rope_scaling = match meta.get(&k("rope.scaling.type")) {
        None => None,
        Some(_) => match meta.str(&k("rope.scaling.type"))?.as_str() {
            "none" => None,
            "linear" => {
                let factor = meta.opt_f64(&k("rope.scaling.factor"))?.ok_or_else(|| {
                    meta.invalid(&k("rope.scaling.factor"), "missing, required by linear rope scaling")
                })?;
                Some(json!({"type": "linear", "factor": factor}))
            }
            other => {
                return Err(meta.unsupported(
                    &k("rope.scaling.type"),
                    format!("unsupported rope scaling {other:?}: accepted values are none and linear"),
                ));
            }
        },
    };
    let tokens = meta.strings("tokenizer.ggml.tokens")?.len();
    let vocab = match tensors.get("token_embd.weight") {
        Some(t) if t.dims.len() == 2 => t.dims[1] as usize,
        _ => meta.opt_u64(&k("vocab_size"))?.map_or(tokens, |n| n as usize),
    };
    let mut eos = Vec::new();
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(id) = meta.opt_u64(key)?
            && !eos.contains(&id)
        {
            eos.push(id);
        }
    }
    let mut doc = json!({
        "model_type": arch,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": meta.usize(&k("feed_forward_length"))?,
        "num_hidden_layers": meta.usize(&k("block_count"))?,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": meta.usize(&k("context_length"))?,
        "rope_theta": meta.opt_f64(&k("rope.freq_base"))?.unwrap_or(10000.0),
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": !tensors.contains_key("output.weight"),
        "attention_bias": tensors.contains_key("blk.0.attn_q.bias"),
        "eos_token_id": eos,
    });
    if let Some(eps) = meta.opt_f64(&k("attention.layer_norm_rms_epsilon"))? {
        doc["rms_norm_eps"] = json!(eps);
    }
    if let Some(bos) = meta.opt_u64("tokenizer.ggml.bos_token_id")? {
        doc["bos_token_id"] = json!(bos);
    }
    let mut config = ModelConfig::from_json_str(&doc.to_string(), "GGUF metadata")
        .map_err(|cause| ModelError::Config { path: meta.path.to_path_buf(), cause })?;
    // Every tensor must be one the decoder reads, in a form kiln has.
    let wanted = layout(&config, tensors);
    let names: BTreeSet<&str> = wanted.iter().map(|(n, _)| n.as_str()).collect();
    for name in tensors.keys() {
        if !names.contains(name.as_str()) {
            let why = if name == "rope_freqs.weight" {
                "per-frequency rope factors (Llama 3.1 rope scaling) are not supported"
            } else {
                "kiln's decoder has no such weight"
            };
            return Err(meta.error(format!("tensor {name}: {why}; refusing rather than ignoring it")));
        }
    }
    let mut overrides = BTreeMap::new();
    let mut default = None;
    for (name, shape) in &wanted {
        let t = tensors.get(name).ok_or_else(|| meta.error(format!("missing tensor {name}")))?;
        let found: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
        if &found != shape {
            return Err(ModelError::WeightShape {
                tensor: name.clone(),
                expected: format!("{shape:?}"),
                found: format!("{found:?}"),
            });
        }
        if shape.len() == 1 {
            if !matches!(t.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
                return Err(
                    meta.error(format!("tensor {name}: type {}, expected F32, F16 or BF16", t.ty.name()))
                );
            }
            continue;
        }
        let form = t.ty.kiln_form().map_err(|m| meta.error(format!("tensor {name}: {m}")))?;
        let spec = match form {
            Form::Dense => None,
            Form::Quantized { bits, .. } => Some(
                QuantSpec::new(bits, GROUP)
                    .map_err(|cause| ModelError::Geometry { tensor: name.clone(), cause })?,
            ),
        };
        if name == "blk.0.attn_q.weight" {
            default = spec;
        }
        overrides.insert(hf_module(name), spec);
    }
    if let Some(d) = default {
        overrides.retain(|_, s| *s != Some(d));
        config.quantization = Some(QuantizationConfig { default: d, overrides });
    }
    Ok(config)
}

/// The Hugging Face module path of a GGUF matrix, for the quantization overrides.
fn hf_module(name: &str) -> String {
    let stem = name.trim_end_matches(".weight");
    match stem {
        "token_embd" => return "model.embed_tokens".into(),
        "output" => return "lm_head".into(),
        _ => {}
    }
    let Some((layer, part)) = stem.strip_prefix("blk.").and_then(|s| s.split_once('.')) else {
        return stem.into();
    };
    let module = match part {
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        other => other,
    };
    format!("model.layers.{layer}.{module}")
}
