//! Verdicts a noisy machine can still give, shared by every comparison the harness makes:
//! a confidence sequence that lets a run add pairs until its interval is narrow and stop
//! when it likes ([`sequence`]), the least-squares fit of one constant per forward or per
//! token across cells ([`fit`]), and the one form in which every page prints a number: its
//! estimate, interval, n and verdict at a margin ([`reading`]), gathered into the summary
//! every page renders ([`sheet`]), on Student's t and its relatives ([`student_t`]): every
//! interval, test and geometric mean the harness takes lives here. The flags of a run that adds
//! observations until its intervals are narrow, and its budget in observations and in time
//! ([`Budget`]), are here too, so every such task states its caps and its ETA alike.

pub mod fit;
pub mod reading;
pub mod roof_tables;
pub mod roofline;
pub mod sequence;
pub mod sheet;
pub mod student_t;

use std::time::Duration;

use reading::{Reading, duration_text};
use sequence::Stopped;

/// The flags of every comparison that adds ABBA pairs until its answer is known
/// (`bench-kernels --compare`, `qmv-pin-tax`): the sequential rule, its budgets and the
/// equivalence margin. A sweep, which adds repetitions and has no pairs to judge at a
/// margin, takes [`RepetitionFlags`].
#[derive(clap::Args, Clone, Debug, Default)]
pub struct SequentialFlags {
    /// Keep adding ABBA pairs (each measures both sides once) until the 95% interval of
    /// every reported ratio has a half-width under PCT percent, or a budget ends the run
    /// (--max-pairs, --max-time). The intervals are then a confidence sequence's, valid
    /// however the run stops.
    #[arg(long, value_name = "PCT", value_parser = pct_arg)]
    pub until_ci: Option<f64>,
    /// With --until-ci: at most N pairs in all [default: 40; none with --max-time, which
    /// is then the budget].
    #[arg(long, value_name = "N", requires = "until_ci", value_parser = clap::value_parser!(u64).range(2..=MAX_CAP))]
    pub max_pairs: Option<u64>,
    /// With --until-ci: start no new pairs that would end after this long from the first
    /// measurement (such as 90s, 20m, 1h; a bare number is seconds).
    #[arg(long, value_name = "DURATION", requires = "until_ci", value_parser = duration_arg)]
    pub max_time: Option<Duration>,
    /// Judge every ratio at ±PCT percent [default: 5]: `same within ±PCT%` when its whole
    /// 95% interval lies inside, `regressed` or `improved by more than PCT%` when wholly
    /// beyond, else `undecided` with how many more pairs (and how long) would likely
    /// settle it. With --until-ci the run also stops once every ratio is decided.
    #[arg(long, value_name = "PCT", value_parser = pct_arg)]
    pub margin: Option<f64>,
}

/// The flags of a sweep that repeats its cells until its intervals are narrow
/// (`bench-longprompt`): the sequential rule and its budgets, in repetitions.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct RepetitionFlags {
    /// Keep adding repetitions of every cell (from at least 4; with --peer two at a time,
    /// so each engine opens as often) until the 95% interval of every rate, and of every
    /// kiln/peer ratio, has a half-width under PCT percent, or a budget ends the run
    /// (--max-repetitions, --max-time). One run directory, one CSV and one report grow
    /// round by round; a cell skipped by rule keeps its one row. The intervals are then a
    /// confidence sequence's, valid however the run stops.
    #[arg(long, value_name = "PCT", value_parser = pct_arg)]
    pub until_ci: Option<f64>,
    /// With --until-ci: at most N repetitions of every cell [default: 40; none with
    /// --max-time, which is then the budget].
    #[arg(long, alias = "max-pairs", value_name = "N", requires = "until_ci", value_parser = clap::value_parser!(u64).range(2..=MAX_CAP))]
    pub max_repetitions: Option<u64>,
    /// With --until-ci: start no new repetition that would end after this long from the
    /// first cell (such as 90s, 20m, 1h; a bare number is seconds).
    #[arg(long, value_name = "DURATION", requires = "until_ci", value_parser = duration_arg)]
    pub max_time: Option<Duration>,
    /// Refused with its reason: a sweep has no paired ratio to judge at a margin.
    #[arg(long, value_name = "PCT", value_parser = pct_arg, hide = true)]
    pub margin: Option<f64>,
}

/// The default of `--max-pairs` and `--max-repetitions` with `--until-ci` and no
/// `--max-time`.
pub const DEFAULT_MAX_PAIRS: u64 = 40;

/// The largest cap the flags accept, and the cap when `--max-time` alone is the budget.
pub const MAX_CAP: u64 = 10_000;

/// The cap in observations: the one given, else the default, lifted when `--max-time`
/// is the budget (a default cap would end the run before the time the user gave).
fn cap(given: Option<u64>, max_time: Option<Duration>) -> usize {
    match (given, max_time) {
        (Some(n), _) => n as usize,
        (None, Some(_)) => MAX_CAP as usize,
        (None, None) => DEFAULT_MAX_PAIRS as usize,
    }
}

impl SequentialFlags {
    /// The pair budget with `--until-ci`.
    pub fn max_pairs(&self) -> usize {
        cap(self.max_pairs, self.max_time)
    }

    /// The run's budget, in pairs and in time.
    pub fn budget(&self) -> Budget {
        Budget {
            max_n: self.max_pairs(),
            cap_given: self.max_pairs.is_some(),
            max_time: self.max_time,
            flag: "--max-pairs",
            unit: "pairs",
        }
    }
}

impl RepetitionFlags {
    /// The repetition budget with `--until-ci`.
    pub fn max_repetitions(&self) -> usize {
        cap(self.max_repetitions, self.max_time)
    }

    /// The run's budget, in repetitions of every cell and in time.
    pub fn budget(&self) -> Budget {
        Budget {
            max_n: self.max_repetitions(),
            cap_given: self.max_repetitions.is_some(),
            max_time: self.max_time,
            flag: "--max-repetitions",
            unit: "repetitions",
        }
    }
}

/// What bounds a run that adds observations until its intervals are narrow: a count and
/// a time, in its task's words. Every figure it prints turns counts into time with the
/// measured time per observation.
#[derive(Clone, Debug, PartialEq)]
pub struct Budget {
    /// The most observations in all.
    pub max_n: usize,
    /// Whether the user gave the cap.
    pub cap_given: bool,
    /// `--max-time`, counted from the first measurement.
    pub max_time: Option<Duration>,
    /// The cap's flag: `--max-pairs`, `--max-repetitions`.
    pub flag: &'static str,
    /// What one observation is called, plural: `pairs`, `repetitions`.
    pub unit: &'static str,
}

/// `90s`, `8m`, `1.5h`: a duration as the flags take it.
pub fn flag_duration(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 3600.0 && (s % 3600.0) == 0.0 {
        format!("{}h", s / 3600.0)
    } else if s >= 3600.0 {
        format!("{:.1}h", s / 3600.0)
    } else if s >= 60.0 && (s % 60.0) == 0.0 {
        format!("{}m", s / 60.0)
    } else {
        format!("{s:.0}s")
    }
}

impl Budget {
    /// How many more observations both budgets leave after `done` of them in `elapsed`,
    /// each taking `secs_each`; and whether the time (not the cap) is what binds.
    pub fn left(&self, done: usize, elapsed: Duration, secs_each: Option<f64>) -> (usize, bool) {
        let by_count = self.max_n.saturating_sub(done);
        match (self.max_time, secs_each) {
            (Some(max), Some(s)) if s > 0.0 => {
                let by_time = ((max.as_secs_f64() - elapsed.as_secs_f64()).max(0.0) / s).floor();
                let by_time = if by_time >= by_count as f64 { by_count } else { by_time as usize };
                (by_time, by_time < by_count)
            }
            _ => (by_count, false),
        }
    }

    /// The whole run's ETA to its budget: `ETA at most about 6 min (12 more pairs, to
    /// --max-pairs 40)`; sooner when the intervals narrow first.
    pub fn eta(&self, done: usize, elapsed: Duration, secs_each: Option<f64>) -> String {
        let (left, by_time) = self.left(done, elapsed, secs_each);
        let to = match self.max_time {
            Some(t) if by_time => format!("--max-time {}", flag_duration(t)),
            _ => format!("{} {}", self.flag, self.max_n),
        };
        match secs_each {
            _ if left == 0 => format!("ETA: the budget ends the run now ({to})"),
            Some(s) => {
                format!("ETA at most {} ({left} more {}, to {to})", duration_text(left as f64 * s), self.unit)
            }
            None => format!("ETA unknown until one of the {} is timed ({left} more, to {to})", self.unit),
        }
    }

    /// The note a run prints once it knows how long an observation takes, when the cap
    /// ends it well before `--max-time` would: `--max-pairs 40 ends this run before
    /// --max-time 8m: about 5 min of measurement`.
    pub fn cap_note(&self, secs_each: f64) -> Option<String> {
        let max = self.max_time?;
        let to_cap = self.max_n as f64 * secs_each;
        (to_cap < max.as_secs_f64()).then(|| {
            format!(
                "note: {} {} ends this run before --max-time {}: {} of measurement",
                self.flag,
                self.max_n,
                flag_duration(max),
                duration_text(to_cap)
            )
        })
    }

    /// The stopping line in this budget's words.
    pub fn stopped_text(&self, stopped: &Stopped, target_pct: f64) -> String {
        match stopped {
            Stopped::MaxPairs(n) => format!(
                "stopping rule: {} {n} reached before every half-width was under {target_pct}% (the budget ended the run)",
                self.flag
            ),
            Stopped::MaxTime => match self.max_time {
                Some(t) => format!(
                    "stopping rule: --max-time {} reached before every half-width was under {target_pct}% (the budget ended the run)",
                    flag_duration(t)
                ),
                None => stopped.describe(target_pct),
            },
            other => other.describe(target_pct),
        }
    }

    /// `about 14 more repetitions would likely bring every interval under 5% (about 3
    /// min)`, from the readings still wider than the target; `None` when none is.
    pub fn settle_text<'r>(
        &self,
        readings: impl IntoIterator<Item = &'r Reading>,
        target_pct: f64,
        secs_each: Option<f64>,
    ) -> Option<String> {
        let mut readings_short = false;
        let needs: Vec<Option<usize>> = readings
            .into_iter()
            .inspect(|r| readings_short |= r.n < 2)
            .map(|r| more_for_width(r, target_pct))
            .filter(|m| *m != Some(0))
            .collect();
        if needs.is_empty() {
            return None;
        }
        let unit = self.unit;
        if needs.contains(&None) {
            return Some(match secs_each {
                _ if readings_short => format!(
                    "no count of {unit} can be told yet to bring every interval under {target_pct}%: a reading rests on one observation"
                ),
                Some(s) => format!(
                    "more than {BEYOND} more {unit} would be needed to bring every interval under {target_pct}% (more than {})",
                    duration_text(s * BEYOND as f64)
                ),
                None => format!(
                    "more than {BEYOND} more {unit} would be needed to bring every interval under {target_pct}%"
                ),
            });
        }
        let m = needs.into_iter().flatten().max().unwrap_or(0);
        let time = secs_each.map_or(String::new(), |s| format!(" ({})", duration_text(s * m as f64)));
        Some(format!("about {m} more {unit} would likely bring every interval under {target_pct}%{time}"))
    }
}

/// How far [`more_for_width`] looks.
const BEYOND: usize = 100_000;

/// How many more observations would likely bring `r`'s interval under a half-width of
/// `target_pct` percent, its spread staying what it is: 0 when it is already there,
/// `None` when it cannot say (fewer than two observations, or more than [`BEYOND`]).
pub fn more_for_width(r: &Reading, target_pct: f64) -> Option<usize> {
    if r.half_width_pct().is_some_and(|h| h < target_pct) {
        return Some(0);
    }
    if r.n < 2 {
        return None;
    }
    if r.sd_log <= 0.0 {
        return Some(0);
    }
    let gap = (1.0 + target_pct / 100.0).ln();
    (r.n.max(2)..=r.n + BEYOND)
        .find(|&k| r.method.half_factor(k).is_some_and(|h| h * r.sd_log < gap))
        .map(|k| k - r.n)
}

/// A percentage: a finite number above 0 and below 100.
pub fn pct_arg(s: &str) -> Result<f64, String> {
    match s.trim_end_matches('%').parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v < 100.0 => Ok(v),
        _ => Err(format!("{s:?}: expected a percentage above 0 and below 100, such as 3 or 2.5")),
    }
}

/// A duration: a number with `s`, `m` or `h` (bare: seconds), at least one second and at
/// most a week.
pub fn duration_arg(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?}: expected a duration such as 90s, 20m or 1h (1 s to 168 h)");
    let (num, unit) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => (&s[..i], &s[i..]),
        None => (s, "s"),
    };
    let scale = match unit {
        "s" | "sec" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        _ => return Err(bad()),
    };
    let v: f64 = num.trim().parse().map_err(|_| bad())?;
    let secs = v * scale;
    if !secs.is_finite() || !(1.0..=168.0 * 3600.0).contains(&secs) {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_and_margins_parse_with_their_range() {
        assert_eq!(duration_arg("20m"), Ok(Duration::from_secs(1200)));
        assert_eq!(duration_arg("90"), Ok(Duration::from_secs(90)));
        assert_eq!(duration_arg("1.5h"), Ok(Duration::from_secs(5400)));
        for bad in ["", "0s", "-5m", "20x", "1e300h", "nanm", "200h"] {
            assert!(duration_arg(bad).unwrap_err().contains("expected a duration"), "{bad}");
        }
        assert_eq!(pct_arg("3"), Ok(3.0));
        assert_eq!(pct_arg("2.5%"), Ok(2.5));
        for bad in ["0", "-1", "100", "inf", "NaN", "x"] {
            assert!(pct_arg(bad).unwrap_err().contains("expected a percentage"), "{bad}");
        }
    }

    #[test]
    fn a_time_budget_is_not_cut_by_the_default_pair_cap() {
        let until = SequentialFlags { until_ci: Some(5.0), ..SequentialFlags::default() };
        assert_eq!(until.max_pairs(), 40, "the default cap without a time budget");
        let timed = SequentialFlags { max_time: Some(Duration::from_secs(480)), ..until.clone() };
        assert!(timed.max_pairs() >= 1000, "--max-time 8m cut to {} pairs", timed.max_pairs());
        let both = SequentialFlags { max_pairs: Some(40), ..timed };
        assert_eq!(both.max_pairs(), 40, "a cap the user gave stays");
    }

    fn budget(max_n: usize, max_time: Option<u64>) -> Budget {
        Budget {
            max_n,
            cap_given: true,
            max_time: max_time.map(Duration::from_secs),
            flag: "--max-pairs",
            unit: "pairs",
        }
    }

    #[test]
    fn the_eta_covers_the_whole_run_to_whichever_budget_ends_it() {
        // 10 of 40 pairs done at 12 s each: 30 more, 6 minutes.
        let b = budget(40, None);
        assert_eq!(b.left(10, Duration::from_secs(120), Some(12.0)), (30, false));
        assert_eq!(
            b.eta(10, Duration::from_secs(120), Some(12.0)),
            "ETA at most about 6 min (30 more pairs, to --max-pairs 40)"
        );
        // --max-time 8m with 2 minutes spent: 30 more pairs would not fit, 30 pairs of 12 s
        // = 360 s does; at 20 s each only 18 do.
        let t = budget(40, Some(480));
        assert_eq!(t.left(10, Duration::from_secs(120), Some(20.0)), (18, true));
        assert_eq!(
            t.eta(10, Duration::from_secs(120), Some(20.0)),
            "ETA at most about 6 min (18 more pairs, to --max-time 8m)"
        );
        assert!(
            b.eta(40, Duration::from_secs(480), Some(12.0)).starts_with("ETA: the budget ends the run now")
        );
    }

    #[test]
    fn a_cap_that_ends_the_run_before_its_time_is_said() {
        // The run: 40 pairs of 7.35 s end after 4.9 min of an 8 min budget.
        let both = SequentialFlags {
            until_ci: Some(5.0),
            max_pairs: Some(40),
            max_time: Some(Duration::from_secs(480)),
            margin: None,
        };
        assert_eq!(
            both.budget().cap_note(7.35).as_deref(),
            Some("note: --max-pairs 40 ends this run before --max-time 8m: about 5 min of measurement")
        );
        assert_eq!(both.budget().cap_note(13.0), None, "the time ends it first");
        let timed = SequentialFlags { max_pairs: None, ..both };
        assert_eq!(timed.budget().cap_note(7.35), None, "no cap cuts a time budget");
        let sweep = RepetitionFlags { until_ci: Some(5.0), ..RepetitionFlags::default() };
        assert_eq!((sweep.budget().flag, sweep.budget().max_n), ("--max-repetitions", 40));
    }

    #[test]
    fn what_would_settle_it_is_said_in_time_too() {
        use reading::Method;
        let wide = Reading::of(&[10.0, 12.0, 9.0, 11.0, 10.5], Method::Sequence).unwrap();
        let more = more_for_width(&wide, 5.0).unwrap();
        assert!(more > 0, "{wide:?}");
        let b = RepetitionFlags::default().budget();
        let text = b.settle_text([&wide], 5.0, Some(60.0)).unwrap();
        assert_eq!(
            text,
            format!(
                "about {more} more repetitions would likely bring every interval under 5%{}",
                format_args!(" ({})", duration_text(60.0 * more as f64))
            )
        );
        // Already narrow: nothing to say.
        let narrow = Reading::of(&[10.0, 10.01, 10.0, 9.99, 10.0], Method::Sequence).unwrap();
        assert_eq!(more_for_width(&narrow, 5.0), Some(0));
        assert_eq!(b.settle_text([&narrow], 5.0, Some(60.0)), None);
        // One observation: no spread to extrapolate from.
        let one = Reading::of(&[10.0], Method::Sequence).unwrap();
        assert!(b.settle_text([&one], 5.0, None).unwrap().starts_with("no count of repetitions"));
        // Beyond what a run could add: said with its time, not as too few observations.
        let hopeless = Reading::of(&[10.0, 1000.0, 5.0, 900.0], Method::Sequence).unwrap();
        assert_eq!(more_for_width(&hopeless, 0.5), None);
        let text = b.settle_text([&hopeless], 0.5, Some(1.0)).unwrap();
        assert_eq!(
            text,
            "more than 100000 more repetitions would be needed to bring every interval under 0.5% (more than about 27.8 h)"
        );
        // The stopping line names the task's own cap.
        assert_eq!(
            b.stopped_text(&Stopped::MaxPairs(40), 5.0),
            "stopping rule: --max-repetitions 40 reached before every half-width was under 5% (the budget ended the run)"
        );
    }
}
