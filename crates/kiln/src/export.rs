//! `kiln export-gguf MODEL OUT.gguf`: loads a model and writes it as a GGUF file
//! (kiln-model's `checkpoint::gguf::export` says what each tensor becomes), then says on
//! stdout how every matrix was written.

use std::io::Write;

use anyhow::Context;
use kiln_core::MemoryPool;
use kiln_model::LoadOptions;

use crate::args::ExportArgs;
use crate::runtime;

/// Runs the command on the worker pool.
pub fn run(args: ExportArgs) -> anyhow::Result<()> {
    runtime::check_threads(args.threads)?;
    runtime::in_pool(args.threads, |_| export(args))
}

fn export(args: ExportArgs) -> anyhow::Result<()> {
    // Before the model loads: a FIFO or a device is refused at once (exit 2).
    kiln_model::output::destination(&args.out)
        .with_context(|| format!("invalid OUT.gguf {}", args.out.display()))?;
    let pool = MemoryPool::from_env()?;
    let opts = LoadOptions { pool, quantize: args.quantize.as_deref().and_then(|b| b.parse().ok()) };
    let model =
        kiln_model::load(&args.model, &opts).with_context(|| format!("loading model {}", args.model))?;
    let report = kiln_model::checkpoint::gguf::export(&model, &args.out)
        .with_context(|| format!("exporting {} to {}", args.model, args.out.display()))?;
    let mut out = std::io::stdout().lock();
    let mut line = format!(
        "wrote {} ({} bytes): {} matrices as Q4_1, {} as Q8_0, {} as F32",
        report.path.display(),
        report.bytes,
        report.q4_1,
        report.q8_0,
        report.f32.len()
    );
    if let Some((name, why)) = report.f32.first() {
        line.push_str(&format!(" (first: {name}: {why})"));
    }
    writeln!(out, "{line}").context("writing to stdout")?;
    Ok(())
}
