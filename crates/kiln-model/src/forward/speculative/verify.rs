//! Accepting a verified draft. The verify forward gives K + 1 rows of logits: row i is
//! the target's prediction after the pending token and the first i drafted tokens.
//! Greedy acceptance keeps the longest prefix of the draft that matches the target's
//! argmax and then takes the argmax of the first row that disagrees (or of the last row
//! when all agree), so the tokens are exactly the ones one-token-at-a-time greedy decode
//! would produce from the same logits. Sampled acceptance is the standard rejection
//! rule: draft token x drawn from q is kept with probability min(1, p(x) / q(x)); on
//! the first rejection the replacement is drawn from the residual max(0, p - q),
//! renormalised, which makes every emitted token distributed exactly as p.

use crate::forward::ops::argmax;
use crate::forward::sampling::Sampler;

/// What a verify accepted: how many drafted tokens, and the token that follows them
/// (the correction at the first rejection, or the bonus token after a full acceptance).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accepted {
    /// Drafted tokens kept.
    pub accepted: usize,
    /// The token emitted after them.
    pub next: u32,
}

/// Greedy acceptance over `rows` (`[drafts.len() + 1, vocab]`).
pub fn accept_greedy(rows: &[f32], vocab: usize, drafts: &[u32]) -> Accepted {
    for (i, &d) in drafts.iter().enumerate() {
        let best = argmax(&rows[i * vocab..(i + 1) * vocab]) as u32;
        if best != d {
            return Accepted { accepted: i, next: best };
        }
    }
    let n = drafts.len();
    Accepted { accepted: n, next: argmax(&rows[n * vocab..(n + 1) * vocab]) as u32 }
}

/// Sampled acceptance over `rows` (`[drafts.len() + 1, vocab]`) under the sampler's
/// parameters. `dists[i]` is the distribution `drafts[i]` was drawn from; an empty
/// `dists` means every draft was deterministic (all of q's mass on the drafted token).
pub fn accept_sampled(
    sampler: &mut Sampler,
    rows: &[f32],
    vocab: usize,
    drafts: &[u32],
    dists: &[Vec<f32>],
) -> Accepted {
    let mut p = Vec::with_capacity(vocab);
    for (i, &d) in drafts.iter().enumerate() {
        sampler.distribution(&rows[i * vocab..(i + 1) * vocab], &mut p);
        let q = dists.get(i);
        let px = p[d as usize] as f64;
        let qx = q.map_or(1.0, |q| q[d as usize] as f64);
        let u = sampler.uniform();
        if qx > 0.0 && u * qx < px {
            continue;
        }
        // Residual: max(0, p - q), which for a deterministic draft is p without x.
        match q {
            Some(q) => p.iter_mut().zip(q).for_each(|(p, &q)| *p = (*p - q).max(0.0)),
            None => p[d as usize] = 0.0,
        }
        let next = if p.iter().any(|&v| v > 0.0) {
            sampler.draw(&p)
        } else {
            // p equals q to rounding: any draw from p is as good; take p's mode.
            argmax(&rows[i * vocab..(i + 1) * vocab]) as u32
        };
        return Accepted { accepted: i, next };
    }
    let n = drafts.len();
    sampler.distribution(&rows[n * vocab..(n + 1) * vocab], &mut p);
    Accepted { accepted: n, next: sampler.draw(&p) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forward::sampling::SamplingParams;

    #[test]
    fn greedy_keeps_the_agreeing_prefix_then_corrects() {
        let v = 4;
        // Row argmaxes: 2, 1, 3, 0.
        let rows = [0., 0., 5., 0., 0., 5., 0., 0., 0., 0., 0., 5., 5., 0., 0., 0.];
        assert_eq!(accept_greedy(&rows, v, &[2, 1, 3]), Accepted { accepted: 3, next: 0 });
        assert_eq!(accept_greedy(&rows, v, &[2, 0, 3]), Accepted { accepted: 1, next: 1 });
        assert_eq!(accept_greedy(&rows, v, &[3, 1, 3]), Accepted { accepted: 0, next: 2 });
        assert_eq!(accept_greedy(&rows[..v], v, &[]), Accepted { accepted: 0, next: 2 });
    }

    /// The emitted first token must be distributed as the target's p whatever the draft
    /// proposes: a deterministic draft, and a draft sampled from a different q.
    #[test]
    fn the_rejection_rule_samples_the_target_distribution() {
        let v = 4;
        let logits = [1.0f32, 0.2, -0.5, 0.7];
        let params = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 11 };
        let mut sampler = Sampler::new(params, v).unwrap();
        let mut p = Vec::new();
        sampler.distribution(&logits, &mut p);
        let rows: Vec<f32> = logits.iter().chain(logits.iter()).copied().collect();
        let q = vec![0.1f32, 0.6, 0.2, 0.1];
        let trials = 40_000;
        for case in 0..3 {
            let mut counts = [0usize; 4];
            let mut qs = Sampler::new(SamplingParams { seed: 99, ..params }, v).unwrap();
            for _ in 0..trials {
                let (draft, dists) = match case {
                    0 => (1u32, Vec::new()),
                    1 => (0u32, Vec::new()),
                    _ => (qs.draw(&q), vec![q.clone()]),
                };
                let a = accept_sampled(&mut sampler, &rows, v, &[draft], &dists);
                let first = if a.accepted == 1 { draft } else { a.next };
                counts[first as usize] += 1;
            }
            for t in 0..v {
                let got = counts[t] as f64 / trials as f64;
                let sd = (p[t] as f64 * (1.0 - p[t] as f64) / trials as f64).sqrt();
                assert!((got - p[t] as f64).abs() < 5.0 * sd, "case {case} token {t}: {got} vs {}", p[t]);
            }
        }
    }
}
