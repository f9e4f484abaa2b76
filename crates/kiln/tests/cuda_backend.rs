//! `--backend cuda` end to end through the real `kiln` binary. Without the `cuda` feature
//! the flag is refused by name (exit 2). With it (CI's cuda group builds it), the device
//! forward runs through the host execution of its kernels (`KILN_CUDA_EMULATE=1`, no GPU
//! needed): bench-decode's record is the device pool's, `estimate --backend cuda` equals
//! its peak, a smaller limit is exit 3 with `out of memory:`, greedy text equals the CPU's,
//! and what the device forward does not run is exit 2 naming it.

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
    let run = dir.run(&["serve", "-m", "synthetic:tiny", "--backend", "cuda"]).expect_code(2);
    assert!(run.stderr().contains("kiln serve runs on the cpu backend only"), "{}", run.describe());
    let copy = ["bench-expert-copy", "-m", "synthetic:tiny-moe", "--expert-slots", "4", "--backend", "cuda"];
    let run = dir.run(&copy).expect_code(2);
    assert!(
        run.stderr().contains("kiln bench-expert-copy runs on the cpu backend only"),
        "{}",
        run.describe()
    );
    let run = dir.run_env(&base, &[("KILN_CUDA_EMULATE", "yes")]).expect_code(2);
    assert!(run.stderr().contains("invalid KILN_CUDA_EMULATE"), "{}", run.describe());
    // The device runs f16 activations: a scheme asked for was silently ignored.
    for scheme in ["int8", "int16", "f32"] {
        let run = dir.run_env(&base, &[EMULATE[0], ("KILN_ACT_PRECISION", scheme)]).expect_code(2);
        let says = format!("invalid KILN_ACT_PRECISION={scheme} with --backend cuda");
        assert!(run.stderr().contains(&says), "{}", run.describe());
    }
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
