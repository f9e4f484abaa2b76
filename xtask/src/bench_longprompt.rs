//! `cargo xtask bench-longprompt`.

use std::process::ExitCode;

use xshell::Shell;

/// Flags of `cargo xtask bench-longprompt`.
#[derive(clap::Args)]
pub struct BenchLongprompt {}

impl BenchLongprompt {
    pub fn run(self, _sh: &Shell) -> anyhow::Result<ExitCode> {
        anyhow::bail!("bench-longprompt is not built yet")
    }
}
