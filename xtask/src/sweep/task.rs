//! One cell away from the sweep that planned it: the spec a run directory holds
//! (`sweep.json`: the plan, the engine, the knobs, the layers' inputs, the row metadata)
//! and `cargo xtask sweep-task RUN_DIR INDEX`, which runs cell INDEX through the same
//! driver, layers, runner and classifier as a local sweep and writes its row to its own
//! file, atomically. A Slurm array task is one such call.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::classify;
use super::driver::{Driver, RowMeta};
use super::layers::{Backstop, DeviceBudget, FakeOom, OomLayers};
use super::plan::Plan;
use super::record::{RecordFile, RecordView};
use super::rows::{self, CsvOut, Knobs, Row};
use super::runner::{EngineKnobs, LocalRunner, Ran};
use crate::child::{self, Shutdown};
use crate::console::usage;
use crate::kiln_build::Backend;
use crate::machine::Machine;

/// The file in a run directory that holds the spec.
pub const SPEC_FILE: &str = "sweep.json";

/// One array of tasks: the cells of one model, in the order they run (ascending prompt
/// length), one at a time.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArrayPlan {
    /// The model.
    pub model: String,
    /// Plan indices of its cells; task k runs `cells[k]`.
    pub cells: Vec<usize>,
    /// The array (index into the list) this one starts after, for `--max-parallel`.
    pub after: Option<usize>,
}

/// Everything a cell needs to run in another process, on another node: written once by
/// the submitting sweep, read by every task and by `merge`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TaskSpec {
    /// `longprompt` or `decode`.
    pub command: String,
    /// The cells, in plan order.
    pub plan: Plan,
    /// The arrays the cells are submitted as.
    pub arrays: Vec<ArrayPlan>,
    /// The `kiln` binary every task runs (the copy in the run directory).
    pub kiln: PathBuf,
    /// The engine's working directory (the submitting checkout).
    pub workdir: PathBuf,
    /// Where relative model paths were typed.
    pub user_cwd: PathBuf,
    /// Passed to every engine call.
    pub knobs: EngineKnobs,
    /// The engine knobs as rows record them (token counts come from each cell).
    pub row_knobs: Knobs,
    /// `--cell-timeout`.
    pub cell_timeout_s: u64,
    /// The estimate layer is on (no `--no-estimate`).
    pub estimate_on: bool,
    /// The persistent OOM record, on the shared filesystem.
    pub record: PathBuf,
    /// `KILN_BENCH_IGNORE_OOM_RECORD=1` at submission.
    pub ignore_record: bool,
    /// `KILN_BENCH_FAKE_OOM` at submission.
    pub fake_oom: Vec<(String, u64)>,
    /// The CSV as rows and record lines name it.
    pub source_csv: String,
    /// The CSV `merge` writes.
    pub output: PathBuf,
    /// `cpu`, `cuda`, `metal`.
    pub backend: String,
    /// The submitting commit.
    pub commit: String,
    /// Build features, `None` for a binary the harness did not build.
    pub features: Option<Vec<String>>,
    /// The `KILN_*` environment at submission (every task gets it).
    pub kiln_env: BTreeMap<String, String>,
    /// The engine's version.
    pub kiln_version: String,
    /// `--memory-limit` or `KILN_MEMORY_LIMIT`, for the device name.
    pub memory_limit: Option<String>,
    /// `--busy-cpus`: other processes' CPU above which a cell is marked disturbed.
    pub busy_cpus: f64,
}

impl TaskSpec {
    /// Reads `RUN_DIR/sweep.json`; a directory without one is a usage error.
    pub fn read(run_dir: &Path) -> Result<TaskSpec> {
        let path = run_dir.join(SPEC_FILE);
        if !path.is_file() {
            usage!(
                "{}: no {SPEC_FILE}: expected a run directory written by `--runner slurm`",
                run_dir.display()
            );
        }
        let text = crate::fsx::read_text_bounded(&path, crate::fsx::MAX_RUN_FILE_BYTES)?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// Writes `RUN_DIR/sweep.json` atomically.
    pub fn write(&self, run_dir: &Path) -> Result<()> {
        crate::fsx::write_atomic(
            &run_dir.join(SPEC_FILE),
            (serde_json::to_string_pretty(self)? + "\n").as_bytes(),
        )
    }

    /// The row metadata every row of this sweep carries; `host` is where it was written.
    pub(super) fn row_meta(&self, host: String) -> RowMeta {
        RowMeta {
            root: self.workdir.clone(),
            host,
            backend: self.backend.clone(),
            commit: self.commit.clone(),
            features: self.features.clone(),
            kiln_env: self.kiln_env.clone(),
            kiln_version: self.kiln_version.clone(),
            driver_version: String::new(),
            cuda_version: String::new(),
        }
    }

    /// The array and position of cell `index`.
    pub fn position(&self, index: usize) -> Option<(usize, usize)> {
        self.arrays
            .iter()
            .enumerate()
            .find_map(|(a, arr)| arr.cells.iter().position(|&c| c == index).map(|k| (a, k)))
    }
}

/// `RUN_DIR/rows/NNNN.csv`: cell `index`'s row (the sweep header and one row).
pub fn row_path(run_dir: &Path, index: usize) -> PathBuf {
    run_dir.join("rows").join(format!("{:04}.csv", index + 1))
}

/// `RUN_DIR/rows/NNNN.times`: when the task started and when its row was written (Unix
/// seconds), for the overhead figures.
pub fn times_path(run_dir: &Path, index: usize) -> PathBuf {
    run_dir.join("rows").join(format!("{:04}.times", index + 1))
}

/// Cell `index`'s row, when its task wrote one.
pub fn read_row(run_dir: &Path, index: usize) -> Result<Option<Row>> {
    let path = row_path(run_dir, index);
    if !path.is_file() {
        return Ok(None);
    }
    Ok(rows::read_rows(&path)?.into_iter().next())
}

/// Writes cell `index`'s row: a temporary file beside it, synced, then renamed, so a
/// reader sees the whole row or none.
pub fn write_row(run_dir: &Path, index: usize, row: &Row) -> Result<()> {
    let path = row_path(run_dir, index);
    let tmp = path.with_extension("csv.tmp");
    let mut out = CsvOut::create(&tmp)?;
    out.write(row)?;
    drop(out);
    fs::rename(&tmp, &path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// How long a failed cell waits for the signal that may have caused it.
const SIGNAL_GRACE: Duration = Duration::from_millis(1500);

/// A signal that arrives within `grace`.
fn signal_within(shutdown: &Shutdown, grace: Duration) -> Option<i32> {
    let start = std::time::Instant::now();
    loop {
        if let Some(sig) = shutdown.pending() {
            return Some(sig);
        }
        if start.elapsed() >= grace {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `cargo xtask sweep-task RUN_DIR INDEX` (hidden): runs one cell of a planned sweep.
#[derive(clap::Args)]
pub struct SweepTask {
    /// The run directory `--runner slurm` wrote.
    run_dir: PathBuf,
    /// The cell's index in the plan (from 0).
    index: usize,
}

impl SweepTask {
    pub fn run(self) -> Result<ExitCode> {
        let started = unix_now();
        let run_dir = crate::args::user_path(&self.run_dir)?;
        let spec = TaskSpec::read(&run_dir)?;
        let total = spec.plan.cells.len();
        let Some(cell) = spec.plan.cells.get(self.index) else {
            usage!(
                "cell index {}: the plan in {} has cells 0 to {}",
                self.index,
                run_dir.display(),
                total - 1
            )
        };
        if row_path(&run_dir, self.index).is_file() {
            eprintln!(
                "{cell}: already has a row in {}; nothing to do",
                row_path(&run_dir, self.index).display()
            );
            return Ok(ExitCode::SUCCESS);
        }
        let backend: Backend = match spec.backend.parse() {
            Ok(b) => b,
            Err(e) => usage!("{}: {e}", run_dir.join(SPEC_FILE).display()),
        };
        let shutdown = Shutdown::install()?;
        let mut machine = Machine::probe();
        let logs = run_dir.join("logs");
        fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
        // The node's adapter, as its engine finds it (vulkan and metal only).
        let base = logs.join(format!("adapter-{}", std::process::id()));
        if let Ran::Interrupted(sig) =
            super::adapter::find(&mut machine, &spec.kiln, &spec.backend, &base, &shutdown)?
        {
            return Ok(ExitCode::from(child::exit_code_for(sig)));
        }
        let device = machine.device(&spec.backend, spec.memory_limit.as_deref());
        fs::create_dir_all(run_dir.join("rows"))?;
        let mut runner = LocalRunner {
            // Refused with --runner slurm: the rows a node writes keep no roofs.
            measure_roofs: false,
            kiln: spec.kiln.clone(),
            workdir: spec.workdir.clone(),
            user_cwd: spec.user_cwd.clone(),
            memory_events: classify::memory_events_path(),
            run_dir: logs,
            knobs: spec.knobs.clone(),
            backend,
            cell_timeout: Duration::from_secs(spec.cell_timeout_s),
            host: machine.host.clone(),
            device,
            // The node's GPU, under the sweep's memory limit.
            device_budget: machine
                .device_memory(&spec.backend)
                .map(|(gpu, memory)| DeviceBudget::new(gpu, memory, spec.row_knobs.memory_limit_bytes)),
            shutdown: &shutdown,
        };
        let layers = OomLayers {
            backstop: Backstop::default(),
            record: RecordView::new(RecordFile::new(spec.record.clone())),
            ignore_record: spec.ignore_record,
            fake: FakeOom::new(spec.fake_oom.clone()),
        };
        let mut meta = spec.row_meta(machine.host.clone());
        // The GPU software is the node's, as the device is.
        (meta.driver_version, meta.cuda_version) = machine.gpu_software(&spec.backend);
        let mut driver = Driver {
            roofs: Default::default(),
            meta,
            shutdown: &shutdown,
            plan: &spec.plan,
            layers,
            estimate_on: spec.estimate_on,
            source_csv: spec.source_csv.clone(),
            model_paths: BTreeMap::new(),
            knobs: spec.row_knobs.clone(),
            // `--peer` is refused with `--runner slurm`; a node never waits for quiet,
            // it marks a cell measured beside other work as disturbed.
            peer: None,
            quiet: (crate::quiet::Limits { others_cpus: spec.busy_cpus }, None),
        };
        // The backstop of a sweep spread over tasks: the rows of this model's cells that
        // ran before this one (its array runs them one at a time, shortest first).
        if let Some((a, k)) = spec.position(self.index) {
            for &earlier in &spec.arrays[a].cells[..k] {
                if let Some(row) = read_row(&run_dir, earlier)? {
                    driver.note_earlier(&row);
                }
            }
        }
        // Slurm ends a task (scancel, time limit) by signalling every process in it, the
        // engine too, which may die first: a failure row is written only when no signal
        // for this task follows within a moment, so a cancelled cell is never a
        // `FAIL:bench`.
        let mut cancelled = None;
        let probe = crate::quiet::Probe::around_children();
        let ran = driver.cell(&mut runner, self.index, total, cell, probe.as_ref(), &mut |row| {
            let failed = classify::Status::parse(&row.status).is_none_or(|s| s.is_failure());
            if failed && let Some(sig) = signal_within(&shutdown, SIGNAL_GRACE) {
                cancelled = Some(sig);
                return Ok(());
            }
            write_row(&run_dir, self.index, row)
        })?;
        let interrupted = match ran {
            Ran::Done(_) => cancelled,
            Ran::Interrupted(sig) => Some(sig),
        };
        if let Some(sig) = interrupted {
            eprintln!("{cell}: interrupted by {}: no row written", child::signal_name(sig));
            return Ok(ExitCode::from(child::exit_code_for(sig)));
        }
        let code = ExitCode::SUCCESS;
        let times = format!("{started:.3},{:.3}\n", unix_now());
        crate::fsx::write_atomic(&times_path(&run_dir, self.index), times.as_bytes())?;
        Ok(code)
    }
}
