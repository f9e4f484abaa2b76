//! Synthetic models: real shapes, seeded weights, no download.

use crate::error::{ModelError, Result};
use crate::model::{LoadOptions, LoadedModel, ModelInfo};

/// Configuration and weight size of a synthetic profile.
pub fn inspect(profile: &str) -> Result<ModelInfo> {
    Err(ModelError::UnknownSynthetic { name: profile.to_string(), accepted: String::new() })
}

/// Builds a synthetic model.
pub fn load(profile: &str, _opts: &LoadOptions) -> Result<LoadedModel> {
    Err(ModelError::UnknownSynthetic { name: profile.to_string(), accepted: String::new() })
}
