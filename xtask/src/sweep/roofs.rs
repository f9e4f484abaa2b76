//! `--measure-roofs`: every kiln cell of a CPU sweep measures the machine's compute roofs
//! and read bandwidth beside itself (`kiln bench-decode --measure-roofs`), and the sweep
//! places each cell's prefill and decode under the highest roofs the run measured, one
//! point per run of a cell. The placing is [`Roofline::place`]'s; the summary prints the
//! points' texts and report.html draws them.

use std::collections::BTreeMap;

use kiln_protocol::DecodeReport;

use crate::verdict::roof_tables;
use crate::verdict::roofline::{Roof, Roofline};
use crate::verdict::sheet::Sheet;

/// What the cells' reports said, in the order they ran.
#[derive(Clone, Debug, Default)]
pub struct CellRoofs {
    cells: Vec<(String, DecodeReport)>,
}

impl CellRoofs {
    /// Keeps `report` of the cell labelled `label` when it measured the roofs.
    pub fn note(&mut self, label: String, report: &DecodeReport) {
        if report.roofs.is_some() {
            self.cells.push((label, report.clone()));
        }
    }

    /// Adds the cells `other` noted after these (a later round's).
    pub fn extend(&mut self, other: CellRoofs) {
        self.cells.extend(other.cells);
    }

    /// The run's roofline: per thread count the highest read bandwidth and compute roof
    /// any cell measured (a roof is what the machine can do: a lower reading is that
    /// cell's disturbance), every probe's highest reading, and each cell's prefill and
    /// decode placed under them. `None` when no cell measured roofs.
    pub fn roofline(&self) -> Option<Roofline> {
        let mut bandwidth: BTreeMap<usize, f64> = BTreeMap::new();
        let mut compute: BTreeMap<usize, (String, f64)> = BTreeMap::new();
        let mut probes: BTreeMap<(usize, String), f64> = BTreeMap::new();
        for (_, r) in &self.cells {
            let Some(m) = &r.roofs else { continue };
            let t = r.threads as usize;
            let b = bandwidth.entry(t).or_insert(0.0);
            *b = b.max(m.read_bandwidth_bytes_per_s);
            if compute.get(&t).is_none_or(|c| m.compute_roof_ops_per_s > c.1) {
                compute.insert(t, (m.compute_roof.clone(), m.compute_roof_ops_per_s));
            }
            for (name, &v) in &m.compute_probes {
                let p = probes.entry((t, name.clone())).or_insert(0.0);
                *p = p.max(v);
            }
        }
        if bandwidth.is_empty() {
            return None;
        }
        let mut line = Roofline {
            bandwidth: bandwidth.iter().map(|(t, b)| Roof::bandwidth(*t, *b)).collect(),
            compute: compute.iter().map(|(t, (n, v))| Roof::compute(n.clone(), *t, *v)).collect(),
            probes: probes.iter().map(|((t, n), v)| Roof::compute(n.clone(), *t, *v)).collect(),
            points: Vec::new(),
            counted: "a prefill counts its layer products (2 * N * K per product and prompt token), the \
                      LM head's one row and causal attention's two products, over the weight bytes it \
                      reads once; a decode step counts its layer products and LM head over the weight \
                      bytes one step reads (attention not counted)"
                .into(),
        };
        for (label, r) in &self.cells {
            let Some(m) = &r.roofs else { continue };
            let t = r.threads as usize;
            if m.prefill_ops_per_s > 0.0 && m.prefill_bytes > 0.0 {
                let secs = m.prefill_ops / m.prefill_ops_per_s;
                line.place(format!("{label} prefill"), "prefill", t, m.prefill_ops, m.prefill_bytes, secs);
            }
            if r.decode_tok_s > 0.0 && m.decode_bytes_per_token > 0.0 {
                let (ops, bytes) = (m.decode_ops_per_token, m.decode_bytes_per_token);
                line.place(format!("{label} decode"), "decode", t, ops, bytes, 1.0 / r.decode_tok_s);
            }
        }
        Some(line)
    }

    /// Adds the run's roofline to `sheet`: its roofs table, its points table and the
    /// roofline report.html draws. Nothing when no cell measured roofs.
    pub fn add_to(&self, sheet: &mut Sheet) {
        let Some(line) = self.roofline() else { return };
        sheet.tables.push(roof_tables::roofs(
            &line,
            "Every kiln cell measured the roofs beside its run (`kiln bench-decode \
             --measure-roofs`): the read bandwidth, and each compute roof as a register-only loop \
             of its instructions on all the cell's threads at once, in operations per second with \
             a multiply-accumulate counted as two. These are the highest readings of the run; a \
             point is held to the compute roof its cell's weights use (int8 for quantized ones). \
             bench-decode's own JSON gives each cell's share against its own readings.",
        ));
        sheet.tables.push(roof_tables::points(&line, "Cells under the roofs", "cell and phase", "a phase"));
        sheet.roofline = Some(line);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verdict::roofline::Bound;
    use kiln_protocol::RoofsReport;

    fn report(
        threads: u64,
        bandwidth: f64,
        roof: f64,
        prefill_ops_per_s: f64,
        decode_tok_s: f64,
    ) -> DecodeReport {
        let mut r: DecodeReport = serde_json::from_str(
            r#"{"model":"m","model_path":"m","prompt_tokens":512,"generated_tokens":8,"prefill_ms":1.0,"prefill_tok_s":1.0,"decode_ms":1.0,"decode_tok_s":1.0,"peak_bytes":1,"peak_breakdown":{"weights":1,"kv":0,"scratch":0,"other":0},"max_rss_bytes":1,"startup_ms":1.0,"first_token_ms":1.0,"backend":"cpu","threads":2,"kiln_version":"0","attention":"streaming","prefill_chunk":0,"memory_limit_bytes":null}"#,
        )
        .unwrap();
        r.threads = threads;
        r.decode_tok_s = decode_tok_s;
        r.roofs = Some(RoofsReport {
            compute_roof: "int8_avx512_vnni".into(),
            compute_roof_ops_per_s: roof,
            compute_probes: [("int8_avx512_vnni".to_string(), roof), ("f32_fma".to_string(), roof / 4.0)]
                .into_iter()
                .collect(),
            compute_probe_ms: 10.0,
            read_bandwidth_bytes_per_s: bandwidth,
            prefill_ops: 512.0 * 1e9,
            prefill_attention_ops: 1e9,
            prefill_bytes: 0.5e9,
            prefill_ops_per_s,
            prefill_compute_share: prefill_ops_per_s / roof,
            decode_ops_per_token: 1e9,
            decode_bytes_per_token: 0.5e9,
            decode_bandwidth_share: 0.0,
        });
        r
    }

    #[test]
    fn each_cell_is_placed_under_the_runs_highest_roofs_prefill_by_compute_decode_by_bandwidth() {
        let mut c = CellRoofs::default();
        // Two cells on 2 threads: the second measured the roofs lower (disturbed).
        c.note("qwen@512".into(), &report(2, 40e9, 1.4e12, 0.14e12, 40.0));
        c.note("qwen@8192".into(), &report(2, 30e9, 1.2e12, 0.07e12, 20.0));
        // A cell that measured nothing is not a point.
        let mut plain = report(2, 1.0, 1.0, 1.0, 1.0);
        plain.roofs = None;
        c.note("plain@1".into(), &plain);
        let line = c.roofline().unwrap();
        assert_eq!(line.bandwidth, vec![Roof::bandwidth(2, 40e9)]);
        assert_eq!(line.compute, vec![Roof::compute("int8_avx512_vnni", 2, 1.4e12)]);
        assert_eq!(line.probes.len(), 2);
        let names: Vec<&str> = line.points.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["qwen@512 prefill", "qwen@512 decode", "qwen@8192 prefill", "qwen@8192 decode"]);
        // Prefill: 1024 ops per byte, above the ridge of 35: 10% of the compute roof.
        let p = &line.points[0];
        assert_eq!(p.bound, Some(Bound::Compute));
        assert!((p.share.unwrap() - 0.1).abs() < 1e-9 && p.text == "compute, 10%", "{p:?}");
        // Decode: 2 ops per byte at 40 tok/s reads 20 GB/s, half the bandwidth.
        let d = &line.points[1];
        assert_eq!(d.bound, Some(Bound::Bandwidth));
        assert!((d.share.unwrap() - 0.5).abs() < 1e-9, "{d:?}");
        // The second cell is held to the run's roofs, not its own lower readings.
        assert!((line.points[2].share.unwrap() - 0.05).abs() < 1e-9);

        let mut sheet = Sheet {
            task: "sweep".into(),
            headline: "h".into(),
            tables: vec![],
            notes: vec![],
            roofline: None,
        };
        c.add_to(&mut sheet);
        let md = sheet.markdown();
        assert!(
            md.contains("Cells under the roofs")
                && md.contains("`qwen@512 prefill`")
                && md.contains("compute, 10%"),
            "{md}"
        );
        assert!(sheet.roofline.is_some());
        // No cell with roofs: the sheet is left alone.
        let mut bare = Sheet { roofline: None, tables: vec![], ..sheet };
        CellRoofs::default().add_to(&mut bare);
        assert!(bare.tables.is_empty() && bare.roofline.is_none());
    }
}
