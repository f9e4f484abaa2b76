//! The ABBA boot driver every mode shares: for each boot of the order, a port preflight,
//! a quiet check, `kiln serve` booted with its arm pinned, liveness before every
//! readiness probe, the arm's identity from the kernel line, a discarded warm-up pass and
//! the measured passes (for arms that speculate, the identity is checked again from the
//! exactness gate's line once the warm-up has made it verify), then SIGTERM, grace,
//! SIGKILL of the group. Every pass is written (flushed) as it ends, failures with their
//! reason; a signal stops the server, keeps what was written and never boots the next arm.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::future::Future;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::arms::{Arm, GateLine, Order, check_gate, check_identity};
use super::records::{BootRecord, CellDef, CellMeasure, PassRecord, cell_failures};
use crate::child::{self, Shutdown};
use crate::quiet::{self, Limits, Probe, Reading};
use crate::serve_bench::client::Target;
use crate::serve_bench::until_signal;
use crate::server::{self, Ready, Server, ServerSpec};

/// What a mode supplies: its cells, its server arguments and one pass over the cells.
/// The boot, identity, ABBA, signal and statistics machinery stays here and in
/// `analysis`, shared by every mode.
pub trait Mode {
    /// `sweep`, `mixed`, ...
    fn name(&self) -> &'static str;
    /// What one measured unit is called in progress lines: `pass`, `window`.
    fn unit(&self) -> &'static str {
        "pass"
    }
    /// The cells, in pass order.
    fn cells(&self) -> Vec<CellDef>;
    /// Extra `kiln serve` arguments this mode needs.
    fn server_args(&self) -> Vec<OsString>;
    /// Cells that cannot run by rule, with the reason: [`Mode::run_pass`] sends none of
    /// their requests.
    fn skipped(&self) -> Vec<(String, String)> {
        Vec::new()
    }
    /// Which arms the result compares, and which way round.
    fn design(&self) -> super::analysis::Design;
    /// The plot beside the tables; `design` names the arms the ratios compare, judged
    /// at `margin_pct`.
    fn panels(
        &self,
        rows: &[super::analysis::TaxRow],
        passes: &[PassRecord],
        design: super::analysis::Design,
        margin_pct: f64,
    ) -> Vec<crate::plot::Panel>;
    /// A table fitting the arms' difference across cells, where the mode has one;
    /// `aa_fp_pct` is the false-positive rate of the A/A run the result cites, which the
    /// fit's caveat names when it is above the nominal 5%.
    fn fit(
        &self,
        _rows: &[super::analysis::TaxRow],
        _aa_fp_pct: Option<f64>,
    ) -> Option<crate::verdict::sheet::Table> {
        None
    }
    /// One pass over every cell. `pass` (0 = warm-up) seeds the prompts, so the same pass
    /// of every boot sends the same requests.
    fn run_pass(
        &self,
        target: &Target,
        pass: usize,
        timeout: Duration,
    ) -> impl Future<Output = Vec<CellMeasure>>;
}

/// How the driver runs.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The boot order.
    pub order: Order,
    /// Measured passes per boot (after one warm-up).
    pub passes: usize,
    /// The port every boot binds.
    pub port: u16,
    /// `-m`.
    pub model: String,
    /// The engine.
    pub kiln_bin: PathBuf,
    /// What every boot's `kiln serve` gets before the mode's and the user's arguments:
    /// the backend's (none on the CPU).
    pub engine_args: Vec<String>,
    /// Extra `kiln serve` arguments from the user.
    pub serve_args: Vec<String>,
    /// Readiness timeout.
    pub boot_timeout: Duration,
    /// SIGTERM-to-SIGKILL grace.
    pub grace: Duration,
    /// Pause between boots.
    pub cooldown: Duration,
    /// Wait (bounded) for quiet instead of marking passes disturbed.
    pub require_quiet: bool,
    /// The bound of that wait.
    pub quiet_timeout: Duration,
    /// What counts as busy.
    pub busy: Limits,
    /// One request's timeout.
    pub request_timeout: Duration,
    /// The run directory.
    pub run_dir: PathBuf,
    /// The working directory for the server.
    pub cwd: PathBuf,
    /// Boots already run before this order (a run that adds ABBA blocks until its
    /// intervals are narrow runs one block at a time): numbering continues after them.
    pub first_boot: usize,
    /// `--max-time`: no pair of boots is started that would likely end after this.
    pub deadline: Option<Instant>,
}

/// How the driver ended.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Every boot started.
    pub boots: Vec<BootRecord>,
    /// Every pass written.
    pub passes: Vec<PassRecord>,
    /// The signal that ended it early.
    pub interrupted: Option<i32>,
    /// A reason the driver stopped before the order was done.
    pub aborted: Option<String>,
    /// The time budget ended the order early (at a pair boundary).
    pub out_of_time: bool,
}

struct Writer {
    passes: File,
    boots: File,
}

impl Writer {
    fn open(dir: &Path) -> Result<Writer> {
        let open = |name: &str| {
            let p = dir.join(name);
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(&p)
                .with_context(|| format!("opening {}", p.display()))
        };
        Ok(Writer { passes: open("passes.jsonl")?, boots: open("boots.jsonl")? })
    }

    fn pass(&mut self, p: &PassRecord) -> Result<()> {
        writeln!(self.passes, "{}", serde_json::to_string(p)?)?;
        self.passes.flush().context("writing passes.jsonl")
    }

    fn boot(&mut self, b: &BootRecord) -> Result<()> {
        writeln!(self.boots, "{}", serde_json::to_string(b)?)?;
        self.boots.flush().context("writing boots.jsonl")
    }
}

fn hms(s: f64) -> String {
    let s = s.max(0.0).round() as u64;
    if s >= 3600 { format!("{}h{:02}m", s / 3600, s / 60 % 60) } else { format!("{}m{:02}s", s / 60, s % 60) }
}

/// Waits (bounded) for a quiet machine when the plan asks; returns the last reading
/// and the signal if one came.
fn wait_quiet(plan: &Plan, shutdown: &Shutdown, ours: &[i32], what: &str) -> (Option<Reading>, Option<i32>) {
    let wait = plan.require_quiet.then_some(plan.quiet_timeout);
    quiet::wait_quiet(plan.busy, wait, shutdown, ours, what)
}

/// Runs the order with `mode`.
pub fn run<M: Mode>(mode: &M, plan: &Plan, shutdown: &Shutdown) -> Result<Outcome> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting tokio")?;
    let mut w = Writer::open(&plan.run_dir)?;
    let mut out = Outcome::default();
    let boots = plan.first_boot + plan.order.0.len();
    let units = plan.order.0.len() * (plan.passes + 1);
    let mut done_units = 0usize;
    let started = Instant::now();
    let progress = |done: usize| {
        let el = started.elapsed().as_secs_f64();
        let eta = if done > 0 { el / done as f64 * (units - done) as f64 } else { f64::NAN };
        if eta.is_finite() {
            format!("elapsed {}, about {} left", hms(el), hms(eta))
        } else {
            format!("elapsed {}", hms(el))
        }
    };
    'boots: for (bi, &arm) in plan.order.0.iter().enumerate() {
        let boot = plan.first_boot + bi + 1;
        if let Some(sig) = shutdown.pending() {
            out.interrupted = Some(sig);
            break;
        }
        // Pairs are consecutive boots (0-1, 2-3, ...): before a pair starts, the budget
        // must leave room for two boots of the mean length so far.
        if let Some(deadline) = plan.deadline
            && bi % 2 == 0
            && bi > 0
        {
            let per_boot = started.elapsed() / bi as u32;
            if Instant::now() + per_boot * 2 > deadline {
                eprintln!("--max-time: no time for another pair of boots; stopping after {bi} boots");
                out.out_of_time = true;
                break;
            }
        }
        if boot > 1 && !plan.cooldown.is_zero() {
            eprintln!("    cooldown {:.0} s", plan.cooldown.as_secs_f64());
            if let Some(sig) = quiet::pause(shutdown, plan.cooldown) {
                out.interrupted = Some(sig);
                break;
            }
        }
        let tq = Instant::now();
        let (reading, sig) = wait_quiet(plan, shutdown, &[], &format!("boot {boot}"));
        let quiet_check_s = tq.elapsed().as_secs_f64();
        if let Some(sig) = sig {
            out.interrupted = Some(sig);
            break;
        }
        if let Some(why) = reading.and_then(|r| r.busy(plan.busy)) {
            eprintln!("    the machine is busy before boot {boot}: {why}");
        }
        let t0 = Instant::now();
        if server::port_answers(plan.port) {
            out.aborted = Some(format!(
                "port {} already answers on 127.0.0.1 before boot {boot}: a stale server would be measured as the {} arm; stop it or pick another --port",
                plan.port,
                arm.as_str()
            ));
            break;
        }
        let log_name = format!("boot-{boot}-{}.log", arm.as_str());
        let mut args: Vec<OsString> = vec![
            "serve".into(),
            "-m".into(),
            plan.model.clone().into(),
            "--port".into(),
            plan.port.to_string().into(),
        ];
        args.extend(plan.engine_args.iter().map(OsString::from));
        args.extend(unless_given(mode.server_args(), &plan.serve_args));
        args.extend(server::served_name(&plan.model, &plan.serve_args).1);
        args.extend(plan.serve_args.iter().map(OsString::from));
        let spec = ServerSpec {
            bin: plan.kiln_bin.clone(),
            args,
            env: arm.env(),
            log: plan.run_dir.join(&log_name),
            cwd: plan.cwd.clone(),
        };
        let srv = Server::start(&spec)?;
        let preflight_s = t0.elapsed().as_secs_f64();
        let mut rec = BootRecord {
            boot,
            arm,
            runs: arm.runs(),
            pid: Some(srv.pid()),
            kernel: None,
            gate: None,
            failure: None,
            preflight_s,
            quiet_check_s,
            ready_after_s: None,
            stop_s: 0.0,
            killed: false,
            ended: String::new(),
            log: log_name,
        };
        eprintln!(
            "[boot {boot}/{boots}] {arm}: booting kiln serve (pid {}); {}",
            srv.pid(),
            progress(done_units)
        );
        let ready = srv.wait_ready(shutdown, plan.boot_timeout);
        let target = match ready {
            Ready::Up { addr, after_s } => {
                rec.ready_after_s = Some(after_s);
                match check_identity(arm, &srv.log_text()) {
                    Ok(k) => {
                        eprintln!(
                            "    ready after {after_s:.1} s at http://{addr}; kernels: isa={} threads={} qmv_wide={} pinned={}",
                            k.isa, k.threads, k.qmv_wide, k.pinned
                        );
                        rec.kernel = Some(k);
                        Some(Target::at(addr))
                    }
                    Err(e) => {
                        rec.failure = Some(e);
                        None
                    }
                }
            }
            Ready::Died(how) => {
                rec.failure = Some(format!("the server {how} before it was ready"));
                None
            }
            Ready::TimedOut => {
                rec.failure =
                    Some(format!("the server was not ready after {} s", plan.boot_timeout.as_secs()));
                None
            }
            Ready::Interrupted(sig) => {
                out.interrupted = Some(sig);
                None
            }
        };
        let mut dead: Option<String> = None;
        let mut skip: Option<String> = None;
        if let Some(target) = target {
            let mut last = reading;
            for pass in 0..=plan.passes {
                if let Some(sig) = shutdown.pending() {
                    out.interrupted = Some(sig);
                    break;
                }
                if let Some(how) = dead
                    .as_ref()
                    .map(|h| format!("the server {h} in an earlier pass of this boot"))
                    .or_else(|| skip.clone())
                {
                    let rp = failed_pass(boot, arm, pass, format!("not run: {how}"));
                    w.pass(&rp)?;
                    out.passes.push(rp);
                    done_units += 1;
                    continue;
                }
                if plan.require_quiet && last.and_then(|r| r.busy(plan.busy)).is_some() {
                    let (_, sig) =
                        wait_quiet(plan, shutdown, &[srv.pid()], &format!("boot {boot} pass {pass}"));
                    if let Some(sig) = sig {
                        out.interrupted = Some(sig);
                        break;
                    }
                }
                let probe = Probe::start(&[srv.pid()]);
                let tp = Instant::now();
                let cells = match rt
                    .block_on(until_signal(shutdown, mode.run_pass(&target, pass, plan.request_timeout)))
                {
                    Ok(c) => c,
                    Err(sig) => {
                        out.interrupted = Some(sig);
                        break;
                    }
                };
                let reading = probe.and_then(|p| p.finish());
                last = reading;
                let invalid = cells.iter().find_map(|c| c.invalid.clone());
                let requests: usize = cells.iter().map(|c| c.requests).sum();
                let failed: usize = cells.iter().map(|c| c.failed).sum();
                // Failed requests may mean a dying server: let it finish dying, so the pass
                // is blamed on the death rather than on its symptoms.
                dead = if failed > 0 { srv.exited_within(Duration::from_millis(1000)) } else { srv.exited() };
                let reason = pass_failure(&cells, dead.as_deref(), requests, failed);
                let failed_cells = cell_failures(&cells);
                let rp = PassRecord {
                    boot,
                    arm,
                    pass,
                    ok: reason.is_none(),
                    reason,
                    invalid,
                    disturbed: reading.and_then(|r| r.busy(plan.busy)),
                    quiet: reading,
                    elapsed_s: tp.elapsed().as_secs_f64(),
                    cells,
                };
                w.pass(&rp)?;
                done_units += 1;
                let what = if pass == 0 {
                    "warm-up".to_string()
                } else {
                    format!("{} {pass}/{}", mode.unit(), plan.passes)
                };
                let mut state = match (&rp.reason, &rp.invalid, &rp.disturbed) {
                    (Some(r), _, _) => format!("FAILED: {r}"),
                    (None, Some(i), _) => format!("INVALID: {i}"),
                    (None, None, Some(d)) => format!("ok, disturbed: {d}"),
                    (None, None, None) => "ok".to_string(),
                };
                if rp.reason.is_none() && !failed_cells.is_empty() {
                    state
                        .push_str(&format!("; failed cells (the others count): {}", failed_cells.join("; ")));
                }
                eprintln!(
                    "[boot {boot}/{boots}] {} {what}: {state} ({:.1} s); {}",
                    arm.as_str(),
                    rp.elapsed_s,
                    progress(done_units)
                );
                out.passes.push(rp);
                // The gate logs at the first verify, which the warm-up made happen.
                if pass == 0 && dead.is_none() && arm.expects_gate() {
                    match wait_gate(&srv, arm) {
                        Ok(g) => {
                            if let Some(g) = &g {
                                eprintln!("    gate: outcome={} qmv_wide={}", g.outcome, g.qmv_wide);
                            }
                            rec.gate = g;
                        }
                        Err(e) => {
                            eprintln!("[boot {boot}/{boots}] {} FAILED: {e}", arm.as_str());
                            rec.failure = Some(e.clone());
                            skip = Some(e);
                        }
                    }
                }
            }
        } else if out.interrupted.is_none() {
            let why = rec.failure.clone().unwrap_or_default();
            eprintln!("[boot {boot}/{boots}] {} FAILED: {why}", arm.as_str());
            for pass in 0..=plan.passes {
                let rp = failed_pass(boot, arm, pass, format!("boot failed: {why}"));
                w.pass(&rp)?;
                out.passes.push(rp);
                done_units += 1;
            }
        }
        let ts = Instant::now();
        let stopped = srv.stop(plan.grace)?;
        rec.stop_s = ts.elapsed().as_secs_f64();
        rec.killed = stopped.killed;
        rec.ended = match stopped.died_before {
            Some(how) => format!("{how}, before it was stopped"),
            None => stopped.ended,
        };
        if stopped.killed {
            eprintln!(
                "    warning: the server ignored SIGTERM for {} s and its group was killed",
                plan.grace.as_secs()
            );
        }
        w.boot(&rec)?;
        out.boots.push(rec);
        if let Some(sig) = out.interrupted {
            eprintln!(
                "interrupted by {}: the server's group was stopped; {} passes kept; no further boot",
                child::signal_name(sig),
                out.passes.len()
            );
            break 'boots;
        }
    }
    Ok(out)
}

/// The gate's line of a speculating arm, checked; the log is given a moment to catch up
/// with the stream that made the gate decide.
fn wait_gate(srv: &Server, arm: Arm) -> Result<Option<GateLine>, String> {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let r = check_gate(arm, &srv.log_text());
        if r.is_ok() || Instant::now() >= deadline {
            return r;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The mode's `kiln serve` flags (`--flag value` pairs) less those a `--serve-arg` sets
/// (`--flag value` or `--flag=value`): kiln refuses a flag given twice, and the user's
/// choice wins.
fn unless_given(own: Vec<OsString>, serve_args: &[String]) -> Vec<OsString> {
    let given = |flag: &OsString| {
        let flag = flag.to_string_lossy();
        serve_args.iter().any(|a| *a == flag || a.starts_with(&format!("{flag}=")))
    };
    own.chunks(2).filter(|pair| !given(&pair[0])).flat_map(|pair| pair.iter().cloned()).collect()
}

/// Why a pass whose cells came back as `cells` does not count, if it does not: the
/// server died during it, or every cell failed. A failed cell among cells that completed
/// fails that cell only (see [`cell_failures`]); the pass counts for the others.
fn pass_failure(cells: &[CellMeasure], dead: Option<&str>, requests: usize, failed: usize) -> Option<String> {
    if let Some(how) = dead {
        return Some(format!("the server {how} during the pass"));
    }
    if failed == 0 || cells.iter().any(|c| c.failed == 0) {
        return None;
    }
    Some(format!(
        "{failed} of {requests} requests failed; first: {}",
        cells.iter().find_map(|c| c.first_error.clone()).unwrap_or_default()
    ))
}

fn failed_pass(boot: usize, arm: Arm, pass: usize, reason: String) -> PassRecord {
    PassRecord {
        boot,
        arm,
        pass,
        ok: false,
        reason: Some(reason),
        invalid: None,
        disturbed: None,
        quiet: None,
        elapsed_s: 0.0,
        cells: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(name: &str, requests: usize, failed: usize) -> CellMeasure {
        CellMeasure {
            cell: name.into(),
            requests,
            failed,
            first_error: (failed > 0).then(|| "HTTP 400".to_string()),
            metrics: std::collections::BTreeMap::new(),
            hashes: std::collections::BTreeMap::new(),
            prompt_tokens: None,
            cached_tokens: None,
            invalid: None,
            detail: None,
        }
    }

    #[test]
    fn a_serve_arg_replaces_the_modes_own_flag() {
        let own: Vec<OsString> = ["--parallel", "8", "--max-queue", "8"].iter().map(OsString::from).collect();
        let given = ["--parallel=2".to_string(), "--prefill-chunk".to_string(), "16".to_string()];
        assert_eq!(unless_given(own.clone(), &given), ["--max-queue", "8"]);
        assert_eq!(
            unless_given(own.clone(), &["--max-queue".to_string(), "4".to_string()]),
            ["--parallel", "8"]
        );
        assert_eq!(unless_given(own.clone(), &[]), own);
    }

    #[test]
    fn a_failed_cell_fails_itself_and_not_the_pass() {
        let cells = [cell("decode B=1", 1, 0), cell("chunked prefill 1024", 2, 2)];
        assert_eq!(pass_failure(&cells, None, 3, 2), None);
        assert_eq!(cell_failures(&cells), ["chunked prefill 1024: 2 of 2 requests failed; first: HTTP 400"]);
        // Every cell failed, or the server died: the pass fails.
        let all = [cell("a", 1, 1), cell("b", 2, 1)];
        assert_eq!(pass_failure(&all, None, 3, 2).unwrap(), "2 of 3 requests failed; first: HTTP 400");
        let died = pass_failure(&cells, Some("exited with status 3"), 3, 2).unwrap();
        assert_eq!(died, "the server exited with status 3 during the pass");
    }

    #[test]
    fn durations_read_as_minutes_or_hours() {
        assert_eq!(hms(65.4), "1m05s");
        assert_eq!(hms(3725.0), "1h02m");
        assert_eq!(hms(-1.0), "0m00s");
    }
}
