//! Errors that end `cargo xtask` with a particular status, and stdout writes that turn a
//! closed pipe (`cargo xtask ... | head`) into a quiet exit instead of a panic, and sizes as a reader
//! takes them in.

use std::fmt;
use std::io::{self, Write};

/// Bad input found before anything ran: exit 2, like a clap usage error.
pub use kiln_protocol::UsageError;

/// stdout's reader went away: stop quietly.
#[derive(Debug)]
pub struct BrokenPipe;

impl fmt::Display for BrokenPipe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("stdout was closed")
    }
}

impl std::error::Error for BrokenPipe {}

/// Returns a [`UsageError`] from the enclosing function.
macro_rules! usage {
    ($($arg:tt)*) => {
        return Err(anyhow::Error::new($crate::console::UsageError(format!($($arg)*))))
    };
}
pub(crate) use usage;

/// Writes `text` to stdout and flushes it. A closed pipe is [`BrokenPipe`].
pub fn out(text: &str) -> anyhow::Result<()> {
    let mut stdout = io::stdout().lock();
    match stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Err(BrokenPipe.into()),
        Err(e) => Err(anyhow::Error::new(e).context("writing to stdout")),
    }
}

/// The exit status for an error that ended a task, and whether to print the error: 2 for
/// bad input, 0 and silence for a closed stdout (its reader has all it wanted), 1 otherwise.
pub fn exit_for(e: &anyhow::Error) -> (u8, bool) {
    if e.downcast_ref::<BrokenPipe>().is_some() {
        (0, false)
    } else if e.downcast_ref::<UsageError>().is_some() {
        (2, true)
    } else {
        (1, true)
    }
}

/// A size as a reader takes it in: `512 B`, `1.5 GiB` (binary units, one decimal).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 { format!("{bytes} B") } else { format!("{v:.1} {}", UNITS[i]) }
}
