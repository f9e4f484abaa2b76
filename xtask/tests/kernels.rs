//! `cargo xtask bench-kernels` against a stand-in cargo (given as `CARGO`): a signal
//! stops the children it runs, as every task's children are stopped, and their own
//! children with them, with or without `--compare`. criterion itself never runs here.

use std::fs;
use std::io::Read as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A process that exists and is not a zombie.
fn alive(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

/// The pid in `path`, once it is there.
fn wait_pid(path: &Path) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(pid) = fs::read_to_string(path).ok().and_then(|s| s.trim().parse().ok()) {
            return pid;
        }
        assert!(Instant::now() < deadline, "the stand-in cargo never started");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sigint_while_listing_the_benchmarks_stops_cargo_and_its_children() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    // `cargo bench ... -- --list`, as a cargo that runs the bench binary (a grandchild of
    // xtask) and waits for it.
    let cargo = dir.path().join("cargo.sh");
    fs::write(
        &cargo,
        format!("#!/bin/sh\necho $$ > '{d}/cargo.pid'\nsleep 120 &\necho $! > '{d}/bench.pid'\nwait\n"),
    )
    .unwrap();
    fs::set_permissions(&cargo, fs::Permissions::from_mode(0o755)).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_xtask"));
    cmd.arg("bench-kernels")
        .env("CARGO", &cargo)
        .env("CRITERION_HOME", dir.path().join("criterion"))
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let cargo_pid = wait_pid(&dir.path().join("cargo.pid"));
    let bench_pid = wait_pid(&dir.path().join("bench.pid"));
    rustix::process::kill_process(rustix::process::Pid::from_child(&child), rustix::process::Signal::INT)
        .unwrap();
    let status = child.wait().unwrap();
    // Checked before stderr is read: a surviving child holds the pipe open.
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(cargo_pid) || alive(bench_pid) {
        if Instant::now() > deadline {
            // Leave nothing behind, then fail.
            for pid in [cargo_pid, bench_pid] {
                let _ = rustix::process::kill_process(
                    rustix::process::Pid::from_raw(pid).unwrap(),
                    rustix::process::Signal::KILL,
                );
            }
            panic!(
                "after SIGINT: cargo alive {}, its child alive {} (xtask {status})",
                alive(cargo_pid),
                alive(bench_pid)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert_eq!(status.code(), Some(130), "status {status}\nstderr:\n{stderr}");
    assert!(stderr.contains("interrupted by SIGINT during listing the kernel benchmarks"), "{stderr}");
}

/// Waits up to 10 s for `pids` to end; otherwise kills them (leaving nothing behind) and
/// fails with `context`.
fn expect_gone(pids: &[i32], context: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|&p| alive(p)) {
        if Instant::now() > deadline {
            let left: Vec<i32> = pids.iter().copied().filter(|&p| alive(p)).collect();
            for &pid in &left {
                let _ = rustix::process::kill_process(
                    rustix::process::Pid::from_raw(pid).unwrap(),
                    rustix::process::Signal::KILL,
                );
            }
            panic!("processes {left:?} outlived the signal: {context}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A repository of one commit to compare with, a stand-in cargo whose build reports a
/// stand-in `kernels` bench binary, and that binary: it lists one benchmark, and a run of
/// it starts a child (as criterion's bench binary is one process, this stands for whatever
/// it would start) and waits. While `hang-build` exists the build itself starts a child (a
/// rustc) and waits. Each records its pids.
fn compare_sandbox() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let git = |args: &[&str]| {
        let out = Command::new("git").current_dir(dir.path()).args(args).output().unwrap();
        assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    fs::write(dir.path().join("README"), "a revision to compare with\n").unwrap();
    fs::write(dir.path().join(".gitignore"), "/target/\n/*.sh\n/*.pid\n/hang-build\n").unwrap();
    git(&["init", "-q", "-b", "main"]);
    git(&["add", "-A"]);
    git(&["-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "rev"]);
    let scripts = [
        (
            "cargo.sh",
            format!(
                "#!/bin/sh\nif [ -e '{d}/hang-build' ]; then\n  echo $$ > '{d}/cargo.pid'\n  sleep 120 >/dev/null 2>&1 &\n  echo $! > '{d}/rustc.pid'\n  wait\nfi\necho '{{\"reason\":\"compiler-artifact\",\"target\":{{\"name\":\"kernels\",\"kind\":[\"bench\"]}},\"executable\":\"{d}/kernels.sh\"}}'\n"
            ),
        ),
        (
            "kernels.sh",
            format!(
                "#!/bin/sh\ncase \"$*\" in *--list*) echo 'qmv/x/t1: benchmark'; exit 0 ;; esac\necho $$ > '{d}/bench.pid'\nsleep 120 >/dev/null 2>&1 &\necho $! > '{d}/bench-child.pid'\nwait\n"
            ),
        ),
    ];
    for (name, text) in scripts {
        let p = dir.path().join(name);
        fs::write(&p, text).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
    }
    dir
}

/// Starts `bench-kernels --compare HEAD` in `dir`, waits for the pids in `wait_for`, sends
/// `sig` and checks that those processes end; returns xtask's status and stderr.
fn signal_a_comparison(
    dir: &Path,
    wait_for: &[&str],
    sig: rustix::process::Signal,
) -> (std::process::ExitStatus, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_xtask"));
    cmd.args(["bench-kernels", "--compare", "HEAD", "--quick"])
        .env("CARGO", dir.join("cargo.sh"))
        .env("CRITERION_HOME", dir.join("target/criterion"))
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let line = format!("{cmd:?}");
    let mut child = cmd.spawn().unwrap();
    let pids: Vec<i32> = wait_for.iter().map(|name| wait_pid(&dir.join(name))).collect();
    rustix::process::kill_process(rustix::process::Pid::from_child(&child), sig).unwrap();
    let status = child.wait().unwrap();
    // Checked before stderr is read: a surviving child holds the pipe open.
    expect_gone(&pids, &format!("xtask {status}: {line}"));
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    (status, stderr)
}

#[test]
fn sigint_while_building_the_revision_stops_the_build_and_removes_its_worktree() {
    let dir = compare_sandbox();
    fs::write(dir.path().join("hang-build"), "").unwrap();
    let (status, stderr) =
        signal_a_comparison(dir.path(), &["cargo.pid", "rustc.pid"], rustix::process::Signal::INT);
    assert_eq!(status.code(), Some(130), "status {status}\nstderr:\n{stderr}");
    assert!(stderr.contains("interrupted by SIGINT during building the kernel benches in"), "{stderr}");
    let out = Command::new("git").current_dir(dir.path()).args(["worktree", "list"]).output().unwrap();
    let list = String::from_utf8_lossy(&out.stdout);
    assert_eq!(list.lines().count(), 1, "a worktree survived the interrupt:\n{list}\nstderr:\n{stderr}");
}

#[test]
fn sigterm_during_a_criterion_run_of_a_comparison_stops_it_and_its_children() {
    let dir = compare_sandbox();
    let (status, stderr) =
        signal_a_comparison(dir.path(), &["bench.pid", "bench-child.pid"], rustix::process::Signal::TERM);
    assert_eq!(status.code(), Some(143), "status {status}\nstderr:\n{stderr}");
    assert!(stderr.contains("interrupted by SIGTERM during the criterion run of qmv/x/t1"), "{stderr}");
}

/// The times (ns) the stand-in bench binary of [`recorded_sandbox`] reports, round by
/// round, for A (REV) and B (the working tree), with the bytes each benchmark declares: a
/// clear regression, the two rounds whose B/A interval spans a factor of 160 either way,
/// and a read-bandwidth benchmark on a loaded machine.
const RECORDED: [(&str, [f64; 2], [f64; 2], u64); 3] = [
    ("qmv/q4_g64_n4096_k4096_m1/t1", [100.0, 102.0], [130.0, 134.0], 2000),
    ("qmv_wide/q4_g64_n4096_k4096_m8/t1", [100.0, 100.0], [88.8, 197.7], 2000),
    ("read_bandwidth/sum_1024MiB_start/t1", [25.0, 30.0], [40.0, 20.0], 1000),
];

/// [`compare_sandbox`] with a bench binary that, instead of running criterion, writes
/// criterion's files with the times of [`RECORDED`], one round after another.
fn recorded_sandbox() -> tempfile::TempDir {
    let dir = compare_sandbox();
    let d = dir.path().display();
    let mut listing = String::new();
    for (id, a, b, bytes) in RECORDED {
        listing.push_str(&format!("{id}: benchmark\\n"));
        let key = id.replace('/', "_");
        for (side, times) in [("a", a), ("b", b)] {
            let text: String = times.iter().map(|t| format!("{t}\n")).collect();
            fs::write(dir.path().join(format!("times-{side}-{key}")), text).unwrap();
        }
        fs::write(dir.path().join(format!("bytes-{key}")), format!("{bytes}\n")).unwrap();
    }
    // REV's binary is a copy named `kernels-<sha>`; the working tree's is this script.
    let script = format!(
        r#"#!/bin/sh
case "$*" in *--list*) printf '{listing}'; exit 0 ;; esac
case "$(basename "$0")" in kernels.sh) side=b ;; *) side=a ;; esac
id=${{2#^}}; id=${{id%$}}
key=$(echo "$id" | tr / _)
n=$(cat "{d}/count-$side-$key" 2>/dev/null || echo 0); n=$((n + 1)); echo $n > "{d}/count-$side-$key"
t=$(sed -n "${{n}}p" "{d}/times-$side-$key")
bytes=$(cat "{d}/bytes-$key")
mkdir -p "$CRITERION_HOME/$id/new"
e="{{\"confidence_interval\":{{\"confidence_level\":0.95,\"lower_bound\":$t,\"upper_bound\":$t}},\"point_estimate\":$t,\"standard_error\":0.0}}"
echo "{{\"mean\":$e,\"slope\":null}}" > "$CRITERION_HOME/$id/new/estimates.json"
echo "{{\"full_id\":\"$id\",\"throughput\":{{\"Bytes\":$bytes}}}}" > "$CRITERION_HOME/$id/new/benchmark.json"
"#
    );
    fs::write(dir.path().join("kernels.sh"), script).unwrap();
    dir
}

/// Runs xtask with `args` in `dir` (the stand-in cargo, criterion's directory under it);
/// returns its stdout, failing with everything it printed when it fails.
fn xtask_in(dir: &Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(args)
        .env("CARGO", dir.join("cargo.sh"))
        .env("CRITERION_HOME", dir.join("target/criterion"))
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "xtask {args:?}: {}\nstdout:\n{stdout}\nstderr:\n{stderr}", out.status);
    stdout.into_owned()
}

/// A cell's text as a markdown table prints it.
fn md_cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

#[test]
fn the_pull_request_comment_says_what_the_terminal_said_and_a_wide_pair_is_undecided() {
    let dir = recorded_sandbox();
    let terminal = xtask_in(dir.path(), &["bench-kernels", "--compare", "HEAD", "--rounds", "2"]);
    // The two rounds of 0.888 and 1.977: undecided, with the rounds and time that would
    // settle it, and never "within noise".
    let wide = terminal.lines().find(|l| l.contains("qmv_wide")).unwrap();
    assert!(!wide.contains("within noise"), "{terminal}");
    assert!(wide.contains("| 1.325 [0.008, 214.047] (n=2, within a factor of 161.5) |"), "{terminal}");
    assert!(
        wide.contains("| undecided at ±5%: about 24 more rounds would likely settle it (about "),
        "{terminal}"
    );
    let url = "https://example.invalid/run/7";
    let comment = xtask_in(dir.path(), &["bench-kernels", "--pr-comment", "--run-url", url]);
    let readings = fs::read_to_string(dir.path().join("target/criterion/readings.json")).unwrap();
    let sheet: serde_json::Value = serde_json::from_str(&readings).unwrap();
    let context = format!("terminal:\n{terminal}\ncomment:\n{comment}\nreadings.json:\n{readings}");

    // One headline, printed alike, answering the question and keeping the read bandwidth
    // apart from the kernels.
    let headline = sheet["headline"].as_str().unwrap();
    assert!(
        headline.starts_with(
            "Did this change regress a kernel? yes: 1 of 2 kernel benchmarks regressed by more than 5%."
        ) && headline.contains("Kernels at ±5%: 1 regressed, 0 improved, 0 same, 1 undecided (of 2).")
            && headline.contains(
                "the machine and not the change: 0 regressed, 0 improved, 0 same, 1 undecided (of 1)."
            ),
        "{context}"
    );
    let (top, folded) = comment.split_once("<details>").unwrap();
    for page in [&terminal, top] {
        assert!(page.contains(headline), "{context}");
    }
    // Every cell of the record is in the terminal and in the comment's report as written.
    let mut verdicts = Vec::new();
    for table in sheet["tables"].as_array().unwrap() {
        for row in table["rows"].as_array().unwrap() {
            for cell in row.as_array().unwrap() {
                let text = md_cell(cell["text"].as_str().unwrap());
                assert!(terminal.contains(&text) && folded.contains(&text), "{text}\n{context}");
                if let Some(j) = cell.get("judged") {
                    verdicts.push((
                        row[0]["text"].as_str().unwrap().to_string(),
                        j["verdict"]["verdict"].clone(),
                        text,
                    ));
                }
            }
        }
    }
    assert_eq!(verdicts.len(), 3, "{context}");
    let (_, v, text) = verdicts.iter().find(|(id, ..)| id.contains("qmv_wide")).unwrap();
    assert_eq!((v.as_str(), wide.contains(text.as_str())), (Some("undecided"), true), "{context}");
    assert!(!terminal.contains("within noise") && !comment.contains("within noise"), "{context}");
    // Above the fold: the regressed kernel's row as the terminal printed it, nothing else.
    let regressed = terminal.lines().find(|l| l.contains("`qmv/q4_g64_n4096_k4096_m1/t1`")).unwrap();
    assert!(regressed.contains("| regressed by more than 5% |") && top.contains(regressed), "{context}");
    assert!(!top.contains("| `qmv_wide") && !top.contains("| `read_bandwidth"), "{context}");
    assert!(
        top.contains(&format!("Measured by [this run]({url}).")) && comment.ends_with("</details>\n"),
        "{context}"
    );
}

#[test]
fn the_verdict_s_margin_is_what_the_help_says() {
    let dir = recorded_sandbox();
    let help = xtask_in(dir.path(), &["bench-kernels", "--help"]);
    let flat = help.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        flat.contains("--margin <PCT> With --compare: the verdict's margin, in percent [default: 5, or --noise-threshold]")
            && flat.contains("With --compare and no --margin: the verdict's margin as a fraction (0.05 is ±5%)"),
        "{help}"
    );
    let compare = |extra: &[&str]| {
        let mut args = vec!["bench-kernels", "--compare", "HEAD", "--rounds", "2"];
        args.extend(extra);
        // Each comparison starts its rounds again.
        for f in fs::read_dir(dir.path()).unwrap() {
            let p = f.unwrap().path();
            if p.file_name().unwrap().to_string_lossy().starts_with("count-") {
                fs::remove_file(p).unwrap();
            }
        }
        xtask_in(dir.path(), &args)
    };
    let regressed =
        |out: &str| out.lines().find(|l| l.contains("`qmv/q4_g64_n4096_k4096_m1/t1`")).unwrap().to_string();
    // 1.307 [1.222, 1.397]: beyond ±5% (the default), within ±50%, beyond ±20%.
    assert!(regressed(&compare(&[])).contains("| regressed by more than 5% |"));
    let out = compare(&["--noise-threshold", "0.5"]);
    assert!(out.contains("| verdict at ±50% |") && regressed(&out).contains("| same within ±50% |"), "{out}");
    let out = compare(&["--noise-threshold", "0.5", "--margin", "20"]);
    assert!(
        out.contains("| verdict at ±20% |") && regressed(&out).contains("| regressed by more than 20% |"),
        "{out}"
    );
}
