//! `cargo xtask bench-offload-copy`: MoE models x expert-cache slot counts x batch sizes
//! x miss rates, one `kiln bench-expert-copy` child per cell, a table per geometry.
//!
//! The rules of a geometry live in the engine (one function, reached through the child's
//! exit 2 and its `invalid --expert-slots:` line), never here: the first cell of a
//! geometry builds its cache before the table's header is printed, so a refused geometry
//! prints one `SKIPPED` line and no orphan header. Nothing is clamped. A derived default
//! that a backend refuses is expected output (exit 0); a geometry named by hand
//! (`--cache-slots`) that measured nothing, or a run that measured nothing, exits 1. An
//! out-of-memory is not a geometry statement: it is a `SKIP:oom` row fed to the sweep's
//! backstop and `.oom-record` (the same layers as bench-longprompt), keyed
//! `<model>+expert-slots` at the slot count so the two sweeps never pre-skip each other.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Result;
use serde::{Deserialize, Serialize};
use xshell::Shell;

use crate::child as shutdown;
use crate::console::{self, usage};
use crate::engine::BackendArg;
use crate::plot;
use crate::sweep::classify::Status;
use crate::sweep::driver::{RowMeta, now};
use crate::sweep::flags::count;
use crate::sweep::layers::{EstimateFacts, OomLayers};
use crate::sweep::plan::{self, Cell, Engine, Named, Prompt};
use crate::sweep::record::RecordLine;
use crate::sweep::rows::{CsvOut, round3};
use crate::sweep::runner::{CellRunner, LocalRunner, Ran};
use crate::sweep::series::SeriesFlags;
use crate::sweep::{HarnessEnv, Session, SweepFlags, user_path};
use kiln_protocol::{EstimateReport, GEOMETRY_REFUSED, OffloadCopyReport};

/// The suffix that keys this sweep's OOMs in the shared record.
const RECORD_SUFFIX: &str = "+expert-slots";

/// Flags of `cargo xtask bench-offload-copy`.
#[derive(clap::Args)]
pub struct BenchOffloadCopy {
    /// MoE models, comma- or space-separated [default on the CPU: synthetic:tiny-moe,
    /// synthetic:tiny-qwen2-moe; on a GPU: synthetic:qwen3-30b-a3b, synthetic:mixtral-8x7b,
    /// synthetic:qwen1.5-moe-a2.7b].
    #[arg(long, value_name = "LIST", value_parser = plan::models_arg)]
    models: Option<plan::Models>,
    /// Expert-cache slot counts, for every model [default per model: its experts per
    /// layer, and 0.4 x layers x experts].
    #[arg(long, value_name = "LIST", value_parser = counts_arg)]
    cache_slots: Option<Counts>,
    /// Rows decoded together.
    #[arg(long, value_name = "LIST", value_parser = counts_arg, default_value = "1,4,16,64")]
    batch_sizes: Counts,
    /// Shares of expert choices that miss the cache, each 0 to 1.
    #[arg(long, value_name = "LIST", value_parser = rates_arg, default_value = "0,0.1,0.5,1")]
    miss_rates: Rates,
    /// Passed to the engine: most decode steps per cell.
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = count(1))]
    steps: u64,
    /// Passed to the engine: simulate steps (up to --steps) for at least this long.
    #[arg(long, value_name = "MS", default_value_t = 300, value_parser = count(0))]
    min_time_ms: u64,
    /// Passed to the engine: the read-bandwidth buffer of each cell (1MiB or more).
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = bandwidth_arg)]
    bandwidth_bytes: String,
    /// The CSV to write [default: benchmarks/<backend>_<host>_<date>_offload-copy.csv];
    /// the markdown tables and the SVG go beside it.
    #[arg(long, value_name = "FILE")]
    output: Option<PathBuf>,
    /// Passed to the engine: the memory pool's limit, which also sets the CPU backend's
    /// slot cap (bytes, or 512MiB, 4GiB, ...).
    #[arg(long, value_name = "SIZE")]
    memory_limit: Option<String>,
    /// Passed to the engine: worker threads [default: the engine's].
    #[arg(long, value_name = "N", value_parser = count(1))]
    threads: Option<u64>,
    /// Seconds before a cell is killed [default: 1800 on the CPU, 900 on a GPU].
    #[arg(long, value_name = "SECS", value_parser = count(1))]
    cell_timeout: Option<u64>,
    /// Do not build kiln; use the release binary already in the target directory.
    #[arg(long)]
    no_build: bool,
    /// Use this kiln binary instead of building one (also KILN_BENCH_KILN_BIN).
    #[arg(long, value_name = "PATH")]
    kiln_bin: Option<PathBuf>,
    /// The backend to build and run.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// The persistent OOM record [default: benchmarks/.oom-record].
    #[arg(long, value_name = "FILE")]
    oom_record: Option<PathBuf>,
    /// Where run directories (env.json, per-cell logs) go [default: benchmarks/runs].
    #[arg(long, value_name = "DIR")]
    runs_dir: Option<PathBuf>,
}

/// Positive integers from a list.
#[derive(Clone, Debug)]
struct Counts(Vec<u64>);

/// Rates in [0, 1] from a list.
#[derive(Clone, Debug)]
struct Rates(Vec<f64>);

fn tokens(s: &str) -> Vec<&str> {
    s.split([' ', ',', '\t', '\n']).filter(|t| !t.is_empty()).collect()
}

fn counts_arg(s: &str) -> Result<Counts, String> {
    let t = tokens(s);
    if t.is_empty() {
        return Err("the list is empty: expected positive integers such as \"1,4,16,64\"".into());
    }
    let mut out = Vec::new();
    for x in t {
        match x.parse::<u64>() {
            Ok(n) if n > 0 && x.bytes().all(|b| b.is_ascii_digit()) => {
                if out.contains(&n) {
                    return Err(format!("`{x}` appears twice: each value runs once"));
                }
                out.push(n);
            }
            _ => {
                return Err(format!(
                    "`{x}` is not a positive integer: expected values such as \"1,4,16,64\""
                ));
            }
        }
    }
    Ok(Counts(out))
}

/// `--bandwidth-bytes`, checked at parse time by the engine's own rule and passed on as
/// written.
fn bandwidth_arg(s: &str) -> Result<String, String> {
    kiln_protocol::parse_bandwidth_bytes(s).map(|_| s.to_string())
}

fn rates_arg(s: &str) -> Result<Rates, String> {
    let t = tokens(s);
    if t.is_empty() {
        return Err("the list is empty: expected rates from 0 to 1 such as \"0,0.1,0.5,1\"".into());
    }
    let mut out: Vec<f64> = Vec::new();
    for x in t {
        match x.parse::<f64>() {
            Ok(r) if (0.0..=1.0).contains(&r) => {
                if out.contains(&r) {
                    return Err(format!("`{x}` appears twice: each rate runs once"));
                }
                out.push(r);
            }
            _ => {
                return Err(format!(
                    "`{x}` is not a rate from 0 to 1: expected values such as \"0,0.1,0.5,1\""
                ));
            }
        }
    }
    Ok(Rates(out))
}

/// The CSV header, exactly: the geometry, the measurements, then the fingerprint every
/// sweep's rows carry, then the status.
pub const HEADER: [&str; 27] = [
    "model",
    "model_path",
    "cache_slots",
    "slot_bytes",
    "cache_bytes",
    "batch_size",
    "miss_rate",
    "measured_miss_rate",
    "tokens",
    "fetches",
    "misses",
    "bytes_copied",
    "copy_gb_s",
    "fetch_us_per_token",
    "read_bandwidth_gb_s",
    "copy_share",
    "peak_bytes",
    "date",
    "host",
    "device",
    "backend",
    "kiln_version",
    "commit",
    "features",
    "memory_limit_bytes",
    "threads",
    "status",
];

/// One row of the CSV: one (model, slots, batch, miss rate) cell.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OffloadRow {
    model: String,
    model_path: String,
    cache_slots: u64,
    slot_bytes: Option<u64>,
    cache_bytes: Option<u64>,
    batch_size: u64,
    miss_rate: f64,
    measured_miss_rate: Option<f64>,
    tokens: Option<u64>,
    fetches: Option<u64>,
    misses: Option<u64>,
    bytes_copied: Option<u64>,
    copy_gb_s: Option<f64>,
    fetch_us_per_token: Option<f64>,
    read_bandwidth_gb_s: Option<f64>,
    copy_share: Option<f64>,
    peak_bytes: Option<u64>,
    date: String,
    host: String,
    device: String,
    backend: String,
    kiln_version: String,
    commit: String,
    features: String,
    memory_limit_bytes: Option<u64>,
    threads: Option<u64>,
    status: String,
}

/// A model's expert shape, as the engine's estimate reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Shape {
    layers: u64,
    experts: u64,
    slot_bytes: u64,
}

impl Shape {
    fn of(r: &EstimateReport) -> Option<Shape> {
        Some(Shape { layers: r.moe_layers?, experts: r.moe_experts?, slot_bytes: r.expert_slot_bytes? })
    }

    /// The seed's defaults: the experts of one layer, and 0.4 x layers x experts
    /// (rounded down, as `int()` does), each once.
    fn default_slots(self) -> Vec<u64> {
        let mut v = vec![self.experts, 4 * self.layers * self.experts / 10];
        v.dedup();
        v
    }
}

/// `1.5 GiB`-style sizes for the geometry lines.
fn size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 { format!("{bytes} B") } else { format!("{v:.1} {}", UNITS[i]) }
}

/// The column titles of a geometry's table.
pub const TABLE_COLUMNS: &str = "  batch   miss  measured  copy GB/s  share  fetch us/token  status";

fn table_row(r: &OffloadRow) -> String {
    let opt = |v: Option<f64>, p: usize| v.map_or("-".to_string(), |v| format!("{v:.p$}"));
    format!(
        "  {:>5}  {:>5.2}  {:>8}  {:>9}  {:>5}  {:>14}  {}",
        r.batch_size,
        r.miss_rate,
        opt(r.measured_miss_rate, 3),
        opt(r.copy_gb_s, 2),
        opt(r.copy_share, 2),
        opt(r.fetch_us_per_token, 2),
        r.status
    )
}

/// Everything one run holds while it walks the geometries.
struct Run<'a> {
    runner: LocalRunner<'a>,
    layers: OomLayers,
    meta: RowMeta,
    csv: CsvOut,
    source_csv: String,
    rows: Vec<OffloadRow>,
    cell: usize,
    engine_args: Vec<String>,
    memory_limit_bytes: Option<u64>,
    threads: Option<u64>,
}

/// Why a model has no expert shape: the status of its rows and the reason.
type NoShape = (Status, String);

/// What became of one geometry.
enum Geometry {
    /// At least one cell ran or was skipped by the OOM layers after the first.
    Tabled { measured: usize },
    /// Not one cell ran: a `SKIPPED` (or OOM-layer) line was printed instead of a table.
    Skipped,
}

impl BenchOffloadCopy {
    pub fn run(self, sh: &Shell) -> Result<ExitCode> {
        let harness_env = HarnessEnv::read()?;
        if self.steps == 0 {
            usage!("--steps 0: accepted values are 1 or more");
        }
        let flags = SweepFlags {
            max_tokens: None,
            warmup_tokens: 0,
            output: self.output.clone(),
            memory_limit: self.memory_limit.clone(),
            prefill_chunk: None,
            attention: None,
            kv_dtype: None,
            threads: self.threads,
            cell_timeout: self.cell_timeout,
            no_estimate: false,
            no_build: self.no_build,
            kiln_bin: self.kiln_bin.clone(),
            backend: self.backend,
            oom_record: self.oom_record.clone(),
            runs_dir: self.runs_dir.clone(),
            series: SeriesFlags::default(),
            runner: Default::default(),
        };
        let (_, memory_limit_bytes) = flags.engine_knobs()?;
        let session = Session::prepare(&sh.current_dir(), "offload-copy", &flags, harness_env)?;
        let gpu = session.is_gpu();
        let models: Vec<String> = match &self.models {
            Some(m) => m.0.clone(),
            None if gpu => vec![
                "synthetic:qwen3-30b-a3b".into(),
                "synthetic:mixtral-8x7b".into(),
                "synthetic:qwen1.5-moe-a2.7b".into(),
            ],
            None => vec!["synthetic:tiny-moe".into(), "synthetic:tiny-qwen2-moe".into()],
        };
        let path = match &self.output {
            Some(p) => user_path(p)?,
            None => session.default_output("offload-copy")?,
        };
        session.check_output(&path)?;
        let csv = CsvOut::create_with_header(&path, &HEADER)?;
        let started = match session.start(&path, &flags)? {
            Ok(s) => s,
            Err(code) => return Ok(code),
        };
        let run_dir = started.run_dir().to_path_buf();
        let mut run = Run {
            runner: started.runner(),
            layers: started.layers(),
            meta: started.meta(),
            csv,
            source_csv: started.display(&path),
            rows: Vec::new(),
            cell: 0,
            engine_args: vec![
                "--steps".into(),
                self.steps.to_string(),
                "--min-time-ms".into(),
                self.min_time_ms.to_string(),
                "--bandwidth-bytes".into(),
                self.bandwidth_bytes.clone(),
            ],
            memory_limit_bytes,
            threads: self.threads,
        };
        let named_slots = self.cache_slots.is_some();
        // A model named with --models that cannot run is an error, as in bench-longprompt.
        let named_models = self.models.is_some();
        let (mut total, mut skipped) = (0usize, Vec::<String>::new());
        let mut named_empty = Vec::new();
        let mut interrupted = None;
        'models: for model in &models {
            let facts = match run.shape(model)? {
                Ran::Done(f) => f,
                Ran::Interrupted(sig) => {
                    interrupted = Some(sig);
                    break;
                }
            };
            let (model_path, shape) = match facts {
                Ok(x) => x,
                Err((status, reason)) => {
                    // Rows for the record: one per cell of the grid, at the named slot
                    // counts (0 when they would have come from the model's shape).
                    let slots = self.cache_slots.as_ref().map_or(vec![0], |c| c.0.clone());
                    for &s in &slots {
                        for &b in &self.batch_sizes.0 {
                            for &r in &self.miss_rates.0 {
                                run.write(OffloadRow {
                                    model: model.clone(),
                                    model_path: model.clone(),
                                    cache_slots: s,
                                    batch_size: b,
                                    miss_rate: r,
                                    status: status.as_str().into(),
                                    ..OffloadRow::default()
                                })?;
                            }
                        }
                    }
                    let labels: Vec<String> = if named_slots {
                        slots.iter().map(|s| format!("{model}@{s}")).collect()
                    } else {
                        vec![model.clone()]
                    };
                    console::out(&format!("{model}: {} -- {reason}\n", status.as_str()))?;
                    total += labels.len();
                    if named_slots || named_models {
                        named_empty.extend(labels.iter().cloned());
                    }
                    skipped.extend(labels);
                    continue;
                }
            };
            let slots = self.cache_slots.as_ref().map_or_else(|| shape.default_slots(), |c| c.0.clone());
            for s in slots {
                total += 1;
                let g = match run.geometry(
                    model,
                    &model_path,
                    shape,
                    s,
                    &self.batch_sizes.0,
                    &self.miss_rates.0,
                )? {
                    Ran::Done(g) => g,
                    Ran::Interrupted(sig) => {
                        interrupted = Some(sig);
                        break 'models;
                    }
                };
                match g {
                    Geometry::Tabled { measured } => {
                        if measured == 0 && named_slots {
                            named_empty.push(format!("{model}@{s}"));
                        }
                    }
                    Geometry::Skipped => {
                        skipped.push(format!("{model}@{s}"));
                        if named_slots {
                            named_empty.push(format!("{model}@{s}"));
                        }
                    }
                }
            }
        }
        let tally = if skipped.is_empty() {
            format!("skipped 0 of {total} combinations")
        } else {
            format!("skipped {} of {total} combinations: {}", skipped.len(), skipped.join(", "))
        };
        console::out(&format!("\n{tally}\n"))?;
        run.write_tables(&path);
        crate::report::write_or_warn(&run_dir);
        if let Some(sig) = interrupted {
            eprintln!(
                "interrupted by {}: the running cell's process group was killed; finished rows are in {}",
                shutdown::signal_name(sig),
                run.source_csv
            );
            return Ok(ExitCode::from(shutdown::exit_code_for(sig)));
        }
        let measured = run.rows.iter().filter(|r| r.status == Status::Ok.as_str()).count();
        let failed: Vec<String> = run
            .rows
            .iter()
            .filter(|r| r.status.starts_with("FAIL:"))
            .map(|r| {
                format!(
                    "{}@{} bs={} miss={}: {}",
                    r.model, r.cache_slots, r.batch_size, r.miss_rate, r.status
                )
            })
            .collect();
        let mut reasons = Vec::new();
        if measured == 0 {
            reasons.push("the run measured nothing".to_string());
        }
        if !named_empty.is_empty() {
            reasons.push(format!(
                "models or geometries named with --models or --cache-slots measured nothing: {}",
                named_empty.join(", ")
            ));
        }
        reasons.extend(failed);
        for r in &reasons {
            eprintln!("exit 1: {r}");
        }
        eprintln!("results: {}", run.source_csv);
        Ok(ExitCode::from(if reasons.is_empty() { 0 } else { 1 }))
    }
}

impl Run<'_> {
    /// The model's path and expert shape from `kiln estimate`, or why there is none.
    /// The status of the rows of a model without a shape: `SKIP:missing_model` for a name
    /// the engine cannot find, `SKIP:unsupported` for a model without experts or one it
    /// refuses by rule, `FAIL:estimate` when the estimate failed.
    fn shape(&mut self, model: &str) -> Result<Ran<Result<(String, Shape), NoShape>>> {
        let cell = self.cell_for(model.to_string(), 1);
        let i = self.next_index();
        Ok(match self.runner.estimate(i, &cell)? {
            Ran::Interrupted(sig) => Ran::Interrupted(sig),
            Ran::Done(EstimateFacts::Report(r)) => Ran::Done(match Shape::of(&r) {
                Some(s) => Ok((r.model_path, s)),
                None => Err((
                    Status::Unsupported,
                    "not a mixture-of-experts model: the expert cache applies to qwen2_moe, qwen3_moe and mixtral models".into(),
                )),
            }),
            Ran::Done(EstimateFacts::ByRule(r)) => Ran::Done(Err((Status::Unsupported, r))),
            Ran::Done(EstimateFacts::MissingModel(r)) => Ran::Done(Err((Status::MissingModel, r))),
            Ran::Done(EstimateFacts::Failed(r)) => Ran::Done(Err((Status::Estimate, r))),
            Ran::Done(EstimateFacts::NotApplicable) => {
                Ran::Done(Err((Status::Estimate, "the engine could not estimate it".into())))
            }
        })
    }

    fn next_index(&mut self) -> usize {
        self.cell += 1;
        self.cell - 1
    }

    fn cell_for(&self, model: String, len: u64) -> Cell {
        Cell {
            model,
            prompt: Prompt::Tokens(len),
            max_tokens: 1,
            warmup_tokens: 0,
            named: Named { models: false, prompts: false },
            env: BTreeMap::new(),
            repetition: 1,
            engine: Engine::Kiln,
        }
    }

    /// One geometry: the OOM layers, then its first cell (which builds the cache), and
    /// only then its header and rows.
    fn geometry(
        &mut self,
        model: &str,
        model_path: &str,
        shape: Shape,
        slots: u64,
        batches: &[u64],
        rates: &[f64],
    ) -> Result<Ran<Geometry>> {
        let label = format!("{model} @ cache_slots={slots} ({})", size(slots * shape.slot_bytes));
        let key = self.cell_for(format!("{model}{RECORD_SUFFIX}"), slots);
        let cells: Vec<(u64, f64)> =
            batches.iter().flat_map(|&b| rates.iter().map(move |&r| (b, r))).collect();
        let blank = |b: u64, r: f64| OffloadRow {
            model: model.to_string(),
            model_path: model_path.to_string(),
            cache_slots: slots,
            slot_bytes: Some(shape.slot_bytes),
            cache_bytes: Some(slots * shape.slot_bytes),
            batch_size: b,
            miss_rate: r,
            ..OffloadRow::default()
        };
        let mut headed = false;
        let mut measured = 0;
        for (j, &(b, r)) in cells.iter().enumerate() {
            if let Some(skip) = self.layers.judge(&key, self.runner.device())? {
                if j == 0 && skip.status != Status::Oom {
                    // Not one cell of this geometry can run: one line, rows for the record.
                    for &(b, r) in &cells {
                        let mut row = blank(b, r);
                        row.status = skip.status.as_str().into();
                        self.write(row)?;
                    }
                    console::out(&format!("{label}: {} -- {}\n", skip.status.as_str(), skip.reason))?;
                    return Ok(Ran::Done(Geometry::Skipped));
                }
                eprintln!("{label} batch {b} miss {r}: {}: {}", skip.status.as_str(), skip.reason);
                let mut row = blank(b, r);
                row.status = skip.status.as_str().into();
                if !headed {
                    console::out(&format!("{label}\n{TABLE_COLUMNS}\n"))?;
                    headed = true;
                }
                console::out(&format!("{}\n", table_row(self.finish(&mut row))))?;
                let device = self.runner.device().to_string();
                self.record_row(row, &key, slots, skip.status, device)?;
                continue;
            }
            let mut row = blank(b, r);
            let (status, report, demand, reason, device) = match self.measure(model, slots, b, r)? {
                Ran::Done(x) => x,
                Ran::Interrupted(sig) => return Ok(Ran::Interrupted(sig)),
            };
            if j == 0 && status == Status::Unsupported {
                let why = reason.clone().unwrap_or_default();
                if let Some(rule) = why.strip_prefix(GEOMETRY_REFUSED) {
                    // Refused by the engine's rules: one line, no header, and rows that
                    // say so. Never clamped.
                    let prefix = format!("{model} @ cache_slots={slots}: ");
                    let rule = rule.strip_prefix(&prefix).unwrap_or(rule).to_string();
                    for &(b, r) in &cells {
                        let mut row = blank(b, r);
                        row.status = Status::Unsupported.as_str().into();
                        self.write(row)?;
                    }
                    console::out(&format!("{label}: SKIPPED -- {rule}\n"))?;
                    return Ok(Ran::Done(Geometry::Skipped));
                }
                eprintln!("{label}: {}", why);
            }
            row.status = status.as_str().into();
            row.peak_bytes = demand;
            if let Some(rep) = &report {
                row.model_path = rep.model_path.clone();
                row.measured_miss_rate = Some(round3(rep.measured_miss_rate));
                row.tokens = Some(rep.tokens);
                row.fetches = Some(rep.fetches);
                row.misses = Some(rep.misses);
                row.bytes_copied = Some(rep.bytes_copied);
                row.copy_gb_s = rep.copy_gb_s.map(round3);
                row.fetch_us_per_token = Some(round3(rep.fetch_us_per_token));
                row.read_bandwidth_gb_s = Some(round3(rep.read_bandwidth_gb_s));
                row.copy_share = rep.copy_share.map(round3);
                row.peak_bytes = Some(rep.peak_bytes);
                if self.meta.kiln_version.is_empty() {
                    self.meta.kiln_version = rep.kiln_version.clone();
                }
                measured += 1;
            } else if let Some(why) = &reason {
                eprintln!("{label} batch {b} miss {r}: {}: {why}", status.as_str());
            }
            if !headed {
                console::out(&format!("{label}\n{TABLE_COLUMNS}\n"))?;
                headed = true;
            }
            console::out(&format!("{}\n", table_row(self.finish(&mut row))))?;
            self.record_row(row, &key, slots, status, device)?;
        }
        Ok(Ran::Done(Geometry::Tabled { measured }))
    }

    /// Writes `row` and feeds its status to the OOM layers: only an exact `SKIP:oom`
    /// reaches the backstop and the record.
    fn record_row(
        &mut self,
        row: OffloadRow,
        key: &Cell,
        slots: u64,
        status: Status,
        device: String,
    ) -> Result<()> {
        let (date, commit, peak) = (row.date.clone(), row.commit.clone(), row.peak_bytes);
        self.write(row)?;
        let source_csv = self.source_csv.clone();
        let appended = self.layers.observe(key, status, || RecordLine {
            model: key.model.clone(),
            prompt_target_len: slots,
            date,
            commit,
            peak_bytes: peak,
            source_csv,
            device: Some(device),
        })?;
        if appended {
            eprintln!(
                "    recorded {}@{slots} in {}",
                key.model,
                self.meta.display(self.layers.record.file().path())
            );
        }
        Ok(())
    }

    /// Fills the fingerprint of `row` and returns it.
    fn finish<'r>(&self, row: &'r mut OffloadRow) -> &'r OffloadRow {
        let m = &self.meta;
        row.date = now();
        row.host = m.host.clone();
        row.device = self.runner.device().to_string();
        row.backend = m.backend.clone();
        row.kiln_version = m.kiln_version.clone();
        row.commit = m.commit.clone();
        row.features = m.features_column(&BTreeMap::new());
        row.memory_limit_bytes = self.memory_limit_bytes;
        row.threads = self.threads;
        row
    }

    fn write(&mut self, mut row: OffloadRow) -> Result<()> {
        if row.date.is_empty() {
            self.finish(&mut row);
        }
        self.csv.write_record(&row)?;
        self.rows.push(row);
        Ok(())
    }

    /// One `kiln bench-expert-copy` cell.
    #[allow(clippy::type_complexity)]
    fn measure(
        &mut self,
        model: &str,
        slots: u64,
        batch: u64,
        rate: f64,
    ) -> Result<Ran<(Status, Option<OffloadCopyReport>, Option<u64>, Option<String>, String)>> {
        let cell = self.cell_for(model.to_string(), slots);
        let mut args = vec![
            "bench-expert-copy".to_string(),
            "-m".into(),
            self.runner.model_arg(&cell),
            "--expert-slots".into(),
            slots.to_string(),
            "--batch-size".into(),
            batch.to_string(),
            "--miss-rate".into(),
            rate.to_string(),
        ];
        args.extend(self.engine_args.iter().cloned());
        args.extend(self.runner.knobs.to_args());
        let i = self.next_index();
        Ok(match self.runner.run_kiln(i, &cell, &args, OffloadCopyReport::parse)? {
            Ran::Done((c, _log)) => Ran::Done((
                c.status,
                c.report,
                c.oom_demand_bytes,
                c.reason,
                self.runner.device().to_string(),
            )),
            Ran::Interrupted(sig) => Ran::Interrupted(sig),
        })
    }

    /// The markdown tables and the SVG beside the CSV; a failure is a warning, never the
    /// loss of the CSV.
    fn write_tables(&self, csv: &Path) {
        let md = csv.with_extension("md");
        // Replaced atomically: a reader sees the last run's tables or this run's whole.
        match crate::sweep::task::write_atomic(&md, markdown(&self.rows).as_bytes()) {
            Ok(()) => eprintln!("tables: {}", md.display()),
            Err(e) => eprintln!("warning: no tables beside {}: {e:#}", csv.display()),
        }
        let svg = csv.with_extension("svg");
        match plot::write_svg(&svg, &panels(&self.rows)) {
            Ok(_) => eprintln!("plot: {}", svg.display()),
            Err(e) => eprintln!("warning: no plot beside {}: {e:#}", csv.display()),
        }
    }
}

/// One markdown table per geometry with a row that ran, in sweep order.
pub fn markdown(rows: &[OffloadRow]) -> String {
    let mut out = String::from("# Expert offload copy cost\n");
    let mut seen: Vec<(String, u64)> = Vec::new();
    for r in rows {
        let key = (r.model.clone(), r.cache_slots);
        if seen.contains(&key) {
            continue;
        }
        seen.push(key.clone());
        let group: Vec<&OffloadRow> =
            rows.iter().filter(|x| (x.model.clone(), x.cache_slots) == key).collect();
        if group.iter().all(|x| x.status != Status::Ok.as_str() && x.status != Status::Oom.as_str()) {
            let status = &group[0].status;
            out.push_str(&format!("\n{} @ cache_slots={}: {status}\n", key.0, key.1));
            continue;
        }
        let bytes = r.cache_bytes.unwrap_or(0);
        out.push_str(&format!("\n## {} @ cache_slots={} ({})\n\n", key.0, key.1, size(bytes)));
        out.push_str(
            "| batch | miss rate | measured | copy GB/s | share of read | fetch us/token | status |\n",
        );
        out.push_str("|---:|---:|---:|---:|---:|---:|---|\n");
        let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v}"));
        for x in group {
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} |\n",
                x.batch_size,
                x.miss_rate,
                opt(x.measured_miss_rate),
                opt(x.copy_gb_s),
                opt(x.copy_share),
                opt(x.fetch_us_per_token),
                x.status
            ));
        }
    }
    out
}

/// Expert-fetch time per token against the miss rate, one line per (geometry, batch
/// size); a cell without a measurement is marked with its status. Lines more than 10x
/// apart get a panel each.
pub fn panels(rows: &[OffloadRow]) -> Vec<plot::Panel> {
    let name = |r: &OffloadRow| format!("{}@{} bs={}", r.model, r.cache_slots, r.batch_size);
    let mut names: Vec<String> = Vec::new();
    for r in rows {
        if !names.contains(&name(r)) {
            names.push(name(r));
        }
    }
    let series: Vec<plot::Series> = names
        .iter()
        .map(|n| {
            plot::Series::line(
                n.clone(),
                rows.iter()
                    .filter(|r| &name(r) == n && r.status == Status::Ok.as_str())
                    .filter_map(|r| Some((r.miss_rate, r.fetch_us_per_token?)))
                    .collect(),
            )
        })
        .collect();
    let marks: Vec<plot::Mark> = rows
        .iter()
        .filter(|r| r.status != Status::Ok.as_str() && r.status != Status::Unsupported.as_str())
        .map(|r| plot::Mark { series: name(r), x: r.miss_rate, label: r.status.clone() })
        .collect();
    // A geometry refused outright has nothing to draw or mark.
    let series = series
        .into_iter()
        .filter(|s| !s.points.is_empty() || marks.iter().any(|m| m.series == s.name))
        .collect();
    vec![plot::Panel {
        series,
        marks,
        split_when_spread: true,
        ..plot::Panel::new(
            "expert-fetch time per token",
            plot::Axis::linear("miss rate (share of expert lookups)"),
            plot::Axis::from_zero("expert fetch (µs/token)"),
        )
    }]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_strictly_and_name_the_bad_entry() {
        assert_eq!(counts_arg("1,4 16").unwrap().0, vec![1, 4, 16]);
        for bad in ["", "0", "1,1", "-4", "2x"] {
            assert!(counts_arg(bad).is_err(), "{bad:?}");
        }
        assert!(counts_arg("2x").unwrap_err().contains("`2x`"));
        assert_eq!(rates_arg("0,0.1 1").unwrap().0, vec![0.0, 0.1, 1.0]);
        for bad in ["", "1.5", "-0.1", "nan", "0,0"] {
            assert!(rates_arg(bad).is_err(), "{bad:?}");
        }
        assert_eq!(bandwidth_arg("4MiB").unwrap(), "4MiB");
        for bad in ["4KiB", "lots", ""] {
            assert!(bandwidth_arg(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn default_slots_follow_the_seed() {
        let qwen3 = Shape { layers: 48, experts: 128, slot_bytes: 1 };
        assert_eq!(qwen3.default_slots(), vec![128, 2457]);
        let tiny = Shape { layers: 2, experts: 8, slot_bytes: 1 };
        assert_eq!(tiny.default_slots(), vec![8, 6]);
        assert_eq!(size(47 << 30), "47.0 GiB");
        assert_eq!(size(512), "512 B");
    }

    #[test]
    fn the_header_is_the_row_struct() {
        let mut w = csv::WriterBuilder::new().has_headers(true).from_writer(Vec::new());
        w.serialize(OffloadRow::default()).unwrap();
        let text = String::from_utf8(w.into_inner().unwrap()).unwrap();
        assert_eq!(text.lines().next().unwrap(), HEADER.join(","));
    }

    #[test]
    fn tables_and_the_plot_cover_measured_and_skipped_geometries() {
        let row = |slots: u64, b: u64, r: f64, status: &str, fetch: Option<f64>| OffloadRow {
            model: "m".into(),
            cache_slots: slots,
            cache_bytes: Some(slots * 1024),
            batch_size: b,
            miss_rate: r,
            status: status.into(),
            fetch_us_per_token: fetch,
            ..OffloadRow::default()
        };
        let rows = [
            row(8, 1, 0.0, "ok", Some(1.0)),
            row(8, 1, 1.0, "ok", Some(9.0)),
            row(16, 1, 0.0, "SKIP:unsupported", None),
            row(16, 1, 1.0, "SKIP:unsupported", None),
        ];
        let md = markdown(&rows);
        assert_eq!(md.matches("## m @ cache_slots=8").count(), 1);
        assert!(md.contains("m @ cache_slots=16: SKIP:unsupported"));
        assert!(!md.contains("## m @ cache_slots=16"));
        let p = panels(&rows);
        assert_eq!(p[0].series.len(), 1);
        assert_eq!(p[0].series[0].points, vec![(0.0, 1.0).into(), (1.0, 9.0).into()]);
        assert!(p[0].marks.is_empty());
        let mut rows = rows.to_vec();
        rows.push(row(8, 4, 0.0, "ok", Some(0.5)));
        rows.push(row(8, 4, 0.5, "ok", Some(2.5)));
        rows.push(row(8, 4, 1.0, "FAIL:timeout", None));
        let l = plot::raster::check("offload-copy", &panels(&rows));
        let p = &l.panels[0];
        assert_eq!((p.x_ticks[0].value, p.x_ticks.last().unwrap().value), (0.0, 1.0));
        assert_eq!(p.notes[0].0, "m@8 bs=4: FAIL:timeout at 1");
    }
}
