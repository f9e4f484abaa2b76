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
