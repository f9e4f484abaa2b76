//! Choosing the next token from logits: greedy (temperature 0), or sampling at a
//! temperature from the top-k tokens and then the smallest set whose probability reaches
//! top-p, with a seeded generator so a seed reproduces a run exactly.

use rand_core::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::error::{ModelError, Result};
use crate::ops::{argmax, exp};

/// Temperatures below this are greedy: sampling divides logits by the temperature, and
/// below about 3e-39 (the subnormals) its reciprocal is infinite and the softmax NaN; long
/// before that the most likely token takes all the probability anyway.
pub const GREEDY_BELOW_TEMPERATURE: f32 = 1e-6;

/// Candidates sorted before falling back to sorting the whole vocabulary for top-p.
const TOP_P_FIRST_PASS: usize = 1024;

/// How to choose tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 (or anything below [`GREEDY_BELOW_TEMPERATURE`]) for greedy; otherwise logits are
    /// divided by it before the softmax.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`;
    /// 1 keeps all.
    pub top_p: f32,
    /// Seed of the generator.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 }
    }
}

impl SamplingParams {
    /// Whether this picks the most likely token every time: a temperature below
    /// [`GREEDY_BELOW_TEMPERATURE`], or top-k 1.
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_BELOW_TEMPERATURE || self.top_k == 1
    }

    /// Checks the ranges: temperature finite and >= 0, top-p in (0, 1].
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(ModelError::InvalidArgument {
                what: "temperature".into(),
                message: format!(
                    "{} is out of range: accepted values are finite and >= 0 (0 = greedy)",
                    self.temperature
                ),
            });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::InvalidArgument {
                what: "top-p".into(),
                message: format!("{} is out of range: accepted values are in (0, 1]", self.top_p),
            });
        }
        Ok(())
    }
}

/// A seeded sampler; its buffers are sized once for the vocabulary.
pub struct Sampler {
    params: SamplingParams,
    rng: Xoshiro256PlusPlus,
    probs: Vec<f32>,
    order: Vec<u32>,
}

impl Sampler {
    /// A sampler for `vocab` logits per step.
    pub fn new(params: SamplingParams, vocab: usize) -> Result<Self> {
        params.validate()?;
        let (probs, order) = if params.is_greedy() {
            (Vec::new(), Vec::new())
        } else {
            (vec![0f32; vocab], (0..vocab as u32).collect())
        };
        Ok(Sampler { params, rng: Xoshiro256PlusPlus::seed_from_u64(params.seed), probs, order })
    }

    /// The parameters.
    pub fn params(&self) -> SamplingParams {
        self.params
    }

    /// The next token.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits) as u32;
        }
        let inv_t = 1.0 / self.params.temperature;
        let max = logits[argmax(logits)];
        let probs = &mut self.probs[..logits.len()];
        let mut total = 0f64;
        for (p, &l) in probs.iter_mut().zip(logits) {
            // NaN logits get no probability.
            *p = if l.is_nan() { 0.0 } else { exp((l - max) * inv_t) };
            total += *p as f64;
        }
        let u = (self.rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
        let vocab = logits.len();
        let k = match self.params.top_k {
            0 => vocab,
            k => k.min(vocab),
        };
        if k == vocab && self.params.top_p >= 1.0 {
            return pick(probs.iter().enumerate().map(|(i, &p)| (i as u32, p)), total * u);
        }
        let order = &mut self.order;
        order.clear();
        order.extend(0..vocab as u32);
        let by_prob = |a: &u32, b: &u32| probs[*b as usize].total_cmp(&probs[*a as usize]).then(a.cmp(b));
        // The candidates are the top k; for top-p sort only a first slice when it already
        // reaches the mass, which holds whenever the distribution is not nearly flat.
        let mut sorted = k.min(TOP_P_FIRST_PASS);
        loop {
            if sorted < vocab {
                order.select_nth_unstable_by(sorted - 1, by_prob);
            }
            order[..sorted].sort_unstable_by(by_prob);
            let cut = nucleus(order[..sorted].iter().map(|&i| probs[i as usize]), total, self.params.top_p);
            match cut {
                Some(n) => {
                    let n = n.min(k);
                    let mass: f64 = order[..n].iter().map(|&i| probs[i as usize] as f64).sum();
                    return pick(order[..n].iter().map(|&i| (i, probs[i as usize])), mass * u);
                }
                None if sorted >= k => {
                    let mass: f64 = order[..k].iter().map(|&i| probs[i as usize] as f64).sum();
                    return pick(order[..k].iter().map(|&i| (i, probs[i as usize])), mass * u);
                }
                None => sorted = k,
            }
        }
    }
}

impl Sampler {
    /// Writes into `out` the distribution [`Self::sample`] draws from at these logits:
    /// temperature, then top-k, then top-p, renormalised; tokens outside the candidates
    /// get 0. Greedy parameters give all the mass to the first maximum. Speculative
    /// verification compares draft and target under this distribution.
    pub fn distribution(&mut self, logits: &[f32], out: &mut Vec<f32>) {
        let vocab = logits.len();
        out.clear();
        out.resize(vocab, 0.0);
        if self.params.is_greedy() {
            out[argmax(logits)] = 1.0;
            return;
        }
        let inv_t = 1.0 / self.params.temperature;
        let max = logits[argmax(logits)];
        for (p, &l) in out.iter_mut().zip(logits) {
            *p = if l.is_nan() { 0.0 } else { exp((l - max) * inv_t) };
        }
        let k = match self.params.top_k {
            0 => vocab,
            k => k.min(vocab),
        };
        if k < vocab || self.params.top_p < 1.0 {
            let total: f64 = out.iter().map(|&p| p as f64).sum();
            let order = &mut self.order;
            order.clear();
            order.extend(0..vocab as u32);
            let probs = &*out;
            order.sort_unstable_by(|a, b| probs[*b as usize].total_cmp(&probs[*a as usize]).then(a.cmp(b)));
            let kept = nucleus(order[..k].iter().map(|&i| probs[i as usize]), total, self.params.top_p)
                .unwrap_or(k)
                .min(k);
            for &i in &order[kept..] {
                out[i as usize] = 0.0;
            }
        }
        let total: f64 = out.iter().map(|&p| p as f64).sum();
        if total > 0.0 {
            let inv = (1.0 / total) as f32;
            out.iter_mut().for_each(|p| *p *= inv);
        }
    }

    /// A uniform draw in [0, 1) from the sampler's generator.
    pub fn uniform(&mut self) -> f64 {
        (self.rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Draws a token from `weights` (non-negative, any total) with the sampler's
    /// generator; the first positive weight when they all round away.
    pub fn draw(&mut self, weights: &[f32]) -> u32 {
        let total: f64 = weights.iter().map(|&p| p.max(0.0) as f64).sum();
        let u = self.uniform();
        pick(weights.iter().enumerate().map(|(i, &p)| (i as u32, p)), total * u)
    }
}

/// How many of the sorted probabilities it takes to reach `top_p` of `total`, or `None`
/// when these do not.
fn nucleus(sorted: impl Iterator<Item = f32>, total: f64, top_p: f32) -> Option<usize> {
    let target = top_p as f64 * total;
    let mut acc = 0f64;
    for (n, p) in sorted.enumerate() {
        acc += p as f64;
        if acc >= target {
            return Some(n + 1);
        }
    }
    None
}

/// The first candidate at which the running sum passes `threshold` (the last one when
/// rounding leaves the threshold unreached).
fn pick(candidates: impl Iterator<Item = (u32, f32)>, threshold: f64) -> u32 {
    let mut acc = 0f64;
    let mut last = 0;
    for (i, p) in candidates {
        if p <= 0.0 {
            continue;
        }
        acc += p as f64;
        last = i;
        if acc > threshold {
            return i;
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        (0..50).map(|i| ((i * 37 % 17) as f32) * 0.3).collect()
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::default(), 4).unwrap();
        assert_eq!(s.sample(&[0.0, 2.0, 1.0, 2.0]), 1);
    }

    #[test]
    fn a_seed_reproduces_the_draws() {
        let p = SamplingParams { temperature: 0.8, top_k: 0, top_p: 1.0, seed: 42 };
        let draw = |p: SamplingParams| {
            let mut s = Sampler::new(p, 50).unwrap();
            (0..40).map(|_| s.sample(&logits())).collect::<Vec<_>>()
        };
        assert_eq!(draw(p), draw(p));
        assert_ne!(draw(p), draw(SamplingParams { seed: 43, ..p }));
        let distinct: std::collections::BTreeSet<_> = draw(p).into_iter().collect();
        assert!(distinct.len() > 3, "{distinct:?}");
    }

    #[test]
    fn top_k_and_top_p_restrict_the_candidates() {
        let l = logits();
        let mut ranked: Vec<u32> = (0..50).collect();
        ranked.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
        let p = SamplingParams { temperature: 1.0, top_k: 3, top_p: 1.0, seed: 1 };
        let mut s = Sampler::new(p, 50).unwrap();
        for _ in 0..100 {
            assert!(ranked[..3].contains(&s.sample(&l)));
        }
        // A sharp distribution: the top token alone holds more than half the mass.
        let mut sharp = vec![0f32; 50];
        sharp[7] = 10.0;
        let p = SamplingParams { temperature: 1.0, top_k: 0, top_p: 0.5, seed: 3 };
        let mut s = Sampler::new(p, 50).unwrap();
        for _ in 0..50 {
            assert_eq!(s.sample(&sharp), 7);
        }
        // A flat distribution: top-p 0.09 of 50 equal tokens takes 4.5 tokens' mass, so
        // the first five by id (ties rank by id).
        let flat = vec![1f32; 50];
        let p = SamplingParams { temperature: 1.0, top_k: 0, top_p: 0.09, seed: 5 };
        let mut s = Sampler::new(p, 50).unwrap();
        for _ in 0..50 {
            assert!(s.sample(&flat) < 5);
        }
    }

    #[test]
    fn tiny_temperatures_pick_the_most_likely_token() {
        // Distinct logits (37 is prime to 50), so the most likely token is unique.
        let l: Vec<f32> = (0..50).map(|i| ((i * 37 % 50) as f32) * 0.3).collect();
        let best = argmax(&l) as u32;
        // Subnormal, below the threshold, and just above it (where 1 / t is still finite).
        for t in [1e-40, f32::MIN_POSITIVE, 1e-7, GREEDY_BELOW_TEMPERATURE, 2e-6] {
            let p = SamplingParams { temperature: t, top_k: 0, top_p: 1.0, seed: 9 };
            let mut s = Sampler::new(p, 50).unwrap();
            for _ in 0..20 {
                assert_eq!(s.sample(&l), best, "temperature {t}");
            }
            let p = SamplingParams { top_p: 0.5, ..p };
            let mut s = Sampler::new(p, 50).unwrap();
            assert_eq!(s.sample(&l), best, "temperature {t}, top-p 0.5");
        }
    }

    #[test]
    fn out_of_range_parameters_are_refused_by_name() {
        let e = SamplingParams { temperature: -1.0, ..Default::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("temperature"), "{e}");
        let e = SamplingParams { top_p: 0.0, ..Default::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("top-p") && e.to_string().contains("(0, 1]"), "{e}");
    }
}
