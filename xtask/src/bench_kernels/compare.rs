//! `cargo xtask bench-kernels --compare REV`: the kernel benchmarks of REV against those
//! of the working tree, measured in the same run and interleaved, so a change is never
//! judged against numbers taken under another load.
//!
//! REV is checked out as a detached git worktree under `target/bench-compare/<sha>`, its
//! bench binary built (with the workspace's target directory, so deps are shared) and
//! copied aside (`target/bench-compare/kernels-<sha>`: with the same dependency graph
//! cargo names both trees' `kernels` binaries alike), and the worktree removed again;
//! then the working tree's is built. Each
//! benchmark then runs as rounds of one A (REV) and one B (working tree) run, alternating
//! which goes first (A B, B A, A B, ...: ABBA), each run a fresh criterion process with
//! its own output directory. Every round gives one pair; the change is the geometric
//! mean of the pairs' B/A time ratios with its 95% interval (Student's t on the log
//! ratios), and the verdict is "regressed" or "improved" only when the whole interval
//! lies beyond the noise threshold.
//!
//! The builds, listings and criterion runs are children of the one shutdown point, each in
//! a process group of its own: a signal stops the running one whole (cargo and every rustc
//! it started, or the bench binary) and ends the comparison, REV's worktree removed.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, Result, bail};

use super::files::{BenchmarkFile, EstimatesFile, ThroughputFile, read_json};
use super::render::{bandwidth_threads, fmt_time, parse_kernel_id};
use super::{BENCH_PACKAGE, BENCH_TARGET, CARGO_GRACE};
use crate::child::{self, Shutdown, Waited};
use crate::student_t::{self, Interval};
use crate::verdict::equivalence::{self, Equivalence};
use crate::verdict::sequence::{self, Stopped};

/// How a step of the comparison ended: its value, or the signal that stopped its child
/// (the child's group is stopped and reaped) with what that child was doing.
pub(super) enum Step<T> {
    Done(T),
    Signal(i32, String),
}

/// The value of a step; a signal that stopped it is returned from the enclosing function
/// (which returns `Result<Step<_>>`).
macro_rules! done {
    ($step:expr) => {
        match $step {
            Step::Done(v) => v,
            Step::Signal(sig, what) => return Ok(Step::Signal(sig, what)),
        }
    };
}

/// Runs `cmd` (doing `what`) under `shutdown` with its standard output captured, and its
/// standard error too when `stderr` is set; a timeout cannot happen, there is none.
fn run_child(cmd: &mut Command, shutdown: &Shutdown, what: String, stderr: bool) -> Result<Step<Output>> {
    let (waited, stdout, stderr) = if stderr {
        child::capture_both(cmd, shutdown, CARGO_GRACE)
    } else {
        child::capture(cmd, shutdown, CARGO_GRACE).map(|(w, out)| (w, out, Vec::new()))
    }
    .with_context(|| what.clone())?;
    match waited {
        Waited::Exited(status) => Ok(Step::Done(Output { status, stdout, stderr })),
        Waited::Interrupted(sig) => Ok(Step::Signal(sig, what)),
        Waited::TimedOut => bail!("{what}: timed out"),
    }
}

/// Which tree a run measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Side {
    /// REV.
    A,
    /// The working tree.
    B,
}

/// The run order of `rounds` rounds: A B, then B A, alternating.
pub(super) fn order(rounds: usize) -> Vec<Side> {
    (0..rounds).flat_map(|r| if r % 2 == 0 { [Side::A, Side::B] } else { [Side::B, Side::A] }).collect()
}

/// What a paired comparison says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    Improved,
    Regressed,
    WithinNoise,
    TooFewPairs,
}

impl Verdict {
    fn as_str(self) -> &'static str {
        match self {
            Verdict::Improved => "improved",
            Verdict::Regressed => "**regressed**",
            Verdict::WithinNoise => "within noise",
            Verdict::TooFewPairs => "too few pairs",
        }
    }
}

/// The verdict on B/A time ratios: regressed (slower) only when the whole interval lies
/// above `1 + noise`, improved only when it lies below `1 - noise`.
pub(super) fn judge(ratio: Option<Interval>, noise: f64) -> Verdict {
    match ratio.and_then(|r| r.ci95) {
        None => Verdict::TooFewPairs,
        Some((lo, _)) if lo > 1.0 + noise => Verdict::Regressed,
        Some((_, hi)) if hi < 1.0 - noise => Verdict::Improved,
        Some(_) => Verdict::WithinNoise,
    }
}

/// The `kernels` bench executable among cargo's `--message-format json` lines.
pub(super) fn bench_executable(json_lines: &str) -> Option<PathBuf> {
    json_lines.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()).find_map(|v| {
        let is_it = v["reason"] == "compiler-artifact"
            && v["target"]["name"] == BENCH_TARGET
            && v["target"]["kind"].as_array().is_some_and(|k| k.iter().any(|x| x == "bench"));
        is_it.then(|| v["executable"].as_str().map(PathBuf::from)).flatten()
    })
}

/// Builds the bench binary of the tree at `dir` with `target_dir`; returns its path.
fn build(dir: &Path, target_dir: &Path, shutdown: &Shutdown) -> Result<Step<PathBuf>> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    eprintln!("building the kernel benches in {}", dir.display());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(dir)
        .env("CARGO_TARGET_DIR", target_dir)
        .args(["bench", "-p", BENCH_PACKAGE, "--bench", BENCH_TARGET, "--no-run", "--message-format", "json"])
        .stderr(std::process::Stdio::inherit());
    let what = format!("building the kernel benches in {}", dir.display());
    let out = done!(run_child(&mut cmd, shutdown, what, false)?);
    if !out.status.success() {
        bail!("building the kernel benches in {} failed ({})", dir.display(), out.status);
    }
    bench_executable(&String::from_utf8_lossy(&out.stdout))
        .map(Step::Done)
        .with_context(|| format!("cargo built no {BENCH_TARGET} bench executable in {}", dir.display()))
}

/// A copy of REV's bench executable `bin` in `dir`, named for `tag`. Both trees build into
/// one target directory, and when their dependency graphs are the same cargo gives both
/// `kernels` executables one name: the working tree's build then replaced REV's, and every
/// pair compared the working tree with itself.
fn keep_copy(bin: &Path, dir: &Path, tag: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let kept = dir.join(format!("kernels-{tag}"));
    std::fs::copy(bin, &kept).with_context(|| format!("copying {} to {}", bin.display(), kept.display()))?;
    Ok(kept)
}

/// A detached worktree of `rev` under `<target>/bench-compare/<sha>`.
fn worktree(root: &Path, target_dir: &Path, rev: &str) -> Result<(PathBuf, String)> {
    let git = |args: &[&str]| -> Result<String> {
        let out = Command::new("git").current_dir(root).args(args).output().context("running git")?;
        if !out.status.success() {
            bail!("git {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let sha = match git(&["rev-parse", "--verify", &format!("{rev}^{{commit}}")]) {
        Ok(s) => s,
        Err(e) => {
            crate::console::usage!("--compare {rev}: not a commit ({e:#}): expected a revision git knows")
        }
    };
    let dir = target_dir.join("bench-compare").join(&sha[..12]);
    if !dir.join("Cargo.toml").is_file() {
        let _ = git(&["worktree", "prune"]);
        git(&["worktree", "add", "--detach", &dir.display().to_string(), &sha])?;
    }
    Ok((dir, sha))
}

/// The benchmark ids a bench binary lists for `filter`.
fn list(bin: &Path, filter: Option<&str>, shutdown: &Shutdown) -> Result<Step<Vec<String>>> {
    let mut cmd = Command::new(bin);
    cmd.args(["--bench", "--list"]);
    cmd.args(filter);
    let what = format!("listing the benchmarks of {}", bin.display());
    let out = done!(run_child(&mut cmd, shutdown, what, false)?);
    Ok(Step::Done(super::parse_list(&String::from_utf8_lossy(&out.stdout))))
}

/// Mean time per iteration of one fresh criterion run of benchmark `id`, and the bytes
/// one iteration reads (its declared throughput), when it declares them.
fn measure(
    bin: &Path,
    id: &str,
    home: &Path,
    quick: bool,
    shutdown: &Shutdown,
) -> Result<Step<(f64, Option<u64>)>> {
    let _ = std::fs::remove_dir_all(home);
    let pattern = format!("^{}$", regex_escape(id));
    let mut cmd = Command::new(bin);
    cmd.env("CRITERION_HOME", home).args(["--bench", &pattern, "--noplot"]);
    if quick {
        cmd.arg("--quick");
    } else {
        cmd.args(["--sample-size", "10", "--warm-up-time", "1", "--measurement-time", "3"]);
    }
    let what = format!("the criterion run of {id} ({})", bin.display());
    let out = done!(run_child(&mut cmd, shutdown, what, true)?);
    if !out.status.success() {
        bail!(
            "{id}: {} exited {}: {}",
            bin.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let est: EstimatesFile = read_json(&home.join(id).join("new/estimates.json"))?;
    let bench: BenchmarkFile = read_json(&home.join(id).join("new/benchmark.json"))?;
    let bytes = match bench.throughput {
        Some(ThroughputFile::Bytes(b) | ThroughputFile::BytesDecimal(b)) => Some(b),
        _ => None,
    };
    Ok(Step::Done((est.mean.point_estimate, bytes)))
}

fn regex_escape(s: &str) -> String {
    s.chars().fold(String::new(), |mut o, c| {
        if "\\.+*?()|[]{}^$".contains(c) {
            o.push('\\');
        }
        o.push(c);
        o
    })
}

/// One benchmark's pairs.
pub(super) struct Compared {
    pub(super) id: String,
    /// (A ns, B ns) per round.
    pub(super) pairs: Vec<(f64, f64)>,
    /// Bytes one iteration reads, when the benchmark declares them.
    pub(super) bytes: Option<u64>,
    /// With `--until-ci`: why its rounds stopped.
    pub(super) stopped: Option<Stopped>,
}

impl Compared {
    /// Mean time per iteration of one side over the rounds.
    fn mean_ns(&self, side: Side) -> f64 {
        let pick = |p: &(f64, f64)| if side == Side::A { p.0 } else { p.1 };
        self.pairs.iter().map(pick).sum::<f64>() / self.pairs.len().max(1) as f64
    }

    /// GB/s (10^9 bytes per second) of one side, at its mean time.
    fn gb_s(&self, side: Side) -> Option<f64> {
        self.bytes.map(|b| b as f64 / self.mean_ns(side))
    }
}

/// Each side's read bandwidth per thread count: the highest of its `read_bandwidth`
/// benchmarks' GB/s, as the baseline report takes it.
fn bandwidth(results: &[Compared], side: Side) -> BTreeMap<usize, f64> {
    let mut bw = BTreeMap::new();
    for c in results {
        if let (Some(t), Some(g)) = (bandwidth_threads(&c.id), c.gb_s(side)) {
            let e = bw.entry(t).or_insert(g);
            *e = f64::max(*e, g);
        }
    }
    bw
}

/// How the comparison is judged beyond the noise threshold.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Judging {
    /// `--until-ci`: the confidence sequence's intervals, and the target half-width.
    pub(super) until_ci: Option<f64>,
    /// `--margin`: the equivalence verdict.
    pub(super) margin: Option<f64>,
}

/// B/A over the rounds: the fixed-n t interval, or with `sequential` the confidence
/// sequence's (valid however many rounds the run chose to add).
fn ratio_of(pairs: &[(f64, f64)], sequential: bool) -> Option<Interval> {
    let ba: Vec<(f64, f64)> = pairs.iter().map(|(a, b)| (*b, *a)).collect();
    if sequential { sequence::paired_ratio(&ba) } else { student_t::paired_ratio(&ba) }
}

/// The equivalence verdict of B/A at `margin`, from the interval the run reports (with a
/// fixed design, the 90% TOST interval).
fn equivalence_of(pairs: &[(f64, f64)], margin: f64, sequential: bool) -> String {
    let n = pairs.len();
    let v = if sequential {
        ratio_of(pairs, true)
            .filter(|r| r.ci95.is_some())
            .map(|r| equivalence::judge(&r, margin, sequence::half_factor))
    } else {
        let logs: Vec<f64> =
            pairs.iter().filter(|(a, b)| *a > 0.0 && *b > 0.0).map(|(a, b)| (b / a).ln()).collect();
        equivalence::tost(&logs, margin).map(|t| t.verdict)
    };
    match v {
        Some(v) => equivalence::describe(&v, margin, n),
        None => format!("undecided at {margin}% (too few rounds for an interval; {n} so far)"),
    }
}

/// The markdown section of an interleaved comparison.
pub(super) fn render(
    rev: &str,
    sha: &str,
    rounds: usize,
    noise: f64,
    judging: Judging,
    results: &[Compared],
    missing: &[String],
) -> String {
    let sequential = judging.until_ci.is_some();
    let mut s = String::new();
    let interval = if sequential {
        "the Gaussian-mixture t confidence sequence on the log ratios, valid however many rounds the run added"
    } else {
        "Student's t on the log ratios"
    };
    let _ = writeln!(
        s,
        "### Interleaved comparison: `{rev}` ({}) = A, the working tree = B\n\n\
         Each benchmark ran {} rounds in ABBA order (A B, B A, ...), each run a fresh \
         criterion process; change = geometric mean of the rounds' B/A time ratios with its 95% \
         interval ({interval}); a verdict needs the whole interval beyond ±{}%.\n",
        &sha[..sha.len().min(12)],
        match judging.until_ci {
            Some(t) => format!("at least {rounds} and until the interval's half-width was under {t}%"),
            None => rounds.to_string(),
        },
        noise * 100.0
    );
    let (bw_a, bw_b) = (bandwidth(results, Side::A), bandwidth(results, Side::B));
    if bw_a.is_empty() {
        let _ = writeln!(s, "Read bandwidth: **not in this comparison**, so no percentages below.\n");
    } else {
        let list: Vec<String> = bw_a
            .iter()
            .map(|(t, a)| {
                format!(
                    "{a:.1} / {} GB/s with {t} thread(s)",
                    bw_b.get(t).map_or("-".into(), |b| format!("{b:.1}"))
                )
            })
            .collect();
        let _ = writeln!(
            s,
            "Read bandwidth A / B (the highest `read_bandwidth` measurement of each side): {}.\n",
            list.join(", ")
        );
    }
    let mut header =
        "| benchmark | A (mean of rounds) | B (mean of rounds) | B/A (95% CI) | verdict | GB/s A / B | % of read BW A / B |"
            .to_string();
    let mut rule = "|---|---:|---:|---|---|---:|---:|".to_string();
    if let Some(m) = judging.margin {
        header.push_str(&format!(" at ±{m}% |"));
        rule.push_str("---|");
    }
    if sequential {
        header.push_str(" stopped |");
        rule.push_str("---|");
    }
    let _ = writeln!(s, "{header}\n{rule}");
    for c in results {
        let mean =
            |f: fn(&(f64, f64)) -> f64| c.pairs.iter().map(f).sum::<f64>() / c.pairs.len().max(1) as f64;
        let gbs = |side| c.gb_s(side).map_or("n/a".to_string(), |g| format!("{g:.1}"));
        let threads = parse_kernel_id(&c.id).map(|k| k.threads);
        let share = |side, bw: &BTreeMap<usize, f64>| match (c.gb_s(side), threads.and_then(|t| bw.get(&t))) {
            (Some(g), Some(b)) => format!("{:.0}%", 100.0 * g / b),
            _ => "n/a".to_string(),
        };
        let ratio = ratio_of(&c.pairs, sequential);
        let shown = match ratio {
            Some(i @ Interval { mean, ci95: Some((lo, hi)), n, .. }) => {
                let flag =
                    if i.zero_width() { format!(", {}", student_t::ZERO_WIDTH) } else { String::new() };
                format!("{mean:.3} [{lo:.3}, {hi:.3}] (n={n}{flag})")
            }
            Some(Interval { mean, n, .. }) => format!("{mean:.3} (n={n}: no interval)"),
            None => "- (n=0)".into(),
        };
        let mut line = format!(
            "| `{}` | {} | {} | {shown} | {} | {} / {} | {} / {} |",
            c.id,
            fmt_time(mean(|p| p.0)),
            fmt_time(mean(|p| p.1)),
            judge(ratio, noise).as_str(),
            gbs(Side::A),
            gbs(Side::B),
            share(Side::A, &bw_a),
            share(Side::B, &bw_b)
        );
        if let Some(m) = judging.margin {
            line.push_str(&format!(" {} |", equivalence_of(&c.pairs, m, sequential)));
        }
        if let Some(t) = judging.until_ci {
            let why = c.stopped.as_ref().map_or("-".to_string(), |st| {
                st.describe(t).trim_start_matches("stopping rule: ").to_string()
            });
            line.push_str(&format!(" {why} |"));
        }
        let _ = writeln!(s, "{line}");
    }
    if !missing.is_empty() {
        let _ = writeln!(s, "\nIn one tree only (not compared): {}", missing.join(", "));
    }
    s
}

/// What `--compare` runs: the flags that shape it.
pub(super) struct CompareRun<'a> {
    /// REV.
    pub(super) rev: &'a str,
    /// `--filter`.
    pub(super) filter: Option<&'a str>,
    /// `--rounds`.
    pub(super) rounds: usize,
    /// `--quick`.
    pub(super) quick: bool,
    /// `--noise-threshold`.
    pub(super) noise: f64,
    /// `--until-ci`, its budgets and `--margin`.
    pub(super) seq: &'a crate::verdict::SequentialFlags,
}

/// Runs the comparison; returns the report section, or the signal that stopped it.
pub(super) fn run(
    root: &Path,
    target_dir: &Path,
    c: &CompareRun<'_>,
    shutdown: &Shutdown,
) -> Result<Step<String>> {
    let CompareRun { rev, filter, rounds, quick, noise, seq } = *c;
    let judging = Judging { until_ci: seq.until_ci, margin: seq.margin };
    let (tree, sha) = worktree(root, target_dir, rev)?;
    let built = build(&tree, target_dir, shutdown);
    // The worktree is only needed to build REV's benches: unregister it at once, so no
    // run leaves a worktree behind in the repository (its build artifacts stay in the
    // target directory for the next comparison).
    let removed = Command::new("git")
        .current_dir(root)
        .args(["worktree", "remove", "--force", &tree.display().to_string()])
        .status();
    if !removed.is_ok_and(|s| s.success()) {
        eprintln!("warning: could not remove the worktree {}: run `git worktree prune`", tree.display());
    }
    let bin_a = keep_copy(&done!(built?), &target_dir.join("bench-compare"), &sha[..12])?;
    let bin_b = done!(build(root, target_dir, shutdown)?);
    let ids_a = done!(list(&bin_a, filter, shutdown)?);
    let ids_b = done!(list(&bin_b, filter, shutdown)?);
    let both: Vec<String> = ids_b.iter().filter(|id| ids_a.contains(id)).cloned().collect();
    let missing: Vec<String> =
        ids_a.iter().chain(&ids_b).filter(|id| !both.contains(id)).map(|id| format!("`{id}`")).collect();
    if both.is_empty() {
        bail!("no kernel benchmark is in both trees for the filter {:?}", filter.unwrap_or(""));
    }
    let home = target_dir.join("bench-compare").join("criterion");
    let mut results = Vec::new();
    let started = std::time::Instant::now();
    for (i, id) in both.iter().enumerate() {
        let mut pairs: Vec<(f64, f64)> = Vec::new();
        let mut bytes = None;
        let stopped = loop {
            let t0 = std::time::Instant::now();
            // Round r runs A B when r is even, B A when odd: the order of `order`.
            let r = pairs.len();
            let (mut a, mut b) = (0.0, 0.0);
            for side in &order(r + 1)[2 * r..] {
                let (ns, by) = match side {
                    Side::A => done!(measure(&bin_a, id, &home.join("a"), quick, shutdown)?),
                    Side::B => done!(measure(&bin_b, id, &home.join("b"), quick, shutdown)?),
                };
                bytes = bytes.or(by);
                if *side == Side::A { a = ns } else { b = ns }
            }
            pairs.push((a, b));
            if pairs.len() < rounds {
                continue;
            }
            let Some(target) = seq.until_ci else { break None };
            let ratio = ratio_of(&pairs, true);
            if ratio.and_then(|r| Some(sequence::half_width_pct(r.mean, r.ci95?))).is_some_and(|h| h < target)
            {
                break Some(Stopped::Converged);
            }
            if let Some(m) = seq.margin
                && let Some(r) = ratio.filter(|r| r.ci95.is_some())
                && matches!(
                    equivalence::judge(&r, m, sequence::half_factor),
                    Equivalence::Equivalent | Equivalence::Differs
                )
            {
                break Some(Stopped::Decided(m));
            }
            if pairs.len() >= seq.max_pairs() {
                break Some(Stopped::MaxPairs(pairs.len()));
            }
            if let Some(max) = seq.max_time
                && started.elapsed() + t0.elapsed() > max
            {
                break Some(Stopped::MaxTime);
            }
        };
        let r = ratio_of(&pairs, seq.until_ci.is_some());
        eprintln!(
            "[{}/{}] {id}: B/A {} after {} rounds",
            i + 1,
            both.len(),
            r.map_or("-".into(), |r| format!("{:.3}", r.mean)),
            pairs.len()
        );
        results.push(Compared { id: id.clone(), pairs, bytes, stopped });
    }
    Ok(Step::Done(render(rev, &sha, rounds, noise, judging, &results, &missing)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_alternate_which_tree_goes_first() {
        use Side::*;
        assert_eq!(order(4), [A, B, B, A, A, B, B, A]);
        assert_eq!(order(1), [A, B]);
    }

    #[test]
    fn a_verdict_needs_the_whole_interval_beyond_the_noise() {
        let r = |mean: f64, lo: f64, hi: f64| Some(Interval { n: 4, mean, sd: 0.0, ci95: Some((lo, hi)) });
        assert_eq!(judge(r(1.2, 1.05, 1.3), 0.01), Verdict::Regressed);
        assert_eq!(judge(r(0.8, 0.7, 0.9), 0.01), Verdict::Improved);
        assert_eq!(judge(r(1.2, 0.95, 1.4), 0.01), Verdict::WithinNoise);
        assert_eq!(judge(r(1.005, 1.002, 1.008), 0.01), Verdict::WithinNoise);
        assert_eq!(
            judge(Some(Interval { n: 1, mean: 2.0, sd: 0.0, ci95: None }), 0.01),
            Verdict::TooFewPairs
        );
    }

    #[test]
    fn revs_executable_is_kept_apart_from_a_rebuild_at_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("kernels-abc");
        std::fs::write(&bin, b"rev").unwrap();
        let kept = keep_copy(&bin, &dir.path().join("bench-compare"), "a645baff71c3").unwrap();
        std::fs::write(&bin, b"working tree").unwrap();
        assert_ne!(kept, bin);
        assert_eq!(std::fs::read(&kept).unwrap(), b"rev");
        // A second comparison of the same REV replaces the copy.
        std::fs::write(&bin, b"rev again").unwrap();
        let again = keep_copy(&bin, &dir.path().join("bench-compare"), "a645baff71c3").unwrap();
        assert_eq!((again, std::fs::read(&kept).unwrap()), (kept, b"rev again".to_vec()));
    }

    #[test]
    fn the_bench_executable_is_found_in_cargos_messages() {
        let lines = [
            r#"{"reason":"compiler-artifact","target":{"name":"kiln_core","kind":["lib"]},"executable":null}"#,
            r#"{"reason":"compiler-artifact","target":{"name":"kernels","kind":["bench"]},"executable":"/t/release/deps/kernels-abc"}"#,
            r#"{"reason":"build-finished","success":true}"#,
        ]
        .join("\n");
        assert_eq!(bench_executable(&lines), Some(PathBuf::from("/t/release/deps/kernels-abc")));
        assert_eq!(bench_executable("not json\n"), None);
    }

    #[test]
    fn the_report_gives_each_change_as_a_paired_ratio_with_its_interval() {
        let results = [
            Compared {
                id: "qmv/q4_g64_n4096_k4096_m1/t1".into(),
                pairs: vec![(100.0, 130.0), (102.0, 134.0), (98.0, 128.0)],
                bytes: Some(2000),
                stopped: None,
            },
            Compared {
                id: "qmv/q4_g64_n4096_k4096_m1/t2".into(),
                pairs: vec![(100.0, 99.0), (90.0, 92.0), (110.0, 108.0)],
                bytes: None,
                stopped: None,
            },
            // 40 GB/s on A, 25 on B (the machine's load, say): each side's share uses its own.
            Compared {
                id: "read_bandwidth/sum_1024MiB_start/t1".into(),
                pairs: vec![(25.0, 40.0)],
                bytes: Some(1000),
                stopped: None,
            },
        ];
        let text =
            render("main", "0123456789abcdef", 3, 0.01, Judging::default(), &results, &["`x/y/t1`".into()]);
        assert!(text.contains("`main` (0123456789ab) = A"), "{text}");
        assert!(text.contains("| `qmv/q4_g64_n4096_k4096_m1/t1` | 100.0 ns | 130.7 ns | 1.307 ["), "{text}");
        // 2000 bytes in 100 ns: 20 GB/s, half of A's 40; in 130.7 ns: 15.3 GB/s, 61% of B's 25.
        assert!(text.contains("| **regressed** | 20.0 / 15.3 | 50% / 61% |"), "{text}");
        assert!(text.contains("| within noise | n/a / n/a | n/a / n/a |"), "{text}");
        assert!(text.contains("Read bandwidth A / B (the highest `read_bandwidth` measurement of each side): 40.0 / 25.0 GB/s with 1 thread(s)."), "{text}");
        assert!(text.contains("| **regressed** |"), "{text}");
        // Every ratio carries its n.
        assert_eq!(text.matches("] (n=3) |").count(), 2, "{text}");
        assert!(text.contains("| within noise |"), "{text}");
        assert!(text.contains("In one tree only (not compared): `x/y/t1`"), "{text}");
        assert_eq!(regex_escape("read_bandwidth/64MiB/t1"), "read_bandwidth/64MiB/t1");
        assert_eq!(regex_escape("a.b(c)"), "a\\.b\\(c\\)");
        let one = [Compared { id: "x".into(), pairs: vec![(100.0, 130.0)], bytes: None, stopped: None }];
        let text = render("main", "0123456789abcdef", 1, 0.01, Judging::default(), &one, &[]);
        assert!(text.contains("| 1.300 (n=1: no interval) | too few pairs |"), "{text}");
    }

    #[test]
    fn a_sequential_comparison_reports_its_margin_verdict_and_why_it_stopped() {
        let results = [
            Compared {
                id: "qmv/a/t1".into(),
                pairs: vec![(100.0, 130.0), (101.0, 131.0), (99.0, 129.0), (100.0, 130.5), (100.0, 129.5)],
                bytes: None,
                stopped: Some(Stopped::Decided(5.0)),
            },
            Compared {
                id: "qmv/b/t1".into(),
                pairs: vec![(100.0, 100.5), (100.0, 99.5), (100.0, 100.0), (100.0, 100.2)],
                bytes: None,
                stopped: Some(Stopped::MaxPairs(4)),
            },
        ];
        let judging = Judging { until_ci: Some(1.0), margin: Some(5.0) };
        let text = render("main", "0123456789abcdef", 4, 0.01, judging, &results, &[]);
        assert!(text.contains("the Gaussian-mixture t confidence sequence"), "{text}");
        assert!(text.contains("| at ±5% | stopped |"), "{text}");
        let a = text.lines().find(|l| l.contains("qmv/a/t1")).unwrap();
        assert!(a.contains("| differs by more than 5% | decided, every reported ratio"), "{a}");
        let b = text.lines().find(|l| l.contains("qmv/b/t1")).unwrap();
        assert!(b.contains("| equivalent within 5% | --max-pairs 4 reached"), "{b}");
        // The same 4 rounds judged with a fixed design use the TOST's 90% interval.
        assert_eq!(equivalence_of(&results[1].pairs, 5.0, false), "equivalent within 5%");
        assert!(
            equivalence_of(&results[1].pairs[..1], 5.0, false).starts_with("undecided at 5% (too few rounds")
        );
    }
}
