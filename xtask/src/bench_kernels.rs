//! `cargo xtask bench-kernels`.

use std::process::ExitCode;

use xshell::Shell;

/// Flags of `cargo xtask bench-kernels`.
#[derive(clap::Args)]
pub struct BenchKernels {}

impl BenchKernels {
    pub fn run(self, _sh: &Shell) -> anyhow::Result<ExitCode> {
        anyhow::bail!("bench-kernels is not built yet")
    }
}
