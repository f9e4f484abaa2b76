//! The process-wide `qmv_wide` switch. It is an atomic seeded once from `KILN_QMV_WIDE`
//! and settable at run time (an exactness gate may turn it off); when the variable is set
//! at all, the operator has pinned it and `qmv_wide_pinned_by_operator` says so.
//!
//! Values `0`, `false`, `no` and `off` (any case, surrounding spaces ignored) turn the
//! switch off; any other value, including an empty one, turns it on. Unset: on.
//!
//! On and not pinned, the switch lets the measured crossover ([`crate::crossover`],
//! installed with [`set_crossover`]) choose per M between `qmv_wide` and `qmv` per row;
//! pinned on (`KILN_QMV_WIDE=1`) it forces `qmv_wide` at every M; off (pinned with `0`,
//! or turned off by the exactness gate) it forces `qmv` per row.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};

use crate::crossover::Crossover;

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

static CROSSOVER: AtomicU16 = AtomicU16::new(Crossover::ALL_WIDE.bits());

/// Installs the crossover the dispatcher follows while the switch is on and not pinned
/// (until then: [`Crossover::ALL_WIDE`], `qmv_wide` at every M).
pub fn set_crossover(c: Crossover) {
    CROSSOVER.store(c.bits(), Ordering::Relaxed);
}

/// The installed crossover.
pub fn crossover() -> Crossover {
    Crossover::from_bits(CROSSOVER.load(Ordering::Relaxed))
}

/// Whether `m` rows (`2 <= m <` the `qmm` limit) run `qmv_wide`: `switch_on` and
/// `pinned` are the switch's state, `c` the crossover.
pub fn wide_for(m: usize, switch_on: bool, pinned: bool, c: Crossover) -> bool {
    switch_on && (pinned || c.wide_at(m))
}

/// The batch sizes that run `qmv_wide` now, as the switch, the pin and the crossover
/// decide together (for reports): none while the switch is off, every M when pinned on.
pub fn wide_rows() -> Crossover {
    let c = crossover();
    Crossover::from_bits(
        (2..16)
            .filter(|&m| wide_for(m, qmv_wide_enabled(), qmv_wide_pinned_by_operator(), c))
            .fold(0, |b, m| b | 1 << m),
    )
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

    #[test]
    fn the_pin_overrides_the_crossover_and_off_forces_per_row() {
        let c = Crossover::from_bits(1 << 3);
        // Unpinned and on: the crossover decides.
        assert!(wide_for(3, true, false, c) && !wide_for(2, true, false, c));
        // Pinned on: wide everywhere; off (pinned or by the gate): per row everywhere.
        assert!(wide_for(2, true, true, c));
        assert!(!wide_for(3, false, true, c) && !wide_for(3, false, false, c));
    }
}
