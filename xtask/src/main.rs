//! `cargo xtask`: kiln's benchmark harness. A thin dispatcher: parse the flags, move to
//! the workspace root, run one task. Each task lives in its own module; what the bench
//! tasks share (plan, layers, record, runner) lives in `sweep`.

mod args;
mod bench_decode;
mod bench_kernels;
mod bench_longprompt;
mod bench_offload_copy;
mod bench_quality;
mod bisect;
mod child;
mod console;
mod cuda_toolkit;
mod fsx;
mod kiln_build;
mod machine;
mod oom_record;
mod peer;
mod pin_tax;
mod plot;
mod quiet;
mod report;
mod run_dir;
mod serve_bench;
mod server;
mod shell;
mod sweep;
mod verdict;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use xshell::Shell;

/// kiln's benchmark harness.
#[derive(Parser)]
#[command(name = "cargo xtask", about = "kiln's benchmark harness")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// One decode measurement per model.
    BenchDecode(bench_decode::BenchDecode),
    /// Models x prompt lengths, with the OOM-avoidance layers.
    BenchLongprompt(bench_longprompt::BenchLongprompt),
    /// criterion kernel benchmarks and a pull-request report.
    BenchKernels(bench_kernels::BenchKernels),
    /// Perplexity and KL divergence of each activation scheme against an f32 reference.
    BenchQuality(bench_quality::BenchQuality),
    /// MoE models x expert-cache slots x batch sizes x miss rates: the offload copy cost.
    BenchOffloadCopy(bench_offload_copy::BenchOffloadCopy),
    /// Inspect or prune benchmarks/.oom-record.
    OomRecord(oom_record::OomRecord),
    /// Load-test an OpenAI-compatible server: latency percentiles and throughput per level.
    ServeBench(serve_bench::ServeBench),
    /// Price the qmv_wide narrow pin with interleaved (ABBA) boots of kiln serve.
    QmvPinTax(pin_tax::QmvPinTax),
    /// Write report.html for run directories again from their files; compare two or more.
    Report(report::Report),
    /// Find the first commit that made a measurement worse, calling each revision like good or like bad from ABBA pairs.
    Bisect(bisect::Bisect),
    /// Join the rows of a `--runner slurm` sweep into its CSV and print the summary.
    Merge(sweep::slurm::merge::Merge),
    /// Run one cell of a planned sweep (what each Slurm task calls).
    #[command(hide = true)]
    SweepTask(sweep::task::SweepTask),
}

/// `cmd` with every flag that takes a value allowed to take a negative number as it, in
/// every subcommand: `--threads -1` then reaches the flag's parser and gets its message
/// with the accepted range instead of clap's "unexpected argument '-1'".
fn with_negative_values(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|a| {
        if a.get_action().takes_values() && !a.is_positional() { a.allow_negative_numbers(true) } else { a }
    })
    .mut_subcommands(with_negative_values)
}

fn main() -> ExitCode {
    let matches = with_negative_values(Cli::command()).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let sh = match Shell::new() {
        Ok(sh) => sh,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    match std::env::current_dir() {
        Ok(cwd) => sh.change_dir(args::project_root(&cwd)),
        Err(e) => {
            eprintln!("error: reading the current directory: {e}");
            return ExitCode::FAILURE;
        }
    }
    let result = match cli.task {
        Task::BenchDecode(t) => t.run(&sh),
        Task::BenchLongprompt(t) => t.run(&sh),
        Task::BenchOffloadCopy(t) => t.run(&sh),
        Task::BenchKernels(t) => t.run(&sh),
        Task::BenchQuality(t) => t.run(&sh),
        Task::OomRecord(t) => t.run(&sh),
        Task::ServeBench(t) => t.run(&sh),
        Task::QmvPinTax(t) => t.run(&sh),
        Task::Report(t) => t.run(),
        Task::Bisect(t) => t.run(&sh),
        Task::Merge(t) => t.run(),
        Task::SweepTask(t) => t.run(),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            let (code, print) = console::exit_for(&e);
            if print {
                eprintln!("error: {e:#}");
            }
            ExitCode::from(code)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every task that takes a model takes it as `-m`, `--model` and `--models`: the
    /// spellings differ between tasks, so each accepts all of them.
    #[test]
    fn every_model_flag_accepts_every_spelling() {
        fn walk(cmd: &clap::Command, path: &mut Vec<String>, found: &mut Vec<Vec<String>>) {
            let takes_model = cmd.get_arguments().any(|a| matches!(a.get_long(), Some("model" | "models")));
            if takes_model {
                found.push(path.clone());
            }
            for sub in cmd.get_subcommands() {
                path.push(sub.get_name().to_string());
                walk(sub, path, found);
                path.pop();
            }
        }
        let cli = with_negative_values(Cli::command());
        let mut found = Vec::new();
        walk(&cli, &mut Vec::new(), &mut found);
        assert!(found.len() >= 6, "{found:?}");
        for path in &found {
            for spelling in ["-m", "--model", "--models"] {
                let mut argv = vec!["cargo xtask".to_string()];
                argv.extend(path.iter().cloned());
                argv.extend([spelling.to_string(), "synthetic:tiny".to_string()]);
                if let Err(e) = cli.clone().try_get_matches_from(&argv) {
                    assert!(!matches!(e.kind(), clap::error::ErrorKind::UnknownArgument), "{argv:?}: {e}");
                }
            }
        }
    }
}
