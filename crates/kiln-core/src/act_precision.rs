//! The process-wide activation scheme of the 4- and 8-bit kernels, read once from
//! `KILN_ACT_PRECISION`.
//!
//! - `int` (the default; unset or empty): the integer scheme of [`crate::kernels`]:
//!   activations quantized per weight group (8-bit codes for 4-bit weights, 16-bit for
//!   8-bit weights), exact integer sums, `qmv`, `qmv_wide` and `qmm` bit-identical row
//!   for row.
//! - `f32`: f32 activations against the exactly dequantized weights, the rounding-free
//!   reference `cargo xtask bench-quality` measures the integer scheme against. `qmv`
//!   and `qmv_wide` share one per-row loop (identical rows); `qmm` dequantizes tiles for
//!   `matrixmultiply::sgemm`, which sums in another order, so its rows differ from the
//!   vector kernels' by f32 rounding only.

use std::sync::OnceLock;

/// The environment variable choosing the scheme.
pub const ACT_PRECISION_ENV: &str = "KILN_ACT_PRECISION";

/// How the 4- and 8-bit kernels treat activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ActScheme {
    /// Integer codes per weight group (the default).
    Int,
    /// f32 activations (the reference).
    F32,
}

impl ActScheme {
    /// Accepted values, for messages.
    pub const ACCEPTED: &'static str = "int, f32";

    /// Parses a `KILN_ACT_PRECISION` value (surrounding spaces and case ignored; empty is
    /// the default).
    pub fn parse(value: &str) -> Result<ActScheme, String> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "int" => Ok(ActScheme::Int),
            "f32" => Ok(ActScheme::F32),
            other => {
                Err(format!("invalid {ACT_PRECISION_ENV} {other:?}: accepted values are {}", Self::ACCEPTED))
            }
        }
    }

    /// The scheme `KILN_ACT_PRECISION` asks for, or the error naming a bad value.
    pub fn from_env() -> Result<ActScheme, String> {
        match std::env::var(ACT_PRECISION_ENV) {
            Ok(v) => Self::parse(&v),
            Err(std::env::VarError::NotPresent) => Ok(ActScheme::Int),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(format!("invalid {ACT_PRECISION_ENV}: not UTF-8; accepted values are {}", Self::ACCEPTED))
            }
        }
    }

    /// The name reports use.
    pub fn as_str(self) -> &'static str {
        match self {
            ActScheme::Int => "int",
            ActScheme::F32 => "f32",
        }
    }
}

/// The scheme of this process: `KILN_ACT_PRECISION` read once; a bad value falls back to
/// the default here (the `kiln` binary refuses it before any kernel runs).
pub fn act_scheme() -> ActScheme {
    static SCHEME: OnceLock<ActScheme> = OnceLock::new();
    *SCHEME.get_or_init(|| ActScheme::from_env().unwrap_or(ActScheme::Int))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_values_and_names_bad_ones() {
        assert_eq!(ActScheme::parse(" F32 "), Ok(ActScheme::F32));
        assert_eq!(ActScheme::parse(""), Ok(ActScheme::Int));
        assert_eq!(ActScheme::parse("int"), Ok(ActScheme::Int));
        let e = ActScheme::parse("int4").unwrap_err();
        assert!(e.contains("KILN_ACT_PRECISION") && e.contains("\"int4\"") && e.contains("int, f32"), "{e}");
    }
}
