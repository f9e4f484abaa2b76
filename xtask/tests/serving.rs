//! serve-bench and qmv-pin-tax end to end: the real `cargo xtask` against the real
//! `kiln serve` on synthetic:tiny, and, where a failure has to be injected (a malformed
//! usage, a server that dies mid-pass or boots slowly), against serve-stand-in, which
//! speaks the same contracts and misbehaves on request. Each test has its own directory
//! and port.

#[allow(dead_code)]
mod util;

use std::fs;
use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use util::{Run, Sandbox};

/// The stand-in server, for the failures kiln serve cannot be asked to have.
fn stand_in() -> &'static str {
    env!("CARGO_BIN_EXE_serve-stand-in")
}

/// The real kiln binary (debug, built once per test run).
fn kiln() -> &'static str {
    util::kiln_bin().to_str().expect("a UTF-8 path")
}

/// A port nothing listens on right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The single run directory under `runs`.
fn run_dir(runs: &Path) -> PathBuf {
    let dirs: Vec<PathBuf> = fs::read_dir(runs).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    dirs[0].clone()
}

fn csv_rows(path: &Path) -> Vec<csv::StringRecord> {
    let mut rdr = csv::Reader::from_path(path).unwrap();
    let h = rdr.headers().unwrap().clone();
    let mut rows = vec![h];
    rows.extend(rdr.records().map(Result::unwrap));
    rows
}

fn col(rows: &[csv::StringRecord], row: usize, name: &str) -> String {
    let i = rows[0].iter().position(|h| h == name).unwrap_or_else(|| panic!("no column {name}"));
    rows[row][i].to_string()
}

fn serve_bench(sb: &Sandbox, server: &str, extra: &[&str], env: &[(&str, &str)]) -> Run {
    let runs = sb.path("runs");
    let mut args = vec!["-m", "synthetic:tiny", "--kiln-bin", server, "--runs-dir", runs.to_str().unwrap()];
    args.extend_from_slice(extra);
    sb.run_with("serve-bench", &args, env)
}

#[test]
fn a_runs_dir_naming_a_file_is_refused_before_kiln_is_built() {
    let sb = Sandbox::new();
    let file = sb.path("not-a-dir");
    fs::write(&file, "x").unwrap();
    // A cargo that leaves a mark: the build must not start.
    let mark = sb.path("cargo-ran");
    let cargo = sb.path("fake-cargo");
    fs::write(&cargo, format!("#!/bin/sh\ntouch '{}'\nexit 1\n", mark.display())).unwrap();
    let mut perms = fs::metadata(&cargo).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    fs::set_permissions(&cargo, perms).unwrap();
    let run = sb.run_with(
        "serve-bench",
        &["-m", "synthetic:tiny", "--runs-dir", file.to_str().unwrap()],
        &[("CARGO", cargo.to_str().unwrap())],
    );
    run.expect_code(2).expect_stderr("--runs-dir").expect_stderr("is not a directory");
    assert!(!mark.exists(), "kiln was built before the flag was checked{run}");
}

#[test]
fn serve_bench_boots_a_server_and_writes_every_output() {
    let sb = Sandbox::new();
    let run = serve_bench(
        &sb,
        kiln(),
        &["--concurrency", "1,2", "--requests", "4", "--max-tokens", "5", "--prompt-tokens", "32"],
        &[],
    );
    // Token-id prompts: the server counts exactly the asked length.
    run.expect_code(0)
        .expect_stdout("| c=1 | 4 | 0 |")
        .expect_stdout("| c=2 | 4 | 0 |")
        .expect_stdout("client CPU")
        .expect_stdout("| prompt tok asked / counted |")
        .expect_stdout("| 32 / 32 | ");
    let dir = run_dir(&sb.path("runs"));
    for f in ["env.json", "requests.jsonl", "levels.csv", "summary.md", "serve-bench.svg", "server.log"] {
        assert!(dir.join(f).is_file(), "no {f}{run}");
    }
    let lines: Vec<serde_json::Value> = fs::read_to_string(dir.join("requests.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // One warm-up round per level (1 + 2 requests) and 4 measured per level.
    assert_eq!(lines.len(), 11, "{run}");
    assert_eq!(lines.iter().filter(|l| l["warmup"] == true).count(), 3);
    let measured = lines.iter().find(|l| l["warmup"] == false).unwrap();
    assert_eq!(measured["output_tokens"], 5);
    assert_eq!(measured["tokens_from"], "usage");
    // kiln serve sends one event per decodable piece of text, so at most 4 gaps for 5 tokens
    // (a random synthetic model's bytes often merge); the gaps equal the events less one.
    let itl = measured["itl_ms"].as_array().unwrap().len();
    assert!(itl <= 4, "{itl} gaps for 5 tokens{run}");
    assert_eq!(measured["deltas"].as_u64().unwrap().saturating_sub(1), itl as u64, "{run}");
    let rows = csv_rows(&dir.join("levels.csv"));
    assert_eq!(rows.len(), 3);
    assert_eq!(
        (col(&rows, 2, "level"), col(&rows, 2, "ok"), col(&rows, 2, "output_tokens")),
        ("c=2".into(), "4".into(), "20".into())
    );
    assert!(
        col(&rows, 2, "server_cpu_s").parse::<f64>().is_ok(),
        "a booted server's CPU time is reported{run}"
    );
    let env: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(dir.join("env.json")).unwrap()).unwrap();
    for key in ["commit", "host", "cpu", "device", "kiln_env"] {
        assert!(env.get(key).is_some(), "env.json lacks {key}");
    }
    let svg = fs::read_to_string(dir.join("serve-bench.svg")).unwrap();
    assert!(svg.contains("TTFT p99") && svg.contains("output tok/s"));
}

#[test]
fn chat_prompts_are_calibrated_to_the_servers_count() {
    let sb = Sandbox::new();
    let args = [
        "--endpoint",
        "chat",
        "--concurrency",
        "2",
        "--requests",
        "4",
        "--max-tokens",
        "3",
        "--prompt-tokens",
        "96",
    ];
    let run = serve_bench(&sb, kiln(), &args, &[]);
    run.expect_code(0).expect_stderr("prompt calibration: the server counted ").expect_stdout("| 96 / ");
    assert!(!run.stdout.contains("5% off"), "{run}");
    let dir = run_dir(&sb.path("runs"));
    let lines: Vec<serde_json::Value> = fs::read_to_string(dir.join("requests.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.iter().filter(|l| l["level"] == "calibration").count(), 3, "{run}");
    for l in lines.iter().filter(|l| l["level"] == "c=2" && l["warmup"] == false) {
        let n = l["prompt_tokens"].as_u64().unwrap();
        // Words of one length and filler bytes: exact for kiln's byte-level tokenizer.
        assert_eq!(n, 96, "the server counted {n} prompt tokens for 96 asked{run}");
    }
}

#[test]
fn a_malformed_usage_completes_the_level_on_counted_deltas_including_reasoning() {
    let sb = Sandbox::new();
    let env = [("STAND_IN_BAD_USAGE", "1"), ("STAND_IN_REASONING", "1")];
    let run = serve_bench(
        &sb,
        stand_in(),
        &[
            "--endpoint",
            "chat",
            "--concurrency",
            "2",
            "--requests",
            "4",
            "--max-tokens",
            "6",
            "--warmup-rounds",
            "0",
        ],
        &env,
    );
    run.expect_code(0).expect_stderr("4 on counted deltas: malformed usage");
    let dir = run_dir(&sb.path("runs"));
    let rows = csv_rows(&dir.join("levels.csv"));
    assert_eq!((col(&rows, 1, "ok"), col(&rows, 1, "bad_usage")), ("4".into(), "4".into()), "{run}");
    // Half of each stream is reasoning_content: every delta counts, and TTFT is the first.
    assert_eq!(col(&rows, 1, "output_tokens"), "24", "{run}");
    assert!(!col(&rows, 1, "ttft_ms_p50").is_empty());
}

const SMALL_LEVELS: [&str; 10] = [
    "--concurrency",
    "1,2",
    "--requests",
    "4",
    "--max-tokens",
    "3",
    "--warmup-rounds",
    "0",
    "--request-timeout",
    "10",
];

#[test]
fn failed_requests_are_counted_per_level_and_the_sweep_goes_on() {
    let sb = Sandbox::new();
    // The server answers 500 from its 4th request on: c=1 has 3 of 4 ok, c=2 none.
    let run = serve_bench(&sb, stand_in(), &SMALL_LEVELS, &[("STAND_IN_FAIL_AFTER", "3")]);
    run.expect_code(1).expect_stderr("exit 1: requests failed (c=1: 1 of 4 failed; c=2: 4 of 4 failed)");
    let rows = csv_rows(&run_dir(&sb.path("runs")).join("levels.csv"));
    assert_eq!(rows.len(), 3, "{run}");
    assert_eq!((col(&rows, 1, "ok"), col(&rows, 1, "failed")), ("3".into(), "1".into()));
}

#[test]
fn a_booted_server_that_dies_stops_the_run_keeping_the_levels_measured() {
    for (env, how) in [
        (&[("STAND_IN_DIE_AFTER", "3")][..], "exited with status 3"),
        (&[("STAND_IN_DIE_AFTER", "3"), ("STAND_IN_DIE_BY_SIGKILL", "1")][..], "killed by signal 9"),
    ] {
        let sb = Sandbox::new();
        // It dies at its 4th request, in level c=1: c=2 is never sent to a dead server.
        let run = serve_bench(&sb, stand_in(), &SMALL_LEVELS, env);
        run.expect_code(1)
            .expect_stderr(&format!("kiln serve {how} during level c=1 (its log: "))
            .expect_stderr("stopping; the levels already measured are kept")
            .expect_stdout("| c=1 | 3 | 1 |")
            .expect_stdout(&format!("stopped: kiln serve {how} during level c=1"));
        assert!(!run.stderr.contains("ignored SIGTERM"), "{run}");
        assert!(!run.stdout.contains("| c=2 |"), "{run}");
        let rows = csv_rows(&run_dir(&sb.path("runs")).join("levels.csv"));
        assert_eq!(rows.len(), 2, "the header and c=1{run}");
    }
}

#[test]
fn serve_bench_measures_any_server_by_url() {
    let sb = Sandbox::new();
    let mut srv = std::process::Command::new(stand_in())
        .args(["serve", "-m", "x", "--port", "0"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = srv.stderr.take().unwrap();
    let mut seen = String::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !seen.contains("listening on http://") || !seen.ends_with('\n') {
        assert!(Instant::now() < deadline, "the stand-in did not start: {seen}");
        let mut b = [0u8; 256];
        let n = err.read(&mut b).unwrap();
        seen.push_str(&String::from_utf8_lossy(&b[..n]));
    }
    let at = seen.find("http://").unwrap();
    let url = seen[at..].lines().next().unwrap().trim().to_string();
    let runs = sb.path("runs");
    let run = sb.run(
        "serve-bench",
        &[
            "--url",
            &url,
            "--rate",
            "20",
            "--requests",
            "6",
            "--max-tokens",
            "3",
            "--runs-dir",
            runs.to_str().unwrap(),
        ],
    );
    let _ = srv.kill();
    let _ = srv.wait();
    run.expect_code(0).expect_stdout("| rate=20 | 6 | 0 |");
    assert!(!run_dir(&runs).join("server.log").exists(), "nothing was booted{run}");
}

/// `qmv-pin-tax --mode sweep` on the smallest design: `--order "1 0"`, one pass, two
/// small decode levels and small prefill cells.
fn pin_tax_args(sb: &Sandbox, server: &str, port: u16, order: &str) -> Vec<String> {
    [
        "--mode",
        "sweep",
        "-m",
        "synthetic:tiny",
        "--order",
        order,
        "--passes",
        "1",
        "--concurrency",
        "1,2",
        "--max-tokens",
        "4",
        "--decode-prompt",
        "8",
        "--prefix-tokens",
        "32",
        "--prefill-tokens",
        "16",
        "--chunked-tokens",
        "48",
        "--cache-requests",
        "2",
        "--prefill-requests",
        "1",
        "--cooldown",
        "0",
        // Chunks of 16 tokens: the 48-token control is three chunks (the stand-in ignores it).
        "--serve-arg=--prefill-chunk=16",
        "--grace",
        "5",
        "--request-timeout",
        "20",
        "--boot-timeout",
        "60",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        "--port".into(),
        port.to_string(),
        "--kiln-bin".into(),
        server.into(),
        "--runs-dir".into(),
        sb.path("runs").display().to_string(),
    ])
    .collect()
}

fn pin_tax(sb: &Sandbox, server: &str, port: u16, order: &str, env: &[(&str, &str)]) -> Run {
    let args = pin_tax_args(sb, server, port, order);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    sb.run_with("qmv-pin-tax", &args, env)
}

/// The dated records in `dir` (the run directory by default, else `--record-dir`).
fn records(dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with("qmv-pin-tax-") && name.ends_with(".md")
        })
        .collect()
}

fn jsonl(path: &Path) -> Vec<serde_json::Value> {
    fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// The summary row starting `prefix` gives each arm's counted passes (`None`: none, `-`)
/// in its two arm columns, as its readings print them (`12.3 (n=1: no interval)`).
fn assert_arm_ns(run: &Run, prefix: &str, ns: [Option<usize>; 2]) {
    let row =
        run.stdout.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no row {prefix}{run}"));
    let cells: Vec<&str> = row[prefix.len()..].split(" | ").collect();
    for (cell, n) in cells.iter().zip(ns) {
        match n {
            None => assert_eq!(*cell, "-", "{row}"),
            Some(1) => assert!(cell.contains("(n=1: no interval"), "{row}"),
            Some(n) => assert!(cell.contains(&format!("(n={n},")), "{row}"),
        }
    }
}

#[test]
fn a_complete_abba_run_pins_both_arms_checks_them_and_writes_the_record() {
    let sb = Sandbox::new();
    let run = pin_tax(&sb, kiln(), free_port(), "1 0", &[]);
    run.expect_code(0)
        .expect_stdout("no verdict: one pair gives no interval")
        .expect_stdout("failed passes: 0")
        .expect_stdout("contaminated cells (reported, excluded from every verdict): 0")
        .expect_stderr("qmv_wide=on pinned=yes")
        .expect_stderr("qmv_wide=off pinned=yes")
        .expect_stderr("about");
    assert_arm_ns(&run, "| decode B=2 | output tok/s | ", [Some(1), Some(1)]);
    let dir = run_dir(&sb.path("runs"));
    // The summary is the sheet in readings.json: summary.md and report.html print its
    // texts, the ratio's with the verdict's words.
    let readings: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(dir.join("readings.json")).unwrap()).unwrap();
    assert_eq!(readings["task"], "qmv-pin-tax", "{run}");
    let summary = fs::read_to_string(dir.join("summary.md")).unwrap();
    let report = fs::read_to_string(dir.join("report.html")).unwrap();
    let headline = readings["headline"].as_str().unwrap();
    assert!(headline.starts_with("qmv_wide pin, narrow/wide: "), "{headline}");
    for t in readings["tables"][0]["rows"].as_array().unwrap().iter().flat_map(|r| r.as_array().unwrap()) {
        let t = t["text"].as_str().unwrap();
        assert!(run.stdout.contains(t) && summary.contains(t), "{t} is not in the terminal's summary{run}");
        assert!(
            report.contains(
                &t.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('\'', "&#39;")
            ),
            "{t} is not in report.html"
        );
    }
    let passes = jsonl(&dir.join("passes.jsonl"));
    assert_eq!(passes.len(), 4, "a warm-up and a measured pass per boot{run}");
    assert!(passes.iter().all(|p| p["ok"] == true), "{run}");
    assert_eq!(passes[0]["arm"], "wide");
    assert_eq!(passes[3]["arm"], "narrow");
    let boots = jsonl(&dir.join("boots.jsonl"));
    assert_eq!(boots.len(), 2);
    assert_eq!(boots[1]["kernel"]["qmv_wide"], "off");
    assert!(dir.join("tax.svg").is_file(), "{run}");
    let records = records(&dir);
    assert_eq!(records.len(), 1, "{run}");
    assert!(records[0].with_extension("svg").is_file(), "the record's plot is beside it{run}");
    let name = records[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("qmv-pin-tax-") && name.ends_with(".md"), "{name}");
    let text = fs::read_to_string(&records[0]).unwrap();
    assert!(text.contains("| order | 1 0 |") && text.contains("narrow/wide"), "{text}");
    // The command row, pasted into a shell, gives back the words the run was given.
    let row = text.lines().find(|l| l.starts_with("| command | `cargo xtask qmv-pin-tax ")).expect(&text);
    let line = row.trim_start_matches("| command | `cargo xtask ").trim_end_matches("` |");
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!("set -- {line}; printf '%s\\0' \"$@\""))
        .output()
        .unwrap();
    let words: Vec<String> =
        String::from_utf8(out.stdout).unwrap().split_terminator('\0').map(str::to_string).collect();
    let mut typed = vec!["qmv-pin-tax".to_string()];
    typed.extend(pin_tax_args(&sb, kiln(), 0, "1 0"));
    let port = typed.iter().position(|a| a == "--port").unwrap() + 1;
    typed[port] = words[port].clone();
    assert_eq!(words, typed, "{row}");
}

#[test]
fn a_server_already_on_the_port_is_refused_before_any_boot() {
    let sb = Sandbox::new();
    let stale = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = stale.local_addr().unwrap().port();
    let run = pin_tax(&sb, kiln(), port, "1 0", &[]);
    run.expect_code(1).expect_stderr(&format!("port {port} already answers on 127.0.0.1 before boot 1"));
    let dir = run_dir(&sb.path("runs"));
    assert!(!dir.join("boot-1-wide.log").exists(), "a server was booted{run}");
    drop(stale);
}

#[test]
fn an_inherited_pin_is_refused_with_exit_2_before_anything_runs() {
    let sb = Sandbox::new();
    let run = pin_tax(&sb, kiln(), free_port(), "1 0", &[("KILN_QMV_WIDE", "1")]);
    run.expect_code(2).expect_stderr("KILN_QMV_WIDE=1 is set in the environment");
    assert!(!sb.path("runs").exists(), "{run}");
    let bad = Sandbox::new();
    let r = bad.run("qmv-pin-tax", &["--mode", "sweep", "--order", "1 1 0"]);
    r.expect_code(2).expect_stderr("has 2 wide and 1 narrow boots");
    let r = bad.run("qmv-pin-tax", &["--mode", "sweep", "--kiln-bin", "/nonexistent/kiln"]);
    r.expect_code(2).expect_stderr("--kiln-bin (or KILN_BENCH_KILN_BIN) /nonexistent/kiln: no such file");
}

#[test]
fn a_boot_that_dies_mid_pass_is_a_failed_pass_and_the_sweep_goes_on() {
    let sb = Sandbox::new();
    // The narrow boot (first) dies at its 4th request, inside its warm-up pass.
    let env = [("STAND_IN_DIE_AFTER", "3"), ("STAND_IN_DIE_ARM", "0")];
    let run = pin_tax(&sb, stand_in(), free_port(), "0 1", &env);
    run.expect_code(1).expect_stdout("failed passes: 2").expect_stderr("exit 1: 2 passes failed");
    let passes = jsonl(&run_dir(&sb.path("runs")).join("passes.jsonl"));
    assert_eq!(passes.len(), 4, "{run}");
    assert!(
        passes[0]["reason"].as_str().unwrap().contains("the server exited with status 3 during the pass"),
        "{run}"
    );
    assert!(passes[1]["reason"].as_str().unwrap().starts_with("not run: the server exited"), "{run}");
    assert_eq!((passes[2]["ok"].as_bool(), passes[3]["ok"].as_bool()), (Some(true), Some(true)), "{run}");
    assert_arm_ns(&run, "| decode B=1 | output tok/s | ", [None, Some(1)]);
}

#[test]
fn a_cell_past_the_models_context_is_skipped_by_rule_and_the_others_are_measured() {
    let sb = Sandbox::new();
    // synthetic:tiny's context is 1024 tokens: the default chunked prefill of 1024 prompt
    // tokens and 1 generated token cannot fit.
    let mut args = pin_tax_args(&sb, kiln(), free_port(), "1 0");
    let at = args.iter().position(|a| a == "--chunked-tokens").unwrap() + 1;
    args[at] = "1024".into();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = sb.run("qmv-pin-tax", &args);
    run.expect_code(0)
        .expect_stderr("chunked prefill 1024: SKIP:context: 1024 prompt plus 1 generated tokens exceed the model's context of 1024 tokens")
        .expect_stdout("failed passes: 0")
        .expect_stdout("skipped cells (never sent): 1\n- chunked prefill 1024: SKIP:context");
    assert_arm_ns(&run, "| decode B=2 | output tok/s | ", [Some(1), Some(1)]);
    assert_arm_ns(&run, "| uncached prefill 16 | TTFT ms | ", [Some(1), Some(1)]);
    assert!(!run.stdout.contains("| chunked prefill 1024 |"), "{run}");
    // The report lists the skipped cell under "Skipped and failed", never "none" beside it.
    let report = fs::read_to_string(run_dir(&sb.path("runs")).join("report.html")).unwrap();
    assert!(
        !report.contains("none: every cell was measured") && report.contains("<td>chunked prefill 1024</td>"),
        "{report}"
    );
    let passes = jsonl(&run_dir(&sb.path("runs")).join("passes.jsonl"));
    assert!(passes.iter().all(|p| p["ok"] == true && p["cells"].as_array().unwrap().len() == 4), "{run}");
}

#[test]
fn a_failed_cell_fails_that_cell_and_the_pass_counts_for_the_others() {
    let sb = Sandbox::new();
    // 8 requests a pass, the chunked prefill last: from the 16th request of a boot on
    // (pass 1's chunked prefill) the server answers 500 and stays up.
    let run = pin_tax(&sb, stand_in(), free_port(), "1 0", &[("STAND_IN_FAIL_AFTER", "15")]);
    run.expect_code(1)
        .expect_stdout("failed passes: 0")
        .expect_stdout("failed cells (their passes count for the other cells): 2")
        .expect_stderr("failed cells (the others count): chunked prefill 48: 1 of 1 requests failed")
        .expect_stderr("exit 1: 2 cells failed in a counted pass");
    assert_arm_ns(&run, "| decode B=2 | output tok/s | ", [Some(1), Some(1)]);
    assert_arm_ns(&run, "| chunked prefill 48 | TTFT ms | ", [None, None]);
}

#[test]
fn sigint_mid_boot_stops_the_server_prints_the_partial_summary_and_exits_130() {
    let sb = Sandbox::new();
    let tag = format!("pin-tax-interrupt-{}", std::process::id());
    let args = pin_tax_args(&sb, stand_in(), free_port(), "1 0");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (line, mut child) = sb.spawn(
        "qmv-pin-tax",
        &args,
        &[("STAND_IN_START_DELAY_MS", "30000"), ("XTASK_TEST_TAG", tag.as_str())],
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let booting = || {
        fs::read_dir(sb.path("runs"))
            .ok()
            .and_then(|mut d| d.next())
            .is_some_and(|e| e.unwrap().path().join("boot-1-wide.log").exists())
    };
    while !booting() {
        assert!(Instant::now() < deadline, "no boot after 60 s: {line}");
        assert!(child.try_wait().unwrap().is_none(), "xtask ended early: {line}");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    rustix::process::kill_process(rustix::process::Pid::from_child(&child), rustix::process::Signal::INT)
        .unwrap();
    let sent = Instant::now();
    let status = child.wait().unwrap();
    let (mut stdout, mut stderr) = (String::new(), String::new());
    child.stdout.take().unwrap().read_to_string(&mut stdout).unwrap();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    let run = Run { cmd: line, status, stdout, stderr };
    run.expect_code(130)
        .expect_stdout("interrupted by SIGINT: partial summary")
        .expect_stdout("passes written: 0 of 4");
    assert!(sent.elapsed() < Duration::from_secs(15), "the interrupt took {:?}{run}", sent.elapsed());
    let dir = run_dir(&sb.path("runs"));
    assert!(!dir.join("boot-2-narrow.log").exists(), "the next arm was booted{run}");
    let survivors: Vec<String> = fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            let environ = fs::read(e.path().join("environ")).ok()?;
            let needle = format!("XTASK_TEST_TAG={tag}");
            environ
                .split(|&b| b == 0)
                .any(|v| v == needle.as_bytes())
                .then(|| e.file_name().to_string_lossy().into_owned())
        })
        .collect();
    assert!(survivors.is_empty(), "processes of the interrupted run survive: {survivors:?}{run}");
}

/// `qmv-pin-tax --mode mixed` on the smallest design: `--order "A B"`, one measured
/// window of one speculative and two classic streams per boot.
fn mixed(sb: &Sandbox, server: &str, extra: &[&str], env: &[(&str, &str)]) -> Run {
    let (runs, records) = (sb.path("runs"), sb.path("records"));
    let port = free_port().to_string();
    let defaults = [
        ("--order", "A B"),
        ("--windows", "1"),
        ("--classic-streams", "2"),
        ("--max-tokens", "96"),
        ("--decode-prompt", "8"),
        ("--passage-tokens", "16"),
        ("--cooldown", "0"),
        ("--grace", "5"),
        ("--request-timeout", "60"),
        ("--boot-timeout", "60"),
        ("--drain-timeout", "60"),
    ];
    let mut args = vec!["--mode", "mixed", "-m", "synthetic:tiny"];
    for (flag, value) in defaults {
        if !extra.contains(&flag) {
            args.extend([flag, value]);
        }
    }
    args.extend(["--port", &port, "--kiln-bin", server]);
    args.extend(["--runs-dir", runs.to_str().unwrap(), "--record-dir", records.to_str().unwrap()]);
    args.extend_from_slice(extra);
    sb.run_with("qmv-pin-tax", &args, env)
}

#[test]
fn a_mixed_run_checks_each_arm_by_its_gate_line_and_writes_every_window() {
    let sb = Sandbox::new();
    // The speculative stream's budget is fixed past what 96 classic tokens can take even
    // if every draft is accepted (96 x 5), so the window's validity does not hang on how
    // fast a debug engine speculates on a loaded machine.
    let run = mixed(&sb, kiln(), &["--spec-max-tokens", "600"], &[]);
    run.expect_code(0)
        .expect_stdout("| window | acceptance % |")
        .expect_stdout("failed windows: 0")
        .expect_stdout("invalid windows (completed, not counted): 0")
        .expect_stdout("windows written: 4 of 4 planned")
        .expect_stderr("qmv_wide=on pinned=no")
        .expect_stderr("qmv_wide=on pinned=yes")
        .expect_stderr("gate: outcome=exact qmv_wide=on");
    assert_arm_ns(&run, "| window | classic tok/s per stream | ", [Some(1), Some(1)]);
    let dir = run_dir(&sb.path("runs"));
    let passes = jsonl(&dir.join("passes.jsonl"));
    assert_eq!(passes.len(), 4, "a warm-up and a measured window per boot{run}");
    for p in &passes {
        let r = &p["cells"][0]["detail"]["RESULT"];
        assert_eq!(r["valid"], true, "{p}{run}");
        assert_eq!(r["drained"], true, "{p}");
        assert!(r["overlap"].as_f64().unwrap() >= 0.95, "{p}");
        assert_eq!(r["classic"].as_array().unwrap().len(), 2, "{p}");
        assert!(r["speculative"]["drafted"].as_u64().unwrap() > 0, "{p}");
        assert_eq!(r["spec_max_tokens"], 600);
    }
    assert_eq!((passes[0]["arm"].as_str(), passes[3]["arm"].as_str()), (Some("A"), Some("B")));
    let boots = jsonl(&dir.join("boots.jsonl"));
    assert_eq!(boots[0]["gate"]["outcome"], "exact", "{run}");
    assert_eq!(boots[1]["kernel"]["pinned"], "yes");
    let records = records(&sb.path("records"));
    assert_eq!(records.len(), 1, "{run}");
    let name = records[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("qmv-pin-tax-mixed-"), "{name}");
    assert!(records[0].with_extension("svg").is_file(), "the record's plot is beside it{run}");
    let text = fs::read_to_string(&records[0]).unwrap();
    assert!(
        text.contains("| order | A B |") && text.contains("## Windows") && text.contains("outcome=exact"),
        "{text}"
    );
}

#[test]
fn a_mixed_arm_whose_gate_declines_fails_its_boot_and_the_run() {
    let sb = Sandbox::new();
    // A probe that is never exact: arm A (nothing allowed) declines and decodes classically,
    // so it is not the arm it claims to be; arm B (inexact allowed) speculates.
    let run = mixed(&sb, stand_in(), &["--max-tokens", "40"], &[("STAND_IN_PROBE", "inexact")]);
    run.expect_code(1)
        .expect_stderr(
            "arm identity: the A boot's gate says outcome=inexact-declined qmv_wide=on (expected outcome=exact qmv_wide=on or outcome=exact-without-qmv-wide qmv_wide=off)",
        )
        .expect_stderr("exit 1: 1 windows failed")
        .expect_stderr("exit 1: no counted window for arm A")
        .expect_stdout("failed boots: 1")
        .expect_stdout("gate says outcome=inexact-declined");
    let dir = run_dir(&sb.path("runs"));
    let passes = jsonl(&dir.join("passes.jsonl"));
    assert_eq!(passes.len(), 4, "{run}");
    assert!(passes[1]["reason"].as_str().unwrap().starts_with("not run: arm identity"), "{run}");
    // The B boot ran and counted.
    assert_eq!((passes[3]["arm"].as_str(), passes[3]["ok"].as_bool()), (Some("B"), Some(true)), "{run}");
    assert_eq!(jsonl(&dir.join("boots.jsonl"))[1]["gate"]["outcome"], "inexact-allowed", "{run}");

    // Refused before anything runs: an inherited gate variable, a bad order, a sweep flag.
    let r = mixed(&Sandbox::new(), stand_in(), &[], &[("KILN_SPEC_ALLOW_INEXACT", "1")]);
    r.expect_code(2).expect_stderr("KILN_SPEC_ALLOW_INEXACT=1 is set in the environment");
    let r = mixed(&Sandbox::new(), stand_in(), &["--order", "A 1"], &[]);
    r.expect_code(2).expect_stderr("--order: \"1\" is not an arm: expected A (default environment) or B");
    let r = mixed(&Sandbox::new(), stand_in(), &["--passes", "2"], &[]);
    r.expect_code(2).expect_stderr("--passes is for --mode sweep");
}

/// `pin_tax_args` with more flags.
fn pin_tax_more(sb: &Sandbox, order: &str, more: &[&str], env: &[(&str, &str)]) -> Run {
    let mut args = pin_tax_args(sb, stand_in(), free_port(), order);
    args.extend(more.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    sb.run_with("qmv-pin-tax", &args, env)
}

/// The summary table's line of a cell and metric.
fn tax_line<'a>(run: &'a Run, cell_metric: &str) -> &'a str {
    run.stdout.lines().find(|l| l.starts_with(cell_metric)).unwrap_or_else(|| panic!("no {cell_metric}{run}"))
}

#[test]
fn until_ci_adds_abba_blocks_to_a_known_cost_judges_the_margin_and_cites_the_aa_floor() {
    let sb = Sandbox::new();
    // The stand-in's narrow arm takes 8 ms more per token than its wide arm's 2 ms.
    let env = [("STAND_IN_TOKEN_MS", "2"), ("STAND_IN_NARROW_TOKEN_MS", "8")];
    // The A/A run first: both slots run the wide arm, so the injected cost never shows.
    let aa = pin_tax_more(&sb, "1 0 0 1", &["--aa", "--until-ci", "30", "--max-pairs", "4"], &env);
    aa.expect_code(0)
        .expect_stdout("A/A noise floor, A2/A1 (both slots run wide): the difference between identical arms: ")
        .expect_stdout("A/A run: slots A1 and A2 both run wide (KILN_QMV_WIDE=1), so every difference between them is noise")
        .expect_stdout("false-positive rate")
        .expect_stdout("stopping rule: ")
        .expect_stdout("95% interval from the confidence sequence on the logs")
        .expect_stdout("| cell | metric | A2 | A1 | A2/A1 |")
        // The progress line names the slot and the environment every boot ran.
        .expect_stderr("A2, A/A: wide (KILN_QMV_WIDE=1): booting");
    let aa_dir = run_dir(&sb.path("runs"));
    let boots = jsonl(&aa_dir.join("boots.jsonl"));
    assert!(boots.len() == 4 || boots.len() == 8, "two or four pairs{aa}");
    assert!(boots.iter().all(|b| b["kernel"]["qmv_wide"] == "on"), "every boot ran wide{aa}");
    assert!(aa_dir.join("aa.json").is_file(), "{aa}");
    // Every boot ran the wide kernel, so nothing records one as narrow: the slots are
    // A1 and A2, each recorded with the environment it ran, in boots.jsonl, passes.jsonl,
    // the log names and the summary alike.
    let arms: Vec<&str> = boots.iter().map(|b| b["arm"].as_str().unwrap()).collect();
    assert_eq!(arms[..4], ["A1", "A2", "A2", "A1"], "{aa}");
    assert!(boots.iter().all(|b| b["runs"] == "wide"), "{aa}");
    for (i, b) in boots.iter().enumerate() {
        let log = format!("boot-{}-{}.log", i + 1, arms[i]);
        assert_eq!(b["log"], log.as_str(), "{aa}");
        assert!(aa_dir.join(&log).is_file(), "no {log}{aa}");
    }
    let passes = jsonl(&aa_dir.join("passes.jsonl"));
    assert!(passes.iter().all(|p| p["arm"] == "A1" || p["arm"] == "A2"), "{aa}");
    let summary = fs::read_to_string(aa_dir.join("summary.md")).unwrap();
    let plot = fs::read_to_string(aa_dir.join("tax.svg")).unwrap();
    assert!(plot.contains("A2/A1"), "{aa}");
    for text in [&summary, &plot, &aa.stdout, &aa.stderr] {
        assert!(!text.contains("narrow"), "an A/A run of the wide kernel mentions narrow{aa}");
    }
    // Nor a pin or a tax: it is titled and worded as the noise floor it is.
    for text in [&summary, &plot] {
        assert!(!text.contains("tax") && !text.contains("pin ") && !text.contains("pin:"), "{text}");
    }
    let names: Vec<String> = fs::read_dir(&aa_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!names.iter().any(|n| n.contains("narrow")), "{names:?}{aa}");

    let ab = pin_tax_more(&sb, "1 0 0 1", &["--until-ci", "30", "--max-pairs", "6", "--margin", "5"], &env);
    ab.expect_code(0)
        .expect_stdout("the latest A/A run of --mode sweep on this device")
        .expect_stdout("stopping rule: ");
    // 10 ms against 2 ms per token: far outside the 5% margin, whatever the noise.
    let tpot = tax_line(&ab, "| decode B=1 | TPOT ms |");
    assert!(
        tpot.contains("regressed by more than 5%") && tpot.contains("the pin costs more than 5%"),
        "{tpot}{ab}"
    );
    let dirs: Vec<PathBuf> = {
        let mut d: Vec<PathBuf> = fs::read_dir(sb.path("runs")).unwrap().map(|e| e.unwrap().path()).collect();
        d.sort();
        d
    };
    let boots = jsonl(&dirs[1].join("boots.jsonl"));
    assert!([4, 8, 12].contains(&boots.len()), "whole ABBA blocks, at most 6 pairs{ab}");
    let arms: Vec<&str> = boots.iter().map(|b| b["arm"].as_str().unwrap()).collect();
    assert_eq!(arms[..4], ["wide", "narrow", "narrow", "wide"], "{ab}");
    if arms.len() > 4 {
        assert_eq!(
            arms[4..8],
            ["narrow", "wide", "wide", "narrow"],
            "the next block opens with the other arm{ab}"
        );
    }
    // The fit recovers the injected cost: 8 ms more per forward of the narrow arm (within
    // a loose band: the machine is shared).
    let line =
        ab.stdout.lines().find(|l| l.starts_with("| per forward | ")).unwrap_or_else(|| panic!("{ab}"));
    let ms: f64 = line["| per forward | ".len()..].split_whitespace().next().unwrap().parse().unwrap();
    assert!((4.0..12.0).contains(&ms), "{line}{ab}");
}

#[test]
fn a_mixed_run_until_ci_adds_blocks_until_its_pair_budget_and_aa_runs_arm_a_only() {
    let sb = Sandbox::new();
    // One pair from "A B", then one block (B A A B): 3 pairs, and the next block would
    // pass --max-pairs 3. Three pairs never bound the sequence, so the budget ends it.
    let run = mixed(&sb, stand_in(), &["--until-ci", "5", "--max-pairs", "3"], &[]);
    run.expect_code(0)
        .expect_stdout("stopping rule: --max-pairs 3 reached")
        .expect_stdout("the sequential interval is not bounded yet");
    let boots = jsonl(&run_dir(&sb.path("runs")).join("boots.jsonl"));
    let arms: Vec<&str> = boots.iter().map(|b| b["arm"].as_str().unwrap()).collect();
    assert_eq!(arms, ["A", "B", "B", "A", "A", "B"], "{run}");
    let aa_sb = Sandbox::new();
    let aa = mixed(&aa_sb, stand_in(), &["--aa"], &[]);
    aa.expect_code(0).expect_stdout("A/A run: slots A1 and A2 both run A (default environment)");
    let records = records(&aa_sb.path("records"));
    let name = records[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("qmv-pin-tax-aa-mixed-"), "{name}");
    let text = fs::read_to_string(&records[0]).unwrap();
    assert!(text.starts_with("# A/A noise floor (identical arms A1 and A2), --mode mixed: "), "{text}");
    let boots = jsonl(&run_dir(&aa_sb.path("runs")).join("boots.jsonl"));
    assert!(boots.iter().all(|b| b["kernel"]["pinned"] == "no"), "every boot ran arm A{aa}");
    let arms: Vec<&str> = boots.iter().map(|b| b["arm"].as_str().unwrap()).collect();
    assert_eq!(arms, ["A1", "A2"], "the slots of the order \"A B\", not arm B{aa}");
    assert!(boots.iter().all(|b| b["runs"] == "A"), "{aa}");
}

#[test]
fn max_time_stops_the_first_order_at_a_pair_boundary() {
    let sb = Sandbox::new();
    // Boots of at least 1.5 s against a 5 s budget: after the first pair there is no room
    // for a second, so the order "1 0 0 1" stops after two boots, a whole pair.
    let env = [("STAND_IN_START_DELAY_MS", "1500")];
    let run = pin_tax_more(&sb, "1 0 0 1", &["--until-ci", "1", "--max-time", "5s"], &env);
    run.expect_code(0).expect_stdout("stopping rule: --max-time reached").expect_stdout("; 1 pairs, 2 boots");
    run.expect_stderr("--max-time: no time for another pair of boots; stopping after 2 boots");
    let boots = jsonl(&run_dir(&sb.path("runs")).join("boots.jsonl"));
    assert_eq!(boots.len(), 2, "{run}");
}

#[test]
fn negative_counts_name_the_flag_and_the_accepted_range() {
    let sb = Sandbox::new();
    let cases: [(&str, &[&str]); 4] = [
        ("serve-bench", &["--max-tokens", "-1"]),
        ("serve-bench", &["--warmup-rounds", "-2"]),
        ("qmv-pin-tax", &["--cooldown", "-1"]),
        ("qmv-pin-tax", &["--cache-requests", "-3"]),
    ];
    for (task, args) in cases {
        let r = sb.run(task, args);
        r.expect_code(2)
            .expect_stderr(args[0])
            .expect_stderr(&format!("{} is negative: accepted values are 0 to", args[1]));
        assert!(!r.stderr.contains("invalid digit"), "{r}");
    }
}
