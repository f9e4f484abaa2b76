//! The two tables every page prints of a [`Roofline`]: the roofs per thread count, and
//! the points under them with their bound and share. The kernel run's roofline sheet and a
//! sweep's (`--measure-roofs`) both build them here, from the values
//! [`Roofline::place`] decided.

use super::roofline::{Roof, Roofline, ops_text};
use super::sheet::{Cell, Table};

/// The roofs per thread count: the read bandwidth, the compute roof points are held to,
/// the ridge and every probe. `legend` says how this run measured them.
pub fn roofs(r: &Roofline, legend: &str) -> Table {
    let mut threads: Vec<usize> = r.bandwidth.iter().chain(&r.probes).map(|x| x.threads).collect();
    threads.sort_unstable();
    threads.dedup();
    Table {
        title: "Roofs measured in this run".into(),
        legend: legend.into(),
        columns: ["threads", "read bandwidth", "compute roof (held to)", "ridge (ops/byte)", "every probe"]
            .map(str::to_string)
            .to_vec(),
        rows: threads
            .iter()
            .map(|&t| {
                let find = |v: &[Roof]| v.iter().find(|x| x.threads == t).cloned();
                let probes: Vec<String> = r
                    .probes
                    .iter()
                    .filter(|p| p.threads == t)
                    .map(|p| format!("{} {}", p.name, p.text))
                    .collect();
                vec![
                    Cell::text(t.to_string()),
                    Cell::text(find(&r.bandwidth).map_or("not measured".into(), |b| b.text)),
                    Cell::text(
                        find(&r.compute)
                            .map_or("not measured".into(), |c| format!("{} ({})", c.text, c.name)),
                    ),
                    Cell::text(r.ridge(t).map_or("n/a".into(), |x| format!("{x:.1}"))),
                    Cell::text(if probes.is_empty() { "none".into() } else { probes.join(", ") }),
                ]
            })
            .collect(),
    }
}

/// The points under the roofs, titled `title`, each named in a first column headed
/// `first` (`a` point is what the legend calls one: `a kernel`, `a cell's phase`).
pub fn points(r: &Roofline, title: &str, first: &str, a: &str) -> Table {
    Table {
        title: title.into(),
        legend: format!(
            "Intensity is operations per byte read: {}. Below the ridge the read bandwidth bounds \
             {a}, above it the compute roof; the share is its operations per second over that \
             bound at its intensity.",
            r.counted
        ),
        columns: [first, "ops/byte", "operations per second", "bound, share"].map(str::to_string).to_vec(),
        rows: r
            .points
            .iter()
            .map(|p| {
                vec![
                    Cell::text(format!("`{}`", p.name)),
                    Cell::text(format!("{:.2}", p.intensity)),
                    Cell::text(ops_text(p.ops_per_s)),
                    Cell::text(p.text.clone()),
                ]
            })
            .collect(),
    }
}
