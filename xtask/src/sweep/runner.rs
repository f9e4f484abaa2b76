//! The runner: executes one cell and returns its outcome. Today that is a local `kiln`
//! child in its own process group, with a timeout, its output in per-cell logs; the
//! [`CellRunner`] trait is the seam where a cluster task array can stand in.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};

use super::classify::{self, ChildExit, KILN_BY_RULE_EXIT_CODE, Status};
use super::layers::EstimateFacts;
use super::plan::{Cell, Prompt};
use super::report::{DecodeReport, EstimateReport};
use crate::child::{self, Group, Shutdown, Waited};

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

/// Executes cells. Implementations decide where; the sweep only sees outcomes.
pub trait CellRunner {
    /// Where the cell's model is, as the `model_path` column shows it; `None` when it is
    /// not there.
    fn locate_model(&mut self, cell: &Cell) -> Option<String>;
    /// `kiln estimate` for the cell.
    fn estimate(&mut self, index: usize, cell: &Cell) -> Result<Ran<EstimateFacts>>;
    /// `kiln bench-decode` for the cell.
    fn run(&mut self, index: usize, cell: &Cell) -> Result<Ran<Outcome>>;
    /// The device the cells run on (what record lines are scoped to).
    fn device(&self) -> &str;
}

/// Knobs passed through to every engine call.
#[derive(Clone, Debug, Default)]
pub struct EngineKnobs {
    /// `--memory-limit`.
    pub memory_limit: Option<String>,
    /// `--prefill-chunk`.
    pub prefill_chunk: Option<u64>,
    /// `--attention`.
    pub attention: Option<String>,
}

impl EngineKnobs {
    fn args(&self) -> Vec<String> {
        let mut a = Vec::new();
        if let Some(m) = &self.memory_limit {
            a.extend(["--memory-limit".into(), m.clone()]);
        }
        if let Some(c) = self.prefill_chunk {
            a.extend(["--prefill-chunk".into(), c.to_string()]);
        }
        if let Some(at) = &self.attention {
            a.extend(["--attention".into(), at.clone()]);
        }
        a
    }
}

/// The timeout of one `kiln estimate`: it reads a config, never weights.
const ESTIMATE_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs cells as local child processes.
pub struct LocalRunner<'a> {
    /// The `kiln` binary.
    pub kiln: PathBuf,
    /// The children's working directory (the workspace root, where `models/` is).
    pub workdir: PathBuf,
    /// Where relative model paths the user typed are resolved.
    pub user_cwd: PathBuf,
    /// Per-cell logs go here.
    pub run_dir: PathBuf,
    /// Passed to every call.
    pub knobs: EngineKnobs,
    /// Per cell.
    pub cell_timeout: Duration,
    /// This host.
    pub host: String,
    /// This device.
    pub device: String,
    /// Signals and child exits.
    pub shutdown: &'a Shutdown,
    /// Model name -> the argument passed to the engine.
    pub located: BTreeMap<String, String>,
}

impl LocalRunner<'_> {
    fn model_arg(&mut self, cell: &Cell) -> String {
        match self.located.get(&cell.model) {
            Some(a) => a.clone(),
            None => cell.model.clone(),
        }
    }

    fn log_base(&self, index: usize, cell: &Cell) -> PathBuf {
        let label: String = cell
            .label()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '@') { c } else { '_' })
            .take(80)
            .collect();
        self.run_dir.join(format!("{:03}-{label}", index + 1))
    }

    /// Runs `kiln args...` with stdout and stderr in `<base>.stdout` / `<base>.stderr`.
    fn spawn_and_wait(
        &self,
        args: &[String],
        cell: &Cell,
        base: &Path,
        timeout: Duration,
    ) -> Result<Ran<(ChildExit, String, String)>> {
        let out_path = base.with_extension(ext(base, "stdout"));
        let err_path = base.with_extension(ext(base, "stderr"));
        let stdout = File::create(&out_path).with_context(|| format!("creating {}", out_path.display()))?;
        let stderr = File::create(&err_path).with_context(|| format!("creating {}", err_path.display()))?;
        let mut cmd = Command::new(&self.kiln);
        cmd.args(args)
            .current_dir(&self.workdir)
            .envs(&cell.env)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr);
        let child = child::spawn(&mut cmd, Group::Own)
            .with_context(|| format!("starting {} for cell {cell}", self.kiln.display()))?;
        // A cell's engine holds nothing worth a grace period: it is killed at once.
        let exit = match child.wait(self.shutdown, Some(timeout), Duration::ZERO)? {
            Waited::Interrupted(sig) => return Ok(Ran::Interrupted(sig)),
            Waited::TimedOut => ChildExit::TimedOut,
            Waited::Exited(st) => child_exit(st),
        };
        let read = |p: &Path| fs::read(p).map(|b| String::from_utf8_lossy(&b).into_owned());
        let out = read(&out_path).with_context(|| format!("reading {}", out_path.display()))?;
        let err = read(&err_path).with_context(|| format!("reading {}", err_path.display()))?;
        Ok(Ran::Done((exit, out, err)))
    }
}

/// `base.stdout` even when the label holds dots (`model@1.5`): the extension is appended,
/// never substituted.
fn ext(base: &Path, suffix: &str) -> String {
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

impl CellRunner for LocalRunner<'_> {
    fn locate_model(&mut self, cell: &Cell) -> Option<String> {
        let spec = &cell.model;
        if spec.starts_with("synthetic:") {
            self.located.insert(spec.clone(), spec.clone());
            return Some(spec.clone());
        }
        let candidates =
            [self.user_cwd.join(spec), self.workdir.join(spec), self.workdir.join("models").join(spec)];
        let dir = candidates.into_iter().find(|d| d.join("config.json").is_file())?;
        let arg = dir.display().to_string();
        self.located.insert(spec.clone(), arg.clone());
        Some(arg)
    }

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
        args.extend(self.knobs.args());
        let base = self.log_base(index, cell);
        let base = base.with_extension(ext(&base, "estimate"));
        let (exit, out, err) = match self.spawn_and_wait(&args, cell, &base, ESTIMATE_TIMEOUT)? {
            Ran::Done(x) => x,
            Ran::Interrupted(sig) => return Ok(Ran::Interrupted(sig)),
        };
        Ok(Ran::Done(estimate_facts(exit, &out, &err)))
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
        args.extend(self.knobs.args());
        let base = self.log_base(index, cell);
        let (exit, out, err) = match self.spawn_and_wait(&args, cell, &base, self.cell_timeout)? {
            Ran::Done(x) => x,
            Ran::Interrupted(sig) => return Ok(Ran::Interrupted(sig)),
        };
        let c = classify_run(exit, &out, &err, self.cell_timeout);
        Ok(Ran::Done(Outcome {
            status: c.status,
            report: c.report,
            oom_demand_bytes: c.oom_demand_bytes,
            reason: c.reason,
            host: self.host.clone(),
            device: self.device.clone(),
            log: base.with_extension(ext(&base, "stderr")).display().to_string(),
        }))
    }

    fn device(&self) -> &str {
        &self.device
    }
}

/// What the estimate's exit and output say.
pub fn estimate_facts(exit: ChildExit, stdout: &str, stderr: &str) -> EstimateFacts {
    match exit {
        ChildExit::Code(0) => match EstimateReport::parse(stdout) {
            Ok(Some(r)) => EstimateFacts::Report(r),
            Ok(None) => EstimateFacts::Failed("it printed no result".into()),
            Err(e) => EstimateFacts::Failed(format!("{e:#}")),
        },
        ChildExit::Code(KILN_BY_RULE_EXIT_CODE) => EstimateFacts::ByRule(classify::reason_line(stderr)),
        ChildExit::TimedOut => {
            EstimateFacts::Failed(format!("timed out after {}s", ESTIMATE_TIMEOUT.as_secs()))
        }
        other => EstimateFacts::Failed(format!("{other}: {}", classify::reason_line(stderr))),
    }
}

/// A classified `bench-decode`.
#[derive(Debug)]
pub struct Classified {
    /// The status.
    pub status: Status,
    /// The report, for `ok`.
    pub report: Option<DecodeReport>,
    /// For `SKIP:oom`.
    pub oom_demand_bytes: Option<u64>,
    /// Why it is not `ok`.
    pub reason: Option<String>,
}

/// Classifies a finished `bench-decode`: a timeout first (never an OOM), then a clean
/// exit with its report, then out of memory, then a refusal by rule, then a failure.
pub fn classify_run(exit: ChildExit, stdout: &str, stderr: &str, timeout: Duration) -> Classified {
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
        return match DecodeReport::parse(stdout) {
            Ok(Some(report)) => {
                Classified { status: Status::Ok, report: Some(report), oom_demand_bytes: None, reason: None }
            }
            Ok(None) => fail(Status::NoOutput, "exit 0 with nothing on stdout".into()),
            Err(e) => fail(Status::Bench, format!("{e:#}")),
        };
    }
    let text = format!("{stdout}\n{stderr}");
    if classify::is_oom(exit, &text) {
        return Classified {
            status: Status::Oom,
            report: None,
            oom_demand_bytes: classify::oom_demand_bytes(&text),
            reason: Some(format!("{exit}: {}", classify::reason_line(stderr))),
        };
    }
    if exit == ChildExit::Code(KILN_BY_RULE_EXIT_CODE) {
        return fail(Status::Unsupported, classify::reason_line(stderr));
    }
    fail(Status::Bench, format!("{exit}: {}", classify::reason_line(stderr)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn classification_covers_every_way_a_cell_ends() {
        let c = classify_run(ChildExit::TimedOut, "", "out of memory: requested", T);
        assert_eq!(c.status, Status::Timeout);
        let c = classify_run(ChildExit::Code(0), "", "", T);
        assert_eq!(c.status, Status::NoOutput);
        let c = classify_run(ChildExit::Code(0), "{\"model\":1}", "", T);
        assert_eq!(c.status, Status::Bench);
        assert!(c.reason.unwrap().contains("malformed result"));
        let oom = "error: out of memory: requested 4 KiB (4096 bytes) for kv with 1 KiB (1024 bytes) in use, limit 4 KiB (4096 bytes)";
        let c = classify_run(ChildExit::Code(3), "", oom, T);
        assert_eq!((c.status, c.oom_demand_bytes), (Status::Oom, Some(5120)));
        let c = classify_run(ChildExit::Signal(9), "", "", T);
        assert_eq!((c.status, c.oom_demand_bytes), (Status::Oom, None));
        let c = classify_run(ChildExit::Code(2), "", "error: invalid geometry: group size 48", T);
        assert_eq!(c.status, Status::Unsupported);
        assert_eq!(c.reason.unwrap(), "invalid geometry: group size 48");
        let c = classify_run(ChildExit::Code(101), "", "thread 'main' panicked at src/x.rs", T);
        assert_eq!(c.status, Status::Bench);
        let c = classify_run(ChildExit::Signal(11), "", "", T);
        assert_eq!(c.status, Status::Bench);
    }

    #[test]
    fn estimate_outcomes() {
        assert!(
            matches!(estimate_facts(ChildExit::Code(2), "", "error: bad"), EstimateFacts::ByRule(r) if r == "bad")
        );
        assert!(matches!(estimate_facts(ChildExit::Code(0), "", ""), EstimateFacts::Failed(_)));
        assert!(matches!(estimate_facts(ChildExit::Code(0), "nope", ""), EstimateFacts::Failed(_)));
        assert!(
            matches!(estimate_facts(ChildExit::Code(1), "", "error: x"), EstimateFacts::Failed(r) if r == "exit code 1: x")
        );
        assert!(matches!(estimate_facts(ChildExit::TimedOut, "", ""), EstimateFacts::Failed(_)));
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
