//! Rendering the markdown report: the run's context, one table row per benchmark, the
//! verdicts against the baseline, the thread-scaling table, and the activation schemes
//! side by side.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use super::files::{Measured, Row};
use super::stats::verdict;
use super::target::BANDWIDTH_GROUP;
use super::target::compute_roof_id;
use crate::verdict::roofline::Roofline;

/// Where and how the run happened.
pub(super) struct RunContext {
    pub(super) date: String,
    pub(super) commit: String,
    pub(super) host: String,
    pub(super) cpu: String,
    pub(super) quick: bool,
    pub(super) filter: Option<String>,
    pub(super) baseline: String,
    pub(super) baseline_named: bool,
    pub(super) saved_as: Option<String>,
    pub(super) noise_threshold: f64,
    pub(super) significance_level: f64,
}

/// A kernel benchmark id taken apart: `<kernel>/q<bits>_g<g>_n<N>_k<K>_m<M>/t<threads>`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct KernelId {
    pub(super) kernel: String,
    pub(super) bits: u32,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) m: usize,
    pub(super) threads: usize,
}

pub(super) fn parse_kernel_id(id: &str) -> Option<KernelId> {
    let mut parts = id.split('/');
    let (kernel, case, t) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let threads = t.strip_prefix('t')?.parse().ok()?;
    let mut fields = case.split('_');
    let bits = fields.next()?.strip_prefix('q')?.parse().ok()?;
    let _group: usize = fields.next()?.strip_prefix('g')?.parse().ok()?;
    let n = fields.next()?.strip_prefix('n')?.parse().ok()?;
    let k = fields.next()?.strip_prefix('k')?.parse().ok()?;
    let m = fields.next()?.strip_prefix('m')?.parse().ok()?;
    Some(KernelId { kernel: kernel.to_string(), bits, n, k, m, threads })
}

/// Threads of a read-bandwidth id (`read_bandwidth/<buffer>/t<threads>`).
pub(super) fn bandwidth_threads(id: &str) -> Option<usize> {
    let rest = id.strip_prefix(BANDWIDTH_GROUP)?.strip_prefix('/')?;
    rest.rsplit('/').next()?.strip_prefix('t')?.parse().ok()
}

pub(super) fn fmt_time(ns: f64) -> String {
    if ns >= 1e9 {
        format!("{:.3} s", ns / 1e9)
    } else if ns >= 1e6 {
        format!("{:.3} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2} µs", ns / 1e3)
    } else {
        format!("{ns:.1} ns")
    }
}

pub(super) fn fmt_pct(v: f64) -> String {
    format!("{:+.1}%", v * 100.0)
}

/// The markdown report; each line's bound and share are `roofline`'s, as placed there.
pub(super) fn render(ctx: &RunContext, rows: &[Row], roofline: &Roofline) -> String {
    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(w, "## Kernel benchmarks, {}\n", ctx.date);
    let baseline = if ctx.baseline_named {
        format!("`{}`", ctx.baseline)
    } else {
        format!("`{}` (the previous run)", ctx.baseline)
    };
    let _ = writeln!(
        w,
        "commit `{}` · host `{}` · {} · {} · filter {} · baseline {}{} · noise threshold {}% · significance {}\n",
        ctx.commit,
        ctx.host,
        ctx.cpu,
        if ctx.quick { "criterion `--quick` (two samples each: comparisons are weak)" } else { "full run" },
        ctx.filter.as_deref().map_or("none".to_string(), |f| format!("`{f}`")),
        baseline,
        ctx.saved_as.as_deref().map_or(String::new(), |s| format!(", results saved as `{s}`")),
        ctx.noise_threshold * 100.0,
        ctx.significance_level,
    );

    let _ = writeln!(
        w,
        "The baseline was measured in an earlier run, not interleaved with this one: on a shared \
         machine a change may be the load, not the code. For verdicts from interleaved pairs, run \
         `cargo xtask bench-kernels --compare REV`.\n"
    );

    // Read bandwidth per thread count, from this run only: the highest of its
    // measurements (the bench takes one at the start and one at the end of the run; on a
    // shared machine the lower one met someone else's load).
    let mut bandwidth: BTreeMap<usize, f64> = BTreeMap::new();
    for r in rows {
        if let (Some(t), Some(g)) = (bandwidth_threads(&r.id), r.current.as_ref().and_then(Measured::gb_s)) {
            let e = bandwidth.entry(t).or_insert(g);
            *e = e.max(g);
        }
    }
    if bandwidth.is_empty() {
        let _ = writeln!(w, "Read bandwidth: **not measured in this run**, so no percentages below.\n");
    } else {
        let list: Vec<String> =
            bandwidth.iter().map(|(t, g)| format!("{g:.1} GB/s with {t} thread(s)")).collect();
        let _ = writeln!(
            w,
            "Read bandwidth measured in this run (the higher of its measurements at the start and the end): {}.\n",
            list.join(", ")
        );
    }

    if roofline.compute.is_empty() {
        let _ = writeln!(w, "Compute roofs: **not measured in this run**, so no bound below.\n");
    } else {
        let list: Vec<String> = roofline
            .compute
            .iter()
            .map(|c| {
                let ridge = roofline
                    .ridge(c.threads)
                    .map_or(String::new(), |r| format!(", ridge at {r:.1} ops/byte"));
                format!("{} ({}) with {} thread(s){ridge}", c.text, c.name, c.threads)
            })
            .collect();
        let _ = writeln!(
            w,
            "Compute roof measured in this run (the highest int8 multiply-accumulate rate, a MAC counted as two operations): {}.\n",
            list.join("; ")
        );
    }

    let _ = writeln!(
        w,
        "| benchmark | baseline | current | change (95% CI) | verdict | GB/s | % of read BW | roof: bound, share |"
    );
    let _ = writeln!(w, "|---|---:|---:|---|---|---:|---:|---|");
    for row in rows {
        let (v, p) = verdict(row, ctx.noise_threshold, ctx.significance_level);
        let base = row.baseline.as_ref().map_or("none".to_string(), |b| fmt_time(b.ns));
        let current = match &row.current {
            Some(c) => format!("{} [{}, {}]", fmt_time(c.ns), fmt_time(c.ns_lo), fmt_time(c.ns_hi)),
            None => "did not run".to_string(),
        };
        let change = match (row.change, p) {
            (Some(c), Some(p)) => {
                format!("{} [{}, {}], p = {p:.3}", fmt_pct(c.point), fmt_pct(c.lo), fmt_pct(c.hi))
            }
            (Some(c), None) => format!("{} [{}, {}]", fmt_pct(c.point), fmt_pct(c.lo), fmt_pct(c.hi)),
            (None, _) => "n/a".to_string(),
        };
        let gbs = row.current.as_ref().and_then(Measured::gb_s);
        let threads = parse_kernel_id(&row.id).map(|k| k.threads).or_else(|| bandwidth_threads(&row.id));
        let pct = match (gbs, threads.and_then(|t| bandwidth.get(&t))) {
            (Some(g), Some(bw)) if bandwidth_threads(&row.id).is_none() => share_of_bandwidth(g, *bw),
            _ => "n/a".to_string(),
        };
        let gbs = gbs.map_or("n/a".to_string(), |g| format!("{g:.1}"));
        let roof = match compute_roof_id(&row.id) {
            Some((probe, t)) => roofline
                .probes
                .iter()
                .find(|p| p.name == probe && p.threads == t)
                .map_or("n/a".to_string(), |p| format!("the roof: {}", p.text)),
            None => roofline
                .points
                .iter()
                .find(|p| p.name == row.id)
                .map_or("n/a".to_string(), |p| p.text.clone()),
        };
        let _ = writeln!(
            w,
            "| `{}` | {base} | {current} | {change} | {} | {gbs} | {pct} | {roof} |",
            row.id,
            v.as_str()
        );
    }

    render_scaling(w, rows);
    render_schemes(w, rows);

    let missing: Vec<&str> = rows.iter().filter(|r| r.current.is_none()).map(|r| r.id.as_str()).collect();
    if !missing.is_empty() {
        let _ = writeln!(
            w,
            "\n**{} benchmark(s) did not run** (see the bench output): {}",
            missing.len(),
            missing.join(", ")
        );
    }
    let _ = writeln!(
        w,
        "\nTimes are per product (95% interval); GB/s counts the matrix's packed codes, scales and \
         biases once per product (`qmv_per_row` reads them M times); the percentage is of the read \
         bandwidth with the same thread count. The roof column places each kernel on the roofline by \
         its operations per byte read: below the ridge (the compute roof over the read bandwidth) \
         the read bandwidth bounds it, above it the compute roof; its share is its operations per \
         second over that bound ({}). The roofline itself is in `kiln-roofline/` \
         beside this report (readings.json, report.html).",
        roofline.counted
    );
    out
}

/// A kernel's GB/s as a percentage of the read bandwidth measured in the same run. Over
/// 100% is not a share: the kernel read faster than the bandwidth measurement did, so
/// that measurement met load (or the kernel's bytes are reused from cache), and the
/// figure is flagged rather than printed as if it were one.
pub(super) fn share_of_bandwidth(gb_s: f64, bandwidth: f64) -> String {
    let pct = 100.0 * gb_s / bandwidth;
    if pct > 100.0 {
        format!("{pct:.0}% (over 100%: the read bandwidth measured low, not a share)")
    } else {
        format!("{pct:.0}%")
    }
}

/// Time at M over time at M = 1 (`qmv`) for the same shape, width and threads: the batch
/// scaling of the vector kernels.
pub(super) fn render_scaling(w: &mut String, rows: &[Row]) {
    let times: BTreeMap<KernelId, f64> =
        rows.iter().filter_map(|r| Some((parse_kernel_id(&r.id)?, r.current.as_ref()?.ns))).collect();
    // Keyed by the id with M set to 1: one line per kernel, width, shape and threads.
    let mut lines: BTreeMap<KernelId, BTreeMap<usize, f64>> = BTreeMap::new();
    for (id, &ns) in &times {
        if id.m < 2 {
            continue;
        }
        let base = if id.kernel.ends_with(INT8_SUFFIX) { "qmv_int8" } else { "qmv" };
        let one = KernelId { kernel: base.into(), m: 1, ..id.clone() };
        if let Some(&base) = times.get(&one) {
            lines.entry(KernelId { m: 1, ..id.clone() }).or_default().insert(id.m, ns / base);
        }
    }
    if lines.is_empty() {
        return;
    }
    let ms: BTreeSet<usize> = lines.values().flat_map(|l| l.keys().copied()).collect();
    let _ = writeln!(w, "\nTime at M over the time of `qmv` at M = 1 (same shape, width, threads):\n");
    let header: Vec<String> = ms.iter().map(|m| format!("M = {m}")).collect();
    let _ = writeln!(w, "| kernel | bits | shape | threads | {} |", header.join(" | "));
    let _ = writeln!(w, "|---|---:|---|---:|{}", "---:|".repeat(ms.len()));
    for (id, by_m) in &lines {
        let cells: Vec<String> =
            ms.iter().map(|m| by_m.get(m).map_or(String::new(), |r| format!("{r:.2}x"))).collect();
        let _ = writeln!(
            w,
            "| {} | {} | n{}_k{} | {} | {} |",
            id.kernel,
            id.bits,
            id.n,
            id.k,
            id.threads,
            cells.join(" | ")
        );
    }
}

/// The suffix of kernel names measured under `KILN_ACT_PRECISION=int8` (4-bit weights);
/// names without it ran the default scheme, `int16`.
pub(super) const INT8_SUFFIX: &str = "_int8";

/// Each 4-bit kernel under the default `int16` scheme beside the same kernel under
/// `int8`: the speed the finer activation codes cost.
pub(super) fn render_schemes(w: &mut String, rows: &[Row]) {
    let times: BTreeMap<KernelId, f64> =
        rows.iter().filter_map(|r| Some((parse_kernel_id(&r.id)?, r.current.as_ref()?.ns))).collect();
    let mut lines = Vec::new();
    for (id, &ns8) in &times {
        let Some(plain) = id.kernel.strip_suffix(INT8_SUFFIX) else { continue };
        if let Some(&ns16) = times.get(&KernelId { kernel: plain.into(), ..id.clone() }) {
            lines.push((plain.to_string(), id, ns16, ns8));
        }
    }
    if lines.is_empty() {
        return;
    }
    let _ = writeln!(
        w,
        "\nActivation schemes (`KILN_ACT_PRECISION`), same run: time under `int16` (the default) over time under `int8`:\n"
    );
    let _ = writeln!(w, "| kernel | bits | shape | M | threads | int16 | int8 | int16 / int8 |");
    let _ = writeln!(w, "|---|---:|---|---:|---:|---:|---:|---:|");
    for (kernel, id, ns16, ns8) in lines {
        let _ = writeln!(
            w,
            "| {kernel} | {} | n{}_k{} | {} | {} | {:.1} us | {:.1} us | {:.3} |",
            id.bits,
            id.n,
            id.k,
            id.m,
            id.threads,
            ns16 / 1e3,
            ns8 / 1e3,
            ns16 / ns8
        );
    }
}
