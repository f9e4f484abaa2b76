//! Equivalence verdicts at a margin: two one-sided tests (Schuirmann, "A comparison of the
//! two one-sided tests procedure and the power approach for assessing the equivalence of
//! average bioavailability", Journal of Pharmacokinetics and Biopharmaceutics 15(6),
//! 1987) on the mean log ratio.
//!
//! `--margin PCT` bounds the ratio to `[1 / (1 + PCT/100), 1 + PCT/100]`, symmetric on
//! the logs, so the verdict does not depend on which arm is the numerator (25% gives the
//! classical 0.80 to 1.25). A ratio whose whole interval lies inside is `equivalent
//! within PCT`: both one-sided tests reject a difference beyond the margin, each at 5%,
//! which for a fixed number of pairs is the 90% t interval inside the bounds. One whose
//! whole interval lies outside `differs` (by more than the margin). Otherwise it is
//! `undecided`, with the pairs that would likely settle it if the estimate and its
//! spread held. With `--until-ci` the interval is the confidence sequence's 95% one
//! ([`super::sequence`]), each of whose sides errs at most 5% at any stopping time.

use crate::student_t::{Interval, interval, t_quantile};

/// The verdict at a margin.
#[derive(Clone, Debug, PartialEq)]
pub enum Equivalence {
    /// The whole interval lies inside the margin.
    Equivalent,
    /// The whole interval lies outside it.
    Differs,
    /// Neither: `pairs` in all would likely settle it (`None`: the estimate sits on the
    /// margin, or there is no interval yet to extrapolate from).
    Undecided { pairs: Option<usize> },
}

/// The equivalence bounds of a ratio at `margin_pct`.
pub fn bounds(margin_pct: f64) -> (f64, f64) {
    let hi = 1.0 + margin_pct / 100.0;
    (1.0 / hi, hi)
}

/// The verdict of `ratio` (a geometric mean with its interval, `sd` of the logs) at
/// `margin_pct`; `half_at(n)` is the interval's half-width on the logs per unit of `sd`
/// at `n` pairs, used to say how many pairs would likely settle an undecided one.
pub fn judge(ratio: &Interval, margin_pct: f64, half_at: impl Fn(usize) -> Option<f64>) -> Equivalence {
    let (lo_b, hi_b) = bounds(margin_pct);
    let Some((lo, hi)) = ratio.ci95 else {
        return Equivalence::Undecided { pairs: None };
    };
    if lo_b < lo && hi < hi_b {
        return Equivalence::Equivalent;
    }
    if hi < lo_b || lo > hi_b {
        return Equivalence::Differs;
    }
    // The interval has to shrink to the distance between the estimate and the margin.
    let gap = ((1.0 + margin_pct / 100.0).ln() - ratio.mean.ln().abs()).abs();
    if gap < 1e-9 || ratio.sd <= 0.0 {
        return Equivalence::Undecided { pairs: None };
    }
    let pairs = (ratio.n.max(2)..=100_000).find(|&k| half_at(k).is_some_and(|h| h * ratio.sd < gap));
    Equivalence::Undecided { pairs }
}

/// `equivalent within 5%`, `differs by more than 5%`, `undecided at 5% (about 12 pairs in
/// all would likely settle it; 8 so far)`.
pub fn describe(v: &Equivalence, margin_pct: f64, n: usize) -> String {
    match v {
        Equivalence::Equivalent => format!("equivalent within {margin_pct}%"),
        Equivalence::Differs => format!("differs by more than {margin_pct}%"),
        Equivalence::Undecided { pairs: Some(k) } => {
            format!("undecided at {margin_pct}% (about {k} pairs in all would likely settle it; {n} so far)")
        }
        Equivalence::Undecided { pairs: None } => {
            format!("undecided at {margin_pct}% (no estimate of the pairs it needs; {n} so far)")
        }
    }
}

/// The fixed-n two one-sided tests on log ratios `d` at `margin_pct`.
#[derive(Clone, Debug, PartialEq)]
pub struct Tost {
    /// The geometric mean ratio with its 90% interval (`sd` of the logs).
    pub ratio: Interval,
    /// p of the test against the lower bound (H0: ratio <= lower).
    pub p_lower: f64,
    /// p of the test against the upper bound (H0: ratio >= upper).
    pub p_upper: f64,
    /// The verdict.
    pub verdict: Equivalence,
}

/// The fixed-n TOST at 5% per side; `None` under two pairs.
pub fn tost(d: &[f64], margin_pct: f64) -> Option<Tost> {
    let i = interval(d)?;
    if i.n < 2 {
        return None;
    }
    let df = (i.n - 1) as f64;
    let se = i.sd / (i.n as f64).sqrt();
    let q = t_quantile(0.95, df);
    let ratio =
        Interval { mean: i.mean.exp(), ci95: Some(((i.mean - q * se).exp(), (i.mean + q * se).exp())), ..i };
    let (lo_b, hi_b) = bounds(margin_pct);
    let upper_tail = |t: f64| 1.0 - crate::student_t::t_cdf(t, df);
    let p_lower = upper_tail((i.mean - lo_b.ln()) / se);
    let p_upper = upper_tail((hi_b.ln() - i.mean) / se);
    let verdict = judge(&ratio, margin_pct, |k| Some(t_quantile(0.95, (k - 1) as f64) / (k as f64).sqrt()));
    Some(Tost { ratio, p_lower, p_upper, verdict })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logs(pairs: &[(f64, f64)]) -> Vec<f64> {
        pairs.iter().map(|(t, r)| (t / r).ln()).collect()
    }

    /// Wellek (2003), Testing Statistical Hypotheses of Equivalence, p. 212: AUC of a Test
    /// and a Reference drug in 12 subjects, analysed in the SAS/STAT User's Guide, "The
    /// TTEST Procedure", Example "Equivalence Testing with Lognormal Data"
    /// (`proc ttest dist=lognormal tost(0.8, 1.25); paired TestAUC*RefAUC;`). SAS
    /// reports the geometric mean ratio 0.9412 with the 90% confidence limits 0.8634 and
    /// 1.0260, inside 0.8 to 1.25: "Equivalent".
    const WELLEK_AUC: [(f64, f64); 12] = [
        (103.4, 90.11),
        (59.92, 77.71),
        (68.17, 77.71),
        (94.54, 97.51),
        (69.48, 58.21),
        (72.17, 101.3),
        (74.37, 79.84),
        (84.44, 96.06),
        (96.74, 89.30),
        (94.26, 97.22),
        (48.52, 61.62),
        (95.68, 85.80),
    ];

    #[test]
    fn tost_reproduces_the_published_bioequivalence_example() {
        let t = tost(&logs(&WELLEK_AUC), 25.0).unwrap();
        assert_eq!(t.ratio.n, 12);
        assert!((t.ratio.mean - 0.9412).abs() < 5e-5, "{}", t.ratio.mean);
        let (lo, hi) = t.ratio.ci95.unwrap();
        assert!((lo - 0.8634).abs() < 5e-5 && (hi - 1.0260).abs() < 5e-5, "{lo} {hi}");
        assert_eq!(t.verdict, Equivalence::Equivalent);
        // Both one-sided tests reject at 5%, which is what the interval inside the bounds
        // means; the overall p is the larger.
        assert!(t.p_lower < 0.05 && t.p_upper < 0.05, "{} {}", t.p_lower, t.p_upper);
        assert_eq!(describe(&t.verdict, 25.0, 12), "equivalent within 25%");
    }

    #[test]
    fn a_narrower_margin_leaves_it_undecided_or_different() {
        // At 5% ([0.952, 1.05]) the same interval straddles the lower bound: undecided,
        // and it would take more subjects than the study had.
        let t = tost(&logs(&WELLEK_AUC), 5.0).unwrap();
        let Equivalence::Undecided { pairs: Some(k) } = t.verdict else { panic!("{:?}", t.verdict) };
        assert!(k > 12, "{k}");
        assert!(t.p_lower > 0.05, "{}", t.p_lower);
        assert!(describe(&t.verdict, 5.0, 12).starts_with("undecided at 5% (about "));
        // A clear 30% slowdown with little noise: the whole interval is beyond 10%.
        let slow: Vec<f64> = [1.29, 1.31, 1.30, 1.32, 1.28].iter().map(|r: &f64| r.ln()).collect();
        assert_eq!(tost(&slow, 10.0).unwrap().verdict, Equivalence::Differs);
        assert_eq!(bounds(25.0), (0.8, 1.25));
        assert_eq!(tost(&[0.1], 5.0), None);
    }
}
