//! Loading a model by name: a synthetic profile, a checkpoint directory or a GGUF file, into
//! the [`crate::model`] types, with every weight byte counted by the pool. `source.rs`
//! resolves the name; the loaders are `checkpoint/` (safetensors directories, and GGUF
//! files in `checkpoint/gguf/`) and `synthetic/`; `config.rs`, `tokenizer.rs` and
//! `chat_template.rs` read what every checkpoint carries beside its weights, and
//! `tokenizer_files.rs` writes a model's tokenizer back out.

pub mod chat_template;
pub mod checkpoint;
pub mod config;
pub mod source;
pub mod synthetic;
pub mod tokenizer;
pub mod tokenizer_files;

use crate::error::Result;
use crate::loading::source::ModelSource;
use crate::model::{LoadOptions, LoadedModel, ModelInfo, TextModel};

/// Reads a model's configuration, tokenizer and chat template without its weights.
pub fn load_text(spec: &str) -> Result<TextModel> {
    match ModelSource::resolve(spec)? {
        ModelSource::Synthetic(profile) => synthetic::load_text(&profile),
        ModelSource::Dir(dir) => checkpoint::load_text(&dir),
        ModelSource::Gguf(file) => checkpoint::gguf::load_text(&file),
    }
}

/// The name a server lists a model under by default: the synthetic name as given
/// (`synthetic:tiny@8bit`), a GGUF file's `general.name` or else its file stem, a
/// checkpoint directory's name. Never a path, so it does not leak the file system and a
/// client can use it as a name.
pub fn default_model_id(source: &ModelSource) -> Result<String> {
    let stem = |p: &std::path::Path, file: bool| {
        // `.` or `models/x/..` have no final name: use the canonical path's.
        let p = std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
        let name = if file { p.file_stem() } else { p.file_name() };
        name.map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| p.display().to_string())
    };
    Ok(match source {
        ModelSource::Synthetic(profile) => format!("synthetic:{profile}"),
        ModelSource::Dir(dir) => stem(dir, false),
        ModelSource::Gguf(file) => match checkpoint::gguf::general_name(file)? {
            Some(name) => name,
            None => stem(file, true),
        },
    })
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
    let model = match ModelSource::resolve(spec)? {
        ModelSource::Synthetic(profile) => synthetic::load(&profile, opts),
        ModelSource::Dir(dir) => checkpoint::load(&dir, opts),
        ModelSource::Gguf(file) => checkpoint::gguf::load(&file, opts),
    };
    // The load's heap scratch, once the weights are built (see the function).
    kiln_core::pool::return_freed_heap();
    model
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use kiln_core::MemoryPool;

    use super::*;

    #[test]
    fn default_ids_are_short_names_not_paths() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let id = |s: ModelSource| default_model_id(&s).unwrap();
        assert_eq!(id(ModelSource::Synthetic("tiny@8bit".into())), "synthetic:tiny@8bit");
        assert_eq!(id(ModelSource::Dir(fixtures.join("models/llama3-tiny"))), "llama3-tiny");
        // A path with no final name of its own is named by where it leads.
        assert_eq!(id(ModelSource::Dir(fixtures.join("models/llama3-tiny/../qwen2-tiny/."))), "qwen2-tiny");
        // A GGUF file without general.name: its stem.
        assert_eq!(id(ModelSource::Gguf(fixtures.join("gguf/llama-tiny.gguf"))), "llama-tiny");
        // With one: general.name (kiln export-gguf writes "kiln export").
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("exported-file.gguf");
        let model = synthetic::load_with_seed("tiny-qwen@4bit-g32", 1, &MemoryPool::unlimited()).unwrap();
        checkpoint::gguf::export(&model, &out).unwrap();
        assert_eq!(id(ModelSource::Gguf(out)), "kiln export");
    }
}
