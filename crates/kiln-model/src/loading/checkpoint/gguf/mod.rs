//! llama.cpp's GGUF files: one memory-mapped file holding the model's metadata, its
//! tokenizer and chat template, and its tensors.
//!
//! The header is parsed strictly (`header.rs`); `general.architecture` `llama` and `qwen2`
//! become a [`ModelConfig`] through the same validation as a `config.json`; tensors of the
//! block types with an exact kiln form (`tensors.rs`) are repacked into MLX-affine groups
//! of 32 straight from the map, and llama.cpp's permutation of llama's Q and K rows (its
//! rope pairs adjacent elements, Hugging Face's pairs the two halves of a head) is undone
//! on the way; the tokenizer is rebuilt from the metadata (`tokenizer.rs`).

mod export;
mod header;
mod tensors;
mod tokenizer;
mod writer;

pub use export::{ExportReport, export};

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

use half::f16;
use kiln_core::{Buffer, DenseMatrix, MemoryPool, QuantSpec, QuantizedMatrix, ScaleData, SharedBytes, Tag};
use rayon::prelude::*;
use serde_json::json;

use self::header::{Header, TensorInfo, Value};
use self::tensors::{Form, GROUP, GgmlType};
use super::mmap::MappedFile;
use crate::chat_template::ChatTemplate;
use crate::config::{ModelConfig, QuantizationConfig};
use crate::error::{ModelError, Result};
use crate::model::{LoadOptions, LoadedModel, ModelInfo, TextModel};
use crate::source::ModelSource;
use crate::tokenizer::Tokenizer;
use crate::weights::{DenseMlp, Layer, Linear, LinearWeight, Mlp, ModelWeights, RmsNorm};

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
    map: &'a BTreeMap<String, Value>,
    path: &'a Path,
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
        tokenizer::as_strings(v).ok_or_else(|| self.wrong_type(key, v, "an array of strings"))
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
struct Parsed {
    file: Arc<MappedFile>,
    header: Header,
    tensors: BTreeMap<String, TensorInfo>,
}

impl Parsed {
    fn open(path: &Path) -> Result<Self> {
        let file = MappedFile::open(path)?;
        let header = header::parse(file.bytes())
            .map_err(|e| ModelError::Checkpoint { path: path.to_path_buf(), message: e.0 })?;
        let tensors = header.tensors.iter().map(|t| (t.name.clone(), t.clone())).collect();
        Ok(Parsed { file, header, tensors })
    }

    fn path(&self) -> &Path {
        self.file.path()
    }

    fn meta(&self) -> Meta<'_> {
        Meta { map: &self.header.metadata, path: self.file.path() }
    }

    fn error(&self, message: String) -> ModelError {
        ModelError::Checkpoint { path: self.path().to_path_buf(), message }
    }

    fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors.get(name).ok_or_else(|| self.error(format!("missing tensor {name}")))
    }
}

/// A GGUF file with the model configuration its metadata describes.
struct Gguf {
    parsed: Parsed,
    config: ModelConfig,
}

impl Gguf {
    fn open(path: &Path) -> Result<Self> {
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
fn layout(c: &ModelConfig, present: &BTreeMap<String, TensorInfo>) -> Vec<(String, Vec<usize>)> {
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

/// Bytes a tensor of `form` with `n` rows of `k` takes in the pool.
fn pool_bytes(form: Form, n: usize, k: usize) -> u64 {
    let (n, k) = (n as u64, k as u64);
    match form {
        Form::Dense => n * k * 4,
        Form::Quantized { bits, f32_scales } => {
            n * k * u64::from(bits) / 8 + 2 * (n * k / GROUP as u64) * if f32_scales { 4 } else { 2 }
        }
    }
}

/// Configuration and weight size of a GGUF file, from its header.
pub fn inspect(path: &Path, _opts: &LoadOptions) -> Result<ModelInfo> {
    let g = Gguf::open(path)?;
    let (mut bytes, mut transient) = (0, 0);
    for (name, shape) in layout(&g.config, &g.tensors) {
        let t = g.tensor(&name)?;
        bytes += match shape.as_slice() {
            [n] => *n as u64 * 4,
            [k, n] => {
                let form = t.ty.kiln_form().map_err(|m| g.error(format!("tensor {name}: {m}")))?;
                if let Form::Quantized { .. } = form {
                    // The f32 scales and biases one matrix decodes through (see `matrix`).
                    transient = transient.max(2 * (*n * *k / GROUP) as u64 * 4);
                }
                pool_bytes(form, *n, *k)
            }
            _ => 0,
        };
    }
    let weight_bytes = bytes + transient;
    // GGUF files of mixture-of-experts models are refused when the config is read.
    Ok(ModelInfo {
        source: ModelSource::Gguf(path.to_path_buf()),
        config: g.config,
        weight_bytes,
        expert_slot_bytes: None,
    })
}

/// Loads a GGUF file: weights repacked from the mapped file into pool-counted buffers,
/// the tokenizer and chat template from its metadata. `--quantize` does not apply: the
/// file's own block types are kept.
pub fn load(path: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    let g = Gguf::open(path)?;
    let (tokenizer, chat_template) = text_side(&g)?;
    let weights = build(&g, &opts.pool)?;
    Ok(LoadedModel {
        source: ModelSource::Gguf(path.to_path_buf()),
        config: g.config,
        weights,
        tokenizer,
        chat_template,
    })
}

/// The tokenizer and chat template of a parsed file.
fn text_side(p: &Parsed) -> Result<(Tokenizer, Option<ChatTemplate>)> {
    let meta = p.meta();
    let path = p.path();
    let doc = tokenizer::tokenizer_json(&meta)?;
    let tk = doc.to_string().parse::<tokenizers::Tokenizer>().map_err(|e| ModelError::Tokenizer {
        path: path.to_path_buf(),
        message: format!("the tokenizer in the GGUF metadata could not be built: {e}"),
    })?;
    let tokenizer = Tokenizer::Hf(Box::new(tk));
    let chat_template = match meta.get("tokenizer.chat_template") {
        None => None,
        Some(_) => {
            let tokens = meta.strings("tokenizer.ggml.tokens")?;
            let token = |key: &str| -> Result<Option<String>> {
                Ok(meta.opt_u64(key)?.and_then(|id| tokens.get(id as usize).cloned()))
            };
            Some(ChatTemplate::new(
                meta.str("tokenizer.chat_template")?,
                token("tokenizer.ggml.bos_token_id")?,
                token("tokenizer.ggml.eos_token_id")?,
                path.join("tokenizer.chat_template"),
            )?)
        }
    };
    Ok((tokenizer, chat_template))
}

/// The configuration, tokenizer and chat template of a GGUF file, without its weights.
pub fn load_text(path: &Path) -> Result<TextModel> {
    let g = Gguf::open(path)?;
    let (tokenizer, chat_template) = text_side(&g)?;
    Ok(TextModel {
        source: ModelSource::Gguf(path.to_path_buf()),
        config: g.config,
        tokenizer,
        chat_template,
    })
}

/// The file's `general.name`, when it has a non-empty one on a single line.
pub fn general_name(path: &Path) -> Result<Option<String>> {
    let p = Parsed::open(path)?;
    Ok(match p.meta().get("general.name") {
        Some(Value::Str(s)) if !s.trim().is_empty() && !s.chars().any(char::is_control) => {
            Some(s.trim().to_string())
        }
        _ => None,
    })
}

/// Which rows of a stored matrix feed each row of kiln's: identity, or llama.cpp's Q/K
/// permutation undone for `heads` heads.
#[derive(Clone, Copy)]
enum Rows {
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

fn build(g: &Gguf, pool: &MemoryPool) -> Result<ModelWeights> {
    let c = &g.config;
    let permuted = c.architecture == crate::config::Architecture::Llama;
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
fn matrix(g: &Parsed, pool: &MemoryPool, name: &str, rows: Rows) -> Result<LinearWeight> {
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

/// One matrix of a GGUF file in its kiln form, with no model around it (tools and tests
/// that check a tensor's mapping read it this way).
pub fn read_matrix(path: &Path, name: &str, pool: &MemoryPool) -> Result<LinearWeight> {
    let p = Parsed::open(path)?;
    let t = p.tensor(name)?;
    if t.dims.len() != 2 {
        return Err(p.error(format!("tensor {name}: {} dimensions, expected a matrix", t.dims.len())));
    }
    matrix(&p, pool, name, Rows::Same)
}

/// The tokenizer a GGUF file describes, without loading its weights (for tests and tools
/// that compare token ids).
pub fn tokenizer_from_file(path: &Path) -> Result<Tokenizer> {
    let p = Parsed::open(path)?;
    let doc = tokenizer::tokenizer_json(&p.meta())?;
    let tk = doc.to_string().parse::<tokenizers::Tokenizer>().map_err(|e| ModelError::Tokenizer {
        path: path.to_path_buf(),
        message: format!("the tokenizer in the GGUF metadata could not be built: {e}"),
    })?;
    Ok(Tokenizer::Hf(Box::new(tk)))
}
