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
    Some(crate::verdict::student_t::two_sided_p(t, df))
}
