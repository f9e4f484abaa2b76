//! kiln-core: the MLX-affine quantized weight format, the quantized matrix kernels
//! (`qmv`, `qmv_wide`, `qmm`) with their scalar references, the dense twin used by
//! unquantized checkpoints, and the memory pool every large allocation goes through.
//!
//! Kernels know nothing of models: they take activations, a [`QuantizedMatrix`] and an
//! output slice. Models know nothing of ISAs: they call [`quantized_matmul`] and the
//! dispatcher picks the kernel (see [`kernels`]).
#![deny(missing_docs)]

pub mod act_precision;
mod arena;
pub mod bandwidth;
pub mod buffer;
pub mod copy;
pub mod crossover;
pub mod dense;
mod env;
pub mod format;
pub mod kernels;
pub mod math;
pub mod matrix;
pub mod pool;
pub mod quantize;
pub mod roofs;
pub mod size;
pub mod wide;
pub mod workers;

pub use buffer::{Buffer, BufferError, PoolVec, SharedBytes};

pub use dense::DenseMatrix;
pub use format::{GeometryError, QuantSpec, validate_geometry};
pub use kernels::{KernelChoice, qmv_batch_limit, quantized_matmul, select_kernel};
pub use matrix::{LANE_ROWS, Layout, QuantizedMatrix, ScaleData, ScaleDtype};
pub use pool::{Lease, MemoryPool, OutOfMemory, PoolStats, Tag};
pub use quantize::quantize;
