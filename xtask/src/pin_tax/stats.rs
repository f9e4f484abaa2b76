//! The statistics of the tax: the paired t interval on log ratios (Student's t from
//! [`crate::student_t`]), and an arm's spread.
//!
//! Method: each ABBA pair (the k-th narrow boot with the k-th wide boot) gives one log
//! ratio `ln(narrow / wide)` of the boots' means. The tax is `exp(mean)` of those, and
//! its 95% interval `exp(mean ± t(0.975, n - 1) * sd / sqrt(n))`: a paired t interval on
//! log ratios, so the interval is multiplicative and a boot-to-boot drift shared by both
//! arms of a pair cancels.

use crate::student_t::t_quantile;

/// A paired t interval on the differences `d` (for the tax: log ratios).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PairedT {
    /// Pairs.
    pub n: usize,
    /// Mean difference.
    pub mean: f64,
    /// Sample standard deviation (n - 1).
    pub sd: f64,
    /// The t statistic of mean against zero.
    pub t: f64,
    /// The 95% interval, when n >= 2.
    pub ci95: Option<(f64, f64)>,
}

/// The paired t summary of `d`; `None` when empty.
pub fn paired_t(d: &[f64]) -> Option<PairedT> {
    let n = d.len();
    if n == 0 {
        return None;
    }
    let mean = d.iter().sum::<f64>() / n as f64;
    if n < 2 {
        return Some(PairedT { n, mean, sd: f64::NAN, t: f64::NAN, ci95: None });
    }
    let sd = (d.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt();
    let se = sd / (n as f64).sqrt();
    let q = t_quantile(0.975, (n - 1) as f64);
    Some(PairedT { n, mean, sd, t: mean / se, ci95: Some((mean - q * se, mean + q * se)) })
}

/// The tax ratio and its interval from (narrow, wide) boot means.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ratio {
    /// Pairs.
    pub pairs: usize,
    /// narrow / wide: the geometric mean of the pairs' ratios.
    pub ratio: f64,
    /// Its 95% interval, when there are two pairs or more.
    pub ci95: Option<(f64, f64)>,
}

/// The narrow/wide ratio of paired boot means.
pub fn ratio(pairs: &[(f64, f64)]) -> Option<Ratio> {
    let logs: Vec<f64> =
        pairs.iter().filter(|(n, w)| *n > 0.0 && *w > 0.0).map(|(n, w)| (n / w).ln()).collect();
    let p = paired_t(&logs)?;
    Some(Ratio { pairs: p.n, ratio: p.mean.exp(), ci95: p.ci95.map(|(lo, hi)| (lo.exp(), hi.exp())) })
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
    use crate::student_t::ln_gamma;

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
        // t = 4.0621, df = 9, 95% CI 0.7001142 to 2.4598858, mean difference 1.58.
        let d = [1.2, 2.4, 1.3, 1.3, 0.0, 1.0, 1.8, 0.8, 4.6, 1.4];
        let p = paired_t(&d).unwrap();
        assert_eq!(p.n, 10);
        assert!((p.mean - 1.58).abs() < 1e-12);
        assert!((p.t - 4.0621).abs() < 1e-4, "{}", p.t);
        let (lo, hi) = p.ci95.unwrap();
        assert!((lo - 0.700_114_2).abs() < 1e-6, "{lo}");
        assert!((hi - 2.459_885_8).abs() < 1e-6, "{hi}");
    }

    #[test]
    fn ratios_are_geometric_and_need_two_pairs_for_an_interval() {
        let r = ratio(&[(90.0, 100.0)]).unwrap();
        assert_eq!(r.pairs, 1);
        assert!((r.ratio - 0.9).abs() < 1e-12);
        assert_eq!(r.ci95, None);
        // Ratios 0.5 and 2 average to 1 in log space.
        let r = ratio(&[(50.0, 100.0), (200.0, 100.0)]).unwrap();
        assert!((r.ratio - 1.0).abs() < 1e-12);
        let (lo, hi) = r.ci95.unwrap();
        assert!(lo < 1.0 && hi > 1.0);
        assert!((lo * hi - 1.0).abs() < 1e-9, "the interval is symmetric in log space");
        assert_eq!(ratio(&[]), None);
        assert_eq!(spread_pct(&[99.0, 101.0]), Some(2.0));
        assert_eq!(spread_pct(&[1.0]), None);
    }
}
