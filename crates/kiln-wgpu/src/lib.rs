//! kiln-wgpu: kiln's third backend, WGSL compute kernels run through wgpu on Vulkan (Linux
//! and Windows GPUs; Mesa's lavapipe on the CPU in the tests) and Metal (Apple GPUs, through
//! naga's translation to MSL).
//!
//! The kernels are in `shaders/` (`qmv.wgsl`: `qmv` and `qmv_wide` over MLX-affine 4- and
//! 8-bit weights; `qmm.wgsl` for more rows; `embed.wgsl`, `rms_norm.wgsl`, `rope.wgsl`,
//! `kv_store.wgsl`, `silu_mul.wgsl`, `add.wgsl`, `add_bias.wgsl`; `attn_split.wgsl` and
//! `attn_merge.wgsl`: split-and-merge decode attention over an f16 cache), listed in
//! [`shaders`]. [`kernels`] describes each dispatch as data and checks its shape; [`exec`]
//! opens an adapter, counts every allocation in a [`DevicePool`] and queues dispatches
//! (or, as a plan, only counts); [`model`] is the forward pass on them. docs/metal.md says
//! what has run where.
#![deny(missing_docs)]

pub mod backend;
pub mod error;
pub mod exec;
pub mod kernels;
pub mod model;
pub mod pool;
pub mod shaders;

pub use error::WgpuError;
pub use exec::{AdapterDesc, Backend, Dispatch, Mem, WgpuExec};
pub use model::{WgpuCache, WgpuEngine, WgpuPlan, WgpuRunShape};
pub use pool::DevicePool;
pub use shaders::Kernel;
