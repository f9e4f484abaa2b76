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
//!
//! `--compare REV` measures both trees in one run instead (`compare`), judges each
//! benchmark's B/A ratio once as a reading at the margin (`sheet`), and writes that sheet
//! as `readings.json` beside the report; `--pr-comment` prints the pull request's comment
//! from it (`comment`).
//!
//! This module runs criterion; `files` reads what it leaves, `stats` judges a change, and
//! `render` writes the report.

mod comment;
mod compare;
mod files;
mod plot;
mod render;
mod roofs;
mod sheet;
mod stats;
mod target;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

use anyhow::{Context, Result};
use xshell::Shell;

use self::files::{Snapshot, collect, run_started};
use self::render::{RunContext, render};
use self::target::{BENCH_PACKAGE, BENCH_TARGET, CARGO_GRACE, parse_list, with_roofs};
use crate::child::{self, Shutdown, Waited};
use crate::machine::{self, Machine};
use crate::verdict::reading::DEFAULT_MARGIN_PCT;
use crate::verdict::sheet::Sheet;

/// The baseline criterion compares with, and saves, when none is named.
const DEFAULT_BASELINE: &str = "base";
/// Where the report is written, under criterion's output directory.
const REPORT_FILE: &str = "kiln-kernels-report.md";
/// criterion's `--noise-threshold` when none is given.
const DEFAULT_NOISE_THRESHOLD: f64 = 0.01;

/// Flags of `cargo xtask bench-kernels`.
#[derive(clap::Args)]
// The shared sequential flags, worded for rounds of this comparison.
#[command(mut_arg("until_ci", |a| a.help(
    "With --compare: keep adding rounds to each benchmark after its --rounds until the 95% \
     interval of its B/A ratio has a half-width under PCT percent, or a budget ends it \
     (--max-pairs, --max-time). The intervals are then a confidence sequence's, valid however \
     the run stops"
)))]
#[command(mut_arg("max_pairs", |a| a.help("With --until-ci: at most N rounds per benchmark [default: 40; none with --max-time, which is then the budget]")))]
#[command(mut_arg("max_time", |a| a.help(
    "With --until-ci: start no new round that would end after this long from the start of the \
     first benchmark's rounds (such as 90s, 20m, 1h; a bare number is seconds)"
)))]
#[command(mut_arg("margin", |a| a.help(
    "With --compare: the verdict's margin, in percent [default: 5, or --noise-threshold]. A \
     benchmark is `same` only when the whole 95% interval of its B/A time ratio lies within \
     ±PCT, `regressed` or `improved` only when it lies wholly beyond, else `undecided` with \
     about how many more rounds (and how long) would likely settle it. With --until-ci the \
     run also stops adding rounds to a benchmark once it is decided"
)))]
pub struct BenchKernels {
    /// Run only the benchmarks whose id matches this regular expression (criterion's
    /// filter); the read-bandwidth and compute-roof benchmarks always run too.
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
    /// Without --compare: criterion's --noise-threshold, a change is improved or regressed
    /// only when its whole confidence interval lies beyond this fraction [default: 0.01].
    /// With --compare and no --margin: the verdict's margin as a fraction (0.05 is ±5%).
    #[arg(long, value_name = "FRACTION", value_parser = fraction_arg)]
    noise_threshold: Option<f64>,
    /// Without --compare: the p-value below which a change counts as significant
    /// (criterion's --significance-level).
    #[arg(long, value_name = "P", default_value_t = 0.05)]
    significance_level: f64,
    /// Compare with revision REV in this run: build its benches in a git worktree under
    /// the target directory and run both trees' benchmarks interleaved (A B, B A, ...);
    /// the report's verdicts come from these pairs.
    #[arg(long, value_name = "REV", conflicts_with_all = ["baseline", "save_baseline"])]
    compare: Option<String>,
    /// Rounds (pairs) per benchmark for --compare (with --until-ci: the first rounds,
    /// before the sequential rule may stop).
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u64).range(2..))]
    rounds: u64,
    /// For --compare: the sequential rule, its budgets and the verdict's margin.
    #[command(flatten)]
    seq: crate::verdict::SequentialFlags,
    /// Print the pull request's comment on the last --compare (from `readings.json` and
    /// the report in criterion's directory) and exit; runs nothing.
    #[arg(long, conflicts_with_all = ["compare", "baseline", "save_baseline", "filter", "quick"])]
    pr_comment: bool,
    /// With --pr-comment: the CI run to link to.
    #[arg(long, value_name = "URL", requires = "pr_comment")]
    run_url: Option<String>,
}

/// A fraction: a finite number above 0 and below 1.
fn fraction_arg(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v < 1.0 => Ok(v),
        _ => Err(format!("{s:?}: expected a fraction above 0 and below 1, such as 0.01")),
    }
}

impl BenchKernels {
    pub fn run(self, sh: &Shell) -> Result<ExitCode> {
        if self.compare.is_none() && (self.seq.until_ci.is_some() || self.seq.margin.is_some()) {
            crate::console::usage!(
                "--until-ci and --margin judge interleaved pairs: they need --compare REV"
            );
        }
        let criterion_dir = criterion_dir()?;
        if self.pr_comment {
            return pr_comment(&criterion_dir, self.run_url.as_deref());
        }
        // Every cargo and criterion child runs in its own process group under the one
        // shutdown point: a signal stops the group (cargo and what it started, or the bench
        // binary) and exits 128 + signal.
        let shutdown = Shutdown::install()?;
        if let Some(rev) = &self.compare {
            let target_dir =
                criterion_dir.parent().map(PathBuf::from).unwrap_or_else(|| PathBuf::from("target"));
            // The read bandwidth is measured in the same comparison, so each side's GB/s
            // has its share of what the machine gave that side.
            let filter = self.filter.as_deref().map(with_roofs);
            // A comparison that ends early leaves no earlier one's files to be commented on.
            for stale in [REPORT_FILE, crate::verdict::reading::FILE] {
                let path = criterion_dir.join(stale);
                match std::fs::remove_file(&path) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        return Err(e).with_context(|| format!("removing {}", path.display()));
                    }
                    _ => {}
                }
            }
            let margin_pct =
                self.seq.margin.or(self.noise_threshold.map(|f| f * 100.0)).unwrap_or(DEFAULT_MARGIN_PCT);
            let found = match compare::run(
                &sh.current_dir(),
                &target_dir,
                &compare::CompareRun {
                    rev,
                    filter: filter.as_deref(),
                    rounds: self.rounds as usize,
                    quick: self.quick,
                    margin_pct,
                    seq: &self.seq,
                },
                &shutdown,
            )? {
                compare::Step::Done(found) => found,
                compare::Step::Signal(sig, what) => return Ok(interrupted(sig, &what)),
            };
            let machine = Machine::probe();
            let report = format!(
                "## Kernel benchmarks, {}\n\ncommit `{}` · host `{}` · {} ({} logical CPUs)\n\n{section}",
                chrono::Local::now().format("%Y-%m-%d %H:%M"),
                machine::commit(&sh.current_dir()),
                machine.host,
                machine.cpu,
                machine.cpus,
                section = found.section
            );
            let path = criterion_dir.join(REPORT_FILE);
            std::fs::create_dir_all(&criterion_dir)
                .with_context(|| format!("creating {}", criterion_dir.display()))?;
            std::fs::write(&path, &report).with_context(|| format!("writing {}", path.display()))?;
            found.sheet.write(&criterion_dir)?;
            println!("\n{report}");
            println!(
                "report written to {}, its readings to {}",
                path.display(),
                criterion_dir.join(crate::verdict::reading::FILE).display()
            );
            return Ok(ExitCode::SUCCESS);
        }
        let filter = match &self.filter {
            Some(f) => with_roofs(f),
            None => String::new(),
        };
        let baseline_name = self.baseline.clone().or_else(|| self.save_baseline.clone());
        let compared = baseline_name.clone().unwrap_or_else(|| DEFAULT_BASELINE.to_string());

        // The benchmarks this run should produce, and the baseline as it is before the run
        // (saving a baseline overwrites it).
        let mut list_cmd = cargo_bench(sh);
        list_cmd.arg("--list").args((!filter.is_empty()).then_some(&filter));
        let listed = match child::capture(&mut list_cmd, &shutdown, CARGO_GRACE)
            .context("listing the kernel benchmarks")?
        {
            (Waited::Exited(st), out) if st.success() => String::from_utf8_lossy(&out).into_owned(),
            (Waited::Exited(st), _) => anyhow::bail!("listing the kernel benchmarks failed ({st})"),
            (Waited::Interrupted(sig), _) => return Ok(interrupted(sig, "listing the kernel benchmarks")),
            (Waited::TimedOut, _) => anyhow::bail!("listing the kernel benchmarks timed out"),
        };
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
            self.noise_threshold.unwrap_or(DEFAULT_NOISE_THRESHOLD).to_string(),
            "--significance-level".into(),
            self.significance_level.to_string(),
        ]);
        let mut bench_cmd = cargo_bench(sh);
        bench_cmd.args(&args);
        let bench = child::spawn(&mut bench_cmd).context("starting cargo bench")?;
        let bench_ok = match bench.wait(&shutdown, None, CARGO_GRACE)? {
            Waited::Exited(st) => st.success(),
            Waited::Interrupted(sig) => return Ok(interrupted(sig, "the benchmark run")),
            Waited::TimedOut => false,
        };

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
            noise_threshold: self.noise_threshold.unwrap_or(DEFAULT_NOISE_THRESHOLD),
            significance_level: self.significance_level,
        };
        let roofline = roofs::roofline(&rows);
        let report = render(&context, &rows, &roofline);
        let path = criterion_dir.join(REPORT_FILE);
        std::fs::write(&path, &report).with_context(|| format!("writing {}", path.display()))?;
        println!("\n{report}");
        println!("report written to {}", path.display());
        let roof_dir = criterion_dir.join(roofs::ROOFLINE_DIR);
        let sheet = roofs::sheet(&roofline, &format!("commit {}, host {}", context.commit, context.host));
        match write_roofline(sh, &roof_dir, &sheet) {
            Ok(page) => println!(
                "roofline: {} and {}",
                roof_dir.join(crate::verdict::reading::FILE).display(),
                page.display()
            ),
            Err(e) => eprintln!("warning: no roofline page: {e:#}"),
        }
        let svg = path.with_extension("svg");
        match crate::plot::write_svg(&svg, &plot::panels(&rows)) {
            Ok(_) => println!("plot written to {}", svg.display()),
            Err(e) => eprintln!("warning: no plot beside the report: {e:#}"),
        }
        if !bench_ok {
            eprintln!("error: the benchmark run failed; benchmarks without results are listed as not run");
            return Ok(ExitCode::FAILURE);
        }
        Ok(ExitCode::SUCCESS)
    }
}

/// Writes the roofline's sheet (`readings.json`), the run's fingerprint (`env.json`) and
/// report.html into `dir`, a run directory `cargo xtask report` reads again; returns the
/// page's path.
fn write_roofline(sh: &Shell, dir: &std::path::Path, sheet: &Sheet) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    sheet.write(dir)?;
    crate::run_dir::write_env_json(dir, &crate::run_dir::fingerprint(&sh.current_dir(), None).0)?;
    crate::report::write(dir)
}

/// Prints the pull request's comment on the comparison whose files are in `criterion_dir`
/// (a run that left none gets a comment saying so).
fn pr_comment(criterion_dir: &std::path::Path, run_url: Option<&str>) -> Result<ExitCode> {
    let sheet = Sheet::read(criterion_dir)?;
    let report = crate::fsx::read_text_if_any(&criterion_dir.join(REPORT_FILE), 64 << 20)?;
    print!("{}", comment::body(sheet.as_ref(), report.as_deref(), run_url));
    Ok(ExitCode::SUCCESS)
}

/// `cargo bench -p kiln-benches --bench kernels --` in the workspace, with the cargo
/// that runs xtask (`$CARGO`), else the one on the PATH; the caller adds criterion's
/// arguments.
fn cargo_bench(sh: &Shell) -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"));
    let mut cmd = Command::new(cargo);
    cmd.current_dir(sh.current_dir()).args(["bench", "-p", BENCH_PACKAGE, "--bench", BENCH_TARGET, "--"]);
    cmd
}

/// The exit for a signal that stopped `what`: its group is already stopped and reaped.
fn interrupted(sig: i32, what: &str) -> ExitCode {
    eprintln!("interrupted by {} during {what}: its process group was stopped", child::signal_name(sig));
    ExitCode::from(child::exit_code_for(sig))
}

/// criterion's output directory: `$CRITERION_HOME`, else `<cargo target dir>/criterion`.
fn criterion_dir() -> Result<PathBuf> {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return Ok(PathBuf::from(home));
    }
    let meta = cargo_metadata::MetadataCommand::new().no_deps().exec().context("running cargo metadata")?;
    Ok(meta.target_directory.into_std_path_buf().join("criterion"))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;

    use super::files::*;
    use super::render::*;
    use super::stats::*;
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
        assert!((crate::verdict::student_t::two_sided_p(2.228, 10.0) - 0.05).abs() < 1e-3);
        assert!((crate::verdict::student_t::two_sided_p(0.0, 7.0) - 1.0).abs() < 1e-12);
        assert!(crate::verdict::student_t::two_sided_p(40.0, 18.0) < 1e-15);
        // Identical samples: no evidence of a difference.
        let a = [1.0, 2.0, 3.0, 4.0];
        assert!((welch_p(&a, &a).unwrap() - 1.0).abs() < 1e-12);
        assert_eq!(welch_p(&[1.0], &a), None);
        // Well separated samples: t = 11.6 with about 3 degrees of freedom, p = 0.0014.
        let p = welch_p(&[10.0, 10.1, 9.9, 10.05], &a).unwrap();
        assert!((0.0005..0.005).contains(&p), "{p}");
        assert!((crate::verdict::student_t::ln_gamma(5.0) - 24f64.ln()).abs() < 1e-12);
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
        let roof = "compute_roof/int8_avx512_vnni/t1";
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
            [bw, bw_end, roof, qmv, wide, fresh_only, gone].iter().map(|s| s.to_string()).collect();
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
        // A compute roof of 0.7 TOPS: 700 000 operations (criterion's elements) in 1 µs.
        results(dir, roof, "new", 0, &[1.0e3, 1.0e3]);
        write(
            dir,
            &format!("{roof}/new/benchmark.json"),
            &benchmark_json(roof, 0)
                .replace(r#""throughput":{"Bytes":0}"#, r#""throughput":{"Elements":700000}"#),
        );
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
        let md = render(&ctx, &rows, &roofs::roofline(&rows));
        assert!(md.contains("the start and the end): 20.0 GB/s with 1 thread(s)"), "{md}");
        // qmv: 9437184 bytes in 0.75 ms = 12.6 GB/s, 63% of 20 GB/s.
        let qmv_line = md.lines().find(|l| l.contains(qmv)).unwrap();
        assert!(qmv_line.contains("| 1.000 ms |") && qmv_line.contains("| 750.00 µs ["), "{qmv_line}");
        assert!(
            qmv_line.contains("-25.0% [-27.0%, -23.0%]") && qmv_line.contains("| improved |"),
            "{qmv_line}"
        );
        assert!(qmv_line.contains("| 12.6 | 63% |"), "{qmv_line}");
        // 2 * 4096 * 4096 operations over 9437184 bytes: 3.6 per byte, far below the ridge
        // of 0.7 TOPS over 20 GB/s (35 per byte): the bandwidth bounds it, at 63%.
        assert!(qmv_line.ends_with("| bandwidth, 63% |"), "{qmv_line}");
        assert!(
            md.contains("700.0 GOPS (int8_avx512_vnni) with 1 thread(s), ridge at 35.0 ops/byte"),
            "{md}"
        );
        let roof_line = md.lines().find(|l| l.contains(roof)).unwrap();
        assert!(roof_line.ends_with("| the roof: 700.0 GOPS |"), "{roof_line}");
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
                ops: None,
            }),
            baseline: None,
            change: None,
        };
        let rows = [row];
        let md = render(&ctx, &rows, &roofs::roofline(&rows));
        assert!(md.contains("**not measured in this run**"), "{md}");
        assert!(md.contains("Compute roofs: **not measured in this run**"), "{md}");
        assert!(md.contains("| no baseline | 10.0 | n/a |"), "{md}");
        assert!(md.contains("`base` (the previous run)") && md.contains("results saved as `x`"), "{md}");
    }

    #[test]
    fn a_share_of_the_read_bandwidth_over_100_percent_is_flagged() {
        // 28 GB/s against a bandwidth reading of 20 GB/s: printed bare, "140%" reads as a
        // share the kernel cannot have; the reading met load.
        assert_eq!(
            share_of_bandwidth(28.0, 20.0),
            "140% (over 100%: the read bandwidth measured low, not a share)"
        );
        assert_eq!(share_of_bandwidth(12.6, 20.0), "63%");
    }

    #[test]
    fn schemes_show_side_by_side() {
        let row = |id: &str, ns: f64| Row {
            id: id.into(),
            current: Some(Measured { ns, ns_lo: ns, ns_hi: ns, samples: vec![ns], bytes: None, ops: None }),
            baseline: None,
            change: None,
        };
        let rows = [
            row("qmv/q4_g64_n896_k4864_m1/t2", 1.05e5),
            row("qmv_int8/q4_g64_n896_k4864_m1/t2", 1e5),
            row("qmv_wide_int8/q4_g64_n896_k4864_m8/t2", 3e5),
        ];
        let mut md = String::new();
        render_schemes(&mut md, &rows);
        assert!(md.contains("| qmv | 4 | n896_k4864 | 1 | 2 | 105.0 us | 100.0 us | 1.050 |"), "{md}");
        // A scheme without its partner has no line.
        assert!(!md.contains("| qmv_wide |"), "{md}");
        let mut md = String::new();
        render_scaling(&mut md, &rows);
        // The int8 kernels scale against the int8 qmv.
        assert!(md.contains("| qmv_wide_int8 | 4 | n896_k4864 | 2 | 3.00x |"), "{md}");
    }
}
