//! The runner: executes one cell and returns its outcome. Today that is a local `kiln`
//! child in its own process group, with a timeout, its output in per-cell logs; the
//! [`CellRunner`] trait is the seam where a cluster task array can stand in.

use std::fs::{self, File};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};

use super::classify::{self, ChildExit, KILN_BY_RULE_EXIT_CODE, Status};
use super::layers::{DeviceBudget, EstimateFacts};
use super::plan::{Cell, Prompt};
use crate::child::{self, Shutdown, Waited};
use crate::kiln_build::Backend;
use kiln_protocol::{DecodeReport, EstimateReport, ReportError};

/// A step that either finished or was cut short by a signal.
#[derive(Debug)]
pub enum Ran<T> {
    /// It finished.
    Done(T),
    /// A signal arrived; the child was killed and reaped.
    Interrupted(i32),
}

/// What running a cell produced.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The row's status.
    pub status: Status,
    /// The engine's report, for `ok`.
    pub report: Option<DecodeReport>,
    /// For `SKIP:oom`: what the cell needed when it was refused, when it said.
    pub oom_demand_bytes: Option<u64>,
    /// Why it is not `ok`, in one line.
    pub reason: Option<String>,
    /// Where it ran.
    pub host: String,
    /// On what.
    pub device: String,
    /// Where its output is.
    pub log: String,
}

/// Executes cells. Implementations decide where; the sweep only sees outcomes. Where a
/// model is, and whether a cell fits its context, is the engine's answer (`kiln
/// estimate`), never the harness's.
pub trait CellRunner {
    /// `kiln estimate` for the cell.
    fn estimate(&mut self, index: usize, cell: &Cell) -> Result<Ran<EstimateFacts>>;
    /// `kiln bench-decode` for the cell.
    fn run(&mut self, index: usize, cell: &Cell) -> Result<Ran<Outcome>>;
    /// The device the cells run on (what record lines are scoped to).
    fn device(&self) -> &str;
    /// The memory the estimate layer prices cells against when they run on a GPU whose
    /// memory the harness knows; `None` leaves the verdict to the engine's estimate.
    fn device_budget(&self) -> Option<&DeviceBudget> {
        None
    }
}

/// Knobs passed through to every engine call: the protocol's set, whose `to_args` is
/// the command line every call gets.
pub use kiln_protocol::Knobs as EngineKnobs;

/// Runs cells as local child processes.
pub struct LocalRunner<'a> {
    /// The `kiln` binary.
    pub kiln: PathBuf,
    /// The children's working directory (the workspace root, where `models/` is).
    pub workdir: PathBuf,
    /// Where relative model paths the user typed are resolved.
    pub user_cwd: PathBuf,
    /// The harness's cgroup's `memory.events`, the evidence of a kernel OOM kill.
    pub memory_events: Option<PathBuf>,
    /// Per-cell logs go here.
    pub run_dir: PathBuf,
    /// Passed to every call.
    pub knobs: EngineKnobs,
    /// The backend every call runs on (`--backend`, passed only when not the CPU).
    pub backend: Backend,
    /// Per cell.
    pub cell_timeout: Duration,
    /// This host.
    pub host: String,
    /// This device.
    pub device: String,
    /// On a GPU: its memory, or the memory limit when smaller.
    pub device_budget: Option<DeviceBudget>,
    /// `--measure-roofs`: every bench-decode measures the CPU's roofs beside its run.
    pub measure_roofs: bool,
    /// Signals and child exits.
    pub shutdown: &'a Shutdown,
}

impl LocalRunner<'_> {
    pub(crate) fn model_arg(&self, cell: &Cell) -> String {
        model_arg(&self.user_cwd, &self.workdir, &cell.model)
    }

    pub(crate) fn log_base(&self, index: usize, cell: &Cell) -> PathBuf {
        log_base(&self.run_dir, index, cell)
    }

    /// What every engine call gets after its own arguments: the backend (nothing for the
    /// CPU, so an older binary runs as before), then the knobs.
    pub(crate) fn engine_args(&self) -> Vec<String> {
        let mut args = crate::kiln_build::backend_args(self.backend);
        args.extend(self.knobs.to_args());
        args
    }

    /// Runs `kiln args...` with stdout and stderr in `<base>.stdout` / `<base>.stderr`.
    fn spawn_and_wait(
        &self,
        args: &[String],
        cell: &Cell,
        base: &Path,
        timeout: Duration,
    ) -> Result<Ran<(ChildExit, String, String)>> {
        let mut cmd = Command::new(&self.kiln);
        cmd.args(args).current_dir(&self.workdir).envs(&cell.env);
        run_logged(cmd, &format!("cell {cell}"), base, timeout, self.shutdown)
    }
}

/// `<run_dir>/NNN-<label>`, the stem of cell `index`'s log files, the label reduced to
/// characters safe in a file name.
pub fn log_base(run_dir: &Path, index: usize, cell: &Cell) -> PathBuf {
    let label: String = cell
        .label()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '@' | '+' | '#') { c } else { '_' })
        .take(80)
        .collect();
    run_dir.join(format!("{:03}-{label}", index + 1))
}

/// The `-m` argument: a path that exists relative to where the user typed it is passed
/// absolute (the engine runs in the workspace root); anything else is passed as given,
/// for the engine to resolve by its own rules.
pub fn model_arg(user_cwd: &Path, workdir: &Path, model: &str) -> String {
    let typed = user_cwd.join(model);
    if !model.is_empty() && user_cwd != workdir && typed.exists() {
        typed.display().to_string()
    } else {
        model.to_string()
    }
}

/// Runs `cmd` to completion in its own process group with stdin closed and stdout and
/// stderr in `<base>.stdout` / `<base>.stderr`, killed at `timeout` or on a signal (at
/// once: a measured program holds nothing worth a grace period); returns its exit and
/// both outputs. `what` names it in errors.
pub fn run_logged(
    mut cmd: Command,
    what: &str,
    base: &Path,
    timeout: Duration,
    shutdown: &Shutdown,
) -> Result<Ran<(ChildExit, String, String)>> {
    let out_path = base.with_extension(ext(base, "stdout"));
    let err_path = base.with_extension(ext(base, "stderr"));
    let stdout = File::create(&out_path).with_context(|| format!("creating {}", out_path.display()))?;
    let stderr = File::create(&err_path).with_context(|| format!("creating {}", err_path.display()))?;
    cmd.stdin(Stdio::null()).stdout(stdout).stderr(stderr);
    let program = cmd.get_program().to_string_lossy().into_owned();
    let child = child::spawn(&mut cmd).with_context(|| format!("starting {program} for {what}"))?;
    let exit = match child.wait(shutdown, Some(timeout), Duration::ZERO)? {
        Waited::Interrupted(sig) => return Ok(Ran::Interrupted(sig)),
        Waited::TimedOut => ChildExit::TimedOut,
        Waited::Exited(st) => child_exit(st),
    };
    let read = |p: &Path| fs::read(p).map(|b| String::from_utf8_lossy(&b).into_owned());
    let out = read(&out_path).with_context(|| format!("reading {}", out_path.display()))?;
    let err = read(&err_path).with_context(|| format!("reading {}", err_path.display()))?;
    Ok(Ran::Done((exit, out, err)))
}

/// `base.stdout` even when the label holds dots (`model@1.5`): the extension is appended,
/// never substituted.
pub fn ext(base: &Path, suffix: &str) -> String {
    match base.extension() {
        Some(e) => format!("{}.{suffix}", e.to_string_lossy()),
        None => suffix.to_string(),
    }
}

fn child_exit(st: ExitStatus) -> ChildExit {
    match (st.code(), st.signal()) {
        (Some(c), _) => ChildExit::Code(c),
        (None, Some(s)) => ChildExit::Signal(s),
        (None, None) => ChildExit::Code(-1),
    }
}

impl LocalRunner<'_> {
    /// Runs `kiln args...` (the engine knobs are the caller's to add) as cell `index`
    /// and classifies it with the report parser `parse`; also the stderr log's path.
    pub(crate) fn run_kiln<R>(
        &self,
        index: usize,
        cell: &Cell,
        args: &[String],
        parse: impl Fn(&str) -> Result<Option<R>, ReportError>,
    ) -> Result<Ran<(Classified<R>, String)>> {
        let base = self.log_base(index, cell);
        let oom_kills_before = self.memory_events.as_deref().and_then(classify::oom_kill_count);
        let (exit, out, err) = match self.spawn_and_wait(args, cell, &base, self.cell_timeout)? {
            Ran::Done(x) => x,
            Ran::Interrupted(sig) => return Ok(Ran::Interrupted(sig)),
        };
        let oom_kills_after = self.memory_events.as_deref().and_then(classify::oom_kill_count);
        let evidence = Evidence {
            oom_kill_rose: matches!((oom_kills_before, oom_kills_after), (Some(b), Some(a)) if a > b),
        };
        let c = classify_child(exit, &out, &err, self.cell_timeout, evidence, parse);
        Ok(Ran::Done((c, base.with_extension(ext(&base, "stderr")).display().to_string())))
    }
}

impl CellRunner for LocalRunner<'_> {
    fn estimate(&mut self, index: usize, cell: &Cell) -> Result<Ran<EstimateFacts>> {
        let Prompt::Tokens(n) = cell.prompt else { return Ok(Ran::Done(EstimateFacts::NotApplicable)) };
        let mut args = vec![
            "estimate".to_string(),
            "-m".into(),
            self.model_arg(cell),
            "--prompt-tokens".into(),
            n.to_string(),
            // Warm-up steps are part of the generated tokens (docs/engine-protocol.md).
            "--max-tokens".into(),
            cell.max_tokens.to_string(),
        ];
        args.extend(self.engine_args());
        let base = self.log_base(index, cell);
        let base = base.with_extension(ext(&base, "estimate"));
        // The estimate reads a config, never weights, but a slow disk or a huge config is
        // bounded by the same limit as the cell it guards.
        let (exit, out, err) = match self.spawn_and_wait(&args, cell, &base, self.cell_timeout)? {
            Ran::Done(x) => x,
            Ran::Interrupted(sig) => return Ok(Ran::Interrupted(sig)),
        };
        Ok(Ran::Done(estimate_facts(exit, &out, &err, self.cell_timeout)))
    }

    fn run(&mut self, index: usize, cell: &Cell) -> Result<Ran<Outcome>> {
        let mut args = vec!["bench-decode".to_string(), "-m".into(), self.model_arg(cell)];
        match &cell.prompt {
            Prompt::Tokens(n) => args.extend(["--prompt-tokens".into(), n.to_string()]),
            Prompt::Text(t) => args.extend(["-p".into(), t.clone()]),
        }
        args.extend([
            "-n".into(),
            cell.max_tokens.to_string(),
            "--warmup-tokens".into(),
            cell.warmup_tokens.to_string(),
            "--format".into(),
            "json".into(),
        ]);
        args.extend(self.engine_args());
        if self.measure_roofs {
            args.push("--measure-roofs".into());
        }
        let (c, log) = match self.run_kiln(index, cell, &args, DecodeReport::parse)? {
            Ran::Done(x) => x,
            Ran::Interrupted(sig) => return Ok(Ran::Interrupted(sig)),
        };
        Ok(Ran::Done(Outcome {
            status: c.status,
            report: c.report,
            oom_demand_bytes: c.oom_demand_bytes,
            reason: c.reason,
            host: self.host.clone(),
            device: self.device.clone(),
            log,
        }))
    }

    fn device(&self) -> &str {
        &self.device
    }

    fn device_budget(&self) -> Option<&DeviceBudget> {
        self.device_budget.as_ref()
    }
}

/// What the estimate's exit and output say.
pub fn estimate_facts(exit: ChildExit, stdout: &str, stderr: &str, timeout: Duration) -> EstimateFacts {
    match exit {
        ChildExit::Code(0) => match EstimateReport::parse(stdout) {
            Ok(Some(r)) => EstimateFacts::Report(Box::new(r)),
            Ok(None) => EstimateFacts::Failed("it printed no result".into()),
            Err(e) => EstimateFacts::Failed(e.to_string()),
        },
        ChildExit::Code(KILN_BY_RULE_EXIT_CODE) => {
            let reason = classify::reason_line(stderr);
            if classify::is_missing_model(stderr) {
                EstimateFacts::MissingModel(reason)
            } else {
                EstimateFacts::ByRule(reason)
            }
        }
        ChildExit::TimedOut => {
            EstimateFacts::Failed(format!("timed out after {}s (--cell-timeout)", timeout.as_secs()))
        }
        other => EstimateFacts::Failed(format!("{other}: {}", classify::failure_reason(stderr))),
    }
}

/// A classified engine child (`bench-decode` unless said otherwise).
#[derive(Debug)]
pub struct Classified<R = DecodeReport> {
    /// The status.
    pub status: Status,
    /// The report, for `ok`.
    pub report: Option<R>,
    /// For `SKIP:oom`.
    pub oom_demand_bytes: Option<u64>,
    /// Why it is not `ok`.
    pub reason: Option<String>,
}

/// What the harness saw around a cell besides its exit and output.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Evidence {
    /// The cgroup's `oom_kill` count rose while the cell ran.
    pub oom_kill_rose: bool,
}

/// Classifies a finished `bench-decode`: see [`classify_child`].
#[cfg(test)]
pub fn classify_run(
    exit: ChildExit,
    stdout: &str,
    stderr: &str,
    timeout: Duration,
    evidence: Evidence,
) -> Classified {
    classify_child(exit, stdout, stderr, timeout, evidence, DecodeReport::parse)
}

/// Classifies a finished engine child whose report `parse` reads: a timeout first (never
/// an OOM), then a clean exit with its report, then out of memory (only on evidence),
/// then a refusal by rule, then a kill, an abort or another failure.
pub fn classify_child<R>(
    exit: ChildExit,
    stdout: &str,
    stderr: &str,
    timeout: Duration,
    evidence: Evidence,
    parse: impl Fn(&str) -> Result<Option<R>, ReportError>,
) -> Classified<R> {
    let fail = |status, reason: String| Classified {
        status,
        report: None,
        oom_demand_bytes: None,
        reason: Some(reason),
    };
    if exit == ChildExit::TimedOut {
        return fail(Status::Timeout, format!("killed after {}s (--cell-timeout)", timeout.as_secs()));
    }
    if exit == ChildExit::Code(0) {
        return match parse(stdout) {
            Ok(Some(report)) => {
                Classified { status: Status::Ok, report: Some(report), oom_demand_bytes: None, reason: None }
            }
            Ok(None) => fail(Status::NoOutput, "exit 0 with nothing on stdout".into()),
            Err(e) => fail(Status::Bench, e.to_string()),
        };
    }
    let text = format!("{stdout}\n{stderr}");
    if classify::is_oom(exit, &text, evidence.oom_kill_rose) {
        let why = if exit == ChildExit::Signal(classify::SIGKILL) {
            "the cgroup's oom_kill count rose during the cell".to_string()
        } else {
            classify::reason_line(stderr)
        };
        return Classified {
            status: Status::Oom,
            report: None,
            oom_demand_bytes: classify::oom_demand_bytes(&text),
            reason: Some(format!("{exit}: {why}")),
        };
    }
    if exit == ChildExit::Code(KILN_BY_RULE_EXIT_CODE) {
        let status =
            if classify::is_missing_model(stderr) { Status::MissingModel } else { Status::Unsupported };
        return fail(status, classify::reason_line(stderr));
    }
    if classify::is_abort(&text) {
        return fail(Status::Abort, format!("{exit}: {}", classify::failure_reason(stderr)));
    }
    if exit == ChildExit::Signal(classify::SIGKILL) {
        return fail(
            Status::Killed,
            format!(
                "{exit} from outside the harness, with no out-of-memory kill in the cgroup's memory.events"
            ),
        );
    }
    fail(Status::Bench, format!("{exit}: {}", classify::failure_reason(stderr)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(5);

    fn classify(exit: ChildExit, stdout: &str, stderr: &str) -> Classified {
        classify_run(exit, stdout, stderr, T, Evidence::default())
    }

    #[test]
    fn classification_covers_every_way_a_cell_ends() {
        let c = classify(ChildExit::TimedOut, "", "out of memory: requested");
        assert_eq!(c.status, Status::Timeout);
        let c = classify(ChildExit::Code(0), "", "");
        assert_eq!(c.status, Status::NoOutput);
        let c = classify(ChildExit::Code(0), "{\"model\":1}", "");
        assert_eq!(c.status, Status::Bench);
        assert!(c.reason.unwrap().contains("malformed result"));
        let oom = "error: out of memory: requested 4 KiB (4096 bytes) for kv with 1 KiB (1024 bytes) in use, limit 4 KiB (4096 bytes)";
        let c = classify(ChildExit::Code(3), "", oom);
        assert_eq!((c.status, c.oom_demand_bytes), (Status::Oom, Some(5120)));
        let c = classify(ChildExit::Code(2), "", "error: invalid geometry: group size 48");
        assert_eq!(c.status, Status::Unsupported);
        assert_eq!(c.reason.unwrap(), "invalid geometry: group size 48");
        let c = classify(ChildExit::Code(2), "", "error: model not found: ./m: expected synthetic:<profile>");
        assert_eq!(c.status, Status::MissingModel);
        let c = classify(ChildExit::Signal(11), "", "");
        assert_eq!(c.status, Status::Bench);
    }

    #[test]
    fn only_evidence_makes_an_oom() {
        // kill -9 from outside: no oom_kill in the cgroup.
        let c = classify(ChildExit::Signal(9), "", "");
        assert_eq!((c.status, c.oom_demand_bytes), (Status::Killed, None));
        let seen = Evidence { oom_kill_rose: true };
        let c = classify_run(ChildExit::Signal(9), "", "", T, seen);
        assert_eq!(c.status, Status::Oom);
        assert!(c.reason.unwrap().contains("oom_kill"));
        // Exit 3 without kiln's line is not kiln reporting an OOM.
        assert_eq!(classify(ChildExit::Code(3), "", "error: something").status, Status::Bench);
        // A bug's allocation abort, and a panic that talks about memory.
        let abort = "memory allocation of 1099511627776 bytes failed\n";
        let c = classify(ChildExit::Signal(6), "", abort);
        assert_eq!(c.status, Status::Abort);
        assert!(c.reason.unwrap().contains("memory allocation of 1099511627776 bytes failed"));
        let panic = "thread 'main' panicked at src/plan.rs:9:5:\nran out of memory planning 1e9 layers\n\
                     note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n";
        let c = classify(ChildExit::Code(101), "", panic);
        assert_eq!(c.status, Status::Bench);
        assert_eq!(
            c.reason.unwrap(),
            "exit code 101: panicked at src/plan.rs:9:5: ran out of memory planning 1e9 layers"
        );
    }

    #[test]
    fn estimate_outcomes() {
        let t = |exit, out, err| estimate_facts(exit, out, err, T);
        assert!(matches!(t(ChildExit::Code(2), "", "error: bad"), EstimateFacts::ByRule(r) if r == "bad"));
        assert!(matches!(
            t(ChildExit::Code(2), "", "error: model not found: x"),
            EstimateFacts::MissingModel(r) if r == "model not found: x"
        ));
        assert!(matches!(t(ChildExit::Code(0), "", ""), EstimateFacts::Failed(_)));
        assert!(matches!(t(ChildExit::Code(0), "nope", ""), EstimateFacts::Failed(_)));
        assert!(
            matches!(t(ChildExit::Code(1), "", "error: x"), EstimateFacts::Failed(r) if r == "exit code 1: x")
        );
        // The estimate's timeout is the cell's.
        assert!(matches!(
            t(ChildExit::TimedOut, "", ""),
            EstimateFacts::Failed(r) if r == "timed out after 5s (--cell-timeout)"
        ));
    }

    #[test]
    fn log_names_append_their_extension() {
        assert_eq!(ext(Path::new("001-m@1.5"), "stdout"), "5.stdout");
        assert_eq!(
            Path::new("001-m@1.5").with_extension(ext(Path::new("001-m@1.5"), "stdout")),
            Path::new("001-m@1.5.stdout")
        );
        assert_eq!(ext(Path::new("001-m@512"), "stdout"), "stdout");
    }
}
