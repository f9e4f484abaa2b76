//! `cargo xtask bench-decode`.

use std::process::ExitCode;

use xshell::Shell;

/// Flags of `cargo xtask bench-decode`.
#[derive(clap::Args)]
pub struct BenchDecode {}

impl BenchDecode {
    pub fn run(self, _sh: &Shell) -> anyhow::Result<ExitCode> {
        anyhow::bail!("bench-decode is not built yet")
    }
}
