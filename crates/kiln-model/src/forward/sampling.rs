//! Choosing the next token from logits: greedy (temperature 0), or sampling at a
//! temperature from the tokens min-p keeps, then the top-k tokens and then the smallest set
//! whose probability reaches top-p, with a seeded generator so a seed reproduces a run
//! exactly. Before that, [`Penalizer`] adjusts a sequence's logits row (logit bias, then
//! the repetition, frequency and presence penalties), in the order vLLM's sampler applies
//! them.

use std::collections::HashMap;

use rand_core::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::error::{ModelError, Result};
use crate::forward::ops::{argmax, exp};

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
    /// Drop tokens whose probability (after the temperature) is below `min_p` times the
    /// most likely token's, before top-k and top-p; 0 keeps all. Greedy ignores it.
    pub min_p: f32,
    /// Seed of the generator.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 0 }
    }
}

impl SamplingParams {
    /// Whether this picks the most likely token every time: a temperature below
    /// [`GREEDY_BELOW_TEMPERATURE`], or top-k 1.
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_BELOW_TEMPERATURE || self.top_k == 1
    }

    /// Checks the ranges: temperature finite and >= 0, top-p in (0, 1], min-p in [0, 1].
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
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(ModelError::InvalidArgument {
                what: "min-p".into(),
                message: format!("{} is out of range: accepted values are 0 to 1", self.min_p),
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
        }
        // The probabilities are relative to the most likely token's (which is 1), so
        // min-p's threshold is min-p itself.
        min_p_filter(probs, self.params.min_p);
        for &p in probs.iter() {
            total += p as f64;
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
    /// temperature, then min-p, then top-k, then top-p, renormalised; tokens outside the candidates
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
        min_p_filter(out, self.params.min_p);
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

/// Zeroes the probabilities below `min_p`; `probs` are relative to the largest, which is
/// 1, so the largest always stays.
fn min_p_filter(probs: &mut [f32], min_p: f32) {
    if min_p > 0.0 {
        probs.iter_mut().filter(|p| **p < min_p).for_each(|p| *p = 0.0);
    }
}

/// What a request does to its sequence's logits row before sampling: a bias per token
/// id, and the repetition, frequency and presence penalties. Applied by [`Penalizer`] in
/// vLLM's order: the bias, then for every token seen so far the repetition penalty
/// (prompt and output tokens, as vLLM and Hugging Face count them: a positive logit is
/// divided by it, a negative one multiplied), then the frequency penalty times the
/// token's count in the output and the presence penalty once for a token in the output
/// (output tokens only, as OpenAI defines them). Temperature, min-p, top-k and top-p
/// follow in [`Sampler`].
#[derive(Clone, Debug, PartialEq)]
pub struct LogitAdjustments {
    /// Added to the logit of each token id.
    pub logit_bias: Vec<(u32, f32)>,
    /// Above 0; 1 is off.
    pub repetition_penalty: f32,
    /// Subtracted per occurrence in the output, -2 to 2; 0 is off.
    pub frequency_penalty: f32,
    /// Subtracted once for a token in the output, -2 to 2; 0 is off.
    pub presence_penalty: f32,
}

impl Default for LogitAdjustments {
    fn default() -> Self {
        LogitAdjustments {
            logit_bias: Vec::new(),
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
        }
    }
}

impl LogitAdjustments {
    /// Whether these leave every logit as it is.
    pub fn is_off(&self) -> bool {
        self.logit_bias.is_empty()
            && self.repetition_penalty == 1.0
            && self.frequency_penalty == 0.0
            && self.presence_penalty == 0.0
    }

    /// Checks the ranges: biases finite, in [-100, 100] and for ids below `vocab`;
    /// repetition penalty finite and above 0; frequency and presence penalties in [-2, 2].
    pub fn validate(&self, vocab: usize) -> Result<()> {
        let bad =
            |what: &str, message: String| Err(ModelError::InvalidArgument { what: what.into(), message });
        for &(id, bias) in &self.logit_bias {
            if id as usize >= vocab {
                return bad(
                    "logit-bias",
                    format!(
                        "token id {id} is outside the vocabulary: accepted ids are 0 to {}",
                        vocab.saturating_sub(1)
                    ),
                );
            }
            if !(-100.0..=100.0).contains(&bias) {
                return bad(
                    "logit-bias",
                    format!("{bias} for token id {id} is out of range: accepted values are -100 to 100"),
                );
            }
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(
                "repetition-penalty",
                format!(
                    "{} is out of range: accepted values are finite and above 0 (1 = off)",
                    self.repetition_penalty
                ),
            );
        }
        for (what, v) in
            [("frequency-penalty", self.frequency_penalty), ("presence-penalty", self.presence_penalty)]
        {
            if !(-2.0..=2.0).contains(&v) {
                return bad(what, format!("{v} is out of range: accepted values are -2 to 2"));
            }
        }
        Ok(())
    }
}

/// A sequence's [`LogitAdjustments`] and the counts of its tokens so far.
#[derive(Clone, Debug)]
pub struct Penalizer {
    adjust: LogitAdjustments,
    /// Every token of the prompt and the output, with its count in the output.
    seen: HashMap<u32, u32>,
}

impl Penalizer {
    /// A penalizer for a sequence that starts with `prompt`.
    pub fn new(adjust: LogitAdjustments, prompt: &[u32]) -> Self {
        let mut seen = HashMap::new();
        if adjust.repetition_penalty != 1.0 {
            for &t in prompt {
                seen.entry(t).or_insert(0);
            }
        }
        Penalizer { adjust, seen }
    }

    /// Counts `token` as generated.
    pub fn observe(&mut self, token: u32) {
        *self.seen.entry(token).or_insert(0) += 1;
    }

    /// Adjusts the sequence's next logits row in place. Ids past the row are skipped.
    pub fn apply(&self, logits: &mut [f32]) {
        let a = &self.adjust;
        for &(id, bias) in &a.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
        for (&id, &count) in &self.seen {
            let Some(l) = logits.get_mut(id as usize) else { continue };
            if a.repetition_penalty != 1.0 {
                *l = if *l > 0.0 { *l / a.repetition_penalty } else { *l * a.repetition_penalty };
            }
            *l -= a.frequency_penalty * count as f32;
            if count > 0 {
                *l -= a.presence_penalty;
            }
        }
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
        let p = SamplingParams { temperature: 0.8, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 42 };
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
        let p = SamplingParams { temperature: 1.0, top_k: 3, top_p: 1.0, min_p: 0.0, seed: 1 };
        let mut s = Sampler::new(p, 50).unwrap();
        for _ in 0..100 {
            assert!(ranked[..3].contains(&s.sample(&l)));
        }
        // A sharp distribution: the top token alone holds more than half the mass.
        let mut sharp = vec![0f32; 50];
        sharp[7] = 10.0;
        let p = SamplingParams { temperature: 1.0, top_k: 0, top_p: 0.5, min_p: 0.0, seed: 3 };
        let mut s = Sampler::new(p, 50).unwrap();
        for _ in 0..50 {
            assert_eq!(s.sample(&sharp), 7);
        }
        // A flat distribution: top-p 0.09 of 50 equal tokens takes 4.5 tokens' mass, so
        // the first five by id (ties rank by id).
        let flat = vec![1f32; 50];
        let p = SamplingParams { temperature: 1.0, top_k: 0, top_p: 0.09, min_p: 0.0, seed: 5 };
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
            let p = SamplingParams { temperature: t, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 9 };
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

    fn adjusted(adjust: LogitAdjustments, prompt: &[u32], output: &[u32], logits: &[f32]) -> Vec<f32> {
        let mut p = Penalizer::new(adjust, prompt);
        for &t in output {
            p.observe(t);
        }
        let mut l = logits.to_vec();
        p.apply(&mut l);
        l
    }

    #[test]
    fn logit_bias_adds_to_the_named_ids() {
        let a = LogitAdjustments { logit_bias: vec![(0, 5.0), (2, -100.0)], ..Default::default() };
        assert_eq!(adjusted(a, &[], &[], &[1.0, 2.0, 3.0]), [6.0, 2.0, -97.0]);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output() {
        let a = LogitAdjustments { repetition_penalty: 2.0, ..Default::default() };
        // Token 0 is in the prompt, 1 in the output, 2 in neither; a repeated token is
        // penalised once.
        let l = adjusted(a, &[0, 0], &[1, 1], &[2.0, -1.0, 3.0]);
        assert_eq!(l, [1.0, -2.0, 3.0]);
    }

    #[test]
    fn frequency_and_presence_penalties_count_output_tokens_only() {
        let a = LogitAdjustments { frequency_penalty: 0.5, presence_penalty: 0.25, ..Default::default() };
        // Token 0 only in the prompt: untouched. Token 1 twice in the output:
        // 0 - 2 * 0.5 - 0.25. Token 2 once: 0 - 0.5 - 0.25.
        let l = adjusted(a, &[0, 3], &[1, 2, 1], &[0.0, 0.0, 0.0, 1.0]);
        assert_eq!(l, [0.0, -1.25, -0.75, 1.0]);
        // Negative penalties encourage repeats.
        let a = LogitAdjustments { frequency_penalty: -1.0, presence_penalty: -2.0, ..Default::default() };
        assert_eq!(adjusted(a, &[], &[0, 0, 0], &[1.0, 1.0]), [6.0, 1.0]);
    }

    #[test]
    fn the_bias_comes_before_the_penalties() {
        // vLLM's order: (1 + 3) / 2 - 0.5 * 1 - 1 = 0.5; the penalty first would give
        // 1 / 2 + 3 - 1.5 = 2.
        let a = LogitAdjustments {
            logit_bias: vec![(0, 3.0)],
            repetition_penalty: 2.0,
            frequency_penalty: 0.5,
            presence_penalty: 1.0,
        };
        assert_eq!(adjusted(a, &[], &[0], &[1.0, 0.0]), [0.5, 0.0]);
    }

    #[test]
    fn min_p_drops_tokens_below_its_share_of_the_top_probability_after_the_temperature() {
        // Probabilities relative to the top: 1, 0.5, 0.09, 0.11.
        let l: Vec<f32> = [1.0f32, 0.5, 0.09, 0.11].iter().map(|p| p.ln()).collect();
        let p = SamplingParams { temperature: 1.0, min_p: 0.1, seed: 1, ..Default::default() };
        let mut s = Sampler::new(p, 4).unwrap();
        let mut d = Vec::new();
        s.distribution(&l, &mut d);
        let total = 1.0 + 0.5 + 0.11;
        for (got, want) in d.iter().zip([1.0 / total, 0.5 / total, 0.0, 0.11 / total]) {
            assert!((got - want).abs() < 1e-6, "{d:?}");
        }
        for _ in 0..200 {
            assert_ne!(s.sample(&l), 2);
        }
        // At temperature 2 the relative probabilities are the square roots (1, 0.707,
        // 0.3, 0.332): min-p 0.31 keeps token 3 and drops token 2, which min-p 0.31 at
        // temperature 1 would drop with token 3.
        let p = SamplingParams { temperature: 2.0, min_p: 0.31, seed: 1, ..Default::default() };
        let mut s = Sampler::new(p, 4).unwrap();
        s.distribution(&l, &mut d);
        assert!(d[2] == 0.0 && d[3] > 0.0 && d[1] > 0.0, "{d:?}");
        // min-p 1 keeps the top token only; greedy ignores min-p.
        let mut s =
            Sampler::new(SamplingParams { temperature: 1.0, min_p: 1.0, ..Default::default() }, 4).unwrap();
        for _ in 0..20 {
            assert_eq!(s.sample(&l), 0);
        }
    }

    #[test]
    fn out_of_range_adjustments_are_refused_by_name() {
        let e = SamplingParams { min_p: 1.5, ..Default::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("min-p") && e.to_string().contains("0 to 1"), "{e}");
        let cases = [
            (LogitAdjustments { logit_bias: vec![(9, 1.0)], ..Default::default() }, "logit-bias"),
            (LogitAdjustments { logit_bias: vec![(0, 101.0)], ..Default::default() }, "logit-bias"),
            (LogitAdjustments { repetition_penalty: 0.0, ..Default::default() }, "repetition-penalty"),
            (
                LogitAdjustments { repetition_penalty: f32::INFINITY, ..Default::default() },
                "repetition-penalty",
            ),
            (LogitAdjustments { frequency_penalty: 2.5, ..Default::default() }, "frequency-penalty"),
            (LogitAdjustments { presence_penalty: -2.5, ..Default::default() }, "presence-penalty"),
        ];
        for (a, what) in cases {
            let e = a.validate(4).unwrap_err();
            assert!(e.to_string().contains(what), "{e}");
        }
        assert!(LogitAdjustments::default().is_off());
        assert!(LogitAdjustments { presence_penalty: 2.0, ..Default::default() }.validate(4).is_ok());
    }
}
