//! `report.html`, the page a person opens first: one self-contained file per run
//! directory (inline SVG and CSS, no script, nothing fetched) with the run's command and
//! fingerprint, its summary table, its plots, every cell that was skipped or failed with
//! the reason, and links to the files beside it. Everything is read back from the run's
//! files, so `cargo xtask report RUN_DIR` re-renders it at any time, and given several
//! runs writes them side by side with each later run's ratio to the first, per cell.

mod compare;
mod html;
pub mod roofline;
mod run;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};

use self::html::{escape, head, table};
pub use self::run::Run;
use crate::console::usage;

/// Flags of `cargo xtask report`.
#[derive(clap::Args)]
pub struct Report {
    /// Run directories (benchmarks/runs/<stamp>-<command>); with two or more, the later
    /// ones are compared with the first.
    #[arg(value_name = "RUN_DIR", required = true)]
    run_dirs: Vec<PathBuf>,
    /// Where the comparison goes [default: compare.html in the last RUN_DIR].
    #[arg(long, value_name = "FILE")]
    output: Option<PathBuf>,
    /// With two or more runs: judge each ratio B/A at ±PCT percent [default: 5].
    #[arg(long, value_name = "PCT", value_parser = crate::verdict::pct_arg)]
    margin: Option<f64>,
}

impl Report {
    pub fn run(self) -> Result<ExitCode> {
        let mut runs = Vec::new();
        for d in &self.run_dirs {
            let dir = crate::args::user_path(d)?;
            if !dir.is_dir() {
                usage!(
                    "{} is not a directory: give run directories (benchmarks/runs/<stamp>-<command>)",
                    d.display()
                );
            }
            match Run::load(&dir) {
                Ok(r) => runs.push(r),
                Err(e) => usage!("{}: {e:#}", d.display()),
            }
        }
        if runs.len() < 2 && self.margin.is_some() {
            usage!("--margin judges a comparison: give two or more run directories");
        }
        let margin = self.margin.unwrap_or(crate::verdict::reading::DEFAULT_MARGIN_PCT);
        // Everything is checked before anything is written.
        let comparison = if runs.len() > 1 {
            let (sheet, page) = match compare::compare(&runs, margin) {
                Ok(p) => p,
                Err(e) => usage!("{e:#}"),
            };
            let out = match &self.output {
                Some(o) => crate::args::user_path(o)?,
                None => runs.last().map(|r| r.dir.join("compare.html")).unwrap_or_default(),
            };
            check_output(&out, &runs)?;
            Some((sheet, page, out))
        } else {
            None
        };
        for run in &runs {
            let path = write_page(run)?;
            eprintln!("report: {}", path.display());
        }
        if let Some((sheet, page, out)) = comparison {
            crate::fsx::write_atomic(&out, page.as_bytes())?;
            eprintln!("comparison: {}", out.display());
            crate::console::out(&sheet.markdown())?;
        }
        Ok(ExitCode::SUCCESS)
    }
}

/// Refuses `out` as the comparison's path when writing it would replace what a run
/// recorded: a file the report reads (env.json, the sweep's CSV wherever it is, ...),
/// however spelled (a link, `..`, a hard link), or any other file in a run directory
/// but its `compare.html`.
fn check_output(out: &Path, runs: &[Run]) -> Result<()> {
    const ACCEPTED: &str =
        "pass a new file outside the run directories, or compare.html in one (the default)";
    if out.is_dir() {
        usage!("--output {} is a directory: {ACCEPTED}", out.display());
    }
    for run in runs {
        if let Some(input) = run.inputs().iter().find(|i| crate::fsx::same_file(out, i)) {
            usage!(
                "--output {} is {}, which the report reads from run {}: {ACCEPTED}",
                out.display(),
                input.display(),
                run.dir.display()
            );
        }
        let real = crate::fsx::real_path(out);
        let in_run = real.parent() == Some(crate::fsx::real_path(&run.dir).as_path());
        if in_run && real.file_name() != Some("compare.html".as_ref()) && fs_exists(&real) {
            usage!(
                "--output {} would replace {}, a file of run {}: {ACCEPTED}",
                out.display(),
                real.display(),
                run.dir.display()
            );
        }
    }
    Ok(())
}

/// Whether there is anything at `path` (a dangling link counts).
fn fs_exists(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

/// Writes `run_dir/report.html` from the run's files; what a task calls when it ends.
/// A failure is a warning: the measurements are already on disk.
pub fn write_or_warn(run_dir: &Path) {
    match write(run_dir) {
        Ok(p) => eprintln!("report: {}", p.display()),
        Err(e) => eprintln!("warning: no report.html in {}: {e:#}", run_dir.display()),
    }
}

/// Writes (or rewrites in place) `run_dir/report.html` from the run's files, silently: what
/// a run that grows round by round calls after each round.
pub fn write(run_dir: &Path) -> Result<PathBuf> {
    Run::load(run_dir).and_then(|r| write_page(&r))
}

fn write_page(run: &Run) -> Result<PathBuf> {
    let path = run.dir.join("report.html");
    crate::fsx::write_atomic(&path, page(run).as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// One run's page.
pub fn page(run: &Run) -> String {
    let mut s = head(&format!("{}: {}", run.kind.name(), run.name));
    for note in run.host_execution_notes().lines() {
        let _ = writeln!(s, "<p class=\"note\"><strong>{}</strong></p>", escape(note));
    }
    let _ = writeln!(s, "<h2>Command</h2>\n<pre>{}</pre>", escape(&run.command()));
    let _ = writeln!(s, "<h2>Fingerprint</h2>");
    let fp: Vec<Vec<String>> = run.fingerprint().into_iter().map(|(k, v)| vec![k, v]).collect();
    s.push_str(&if fp.is_empty() {
        "<p class=\"note\">no env.json in the run directory</p>\n".into()
    } else {
        table(&["key", "value"], &fp, &[])
    });
    let _ = writeln!(s, "<h2>Summary</h2>");
    s.push_str(&run.summary_html());
    let plots = run.plots();
    if !plots.is_empty() {
        let _ = writeln!(s, "<h2>Plots</h2>");
        for svg in plots {
            let _ = writeln!(s, "<div class=\"plot\">{svg}</div>");
        }
    }
    let (headers, problems) = run.problems();
    let _ = writeln!(s, "<h2>Skipped and failed</h2>");
    if problems.is_empty() {
        let _ = writeln!(s, "<p>none: every cell was measured</p>");
    } else {
        let _ = writeln!(s, "<p>{} cell(s) without a measurement:</p>", problems.len());
        s.push_str(&table(&headers, &problems, &[]));
    }
    let _ = writeln!(s, "<h2>Files</h2>\n<ul>");
    for (href, label) in run.files() {
        let _ = writeln!(s, "<li><a href=\"{}\">{}</a></li>", escape(&href), escape(&label));
    }
    s.push_str("</ul>\n</body></html>\n");
    s
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use crate::serve_bench::output::{LevelSummary, csv_header, csv_record};

    fn serve_dir(dir: &Path, tok_s: f64) {
        fs::write(
            dir.join("env.json"),
            r#"{"command": ["xtask", "serve-bench", "--url", "http://x/<y>"], "commit": "abc"}"#,
        )
        .unwrap();
        let mut w = csv::Writer::from_path(dir.join("levels.csv")).unwrap();
        w.write_record(csv_header()).unwrap();
        for c in [1usize, 4] {
            let mut l = LevelSummary::of(format!("c={c}"), Some(c), None, &[], 2.0);
            l.output_tok_s = tok_s * c as f64;
            w.write_record(csv_record(&l)).unwrap();
        }
        w.flush().unwrap();
        fs::write(
            dir.join("requests.jsonl"),
            "{\"level\":\"c=4\",\"key\":\"c=4/3\",\"ok\":false,\"error\":\"connection <reset>\",\"warmup\":false}\n{\"level\":\"c=4\",\"key\":\"c=4/4\",\"ok\":true}\n{\"cut sho",
        )
        .unwrap();
        fs::write(dir.join("summary.md"), "| level | ok |\n|---|---:|\n| c=1 | 4 |\n").unwrap();
    }

    #[test]
    fn a_serve_bench_page_escapes_its_data_and_lists_failed_requests() {
        let d = tempfile::tempdir().unwrap();
        serve_dir(d.path(), 10.0);
        // Killed mid-write, in the middle of a character: the cut line is left out.
        let mut reqs = fs::read(d.path().join("requests.jsonl")).unwrap();
        reqs.extend_from_slice(&"\n{\"error\":\"é".as_bytes()[..12]);
        fs::write(d.path().join("requests.jsonl"), reqs).unwrap();
        let run = Run::load(d.path()).unwrap();
        let html = page(&run);
        assert!(html.contains("http://x/&lt;y&gt;") && !html.contains("<y>"), "{html}");
        assert!(html.contains("<td>c=4/3</td>") && html.contains("connection &lt;reset&gt;"), "{html}");
        assert!(html.contains("1 cell(s) without a measurement"), "{html}");
        assert!(html.contains(">throughput</text>") && html.contains("<td>c=1</td><td>4</td>"), "{html}");
        assert!(html.contains("href=\"levels.csv\"") && html.contains("href=\"requests.jsonl\""));
    }

    #[test]
    fn a_host_execution_run_says_so_at_the_top_of_its_page() {
        let d = tempfile::tempdir().unwrap();
        serve_dir(d.path(), 10.0);
        let plain = page(&Run::load(d.path()).unwrap());
        assert!(!plain.contains("not a GPU"), "{plain}");
        fs::write(
            d.path().join("env.json"),
            r#"{"command": ["xtask", "serve-bench"], "device": "cuda:host execution on Some CPU (16 GiB)"}"#,
        )
        .unwrap();
        let html = page(&Run::load(d.path()).unwrap());
        let note = "host execution on Some CPU (16 GiB), not a GPU";
        let at = html.find(note).unwrap_or_else(|| panic!("no host-execution line: {html}"));
        assert!(at < html.find("<h2>Summary</h2>").unwrap(), "the line comes before the figures");
    }

    #[test]
    fn two_serve_runs_compare_level_by_level_and_other_tasks_are_refused() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        serve_dir(a.path(), 10.0);
        serve_dir(b.path(), 15.0);
        let runs = [Run::load(a.path()).unwrap(), Run::load(b.path()).unwrap()];
        let html = compare::compare(&runs, 5.0).unwrap().1;
        let row = html.lines().find(|l| l.contains("<td>c=4</td><td>output tok/s</td>")).unwrap();
        // One throughput per level and run: the ratio says so, never a bare 1.500.
        assert!(
            row.ends_with(
                "<td class=\"n\">40.00 (n=1: no interval)</td><td class=\"n\">60.00 (n=1: no interval)</td><td class=\"n\">1.500 (n=1: no interval) undecided: n=1, no interval yet</td></tr>"
            ),
            "{row}"
        );
        // A pin-tax run is its own comparison.
        let p = tempfile::tempdir().unwrap();
        fs::write(
            p.path().join("passes.jsonl"),
            "{\"boot\":1,\"arm\":\"narrow\",\"pass\":1,\"ok\":false,\"reason\":\"boom\"}\n",
        )
        .unwrap();
        fs::write(p.path().join("tax.svg"), "<svg onload=\"x()\"></svg>").unwrap();
        let tax = Run::load(p.path()).unwrap();
        let html = page(&tax);
        assert!(html.contains("<td>boom</td>") && !html.contains("onload"), "{html}");
        let err = compare::compare(&[runs.into_iter().next().unwrap(), tax], 5.0).unwrap_err().to_string();
        assert!(err.contains("only runs of one task compare"), "{err}");
    }

    #[test]
    fn a_comparison_of_28_runs_labels_them_a_to_z_then_aa_and_ab() {
        let dirs: Vec<tempfile::TempDir> = (0..28).map(|_| tempfile::tempdir().unwrap()).collect();
        let runs: Vec<Run> = dirs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                serve_dir(d.path(), 10.0 + i as f64);
                Run::load(d.path()).unwrap()
            })
            .collect();
        let html = compare::compare(&runs, 5.0).unwrap().1;
        let header = html.lines().find(|l| l.starts_with("<table><tr><th>cell</th>")).unwrap();
        let th: Vec<&str> = header.split("<th>").skip(1).map(|c| c.split('<').next().unwrap()).collect();
        assert_eq!(&th[2..5], ["A", "B", "C"]);
        assert_eq!(&th[27..30], ["Z", "AA", "AB"]);
        assert_eq!(&th[30..32], ["B/A", "C/A"]);
        assert_eq!(th.last(), Some(&"AB/A"));
        let unique: std::collections::BTreeSet<&&str> = th.iter().collect();
        assert_eq!(unique.len(), th.len(), "{th:?}");
    }

    #[test]
    fn a_nan_or_negative_level_measurement_is_an_error_naming_line_and_column() {
        let d = tempfile::tempdir().unwrap();
        serve_dir(d.path(), 10.0);
        let good = fs::read_to_string(d.path().join("levels.csv")).unwrap();
        let col = good.lines().next().unwrap().split(',').position(|c| c == "output_tok_s").unwrap();
        for bad in ["NaN", "inf", "-1", "fast"] {
            let mut lines: Vec<String> = good.lines().map(str::to_string).collect();
            let mut cells: Vec<&str> = lines[2].split(',').collect();
            cells[col] = bad;
            lines[2] = cells.join(",");
            fs::write(d.path().join("levels.csv"), lines.join("\n") + "\n").unwrap();
            let e = Run::load(d.path()).err().unwrap().to_string();
            assert!(e.contains(&format!("levels.csv: line 3: column output_tok_s is {bad:?}: expected a finite non-negative number")), "{e}");
        }
    }

    /// The probe's four SVGs that passed the old inline filter: each reaches the page only
    /// as a base64 image, so none of its markup is the page's.
    #[test]
    fn a_pin_tax_svg_is_an_image_never_markup() {
        let mut pasted: Vec<&str> = Vec::new();
        for (svg, markup) in [
            ("<svg/onload=alert(1)>", &["onload", "alert("][..]),
            (
                "<svg><meta http-equiv=\"refresh\" content=\"0;url=http://evil/\"></svg>",
                &["http-equiv=\"refresh", "evil"],
            ),
            (
                "<svg><a xlink:href = \"java&#115;cript:alert(1)\"><text>x</text></a></svg>",
                &["xlink:href", "java&#115;cript", "javascript"],
            ),
            (
                "<svg><form action=http://evil/><input type=password name=p></form></svg>",
                &["<form", "<input", "evil"],
            ),
        ] {
            let p = tempfile::tempdir().unwrap();
            fs::write(
                p.path().join("passes.jsonl"),
                "{\"boot\":1,\"arm\":\"narrow\",\"pass\":1,\"ok\":true}\n",
            )
            .unwrap();
            fs::write(p.path().join("tax.svg"), svg).unwrap();
            let html = page(&Run::load(p.path()).unwrap());
            let img = format!(
                "<img alt=\"tax.svg\" src=\"data:image/svg+xml;base64,{}\">",
                html::base64(svg.as_bytes())
            );
            // Outside its base64 image, the page holds none of the file's markup.
            let rest = html.replace(&img, "").to_ascii_lowercase();
            pasted.extend(markup.iter().filter(|m| rest.contains(&m.to_ascii_lowercase())));
            if pasted.is_empty() {
                assert!(html.contains(&img), "{html}");
                assert!(html.contains("form-action 'none'; base-uri 'none'; frame-src 'none'"), "{html}");
            }
        }
        assert!(pasted.is_empty(), "the page holds the SVG's {pasted:?}");
    }

    /// A sweep run directory: its CSV of `decode` rates (one repetition each) at one
    /// cell, and env.json naming it with `command`.
    fn sweep_dir(dir: &Path, decode: &[f64], command: &[&str]) {
        use crate::sweep::rows::{CsvOut, Row};
        let csv = dir.join("out.csv");
        let mut out = CsvOut::create(&csv).unwrap();
        for (i, d) in decode.iter().enumerate() {
            out.write(&Row {
                model: "synthetic:tiny".into(),
                prompt_target_len: Some(16),
                prompt_tokens: Some(16),
                generated_tokens: Some(3),
                prefill_ms: Some(1.0),
                prefill_tok_s: Some(1000.0 + i as f64),
                decode_ms: Some(1.0),
                decode_tok_s: Some(*d),
                peak_bytes: Some(1 << 20),
                date: "2026-12-07T12:00:00Z".into(),
                status: "ok".into(),
                repetition: i as u32 + 1,
                engine: "kiln".into(),
                disturbed: if i == 1 { "other processes used 1.2 CPUs".into() } else { String::new() },
                ..Row::default()
            })
            .unwrap();
        }
        drop(out);
        let env = serde_json::json!({ "command": command, "output": csv.to_str().unwrap() });
        fs::write(dir.join("env.json"), env.to_string()).unwrap();
    }

    #[test]
    fn a_sweep_page_renders_the_readings_its_terminal_printed() {
        let d = tempfile::tempdir().unwrap();
        let decode = [12000.0, 6012.0, 27506.0, 14000.0, 13000.0];
        sweep_dir(d.path(), &decode, &["xtask", "bench-longprompt"]);
        // The terminal's sheet, kept: the page prints its texts, whatever the CSV says.
        let kept = crate::sweep::series::sequential_sheet(
            &crate::sweep::rows::read_rows(&d.path().join("out.csv")).unwrap(),
            5.0,
            Some("stopping rule: --max-pairs 5 reached".into()),
        )
        .0;
        kept.write(d.path()).unwrap();
        let html = page(&Run::load(d.path()).unwrap());
        assert!(!kept.texts().is_empty());
        for t in kept
            .texts()
            .into_iter()
            .chain([kept.headline.as_str()])
            .chain(kept.notes.iter().map(String::as_str))
        {
            assert!(html.contains(&escape(t)), "the page lacks the terminal's {t:?}:\n{html}");
        }
        assert!(html.contains("--until-ci 5%: 1 of 2 intervals are not under ±5% after 5 repetitions: synthetic:tiny@16 kiln decode (within a factor of 3.65)"), "{html}");
        assert!(html.contains("1 disturbed"), "{html}");
        // Not the arithmetic mean of the rates.
        let mean = decode.iter().sum::<f64>() / decode.len() as f64;
        assert!(!html.contains(&format!("{mean:.1}")) && !html.contains(&format!("{mean:.0}")), "{html}");
    }

    #[test]
    fn an_older_until_ci_run_without_readings_renders_through_the_same_sheet() {
        let d = tempfile::tempdir().unwrap();
        sweep_dir(
            d.path(),
            &[12000.0, 6012.0, 27506.0, 14000.0],
            &["xtask", "bench-longprompt", "--until-ci", "5"],
        );
        let rows = crate::sweep::rows::read_rows(&d.path().join("out.csv")).unwrap();
        let want = crate::sweep::series::sequential_sheet(&rows, 5.0, None).0;
        let html = page(&Run::load(d.path()).unwrap());
        for t in want.texts() {
            assert!(html.contains(&escape(t)), "the page lacks {t:?}:\n{html}");
        }
        assert!(html.contains("confidence sequence") && html.contains("--until-ci 5%: "), "{html}");
        // The plot's intervals are the sheet's: the confidence sequence's, not Student's t.
        let run = Run::load(d.path()).unwrap();
        let drawn = |m| crate::plot::render(&crate::sweep::panels::panels_by(&rows, m)).0;
        assert_eq!(run.plots(), [drawn(crate::verdict::reading::Method::Sequence)]);
        assert_ne!(run.plots(), [drawn(crate::verdict::reading::Method::T)]);
        // `--until-ci=5` is the same run; without the flag, Student's t.
        sweep_dir(
            d.path(),
            &[12000.0, 6012.0, 27506.0, 14000.0],
            &["xtask", "bench-longprompt", "--until-ci=5"],
        );
        assert!(page(&Run::load(d.path()).unwrap()).contains("confidence sequence"));
        sweep_dir(d.path(), &[12000.0, 6012.0, 27506.0, 14000.0], &["xtask", "bench-longprompt"]);
        let plain = page(&Run::load(d.path()).unwrap());
        assert!(plain.contains("Student&#39;s t") && !plain.contains("--until-ci"), "{plain}");
    }
}
