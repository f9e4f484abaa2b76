//! Runs side by side as one [`Sheet`]: a headline that answers "did B change anything?",
//! the settings that differ (compared as data), then per cell each run's reading and each
//! later run's ratio to the first with its interval and verdict at a margin. The terminal
//! prints the sheet's markdown and compare.html renders the same cells' texts; neither
//! computes a number of its own. Runs of different tasks are refused.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use anyhow::{Result, bail};
use serde_json::Value;

use super::html::{escape, head, table};
use super::run::{Kind, Run, engine, setting_text};
use crate::verdict::reading::{Better, Method, Reading, Verdict};
use crate::verdict::sheet::{Cell, Sheet, Table};

/// Settings that say which run a directory is, not how it measured: never a difference.
const RUN_OWN: [&str; 3] = ["started", "output", "oom_record"];

/// The unit of a ratio that compares one value per run: each run's geometric mean. A
/// serve-bench level's requests share their run's machine and server state, so their
/// spread is no interval for a difference between two runs (two runs of one setting on
/// a busy machine read as a 3x "regression" of TTFT at n=16 requests); only repeated
/// runs are.
const RUNS: &str = "runs";

/// One run's observations of one quantity of one cell.
#[derive(Clone, Debug, Default)]
struct Sample {
    values: Vec<f64>,
    /// How many of them a busy machine disturbed.
    disturbed: usize,
}

/// One compared quantity of one cell, per run.
struct Line {
    cell: String,
    metric: &'static str,
    better: Better,
    /// What one observation of the ratio is, for the verdict's "N more ... would settle
    /// it"; [`RUNS`] when the ratio rests on one value per run.
    unit: &'static str,
    samples: Vec<Option<Sample>>,
}

/// Every compared line of `runs`, in the order the runs list their cells.
fn lines(runs: &[Run]) -> Result<Vec<Line>> {
    let mut out: Vec<Line> = Vec::new();
    let mut put = |cell: String, metric: &'static str, better, unit, run: usize, s: Sample| {
        let i = match out.iter().position(|l| l.cell == cell && l.metric == metric) {
            Some(i) => i,
            None => {
                out.push(Line { cell, metric, better, unit, samples: vec![None; runs.len()] });
                out.len() - 1
            }
        };
        out[i].samples[run] = Some(s);
    };
    for (ri, run) in runs.iter().enumerate() {
        match &run.kind {
            Kind::Readings { sheet } => bail!(
                "{}: a {} run keeps only its readings, no measurements to compare with another run's",
                run.name,
                if sheet.task.is_empty() { "readings-only" } else { &sheet.task }
            ),
            Kind::Sweep { rows, .. } => {
                let mut cells: Vec<((String, String, u64), [Sample; 2])> = Vec::new();
                for r in rows {
                    let key = (r.model.clone(), engine(r), r.prompt_target_len.unwrap_or(0));
                    let i = match cells.iter().position(|(k, _)| *k == key) {
                        Some(i) => i,
                        None => {
                            cells.push((key, Default::default()));
                            cells.len() - 1
                        }
                    };
                    if r.status != "ok" {
                        continue;
                    }
                    let busy = usize::from(!r.disturbed.trim().is_empty());
                    for (s, v) in cells[i].1.iter_mut().zip([r.decode_tok_s, r.prefill_tok_s]) {
                        if let Some(v) = v {
                            s.values.push(v);
                            s.disturbed += busy;
                        }
                    }
                }
                for ((model, engine, len), [decode, prefill]) in cells {
                    let cell = format!("{model} ({engine}) @ {len}");
                    put(cell.clone(), "decode tok/s", Better::Higher, "repetitions", ri, decode);
                    put(cell, "prefill tok/s", Better::Higher, "repetitions", ri, prefill);
                }
            }
            Kind::Serve { levels, requests, .. } => {
                for l in levels {
                    let busy = !l.disturbed.trim().is_empty();
                    let mark =
                        |values: Vec<f64>| Sample { disturbed: if busy { values.len() } else { 0 }, values };
                    put(
                        l.level.clone(),
                        "output tok/s",
                        Better::Higher,
                        RUNS,
                        ri,
                        mark(vec![l.output_tok_s]),
                    );
                    // Each measured request is one observation of its latencies; a run
                    // without requests.jsonl has only the level's median.
                    for (metric, key, median) in [
                        ("TTFT ms", "ttft_ms", l.ttft.median),
                        ("TPOT ms", "tpot_ms", l.tpot.median),
                        ("E2E ms", "e2e_ms", l.e2e.median),
                    ] {
                        let mut values: Vec<f64> = requests
                            .iter()
                            .filter(|r| r.get("level").and_then(Value::as_str) == Some(l.level.as_str()))
                            .filter(|r| r.get("warmup").and_then(Value::as_bool) == Some(false))
                            .filter(|r| r.get("ok").and_then(Value::as_bool) == Some(true))
                            .filter_map(|r| r.get(key).and_then(Value::as_f64))
                            .collect();
                        if values.is_empty() {
                            values.extend(median);
                        }
                        put(l.level.clone(), metric, Better::Lower, RUNS, ri, mark(values));
                    }
                }
            }
            Kind::Offload { rows, .. } => {
                for r in rows.iter().filter(|r| r.status == "ok") {
                    let cell =
                        format!("{}@{} bs={} miss={}", r.model, r.cache_slots, r.batch_size, r.miss_rate);
                    for (metric, column, v, better) in [
                        ("fetch us/token", "fetch_us_per_token", r.fetch_us_per_token, Better::Lower),
                        ("copy GB/s", "copy_gb_s", r.copy_gb_s, Better::Higher),
                    ] {
                        let Some(v) = v else { continue };
                        if !(v.is_finite() && v >= 0.0) {
                            bail!(
                                "{}: cell {cell}: {column} is {v}: an ok row's measurement must be a finite non-negative number",
                                run.name
                            );
                        }
                        let mut s = Sample::default();
                        s.values.push(v);
                        put(cell.clone(), metric, better, RUNS, ri, s);
                    }
                }
            }
            Kind::Quality { raw, .. } => {
                for m in raw {
                    let g = |k: &str| m.get(k).cloned().unwrap_or_default();
                    let cell = format!("{} {}", g("model"), g("scheme"));
                    // A NaN here is intentional (no reference to score against): no value.
                    for (metric, key, better) in [
                        ("mean KLD", "kld_mean", Better::Lower),
                        ("PPL", "ppl", Better::Lower),
                        ("tok/s", "tok_s", Better::Higher),
                    ] {
                        let values =
                            g(key).parse::<f64>().ok().filter(|v| v.is_finite()).into_iter().collect();
                        put(cell.clone(), metric, better, RUNS, ri, Sample { values, disturbed: 0 });
                    }
                }
            }
            Kind::PinTax { .. } => bail!(
                "{}: a qmv-pin-tax run is its own A/B comparison (its summary gives the ratios): compare sweep, serve-bench, offload or quality runs",
                run.name
            ),
        }
    }
    Ok(out)
}

/// How a run's intervals are taken: the confidence sequence when it ran until its
/// intervals were narrow (`until_ci` in env.json), else Student's t.
fn method(run: &Run) -> Method {
    match run.env.as_ref().and_then(|e| e.get("until_ci")) {
        Some(v) if !v.is_null() && v != &Value::Bool(false) => Method::Sequence,
        _ => Method::T,
    }
}

/// The comparison of `runs` (the first is the base) judged at `margin_pct`: the sheet
/// the terminal prints, and compare.html rendered from it.
pub fn compare(runs: &[Run], margin_pct: f64) -> Result<(Sheet, String)> {
    let first = runs[0].kind.name();
    if let Some(other) = runs.iter().find(|r| r.kind.name() != first) {
        bail!(
            "{} is a {first} run and {} a {} run: only runs of one task compare",
            runs[0].name,
            other.name,
            other.kind.name()
        );
    }
    let sheet = sheet(runs, margin_pct)?;
    Ok((sheet.clone(), page(runs, &sheet)))
}

fn sheet(runs: &[Run], margin_pct: f64) -> Result<Sheet> {
    let methods: Vec<Method> = runs.iter().map(method).collect();
    // Per later run: regressed, improved, same, undecided.
    let mut tally = vec![[0usize; 4]; runs.len()];
    let mut rows = Vec::new();
    for l in lines(runs)? {
        let mut row: Vec<Cell> = vec![l.cell.as_str().into(), l.metric.into()];
        for (s, &m) in l.samples.iter().zip(&methods) {
            row.push(
                match s.as_ref().and_then(|s| Some(Reading::of(&s.values, m)?.disturbed(s.disturbed))) {
                    Some(r) => Cell::reading(r),
                    None => "-".into(),
                },
            );
        }
        for i in 1..runs.len() {
            let m = if methods[0] == Method::Sequence || methods[i] == Method::Sequence {
                Method::Sequence
            } else {
                Method::T
            };
            let judged = match (&l.samples[0], &l.samples[i]) {
                (Some(a), Some(b)) if l.unit == RUNS => {
                    // One value a run: its geometric mean, disturbed when any of it was.
                    let one = |s: &Sample| Some(Reading::of(&s.values, Method::T)?.estimate);
                    let busy = usize::from(a.disturbed > 0 || b.disturbed > 0);
                    match (one(a), one(b)) {
                        (Some(ea), Some(eb)) => Reading::of_ratio_unpaired(&[eb], &[ea], m)
                            .map(|r| r.disturbed(busy).judge(l.better, margin_pct)),
                        _ => None,
                    }
                }
                (Some(a), Some(b)) => Reading::of_ratio_unpaired(&b.values, &a.values, m)
                    .map(|r| r.disturbed(a.disturbed + b.disturbed).judge(l.better, margin_pct)),
                _ => None,
            };
            row.push(match judged {
                Some(j) => {
                    tally[i][match j.verdict {
                        Verdict::Regressed => 0,
                        Verdict::Improved => 1,
                        Verdict::Same => 2,
                        Verdict::Undecided { .. } | Verdict::NoInterval => 3,
                    }] += 1;
                    Cell::judged(j, l.unit, None)
                }
                None => "-".into(),
            });
        }
        rows.push(row);
    }
    let headline = (1..runs.len())
        .map(|i| {
            let [reg, imp, same, und] = tally[i];
            if reg + imp + same + und == 0 {
                format!("{} vs A: no cell was measured by both", letter(i))
            } else {
                format!(
                    "{} vs A: {reg} regressed, {imp} improved, {same} same within ±{margin_pct}%, {und} undecided",
                    letter(i)
                )
            }
        })
        .collect::<Vec<_>>()
        .join("; ");
    let mut columns = vec!["cell".to_string(), "metric".to_string()];
    columns.extend((0..runs.len()).map(letter));
    columns.extend((1..runs.len()).map(|i| format!("{}/A", letter(i))));
    let per_cell = Table {
        title: "Per cell".into(),
        legend: format!(
            "Each run's value is the geometric mean of its observations (a sweep's repetitions; a serve-bench level's requests; an offload or quality cell and a level's throughput are one value) with its 95% interval on the logs (Student's t; the confidence sequence for a run stopped by --until-ci), n, and how many were taken on a busy machine. A sweep's ratio is the ratio of the two geometric means with the 95% interval of the difference of their logs (Welch's; with --until-ci, the sum of the two runs' sequence widths), judged at ±{margin_pct}%: same when the whole interval is within the margin, improved or regressed when it lies wholly beyond it, undecided otherwise. A serve-bench, offload or quality ratio rests on one value a run (a level's requests share their run's machine and server, so their spread is no interval for a difference between runs): with one observation on a side there is no interval and so no verdict. A cell one run did not measure shows -."
        ),
        columns,
        rows,
    };
    let mut tables = Vec::new();
    let mut notes = Vec::new();
    let diffs = differing_settings(runs);
    if diffs.rows.is_empty() {
        notes.push(format!(
            "Settings: every setting that can change a measurement is equal ({} compared; {} are each run's own).",
            compared_settings(runs),
            RUN_OWN.join(", ")
        ));
    } else {
        tables.push(diffs);
    }
    tables.push(per_cell);
    Ok(Sheet { task: format!("compare {}", runs[0].kind.name()), headline, tables, notes, roofline: None })
}

/// The settings compared: every key of any run's env.json but the runs' own.
fn compared_settings(runs: &[Run]) -> usize {
    let mut keys: Vec<String> = runs.iter().flat_map(|r| r.settings().into_keys()).collect();
    keys.sort();
    keys.dedup();
    keys.iter().filter(|k| !RUN_OWN.contains(&k.as_str())).count()
}

/// The table of settings whose values differ between runs (as JSON values: key order
/// and spelling of the file do not matter), by name and value.
fn differing_settings(runs: &[Run]) -> Table {
    let settings: Vec<BTreeMap<String, Value>> = runs.iter().map(Run::settings).collect();
    let mut keys: Vec<&String> = settings.iter().flat_map(|s| s.keys()).collect();
    keys.sort();
    keys.dedup();
    let rows = keys
        .into_iter()
        .filter(|k| !RUN_OWN.contains(&k.as_str()))
        .filter(|k| settings.iter().any(|s| s.get(*k) != settings[0].get(*k)))
        .map(|k| {
            let mut row: Vec<Cell> = vec![k.as_str().into()];
            row.extend(
                settings.iter().map(|s| Cell::text(s.get(k).map_or("(not recorded)".into(), setting_text))),
            );
            row
        })
        .collect();
    let mut columns = vec!["setting that differs".to_string()];
    columns.extend((0..runs.len()).map(letter));
    Table {
        title: "Settings that differ".into(),
        legend: "From each run's env.json, compared as values; a ratio across different settings measures the settings too.".into(),
        columns,
        rows,
    }
}

/// compare.html: the sheet's headline, tables and notes as they are, the runs, and every
/// setting for reference.
fn page(runs: &[Run], sheet: &Sheet) -> String {
    let names: Vec<String> =
        runs.iter().enumerate().map(|(i, r)| format!("{} {}", letter(i), r.name)).collect();
    let mut s = head(&format!("{}: {}", runs[0].kind.name(), names.join(" vs ")));
    let _ = writeln!(s, "<p><strong>{}</strong></p>", escape(&sheet.headline));
    let _ = writeln!(s, "<h2>Runs</h2>");
    let rows: Vec<Vec<String>> =
        runs.iter().enumerate().map(|(i, r)| vec![letter(i), r.name.clone(), r.command()]).collect();
    s.push_str(&table(&["run", "directory", "command"], &rows, &[]));
    for t in &sheet.tables {
        let _ = writeln!(s, "<h2>{}</h2>", escape(&t.title));
        let hdr: Vec<&str> = t.columns.iter().map(String::as_str).collect();
        let numeric: Vec<bool> =
            (0..hdr.len()).map(|i| t.rows.iter().any(|r| r.get(i).is_some_and(Cell::numeric))).collect();
        let body: Vec<Vec<String>> =
            t.rows.iter().map(|r| r.iter().map(|c| c.text.clone()).collect()).collect();
        s.push_str(&table(&hdr, &body, &numeric));
        if !t.legend.is_empty() {
            let _ = writeln!(s, "<p class=\"note\">{}</p>", escape(&t.legend));
        }
    }
    for n in &sheet.notes {
        let _ = writeln!(s, "<p>{}</p>", escape(n));
    }
    // Every setting, for reference: the differing ones are the table above.
    let settings: Vec<BTreeMap<String, Value>> = runs.iter().map(Run::settings).collect();
    let mut keys: Vec<&String> = settings.iter().flat_map(|s| s.keys()).collect();
    keys.sort();
    keys.dedup();
    let all: Vec<Vec<String>> = keys
        .into_iter()
        .map(|k| {
            let mut row = vec![k.clone()];
            row.extend(settings.iter().map(|s| s.get(k).map_or("(not recorded)".into(), setting_text)));
            row
        })
        .collect();
    let mut headers = vec!["setting".to_string()];
    headers.extend((0..runs.len()).map(letter));
    let hdr: Vec<&str> = headers.iter().map(String::as_str).collect();
    let _ = writeln!(s, "<h2>Every setting</h2>");
    s.push_str(&table(&hdr, &all, &[]));
    for (i, r) in runs.iter().enumerate() {
        let _ = writeln!(
            s,
            "<p><a href=\"{}\">{} report</a></p>",
            escape(&format!("file://{}/report.html", r.dir.display())),
            letter(i)
        );
    }
    s.push_str("</body></html>\n");
    s
}

/// Run `i`'s label, as spreadsheet columns go: A..Z, then AA, AB, ..., ZZ, AAA, ...
fn letter(i: usize) -> String {
    let mut label = Vec::new();
    let mut n = i + 1;
    while n > 0 {
        n -= 1;
        label.push(char::from(b'A' + (n % 26) as u8));
        n /= 26;
    }
    label.iter().rev().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_past_the_26th_get_two_letters_and_no_label_repeats() {
        for (i, want) in
            [(0, "A"), (25, "Z"), (26, "AA"), (27, "AB"), (51, "AZ"), (52, "BA"), (701, "ZZ"), (702, "AAA")]
        {
            assert_eq!(letter(i), want, "run {i}");
        }
        let labels: std::collections::BTreeSet<String> = (0..2000).map(letter).collect();
        assert_eq!(labels.len(), 2000);
    }

    /// An offload run directory whose one ok row has `fetch` us/token.
    fn offload_run(dir: &std::path::Path, fetch: f64) -> Run {
        use crate::bench_offload_copy::OffloadRow;
        let csv = dir.join("offload.csv");
        let mut w = csv::Writer::from_path(&csv).unwrap();
        let row = OffloadRow {
            model: "synthetic:tiny".into(),
            cache_slots: 4,
            batch_size: 1,
            miss_rate: 0.5,
            fetch_us_per_token: Some(fetch),
            copy_gb_s: Some(2.0),
            status: "ok".into(),
            ..OffloadRow::default()
        };
        w.serialize(&row).unwrap();
        w.flush().unwrap();
        std::fs::write(dir.join("env.json"), serde_json::json!({ "output": csv }).to_string()).unwrap();
        Run::load(dir).unwrap()
    }

    #[test]
    fn an_offload_value_that_is_not_a_number_is_refused_naming_its_cell() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let good = offload_run(a.path(), 3.0);
        for bad in [f64::NAN, f64::INFINITY, -1.0] {
            let e = compare(&[offload_run(a.path(), 3.0), offload_run(b.path(), bad)], 5.0).unwrap_err();
            let want = format!("cell synthetic:tiny@4 bs=1 miss=0.5: fetch_us_per_token is {bad}");
            assert!(e.to_string().contains(&want), "{e}");
        }
        // Two good runs: one value each, so no interval and no verdict.
        let (sheet, _) = compare(&[good, offload_run(b.path(), 6.0)], 5.0).unwrap();
        assert!(
            sheet.texts().contains(&"2.000 (n=1: no interval) undecided: n=1, no interval yet"),
            "{sheet:?}"
        );
        assert_eq!(sheet.headline, "B vs A: 0 regressed, 0 improved, 0 same within ±5%, 2 undecided");
    }
}
