//! GGUF loading against llama.cpp's own Python package and mlx-lm, on the fixtures
//! scripts/fixtures/make_gguf_fixtures.py writes: every block type kiln loads
//! dequantizes bit for bit as `gguf.quants.dequantize` does (up to the sign of zero), a type without an exact kiln
//! form is refused by name, and a converted llama (Q and K rows permuted as llama.cpp
//! stores them) gives mlx-lm's logits, with the tokenizer rebuilt from the metadata
//! encoding as the original `tokenizer.json` does.

use std::path::{Path, PathBuf};

use kiln_core::MemoryPool;
use kiln_model::checkpoint::gguf;
use kiln_model::weights::LinearWeight;
use kiln_model::{EngineOptions, LoadOptions, Session, Tokenizer};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn read_f32s(st: &safetensors::SafeTensors<'_>, name: &str) -> Vec<f32> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn dequantized(w: &LinearWeight) -> Vec<f32> {
    let (n, k) = (w.n(), w.k());
    let mut out = vec![0f32; n * k];
    for (r, row) in out.chunks_exact_mut(k).enumerate() {
        w.row(r, row);
    }
    out
}

#[test]
fn every_supported_block_type_dequantizes_bit_exactly() {
    let path = fixtures().join("gguf/blocks.gguf");
    let bytes = std::fs::read(fixtures().join("gguf/blocks.safetensors")).unwrap();
    let reference = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let pool = MemoryPool::unlimited();
    for (name, quantized) in [
        ("f32", false),
        ("f16", false),
        ("bf16", false),
        ("q4_0", true),
        ("q4_1", true),
        ("q8_0", true),
        ("q4_k", true),
        ("q5_k", true),
    ] {
        let w = gguf::read_matrix(&path, name, &pool).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(matches!(w, LinearWeight::Quantized(_)), quantized, "{name}");
        let got = dequantized(&w);
        let want = read_f32s(&reference, name);
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (g, r)) in got.iter().zip(&want).enumerate() {
            // Bit for bit, except that a zero may differ in sign: ggml's `d * (q - 8)` is
            // -0 for a negative d, kiln's `d * q + (-8d)` is +0; no product or sum can
            // tell them apart.
            let same = g.to_bits() == r.to_bits() || (*g == 0.0 && *r == 0.0);
            assert!(same, "{name} element {i}: kiln {g}, gguf {r}");
        }
    }
}

#[test]
fn a_block_type_without_an_exact_form_is_refused_by_name() {
    let path = fixtures().join("gguf/blocks.gguf");
    let e = gguf::read_matrix(&path, "q6_k", &MemoryPool::unlimited()).unwrap_err().to_string();
    assert!(e.contains("q6_k") && e.contains("Q6_K") && e.contains("accepted types"), "{e}");
}

fn llama() -> PathBuf {
    fixtures().join("gguf/llama-tiny.gguf")
}

#[test]
fn metadata_becomes_the_model_config() {
    let opts = LoadOptions { pool: MemoryPool::unlimited(), quantize: None };
    let info = kiln_model::inspect(llama().to_str().unwrap(), &opts).unwrap();
    let c = &info.config;
    assert_eq!(c.architecture.as_str(), "llama");
    assert_eq!((c.hidden_size, c.intermediate_size, c.num_hidden_layers), (64, 128, 2));
    assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (4, 2, 16));
    assert_eq!((c.vocab_size, c.max_position_embeddings), (373, 512));
    assert_eq!((c.rms_norm_eps, c.rope_theta), (1e-5, 10000.0));
    assert!(!c.tie_word_embeddings && c.rope_scaling.is_none() && c.quantization.is_none());
    assert_eq!((c.bos_token_id, c.eos_token_ids.as_slice()), (Some(368), &[369][..]));
    let model = kiln_model::load(llama().to_str().unwrap(), &opts).unwrap();
    assert_eq!(opts.pool.stats().live_bytes, info.weight_bytes, "inspect prices what load holds");
    assert!(model.chat_template.is_some());
}

#[test]
fn unpermuted_llama_logits_match_mlx() {
    let bytes = std::fs::read(fixtures().join("gguf/llama-tiny.safetensors")).unwrap();
    let reference = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids: Vec<u32> = reference
        .tensor("prompt_ids")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let want = read_f32s(&reference, "logits");
    let pool = MemoryPool::unlimited();
    let model =
        kiln_model::load(llama().to_str().unwrap(), &LoadOptions { pool: pool.clone(), quantize: None })
            .unwrap();
    let options = EngineOptions { kv_dtype: kiln_model::KvDtype::F32, ..EngineOptions::default() };
    let mut session = Session::new(&model, &pool, options).unwrap();
    let got = session.prefill_all_logits(&ids).unwrap();
    assert_eq!(got.len(), want.len());
    let worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
    let scale = want.iter().map(|w| w.abs()).fold(0f32, f32::max);
    // f32 arithmetic in another order than mlx's; a wrong row order moves logits by units.
    assert!(worst < 5e-4, "largest logit difference {worst} (logits reach {scale})");
    assert!(scale > 1.0, "the reference is not degenerate");
}

#[test]
fn the_rebuilt_tokenizer_encodes_as_the_original() {
    let from_gguf = gguf::tokenizer_from_file(&llama()).unwrap();
    let original = Tokenizer::from_file(&fixtures().join("models/llama3-tiny/tokenizer.json")).unwrap();
    for text in [
        "Hello, world! It's 2024-06-01 and 12345 apples cost $3.50.",
        "  leading spaces\n\nnew lines\ttabs",
        "héllo wörld ünïcödé 你好",
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    ] {
        for special in [false, true] {
            assert_eq!(
                from_gguf.encode(text, special).unwrap(),
                original.encode(text, special).unwrap(),
                "{text:?} (special tokens: {special})"
            );
        }
        let ids = original.encode(text, false).unwrap();
        assert_eq!(from_gguf.decode(&ids).unwrap(), original.decode(&ids).unwrap(), "{text:?}");
    }
}
