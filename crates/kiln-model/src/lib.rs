//! kiln-model: models on top of kiln-core.
