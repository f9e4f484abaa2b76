//! `cargo xtask bench-kernels --compare REV`: the kernel benchmarks of REV against those
//! of the working tree, measured in the same run and interleaved, so a change is never
//! judged against numbers taken under another load.
//!
//! REV is checked out as a detached git worktree under `target/bench-compare/<sha>`, its
//! bench binary built (with the workspace's target directory: deps are shared, and the
//! two `kernels` binaries differ by their package path's hash) and the worktree removed
//! again; then the working tree's is built. Each
//! benchmark then runs as rounds of one A (REV) and one B (working tree) run, alternating
//! which goes first (A B, B A, A B, ...: ABBA), each run a fresh criterion process with
//! its own output directory. Every round gives one pair; the change is the geometric
//! mean of the pairs' B/A time ratios with its 95% interval (Student's t on the log
//! ratios), and the verdict is "regressed" or "improved" only when the whole interval
//! lies beyond the noise threshold.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use super::files::{EstimatesFile, read_json};
use super::render::fmt_time;
use super::{BENCH_PACKAGE, BENCH_TARGET};
use crate::student_t::{self, Interval};

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
fn build(dir: &Path, target_dir: &Path) -> Result<PathBuf> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    eprintln!("building the kernel benches in {}", dir.display());
    let out = Command::new(cargo)
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", target_dir)
        .args(["bench", "-p", BENCH_PACKAGE, "--bench", BENCH_TARGET, "--no-run", "--message-format", "json"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("building the benches in {}", dir.display()))?;
    if !out.status.success() {
        bail!("building the kernel benches in {} failed ({})", dir.display(), out.status);
    }
    bench_executable(&String::from_utf8_lossy(&out.stdout))
        .with_context(|| format!("cargo built no {BENCH_TARGET} bench executable in {}", dir.display()))
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
fn list(bin: &Path, filter: Option<&str>) -> Result<Vec<String>> {
    let mut cmd = Command::new(bin);
    cmd.args(["--bench", "--list"]);
    cmd.args(filter);
    let out = cmd.output().with_context(|| format!("running {} --list", bin.display()))?;
    Ok(super::parse_list(&String::from_utf8_lossy(&out.stdout)))
}

/// Mean time per iteration of one fresh criterion run of benchmark `id`.
fn measure(bin: &Path, id: &str, home: &Path, quick: bool) -> Result<f64> {
    let _ = std::fs::remove_dir_all(home);
    let pattern = format!("^{}$", regex_escape(id));
    let mut cmd = Command::new(bin);
    cmd.env("CRITERION_HOME", home).args(["--bench", &pattern, "--noplot"]);
    if quick {
        cmd.arg("--quick");
    } else {
        cmd.args(["--sample-size", "10", "--warm-up-time", "1", "--measurement-time", "3"]);
    }
    let out = cmd.output().with_context(|| format!("running {}", bin.display()))?;
    if !out.status.success() {
        bail!(
            "{id}: {} exited {}: {}",
            bin.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let est: EstimatesFile = read_json(&home.join(id).join("new/estimates.json"))?;
    Ok(est.mean.point_estimate)
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
}

/// The markdown section of an interleaved comparison.
pub(super) fn render(
    rev: &str,
    sha: &str,
    rounds: usize,
    noise: f64,
    results: &[Compared],
    missing: &[String],
) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "### Interleaved comparison: `{rev}` ({}) = A, the working tree = B\n\n\
         Each benchmark ran {rounds} rounds in ABBA order (A B, B A, ...), each run a fresh \
         criterion process; change = geometric mean of the rounds' B/A time ratios with its 95% \
         interval (Student's t on the log ratios); a verdict needs the whole interval beyond ±{}%.\n",
        &sha[..sha.len().min(12)],
        noise * 100.0
    );
    let _ = writeln!(s, "| benchmark | A (mean of rounds) | B (mean of rounds) | B/A (95% CI) | verdict |");
    let _ = writeln!(s, "|---|---:|---:|---|---|");
    for c in results {
        let mean =
            |f: fn(&(f64, f64)) -> f64| c.pairs.iter().map(f).sum::<f64>() / c.pairs.len().max(1) as f64;
        let ratio = student_t::paired_ratio(&c.pairs.iter().map(|(a, b)| (*b, *a)).collect::<Vec<_>>());
        let shown = match ratio {
            Some(i @ Interval { mean, ci95: Some((lo, hi)), n, .. }) => {
                let flag =
                    if i.zero_width() { format!(", {}", student_t::ZERO_WIDTH) } else { String::new() };
                format!("{mean:.3} [{lo:.3}, {hi:.3}] (n={n}{flag})")
            }
            Some(Interval { mean, n, .. }) => format!("{mean:.3} (n={n}: no interval)"),
            None => "- (n=0)".into(),
        };
        let _ = writeln!(
            s,
            "| `{}` | {} | {} | {shown} | {} |",
            c.id,
            fmt_time(mean(|p| p.0)),
            fmt_time(mean(|p| p.1)),
            judge(ratio, noise).as_str()
        );
    }
    if !missing.is_empty() {
        let _ = writeln!(s, "\nIn one tree only (not compared): {}", missing.join(", "));
    }
    s
}

/// Runs the comparison; returns the report section.
pub(super) fn run(
    root: &Path,
    target_dir: &Path,
    rev: &str,
    filter: Option<&str>,
    rounds: usize,
    quick: bool,
    noise: f64,
) -> Result<String> {
    let (tree, sha) = worktree(root, target_dir, rev)?;
    let built = build(&tree, target_dir);
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
    let bin_a = built?;
    let bin_b = build(root, target_dir)?;
    let (ids_a, ids_b) = (list(&bin_a, filter)?, list(&bin_b, filter)?);
    let both: Vec<String> = ids_b.iter().filter(|id| ids_a.contains(id)).cloned().collect();
    let missing: Vec<String> =
        ids_a.iter().chain(&ids_b).filter(|id| !both.contains(id)).map(|id| format!("`{id}`")).collect();
    if both.is_empty() {
        bail!("no kernel benchmark is in both trees for the filter {:?}", filter.unwrap_or(""));
    }
    let home = target_dir.join("bench-compare").join("criterion");
    let mut results = Vec::new();
    for (i, id) in both.iter().enumerate() {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for side in order(rounds) {
            match side {
                Side::A => a.push(measure(&bin_a, id, &home.join("a"), quick)?),
                Side::B => b.push(measure(&bin_b, id, &home.join("b"), quick)?),
            }
        }
        let pairs: Vec<(f64, f64)> = a.into_iter().zip(b).collect();
        let r = student_t::paired_ratio(&pairs.iter().map(|(a, b)| (*b, *a)).collect::<Vec<_>>());
        eprintln!(
            "[{}/{}] {id}: B/A {}",
            i + 1,
            both.len(),
            r.map_or("-".into(), |r| format!("{:.3}", r.mean))
        );
        results.push(Compared { id: id.clone(), pairs });
    }
    Ok(render(rev, &sha, rounds, noise, &results, &missing))
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
            },
            Compared {
                id: "qmv/q4_g64_n4096_k4096_m1/t2".into(),
                pairs: vec![(100.0, 99.0), (90.0, 92.0), (110.0, 108.0)],
            },
        ];
        let text = render("main", "0123456789abcdef", 3, 0.01, &results, &["`x/y/t1`".into()]);
        assert!(text.contains("`main` (0123456789ab) = A"), "{text}");
        assert!(text.contains("| `qmv/q4_g64_n4096_k4096_m1/t1` | 100.0 ns | 130.7 ns | 1.307 ["), "{text}");
        assert!(text.contains("| **regressed** |"), "{text}");
        // Every ratio carries its n.
        assert_eq!(text.matches("] (n=3) |").count(), 2, "{text}");
        assert!(text.contains("| within noise |"), "{text}");
        assert!(text.contains("In one tree only (not compared): `x/y/t1`"), "{text}");
        assert_eq!(regex_escape("read_bandwidth/64MiB/t1"), "read_bandwidth/64MiB/t1");
        assert_eq!(regex_escape("a.b(c)"), "a\\.b\\(c\\)");
        let one = [Compared { id: "x".into(), pairs: vec![(100.0, 130.0)] }];
        let text = render("main", "0123456789abcdef", 1, 0.01, &one, &[]);
        assert!(text.contains("| 1.300 (n=1: no interval) | too few pairs |"), "{text}");
    }
}
