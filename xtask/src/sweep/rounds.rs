//! One `--until-ci` sweep: one build, one run directory, one CSV locked for the whole
//! run, report.html rewritten in place after every round, one progress line per round and
//! one summary at the end. Each round adds the next repetition of every cell; a cell a
//! rule skipped (its latest row a `SKIP:`) keeps the one row it has and is not planned
//! again, so a skip is written once however many rounds follow.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Result;

use super::classify::Status;
use super::driver;
use super::flags::SweepFlags;
use super::plan::{CellKey, Plan};
use super::rows::{CsvOut, Output, Row};
use super::series;
use super::session::{Session, Started};
use super::summary::{self, UntilCi};
use crate::child::signal_name;
use crate::peer::PeerRunner;
use crate::verdict::reading::{Method, Reading};
use crate::verdict::sequence::Stopped;
use crate::verdict::sheet::Sheet;
use crate::verdict::{Budget, RepetitionFlags};

/// Runs `base`'s cells in rounds until every interval is under `seq`'s target or its
/// budget ends the run, and returns the run's exit status.
pub fn until_ci(
    session: Session,
    output: Output,
    flags: &SweepFlags,
    base: &Plan,
    seq: &RepetitionFlags,
) -> Result<ExitCode> {
    let Some(target) = seq.until_ci else { anyhow::bail!("until_ci needs --until-ci") };
    let budget = seq.budget();
    let peer = flags.series.peer.is_some();
    // With a peer, repetitions alternate which engine opens: two at a time keep it even.
    let step: u32 = if peer { 2 } else { 1 };
    let mut repeat = flags.series.repeat.max(4);
    let cap = match seq.max_time {
        Some(t) if seq.max_repetitions.is_none() => {
            format!("--max-time {}", crate::verdict::flag_duration(t))
        }
        Some(t) => {
            format!("{} {}, --max-time {}", budget.flag, budget.max_n, crate::verdict::flag_duration(t))
        }
        None => format!("{} {}", budget.flag, budget.max_n),
    };
    eprintln!(
        "sweep: {} cells, {repeat} repetitions each, then one more per round until every interval is under {target}% (budget: {cap})",
        base.cells.len() * if peer { 2 } else { 1 }
    );
    let mut rounds = match Rounds::start(session, output, flags)? {
        Ok(r) => r,
        Err(code) => return Ok(code),
    };
    let mut round = 0;
    let mut noted = false;
    let (stopped, interrupted) = loop {
        round += 1;
        // The first repetition of every cell runs alone, so a cell a rule skips is skipped
        // once, not once per repetition of the first round.
        let mut ran = Round { interrupted: None, failed: Vec::new() };
        if round == 1 && repeat > 1 {
            ran = rounds.round(&rounds.plan(base, 1, peer))?;
        }
        if ran.interrupted.is_none() && ran.failed.is_empty() {
            ran = rounds.round(&rounds.plan(base, repeat, peer))?;
        }
        let rows = rounds.rows();
        let (sheet, narrow) = series::sequential_sheet(&rows, target, None);
        rounds.write_report(&sheet);
        if let Some(sig) = ran.interrupted {
            break (Stopped::Ended(format!("interrupted by {}", signal_name(sig))), Some(sig));
        }
        if !ran.failed.is_empty() {
            break (Stopped::Ended(format!("a repetition failed: {}", ran.failed.join(", "))), None);
        }
        if narrow {
            break (Stopped::Converged, None);
        }
        let secs_each = rounds.secs_each(repeat);
        if repeat as usize + step as usize > budget.max_n {
            break (Stopped::MaxPairs(repeat as usize), None);
        }
        if let Some(max) = seq.max_time
            && rounds.measuring.as_secs_f64() + secs_each * f64::from(step) > max.as_secs_f64()
        {
            break (Stopped::MaxTime, None);
        }
        if !rounds.has_work(&rounds.plan(base, repeat + step, peer)) {
            break (Stopped::Ended("no cell is left to repeat: every cell was skipped by rule".into()), None);
        }
        if !noted {
            noted = true;
            if let Some(note) = budget.cap_note(secs_each) {
                eprintln!("{note}");
            }
        }
        eprintln!("{}", rounds.progress(target, round, repeat, &budget));
        repeat += step;
    };
    let mut stop_line = format!("{}; {repeat} repetitions", budget.stopped_text(&stopped, target));
    if matches!(stopped, Stopped::MaxPairs(_) | Stopped::MaxTime)
        && let Some(settle) = budget.settle_text(
            rounds.readings().iter().map(|r| &r.reading),
            target,
            Some(rounds.secs_each(repeat)),
        )
    {
        stop_line = format!("{stop_line}; {settle}");
    }
    let plan = rounds.plan(base, repeat, peer);
    rounds.finish(&plan, interrupted, UntilCi { target_pct: target, stopped: Some(stop_line) })
}

/// A sweep under way: what every round shares.
pub struct Rounds<'f> {
    started: Started,
    flags: &'f SweepFlags,
    csv: CsvOut,
    path: PathBuf,
    /// Every row of the run (and of the resumed file), by cell.
    rows: BTreeMap<CellKey, Row>,
    /// Time spent running rounds, the build not counted.
    measuring: Duration,
    /// What the peer runner learnt (exported models, its version), kept across rounds.
    peer_cache: (BTreeMap<String, Result<PathBuf, String>>, String),
    /// The roofs every round's cells measured (`--measure-roofs`).
    roofs: super::roofs::CellRoofs,
}

/// What one round did.
pub struct Round {
    /// The signal that interrupted it.
    pub interrupted: Option<i32>,
    /// Cells whose row of this round is a failure.
    pub failed: Vec<String>,
}

/// One rate or ratio of a cell as the confidence sequence reads it.
pub struct CellReading {
    /// `model@len`, with ` (peer)` for the peer's rates.
    pub cell: String,
    /// `decode tok/s`, `prefill kiln/peer`, ...
    pub metric: &'static str,
    /// The reading.
    pub reading: Reading,
}

/// A cell with the repetition left out: what its repetitions share.
fn base_key(key: &CellKey) -> CellKey {
    CellKey { repetition: 0, ..key.clone() }
}

/// The cells whose latest row is a skip: a rule decided them, and would again.
fn settled<'r>(rows: impl IntoIterator<Item = &'r Row>) -> BTreeSet<CellKey> {
    let mut latest: BTreeMap<CellKey, &Row> = BTreeMap::new();
    for r in rows {
        let e = latest.entry(base_key(&r.key())).or_insert(r);
        if r.repetition >= e.repetition {
            *e = r;
        }
    }
    latest
        .into_iter()
        .filter(|(_, r)| Status::parse(&r.status).is_some_and(Status::is_skip))
        .map(|(k, _)| k)
        .collect()
}

impl<'f> Rounds<'f> {
    /// Builds kiln when asked and creates the one run directory; `Err(code)` when a signal
    /// ended the build.
    pub fn start(session: Session, output: Output, flags: &'f SweepFlags) -> Result<Result<Self, ExitCode>> {
        let started = match session.start(&output.path, flags)? {
            Ok(s) => s,
            Err(code) => return Ok(Err(code)),
        };
        let mut rows = BTreeMap::new();
        if let Some(existing) = output.resumed {
            eprintln!("resuming {}: {} rows already", started.display(&output.path), existing.len());
            rows.extend(existing.into_iter().map(|r| (r.key(), r)));
        }
        Ok(Ok(Rounds {
            started,
            flags,
            csv: output.csv,
            path: output.path,
            rows,
            measuring: Duration::ZERO,
            peer_cache: Default::default(),
            roofs: Default::default(),
        }))
    }

    /// `base` at `repeat` repetitions, less the repetitions not yet run of every cell a
    /// rule skipped: such a cell keeps the one row it has.
    pub fn plan(&self, base: &Plan, repeat: u32, peer: bool) -> Plan {
        let settled = settled(self.rows.values());
        let mut plan = series::expand(base, repeat, peer);
        plan.cells.retain(|c| self.rows.contains_key(&c.key()) || !settled.contains(&base_key(&c.key())));
        plan
    }

    /// Whether `plan` has a cell without a row.
    pub fn has_work(&self, plan: &Plan) -> bool {
        plan.cells.iter().any(|c| !self.rows.contains_key(&c.key()))
    }

    /// Runs the cells of `plan` that have no row yet.
    pub fn round(&mut self, plan: &Plan) -> Result<Round> {
        let t0 = Instant::now();
        let Rounds { started, flags, csv, path, rows, peer_cache, roofs, .. } = self;
        let peer = flags.series.peer.clone().map(|spec| {
            let mut p: PeerRunner<'_> = started.peer_runner(spec);
            (p.exported, p.version) = std::mem::take(peer_cache);
            p
        });
        let mut driver = started.driver(plan, flags, path, peer);
        // Earlier rounds' out-of-memory rows backstop this one, as in a resumed sweep.
        for row in rows.values() {
            driver.note_earlier(row);
        }
        let before: BTreeSet<CellKey> = rows.keys().cloned().collect();
        let interrupted = driver.walk(&mut started.runner(), csv, rows)?;
        if let Some(p) = driver.peer.take() {
            *peer_cache = (p.exported, p.version);
        }
        roofs.extend(std::mem::take(&mut driver.roofs));
        let failed = rows
            .iter()
            .filter(|(k, r)| !before.contains(*k) && Status::parse(&r.status).is_some_and(Status::is_failure))
            .map(|(_, r)| format!("{} ({})", label(r), r.status))
            .collect();
        self.measuring += t0.elapsed();
        Ok(Round { interrupted, failed })
    }

    /// Every row so far.
    pub fn rows(&self) -> Vec<Row> {
        self.rows.values().cloned().collect()
    }

    /// The measured time of one repetition of every cell, after `repeat` of them.
    pub fn secs_each(&self, repeat: u32) -> f64 {
        self.measuring.as_secs_f64() / f64::from(repeat.max(1))
    }

    /// Rewrites the run's readings and report.html in place from the rows so far
    /// (`sheet`, the round's sequential readings).
    pub fn write_report(&self, sheet: &Sheet) {
        summary::write_or_warn(self.started.run_dir(), sheet);
        if let Err(e) = crate::report::write(self.started.run_dir()) {
            eprintln!("warning: no report.html in {}: {e:#}", self.started.display(self.started.run_dir()));
        }
    }

    /// Every cell's rates (and with a peer its kiln/peer ratios) over its ok
    /// repetitions, as the confidence sequence reads them.
    pub fn readings(&self) -> Vec<CellReading> {
        readings(self.rows.values())
    }

    /// The line a round ends with: how many repetitions of how many cells, the widest
    /// interval, what would likely settle every one, and the whole run's ETA.
    pub fn progress(&self, target: f64, round: usize, repeat: u32, budget: &Budget) -> String {
        let readings = self.readings();
        let cells: BTreeSet<&str> = readings.iter().map(|r| r.cell.as_str()).collect();
        let secs_each = self.secs_each(repeat);
        let widest = readings
            .iter()
            .max_by(|a, b| {
                let w = |r: &CellReading| r.reading.half_width_pct().unwrap_or(f64::INFINITY);
                w(a).total_cmp(&w(b))
            })
            .map_or("none yet".to_string(), |r| {
                format!("{} ({} {}, n={})", r.reading.width(), r.cell, r.metric, r.reading.n)
            });
        let mut line = format!(
            "--until-ci {target}%: round {round}: {repeat} repetitions of {} cells; widest interval {widest}",
            cells.len()
        );
        if let Some(settle) = budget.settle_text(readings.iter().map(|r| &r.reading), target, Some(secs_each))
        {
            line = format!("{line}; {settle}");
        }
        let eta = budget.eta(repeat as usize, self.measuring, Some(secs_each));
        format!("{line}; {eta}")
    }

    /// Prints the run's one summary (the readings of `plan`'s cells as the confidence
    /// sequence reads them, the target's verdict and why the run stopped), keeps it in the
    /// run directory, rewrites the report a last time and returns the exit status.
    pub fn finish(self, plan: &Plan, interrupted: Option<i32>, until_ci: UntilCi) -> Result<ExitCode> {
        let source = self.started.display(&self.path);
        let finished = summary::pair(plan, &self.rows);
        let mut sheet = summary::sheet_with(&finished, interrupted.map(signal_name), Some(until_ci));
        self.roofs.add_to(&mut sheet);
        let (code, sheet) = driver::conclude(plan, &self.rows, interrupted, sheet, &source, self.measuring)?;
        drop(self.csv);
        summary::write_or_warn(self.started.run_dir(), &sheet);
        crate::report::write_or_warn(self.started.run_dir());
        Ok(ExitCode::from(code))
    }
}

/// `model@len` of a row, `#r` after the first repetition and `+peer` for the peer's.
fn label(r: &Row) -> String {
    let len = r.prompt_target_len.map_or("text".to_string(), |l| l.to_string());
    let mut s = format!("{}@{len}", r.model);
    if r.repetition > 1 {
        s.push_str(&format!("#{}", r.repetition));
    }
    if r.is_peer() {
        s.push_str("+peer");
    }
    s
}

/// The readings of [`Rounds::readings`], from rows.
fn readings<'r>(rows: impl IntoIterator<Item = &'r Row>) -> Vec<CellReading> {
    type Reps = BTreeMap<u32, (f64, f64)>;
    let mut by: BTreeMap<(String, Option<u64>), BTreeMap<bool, Reps>> = BTreeMap::new();
    for r in rows {
        if r.status != Status::Ok.as_str() {
            continue;
        }
        let (Some(d), Some(p)) = (r.decode_tok_s, r.prefill_tok_s) else { continue };
        by.entry((r.model.clone(), r.prompt_target_len))
            .or_default()
            .entry(r.is_peer())
            .or_default()
            .insert(r.repetition, (d, p));
    }
    let mut out = Vec::new();
    for ((model, len), engines) in &by {
        let cell = format!("{model}@{}", len.map_or("text".to_string(), |l| l.to_string()));
        for (peer, reps) in engines {
            let name = if *peer { format!("{cell} (peer)") } else { cell.clone() };
            let mut push = |metric, reading: Option<Reading>| {
                if let Some(reading) = reading {
                    out.push(CellReading { cell: name.clone(), metric, reading });
                }
            };
            let values = |k: fn(&(f64, f64)) -> f64| reps.values().map(k).collect::<Vec<f64>>();
            push("decode tok/s", Reading::of(&values(|v| v.0), Method::Sequence));
            push("prefill tok/s", Reading::of(&values(|v| v.1), Method::Sequence));
            if let (false, Some(other)) = (peer, engines.get(&true)) {
                let pairs = |k: fn(&(f64, f64)) -> f64| -> Vec<(f64, f64)> {
                    reps.iter().filter_map(|(rep, v)| Some((k(v), k(other.get(rep)?)))).collect()
                };
                push("decode kiln/peer", Reading::of_pairs(&pairs(|v| v.0), Method::Sequence));
                push("prefill kiln/peer", Reading::of_pairs(&pairs(|v| v.1), Method::Sequence));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::plan::{CellTemplate, Named, Prompt};
    use super::*;

    fn row(model: &str, len: u64, rep: u32, status: &str, decode: f64) -> Row {
        Row {
            model: model.into(),
            prompt_target_len: Some(len),
            repetition: rep,
            status: status.into(),
            decode_tok_s: Some(decode),
            prefill_tok_s: Some(10.0 * decode),
            engine: "kiln".into(),
            ..Row::default()
        }
    }

    #[test]
    fn a_cell_a_rule_skipped_is_settled_and_one_that_ran_is_not() {
        let rows = [
            row("a", 128, 1, "ok", 10.0),
            row("a", 128, 2, "ok", 11.0),
            row("a", 2048, 1, "SKIP:context", 0.0),
            // Ran, then ran out of memory: the record would pre-skip it from now on.
            row("b", 512, 1, "ok", 5.0),
            row("b", 512, 2, "SKIP:oom", 0.0),
            // Failed once, measured since: still repeated.
            row("c", 64, 1, "FAIL:timeout", 0.0),
            row("c", 64, 2, "ok", 7.0),
        ];
        let s = settled(rows.iter());
        let names: Vec<String> = s.iter().map(|k| format!("{}@{:?}", k.model, k.prompt_target_len)).collect();
        assert_eq!(names, ["a@Some(2048)", "b@Some(512)"]);
    }

    #[test]
    fn readings_are_the_confidence_sequence_of_each_rate_and_ratio() {
        let mut rows: Vec<Row> = (1..=5).map(|r| row("a", 64, r, "ok", 10.0 + f64::from(r))).collect();
        rows.push(row("a", 128, 1, "SKIP:context", 0.0));
        for r in 1..=5 {
            rows.push(Row { engine: "llama-bench".into(), ..row("a", 64, r, "ok", 5.0) });
        }
        let got = readings(rows.iter());
        let names: Vec<String> = got.iter().map(|r| format!("{} {}", r.cell, r.metric)).collect();
        assert_eq!(
            names,
            [
                "a@64 decode tok/s",
                "a@64 prefill tok/s",
                "a@64 decode kiln/peer",
                "a@64 prefill kiln/peer",
                "a@64 (peer) decode tok/s",
                "a@64 (peer) prefill tok/s"
            ]
        );
        let decode: Vec<f64> = (1..=5).map(|r| 10.0 + f64::from(r)).collect();
        assert_eq!(got[0].reading, Reading::of(&decode, Method::Sequence).unwrap());
        assert_eq!(got[0].reading.method, Method::Sequence);
    }

    #[test]
    fn a_settled_cell_is_planned_no_more_but_keeps_its_row() {
        let base = Plan::grid(
            &["a".to_string()],
            &[Prompt::Tokens(64), Prompt::Tokens(2048)],
            &CellTemplate { max_tokens: 4, warmup_tokens: 0, named: Named { models: true, prompts: true } },
        );
        let rows: BTreeMap<CellKey, Row> =
            [row("a", 64, 1, "ok", 1.0), row("a", 2048, 1, "SKIP:context", 0.0)]
                .into_iter()
                .map(|r| (r.key(), r))
                .collect();
        let settled = settled(rows.values());
        let mut plan = series::expand(&base, 3, false);
        plan.cells.retain(|c| rows.contains_key(&c.key()) || !settled.contains(&base_key(&c.key())));
        let labels: Vec<String> = plan.cells.iter().map(|c| c.label()).collect();
        assert_eq!(labels, ["a@64", "a@2048", "a@64#2", "a@64#3"]);
    }
}
