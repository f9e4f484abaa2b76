//! The pin-tax plots: the sweep's cost ratios against B with their intervals, and
//! the mixed mode's per-boot rates, one panel per stream kind, boots as unjoined points.

use std::collections::BTreeMap;

use super::analysis::{Design, Kind, TaxRow};
use super::arms::Arm;
use super::records::{Better, PassRecord};
use crate::plot::{Axis, Panel, Point, RefLine, Series};

/// The plot: each decode metric's cost ratio against B, so that above 1 is always a
/// cost of the pinned arm (of A2, in an A/A run): a time as narrow/wide, a rate as
/// wide/narrow. The y axis is logarithmic, so 1.25 and 0.8 sit equally far from 1 and a
/// wide interval does not flatten the rest; the error bars are the 95% intervals, the
/// lines at 1 and at the ±`margin_pct` band the verdict's margin.
pub fn sweep(rows: &[TaxRow], design: Design, margin_pct: f64) -> Vec<Panel> {
    let decode: Vec<(&TaxRow, f64)> = rows
        .iter()
        .filter(|r| !r.contaminated)
        .filter_map(|r| Some((r, r.cell.strip_prefix("decode B=")?.parse::<f64>().ok()?)))
        .collect();
    let mut metrics: Vec<(&str, Better)> =
        decode.iter().map(|(r, _)| (r.metric.as_str(), r.better)).collect();
    metrics.sort_by_key(|m| m.0);
    metrics.dedup_by_key(|m| m.0);
    let series = metrics
        .iter()
        .map(|&(m, better)| {
            let (a, b) = design.cost_arms(better);
            Series {
                join: true,
                ..Series::points(
                    format!("{m}: {}/{}", a.as_str(), b.as_str()),
                    decode
                        .iter()
                        .filter(|(r, _)| r.metric == m)
                        .filter_map(|(r, x)| {
                            let c = design.cost_ratio(r.better, r.ratio()?);
                            Some(Point { x: *x, y: c.estimate, interval: c.interval })
                        })
                        .collect(),
                )
            }
        })
        .collect();
    let top = 1.0 + margin_pct / 100.0;
    let worse = design.num.as_str();
    let title = match design.kind {
        Kind::Aa => format!("A/A noise floor: {} in batched decode (identical arms)", design.ratio_name()),
        _ => format!("qmv_wide pin: the pinned arm's cost in batched decode ({})", design.ratio_name()),
    };
    vec![Panel {
        series,
        refs: vec![
            RefLine { y: top, name: format!("+{margin_pct}% margin") },
            RefLine { y: 1.0, name: "no difference (1)".into() },
            RefLine { y: 1.0 / top, name: format!("-{margin_pct}% margin") },
        ],
        ..Panel::new(
            title,
            Axis::log("concurrent streams B"),
            Axis::log(format!("cost ratio (above 1: {worse} worse)")),
        )
    }]
}

/// The mixed plot: one panel per stream kind (classic, speculative), each boot's mean
/// over its counted windows as a point of its arm, the windows themselves beside it, never
/// joined: boot 1 and boot 4 of arm A are not a trend.
pub fn mixed(passes: &[PassRecord], metrics: [&str; 2]) -> Vec<Panel> {
    metrics
        .iter()
        .map(|metric| {
            // The arms the passes ran: A and B, or an A/A run's A1 and A2.
            let arms: std::collections::BTreeSet<Arm> = passes.iter().map(|p| p.arm).collect();
            let series = arms
                .iter()
                .map(|&arm| {
                    let mut by_boot: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
                    for p in
                        passes.iter().filter(|p| p.arm == arm && p.ok && p.invalid.is_none() && p.pass > 0)
                    {
                        if let Some(v) = p.cells.first().and_then(|c| c.metrics.get(*metric)) {
                            by_boot.entry(p.boot).or_default().push(*v);
                        }
                    }
                    let points = by_boot
                        .iter()
                        .map(|(b, v)| Point::from((*b as f64, v.iter().sum::<f64>() / v.len() as f64)))
                        .collect();
                    let samples = by_boot
                        .iter()
                        .filter(|(_, v)| v.len() > 1)
                        .flat_map(|(b, v)| v.iter().map(move |x| (*b as f64, *x)))
                        .collect();
                    Series { samples, ..Series::points(format!("arm {}", arm.as_str()), points) }
                })
                .collect();
            Panel {
                series,
                ..Panel::new(
                    format!("mixed: {metric}"),
                    Axis::integer("boot"),
                    Axis::from_zero(format!("{metric} (mean of counted windows)")),
                )
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::records::CellMeasure;
    use super::*;
    use crate::verdict::reading::{Method, Reading};

    #[test]
    fn the_recorded_sweep_plots_ratios_with_error_bars_at_the_levels() {
        // docs/benchmark_results/qmv-pin-tax-cpu-epyc-2cpu-2026-11-30.md: B, metric, ratio, interval.
        let recorded = [
            (1, "output tok/s", 1.0439, 0.9606, 1.1343),
            (1, "TPOT ms", 0.9702, 0.8879, 1.0601),
            (2, "output tok/s", 1.2685, 1.1649, 1.3813),
            (2, "TPOT ms", 0.7767, 0.7010, 0.8607),
            (4, "output tok/s", 1.0286, 0.9560, 1.1066),
            (4, "TPOT ms", 0.9556, 0.8866, 1.0300),
            (8, "output tok/s", 0.7210, 0.6468, 0.8038),
            (8, "TPOT ms", 1.4792, 1.2763, 1.7143),
        ];
        let rows: Vec<TaxRow> = recorded
            .iter()
            .map(|&(b, metric, ratio, lo, hi)| {
                let better = if metric == "TPOT ms" { Better::Lower } else { Better::Higher };
                let r = Reading {
                    estimate: ratio,
                    interval: Some((lo, hi)),
                    n: 4,
                    sd_log: 0.05,
                    method: Method::T,
                    disturbed: 0,
                };
                TaxRow {
                    cell: format!("decode B={b}"),
                    metric: metric.into(),
                    better,
                    num_n: 8,
                    den_n: 8,
                    num: None,
                    den: None,
                    judged: Some(r.judge(better, 5.0)),
                    spread_num: None,
                    spread_den: None,
                    contaminated: false,
                    caveats: Vec::new(),
                    verdict: String::new(),
                    pairs: Vec::new(),
                }
            })
            .collect();
        let panels = sweep(&rows, Design::SWEEP, 5.0);
        let l = crate::plot::raster::check("pin-tax-sweep", &panels);
        let p = &l.panels[0];
        // Not "1 1 1 2 3 4 6 8 11": the levels that ran.
        assert_eq!(p.x_ticks.iter().map(|t| t.label.as_str()).collect::<Vec<_>>(), ["1", "2", "4", "8"]);
        // Two series, the margin band and 1: the interval bounds are error bars, not series.
        assert_eq!(
            p.legend_entries,
            [
                "TPOT ms: narrow/wide",
                "output tok/s: wide/narrow",
                "+5% margin",
                "no difference (1)",
                "-5% margin"
            ]
        );
        assert!(p.series.iter().all(|s| s.intervals.len() == 4));
        assert!(!p.legend.unwrap().overlaps(&p.plot));
        // Every ratio is a cost: tok/s 0.7210 at B=8 is plotted as wide/narrow 1.387,
        // TPOT 1.4792 as it is; a log axis.
        let q = &panels[0];
        assert_eq!(q.y.scale, crate::plot::Scale::Log);
        assert_eq!(q.y.label, "cost ratio (above 1: narrow worse)");
        let tok = q.series.iter().find(|s| s.name.starts_with("output")).unwrap();
        assert!((tok.points[3].y - 1.0 / 0.7210).abs() < 1e-9, "{:?}", tok.points[3]);
        assert!((tok.points[3].interval.unwrap().1 - 1.0 / 0.6468).abs() < 1e-9);
        let tpot = q.series.iter().find(|s| s.name.starts_with("TPOT")).unwrap();
        assert!((tpot.points[3].y - 1.4792).abs() < 1e-9);
        // An A/A run's plot says so, never a pin.
        let aa = &sweep(&rows, Design::SWEEP.aa(), 5.0)[0];
        assert!(aa.title.starts_with("A/A noise floor") && !aa.title.contains("pin"), "{}", aa.title);
        assert!(aa.series.iter().all(|s| s.name.contains("A2/A1") || s.name.contains("A1/A2")));
    }

    #[test]
    fn the_recorded_mixed_run_plots_boots_as_points_per_stream_kind() {
        // docs/benchmark_results/qmv-pin-tax-mixed-cpu-epyc-2cpu-2026-11-30.md: boot, arm,
        // window, counted, classic, speculative.
        let recorded = [
            (1, Arm::A, 1, true, 1.78, 5.16),
            (1, Arm::A, 2, true, 1.97, 3.36),
            (2, Arm::B, 1, true, 1.74, 5.24),
            (2, Arm::B, 2, false, 1.67, 3.41),
            (3, Arm::B, 1, true, 1.96, 5.99),
            (3, Arm::B, 2, true, 2.10, 3.64),
            (4, Arm::A, 1, true, 2.12, 5.79),
            (4, Arm::A, 2, false, 1.50, 3.21),
        ];
        let passes: Vec<PassRecord> = recorded
            .iter()
            .map(|&(boot, arm, pass, counted, classic, spec)| PassRecord {
                boot,
                arm,
                pass,
                ok: true,
                reason: None,
                invalid: (!counted).then(|| "short overlap".to_string()),
                disturbed: None,
                quiet: None,
                elapsed_s: 1.0,
                cells: vec![CellMeasure {
                    cell: "window".into(),
                    requests: 5,
                    failed: 0,
                    first_error: None,
                    metrics: [("classic".to_string(), classic), ("speculative".to_string(), spec)].into(),
                    hashes: BTreeMap::new(),
                    prompt_tokens: None,
                    cached_tokens: None,
                    invalid: None,
                    detail: None,
                }],
            })
            .collect();
        let l = crate::plot::raster::check("pin-tax-mixed", &mixed(&passes, ["classic", "speculative"]));
        assert_eq!(l.panels.len(), 2);
        for p in &l.panels {
            assert_eq!(p.x_ticks.iter().map(|t| t.label.as_str()).collect::<Vec<_>>(), ["1", "2", "3", "4"]);
            assert!(p.series.iter().all(|s| s.line.is_none()), "boots are never joined");
            assert_eq!(p.series[0].points.len(), 2, "arm A: boots 1 and 4");
            // Boots 1 and 3 counted both windows: those are drawn beside their means.
            assert_eq!(p.series.iter().map(|s| s.samples.len()).sum::<usize>(), 4);
        }
    }
}
