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

/// The sweep CSV's header (docs/benchmarks.md).
const HEADER: &str = "model,model_path,prompt_tokens,generated_tokens,prefill_ms,prefill_tok_s,decode_ms,decode_tok_s,peak_bytes,max_rss_bytes,date,host,device,backend,kiln_version,commit,features,driver_version,cuda_version,max_tokens,warmup_tokens,attention,prefill_chunk,kv_dtype,memory_limit_bytes,threads,prompt,prompt_target_len,status,repetition,engine,engine_version,reason,disturbed";

/// A recorded `bench-longprompt --repeat 3` run directory as an older harness left it
/// (its CSV and env.json, no readings): synthetic:tiny measured three times at 16 tokens
/// (the second repetition on a busy machine) and skipped at 2048 (its context), and
/// smollm measured at 16 and out of memory at 2048.
fn recorded_run(sb: &Sandbox) -> PathBuf {
    let dir = sb.path("runs/20261207T120000Z-bench-longprompt");
    fs::create_dir_all(&dir).unwrap();
    let csv = sb.path("recorded.csv");
    let mut text = format!("{HEADER}\n");
    let cols: Vec<&str> = HEADER.split(',').collect();
    let mut row = |fields: &[(&str, &str)]| {
        let line: Vec<String> = cols
            .iter()
            .map(|c| {
                fields.iter().find(|(k, _)| k == c).map_or_else(
                    || match *c {
                        "date" => "2026-12-07T12:00:00Z".to_string(),
                        "host" => "vm".to_string(),
                        "device" => "cpu:Some CPU (8 GiB)".to_string(),
                        "backend" => "cpu".to_string(),
                        "commit" => "f932f61".to_string(),
                        "max_tokens" => "4".to_string(),
                        "warmup_tokens" => "1".to_string(),
                        "engine" => "kiln".to_string(),
                        // An ok row carries every measurement; these are not summarised.
                        "prompt_tokens" | "generated_tokens" | "prefill_ms" | "decode_ms"
                            if fields.contains(&("status", "ok")) =>
                        {
                            "1".to_string()
                        }
                        _ => String::new(),
                    },
                    |(_, v)| format!("\"{}\"", v.replace('"', "\"\"")),
                )
            })
            .collect();
        text.push_str(&(line.join(",") + "\n"));
    };
    let tiny = "synthetic:tiny";
    let small = "synthetic:smollm-135m";
    for (rep, decode, prefill, disturbed) in [
        ("1", "21390.5", "30511.2", ""),
        ("2", "6012.3", "9120.4", "other processes used 1.80 CPUs"),
        ("3", "27034.0", "35010.7", ""),
    ] {
        row(&[
            ("model", tiny),
            ("prompt_target_len", "16"),
            ("status", "ok"),
            ("repetition", rep),
            ("decode_tok_s", decode),
            ("prefill_tok_s", prefill),
            ("peak_bytes", "1048576"),
            ("disturbed", disturbed),
        ]);
        row(&[
            ("model", tiny),
            ("prompt_target_len", "2048"),
            ("status", "SKIP:context"),
            ("repetition", rep),
            ("reason", "2052 tokens exceed the model's context of 2048 tokens"),
        ]);
        row(&[
            ("model", small),
            ("prompt_target_len", "16"),
            ("status", "ok"),
            ("repetition", rep),
            ("decode_tok_s", ["48.2", "51.0", "44.9"][rep.parse::<usize>().unwrap() - 1]),
            ("prefill_tok_s", "612.5"),
            ("peak_bytes", "301989888"),
        ]);
        row(&[
            ("model", small),
            ("prompt_target_len", "2048"),
            ("status", "SKIP:oom"),
            ("repetition", rep),
            ("peak_bytes", "1288490189"),
            ("reason", "out of memory: requested 1.00 GiB for kv"),
        ]);
    }
    fs::write(&csv, text).unwrap();
    fs::write(
        dir.join("env.json"),
        serde_json::json!({
            "command": ["xtask", "bench-longprompt", "--models", "synthetic:tiny synthetic:smollm-135m", "--lengths", "16 2048", "--repeat", "3"],
            "output": csv.to_str().unwrap(),
            "commit": "f932f61",
        })
        .to_string(),
    )
    .unwrap();
    dir
}

/// Text as the page escapes it.
fn escaped(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#39;")
}

#[test]
fn a_recorded_run_s_page_shows_geometric_readings_disturbed_counts_and_where_memory_ran_out() {
    let sb = Sandbox::new();
    let dir = recorded_run(&sb);
    sb.run("report", &[dir.to_str().unwrap()]).expect_code(0);
    let page = fs::read_to_string(dir.join("report.html")).unwrap();
    // Rendered from the CSV through the terminal's sheet: the geometric mean of 21390.5,
    // 6012.3 and 27034.0 with Student's t on the logs (checked by hand), never their
    // arithmetic mean 18145.6 with an interval that may go negative.
    for want in [
        "<td>synthetic:tiny@16</td><td>3 / 3</td><td class=\"n\">15149 [2031, 112983] (n=3, within a factor of 7.46, 1 disturbed)</td>",
        "<td class=\"n\">47.97 [40.93, 56.21] (n=3, ±17.2%)</td>",
        "<td>synthetic:tiny@2048</td><td>0 / 3</td><td class=\"n\">-</td><td class=\"n\">-</td><td>3 SKIP:context</td>",
        &escaped(
            "disturbed 1 of 12 cells (other processes were busy while they ran; see the CSV's disturbed column): synthetic:tiny@16#2",
        ),
        "skipped 6 of 12 cells: synthetic:tiny@2048 (SKIP:context, 3 times), synthetic:smollm-135m@2048 (SKIP:oom, 3 times)",
        &escaped(
            "memory, synthetic:tiny: largest that fit 16 tokens (peak 1.0 MiB (1048576 bytes)); first that did not 2048 tokens: SKIP:context, not memory: 2052 tokens exceed the model's context of 2048 tokens",
        ),
        "memory, synthetic:smollm-135m: largest that fit 16 tokens (peak 288.0 MiB (301989888 bytes)); first that did not 2048 tokens: a real out of memory: it needed 1.2 GiB (1288490189 bytes), the bytes in use plus the refused request",
    ] {
        assert!(page.contains(want), "report.html lacks {want:?}:\n{page}");
    }
    for arithmetic in ["18145.6", "48.0 ["] {
        assert!(!page.contains(arithmetic), "report.html shows an arithmetic mean {arithmetic:?}:\n{page}");
    }
}

/// The sheet a run directory keeps (readings.json): its headline, every cell's text and
/// its notes.
fn sheet_texts(dir: &Path) -> Vec<String> {
    let path = dir.join("readings.json");
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let sheet: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut out: Vec<String> = sheet["headline"].as_str().unwrap().lines().map(str::to_string).collect();
    for t in sheet["tables"].as_array().unwrap() {
        for row in t["rows"].as_array().unwrap() {
            out.extend(row.as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap().to_string()));
        }
    }
    out.extend(sheet["notes"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_string()));
    out
}

/// Every text of the run's sheet is on its terminal and on its page, each cell in a cell.
fn page_says_what_the_terminal_said(run: &util::Run, dir: &Path) -> Vec<String> {
    let texts = sheet_texts(dir);
    let page = fs::read_to_string(dir.join("report.html")).unwrap();
    assert!(texts.iter().any(|t| t.contains(" [") && t.contains("(n=")), "no reading among {texts:?}");
    for t in &texts {
        assert!(run.stdout.contains(t.as_str()), "the terminal did not print {t:?}{run}");
        assert!(page.contains(&escaped(t)), "report.html lacks the terminal's {t:?}:\n{page}");
    }
    texts
}

#[test]
fn a_repeated_sweep_s_page_says_what_its_terminal_said() {
    let sb = Sandbox::new();
    let mut args = SWEEP.to_vec();
    args.extend(["--repeat", "3"]);
    let run = sb.run("bench-longprompt", &args);
    run.expect_code(1);
    let dirs = run_dirs(&sb);
    let texts = page_says_what_the_terminal_said(&run, &dirs[0]);
    assert!(
        texts.iter().any(|t| t.starts_with("memory, synthetic:tiny: largest that fit 16 tokens")),
        "{texts:?}"
    );
    assert!(texts.iter().any(|t| t.contains("(SKIP:context, 3 times)")), "{texts:?}");
    // The summary the terminal printed is kept beside the readings.
    let md = fs::read_to_string(dirs[0].join("summary.md")).unwrap();
    assert!(run.stdout.contains(md.trim()), "summary.md is not what the terminal printed{run}");
    if let Some(chromium) = std::env::var_os("KILN_TEST_CHROMIUM") {
        screenshot_is_not_blank(Path::new(&chromium), &dirs[0].join("report.html"), sb.dir.path());
    }
}

#[test]
fn an_until_ci_sweep_s_page_carries_its_verdict_and_stopping_rule() {
    let sb = Sandbox::new();
    let run = sb.run(
        "bench-longprompt",
        &[
            "--models",
            "synthetic:tiny",
            "--lengths",
            "16",
            "--max-tokens",
            "4",
            "--warmup-tokens",
            "1",
            "--until-ci",
            "1",
            "--max-pairs",
            "5",
        ],
    );
    run.expect_code(0);
    let last = run_dirs(&sb).pop().unwrap();
    let texts = page_says_what_the_terminal_said(&run, &last);
    let verdict =
        texts.iter().find(|t| t.starts_with("--until-ci 1%: ")).unwrap_or_else(|| panic!("{texts:?}"));
    assert!(verdict.contains("after 5 repetitions") || verdict.contains("after 4 repetitions"), "{verdict}");
    assert!(texts.iter().any(|t| t.starts_with("stopping rule: ")), "{texts:?}");
    let page = fs::read_to_string(last.join("report.html")).unwrap();
    assert!(page.contains("confidence sequence"), "{page}");
}

#[test]
fn a_sweep_with_measure_roofs_places_every_cell_and_its_page_draws_the_roofline() {
    let sb = Sandbox::new();
    let args =
        ["--models", "synthetic:tiny", "--lengths", "32 64", "--max-tokens", "4", "--warmup-tokens", "1"];
    let with: Vec<&str> = args.iter().copied().chain(["--measure-roofs", "--threads", "2"]).collect();
    let run = sb.run("bench-longprompt", &with);
    run.expect_code(0).expect_stdout("Cells under the roofs");
    for phase in ["synthetic:tiny@32 prefill", "synthetic:tiny@32 decode", "synthetic:tiny@64 decode"] {
        run.expect_stdout(&format!("| `{phase}` |"));
    }
    let dir = &run_dirs(&sb)[0];
    let sheet: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(dir.join("readings.json")).unwrap()).unwrap();
    let points = sheet["roofline"]["points"].as_array().unwrap();
    assert_eq!(points.len(), 4, "{run}");
    assert!(
        points.iter().all(|p| p["threads"] == 2 && p["share"].as_f64().is_some_and(|s| s > 0.0)),
        "{run}"
    );
    // The page draws the roofline from that record, and prints the same texts.
    let page = fs::read_to_string(dir.join("report.html")).unwrap();
    assert!(page.contains("roofline, 2 thread(s)"), "no roofline plot");
    assert!(page.contains("<td><code>synthetic:tiny@32 prefill</code></td>"), "the point's name as code");
    let text = points[0]["text"].as_str().unwrap();
    assert!(page.contains(text) && run.stdout.contains(text), "{text}");
    // The roofs are the CPU's: another backend is refused before anything is built.
    let refused: Vec<&str> = args.iter().copied().chain(["--measure-roofs", "--backend", "cuda"]).collect();
    sb.run("bench-longprompt", &refused).expect_code(2).expect_stderr("--measure-roofs with --backend cuda");
}
