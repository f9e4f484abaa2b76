//! What `bench-decode` and `bench-longprompt` share: their flags, the session (build,
//! machine, commit, run directory, env.json), and the driver that walks a plan through
//! the layers and the runner, writing one flushed row per cell.
//!
//! The plan (`plan`), the layers that decide whether a cell runs (`layers`, `record`)
//! and the runner that executes one cell (`runner`) stay apart: the driver only moves
//! facts between them.

pub mod classify;
pub mod layers;
pub mod plan;
pub mod record;
pub mod report;
pub mod rows;
pub mod runner;
pub mod summary;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::json;

use self::classify::Status;
use self::layers::{Backstop, EstimateFacts, FakeOom, OomLayers, Skip};
use self::plan::{CellKey, Plan};
use self::record::{RecordFile, RecordLine, RecordView};
use self::rows::{CsvOut, Row, round3};
use self::runner::{CellRunner, EngineKnobs, LocalRunner, Outcome, Ran};
use crate::child::{self as shutdown, Shutdown};
use crate::console::{self, usage};
use crate::engine::{self, Backend, BackendArg, EnginePackage};
use crate::machine::{self, Machine};

/// `--attention`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Attention {
    /// Attention over the cache in blocks, never materialising the score matrix.
    Streaming,
    /// The full score matrix (more memory).
    Naive,
}

/// Flags every bench command shares.
#[derive(clap::Args, Clone, Debug)]
pub struct SweepFlags {
    /// Tokens generated per cell: the first comes from the prefill, the warm-up steps are
    /// part of them [default: 32 on the CPU, 128 on a GPU].
    #[arg(long, value_name = "N")]
    pub max_tokens: Option<u64>,
    /// Decode steps run before the timed ones.
    #[arg(long, value_name = "W", default_value_t = 4)]
    pub warmup_tokens: u64,
    /// The CSV to write [default: benchmarks/<backend>_<host>_<date>_<command>.csv].
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Passed to the engine: the memory pool's limit (bytes, or 512MiB, 4GiB, ...).
    #[arg(long, value_name = "SIZE")]
    pub memory_limit: Option<String>,
    /// Passed to the engine: prefill in chunks of N tokens (0 = one forward).
    #[arg(long, value_name = "N")]
    pub prefill_chunk: Option<u64>,
    /// Passed to the engine: the attention implementation.
    #[arg(long, value_enum)]
    pub attention: Option<Attention>,
    /// Seconds before a cell is killed [default: 1800 on the CPU, 900 on a GPU].
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
    pub cell_timeout: Option<u64>,
    /// Turn the estimate layer off: launch cells whose estimate is above the budget.
    #[arg(long)]
    pub no_estimate: bool,
    /// Do not build kiln; use the release binary already in the target directory.
    #[arg(long)]
    pub no_build: bool,
    /// Use this kiln binary instead of building one (also KILN_BENCH_KILN_BIN).
    #[arg(long, value_name = "PATH")]
    pub kiln_bin: Option<PathBuf>,
    /// The backend to build and run.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    pub backend: BackendArg,
    /// The persistent OOM record [default: benchmarks/.oom-record].
    #[arg(long, value_name = "FILE")]
    pub oom_record: Option<PathBuf>,
    /// Where run directories (env.json, per-cell logs) go [default: benchmarks/runs].
    #[arg(long, value_name = "DIR")]
    pub runs_dir: Option<PathBuf>,
}

impl SweepFlags {
    /// The cell template these flags and the backend's defaults give, checked the way
    /// the engine counts tokens; a bad combination is a usage error (exit 2).
    pub fn cell_template(&self, defaults: &Defaults, named: plan::Named) -> Result<plan::CellTemplate> {
        let template = plan::CellTemplate {
            max_tokens: self.max_tokens.unwrap_or(defaults.max_tokens),
            warmup_tokens: self.warmup_tokens,
            named,
        };
        if let Err(e) = template.validate() {
            crate::console::usage!("{e}");
        }
        Ok(template)
    }
}

/// The defaults that depend on the backend.
#[derive(Clone, Debug)]
pub struct Defaults {
    /// Models of a default sweep.
    pub models: Vec<String>,
    /// Prompt lengths of a default sweep.
    pub lengths: Vec<u64>,
    /// `--max-tokens`.
    pub max_tokens: u64,
    /// `--cell-timeout`.
    pub cell_timeout: Duration,
}

impl Defaults {
    /// On the CPU, a sweep that finishes in about a minute on a 2-core machine (the
    /// 2048-token cells of tiny and smollm-135m are skipped by their contexts, which is
    /// expected output); on a GPU, the ladder long-prompt work is judged on.
    pub fn for_backend(backend: Backend) -> Defaults {
        if backend.is_gpu() {
            Defaults {
                models: vec![
                    "synthetic:qwen2.5-0.5b".into(),
                    "synthetic:llama-3.2-1b".into(),
                    "synthetic:llama-3.1-8b".into(),
                ],
                lengths: vec![512, 2048, 8192, 32768],
                max_tokens: 128,
                cell_timeout: Duration::from_secs(900),
            }
        } else {
            Defaults {
                models: vec![
                    "synthetic:tiny".into(),
                    "synthetic:smollm-135m".into(),
                    "synthetic:qwen2.5-0.5b".into(),
                ],
                lengths: vec![128, 512, 2048],
                max_tokens: 32,
                cell_timeout: Duration::from_secs(1800),
            }
        }
    }
}

/// The harness's own variables, read once and validated before anything runs.
#[derive(Clone, Debug, Default)]
pub struct HarnessEnv {
    /// `KILN_BENCH_FAKE_OOM`.
    pub fake_oom: Vec<(String, u64)>,
    /// `KILN_BENCH_IGNORE_OOM_RECORD=1`.
    pub ignore_record: bool,
    /// `KILN_BENCH_KILN_BIN`.
    pub kiln_bin: Option<PathBuf>,
}

impl HarnessEnv {
    /// Reads the variables; a malformed one is a usage error naming it.
    pub fn read() -> Result<HarnessEnv> {
        let var = |k: &str| std::env::var_os(k).map(|v| v.to_string_lossy().into_owned());
        let fake_oom = match var("KILN_BENCH_FAKE_OOM") {
            Some(v) => match plan::parse_fake_oom(&v) {
                Ok(f) => f,
                Err(e) => usage!("{e}"),
            },
            None => Vec::new(),
        };
        let ignore_record = match var("KILN_BENCH_IGNORE_OOM_RECORD").as_deref().map(str::trim) {
            None | Some("" | "0") => false,
            Some("1") => true,
            Some(other) => {
                usage!("KILN_BENCH_IGNORE_OOM_RECORD={other:?}: expected 1 (ignore the record) or 0")
            }
        };
        let kiln_bin = var("KILN_BENCH_KILN_BIN").filter(|v| !v.is_empty()).map(PathBuf::from);
        Ok(HarnessEnv { fake_oom, ignore_record, kiln_bin })
    }
}

/// Where the CSV goes and whether it is resumed.
#[derive(Clone, Debug)]
pub struct Output {
    /// The CSV.
    pub path: PathBuf,
    /// Rows already in it (`--resume`); `None` creates or truncates it.
    pub resumed: Option<Vec<Row>>,
}

/// Resolves a path the user typed against the directory they typed it in.
pub fn user_path(p: &Path) -> Result<PathBuf> {
    if p.is_absolute() {
        return Ok(p.to_path_buf());
    }
    Ok(std::env::current_dir().context("reading the current directory")?.join(p))
}

/// Everything prepared before the first cell: the engine binary, the machine, the commit,
/// the run directory with its env.json.
pub struct Session {
    root: PathBuf,
    machine: Machine,
    backend: Backend,
    /// Build features, `None` for a binary the harness did not build.
    features: Option<Vec<String>>,
    kiln_bin: PathBuf,
    kiln_version: String,
    commit: String,
    kiln_env: BTreeMap<String, String>,
    device: String,
    command: String,
    defaults: Defaults,
    shutdown: Shutdown,
    harness_env: HarnessEnv,
}

/// How the session ended before any cell ran.
pub enum Prepared {
    /// Ready.
    Ready(Box<Session>),
    /// A signal arrived during the build.
    Interrupted(i32),
}

impl Session {
    /// Builds (or finds) the engine, probes the machine and opens the run directory.
    pub fn prepare(
        root: &Path,
        command: &str,
        flags: &SweepFlags,
        harness_env: HarnessEnv,
    ) -> Result<Prepared> {
        let shutdown = Shutdown::install()?;
        let machine = Machine::probe();
        let prebuilt = match flags.kiln_bin.clone().or_else(|| harness_env.kiln_bin.clone()) {
            Some(p) => Some(user_path(&p)?),
            None => None,
        };
        let pkg = EnginePackage::read(root);
        let (backend, features, kiln_bin, kiln_version) = match prebuilt {
            Some(bin) => {
                if !bin.is_file() {
                    usage!(
                        "--kiln-bin (or KILN_BENCH_KILN_BIN) {}: no such file: expected a built kiln binary",
                        bin.display()
                    );
                }
                let backend = match flags.backend {
                    BackendArg::Auto | BackendArg::Cpu => Backend::Cpu,
                    BackendArg::Cuda => Backend::Cuda,
                    BackendArg::Metal => Backend::Metal,
                };
                let version = pkg.as_ref().map(|p| p.version.clone()).unwrap_or_default();
                (backend, None, bin, version)
            }
            None => {
                let pkg = pkg?;
                let choice = match engine::choose_for(&machine, flags.backend, &pkg) {
                    Ok(c) => c,
                    Err(e) => usage!("{e}"),
                };
                if let Some(note) = &choice.note {
                    eprintln!("note: {note}");
                }
                if flags.no_build {
                    eprintln!("not building kiln (--no-build)");
                } else if let Some(sig) = engine::build_release(root, choice.backend, &shutdown)? {
                    eprintln!("interrupted by {} during the build", shutdown::signal_name(sig));
                    return Ok(Prepared::Interrupted(sig));
                }
                let bin = pkg.binary("release");
                if !bin.is_file() {
                    anyhow::bail!("no kiln binary at {}: run without --no-build to build it", bin.display());
                }
                (choice.backend, Some(choice.backend.features()), bin, pkg.version.clone())
            }
        };
        let kiln_env = machine::kiln_env();
        let limit = flags.memory_limit.clone().or_else(|| kiln_env.get("KILN_MEMORY_LIMIT").cloned());
        let device = machine.device(backend.as_str(), limit.as_deref());
        Ok(Prepared::Ready(Box::new(Session {
            root: root.to_path_buf(),
            commit: machine::commit(root),
            defaults: Defaults::for_backend(backend),
            machine,
            backend,
            features,
            kiln_bin,
            kiln_version,
            kiln_env,
            device,
            command: command.to_string(),
            shutdown,
            harness_env,
        })))
    }

    /// The backend's defaults.
    pub fn defaults(&self) -> &Defaults {
        &self.defaults
    }

    /// `benchmarks/<backend>_<host>_<date>_<kind>.csv`, or the first free
    /// `..._<kind>-N.csv` when an earlier run already wrote that file.
    pub fn default_output(&self, kind: &str) -> PathBuf {
        let host: String = self
            .machine
            .host
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' })
            .collect();
        let date = chrono::Utc::now().format("%Y-%m-%d");
        let stem = format!("{}_{host}_{date}_{kind}", self.backend.as_str());
        let (path, taken) = unused_path(&self.root.join("benchmarks"), &stem);
        if let Some(first) = taken {
            eprintln!(
                "note: {} exists; writing {} (pass --resume {} to finish that run instead)",
                self.display(&first),
                self.display(&path),
                self.display(&first)
            );
        }
        path
    }

    fn display(&self, p: &Path) -> String {
        p.strip_prefix(&self.root).unwrap_or(p).display().to_string()
    }

    /// Runs `plan` and returns the exit status.
    pub fn sweep(self, plan: &Plan, output: Output, flags: &SweepFlags) -> Result<ExitCode> {
        let record_path = match &flags.oom_record {
            Some(p) => user_path(p)?,
            None => self.root.join("benchmarks/.oom-record"),
        };
        let cell_timeout = flags.cell_timeout.map(Duration::from_secs).unwrap_or(self.defaults.cell_timeout);
        let knobs = EngineKnobs {
            memory_limit: flags.memory_limit.clone(),
            prefill_chunk: flags.prefill_chunk,
            attention: flags.attention.map(|a| match a {
                Attention::Streaming => "streaming".to_string(),
                Attention::Naive => "naive".to_string(),
            }),
        };
        let runs_dir = match &flags.runs_dir {
            Some(d) => user_path(d)?,
            None => self.root.join("benchmarks/runs"),
        };
        let run_dir = crate::runs::create_run_dir(&runs_dir, &self.command)?;
        self.write_env_json(&run_dir, &output.path, &record_path, &knobs, cell_timeout, flags)?;
        eprintln!(
            "sweep: {} cells; kiln {} ({}); device {}; run directory {}",
            plan.cells.len(),
            self.display(&self.kiln_bin),
            self.backend.as_str(),
            self.device,
            self.display(&run_dir)
        );
        let mut runner = LocalRunner {
            kiln: self.kiln_bin.clone(),
            workdir: self.root.clone(),
            user_cwd: std::env::current_dir().context("reading the current directory")?,
            run_dir,
            knobs,
            cell_timeout,
            host: self.machine.host.clone(),
            device: self.device.clone(),
            shutdown: &self.shutdown,
            located: BTreeMap::new(),
        };
        let layers = OomLayers {
            backstop: Backstop::default(),
            record: RecordView::new(RecordFile::new(record_path)),
            ignore_record: self.harness_env.ignore_record,
            fake: FakeOom::new(self.harness_env.fake_oom.clone()),
        };
        if layers.ignore_record {
            eprintln!("KILN_BENCH_IGNORE_OOM_RECORD=1: the OOM record does not pre-skip cells in this run");
        }
        let mut driver = Driver {
            meta: RowMeta {
                root: self.root.clone(),
                host: self.machine.host.clone(),
                backend: self.backend.as_str().to_string(),
                commit: self.commit.clone(),
                features: self.features.clone(),
                kiln_env: self.kiln_env.clone(),
                kiln_version: self.kiln_version.clone(),
            },
            shutdown: &self.shutdown,
            plan,
            layers,
            estimate_on: !flags.no_estimate,
            source_csv: self.display(&output.path),
        };
        Ok(ExitCode::from(driver.run(&mut runner, output)?))
    }

    fn write_env_json(
        &self,
        run_dir: &Path,
        output: &Path,
        record: &Path,
        knobs: &EngineKnobs,
        cell_timeout: Duration,
        flags: &SweepFlags,
    ) -> Result<()> {
        let env = json!({
            "command": std::env::args().collect::<Vec<_>>(),
            "started": now(),
            "commit": self.commit,
            "backend": self.backend.as_str(),
            "features": self.features,
            "kiln_bin": self.kiln_bin,
            "kiln_version": self.kiln_version,
            "host": self.machine.host,
            "os": self.machine.os,
            "cpu": self.machine.cpu,
            "cpus": self.machine.cpus,
            "memory_bytes": self.machine.memory_bytes,
            "gpus": self.machine.gpus,
            "device": self.device,
            "kiln_env": self.kiln_env,
            "output": output,
            "oom_record": record,
            "estimate_layer": !flags.no_estimate,
            "memory_limit": knobs.memory_limit,
            "prefill_chunk": knobs.prefill_chunk,
            "attention": knobs.attention,
            "cell_timeout_s": cell_timeout.as_secs(),
        });
        let path = run_dir.join("env.json");
        fs::write(&path, serde_json::to_string_pretty(&env)? + "\n")
            .with_context(|| format!("writing {}", path.display()))
    }
}

/// The current time for rows and records: UTC, seconds.
fn now() -> String {
    chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// What every row of a run says about where it comes from.
struct RowMeta {
    root: PathBuf,
    host: String,
    backend: String,
    commit: String,
    /// Build features, `None` for a binary the harness did not build.
    features: Option<Vec<String>>,
    kiln_env: BTreeMap<String, String>,
    /// The engine's version; filled from the first report when the package did not say.
    kiln_version: String,
}

impl RowMeta {
    /// The `features` column: the build features (`none`, `cuda`, or `unknown` for a
    /// binary the harness did not build), then `; ` and the cell's `KILN_*` environment
    /// (inherited, plus what the cell sets) when there is any.
    fn features_column(&self, cell_env: &BTreeMap<String, String>) -> String {
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

    fn display(&self, p: &Path) -> String {
        p.strip_prefix(&self.root).unwrap_or(p).display().to_string()
    }
}

/// Walks a plan: layers, runner, rows.
struct Driver<'a> {
    meta: RowMeta,
    shutdown: &'a Shutdown,
    plan: &'a Plan,
    layers: OomLayers,
    estimate_on: bool,
    source_csv: String,
}

/// What happened to one cell.
enum CellResult {
    Skipped(Skip),
    Ran(Box<Outcome>),
}

impl Driver<'_> {
    fn run(&mut self, runner: &mut dyn CellRunner, output: Output) -> Result<u8> {
        let mut rows: BTreeMap<CellKey, Row> = BTreeMap::new();
        let mut csv = match output.resumed {
            Some(existing) => {
                let wanted: BTreeMap<CellKey, ()> = self.plan.cells.iter().map(|c| (c.key(), ())).collect();
                for row in existing.into_iter().filter(|r| wanted.contains_key(&r.key())) {
                    // A resumed sweep is the same sweep: its earlier OOMs still backstop.
                    if row.status == Status::Oom.as_str() {
                        let len = row.prompt_target_len.unwrap_or(0);
                        self.layers.backstop.note_oom(&row.model, len);
                    }
                    rows.insert(row.key(), row);
                }
                eprintln!(
                    "resuming {}: {} of {} cells already have a row",
                    self.source_csv,
                    rows.len(),
                    self.plan.cells.len()
                );
                CsvOut::append(&output.path)?
            }
            None => CsvOut::create(&output.path)?,
        };
        let total = self.plan.cells.len();
        let started = Instant::now();
        let mut interrupted = None;
        for (i, cell) in self.plan.cells.iter().enumerate() {
            if rows.contains_key(&cell.key()) {
                continue;
            }
            if let Some(sig) = self.shutdown.pending() {
                interrupted = Some(sig);
                break;
            }
            let result = match self.one_cell(runner, i, cell)? {
                Ran::Done(r) => r,
                Ran::Interrupted(sig) => {
                    interrupted = Some(sig);
                    break;
                }
            };
            let row = self.row(runner, cell, &result);
            let status = Status::parse(&row.status).unwrap_or(Status::Bench);
            csv.write(&row)?;
            self.print_cell(i, total, cell, &row, &result);
            let device = match &result {
                CellResult::Ran(o) => o.device.clone(),
                CellResult::Skipped(_) => runner.device().to_string(),
            };
            let appended = self.layers.observe(cell, status, || RecordLine {
                model: cell.model.clone(),
                prompt_target_len: cell.layer_len(),
                date: row.date.clone(),
                commit: row.commit.clone(),
                peak_bytes: row.peak_bytes,
                source_csv: self.source_csv.clone(),
                device: Some(device),
            })?;
            if appended {
                eprintln!(
                    "    recorded {}@{} in {}",
                    cell.model,
                    cell.layer_len(),
                    self.meta.display(self.layers.record.file().path())
                );
            }
            rows.insert(cell.key(), row);
        }
        if let Some(sig) = interrupted {
            eprintln!(
                "interrupted by {}: the running cell's process group was killed; finished rows are in {}",
                shutdown::signal_name(sig),
                self.source_csv
            );
        }
        let finished = summary::pair(self.plan, &rows);
        let text = summary::render(self.plan, &finished, interrupted.map(shutdown::signal_name));
        console::out(&format!("\n{text}"))?;
        if let Some(sig) = interrupted {
            return Ok(shutdown::exit_code_for(sig));
        }
        let (code, reasons) = summary::exit_status(&finished);
        for r in &reasons {
            eprintln!("exit 1: {r}");
        }
        eprintln!("results: {} ({:.0} s)", self.source_csv, started.elapsed().as_secs_f64());
        Ok(code)
    }

    /// The layers in order, then the runner.
    fn one_cell(
        &mut self,
        runner: &mut dyn CellRunner,
        i: usize,
        cell: &plan::Cell,
    ) -> Result<Ran<CellResult>> {
        if runner.locate_model(cell).is_none() {
            let reason = format!(
                "model `{}` not found: expected synthetic:<profile>, a directory under ./models/, or a path to a directory holding config.json",
                cell.model
            );
            return Ok(Ran::Done(CellResult::Skipped(Skip { status: Status::MissingModel, reason })));
        }
        let facts = match runner.estimate(i, cell)? {
            Ran::Done(f) => f,
            Ran::Interrupted(sig) => return Ok(Ran::Interrupted(sig)),
        };
        if let EstimateFacts::Failed(why) = &facts
            && !self.estimate_on
        {
            eprintln!("warning: {cell}: kiln estimate failed ({why}); running it anyway (--no-estimate)");
        }
        if let Some(skip) = layers::judge_estimate(&facts, self.estimate_on) {
            return Ok(Ran::Done(CellResult::Skipped(skip)));
        }
        if let Some(skip) = self.layers.judge(cell, runner.device())? {
            return Ok(Ran::Done(CellResult::Skipped(skip)));
        }
        Ok(match runner.run(i, cell)? {
            Ran::Done(o) => Ran::Done(CellResult::Ran(Box::new(o))),
            Ran::Interrupted(sig) => Ran::Interrupted(sig),
        })
    }

    fn row(&mut self, runner: &mut dyn CellRunner, cell: &plan::Cell, result: &CellResult) -> Row {
        let s = &self.meta;
        let model_path = runner.locate_model(cell).unwrap_or_else(|| cell.model.clone());
        let mut row = Row {
            model: cell.model.clone(),
            model_path,
            date: now(),
            host: s.host.clone(),
            device: runner.device().to_string(),
            backend: s.backend.clone(),
            kiln_version: s.kiln_version.clone(),
            commit: s.commit.clone(),
            features: s.features_column(&cell.env),
            max_tokens: cell.max_tokens,
            prompt: cell.prompt_text().to_string(),
            prompt_target_len: cell.prompt_target_len(),
            ..Row::default()
        };
        match result {
            CellResult::Skipped(skip) => row.status = skip.status.as_str().into(),
            CellResult::Ran(o) => {
                row.status = o.status.as_str().into();
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

/// `dir/<stem>.csv`, or when that exists the first free `dir/<stem>-N.csv` (N from 2)
/// together with the taken first name: a default output never overwrites what an
/// earlier run measured.
fn unused_path(dir: &Path, stem: &str) -> (PathBuf, Option<PathBuf>) {
    let first = dir.join(format!("{stem}.csv"));
    if !first.exists() {
        return (first, None);
    }
    let mut i = 2;
    loop {
        let p = dir.join(format!("{stem}-{i}.csv"));
        if !p.exists() {
            return (p, Some(first));
        }
        i += 1;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::layers::EstimateFacts;
    use super::plan::{CellTemplate, Named, Prompt};
    use super::report::EstimateReport;
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
        fn locate_model(&mut self, cell: &plan::Cell) -> Option<String> {
            (!self.missing.contains(&cell.model)).then(|| format!("/models/{}", cell.model))
        }

        fn estimate(&mut self, _: usize, cell: &plan::Cell) -> Result<Ran<EstimateFacts>> {
            if self.estimate_fails.contains(&cell.label()) {
                return Ok(Ran::Done(EstimateFacts::Failed("exit code 1: boom".into())));
            }
            Ok(Ran::Done(EstimateFacts::Report(EstimateReport {
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
            })))
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
            meta: RowMeta {
                root: dir.path().to_path_buf(),
                host: "here".into(),
                backend: "cpu".into(),
                commit: "abc1234".into(),
                features: Some(vec![]),
                kiln_env: BTreeMap::new(),
                kiln_version: "0.1.0".into(),
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
        };
        let mut runner = Scripted {
            missing: set(&["gone"]),
            estimate_fails: set(&["a@3"]),
            ooms: set(&["a@2"]),
            launched: Vec::new(),
        };
        let output = Output { path: csv.clone(), resumed: Some(rows::read_rows(&csv).unwrap()) };
        let code = driver.run(&mut runner, output).unwrap();
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
                assert_eq!((r.model.as_str(), r.prompt_target_len, r.peak_bytes), ("a", 2, Some(777)));
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
        };
        assert_eq!(meta.features_column(&BTreeMap::new()), "cuda; KILN_QMV_WIDE=0");
        let arm = [("KILN_QMV_WIDE".to_string(), "1".to_string())].into();
        assert_eq!(meta.features_column(&arm), "cuda; KILN_QMV_WIDE=1");
        let bare = RowMeta { features: None, kiln_env: BTreeMap::new(), ..meta };
        assert_eq!(bare.features_column(&BTreeMap::new()), "unknown");
        assert_eq!(bare.display(Path::new("/r/benchmarks/x.csv")), "benchmarks/x.csv");
    }

    #[test]
    fn default_outputs_never_overwrite_an_earlier_run() {
        let dir = tempfile::tempdir().unwrap();
        let (p, taken) = unused_path(dir.path(), "cpu_h_2026-11-30_longprompt");
        assert_eq!(p, dir.path().join("cpu_h_2026-11-30_longprompt.csv"));
        assert!(taken.is_none());
        fs::write(&p, "x").unwrap();
        let (p2, taken) = unused_path(dir.path(), "cpu_h_2026-11-30_longprompt");
        assert_eq!(p2, dir.path().join("cpu_h_2026-11-30_longprompt-2.csv"));
        assert_eq!(taken, Some(p));
        fs::write(&p2, "y").unwrap();
        let (p3, _) = unused_path(dir.path(), "cpu_h_2026-11-30_longprompt");
        assert_eq!(p3, dir.path().join("cpu_h_2026-11-30_longprompt-3.csv"));
    }
}
