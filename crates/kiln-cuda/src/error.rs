//! [`CudaError`]: every way kiln-cuda refuses a shape or fails to reach the device, as
//! values a caller can match (out of memory above all).

use kiln_core::{GeometryError, Tag};

/// A refusal or failure of kiln-cuda. Messages name the input and what is accepted.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
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
    /// No driver library could be loaded.
    #[error("no CUDA driver was found: none of {tried} could be loaded")]
    NoDriver {
        /// The library names tried, in order.
        tried: String,
    },
    /// The driver loaded but found no device.
    #[error("no CUDA device was found: the driver reports {count} devices")]
    NoDevice {
        /// Devices the driver counted.
        count: i32,
    },
    /// A driver call failed.
    #[error("the CUDA driver call {call} failed: {detail}")]
    Driver {
        /// The call.
        call: &'static str,
        /// The driver's error.
        detail: String,
    },
    /// The device pool's limit refused an allocation.
    #[error(transparent)]
    PoolLimit(#[from] kiln_core::OutOfMemory),
    /// The driver refused an allocation (`CUDA_ERROR_OUT_OF_MEMORY`).
    #[error(
        "out of memory: the CUDA driver refused {requested} bytes for {tag} with {in_use} bytes in use \
         (CUDA_ERROR_OUT_OF_MEMORY)"
    )]
    DeviceOutOfMemory {
        /// Bytes asked for.
        requested: u64,
        /// What they were for.
        tag: Tag,
        /// Bytes the pool held when the request came.
        in_use: u64,
    },
    /// The device forward does not run this model or option.
    #[error("the cuda backend does not run {what}")]
    Unsupported {
        /// What, and what would be accepted.
        what: String,
    },
    /// A bad input to the device forward.
    #[error("invalid {what}: {message}")]
    Input {
        /// The input.
        what: String,
        /// What is wrong and what is accepted.
        message: String,
    },
    /// The host execution has no kernel of that name.
    #[error("unknown kernel {0}: no loaded module holds a kernel of that name")]
    UnknownKernel(String),
}

impl CudaError {
    /// Whether this is running out of memory (the pool's limit or the driver's refusal),
    /// which the CLI reports as `out of memory:` with its own exit code.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, CudaError::PoolLimit(_) | CudaError::DeviceOutOfMemory { .. })
    }

    pub(crate) fn shape(kernel: &'static str, what: impl Into<String>) -> CudaError {
        CudaError::Shape { kernel, what: what.into() }
    }
}
