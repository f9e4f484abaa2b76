//! `cargo xtask bench-quality` end to end on a tiny synthetic model: a reference pass and
//! measured passes through the real `kiln score`, one CSV row per scheme, the markdown
//! table, and a second run that reuses the reference and compares a foreign file.

// Shared with the sweep tests; this one needs only `kiln_bin`.
#[allow(dead_code)]
mod util;

use std::path::Path;
use std::process::{Command, Stdio};

/// Runs `cargo xtask bench-quality` on the tiny model with `args`; returns the CSV's
/// header and rows and a description of the run for failures.
fn run(out_dir: &Path, args: &[&str]) -> (Vec<String>, Vec<Vec<String>>, String) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_xtask"));
    cmd.args(["bench-quality", "--models", "synthetic:tiny@4bit"])
        .args(args)
        .args(["--window", "64", "--first-scored", "32", "--max-windows", "2", "--threads", "1"])
        .arg("--kiln-bin")
        .arg(util::kiln_bin())
        .arg("--out-dir")
        .arg(out_dir)
        .current_dir(root)
        .stdin(Stdio::null());
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("KILN_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd.output().unwrap();
    let describe = format!(
        "\nstatus: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "bench-quality failed{describe}");
    let mut rdr = csv::Reader::from_path(out_dir.join("quality.csv")).unwrap();
    let header: Vec<String> = rdr.headers().unwrap().iter().map(str::to_string).collect();
    let rows: Vec<Vec<String>> =
        rdr.records().map(|r| r.unwrap().iter().map(str::to_string).collect()).collect();
    (header, rows, describe)
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
    assert_eq!(bad.status.code(), Some(1), "{bad:?}");
    assert!(String::from_utf8_lossy(&bad.stderr).contains("invalid --compare \"nofile\""), "{bad:?}");
}
