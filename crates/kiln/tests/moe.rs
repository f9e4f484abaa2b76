//! Mixture-of-experts models through the real binary: `--expert-slots` on generate,
//! bench-decode and estimate; the cache changes no token, estimate prices it exactly, and
//! an illegal geometry exits 2 naming the geometry, the rule and the cap.

// Shared with the other binary tests; not every helper is used here.
#[allow(dead_code)]
mod util;

use util::Dir;

fn generate(extra: &[&str]) -> String {
    let mut args = vec!["generate", "-m", "synthetic:tiny-qwen2-moe", "-p", "Mixture of experts", "-n", "20"];
    args.extend_from_slice(extra);
    let run = Dir::new().run(&args);
    assert!(run.output.status.success(), "{}", run.describe());
    run.stdout()
}

#[test]
fn generate_gives_the_same_text_with_any_legal_expert_cache() {
    let all = generate(&[]);
    for slots in ["2", "5", "16"] {
        assert_eq!(generate(&["--expert-slots", slots]), all, "--expert-slots {slots}");
    }
}

#[test]
fn bench_decode_reports_the_cache_and_estimate_prices_it_exactly() {
    let dir = Dir::new();
    let args = ["-m", "synthetic:tiny-moe", "--prompt-tokens", "12", "-n", "6", "--expert-slots", "4"];
    let bench = dir.run(&[&["bench-decode"][..], &args[..]].concat()).expect_code(0);
    let b = bench.json();
    let estimate = dir.run(&[&["estimate"][..], &args[..]].concat()).expect_code(0);
    let e = estimate.json();
    let without =
        dir.run(&["estimate", "-m", "synthetic:tiny-moe", "--prompt-tokens", "12", "-n", "6"]).expect_code(0);
    let w = without.json();
    let u = |m: &serde_json::Map<String, serde_json::Value>, k: &str| {
        m[k].as_u64().unwrap_or_else(|| panic!("{k} is not a count in {m:?}"))
    };
    assert_eq!(u(&b, "expert_slots"), 4);
    assert!(u(&b, "expert_misses") > 0 && u(&b, "expert_bytes_copied") > 0, "{}", bench.describe());
    assert_eq!(u(&b["peak_breakdown"].as_object().unwrap().clone(), "experts"), u(&b, "expert_cache_bytes"));
    assert_eq!(u(&b, "peak_bytes"), u(&e, "total_bytes"), "{}", bench.describe());
    assert_eq!(u(&e, "experts_bytes"), u(&b, "expert_cache_bytes"));
    assert_eq!(u(&e, "total_bytes") - u(&w, "total_bytes"), u(&e, "experts_bytes"));
    assert!(w.get("experts_bytes").is_none(), "no cache, no expert fields: {w:?}");
}

#[test]
fn an_illegal_geometry_exits_2_naming_the_geometry_the_rule_and_the_cap() {
    let dir = Dir::new();
    let base = ["bench-decode", "-m", "synthetic:tiny-moe", "--prompt-tokens", "8", "-n", "4"];
    let run = |extra: &[&str]| dir.run(&[&base[..], extra].concat()).expect_code(2);
    let floor = run(&["--expert-slots", "1"]);
    assert!(
        floor.stderr().contains("synthetic:tiny-moe @ cache_slots=1: 1 is below the floor of top-k = 2"),
        "{}",
        floor.describe()
    );
    let total = run(&["--expert-slots", "17"]);
    assert!(total.stderr().contains("layers x experts = 2 x 8 = 16"), "{}", total.describe());
    // A limit that holds the weights and a few slots: the cap comes from it.
    let cap = run(&["--expert-slots", "16", "--memory-limit", "420000"]);
    let err = cap.stderr();
    assert!(err.contains("cache_slots=16: 16 exceeds the cpu backend's slot limit of"), "{}", cap.describe());
    assert!(err.contains("memory limit") && err.contains("per slot"), "{}", cap.describe());
    let dense =
        dir.run(&["generate", "-m", "synthetic:tiny", "-p", "x", "--expert-slots", "2"]).expect_code(2);
    assert!(dense.stderr().contains("not a quantized mixture-of-experts model"), "{}", dense.describe());
}

#[test]
fn bench_expert_copy_measures_one_geometry_and_refuses_an_illegal_one_by_rule() {
    let dir = Dir::new();
    let run = |slots: &str, rate: &str| {
        dir.run(&[
            "bench-expert-copy",
            "-m",
            "synthetic:tiny-moe",
            "--expert-slots",
            slots,
            "--batch-size",
            "3",
            "--miss-rate",
            rate,
            "--steps",
            "4",
            "--min-time-ms",
            "60000",
            "--bandwidth-bytes",
            "8MiB",
        ])
    };
    let parse = |r: &util::Run| {
        kiln_protocol::OffloadCopyReport::parse(&r.stdout())
            .unwrap_or_else(|e| panic!("{e}{}", r.describe()))
            .unwrap_or_else(|| panic!("no report{}", r.describe()))
    };
    let none = run("6", "0").expect_code(0);
    let r = parse(&none);
    assert_eq!((r.cache_slots, r.layers, r.experts, r.top_k, r.steps, r.tokens), (6, 2, 8, 2, 4, 12));
    assert_eq!((r.misses, r.bytes_copied, r.copy_gb_s), (0, 0, None));
    assert_eq!(r.fetches, 4 * 2 * 3 * 2, "steps x layers x rows x top-k");
    assert!(r.read_bandwidth_gb_s > 0.0);
    let all = run("6", "1").expect_code(0);
    let r = parse(&all);
    assert_eq!((r.hits, r.measured_miss_rate), (0, 1.0));
    assert!(r.bytes_copied > 0 && r.bytes_copied <= r.misses * r.slot_bytes, "{}", all.describe());
    assert!(r.copy_gb_s.is_some_and(|g| g > 0.0) && r.copy_share.is_some());
    let refused = run("1", "0.5").expect_code(2);
    let err = refused.stderr();
    assert!(err.contains(kiln_protocol::GEOMETRY_REFUSED), "{}", refused.describe());
    assert!(err.contains("synthetic:tiny-moe @ cache_slots=1"), "{}", refused.describe());
    assert!(refused.stdout().trim().is_empty());
}

#[test]
fn a_dense_draft_model_runs_beside_an_expert_cache() {
    // --expert-slots sizes the target's cache; the drafter keeps its own weights resident.
    let args = ["--expert-slots", "3", "--speculative", "--model-draft", "synthetic:tiny-draft"];
    let run = Dir::new().run(
        &[&["generate", "-m", "synthetic:tiny-moe", "-p", "Hello there", "-n", "12"][..], &args[..]].concat(),
    );
    assert!(run.output.status.success(), "{}", run.describe());
}
