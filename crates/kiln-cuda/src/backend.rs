//! kiln-cuda behind kiln-model's backend seam: [`DeviceEngine`] is a
//! [`BackendEngine`] whose caches are [`DeviceCache`]s, so every `kiln` command and the
//! server run it through the same code as the CPU engine. [`CAPABILITIES`] says what the
//! device forward runs; a command asking for more is refused by kiln-model's one check.

use kiln_model::backend::{BackendEngine, Capabilities, SeqCache};
use kiln_model::{
    BackendErrorKind, Logits, MemoryPlan, ModelConfig, ModelError, OneSequence, RunShape, SeqChunk,
    WorkspaceShape,
};
use kiln_protocol::{ActScheme, Attention, KvDtype};

use crate::error::CudaError;
use crate::model::{DEFAULT_PREFILL_CHUNK, DeviceCache, DeviceEngine, DeviceRunShape, prefill_rows};

/// What the device forward runs: MLX-affine 4- and 8-bit products over f16 activations,
/// streaming split attention over an f16 cache, dense (non-MoE) models, several
/// sequences per forward and prefix copies between caches; no expert cache and no
/// speculative verify.
pub const CAPABILITIES: Capabilities = Capabilities {
    name: "cuda",
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

impl From<CudaError> for ModelError {
    fn from(e: CudaError) -> ModelError {
        let kind = match &e {
            _ if e.is_out_of_memory() => BackendErrorKind::OutOfMemory,
            CudaError::Driver { .. } | CudaError::UnknownKernel(_) => BackendErrorKind::Other,
            // No driver or device, a model or option the device forward does not run, a
            // bad input or shape: the command cannot run as given.
            _ => BackendErrorKind::Usage,
        };
        ModelError::backend(kind, e)
    }
}

impl SeqCache for DeviceCache {
    fn len(&self) -> usize {
        DeviceCache::len(self)
    }

    fn bytes(&self) -> u64 {
        DeviceCache::bytes(self)
    }

    fn truncate(&mut self, len: usize) {
        DeviceCache::truncate(self, len)
    }
}

impl BackendEngine for DeviceEngine<'_> {
    type Cache = DeviceCache;

    fn capabilities() -> Capabilities {
        CAPABILITIES
    }

    fn plan(config: &ModelConfig, weights_bytes: u64, shape: &RunShape) -> kiln_model::Result<MemoryPlan> {
        shape.device_plan(config, DEFAULT_PREFILL_CHUNK, |config, r| {
            let run =
                DeviceRunShape { sequence_tokens: r.sequence_tokens, rows: r.rows, logit_rows: r.logit_rows };
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
        DeviceEngine::config(self)
    }

    fn synchronize(&self) -> kiln_model::Result<()> {
        Ok(self.exec().synchronize()?)
    }

    fn memory_limit(&self) -> u64 {
        self.exec().pool().limit()
    }

    fn memory_stats(&self) -> kiln_core::PoolStats {
        self.exec().stats()
    }

    fn cache_bytes_for(&self, tokens: usize) -> u64 {
        let c = DeviceEngine::config(self);
        2 * c.num_hidden_layers as u64 * crate::model::cache_layer_bytes(c, tokens) as u64
    }

    fn prefill_chunk(&self, prompt_tokens: usize) -> usize {
        prefill_rows(self.prefill_chunk_setting(), prompt_tokens)
    }

    fn new_cache(&self, capacity: usize) -> kiln_model::Result<DeviceCache> {
        Ok(DeviceEngine::new_cache(self, capacity)?)
    }

    fn copy_prefix(&self, dst: &mut DeviceCache, src: &DeviceCache, n: usize) -> kiln_model::Result<()> {
        Ok(dst.copy_prefix_from(src, n)?)
    }

    fn reserve(&mut self, shape: WorkspaceShape, capacity: usize) -> kiln_model::Result<()> {
        Ok(DeviceEngine::reserve(self, shape.rows, capacity, shape.logit_rows)?)
    }

    fn forward(
        &mut self,
        seqs: &mut [SeqChunk<'_, DeviceCache>],
        logits: Logits,
    ) -> kiln_model::Result<&[f32]> {
        Ok(self.forward_seqs(seqs, logits)?)
    }
}
