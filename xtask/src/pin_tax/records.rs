//! What a pin-tax run records and reads back, below the driver, the analysis and the A/A
//! floor that all use it: the cells and metrics a mode defines, each pass and boot as
//! `passes.jsonl` and `boots.jsonl` hold them, and an A/A run's noise floor (`aa.json`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::arms::{Arm, GateLine, KernelLine};
use crate::quiet::Reading as QuietReading;
use crate::verdict::reading::Reading;

/// Which way a metric improves: the verdict's own ([`crate::verdict::reading::Better`]).
pub use crate::verdict::reading::Better;

/// A metric a cell reports.
#[derive(Clone, Debug)]
pub struct MetricDef {
    /// Its name, e.g. `output tok/s`.
    pub name: &'static str,
    /// Which way is better.
    pub better: Better,
}

/// A cell: a named workload measured once per pass.
#[derive(Clone, Debug)]
pub struct CellDef {
    /// Its name, e.g. `decode B=4`.
    pub name: String,
    /// What it reports.
    pub metrics: Vec<MetricDef>,
}

/// One cell measured in one pass.
#[derive(Clone, Debug, Serialize)]
pub struct CellMeasure {
    /// The cell.
    pub cell: String,
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed.
    pub failed: usize,
    /// The first failure.
    pub first_error: Option<String>,
    /// Metric values (completed requests only).
    pub metrics: BTreeMap<String, f64>,
    /// Request key -> output hash, for completed requests.
    pub hashes: BTreeMap<String, String>,
    /// The server's `usage.prompt_tokens` of the first completed request: with the
    /// cached tokens, the M of the cell's prefill forward.
    pub prompt_tokens: Option<u64>,
    /// Its `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// Why the measurement does not count although every request completed (a mixed
    /// window whose speculative stream did not cover it, or had not drained).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub invalid: Option<String>,
    /// What a mode records beyond the metrics (a mixed window's timeline).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<serde_json::Value>,
}

/// One pass as written to `passes.jsonl`.
#[derive(Clone, Debug, Serialize)]
pub struct PassRecord {
    /// 1-based boot number.
    pub boot: usize,
    /// Its arm.
    pub arm: Arm,
    /// 0 = warm-up, then 1..=passes.
    pub pass: usize,
    /// Whether it counts.
    pub ok: bool,
    /// Why not.
    pub reason: Option<String>,
    /// Why it does not count although it completed (a cell's `invalid`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub invalid: Option<String>,
    /// Why it was measured on a busy machine, if it was.
    pub disturbed: Option<String>,
    /// What ran beside it.
    pub quiet: Option<QuietReading>,
    /// Wall seconds.
    pub elapsed_s: f64,
    /// Its cells.
    pub cells: Vec<CellMeasure>,
}

/// One boot as written to `boots.jsonl`.
#[derive(Clone, Debug, Serialize)]
pub struct BootRecord {
    /// 1-based boot number.
    pub boot: usize,
    /// Its arm (in an A/A run its slot, `A1` or `A2`).
    pub arm: Arm,
    /// The arm whose environment it ran: its own, or an A/A run's shared one.
    pub runs: Arm,
    /// The server's pid (its process group).
    pub pid: Option<i32>,
    /// The parsed kernel line.
    pub kernel: Option<KernelLine>,
    /// The exactness gate's line, for arms that speculate.
    pub gate: Option<GateLine>,
    /// Why the boot produced no passes, if it did not.
    pub failure: Option<String>,
    /// Port preflight and spawn, seconds.
    pub preflight_s: f64,
    /// The quiet check before the boot, seconds.
    pub quiet_check_s: f64,
    /// Spawn to the first 200 from /health, seconds.
    pub ready_after_s: Option<f64>,
    /// SIGTERM to reaped, seconds.
    pub stop_s: f64,
    /// Whether the grace ran out and SIGKILL was needed.
    pub killed: bool,
    /// How the server ended.
    pub ended: String,
    /// The boot's log, relative to the run directory.
    pub log: String,
}

/// `cell: f of n requests failed; first: ...` for each cell with a failed request.
pub fn cell_failures(cells: &[CellMeasure]) -> Vec<String> {
    cells
        .iter()
        .filter(|c| c.failed > 0)
        .map(|c| {
            format!(
                "{}: {} of {} requests failed; first: {}",
                c.cell,
                c.failed,
                c.requests,
                c.first_error.as_deref().unwrap_or("")
            )
        })
        .collect()
}

/// One metric's noise floor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Floor {
    /// Cells with an interval.
    pub cells: usize,
    /// Of those, cells whose interval excludes 1.
    pub false_positives: usize,
    /// The mean half-width of their intervals, percent.
    pub mean_half_width_pct: Option<f64>,
    /// The pairs behind each interval (the most of any cell).
    pub pairs: usize,
    /// The cell whose interval is the median's width: what the machine typically resolves.
    #[serde(default)]
    pub typical: Option<Reading>,
    /// The widest interval.
    #[serde(default)]
    pub widest: Option<Reading>,
}

impl Floor {
    /// The share of intervals that exclude 1, percent.
    pub fn false_positive_pct(&self) -> Option<f64> {
        (self.cells > 0).then(|| 100.0 * self.false_positives as f64 / self.cells as f64)
    }
}

/// What `aa.json` holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NoiseFloor {
    /// The device fingerprint (`env.json`'s `device`).
    pub device: String,
    /// When the run started (its run directory's stamp).
    pub run: String,
    /// The mode it ran (`sweep`, `mixed`): an A/B run cites only its own mode's.
    #[serde(default)]
    pub mode: Option<String>,
    /// Per metric.
    pub metrics: BTreeMap<String, Floor>,
}

impl NoiseFloor {
    /// The share of all its intervals that exclude 1, percent.
    pub fn false_positive_pct(&self) -> Option<f64> {
        let (fp, cells) = self.metrics.values().fold((0, 0), |a, x| (a.0 + x.false_positives, a.1 + x.cells));
        (cells > 0).then(|| 100.0 * fp as f64 / cells as f64)
    }
}
