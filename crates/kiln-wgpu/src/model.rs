//! The forward pass on a wgpu device: kiln-model's decoder (its configuration, its weights
//! in the checkpoint's bytes, its RoPE angles) run as kiln-wgpu dispatches on a
//! [`WgpuExec`]. The layer order is transformer.rs's: embedding; per layer RMSNorm, q/k/v
//! (with their biases, and Qwen3's per-head q/k RMSNorm), RoPE, the store into the f16
//! cache, split-and-merge attention, o_proj and the residual, RMSNorm, gate and up,
//! SiLU-and-multiply, down and the residual; the final norm and the LM head (the embedding
//! when tied). Weights, the KV caches and every activation live in the device's memory;
//! the host sends the token ids and the rows' RoPE cosines and sines (kiln-model's
//! `Rope::angles`, so every scaling it supports is covered and the angles are the CPU's
//! bits) and reads back the logits rows.
//!
//! Activations are f32 throughout on this backend (no shader-f16 feature is needed); the
//! cache is f16. Under the `f32` scheme (the default) a projection of M rows runs `qmv`
//! (M <= 8: a row's bits do not depend on M, so a prefill in chunks of at most 8 equals
//! one decode step per token bit for bit) or `qmm` (more rows; its rows do not depend on
//! M either). Under `int8` or `int16` ([`WgpuEngine::set_act_scheme`]) each projection
//! quantizes its input per weight group as the CPU does (once for q/k/v and once for
//! gate/up, which share it) and runs `qmv_int` ([`kernels::IntProduct`]): the CPU's
//! integer group sums and float epilogue, so every M gives the same bits. [`WgpuEngine::forward_batch`] runs several sequences' new tokens
//! as one forward: the products over all rows at once, the KV store and attention per
//! sequence.
//!
//! Memory: every buffer is allocated from the executor's [`crate::DevicePool`] under a tag
//! (weights, kv, scratch). [`plan`] makes the same allocations on [`WgpuExec::plan`], which
//! counts and stores nothing, so an estimate is the pool's peak of the run it describes (a
//! test checks it against a run). MoE models and unquantized weights are refused by name.

use kiln_core::{QuantizedMatrix, ScaleDtype, Tag};
use kiln_model::rope::Rope;
use kiln_model::weights::{Linear, LinearWeight, Mlp, ModelWeights, RmsNorm};
use kiln_model::{Logits, ModelConfig};
use kiln_protocol::ActScheme;

use crate::error::WgpuError;
use crate::exec::{Dispatch, Mem, WgpuExec};
use crate::kernels::{self, AttnShape, EmbedShape, IntCodes, IntProduct, ProductShape, Weights};

/// A quantized matrix in device memory, in the checkpoint's bytes.
struct DevMatrix {
    packed: Mem,
    scales: Mem,
    biases: Mem,
    n: usize,
    k: usize,
    spec: kiln_core::QuantSpec,
    scale_dtype: ScaleDtype,
    lanes: usize,
}

impl DevMatrix {
    fn w(&self) -> Weights<'_> {
        Weights { packed: &self.packed, scales: &self.scales, biases: &self.biases }
    }

    fn shape(&self, m: usize) -> ProductShape {
        ProductShape { n: self.n, k: self.k, m, spec: self.spec, scales: self.scale_dtype, lanes: self.lanes }
    }
}

struct DevLinear {
    w: DevMatrix,
    bias: Option<Mem>,
}

struct DevLayer {
    input_norm: Mem,
    q: DevLinear,
    k: DevLinear,
    v: DevLinear,
    o: DevLinear,
    q_norm: Option<Mem>,
    k_norm: Option<Mem>,
    post_norm: Mem,
    gate: DevLinear,
    up: DevLinear,
    down: DevLinear,
    eps: (f32, f32),
    qk_eps: (f32, f32),
}

/// A model's weights on a device.
struct DeviceWeights {
    embed: DevMatrix,
    layers: Vec<DevLayer>,
    norm: Mem,
    final_eps: f32,
    head: Option<DevLinear>,
}

fn scale_bytes(d: &kiln_core::matrix::ScaleData) -> &[u8] {
    use kiln_core::matrix::ScaleData;
    match d {
        ScaleData::F16(b) => bytemuck::cast_slice(&b[..]),
        ScaleData::Bf16(b) => bytemuck::cast_slice(&b[..]),
        ScaleData::F32(b) => bytemuck::cast_slice(&b[..]),
    }
}

fn unsupported(what: String) -> WgpuError {
    WgpuError::Unsupported { what }
}

fn quantized<'w>(name: &str, w: &'w LinearWeight) -> Result<&'w QuantizedMatrix, WgpuError> {
    match w {
        LinearWeight::Quantized(q) => Ok(q),
        LinearWeight::Dense(_) => Err(unsupported(format!(
            "{name}: it is unquantized, and the wgpu backend runs MLX-affine 4- and 8-bit weights \
             (load it with --quantize 4 or --quantize 8)"
        ))),
    }
}

fn matrix(exec: &WgpuExec, name: &str, w: &LinearWeight, product: bool) -> Result<DevMatrix, WgpuError> {
    let q = quantized(name, w)?;
    // The kernels read rows: a matrix reordered for the CPU's lane-row kernel is copied
    // back to rows first.
    let row_major;
    let q = if q.layout() == kiln_core::Layout::RowMajor {
        q
    } else {
        row_major = q.to_row_major();
        &row_major
    };
    let bits = q.spec().bits();
    if product && bits != 4 && bits != 8 {
        return Err(unsupported(format!(
            "{name}: it is {bits}-bit, and the wgpu backend's products take 4- and 8-bit weights"
        )));
    }
    Ok(DevMatrix {
        packed: exec.upload(Tag::Weights, q.packed())?,
        scales: exec.upload(Tag::Weights, scale_bytes(q.scales()))?,
        biases: exec.upload(Tag::Weights, scale_bytes(q.biases()))?,
        n: q.n(),
        k: q.k(),
        spec: q.spec(),
        scale_dtype: q.scales().dtype(),
        lanes: exec.qmv_lanes(q.k()),
    })
}

fn linear(exec: &WgpuExec, name: &str, l: &Linear) -> Result<DevLinear, WgpuError> {
    Ok(DevLinear {
        w: matrix(exec, name, &l.weight, true)?,
        bias: l.bias.as_ref().map(|b| exec.upload(Tag::Weights, &b[..])).transpose()?,
    })
}

fn norm(exec: &WgpuExec, n: &RmsNorm) -> Result<Mem, WgpuError> {
    exec.upload(Tag::Weights, &n.weight[..])
}

impl DeviceWeights {
    fn upload(
        exec: &WgpuExec,
        config: &ModelConfig,
        weights: &ModelWeights,
    ) -> Result<DeviceWeights, WgpuError> {
        if config.moe.is_some() || weights.experts.is_some() {
            return Err(unsupported(
                "a mixture-of-experts model: its forward has no router or expert kernels".into(),
            ));
        }
        attn_shape(config, 1, 0, 1).check()?;
        // The LM head reads the embedding when tied: both as a product, so 4 or 8 bits.
        let embed = matrix(exec, "model.embed_tokens", &weights.embed_tokens, weights.lm_head.is_none())?;
        let mut layers = Vec::with_capacity(weights.layers.len());
        for (i, l) in weights.layers.iter().enumerate() {
            let name = |p: &str| format!("model.layers.{i}.{p}");
            let Mlp::Dense(mlp) = &l.mlp else {
                return Err(unsupported(format!("{}: a routed MLP", name("mlp"))));
            };
            layers.push(DevLayer {
                input_norm: norm(exec, &l.input_layernorm)?,
                q: linear(exec, &name("self_attn.q_proj"), &l.q_proj)?,
                k: linear(exec, &name("self_attn.k_proj"), &l.k_proj)?,
                v: linear(exec, &name("self_attn.v_proj"), &l.v_proj)?,
                o: linear(exec, &name("self_attn.o_proj"), &l.o_proj)?,
                q_norm: l.q_norm.as_ref().map(|n| norm(exec, n)).transpose()?,
                k_norm: l.k_norm.as_ref().map(|n| norm(exec, n)).transpose()?,
                post_norm: norm(exec, &l.post_attention_layernorm)?,
                gate: linear(exec, &name("mlp.gate_proj"), &mlp.gate_proj)?,
                up: linear(exec, &name("mlp.up_proj"), &mlp.up_proj)?,
                down: linear(exec, &name("mlp.down_proj"), &mlp.down_proj)?,
                eps: (l.input_layernorm.eps, l.post_attention_layernorm.eps),
                qk_eps: (l.q_norm.as_ref().map_or(0.0, |n| n.eps), l.k_norm.as_ref().map_or(0.0, |n| n.eps)),
            });
        }
        let head = weights.lm_head.as_ref().map(|h| linear(exec, "lm_head", h)).transpose()?;
        Ok(DeviceWeights {
            embed,
            layers,
            norm: norm(exec, &weights.norm)?,
            final_eps: weights.norm.eps,
            head,
        })
    }
}

/// One sequence's keys and values on the device: per layer, f16 `[kv_heads, capacity,
/// head_dim]` for the keys and the same for the values. The capacity is fixed when it is
/// made.
pub struct WgpuCache {
    keys: Vec<Mem>,
    values: Vec<Mem>,
    capacity: usize,
    len: usize,
}

impl WgpuCache {
    /// Positions stored.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions it holds at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets every position (the memory stays).
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Forgets the positions from `len` on.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Bytes held on the device.
    pub fn bytes(&self) -> u64 {
        self.keys.iter().chain(&self.values).map(|m| m.bytes() as u64).sum()
    }
}

/// The bytes of one layer's keys (or values) for `capacity` positions.
pub fn cache_layer_bytes(config: &ModelConfig, capacity: usize) -> usize {
    config.num_key_value_heads * capacity * config.head_dim * 2
}

fn attn_shape(c: &ModelConfig, rows: usize, start: usize, capacity: usize) -> AttnShape {
    AttnShape {
        rows,
        start,
        kv_heads: c.num_key_value_heads,
        group: c.gqa_group(),
        head_dim: c.head_dim,
        capacity,
    }
}

/// The activations of forwards of up to `rows` rows over caches of up to `capacity`
/// positions, returning up to `logit_rows` rows of logits (all f32).
struct Work {
    rows: usize,
    capacity: usize,
    logit_rows: usize,
    tokens: Mem,
    /// The rows' RoPE cosines, then their sines.
    cs: Mem,
    x: Mem,
    xn: Mem,
    q: Mem,
    k: Mem,
    v: Mem,
    qn: Option<Mem>,
    kn: Option<Mem>,
    attn: Mem,
    scratch: Mem,
    proj: Mem,
    gate: Mem,
    up: Mem,
    mlp: Mem,
    head_x: Mem,
    logits: Mem,
    /// The quantized activations of one product (integer schemes only).
    act: Option<Mem>,
}

impl Work {
    fn new(
        exec: &WgpuExec,
        c: &ModelConfig,
        rows: usize,
        capacity: usize,
        logit_rows: usize,
        int_act: bool,
    ) -> Result<Work, WgpuError> {
        let s = |bytes: usize| exec.alloc(Tag::Scratch, bytes);
        let (h, qd, kvd, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.mlp_width());
        let attn = attn_shape(c, rows, 0, capacity);
        Ok(Work {
            rows,
            capacity,
            logit_rows,
            tokens: s(rows * 4)?,
            cs: s(rows * c.head_dim * 4)?,
            x: s(rows * h * 4)?,
            xn: s(rows * h * 4)?,
            q: s(rows * qd * 4)?,
            k: s(rows * kvd * 4)?,
            v: s(rows * kvd * 4)?,
            qn: if c.qk_norm { Some(s(rows * qd * 4)?) } else { None },
            kn: if c.qk_norm { Some(s(rows * kvd * 4)?) } else { None },
            attn: s(rows * qd * 4)?,
            scratch: s(attn.scratch_bytes())?,
            proj: s(rows * h * 4)?,
            gate: s(rows * inter * 4)?,
            up: s(rows * inter * 4)?,
            mlp: s(rows * inter * 4)?,
            head_x: s(logit_rows * h * 4)?,
            logits: s(logit_rows * c.vocab_size * 4)?,
            act: if int_act {
                let k = h.max(qd).max(inter);
                Some(s(kernels::act_bytes_at_most(rows.max(logit_rows), k))?)
            } else {
                None
            },
        })
    }
}

/// Prompt tokens per prefill forward when none is asked for (`--prefill-chunk 0`), as the
/// CUDA backend: the attention keeps one state per row, query head and 256-key span, so
/// one forward over a whole long prompt would hold rows x context of them.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// Rows of the largest prefill forward of `prompt_tokens` in chunks of `chunk` (0:
/// [`DEFAULT_PREFILL_CHUNK`]).
pub fn prefill_rows(chunk: usize, prompt_tokens: usize) -> usize {
    kiln_model::prefill_rows(chunk, prompt_tokens, DEFAULT_PREFILL_CHUNK)
}

/// What a wgpu run holds at its peak, by tag, from [`plan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WgpuPlan {
    /// Weights in the checkpoint's bytes, norms and biases.
    pub weights_bytes: u64,
    /// The KV cache.
    pub kv_bytes: u64,
    /// The activations, the RoPE angles and the attention's span states.
    pub scratch_bytes: u64,
    /// Everything: the device pool's peak for the run.
    pub total_bytes: u64,
}

/// The shape of a run: one sequence of `sequence_tokens` positions, forwards of up to
/// `rows` rows, returning up to `logit_rows` rows of logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WgpuRunShape {
    /// Positions the cache holds (prompt plus generated tokens).
    pub sequence_tokens: usize,
    /// Rows of the largest forward (the prefill chunk, or the prompt).
    pub rows: usize,
    /// Logit rows of the largest forward (1, or the prompt for scoring).
    pub logit_rows: usize,
    /// The products' activation scheme: the integer ones hold the quantized activations.
    pub act: ActScheme,
}

/// The device memory a run of `shape` takes, from the model's configuration and the CPU's
/// count of its weight bytes (`ModelInfo::weight_bytes`: the device holds the same bytes;
/// no weights are loaded): the allocations [`WgpuEngine`] makes for it, counted by
/// [`WgpuExec::plan`].
pub fn plan(config: &ModelConfig, weight_bytes: u64, shape: WgpuRunShape) -> Result<WgpuPlan, WgpuError> {
    let exec = WgpuExec::plan(u64::MAX);
    let weights = exec.alloc(Tag::Weights, weight_bytes as usize)?;
    let work = Work::new(
        &exec,
        config,
        shape.rows.max(1),
        shape.sequence_tokens.max(1),
        shape.logit_rows.max(1),
        int_scheme(shape.act),
    )?;
    let cache = alloc_cache(&exec, config, shape.sequence_tokens)?;
    let st = exec.stats();
    drop((cache, work, weights));
    let tag = |t: &str| st.by_tag.get(t).map_or(0, |s| s.at_peak);
    Ok(WgpuPlan {
        weights_bytes: tag("weights"),
        kv_bytes: tag("kv"),
        scratch_bytes: tag("scratch"),
        total_bytes: st.peak_bytes,
    })
}

fn alloc_cache(exec: &WgpuExec, config: &ModelConfig, capacity: usize) -> Result<WgpuCache, WgpuError> {
    let limit = config.max_position_embeddings;
    if capacity == 0 || capacity > limit {
        return Err(WgpuError::Input {
            what: "cache capacity".into(),
            message: format!("{capacity} positions: accepted are 1 to the model's context of {limit}"),
        });
    }
    let bytes = cache_layer_bytes(config, capacity);
    let layers = config.num_hidden_layers;
    let mut keys = Vec::with_capacity(layers);
    let mut values = Vec::with_capacity(layers);
    for _ in 0..layers {
        keys.push(exec.alloc(Tag::Kv, bytes)?);
        values.push(exec.alloc(Tag::Kv, bytes)?);
    }
    Ok(WgpuCache { keys, values, capacity, len: 0 })
}

/// Whether `act` is an integer scheme this backend runs (`int8`, `int16`).
fn int_scheme(act: ActScheme) -> bool {
    matches!(act, ActScheme::Int8 | ActScheme::Int16)
}

/// The activation schemes [`WgpuEngine::set_act_scheme`] takes, for messages.
pub const ACT_SCHEMES: &str = "f32, int8, int16";

/// A model on a wgpu device with its activations, running forwards over caches it makes.
pub struct WgpuEngine<'e> {
    exec: &'e WgpuExec,
    config: ModelConfig,
    weights: DeviceWeights,
    rope: Rope,
    work: Option<Work>,
    logits: Vec<f32>,
    act: ActScheme,
}

#[derive(Clone, Copy)]
enum Proj {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

/// One sequence of a forward: its first row among the forward's rows, its new tokens and
/// the position of the first.
#[derive(Clone, Copy)]
struct Seq {
    row: usize,
    rows: usize,
    start: usize,
}

fn input_err(what: &str, message: String) -> WgpuError {
    WgpuError::Input { what: what.into(), message }
}

impl<'e> WgpuEngine<'e> {
    /// Copies the weights to `exec`, checking first that this backend runs them.
    pub fn new(exec: &'e WgpuExec, config: &ModelConfig, weights: &ModelWeights) -> Result<Self, WgpuError> {
        let weights = DeviceWeights::upload(exec, config, weights)?;
        Ok(WgpuEngine {
            exec,
            config: config.clone(),
            weights,
            rope: Rope::new(config),
            work: None,
            logits: Vec::new(),
            act: ActScheme::F32,
        })
    }

    /// Runs the products under `act`: `f32` (the default), or the CPU's integer schemes
    /// `int8` and `int16`; `f16` and `int16-wide8` are refused by name. The activations
    /// held are reallocated at the next forward when the scheme changes.
    pub fn set_act_scheme(&mut self, act: ActScheme) -> Result<(), WgpuError> {
        if act != ActScheme::F32 && !int_scheme(act) {
            return Err(unsupported(format!(
                "{}={}: the wgpu products run {ACT_SCHEMES}",
                kiln_protocol::ACT_PRECISION_ENV,
                act.as_str()
            )));
        }
        if act != self.act {
            self.act = act;
            self.work = None;
        }
        Ok(())
    }

    /// The products' activation scheme.
    pub fn act_scheme(&self) -> ActScheme {
        self.act
    }

    /// What the products run, for the binary's kernel line: `act=<scheme>`, and for the
    /// integer schemes `dot=packed` (WGSL's packed dot products) or `dot=plain`.
    pub fn products_desc(&self) -> String {
        if int_scheme(self.act) {
            let dot = if self.exec.packed_dot() { "packed" } else { "plain" };
            format!("act={} dot={dot}", self.act.as_str())
        } else {
            format!("act={}", self.act.as_str())
        }
    }

    /// The executor.
    pub fn exec(&self) -> &'e WgpuExec {
        self.exec
    }

    /// Dispatches queued so far on the executor.
    pub fn dispatches(&self) -> u64 {
        self.exec.dispatches()
    }

    /// Allocates the activations for forwards of up to `rows` rows over caches of up to
    /// `capacity` positions returning up to `logit_rows` logit rows, unless what is held
    /// covers it; a larger one replaces it (the old one is freed first).
    pub fn reserve(&mut self, rows: usize, capacity: usize, logit_rows: usize) -> Result<(), WgpuError> {
        let (rows, capacity, logit_rows) = (rows.max(1), capacity.max(1), logit_rows.max(1));
        if let Some(w) = &self.work
            && w.rows >= rows
            && w.capacity >= capacity
            && w.logit_rows >= logit_rows
        {
            return Ok(());
        }
        let (r, c, l) = self.work.as_ref().map_or((rows, capacity, logit_rows), |w| {
            (w.rows.max(rows), w.capacity.max(capacity), w.logit_rows.max(logit_rows))
        });
        self.work = None;
        self.work = Some(Work::new(self.exec, &self.config, r, c, l, int_scheme(self.act))?);
        Ok(())
    }

    /// An empty cache of `capacity` positions (at most the model's context).
    pub fn new_cache(&self, capacity: usize) -> Result<WgpuCache, WgpuError> {
        alloc_cache(self.exec, &self.config, capacity)
    }

    /// Runs `tokens` of the sequence of `cache` through the model, appends their keys and
    /// values to it, and returns the requested logits (`[rows, vocab]`; `Logits::Last`
    /// is the last token's row).
    pub fn forward(
        &mut self,
        cache: &mut WgpuCache,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<&[f32], WgpuError> {
        self.run(&mut [(cache, tokens)], logits)
    }

    /// Makes `dst` hold the first `n` positions of `src`: per layer and key/value head,
    /// one device copy of the keys and one of the values (a head's positions are
    /// contiguous, at a stride of its cache's capacity).
    pub fn copy_prefix(&self, dst: &mut WgpuCache, src: &WgpuCache, n: usize) -> Result<(), WgpuError> {
        if n > src.len || n > dst.capacity {
            return Err(input_err(
                "cache prefix",
                format!(
                    "{n} positions from a cache holding {} into one of {} positions",
                    src.len, dst.capacity
                ),
            ));
        }
        let c = &self.config;
        let row = c.head_dim * 2;
        for (to, from) in dst.keys.iter_mut().zip(&src.keys).chain(dst.values.iter_mut().zip(&src.values)) {
            for h in 0..c.num_key_value_heads {
                self.exec.copy_range(to, h * dst.capacity * row, from, h * src.capacity * row, n * row)?;
            }
        }
        dst.len = n;
        Ok(())
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// One forward over several sequences' new tokens (each sequence's cache and tokens):
    /// the products run over all rows together, the KV store and attention per sequence.
    /// Returns each sequence's last row of logits, in order (`[sequences, vocab]`).
    pub fn forward_batch(&mut self, seqs: &mut [(&mut WgpuCache, &[u32])]) -> Result<&[f32], WgpuError> {
        self.run(seqs, Logits::Last)
    }

    /// Runs `tokens` into `cache` in forwards of `chunk` tokens (0:
    /// [`DEFAULT_PREFILL_CHUNK`]) and returns the last token's logits.
    pub fn prefill(
        &mut self,
        cache: &mut WgpuCache,
        tokens: &[u32],
        chunk: usize,
    ) -> Result<&[f32], WgpuError> {
        if tokens.is_empty() {
            return self.forward(cache, tokens, Logits::Last);
        }
        let chunk = prefill_rows(chunk, tokens.len());
        let n = tokens.chunks(chunk).count();
        for (i, part) in tokens.chunks(chunk).enumerate() {
            let logits = if i + 1 == n { Logits::Last } else { Logits::None };
            self.forward(cache, part, logits)?;
        }
        Ok(&self.logits)
    }

    /// One decode step: `token` appended to `cache`, its logits returned.
    pub fn decode(&mut self, cache: &mut WgpuCache, token: u32) -> Result<&[f32], WgpuError> {
        self.forward(cache, &[token], Logits::Last)
    }

    fn check(&self, seqs: &[(&mut WgpuCache, &[u32])], logits: Logits) -> Result<(), WgpuError> {
        let vocab = self.config.vocab_size;
        if seqs.is_empty() {
            return Err(input_err("forward input", "a forward needs at least one sequence".into()));
        }
        if matches!(logits, Logits::All) && seqs.len() > 1 {
            return Err(input_err(
                "forward input",
                format!("every row's logits of {} sequences: accepted is one sequence", seqs.len()),
            ));
        }
        for (i, (cache, tokens)) in seqs.iter().enumerate() {
            if tokens.is_empty() {
                return Err(input_err("forward input", "a forward needs at least one new token".into()));
            }
            if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(input_err(
                    "token id",
                    format!("{t} is outside the vocabulary: accepted ids are 0..{vocab}"),
                ));
            }
            if cache.len + tokens.len() > cache.capacity {
                let which = if seqs.len() > 1 { format!(" (sequence {i})") } else { String::new() };
                return Err(input_err(
                    "forward input",
                    format!(
                        "{} new tokens after {} do not fit the device cache of {} positions{which}",
                        tokens.len(),
                        cache.len,
                        cache.capacity
                    ),
                ));
            }
        }
        Ok(())
    }

    /// One forward over several sequences with the logits `logits` asks for (`All`: one
    /// sequence only).
    pub fn forward_seqs(
        &mut self,
        seqs: &mut [(&mut WgpuCache, &[u32])],
        logits: Logits,
    ) -> Result<&[f32], WgpuError> {
        self.run(seqs, logits)
    }

    fn run(&mut self, seqs: &mut [(&mut WgpuCache, &[u32])], logits: Logits) -> Result<&[f32], WgpuError> {
        self.check(seqs, logits)?;
        let c = &self.config;
        let (vocab, h, inter) = (c.vocab_size, c.hidden_size, c.mlp_width());
        let (heads, kvh, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let half = hd / 2;
        let mut parts = Vec::with_capacity(seqs.len());
        let mut rows = 0;
        for (cache, tokens) in seqs.iter() {
            parts.push(Seq { row: rows, rows: tokens.len(), start: cache.len });
            rows += tokens.len();
        }
        let capacity = seqs.iter().map(|(c, _)| c.capacity).max().unwrap_or(1);
        let logit_rows = match logits {
            Logits::None => 0,
            Logits::Last => seqs.len(),
            Logits::All => rows,
        };
        self.reserve(rows, capacity, logit_rows)?;
        let c = &self.config;
        let exec = self.exec;
        let w = self.work.as_mut().expect("reserved above");
        let ids: Vec<i32> = seqs.iter().flat_map(|(_, t)| t.iter().map(|&t| t as i32)).collect();
        exec.write(&mut w.tokens, 0, bytemuck::cast_slice(&ids))?;
        let mut cs = vec![0f32; 2 * rows * half];
        {
            let (cos, sin) = cs.split_at_mut(rows * half);
            for s in &parts {
                for r in 0..s.rows {
                    let at = (s.row + r) * half;
                    self.rope.angles(s.start + r, &mut cos[at..at + half], &mut sin[at..at + half]);
                }
            }
        }
        exec.write(&mut w.cs, 0, bytemuck::cast_slice(&cs))?;
        let w = self.work.as_ref().expect("reserved above");
        let go = |d: Result<Dispatch<'_>, WgpuError>| exec.dispatch(&d?);
        let e = &self.weights.embed;
        go(EmbedShape { rows, vocab, d: h, spec: e.spec, scales: e.scale_dtype }.dispatch(
            e.w(),
            &w.tokens,
            &w.x,
        ))?;
        // Under an integer scheme, the codes last quantized into `w.act` (group size, codes,
        // rows, width): a product whose input is unchanged since (`same_x`) reuses them.
        let quantized = std::cell::Cell::new(None);
        let act = self.act;
        let packed_dot = exec.packed_dot();
        let matmul = |mat: &DevMatrix, m: usize, x: &Mem, y: &Mem, same_x: bool| -> Result<(), WgpuError> {
            let shape = mat.shape(m);
            let (Some(codes), Some(buf)) = (IntCodes::for_weight_bits(mat.spec.bits(), act), &w.act) else {
                return go(shape.dispatch(mat.w(), x, 0, y, 0));
            };
            let p = IntProduct { shape, codes };
            let key = Some((mat.spec.group_size(), codes, m, mat.k));
            if !same_x || quantized.get() != key {
                go(p.quantize(x, 0, buf))?;
                quantized.set(key);
            }
            go(p.product(mat.w(), buf, y, 0, packed_dot))
        };
        let project = |lin: &DevLinear, m: usize, x: &Mem, y: &Mem, same_x: bool| -> Result<(), WgpuError> {
            matmul(&lin.w, m, x, y, same_x)?;
            match &lin.bias {
                Some(b) => go(kernels::add_bias(m * lin.w.n, lin.w.n, y, b)),
                None => Ok(()),
            }
        };
        for (l, layer) in self.weights.layers.iter().enumerate() {
            let lin = |p: Proj| match p {
                Proj::Q => &layer.q,
                Proj::K => &layer.k,
                Proj::V => &layer.v,
                Proj::O => &layer.o,
                Proj::Gate => &layer.gate,
                Proj::Up => &layer.up,
                Proj::Down => &layer.down,
            };
            go(kernels::rms_norm(rows, h, layer.eps.0, &w.x, 0, &layer.input_norm, &w.xn, 0))?;
            project(lin(Proj::Q), rows, &w.xn, &w.q, false)?;
            project(lin(Proj::K), rows, &w.xn, &w.k, true)?;
            project(lin(Proj::V), rows, &w.xn, &w.v, true)?;
            let (qs, ks) = match (&layer.q_norm, &layer.k_norm, &w.qn, &w.kn) {
                (Some(wq), Some(wk), Some(qn), Some(kn)) => {
                    go(kernels::rms_norm(rows * heads, hd, layer.qk_eps.0, &w.q, 0, wq, qn, 0))?;
                    go(kernels::rms_norm(rows * kvh, hd, layer.qk_eps.1, &w.k, 0, wk, kn, 0))?;
                    (qn, kn)
                }
                _ => (&w.q, &w.k),
            };
            go(kernels::rope(rows, heads, half, qs, 0, &w.cs))?;
            go(kernels::rope(rows, kvh, half, ks, 0, &w.cs))?;
            for (s, (cache, _)) in parts.iter().zip(seqs.iter()) {
                let (keys, values) = (&cache.keys[l], &cache.values[l]);
                go(kernels::kv_store(
                    s.rows,
                    kvh,
                    hd,
                    cache.capacity,
                    s.start,
                    s.row,
                    ks,
                    &w.v,
                    keys,
                    values,
                ))?;
                let shape = attn_shape(c, s.rows, s.start, cache.capacity);
                let [split, merge] = shape.dispatches(qs, s.row, keys, values, &w.scratch, &w.attn, s.row)?;
                exec.dispatch(&split)?;
                exec.dispatch(&merge)?;
            }
            project(lin(Proj::O), rows, &w.attn, &w.proj, false)?;
            go(kernels::add(rows * h, &w.x, &w.proj))?;
            go(kernels::rms_norm(rows, h, layer.eps.1, &w.x, 0, &layer.post_norm, &w.xn, 0))?;
            project(lin(Proj::Gate), rows, &w.xn, &w.gate, false)?;
            project(lin(Proj::Up), rows, &w.xn, &w.up, true)?;
            go(kernels::silu_mul(rows * inter, &w.gate, &w.up, &w.mlp))?;
            project(lin(Proj::Down), rows, &w.mlp, &w.proj, false)?;
            go(kernels::add(rows * h, &w.x, &w.proj))?;
        }
        if logit_rows > 0 {
            let (norm, eps) = (&self.weights.norm, self.weights.final_eps);
            if matches!(logits, Logits::All) {
                go(kernels::rms_norm(rows, h, eps, &w.x, 0, norm, &w.head_x, 0))?;
            } else {
                for (i, s) in parts.iter().enumerate() {
                    go(kernels::rms_norm(1, h, eps, &w.x, s.row + s.rows - 1, norm, &w.head_x, i))?;
                }
            }
            match &self.weights.head {
                Some(head) => project(head, logit_rows, &w.head_x, &w.logits, false)?,
                None => matmul(e, logit_rows, &w.head_x, &w.logits, false)?,
            }
        }
        for (s, (cache, _)) in parts.iter().zip(seqs.iter_mut()) {
            cache.len = s.start + s.rows;
        }
        self.logits.resize(logit_rows * vocab, 0.0);
        if logit_rows == 0 {
            exec.flush()?;
        } else {
            exec.read(&w.logits, 0, &mut self.logits[..])?;
        }
        Ok(&self.logits)
    }
}
