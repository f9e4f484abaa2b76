//! Where bisect builds: one git worktree at one path for the whole run, checked out at
//! each revision in turn, and one target dir, so that after the first (cold) build cargo
//! rebuilds only the crates a revision changed. A fresh worktree per revision would give
//! every file a new path and a new mtime, and cargo would rebuild every crate each time.
//!
//! Both live in the run directory and go when the run ends, however it ends (success, an
//! error, a signal), unless `--keep-build` keeps them. The worktree is locked with the
//! run's pid as the reason, so one that a run killed where it could not clean up
//! (SIGKILL) left registered is found by the next run in the repository, new or resumed,
//! and removed, with the target dir of its run.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// A repository's (or a worktree's) git.
pub struct Git<'a>(pub &'a Path);

impl Git<'_> {
    /// Runs git with `args`: its trimmed standard output, or an error with its stderr.
    pub fn run(&self, args: &[&str]) -> Result<String> {
        let out = Command::new("git").current_dir(self.0).args(args).output().context("running git")?;
        if !out.status.success() {
            bail!("git {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }
}

/// The lock reason of the worktree a run adds, before its pid.
const LOCK_REASON: &str = "kiln bisect pid ";

/// The run directory's worktree, checked out at each revision in turn.
pub const WORKTREE: &str = "worktree-checkout";

/// The run directory's target dir.
pub const TARGET: &str = "target";

/// Unlocks and removes the worktree at `dir`, and its registration; a directory git will
/// not remove is deleted and the registration pruned.
fn remove_worktree(git: &Git<'_>, dir: &Path) {
    let d = dir.display().to_string();
    let _ = git.run(&["worktree", "unlock", &d]);
    if git.run(&["worktree", "remove", "--force", &d]).is_err() {
        let _ = fs::remove_dir_all(dir);
        let _ = git.run(&["worktree", "prune"]);
    }
}

/// Removes the worktrees that earlier runs left registered: a run killed by a signal it
/// cannot trap (SIGKILL) never reaches [`Checkout`]'s drop. A worktree is stale when its
/// lock names the pid of a process that is gone; a live run's are left alone. The target
/// dir beside a stale worktree goes with it, unless it is `run_dir`'s own (a resumed run
/// builds on in it).
pub fn remove_stale_worktrees(git: &Git<'_>, run_dir: &Path) {
    let _ = git.run(&["worktree", "prune"]);
    let Ok(list) = git.run(&["worktree", "list", "--porcelain"]) else { return };
    let ours = fs::canonicalize(run_dir).ok();
    for entry in list.split("\n\n") {
        let path = entry.lines().find_map(|l| l.strip_prefix("worktree "));
        let pid = entry
            .lines()
            .find_map(|l| l.strip_prefix("locked ")?.strip_prefix(LOCK_REASON)?.trim().parse::<i32>().ok());
        let (Some(path), Some(pid)) = (path, pid) else { continue };
        if process_alive(pid) {
            continue;
        }
        eprintln!("removing the worktree {path}: bisect pid {pid}, which added it, is gone");
        let path = Path::new(path);
        remove_worktree(git, path);
        // Only a bisect run directory's own target dir, never one a name merely matches.
        if let Some(parent) = path.parent()
            && parent.join("measurements.jsonl").is_file()
            && fs::canonicalize(parent).ok() != ours
            && parent.join(TARGET).is_dir()
        {
            eprintln!("removing its run's target dir {}", parent.join(TARGET).display());
            let _ = fs::remove_dir_all(parent.join(TARGET));
        }
    }
}

/// Whether a process with this pid exists (a reused pid counts: the worktree is kept).
fn process_alive(pid: i32) -> bool {
    match rustix::process::Pid::from_raw(pid) {
        Some(p) => !matches!(rustix::process::test_kill_process(p), Err(e) if e == rustix::io::Errno::SRCH),
        None => false,
    }
}

/// The run's one worktree and target dir; removed when dropped (whatever ends the run's
/// scope: its end, an error, a signal), or kept and unlocked with `keep`.
pub struct Checkout<'a> {
    git: &'a Git<'a>,
    /// The worktree's path.
    pub dir: PathBuf,
    /// The target dir every build uses.
    pub target: PathBuf,
    added: bool,
    keep: bool,
}

impl<'a> Checkout<'a> {
    /// The worktree and target dir of `run_dir`; nothing is added until the first
    /// [`Checkout::at`].
    pub fn new(git: &'a Git<'a>, run_dir: &Path, keep: bool) -> Checkout<'a> {
        Checkout { git, dir: run_dir.join(WORKTREE), target: run_dir.join(TARGET), added: false, keep }
    }

    /// The worktree, checked out at `sha`: added (locked with this run's pid) the first
    /// time, after that checked out in place, which rewrites only the files that differ,
    /// so cargo sees every other file as it was.
    pub fn at(&mut self, sha: &str) -> Result<&Path> {
        let d = self.dir.display().to_string();
        let reason = format!("{LOCK_REASON}{}", std::process::id());
        // One that --keep-build kept (unlocked) is taken over, with its files as they are,
        // so its builds stay warm too.
        if !self.added
            && self.dir.exists()
            && self.git.run(&["worktree", "lock", "--reason", &reason, &d]).is_ok()
        {
            self.added = true;
        }
        if !self.added {
            // Anything else there (a killed run's, already unregistered) is no one's.
            if self.dir.exists() {
                remove_worktree(self.git, &self.dir);
            }
            let _ = self.git.run(&["worktree", "prune"]);
            self.git.run(&["worktree", "add", "--detach", "--lock", "--reason", &reason, &d, sha])?;
            self.added = true;
        } else {
            // --force: a build may have touched a tracked file (a Cargo.lock brought up to
            // date); the revision's own contents win.
            Git(&self.dir)
                .run(&["checkout", "--quiet", "--force", "--detach", sha])
                .with_context(|| format!("checking out {} in {d}", &sha[..12]))?;
        }
        Ok(&self.dir)
    }
}

impl Drop for Checkout<'_> {
    fn drop(&mut self) {
        let built = self.target.is_dir();
        if !self.added && !built {
            return;
        }
        if self.keep {
            // Unlocked, so the next bisect in the repository does not take it for stale.
            let _ = self.git.run(&["worktree", "unlock", &self.dir.display().to_string()]);
            eprintln!(
                "kept (--keep-build): the worktree {} (git worktree remove {0} removes it) and the target dir {}",
                self.dir.display(),
                self.target.display()
            );
            return;
        }
        if self.added {
            remove_worktree(self.git, &self.dir);
        }
        if built {
            let _ = fs::remove_dir_all(&self.target);
        }
        let what = if built { "the worktree and the target dir" } else { "the worktree" };
        eprintln!("removed {what} (--keep-build keeps them)");
    }
}
