//! Helpers for tests that run the real `cargo xtask` binary against the real `kiln`
//! binary: kiln is built once per test run, each test gets its own directory, record and
//! run directory, and a failed expectation prints the full stdout, stderr and status.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::OnceLock;

/// The debug `kiln` binary, built once for the whole test run, or the one
/// `KILN_TEST_KILN_BIN` names. CI names the binary its `cargo test --workspace` has
/// already built for kiln's own tests: building it again here with `-p kiln` would
/// resolve other dependency features and recompile a dozen crates.
pub fn kiln_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(given) = std::env::var_os("KILN_TEST_KILN_BIN") {
            let bin = PathBuf::from(given);
            assert!(bin.is_file(), "KILN_TEST_KILN_BIN={}: no such file", bin.display());
            return bin;
        }
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace");
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let status = Command::new(&cargo)
            .current_dir(root)
            .args(["build", "--package", "kiln", "--bin", "kiln"])
            .status()
            .expect("running cargo build for kiln");
        assert!(status.success(), "cargo build --package kiln failed: {status}");
        let meta = cargo_metadata::MetadataCommand::new()
            .manifest_path(root.join("Cargo.toml"))
            .no_deps()
            .exec()
            .expect("cargo metadata");
        let bin = meta
            .target_directory
            .into_std_path_buf()
            .join("debug")
            .join(format!("kiln{}", std::env::consts::EXE_SUFFIX));
        assert!(bin.is_file(), "no kiln binary at {}", bin.display());
        bin
    })
}

/// A finished `cargo xtask` run.
pub struct Run {
    /// The command line.
    pub cmd: String,
    /// How it ended.
    pub status: ExitStatus,
    /// stdout.
    pub stdout: String,
    /// stderr.
    pub stderr: String,
}

impl fmt::Display for Run {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "\n--- command\n{}\n--- status\n{}\n--- stdout\n{}\n--- stderr\n{}\n---",
            self.cmd, self.status, self.stdout, self.stderr
        )
    }
}

impl Run {
    fn from_output(cmd: String, out: Output) -> Run {
        Run {
            cmd,
            status: out.status,
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// Asserts the exit code, printing everything when it differs.
    pub fn expect_code(&self, code: i32) -> &Run {
        assert_eq!(self.status.code(), Some(code), "unexpected exit status{self}");
        self
    }

    /// Asserts stderr contains `needle`.
    pub fn expect_stderr(&self, needle: &str) -> &Run {
        assert!(self.stderr.contains(needle), "stderr lacks {needle:?}{self}");
        self
    }

    /// Asserts stdout contains `needle`.
    pub fn expect_stdout(&self, needle: &str) -> &Run {
        assert!(self.stdout.contains(needle), "stdout lacks {needle:?}{self}");
        self
    }
}

/// One row of a result CSV, by column name.
#[derive(Debug, Clone)]
pub struct Row(pub Vec<(String, String)>);

impl Row {
    /// A column's value.
    pub fn get(&self, col: &str) -> &str {
        self.0
            .iter()
            .find(|(k, _)| k == col)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("no column {col}"))
    }
}

/// A test's own directory, record, run directory and output CSV.
pub struct Sandbox {
    /// Removed when the test ends.
    pub dir: tempfile::TempDir,
    /// Extra environment for every run.
    pub env: Vec<(String, String)>,
}

impl Sandbox {
    /// A fresh sandbox.
    pub fn new() -> Sandbox {
        Sandbox { dir: tempfile::tempdir().expect("tempdir"), env: Vec::new() }
    }

    /// A path inside it.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The OOM record every run uses.
    pub fn record(&self) -> PathBuf {
        self.path("oom-record")
    }

    /// The default output CSV.
    pub fn csv(&self) -> PathBuf {
        self.path("out.csv")
    }

    /// `cargo xtask <task> args...` with the kiln binary, record, run directory and
    /// output pointed into the sandbox (unless `args` name them), and no inherited
    /// `KILN_*` variable.
    pub fn command(&self, task: &str, args: &[&str]) -> Command {
        let given = task.starts_with("bench-") && !args.contains(&"--kiln-bin");
        self.command_with(task, args, given.then(kiln_bin))
    }

    /// [`Sandbox::command`] with `kiln` as the `--kiln-bin` of a `bench-` task, or none.
    fn command_with(&self, task: &str, args: &[&str], kiln: Option<&Path>) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_xtask"));
        cmd.arg(task);
        if let Some(bin) = kiln {
            cmd.arg("--kiln-bin").arg(bin);
        }
        if task.starts_with("bench-") {
            if !args.contains(&"--oom-record") {
                cmd.arg("--oom-record").arg(self.record());
            }
            if !args.contains(&"--runs-dir") {
                cmd.arg("--runs-dir").arg(self.path("runs"));
            }
            if !args.contains(&"--output") && !args.contains(&"--resume") {
                cmd.arg("--output").arg(self.csv());
            }
        }
        cmd.args(args);
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("KILN_") {
                cmd.env_remove(k);
            }
        }
        // The engine on all cores would starve the tests running beside this one.
        cmd.env("RAYON_NUM_THREADS", "1");
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd.current_dir(self.dir.path());
        cmd
    }

    /// Runs `cargo xtask <task> args...` to the end.
    pub fn run(&self, task: &str, args: &[&str]) -> Run {
        self.run_with(task, args, &[])
    }

    /// Same, with extra environment.
    pub fn run_with(&self, task: &str, args: &[&str], env: &[(&str, &str)]) -> Run {
        let mut cmd = self.command(task, args);
        cmd.envs(env.iter().copied());
        let line = format!("{env:?} {cmd:?}");
        let out = cmd.stdin(Stdio::null()).output().expect("running xtask");
        Run::from_output(line, out)
    }

    /// Runs `cargo xtask <task> args...`, killing it and failing the test when it has not
    /// ended within `limit`: for what must not block (a FIFO where a file should be).
    pub fn run_within(&self, task: &str, args: &[&str], limit: std::time::Duration) -> Run {
        let (line, mut child) = self.spawn(task, args, &[]);
        let start = std::time::Instant::now();
        while child.try_wait().expect("waiting for xtask").is_none() {
            if start.elapsed() > limit {
                let _ = child.kill();
                let out = child.wait_with_output().expect("reaping xtask");
                panic!("still running after {limit:?}, killed{}", Run::from_output(line, out));
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        Run::from_output(line, child.wait_with_output().expect("reading xtask's output"))
    }

    /// Starts `cargo xtask <task> args...` with piped output.
    pub fn spawn(&self, task: &str, args: &[&str], env: &[(&str, &str)]) -> (String, Child) {
        let mut cmd = self.command(task, args);
        cmd.envs(env.iter().copied());
        let line = format!("{env:?} {cmd:?}");
        let child =
            cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn");
        (line, child)
    }

    /// Starts `cargo xtask <task> args...` as [`Sandbox::spawn`] does, but with no kiln
    /// binary given: the task builds kiln itself, in the workspace [`Sandbox::kiln_workspace`]
    /// makes of the sandbox, with the cargo `env` names as `CARGO`.
    pub fn spawn_building(&self, task: &str, args: &[&str], env: &[(&str, &str)]) -> (String, Child) {
        let mut cmd = self.command_with(task, args, None);
        cmd.envs(env.iter().copied());
        let line = format!("{env:?} {cmd:?}");
        let child =
            cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn");
        (line, child)
    }

    /// Makes the sandbox a workspace whose one member is a `kiln` package with no feature:
    /// what a task that builds kiln finds from its current directory.
    pub fn kiln_workspace(&self) {
        fs::create_dir_all(self.path("kiln/src")).expect("creating the kiln package");
        fs::write(self.path("Cargo.toml"), "[workspace]\nmembers = [\"kiln\"]\nresolver = \"2\"\n")
            .expect("writing the workspace manifest");
        fs::write(
            self.path("kiln/Cargo.toml"),
            "[package]\nname = \"kiln\"\nversion = \"0.9.0\"\nedition = \"2021\"\n",
        )
        .expect("writing the kiln manifest");
        fs::write(self.path("kiln/src/main.rs"), "fn main() {}\n").expect("writing the kiln source");
    }

    /// The rows of a result CSV.
    pub fn rows(&self, path: &Path) -> Vec<Row> {
        let mut rdr =
            csv::Reader::from_path(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let header: Vec<String> = rdr.headers().expect("header").iter().map(str::to_string).collect();
        rdr.records()
            .map(|r| {
                let r = r.expect("a CSV row");
                Row(header.iter().cloned().zip(r.iter().map(str::to_string)).collect())
            })
            .collect()
    }

    /// `(prompt_target_len, status)` of every row of `model` in the default CSV.
    pub fn statuses(&self, model: &str) -> Vec<(String, String)> {
        self.rows(&self.csv())
            .iter()
            .filter(|r| r.get("model") == model)
            .map(|r| (r.get("prompt_target_len").to_string(), r.get("status").to_string()))
            .collect()
    }

    /// The record's lines.
    pub fn record_lines(&self) -> Vec<String> {
        match fs::read_to_string(self.record()) {
            Ok(t) => t.lines().map(str::to_string).collect(),
            Err(_) => Vec::new(),
        }
    }
}

/// The processes whose environment holds `XTASK_TEST_TAG=<tag>`, as `(pid, cmdline)`.
pub fn tagged_processes(tag: &str) -> Vec<(String, String)> {
    let needle = format!("XTASK_TEST_TAG={tag}");
    let Ok(dir) = fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| {
        let e = e.ok()?;
        let environ = fs::read(e.path().join("environ")).ok()?;
        if !environ.split(|&b| b == 0).any(|v| v == needle.as_bytes()) {
            return None;
        }
        let cmdline = fs::read(e.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        Some((e.file_name().to_string_lossy().into_owned(), cmdline))
    })
    .collect()
}

/// A process that exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

/// The pid a stand-in program wrote in `path`, once it has (within 60 s).
pub fn wait_pid(path: &Path) -> i32 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if let Some(pid) = fs::read_to_string(path).ok().and_then(|s| s.trim().parse().ok()) {
            return pid;
        }
        assert!(std::time::Instant::now() < deadline, "no pid in {} after 60 s", path.display());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// `[(len, status)]` from literals.
pub fn expect(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect()
}

/// A stand-in `kiln` for scenarios the real engine cannot be made to produce on demand (a
/// kill from outside, an allocation abort, a stalled estimate): a shell script that runs
/// `estimate` for `kiln estimate` and `bench` for `kiln bench-decode`.
pub fn fake_kiln(sb: &Sandbox, name: &str, estimate: &str, bench: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = sb.path(name);
    let script = format!(
        "#!/bin/sh\ncase \"$1\" in\n  estimate)\n{estimate}\n  ;;\n  bench-decode)\n{bench}\n  ;;\nesac\nexit 1\n"
    );
    fs::write(&path, script).expect("writing the fake kiln");
    fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}
