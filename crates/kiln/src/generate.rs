//! `kiln generate`: encode the prompt (through the model's chat template unless told
//! not to), prefill, then sample token by token, writing text to stdout as soon as it
//! decodes to whole characters. Stops at EOS or after `--max-tokens`. Timing goes to
//! stderr.

use std::collections::VecDeque;
use std::io::Write;
use std::time::Instant;

use anyhow::Context;
use kiln_model::{BackendEngine, LoadedModel, ModelError, Sampler, SamplingParams, WorkspaceShape};

use crate::args::GenerateArgs;
use crate::backend::{self, Asks, EngineTask};
use crate::exit::usage;
use crate::{runtime, speculate};

/// Runs the generation on the worker pool.
pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    runtime::in_pool(args.run.threads, |_| generate(args))
}

fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    // 0 would decode to the context and then fail: refused, as bench-decode does.
    if args.max_tokens == 0 {
        return Err(usage("invalid --max-tokens 0: accepted values are 1 or more"));
    }
    let speculative = args.spec.enabled()?;
    let chosen = backend::check(&args.run, Asks { speculative, ..Asks::default() })?;
    let pool = runtime::pool(&args.run)?;
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: 0.0,
        seed: args.seed,
    };
    params.validate()?;
    let name = &args.run.model;
    let mut model = kiln_model::load(name, &runtime::load_options(&args.run, &pool))
        .with_context(|| format!("loading model {name}"))?;
    if backend::runs_on_host(&chosen) {
        model.prepare_for_cpu();
    }
    runtime::warn_ignored_quantize(&args.run, &model.config);
    // The weights are in the pool now: what is live counts against the slots' room.
    let slot_bytes = model.weights.experts.as_ref().map(kiln_model::expert_cache::slot_bytes_of);
    runtime::expert_geometry(&args.run, &model.config, slot_bytes, pool.stats().live_bytes, &pool)?;
    let ids = encode_prompt(&model, &args.prompt, !args.no_chat_template)?;
    let limit = model.config.max_position_embeddings;
    let requested = runtime::sequence_tokens(ids.len(), false, args.max_tokens)?;
    if kiln_protocol::check_context(ids.len(), args.max_tokens, limit).is_err() {
        return Err(ModelError::ContextExceeded { requested, limit }).with_context(|| {
            format!("prompt of {} tokens plus --max-tokens {}", ids.len(), args.max_tokens)
        });
    }
    let gate = if speculative { Some(speculate::gate()?) } else { None };
    let draft = speculate::load_draft(&args.spec, &args.run, &pool, &model)?;
    let options = runtime::engine_options(&args.run);
    let task = Generate {
        args: &args,
        model: &model,
        pool: &pool,
        options,
        params,
        ids: &ids,
        capacity: requested,
        gate,
        draft: draft.as_ref(),
    };
    backend::with_engine(&chosen, &args.run, &model, &pool, options, task)
}

/// The generation on one engine, whichever backend it runs on.
struct Generate<'a> {
    args: &'a GenerateArgs,
    model: &'a LoadedModel,
    pool: &'a kiln_core::MemoryPool,
    options: kiln_model::EngineOptions,
    params: SamplingParams,
    ids: &'a [u32],
    /// Positions the sequence holds at most.
    capacity: usize,
    gate: Option<kiln_model::speculative::ExactnessGate>,
    draft: Option<&'a LoadedModel>,
}

impl EngineTask for Generate<'_> {
    type Out = ();

    fn run<B: BackendEngine>(self, mut engine: B, _: &str) -> anyhow::Result<()> {
        let Generate { args, model, pool, options, params, ids, capacity, mut gate, draft } = self;
        let name = &args.run.model;
        engine
            .reserve(WorkspaceShape { rows: engine.prefill_chunk(ids.len()), logit_rows: 1 }, capacity)
            .context("allocating the workspace")?;
        let mut cache = engine.new_cache(capacity).context("allocating the KV cache")?;
        let mut sampler = Sampler::new(params, model.config.vocab_size)?;
        // Stop at the config's EOS ids and at the chat template's end token (an instruct
        // model's end of turn), when the tokenizer knows it.
        let mut eos = model.config.eos_token_ids.clone();
        let template_eos = model.chat_template.as_ref().and_then(|t| t.eos_token.as_deref());
        eos.extend(template_eos.and_then(|t| model.tokenizer.token_to_id(t)));

        let mut out = std::io::stdout().lock();
        let mut text = TextStream::default();
        // Bounded by the context, checked above.
        let mut generated = Vec::with_capacity(args.max_tokens);
        let t = Instant::now();
        let logits = engine.prefill(&mut cache, ids).context("running the prefill")?;
        let prefill_s = t.elapsed().as_secs_f64();
        let first = sampler.sample(logits);
        let mut stream = match gate {
            Some(_) => Some(speculate::stream(
                &args.spec,
                name,
                draft,
                pool,
                options,
                params,
                ids,
                first,
                model.config.vocab_size,
            )?),
            None => None,
        };
        // Tokens sampled but not yet written: one at a time classically, a verify's
        // accepted run speculatively.
        let mut queue = VecDeque::from([first]);
        let t = Instant::now();
        while let Some(token) = queue.pop_front() {
            if eos.contains(&token) {
                break;
            }
            generated.push(token);
            let decoded = model.tokenizer.decode(&generated).context("decoding generated tokens")?;
            text.write_new(&decoded, &mut out).context("writing to stdout")?;
            if generated.len() == args.max_tokens {
                break;
            }
            if !queue.is_empty() {
                continue;
            }
            match (&mut stream, &mut gate) {
                (Some(stream), Some(gate)) => {
                    let want = args.max_tokens - generated.len();
                    let step = stream
                        .step(&mut engine, &mut cache, &mut sampler, gate, want)
                        .context("running a speculative step")?;
                    if let Some(report) = &step.gate {
                        speculate::log_gate(report);
                    }
                    queue.extend(step.tokens);
                }
                _ => {
                    let logits = engine.decode(&mut cache, token).context("running a decode step")?;
                    queue.push_back(sampler.sample(logits));
                }
            }
        }
        if !generated.is_empty() {
            let decoded = model.tokenizer.decode(&generated).context("decoding generated tokens")?;
            text.finish(&decoded, &mut out).context("writing to stdout")?;
        }
        writeln!(out).context("writing to stdout")?;
        out.flush().context("writing to stdout")?;
        let decode_s = t.elapsed().as_secs_f64();
        eprintln!(
            "prompt: {} tokens, {:.1} tok/s; generated: {} tokens, {:.1} tok/s",
            ids.len(),
            ids.len() as f64 / prefill_s,
            generated.len(),
            generated.len() as f64 / decode_s.max(f64::MIN_POSITIVE),
        );
        if let Some(stream) = &stream {
            speculate::log_summary(stream.drafter_name(), args.spec.k(), &stream.stats());
        }
        Ok(())
    }
}

/// The prompt's token ids: through the chat template when asked and the model has one
/// (the rendered text already holds its special tokens, so none are added), else the
/// text with the tokenizer's special tokens.
fn encode_prompt(model: &LoadedModel, prompt: &str, use_template: bool) -> anyhow::Result<Vec<u32>> {
    let ids = match model.chat_template.as_ref().filter(|_| use_template) {
        Some(template) => {
            let text = template.render_prompt(prompt).context("applying the chat template")?;
            model.tokenizer.encode(&text, false).context("encoding the prompt")?
        }
        None => model.tokenizer.encode(prompt, true).context("encoding the prompt")?,
    };
    if ids.is_empty() {
        return Err(usage("invalid --prompt: it encodes to no tokens; give some text"));
    }
    Ok(ids)
}

/// Text written so far, so each step writes only what is new, and only once it is whole
/// characters (a byte-level token can end inside a UTF-8 sequence).
#[derive(Default)]
struct TextStream {
    written: usize,
}

impl TextStream {
    fn write_new(&mut self, decoded: &str, out: &mut impl Write) -> std::io::Result<()> {
        if decoded.ends_with('\u{fffd}') {
            return Ok(());
        }
        if let Some(new) = decoded.get(self.written..) {
            out.write_all(new.as_bytes())?;
            out.flush()?;
            self.written = decoded.len();
        }
        Ok(())
    }

    /// Writes whatever is left at the end of the stream, an incomplete final character
    /// included (as the decoder's U+FFFD replacement), so no output is dropped.
    fn finish(&mut self, decoded: &str, out: &mut impl Write) -> std::io::Result<()> {
        if let Some(rest) = decoded.get(self.written..)
            && !rest.is_empty()
        {
            out.write_all(rest.as_bytes())?;
            out.flush()?;
            self.written = decoded.len();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_only_new_whole_characters() {
        let mut s = TextStream::default();
        let mut out = Vec::new();
        s.write_new("he", &mut out).unwrap();
        s.write_new("he\u{fffd}", &mut out).unwrap();
        s.write_new("heé", &mut out).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "heé");
    }

    #[test]
    fn an_incomplete_last_character_is_flushed_at_the_end() {
        let mut s = TextStream::default();
        let mut out = Vec::new();
        s.write_new("ab", &mut out).unwrap();
        s.write_new("ab\u{fffd}", &mut out).unwrap();
        s.finish("ab\u{fffd}", &mut out).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "ab\u{fffd}");
        let mut s = TextStream::default();
        let mut out = Vec::new();
        s.write_new("ok", &mut out).unwrap();
        s.finish("ok", &mut out).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "ok");
    }
}
