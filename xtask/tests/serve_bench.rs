//! serve-bench's honesty marks end to end, against the real `kiln serve` on
//! synthetic:tiny: a level measured beside a busy process is marked disturbed in
//! levels.csv and the summary, and a p99 of a few requests says how few.

#[allow(dead_code)]
mod util;

use std::fs;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use util::Sandbox;

/// A process that keeps one core busy until dropped.
struct Spinner(std::process::Child);

impl Spinner {
    fn start() -> Spinner {
        let child = Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .stdin(Stdio::null())
            .spawn()
            .expect("starting a busy loop");
        Spinner(child)
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_level_beside_a_busy_process_is_disturbed_and_a_p99_of_8_requests_says_so() {
    let sb = Sandbox::new();
    let runs = sb.path("runs");
    let kiln = util::kiln_bin().to_str().unwrap().to_string();
    let spinner = Spinner::start();
    let run = sb.run(
        "serve-bench",
        &[
            "-m",
            "synthetic:tiny",
            "--kiln-bin",
            &kiln,
            "--runs-dir",
            runs.to_str().unwrap(),
            "--concurrency",
            "1",
            "--requests",
            "8",
            "--max-tokens",
            "3",
            "--prompt-tokens",
            "16",
        ],
    );
    drop(spinner);
    run.expect_code(0)
        .expect_stdout("(p99 of 8)")
        .expect_stdout(
            "requests per percentile: c=1 on 8. A p99 of fewer than 100 values is about the largest of them",
        )
        .expect_stdout("| disturbed |\n")
        .expect_stdout("disturbed: the machine was busy while these levels ran")
        .expect_stderr("    disturbed: other processes used");
    let dirs: Vec<PathBuf> = fs::read_dir(&runs).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(dirs.len(), 1, "{run}");
    let mut rdr = csv::Reader::from_path(dirs[0].join("levels.csv")).unwrap();
    let at = rdr.headers().unwrap().iter().position(|h| h == "disturbed").expect("a disturbed column");
    let rows: Vec<csv::StringRecord> = rdr.records().map(Result::unwrap).collect();
    assert_eq!(rows.len(), 1, "{run}");
    assert!(rows[0][at].starts_with("other processes used "), "{:?}{run}", &rows[0][at]);
    let env: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(dirs[0].join("env.json")).unwrap()).unwrap();
    assert_eq!(env["serve_bench"]["busy_cpus"], 0.5, "{env}");
}
