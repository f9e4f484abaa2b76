//! kiln-wgpu behind kiln-model's backend seam: [`WgpuBackend`] (the engine with its
//! prefill chunk) is a [`BackendEngine`] whose caches are [`WgpuCache`]s, so every `kiln`
//! command and the server run it through the same code as the CPU and CUDA engines.
//! [`CAPABILITIES`] says what it runs; the binary names it `vulkan` or `metal` after the
//! wgpu backend it opened.

use kiln_model::backend::{BackendEngine, Capabilities, SeqCache};
use kiln_model::{
    BackendErrorKind, Logits, MemoryPlan, ModelConfig, ModelError, OneSequence, RunShape, SeqChunk,
    WorkspaceShape,
};
use kiln_protocol::{ActScheme, Attention, KvDtype};

use crate::error::WgpuError;
use crate::model::{DEFAULT_PREFILL_CHUNK, WgpuCache, WgpuEngine, WgpuRunShape, prefill_rows};

/// What the wgpu forward runs: MLX-affine 4- and 8-bit products over f32 activations (the
/// default) or under the CPU's integer schemes `int8` and `int16` (its codes and integer
/// group sums, with WGSL's packed dot products where the adapter has them), streaming
/// split attention over an f16 cache, dense (non-MoE) models, several
/// sequences per forward and prefix copies between caches; no expert cache and no
/// speculative verify. `name` is the Vulkan one; the binary renames it for Metal.
pub const CAPABILITIES: Capabilities = Capabilities {
    name: "vulkan",
    weight_bits: &[4, 8],
    dense_weights: false,
    attention: &[Attention::Streaming],
    kv_dtypes: &[KvDtype::F16],
    act_schemes: &[ActScheme::F32, ActScheme::Int8, ActScheme::Int16],
    moe: false,
    expert_slots: false,
    speculative: false,
    batched_decode: true,
    prompt_cache: true,
};

impl From<WgpuError> for ModelError {
    fn from(e: WgpuError) -> ModelError {
        let kind = match &e {
            _ if e.is_out_of_memory() => BackendErrorKind::OutOfMemory,
            WgpuError::Device { .. } => BackendErrorKind::Other,
            // No adapter, a model or option this forward does not run, a bad input or
            // shape: the command cannot run as given.
            _ => BackendErrorKind::Usage,
        };
        ModelError::backend(kind, e)
    }
}

impl SeqCache for WgpuCache {
    fn len(&self) -> usize {
        WgpuCache::len(self)
    }

    fn bytes(&self) -> u64 {
        WgpuCache::bytes(self)
    }

    fn truncate(&mut self, len: usize) {
        WgpuCache::truncate(self, len)
    }
}

/// The wgpu engine with the prefill chunk its seam's prefill runs in.
pub struct WgpuBackend<'e> {
    /// The engine.
    pub engine: WgpuEngine<'e>,
    /// Prompt tokens per prefill forward (0: the engine's default chunk).
    pub prefill_chunk: usize,
}

impl BackendEngine for WgpuBackend<'_> {
    type Cache = WgpuCache;

    fn capabilities() -> Capabilities {
        CAPABILITIES
    }

    fn plan(config: &ModelConfig, weights_bytes: u64, shape: &RunShape) -> kiln_model::Result<MemoryPlan> {
        // The scheme the run's products take (the binary checked KILN_ACT_PRECISION
        // against these capabilities), else this backend's own.
        let act = CAPABILITIES.act_scheme(shape.act);
        shape.device_plan(config, DEFAULT_PREFILL_CHUNK, |config, r| {
            let run = WgpuRunShape {
                sequence_tokens: r.sequence_tokens,
                rows: r.rows,
                logit_rows: r.logit_rows,
                act,
            };
            let p = crate::model::plan(config, weights_bytes, run)?;
            Ok(OneSequence {
                weights_bytes: p.weights_bytes,
                kv_bytes: p.kv_bytes,
                scratch_bytes: p.scratch_bytes,
                total_bytes: p.total_bytes,
            })
        })
    }

    fn config(&self) -> &ModelConfig {
        self.engine.config()
    }

    fn memory_limit(&self) -> u64 {
        self.engine.exec().pool().limit()
    }

    fn memory_stats(&self) -> kiln_core::PoolStats {
        self.engine.exec().stats()
    }

    fn cache_bytes_for(&self, tokens: usize) -> u64 {
        let c = self.engine.config();
        2 * c.num_hidden_layers as u64 * crate::model::cache_layer_bytes(c, tokens) as u64
    }

    fn prefill_chunk(&self, prompt_tokens: usize) -> usize {
        prefill_rows(self.prefill_chunk, prompt_tokens)
    }

    fn new_cache(&self, capacity: usize) -> kiln_model::Result<WgpuCache> {
        Ok(self.engine.new_cache(capacity)?)
    }

    fn copy_prefix(&self, dst: &mut WgpuCache, src: &WgpuCache, n: usize) -> kiln_model::Result<()> {
        Ok(self.engine.copy_prefix(dst, src, n)?)
    }

    fn reserve(&mut self, shape: WorkspaceShape, capacity: usize) -> kiln_model::Result<()> {
        Ok(self.engine.reserve(shape.rows, capacity, shape.logit_rows)?)
    }

    fn forward(
        &mut self,
        seqs: &mut [SeqChunk<'_, WgpuCache>],
        logits: Logits,
    ) -> kiln_model::Result<&[f32]> {
        let mut pairs: Vec<(&mut WgpuCache, &[u32])> =
            seqs.iter_mut().map(|s| (&mut *s.cache, s.tokens)).collect();
        Ok(self.engine.forward_seqs(&mut pairs, logits)?)
    }

    fn synchronize(&self) -> kiln_model::Result<()> {
        Ok(self.engine.exec().synchronize()?)
    }
}
