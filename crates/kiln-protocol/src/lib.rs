//! The engine protocol (docs/engine-protocol.md) in one place: the reports `kiln
//! bench-decode` and `kiln estimate` print, their field lists, the exit codes, the marker
//! of an out-of-memory line, and the syntax of sizes. The engine writes these structs and
//! the harness parses them, so neither side spells a field name of its own.
//!
//! This crate holds no engine code: a harness may depend on it without building an engine.

#![deny(missing_docs)]

mod act;
mod knobs;
mod lines;
mod report;
mod size;
mod switches;
mod tokens;
mod usage;

pub use act::{ACT_PRECISION_ENV, ActScheme};
pub use knobs::{Attention, Backend, KNOB_COLUMNS, KNOBS, Knob, KnobError, Knobs, KvDtype};
pub use lines::{GateOutcome, KernelChangedLine, KernelConfigLine, ListeningLine, SpecGateLine};
pub use report::{
    DECODE_FIELDS, DecodeReport, DeviceDesc, ESTIMATE_EXPERT_FIELDS, ESTIMATE_FIELDS, EXPERT_FIELDS,
    EstimateReport, OffloadCopyReport, ReportError, RoofsReport, SPEC_FIELDS,
};
pub use size::{MIN_BANDWIDTH_BYTES, SizeParseError, parse_bandwidth_bytes, parse_size};
pub use switches::{CUDA_EMULATE_ENV, cuda_emulation, switch_value};
pub use tokens::{ContextExceeded, WarmupError, check_context, context_room, timed_decode_steps};
pub use usage::UsageError;

/// Exit status: success.
pub const EXIT_SUCCESS: u8 = 0;
/// Exit status: anything else (a bug, an I/O failure).
pub const EXIT_FAILURE: u8 = 1;
/// Exit status: bad arguments or an unusable model.
pub const EXIT_USAGE: u8 = 2;
/// Exit status: the memory pool refused an allocation.
pub const EXIT_OUT_OF_MEMORY: u8 = 3;

/// What the `error:` line of an exit of [`EXIT_USAGE`] carries when an expert cache
/// geometry is refused by the engine's rules (floor, total, backend cap): `error:
/// invalid --expert-slots: <model> @ cache_slots=S: ...`. The text after the marker is the
/// reason, naming the rule and the cap.
pub const GEOMETRY_REFUSED: &str = "invalid --expert-slots: ";

/// How the line that explains an exit of [`EXIT_OUT_OF_MEMORY`] starts on stderr.
pub const OOM_LINE_PREFIX: &str = "out of memory:";

/// What the `error:` line of an exit of [`EXIT_USAGE`] carries when the model is not where
/// it was named: `error: model not found: ...`, or after context the engine adds,
/// `error: reading model m: model not found: ...`.
pub const MODEL_NOT_FOUND: &str = "model not found:";
