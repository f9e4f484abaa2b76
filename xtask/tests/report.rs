//! `report.html` and `cargo xtask report` end to end: two real sweeps on the tiny model,
//! the page each run directory gets, the comparison of the two, bad input, and (with
//! `KILN_TEST_CHROMIUM` set, as CI does) the page rendered by a real headless browser.

// Shared with the sweep tests; not every helper is used here.
#[allow(dead_code)]
mod util;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use util::Sandbox;

const SWEEP: [&str; 8] =
    ["--models", "synthetic:tiny", "--lengths", "16 2048", "--max-tokens", "4", "--warmup-tokens", "1"];

fn run_dirs(sb: &Sandbox) -> Vec<PathBuf> {
    let mut d: Vec<PathBuf> = fs::read_dir(sb.path("runs")).unwrap().map(|e| e.unwrap().path()).collect();
    d.sort();
    d
}

#[test]
fn every_sweep_run_gets_a_report_and_two_runs_compare_per_cell() {
    let sb = Sandbox::new();
    // 2048 tokens exceed tiny's context: a skipped cell the page must list with its reason.
    let a = sb.run("bench-longprompt", &SWEEP);
    a.expect_code(1).expect_stderr("report: ");
    let mut second = SWEEP.to_vec();
    let b_csv = sb.path("b.csv");
    second.extend(["--output", b_csv.to_str().unwrap()]);
    sb.run("bench-longprompt", &second).expect_code(1);
    let dirs = run_dirs(&sb);
    assert_eq!(dirs.len(), 2, "{a}");
    let page = fs::read_to_string(dirs[0].join("report.html")).unwrap();
    for needle in [
        "<!DOCTYPE html>",
        "bench-longprompt --kiln-bin",
        "--models synthetic:tiny --lengths &#39;16 2048&#39;",
        "<h2>Fingerprint</h2>",
        "<td>commit</td>",
        "<svg xmlns=\"http://www.w3.org/2000/svg\"",
        ">decode (tok/s)</text>",
        "SKIP:context",
        "exceed the model&#39;s context",
        "href=\"../../out.csv\"",
        "href=\"env.json\"",
    ] {
        assert!(page.contains(needle), "report.html lacks {needle:?}:\n{page}");
    }
    // Self-contained: no script, and no address but the SVG namespace.
    assert!(!page.contains("<script"));
    assert_eq!(
        page.matches("http").count(),
        page.matches("http://www.w3.org/2000/svg").count() + 1,
        "the CSP line aside"
    );
    // Re-rendered from the files alone, it is the same page.
    fs::remove_file(dirs[0].join("report.html")).unwrap();
    let r = sb.run("report", &[dirs[0].to_str().unwrap(), dirs[1].to_str().unwrap()]);
    r.expect_code(0).expect_stderr("comparison: ");
    let again = fs::read_to_string(dirs[0].join("report.html")).unwrap();
    assert_eq!(again, page, "{r}");
    let cmp = fs::read_to_string(dirs[1].join("compare.html")).unwrap();
    // The two runs differ only by where their CSVs went, which is each run's own.
    let equal = "every setting that can change a measurement is equal";
    for needle in ["<th>B/A</th>", "synthetic:tiny (kiln) @ 16", "decode tok/s", equal] {
        assert!(cmp.contains(needle), "compare.html lacks {needle:?}:\n{cmp}");
    }
    // Each measured cell has a ratio; the skipped one has none.
    let row =
        cmp.lines().find(|l| l.contains("synthetic:tiny (kiln) @ 16") && l.contains("decode tok/s")).unwrap();
    // One repetition a run: a ratio with its n and no verdict.
    let cell = row.rsplit("<td class=\"n\">").next().unwrap().split('<').next().unwrap();
    let ratio: f64 = cell.split(' ').next().unwrap().parse().unwrap();
    assert!(ratio > 0.0 && cell.contains("undecided: n=1, no interval yet"), "{row}");
    let skipped = cmp.lines().find(|l| l.contains("@ 2048") && l.contains("decode tok/s")).unwrap();
    assert!(skipped.ends_with("<td class=\"n\">-</td></tr>"), "{skipped}");
    if let Some(chromium) = std::env::var_os("KILN_TEST_CHROMIUM") {
        screenshot_is_not_blank(Path::new(&chromium), &dirs[0].join("report.html"), sb.dir.path());
    } else {
        eprintln!("KILN_TEST_CHROMIUM unset: report.html was not rendered in a browser");
    }
}

#[test]
fn report_refuses_what_is_not_a_run_directory() {
    let sb = Sandbox::new();
    sb.run("report", &[sb.path("nowhere").to_str().unwrap()])
        .expect_code(2)
        .expect_stderr("is not a directory");
    fs::create_dir(sb.path("empty")).unwrap();
    sb.run("report", &[sb.path("empty").to_str().unwrap()])
        .expect_code(2)
        .expect_stderr("not a run directory");
}

/// `path` made a FIFO (named pipe) that nothing writes: opening it to read would wait
/// forever.
fn fifo(path: &Path) {
    use rustix::fs::{CWD, FileType, Mode, mknodat};
    mknodat(CWD, path, FileType::Fifo, Mode::from_raw_mode(0o600), 0).expect("mkfifo");
}

/// A serve-bench run directory as far as the report reads one: levels.csv.
fn levels_dir(sb: &Sandbox, name: &str) -> PathBuf {
    let d = sb.path(name);
    fs::create_dir(&d).unwrap();
    fs::write(d.join("levels.csv"), "level,concurrency,output_tok_s\nc=1,1,10\n").unwrap();
    d
}

#[test]
fn report_refuses_a_fifo_or_a_device_in_a_run_directory_at_once() {
    let sb = Sandbox::new();
    let limit = std::time::Duration::from_secs(60);
    for name in ["summary.md", "requests.jsonl", "env.json"] {
        let d = levels_dir(&sb, &format!("serve-{name}"));
        fifo(&d.join(name));
        sb.run_within("report", &[d.to_str().unwrap()], limit)
            .expect_code(2)
            .expect_stderr(&format!("{name} is a FIFO (named pipe): only a regular file is read there"));
    }
    // The sweep's CSV, wherever env.json's output puts it.
    let d = sb.path("sweep");
    fs::create_dir(&d).unwrap();
    let csv = sb.path("results.csv");
    fifo(&csv);
    fs::write(d.join("env.json"), format!("{{\"output\": {:?}}}", csv.to_str().unwrap())).unwrap();
    sb.run_within("report", &[d.to_str().unwrap()], limit)
        .expect_code(2)
        .expect_stderr("results.csv is a FIFO (named pipe)");
    // A link to /dev/zero is followed and refused, not read without end.
    let d = levels_dir(&sb, "zero");
    std::os::unix::fs::symlink("/dev/zero", d.join("summary.md")).unwrap();
    sb.run_within("report", &[d.to_str().unwrap()], limit)
        .expect_code(2)
        .expect_stderr("summary.md is a character device");
    // A FIFO the report does not read is only listed.
    fs::remove_file(d.join("summary.md")).unwrap();
    fifo(&d.join("kiln.fifo"));
    sb.run_within("report", &[d.to_str().unwrap()], limit).expect_code(0);
    assert!(fs::read_to_string(d.join("report.html")).unwrap().contains("kiln.fifo"));
    let d2 = levels_dir(&sb, "plain");
    fs::remove_file(d2.join("levels.csv")).unwrap();
    fifo(&d2.join("levels.csv"));
    sb.run_within("report", &[d2.to_str().unwrap()], limit)
        .expect_code(2)
        .expect_stderr("levels.csv is a FIFO");
}

#[test]
fn a_comparison_never_replaces_a_file_of_a_run() {
    let sb = Sandbox::new();
    let (a, b) = (levels_dir(&sb, "a"), levels_dir(&sb, "b"));
    fs::write(a.join("env.json"), "{\"commit\": \"abc\"}").unwrap();
    fs::write(a.join("notes.txt"), "mine").unwrap();
    std::os::unix::fs::symlink(a.join("levels.csv"), sb.path("link.csv")).unwrap();
    fs::hard_link(a.join("env.json"), sb.path("hard.json")).unwrap();
    let files = |d: &Path| -> Vec<(PathBuf, Vec<u8>)> {
        let mut v: Vec<_> = fs::read_dir(d).unwrap().map(|e| e.unwrap().path()).collect();
        v.sort();
        v.into_iter().map(|p| (p.clone(), fs::read(&p).unwrap())).collect()
    };
    let before = (files(&a), files(&b));
    for out in [
        a.join("levels.csv"),
        a.join("env.json"),
        b.join("../a/levels.csv"),
        sb.path("link.csv"),
        sb.path("hard.json"),
        a.join("notes.txt"),
        // Not there yet, but the report would read it next time.
        a.join("summary.md"),
        a.clone(),
    ] {
        sb.run("report", &[a.to_str().unwrap(), b.to_str().unwrap(), "--output", out.to_str().unwrap()])
            .expect_code(2)
            .expect_stderr(&format!("--output {}", out.display()))
            .expect_stderr("pass a new file outside the run directories");
    }
    // Refused before anything was written: not even report.html.
    assert!(before == (files(&a), files(&b)), "a run directory changed");
    // A new file is fine, and so is the run's own compare.html, again.
    for out in [sb.path("cmp.html"), a.join("compare.html"), a.join("compare.html")] {
        sb.run("report", &[a.to_str().unwrap(), b.to_str().unwrap(), "--output", out.to_str().unwrap()])
            .expect_code(0);
        assert!(fs::read_to_string(&out).unwrap().contains("<th>B/A</th>"));
    }
    assert_eq!(fs::read(a.join("env.json")).unwrap(), b"{\"commit\": \"abc\"}");
}

/// Headless Chromium (the flags the machine notes say work offline) draws the page; the
/// screenshot must have the page's text and plot: many pixels that are not background.
fn screenshot_is_not_blank(chromium: &Path, page: &Path, tmp: &Path) {
    let shot = tmp.join("report.png");
    let profile = tmp.join("chromium-profile");
    let out = Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--window-size=1400,1800",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(format!("--screenshot={}", shot.display()))
        .arg(format!("file://{}", page.display()))
        .output()
        .unwrap_or_else(|e| panic!("KILN_TEST_CHROMIUM={}: {e}", chromium.display()));
    assert!(
        shot.is_file(),
        "chromium wrote no screenshot: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let png = resvg::tiny_skia::Pixmap::load_png(&shot).expect("a PNG screenshot");
    let ink = png.pixels().iter().filter(|p| p.red() < 200 || p.green() < 200 || p.blue() < 200).count();
    let coloured = png.pixels().iter().filter(|p| p.blue() > 150 && p.red() < 60).count();
    let total = png.pixels().len();
    assert!(ink > total / 200, "the screenshot is blank: {ink} of {total} pixels drawn ({})", shot.display());
    assert!(coloured > 50, "the screenshot shows no plotted series (blue pixels: {coloured})");
}
