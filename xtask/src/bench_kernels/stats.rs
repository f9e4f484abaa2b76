//! The statistics of a comparison: Welch's t-test on the two samples and criterion's rule
//! for calling a change improved, regressed or within noise.

use super::files::Row;

/// What a row says about performance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    Improved,
    Regressed,
    WithinNoise,
    NoChange,
    NoBaseline,
    NotRun,
}

impl Verdict {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Verdict::Improved => "improved",
            Verdict::Regressed => "**regressed**",
            Verdict::WithinNoise => "within noise",
            Verdict::NoChange => "no change",
            Verdict::NoBaseline => "no baseline",
            Verdict::NotRun => "did not run",
        }
    }
}

/// criterion's rule: no change unless `p < significance`; then improved (regressed) only
/// when the whole interval of the change lies below `-noise` (above `+noise`).
pub(super) fn verdict(row: &Row, noise: f64, significance: f64) -> (Verdict, Option<f64>) {
    let Some(current) = &row.current else { return (Verdict::NotRun, None) };
    let (Some(base), Some(change)) = (&row.baseline, row.change) else { return (Verdict::NoBaseline, None) };
    let p = welch_p(&current.samples, &base.samples);
    let v = match p {
        Some(p) if p < significance => {
            if change.lo < -noise && change.hi < -noise {
                Verdict::Improved
            } else if change.lo > noise && change.hi > noise {
                Verdict::Regressed
            } else {
                Verdict::WithinNoise
            }
        }
        _ => Verdict::NoChange,
    };
    (v, p)
}

/// Two-sided p-value of Welch's t-test between two samples; `None` when either has fewer
/// than two values or both have no spread.
pub(super) fn welch_p(a: &[f64], b: &[f64]) -> Option<f64> {
    let stats = |s: &[f64]| {
        let n = s.len() as f64;
        let mean = s.iter().sum::<f64>() / n;
        let var = s.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
        (n, mean, var)
    };
    if a.len() < 2 || b.len() < 2 {
        return None;
    }
    let ((na, ma, va), (nb, mb, vb)) = (stats(a), stats(b));
    let se2 = va / na + vb / nb;
    if se2 <= 0.0 {
        return if ma == mb { Some(1.0) } else { Some(0.0) };
    }
    let t = (ma - mb) / se2.sqrt();
    let df = se2 * se2 / ((va / na).powi(2) / (na - 1.0) + (vb / nb).powi(2) / (nb - 1.0));
    Some(student_t_two_sided(t, df))
}

/// `P(|T| >= |t|)` for Student's t with `df` degrees of freedom:
/// the regularized incomplete beta `I_{df / (df + t^2)}(df / 2, 1 / 2)`.
pub(super) fn student_t_two_sided(t: f64, df: f64) -> f64 {
    incomplete_beta(df / 2.0, 0.5, df / (df + t * t)).clamp(0.0, 1.0)
}

/// The regularized incomplete beta function `I_x(a, b)`, by its continued fraction
/// (modified Lentz), using the symmetry `I_x(a, b) = 1 - I_{1-x}(b, a)` where it converges
/// faster.
pub(super) fn incomplete_beta(a: f64, b: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    let ln_front = ln_gamma(a + b) - ln_gamma(a) - ln_gamma(b) + a * x.ln() + b * (1.0 - x).ln();
    if x < (a + 1.0) / (a + b + 2.0) {
        ln_front.exp() * beta_fraction(a, b, x) / a
    } else {
        1.0 - ln_front.exp() * beta_fraction(b, a, 1.0 - x) / b
    }
}

pub(super) fn beta_fraction(a: f64, b: f64, x: f64) -> f64 {
    const TINY: f64 = 1e-300;
    let mut c = 1.0;
    let mut d = 1.0 - (a + b) * x / (a + 1.0);
    if d.abs() < TINY {
        d = TINY;
    }
    d = 1.0 / d;
    let mut h = d;
    for m in 1..300 {
        let m = f64::from(m);
        let m2 = 2.0 * m;
        for num in [
            m * (b - m) * x / ((a + m2 - 1.0) * (a + m2)),
            -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1.0)),
        ] {
            d = 1.0 + num * d;
            if d.abs() < TINY {
                d = TINY;
            }
            c = 1.0 + num / c;
            if c.abs() < TINY {
                c = TINY;
            }
            d = 1.0 / d;
            h *= d * c;
        }
        if (d * c - 1.0).abs() < 1e-14 {
            break;
        }
    }
    h
}

/// `ln(Gamma(x))` for x > 0 (Lanczos, g = 7, n = 9; relative error below 1e-13).
pub(super) fn ln_gamma(x: f64) -> f64 {
    const C: [f64; 9] = [
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
        // Reflection: Gamma(x) Gamma(1 - x) = pi / sin(pi x).
        return (std::f64::consts::PI / (std::f64::consts::PI * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let t = x + 7.5;
    let sum = C[1..].iter().enumerate().fold(C[0], |s, (i, c)| s + c / (x + i as f64 + 1.0));
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + sum.ln()
}
