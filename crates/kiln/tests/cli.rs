//! The `kiln` binary's contract: exit codes, the JSON and CSV records of bench-decode and
//! estimate, and generate's output.

mod util;

use std::io::Read;
use std::process::Stdio;

use util::{Dir, Run};

fn u64_field(run: &Run, map: &serde_json::Map<String, serde_json::Value>, key: &str) -> u64 {
    map.get(key)
        .and_then(|v| v.as_u64())
        .unwrap_or_else(|| panic!("{key} is not an integer{}", run.describe()))
}

fn f64_field(run: &Run, map: &serde_json::Map<String, serde_json::Value>, key: &str) -> f64 {
    map.get(key).and_then(|v| v.as_f64()).unwrap_or_else(|| panic!("{key} is not a number{}", run.describe()))
}

#[test]
fn bench_decode_prints_every_protocol_field() {
    let dir = Dir::new();
    let run = dir
        .run(&[
            "bench-decode",
            "-m",
            "synthetic:tiny",
            "--prompt-tokens",
            "37",
            "-n",
            "9",
            "--warmup-tokens",
            "2",
        ])
        .expect_code(0);
    let j = run.json();
    // Every field the protocol crate lists, kiln's additions included.
    for key in kiln_protocol::DECODE_FIELDS.into_iter().chain(["peak_breakdown"]) {
        assert!(j.contains_key(key), "missing {key}{}", run.describe());
    }
    assert_eq!(j["model"], "synthetic:tiny");
    assert_eq!(j["model_path"], "synthetic:tiny");
    assert_eq!(u64_field(&run, &j, "prompt_tokens"), 37);
    assert_eq!(u64_field(&run, &j, "generated_tokens"), 9);
    assert_eq!(u64_field(&run, &j, "decode_steps"), 6);
    assert_eq!(j["backend"], "cpu");
    assert_eq!(j["attention"], "streaming");
    assert_eq!(j["kiln_version"], env!("CARGO_PKG_VERSION"));
    for key in ["prefill_ms", "prefill_tok_s", "decode_ms", "decode_tok_s", "startup_ms"] {
        assert!(f64_field(&run, &j, key) > 0.0, "{key} must be positive{}", run.describe());
    }
    assert!(f64_field(&run, &j, "first_token_ms") >= f64_field(&run, &j, "startup_ms"), "{}", run.describe());
    let peak = u64_field(&run, &j, "peak_bytes");
    let breakdown = j["peak_breakdown"].as_object().expect("peak_breakdown is an object");
    let sum: u64 = ["weights", "kv", "scratch", "other"]
        .iter()
        .map(|t| breakdown.get(*t).and_then(|v| v.as_u64()).expect("a count per tag"))
        .sum();
    assert_eq!(sum, peak, "{}", run.describe());
    assert_eq!(breakdown["weights"].as_u64(), j["weights_bytes"].as_u64());
    assert!(breakdown["kv"].as_u64() > Some(0));
    assert!(u64_field(&run, &j, "max_rss_bytes") > peak);
    assert!(u64_field(&run, &j, "bytes_read_per_token") > 0);
    assert!(j["read_bandwidth_bytes_per_s"].is_null() && j["decode_bandwidth_share"].is_null());
    assert!(!j.contains_key("roofs"), "roofs only when asked{}", run.describe());
    assert!(u64_field(&run, &j, "threads") >= 1);
}

#[test]
fn bench_decode_measures_the_roofs_when_asked() {
    let dir = Dir::new();
    let args = ["bench-decode", "-m", "synthetic:tiny", "--prompt-tokens", "16", "-n", "3", "--threads", "1"];
    let run = dir.run(&[&args[..], &["--measure-roofs"]].concat()).expect_code(0);
    let j = run.json();
    let probes: Vec<&str> = kiln_core::roofs::available().iter().map(|p| p.as_str()).collect();
    if probes.is_empty() {
        // A CPU none of the probes runs on: the bandwidth is measured, no roofs reported.
        assert!(!j.contains_key("roofs") && f64_field(&run, &j, "read_bandwidth_bytes_per_s") > 0.0);
        return;
    }
    let r = j["roofs"].as_object().unwrap_or_else(|| panic!("no roofs{}", run.describe()));
    let measured: Vec<&str> = r["compute_probes"].as_object().unwrap().keys().map(String::as_str).collect();
    let mut want = probes.clone();
    want.sort_unstable();
    assert_eq!(measured, want, "every probe this CPU runs, no other{}", run.describe());
    // Synthetic weights are quantized: the prefill is held to the best int8 roof.
    let roof = r["compute_roof"].as_str().unwrap();
    assert!(roof.starts_with("int8_") && probes.contains(&roof), "{roof}");
    let f = |k: &str| f64_field(&run, r, k);
    let best_int8 = r["compute_probes"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.starts_with("int8_"))
        .map(|(_, v)| v.as_f64().unwrap())
        .fold(0.0, f64::max);
    assert_eq!(f("compute_roof_ops_per_s"), best_int8);
    assert!(f("prefill_ops") > f("prefill_attention_ops") && f("prefill_attention_ops") > 0.0);
    // The shares are the record's own figures divided, nothing else.
    let prefill_s = f64_field(&run, &j, "prefill_ms") / 1e3;
    assert!((f("prefill_ops_per_s") * prefill_s / f("prefill_ops") - 1.0).abs() < 1e-6, "{}", run.describe());
    assert!(
        (f("prefill_compute_share") - f("prefill_ops_per_s") / f("compute_roof_ops_per_s")).abs() < 1e-12
    );
    assert_eq!(f("read_bandwidth_bytes_per_s"), f64_field(&run, &j, "read_bandwidth_bytes_per_s"));
    assert_eq!(f("decode_bandwidth_share"), f64_field(&run, &j, "decode_bandwidth_share"));
    assert_eq!(f("decode_bytes_per_token"), f64_field(&run, &j, "bytes_read_per_token"));
    assert!(run.stderr().contains("roofs (1 thread(s)): compute "), "{}", run.describe());
    // The CSV form keeps its columns.
    let csv = dir.run(&[&args[..], &["--measure-roofs", "--format", "csv"]].concat()).expect_code(0);
    let header: Vec<String> = csv.stdout().lines().next().unwrap().split(',').map(String::from).collect();
    assert_eq!(header, kiln_protocol::DECODE_FIELDS, "{}", csv.describe());
}

#[test]
fn bench_decode_csv_is_a_header_and_one_row() {
    let dir = Dir::new();
    let run = dir
        .run(&["bench-decode", "-m", "synthetic:tiny", "--prompt-tokens", "8", "-n", "3", "--format", "csv"])
        .expect_code(0);
    let out = run.stdout();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{}", run.describe());
    let header: Vec<&str> = lines[0].split(',').collect();
    assert_eq!(header, kiln_protocol::DECODE_FIELDS, "{}", run.describe());
    assert_eq!(lines[1].split(',').count(), header.len(), "{}", run.describe());
}

#[test]
fn threads_memory_limit_and_prompt_text_are_honoured() {
    let dir = Dir::new();
    let run = dir
        .run(&[
            "bench-decode",
            "-m",
            "synthetic:tiny-qwen",
            "-p",
            "hello, kiln",
            "-n",
            "2",
            "--threads",
            "1",
            "--memory-limit",
            "64MiB",
            "--attention",
            "naive",
            "--prefill-chunk",
            "4",
        ])
        .expect_code(0);
    let j = run.json();
    // The byte tokenizer: BOS plus one token per byte.
    assert_eq!(u64_field(&run, &j, "prompt_tokens"), 12);
    assert_eq!(u64_field(&run, &j, "threads"), 1);
    assert_eq!(u64_field(&run, &j, "memory_limit_bytes"), 64 << 20);
    assert_eq!(j["attention"], "naive");
    assert_eq!(u64_field(&run, &j, "prefill_chunk"), 4);
    // The environment variable sets the limit when the flag is absent.
    let env = [("KILN_MEMORY_LIMIT", "3MiB")];
    let run = dir.run_env(&["estimate", "-m", "synthetic:tiny", "--prompt-tokens", "8"], &env).expect_code(0);
    let j = run.json();
    assert_eq!(u64_field(&run, &j, "memory_limit_bytes"), 3 << 20, "{}", run.describe());
}

#[test]
fn a_missing_model_is_exit_2_naming_the_path() {
    let dir = Dir::new();
    let run = dir.run(&["bench-decode", "-m", "models/no-such-model", "--prompt-tokens", "8", "-n", "2"]);
    let run = run.expect_code(2);
    assert!(run.stderr().contains("no-such-model"), "{}", run.describe());
    assert!(run.stdout().is_empty(), "{}", run.describe());
    let run = dir.run(&["estimate", "-m", "/nowhere/at/all", "--prompt-tokens", "8"]).expect_code(2);
    assert!(run.stderr().contains("/nowhere/at/all"), "{}", run.describe());
    let run = dir.run(&["estimate", "-m", "synthetic:huge", "--prompt-tokens", "8"]).expect_code(2);
    assert!(run.stderr().contains("qwen2.5-0.5b"), "the accepted profiles are listed{}", run.describe());
}

#[test]
fn bad_arguments_are_exit_2() {
    let dir = Dir::new();
    let cases: &[&[&str]] = &[
        &["bench-decode", "-m", "synthetic:tiny", "--prompt-tokens", "8", "--no-such-flag"],
        &["bench-decode", "-m", "synthetic:tiny"],
        &["bench-decode", "-m", "synthetic:tiny", "--prompt-tokens", "8", "--attention", "flash"],
        &["bench-decode", "-m", "synthetic:tiny", "--prompt-tokens", "eight"],
        &["bench-decode", "-m", "synthetic:tiny", "--prompt-tokens", "8", "--memory-limit", "lots"],
        &["bench-decode", "-m", "synthetic:tiny", "--prompt-tokens", "8", "-n", "3", "--warmup-tokens", "2"],
        &["bench-decode", "-m", "synthetic:tiny", "--prompt-tokens", "0"],
        &["bench-decode", "-m", "synthetic:tiny", "--prompt-tokens", "8", "--threads", "0"],
        &["generate", "-m", "synthetic:tiny", "-p", "x", "--top-p", "1.5"],
        &["estimate", "-m", "synthetic:tiny"],
    ];
    for args in cases {
        let run = dir.run(args).expect_code(2);
        assert!(!run.stderr().is_empty(), "{}", run.describe());
    }
    let run =
        dir.run(&["bench-decode", "-m", "synthetic:tiny", "--prompt-tokens", "8", "--memory-limit", "lots"]);
    assert!(run.stderr().contains("lots") && run.stderr().contains("MiB"), "{}", run.describe());
}

#[test]
fn a_run_beyond_the_context_is_exit_2_and_estimate_flags_it() {
    let dir = Dir::new();
    // tiny's context is 1024 positions.
    let run = dir.run(&["bench-decode", "-m", "synthetic:tiny", "--prompt-tokens", "1000", "-n", "30"]);
    let run = run.expect_code(2);
    assert!(run.stderr().contains("1030") && run.stderr().contains("1024"), "{}", run.describe());
    let run =
        dir.run(&["estimate", "-m", "synthetic:tiny", "--prompt-tokens", "1000", "-n", "30"]).expect_code(0);
    let j = run.json();
    assert_eq!(j["within_context"], false);
    assert_eq!(u64_field(&run, &j, "context_length"), 1024);
}

#[test]
fn a_small_memory_limit_is_exit_3_with_the_pools_message() {
    let dir = Dir::new();
    for limit in ["100KiB", "300KiB"] {
        let run = dir.run(&[
            "bench-decode",
            "-m",
            "synthetic:tiny",
            "--prompt-tokens",
            "64",
            "-n",
            "4",
            "--memory-limit",
            limit,
        ]);
        let run = run.expect_code(3);
        assert!(run.stderr().lines().any(|l| l.starts_with("out of memory:")), "{}", run.describe());
        assert!(run.stdout().is_empty(), "{}", run.describe());
    }
    // The estimate says the same run does not fit.
    let run = dir.run(&[
        "estimate",
        "-m",
        "synthetic:tiny",
        "--prompt-tokens",
        "64",
        "-n",
        "4",
        "--memory-limit",
        "300KiB",
    ]);
    assert_eq!(run.expect_code(0).json()["fits"], false);
}

#[test]
fn help_documents_the_exit_codes() {
    let dir = Dir::new();
    for args in [&["--help"][..], &["bench-decode", "--help"][..]] {
        let run = dir.run(args).expect_code(0);
        let out = run.stdout();
        assert!(out.contains("Exit status") && out.contains("out of memory:"), "{}", run.describe());
        for code in ["0  success", "1  anything else", "2  bad arguments", "3  out of memory"] {
            assert!(out.contains(code), "missing {code:?}{}", run.describe());
        }
    }
}

#[test]
fn generate_is_reproducible_with_a_seed() {
    let dir = Dir::new();
    let args = |seed: &'static str| {
        [
            "generate",
            "-m",
            "synthetic:tiny",
            "-p",
            "The kiln",
            "-n",
            "24",
            "--temperature",
            "0.9",
            "--top-k",
            "50",
            "--seed",
            seed,
        ]
    };
    let a = dir.run(&args("1")).expect_code(0);
    let b = dir.run(&args("1")).expect_code(0);
    let c = dir.run(&args("2")).expect_code(0);
    assert_eq!(a.output.stdout, b.output.stdout, "{}{}", a.describe(), b.describe());
    assert_ne!(a.output.stdout, c.output.stdout, "{}{}", a.describe(), c.describe());
    assert!(a.stderr().contains("tok/s"), "{}", a.describe());
    // Greedy needs no seed and is reproducible too.
    let g1 = dir
        .run(&["generate", "-m", "synthetic:tiny", "-p", "x", "-n", "8", "--no-chat-template"])
        .expect_code(0);
    let g2 = dir.run(&["generate", "-m", "synthetic:tiny", "-p", "x", "-n", "8"]).expect_code(0);
    assert_eq!(g1.output.stdout, g2.output.stdout);
}

#[test]
fn a_closed_stdout_ends_generate_quietly() {
    let dir = Dir::new();
    let mut child = dir
        .command(&["generate", "-m", "synthetic:tiny", "-p", "x", "-n", "1000", "--temperature", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting kiln");
    drop(child.stdout.take());
    let mut stderr = String::new();
    child.stderr.take().expect("stderr").read_to_string(&mut stderr).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "stderr: {stderr}");
    assert!(!stderr.contains("panicked") && !stderr.contains("error"), "stderr: {stderr}");
}

#[test]
fn checkpoints_resolve_by_path_and_under_models() {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../kiln-model/tests/fixtures/models/llama3-tiny-4bit-g64")
        .canonicalize()
        .expect("the 4-bit llama fixture checkpoint");
    let dir = Dir::new();
    std::fs::create_dir(dir.path().join("models")).unwrap();
    std::os::unix::fs::symlink(&fixture, dir.path().join("models/llama-fixture")).unwrap();
    let path = fixture.to_str().expect("a UTF-8 path");
    for model in ["llama-fixture", "models/llama-fixture", path] {
        let run = dir.run(&["bench-decode", "-m", model, "--prompt-tokens", "12", "-n", "3"]).expect_code(0);
        let j = run.json();
        assert_eq!(j["model"], model);
        assert_eq!(u64_field(&run, &j, "prompt_tokens"), 12);
        let est = dir.run(&["estimate", "-m", model, "--prompt-tokens", "12", "-n", "3"]).expect_code(0);
        assert!(
            u64_field(&est, &est.json(), "total_bytes") >= u64_field(&run, &j, "peak_bytes"),
            "{}{}",
            est.describe(),
            run.describe()
        );
    }
    let run = dir.run(&["generate", "-m", "models/llama-fixture", "-p", "hi", "-n", "4"]).expect_code(0);
    assert!(run.stderr().contains("generated"), "{}", run.describe());
}

/// `kiln export-tokenizer` writes both files for a synthetic model, a checkpoint and a GGUF
/// file; the checkpoint's tokenizer is the one it ships; a rerun replaces them leaving no
/// temporary file; an output that is not a directory, or a file in it that is not a
/// regular file, is refused with exit 2.
#[test]
fn export_tokenizer_writes_hugging_face_files_for_every_kind_of_model() {
    let dir = Dir::new();
    let read = |p: std::path::PathBuf| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
            .unwrap()
    };
    let out = dir.path().join("tiny");
    let run = dir.run(&["export-tokenizer", "synthetic:tiny", out.to_str().unwrap()]).expect_code(0);
    assert!(run.stdout().contains("tokenizer.json"), "{}", run.describe());
    let tk = read(out.join("tokenizer.json"));
    assert_eq!(tk["model"]["type"], "BPE");
    assert_eq!(tk["model"]["vocab"].as_object().unwrap().len(), 512, "synthetic:tiny's vocabulary");
    let config = read(out.join("tokenizer_config.json"));
    assert_eq!(config["bos_token"], "<s>");
    assert_eq!(config["model_max_length"], 1024);
    assert!(config["chat_template"].as_str().unwrap().contains("assistant: "), "{config}");
    // Replaced on a rerun, nothing left behind.
    dir.run(&["export-tokenizer", "synthetic:tiny", out.to_str().unwrap()]).expect_code(0);
    let names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");

    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../kiln-model/tests/fixtures");
    let ckpt = fixtures.join("models/llama3-tiny");
    let out = dir.path().join("llama3");
    dir.run(&["export-tokenizer", ckpt.to_str().unwrap(), out.to_str().unwrap()]).expect_code(0);
    let (ours, theirs) = (read(out.join("tokenizer.json")), read(ckpt.join("tokenizer.json")));
    assert_eq!(ours["model"]["vocab"], theirs["model"]["vocab"]);
    assert_eq!(
        ours["model"]["merges"].as_array().map(Vec::len),
        theirs["model"]["merges"].as_array().map(Vec::len)
    );
    assert_eq!(ours["added_tokens"], theirs["added_tokens"]);
    let config = read(out.join("tokenizer_config.json"));
    assert!(config["chat_template"].as_str().is_some_and(|t| t.contains("start_header_id")), "{config}");
    let gguf = fixtures.join("gguf/qwen2-tiny.gguf");
    let out = dir.path().join("qwen2");
    dir.run(&["export-tokenizer", gguf.to_str().unwrap(), out.to_str().unwrap()]).expect_code(0);
    assert_eq!(read(out.join("tokenizer.json"))["model"]["type"], "BPE");

    // Refusals: DIR a regular file, a FIFO where a file goes; both left as they were.
    let file = dir.path().join("a-file");
    std::fs::write(&file, "keep").unwrap();
    let run = dir.run(&["export-tokenizer", "synthetic:tiny", file.to_str().unwrap()]).expect_code(2);
    assert!(run.stderr().contains("not a directory"), "{}", run.describe());
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep");
    let fifo_dir = dir.path().join("fifo");
    std::fs::create_dir(&fifo_dir).unwrap();
    std::fs::write(fifo_dir.join("tokenizer.json"), "old").unwrap();
    let fifo = fifo_dir.join("tokenizer_config.json");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let run = dir.run(&["export-tokenizer", "synthetic:tiny", fifo_dir.to_str().unwrap()]).expect_code(2);
    assert!(run.stderr().contains("not a regular file"), "{}", run.describe());
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
    // Nothing was written: the other target is checked before either file is.
    assert_eq!(std::fs::read_to_string(fifo_dir.join("tokenizer.json")).unwrap(), "old");
}
