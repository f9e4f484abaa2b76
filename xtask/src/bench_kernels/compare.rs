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
//! its own output directory. Every round gives one pair, and each round's wall time is
//! kept; [`super::sheet`] judges the pairs (one [`crate::verdict::reading::Reading`] per
//! benchmark) and words the result.
//!
//! The builds, listings and criterion runs are children of the one shutdown point, each in
//! a process group of its own: a signal stops the running one whole (cargo and every rustc
//! it started, or the bench binary) and ends the comparison, REV's worktree removed.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, Result, bail};

use super::files::{BenchmarkFile, EstimatesFile, ThroughputFile, read_json};
use super::sheet::{Compared, Judging, Side, judged, ratio, section, sheet};
use super::target::{BENCH_PACKAGE, BENCH_TARGET, CARGO_GRACE};
use crate::child::{self, Shutdown, Waited};
use crate::verdict::reading::Method;
use crate::verdict::sequence::Stopped;
use crate::verdict::sheet::Sheet;

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

/// The run order of `rounds` rounds: A B, then B A, alternating.
pub(super) fn order(rounds: usize) -> Vec<Side> {
    (0..rounds).flat_map(|r| if r % 2 == 0 { [Side::A, Side::B] } else { [Side::B, Side::A] }).collect()
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
    Ok(Step::Done(super::target::parse_list(&String::from_utf8_lossy(&out.stdout))))
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
    /// The verdict's margin in percent.
    pub(super) margin_pct: f64,
    /// `--until-ci`, its budgets and `--margin`.
    pub(super) seq: &'a crate::verdict::SequentialFlags,
}

/// What a comparison found: its sheet, and the markdown section printed from it.
pub(super) struct Comparison {
    pub(super) sheet: Sheet,
    pub(super) section: String,
}

/// Runs the comparison; returns what it found, or the signal that stopped it.
pub(super) fn run(
    root: &Path,
    target_dir: &Path,
    c: &CompareRun<'_>,
    shutdown: &Shutdown,
) -> Result<Step<Comparison>> {
    let CompareRun { rev, filter, rounds, quick, margin_pct, seq } = *c;
    let judging = Judging { until_ci: seq.until_ci, margin_pct };
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
        let first = std::time::Instant::now();
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
            if ratio(&pairs, Method::Sequence).and_then(|r| r.half_width_pct()).is_some_and(|h| h < target) {
                break Some(Stopped::Converged);
            }
            if seq.margin.is_some() && judged(&pairs, &judging).is_some_and(|j| j.decided()) {
                break Some(Stopped::Decided(margin_pct));
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
        let wall_s = first.elapsed().as_secs_f64();
        eprintln!(
            "[{}/{}] {id}: B/A {}; {}",
            i + 1,
            both.len(),
            judged(&pairs, &judging).map_or(format!("- (n={})", pairs.len()), |j| format!(
                "{}: {}",
                j.reading.ratio_text(),
                j.text("rounds", Some(wall_s / pairs.len() as f64))
            )),
            eta_text(i + 1, both.len(), started.elapsed()),
        );
        results.push(Compared { id: id.clone(), pairs, bytes, stopped, wall_s });
    }
    let sheet = sheet(rev, &sha, rounds, &judging, &results, &missing);
    let section = section(rev, &sha, &sheet);
    Ok(Step::Done(Comparison { sheet, section }))
}

/// What the rest of a comparison will likely take: the benchmarks left at the mean wall
/// time of the `done` ones so far (each runs at least its `--rounds`; with `--until-ci`,
/// until it settles or its budget ends), as a reader plans with it.
fn eta_text(done: usize, total: usize, elapsed: std::time::Duration) -> String {
    let left = total.saturating_sub(done);
    if left == 0 {
        return "no benchmark left".into();
    }
    let per = elapsed.as_secs_f64() / done.max(1) as f64;
    let what = if left == 1 { "the one benchmark".to_string() } else { format!("the {left} benchmarks") };
    format!("ETA {} for {what} left", crate::verdict::reading::duration_text(per * left as f64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_eta_covers_every_benchmark_left() {
        let t = std::time::Duration::from_secs(120);
        assert_eq!(eta_text(2, 7, t), "ETA about 5 min for the 5 benchmarks left");
        assert_eq!(eta_text(6, 7, t), "ETA about 20 s for the one benchmark left");
        assert_eq!(eta_text(7, 7, t), "no benchmark left");
    }

    #[test]
    fn rounds_alternate_which_tree_goes_first() {
        use Side::*;
        assert_eq!(order(4), [A, B, B, A, A, B, B, A]);
        assert_eq!(order(1), [A, B]);
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
    fn criterion_ids_are_escaped_for_its_filter() {
        assert_eq!(regex_escape("read_bandwidth/64MiB/t1"), "read_bandwidth/64MiB/t1");
        assert_eq!(regex_escape("a.b(c)"), "a\\.b\\(c\\)");
    }
}
