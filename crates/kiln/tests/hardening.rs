//! Hostile input to the real `kiln` binary: counts that overflow, configs that parse but
//! cannot be built, unbounded threads, degenerate sampling, odd files and environment.
//! Every case must end with a clear error (exit 2 naming the input) or a correct result,
//! never a panic, an abort, a hang or a wrapped number.

mod util;

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use util::{Dir, Run};

const MAX: &str = "18446744073709551615";

/// The committed 4-bit llama checkpoint.
fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../kiln-model/tests/fixtures/models/llama3-tiny-4bit-g64")
        .canonicalize()
        .expect("the 4-bit llama fixture checkpoint")
}

/// A copy of the fixture under `dir/name` (files linked) whose `config.json` is `edit`ed.
fn checkpoint_with(dir: &Dir, name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let src = fixture();
    let dst = dir.path().join(name);
    std::fs::create_dir_all(&dst).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "config.json" {
            std::os::unix::fs::symlink(entry.path(), dst.join(entry.file_name())).unwrap();
        }
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dst.join("config.json"), config.to_string()).unwrap();
    dst
}

/// Asserts exit 2, nothing on stdout, and every needle in stderr.
fn refused(run: Run, needles: &[&str]) -> Run {
    let run = run.expect_code(2);
    assert!(run.stdout().is_empty(), "a refused run prints no record{}", run.describe());
    for n in needles {
        assert!(run.stderr().contains(n), "stderr lacks {n:?}{}", run.describe());
    }
    assert!(!run.stderr().contains("panicked"), "{}", run.describe());
    run
}

/// Runs `kiln ARGS` and fails the test if it has not finished within `limit`.
fn run_within(dir: &Dir, args: &[&str], limit: Duration) -> std::process::Output {
    let mut child =
        dir.command(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("starting kiln");
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!(
                "kiln {} still running after {limit:?}\nstderr: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn overflowing_counts_are_exit_2_naming_the_flag() {
    let dir = Dir::new();
    let m = "synthetic:tiny";
    let cases: &[(&[&str], &[&str])] = &[
        (&["generate", "-m", m, "-p", "hi", "-n", MAX], &["--max-tokens", MAX]),
        (&["bench-decode", "-m", m, "--prompt-tokens", MAX, "-n", "1"], &["--prompt-tokens", MAX]),
        (&["bench-decode", "-m", m, "-p", "hello", "-n", MAX], &["--max-tokens", MAX]),
        (&["bench-decode", "-m", m, "--prompt-tokens", "1", "-n", MAX], &["--max-tokens", MAX]),
        (
            &["bench-decode", "-m", m, "--prompt-tokens", "8", "-n", "4", "--warmup-tokens", MAX],
            &["--warmup-tokens", MAX],
        ),
        (
            &["bench-decode", "-m", m, "--prompt-tokens", "8", "-n", MAX, "--warmup-tokens", MAX],
            &["--max-tokens"],
        ),
        (&["estimate", "-m", m, "--prompt-tokens", MAX], &["--prompt-tokens", MAX]),
        (&["estimate", "-m", m, "--prompt-tokens", "1", "-n", MAX], &["--max-tokens", MAX]),
        // 2^62 tokens: the sum fits, the bytes do not.
        (
            &["estimate", "-m", m, "--prompt-tokens", "4611686018427387904"],
            &["--prompt-tokens", "4611686018427387904", "overflows"],
        ),
        (
            &["estimate", "-m", m, "--prompt-tokens", "4611686018427387904", "--attention", "naive"],
            &["--prompt-tokens", "overflows"],
        ),
    ];
    for (args, needles) in cases {
        refused(dir.run(args), needles);
    }
    // -n alone beyond tiny's 1024-position context fails before the model is built.
    refused(dir.run(&["bench-decode", "-m", m, "-p", "hello", "-n", "5000"]), &["1024"]);
}

#[test]
fn estimates_of_huge_runs_are_closed_form_and_do_not_fit() {
    let dir = Dir::new();
    // 10^12 naive prompt tokens in chunks of one: a loop per chunk would run for minutes.
    let args =
        ["estimate", "-m", "synthetic:tiny", "--prompt-tokens", "1000000000000", "--attention", "naive"];
    let mut with_chunk = args.to_vec();
    with_chunk.extend(["--prefill-chunk", "1", "--memory-limit", "1GiB"]);
    let out = run_within(&dir, &with_chunk, Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(0), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["fits"], false, "{j}");
    assert_eq!(j["within_context"], false, "{j}");
    // tiny: 4 heads; the largest score matrix is the last decode step's, 4 * (10^12 + 128).
    assert_eq!(j["attention_scores_bytes"].as_u64(), Some(4 * 4 * 1_000_000_000_128), "{j}");
    let total = j["total_bytes"].as_u64().unwrap();
    let parts = ["weights_bytes", "kv_bytes", "scratch_bytes"].map(|k| j[k].as_u64().unwrap());
    assert_eq!(total, parts.iter().sum::<u64>(), "{j}");
}

#[test]
fn threads_beyond_the_bound_are_refused() {
    let dir = Dir::new();
    let base = ["generate", "-m", "synthetic:tiny", "-p", "hi", "-n", "2"];
    for n in ["100000", MAX] {
        let mut args = base.to_vec();
        args.extend(["--threads", n]);
        refused(dir.run(&args), &["--threads", n, "per available CPU"]);
    }
    refused(
        dir.run(&["estimate", "-m", "synthetic:tiny", "--prompt-tokens", "4", "--threads", "100000"]),
        &["--threads"],
    );
    refused(dir.run_env(&base, &[("RAYON_NUM_THREADS", "100000")]), &["RAYON_NUM_THREADS"]);
    dir.run(&["generate", "-m", "synthetic:tiny", "-p", "hi", "-n", "2", "--threads", "2"]).expect_code(0);
}

#[test]
fn subnormal_temperatures_are_greedy() {
    let dir = Dir::new();
    let generate = |t: &str| {
        let run =
            dir.run(&["generate", "-m", "synthetic:tiny", "-p", "hello", "-n", "12", "--temperature", t]);
        run.expect_code(0).output.stdout
    };
    let greedy = generate("0");
    for t in ["1e-40", "1e-30", "1e-7"] {
        assert_eq!(generate(t), greedy, "temperature {t} must act as greedy");
    }
}

#[test]
fn configs_out_of_range_are_exit_2_naming_the_field_once() {
    let dir = Dir::new();
    let cases: &[(&str, serde_json::Value, &str)] = &[
        ("num_hidden_layers", 1_000_000_000u64.into(), "num_hidden_layers"),
        ("hidden_size", 0.into(), "hidden_size"),
        ("vocab_size", 0.into(), "vocab_size"),
        ("intermediate_size", (1u64 << 40).into(), "intermediate_size"),
        ("max_position_embeddings", 0.into(), "max_position_embeddings"),
        ("rope_theta", (-10000.0).into(), "rope_theta"),
        ("rms_norm_eps", (-1e-5).into(), "rms_norm_eps"),
        ("bits", ((1u64 << 32) + 4).into(), "quantization.bits"),
        ("group_size", (1u64 << 40).into(), "quantization.group_size"),
        ("low_freq_factor", 8.0.into(), "rope_scaling.high_freq_factor"),
    ];
    for (i, (field, value, named)) in cases.iter().enumerate() {
        let ck = checkpoint_with(&dir, &format!("ck{i}"), |c| match *field {
            "bits" | "group_size" => c["quantization"][field] = value.clone(),
            "low_freq_factor" => c["rope_scaling"][field] = value.clone(),
            _ => c[field] = value.clone(),
        });
        let path = ck.to_str().unwrap();
        for args in [
            vec!["estimate", "-m", path, "--prompt-tokens", "8"],
            vec!["bench-decode", "-m", path, "--prompt-tokens", "8", "-n", "2"],
            vec!["generate", "-m", path, "-p", "hi", "-n", "2"],
        ] {
            let run = refused(dir.run(&args), &[named, "config.json"]);
            let shown = value.to_string();
            let needle = format!("invalid {named}");
            assert_eq!(
                run.stderr().matches(&needle).count(),
                1,
                "the cause is printed once ({shown}){}",
                run.describe()
            );
        }
    }
}

#[test]
fn geometry_and_memory_limit_errors_print_their_cause_once() {
    let dir = Dir::new();
    // A group of 128 cannot divide the fixture's 64-wide rows.
    let ck = checkpoint_with(&dir, "g128", |c| c["quantization"]["group_size"] = 128.into());
    let run = refused(dir.run(&["estimate", "-m", ck.to_str().unwrap(), "--prompt-tokens", "8"]), &["128"]);
    let first_line = run.stderr().lines().find(|l| l.starts_with("error:")).unwrap_or_default().to_string();
    let words: Vec<&str> = first_line.split(": ").collect();
    let mut seen = std::collections::BTreeSet::new();
    for w in &words {
        assert!(seen.insert(*w), "{w:?} is printed twice{}", run.describe());
    }
    for env in ["12XB", "lots"] {
        let run = refused(
            dir.run_env(
                &["estimate", "-m", "synthetic:tiny", "--prompt-tokens", "8"],
                &[("KILN_MEMORY_LIMIT", env)],
            ),
            &["KILN_MEMORY_LIMIT", env],
        );
        assert_eq!(run.stderr().matches(env).count(), 1, "{}", run.describe());
    }
}

#[test]
fn a_non_utf8_memory_limit_is_an_error_naming_the_variable() {
    let dir = Dir::new();
    let mut cmd = dir.command(&["estimate", "-m", "synthetic:tiny", "--prompt-tokens", "8"]);
    cmd.env("KILN_MEMORY_LIMIT", std::ffi::OsStr::from_bytes(b"1\xffGiB"));
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("KILN_MEMORY_LIMIT") && stderr.contains("UTF-8"), "stderr: {stderr}");
    assert!(out.stdout.is_empty());
}

#[test]
fn an_empty_model_name_says_so() {
    let dir = Dir::new();
    for args in [
        &["generate", "-m", "", "-p", "hi"][..],
        &["estimate", "-m", "", "--prompt-tokens", "8"],
        &["bench-decode", "-m", " ", "--prompt-tokens", "8"],
    ] {
        let run = refused(dir.run(args), &["empty"]);
        assert!(!run.stderr().contains("not found"), "{}", run.describe());
    }
}

#[test]
fn a_fifo_model_file_is_named_without_blocking() {
    let dir = Dir::new();
    for file in ["tokenizer.json", "config.json", "model.safetensors.index.json"] {
        let ck = checkpoint_with(&dir, &format!("fifo-{}", file.replace('.', "-")), |_| {});
        let path = ck.join(file);
        std::fs::remove_file(&path).unwrap();
        let status = std::process::Command::new("mkfifo").arg(&path).status().expect("running mkfifo");
        assert!(status.success());
        let args = ["generate", "-m", ck.to_str().unwrap(), "-p", "hi", "-n", "2"];
        let out = run_within(&dir, &args, Duration::from_secs(30));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{file}: {stderr}");
        assert!(stderr.contains(file) && stderr.contains("FIFO"), "{file}: {stderr}");
        assert!(!stderr.contains("missing") && !stderr.contains("not found"), "{file}: {stderr}");
    }
}

#[test]
fn outputs_that_are_not_regular_files_are_refused_and_left_alone() {
    use std::os::unix::fs::FileTypeExt;
    let dir = Dir::new();
    let fifo = dir.path().join("out.fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().expect("running mkfifo").success());
    let text = dir.path().join("text.txt");
    std::fs::write(&text, "a few words of text to score, repeated. ".repeat(8)).unwrap();
    let t = text.to_str().unwrap();
    for out in [fifo.to_str().unwrap(), "/dev/null", dir.path().to_str().unwrap()] {
        let kind = if out == "/dev/null" {
            "a device"
        } else if out.ends_with("fifo") {
            "a FIFO"
        } else {
            "a directory"
        };
        let export =
            run_within(&dir, &["export-gguf", "synthetic:tiny-qwen@4bit-g32", out], Duration::from_secs(60));
        let score = run_within(
            &dir,
            &[
                "score",
                "-m",
                "synthetic:tiny",
                "--text-file",
                t,
                "--window",
                "16",
                "--first-scored",
                "8",
                "--output",
                out,
            ],
            Duration::from_secs(60),
        );
        for (what, run, flag) in [("export-gguf", export, "OUT.gguf"), ("score", score, "--output")] {
            let stderr = String::from_utf8_lossy(&run.stderr);
            assert_eq!(run.status.code(), Some(2), "{what} {out}: {stderr}");
            for n in [flag, out, kind, "expected a new path or a regular file"] {
                assert!(stderr.contains(n), "{what} {out}: stderr lacks {n:?}: {stderr}");
            }
        }
    }
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo(), "the FIFO was replaced");
    assert!(std::fs::metadata("/dev/null").unwrap().file_type().is_char_device());
    // Nothing was left beside them.
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left.len(), 2, "{left:?}");
}

#[test]
fn zero_and_negative_counts_are_exit_2_with_the_accepted_range() {
    let dir = Dir::new();
    refused(
        dir.run(&["generate", "-m", "synthetic:tiny", "-p", "hi", "-n", "0"]),
        &["invalid --max-tokens 0: accepted values are 1 or more"],
    );
    for (flag, args) in [
        ("--max-tokens", vec!["generate", "-m", "synthetic:tiny", "-p", "hi", "-n", "-1"]),
        ("--threads", vec!["generate", "-m", "synthetic:tiny", "-p", "hi", "--threads", "-1"]),
        ("--prompt-tokens", vec!["bench-decode", "-m", "synthetic:tiny", "--prompt-tokens", "-5"]),
        (
            "--window",
            vec!["score", "-m", "synthetic:tiny", "--text-file", "x", "--window", "-1", "--output", "o"],
        ),
    ] {
        let run =
            refused(dir.run(&args), &[flag, "is negative: accepted values are 0 to 18446744073709551615"]);
        assert!(!run.stderr().contains("unexpected argument"), "{}", run.describe());
    }
}

#[test]
fn a_config_json_symlink_loop_is_exit_2_naming_it() {
    let dir = Dir::new();
    let ck = checkpoint_with(&dir, "loop", |_| {});
    let config = ck.join("config.json");
    std::fs::remove_file(&config).unwrap();
    std::os::unix::fs::symlink(&config, &config).unwrap();
    for args in [
        vec!["generate", "-m", ck.to_str().unwrap(), "-p", "hi", "-n", "1"],
        vec!["estimate", "-m", ck.to_str().unwrap(), "--prompt-tokens", "4"],
        vec!["export-tokenizer", ck.to_str().unwrap(), dir.path().join("tok").to_str().unwrap()],
    ] {
        refused(dir.run(&args), &["config.json", "a symbolic link that cannot be followed"]);
    }
    // A model folder that is itself a looping link.
    let folder = dir.path().join("folder-loop");
    std::os::unix::fs::symlink(&folder, &folder).unwrap();
    let out = dir.path().join("tok2");
    refused(
        dir.run(&["export-tokenizer", folder.to_str().unwrap(), out.to_str().unwrap()]),
        &["a symbolic link that cannot be followed"],
    );
    assert!(!out.exists(), "a refused export created its DIR");
}

#[test]
fn export_tokenizer_of_a_file_or_into_a_file_is_exit_2_and_creates_nothing() {
    let dir = Dir::new();
    let file = dir.path().join("weights.bin");
    std::fs::write(&file, b"not a model").unwrap();
    let out = dir.path().join("tok");
    // MODEL a plain file (not a GGUF): its config.json was looked for under it.
    refused(
        dir.run(&["export-tokenizer", file.to_str().unwrap(), out.to_str().unwrap()]),
        &["weights.bin", "it is a file, not a GGUF file"],
    );
    assert!(!out.exists());
    // DIR under a file: no directory can be made there.
    let under = file.join("tok");
    refused(
        dir.run(&["export-tokenizer", "synthetic:tiny", under.to_str().unwrap()]),
        &["invalid DIR", "weights.bin/tok"],
    );
}

#[test]
fn every_command_refuses_a_bad_engine_variable_at_start() {
    let dir = Dir::new();
    let out = dir.path().join("tok");
    let gguf = dir.path().join("x.gguf");
    let commands: [Vec<&str>; 3] = [
        vec!["estimate", "-m", "synthetic:tiny", "--prompt-tokens", "4"],
        vec!["export-tokenizer", "synthetic:tiny", out.to_str().unwrap()],
        vec!["export-gguf", "synthetic:tiny", gguf.to_str().unwrap()],
    ];
    let cases: [(&str, &str, &str); 6] = [
        ("KILN_WEIGHT_LAYOUT", "bogus", "KILN_WEIGHT_LAYOUT"),
        ("KILN_ACT_PRECISION", "int3", "KILN_ACT_PRECISION"),
        ("KILN_QMV_CROSSOVER", "soon", "KILN_QMV_CROSSOVER"),
        ("KILN_CUDA_EMULATE", "yes", "KILN_CUDA_EMULATE"),
        ("KILN_SPEC_ALLOW_INEXACT", "maybe", "KILN_SPEC_ALLOW_INEXACT"),
        ("RAYON_NUM_THREADS", "abc", "RAYON_NUM_THREADS"),
    ];
    for args in &commands {
        for (name, value, needle) in cases {
            refused(dir.run_env(args, &[(name, value)]), &[needle]);
        }
    }
    assert!(!out.exists() && !gguf.exists(), "a refused export created its output");
    // Values the variables accept still run.
    dir.run_env(&commands[0], &[("RAYON_NUM_THREADS", "2"), ("KILN_WEIGHT_LAYOUT", "auto")]).expect_code(0);
}

#[test]
fn quantize_on_a_quantized_model_warns() {
    let dir = Dir::new();
    let fixture = fixture();
    for model in ["synthetic:tiny@4bit", fixture.to_str().unwrap()] {
        let run =
            dir.run(&["bench-decode", "-m", model, "--prompt-tokens", "8", "-n", "2", "--quantize", "8"]);
        let run = run.expect_code(0);
        assert!(run.stderr().contains("warning: --quantize 8 ignored"), "{}", run.describe());
        let run =
            dir.run(&["estimate", "-m", model, "--prompt-tokens", "8", "--quantize", "4"]).expect_code(0);
        assert!(run.stderr().contains("warning: --quantize 4 ignored"), "{}", run.describe());
        assert_eq!(run.json()["prompt_tokens"], 8, "the warning does not touch the record{}", run.describe());
    }
    // The unquantized fixture is quantized on load: no warning.
    let float = fixture.with_file_name("llama3-tiny");
    let run =
        dir.run(&["estimate", "-m", float.to_str().unwrap(), "--prompt-tokens", "8", "--quantize", "8"]);
    let run = run.expect_code(0);
    assert!(!run.stderr().contains("warning"), "{}", run.describe());
}

#[test]
fn generate_flushes_a_final_incomplete_character() {
    // The byte-level tokenizer of synthetic models emits one byte per token, so some
    // lengths end inside a UTF-8 sequence; that last byte must come out (as U+FFFD).
    let dir = Dir::new();
    let mut found = false;
    for n in 1..=16 {
        let run = dir.run(&["generate", "-m", "synthetic:tiny@4bit", "-p", "hi", "-n", &n.to_string()]);
        let run = run.expect_code(0);
        let text = run.stdout();
        let text = text.strip_suffix('\n').unwrap_or(&text);
        let generated: usize = run
            .stderr()
            .split("generated: ")
            .nth(1)
            .and_then(|s| s.split(' ').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no token count{}", run.describe()));
        // Every generated byte shows: a whole character or one U+FFFD per broken sequence.
        assert!(text.chars().count() >= generated.min(1), "{}", run.describe());
        if text.ends_with('\u{fffd}') {
            found = true;
        }
    }
    assert!(found, "no length from 1 to 16 ended inside a character; the test needs another prompt");
}
