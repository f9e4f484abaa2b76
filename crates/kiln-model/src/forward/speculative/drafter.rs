//! Drafters: what proposes the tokens a verify block checks. [`PromptLookup`] finds the
//! sequence's last few tokens earlier in the sequence and proposes what followed them there
//! (no weights, works on every model); [`DraftModel`] runs a smaller model of the same
//! vocabulary ahead of the target.

use kiln_core::MemoryPool;

use crate::error::{ModelError, Result};
use crate::forward::engine::{Engine, EngineOptions};
use crate::forward::kv_cache::KvCache;
use crate::forward::ops::argmax;
use crate::forward::sampling::{Sampler, SamplingParams};
use crate::model::LoadedModel;

/// Tokens proposed to follow a sequence, with the distribution each was drawn from when
/// the drafter samples (empty when every token was chosen deterministically, which the
/// rejection rule treats as a distribution with all its mass on the token).
#[derive(Clone, Debug, Default)]
pub struct Draft {
    /// The proposed tokens, in order.
    pub tokens: Vec<u32>,
    /// For each token, the drafter's distribution over the vocabulary; empty when the
    /// drafter is deterministic.
    pub dists: Vec<Vec<f32>>,
}

impl Draft {
    /// Forgets the previous proposal.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.dists.clear();
    }
}

/// Proposes tokens to follow a sequence.
pub trait Drafter {
    /// A short name for reports (`prompt-lookup`, `draft-model`).
    fn name(&self) -> &'static str;

    /// Fills `draft` with at most `k` tokens to follow `history` (the whole sequence so
    /// far, prompt included). Proposing none is allowed: the step then decodes one token
    /// classically.
    fn draft(&mut self, history: &[u32], k: usize, draft: &mut Draft) -> Result<()>;
}

/// Drafts by prompt lookup: the longest suffix of the sequence (at most `max_ngram`
/// tokens, at least `min_ngram`) that also occurs earlier proposes the tokens that
/// followed its latest earlier occurrence.
#[derive(Clone, Copy, Debug)]
pub struct PromptLookup {
    /// Longest suffix tried.
    pub max_ngram: usize,
    /// Shortest suffix accepted as a match.
    pub min_ngram: usize,
}

impl Default for PromptLookup {
    fn default() -> Self {
        PromptLookup { max_ngram: 3, min_ngram: 1 }
    }
}

impl PromptLookup {
    /// The tokens that followed an earlier occurrence of the longest matching suffix, at
    /// most `k` of them: the latest occurrence that still has `k` tokens after it, else
    /// the earliest (the one with the most), so a short period (`a b a b a b`) still
    /// drafts k tokens instead of the one or two before the end of the sequence.
    pub fn lookup<'h>(&self, history: &'h [u32], k: usize) -> &'h [u32] {
        let len = history.len();
        for n in (self.min_ngram.max(1)..=self.max_ngram.min(len.saturating_sub(1))).rev() {
            let suffix = &history[len - n..];
            // An occurrence must end before the suffix itself starts, to have a
            // continuation that is not the suffix.
            let mut earliest = None;
            for start in (0..len - n).rev() {
                if &history[start..start + n] == suffix {
                    let from = start + n;
                    if from + k <= len {
                        return &history[from..from + k];
                    }
                    earliest = Some(from);
                }
            }
            if let Some(from) = earliest {
                return &history[from..(from + k).min(len)];
            }
        }
        &[]
    }
}

impl Drafter for PromptLookup {
    fn name(&self) -> &'static str {
        "prompt-lookup"
    }

    fn draft(&mut self, history: &[u32], k: usize, draft: &mut Draft) -> Result<()> {
        draft.clear();
        draft.tokens.extend_from_slice(self.lookup(history, k));
        Ok(())
    }
}

/// Drafts with a smaller model of the same vocabulary, run ahead of the target over its
/// own cache. Greedy parameters draft the draft model's argmax; sampling parameters draw
/// from its distribution under the same temperature, top-k and top-p, and keep that
/// distribution for the rejection rule.
pub struct DraftModel<'d> {
    engine: Engine<'d>,
    cache: KvCache,
    /// The tokens the cache holds, so only what changed since the last draft is fed.
    fed: Vec<u32>,
    sampler: Sampler,
}

impl<'d> DraftModel<'d> {
    /// A drafter over `draft`, checked against the target's vocabulary size.
    pub fn new(
        draft: &'d LoadedModel,
        target_vocab: usize,
        pool: &MemoryPool,
        options: EngineOptions,
        params: SamplingParams,
    ) -> Result<Self> {
        check_vocabulary(draft, target_vocab)?;
        // `--expert-slots` sizes the target's expert cache; the draft keeps its experts
        // (if it has any) resident.
        let engine = Engine::new(draft, pool, EngineOptions { expert_slots: None, ..options })?;
        let cache = engine.new_cache();
        // The draft's generator must not replay the target sampler's draws.
        let sampler =
            Sampler::new(SamplingParams { seed: params.seed ^ 0x5eed_d4af, ..params }, target_vocab)?;
        Ok(DraftModel { engine, cache, fed: Vec::new(), sampler })
    }
}

/// Refuses a draft model whose vocabulary differs from the target's.
pub fn check_vocabulary(draft: &LoadedModel, target_vocab: usize) -> Result<()> {
    let v = draft.config.vocab_size;
    if v != target_vocab {
        return Err(ModelError::InvalidArgument {
            what: "draft model".into(),
            message: format!(
                "{} has a vocabulary of {v} tokens but the target's has {target_vocab}: \
                 a draft model must share the target's vocabulary",
                draft.source.display_path()
            ),
        });
    }
    Ok(())
}

impl Drafter for DraftModel<'_> {
    fn name(&self) -> &'static str {
        "draft-model"
    }

    fn draft(&mut self, history: &[u32], k: usize, draft: &mut Draft) -> Result<()> {
        draft.clear();
        if k == 0 || history.is_empty() {
            return Ok(());
        }
        // Keep the longest prefix the cache already holds, but feed at least the last
        // token so there are logits to draft from.
        let common = self.fed.iter().zip(history).take_while(|(a, b)| a == b).count().min(history.len() - 1);
        let room = self.engine.config().max_position_embeddings.saturating_sub(history.len());
        let k = k.min(room);
        if k == 0 {
            return Ok(());
        }
        self.cache.truncate(common);
        self.fed.truncate(common);
        let greedy = self.sampler.params().is_greedy();
        let mut logits = self.engine.prefill(&mut self.cache, &history[common..])?;
        self.fed.extend_from_slice(&history[common..]);
        for i in 0..k {
            let token = if greedy {
                argmax(logits) as u32
            } else {
                let mut dist = Vec::new();
                self.sampler.distribution(logits, &mut dist);
                let token = self.sampler.draw(&dist);
                draft.dists.push(dist);
                token
            };
            draft.tokens.push(token);
            if i + 1 < k {
                logits = self.engine.decode(&mut self.cache, token)?;
                self.fed.push(token);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lookup_continues_the_latest_match_of_the_longest_suffix() {
        let pl = PromptLookup::default();
        // "1 2 3" occurs at 0 and is the suffix; what followed is 4 5 6.
        assert_eq!(pl.lookup(&[1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 3), &[4, 5, 6]);
        assert_eq!(pl.lookup(&[1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 10), &[4, 5, 6, 9, 1, 2, 3]);
        // The latest of two occurrences with k tokens after it wins.
        assert_eq!(pl.lookup(&[7, 1, 8, 7, 1, 9, 7, 1], 1), &[9]);
        assert_eq!(pl.lookup(&[7, 1, 8, 7, 1, 9, 7, 1], 3), &[9, 7, 1]);
        assert_eq!(pl.lookup(&[7, 1, 8, 7, 1, 9, 7, 1], 4), &[8, 7, 1, 9]);
        // A period of one: the latest match has one token after it, an earlier one four.
        assert_eq!(pl.lookup(&[5, 4, 4, 4, 4, 4, 4, 4, 4], 4), &[4, 4, 4, 4]);
        // A longer suffix beats a later shorter one: "2 7" matches at 1, "7" alone later.
        assert_eq!(pl.lookup(&[5, 2, 7, 4, 7, 6, 2, 7], 2), &[4, 7]);
        // Nothing repeats: no proposal.
        assert!(pl.lookup(&[1, 2, 3, 4], 4).is_empty());
        assert!(pl.lookup(&[1], 4).is_empty());
        assert!(pl.lookup(&[], 4).is_empty());
        let strict = PromptLookup { max_ngram: 3, min_ngram: 2 };
        assert!(strict.lookup(&[7, 1, 8, 7], 2).is_empty());
    }
}
