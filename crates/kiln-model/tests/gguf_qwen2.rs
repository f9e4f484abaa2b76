//! A qwen2-architecture GGUF file (q/k/v biases, NEOX rope so no Q/K permutation, tied
//! embedding; attention and embedding in Q8_0, MLP in Q4_0) against mlx-lm's qwen2 on the
//! same weights, on the fixtures scripts/fixtures/make_gguf_fixtures.py writes; a qwen2
//! file with a block type kiln has no exact form for is refused naming the tensor and type.
//!
//! The quantized matrices must run with f32 activations (`KILN_ACT_PRECISION=f32`, kiln's
//! reference arithmetic) for the logits to be comparable at f32 rounding: the scheme is
//! read once per process, so this binary sets it before any test touches the engine.

use std::path::{Path, PathBuf};
use std::sync::Once;

use kiln_core::MemoryPool;
use kiln_core::act_precision::{ACT_PRECISION_ENV, ActScheme, act_scheme};
use kiln_model::checkpoint::gguf;
use kiln_model::{EngineOptions, LoadOptions, Session, Tokenizer};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Selects f32 activations for this process; every test calls it first.
fn f32_activations() {
    static SET: Once = Once::new();
    SET.call_once(|| {
        // SAFETY: every test of this binary calls this function before anything else, and
        // `Once` makes all of them wait until it returns, so no other thread reads or
        // writes the environment while it is being set.
        unsafe { std::env::set_var(ACT_PRECISION_ENV, "f32") };
    });
    assert_eq!(act_scheme(), ActScheme::F32);
}

fn qwen2() -> PathBuf {
    fixtures().join("gguf/qwen2-tiny.gguf")
}

fn read<T>(st: &safetensors::SafeTensors<'_>, name: &str, width: usize, f: impl Fn(&[u8]) -> T) -> Vec<T> {
    st.tensor(name).unwrap().data().chunks_exact(width).map(f).collect()
}

#[test]
fn qwen2_metadata_becomes_the_model_config() {
    f32_activations();
    let opts = LoadOptions { pool: MemoryPool::unlimited(), quantize: None };
    let info = kiln_model::inspect(qwen2().to_str().unwrap(), &opts).unwrap();
    let c = &info.config;
    assert_eq!(c.architecture.as_str(), "qwen2");
    assert_eq!((c.hidden_size, c.intermediate_size, c.num_hidden_layers), (64, 192, 2));
    assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (4, 1, 16));
    assert_eq!((c.vocab_size, c.max_position_embeddings), (320, 512));
    assert_eq!((c.rms_norm_eps, c.rope_theta), (1e-6, 1e6));
    assert!(c.attention_bias && !c.o_proj_bias && c.tie_word_embeddings);
    // Q8_0 is the default (the first layer's query); the MLP's Q4_0 are overrides.
    let q = c.quantization.as_ref().expect("a quantized file");
    assert_eq!((q.default.bits(), q.default.group_size()), (8, 32));
    for i in 0..2 {
        for m in ["gate_proj", "up_proj", "down_proj"] {
            let s = q.overrides[&format!("model.layers.{i}.mlp.{m}")].expect("quantized");
            assert_eq!((s.bits(), s.group_size()), (4, 32), "layer {i} {m}");
        }
    }
    let model = kiln_model::load(qwen2().to_str().unwrap(), &opts).unwrap();
    // inspect prices the peak of loading: what stays, plus the f32 scales and biases the
    // largest quantized matrix (the 320 x 64 embedding: 640 groups) decodes through.
    let transient = 2 * (320 * 64 / 32) * 4;
    assert_eq!(opts.pool.stats().live_bytes + transient, info.weight_bytes, "inspect prices what load holds");
    assert!(model.chat_template.is_some() && model.weights.lm_head.is_none());
}

#[test]
fn qwen2_logits_match_mlx_on_the_same_quantized_weights() {
    f32_activations();
    let bytes = std::fs::read(fixtures().join("gguf/qwen2-tiny.safetensors")).unwrap();
    let reference = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids = read(&reference, "prompt_ids", 4, |c| u32::from_le_bytes(c.try_into().unwrap()));
    let f64s = |name| read(&reference, name, 8, |c| f64::from_le_bytes(c.try_into().unwrap()));
    let (exact, mlx_f32) = (f64s("logits_f64"), f64s("logits_f32"));
    let pool = MemoryPool::unlimited();
    let model =
        kiln_model::load(qwen2().to_str().unwrap(), &LoadOptions { pool: pool.clone(), quantize: None })
            .unwrap();
    let options = EngineOptions { kv_dtype: kiln_model::KvDtype::F32, ..EngineOptions::default() };
    let mut session = Session::new(&model, &pool, options).unwrap();
    let got = session.prefill_all_logits(&ids).unwrap();
    assert_eq!(got.len(), exact.len());
    let worst = |v: &mut dyn Iterator<Item = f64>| -> f64 {
        v.zip(&exact).map(|(g, e)| (g - e).abs()).fold(0.0, f64::max)
    };
    let kiln_err = worst(&mut got.iter().map(|&g| f64::from(g)));
    let mlx_err = worst(&mut mlx_f32.iter().copied());
    let scale = exact.iter().map(|e| e.abs()).fold(0.0, f64::max);
    // The tolerance is derived from the reference's own f32 rounding: mlx-lm in f32 lands
    // `mlx_err` from the f64 logits (1.7e-5 of logits reaching 46). kiln in f32 on the
    // same weights sums in another order, so its distance is of the same size; four times
    // mlx's allows for a different order and its rounding of the dequantized weights being
    // none (they are exact in f32). A missing bias or a permuted row moves logits by
    // tenths and more.
    let tolerance = 4.0 * mlx_err;
    assert!(mlx_err > 0.0 && scale > 1.0, "the reference is degenerate: {mlx_err} {scale}");
    eprintln!(
        "largest logit difference: kiln {kiln_err:.3e}, mlx f32 {mlx_err:.3e}, logits reach {scale:.1}"
    );
    assert!(
        kiln_err <= tolerance,
        "largest logit difference {kiln_err}, tolerance {tolerance} (mlx f32: {mlx_err})"
    );
}

#[test]
fn a_qwen2_file_with_an_unsupported_block_type_is_refused_by_tensor_and_type() {
    f32_activations();
    let path = fixtures().join("gguf/qwen2-tiny-q5_0.gguf");
    let opts = LoadOptions { pool: MemoryPool::unlimited(), quantize: None };
    let Err(e) = kiln_model::load(path.to_str().unwrap(), &opts) else { panic!("the Q5_0 file loaded") };
    let e = e.to_string();
    assert!(e.contains("blk.1.ffn_down.weight") && e.contains("Q5_0") && e.contains("accepted types"), "{e}");
}

#[test]
fn the_rebuilt_qwen2_tokenizer_encodes_as_the_original() {
    f32_activations();
    let from_gguf = gguf::tokenizer_from_file(&qwen2()).unwrap();
    let original = Tokenizer::from_file(&fixtures().join("models/qwen2-tiny/tokenizer.json")).unwrap();
    for text in [
        "Hello, world! It's 2024-06-01 and 12345 apples cost $3.50.",
        "  leading spaces\n\nnew lines\ttabs",
        "<|im_start|>user\nhi<|im_end|>",
    ] {
        for special in [false, true] {
            assert_eq!(
                from_gguf.encode(text, special).unwrap(),
                original.encode(text, special).unwrap(),
                "{text:?} (special tokens: {special})"
            );
        }
    }
}
