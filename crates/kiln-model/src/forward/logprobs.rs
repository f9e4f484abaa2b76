//! Log-probabilities of tokens: the log-softmax of a logits row, its most likely
//! alternatives, and teacher-forced scoring of a token sequence. `kiln score` and the
//! server's `logprobs`/`echo` both go through [`score_sequence`] and [`log_softmax`],
//! so a text scores to the same values in both.

use crate::error::Result;
use crate::forward::backend::BackendEngine;

/// `out = logits - logsumexp(logits)`, the exponentials summed in f64.
pub fn log_softmax(logits: &[f32], out: &mut [f32]) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lse = f64::from(max) + sum.ln();
    for (o, &l) in out.iter_mut().zip(logits) {
        *o = (f64::from(l) - lse) as f32;
    }
}

/// The `k` largest entries of a log-probability row as `(token, logprob)`, most likely
/// first; equal values in token order. NaN entries are never chosen.
pub fn top_logprobs(logprobs: &[f32], k: usize) -> Vec<(u32, f32)> {
    if k == 0 {
        return Vec::new();
    }
    let better = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (i, &v) in logprobs.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if top.len() == k && v <= top[k - 1].1 {
            continue;
        }
        let item = (i as u32, v);
        let at = top.partition_point(|t| better(t, &item).is_lt());
        top.insert(at, item);
        top.truncate(k);
    }
    top
}

/// Runs `tokens` into `cache` (the engine's prefill chunks, every row's logits computed)
/// and calls `each(pos, logits, logprobs)` for every position `pos >= first`: the logits
/// after token `pos` and their [`log_softmax`], the distribution of token `pos + 1`.
pub fn score_sequence<E: BackendEngine>(
    engine: &mut E,
    cache: &mut E::Cache,
    tokens: &[u32],
    first: usize,
    mut each: impl FnMut(usize, &[f32], &[f32]),
) -> Result<()> {
    let vocab = engine.config().vocab_size;
    let mut lp = vec![0f32; vocab];
    engine.prefill_each_logits(cache, tokens, &mut |start, logits| {
        for (r, row) in logits.chunks_exact(vocab).enumerate() {
            let pos = start + r;
            if pos >= first {
                log_softmax(row, &mut lp);
                each(pos, row, &lp);
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_matches_hand_values() {
        let mut out = [0f32; 3];
        log_softmax(&[0.0, 0.0, (2f32).ln()], &mut out);
        // Probabilities 1/4, 1/4, 1/2.
        assert!((out[0] - (0.25f32).ln()).abs() < 1e-6);
        assert!((out[2] - (0.5f32).ln()).abs() < 1e-6);
    }

    #[test]
    fn top_logprobs_are_the_largest_most_likely_first_ties_by_id() {
        let row = [-3.0, -1.0, f32::NAN, -1.0, -0.5, -7.0];
        assert_eq!(top_logprobs(&row, 3), vec![(4, -0.5), (1, -1.0), (3, -1.0)]);
        assert_eq!(top_logprobs(&row, 0), vec![]);
        assert_eq!(top_logprobs(&row, 10).len(), 5, "NaN is never chosen");
        assert_eq!(top_logprobs(&row, 10).last(), Some(&(5, -7.0)));
    }
}
