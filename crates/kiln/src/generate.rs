//! `kiln generate`: encode the prompt (through the model's chat template unless told
//! not to), prefill, then sample token by token, writing text to stdout as soon as it
//! decodes to whole characters. Stops at EOS or after `--max-tokens`. Timing goes to
//! stderr.

use std::collections::VecDeque;
use std::io::Write;
use std::time::Instant;

use anyhow::Context;
use kiln_model::{LoadedModel, ModelError, Sampler, SamplingParams};

use crate::args::GenerateArgs;
use crate::backend::{self, Runner};
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
    let backend = backend::check(&args.run, "generate", true, speculative)?;
    let pool = runtime::pool(&args.run)?;
    let device = backend::open(&args.run, backend)?;
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
    if device.is_none() {
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
    let mut gate = if speculative { Some(speculate::gate()?) } else { None };
    let draft = speculate::load_draft(&args.spec, &args.run, &pool, &model)?;
    let options = runtime::engine_options(&args.run);
    let mut runner = Runner::new(&model, &pool, options, device.as_ref(), requested, ids.len())?;
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
    let logits = runner.prefill(&ids).context("running the prefill")?;
    let prefill_s = t.elapsed().as_secs_f64();
    let first = sampler.sample(logits);
    let mut stream = match gate {
        Some(_) => Some(speculate::stream(
            &args.spec,
            name,
            draft.as_ref(),
            &pool,
            options,
            params,
            &ids,
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
                #[allow(irrefutable_let_patterns)] // without the `cuda` feature
                let Runner::Cpu { engine, cache } = &mut runner else {
                    unreachable!("backend::check refuses --speculative with --backend cuda")
                };
                let want = args.max_tokens - generated.len();
                let step = stream
                    .step(engine, cache, &mut sampler, gate, want)
                    .context("running a speculative step")?;
                if let Some(report) = &step.gate {
                    speculate::log_gate(report);
                }
                queue.extend(step.tokens);
            }
            _ => {
                let logits = runner.decode(token).context("running a decode step")?;
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
