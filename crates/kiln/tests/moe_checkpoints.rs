//! Mixture-of-experts checkpoints through the real binary, on kiln-model's mlx-lm
//! fixtures (scripts/fixtures/make_moe_fixtures.py): `kiln generate` writes mlx-lm's
//! greedy continuation for Mixtral, Qwen2-MoE and Qwen3-MoE in MLX's stacked layout and
//! for Mixtral's Hugging Face per-expert layout quantized on load, and the same text
//! through an expert cache at the floor; a checkpoint that disagrees with its config exits
//! 2 naming the tensor; `kiln estimate` prices a MoE checkpoint, with and without an
//! expert cache, at exactly the peak `kiln bench-decode` measures (and bounds it when the
//! checkpoint is quantized on load).

// Shared with the other binary tests; not every helper is used here.
#[allow(dead_code)]
mod util;

use std::path::PathBuf;

use util::{Dir, Run};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../kiln-model/tests/fixtures/moe").join(name)
}

/// What `kiln generate` writes for mlx-lm's greedy run: the `greedy_text` the fixture
/// script recorded in the reference's safetensors metadata (special tokens skipped, as
/// kiln writes text), and the newline that ends kiln's output.
fn greedy_text(reference: &str) -> String {
    let bytes = std::fs::read(fixture(&format!("references/{reference}.safetensors"))).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    let text = header["__metadata__"]["greedy_text"].as_str().expect("greedy_text in the reference");
    format!("{text}\n")
}

/// The prompt the references were made with (through the chat template).
const PROMPT: &str = "What is the capital of France?";

/// Steps in each reference's greedy run.
const STEPS: &str = "24";

fn generate(dir: &Dir, model: &str, extra: &[&str]) -> Run {
    let mut args = vec!["generate", "-m", model, "-p", PROMPT, "-n", STEPS];
    args.extend_from_slice(extra);
    dir.run(&args).expect_code(0)
}

#[test]
fn generate_writes_mlx_greedy_text_resident_and_through_an_expert_cache() {
    let dir = Dir::new();
    for name in ["mixtral-moe-tiny-4bit-g64", "qwen2-moe-tiny-4bit", "qwen3-moe-tiny-4bit"] {
        let model = fixture(name);
        let model = model.to_str().unwrap();
        let want = greedy_text(name);
        let all = generate(&dir, model, &[]);
        assert_eq!(all.stdout(), want, "{name}: kiln's greedy text against mlx-lm's{}", all.describe());
        // Every fixture routes to top-2: two slots is the floor, so nearly every expert
        // a token needs is a miss.
        let cached = generate(&dir, model, &["--expert-slots", "2"]);
        assert_eq!(cached.stdout(), want, "{name}: --expert-slots 2 changed the text{}", cached.describe());
    }
}

#[test]
fn generate_on_hugging_face_per_expert_weights_quantized_on_load_writes_mlx_greedy_text() {
    let dir = Dir::new();
    let model = fixture("mixtral-moe-tiny");
    let run = generate(&dir, model.to_str().unwrap(), &["--quantize", "4"]);
    // mlx_lm.convert of the same weights to 4-bit group 64 made the reference.
    let want = greedy_text("mixtral-moe-tiny-4bit-g64");
    assert_eq!(run.stdout(), want, "{}", run.describe());
    // The cache's slots are sized from the experts as loaded (quantized here, with the
    // checkpoint's bf16 as their scale dtype), not from a config without a quantization block.
    let cached = generate(&dir, model.to_str().unwrap(), &["--quantize", "4", "--expert-slots", "2"]);
    assert_eq!(cached.stdout(), want, "--expert-slots 2 changed the text{}", cached.describe());
}

#[test]
fn a_checkpoint_with_fewer_experts_than_its_config_exits_2_naming_the_router() {
    let dir = Dir::new();
    let src = fixture("qwen2-moe-tiny-4bit");
    let broken = dir.path().join("broken");
    std::fs::create_dir(&broken).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, broken.join(path.file_name().unwrap())).unwrap();
    }
    let config_path = broken.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["num_experts"] = 5.into();
    std::fs::write(&config_path, config.to_string()).unwrap();
    let model = broken.to_str().unwrap();
    for args in
        [&["generate", "-m", model, "-p", "hi"][..], &["estimate", "-m", model, "--prompt-tokens", "4"][..]]
    {
        let run = dir.run(args).expect_code(2);
        assert!(
            run.stderr().contains("tensor model.layers.0.mlp.gate.weight has shape [4, 8], expected [5, 8]"),
            "{}",
            run.describe()
        );
    }
}

fn field(run: &Run, key: &str) -> u64 {
    run.json().get(key).and_then(|v| v.as_u64()).unwrap_or_else(|| panic!("{key} missing{}", run.describe()))
}

#[test]
fn estimate_prices_moe_checkpoints_at_bench_decodes_peak() {
    let dir = Dir::new();
    let stacked = fixture("qwen3-moe-tiny-4bit");
    let per_expert = fixture("mixtral-moe-tiny");
    let (stacked, per_expert) = (stacked.to_str().unwrap(), per_expert.to_str().unwrap());
    let cases: &[(&str, &[&str])] = &[
        (stacked, &[]),
        (stacked, &["--expert-slots", "2"]),
        (stacked, &["--expert-slots", "16"]),
        (per_expert, &["--quantize", "4"]),
        (per_expert, &["--quantize", "4", "--expert-slots", "3"]),
    ];
    for &(model, extra) in cases {
        let mut est = vec!["estimate", "-m", model, "--prompt-tokens", "20", "-n", "6"];
        est.extend_from_slice(extra);
        let est = dir.run(&est).expect_code(0);
        let mut bench = vec!["bench-decode", "-m", model, "--prompt-tokens", "20", "-n", "6"];
        bench.extend_from_slice(extra);
        let bench = dir.run(&bench).expect_code(0);
        let both = format!("{}{}", est.describe(), bench.describe());
        assert_eq!(field(&est, "weights_bytes"), field(&bench, "weights_bytes"), "{both}");
        let (total, peak) = (field(&est, "total_bytes"), field(&bench, "peak_bytes"));
        if extra.first() == Some(&"--quantize") {
            // Quantizing on load holds a chunk of widened rows beside the weights; the
            // estimate counts it as part of the weights, so it bounds the peak (as for a
            // dense checkpoint quantized on load) rather than equalling it.
            assert!(total >= peak, "estimate {total} below the peak {peak}{both}");
        } else {
            assert_eq!(total, peak, "{both}");
        }
        if let Some(at) = extra.iter().position(|&a| a == "--expert-slots") {
            let slots: u64 = extra[at + 1].parse().unwrap();
            assert_eq!(field(&est, "expert_slots"), slots, "{both}");
            assert_eq!(field(&est, "experts_bytes"), slots * field(&est, "expert_slot_bytes"), "{both}");
        }
    }
}
