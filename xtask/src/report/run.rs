//! A run directory read back from its files: which task wrote it, its env.json, and its
//! rows (the sweep's CSV, which env.json names; levels.csv; passes.jsonl; quality.csv).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use super::html;
use crate::bench_offload_copy::OffloadRow;
use crate::console::usage;
use crate::serve_bench::output::LevelSummary;
use crate::serve_bench::stats::Summary;
use crate::sweep::rows::{self, Row};
use crate::sweep::summary::{self, RunState, UntilCi};
use crate::verdict::sheet::Sheet;

/// What a run directory holds.
pub enum Kind {
    /// bench-longprompt or bench-decode: the CSV env.json names, and the sheet its
    /// terminal printed (readings.json), or for a run written before there was one, the
    /// sheet built from the CSV by the same function.
    Sweep { csv: PathBuf, rows: Vec<Row>, sheet: Sheet },
    /// bench-offload-copy.
    Offload { csv: PathBuf, rows: Vec<OffloadRow>, raw: Vec<BTreeMap<String, String>> },
    /// serve-bench: levels.csv, summary.md and requests.jsonl.
    Serve { levels: Vec<LevelSummary>, open_loop: bool, summary: Option<String>, requests: Vec<Value> },
    /// qmv-pin-tax: summary.md, tax.svg, passes.jsonl.
    PinTax { passes: Vec<Value>, summary: Option<String>, svg: Option<Vec<u8>> },
    /// bench-quality: quality.csv and quality.md.
    Quality { raw: Vec<BTreeMap<String, String>>, summary: Option<String> },
    /// A run that keeps only the sheet its terminal printed (readings.json), such as a
    /// bisect: the page renders that sheet.
    Readings { sheet: Sheet },
}

impl Kind {
    /// The task's name.
    pub fn name(&self) -> &'static str {
        match self {
            Kind::Sweep { .. } => "decode sweep",
            Kind::Offload { .. } => "offload copy",
            Kind::Serve { .. } => "serve-bench",
            Kind::PinTax { .. } => "qmv-pin-tax",
            Kind::Quality { .. } => "bench-quality",
            Kind::Readings { sheet } if sheet.task == "bisect" => "bisect",
            Kind::Readings { sheet } if sheet.task == "bench-kernels" => "bench-kernels roofline",
            Kind::Readings { .. } => "readings",
        }
    }
}

/// One run.
pub struct Run {
    /// Its directory.
    pub dir: PathBuf,
    /// The directory's name.
    pub name: String,
    /// env.json, when there is one.
    pub env: Option<Value>,
    /// Its rows.
    pub kind: Kind,
}

/// A file of the run directory (a regular file only, see [`crate::fsx`]).
fn read_text(path: &Path) -> Result<String> {
    crate::fsx::read_text_bounded(path, crate::fsx::MAX_RUN_FILE_BYTES)
}

/// Same, `None` when the run has no such file.
fn read_text_if_any(path: &Path) -> Result<Option<String>> {
    crate::fsx::read_text_if_any(path, crate::fsx::MAX_RUN_FILE_BYTES)
}

fn read_csv_maps(path: &Path) -> Result<Vec<BTreeMap<String, String>>> {
    Ok(read_csv_lines(path)?.into_iter().map(|(_, m)| m).collect())
}

/// A CSV's rows by column name, each with its line number in the file.
fn read_csv_lines(path: &Path) -> Result<Vec<(u64, BTreeMap<String, String>)>> {
    let text = read_text(path)?;
    let mut rdr = csv::Reader::from_reader(text.as_bytes());
    let headers = rdr.headers().with_context(|| format!("reading {}", path.display()))?.clone();
    let mut out = Vec::new();
    for rec in rdr.records() {
        let rec = rec.with_context(|| format!("reading {}", path.display()))?;
        let line = rec.position().map_or(0, csv::Position::line);
        out.push((
            line,
            headers.iter().zip(rec.iter()).map(|(h, v)| (h.to_string(), v.to_string())).collect(),
        ));
    }
    Ok(out)
}

fn read_jsonl(path: &Path) -> Result<Vec<Value>> {
    // Lossy: a run killed mid-write may end in half a character; that line is dropped below.
    let bytes = crate::fsx::read_regular_bounded(path, crate::fsx::MAX_RUN_FILE_BYTES)?;
    let text = String::from_utf8_lossy(&bytes);
    // A last line cut short (the run was killed mid-write) is left out, not an error.
    Ok(text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect())
}

/// levels.csv back into the summaries the plot draws.
///
/// Every column but `level` is a count or a measurement: empty, or a finite non-negative
/// number (serve-bench writes no other), else an error naming the file, line and column.
fn read_levels(path: &Path) -> Result<Vec<LevelSummary>> {
    let lines = read_csv_lines(path)?;
    for (line, m) in &lines {
        // `level` names the level and `disturbed` says what else ran: text, not numbers.
        let text = |c: &str| c == "level" || c == "disturbed";
        for (col, v) in m.iter().filter(|(c, v)| !text(c.as_str()) && !v.trim().is_empty()) {
            if !v.trim().parse::<f64>().is_ok_and(|x| x.is_finite() && x >= 0.0) {
                usage!(
                    "{}: line {line}: column {col} is {v:?}: expected a finite non-negative number, or nothing",
                    path.display()
                );
            }
        }
    }
    let maps: Vec<BTreeMap<String, String>> = lines.into_iter().map(|(_, m)| m).collect();
    let f = |m: &BTreeMap<String, String>, k: &str| m.get(k).and_then(|v| v.parse::<f64>().ok());
    let sum = |m: &BTreeMap<String, String>, metric: &str| Summary {
        n: 0,
        mean: f(m, &format!("{metric}_mean")),
        median: f(m, &format!("{metric}_p50")),
        p90: f(m, &format!("{metric}_p90")),
        p95: f(m, &format!("{metric}_p95")),
        p99: f(m, &format!("{metric}_p99")),
    };
    Ok(maps
        .iter()
        .map(|m| {
            let mut l = LevelSummary::of(
                m.get("level").cloned().unwrap_or_default(),
                m.get("concurrency").and_then(|v| v.parse().ok()),
                f(m, "rate"),
                &[],
                f(m, "wall_s").unwrap_or(0.0),
            );
            l.requests = f(m, "requests").unwrap_or(0.0) as usize;
            l.ok = f(m, "ok").unwrap_or(0.0) as usize;
            l.failed = f(m, "failed").unwrap_or(0.0) as usize;
            l.output_tokens = f(m, "output_tokens").unwrap_or(0.0) as u64;
            l.output_tok_s = f(m, "output_tok_s").unwrap_or(0.0);
            l.req_s = f(m, "req_s").unwrap_or(0.0);
            l.ttft = sum(m, "ttft_ms");
            l.tpot = sum(m, "tpot_ms");
            l.itl = sum(m, "itl_ms");
            l.e2e = sum(m, "e2e_ms");
            l.client_cpu_s = f(m, "client_cpu_s").unwrap_or(0.0);
            l.server_cpu_s = f(m, "server_cpu_s");
            l.disturbed = m.get("disturbed").cloned().unwrap_or_default();
            l
        })
        .collect())
}

impl Run {
    /// Reads `dir`.
    pub fn load(dir: &Path) -> Result<Run> {
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let env_path = dir.join("env.json");
        let env: Option<Value> = match read_text_if_any(&env_path)? {
            Some(text) => Some(
                serde_json::from_str(&text).with_context(|| format!("{} is not JSON", env_path.display()))?,
            ),
            None => None,
        };
        // Which task wrote the run is told by which file it has (of any type: a FIFO
        // named levels.csv is refused when read, not taken for another task's run).
        let has = |name: &str| fs::symlink_metadata(dir.join(name)).is_ok();
        let kind = if has("levels.csv") {
            let levels = read_levels(&dir.join("levels.csv"))?;
            let open_loop = levels.iter().any(|l| l.concurrency.is_none());
            let requests = match read_jsonl(&dir.join("requests.jsonl")) {
                Err(e) if crate::fsx::is_not_found(&e) => Vec::new(),
                r => r?,
            };
            Kind::Serve { levels, open_loop, summary: read_text_if_any(&dir.join("summary.md"))?, requests }
        } else if has("passes.jsonl") {
            Kind::PinTax {
                passes: read_jsonl(&dir.join("passes.jsonl"))?,
                summary: read_text_if_any(&dir.join("summary.md"))?,
                svg: match crate::fsx::read_regular_bounded(
                    &dir.join("tax.svg"),
                    crate::fsx::MAX_RUN_FILE_BYTES,
                ) {
                    Err(e) if crate::fsx::is_not_found(&e) => None,
                    r => Some(r?),
                },
            }
        } else if has("quality.csv") {
            Kind::Quality {
                raw: read_csv_maps(&dir.join("quality.csv"))?,
                summary: read_text_if_any(&dir.join("quality.md"))?,
            }
        } else if let Some(out) = env.as_ref().and_then(|e| e.get("output")).and_then(Value::as_str) {
            // The output path as the task wrote it: absolute, or relative to the workspace.
            let csv = PathBuf::from(out);
            let csv = if csv.is_absolute() { csv } else { crate::args::project_root(dir).join(csv) };
            let head = read_text(&csv)
                .with_context(|| format!("reading {}, the run's CSV (env.json's output)", csv.display()))?;
            let first = head.lines().next().unwrap_or_default();
            let offload = [
                &crate::bench_offload_copy::HEADER[..],
                &crate::bench_offload_copy::HEADER_BEFORE_DRIVER[..],
            ];
            if rows::is_sweep_header(first) {
                let rows = rows::rows_from_bytes(head.as_bytes(), &csv)?;
                let sheet = match Sheet::read(dir)? {
                    Some(sheet) => sheet,
                    None => {
                        let state = RunState { until_ci: until_ci(env.as_ref()), ..RunState::default() };
                        summary::sheet_of_rows(&rows, &state)
                    }
                };
                Kind::Sweep { csv, rows, sheet }
            } else if offload.iter().any(|h| first == h.join(",")) {
                let mut rdr = csv::Reader::from_reader(head.as_bytes());
                let rows = rdr
                    .deserialize()
                    .collect::<Result<Vec<OffloadRow>, _>>()
                    .with_context(|| format!("reading {}", csv.display()))?;
                Kind::Offload { raw: read_csv_maps(&csv)?, csv, rows }
            } else {
                bail!("{} has neither the sweep's nor the offload sweep's header", csv.display());
            }
        } else if let Some(sheet) = Sheet::read(dir)? {
            Kind::Readings { sheet }
        } else {
            bail!(
                "not a run directory: it has no levels.csv (serve-bench), passes.jsonl (qmv-pin-tax), quality.csv (bench-quality), env.json naming a sweep's CSV or readings.json (bisect)"
            );
        };
        Ok(Run { dir: dir.to_path_buf(), name, env, kind })
    }

    /// The files [`Run::load`] reads (whether or not the run has each): what a comparison
    /// must never be written over.
    pub fn inputs(&self) -> Vec<PathBuf> {
        let names: &[&str] = match &self.kind {
            Kind::Sweep { .. } => &[crate::verdict::reading::FILE, "summary.md"],
            Kind::Offload { .. } => &[],
            Kind::Serve { .. } => &["levels.csv", "requests.jsonl", "summary.md"],
            Kind::PinTax { .. } => &["passes.jsonl", "summary.md", "tax.svg"],
            Kind::Quality { .. } => &["quality.csv", "quality.md"],
            Kind::Readings { .. } => &[crate::verdict::reading::FILE, "summary.md"],
        };
        let mut out: Vec<PathBuf> = ["env.json"].iter().chain(names).map(|n| self.dir.join(n)).collect();
        if let Kind::Sweep { csv, .. } | Kind::Offload { csv, .. } = &self.kind {
            out.push(csv.clone());
        }
        out
    }

    /// The command line that made the run, from env.json.
    pub fn command(&self) -> String {
        match self.env.as_ref().and_then(|e| e.get("command")) {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    let s = v.as_str().unwrap_or_default();
                    if !s.is_empty()
                        && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./:=@,+".contains(c))
                    {
                        s.to_string()
                    } else {
                        format!("'{}'", s.replace('\'', r"'\''"))
                    }
                })
                .collect::<Vec<_>>()
                .join(" "),
            Some(Value::String(s)) => s.clone(),
            _ => "(not recorded)".into(),
        }
    }

    /// The lines that say a run's figures are the CUDA kernels' host execution, not a
    /// GPU's (`KILN_CUDA_EMULATE=1`): from env.json's device and, for a sweep, each row's.
    pub fn host_execution_notes(&self) -> String {
        let mut devices: Vec<&str> = Vec::new();
        if let Some(Value::String(d)) = self.env.as_ref().and_then(|e| e.get("device")) {
            devices.push(d);
        }
        if let Kind::Sweep { rows, .. } = &self.kind {
            devices.extend(rows.iter().map(|r| r.device.as_str()));
        }
        crate::machine::host_execution_notes(devices)
    }

    /// env.json as settings, compared as data: nested objects become dotted keys
    /// (`serve_bench.max_tokens`, `kiln_env.KILN_THREADS`), sorted, so two runs of the
    /// same settings are equal whatever order their files list keys in. The command line
    /// is left out (it is shown on its own).
    pub fn settings(&self) -> BTreeMap<String, Value> {
        fn flatten(prefix: &str, v: &Value, out: &mut BTreeMap<String, Value>) {
            match v {
                Value::Object(m) if !m.is_empty() => {
                    for (k, v) in m {
                        let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                        flatten(&key, v, out);
                    }
                }
                other => {
                    out.insert(prefix.to_string(), other.clone());
                }
            }
        }
        let mut out = BTreeMap::new();
        if let Some(Value::Object(m)) = &self.env {
            for (k, v) in m.iter().filter(|(k, _)| k.as_str() != "command") {
                flatten(k, v, &mut out);
            }
        }
        out
    }

    /// [`Run::settings`] as text, one row per setting.
    pub fn fingerprint(&self) -> Vec<(String, String)> {
        self.settings().into_iter().map(|(k, v)| (k, setting_text(&v))).collect()
    }

    /// The summary, as HTML.
    pub fn summary_html(&self) -> String {
        match &self.kind {
            // The terminal's sheet, cell for cell: nothing here takes a mean.
            Kind::Sweep { sheet, .. } | Kind::Readings { sheet } => html::sheet(sheet),
            Kind::Offload { rows, .. } => html::markdown(&crate::bench_offload_copy::markdown(rows)),
            Kind::Serve { summary, .. } | Kind::PinTax { summary, .. } => {
                markdown_file(summary, "summary.md")
            }
            Kind::Quality { summary, .. } => markdown_file(summary, "quality.md"),
        }
    }

    /// The plots, as HTML: inline SVG drawn again from the rows, or (the pin tax's, whose
    /// analysis is not redone here) the run's own tax.svg as an image, never as markup.
    pub fn plots(&self) -> Vec<String> {
        // A run that measured the machine's roofs recorded them in its sheet: the
        // roofline is drawn from that record.
        let roofline = match &self.kind {
            Kind::Sweep { sheet, .. } | Kind::Readings { sheet } => sheet.roofline.as_ref(),
            _ => None,
        };
        let roofline = roofline.map(|r| crate::plot::render(&super::roofline::panels(r)).0);
        let panels = match &self.kind {
            Kind::Readings { .. } => return roofline.into_iter().collect(),
            // The points and intervals are the sheet's readings, taken the same way.
            Kind::Sweep { rows, sheet, .. } => {
                let method = sheet
                    .tables
                    .iter()
                    .flat_map(|t| t.rows.iter().flatten())
                    .find_map(|c| c.reading.as_ref().map(|r| r.method))
                    .unwrap_or(crate::verdict::reading::Method::T);
                crate::sweep::panels::panels_by(rows, method)
            }
            Kind::Offload { rows, .. } => crate::bench_offload_copy::panels(rows),
            Kind::Serve { levels, open_loop, .. } => crate::serve_bench::output::panels(levels, *open_loop),
            Kind::PinTax { svg, .. } => {
                return svg.iter().map(|svg| html::svg_image(svg, "tax.svg")).collect();
            }
            Kind::Quality { raw, .. } => crate::bench_quality::plot::panels(
                &raw.iter().filter_map(crate::bench_quality::plot::Scored::from_csv).collect::<Vec<_>>(),
            ),
        };
        std::iter::once(crate::plot::render(&panels).0).chain(roofline).collect()
    }

    /// Every cell without a measurement: the table's header and rows.
    pub fn problems(&self) -> (Vec<&'static str>, Vec<Vec<String>>) {
        match &self.kind {
            Kind::Sweep { rows, .. } => (
                vec!["model", "engine", "prompt tokens", "repetition", "status", "reason"],
                rows.iter()
                    .filter(|r| r.status != "ok")
                    .map(|r| {
                        vec![
                            r.model.clone(),
                            engine(r),
                            r.prompt_target_len.map_or_else(|| r.prompt.clone(), |l| l.to_string()),
                            r.repetition.to_string(),
                            r.status.clone(),
                            r.reason.clone(),
                        ]
                    })
                    .collect(),
            ),
            Kind::Offload { raw, .. } => (
                vec!["model", "cache_slots", "batch_size", "miss_rate", "status"],
                raw.iter()
                    .filter(|m| m.get("status").is_some_and(|s| s != "ok"))
                    .map(|m| {
                        ["model", "cache_slots", "batch_size", "miss_rate", "status"]
                            .iter()
                            .map(|k| m.get(*k).cloned().unwrap_or_default())
                            .collect()
                    })
                    .collect(),
            ),
            Kind::Serve { requests, .. } => (
                vec!["level", "request", "warm-up", "HTTP status", "error"],
                requests
                    .iter()
                    .filter(|r| r.get("ok").and_then(Value::as_bool) == Some(false))
                    .map(|r| {
                        let s = |k: &str| {
                            r.get(k).map_or(String::new(), |v| {
                                v.as_str().map_or_else(|| v.to_string(), str::to_string)
                            })
                        };
                        vec![s("level"), s("key"), s("warmup"), s("http_status"), s("error")]
                    })
                    .collect(),
            ),
            Kind::PinTax { passes, .. } => {
                // One list from the run's own records: cells never sent (env.json's
                // skipped), passes that do not count, and cells that failed in a pass
                // that counts; the page's "none" is said only when all three are empty.
                let s = |v: &Value, k: &str| {
                    v.get(k)
                        .map_or(String::new(), |v| v.as_str().map_or_else(|| v.to_string(), str::to_string))
                };
                let skipped = self
                    .env
                    .as_ref()
                    .and_then(|e| e.get("qmv_pin_tax"))
                    .and_then(|t| t.get("skipped"))
                    .and_then(Value::as_object);
                let mut out: Vec<Vec<String>> = skipped
                    .into_iter()
                    .flatten()
                    .map(|(cell, why)| {
                        let why = why.as_str().map_or_else(|| why.to_string(), str::to_string);
                        vec![
                            cell.clone(),
                            "every boot".into(),
                            "-".into(),
                            "-".into(),
                            format!("SKIP:context: {why}"),
                        ]
                    })
                    .collect();
                for p in passes.iter().filter(|p| p.get("pass").and_then(Value::as_u64).unwrap_or(0) > 0) {
                    let counts = p.get("ok").and_then(Value::as_bool) == Some(true)
                        && p.get("invalid").is_none_or(Value::is_null);
                    if !counts {
                        let why = p
                            .get("reason")
                            .and_then(Value::as_str)
                            .or_else(|| p.get("invalid").and_then(Value::as_str))
                            .unwrap_or("failed");
                        out.push(vec![
                            "every cell".into(),
                            s(p, "boot"),
                            s(p, "arm"),
                            s(p, "pass"),
                            why.to_string(),
                        ]);
                        continue;
                    }
                    let cells = p.get("cells").and_then(Value::as_array).into_iter().flatten();
                    for c in cells.filter(|c| c.get("failed").and_then(Value::as_u64).unwrap_or(0) > 0) {
                        let why = format!(
                            "{} of {} requests failed; first: {}",
                            s(c, "failed"),
                            s(c, "requests"),
                            c.get("first_error").and_then(Value::as_str).unwrap_or("")
                        );
                        out.push(vec![s(c, "cell"), s(p, "boot"), s(p, "arm"), s(p, "pass"), why]);
                    }
                }
                (vec!["cell", "boot", "arm", "pass", "why it has no measurement"], out)
            }
            Kind::Quality { .. } | Kind::Readings { .. } => (Vec::new(), Vec::new()),
        }
    }

    /// Links to the files beside the report (and the sweep's CSV, wherever it is):
    /// (href, label).
    pub fn files(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        if let Kind::Sweep { csv, .. } | Kind::Offload { csv, .. } = &self.kind {
            let href = relative(&self.dir, csv);
            out.push((href.clone(), format!("{href} (the run's CSV)")));
        }
        let mut names: Vec<String> = fs::read_dir(&self.dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect()
            })
            .unwrap_or_default();
        names.sort();
        for n in names.into_iter().filter(|n| n != "report.html" && !n.starts_with('.')) {
            match fs::metadata(self.dir.join(&n)) {
                Ok(m) if m.is_dir() => out.push((percent_encode(&n) + "/", format!("{n}/ (a folder)"))),
                m => {
                    let size = m.map(|m| m.len()).unwrap_or(0);
                    out.push((percent_encode(&n), format!("{n} ({size} bytes)")));
                }
            }
        }
        out
    }
}

/// A setting's value as a page prints it: a string bare, nothing as `-`, else its JSON.
pub fn setting_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

/// A summary file the run wrote, as HTML, or a note that it has none.
fn markdown_file(md: &Option<String>, name: &str) -> String {
    match md {
        Some(md) => html::markdown(md),
        None => format!("<p class=\"bad\">no {name} in the run directory</p>\n"),
    }
}

/// A peer's rows carry their engine; kiln's say kiln.
pub fn engine(r: &Row) -> String {
    if r.is_peer() { r.engine.clone() } else { "kiln".into() }
}

/// `--until-ci`'s target from the command env.json records (`--until-ci 5` or
/// `--until-ci=5`), for a run written before its readings were kept.
fn until_ci(env: Option<&Value>) -> Option<UntilCi> {
    let args: Vec<&str> = env?.get("command")?.as_array()?.iter().filter_map(Value::as_str).collect();
    let value = args.iter().enumerate().find_map(|(i, a)| match a.strip_prefix("--until-ci") {
        Some("") => args.get(i + 1).copied(),
        Some(v) => v.strip_prefix('='),
        None => None,
    })?;
    let target_pct = crate::verdict::pct_arg(value).ok()?;
    Some(UntilCi { target_pct, stopped: None })
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~/".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// `to` as a link relative to the directory `from` (both made absolute).
fn relative(from: &Path, to: &Path) -> String {
    let abs = |p: &Path| fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let (from, to) = (abs(from), abs(to));
    let a: Vec<_> = from.components().collect();
    let b: Vec<_> = to.components().collect();
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let mut parts: Vec<String> = vec!["..".into(); a.len() - common];
    parts.extend(b[common..].iter().map(|c| c.as_os_str().to_string_lossy().into_owned()));
    percent_encode(&parts.join("/"))
}
