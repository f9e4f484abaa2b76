//! `cargo xtask bench-quality` end to end on a tiny synthetic model: a reference pass and
//! measured passes through the real `kiln score`, one CSV row per scheme, the markdown
//! table, and a second run that reuses the reference and compares a foreign file; a
//! failed rerun keeps the finished CSV, a concurrent one is refused on the lock, and a
//! signal stops the scoring child as every task's children are stopped.

// Shared with the sweep tests; this one needs only `kiln_bin`.
#[allow(dead_code)]
mod util;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `cargo xtask bench-quality` on the tiny model with `args`, `kiln` as the engine.
fn command(out_dir: &Path, kiln: &Path, args: &[&str]) -> Command {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_xtask"));
    cmd.args(["bench-quality", "--models", "synthetic:tiny@4bit"]).args(args);
    // The short windows, unless the test sets a flag itself.
    for pair in [["--window", "64"], ["--first-scored", "32"], ["--max-windows", "2"], ["--threads", "1"]] {
        if !args.contains(&pair[0]) {
            cmd.args(pair);
        }
    }
    cmd.arg("--kiln-bin").arg(kiln).arg("--out-dir").arg(out_dir).current_dir(root).stdin(Stdio::null());
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("KILN_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// The CSV's header and rows.
fn read_csv(path: &Path) -> (Vec<String>, Vec<Vec<String>>) {
    let mut rdr = csv::Reader::from_path(path).unwrap();
    let header: Vec<String> = rdr.headers().unwrap().iter().map(str::to_string).collect();
    let rows: Vec<Vec<String>> =
        rdr.records().map(|r| r.unwrap().iter().map(str::to_string).collect()).collect();
    (header, rows)
}

fn describe_output(out: &std::process::Output) -> String {
    format!(
        "\nstatus: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs `cargo xtask bench-quality` on the tiny model with `args`; returns the CSV's
/// header and rows and a description of the run for failures.
fn run(out_dir: &Path, args: &[&str]) -> (Vec<String>, Vec<Vec<String>>, String) {
    let out = command(out_dir, util::kiln_bin(), args).output().unwrap();
    let describe = describe_output(&out);
    assert!(out.status.success(), "bench-quality failed{describe}");
    let (header, rows) = read_csv(&out_dir.join("quality.csv"));
    (header, rows, describe)
}

#[test]
fn every_scheme_the_engine_knows_is_one_bench_quality_takes() {
    // The list is the engine's (kiln-protocol's ActScheme): int16-wide8 was refused here.
    let dir = tempfile::tempdir().unwrap();
    let (header, rows, describe) = run(&dir.path().join("q"), &["--schemes", "int16-wide8"]);
    let at = header.iter().position(|h| h == "scheme").unwrap();
    assert_eq!(rows.len(), 1, "{describe}");
    assert_eq!(rows[0][at], "int16-wide8", "{describe}");
    let out = command(&dir.path().join("bad"), util::kiln_bin(), &["--schemes", "int4"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", describe_output(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("accepted values are int16, int8 (or int), int16-wide8, f32"), "{stderr}");
}

#[test]
fn bench_quality_scores_each_scheme_against_the_f32_reference() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("q");
    let (header, rows, describe) = run(&out_dir, &["--schemes", "int8,int16,f32"]);
    let col = |row: &Vec<String>, name: &str| -> String {
        row[header.iter().position(|h| h == name).unwrap_or_else(|| panic!("no column {name}"))].clone()
    };
    let num = |row: &Vec<String>, name: &str| -> f64 { col(row, name).parse().unwrap() };
    assert_eq!(rows.len(), 3, "{describe}");
    let (int, int16, f32) = (&rows[0], &rows[1], &rows[2]);
    let names: Vec<String> = rows.iter().map(|r| col(r, "scheme")).collect();
    assert_eq!(names, ["int8", "int16", "f32"]);
    for r in rows.iter() {
        assert_eq!(num(r, "positions"), 62.0, "2 windows x 31 positions{describe}");
        assert!(num(r, "ppl") > 1.0 && num(r, "ppl_ref") > 1.0);
        assert!((0.0..=1.0).contains(&num(r, "top1_agree")));
        assert!(num(r, "kld_max") >= num(r, "kld_p99") && num(r, "kld_p99") >= num(r, "kld_median"));
        assert!(!col(r, "commit").is_empty() && !col(r, "host").is_empty());
    }
    // The f32 scheme differs from the reference only by the f16 cache; int8 activations
    // on random 4-bit weights move the distribution much more, and 16-bit codes far less.
    assert!(num(int, "kld_mean") > num(f32, "kld_mean"), "{describe}");
    assert!(num(int, "kld_mean") > 10.0 * num(int16, "kld_mean"), "{describe}");
    let md = std::fs::read_to_string(out_dir.join("quality.md")).unwrap();
    assert!(md.contains("| synthetic:tiny@4bit | int8 |") && md.contains("mean KLD"), "{md}");

    // Again against the first run's reference, with its int8 file as another engine's:
    // the same statistics under the given name, and no reference pass.
    let again = dir.path().join("again");
    let reference = out_dir.join("m0-reference.lp");
    let other = format!("other={}", out_dir.join("m0-int8.lp").display());
    let (header2, rows2, describe2) =
        run(&again, &["--schemes", "int8", "--reference", reference.to_str().unwrap(), "--compare", &other]);
    assert_eq!(header2, header);
    assert_eq!(rows2.len(), 2, "{describe2}");
    assert!(!again.join("m0-reference.lp").exists(), "{describe2}");
    assert_eq!(col(&rows2[1], "scheme"), "other");
    for c in ["kld_mean", "kld_p99", "top1_agree", "ppl", "ppl_ref"] {
        assert_eq!(col(&rows2[0], c), col(int, c), "{c}{describe2}");
        assert_eq!(col(&rows2[1], c), col(int, c), "{c}{describe2}");
    }
    assert_eq!(col(&rows2[1], "tok_s"), "NaN", "{describe2}");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let bad = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["bench-quality", "--compare", "nofile", "--kiln-bin"])
        .arg(util::kiln_bin())
        .current_dir(root)
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    assert!(String::from_utf8_lossy(&bad.stderr).contains("invalid --compare \"nofile\""), "{bad:?}");
    for (args, needle) in [
        (["--schemes", "int4"], "invalid --schemes entry \"int4\""),
        (["--window", "-1"], "-1 is negative: accepted values are 2 to"),
    ] {
        let out = command(&dir.path().join("bad"), util::kiln_bin(), &args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{}", describe_output(&out));
        assert!(String::from_utf8_lossy(&out.stderr).contains(needle), "{}", describe_output(&out));
    }
    // The f32 scheme against its own reference scores the KLD floor's order, never a
    // clamped positive bias; the floor is printed beside every figure.
    assert!(num(f32, "kld_floor") >= 0.0 && num(f32, "kld_floor") < 1e-9, "{describe}");
    assert!(md.contains("KLD floor"), "{md}");

    // A rerun into the same directory that fails after it measured leaves the finished
    // quality.csv as it was (its rows so far are in quality.partial.csv).
    let broken = dir.path().join("broken.lp");
    std::fs::write(&broken, b"KILNLP01\xff\xff\xff\xff").unwrap();
    let before = std::fs::read(out_dir.join("quality.csv")).unwrap();
    let other = format!("broken={}", broken.display());
    let out =
        command(&out_dir, util::kiln_bin(), &["--schemes", "int8", "--compare", &other]).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", describe_output(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("claims 4294967295 bytes"),
        "{}",
        describe_output(&out)
    );
    assert_eq!(std::fs::read(out_dir.join("quality.csv")).unwrap(), before, "quality.csv was truncated");
    assert_eq!(read_csv(&out_dir.join("quality.partial.csv")).1.len(), 1);

    // A second run into a directory another run is writing is refused on the lock.
    let held = std::fs::OpenOptions::new().write(true).open(out_dir.join("quality.partial.csv")).unwrap();
    rustix::fs::flock(&held, rustix::fs::FlockOperation::NonBlockingLockExclusive).unwrap();
    let out = command(&out_dir, util::kiln_bin(), &["--schemes", "int8"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", describe_output(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("quality.partial.csv is being written"),
        "{}",
        describe_output(&out)
    );
    assert_eq!(std::fs::read(out_dir.join("quality.csv")).unwrap(), before);
}

/// A stand-in for `kiln` that records its pid in PIDFILE and sleeps.
fn sleeping_kiln(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let pidfile = dir.join("kiln.pid");
    let bin = dir.join("kiln");
    std::fs::write(&bin, format!("#!/bin/sh\necho $$ > '{}'\nexec sleep 60\n", pidfile.display())).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    (bin, pidfile)
}

/// Waits for the stand-in to write its pid.
fn child_pid(pidfile: &Path) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(pid) = std::fs::read_to_string(pidfile).ok().and_then(|s| s.trim().parse().ok()) {
            return pid;
        }
        assert!(Instant::now() < deadline, "kiln score never started");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn alive(pid: i32) -> bool {
    // A zombie (not yet reaped by its parent) counts as gone.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

#[test]
fn a_signal_stops_the_scoring_child_and_sigkill_takes_it_along() {
    let dir = tempfile::tempdir().unwrap();
    let (kiln, pidfile) = sleeping_kiln(dir.path());
    // SIGINT: the child's group is killed, exit 130.
    let mut child = command(&dir.path().join("q"), &kiln, &["--schemes", "int8"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child_pid(&pidfile);
    let started = Instant::now();
    unsafe_free_kill(child.id() as i32, rustix::process::Signal::INT);
    while child.try_wait().unwrap().is_none() {
        assert!(started.elapsed() < Duration::from_secs(20), "bench-quality kept scoring after SIGINT");
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", describe_output(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("interrupted by SIGINT"),
        "{}",
        describe_output(&out)
    );
    assert!(!alive(pid), "kiln score outlived the interrupted run");
    // SIGKILL, which no handler sees: the parent-death signal takes the child along.
    std::fs::remove_file(&pidfile).unwrap();
    let mut child = command(&dir.path().join("k"), &kiln, &["--schemes", "int8"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child_pid(&pidfile);
    child.kill().unwrap();
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(pid) {
        assert!(Instant::now() < deadline, "kiln score outlived a SIGKILLed bench-quality");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn unsafe_free_kill(pid: i32, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(pid).unwrap();
    rustix::process::kill_process(pid, sig).unwrap();
}

#[test]
fn a_directory_another_run_holds_is_refused_naming_the_out_dir_flag() {
    // No kiln is needed: the lock is taken before the engine is looked at.
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("q");
    std::fs::create_dir_all(&out_dir).unwrap();
    let held = std::fs::File::create(out_dir.join("quality.partial.csv")).unwrap();
    rustix::fs::flock(&held, rustix::fs::FlockOperation::NonBlockingLockExclusive).unwrap();
    let (kiln, _) = sleeping_kiln(dir.path());
    let out = command(&out_dir, &kiln, &["--schemes", "int8"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{}", describe_output(&out));
    assert!(stderr.contains("quality.partial.csv is being written"), "{}", describe_output(&out));
    // bench-quality's flag is --out-dir; it has no --output.
    assert!(stderr.contains("pass another --out-dir"), "{}", describe_output(&out));
    assert!(!stderr.contains("--output"), "{}", describe_output(&out));
}
