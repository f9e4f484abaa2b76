//! `cargo xtask bisect --good REV --bad REV --metric NAME -- TASK ARGS...`: the first
//! commit that made a measurement worse, found by measuring rather than guessing.
//!
//! Each probed revision is checked out as a detached git worktree under the run
//! directory, built (`cargo build --release -p kiln`, one target directory shared by
//! every revision of the run) or, with `--no-build`, taken as the file `--bin` names in
//! it; the binary is copied out and the worktree removed at once, so an interrupted run
//! leaves none behind. TASK ARGS is then run as given (no shell), with `{bin}` in any
//! argument replaced by that binary's path, and prints the metric as `NAME=VALUE` on its
//! standard output (the last such token counts). A revision is measured against the good
//! one in ABBA pairs (good probe, probe good, ...), first `--min-pairs` of them, then one
//! pair at a time, and judged on the confidence sequence of the pairs' log ratios
//! ([`crate::verdict::sequence`], valid however many pairs it took) at `--margin`:
//! `like good` when the whole interval lies within the margin (two one-sided tests),
//! `like bad` when it lies wholly beyond the margin on the side the bad revision is,
//! else more pairs up to `--max-pairs`, then `undecided`, which ends the bisection with
//! the range that is left rather than a guess. The bad revision is measured first; when it
//! is not `like bad` there is nothing to bisect. Every run's value is appended to
//! `measurements.jsonl` as it is taken, so `--resume DIR` continues a stopped bisection
//! without measuring anything twice.
//!
//! The build runs in a process group of its own, which a signal stops whole: cargo and
//! every rustc it started, not cargo alone.
//!
//! Each worktree is locked with the run's pid as the reason, so one that a run killed
//! where it could not clean up (SIGKILL) left registered is found by the next run in the
//! repository, new or resumed, and removed. `measurements.jsonl` is created with the run
//! directory, so a run stopped before its first value (in its first build) is resumable.
//!
//! A value that is not a positive number cannot be a ratio's term: it is refused at its
//! first reading, naming the metric, the revision and the value (exit 2), and not recorded.

use std::fmt::Write as _;
use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use xshell::Shell;

use crate::child::{self, Shutdown, Waited};
use crate::console::usage;
use crate::verdict::equivalence::{self, Equivalence};
use crate::verdict::sequence;

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
    /// A probe within ±PCT% of the good revision is like good; beyond it, on the bad
    /// revision's side, like bad.
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

/// What a probe's pairs say.
#[derive(Clone, Debug, PartialEq)]
pub enum Call {
    /// Within the margin of the good revision.
    LikeGood,
    /// Beyond it, on the bad revision's side.
    LikeBad,
    /// Beyond it, on the other side (faster than good: not this regression).
    Other,
    /// Not decided yet.
    Undecided,
}

impl Call {
    fn as_str(&self) -> &'static str {
        match self {
            Call::LikeGood => "like good",
            Call::LikeBad => "like bad",
            Call::Other => "differs, but on the other side of good",
            Call::Undecided => "undecided",
        }
    }
}

/// The call on (good, probe) pairs at `margin`; `bad_side` is the sign of the bad
/// revision's log ratio (0 while the bad revision itself is being measured: any side).
pub fn call(pairs: &[(f64, f64)], margin: f64, bad_side: f64) -> (Call, Option<crate::student_t::Interval>) {
    let probe_over_good: Vec<(f64, f64)> = pairs.iter().map(|(g, p)| (*p, *g)).collect();
    let Some(r) = sequence::paired_ratio(&probe_over_good) else { return (Call::Undecided, None) };
    if r.ci95.is_none() {
        return (Call::Undecided, Some(r));
    }
    let c = match equivalence::judge(&r, margin, sequence::half_factor) {
        Equivalence::Equivalent => Call::LikeGood,
        Equivalence::Differs if bad_side == 0.0 || r.mean.ln().signum() == bad_side => Call::LikeBad,
        Equivalence::Differs => Call::Other,
        Equivalence::Undecided { .. } => Call::Undecided,
    };
    (c, Some(r))
}

/// The next index to probe in `lo..hi` (exclusive ends: lo is like good, hi like bad).
pub fn midpoint(lo: usize, hi: usize) -> Option<usize> {
    (hi - lo > 1).then(|| lo + (hi - lo) / 2)
}

/// The repository's git.
struct Git<'a>(&'a Path);

impl Git<'_> {
    fn run(&self, args: &[&str]) -> Result<String> {
        let out = Command::new("git").current_dir(self.0).args(args).output().context("running git")?;
        if !out.status.success() {
            bail!("git {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }
}

/// A worktree that is removed when dropped, whatever ends its scope (an error, a signal).
struct Worktree<'a> {
    git: &'a Git<'a>,
    dir: PathBuf,
}

impl Drop for Worktree<'_> {
    fn drop(&mut self) {
        remove_worktree(self.git, &self.dir);
    }
}

/// The lock reason of every worktree a run adds, before its pid.
const LOCK_REASON: &str = "kiln bisect pid ";

/// Unlocks and removes the worktree at `dir`, and its registration; a directory git will
/// not remove is deleted and the registration pruned.
fn remove_worktree(git: &Git<'_>, dir: &Path) {
    let d = dir.display().to_string();
    let _ = git.run(&["worktree", "unlock", &d]);
    if git.run(&["worktree", "remove", "--force", &d]).is_err() {
        let _ = fs::remove_dir_all(dir);
        let _ = git.run(&["worktree", "prune"]);
    }
}

/// Removes the worktrees that earlier runs left registered: a run killed by a signal it
/// cannot trap (SIGKILL) never reaches [`Worktree`]'s drop. A worktree is stale when its
/// lock names the pid of a process that is gone; a live run's are left alone.
fn remove_stale_worktrees(git: &Git<'_>) {
    let _ = git.run(&["worktree", "prune"]);
    let Ok(list) = git.run(&["worktree", "list", "--porcelain"]) else { return };
    for entry in list.split("\n\n") {
        let path = entry.lines().find_map(|l| l.strip_prefix("worktree "));
        let pid = entry
            .lines()
            .find_map(|l| l.strip_prefix("locked ")?.strip_prefix(LOCK_REASON)?.trim().parse::<i32>().ok());
        if let (Some(path), Some(pid)) = (path, pid)
            && !process_alive(pid)
        {
            eprintln!("removing the worktree {path}: bisect pid {pid}, which added it, is gone");
            remove_worktree(git, Path::new(path));
        }
    }
}

/// Whether a process with this pid exists (a reused pid counts: the worktree is kept).
fn process_alive(pid: i32) -> bool {
    match rustix::process::Pid::from_raw(pid) {
        Some(p) => !matches!(rustix::process::test_kill_process(p), Err(e) if e == rustix::io::Errno::SRCH),
        None => false,
    }
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
            Some(r) => crate::sweep::user_path(r)?,
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
                let d = crate::sweep::user_path(d)?;
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
                    Some(d) => crate::sweep::user_path(d)?,
                    None => root.join("benchmarks/runs"),
                };
                let d = crate::runs::create_run_dir(&runs, "bisect")?;
                // Created with the directory, so the run is resumable from here on, even
                // when it is stopped before its first value (in the first build).
                let m = d.join("measurements.jsonl");
                fs::File::create(&m).with_context(|| format!("creating {}", m.display()))?;
                d
            }
        };
        let shutdown = Shutdown::install()?;
        remove_stale_worktrees(&git);
        let mut known = load(&run_dir.join("measurements.jsonl"))?;
        eprintln!(
            "bisect: {} candidate commits between {} and {}; run directory {}",
            line.len(),
            &good[..12],
            &bad[..12],
            run_dir.display()
        );
        let mut log = String::new();
        let _ = writeln!(
            log,
            "bisect of `{}` at ±{}%: probe / good per ABBA pair, 95% interval from the confidence sequence on the log ratios\n",
            self.metric, self.margin
        );
        let _ = writeln!(
            log,
            "| step | commit | subject | pairs | probe / good | call |\n|---:|---|---|---:|---|---|"
        );
        let ctx = Ctx { bisect: &self, git: &git, run_dir: &run_dir, shutdown: &shutdown, good: &good };
        let good_bin = match ctx.binary(&good)? {
            Step::Done(b) => b,
            Step::Signal(sig) => return Ok(interrupted(sig, &log, &run_dir)),
        };
        // Step 0: is bad bad at all?
        let (c, r, n) = match ctx.measure(&bad, &good_bin, 0.0, &mut known)? {
            Step::Done(x) => x,
            Step::Signal(sig) => return Ok(interrupted(sig, &log, &run_dir)),
        };
        row(&mut log, 0, &git, &bad, n, r, &c);
        if c != Call::LikeBad {
            let _ =
                writeln!(log, "\nthe bad revision is {} against the good one: nothing to bisect", c.as_str());
            return finish(&run_dir, &log, ExitCode::FAILURE);
        }
        let bad_side = r.map_or(0.0, |r| r.mean.ln().signum());
        // ext[0] is the good revision, ext[1..] the candidates, the last of them bad:
        // ext[lo] is like good and ext[hi] like bad throughout.
        let ext: Vec<&str> = std::iter::once(good.as_str()).chain(line.iter().map(String::as_str)).collect();
        let (mut lo, mut hi) = (0usize, ext.len() - 1);
        let mut step = 1;
        while let Some(mid) = midpoint(lo, hi) {
            let probe = ext[mid];
            let (c, r, n) = match ctx.measure(probe, &good_bin, bad_side, &mut known)? {
                Step::Done(x) => x,
                Step::Signal(sig) => return Ok(interrupted(sig, &log, &run_dir)),
            };
            row(&mut log, step, &git, probe, n, r, &c);
            step += 1;
            match c {
                Call::LikeGood | Call::Other => lo = mid,
                Call::LikeBad => hi = mid,
                Call::Undecided => {
                    let _ = writeln!(
                        log,
                        "\nundecided: {} stayed undecided after {n} pairs; the first bad commit is after {} and at or before {} (raise --max-pairs or widen --margin to go on)",
                        &probe[..12],
                        &ext[lo][..12],
                        &ext[hi][..12]
                    );
                    return finish(&run_dir, &log, ExitCode::FAILURE);
                }
            }
        }
        let first = ext[hi];
        let subject = git.run(&["log", "-1", "--format=%s", first]).unwrap_or_default();
        let _ = writeln!(log, "\nfirst bad commit: {first} {subject}");
        finish(&run_dir, &log, ExitCode::SUCCESS)
    }
}

/// What every step shares.
struct Ctx<'a> {
    bisect: &'a Bisect,
    git: &'a Git<'a>,
    run_dir: &'a Path,
    shutdown: &'a Shutdown,
    good: &'a str,
}

impl Ctx<'_> {
    /// The binary of `sha`, built (or copied) from a worktree that is removed at once;
    /// reused when the run directory already has it.
    fn binary(&self, sha: &str) -> Result<Step<PathBuf>> {
        let name =
            self.bisect.bin.as_ref().and_then(|b| b.file_name()).map_or("kiln".into(), |n| n.to_os_string());
        let out = self.run_dir.join("bin").join(&sha[..12]).join(&name);
        if out.is_file() {
            return Ok(Step::Done(out));
        }
        let dir = self.run_dir.join(format!("worktree-{}", &sha[..12]));
        // One left by a killed run of this directory (resumed now) is no longer anyone's.
        if dir.exists() {
            remove_worktree(self.git, &dir);
        }
        let _ = self.git.run(&["worktree", "prune"]);
        let reason = format!("{LOCK_REASON}{}", std::process::id());
        self.git.run(&[
            "worktree",
            "add",
            "--detach",
            "--lock",
            "--reason",
            &reason,
            &dir.display().to_string(),
            sha,
        ])?;
        let tree = Worktree { git: self.git, dir };
        let built = if self.bisect.no_build {
            tree.dir.join(self.bisect.bin.as_deref().unwrap_or(Path::new("kiln")))
        } else {
            let target = self.run_dir.join("target");
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let mut cmd = Command::new(cargo);
            cmd.current_dir(&tree.dir).env("CARGO_TARGET_DIR", &target).args([
                "build",
                "--release",
                "--package",
                "kiln",
            ]);
            eprintln!("building {} in {}", &sha[..12], tree.dir.display());
            // Its own group: a signal stops cargo and every rustc it started, not cargo alone.
            let owned = child::spawn(&mut cmd).context("starting cargo")?;
            match owned.wait(self.shutdown, None, Duration::from_secs(10))? {
                Waited::Exited(st) if st.success() => {}
                Waited::Exited(st) => bail!("building {} failed ({st})", &sha[..12]),
                Waited::TimedOut => bail!("building {} timed out", &sha[..12]),
                Waited::Interrupted(sig) => return Ok(Step::Signal(sig)),
            }
            target.join("release/kiln")
        };
        if !built.is_file() {
            bail!("{}: no binary at {} in its worktree", &sha[..12], built.display());
        }
        fs::create_dir_all(out.parent().unwrap_or(self.run_dir))?;
        fs::copy(&built, &out).with_context(|| format!("copying {} out of its worktree", built.display()))?;
        drop(tree);
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
    /// out; every value is appended to `measurements.jsonl` as it is taken.
    fn measure(
        &self,
        sha: &str,
        good_bin: &Path,
        bad_side: f64,
        known: &mut Vec<Measurement>,
    ) -> Result<Step<(Call, Option<crate::student_t::Interval>, usize)>> {
        let bin = match self.binary(sha)? {
            Step::Done(b) => b,
            Step::Signal(s) => return Ok(Step::Signal(s)),
        };
        let mut file =
            OpenOptions::new().create(true).append(true).open(self.run_dir.join("measurements.jsonl"))?;
        let mut pairs: Vec<(f64, f64)> = Vec::new();
        loop {
            let k = pairs.len();
            // ABBA: good first in even pairs, the probe first in odd ones.
            let order = if k.is_multiple_of(2) { [false, true] } else { [true, false] };
            let mut got = [0.0f64; 2];
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
                        v
                    }
                };
                got[usize::from(probe)] = v;
            }
            pairs.push((got[0], got[1]));
            if pairs.len() < self.bisect.min_pairs as usize {
                continue;
            }
            let (c, r) = call(&pairs, self.bisect.margin, bad_side);
            eprintln!(
                "  {}: {} pairs, probe/good {}: {}",
                &sha[..12],
                pairs.len(),
                r.map_or("-".into(), |r| format!("{:.3}", r.mean)),
                c.as_str()
            );
            if c != Call::Undecided || pairs.len() >= self.bisect.max_pairs as usize {
                return Ok(Step::Done((c, r, pairs.len())));
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

fn row(
    log: &mut String,
    step: usize,
    git: &Git<'_>,
    sha: &str,
    n: usize,
    r: Option<crate::student_t::Interval>,
    c: &Call,
) {
    let subject = git.run(&["log", "-1", "--format=%s", sha]).unwrap_or_default().replace('|', "\\|");
    let ratio = match r {
        Some(crate::student_t::Interval { mean, ci95: Some((lo, hi)), .. }) => {
            format!("{mean:.3} [{lo:.3}, {hi:.3}]")
        }
        Some(r) => format!("{:.3} (no interval yet)", r.mean),
        None => "-".into(),
    };
    let _ = writeln!(log, "| {step} | {} | {subject} | {n} | {ratio} | {} |", &sha[..12], c.as_str());
}

fn finish(run_dir: &Path, log: &str, code: ExitCode) -> Result<ExitCode> {
    fs::write(run_dir.join("summary.md"), log).context("writing summary.md")?;
    crate::console::out(log)?;
    eprintln!("results: {}", run_dir.display());
    Ok(code)
}

fn interrupted(sig: i32, log: &str, run_dir: &Path) -> ExitCode {
    let _ = crate::console::out(&format!(
        "{log}\ninterrupted by {}: resume with --resume {}\n",
        child::signal_name(sig),
        run_dir.display()
    ));
    ExitCode::from(child::exit_code_for(sig))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_follow_the_interval_and_the_bad_side() {
        let steady = |r: f64| -> Vec<(f64, f64)> {
            [1.0, 1.01, 0.99, 1.0, 1.005].iter().map(|j| (100.0, 100.0 * r * j)).collect()
        };
        assert_eq!(call(&steady(1.0), 5.0, 1.0).0, Call::LikeGood);
        assert_eq!(call(&steady(1.5), 5.0, 1.0).0, Call::LikeBad);
        assert_eq!(call(&steady(1.5), 5.0, 0.0).0, Call::LikeBad, "measuring bad itself: any side");
        assert_eq!(call(&steady(0.6), 5.0, 1.0).0, Call::Other);
        assert_eq!(call(&steady(1.05), 5.0, 1.0).0, Call::Undecided, "on the margin");
        assert_eq!(call(&steady(1.5)[..3], 5.0, 1.0).0, Call::Undecided, "3 pairs: unbounded");
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
