//! kiln-model: Llama-family models on top of kiln-core's kernels: configs, checkpoint
//! loaders, synthetic models, the transformer forward pass with its KV cache, sampling,
//! and tokenizers with chat templates. Nothing here knows about HTTP or the harness.
//!
//! The folders say the design: `loading/` turns a model's name into the [`model`] types
//! (source, config, checkpoints, synthetic models, tokenizer, chat template), `forward/`
//! runs them (weights, transformer, attention, KV cache, experts, engine, sampling,
//! speculative decoding). [`model`] and [`error`] are the leaves both sides share. Each
//! module is public under its own name at the crate root (`kiln_model::config`,
//! `kiln_model::engine`), so callers need not know the folder.
#![deny(missing_docs)]

pub mod error;
mod forward;
mod loading;
pub mod model;
pub mod output;

pub use forward::{
    attention, backend, engine, expert_cache, experts, kv_cache, logprobs, moe, ops, plan, rope, sampling,
    speculative, transformer, weights, workspace,
};
pub use loading::{
    chat_template, checkpoint, config, default_model_id, inspect, load, load_text, source, synthetic,
    tokenizer, tokenizer_files,
};

pub use config::{Architecture, ModelConfig, MoeConfig, QuantizationConfig, RopeScaling};
pub use error::{BackendErrorKind, ConfigError, ModelError, Result};
pub use expert_cache::{
    CacheGeometry, CacheGeometryError, CacheStats, ExpertCache, SlotCap, check_cache_geometry,
};
pub use model::{LoadOptions, LoadedModel, ModelInfo, TextModel};
pub use source::ModelSource;
pub use tokenizer::Tokenizer;

pub use attention::AttentionKind;
pub use backend::{BackendEngine, Capabilities, Needs, SeqCache};
pub use engine::{Engine, EngineOptions, Session};
pub use kv_cache::{KV_BLOCK_TOKENS, KvCache, KvDtype, KvLayout};
pub use plan::{DeviceRun, MemoryPlan, OneSequence, RunShape, WorkspaceShape, plan, prefill_rows};
pub use sampling::{LogitAdjustments, Penalizer, Sampler, SamplingParams};
pub use transformer::{Logits, SeqChunk, Transformer};
pub use workspace::Workspace;
