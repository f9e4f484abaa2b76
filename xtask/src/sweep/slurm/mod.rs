//! `--runner slurm`: the sweep's cells handed to Slurm as job arrays instead of run here.
//! The submitting sweep builds kiln once, writes a run directory under `--shared-dir`
//! (the spec, env.json, both binaries, one batch script per model), submits the scripts
//! with `sbatch`, and with `--wait` follows them and merges the rows. Each task is
//! `xtask sweep-task RUN_DIR INDEX` ([`super::task`]): the local runner's code for one cell.

pub mod merge;
pub mod script;
pub mod wait;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use super::task::{TaskSpec, unix_now};
use crate::child::Shutdown;
use crate::console::usage;
use crate::fsx::write_atomic;
use crate::shell;
use merge::Jobs;
use script::SbatchOptions;

/// `--runner`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum RunnerKind {
    /// One cell after another on this machine.
    #[default]
    Local,
    /// Slurm job arrays, one per model (see docs/benchmarks.md).
    Slurm,
}

/// Where the cells run, and the Slurm options.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct RunnerFlags {
    /// Where the cells run: here, or as Slurm job arrays (one per model, its lengths in
    /// ascending order, one at a time).
    #[arg(long, value_enum, default_value_t = RunnerKind::Local)]
    pub runner: RunnerKind,
    /// --runner slurm: a directory every node sees at the same path; the run directory
    /// (plan, binaries, scripts, rows) goes under it, and the OOM record defaults to
    /// DIR/.oom-record.
    #[arg(long, value_name = "DIR")]
    pub shared_dir: Option<PathBuf>,
    /// --runner slurm: sbatch --partition.
    #[arg(long, value_name = "NAME")]
    pub partition: Option<String>,
    /// --runner slurm: sbatch --account.
    #[arg(long, value_name = "NAME")]
    pub account: Option<String>,
    /// --runner slurm: sbatch --time, the limit of each cell's task.
    #[arg(long, value_name = "TIME")]
    pub time: Option<String>,
    /// --runner slurm: sbatch --gres, e.g. gpu:1.
    #[arg(long, value_name = "LIST")]
    pub gres: Option<String>,
    /// --runner slurm: at most N models run at once (later arrays wait for earlier ones).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_parallel: Option<u64>,
    /// --runner slurm: one more #SBATCH option, as sbatch takes it (repeatable), e.g.
    /// --sbatch-arg=--mem=16G.
    #[arg(long = "sbatch-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub sbatch_args: Vec<String>,
    /// --runner slurm: print the batch scripts and the sbatch calls; submit nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// --runner slurm: follow the arrays until they end, then merge and print the summary.
    #[arg(long)]
    pub wait: bool,
}

/// Checked `--runner slurm` options.
#[derive(Clone, Debug)]
pub struct SlurmOptions {
    /// `--shared-dir`, absolute.
    pub shared_dir: PathBuf,
    /// The `#SBATCH` options.
    pub sbatch: SbatchOptions,
    /// `--max-parallel`.
    pub max_parallel: Option<usize>,
    /// `--dry-run`.
    pub dry_run: bool,
    /// `--wait`.
    pub wait: bool,
}

impl RunnerFlags {
    /// The Slurm options, or `None` for the local runner. A Slurm flag without
    /// `--runner slurm`, a missing or unusable `--shared-dir`, or no `sbatch` on PATH is a
    /// usage error, before anything is built.
    pub fn slurm(&self) -> Result<Option<SlurmOptions>> {
        if self.runner == RunnerKind::Local {
            let given = [
                ("--shared-dir", self.shared_dir.is_some()),
                ("--partition", self.partition.is_some()),
                ("--account", self.account.is_some()),
                ("--time", self.time.is_some()),
                ("--gres", self.gres.is_some()),
                ("--max-parallel", self.max_parallel.is_some()),
                ("--sbatch-arg", !self.sbatch_args.is_empty()),
                ("--dry-run", self.dry_run),
                ("--wait", self.wait),
            ];
            if let Some((flag, _)) = given.iter().find(|(_, set)| *set) {
                usage!("{flag} applies to --runner slurm only: add --runner slurm, or drop {flag}");
            }
            return Ok(None);
        }
        let Some(dir) = &self.shared_dir else {
            usage!(
                "--runner slurm needs --shared-dir DIR: a directory every node sees at the same path (the run directory goes under it)"
            );
        };
        let dir = crate::args::user_path(dir)?;
        if !dir.is_dir() {
            usage!(
                "--shared-dir {}: no such directory: expected a directory every node sees at the same path",
                dir.display()
            );
        }
        if dir.to_string_lossy().chars().any(char::is_whitespace) {
            usage!(
                "--shared-dir {}: the path holds whitespace, which #SBATCH --output cannot carry: expected a path without spaces",
                dir.display()
            );
        }
        let sbatch = SbatchOptions {
            partition: self.partition.clone(),
            account: self.account.clone(),
            time: self.time.clone(),
            gres: self.gres.clone(),
            extra: self.sbatch_args.clone(),
        };
        // Before anything is built: what the batch scripts will carry.
        script::check_inputs(&dir, &sbatch, &crate::machine::kiln_env())?;
        if !self.dry_run && !on_path("sbatch") {
            usage!(
                "--runner slurm: no sbatch on PATH: install the Slurm client, or pass --dry-run to see the scripts"
            );
        }
        Ok(Some(SlurmOptions {
            shared_dir: dir,
            sbatch,
            max_parallel: self.max_parallel.map(|n| n as usize),
            dry_run: self.dry_run,
            wait: self.wait,
        }))
    }
}

fn on_path(bin: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
}

/// Copies `from` to `to` with its permissions.
fn copy_binary(from: &Path, to: &Path) -> Result<()> {
    fs::copy(from, to).with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    Ok(())
}

/// Submits `spec` (whose `kiln` is the binary to copy in) from `run_dir`, which the caller
/// created under the shared directory and wrote env.json into; or, in a dry run, prints
/// what would be submitted. Returns the exit status: the merged sweep's with `--wait`,
/// else 0 once every array is queued.
pub fn submit(run_dir: &Path, mut spec: TaskSpec, opts: &SlurmOptions, shutdown: &Shutdown) -> Result<u8> {
    spec.arrays = script::arrays(&spec.plan, opts.max_parallel);
    let scripts: Vec<(PathBuf, String)> = spec
        .arrays
        .iter()
        .enumerate()
        .map(|(j, arr)| {
            let text = script::batch_script(
                run_dir,
                &spec.command,
                j,
                arr,
                &spec.plan,
                &opts.sbatch,
                &spec.kiln_env,
            )?;
            Ok((run_dir.join("slurm").join(format!("{}.sbatch", j + 1)), text))
        })
        .collect::<Result<_>>()?;
    if opts.dry_run {
        for (j, (path, text)) in scripts.iter().enumerate() {
            let args = script::sbatch_args(&spec.arrays[j], path, None);
            // The dependency placeholder stays a shell variable; every other word is quoted.
            let line: Vec<String> =
                args.iter().map(|a| if a.contains("$JOB_") { a.clone() } else { shell::quote(a) }).collect();
            println!(
                "# JOB_{}=$(sbatch {})\n# {}:\n{text}",
                j + 1,
                line.join(" "),
                shell::comment_text(&path.display().to_string())
            );
        }
        eprintln!(
            "dry run: {} cells in {} arrays; nothing was written or submitted",
            spec.plan.cells.len(),
            spec.arrays.len()
        );
        return Ok(0);
    }
    let bin = run_dir.join("bin");
    fs::create_dir_all(&bin).with_context(|| format!("creating {}", bin.display()))?;
    fs::create_dir_all(run_dir.join("slurm"))?;
    fs::create_dir_all(run_dir.join("rows"))?;
    copy_binary(&spec.kiln, &bin.join("kiln"))?;
    let xtask = std::env::current_exe().context("finding the running xtask binary")?;
    copy_binary(&xtask, &bin.join("xtask"))?;
    spec.kiln = bin.join("kiln");
    spec.write(run_dir)?;
    for (path, text) in &scripts {
        write_atomic(path, text.as_bytes())?;
    }
    let mut jobs = Jobs { submitted_unix: unix_now(), job_ids: Vec::new() };
    for (j, (path, _)) in scripts.iter().enumerate() {
        let args = script::sbatch_args(&spec.arrays[j], path, Some(&jobs.job_ids));
        let out = Command::new("sbatch").args(&args).current_dir(&spec.user_cwd).output();
        let id = match &out {
            Ok(o) if o.status.success() => {
                let text = String::from_utf8_lossy(&o.stdout);
                text.trim().split(';').next().unwrap_or("").to_string()
            }
            _ => String::new(),
        };
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
            let why = match &out {
                Ok(o) => format!(
                    "{}: {}{}",
                    o.status,
                    String::from_utf8_lossy(&o.stderr).trim(),
                    String::from_utf8_lossy(&o.stdout).trim()
                ),
                Err(e) => e.to_string(),
            };
            if !jobs.job_ids.is_empty() {
                eprintln!("cancelling the arrays already queued: {}", jobs.job_ids.join(" "));
                let _ = wait::scancel(&jobs);
            }
            anyhow::bail!("sbatch {} failed ({why})", args.join(" "));
        }
        let arr = &spec.arrays[j];
        eprintln!(
            "submitted {} as job {id}: {} cells, one at a time{}",
            arr.model,
            arr.cells.len(),
            arr.after.map(|a| format!(", after job {}", jobs.job_ids[a])).unwrap_or_default()
        );
        jobs.job_ids.push(id);
    }
    write_atomic(&run_dir.join(Jobs::FILE), (serde_json::to_string_pretty(&jobs)? + "\n").as_bytes())?;
    if !opts.wait {
        eprintln!(
            "queued {} cells; when they end: cargo xtask merge {}",
            spec.plan.cells.len(),
            shell::quote(&run_dir.display().to_string())
        );
        return Ok(0);
    }
    let followed = wait::follow(run_dir, &spec, &jobs, shutdown)?;
    let code = merge::merge_run(
        run_dir,
        merge::MergeOptions {
            interrupted: followed.interrupted,
            reported: followed.lost.clone(),
            ..merge::MergeOptions::default()
        },
    )?;
    if let Some(line) = wait::overhead(run_dir, &spec, &jobs, &followed, unix_now()) {
        eprintln!("{line}");
    }
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_flags_need_the_slurm_runner_and_a_shared_dir() {
        let local = RunnerFlags { partition: Some("gpu".into()), ..RunnerFlags::default() };
        let e = local.slurm().unwrap_err().to_string();
        assert!(e.contains("--partition applies to --runner slurm only"), "{e}");
        assert!(RunnerFlags::default().slurm().unwrap().is_none());
        let no_dir = RunnerFlags { runner: RunnerKind::Slurm, dry_run: true, ..RunnerFlags::default() };
        assert!(no_dir.slurm().unwrap_err().to_string().contains("needs --shared-dir"));
        let gone = RunnerFlags { shared_dir: Some("/nonexistent/kiln".into()), ..no_dir.clone() };
        assert!(gone.slurm().unwrap_err().to_string().contains("no such directory"));
        let dir = tempfile::tempdir().unwrap();
        let ok = RunnerFlags { shared_dir: Some(dir.path().into()), max_parallel: Some(2), ..no_dir };
        let o = ok.slurm().unwrap().unwrap();
        assert_eq!((o.max_parallel, o.dry_run), (Some(2), true));
        // A newline in an option is refused as bad input before anything is built.
        let nl = RunnerFlags { sbatch_args: vec!["--mem=1G\ntouch /tmp/x".into()], ..ok.clone() };
        let e = nl.slurm().unwrap_err();
        assert!(e.downcast_ref::<crate::console::UsageError>().is_some(), "{e}");
        assert!(e.to_string().contains("--sbatch-arg \"--mem=1G\\ntouch /tmp/x\""), "{e}");
        let nl = RunnerFlags { partition: Some("gpu\nid".into()), ..ok };
        assert!(nl.slurm().unwrap_err().to_string().starts_with("--partition "));
    }
}
