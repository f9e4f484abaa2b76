//! `cargo xtask`: kiln's benchmark harness. A thin dispatcher: parse the flags, move to
//! the workspace root, run one task. Each task lives in its own module; what the bench
//! tasks share (plan, layers, record, runner) lives in `sweep`.

mod bench_decode;
mod bench_kernels;
mod bench_longprompt;
mod bench_quality;
mod console;
mod engine;
mod machine;
mod oom_record;
mod shutdown;
mod sweep;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
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
    /// Inspect or prune benchmarks/.oom-record.
    OomRecord(oom_record::OomRecord),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let sh = match Shell::new() {
        Ok(sh) => sh,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    sh.change_dir(project_root());
    let result = match cli.task {
        Task::BenchDecode(t) => t.run(&sh),
        Task::BenchLongprompt(t) => t.run(&sh),
        Task::BenchKernels(t) => t.run(&sh),
        Task::BenchQuality(t) => t.run(&sh),
        Task::OomRecord(t) => t.run(&sh),
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

/// The workspace root: xtask's manifest directory's parent.
fn project_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(|p| p.to_path_buf())
        .unwrap_or_else(|| std::path::PathBuf::from("."))
}
