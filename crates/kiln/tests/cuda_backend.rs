//! `--backend cuda` end to end through the real `kiln` binary. Without the `cuda` feature
//! the flag is refused by name (exit 2). With it (CI's cuda group builds it), the device
//! forward runs through the host execution of its kernels (`KILN_CUDA_EMULATE=1`, no GPU
//! needed): bench-decode's record is the device pool's, `estimate --backend cuda` equals
//! its peak, a smaller limit is exit 3 with `out of memory:`, greedy text equals the CPU's
//! (from `generate`, `score` and `kiln serve`, whose batched forwards and prompt cache run
//! on the device), and what the device forward does not run is exit 2 naming it, from the
//! one capability check.

#[cfg(feature = "cuda")]
#[path = "../../kiln-serve/tests/client/mod.rs"]
mod client;
// Shared with the other binary tests; not every helper is used here.
#[cfg(feature = "cuda")]
#[allow(dead_code)]
mod common;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod util;

use util::Dir;

#[cfg(not(feature = "cuda"))]
#[test]
fn a_build_without_the_feature_refuses_backend_cuda_naming_the_feature() {
    let dir = Dir::new();
    for cmd in ["bench-decode", "estimate", "generate"] {
        let mut args = vec![cmd, "-m", "synthetic:tiny", "--backend", "cuda"];
        args.extend(if cmd == "generate" { ["-p", "hi"] } else { ["--prompt-tokens", "8"] });
        let run = dir.run(&args).expect_code(2);
        assert!(run.stderr().contains("built without the `cuda` feature"), "{}", run.describe());
    }
}

#[cfg(feature = "cuda")]
const EMULATE: [(&str, &str); 1] = [("KILN_CUDA_EMULATE", "1")];

#[cfg(feature = "cuda")]
#[test]
fn bench_decode_on_the_device_reports_the_device_pool_and_estimate_equals_its_peak() {
    let dir = Dir::new();
    let bench = ["bench-decode", "-m", "synthetic:tiny-qwen", "--backend", "cuda", "--prompt-tokens", "40"];
    let flags = ["-n", "6", "--prefill-chunk", "16"];
    let args: Vec<&str> = bench.iter().chain(&flags).copied().collect();
    let run = dir.run_env(&args, &EMULATE).expect_code(0);
    let r = run.json();
    assert_eq!(r["backend"], "cuda", "{}", run.describe());
    let peak = r["peak_bytes"].as_u64().unwrap();
    assert_eq!(r["estimated_peak_bytes"].as_u64(), Some(peak), "{}", run.describe());
    assert_eq!(r["decode_steps"].as_u64(), Some(5));
    assert!(r["qmv_wide"].is_null(), "no CPU kernel ran");
    let est = ["estimate", "-m", "synthetic:tiny-qwen", "--backend", "cuda", "--prompt-tokens", "40"];
    let args: Vec<&str> = est.iter().chain(&flags).copied().collect();
    let e = dir.run(&args).expect_code(0);
    assert_eq!(e.json()["total_bytes"].as_u64(), Some(peak), "estimate == peak{}", e.describe());
    let breakdown = &r["peak_breakdown"];
    assert_eq!(breakdown["kv"].as_u64(), e.json()["kv_bytes"].as_u64());
    assert_eq!(breakdown["weights"].as_u64(), e.json()["weights_bytes"].as_u64());

    // One byte under the plan: exit 3, the pool's line first.
    let limit = (peak - 1).to_string();
    let args: Vec<&str> =
        bench.iter().chain(&flags).copied().chain(["--memory-limit", limit.as_str()]).collect();
    let run = dir.run_env(&args, &EMULATE).expect_code(3);
    let first = run.stderr().lines().find(|l| !l.starts_with("kiln:")).unwrap_or_default().to_string();
    assert!(first.starts_with("out of memory:"), "{}", run.describe());
    let args: Vec<&str> =
        est.iter().chain(&flags).copied().chain(["--memory-limit", limit.as_str()]).collect();
    assert_eq!(dir.run(&args).expect_code(0).json()["fits"], false);
}

#[cfg(feature = "cuda")]
#[test]
fn greedy_generation_on_the_device_writes_the_cpus_text() {
    let dir = Dir::new();
    let args = ["generate", "-m", "synthetic:tiny", "-p", "the kiln", "-n", "12"];
    let cpu = dir.run(&args).expect_code(0);
    let with: Vec<&str> = args.iter().copied().chain(["--backend", "cuda"]).collect();
    let dev = dir.run_env(&with, &EMULATE).expect_code(0);
    assert!(!cpu.stdout().trim().is_empty());
    assert_eq!(dev.stdout(), cpu.stdout(), "{}", dev.describe());
}

#[cfg(feature = "cuda")]
#[test]
fn what_the_device_forward_does_not_run_is_exit_2_naming_it() {
    let dir = Dir::new();
    let base = ["bench-decode", "-m", "synthetic:tiny", "--backend", "cuda", "--prompt-tokens", "8"];
    for (extra, says) in [
        (&["--speculative"][..], "--speculative"),
        (&["--attention", "naive"][..], "--attention naive"),
        (&["--kv-dtype", "f32"][..], "--kv-dtype f32"),
    ] {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let run = dir.run_env(&args, &EMULATE).expect_code(2);
        assert!(run.stderr().contains(says), "{}", run.describe());
    }
    let run = dir
        .run_env(
            &["bench-decode", "-m", "synthetic:tiny-moe", "--backend", "cuda", "--prompt-tokens", "8"],
            &EMULATE,
        )
        .expect_code(2);
    assert!(run.stderr().contains("does not run a mixture-of-experts model"), "{}", run.describe());
    let run =
        dir.run(&["serve", "-m", "synthetic:tiny", "--backend", "cuda", "--speculative"]).expect_code(2);
    assert!(
        run.stderr().contains("invalid --speculative with --backend cuda: the cuda backend does not run it"),
        "{}",
        run.describe()
    );
    let copy = ["bench-expert-copy", "-m", "synthetic:tiny-moe", "--expert-slots", "4", "--backend", "cuda"];
    let run = dir.run(&copy).expect_code(2);
    assert!(run.stderr().contains("invalid --expert-slots with --backend cuda"), "{}", run.describe());
    let run = dir.run_env(&base, &[("KILN_CUDA_EMULATE", "yes")]).expect_code(2);
    assert!(run.stderr().contains("invalid KILN_CUDA_EMULATE"), "{}", run.describe());
    // The device runs f16 activations: a scheme asked for was silently ignored.
    for scheme in ["int8", "int16", "f32"] {
        let run = dir.run_env(&base, &[EMULATE[0], ("KILN_ACT_PRECISION", scheme)]).expect_code(2);
        let says = format!("invalid KILN_ACT_PRECISION={scheme} with --backend cuda");
        assert!(run.stderr().contains(&says), "{}", run.describe());
        assert!(run.stderr().contains("its products run f16"), "{}", run.describe());
    }
    // The scheme the device runs is accepted by name, and the CPU refuses it by name.
    let run = dir.run_env(&base, &[EMULATE[0], ("KILN_ACT_PRECISION", "f16")]).expect_code(0);
    assert_eq!(run.json()["act_scheme"], "f16", "{}", run.describe());
    let cpu = ["bench-decode", "-m", "synthetic:tiny", "--prompt-tokens", "8"];
    let run = dir.run_env(&cpu, &[("KILN_ACT_PRECISION", "f16")]).expect_code(2);
    assert!(run.stderr().contains("invalid KILN_ACT_PRECISION=f16 with --backend cpu"), "{}", run.describe());
    assert_eq!(dir.run(&cpu).expect_code(0).json()["act_scheme"], "int16");
}

#[cfg(feature = "cuda")]
#[test]
fn scoring_on_the_device_writes_the_cpus_log_probabilities_within_f16_rounding() {
    let dir = Dir::new();
    let text = dir.path().join("text.txt");
    std::fs::write(
        &text,
        "the potters sealed the kiln door with bricks and mud, then lit the fire ".repeat(8),
    )
    .unwrap();
    let text = text.to_str().unwrap();
    let mut summaries = Vec::new();
    for (backend, out) in [("cpu", "cpu.bin"), ("cuda", "cuda.bin")] {
        let out = dir.path().join(out);
        let args = [
            "score",
            "-m",
            "synthetic:tiny-qwen",
            "--text-file",
            text,
            "--window",
            "32",
            "--first-scored",
            "8",
            "--max-windows",
            "3",
            "--output",
            out.to_str().unwrap(),
            "--backend",
            backend,
        ];
        let run = dir.run_env(&args, &EMULATE).expect_code(0);
        summaries.push(run.json());
    }
    let (cpu, dev) = (&summaries[0], &summaries[1]);
    assert_eq!(cpu["positions"], dev["positions"]);
    assert_eq!(dev["act_precision"], "f16");
    let (a, b) = (cpu["mean_nll"].as_f64().unwrap(), dev["mean_nll"].as_f64().unwrap());
    // f16 activations against the CPU's int16 codes: the mean differs by rounding only.
    assert!((a - b).abs() < 0.02 * a.abs().max(1.0), "cpu {a} vs device {b}");
}

#[cfg(feature = "cuda")]
#[test]
fn serve_on_the_device_batches_streams_and_shares_prefixes_with_the_cpus_greedy_text() {
    use client::post;
    use serde_json::json;
    let prompt = "The potters sealed the door with bricks and mud, and the kiln";
    let body =
        json!({"model": "synthetic:tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "n": 3});
    let cpu = common::Serve::start(&["-m", "synthetic:tiny", "--threads", "1"]);
    let want = post(cpu.addr, "/v1/completions", &body);
    assert_eq!(want.status, 200, "{}", want.body);
    let dev =
        common::Serve::start_env(&["-m", "synthetic:tiny", "--backend", "cuda", "--parallel", "4"], &EMULATE);
    let log = dev.log();
    assert!(
        log.iter().any(|l| l.contains("kernel configuration: isa=cuda") && l.contains("act=f16")),
        "{}",
        dev.stderr()
    );
    // Three choices share one prompt: one prefills, the others copy its device cache;
    // their rows decode together in one forward.
    let got = post(dev.addr, "/v1/completions", &body);
    assert_eq!(got.status, 200, "{}{}", got.body, dev.stderr());
    let (w, g) = (want.json(), got.json());
    for i in 0..3 {
        assert_eq!(g["choices"][i]["text"], w["choices"][0]["text"], "choice {i}{}", dev.stderr());
    }
    assert!(g["system_fingerprint"].as_str().unwrap().ends_with("-cuda"), "{g}");
    // The same prompt again: its prefix comes from the prompt cache, in device memory.
    let again = post(dev.addr, "/v1/completions", &body);
    assert_eq!(again.status, 200, "{}{}", again.body, dev.stderr());
    let a = again.json();
    assert!(a["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) > 0, "{a}");
    assert_eq!(a["choices"][0]["text"], w["choices"][0]["text"], "{a}");
    // Past the device pool: the request fails with an error body, the server keeps serving.
    let huge = json!({"model": "synthetic:tiny", "prompt": prompt, "max_tokens": 900});
    let small = common::Serve::start_env(
        &["-m", "synthetic:tiny", "--backend", "cuda", "--memory-limit", "4MiB"],
        &EMULATE,
    );
    let r = post(small.addr, "/v1/completions", &huge);
    assert_eq!(r.status, 503, "{}{}", r.body, small.stderr());
    assert!(r.body.contains("past the memory limit of 4194304 bytes"), "{}", r.body);
    let again = post(
        small.addr,
        "/v1/completions",
        &json!({"model": "synthetic:tiny", "prompt": "hi", "max_tokens": 4}),
    );
    assert_eq!(again.status, 200, "{}{}", again.body, small.stderr());
}

#[cfg(feature = "cuda")]
#[test]
fn without_a_driver_or_emulation_backend_cuda_is_exit_2_saying_so() {
    if kiln_cuda_driver_present() {
        return;
    }
    let dir = Dir::new();
    let run = dir
        .run(&["bench-decode", "-m", "synthetic:tiny", "--backend", "cuda", "--prompt-tokens", "8"])
        .expect_code(2);
    assert!(run.stderr().contains("no CUDA driver was found"), "{}", run.describe());
}

#[cfg(feature = "cuda")]
fn kiln_cuda_driver_present() -> bool {
    std::path::Path::new("/proc/driver/nvidia/version").exists()
}
