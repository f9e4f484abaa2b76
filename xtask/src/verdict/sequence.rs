//! A confidence sequence for the mean of paired log ratios, valid however the run decides
//! to stop: the Gaussian-mixture t confidence sequence.
//!
//! Method: for pairs' log ratios `d_1, d_2, ...` assumed independent `N(mu, sigma^2)`
//! with both unknown, the t statistic `t_n = (mean_n - mu) / (s_n / sqrt(n))` of the
//! first `n` enters the Bayes factor of a `N(0, g)` prior on the standardized effect
//! `(mean - mu) / sigma` against none (Gönen, Johnson, Lu and Westfall, "The Bayesian
//! two-sample t test", The American Statistician 59(3), 2005, in its one-sample form):
//!
//! `B_n = (1 + n g)^(-1/2) * ((1 + t^2 / nu) / (1 + t^2 / (nu (1 + n g))))^((nu + 1) / 2)`,
//! `nu = n - 1`.
//!
//! As a function of the scale-invariant statistics it is a likelihood ratio of nested
//! data, so under `mu` it is a nonnegative martingale (in the filtration of those
//! statistics), and Ville's inequality gives `P(B_n >= 1/alpha for some n) <= alpha`:
//! the intervals `{mu : B_n(mu) < 1/alpha}` hold their 95% coverage simultaneously for
//! every `n`, hence at any stopping time, whatever rule picked it. This is the
//! construction of Lai ("On confidence sequences", Annals of Statistics 4(2), 1976) with
//! a Gaussian in place of his flat mixture over the mean, as analysed by Wang and Ramdas
//! ("Anytime-valid t-tests and confidence sequences for Gaussian means with unknown
//! variance", Sequential Analysis, 2024). `B_n` grows with `|t|`, so the set is the
//! interval `mean_n ± t*_n s_n / sqrt(n)` with `t*_n` the root of `B_n(t) = 1/alpha`.
//! It is bounded only once `(nu / 2) ln(1 + n g) > ln(1 / alpha)`: with `g` = 4, from
//! four pairs on.
//!
//! The price of stopping when one likes: the interval is wider than the fixed-n t
//! interval (about 1.9 times as wide at 5 pairs, 1.7 times at 20), and its coverage rests on
//! the log ratios being close to normal. A fixed-n interval re-tested
//! after every pair, stopping when it is narrow enough, covers less than it says (the
//! unit test below measures both).

use crate::verdict::student_t::Interval;

/// The error probability of every interval: 95% coverage.
pub const ALPHA: f64 = 0.05;

/// The prior variance of the standardized effect in the mixture: chosen so the sequence
/// is bounded from four pairs (one default ABBA order of the sweep) and tight from about
/// five to fifteen pairs, where runs on a shared machine end.
pub const MIXTURE_G: f64 = 4.0;

/// `ln B_n` at t statistic `t` with `n` values.
fn ln_bayes_factor(t: f64, n: usize, g: f64) -> f64 {
    let nu = (n - 1) as f64;
    let ng = n as f64 * g;
    let t2 = t * t;
    0.5 * (nu + 1.0) * ((1.0 + t2 / nu).ln() - (1.0 + t2 / (nu * (1.0 + ng))).ln()) - 0.5 * (1.0 + ng).ln()
}

/// The critical `|t|` at `n` values: the root of `B_n(t) = 1/alpha`; `None` while the
/// sequence is unbounded (`B_n` never reaches `1/alpha`) or under two values.
pub fn critical_t(n: usize, alpha: f64, g: f64) -> Option<f64> {
    if n < 2 {
        return None;
    }
    let target = (1.0 / alpha).ln();
    let sup = 0.5 * (n - 1) as f64 * (1.0 + n as f64 * g).ln();
    if sup <= target {
        return None;
    }
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    while ln_bayes_factor(hi, n, g) < target {
        hi *= 2.0;
        if hi > 1e12 {
            return None;
        }
    }
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if ln_bayes_factor(mid, n, g) < target {
            lo = mid;
        } else {
            hi = mid;
        }
        if hi - lo < 1e-12 * hi {
            break;
        }
    }
    Some(hi)
}

/// [`critical_t`] at [`ALPHA`] and [`MIXTURE_G`], computed once per `n` up to 1024.
fn critical(n: usize) -> Option<f64> {
    static TABLE: std::sync::OnceLock<Vec<Option<f64>>> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| (0..=1024).map(|n| critical_t(n, ALPHA, MIXTURE_G)).collect());
    match table.get(n) {
        Some(c) => *c,
        None => critical_t(n, ALPHA, MIXTURE_G),
    }
}

/// The confidence sequence's interval for the mean of `d` at its current length, as an
/// [`Interval`] (`ci95: None` while unbounded); `None` when `d` is empty.
pub fn interval(d: &[f64]) -> Option<Interval> {
    let n = d.len();
    if n == 0 {
        return None;
    }
    let mean = d.iter().sum::<f64>() / n as f64;
    if n < 2 {
        return Some(Interval { n, mean, sd: 0.0, ci95: None });
    }
    let sd = (d.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt();
    let ci95 = critical(n).map(|c| {
        let half = c * sd / (n as f64).sqrt();
        (mean - half, mean + half)
    });
    Some(Interval { n, mean, sd, ci95 })
}

/// The ratio of paired samples (`a_i / b_i`) as a geometric mean with the confidence
/// sequence's interval of the mean log ratio, mapped back with `exp`; pairs with a
/// non-positive side are left out.
pub fn paired_ratio(pairs: &[(f64, f64)]) -> Option<Interval> {
    let logs: Vec<f64> =
        pairs.iter().filter(|(a, b)| *a > 0.0 && *b > 0.0).map(|(a, b)| (a / b).ln()).collect();
    let i = interval(&logs)?;
    Some(Interval { mean: i.mean.exp(), ci95: i.ci95.map(|(lo, hi)| (lo.exp(), hi.exp())), ..i })
}

/// The half-width of a ratio's interval in percent: the larger distance of its ends from
/// the estimate, relative to it (`hi / mean - 1` for an interval symmetric on the logs).
pub fn half_width_pct(mean: f64, (lo, hi): (f64, f64)) -> f64 {
    100.0 * (hi / mean - 1.0).max(1.0 - lo / mean)
}

/// The half-width of the sequence's interval on the logs per unit of sd at `n` pairs.
pub fn half_factor(n: usize) -> Option<f64> {
    critical(n).map(|c| c / (n as f64).sqrt())
}

/// Why a run that adds pairs until its intervals are narrow ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Stopped {
    /// Every reported ratio's half-width fell under the target.
    Converged,
    /// Every reported ratio was decided at the margin (equivalent or differs).
    Decided(f64),
    /// `--max-pairs` was reached first.
    MaxPairs(usize),
    /// `--max-time` was reached first (or the next block would have passed it).
    MaxTime,
    /// A signal, a failure or an aborted boot ended it.
    Ended(String),
}

impl Stopped {
    /// The line the summary prints.
    pub fn describe(&self, target_pct: f64) -> String {
        match self {
            Stopped::Converged => {
                format!(
                    "stopping rule: converged, every reported interval's half-width is under {target_pct}%"
                )
            }
            Stopped::Decided(m) => {
                format!("stopping rule: decided, every reported ratio is the same within ±{m}% or beyond it")
            }
            Stopped::MaxPairs(n) => format!(
                "stopping rule: --max-pairs {n} reached before every half-width was under {target_pct}% (the budget ended the run)"
            ),
            Stopped::MaxTime => format!(
                "stopping rule: --max-time reached before every half-width was under {target_pct}% (the budget ended the run)"
            ),
            Stopped::Ended(why) => format!("stopping rule: the run ended early ({why})"),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A small deterministic generator (SplitMix64) with Box-Muller normals, so the
    /// simulations are the same on every run and need no dependency.
    pub(crate) struct Rng(u64);

    impl Rng {
        pub(crate) fn new(seed: u64) -> Rng {
            Rng(seed)
        }
        fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn uniform(&mut self) -> f64 {
            ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        }
        pub(crate) fn normal(&mut self) -> f64 {
            let (u, v) = (self.uniform(), self.uniform());
            (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
        }
    }

    /// Runs the stopping rule `--until-ci target --max-pairs max` on simulated pairs
    /// whose true ratio is `ratio` and log-scale noise `sigma`; returns the share of runs
    /// whose final interval holds the true ratio, and the mean pairs used.
    fn coverage(
        runs: usize,
        ratio: f64,
        sigma: f64,
        target_pct: f64,
        max: usize,
        first: usize,
        interval_of: fn(&[f64]) -> Option<Interval>,
    ) -> (f64, f64) {
        let mut rng = Rng::new(0x6b69_6c6e ^ (sigma.to_bits()));
        let mu = ratio.ln();
        let (mut covered, mut pairs) = (0usize, 0usize);
        for _ in 0..runs {
            let mut d: Vec<f64> = Vec::with_capacity(max);
            let last = loop {
                d.push(mu + sigma * rng.normal());
                if d.len() < first {
                    continue;
                }
                let i = interval_of(&d).map(|i| Interval {
                    mean: i.mean.exp(),
                    ci95: i.ci95.map(|(lo, hi)| (lo.exp(), hi.exp())),
                    ..i
                });
                let narrow = i
                    .as_ref()
                    .and_then(|i| Some(half_width_pct(i.mean, i.ci95?)))
                    .is_some_and(|h| h < target_pct);
                if narrow || d.len() >= max {
                    break i;
                }
            };
            pairs += d.len();
            if last.and_then(|i| i.ci95).is_some_and(|(lo, hi)| lo <= ratio && ratio <= hi) {
                covered += 1;
            }
        }
        (covered as f64 / runs as f64, pairs as f64 / runs as f64)
    }

    #[test]
    fn the_sequence_covers_under_the_stopping_rule_the_runs_use() {
        // 10,000 simulated runs of `--until-ci 3 --max-pairs 60` from the default order's
        // 4 pairs, a true tax of 5% and 2%, 4%, 8% noise per pair: the interval the run
        // stops with holds the true ratio in at least 94% of them.
        for sigma in [0.02, 0.04, 0.08] {
            let (cov, pairs) = coverage(10_000, 1.05, sigma, 3.0, 60, 4, interval);
            eprintln!("sigma {sigma}: the sequence covered {cov} with {pairs:.1} pairs on average");
            assert!(cov >= 0.94, "sigma {sigma}: coverage {cov} over {pairs} pairs on average");
        }
        // The fixed-n t interval re-tested after every pair under the same rule covers
        // less than its 95%: the reason the runs use the sequence.
        let (naive, pairs) = coverage(10_000, 1.05, 0.04, 3.0, 60, 2, crate::verdict::student_t::interval);
        eprintln!("sigma 0.04: a re-tested t interval covered {naive} with {pairs:.1} pairs on average");
        assert!(naive < 0.94, "a re-tested t interval covered {naive}");
    }

    #[test]
    fn the_critical_value_solves_the_bayes_factor_and_exceeds_students() {
        // Unbounded below four pairs with g = 4: (nu / 2) ln(1 + n g) = ln 13 = 2.56 < ln 20
        // at n = 3.
        assert_eq!(critical_t(3, ALPHA, MIXTURE_G), None);
        for n in [4usize, 5, 8, 20, 60] {
            let c = critical_t(n, ALPHA, MIXTURE_G).unwrap();
            assert!((ln_bayes_factor(c, n, MIXTURE_G) - 20f64.ln()).abs() < 1e-9, "n {n}");
            let t = crate::verdict::student_t::t_quantile(0.975, (n - 1) as f64);
            assert!(c > t, "n {n}: {c} <= the fixed-n {t}");
        }
        let i = interval(&[0.1, 0.12, 0.08, 0.1, 0.11]).unwrap();
        let (lo, hi) = i.ci95.unwrap();
        assert!(lo < 0.1 && hi > 0.1 && ((lo + hi) / 2.0 - i.mean).abs() < 1e-12);
        assert_eq!(interval(&[0.1, 0.2]).unwrap().ci95, None, "two pairs: not yet bounded");
        let r = paired_ratio(&[(105.0, 100.0); 5]).unwrap();
        assert_eq!(half_width_pct(r.mean, r.ci95.unwrap()), 0.0);
    }
}
