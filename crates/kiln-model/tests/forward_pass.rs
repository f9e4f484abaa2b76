//! The forward pass against an independent f64 implementation of the same decoder, and
//! its variants against each other: streaming and naive attention, chunked and whole
//! prefill, f16 and f32 caches; synthetic determinism; errors that leave a sequence
//! usable.
//!
//! Comparisons that check the forward pass itself run the model's dense twin (every
//! matrix dequantized to f32, products through the dense kernel), so the quantized
//! kernels' own rounding (which may quantize activations to int8) does not hide a
//! forward-pass error behind a loose tolerance. One test runs the quantized kernels end
//! to end against the same reference, with the kernels' tolerance.

use kiln_core::dense::DenseMatrix;
use kiln_core::{Buffer, MemoryPool, Tag};
use kiln_model::config::RopeScaling;
use kiln_model::ops::argmax;
use kiln_model::tokenizer::ByteTokenizer;
use kiln_model::weights::{DenseMlp, Layer, Linear, LinearWeight, Mlp, ModelWeights, RmsNorm};
use kiln_model::{
    AttentionKind, EngineOptions, KvDtype, LoadedModel, ModelConfig, ModelError, Sampler, SamplingParams,
    Session, Tokenizer, synthetic,
};

/// |kiln - f64 reference| / |reference| (Euclidean norms over all logits) for the dense
/// twin: f32 arithmetic against f64 (measured about 1e-6).
const DENSE_TOLERANCE: f64 = 1e-4;

/// The same for the quantized kernels, derived from their centred-code scheme
/// (kiln_core::kernels): each matrix product rounds its input activations per group to
/// codes `xq` with `sx = max|x| / 127` (4-bit weights; 8-bit weights use 16-bit codes,
/// 256 times finer, so 4-bit bounds both). The product's error is exactly the centred
/// weights `s * (q - c)` applied to the rounding error `sx * xq - x`, uniform in
/// `±sx / 2`: relative to the input it is `CREST / (127 * sqrt(12))` in RMS, where
/// `CREST = max|x| / rms(x)` within a group (about 2.5 for Gaussian groups of 64; 4 allows
/// outliers). A two-layer model rounds `ROUNDINGS` independent inputs (per layer the
/// attention input, shared by q, k and v, the o_proj input, the MLP input, shared by gate
/// and up, and the down_proj input; then the LM head's), whose errors add in quadrature,
/// and the untrained layers amplify them by at most `AMPLIFICATION` (normalisation and
/// softmax). The product, 0.082, is 3.4 times the largest measured error (2.4%, tiny at
/// 4 bits against the f64 decoder). A wrong rotation, mask or head mapping costs the whole
/// norm.
const KERNEL_TOLERANCE: f64 = AMPLIFICATION * SQRT_ROUNDINGS * CREST / (127.0 * SQRT_12);
/// See [`KERNEL_TOLERANCE`]: `max|x| / rms(x)` allowed within a group of activations.
const CREST: f64 = 4.0;
/// See [`KERNEL_TOLERANCE`]: the square root of 9 rounded inputs (4 per layer, 2 layers,
/// and the LM head's).
const SQRT_ROUNDINGS: f64 = 3.0;
/// See [`KERNEL_TOLERANCE`]: growth of the rounding error through the untrained layers.
const AMPLIFICATION: f64 = 3.0;
/// `sqrt(12)`: a uniform error on `±step / 2` has RMS `step / sqrt(12)`.
const SQRT_12: f64 = 3.464_101_615_137_754_5;

/// Between two runs of the dense twin that differ only in summation order (attention
/// implementation, prefill chunking, batch composition).
const ORDER_TOLERANCE: f64 = 1e-4;

/// An f16 cache against an f32 one on the dense twin: keys and values rounded to 11 bits
/// (measured about 3e-4).
const KV_F16_TOLERANCE: f64 = 3e-3;

fn load(name: &str, seed: u64) -> (LoadedModel, MemoryPool) {
    let pool = MemoryPool::unlimited();
    (synthetic::load_with_seed(name, seed, &pool).unwrap(), pool)
}

/// The model with every matrix dequantized to f32: the same function, computed by the
/// dense kernel instead of the quantized ones.
fn dense_twin(model: &LoadedModel) -> LoadedModel {
    fn matrix(w: &LinearWeight) -> LinearWeight {
        let (n, k) = (w.n(), w.k());
        let mut data = vec![0f32; n * k];
        for (r, row) in data.chunks_exact_mut(k).enumerate() {
            w.row(r, row);
        }
        LinearWeight::Dense(DenseMatrix::new(n, k, data.into()))
    }
    fn copy(b: &Buffer<f32>) -> Buffer<f32> {
        b.to_vec().into()
    }
    fn linear(l: &Linear) -> Linear {
        Linear { weight: matrix(&l.weight), bias: l.bias.as_ref().map(copy) }
    }
    fn norm(n: &RmsNorm) -> RmsNorm {
        RmsNorm { weight: copy(&n.weight), eps: n.eps }
    }
    let w = &model.weights;
    let layers = w
        .layers
        .iter()
        .map(|l| Layer {
            input_layernorm: norm(&l.input_layernorm),
            q_proj: linear(&l.q_proj),
            k_proj: linear(&l.k_proj),
            v_proj: linear(&l.v_proj),
            o_proj: linear(&l.o_proj),
            q_norm: None,
            k_norm: None,
            post_attention_layernorm: norm(&l.post_attention_layernorm),
            mlp: Mlp::Dense(DenseMlp {
                gate_proj: linear(&l.mlp.dense().unwrap().gate_proj),
                up_proj: linear(&l.mlp.dense().unwrap().up_proj),
                down_proj: linear(&l.mlp.dense().unwrap().down_proj),
            }),
        })
        .collect();
    LoadedModel {
        source: model.source.clone(),
        config: model.config.clone(),
        weights: ModelWeights {
            embed_tokens: matrix(&w.embed_tokens),
            layers,
            norm: norm(&w.norm),
            lm_head: w.lm_head.as_ref().map(linear),
            experts: None,
        },
        tokenizer: Tokenizer::Bytes(ByteTokenizer),
        chat_template: None,
    }
}

/// A synthetic model's dense twin.
fn load_dense(name: &str, seed: u64) -> (LoadedModel, MemoryPool) {
    let (model, pool) = load(name, seed);
    (dense_twin(&model), pool)
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + salt * 11 + 5) % 250).collect()
}

/// |a - b| / |b| in the Euclidean norm: the size of the error against the size of the
/// logits, insensitive to which single logit a rounding happens to hit.
fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let diff: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| y * y).sum();
    (diff / norm.max(1e-300)).sqrt()
}

fn rel_err32(a: &[f32], b: &[f32]) -> f64 {
    rel_err(a, &b.iter().map(|&v| v as f64).collect::<Vec<_>>())
}

fn options(attention: AttentionKind, prefill_chunk: usize, kv_dtype: KvDtype) -> EngineOptions {
    EngineOptions { attention, prefill_chunk, kv_dtype, expert_slots: None }
}

// ---- an f64 decoder written from the model's definition, sharing no code with kiln ----

fn dense(w: &LinearWeight) -> Vec<f64> {
    let mut row = vec![0f32; w.k()];
    let mut out = Vec::with_capacity(w.n() * w.k());
    for r in 0..w.n() {
        w.row(r, &mut row);
        out.extend(row.iter().map(|&v| v as f64));
    }
    out
}

fn linear(x: &[f64], rows: usize, lin: &Linear) -> Vec<f64> {
    let (n, k) = (lin.weight.n(), lin.weight.k());
    let w = dense(&lin.weight);
    let mut y = vec![0f64; rows * n];
    for r in 0..rows {
        for o in 0..n {
            let mut acc: f64 = (0..k).map(|j| x[r * k + j] * w[o * k + j]).sum();
            if let Some(b) = &lin.bias {
                acc += b[o] as f64;
            }
            y[r * n + o] = acc;
        }
    }
    y
}

fn rms(x: &[f64], w: &[f32], eps: f32) -> Vec<f64> {
    let d = w.len();
    let mut out = vec![0f64; x.len()];
    for (xr, or) in x.chunks(d).zip(out.chunks_mut(d)) {
        let ms = xr.iter().map(|v| v * v).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        for j in 0..d {
            or[j] = xr[j] * inv * w[j] as f64;
        }
    }
    out
}

/// Inverse frequencies as Hugging Face's `_compute_llama3_parameters` defines them.
fn inv_freq(c: &ModelConfig) -> Vec<f64> {
    let d = c.head_dim;
    (0..d / 2)
        .map(|i| {
            let f = 1.0 / (c.rope_theta as f64).powf(2.0 * i as f64 / d as f64);
            match c.rope_scaling {
                None => f,
                Some(RopeScaling::Linear { factor }) => f / factor as f64,
                Some(RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                }) => {
                    let old = original_max_position_embeddings as f64;
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    let low_wl = old / low_freq_factor as f64;
                    let high_wl = old / high_freq_factor as f64;
                    let scaled = if wavelen > low_wl { f / factor as f64 } else { f };
                    let smooth = (old / wavelen - low_freq_factor as f64)
                        / (high_freq_factor as f64 - low_freq_factor as f64);
                    let medium = wavelen >= high_wl && wavelen <= low_wl;
                    if medium { (1.0 - smooth) * scaled / factor as f64 + smooth * scaled } else { scaled }
                }
            }
        })
        .collect()
}

fn rotate(x: &mut [f64], heads: usize, d: usize, pos: usize, freqs: &[f64]) {
    for h in 0..heads {
        let v = &mut x[h * d..(h + 1) * d];
        for i in 0..d / 2 {
            let a = pos as f64 * freqs[i];
            let (x1, x2) = (v[i], v[i + d / 2]);
            v[i] = x1 * a.cos() - x2 * a.sin();
            v[i + d / 2] = x2 * a.cos() + x1 * a.sin();
        }
    }
}

/// Logits of every position of `tokens`, `[tokens, vocab]`.
fn reference(model: &LoadedModel, tokens: &[u32]) -> Vec<f64> {
    let c = &model.config;
    let w = &model.weights;
    let (t, h, d) = (tokens.len(), c.hidden_size, c.head_dim);
    let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
    let freqs = inv_freq(c);
    let embed = dense(&w.embed_tokens);
    let mut x: Vec<f64> =
        tokens.iter().flat_map(|&tok| embed[tok as usize * h..(tok as usize + 1) * h].to_vec()).collect();
    for layer in &w.layers {
        let xn = rms(&x, &layer.input_layernorm.weight, layer.input_layernorm.eps);
        let mut q = linear(&xn, t, &layer.q_proj);
        let mut k = linear(&xn, t, &layer.k_proj);
        let v = linear(&xn, t, &layer.v_proj);
        for p in 0..t {
            rotate(&mut q[p * nh * d..(p + 1) * nh * d], nh, d, p, &freqs);
            rotate(&mut k[p * nkv * d..(p + 1) * nkv * d], nkv, d, p, &freqs);
        }
        let mut att = vec![0f64; t * nh * d];
        for head in 0..nh {
            let kvh = head * nkv / nh;
            for i in 0..t {
                let qi = &q[i * nh * d + head * d..i * nh * d + (head + 1) * d];
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        let kj = &k[j * nkv * d + kvh * d..j * nkv * d + (kvh + 1) * d];
                        qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (j, p) in e.iter().enumerate() {
                    for c in 0..d {
                        att[i * nh * d + head * d + c] += p / sum * v[j * nkv * d + kvh * d + c];
                    }
                }
            }
        }
        let o = linear(&att, t, &layer.o_proj);
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        let xn = rms(&x, &layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps);
        let mlp = layer.mlp.dense().unwrap();
        let g = linear(&xn, t, &mlp.gate_proj);
        let u = linear(&xn, t, &mlp.up_proj);
        let act: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
        let down = linear(&act, t, &mlp.down_proj);
        x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
    }
    let xn = rms(&x, &w.norm.weight, w.norm.eps);
    let head_w = match &w.lm_head {
        Some(head) => dense(&head.weight),
        None => embed,
    };
    let vocab = c.vocab_size;
    let mut logits = vec![0f64; t * vocab];
    for p in 0..t {
        for o in 0..vocab {
            logits[p * vocab + o] = (0..h).map(|j| xn[p * h + j] * head_w[o * h + j]).sum();
        }
    }
    logits
}

#[test]
fn matches_an_independent_f64_decoder() {
    // tiny: llama with llama3 rope scaling, GQA 2, tied head; tiny-qwen: q/k/v biases,
    // GQA 4, untied head.
    for name in ["tiny", "tiny-qwen", "tiny@8bit"] {
        let (model, pool) = load(name, 11);
        let dense = dense_twin(&model);
        let tokens = prompt(40, 1);
        let want = reference(&model, &tokens);
        let vocab = model.config.vocab_size;
        let last = &want[(tokens.len() - 1) * vocab..];
        let spread =
            last.iter().cloned().fold(f64::MIN, f64::max) - last.iter().cloned().fold(f64::MAX, f64::min);
        assert!(spread > 1.0, "{name}: the logits carry information (spread {spread})");
        for attention in [AttentionKind::Streaming, AttentionKind::Naive] {
            let opts = options(attention, 0, KvDtype::F32);
            let got = Session::new(&dense, &pool, opts).unwrap().prefill_all_logits(&tokens).unwrap();
            let e = rel_err(&got, &want);
            assert!(e < DENSE_TOLERANCE, "{name} {attention:?}, dense twin: relative error {e}");
            let got = Session::new(&model, &pool, opts).unwrap().prefill_all_logits(&tokens).unwrap();
            let e = rel_err(&got, &want);
            assert!(e < KERNEL_TOLERANCE, "{name} {attention:?}, quantized kernels: relative error {e}");
        }
    }
}

#[test]
fn decode_steps_continue_the_prefill() {
    // Prefill of n tokens then decode of one equals a prefill of n + 1 tokens.
    let (model, pool) = load_dense("tiny-qwen", 3);
    let tokens = prompt(30, 2);
    let opts = options(AttentionKind::Streaming, 0, KvDtype::F32);
    let mut whole = Session::new(&model, &pool, opts).unwrap();
    let want = whole.prefill(&tokens).unwrap().to_vec();
    let mut split = Session::new(&model, &pool, opts).unwrap();
    split.prefill(&tokens[..29]).unwrap();
    let got = split.decode_step(tokens[29]).unwrap().to_vec();
    let e = rel_err32(&got, &want);
    assert!(e < ORDER_TOLERANCE, "relative error {e}");
    assert_eq!(split.len(), 30);
}

/// Prefills `tokens`, then decodes four greedy steps; returns the last logits.
fn prefill_and_decode(
    model: &LoadedModel,
    pool: &MemoryPool,
    opts: EngineOptions,
    tokens: &[u32],
) -> Vec<f32> {
    let mut s = Session::new(model, pool, opts).unwrap();
    let mut logits = s.prefill(tokens).unwrap().to_vec();
    for _ in 0..4 {
        let next = argmax(&logits) as u32;
        logits = s.decode_step(next).unwrap().to_vec();
    }
    assert_eq!(s.len(), tokens.len() + 4);
    logits
}

#[test]
fn streaming_and_naive_attention_agree_across_tiles_and_blocks() {
    // tiny's tiles are one cache block, 256 keys: 300 positions cross a tile and a
    // block boundary.
    let tokens = prompt(300, 3);
    let (model, pool) = load_dense("tiny", 5);
    let run = |attention| prefill_and_decode(&model, &pool, options(attention, 0, KvDtype::F16), &tokens);
    let e = rel_err32(&run(AttentionKind::Streaming), &run(AttentionKind::Naive));
    assert!(e < ORDER_TOLERANCE, "dense twin, streaming against naive: relative error {e}");
    // Through the quantized kernels the two still agree to the kernels' tolerance.
    let (model, pool) = load("tiny", 5);
    let run = |attention| prefill_and_decode(&model, &pool, options(attention, 0, KvDtype::F16), &tokens);
    let e = rel_err32(&run(AttentionKind::Streaming), &run(AttentionKind::Naive));
    assert!(e < KERNEL_TOLERANCE, "quantized, streaming against naive: relative error {e}");
}

#[test]
fn chunked_prefill_agrees_with_whole_prefill() {
    let tokens = prompt(270, 4);
    for quantized in [false, true] {
        let (model, pool) = if quantized { load("tiny", 9) } else { load_dense("tiny", 9) };
        let last = |chunk| {
            let mut s =
                Session::new(&model, &pool, options(AttentionKind::Streaming, chunk, KvDtype::F16)).unwrap();
            let logits = s.prefill(&tokens).unwrap().to_vec();
            assert_eq!(s.len(), tokens.len());
            logits
        };
        let whole = last(0);
        let tolerance = if quantized { KERNEL_TOLERANCE } else { ORDER_TOLERANCE };
        for chunk in [1, 7, 64, 256, 1000] {
            let e = rel_err32(&last(chunk), &whole);
            assert!(e < tolerance, "quantized {quantized}, chunk {chunk}: relative error {e}");
        }
    }
}

#[test]
fn f16_cache_stays_close_to_f32() {
    let (model, pool) = load_dense("tiny-qwen", 2);
    let tokens = prompt(100, 5);
    let run = |dtype| {
        let mut s = Session::new(&model, &pool, options(AttentionKind::Streaming, 0, dtype)).unwrap();
        s.prefill(&tokens).unwrap().to_vec()
    };
    let e = rel_err32(&run(KvDtype::F16), &run(KvDtype::F32));
    assert!(e < KV_F16_TOLERANCE && e > 0.0, "relative error {e}");
}

#[test]
fn synthetic_weights_depend_only_on_the_seed() {
    let tokens = prompt(20, 6);
    let logits = |seed| {
        let (model, pool) = load("tiny-qwen", seed);
        let mut s = Session::new(&model, &pool, EngineOptions::default()).unwrap();
        s.prefill(&tokens).unwrap().to_vec()
    };
    let a = logits(1);
    assert_eq!(a, logits(1), "same seed, same logits, bit for bit");
    assert_ne!(a, logits(2));
    // The default seed is the one `load` uses.
    let pool = MemoryPool::unlimited();
    let opts = kiln_model::LoadOptions { pool: pool.clone(), quantize: None };
    let m1 = kiln_model::load("synthetic:tiny", &opts).unwrap();
    let m2 = synthetic::load_with_seed("tiny", synthetic::DEFAULT_SEED, &pool).unwrap();
    let (LinearWeight::Quantized(a), LinearWeight::Quantized(b)) =
        (&m1.weights.embed_tokens, &m2.weights.embed_tokens)
    else {
        panic!("synthetic embeddings are quantized")
    };
    assert_eq!(a.packed(), b.packed());
}

#[test]
fn seeded_sampling_reproduces_a_generation() {
    let (model, pool) = load("tiny", 4);
    let tokens = prompt(12, 7);
    let generate = |seed| {
        let mut s = Session::new(&model, &pool, EngineOptions::default()).unwrap();
        let params = SamplingParams { temperature: 1.0, top_k: 40, top_p: 0.95, min_p: 0.0, seed };
        let mut sampler = Sampler::new(params, model.config.vocab_size).unwrap();
        let mut out = vec![sampler.sample(s.prefill(&tokens).unwrap())];
        for _ in 0..24 {
            let last = *out.last().unwrap();
            out.push(sampler.sample(s.decode_step(last).unwrap()));
        }
        out
    };
    assert_eq!(generate(7), generate(7));
    assert_ne!(generate(7), generate(8));
}

#[test]
fn context_overflow_and_bad_tokens_are_refused_before_any_work() {
    let (model, pool) = load("tiny", 1);
    let limit = model.config.max_position_embeddings;
    let mut s = Session::new(&model, &pool, EngineOptions::default()).unwrap();
    let e = s.prefill(&prompt(limit + 1, 0)).unwrap_err();
    assert!(
        matches!(e, ModelError::ContextExceeded { requested, limit: l } if requested == limit + 1 && l == limit)
    );
    assert!(s.is_empty());
    let e = s.prefill(&[1, 2, model.config.vocab_size as u32]).unwrap_err();
    assert!(e.to_string().contains("outside the vocabulary"), "{e}");
    assert!(s.is_empty());
    assert!(s.prefill(&[]).is_err());
}

#[test]
fn out_of_memory_leaves_the_sequence_as_it_was() {
    let probe = MemoryPool::unlimited();
    let model = synthetic::load_with_seed("tiny", 1, &probe).unwrap();
    let weights = probe.stats().live_bytes;
    // Room for the weights, the workspace of a short forward and one cache block, not
    // for a naive score matrix over 600 positions.
    let pool = MemoryPool::with_limit(weights + (3 << 20));
    let _held = pool.reserve(Tag::Weights, weights).unwrap();
    let mut s = Session::new(&model, &pool, options(AttentionKind::Naive, 0, KvDtype::F16)).unwrap();
    s.prefill(&prompt(10, 1)).unwrap();
    let e = s.prefill(&prompt(600, 1)).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert!(e.to_string().starts_with("out of memory:"), "{e}");
    assert_eq!(s.len(), 10);
    // The sequence still runs.
    s.decode_step(3).unwrap();
    assert_eq!(s.len(), 11);
}
