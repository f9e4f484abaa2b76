//! kiln against mlx-lm on the committed fixture checkpoints: logits at the last 32
//! prompt positions and along a 40-step greedy continuation (fed the reference's tokens),
//! and kiln's own free-running greedy decode against the reference's tokens.
//!
//! Tolerances come from the fixture. The script records how far mlx's own forward moves
//! when it rounds what kiln rounds, per configuration (`f32_cache`, `f16_cache`, and for
//! quantized models `int_act_*`: activations entering 4- and 8-bit matmuls as int8 / int16
//! codes per group, with the kernels' exact-sum bias term): the largest move of any logit,
//! and the largest move of a step's top-2 margin. kiln's own rounding is another draw of
//! the same noise, so it may move logits by [`LOGIT_FACTOR`] times as much, plus
//! [`F32_FLOOR`] for f32 arithmetic in another order; a step whose reference margin is
//! within [`MARGIN_FACTOR`] times the margin move (plus twice the floor) is a near tie,
//! where kiln may pick either token, and ends the free-running comparison. A wrong
//! weight, rotation, mask or head mapping moves logits by whole units.
//!
//! The quantized checkpoints are also run with every matrix dequantized, in f32, where
//! they must match mlx to f32 noise: that checks the loader apart from the kernels'
//! rounding.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kiln_core::MemoryPool;
use kiln_model::ops::argmax;
use kiln_model::{AttentionKind, EngineOptions, KvDtype, LoadOptions, LoadedModel, Session, checkpoint};

/// kiln's rounding against the simulated one: the same rounding rule applied to
/// activations that differ by f32 noise, which flips codes and redraws the noise (measured
/// ratios 0.9 to 1.25 on these fixtures).
const LOGIT_FACTOR: f32 = 2.0;

/// The same for a step's top-2 margin, which decides the near ties.
const MARGIN_FACTOR: f32 = 2.0;

/// Absolute slack for f32 arithmetic in another order than mlx's: logits here reach
/// about 60, and kiln's f32 path meets mlx's within 4e-5.
const F32_FLOOR: f32 = 5e-4;

/// Steps the free-running greedy decode must follow the reference where the fixture
/// says its run is clear of ties under the configuration.
const MIN_GREEDY_STEPS: usize = 32;

/// Steps the free-running greedy decode must follow the reference where the run is not
/// clear of near ties: it is compared up to its first one, which for
/// `llama3-tiny-4bit-g64` under integer kernels (the only such run, with both caches) is
/// step 12 (docs/models.md). Fewer would mean a tolerance grown or a decode gone wrong.
const MIN_GREEDY_STEPS_BEFORE_A_TIE: usize = 12;

struct Reference {
    name: String,
    prompt_ids: Vec<u32>,
    /// `[32, vocab]`, the last prompt positions.
    prompt_logits: Vec<f32>,
    greedy_ids: Vec<u32>,
    /// `[steps, vocab]`: step 0 is the last prompt position's logits.
    step_logits: Vec<f32>,
    margins: Vec<f32>,
    meta: HashMap<String, String>,
}

fn models() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models")
}

fn reference(name: &str) -> Reference {
    let bytes = std::fs::read(models().join(format!("references/{name}.safetensors"))).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let words = |t: &str| -> Vec<[u8; 4]> {
        st.tensor(t).unwrap().data().chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]).collect()
    };
    let u32s = |t: &str| words(t).into_iter().map(u32::from_le_bytes).collect::<Vec<_>>();
    let f32s = |t: &str| words(t).into_iter().map(f32::from_le_bytes).collect::<Vec<_>>();
    Reference {
        name: name.to_string(),
        prompt_ids: u32s("prompt_ids"),
        prompt_logits: f32s("prompt_logits"),
        greedy_ids: u32s("greedy_ids"),
        step_logits: f32s("step_logits"),
        margins: f32s("margins"),
        meta: meta.metadata().clone().unwrap_or_default(),
    }
}

/// What kiln rounds in one run, named as the fixture names its configurations.
fn rounding(kv: KvDtype, int_activations: bool) -> &'static str {
    match (int_activations, kv) {
        (false, KvDtype::F32) => "f32_cache",
        (false, KvDtype::F16) => "f16_cache",
        (true, KvDtype::F32) => "int_act_f32_cache",
        (true, KvDtype::F16) => "int_act_f16_cache",
    }
}

/// Tolerances for one configuration.
#[derive(Clone, Copy, Debug)]
struct Tolerance {
    logit: f32,
    near_tie: f32,
    /// The fixture promises no near tie in the whole run.
    clear: bool,
}

impl Reference {
    fn recorded(&self, key: &str) -> f32 {
        let v = self.meta.get(key).unwrap_or_else(|| panic!("{} lacks {key}", self.name));
        v.parse().unwrap_or_else(|e| panic!("{}: {key} = {v:?}: {e}", self.name))
    }

    fn tolerance(&self, config: &str) -> Tolerance {
        let clear = self.meta.get("greedy_safe").is_some_and(|s| s.split(',').any(|c| c == config));
        Tolerance {
            logit: LOGIT_FACTOR * self.recorded(&format!("logit/{config}")) + F32_FLOOR,
            near_tie: MARGIN_FACTOR * self.recorded(&format!("margin/{config}")) + 2.0 * F32_FLOOR,
            clear,
        }
    }
}

/// Whether any matrix of `model` meets kernels that quantize activations.
fn rounds_activations(model: &LoadedModel) -> bool {
    use kiln_core::kernels::ActivationPrecision;
    use kiln_model::weights::LinearWeight;
    let w = &model.weights;
    let mut all = vec![&w.embed_tokens];
    for l in &w.layers {
        all.extend(
            [
                &l.q_proj,
                &l.k_proj,
                &l.v_proj,
                &l.o_proj,
                &l.mlp.dense().unwrap().gate_proj,
                &l.mlp.dense().unwrap().up_proj,
                &l.mlp.dense().unwrap().down_proj,
            ]
            .map(|p| &p.weight),
        );
    }
    all.extend(w.lm_head.as_ref().map(|h| &h.weight));
    all.into_iter().any(|m| match m {
        LinearWeight::Quantized(q) => {
            ActivationPrecision::for_bits(q.spec().bits()) != ActivationPrecision::F32
        }
        LinearWeight::Dense(_) => false,
    })
}

fn load(dir: &str, quantize: Option<u32>) -> (LoadedModel, MemoryPool) {
    let pool = MemoryPool::unlimited();
    let m = checkpoint::load(&models().join(dir), &LoadOptions { pool: pool.clone(), quantize }).unwrap();
    (m, pool)
}

/// The largest |kiln - reference| over the recorded logits, with the reference's tokens
/// fed; each step's argmax must be the reference's unless the step is a near tie.
fn max_deviation(
    model: &LoadedModel,
    pool: &MemoryPool,
    r: &Reference,
    opts: EngineOptions,
    tol: Tolerance,
) -> f32 {
    let vocab = model.config.vocab_size;
    let mut s = Session::new(model, pool, opts).unwrap();
    let all = s.prefill_all_logits(&r.prompt_ids).unwrap();
    let p = r.prompt_ids.len();
    let recorded = r.prompt_logits.len() / vocab;
    let mut dev = 0f32;
    for (a, b) in all[(p - recorded) * vocab..].iter().zip(&r.prompt_logits) {
        dev = dev.max((a - b).abs());
    }
    let mut row = all[(p - 1) * vocab..].to_vec();
    for (i, want) in r.step_logits.chunks_exact(vocab).enumerate() {
        for (a, b) in row.iter().zip(want) {
            dev = dev.max((a - b).abs());
        }
        if r.margins[i] > tol.near_tie {
            assert_eq!(argmax(&row) as u32, r.greedy_ids[i], "{}: step {i}, margin {}", r.name, r.margins[i]);
        }
        if i + 1 < r.greedy_ids.len() {
            row = s.decode_step(r.greedy_ids[i]).unwrap().to_vec();
        }
    }
    dev
}

/// Steps of kiln's own greedy decode equal to the reference's before the first near tie.
fn greedy_agreement(
    model: &LoadedModel,
    pool: &MemoryPool,
    r: &Reference,
    opts: EngineOptions,
    tol: Tolerance,
) -> usize {
    let mut s = Session::new(model, pool, opts).unwrap();
    let ours = s.generate_greedy(&r.prompt_ids, r.greedy_ids.len()).unwrap();
    for (i, (a, b)) in ours.iter().zip(&r.greedy_ids).enumerate() {
        if r.margins[i] <= tol.near_tie {
            return i;
        }
        assert_eq!(
            a, b,
            "{}: greedy step {i} (margin {}): {ours:?} vs {:?}",
            r.name, r.margins[i], r.greedy_ids
        );
    }
    ours.len()
}

/// Runs `dir` against reference `name` under both caches, both attention kernels and
/// whole and chunked prefill.
fn check(dir: &str, name: &str, quantize: Option<u32>) {
    let (model, pool) = load(dir, quantize);
    let r = reference(name);
    // kiln-core says whether its kernels round the activations of these weights' widths;
    // the tolerance is the one of the rounding kiln performs.
    let int_activations = rounds_activations(&model);
    for kv in [KvDtype::F32, KvDtype::F16] {
        let config = rounding(kv, int_activations);
        let tol = r.tolerance(config);
        for (attention, prefill_chunk) in [(AttentionKind::Streaming, 0), (AttentionKind::Naive, 16)] {
            let opts = EngineOptions { attention, prefill_chunk, kv_dtype: kv, expert_slots: None };
            let dev = max_deviation(&model, &pool, &r, opts, tol);
            let steps = greedy_agreement(&model, &pool, &r, opts, tol);
            eprintln!(
                "{dir} vs {name}, {config}, {} attention, prefill chunk {prefill_chunk}: max logit deviation \
                 {dev:.2e} (tolerance {:.2e}); greedy agrees for {steps} steps (near tie below {:.2e})",
                attention.as_str(),
                tol.logit,
                tol.near_tie,
            );
            assert!(dev <= tol.logit, "{dir} {opts:?}: logits deviate by {dev}, tolerance {}", tol.logit);
            let min = if tol.clear { MIN_GREEDY_STEPS } else { MIN_GREEDY_STEPS_BEFORE_A_TIE };
            assert!(steps >= min, "{dir} {opts:?}: {steps} greedy steps, at least {min} required");
        }
    }
}

#[test]
fn llama3_bf16_sharded_matches_mlx() {
    check("llama3-tiny", "llama3-tiny", None);
}

#[test]
fn qwen2_f32_tied_matches_mlx() {
    check("qwen2-tiny", "qwen2-tiny", None);
}

#[test]
fn qwen2_mlx_4bit_with_overrides_matches_mlx() {
    check("qwen2-tiny-4bit", "qwen2-tiny-4bit", None);
}

#[test]
fn llama3_mlx_4bit_g64_matches_mlx() {
    check("llama3-tiny-4bit-g64", "llama3-tiny-4bit-g64", None);
}

#[test]
fn quantize_4_on_load_matches_mlx_quantization() {
    // The weights are mlx's bit for bit (tests/checkpoints.rs), so mlx's run applies.
    check("llama3-tiny", "llama3-tiny-4bit-g64", Some(4));
}

/// Every quantized matrix replaced by its exact dequantization, so the forward runs in
/// f32 with the checkpoint's weights: separates what the loader reads from what the
/// integer kernels round.
fn dequantized(model: LoadedModel) -> LoadedModel {
    use kiln_core::DenseMatrix;
    use kiln_model::weights::LinearWeight;
    fn dense(w: &mut LinearWeight) {
        if let LinearWeight::Quantized(_) = w {
            let (n, k) = (w.n(), w.k());
            let mut data = vec![0f32; n * k];
            for (r, row) in data.chunks_exact_mut(k).enumerate() {
                w.row(r, row);
            }
            *w = LinearWeight::Dense(DenseMatrix::new(n, k, data.into()));
        }
    }
    let mut m = model;
    dense(&mut m.weights.embed_tokens);
    for l in &mut m.weights.layers {
        let mlp = l.mlp.dense_mut().unwrap();
        for p in [
            &mut l.q_proj,
            &mut l.k_proj,
            &mut l.v_proj,
            &mut l.o_proj,
            &mut mlp.gate_proj,
            &mut mlp.up_proj,
            &mut mlp.down_proj,
        ] {
            dense(&mut p.weight);
        }
    }
    if let Some(h) = &mut m.weights.lm_head {
        dense(&mut h.weight);
    }
    m
}

#[test]
fn quantized_checkpoints_dequantized_match_mlx_to_f32_noise() {
    for (dir, name, quantize) in [
        ("qwen2-tiny-4bit", "qwen2-tiny-4bit", None),
        ("llama3-tiny-4bit-g64", "llama3-tiny-4bit-g64", None),
        ("llama3-tiny", "llama3-tiny-4bit-g64", Some(4)),
    ] {
        let (model, pool) = load(dir, quantize);
        let model = dequantized(model);
        let r = reference(name);
        let tol = r.tolerance("f32_cache");
        assert!(tol.clear, "{name}: the fixture's f32 run must be clear of ties");
        let opts = EngineOptions { kv_dtype: KvDtype::F32, ..EngineOptions::default() };
        let dev = max_deviation(&model, &pool, &r, opts, tol);
        let steps = greedy_agreement(&model, &pool, &r, opts, tol);
        eprintln!(
            "{dir} dequantized vs {name}: max logit deviation {dev:.2e}; greedy agrees for {steps} steps"
        );
        assert!(dev <= tol.logit, "{dir}: logits deviate by {dev}, tolerance {}", tol.logit);
        assert_eq!(steps, r.greedy_ids.len(), "{dir}");
    }
}
