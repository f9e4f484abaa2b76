//! How a finished child is classified: the status vocabulary of a sweep row, and the
//! out-of-memory classifier, a pure function of the exit, the captured text and the
//! evidence the harness gathered. A `SKIP:oom` row writes a record line that pre-skips
//! the cell for good, so only evidence of running out of memory makes one.

use std::fmt;
use std::path::{Path, PathBuf};

/// The protocol's exit code for "the memory pool refused an allocation".
pub const KILN_OOM_EXIT_CODE: i32 = kiln_protocol::EXIT_OUT_OF_MEMORY as i32;
/// The protocol's exit code for "bad arguments or an unusable model".
pub const KILN_BY_RULE_EXIT_CODE: i32 = kiln_protocol::EXIT_USAGE as i32;
/// SIGKILL's number, the kernel OOM killer's signal (the same on Linux and macOS).
pub const SIGKILL: i32 = 9;

/// How a child ended, as the harness saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChildExit {
    /// It exited with this code.
    Code(i32),
    /// It died by this signal, not sent by the harness.
    Signal(i32),
    /// The harness killed it when its time ran out.
    TimedOut,
}

impl fmt::Display for ChildExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChildExit::Code(c) => write!(f, "exit code {c}"),
            ChildExit::Signal(s) => write!(f, "signal {s}"),
            ChildExit::TimedOut => f.write_str("timed out"),
        }
    }
}

/// The `status` column: exactly one per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Status {
    /// Measured.
    Ok,
    /// The estimate is above the memory budget; not launched.
    OomEstimate,
    /// The cell ran out of memory (or the fake-OOM hook said so).
    Oom,
    /// An earlier cell of the same model ran out of memory at a length <= this one.
    OomBackstop,
    /// The persistent record holds an OOM of this model at a length <= this one.
    OomRecord,
    /// Prompt plus generated tokens exceed the model's context.
    Context,
    /// The model is not where the name says.
    MissingModel,
    /// The engine refused the cell by rule (exit 2: unsupported config, invalid geometry).
    Unsupported,
    /// The cell ran past its time and was killed.
    Timeout,
    /// The engine failed for another reason, or reported a malformed result.
    Bench,
    /// The engine exited 0 without a result on stdout.
    NoOutput,
    /// `kiln estimate` failed, so the budget layer could not decide.
    Estimate,
    /// SIGKILL from outside the harness with no evidence of an out-of-memory kill.
    Killed,
    /// A Rust allocation or capacity abort: a bug asking for an impossible size, not a
    /// machine out of memory.
    Abort,
    /// The `--peer` engine could not measure the cell (missing, failed, unparsable
    /// output, no model file); the row's reason says which.
    Peer,
    /// `--runner slurm`: the cell's task was cancelled (`scancel`) before it wrote a row.
    SlurmCancelled,
    /// `--runner slurm`: the cell's task hit its Slurm time limit before it wrote a row.
    SlurmTimeout,
    /// `--runner slurm`: the cell's node failed before the task wrote a row.
    SlurmNodeFail,
    /// `--runner slurm`: Slurm killed the task for its job's memory limit before it wrote
    /// a row (not the engine's out of memory: nothing the harness saw).
    SlurmOom,
    /// `--runner slurm`: the cell's task ended without a row for another reason (or Slurm
    /// no longer knows it).
    SlurmLost,
}

impl Status {
    /// Every status, in the order the documentation lists them.
    pub const ALL: [Status; 20] = [
        Status::Ok,
        Status::OomEstimate,
        Status::Oom,
        Status::OomBackstop,
        Status::OomRecord,
        Status::Context,
        Status::MissingModel,
        Status::Unsupported,
        Status::Timeout,
        Status::Bench,
        Status::NoOutput,
        Status::Estimate,
        Status::Killed,
        Status::Abort,
        Status::Peer,
        Status::SlurmCancelled,
        Status::SlurmTimeout,
        Status::SlurmNodeFail,
        Status::SlurmOom,
        Status::SlurmLost,
    ];

    /// The text written in the `status` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::OomEstimate => "SKIP:oom_estimate",
            Status::Oom => "SKIP:oom",
            Status::OomBackstop => "SKIP:oom_backstop",
            Status::OomRecord => "SKIP:oom_record",
            Status::Context => "SKIP:context",
            Status::MissingModel => "SKIP:missing_model",
            Status::Unsupported => "SKIP:unsupported",
            Status::Timeout => "FAIL:timeout",
            Status::Bench => "FAIL:bench",
            Status::NoOutput => "FAIL:no_output",
            Status::Estimate => "FAIL:estimate",
            Status::Killed => "FAIL:killed",
            Status::Abort => "FAIL:abort",
            Status::Peer => "FAIL:peer",
            Status::SlurmCancelled => "FAIL:slurm_cancelled",
            Status::SlurmTimeout => "FAIL:slurm_timeout",
            Status::SlurmNodeFail => "FAIL:slurm_node_fail",
            Status::SlurmOom => "FAIL:slurm_oom",
            Status::SlurmLost => "FAIL:slurm",
        }
    }

    /// Parses the `status` column.
    pub fn parse(s: &str) -> Option<Status> {
        Status::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// A skip by rule: the model or backend cannot run this cell at all. These count
    /// against the exit status when the user named the cell explicitly.
    pub fn is_by_rule(self) -> bool {
        matches!(self, Status::Context | Status::MissingModel | Status::Unsupported)
    }

    /// A failure: always a non-zero exit.
    pub fn is_failure(self) -> bool {
        matches!(
            self,
            Status::Timeout
                | Status::Bench
                | Status::NoOutput
                | Status::Estimate
                | Status::Killed
                | Status::Abort
                | Status::Peer
                | Status::SlurmCancelled
                | Status::SlurmTimeout
                | Status::SlurmNodeFail
                | Status::SlurmOom
                | Status::SlurmLost
        )
    }

    /// Not measured, for any reason.
    pub fn is_skip(self) -> bool {
        self.as_str().starts_with("SKIP:")
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether a child that ended with `exit` and printed `text` (stdout and stderr together)
/// ran out of memory, on evidence only:
///
/// - kiln's exit 3 together with its `out of memory:` line;
/// - SIGKILL while the cgroup's `oom_kill` count rose (`oom_kill_rose`): the kernel's OOM
///   killer, not a `kill -9` from someone else;
/// - another engine's allocator reporting it (the CUDA and Metal markers below), under any
///   failing exit.
///
/// A timeout or a clean exit never is; nor is a panic (its text may mention memory, its
/// cause is a bug), nor a Rust allocation or capacity abort ([`is_abort`]).
pub fn is_oom(exit: ChildExit, text: &str, oom_kill_rose: bool) -> bool {
    match exit {
        ChildExit::TimedOut | ChildExit::Code(0) => false,
        ChildExit::Signal(SIGKILL) => oom_kill_rose,
        _ if is_panic(text) || is_abort(text) => false,
        ChildExit::Code(KILN_OOM_EXIT_CODE) if has_kiln_oom_line(text) => true,
        ChildExit::Code(_) | ChildExit::Signal(_) => text.lines().any(line_reports_oom),
    }
}

/// kiln's pool message: a line that starts with `out of memory:` (after `error: `).
fn has_kiln_oom_line(text: &str) -> bool {
    text.lines()
        .map(|l| l.trim_start())
        .any(|l| l.strip_prefix("error: ").unwrap_or(l).starts_with(kiln_protocol::OOM_LINE_PREFIX))
}

/// Allocators' own out-of-memory reports, from engines that are not kiln.
const OOM_PHRASES: &[&str] = &[
    // Metal.
    "[metal::malloc]",
    "greater than the maximum allowed buffer size",
    // CUDA.
    "cuda_error_out_of_memory",
    "cudaerrormemoryallocation",
    "cuda out of memory",
];

/// Reasons that make a `cuMemAlloc failed` line an out-of-memory one; without one, the
/// call may have failed for an invalid value or a torn-down context.
const CU_MEM_ALLOC_OOM_REASONS: &[&str] = &["out of memory", "out_of_memory"];

fn line_reports_oom(line: &str) -> bool {
    let lower = line.to_ascii_lowercase();
    if OOM_PHRASES.iter().any(|p| contains_phrase(&lower, p)) {
        return true;
    }
    lower.contains("cumemalloc failed") && CU_MEM_ALLOC_OOM_REASONS.iter().any(|r| lower.contains(r))
}

/// `phrase` in `haystack` with no letter or digit glued to either end, so that
/// "without of memory" style accidents and identifiers do not match.
fn contains_phrase(haystack: &str, phrase: &str) -> bool {
    let glued = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    let first_is_word = phrase.chars().next().is_some_and(|c| c.is_ascii_alphanumeric());
    let last_is_word = phrase.chars().last().is_some_and(|c| c.is_ascii_alphanumeric());
    haystack.match_indices(phrase).any(|(at, _)| {
        let before = haystack[..at].chars().next_back();
        let after = haystack[at + phrase.len()..].chars().next();
        let glued_before = first_is_word && glued(before);
        let glued_after = last_is_word && glued(after);
        !(glued_before || glued_after)
    })
}

/// A Rust allocation abort (`memory allocation of 1024 bytes failed`) or capacity
/// overflow: the program asked for a size no machine has, which is a bug to fix, not a
/// cell to skip for good.
pub fn is_abort(text: &str) -> bool {
    text.lines().any(|line| {
        let lower = line.to_ascii_lowercase();
        lower.contains("capacity overflow") || is_rust_alloc_failure(&lower)
    })
}

/// Rust's allocation-error handler: `memory allocation of 1024 bytes failed`.
fn is_rust_alloc_failure(lower: &str) -> bool {
    const HEAD: &str = "memory allocation of ";
    lower.match_indices(HEAD).any(|(at, _)| {
        let rest = &lower[at + HEAD.len()..];
        let digits = rest.chars().take_while(char::is_ascii_digit).count();
        digits > 0 && rest[digits..].starts_with(" bytes failed")
    })
}

/// Whether the text holds a Rust panic.
fn is_panic(text: &str) -> bool {
    text.lines().any(is_panic_head)
}

/// `thread 'main' panicked at src/x.rs:1:2:` (newer toolchains add the thread id:
/// `thread 'main' (7) panicked at ...`).
fn is_panic_head(line: &str) -> bool {
    line.starts_with("thread '") && line.contains(" panicked at ")
}

/// A panic's own message (`thread 'main' panicked at src/x.rs:1:2:` is followed by it),
/// as `panicked at src/x.rs:1:2: the message`, never the backtrace footer.
pub fn panic_message(text: &str) -> Option<String> {
    let lines: Vec<&str> = text.lines().collect();
    let at = lines.iter().position(|l| is_panic_head(l))?;
    let head = lines[at];
    let location = head[head.find(" panicked at ")? + " panicked at ".len()..].trim_end_matches(':');
    let message: Vec<&str> = lines[at + 1..]
        .iter()
        .map(|l| l.trim())
        .take_while(|l| !l.starts_with("note: ") && !l.starts_with("stack backtrace:"))
        .filter(|l| !l.is_empty())
        .collect();
    let message = if message.is_empty() { "(no message)".to_string() } else { message.join(" ") };
    Some(format!("panicked at {location}: {message}"))
}

/// Why a failing child failed, in one line: its panic message when it panicked, else
/// its last `error:` line (see [`reason_line`]).
pub fn failure_reason(stderr: &str) -> String {
    match panic_message(stderr) {
        Some(m) => truncate(&m),
        None => reason_line(stderr),
    }
}

/// Whether the engine refused the cell because the model is not where it was named: its
/// `error:` line carries `model not found:` (after any context it adds in front).
pub fn is_missing_model(stderr: &str) -> bool {
    stderr.lines().map(str::trim).any(|l| {
        l.strip_prefix("error: ").is_some_and(|e| {
            e.starts_with(kiln_protocol::MODEL_NOT_FOUND)
                || e.contains(&format!(": {}", kiln_protocol::MODEL_NOT_FOUND))
        })
    })
}

/// The `memory.events` file of the cgroup this process is in (cgroup v2), when the
/// system has one: the children run in the same cgroup.
pub fn memory_events_path() -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    let file = Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/')).join("memory.events");
    file.is_file().then_some(file)
}

/// The `oom_kill` count in a `memory.events` file.
pub fn oom_kill_count(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    parse_oom_kill(&text)
}

fn parse_oom_kill(text: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix("oom_kill ")).and_then(|n| n.trim().parse().ok())
}

/// The bytes an engine's `out of memory:` line says the cell needed when it was refused:
/// the bytes in use plus the refused request. `None` when no line carries both numbers.
pub fn oom_demand_bytes(text: &str) -> Option<u64> {
    text.lines().filter_map(|l| l.find("out of memory:").map(|at| &l[at..])).find_map(|line| {
        let requested = number_before(line, " bytes) for ")?;
        let in_use = number_before(line, " bytes) in use")?;
        requested.checked_add(in_use)
    })
}

/// The integer that ends right before the first `marker` in `line` (after a `(`).
fn number_before(line: &str, marker: &str) -> Option<u64> {
    let end = line.find(marker)?;
    let start = line[..end].rfind('(')? + 1;
    line[start..end].trim().parse().ok()
}

/// The engine's own explanation of a refusal: its last `error:` line, else its last
/// non-empty line, trimmed to one line for a terminal.
pub fn reason_line(text: &str) -> String {
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let line = lines
        .iter()
        .rev()
        .find(|l| l.starts_with("error:") || l.starts_with("out of memory:"))
        .or(lines.last())
        .copied()
        .unwrap_or("no message");
    truncate(line.strip_prefix("error: ").unwrap_or(line))
}

/// One line for a terminal: at most 300 bytes.
fn truncate(line: &str) -> String {
    const MAX: usize = 300;
    if line.len() > MAX {
        let cut = (0..=MAX).rev().find(|&i| line.is_char_boundary(i)).unwrap_or(0);
        format!("{}...", &line[..cut])
    } else {
        line.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(c: i32) -> ChildExit {
        ChildExit::Code(c)
    }

    const KILN_OOM: &str = "error: out of memory: requested 390.62 KiB (400000 bytes) for kv with \
                            1.00 MiB (1048576 bytes) in use, limit 1.00 MiB (1048576 bytes)";

    fn is_oom(exit: ChildExit, text: &str) -> bool {
        super::is_oom(exit, text, false)
    }

    #[test]
    fn kiln_exit_3_needs_its_out_of_memory_line() {
        assert!(is_oom(code(3), KILN_OOM));
        assert!(is_oom(code(3), "out of memory: requested 1 B (1 bytes) for kv"));
        // kiln-wgpu's refusal by the device itself (`WgpuError::DeviceOutOfMemory`, what
        // `kiln --backend vulkan|metal` prints when wgpu refuses a buffer), and its refusal
        // of a buffer larger than the adapter binds.
        assert!(is_oom(
            code(3),
            "out of memory: the wgpu device refused 1073741824 bytes for weights with 0 bytes in use \
             (Not enough memory left.)\nerror: copying the weights to the device: out of memory: ..."
        ));
        assert!(is_oom(
            code(3),
            "error: out of memory: the wgpu device refused 4294967296 bytes for kv with 12 bytes in use \
             (above the adapter's largest storage buffer binding, 2147483648 bytes)"
        ));
        assert!(!is_oom(code(3), ""), "exit 3 alone is no evidence");
        assert!(!is_oom(code(3), "error: something else"));
        // The pool's line under another exit code is not kiln reporting an OOM.
        assert!(!is_oom(code(1), KILN_OOM));
    }

    #[test]
    fn sigkill_is_an_oom_only_when_the_cgroup_counted_a_kill() {
        assert!(super::is_oom(ChildExit::Signal(9), "", true));
        assert!(!super::is_oom(ChildExit::Signal(9), "", false), "kill -9 from outside");
        assert!(!super::is_oom(ChildExit::Signal(11), "segmentation fault", true));
        assert!(!is_oom(ChildExit::Signal(6), "assertion failed"));
    }

    #[test]
    fn a_timeout_is_never_oom() {
        assert!(!super::is_oom(ChildExit::TimedOut, "", true));
        assert!(!is_oom(ChildExit::TimedOut, KILN_OOM));
    }

    #[test]
    fn panics_and_rust_aborts_are_bugs_not_ooms() {
        let panic = "thread 'main' (123) panicked at crates/kiln-model/src/plan.rs:40:9:\n\
                     out of memory while planning: 1000000000 layers\n\
                     note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n";
        assert!(!is_oom(code(101), panic));
        assert!(!is_oom(code(3), &format!("{panic}{KILN_OOM}")));
        assert_eq!(
            panic_message(panic).unwrap(),
            "panicked at crates/kiln-model/src/plan.rs:40:9: out of memory while planning: 1000000000 layers"
        );
        assert_eq!(failure_reason(panic), panic_message(panic).unwrap());
        let abort = "memory allocation of 17179869184 bytes failed\n";
        assert!(!is_oom(ChildExit::Signal(6), abort) && is_abort(abort));
        let overflow = "thread 'main' panicked at library/alloc/src/raw_vec.rs:24:5:\ncapacity overflow\n";
        assert!(!is_oom(code(101), overflow) && is_abort(overflow));
        assert!(!is_abort("memory allocation of many bytes failed") && !is_abort(KILN_OOM));
        // Without a panic the last error line stands.
        assert_eq!(failure_reason("x\nerror: bad thing\n"), "bad thing");
    }

    #[test]
    fn generic_allocator_phrases_are_not_evidence() {
        for text in [
            "Out Of Memory",
            "error: failed to allocate 1073741824 bytes",
            "mmap: Cannot allocate memory (os error 12)",
            "terminate called after throwing an instance of 'std::bad_alloc'",
        ] {
            assert!(!is_oom(code(1), text), "{text:?}");
        }
    }

    #[test]
    fn the_oom_kill_count_is_read_from_memory_events() {
        let text = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n";
        assert_eq!(parse_oom_kill(text), Some(2));
        assert_eq!(parse_oom_kill("oom 3\n"), None);
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("memory.events");
        std::fs::write(&f, text).unwrap();
        assert_eq!(oom_kill_count(&f), Some(2));
        assert_eq!(oom_kill_count(&dir.path().join("none")), None);
    }

    #[test]
    fn a_missing_model_is_named_by_the_protocol_prefix() {
        assert!(is_missing_model("error: model not found: ./m: expected synthetic:<profile>"));
        assert!(is_missing_model("error: reading model m: model not found: m: expected synthetic:<profile>"));
        assert!(!is_missing_model("warning: model not found: m"));
        assert!(!is_missing_model("error: unsupported config: bits 3"));
    }

    #[test]
    fn metal_allocator_messages() {
        assert!(is_oom(code(1), "[metal::malloc] Resource limit (499000) exceeded"));
        assert!(is_oom(
            code(134),
            "libc++abi: terminating due to uncaught exception of type std::runtime_error: \
             Attempting to allocate 34359738368 bytes which is greater than the maximum \
             allowed buffer size of 28991029248 bytes."
        ));
    }

    #[test]
    fn cuda_allocator_messages() {
        assert!(is_oom(code(1), "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")"));
        assert!(is_oom(code(1), "CUDA_ERROR_OUT_OF_MEMORY"));
        assert!(is_oom(code(1), "cudaMalloc returned cudaErrorMemoryAllocation"));
    }

    #[test]
    fn cu_mem_alloc_failed_needs_an_out_of_memory_reason() {
        assert!(is_oom(code(1), "cuMemAlloc failed: out of memory"));
        assert!(is_oom(code(1), "cuMemAlloc failed (CUDA_ERROR_OUT_OF_MEMORY)"));
        assert!(!is_oom(code(1), "cuMemAlloc failed: CUDA_ERROR_INVALID_VALUE"));
        assert!(!is_oom(code(1), "cuMemAlloc failed: CUDA_ERROR_DEINITIALIZED"));
        assert!(!is_oom(code(1), "cuMemAlloc failed"));
    }

    #[test]
    fn the_pytorch_cuda_message_counts() {
        assert!(is_oom(code(1), "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"));
    }

    #[test]
    fn look_alikes_never_match() {
        for text in [
            "zoom",
            "room",
            "oom",
            "OOM",
            "the room is out of chairs",
            "zoomed in on memory usage",
            "boom: oom-ish",
            "memory allocation of many bytes failed",
            "memory allocation of bytes failed",
            "checked without of memoryless values",
            "failed to allocated_port",
            "error: model not found: synthetic:room",
        ] {
            assert!(!is_oom(code(1), text), "{text:?} matched");
        }
        assert!(!is_oom(code(0), ""));
        assert!(!is_oom(code(0), "warning: failed to allocate huge pages, using small ones"));
        assert!(!is_oom(code(2), "error: unknown synthetic model \"zoom\""));
    }

    #[test]
    fn demand_is_in_use_plus_the_refused_request() {
        let msg = "warning: x\nerror: out of memory: requested 390.62 KiB (400000 bytes) for kv \
                   with 1.00 MiB (1048576 bytes) in use, limit 1.00 MiB (1048576 bytes)\n";
        assert_eq!(oom_demand_bytes(msg), Some(1_448_576));
        let sys = "out of memory: the system refused 1.00 GiB (1073741824 bytes) for weights \
                   with 0 B (0 bytes) in use";
        assert_eq!(oom_demand_bytes(sys), Some(1_073_741_824));
        assert_eq!(oom_demand_bytes("CUDA_ERROR_OUT_OF_MEMORY"), None);
        assert_eq!(oom_demand_bytes("out of memory: requested lots (many bytes) for kv"), None);
    }

    #[test]
    fn statuses_round_trip_and_partition() {
        for st in Status::ALL {
            assert_eq!(Status::parse(st.as_str()), Some(st));
            assert!(!(st.is_failure() && st.is_skip()), "{st}");
            assert_eq!(st == Status::Ok, !st.is_failure() && !st.is_skip(), "{st}");
        }
        assert_eq!(Status::parse("SKIP:oom "), None);
        assert!(Status::Context.is_by_rule() && !Status::Oom.is_by_rule());
    }

    #[test]
    fn reason_prefers_the_error_line() {
        let text = "loading\nerror: 9000 tokens exceed the model's context of 2048 tokens\n\n";
        assert_eq!(reason_line(text), "9000 tokens exceed the model's context of 2048 tokens");
        assert_eq!(reason_line("just this\n"), "just this");
        assert_eq!(reason_line(""), "no message");
        assert!(reason_line(&"é".repeat(400)).ends_with("..."));
    }
}
