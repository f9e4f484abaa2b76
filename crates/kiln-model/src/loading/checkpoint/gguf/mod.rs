//! llama.cpp's GGUF files: one memory-mapped file holding the model's metadata, its
//! tokenizer and chat template, and its tensors.
//!
//! The header is parsed strictly (`header.rs`); `general.architecture` `llama` and `qwen2`
//! become a [`crate::loading::config::ModelConfig`] through the same validation as a `config.json`
//! (`meta.rs`); tensors of the block types with an exact kiln form (`tensors.rs`) are
//! repacked into MLX-affine groups of 32 straight from the map, and llama.cpp's
//! permutation of llama's Q and K rows (its rope pairs adjacent elements, Hugging Face's
//! pairs the two halves of a head) is undone on the way (`weights.rs`); the tokenizer is
//! rebuilt from the metadata (`tokenizer.rs`). This file holds the entry points.

mod export;
mod header;
mod meta;
mod tensors;
mod tokenizer;
mod weights;
mod writer;

pub use export::{ExportReport, export};

use std::path::Path;

use kiln_core::MemoryPool;

use self::header::Value;
use self::meta::{Gguf, Parsed, layout};
use self::tensors::{Form, GROUP};
use self::weights::{Rows, build, matrix, pool_bytes};
use crate::error::{ModelError, Result};
use crate::forward::weights::LinearWeight;
use crate::loading::chat_template::ChatTemplate;
use crate::loading::source::ModelSource;
use crate::loading::tokenizer::Tokenizer;
use crate::model::{LoadOptions, LoadedModel, ModelInfo, TextModel};

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
    kiln_core::pool::return_freed_heap();
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
