//! The adapter a `vulkan` or `metal` sweep runs on, as the built engine names it: `kiln
//! estimate --backend vulkan|metal` finds the adapter without opening a device and prints
//! it (`device`). The harness asks once, before the first cell, so the rows' device, driver
//! and pre-skip budget are the adapter's, never the host's.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::Result;
use kiln_protocol::EstimateReport;

use super::runner::{Ran, run_logged};
use crate::child::Shutdown;
use crate::console::usage;
use crate::machine::Machine;
use crate::sweep::classify::ChildExit;

/// How long the engine may take to name its adapter (a driver that does not answer).
const ADAPTER_TIMEOUT: Duration = Duration::from_secs(120);

/// Asks `kiln` which adapter `backend` runs on and keeps it in `machine`; its output goes
/// to `<base>.stdout` / `<base>.stderr`. Nothing is asked for any other backend. An
/// engine that cannot name its adapter (none found, built without the backend) is a usage
/// error in the engine's words; one that does not answer in two minutes is killed.
pub fn find(
    machine: &mut Machine,
    kiln: &Path,
    backend: &str,
    base: &Path,
    shutdown: &Shutdown,
) -> Result<Ran<()>> {
    if !matches!(backend, "vulkan" | "metal") {
        return Ok(Ran::Done(()));
    }
    let mut cmd = Command::new(kiln);
    cmd.args(["estimate", "-m", "synthetic:tiny", "--prompt-tokens", "1", "--max-tokens", "1"])
        .args(["--backend", backend]);
    let what = format!("finding the {backend} adapter");
    let (exit, out, err) = match run_logged(cmd, &what, base, ADAPTER_TIMEOUT, shutdown)? {
        Ran::Done(x) => x,
        Ran::Interrupted(sig) => return Ok(Ran::Interrupted(sig)),
    };
    let said =
        err.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("(nothing on stderr)").trim().to_string();
    match exit {
        ChildExit::Code(0) => {}
        ChildExit::TimedOut => anyhow::bail!(
            "--backend {backend}: {} estimate did not name its adapter within {} s (a driver that does not answer?); killed",
            kiln.display(),
            ADAPTER_TIMEOUT.as_secs()
        ),
        _ => usage!("--backend {backend}: the engine did not name its {backend} adapter: {said}"),
    }
    let report = EstimateReport::parse(&out)
        .map_err(|e| anyhow::anyhow!("{} estimate --backend {backend}: {e}", kiln.display()))?;
    match report.and_then(|r| r.device) {
        Some(d) => machine.adapter = Some(d),
        None => anyhow::bail!(
            "{} estimate --backend {backend} named no adapter: an engine older than the `device` field?",
            kiln.display()
        ),
    }
    Ok(Ran::Done(()))
}
