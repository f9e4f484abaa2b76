//! [`WgpuError`]: every way kiln-wgpu refuses a shape or fails to reach the device, as
//! values a caller can match (out of memory above all).

use kiln_core::{GeometryError, Tag};

/// A refusal or failure of kiln-wgpu. Messages name the input and what is accepted.
#[derive(Debug, thiserror::Error)]
pub enum WgpuError {
    /// The quantized geometry breaks the format's rules.
    #[error(transparent)]
    Geometry(#[from] GeometryError),
    /// A kernel was asked for a shape it does not take.
    #[error("invalid {kernel} shape: {what}")]
    Shape {
        /// The kernel family (`qmv`, `attention`, ...).
        kernel: &'static str,
        /// What is wrong and what would be accepted.
        what: String,
    },
    /// wgpu found no adapter of the backend asked for.
    #[error("no {backend} adapter was found: {detail}")]
    NoAdapter {
        /// The backend asked for (`vulkan`, `metal`).
        backend: &'static str,
        /// wgpu's reason.
        detail: String,
    },
    /// The adapter, the device or a command failed.
    #[error("the wgpu device failed in {call}: {detail}")]
    Device {
        /// What was being done.
        call: &'static str,
        /// wgpu's error.
        detail: String,
    },
    /// The device pool's limit refused an allocation.
    #[error(transparent)]
    PoolLimit(#[from] kiln_core::OutOfMemory),
    /// The device refused an allocation (wgpu's out-of-memory error).
    #[error(
        "out of memory: the wgpu device refused {requested} bytes for {tag} with {in_use} bytes in use ({detail})"
    )]
    DeviceOutOfMemory {
        /// Bytes asked for.
        requested: u64,
        /// What they were for.
        tag: Tag,
        /// Bytes the pool held when the request came.
        in_use: u64,
        /// wgpu's error.
        detail: String,
    },
    /// The wgpu forward does not run this model or option.
    #[error("the wgpu backend does not run {what}")]
    Unsupported {
        /// What, and what would be accepted.
        what: String,
    },
    /// A bad input to the forward.
    #[error("invalid {what}: {message}")]
    Input {
        /// The input.
        what: String,
        /// What is wrong and what is accepted.
        message: String,
    },
}

impl WgpuError {
    /// Whether this is running out of memory (the pool's limit or the device's refusal),
    /// which the CLI reports as `out of memory:` with its own exit code.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, WgpuError::PoolLimit(_) | WgpuError::DeviceOutOfMemory { .. })
    }

    pub(crate) fn shape(kernel: &'static str, what: impl Into<String>) -> WgpuError {
        WgpuError::Shape { kernel, what: what.into() }
    }
}
