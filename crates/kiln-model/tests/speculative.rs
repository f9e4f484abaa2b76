//! Speculative decoding against classic decoding on every kind of model kiln loads
//! (synthetic profiles at 4 and 8 bits, the committed llama and qwen fixture checkpoints
//! dense, MLX 4-bit and quantized on load to 4 and 8 bits), both cache types and both
//! drafters: greedy output must be identical token for token, the gate must find the
//! verify block exact, and a drafter that is the target itself must be accepted in full.

use std::path::Path;

use kiln_core::MemoryPool;
use kiln_model::speculative::{
    DraftModel, Drafter, ExactnessGate, GateKey, GateOutcome, GatePolicy, ProcessSwitch, PromptLookup,
    SpecStats, SpecStream,
};
use kiln_model::{
    Engine, EngineOptions, KvDtype, LoadOptions, LoadedModel, ModelError, Sampler, SamplingParams, Session,
};

fn load(spec: &str, quantize: Option<u32>) -> (LoadedModel, MemoryPool) {
    let pool = MemoryPool::unlimited();
    let spec = if spec.starts_with("synthetic:") {
        spec.to_string()
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(spec).display().to_string()
    };
    let model = kiln_model::load(&spec, &LoadOptions { pool: pool.clone(), quantize })
        .unwrap_or_else(|e| panic!("{spec}: {e}"));
    (model, pool)
}

/// A prompt that repeats itself, so prompt lookup has something to find.
fn prompt(vocab: usize) -> Vec<u32> {
    let phrase: Vec<u32> = [17u32, 102, 55, 230, 9, 77, 140, 33].iter().map(|&t| t % vocab as u32).collect();
    phrase.iter().cycle().take(40).copied().collect()
}

/// Decodes `n` tokens speculatively; returns them, the stream's counts and every gate
/// outcome it reported.
#[allow(clippy::too_many_arguments)]
fn speculate(
    model: &LoadedModel,
    pool: &MemoryPool,
    options: EngineOptions,
    drafter: Box<dyn Drafter + '_>,
    params: SamplingParams,
    k: usize,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, SpecStats, Vec<GateOutcome>) {
    let mut engine = Engine::new(model, pool, options).unwrap();
    let mut cache = engine.new_cache();
    let mut sampler = Sampler::new(params, model.config.vocab_size).unwrap();
    let mut gate = ExactnessGate::new(GatePolicy::default(), ProcessSwitch);
    let first = sampler.sample(engine.prefill(&mut cache, prompt).unwrap());
    let key = GateKey { model: "m".into(), k, kv_dtype: options.kv_dtype };
    let mut stream = SpecStream::new(drafter, key, prompt, first);
    let mut out = vec![first];
    let mut outcomes = Vec::new();
    while out.len() < n {
        let step = stream.step(&mut engine, &mut cache, &mut sampler, &mut gate, n - out.len()).unwrap();
        assert!(!step.tokens.is_empty() && step.tokens.len() <= n - out.len());
        outcomes.extend(step.gate.map(|r| r.outcome));
        out.extend(step.tokens);
        assert_eq!(cache.len() + 1, prompt.len() + out.len(), "the cache holds all but the pending token");
    }
    assert_eq!(stream.history()[prompt.len()..], out[..]);
    (out, stream.stats(), outcomes)
}

fn classic(
    model: &LoadedModel,
    pool: &MemoryPool,
    options: EngineOptions,
    prompt: &[u32],
    n: usize,
) -> Vec<u32> {
    Session::new(model, pool, options).unwrap().generate_greedy(prompt, n).unwrap()
}

/// Greedy with prompt lookup equals greedy without, for every K tried; the gate ran once
/// per key and found it exact.
fn check_identical(spec: &str, quantize: Option<u32>) {
    let (model, pool) = load(spec, quantize);
    let ids = prompt(model.config.vocab_size);
    for kv_dtype in [KvDtype::F16, KvDtype::F32] {
        let options = EngineOptions { kv_dtype, ..Default::default() };
        let want = classic(&model, &pool, options, &ids, 48);
        for k in [1, 4] {
            let (got, stats, outcomes) = speculate(
                &model,
                &pool,
                options,
                Box::new(PromptLookup::default()),
                SamplingParams::default(),
                k,
                &ids,
                48,
            );
            let what = format!("{spec} quantize={quantize:?} kv={kv_dtype:?} k={k}");
            assert_eq!(got, want, "{what}: speculative greedy differs from classic greedy ({stats:?})");
            assert_eq!(outcomes, [GateOutcome::Exact], "{what}");
            assert!(stats.verifies > 0, "{what}: prompt lookup never drafted on a repeating prompt");
        }
    }
}

#[test]
fn synthetic_4_and_8_bit_llama_and_qwen() {
    for spec in ["synthetic:tiny", "synthetic:tiny@8bit", "synthetic:tiny-qwen", "synthetic:tiny-qwen@8bit"] {
        check_identical(spec, None);
    }
}

#[test]
fn fixture_checkpoints_dense() {
    check_identical("llama3-tiny", None);
    check_identical("qwen2-tiny", None);
}

#[test]
fn fixture_checkpoints_mlx_4bit() {
    check_identical("llama3-tiny-4bit-g64", None);
    check_identical("qwen2-tiny-4bit", None);
}

#[test]
fn fixture_checkpoints_quantized_on_load() {
    check_identical("llama3-tiny", Some(4));
    check_identical("qwen2-tiny", Some(8));
}

/// A draft model that is the target itself proposes exactly the target's choices: every
/// draft is accepted, greedy and sampled (p equals q, so the rejection rule never
/// rejects); a different small drafter still gives identical greedy output.
#[test]
fn draft_models() {
    let (model, pool) = load("synthetic:tiny", None);
    let (small, small_pool) = load("synthetic:tiny-draft", None);
    let ids = prompt(model.config.vocab_size);
    let options = EngineOptions::default();
    let want = classic(&model, &pool, options, &ids, 40);
    let greedy = SamplingParams::default();
    let same = DraftModel::new(&model, 512, &pool, options, greedy).unwrap();
    let (got, stats, _) = speculate(&model, &pool, options, Box::new(same), greedy, 4, &ids, 40);
    assert_eq!(got, want);
    assert_eq!(stats.accepted, stats.drafted, "{stats:?}");
    assert!(stats.drafted >= 30, "{stats:?}");

    let other = DraftModel::new(&small, 512, &small_pool, options, greedy).unwrap();
    let (got, stats, _) = speculate(&model, &pool, options, Box::new(other), greedy, 3, &ids, 40);
    assert_eq!(got, want, "{stats:?}");
    assert!(stats.verifies > 0);

    let sampled = SamplingParams { temperature: 0.9, top_k: 40, top_p: 0.95, min_p: 0.0, seed: 5 };
    let same = DraftModel::new(&model, 512, &pool, options, sampled).unwrap();
    let (got, stats, _) = speculate(&model, &pool, options, Box::new(same), sampled, 4, &ids, 40);
    assert_eq!(got.len(), 40);
    assert!(got.iter().all(|&t| t < 512));
    assert_eq!(stats.accepted, stats.drafted, "{stats:?}");
}

#[test]
fn a_draft_model_of_another_vocabulary_is_refused() {
    let (small, pool) = load("synthetic:tiny-qwen-draft", None);
    let Err(e) = DraftModel::new(&small, 512, &pool, EngineOptions::default(), SamplingParams::default())
    else {
        panic!("a 384-token drafter was accepted for a 512-token target");
    };
    assert!(matches!(e, ModelError::InvalidArgument { .. }));
    let msg = e.to_string();
    assert!(
        msg.contains("384") && msg.contains("512") && msg.contains("share the target's vocabulary"),
        "{msg}"
    );
}

/// Sampled speculation with prompt lookup: valid tokens, reproducible from the seed.
#[test]
fn sampled_speculation_is_reproducible() {
    let (model, pool) = load("synthetic:tiny-qwen", None);
    let ids = prompt(model.config.vocab_size);
    let p = SamplingParams { temperature: 0.7, top_k: 0, top_p: 0.9, min_p: 0.0, seed: 3 };
    let run = || {
        speculate(&model, &pool, EngineOptions::default(), Box::new(PromptLookup::default()), p, 4, &ids, 40)
            .0
    };
    let a = run();
    assert_eq!(a, run());
    assert!(a.iter().all(|&t| (t as usize) < model.config.vocab_size));
}
