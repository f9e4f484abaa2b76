//! Running a model: [`Engine`] owns the forward's workspace and runs prefill (chunked),
//! single-sequence decode and batched decode over caches the caller owns; [`Session`] is
//! one sequence with its cache, the simplest way to turn a prompt into logits and tokens.
//!
//! ```no_run
//! # fn main() -> kiln_model::Result<()> {
//! use kiln_core::MemoryPool;
//! use kiln_model::{EngineOptions, LoadOptions, Session};
//!
//! let pool = MemoryPool::unlimited();
//! let model = kiln_model::load("synthetic:tiny", &LoadOptions { pool: pool.clone(), quantize: None })?;
//! let mut session = Session::new(&model, &pool, EngineOptions::default())?;
//! let logits = session.prefill(&[256, 72, 105])?; // [vocab] for the last prompt token
//! let next = kiln_model::ops::argmax(logits) as u32;
//! let logits = session.decode_step(next)?;
//! # let _ = logits;
//! # Ok(())
//! # }
//! ```

use kiln_core::MemoryPool;

use crate::error::{ModelError, Result};
use crate::forward::attention::AttentionKind;
use crate::forward::kv_cache::{KvCache, KvDtype};
use crate::forward::ops::argmax;
use crate::forward::plan::{MemoryPlan, RunShape, WorkspaceShape};
use crate::forward::transformer::{Logits, SeqChunk, Transformer};
use crate::forward::weights::ModelWeights;
use crate::forward::workspace::Workspace;
use crate::loading::config::ModelConfig;
use crate::model::LoadedModel;

/// How an engine runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineOptions {
    /// Attention implementation.
    pub attention: AttentionKind,
    /// Prompt tokens per prefill forward; 0 runs the whole prompt in one forward.
    pub prefill_chunk: usize,
    /// Cache storage type.
    pub kv_dtype: KvDtype,
    /// Resident expert slots of a MoE model (`--expert-slots`); `None` keeps every
    /// expert resident in its backing store.
    pub expert_slots: Option<usize>,
}

/// A model with a workspace, running forwards over caches the caller owns.
pub struct Engine<'m> {
    transformer: Transformer<'m>,
    workspace: Workspace,
    pool: MemoryPool,
    options: EngineOptions,
}

impl<'m> Engine<'m> {
    /// An engine over a loaded model; the workspace grows on first use.
    pub fn new(model: &'m LoadedModel, pool: &MemoryPool, options: EngineOptions) -> Result<Self> {
        Self::from_parts(&model.config, &model.weights, pool, options)
    }

    /// An engine over a configuration and weights.
    pub fn from_parts(
        config: &'m ModelConfig,
        weights: &'m ModelWeights,
        pool: &MemoryPool,
        options: EngineOptions,
    ) -> Result<Self> {
        let mut transformer = Transformer::new(config, weights, options.attention)?;
        if let Some(slots) = options.expert_slots {
            transformer.set_expert_cache(crate::forward::expert_cache::build(config, weights, slots, pool)?);
        }
        let workspace = Workspace::empty(config, pool)?;
        Ok(Engine { transformer, workspace, pool: pool.clone(), options })
    }

    /// Allocates the workspace for `shape` now (a memory plan's workspace), so the run
    /// allocates no activations later.
    pub fn reserve_workspace(&mut self, shape: WorkspaceShape) -> Result<()> {
        self.workspace.ensure(self.transformer.config(), shape.rows, shape.logit_rows)?;
        Ok(())
    }

    /// The forward pass.
    pub fn transformer(&self) -> &Transformer<'m> {
        &self.transformer
    }

    /// The model's configuration.
    pub fn config(&self) -> &'m ModelConfig {
        self.transformer.config()
    }

    /// The options the engine was made with.
    pub fn options(&self) -> EngineOptions {
        self.options
    }

    /// An empty cache for a new sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.transformer.kv_layout(self.options.kv_dtype), &self.pool)
    }

    fn chunk(&self, tokens: usize) -> usize {
        match self.options.prefill_chunk {
            0 => tokens.max(1),
            c => c,
        }
    }

    fn check_context(&self, cache: &KvCache, new: usize) -> Result<()> {
        kiln_protocol::check_context(cache.len(), new, self.config().max_position_embeddings)
            .map_err(|e| ModelError::ContextExceeded { requested: e.requested, limit: e.limit })
    }

    /// Appends `tokens` to the sequence of `cache` in chunks of the engine's
    /// `prefill_chunk`, and returns the logits of the last token (`[vocab]`).
    pub fn prefill(&mut self, cache: &mut KvCache, tokens: &[u32]) -> Result<&[f32]> {
        self.check_context(cache, tokens.len())?;
        let chunk = self.chunk(tokens.len());
        let (head, last) = split_last_chunk(tokens, chunk);
        for part in head.chunks(chunk) {
            self.transformer.forward(
                &mut self.workspace,
                &mut [SeqChunk { cache, tokens: part }],
                Logits::None,
            )?;
        }
        self.transformer.forward(&mut self.workspace, &mut [SeqChunk { cache, tokens: last }], Logits::Last)
    }

    /// Like [`Self::prefill`], but returns the logits of every token (`[tokens, vocab]`),
    /// as reference comparisons need.
    pub fn prefill_all_logits(&mut self, cache: &mut KvCache, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut all = Vec::with_capacity(tokens.len() * self.config().vocab_size);
        self.prefill_each_logits(cache, tokens, |_, logits| all.extend_from_slice(logits))?;
        Ok(all)
    }

    /// Like [`Self::prefill_all_logits`], but hands each chunk's logits to `each` as it
    /// is computed (`each(first token index, [chunk tokens, vocab])`), so no more than
    /// one chunk's logits are held.
    pub fn prefill_each_logits(
        &mut self,
        cache: &mut KvCache,
        tokens: &[u32],
        mut each: impl FnMut(usize, &[f32]),
    ) -> Result<()> {
        self.check_context(cache, tokens.len())?;
        let chunk = self.chunk(tokens.len());
        for (i, part) in tokens.chunks(chunk).enumerate() {
            let logits = self.transformer.forward(
                &mut self.workspace,
                &mut [SeqChunk { cache, tokens: part }],
                Logits::All,
            )?;
            each(i * chunk, logits);
        }
        Ok(())
    }

    /// Appends one token and returns the logits after it (`[vocab]`).
    pub fn decode(&mut self, cache: &mut KvCache, token: u32) -> Result<&[f32]> {
        let tokens = [token];
        self.transformer.forward(
            &mut self.workspace,
            &mut [SeqChunk { cache, tokens: &tokens }],
            Logits::Last,
        )
    }

    /// Appends `tokens[i]` to sequence `caches[i]` for every i in one forward (the
    /// projections run with M = B rows) and returns the logits `[B, vocab]`, row i for
    /// sequence i.
    pub fn decode_batch(&mut self, caches: &mut [KvCache], tokens: &[u32]) -> Result<&[f32]> {
        if caches.len() != tokens.len() {
            return Err(ModelError::InvalidArgument {
                what: "batched decode".into(),
                message: format!(
                    "{} caches but {} tokens: give one token per sequence",
                    caches.len(),
                    tokens.len()
                ),
            });
        }
        let mut seqs: Vec<SeqChunk<'_>> = caches
            .iter_mut()
            .zip(tokens.chunks(1))
            .map(|(cache, tokens)| SeqChunk { cache, tokens })
            .collect();
        self.transformer.forward(&mut self.workspace, &mut seqs, Logits::Last)
    }

    /// One forward over any mix of sequences and token counts.
    pub fn forward(&mut self, seqs: &mut [SeqChunk<'_>], logits: Logits) -> Result<&[f32]> {
        self.transformer.forward(&mut self.workspace, seqs, logits)
    }
}

impl crate::forward::backend::BackendEngine for Engine<'_> {
    type Cache = KvCache;

    fn capabilities() -> crate::forward::backend::Capabilities {
        crate::forward::backend::CPU
    }

    fn plan(config: &ModelConfig, weights_bytes: u64, shape: &RunShape) -> Result<MemoryPlan> {
        crate::forward::plan::plan(config, weights_bytes, shape)
    }

    fn config(&self) -> &ModelConfig {
        self.transformer.config()
    }

    fn memory_limit(&self) -> u64 {
        self.pool.limit()
    }

    fn expert_stats(&self) -> Option<crate::forward::expert_cache::CacheStats> {
        self.transformer.expert_cache().map(|c| c.stats())
    }

    fn reset_expert_stats(&mut self) {
        if let Some(mut c) = self.transformer.expert_cache() {
            c.reset_stats();
        }
    }

    fn memory_stats(&self) -> kiln_core::PoolStats {
        self.pool.stats()
    }

    fn cache_bytes_for(&self, tokens: usize) -> u64 {
        self.transformer.kv_layout(self.options.kv_dtype).bytes_for(tokens)
    }

    fn prefill_chunk(&self, prompt_tokens: usize) -> usize {
        self.chunk(prompt_tokens)
    }

    fn new_cache(&self, _capacity: usize) -> Result<KvCache> {
        // The CPU's cache grows block by block as positions land.
        Ok(Engine::new_cache(self))
    }

    fn copy_prefix(&self, dst: &mut KvCache, src: &KvCache, n: usize) -> Result<()> {
        Ok(dst.copy_prefix_from(src, n)?)
    }

    fn reserve(&mut self, shape: WorkspaceShape, _capacity: usize) -> Result<()> {
        self.reserve_workspace(shape)
    }

    fn forward(&mut self, seqs: &mut [SeqChunk<'_>], logits: Logits) -> Result<&[f32]> {
        Engine::forward(self, seqs, logits)
    }

    // The CPU's own prefill skips the LM head of every chunk but the last and checks the
    // context once, as the provided one does: the same forwards.
    fn prefill(&mut self, cache: &mut KvCache, tokens: &[u32]) -> Result<&[f32]> {
        Engine::prefill(self, cache, tokens)
    }
}

/// Splits `tokens` into whole chunks and the final chunk (never empty unless `tokens` is).
fn split_last_chunk(tokens: &[u32], chunk: usize) -> (&[u32], &[u32]) {
    if tokens.is_empty() {
        return (tokens, tokens);
    }
    let last_len = match tokens.len() % chunk {
        0 => chunk,
        r => r,
    };
    tokens.split_at(tokens.len() - last_len)
}

/// One sequence: an engine and its cache.
pub struct Session<'m> {
    engine: Engine<'m>,
    cache: KvCache,
}

impl<'m> Session<'m> {
    /// A new, empty sequence over `model`.
    pub fn new(model: &'m LoadedModel, pool: &MemoryPool, options: EngineOptions) -> Result<Self> {
        Self::from_engine(Engine::new(model, pool, options)?)
    }

    /// A new, empty sequence over an engine.
    pub fn from_engine(engine: Engine<'m>) -> Result<Self> {
        let cache = engine.new_cache();
        Ok(Session { engine, cache })
    }

    /// The engine.
    pub fn engine(&mut self) -> &mut Engine<'m> {
        &mut self.engine
    }

    /// The sequence's cache.
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// Positions in the sequence so far.
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// Whether the sequence is empty.
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }

    /// Forgets the sequence (the cache's blocks are kept for the next one).
    pub fn reset(&mut self) {
        self.cache.truncate(0);
    }

    /// Appends `tokens`; returns the logits after the last one.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32]> {
        self.engine.prefill(&mut self.cache, tokens)
    }

    /// Appends `tokens`; returns the logits after every one (`[tokens, vocab]`).
    pub fn prefill_all_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.engine.prefill_all_logits(&mut self.cache, tokens)
    }

    /// Appends one token; returns the logits after it.
    pub fn decode_step(&mut self, token: u32) -> Result<&[f32]> {
        self.engine.decode(&mut self.cache, token)
    }

    /// Prefills `prompt` and decodes `n` tokens greedily (first maximum on ties), never
    /// stopping at EOS; returns the `n` tokens.
    pub fn generate_greedy(&mut self, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(n);
        if n == 0 {
            return Ok(out);
        }
        let mut next = argmax(self.prefill(prompt)?) as u32;
        out.push(next);
        while out.len() < n {
            next = argmax(self.decode_step(next)?) as u32;
            out.push(next);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_chunk_is_never_empty() {
        let t: Vec<u32> = (0..10).collect();
        assert_eq!(split_last_chunk(&t, 4), (&t[..8], &t[8..]));
        assert_eq!(split_last_chunk(&t, 5), (&t[..5], &t[5..]));
        assert_eq!(split_last_chunk(&t, 10), (&t[..0], &t[..]));
        assert_eq!(split_last_chunk(&t, 20), (&t[..0], &t[..]));
    }
}
