//! The activations of a forward pass, allocated from the pool under [`Tag::Scratch`] for
//! a number of rows ([`WorkspaceShape`]) and reused by every forward that fits, so a
//! decode step allocates no activations (naive attention's score matrix and the
//! kernels' activation codes are allocated per step, see docs/cli.md).

use kiln_core::{MemoryPool, OutOfMemory, PoolVec, Tag};

use crate::forward::plan::WorkspaceShape;
use crate::loading::config::ModelConfig;

/// Activation buffers for up to `shape().rows` token rows.
pub struct Workspace {
    pool: MemoryPool,
    shape: WorkspaceShape,
    pub(crate) bufs: Buffers,
}

/// The buffers, each sized for the workspace's rows.
pub(crate) struct Buffers {
    /// Residual stream `[rows, hidden]`.
    pub x: PoolVec<f32>,
    /// Normed residual `[rows, hidden]`; also the final norm's output.
    pub xn: PoolVec<f32>,
    /// o_proj and down_proj output `[rows, hidden]`.
    pub proj: PoolVec<f32>,
    /// Queries, then the attention output `[rows, q_dim]`.
    pub q: PoolVec<f32>,
    /// Attention scratch `[rows, q_dim]`.
    pub tmp: PoolVec<f32>,
    /// Keys `[rows, kv_dim]`.
    pub k: PoolVec<f32>,
    /// Values `[rows, kv_dim]`.
    pub v: PoolVec<f32>,
    /// SwiGLU gate, then its product with up `[rows, mlp_width]`.
    pub gate: PoolVec<f32>,
    /// SwiGLU up `[rows, mlp_width]`.
    pub up: PoolVec<f32>,
    /// MoE router logits `[rows, experts]` (empty for a dense model).
    pub router: PoolVec<f32>,
    /// MoE rows gathered for one expert `[rows, hidden]` (empty for a dense model).
    pub xe: PoolVec<f32>,
    /// MoE expert output `[rows, hidden]` (empty for a dense model).
    pub ye: PoolVec<f32>,
    /// RoPE cosines `[rows, head_dim / 2]`.
    pub cos: PoolVec<f32>,
    /// RoPE sines `[rows, head_dim / 2]`.
    pub sin: PoolVec<f32>,
    /// Logits `[logit_rows, vocab]`.
    pub logits: PoolVec<f32>,
}

impl Workspace {
    /// A workspace of `shape` for `config`, taking exactly `shape.bytes(config)` from the pool.
    pub fn new(config: &ModelConfig, pool: &MemoryPool, shape: WorkspaceShape) -> Result<Self, OutOfMemory> {
        Ok(Workspace { pool: pool.clone(), shape, bufs: Buffers::new(config, pool, shape)? })
    }

    /// An empty workspace that grows on first use.
    pub fn empty(config: &ModelConfig, pool: &MemoryPool) -> Result<Self, OutOfMemory> {
        Self::new(config, pool, WorkspaceShape::default())
    }

    /// Current capacity.
    pub fn shape(&self) -> WorkspaceShape {
        self.shape
    }

    /// The pool the workspace (and naive attention's scores) come from.
    pub fn pool(&self) -> &MemoryPool {
        &self.pool
    }

    /// Makes room for `rows` rows and `logit_rows` rows of logits, reallocating (after
    /// freeing the old buffers, so the pool never holds both) when the capacity is short.
    pub fn ensure(
        &mut self,
        config: &ModelConfig,
        rows: usize,
        logit_rows: usize,
    ) -> Result<(), OutOfMemory> {
        if rows <= self.shape.rows && logit_rows <= self.shape.logit_rows {
            return Ok(());
        }
        let shape = WorkspaceShape {
            rows: rows.max(self.shape.rows),
            logit_rows: logit_rows.max(self.shape.logit_rows),
        };
        // Free first; if the larger allocation is refused the workspace stays empty (and
        // says so), ready for a smaller forward.
        self.bufs = Buffers::new(config, &self.pool, WorkspaceShape::default())?;
        self.shape = WorkspaceShape::default();
        self.bufs = Buffers::new(config, &self.pool, shape)?;
        self.shape = shape;
        Ok(())
    }
}

impl Buffers {
    fn new(config: &ModelConfig, pool: &MemoryPool, shape: WorkspaceShape) -> Result<Self, OutOfMemory> {
        let r = shape.rows;
        let a = |n: usize| pool.alloc_zeroed::<f32>(Tag::Scratch, r * n);
        Ok(Buffers {
            x: a(config.hidden_size)?,
            xn: a(config.hidden_size)?,
            proj: a(config.hidden_size)?,
            q: a(config.q_dim())?,
            tmp: a(config.q_dim())?,
            k: a(config.kv_dim())?,
            v: a(config.kv_dim())?,
            gate: a(config.mlp_width())?,
            up: a(config.mlp_width())?,
            router: a(config.moe.map_or(0, |m| m.experts))?,
            xe: a(if config.moe.is_some() { config.hidden_size } else { 0 })?,
            ye: a(if config.moe.is_some() { config.hidden_size } else { 0 })?,
            cos: a(config.head_dim / 2)?,
            sin: a(config.head_dim / 2)?,
            logits: pool.alloc_zeroed::<f32>(Tag::Scratch, shape.logit_rows * config.vocab_size)?,
        })
    }
}

impl std::fmt::Debug for Workspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workspace").field("shape", &self.shape).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic;

    #[test]
    fn takes_exactly_the_planned_bytes_and_regrows_without_doubling() {
        let config = synthetic::inspect("tiny").unwrap().config;
        let pool = MemoryPool::unlimited();
        let shape = WorkspaceShape { rows: 7, logit_rows: 2 };
        let mut ws = Workspace::new(&config, &pool, shape).unwrap();
        assert_eq!(pool.stats().live_bytes, shape.bytes(&config));
        ws.ensure(&config, 5, 1).unwrap();
        assert_eq!(ws.shape(), shape);
        ws.ensure(&config, 20, 1).unwrap();
        let grown = WorkspaceShape { rows: 20, logit_rows: 2 };
        assert_eq!(pool.stats().live_bytes, grown.bytes(&config));
        assert_eq!(pool.stats().peak_bytes, grown.bytes(&config));
    }
}
