//! Splitting a product's output rows (weight rows) into rayon tasks. Every kernel runs
//! through here, so they all thread the same way: contiguous ranges of weight rows, each
//! task streaming its own slice of the matrix.

use std::ops::Range;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::part::QmvPart;
#[cfg(target_arch = "x86_64")]
use crate::matrix::{LANE_ROWS, Layout, QuantizedMatrix};

/// Bytes of weights one task aims to read: large enough that task overhead is noise,
/// small enough that two threads balance on the smallest benchmarked matrix.
const TASK_BYTES: usize = 128 << 10;

/// Tasks per thread, at least, when the matrix has rows enough.
const TASKS_PER_THREAD: usize = 8;

/// Rows per task for `n` rows of `row_bytes` bytes each on the current rayon pool.
pub(crate) fn rows_per_task(n: usize, row_bytes: usize) -> usize {
    let by_bytes = (TASK_BYTES / row_bytes.max(1)).max(1);
    let by_balance = n.div_ceil(rayon::current_num_threads() * TASKS_PER_THREAD).max(1);
    by_bytes.min(by_balance)
}

/// Runs `f(rows, out)` over `y` (one output per weight row) in chunks of `rows_per_task`.
/// (Only the AVX2 `qmv` has a one-row path of its own.)
#[cfg(any(target_arch = "x86_64", test))]
pub(crate) fn rows(y: &mut [f32], rows_per_task: usize, f: impl Fn(Range<usize>, &mut [f32]) + Sync) {
    y.par_chunks_mut(rows_per_task).enumerate().for_each(|(t, out)| {
        let r0 = t * rows_per_task;
        f(r0..r0 + out.len(), out);
    });
}

/// Runs `f(rows, outs)` over `y[m, n]` in chunks of `rows_per_task` weight rows; `outs[i]`
/// is the piece of output row `i` those weight rows produce.
pub(crate) fn rows_multi(
    y: &mut [f32],
    m: usize,
    n: usize,
    rows_per_task: usize,
    f: impl Fn(Range<usize>, &mut [&mut [f32]]) + Sync,
) {
    debug_assert_eq!(y.len(), m * n);
    let tasks = n.div_ceil(rows_per_task);
    let mut per_task: Vec<Vec<&mut [f32]>> = (0..tasks).map(|_| Vec::with_capacity(m)).collect();
    for yrow in y.chunks_exact_mut(n) {
        for (t, piece) in yrow.chunks_mut(rows_per_task).enumerate() {
            per_task[t].push(piece);
        }
    }
    per_task.into_par_iter().enumerate().for_each(|(t, mut outs)| {
        let r0 = t * rows_per_task;
        let len = outs.first().map_or(0, |o| o.len());
        f(r0..r0 + len, &mut outs);
    });
}

/// Bytes of weights one task of [`parts`] reads at least (unless the products are smaller
/// than one task per thread). The wake-up of a sleeping worker is paid once per region,
/// whatever its task count; each further task costs a steal, well under a microsecond,
/// about what one thread takes to stream 16 KiB at 20 GB/s. So the region keeps
/// [`TASKS_PER_THREAD`] tasks per thread, which lets a thread that is descheduled on a
/// loaded machine hold up only a small task, down to this floor. (The per-product split,
/// [`rows_per_task`], cuts smollm-135m's 576x576 projections into 16 tasks of 13 KiB; in
/// one region with k and v they become 16 tasks of 22 KiB.)
#[cfg(any(target_arch = "x86_64", test))]
const MIN_TASK_BYTES: usize = 16 << 10;

/// Tasks for a region reading `bytes` of weights on `threads` threads: as many as
/// [`TASK_BYTES`] asks for, at most [`TASKS_PER_THREAD`] per thread, none under
/// [`MIN_TASK_BYTES`] when there are enough bytes for one per thread, and a multiple of
/// `threads` so equal tasks end together.
#[cfg(any(target_arch = "x86_64", test))]
fn region_tasks(bytes: usize, threads: usize) -> usize {
    let wanted = bytes.div_ceil(TASK_BYTES).max(threads * TASKS_PER_THREAD);
    let affordable = (bytes / MIN_TASK_BYTES).max(threads);
    wanted.min(affordable).next_multiple_of(threads)
}

/// Runs `f(w, bias, rows, out)` over every part's rows in one parallel region: the rows of
/// all the matrices are cut into tasks of about the same bytes (a part's rows never share
/// a task with another part's), so products that read the same activations wake the pool
/// once between them. On a one-thread pool everything runs on the caller, with no tasks.
#[cfg(target_arch = "x86_64")]
pub(crate) fn parts(
    parts: &mut [QmvPart<'_>],
    f: impl Fn(&QuantizedMatrix, Option<&[f32]>, Range<usize>, &mut [f32]) + Sync,
) {
    let threads = rayon::current_num_threads();
    if threads == 1 {
        for p in parts.iter_mut() {
            f(p.w, p.bias, 0..p.w.n(), p.y);
        }
        return;
    }
    let bytes: usize = parts.iter().map(|p| p.w.bytes_read()).sum();
    let per_task = bytes.div_ceil(region_tasks(bytes, threads)).max(1);
    let mut tasks = Vec::new();
    for p in parts.iter_mut() {
        let row_bytes = (p.w.bytes_read() / p.w.n().max(1)).max(1);
        // A lane-row matrix is read in whole blocks of 16 rows.
        let rows = (per_task / row_bytes).max(1);
        let rows = if p.w.layout() == Layout::LaneRows { rows.next_multiple_of(LANE_ROWS) } else { rows };
        let (w, bias) = (p.w, p.bias);
        for (t, out) in p.y.chunks_mut(rows).enumerate() {
            tasks.push((w, bias, t * rows, out));
        }
    }
    tasks.into_par_iter().for_each(|(w, bias, r0, out)| {
        let len = out.len();
        f(w, bias, r0..r0 + len, out);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_output_is_visited_once_with_its_row() {
        let (m, n) = (3, 37);
        let mut y = vec![0f32; m * n];
        rows_multi(&mut y, m, n, 5, |rows, outs| {
            assert_eq!(outs.len(), m);
            for (i, o) in outs.iter_mut().enumerate() {
                for (r, v) in rows.clone().zip(o.iter_mut()) {
                    *v += (i * 1000 + r) as f32;
                }
            }
        });
        for i in 0..m {
            for r in 0..n {
                assert_eq!(y[i * n + r], (i * 1000 + r) as f32);
            }
        }
        let mut v = vec![0f32; n];
        rows(&mut v, 4, |rows, out| {
            for (r, o) in rows.zip(out) {
                *o += r as f32;
            }
        });
        assert!(v.iter().enumerate().all(|(r, &o)| o == r as f32));
        assert!(rows_per_task(10, 1 << 20) >= 1);
    }

    #[test]
    fn regions_split_into_whole_rounds_of_affordable_tasks() {
        // smollm-135m's q|k|v at 2 threads: 960 rows of 360 bytes; o_proj alone.
        assert_eq!(region_tasks(960 * 360, 2), 16);
        assert_eq!(region_tasks(576 * 360, 2), 12);
        // Tiny products still give every thread a task.
        assert_eq!(region_tasks(1000, 2), 2);
        assert_eq!(region_tasks(1000, 3), 3);
        // Large ones are capped by TASK_BYTES, not by the per-thread count.
        assert_eq!(region_tasks(64 << 20, 2), 512);
        for bytes in [1, 100_000, 5 << 20] {
            for threads in 1..5 {
                assert_eq!(region_tasks(bytes, threads) % threads, 0);
            }
        }
    }
}
