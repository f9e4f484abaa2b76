//! kiln against mlx-lm on the committed fixture checkpoints: logits at the last 32
//! prompt positions and along a 40-step greedy continuation (fed the reference's tokens),
//! and kiln's own free-running greedy decode against the reference's tokens.
//!
//! Tolerances come from the fixture, derived as tests/mlx_reference/mod.rs describes,
//! from mlx's own moves under the roundings kiln performs: per configuration
//! (`f32_cache`, `f16_cache`, and for quantized models `int_act_*`: activations entering
//! 4- and 8-bit matmuls as int8 / int16 codes per group, with the kernels' exact-sum bias
//! term).
//!
//! The quantized checkpoints are also run with every matrix dequantized, in f32, where
//! they must match mlx to f32 noise: that checks the loader apart from the kernels'
//! rounding.

mod mlx_reference;

use std::path::{Path, PathBuf};

use kiln_core::MemoryPool;
use kiln_model::{AttentionKind, EngineOptions, KvDtype, LoadOptions, LoadedModel, checkpoint};
use mlx_reference::{Reference, greedy_agreement, max_deviation};

/// Steps the free-running greedy decode must follow the reference where the fixture
/// says its run is clear of ties under the configuration.
const MIN_GREEDY_STEPS: usize = 32;

/// Steps the free-running greedy decode must follow the reference where the run is not
/// clear of near ties: it is compared up to its first one, which for
/// `llama3-tiny-4bit-g64` under integer kernels (the only such run, with both caches) is
/// step 12 (docs/models.md). Fewer would mean a tolerance grown or a decode gone wrong.
const MIN_GREEDY_STEPS_BEFORE_A_TIE: usize = 12;

fn models() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models")
}

fn reference(name: &str) -> Reference {
    mlx_reference::reference(&models(), name)
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
