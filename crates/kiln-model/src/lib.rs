//! kiln-model: Llama-family models on top of kiln-core's kernels: configs, checkpoint
//! loaders, synthetic models, the transformer forward pass with its KV cache, sampling,
//! and tokenizers with chat templates. Nothing here knows about HTTP or the harness.
#![deny(missing_docs)]

pub mod chat_template;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod model;
pub mod source;
pub mod synthetic;
pub mod tokenizer;
pub mod weights;

pub use config::{Architecture, ModelConfig, QuantizationConfig, RopeScaling};
pub use error::{ConfigError, ModelError, Result};
pub use model::{LoadOptions, LoadedModel, ModelInfo, inspect, load};
pub use source::ModelSource;
pub use tokenizer::Tokenizer;
