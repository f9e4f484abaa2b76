//! Student's t distribution for the harness's statistics: its CDF, two-sided p-value and
//! quantiles, from the regularized incomplete beta function (one implementation shared
//! by bench-kernels' Welch test and qmv-pin-tax's paired interval).

/// ln Γ(x) for x > 0 (Lanczos, g = 7, n = 9; about 15 significant digits).
pub fn ln_gamma(x: f64) -> f64 {
    const G: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // Reflection: Γ(x) Γ(1 - x) = π / sin(πx).
        return (std::f64::consts::PI / (std::f64::consts::PI * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut a = G[0];
    let t = x + 7.5;
    for (i, g) in G.iter().enumerate().skip(1) {
        a += g / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// The regularized incomplete beta function I_x(a, b).
pub fn inc_beta(a: f64, b: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    let front = (ln_gamma(a + b) - ln_gamma(a) - ln_gamma(b) + a * x.ln() + b * (1.0 - x).ln()).exp();
    if x < (a + 1.0) / (a + b + 2.0) {
        front * beta_cf(a, b, x) / a
    } else {
        1.0 - front * beta_cf(b, a, 1.0 - x) / b
    }
}

/// The continued fraction of the incomplete beta function (modified Lentz).
fn beta_cf(a: f64, b: f64, x: f64) -> f64 {
    const TINY: f64 = 1e-300;
    let fix = |v: f64| if v.abs() < TINY { TINY } else { v };
    let (qab, qap, qam) = (a + b, a + 1.0, a - 1.0);
    let mut c = 1.0;
    let mut d = 1.0 / fix(1.0 - qab * x / qap);
    let mut h = d;
    for m in 1..=300 {
        let m = f64::from(m);
        let m2 = 2.0 * m;
        let aa = m * (b - m) * x / ((qam + m2) * (a + m2));
        d = 1.0 / fix(1.0 + aa * d);
        c = fix(1.0 + aa / c);
        h *= d * c;
        let aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2));
        d = 1.0 / fix(1.0 + aa * d);
        c = fix(1.0 + aa / c);
        let del = d * c;
        h *= del;
        if (del - 1.0).abs() < 1e-15 {
            break;
        }
    }
    h
}

/// P(T <= t) for Student's t with `df` degrees of freedom.
pub fn t_cdf(t: f64, df: f64) -> f64 {
    let tail = 0.5 * inc_beta(df / 2.0, 0.5, df / (df + t * t));
    if t >= 0.0 { 1.0 - tail } else { tail }
}

/// The `p` quantile (0.5 < p < 1) of Student's t with `df` degrees of freedom, by
/// bisection on the CDF to 1e-12.
pub fn t_quantile(p: f64, df: f64) -> f64 {
    let (mut lo, mut hi) = (0.0, 1e4);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if t_cdf(mid, df) < p {
            lo = mid;
        } else {
            hi = mid;
        }
        if hi - lo < 1e-12 {
            break;
        }
    }
    0.5 * (lo + hi)
}

/// `P(|T| >= |t|)` for Student's t with `df` degrees of freedom:
/// the regularized incomplete beta `I_{df / (df + t^2)}(df / 2, 1 / 2)`.
pub fn two_sided_p(t: f64, df: f64) -> f64 {
    inc_beta(df / 2.0, 0.5, df / (df + t * t)).clamp(0.0, 1.0)
}
/// A sample's mean, standard deviation and the two-sided 95% confidence interval of the
/// mean from Student's t (`n - 1` degrees of freedom); no interval below two values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Interval {
    /// How many values.
    pub n: usize,
    /// Their mean.
    pub mean: f64,
    /// Their sample standard deviation (`n - 1`); 0 for one value.
    pub sd: f64,
    /// The interval's ends, `None` for fewer than two values.
    pub ci95: Option<(f64, f64)>,
}

/// The [`Interval`] of `xs`; `None` when `xs` is empty.
pub fn interval(xs: &[f64]) -> Option<Interval> {
    let n = xs.len();
    if n == 0 {
        return None;
    }
    let mean = xs.iter().sum::<f64>() / n as f64;
    if n == 1 {
        return Some(Interval { n, mean, sd: 0.0, ci95: None });
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let sd = var.sqrt();
    let half = t_quantile(0.975, (n - 1) as f64) * sd / (n as f64).sqrt();
    Some(Interval { n, mean, sd, ci95: Some((mean - half, mean + half)) })
}

impl Interval {
    /// Whether the interval has no width although it has two values or more: every value
    /// was the same (a quantized or saturated measurement, or too few values), so it says
    /// nothing about the spread and must be flagged, never read as certainty.
    #[cfg(test)]
    pub fn zero_width(&self) -> bool {
        self.ci95.is_some_and(|(lo, hi)| lo == hi)
    }
}

/// What a printed zero-width interval carries beside it.
pub const ZERO_WIDTH: &str = "zero width: every value equal, no measured spread";

/// A positive quantity (a rate) as its geometric mean with the 95% interval of the mean of
/// its logs mapped back with `exp`, so the interval is multiplicative and never goes below
/// zero as an interval of the raw values can (`sd` is of the logs). Non-positive values
/// are left out; `None` when none is left.
pub fn log_interval(xs: &[f64]) -> Option<Interval> {
    let logs: Vec<f64> = xs.iter().filter(|x| **x > 0.0 && x.is_finite()).map(|x| x.ln()).collect();
    let i = interval(&logs)?;
    Some(Interval { mean: i.mean.exp(), ci95: i.ci95.map(|(lo, hi)| (lo.exp(), hi.exp())), ..i })
}

/// The ratio of paired samples as a geometric mean with its 95% interval: the
/// [`Interval`] of `ln(a_i / b_i)`, mapped back with `exp` (so `sd` is of the logs).
/// Pairs with a non-positive side are left out.
pub fn paired_ratio(pairs: &[(f64, f64)]) -> Option<Interval> {
    let logs: Vec<f64> =
        pairs.iter().filter(|(a, b)| *a > 0.0 && *b > 0.0).map(|(a, b)| (a / b).ln()).collect();
    let i = interval(&logs)?;
    Some(Interval { mean: i.mean.exp(), ci95: i.ci95.map(|(lo, hi)| (lo.exp(), hi.exp())), ..i })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interval_uses_the_published_t_quantile() {
        // t(0.975, 2) = 4.302653 (published tables); values 9, 10, 11: sd 1.
        let i = interval(&[9.0, 10.0, 11.0]).unwrap();
        assert_eq!((i.n, i.mean, i.sd), (3, 10.0, 1.0));
        let (lo, hi) = i.ci95.unwrap();
        let half = 4.302653 / 3f64.sqrt();
        assert!((lo - (10.0 - half)).abs() < 1e-5 && (hi - (10.0 + half)).abs() < 1e-5, "{lo} {hi}");
        let one = interval(&[7.0]).unwrap();
        assert_eq!((one.mean, one.sd, one.ci95), (7.0, 0.0, None));
        assert!(interval(&[]).is_none());
    }

    #[test]
    fn an_interval_of_rates_on_their_logs_stays_positive() {
        // Rates 600, 9000, 14000 tok/s: the interval of the raw values is
        // 7867 ± 4.303 * 6730 / sqrt(3), which goes below zero; on the logs it cannot.
        let raw = interval(&[600.0, 9000.0, 14000.0]).unwrap();
        assert!(raw.ci95.unwrap().0 < 0.0, "{raw:?}");
        let r = log_interval(&[600.0, 9000.0, 14000.0]).unwrap();
        let (lo, hi) = r.ci95.unwrap();
        assert!(lo > 0.0 && lo < r.mean && r.mean < hi, "{r:?}");
        assert!((r.mean - (600.0f64 * 9000.0 * 14000.0).cbrt()).abs() < 1e-6, "{}", r.mean);
        assert!((lo * hi - r.mean * r.mean).abs() < 1e-6 * r.mean * r.mean, "symmetric in log space");
        assert_eq!(log_interval(&[0.0, -1.0]), None);
        assert!(log_interval(&[5.0, 5.0]).unwrap().zero_width());
        assert!(!r.zero_width() && !log_interval(&[5.0]).unwrap().zero_width());
    }

    #[test]
    fn a_paired_ratio_is_a_geometric_mean_with_its_interval() {
        let r = paired_ratio(&[(2.0, 1.0), (8.0, 2.0), (0.0, 1.0)]).unwrap();
        assert_eq!(r.n, 2, "the pair with a zero is left out");
        assert!((r.mean - 8f64.sqrt()).abs() < 1e-12, "{}", r.mean);
        let (lo, hi) = r.ci95.unwrap();
        assert!(lo < r.mean && r.mean < hi);
        // Equal pairs: ratio 1 with a zero-width interval.
        let same = paired_ratio(&[(3.0, 3.0), (5.0, 5.0)]).unwrap();
        assert_eq!((same.mean, same.ci95), (1.0, Some((1.0, 1.0))));
    }
}
