//! The sweep on a CUDA backend without a GPU: the real `cargo xtask` driving a stand-in
//! `kiln` that logs its arguments, so what the harness passes to every engine call, and
//! what its rows say about where they ran, is checked on a CPU host.

// Shared with the sweep tests; not every helper is used here.
#[allow(dead_code)]
mod util;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use util::{Run, Sandbox};

/// One line `kiln estimate` prints: the peak, the limit and whether it fits.
fn estimate_json(total: u64, limit: Option<u64>) -> String {
    let fits = limit.is_none_or(|l| total <= l);
    let limit = limit.map_or("null".to_string(), |l| l.to_string());
    format!(
        r#"{{"model":"fake","model_path":"fake","prompt_tokens":64,"max_tokens":6,"weights_bytes":{total},"kv_bytes":0,"scratch_bytes":0,"total_bytes":{total},"memory_limit_bytes":{limit},"fits":{fits},"context_length":4096,"attention":"streaming","prefill_chunk":0,"within_context":true}}"#
    )
}

/// A stand-in `kiln` whose `estimate` prints `estimate` and whose `bench-decode` prints a
/// report on `backend`; every call's arguments are appended to `<name>.calls`.
fn logging_kiln(sb: &Sandbox, name: &str, estimate: &str, backend: &str) -> (PathBuf, PathBuf) {
    let path = sb.path(name);
    let calls = sb.path(&format!("{name}.calls"));
    let decode = format!(
        r#"{{"model":"fake","model_path":"fake","prompt_tokens":64,"generated_tokens":6,"prefill_ms":10.0,"prefill_tok_s":6400.0,"decode_ms":5.0,"decode_tok_s":800.0,"peak_bytes":1000,"peak_breakdown":{{"weights":600,"kv":300,"scratch":100,"other":0}},"max_rss_bytes":5000,"startup_ms":1.0,"first_token_ms":11.0,"backend":"{backend}","threads":1,"kiln_version":"0.1.0","attention":"streaming","prefill_chunk":0,"memory_limit_bytes":null}}"#
    );
    let script = format!(
        "#!/bin/sh\necho \"$@\" >> '{}'\ncase \"$1\" in\n  estimate) echo '{estimate}' ;;\n  bench-decode) echo '{decode}' ;;\n  *) exit 1 ;;\nesac\n",
        calls.display()
    );
    fs::write(&path, script).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
    (path, calls)
}

fn decode(sb: &Sandbox, kiln: &Path, backend: &str, env: &[(&str, &str)]) -> Run {
    sb.run_with(
        "bench-decode",
        &[
            "--kiln-bin",
            kiln.to_str().unwrap(),
            "--backend",
            backend,
            "--models",
            "fake",
            "--prompt-tokens",
            "64",
            "--max-tokens",
            "6",
            "--warmup-tokens",
            "1",
        ],
        env,
    )
}

#[test]
fn every_engine_call_gets_the_cuda_backend_and_a_cpu_run_passes_nothing_extra() {
    let sb = Sandbox::new();
    let (kiln, calls) = logging_kiln(&sb, "kiln", &estimate_json(100, None), "cuda");
    let run = decode(&sb, &kiln, "cuda", &[]);
    run.expect_code(0);
    let log = fs::read_to_string(&calls).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines.len(), 2, "{log}{run}");
    assert!(lines[0].starts_with("estimate ") && lines[1].starts_with("bench-decode "), "{log}");
    for l in &lines {
        assert!(l.contains(" --backend cuda"), "{l:?} lacks --backend cuda{run}");
    }
    let rows = sb.rows(&sb.csv());
    assert_eq!(rows[0].get("backend"), "cuda", "{run}");

    // On the CPU nothing is added: an older kiln (bisect's builds) knows no --backend.
    fs::remove_file(&calls).unwrap();
    let (cpu_kiln, cpu_calls) = logging_kiln(&sb, "kiln-cpu", &estimate_json(100, None), "cpu");
    let run = decode(&sb, &cpu_kiln, "cpu", &[]);
    run.expect_code(0);
    let log = fs::read_to_string(&cpu_calls).unwrap();
    assert_eq!(log.lines().count(), 2, "{log}{run}");
    assert!(!log.contains("--backend"), "{log}");
}

/// A directory holding a stand-in `nvidia-smi` that prints the H200 answers of
/// `xtask/src/fixtures/nvidia-smi/`, and the PATH that finds it first.
fn fake_gpu(sb: &Sandbox) -> String {
    let bin = sb.path("gpu-bin");
    fs::create_dir_all(&bin).unwrap();
    let query = bin.join("query.csv");
    let table = bin.join("table.txt");
    fs::write(&query, include_str!("../src/fixtures/nvidia-smi/h200-query.csv")).unwrap();
    fs::write(&table, include_str!("../src/fixtures/nvidia-smi/h200.txt")).unwrap();
    let smi = bin.join("nvidia-smi");
    let script = format!(
        "#!/bin/sh\ncase \"$1\" in\n  --query-gpu=name,memory.total,driver_version) cat '{}' ;;\n  '') cat '{}' ;;\n  *) exit 6 ;;\nesac\n",
        query.display(),
        table.display()
    );
    fs::write(&smi, script).unwrap();
    fs::set_permissions(&smi, fs::Permissions::from_mode(0o755)).unwrap();
    format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default())
}

/// The run directory's env.json.
fn env_json(sb: &Sandbox) -> serde_json::Value {
    let runs: Vec<_> = fs::read_dir(sb.path("runs")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    serde_json::from_str(&fs::read_to_string(runs[0].join("env.json")).unwrap()).unwrap()
}

#[test]
fn on_a_gpu_the_rows_name_the_gpu_its_driver_and_cuda_and_the_host_execution_never_does() {
    let sb = Sandbox::new();
    let path = fake_gpu(&sb);
    let (kiln, _) = logging_kiln(&sb, "kiln", &estimate_json(100, None), "cuda");
    let run = decode(&sb, &kiln, "cuda", &[("PATH", &path)]);
    run.expect_code(0);
    let rows = sb.rows(&sb.csv());
    let r = &rows[0];
    assert_eq!(
        (r.get("device"), r.get("backend"), r.get("driver_version"), r.get("cuda_version")),
        ("cuda:NVIDIA H200 (143771 MiB)", "cuda", "580.95.05", "13.0"),
        "{run}"
    );
    assert!(!run.stdout.contains("host execution"), "a GPU's figures are not the host's{run}");
    let env = env_json(&sb);
    assert_eq!(env["gpus"][0], "NVIDIA H200 (143771 MiB)");
    assert_eq!(
        (env["driver_version"].as_str(), env["cuda_version"].as_str()),
        (Some("580.95.05"), Some("13.0"))
    );

    // The CPU backend on the same machine: its rows carry no GPU software.
    let sb = Sandbox::new();
    let path = fake_gpu(&sb);
    let (kiln, _) = logging_kiln(&sb, "kiln", &estimate_json(100, None), "cpu");
    let run = decode(&sb, &kiln, "cpu", &[("PATH", &path)]);
    run.expect_code(0);
    let r = &sb.rows(&sb.csv())[0];
    assert!(r.get("device").starts_with("cpu:"), "{run}");
    assert_eq!((r.get("driver_version"), r.get("cuda_version")), ("", ""), "{run}");

    // KILN_CUDA_EMULATE: the CUDA kernels run on the host, so the device is the CPU's,
    // whatever GPU the machine has.
    let sb = Sandbox::new();
    let path = fake_gpu(&sb);
    let (kiln, _) = logging_kiln(&sb, "kiln", &estimate_json(100, None), "cuda");
    let run = decode(&sb, &kiln, "cuda", &[("PATH", &path), ("KILN_CUDA_EMULATE", "1")]);
    run.expect_code(0);
    let r = &sb.rows(&sb.csv())[0];
    assert!(r.get("device").starts_with("cuda:host execution on "), "{run}");
    assert!(!r.get("device").contains("H200"), "{run}");
    assert_eq!((r.get("driver_version"), r.get("cuda_version")), ("", ""), "{run}");
    // The terminal summary says whose figures they are, before any of them.
    let first = run.stdout.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    assert!(
        first.starts_with("figures are the CUDA kernels' host execution on ")
            && first.ends_with(", not a GPU (KILN_CUDA_EMULATE=1)"),
        "{run}"
    );
}

#[test]
fn on_a_gpu_the_estimate_pre_skip_prices_the_gpus_memory_or_a_smaller_limit() {
    const GIB: u64 = 1 << 30;
    // 100 GiB: above the engine's host-side limit (fits false), within the H200's 140 GiB.
    let sb = Sandbox::new();
    let path = fake_gpu(&sb);
    let (kiln, calls) = logging_kiln(&sb, "kiln", &estimate_json(100 * GIB, Some(24 * GIB)), "cuda");
    let run = decode(&sb, &kiln, "cuda", &[("PATH", &path)]);
    run.expect_code(0);
    assert_eq!(sb.rows(&sb.csv())[0].get("status"), "ok", "{run}");
    assert_eq!(fs::read_to_string(&calls).unwrap().lines().count(), 2, "the cell did not run{run}");
    assert_eq!(env_json(&sb)["device_budget_bytes"], 143771u64 << 20);

    // 200 GiB with no limit the engine knows of: above the GPU's memory, not launched.
    let sb = Sandbox::new();
    let path = fake_gpu(&sb);
    let (kiln, calls) = logging_kiln(&sb, "kiln", &estimate_json(200 * GIB, None), "cuda");
    let run = decode(&sb, &kiln, "cuda", &[("PATH", &path)]);
    // Nothing was measured, so the run exits 1.
    run.expect_code(1).expect_stderr("(the memory of NVIDIA H200 (143771 MiB))");
    let r = &sb.rows(&sb.csv())[0];
    assert_eq!(r.get("status"), "SKIP:oom_estimate", "{run}");
    assert_eq!(fs::read_to_string(&calls).unwrap().lines().count(), 1, "the cell ran{run}");

    // KILN_MEMORY_LIMIT below the GPU's memory is the budget.
    let sb = Sandbox::new();
    let path = fake_gpu(&sb);
    let (kiln, _) = logging_kiln(&sb, "kiln", &estimate_json(2 * GIB, None), "cuda");
    let run = decode(&sb, &kiln, "cuda", &[("PATH", &path), ("KILN_MEMORY_LIMIT", "1GiB")]);
    run.expect_code(1).expect_stderr(&format!("above the budget of {GIB} bytes (the memory limit"));
    let r = &sb.rows(&sb.csv())[0];
    assert_eq!(
        (r.get("status"), r.get("device")),
        ("SKIP:oom_estimate", "cuda:NVIDIA H200 (143771 MiB) limit 1GiB"),
        "{run}"
    );

    // The CPU backend on the same machine keeps the engine's verdict.
    let sb = Sandbox::new();
    let path = fake_gpu(&sb);
    let (kiln, _) = logging_kiln(&sb, "kiln", &estimate_json(100 * GIB, Some(24 * GIB)), "cpu");
    let run = decode(&sb, &kiln, "cpu", &[("PATH", &path)]);
    run.expect_code(1);
    assert_eq!(sb.rows(&sb.csv())[0].get("status"), "SKIP:oom_estimate", "{run}");
    assert!(env_json(&sb)["device_budget_bytes"].is_null());
}

#[test]
fn a_device_out_of_memory_is_recorded_on_the_gpu_and_pre_skips_it_next_time() {
    let sb = Sandbox::new();
    let path = fake_gpu(&sb);
    let estimate = estimate_json(100, None);
    let line = "out of memory: requested 1.00 KiB (1024 bytes) for kv with 0 B (0 bytes) in use, limit 1.00 KiB (1024 bytes)";
    let bench = format!("echo 'error: {line}' >&2; exit 3");
    let kiln = util::fake_kiln(&sb, "kiln-oom", &format!("echo '{estimate}'; exit 0"), &bench);
    let run = decode(&sb, &kiln, "cuda", &[("PATH", &path)]);
    run.expect_code(1);
    let lines = sb.record_lines();
    assert_eq!(lines.len(), 1, "{run}");
    assert!(lines[0].ends_with(",cuda:NVIDIA H200 (143771 MiB)"), "{lines:?}{run}");
    // The next run on that GPU is pre-skipped; the same cells under the host execution
    // are another device and run.
    let run = decode(&sb, &kiln, "cuda", &[("PATH", &path)]);
    run.expect_stderr("SKIP:oom_record");
    let run = decode(&sb, &kiln, "cuda", &[("PATH", &path), ("KILN_CUDA_EMULATE", "1")]);
    assert!(!run.stderr.contains("SKIP:oom_record"), "{run}");
    assert_eq!(sb.record_lines().len(), 2, "{run}");
    assert!(sb.record_lines()[1].contains(",cuda:host execution on "), "{run}");
}

#[test]
fn auto_picks_cuda_on_a_machine_with_an_nvidia_driver_when_kiln_declares_the_feature() {
    let sb = Sandbox::new();
    let path = fake_gpu(&sb);
    // A checkout whose kiln package declares `cuda`, with its release binary already
    // built (--no-build): a stand-in that logs its calls.
    let ws = sb.path("checkout");
    fs::create_dir_all(ws.join("kiln/src")).unwrap();
    fs::write(ws.join("Cargo.toml"), "[workspace]\nmembers = [\"kiln\"]\nresolver = \"2\"\n").unwrap();
    fs::write(
        ws.join("kiln/Cargo.toml"),
        "[package]\nname = \"kiln\"\nversion = \"0.9.0\"\nedition = \"2021\"\n\n[features]\ncuda = []\n",
    )
    .unwrap();
    fs::write(ws.join("kiln/src/main.rs"), "fn main() {}\n").unwrap();
    let (stand_in, calls) = logging_kiln(&sb, "kiln", &estimate_json(100, None), "cuda");
    fs::create_dir_all(ws.join("target/release")).unwrap();
    fs::copy(&stand_in, ws.join("target/release/kiln")).unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_xtask"));
    cmd.args(["bench-decode", "--no-build", "--models", "fake", "--prompt-tokens", "64"])
        .args(["--max-tokens", "6", "--warmup-tokens", "1", "--output"])
        .arg(sb.csv())
        .arg("--oom-record")
        .arg(sb.record())
        .arg("--runs-dir")
        .arg(sb.path("runs"))
        .current_dir(&ws)
        .env("PATH", &path)
        .env_remove("CARGO_TARGET_DIR");
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("KILN_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd.output().unwrap();
    let run = Run {
        cmd: format!("{cmd:?}"),
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    run.expect_code(0).expect_stderr("(cuda); device cuda:NVIDIA H200 (143771 MiB)");
    let r = &sb.rows(&sb.csv())[0];
    assert_eq!(
        (r.get("backend"), r.get("features"), r.get("driver_version"), r.get("cuda_version")),
        ("cuda", "cuda", "580.95.05", "13.0"),
        "{run}"
    );
    let log = fs::read_to_string(&calls).unwrap();
    assert!(log.lines().count() == 2 && log.lines().all(|l| l.contains("--backend cuda")), "{log}{run}");
}

#[test]
fn a_kiln_cuda_emulate_the_engine_would_refuse_is_refused_before_anything_runs() {
    let sb = Sandbox::new();
    let (kiln, calls) = logging_kiln(&sb, "kiln", &estimate_json(100, None), "cuda");
    let run = decode(&sb, &kiln, "cuda", &[("KILN_CUDA_EMULATE", "yes")]);
    run.expect_code(2).expect_stderr("invalid KILN_CUDA_EMULATE \"yes\": accepted values are 0 and 1");
    assert!(!calls.exists() && !sb.csv().exists(), "{run}");
}

#[test]
fn the_host_execution_gets_the_cpu_ladder_and_a_gpu_the_gpu_ladder() {
    for (emulate, first) in [
        (true, "estimate -m synthetic:tiny --prompt-tokens 128 "),
        (false, "estimate -m synthetic:qwen2.5-0.5b --prompt-tokens 512 "),
    ] {
        let sb = Sandbox::new();
        let path = fake_gpu(&sb);
        let (kiln, calls) = logging_kiln(&sb, "kiln", &estimate_json(100, None), "cuda");
        let mut env = vec![("PATH", path.as_str())];
        if emulate {
            env.push(("KILN_CUDA_EMULATE", "1"));
        }
        let run = sb.run_with(
            "bench-longprompt",
            &["--kiln-bin", kiln.to_str().unwrap(), "--backend", "cuda"],
            &env,
        );
        run.expect_code(0);
        let log = fs::read_to_string(&calls).unwrap();
        assert!(log.starts_with(first), "emulated {emulate}: {log}{run}");
    }
}

/// [`estimate_json`] with the adapter `kiln estimate --backend vulkan` names: a GPU with
/// 8 GiB of device-local memory.
fn estimate_on_adapter(total: u64) -> String {
    let device = r#""device":{"name":"Test GPU","backend":"vulkan","driver":"testdrv","driver_info":"Test 1.0","device_type":"DiscreteGpu","memory_bytes":8589934592,"memory_source":"the Vulkan device-local heap"}"#;
    let limit = 8u64 << 30;
    let json = estimate_json(total, Some(limit));
    format!("{},{device}}}", json.strip_suffix('}').unwrap())
}

#[test]
fn on_vulkan_the_rows_name_the_adapter_and_its_driver_and_its_memory_is_the_pre_skip_budget() {
    const GIB: u64 = 1 << 30;
    let sb = Sandbox::new();
    let (kiln, calls) = logging_kiln(&sb, "kiln", &estimate_on_adapter(4 * GIB), "vulkan");
    let run = decode(&sb, &kiln, "vulkan", &[]);
    run.expect_code(0);
    let r = &sb.rows(&sb.csv())[0];
    assert_eq!(
        (r.get("status"), r.get("device"), r.get("driver_version"), r.get("cuda_version")),
        ("ok", "vulkan:Test GPU (8 GiB)", "Test 1.0", ""),
        "{run}"
    );
    assert_eq!(env_json(&sb)["device_budget_bytes"], 8u64 << 30);
    // The adapter is asked once, before the cells, with the sweep's backend.
    let log = fs::read_to_string(&calls).unwrap();
    assert!(log.lines().next().unwrap().starts_with("estimate -m synthetic:tiny "), "{log}");
    assert!(log.lines().next().unwrap().ends_with("--backend vulkan"), "{log}");

    // 16 GiB: above the adapter's memory, not launched, and the reason names it.
    let sb = Sandbox::new();
    let (kiln, calls) = logging_kiln(&sb, "kiln", &estimate_on_adapter(16 * GIB), "vulkan");
    let run = decode(&sb, &kiln, "vulkan", &[]);
    run.expect_code(1).expect_stderr("(the memory of Test GPU)");
    assert_eq!(sb.rows(&sb.csv())[0].get("status"), "SKIP:oom_estimate", "{run}");
    assert!(!fs::read_to_string(&calls).unwrap().contains("bench-decode"), "the cell ran{run}");

    // An engine that cannot name its adapter stops the sweep before any cell, in its words.
    let sb = Sandbox::new();
    let refusal = "error: invalid --backend vulkan: this kiln was built without the `vulkan` feature";
    let kiln = util::fake_kiln(&sb, "kiln-plain", &format!("echo '{refusal}' >&2; exit 2"), "exit 1");
    let run = decode(&sb, &kiln, "vulkan", &[]);
    run.expect_code(2)
        .expect_stderr(&format!("--backend vulkan: the engine did not name its vulkan adapter: {refusal}"));
    assert!(!sb.csv().exists() || sb.rows(&sb.csv()).is_empty(), "{run}");
}
