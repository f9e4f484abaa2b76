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
//!
//! The flags (`flags`), what a run walks (`plan`: models, shapes, geometries, cells), the
//! row and its header (`rows`), the walk of a geometry's cells through the sweep
//! driver's cell steps (`run`), and the tally, exit status, tables and plot (`summary`)
//! stay apart, as in `sweep/`.

mod flags;
mod plan;
mod rows;
mod run;
mod summary;

use std::process::ExitCode;

use anyhow::Result;
use xshell::Shell;

use crate::args::user_path;
use crate::child as shutdown;
use crate::console::{self, usage};
use crate::sweep::rows::CsvOut;
use crate::sweep::runner::Ran;
use crate::sweep::series::SeriesFlags;
use crate::sweep::{HarnessEnv, Session, SweepFlags};
pub use flags::BenchOffloadCopy;
pub use rows::{HEADER, HEADER_BEFORE_DRIVER, OffloadRow};
use run::{Geometry, Run};
use summary::Tally;
pub use summary::{markdown, panels};

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
            measure_roofs: false,
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
        let models = match &self.models {
            Some(m) => m.0.clone(),
            None => plan::default_models(gpu),
        };
        let path = match &self.output {
            Some(p) => user_path(p)?,
            None => session.default_output("offload-copy")?,
        };
        session.check_output(&path)?;
        let csv = CsvOut::create_with_header(&path, &HEADER, "--output")?;
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
        let mut tally = Tally::default();
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
                    tally.total += labels.len();
                    if named_slots || named_models {
                        tally.named_empty.extend(labels.iter().cloned());
                    }
                    tally.skipped.extend(labels);
                    continue;
                }
            };
            let slots = self.cache_slots.as_ref().map_or_else(|| shape.default_slots(), |c| c.0.clone());
            for s in slots {
                tally.total += 1;
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
                            tally.named_empty.push(format!("{model}@{s}"));
                        }
                    }
                    Geometry::Skipped => {
                        tally.skipped.push(format!("{model}@{s}"));
                        if named_slots {
                            tally.named_empty.push(format!("{model}@{s}"));
                        }
                    }
                }
            }
        }
        console::out(&format!("\n{}\n", tally.line()))?;
        summary::write_tables(&run.rows, &path);
        crate::report::write_or_warn(&run_dir);
        if let Some(sig) = interrupted {
            eprintln!(
                "interrupted by {}: the running cell's process group was killed; finished rows are in {}",
                shutdown::signal_name(sig),
                run.source_csv
            );
            return Ok(ExitCode::from(shutdown::exit_code_for(sig)));
        }
        let reasons = tally.exit_reasons(&run.rows);
        for r in &reasons {
            eprintln!("exit 1: {r}");
        }
        eprintln!("results: {}", run.source_csv);
        Ok(ExitCode::from(if reasons.is_empty() { 0 } else { 1 }))
    }
}
