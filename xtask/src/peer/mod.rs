//! The peer engine a sweep measures beside kiln (`--peer llama-bench=PATH`): for each
//! cell, llama.cpp's `llama-bench` on the same weights (the model written once per sweep
//! by `kiln export-gguf`), the same prompt length, the same number of timed decode steps
//! and the same threads. Each run is a child of the harness like a kiln cell (own
//! process group, the cell timeout, signals), its output in the run directory. A peer
//! that is missing, fails, or prints what cannot be parsed gives a `FAIL:peer` row with
//! the reason; the sweep goes on.

pub mod llama_bench;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Result;

use crate::child::Shutdown;
use crate::sweep::classify::{ChildExit, Status, failure_reason};
use crate::sweep::plan::{Cell, Prompt};
use crate::sweep::runner::{Ran, ext, log_base, model_arg, run_logged};

/// The `engine` column of a peer row.
pub const PROGRAM: &str = "llama-bench";

/// A validated `--peer NAME=PATH`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerSpec {
    /// The peer's program (only `llama-bench` today).
    pub program: String,
    /// Its binary.
    pub path: PathBuf,
}

/// `--peer` for clap: `llama-bench=PATH`.
pub fn peer_arg(s: &str) -> Result<PeerSpec, String> {
    match s.split_once('=') {
        Some((PROGRAM, path)) if !path.is_empty() => {
            Ok(PeerSpec { program: PROGRAM.into(), path: PathBuf::from(path) })
        }
        Some((PROGRAM, _)) => Err(format!("{s:?}: expected llama-bench=PATH with the binary's path")),
        _ => Err(format!("{s:?}: expected llama-bench=PATH (llama-bench is the one peer the sweeps drive)")),
    }
}

/// What one peer run measured.
#[derive(Clone, Debug, PartialEq)]
pub struct PeerReport {
    /// Prompt tokens of the prefill test.
    pub prompt_tokens: u64,
    /// Timed generated tokens of the decode test.
    pub generated_tokens: u64,
    /// Mean wall time of the prefill.
    pub prefill_ms: f64,
    /// Its rate.
    pub prefill_tok_s: f64,
    /// Mean wall time of the timed decode steps.
    pub decode_ms: f64,
    /// Their rate.
    pub decode_tok_s: f64,
}

/// How one peer cell ended.
#[derive(Clone, Debug)]
pub struct PeerOutcome {
    /// `ok`, `FAIL:peer`, or `FAIL:timeout`.
    pub status: Status,
    /// The measurement, for `ok`.
    pub report: Option<PeerReport>,
    /// Why it is not `ok`.
    pub reason: Option<String>,
    /// The GGUF file the peer ran, when there is one.
    pub model_path: Option<String>,
    /// The peer's version (`llama.cpp b<number> (<commit>)`), once known.
    pub version: String,
}

impl PeerOutcome {
    fn failed(status: Status, reason: String, model_path: Option<String>, version: String) -> PeerOutcome {
        PeerOutcome { status, report: None, reason: Some(reason), model_path, version }
    }
}

/// Runs peer cells: exports each model once, then two llama-bench runs per cell (the
/// prefill at depth 0, the decode steps at the prompt's depth).
pub struct PeerRunner<'a> {
    /// `--peer`.
    pub spec: PeerSpec,
    /// kiln, for `export-gguf`.
    pub kiln: PathBuf,
    /// The workspace root (the children's working directory).
    pub workdir: PathBuf,
    /// Where the user typed the command (relative model paths).
    pub user_cwd: PathBuf,
    /// Per-cell logs.
    pub run_dir: PathBuf,
    /// Where exported models go (`target/peer-gguf`).
    pub export_dir: PathBuf,
    /// `--threads`, passed as `-t`.
    pub threads: Option<u64>,
    /// The cell timeout, for each child.
    pub timeout: Duration,
    /// Signals.
    pub shutdown: &'a Shutdown,
    /// Each model's export: the file, or why there is none.
    pub exported: BTreeMap<String, Result<PathBuf, String>>,
    /// The peer's version, from its first report.
    pub version: String,
}

/// File name of a model's export: the name reduced to safe characters.
fn export_name(model: &str) -> String {
    let stem: String = model
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '-') { c } else { '_' })
        .collect();
    format!("{stem}.gguf")
}

impl PeerRunner<'_> {
    /// The model file for `cell`, exported on first use.
    fn model_file(&mut self, index: usize, cell: &Cell) -> Result<Ran<Result<PathBuf, String>>> {
        if let Some(done) = self.exported.get(&cell.model) {
            return Ok(Ran::Done(done.clone()));
        }
        let out = self.export_dir.join(export_name(&cell.model));
        if let Err(e) = std::fs::create_dir_all(&self.export_dir) {
            let why = format!("creating {}: {e}", self.export_dir.display());
            self.exported.insert(cell.model.clone(), Err(why.clone()));
            return Ok(Ran::Done(Err(why)));
        }
        let base = log_base(&self.run_dir, index, cell);
        let base = base.with_extension(ext(&base, "export"));
        let mut cmd = Command::new(&self.kiln);
        cmd.arg("export-gguf").arg(model_arg(&self.user_cwd, &self.workdir, &cell.model)).arg(&out);
        cmd.current_dir(&self.workdir);
        let result = match run_logged(
            cmd,
            &format!("exporting {}", cell.model),
            &base,
            self.timeout,
            self.shutdown,
        )? {
            Ran::Interrupted(sig) => return Ok(Ran::Interrupted(sig)),
            Ran::Done((ChildExit::Code(0), _, _)) => Ok(out),
            Ran::Done((exit, _, err)) => {
                Err(format!("kiln export-gguf {} failed ({exit}): {}", cell.model, failure_reason(&err)))
            }
        };
        self.exported.insert(cell.model.clone(), result.clone());
        Ok(Ran::Done(result))
    }

    /// One llama-bench run; its test of shape (`n_prompt`, `n_gen`, `n_depth`).
    fn bench(
        &mut self,
        base: &Path,
        model: &Path,
        (n_prompt, n_gen, n_depth): (u64, u64, u64),
        what: &str,
    ) -> Result<Ran<Result<llama_bench::Test, (Status, String)>>> {
        let mut cmd = Command::new(&self.spec.path);
        cmd.arg("-m").arg(model);
        for (flag, v) in [("-p", n_prompt), ("-n", n_gen), ("-d", n_depth), ("-r", 1)] {
            cmd.args([flag.to_string(), v.to_string()]);
        }
        if let Some(t) = self.threads {
            cmd.args(["-t".to_string(), t.to_string()]);
        }
        cmd.args(["-o", "json"]).current_dir(&self.workdir);
        let base = base.with_extension(ext(base, what));
        let (exit, out, err) = match run_logged(cmd, what, &base, self.timeout, self.shutdown)? {
            Ran::Interrupted(sig) => return Ok(Ran::Interrupted(sig)),
            Ran::Done(x) => x,
        };
        let secs = self.timeout.as_secs();
        Ok(Ran::Done(match exit {
            ChildExit::TimedOut => {
                Err((Status::Timeout, format!("{what}: killed after {secs}s (--cell-timeout)")))
            }
            ChildExit::Code(0) => llama_bench::parse(&out)
                .and_then(|tests| llama_bench::find(&tests, n_prompt, n_gen, n_depth).cloned())
                .map_err(|e| (Status::Peer, format!("{what}: {e}"))),
            other => Err((Status::Peer, format!("{what}: {other}: {}", failure_reason(&err)))),
        }))
    }

    /// Runs the peer on `cell`.
    pub fn run(&mut self, index: usize, cell: &Cell) -> Result<Ran<PeerOutcome>> {
        let version = self.version.clone();
        let fail = |reason: String, path: Option<String>| {
            PeerOutcome::failed(Status::Peer, reason, path, version.clone())
        };
        if !self.spec.path.is_file() {
            let reason = format!("--peer {}={}: no such file", self.spec.program, self.spec.path.display());
            return Ok(Ran::Done(fail(reason, None)));
        }
        let Prompt::Tokens(n_prompt) = cell.prompt else {
            return Ok(Ran::Done(fail(
                "the peer runs prompts given as a token count (--prompt-tokens), not text".into(),
                None,
            )));
        };
        let model = match self.model_file(index, cell)? {
            Ran::Interrupted(sig) => return Ok(Ran::Interrupted(sig)),
            Ran::Done(Ok(m)) => m,
            Ran::Done(Err(why)) => return Ok(Ran::Done(fail(why, None))),
        };
        let shown = Some(model.display().to_string());
        // kiln times max_tokens - 1 - warmup decode steps after the prefill's token.
        let n_gen = cell.max_tokens.saturating_sub(1 + cell.warmup_tokens).max(1);
        let base = log_base(&self.run_dir, index, cell);
        let prefill = match self.bench(&base, &model, (n_prompt, 0, 0), "llama-bench prefill")? {
            Ran::Interrupted(sig) => return Ok(Ran::Interrupted(sig)),
            Ran::Done(t) => t,
        };
        let decode = match self.bench(&base, &model, (0, n_gen, n_prompt), "llama-bench decode")? {
            Ran::Interrupted(sig) => return Ok(Ran::Interrupted(sig)),
            Ran::Done(t) => t,
        };
        let (pp, tg) = match (prefill, decode) {
            (Ok(pp), Ok(tg)) => (pp, tg),
            (Err((status, why)), _) | (_, Err((status, why))) => {
                return Ok(Ran::Done(PeerOutcome::failed(status, why, shown, self.version.clone())));
            }
        };
        if self.version.is_empty() {
            self.version = pp.version();
        }
        let report = PeerReport {
            prompt_tokens: pp.n_prompt,
            generated_tokens: tg.n_gen,
            prefill_ms: pp.avg_ns as f64 / 1e6,
            prefill_tok_s: pp.avg_ts,
            decode_ms: tg.avg_ns as f64 / 1e6,
            decode_tok_s: tg.avg_ts,
        };
        Ok(Ran::Done(PeerOutcome {
            status: Status::Ok,
            report: Some(report),
            reason: None,
            model_path: shown,
            version: pp.version(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peer_flag_names_llama_bench_and_a_path() {
        let p = peer_arg("llama-bench=/opt/llama/bin/llama-bench").unwrap();
        assert_eq!(
            (p.program.as_str(), p.path.as_path()),
            ("llama-bench", Path::new("/opt/llama/bin/llama-bench"))
        );
        assert!(peer_arg("llama-bench=").unwrap_err().contains("expected llama-bench=PATH"));
        assert!(peer_arg("vllm=/x").unwrap_err().contains("llama-bench is the one peer"));
        assert!(peer_arg("/x/llama-bench").unwrap_err().contains("expected llama-bench=PATH"));
    }

    #[test]
    fn export_names_are_safe_file_names() {
        assert_eq!(export_name("synthetic:qwen2.5-0.5b@4bit-g32"), "synthetic_qwen2.5-0.5b_4bit-g32.gguf");
        assert_eq!(export_name("../models/x y"), ".._models_x_y.gguf");
    }
}
