//! The kernel report's picture: each kernel's share of the read bandwidth measured in the
//! same run (GB/s when none was), against M, one panel per thread count.

use std::collections::BTreeMap;

use super::files::{Measured, Row};
use super::render::{INT8_SUFFIX, bandwidth_threads, parse_kernel_id};
use crate::plot::{Axis, Panel, RefLine, Series};

/// (threads, kernel, bits, n, k): one line of the plot.
type LineKey = (usize, String, u32, usize, usize);

/// One panel per thread count; a series per kernel, width and shape over the Ms that ran.
pub(super) fn panels(rows: &[Row]) -> Vec<Panel> {
    let mut bandwidth: BTreeMap<usize, f64> = BTreeMap::new();
    for r in rows {
        if let (Some(t), Some(g)) = (bandwidth_threads(&r.id), r.current.as_ref().and_then(Measured::gb_s)) {
            let e = bandwidth.entry(t).or_insert(g);
            *e = e.max(g);
        }
    }
    // (threads, kernel, bits, n, k) -> points; `qmv` at M = 1 is where every batched
    // kernel of the same shape starts, so it opens their lines.
    let mut lines: BTreeMap<LineKey, Vec<(f64, f64)>> = BTreeMap::new();
    for r in rows {
        let (Some(id), Some(g)) = (parse_kernel_id(&r.id), r.current.as_ref().and_then(Measured::gb_s))
        else {
            continue;
        };
        let y = match bandwidth.get(&id.threads) {
            Some(bw) => 100.0 * g / bw,
            None => g,
        };
        lines.entry((id.threads, id.kernel.clone(), id.bits, id.n, id.k)).or_default().push((id.m as f64, y));
    }
    let base = |kernel: &str| if kernel.ends_with(INT8_SUFFIX) { "qmv_int8" } else { "qmv" };
    let mut by_threads: BTreeMap<usize, BTreeMap<String, Vec<(f64, f64)>>> = BTreeMap::new();
    for ((t, kernel, bits, n, k), pts) in &lines {
        let is_base = kernel == base(kernel);
        let has_batched = lines.keys().any(|(t2, k2, b2, n2, kk)| {
            (t2, b2, n2, kk) == (t, bits, n, k) && k2 != kernel && base(k2) == kernel
        });
        if is_base && has_batched {
            continue;
        }
        let mut pts = pts.clone();
        if !is_base && let Some(start) = lines.get(&(*t, base(kernel).to_string(), *bits, *n, *k)) {
            pts.extend(start.iter().filter(|p| p.0 == 1.0));
        }
        let name = if is_base {
            format!("{kernel} q{bits} n{n}_k{k}")
        } else {
            format!("{} q{bits} n{n}_k{k} (from {} at M = 1)", kernel, base(kernel))
        };
        by_threads.entry(*t).or_default().insert(name, pts);
    }
    // Every panel lists every line (empty where that thread count lacks it), so a kernel
    // keeps its colour and marker from panel to panel.
    let names: std::collections::BTreeSet<String> =
        by_threads.values().flat_map(|m| m.keys().cloned()).collect();
    by_threads
        .into_iter()
        .map(|(t, series)| {
            let measured = bandwidth.contains_key(&t);
            Panel {
                series: names
                    .iter()
                    .map(|n| Series::line(n.clone(), series.get(n).cloned().unwrap_or_default()))
                    .collect(),
                refs: if measured {
                    vec![RefLine { y: 100.0, name: "the read bandwidth".into() }]
                } else {
                    Vec::new()
                },
                ..Panel::new(
                    format!("{t} thread(s)"),
                    Axis::log("M (activation rows)"),
                    Axis::from_zero(if measured {
                        "share of the read bandwidth (%)"
                    } else {
                        "weights read (GB/s)"
                    }),
                )
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, ns: f64, bytes: u64) -> Row {
        Row {
            id: id.into(),
            current: Some(Measured {
                ns,
                ns_lo: ns,
                ns_hi: ns,
                samples: vec![],
                bytes: Some(bytes),
                ops: None,
            }),
            baseline: None,
            change: None,
        }
    }

    #[test]
    fn kernels_are_drawn_as_shares_of_the_bandwidth_against_m() {
        // Shapes and rates of docs/benchmark_results/kernels-epyc-zen4-2vcpu-2026-11-30.md:
        // 4-bit qmv near 31-39 GB/s of 37-53 with two threads, qmv_wide at M = 8 3-6x the time.
        let b = 14336 * 4096 / 2 + 14336 * 4096 / 64 * 4;
        let rows = vec![
            row("read_bandwidth/sum_1024MiB_start/t2", 1e9 / 45.0 * 1.073741824, 1073741824),
            row("read_bandwidth/sum_1024MiB_start/t1", 1e9 / 30.0 * 1.073741824, 1073741824),
            row("qmv/q4_g64_n14336_k4096_m1/t2", b as f64 / 36.0, b),
            row("qmv_wide/q4_g64_n14336_k4096_m2/t2", b as f64 / 34.0, b),
            row("qmv_wide/q4_g64_n14336_k4096_m8/t2", b as f64 / 9.0, b),
            row("qmv/q4_g64_n14336_k4096_m1/t1", b as f64 / 25.0, b),
            row("qmv_wide/q4_g64_n14336_k4096_m8/t1", b as f64 / 6.0, b),
            row("qmv/q8_g64_n4096_k4096_m1/t1", 1e6, 20_000_000),
        ];
        let l = crate::plot::raster::check("kernels", &panels(&rows));
        assert_eq!(
            l.panels.iter().map(|p| p.title.as_str()).collect::<Vec<_>>(),
            ["1 thread(s)", "2 thread(s)"]
        );
        let p = &l.panels[1];
        assert_eq!(p.x_ticks.iter().map(|t| t.label.as_str()).collect::<Vec<_>>(), ["1", "2", "8"]);
        assert_eq!(p.legend_entries, ["qmv_wide q4 n14336_k4096 (from qmv at M = 1)", "the read bandwidth"]);
        // qmv's 36 GB/s of 45 opens the line: 80% at M = 1, then qmv_wide at 2 and 8.
        let s = p.series.iter().find(|s| s.name.starts_with("qmv_wide")).unwrap();
        assert_eq!(s.line.as_ref().unwrap().len(), 3);
        let y80 = p.y_ticks.iter().find(|t| t.value == 80.0).unwrap().at;
        assert!((s.points[0].1 - y80).abs() < 0.5, "{:?} {y80}", s.points);
        // A shape with no batched kernel keeps its qmv point.
        assert!(l.panels[0].legend_entries.contains(&"qmv q8 n4096_k4096".to_string()));
        assert!(
            !p.legend_entries.contains(&"qmv q8 n4096_k4096".to_string()),
            "no entry for a line not drawn"
        );
        let colour = |i: usize| {
            l.panels[i].series.iter().find(|s| s.name.starts_with("qmv_wide")).unwrap().colour.clone()
        };
        assert_eq!(colour(0), colour(1), "a kernel keeps its colour across panels");
    }
}
