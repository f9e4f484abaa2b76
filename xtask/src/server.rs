//! A long-running `kiln serve` child: started through `child` (own process group,
//! killed with the harness) with its output in a log file, watched (alive? ready? which
//! kernels?), and stopped with `child`'s SIGTERM, grace, SIGKILL of the group. The one
//! place the harness boots a server; the ABBA driver and serve-bench both use it.

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rustix::process::{Pid, WaitId, WaitIdOptions, waitid};

use crate::child::{self, Owned, Shutdown};

/// How to start a server.
#[derive(Clone, Debug)]
pub struct ServerSpec {
    /// The binary.
    pub bin: PathBuf,
    /// Its arguments (`serve -m MODEL --port P ...`).
    pub args: Vec<OsString>,
    /// Variables set for it (an arm's pin).
    pub env: Vec<(String, String)>,
    /// Where its stdout and stderr go.
    pub log: PathBuf,
    /// Its working directory.
    pub cwd: PathBuf,
}

/// A started server.
pub struct Server {
    child: Owned,
    pid: Pid,
    log: PathBuf,
    started: Instant,
}

/// How a wait for readiness ended.
#[derive(Debug)]
pub enum Ready {
    /// `GET /health` answered 200 on the address the server logged.
    Up {
        /// The address from its `listening on` line.
        addr: SocketAddr,
        /// Seconds from the spawn to the first 200.
        after_s: f64,
    },
    /// The child exited first.
    Died(String),
    /// A signal arrived.
    Interrupted(i32),
    /// The time ran out.
    TimedOut,
}

/// Whether something answers TCP on `127.0.0.1:port`: the port preflight.
pub fn port_answers(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
}

/// `GET /health` once: the status code, or `None` when nothing answered.
pub fn health(addr: SocketAddr) -> Option<u16> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.set_write_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").ok()?;
    let mut head = [0u8; 64];
    let n = s.read(&mut head).ok()?;
    let line = String::from_utf8_lossy(&head[..n]);
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The name requests give a booted `kiln serve -m MODEL ARGS...`, and the arguments to add
/// so it serves under that name. kiln lists a short name by default (a directory's or
/// file's own name, not its path); the harness names the model as it was given unless
/// `serve_args` set `--served-model-name` already, whose value is then the name.
pub fn served_name(model: &str, serve_args: &[String]) -> (String, Vec<OsString>) {
    const FLAG: &str = "--served-model-name";
    for (i, a) in serve_args.iter().enumerate() {
        if a == FLAG
            && let Some(v) = serve_args.get(i + 1)
        {
            return (v.clone(), Vec::new());
        }
        if let Some(v) = a.strip_prefix(FLAG).and_then(|r| r.strip_prefix('=')) {
            return (v.to_string(), Vec::new());
        }
    }
    (model.to_string(), vec![FLAG.into(), model.into()])
}

/// The address of the first `listening on http://IP:PORT` in `log`.
pub fn listening_addr(log: &str) -> Option<SocketAddr> {
    kiln_protocol::ListeningLine::find(log).map(|l| l.addr)
}

impl Server {
    /// Spawns the server in its own process group.
    pub fn start(spec: &ServerSpec) -> Result<Server> {
        let log = File::create(&spec.log).with_context(|| format!("creating {}", spec.log.display()))?;
        let err = log.try_clone().context("duplicating the server log's handle")?;
        let mut cmd = Command::new(&spec.bin);
        cmd.args(&spec.args)
            .current_dir(&spec.cwd)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(err));
        for (k, v) in &spec.env {
            cmd.env(k, v);
        }
        let child = child::spawn(&mut cmd).with_context(|| format!("starting {}", spec.bin.display()))?;
        let pid = Pid::from_raw(child.pid() as i32).context("the server's pid")?;
        Ok(Server { child, pid, log: spec.log.clone(), started: Instant::now() })
    }

    /// The process id (also the group id).
    pub fn pid(&self) -> i32 {
        self.pid.as_raw_nonzero().get()
    }

    /// The log so far.
    pub fn log_text(&self) -> String {
        fs::read(&self.log).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default()
    }

    /// The log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// `None` while running; how it ended once it has. Does not reap, so the group id
    /// stays reserved for the final kill.
    pub fn exited(&self) -> Option<String> {
        if self.child.is_alive().unwrap_or(false) {
            return None;
        }
        // What `child` reaps later, read without reaping, for the record.
        let opts = WaitIdOptions::EXITED | WaitIdOptions::NOHANG | WaitIdOptions::NOWAIT;
        match waitid(WaitId::Pid(self.pid), opts) {
            Ok(None) => None,
            Ok(Some(st)) => Some(match (st.exit_status(), st.terminating_signal()) {
                (Some(code), _) => format!("exited with status {code}"),
                (_, Some(sig)) => format!("killed by signal {sig}"),
                _ => "ended".to_string(),
            }),
            Err(e) => Some(format!("could not be waited on: {e}")),
        }
    }

    /// Like [`Server::exited`], but gives a server that is going away up to `patience`
    /// to finish: a process that closed its sockets may still be tearing down.
    pub fn exited_within(&self, patience: Duration) -> Option<String> {
        let deadline = Instant::now() + patience;
        loop {
            let e = self.exited();
            if e.is_some() || Instant::now() >= deadline {
                return e;
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits until the server is ready: before every probe the child must still be
    /// alive, so a stale server holding the port can never answer for it.
    pub fn wait_ready(&self, shutdown: &Shutdown, timeout: Duration) -> Ready {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(sig) = shutdown.pending() {
                return Ready::Interrupted(sig);
            }
            if let Some(how) = self.exited() {
                return Ready::Died(how);
            }
            if let Some(addr) = listening_addr(&self.log_text())
                && health(addr) == Some(200)
            {
                // The probe raced the exit check: confirm it is still this child.
                if let Some(how) = self.exited() {
                    return Ready::Died(how);
                }
                return Ready::Up { addr, after_s: self.started.elapsed().as_secs_f64() };
            }
            if Instant::now() >= deadline {
                return Ready::TimedOut;
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// The server's CPU time so far (user + system, all its threads), from /proc.
    pub fn cpu_seconds(&self) -> Option<f64> {
        crate::quiet::process_cpu_seconds(self.pid())
    }

    /// SIGTERM to the group, up to `grace` for the leader to exit, then SIGKILL to the
    /// group, then reap (all `child`'s [`Owned::stop`]). Says how it ended, whether it
    /// took our SIGKILL, and whether it had ended before it was asked to stop (a server
    /// killed from outside, say, is reaped, not signalled).
    pub fn stop(self, grace: Duration) -> Result<Stopped> {
        let died_before = self.exited();
        let status = self.child.stop(grace)?;
        let by_kill = status.signal() == Some(rustix::process::Signal::KILL.as_raw());
        Ok(Stopped { ended: status.to_string(), killed: by_kill && died_before.is_none(), died_before })
    }
}

/// How [`Server::stop`] ended a server.
#[derive(Debug)]
pub struct Stopped {
    /// Its exit status, as the standard library words it.
    pub ended: String,
    /// It outlived SIGTERM and the grace, and our SIGKILL ended it.
    pub killed: bool,
    /// It had already ended when asked to stop: how (`killed by signal 9`).
    pub died_before: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_booted_server_is_named_as_the_model_was_given_unless_its_arguments_name_it() {
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let (name, add) = served_name("models/Qwen2.5-0.5B", &args(&["--parallel", "2"]));
        assert_eq!(name, "models/Qwen2.5-0.5B");
        assert_eq!(add, vec![OsString::from("--served-model-name"), OsString::from("models/Qwen2.5-0.5B")]);
        let (name, add) = served_name("m", &args(&["--served-model-name", "q"]));
        assert_eq!((name.as_str(), add.len()), ("q", 0));
        let (name, add) = served_name("m", &args(&["--served-model-name=q2"]));
        assert_eq!((name.as_str(), add.len()), ("q2", 0));
    }

    #[test]
    fn the_listening_line_gives_the_address() {
        let log = "INFO kernel configuration: isa=avx2\nINFO listening on http://127.0.0.1:41234\n";
        assert_eq!(listening_addr(log), Some(SocketAddr::from(([127, 0, 0, 1], 41234))));
        let json = r#"{"fields":{"message":"listening on http://127.0.0.1:5"}}"#;
        assert_eq!(listening_addr(json), Some(SocketAddr::from(([127, 0, 0, 1], 5))));
        assert_eq!(listening_addr("starting"), None);
    }

    #[test]
    fn a_group_that_ignores_sigterm_is_killed_after_the_grace() {
        let dir = tempfile::tempdir().unwrap();
        let spec = ServerSpec {
            bin: "sh".into(),
            args: vec!["-c".into(), "trap '' TERM; sleep 30 & wait".into()],
            env: vec![],
            log: dir.path().join("log"),
            cwd: dir.path().to_path_buf(),
        };
        let s = Server::start(&spec).unwrap();
        let pid = s.pid();
        thread::sleep(Duration::from_millis(200));
        assert_eq!(s.exited(), None);
        let st = s.stop(Duration::from_millis(300)).unwrap();
        assert!(st.killed && st.died_before.is_none(), "{st:?}");
        // Nothing is left in the group once init has reaped the orphaned grandchild.
        let gone = (0..100).any(|_| {
            thread::sleep(Duration::from_millis(20));
            rustix::process::kill_process_group(Pid::from_raw(pid).unwrap(), rustix::process::Signal::KILL)
                .is_err()
        });
        assert!(gone, "the server's group outlived stop()");
    }

    #[test]
    fn a_server_killed_from_outside_is_not_said_to_have_ignored_sigterm() {
        let dir = tempfile::tempdir().unwrap();
        let spec = ServerSpec {
            bin: "sh".into(),
            args: vec!["-c".into(), "sleep 30".into()],
            env: vec![],
            log: dir.path().join("log"),
            cwd: dir.path().to_path_buf(),
        };
        let s = Server::start(&spec).unwrap();
        rustix::process::kill_process(Pid::from_raw(s.pid()).unwrap(), rustix::process::Signal::KILL)
            .unwrap();
        assert!(s.exited_within(Duration::from_secs(5)).is_some());
        let st = s.stop(Duration::from_millis(300)).unwrap();
        assert!(!st.killed, "{st:?}");
        assert_eq!(st.died_before.as_deref(), Some("killed by signal 9"), "{st:?}");
    }
}
