//! The `0`/`1` switches both sides read from the environment, parsed by one rule: unset
//! or empty is the switch's default, `0` is off, `1` is on, and anything else (non-UTF-8
//! bytes included) is refused naming the variable, by the engine (exit 2) and by the
//! harness before it starts a run.

use std::ffi::OsStr;

/// Runs `--backend cuda`'s kernels through their host execution on the CPU when `1`.
pub const CUDA_EMULATE_ENV: &str = "KILN_CUDA_EMULATE";

/// The value `value` of the switch `name` gives, `default` when unset or empty.
pub fn switch_value(name: &str, value: Option<&OsStr>, default: bool) -> Result<bool, String> {
    match value {
        None => Ok(default),
        Some(v) if v.is_empty() => Ok(default),
        Some(v) if v == "0" => Ok(false),
        Some(v) if v == "1" => Ok(true),
        Some(v) => Err(format!("invalid {name} {v:?}: accepted values are 0 and 1")),
    }
}

/// Whether [`CUDA_EMULATE_ENV`]'s value asks for the host execution (default no).
pub fn cuda_emulation(value: Option<&OsStr>) -> Result<bool, String> {
    switch_value(CUDA_EMULATE_ENV, value, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_take_0_1_or_nothing_and_name_themselves_otherwise() {
        fn v(s: &str) -> Option<&OsStr> {
            Some(OsStr::new(s))
        }
        assert_eq!(cuda_emulation(None), Ok(false));
        assert_eq!(cuda_emulation(v("")), Ok(false));
        assert_eq!(cuda_emulation(v("0")), Ok(false));
        assert_eq!(cuda_emulation(v("1")), Ok(true));
        assert_eq!(switch_value("KILN_CUDA_GRAPHS", None, true), Ok(true));
        let e = cuda_emulation(v("yes")).unwrap_err();
        assert_eq!(e, "invalid KILN_CUDA_EMULATE \"yes\": accepted values are 0 and 1");
        use std::os::unix::ffi::OsStrExt;
        assert!(cuda_emulation(Some(OsStr::from_bytes(b"\xff"))).is_err(), "non-UTF-8 is refused, not unset");
    }
}
