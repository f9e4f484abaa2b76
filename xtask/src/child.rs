//! Child processes the harness owns, and the one shutdown point.
//!
//! Every child is started with [`spawn`]: in its own process group (a build too: the
//! harness receives the terminal's Ctrl-C and stops the whole group, cargo and every rustc
//! it started) and, on Linux, with a parent-death signal, so that a harness killed by a
//! signal it cannot trap (SIGKILL, SIGUSR1, SIGXFSZ, ...) takes its children with it.
//! The [`Owned`] handle it returns can
//!
//! - run the child to completion under a timeout, turning SIGINT, SIGTERM and SIGHUP
//!   into one event that stops it ([`Owned::wait`], what a sweep cell does);
//! - check that a long-running child is still alive ([`Owned::is_alive`]) and stop it:
//!   SIGTERM, a grace period, then SIGKILL of its whole group ([`Owned::stop`], what a
//!   server driver does).
//!
//! Whatever happens, the child is reaped exactly once: a handle dropped unreaped (an
//! error path) kills the group and reaps it. Nothing else in the harness looks at
//! signals or kills processes.
//!
//! Two limits of the parent-death signal, by the kernel's design: it fires when the
//! *thread* that spawned the child ends, so spawn long-running children from a thread
//! that outlives them (the main thread); and it reaches the child only, not processes the
//! child starts itself (a normal exit or a stop still kills the whole group).

use std::cell::Cell;
use std::io;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rustix::process::{Pid, Signal, WaitId, WaitIdOptions, kill_process_group, waitid};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// How a wait ended.
#[derive(Debug)]
pub enum Waited {
    /// The child ended on its own.
    Exited(ExitStatus),
    /// The time ran out; the child was stopped and reaped.
    TimedOut,
    /// A signal arrived; the child was stopped and reaped.
    Interrupted(i32),
}

/// Starts `cmd` in a new process group led by the child, with its parent-death signal set
/// to SIGKILL (Linux). Stopping it stops the whole group, and after a normal exit any
/// process it left behind in that group is killed.
///
/// The signal is set race-free: the harness's pid is taken before the fork, and the
/// child, after setting the signal, checks that its parent is still that process; if the
/// harness died in between, the child never runs the program.
pub fn spawn(cmd: &mut Command) -> io::Result<Owned> {
    cmd.process_group(0);
    die_with_parent(cmd);
    let child = cmd.spawn()?;
    let pid = Pid::from_child(&child);
    Ok(Owned { child: Some(child), pid })
}

/// Runs `cmd` to its end in its own group with its standard output captured, as
/// [`Owned::wait`] runs a child: SIGINT, SIGTERM or SIGHUP stops its whole group (SIGTERM,
/// `grace`, SIGKILL) and is returned as [`Waited::Interrupted`]. The output is read on a
/// thread while the child runs, so a long one cannot fill the pipe and stall it.
pub fn capture(cmd: &mut Command, shutdown: &Shutdown, grace: Duration) -> Result<(Waited, Vec<u8>)> {
    let (waited, stdout, _) = run_captured(cmd, shutdown, grace, false)?;
    Ok((waited, stdout))
}

/// [`capture`] with the standard error captured too: `(waited, stdout, stderr)`.
pub fn capture_both(
    cmd: &mut Command,
    shutdown: &Shutdown,
    grace: Duration,
) -> Result<(Waited, Vec<u8>, Vec<u8>)> {
    run_captured(cmd, shutdown, grace, true)
}

/// [`capture`]'s run, with standard error captured too when `stderr` (else inherited,
/// and returned empty).
fn run_captured(
    cmd: &mut Command,
    shutdown: &Shutdown,
    grace: Duration,
    stderr: bool,
) -> Result<(Waited, Vec<u8>, Vec<u8>)> {
    cmd.stdout(Stdio::piped());
    if stderr {
        cmd.stderr(Stdio::piped());
    }
    let mut owned = spawn(cmd)?;
    let out = read_on_thread(owned.child_mut().stdout.take().context("a piped stdout")?)?;
    let err = match stderr {
        true => Some(read_on_thread(owned.child_mut().stderr.take().context("a piped stderr")?)?),
        false => None,
    };
    let waited = owned.wait(shutdown, None, grace)?;
    // The group is gone (stopped or exited and its stragglers killed), so the pipes'
    // writers are closed and the readers end.
    let err = err.map(|h| h.join().unwrap_or_default()).unwrap_or_default();
    Ok((waited, out.join().unwrap_or_default(), err))
}

/// Reads `pipe` to its end on a thread of its own.
fn read_on_thread(mut pipe: impl io::Read + Send + 'static) -> Result<thread::JoinHandle<Vec<u8>>> {
    thread::Builder::new()
        .name("capture".into())
        .spawn(move || {
            let mut out = Vec::new();
            // A read error ends the capture with what came before it.
            let _ = pipe.read_to_end(&mut out);
            out
        })
        .context("starting the output reader")
}

#[cfg(target_os = "linux")]
fn die_with_parent(cmd: &mut Command) {
    use rustix::process::{getpid, getppid, set_parent_process_death_signal};
    let parent = getpid();
    // SAFETY: the closure runs in the forked child before exec, where only
    // async-signal-safe work is allowed: it makes two system calls (prctl, getppid) and
    // builds an io::Error from a raw code, none of which allocates or takes a lock.
    unsafe {
        cmd.pre_exec(move || {
            set_parent_process_death_signal(Some(Signal::KILL))?;
            if getppid() != Some(parent) {
                // The harness died before the signal was armed: do not start orphaned.
                return Err(io::Error::from_raw_os_error(rustix::io::Errno::SRCH.raw_os_error()));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_cmd: &mut Command) {}

/// A running child the harness owns. Reaped by [`Owned::wait`] or [`Owned::stop`], or
/// killed and reaped when dropped.
#[derive(Debug)]
pub struct Owned {
    child: Option<Child>,
    pid: Pid,
}

impl Owned {
    /// The child's pid, also its process group id.
    #[allow(dead_code, reason = "API for long-running children (a server driver)")]
    pub fn pid(&self) -> u32 {
        self.pid.as_raw_nonzero().get() as u32
    }

    /// The standard library's handle, to take the child's pipes from.
    #[allow(dead_code, reason = "API for long-running children (a server driver)")]
    pub fn child_mut(&mut self) -> &mut Child {
        self.child.as_mut().expect("an Owned child is present until it is reaped")
    }

    /// Whether the child is still running. It is not reaped here (its pid stays reserved,
    /// so a later group kill cannot reach a stranger); [`Owned::stop`] reaps it.
    pub fn is_alive(&self) -> Result<bool> {
        let options = WaitIdOptions::EXITED | WaitIdOptions::NOHANG | WaitIdOptions::NOWAIT;
        loop {
            match waitid(WaitId::Pid(self.pid), options) {
                Ok(Some(_)) => return Ok(false),
                Ok(None) => return Ok(true),
                Err(e) if e == rustix::io::Errno::INTR => continue,
                Err(e) => return Err(io::Error::from(e)).context("checking on a child"),
            }
        }
    }

    /// Stops the child: SIGTERM to its group, up to `grace` for it to
    /// exit, then SIGKILL; then any straggler in its group is killed and the child is
    /// reaped. A zero grace sends SIGKILL at once. A child that already exited is reaped
    /// and its status returned.
    pub fn stop(mut self, grace: Duration) -> Result<ExitStatus> {
        if self.is_alive()? {
            if !grace.is_zero() {
                self.signal(Signal::TERM);
                let deadline = Instant::now().checked_add(grace);
                while self.is_alive()? && deadline.is_none_or(|d| Instant::now() < d) {
                    thread::sleep(Duration::from_millis(10));
                }
            }
            if self.is_alive()? {
                self.signal(Signal::KILL);
            }
        }
        self.reap()
    }

    /// Waits until the child ends, `timeout` passes, or SIGINT/SIGTERM/SIGHUP arrives; in
    /// the last two cases stops it as [`Owned::stop`] does with `grace`. The child is
    /// always reaped before this returns.
    pub fn wait(mut self, shutdown: &Shutdown, timeout: Option<Duration>, grace: Duration) -> Result<Waited> {
        if let Some(sig) = shutdown.pending() {
            self.stop(grace)?;
            return Ok(Waited::Interrupted(sig));
        }
        let token = shutdown.next_token.get();
        shutdown.next_token.set(token + 1);
        let pid = self.pid;
        let tx = shutdown.tx.clone();
        thread::Builder::new()
            .name(format!("wait-{}", pid.as_raw_nonzero()))
            .spawn(move || {
                // Wait without reaping: while the child is a zombie its pid, and so its
                // process group id, cannot be reused, so a group kill stays safe.
                loop {
                    match waitid(WaitId::Pid(pid), WaitIdOptions::EXITED | WaitIdOptions::NOWAIT) {
                        Err(e) if e == rustix::io::Errno::INTR => continue,
                        _ => break,
                    }
                }
                let _ = tx.send(Event::Ended(token));
            })
            .context("starting a child waiter")?;
        // A timeout too long to add to the clock is no timeout at all.
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let outcome = loop {
            let event = match deadline {
                None => shutdown.rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(d) => shutdown.rx.recv_timeout(d.saturating_duration_since(Instant::now())),
            };
            match event {
                Ok(Event::Ended(t)) if t == token => break None,
                Ok(Event::Ended(_)) => continue,
                Ok(Event::Signal(sig)) => break Some(Waited::Interrupted(sig)),
                Err(RecvTimeoutError::Timeout) => break Some(Waited::TimedOut),
                Err(RecvTimeoutError::Disconnected) => anyhow::bail!("the child waiter went away"),
            }
        };
        match outcome {
            None => Ok(Waited::Exited(self.reap()?)),
            Some(cut) => {
                self.stop(grace)?;
                // The waiter's event for this token is now stale; a signal that landed
                // while the child was stopped is kept for the caller.
                if let Some(sig) = shutdown.take_signal()
                    && !matches!(cut, Waited::Interrupted(_))
                {
                    shutdown.deferred.set(Some(sig));
                }
                Ok(cut)
            }
        }
    }

    /// Sends `sig` to the child's group.
    fn signal(&self, sig: Signal) {
        let r = kill_process_group(self.pid, sig);
        // ESRCH: it is already gone, which is what we wanted.
        if let Err(e) = r
            && e != rustix::io::Errno::SRCH
        {
            eprintln!("warning: could not signal child {}: {e}", self.pid.as_raw_nonzero());
        }
    }

    /// Kills what is left of an exited child's group and reaps the child.
    fn reap(&mut self) -> Result<ExitStatus> {
        // Stragglers the child left in its group; none is the normal case. The child is at
        // worst a zombie here, so the group id still names its group.
        let _ = kill_process_group(self.pid, Signal::KILL);
        let mut child = self.child.take().context("a child reaped twice")?;
        child.wait().context("reaping a child")
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.signal(Signal::KILL);
            let _ = self.reap();
        }
    }
}

enum Event {
    Signal(i32),
    /// The child waited on under this token has ended (it is not reaped yet).
    Ended(u64),
}

/// The signal listener and the event channel: SIGINT, SIGTERM and SIGHUP arrive here as
/// events beside the exits of the children waited on.
pub struct Shutdown {
    tx: Sender<Event>,
    rx: Receiver<Event>,
    next_token: Cell<u64>,
    /// A signal that arrived while a child was being stopped after a timeout.
    deferred: Cell<Option<i32>>,
}

/// The exit code for death by `signal`, as a shell reports it.
pub fn exit_code_for(signal: i32) -> u8 {
    u8::try_from(128 + signal).unwrap_or(u8::MAX)
}

/// The signal's name, for messages.
pub fn signal_name(signal: i32) -> &'static str {
    match signal {
        SIGINT => "SIGINT",
        SIGTERM => "SIGTERM",
        SIGHUP => "SIGHUP",
        _ => "a signal",
    }
}

impl Shutdown {
    /// Starts listening for SIGINT, SIGTERM and SIGHUP. From here on they no longer
    /// terminate the process: they arrive as events.
    pub fn install() -> Result<Shutdown> {
        let (tx, rx) = channel();
        let mut signals = Signals::new([SIGINT, SIGTERM, SIGHUP])
            .context("installing the SIGINT/SIGTERM/SIGHUP handlers")?;
        let sig_tx = tx.clone();
        thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                for sig in signals.forever() {
                    if sig_tx.send(Event::Signal(sig)).is_err() {
                        break;
                    }
                }
            })
            .context("starting the signal listener")?;
        Ok(Shutdown { tx, rx, next_token: Cell::new(0), deferred: Cell::new(None) })
    }

    /// A signal that arrived while no child was being waited on, if any.
    pub fn pending(&self) -> Option<i32> {
        self.deferred.take().or_else(|| self.take_signal())
    }

    /// The first queued signal; exits of children already reaped are stale and dropped.
    fn take_signal(&self) -> Option<i32> {
        self.rx.try_iter().find_map(|e| match e {
            Event::Signal(s) => Some(s),
            Event::Ended(_) => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Command {
        let mut c = Command::new("sh");
        c.arg("-c").arg(script).stderr(Stdio::null());
        c
    }

    #[test]
    fn exit_codes_follow_the_shell() {
        assert_eq!(exit_code_for(SIGINT), 130);
        assert_eq!(exit_code_for(SIGTERM), 143);
        assert_eq!(exit_code_for(SIGHUP), 129);
    }

    #[test]
    fn a_timeout_kills_the_whole_group() {
        let sd = Shutdown::install().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("grandchild-survived");
        // The grandchild would write the marker after the timeout unless its group dies.
        let script = format!("(sleep 2; touch '{}') & sleep 30", marker.display());
        let child = spawn(&mut sh(&script)).unwrap();
        let start = Instant::now();
        let w = child.wait(&sd, Some(Duration::from_millis(300)), Duration::ZERO).unwrap();
        assert!(matches!(w, Waited::TimedOut), "{w:?}");
        assert!(start.elapsed() < Duration::from_secs(10));
        thread::sleep(Duration::from_millis(2500));
        assert!(!marker.exists(), "the grandchild outlived its group's kill");
        // Any timeout, up to the largest, is accepted.
        for timeout in [Duration::from_secs(30), Duration::from_secs(u64::MAX), Duration::MAX] {
            let child = spawn(&mut sh("exit 7")).unwrap();
            match child.wait(&sd, Some(timeout), Duration::ZERO).unwrap() {
                Waited::Exited(st) => assert_eq!(st.code(), Some(7)),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(sd.pending(), None);
    }

    #[test]
    fn a_long_running_child_is_checked_and_stopped_with_term_then_kill() {
        use std::os::unix::process::ExitStatusExt;
        // Exits on SIGTERM: stop returns well inside the grace period.
        let polite = spawn(&mut sh("trap 'exit 0' TERM; while :; do sleep 0.05; done")).unwrap();
        thread::sleep(Duration::from_millis(200));
        assert!(polite.is_alive().unwrap());
        let start = Instant::now();
        let st = polite.stop(Duration::from_secs(20)).unwrap();
        assert!(start.elapsed() < Duration::from_secs(10), "TERM was not sent first");
        assert_eq!(st.code(), Some(0), "{st:?}");
        // Ignores SIGTERM: killed once the grace period is over.
        let stubborn = spawn(&mut sh("trap '' TERM; while :; do sleep 0.05; done")).unwrap();
        thread::sleep(Duration::from_millis(200));
        let start = Instant::now();
        let st = stubborn.stop(Duration::from_millis(300)).unwrap();
        assert!(start.elapsed() >= Duration::from_millis(300));
        assert_eq!(st.signal(), Some(9), "{st:?}");
        // Already gone: reaped with its own status, nothing signalled.
        let done = spawn(&mut sh("exit 4")).unwrap();
        while done.is_alive().unwrap() {
            thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(done.stop(Duration::from_secs(1)).unwrap().code(), Some(4));
    }

    #[test]
    fn a_capture_keeps_each_stream_apart() {
        let sd = Shutdown::install().unwrap();
        let script = "echo out; echo err >&2; exit 3";
        match capture_both(&mut sh(script), &sd, Duration::ZERO).unwrap() {
            (Waited::Exited(st), out, err) => {
                assert_eq!((st.code(), &out[..], &err[..]), (Some(3), &b"out\n"[..], &b"err\n"[..]));
            }
            other => panic!("{other:?}"),
        }
        match capture(&mut sh(script), &sd, Duration::ZERO).unwrap() {
            (Waited::Exited(st), out) => assert_eq!((st.code(), &out[..]), (Some(3), &b"out\n"[..])),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_dropped_handle_kills_and_reaps_its_child() {
        let child = spawn(&mut sh("sleep 30")).unwrap();
        let pid = child.pid;
        drop(child);
        // Reaped: the pid names no child of ours any more.
        assert!(waitid(WaitId::Pid(pid), WaitIdOptions::EXITED | WaitIdOptions::NOHANG).is_err());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_child_dies_with_the_thread_that_spawned_it() {
        use std::os::unix::process::ExitStatusExt;
        // The parent-death signal fires when the spawning thread ends, which a test can
        // cause without killing itself: the child must then die by SIGKILL.
        let child = thread::spawn(|| spawn(&mut sh("sleep 30")).unwrap()).join().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while child.is_alive().unwrap() {
            assert!(Instant::now() < deadline, "the child outlived its parent thread");
            thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(child.stop(Duration::ZERO).unwrap().signal(), Some(9));
    }
}
