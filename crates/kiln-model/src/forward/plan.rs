//! The memory plan of a run: bytes of weights, KV cache and scratch for a prompt length,
//! a number of generated tokens, an attention implementation and a prefill chunking.
//!
//! The same figures size the real allocations (the workspace is allocated from
//! [`MemoryPlan::workspace`], the cache grows in the blocks counted here), so `kiln
//! estimate` predicts `kiln bench-decode`'s pool peak from first principles rather than
//! from a fitted model. The cache's last block is counted whole both here and when it is
//! allocated, so the prediction is the peak itself, not a bound above it; with naive
//! attention it also counts the largest score matrix, held while the cache is at most as
//! full.
//!
//! Every size is computed in checked 64-bit arithmetic and in closed form (no loop over
//! the prompt's chunks), so any run shape, however large, plans in constant time and one
//! whose bytes overflow is [`ModelError::RunTooLarge`], not a wrapped number or an abort.

use crate::error::{ModelError, Result};
use crate::forward::attention::{AttentionKind, AttnShape};
use crate::forward::kv_cache::{KvDtype, KvLayout};
use crate::loading::config::ModelConfig;

/// What a run does, as far as memory is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunShape {
    /// Tokens in the prompt of each sequence.
    pub prompt_tokens: usize,
    /// Tokens generated per sequence (the last one is never fed back, but is counted).
    pub max_tokens: usize,
    /// Prompt rows per prefill forward; 0 runs the whole prompt in one forward.
    pub prefill_chunk: usize,
    /// Sequences decoded together.
    pub batch: usize,
    /// Attention implementation.
    pub attention: AttentionKind,
    /// Cache storage type.
    pub kv_dtype: KvDtype,
    /// The activation scheme the products run (`KILN_ACT_PRECISION` as the binary
    /// checked it); `None`: the backend's own. A device backend whose scratch depends on
    /// it (kiln-wgpu's integer codes) plans with it.
    pub act: Option<kiln_protocol::ActScheme>,
}

impl RunShape {
    /// One sequence, streaming attention, f16 cache, whole-prompt prefill.
    pub fn single(prompt_tokens: usize, max_tokens: usize) -> Self {
        RunShape {
            prompt_tokens,
            max_tokens,
            prefill_chunk: 0,
            batch: 1,
            attention: AttentionKind::Streaming,
            kv_dtype: KvDtype::F16,
            act: None,
        }
    }

    /// Rows of the largest prefill forward.
    pub fn prefill_rows(&self) -> usize {
        match self.prefill_chunk {
            0 => self.prompt_tokens,
            c => c.min(self.prompt_tokens),
        }
    }

    /// Positions each sequence's cache must hold (saturating at `usize::MAX`, which no
    /// context reaches).
    pub fn sequence_tokens(&self) -> usize {
        self.prompt_tokens.saturating_add(self.max_tokens)
    }
}

/// Capacity of a workspace: activation rows per forward and rows of logits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkspaceShape {
    /// Token rows one forward carries.
    pub rows: usize,
    /// Rows of logits one forward returns.
    pub logit_rows: usize,
}

impl WorkspaceShape {
    /// f32 values of activations per row: the residual, the normed copy, projection output,
    /// q, k, v, attention scratch, gate, up (the widest MLP), a row of RoPE cosines and
    /// sines, and for a MoE model the router's logits and an expert's gathered input and
    /// output.
    pub fn values_per_row(config: &ModelConfig) -> usize {
        3 * config.hidden_size
            + 2 * config.q_dim()
            + 2 * config.kv_dim()
            + 2 * config.mlp_width()
            + config.head_dim
            + config.moe.map_or(0, |m| m.experts + 2 * config.hidden_size)
    }

    /// Bytes a workspace of this shape allocates for `config`.
    ///
    /// # Panics
    /// When the size overflows 64 bits; [`Self::checked_bytes`] returns `None` instead.
    pub fn bytes(&self, config: &ModelConfig) -> u64 {
        self.checked_bytes(config).expect("workspace size overflows 64 bits")
    }

    /// [`Self::bytes`], `None` when it overflows 64 bits.
    pub fn checked_bytes(&self, config: &ModelConfig) -> Option<u64> {
        let rows = (self.rows as u64).checked_mul(Self::values_per_row(config) as u64)?;
        let logits = (self.logit_rows as u64).checked_mul(config.vocab_size as u64)?;
        rows.checked_add(logits)?.checked_mul(4)
    }
}

/// Predicted pool bytes of a run, by part.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MemoryPlan {
    /// Weights, as loading counts them.
    pub weights_bytes: u64,
    /// KV cache of every sequence, in whole blocks.
    pub kv_bytes: u64,
    /// Workspace plus, for naive attention, the largest score matrix.
    pub scratch_bytes: u64,
    /// The workspace alone.
    pub workspace_bytes: u64,
    /// The largest naive score matrix (0 for streaming attention).
    pub attention_scores_bytes: u64,
    /// The expert cache's slots (0 without one).
    pub experts_bytes: u64,
    /// The predicted peak: weights + KV + scratch + experts.
    pub total_bytes: u64,
    /// The workspace to allocate for the run.
    #[serde(skip)]
    pub workspace: WorkspaceShape,
}

/// What a device backend counted for one sequence of a run (its weights, one cache, its
/// activations, and the peak of those), the caller's own plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OneSequence {
    /// Weights as the device holds them.
    pub weights_bytes: u64,
    /// One sequence's cache.
    pub kv_bytes: u64,
    /// The activations.
    pub scratch_bytes: u64,
    /// The peak of the three.
    pub total_bytes: u64,
}

impl OneSequence {
    /// The plan of `batch` such sequences, every cache allocated before the first forward
    /// (a device allocates a sequence's whole cache at once), with the workspace `shape`.
    ///
    /// # Errors
    /// [`ModelError::RunTooLarge`] when the caches' bytes overflow 64 bits.
    pub fn times(self, batch: usize, shape: WorkspaceShape) -> Result<MemoryPlan> {
        let too_large = || ModelError::RunTooLarge { what: "the device KV cache".into() };
        let kv = self.kv_bytes.checked_mul(batch.max(1) as u64).ok_or_else(too_large)?;
        let total = (self.total_bytes - self.kv_bytes).checked_add(kv).ok_or_else(too_large)?;
        Ok(MemoryPlan {
            weights_bytes: self.weights_bytes,
            kv_bytes: kv,
            scratch_bytes: self.scratch_bytes,
            workspace_bytes: self.scratch_bytes,
            attention_scores_bytes: 0,
            experts_bytes: 0,
            total_bytes: total,
            workspace: shape,
        })
    }
}

/// Rows of the largest prefill forward of `prompt_tokens` in chunks of `chunk` (0: the
/// backend's `default_chunk`), at least one.
pub fn prefill_rows(chunk: usize, prompt_tokens: usize, default_chunk: usize) -> usize {
    let chunk = if chunk == 0 { default_chunk } else { chunk };
    chunk.min(prompt_tokens).max(1)
}

/// What one forward of a device backend's run is sized by: the cache length planned for
/// each sequence, the rows of its largest prefill forward (at least the batch, which one
/// decode forward carries) and the rows of logits (one per sequence).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRun {
    /// Prompt plus generated tokens of one sequence.
    pub sequence_tokens: usize,
    /// Rows of the largest forward.
    pub rows: usize,
    /// Rows of logits.
    pub logit_rows: usize,
}

impl RunShape {
    /// A device backend's plan of this run: `one` counts one sequence (given the model's
    /// configuration with its context stretched over the run, since past the context the
    /// cache would be refused but its bytes are still planned, as the CPU's plan does, and
    /// the run's [`DeviceRun`], prefill rows by [`prefill_rows`] with `default_chunk`),
    /// and the batch's caches are added ([`OneSequence::times`]). The CUDA and wgpu
    /// backends plan through here.
    ///
    /// # Errors
    /// `one`'s, and [`ModelError::RunTooLarge`] when the caches' bytes overflow 64 bits.
    pub fn device_plan(
        &self,
        config: &ModelConfig,
        default_chunk: usize,
        one: impl FnOnce(&ModelConfig, DeviceRun) -> Result<OneSequence>,
    ) -> Result<MemoryPlan> {
        let batch = self.batch.max(1);
        let rows = prefill_rows(self.prefill_chunk, self.prompt_tokens, default_chunk).max(batch);
        let run = DeviceRun { sequence_tokens: self.sequence_tokens(), rows, logit_rows: batch };
        let mut config = config.clone();
        config.max_position_embeddings = config.max_position_embeddings.max(run.sequence_tokens);
        one(&config, run)?.times(batch, WorkspaceShape { rows, logit_rows: batch })
    }
}

/// Plans `run` for a model of `config` whose weights take `weights_bytes`.
///
/// # Errors
/// [`ModelError::RunTooLarge`] when a part, or the total, overflows 64 bits.
pub fn plan(config: &ModelConfig, weights_bytes: u64, run: &RunShape) -> Result<MemoryPlan> {
    let too_large = |what: &str| ModelError::RunTooLarge { what: what.to_string() };
    let batch = run.batch.max(1);
    let layout = KvLayout::new(config, run.kv_dtype);
    let tokens = run
        .prompt_tokens
        .checked_add(run.max_tokens)
        .ok_or_else(|| too_large("prompt plus generated tokens"))?;
    let kv_bytes = (layout.blocks_for(tokens) as u64)
        .checked_mul(layout.block_bytes())
        .and_then(|b| b.checked_mul(batch as u64))
        .ok_or_else(|| too_large("the KV cache"))?;
    let workspace = WorkspaceShape { rows: run.prefill_rows().max(batch), logit_rows: batch };
    let workspace_bytes = workspace.checked_bytes(config).ok_or_else(|| too_large("the workspace"))?;
    let attention_scores_bytes = match run.attention {
        AttentionKind::Streaming => 0,
        AttentionKind::Naive => max_naive_scores(config, run, tokens)
            .and_then(|v| v.checked_mul(4))
            .ok_or_else(|| too_large("the naive attention scores"))?,
    };
    let scratch_bytes =
        workspace_bytes.checked_add(attention_scores_bytes).ok_or_else(|| too_large("the scratch"))?;
    let total_bytes = weights_bytes
        .checked_add(kv_bytes)
        .and_then(|b| b.checked_add(scratch_bytes))
        .ok_or_else(|| too_large("the total"))?;
    Ok(MemoryPlan {
        weights_bytes,
        kv_bytes,
        scratch_bytes,
        workspace_bytes,
        attention_scores_bytes,
        experts_bytes: 0,
        total_bytes,
        workspace,
    })
}

impl MemoryPlan {
    /// The plan with an expert cache of `bytes` (its slots, allocated before the run).
    pub fn with_expert_cache(self, bytes: u64) -> Result<MemoryPlan> {
        let total_bytes = self
            .total_bytes
            .checked_add(bytes)
            .ok_or_else(|| ModelError::RunTooLarge { what: "the expert cache".into() })?;
        Ok(MemoryPlan { experts_bytes: self.experts_bytes + bytes, total_bytes, ..self })
    }
}

/// Values of the largest score matrix over the prefill chunks and the decode steps of a
/// run of `tokens` positions, `None` when it overflows 64 bits.
///
/// A chunk of `rows` rows ending at position `end` holds `heads * rows * end` scores.
/// Over the full chunks of `c` rows that grows with `end`, so the last full chunk (ending
/// at `c * floor(P / c)`) is their largest; a last partial chunk of `P mod c` rows ends at
/// `P`; a decode step is one row against at most every position of the run.
fn max_naive_scores(config: &ModelConfig, run: &RunShape, tokens: usize) -> Option<u64> {
    let heads = attn_shape(config).heads as u64;
    let p = run.prompt_tokens as u64;
    let c = run.prefill_rows().max(1) as u64;
    let full_end = p / c * c;
    let full = c.checked_mul(full_end)?;
    let partial = (p % c).checked_mul(p)?;
    let decode = tokens as u64;
    heads.checked_mul(full.max(partial).max(decode))
}

/// The head geometry of `config`.
pub fn attn_shape(config: &ModelConfig) -> AttnShape {
    AttnShape {
        heads: config.num_attention_heads,
        kv_heads: config.num_key_value_heads,
        head_dim: config.head_dim,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic;

    #[test]
    fn parts_add_up_and_chunking_bounds_the_workspace() {
        let info = synthetic::inspect("qwen2.5-0.5b").unwrap();
        let c = &info.config;
        let whole = plan(c, info.weight_bytes, &RunShape::single(2048, 128)).unwrap();
        assert_eq!(whole.total_bytes, whole.weights_bytes + whole.kv_bytes + whole.scratch_bytes);
        assert_eq!(whole.workspace.rows, 2048);
        // 24 layers x 2 x 128 values x 2 bytes per position, 9 blocks of 256.
        assert_eq!(whole.kv_bytes, 24 * 2 * 128 * 2 * 256 * 9);
        let chunked =
            plan(c, info.weight_bytes, &RunShape { prefill_chunk: 256, ..RunShape::single(2048, 128) })
                .unwrap();
        assert_eq!(chunked.workspace.rows, 256);
        assert!(chunked.scratch_bytes * 7 < whole.scratch_bytes);
        assert_eq!(chunked.kv_bytes, whole.kv_bytes);
    }

    #[test]
    fn naive_scores_grow_with_the_square_of_the_prompt() {
        let info = synthetic::inspect("tiny").unwrap();
        let c = &info.config;
        let naive = |p, chunk| {
            let run =
                RunShape { attention: AttentionKind::Naive, prefill_chunk: chunk, ..RunShape::single(p, 4) };
            plan(c, 0, &run).unwrap().attention_scores_bytes
        };
        assert_eq!(naive(100, 0), 4 * 4 * 100 * 100);
        assert_eq!(naive(200, 0), 4 * 4 * 200 * 200);
        // Chunks of 64 over 200: the last full chunk, rows 128..192, is the largest.
        assert_eq!(naive(200, 64), 4 * 4 * 64 * 192);
        assert_eq!(plan(c, 0, &RunShape::single(200, 4)).unwrap().attention_scores_bytes, 0);
        // A last partial chunk: 64-row chunks over 150 end with rows 128..150 (22 * 150 =
        // 3300 < 64 * 128 = 8192), a 1-row chunking's largest is its last row.
        assert_eq!(naive(150, 64), 4 * 4 * 64 * 128);
        assert_eq!(naive(150, 100), 4 * 4 * 100 * 100);
        assert_eq!(naive(190, 100), 4 * 4 * 90 * 190);
        assert_eq!(naive(200, 1), 4 * 4 * 204);
    }

    #[test]
    fn the_closed_form_matches_a_walk_over_the_chunks() {
        let info = synthetic::inspect("tiny").unwrap();
        let c = &info.config;
        let shape = attn_shape(c);
        for p in 1..80 {
            for chunk in 0..p + 2 {
                let run = RunShape {
                    attention: AttentionKind::Naive,
                    prefill_chunk: chunk,
                    ..RunShape::single(p, 3)
                };
                let rows = run.prefill_rows().max(1);
                let (mut most, mut start) = (shape.naive_scores(1, p + 3), 0);
                while start < p {
                    let r = rows.min(p - start);
                    most = most.max(shape.naive_scores(r, start + r));
                    start += r;
                }
                assert_eq!(
                    plan(c, 0, &run).unwrap().attention_scores_bytes,
                    4 * most as u64,
                    "p {p} chunk {chunk}"
                );
            }
        }
    }

    #[test]
    fn sizes_that_overflow_are_errors_and_huge_ones_plan_at_once() {
        let info = synthetic::inspect("tiny").unwrap();
        let c = &info.config;
        for (p, n) in [(usize::MAX, 1), (usize::MAX / 2, usize::MAX / 2 + 2), (1 << 62, 128)] {
            let e = plan(c, 0, &RunShape::single(p, n)).unwrap_err();
            assert!(matches!(e, ModelError::RunTooLarge { .. }), "{e}");
        }
        // 10^12 naive prompt tokens in chunks of 1: constant time, no loop per chunk.
        let run = RunShape {
            attention: AttentionKind::Naive,
            prefill_chunk: 1,
            ..RunShape::single(1_000_000_000_000, 1)
        };
        let p = plan(c, 0, &run).unwrap();
        assert_eq!(p.attention_scores_bytes, 4 * 4 * 1_000_000_000_001);
        assert_eq!(
            plan(c, u64::MAX, &RunShape::single(1, 1)).unwrap_err().to_string(),
            ModelError::RunTooLarge { what: "the total".into() }.to_string()
        );
    }
}
