//! kiln-model: Llama-family models on top of kiln-core's kernels: configs, checkpoint
//! loaders, synthetic models, the transformer forward pass with its KV cache, sampling,
//! and tokenizers with chat templates. Nothing here knows about HTTP or the harness.
#![deny(missing_docs)]

pub mod attention;
pub mod chat_template;
pub mod checkpoint;
pub mod config;
pub mod engine;
pub mod error;
pub mod expert_cache;
pub mod experts;
pub mod kv_cache;
pub mod logprobs;
pub mod model;
pub mod moe;
pub mod ops;
pub mod output;
pub mod plan;
pub mod rope;
pub mod sampling;
pub mod source;
pub mod speculative;
pub mod synthetic;
pub mod tokenizer;
pub mod tokenizer_files;
pub mod transformer;
pub mod weights;
pub mod workspace;

pub use config::{Architecture, ModelConfig, MoeConfig, QuantizationConfig, RopeScaling};
pub use error::{ConfigError, ModelError, Result};
pub use expert_cache::{
    CacheGeometry, CacheGeometryError, CacheStats, ExpertCache, SlotCap, check_cache_geometry,
};
pub use model::{LoadOptions, LoadedModel, ModelInfo, TextModel, default_model_id, inspect, load, load_text};
pub use source::ModelSource;
pub use tokenizer::Tokenizer;

pub use attention::AttentionKind;
pub use engine::{Engine, EngineOptions, Session};
pub use kv_cache::{KV_BLOCK_TOKENS, KvCache, KvDtype, KvLayout};
pub use plan::{MemoryPlan, RunShape, WorkspaceShape, plan};
pub use sampling::{LogitAdjustments, Penalizer, Sampler, SamplingParams};
pub use transformer::{Logits, SeqChunk, Transformer};
pub use workspace::Workspace;
