//! Mixture-of-experts checkpoints against mlx-lm (fixtures of
//! scripts/fixtures/make_moe_fixtures.py): Mixtral, Qwen2-MoE (shared expert) and
//! Qwen3-MoE (q/k norms, `norm_topk_prob`) in MLX's stacked layout, and Mixtral in Hugging
//! Face's per-expert float layout quantized on load. Logits at the last 8 prompt positions
//! and along a 24-step greedy continuation (fed the reference's tokens), kiln's own greedy
//! decode, the same decode through an expert cache of top-k slots, and the errors of
//! broken checkpoints.
//!
//! Tolerances come from the fixture, derived as tests/mlx_reference/mod.rs describes: the
//! script records how far mlx's own forward moves when it rounds what kiln rounds (the KV
//! cache to f16; activations entering 4- and 8-bit matmuls as the integer codes of kiln's
//! activation scheme, `int16_act_*` for the default `int16`, `int_act_*` for `int8`). The
//! script also picked each model's seed so that no router's k-th and (k+1)-th logits come
//! within 4 times their largest move under those roundings: kiln's rounding cannot swap an
//! expert, which would move logits by whole units.

mod mlx_reference;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_core::act_precision::{ActScheme, act_scheme};
use kiln_core::{MemoryPool, ScaleData};
use kiln_model::{EngineOptions, KvDtype, LoadOptions, LoadedModel, Session, checkpoint};
use mlx_reference::{Reference, greedy_agreement, max_deviation};
use safetensors::Dtype;
use safetensors::tensor::TensorView;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/moe")
}

fn reference(name: &str) -> Reference {
    mlx_reference::reference(&fixtures(), name)
}

/// The fixture's name for what kiln rounds in this process (every matrix of these
/// fixtures is 4- or 8-bit, so the activation scheme applies to all of them).
fn rounding(kv: KvDtype) -> String {
    let act = match act_scheme() {
        ActScheme::Int16 => "int16_act_",
        ActScheme::Int8 => "int_act_",
        // Its batched rows (a prefill of 2 to 15 tokens) round as int8's do: the looser
        // of the two tolerances covers both.
        ActScheme::Int16Wide8 => "int_act_",
        ActScheme::F32 | ActScheme::F16 => "",
    };
    let cache = match kv {
        KvDtype::F32 => "f32_cache",
        KvDtype::F16 => "f16_cache",
    };
    format!("{act}{cache}")
}

fn load(dir: &str, quantize: Option<u32>) -> (LoadedModel, MemoryPool) {
    let pool = MemoryPool::unlimited();
    let m = checkpoint::load(&fixtures().join(dir), &LoadOptions { pool: pool.clone(), quantize })
        .unwrap_or_else(|e| panic!("loading {dir}: {e}"));
    (m, pool)
}

/// Runs `dir` against reference `name` under both KV caches, with every expert resident
/// and, for a checkpoint quantized as stored, through an expert cache at the floor (top-k
/// slots), which must change no token. (The cache's geometry reads the experts' spec from
/// config.json's `quantization`, so a float checkpoint quantized on load has none.)
fn check(dir: &str, name: &str, quantize: Option<u32>) {
    let (model, pool) = load(dir, quantize);
    let r = reference(name);
    let top_k = model.config.moe.expect("a mixture of experts").top_k;
    for kv in [KvDtype::F32, KvDtype::F16] {
        let config = rounding(kv);
        let tol = r.tolerance(&config);
        let resident = EngineOptions { kv_dtype: kv, ..EngineOptions::default() };
        let dev = max_deviation(&model, &pool, &r, resident, tol);
        let steps = greedy_agreement(&model, &pool, &r, resident, tol);
        eprintln!(
            "{dir} vs {name}, {config}: max logit deviation {dev:.2e} (tolerance {:.2e}); greedy agrees for \
             {steps} of {} steps (near tie below {:.2e})",
            tol.logit,
            r.greedy_ids.len(),
            tol.near_tie
        );
        assert!(dev <= tol.logit, "{dir} {config}: logits deviate by {dev}, tolerance {}", tol.logit);
        if tol.clear {
            assert_eq!(steps, r.greedy_ids.len(), "{dir} {config}: the fixture is clear of near ties");
        }
        if quantize.is_some() {
            continue;
        }
        let cached = EngineOptions { expert_slots: Some(top_k), ..resident };
        let mut a = Session::new(&model, &pool, resident).unwrap();
        let mut b = Session::new(&model, &pool, cached).unwrap();
        let n = r.greedy_ids.len();
        assert_eq!(
            b.generate_greedy(&r.prompt_ids, n).unwrap(),
            a.generate_greedy(&r.prompt_ids, n).unwrap(),
            "{dir} {config}: --expert-slots {top_k} changed the tokens"
        );
    }
}

#[test]
fn mixtral_mlx_stacked_experts_match_mlx() {
    check("mixtral-moe-tiny-4bit-g64", "mixtral-moe-tiny-4bit-g64", None);
}

#[test]
fn qwen2_moe_mlx_with_shared_expert_matches_mlx() {
    check("qwen2-moe-tiny-4bit", "qwen2-moe-tiny-4bit", None);
}

#[test]
fn qwen3_moe_mlx_with_qk_norm_and_8_bit_router_matches_mlx() {
    check("qwen3-moe-tiny-4bit", "qwen3-moe-tiny-4bit", None);
}

#[test]
fn mixtral_hugging_face_per_expert_quantized_on_load_matches_mlx() {
    check("mixtral-moe-tiny", "mixtral-moe-tiny-4bit-g64", Some(4));
}

fn scale_bits(s: &ScaleData) -> Vec<f32> {
    (0..s.len()).map(|i| s.get(i)).collect()
}

#[test]
fn quantize_on_load_of_per_expert_tensors_equals_mlx_convert_bit_for_bit() {
    let (hf, _) = load("mixtral-moe-tiny", Some(4));
    let (mlx, _) = load("mixtral-moe-tiny-4bit-g64", None);
    let (a, b) = (hf.weights.experts.as_ref().unwrap(), mlx.weights.experts.as_ref().unwrap());
    assert_eq!((a.layers(), a.experts(), a.top_k()), (2, 4, 2));
    assert_eq!((a.layers(), a.experts(), a.expert_bytes()), (b.layers(), b.experts(), b.expert_bytes()));
    for id in 0..a.total() {
        for (x, y) in a.by_id(id).parts().into_iter().zip(b.by_id(id).parts()) {
            assert_eq!((x.n(), x.k(), x.spec()), (y.n(), y.k(), y.spec()), "expert {id}");
            assert_eq!(x.packed(), y.packed(), "expert {id}: packed codes");
            assert_eq!(scale_bits(x.scales()), scale_bits(y.scales()), "expert {id}: scales");
            assert_eq!(scale_bits(x.biases()), scale_bits(y.biases()), "expert {id}: biases");
        }
    }
}

/// A tensor as the tests rewrite it.
struct Stored {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// Every tensor of the fixture `dir`.
fn tensors_of(dir: &str) -> BTreeMap<String, Stored> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(fixtures().join(dir)).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, t) in st.tensors() {
            out.insert(name, Stored { dtype: t.dtype(), shape: t.shape().to_vec(), data: t.data().to_vec() });
        }
    }
    out
}

/// The fixture `dir` rewritten by `edit` (its tensors and its config.json) into one
/// `model.safetensors` as the `safetensors` library writes it: header padded to 8 bytes,
/// tensors ordered by alignment, so every tensor is aligned for its dtype.
fn rewritten(
    dir: &str,
    edit: impl FnOnce(&mut BTreeMap<String, Stored>, &mut serde_json::Value),
) -> tempfile::TempDir {
    let src = fixtures().join(dir);
    let mut tensors = tensors_of(dir);
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut tensors, &mut config);
    let out = tempfile::tempdir().unwrap();
    std::fs::write(out.path().join("config.json"), serde_json::to_string_pretty(&config).unwrap()).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), out.path().join(f)).unwrap();
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, t)| (n.clone(), TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap()))
        .collect();
    std::fs::write(out.path().join("model.safetensors"), safetensors::serialize(views, None).unwrap())
        .unwrap();
    out
}

/// Experts of `model`, checked to be views into their stacks: views of one stack lie back
/// to back, as the stack does in the file; copies are separate allocations, never exactly
/// adjacent.
fn experts_are_views(model: &LoadedModel) -> bool {
    let store = model.weights.experts.as_ref().unwrap();
    (0..store.layers()).all(|layer| {
        (0..3).all(|part| {
            let at = |e: usize| store.get(layer, e).parts()[part].packed();
            let first = at(0).as_ptr() as usize;
            (1..store.experts()).all(|e| at(e).as_ptr() as usize == first + e * size_of_val(at(0)))
        })
    })
}

#[test]
fn stacked_experts_are_views_into_the_mapped_file_when_aligned() {
    for dir in ["mixtral-moe-tiny-4bit-g64", "qwen2-moe-tiny-4bit", "qwen3-moe-tiny-4bit"] {
        // mlx writes the safetensors header unpadded, so its U32 stacks sit at odd
        // offsets: each expert is then copied on its own (never the whole stack).
        let (model, pool) = load(dir, None);
        let moe = model.config.moe.unwrap();
        assert_eq!(
            model.weights.experts.as_ref().unwrap().total(),
            model.config.num_hidden_layers * moe.experts
        );
        assert!(!experts_are_views(&model), "{dir}: mlx's unpadded header leaves no U32 stack aligned");
        let info =
            checkpoint::inspect(&fixtures().join(dir), &LoadOptions { pool: pool.clone(), quantize: None })
                .unwrap();
        assert_eq!(pool.stats().live_bytes, info.weight_bytes, "{dir}: the estimate is what the load holds");
        // The same tensors, aligned: every expert is a view, counted in the pool as before.
        let aligned = rewritten(dir, |_, _| {});
        let pool = MemoryPool::unlimited();
        let opts = LoadOptions { pool: pool.clone(), quantize: None };
        let model = checkpoint::load(aligned.path(), &opts).unwrap();
        assert!(experts_are_views(&model), "{dir}: aligned stacks must be viewed in place");
        assert_eq!(pool.stats().live_bytes, checkpoint::inspect(aligned.path(), &opts).unwrap().weight_bytes);
    }
}

/// The load error of the fixture `dir` rewritten by `edit`.
fn load_error(
    dir: &str,
    quantize: Option<u32>,
    edit: impl FnOnce(&mut BTreeMap<String, Stored>, &mut serde_json::Value),
) -> String {
    let broken = rewritten(dir, edit);
    let opts = LoadOptions { pool: MemoryPool::unlimited(), quantize };
    let e = checkpoint::inspect(broken.path(), &opts).map(|_| ()).unwrap_err().to_string();
    // inspect and load plan alike, so they refuse alike.
    assert_eq!(checkpoint::load(broken.path(), &opts).map(|_| ()).unwrap_err().to_string(), e);
    e
}

/// The first `rows` entries along `t`'s first axis.
fn truncate(t: &mut Stored, rows: usize) {
    let per = t.data.len() / t.shape[0];
    t.data.truncate(rows * per);
    t.shape[0] = rows;
}

fn assert_names(e: &str, parts: &[&str]) {
    for p in parts {
        assert!(e.contains(p), "{p:?} missing from: {e}");
    }
}

#[test]
fn a_stack_with_the_wrong_expert_count_is_refused_naming_it() {
    let e = load_error("qwen2-moe-tiny-4bit", None, |t, _| {
        truncate(t.get_mut("model.layers.1.mlp.switch_mlp.up_proj.weight").unwrap(), 3)
    });
    assert_names(
        &e,
        &[
            "tensor model.layers.1.mlp.switch_mlp.up_proj.weight has shape [3, 32, 8]",
            "expected [4, ...]",
            "num_experts = 4",
        ],
    );
}

#[test]
fn a_misshapen_stack_is_refused_naming_it() {
    let e = load_error("qwen3-moe-tiny-4bit", None, |t, _| {
        let s = t.get_mut("model.layers.0.mlp.switch_mlp.down_proj.scales").unwrap();
        s.shape = vec![8, 32, 2];
    });
    assert_names(
        &e,
        &[
            "tensor model.layers.0.mlp.switch_mlp.down_proj.scales has shape [32, 2], expected [64, 1]",
            "for each expert of the stack",
        ],
    );
}

#[test]
fn a_missing_stack_is_refused_naming_it() {
    let e = load_error("mixtral-moe-tiny-4bit-g64", None, |t, _| {
        t.remove("model.layers.1.block_sparse_moe.switch_mlp.down_proj.weight");
    });
    assert_names(
        &e,
        &["missing tensor model.layers.1.block_sparse_moe.switch_mlp.down_proj.weight", "4 stacked [64, 64]"],
    );
}

#[test]
fn a_router_of_the_wrong_width_is_refused_naming_it() {
    let e = load_error("qwen2-moe-tiny-4bit", None, |t, _| {
        for s in ["weight", "scales", "biases"] {
            truncate(t.get_mut(&format!("model.layers.0.mlp.gate.{s}")).unwrap(), 3);
        }
    });
    assert_names(&e, &["tensor model.layers.0.mlp.gate.weight has shape [3, 8], expected [4, 8]"]);
}

#[test]
fn experts_in_neither_layout_are_refused_naming_both() {
    let e = load_error("qwen3-moe-tiny-4bit", None, |t, _| {
        let stacked: Vec<String> = t.keys().filter(|n| n.contains(".switch_mlp.")).cloned().collect();
        for n in stacked {
            let v = t.remove(&n).unwrap();
            t.insert(n.replace(".switch_mlp.", ".stacked_experts."), v);
        }
    });
    assert_names(
        &e,
        &[
            "missing the routed experts of model.layers.0",
            "model.layers.0.mlp.switch_mlp.gate_proj.weight (MLX layout",
            "model.layers.0.mlp.experts.0.gate_proj.weight (Hugging Face layout",
        ],
    );
}

#[test]
fn a_missing_q_norm_is_refused_naming_it() {
    let e = load_error("qwen3-moe-tiny-4bit", None, |t, _| {
        t.remove("model.layers.1.self_attn.q_norm.weight");
    });
    assert_names(&e, &["missing tensor model.layers.1.self_attn.q_norm.weight", "a vector of 16 (head_dim"]);
}

#[test]
fn a_missing_per_expert_tensor_is_refused_naming_it() {
    let e = load_error("mixtral-moe-tiny", Some(4), |t, _| {
        t.remove("model.layers.1.block_sparse_moe.experts.3.w2.weight");
    });
    assert_names(
        &e,
        &["missing tensor model.layers.1.block_sparse_moe.experts.3.w2.weight (a [64, 64] matrix)"],
    );
}

#[test]
fn a_misshapen_per_expert_tensor_is_refused_naming_it() {
    let e = load_error("mixtral-moe-tiny", Some(4), |t, _| {
        truncate(t.get_mut("model.layers.0.block_sparse_moe.experts.2.w1.weight").unwrap(), 32)
    });
    assert_names(
        &e,
        &["tensor model.layers.0.block_sparse_moe.experts.2.w1.weight has shape [32, 64], expected [64, 64]"],
    );
}

#[test]
fn more_per_expert_tensors_than_the_config_has_experts_are_refused() {
    let e = load_error("mixtral-moe-tiny", Some(4), |t, c| {
        c["num_local_experts"] = 3.into();
        for l in 0..2 {
            truncate(t.get_mut(&format!("model.layers.{l}.block_sparse_moe.gate.weight")).unwrap(), 3);
        }
    });
    assert_names(
        &e,
        &[
            "tensor model.layers.0.block_sparse_moe.experts.3.w1.weight is expert 3",
            "num_local_experts is 3",
            "experts 0 to 2",
        ],
    );
}

#[test]
fn float_experts_without_quantize_are_refused_naming_the_flag() {
    let e = load_error("mixtral-moe-tiny", None, |_, _| {});
    assert_names(
        &e,
        &[
            "tensor model.layers.0.block_sparse_moe.experts.0.w1.weight is a float routed expert",
            "--quantize 4",
        ],
    );
}

/// The experts of `model`, every matrix's codes, scales and biases, in store order.
fn expert_contents(model: &LoadedModel) -> Vec<(Vec<u32>, Vec<f32>, Vec<f32>)> {
    let store = model.weights.experts.as_ref().unwrap();
    (0..store.total())
        .flat_map(|id| store.by_id(id).parts())
        .map(|m| (m.packed().to_vec(), scale_bits(m.scales()), scale_bits(m.biases())))
        .collect()
}

#[test]
fn qwen_per_expert_tensors_load_as_their_stacks_do() {
    // mlx-lm's Qwen sanitizers accept experts stored one by one, quantized or not: the
    // Hugging Face names with MLX triples. Split each stack into them.
    for dir in ["qwen2-moe-tiny-4bit", "qwen3-moe-tiny-4bit"] {
        let split = rewritten(dir, |t, _| {
            let stacked: Vec<String> = t.keys().filter(|n| n.contains(".switch_mlp.")).cloned().collect();
            for name in stacked {
                let mut stack = t.remove(&name).unwrap();
                let experts = stack.shape[0];
                let per = stack.data.len() / experts;
                let shape = stack.shape.split_off(1);
                for e in 0..experts {
                    let data = stack.data[e * per..(e + 1) * per].to_vec();
                    let stored = Stored { dtype: stack.dtype, shape: shape.clone(), data };
                    t.insert(name.replace(".switch_mlp.", &format!(".experts.{e}.")), stored);
                }
            }
        });
        let pool = MemoryPool::unlimited();
        let per_expert =
            checkpoint::load(split.path(), &LoadOptions { pool: pool.clone(), quantize: None }).unwrap();
        let (stacked, _) = load(dir, None);
        assert_eq!(expert_contents(&per_expert), expert_contents(&stacked), "{dir}");
        let r = reference(dir);
        let opts = EngineOptions::default();
        let mut a = Session::new(&per_expert, &pool, opts).unwrap();
        let mut b = Session::new(&stacked, &pool, opts).unwrap();
        assert_eq!(
            a.prefill_all_logits(&r.prompt_ids).unwrap(),
            b.prefill_all_logits(&r.prompt_ids).unwrap(),
            "{dir}: per-expert and stacked logits differ"
        );
    }
}

#[test]
fn a_float_stack_quantizes_on_load_one_expert_at_a_time_as_mlx_does() {
    // What mlx-lm saves for Mixtral without quantizing: each matrix of every expert
    // stacked, in the source dtype.
    let stacked = rewritten("mixtral-moe-tiny", |t, _| {
        for l in 0..2 {
            for (hf, mlx) in [("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")] {
                let block = format!("model.layers.{l}.block_sparse_moe");
                let parts: Vec<Stored> =
                    (0..4).map(|e| t.remove(&format!("{block}.experts.{e}.{hf}.weight")).unwrap()).collect();
                let mut shape = vec![parts.len()];
                shape.extend_from_slice(&parts[0].shape);
                let data = parts.iter().flat_map(|p| p.data.iter().copied()).collect();
                t.insert(
                    format!("{block}.switch_mlp.{mlx}.weight"),
                    Stored { dtype: parts[0].dtype, shape, data },
                );
            }
        }
    });
    let pool = MemoryPool::unlimited();
    let opts = LoadOptions { pool: pool.clone(), quantize: Some(4) };
    let model = checkpoint::load(stacked.path(), &opts).unwrap();
    assert_eq!(pool.stats().peak_bytes, checkpoint::inspect(stacked.path(), &opts).unwrap().weight_bytes);
    let (mlx, _) = load("mixtral-moe-tiny-4bit-g64", None);
    assert_eq!(expert_contents(&model), expert_contents(&mlx), "mlx's 4-bit group-64 experts, bit for bit");
    let e =
        checkpoint::inspect(stacked.path(), &LoadOptions { pool, quantize: None }).map(|_| ()).unwrap_err();
    assert_names(
        &e.to_string(),
        &[
            "tensor model.layers.0.block_sparse_moe.switch_mlp.gate_proj.weight is a float routed expert",
            "--quantize 4",
        ],
    );
}
