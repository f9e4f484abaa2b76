//! `cargo xtask bench-longprompt`: models x prompt lengths, model-major, through the
//! estimate, backstop and OOM-record layers.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use xshell::Shell;

use crate::console::usage;
use crate::sweep::plan::{self, Named, Plan, Prompt};
use crate::sweep::{HarnessEnv, Output, Prepared, Session, SweepFlags, rows, user_path};

/// Flags of `cargo xtask bench-longprompt`.
#[derive(clap::Args)]
pub struct BenchLongprompt {
    /// Models, comma- or space-separated: synthetic:<profile>, a directory under
    /// ./models/, or a path [default on the CPU: synthetic:tiny, synthetic:smollm-135m,
    /// synthetic:qwen2.5-0.5b; on a GPU: synthetic:qwen2.5-0.5b, synthetic:llama-3.2-1b,
    /// synthetic:llama-3.1-8b].
    #[arg(long, value_name = "LIST", value_parser = plan::models_arg)]
    models: Option<plan::Models>,
    /// Prompt lengths in tokens, e.g. "512 2048 8192" [default: "128 512 2048" on the
    /// CPU, "512 2048 8192 32768" on a GPU].
    #[arg(long, value_name = "LADDER", value_parser = plan::ladder_arg)]
    lengths: Option<plan::Ladder>,
    /// Append to FILE, running only the cells that have no row in it.
    #[arg(long, value_name = "FILE")]
    resume: Option<PathBuf>,
    #[command(flatten)]
    sweep: SweepFlags,
}

impl BenchLongprompt {
    pub fn run(self, sh: &Shell) -> Result<ExitCode> {
        let harness_env = HarnessEnv::read()?;
        let resumed = match &self.resume {
            Some(file) => {
                let file = user_path(file)?;
                if let Some(out) = &self.sweep.output
                    && user_path(out)? != file
                {
                    usage!(
                        "--resume {} and --output {} differ: a resumed sweep appends to the file it resumes",
                        file.display(),
                        out.display()
                    );
                }
                if !file.is_file() {
                    usage!(
                        "--resume {}: no such file: expected a CSV written by an earlier sweep",
                        file.display()
                    );
                }
                Some((file.clone(), rows::read_rows(&file)?))
            }
            None => None,
        };
        let session = match Session::prepare(&sh.current_dir(), "longprompt", &self.sweep, harness_env)? {
            Prepared::Ready(s) => s,
            Prepared::Interrupted(sig) => return Ok(ExitCode::from(crate::child::exit_code_for(sig))),
        };
        let d = session.defaults().clone();
        let named = Named { models: self.models.is_some(), prompts: self.lengths.is_some() };
        let template = self.sweep.cell_template(&d, named)?;
        let models = self.models.map_or(d.models, |m| m.0);
        let prompts: Vec<Prompt> =
            self.lengths.map_or(d.lengths, |l| l.0).into_iter().map(Prompt::Tokens).collect();
        let plan = Plan::grid(&models, &prompts, &template);
        let output = match resumed {
            Some((path, rows)) => Output { path, resumed: Some(rows) },
            None => Output {
                path: match &self.sweep.output {
                    Some(p) => user_path(p)?,
                    None => session.default_output("longprompt"),
                },
                resumed: None,
            },
        };
        session.sweep(&plan, output, &self.sweep)
    }
}
