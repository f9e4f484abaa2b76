//! The memory plan of a run: bytes of weights, KV cache and scratch for a prompt length,
//! a number of generated tokens, an attention implementation and a prefill chunking.
//!
//! The same figures size the real allocations (the workspace is allocated from
//! [`MemoryPlan::workspace`], the cache grows in the blocks counted here), so `kiln
//! estimate` predicts `kiln bench-decode`'s pool peak from first principles rather than
//! from a fitted model. With streaming attention the prediction is an upper bound that
//! overshoots only by the rounding of the cache's last block; with naive attention it
//! also counts the largest score matrix, held while the cache is at most as full.

use crate::attention::{AttentionKind, AttnShape};
use crate::config::ModelConfig;
use crate::kv_cache::{KvDtype, KvLayout};

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
        }
    }

    /// Rows of the largest prefill forward.
    pub fn prefill_rows(&self) -> usize {
        match self.prefill_chunk {
            0 => self.prompt_tokens,
            c => c.min(self.prompt_tokens),
        }
    }

    /// Positions each sequence's cache must hold.
    pub fn sequence_tokens(&self) -> usize {
        self.prompt_tokens + self.max_tokens
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
    /// q, k, v, attention scratch, gate, up, and a row of RoPE cosines and sines.
    pub fn values_per_row(config: &ModelConfig) -> usize {
        3 * config.hidden_size
            + 2 * config.q_dim()
            + 2 * config.kv_dim()
            + 2 * config.intermediate_size
            + config.head_dim
    }

    /// Bytes a workspace of this shape allocates for `config`.
    pub fn bytes(&self, config: &ModelConfig) -> u64 {
        let values = self.rows * Self::values_per_row(config) + self.logit_rows * config.vocab_size;
        values as u64 * 4
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
    /// The predicted peak: weights + KV + scratch.
    pub total_bytes: u64,
    /// The workspace to allocate for the run.
    #[serde(skip)]
    pub workspace: WorkspaceShape,
}

/// Plans `run` for a model of `config` whose weights take `weights_bytes`.
pub fn plan(config: &ModelConfig, weights_bytes: u64, run: &RunShape) -> MemoryPlan {
    let batch = run.batch.max(1);
    let layout = KvLayout::new(config, run.kv_dtype);
    let kv_bytes = batch as u64 * layout.bytes_for(run.sequence_tokens());
    let workspace = WorkspaceShape { rows: run.prefill_rows().max(batch), logit_rows: batch };
    let workspace_bytes = workspace.bytes(config);
    let attention_scores_bytes = match run.attention {
        AttentionKind::Streaming => 0,
        AttentionKind::Naive => 4 * max_naive_scores(config, run) as u64,
    };
    let scratch_bytes = workspace_bytes + attention_scores_bytes;
    MemoryPlan {
        weights_bytes,
        kv_bytes,
        scratch_bytes,
        workspace_bytes,
        attention_scores_bytes,
        total_bytes: weights_bytes + kv_bytes + scratch_bytes,
        workspace,
    }
}

/// The largest score matrix over the prefill chunks and the decode steps.
fn max_naive_scores(config: &ModelConfig, run: &RunShape) -> usize {
    let shape = attn_shape(config);
    let chunk = run.prefill_rows().max(1);
    let mut most = 0;
    let mut start = 0;
    while start < run.prompt_tokens {
        let rows = chunk.min(run.prompt_tokens - start);
        most = most.max(shape.naive_scores(rows, start + rows));
        start += rows;
    }
    // A decode step of one sequence sees at most every position of the run.
    most.max(shape.naive_scores(1, run.sequence_tokens()))
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
        let whole = plan(c, info.weight_bytes, &RunShape::single(2048, 128));
        assert_eq!(whole.total_bytes, whole.weights_bytes + whole.kv_bytes + whole.scratch_bytes);
        assert_eq!(whole.workspace.rows, 2048);
        // 24 layers x 2 x 128 values x 2 bytes per position, 9 blocks of 256.
        assert_eq!(whole.kv_bytes, 24 * 2 * 128 * 2 * 256 * 9);
        let chunked =
            plan(c, info.weight_bytes, &RunShape { prefill_chunk: 256, ..RunShape::single(2048, 128) });
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
            plan(c, 0, &run).attention_scores_bytes
        };
        assert_eq!(naive(100, 0), 4 * 4 * 100 * 100);
        assert_eq!(naive(200, 0), 4 * 4 * 200 * 200);
        // Chunks of 64 over 200: the last full chunk, rows 128..192, is the largest.
        assert_eq!(naive(200, 64), 4 * 4 * 64 * 192);
        assert_eq!(plan(c, 0, &RunShape::single(200, 4)).attention_scores_bytes, 0);
    }
}
