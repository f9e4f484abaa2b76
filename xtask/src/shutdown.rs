//! The one shutdown point. SIGINT, SIGTERM and SIGHUP are turned into events on one
//! channel, beside the exits of the children the harness waits for; whoever waits on a
//! child sees an interrupt as one event, kills the child (or its whole process group),
//! reaps it, and returns `Interrupted` so the caller can keep its rows, print what it has
//! and exit with 128 + the signal. Nothing else in the harness looks at signals.

use std::cell::Cell;
use std::io;
use std::process::{Child, ExitStatus};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rustix::process::{Pid, Signal, WaitId, WaitIdOptions, kill_process, kill_process_group, waitid};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

enum Event {
    Signal(i32),
    /// The child waited on under this token has ended (it is not reaped yet).
    Ended(u64),
}

/// What to kill when a wait is cut short.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// The child leads its own process group: kill the whole group, and after a normal
    /// exit kill any process it left behind in that group.
    Group,
    /// The child shares the harness's group (a build the terminal's Ctrl-C also reaches):
    /// kill the child alone.
    Child,
}

/// How a wait ended.
#[derive(Debug)]
pub enum Waited {
    /// The child ended on its own.
    Exited(ExitStatus),
    /// The time ran out; the child was killed and reaped.
    TimedOut,
    /// A signal arrived; the child was killed and reaped.
    Interrupted(i32),
}

/// The signal listener and the event channel.
pub struct Shutdown {
    tx: Sender<Event>,
    rx: Receiver<Event>,
    next_token: Cell<u64>,
    /// A signal that arrived while a child was being reaped after a timeout.
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
        if let Some(sig) = self.deferred.take() {
            return Some(sig);
        }
        // Exits of children already reaped are stale here and are dropped.
        self.rx.try_iter().find_map(|e| match e {
            Event::Signal(s) => Some(s),
            Event::Ended(_) => None,
        })
    }

    /// Waits for `child` until it ends, `timeout` passes, or a signal arrives; in the last
    /// two cases kills it per `scope`. The child is always reaped before this returns.
    pub fn wait(&self, mut child: Child, timeout: Option<Duration>, scope: Scope) -> Result<Waited> {
        if let Some(sig) = self.pending() {
            kill(&child, scope);
            child.wait().context("reaping a child after an interrupt")?;
            return Ok(Waited::Interrupted(sig));
        }
        let token = self.next_token.get();
        self.next_token.set(token + 1);
        let pid = Pid::from_child(&child);
        let tx = self.tx.clone();
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
        let deadline = timeout.map(|t| Instant::now() + t);
        let outcome = loop {
            let event = match deadline {
                None => self.rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(d) => self.rx.recv_timeout(d.saturating_duration_since(Instant::now())),
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
            None => {
                if scope == Scope::Group {
                    // Stragglers the child left in its group; none is the normal case.
                    let _ = kill_process_group(pid, Signal::KILL);
                }
                let status = child.wait().context("reaping a child")?;
                Ok(Waited::Exited(status))
            }
            Some(cut) => {
                kill(&child, scope);
                child.wait().context("reaping a killed child")?;
                // The waiter's event for this token is now stale; a signal that lands
                // while we reaped is kept for the caller.
                if let Some(sig) = self.rx.try_iter().find_map(|e| match e {
                    Event::Signal(s) => Some(s),
                    Event::Ended(_) => None,
                }) && !matches!(cut, Waited::Interrupted(_))
                {
                    self.deferred.set(Some(sig));
                }
                Ok(cut)
            }
        }
    }
}

fn kill(child: &Child, scope: Scope) {
    let pid = Pid::from_child(child);
    let r: io::Result<()> = match scope {
        Scope::Group => kill_process_group(pid, Signal::KILL).map_err(Into::into),
        Scope::Child => kill_process(pid, Signal::KILL).map_err(Into::into),
    };
    // ESRCH: it is already gone, which is what we wanted.
    if let Err(e) = r
        && e.raw_os_error() != Some(rustix::io::Errno::SRCH.raw_os_error())
    {
        eprintln!("warning: could not kill child {}: {e}", pid.as_raw_nonzero());
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::CommandExt;
    use std::process::Command;

    use super::*;

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
        let child = Command::new("sh").arg("-c").arg(script).process_group(0).spawn().unwrap();
        let start = Instant::now();
        let w = sd.wait(child, Some(Duration::from_millis(300)), Scope::Group).unwrap();
        assert!(matches!(w, Waited::TimedOut), "{w:?}");
        assert!(start.elapsed() < Duration::from_secs(10));
        thread::sleep(Duration::from_millis(2500));
        assert!(!marker.exists(), "the grandchild outlived its group's kill");
        let child = Command::new("sh").arg("-c").arg("exit 7").process_group(0).spawn().unwrap();
        match sd.wait(child, Some(Duration::from_secs(30)), Scope::Group).unwrap() {
            Waited::Exited(st) => assert_eq!(st.code(), Some(7)),
            other => panic!("{other:?}"),
        }
        assert_eq!(sd.pending(), None);
    }
}
