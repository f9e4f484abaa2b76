//! The `kiln` binary: `generate`, `bench-decode`, `estimate`, `serve`, `score`,
//! `bench-expert-copy`, `export-gguf` and `export-tokenizer`. It parses the command
//! line, runs one command, and turns its outcome into the documented exit status
//! (docs/cli.md, docs/engine-protocol.md); everything else lives in kiln-model.

mod args;
mod backend;
mod bench;
mod cli;
mod clock;
mod estimate;
mod exit;
mod expert_copy;
mod export;
mod export_tokenizer;
mod generate;
mod prompt;
mod roofs;
mod runtime;
mod rusage;
mod score;
mod serve;
mod speculate;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};

use crate::cli::{Cli, Command};
use crate::clock::Clock;

fn main() -> ExitCode {
    let mut clock = Clock::start();
    exit::install_panic_report();
    // clap prints usage errors itself and exits 2, the protocol's code for bad arguments.
    let cli = cli::with_negative_values(Cli::command()).get_matches();
    let cli = Cli::from_arg_matches(&cli).unwrap_or_else(|e| e.exit());
    let result = runtime::check_env().and_then(|()| match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::BenchDecode(args) => bench::run(args, &mut clock),
        Command::Estimate(args) => estimate::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Score(args) => score::run(args),
        Command::BenchExpertCopy(args) => expert_copy::run(args),
        Command::ExportGguf(args) => export::run(args),
        Command::ExportTokenizer(args) => export_tokenizer::run(args),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => exit::report(&e),
    }
}
