//! `cargo xtask oom-record`.

use std::process::ExitCode;

use xshell::Shell;

/// Flags of `cargo xtask oom-record`.
#[derive(clap::Args)]
pub struct OomRecord {}

impl OomRecord {
    pub fn run(self, _sh: &Shell) -> anyhow::Result<ExitCode> {
        anyhow::bail!("oom-record is not built yet")
    }
}
