//! `cargo xtask bench-kernels`: runs kiln's criterion kernel benchmarks
//! (`cargo bench -p kiln-benches --bench kernels`) and writes a markdown report ready to
//! paste into a pull request, built from criterion's own output files.
//!
//! What criterion 0.8 leaves under `<target>/criterion/<group>/<function>/<value>/`:
//! - `new/{benchmark,estimates,sample,tukey}.json`: this run (`benchmark.json` holds the
//!   id and the throughput, `estimates.json` the mean/median/slope with 95% intervals in
//!   ns, `sample.json` the raw iteration counts and times);
//! - `<baseline>/...`: the same files for a named baseline (`base` unless named), copied
//!   from `new/` after the run when the baseline is being saved;
//! - `change/estimates.json`: the relative change of the mean and median against the
//!   baseline, with intervals, written only when a comparison ran. It is not removed by
//!   later runs, so the report uses it only when it is newer than this run's start.
//!
//! criterion's verdict needs a p-value it prints but never writes: the report recomputes it
//! with Welch's t-test on the two saved samples (criterion bootstraps the same statistic),
//! then applies criterion's rule: no change unless p < significance; otherwise improved or
//! regressed only when the whole interval of the change lies beyond the noise threshold.
//! The thresholds are passed to criterion, so both use the same ones.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::SystemTime;

use anyhow::{Context, Result};
use serde::Deserialize;
use xshell::{Shell, cmd};

use crate::machine::{self, Machine};

/// The bench target the task runs.
const BENCH_PACKAGE: &str = "kiln-benches";
const BENCH_TARGET: &str = "kernels";
/// The read-bandwidth benches, measured in every run (at its start and its end) so each
/// report carries the machine's limit from the same run.
const BANDWIDTH_GROUP: &str = "read_bandwidth";
/// The baseline criterion compares with, and saves, when none is named.
const DEFAULT_BASELINE: &str = "base";
/// Where the report is written, under criterion's output directory.
const REPORT_FILE: &str = "kiln-kernels-report.md";

/// Flags of `cargo xtask bench-kernels`.
#[derive(clap::Args)]
pub struct BenchKernels {
    /// Run only the benchmarks whose id matches this regular expression (criterion's
    /// filter); the read-bandwidth benchmarks always run too.
    #[arg(long, value_name = "REGEX")]
    filter: Option<String>,
    /// Save the results as this named baseline (comparing with it first when it exists).
    #[arg(long, value_name = "NAME", conflicts_with = "baseline")]
    save_baseline: Option<String>,
    /// Compare with this named baseline and leave it as it is; benchmarks it lacks are
    /// reported as having no baseline.
    #[arg(long, value_name = "NAME")]
    baseline: Option<String>,
    /// criterion's quick mode: two samples per benchmark, a run in about two minutes;
    /// comparisons from it rarely reach significance.
    #[arg(long)]
    quick: bool,
    /// A change is called an improvement or a regression only when its whole confidence
    /// interval lies beyond this fraction (criterion's --noise-threshold).
    #[arg(long, value_name = "FRACTION", default_value_t = 0.01)]
    noise_threshold: f64,
    /// p-value below which a change counts as significant (criterion's
    /// --significance-level).
    #[arg(long, value_name = "P", default_value_t = 0.05)]
    significance_level: f64,
}

impl BenchKernels {
    pub fn run(self, sh: &Shell) -> Result<ExitCode> {
        let criterion_dir = criterion_dir()?;
        let filter = match &self.filter {
            Some(f) => format!("(?:{f})|^{BANDWIDTH_GROUP}/"),
            None => String::new(),
        };
        let baseline_name = self.baseline.clone().or_else(|| self.save_baseline.clone());
        let compared = baseline_name.clone().unwrap_or_else(|| DEFAULT_BASELINE.to_string());

        // The benchmarks this run should produce, and the baseline as it is before the run
        // (saving a baseline overwrites it).
        let filter_arg: Vec<&str> = if filter.is_empty() { vec![] } else { vec![filter.as_str()] };
        let listed =
            cmd!(sh, "cargo bench -p {BENCH_PACKAGE} --bench {BENCH_TARGET} -- --list {filter_arg...}")
                .read()
                .context("listing the kernel benchmarks")?;
        let expected = parse_list(&listed);
        if expected.is_empty() {
            anyhow::bail!(
                "no kernel benchmark matches the filter {:?}",
                self.filter.as_deref().unwrap_or("")
            );
        }
        let baseline = Snapshot::read(&criterion_dir, &compared, &expected)?;

        let start = run_started(&criterion_dir)?;
        let mut args: Vec<String> = Vec::new();
        if !filter.is_empty() {
            args.push(filter.clone());
        }
        if let Some(name) = &self.save_baseline {
            args.extend(["--save-baseline".into(), name.clone()]);
        }
        if let Some(name) = &self.baseline {
            args.extend(["--baseline-lenient".into(), name.clone()]);
        }
        if self.quick {
            args.push("--quick".into());
        }
        args.extend([
            "--noise-threshold".into(),
            self.noise_threshold.to_string(),
            "--significance-level".into(),
            self.significance_level.to_string(),
        ]);
        let bench_ok =
            cmd!(sh, "cargo bench -p {BENCH_PACKAGE} --bench {BENCH_TARGET} -- {args...}").run().is_ok();

        let rows = collect(&criterion_dir, &expected, &baseline, start)?;
        let machine = Machine::probe();
        let context = RunContext {
            date: chrono::Local::now().format("%Y-%m-%d %H:%M").to_string(),
            commit: machine::commit(&sh.current_dir()),
            host: machine.host.clone(),
            cpu: format!("{} ({} logical CPUs)", machine.cpu, machine.cpus),
            quick: self.quick,
            filter: self.filter.clone(),
            baseline: compared,
            baseline_named: baseline_name.is_some(),
            saved_as: self.save_baseline.clone(),
            noise_threshold: self.noise_threshold,
            significance_level: self.significance_level,
        };
        let report = render(&context, &rows);
        let path = criterion_dir.join(REPORT_FILE);
        std::fs::write(&path, &report).with_context(|| format!("writing {}", path.display()))?;
        println!("\n{report}");
        println!("report written to {}", path.display());
        if !bench_ok {
            eprintln!("error: the benchmark run failed; benchmarks without results are listed as not run");
            return Ok(ExitCode::FAILURE);
        }
        Ok(ExitCode::SUCCESS)
    }
}

/// criterion's output directory: `$CRITERION_HOME`, else `<cargo target dir>/criterion`.
fn criterion_dir() -> Result<PathBuf> {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return Ok(PathBuf::from(home));
    }
    let meta = cargo_metadata::MetadataCommand::new().no_deps().exec().context("running cargo metadata")?;
    Ok(meta.target_directory.into_std_path_buf().join("criterion"))
}

/// Ids from criterion's `--list` output (`<id>: benchmark` lines), in a stable order.
fn parse_list(out: &str) -> Vec<String> {
    let ids: BTreeSet<String> =
        out.lines().filter_map(|l| l.trim().strip_suffix(": benchmark")).map(str::to_string).collect();
    ids.into_iter().collect()
}

// ---------------------------------------------------------------------------------------
// criterion's files.

#[derive(Deserialize)]
struct BenchmarkFile {
    full_id: String,
    #[serde(default)]
    throughput: Option<ThroughputFile>,
}

#[derive(Deserialize)]
enum ThroughputFile {
    Bytes(u64),
    BytesDecimal(u64),
    #[serde(other)]
    Other,
}

#[derive(Clone, Deserialize)]
struct Interval {
    lower_bound: f64,
    upper_bound: f64,
}

#[derive(Clone, Deserialize)]
struct EstimateFile {
    confidence_interval: Interval,
    point_estimate: f64,
}

#[derive(Deserialize)]
struct EstimatesFile {
    mean: EstimateFile,
    #[serde(default)]
    slope: Option<EstimateFile>,
}

#[derive(Deserialize)]
struct ChangeFile {
    mean: EstimateFile,
}

#[derive(Deserialize)]
struct SampleFile {
    iters: Vec<f64>,
    times: Vec<f64>,
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Marks the start of a run with a file in `criterion_dir` and returns its modification
/// time. Results are told fresh by comparing their files' times with it: both come from
/// the filesystem's clock, which can lag `SystemTime::now()` by a tick, so a file written
/// just after `now()` could otherwise look older than the run.
fn run_started(criterion_dir: &Path) -> Result<SystemTime> {
    std::fs::create_dir_all(criterion_dir)
        .with_context(|| format!("creating {}", criterion_dir.display()))?;
    let marker = criterion_dir.join(".kiln-run-start");
    std::fs::write(&marker, b"").with_context(|| format!("writing {}", marker.display()))?;
    modified(&marker).with_context(|| format!("reading the time of {}", marker.display()))
}

/// Maps benchmark ids to their directories by reading every `<sub>/benchmark.json`.
fn id_dirs(criterion_dir: &Path, sub: &str) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![criterion_dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for e in entries.flatten() {
            let p = e.path();
            if !p.is_dir() {
                continue;
            }
            let file = p.join(sub).join("benchmark.json");
            if file.is_file() {
                if let Ok(b) = read_json::<BenchmarkFile>(&file) {
                    out.insert(b.full_id, p.clone());
                }
            } else {
                stack.push(p);
            }
        }
    }
    out
}

/// One set of results for a benchmark: time per iteration (criterion's typical estimate:
/// the slope when it has one, else the mean) with its interval, the per-iteration times of
/// every sample, and the bytes one iteration reads.
#[derive(Clone, Debug, PartialEq)]
struct Measured {
    ns: f64,
    ns_lo: f64,
    ns_hi: f64,
    samples: Vec<f64>,
    bytes: Option<u64>,
}

impl Measured {
    fn read(dir: &Path) -> Result<Measured> {
        let est: EstimatesFile = read_json(&dir.join("estimates.json"))?;
        let sample: SampleFile = read_json(&dir.join("sample.json"))?;
        let bench: BenchmarkFile = read_json(&dir.join("benchmark.json"))?;
        let typical = est.slope.unwrap_or(est.mean);
        let samples = sample.iters.iter().zip(&sample.times).map(|(i, t)| t / i).collect();
        let bytes = match bench.throughput {
            Some(ThroughputFile::Bytes(b) | ThroughputFile::BytesDecimal(b)) => Some(b),
            _ => None,
        };
        Ok(Measured {
            ns: typical.point_estimate,
            ns_lo: typical.confidence_interval.lower_bound,
            ns_hi: typical.confidence_interval.upper_bound,
            samples,
            bytes,
        })
    }

    /// Bytes per second of one iteration's bytes, 10^9 per GB.
    fn gb_s(&self) -> Option<f64> {
        self.bytes.map(|b| b as f64 / self.ns)
    }
}

/// The baseline's results as they were before the run.
struct Snapshot {
    results: BTreeMap<String, Measured>,
}

impl Snapshot {
    fn read(criterion_dir: &Path, name: &str, ids: &[String]) -> Result<Snapshot> {
        let dirs = id_dirs(criterion_dir, name);
        let mut results = BTreeMap::new();
        for id in ids {
            if let Some(dir) = dirs.get(id) {
                let m =
                    Measured::read(&dir.join(name)).with_context(|| format!("baseline {name} of {id}"))?;
                results.insert(id.clone(), m);
            }
        }
        Ok(Snapshot { results })
    }
}

/// A relative change of the mean (0.05 = 5% slower) with its interval.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Change {
    point: f64,
    lo: f64,
    hi: f64,
}

/// One line of the report.
#[derive(Clone, Debug, PartialEq)]
struct Row {
    id: String,
    current: Option<Measured>,
    baseline: Option<Measured>,
    change: Option<Change>,
}

/// The results of `ids` that this run produced (files newer than `start`), beside the
/// baseline snapshot.
fn collect(criterion_dir: &Path, ids: &[String], baseline: &Snapshot, start: SystemTime) -> Result<Vec<Row>> {
    let dirs = id_dirs(criterion_dir, "new");
    let fresh = |p: &Path| modified(p).is_some_and(|t| t >= start);
    let mut rows = Vec::new();
    for id in ids {
        let dir = dirs.get(id);
        let new_dir = dir.map(|d| d.join("new"));
        let current = match &new_dir {
            Some(n) if fresh(&n.join("estimates.json")) => {
                Some(Measured::read(n).with_context(|| format!("this run's results of {id}"))?)
            }
            _ => None,
        };
        let change = match dir.map(|d| d.join("change").join("estimates.json")) {
            Some(c) if current.is_some() && fresh(&c) => {
                let f: ChangeFile = read_json(&c)?;
                Some(Change {
                    point: f.mean.point_estimate,
                    lo: f.mean.confidence_interval.lower_bound,
                    hi: f.mean.confidence_interval.upper_bound,
                })
            }
            _ => None,
        };
        rows.push(Row { id: id.clone(), current, baseline: baseline.results.get(id).cloned(), change });
    }
    Ok(rows)
}

// ---------------------------------------------------------------------------------------
// The verdict.

/// What a row says about performance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Improved,
    Regressed,
    WithinNoise,
    NoChange,
    NoBaseline,
    NotRun,
}

impl Verdict {
    fn as_str(self) -> &'static str {
        match self {
            Verdict::Improved => "improved",
            Verdict::Regressed => "**regressed**",
            Verdict::WithinNoise => "within noise",
            Verdict::NoChange => "no change",
            Verdict::NoBaseline => "no baseline",
            Verdict::NotRun => "did not run",
        }
    }
}

/// criterion's rule: no change unless `p < significance`; then improved (regressed) only
/// when the whole interval of the change lies below `-noise` (above `+noise`).
fn verdict(row: &Row, noise: f64, significance: f64) -> (Verdict, Option<f64>) {
    let Some(current) = &row.current else { return (Verdict::NotRun, None) };
    let (Some(base), Some(change)) = (&row.baseline, row.change) else { return (Verdict::NoBaseline, None) };
    let p = welch_p(&current.samples, &base.samples);
    let v = match p {
        Some(p) if p < significance => {
            if change.lo < -noise && change.hi < -noise {
                Verdict::Improved
            } else if change.lo > noise && change.hi > noise {
                Verdict::Regressed
            } else {
                Verdict::WithinNoise
            }
        }
        _ => Verdict::NoChange,
    };
    (v, p)
}

/// Two-sided p-value of Welch's t-test between two samples; `None` when either has fewer
/// than two values or both have no spread.
fn welch_p(a: &[f64], b: &[f64]) -> Option<f64> {
    let stats = |s: &[f64]| {
        let n = s.len() as f64;
        let mean = s.iter().sum::<f64>() / n;
        let var = s.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
        (n, mean, var)
    };
    if a.len() < 2 || b.len() < 2 {
        return None;
    }
    let ((na, ma, va), (nb, mb, vb)) = (stats(a), stats(b));
    let se2 = va / na + vb / nb;
    if se2 <= 0.0 {
        return if ma == mb { Some(1.0) } else { Some(0.0) };
    }
    let t = (ma - mb) / se2.sqrt();
    let df = se2 * se2 / ((va / na).powi(2) / (na - 1.0) + (vb / nb).powi(2) / (nb - 1.0));
    Some(student_t_two_sided(t, df))
}

/// `P(|T| >= |t|)` for Student's t with `df` degrees of freedom:
/// the regularized incomplete beta `I_{df / (df + t^2)}(df / 2, 1 / 2)`.
fn student_t_two_sided(t: f64, df: f64) -> f64 {
    incomplete_beta(df / 2.0, 0.5, df / (df + t * t)).clamp(0.0, 1.0)
}

/// The regularized incomplete beta function `I_x(a, b)`, by its continued fraction
/// (modified Lentz), using the symmetry `I_x(a, b) = 1 - I_{1-x}(b, a)` where it converges
/// faster.
fn incomplete_beta(a: f64, b: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    let ln_front = ln_gamma(a + b) - ln_gamma(a) - ln_gamma(b) + a * x.ln() + b * (1.0 - x).ln();
    if x < (a + 1.0) / (a + b + 2.0) {
        ln_front.exp() * beta_fraction(a, b, x) / a
    } else {
        1.0 - ln_front.exp() * beta_fraction(b, a, 1.0 - x) / b
    }
}

fn beta_fraction(a: f64, b: f64, x: f64) -> f64 {
    const TINY: f64 = 1e-300;
    let mut c = 1.0;
    let mut d = 1.0 - (a + b) * x / (a + 1.0);
    if d.abs() < TINY {
        d = TINY;
    }
    d = 1.0 / d;
    let mut h = d;
    for m in 1..300 {
        let m = f64::from(m);
        let m2 = 2.0 * m;
        for num in [
            m * (b - m) * x / ((a + m2 - 1.0) * (a + m2)),
            -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1.0)),
        ] {
            d = 1.0 + num * d;
            if d.abs() < TINY {
                d = TINY;
            }
            c = 1.0 + num / c;
            if c.abs() < TINY {
                c = TINY;
            }
            d = 1.0 / d;
            h *= d * c;
        }
        if (d * c - 1.0).abs() < 1e-14 {
            break;
        }
    }
    h
}

/// `ln(Gamma(x))` for x > 0 (Lanczos, g = 7, n = 9; relative error below 1e-13).
fn ln_gamma(x: f64) -> f64 {
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // Reflection: Gamma(x) Gamma(1 - x) = pi / sin(pi x).
        return (std::f64::consts::PI / (std::f64::consts::PI * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let t = x + 7.5;
    let sum = C[1..].iter().enumerate().fold(C[0], |s, (i, c)| s + c / (x + i as f64 + 1.0));
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + sum.ln()
}

// ---------------------------------------------------------------------------------------
// The report.

/// Where and how the run happened.
struct RunContext {
    date: String,
    commit: String,
    host: String,
    cpu: String,
    quick: bool,
    filter: Option<String>,
    baseline: String,
    baseline_named: bool,
    saved_as: Option<String>,
    noise_threshold: f64,
    significance_level: f64,
}

/// A kernel benchmark id taken apart: `<kernel>/q<bits>_g<g>_n<N>_k<K>_m<M>/t<threads>`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct KernelId {
    kernel: String,
    bits: u32,
    n: usize,
    k: usize,
    m: usize,
    threads: usize,
}

fn parse_kernel_id(id: &str) -> Option<KernelId> {
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
fn bandwidth_threads(id: &str) -> Option<usize> {
    let rest = id.strip_prefix(BANDWIDTH_GROUP)?.strip_prefix('/')?;
    rest.rsplit('/').next()?.strip_prefix('t')?.parse().ok()
}

fn fmt_time(ns: f64) -> String {
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

fn fmt_pct(v: f64) -> String {
    format!("{:+.1}%", v * 100.0)
}

/// The markdown report.
fn render(ctx: &RunContext, rows: &[Row]) -> String {
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

    let _ =
        writeln!(w, "| benchmark | baseline | current | change (95% CI) | verdict | GB/s | % of read BW |");
    let _ = writeln!(w, "|---|---:|---:|---|---|---:|---:|");
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
            (Some(g), Some(bw)) if bandwidth_threads(&row.id).is_none() => format!("{:.0}%", 100.0 * g / bw),
            _ => "n/a".to_string(),
        };
        let gbs = gbs.map_or("n/a".to_string(), |g| format!("{g:.1}"));
        let _ =
            writeln!(w, "| `{}` | {base} | {current} | {change} | {} | {gbs} | {pct} |", row.id, v.as_str());
    }

    render_scaling(w, rows);

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
         bandwidth with the same thread count."
    );
    out
}

/// Time at M over time at M = 1 (`qmv`) for the same shape, width and threads: the batch
/// scaling of the vector kernels.
fn render_scaling(w: &mut String, rows: &[Row]) {
    let times: BTreeMap<KernelId, f64> =
        rows.iter().filter_map(|r| Some((parse_kernel_id(&r.id)?, r.current.as_ref()?.ns))).collect();
    // Keyed by the id with M set to 1: one line per kernel, width, shape and threads.
    let mut lines: BTreeMap<KernelId, BTreeMap<usize, f64>> = BTreeMap::new();
    for (id, &ns) in &times {
        if id.m < 2 {
            continue;
        }
        let one = KernelId { kernel: "qmv".into(), m: 1, ..id.clone() };
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

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, rel: &str, text: &str) {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    fn benchmark_json(id: &str, bytes: u64) -> String {
        let (group, rest) = id.split_once('/').unwrap();
        let (function, value) = rest.split_once('/').unwrap();
        format!(
            r#"{{"group_id":"{group}","function_id":"{function}","value_str":"{value}","throughput":{{"Bytes":{bytes}}},"full_id":"{id}","directory_name":"{id}","title":"{id}"}}"#
        )
    }

    fn estimates_json(mean: f64, lo: f64, hi: f64) -> String {
        let e = |p: f64, l: f64, h: f64| {
            format!(
                r#"{{"confidence_interval":{{"confidence_level":0.95,"lower_bound":{l},"upper_bound":{h}}},"point_estimate":{p},"standard_error":1.0}}"#
            )
        };
        format!(
            r#"{{"mean":{},"median":{},"median_abs_dev":{},"slope":null,"std_dev":{}}}"#,
            e(mean, lo, hi),
            e(mean, lo, hi),
            e(1.0, 0.5, 1.5),
            e(1.0, 0.5, 1.5)
        )
    }

    fn sample_json(per_iter: &[f64]) -> String {
        let iters: Vec<String> = per_iter.iter().map(|_| "2.0".to_string()).collect();
        let times: Vec<String> = per_iter.iter().map(|t| format!("{}", 2.0 * t)).collect();
        format!(r#"{{"sampling_mode":"Flat","iters":[{}],"times":[{}]}}"#, iters.join(","), times.join(","))
    }

    fn change_json(p: f64, lo: f64, hi: f64) -> String {
        let e = format!(
            r#"{{"confidence_interval":{{"confidence_level":0.95,"lower_bound":{lo},"upper_bound":{hi}}},"point_estimate":{p},"standard_error":0.01}}"#
        );
        format!(r#"{{"mean":{e},"median":{e}}}"#)
    }

    fn results(dir: &Path, id: &str, sub: &str, bytes: u64, per_iter: &[f64]) {
        let mean = per_iter.iter().sum::<f64>() / per_iter.len() as f64;
        write(dir, &format!("{id}/{sub}/benchmark.json"), &benchmark_json(id, bytes));
        write(dir, &format!("{id}/{sub}/estimates.json"), &estimates_json(mean, mean * 0.99, mean * 1.01));
        write(dir, &format!("{id}/{sub}/sample.json"), &sample_json(per_iter));
    }

    #[test]
    fn welch_matches_known_values() {
        // t = 2.228 with 10 degrees of freedom is the two-sided 5% point.
        assert!((student_t_two_sided(2.228, 10.0) - 0.05).abs() < 1e-3);
        assert!((student_t_two_sided(0.0, 7.0) - 1.0).abs() < 1e-12);
        assert!(student_t_two_sided(40.0, 18.0) < 1e-15);
        // Identical samples: no evidence of a difference.
        let a = [1.0, 2.0, 3.0, 4.0];
        assert!((welch_p(&a, &a).unwrap() - 1.0).abs() < 1e-12);
        assert_eq!(welch_p(&[1.0], &a), None);
        // Well separated samples: t = 11.6 with about 3 degrees of freedom, p = 0.0014.
        let p = welch_p(&[10.0, 10.1, 9.9, 10.05], &a).unwrap();
        assert!((0.0005..0.005).contains(&p), "{p}");
        assert!((ln_gamma(5.0) - 24f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn ids_parse_and_list_lines_are_read() {
        let k = parse_kernel_id("qmv_wide/q4_g64_n14336_k4096_m8/t2").unwrap();
        assert_eq!((k.kernel.as_str(), k.bits, k.n, k.k, k.m, k.threads), ("qmv_wide", 4, 14336, 4096, 8, 2));
        assert_eq!(parse_kernel_id("read_bandwidth/sum_1024MiB/t1"), None);
        assert_eq!(bandwidth_threads("read_bandwidth/sum_1024MiB/t1"), Some(1));
        assert_eq!(bandwidth_threads("read_bandwidth/sum_1024MiB_end/t2"), Some(2));
        let listed =
            "read_bandwidth/sum_1024MiB/t1: benchmark\n\nqmv/q4_g64_n896_k4864_m1/t1: benchmark\nnoise\n";
        assert_eq!(parse_list(listed), vec!["qmv/q4_g64_n896_k4864_m1/t1", "read_bandwidth/sum_1024MiB/t1"]);
    }

    #[test]
    fn report_reads_criterion_files_and_says_what_is_missing() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let bw = "read_bandwidth/sum_1024MiB_start/t1";
        let bw_end = "read_bandwidth/sum_1024MiB_end/t1";
        let qmv = "qmv/q4_g64_n4096_k4096_m1/t1";
        let wide = "qmv_wide/q4_g64_n4096_k4096_m8/t1";
        let fresh_only = "qmv/q8_g64_n4096_k4096_m1/t1";
        let gone = "qmm/q4_g64_n4096_k4096_m16/t1";
        // A baseline saved earlier, and a stale change file that must be ignored.
        results(dir, qmv, "main", 9_437_184, &[1.0e6, 1.01e6, 0.99e6, 1.0e6]);
        results(dir, wide, "main", 9_437_184, &[2.0e6, 2.02e6, 1.98e6, 2.0e6]);
        results(dir, gone, "main", 9_437_184, &[3.0e6, 3.0e6]);
        write(dir, &format!("{fresh_only}/change/estimates.json"), &change_json(0.5, 0.4, 0.6));
        let ids: Vec<String> =
            [bw, bw_end, qmv, wide, fresh_only, gone].iter().map(|s| s.to_string()).collect();
        let snapshot = Snapshot::read(dir, "main", &ids).unwrap();
        assert_eq!(snapshot.results.len(), 3);

        // The stale files above are older than the run by more than a filesystem tick.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let start = run_started(dir).unwrap();
        // This run: bandwidth 20 GB/s (1 GiB... here 1e9 bytes in 50 ms), qmv 25% faster,
        // qmv_wide unchanged, one benchmark with no baseline, one that did not run.
        results(dir, bw, "new", 1_000_000_000, &[50.0e6, 50.2e6, 49.8e6, 50.0e6]);
        // Measured again at the end under someone else's load: the limit stays 20 GB/s.
        results(dir, bw_end, "new", 1_000_000_000, &[80.0e6, 80.0e6, 80.0e6]);
        results(dir, qmv, "new", 9_437_184, &[0.75e6, 0.76e6, 0.74e6, 0.75e6]);
        write(dir, &format!("{qmv}/change/estimates.json"), &change_json(-0.25, -0.27, -0.23));
        results(dir, wide, "new", 9_437_184, &[2.0e6, 2.03e6, 1.97e6, 2.0e6]);
        write(dir, &format!("{wide}/change/estimates.json"), &change_json(0.001, -0.01, 0.012));
        results(dir, fresh_only, "new", 18_874_368, &[1.5e6, 1.5e6, 1.5e6]);

        let rows = collect(dir, &ids, &snapshot, start).unwrap();
        let by_id: BTreeMap<&str, &Row> = rows.iter().map(|r| (r.id.as_str(), r)).collect();
        assert_eq!(verdict(by_id[qmv], 0.01, 0.05).0, Verdict::Improved);
        assert_eq!(verdict(by_id[wide], 0.01, 0.05).0, Verdict::NoChange);
        assert_eq!(verdict(by_id[fresh_only], 0.01, 0.05).0, Verdict::NoBaseline);
        assert_eq!(by_id[fresh_only].change, None, "a change file older than the run is stale");
        assert_eq!(verdict(by_id[gone], 0.01, 0.05).0, Verdict::NotRun);

        let ctx = RunContext {
            date: "2026-11-30 12:00".into(),
            commit: "abc1234".into(),
            host: "devbox".into(),
            cpu: "AMD EPYC (2 logical CPUs)".into(),
            quick: false,
            filter: Some("n4096_k4096".into()),
            baseline: "main".into(),
            baseline_named: true,
            saved_as: None,
            noise_threshold: 0.01,
            significance_level: 0.05,
        };
        let md = render(&ctx, &rows);
        assert!(md.contains("the start and the end): 20.0 GB/s with 1 thread(s)"), "{md}");
        // qmv: 9437184 bytes in 0.75 ms = 12.6 GB/s, 63% of 20 GB/s.
        let qmv_line = md.lines().find(|l| l.contains(qmv)).unwrap();
        assert!(qmv_line.contains("| 1.000 ms |") && qmv_line.contains("| 750.00 µs ["), "{qmv_line}");
        assert!(
            qmv_line.contains("-25.0% [-27.0%, -23.0%]") && qmv_line.contains("| improved |"),
            "{qmv_line}"
        );
        assert!(qmv_line.contains("| 12.6 | 63% |"), "{qmv_line}");
        let gone_line = md.lines().find(|l| l.contains(gone)).unwrap();
        assert!(gone_line.contains("did not run") && !gone_line.contains("| 0"), "{gone_line}");
        assert!(md.lines().find(|l| l.contains(fresh_only)).unwrap().contains("| none |"));
        assert!(md.contains("**1 benchmark(s) did not run**"));
        // Batch scaling: 2.0 ms / 0.75 ms.
        assert!(md.contains("| qmv_wide | 4 | n4096_k4096 | 1 | 2.67x |"), "{md}");
    }

    #[test]
    fn a_run_without_bandwidth_says_so() {
        let ctx = RunContext {
            date: "d".into(),
            commit: "c".into(),
            host: "h".into(),
            cpu: "cpu".into(),
            quick: true,
            filter: None,
            baseline: "base".into(),
            baseline_named: false,
            saved_as: Some("x".into()),
            noise_threshold: 0.02,
            significance_level: 0.05,
        };
        let row = Row {
            id: "qmv/q4_g64_n896_k4864_m1/t2".into(),
            current: Some(Measured {
                ns: 1e5,
                ns_lo: 0.9e5,
                ns_hi: 1.1e5,
                samples: vec![1e5, 1e5],
                bytes: Some(1_000_000),
            }),
            baseline: None,
            change: None,
        };
        let md = render(&ctx, &[row]);
        assert!(md.contains("**not measured in this run**"), "{md}");
        assert!(md.contains("| no baseline | 10.0 | n/a |"), "{md}");
        assert!(md.contains("`base` (the previous run)") && md.contains("results saved as `x`"), "{md}");
    }
}
