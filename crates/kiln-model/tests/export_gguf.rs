//! `checkpoint::gguf::export` round-tripped through kiln's own GGUF loader: a model in
//! groups of 32 comes back as the same weights in the same layout and gives the same
//! logits bit for bit (Qwen2, and Llama with its Q/K rows permuted on the way out and back);
//! groups of 64 come back as the same weight values; what has no block form is written
//! as F32 and reported; a model the loader could not read back is refused by name; the
//! file appears whole or not at all.

use kiln_core::MemoryPool;
use kiln_model::checkpoint::gguf;
use kiln_model::weights::{LinearWeight, ModelWeights};
use kiln_model::{EngineOptions, LoadOptions, LoadedModel, ModelError, Session, load};

fn opts(pool: &MemoryPool) -> LoadOptions {
    LoadOptions { pool: pool.clone(), quantize: None }
}

fn matrices(w: &ModelWeights) -> Vec<&LinearWeight> {
    let mut m = vec![&w.embed_tokens];
    for l in &w.layers {
        let mlp = l.mlp.dense().expect("the exported models are dense");
        m.extend([
            &l.q_proj.weight,
            &l.k_proj.weight,
            &l.v_proj.weight,
            &l.o_proj.weight,
            &mlp.gate_proj.weight,
            &mlp.up_proj.weight,
            &mlp.down_proj.weight,
        ]);
    }
    m.extend(w.lm_head.as_ref().map(|h| &h.weight));
    m
}

/// Every matrix dequantizes to the same values, row for row.
fn same_weights(a: &LoadedModel, b: &LoadedModel) {
    let (ma, mb) = (matrices(&a.weights), matrices(&b.weights));
    assert_eq!(ma.len(), mb.len());
    for (i, (x, y)) in ma.iter().zip(&mb).enumerate() {
        assert_eq!((x.n(), x.k()), (y.n(), y.k()), "matrix {i}");
        let (mut rx, mut ry) = (vec![0f32; x.k()], vec![0f32; x.k()]);
        for r in 0..x.n() {
            x.row(r, &mut rx);
            y.row(r, &mut ry);
            assert_eq!(rx, ry, "matrix {i} row {r}");
        }
    }
    for (la, lb) in a.weights.layers.iter().zip(&b.weights.layers) {
        assert_eq!(&la.input_layernorm.weight[..], &lb.input_layernorm.weight[..]);
        assert_eq!(la.q_proj.bias.as_deref(), lb.q_proj.bias.as_deref());
        assert_eq!(la.k_proj.bias.as_deref(), lb.k_proj.bias.as_deref());
    }
}

fn logits(model: &LoadedModel, pool: &MemoryPool, tokens: &[u32]) -> Vec<f32> {
    Session::new(model, pool, EngineOptions::default()).unwrap().prefill_all_logits(tokens).unwrap()
}

fn round_trip(name: &str) -> (LoadedModel, LoadedModel, gguf::ExportReport, MemoryPool) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m.gguf");
    let pool = MemoryPool::unlimited();
    let model = load(&format!("synthetic:{name}"), &opts(&pool)).unwrap();
    let report = gguf::export(&model, &out).unwrap();
    assert_eq!(report.bytes, std::fs::metadata(&out).unwrap().len(), "{name}");
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["m.gguf"], "no temporary file is left beside it");
    let back = load(out.to_str().unwrap(), &opts(&pool)).unwrap();
    (model, back, report, pool)
}

#[test]
fn groups_of_32_come_back_exactly_with_the_same_logits() {
    for name in ["tiny-qwen@4bit-g32", "smollm-draft@4bit-g32"] {
        let (model, back, report, pool) = round_trip(name);
        assert!(report.f32.is_empty() && report.q8_0 == 0, "{name}: {report:?}");
        assert_eq!(report.q4_1, matrices(&model.weights).len(), "{name}");
        assert_eq!(back.config.architecture, model.config.architecture);
        same_weights(&model, &back);
        let tokens: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 256).collect();
        assert_eq!(logits(&model, &pool, &tokens), logits(&back, &pool, &tokens), "{name}: logits differ");
        // The byte tokenizer survives as byte tokens.
        let text = "kiln, exported";
        assert_eq!(model.tokenizer.encode(text, false).unwrap(), back.tokenizer.encode(text, false).unwrap());
    }
}

#[test]
fn groups_of_64_split_into_blocks_with_the_same_values() {
    let (model, back, report, _) = round_trip("tiny-qwen");
    assert!(report.f32.is_empty(), "{report:?}");
    same_weights(&model, &back);
}

#[test]
fn what_has_no_block_form_is_written_as_f32_and_reported() {
    // Synthetic 8-bit groups centre their codes with a bias that is not -128 x scale.
    let (model, back, report, _) = round_trip("tiny-qwen@8bit");
    assert_eq!(report.q4_1 + report.q8_0, 0, "{report:?}");
    assert_eq!(report.f32.len(), matrices(&model.weights).len());
    assert!(report.f32[0].1.contains("is not -128 x its scale"), "{report:?}");
    same_weights(&model, &back);
}

#[test]
fn a_model_the_loader_cannot_read_back_is_refused_and_nothing_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tiny.gguf");
    let pool = MemoryPool::unlimited();
    // synthetic:tiny has Llama 3.1 rope scaling.
    let model = load("synthetic:tiny", &opts(&pool)).unwrap();
    let e = gguf::export(&model, &out).unwrap_err();
    assert!(matches!(e, ModelError::Export { .. }), "{e:?}");
    assert!(e.to_string().contains("accepted rope scalings are none and linear"), "{e}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
