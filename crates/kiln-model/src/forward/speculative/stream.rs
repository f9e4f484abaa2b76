//! One speculating sequence: its history, its drafter, and the step that drafts,
//! consults the gate, verifies and rolls the cache back.

use crate::error::Result;
use crate::forward::backend::{BackendEngine, SeqCache};
use crate::forward::sampling::Sampler;
use crate::forward::transformer::{Logits, SeqChunk};

use super::drafter::{Draft, Drafter};
use super::gate::{ExactnessGate, GateKey, GateReport, WideSwitch};
use super::verify::{accept_greedy, accept_sampled};

/// Drafted tokens per verify when not told otherwise.
pub const DEFAULT_DRAFT_TOKENS: usize = 4;

/// Blocks the gate's probe compares with the chain: the stream's own draft and
/// pseudo-random continuations from the same state.
pub const PROBE_DRAWS: usize = 3;

/// What a stream has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Tokens the drafter proposed and a verify checked.
    pub drafted: u64,
    /// Of those, tokens the target accepted.
    pub accepted: u64,
    /// Verify forwards.
    pub verifies: u64,
    /// Single-token forwards (no draft, or the gate declined).
    pub classic_steps: u64,
}

impl SpecStats {
    /// accepted / drafted, when anything was drafted.
    pub fn acceptance_rate(&self) -> Option<f64> {
        (self.drafted > 0).then(|| self.accepted as f64 / self.drafted as f64)
    }

    /// Adds another stream's counts.
    pub fn add(&mut self, other: &SpecStats) {
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        self.verifies += other.verifies;
        self.classic_steps += other.classic_steps;
    }
}

/// The outcome of one step.
#[derive(Clone, Debug, Default)]
pub struct SpecStep {
    /// Tokens emitted, at least one: the accepted drafts, then the target's own token.
    pub tokens: Vec<u32>,
    /// The gate's decision when this step took it (to be logged once).
    pub gate: Option<GateReport>,
}

/// One sequence decoding speculatively. The cache holds every position of the history
/// but the last token, which is pending: the next forward feeds it.
pub struct SpecStream<'d> {
    drafter: Box<dyn Drafter + 'd>,
    key: GateKey,
    history: Vec<u32>,
    declined: bool,
    draft: Draft,
    stats: SpecStats,
}

impl<'d> SpecStream<'d> {
    /// A stream whose history is `prompt` then `first` (the token sampled from the
    /// prefill's logits); the cache must hold the prompt. `key.k` is the draft length.
    pub fn new(drafter: Box<dyn Drafter + 'd>, key: GateKey, prompt: &[u32], first: u32) -> Self {
        let mut history = Vec::with_capacity(prompt.len() + 256);
        history.extend_from_slice(prompt);
        history.push(first);
        SpecStream {
            drafter,
            key,
            history,
            declined: false,
            draft: Draft::default(),
            stats: SpecStats::default(),
        }
    }

    /// The sequence so far, prompt included; the last token is not in the cache yet.
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// Counts so far.
    pub fn stats(&self) -> SpecStats {
        self.stats
    }

    /// The gate key of this stream.
    pub fn key(&self) -> &GateKey {
        &self.key
    }

    /// The drafter's name.
    pub fn drafter_name(&self) -> &'static str {
        self.drafter.name()
    }

    /// Whether the gate sent this stream back to classic decoding.
    pub fn declined(&self) -> bool {
        self.declined
    }

    /// Emits at least one and at most `want` tokens (`want` >= 1): drafts, consults the
    /// gate at the first verify of the key, verifies in one forward and keeps the
    /// accepted prefix; or decodes one token classically when there is no draft or the
    /// gate declined.
    pub fn step<E: BackendEngine, S: WideSwitch>(
        &mut self,
        engine: &mut E,
        cache: &mut E::Cache,
        sampler: &mut Sampler,
        gate: &mut ExactnessGate<S>,
        want: usize,
    ) -> Result<SpecStep> {
        let pending = *self.history.last().expect("a stream's history holds at least its first token");
        debug_assert_eq!(cache.len() + 1, self.history.len());
        let room = engine.config().max_position_embeddings.saturating_sub(cache.len());
        let k = self.key.k.min(want.saturating_sub(1)).min(room.saturating_sub(1));
        if self.declined || k == 0 {
            self.draft.clear();
        } else {
            self.drafter.draft(&self.history, k, &mut self.draft)?;
            self.draft.tokens.truncate(k);
        }
        let mut step = SpecStep::default();
        if !self.draft.tokens.is_empty() && gate.decided(&self.key).is_none() {
            let vocab = engine.config().vocab_size;
            let (k_full, drafts) = (self.key.k, &self.draft.tokens);
            let report = gate.decide(&self.key, || {
                probe_block(engine, cache, pending, drafts, k_full.min(room - 1), vocab)
            })?;
            step.gate = Some(report);
        }
        if !self.draft.tokens.is_empty() && gate.decided(&self.key).is_some_and(|o| !o.speculates()) {
            self.declined = true;
            self.draft.clear();
        }
        if self.draft.tokens.is_empty() {
            let logits = engine.decode(cache, pending)?;
            let token = sampler.sample(logits);
            self.history.push(token);
            self.stats.classic_steps += 1;
            step.tokens.push(token);
            return Ok(step);
        }

        let drafts = &self.draft.tokens;
        let mut block = Vec::with_capacity(drafts.len() + 1);
        block.push(pending);
        block.extend_from_slice(drafts);
        let base = cache.len();
        let vocab = engine.config().vocab_size;
        let rows = engine.forward(&mut [SeqChunk { cache, tokens: &block }], Logits::All)?;
        let accepted = if sampler.params().is_greedy() {
            accept_greedy(rows, vocab, drafts)
        } else {
            accept_sampled(sampler, rows, vocab, drafts, &self.draft.dists)
        };
        // Roll back past the rejected drafts: keep the pending token and the accepted
        // ones; the correction (or bonus) token is the new pending one.
        cache.truncate(base + 1 + accepted.accepted);
        step.tokens.extend_from_slice(&drafts[..accepted.accepted]);
        step.tokens.push(accepted.next);
        self.history.extend_from_slice(&step.tokens);
        self.stats.verifies += 1;
        self.stats.drafted += drafts.len() as u64;
        self.stats.accepted += accepted.accepted as u64;
        Ok(step)
    }
}

/// The gate's probe from the cache's current state with `pending` next: for each of
/// [`PROBE_DRAWS`] blocks of `k + 1` tokens (the pending token and the stream's drafts,
/// padded, then pseudo-random continuations) runs the block in one forward and the same
/// tokens one forward each, and compares every logit bit for bit. The cache is left as
/// it was. True when every draw matched.
pub fn probe_block<E: BackendEngine>(
    engine: &mut E,
    cache: &mut E::Cache,
    pending: u32,
    drafts: &[u32],
    k: usize,
    vocab: usize,
) -> Result<bool> {
    let base = cache.len();
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ base as u64;
    let mut random = move || {
        // xorshift64*: fixed, so a probe is reproducible.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % vocab
    };
    let mut exact = true;
    for draw in 0..PROBE_DRAWS {
        let mut block = Vec::with_capacity(k + 1);
        block.push(pending);
        if draw == 0 {
            block.extend(drafts.iter().take(k));
        }
        while block.len() < k + 1 {
            block.push(random() as u32);
        }
        let together = engine.forward(&mut [SeqChunk { cache, tokens: &block }], Logits::All)?.to_vec();
        cache.truncate(base);
        for (i, &t) in block.iter().enumerate() {
            let one = engine.decode(cache, t)?;
            let same = one
                .iter()
                .zip(&together[i * vocab..(i + 1) * vocab])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            exact &= same;
        }
        cache.truncate(base);
    }
    Ok(exact)
}
