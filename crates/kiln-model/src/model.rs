//! The model types every loader returns and the forward pass reads: [`LoadOptions`] in,
//! [`ModelInfo`] (what is known without the weights), [`LoadedModel`] and [`TextModel`]
//! out. The loaders themselves live in `loading/`; this file names only the types its
//! structs hold, so any module can use it without reaching a loader.

use kiln_core::MemoryPool;

use crate::forward::weights::ModelWeights;
use crate::loading::chat_template::ChatTemplate;
use crate::loading::config::ModelConfig;
use crate::loading::source::ModelSource;
use crate::loading::tokenizer::Tokenizer;

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

impl LoadedModel {
    /// Stores the weights as the CPU backend's kernels read them fastest: the lane-row
    /// layout where `kiln_core::kernels::lane_rows_preferred` says so (an AVX-512 CPU,
    /// `KILN_WEIGHT_LAYOUT` unset or `auto`), in place. Returns the matrices reordered.
    /// For a model the CPU backend runs; a device backend copies rows, so its model is
    /// left as loaded (it would copy a reordered matrix back to rows first).
    pub fn prepare_for_cpu(&mut self) -> usize {
        self.weights.store_for_cpu()
    }
}

/// What a model reads and writes text with: everything but its weights.
pub struct TextModel {
    /// Where it comes from.
    pub source: ModelSource,
    /// Its configuration (context length, BOS and EOS ids, vocabulary size).
    pub config: ModelConfig,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// Its chat template, when the checkpoint has one.
    pub chat_template: Option<ChatTemplate>,
}
