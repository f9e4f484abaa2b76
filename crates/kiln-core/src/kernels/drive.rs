//! Splitting a product's output rows (weight rows) into rayon tasks. Every kernel runs
//! through here, so they all thread the same way: contiguous ranges of weight rows, each
//! task streaming its own slice of the matrix.

use std::ops::Range;

use rayon::prelude::*;

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
}
