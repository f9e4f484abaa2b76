//! Where a model comes from: `synthetic:<profile>[@4bit|@8bit]`, a name under `./models/`
//! (MLX-style `models/NAME` directories), a path to a checkpoint directory, or a path to a
//! GGUF file (`*.gguf`, directly or under `./models/`).

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use crate::error::{ModelError, Result};

/// A resolved model name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// A generated model; the string is everything after `synthetic:`.
    Synthetic(String),
    /// A checkpoint directory holding `config.json`.
    Dir(PathBuf),
    /// A llama.cpp GGUF file.
    Gguf(PathBuf),
}

impl ModelSource {
    /// Resolves `spec`. A path that exists is used as is; otherwise `models/<spec>` under
    /// the current directory is tried. A missing model is [`ModelError::NotFound`].
    pub fn resolve(spec: &str) -> Result<Self> {
        Self::resolve_in(spec, Path::new("."))
    }

    /// [`Self::resolve`] relative to `root` instead of the current directory.
    pub fn resolve_in(spec: &str, root: &Path) -> Result<Self> {
        if spec.trim().is_empty() {
            return Err(ModelError::InvalidArgument {
                what: "model".into(),
                message: format!(
                    "the model name {spec:?} is empty: expected synthetic:<profile>, a directory \
                     under ./models/, or a path to a directory holding config.json"
                ),
            });
        }
        if let Some(rest) = spec.strip_prefix("synthetic:") {
            return Ok(ModelSource::Synthetic(rest.to_string()));
        }
        let direct = root.join(spec);
        if is_gguf_path(&direct) {
            if regular_file(&direct)? {
                return Ok(ModelSource::Gguf(direct));
            }
            let under_models = root.join("models").join(spec);
            if regular_file(&under_models)? {
                return Ok(ModelSource::Gguf(under_models));
            }
            return Err(ModelError::NotFound { path: PathBuf::from(spec) });
        }
        if regular_file(&direct.join("config.json"))? {
            return Ok(ModelSource::Dir(direct));
        }
        let under_models = root.join("models").join(spec);
        if regular_file(&under_models.join("config.json"))? {
            return Ok(ModelSource::Dir(under_models));
        }
        if std::fs::metadata(&direct).is_ok_and(|m| m.is_file()) {
            return Err(ModelError::InvalidArgument {
                what: format!("model {spec}"),
                message: "it is a file, not a GGUF file (*.gguf) or a directory holding config.json: \
                          expected synthetic:<profile>, a directory under ./models/, a checkpoint \
                          directory or a .gguf file"
                    .into(),
            });
        }
        let path = if direct.exists() { direct.join("config.json") } else { PathBuf::from(spec) };
        Err(ModelError::NotFound { path })
    }

    /// The path or synthetic name, for reports.
    pub fn display_path(&self) -> String {
        match self {
            ModelSource::Synthetic(p) => format!("synthetic:{p}"),
            ModelSource::Dir(d) | ModelSource::Gguf(d) => d.display().to_string(),
        }
    }
}

/// Whether `path` names a GGUF file (by its extension).
pub fn is_gguf_path(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// Whether `path` is present as a regular file (symbolic links followed): `Ok(false)`
/// when nothing is there, [`ModelError::NotRegularFile`] when something else is. Only the
/// file's metadata is read, so a FIFO is named without blocking on it.
pub fn regular_file(path: &Path) -> Result<bool> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        // Nothing there, or a regular file where the path needs a directory (MODEL
        // naming a file that is not a GGUF, whose `config.json` is looked for under it).
        Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory) => {
            return Ok(false);
        }
        // A link that exists but cannot be followed (a loop, too many levels, here or in a
        // folder above) names no file: bad input, not an I/O failure.
        Err(e)
            if e.raw_os_error() == Some(libc::ELOOP)
                || std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) =>
        {
            return Err(ModelError::NotRegularFile {
                path: path.to_path_buf(),
                kind: "a symbolic link that cannot be followed (a loop?)",
            });
        }
        Err(cause) => return Err(ModelError::Io { path: path.to_path_buf(), cause }),
    };
    match not_regular(&meta.file_type()) {
        None => Ok(true),
        Some(kind) => Err(ModelError::NotRegularFile { path: path.to_path_buf(), kind }),
    }
}

/// What a file that is not a regular one is ("a FIFO", "a directory", ...), for
/// messages; `None` for a regular file.
pub(crate) fn not_regular(t: &std::fs::FileType) -> Option<&'static str> {
    Some(if t.is_file() {
        return None;
    } else if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else {
        "not a file"
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_or_a_looping_link_as_model_is_bad_input_not_an_io_failure() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        std::fs::write(root.join("weights.bin"), "x").unwrap();
        let e = ModelSource::resolve_in("weights.bin", root).unwrap_err();
        assert!(matches!(e, ModelError::InvalidArgument { .. }), "{e:?}");
        assert!(e.to_string().contains("it is a file, not a GGUF file"), "{e}");
        // A model folder that is a link to itself: every path under it loops.
        std::os::unix::fs::symlink("loop", root.join("loop")).unwrap();
        let e = ModelSource::resolve_in("loop", root).unwrap_err();
        assert!(matches!(e, ModelError::NotRegularFile { .. }), "{e:?}");
        // A config.json that links to itself.
        std::fs::create_dir(root.join("m")).unwrap();
        std::os::unix::fs::symlink("config.json", root.join("m/config.json")).unwrap();
        let e = ModelSource::resolve_in("m", root).unwrap_err();
        assert!(matches!(e, ModelError::NotRegularFile { .. }), "{e:?}");
    }

    #[test]
    fn resolves_paths_models_dir_and_synthetic() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        std::fs::create_dir_all(root.join("models/tiny-4bit")).unwrap();
        std::fs::write(root.join("models/tiny-4bit/config.json"), "{}").unwrap();
        assert_eq!(
            ModelSource::resolve_in("tiny-4bit", root).unwrap(),
            ModelSource::Dir(root.join("models/tiny-4bit"))
        );
        assert_eq!(
            ModelSource::resolve_in("models/tiny-4bit", root).unwrap(),
            ModelSource::Dir(root.join("models/tiny-4bit"))
        );
        assert_eq!(
            ModelSource::resolve_in("synthetic:tiny@8bit", root).unwrap(),
            ModelSource::Synthetic("tiny@8bit".into())
        );
        std::fs::write(root.join("models/m.gguf"), "GGUF").unwrap();
        assert_eq!(
            ModelSource::resolve_in("m.gguf", root).unwrap(),
            ModelSource::Gguf(root.join("models/m.gguf"))
        );
        assert!(ModelSource::resolve_in("other.gguf", root).is_err());
        let e = ModelSource::resolve_in("nope", root).unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
        let e = ModelSource::resolve_in("", root).unwrap_err().to_string();
        assert!(e.contains("empty") && !e.contains("not found"), "{e}");
    }
}
