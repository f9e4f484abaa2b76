//! One number a user reads, computed once.
//!
//! A [`Reading`] is an estimate with everything a reader needs to trust it: its 95%
//! interval, how many observations it rests on, how the interval was taken and how many
//! observations a busy machine disturbed. A [`Judged`] reading is a ratio (B/A) with its
//! [`Verdict`] at a margin. The terminal summary, report.html, compare.html, the kernel
//! markdown, the pull-request comment and the records all print these values through
//! [`Reading::text`], [`Reading::width`] and [`Judged::text`]; none of them takes a mean or
//! an interval of its own. A run writes the readings it printed to [`FILE`] beside its
//! rows, so a page rendered later shows what the terminal showed.

use serde::{Deserialize, Serialize};

use crate::verdict::sequence;
use crate::verdict::student_t::{self, Interval};

/// The file in a run directory that holds the readings its terminal summary printed.
pub const FILE: &str = "readings.json";

/// The margin a comparison is judged at when the user gave none (`--margin`'s default
/// where a task has the flag), in percent.
pub const DEFAULT_MARGIN_PCT: f64 = 5.0;

/// How a reading's interval was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// Student's t on the logs, valid for the number of observations fixed in advance.
    T,
    /// The confidence sequence on the logs (`--until-ci`), valid however the run stopped.
    Sequence,
}

impl Method {
    /// The interval's half-width on the logs per unit of sd at `n` observations.
    pub fn half_factor(self, n: usize) -> Option<f64> {
        match self {
            Method::T if n >= 2 => Some(student_t::t_quantile(0.975, (n - 1) as f64) / (n as f64).sqrt()),
            Method::T => None,
            Method::Sequence => sequence::half_factor(n),
        }
    }

    /// How the interval was taken, for a page's legend.
    pub fn describe(self) -> &'static str {
        match self {
            Method::T => "95% interval from Student's t on the logs",
            Method::Sequence => {
                "95% interval from the confidence sequence on the logs, valid however many observations the run added"
            }
        }
    }
}

/// A positive quantity (a rate, a time, a ratio) as the geometric mean of its
/// observations with the 95% interval of their mean log, mapped back.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Reading {
    /// The geometric mean.
    pub estimate: f64,
    /// The interval's ends; `None` below two observations (or while a confidence
    /// sequence is still unbounded).
    pub interval: Option<(f64, f64)>,
    /// How many observations it rests on.
    pub n: usize,
    /// The standard deviation of their logs (0 for one).
    pub sd_log: f64,
    /// How the interval was taken.
    pub method: Method,
    /// How many of the observations were taken on a busy machine.
    #[serde(default)]
    pub disturbed: usize,
}

impl Reading {
    fn from_log_interval(i: Interval, method: Method) -> Reading {
        Reading { estimate: i.mean, interval: i.ci95, n: i.n, sd_log: i.sd, method, disturbed: 0 }
    }

    /// The reading of positive observations (non-positive or non-finite ones are left
    /// out); `None` when none is left.
    pub fn of(xs: &[f64], method: Method) -> Option<Reading> {
        let i = match method {
            Method::T => student_t::log_interval(xs)?,
            Method::Sequence => {
                let logs: Vec<f64> =
                    xs.iter().filter(|x| **x > 0.0 && x.is_finite()).map(|x| x.ln()).collect();
                let i = sequence::interval(&logs)?;
                Interval { mean: i.mean.exp(), ci95: i.ci95.map(|(lo, hi)| (lo.exp(), hi.exp())), ..i }
            }
        };
        Some(Reading::from_log_interval(i, method))
    }

    /// The reading of the ratios `a_i / b_i` of paired observations.
    pub fn of_pairs(pairs: &[(f64, f64)], method: Method) -> Option<Reading> {
        let i = match method {
            Method::T => student_t::paired_ratio(pairs)?,
            Method::Sequence => sequence::paired_ratio(pairs)?,
        };
        Some(Reading::from_log_interval(i, method))
    }

    /// The ratio B/A of two independent samples (two runs' repetitions, no pairing):
    /// the ratio of their geometric means with the 95% interval of the difference of
    /// their mean logs. [`Method::T`] takes Welch's interval (unequal variances,
    /// Welch-Satterthwaite degrees of freedom); [`Method::Sequence`] adds the two runs'
    /// confidence-sequence half-widths, each at half the error rate, so the sum still
    /// covers at 95% however either run stopped. `n` is the smaller side's count (what
    /// one more repetition of each run adds to) and `sd_log` the spread of one B-minus-A
    /// difference, so [`Judged::more_needed`] counts repetitions per run. No interval
    /// below two observations on either side; `None` when a side has no positive value.
    pub fn of_ratio_unpaired(b: &[f64], a: &[f64], method: Method) -> Option<Reading> {
        let logs = |xs: &[f64]| -> Vec<f64> {
            xs.iter().filter(|x| **x > 0.0 && x.is_finite()).map(|x| x.ln()).collect()
        };
        let (lb, la) = (logs(b), logs(a));
        let (ib, ia) = (student_t::interval(&lb)?, student_t::interval(&la)?);
        let (nb, na) = (ib.n as f64, ia.n as f64);
        let d = ib.mean - ia.mean;
        let (vb, va) = (ib.sd * ib.sd, ia.sd * ia.sd);
        let n = ib.n.min(ia.n);
        let half = if n < 2 {
            None
        } else {
            match method {
                Method::T => {
                    let (eb, ea) = (vb / nb, va / na);
                    let se2 = eb + ea;
                    if se2 <= 0.0 {
                        Some(0.0)
                    } else {
                        let df = se2 * se2 / (eb * eb / (nb - 1.0) + ea * ea / (na - 1.0));
                        Some(student_t::t_quantile(0.975, df) * se2.sqrt())
                    }
                }
                Method::Sequence => {
                    let side = |k: usize, sd: f64| {
                        sequence::critical_t(k, sequence::ALPHA / 2.0, sequence::MIXTURE_G)
                            .map(|c| c * sd / (k as f64).sqrt())
                    };
                    match (side(ib.n, ib.sd), side(ia.n, ia.sd)) {
                        (Some(hb), Some(ha)) => Some(hb + ha),
                        _ => None,
                    }
                }
            }
        };
        Some(Reading {
            estimate: d.exp(),
            interval: half.map(|h| ((d - h).exp(), (d + h).exp())),
            n,
            sd_log: (vb + va).sqrt(),
            method,
            disturbed: 0,
        })
    }

    /// With `disturbed` of its observations taken on a busy machine.
    pub fn disturbed(mut self, disturbed: usize) -> Reading {
        self.disturbed = disturbed;
        self
    }

    /// The larger distance of the interval's ends from the estimate, in percent.
    pub fn half_width_pct(&self) -> Option<f64> {
        self.interval.map(|ci| sequence::half_width_pct(self.estimate, ci))
    }

    /// Whether the interval has no width although it has two observations or more.
    pub fn zero_width(&self) -> bool {
        self.interval.is_some_and(|(lo, hi)| lo == hi)
    }

    /// The interval's width as a reader takes it in: `±3.2%` up to ±100%, beyond that the
    /// factor either way (`within a factor of 240`), since a percentage past 100 reads as
    /// nonsense; `no interval (n=1)` without one.
    pub fn width(&self) -> String {
        let Some((lo, hi)) = self.interval else {
            return format!("no interval (n={})", self.n);
        };
        if self.zero_width() {
            return student_t::ZERO_WIDTH.to_string();
        }
        let pct = sequence::half_width_pct(self.estimate, (lo, hi));
        if pct <= 100.0 {
            format!("±{pct:.1}%")
        } else {
            let factor = (hi / self.estimate).max(if lo > 0.0 { self.estimate / lo } else { f64::INFINITY });
            format!("within a factor of {}", sig(factor))
        }
    }

    /// `12859 [6012, 27506] (n=3, ±114.0%)`, with `fmt` for the values; a disturbed count
    /// is added when there is one.
    pub fn text_with(&self, fmt: impl Fn(f64) -> String) -> String {
        let mut tail = format!("n={}", self.n);
        if self.interval.is_some() {
            tail.push_str(&format!(", {}", self.width()));
        } else {
            tail.push_str(": no interval");
        }
        if self.disturbed > 0 {
            tail.push_str(&format!(", {} disturbed", self.disturbed));
        }
        match self.interval {
            Some((lo, hi)) => format!("{} [{}, {}] ({tail})", fmt(self.estimate), fmt(lo), fmt(hi)),
            None => format!("{} ({tail})", fmt(self.estimate)),
        }
    }

    /// [`Reading::text_with`] with [`sig`] for a rate or a time.
    pub fn text(&self) -> String {
        self.text_with(sig)
    }

    /// [`Reading::text_with`] with three decimals, for a ratio.
    pub fn ratio_text(&self) -> String {
        self.text_with(|v| format!("{v:.3}"))
    }

    /// The verdict of this reading as the ratio B/A at `margin_pct`, `better` saying which
    /// way is an improvement.
    pub fn judge(self, better: Better, margin_pct: f64) -> Judged {
        let verdict = verdict(&self, better, margin_pct);
        Judged { reading: self, better, margin_pct, verdict }
    }
}

/// A value with about four significant figures and no trailing noise: `12859`, `48.21`,
/// `0.1234`, `3.2e-5`.
pub fn sig(v: f64) -> String {
    let a = v.abs();
    if !v.is_finite() {
        return format!("{v}");
    }
    if a >= 1000.0 || a == 0.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else if a >= 1e-3 {
        format!("{v:.4}")
    } else {
        format!("{v:.2e}")
    }
}

/// Which way of a ratio B/A is an improvement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Better {
    /// A rate: above 1 is an improvement.
    Higher,
    /// A time or a size: below 1 is an improvement.
    Lower,
}

/// What a ratio B/A says at a margin.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "verdict")]
pub enum Verdict {
    /// The whole interval lies within the margin either way.
    Same,
    /// The whole interval lies beyond the margin, on the better side.
    Improved,
    /// The whole interval lies beyond the margin, on the worse side.
    Regressed,
    /// Neither: `pairs` in all would likely settle it (`None`: no estimate, as when the
    /// estimate sits on the margin).
    Undecided { pairs: Option<usize> },
    /// Fewer than two observations: no interval, so no verdict.
    NoInterval,
}

fn verdict(r: &Reading, better: Better, margin_pct: f64) -> Verdict {
    let Some((lo, hi)) = r.interval else {
        return Verdict::NoInterval;
    };
    let top = 1.0 + margin_pct / 100.0;
    let bottom = 1.0 / top;
    if bottom < lo && hi < top {
        return Verdict::Same;
    }
    let (up, down) = match better {
        Better::Higher => (Verdict::Improved, Verdict::Regressed),
        Better::Lower => (Verdict::Regressed, Verdict::Improved),
    };
    if lo > top {
        return up;
    }
    if hi < bottom {
        return down;
    }
    // The interval must shrink to the distance between the estimate and the nearer
    // bound on the side the estimate points to (or inside the margin when it is within).
    let gap = (top.ln() - r.estimate.ln().abs()).abs();
    if gap < 1e-9 || r.sd_log <= 0.0 {
        return Verdict::Undecided { pairs: None };
    }
    let pairs = (r.n.max(2)..=100_000).find(|&k| r.method.half_factor(k).is_some_and(|h| h * r.sd_log < gap));
    Verdict::Undecided { pairs }
}

/// A ratio B/A with its verdict.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Judged {
    /// The ratio.
    pub reading: Reading,
    /// Which way is an improvement.
    pub better: Better,
    /// The margin, in percent.
    pub margin_pct: f64,
    /// What it says.
    pub verdict: Verdict,
}

impl Judged {
    /// Whether the verdict is a decision (same, improved or regressed).
    pub fn decided(&self) -> bool {
        matches!(self.verdict, Verdict::Same | Verdict::Improved | Verdict::Regressed)
    }

    /// How many more observations would likely settle an undecided verdict.
    pub fn more_needed(&self) -> Option<usize> {
        match self.verdict {
            Verdict::Undecided { pairs: Some(k) } => Some(k.saturating_sub(self.reading.n)),
            _ => None,
        }
    }

    /// The verdict in words: `same within ±5%`, `regressed by more than 5%`, `undecided at
    /// ±5%: about 12 more pairs would likely settle it (~4 min)`. `unit` names one
    /// observation (`pairs`, `rounds`, `repetitions`); `secs_each`, when known, turns the
    /// count into time.
    pub fn text(&self, unit: &str, secs_each: Option<f64>) -> String {
        let m = self.margin_pct;
        match &self.verdict {
            Verdict::Same => format!("same within ±{m}%"),
            Verdict::Improved => format!("improved by more than {m}%"),
            Verdict::Regressed => format!("regressed by more than {m}%"),
            Verdict::NoInterval => format!("undecided: n={}, no interval yet", self.reading.n),
            Verdict::Undecided { pairs: Some(k) } => {
                let more = k.saturating_sub(self.reading.n).max(1);
                let time =
                    secs_each.map_or(String::new(), |s| format!(" ({})", duration_text(s * more as f64)));
                format!("undecided at ±{m}%: about {more} more {unit} would likely settle it{time}")
            }
            Verdict::Undecided { pairs: None } => {
                format!(
                    "undecided at ±{m}%: the estimate sits on the margin, no count of {unit} would settle it"
                )
            }
        }
    }
}

/// `45 s`, `12 min`, `3.5 h`: a budget as a reader plans with it.
pub fn duration_text(secs: f64) -> String {
    if !secs.is_finite() {
        return "unbounded".into();
    }
    if secs < 90.0 {
        format!("about {:.0} s", secs.max(1.0))
    } else if secs < 90.0 * 60.0 {
        format!("about {:.0} min", secs / 60.0)
    } else {
        format!("about {:.1} h", secs / 3600.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ratio(pairs: &[(f64, f64)]) -> Reading {
        Reading::of_pairs(pairs, Method::T).unwrap()
    }

    #[test]
    fn a_wide_interval_is_undecided_never_same() {
        // The kernel comparison's false all-clear: 1.325 [0.008, 211] at n=2.
        let r = ratio(&[(1.0, 50.0), (35.0, 1.0)]);
        assert!(r.interval.unwrap().0 < 0.05 && r.interval.unwrap().1 > 20.0, "{r:?}");
        let j = r.judge(Better::Lower, 5.0);
        assert!(matches!(j.verdict, Verdict::Undecided { .. }), "{j:?}");
        assert!(j.text("rounds", Some(30.0)).starts_with("undecided at ±5%"), "{}", j.text("rounds", None));
        assert!(!j.decided());
    }

    #[test]
    fn verdicts_follow_the_interval_and_the_direction() {
        let same = ratio(&[(1.0, 1.0), (1.01, 1.0), (0.99, 1.0), (1.0, 1.0)]).judge(Better::Higher, 5.0);
        assert_eq!(same.verdict, Verdict::Same);
        assert_eq!(same.text("pairs", None), "same within ±5%");
        let up = ratio(&[(2.0, 1.0), (2.1, 1.0), (1.9, 1.0)]);
        assert_eq!(up.clone().judge(Better::Higher, 5.0).verdict, Verdict::Improved);
        assert_eq!(up.judge(Better::Lower, 5.0).verdict, Verdict::Regressed);
        let one = ratio(&[(2.0, 1.0)]).judge(Better::Higher, 5.0);
        assert_eq!(one.verdict, Verdict::NoInterval);
        assert!(one.text("pairs", None).contains("no interval"));
    }

    #[test]
    fn an_undecided_verdict_counts_what_is_missing_and_its_time() {
        let r = ratio(&[(1.04, 1.0), (1.10, 1.0), (1.00, 1.0), (1.08, 1.0)]).judge(Better::Higher, 2.0);
        let Verdict::Undecided { pairs: Some(k) } = r.verdict else { panic!("{r:?}") };
        assert!(k > 4, "{k}");
        assert_eq!(r.more_needed(), Some(k - 4));
        let t = r.text("pairs", Some(60.0));
        assert!(t.contains(&format!("about {} more pairs", k - 4)) && t.contains("min"), "{t}");
    }

    #[test]
    fn widths_past_100_percent_read_as_a_factor() {
        let r = Reading::of(&[10.0, 12000.0], Method::T).unwrap();
        assert!(r.width().starts_with("within a factor of"), "{}", r.width());
        let r = Reading::of(&[100.0, 104.0, 98.0], Method::T).unwrap();
        assert!(r.width().starts_with('±') && r.width().ends_with('%'), "{}", r.width());
        assert_eq!(Reading::of(&[5.0], Method::T).unwrap().width(), "no interval (n=1)");
        assert!(Reading::of(&[5.0, 5.0], Method::T).unwrap().width().contains("zero width"));
    }

    #[test]
    fn the_text_carries_n_the_interval_and_what_was_disturbed() {
        let r = Reading::of(&[100.0, 110.0, 90.0], Method::T).unwrap().disturbed(1);
        let t = r.text();
        assert!(t.starts_with("99.67 ["), "{t}");
        assert!(t.contains("(n=3, ±") && t.ends_with(", 1 disturbed)"), "{t}");
        // A rate's interval never goes below zero.
        let wide = Reading::of(&[600.0, 9000.0, 14000.0], Method::T).unwrap();
        assert!(wide.interval.unwrap().0 > 0.0);
        // Round trip through the record: the same text (serde_json may move the last bit).
        let back: Reading = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!((back.text(), back.n, back.disturbed), (r.text(), r.n, r.disturbed));
    }

    #[test]
    fn an_unpaired_ratio_is_welch_s_on_the_logs() {
        // Logs of A: ln 100 + {-0.1, 0, 0.1}; of B: ln 50 + {-0.2, 0, 0.2}.
        let a: Vec<f64> = [-0.1f64, 0.0, 0.1].iter().map(|d| 100.0 * d.exp()).collect();
        let b: Vec<f64> = [-0.2f64, 0.0, 0.2].iter().map(|d| 50.0 * d.exp()).collect();
        let r = Reading::of_ratio_unpaired(&b, &a, Method::T).unwrap();
        assert!((r.estimate - 0.5).abs() < 1e-12, "{r:?}");
        // se^2 = 0.04/3 + 0.01/3; df = se^4 / ((0.04/3)^2/2 + (0.01/3)^2/2) = 2.94.
        let se = (0.05f64 / 3.0).sqrt();
        let df = (0.05f64 / 3.0).powi(2) / ((0.04f64 / 3.0).powi(2) / 2.0 + (0.01f64 / 3.0).powi(2) / 2.0);
        let half = student_t::t_quantile(0.975, df) * se;
        let (lo, hi) = r.interval.unwrap();
        assert!((lo - 0.5 * (-half).exp()).abs() < 1e-9 && (hi - 0.5 * half.exp()).abs() < 1e-9, "{r:?}");
        assert_eq!(r.n, 3);
        assert_eq!(r.clone().judge(Better::Higher, 5.0).verdict, Verdict::Regressed);
        // The sequence's interval is wider than Welch's, and still centred on the logs.
        let s = Reading::of_ratio_unpaired(&b, &a, Method::Sequence).unwrap();
        if let Some((slo, shi)) = s.interval {
            assert!(slo < lo && shi > hi, "{s:?}");
        }
        // One repetition on either side: no interval, so no verdict.
        let one = Reading::of_ratio_unpaired(&b[..1], &a, Method::T).unwrap();
        assert_eq!((one.n, one.interval), (1, None));
        let j = one.judge(Better::Higher, 5.0);
        assert_eq!(j.text("repetitions", None), "undecided: n=1, no interval yet");
        // Equal values on both sides: a zero-width interval at 1.
        let same = Reading::of_ratio_unpaired(&[5.0, 5.0], &[5.0, 5.0], Method::T).unwrap();
        assert_eq!(same.interval, Some((1.0, 1.0)));
        assert!(Reading::of_ratio_unpaired(&[], &a, Method::T).is_none());
        assert!(Reading::of_ratio_unpaired(&[f64::NAN, -1.0], &a, Method::T).is_none());
    }

    #[test]
    fn noisy_repetitions_of_equal_runs_are_undecided_never_a_5x_regression() {
        // Prefill rates of two runs of the same settings on a loaded machine.
        let a = [5200.0, 26000.0, 14000.0];
        let b = [5400.0, 2900.0, 21000.0];
        let j = Reading::of_ratio_unpaired(&b, &a, Method::T).unwrap().judge(Better::Higher, 5.0);
        assert!(matches!(j.verdict, Verdict::Undecided { .. }), "{j:?}");
        assert!(j.more_needed().is_some_and(|k| k > 0), "{j:?}");
    }

    #[test]
    fn values_print_with_four_significant_figures() {
        assert_eq!(sig(12859.4), "12859");
        assert_eq!(sig(482.13), "482.1");
        assert_eq!(sig(48.213), "48.21");
        assert_eq!(sig(0.12345), "0.1235");
        assert_eq!(sig(0.0000321), "3.21e-5");
        assert_eq!(duration_text(30.0), "about 30 s");
        assert_eq!(duration_text(4800.0), "about 80 min");
    }
}
