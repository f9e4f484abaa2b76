//! `cargo xtask bisect` end to end on a scripted history: a temporary git repository
//! whose stand-in engine (a shell script) gains a sleep in one commit, measured by a
//! script that times it. The bisect must name that commit, resume without measuring
//! anything again, and leave no worktree behind, also when interrupted.

#[allow(dead_code)]
mod util;

use std::fs;
use std::io::Read as _;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use util::{Run, Sandbox};

fn git(repo: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .current_dir(repo)
        .args(["-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false"])
        .args(args)
        .output()
        .expect("git");
    assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn write_exec(path: &Path, text: &str) {
    fs::write(path, text).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
}

/// Six commits; the fourth makes the engine sleep 0.9 s instead of 0.3 s (long enough
/// that a loaded machine's fork and exec noise stays small beside it). Returns the
/// commits, oldest first.
fn history(repo: &Path) -> Vec<String> {
    history_of(repo, |i| format!("#!/bin/sh\nsleep {}\n", if i >= 4 { "0.9" } else { "0.3" }))
}

/// Six commits whose stand-in engine (commit `i`, from 1) is the script `engine(i)`.
fn history_of(repo: &Path, engine: impl Fn(usize) -> String) -> Vec<String> {
    fs::create_dir_all(repo).unwrap();
    git(repo, &["init", "-q", "-b", "main"]);
    let mut shas = Vec::new();
    for i in 1..=6 {
        write_exec(&repo.join("engine.sh"), &engine(i));
        fs::write(repo.join("notes.txt"), format!("change {i}\n")).unwrap();
        git(repo, &["add", "-A"]);
        git(repo, &["commit", "-q", "-m", &format!("change {i}")]);
        shas.push(git(repo, &["rev-parse", "HEAD"]));
    }
    shas
}

/// Times one run of the engine it is given, in milliseconds.
fn measurer(dir: &Path) -> String {
    let p = dir.join("measure.sh");
    write_exec(
        &p,
        "#!/bin/sh\nstart=$(date +%s%N)\n\"$1\"\nend=$(date +%s%N)\necho \"time_ms=$(( (end - start) / 1000000 ))\"\n",
    );
    p.display().to_string()
}

fn bisect_args(sb: &Sandbox, repo: &Path, shas: &[String], extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "--good",
        &shas[0],
        "--bad",
        &shas[5],
        "--metric",
        "time_ms",
        "--margin",
        "25",
        "--max-pairs",
        "16",
        "--no-build",
        "--bin",
        "engine.sh",
        "--repo",
        &repo.display().to_string(),
        "--runs-dir",
        &sb.path("runs").display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a.extend(["--".to_string(), measurer(sb.dir.path()), "{bin}".to_string()]);
    a
}

fn worktrees(repo: &Path) -> usize {
    git(repo, &["worktree", "list"]).lines().count()
}

#[test]
fn bisect_names_the_commit_that_added_the_sleep_and_resumes_without_measuring_again() {
    let sb = Sandbox::new();
    let repo = sb.path("repo");
    let shas = history(&repo);
    let args = bisect_args(&sb, &repo, &shas, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = sb.run("bisect", &args);
    run.expect_code(0).expect_stdout(&format!("first bad commit: {} change 4", shas[3]));
    // Step 0 confirms the bad revision; then probes, each with its evidence.
    run.expect_stdout(&format!("| 0 | {} | change 6 |", &shas[5][..12])).expect_stdout("| like bad |");
    run.expect_stdout("| like good |");
    assert_eq!(worktrees(&repo), 1, "no worktree is left behind{run}");
    let dir = fs::read_dir(sb.path("runs")).unwrap().next().unwrap().unwrap().path();
    let measured = fs::read_to_string(dir.join("measurements.jsonl")).unwrap().lines().count();
    assert!(measured >= 8, "{run}");

    // Resumed: the same answer from the values already measured, and none taken again.
    let resumed = bisect_args(&sb, &repo, &shas, &["--resume", &dir.display().to_string()]);
    let resumed: Vec<&str> = resumed.iter().map(String::as_str).collect();
    let again = sb.run("bisect", &resumed);
    again.expect_code(0).expect_stdout(&format!("first bad commit: {} change 4", shas[3]));
    let after = fs::read_to_string(dir.join("measurements.jsonl")).unwrap().lines().count();
    assert_eq!(after, measured, "a resumed bisection measured again{again}");
}

#[test]
fn a_bad_revision_that_is_not_bad_and_bad_input_end_the_bisection_plainly() {
    let sb = Sandbox::new();
    let repo = sb.path("repo");
    let shas = history(&repo);
    // change 1 against change 3: the same engine, nothing to bisect.
    let mut args = bisect_args(&sb, &repo, &shas, &[]);
    let i = args.iter().position(|a| a == &shas[5]).unwrap();
    args[i] = shas[2].clone();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    sb.run("bisect", &args).expect_code(1).expect_stdout("nothing to bisect");
    let mut swapped = bisect_args(&sb, &repo, &shas, &[]);
    swapped.swap(1, 3);
    let swapped: Vec<&str> = swapped.iter().map(String::as_str).collect();
    sb.run("bisect", &swapped).expect_code(2).expect_stderr("is not an ancestor of --bad");
    assert_eq!(worktrees(&repo), 1);
}

#[test]
fn ctrl_c_mid_measurement_exits_130_and_leaves_no_worktree() {
    let sb = Sandbox::new();
    let repo = sb.path("repo");
    let shas = history(&repo);
    let args = bisect_args(&sb, &repo, &shas, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (line, mut child) = sb.spawn("bisect", &args, &[]);
    let deadline = Instant::now() + Duration::from_secs(60);
    // Wait until it measures (a log of a run exists), then interrupt it.
    let measuring = || {
        fs::read_dir(sb.path("runs"))
            .ok()
            .and_then(|mut d| d.next())
            .is_some_and(|e| e.unwrap().path().join("logs").is_dir())
    };
    while !measuring() {
        assert!(Instant::now() < deadline, "no measurement after 60 s: {line}");
        std::thread::sleep(Duration::from_millis(20));
    }
    rustix::process::kill_process(rustix::process::Pid::from_child(&child), rustix::process::Signal::INT)
        .unwrap();
    let status = child.wait().unwrap();
    let (mut stdout, mut stderr) = (String::new(), String::new());
    child.stdout.take().unwrap().read_to_string(&mut stdout).unwrap();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    let run = Run { cmd: line, status, stdout, stderr };
    run.expect_code(130).expect_stdout("interrupted by SIGINT: resume with --resume");
    assert_eq!(worktrees(&repo), 1, "a worktree survived the interrupt{run}");
}

/// A stand-in for `cargo build --release --package kiln` in a revision's worktree (given
/// to the bisect as `CARGO`): it copies the worktree's engine script to where the build
/// would leave kiln, counts its builds in the target dir and logs each build's directory
/// and that count to `dir/builds.log`. While `dir/hang` exists (or `dir/hang-later`, and
/// the target dir has a build already) it instead starts a grandchild, records both pids
/// and waits, as cargo waits on rustc; while `dir/fail-later` exists a build after the
/// first fails. The grandchild's output goes nowhere, so if it outlives the run it does
/// not hold the run's pipes open.
fn fake_cargo(dir: &Path) -> String {
    let p = dir.join("cargo.sh");
    let d = dir.display();
    write_exec(
        &p,
        &format!(
            r#"#!/bin/sh
mkdir -p "$CARGO_TARGET_DIR/release"
n=$(cat "$CARGO_TARGET_DIR/builds" 2>/dev/null || echo 0)
echo "$PWD $n" >> '{d}/builds.log'
if [ -e '{d}/hang' ] || {{ [ -e '{d}/hang-later' ] && [ "$n" -gt 0 ]; }}; then
  sleep 120 >/dev/null 2>&1 &
  echo $! > '{d}/grandchild.pid'
  echo $$ > '{d}/cargo.pid'
  wait
fi
if [ -e '{d}/fail-later' ] && [ "$n" -gt 0 ]; then
  echo 'error: could not compile kiln' >&2
  exit 101
fi
echo $((n + 1)) > "$CARGO_TARGET_DIR/builds"
cp engine.sh "$CARGO_TARGET_DIR/release/kiln"
"#
        ),
    );
    p.display().to_string()
}

/// Bisect args that build each revision (with [`fake_cargo`]) from `good` to `bad`.
fn build_args(sb: &Sandbox, repo: &Path, good: &str, bad: &str, extra: &[&str]) -> Vec<String> {
    // Four pairs at most: step 0 then ends the run either way (like good or undecided).
    let mut a: Vec<String> =
        ["--good", good, "--bad", bad, "--metric", "time_ms", "--margin", "25", "--max-pairs", "4"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    a.extend(["--repo".into(), repo.display().to_string()]);
    a.extend(["--runs-dir".into(), sb.path("runs").display().to_string()]);
    a.extend(extra.iter().map(|s| s.to_string()));
    a.extend(["--".to_string(), measurer(sb.dir.path()), "{bin}".to_string()]);
    a
}

/// A process that exists and is not a zombie.
fn alive(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

/// The pid the fake build wrote in `name`, once it has.
fn wait_pid(sb: &Sandbox, name: &str, line: &str) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(pid) = fs::read_to_string(sb.path(name)).ok().and_then(|s| s.trim().parse().ok()) {
            return pid;
        }
        assert!(Instant::now() < deadline, "the build never started after 60 s: {line}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Signals a spawned xtask and collects how it ended.
fn signal_and_collect(line: String, mut child: std::process::Child, sig: rustix::process::Signal) -> Run {
    rustix::process::kill_process(rustix::process::Pid::from_child(&child), sig).unwrap();
    let status = child.wait().unwrap();
    let (mut stdout, mut stderr) = (String::new(), String::new());
    child.stdout.take().unwrap().read_to_string(&mut stdout).unwrap();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    Run { cmd: line, status, stdout, stderr }
}

/// The run directories under the sandbox's runs, oldest first.
fn run_dirs(sb: &Sandbox) -> Vec<std::path::PathBuf> {
    let mut d: Vec<_> = fs::read_dir(sb.path("runs")).unwrap().map(|e| e.unwrap().path()).collect();
    d.sort();
    d
}

#[test]
fn a_signal_in_the_first_build_stops_the_whole_build_and_the_run_resumes_from_there() {
    let sb = Sandbox::new();
    let repo = sb.path("repo");
    let shas = history(&repo);
    let cargo = fake_cargo(sb.dir.path());
    fs::write(sb.path("hang"), "").unwrap();
    // change 1 against change 3: the same engine, so a finished run ends quickly.
    let args = build_args(&sb, &repo, &shas[0], &shas[2], &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (line, child) = sb.spawn("bisect", &args, &[("CARGO", &cargo)]);
    let grandchild = wait_pid(&sb, "grandchild.pid", &line);
    let run = signal_and_collect(line, child, rustix::process::Signal::INT);
    let dir = run_dirs(&sb).pop().unwrap();
    run.expect_code(130)
        .expect_stdout(&format!("interrupted by SIGINT: resume with --resume {}", dir.display()));
    // The build's own child too, not cargo alone: the whole group was stopped.
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(grandchild) {
        assert!(Instant::now() < deadline, "the build's child {grandchild} outlived the interrupt{run}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(worktrees(&repo), 1, "a worktree survived the interrupt{run}");

    // Stopped before its first value, the run directory is still resumable.
    fs::remove_file(sb.path("hang")).unwrap();
    let resumed = build_args(&sb, &repo, &shas[0], &shas[2], &["--resume", &dir.display().to_string()]);
    let resumed: Vec<&str> = resumed.iter().map(String::as_str).collect();
    let again = sb.run_with("bisect", &resumed, &[("CARGO", &cargo)]);
    again.expect_code(1).expect_stdout("nothing to bisect");
    assert_eq!(run_dirs(&sb).len(), 1, "the resumed run made a new directory{again}");
    assert_eq!(worktrees(&repo), 1, "{again}");
}

#[test]
fn a_worktree_left_by_a_run_killed_in_its_build_is_removed_by_the_next_run() {
    let sb = Sandbox::new();
    let repo = sb.path("repo");
    let shas = history(&repo);
    let cargo = fake_cargo(sb.dir.path());
    let args_of = |extra: &[&str]| build_args(&sb, &repo, &shas[0], &shas[2], extra);
    // Kills a run in its first build with SIGKILL, which it cannot trap: its worktree
    // stays registered, and the build's child is killed here by hand.
    let kill_in_build = |args: &[String]| {
        fs::write(sb.path("hang"), "").unwrap();
        let _ = fs::remove_file(sb.path("grandchild.pid"));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (line, child) = sb.spawn("bisect", &args, &[("CARGO", &cargo)]);
        let grandchild = wait_pid(&sb, "grandchild.pid", &line);
        let run = signal_and_collect(line, child, rustix::process::Signal::KILL);
        assert_eq!(worktrees(&repo), 2, "the killed run's worktree is registered{run}");
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_raw(grandchild).unwrap(),
            rustix::process::Signal::KILL,
        );
        fs::remove_file(sb.path("hang")).unwrap();
    };

    // Resumed: the run's own worktree is removed and added again.
    kill_in_build(&args_of(&[]));
    let dir = run_dirs(&sb).pop().unwrap();
    let resumed = args_of(&["--resume", &dir.display().to_string()]);
    let resumed: Vec<&str> = resumed.iter().map(String::as_str).collect();
    let again = sb.run_with("bisect", &resumed, &[("CARGO", &cargo)]);
    again.expect_code(1).expect_stdout("nothing to bisect");
    assert_eq!(worktrees(&repo), 1, "the stale worktree is still registered{again}");

    // A new run removes the worktree another, killed, run left.
    kill_in_build(&args_of(&[]));
    let killed = run_dirs(&sb).pop().unwrap();
    let fresh = args_of(&[]);
    let fresh: Vec<&str> = fresh.iter().map(String::as_str).collect();
    let next = sb.run_with("bisect", &fresh, &[("CARGO", &cargo)]);
    next.expect_code(1).expect_stdout("nothing to bisect").expect_stderr("is gone");
    assert_eq!(worktrees(&repo), 1, "the stale worktree is still registered{next}");
    let left: Vec<_> = fs::read_dir(&killed)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("worktree-"))
        .collect();
    assert!(left.is_empty(), "the stale worktree's files are still there: {left:?}{next}");
    // And the killed run's target dir (its build had started one) goes with it.
    assert!(!killed.join("target").exists(), "the killed run's target dir is still there{next}");
}

#[test]
fn a_metric_of_zero_or_below_is_refused_at_its_first_reading() {
    for value in ["0", "-2.5"] {
        let sb = Sandbox::new();
        let repo = sb.path("repo");
        let shas = history(&repo);
        let constant = sb.path("constant.sh");
        write_exec(&constant, &format!("#!/bin/sh\necho time_ms={value}\n"));
        let mut args = bisect_args(&sb, &repo, &shas, &[]);
        let n = args.len();
        args[n - 2] = constant.display().to_string();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let run = sb.run("bisect", &args);
        // The good revision is measured first (pair 0 is good, probe).
        run.expect_code(2)
            .expect_stderr(&format!("time_ms={value} measured on {} (the good revision)", &shas[0][..12]))
            .expect_stderr("expected a positive number");
        let dir = run_dirs(&sb).pop().unwrap();
        let outs = fs::read_dir(dir.join("logs"))
            .unwrap()
            .filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "out"));
        assert_eq!(outs.count(), 1, "measured again after the first reading{run}");
        let recorded = fs::read_to_string(dir.join("measurements.jsonl")).unwrap();
        assert!(recorded.is_empty(), "the value was recorded: {recorded}{run}");
        assert_eq!(worktrees(&repo), 1, "{run}");
    }
}

/// The 75x history: commits 1 to 3 serve 7500 tokens/s, commits 4 to 6 serve 100 (0.013
/// of it, the issue's bad commit).
fn history_75x(repo: &Path) -> Vec<String> {
    history_of(repo, |i| format!("#!/bin/sh\necho {}\n", if i >= 4 { 100 } else { 7500 }))
}

/// A measurer of the engine's `tok_s` with 20-30% noise from run to run: each run takes
/// the next factor of a fixed cycle (so the test is repeatable), as a shared host would
/// scatter it.
fn noisy_measurer(dir: &Path) -> String {
    let p = dir.join("noisy.sh");
    let d = dir.display();
    write_exec(
        &p,
        &format!(
            r#"#!/bin/sh
n=$(cat '{d}/noise-count' 2>/dev/null || echo 0)
echo $((n + 1)) > '{d}/noise-count'
base=$("$1")
awk -v n="$n" -v base="$base" 'BEGIN {{ split("1.00 1.30 0.75 1.20 0.80 1.25 0.72 1.10", f, " "); printf "tok_s=%.3f\n", base * f[n % 8 + 1] }}'
"#
        ),
    );
    p.display().to_string()
}

/// Bisect args for the 75x history at the default margin and pairs; `build` builds each
/// revision with the `CARGO` the caller gives, else the worktree's engine.sh is taken.
fn args_75x(sb: &Sandbox, repo: &Path, shas: &[String], build: bool, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> =
        ["--good", &shas[0], "--bad", &shas[5], "--metric", "tok_s"].iter().map(|s| s.to_string()).collect();
    if !build {
        a.extend(["--no-build".into(), "--bin".into(), "engine.sh".into()]);
    }
    a.extend(["--repo".into(), repo.display().to_string()]);
    a.extend(["--runs-dir".into(), sb.path("runs").display().to_string()]);
    a.extend(extra.iter().map(|s| s.to_string()));
    a.extend(["--".to_string(), noisy_measurer(sb.dir.path()), "{bin}".to_string()]);
    a
}

/// Every `"text"` of a readings.json, in order.
fn texts(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                match (k.as_str(), x) {
                    ("text", serde_json::Value::String(t)) => out.push(t.clone()),
                    _ => texts(x, out),
                }
            }
        }
        serde_json::Value::Array(xs) => xs.iter().for_each(|x| texts(x, out)),
        _ => {}
    }
}

#[test]
fn a_75x_regression_under_30_percent_noise_is_bisected_in_a_few_pairs_and_the_run_dir_says_what_the_terminal_said()
 {
    let sb = Sandbox::new();
    let repo = sb.path("repo");
    let shas = history_75x(&repo);
    let args = args_75x(&sb, &repo, &shas, false, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = sb.run("bisect", &args);
    run.expect_code(0).expect_stdout(&format!("first bad commit: {} change 4", shas[3]));
    // Each revision is called at its first judgement (four pairs), near good or near bad
    // however far from good within the noise.
    run.expect_stdout("| like bad |").expect_stdout("| like good |").expect_stdout("(n=4, ");
    let dir = run_dirs(&sb).pop().unwrap();
    let measured = fs::read_to_string(dir.join("measurements.jsonl")).unwrap().lines().count();
    assert!(measured <= 3 * 4 * 2, "{measured} runs for three revisions{run}");

    // The run directory holds what the terminal printed: summary.md is stdout, and every
    // text of readings.json is printed there as it stands.
    let summary = fs::read_to_string(dir.join("summary.md")).unwrap();
    assert_eq!(summary, run.stdout, "summary.md differs from stdout{run}");
    let json: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(dir.join("readings.json")).expect("readings.json")).unwrap();
    let mut all = Vec::new();
    texts(&json, &mut all);
    assert!(all.len() >= 3 * 4, "too few cells in readings.json: {all:?}");
    for t in &all {
        assert!(
            run.stdout.contains(&t.replace('|', "\\|")),
            "{t:?} of readings.json is not on the terminal{run}"
        );
    }
    assert!(json["headline"].as_str().unwrap().contains(&shas[3]), "{json}");
    // And its report.html renders the same texts, cell for cell.
    let page = fs::read_to_string(dir.join("report.html")).expect("report.html beside the readings");
    let escaped = |t: &str| {
        t.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
            .replace('"', "&quot;")
            .replace('\'', "&#39;")
    };
    for t in &all {
        assert!(page.contains(&escaped(t)), "{t:?} of readings.json is not on report.html");
    }
}

/// The directory and the count of earlier builds in the target dir, of each build the
/// fake cargo ran.
fn builds(sb: &Sandbox) -> Vec<(String, usize)> {
    fs::read_to_string(sb.path("builds.log"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let (dir, n) = l.rsplit_once(' ').unwrap();
            (dir.to_string(), n.parse().unwrap())
        })
        .collect()
}

/// What a run directory holds besides its records: worktrees and target dirs.
fn build_leftovers(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("worktree") || n == "target")
        .collect()
}

#[test]
fn every_revision_builds_in_one_worktree_and_one_target_dir_which_go_at_the_end() {
    let sb = Sandbox::new();
    let repo = sb.path("repo");
    let shas = history_75x(&repo);
    let cargo = fake_cargo(sb.dir.path());
    let args = args_75x(&sb, &repo, &shas, true, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = sb.run_with("bisect", &args, &[("CARGO", &cargo)]);
    run.expect_code(0).expect_stdout(&format!("first bad commit: {} change 4", shas[3]));
    // The cost is said before the first build starts.
    let cost =
        run.stderr.find("the first build of a cold target dir").unwrap_or_else(|| panic!("no cost{run}"));
    assert!(cost < run.stderr.find("building ").unwrap(), "the cost came after the first build{run}");
    // Good, bad and two midpoints, each checked out at one path and built in one target
    // dir that already holds the earlier builds (so cargo rebuilds only what changed).
    let b = builds(&sb);
    assert_eq!(b.len(), 4, "{b:?}{run}");
    assert!(b.iter().all(|(d, _)| *d == b[0].0), "revisions were built in different worktrees: {b:?}{run}");
    assert_eq!(b.iter().map(|(_, n)| *n).collect::<Vec<_>>(), [0, 1, 2, 3], "a cold target dir: {b:?}{run}");
    let dir = run_dirs(&sb).pop().unwrap();
    assert_eq!(build_leftovers(&dir), Vec::<String>::new(), "the build was left behind{run}");
    assert_eq!(worktrees(&repo), 1, "{run}");

    // --keep-build keeps both, unlocked, so the next bisect does not take them for stale.
    let _ = fs::remove_file(sb.path("builds.log"));
    let args = args_75x(&sb, &repo, &shas, true, &["--keep-build"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let kept = sb.run_with("bisect", &args, &[("CARGO", &cargo)]);
    kept.expect_code(0).expect_stderr("kept");
    let dir = run_dirs(&sb).pop().unwrap();
    let mut left = build_leftovers(&dir);
    left.sort();
    assert_eq!(left.len(), 2, "{left:?}{kept}");
    assert_eq!(worktrees(&repo), 2, "{kept}");
    assert!(!git(&repo, &["worktree", "list", "--porcelain"]).contains("locked"), "{kept}");
    let wt = dir.join(left.iter().find(|n| n.starts_with("worktree")).unwrap());
    git(&repo, &["worktree", "remove", "--force", &wt.display().to_string()]);
}

#[test]
fn a_failed_or_interrupted_later_build_removes_the_worktree_and_the_target_dir() {
    let sb = Sandbox::new();
    let repo = sb.path("repo");
    let shas = history_75x(&repo);
    let cargo = fake_cargo(sb.dir.path());
    let args = args_75x(&sb, &repo, &shas, true, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();

    fs::write(sb.path("fail-later"), "").unwrap();
    let failed = sb.run_with("bisect", &args, &[("CARGO", &cargo)]);
    failed.expect_code(1).expect_stderr("failed");
    let dir = run_dirs(&sb).pop().unwrap();
    assert_eq!(build_leftovers(&dir), Vec::<String>::new(), "a failed build left its build behind{failed}");
    assert_eq!(worktrees(&repo), 1, "{failed}");
    fs::remove_file(sb.path("fail-later")).unwrap();

    // Interrupted in the second build, with a warm target dir.
    fs::write(sb.path("hang-later"), "").unwrap();
    let (line, child) = sb.spawn("bisect", &args, &[("CARGO", &cargo)]);
    let grandchild = wait_pid(&sb, "grandchild.pid", &line);
    let run = signal_and_collect(line, child, rustix::process::Signal::TERM);
    run.expect_code(143).expect_stdout("interrupted by SIGTERM: resume with --resume");
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(grandchild) {
        assert!(Instant::now() < deadline, "the build's child {grandchild} outlived the signal{run}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let dir = run_dirs(&sb).pop().unwrap();
    assert_eq!(
        build_leftovers(&dir),
        Vec::<String>::new(),
        "an interrupted build left its build behind{run}"
    );
    assert_eq!(worktrees(&repo), 1, "{run}");
}
