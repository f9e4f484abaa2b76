//! The cell driver: walks a plan through the layers and the runner, writing one flushed
//! row per cell and feeding each outcome back to the layers and the record.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Result;

use super::classify::Status;
use super::layers::{self, EstimateFacts, OomLayers, Skip};
use super::plan::{self, CellKey, Engine, Plan};
use super::record::RecordLine;
use super::rows::{CsvOut, Knobs, Output, Row, round3};
use super::runner::{CellRunner, Outcome, Ran};
use super::summary;
use crate::child::{self as shutdown, Shutdown};
use crate::console;
use crate::peer::{PeerOutcome, PeerRunner};
use crate::quiet;
use crate::verdict::sheet::Sheet;

/// The current time for rows and records: UTC, seconds.
pub(crate) fn now() -> String {
    chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// What every row of a run says about where it comes from: the fingerprint every sweep's
/// rows carry.
pub(crate) struct RowMeta {
    pub(crate) root: PathBuf,
    pub(crate) host: String,
    pub(crate) backend: String,
    pub(crate) commit: String,
    /// Build features, `None` for a binary the harness did not build.
    pub(crate) features: Option<Vec<String>>,
    pub(crate) kiln_env: BTreeMap<String, String>,
    /// The engine's version; filled from the first report when the package did not say.
    pub(crate) kiln_version: String,
    /// The NVIDIA driver's version when the backend runs on a GPU, else empty.
    pub(crate) driver_version: String,
    /// The CUDA version that driver supports, else empty.
    pub(crate) cuda_version: String,
}

impl RowMeta {
    /// The `features` column: the build features (`none`, `cuda`, or `unknown` for a
    /// binary the harness did not build), then `; ` and the cell's `KILN_*` environment
    /// (inherited, plus what the cell sets) when there is any.
    pub(crate) fn features_column(&self, cell_env: &BTreeMap<String, String>) -> String {
        let features = match &self.features {
            None => "unknown".to_string(),
            Some(f) if f.is_empty() => "none".to_string(),
            Some(f) => f.join("+"),
        };
        let mut env = self.kiln_env.clone();
        env.extend(cell_env.iter().map(|(k, v)| (k.clone(), v.clone())));
        if env.is_empty() {
            features
        } else {
            let pairs: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
            format!("{features}; {}", pairs.join(" "))
        }
    }

    /// A kiln cell's row before anything is known of its run: the cell's coordinates and
    /// knobs (`knobs` with the cell's token counts) and where the row comes from; the
    /// model path is the model as named, the device and the measurements empty.
    pub(super) fn cell_row(&self, cell: &plan::Cell, knobs: &Knobs) -> Row {
        let mut row = Row {
            model: cell.model.clone(),
            model_path: cell.model.clone(),
            date: now(),
            host: self.host.clone(),
            backend: self.backend.clone(),
            kiln_version: self.kiln_version.clone(),
            commit: self.commit.clone(),
            features: self.features_column(&cell.env),
            driver_version: self.driver_version.clone(),
            cuda_version: self.cuda_version.clone(),
            prompt: cell.prompt_text().to_string(),
            prompt_target_len: cell.prompt_target_len(),
            repetition: cell.repetition,
            engine: Engine::KILN.into(),
            ..Row::default()
        };
        row.set_knobs(&Knobs {
            max_tokens: cell.max_tokens,
            warmup_tokens: cell.warmup_tokens,
            ..knobs.clone()
        });
        row
    }

    pub(crate) fn display(&self, p: &Path) -> String {
        p.strip_prefix(&self.root).unwrap_or(p).display().to_string()
    }
}

/// `text` on one line, for the `reason` column.
pub(super) fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Walks a plan: layers, runner, rows.
pub(super) struct Driver<'a> {
    pub(super) meta: RowMeta,
    pub(super) shutdown: &'a Shutdown,
    pub(super) plan: &'a Plan,
    pub(super) layers: OomLayers,
    pub(super) estimate_on: bool,
    pub(super) source_csv: String,
    /// Where the engine found each model, from its estimates.
    pub(super) model_paths: BTreeMap<String, String>,
    /// The engine knobs of every row (the token counts come from each cell).
    pub(super) knobs: Knobs,
    /// The `--peer` engine, for the plan's peer cells.
    pub(super) peer: Option<PeerRunner<'a>>,
    /// The quiet check: the busy limit, and how long to wait for quiet before a cell
    /// (`--require-quiet`; `None` only marks disturbed cells).
    pub(super) quiet: (quiet::Limits, Option<std::time::Duration>),
    /// The roofs each kiln cell measured beside itself (`--measure-roofs`).
    pub(super) roofs: super::roofs::CellRoofs,
}

/// What happened to one cell a layer judged: skipped by it, or run.
pub(crate) enum Judged<T> {
    /// A layer decided not to launch it.
    Skipped(Skip),
    /// It ran, with this result.
    Ran(T),
}

/// What happened to one decode cell.
type CellResult = Judged<Box<Outcome>>;

/// The OOM layers' verdict on `cell` for `device` (backstop, record, fake-OOM hook), then
/// `run` when they let it: the order every kiln cell keeps, a decode sweep's and
/// bench-offload-copy's alike.
pub(crate) fn judge_then_run<T>(
    layers: &mut OomLayers,
    cell: &plan::Cell,
    device: &str,
    run: impl FnOnce() -> Result<Ran<T>>,
) -> Result<Ran<Judged<T>>> {
    if let Some(skip) = layers.judge(cell, device)? {
        return Ok(Ran::Done(Judged::Skipped(skip)));
    }
    Ok(match run()? {
        Ran::Done(t) => Ran::Done(Judged::Ran(t)),
        Ran::Interrupted(sig) => Ran::Interrupted(sig),
    })
}

/// What a written row tells the OOM layers about its cell.
pub(crate) struct Written<'r> {
    /// The row's status.
    pub(crate) status: Status,
    /// The row's date.
    pub(crate) date: &'r str,
    /// The row's commit.
    pub(crate) commit: &'r str,
    /// What the cell needed when it ran out of memory, when it said.
    pub(crate) peak_bytes: Option<u64>,
    /// Where it ran (what a record line is scoped to).
    pub(crate) device: String,
}

/// Feeds a cell's written row back to the OOM layers: only an exact `SKIP:oom` reaches
/// the backstop and the record (keyed by `cell`'s model and length, naming `source_csv`),
/// and an appended record line is said on stderr. Every kiln cell ends here once its row
/// is on disk.
pub(crate) fn feed_back(
    layers: &mut OomLayers,
    meta: &RowMeta,
    source_csv: &str,
    cell: &plan::Cell,
    row: Written<'_>,
) -> Result<()> {
    let appended = layers.observe(cell, row.status, || RecordLine {
        model: cell.model.clone(),
        prompt_target_len: cell.layer_len(),
        date: row.date.to_string(),
        commit: row.commit.to_string(),
        demand_bytes: row.peak_bytes,
        source_csv: source_csv.to_string(),
        device: Some(row.device),
    })?;
    if appended {
        eprintln!(
            "    recorded {}@{} in {}",
            cell.model,
            cell.layer_len(),
            meta.display(layers.record.file().path())
        );
    }
    Ok(())
}

/// The end of a sweep: its one summary on stdout (`sheet`, the readings of `plan`'s cells,
/// which the caller keeps in the run directory), the reasons for a non-zero exit on
/// stderr, and the exit status (the signal's when `interrupted`) with the sheet.
pub(super) fn conclude(
    plan: &Plan,
    rows: &BTreeMap<CellKey, Row>,
    interrupted: Option<i32>,
    sheet: Sheet,
    source_csv: &str,
    elapsed: std::time::Duration,
) -> Result<(u8, Sheet)> {
    console::out(&format!("\n{}", sheet.markdown()))?;
    if let Some(sig) = interrupted {
        return Ok((shutdown::exit_code_for(sig), sheet));
    }
    let finished = summary::pair(plan, rows);
    let (code, reasons) = summary::exit_status(&finished);
    for r in &reasons {
        eprintln!("exit 1: {r}");
    }
    eprintln!("results: {source_csv} ({:.0} s)", elapsed.as_secs_f64());
    Ok((code, sheet))
}

impl Driver<'_> {
    /// Runs every cell of the plan, prints the summary and returns the exit status with
    /// the summary's sheet (which the session keeps in the run directory).
    pub(super) fn run(&mut self, runner: &mut dyn CellRunner, output: Output) -> Result<(u8, Sheet)> {
        let mut rows: BTreeMap<CellKey, Row> = BTreeMap::new();
        let mut csv = output.csv;
        if let Some(existing) = output.resumed {
            let wanted: BTreeMap<CellKey, ()> = self.plan.cells.iter().map(|c| (c.key(), ())).collect();
            for row in existing.into_iter().filter(|r| wanted.contains_key(&r.key())) {
                self.note_earlier(&row);
                rows.insert(row.key(), row);
            }
            eprintln!(
                "resuming {}: {} of {} cells already have a row",
                self.source_csv,
                rows.len(),
                self.plan.cells.len()
            );
        }
        let started = Instant::now();
        let interrupted = self.walk(runner, &mut csv, &mut rows)?;
        let finished = summary::pair(self.plan, &rows);
        let mut sheet = summary::sheet(&finished, interrupted.map(shutdown::signal_name));
        self.roofs.add_to(&mut sheet);
        conclude(self.plan, &rows, interrupted, sheet, &self.source_csv, started.elapsed())
    }

    /// Runs every cell of the plan that has no row in `rows` yet, in order: each row is
    /// written to `csv` as it is made and kept in `rows`. Returns the signal that
    /// interrupted the walk, if one did.
    pub(super) fn walk(
        &mut self,
        runner: &mut dyn CellRunner,
        csv: &mut CsvOut,
        rows: &mut BTreeMap<CellKey, Row>,
    ) -> Result<Option<i32>> {
        let total = self.plan.cells.len();
        let mut interrupted = None;
        for (i, cell) in self.plan.cells.iter().enumerate() {
            if rows.contains_key(&cell.key()) {
                continue;
            }
            if let Some(sig) = self.shutdown.pending() {
                interrupted = Some(sig);
                break;
            }
            if self.quiet.1.is_some() {
                let what = format!("cell {cell}");
                if let (_, Some(sig)) =
                    quiet::wait_quiet(self.quiet.0, self.quiet.1, self.shutdown, &[], &what)
                {
                    interrupted = Some(sig);
                    break;
                }
            }
            let probe = quiet::Probe::around_children();
            if cell.engine == Engine::Peer {
                let outcome = match self.peer.as_mut() {
                    Some(peer) => match peer.run(i, cell)? {
                        Ran::Done(o) => o,
                        Ran::Interrupted(sig) => {
                            interrupted = Some(sig);
                            break;
                        }
                    },
                    None => anyhow::bail!("the plan has a peer cell ({cell}) but no --peer was given"),
                };
                let mut row = self.peer_row(runner, cell, &outcome);
                row.disturbed = self.disturbed(probe.as_ref());
                csv.write(&row)?;
                match &outcome.report {
                    Some(r) => eprintln!(
                        "[{}/{total}] {cell}: ok: decode {:.1} tok/s, prefill {:.1} tok/s ({})",
                        i + 1,
                        r.decode_tok_s,
                        r.prefill_tok_s,
                        outcome.version
                    ),
                    None => eprintln!("[{}/{total}] {cell}: {}: {}", i + 1, row.status, row.reason),
                }
                rows.insert(cell.key(), row);
                continue;
            }
            match self.cell(runner, i, total, cell, probe.as_ref(), &mut |row| csv.write(row))? {
                Ran::Done(row) => rows.insert(cell.key(), row),
                Ran::Interrupted(sig) => {
                    interrupted = Some(sig);
                    break;
                }
            };
        }
        if let Some(sig) = interrupted {
            eprintln!(
                "interrupted by {}: the running cell's process group was killed; finished rows are in {}",
                shutdown::signal_name(sig),
                self.source_csv
            );
        }
        Ok(interrupted)
    }

    /// A row of this sweep written before this cell (a resumed file's, or an earlier
    /// Slurm task's): a resumed sweep is the same sweep, so its earlier OOMs still backstop.
    pub(super) fn note_earlier(&mut self, row: &Row) {
        if row.status == Status::Oom.as_str() {
            let len = row.prompt_target_len.unwrap_or(0);
            self.layers.backstop.note_oom(&row.model, len);
        }
    }

    /// One kiln cell, the whole way: the layers, the runner, its row (marked disturbed
    /// when `probe` saw other work beside it) handed to `write` (before
    /// anything else happens, so it is never lost), the line on stderr, and the outcome
    /// fed back to the backstop and the record. The local loop and a Slurm task
    /// (`sweep-task`) both run a cell through here.
    pub(super) fn cell(
        &mut self,
        runner: &mut dyn CellRunner,
        i: usize,
        total: usize,
        cell: &plan::Cell,
        probe: Option<&quiet::Probe>,
        write: &mut dyn FnMut(&Row) -> Result<()>,
    ) -> Result<Ran<Row>> {
        let result = match self.one_cell(runner, i, cell)? {
            Ran::Done(r) => r,
            Ran::Interrupted(sig) => return Ok(Ran::Interrupted(sig)),
        };
        let mut row = self.row(runner, cell, &result);
        if let CellResult::Ran(o) = &result {
            row.disturbed = self.disturbed(probe);
            if let Some(r) = &o.report {
                self.roofs.note(cell.label(), r);
            }
        }
        let status = Status::parse(&row.status).unwrap_or(Status::Bench);
        write(&row)?;
        self.print_cell(i, total, cell, &row, &result);
        let device = match &result {
            CellResult::Ran(o) => o.device.clone(),
            CellResult::Skipped(_) => runner.device().to_string(),
        };
        let written =
            Written { status, date: &row.date, commit: &row.commit, peak_bytes: row.peak_bytes, device };
        feed_back(&mut self.layers, &self.meta, &self.source_csv, cell, written)?;
        Ok(Ran::Done(row))
    }

    /// The layers in order, then the runner.
    fn one_cell(
        &mut self,
        runner: &mut dyn CellRunner,
        i: usize,
        cell: &plan::Cell,
    ) -> Result<Ran<CellResult>> {
        let facts = match runner.estimate(i, cell)? {
            Ran::Done(f) => f,
            Ran::Interrupted(sig) => return Ok(Ran::Interrupted(sig)),
        };
        if let EstimateFacts::Report(r) = &facts {
            self.model_paths.insert(cell.model.clone(), r.model_path.clone());
        }
        if let EstimateFacts::Failed(why) = &facts
            && !self.estimate_on
        {
            eprintln!("warning: {cell}: kiln estimate failed ({why}); running it anyway (--no-estimate)");
        }
        if let Some(skip) = layers::judge_estimate(&facts, self.estimate_on, runner.device_budget()) {
            return Ok(Ran::Done(CellResult::Skipped(skip)));
        }
        let device = runner.device().to_string();
        judge_then_run(&mut self.layers, cell, &device, || {
            Ok(match runner.run(i, cell)? {
                Ran::Done(o) => Ran::Done(Box::new(o)),
                Ran::Interrupted(sig) => Ran::Interrupted(sig),
            })
        })
    }

    fn row(&mut self, runner: &mut dyn CellRunner, cell: &plan::Cell, result: &CellResult) -> Row {
        let mut row = self.meta.cell_row(cell, &self.knobs);
        row.device = runner.device().to_string();
        if let Some(path) = self.model_paths.get(&cell.model) {
            row.model_path = path.clone();
        }
        match result {
            CellResult::Skipped(skip) => {
                row.status = skip.status.as_str().into();
                row.reason = one_line(&skip.reason);
            }
            CellResult::Ran(o) => {
                row.status = o.status.as_str().into();
                row.reason = o.reason.as_deref().map(one_line).unwrap_or_default();
                row.host = o.host.clone();
                row.device = o.device.clone();
                row.peak_bytes = o.oom_demand_bytes;
                if let Some(r) = &o.report {
                    if self.meta.kiln_version.is_empty() {
                        self.meta.kiln_version = r.kiln_version.clone();
                    }
                    row.model_path = r.model_path.clone();
                    row.prompt_tokens = Some(r.prompt_tokens);
                    row.generated_tokens = Some(r.generated_tokens);
                    row.prefill_ms = Some(round3(r.prefill_ms));
                    row.prefill_tok_s = Some(round3(r.prefill_tok_s));
                    row.decode_ms = Some(round3(r.decode_ms));
                    row.decode_tok_s = Some(round3(r.decode_tok_s));
                    row.peak_bytes = Some(r.peak_bytes);
                    row.max_rss_bytes = r.max_rss_bytes;
                    row.backend = r.backend.clone();
                    row.kiln_version = r.kiln_version.clone();
                }
            }
        }
        row.engine_version = row.kiln_version.clone();
        row
    }

    /// What else ran while a cell did, when it was more than the busy limit.
    fn disturbed(&self, probe: Option<&quiet::Probe>) -> String {
        probe.and_then(quiet::Probe::finish).and_then(|r| r.busy(self.quiet.0)).unwrap_or_default()
    }

    /// The row of a peer cell: the cell's coordinates and knobs like kiln's row, the
    /// peer's measurement, program and version.
    fn peer_row(&self, runner: &dyn CellRunner, cell: &plan::Cell, o: &PeerOutcome) -> Row {
        let s = &self.meta;
        let mut row = Row {
            model: cell.model.clone(),
            model_path: o.model_path.clone().unwrap_or_else(|| cell.model.clone()),
            date: now(),
            host: s.host.clone(),
            device: runner.device().to_string(),
            backend: s.backend.clone(),
            kiln_version: s.kiln_version.clone(),
            commit: s.commit.clone(),
            features: s.features_column(&cell.env),
            driver_version: s.driver_version.clone(),
            cuda_version: s.cuda_version.clone(),
            prompt: cell.prompt_text().to_string(),
            prompt_target_len: cell.prompt_target_len(),
            status: o.status.as_str().into(),
            repetition: cell.repetition,
            engine: crate::peer::PROGRAM.into(),
            engine_version: o.version.clone(),
            reason: o.reason.as_deref().map(one_line).unwrap_or_default(),
            ..Row::default()
        };
        row.set_knobs(&Knobs {
            max_tokens: cell.max_tokens,
            warmup_tokens: cell.warmup_tokens,
            ..self.knobs.clone()
        });
        if let Some(r) = &o.report {
            row.prompt_tokens = Some(r.prompt_tokens);
            row.generated_tokens = Some(r.generated_tokens);
            row.prefill_ms = Some(round3(r.prefill_ms));
            row.prefill_tok_s = Some(round3(r.prefill_tok_s));
            row.decode_ms = Some(round3(r.decode_ms));
            row.decode_tok_s = Some(round3(r.decode_tok_s));
        }
        row
    }

    fn print_cell(&self, i: usize, total: usize, cell: &plan::Cell, row: &Row, result: &CellResult) {
        let head = format!("[{}/{total}] {cell}", i + 1);
        match result {
            CellResult::Skipped(skip) => eprintln!("{head}: {}: {}", skip.status, skip.reason),
            CellResult::Ran(o) => match &o.report {
                Some(r) => eprintln!(
                    "{head}: ok: decode {:.1} tok/s, prefill {:.1} tok/s, {} prompt tokens, peak {:.1} MiB",
                    r.decode_tok_s,
                    r.prefill_tok_s,
                    r.prompt_tokens,
                    r.peak_bytes as f64 / (1u64 << 20) as f64
                ),
                None => eprintln!(
                    "{head}: {}: {} (log: {})",
                    row.status,
                    o.reason.as_deref().unwrap_or("no reason given"),
                    self.meta.display(Path::new(&o.log))
                ),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use kiln_protocol::EstimateReport;

    use super::super::layers::{Backstop, FakeOom};
    use super::super::record::{self, RecordFile, RecordView};
    use super::super::rows::{self, CsvOut};
    use super::plan::{CellTemplate, Named, Prompt};
    use super::*;

    /// A runner that answers from a script: which models exist, which cells fail their
    /// estimate, which run out of memory. It records what it was asked to launch.
    struct Scripted {
        missing: BTreeSet<String>,
        estimate_fails: BTreeSet<String>,
        ooms: BTreeSet<String>,
        launched: Vec<String>,
    }

    impl CellRunner for Scripted {
        fn estimate(&mut self, _: usize, cell: &plan::Cell) -> Result<Ran<EstimateFacts>> {
            if self.missing.contains(&cell.model) {
                return Ok(Ran::Done(EstimateFacts::MissingModel(format!(
                    "model not found: {}",
                    cell.model
                ))));
            }
            if self.estimate_fails.contains(&cell.label()) {
                return Ok(Ran::Done(EstimateFacts::Failed("exit code 1: boom".into())));
            }
            Ok(Ran::Done(EstimateFacts::Report(Box::new(EstimateReport {
                model: cell.model.clone(),
                model_path: cell.model.clone(),
                prompt_tokens: cell.layer_len(),
                max_tokens: cell.max_tokens,
                weights_bytes: 1,
                kv_bytes: 1,
                scratch_bytes: 1,
                total_bytes: 3,
                memory_limit_bytes: None,
                fits: true,
                context_length: 4096,
                attention: "streaming".into(),
                prefill_chunk: 0,
                within_context: true,
                kv_dtype: None,
                workspace_bytes: None,
                attention_scores_bytes: None,
                expert_slots: None,
                experts_bytes: None,
                moe_layers: None,
                moe_experts: None,
                moe_top_k: None,
                expert_slot_bytes: None,
                device: None,
            }))))
        }

        fn run(&mut self, _: usize, cell: &plan::Cell) -> Result<Ran<Outcome>> {
            self.launched.push(cell.label());
            let oom = self.ooms.contains(&cell.label());
            Ok(Ran::Done(Outcome {
                status: if oom { Status::Oom } else { Status::NoOutput },
                report: None,
                oom_demand_bytes: oom.then_some(777),
                reason: Some("scripted".into()),
                host: "elsewhere".into(),
                device: "gpu:remote".into(),
                log: "log".into(),
            }))
        }

        fn device(&self) -> &str {
            "gpu:remote"
        }
    }

    fn set(items: &[&str]) -> BTreeSet<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_driver_feeds_outcomes_from_wherever_they_ran_into_rows_and_the_record() {
        let dir = tempfile::tempdir().unwrap();
        let record = RecordFile::new(dir.path().join(".oom-record"));
        let plan = Plan::grid(
            &["a".to_string(), "b".to_string(), "gone".to_string()],
            &[Prompt::Tokens(1), Prompt::Tokens(2), Prompt::Tokens(3)],
            &CellTemplate { max_tokens: 4, warmup_tokens: 0, named: Named { models: false, prompts: false } },
        );
        let csv = dir.path().join("out.csv");
        // b@1 already has a SKIP:oom row from the interrupted first half of this sweep.
        let earlier = Row {
            model: "b".into(),
            date: "2026-01-01T00:00:00Z".into(),
            prompt_target_len: Some(1),
            status: "SKIP:oom".into(),
            max_tokens: 4,
            ..Row::default()
        };
        let mut first = CsvOut::create(&csv).unwrap();
        first.write(&earlier).unwrap();
        drop(first);
        let shutdown = Shutdown::install().unwrap();
        let mut driver = Driver {
            roofs: Default::default(),
            meta: RowMeta {
                root: dir.path().to_path_buf(),
                host: "here".into(),
                backend: "cpu".into(),
                commit: "abc1234".into(),
                features: Some(vec![]),
                kiln_env: BTreeMap::new(),
                kiln_version: "0.1.0".into(),
                driver_version: String::new(),
                cuda_version: String::new(),
            },
            shutdown: &shutdown,
            plan: &plan,
            layers: OomLayers {
                backstop: Backstop::default(),
                record: RecordView::new(record.clone()),
                ignore_record: false,
                fake: FakeOom::default(),
            },
            estimate_on: true,
            source_csv: "out.csv".into(),
            model_paths: BTreeMap::new(),
            knobs: Knobs::default(),
            peer: None,
            quiet: (quiet::Limits { others_cpus: f64::INFINITY }, None),
        };
        let mut runner = Scripted {
            missing: set(&["gone"]),
            estimate_fails: set(&["a@3"]),
            ooms: set(&["a@2"]),
            launched: Vec::new(),
        };
        let (out, resumed) = CsvOut::resume(&csv).unwrap();
        let output = Output { path: csv.clone(), csv: out, resumed: Some(resumed) };
        let (code, _) = driver.run(&mut runner, output).unwrap();
        assert_eq!(code, 1, "a@1 and a@3 failed");
        // b is backstopped by its earlier row; gone never reaches the runner.
        assert_eq!(runner.launched, ["a@1", "a@2"]);
        let statuses: Vec<(String, String)> = rows::read_rows(&csv)
            .unwrap()
            .into_iter()
            .map(|r| (format!("{}@{}", r.model, r.prompt_target_len.unwrap()), r.status))
            .collect();
        let want = [
            ("b@1", "SKIP:oom"),
            ("a@1", "FAIL:no_output"),
            ("a@2", "SKIP:oom"),
            ("a@3", "FAIL:estimate"),
            ("b@2", "SKIP:oom_backstop"),
            ("b@3", "SKIP:oom_backstop"),
            ("gone@1", "SKIP:missing_model"),
            ("gone@2", "SKIP:missing_model"),
            ("gone@3", "SKIP:missing_model"),
        ];
        let want: Vec<(String, String)> = want.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
        assert_eq!(statuses, want);
        let rows = rows::read_rows(&csv).unwrap();
        let oom = rows.iter().find(|r| r.model == "a" && r.status == "SKIP:oom").unwrap();
        assert_eq!(
            (oom.host.as_str(), oom.device.as_str(), oom.peak_bytes),
            ("elsewhere", "gpu:remote", Some(777))
        );
        // One record line, scoped to the device the cell ran on, with its demand.
        let entries = record.read().unwrap();
        assert_eq!(entries.len(), 1);
        match &entries[0] {
            record::Entry::Line { record: r, .. } => {
                assert_eq!((r.model.as_str(), r.prompt_target_len, r.demand_bytes), ("a", 2, Some(777)));
                assert_eq!(r.device.as_deref(), Some("gpu:remote"));
                assert_eq!(r.source_csv, "out.csv");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_features_column_carries_the_kiln_environment() {
        let meta = RowMeta {
            root: PathBuf::from("/r"),
            host: "h".into(),
            backend: "cuda".into(),
            commit: "c".into(),
            features: Some(vec!["cuda".into()]),
            kiln_env: [("KILN_QMV_WIDE".to_string(), "0".to_string())].into(),
            kiln_version: String::new(),
            driver_version: "580.95.05".into(),
            cuda_version: "13.0".into(),
        };
        assert_eq!(meta.features_column(&BTreeMap::new()), "cuda; KILN_QMV_WIDE=0");
        let arm = [("KILN_QMV_WIDE".to_string(), "1".to_string())].into();
        assert_eq!(meta.features_column(&arm), "cuda; KILN_QMV_WIDE=1");
        let bare = RowMeta { features: None, kiln_env: BTreeMap::new(), ..meta };
        assert_eq!(bare.features_column(&BTreeMap::new()), "unknown");
        assert_eq!(bare.display(Path::new("/r/benchmarks/x.csv")), "benchmarks/x.csv");
    }
}
