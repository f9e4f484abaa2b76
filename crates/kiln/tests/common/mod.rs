//! A real `kiln serve` for the server tests: booted on an ephemeral port, its address
//! read from the listening line, its stderr kept for failure messages, stopped by signal
//! or killed when dropped.
//!
//! A test binary using it declares `mod client;` (kiln-serve's HTTP test client) and
//! `mod util;` beside `mod common;`.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::client::get;
use crate::util::Dir;

/// How long a server may take to bind and load its model, and how long a log line is
/// waited for.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(90);

/// A running `kiln serve`; killed when dropped.
pub struct Serve {
    child: Child,
    /// The address it listens on.
    pub addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
    _dir: Dir,
}

impl Serve {
    /// `kiln serve --port 0 ARGS`, once /health answers 200.
    pub fn start(args: &[&str]) -> Serve {
        Self::start_env(args, &[])
    }

    /// `kiln serve --port 0 ARGS` with extra environment variables, once /health answers
    /// 200.
    pub fn start_env(args: &[&str], env: &[(&str, &str)]) -> Serve {
        Self::start_with(args, env, None)
    }

    /// `kiln serve --port 0 ARGS` with extra environment variables and, when given, its
    /// open-file limit (RLIMIT_NOFILE) set to `nofile` (soft, hard), once /health answers
    /// 200.
    pub fn start_with(args: &[&str], env: &[(&str, &str)], nofile: Option<(u64, u64)>) -> Serve {
        let dir = Dir::new();
        let mut all = vec!["serve", "--port", "0"];
        all.extend_from_slice(args);
        let mut cmd = dir.command(&all);
        cmd.envs(env.iter().copied()).stdout(Stdio::null()).stderr(Stdio::piped());
        if let Some((soft, hard)) = nofile {
            use std::os::unix::process::CommandExt;
            let limit = libc::rlimit { rlim_cur: soft as libc::rlim_t, rlim_max: hard as libc::rlim_t };
            // SAFETY: the closure runs in the forked child before exec and calls only
            // setrlimit, which is async-signal-safe, on a value copied into it.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut child = cmd.spawn().expect("starting kiln serve");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        let mut s = Serve { child, addr: "0.0.0.0:0".parse().unwrap(), log, _dir: dir };
        let line = s.wait_for("listening on http://");
        let at = line.find("http://").unwrap() + "http://".len();
        let addr = line[at..].split(|c: char| c.is_whitespace() || c == '"').next().unwrap();
        s.addr = addr.parse().unwrap_or_else(|e| panic!("bad address {addr:?}: {e}{}", s.stderr()));
        let t = Instant::now();
        while get(s.addr, "/health").status != 200 {
            assert!(t.elapsed() < BOOT_TIMEOUT, "the model did not load{}", s.stderr());
            std::thread::sleep(Duration::from_millis(25));
        }
        s
    }

    /// Waits (bounded) for a stderr line containing `needle`, logged before or after the
    /// call, and returns the first such line.
    pub fn wait_for(&self, needle: &str) -> String {
        let t = Instant::now();
        loop {
            if let Some(l) = self.log.lock().unwrap().iter().find(|l| l.contains(needle)) {
                return l.clone();
            }
            assert!(t.elapsed() < BOOT_TIMEOUT, "no stderr line with {needle:?}{}", self.stderr());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The stderr lines so far.
    pub fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    /// The stderr so far, for a failure message.
    pub fn stderr(&self) -> String {
        format!("\n---- kiln serve stderr ----\n{}\n", self.log().join("\n"))
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends signal `sig` to the server.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) with the pid of a child this test started and still owns.
        let r = unsafe { libc::kill(self.child.id() as i32, sig) };
        assert_eq!(r, 0, "kill failed");
    }

    /// Waits for the server to exit, failing after `within`.
    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(t.elapsed() < within, "kiln serve did not exit within {within:?}{}", self.stderr());
            std::thread::sleep(Duration::from_millis(25));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
