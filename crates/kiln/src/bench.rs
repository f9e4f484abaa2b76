//! `kiln bench-decode`: one measurement of prefill and decode, printed as one JSON object
//! (or a CSV header and row) exactly as docs/engine-protocol.md lays out.
//!
//! The run is greedy and never stops at EOS. The prefill yields the first generated token;
//! each further token is one decode step; the first `--warmup-tokens` steps are not
//! timed. The workspace and the whole KV cache are allocated from the memory plan before
//! the prefill, so a run that does not fit fails before it starts. The timed steps take
//! from the pool only naive attention's score matrix (allocated and freed each step, its
//! largest counted in the plan); the kernels' activation codes are small heap buffers
//! outside the pool.

use std::time::Instant;

use anyhow::Context;
use kiln_core::bandwidth::{self, ReadBuffer};
use kiln_core::wide::qmv_wide_enabled;
use kiln_model::ops::argmax;
use kiln_model::{BackendEngine, ModelError, RunShape, SeqCache};
use kiln_protocol::{DecodeReport, WarmupError};

use crate::args::{BenchArgs, Format};
use crate::backend::EngineTask;
use crate::clock::Clock;
use crate::exit::usage;
use crate::{backend, prompt, roofs, runtime, rusage, speculate};

/// Passes over the bandwidth buffer; the best one is reported.
const BANDWIDTH_PASSES: usize = 5;

/// What a speculative run adds to the record.
struct SpecFields {
    drafter: &'static str,
    draft_tokens: usize,
    gate: &'static str,
    drafted: u64,
    accepted: u64,
    acceptance: Option<f64>,
    verifies: u64,
}

/// Runs the measurement on the worker pool and prints its record.
pub fn run(args: BenchArgs, clock: &mut Clock) -> anyhow::Result<()> {
    runtime::in_pool(args.run.threads, |threads| measure(args, clock, threads))
}

fn measure(args: BenchArgs, clock: &mut Clock, threads: usize) -> anyhow::Result<()> {
    let asks = backend::Asks { speculative: args.spec.enabled()?, ..Default::default() };
    let chosen = backend::check(&args.run, asks)?;
    let pool = runtime::pool(&args.run)?;
    // The protocol's warm-up rule: `max_tokens - 1` decode steps, the first
    // `warmup_tokens` untimed, at least one timed.
    let warmup = kiln_protocol::timed_decode_steps(args.max_tokens as u64, args.warmup_tokens as u64);
    if warmup == Err(WarmupError::NoTokens) {
        return Err(usage("invalid --max-tokens 0: accepted values are 1 or more"));
    }
    if args.prompt_tokens == Some(0) {
        return Err(usage("invalid --prompt-tokens 0: a prompt needs at least 1 token"));
    }
    if let Err(WarmupError::NoTimedStep { .. }) = warmup {
        return Err(usage(format!(
            "invalid --warmup-tokens {}: with --max-tokens {} there would be no timed decode step; \
             accepted values are below max-tokens - 1",
            args.warmup_tokens, args.max_tokens
        )));
    }

    let bandwidth = if args.measure_bandwidth || args.measure_roofs {
        let t = Instant::now();
        let buf = ReadBuffer::new(bandwidth::DEFAULT_BYTES);
        let bw = bandwidth::measure(&buf, BANDWIDTH_PASSES);
        drop(buf);
        let spent = t.elapsed();
        clock.exclude(spent);
        Some((bw, spent.as_secs_f64() * 1e3))
    } else {
        None
    };

    if args.measure_roofs && !backend::runs_on_host(&chosen) {
        return Err(usage(format!(
            "invalid --measure-roofs with --backend {}: it measures the CPU's roofs; use --backend cpu",
            chosen.caps.name
        )));
    }
    let measured_roofs = args.measure_roofs.then(|| {
        let (m, spent) = roofs::measure();
        clock.exclude(spent);
        m
    });
    let model_name = &args.run.model;
    let load_opts = runtime::load_options(&args.run, &pool);
    let info =
        kiln_model::inspect(model_name, &load_opts).with_context(|| format!("reading model {model_name}"))?;
    let context = info.config.max_position_embeddings;
    // `at_least`: the prompt is text not yet encoded, so `prompt` is a lower bound.
    let check_context = |prompt: usize, at_least: bool| -> anyhow::Result<()> {
        let requested = runtime::sequence_tokens(prompt, args.prompt_tokens.is_some(), args.max_tokens)?;
        if kiln_protocol::check_context(prompt, args.max_tokens, context).is_err() {
            let of = if at_least { "at least " } else { "" };
            return Err(ModelError::ContextExceeded { requested, limit: context }).with_context(|| {
                format!("{model_name}: prompt of {of}{prompt} tokens plus {} generated", args.max_tokens)
            });
        }
        Ok(())
    };
    runtime::warn_ignored_quantize(&args.run, &info.config);
    // A text prompt is at least one token: `-n` alone can already be beyond the context.
    check_context(args.prompt_tokens.unwrap_or(1), args.prompt_tokens.is_none())?;
    let geometry =
        runtime::expert_geometry(&args.run, &info.config, info.expert_slot_bytes, info.weight_bytes, &pool)?;
    let mut model =
        kiln_model::load(model_name, &load_opts).with_context(|| format!("loading model {model_name}"))?;
    if backend::runs_on_host(&chosen) {
        model.prepare_for_cpu();
    }
    let ids = match (&args.prompt, args.prompt_tokens) {
        (_, Some(n)) => prompt::of_length(&model.tokenizer, n)?,
        (Some(text), None) => prompt::of_text(&model.tokenizer, text)?,
        (None, None) => return Err(usage("bench-decode needs --prompt TEXT or --prompt-tokens N")),
    };
    check_context(ids.len(), false)?;

    let options = runtime::engine_options(&args.run);
    let run_shape = RunShape {
        prompt_tokens: ids.len(),
        max_tokens: args.max_tokens,
        prefill_chunk: options.prefill_chunk,
        batch: 1,
        attention: options.attention,
        kv_dtype: options.kv_dtype,
        act: Some(chosen.act),
    };
    let plan = backend::plan(&chosen, &model.config, info.weight_bytes, &run_shape)
        .and_then(|p| p.with_expert_cache(geometry.as_ref().map_or(0, |g| g.cache_bytes())))
        .with_context(|| {
            format!("planning {} prompt tokens plus --max-tokens {}", ids.len(), args.max_tokens)
        })?;
    let task = Measure {
        args: &args,
        clock,
        model: &model,
        pool: &pool,
        options,
        ids: &ids,
        plan,
        shape: run_shape,
    };
    let m = backend::with_engine(&chosen, &args.run, &model, &pool, options, task)?;

    let decode_tok_s = if m.decode_s > 0.0 { m.decode_steps as f64 / m.decode_s } else { 0.0 };
    let on_cpu = backend::runs_on_host(&chosen);
    let bytes_read_per_token = model.weights.bytes_read_per_token() as u64;
    let spec_fields = m.spec;
    let expert_stats = m.experts;
    let roofs = measured_roofs.as_ref().zip(bandwidth).and_then(|(r, (bw, _))| {
        let run = roofs::Run {
            ops: roofs::ForwardOps::of(&model.weights, &model.config),
            prompt_tokens: ids.len(),
            prefill_s: m.prefill_s,
            bytes_per_token: bytes_read_per_token as f64,
            decode_tok_s,
            bandwidth: bw.bytes_per_s,
        };
        roofs::report(r, &run).inspect(|r| eprintln!("{}", roofs::describe(r, threads)))
    });
    let report = DecodeReport {
        model: model_name.clone(),
        model_path: model.source.display_path(),
        prompt_tokens: ids.len() as u64,
        generated_tokens: args.max_tokens as u64,
        prefill_ms: m.prefill_s * 1e3,
        prefill_tok_s: ids.len() as f64 / m.prefill_s,
        decode_ms: m.decode_s * 1e3,
        decode_tok_s,
        peak_bytes: m.memory.peak_bytes,
        max_rss_bytes: rusage::max_rss_bytes(),
        startup_ms: m.startup_ms,
        first_token_ms: m.first_token_ms,
        backend: chosen.caps.name.into(),
        threads: threads as u64,
        kiln_version: env!("CARGO_PKG_VERSION").into(),
        attention: options.attention.as_str().into(),
        prefill_chunk: options.prefill_chunk as u64,
        memory_limit_bytes: (m.limit_bytes != u64::MAX).then_some(m.limit_bytes),
        max_tokens: Some(args.max_tokens as u64),
        warmup_tokens: Some(args.warmup_tokens as u64),
        decode_steps: Some(m.decode_steps as u64),
        kv_dtype: Some(options.kv_dtype.as_str().into()),
        // The CPU's kernel switches: a device's products choose their own kernels.
        qmv_wide: on_cpu.then(qmv_wide_enabled),
        qmv_wide_rows: on_cpu.then(|| kiln_core::wide::wide_rows().to_string()),
        act_scheme: Some(chosen.act),
        weights_bytes: Some(if on_cpu { info.weight_bytes } else { plan.weights_bytes }),
        estimated_peak_bytes: Some(plan.total_bytes),
        bytes_read_per_token: Some(bytes_read_per_token),
        // The probe reads host memory: beside a device run it says nothing of the device.
        read_bandwidth_bytes_per_s: bandwidth.map(|(bw, _)| bw.bytes_per_s),
        bandwidth_probe_ms: bandwidth.map(|(_, ms)| ms),
        decode_bandwidth_share: bandwidth
            .filter(|_| decode_tok_s > 0.0 && on_cpu)
            .map(|(bw, _)| decode_tok_s * bytes_read_per_token as f64 / bw.bytes_per_s),
        spec_drafter: spec_fields.as_ref().map(|f| f.drafter.to_string()),
        spec_draft_tokens: spec_fields.as_ref().map(|f| f.draft_tokens as u64),
        spec_gate: spec_fields.as_ref().map(|f| f.gate.to_string()),
        spec_drafted: spec_fields.as_ref().map(|f| f.drafted),
        spec_accepted: spec_fields.as_ref().map(|f| f.accepted),
        spec_acceptance: spec_fields.as_ref().and_then(|f| f.acceptance),
        spec_verifies: spec_fields.as_ref().map(|f| f.verifies),
        expert_slots: geometry.as_ref().map(|g| g.slots as u64),
        expert_cache_bytes: geometry.as_ref().map(|g| g.cache_bytes()),
        expert_hits: expert_stats.map(|s| s.hits),
        expert_misses: expert_stats.map(|s| s.misses),
        expert_bytes_copied: expert_stats.map(|s| s.bytes_copied),
        expert_copy_ms: expert_stats.map(|s| s.copy_ns as f64 / 1e6),
        peak_breakdown: m.memory.by_tag.iter().map(|(tag, s)| (tag.clone(), s.at_peak)).collect(),
        roofs,
    };
    write(&args, report)
}

/// What one measurement took, on whichever backend ran it.
struct Measured {
    prefill_s: f64,
    decode_s: f64,
    decode_steps: usize,
    startup_ms: f64,
    first_token_ms: f64,
    /// The pool the run's memory was counted in (the device's on a GPU).
    memory: kiln_core::PoolStats,
    limit_bytes: u64,
    spec: Option<SpecFields>,
    experts: Option<kiln_model::CacheStats>,
}

/// The measurement on one engine: the workspace and the whole cache allocated from the
/// plan before the prefill (so a run that does not fit fails first), then the prefill and
/// the decode steps, greedy, the first `--warmup-tokens` untimed.
struct Measure<'a> {
    args: &'a BenchArgs,
    clock: &'a mut Clock,
    model: &'a kiln_model::LoadedModel,
    pool: &'a kiln_core::MemoryPool,
    options: kiln_model::EngineOptions,
    ids: &'a [u32],
    plan: kiln_model::MemoryPlan,
    shape: RunShape,
}

impl EngineTask for Measure<'_> {
    type Out = Measured;

    fn run<B: BackendEngine>(self, mut engine: B, _: &str) -> anyhow::Result<Measured> {
        let Measure { args, clock, model, pool, options, ids, plan, shape } = self;
        let seq = shape.sequence_tokens();
        engine.reserve(plan.workspace, seq).context("allocating the workspace")?;
        let mut cache = engine.new_cache(seq).context("allocating the KV cache")?;
        cache.reserve(seq).context("allocating the KV cache")?;
        let startup_ms = clock.ms();

        let t = Instant::now();
        let logits = engine.prefill(&mut cache, ids).context("running the prefill")?;
        let mut next = argmax(logits) as u32;
        let prefill_s = t.elapsed().as_secs_f64();
        let first_token_ms = clock.ms();

        let steps = args.max_tokens - 1;
        let mut timed_from = None;
        let mut spec = None;
        let decode_steps = if args.spec.enabled()? {
            // Speculative: each step emits one or more tokens; the timer starts at the
            // first step that begins past the warm-up tokens, and counts the tokens after.
            let draft = speculate::load_draft(&args.spec, &args.run, pool, model)?;
            let mut gate = speculate::gate()?;
            let params = kiln_model::SamplingParams::default();
            let mut sampler = kiln_model::Sampler::new(params, model.config.vocab_size)?;
            let mut stream = speculate::stream(
                &args.spec,
                &args.run.model,
                draft.as_ref(),
                pool,
                options,
                params,
                ids,
                next,
                model.config.vocab_size,
            )?;
            let (mut done, mut timed_tokens) = (0, 0);
            let mut outcome = None;
            while done < steps {
                if timed_from.is_none() && done >= args.warmup_tokens {
                    timed_from = Some(Instant::now());
                }
                let step = stream
                    .step(&mut engine, &mut cache, &mut sampler, &mut gate, steps - done)
                    .context("running a speculative step")?;
                if let Some(report) = &step.gate {
                    speculate::log_gate(report);
                    outcome = Some(report.outcome);
                }
                done += step.tokens.len();
                if timed_from.is_some() {
                    timed_tokens += step.tokens.len();
                }
            }
            let stats = stream.stats();
            speculate::log_summary(stream.drafter_name(), args.spec.k(), &stats);
            spec = Some(SpecFields {
                drafter: stream.drafter_name(),
                draft_tokens: args.spec.k(),
                gate: outcome.map_or("not-run", |o| o.as_str()),
                drafted: stats.drafted,
                accepted: stats.accepted,
                acceptance: stats.acceptance_rate(),
                verifies: stats.verifies,
            });
            timed_tokens
        } else {
            for step in 0..steps {
                if step == args.warmup_tokens {
                    engine.reset_expert_stats();
                    engine.synchronize()?;
                    timed_from = Some(Instant::now());
                }
                next = argmax(engine.decode(&mut cache, next).context("running a decode step")?) as u32;
            }
            steps.saturating_sub(args.warmup_tokens)
        };
        engine.synchronize()?;
        let decode_s = timed_from.map_or(0.0, |t| t.elapsed().as_secs_f64());
        Ok(Measured {
            prefill_s,
            decode_s,
            decode_steps,
            startup_ms,
            first_token_ms,
            memory: engine.memory_stats(),
            limit_bytes: engine.memory_limit(),
            spec,
            experts: engine.expert_stats(),
        })
    }
}

fn write(args: &BenchArgs, report: DecodeReport) -> anyhow::Result<()> {
    let out = std::io::stdout().lock();
    match args.format {
        Format::Json => report.write_json(out),
        Format::Csv => report.write_csv(out),
    }
    .context("writing the result")
}
