//! Running the real `kiln` binary from tests: each command runs in its own temporary
//! directory, and a failed expectation prints the full command, status, stdout and
//! stderr.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// The binary Cargo built for these tests.
pub fn kiln_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_kiln"))
}

/// A temporary directory holding one test's runs.
pub struct Dir {
    tmp: tempfile::TempDir,
}

impl Dir {
    /// A fresh directory.
    pub fn new() -> Dir {
        Dir { tmp: tempfile::tempdir().expect("creating a temporary directory") }
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        self.tmp.path()
    }

    /// `kiln ARGS` in this directory, without KILN_* variables from the caller's
    /// environment (they would change the results).
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(kiln_bin());
        cmd.args(args).current_dir(self.path()).stdin(Stdio::null());
        for (key, _) in std::env::vars() {
            if key.starts_with("KILN_") {
                cmd.env_remove(key);
            }
        }
        // The `qmv_wide` crossover's cache: kept under the target directory, so a server
        // test measures it once per checkout and never writes the user's cache.
        cmd.env("XDG_CACHE_HOME", Path::new(env!("CARGO_TARGET_TMPDIR")).join("xdg-cache"));
        cmd
    }

    /// Runs `kiln ARGS` to completion.
    pub fn run(&self, args: &[&str]) -> Run {
        self.run_env(args, &[])
    }

    /// Runs `kiln ARGS` to completion with extra environment variables.
    pub fn run_env(&self, args: &[&str], env: &[(&str, &str)]) -> Run {
        let mut cmd = self.command(args);
        cmd.envs(env.iter().copied());
        let output = cmd.output().expect("starting kiln");
        let mut shown: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        shown.extend(args.iter().map(|s| s.to_string()));
        Run { args: shown, output }
    }
}

/// A finished run.
pub struct Run {
    args: Vec<String>,
    /// What it produced.
    pub output: Output,
}

impl Run {
    /// Standard output as text.
    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.output.stdout).into_owned()
    }

    /// Standard error as text.
    pub fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.output.stderr).into_owned()
    }

    /// Everything about the run, for a failure message.
    pub fn describe(&self) -> String {
        format!(
            "\n\ncommand: kiln {}\nstatus: {}\n\n---- stdout ----\n{}\n---- stderr ----\n{}\n",
            self.args.join(" "),
            self.output.status,
            self.stdout(),
            self.stderr()
        )
    }

    /// Asserts the exit code and returns the run.
    pub fn expect_code(self, code: i32) -> Run {
        assert_eq!(self.output.status.code(), Some(code), "expected exit code {code}{}", self.describe());
        self
    }

    /// Parses stdout as one JSON object on one line.
    pub fn json(&self) -> serde_json::Map<String, serde_json::Value> {
        let out = self.stdout();
        assert_eq!(out.lines().count(), 1, "expected one line of JSON{}", self.describe());
        match serde_json::from_str(&out) {
            Ok(serde_json::Value::Object(map)) => map,
            other => panic!("expected a JSON object, got {other:?}{}", self.describe()),
        }
    }
}
