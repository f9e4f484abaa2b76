//! Runs side by side: the fingerprints (differences marked), then per cell each run's
//! value and each later run's ratio to the first. Runs of different tasks are refused.

use std::fmt::Write as _;

use anyhow::{Result, bail};

use super::head;
use super::html::{escape, table};
use super::runs::{Kind, Run, mean, sweep_cells};

/// One compared quantity of one cell, per run.
struct Line {
    cell: String,
    metric: &'static str,
    values: Vec<Option<f64>>,
}

fn lines(runs: &[Run]) -> Result<Vec<Line>> {
    let mut out: Vec<Line> = Vec::new();
    let mut put = |cell: String, metric: &'static str, run: usize, v: Option<f64>| {
        let i = match out.iter().position(|l| l.cell == cell && l.metric == metric) {
            Some(i) => i,
            None => {
                out.push(Line { cell, metric, values: vec![None; runs.len()] });
                out.len() - 1
            }
        };
        out[i].values[run] = v;
    };
    for (ri, run) in runs.iter().enumerate() {
        match &run.kind {
            Kind::Sweep { rows, .. } => {
                for ((model, engine, len), c) in sweep_cells(rows) {
                    let cell = format!("{model} ({engine}) @ {len}");
                    put(cell.clone(), "decode tok/s", ri, mean(&c.decode));
                    put(cell, "prefill tok/s", ri, mean(&c.prefill));
                }
            }
            Kind::Serve { levels, .. } => {
                for l in levels {
                    put(l.level.clone(), "output tok/s", ri, Some(l.output_tok_s));
                    put(l.level.clone(), "TTFT p50 ms", ri, l.ttft.median);
                    put(l.level.clone(), "TPOT p50 ms", ri, l.tpot.median);
                    put(l.level.clone(), "E2E p50 ms", ri, l.e2e.median);
                }
            }
            Kind::Offload { raw, .. } => {
                for m in raw {
                    let g = |k: &str| m.get(k).cloned().unwrap_or_default();
                    let cell = format!(
                        "{}@{} bs={} miss={}",
                        g("model"),
                        g("cache_slots"),
                        g("batch_size"),
                        g("miss_rate")
                    );
                    put(cell.clone(), "fetch us/token", ri, g("fetch_us_per_token").parse().ok());
                    put(cell, "copy GB/s", ri, g("copy_gb_s").parse().ok());
                }
            }
            Kind::Quality { raw, .. } => {
                for m in raw {
                    let g = |k: &str| m.get(k).cloned().unwrap_or_default();
                    let cell = format!("{} {}", g("model"), g("scheme"));
                    put(cell.clone(), "mean KLD", ri, g("kld_mean").parse().ok());
                    put(cell.clone(), "PPL", ri, g("ppl").parse().ok());
                    put(cell, "tok/s", ri, g("tok_s").parse().ok());
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

/// The comparison page of `runs` (the first is the base).
pub fn page(runs: &[Run]) -> Result<String> {
    let first = runs[0].kind.name();
    if let Some(other) = runs.iter().find(|r| r.kind.name() != first) {
        bail!(
            "{} is a {first} run and {} a {} run: only runs of one task compare",
            runs[0].name,
            other.name,
            other.kind.name()
        );
    }
    let names: Vec<String> =
        runs.iter().enumerate().map(|(i, r)| format!("{} {}", letter(i), r.name)).collect();
    let mut s = head(&format!("{first}: {}", names.join(" vs ")));
    let _ = writeln!(s, "<h2>Runs</h2>");
    let mut rows = vec![];
    for (i, r) in runs.iter().enumerate() {
        rows.push(vec![letter(i), r.name.clone(), r.command()]);
    }
    s.push_str(&table(&["run", "directory", "command"], &rows, &[]));
    // Fingerprints side by side, the keys that differ first.
    let fps: Vec<Vec<(String, String)>> = runs.iter().map(|r| r.fingerprint()).collect();
    let mut keys: Vec<String> = Vec::new();
    for fp in &fps {
        for (k, _) in fp {
            if !keys.contains(k) {
                keys.push(k.clone());
            }
        }
    }
    let value = |fp: &[(String, String)], k: &str| {
        fp.iter().find(|(x, _)| x == k).map_or("-".to_string(), |(_, v)| v.clone())
    };
    let mut fp_rows: Vec<(bool, Vec<String>)> = keys
        .iter()
        .map(|k| {
            let vals: Vec<String> = fps.iter().map(|fp| value(fp, k)).collect();
            let differs = vals.iter().any(|v| *v != vals[0]);
            let mut row = vec![format!("{k}{}", if differs { " (differs)" } else { "" })];
            row.extend(vals);
            (differs, row)
        })
        .collect();
    fp_rows.sort_by_key(|(d, _)| !*d);
    let mut headers = vec!["key".to_string()];
    headers.extend((0..runs.len()).map(letter));
    let hdr: Vec<&str> = headers.iter().map(String::as_str).collect();
    let _ = writeln!(s, "<h2>Fingerprints</h2>");
    s.push_str(&table(&hdr, &fp_rows.into_iter().map(|(_, r)| r).collect::<Vec<_>>(), &[]));
    // Per cell.
    let mut headers = vec!["cell".to_string(), "metric".to_string()];
    headers.extend((0..runs.len()).map(letter));
    headers.extend((1..runs.len()).map(|i| format!("{}/A", letter(i))));
    let hdr: Vec<&str> = headers.iter().map(String::as_str).collect();
    let body: Vec<Vec<String>> = lines(runs)?
        .into_iter()
        .map(|l| {
            let mut row = vec![l.cell, l.metric.to_string()];
            row.extend(l.values.iter().map(|v| v.map_or("-".into(), fmt)));
            row.extend(l.values[1..].iter().map(|v| match (l.values[0], v) {
                (Some(a), Some(b)) if a != 0.0 => format!("{:.3}", b / a),
                _ => "-".into(),
            }));
            row
        })
        .collect();
    let numeric: Vec<bool> = (0..hdr.len()).map(|i| i >= 2).collect();
    let _ = writeln!(
        s,
        "<h2>Per cell</h2>\n<p class=\"note\">each later run's value over A's; a cell one run did not measure shows -</p>"
    );
    s.push_str(&table(&hdr, &body, &numeric));
    for (i, r) in runs.iter().enumerate() {
        let _ = writeln!(
            s,
            "<p><a href=\"{}\">{} report</a></p>",
            escape(&format!("file://{}/report.html", r.dir.display())),
            letter(i)
        );
    }
    s.push_str("</body></html>\n");
    Ok(s)
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

fn fmt(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.1}")
    } else if v.abs() >= 0.01 || v == 0.0 {
        format!("{v:.3}")
    } else {
        format!("{v:.3e}")
    }
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
}
