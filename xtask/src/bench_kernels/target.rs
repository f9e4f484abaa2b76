//! What the kernel benches are and how their runs are read, below every part of the
//! task: the bench target's names, the read-bandwidth group, how long cargo gets on a
//! signal, and criterion's benchmark list.

use std::collections::BTreeSet;
use std::time::Duration;

/// The bench target the task runs.
pub(super) const BENCH_PACKAGE: &str = "kiln-benches";
pub(super) const BENCH_TARGET: &str = "kernels";

/// The read-bandwidth benches, measured in every run (at its start and its end) so each
/// report carries the machine's limit from the same run.
pub(super) const BANDWIDTH_GROUP: &str = "read_bandwidth";

/// The compute-roof benches (`compute_roof/<probe>/t<threads>`), measured in every run
/// right after the first read-bandwidth reading; their throughput is in operations.
pub(super) const COMPUTE_GROUP: &str = "compute_roof";

/// `(probe, threads)` of a compute-roof id (`compute_roof/<probe>/t<threads>`).
pub(super) fn compute_roof_id(id: &str) -> Option<(&str, usize)> {
    let rest = id.strip_prefix(COMPUTE_GROUP)?.strip_prefix('/')?;
    let (probe, t) = rest.split_once('/')?;
    Some((probe, t.strip_prefix('t')?.parse().ok()?))
}

/// criterion's filter for `filter` with the machine's roofs added, which every run
/// measures whatever it filters.
pub(super) fn with_roofs(filter: &str) -> String {
    format!("(?:{filter})|^{BANDWIDTH_GROUP}/|^{COMPUTE_GROUP}/")
}

/// How long cargo and criterion get to end on SIGTERM before their group is killed.
pub(super) const CARGO_GRACE: Duration = Duration::from_secs(5);

/// Ids from criterion's `--list` output (`<id>: benchmark` lines), in a stable order.
pub(super) fn parse_list(out: &str) -> Vec<String> {
    let ids: BTreeSet<String> =
        out.lines().filter_map(|l| l.trim().strip_suffix(": benchmark")).map(str::to_string).collect();
    ids.into_iter().collect()
}
