//! One run's walk: each model's shape from its estimate, then each geometry's cells
//! through the sweep driver's cell steps (the OOM layers' verdict, the run, the row
//! flushed before anything else, the outcome fed back to the backstop and the record),
//! with the rule only this sweep has: the first cell of a geometry builds its cache, and
//! a geometry whose first cell is refused prints one line and no table.

use std::collections::BTreeMap;

use anyhow::Result;

use super::plan::{self, Shape};
use super::rows::{OffloadRow, TABLE_COLUMNS, size, table_row};
use crate::console;
use crate::sweep::classify::Status;
use crate::sweep::driver::{Judged, RowMeta, Written, feed_back, judge_then_run, now};
use crate::sweep::layers::{EstimateFacts, OomLayers};
use crate::sweep::plan::Cell;
use crate::sweep::rows::{CsvOut, round3};
use crate::sweep::runner::{CellRunner, LocalRunner, Ran};
use kiln_protocol::{GEOMETRY_REFUSED, OffloadCopyReport};

/// Everything one run holds while it walks the geometries.
pub(super) struct Run<'a> {
    pub(super) runner: LocalRunner<'a>,
    pub(super) layers: OomLayers,
    pub(super) meta: RowMeta,
    pub(super) csv: CsvOut,
    pub(super) source_csv: String,
    pub(super) rows: Vec<OffloadRow>,
    /// The index of the next engine child (its logs' name).
    pub(super) cell: usize,
    /// Passed to every `bench-expert-copy` child after the cell's own flags.
    pub(super) engine_args: Vec<String>,
    pub(super) memory_limit_bytes: Option<u64>,
    pub(super) threads: Option<u64>,
}

/// Why a model has no expert shape: the status of its rows and the reason.
pub(super) type NoShape = (Status, String);

/// What became of one geometry.
pub(super) enum Geometry {
    /// At least one cell ran or was skipped by the OOM layers after the first.
    Tabled { measured: usize },
    /// Not one cell ran: a `SKIPPED` (or OOM-layer) line was printed instead of a table.
    Skipped,
}

/// What one `kiln bench-expert-copy` child produced.
struct Measured {
    status: Status,
    report: Option<OffloadCopyReport>,
    /// For `SKIP:oom`: what the cell needed when it was refused, when it said.
    demand: Option<u64>,
    reason: Option<String>,
    device: String,
}

/// The next child's index.
fn next_index(cell: &mut usize) -> usize {
    *cell += 1;
    *cell - 1
}

/// One `kiln bench-expert-copy` cell, child number `index`.
fn measure(
    runner: &LocalRunner<'_>,
    index: usize,
    engine_args: &[String],
    model: &str,
    slots: u64,
    (batch, rate): (u64, f64),
) -> Result<Ran<Measured>> {
    let cell = plan::cell(model.to_string(), slots);
    let mut args = vec![
        "bench-expert-copy".to_string(),
        "-m".into(),
        runner.model_arg(&cell),
        "--expert-slots".into(),
        slots.to_string(),
        "--batch-size".into(),
        batch.to_string(),
        "--miss-rate".into(),
        rate.to_string(),
    ];
    args.extend(engine_args.iter().cloned());
    args.extend(runner.engine_args());
    Ok(match runner.run_kiln(index, &cell, &args, OffloadCopyReport::parse)? {
        Ran::Done((c, _log)) => Ran::Done(Measured {
            status: c.status,
            report: c.report,
            demand: c.oom_demand_bytes,
            reason: c.reason,
            device: runner.device().to_string(),
        }),
        Ran::Interrupted(sig) => Ran::Interrupted(sig),
    })
}

impl Run<'_> {
    /// The model's path and expert shape from `kiln estimate`, or why there is none.
    /// The status of the rows of a model without a shape: `SKIP:missing_model` for a name
    /// the engine cannot find, `SKIP:unsupported` for a model without experts or one it
    /// refuses by rule, `FAIL:estimate` when the estimate failed.
    pub(super) fn shape(&mut self, model: &str) -> Result<Ran<Result<(String, Shape), NoShape>>> {
        let cell = plan::cell(model.to_string(), 1);
        let i = next_index(&mut self.cell);
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

    /// One geometry: the OOM layers, then its first cell (which builds the cache), and
    /// only then its header and rows.
    pub(super) fn geometry(
        &mut self,
        model: &str,
        model_path: &str,
        shape: Shape,
        slots: u64,
        batches: &[u64],
        rates: &[f64],
    ) -> Result<Ran<Geometry>> {
        let label = format!("{model} @ cache_slots={slots} ({})", size(slots * shape.slot_bytes));
        let key = plan::record_key(model, slots);
        let cells = plan::cells(batches, rates);
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
            let device = self.runner.device().to_string();
            let (runner, index, engine_args) = (&self.runner, &mut self.cell, &self.engine_args);
            let judged = judge_then_run(&mut self.layers, &key, &device, || {
                measure(runner, next_index(index), engine_args, model, slots, (b, r))
            })?;
            let m = match judged {
                Ran::Interrupted(sig) => return Ok(Ran::Interrupted(sig)),
                Ran::Done(Judged::Ran(m)) => m,
                Ran::Done(Judged::Skipped(skip)) => {
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
                    self.record_row(row, &key, skip.status, device)?;
                    continue;
                }
            };
            let mut row = blank(b, r);
            if j == 0 && m.status == Status::Unsupported {
                let why = m.reason.clone().unwrap_or_default();
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
            row.status = m.status.as_str().into();
            row.peak_bytes = m.demand;
            if let Some(rep) = &m.report {
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
            } else if let Some(why) = &m.reason {
                eprintln!("{label} batch {b} miss {r}: {}: {why}", m.status.as_str());
            }
            if !headed {
                console::out(&format!("{label}\n{TABLE_COLUMNS}\n"))?;
                headed = true;
            }
            console::out(&format!("{}\n", table_row(self.finish(&mut row))))?;
            self.record_row(row, &key, m.status, m.device)?;
        }
        Ok(Ran::Done(Geometry::Tabled { measured }))
    }

    /// Writes `row` and feeds its status to the OOM layers, as the driver does for every
    /// kiln cell: only an exact `SKIP:oom` reaches the backstop and the record.
    fn record_row(&mut self, row: OffloadRow, key: &Cell, status: Status, device: String) -> Result<()> {
        let (date, commit, peak_bytes) = (row.date.clone(), row.commit.clone(), row.peak_bytes);
        self.write(row)?;
        let written = Written { status, date: &date, commit: &commit, peak_bytes, device };
        feed_back(&mut self.layers, &self.meta, &self.source_csv, key, written)
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
        row.driver_version = m.driver_version.clone();
        row.cuda_version = m.cuda_version.clone();
        row.memory_limit_bytes = self.memory_limit_bytes;
        row.threads = self.threads;
        row
    }

    /// Writes `row` (its fingerprint filled when it has none yet), flushed, and keeps it
    /// for the tables.
    pub(super) fn write(&mut self, mut row: OffloadRow) -> Result<()> {
        if row.date.is_empty() {
            self.finish(&mut row);
        }
        self.csv.write_record(&row)?;
        self.rows.push(row);
        Ok(())
    }
}
