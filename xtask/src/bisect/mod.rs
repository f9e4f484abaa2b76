//! `cargo xtask bisect --good REV --bad REV --metric NAME -- TASK ARGS...`: the first
//! commit that made a measurement worse, found by measuring rather than guessing.
//!
//! Every probed revision is checked out in one git worktree under the run directory and
//! built there (`cargo build --release -p kiln`) into one target dir, so only the first
//! build is cold ([`build`]); with `--no-build` the file `--bin` names in it is taken
//! instead. The binary is copied out, and the worktree and target dir are removed when the
//! run ends, however it ends (`--keep-build` keeps them). TASK ARGS is then run as given
//! (no shell), with `{bin}` in any argument replaced by that binary's path, and prints the
//! metric as `NAME=VALUE` on its standard output (the last such token counts). A revision
//! is measured against the good one in ABBA pairs (good probe, probe good, ...), first
//! `--min-pairs` of them, then one pair at a time, its ratio to good read on the confidence
//! sequence of the pairs' log ratios ([`crate::verdict::sequence`], valid however many
//! pairs it took). The bad revision is measured first and must lie beyond `--margin` of
//! good, else there is nothing to bisect; every later revision is called by the side of
//! the line between good and bad its interval lies on ([`classify`]), with more pairs up
//! to `--max-pairs` while it straddles the line, then `undecided`, which ends the
//! bisection with the range that is left and what would decide it rather than a guess.
//! Every run's value is appended to `measurements.jsonl` as it is taken, so `--resume DIR`
//! continues a stopped bisection without measuring anything twice. The summary is a
//! [`crate::verdict::sheet::Sheet`] ([`summary`]).
//!
//! The build runs in a process group of its own, which a signal stops whole: cargo and
//! every rustc it started, not cargo alone. `measurements.jsonl` is created with the run
//! directory, so a run stopped before its first value (in its first build) is resumable.
//!
//! A value that is not a positive number cannot be a ratio's term: it is refused at its
//! first reading, naming the metric, the revision and the value (exit 2), and not recorded.

mod build;
mod classify;
mod summary;

use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use xshell::Shell;

use self::build::{Checkout, Git};
use self::classify::{Call, Side};
use self::summary::Summary;
use crate::child::{self, Shutdown, Waited};
use crate::console::usage;
use crate::verdict::reading::{Method, Reading, duration_text};

/// Flags of `cargo xtask bisect`.
#[derive(clap::Args, Debug)]
pub struct Bisect {
    /// The last revision known to measure well.
    #[arg(long, value_name = "REV")]
    good: String,
    /// A later revision that measures worse (a descendant of --good).
    #[arg(long, value_name = "REV")]
    bad: String,
    /// The metric TASK prints as NAME=VALUE on its standard output.
    #[arg(long, value_name = "NAME", value_parser = metric_arg)]
    metric: String,
    /// The bad revision must lie beyond ±PCT% of the good one; a probe is like bad only
    /// beyond it (and beyond the log-midpoint of good and bad), like good on good's side
    /// of the farther of the two.
    #[arg(long, value_name = "PCT", default_value_t = 5.0, value_parser = crate::verdict::pct_arg)]
    margin: f64,
    /// Pairs measured before a probe is first judged (the sequence is bounded from 4).
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u64).range(4..=1000))]
    min_pairs: u64,
    /// Pairs after which a probe still undecided ends the bisection as undecided.
    #[arg(long, value_name = "N", default_value_t = 12, value_parser = clap::value_parser!(u64).range(4..=1000))]
    max_pairs: u64,
    /// The git repository to bisect [default: this checkout].
    #[arg(long, value_name = "DIR")]
    repo: Option<PathBuf>,
    /// Do not build: take the binary at --bin inside each revision's worktree.
    #[arg(long)]
    no_build: bool,
    /// Keep the build's worktree and target dir in the run directory at the end (a
    /// --resume of the run builds on in them) instead of removing them.
    #[arg(long)]
    keep_build: bool,
    /// With --no-build: the binary's path inside the worktree.
    #[arg(long, value_name = "PATH", requires = "no_build")]
    bin: Option<PathBuf>,
    /// Where run directories go [default: benchmarks/runs].
    #[arg(long, value_name = "DIR")]
    runs_dir: Option<PathBuf>,
    /// Continue the bisection in this run directory, reusing every value measured there.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Seconds one run of TASK may take.
    #[arg(long, value_name = "SECS", default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    task_timeout: u64,
    /// The measuring command and its arguments; `{bin}` is replaced by the revision's binary.
    #[arg(last = true, required = true, value_name = "TASK ARGS")]
    task: Vec<String>,
}

fn metric_arg(s: &str) -> Result<String, String> {
    if s.is_empty() || s.contains(char::is_whitespace) || s.contains('=') {
        return Err(format!("{s:?}: expected a metric name without spaces or '=', such as time_ms"));
    }
    Ok(s.to_string())
}

/// One run of TASK, as `measurements.jsonl` holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Measurement {
    /// The measured revision.
    pub sha: String,
    /// The revision it was paired against (the good one).
    pub against: String,
    /// The pair's index (0-based).
    pub pair: usize,
    /// Whether this run is the probe's (else the good revision's).
    pub probe: bool,
    /// The metric.
    pub value: f64,
}

/// The next index to probe in `lo..hi` (exclusive ends: lo is like good, hi like bad).
pub fn midpoint(lo: usize, hi: usize) -> Option<usize> {
    (hi - lo > 1).then(|| lo + (hi - lo) / 2)
}

/// How a step ended: the value, or the signal that stopped it.
enum Step<T> {
    Done(T),
    Signal(i32),
}

impl Bisect {
    pub fn run(self, sh: &Shell) -> Result<ExitCode> {
        let root = sh.current_dir();
        let repo = match &self.repo {
            Some(r) => crate::args::user_path(r)?,
            None => root.clone(),
        };
        if self.max_pairs < self.min_pairs {
            usage!(
                "--max-pairs {} is below --min-pairs {}: expected at least as many",
                self.max_pairs,
                self.min_pairs
            );
        }
        if self.no_build && self.bin.is_none() {
            usage!("--no-build needs --bin PATH: the binary's path inside each revision's worktree");
        }
        let git = Git(&repo);
        let sha = |rev: &str, flag: &str| -> Result<String> {
            match git.run(&["rev-parse", "--verify", &format!("{rev}^{{commit}}")]) {
                Ok(s) => Ok(s),
                Err(e) => usage!("{flag} {rev}: not a commit of {} ({e:#})", repo.display()),
            }
        };
        let good = sha(&self.good, "--good")?;
        let bad = sha(&self.bad, "--bad")?;
        if good == bad || git.run(&["merge-base", "--is-ancestor", &good, &bad]).is_err() {
            usage!(
                "--good {} is not an ancestor of --bad {}: expected an earlier revision of the same line",
                self.good,
                self.bad
            );
        }
        // good..bad along the first-parent line: the candidates, oldest first.
        let listed = git.run(&[
            "rev-list",
            "--first-parent",
            "--ancestry-path",
            "--reverse",
            &format!("{good}..{bad}"),
        ])?;
        let line: Vec<String> = listed.lines().map(str::to_string).collect();
        let run_dir = match &self.resume {
            Some(d) => {
                let d = crate::args::user_path(d)?;
                if !d.join("measurements.jsonl").is_file() {
                    usage!(
                        "--resume {}: no measurements.jsonl there: expected a bisect run directory",
                        d.display()
                    );
                }
                d
            }
            None => {
                let runs = match &self.runs_dir {
                    Some(d) => crate::args::user_path(d)?,
                    None => root.join("benchmarks/runs"),
                };
                let d = crate::run_dir::create_run_dir(&runs, "bisect")?;
                // Created with the directory, so the run is resumable from here on, even
                // when it is stopped before its first value (in the first build).
                let m = d.join("measurements.jsonl");
                fs::File::create(&m).with_context(|| format!("creating {}", m.display()))?;
                d
            }
        };
        let shutdown = Shutdown::install()?;
        build::remove_stale_worktrees(&git, &run_dir);
        // The bisection, then the page: written once the worktree and target dir it built
        // in are gone (`Checkout` removes them when the bisection's context drops), so it
        // lists only what stays.
        let code = (|| -> Result<ExitCode> {
            let mut known = load(&run_dir.join("measurements.jsonl"))?;
            eprintln!(
                "bisect: {} candidate commits between {} and {}; run directory {}",
                line.len(),
                &good[..12],
                &bad[..12],
                run_dir.display()
            );
            // ext[0] is the good revision, ext[1..] the candidates, the last of them bad:
            // ext[lo] is like good and ext[hi] like bad throughout.
            let ext: Vec<&str> =
                std::iter::once(good.as_str()).chain(line.iter().map(String::as_str)).collect();
            let mut summary = Summary::new(&self.metric, self.margin);
            let interrupted = |sig: i32, summary: Summary| {
                let headline = format!(
                    "interrupted by {}: resume with --resume {}",
                    child::signal_name(sig),
                    run_dir.display()
                );
                summary.finish(headline, &run_dir, ExitCode::from(child::exit_code_for(sig)))
            };
            let mut ctx = Ctx {
                bisect: &self,
                run_dir: &run_dir,
                shutdown: &shutdown,
                good: &good,
                checkout: Checkout::new(&git, &run_dir, self.keep_build),
                pair_secs: Vec::new(),
            };
            ctx.say_cost(ext.len() - 1);
            let good_bin = match ctx.binary(&good)? {
                Step::Done(b) => b,
                Step::Signal(sig) => return interrupted(sig, summary),
            };
            // Step 0: is bad bad at all?
            let c = match ctx.measure(&bad, &good_bin, None, &mut known)? {
                Step::Done(c) => c,
                Step::Signal(sig) => return interrupted(sig, summary),
            };
            summary.row(0, &bad, &subject(&git, &bad), &c, ctx.secs_each());
            if c.side != Side::Bad {
                let headline = match c.side {
                    Side::Good => {
                        "the bad revision is like good against the good one: nothing to bisect".to_string()
                    }
                    _ => format!(
                        "the bad revision is undecided against the good one after {} pairs: nothing to bisect until it is decided",
                        c.reading.n
                    ),
                };
                if let Some(more) = c.more_needed() {
                    summary.note(format!(
                        "to go on: --resume {} --max-pairs {}",
                        run_dir.display(),
                        c.reading.n + more
                    ));
                }
                return summary.finish(headline, &run_dir, ExitCode::FAILURE);
            }
            let bad_at = c.reading.estimate;
            let (mut lo, mut hi) = (0usize, ext.len() - 1);
            let mut step = 1;
            while let Some(mid) = midpoint(lo, hi) {
                let probe = ext[mid];
                let c = match ctx.measure(probe, &good_bin, Some(bad_at), &mut known)? {
                    Step::Done(c) => c,
                    Step::Signal(sig) => return interrupted(sig, summary),
                };
                summary.row(step, probe, &subject(&git, probe), &c, ctx.secs_each());
                step += 1;
                match c.side {
                    Side::Good => lo = mid,
                    Side::Bad => hi = mid,
                    Side::Undecided { .. } => {
                        let headline = format!(
                            "undecided: the first bad commit is after {} and at or before {}; {} straddles the line between good and bad after {} pairs",
                            &ext[lo][..12],
                            &ext[hi][..12],
                            &probe[..12],
                            c.reading.n
                        );
                        if let Some(more) = c.more_needed() {
                            let time = ctx.secs_each().map_or(String::new(), |s| {
                                format!(", {} more", duration_text(s * more as f64))
                            });
                            summary.note(format!(
                                "to go on: --resume {} --max-pairs {}{time}",
                                run_dir.display(),
                                c.reading.n + more
                            ));
                        }
                        return summary.finish(headline, &run_dir, ExitCode::FAILURE);
                    }
                }
            }
            let first = ext[hi];
            summary.finish(
                format!("first bad commit: {first} {}", subject(&git, first)),
                &run_dir,
                ExitCode::SUCCESS,
            )
        })();
        crate::report::write_or_warn(&run_dir);
        code
    }
}

/// The subject line of `sha`'s commit message.
fn subject(git: &Git<'_>, sha: &str) -> String {
    git.run(&["log", "-1", "--format=%s", sha]).unwrap_or_default()
}

/// What every step shares.
struct Ctx<'a> {
    bisect: &'a Bisect,
    run_dir: &'a Path,
    shutdown: &'a Shutdown,
    good: &'a str,
    checkout: Checkout<'a>,
    /// The seconds each pair measured in this process took.
    pair_secs: Vec<f64>,
}

impl Ctx<'_> {
    /// Says, before the first build, what building will cost and what is left behind.
    fn say_cost(&self, candidates: usize) {
        if self.bisect.no_build {
            return;
        }
        let probes = (candidates.max(1) as f64).log2().ceil() as usize;
        let end = if self.bisect.keep_build {
            "both are kept at the end (--keep-build)"
        } else {
            "both are removed at the end (--keep-build keeps them)"
        };
        let first = if self.checkout.target.is_dir() {
            "the target dir holds this run's earlier builds, so the first build is warm too"
        } else {
            "the first build of a cold target dir compiles kiln and all its dependencies in release (several minutes; 20 or more on a loaded 2-core machine)"
        };
        eprintln!(
            "bisect builds about {} revisions (good, bad and about {probes} midpoints) in one worktree, {}, into one target dir, {}: {first}, each later revision rebuilds only the crates that changed; {end}",
            probes + 2,
            self.checkout.dir.display(),
            self.checkout.target.display()
        );
    }

    /// The mean time of a pair measured in this process, once there is one.
    fn secs_each(&self) -> Option<f64> {
        (!self.pair_secs.is_empty()).then(|| self.pair_secs.iter().sum::<f64>() / self.pair_secs.len() as f64)
    }

    /// The binary of `sha`, built in (or taken from) the run's worktree checked out at
    /// it; reused when the run directory already has it.
    fn binary(&mut self, sha: &str) -> Result<Step<PathBuf>> {
        let name =
            self.bisect.bin.as_ref().and_then(|b| b.file_name()).map_or("kiln".into(), |n| n.to_os_string());
        let out = self.run_dir.join("bin").join(&sha[..12]).join(&name);
        if out.is_file() {
            return Ok(Step::Done(out));
        }
        let dir = self.checkout.at(sha)?.to_path_buf();
        let built = if self.bisect.no_build {
            dir.join(self.bisect.bin.as_deref().unwrap_or(Path::new("kiln")))
        } else {
            let target = &self.checkout.target;
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let mut cmd = Command::new(cargo);
            cmd.current_dir(&dir).env("CARGO_TARGET_DIR", target).args([
                "build",
                "--release",
                "--package",
                "kiln",
            ]);
            eprintln!("building {} in {}", &sha[..12], dir.display());
            let start = Instant::now();
            // Its own group: a signal stops cargo and every rustc it started, not cargo alone.
            let owned = child::spawn(&mut cmd).context("starting cargo")?;
            match owned.wait(self.shutdown, None, Duration::from_secs(10))? {
                Waited::Exited(st) if st.success() => {}
                Waited::Exited(st) => bail!("building {} failed ({st})", &sha[..12]),
                Waited::TimedOut => bail!("building {} timed out", &sha[..12]),
                Waited::Interrupted(sig) => return Ok(Step::Signal(sig)),
            }
            eprintln!("built {} in {}", &sha[..12], duration_text(start.elapsed().as_secs_f64()));
            target.join("release/kiln")
        };
        if !built.is_file() {
            bail!("{}: no binary at {} in its worktree", &sha[..12], built.display());
        }
        fs::create_dir_all(out.parent().unwrap_or(self.run_dir))?;
        fs::copy(&built, &out).with_context(|| format!("copying {} out of its worktree", built.display()))?;
        Ok(Step::Done(out))
    }

    /// One run of TASK with `bin`: the metric it printed.
    fn run_task(&self, bin: &Path, label: &str) -> Result<Step<f64>> {
        let args: Vec<String> =
            self.bisect.task.iter().map(|a| a.replace("{bin}", &bin.display().to_string())).collect();
        let logs = self.run_dir.join("logs");
        fs::create_dir_all(&logs)?;
        let stdout_path = logs.join(format!("{label}.out"));
        let mut cmd = Command::new(&args[0]);
        cmd.args(&args[1..])
            .stdin(Stdio::null())
            .stdout(fs::File::create(&stdout_path)?)
            .stderr(fs::File::create(logs.join(format!("{label}.err")))?);
        let owned = child::spawn(&mut cmd).with_context(|| format!("starting {}", args[0]))?;
        match owned.wait(
            self.shutdown,
            Some(Duration::from_secs(self.bisect.task_timeout)),
            Duration::from_secs(5),
        )? {
            Waited::Exited(st) if st.success() => {}
            Waited::Exited(st) => bail!("{label}: {} exited {st} (see {})", args[0], logs.display()),
            Waited::TimedOut => bail!("{label}: {} ran past --task-timeout", args[0]),
            Waited::Interrupted(sig) => return Ok(Step::Signal(sig)),
        }
        let text = fs::read_to_string(&stdout_path)?;
        match parse_metric(&text, &self.bisect.metric) {
            Some(v) => Ok(Step::Done(v)),
            None => bail!(
                "{label}: {} printed no {}=NUMBER (see {})",
                args[0],
                self.bisect.metric,
                stdout_path.display()
            ),
        }
    }

    /// Measures `sha` against the good revision until the call is made or the pairs run
    /// out; every value is appended to `measurements.jsonl` as it is taken. `bad_at` is
    /// the bad revision's ratio to good (`None` while the bad revision itself is measured:
    /// then the call is whether it lies beyond the margin at all).
    fn measure(
        &mut self,
        sha: &str,
        good_bin: &Path,
        bad_at: Option<f64>,
        known: &mut Vec<Measurement>,
    ) -> Result<Step<Call>> {
        let bin = match self.binary(sha)? {
            Step::Done(b) => b,
            Step::Signal(s) => return Ok(Step::Signal(s)),
        };
        let mut file =
            OpenOptions::new().create(true).append(true).open(self.run_dir.join("measurements.jsonl"))?;
        // (probe, good) per pair.
        let mut pairs: Vec<(f64, f64)> = Vec::new();
        loop {
            let k = pairs.len();
            // ABBA: good first in even pairs, the probe first in odd ones.
            let order = if k.is_multiple_of(2) { [false, true] } else { [true, false] };
            let mut got = [0.0f64; 2];
            let start = Instant::now();
            let mut fresh = 0;
            for probe in order {
                let hit = known
                    .iter()
                    .find(|m| m.sha == sha && m.against == self.good && m.pair == k && m.probe == probe);
                let v = match hit {
                    Some(m) => {
                        positive(&self.bisect.metric, if probe { sha } else { self.good }, probe, m.value)?
                    }
                    None => {
                        let label =
                            format!("{}-pair{k}-{}", &sha[..12], if probe { "probe" } else { "good" });
                        let v = match self.run_task(if probe { &bin } else { good_bin }, &label)? {
                            Step::Done(v) => {
                                positive(&self.bisect.metric, if probe { sha } else { self.good }, probe, v)?
                            }
                            Step::Signal(s) => return Ok(Step::Signal(s)),
                        };
                        let m = Measurement {
                            sha: sha.into(),
                            against: self.good.into(),
                            pair: k,
                            probe,
                            value: v,
                        };
                        writeln!(file, "{}", serde_json::to_string(&m)?)?;
                        file.flush()?;
                        known.push(m);
                        fresh += 1;
                        v
                    }
                };
                got[usize::from(probe)] = v;
            }
            if fresh == 2 {
                self.pair_secs.push(start.elapsed().as_secs_f64());
            }
            pairs.push((got[1], got[0]));
            if pairs.len() < self.bisect.min_pairs as usize {
                continue;
            }
            let Some(r) = Reading::of_pairs(&pairs, Method::Sequence) else {
                bail!("{}: no pair of positive values to judge", &sha[..12]);
            };
            let c = match bad_at {
                None => classify::confirm_bad(&r, self.bisect.margin),
                Some(b) => classify::classify(&r, b, self.bisect.margin),
            };
            eprintln!(
                "  {}: {} / good {}: {}",
                &sha[..12],
                self.bisect.metric,
                c.reading.ratio_text(),
                c.side.word()
            );
            if !matches!(c.side, Side::Undecided { .. }) || pairs.len() >= self.bisect.max_pairs as usize {
                return Ok(Step::Done(c));
            }
        }
    }
}

/// `value` when it is positive; else a usage error naming the metric, the revision and
/// the value: the bisection judges ratios of the metric, which a zero or a negative value
/// cannot form, so going on would only end undecided after every pair.
fn positive(metric: &str, sha: &str, probe: bool, value: f64) -> Result<f64> {
    if value > 0.0 {
        return Ok(value);
    }
    let which = if probe { "the probed revision" } else { "the good revision" };
    usage!(
        "{metric}={value} measured on {} ({which}): expected a positive number, since the bisection compares ratios of {metric}; pick a --metric whose values are above 0",
        &sha[..12]
    )
}

/// The last `NAME=NUMBER` token of `text`.
pub fn parse_metric(text: &str, name: &str) -> Option<f64> {
    let prefix = format!("{name}=");
    text.split_whitespace()
        .filter_map(|t| t.strip_prefix(&prefix)?.parse::<f64>().ok())
        .rfind(|v| v.is_finite())
}

fn load(path: &Path) -> Result<Vec<Measurement>> {
    let text = match crate::fsx::read_text_bounded(path, crate::fsx::MAX_RUN_FILE_BYTES) {
        Ok(t) => t,
        Err(e) if crate::fsx::is_not_found(&e) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l)
                .with_context(|| format!("{} line {}: not a measurement", path.display(), i + 1))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_midpoint_halves_the_range_left() {
        assert_eq!((midpoint(0, 1), midpoint(0, 4), midpoint(3, 5)), (None, Some(2), Some(4)));
    }

    #[test]
    fn the_metric_is_the_last_name_value_token() {
        assert_eq!(parse_metric("warm time_ms=9\ntime_ms=12.5 other=1\n", "time_ms"), Some(12.5));
        assert_eq!(parse_metric("time_ms=abc time_ms=inf", "time_ms"), None);
        assert_eq!(parse_metric("xtime_ms=3", "time_ms"), None);
        assert_eq!(
            metric_arg("a b").unwrap_err(),
            "\"a b\": expected a metric name without spaces or '=', such as time_ms"
        );
    }
}
