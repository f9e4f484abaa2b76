//! Loading a model by name: a synthetic profile, a checkpoint directory or a GGUF file, into
//! [`LoadedModel`], with every weight byte counted by the pool.

use kiln_core::MemoryPool;

use crate::chat_template::ChatTemplate;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::source::ModelSource;
use crate::tokenizer::Tokenizer;
use crate::weights::ModelWeights;
use crate::{checkpoint, synthetic};

/// How to load.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Pool every weight byte is counted in.
    pub pool: MemoryPool,
    /// Quantize an unquantized checkpoint on load to this many bits (4 or 8, group 64).
    /// Ignored for checkpoints that are already quantized and for synthetic models.
    pub quantize: Option<u32>,
}

/// What can be known about a model without loading its weights.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    /// Where it comes from.
    pub source: ModelSource,
    /// Its configuration.
    pub config: ModelConfig,
    /// Bytes loading will count under the weights tag.
    pub weight_bytes: u64,
    /// Bytes of one expert cache slot for the routed experts as they will load; `None`
    /// for a dense model or experts no slot can hold.
    pub expert_slot_bytes: Option<u64>,
}

/// A model ready to run.
pub struct LoadedModel {
    /// Where it came from.
    pub source: ModelSource,
    /// Its configuration.
    pub config: ModelConfig,
    /// Its weights.
    pub weights: ModelWeights,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// Its chat template, when the checkpoint has one.
    pub chat_template: Option<ChatTemplate>,
}

/// Reads a model's configuration and weight size without loading weights.
pub fn inspect(spec: &str, opts: &LoadOptions) -> Result<ModelInfo> {
    match ModelSource::resolve(spec)? {
        ModelSource::Synthetic(profile) => synthetic::inspect(&profile),
        ModelSource::Dir(dir) => checkpoint::inspect(&dir, opts),
        ModelSource::Gguf(file) => checkpoint::gguf::inspect(&file, opts),
    }
}

/// Loads a model.
pub fn load(spec: &str, opts: &LoadOptions) -> Result<LoadedModel> {
    match ModelSource::resolve(spec)? {
        ModelSource::Synthetic(profile) => synthetic::load(&profile, opts),
        ModelSource::Dir(dir) => checkpoint::load(&dir, opts),
        ModelSource::Gguf(file) => checkpoint::gguf::load(&file, opts),
    }
}
