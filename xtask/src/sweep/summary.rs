//! What a sweep says at the end, as one [`Sheet`] built from its rows: per cell the
//! decode and prefill rates as [`Reading`]s (geometric mean, 95% interval, n, disturbed
//! count; Student's t, or the confidence sequence with `--until-ci`), kiln/peer ratios,
//! the tally, where each model runs out of memory, and the exit status. The terminal
//! prints [`Sheet::markdown`], the run directory keeps the sheet ([`write`]) and
//! report.html renders its cells; a run directory without one is rendered through
//! [`sheet_of_rows`] here, never through a formula of its own.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context as _, Result};

use super::classify::Status;
use super::plan::{Cell, CellKey, Engine, Plan, Prompt};
use super::record::bytes_text;
use super::rows::Row;
use crate::verdict::reading::{Method, Reading};
use crate::verdict::sheet::{self, Sheet, Table};

/// A cell and its row, when it has one.
pub struct Finished<'a> {
    /// The cell.
    pub cell: &'a Cell,
    /// Its row: from this run or from the resumed file.
    pub row: Option<&'a Row>,
}

/// Pairs every cell of `plan` with its row.
pub fn pair<'a>(plan: &'a Plan, rows: &'a BTreeMap<CellKey, Row>) -> Vec<Finished<'a>> {
    plan.cells.iter().map(|cell| Finished { cell, row: rows.get(&cell.key()) }).collect()
}

fn status_of(row: &Row) -> Option<Status> {
    Status::parse(&row.status)
}

/// What a sweep's sheet says beyond its rows.
#[derive(Clone, Debug, Default)]
pub struct RunState {
    /// The cells of the plan that have no row: each as a row with its coordinates
    /// (model, prompt, repetition, engine) and nothing else.
    pub not_run: Vec<Row>,
    /// The signal that interrupted the run, by name.
    pub interrupted: Option<String>,
    /// `--until-ci`: the intervals are the confidence sequence's and are judged against
    /// its target.
    pub until_ci: Option<UntilCi>,
}

/// `--until-ci`'s target and, once the run has stopped, why.
#[derive(Clone, Debug)]
pub struct UntilCi {
    /// The half-width every interval must fall under, in percent.
    pub target_pct: f64,
    /// The stopping rule's line (`stopping rule: converged, ...`), once it stopped.
    pub stopped: Option<String>,
}

/// The sheet of a run from its plan's cells ([`pair`]): their rows in plan order, and the
/// cells without one.
pub fn sheet(finished: &[Finished<'_>], interrupted: Option<&str>) -> Sheet {
    sheet_with(finished, interrupted, None)
}

/// [`sheet`] of a `--until-ci` run (`until_ci` set: the confidence sequence's intervals,
/// the target's verdict and why the run stopped) or of any other (`None`).
pub fn sheet_with(finished: &[Finished<'_>], interrupted: Option<&str>, until_ci: Option<UntilCi>) -> Sheet {
    let rows: Vec<Row> = finished.iter().filter_map(|f| f.row.cloned()).collect();
    let state = RunState {
        not_run: finished.iter().filter(|f| f.row.is_none()).map(|f| coordinates(f.cell)).collect(),
        interrupted: interrupted.map(str::to_string),
        until_ci,
    };
    sheet_of_rows(&rows, &state)
}

/// [`sheet`]'s markdown: what the terminal prints.
#[cfg(test)]
pub fn render(_plan: &Plan, finished: &[Finished<'_>], interrupted: Option<&str>) -> String {
    sheet(finished, interrupted).markdown()
}

/// Writes `sheet` into `run_dir`: the readings report.html renders, and summary.md (what
/// the terminal printed).
pub fn write(run_dir: &Path, sheet: &Sheet) -> Result<()> {
    sheet.write(run_dir)?;
    let md = run_dir.join("summary.md");
    crate::fsx::write_atomic(&md, sheet.markdown().as_bytes())
        .with_context(|| format!("writing {}", md.display()))
}

/// [`write`], a failure a warning: the rows are already on disk.
pub fn write_or_warn(run_dir: &Path, sheet: &Sheet) {
    if let Err(e) = write(run_dir, sheet) {
        eprintln!("warning: no readings in {}: {e:#}", run_dir.display());
    }
}

/// A cell's coordinates as a row that has nothing else.
fn coordinates(cell: &Cell) -> Row {
    Row {
        model: cell.model.clone(),
        prompt_target_len: cell.prompt_target_len(),
        prompt: match &cell.prompt {
            Prompt::Text(t) => t.clone(),
            Prompt::Tokens(_) => String::new(),
        },
        repetition: cell.repetition,
        engine: if cell.engine == Engine::Peer { "peer".into() } else { Engine::KILN.into() },
        ..Row::default()
    }
}

/// The prompt of a row as a cell label shows it: its length, or `text`.
fn prompt_of(r: &Row) -> String {
    r.prompt_target_len.map_or_else(|| "text".into(), |l| l.to_string())
}

/// A row's label as the plan's cell has it: `model@len`, `#rep` past the first,
/// `+peer` for the peer's.
fn row_label(r: &Row) -> String {
    let mut s = format!("{}@{}", r.model, prompt_of(r));
    if r.repetition > 1 {
        s.push_str(&format!("#{}", r.repetition));
    }
    if r.is_peer() {
        s.push_str("+peer");
    }
    s
}

/// One engine's rows of one cell.
#[derive(Default)]
struct Group<'a> {
    rows: Vec<&'a Row>,
    /// The plan's cells of this engine and prompt that have no row.
    not_run: usize,
}

impl Group<'_> {
    /// The ok rows' (repetition, decode, prefill, disturbed).
    fn ok(&self) -> Vec<(u32, f64, f64, bool)> {
        self.rows
            .iter()
            .filter(|r| r.status == Status::Ok.as_str())
            .filter_map(|r| Some((r.repetition, r.decode_tok_s?, r.prefill_tok_s?, !r.disturbed.is_empty())))
            .collect()
    }

    /// The statuses that are not ok, each with its count, in order of appearance.
    fn others(&self) -> Vec<(String, usize)> {
        let mut out: Vec<(String, usize)> = Vec::new();
        for r in self.rows.iter().filter(|r| r.status != Status::Ok.as_str()) {
            match out.iter_mut().find(|(s, _)| *s == r.status) {
                Some((_, n)) => *n += 1,
                None => out.push((r.status.clone(), 1)),
            }
        }
        out
    }
}

/// A rate's cell: the reading of `values` with how many of them were disturbed, or `-`.
fn rate_cell(values: &[(f64, bool)], method: Method) -> (sheet::Cell, Option<Reading>) {
    let xs: Vec<f64> = values.iter().map(|v| v.0).collect();
    match Reading::of(&xs, method) {
        Some(r) => {
            let r = r.disturbed(values.iter().filter(|v| v.1 && v.0 > 0.0 && v.0.is_finite()).count());
            (sheet::Cell::reading(r.clone()), Some(r))
        }
        None => (sheet::Cell::text("-"), None),
    }
}

/// A ratio's value: three decimals, or past them four significant figures, so an end
/// of a wide interval never prints as `0.000`.
fn ratio_value(v: f64) -> String {
    if (1e-3..1e3).contains(&v.abs()) { format!("{v:.3}") } else { crate::verdict::reading::sig(v) }
}

/// A ratio's cell (kiln/peer, no margin: a sweep judges none): its reading as a ratio.
fn ratio_cell(pairs: &[((f64, f64), bool)], method: Method) -> (sheet::Cell, Option<Reading>) {
    let ps: Vec<(f64, f64)> = pairs.iter().map(|p| p.0).collect();
    match Reading::of_pairs(&ps, method) {
        Some(r) => {
            let r = r.disturbed(pairs.iter().filter(|p| p.1).count());
            let text = r.text_with(ratio_value);
            (sheet::Cell { text, reading: Some(r.clone()), judged: None }, Some(r))
        }
        None => (sheet::Cell::text("-"), None),
    }
}

/// The sheet of a sweep's rows: the one computation behind the terminal's summary, the
/// run's readings and report.html.
pub fn sheet_of_rows(rows: &[Row], state: &RunState) -> Sheet {
    sheet_and_verdict(rows, state).0
}

/// [`sheet_of_rows`], and with `--until-ci` whether every interval is under its target.
pub fn sheet_and_verdict(rows: &[Row], state: &RunState) -> (Sheet, bool) {
    let method = if state.until_ci.is_some() { Method::Sequence } else { Method::T };
    let mut models: Vec<&str> = Vec::new();
    for r in rows.iter().chain(&state.not_run) {
        if !models.contains(&r.model.as_str()) {
            models.push(&r.model);
        }
    }
    // Model in order of appearance, then prompt length (a text prompt last), then kiln
    // before the peer.
    type Key = (usize, bool, u64, String);
    let mut cells: BTreeMap<Key, (String, [Group<'_>; 2])> = BTreeMap::new();
    for (r, ran) in rows.iter().map(|r| (r, true)).chain(state.not_run.iter().map(|r| (r, false))) {
        let m = models.iter().position(|m| *m == r.model).unwrap_or(0);
        let key = (m, r.prompt_target_len.is_none(), r.prompt_target_len.unwrap_or(0), r.prompt.clone());
        let label = format!("{}@{}", r.model, prompt_of(r));
        let (_, groups) = cells.entry(key).or_insert_with(|| (label, Default::default()));
        let g = &mut groups[usize::from(r.is_peer())];
        if ran {
            g.rows.push(r);
        } else {
            g.not_run += 1;
        }
    }
    let peer = rows.iter().any(Row::is_peer);
    let mut body = Vec::new();
    let (mut judged, mut wide) = (0usize, Vec::<String>::new());
    let mut check = |what: String, r: &Option<Reading>| {
        let Some(t) = &state.until_ci else { return };
        judged += 1;
        match r {
            Some(r) if r.half_width_pct().is_some_and(|h| h < t.target_pct) => {}
            Some(r) => wide.push(format!("{what} ({})", r.width())),
            None => wide.push(format!("{what} (no reading)")),
        }
    };
    for (label, groups) in cells.values() {
        let label = label.clone();
        let kiln_ok = groups[0].ok();
        let peer_ok = groups[1].ok();
        for (e, g) in groups.iter().enumerate() {
            if g.rows.is_empty() && g.not_run == 0 {
                continue;
            }
            let ok = g.ok();
            let (d, dr) = rate_cell(&ok.iter().map(|o| (o.1, o.3)).collect::<Vec<_>>(), method);
            let (p, pr) = rate_cell(&ok.iter().map(|o| (o.2, o.3)).collect::<Vec<_>>(), method);
            if !ok.is_empty() {
                check(format!("{label} {} decode", if e == 0 { "kiln" } else { "peer" }), &dr);
                check(format!("{label} {} prefill", if e == 0 { "kiln" } else { "peer" }), &pr);
            }
            let mut cells_row = vec![sheet::Cell::text(label.clone())];
            if peer {
                let version = g.rows.iter().map(|r| r.engine_version.as_str()).find(|v| !v.is_empty());
                let name = match (e, version) {
                    (0, _) => "kiln".to_string(),
                    (_, None) => "peer".to_string(),
                    (_, Some(v)) => format!("peer ({v})"),
                };
                cells_row.push(sheet::Cell::text(name));
            }
            cells_row.extend([sheet::Cell::text(format!("{} / {}", ok.len(), g.rows.len())), d, p]);
            if peer {
                let (rd, rp) = if e == 0 && !peer_ok.is_empty() && !kiln_ok.is_empty() {
                    let pairs = |k: fn(&(u32, f64, f64, bool)) -> f64| -> Vec<((f64, f64), bool)> {
                        kiln_ok
                            .iter()
                            .filter_map(|a| {
                                let b = peer_ok.iter().find(|b| b.0 == a.0)?;
                                Some(((k(a), k(b)), a.3 || b.3))
                            })
                            .collect()
                    };
                    let (rd, rdr) = ratio_cell(&pairs(|v| v.1), method);
                    let (rp, rpr) = ratio_cell(&pairs(|v| v.2), method);
                    check(format!("{label} decode kiln/peer"), &rdr);
                    check(format!("{label} prefill kiln/peer"), &rpr);
                    (rd, rp)
                } else {
                    (sheet::Cell::text(""), sheet::Cell::text(""))
                };
                cells_row.extend([rd, rp]);
            }
            let mut others = g.others();
            if g.not_run > 0 {
                others.push(("not run".into(), g.not_run));
            }
            let status = if others.is_empty() {
                "ok".to_string()
            } else if g.rows.len() + g.not_run == 1 {
                others[0].0.clone()
            } else {
                let mut parts = Vec::new();
                if !ok.is_empty() {
                    parts.push(format!("{} ok", ok.len()));
                }
                parts.extend(others.iter().map(|(s, n)| format!("{n} {s}")));
                parts.join(", ")
            };
            cells_row.push(sheet::Cell::text(status));
            body.push(cells_row);
        }
    }
    let mut columns = vec!["cell"];
    if peer {
        columns.push("engine");
    }
    columns.extend(["ok / ran", "decode tok/s", "prefill tok/s"]);
    if peer {
        columns.extend(["decode kiln/peer", "prefill kiln/peer"]);
    }
    columns.push("status");
    let mut legend = format!(
        "decode and prefill tok/s: the geometric mean of the cell's ok repetitions [{}] \
         (n = ok repetitions, ± the interval's half-width; disturbed = measured while other processes were busy)",
        method.describe()
    );
    if peer {
        legend.push_str(
            "; kiln/peer: the geometric mean of the ratios of the repetitions where both ran, with its interval (paired, on the log ratios); above 1 kiln is faster",
        );
    }
    let table = Table {
        title: "per cell".into(),
        legend,
        columns: columns.into_iter().map(str::to_string).collect(),
        rows: body,
    };

    let total = rows.len() + state.not_run.len();
    let mut tally: BTreeMap<&str, usize> = BTreeMap::new();
    for r in rows {
        *tally.entry(r.status.as_str()).or_default() += 1;
    }
    if !state.not_run.is_empty() {
        tally.insert("not run", state.not_run.len());
    }
    let counts: Vec<String> = Status::ALL
        .iter()
        .map(|st| st.as_str())
        .chain(["not run"])
        .filter_map(|name| tally.get(name).map(|n| format!("{n} {name}")))
        .collect();
    let tally_line = format!("{total} cells: {}", counts.join(", "));
    let mut notes = Vec::new();
    let narrow = judged > 0 && wide.is_empty();
    let main = match &state.until_ci {
        None => tally_line,
        Some(t) => {
            notes.push(tally_line);
            let reps = rows.iter().map(|r| r.repetition).max().unwrap_or(0);
            if judged == 0 {
                format!("--until-ci {}%: nothing was measured", t.target_pct)
            } else if narrow {
                format!(
                    "--until-ci {}%: every interval is under ±{}% after {reps} repetitions",
                    t.target_pct, t.target_pct
                )
            } else {
                let shown: Vec<&str> = wide.iter().take(6).map(String::as_str).collect();
                let more =
                    if wide.len() > 6 { format!(" and {} more", wide.len() - 6) } else { String::new() };
                format!(
                    "--until-ci {}%: {} of {judged} intervals are not under ±{}% after {reps} repetitions: {}{more}",
                    t.target_pct,
                    wide.len(),
                    t.target_pct,
                    shown.join(", ")
                )
            }
        }
    };
    // Figures of the CUDA kernels' host execution are the CPU's: said before any of them.
    let host = crate::machine::host_execution_notes(rows.iter().map(|r| r.device.as_str()));
    let headline = format!("{host}{main}");
    notes.extend(listings(rows, total, state));
    notes.extend(memory_lines(rows));
    if let Some(stopped) = state.until_ci.as_ref().and_then(|t| t.stopped.clone()) {
        notes.push(stopped);
    }
    let s = Sheet { task: "sweep".into(), headline, tables: vec![table], notes, roofline: None };
    (s, narrow)
}

/// The lines that list skipped, disturbed and failed cells, and the interruption.
fn listings(rows: &[Row], total: usize, state: &RunState) -> Vec<String> {
    let mut notes = Vec::new();
    // A cell skipped (or disturbed) on several repetitions is listed once, with how many
    // times.
    let group = |picked: &[&Row], with_status: bool| -> Vec<String> {
        let mut seen: Vec<(String, String, usize, String)> = Vec::new();
        for r in picked {
            let base = format!("{}@{}{}", r.model, prompt_of(r), if r.is_peer() { "+peer" } else { "" });
            let st = if with_status { r.status.clone() } else { String::new() };
            match seen.iter_mut().find(|s| s.0 == base && s.1 == st) {
                Some(s) => s.2 += 1,
                None => seen.push((base, st, 1, row_label(r))),
            }
        }
        seen.into_iter()
            .map(|(base, st, n, first)| match (n, st.is_empty()) {
                (1, true) => first,
                (1, false) => format!("{first} ({st})"),
                (_, true) => format!("{base} ({n} times)"),
                (_, false) => format!("{base} ({st}, {n} times)"),
            })
            .collect()
    };
    let list = |pred: &dyn Fn(Status) -> bool| -> (usize, Vec<String>) {
        let picked: Vec<&Row> = rows.iter().filter(|r| status_of(r).is_some_and(pred)).collect();
        (picked.len(), group(&picked, true))
    };
    let (n, skipped) = list(&|st| st.is_skip());
    let items = if skipped.is_empty() { "none".to_string() } else { skipped.join(", ") };
    notes.push(format!("skipped {n} of {total} cells: {items}"));
    let disturbed: Vec<&Row> = rows.iter().filter(|r| !r.disturbed.is_empty()).collect();
    if !disturbed.is_empty() {
        notes.push(format!(
            "disturbed {} of {total} cells (other processes were busy while they ran; see the CSV's disturbed column): {}",
            disturbed.len(),
            group(&disturbed, false).join(", ")
        ));
    }
    let (n, failed) = list(&|st| st.is_failure());
    if n > 0 {
        notes.push(format!("failed {n} of {total} cells: {}", failed.join(", ")));
    }
    if let Some(why) = &state.interrupted {
        // A cell the interruption cancelled (a Slurm task) has a row, but did not finish.
        let cancelled = rows.iter().filter(|r| status_of(r) == Some(Status::SlurmCancelled)).count();
        let done = rows.len() - cancelled;
        let also = if cancelled > 0 { format!(" ({cancelled} cancelled)") } else { String::new() };
        notes.push(format!(
            "interrupted by {why} after {done} of {total} cells{also}; every finished row is kept"
        ));
    }
    notes
}

/// Why a length did not fit, in words.
fn why_not(r: &Row) -> String {
    let needed = r
        .peak_bytes
        .map(|b| format!(": it needed {}, the bytes in use plus the refused request", bytes_text(b)))
        .unwrap_or_default();
    match status_of(r) {
        Some(Status::Oom) => format!("a real out of memory{needed}"),
        Some(Status::OomEstimate) => "the estimate is above the memory budget (not run)".into(),
        Some(Status::OomRecord) => {
            "the OOM record holds an out of memory at this length or a shorter one (not run)".into()
        }
        Some(Status::OomBackstop) => {
            "backstop: a shorter prompt ran out of memory in this run (not run)".into()
        }
        _ if r.reason.is_empty() => format!("{}, not memory", r.status),
        _ => format!("{}, not memory: {}", r.status, r.reason),
    }
}

/// Where each model runs out of memory, one line each: the largest length that fit
/// (with its peak) and the first longer one that did not (with why).
pub fn memory_lines(rows: &[Row]) -> Vec<String> {
    let kiln: Vec<&Row> = rows.iter().filter(|r| !r.is_peer() && r.prompt_target_len.is_some()).collect();
    let mut models: Vec<&str> = Vec::new();
    for r in &kiln {
        if !models.contains(&r.model.as_str()) {
            models.push(&r.model);
        }
    }
    let mut out = Vec::new();
    for m in models {
        let mine: Vec<&Row> = kiln.iter().copied().filter(|r| r.model == m).collect();
        let fits = |len: u64| {
            mine.iter().any(|r| r.prompt_target_len == Some(len) && r.status == Status::Ok.as_str())
        };
        let mut lens: Vec<u64> = mine.iter().filter_map(|r| r.prompt_target_len).collect();
        lens.sort_unstable();
        lens.dedup();
        let largest = lens.iter().copied().filter(|&l| fits(l)).max();
        let first_not = lens.iter().copied().find(|&l| largest.is_none_or(|big| l > big) && !fits(l));
        let fit = match largest {
            Some(l) => {
                let peak = mine
                    .iter()
                    .filter(|r| r.prompt_target_len == Some(l) && r.status == Status::Ok.as_str())
                    .filter_map(|r| r.peak_bytes)
                    .max()
                    .map_or_else(|| "peak not recorded".to_string(), |b| format!("peak {}", bytes_text(b)));
                format!("largest that fit {l} tokens ({peak})")
            }
            None => "no length fit".to_string(),
        };
        let not = match first_not {
            Some(l) => {
                // The most telling row at that length: a real out of memory over what
                // followed from one (the record, the backstop) or an estimate.
                let rank = |r: &Row| match status_of(r) {
                    Some(Status::Oom) => 0,
                    Some(Status::OomRecord) => 1,
                    Some(Status::OomEstimate) => 2,
                    Some(Status::OomBackstop) => 3,
                    _ => 4,
                };
                let r = mine
                    .iter()
                    .filter(|r| r.prompt_target_len == Some(l))
                    .min_by_key(|r| rank(r))
                    .expect("a row at every length");
                format!("; first that did not {l} tokens: {}", why_not(r))
            }
            None => "; every length run fit".to_string(),
        };
        out.push(format!("memory, {m}: {fit}{not}"));
    }
    out
}

/// The exit status of a finished (not interrupted) sweep: 1 when a cell failed, when a
/// cell whose coordinates the user named could not run by rule, or when nothing at all
/// was measured; 0 otherwise (skips of cells derived from defaults and out-of-memory
/// results are results).
pub fn exit_status(finished: &[Finished<'_>]) -> (u8, Vec<String>) {
    let mut reasons = Vec::new();
    let mut measured = false;
    for f in finished {
        let Some(st) = f.row.and_then(status_of) else { continue };
        if st == Status::Ok {
            measured = true;
        } else if st.is_failure() {
            reasons.push(format!("{} failed ({st})", f.cell.label()));
        } else if st.is_by_rule() && f.cell.named_for(st) {
            reasons.push(format!("{} was named explicitly but cannot run ({st})", f.cell.label()));
        }
    }
    if !measured {
        reasons.push("nothing was measured".into());
    }
    (u8::from(!reasons.is_empty()), reasons)
}

#[cfg(test)]
mod tests {
    use super::super::plan::{CellTemplate, Named};
    use super::*;
    use crate::verdict::reading::{Method, Reading};

    fn plan(named: Named) -> Plan {
        Plan::grid(
            &["a".to_string(), "b".to_string()],
            &[Prompt::Tokens(512), Prompt::Tokens(2048)],
            &CellTemplate { max_tokens: 8, warmup_tokens: 0, named },
        )
    }

    fn rows(plan: &Plan, statuses: &[&str]) -> BTreeMap<CellKey, Row> {
        plan.cells
            .iter()
            .zip(statuses)
            .filter(|(_, s)| !s.is_empty())
            .map(|(c, s)| {
                let row = Row {
                    model: c.model.clone(),
                    prompt_target_len: c.prompt_target_len(),
                    decode_tok_s: Some(12.345),
                    prefill_tok_s: Some(1234.5),
                    status: s.to_string(),
                    ..Row::default()
                };
                (c.key(), row)
            })
            .collect()
    }

    fn exit(named: Named, statuses: &[&str]) -> u8 {
        let p = plan(named);
        let r = rows(&p, statuses);
        exit_status(&pair(&p, &r)).0
    }

    const DEFAULTS: Named = Named { models: false, prompts: false };
    const EXPLICIT: Named = Named { models: true, prompts: true };
    const MODELS_ONLY: Named = Named { models: true, prompts: false };

    #[test]
    fn derived_skips_and_ooms_exit_zero() {
        assert_eq!(exit(DEFAULTS, &["ok", "SKIP:context", "SKIP:missing_model", "SKIP:unsupported"]), 0);
        assert_eq!(exit(EXPLICIT, &["ok", "SKIP:oom", "SKIP:oom_backstop", "SKIP:oom_record"]), 0);
        assert_eq!(exit(EXPLICIT, &["ok", "SKIP:oom_estimate", "ok", "ok"]), 0);
        assert_eq!(exit(MODELS_ONLY, &["ok", "SKIP:context", "ok", "SKIP:context"]), 0);
    }

    #[test]
    fn explicit_by_rule_skips_failures_and_nothing_measured_exit_one() {
        assert_eq!(exit(EXPLICIT, &["ok", "SKIP:context", "ok", "ok"]), 1);
        assert_eq!(exit(MODELS_ONLY, &["ok", "ok", "SKIP:missing_model", "SKIP:missing_model"]), 1);
        assert_eq!(exit(DEFAULTS, &["ok", "FAIL:timeout", "ok", "ok"]), 1);
        assert_eq!(exit(DEFAULTS, &["ok", "FAIL:no_output", "ok", "ok"]), 1);
        assert_eq!(exit(DEFAULTS, &["SKIP:oom", "SKIP:oom_backstop", "SKIP:oom_record", "SKIP:oom"]), 1);
        assert_eq!(exit(DEFAULTS, &["", "", "", ""]), 1);
    }

    #[test]
    fn the_summary_shows_rates_statuses_and_the_tally() {
        let p = plan(DEFAULTS);
        let mut r = rows(&p, &["ok", "SKIP:oom", "SKIP:context", ""]);
        r.get_mut(&p.cells[0].key()).unwrap().disturbed = "other processes used 1.20 CPUs".into();
        let text = render(&p, &pair(&p, &r), Some("SIGINT"));
        // One row per cell, each rate a reading: the disturbed one says so in its text.
        assert!(text.contains("| cell | ok / ran | decode tok/s | prefill tok/s | status |"), "{text}");
        assert!(
            text.contains("| a@512 | 1 / 1 | 12.35 (n=1: no interval, 1 disturbed) | 1235 (n=1: no interval, 1 disturbed) | ok |"),
            "{text}"
        );
        assert!(text.contains("| a@2048 | 0 / 1 | - | - | SKIP:oom |"), "{text}");
        assert!(text.contains("| b@512 | 0 / 1 | - | - | SKIP:context |"), "{text}");
        assert!(text.contains("| b@2048 | 0 / 0 | - | - | not run |"), "{text}");
        assert!(text.contains("4 cells: 1 ok, 1 SKIP:oom, 1 SKIP:context, 1 not run"), "{text}");
        assert!(text.contains("skipped 2 of 4 cells: a@2048 (SKIP:oom), b@512 (SKIP:context)"), "{text}");
        assert!(text.contains("interrupted by SIGINT after 3 of 4 cells"), "{text}");
        assert!(text.contains("disturbed 1 of 4 cells (other processes were busy"), "{text}");
        assert!(text.contains("see the CSV's disturbed column): a@512\n"), "{text}");
    }

    #[test]
    fn a_summary_of_the_host_execution_says_its_figures_are_not_a_gpus() {
        let p = plan(DEFAULTS);
        let mut r = rows(&p, &["ok", "ok", "ok", ""]);
        for row in r.values_mut() {
            row.device = "cuda:host execution on Some CPU (24 GiB)".into();
        }
        let text = render(&p, &pair(&p, &r), None);
        let first = text.lines().next().unwrap_or("");
        assert_eq!(
            first,
            "figures are the CUDA kernels' host execution on Some CPU (24 GiB), not a GPU (KILN_CUDA_EMULATE=1)",
            "{text}"
        );
        assert_eq!(text.matches("host execution").count(), 1, "one line per device{text}");
        // A GPU's or the CPU's rows carry no such line.
        for device in ["cuda:NVIDIA H200 (143771 MiB)", "cpu:Some CPU (24 GiB)"] {
            for row in r.values_mut() {
                row.device = device.into();
            }
            let text = render(&p, &pair(&p, &r), None);
            assert!(!text.contains("host execution"), "{text}");
        }
    }

    #[test]
    fn cells_a_slurm_interrupt_cancelled_do_not_count_as_finished() {
        let p = plan(DEFAULTS);
        let r = rows(&p, &["ok", "FAIL:slurm_cancelled", "FAIL:slurm_cancelled", "FAIL:slurm_cancelled"]);
        let text = render(&p, &pair(&p, &r), Some("SIGINT"));
        assert!(
            text.contains(
                "interrupted by SIGINT after 1 of 4 cells (3 cancelled); every finished row is kept"
            ),
            "{text}"
        );
    }

    #[test]
    fn with_repeat_the_main_table_summarises_every_repetition() {
        // Repetition 1 of a@512 ran at 10 tok/s, 2 and 3 at 40: the table must not show
        // repetition 1 as the cell's figure but the geometric mean of all three.
        let p = super::super::series::expand(&plan(DEFAULTS), 3, false);
        let mut r: BTreeMap<CellKey, Row> = BTreeMap::new();
        for c in &p.cells {
            let (d, status) = match (c.model.as_str(), c.prompt_target_len().unwrap_or(0), c.repetition) {
                ("a", 512, 1) => (10.0, "ok"),
                ("a", 512, _) => (40.0, "ok"),
                ("b", 2048, _) => (1.0, "SKIP:context"),
                ("b", 512, 2) => (1.0, "FAIL:timeout"),
                _ => (20.0, "ok"),
            };
            let row = Row {
                model: c.model.clone(),
                prompt_target_len: c.prompt_target_len(),
                decode_tok_s: Some(d),
                prefill_tok_s: Some(100.0 * d),
                status: status.to_string(),
                repetition: c.repetition,
                ..Row::default()
            };
            r.insert(c.key(), row);
        }
        let text = render(&p, &pair(&p, &r), None);
        assert!(text.contains("the geometric mean of the cell's ok repetitions"), "{text}");
        // (10 * 40 * 40)^(1/3) = 25.2, with its interval; prefill 100 times that.
        let a = Reading::of(&[10.0, 40.0, 40.0], Method::T).unwrap();
        assert!(a.text().starts_with("25.20 ["), "{}", a.text());
        let pa = Reading::of(&[1000.0, 4000.0, 4000.0], Method::T).unwrap();
        assert!(text.contains(&format!("| a@512 | 3 / 3 | {} | {} | ok |", a.text(), pa.text())), "{text}");
        assert!(text.contains("| b@512 | 2 / 3 | 20.00 [20.00, 20.00] (n=2, zero width"), "{text}");
        assert!(text.contains("| 2 ok, 1 FAIL:timeout |"), "{text}");
        assert!(text.contains("| b@2048 | 0 / 3 | - | - | 3 SKIP:context |"), "{text}");
        // A cell skipped on every repetition is listed once.
        assert!(text.contains("skipped 3 of 12 cells: b@2048 (SKIP:context, 3 times)"), "{text}");
    }

    #[test]
    fn a_ratio_s_wide_interval_never_ends_at_zero() {
        assert_eq!(ratio_value(2.0), "2.000");
        assert_eq!(ratio_value(0.0000385), "3.85e-5");
        assert_eq!(ratio_value(4506717.852), "4506718");
        let pairs = [((1.0, 50.0), false), ((35.0, 1.0), true)];
        let (cell, r) = ratio_cell(&pairs, Method::T);
        assert!(r.unwrap().interval.unwrap().0 < 1e-3);
        assert!(!cell.text.contains("[0.000,"), "{}", cell.text);
        assert!(
            cell.text.contains("within a factor of") && cell.text.ends_with(", 1 disturbed)"),
            "{}",
            cell.text
        );
    }

    fn mem_row(model: &str, len: u64, status: &str, peak: Option<u64>) -> Row {
        Row {
            model: model.into(),
            prompt_target_len: Some(len),
            status: status.into(),
            peak_bytes: peak,
            decode_tok_s: (status == "ok").then_some(10.0),
            prefill_tok_s: (status == "ok").then_some(100.0),
            repetition: 1,
            engine: "kiln".into(),
            ..Row::default()
        }
    }

    #[test]
    fn where_each_model_runs_out_of_memory_is_one_line() {
        let rows = [
            mem_row("a", 512, "ok", Some(3 << 20)),
            mem_row("a", 2048, "ok", Some(1_288_490_189)),
            // Repetition 1 was pre-skipped by the backstop; repetition 2 ran out for real.
            mem_row("a", 8192, "SKIP:oom_backstop", None),
            mem_row("a", 8192, "SKIP:oom", Some(5 << 30)),
            mem_row("a", 32768, "SKIP:oom_backstop", None),
            mem_row("b", 512, "SKIP:oom_estimate", None),
            mem_row("c", 512, "ok", None),
            mem_row("c", 2048, "SKIP:oom_record", None),
            mem_row("d", 16, "ok", Some(1000)),
            mem_row("d", 2048, "SKIP:context", None),
            mem_row("e", 16, "ok", Some(1000)),
        ];
        let lines = memory_lines(&rows);
        assert_eq!(
            lines,
            [
                "memory, a: largest that fit 2048 tokens (peak 1.2 GiB (1288490189 bytes)); first that did not 8192 tokens: a real out of memory: it needed 5.0 GiB (5368709120 bytes), the bytes in use plus the refused request",
                "memory, b: no length fit; first that did not 512 tokens: the estimate is above the memory budget (not run)",
                "memory, c: largest that fit 512 tokens (peak not recorded); first that did not 2048 tokens: the OOM record holds an out of memory at this length or a shorter one (not run)",
                "memory, d: largest that fit 16 tokens (peak 1000 B (1000 bytes)); first that did not 2048 tokens: SKIP:context, not memory",
                "memory, e: largest that fit 16 tokens (peak 1000 B (1000 bytes)); every length run fit",
            ]
        );
        // The sheet carries them, so the terminal and the page say the same.
        let sheet = sheet_of_rows(&rows, &RunState::default());
        for l in &lines {
            assert!(sheet.notes.contains(l) && sheet.markdown().contains(l.as_str()), "{l}");
        }
    }
}
