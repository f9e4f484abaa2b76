//! The process-wide `qmv_wide` switch. It is an atomic seeded once from `KILN_QMV_WIDE`
//! and settable at run time (an exactness gate may turn it off); when the variable is set
//! at all, the operator has pinned it and `qmv_wide_pinned_by_operator` says so.
//!
//! Values `0`, `false`, `no` and `off` (any case, surrounding spaces ignored) turn the
//! switch off; any other value, including an empty one, turns it on. Unset: on.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

/// The environment variable seeding the switch.
pub const QMV_WIDE_ENV: &str = "KILN_QMV_WIDE";

struct Switch {
    on: AtomicBool,
    pinned: bool,
}

fn switch() -> &'static Switch {
    static SWITCH: OnceLock<Switch> = OnceLock::new();
    SWITCH.get_or_init(|| {
        // A value that is not UTF-8 is still set (pinned) and, being none of the "off"
        // words, turns the switch on, as the documentation says of any other value.
        let value = std::env::var_os(QMV_WIDE_ENV).map(|v| v.to_string_lossy().into_owned());
        let on = value.as_deref().is_none_or(parse_switch_value);
        Switch { on: AtomicBool::new(on), pinned: value.is_some() }
    })
}

/// Reads a `KILN_QMV_WIDE` value: false for `0`, `false`, `no`, `off`, true otherwise.
pub fn parse_switch_value(value: &str) -> bool {
    !matches!(value.trim().to_ascii_lowercase().as_str(), "0" | "false" | "no" | "off")
}

/// Whether `2 <= M < qmv_batch_limit` runs `qmv_wide` (true) or `qmv` once per row.
pub fn qmv_wide_enabled() -> bool {
    switch().on.load(Ordering::Relaxed)
}

/// Turns the wide kernel on or off for the whole process.
pub fn set_qmv_wide(on: bool) {
    switch().on.store(on, Ordering::Relaxed);
}

/// True when `KILN_QMV_WIDE` was set at all when the switch was first read, whatever its
/// value: the operator chose the kernel, and automatic changes should respect that.
pub fn qmv_wide_pinned_by_operator() -> bool {
    switch().pinned
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_that_turn_it_off() {
        for v in ["0", "false", "FALSE", " no ", "Off"] {
            assert!(!parse_switch_value(v), "{v:?}");
        }
        for v in ["1", "true", "yes", "on", "", "wide"] {
            assert!(parse_switch_value(v), "{v:?}");
        }
    }
}
