//! Checkpoint directories: config.json, safetensors (single or sharded), tokenizer.

use std::path::Path;

use crate::error::{ModelError, Result};
use crate::model::{LoadOptions, LoadedModel, ModelInfo};

/// Configuration and weight size of a checkpoint, from its headers only.
pub fn inspect(dir: &Path, _opts: &LoadOptions) -> Result<ModelInfo> {
    Err(ModelError::NotFound { path: dir.to_path_buf() })
}

/// Loads a checkpoint.
pub fn load(dir: &Path, _opts: &LoadOptions) -> Result<LoadedModel> {
    Err(ModelError::NotFound { path: dir.to_path_buf() })
}
