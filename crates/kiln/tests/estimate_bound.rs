//! `kiln estimate` against `kiln bench-decode`'s measured pool peak, over several
//! synthetic shapes, prompt lengths, generation lengths, chunkings and cache types: the
//! estimate must equal the measured peak, byte for byte, with streaming and with naive
//! attention, as docs/cli.md says.

mod util;

use util::{Dir, Run};

fn field(run: &Run, key: &str) -> u64 {
    run.json().get(key).and_then(|v| v.as_u64()).unwrap_or_else(|| panic!("{key} missing{}", run.describe()))
}

/// Runs both commands with `args` and asserts the estimate is the peak.
fn measure(dir: &Dir, model: &str, prompt: usize, max_tokens: usize, extra: &[&str]) {
    let (p, n) = (prompt.to_string(), max_tokens.to_string());
    let mut est_args = vec!["estimate", "-m", model, "--prompt-tokens", &p, "-n", &n];
    est_args.extend_from_slice(extra);
    let est = dir.run(&est_args).expect_code(0);
    let mut bench_args = vec!["bench-decode", "-m", model, "--prompt-tokens", &p, "-n", &n];
    bench_args.extend_from_slice(extra);
    let bench = dir.run(&bench_args).expect_code(0);
    let (total, peak) = (field(&est, "total_bytes"), field(&bench, "peak_bytes"));
    assert_eq!(
        field(&est, "weights_bytes"),
        field(&bench, "weights_bytes"),
        "{}{}",
        est.describe(),
        bench.describe()
    );
    assert_eq!(total, field(&bench, "estimated_peak_bytes"), "{}{}", est.describe(), bench.describe());
    assert_eq!(
        total,
        peak,
        "estimate {total} and measured peak {peak} differ{}{}",
        est.describe(),
        bench.describe()
    );
}

#[test]
fn streaming_estimates_equal_the_peak() {
    let dir = Dir::new();
    let cases: &[(&str, usize, usize, &[&str])] = &[
        ("synthetic:tiny", 1, 1, &[]),
        ("synthetic:tiny", 100, 8, &[]),
        ("synthetic:tiny", 250, 10, &[]),
        ("synthetic:tiny", 300, 4, &["--prefill-chunk", "64"]),
        ("synthetic:tiny", 700, 3, &["--prefill-chunk", "100"]),
        ("synthetic:tiny", 511, 2, &["--kv-dtype", "f32"]),
        ("synthetic:tiny@8bit", 40, 5, &["--prefill-chunk", "7"]),
        ("synthetic:tiny-qwen", 257, 3, &[]),
        ("synthetic:tiny-qwen", 600, 2, &["--prefill-chunk", "256"]),
    ];
    for &(model, prompt, max_tokens, extra) in cases {
        measure(&dir, model, prompt, max_tokens, extra);
    }
}

#[test]
fn naive_estimates_equal_the_peak() {
    let dir = Dir::new();
    let cases: &[(&str, usize, usize, &[&str])] = &[
        ("synthetic:tiny", 300, 4, &["--attention", "naive"]),
        ("synthetic:tiny", 600, 4, &["--attention", "naive", "--prefill-chunk", "128"]),
        ("synthetic:tiny-qwen", 900, 2, &["--attention", "naive"]),
        // Prompt and generated tokens end in a second cache block.
        ("synthetic:tiny", 250, 20, &["--attention", "naive"]),
    ];
    for &(model, prompt, max_tokens, extra) in cases {
        measure(&dir, model, prompt, max_tokens, extra);
    }
}

#[test]
fn every_profile_can_be_estimated_without_loading() {
    let dir = Dir::new();
    // Weight sizes near the mlx-community 4-bit conversions of the same models.
    let expect: &[(&str, f64, f64)] = &[
        ("synthetic:smollm-135m", 0.05e9, 0.12e9),
        ("synthetic:qwen2.5-0.5b", 0.25e9, 0.30e9),
        ("synthetic:llama-3.2-1b", 0.6e9, 0.8e9),
        ("synthetic:qwen2.5-7b", 4.0e9, 4.6e9),
        ("synthetic:llama-3.1-8b", 4.2e9, 4.7e9),
        ("synthetic:llama-3.1-8b@8bit", 8.0e9, 9.0e9),
    ];
    for &(model, lo, hi) in expect {
        let run = dir.run(&["estimate", "-m", model, "--prompt-tokens", "2048", "-n", "128"]).expect_code(0);
        let w = field(&run, "weights_bytes") as f64;
        assert!(w > lo && w < hi, "{model}: {w} bytes of weights{}", run.describe());
        assert!(field(&run, "kv_bytes") > 0 && field(&run, "scratch_bytes") > 0);
    }
}
