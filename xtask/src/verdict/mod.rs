//! Verdicts a noisy machine can still give, shared by every comparison the harness makes:
//! a confidence sequence that lets a run add pairs until its interval is narrow and stop
//! when it likes ([`sequence`]), equivalence at a margin by two one-sided tests
//! ([`equivalence`]), and the least-squares fit of one constant per forward or per token
//! across cells ([`fit`]), and the one form in which every page prints a number: its
//! estimate, interval, n and verdict ([`reading`]).

pub mod equivalence;
pub mod fit;
pub mod reading;
pub mod sequence;
pub mod sheet;

use std::time::Duration;

/// The flags of every comparison that can run until its answer is known: the sequential
/// rule and its budgets, and the equivalence margin.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct SequentialFlags {
    /// Keep adding ABBA pairs until the 95% interval of every reported ratio has a
    /// half-width under PCT percent, or a budget ends the run (--max-pairs, --max-time).
    /// The intervals are then a confidence sequence's, valid however the run stops.
    #[arg(long, value_name = "PCT", value_parser = pct_arg)]
    pub until_ci: Option<f64>,
    /// With --until-ci: at most N pairs in all [default: 40].
    #[arg(long, value_name = "N", requires = "until_ci", value_parser = clap::value_parser!(u64).range(2..=10_000))]
    pub max_pairs: Option<u64>,
    /// With --until-ci: start no new pairs that would end after this long from the start
    /// (such as 90s, 20m, 1h; a bare number is seconds).
    #[arg(long, value_name = "DURATION", requires = "until_ci", value_parser = duration_arg)]
    pub max_time: Option<Duration>,
    /// Judge every ratio for equivalence within ±PCT percent (two one-sided tests):
    /// `equivalent within PCT`, `differs by more than PCT`, or `undecided` with the pairs
    /// that would likely settle it. With --until-ci the run also stops once every ratio
    /// is decided.
    #[arg(long, value_name = "PCT", value_parser = pct_arg)]
    pub margin: Option<f64>,
}

/// The default of `--max-pairs` with `--until-ci`.
pub const DEFAULT_MAX_PAIRS: u64 = 40;

impl SequentialFlags {
    /// The pair budget with `--until-ci`.
    pub fn max_pairs(&self) -> usize {
        self.max_pairs.unwrap_or(DEFAULT_MAX_PAIRS) as usize
    }
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
}
