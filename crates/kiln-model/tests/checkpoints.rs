//! Loading the committed fixture checkpoints: every format kiln reads (sharded bf16, single
//! f32, MLX 4-bit with per-layer overrides), quantize-on-load against mlx's own
//! quantization, pool accounting against `inspect`, and the errors a broken checkpoint
//! gets.

use std::fs;
use std::path::{Path, PathBuf};

use kiln_core::{MemoryPool, QuantSpec, ScaleDtype, Tag};
use kiln_model::config::Architecture;
use kiln_model::weights::{Linear, LinearWeight, ModelWeights};
use kiln_model::{LoadOptions, LoadedModel, ModelError, checkpoint};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(name)
}

fn opts(pool: &MemoryPool, quantize: Option<u32>) -> LoadOptions {
    LoadOptions { pool: pool.clone(), quantize }
}

fn load(name: &str, quantize: Option<u32>) -> (LoadedModel, MemoryPool) {
    let pool = MemoryPool::unlimited();
    let m =
        checkpoint::load(&fixture(name), &opts(&pool, quantize)).unwrap_or_else(|e| panic!("{name}: {e}"));
    (m, pool)
}

/// Every byte the weights hold: what the pool must count under the weights tag.
fn held_bytes(w: &ModelWeights) -> usize {
    let lin = |l: &Linear| l.weight.bytes_read() + l.bias.as_ref().map_or(0, |b| b.byte_len());
    let layers: usize = w
        .layers
        .iter()
        .map(|l| {
            [
                &l.q_proj,
                &l.k_proj,
                &l.v_proj,
                &l.o_proj,
                &l.mlp.dense().unwrap().gate_proj,
                &l.mlp.dense().unwrap().up_proj,
                &l.mlp.dense().unwrap().down_proj,
            ]
            .into_iter()
            .map(lin)
            .sum::<usize>()
                + l.input_layernorm.weight.byte_len()
                + l.post_attention_layernorm.weight.byte_len()
        })
        .sum();
    w.embed_tokens.bytes_read() + layers + w.norm.weight.byte_len() + w.lm_head.as_ref().map_or(0, lin)
}

fn quantized(w: &LinearWeight) -> &kiln_core::QuantizedMatrix {
    match w {
        LinearWeight::Quantized(q) => q,
        LinearWeight::Dense(_) => panic!("expected a quantized matrix"),
    }
}

fn is_dense(w: &LinearWeight) -> bool {
    matches!(w, LinearWeight::Dense(_))
}

/// The estimate is the pool's peak under the weights tag, exactly; what stays after the
/// load is what the weights hold.
fn assert_accounting(name: &str, quantize: Option<u32>) {
    let pool = MemoryPool::unlimited();
    let info = checkpoint::inspect(&fixture(name), &opts(&pool, quantize)).unwrap();
    assert_eq!(pool.stats().peak_bytes, 0, "inspect must not count anything");
    let m = checkpoint::load(&fixture(name), &opts(&pool, quantize)).unwrap();
    let stats = pool.stats();
    let weights = stats.by_tag[Tag::Weights.as_str()];
    assert_eq!(weights.peak, info.weight_bytes, "{name} {quantize:?}: peak vs inspect");
    assert_eq!(weights.live, held_bytes(&m.weights) as u64, "{name} {quantize:?}: live vs held");
    drop(m);
    assert_eq!(pool.stats().live_bytes, 0, "{name}: dropping the model releases every byte");
}

#[test]
fn llama_sharded_bf16_loads_dense_with_llama3_rope_and_generation_eos() {
    let (m, _pool) = load("llama3-tiny", None);
    let c = &m.config;
    assert_eq!(c.architecture, Architecture::Llama);
    assert_eq!((c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim), (64, 4, 2, 16));
    assert!(matches!(c.rope_scaling, Some(kiln_model::RopeScaling::Llama3 { .. })));
    // config.json names <|end_of_text|> only; generation_config.json adds <|eot_id|>.
    let eot = m.tokenizer.token_to_id("<|eot_id|>").unwrap();
    let eos = m.tokenizer.token_to_id("<|end_of_text|>").unwrap();
    assert_eq!(c.eos_token_ids, vec![eos, eot]);
    let w = &m.weights;
    assert!(is_dense(&w.embed_tokens) && w.lm_head.is_some());
    assert_eq!((w.embed_tokens.n(), w.embed_tokens.k()), (c.vocab_size, 64));
    assert_eq!(w.layers.len(), 2);
    let l = &w.layers[1];
    assert_eq!((l.k_proj.weight.n(), l.k_proj.weight.k()), (32, 64));
    assert_eq!(
        (l.mlp.dense().unwrap().down_proj.weight.n(), l.mlp.dense().unwrap().down_proj.weight.k()),
        (64, 128)
    );
    assert!(l.q_proj.bias.is_none());
    // bf16 is widened: every value is exactly representable in bf16.
    let mut row = vec![0f32; 64];
    w.embed_tokens.row(7, &mut row);
    assert!(row.iter().all(|v| half::bf16::from_f32(*v).to_f32() == *v));
    assert!(row.iter().any(|v| *v != 0.0));
    let tmpl = m.chat_template.as_ref().expect("llama3-tiny has a chat template");
    assert_eq!(tmpl.bos_token.as_deref(), Some("<|begin_of_text|>"));
    assert_eq!(tmpl.eos_token.as_deref(), Some("<|eot_id|>"));
}

#[test]
fn qwen2_f32_is_viewed_in_place_with_biases_and_tied_embeddings() {
    let (m, _pool) = load("qwen2-tiny", None);
    let c = &m.config;
    assert_eq!(c.architecture, Architecture::Qwen2);
    assert!(c.tie_word_embeddings && c.attention_bias);
    let w = &m.weights;
    assert!(w.lm_head.is_none(), "tied: the embedding is the LM head");
    let l = &w.layers[0];
    assert_eq!(l.q_proj.bias.as_ref().map(|b| b.len()), Some(64));
    assert_eq!(l.k_proj.bias.as_ref().map(|b| b.len()), Some(16));
    assert!(l.o_proj.bias.is_none());
    // The safetensors writer aligns f32 data, so norms and biases are views of the map.
    assert!(l.input_layernorm.weight.is_shared());
    assert!(l.q_proj.bias.as_ref().unwrap().is_shared());
    assert!(is_dense(&w.embed_tokens));
}

#[test]
fn mlx_4bit_honours_per_layer_overrides_and_quantized_tied_head() {
    let (m, _pool) = load("qwen2-tiny-4bit", None);
    let q = m.config.quantization.as_ref().unwrap();
    assert_eq!(q.default, QuantSpec::new(4, 32).unwrap());
    let w = &m.weights;
    assert!(w.lm_head.is_none());
    let embed = quantized(&w.embed_tokens);
    assert_eq!(embed.spec(), QuantSpec::new(4, 32).unwrap());
    assert_eq!(embed.scales().dtype(), ScaleDtype::Bf16);
    // Layer 0's down_proj carries its own spec in config.json.
    assert_eq!(
        quantized(&w.layers[0].mlp.dense().unwrap().down_proj.weight).spec(),
        QuantSpec::new(8, 32).unwrap()
    );
    assert_eq!(
        quantized(&w.layers[1].mlp.dense().unwrap().down_proj.weight).spec(),
        QuantSpec::new(4, 32).unwrap()
    );
    // Layer 1's o_proj was skipped by the quantizer: no scales, a bf16 matrix.
    assert!(is_dense(&w.layers[1].o_proj.weight));
    assert!(!is_dense(&w.layers[0].o_proj.weight));
    // The linear biases of q/k/v stay biases, next to the quantization biases.
    assert_eq!(w.layers[1].v_proj.bias.as_ref().map(|b| b.len()), Some(16));
    // The quantized embedding reads rows like a table.
    let mut row = vec![0f32; 64];
    w.embed_tokens.row(3, &mut row);
    assert!(row.iter().any(|v| *v != 0.0));
}

/// Every matrix of a decoder with a name for messages.
fn matrices(w: &ModelWeights) -> Vec<(String, &LinearWeight)> {
    let mut v = vec![("embed_tokens".to_string(), &w.embed_tokens)];
    for (i, l) in w.layers.iter().enumerate() {
        for (n, p) in [
            ("q_proj", &l.q_proj),
            ("k_proj", &l.k_proj),
            ("v_proj", &l.v_proj),
            ("o_proj", &l.o_proj),
            ("gate_proj", &l.mlp.dense().unwrap().gate_proj),
            ("up_proj", &l.mlp.dense().unwrap().up_proj),
            ("down_proj", &l.mlp.dense().unwrap().down_proj),
        ] {
            v.push((format!("layer {i} {n}"), &p.weight));
        }
    }
    if let Some(h) = &w.lm_head {
        v.push(("lm_head".into(), &h.weight));
    }
    v
}

#[test]
fn quantize_on_load_equals_mlx_quantization_bit_for_bit() {
    let (ours, _p1) = load("llama3-tiny", Some(4));
    let (mlx, _p2) = load("llama3-tiny-4bit-g64", None);
    let (a, b) = (matrices(&ours.weights), matrices(&mlx.weights));
    assert_eq!(a.len(), 16);
    assert_eq!(a.len(), b.len());
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        let (x, y) = (quantized(x), quantized(y));
        assert_eq!(x.spec(), QuantSpec::new(4, 64).unwrap(), "{name}");
        assert_eq!(x.spec(), y.spec(), "{name}");
        assert_eq!(x.scales().dtype(), ScaleDtype::Bf16, "{name}: a bf16 source keeps bf16 scales");
        assert_eq!(x.packed(), y.packed(), "{name}: packed codes");
        for i in 0..x.scales().len() {
            assert_eq!(x.scales().get(i).to_bits(), y.scales().get(i).to_bits(), "{name}: scale {i}");
            assert_eq!(x.biases().get(i).to_bits(), y.biases().get(i).to_bits(), "{name}: bias {i}");
        }
    }
    // Norms are untouched by quantization.
    assert_eq!(&*ours.weights.norm.weight, &*mlx.weights.norm.weight);
}

#[test]
fn quantize_on_load_of_f32_keeps_f32_scales_and_skips_nothing() {
    let (m, _pool) = load("qwen2-tiny", Some(8));
    for (name, w) in matrices(&m.weights) {
        let q = quantized(w);
        assert_eq!(q.spec(), QuantSpec::new(8, 64).unwrap(), "{name}");
        assert_eq!(q.scales().dtype(), ScaleDtype::F32, "{name}");
    }
    // 8-bit g64 puts each value on its group's grid `bias + scale * q`: within half a
    // step of the original, or at the grid's edge for a value MLX's grid stops short of.
    let (dense, _p) = load("qwen2-tiny", None);
    let (mut a, mut b) = (vec![0f32; 64], vec![0f32; 64]);
    let q = quantized(&m.weights.embed_tokens);
    for r in [0, 11, 200] {
        m.weights.embed_tokens.row(r, &mut a);
        dense.weights.embed_tokens.row(r, &mut b);
        let (scale, bias) = (q.scales().get(r), q.biases().get(r));
        let (e0, e1) = (bias, bias + scale * 255.0);
        for (x, y) in a.iter().zip(&b) {
            let inside = y.clamp(e0.min(e1), e0.max(e1));
            assert!((x - inside).abs() <= 0.5 * scale.abs() * 1.0001, "row {r}: {x} vs {y}");
        }
    }
}

#[test]
fn inspect_is_the_weights_peak_for_every_format() {
    for (name, q) in [
        ("llama3-tiny", None),
        ("llama3-tiny", Some(4)),
        ("llama3-tiny", Some(8)),
        ("qwen2-tiny", None),
        ("qwen2-tiny", Some(4)),
        ("qwen2-tiny-4bit", None),
        ("qwen2-tiny-4bit", Some(8)),
        ("llama3-tiny-4bit-g64", None),
    ] {
        assert_accounting(name, q);
    }
}

#[test]
fn a_pool_too_small_for_the_weights_is_out_of_memory_and_leaks_nothing() {
    let info = checkpoint::inspect(&fixture("qwen2-tiny"), &opts(&MemoryPool::unlimited(), None)).unwrap();
    let pool = MemoryPool::with_limit(info.weight_bytes - 1);
    let e = checkpoint::load(&fixture("qwen2-tiny"), &opts(&pool, None)).err().expect("must not fit");
    assert!(e.is_out_of_memory(), "{e}");
    assert!(e.to_string().starts_with("out of memory:"), "{e}");
    assert_eq!(pool.stats().live_bytes, 0);
    let pool = MemoryPool::with_limit(info.weight_bytes);
    checkpoint::load(&fixture("qwen2-tiny"), &opts(&pool, None)).unwrap();
}

#[test]
fn load_by_name_resolves_the_directory() {
    let pool = MemoryPool::unlimited();
    let spec = fixture("qwen2-tiny").display().to_string();
    let m = kiln_model::load(&spec, &opts(&pool, None)).unwrap();
    assert_eq!(m.source.display_path(), spec);
    let info = kiln_model::inspect(&spec, &opts(&pool, None)).unwrap();
    assert_eq!(info.config, m.config);
}

// ---- errors ----

/// A writable copy of a fixture.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for e in fs::read_dir(fixture(name)).unwrap() {
        let p = e.unwrap().path();
        fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    tmp
}

fn load_err(dir: &Path, quantize: Option<u32>) -> ModelError {
    let pool = MemoryPool::unlimited();
    let inspected = checkpoint::inspect(dir, &opts(&pool, quantize));
    let loaded = checkpoint::load(dir, &opts(&pool, quantize));
    let e = loaded.err().expect("load must fail");
    // inspect (which backs `kiln estimate`) refuses the same checkpoints, unless the
    // fault is one only the load reaches (the tokenizer).
    if !matches!(e, ModelError::Tokenizer { .. }) {
        assert!(inspected.is_err(), "inspect accepted what load refused: {e}");
    }
    e
}

fn assert_mentions(e: &ModelError, needles: &[&str]) {
    let msg = e.to_string();
    for n in needles {
        assert!(msg.contains(n), "{msg:?} lacks {n:?}");
    }
    assert!(!msg.ends_with('.'), "{msg:?} ends with a period");
}

fn edit_json(path: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value = serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// Rewrites one safetensors file with `f` applied to its tensors.
fn edit_tensors(path: &Path, f: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>)) {
    let bytes = fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    f(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn a_missing_tensor_names_the_tensor_and_the_files() {
    let tmp = copy_fixture("qwen2-tiny");
    edit_tensors(&tmp.path().join("model.safetensors"), |t| {
        t.retain(|(n, ..)| n != "model.layers.1.mlp.up_proj.weight")
    });
    let e = load_err(tmp.path(), None);
    assert_mentions(
        &e,
        &["model.safetensors", "missing tensor model.layers.1.mlp.up_proj.weight", "[192, 64]"],
    );
}

#[test]
fn a_missing_bias_is_a_missing_tensor() {
    let tmp = copy_fixture("qwen2-tiny");
    edit_tensors(&tmp.path().join("model.safetensors"), |t| {
        t.retain(|(n, ..)| n != "model.layers.0.self_attn.k_proj.bias")
    });
    assert_mentions(&load_err(tmp.path(), None), &["model.layers.0.self_attn.k_proj.bias", "length 16"]);
}

#[test]
fn a_wrong_shape_names_the_tensor_and_the_expected_shape() {
    let tmp = copy_fixture("qwen2-tiny");
    edit_json(&tmp.path().join("config.json"), |c| c["intermediate_size"] = 256.into());
    let e = load_err(tmp.path(), None);
    assert_mentions(
        &e,
        &["model.safetensors", "model.layers.0.mlp.gate_proj.weight", "[192, 64]", "[256, 64]"],
    );
}

#[test]
fn an_unsupported_dtype_names_the_tensor_and_the_accepted_ones() {
    let tmp = copy_fixture("qwen2-tiny");
    edit_tensors(&tmp.path().join("model.safetensors"), |t| {
        for (n, d, s, b) in t.iter_mut() {
            if n == "model.norm.weight" {
                // 64 f32 values reinterpreted as 32 f64s: same bytes, refused dtype.
                *d = safetensors::Dtype::F64;
                *s = vec![32];
                assert_eq!(b.len(), 256);
            }
        }
    });
    let e = load_err(tmp.path(), None);
    assert_mentions(&e, &["model.norm.weight", "F64", "F32, F16 or BF16"]);
}

#[test]
fn a_missing_shard_and_an_inconsistent_index_are_refused() {
    let tmp = copy_fixture("llama3-tiny");
    fs::remove_file(tmp.path().join("model-00002-of-00002.safetensors")).unwrap();
    assert_mentions(
        &load_err(tmp.path(), None),
        &["model.safetensors.index.json", "model-00002-of-00002.safetensors", "does not exist"],
    );
    let tmp = copy_fixture("llama3-tiny");
    edit_json(&tmp.path().join("model.safetensors.index.json"), |v| {
        v["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors".into();
    });
    assert_mentions(&load_err(tmp.path(), None), &["model.norm.weight", "model-00001-of-00002.safetensors"]);
}

#[test]
fn a_truncated_file_is_not_a_valid_safetensors_file() {
    let tmp = copy_fixture("qwen2-tiny");
    let p = tmp.path().join("model.safetensors");
    let bytes = fs::read(&p).unwrap();
    fs::write(&p, &bytes[..bytes.len() - 100]).unwrap();
    assert_mentions(&load_err(tmp.path(), None), &["model.safetensors", "not a valid safetensors file"]);
}

#[test]
fn no_weights_at_all_says_what_would_be_accepted() {
    let tmp = tempfile::tempdir().unwrap();
    fs::copy(fixture("qwen2-tiny/config.json"), tmp.path().join("config.json")).unwrap();
    assert_mentions(&load_err(tmp.path(), None), &["no weights found", "model.safetensors.index.json"]);
}

#[test]
fn malformed_and_unsupported_configs_name_the_file_and_field() {
    let tmp = copy_fixture("qwen2-tiny");
    fs::write(tmp.path().join("config.json"), "{ not json").unwrap();
    let err = load_err(tmp.path(), None);
    assert_mentions(&err, &["config.json", "not a valid config"]);
    let msg = err.to_string();
    assert_eq!(msg.matches("config.json").count(), 1, "the file is named once: {msg}");
    let tmp = copy_fixture("qwen2-tiny");
    edit_json(&tmp.path().join("config.json"), |c| c["model_type"] = "gemma".into());
    assert_mentions(
        &load_err(tmp.path(), None),
        &["config.json", "model_type", "gemma", "llama, qwen2, mistral"],
    );
    let tmp = copy_fixture("llama3-tiny");
    fs::write(tmp.path().join("generation_config.json"), r#"{"eos_token_id": "x"}"#).unwrap();
    assert_mentions(&load_err(tmp.path(), None), &["generation_config.json", "eos_token_id"]);
}

#[test]
fn a_bias_the_config_does_not_declare_is_refused() {
    // qwen2's q/k/v biases under a llama config would be silently dropped.
    let tmp = copy_fixture("qwen2-tiny");
    edit_json(&tmp.path().join("config.json"), |c| c["model_type"] = "llama".into());
    assert_mentions(&load_err(tmp.path(), None), &["model.layers.0.self_attn.q_proj.bias", "no bias"]);
}

#[test]
fn quantization_config_must_match_the_packed_tensors() {
    // Claiming 8 bits for 4-bit data: the packed width does not fit.
    let tmp = copy_fixture("qwen2-tiny-4bit");
    edit_json(&tmp.path().join("config.json"), |c| {
        c["quantization"]["bits"] = 8.into();
        c["quantization_config"]["bits"] = 8.into();
    });
    assert_mentions(
        &load_err(tmp.path(), None),
        &["model.embed_tokens.weight", "[320, 8]", "[320, 16]", "8-bit g32"],
    );
    // A group larger than K breaks the format's geometry.
    let tmp = copy_fixture("qwen2-tiny-4bit");
    edit_json(&tmp.path().join("config.json"), |c| {
        c["quantization"]["group_size"] = 128.into();
        c["quantization_config"]["group_size"] = 128.into();
    });
    let e = load_err(tmp.path(), None);
    assert!(matches!(e, ModelError::Geometry { .. }), "{e}");
    assert_mentions(&e, &["model.embed_tokens", "multiple of the group size"]);
    // A module the config leaves unquantized must hold a float matrix.
    let tmp = copy_fixture("qwen2-tiny-4bit");
    edit_json(&tmp.path().join("config.json"), |c| {
        c["quantization"]["model.layers.0.self_attn.q_proj"] = false.into();
    });
    assert_mentions(
        &load_err(tmp.path(), None),
        &["model.layers.0.self_attn.q_proj.weight", "U32", "left unquantized"],
    );
    // Packed data without a quantization block.
    let tmp = copy_fixture("qwen2-tiny-4bit");
    edit_json(&tmp.path().join("config.json"), |c| {
        let o = c.as_object_mut().unwrap();
        o.remove("quantization");
        o.remove("quantization_config");
    });
    assert_mentions(
        &load_err(tmp.path(), None),
        &["model.embed_tokens.weight", "U32", "no quantization block"],
    );
}

#[test]
fn an_explicit_false_override_matches_the_implicit_one() {
    // mlx-lm records a skipped module nowhere; some converters write `false`. Both load
    // layer 1's o_proj as a float matrix.
    let tmp = copy_fixture("qwen2-tiny-4bit");
    edit_json(&tmp.path().join("config.json"), |c| {
        c["quantization"]["model.layers.1.self_attn.o_proj"] = false.into();
    });
    let pool = MemoryPool::unlimited();
    let m = checkpoint::load(tmp.path(), &opts(&pool, None)).unwrap();
    assert!(is_dense(&m.weights.layers[1].o_proj.weight));
}

#[test]
fn quantize_accepts_4_and_8_bits_only() {
    let e = load_err(&fixture("qwen2-tiny"), Some(3));
    assert!(matches!(e, ModelError::InvalidArgument { .. }), "{e}");
    assert_mentions(&e, &["quantize", "3", "4 and 8"]);
}

#[test]
fn a_missing_tokenizer_names_the_file() {
    let tmp = copy_fixture("qwen2-tiny");
    fs::remove_file(tmp.path().join("tokenizer.json")).unwrap();
    assert_mentions(&load_err(tmp.path(), None), &["tokenizer.json", "missing"]);
}
