//! Reading criterion's output files: the run's and a baseline's estimates, samples and
//! throughput per benchmark id, and which ids have no results.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anyhow::{Context, Result};
use serde::Deserialize;

#[derive(Deserialize)]
pub(super) struct BenchmarkFile {
    pub(super) full_id: String,
    #[serde(default)]
    pub(super) throughput: Option<ThroughputFile>,
}

#[derive(Deserialize)]
pub(super) enum ThroughputFile {
    Bytes(u64),
    BytesDecimal(u64),
    /// The compute roofs' operations.
    Elements(u64),
    #[serde(other)]
    Other,
}

#[derive(Clone, Deserialize)]
pub(super) struct Interval {
    pub(super) lower_bound: f64,
    pub(super) upper_bound: f64,
}

#[derive(Clone, Deserialize)]
pub(super) struct EstimateFile {
    pub(super) confidence_interval: Interval,
    pub(super) point_estimate: f64,
}

#[derive(Deserialize)]
pub(super) struct EstimatesFile {
    pub(super) mean: EstimateFile,
    #[serde(default)]
    pub(super) slope: Option<EstimateFile>,
}

#[derive(Deserialize)]
pub(super) struct ChangeFile {
    pub(super) mean: EstimateFile,
}

#[derive(Deserialize)]
pub(super) struct SampleFile {
    pub(super) iters: Vec<f64>,
    pub(super) times: Vec<f64>,
}

pub(super) fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let text = crate::fsx::read_text_bounded(path, crate::fsx::MAX_RUN_FILE_BYTES)?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

pub(super) fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Marks the start of a run with a file in `criterion_dir` and returns its modification
/// time. Results are told fresh by comparing their files' times with it: both come from
/// the filesystem's clock, which can lag `SystemTime::now()` by a tick, so a file written
/// just after `now()` could otherwise look older than the run.
pub(super) fn run_started(criterion_dir: &Path) -> Result<SystemTime> {
    std::fs::create_dir_all(criterion_dir)
        .with_context(|| format!("creating {}", criterion_dir.display()))?;
    let marker = criterion_dir.join(".kiln-run-start");
    std::fs::write(&marker, b"").with_context(|| format!("writing {}", marker.display()))?;
    modified(&marker).with_context(|| format!("reading the time of {}", marker.display()))
}

/// Maps benchmark ids to their directories by reading every `<sub>/benchmark.json`.
pub(super) fn id_dirs(criterion_dir: &Path, sub: &str) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![criterion_dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for e in entries.flatten() {
            let p = e.path();
            if !p.is_dir() {
                continue;
            }
            let file = p.join(sub).join("benchmark.json");
            if file.is_file() {
                if let Ok(b) = read_json::<BenchmarkFile>(&file) {
                    out.insert(b.full_id, p.clone());
                }
            } else {
                stack.push(p);
            }
        }
    }
    out
}

/// One set of results for a benchmark: time per iteration (criterion's typical estimate:
/// the slope when it has one, else the mean) with its interval, the per-iteration times of
/// every sample, and the bytes one iteration reads or (a compute roof) the operations it
/// does.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Measured {
    pub(super) ns: f64,
    pub(super) ns_lo: f64,
    pub(super) ns_hi: f64,
    pub(super) samples: Vec<f64>,
    pub(super) bytes: Option<u64>,
    pub(super) ops: Option<u64>,
}

impl Measured {
    pub(super) fn read(dir: &Path) -> Result<Measured> {
        let est: EstimatesFile = read_json(&dir.join("estimates.json"))?;
        let sample: SampleFile = read_json(&dir.join("sample.json"))?;
        let bench: BenchmarkFile = read_json(&dir.join("benchmark.json"))?;
        let typical = est.slope.unwrap_or(est.mean);
        let samples = sample.iters.iter().zip(&sample.times).map(|(i, t)| t / i).collect();
        let bytes = match bench.throughput {
            Some(ThroughputFile::Bytes(b) | ThroughputFile::BytesDecimal(b)) => Some(b),
            _ => None,
        };
        let ops = match bench.throughput {
            Some(ThroughputFile::Elements(n)) => Some(n),
            _ => None,
        };
        Ok(Measured {
            ns: typical.point_estimate,
            ns_lo: typical.confidence_interval.lower_bound,
            ns_hi: typical.confidence_interval.upper_bound,
            samples,
            bytes,
            ops,
        })
    }

    /// Bytes per second of one iteration's bytes, 10^9 per GB.
    pub(super) fn gb_s(&self) -> Option<f64> {
        self.bytes.map(|b| b as f64 / self.ns)
    }
}

/// The baseline's results as they were before the run.
pub(super) struct Snapshot {
    pub(super) results: BTreeMap<String, Measured>,
}

impl Snapshot {
    pub(super) fn read(criterion_dir: &Path, name: &str, ids: &[String]) -> Result<Snapshot> {
        let dirs = id_dirs(criterion_dir, name);
        let mut results = BTreeMap::new();
        for id in ids {
            if let Some(dir) = dirs.get(id) {
                let m =
                    Measured::read(&dir.join(name)).with_context(|| format!("baseline {name} of {id}"))?;
                results.insert(id.clone(), m);
            }
        }
        Ok(Snapshot { results })
    }
}

/// A relative change of the mean (0.05 = 5% slower) with its interval.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Change {
    pub(super) point: f64,
    pub(super) lo: f64,
    pub(super) hi: f64,
}

/// One line of the report.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Row {
    pub(super) id: String,
    pub(super) current: Option<Measured>,
    pub(super) baseline: Option<Measured>,
    pub(super) change: Option<Change>,
}

/// The results of `ids` that this run produced (files newer than `start`), beside the
/// baseline snapshot.
pub(super) fn collect(
    criterion_dir: &Path,
    ids: &[String],
    baseline: &Snapshot,
    start: SystemTime,
) -> Result<Vec<Row>> {
    let dirs = id_dirs(criterion_dir, "new");
    let fresh = |p: &Path| modified(p).is_some_and(|t| t >= start);
    let mut rows = Vec::new();
    for id in ids {
        let dir = dirs.get(id);
        let new_dir = dir.map(|d| d.join("new"));
        let current = match &new_dir {
            Some(n) if fresh(&n.join("estimates.json")) => {
                Some(Measured::read(n).with_context(|| format!("this run's results of {id}"))?)
            }
            _ => None,
        };
        let change = match dir.map(|d| d.join("change").join("estimates.json")) {
            Some(c) if current.is_some() && fresh(&c) => {
                let f: ChangeFile = read_json(&c)?;
                Some(Change {
                    point: f.mean.point_estimate,
                    lo: f.mean.confidence_interval.lower_bound,
                    hi: f.mean.confidence_interval.upper_bound,
                })
            }
            _ => None,
        };
        rows.push(Row { id: id.clone(), current, baseline: baseline.results.get(id).cloned(), change });
    }
    Ok(rows)
}
