//! Errors of kiln-model. Each names the input and what would be accepted;
//! [`ModelError::OutOfMemory`] stays matchable so the CLI can map it to its exit code.

use std::path::PathBuf;

use kiln_core::{GeometryError, OutOfMemory};

/// A `config.json` kiln cannot use.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// Not JSON, or not an object. The message leaves the document's name out: every
    /// caller wraps it with the file's path ([`ModelError::Config`]), which would say it twice.
    #[error("not a valid config: {message}")]
    Json {
        /// Which document (`config.json`, `GGUF metadata`), for callers that match on it.
        source_name: String,
        /// What the parser said.
        message: String,
    },
    /// A value kiln does not implement.
    #[error("unsupported {field} {value}: accepted values are {accepted}")]
    Unsupported {
        /// The field, dotted for nested ones.
        field: String,
        /// The refused value, as written.
        value: String,
        /// What would be accepted.
        accepted: String,
    },
    /// A value of the wrong type or range.
    #[error("invalid {field}: {message}")]
    Invalid {
        /// The field.
        field: String,
        /// What is wrong and what is expected.
        message: String,
    },
    /// A required field is absent.
    #[error("missing required field {field}")]
    Missing {
        /// The field.
        field: String,
    },
}

impl ConfigError {
    /// Prefixes the field name with the object it was found in.
    pub fn within(self, at: &str) -> Self {
        match self {
            ConfigError::Missing { field } => ConfigError::Missing { field: format!("{at}.{field}") },
            ConfigError::Invalid { field, message } => {
                ConfigError::Invalid { field: format!("{at}.{field}"), message }
            }
            other => other,
        }
    }
}

/// Anything that stops a model from loading or running.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// An error of a backend other than the CPU's (kiln-cuda's, kiln-wgpu's), with its
    /// class.
    // Not a chained source: a report printing the chain says the message once.
    #[error("{error}")]
    Backend {
        /// How it is answered.
        kind: BackendErrorKind,
        /// The backend's own error.
        error: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// The pool refused an allocation. The message starts `out of memory:`.
    #[error(transparent)]
    OutOfMemory(#[from] OutOfMemory),
    /// No model at the given name or path.
    #[error(
        "model not found: {path}: expected synthetic:<profile>, a directory under ./models/, a path to a directory holding config.json, or a path to a .gguf file"
    )]
    NotFound {
        /// What was looked for.
        path: PathBuf,
    },
    /// An unknown synthetic profile or suffix.
    #[error(
        "unknown synthetic model {name:?}: accepted profiles are {accepted}, optionally with @4bit, @8bit or @4bit-g32"
    )]
    UnknownSynthetic {
        /// The name given.
        name: String,
        /// The profiles kiln knows.
        accepted: String,
    },
    /// `config.json` could not be used. The cause is part of the message, not a chained
    /// source, so a report that prints the chain says it once.
    #[error("{path}: {cause}")]
    Config {
        /// The file.
        path: PathBuf,
        /// Why.
        cause: ConfigError,
    },
    /// A quantized tensor's geometry is invalid.
    #[error("{tensor}: {cause}")]
    Geometry {
        /// The tensor or module.
        tensor: String,
        /// The rule it broke (in the message, not chained).
        cause: GeometryError,
    },
    /// A checkpoint file is unreadable, inconsistent or lacks a tensor.
    #[error("{path}: {message}")]
    Checkpoint {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The tokenizer or chat template could not be loaded or applied.
    #[error("{path}: {message}")]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A model file exists but is not a regular file (a FIFO, socket, device or directory),
    /// so reading it could block or mean nothing.
    #[error("{path} is {kind}, not a regular file: kiln reads model files from regular files only")]
    NotRegularFile {
        /// The file.
        path: PathBuf,
        /// What it is instead ("a FIFO", "a directory", ...).
        kind: &'static str,
    },
    /// A file kiln was asked to write names something that is not a regular file (a
    /// FIFO, a device, a directory): replacing it would destroy it, writing into it
    /// would not leave a file.
    #[error("{path} is {kind}: expected a new path or a regular file to replace")]
    NotRegularOutput {
        /// The path asked for.
        path: PathBuf,
        /// What it is instead ("a FIFO", "a device", ...).
        kind: &'static str,
    },
    /// A model cannot be written as the file asked for (`kiln export-gguf`).
    #[error("{path}: {message}")]
    Export {
        /// The file that was to be written.
        path: PathBuf,
        /// What has no form in the file and what is accepted.
        message: String,
    },
    /// A file could not be read.
    #[error("{path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error (in the message, not chained).
        cause: std::io::Error,
    },
    /// The requested sequence is longer than the model's context.
    #[error(
        "{requested} tokens (prompt plus generated) exceed the model's context of {limit} tokens \
         (max_position_embeddings, or the sliding window when shorter)"
    )]
    ContextExceeded {
        /// Tokens asked for.
        requested: usize,
        /// The model's context length.
        limit: usize,
    },
    /// A weight's shape disagrees with the configuration.
    #[error("{tensor} has shape {found}, expected {expected} from the model's config")]
    WeightShape {
        /// The tensor or module.
        tensor: String,
        /// The shape the config implies.
        expected: String,
        /// The shape found.
        found: String,
    },
    /// A run whose memory plan overflows 64 bits.
    #[error("the run is too large to plan: {what} overflows 64 bits")]
    RunTooLarge {
        /// The part that overflows.
        what: String,
    },
    /// An expert cache geometry the rules refuse (the message names the geometry, the
    /// rule and the cap).
    #[error("invalid --expert-slots: {0}")]
    CacheGeometry(CacheGeometryError),
    /// A run option is out of range.
    #[error("invalid {what}: {message}")]
    InvalidArgument {
        /// The option.
        what: String,
        /// What is wrong and what is accepted.
        message: String,
    },
}

/// An expert cache geometry the rules refuse (`expert_cache::check_cache_geometry`). Each message names the geometry
/// (`<model> @ cache_slots=S`), the rule and the bound.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CacheGeometryError {
    /// Fewer slots than the router's top-k.
    #[error(
        "{model} @ cache_slots={slots}: {slots} is below the floor of top-k = {top_k} slots (every expert \
         one token routes to must be resident at once); accepted values are {top_k} to {most}"
    )]
    BelowFloor {
        /// The model.
        model: String,
        /// Slots asked for.
        slots: usize,
        /// The floor.
        top_k: usize,
        /// The most slots accepted.
        most: String,
    },
    /// More slots than experts.
    #[error(
        "{model} @ cache_slots={slots}: {slots} exceeds the total of layers x experts = {layers} x {experts} \
         = {total}; accepted values are {top_k} to {total}"
    )]
    AboveTotal {
        /// The model.
        model: String,
        /// Slots asked for.
        slots: usize,
        /// Decoder layers.
        layers: usize,
        /// Experts per layer.
        experts: usize,
        /// layers x experts.
        total: usize,
        /// The floor.
        top_k: usize,
    },
    /// More slots than the backend can hold.
    #[error(
        "{model} @ cache_slots={slots}: {slots} exceeds the {backend} backend's slot limit of {cap} ({reason}); \
         reduce --expert-slots or raise --memory-limit"
    )]
    AboveCap {
        /// The model.
        model: String,
        /// Slots asked for.
        slots: usize,
        /// The backend.
        backend: &'static str,
        /// Its cap.
        cap: u64,
        /// Where the cap comes from.
        reason: String,
    },
}

/// Not `#[from]`: the rule is part of the message, not a chained source, so a report
/// that prints the chain says it once.
impl From<CacheGeometryError> for ModelError {
    fn from(e: CacheGeometryError) -> Self {
        ModelError::CacheGeometry(e)
    }
}

/// How a backend's error is answered: the class the `kiln` binary maps to its exit
/// status and the server to its response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendErrorKind {
    /// The backend's memory pool (or its device) refused an allocation; the message starts
    /// `out of memory:`.
    OutOfMemory,
    /// The input or the model is one the backend does not run (or no device is there).
    Usage,
    /// Anything else (a driver call failed).
    Other,
}

impl ModelError {
    /// Whether this is the pool's out-of-memory refusal, the CPU's or a backend's.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(
            self,
            ModelError::OutOfMemory(_) | ModelError::Backend { kind: BackendErrorKind::OutOfMemory, .. }
        )
    }

    /// A backend's error, kept whole (its message is this error's).
    pub fn backend(kind: BackendErrorKind, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        ModelError::Backend { kind, error: Box::new(source) }
    }
}

/// kiln-model's result type.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
