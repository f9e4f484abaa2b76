//! `cargo xtask bench-kernels` against a stand-in cargo (given as `CARGO`): a signal
//! stops the children it runs, as every task's children are stopped, and their own
//! children with them. criterion itself never runs here.

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
