//! Exit codes, the one place errors become a status: 0 success, 1 anything else, 2 bad
//! arguments or an unusable model, 3 out of memory. A broken pipe on stdout (the reader
//! went away) ends the process quietly with 0.

use std::process::ExitCode;

use kiln_core::OutOfMemory;
use kiln_core::pool::LimitError;
use kiln_model::{BackendErrorKind, ModelError};

/// The protocol's exit codes, defined once in kiln-protocol for the engine and the
/// harness: success, anything else, bad arguments or an unusable model, out of memory.
pub use kiln_protocol::{
    EXIT_FAILURE as FAILURE, EXIT_OUT_OF_MEMORY as OUT_OF_MEMORY, EXIT_SUCCESS as SUCCESS,
    EXIT_USAGE as USAGE,
};

/// An argument the parser accepted but the command cannot use (the protocol's type, so
/// engine and harness mean the same by exit 2).
pub use kiln_protocol::UsageError;

/// Shorthand for a [`UsageError`] as an `anyhow::Error`.
pub fn usage(message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(UsageError(message.into()))
}

/// What an error means for the exit status.
#[derive(Debug, PartialEq, Eq)]
pub enum Kind {
    /// The reader of stdout went away.
    BrokenPipe,
    /// The pool refused an allocation.
    OutOfMemory,
    /// Bad arguments or an unusable model.
    Usage,
    /// Anything else.
    Other,
}

/// Classifies `err` by the first cause in its chain that says what it is.
pub fn classify(err: &anyhow::Error) -> Kind {
    for cause in err.chain() {
        if cause.downcast_ref::<OutOfMemory>().is_some() {
            return Kind::OutOfMemory;
        }
        if cause.downcast_ref::<UsageError>().is_some() || cause.downcast_ref::<LimitError>().is_some() {
            return Kind::Usage;
        }
        if let Some(e) = cause.downcast_ref::<ModelError>() {
            return match e {
                ModelError::OutOfMemory(_) => Kind::OutOfMemory,
                ModelError::Backend { kind, .. } => match kind {
                    BackendErrorKind::OutOfMemory => Kind::OutOfMemory,
                    BackendErrorKind::Usage => Kind::Usage,
                    BackendErrorKind::Other => Kind::Other,
                },
                ModelError::Io { .. } => Kind::Other,
                _ => Kind::Usage,
            };
        }
        #[cfg(feature = "cuda")]
        if let Some(e) = cause.downcast_ref::<kiln_cuda::CudaError>() {
            use kiln_cuda::CudaError as E;
            return match e {
                _ if e.is_out_of_memory() => Kind::OutOfMemory,
                E::Driver { .. } | E::UnknownKernel(_) => Kind::Other,
                // No driver or device, a model or option the device forward does not run,
                // a bad input or shape: the command cannot run as given.
                _ => Kind::Usage,
            };
        }
        if let Some(e) = cause.downcast_ref::<std::io::Error>()
            && e.kind() == std::io::ErrorKind::BrokenPipe
        {
            return Kind::BrokenPipe;
        }
    }
    Kind::Other
}

/// Prints `err` to stderr as the protocol asks and returns the exit status.
pub fn report(err: &anyhow::Error) -> ExitCode {
    let kind = classify(err);
    let code = match kind {
        Kind::BrokenPipe => return ExitCode::from(SUCCESS),
        Kind::OutOfMemory => OUT_OF_MEMORY,
        Kind::Usage => USAGE,
        Kind::Other => FAILURE,
    };
    if kind == Kind::OutOfMemory {
        // The pool's own message on a line of its own, so a harness can match the line
        // start; the context that led to it follows.
        if let Some(oom) = err.chain().find_map(oom_message) {
            eprintln!("{oom}");
        }
    }
    eprintln!("error: {err:#}");
    ExitCode::from(code)
}

/// Makes a panic end with its message: the default report (message, location and, when
/// RUST_BACKTRACE asks, a backtrace) is followed by one `error: kiln panicked: ...` line,
/// so the last lines of stderr name the panic even when a backtrace precedes them.
pub fn install_panic_report() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(no message)");
        let at = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
        eprintln!("error: kiln panicked: {message}{at}");
    }));
}

fn oom_message(cause: &(dyn std::error::Error + 'static)) -> Option<String> {
    #[cfg(feature = "cuda")]
    if let Some(e) = cause.downcast_ref::<kiln_cuda::CudaError>().filter(|e| e.is_out_of_memory()) {
        return Some(e.to_string());
    }
    if let Some(e) = cause.downcast_ref::<OutOfMemory>() {
        return Some(e.to_string());
    }
    match cause.downcast_ref::<ModelError>() {
        Some(ModelError::OutOfMemory(e)) => Some(e.to_string()),
        Some(e @ ModelError::Backend { kind: BackendErrorKind::OutOfMemory, .. }) => Some(e.to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use anyhow::Context;
    use kiln_core::Tag;

    use super::*;

    #[test]
    fn causes_map_to_documented_codes() {
        let oom = OutOfMemory { requested: 10, tag: Tag::Kv, in_use: 5, limit: 8 };
        let e = anyhow::Error::new(ModelError::from(oom.clone())).context("loading synthetic:tiny");
        assert_eq!(classify(&e), Kind::OutOfMemory);
        assert_eq!(classify(&anyhow::Error::new(oom)), Kind::OutOfMemory);
        let e = anyhow::Error::new(ModelError::ContextExceeded { requested: 10, limit: 5 });
        assert_eq!(classify(&e), Kind::Usage);
        assert_eq!(classify(&usage("bad")), Kind::Usage);
        let io = std::io::Error::new(std::io::ErrorKind::BrokenPipe, "pipe");
        let e = Err::<(), _>(io).context("writing").unwrap_err();
        assert_eq!(classify(&e), Kind::BrokenPipe);
        assert_eq!(classify(&anyhow::anyhow!("something")), Kind::Other);
        let e = anyhow::Error::new(ModelError::Io { path: "x".into(), cause: std::io::Error::other("disk") });
        assert_eq!(classify(&e), Kind::Other);
    }

    /// Set only in the child process [`a_panic_ends_with_its_message`] starts.
    const PANIC_CHILD: &str = "KILN_TEST_PANIC_CHILD";

    #[test]
    fn a_panic_ends_with_its_message() {
        if std::env::var_os(PANIC_CHILD).is_some() {
            install_panic_report();
            panic!("the probe's panic text");
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "exit::tests::a_panic_ends_with_its_message",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(PANIC_CHILD, "1")
            .env("RUST_BACKTRACE", "1")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        let lines: Vec<&str> = stderr.lines().collect();
        let report =
            lines.iter().rposition(|l| l.starts_with("error: kiln panicked: the probe's panic text at "));
        let report = report.unwrap_or_else(|| panic!("no panic report line: {stderr}"));
        let backtrace = lines.iter().position(|l| l.contains("stack backtrace"));
        assert!(backtrace.is_none_or(|b| b < report), "the report follows the backtrace: {stderr}");
    }
}
