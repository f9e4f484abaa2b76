//! `kiln score`: teacher-forced log-probabilities of a text, for quality measurements.
//!
//! The text is encoded without special tokens and cut into consecutive windows of
//! `--window` tokens; each window runs as one fresh sequence (BOS first when the
//! tokenizer adds one), and positions `--first-scored` to the window's end score the
//! next token. The record of every scored position (the next token's id and the
//! log-softmax over the whole vocabulary) goes to `--output` in the binary format
//! docs/engine-protocol.md describes; stdout gets one JSON summary line.

use std::io::{BufWriter, Write};
use std::time::Instant;

use anyhow::Context;
use kiln_model::logprobs::score_sequence;
use kiln_model::output::AtomicFile;
use kiln_model::{LoadedModel, WorkspaceShape};
use serde::Serialize;

use crate::args::ScoreArgs;
use crate::exit::usage;
use crate::runtime;

/// First bytes of a log-probability file.
pub const MAGIC: &[u8; 8] = b"KILNLP01";

/// The JSON header of a log-probability file.
#[derive(Serialize)]
struct Header<'a> {
    model: &'a str,
    vocab: usize,
    window: usize,
    first_scored: usize,
    windows: usize,
    positions: usize,
    text_tokens: usize,
    bos: Option<u32>,
    kv_dtype: &'a str,
    act_precision: String,
}

/// The JSON summary line.
#[derive(Serialize)]
struct Summary<'a> {
    model: &'a str,
    windows: usize,
    positions: usize,
    mean_nll: f64,
    perplexity: f64,
    seconds: f64,
    tokens_per_s: f64,
    act_precision: String,
}

/// Runs the command on the worker pool.
pub fn run(args: ScoreArgs) -> anyhow::Result<()> {
    runtime::in_pool(args.run.threads, |_| score(args))
}

fn score(args: ScoreArgs) -> anyhow::Result<()> {
    let chosen = crate::backend::check(&args.run, crate::backend::Asks::default())?;
    // Before the model loads: a FIFO or a device is refused at once (exit 2).
    if let Some(output) = args.output.as_ref().filter(|_| !args.ids_only) {
        kiln_model::output::destination(output)
            .with_context(|| format!("invalid --output {}", output.display()))?;
    }
    let text = std::fs::read_to_string(&args.text_file)
        .with_context(|| format!("reading --text-file {}", args.text_file.display()))?;
    let pool = runtime::pool(&args.run)?;
    let name = &args.run.model;
    let mut model = kiln_model::load(name, &runtime::load_options(&args.run, &pool))
        .with_context(|| format!("loading model {name}"))?;
    if crate::backend::runs_on_host(&chosen) {
        model.prepare_for_cpu();
    }
    let tokens = model.tokenizer.encode(&text, false).context("encoding --text-file")?;
    if args.ids_only {
        let mut out = std::io::stdout().lock();
        serde_json::to_writer(&mut out, &tokens).context("writing to stdout")?;
        writeln!(out).context("writing to stdout")?;
        return Ok(());
    }
    let Some(output) = args.output.clone() else {
        return Err(usage("missing --output: give the log-probability file to write"));
    };
    let bos = bos_token(&model)?;
    let body = args.window - usize::from(bos.is_some());
    if args.window < 2 || args.first_scored >= args.window - 1 || body == 0 {
        return Err(usage(format!(
            "invalid --window {} / --first-scored {}: the window must hold at least 2 tokens and \
             --first-scored must be below the window's last position ({})",
            args.window,
            args.first_scored,
            args.window.saturating_sub(1)
        )));
    }
    if args.window > model.config.max_position_embeddings {
        return Err(usage(format!(
            "invalid --window {}: the model's context is {} tokens",
            args.window, model.config.max_position_embeddings
        )));
    }
    let mut windows = tokens.len() / body;
    if let Some(max) = args.max_windows {
        windows = windows.min(max);
    }
    if windows == 0 {
        return Err(usage(format!(
            "invalid --text-file {}: it encodes to {} tokens, fewer than one window of {}",
            args.text_file.display(),
            tokens.len(),
            body
        )));
    }
    let per_window = args.window - 1 - args.first_scored;
    let vocab = model.config.vocab_size;
    // The scheme the kernels run (validated before the model loaded), by its name.
    let act_precision = chosen.act.as_str().to_string();
    let header = Header {
        model: name,
        vocab,
        window: args.window,
        first_scored: args.first_scored,
        windows,
        positions: windows * per_window,
        text_tokens: tokens.len(),
        bos,
        kv_dtype: args.run.kv_dtype.as_str(),
        act_precision: act_precision.clone(),
    };
    // A temporary file beside the output, renamed over it when whole: two runs writing
    // one output never share a temporary file, and a failed run leaves the old output.
    let mut file =
        AtomicFile::create(&output).with_context(|| format!("invalid --output {}", output.display()))?;
    let tmp = file.tmp_path().to_path_buf();
    let mut out = BufWriter::with_capacity(1 << 20, file.file());
    let json = serde_json::to_vec(&header).context("encoding the header")?;
    out.write_all(MAGIC)?;
    out.write_all(&(json.len() as u32).to_le_bytes())?;
    out.write_all(&json)?;

    let options = runtime::engine_options(&args.run);
    let task = Windows { args: &args, tokens: &tokens, bos, body, windows, out: &mut out };
    let (nll, count, started) =
        crate::backend::with_engine(&chosen, &args.run, &model, &pool, options, task)?;
    out.flush().with_context(|| format!("writing {}", tmp.display()))?;
    drop(out);
    file.commit().with_context(|| format!("writing {}", output.display()))?;
    let seconds = started.elapsed().as_secs_f64();
    let mean_nll = nll / count as f64;
    let summary = Summary {
        model: name,
        windows,
        positions: count,
        mean_nll,
        perplexity: mean_nll.exp(),
        seconds,
        tokens_per_s: (windows * args.window) as f64 / seconds,
        act_precision,
    };
    let mut stdout = std::io::stdout().lock();
    serde_json::to_writer(&mut stdout, &summary).context("writing to stdout")?;
    writeln!(stdout).context("writing to stdout")?;
    Ok(())
}

/// Every window scored on one engine: each its own sequence, prefilled with every row's
/// logits through the function the server's `echo` log-probabilities use. Returns the
/// summed negative log-likelihood, the positions scored and when scoring started.
struct Windows<'a, W> {
    args: &'a ScoreArgs,
    tokens: &'a [u32],
    bos: Option<u32>,
    body: usize,
    windows: usize,
    out: &'a mut W,
}

impl<W: Write> crate::backend::EngineTask for Windows<'_, W> {
    type Out = (f64, usize, Instant);

    fn run<B: kiln_model::BackendEngine>(self, mut engine: B, _: &str) -> anyhow::Result<Self::Out> {
        let Windows { args, tokens, bos, body, windows, out } = self;
        engine
            .reserve(
                WorkspaceShape {
                    rows: engine.prefill_chunk(args.window),
                    logit_rows: engine.prefill_chunk(args.window),
                },
                args.window,
            )
            .context("allocating the workspace")?;
        let started = Instant::now();
        let (mut nll, mut count) = (0f64, 0usize);
        for w in 0..windows {
            let mut ids = Vec::with_capacity(args.window);
            ids.extend(bos);
            ids.extend_from_slice(&tokens[w * body..(w + 1) * body]);
            let mut cache = engine.new_cache(args.window).context("allocating the KV cache")?;
            // The server's `echo` log-probabilities run through the same function.
            let mut written = Ok(());
            score_sequence(&mut engine, &mut cache, &ids, args.first_scored, |pos, _, lp| {
                let Some(&target) = ids.get(pos + 1) else { return };
                if written.is_err() {
                    return;
                }
                nll -= f64::from(lp[target as usize]);
                count += 1;
                written = write_record(out, target, lp);
            })
            .context("running the forward pass")?;
            written?;
        }
        Ok((nll, count, started))
    }
}

/// The token a window starts with: BOS when the tokenizer's own encoding adds one.
fn bos_token(model: &LoadedModel) -> anyhow::Result<Option<u32>> {
    let with = model.tokenizer.encode("a", true).context("encoding a probe")?;
    let without = model.tokenizer.encode("a", false).context("encoding a probe")?;
    Ok((with.len() > without.len()).then(|| with[0]))
}

/// One scored position: the next token's id, then the log-softmax over the vocabulary.
fn write_record(out: &mut impl Write, target: u32, lp: &[f32]) -> std::io::Result<()> {
    out.write_all(&target.to_le_bytes())?;
    for v in lp {
        out.write_all(&v.to_le_bytes())?;
    }
    Ok(())
}
