//! `--aa`: the machine's noise floor. Both slots of every ABBA pair run the same
//! environment, so every true ratio is 1: the share of cells whose interval excludes 1
//! is the false-positive rate of this design on this machine, and the intervals' widths
//! are what the machine can resolve. The run writes `aa.json`; an A/B run cites the
//! latest one measured on the same device fingerprint.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::analysis::TaxRow;

/// One metric's noise floor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Floor {
    /// Cells with an interval.
    pub cells: usize,
    /// Of those, cells whose interval excludes 1.
    pub false_positives: usize,
    /// The mean half-width of their intervals, percent.
    pub mean_half_width_pct: Option<f64>,
    /// The pairs behind each interval (the most of any cell).
    pub pairs: usize,
}

/// What `aa.json` holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NoiseFloor {
    /// The device fingerprint (`env.json`'s `device`).
    pub device: String,
    /// When the run started (its run directory's stamp).
    pub run: String,
    /// Per metric.
    pub metrics: BTreeMap<String, Floor>,
}

/// The noise floor of an A/A run's rows (contaminated ones left out).
pub fn floor(device: &str, run: &str, rows: &[TaxRow]) -> NoiseFloor {
    let mut metrics: BTreeMap<String, Floor> = BTreeMap::new();
    for r in rows.iter().filter(|r| !r.contaminated) {
        let Some((ratio, ci)) = r.ratio.and_then(|x| Some((x.ratio, x.ci95?))) else { continue };
        let f = metrics.entry(r.metric.clone()).or_insert(Floor {
            cells: 0,
            false_positives: 0,
            mean_half_width_pct: None,
            pairs: 0,
        });
        let hw = crate::verdict::sequence::half_width_pct(ratio, ci);
        f.mean_half_width_pct =
            Some((f.mean_half_width_pct.unwrap_or(0.0) * f.cells as f64 + hw) / (f.cells + 1) as f64);
        f.cells += 1;
        f.false_positives += usize::from(ci.0 > 1.0 || ci.1 < 1.0);
        f.pairs = f.pairs.max(r.ratio.map_or(0, |x| x.pairs));
    }
    NoiseFloor { device: device.to_string(), run: run.to_string(), metrics }
}

/// The lines of a noise floor, for the summary.
pub fn describe(f: &NoiseFloor) -> String {
    let mut s = String::new();
    for (m, x) in &f.metrics {
        let rate = 100.0 * x.false_positives as f64 / x.cells.max(1) as f64;
        let _ = writeln!(
            s,
            "- {m}: {} of {} cells' intervals exclude 1 (false-positive rate {rate:.0}%, nominal 5%); mean half-width {} with up to {} pairs",
            x.false_positives,
            x.cells,
            x.mean_half_width_pct.map_or("-".into(), |h| format!("{h:.1}%")),
            x.pairs
        );
    }
    if f.metrics.is_empty() {
        let _ = writeln!(s, "- no cell has an interval: nothing to say about the noise floor");
    }
    s
}

/// Writes `aa.json` into the run directory.
pub fn write(run_dir: &Path, f: &NoiseFloor) -> Result<()> {
    let p = run_dir.join("aa.json");
    let tmp = run_dir.join(".aa.json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(f)?)
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &p).with_context(|| format!("writing {}", p.display()))
}

/// The latest A/A run under `runs_dir` measured on `device`, other than `except`: run
/// directories sort by their stamp, so the last match is the latest.
pub fn latest(runs_dir: &Path, device: &str, except: &Path) -> Option<(PathBuf, NoiseFloor)> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(runs_dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p != except && p.join("aa.json").is_file())
        .collect();
    dirs.sort();
    dirs.into_iter().rev().find_map(|d| {
        let text = crate::fsx::read_text_bounded(&d.join("aa.json"), crate::fsx::MAX_RUN_FILE_BYTES).ok()?;
        let f: NoiseFloor = serde_json::from_str(&text).ok()?;
        (f.device == device).then_some((d, f))
    })
}

#[cfg(test)]
mod tests {
    use super::super::abba::Better;
    use super::super::stats::Ratio;
    use super::*;

    fn row(cell: &str, metric: &str, ratio: f64, ci: (f64, f64)) -> TaxRow {
        TaxRow {
            cell: cell.into(),
            metric: metric.into(),
            better: Better::Higher,
            num_n: 4,
            den_n: 4,
            num_mean: None,
            den_mean: None,
            ratio: Some(Ratio { pairs: 4, ratio, ci95: Some(ci) }),
            spread_num: None,
            spread_den: None,
            contaminated: false,
            verdict: String::new(),
            equivalence: None,
            pairs: Vec::new(),
        }
    }

    #[test]
    fn the_floor_counts_intervals_that_exclude_one_and_is_found_by_device() {
        let rows = [
            row("decode B=1", "output tok/s", 1.0, (0.95, 1.05)),
            row("decode B=2", "output tok/s", 1.08, (1.02, 1.14)),
            row("decode B=1", "TPOT ms", 1.0, (0.98, 1.02)),
        ];
        let f = floor("cpu-epyc-2cpu", "20261201T100000Z", &rows);
        let tok = &f.metrics["output tok/s"];
        assert_eq!((tok.cells, tok.false_positives, tok.pairs), (2, 1, 4));
        // Half-widths 5% and 5.56%: 1.14 / 1.08 - 1.
        assert!((tok.mean_half_width_pct.unwrap() - (5.0 + 100.0 * (1.14 / 1.08 - 1.0)) / 2.0).abs() < 1e-9);
        assert!(
            describe(&f)
                .contains("- output tok/s: 1 of 2 cells' intervals exclude 1 (false-positive rate 50%")
        );
        let tmp = tempfile::tempdir().unwrap();
        let (a, b, c) = (
            tmp.path().join("20261201T1-x"),
            tmp.path().join("20261201T2-x"),
            tmp.path().join("20261201T3-x"),
        );
        for d in [&a, &b, &c] {
            std::fs::create_dir(d).unwrap();
        }
        write(&a, &f).unwrap();
        write(&b, &NoiseFloor { device: "other".into(), ..f.clone() }).unwrap();
        let (dir, got) = latest(tmp.path(), "cpu-epyc-2cpu", &c).unwrap();
        assert_eq!((dir, got), (a.clone(), f));
        assert!(latest(tmp.path(), "cpu-epyc-2cpu", &a).is_none(), "the run itself is not cited");
    }
}
