//! The speculative-decoding options `generate` and `bench-decode` share: loading the
//! draft model, building the drafter and the gate, and writing the gate's line and the
//! acceptance summary to stderr.

use anyhow::Context;
use kiln_core::MemoryPool;
use kiln_model::speculative::{
    DraftModel, Drafter, ExactnessGate, GateKey, GateReport, PromptLookup, SpecStats, SpecStream,
    check_vocabulary,
};
use kiln_model::{EngineOptions, LoadedModel, SamplingParams};

use crate::args::{RunArgs, SpecArgs};
use crate::exit::usage;
use crate::runtime;

impl SpecArgs {
    /// Whether speculation is on; `--draft-tokens` or `--model-draft` without
    /// `--speculative` is refused.
    pub fn enabled(&self) -> anyhow::Result<bool> {
        if !self.speculative && (self.draft_tokens.is_some() || self.model_draft.is_some()) {
            return Err(usage("--draft-tokens and --model-draft need --speculative"));
        }
        if self.draft_tokens == Some(0) {
            return Err(usage(format!(
                "invalid --draft-tokens 0: accepted values are 1 to {MAX_DRAFT_TOKENS}"
            )));
        }
        if let Some(k) = self.draft_tokens.filter(|&k| k > MAX_DRAFT_TOKENS) {
            return Err(usage(format!(
                "invalid --draft-tokens {k}: accepted values are 1 to {MAX_DRAFT_TOKENS}"
            )));
        }
        Ok(self.speculative)
    }

    /// K.
    pub fn k(&self) -> usize {
        self.draft_tokens.unwrap_or(kiln_model::speculative::DEFAULT_DRAFT_TOKENS)
    }
}

/// The largest `--draft-tokens` accepted.
pub const MAX_DRAFT_TOKENS: usize = 32;

/// The draft model named by `--model-draft`, loaded into `pool` and checked against the
/// target's vocabulary.
pub fn load_draft(
    spec: &SpecArgs,
    run: &RunArgs,
    pool: &MemoryPool,
    target: &LoadedModel,
) -> anyhow::Result<Option<LoadedModel>> {
    let Some(name) = &spec.model_draft else { return Ok(None) };
    let mut draft = kiln_model::load(name, &runtime::load_options(run, pool))
        .with_context(|| format!("loading draft model {name}"))?;
    // The draft runs on the CPU whatever the target runs on.
    draft.prepare_for_cpu();
    check_vocabulary(&draft, target.config.vocab_size)
        .map_err(|e| usage(format!("invalid --model-draft: {e}")))?;
    Ok(Some(draft))
}

/// The gate, its policy read from the environment (a bad value is a usage error).
pub fn gate() -> anyhow::Result<ExactnessGate> {
    ExactnessGate::from_env().map_err(|e| usage(e.to_string()))
}

/// A stream over the draft model when there is one, else prompt lookup.
#[allow(clippy::too_many_arguments)]
pub fn stream<'d>(
    spec: &SpecArgs,
    model_name: &str,
    draft: Option<&'d LoadedModel>,
    pool: &MemoryPool,
    options: EngineOptions,
    params: SamplingParams,
    prompt: &[u32],
    first: u32,
    target_vocab: usize,
) -> anyhow::Result<SpecStream<'d>> {
    let drafter: Box<dyn Drafter + 'd> = match draft {
        Some(d) => Box::new(
            DraftModel::new(d, target_vocab, pool, options, params).context("preparing the draft model")?,
        ),
        None => Box::new(PromptLookup::default()),
    };
    let key = GateKey { model: model_name.to_string(), k: spec.k(), kv_dtype: options.kv_dtype };
    Ok(SpecStream::new(drafter, key, prompt, first))
}

/// Writes the gate's decision to stderr: `INFO ` or `WARN ` then the fixed line.
pub fn log_gate(report: &GateReport) {
    let level = if report.outcome.is_warning() { "WARN" } else { "INFO" };
    eprintln!("{level} {}", report.message());
}

/// The acceptance summary line on stderr.
pub fn log_summary(drafter: &str, k: usize, stats: &SpecStats) {
    let rate = stats.acceptance_rate().map_or_else(|| "n/a".to_string(), |r| format!("{r:.3}"));
    eprintln!(
        "speculative: drafter={drafter} k={k} drafted={} accepted={} acceptance={rate} verifies={} classic_steps={}",
        stats.drafted, stats.accepted, stats.verifies, stats.classic_steps
    );
}
