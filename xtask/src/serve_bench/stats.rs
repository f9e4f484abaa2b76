//! Per-level statistics of serve-bench: the percentile method and the summary of one
//! latency series (mean, median, p90, p95, p99).
//!
//! Percentiles use linear interpolation between the closest ranks (Hyndman and Fan's
//! type 7, the default of NumPy's `percentile` and R's `quantile`): for `n` sorted values
//! the p-th percentile sits at rank `h = (n - 1) * p / 100` (0-based) and is
//! `x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)])`. One value is every
//! percentile of itself; no values have none.

use serde::Serialize;

/// The p-th percentile (0 to 100) of `sorted`, ascending, by linear interpolation
/// between the closest ranks; `None` when empty.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let n = sorted.len();
    if n == 0 {
        return None;
    }
    let h = (n - 1) as f64 * (p.clamp(0.0, 100.0) / 100.0);
    let lo = h.floor() as usize;
    let hi = (lo + 1).min(n - 1);
    Some(sorted[lo] + (h - lo as f64) * (sorted[hi] - sorted[lo]))
}

/// The summary of one series, in milliseconds for latencies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Values summarised.
    pub n: usize,
    /// Arithmetic mean.
    pub mean: Option<f64>,
    /// 50th percentile.
    pub median: Option<f64>,
    /// 90th percentile.
    pub p90: Option<f64>,
    /// 95th percentile.
    pub p95: Option<f64>,
    /// 99th percentile.
    pub p99: Option<f64>,
}

impl Summary {
    /// Summarises `values` (any order; non-finite values are dropped).
    pub fn of(values: impl IntoIterator<Item = f64>) -> Summary {
        let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let mean = (n > 0).then(|| v.iter().sum::<f64>() / n as f64);
        Summary {
            n,
            mean,
            median: percentile(&v, 50.0),
            p90: percentile(&v, 90.0),
            p95: percentile(&v, 95.0),
            p99: percentile(&v, 99.0),
        }
    }

    /// The five statistics in column order: mean, median, p90, p95, p99.
    pub fn columns(&self) -> [Option<f64>; 5] {
        [self.mean, self.median, self.p90, self.p95, self.p99]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: Option<f64>, b: f64) {
        let a = a.expect("a value");
        assert!((a - b).abs() < 1e-9, "{a} != {b}");
    }

    #[test]
    fn percentiles_match_numpy_linear_interpolation() {
        // numpy.percentile([1, 2, 3, 4], 50) == 2.5; ([1..10], 90) == 9.1;
        // ([1..100], 99) == 99.01; ([15, 20, 35, 40, 50], 40) == 29.0.
        close(percentile(&[1.0, 2.0, 3.0, 4.0], 50.0), 2.5);
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        close(percentile(&ten, 90.0), 9.1);
        close(percentile(&ten, 0.0), 1.0);
        close(percentile(&ten, 100.0), 10.0);
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        close(percentile(&hundred, 99.0), 99.01);
        close(percentile(&[15.0, 20.0, 35.0, 40.0, 50.0], 40.0), 29.0);
        close(percentile(&[7.0], 99.0), 7.0);
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn a_summary_sorts_and_drops_non_finite_values() {
        let s = Summary::of([4.0, f64::NAN, 1.0, 3.0, 2.0]);
        assert_eq!(s.n, 4);
        close(s.mean, 2.5);
        close(s.median, 2.5);
        close(s.p90, 3.7);
        close(s.p99, 3.97);
        let e = Summary::of([]);
        assert_eq!((e.n, e.mean, e.p99), (0, None, None));
    }
}
