//! `--wait`: follows a submitted sweep until every task has ended, printing one line per
//! finished cell (its row's status, or the Slurm state of a task that died without one);
//! SIGINT, SIGTERM or SIGHUP cancel the arrays (`scancel`) and the wait goes on until
//! Slurm has ended them. Then it reports the runner's overhead per cell.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::super::task::{self, TaskSpec, unix_now};
use super::merge::{self, Jobs, TaskState};
use crate::child::{self, Shutdown};

/// How often the row files are looked at.
const POLL: Duration = Duration::from_millis(250);
/// How often Slurm is asked.
const QUERY_EVERY: Duration = Duration::from_secs(1);
/// How long Slurm may stay unreachable before the wait gives up (the tasks go on).
const UNREACHABLE_FOR: Duration = Duration::from_secs(60);

/// When each finished cell's row was seen.
pub struct Followed {
    /// The signal that cancelled the sweep.
    pub interrupted: Option<i32>,
    /// `(cell index, Unix time its row was seen)`.
    pub seen: Vec<(usize, f64)>,
    /// Cells whose task ended without a row, each already reported with its line.
    pub lost: BTreeSet<usize>,
}

/// Cancels every array of `jobs`.
pub fn scancel(jobs: &Jobs) -> Result<()> {
    let out = Command::new("scancel").args(&jobs.job_ids).output().context("running scancel")?;
    if !out.status.success() {
        anyhow::bail!(
            "scancel {} failed: {}",
            jobs.job_ids.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Follows the sweep until no task is queued or running.
pub fn follow(run_dir: &Path, spec: &TaskSpec, jobs: &Jobs, shutdown: &Shutdown) -> Result<Followed> {
    let total = spec.plan.cells.len();
    let mut reported: BTreeSet<usize> = BTreeSet::new();
    let mut seen = Vec::new();
    let mut lost = BTreeSet::new();
    let mut interrupted = None;
    let mut last_query: Option<Instant> = None;
    let mut last_reached = Instant::now();
    let mut last_seen: BTreeMap<String, TaskState> = BTreeMap::new();
    let mut inferred: BTreeMap<String, TaskState> = BTreeMap::new();
    loop {
        if interrupted.is_none()
            && let Some(sig) = shutdown.pending()
        {
            eprintln!(
                "interrupted by {}: cancelling jobs {}",
                child::signal_name(sig),
                jobs.job_ids.join(" ")
            );
            scancel(jobs)?;
            interrupted = Some(sig);
        }
        for i in 0..total {
            if reported.contains(&i) {
                continue;
            }
            if let Some(row) = task::read_row(run_dir, i)? {
                seen.push((i, unix_now()));
                reported.insert(i);
                eprintln!(
                    "[{}/{total}] {}: {}{}",
                    reported.len(),
                    spec.plan.cells[i],
                    row.status,
                    rates(&row)
                );
            }
        }
        if last_query.is_none_or(|t| t.elapsed() >= QUERY_EVERY) {
            last_query = Some(Instant::now());
            let states = match merge::query(&jobs.job_ids) {
                Ok(s) => {
                    last_reached = Instant::now();
                    s
                }
                Err(e) if last_reached.elapsed() < UNREACHABLE_FOR => {
                    eprintln!("warning: {e:#}; asking again");
                    std::thread::sleep(POLL);
                    continue;
                }
                Err(e) => {
                    return Err(e.context(format!(
                        "Slurm was unreachable for {}s; its tasks may still be running: merge later with `cargo xtask merge {}`",
                        UNREACHABLE_FOR.as_secs(),
                        crate::shell::quote(&run_dir.display().to_string())
                    )));
                }
            };
            let active = states.values().any(|s| s.is_active());
            // A task that ended without a row: its line now, from Slurm's state.
            for i in 0..total {
                let Some(id) = jobs.task_id(spec, i) else { continue };
                let st = match states.get(&id) {
                    Some(st) => {
                        last_seen.insert(id.clone(), st.clone());
                        st.clone()
                    }
                    // Slurm drops a pending array task cancelled with scancel without a
                    // trace. Gone while its array is still queued, never seen running,
                    // and no row: it was cancelled before it started.
                    None => {
                        let job = id.split('_').next().unwrap_or_default();
                        let array_known = states.keys().any(|k| k.split('_').next() == Some(job));
                        let never_ran = last_seen.get(&id).is_none_or(|s| s.state == "PENDING");
                        if !(array_known && never_ran) || task::row_path(run_dir, i).is_file() {
                            continue;
                        }
                        let st = TaskState {
                            state: "CANCELLED".into(),
                            reason: "left the queue before it started (Slurm keeps no record of a pending array task cancelled with scancel)".into(),
                        };
                        inferred.insert(id.clone(), st.clone());
                        st
                    }
                };
                if reported.contains(&i) || st.is_active() || task::row_path(run_dir, i).is_file() {
                    continue;
                }
                reported.insert(i);
                lost.insert(i);
                let log = merge::task_log(run_dir, spec, jobs, i).map(|p| p.display().to_string());
                eprintln!(
                    "[{}/{total}] {}: {}: Slurm task {id} ended {} without a row ({}; log: {})",
                    reported.len(),
                    spec.plan.cells[i],
                    merge::lost_status(&st.state),
                    st.state,
                    if st.reason.is_empty() { "no reason given" } else { &st.reason },
                    log.unwrap_or_default()
                );
            }
            if !active {
                merge::write_inferred(run_dir, &inferred)?;
                // One last look for rows written just before the task ended.
                for i in 0..total {
                    if !reported.contains(&i) && task::row_path(run_dir, i).is_file() {
                        seen.push((i, unix_now()));
                    }
                }
                return Ok(Followed { interrupted, seen, lost });
            }
        }
        std::thread::sleep(POLL);
    }
}

fn rates(row: &super::super::rows::Row) -> String {
    match (row.decode_tok_s, row.prefill_tok_s) {
        (Some(d), Some(p)) => format!(": decode {d:.1} tok/s, prefill {p:.1} tok/s"),
        _ => String::new(),
    }
}

/// The runner's overhead per cell, from the tasks' own times: how long each task waited
/// to start (after the submission for an array's first task, after the previous task's
/// row for the others, which the `%1` throttle holds back until then), and how long after
/// its row was written the row was seen here and merged.
pub fn overhead(
    run_dir: &Path,
    spec: &TaskSpec,
    jobs: &Jobs,
    followed: &Followed,
    merged_at: f64,
) -> Option<String> {
    let times: Vec<Option<(f64, f64)>> = (0..spec.plan.cells.len())
        .map(|i| {
            let text =
                crate::fsx::read_text_bounded(&task::times_path(run_dir, i), crate::fsx::MAX_RUN_FILE_BYTES)
                    .ok()?;
            let (a, b) = text.trim().split_once(',')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .collect();
    let mut to_start = Vec::new();
    for arr in &spec.arrays {
        let mut ready = jobs.submitted_unix;
        for &i in &arr.cells {
            let Some((start, end)) = times[i] else { break };
            to_start.push(start - ready);
            ready = end;
        }
    }
    let to_seen: Vec<f64> =
        followed.seen.iter().filter_map(|&(i, at)| times[i].map(|(_, end)| at - end)).collect();
    let to_merged: Vec<f64> = times.iter().flatten().map(|&(_, end)| merged_at - end).collect();
    if to_start.is_empty() {
        return None;
    }
    let last_to_merged = to_merged.iter().copied().fold(f64::INFINITY, f64::min);
    Some(format!(
        "slurm overhead per cell ({} cells): submission or previous cell's row to task start: median {:.2} s, max {:.2} s; \
         row written to seen by --wait: median {:.2} s; last row to merged CSV: {:.2} s",
        to_start.len(),
        median(&to_start),
        to_start.iter().copied().fold(0.0, f64::max),
        median(&to_seen),
        last_to_merged
    ))
}

fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }
}
