//! The decoder forward pass: embedding, then per layer RMSNorm, q/k/v projections (with
//! Qwen3's per-head q/k RMSNorm), RoPE, attention over the KV cache, o_proj and the
//! residual, RMSNorm, the MLP (SwiGLU, or a mixture of experts in `moe.rs`, read through
//! the expert cache when the engine has one) and the residual; then the final norm and
//! the LM head (the embedding matrix when tied).
//!
//! One forward carries any number of sequences, each with any number of new tokens: the
//! projections run once over all their rows (M = total rows, so batched decode reaches
//! `qmv_wide` and prefill reaches `qmm`), attention runs per sequence over its own cache.
//! Every row is computed by the same operations whatever else shares the forward, so a
//! sequence decoded in a batch matches it decoded alone up to the kernels' own rounding.
//! A one-row forward (a decode step) runs the projections that read the same input (q|k|v,
//! gate|up) as one `qmv_many` region, and o_proj, down_proj and the head through it too,
//! for its task sizes and its one-thread path; the logits are the same bits as one product
//! at a time ([`Transformer::set_fused_decode`] turns it off for comparisons).

use std::sync::Mutex;

use rayon::prelude::*;

use crate::error::{ModelError, Result};
use crate::forward::attention::{self, AttentionKind, AttnJob, AttnShape, MAX_GQA_GROUP, MAX_HEAD_DIM};
use crate::forward::expert_cache::ExpertCache;
use crate::forward::kv_cache::{KvCache, KvDtype, KvLayout};
use crate::forward::moe::{self, MoeBufs};
use crate::forward::ops::{add_in_place, rms_norm, silu_mul};
use crate::forward::plan::attn_shape;
use crate::forward::rope::Rope;
use crate::forward::weights::{Linear, LinearWeight, Mlp, ModelWeights, RmsNorm};
use crate::forward::workspace::Workspace;
use crate::loading::config::ModelConfig;
use kiln_core::Tag;
use kiln_core::kernels::{KernelChoice, QmvPart, qmv_many, select_kernel};

/// New tokens of one sequence in a forward, and its cache (the CPU's unless a backend
/// names its own, [`crate::backend::BackendEngine::Cache`]).
pub struct SeqChunk<'a, C = KvCache> {
    /// The sequence's cache; the tokens land at positions `cache.len()..`.
    pub cache: &'a mut C,
    /// The new tokens.
    pub tokens: &'a [u32],
}

/// Which rows of logits a forward returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// None: a prefill chunk that is not the last skips the LM head.
    None,
    /// The last row of each sequence, in order.
    Last,
    /// Every row.
    All,
}

/// A model's weights bound to its configuration, ready to run forwards.
pub struct Transformer<'m> {
    config: &'m ModelConfig,
    weights: &'m ModelWeights,
    rope: Rope,
    shape: AttnShape,
    attention: AttentionKind,
    /// The expert cache of a MoE model run with `--expert-slots`; `None` reads every
    /// expert from its backing store. Locked once per forward.
    experts: Option<Mutex<ExpertCache>>,
    /// Whether a one-row forward runs the projections that share an input in one region
    /// ([`Transformer::set_fused_decode`]).
    fused: bool,
}

impl<'m> Transformer<'m> {
    /// Checks every weight's shape against `config`.
    pub fn new(config: &'m ModelConfig, weights: &'m ModelWeights, attention: AttentionKind) -> Result<Self> {
        check_shapes(config, weights)?;
        Ok(Transformer {
            config,
            weights,
            rope: Rope::new(config),
            shape: attn_shape(config),
            attention,
            experts: None,
            fused: true,
        })
    }

    /// Whether a one-row forward (a decode step) runs q, k and v, and gate and up, each as
    /// one parallel region with the activations quantized once (the default), or every
    /// projection on its own. The logits are bit-identical either way; the switch exists so
    /// tests and benchmarks can compare the two.
    pub fn set_fused_decode(&mut self, fused: bool) {
        self.fused = fused;
    }

    /// Reads the routed experts through `cache` from now on.
    pub fn set_expert_cache(&mut self, cache: ExpertCache) {
        self.experts = Some(Mutex::new(cache));
    }

    /// The expert cache, when there is one.
    pub fn expert_cache(&self) -> Option<std::sync::MutexGuard<'_, ExpertCache>> {
        self.experts.as_ref().map(|m| m.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The configuration.
    pub fn config(&self) -> &'m ModelConfig {
        self.config
    }

    /// The weights.
    pub fn weights(&self) -> &'m ModelWeights {
        self.weights
    }

    /// The attention implementation in use.
    pub fn attention(&self) -> AttentionKind {
        self.attention
    }

    /// The cache layout of this model stored as `dtype`.
    pub fn kv_layout(&self, dtype: KvDtype) -> KvLayout {
        KvLayout::new(self.config, dtype)
    }

    /// Runs the new tokens of every sequence in `seqs` through the model, appends their
    /// keys and values to the caches, and returns the requested logits (`[rows, vocab]`).
    ///
    /// Nothing is appended when an error is returned: a refused allocation leaves every
    /// cache as it was.
    pub fn forward<'w>(
        &self,
        ws: &'w mut Workspace,
        seqs: &mut [SeqChunk<'_>],
        logits: Logits,
    ) -> Result<&'w [f32]> {
        let c = self.config;
        let rows: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        if rows == 0 || seqs.iter().any(|s| s.tokens.is_empty()) {
            return Err(ModelError::InvalidArgument {
                what: "forward input".into(),
                message: "every sequence needs at least one new token".into(),
            });
        }
        for s in seqs.iter() {
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(ModelError::InvalidArgument {
                    what: "token id".into(),
                    message: format!("{t} is outside the vocabulary: accepted ids are 0..{}", c.vocab_size),
                });
            }
            kiln_protocol::check_context(s.cache.len(), s.tokens.len(), c.max_position_embeddings)
                .map_err(|e| ModelError::ContextExceeded { requested: e.requested, limit: e.limit })?;
        }
        let logit_rows = match logits {
            Logits::None => 0,
            Logits::Last => seqs.len(),
            Logits::All => rows,
        };
        ws.ensure(c, rows, logit_rows)?;
        // The other workers spin between this forward's regions instead of parking.
        kiln_core::workers::keep_warm();
        for s in seqs.iter_mut() {
            let end = s.cache.len() + s.tokens.len();
            s.cache.reserve(end)?;
        }
        let mut scores = match self.attention {
            AttentionKind::Streaming => None,
            AttentionKind::Naive => {
                let most = seqs
                    .iter()
                    .map(|s| self.shape.naive_scores(s.tokens.len(), s.cache.len() + s.tokens.len()))
                    .max()
                    .unwrap_or(0);
                Some(ws.pool().alloc_zeroed::<f32>(Tag::Scratch, most)?)
            }
        };

        let (h, q_dim, kv_dim, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.mlp_width());
        let mut cache = self.expert_cache();
        let half = c.head_dim / 2;
        let b = &mut ws.bufs;
        let x = &mut b.x[..rows * h];
        let xn = &mut b.xn[..rows * h];
        let proj = &mut b.proj[..rows * h];
        let q = &mut b.q[..rows * q_dim];
        let tmp = &mut b.tmp[..rows * q_dim];
        let k = &mut b.k[..rows * kv_dim];
        let v = &mut b.v[..rows * kv_dim];
        let gate = &mut b.gate[..rows * inter];
        let up = &mut b.up[..rows * inter];
        let cos = &mut b.cos[..rows * half];
        let sin = &mut b.sin[..rows * half];
        let experts = c.moe.map_or(0, |m| m.experts);
        let router = &mut b.router[..rows * experts];
        let (xe, ye) = if experts > 0 {
            (&mut b.xe[..rows * h], &mut b.ye[..rows * h])
        } else {
            (&mut b.xe[..0], &mut b.ye[..0])
        };

        let mut r = 0;
        for s in seqs.iter() {
            let start = s.cache.len();
            for (i, &t) in s.tokens.iter().enumerate() {
                self.weights.embed_tokens.row(t as usize, &mut x[r * h..(r + 1) * h]);
                self.rope.angles(
                    start + i,
                    &mut cos[r * half..(r + 1) * half],
                    &mut sin[r * half..(r + 1) * half],
                );
                r += 1;
            }
        }

        for (l, layer) in self.weights.layers.iter().enumerate() {
            norm(&layer.input_layernorm, x, xn);
            self.project(
                xn,
                rows,
                [(&layer.q_proj, &mut *q), (&layer.k_proj, &mut *k), (&layer.v_proj, &mut *v)],
            );
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                head_norm(qn, q);
                head_norm(kn, k);
            }
            self.apply_rope(q, q_dim, cos, sin);
            self.apply_rope(k, kv_dim, cos, sin);
            let mut r = 0;
            for s in seqs.iter_mut() {
                let start = s.cache.len();
                for i in 0..s.tokens.len() {
                    let (kr, vr) = (&k[r * kv_dim..(r + 1) * kv_dim], &v[r * kv_dim..(r + 1) * kv_dim]);
                    s.cache.store(l, start + i, kr, vr);
                    r += 1;
                }
            }
            self.attend(l, seqs, q, tmp, scores.as_deref_mut());
            self.project(q, rows, [(&layer.o_proj, &mut *proj)]);
            add_in_place(x, proj);
            norm(&layer.post_attention_layernorm, x, xn);
            match &layer.mlp {
                Mlp::Dense(mlp) => {
                    self.project(xn, rows, [(&mlp.gate_proj, &mut *gate), (&mlp.up_proj, &mut *up)]);
                    silu_mul(gate, up);
                    self.project(gate, rows, [(&mlp.down_proj, &mut *proj)]);
                }
                Mlp::Moe(mlp) => {
                    let (Some(cfg), Some(store)) = (&c.moe, &self.weights.experts) else {
                        unreachable!("check_shapes requires a MoE config and an expert store")
                    };
                    let bufs = MoeBufs {
                        router: &mut *router,
                        xe: &mut *xe,
                        ye: &mut *ye,
                        gate: &mut *gate,
                        up: &mut *up,
                    };
                    moe::forward(mlp, cfg, store, cache.as_deref_mut(), l, xn, rows, h, proj, bufs);
                }
            }
            add_in_place(x, proj);
        }
        drop(scores);
        for s in seqs.iter_mut() {
            s.cache.commit(s.tokens.len());
        }

        if logit_rows == 0 {
            return Ok(&b.logits[..0]);
        }
        let selected = &mut xn[..logit_rows * h];
        match logits {
            Logits::All => rms_norm(x, &self.weights.norm.weight, self.weights.norm.eps, selected),
            _ => {
                let mut end = 0;
                for (j, s) in seqs.iter().enumerate() {
                    end += s.tokens.len();
                    let row = &x[(end - 1) * h..end * h];
                    rms_norm(
                        row,
                        &self.weights.norm.weight,
                        self.weights.norm.eps,
                        &mut selected[j * h..(j + 1) * h],
                    );
                }
            }
        }
        let out = &mut b.logits[..logit_rows * c.vocab_size];
        match (&self.weights.lm_head, &self.weights.embed_tokens) {
            (Some(head), _) => self.project(selected, logit_rows, [(head, out)]),
            (None, LinearWeight::Quantized(w)) if self.fused && logit_rows == 1 => {
                qmv_many(selected, &mut [QmvPart { w, y: &mut *out, bias: None }])
            }
            (None, embed) => embed.matmul(selected, logit_rows, out),
        }
        Ok(out)
    }

    /// `y_i = x W_i^T + b_i` for linears that read the same `rows` rows `x`. A single row
    /// of a fused transformer (a decode step) runs them as one [`qmv_many`] region when
    /// every matrix is quantized, and so does each row of a batch the kernels run one row
    /// at a time (`QmvPerRow`, where the measured crossover puts `qmv` per row ahead of
    /// `qmv_wide`): a batched step then costs what its rows cost one by one, not more
    /// regions than that. Otherwise each runs on its own. All give the same bits.
    fn project<const N: usize>(&self, x: &[f32], rows: usize, outs: [(&Linear, &mut [f32]); N]) {
        let all_quantized = outs.iter().all(|(l, _)| matches!(l.weight, LinearWeight::Quantized(_)));
        let k = x.len() / rows.max(1);
        let per_row = rows == 1
            || outs.iter().all(|(l, _)| select_kernel(rows, k, l.weight.n()) == KernelChoice::QmvPerRow);
        if !(self.fused && per_row && all_quantized) {
            for (l, y) in outs {
                l.forward(x, rows, y);
            }
            return;
        }
        let mut parts = outs.map(|(l, y)| {
            let LinearWeight::Quantized(w) = &l.weight else { unreachable!("checked above") };
            (w, l.bias.as_deref(), y)
        });
        for (r, xr) in x.chunks_exact(k).enumerate() {
            let mut row_parts = parts.each_mut().map(|(w, bias, y)| {
                let n = w.n();
                QmvPart { w, y: &mut y[r * n..(r + 1) * n], bias: *bias }
            });
            qmv_many(xr, &mut row_parts);
        }
    }

    fn apply_rope(&self, x: &mut [f32], width: usize, cos: &[f32], sin: &[f32]) {
        let half = self.rope.half();
        let one = |(r, row): (usize, &mut [f32])| {
            self.rope.apply(row, &cos[r * half..(r + 1) * half], &sin[r * half..(r + 1) * half]);
        };
        if x.len() / width > 16 {
            x.par_chunks_mut(width).enumerate().for_each(one);
        } else {
            x.chunks_mut(width).enumerate().for_each(one);
        }
    }

    fn attend(
        &self,
        layer: usize,
        seqs: &[SeqChunk<'_>],
        q: &mut [f32],
        tmp: &mut [f32],
        scores: Option<&mut [f32]>,
    ) {
        let run = |job: AttnJob<'_>, scores: Option<&mut [f32]>| match scores {
            None => attention::streaming(&self.shape, layer, job),
            Some(sc) => attention::naive(&self.shape, layer, job, sc),
        };
        if let [s] = seqs {
            // The common case (prefill, single-sequence decode) needs no job list.
            run(AttnJob { q, tmp, cache: &*s.cache, start: s.cache.len() }, scores);
            return;
        }
        let q_dim = self.shape.heads * self.shape.head_dim;
        let mut jobs = Vec::with_capacity(seqs.len());
        let (mut q_rest, mut tmp_rest) = (q, tmp);
        for s in seqs {
            let n = s.tokens.len() * q_dim;
            let (qs, qr) = std::mem::take(&mut q_rest).split_at_mut(n);
            let (ts, tr) = std::mem::take(&mut tmp_rest).split_at_mut(n);
            (q_rest, tmp_rest) = (qr, tr);
            jobs.push(AttnJob { q: qs, tmp: ts, cache: &*s.cache, start: s.cache.len() });
        }
        match scores {
            // Streaming jobs keep their state on the stack: sequences run in parallel.
            None => jobs.into_par_iter().for_each(|job| run(job, None)),
            // Naive jobs share one score matrix: one sequence at a time.
            Some(sc) => {
                for job in jobs {
                    run(job, Some(&mut *sc));
                }
            }
        }
    }
}

fn norm(n: &RmsNorm, x: &[f32], out: &mut [f32]) {
    rms_norm(x, &n.weight, n.eps, out);
}

/// RMSNorm of every head of every row of `x` in place (`n` is one head wide).
fn head_norm(n: &RmsNorm, x: &mut [f32]) {
    let mut head = [0f32; MAX_HEAD_DIM];
    let d = n.weight.len();
    for chunk in x.chunks_exact_mut(d) {
        head[..d].copy_from_slice(chunk);
        rms_norm(&head[..d], &n.weight, n.eps, chunk);
    }
}

fn check_shapes(c: &ModelConfig, w: &ModelWeights) -> Result<()> {
    if c.head_dim > MAX_HEAD_DIM || !c.head_dim.is_multiple_of(2) {
        return Err(ModelError::InvalidArgument {
            what: "head_dim".into(),
            message: format!(
                "{} is not supported: kiln runs even head sizes up to {MAX_HEAD_DIM}",
                c.head_dim
            ),
        });
    }
    if c.gqa_group() > MAX_GQA_GROUP {
        return Err(ModelError::InvalidArgument {
            what: "num_key_value_heads".into(),
            message: format!(
                "{} query heads per key/value head is not supported: kiln runs groups of up to {MAX_GQA_GROUP}",
                c.gqa_group()
            ),
        });
    }
    let weight = |name: &str, lw: &LinearWeight, n: usize, k: usize| -> Result<()> {
        if lw.n() != n || lw.k() != k {
            return Err(ModelError::WeightShape {
                tensor: name.to_string(),
                expected: format!("[{n}, {k}]"),
                found: format!("[{}, {}]", lw.n(), lw.k()),
            });
        }
        Ok(())
    };
    let linear = |name: &str, lin: &Linear, n: usize, k: usize| -> Result<()> {
        weight(name, &lin.weight, n, k)?;
        if let Some(b) = &lin.bias
            && b.len() != n
        {
            return Err(ModelError::WeightShape {
                tensor: format!("{name}.bias"),
                expected: format!("[{n}]"),
                found: format!("[{}]", b.len()),
            });
        }
        Ok(())
    };
    let norm_len = |name: &str, n: &RmsNorm| -> Result<()> {
        if n.weight.len() != c.hidden_size {
            return Err(ModelError::WeightShape {
                tensor: name.to_string(),
                expected: format!("[{}]", c.hidden_size),
                found: format!("[{}]", n.weight.len()),
            });
        }
        Ok(())
    };
    let (h, q, kv, i) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    if w.layers.len() != c.num_hidden_layers {
        return Err(ModelError::WeightShape {
            tensor: "model.layers".into(),
            expected: format!("{} layers", c.num_hidden_layers),
            found: format!("{} layers", w.layers.len()),
        });
    }
    weight("model.embed_tokens", &w.embed_tokens, c.vocab_size, h)?;
    for (l, layer) in w.layers.iter().enumerate() {
        let p = |m: &str| format!("model.layers.{l}.{m}");
        linear(&p("self_attn.q_proj"), &layer.q_proj, q, h)?;
        linear(&p("self_attn.k_proj"), &layer.k_proj, kv, h)?;
        linear(&p("self_attn.v_proj"), &layer.v_proj, kv, h)?;
        linear(&p("self_attn.o_proj"), &layer.o_proj, h, q)?;
        match (&layer.mlp, &c.moe) {
            (Mlp::Dense(mlp), None) => {
                linear(&p("mlp.gate_proj"), &mlp.gate_proj, i, h)?;
                linear(&p("mlp.up_proj"), &mlp.up_proj, i, h)?;
                linear(&p("mlp.down_proj"), &mlp.down_proj, h, i)?;
            }
            (Mlp::Moe(mlp), Some(moe)) => {
                linear(&p("mlp.gate"), &mlp.router, moe.experts, h)?;
                match (&mlp.shared_expert, &mlp.shared_expert_gate, moe.shared_expert_intermediate_size) {
                    (None, None, None) => {}
                    (Some(s), Some(g), Some(si)) => {
                        linear(&p("mlp.shared_expert.gate_proj"), &s.gate_proj, si, h)?;
                        linear(&p("mlp.shared_expert.up_proj"), &s.up_proj, si, h)?;
                        linear(&p("mlp.shared_expert.down_proj"), &s.down_proj, h, si)?;
                        linear(&p("mlp.shared_expert_gate"), g, 1, h)?;
                    }
                    _ => {
                        return Err(ModelError::WeightShape {
                            tensor: p("mlp.shared_expert"),
                            expected: "a shared expert and its gate exactly when the config names one".into(),
                            found: "a mismatch".into(),
                        });
                    }
                }
            }
            _ => {
                return Err(ModelError::WeightShape {
                    tensor: p("mlp"),
                    expected: if c.moe.is_some() { "a mixture of experts" } else { "a dense MLP" }.into(),
                    found: "the other kind".into(),
                });
            }
        }
        match (&layer.q_norm, &layer.k_norm, c.qk_norm) {
            (Some(qn), Some(kn), true) => {
                for (name, n) in [("self_attn.q_norm", qn), ("self_attn.k_norm", kn)] {
                    if n.weight.len() != c.head_dim {
                        return Err(ModelError::WeightShape {
                            tensor: p(name),
                            expected: format!("[{}]", c.head_dim),
                            found: format!("[{}]", n.weight.len()),
                        });
                    }
                }
            }
            (None, None, false) => {}
            _ => {
                return Err(ModelError::WeightShape {
                    tensor: p("self_attn.q_norm"),
                    expected: format!("q_norm and k_norm {}", if c.qk_norm { "present" } else { "absent" }),
                    found: "otherwise".into(),
                });
            }
        }
        norm_len(&p("input_layernorm"), &layer.input_layernorm)?;
        norm_len(&p("post_attention_layernorm"), &layer.post_attention_layernorm)?;
    }
    norm_len("model.norm", &w.norm)?;
    if let Some(moe) = &c.moe {
        let Some(store) = &w.experts else {
            return Err(ModelError::WeightShape {
                tensor: "model.layers.*.mlp.experts".into(),
                expected: format!("{} experts per layer", moe.experts),
                found: "none".into(),
            });
        };
        let e = store.by_id(0);
        let ei = moe.expert_intermediate_size;
        if store.layers() != c.num_hidden_layers
            || store.experts() != moe.experts
            || store.top_k() != moe.top_k
        {
            return Err(ModelError::WeightShape {
                tensor: "model.layers.*.mlp.experts".into(),
                expected: format!(
                    "{} layers x {} experts, top-{}",
                    c.num_hidden_layers, moe.experts, moe.top_k
                ),
                found: format!(
                    "{} layers x {} experts, top-{}",
                    store.layers(),
                    store.experts(),
                    store.top_k()
                ),
            });
        }
        for (name, m, n, k) in [
            ("gate_proj", &e.gate_proj, ei, h),
            ("up_proj", &e.up_proj, ei, h),
            ("down_proj", &e.down_proj, h, ei),
        ] {
            if m.n() != n || m.k() != k {
                return Err(ModelError::WeightShape {
                    tensor: format!("model.layers.0.mlp.experts.0.{name}"),
                    expected: format!("[{n}, {k}]"),
                    found: format!("[{}, {}]", m.n(), m.k()),
                });
            }
        }
    }
    if let Some(head) = &w.lm_head {
        linear("lm_head", head, c.vocab_size, h)?;
    }
    Ok(())
}
