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
//! Longer jobs (prefill chunks) split over (key/value head, block of query rows); each
//! task converts a tile of keys and values to f32 once and multiplies it, as matrices,
//! with every query head of the group and every row of its block.
//!
//! [`AttentionKind::Naive`] materialises the full score matrix `[heads, rows, context]`
//! from the pool, as implementations without a fused kernel do, so the quadratic memory
//! of long prompts can be reproduced and measured.
//!
//! Both leave the result in the query buffer, row-major `[rows, heads * head_dim]`.

use kiln_core::kernels::attn::{self, DecodeShape};
use rayon::prelude::*;

use crate::forward::kv_cache::{KV_BLOCK_TOKENS, KvCache};
use crate::forward::ops::{Strided, exp, exp_shifted_sum, gemm, max, scale};

/// f32 values in one stack tile of keys (and as many of values): 64 KiB, so a tile of
/// 256 keys of width 64 (or 128 of width 128) makes each product large enough to run at
/// matrix speed, while the two tiles and the scores stay well inside a thread's stack.
const TILE_VALUES: usize = 16384;

/// The widest head kiln runs.
pub const MAX_HEAD_DIM: usize = 512;

/// The most query heads per key/value head kiln runs (a decode task multiplies them as
/// one matrix against a tile of keys).
pub const MAX_GQA_GROUP: usize = 64;

/// Queries (rows times heads of a group) one streaming task carries at once.
const MAX_STATES: usize = 1024;

/// Query rows per streaming task in a prefill: enough for the tile products to run at
/// matrix speed, few enough that long prompts still split into many tasks.
const BLOCK_ROWS: usize = 64;

/// Query-key pairs below which a job runs on the calling thread.
const SERIAL_WORK: usize = 4096;

/// Rows of one sequence that go through the fused kernel, each as its own decode: a decode
/// step and a speculative verify (at most 33 rows, `--draft-tokens` 32 plus one), which
/// must reproduce decode exactly. Longer prefill chunks multiply tiles as matrices.
pub const FUSED_ROWS: usize = 64;

/// f32 scores of one tile for every query a task multiplies at once.
const SCORE_VALUES: usize = BLOCK_ROWS * KV_BLOCK_TOKENS;

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

    /// Query rows per streaming task: [`BLOCK_ROWS`], fewer when the group is so large
    /// that its states would not fit.
    fn block_rows(&self) -> usize {
        BLOCK_ROWS.min(MAX_STATES / self.group()).max(1)
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

/// Streaming attention for one sequence in `layer`: the fused kernel up to
/// [`FUSED_ROWS`] rows, tiled products beyond.
pub fn streaming(shape: &AttnShape, layer: usize, job: AttnJob<'_>) {
    let rows = job.q.len() / shape.q_dim();
    if rows <= FUSED_ROWS {
        let ds = DecodeShape::new(shape.group(), shape.head_dim);
        return attn::decode(&ds, shape.kv_heads, job.q, job.start, &job.cache.layer(layer));
    }
    let AttnJob { q, tmp, cache, start } = job;
    let w = shape.group() * shape.head_dim;
    let block_rows = shape.block_rows();
    let queries: &[f32] = q;
    let blocks = |h: usize, head_out: &mut [f32]| {
        for (b, out) in head_out.chunks_mut(block_rows * w).enumerate() {
            let r0 = b * block_rows;
            streaming_task(shape, layer, cache, queries, h, start + r0, r0, out);
        }
    };
    let all = &mut tmp[..rows * shape.q_dim()];
    // Query-key products of the whole job: a short decode step is cheaper run in place
    // than split among threads.
    if rows * (start + rows) * shape.heads < SERIAL_WORK {
        all.chunks_mut(rows * w).enumerate().for_each(|(h, out)| blocks(h, out));
    } else {
        all.par_chunks_mut(rows * w).enumerate().for_each(|(h, head_out)| {
            if rows <= block_rows {
                blocks(h, head_out);
            } else {
                head_out.par_chunks_mut(block_rows * w).enumerate().for_each(|(b, out)| {
                    let r0 = b * block_rows;
                    streaming_task(shape, layer, cache, queries, h, start + r0, r0, out);
                });
            }
        });
    }
    gather(tmp, shape.kv_heads, rows, w, q);
}

/// Queries of one streaming task that share positions and layout, multiplied as one
/// matrix: either the group's heads of a single row, or one head over a block of rows.
struct QueryMatrix<'a> {
    /// `[m, head_dim]`, row stride `rs`.
    q: Strided<'a>,
    m: usize,
    /// Position of row `r` is `pos0 + r * pos_step`.
    pos0: usize,
    pos_step: usize,
    /// Output row `r` starts at `out_off + r * out_rs` in the task's output.
    out_off: usize,
    out_rs: usize,
    /// Running maximum and sum of row `r` are entry `state_off + r`.
    state_off: usize,
}

/// One task: key/value head `h`, query rows `r0..` (at positions `pos0..`), writing the
/// group's heads for those rows into `out` (`[rows, group * head_dim]`).
#[allow(clippy::too_many_arguments)]
fn streaming_task(
    shape: &AttnShape,
    layer: usize,
    cache: &KvCache,
    q: &[f32],
    h: usize,
    pos0: usize,
    r0: usize,
    out: &mut [f32],
) {
    let (g, hd, q_dim) = (shape.group(), shape.head_dim, shape.q_dim());
    let w = g * hd;
    let nr = out.len() / w;
    let tile = shape.tile();
    let mut kt = [0f32; TILE_VALUES];
    let mut vt = [0f32; TILE_VALUES];
    let mut s = [0f32; SCORE_VALUES];
    let mut m = [f32::NEG_INFINITY; MAX_STATES];
    let mut l = [0f32; MAX_STATES];
    out.fill(0.0);
    let end_max = pos0 + nr;
    let mut t0 = 0;
    while t0 < end_max {
        let n = tile.min(end_max - t0);
        cache.read(layer, false, h, t0, n, &mut kt);
        cache.read(layer, true, h, t0, n, &mut vt);
        let (kt, vt) = (&kt[..n * hd], &vt[..n * hd]);
        if nr == 1 {
            // Decode: the group's heads of one row are contiguous, one matrix of g rows.
            let qm = QueryMatrix {
                q: Strided { data: &q[r0 * q_dim + h * w..(r0 + 1) * q_dim], rs: hd, cs: 1 },
                m: g,
                pos0,
                pos_step: 0,
                out_off: 0,
                out_rs: hd,
                state_off: 0,
            };
            tile_update(shape, &qm, t0, n, kt, vt, &mut s, &mut m, &mut l, out);
        } else {
            for j in 0..g {
                let qm = QueryMatrix {
                    q: Strided { data: &q[r0 * q_dim + (h * g + j) * hd..], rs: q_dim, cs: 1 },
                    m: nr,
                    pos0,
                    pos_step: 1,
                    out_off: j * hd,
                    out_rs: w,
                    state_off: j * nr,
                };
                tile_update(shape, &qm, t0, n, kt, vt, &mut s, &mut m, &mut l, out);
            }
        }
        t0 += n;
    }
    for i in 0..nr {
        for j in 0..g {
            let st = if nr == 1 { j } else { j * nr + i };
            let acc = &mut out[i * w + j * hd..i * w + (j + 1) * hd];
            scale(acc, 1.0 / l[st]);
        }
    }
}

/// Folds keys and values `t0..t0 + n` (`kt`, `vt`: `[n, head_dim]`) into the running
/// softmax of every query of `qm`.
#[allow(clippy::too_many_arguments)]
fn tile_update(
    shape: &AttnShape,
    qm: &QueryMatrix<'_>,
    t0: usize,
    n: usize,
    kt: &[f32],
    vt: &[f32],
    s: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
    out: &mut [f32],
) {
    let hd = shape.head_dim;
    let softmax_scale = 1.0 / (hd as f32).sqrt();
    let s = &mut s[..qm.m * n];
    // Scores: s[m, n] = scale * q[m, hd] k[n, hd]^T.
    gemm(qm.m, hd, n, softmax_scale, qm.q, Strided { data: kt, rs: 1, cs: hd }, 0.0, s, n);
    for (r, row) in s.chunks_exact_mut(n).enumerate() {
        let end = qm.pos0 + r * qm.pos_step + 1;
        let valid = end.saturating_sub(t0).min(n);
        let st = qm.state_off + r;
        if valid == 0 {
            // Every key of this tile lies after this query: it contributes nothing.
            row.fill(0.0);
            continue;
        }
        let mx = max(&row[..valid]).max(m[st]);
        let corr = exp(m[st] - mx);
        let sum = exp_shifted_sum(&mut row[..valid], mx);
        row[valid..].fill(0.0);
        l[st] = l[st] * corr + sum;
        m[st] = mx;
        if corr != 1.0 {
            let o = qm.out_off + r * qm.out_rs;
            scale(&mut out[o..o + hd], corr);
        }
    }
    // Values: out[m, hd] += p[m, n] v[n, hd].
    let p = Strided { data: s, rs: n, cs: 1 };
    gemm(qm.m, n, hd, 1.0, p, Strided { data: vt, rs: hd, cs: 1 }, 1.0, &mut out[qm.out_off..], qm.out_rs);
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
