//! `--runner slurm` against a real cluster: the one-node cluster scripts/ci/slurm-up.sh
//! starts (CI starts it and sets KILN_SLURM_TEST=1 and SLURM_CONF). Without
//! KILN_SLURM_TEST=1 these tests say so and do nothing; with it, a cluster that cannot be
//! reached fails them with the reason.

#[allow(dead_code)]
mod util;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

use util::{Run, Sandbox, expect};

const SHORT: [&str; 4] = ["--max-tokens", "6", "--warmup-tokens", "1"];

/// Whether the tests should run; when they should, the cluster must answer.
fn cluster_up() -> bool {
    match std::env::var("KILN_SLURM_TEST").as_deref() {
        Ok("1") => {}
        _ => {
            eprintln!("KILN_SLURM_TEST is not 1: no Slurm cluster to test against (scripts/ci/slurm-up.sh)");
            return false;
        }
    }
    let out = Command::new("sinfo").args(["-h", "-o", "%t"]).output();
    match out {
        Ok(o) if o.status.success() => {
            let states = String::from_utf8_lossy(&o.stdout).to_string();
            assert!(
                states.lines().any(|s| matches!(s.trim(), "idle" | "mix" | "alloc")),
                "KILN_SLURM_TEST=1 but no node is up: sinfo says {states:?}"
            );
            true
        }
        Ok(o) => panic!(
            "KILN_SLURM_TEST=1 but sinfo failed ({}): {} (SLURM_CONF={:?})",
            o.status,
            String::from_utf8_lossy(&o.stderr),
            std::env::var("SLURM_CONF")
        ),
        Err(e) => panic!("KILN_SLURM_TEST=1 but sinfo cannot run: {e}"),
    }
}

fn args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut a: Vec<&str> = SHORT.to_vec();
    a.extend_from_slice(extra);
    a
}

/// `args(plan)` on the cluster: `--runner slurm --shared-dir DIR`, then `extra`.
fn slurm_args<'a>(plan: &[&'a str], dir: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = args(plan);
    a.extend(["--runner", "slurm", "--shared-dir", dir]);
    a.extend_from_slice(extra);
    a
}

fn shared(sb: &Sandbox) -> String {
    let dir = sb.path("shared");
    fs::create_dir_all(&dir).unwrap();
    dir.display().to_string()
}

/// The one run directory under the shared one, once `file` is in it.
fn run_dir_with(sb: &Sandbox, file: &str, within: Duration) -> PathBuf {
    let start = Instant::now();
    loop {
        if let Ok(entries) = fs::read_dir(sb.path("shared")) {
            for e in entries.flatten() {
                if e.path().join(file).is_file() {
                    return e.path();
                }
            }
        }
        assert!(start.elapsed() < within, "no run directory with {file} after {within:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn job_ids(run_dir: &Path) -> Vec<String> {
    let v: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(run_dir.join("jobs.json")).unwrap()).unwrap();
    v["job_ids"].as_array().unwrap().iter().map(|j| j.as_str().unwrap().to_string()).collect()
}

/// Waits for a spawned `--wait` sweep, bounded; kills it and fails when it hangs.
fn finish(line: String, mut child: Child, within: Duration) -> Run {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > within {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{line} still running after {within:?}; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out: Output = child.wait_with_output().unwrap();
    Run {
        cmd: line,
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn scancel(id: &str) {
    let st = Command::new("scancel").arg(id).status().expect("scancel");
    assert!(st.success(), "scancel {id}: {st}");
}

/// Every column but the timings, the date and the host, as `(column, value)` rows.
fn comparable(sb: &Sandbox, csv: &Path) -> Vec<Vec<(String, String)>> {
    // `disturbed` says what else ran beside a cell: the other test binaries, here.
    const VARY: [&str; 8] = [
        "prefill_ms",
        "prefill_tok_s",
        "decode_ms",
        "decode_tok_s",
        "max_rss_bytes",
        "date",
        "host",
        "disturbed",
    ];
    sb.rows(csv)
        .into_iter()
        .map(|r| r.0.into_iter().filter(|(k, _)| !VARY.contains(&k.as_str())).collect())
        .collect()
}

#[test]
fn a_slurm_sweep_backstops_across_tasks_and_merges_what_a_local_run_writes() {
    if !cluster_up() {
        return;
    }
    let plan = ["--models", "synthetic:tiny synthetic:tiny-qwen", "--lengths", "16 32 64"];
    let fake = [("KILN_BENCH_FAKE_OOM", "synthetic:tiny:16")];
    let sb = Sandbox::new();
    let dir = shared(&sb);
    let a = slurm_args(&plan, &dir, &["--wait"]);
    let run = sb.run_with("bench-longprompt", &a, &fake);
    run.expect_code(0)
        .expect_stderr("submitted synthetic:tiny as job ")
        .expect_stderr("SKIP:oom_backstop")
        .expect_stderr("[6/6] ")
        .expect_stderr("slurm overhead per cell (6 cells)")
        .expect_stdout("6 cells: 3 ok, 1 SKIP:oom, 2 SKIP:oom_backstop");
    assert_eq!(
        sb.statuses("synthetic:tiny"),
        expect(&[("16", "SKIP:oom"), ("32", "SKIP:oom_backstop"), ("64", "SKIP:oom_backstop")]),
        "{run}"
    );
    // One record line, written by the task that ran out of memory, in the given record.
    assert_eq!(sb.record_lines().len(), 1, "{:?}{run}", sb.record_lines());
    assert!(sb.record_lines()[0].starts_with("synthetic:tiny,16,"), "{:?}", sb.record_lines());
    // Each cell ran in its own task: one row file per cell.
    let run_dir = run_dir_with(&sb, "jobs.json", Duration::ZERO);
    assert_eq!(
        fs::read_dir(run_dir.join("rows"))
            .unwrap()
            .filter(|e| { e.as_ref().unwrap().path().extension().is_some_and(|x| x == "csv") })
            .count(),
        6
    );

    // The same plan run here, with its own record: the same rows, less timings and host.
    let local = Sandbox::new();
    let run_local = local.run_with("bench-longprompt", &args(&plan), &fake);
    run_local.expect_code(0);
    let (s, l) = (comparable(&sb, &sb.csv()), comparable(&local, &local.csv()));
    assert_eq!(s.len(), 6);
    for (i, (a, b)) in s.iter().zip(&l).enumerate() {
        assert_eq!(a, b, "row {} differs{run}{run_local}", i + 1);
    }
    assert_eq!(s, l);
}

#[test]
fn a_cancelled_task_becomes_a_fail_row_with_slurms_state() {
    if !cluster_up() {
        return;
    }
    let sb = Sandbox::new();
    let dir = shared(&sb);
    // One model at a time: tiny's array waits on tiny-qwen's, so its first task is still
    // queued when it is cancelled.
    let a = slurm_args(
        &["--models", "synthetic:tiny-qwen,synthetic:tiny", "--lengths", "16 32"],
        &dir,
        &["--max-parallel", "1", "--wait"],
    );
    let (line, child) = sb.spawn("bench-longprompt", &a, &[]);
    let run_dir = run_dir_with(&sb, "jobs.json", Duration::from_secs(60));
    let ids = job_ids(&run_dir);
    assert_eq!(ids.len(), 2);
    let cancelled = format!("{}_0", ids[1]);
    scancel(&cancelled);
    let run = finish(line, child, Duration::from_secs(90));
    run.expect_code(1)
        .expect_stderr(&format!("Slurm task {cancelled} ended CANCELLED"))
        .expect_stderr("exit 1: synthetic:tiny@16 failed (FAIL:slurm_cancelled)");
    assert_eq!(sb.statuses("synthetic:tiny-qwen"), expect(&[("16", "ok"), ("32", "ok")]), "{run}");
    assert_eq!(
        sb.statuses("synthetic:tiny"),
        expect(&[("16", "FAIL:slurm_cancelled"), ("32", "ok")]),
        "{run}"
    );
    // `merge` gives the same rows again, from the run directory alone.
    let merged = sb.path("merged.csv");
    let out = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["merge", &run_dir.display().to_string(), "--output", &merged.display().to_string()])
        .current_dir(sb.dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let statuses: Vec<String> = sb.rows(&merged).iter().map(|r| r.get("status").to_string()).collect();
    assert_eq!(statuses, ["ok", "ok", "FAIL:slurm_cancelled", "ok"]);
    let reason = sb.rows(&merged)[2].get("reason").to_string();
    assert!(
        reason.starts_with(&format!("Slurm task {cancelled} ended CANCELLED without a row (")),
        "{reason}"
    );
}

#[test]
fn an_interrupt_while_waiting_cancels_the_arrays_and_merges_what_finished() {
    if !cluster_up() {
        return;
    }
    let sb = Sandbox::new();
    let dir = shared(&sb);
    // An engine whose bench never ends on its own: the task is running when the signal
    // comes.
    let kiln = util::fake_kiln(&sb, "kiln-slow", "exit 1", "sleep 120");
    let kiln = kiln.display().to_string();
    let a = slurm_args(
        &["--models", "synthetic:tiny", "--lengths", "16 32", "--no-estimate", "--kiln-bin", &kiln],
        &dir,
        &["--wait"],
    );
    let (line, child) = sb.spawn("bench-longprompt", &a, &[]);
    let run_dir = run_dir_with(&sb, "jobs.json", Duration::from_secs(60));
    // Wait until the first task's engine is running (its log exists), then interrupt.
    let start = Instant::now();
    while !fs::read_dir(run_dir.join("logs")).is_ok_and(|d| d.count() > 0) {
        assert!(start.elapsed() < Duration::from_secs(60), "the first task never started");
        std::thread::sleep(Duration::from_millis(100));
    }
    let st = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(st.success());
    let run = finish(line, child, Duration::from_secs(90));
    run.expect_code(130)
        .expect_stderr("interrupted by SIGINT: cancelling jobs")
        .expect_stdout("interrupted by SIGINT after 0 of 2 cells (2 cancelled)");
    // Each cancelled cell is reported once: by --wait as it ends, not again by the merge.
    for cell in ["synthetic:tiny@16", "synthetic:tiny@32"] {
        let lines =
            run.stderr.lines().filter(|l| l.contains(&format!("] {cell}: FAIL:slurm_cancelled"))).count();
        assert_eq!(lines, 1, "{cell}{run}");
    }
    assert_eq!(
        sb.statuses("synthetic:tiny"),
        expect(&[("16", "FAIL:slurm_cancelled"), ("32", "FAIL:slurm_cancelled")]),
        "{run}"
    );
    let ids = job_ids(&run_dir);
    let q = Command::new("squeue").args(["-h", "-j", &ids[0]]).output().unwrap();
    assert!(
        String::from_utf8_lossy(&q.stdout).trim().is_empty(),
        "still queued: {}",
        String::from_utf8_lossy(&q.stdout)
    );
}

#[test]
fn a_dry_run_prints_the_scripts_and_submits_nothing() {
    // No cluster needed: nothing reaches Slurm.
    let sb = Sandbox::new();
    let dir = shared(&sb);
    let run = sb.run(
        "bench-longprompt",
        &slurm_args(
            &["--models", "synthetic:tiny synthetic:tiny-qwen", "--lengths", "32 16"],
            &dir,
            &[
                "--max-parallel",
                "1",
                "--partition",
                "gpu",
                "--gres",
                "gpu:1",
                "--sbatch-arg=--mem=4G",
                "--dry-run",
            ],
        ),
    );
    run.expect_code(0)
        .expect_stdout("#SBATCH --array=0-1%1\n")
        .expect_stdout("#SBATCH --partition=gpu\n#SBATCH --gres=gpu:1\n#SBATCH --mem=4G\n")
        .expect_stdout("# JOB_2=$(sbatch --parsable --dependency=afterany:$JOB_1 ")
        .expect_stdout("# synthetic:tiny-qwen@16 synthetic:tiny-qwen@32\n")
        .expect_stdout("cells=(1 0)\n")
        .expect_stderr("nothing was written or submitted");
    assert_eq!(fs::read_dir(sb.path("shared")).unwrap().count(), 0, "{run}");
    assert!(!sb.csv().exists(), "a dry run leaves no CSV{run}");
    // Nothing ran, so there is no plot to miss, and --resume is not a Slurm flag.
    assert!(!run.stderr.contains("no plot") && !run.stderr.contains("--resume"), "{run}");
}

#[test]
fn slurm_flags_are_checked_before_anything_runs() {
    let sb = Sandbox::new();
    let cases: [(&[&str], &str); 3] = [
        (&["--partition", "gpu"], "--partition applies to --runner slurm only"),
        (&["--runner", "slurm"], "--runner slurm needs --shared-dir DIR"),
        (&["--runner", "slurm", "--shared-dir", "nowhere", "--dry-run"], "no such directory"),
    ];
    for (extra, msg) in cases {
        let mut a = vec!["--models", "synthetic:tiny", "--lengths", "16"];
        a.extend_from_slice(extra);
        sb.run("bench-longprompt", &a).expect_code(2).expect_stderr(msg);
    }
    // A value that would end its #SBATCH line, or a KILN_* name no shell can export, is
    // bad input: nothing is written, no script printed.
    let dir = shared(&sb);
    let canary = sb.path("pwned");
    let partition = format!("gpu\ntouch {}", canary.display());
    let mut a = vec!["--models", "synthetic:tiny", "--lengths", "16"];
    a.extend(["--runner", "slurm", "--shared-dir", &dir, "--dry-run", "--partition", &partition]);
    let run = sb.run("bench-longprompt", &a);
    run.expect_code(2).expect_stderr("holds the control character '\\n'");
    assert!(!run.stdout.contains("#SBATCH"), "{run}");
    let a = [
        "--models",
        "synthetic:tiny",
        "--lengths",
        "16",
        "--runner",
        "slurm",
        "--shared-dir",
        &dir,
        "--dry-run",
    ];
    let run = sb.run_with("bench-longprompt", &a, &[("KILN_X;touch y", "1")]);
    run.expect_code(2).expect_stderr("is not a shell variable name");
    assert!(!canary.exists());
    let run = sb.run("merge", &[&sb.dir.path().display().to_string()]);
    run.expect_code(2).expect_stderr("no sweep.json: expected a run directory written by `--runner slurm`");
}

#[test]
fn bench_decode_runs_on_slurm_too() {
    if !cluster_up() {
        return;
    }
    let sb = Sandbox::new();
    let dir = shared(&sb);
    let run = sb.run(
        "bench-decode",
        &slurm_args(
            &["--models", "synthetic:tiny,synthetic:tiny-qwen", "--prompt-tokens", "16"],
            &dir,
            &["--wait"],
        ),
    );
    run.expect_code(0).expect_stdout("2 cells: 2 ok");
    let rows = sb.rows(&sb.csv());
    let got: Vec<(&str, &str)> = rows.iter().map(|r| (r.get("model"), r.get("status"))).collect();
    assert_eq!(got, [("synthetic:tiny", "ok"), ("synthetic:tiny-qwen", "ok")], "{run}");
}
