//! Causal grouped-query attention of one sequence's new rows over its KV cache.
//!
//! [`AttentionKind::Streaming`] (the default) walks the keys with an online softmax: per
//! query it keeps only a running maximum, a running sum and the output accumulator, so
//! its memory is a few tiles on the stack whatever the prompt length.
//!
//! A decode step, and any job of at most [`FUSED_ROWS`] rows (a speculative verify among
//! them, each row computed as its own decode), runs kiln-core's fused kernel
//! ([`kiln_core::kernels::attn::decode`]): the group's query heads read their key/value
//! head's cache once, in place, in its f16 or f32 storage. Work is split over (row,
//! key/value head, span of keys), on the calling thread for short caches, and the partial
//! softmax states of one head's spans are merged in order at the end, so a row's result
//! depends on its position alone.
//!
//! Longer jobs (prefill chunks) run kiln-core's tiled prefill kernel
//! ([`kiln_core::kernels::attn::prefill`]): tasks over (block of query rows, key/value
//! head), each converting a tile of keys and values to f32 once for every query head of
//! the group and every row of its block, an online softmax per row, products on register
//! tiles, and the tiles past a block's last position skipped.
//!
//! [`AttentionKind::Naive`] materialises the full score matrix `[heads, rows, context]`
//! from the pool, as implementations without a fused kernel do, so the quadratic memory
//! of long prompts can be reproduced and measured.
//!
//! Both leave the result in the query buffer, row-major `[rows, heads * head_dim]`.

use kiln_core::kernels::attn::{self, DecodeShape};
use rayon::prelude::*;

use crate::forward::kv_cache::{KV_BLOCK_TOKENS, KvCache};
use crate::forward::ops::{Strided, exp_shifted_sum, gemm, max, scale};

/// f32 values in one stack tile of keys (and as many of values): 64 KiB, so a tile of
/// 256 keys of width 64 (or 128 of width 128) makes each product large enough to run at
/// matrix speed, while the two tiles and the scores stay well inside a thread's stack.
const TILE_VALUES: usize = 16384;

/// The widest head kiln runs.
pub const MAX_HEAD_DIM: usize = 512;

/// The most query heads per key/value head kiln runs (a decode task multiplies them as
/// one matrix against a tile of keys).
pub const MAX_GQA_GROUP: usize = 64;

/// Rows of one sequence that go through the fused kernel, each as its own decode: a decode
/// step and a speculative verify (at most 33 rows, `--draft-tokens` 32 plus one), which
/// must reproduce decode exactly. Longer prefill chunks run the tiled prefill kernel.
pub const FUSED_ROWS: usize = 64;

/// Which attention implementation runs: the protocol's `--attention` knob.
pub use kiln_protocol::Attention as AttentionKind;

/// The head geometry attention needs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

impl AttnShape {
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Keys per tile: the largest power of two whose keys fill at most one stack tile,
    /// capped at the cache block so a tile never straddles blocks.
    pub fn tile(&self) -> usize {
        let fit = (TILE_VALUES / self.head_dim.max(1)).max(1);
        (1usize << fit.ilog2()).min(KV_BLOCK_TOKENS)
    }

    /// f32 values the naive score matrix takes for `rows` queries ending at `context`.
    pub fn naive_scores(&self, rows: usize, context: usize) -> usize {
        self.heads * rows * context
    }
}

/// One sequence's attention job in one layer.
pub struct AttnJob<'a> {
    /// Queries after RoPE, `[rows, heads * head_dim]`; replaced by the output.
    pub q: &'a mut [f32],
    /// Scratch of the same size.
    pub tmp: &'a mut [f32],
    /// The cache, holding (at least reserved and written) positions `0..start + rows`.
    pub cache: &'a KvCache,
    /// Position of the first row.
    pub start: usize,
}

/// Streaming attention for one sequence in `layer`: the fused decode kernel up to
/// [`FUSED_ROWS`] rows, the tiled prefill kernel beyond.
pub fn streaming(shape: &AttnShape, layer: usize, job: AttnJob<'_>) {
    let rows = job.q.len() / shape.q_dim();
    let ds = DecodeShape::new(shape.group(), shape.head_dim);
    if rows <= FUSED_ROWS {
        return attn::decode(&ds, shape.kv_heads, job.q, job.start, &job.cache.layer(layer));
    }
    attn::prefill(&ds, shape.kv_heads, job.q, job.tmp, job.start, &job.cache.layer(layer));
}

/// Naive attention for one sequence in `layer`, materialising scores in `scores`
/// (at least [`AttnShape::naive_scores`] values).
pub fn naive(shape: &AttnShape, layer: usize, job: AttnJob<'_>, scores: &mut [f32]) {
    let AttnJob { q, tmp, cache, start } = job;
    let (g, hd, q_dim) = (shape.group(), shape.head_dim, shape.q_dim());
    let rows = q.len() / q_dim;
    let ctx = start + rows;
    let tile = shape.tile();
    let softmax_scale = 1.0 / (hd as f32).sqrt();
    let queries: &[f32] = q;
    scores[..shape.naive_scores(rows, ctx)]
        .par_chunks_mut(rows * ctx)
        .zip(tmp[..rows * q_dim].par_chunks_mut(rows * hd))
        .enumerate()
        .for_each(|(head, (sc, out))| {
            let kvh = head / g;
            let qv = Strided { data: &queries[head * hd..], rs: q_dim, cs: 1 };
            let mut buf = [0f32; TILE_VALUES];
            let mut t0 = 0;
            while t0 < ctx {
                let n = tile.min(ctx - t0);
                cache.read(layer, false, kvh, t0, n, &mut buf);
                let kv = Strided { data: &buf[..n * hd], rs: 1, cs: hd };
                gemm(rows, hd, n, softmax_scale, qv, kv, 0.0, &mut sc[t0..], ctx);
                t0 += n;
            }
            for (i, row) in sc.chunks_exact_mut(ctx).enumerate() {
                row[start + i + 1..].fill(f32::NEG_INFINITY);
                let mx = max(row);
                let sum = exp_shifted_sum(row, mx);
                scale(row, 1.0 / sum);
            }
            let mut t0 = 0;
            while t0 < ctx {
                let n = tile.min(ctx - t0);
                cache.read(layer, true, kvh, t0, n, &mut buf);
                let p = Strided { data: &sc[t0..], rs: ctx, cs: 1 };
                let beta = if t0 == 0 { 0.0 } else { 1.0 };
                gemm(rows, n, hd, 1.0, p, Strided { data: &buf[..n * hd], rs: hd, cs: 1 }, beta, out, hd);
                t0 += n;
            }
        });
    gather(tmp, shape.heads, rows, hd, q);
}

/// Writes `src` (`[groups, rows, width]`) into `dst` as `[rows, groups * width]`.
fn gather(src: &[f32], groups: usize, rows: usize, width: usize, dst: &mut [f32]) {
    for r in 0..rows {
        for gi in 0..groups {
            dst[r * groups * width + gi * width..r * groups * width + (gi + 1) * width]
                .copy_from_slice(&src[(gi * rows + r) * width..(gi * rows + r + 1) * width]);
        }
    }
}
