//! `cargo xtask bench-decode`: one decode measurement per model, through the same layers
//! and runner as a long-prompt sweep.

use std::process::ExitCode;

use anyhow::Result;
use xshell::Shell;

use crate::args::user_path;
use crate::sweep::plan::{self, Named, Plan, Prompt};
use crate::sweep::series;
use crate::sweep::{HarnessEnv, Session, SweepFlags};

/// The prompt length of a cell when neither `--prompt` nor `--prompt-tokens` is given.
const DEFAULT_PROMPT_TOKENS: u64 = 128;

/// Flags of `cargo xtask bench-decode`.
#[derive(clap::Args)]
pub struct BenchDecode {
    /// Models, comma- or space-separated: synthetic:<profile>, a directory under
    /// ./models/, or a path [default on the CPU: synthetic:tiny, synthetic:smollm-135m,
    /// synthetic:qwen2.5-0.5b; on a GPU: synthetic:qwen2.5-0.5b, synthetic:llama-3.2-1b,
    /// synthetic:llama-3.1-8b].
    #[arg(short = 'm', long, alias = "model", value_name = "LIST", value_parser = plan::models_arg)]
    models: Option<plan::Models>,
    /// The prompt text.
    #[arg(long, value_name = "TEXT", conflicts_with = "prompt_tokens")]
    prompt: Option<String>,
    /// A prompt of N tokens built by the engine [default: 128].
    #[arg(long, value_name = "N")]
    prompt_tokens: Option<u64>,
    #[command(flatten)]
    sweep: SweepFlags,
}

impl BenchDecode {
    pub fn run(self, sh: &Shell) -> Result<ExitCode> {
        let harness_env = HarnessEnv::read()?;
        let session = Session::prepare(&sh.current_dir(), "decode", &self.sweep, harness_env)?;
        let d = session.defaults().clone();
        let named = Named {
            models: self.models.is_some(),
            prompts: self.prompt.is_some() || self.prompt_tokens.is_some(),
        };
        let prompt = match (self.prompt, self.prompt_tokens) {
            (Some(text), _) => Prompt::Text(text),
            (None, Some(n)) => Prompt::Tokens(n),
            (None, None) => Prompt::Tokens(DEFAULT_PROMPT_TOKENS),
        };
        let template = self.sweep.cell_template(&d, named)?;
        let plan = Plan::grid(&self.models.map_or(d.models, |m| m.0), &[prompt], &template);
        let plan = series::expand(&plan, self.sweep.series.repeat, self.sweep.series.peer.is_some());
        let path = match &self.sweep.output {
            Some(p) => user_path(p)?,
            None => session.default_output("decode")?,
        };
        let output = session.open_output(path, false, &session.knobs(&template))?;
        session.sweep(&plan, output, &self.sweep)
    }
}
