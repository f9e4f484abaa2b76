//! The sweep scenarios end to end: the real `cargo xtask` against the real `kiln` on the
//! tiny synthetic models (1024-token context), each test in its own directory.

// Shared with the report tests; not every helper is used here.
#[allow(dead_code)]
mod util;

use std::fs;
use std::io::Read;
use std::time::{Duration, Instant};

use util::{Run, Sandbox, expect};

const TINY: &str = "synthetic:tiny";
const TINY_QWEN: &str = "synthetic:tiny-qwen";
/// Few tokens per cell: the scenarios are about which cells run, not how fast.
const SHORT: [&str; 4] = ["--max-tokens", "6", "--warmup-tokens", "1"];

fn args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut a: Vec<&str> = SHORT.to_vec();
    a.extend_from_slice(extra);
    a
}

fn fields(line: &str) -> Vec<String> {
    let mut rdr = csv::ReaderBuilder::new().has_headers(false).from_reader(line.as_bytes());
    rdr.records().next().expect("a record line").expect("csv").iter().map(str::to_string).collect()
}

#[test]
fn a_fake_oom_at_the_first_length_backstops_the_rest_and_records_one_line() {
    let sb = Sandbox::new();
    let run = sb.run_with(
        "bench-longprompt",
        &args(&["--models", TINY, "--lengths", "64 128 256"]),
        &[("KILN_BENCH_FAKE_OOM", "synthetic:tiny:64")],
    );
    // Nothing was measured, so the run exits 1.
    run.expect_code(1)
        .expect_stderr(
            "SKIP:oom_backstop: synthetic:tiny ran out of memory at length 64 earlier in this sweep",
        )
        .expect_stdout("skipped 3 of 3 cells");
    assert_eq!(
        sb.statuses(TINY),
        expect(&[("64", "SKIP:oom"), ("128", "SKIP:oom_backstop"), ("256", "SKIP:oom_backstop")]),
        "{run}"
    );
    let lines = sb.record_lines();
    assert_eq!(lines.len(), 1, "{lines:?}{run}");
    let f = fields(&lines[0]);
    assert_eq!(f.len(), 7, "{f:?}");
    assert_eq!((f[0].as_str(), f[1].as_str()), (TINY, "64"));
    assert!(f[2].len() == 20 && f[2].ends_with('Z'), "date {:?}", f[2]);
    assert!(!f[3].is_empty(), "commit");
    assert_eq!(f[4], "", "a fake OOM reports no peak");
    assert!(f[5].ends_with("out.csv"), "source_csv {:?}", f[5]);
    assert!(f[6].starts_with("cpu:"), "device {:?}", f[6]);
    // The CSV's own rows carry the environment that made them.
    let rows = sb.rows(&sb.csv());
    assert!(rows[0].get("features").contains("KILN_BENCH_FAKE_OOM=synthetic:tiny:64"), "{rows:?}");
    // And the run directory has its env.json.
    let runs: Vec<_> = fs::read_dir(sb.path("runs")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(runs.len(), 1);
    let env: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(runs[0].join("env.json")).unwrap()).unwrap();
    assert_eq!(env["kiln_env"]["KILN_BENCH_FAKE_OOM"], "synthetic:tiny:64");
    assert!(env["commit"].as_str().is_some_and(|c| !c.is_empty()));
}

#[test]
fn backstop_and_record_are_per_model() {
    let sb = Sandbox::new();
    let run = sb.run_with(
        "bench-longprompt",
        &args(&["--models", "synthetic:tiny synthetic:tiny-qwen", "--lengths", "64,128"]),
        &[("KILN_BENCH_FAKE_OOM", "synthetic:tiny:64")],
    );
    run.expect_code(0);
    assert_eq!(sb.statuses(TINY), expect(&[("64", "SKIP:oom"), ("128", "SKIP:oom_backstop")]), "{run}");
    assert_eq!(sb.statuses(TINY_QWEN), expect(&[("64", "ok"), ("128", "ok")]), "{run}");
    assert_eq!(sb.record_lines().len(), 1);
    // A later sweep pre-skips tiny from the record and still runs tiny-qwen.
    let run = sb.run(
        "bench-longprompt",
        &args(&["--models", "synthetic:tiny-qwen,synthetic:tiny", "--lengths", "128"]),
    );
    run.expect_code(0).expect_stderr("SKIP:oom_record");
    assert_eq!(sb.statuses(TINY), expect(&[("128", "SKIP:oom_record")]), "{run}");
    assert_eq!(sb.statuses(TINY_QWEN), expect(&[("128", "ok")]), "{run}");
    assert_eq!(sb.record_lines().len(), 1, "a pre-skip appends nothing");
}

#[test]
fn a_hand_written_record_pre_skips_and_the_override_runs_for_real_while_still_appending() {
    let sb = Sandbox::new();
    let hand = "synthetic:tiny,128,2026-01-01,abc1234,,hand.csv,\n";
    fs::write(sb.record(), hand).unwrap();
    let run = sb.run("bench-longprompt", &args(&["--models", TINY, "--lengths", "64 128 256"]));
    run.expect_code(0).expect_stderr(":1: synthetic:tiny,128,2026-01-01,abc1234,,hand.csv,");
    assert_eq!(
        sb.statuses(TINY),
        expect(&[("64", "ok"), ("128", "SKIP:oom_record"), ("256", "SKIP:oom_record")]),
        "{run}"
    );
    assert_eq!(fs::read_to_string(sb.record()).unwrap(), hand, "a pre-skip leaves the record alone");

    // The override runs the recorded cells for real; a fake OOM among them is still
    // appended, and backstops the cell after it.
    let run = sb.run_with(
        "bench-longprompt",
        &args(&["--models", TINY, "--lengths", "128 256 512"]),
        &[("KILN_BENCH_IGNORE_OOM_RECORD", "1"), ("KILN_BENCH_FAKE_OOM", "synthetic:tiny:256")],
    );
    run.expect_code(0).expect_stderr("KILN_BENCH_IGNORE_OOM_RECORD=1");
    assert_eq!(
        sb.statuses(TINY),
        expect(&[("128", "ok"), ("256", "SKIP:oom"), ("512", "SKIP:oom_backstop")]),
        "{run}"
    );
    let lines = sb.record_lines();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(&fields(&lines[1])[..2], [TINY, "256"]);
}

#[test]
fn a_truncated_record_line_is_warned_about_and_ignored_while_a_valid_one_applies() {
    let sb = Sandbox::new();
    fs::write(sb.record(), "synthetic:tiny,64\nsynthetic:tiny-qwen,64,2026-01-01,abc1234,,hand.csv,\n")
        .unwrap();
    let run = sb.run(
        "bench-longprompt",
        &args(&["--models", "synthetic:tiny,synthetic:tiny-qwen", "--lengths", "64"]),
    );
    run.expect_code(0)
        .expect_stderr(":1: ignoring malformed OOM-record line \"synthetic:tiny,64\": has 2 fields");
    assert_eq!(sb.statuses(TINY), expect(&[("64", "ok")]), "{run}");
    assert_eq!(sb.statuses(TINY_QWEN), expect(&[("64", "SKIP:oom_record")]), "{run}");
    assert_eq!(run.stderr.matches("ignoring malformed").count(), 1, "warned once{run}");
}

#[test]
fn a_missing_model_creates_no_record() {
    let sb = Sandbox::new();
    let run = sb.run_with(
        "bench-longprompt",
        &args(&["--models", "models/does-not-exist", "--lengths", "64 128"]),
        &[("KILN_BENCH_FAKE_OOM", "models/does-not-exist:64")],
    );
    // The user named a model that is not there: by rule, explicit, exit 1.
    run.expect_code(1).expect_stderr("SKIP:missing_model").expect_stderr("was named explicitly");
    assert_eq!(
        sb.statuses("models/does-not-exist"),
        expect(&[("64", "SKIP:missing_model"), ("128", "SKIP:missing_model")])
    );
    assert!(!sb.record().exists(), "a missing model created the record{run}");
}

#[test]
fn a_bad_ladder_exits_2_before_the_output_is_touched() {
    let sb = Sandbox::new();
    fs::write(sb.csv(), "an earlier sweep\n").unwrap();
    for (ladder, token) in [("512 2o48", "`2o48`"), ("32k", "`32k`")] {
        let run = sb.run("bench-longprompt", &["--models", TINY, "--lengths", ladder]);
        run.expect_code(2).expect_stderr(token);
        assert_eq!(fs::read_to_string(sb.csv()).unwrap(), "an earlier sweep\n", "output touched{run}");
    }
    let fresh = sb.path("never.csv");
    let run = sb.run("bench-longprompt", &["--output", fresh.to_str().unwrap(), "--lengths", "1 2 x"]);
    run.expect_code(2).expect_stderr("`x`");
    assert!(!fresh.exists() && !sb.path("runs").exists(), "something ran{run}");
    let run = sb.run_with("bench-longprompt", &["--lengths", "64"], &[("KILN_BENCH_FAKE_OOM", "tiny")]);
    run.expect_code(2).expect_stderr("KILN_BENCH_FAKE_OOM entry `tiny`");
    assert_eq!(fs::read_to_string(sb.csv()).unwrap(), "an earlier sweep\n", "output touched{run}");
    // Token counts that leave no timed decode step are refused by both bench commands.
    for cmd in ["bench-longprompt", "bench-decode"] {
        let run = sb.run(cmd, &["--models", TINY, "--max-tokens", "3", "--warmup-tokens", "5"]);
        run.expect_code(2).expect_stderr("--warmup-tokens 5 leaves no timed decode step");
        assert_eq!(fs::read_to_string(sb.csv()).unwrap(), "an earlier sweep\n", "output touched{run}");
    }
}

#[test]
fn a_length_beyond_the_context_fails_the_run_only_when_named_explicitly() {
    let sb = Sandbox::new();
    // tiny's context is 1024 tokens.
    let run = sb.run("bench-longprompt", &args(&["--models", TINY, "--lengths", "64 2048"]));
    run.expect_code(1)
        .expect_stderr("exceed the model's context of 1024 tokens")
        .expect_stderr("was named explicitly");
    assert_eq!(sb.statuses(TINY), expect(&[("64", "ok"), ("2048", "SKIP:context")]), "{run}");
    // The CPU default ladder (128 512 2048) reaches past tiny's context: that cell is
    // derived from defaults, so its skip is expected output.
    let run = sb.run("bench-longprompt", &args(&["--models", TINY]));
    run.expect_code(0).expect_stdout("skipped 1 of 3 cells: synthetic:tiny@2048 (SKIP:context)");
    assert_eq!(sb.statuses(TINY), expect(&[("128", "ok"), ("512", "ok"), ("2048", "SKIP:context")]), "{run}");
}

#[test]
fn bench_decode_measures_a_text_prompt() {
    let sb = Sandbox::new();
    let run = sb.run("bench-decode", &args(&["--models", TINY, "--prompt", "Hello, world"]));
    run.expect_code(0).expect_stdout("| synthetic:tiny@text | 1 / 1 |");
    let rows = sb.rows(&sb.csv());
    assert_eq!(rows.len(), 1, "{run}");
    let r = &rows[0];
    assert_eq!(
        (r.get("status"), r.get("prompt"), r.get("prompt_target_len")),
        ("ok", "Hello, world", ""),
        "{run}"
    );
    assert!(r.get("decode_tok_s").parse::<f64>().unwrap() > 0.0, "{run}");
    assert_eq!(r.get("generated_tokens"), "6");
    assert_eq!(r.get("backend"), "cpu");
}

#[test]
fn a_cell_past_its_timeout_is_killed_and_fails_the_run() {
    let sb = Sandbox::new();
    // Build kiln outside the clock.
    util::kiln_bin();
    let start = Instant::now();
    // smollm-135m takes far longer than a second to build and prefill in a debug engine.
    let run = sb.run(
        "bench-longprompt",
        &args(&["--models", "synthetic:smollm-135m", "--lengths", "512", "--cell-timeout", "1"]),
    );
    run.expect_code(1).expect_stderr("FAIL:timeout").expect_stderr("killed after 1s");
    assert!(start.elapsed() < Duration::from_secs(60), "the timeout did not cut the cell short{run}");
    assert_eq!(sb.statuses("synthetic:smollm-135m"), expect(&[("512", "FAIL:timeout")]));
    assert!(!sb.record().exists(), "a timeout is not an OOM{run}");
}

#[test]
fn a_real_engine_oom_is_classified_recorded_backstopped_and_pre_skipped_next_time() {
    let sb = Sandbox::new();
    // Pick a pool limit between the engine's own estimates for 64 and 512 tokens: the
    // first fits (the estimate bounds the peak), the second cannot.
    let total = |n: &str| -> u64 {
        let out = std::process::Command::new(util::kiln_bin())
            .args(["estimate", "-m", TINY, "--prompt-tokens", n, "--max-tokens", "6"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["total_bytes"].as_u64().unwrap()
    };
    let (low, high) = (total("64"), total("512"));
    assert!(high > low + 4096, "estimates {low} and {high} leave no room for a limit");
    let limit = ((low + high) / 2).to_string();
    let sweep =
        args(&["--models", TINY, "--lengths", "64 512 900", "--memory-limit", &limit, "--no-estimate"]);
    let run = sb.run("bench-longprompt", &sweep);
    run.expect_code(0);
    assert_eq!(
        sb.statuses(TINY),
        expect(&[("64", "ok"), ("512", "SKIP:oom"), ("900", "SKIP:oom_backstop")]),
        "{run}"
    );
    let lines = sb.record_lines();
    assert_eq!(lines.len(), 1, "{lines:?}");
    let f = fields(&lines[0]);
    assert_eq!(&f[..2], [TINY, "512"]);
    let peak: u64 = f[4].parse().unwrap_or_else(|_| panic!("peak_bytes {:?} from the engine's report", f[4]));
    assert!(peak > limit.parse::<u64>().unwrap(), "the refused demand {peak} is above the limit {limit}");
    assert!(f[6].ends_with(&format!("limit {limit}")), "device {:?}", f[6]);
    let oom_row = sb.rows(&sb.csv()).into_iter().find(|r| r.get("status") == "SKIP:oom").unwrap();
    assert_eq!(oom_row.get("peak_bytes"), f[4]);

    // The second run pre-skips from the record: nothing above 64 is launched.
    let run = sb.run("bench-longprompt", &sweep);
    run.expect_code(0).expect_stderr("SKIP:oom_record");
    assert_eq!(
        sb.statuses(TINY),
        expect(&[("64", "ok"), ("512", "SKIP:oom_record"), ("900", "SKIP:oom_record")]),
        "{run}"
    );
    assert_eq!(sb.record_lines().len(), 1);
    // Without the limit the device differs, so the scoped line does not apply.
    let run = sb.run("bench-longprompt", &args(&["--models", TINY, "--lengths", "512"]));
    run.expect_code(0);
    assert_eq!(sb.statuses(TINY), expect(&[("512", "ok")]), "{run}");
}

#[test]
fn resume_runs_only_the_cells_without_a_row() {
    let sb = Sandbox::new();
    let sweep = args(&["--models", TINY, "--lengths", "64 128 256"]);
    sb.run("bench-longprompt", &sweep).expect_code(0);
    let text = fs::read_to_string(sb.csv()).unwrap();
    let kept: Vec<&str> = text.lines().take(2).collect();
    fs::write(sb.csv(), kept.join("\n") + "\n").unwrap();
    let mut resume = sweep.clone();
    let csv = sb.csv();
    resume.extend(["--resume", csv.to_str().unwrap()]);
    let run = sb.run("bench-longprompt", &resume);
    run.expect_code(0).expect_stderr("1 of 3 cells already have a row");
    assert_eq!(sb.statuses(TINY), expect(&[("64", "ok"), ("128", "ok"), ("256", "ok")]), "{run}");
    assert_eq!(run.stderr.matches(": ok: decode").count(), 2, "{run}");
}

#[test]
fn an_interrupt_kills_the_running_cell_keeps_rows_and_exits_130() {
    let sb = Sandbox::new();
    // Build kiln before the clock below starts.
    util::kiln_bin();
    let tag = format!("xtask-interrupt-{}", std::process::id());
    let (line, mut child) = sb.spawn(
        "bench-longprompt",
        &args(&["--models", "synthetic:tiny synthetic:smollm-135m", "--lengths", "512 1000"]),
        &[("XTASK_TEST_TAG", tag.as_str())],
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    // Wait for tiny's rows; smollm-135m's first cell (seconds of prefill) is then starting.
    let finished_rows =
        || fs::read_to_string(sb.csv()).map_or(0, |t| t.matches('\n').count().saturating_sub(1));
    while finished_rows() < 2 {
        assert!(Instant::now() < deadline, "no rows after 120s: {line}");
        assert!(child.try_wait().unwrap().is_none(), "xtask ended early: {line}");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(100));
    let pid = rustix::process::Pid::from_child(&child);
    rustix::process::kill_process(pid, rustix::process::Signal::INT).unwrap();
    let sent = Instant::now();
    let status = child.wait().unwrap();
    let mut stdout = String::new();
    let mut stderr = String::new();
    child.stdout.take().unwrap().read_to_string(&mut stdout).unwrap();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    let run = Run { cmd: line, status, stdout, stderr };
    run.expect_code(130)
        .expect_stderr("interrupted by SIGINT")
        .expect_stdout("interrupted by SIGINT after 2 of 4 cells")
        .expect_stdout("| synthetic:smollm-135m@512 | 0 / 0 | - | - | not run |")
        .expect_stdout("| synthetic:smollm-135m@1000 | 0 / 0 | - | - | not run |");
    assert!(sent.elapsed() < Duration::from_secs(10), "the interrupt took {:?}{run}", sent.elapsed());
    assert_eq!(sb.statuses(TINY), expect(&[("512", "ok"), ("1000", "ok")]), "{run}");
    assert!(sb.statuses("synthetic:smollm-135m").is_empty(), "{run}");
    // No engine process of this run survives.
    let survivors = util::tagged_processes(&tag);
    assert!(survivors.is_empty(), "processes of the interrupted run survive: {survivors:?}{run}");
}

#[test]
fn a_sigkilled_harness_takes_the_running_engine_with_it() {
    let sb = Sandbox::new();
    util::kiln_bin();
    let tag = format!("xtask-sigkill-{}", std::process::id());
    // smollm-135m at 1000 tokens prefills for seconds in a debug engine.
    let (line, mut child) = sb.spawn(
        "bench-longprompt",
        &args(&["--models", "synthetic:smollm-135m", "--lengths", "1000", "--no-estimate"]),
        &[("XTASK_TEST_TAG", tag.as_str())],
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    let engine_running = || util::tagged_processes(&tag).iter().any(|(_, cmd)| cmd.contains("bench-decode"));
    while !engine_running() {
        assert!(Instant::now() < deadline, "no kiln bench-decode after 120s: {line}");
        assert!(child.try_wait().unwrap().is_none(), "xtask ended early: {line}");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SIGKILL cannot be trapped: only the kernel's parent-death signal can stop the cell.
    child.kill().unwrap();
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = util::tagged_processes(&tag);
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "processes outlived the SIGKILLed harness: {left:?} ({line})");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_signal_during_the_build_stops_cargo_and_every_process_it_started() {
    use std::os::unix::fs::PermissionsExt as _;
    let sb = Sandbox::new();
    sb.kiln_workspace();
    // `cargo build` as a cargo that starts rustc (a grandchild of xtask) and waits for it;
    // everything else (`cargo metadata`) goes to the real cargo.
    let real = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let d = sb.dir.path().display();
    let cargo = sb.path("cargo.sh");
    fs::write(
        &cargo,
        format!(
            "#!/bin/sh\nif [ \"$1\" != build ]; then exec '{real}' \"$@\"; fi\necho $$ > '{d}/cargo.pid'\nsleep 120 >/dev/null 2>&1 &\necho $! > '{d}/rustc.pid'\nwait\n"
        ),
    )
    .unwrap();
    fs::set_permissions(&cargo, fs::Permissions::from_mode(0o755)).unwrap();
    let (line, mut child) = sb.spawn_building(
        "bench-longprompt",
        &args(&["--models", TINY, "--lengths", "64"]),
        &[("CARGO", &cargo.display().to_string())],
    );
    let cargo_pid = util::wait_pid(&sb.path("cargo.pid"));
    let rustc_pid = util::wait_pid(&sb.path("rustc.pid"));
    rustix::process::kill_process(rustix::process::Pid::from_child(&child), rustix::process::Signal::INT)
        .unwrap();
    let status = child.wait().unwrap();
    // Checked before the pipes are read: a survivor would hold them open.
    let deadline = Instant::now() + Duration::from_secs(10);
    while util::alive(cargo_pid) || util::alive(rustc_pid) {
        if Instant::now() > deadline {
            // Leave nothing behind, then fail.
            for pid in [cargo_pid, rustc_pid] {
                let _ = rustix::process::kill_process(
                    rustix::process::Pid::from_raw(pid).unwrap(),
                    rustix::process::Signal::KILL,
                );
            }
            panic!(
                "after SIGINT: cargo alive {}, its rustc alive {} (xtask {status}): {line}",
                util::alive(cargo_pid),
                util::alive(rustc_pid)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let (mut stdout, mut stderr) = (String::new(), String::new());
    child.stdout.take().unwrap().read_to_string(&mut stdout).unwrap();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    let run = Run { cmd: line, status, stdout, stderr };
    run.expect_code(130).expect_stderr("interrupted by SIGINT during the build");
}

#[test]
fn oom_record_list_and_prune() {
    let sb = Sandbox::new();
    fs::write(
        sb.record(),
        "synthetic:tiny,512,2026-01-01T00:00:00Z,aaa1111,,a.csv,\nbroken,line\nsynthetic:tiny,2048,2026-03-01T00:00:00Z,bbb2222,99,b.csv,cpu:X\nsynthetic:small,512,2026-03-01T00:00:00Z,bbb2222,,b.csv,\n",
    )
    .unwrap();
    let record = sb.record();
    let file = record.to_str().unwrap();
    let run = sb.run("oom-record", &["list", "--file", file]);
    run.expect_code(0).expect_stdout("3 line(s), 1 malformed").expect_stdout("MALFORMED");
    sb.run("oom-record", &["prune", "--file", file]).expect_code(2).expect_stderr("prune needs a filter");
    let run = sb.run("oom-record", &["prune", "--file", file, "--model", TINY, "--before", "2026-02-01"]);
    run.expect_code(0).expect_stdout("removed 1 line(s)");
    let lines = sb.record_lines();
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert!(!lines.iter().any(|l| l.contains("aaa1111")));
    let run = sb.run("oom-record", &["prune", "--file", file, "--malformed", "--dry-run"]);
    run.expect_code(0).expect_stdout("would remove line 1: broken,line");
    assert_eq!(sb.record_lines().len(), 3);
    sb.run("oom-record", &["prune", "--file", file, "--malformed"]).expect_code(0);
    assert_eq!(sb.record_lines().len(), 2);
    sb.run("oom-record", &["prune", "--file", file, "--before", "03/01/2026"])
        .expect_code(2)
        .expect_stderr("YYYY-MM-DD");
    // A record that is not there is said to be missing, never listed as "0 lines".
    let missing = sb.path("no-record");
    for action in ["list", "prune"] {
        let mut args = vec![action, "--file", missing.to_str().unwrap()];
        if action == "prune" {
            args.push("--all");
        }
        let run = sb.run("oom-record", &args);
        run.expect_code(2).expect_stderr("no-record: no such file");
        assert!(!run.stdout.contains("line(s)"), "{run}");
    }
    // The default record (benchmarks/.oom-record under the root) is absent until a sweep
    // records an out-of-memory: said, exit 0.
    let run = sb.run("oom-record", &["list"]);
    run.expect_code(0).expect_stderr("does not exist: no sweep has recorded an out-of-memory here");
    assert!(!run.stdout.contains("line(s)"), "{run}");
}

#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    let sb = Sandbox::new();
    // More output than a pipe holds, so the writer meets the closed end.
    let text: String =
        (0..5000).map(|i| format!("synthetic:tiny,{i},2026-01-01,abc1234,,s.csv,\n")).collect();
    fs::write(sb.record(), text).unwrap();
    let record = sb.record();
    let mut cmd = sb.command("oom-record", &["list", "--file", record.to_str().unwrap()]);
    let mut child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let run = Run {
        cmd: format!("{cmd:?}"),
        status: out.status,
        stdout: String::new(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    run.expect_code(0);
    assert!(run.stderr.is_empty(), "a closed stdout is not an error to report{run}");
}

/// A fake engine's stderr line for kiln's pool refusing an allocation.
const KILN_OOM_LINE: &str = "out of memory: requested 1.00 KiB (1024 bytes) for kv with 0 B (0 bytes) in use, limit 1.00 KiB (1024 bytes)";

#[test]
fn only_evidence_of_running_out_of_memory_writes_a_record_line() {
    let sb = Sandbox::new();
    let panic = "printf \"thread 'main' panicked at src/plan.rs:9:5:\\nout of memory while planning 1000000000 layers\\nnote: run with \\`RUST_BACKTRACE=1\\` environment variable to display a backtrace\\n\" >&2; exit 101";
    let cases = [
        ("kill -9 $$", "FAIL:killed", "no out-of-memory kill in the cgroup"),
        (
            "echo 'memory allocation of 1099511627776 bytes failed' >&2; kill -6 $$",
            "FAIL:abort",
            "memory allocation of 1099511627776 bytes failed",
        ),
        (panic, "FAIL:bench", "panicked at src/plan.rs:9:5: out of memory while planning 1000000000 layers"),
        ("echo 'error: the pool said nothing' >&2; exit 3", "FAIL:bench", "the pool said nothing"),
    ];
    for (i, (bench, status, reason)) in cases.iter().enumerate() {
        let kiln = util::fake_kiln(&sb, &format!("kiln-{i}"), "exit 1", bench);
        let run = sb.run(
            "bench-longprompt",
            &args(&[
                "--kiln-bin",
                kiln.to_str().unwrap(),
                "--models",
                "fake",
                "--lengths",
                "64",
                "--no-estimate",
            ]),
        );
        run.expect_code(1).expect_stderr(status).expect_stderr(reason);
        assert_eq!(sb.statuses("fake"), expect(&[("64", status)]), "{run}");
        assert!(!sb.record().exists(), "no evidence, yet a record line{run}");
    }
    // kiln's exit 3 with its line is evidence.
    let bench = format!("echo 'error: {KILN_OOM_LINE}' >&2; exit 3");
    let kiln = util::fake_kiln(&sb, "kiln-oom", "exit 1", &bench);
    let run = sb.run(
        "bench-longprompt",
        &args(&[
            "--kiln-bin",
            kiln.to_str().unwrap(),
            "--models",
            "fake",
            "--lengths",
            "64",
            "--no-estimate",
        ]),
    );
    // Nothing was measured, so 1.
    run.expect_code(1);
    assert_eq!(sb.statuses("fake"), expect(&[("64", "SKIP:oom")]), "{run}");
    assert_eq!(sb.record_lines().len(), 1, "{run}");
}

#[test]
fn the_estimate_is_bounded_by_the_cell_timeout() {
    let sb = Sandbox::new();
    let kiln = util::fake_kiln(&sb, "kiln", "exec sleep 60", "exit 1");
    let start = Instant::now();
    let run = sb.run(
        "bench-longprompt",
        &args(&[
            "--kiln-bin",
            kiln.to_str().unwrap(),
            "--models",
            "fake",
            "--lengths",
            "64",
            "--cell-timeout",
            "1",
        ]),
    );
    run.expect_code(1).expect_stderr("timed out after 1s (--cell-timeout)");
    assert!(start.elapsed() < Duration::from_secs(30), "the estimate ran past the cell timeout{run}");
    assert_eq!(sb.statuses("fake"), expect(&[("64", "FAIL:estimate")]), "{run}");
}

#[test]
fn resume_trusts_only_whole_rows_and_refuses_other_knobs() {
    let sb = Sandbox::new();
    let sweep = args(&["--models", TINY, "--lengths", "64 128"]);
    sb.run("bench-longprompt", &sweep).expect_code(0);
    // The last row cut short: its last field loses a character (or its last comma) and
    // the newline.
    let text = fs::read_to_string(sb.csv()).unwrap();
    assert!(text.ends_with('\n'), "{text}");
    fs::write(sb.csv(), &text[..text.len() - 2]).unwrap();
    let csv = sb.csv();
    let mut resume = sweep.clone();
    resume.extend(["--resume", csv.to_str().unwrap()]);
    let run = sb.run("bench-longprompt", &resume);
    run.expect_code(0).expect_stderr("1 of 2 cells already have a row").expect_stderr("cut short");
    assert_eq!(sb.statuses(TINY), expect(&[("64", "ok"), ("128", "ok")]), "{run}");
    // Another knob is refused before anything runs, naming it, and the file is untouched.
    let before = fs::read(sb.csv()).unwrap();
    for (extra, needle) in [
        (vec!["--max-tokens", "8"], "--max-tokens 6 in the file, 8 in this run"),
        (vec!["--attention", "naive"], "--attention (default) in the file, naive in this run"),
        (vec!["--prefill-chunk", "16"], "--prefill-chunk (default) in the file, 16 in this run"),
        (
            vec!["--memory-limit", "1GiB"],
            "--memory-limit (bytes) (default) in the file, 1073741824 in this run",
        ),
    ] {
        let mut other: Vec<&str> = resume.clone();
        if extra[0] == "--max-tokens" {
            other =
                vec!["--max-tokens", "8", "--warmup-tokens", "1", "--models", TINY, "--lengths", "64 128"];
            other.extend(["--resume", csv.to_str().unwrap()]);
        } else {
            other.extend(extra.iter().copied());
        }
        let run = sb.run("bench-longprompt", &other);
        run.expect_code(2).expect_stderr(needle);
        assert_eq!(fs::read(sb.csv()).unwrap(), before, "a refused resume changed the file{run}");
    }
    // The knobs are columns of every row.
    let rows = sb.rows(&sb.csv());
    assert_eq!((rows[0].get("max_tokens"), rows[0].get("warmup_tokens")), ("6", "1"));
    assert_eq!((rows[0].get("attention"), rows[0].get("kv_dtype"), rows[0].get("threads")), ("", "", ""));
}

#[test]
fn the_output_is_locked_for_the_run_and_is_never_the_record() {
    let sb = Sandbox::new();
    fs::write(sb.record(), "synthetic:tiny,4096,2026-01-01,abc1234,,hand.csv,\n").unwrap();
    let record_before = fs::read(sb.record()).unwrap();
    // The record, spelled another way: through a symlink, and with a `./` detour.
    let link = sb.path("looks-like-a.csv");
    std::os::unix::fs::symlink(sb.record(), &link).unwrap();
    let detour = sb.dir.path().join(".").join("oom-record");
    for out in [link.to_str().unwrap(), detour.to_str().unwrap()] {
        let run = sb.run("bench-longprompt", &args(&["--models", TINY, "--lengths", "64", "--output", out]));
        run.expect_code(2).expect_stderr("is the OOM record");
        assert_eq!(fs::read(sb.record()).unwrap(), record_before, "the record was touched{run}");
    }
    // Another sweep holds the output: this one is refused, naming it, and truncates nothing.
    fs::write(sb.csv(), "rows of the other sweep\n").unwrap();
    let held = fs::File::open(sb.csv()).unwrap();
    rustix::fs::flock(&held, rustix::fs::FlockOperation::LockExclusive).unwrap();
    let run = sb.run("bench-longprompt", &args(&["--models", TINY, "--lengths", "64"]));
    run.expect_code(2).expect_stderr("being written by another run").expect_stderr("out.csv");
    assert_eq!(fs::read_to_string(sb.csv()).unwrap(), "rows of the other sweep\n");
    drop(held);
}

#[test]
fn every_flag_is_checked_before_anything_runs() {
    let sb = Sandbox::new();
    let run = sb.run("bench-longprompt", &["--models", TINY, "--lengths", "64", "--memory-limit", "12XB"]);
    run.expect_code(2).expect_stderr("--memory-limit").expect_stderr("\"12XB\"").expect_stderr("MiB");
    let run = sb.run_with(
        "bench-longprompt",
        &["--models", TINY, "--lengths", "64"],
        &[("KILN_MEMORY_LIMIT", "lots")],
    );
    run.expect_code(2).expect_stderr("KILN_MEMORY_LIMIT");
    let run = sb.run("bench-longprompt", &["--models", TINY, "--lengths", "-5"]);
    run.expect_code(2).expect_stderr("`-5` is not a non-negative integer");
    let run = sb.run("bench-longprompt", &["--models", TINY, "--lengths", "64", "--threads", "0"]);
    run.expect_code(2).expect_stderr("--threads");
    assert!(!sb.csv().exists() && !sb.path("runs").exists(), "something ran{run}");
}

#[test]
fn the_workspace_is_found_from_the_current_directory() {
    let sb = Sandbox::new();
    util::kiln_bin();
    // A second checkout: its own workspace, entered at a subdirectory.
    let ws = sb.path("checkout");
    fs::create_dir_all(ws.join("crates/x")).unwrap();
    fs::write(ws.join("Cargo.toml"), "[workspace]\nmembers = []\n").unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_xtask"));
    cmd.args(["bench-decode", "--models", TINY, "--max-tokens", "6", "--warmup-tokens", "1", "--kiln-bin"])
        .arg(util::kiln_bin())
        .current_dir(ws.join("crates/x"))
        .env("RAYON_NUM_THREADS", "1");
    let out = cmd.output().unwrap();
    let run = Run {
        cmd: format!("{cmd:?}"),
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    run.expect_code(0);
    let csvs: Vec<_> = fs::read_dir(ws.join("benchmarks"))
        .unwrap_or_else(|e| panic!("no benchmarks/ in the checkout ({e}){run}"))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with("_decode.csv"))
        .collect();
    assert_eq!(csvs.len(), 1, "{csvs:?}{run}");
    assert!(ws.join("benchmarks/runs").is_dir(), "{run}");
}

#[test]
fn a_signal_during_prune_leaves_the_record_whole_and_no_temporary_file() {
    let sb = Sandbox::new();
    // Long comment lines: cheap to parse, slow to write and sync, so the temporary file
    // lives long enough to be seen.
    let comment = format!("# {}\n", "x".repeat(256 << 10));
    let keep: String =
        (0..96).map(|i| format!("{comment}synthetic:tiny,{i},2026-01-01,abc1234,,s.csv,\n")).collect();
    let original = format!("{keep}gone,1,2026-01-01,abc1234,,s.csv,\n");
    let record = sb.record();
    let temp_files = || -> Vec<String> {
        fs::read_dir(sb.dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".tmp."))
            .collect()
    };
    let mut caught = 0;
    for _ in 0..20 {
        fs::write(&record, &original).unwrap();
        let mut cmd =
            sb.command("oom-record", &["prune", "--file", record.to_str().unwrap(), "--model", "gone"]);
        let mut child = cmd
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // SIGTERM the moment the temporary file appears.
        let pid = rustix::process::Pid::from_child(&child);
        while child.try_wait().unwrap().is_none() {
            if !temp_files().is_empty() {
                rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
                caught += 1;
                break;
            }
        }
        let status = child.wait().unwrap();
        assert!(temp_files().is_empty(), "a SIGTERM during the prune ({status}) left {:?}", temp_files());
        let now = fs::read_to_string(&record).unwrap();
        assert!(
            now == original || now == keep,
            "a SIGTERM during the prune ({status}) left a partial record"
        );
        if caught >= 3 {
            break;
        }
    }
    assert!(caught > 0, "the temporary file was never seen: the test proved nothing");
}

#[test]
fn repeat_interleaves_repetitions_and_resume_runs_only_the_missing_ones() {
    let sb = Sandbox::new();
    let sweep = args(&["--models", TINY, "--lengths", "64 128", "--repeat", "2"]);
    let run = sb.run("bench-longprompt", &sweep);
    run.expect_code(0)
        .expect_stdout("the geometric mean of the cell's ok repetitions")
        // `2 / 2`, then ` (N disturbed)` when the shared machine was busy.
        .expect_stdout("| synthetic:tiny@64 | 2 / 2")
        .expect_stdout("| synthetic:tiny@128 | 2 / 2");
    let order = |sb: &Sandbox| -> Vec<(String, String)> {
        sb.rows(&sb.csv())
            .iter()
            .map(|r| (r.get("prompt_target_len").to_string(), r.get("repetition").to_string()))
            .collect()
    };
    // All cells once, then all again: never one cell's repetitions back to back.
    assert_eq!(order(&sb), expect(&[("64", "1"), ("128", "1"), ("64", "2"), ("128", "2")]), "{run}");
    assert!(
        sb.rows(&sb.csv()).iter().all(|r| r.get("engine") == "kiln" && !r.get("engine_version").is_empty())
    );
    // Drop the last repetition's row: a resumed run measures only that one.
    let text = fs::read_to_string(sb.csv()).unwrap();
    let kept: Vec<&str> = text.lines().take(4).collect();
    fs::write(sb.csv(), kept.join("\n") + "\n").unwrap();
    let mut resume = sweep.clone();
    let csv = sb.csv();
    resume.extend(["--resume", csv.to_str().unwrap()]);
    let run = sb.run("bench-longprompt", &resume);
    run.expect_code(0).expect_stderr("3 of 4 cells already have a row");
    assert_eq!(run.stderr.matches(": ok: decode").count(), 1, "{run}");
    assert_eq!(order(&sb), expect(&[("64", "1"), ("128", "1"), ("64", "2"), ("128", "2")]), "{run}");
    // --repeat 0 is refused before anything runs.
    let bad = sb.run("bench-decode", &args(&["--models", TINY, "--repeat", "0"]));
    bad.expect_code(2).expect_stderr("--repeat");
}

#[test]
fn a_missing_peer_is_a_failed_row_and_the_sweep_goes_on() {
    let sb = Sandbox::new();
    let missing = sb.path("no-such-llama-bench");
    let peer = format!("llama-bench={}", missing.display());
    let run =
        sb.run("bench-decode", &args(&["--models", TINY_QWEN, "--prompt-tokens", "16", "--peer", &peer]));
    // kiln measured; the peer's row says why it has no measurement, and the run exits 1.
    run.expect_code(1).expect_stderr("FAIL:peer").expect_stdout("| synthetic:tiny-qwen@16 | kiln | 1 / 1");
    let rows = sb.rows(&sb.csv());
    let got: Vec<(&str, &str)> = rows.iter().map(|r| (r.get("engine"), r.get("status"))).collect();
    assert_eq!(got, [("kiln", "ok"), ("llama-bench", "FAIL:peer")], "{run}");
    assert!(rows[1].get("reason").contains("no such file"), "{run}");
}

/// A stand-in llama-bench: prints the JSON llama-bench prints for the test its arguments
/// ask for (`-p`, `-n`, `-d`), with a rate that depends on the shape, and logs its calls.
fn fake_llama_bench(sb: &Sandbox) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = sb.path("llama-bench");
    let log = sb.path("llama-bench.calls");
    let script = format!(
        r#"#!/bin/sh
echo "$@" >> {log}
p=0; n=0; d=0
while [ $# -gt 0 ]; do
  case "$1" in -p) p=$2; shift;; -n) n=$2; shift;; -d) d=$2; shift;; esac; shift
done
if [ "$n" = 0 ]; then ts=400.0; else ts=50.0; fi
cat <<JSON
[
  {{
    "build_commit": "f00dfee",
    "build_number": 7001,
    "model_filename": "m.gguf",
    "n_threads": 1,
    "n_prompt": $p,
    "n_gen": $n,
    "n_depth": $d,
    "avg_ns": 20000000,
    "stddev_ns": 0,
    "avg_ts": $ts,
    "stddev_ts": 0.0,
    "samples_ns": [ 20000000 ],
    "samples_ts": [ $ts ]
  }}
]
JSON
"#,
        log = log.display()
    );
    fs::write(&path, script).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
    path
}

#[test]
fn a_peer_runs_each_cell_interleaved_on_the_exported_model_and_the_summary_gives_ratios() {
    let sb = Sandbox::new();
    let bin = fake_llama_bench(&sb);
    let peer = format!("llama-bench={}", bin.display());
    let model = "synthetic:tiny-qwen@4bit-g32";
    let run = sb.run(
        "bench-longprompt",
        &args(&["--models", model, "--lengths", "16 32", "--repeat", "2", "--peer", &peer, "--threads", "1"]),
    );
    run.expect_code(0)
        .expect_stdout("| synthetic:tiny-qwen@4bit-g32@16 | peer (llama.cpp b7001 (f00dfee)) | 2 / 2")
        // The fake peer reports the same rates every time: an interval of no width, flagged.
        .expect_stdout("| 50.00 [50.00, 50.00] (n=2, zero width: every value equal, no measured spread")
        .expect_stdout("| 400.0 [400.0, 400.0] (n=2, zero width: every value equal, no measured spread")
        .expect_stdout("kiln/peer");
    let rows = sb.rows(&sb.csv());
    let order: Vec<(&str, &str, &str)> =
        rows.iter().map(|r| (r.get("prompt_target_len"), r.get("repetition"), r.get("engine"))).collect();
    assert_eq!(
        order,
        [
            ("16", "1", "kiln"),
            ("16", "1", "llama-bench"),
            ("32", "1", "kiln"),
            ("32", "1", "llama-bench"),
            ("16", "2", "llama-bench"),
            ("16", "2", "kiln"),
            ("32", "2", "llama-bench"),
            ("32", "2", "kiln"),
        ],
        "{run}"
    );
    let peer_row = rows.iter().find(|r| r.get("engine") == "llama-bench").unwrap();
    assert_eq!(peer_row.get("status"), "ok", "{run}");
    assert_eq!(peer_row.get("engine_version"), "llama.cpp b7001 (f00dfee)");
    assert_eq!((peer_row.get("decode_tok_s"), peer_row.get("prefill_tok_s")), ("50.0", "400.0"));
    assert!(peer_row.get("model_path").ends_with("synthetic_tiny-qwen_4bit-g32.gguf"), "{run}");
    // Two runs per peer cell, the model exported once: the prefill at depth 0, then the
    // timed decode steps (6 tokens - 1 from the prefill - 1 warm-up) at the prompt's depth.
    let calls = fs::read_to_string(sb.path("llama-bench.calls")).unwrap();
    let calls: Vec<&str> = calls.lines().collect();
    assert_eq!(calls.len(), 8, "{calls:?}");
    assert!(calls[0].contains("-p 16 -n 0 -d 0 -r 1 -t 1 -o json"), "{calls:?}");
    assert!(calls[1].contains("-p 0 -n 4 -d 16 -r 1 -t 1 -o json"), "{calls:?}");
    assert_eq!(run.stderr.matches("+peer").count(), 4, "{run}");
}

#[test]
fn until_ci_adds_repetitions_on_one_csv_until_narrow_or_the_budget_ends() {
    let sb = Sandbox::new();
    let run = sb.run(
        "bench-longprompt",
        &args(&["--models", TINY, "--lengths", "64", "--until-ci", "40", "--max-pairs", "6"]),
    );
    run.expect_code(0)
        .expect_stdout("--until-ci 40%: ")
        .expect_stdout("[95% interval from the confidence sequence on the logs")
        .expect_stdout("stopping rule: ");
    let reps: Vec<u32> = sb.rows(&sb.csv()).iter().map(|r| r.get("repetition").parse().unwrap()).collect();
    // At least the 4 a bounded interval needs, at most the budget, each once, in order.
    assert!((4..=6).contains(&reps.len()), "{reps:?}{run}");
    assert_eq!(reps, (1..=reps.len() as u32).collect::<Vec<_>>(), "{run}");
    let r = sb.run("bench-longprompt", &args(&["--models", TINY, "--lengths", "64", "--margin", "5"]));
    r.expect_code(2).expect_stderr("--margin judges paired ratios");
}

#[test]
fn a_directory_flag_naming_a_file_is_refused_before_anything_is_created() {
    let sb = Sandbox::new();
    let file = sb.path("a-file");
    fs::write(&file, "").unwrap();
    let x = sb.path("x.csv");
    let (file_s, x_s) = (file.to_str().unwrap(), x.to_str().unwrap());
    // Nothing but a-file may be in the sandbox afterwards: not x.csv, not the record, not
    // the runs directory.
    let below = file.join("below");
    let below_s = below.to_str().unwrap();
    let rec_below = file.join("oom-record");
    let out_below = file.join("x.csv");
    let cell = ["--models", "synthetic:tiny", "--lengths", "16", "--max-tokens", "4", "--warmup-tokens", "1"];
    for (task, flag, value, out) in [
        ("bench-longprompt", "--runs-dir", file_s, x_s),
        ("bench-longprompt", "--runs-dir", below_s, x_s),
        ("bench-decode", "--runs-dir", file_s, x_s),
        ("bench-longprompt", "--oom-record", rec_below.to_str().unwrap(), x_s),
        ("bench-longprompt", "--output", out_below.to_str().unwrap(), out_below.to_str().unwrap()),
    ] {
        let mut args = vec![flag, value];
        if flag != "--output" {
            args.extend(["--output", out]);
        }
        if task == "bench-longprompt" {
            args.extend(cell);
        } else {
            args.extend(["--models", "synthetic:tiny", "--max-tokens", "4", "--warmup-tokens", "1"]);
        }
        let r = sb.run(task, &args);
        let left: Vec<_> = fs::read_dir(sb.dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, ["a-file"], "{task} {flag} {value} created something{r}");
        r.expect_code(2).expect_stderr(&format!("{flag} {value}: {file_s} is not a directory: expected a "));
    }
}

/// A `cargo` for a task that builds kiln in the sandbox's workspace ([`Sandbox::kiln_workspace`]):
/// `cargo build` logs its call in `builds.log` and leaves the test's kiln binary where the
/// release build would; everything else (`cargo metadata`) goes to the real cargo. The
/// environment a run needs with it: `CARGO` and the sandbox's target directory.
fn fake_cargo(sb: &Sandbox) -> Vec<(String, String)> {
    use std::os::unix::fs::PermissionsExt as _;
    sb.kiln_workspace();
    let real = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let d = sb.dir.path().display();
    let kiln = util::kiln_bin().display();
    let cargo = sb.path("cargo.sh");
    fs::write(
        &cargo,
        format!(
            "#!/bin/sh\nif [ \"$1\" != build ]; then exec '{real}' \"$@\"; fi\necho \"$*\" >> '{d}/builds.log'\nmkdir -p '{d}/target/release'\ncp '{kiln}' '{d}/target/release/kiln'\n"
        ),
    )
    .unwrap();
    fs::set_permissions(&cargo, fs::Permissions::from_mode(0o755)).unwrap();
    vec![
        ("CARGO".to_string(), cargo.display().to_string()),
        ("CARGO_TARGET_DIR".to_string(), sb.path("target").display().to_string()),
    ]
}

/// Runs a task that builds kiln (through [`fake_cargo`]'s environment) to its end.
fn run_building(sb: &Sandbox, task: &str, args: &[&str], env: &[(String, String)]) -> Run {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let (cmd, child) = sb.spawn_building(task, args, &env);
    let out = child.wait_with_output().unwrap();
    Run {
        cmd,
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

#[test]
fn until_ci_is_one_run_one_build_one_report_one_summary_and_a_skipped_cell_is_skipped_once() {
    let sb = Sandbox::new();
    let env = fake_cargo(&sb);
    // The CPU ladder 128 512 2048 reaches past tiny's 1024-token context: 2048 is skipped
    // by rule (derived from the defaults, so the run still exits 0). A target of 0.5%
    // is not met on a shared machine, so the budget of 6 repetitions ends the run after
    // three rounds (4, 5, 6).
    let run = run_building(
        &sb,
        "bench-longprompt",
        &args(&["--models", TINY, "--until-ci", "0.5", "--max-pairs", "6"]),
        &env,
    );
    run.expect_code(0);
    let builds = fs::read_to_string(sb.path("builds.log")).unwrap_or_default();
    assert_eq!(builds.lines().count(), 1, "kiln built once per run, not per round: {builds}{run}");
    let runs: Vec<_> = fs::read_dir(sb.path("runs")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(runs.len(), 1, "one run directory: {runs:?}{run}");
    assert!(runs[0].join("report.html").is_file(), "the run's report.html{run}");
    let statuses = sb.statuses(TINY);
    let skipped: Vec<_> = statuses.iter().filter(|(len, _)| len == "2048").collect();
    assert_eq!(skipped.len(), 1, "the skipped cell keeps its one row: {statuses:?}{run}");
    assert_eq!(skipped[0].1, "SKIP:context");
    for len in ["128", "512"] {
        let n = statuses.iter().filter(|(l, s)| l == len && s == "ok").count();
        assert_eq!(n, 6, "{len}: {statuses:?}{run}");
    }
    // One summary, at the end; each round adds one progress line with the whole run's ETA.
    assert_eq!(run.stdout.matches("stopping rule:").count(), 1, "{run}");
    assert_eq!(run.stdout.matches("| cell |").count(), 1, "one summary table{run}");
    assert_eq!(run.stdout.matches("--until-ci 0.5%: ").count(), 1, "one verdict line{run}");
    let progress: Vec<&str> =
        run.stderr.lines().filter(|l| l.starts_with("--until-ci 0.5%: round ")).collect();
    assert_eq!(progress.len(), 2, "one line per round that another follows: {progress:?}{run}");
    assert!(progress.iter().all(|l| l.contains("widest interval") && l.contains("ETA")), "{progress:?}");
    assert_eq!(run.stderr.matches("sweep: ").count(), 1, "{run}");
    // The budget's end says what would settle it, in repetitions and in time.
    run.expect_stdout("--max-repetitions 6 reached");
    let settle = run.stdout.lines().find(|l| l.contains(" more repetitions would ")).unwrap_or("");
    assert!(settle.contains("under 0.5% (") && settle.contains("about "), "{settle}{run}");
}

#[test]
fn a_build_behind_another_cargo_on_the_target_directory_says_so() {
    let sb = Sandbox::new();
    let env = fake_cargo(&sb);
    fs::create_dir_all(sb.path("target/release")).unwrap();
    // Another cargo's build holds the release directory's lock, as cargo takes it.
    let held = fs::File::create(sb.path("target/release/.cargo-lock")).unwrap();
    rustix::fs::flock(&held, rustix::fs::FlockOperation::LockExclusive).unwrap();
    let run = run_building(&sb, "bench-longprompt", &args(&["--models", TINY, "--lengths", "64"]), &env);
    run.expect_code(0).expect_stderr("waiting for another cargo");
    let line = run.stderr.lines().find(|l| l.contains("waiting for another cargo")).unwrap();
    assert!(line.contains(&sb.path("target").display().to_string()), "names the target directory: {line}");
    drop(held);
    // Without another cargo, no such line.
    let run = run_building(&sb, "bench-longprompt", &args(&["--models", TINY, "--lengths", "64"]), &env);
    run.expect_code(0);
    assert!(!run.stderr.contains("waiting for another cargo"), "{run}");
}

#[test]
fn help_describes_what_each_task_accepts() {
    let help = |task: &str| {
        let out =
            std::process::Command::new(env!("CARGO_BIN_EXE_xtask")).args([task, "--help"]).output().unwrap();
        assert!(out.status.success(), "{task} --help: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // bench-longprompt refuses --margin and has no pairs: its help says neither.
    let lp = help("bench-longprompt");
    assert!(!lp.contains("--margin"), "{lp}");
    assert!(!lp.contains("ABBA") && !lp.contains("pairs"), "{lp}");
    assert!(
        lp.contains("--until-ci")
            && lp.contains("--max-repetitions")
            && lp.contains("repetitions of every cell"),
        "{lp}"
    );
    // The pairs tasks keep their words.
    let k = help("bench-kernels");
    assert!(k.contains("--max-pairs") && k.contains("--margin"), "{k}");
    // --rounds names one thing: bench-kernels' A/B rounds; the pin tax's requests per
    // stream have their own name.
    let p = help("qmv-pin-tax");
    assert!(!p.contains("--rounds"), "{p}");
    assert!(p.contains("--requests-per-stream"), "{p}");
    // Every --max-time is a budget the default pair cap does not cut.
    for h in [&lp, &k, &p] {
        assert!(h.contains("none with --max-time"), "{h}");
    }
}
