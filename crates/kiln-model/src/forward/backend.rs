//! The backend seam: what every engine kiln runs a model on provides, so each `kiln`
//! command and the server run the same code on the CPU (this crate's [`Engine`]), on an
//! NVIDIA GPU (kiln-cuda's device engine) or on any other backend that implements
//! [`BackendEngine`].
//!
//! A backend gives: forwards over any mix of sequences and token counts (prefill chunks
//! and decode rows together, `Logits` choosing the rows returned), new KV caches of its
//! own kind ([`SeqCache`]), its workspace reserved up front, its memory plan (the
//! allocations a run makes, counted without making them), and a [`Capabilities`] value
//! saying what it runs. A command checks its needs against that value once
//! ([`Capabilities::check`]) instead of each command refusing backends by name; the
//! refusal names the flag, the backend and what the backend does support.
//!
//! Prefill, scoring (every row's logits), single and batched decode are provided on top
//! of `forward`, so a backend writes one forward and gets them all, chunked the same way.

use kiln_protocol::{ActScheme, Attention, KvDtype};

use crate::error::{ModelError, Result};
use crate::forward::kv_cache::KvCache;
use crate::forward::plan::{MemoryPlan, RunShape, WorkspaceShape};
use crate::forward::transformer::{Logits, SeqChunk};
use crate::loading::config::ModelConfig;

/// One sequence's keys and values as a backend stores them.
pub trait SeqCache {
    /// Positions stored.
    fn len(&self) -> usize;
    /// Whether nothing is stored.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Bytes held (what the memory pool counts for it).
    fn bytes(&self) -> u64;
    /// Forgets the positions from `len` on.
    fn truncate(&mut self, len: usize);
    /// Allocates room for `tokens` positions now (a cache made whole at creation has it).
    fn reserve(&mut self, tokens: usize) -> Result<()> {
        let _ = tokens;
        Ok(())
    }
}

impl SeqCache for KvCache {
    fn len(&self) -> usize {
        KvCache::len(self)
    }

    fn bytes(&self) -> u64 {
        KvCache::bytes(self)
    }

    fn truncate(&mut self, len: usize) {
        KvCache::truncate(self, len)
    }

    fn reserve(&mut self, tokens: usize) -> Result<()> {
        Ok(KvCache::reserve(self, tokens)?)
    }
}

/// What a backend runs. Every field is a fact of the backend's code, not of the host:
/// a host without a GPU still has a `cuda` backend that cannot open a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// The backend's name, as `--backend` takes it.
    pub name: &'static str,
    /// Weight widths its products take (`bits` of MLX-affine groups).
    pub weight_bits: &'static [u32],
    /// Whether it runs unquantized (dense) weights.
    pub dense_weights: bool,
    /// Attention implementations (`--attention`).
    pub attention: &'static [Attention],
    /// Cache storage types (`--kv-dtype`).
    pub kv_dtypes: &'static [KvDtype],
    /// Activation schemes of the products (`KILN_ACT_PRECISION`); the first is what runs
    /// when none is asked for.
    pub act_schemes: &'static [ActScheme],
    /// Whether it routes mixture-of-experts layers.
    pub moe: bool,
    /// Whether it keeps a MoE model's experts in a cache of slots (`--expert-slots`).
    pub expert_slots: bool,
    /// Whether a target model's verify forward runs on it (`--speculative`).
    pub speculative: bool,
    /// Whether one forward takes several sequences (`kiln serve`'s continuous batching).
    pub batched_decode: bool,
    /// Whether a new sequence can start from another's cached prefix (`kiln serve`'s
    /// prompt cache, the choices of an `n > 1` request).
    pub prompt_cache: bool,
}

/// What a command asks of a backend: its flags, and the activation scheme asked for in
/// the environment (`None`: the backend's own).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Needs {
    /// `--attention`.
    pub attention: Attention,
    /// `--kv-dtype`.
    pub kv_dtype: KvDtype,
    /// `KILN_ACT_PRECISION`, when set.
    pub act: Option<ActScheme>,
    /// `--expert-slots` given.
    pub expert_slots: bool,
    /// `--speculative` (or `--spec-slots` above 0).
    pub speculative: bool,
    /// More than one sequence per forward (`kiln serve`).
    pub batched_decode: bool,
    /// Prefix sharing between sequences (`kiln serve`).
    pub prompt_cache: bool,
}

/// A need a backend does not meet: the flag (or variable) with its value, the backend,
/// and what it supports instead.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} with --backend {backend}: the {backend} backend does not run it; {accepted}")]
pub struct Unmet {
    /// The flag or variable and its value (`--kv-dtype f32`).
    pub what: String,
    /// The backend's name.
    pub backend: &'static str,
    /// What would be accepted.
    pub accepted: String,
}

impl Capabilities {
    /// The activation scheme a run with `asked` (from the environment) uses here.
    pub fn act_scheme(&self, asked: Option<ActScheme>) -> ActScheme {
        asked.unwrap_or(self.act_schemes[0])
    }

    /// Checks `needs` against what the backend runs: the first need it does not meet.
    pub fn check(&self, needs: &Needs) -> std::result::Result<(), Unmet> {
        let unmet = |what: String, accepted: String| Err(Unmet { what, backend: self.name, accepted });
        let list = |names: Vec<&str>| names.join(", ");
        if !self.attention.contains(&needs.attention) {
            let names = list(self.attention.iter().map(|a| a.as_str()).collect());
            return unmet(
                format!("--attention {}", needs.attention.as_str()),
                format!("accepted values here are {names}, or use --backend cpu"),
            );
        }
        if !self.kv_dtypes.contains(&needs.kv_dtype) {
            let names = list(self.kv_dtypes.iter().map(|d| d.as_str()).collect());
            return unmet(
                format!("--kv-dtype {}", needs.kv_dtype.as_str()),
                format!("accepted values here are {names}, or use --backend cpu"),
            );
        }
        if let Some(act) = needs.act
            && !self.act_schemes.contains(&act)
        {
            let names = list(self.act_schemes.iter().map(|s| s.as_str()).collect());
            return unmet(
                format!("{}={}", kiln_protocol::ACT_PRECISION_ENV, act.as_str()),
                format!("its products run {names}; unset the variable or pick a backend that runs it"),
            );
        }
        let flag = |on: bool, have: bool, what: &str| -> std::result::Result<(), Unmet> {
            if on && !have {
                unmet(what.to_string(), "drop it, or use --backend cpu".to_string())
            } else {
                Ok(())
            }
        };
        flag(needs.expert_slots, self.expert_slots, "--expert-slots")?;
        flag(needs.speculative, self.speculative, "--speculative")?;
        flag(needs.batched_decode, self.batched_decode, "batched decode (kiln serve)")?;
        flag(needs.prompt_cache, self.prompt_cache, "the prompt cache (kiln serve)")
    }
}

/// An engine a model runs on: one backend's forward pass, its caches and its workspace.
pub trait BackendEngine {
    /// One sequence's cache on this backend.
    type Cache: SeqCache;

    /// What this backend runs.
    fn capabilities() -> Capabilities
    where
        Self: Sized;

    /// The allocations a run of `shape` makes on this backend, counted without making
    /// them (`kiln estimate`, and the harness's pre-skip).
    fn plan(config: &ModelConfig, weights_bytes: u64, shape: &RunShape) -> Result<MemoryPlan>
    where
        Self: Sized;

    /// The model's configuration.
    fn config(&self) -> &ModelConfig;

    /// The limit of the memory pool this backend counts its allocations in.
    fn memory_limit(&self) -> u64;

    /// That pool's live and peak bytes, by tag.
    fn memory_stats(&self) -> kiln_core::PoolStats;

    /// Bytes a cache holding `tokens` positions takes.
    fn cache_bytes_for(&self, tokens: usize) -> u64;

    /// Prompt tokens per prefill forward (never 0).
    fn prefill_chunk(&self, prompt_tokens: usize) -> usize;

    /// An empty cache for a sequence of up to `capacity` positions (a backend whose
    /// caches grow may ignore it).
    fn new_cache(&self, capacity: usize) -> Result<Self::Cache>;

    /// Makes `dst` hold the first `n` positions of `src` (a shared prompt prefix), on the
    /// backend's memory.
    fn copy_prefix(&self, dst: &mut Self::Cache, src: &Self::Cache, n: usize) -> Result<()>;

    /// Allocates the workspace for forwards of `shape` over caches of up to `capacity`
    /// positions now, so the run allocates no activations later.
    fn reserve(&mut self, shape: WorkspaceShape, capacity: usize) -> Result<()>;

    /// One forward over any mix of sequences and token counts; the tokens of each land
    /// at its cache's positions `len()..`. Returns the rows `logits` asks for.
    fn forward(&mut self, seqs: &mut [SeqChunk<'_, Self::Cache>], logits: Logits) -> Result<&[f32]>;

    /// Appends `tokens` to the sequence of `cache` in prefill chunks and returns the
    /// logits of the last token (`[vocab]`).
    fn prefill(&mut self, cache: &mut Self::Cache, tokens: &[u32]) -> Result<&[f32]> {
        check_context(self.config(), cache.len(), tokens.len())?;
        if tokens.is_empty() {
            return Err(ModelError::InvalidArgument {
                what: "prompt".into(),
                message: "a prefill needs at least one token".into(),
            });
        }
        let chunk = self.prefill_chunk(tokens.len());
        let last_len = match tokens.len() % chunk {
            0 => chunk,
            r => r,
        };
        let (head, last) = tokens.split_at(tokens.len() - last_len);
        for part in head.chunks(chunk) {
            self.forward(&mut [SeqChunk { cache, tokens: part }], Logits::None)?;
        }
        self.forward(&mut [SeqChunk { cache, tokens: last }], Logits::Last)
    }

    /// Appends `tokens` like [`Self::prefill`] and hands each chunk's logits to `each`
    /// (`each(first token index, [chunk tokens, vocab])`).
    fn prefill_each_logits(
        &mut self,
        cache: &mut Self::Cache,
        tokens: &[u32],
        each: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<()> {
        check_context(self.config(), cache.len(), tokens.len())?;
        let chunk = self.prefill_chunk(tokens.len());
        for (i, part) in tokens.chunks(chunk).enumerate() {
            let logits = self.forward(&mut [SeqChunk { cache, tokens: part }], Logits::All)?;
            each(i * chunk, logits);
        }
        Ok(())
    }

    /// Waits until every queued launch has run (a timer's edge); the CPU runs in order.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// The expert cache's counters, when the backend keeps MoE experts in one.
    fn expert_stats(&self) -> Option<crate::forward::expert_cache::CacheStats> {
        None
    }

    /// Zeroes those counters (the end of a warm-up).
    fn reset_expert_stats(&mut self) {}

    /// Appends one token and returns the logits after it (`[vocab]`).
    fn decode(&mut self, cache: &mut Self::Cache, token: u32) -> Result<&[f32]> {
        self.forward(&mut [SeqChunk { cache, tokens: &[token] }], Logits::Last)
    }
}

fn check_context(config: &ModelConfig, held: usize, new: usize) -> Result<()> {
    kiln_protocol::check_context(held, new, config.max_position_embeddings)
        .map_err(|e| ModelError::ContextExceeded { requested: e.requested, limit: e.limit })
}

/// What the CPU engine runs.
pub const CPU: Capabilities = Capabilities {
    name: "cpu",
    weight_bits: &[2, 3, 4, 5, 6, 8],
    dense_weights: true,
    attention: &[Attention::Streaming, Attention::Naive],
    kv_dtypes: &[KvDtype::F16, KvDtype::F32],
    act_schemes: &[ActScheme::Int16, ActScheme::Int8, ActScheme::Int16Wide8, ActScheme::F32],
    moe: true,
    expert_slots: true,
    speculative: true,
    batched_decode: true,
    prompt_cache: true,
};

#[cfg(test)]
mod tests {
    use super::*;

    const DEVICE: Capabilities = Capabilities {
        name: "dev",
        weight_bits: &[4, 8],
        dense_weights: false,
        attention: &[Attention::Streaming],
        kv_dtypes: &[KvDtype::F16],
        act_schemes: &[ActScheme::F16],
        moe: false,
        expert_slots: false,
        speculative: false,
        batched_decode: true,
        prompt_cache: true,
    };

    #[test]
    fn the_cpu_runs_every_knob_value() {
        for attention in [Attention::Streaming, Attention::Naive] {
            for kv_dtype in [KvDtype::F16, KvDtype::F32] {
                for act in [None, Some(ActScheme::Int8), Some(ActScheme::F32)] {
                    let needs = Needs {
                        attention,
                        kv_dtype,
                        act,
                        expert_slots: true,
                        speculative: true,
                        batched_decode: true,
                        prompt_cache: true,
                    };
                    assert_eq!(CPU.check(&needs), Ok(()));
                }
            }
        }
        assert_eq!(CPU.act_scheme(None), ActScheme::Int16);
    }

    #[test]
    fn an_unmet_need_names_the_flag_the_backend_and_what_it_runs() {
        let e = DEVICE.check(&Needs { kv_dtype: KvDtype::F32, ..Needs::default() }).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid --kv-dtype f32 with --backend dev: the dev backend does not run it; accepted values \
             here are f16, or use --backend cpu"
        );
        let e = DEVICE.check(&Needs { act: Some(ActScheme::Int8), ..Needs::default() }).unwrap_err();
        assert!(e.to_string().starts_with("invalid KILN_ACT_PRECISION=int8 with --backend dev"), "{e}");
        assert!(e.to_string().contains("its products run f16"), "{e}");
        let e = DEVICE.check(&Needs { speculative: true, ..Needs::default() }).unwrap_err();
        assert_eq!(e.what, "--speculative");
        assert_eq!(DEVICE.check(&Needs { act: Some(ActScheme::F16), ..Needs::default() }), Ok(()));
        assert_eq!(DEVICE.act_scheme(None), ActScheme::F16);
        // The CPU's kernels have no f16 activations: asked for, it is refused by name.
        let e = CPU.check(&Needs { act: Some(ActScheme::F16), ..Needs::default() }).unwrap_err();
        assert!(e.to_string().starts_with("invalid KILN_ACT_PRECISION=f16 with --backend cpu"), "{e}");
    }
}
