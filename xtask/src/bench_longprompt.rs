//! `cargo xtask bench-longprompt`: models x prompt lengths, model-major, through the
//! estimate, backstop and OOM-record layers.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use xshell::Shell;

use crate::console::usage;
use crate::sweep::plan::{self, Named, Plan, Prompt};
use crate::sweep::record::real_path;
use crate::sweep::{HarnessEnv, Session, SweepFlags, user_path};

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
    // Hyphen values reach the ladder parser, so `--lengths -5` gets its message.
    #[arg(long, value_name = "LADDER", value_parser = plan::ladder_arg, allow_hyphen_values = true)]
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
        let resume = match &self.resume {
            Some(file) => {
                let file = user_path(file)?;
                if let Some(out) = &self.sweep.output
                    && real_path(&user_path(out)?) != real_path(&file)
                {
                    usage!(
                        "--resume {} and --output {} differ: a resumed sweep appends to the file it resumes",
                        file.display(),
                        out.display()
                    );
                }
                Some(file)
            }
            None => None,
        };
        let session = Session::prepare(&sh.current_dir(), "longprompt", &self.sweep, harness_env)?;
        let d = session.defaults().clone();
        let named = Named { models: self.models.is_some(), prompts: self.lengths.is_some() };
        let template = self.sweep.cell_template(&d, named)?;
        let models = self.models.map_or(d.models, |m| m.0);
        let prompts: Vec<Prompt> =
            self.lengths.map_or(d.lengths, |l| l.0).into_iter().map(Prompt::Tokens).collect();
        let plan = Plan::grid(&models, &prompts, &template);
        let knobs = session.knobs(&template);
        let output = match resume {
            Some(path) => session.open_output(path, true, &knobs)?,
            None => {
                let path = match &self.sweep.output {
                    Some(p) => user_path(p)?,
                    None => session.default_output("longprompt")?,
                };
                session.open_output(path, false, &knobs)?
            }
        };
        session.sweep(&plan, output, &self.sweep)
    }
}
