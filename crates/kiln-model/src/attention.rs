//! Causal grouped-query attention of one sequence's new rows over its KV cache.
//!
//! [`AttentionKind::Streaming`] (the default) walks the keys in tiles with an online
//! softmax: per query it keeps only a running maximum, a running sum and the output
//! accumulator, so its memory is a few tiles on the stack whatever the prompt length.
//! Work is split over (key/value head, block of query rows); each task converts a tile
//! of keys and values to f32 once and uses it for every query head of the group and every
//! row of its block.
//!
//! [`AttentionKind::Naive`] materialises the full score matrix `[heads, rows, context]`
//! from the pool, as implementations without a fused kernel do, so the quadratic memory
//! of long prompts can be reproduced and measured.
//!
//! Both leave the result in the query buffer, row-major `[rows, heads * head_dim]`.

use rayon::prelude::*;

use crate::kv_cache::{KV_BLOCK_TOKENS, KvCache};
use crate::ops::{axpy, dot, exp, scale};

/// f32 values in one stack tile of keys (and as many of values).
const TILE_VALUES: usize = 4096;

/// The widest head the stack tiles hold eight keys of.
pub const MAX_HEAD_DIM: usize = TILE_VALUES / 8;

/// Queries (rows times heads of a group) one streaming task carries at once.
const MAX_STATES: usize = 64;

/// Which attention implementation runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// Tiled online softmax; memory independent of the sequence length.
    #[default]
    Streaming,
    /// Materialised scores; memory grows with rows times context.
    Naive,
}

impl AttentionKind {
    /// `streaming` or `naive`.
    pub fn as_str(self) -> &'static str {
        match self {
            AttentionKind::Streaming => "streaming",
            AttentionKind::Naive => "naive",
        }
    }
}

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

/// Streaming attention for one sequence in `layer`.
pub fn streaming(shape: &AttnShape, layer: usize, job: AttnJob<'_>) {
    let AttnJob { q, tmp, cache, start } = job;
    let (g, hd) = (shape.group(), shape.head_dim);
    let w = g * hd;
    let rows = q.len() / shape.q_dim();
    let block_rows = (MAX_STATES / g).max(1);
    let queries: &[f32] = q;
    tmp[..rows * shape.q_dim()].par_chunks_mut(rows * w).enumerate().for_each(|(h, head_out)| {
        head_out.par_chunks_mut(block_rows * w).enumerate().for_each(|(b, out)| {
            let r0 = b * block_rows;
            streaming_task(shape, layer, cache, queries, h, start + r0, r0, out);
        });
    });
    gather(tmp, shape.kv_heads, rows, w, q);
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
    let softmax_scale = 1.0 / (hd as f32).sqrt();
    let mut kt = [0f32; TILE_VALUES];
    let mut vt = [0f32; TILE_VALUES];
    let mut s = [0f32; KV_BLOCK_TOKENS];
    let mut m = [f32::NEG_INFINITY; MAX_STATES];
    let mut l = [0f32; MAX_STATES];
    out.fill(0.0);
    let end_max = pos0 + nr;
    let mut t0 = 0;
    while t0 < end_max {
        let n = tile.min(end_max - t0);
        cache.read(layer, false, h, t0, n, &mut kt);
        cache.read(layer, true, h, t0, n, &mut vt);
        for i in 0..nr {
            let end_i = pos0 + i + 1;
            if t0 >= end_i {
                continue;
            }
            let ni = n.min(end_i - t0);
            let qrow = &q[(r0 + i) * q_dim..(r0 + i + 1) * q_dim];
            for j in 0..g {
                let qv = &qrow[(h * g + j) * hd..(h * g + j + 1) * hd];
                let st = i * g + j;
                let acc = &mut out[i * w + j * hd..i * w + (j + 1) * hd];
                let mut mx = m[st];
                for (t, sv) in s[..ni].iter_mut().enumerate() {
                    let v = dot(qv, &kt[t * hd..(t + 1) * hd]) * softmax_scale;
                    *sv = v;
                    mx = mx.max(v);
                }
                let corr = exp(m[st] - mx);
                let mut sum = 0f32;
                for sv in &mut s[..ni] {
                    let p = exp(*sv - mx);
                    *sv = p;
                    sum += p;
                }
                l[st] = l[st] * corr + sum;
                if corr != 1.0 {
                    scale(acc, corr);
                }
                for (t, &p) in s[..ni].iter().enumerate() {
                    axpy(p, &vt[t * hd..(t + 1) * hd], acc);
                }
                m[st] = mx;
            }
        }
        t0 += n;
    }
    for i in 0..nr {
        for j in 0..g {
            let st = i * g + j;
            let acc = &mut out[i * w + j * hd..i * w + (j + 1) * hd];
            scale(acc, 1.0 / l[st]);
        }
    }
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
            let mut buf = [0f32; TILE_VALUES];
            let mut t0 = 0;
            while t0 < ctx {
                let n = tile.min(ctx - t0);
                cache.read(layer, false, kvh, t0, n, &mut buf);
                for i in 0..rows {
                    let qv = &queries[i * q_dim + head * hd..i * q_dim + (head + 1) * hd];
                    let row = &mut sc[i * ctx..(i + 1) * ctx];
                    for t in 0..n {
                        row[t0 + t] = if t0 + t <= start + i {
                            dot(qv, &buf[t * hd..(t + 1) * hd]) * softmax_scale
                        } else {
                            f32::NEG_INFINITY
                        };
                    }
                }
                t0 += n;
            }
            for row in sc.chunks_exact_mut(ctx) {
                let mx = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let mut sum = 0f32;
                for v in row.iter_mut() {
                    *v = exp(*v - mx);
                    sum += *v;
                }
                scale(row, 1.0 / sum);
            }
            out.fill(0.0);
            let mut t0 = 0;
            while t0 < ctx {
                let n = tile.min(ctx - t0);
                cache.read(layer, true, kvh, t0, n, &mut buf);
                for i in 0..rows {
                    let acc = &mut out[i * hd..(i + 1) * hd];
                    let end = (start + i + 1).min(t0 + n);
                    for t in t0..end {
                        axpy(sc[i * ctx + t], &buf[(t - t0) * hd..(t - t0 + 1) * hd], acc);
                    }
                }
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
