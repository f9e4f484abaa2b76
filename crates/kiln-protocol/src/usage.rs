//! The error both sides end with exit status 2 ([`crate::EXIT_USAGE`]): an input the
//! argument parser accepted but the command cannot use.

/// Bad input found before anything ran: exit 2, like a clap usage error. The message
/// names the input and what would be accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);
