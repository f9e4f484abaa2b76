//! kiln-cuda: kiln's CUDA kernels and the host side that launches them.
//!
//! The kernels are CUDA C++ in `kernels/` (`qmv.cu`: `qmv` and `qmv_wide` over MLX-affine
//! 4- and 8-bit weights; `qmm.cu`: the tensor-core product for many rows; `elementwise.cu`:
//! RMSNorm, SiLU-and-multiply, residual add, RoPE, quantized embedding lookup, the MoE
//! router; `attn.cu`: split-and-merge decode attention over an f16 cache, and the store of
//! new keys and values into it). [`launch`] describes each launch as data (name, grid,
//! block, arguments, buffer sizes) without a driver. With the default feature `host-exec`,
//! [`host`] runs the same source on the CPU for the tests; with `cuda`, build.rs compiles
//! the kernels to PTX and sm_80/sm_90 cubins that `modules` embeds, and `device` runs them
//! through the driver API (loaded at run time). [`pool`] holds the device memory limit
//! rule, [`ptxas`] reads ptxas's resource report for the spill check. docs/cuda.md says
//! what is tested where.
#![deny(missing_docs)]

pub mod backend;
pub mod error;
pub mod exec;
pub mod graph;
pub mod launch;
pub mod model;
pub mod pool;
pub mod ptxas;

#[cfg(feature = "cuda")]
pub mod device;
#[cfg(feature = "host-exec")]
pub mod host;
#[cfg(feature = "cuda")]
pub mod modules;

pub use error::CudaError;
pub use exec::{Exec, Mem};
pub use launch::{
    Act, Arg, AttnBuffers, AttnShape, EmbedBuffers, EmbedShape, Launch, Out, QmmShape, QmvBuffers, QmvShape,
};
pub use model::{DeviceCache, DeviceEngine, DevicePlan, DeviceRunShape};
pub use pool::DevicePool;
