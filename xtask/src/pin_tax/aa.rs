//! `--aa`: the machine's noise floor. Both slots of every ABBA pair run the same
//! environment, so every true ratio is 1: the share of cells whose interval excludes 1
//! is the false-positive rate of this design on this machine, and the intervals' widths
//! are what the machine can resolve. The run writes `aa.json`; an A/B run cites the
//! latest one of its own mode measured on the same device fingerprint.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use super::analysis::TaxRow;
use super::records::{Floor, NoiseFloor};
use crate::verdict::reading::Reading;
use crate::verdict::sheet::{Cell, Table};

/// The noise floor of an A/A run's rows (contaminated ones left out).
pub fn floor(device: &str, run: &str, mode: &str, rows: &[TaxRow]) -> NoiseFloor {
    let mut by_metric: BTreeMap<String, Vec<Reading>> = BTreeMap::new();
    for r in rows.iter().filter(|r| !r.contaminated) {
        if let Some(x) = r.ratio().filter(|x| x.interval.is_some()) {
            by_metric.entry(r.metric.clone()).or_default().push(x.clone());
        }
    }
    let metrics = by_metric
        .into_iter()
        .map(|(m, mut rs)| {
            let hw = |r: &Reading| r.half_width_pct().unwrap_or(f64::INFINITY);
            rs.sort_by(|a, b| hw(a).total_cmp(&hw(b)));
            let f = Floor {
                cells: rs.len(),
                false_positives: rs
                    .iter()
                    .filter(|r| r.interval.is_some_and(|(lo, hi)| lo > 1.0 || hi < 1.0))
                    .count(),
                mean_half_width_pct: Some(rs.iter().map(hw).sum::<f64>() / rs.len() as f64),
                pairs: rs.iter().map(|r| r.n).max().unwrap_or(0),
                typical: rs.get(rs.len() / 2).cloned(),
                widest: rs.last().cloned(),
            };
            (m, f)
        })
        .collect();
    NoiseFloor { device: device.to_string(), run: run.to_string(), mode: Some(mode.to_string()), metrics }
}

fn width(r: &Option<Reading>) -> String {
    r.as_ref().map_or_else(|| "-".into(), Reading::width)
}

/// The lines of a noise floor, for a summary that cites it.
pub fn describe(f: &NoiseFloor) -> Vec<String> {
    let mut s: Vec<String> = f
        .metrics
        .iter()
        .map(|(m, x)| {
            format!(
                "- {m}: {} of {} cells' intervals exclude 1 (false-positive rate {:.0}%, nominal 5%); typical interval {}, widest {}, with up to {} pairs",
                x.false_positives,
                x.cells,
                x.false_positive_pct().unwrap_or(0.0),
                width(&x.typical),
                width(&x.widest),
                x.pairs
            )
        })
        .collect();
    if f.metrics.is_empty() {
        s.push("- no cell has an interval: nothing to say about the noise floor".into());
    }
    s
}

/// The noise floor as a table of the A/A run's own sheet.
pub fn table(f: &NoiseFloor) -> Table {
    Table {
        title: "noise floor per metric".into(),
        legend: "every true ratio of an A/A run is 1, so an interval excluding 1 is a false positive (nominal rate 5%); the typical interval is the cell of median width, what this machine resolves with these pairs".into(),
        columns: ["metric", "cells with an interval", "intervals excluding 1", "false-positive rate", "typical interval", "widest interval", "pairs"]
            .iter()
            .map(|c| c.to_string())
            .collect(),
        rows: f
            .metrics
            .iter()
            .map(|(m, x)| {
                vec![
                    Cell::text(m.clone()),
                    Cell::text(x.cells.to_string()),
                    Cell::text(x.false_positives.to_string()),
                    Cell::text(x.false_positive_pct().map_or("-".into(), |p| format!("{p:.0}%"))),
                    Cell::text(width(&x.typical)),
                    Cell::text(width(&x.widest)),
                    Cell::text(x.pairs.to_string()),
                ]
            })
            .collect(),
    }
}

/// Writes `aa.json` into the run directory.
pub fn write(run_dir: &Path, f: &NoiseFloor) -> Result<()> {
    let p = run_dir.join("aa.json");
    let tmp = run_dir.join(".aa.json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(f)?)
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &p).with_context(|| format!("writing {}", p.display()))
}

/// The latest A/A run of `mode` under `runs_dir` measured on `device`, other than
/// `except`: run directories sort by their stamp, so the last match is the latest. An
/// aa.json written before it named its mode is placed by its run's env.json.
pub fn latest(runs_dir: &Path, device: &str, mode: &str, except: &Path) -> Option<(PathBuf, NoiseFloor)> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(runs_dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p != except && p.join("aa.json").is_file())
        .collect();
    dirs.sort();
    dirs.into_iter().rev().find_map(|d| {
        let read =
            |name: &str| crate::fsx::read_text_bounded(&d.join(name), crate::fsx::MAX_RUN_FILE_BYTES).ok();
        let f: NoiseFloor = serde_json::from_str(&read("aa.json")?).ok()?;
        let its_mode = f.mode.clone().or_else(|| {
            let env: serde_json::Value = serde_json::from_str(&read("env.json")?).ok()?;
            env["qmv_pin_tax"]["mode"].as_str().map(str::to_string)
        });
        (f.device == device && its_mode.as_deref() == Some(mode)).then_some((d, f))
    })
}

#[cfg(test)]
mod tests {
    use super::super::records::Better;
    use super::*;
    use crate::verdict::reading::Method;

    fn row(cell: &str, metric: &str, ratio: f64, ci: (f64, f64)) -> TaxRow {
        let r = Reading {
            estimate: ratio,
            interval: Some(ci),
            n: 4,
            sd_log: 0.05,
            method: Method::T,
            disturbed: 0,
        };
        TaxRow {
            cell: cell.into(),
            metric: metric.into(),
            better: Better::Higher,
            num_n: 4,
            den_n: 4,
            num: None,
            den: None,
            judged: Some(r.judge(Better::Higher, 5.0)),
            spread_num: None,
            spread_den: None,
            contaminated: false,
            caveats: Vec::new(),
            verdict: String::new(),
            pairs: Vec::new(),
        }
    }

    #[test]
    fn the_floor_counts_intervals_that_exclude_one_and_is_found_by_device_and_mode() {
        let rows = [
            row("decode B=1", "output tok/s", 1.0, (0.95, 1.05)),
            row("decode B=2", "output tok/s", 1.08, (1.02, 1.14)),
            row("decode B=1", "TPOT ms", 1.0, (0.98, 1.02)),
        ];
        let f = floor("cpu-epyc-2cpu", "20261201T100000Z", "sweep", &rows);
        let tok = &f.metrics["output tok/s"];
        assert_eq!((tok.cells, tok.false_positives, tok.pairs), (2, 1, 4));
        // Half-widths 5% and 5.56%: 1.14 / 1.08 - 1.
        assert!((tok.mean_half_width_pct.unwrap() - (5.0 + 100.0 * (1.14 / 1.08 - 1.0)) / 2.0).abs() < 1e-9);
        assert!(describe(&f)[1].starts_with(
            "- output tok/s: 1 of 2 cells' intervals exclude 1 (false-positive rate 50%, nominal 5%); typical interval ±5.6%, widest ±5.6%"
        ), "{:?}", describe(&f));
        assert_eq!(f.false_positive_pct(), Some(100.0 / 3.0));
        let tmp = tempfile::tempdir().unwrap();
        let (a, b, c, m) = (
            tmp.path().join("20261201T1-x"),
            tmp.path().join("20261201T2-x"),
            tmp.path().join("20261201T3-x"),
            tmp.path().join("20261201T4-x"),
        );
        for d in [&a, &b, &c, &m] {
            std::fs::create_dir(d).unwrap();
        }
        write(&a, &f).unwrap();
        write(&b, &NoiseFloor { device: "other".into(), ..f.clone() }).unwrap();
        let (dir, got) = latest(tmp.path(), "cpu-epyc-2cpu", "sweep", &c).unwrap();
        assert_eq!((dir, got), (a.clone(), f.clone()));
        assert!(latest(tmp.path(), "cpu-epyc-2cpu", "sweep", &a).is_none(), "the run itself is not cited");
        // A mixed run never cites the sweep's floor, and finds its own, even one written
        // before aa.json named its mode (its env.json says).
        assert!(latest(tmp.path(), "cpu-epyc-2cpu", "mixed", &c).is_none());
        write(&m, &NoiseFloor { mode: None, ..f.clone() }).unwrap();
        std::fs::write(m.join("env.json"), r#"{"qmv_pin_tax": {"mode": "mixed"}}"#).unwrap();
        assert_eq!(latest(tmp.path(), "cpu-epyc-2cpu", "mixed", &c).unwrap().0, m);
        assert_eq!(latest(tmp.path(), "cpu-epyc-2cpu", "sweep", &c).unwrap().0, a);
    }

    #[test]
    fn a_floor_prints_wide_intervals_as_a_factor() {
        let rows = [row("decode B=1", "TPOT ms", 1.3, (0.0054, 312.0))];
        let f = floor("d", "r", "sweep", &rows);
        let t = table(&f);
        assert!(t.rows[0][5].text.starts_with("within a factor of 24"), "{:?}", t.rows[0]);
        assert!(describe(&f)[0].contains("widest within a factor of 240"), "{:?}", describe(&f));
    }
}
