//! Joining a Slurm run: what Slurm says about each task (`sacct`, or `squeue` where the
//! cluster keeps no accounting), and `cargo xtask merge RUN_DIR`, which writes the
//! sweep's CSV from the tasks' row files in plan order, a `FAIL:slurm*` row for every task
//! that ended without one, and the summary.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::super::classify::Status;
use super::super::plan::Cell;
use super::super::rows::{CsvOut, Row};
use super::super::summary;
use super::super::task::{self, TaskSpec};
use crate::child;
use crate::console::{self, usage};

/// `RUN_DIR/jobs.json`: what was submitted.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Jobs {
    /// When `sbatch` was first called (Unix seconds).
    pub submitted_unix: f64,
    /// The job id of each array, in the order of the spec's arrays.
    pub job_ids: Vec<String>,
}

impl Jobs {
    /// The file in a run directory.
    pub const FILE: &'static str = "jobs.json";

    /// Reads it; a run directory without one was never submitted.
    pub fn read(run_dir: &Path) -> Result<Jobs> {
        let path = run_dir.join(Self::FILE);
        if !path.is_file() {
            usage!("{}: no {}: the sweep was never submitted (a dry run?)", run_dir.display(), Self::FILE);
        }
        let text = crate::fsx::read_text_bounded(&path, crate::fsx::MAX_RUN_FILE_BYTES)?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// The Slurm id of the task that runs cell `index` (`<job>_<task>`).
    pub fn task_id(&self, spec: &TaskSpec, index: usize) -> Option<String> {
        let (a, k) = spec.position(index)?;
        Some(format!("{}_{k}", self.job_ids.get(a)?))
    }
}

/// What Slurm says about one task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskState {
    /// `PENDING`, `RUNNING`, `COMPLETED`, `CANCELLED`, `TIMEOUT`, ...
    pub state: String,
    /// Slurm's reason, or `None`.
    pub reason: String,
}

impl TaskState {
    /// Whether the task may still write its row.
    pub fn is_active(&self) -> bool {
        matches!(
            self.state.as_str(),
            "PENDING"
                | "RUNNING"
                | "CONFIGURING"
                | "COMPLETING"
                | "SUSPENDED"
                | "REQUEUED"
                | "REQUEUE_FED"
                | "REQUEUE_HOLD"
                | "RESIZING"
                | "SIGNALING"
                | "STAGE_OUT"
                | "RESV_DEL_HOLD"
        )
    }
}

/// The row status of a task that ended without a row, from its Slurm state.
pub fn lost_status(state: &str) -> Status {
    match state {
        "CANCELLED" => Status::SlurmCancelled,
        "TIMEOUT" | "DEADLINE" => Status::SlurmTimeout,
        "NODE_FAIL" | "BOOT_FAIL" => Status::SlurmNodeFail,
        "OUT_OF_MEMORY" => Status::SlurmOom,
        _ => Status::SlurmLost,
    }
}

/// Parses `JobID|State|Reason` lines (`sacct -P`, or `squeue -o '%i|%T|%r'`). A state
/// such as `CANCELLED by 0` is its first word; a pending range (`41_[2-4%1]`) is one entry
/// per task.
pub fn parse_states(text: &str) -> BTreeMap<String, TaskState> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let mut f = line.trim().split('|');
        let (Some(id), Some(state)) = (f.next(), f.next()) else { continue };
        let reason = f.next().unwrap_or("").trim().to_string();
        let state = state.split_whitespace().next().unwrap_or("").trim_end_matches('+').to_string();
        if id.is_empty() || state.is_empty() {
            continue;
        }
        let st = TaskState { state, reason };
        for id in expand(id.trim()) {
            out.insert(id, st.clone());
        }
    }
    out
}

/// `41_[2-4,7%1]` as `41_2 41_3 41_4 41_7`; any other id as itself.
fn expand(id: &str) -> Vec<String> {
    let Some((job, rest)) = id.split_once("_[") else { return vec![id.to_string()] };
    let body = rest.trim_end_matches(']');
    let body = body.split('%').next().unwrap_or("");
    let mut out = Vec::new();
    for part in body.split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        if let (Ok(a), Ok(b)) = (a.parse::<u64>(), b.parse::<u64>()) {
            out.extend((a..=b.min(a + 100_000)).map(|k| format!("{job}_{k}")));
        }
    }
    out
}

/// What Slurm knows about the tasks of `job_ids`: `sacct` where the cluster keeps
/// accounting, else `squeue -t all` (finished jobs stay there for `MinJobAge`). An
/// unreachable controller is an error naming the command and what it said.
pub fn query(job_ids: &[String]) -> Result<BTreeMap<String, TaskState>> {
    if job_ids.is_empty() {
        return Ok(BTreeMap::new());
    }
    let ids = job_ids.join(",");
    // Without a `Reason` field where this sacct does not know it.
    let sacct = |fields: &str| {
        Command::new("sacct")
            .args(["-n", "-P", "-X", "-j", &ids, "-o", fields])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| parse_states(&String::from_utf8_lossy(&o.stdout)))
    };
    let mut states = sacct("JobID,State,Reason").or_else(|| sacct("JobID,State")).unwrap_or_default();
    let squeue = Command::new("squeue")
        .args(["-h", "-r", "-t", "all", "-j", &ids, "-o", "%i|%T|%r"])
        .output()
        .context("running squeue (is the Slurm client installed and SLURM_CONF set?)")?;
    let text = String::from_utf8_lossy(&squeue.stdout);
    let err = String::from_utf8_lossy(&squeue.stderr);
    if squeue.status.success() {
        // squeue is the live view: it wins for tasks still queued or running.
        for (id, st) in parse_states(&text) {
            if st.is_active() || !states.contains_key(&id) {
                states.insert(id, st);
            }
        }
    } else if !err.contains("Invalid job id") && states.is_empty() {
        anyhow::bail!("squeue -j {ids} failed ({}): {}", squeue.status, err.trim());
    }
    Ok(states)
}

/// `RUN_DIR/slurm/inferred.json`: states `--wait` worked out for tasks Slurm keeps no
/// record of (a pending task cancelled), for a later `merge`.
fn inferred_path(run_dir: &Path) -> PathBuf {
    run_dir.join("slurm").join("inferred.json")
}

/// Saves what `--wait` inferred.
pub fn write_inferred(run_dir: &Path, inferred: &BTreeMap<String, TaskState>) -> Result<()> {
    if inferred.is_empty() {
        return Ok(());
    }
    crate::fsx::write_atomic(
        &inferred_path(run_dir),
        (serde_json::to_string_pretty(inferred)? + "\n").as_bytes(),
    )
}

fn read_inferred(run_dir: &Path) -> BTreeMap<String, TaskState> {
    crate::fsx::read_text_bounded(&inferred_path(run_dir), crate::fsx::MAX_RUN_FILE_BYTES)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default()
}

/// Slurm's own line about a task that ended badly (`*** JOB 41 ON node CANCELLED AT ...
/// ***`) in the task's output file, as a state and the line.
pub fn state_from_log(path: &Path) -> Option<TaskState> {
    let text = crate::fsx::read_text_bounded(path, crate::fsx::MAX_RUN_FILE_BYTES).ok()?;
    let line = text.lines().rev().find(|l| l.contains("*** JOB") || l.contains("*** STEP"))?;
    // `CANCELLED AT ... DUE TO TIME LIMIT` is Slurm's time limit, not a user's scancel.
    let state = if line.contains("TIME LIMIT") {
        "TIMEOUT"
    } else if line.contains("NODE FAIL") {
        "NODE_FAIL"
    } else if line.contains("CANCELLED") {
        "CANCELLED"
    } else {
        "FAILED"
    };
    Some(TaskState { state: state.into(), reason: line.trim().to_string() })
}

/// The output file Slurm writes for cell `index`'s task (the batch script's `--output`).
pub fn task_log(run_dir: &Path, spec: &TaskSpec, jobs: &Jobs, index: usize) -> Option<PathBuf> {
    let (a, k) = spec.position(index)?;
    Some(run_dir.join("slurm").join(format!("{}-{}_{k}.out", a + 1, jobs.job_ids.get(a)?)))
}

/// The row of a cell whose task ended without writing one: every column that describes
/// the cell as a row of this sweep would, no measurement, and the status for `state`.
pub fn lost_row(spec: &TaskSpec, cell: &Cell, state: &TaskState, task_id: &str) -> Row {
    let mut row = spec.row_meta(String::new()).cell_row(cell, &spec.row_knobs);
    row.status = lost_status(&state.state).as_str().to_string();
    row.reason = format!("Slurm task {task_id} ended {} without a row ({})", state.state, state.reason);
    row.engine_version = spec.kiln_version.clone();
    row
}

/// A cell's merged row and, for a task that wrote none, what Slurm said.
pub struct MergedCell {
    /// The row.
    pub row: Row,
    /// `Some(task id, state)` when the row stands for a task that died without one.
    pub lost: Option<(String, TaskState)>,
}

/// Every cell's row in plan order: the task's own, or a `FAIL:slurm*` row from its state
/// (`states`, then Slurm's line in the task's log, else `UNKNOWN`).
pub fn merge_rows(
    run_dir: &Path,
    spec: &TaskSpec,
    jobs: &Jobs,
    states: &BTreeMap<String, TaskState>,
) -> Result<Vec<MergedCell>> {
    let mut out = Vec::with_capacity(spec.plan.cells.len());
    for (i, cell) in spec.plan.cells.iter().enumerate() {
        if let Some(row) = task::read_row(run_dir, i)? {
            check_shard(run_dir, spec, i, cell, &row)?;
            out.push(MergedCell { row, lost: None });
            continue;
        }
        let id = jobs.task_id(spec, i).unwrap_or_else(|| "?".into());
        let st = states
            .get(&id)
            .filter(|s| !s.is_active())
            .cloned()
            .or_else(|| task_log(run_dir, spec, jobs, i).and_then(|p| state_from_log(&p)))
            .unwrap_or_else(|| TaskState {
                state: "UNKNOWN".into(),
                reason: "the task wrote no row and Slurm no longer knows it".into(),
            });
        out.push(MergedCell { row: lost_row(spec, cell, &st, &id), lost: Some((id, st)) });
    }
    Ok(out)
}

/// Refuses a shard whose row is not its cell's: another cell's coordinates (model,
/// prompt, repetition, engine) or knobs (token counts, attention, prefill chunk, KV
/// type, memory limit, threads) would merge as a duplicate row and a missing cell.
fn check_shard(run_dir: &Path, spec: &TaskSpec, index: usize, cell: &Cell, row: &Row) -> Result<()> {
    let want = spec.row_meta(String::new()).cell_row(cell, &spec.row_knobs);
    let path = task::row_path(run_dir, index);
    if row.key() != want.key() {
        usage!(
            "{}: the row is for {} (model {:?}, prompt_target_len {:?}, repetition {}), but shard {} is cell {}: \
             the run directory's rows do not belong to its plan",
            path.display(),
            row.model,
            row.model,
            row.prompt_target_len,
            row.repetition,
            index + 1,
            cell.label()
        );
    }
    let diff = row.knobs().differences(&want.knobs());
    if !diff.is_empty() {
        usage!(
            "{}: cell {}'s row was measured with other settings than the sweep's ({}): \
             the run directory's rows do not belong to its plan",
            path.display(),
            cell.label(),
            diff.join("; ").replace("in this run", "in the sweep")
        );
    }
    Ok(())
}

/// Writes `rows` as the sweep's CSV at `path`: the header, one row per cell, through a
/// temporary file and a rename, so a reader sees the old file or the whole new one.
pub fn write_csv(path: &Path, rows: &[Row]) -> Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.merge.tmp"));
    let mut out = CsvOut::create(&tmp)?;
    for r in rows {
        out.write(r)?;
    }
    drop(out);
    fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

/// How [`merge_run`] runs.
#[derive(Debug, Default)]
pub struct MergeOptions {
    /// Write the CSV here instead of the sweep's `--output`.
    pub output: Option<PathBuf>,
    /// The signal that ended a `--wait`.
    pub interrupted: Option<i32>,
    /// Draw the plot beside the CSV (a `bench-longprompt` that waited draws its own).
    pub plot: bool,
    /// Cells whose task ended without a row and that `--wait` has already reported.
    pub reported: BTreeSet<usize>,
}

/// The line for each merged cell whose task wrote no row, in plan order, less the
/// cells in `reported` (their line was printed when `--wait` saw them end).
pub fn lost_lines(
    merged: &[MergedCell],
    cells: &[Cell],
    logs: &dyn Fn(usize) -> String,
    reported: &BTreeSet<usize>,
) -> Vec<String> {
    let total = merged.len();
    merged
        .iter()
        .enumerate()
        .filter(|(i, _)| !reported.contains(i))
        .filter_map(|(i, m)| {
            let (id, st) = m.lost.as_ref()?;
            Some(format!(
                "[{}/{total}] {}: {}: Slurm task {id} ended {} without a row ({}; log: {})",
                i + 1,
                cells[i],
                m.row.status,
                st.state,
                st.reason,
                logs(i)
            ))
        })
        .collect()
}

/// Merges `run_dir` into its CSV (or `opts.output`), prints the summary and returns the
/// exit status by the local rules. A task still queued or running is refused unless the
/// sweep was interrupted.
pub fn merge_run(run_dir: &Path, opts: MergeOptions) -> Result<u8> {
    let MergeOptions { output, interrupted, plot, reported } = opts;
    let spec = TaskSpec::read(run_dir)?;
    let jobs = Jobs::read(run_dir)?;
    let mut states = query(&jobs.job_ids)?;
    for (id, st) in read_inferred(run_dir) {
        states.entry(id).or_insert(st);
    }
    let active: Vec<&String> = states.iter().filter(|(_, s)| s.is_active()).map(|(id, _)| id).collect();
    if !active.is_empty() && interrupted.is_none() {
        usage!(
            "{}: {} task(s) still queued or running ({}): merge when they end, or cancel them with scancel {}",
            run_dir.display(),
            active.len(),
            active.iter().take(5).map(|s| s.as_str()).collect::<Vec<_>>().join(", "),
            jobs.job_ids.join(" ")
        );
    }
    let merged = merge_rows(run_dir, &spec, &jobs, &states)?;
    let total = merged.len();
    let log =
        |i: usize| task_log(run_dir, &spec, &jobs, i).map(|p| p.display().to_string()).unwrap_or_default();
    for line in lost_lines(&merged, &spec.plan.cells, &log, &reported) {
        eprintln!("{line}");
    }
    let path = output.unwrap_or_else(|| spec.output.clone());
    let rows: Vec<Row> = merged.into_iter().map(|m| m.row).collect();
    write_csv(&path, &rows)?;
    if plot && spec.command == "longprompt" {
        let svg = path.with_extension("svg");
        match crate::plot::write_svg(&svg, &crate::sweep::panels::panels(&rows)) {
            Ok(_) => eprintln!("plot: {}", svg.display()),
            Err(e) => eprintln!("warning: no plot beside {}: {e:#}", path.display()),
        }
    }
    let by_key: BTreeMap<_, _> = rows.iter().map(|r| (r.key(), r.clone())).collect();
    let finished = summary::pair(&spec.plan, &by_key);
    let sheet = summary::sheet(&finished, interrupted.map(child::signal_name));
    // The run directory's readings and page, from the merged rows.
    summary::write_or_warn(run_dir, &sheet);
    crate::report::write_or_warn(run_dir);
    console::out(&format!("\n{}", sheet.markdown()))?;
    eprintln!("merged {total} rows into {}", path.display());
    if let Some(sig) = interrupted {
        return Ok(child::exit_code_for(sig));
    }
    let (code, reasons) = summary::exit_status(&finished);
    for r in &reasons {
        eprintln!("exit 1: {r}");
    }
    Ok(code)
}

/// `cargo xtask merge RUN_DIR`: joins the rows of a `--runner slurm` sweep.
#[derive(clap::Args)]
pub struct Merge {
    /// The run directory the sweep wrote under `--shared-dir`.
    run_dir: PathBuf,
    /// Write the CSV here instead of the sweep's `--output`.
    #[arg(long, value_name = "FILE")]
    output: Option<PathBuf>,
}

impl Merge {
    pub fn run(self) -> Result<ExitCode> {
        let run_dir = crate::args::user_path(&self.run_dir)?;
        let output = self.output.as_deref().map(crate::args::user_path).transpose()?;
        Ok(ExitCode::from(merge_run(
            &run_dir,
            MergeOptions { output, plot: true, ..MergeOptions::default() },
        )?))
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::plan::{CellTemplate, Named, Plan, Prompt};
    use super::super::super::rows::{HEADER, Knobs, read_rows};
    use super::super::super::runner::EngineKnobs;
    use super::super::script;
    use super::*;

    fn spec(dir: &Path) -> TaskSpec {
        let plan = Plan::grid(
            &["a".to_string(), "b".to_string()],
            &[Prompt::Tokens(64), Prompt::Tokens(16)],
            &CellTemplate { max_tokens: 6, warmup_tokens: 1, named: Named { models: true, prompts: true } },
        );
        TaskSpec {
            command: "longprompt".into(),
            arrays: script::arrays(&plan, None),
            plan,
            kiln: dir.join("bin/kiln"),
            workdir: dir.to_path_buf(),
            user_cwd: dir.to_path_buf(),
            knobs: EngineKnobs::default(),
            row_knobs: Knobs { threads: Some(2), ..Knobs::default() },
            cell_timeout_s: 60,
            estimate_on: true,
            record: dir.join(".oom-record"),
            ignore_record: false,
            fake_oom: vec![],
            source_csv: "out.csv".into(),
            output: dir.join("out.csv"),
            backend: "cpu".into(),
            commit: "abc1234".into(),
            features: Some(vec![]),
            kiln_env: [("KILN_BENCH_FAKE_OOM".to_string(), "a:16".to_string())].into(),
            kiln_version: "0.1.0".into(),
            memory_limit: None,
            busy_cpus: 0.5,
        }
    }

    fn row(model: &str, len: u64, status: &str) -> Row {
        let ok = status == "ok";
        Row {
            prompt_tokens: ok.then_some(len),
            generated_tokens: ok.then_some(6),
            prefill_ms: ok.then_some(1.0),
            prefill_tok_s: ok.then_some(2.0),
            decode_ms: ok.then_some(3.0),
            decode_tok_s: ok.then_some(4.0),
            peak_bytes: ok.then_some(5),
            model: model.into(),
            model_path: model.into(),
            date: "2026-01-01T00:00:00Z".into(),
            max_tokens: 6,
            warmup_tokens: 1,
            threads: Some(2),
            prompt_target_len: Some(len),
            status: status.into(),
            repetition: 1,
            ..Row::default()
        }
    }

    #[test]
    fn a_shard_holding_another_cells_row_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        fs::create_dir_all(run.join("rows")).unwrap();
        let spec = spec(run);
        let jobs = Jobs { submitted_unix: 0.0, job_ids: vec!["41".into(), "42".into()] };
        let states = BTreeMap::new();
        // Cell 0 is a@64; a shard holding a@16's row (a copy of cell 1's) would merge
        // as a duplicate a@16 and no a@64.
        task::write_row(run, 1, &row("a", 16, "ok")).unwrap();
        task::write_row(run, 0, &row("a", 16, "ok")).unwrap();
        let e = format!("{:#}", merge_rows(run, &spec, &jobs, &states).err().expect("refused"));
        assert!(e.contains("rows/0001.csv") && e.contains("shard 1 is cell a@64"), "{e}");
        // Another model at the right length, and the right cell with other knobs.
        task::write_row(run, 0, &row("b", 64, "ok")).unwrap();
        assert!(merge_rows(run, &spec, &jobs, &states).is_err());
        let mut other = row("a", 64, "ok");
        other.threads = Some(8);
        task::write_row(run, 0, &other).unwrap();
        let e = format!("{:#}", merge_rows(run, &spec, &jobs, &states).err().expect("refused"));
        assert!(e.contains("--threads 8 in the file, 2 in the sweep"), "{e}");
        task::write_row(run, 0, &row("a", 64, "ok")).unwrap();
        assert_eq!(merge_rows(run, &spec, &jobs, &states).unwrap().len(), 4);
    }

    #[test]
    fn a_task_without_a_row_becomes_a_fail_row_and_the_order_is_the_plans() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        fs::create_dir_all(run.join("rows")).unwrap();
        let spec = spec(run);
        // Plan order: a@64 a@16 b@64 b@16; each array runs 16 first, so task 0 is @16.
        assert_eq!(spec.arrays[0].cells, [1, 0]);
        let jobs = Jobs { submitted_unix: 0.0, job_ids: vec!["41".into(), "42".into()] };
        assert_eq!(jobs.task_id(&spec, 0).as_deref(), Some("41_1"));
        assert_eq!(jobs.task_id(&spec, 3).as_deref(), Some("42_0"));
        // Rows written out of order, as tasks finish; b@64 (42_1) never wrote one.
        task::write_row(run, 3, &row("b", 16, "ok")).unwrap();
        task::write_row(run, 1, &row("a", 16, "SKIP:oom")).unwrap();
        task::write_row(run, 0, &row("a", 64, "SKIP:oom_backstop")).unwrap();
        let states = parse_states(
            "41_0|COMPLETED|None\n41_1|COMPLETED|None\n42_0|COMPLETED|None\n42_1|CANCELLED by 0|None\n",
        );
        let merged = merge_rows(run, &spec, &jobs, &states).unwrap();
        let got: Vec<(String, u64, String)> = merged
            .iter()
            .map(|m| (m.row.model.clone(), m.row.prompt_target_len.unwrap(), m.row.status.clone()))
            .collect();
        let want = [
            ("a", 64, "SKIP:oom_backstop"),
            ("a", 16, "SKIP:oom"),
            ("b", 64, "FAIL:slurm_cancelled"),
            ("b", 16, "ok"),
        ];
        let want: Vec<(String, u64, String)> =
            want.iter().map(|(m, l, s)| (m.to_string(), *l, s.to_string())).collect();
        assert_eq!(got, want);
        let lost = merged[2].lost.as_ref().unwrap();
        assert_eq!((lost.0.as_str(), lost.1.state.as_str()), ("42_1", "CANCELLED"));
        // The merge prints the lost cell's line, unless --wait already printed it.
        let log = |i: usize| format!("log{i}");
        let lines = lost_lines(&merged, &spec.plan.cells, &log, &BTreeSet::new());
        assert_eq!(
            lines,
            [
                "[3/4] b@64: FAIL:slurm_cancelled: Slurm task 42_1 ended CANCELLED without a row (None; log: log2)"
            ]
        );
        assert!(lost_lines(&merged, &spec.plan.cells, &log, &[2].into()).is_empty());
        // The FAIL row carries the cell's knobs and the sweep's provenance.
        let r = &merged[2].row;
        assert_eq!((r.max_tokens, r.warmup_tokens, r.threads), (6, 1, Some(2)));
        assert_eq!((r.commit.as_str(), r.features.as_str()), ("abc1234", "none; KILN_BENCH_FAKE_OOM=a:16"));
        // Written with the sweep's exact header, read back whole.
        let out = run.join("out.csv");
        let rows: Vec<Row> = merged.into_iter().map(|m| m.row).collect();
        write_csv(&out, &rows).unwrap();
        let text = fs::read_to_string(&out).unwrap();
        assert_eq!(text.lines().next().unwrap(), HEADER.join(","));
        assert_eq!(read_rows(&out).unwrap(), rows);
    }

    #[test]
    fn a_run_whose_rows_predate_the_driver_columns_still_merges() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        fs::create_dir_all(run.join("rows")).unwrap();
        let spec = spec(run);
        let jobs = Jobs { submitted_unix: 0.0, job_ids: vec!["41".into(), "42".into()] };
        let shards = [row("a", 64, "ok"), row("a", 16, "ok"), row("b", 64, "ok"), row("b", 16, "ok")];
        for (i, r) in shards.iter().enumerate() {
            let text = super::super::super::rows::before_driver_csv(std::slice::from_ref(r));
            fs::write(task::row_path(run, i), text).unwrap();
        }
        let merged = merge_rows(run, &spec, &jobs, &BTreeMap::new()).unwrap();
        let rows: Vec<Row> = merged.into_iter().map(|m| m.row).collect();
        assert_eq!(rows, shards);
        let out = run.join("out.csv");
        write_csv(&out, &rows).unwrap();
        assert_eq!(fs::read_to_string(&out).unwrap().lines().next().unwrap(), HEADER.join(","));
    }

    #[test]
    fn unknown_tasks_fall_back_to_slurms_line_in_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        let spec = spec(run);
        let jobs = Jobs { submitted_unix: 0.0, job_ids: vec!["41".into(), "42".into()] };
        fs::create_dir_all(run.join("slurm")).unwrap();
        fs::write(
            run.join("slurm/1-41_0.out"),
            "[1/4] a@16: ...\nslurmstepd: error: *** JOB 43 ON vm CANCELLED AT 2026-11-30T20:00:00 DUE TO TIME LIMIT ***\n",
        )
        .unwrap();
        let merged = merge_rows(run, &spec, &jobs, &BTreeMap::new()).unwrap();
        assert_eq!(merged[1].row.status, "FAIL:slurm_timeout");
        assert!(merged[1].lost.as_ref().unwrap().1.reason.contains("*** JOB 43"));
        assert_eq!(merged[0].row.status, "FAIL:slurm");
        assert_eq!(merged[0].lost.as_ref().unwrap().1.state, "UNKNOWN");
    }

    #[test]
    fn states_parse_from_sacct_and_squeue() {
        let s = parse_states("41_0|COMPLETED|None\n41_[2-3%1]|PENDING|JobArrayTaskLimit\n42|TIMEOUT|\n\n");
        assert_eq!(s["41_0"].state, "COMPLETED");
        assert_eq!(s["41_2"], TaskState { state: "PENDING".into(), reason: "JobArrayTaskLimit".into() });
        assert!(s["41_3"].is_active() && !s["41_0"].is_active());
        assert_eq!(s["42"].state, "TIMEOUT");
        assert_eq!(s.len(), 4);
        assert_eq!(lost_status("CANCELLED"), Status::SlurmCancelled);
        assert_eq!(lost_status("TIMEOUT"), Status::SlurmTimeout);
        assert_eq!(lost_status("NODE_FAIL"), Status::SlurmNodeFail);
        assert_eq!(lost_status("OUT_OF_MEMORY"), Status::SlurmOom);
        assert_eq!(lost_status("COMPLETED"), Status::SlurmLost);
        assert!(lost_status("FAILED").is_failure());
    }
}
