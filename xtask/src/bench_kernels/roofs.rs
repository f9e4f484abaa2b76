//! The roofline of a kernel run: the compute roofs (`compute_roof/<probe>/t<threads>`,
//! each probe's operations per second) and the read bandwidth measured in the same run,
//! and each kernel benchmark placed under them by its operational intensity. The
//! placing is [`Roofline::place`]'s; this file only says what a kernel counts, and builds
//! the sheet (`readings.json` of the run's roofline directory, which report.html draws).

use std::collections::BTreeMap;

use crate::verdict::roof_tables;
use crate::verdict::roofline::{Roof, Roofline};
use crate::verdict::sheet::Sheet;

use super::files::{Measured, Row};
use super::render::{KernelId, bandwidth_threads, parse_kernel_id};
use super::target::compute_roof_id;

/// The probes whose roof a kernel is held to: the int8 multiply-accumulate rates (the
/// quantized kernels' dots are integer products of weight and activation codes).
const INT8_PREFIX: &str = "int8_";

/// The directory under criterion's where a run's roofline sheet and report.html go.
pub(super) const ROOFLINE_DIR: &str = "kiln-roofline";

/// Operations one product of a kernel benchmark does: two per multiply-accumulate, one
/// multiply-accumulate per weight and activation row (`2 * M * N * K`); the scales,
/// biases and group sums are not counted.
pub(super) fn kernel_ops(id: &KernelId) -> f64 {
    2.0 * id.m as f64 * id.n as f64 * id.k as f64
}

/// Bytes one product of a kernel benchmark reads: its declared throughput, which is the
/// matrix once; `qmv_per_row` reads it once per row.
pub(super) fn kernel_bytes(id: &KernelId, declared: u64) -> f64 {
    let passes = if id.kernel.starts_with("qmv_per_row") { id.m } else { 1 };
    declared as f64 * passes as f64
}

/// The run's roofs and its kernels under them.
pub(super) fn roofline(rows: &[Row]) -> Roofline {
    let mut bandwidth: BTreeMap<usize, f64> = BTreeMap::new();
    let mut probes: BTreeMap<(usize, String), f64> = BTreeMap::new();
    for r in rows {
        let Some(m) = &r.current else { continue };
        if let (Some(t), Some(b)) = (bandwidth_threads(&r.id), m.bytes) {
            // The higher of the start and end readings, as the report takes it.
            let e = bandwidth.entry(t).or_insert(0.0);
            *e = e.max(b as f64 / m.ns * 1e9);
        }
        if let (Some((probe, t)), Some(ops)) = (compute_roof_id(&r.id), m.ops) {
            probes.insert((t, probe.to_string()), ops as f64 / m.ns * 1e9);
        }
    }
    let mut compute: BTreeMap<usize, (&str, f64)> = BTreeMap::new();
    for ((t, probe), &v) in &probes {
        if probe.starts_with(INT8_PREFIX) && compute.get(t).is_none_or(|c| v > c.1) {
            compute.insert(*t, (probe, v));
        }
    }
    let mut r = Roofline {
        bandwidth: bandwidth.iter().map(|(t, b)| Roof::bandwidth(*t, *b)).collect(),
        compute: compute.iter().map(|(t, (p, v))| Roof::compute(*p, *t, *v)).collect(),
        probes: probes.iter().map(|((t, p), v)| Roof::compute(p.clone(), *t, *v)).collect(),
        points: Vec::new(),
        counted: "a kernel does 2 * M * N * K operations per product (a multiply-accumulate is two; \
                  scales, biases and group sums are not counted) and reads the matrix's packed \
                  codes, scales and biases (`qmv_per_row` M times)"
            .into(),
    };
    for row in rows {
        let (Some(id), Some(Measured { ns, bytes: Some(bytes), .. })) =
            (parse_kernel_id(&row.id), &row.current)
        else {
            continue;
        };
        r.place(
            row.id.clone(),
            id.kernel.clone(),
            id.threads,
            kernel_ops(&id),
            kernel_bytes(&id, *bytes),
            ns / 1e9,
        );
    }
    r
}

/// The roofline's sheet: the roofs per thread count, then each kernel's intensity, rate,
/// bound and share.
pub(super) fn sheet(r: &Roofline, context: &str) -> Sheet {
    let roofs = roof_tables::roofs(
        r,
        "The read bandwidth is the higher of the readings at the run's start and end; each \
         compute roof is a register-only loop of its instructions on all the threads at \
         once (`kiln_core::roofs`), in operations per second with a multiply-accumulate \
         counted as two. A kernel is held to the highest int8 roof; the ridge is where \
         the two roofs meet, in operations per byte.",
    );
    let kernels = roof_tables::points(r, "Kernels under the roofs", "benchmark", "a kernel");
    let headline =
        match (r.compute.iter().max_by_key(|c| c.threads), r.bandwidth.iter().max_by_key(|b| b.threads)) {
            (Some(c), Some(b)) => format!(
                "Roofs with {} thread(s): {} of {} and {} of read bandwidth ({context}).",
                c.threads, c.text, c.name, b.text
            ),
            _ => format!("The roofs were not both measured in this run ({context})."),
        };
    Sheet {
        task: "bench-kernels".into(),
        headline,
        tables: vec![roofs, kernels],
        notes: Vec::new(),
        roofline: Some(r.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, ns: f64, bytes: Option<u64>, ops: Option<u64>) -> Row {
        Row {
            id: id.into(),
            current: Some(Measured { ns, ns_lo: ns, ns_hi: ns, samples: vec![], bytes, ops }),
            baseline: None,
            change: None,
        }
    }

    #[test]
    fn each_kernel_is_held_to_the_roof_its_intensity_meets() {
        assert_eq!(compute_roof_id("compute_roof/int8_avx512_vnni/t2"), Some(("int8_avx512_vnni", 2)));
        assert_eq!(compute_roof_id("read_bandwidth/sum_1024MiB_start/t2"), None);
        // 40 GB/s (the higher of start and end), 1.4 TOPS of vpdpbusd, 0.3 TOPS of FMA.
        let b = 4096 * 4096 / 2 + 4096 * 64 * 2 * 2;
        let rows = vec![
            row("read_bandwidth/sum_1024MiB_start/t2", 25.0, Some(1000), None),
            row("read_bandwidth/sum_1024MiB_end/t2", 40.0, Some(1000), None),
            row("compute_roof/int8_avx512_vnni/t2", 1000.0, None, Some(1_400_000)),
            row("compute_roof/int8_avx2/t2", 1000.0, None, Some(700_000)),
            row("compute_roof/f32_fma_avx512/t2", 1000.0, None, Some(300_000)),
            // qmv at M = 1: 2 * 4096 * 4096 operations over b bytes, read at 32 GB/s.
            row("qmv/q4_g64_n4096_k4096_m1/t2", b as f64 / 32.0, Some(b), None),
            // qmm at M = 256: far right of the ridge, at 0.35 TOPS.
            row("qmm/q4_g64_n4096_k4096_m256/t2", 2.0 * 256.0 * 4096.0 * 4096.0 / 350.0, Some(b), None),
            // qmv_per_row reads the matrix once per row.
            row("qmv_per_row/q4_g64_n4096_k4096_m4/t2", 4.0 * b as f64 / 32.0, Some(b), None),
            // One thread: no roof measured there.
            row("qmv/q4_g64_n4096_k4096_m1/t1", b as f64 / 20.0, Some(b), None),
        ];
        let r = roofline(&rows);
        assert_eq!(r.bandwidth, vec![Roof::bandwidth(2, 40e9)]);
        assert_eq!(r.compute, vec![Roof::compute("int8_avx512_vnni", 2, 1.4e12)]);
        assert_eq!(r.probes.len(), 3);
        assert_eq!(r.ridge(2), Some(35.0));
        let by: BTreeMap<&str, &crate::verdict::roofline::Point> =
            r.points.iter().map(|p| (p.name.as_str(), p)).collect();
        let qmv = by["qmv/q4_g64_n4096_k4096_m1/t2"];
        assert!((qmv.intensity - 2.0 * 4096.0 * 4096.0 / b as f64).abs() < 1e-9);
        assert_eq!(qmv.text, "bandwidth, 80%");
        assert_eq!(by["qmm/q4_g64_n4096_k4096_m256/t2"].text, "compute, 25%");
        let per_row = by["qmv_per_row/q4_g64_n4096_k4096_m4/t2"];
        assert!((per_row.intensity - qmv.intensity).abs() < 1e-9, "M rows, M reads");
        assert_eq!(per_row.text, "bandwidth, 80%");
        assert!(by["qmv/q4_g64_n4096_k4096_m1/t1"].bound.is_none());
        let s = sheet(&r, "host h");
        let md = s.markdown();
        assert!(
            s.headline.starts_with("Roofs with 2 thread(s): 1.40 TOPS of int8_avx512_vnni and 40.0 GB/s"),
            "{}",
            s.headline
        );
        assert!(md.contains("| 2 | 40.0 GB/s | 1.40 TOPS (int8_avx512_vnni) | 35.0 |"), "{md}");
        assert!(md.contains("| `qmm/q4_g64_n4096_k4096_m256/t2` | "), "{md}");
        // The sheet carries the roofline the plot draws, as placed.
        assert_eq!(s.roofline.as_ref(), Some(&r));
    }
}
