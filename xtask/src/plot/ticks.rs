//! Where an axis puts its ticks and how it labels them: nice steps on linear axes, whole
//! numbers on integer axes, the values that occur on log axes, and labels that are unique.

/// A step of 1, 2, 2.5 or 5 times a power of ten, near `span / target`.
pub fn nice_step(span: f64, target: usize) -> f64 {
    let raw = (span / target.max(1) as f64).abs().max(f64::MIN_POSITIVE);
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let n = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 2.5 {
        2.5
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    n * mag
}

/// An integer step from 1, 2, 5, 10, 20, 25, 50, ...: never below 1, never fractional.
pub fn integer_step(span: f64, target: usize) -> f64 {
    let s = nice_step(span, target);
    if s <= 1.0 {
        1.0
    } else if s == 2.5 {
        2.0
    } else {
        s.round()
    }
}

/// The multiples of `step` in `[lo, hi]`.
pub fn multiples(lo: f64, hi: f64, step: f64) -> Vec<f64> {
    let first = (lo / step - 1e-9).ceil() as i64;
    let last = (hi / step + 1e-9).floor() as i64;
    (first..=last).map(|k| clean(k as f64 * step)).collect()
}

/// Rounds away the binary noise of `k * step` (0.30000000000000004) and negative zero.
fn clean(v: f64) -> f64 {
    let r = (v * 1e9).round() / 1e9;
    if r == 0.0 { 0.0 } else { r }
}

/// Ticks on a log axis with no values to label: the powers of ten in `[lo, hi]`, and
/// 2 and 5 times them when fewer than three powers fall inside, and nice linear steps
/// when even those give fewer than two.
pub fn decades(lo: f64, hi: f64) -> Vec<f64> {
    let (a, b) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    let inside = |v: &f64| *v >= lo * (1.0 - 1e-9) && *v <= hi * (1.0 + 1e-9);
    let pow: Vec<f64> = (a..=b).map(|e| 10f64.powi(e)).filter(inside).collect();
    if pow.len() >= 3 {
        return pow;
    }
    let t: Vec<f64> =
        (a..=b).flat_map(|e| [1.0, 2.0, 5.0].map(|m| m * 10f64.powi(e))).filter(inside).collect();
    if t.len() >= 2 {
        return t;
    }
    // A range within a factor of 2.5 (ratios around 1): nice linear steps inside it.
    multiples(lo, hi, nice_step(hi - lo, 5)).into_iter().filter(|v| *v > 0.0).collect()
}

/// Labels for increasing tick values: the fewest decimals that tell every tick apart and
/// write each one exactly (to within a thousandth of the smallest gap).
pub fn labels(values: &[f64]) -> Vec<String> {
    let gap = values.windows(2).map(|w| (w[1] - w[0]).abs()).fold(f64::INFINITY, f64::min);
    let tol = if gap.is_finite() && gap > 0.0 { gap * 1e-3 } else { 1e-9 };
    for decimals in 0..=9 {
        let ls: Vec<String> = values.iter().map(|v| number(*v, decimals)).collect();
        let exact = values.iter().zip(&ls).all(|(v, l)| l.parse::<f64>().is_ok_and(|p| (p - v).abs() <= tol));
        let mut unique = ls.clone();
        unique.sort();
        unique.dedup();
        if exact && unique.len() == ls.len() {
            return ls;
        }
    }
    values.iter().map(|v| format!("{v}")).collect()
}

/// Labels for a log axis: each value on its own terms, so 0.001 and 1000 sit on one axis
/// as `0.001` and `1000`, and values beyond them in exponent form (`1e-8`, `2e6`).
pub fn log_labels(values: &[f64]) -> Vec<String> {
    values
        .iter()
        .map(|v| if (1e-3..1e6).contains(&v.abs()) { labels(&[*v]).remove(0) } else { format!("{v:e}") })
        .collect()
}

/// `v` with `decimals` decimals, never `-0`.
pub fn number(v: f64, decimals: usize) -> String {
    let s = format!("{v:.decimals$}");
    if s.trim_start_matches('-').chars().all(|c| c == '0' || c == '.') {
        s.trim_start_matches('-').to_string()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_unique_exact_and_as_short_as_that_allows() {
        assert_eq!(labels(&[0.0, 0.25, 0.5, 0.75, 1.0]), ["0.00", "0.25", "0.50", "0.75", "1.00"]);
        assert_eq!(labels(&[128.0, 512.0, 2048.0]), ["128", "512", "2048"]);
        assert_eq!(labels(&[0.98, 1.0, 1.02]), ["0.98", "1.00", "1.02"]);
        assert_eq!(labels(&[-0.0000001, 1.0]), ["0", "1"]);
        // What the old `{:.0}` did to 2^k ticks: "1 1 1 2 3 4 6 8 11".
        let pow: Vec<f64> = (0..8).map(|k| 2f64.powf(k as f64 * 0.5)).collect();
        let ls = labels(&pow);
        let mut u = ls.clone();
        u.dedup();
        assert_eq!(u.len(), ls.len(), "{ls:?}");
    }

    #[test]
    fn log_labels_take_each_decade_on_its_own_terms() {
        assert_eq!(
            log_labels(&[1e-8, 1e-5, 0.01, 1.0, 2048.0, 5e6]),
            ["1e-8", "1e-5", "0.01", "1", "2048", "5e6"]
        );
    }

    #[test]
    fn integer_axes_step_by_whole_numbers() {
        for span in [1.0, 3.0, 6.0, 7.0, 12.0, 40.0, 250.0] {
            let s = integer_step(span, 5);
            assert!(s >= 1.0 && s.fract() == 0.0, "{span}: {s}");
        }
        assert_eq!(multiples(0.5, 4.5, 1.0), [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(multiples(0.0, 0.3, 0.1), [0.0, 0.1, 0.2, 0.3]);
    }

    #[test]
    fn nice_steps_and_decades() {
        assert_eq!(nice_step(3500.0, 5), 1000.0);
        assert_eq!(nice_step(1.0, 5), 0.2);
        assert_eq!(decades(1.0, 5000.0), [1.0, 10.0, 100.0, 1000.0]);
        assert_eq!(decades(3.0, 60.0), [5.0, 10.0, 20.0, 50.0]);
    }
}
