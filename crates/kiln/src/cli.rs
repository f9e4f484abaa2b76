//! The command line, as clap parses it: the `kiln` command and its subcommands, each
//! taking its arguments from [`crate::args`]. Flag names and meanings are the engine
//! protocol (docs/engine-protocol.md); docs/cli.md describes every one.

use clap::{Parser, Subcommand};

use crate::args::{BenchArgs, EstimateArgs, ExpertCopyArgs, ExportArgs, GenerateArgs, ScoreArgs};

const EXIT_STATUS: &str = "\
Exit status:
  0  success
  1  anything else (a bug, an I/O failure); stderr has `error: ...`
  2  bad arguments or an unusable model (missing path, unsupported config, invalid
     geometry, prompt plus generated tokens beyond the context); stderr names the input
     and what is accepted
  3  out of memory: the memory pool refused an allocation; stderr has a line starting
     `out of memory:` naming the request, the bytes in use and the limit";

/// `cmd` with every flag that takes a value allowed to take a negative number as it, in
/// every subcommand: `--threads -1` then gets its parser's message with the accepted
/// range instead of clap's "unexpected argument '-1'".
pub fn with_negative_values(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|a| {
        if a.get_action().takes_values() && !a.is_positional() { a.allow_negative_numbers(true) } else { a }
    })
    .mut_subcommands(with_negative_values)
}

/// The kiln inference engine.
#[derive(Parser, Debug)]
#[command(name = "kiln", version, about, after_help = EXIT_STATUS)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
// One value per process, parsed once and moved into its command: the size of the
// largest variant (serve's flags) costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// Generate text from a prompt, streamed to stdout as it is decoded.
    #[command(after_help = EXIT_STATUS)]
    Generate(GenerateArgs),
    /// Run one decode measurement and print one JSON object (or a CSV row).
    #[command(after_help = EXIT_STATUS)]
    BenchDecode(BenchArgs),
    /// Predict the memory pool's peak for a run, without loading the weights.
    #[command(after_help = EXIT_STATUS)]
    Estimate(EstimateArgs),
    /// Serve the OpenAI API (chat and text completions) with continuous batching.
    #[command(after_help = EXIT_STATUS)]
    Serve(crate::serve::ServeArgs),
    /// Write the log-probabilities of a text, window by window, for quality measurements.
    #[command(after_help = EXIT_STATUS)]
    Score(ScoreArgs),
    /// Measure one expert-cache geometry (MoE model, --expert-slots, batch size, miss
    /// rate): copy GB/s, expert-fetch time per token and the read bandwidth, as one JSON
    /// object.
    #[command(after_help = EXIT_STATUS)]
    BenchExpertCopy(ExpertCopyArgs),
    /// Write a model as a GGUF file llama.cpp runs, with kiln's own weights where the
    /// formats coincide (4-bit groups of 32 are Q4_1 blocks).
    #[command(after_help = EXIT_STATUS)]
    ExportGguf(ExportArgs),
    /// Write a model's tokenizer as Hugging Face files (tokenizer.json and
    /// tokenizer_config.json with the chat template), for tools that count tokens as
    /// kiln does.
    #[command(after_help = EXIT_STATUS)]
    ExportTokenizer(crate::export_tokenizer::ExportTokenizerArgs),
}
