//! The call on one revision: which side of the line between good and bad its ratio to
//! good lies on, and when it straddles the line, what would decide it.
//!
//! Good is 1 (every ratio is to good) and bad sits where step 0 measured it. A revision
//! is like bad when its whole interval lies beyond the line on bad's side, like good when
//! it lies wholly on good's side, and undecided only while it straddles the line. The line
//! is the midpoint of good and bad on the log scale (the geometric mean, `sqrt(bad)`),
//! or the `--margin` when that is farther from good, so a revision is never called bad
//! for a difference within the margin. A regression far above the noise is therefore
//! called in the first pairs however noisy the host: an interval of ±25% around 0.95 is
//! plainly nowhere near a bad revision at 0.013, whose midpoint with good is 0.114.
//! Requiring equivalence to good within the margin instead (the earlier rule) needs an
//! interval narrower than the margin, which a shared host may never give.

use crate::verdict::reading::{Better, Reading, Verdict, duration_text};

/// Which side of the line a revision is on.
#[derive(Clone, Debug, PartialEq)]
pub enum Side {
    /// Good's side.
    Good,
    /// Bad's side.
    Bad,
    /// Its interval straddles the line: `pairs` in all would likely settle it (`None`
    /// when no count would: the estimate sits on the line, or there is no interval yet).
    Undecided { pairs: Option<usize> },
}

impl Side {
    /// The word the summary's verdict column prints.
    pub fn word(&self) -> &'static str {
        match self {
            Side::Good => "like good",
            Side::Bad => "like bad",
            Side::Undecided { .. } => "undecided",
        }
    }
}

/// What divides good's side from bad's.
#[derive(Clone, Debug, PartialEq)]
pub enum Line {
    /// Step 0, the bad revision itself: the margin around good, either way.
    Margin,
    /// A later revision: `ratio` on the side of `bad` (the bad revision's ratio to good),
    /// the log-midpoint of good and bad or, when `margin` says so, the margin.
    Between { ratio: f64, bad: f64, margin: bool },
}

/// A revision's ratio to good and the call on it.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    /// The ratio revision / good over its pairs.
    pub reading: Reading,
    /// The call.
    pub side: Side,
    /// What it was called against.
    pub line: Line,
    /// `--margin`, in percent.
    pub margin_pct: f64,
    /// When undecided: the `--margin`s (percent) that would decide it at the pairs it
    /// has, each with the side it would put it on.
    pub deciding_margins: Vec<(f64, Side)>,
}

/// The ratio that divides good's side from bad's, for a bad revision at `bad` (its
/// ratio to good): the log-midpoint of 1 and `bad`, moved out to the margin when the
/// margin is farther from good.
pub fn dividing_line(bad: f64, margin_pct: f64) -> f64 {
    let toward = bad.ln().signum();
    let half = bad.ln().abs() / 2.0;
    (toward * half.max((1.0 + margin_pct / 100.0).ln())).exp()
}

/// The pairs in all after which `r`'s interval would likely be narrower than `gap` on
/// the logs either side of its estimate, if its estimate and spread held.
fn pairs_to_shrink(r: &Reading, gap: f64) -> Option<usize> {
    if gap < 1e-9 || r.sd_log <= 0.0 {
        return None;
    }
    (r.n.max(2)..=100_000).find(|&k| r.method.half_factor(k).is_some_and(|h| h * r.sd_log < gap))
}

/// Step 0: is the bad revision (`r`, its ratio to good) beyond the margin of good at all?
/// Like bad when its whole interval lies beyond ±`margin_pct` either way, like good when
/// it lies wholly within, else undecided with the pairs that would likely settle it.
pub fn confirm_bad(r: &Reading, margin_pct: f64) -> Call {
    // The direction does not matter here: a bad revision is bad on whichever side it is.
    let j = r.clone().judge(Better::Lower, margin_pct);
    let side = match j.verdict {
        Verdict::Same => Side::Good,
        Verdict::Improved | Verdict::Regressed => Side::Bad,
        Verdict::Undecided { pairs } => Side::Undecided { pairs },
        Verdict::NoInterval => Side::Undecided { pairs: None },
    };
    Call { reading: r.clone(), side, line: Line::Margin, margin_pct, deciding_margins: Vec::new() }
}

/// A later revision (`r`, its ratio to good) against the bad revision at `bad` (its
/// ratio to good, as step 0 measured it).
pub fn classify(r: &Reading, bad: f64, margin_pct: f64) -> Call {
    let ratio = dividing_line(bad, margin_pct);
    let line = Line::Between { ratio, bad, margin: ratio != (bad.ln() / 2.0).exp() };
    let undecided = |pairs| Call {
        reading: r.clone(),
        side: Side::Undecided { pairs },
        line: line.clone(),
        margin_pct,
        deciding_margins: Vec::new(),
    };
    let Some((lo, hi)) = r.interval else { return undecided(None) };
    // On an axis that grows toward bad: `near` is the end nearer good, `far` the other.
    let toward = bad.ln().signum();
    let (a, b) = (toward * lo.ln(), toward * hi.ln());
    let (near, far) = (a.min(b), a.max(b));
    let cut = toward * ratio.ln();
    let side = if far < cut {
        Side::Good
    } else if near > cut {
        Side::Bad
    } else {
        return Call {
            deciding_margins: deciding_margins(near, far, bad, margin_pct),
            ..undecided(pairs_to_shrink(r, (toward * r.estimate.ln() - cut).abs()))
        };
    };
    Call { reading: r.clone(), side, line, margin_pct, deciding_margins: Vec::new() }
}

/// The `--margin`s that would decide an interval from `near` to `far` (logs, on the axis
/// toward bad) at the pairs it has, where the margin is the line: past its far end it is
/// like good, if bad still lies beyond that margin; below its near end it is like bad, if
/// the near end is past the log-midpoint (which no margin moves). The percentages are rounded outward to 0.1.
fn deciding_margins(near: f64, far: f64, bad: f64, margin_pct: f64) -> Vec<(f64, Side)> {
    let mut out = Vec::new();
    let pct = |x: f64| 100.0 * (x.exp() - 1.0);
    let half = bad.ln().abs() / 2.0;
    // Strictly past the end: an end on the line is not yet beyond it.
    let mut up = (pct(far) * 10.0).ceil() / 10.0;
    if up <= pct(far) + 1e-9 {
        up += 0.1;
    }
    // Only where the margin is already the line: a wider one then moves it. Where the
    // log-midpoint is the line, a margin past it would call good what is nearer bad.
    let margin_is_line = (1.0 + margin_pct / 100.0).ln() > half;
    if margin_is_line && far > 0.0 && up > margin_pct && (1.0 + up / 100.0).ln() < bad.ln().abs() {
        out.push((up, Side::Good));
    }
    let mut down = (pct(near) * 10.0).floor() / 10.0;
    if down >= pct(near) - 1e-9 {
        down -= 0.1;
    }
    if near > half && down > 0.0 && down < margin_pct {
        out.push((down, Side::Bad));
    }
    out
}

impl Call {
    /// Why the call is what it is, in one line; an undecided one says what more pairs
    /// (and their time, given `secs_each` per pair) or which margin would settle it.
    pub fn why(&self, secs_each: Option<f64>) -> String {
        let m = self.margin_pct;
        let r = &self.reading;
        match (&self.line, &self.side) {
            (Line::Margin, Side::Bad) => format!("beyond ±{m}% of good"),
            (Line::Margin, Side::Good) => format!("within ±{m}% of good"),
            (Line::Margin, Side::Undecided { .. }) => {
                let j = r.clone().judge(Better::Lower, m);
                j.text("pairs", secs_each)
            }
            (Line::Between { ratio, bad, margin }, side) => {
                let what = if *margin {
                    format!("the ±{m}% margin (farther from good than the log-midpoint of good and bad)")
                } else {
                    format!("the log-midpoint of good (1) and bad ({bad:.3})")
                };
                let line = format!("{ratio:.3}, {what}");
                // Good's side of the line is above it when bad is below good.
                let (good_dir, bad_dir) = if *bad < 1.0 { ("above", "below") } else { ("below", "above") };
                match side {
                    Side::Good => format!("wholly {good_dir} {line}"),
                    Side::Bad => format!("wholly {bad_dir} {line}"),
                    Side::Undecided { pairs } => {
                        let mut s = match (r.interval, pairs) {
                            (None, _) => format!("no interval yet (n={}) to set against {line}", r.n),
                            (Some(_), Some(k)) => {
                                let more = k.saturating_sub(r.n).max(1);
                                let time = secs_each.map_or(String::new(), |s| {
                                    format!(" ({})", duration_text(s * more as f64))
                                });
                                format!(
                                    "straddles {line}: about {more} more pairs would likely settle it{time}"
                                )
                            }
                            (Some(_), None) => {
                                format!("the estimate sits on {line}: no count of pairs would settle it")
                            }
                        };
                        for (i, (pct, side)) in self.deciding_margins.iter().enumerate() {
                            let lead = if i == 0 { "; " } else { ", " };
                            s.push_str(&format!("{lead}--margin {pct} would call it {}", side.word()));
                        }
                        s
                    }
                }
            }
        }
    }

    /// The pairs more that would likely settle an undecided call.
    pub fn more_needed(&self) -> Option<usize> {
        match self.side {
            Side::Undecided { pairs: Some(k) } => Some(k.saturating_sub(self.reading.n).max(1)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verdict::reading::Method;

    /// A reading at `estimate` with the interval given, as step k measured it.
    fn reading(estimate: f64, lo: f64, hi: f64, n: usize) -> Reading {
        let sd_log = (hi / lo).ln() / 2.0 / Method::Sequence.half_factor(n).unwrap();
        Reading { estimate, interval: Some((lo, hi)), n, sd_log, method: Method::Sequence, disturbed: 0 }
    }

    /// `n` ABBA pairs (revision, good) at `ratio` with a shared host's 20-30% scatter:
    /// run `i` (good first in even pairs) takes the `i`th factor of a fixed cycle, as the
    /// end-to-end test's measurer does.
    fn noisy_pairs(ratio: f64, n: usize) -> Vec<(f64, f64)> {
        let f = [1.00, 1.30, 0.75, 1.20, 0.80, 1.25, 0.72, 1.10];
        (0..n)
            .map(|k| {
                let (a, b) = (f[(2 * k) % 8], f[(2 * k + 1) % 8]);
                if k % 2 == 0 { (7500.0 * ratio * b, 7500.0 * a) } else { (7500.0 * ratio * a, 7500.0 * b) }
            })
            .collect()
    }

    #[test]
    fn the_issue_s_midpoint_is_on_good_s_side_of_a_75x_regression() {
        // bisect on a shared host: 0.953 [0.743, 1.223] was "undecided" against a bad
        // commit at 0.013, since it is not within 5% of good.
        let probe = reading(0.953, 0.743, 1.223, 8);
        let c = classify(&probe, 0.013, 5.0);
        assert_eq!(c.side, Side::Good, "{c:?}");
        assert_eq!(c.why(None), "wholly above 0.114, the log-midpoint of good (1) and bad (0.013)");
        // Near bad, however wide, it is bad.
        let c = classify(&reading(0.02, 0.004, 0.09, 4), 0.013, 5.0);
        assert_eq!(c.side, Side::Bad, "{c:?}");
        // The same, for a time (bad above good).
        assert_eq!(classify(&reading(1.05, 0.82, 1.35, 8), 75.0, 5.0).side, Side::Good);
        assert_eq!(classify(&reading(60.0, 20.0, 180.0, 4), 75.0, 5.0).side, Side::Bad);
    }

    #[test]
    fn a_75x_regression_under_30_percent_noise_is_called_at_four_pairs() {
        let bad = Reading::of_pairs(&noisy_pairs(1.0 / 75.0, 4), Method::Sequence).unwrap();
        let step0 = confirm_bad(&bad, 5.0);
        assert_eq!(step0.side, Side::Bad, "{step0:?}");
        assert_eq!(step0.why(None), "beyond ±5% of good");
        for (ratio, side) in
            [(1.0, Side::Good), (1.0 / 75.0, Side::Bad), (1.3, Side::Good), (0.02, Side::Bad)]
        {
            let r = Reading::of_pairs(&noisy_pairs(ratio, 4), Method::Sequence).unwrap();
            let (lo, hi) = r.interval.unwrap();
            assert!(hi / lo > 1.5, "the noise is real: {r:?}");
            assert_eq!(classify(&r, bad.estimate, 5.0).side, side, "{ratio}: {r:?}");
        }
    }

    #[test]
    fn an_interval_across_the_line_is_undecided_and_says_what_would_decide_it() {
        // Bad at 0.5: the line is 0.707; an interval from 0.5 to 0.72 straddles it, and
        // no margin moves a log-midpoint.
        let r = reading(0.6, 0.5, 0.72, 6);
        let c = classify(&r, 0.5, 5.0);
        assert_eq!(c.deciding_margins, []);
        let Side::Undecided { pairs: Some(k) } = c.side else { panic!("{c:?}") };
        assert!(k > 6, "{k}");
        assert_eq!(c.more_needed(), Some(k - 6));
        let why = c.why(Some(120.0));
        assert!(
            why.starts_with(&format!(
                "straddles 0.707, the log-midpoint of good (1) and bad (0.500): about {} more pairs would likely settle it (about",
                k - 6
            )),
            "{why}"
        );
        assert!(why.ends_with("min)"), "{why}");
        // A small regression: bad at 1.08, margin 5%, so the line is the margin (1.05);
        // an interval 1.02 to 1.0675 would be like good at a margin of 6.8% (bad stays
        // beyond it) and nothing lower can call it bad (its near end is under the
        // log-midpoint, 1.039).
        let c = classify(&reading(1.045, 1.02, 1.0675, 8), 1.08, 5.0);
        assert!(matches!(c.side, Side::Undecided { .. }), "{c:?}");
        assert_eq!(c.deciding_margins, [(6.8, Side::Good)]);
        let why = c.why(None);
        assert!(
            why.contains("the ±5% margin") && why.ends_with("; --margin 6.8 would call it like good"),
            "{why}"
        );
        // Bad at 1.20, margin 15%: the margin (1.15) is the line; 1.1034 to 1.19 is past
        // the log-midpoint (1.095), so a margin under 10.34% would call it bad, and one
        // over 19% (bad, at 20%, still beyond it) good.
        let c = classify(&reading(1.14, 1.1034, 1.19, 8), 1.20, 15.0);
        assert_eq!(c.deciding_margins, [(19.1, Side::Good), (10.3, Side::Bad)], "{c:?}");
        assert!(
            c.why(None)
                .ends_with("; --margin 19.1 would call it like good, --margin 10.3 would call it like bad"),
            "{}",
            c.why(None)
        );
        // On the line itself no count of pairs settles it.
        let on = classify(&reading(0.5f64.sqrt(), 0.6, 0.833, 6), 0.5, 5.0);
        assert_eq!(on.side, Side::Undecided { pairs: None }, "{on:?}");
        assert!(on.why(None).contains("no count of pairs would settle it"), "{}", on.why(None));
    }

    #[test]
    fn the_line_is_the_log_midpoint_or_the_margin_whichever_is_farther() {
        assert!((dividing_line(0.013, 5.0) - 0.114).abs() < 1e-3);
        assert!((dividing_line(4.0, 5.0) - 2.0).abs() < 1e-12);
        assert!((dividing_line(1.08, 5.0) - 1.05).abs() < 1e-12);
        assert!((dividing_line(1.0 / 1.08, 5.0) - 1.0 / 1.05).abs() < 1e-12);
        // Step 0 stays a margin test: within the margin is nothing to bisect.
        let same = Reading::of_pairs(&[(1.0, 1.0), (1.01, 1.0), (0.99, 1.0), (1.0, 1.0)], Method::T).unwrap();
        assert_eq!(confirm_bad(&same, 5.0).side, Side::Good);
        assert_eq!(confirm_bad(&same, 5.0).why(None), "within ±5% of good");
    }
}
