//! Checkpoint directories as Hugging Face and mlx-lm write them: `config.json` (and
//! `generation_config.json`), safetensors weights (single file or sharded, memory-mapped),
//! `tokenizer.json` and the chat template.
//!
//! Loading is planned first (`plan_load` here, over `plan.rs`'s types and checks): every
//! tensor the decoder needs is found, its dtype and shape checked against the config, and
//! its cost in the pool computed from the safetensors headers alone. [`inspect`] returns that cost; [`load`] then reads the
//! tensors in the plan's order (`build.rs`). Mixture-of-experts checkpoints (`qwen2_moe`,
//! `qwen3_moe`, `mixtral`) add their routers, shared experts and routed experts to the
//! plan (`moe.rs`), in MLX's stacked layout or Hugging Face's per-expert one; the routed
//! experts become the model's [`crate::forward::experts::ExpertStore`]. llama.cpp's single-file
//! GGUF checkpoints load through [`gguf`].

mod build;
pub mod gguf;
mod mmap;
mod moe;
mod plan;
mod safetensors;
mod tensor;

use std::path::Path;

use kiln_core::QuantSpec;
use serde_json::Value;

use self::plan::{Plan, Planner, Step};
use self::safetensors::Checkpoint;
use self::tensor::TensorReader;
use crate::error::{ConfigError, ModelError, Result};
use crate::loading::chat_template::ChatTemplate;
use crate::loading::config::ModelConfig;
use crate::loading::source::ModelSource;
use crate::loading::tokenizer::Tokenizer;
use crate::model::{LoadOptions, LoadedModel, ModelInfo, TextModel};

/// Group size kiln quantizes to on load, as `mlx_lm.convert` does by default.
pub const QUANTIZE_GROUP_SIZE: usize = 64;

/// Widths accepted by [`LoadOptions::quantize`].
pub const QUANTIZE_BITS: [u32; 2] = [4, 8];

/// Configuration and weight size of a checkpoint, from its headers only. `weight_bytes` is
/// the most the load will hold under the weights tag at once (views into the mapped files
/// count their bytes too), so it bounds the pool's peak during and after loading.
pub fn inspect(dir: &Path, opts: &LoadOptions) -> Result<ModelInfo> {
    let config = read_config(dir)?;
    let ck = Checkpoint::open(dir)?;
    let plan = plan_load(&config, &ck, quantize_spec(opts, &config)?)?;
    Ok(ModelInfo {
        source: ModelSource::Dir(dir.to_path_buf()),
        config,
        weight_bytes: plan.peak_bytes(),
        expert_slot_bytes: plan.expert_slot_bytes,
    })
}

/// Loads a checkpoint: weights viewed in place in the mapped files where their dtype and
/// alignment allow, copied or widened to f32 otherwise, quantized when
/// [`LoadOptions::quantize`] asks and the checkpoint is not quantized already; the
/// tokenizer and chat template from the same directory.
pub fn load(dir: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    let config = read_config(dir)?;
    let ck = Checkpoint::open(dir)?;
    let plan = plan_load(&config, &ck, quantize_spec(opts, &config)?)?;
    // Tokenizer and template first: they are cheap and their errors are common.
    let tokenizer = Tokenizer::from_dir(dir)?;
    let chat_template = ChatTemplate::from_dir(dir)?;
    kiln_core::pool::return_freed_heap();
    let weights = build::build(plan, &config, &TensorReader { ck: &ck, pool: &opts.pool })?;
    Ok(LoadedModel { source: ModelSource::Dir(dir.to_path_buf()), config, weights, tokenizer, chat_template })
}

/// Plans the load of `ck` as `config` describes it: the decoder's steps in order, the
/// dense ones from `plan.rs`, a mixture of experts' from `moe.rs` (both build on the
/// plan's types, so the walk over both lives here). `quantize` applies to float matrices
/// of a checkpoint without a `quantization` block.
fn plan_load(config: &ModelConfig, ck: &Checkpoint, quantize: Option<QuantSpec>) -> Result<Plan> {
    let p = Planner { config, ck, quantize };
    let (h, q_dim, kv_dim, inter) =
        (config.hidden_size, config.q_dim(), config.kv_dim(), config.intermediate_size);
    let mut steps = Vec::with_capacity(2 + config.num_hidden_layers * 9 + 1);
    let mut expert_slot_bytes = None;
    steps.push(Step::Linear(p.linear("model.embed_tokens", config.vocab_size, h, false)?));
    for i in 0..config.num_hidden_layers {
        let l = format!("model.layers.{i}");
        let attn_bias = config.attention_bias;
        let mlp_bias = config.mlp_bias;
        steps.push(Step::Vector(p.vector(&format!("{l}.input_layernorm.weight"), h)?));
        steps.push(Step::Linear(p.linear(&format!("{l}.self_attn.q_proj"), q_dim, h, attn_bias)?));
        steps.push(Step::Linear(p.linear(&format!("{l}.self_attn.k_proj"), kv_dim, h, attn_bias)?));
        steps.push(Step::Linear(p.linear(&format!("{l}.self_attn.v_proj"), kv_dim, h, attn_bias)?));
        steps.push(Step::Linear(p.linear(&format!("{l}.self_attn.o_proj"), h, q_dim, config.o_proj_bias)?));
        if config.qk_norm {
            let why = "head_dim in config.json";
            let hd = config.head_dim;
            steps.push(Step::Vector(p.vector_of(&format!("{l}.self_attn.q_norm.weight"), hd, why)?));
            steps.push(Step::Vector(p.vector_of(&format!("{l}.self_attn.k_norm.weight"), hd, why)?));
        }
        steps.push(Step::Vector(p.vector(&format!("{l}.post_attention_layernorm.weight"), h)?));
        match &config.moe {
            Some(moe) => {
                let slot = moe::plan_layer(&p, &l, moe, &mut steps)?;
                expert_slot_bytes = expert_slot_bytes.or(slot);
            }
            None => {
                steps.push(Step::Linear(p.linear(&format!("{l}.mlp.gate_proj"), inter, h, mlp_bias)?));
                steps.push(Step::Linear(p.linear(&format!("{l}.mlp.up_proj"), inter, h, mlp_bias)?));
                steps.push(Step::Linear(p.linear(&format!("{l}.mlp.down_proj"), h, inter, mlp_bias)?));
            }
        }
    }
    steps.push(Step::Vector(p.vector("model.norm.weight", h)?));
    if !config.tie_word_embeddings {
        steps.push(Step::Linear(p.linear("lm_head", config.vocab_size, h, false)?));
    }
    Ok(Plan { steps, expert_slot_bytes })
}

/// The configuration, tokenizer and chat template of a checkpoint, without its weights.
pub fn load_text(dir: &Path) -> Result<TextModel> {
    let config = read_config(dir)?;
    let tokenizer = Tokenizer::from_dir(dir)?;
    let chat_template = ChatTemplate::from_dir(dir)?;
    Ok(TextModel { source: ModelSource::Dir(dir.to_path_buf()), config, tokenizer, chat_template })
}

/// The spec to quantize float matrices to on load, if any.
fn quantize_spec(opts: &LoadOptions, config: &ModelConfig) -> Result<Option<QuantSpec>> {
    let Some(bits) = opts.quantize else { return Ok(None) };
    if !QUANTIZE_BITS.contains(&bits) {
        return Err(ModelError::InvalidArgument {
            what: "quantize".into(),
            message: format!("{bits} bits: accepted values are 4 and 8"),
        });
    }
    if config.quantization.is_some() {
        // Already quantized: the checkpoint's own spec wins.
        return Ok(None);
    }
    QuantSpec::new(bits, QUANTIZE_GROUP_SIZE)
        .map(Some)
        .map_err(|e| ModelError::InvalidArgument { what: "quantize".into(), message: e.to_string() })
}

/// Reads `config.json`, with the EOS ids of `generation_config.json` when it names any
/// (chat models list their end-of-turn token there).
pub fn read_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join("config.json");
    if !crate::loading::source::regular_file(&path)? {
        return Err(ModelError::NotFound { path });
    }
    let text =
        std::fs::read_to_string(&path).map_err(|cause| ModelError::Io { path: path.clone(), cause })?;
    let mut config = ModelConfig::from_json_str(&text, "config.json")
        .map_err(|cause| ModelError::Config { path: path.clone(), cause })?;
    let gen_path = dir.join("generation_config.json");
    if crate::loading::source::regular_file(&gen_path)? {
        let text = std::fs::read_to_string(&gen_path)
            .map_err(|cause| ModelError::Io { path: gen_path.clone(), cause })?;
        if let Some(eos) = generation_eos(&text, "generation_config.json")
            .map_err(|cause| ModelError::Config { path: gen_path.clone(), cause })?
        {
            config.eos_token_ids = eos;
        }
    }
    Ok(config)
}

/// The `eos_token_id` of a `generation_config.json`: an id or a list of ids.
fn generation_eos(text: &str, source: &str) -> Result<Option<Vec<u32>>, ConfigError> {
    let value: Value = serde_json::from_str(text)
        .map_err(|e| ConfigError::Json { source_name: source.to_string(), message: e.to_string() })?;
    let invalid = |v: &Value| ConfigError::Invalid {
        field: "eos_token_id".into(),
        message: format!("expected a token id or a list of token ids, found {v}"),
    };
    let id = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| invalid(v));
    match value.get("eos_token_id") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) if a.is_empty() => Ok(None),
        Some(Value::Array(a)) => a.iter().map(id).collect::<Result<Vec<_>, _>>().map(Some),
        Some(v) => id(v).map(|i| Some(vec![i])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_config_eos_forms() {
        assert_eq!(generation_eos(r#"{"eos_token_id": [1, 2]}"#, "g").unwrap(), Some(vec![1, 2]));
        assert_eq!(generation_eos(r#"{"eos_token_id": 7}"#, "g").unwrap(), Some(vec![7]));
        assert_eq!(generation_eos(r#"{"do_sample": true}"#, "g").unwrap(), None);
        let e = generation_eos(r#"{"eos_token_id": "x"}"#, "g").unwrap_err().to_string();
        assert!(e.contains("eos_token_id") && e.contains("token id"), "{e}");
    }
}
