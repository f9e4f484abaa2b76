//! `kiln estimate`: the memory plan of a bench-decode run, from the model's configuration
//! alone (no weights are loaded), as one JSON object (or a CSV header and row).
//!
//! With `--backend cuda` it is the device forward's plan (kiln-cuda's `model::plan`: the
//! same allocations a `bench-decode --backend cuda` run makes, counted), against
//! `--memory-limit` / `KILN_MEMORY_LIMIT` when given; the GPU's free memory is not read
//! (no device is opened), so without a limit `fits` is true and the harness prices the
//! device's memory itself. With `--backend vulkan|metal` it is kiln-wgpu's plan against
//! the adapter's memory (or the limit, when smaller), and the record names the adapter
//! (`device`): the adapter is found, no device is opened.
//!
//! A run beyond the model's context is still planned and printed, with `within_context`
//! false, so a harness can tell "would not fit in memory" from "cannot run at this length".

use anyhow::Context;
use kiln_model::RunShape;
use kiln_protocol::EstimateReport;

use crate::args::{EstimateArgs, Format};
use crate::exit::usage;
use crate::runtime;

/// Plans the run and prints the record.
pub fn run(args: EstimateArgs) -> anyhow::Result<()> {
    runtime::check_threads(args.run.threads)?;
    let chosen = crate::backend::check(&args.run, crate::backend::Asks::default())?;
    let pool = runtime::pool(&args.run)?;
    if args.prompt_tokens == 0 {
        return Err(usage("invalid --prompt-tokens 0: a prompt needs at least 1 token"));
    }
    if args.max_tokens == 0 {
        return Err(usage("invalid --max-tokens 0: accepted values are 1 or more"));
    }
    let name = &args.run.model;
    let info = kiln_model::inspect(name, &runtime::load_options(&args.run, &pool))
        .with_context(|| format!("reading model {name}"))?;
    runtime::warn_ignored_quantize(&args.run, &info.config);
    runtime::sequence_tokens(args.prompt_tokens, true, args.max_tokens)?;
    let options = runtime::engine_options(&args.run);
    let shape = RunShape {
        prompt_tokens: args.prompt_tokens,
        max_tokens: args.max_tokens,
        prefill_chunk: options.prefill_chunk,
        batch: 1,
        attention: options.attention,
        kv_dtype: options.kv_dtype,
        act: Some(chosen.act),
    };
    let geometry =
        runtime::expert_geometry(&args.run, &info.config, info.expert_slot_bytes, info.weight_bytes, &pool)?;
    let plan = crate::backend::plan(&chosen, &info.config, info.weight_bytes, &shape)
        .and_then(|p| p.with_expert_cache(geometry.as_ref().map_or(0, |g| g.cache_bytes())))
        .with_context(|| {
            format!("planning --prompt-tokens {} with --max-tokens {}", args.prompt_tokens, args.max_tokens)
        })?;
    let planned = Planned {
        weights_bytes: plan.weights_bytes,
        kv_bytes: plan.kv_bytes,
        scratch_bytes: plan.scratch_bytes,
        total_bytes: plan.total_bytes,
        workspace_bytes: plan.workspace_bytes,
        attention_scores_bytes: plan.attention_scores_bytes,
    };
    // A device's free memory is not read here (no device is opened): without a limit
    // given, its plan fits, and the harness prices the device's memory itself.
    // A wgpu backend's adapter is found (no device is opened) and priced against.
    let adapter = crate::backend::adapter(&chosen, &args.run)?;
    let limit = match &adapter {
        Some((_, limit)) => Some(*limit),
        None => runtime::limit_bytes(&pool).filter(|_| {
            crate::backend::runs_on_host(&chosen)
                || args.run.memory_limit.is_some()
                || std::env::var_os("KILN_MEMORY_LIMIT").is_some()
        }),
    };
    let mut record = record(&args, &info, &shape, planned, limit);
    record.device = adapter.map(|(d, _)| d);
    record.expert_slots = geometry.as_ref().map(|g| g.slots as u64);
    record.experts_bytes = geometry.as_ref().map(|_| plan.experts_bytes);
    record.moe_layers = info.config.moe.map(|_| info.config.num_hidden_layers as u64);
    record.moe_experts = info.config.moe.map(|m| m.experts as u64);
    record.moe_top_k = info.config.moe.map(|m| m.top_k as u64);
    record.expert_slot_bytes = info.expert_slot_bytes;
    write(&args, record)
}

/// A plan's figures, from either backend.
struct Planned {
    weights_bytes: u64,
    kv_bytes: u64,
    scratch_bytes: u64,
    total_bytes: u64,
    workspace_bytes: u64,
    attention_scores_bytes: u64,
}

/// The record of a plan against `limit`, without the MoE fields (the CPU path adds them).
fn record(
    args: &EstimateArgs,
    info: &kiln_model::ModelInfo,
    shape: &RunShape,
    p: Planned,
    limit: Option<u64>,
) -> EstimateReport {
    let context = info.config.max_position_embeddings;
    EstimateReport {
        model: args.run.model.clone(),
        model_path: info.source.display_path(),
        prompt_tokens: shape.prompt_tokens as u64,
        max_tokens: shape.max_tokens as u64,
        weights_bytes: p.weights_bytes,
        kv_bytes: p.kv_bytes,
        scratch_bytes: p.scratch_bytes,
        total_bytes: p.total_bytes,
        memory_limit_bytes: limit,
        fits: limit.is_none_or(|l| p.total_bytes <= l),
        context_length: context as u64,
        attention: shape.attention.as_str().into(),
        prefill_chunk: shape.prefill_chunk as u64,
        within_context: kiln_protocol::check_context(shape.prompt_tokens, shape.max_tokens, context).is_ok(),
        kv_dtype: Some(shape.kv_dtype.as_str().into()),
        workspace_bytes: Some(p.workspace_bytes),
        attention_scores_bytes: Some(p.attention_scores_bytes),
        expert_slots: None,
        experts_bytes: None,
        moe_layers: None,
        moe_experts: None,
        moe_top_k: None,
        expert_slot_bytes: None,
        device: None,
    }
}

fn write(args: &EstimateArgs, record: EstimateReport) -> anyhow::Result<()> {
    let out = std::io::stdout().lock();
    match args.format {
        Format::Json => record.write_json(out),
        Format::Csv => record.write_csv(out),
    }
    .context("writing the estimate")
}
