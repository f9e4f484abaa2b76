//! Byte sizes as people write them (`512MiB`, `2GiB`, `1.5GB`, `1048576`) and as kiln
//! prints them.

use std::fmt;

/// The size syntax is part of the engine protocol (the harness checks `--memory-limit`
/// with the same function), so it lives in kiln-protocol.
pub use kiln_protocol::{SizeParseError, parse_size};

/// Displays a byte count with a binary unit, e.g. `1.50 GiB`.
#[derive(Clone, Copy, Debug)]
pub struct HumanBytes(pub u64);

impl fmt::Display for HumanBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
        let mut v = self.0 as f64;
        let mut i = 0;
        while v >= 1024.0 && i + 1 < UNITS.len() {
            v /= 1024.0;
            i += 1;
        }
        if i == 0 { write!(f, "{} B", self.0) } else { write!(f, "{v:.2} {}", UNITS[i]) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_display() {
        assert_eq!(HumanBytes(512).to_string(), "512 B");
        assert_eq!(HumanBytes(3 << 29).to_string(), "1.50 GiB");
    }
}
