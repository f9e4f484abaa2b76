//! How a finished child is classified: the status vocabulary of a sweep row, and the
//! out-of-memory classifier, a pure function of the exit and the captured text.

use std::fmt;

/// The protocol's exit code for "the memory pool refused an allocation".
pub const KILN_OOM_EXIT_CODE: i32 = 3;
/// The protocol's exit code for "bad arguments or an unusable model".
pub const KILN_BY_RULE_EXIT_CODE: i32 = 2;
/// SIGKILL's number, the kernel OOM killer's signal (the same on Linux and macOS).
const SIGKILL: i32 = 9;

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
}

impl Status {
    /// Every status, in the order the documentation lists them.
    pub const ALL: [Status; 12] = [
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
        matches!(self, Status::Timeout | Status::Bench | Status::NoOutput | Status::Estimate)
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
/// ran out of memory. A timeout never is: the harness's own kill says nothing about
/// memory; nor is a clean exit, whatever its log says about a fallback. Matching is by specific, grounded phrases only, so "zoom", "room" or a bare
/// "oom" in a log never count.
pub fn is_oom(exit: ChildExit, text: &str) -> bool {
    match exit {
        ChildExit::TimedOut | ChildExit::Code(0) => false,
        ChildExit::Code(KILN_OOM_EXIT_CODE) => true,
        // Nobody but the kernel's OOM killer SIGKILLs a cell the harness did not kill.
        ChildExit::Signal(SIGKILL) => true,
        ChildExit::Code(_) | ChildExit::Signal(_) => text.lines().any(line_reports_oom),
    }
}

/// Phrases that mean an allocation failed for lack of memory wherever they appear.
const OOM_PHRASES: &[&str] = &[
    // kiln's pool and the generic wording of most allocators and runtimes.
    "out of memory",
    "failed to allocate",
    "cannot allocate memory",
    "std::bad_alloc",
    // Metal.
    "[metal::malloc]",
    "greater than the maximum allowed buffer size",
    // CUDA.
    "cuda_error_out_of_memory",
    "cudaerrormemoryallocation",
];

/// Reasons that make a `cuMemAlloc failed` line an out-of-memory one; without one, the
/// call may have failed for an invalid value or a torn-down context.
const CU_MEM_ALLOC_OOM_REASONS: &[&str] = &["out of memory", "out_of_memory"];

fn line_reports_oom(line: &str) -> bool {
    let lower = line.to_ascii_lowercase();
    if OOM_PHRASES.iter().any(|p| contains_phrase(&lower, p)) {
        return true;
    }
    if lower.contains("cumemalloc failed") {
        return CU_MEM_ALLOC_OOM_REASONS.iter().any(|r| lower.contains(r));
    }
    is_rust_alloc_failure(&lower)
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

/// Rust's allocation-error handler: `memory allocation of 1024 bytes failed`.
fn is_rust_alloc_failure(lower: &str) -> bool {
    const HEAD: &str = "memory allocation of ";
    lower.match_indices(HEAD).any(|(at, _)| {
        let rest = &lower[at + HEAD.len()..];
        let digits = rest.chars().take_while(char::is_ascii_digit).count();
        digits > 0 && rest[digits..].starts_with(" bytes failed")
    })
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
    let line = line.strip_prefix("error: ").unwrap_or(line);
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

    #[test]
    fn kiln_oom_exit_code_is_oom_without_any_text() {
        assert!(is_oom(code(3), ""));
    }

    #[test]
    fn sigkill_is_the_oom_killer() {
        assert!(is_oom(ChildExit::Signal(9), ""));
        assert!(!is_oom(ChildExit::Signal(11), "segmentation fault"));
        assert!(!is_oom(ChildExit::Signal(6), "assertion failed"));
    }

    #[test]
    fn a_timeout_is_never_oom() {
        assert!(!is_oom(ChildExit::TimedOut, ""));
        assert!(!is_oom(ChildExit::TimedOut, "out of memory: requested 1 (1 bytes)"));
    }

    #[test]
    fn the_engine_message_counts_under_any_exit_code() {
        let msg = "out of memory: requested 390.62 KiB (400000 bytes) for kv with 1.00 MiB \
                   (1048576 bytes) in use, limit 1.00 MiB (1048576 bytes)";
        assert!(is_oom(code(1), msg));
        assert!(is_oom(code(1), &format!("error: {msg}")));
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
    fn generic_allocator_messages() {
        assert!(is_oom(code(1), "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"));
        assert!(is_oom(code(1), "Out Of Memory"));
        assert!(is_oom(code(1), "error: failed to allocate 1073741824 bytes"));
        assert!(is_oom(code(1), "mmap: Cannot allocate memory (os error 12)"));
        assert!(is_oom(code(134), "terminate called after throwing an instance of 'std::bad_alloc'"));
        assert!(is_oom(code(134), "memory allocation of 17179869184 bytes failed"));
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
