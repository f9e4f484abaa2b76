//! Generating a synthetic model's weights into one pool-counted arena: every tensor is a
//! 64-byte-aligned segment, filled in parallel (chunk by chunk, each chunk from its own
//! seed), then viewed in place as the weight structs the forward pass reads.
//!
//! One arena rather than a vector per tensor means one refusal check against the pool
//! before anything is written, no zero-fill before the random fill, pages first touched
//! by the thread that fills them, and huge pages over nearly all of it (fewer page
//! faults while generating, fewer TLB misses while the kernels stream the weights).

use std::mem::MaybeUninit;
use std::path::PathBuf;
use std::sync::Arc;

use half::bf16;
use kiln_core::{
    Buffer, Lease, MemoryPool, OutOfMemory, QuantSpec, QuantizedMatrix, ScaleData, SharedBytes, Tag,
};
use rand_core::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use rayon::prelude::*;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::experts::{Expert, ExpertStore};
use crate::weights::{DenseMlp, Layer, Linear, LinearWeight, Mlp, ModelWeights, MoeMlp, RmsNorm};

/// Words (8 bytes) generated from one seed: the unit of parallel generation.
const CHUNK_WORDS: usize = 1 << 13;

/// Segment alignment in words: one cache line.
const ALIGN_WORDS: usize = 8;

/// Half the spread of a synthetic router's per-expert logit bias (uniform in
/// `[-ROUTER_SKEW, ROUTER_SKEW)`): the most favoured expert's logit sits up to
/// `2 * ROUTER_SKEW` above the least favoured one's, on top of logits of unit order.
pub const ROUTER_SKEW: f32 = 1.5;

/// Which tensor a seed belongs to; mixed with the layer index and the model seed.
#[derive(Clone, Copy)]
enum Slot {
    Embed = 1,
    LmHead,
    FinalNorm,
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
    InputNorm,
    PostNorm,
    QBias,
    KBias,
    VBias,
    QNorm,
    KNorm,
    Router,
    RouterBias,
    SharedGate,
    SharedUp,
    SharedDown,
    SharedExpertGate,
    ExpertGate,
    ExpertUp,
    ExpertDown,
}

/// One tensor of the model, in the order [`assemble`] takes them.
#[derive(Clone, Copy)]
enum Tensor {
    /// A quantized `[n, k]`.
    Matrix { n: usize, k: usize, seed: u64 },
    /// `n` f32 values uniform in `[lo, lo + width)`.
    Vector { n: usize, lo: f32, width: f32, seed: u64 },
}

/// Every tensor of `config`'s model, in assembly order.
fn tensors(config: &ModelConfig, seed: u64) -> Vec<Tensor> {
    let (h, i, q, kv) = (config.hidden_size, config.intermediate_size, config.q_dim(), config.kv_dim());
    let s = |layer: usize, slot: Slot| tensor_seed(seed, layer, slot);
    let matrix = |n, k, layer, slot| Tensor::Matrix { n, k, seed: s(layer, slot) };
    let norm = |layer, slot| Tensor::Vector { n: h, lo: 0.9, width: 0.2, seed: s(layer, slot) };
    let bias = |n, layer, slot| Tensor::Vector { n, lo: -0.1, width: 0.2, seed: s(layer, slot) };
    let head_norm =
        |layer, slot| Tensor::Vector { n: config.head_dim, lo: 0.9, width: 0.2, seed: s(layer, slot) };
    let mut out = Vec::new();
    for l in 0..config.num_hidden_layers {
        out.push(norm(l, Slot::InputNorm));
        for (n, w, b) in [(q, Slot::Q, Slot::QBias), (kv, Slot::K, Slot::KBias), (kv, Slot::V, Slot::VBias)] {
            out.push(matrix(n, h, l, w));
            if config.attention_bias {
                out.push(bias(n, l, b));
            }
        }
        if config.qk_norm {
            out.push(head_norm(l, Slot::QNorm));
            out.push(head_norm(l, Slot::KNorm));
        }
        out.push(matrix(h, q, l, Slot::O));
        out.push(norm(l, Slot::PostNorm));
        match &config.moe {
            None => {
                out.push(matrix(i, h, l, Slot::Gate));
                out.push(matrix(i, h, l, Slot::Up));
                out.push(matrix(h, i, l, Slot::Down));
            }
            Some(moe) => {
                out.push(matrix(moe.experts, h, l, Slot::Router));
                // A fixed per-expert logit bias: some experts popular, others rare, as a
                // trained router's are (uniform routing would make every cache look bad).
                out.push(Tensor::Vector {
                    n: moe.experts,
                    lo: -ROUTER_SKEW,
                    width: 2.0 * ROUTER_SKEW,
                    seed: s(l, Slot::RouterBias),
                });
                if let Some(si) = moe.shared_expert_intermediate_size {
                    out.push(matrix(si, h, l, Slot::SharedGate));
                    out.push(matrix(si, h, l, Slot::SharedUp));
                    out.push(matrix(h, si, l, Slot::SharedDown));
                    out.push(matrix(1, h, l, Slot::SharedExpertGate));
                }
            }
        }
    }
    let top = config.num_hidden_layers;
    out.push(matrix(config.vocab_size, h, top, Slot::Embed));
    if !config.tie_word_embeddings {
        out.push(matrix(config.vocab_size, h, top, Slot::LmHead));
    }
    out.push(norm(top, Slot::FinalNorm));
    // The routed experts last, layer by layer, each expert's three matrices together:
    // the host tier an expert cache copies from.
    if let Some(moe) = &config.moe {
        let ei = moe.expert_intermediate_size;
        for l in 0..config.num_hidden_layers {
            for e in 0..moe.experts {
                let es = |slot| mix(s(l, slot) ^ mix(e as u64 + 1));
                out.push(Tensor::Matrix { n: ei, k: h, seed: es(Slot::ExpertGate) });
                out.push(Tensor::Matrix { n: ei, k: h, seed: es(Slot::ExpertUp) });
                out.push(Tensor::Matrix { n: h, k: ei, seed: es(Slot::ExpertDown) });
            }
        }
    }
    out
}

/// How a segment's values are drawn.
#[derive(Clone, Copy)]
enum Fill {
    /// Uniform random code words.
    Codes,
    /// Per-group scales around `base`.
    Scales { base: f32 },
    /// The bias that centres each group's codes: `-mid * scale`, the scale redrawn from
    /// the scales' own stream.
    Biases { base: f32, mid: f32 },
    /// Uniform f32 values.
    Values { lo: f32, width: f32 },
}

/// One contiguous run of the arena.
#[derive(Clone, Copy)]
struct Segment {
    seed: u64,
    fill: Fill,
    /// Bytes of the tensor.
    bytes: usize,
}

impl Segment {
    /// Words the segment occupies, padded to [`ALIGN_WORDS`].
    fn words(&self) -> usize {
        self.bytes.div_ceil(8).next_multiple_of(ALIGN_WORDS)
    }

    /// Writes chunk `c` of the segment.
    fn fill_chunk(&self, c: usize, out: &mut [MaybeUninit<u64>]) {
        let stream = match self.fill {
            Fill::Codes => 0,
            Fill::Scales { .. } | Fill::Biases { .. } => 1,
            Fill::Values { .. } => 2,
        };
        let mut rng =
            Xoshiro256PlusPlus::seed_from_u64(mix(self.seed ^ mix(stream) ^ mix(c as u64 ^ 0xc4a1)));
        let scale =
            |base: f32, rng: &mut Xoshiro256PlusPlus| bf16::from_f32(base * (0.5 + unit(rng.next_u64())));
        for slot in out {
            let word = match self.fill {
                Fill::Codes => rng.next_u64(),
                Fill::Scales { base } => pack_bf16(std::array::from_fn(|_| scale(base, &mut rng))),
                Fill::Biases { base, mid } => {
                    pack_bf16(std::array::from_fn(|_| bf16::from_f32(-mid * scale(base, &mut rng).to_f32())))
                }
                Fill::Values { lo, width } => {
                    let [a, b]: [f32; 2] = std::array::from_fn(|_| lo + width * unit(rng.next_u64()));
                    let (a, b) = (a.to_ne_bytes(), b.to_ne_bytes());
                    u64::from_ne_bytes([a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]])
                }
            };
            slot.write(word);
        }
    }
}

/// Four bf16 values as the word holding them in memory order.
fn pack_bf16(v: [bf16; 4]) -> u64 {
    let b: [[u8; 2]; 4] = v.map(|x| x.to_bits().to_ne_bytes());
    u64::from_ne_bytes([b[0][0], b[0][1], b[1][0], b[1][1], b[2][0], b[2][1], b[3][0], b[3][1]])
}

/// The segments of every tensor, in order.
fn segments(config: &ModelConfig, quant: QuantSpec, seed: u64) -> Vec<Segment> {
    let max_code = quant.max_code() as f32;
    // Codes are uniform on [0, max_code]: mean max_code / 2, variance ((max+1)^2 - 1) / 12.
    let code_std = (((max_code + 1.0) * (max_code + 1.0) - 1.0) / 12.0).sqrt();
    let mut out = Vec::new();
    for t in tensors(config, seed) {
        match t {
            Tensor::Matrix { n, k, seed } => {
                let base = 1.0 / (code_std * (k as f32).sqrt());
                let groups = n * quant.groups_per_row(k);
                out.push(Segment { seed, fill: Fill::Codes, bytes: n * quant.words_per_row(k) * 4 });
                out.push(Segment { seed, fill: Fill::Scales { base }, bytes: groups * 2 });
                out.push(Segment {
                    seed,
                    fill: Fill::Biases { base, mid: 0.5 * max_code },
                    bytes: groups * 2,
                });
            }
            Tensor::Vector { n, lo, width, seed } => {
                out.push(Segment { seed, fill: Fill::Values { lo, width }, bytes: n * 4 });
            }
        }
    }
    out
}

/// Bytes the arena of `config`'s model takes (tensors plus alignment padding).
pub fn arena_bytes(config: &ModelConfig, quant: QuantSpec) -> u64 {
    segments(config, quant, 0).iter().map(|s| s.words() as u64 * 8).sum()
}

/// The arena: generated words, counted by the pool for as long as any view lives.
struct Arena {
    words: Vec<u64>,
    _lease: Lease,
}

impl SharedBytes for Arena {
    fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.words)
    }
}

/// Generates the weights of `config`'s model from `seed`.
pub fn generate(
    config: &ModelConfig,
    quant: QuantSpec,
    seed: u64,
    pool: &MemoryPool,
) -> Result<ModelWeights> {
    let segs = segments(config, quant, seed);
    let total: usize = segs.iter().map(Segment::words).sum();
    let bytes = total as u64 * 8;
    let lease = pool.reserve(Tag::Weights, bytes)?;
    let mut words: Vec<u64> = Vec::new();
    if words.try_reserve_exact(total).is_err() {
        let in_use = pool.stats().live_bytes - bytes;
        return Err(OutOfMemory { requested: bytes, tag: Tag::Weights, in_use, limit: u64::MAX }.into());
    }
    let spare = &mut words.spare_capacity_mut()[..total];
    advise_huge_pages(spare);
    let mut jobs = Vec::with_capacity(segs.len());
    let mut rest = spare;
    for s in &segs {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(s.words());
        jobs.push((s, head));
        rest = tail;
    }
    jobs.into_par_iter().for_each(|(s, mem)| {
        mem.par_chunks_mut(CHUNK_WORDS).enumerate().for_each(|(c, out)| s.fill_chunk(c, out));
    });
    // SAFETY: the segments tile the first `total` slots exactly (each job got the next
    // `words()` of them) and `fill_chunk` writes every slot of every chunk; `total` is
    // within the capacity reserved above.
    unsafe { words.set_len(total) };
    let arena: Arc<dyn SharedBytes> = Arc::new(Arena { words, _lease: lease });
    let mut views = Views { arena, offset: 0, segs: segs.into_iter() };
    assemble(config, quant, &mut views)
}

/// Takes the arena's segments in order as typed views.
struct Views {
    arena: Arc<dyn SharedBytes>,
    offset: usize,
    segs: std::vec::IntoIter<Segment>,
}

impl Views {
    fn next<T: bytemuck::Pod>(&mut self) -> Result<Buffer<T>> {
        let seg = self.segs.next().ok_or_else(|| internal("fewer segments than tensors".into()))?;
        let start = self.offset;
        self.offset += seg.words() * 8;
        Buffer::from_shared(Arc::clone(&self.arena), start, start + seg.bytes, None)
            .map_err(|e| internal(e.to_string()))
    }

    fn matrix(&mut self, n: usize, k: usize, quant: QuantSpec) -> Result<QuantizedMatrix> {
        let (packed, scales, biases) = (self.next()?, self.next()?, self.next()?);
        QuantizedMatrix::new(n, k, quant, packed, ScaleData::Bf16(scales), ScaleData::Bf16(biases))
            .map_err(|cause| ModelError::Geometry { tensor: format!("synthetic [{n}, {k}]"), cause })
    }
}

fn internal(message: String) -> ModelError {
    ModelError::Checkpoint {
        path: PathBuf::from("synthetic"),
        message: format!("generating weights: {message}"),
    }
}

/// Builds the weight structs from the views, taking tensors in [`tensors`]' order.
fn assemble(config: &ModelConfig, quant: QuantSpec, v: &mut Views) -> Result<ModelWeights> {
    let (h, i, q, kv) = (config.hidden_size, config.intermediate_size, config.q_dim(), config.kv_dim());
    let eps = config.rms_norm_eps;
    let linear = |v: &mut Views, n: usize, k: usize, biased: bool| -> Result<Linear> {
        let weight = LinearWeight::Quantized(v.matrix(n, k, quant)?);
        let bias = if biased { Some(v.next()?) } else { None };
        Ok(Linear { weight, bias })
    };
    let mut layers = Vec::with_capacity(config.num_hidden_layers);
    for _ in 0..config.num_hidden_layers {
        let input_layernorm = RmsNorm { weight: v.next()?, eps };
        let q_proj = linear(v, q, h, config.attention_bias)?;
        let k_proj = linear(v, kv, h, config.attention_bias)?;
        let v_proj = linear(v, kv, h, config.attention_bias)?;
        let (q_norm, k_norm) = if config.qk_norm {
            (Some(RmsNorm { weight: v.next()?, eps }), Some(RmsNorm { weight: v.next()?, eps }))
        } else {
            (None, None)
        };
        let o_proj = linear(v, h, q, false)?;
        let post_attention_layernorm = RmsNorm { weight: v.next()?, eps };
        let mlp = match &config.moe {
            None => Mlp::Dense(DenseMlp {
                gate_proj: linear(v, i, h, false)?,
                up_proj: linear(v, i, h, false)?,
                down_proj: linear(v, h, i, false)?,
            }),
            Some(moe) => {
                let router = linear(v, moe.experts, h, true)?;
                let (shared_expert, shared_expert_gate) = match moe.shared_expert_intermediate_size {
                    None => (None, None),
                    Some(si) => (
                        Some(DenseMlp {
                            gate_proj: linear(v, si, h, false)?,
                            up_proj: linear(v, si, h, false)?,
                            down_proj: linear(v, h, si, false)?,
                        }),
                        Some(linear(v, 1, h, false)?),
                    ),
                };
                Mlp::Moe(MoeMlp { router, shared_expert, shared_expert_gate })
            }
        };
        layers.push(Layer {
            input_layernorm,
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            q_norm,
            k_norm,
            post_attention_layernorm,
            mlp,
        });
    }
    let embed_tokens = LinearWeight::Quantized(v.matrix(config.vocab_size, h, quant)?);
    let lm_head =
        if config.tie_word_embeddings { None } else { Some(linear(v, config.vocab_size, h, false)?) };
    let norm = RmsNorm { weight: v.next()?, eps };
    let experts = match &config.moe {
        None => None,
        Some(moe) => {
            let ei = moe.expert_intermediate_size;
            let mut all = Vec::with_capacity(config.num_hidden_layers * moe.experts);
            for _ in 0..config.num_hidden_layers * moe.experts {
                all.push(Expert {
                    gate_proj: v.matrix(ei, h, quant)?,
                    up_proj: v.matrix(ei, h, quant)?,
                    down_proj: v.matrix(h, ei, quant)?,
                });
            }
            Some(ExpertStore::new(config.num_hidden_layers, moe.experts, moe.top_k, all)?)
        }
    };
    if v.segs.next().is_some() {
        return Err(internal("more segments than tensors".into()));
    }
    Ok(ModelWeights { embed_tokens, layers, norm, lm_head, experts })
}

/// SplitMix64's finaliser: a bijective mix so nearby inputs give unrelated seeds.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn tensor_seed(seed: u64, layer: usize, slot: Slot) -> u64 {
    mix(mix(seed ^ mix(layer as u64 + 1)) ^ slot as u64)
}

/// A uniform f32 in `[0, 1)` from the top 24 bits of a word.
fn unit(word: u64) -> f32 {
    (word >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
}

/// Asks the kernel to back the whole 2 MiB pages inside `mem` with huge pages. A hint
/// only; refusing it changes nothing but speed.
fn advise_huge_pages<T>(mem: &mut [T]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = mem.as_mut_ptr() as usize;
        let end = start + size_of_val(mem);
        let first = start.next_multiple_of(HUGE);
        if first < end && (end - first) >= HUGE {
            let len = (end - first) / HUGE * HUGE;
            // SAFETY: `first..first + len` lies inside `mem`, memory this process owns
            // exclusively here; MADV_HUGEPAGE changes how the kernel backs those pages, not
            // their contents or validity, and its result is deliberately ignored.
            unsafe {
                libc::madvise(first as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = mem;
}
