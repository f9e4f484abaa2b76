//! Byte sizes as `--memory-limit` and `KILN_MEMORY_LIMIT` accept them: `512MiB`, `2GiB`,
//! `1.5GB`, `1048576`.

/// A size string that could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid size {input:?}: expected a byte count such as 1073741824, or a number with a \
     unit: B, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000), e.g. \
     512MiB or 2GiB"
)]
pub struct SizeParseError {
    /// The text that was refused.
    pub input: String,
}

/// Parses a byte size. Units are case-insensitive; `K`, `M`, `G`, `T` alone mean the
/// binary units, as in most command-line tools.
pub fn parse_size(input: &str) -> Result<u64, SizeParseError> {
    let err = || SizeParseError { input: input.to_string() };
    let s = input.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err(err());
    }
    let unit = unit.trim().to_ascii_lowercase();
    let mult: u64 = match unit.as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(err()),
    };
    if num.contains('.') {
        let v: f64 = num.parse().map_err(|_| err())?;
        let bytes = v * mult as f64;
        // 2^64 itself is past u64::MAX; `as` would saturate it silently.
        if !bytes.is_finite() || bytes >= u64::MAX as f64 {
            return Err(err());
        }
        Ok(bytes.round() as u64)
    } else {
        let v: u64 = num.parse().map_err(|_| err())?;
        v.checked_mul(mult).ok_or_else(err)
    }
}

/// The smallest read-bandwidth buffer `kiln bench-expert-copy --bandwidth-bytes` takes.
pub const MIN_BANDWIDTH_BYTES: u64 = 1 << 20;

/// `--bandwidth-bytes`: a size of at least [`MIN_BANDWIDTH_BYTES`]. The one rule, read by
/// the engine and, at parse time, by the harness that passes the flag on.
pub fn parse_bandwidth_bytes(input: &str) -> Result<u64, String> {
    let b = parse_size(input).map_err(|e| e.to_string())?;
    if b < MIN_BANDWIDTH_BYTES || usize::try_from(b).is_err() {
        return Err(format!("{b} bytes: accepted values are 1MiB or more"));
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidth_buffers_are_at_least_a_mebibyte() {
        assert_eq!(parse_bandwidth_bytes("4MiB"), Ok(4 << 20));
        assert_eq!(parse_bandwidth_bytes("1048576"), Ok(1 << 20));
        assert!(parse_bandwidth_bytes("1048575").unwrap_err().contains("1MiB or more"));
        assert!(parse_bandwidth_bytes("lots").unwrap_err().contains("invalid size \"lots\""));
    }

    #[test]
    fn parses_the_documented_forms() {
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("2gib").unwrap(), 2 << 30);
        assert_eq!(parse_size("1048576").unwrap(), 1 << 20);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("3GB").unwrap(), 3_000_000_000);
        assert_eq!(parse_size(" 64 KiB ").unwrap(), 64 << 10);
        assert_eq!(parse_size("8G").unwrap(), 8 << 30);
    }

    #[test]
    fn refuses_and_names_bad_input() {
        for bad in [
            "",
            "GiB",
            "12 parsecs",
            "12XB",
            "1.2.3MiB",
            "-5MiB",
            "99999999999999999999",
            "16777216TiB",
            "16EiB",
        ] {
            let e = parse_size(bad).unwrap_err();
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
            assert!(e.to_string().contains("MiB"));
        }
    }
}
