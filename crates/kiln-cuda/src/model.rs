//! The forward pass on a device: kiln-model's decoder (its configuration, its weights in
//! the checkpoint's bytes, its RoPE frequencies) run as a sequence of kiln-cuda launches
//! on an [`Exec`]. The layer order is transformer.rs's: embedding; per layer RMSNorm,
//! q/k/v (with their biases, and Qwen3's per-head q/k RMSNorm), RoPE, the store into the
//! f16 cache, split-and-merge attention, o_proj and the residual, RMSNorm, gate and up,
//! SiLU-and-multiply, down and the residual; the final norm and the LM head (the
//! embedding when tied). Weights, the KV cache and every activation live in the device's
//! memory; the host sends the token ids and positions and reads back the logits rows.
//!
//! Activations that feed a product are f16 (W4A16: f32 accumulation in the kernels); the
//! residual stream, the projections' outputs, q/k/v and the norms' inputs are f32. A
//! projection of M rows runs `qmv` (M = 1), `qmv_wide` (2..=8) or `qmm` (more); the first
//! two give a row the same bits at any M, so a prefill in chunks of at most 8 tokens
//! equals one decode step per token bit for bit, and `qmm` rows do not depend on M either
//! (docs/cuda.md).
//!
//! Memory: every buffer is allocated from the executor's [`crate::DevicePool`] under a tag
//! (weights, kv, scratch). [`plan`] makes the same allocations on [`Exec::plan`], which
//! counts and stores nothing, so `kiln estimate --backend cuda` is the pool's peak of the
//! run it describes (a test checks it against a run). MoE models and unquantized weights are refused with a message.

use kiln_core::{QuantizedMatrix, ScaleDtype, Tag};
use kiln_model::rope::Rope;
use kiln_model::weights::{Linear, LinearWeight, Mlp, ModelWeights, RmsNorm};
use kiln_model::{Logits, ModelConfig, SeqChunk};

use crate::error::CudaError;
use crate::exec::{Exec, Mem};
use crate::launch::{
    self, Act, AttnBuffers, AttnShape, EmbedBuffers, EmbedShape, Launch, Out, QmmShape, QmvBuffers, QmvShape,
};

/// The storage of the activations the products read.
pub const ACT: Act = Act::F16;
const ACT_OUT: Out = Out::F16;
const ACT_BYTES: usize = 2;

/// A quantized matrix in device memory, in the checkpoint's bytes.
struct DevMatrix {
    packed: Mem,
    scales: Mem,
    biases: Mem,
    n: usize,
    k: usize,
    spec: kiln_core::QuantSpec,
    scale_dtype: ScaleDtype,
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
}

/// A model's weights on a device.
pub struct DeviceWeights {
    embed: DevMatrix,
    layers: Vec<DevLayer>,
    norm: Mem,
    head: Option<DevLinear>,
    inv_freq: Mem,
    eps: Vec<(f32, f32)>,
    final_eps: f32,
    qk_eps: Vec<(f32, f32)>,
}

fn scale_bytes(d: &kiln_core::matrix::ScaleData) -> &[u8] {
    use kiln_core::matrix::ScaleData;
    match d {
        ScaleData::F16(b) => bytemuck::cast_slice(&b[..]),
        ScaleData::Bf16(b) => bytemuck::cast_slice(&b[..]),
        ScaleData::F32(b) => bytemuck::cast_slice(&b[..]),
    }
}

fn unsupported(what: String) -> CudaError {
    CudaError::Unsupported { what }
}

fn quantized<'w>(name: &str, w: &'w LinearWeight) -> Result<&'w QuantizedMatrix, CudaError> {
    match w {
        LinearWeight::Quantized(q) => Ok(q),
        LinearWeight::Dense(_) => Err(unsupported(format!(
            "{name}: it is unquantized, and the cuda backend runs MLX-affine 4- and 8-bit weights \
             (load it with --quantize 4 or --quantize 8)"
        ))),
    }
}

fn matrix(exec: &Exec, name: &str, w: &LinearWeight, product: bool) -> Result<DevMatrix, CudaError> {
    let q = quantized(name, w)?;
    // The kernels here read rows: a matrix reordered for the CPU's lane-row kernel is
    // copied back to rows first.
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
            "{name}: it is {bits}-bit, and the cuda backend's products take 4- and 8-bit weights"
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
    })
}

fn linear(exec: &Exec, name: &str, l: &Linear) -> Result<DevLinear, CudaError> {
    Ok(DevLinear {
        w: matrix(exec, name, &l.weight, true)?,
        bias: l.bias.as_ref().map(|b| exec.upload(Tag::Weights, &b[..])).transpose()?,
    })
}

fn norm(exec: &Exec, n: &RmsNorm) -> Result<Mem, CudaError> {
    exec.upload(Tag::Weights, &n.weight[..])
}

impl DeviceWeights {
    /// Copies `weights` to `exec`, checking first that the device forward runs them.
    pub fn upload(
        exec: &Exec,
        config: &ModelConfig,
        weights: &ModelWeights,
    ) -> Result<DeviceWeights, CudaError> {
        if config.moe.is_some() || weights.experts.is_some() {
            return Err(unsupported(
                "a mixture-of-experts model yet: its router and expert kernels exist, the device forward \
                 does not route"
                    .into(),
            ));
        }
        let shape = AttnShape {
            rows: 1,
            start: 0,
            kv_heads: config.num_key_value_heads,
            group: config.gqa_group(),
            head_dim: config.head_dim,
            capacity: 1,
            out: ACT_OUT,
        };
        shape.check()?;
        // The LM head reads the embedding when tied: both as a product, so 4 or 8 bits.
        let embed = matrix(exec, "model.embed_tokens", &weights.embed_tokens, weights.lm_head.is_none())?;
        let mut layers = Vec::with_capacity(weights.layers.len());
        let (mut eps, mut qk_eps) = (Vec::new(), Vec::new());
        for (i, l) in weights.layers.iter().enumerate() {
            let name = |p: &str| format!("model.layers.{i}.{p}");
            let Mlp::Dense(mlp) = &l.mlp else {
                return Err(unsupported(format!("{}: a routed MLP", name("mlp"))));
            };
            eps.push((l.input_layernorm.eps, l.post_attention_layernorm.eps));
            qk_eps.push((l.q_norm.as_ref().map_or(0.0, |n| n.eps), l.k_norm.as_ref().map_or(0.0, |n| n.eps)));
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
            });
        }
        let head = weights.lm_head.as_ref().map(|h| linear(exec, "lm_head", h)).transpose()?;
        let rope = Rope::new(config);
        Ok(DeviceWeights {
            embed,
            layers,
            norm: norm(exec, &weights.norm)?,
            head,
            inv_freq: exec.upload(Tag::Weights, rope.inv_freq())?,
            eps,
            final_eps: weights.norm.eps,
            qk_eps,
        })
    }
}

/// One sequence's keys and values on the device: per layer, f16 `[kv_heads, capacity,
/// head_dim]` for the keys and the same for the values. The capacity is fixed when it is
/// made.
pub struct DeviceCache {
    keys: Vec<Mem>,
    values: Vec<Mem>,
    capacity: usize,
    len: usize,
    head_dim: usize,
}

impl DeviceCache {
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

    /// Bytes held on the device.
    pub fn bytes(&self) -> u64 {
        self.keys.iter().chain(&self.values).map(|m| m.bytes() as u64).sum()
    }

    /// Forgets the positions from `len` on.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Makes this cache hold the first `n` positions of `src`: per layer and key/value
    /// head, one device copy of the keys and one of the values (each head's positions
    /// are contiguous, at a stride of the cache's capacity).
    pub fn copy_prefix_from(&mut self, src: &DeviceCache, n: usize) -> Result<(), CudaError> {
        if n > src.len || n > self.capacity || self.keys.len() != src.keys.len() {
            return Err(CudaError::Input {
                what: "cache prefix".into(),
                message: format!(
                    "{n} positions from a cache holding {} into one of {} positions",
                    src.len, self.capacity
                ),
            });
        }
        let head_bytes = |capacity: usize| self.head_stride(capacity);
        let (row, from_stride, to_stride) =
            (self.position_bytes(), head_bytes(src.capacity), head_bytes(self.capacity));
        let heads = if row == 0 { 0 } else { self.keys.first().map_or(0, |m| m.bytes()) / to_stride.max(1) };
        for (to, from) in self.keys.iter_mut().zip(&src.keys).chain(self.values.iter_mut().zip(&src.values)) {
            for h in 0..heads {
                to.copy_range_from(h * to_stride, from, h * from_stride, n * row)?;
            }
        }
        self.len = n;
        Ok(())
    }

    /// Bytes of one position of one head (f16 values of a head's width).
    fn position_bytes(&self) -> usize {
        self.head_dim * 2
    }

    /// Bytes of one head's positions in a cache of `capacity`.
    fn head_stride(&self, capacity: usize) -> usize {
        capacity * self.position_bytes()
    }
}

/// The bytes of one layer's keys (or values) for `capacity` positions.
pub fn cache_layer_bytes(config: &ModelConfig, capacity: usize) -> usize {
    config.num_key_value_heads * capacity * config.head_dim * 2
}

/// The activations of forwards of up to `rows` rows over caches of up to `capacity`
/// positions, returning up to `logit_rows` rows of logits.
struct Work {
    rows: usize,
    capacity: usize,
    logit_rows: usize,
    tokens: Mem,
    positions: Mem,
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
}

impl Work {
    fn new(
        exec: &Exec,
        c: &ModelConfig,
        rows: usize,
        capacity: usize,
        logit_rows: usize,
    ) -> Result<Work, CudaError> {
        let s = |bytes: usize| exec.alloc(Tag::Scratch, bytes);
        let (h, qd, kvd, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.mlp_width());
        let attn = attn_shape(c, rows, capacity.saturating_sub(rows), capacity);
        Ok(Work {
            rows,
            capacity,
            logit_rows,
            tokens: s(rows * 4)?,
            positions: s(rows * 4)?,
            x: s(rows * h * 4)?,
            xn: s(rows * h * ACT_BYTES)?,
            q: s(rows * qd * 4)?,
            k: s(rows * kvd * 4)?,
            v: s(rows * kvd * 4)?,
            qn: if c.qk_norm { Some(s(rows * qd * 4)?) } else { None },
            kn: if c.qk_norm { Some(s(rows * kvd * 4)?) } else { None },
            attn: s(rows * qd * ACT_BYTES)?,
            scratch: s(attn.scratch_bytes())?,
            proj: s(rows * h * 4)?,
            gate: s(rows * inter * 4)?,
            up: s(rows * inter * 4)?,
            mlp: s(rows * inter * ACT_BYTES)?,
            head_x: s(logit_rows * h * ACT_BYTES)?,
            logits: s(logit_rows * c.vocab_size * 4)?,
        })
    }
}

fn attn_shape(c: &ModelConfig, rows: usize, start: usize, capacity: usize) -> AttnShape {
    AttnShape {
        rows,
        start,
        kv_heads: c.num_key_value_heads,
        group: c.gqa_group(),
        head_dim: c.head_dim,
        capacity,
        out: ACT_OUT,
    }
}

/// Prompt tokens per prefill forward when none is asked for (`--prefill-chunk 0`). The
/// attention kernels keep one state per row, key/value head and 256-key span, so one
/// forward over a whole long prompt would hold rows x context of them (16 GB for 32768
/// tokens of a Qwen2.5-0.5B shape); chunks of 512 keep that to a few hundred MB while
/// each product still runs `qmm` over 512 rows. Until a tiled prefill attention lands.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// Rows of the largest prefill forward of `prompt_tokens` in chunks of `chunk` (0:
/// [`DEFAULT_PREFILL_CHUNK`]).
pub fn prefill_rows(chunk: usize, prompt_tokens: usize) -> usize {
    kiln_model::prefill_rows(chunk, prompt_tokens, DEFAULT_PREFILL_CHUNK)
}

/// What a device run holds at its peak, by tag, from [`plan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevicePlan {
    /// Weights in the checkpoint's bytes, norms, biases and RoPE frequencies.
    pub weights_bytes: u64,
    /// The KV cache.
    pub kv_bytes: u64,
    /// The activations and the attention's span states.
    pub scratch_bytes: u64,
    /// Everything: the device pool's peak for the run.
    pub total_bytes: u64,
}

/// The shape of a device run: one sequence of `sequence_tokens` positions, forwards of up
/// to `rows` rows, returning up to `logit_rows` rows of logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRunShape {
    /// Positions the cache holds (prompt plus generated tokens).
    pub sequence_tokens: usize,
    /// Rows of the largest forward (the prefill chunk, or the prompt).
    pub rows: usize,
    /// Logit rows of the largest forward (1, or the prompt for scoring).
    pub logit_rows: usize,
}

/// The bytes [`DeviceWeights::upload`] takes beyond the CPU's weight bytes of the same
/// model: the RoPE frequencies (the matrices, norms and biases are the same bytes).
pub fn extra_weight_bytes(config: &ModelConfig) -> u64 {
    (config.head_dim / 2 * 4) as u64
}

/// The device memory a run of `shape` takes, from the model's configuration and the CPU's
/// count of its weight bytes (`ModelInfo::weight_bytes`: no weights are loaded): the
/// allocations [`DeviceEngine`] makes for it, counted by [`Exec::plan`].
pub fn plan(config: &ModelConfig, weight_bytes: u64, shape: DeviceRunShape) -> Result<DevicePlan, CudaError> {
    let exec = Exec::plan(u64::MAX);
    let weights = exec.alloc(Tag::Weights, (weight_bytes + extra_weight_bytes(config)) as usize)?;
    let work =
        Work::new(&exec, config, shape.rows.max(1), shape.sequence_tokens.max(1), shape.logit_rows.max(1))?;
    let cache = alloc_cache(&exec, config, shape.sequence_tokens)?;
    let st = exec.stats();
    drop((cache, work, weights));
    let tag = |t: &str| st.by_tag.get(t).map_or(0, |s| s.at_peak);
    Ok(DevicePlan {
        weights_bytes: tag("weights"),
        kv_bytes: tag("kv"),
        scratch_bytes: tag("scratch"),
        total_bytes: st.peak_bytes,
    })
}

fn alloc_cache(exec: &Exec, config: &ModelConfig, capacity: usize) -> Result<DeviceCache, CudaError> {
    let limit = config.max_position_embeddings;
    if capacity == 0 || capacity > limit {
        return Err(CudaError::Input {
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
    Ok(DeviceCache { keys, values, capacity, len: 0, head_dim: config.head_dim })
}

/// A model on a device with its activations, running forwards over caches it makes.
pub struct DeviceEngine<'e> {
    exec: &'e Exec,
    config: ModelConfig,
    weights: DeviceWeights,
    work: Option<Work>,
    logits: Vec<f32>,
    launches: u64,
    /// Whether a one-row forward replays as a graph ([`DeviceEngine::set_graphs`]).
    graphs: bool,
    graph: crate::graph::StepGraph,
    /// The launches of the forward being recorded for the graph.
    recording: Option<Vec<Launch>>,
    /// Prompt tokens per prefill forward (0: [`DEFAULT_PREFILL_CHUNK`]).
    prefill_chunk: usize,
}

impl<'e> DeviceEngine<'e> {
    /// Copies the weights to `exec`.
    pub fn new(exec: &'e Exec, config: &ModelConfig, weights: &ModelWeights) -> Result<Self, CudaError> {
        let weights = DeviceWeights::upload(exec, config, weights)?;
        Ok(DeviceEngine {
            exec,
            config: config.clone(),
            weights,
            work: None,
            logits: Vec::new(),
            launches: 0,
            graphs: true,
            graph: crate::graph::StepGraph::default(),
            recording: None,
            prefill_chunk: 0,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Prompt tokens per prefill forward as set (0: [`DEFAULT_PREFILL_CHUNK`]).
    pub fn prefill_chunk_setting(&self) -> usize {
        self.prefill_chunk
    }

    /// The executor.
    pub fn exec(&self) -> &'e Exec {
        self.exec
    }

    /// Launches queued so far (a graph's nodes counted each replay).
    pub fn launches(&self) -> u64 {
        self.launches
    }

    /// Whether a decode step (a one-row forward) is recorded and replayed as one graph
    /// (the default) or launched kernel by kernel. The outputs are the same bits.
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs = on;
    }

    /// Prompt tokens per prefill forward through the backend seam (0:
    /// [`DEFAULT_PREFILL_CHUNK`]).
    pub fn set_prefill_chunk(&mut self, chunk: usize) {
        self.prefill_chunk = chunk;
    }

    /// The decode graph's counters.
    pub fn graph_stats(&self) -> crate::graph::GraphStats {
        self.graph.stats()
    }

    /// Allocates the activations for forwards of up to `rows` rows over caches of up to
    /// `capacity` positions returning up to `logit_rows` logit rows, unless what is held
    /// covers it; a larger one replaces it (the old one is freed first).
    pub fn reserve(&mut self, rows: usize, capacity: usize, logit_rows: usize) -> Result<(), CudaError> {
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
        self.work = Some(Work::new(self.exec, &self.config, r, c, l)?);
        Ok(())
    }

    /// An empty cache of `capacity` positions (at most the model's context).
    pub fn new_cache(&self, capacity: usize) -> Result<DeviceCache, CudaError> {
        alloc_cache(self.exec, &self.config, capacity)
    }

    fn run(&mut self, l: Result<Launch, CudaError>) -> Result<(), CudaError> {
        let l = l?;
        self.launches += 1;
        if let Some(rec) = &mut self.recording {
            rec.push(l);
            return Ok(());
        }
        // SAFETY: every address in a launch built by this module lies in a `Mem` of this
        // engine's executor (weights, work or the cache being run), sized by the same
        // shapes the builders check: the work for `rows <= work.rows` rows and caches of
        // at most `work.capacity` positions, the cache for its capacity. Outputs never
        // alias inputs (each step writes a buffer of its own).
        unsafe { self.exec.launch(&l) }
    }

    fn project(&mut self, which: Proj, layer: usize, m: usize, x: u64, y: u64) -> Result<(), CudaError> {
        let lin = match which {
            Proj::Q => &self.weights.layers[layer].q,
            Proj::K => &self.weights.layers[layer].k,
            Proj::V => &self.weights.layers[layer].v,
            Proj::O => &self.weights.layers[layer].o,
            Proj::Gate => &self.weights.layers[layer].gate,
            Proj::Up => &self.weights.layers[layer].up,
            Proj::Down => &self.weights.layers[layer].down,
            Proj::Head => match &self.weights.head {
                Some(h) => h,
                None => {
                    let l = product(&self.weights.embed, m, x, y);
                    return self.run(l);
                }
            },
        };
        let l = product(&lin.w, m, x, y);
        let bias = lin.bias.as_ref().map(|b| launch::add_bias(m * lin.w.n, lin.w.n, y, b.addr()));
        self.run(l)?;
        match bias {
            Some(b) => self.run(b),
            None => Ok(()),
        }
    }

    /// Runs `tokens` of the sequence of `cache` through the model, appends their keys and
    /// values to it, and returns the requested logits (`[rows, vocab]`; `Logits::Last`
    /// is the last token's row).
    pub fn forward(
        &mut self,
        cache: &mut DeviceCache,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<&[f32], CudaError> {
        self.forward_seqs(&mut [SeqChunk { cache, tokens }], logits)
    }

    /// One forward over several sequences: every product runs over all their rows at
    /// once (M = the rows of every sequence: decode rows batched, prefill chunks beside
    /// them), RoPE, the cache store and attention per sequence over its own cache. The
    /// rows returned: `Logits::Last`, each sequence's last row in order; `Logits::All`,
    /// every row in order.
    pub fn forward_seqs(
        &mut self,
        seqs: &mut [SeqChunk<'_, DeviceCache>],
        logits: Logits,
    ) -> Result<&[f32], CudaError> {
        let c = &self.config;
        let (vocab, h, inter) = (c.vocab_size, c.hidden_size, c.mlp_width());
        let (heads, kvh, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let input = |message: String| CudaError::Input { what: "forward input".into(), message };
        if seqs.is_empty() || seqs.iter().any(|s| s.tokens.is_empty()) {
            return Err(input("a forward needs at least one new token per sequence".into()));
        }
        let mut ids: Vec<i32> = Vec::new();
        let mut pos: Vec<i32> = Vec::new();
        let mut capacity = 0;
        for s in seqs.iter() {
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(CudaError::Input {
                    what: "token id".into(),
                    message: format!("{t} is outside the vocabulary: accepted ids are 0..{vocab}"),
                });
            }
            let (start, n) = (s.cache.len, s.tokens.len());
            if start + n > s.cache.capacity {
                return Err(input(format!(
                    "{n} new tokens after {start} do not fit the device cache of {} positions",
                    s.cache.capacity
                )));
            }
            capacity = capacity.max(s.cache.capacity);
            ids.extend(s.tokens.iter().map(|&t| t as i32));
            pos.extend((start..start + n).map(|p| p as i32));
        }
        let rows = ids.len();
        let logit_rows = match logits {
            Logits::None => 0,
            Logits::Last => seqs.len(),
            Logits::All => rows,
        };
        self.reserve(rows, capacity, logit_rows)?;
        let exec = self.exec;
        let w = self.work.as_mut().expect("reserved above");
        exec.write(&mut w.tokens, 0, bytemuck::cast_slice(&ids))?;
        exec.write(&mut w.positions, 0, bytemuck::cast_slice(&pos))?;
        let record = seqs.len() == 1 && rows == 1 && logit_rows == 1 && self.graphs;
        let a = |m: &Mem| m.addr();
        let (x, xn, q, k, v, attn, scratch, proj) =
            (a(&w.x), a(&w.xn), a(&w.q), a(&w.k), a(&w.v), a(&w.attn), a(&w.scratch), a(&w.proj));
        let (gate, up, mlp, head_x, out) = (a(&w.gate), a(&w.up), a(&w.mlp), a(&w.head_x), a(&w.logits));
        let (qn, kn) = (w.qn.as_ref().map(a), w.kn.as_ref().map(a));
        let (tok, positions) = (a(&w.tokens), a(&w.positions));
        // Each sequence's first row, rows, first cached position.
        let spans: Vec<(usize, usize, usize)> = seqs
            .iter()
            .scan(0, |row, s| {
                let first = *row;
                *row += s.tokens.len();
                Some((first, s.tokens.len(), s.cache.len))
            })
            .collect();
        // A decode step's launches are recorded from here and replayed as one graph.
        self.recording = record.then(Vec::new);
        let e = &self.weights.embed;
        let embed =
            EmbedShape { rows, vocab, d: h, spec: e.spec, scales: e.scale_dtype }.launch(EmbedBuffers {
                packed: e.packed.addr(),
                scales: e.scales.addr(),
                biases: e.biases.addr(),
                tokens: tok,
                out: x,
            });
        self.run(embed)?;
        let inv_freq = self.weights.inv_freq.addr();
        for l in 0..self.weights.layers.len() {
            let (eps_in, eps_post) = self.weights.eps[l];
            let (eps_q, eps_k) = self.weights.qk_eps[l];
            let layer = &self.weights.layers[l];
            let (in_norm, post_norm) = (layer.input_norm.addr(), layer.post_norm.addr());
            let qk = layer.q_norm.as_ref().map(a).zip(layer.k_norm.as_ref().map(a));
            self.run(launch::rms_norm(rows, h, eps_in, ACT_OUT, x, in_norm, xn))?;
            self.project(Proj::Q, l, rows, xn, q)?;
            self.project(Proj::K, l, rows, xn, k)?;
            self.project(Proj::V, l, rows, xn, v)?;
            let (qs, ks) = match (qk, qn, kn) {
                (Some((wq, wk)), Some(qn), Some(kn)) => {
                    self.run(launch::rms_norm(rows * heads, hd, eps_q, Out::F32, q, wq, qn))?;
                    self.run(launch::rms_norm(rows * kvh, hd, eps_k, Out::F32, k, wk, kn))?;
                    (qn, kn)
                }
                _ => (q, k),
            };
            self.run(launch::rope(rows, heads, hd, qs, positions, inv_freq))?;
            self.run(launch::rope(rows, kvh, hd, ks, positions, inv_freq))?;
            for (s, &(first, n, start)) in seqs.iter().zip(&spans) {
                let (keys, values, cap) =
                    (s.cache.keys[l].addr(), s.cache.values[l].addr(), s.cache.capacity);
                let (ks_i, v_i) = (ks + (first * kvd * 4) as u64, v + (first * kvd * 4) as u64);
                self.run(launch::kv_store(n, kvh, hd, cap, start, ks_i, v_i, keys, values))?;
                let shape = attn_shape(&self.config, n, start, cap);
                let (q_i, out_i) = (qs + (first * qd * 4) as u64, attn + (first * qd * ACT_BYTES) as u64);
                let [split, merge] =
                    shape.launches(AttnBuffers { q: q_i, keys, values, scratch, out: out_i })?;
                self.run(Ok(split))?;
                self.run(Ok(merge))?;
            }
            self.project(Proj::O, l, rows, attn, proj)?;
            self.run(launch::add(rows * h, x, proj))?;
            self.run(launch::rms_norm(rows, h, eps_post, ACT_OUT, x, post_norm, xn))?;
            self.project(Proj::Gate, l, rows, xn, gate)?;
            self.project(Proj::Up, l, rows, xn, up)?;
            self.run(launch::silu_mul(rows * inter, ACT_OUT, gate, up, mlp))?;
            self.project(Proj::Down, l, rows, mlp, proj)?;
            self.run(launch::add(rows * h, x, proj))?;
        }
        let commit = |seqs: &mut [SeqChunk<'_, DeviceCache>]| {
            for s in seqs.iter_mut() {
                s.cache.len += s.tokens.len();
            }
        };
        if logit_rows == 0 {
            commit(seqs);
            self.logits.clear();
            return Ok(&self.logits);
        }
        let final_norm = self.weights.norm.addr();
        let eps = self.weights.final_eps;
        if logits == Logits::All {
            self.run(launch::rms_norm(rows, h, eps, ACT_OUT, x, final_norm, head_x))?;
        } else {
            // Each sequence's last row, normed into its row of the head's input.
            for (i, &(first, n, _)) in spans.iter().enumerate() {
                let from = x + ((first + n - 1) * h * 4) as u64;
                let to = head_x + (i * h * ACT_BYTES) as u64;
                self.run(launch::rms_norm(1, h, eps, ACT_OUT, from, final_norm, to))?;
            }
        }
        self.project(Proj::Head, 0, logit_rows, head_x, out)?;
        if let Some(launches) = self.recording.take() {
            // SAFETY: as in `run`, for every launch this forward recorded.
            unsafe { exec.replay(&mut self.graph, launches) }?;
        }
        commit(seqs);
        self.logits.resize(logit_rows * vocab, 0.0);
        let w = self.work.as_ref().expect("reserved above");
        exec.read(&w.logits, 0, &mut self.logits[..])?;
        Ok(&self.logits)
    }

    /// Runs `tokens` into `cache` in forwards of `chunk` tokens (0:
    /// [`DEFAULT_PREFILL_CHUNK`]) and returns the last token's logits.
    pub fn prefill(
        &mut self,
        cache: &mut DeviceCache,
        tokens: &[u32],
        chunk: usize,
    ) -> Result<&[f32], CudaError> {
        let chunk = prefill_rows(chunk, tokens.len());
        let n = tokens.chunks(chunk).count();
        for (i, part) in tokens.chunks(chunk).enumerate() {
            let logits = if i + 1 == n { Logits::Last } else { Logits::None };
            self.forward(cache, part, logits)?;
        }
        if n == 0 {
            return self.forward(cache, tokens, Logits::Last);
        }
        Ok(&self.logits)
    }

    /// One decode step: `token` appended to `cache`, its logits returned.
    pub fn decode(&mut self, cache: &mut DeviceCache, token: u32) -> Result<&[f32], CudaError> {
        self.forward(cache, &[token], Logits::Last)
    }
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
    Head,
}

fn product(w: &DevMatrix, m: usize, x: u64, y: u64) -> Result<Launch, CudaError> {
    let b = QmvBuffers { packed: w.packed.addr(), scales: w.scales.addr(), biases: w.biases.addr(), x, y };
    if launch::product_kernel(m) != "qmm" {
        QmvShape { n: w.n, k: w.k, m, spec: w.spec, scales: w.scale_dtype, act: ACT }.launch(b)
    } else {
        QmmShape { n: w.n, k: w.k, m, spec: w.spec, scales: w.scale_dtype, act: ACT }.launch(b)
    }
}
