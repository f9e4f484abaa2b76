//! What a run says at its end: the tally of skipped geometries, the reasons it exits 1,
//! and the markdown tables and the SVG written beside the CSV.

use std::path::Path;

use super::rows::{OffloadRow, size};
use crate::plot;
use crate::sweep::classify::Status;

/// The geometries a run walked, and which of them measured nothing.
#[derive(Default)]
pub(super) struct Tally {
    /// Geometries (or models without a shape) walked.
    pub(super) total: usize,
    /// Those skipped whole, as `model@slots` (or the model alone).
    pub(super) skipped: Vec<String>,
    /// Those named with `--models` or `--cache-slots` that measured nothing.
    pub(super) named_empty: Vec<String>,
}

impl Tally {
    /// The line printed after the tables.
    pub(super) fn line(&self) -> String {
        if self.skipped.is_empty() {
            format!("skipped 0 of {} combinations", self.total)
        } else {
            format!(
                "skipped {} of {} combinations: {}",
                self.skipped.len(),
                self.total,
                self.skipped.join(", ")
            )
        }
    }

    /// Why the run exits 1, empty for exit 0: it measured nothing, a geometry named by
    /// hand measured nothing, or a cell failed. A derived default that a backend refuses
    /// is expected output.
    pub(super) fn exit_reasons(&self, rows: &[OffloadRow]) -> Vec<String> {
        let measured = rows.iter().filter(|r| r.status == Status::Ok.as_str()).count();
        let failed = rows.iter().filter(|r| r.status.starts_with("FAIL:")).map(|r| {
            format!("{}@{} bs={} miss={}: {}", r.model, r.cache_slots, r.batch_size, r.miss_rate, r.status)
        });
        let mut reasons = Vec::new();
        if measured == 0 {
            reasons.push("the run measured nothing".to_string());
        }
        if !self.named_empty.is_empty() {
            reasons.push(format!(
                "models or geometries named with --models or --cache-slots measured nothing: {}",
                self.named_empty.join(", ")
            ));
        }
        reasons.extend(failed);
        reasons
    }
}

/// The markdown tables and the SVG beside the CSV; a failure is a warning, never the
/// loss of the CSV.
pub(super) fn write_tables(rows: &[OffloadRow], csv: &Path) {
    let md = csv.with_extension("md");
    // Replaced atomically: a reader sees the last run's tables or this run's whole.
    match crate::fsx::write_atomic(&md, markdown(rows).as_bytes()) {
        Ok(()) => eprintln!("tables: {}", md.display()),
        Err(e) => eprintln!("warning: no tables beside {}: {e:#}", csv.display()),
    }
    let svg = csv.with_extension("svg");
    match plot::write_svg(&svg, &panels(rows)) {
        Ok(_) => eprintln!("plot: {}", svg.display()),
        Err(e) => eprintln!("warning: no plot beside {}: {e:#}", csv.display()),
    }
}

/// One markdown table per geometry with a row that ran, in sweep order.
pub fn markdown(rows: &[OffloadRow]) -> String {
    let mut out = String::from("# Expert offload copy cost\n");
    // Figures of the CUDA kernels' host execution are the CPU's: said before any of them.
    let notes = crate::machine::host_execution_notes(rows.iter().map(|r| r.device.as_str()));
    if !notes.is_empty() {
        out.push_str(&format!("\n{notes}"));
    }
    let mut seen: Vec<(String, u64)> = Vec::new();
    for r in rows {
        let key = (r.model.clone(), r.cache_slots);
        if seen.contains(&key) {
            continue;
        }
        seen.push(key.clone());
        let group: Vec<&OffloadRow> =
            rows.iter().filter(|x| (x.model.clone(), x.cache_slots) == key).collect();
        if group.iter().all(|x| x.status != Status::Ok.as_str() && x.status != Status::Oom.as_str()) {
            let status = &group[0].status;
            out.push_str(&format!("\n{} @ cache_slots={}: {status}\n", key.0, key.1));
            continue;
        }
        let bytes = r.cache_bytes.unwrap_or(0);
        out.push_str(&format!("\n## {} @ cache_slots={} ({})\n\n", key.0, key.1, size(bytes)));
        out.push_str(
            "| batch | miss rate | measured | copy GB/s | share of read | fetch us/token | status |\n",
        );
        out.push_str("|---:|---:|---:|---:|---:|---:|---|\n");
        let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v}"));
        for x in group {
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} |\n",
                x.batch_size,
                x.miss_rate,
                opt(x.measured_miss_rate),
                opt(x.copy_gb_s),
                opt(x.copy_share),
                opt(x.fetch_us_per_token),
                x.status
            ));
        }
    }
    out
}

/// Expert-fetch time per token against the miss rate, one line per (geometry, batch
/// size); a cell without a measurement is marked with its status. Lines more than 10x
/// apart get a panel each.
pub fn panels(rows: &[OffloadRow]) -> Vec<plot::Panel> {
    let name = |r: &OffloadRow| format!("{}@{} bs={}", r.model, r.cache_slots, r.batch_size);
    let mut names: Vec<String> = Vec::new();
    for r in rows {
        if !names.contains(&name(r)) {
            names.push(name(r));
        }
    }
    let series: Vec<plot::Series> = names
        .iter()
        .map(|n| {
            plot::Series::line(
                n.clone(),
                rows.iter()
                    .filter(|r| &name(r) == n && r.status == Status::Ok.as_str())
                    .filter_map(|r| Some((r.miss_rate, r.fetch_us_per_token?)))
                    .collect(),
            )
        })
        .collect();
    let marks: Vec<plot::Mark> = rows
        .iter()
        .filter(|r| r.status != Status::Ok.as_str() && r.status != Status::Unsupported.as_str())
        .map(|r| plot::Mark { series: name(r), x: r.miss_rate, label: r.status.clone() })
        .collect();
    // A geometry refused outright has nothing to draw or mark.
    let series = series
        .into_iter()
        .filter(|s| !s.points.is_empty() || marks.iter().any(|m| m.series == s.name))
        .collect();
    vec![plot::Panel {
        series,
        marks,
        split_when_spread: true,
        ..plot::Panel::new(
            "expert-fetch time per token",
            plot::Axis::linear("miss rate (share of expert lookups)"),
            plot::Axis::from_zero("expert fetch (µs/token)"),
        )
    }]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_and_the_plot_cover_measured_and_skipped_geometries() {
        let row = |slots: u64, b: u64, r: f64, status: &str, fetch: Option<f64>| OffloadRow {
            model: "m".into(),
            cache_slots: slots,
            cache_bytes: Some(slots * 1024),
            batch_size: b,
            miss_rate: r,
            status: status.into(),
            fetch_us_per_token: fetch,
            ..OffloadRow::default()
        };
        let rows = [
            row(8, 1, 0.0, "ok", Some(1.0)),
            row(8, 1, 1.0, "ok", Some(9.0)),
            row(16, 1, 0.0, "SKIP:unsupported", None),
            row(16, 1, 1.0, "SKIP:unsupported", None),
        ];
        let md = markdown(&rows);
        assert!(!md.contains("host execution"), "{md}");
        let emulated: Vec<OffloadRow> = rows
            .iter()
            .map(|r| OffloadRow { device: "cuda:host execution on C (1 GiB)".into(), ..r.clone() })
            .collect();
        assert!(
            markdown(&emulated).contains(
                "\nfigures are the CUDA kernels' host execution on C (1 GiB), not a GPU (KILN_CUDA_EMULATE=1)\n"
            ),
            "{}",
            markdown(&emulated)
        );
        assert_eq!(md.matches("## m @ cache_slots=8").count(), 1);
        assert!(md.contains("m @ cache_slots=16: SKIP:unsupported"));
        assert!(!md.contains("## m @ cache_slots=16"));
        let p = panels(&rows);
        assert_eq!(p[0].series.len(), 1);
        assert_eq!(p[0].series[0].points, vec![(0.0, 1.0).into(), (1.0, 9.0).into()]);
        assert!(p[0].marks.is_empty());
        let mut rows = rows.to_vec();
        rows.push(row(8, 4, 0.0, "ok", Some(0.5)));
        rows.push(row(8, 4, 0.5, "ok", Some(2.5)));
        rows.push(row(8, 4, 1.0, "FAIL:timeout", None));
        let l = plot::raster::check("offload-copy", &panels(&rows));
        let p = &l.panels[0];
        assert_eq!((p.x_ticks[0].value, p.x_ticks.last().unwrap().value), (0.0, 1.0));
        assert_eq!(p.notes[0].0, "m@8 bs=4: FAIL:timeout at 1");
    }

    #[test]
    fn the_tally_names_what_was_skipped_and_why_the_run_fails() {
        let ok =
            OffloadRow { model: "m".into(), cache_slots: 8, status: "ok".into(), ..OffloadRow::default() };
        let fail = OffloadRow { status: "FAIL:timeout".into(), batch_size: 4, miss_rate: 0.5, ..ok.clone() };
        let mut t = Tally { total: 2, ..Tally::default() };
        assert_eq!(t.line(), "skipped 0 of 2 combinations");
        assert!(t.exit_reasons(std::slice::from_ref(&ok)).is_empty());
        t.skipped.push("m@16".into());
        t.named_empty.push("m@16".into());
        assert_eq!(t.line(), "skipped 1 of 2 combinations: m@16");
        assert_eq!(
            t.exit_reasons(&[fail]),
            [
                "the run measured nothing",
                "models or geometries named with --models or --cache-slots measured nothing: m@16",
                "m@8 bs=4 miss=0.5: FAIL:timeout",
            ]
        );
    }
}
