//! The tax's statistics, as thin wrappers: a ratio of paired boot means is a
//! [`Reading`] (`verdict::reading`: geometric mean, 95% interval on the logs, n), and an
//! arm's spread is checked against the trust limit.
//!
//! Method: each ABBA pair (the k-th boot of one arm with the k-th of the other) gives one
//! ratio of the boots' means; the reading is their geometric mean with the paired t
//! interval on their logs (or, with `--until-ci`, the confidence sequence's), so the
//! interval is multiplicative and a boot-to-boot drift shared by both arms of a pair
//! cancels.

use crate::verdict::reading::{Method, Reading};

/// The reading of the ratios `num / den` of paired boot means.
pub fn ratio(pairs: &[(f64, f64)], sequential: bool) -> Option<Reading> {
    Reading::of_pairs(pairs, if sequential { Method::Sequence } else { Method::T })
}

/// An arm's spread: (max - min) / mean of its samples, in percent; `None` under two.
pub fn spread_pct(samples: &[f64]) -> Option<f64> {
    if samples.len() < 2 {
        return None;
    }
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    let max = samples.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let min = samples.iter().copied().fold(f64::INFINITY, f64::min);
    (mean > 0.0).then(|| 100.0 * (max - min) / mean)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verdict::student_t::{ln_gamma, t_quantile};

    #[test]
    fn t_quantiles_match_the_published_table() {
        // Two-sided 95% critical values of Student's t (any statistics table).
        let table = [
            (1.0, 12.706),
            (2.0, 4.303),
            (3.0, 3.182),
            (4.0, 2.776),
            (5.0, 2.571),
            (7.0, 2.365),
            (9.0, 2.262),
            (10.0, 2.228),
            (20.0, 2.086),
            (30.0, 2.042),
            (120.0, 1.980),
        ];
        for (df, want) in table {
            let got = t_quantile(0.975, df);
            assert!((got - want).abs() < 5e-4, "df {df}: {got} != {want}");
        }
        assert!((t_quantile(0.95, 10.0) - 1.812).abs() < 5e-4);
        assert!((t_quantile(0.995, 5.0) - 4.032).abs() < 5e-4);
        // Γ(5) = 24, Γ(1/2) = √π.
        assert!((ln_gamma(5.0) - 24f64.ln()).abs() < 1e-12);
        assert!((ln_gamma(0.5) - std::f64::consts::PI.sqrt().ln()).abs() < 1e-12);
    }

    #[test]
    fn the_paired_t_interval_matches_students_sleep_data() {
        // Cushny and Peebles' sleep data as in R's `sleep`: the extra hours of drug 2
        // minus drug 1 for ten patients. R's t.test(..., paired = TRUE) reports
        // 95% CI 0.7001142 to 2.4598858, mean difference 1.58.
        let d = [1.2, 2.4, 1.3, 1.3, 0.0, 1.0, 1.8, 0.8, 4.6, 1.4];
        let p = crate::verdict::student_t::interval(&d).unwrap();
        assert_eq!(p.n, 10);
        assert!((p.mean - 1.58).abs() < 1e-12);
        let (lo, hi) = p.ci95.unwrap();
        assert!((lo - 0.700_114_2).abs() < 1e-6, "{lo}");
        assert!((hi - 2.459_885_8).abs() < 1e-6, "{hi}");
    }

    #[test]
    fn ratios_are_geometric_and_need_two_pairs_for_an_interval() {
        let r = ratio(&[(90.0, 100.0)], false).unwrap();
        assert_eq!(r.n, 1);
        assert!((r.estimate - 0.9).abs() < 1e-12);
        assert_eq!(r.interval, None);
        // Ratios 0.5 and 2 average to 1 in log space.
        let r = ratio(&[(50.0, 100.0), (200.0, 100.0)], false).unwrap();
        assert!((r.estimate - 1.0).abs() < 1e-12);
        let (lo, hi) = r.interval.unwrap();
        assert!(lo < 1.0 && hi > 1.0);
        assert!((lo * hi - 1.0).abs() < 1e-9, "the interval is symmetric in log space");
        assert_eq!(ratio(&[], false), None);
        assert_eq!(spread_pct(&[99.0, 101.0]), Some(2.0));
        assert_eq!(spread_pct(&[1.0]), None);
    }
}
