//! The roofline plot: operational intensity (operations per byte read) on x, operations
//! per second on y, both log scales; the read-bandwidth roof (a diagonal, `y = I * B`) up
//! to the ridge point and the compute roof (flat, `y = C`) from it, and one point per
//! kernel or cell, one panel per thread count. Drawn from a run's [`Roofline`] as it was
//! recorded (`readings.json`); nothing is placed or measured again here.

use std::collections::{BTreeMap, BTreeSet};

use crate::plot::{Axis, Panel, Point, Series};
use crate::verdict::roofline::Roofline;

/// Operations per second are drawn in GOPS, so the axis labels stay short.
const GOPS: f64 = 1e9;

/// One panel per thread count that has a point or a roof.
pub fn panels(r: &Roofline) -> Vec<Panel> {
    let threads: BTreeSet<usize> =
        r.points.iter().map(|p| p.threads).chain(r.compute.iter().map(|c| c.threads)).collect();
    // Every panel lists every series (empty where a thread count lacks it), so a kernel
    // keeps its colour and marker from panel to panel.
    let names: BTreeSet<&str> = r.points.iter().map(|p| p.series.as_str()).collect();
    threads
        .into_iter()
        .map(|t| {
            let pts: Vec<_> = r.points.iter().filter(|p| p.threads == t && p.intensity > 0.0).collect();
            let bw = r.bandwidth.iter().find(|b| b.threads == t);
            let compute = r.compute.iter().find(|c| c.threads == t);
            let ridge = match (bw, compute) {
                (Some(b), Some(c)) => Some(c.value / b.value),
                _ => None,
            };
            let xs: Vec<f64> = pts.iter().map(|p| p.intensity).chain(ridge).collect();
            let lo = xs.iter().copied().fold(f64::INFINITY, f64::min) / 2.0;
            let hi = xs.iter().copied().fold(0.0, f64::max) * 2.0;
            let mut series = Vec::new();
            if let Some(b) = bw {
                let end = ridge.unwrap_or(hi);
                series.push(Series::line(
                    format!("roof: {} ({})", b.name, b.text),
                    vec![(lo, lo * b.value / GOPS), (end, end * b.value / GOPS)],
                ));
            }
            if let Some(c) = compute {
                let start = ridge.unwrap_or(lo);
                series.push(Series::line(
                    format!("roof: {} ({})", c.name, c.text),
                    vec![(start, c.value / GOPS), (hi, c.value / GOPS)],
                ));
            }
            let mut by_series: BTreeMap<&str, Vec<Point>> = names.iter().map(|n| (*n, Vec::new())).collect();
            for p in pts {
                by_series
                    .entry(p.series.as_str())
                    .or_default()
                    .push((p.intensity, p.ops_per_s / GOPS).into());
            }
            series.extend(by_series.into_iter().map(|(n, pts)| Series::points(n, pts)));
            Panel {
                series,
                ..Panel::new(
                    format!("roofline, {t} thread(s)"),
                    Axis::log_decades("operational intensity (operations per byte read)"),
                    Axis::log("operations per second (GOPS)"),
                )
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verdict::roofline::Roof;

    /// Roofs of this host's kind (Zen 4, two threads: about 40 GB/s and 1.4 TOPS of
    /// `vpdpbusd`) with kernels on both sides of the ridge and a prefill and a decode cell.
    pub(crate) fn recorded() -> Roofline {
        let mut r = Roofline {
            bandwidth: vec![Roof::bandwidth(1, 30e9), Roof::bandwidth(2, 40e9)],
            compute: vec![
                Roof::compute("int8_avx512_vnni", 1, 0.7e12),
                Roof::compute("int8_avx512_vnni", 2, 1.4e12),
            ],
            ..Roofline::default()
        };
        // (name, series, threads, ops per byte, GB/s read)
        for (name, series, t, i, gbs) in [
            ("qmv/q4_g64_n4096_k4096_m1/t2", "qmv", 2, 3.56, 31.0),
            ("qmv_wide/q4_g64_n4096_k4096_m8/t2", "qmv_wide", 2, 28.4, 9.0),
            ("qmm/q4_g64_n4096_k4096_m16/t2", "qmm", 2, 56.9, 3.0),
            ("qmv/q4_g64_n4096_k4096_m1/t1", "qmv", 1, 3.56, 24.0),
            ("prefill", "prefill (cells)", 2, 300.0, 0.5),
            ("decode", "decode (cells)", 2, 2.0, 33.0),
        ] {
            r.place(name, series, t, i * 1e9, 1e9, 1.0 / gbs);
        }
        r
    }

    #[test]
    fn the_roofline_draws_both_roofs_and_every_point_log_log() {
        let r = recorded();
        let l = crate::plot::raster::check("roofline", &panels(&r));
        assert_eq!(
            l.panels.iter().map(|p| p.title.as_str()).collect::<Vec<_>>(),
            ["roofline, 1 thread(s)", "roofline, 2 thread(s)"]
        );
        let p = &l.panels[1];
        assert!(
            p.legend_entries.contains(&"roof: read bandwidth (40.0 GB/s)".to_string()),
            "{:?}",
            p.legend_entries
        );
        assert!(p.legend_entries.contains(&"roof: int8_avx512_vnni (1.40 TOPS)".to_string()));
        for s in ["qmv", "qmv_wide", "qmm", "prefill (cells)", "decode (cells)"] {
            assert!(p.legend_entries.contains(&s.to_string()), "{s} in {:?}", p.legend_entries);
        }
        // Both axes are labelled at powers of ten.
        let x: Vec<&str> = p.x_ticks.iter().map(|t| t.label.as_str()).collect();
        assert_eq!(x, ["1", "10", "100"], "{x:?}");
        let y: Vec<&str> = p.y_ticks.iter().map(|t| t.label.as_str()).collect();
        assert!(y.contains(&"100") && y.contains(&"1000"), "{y:?}");
        // The compute roof is flat at 1400 GOPS and meets the bandwidth roof at the ridge
        // (35 operations per byte): the bandwidth line's last point is the compute line's first.
        let line =
            |name: &str| p.series.iter().find(|s| s.name.starts_with(name)).unwrap().line.clone().unwrap();
        let (bw, c) = (line("roof: read bandwidth"), line("roof: int8"));
        assert!((bw.last().unwrap().0 - c[0].0).abs() < 0.5 && (bw.last().unwrap().1 - c[0].1).abs() < 0.5);
        assert!((c[0].1 - c[1].1).abs() < 0.5, "flat: {c:?}");
        // A bandwidth-bound kernel sits under the diagonal, to the left of the ridge; the
        // prefill cell right of it and under the flat roof.
        let at = |name: &str| p.series.iter().find(|s| s.name == name).unwrap().points[0];
        let (qmv, prefill) = (at("qmv"), at("prefill (cells)"));
        assert!(qmv.0 < c[0].0 && prefill.0 > c[0].0, "{qmv:?} {prefill:?} ridge {:?}", c[0]);
        assert!(prefill.1 > c[0].1, "under the flat roof (y grows downwards): {prefill:?}");
        // The one-thread panel keeps the qmv series' look and has the others empty.
        let colour = |i: usize| l.panels[i].series.iter().find(|s| s.name == "qmv").unwrap().colour.clone();
        assert_eq!(colour(0), colour(1));
    }

    #[test]
    fn report_html_draws_the_roofline_the_run_recorded() {
        use crate::verdict::sheet::Sheet;
        let dir = tempfile::tempdir().unwrap();
        let sheet = Sheet {
            task: "bench-kernels".into(),
            headline: "roofs".into(),
            roofline: Some(recorded()),
            ..Sheet::default()
        };
        sheet.write(dir.path()).unwrap();
        let run = crate::report::Run::load(dir.path()).unwrap();
        assert_eq!(run.kind.name(), "bench-kernels roofline");
        let page = crate::report::page(&run);
        for needle in [
            "<h2>Plots</h2>",
            "roofline, 2 thread(s)",
            "roof: int8_avx512_vnni (1.40 TOPS)",
            "prefill (cells)",
        ] {
            assert!(page.contains(needle), "report.html lacks {needle:?}");
        }
        // A sheet without a roofline draws none.
        Sheet { roofline: None, ..sheet }.write(dir.path()).unwrap();
        let page = crate::report::page(&crate::report::Run::load(dir.path()).unwrap());
        assert!(!page.contains("roofline, ") && !page.contains("<h2>Plots</h2>"), "no plot without roofs");
    }
}
