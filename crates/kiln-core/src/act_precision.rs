//! The process-wide activation scheme of the 4- and 8-bit kernels, read once from
//! `KILN_ACT_PRECISION`.
//!
//! - `int16` (the default; unset or empty): the integer scheme of [`crate::kernels`] with
//!   16-bit activation codes for every integer width: per weight group, codes in
//!   `[-32512, 32512]` for 4-bit weights (`127 * 256`, so AVX2 splits each code exactly
//!   into two 8-bit planes for `maddubs`) and `[-32767, 32767]` for 8-bit weights. Exact
//!   integer sums; `qmv`, `qmv_wide` and `qmm` bit-identical row for row. On AVX2 the
//!   second plane doubles the `maddubs` and the i16 partials to reduce for 4-bit weights:
//!   at least 1.5 times `int8`'s instructions, about a fifth more decode CPU per token on
//!   a compute-bound host (docs/benchmarks.md, "What `int16` costs").
//! - `int8` (also accepted as `int`): the same, but 4-bit weights meet 8-bit codes in
//!   `[-127, 127]` (one `maddubs` plane: cheaper, and 256 times the rounding). 8-bit
//!   weights keep 16-bit codes.
//! - `int16-wide8` (opt-in): `int16` for one activation row (`qmv`, and so single-stream
//!   decode and the per-row path) and for `qmm` (prefill), but the wide kernel
//!   (`qmv_wide`, 2 <= M < the `qmm` limit: batched decode, speculative verify blocks)
//!   gives 4-bit weights `int8`'s 8-bit codes, one `maddubs` plane instead of two. A
//!   batched row is then no longer bit-identical to the same row decoded alone, so
//!   batched greedy can differ from sequential greedy, at `int8`'s quality for those
//!   rows; the speculative exactness gate finds its verify blocks inexact and drops the
//!   wide path (`exact-without-qmv-wide`). 8-bit weights run as under `int16`.
//! - `f32`: f32 activations against the exactly dequantized weights, the rounding-free
//!   reference `cargo xtask bench-quality` measures the integer schemes against. `qmv`
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
    /// 16-bit integer codes per weight group for every integer width (the default).
    Int16,
    /// 8-bit integer codes per group for 4-bit weights, 16-bit for 8-bit weights.
    Int8,
    /// `Int16` for one row and for `qmm`; `Int8` for the rows of `qmv_wide` (M >= 2).
    Int16Wide8,
    /// f32 activations (the reference).
    F32,
}

impl ActScheme {
    /// Accepted values, for messages.
    pub const ACCEPTED: &'static str = "int16, int8 (or int), int16-wide8, f32";

    /// Every scheme, the default first.
    pub const ALL: [ActScheme; 4] =
        [ActScheme::Int16, ActScheme::Int8, ActScheme::Int16Wide8, ActScheme::F32];

    /// Parses a `KILN_ACT_PRECISION` value (surrounding spaces and case ignored; empty is
    /// the default).
    pub fn parse(value: &str) -> Result<ActScheme, String> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "int16" => Ok(ActScheme::Int16),
            "int" | "int8" => Ok(ActScheme::Int8),
            "int16-wide8" => Ok(ActScheme::Int16Wide8),
            "f32" => Ok(ActScheme::F32),
            other => {
                Err(format!("invalid {ACT_PRECISION_ENV} {other:?}: accepted values are {}", Self::ACCEPTED))
            }
        }
    }

    /// The scheme `KILN_ACT_PRECISION` asks for, or the error naming a bad value.
    pub fn from_env() -> Result<ActScheme, String> {
        Self::parse(&crate::env::setting_env(ACT_PRECISION_ENV, Self::ACCEPTED)?)
    }

    /// The name reports use: `int16`, `int8`, `f32`.
    pub fn as_str(self) -> &'static str {
        match self {
            ActScheme::Int16 => "int16",
            ActScheme::Int8 => "int8",
            ActScheme::Int16Wide8 => "int16-wide8",
            ActScheme::F32 => "f32",
        }
    }

    /// The scheme a kernel computing `m` activation rows in one pass follows: for
    /// `int16-wide8`, `int8` when the wide kernel runs two rows or more and `int16`
    /// otherwise; every other scheme is itself. `qmv` and `qmm` follow `rows_scheme(1)`.
    pub fn rows_scheme(self, m: usize) -> ActScheme {
        match self {
            ActScheme::Int16Wide8 if m >= 2 => ActScheme::Int8,
            ActScheme::Int16Wide8 => ActScheme::Int16,
            s => s,
        }
    }

    /// Whether the wide kernel's rows round differently from the same rows run one by one
    /// (`int16-wide8`): then `qmv_wide` and per-row `qmv` are not interchangeable.
    pub fn wide_differs(self) -> bool {
        self.rows_scheme(2) != self.rows_scheme(1)
    }
}

/// The scheme of this process: `KILN_ACT_PRECISION` read once; a bad value falls back to
/// the default here (the `kiln` binary refuses it before any kernel runs).
pub fn act_scheme() -> ActScheme {
    static SCHEME: OnceLock<ActScheme> = OnceLock::new();
    *SCHEME.get_or_init(|| ActScheme::from_env().unwrap_or(ActScheme::Int16))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_values_and_names_bad_ones() {
        assert_eq!(ActScheme::parse(" F32 "), Ok(ActScheme::F32));
        assert_eq!(ActScheme::parse(""), Ok(ActScheme::Int16));
        assert_eq!(ActScheme::parse("int16"), Ok(ActScheme::Int16));
        assert_eq!(ActScheme::parse("int"), Ok(ActScheme::Int8));
        assert_eq!(ActScheme::parse("INT8"), Ok(ActScheme::Int8));
        assert_eq!(ActScheme::parse(" Int16-Wide8"), Ok(ActScheme::Int16Wide8));
        for s in ActScheme::ALL {
            assert_eq!(ActScheme::parse(s.as_str()), Ok(s));
        }
        let e = ActScheme::parse("int4").unwrap_err();
        assert!(
            e.contains("KILN_ACT_PRECISION") && e.contains("\"int4\"") && e.contains("int16-wide8"),
            "{e}"
        );
    }

    #[test]
    fn only_the_wide_scheme_splits_by_rows() {
        assert_eq!(ActScheme::Int16Wide8.rows_scheme(1), ActScheme::Int16);
        assert_eq!(ActScheme::Int16Wide8.rows_scheme(2), ActScheme::Int8);
        assert_eq!(ActScheme::Int16Wide8.rows_scheme(15), ActScheme::Int8);
        assert!(ActScheme::Int16Wide8.wide_differs());
        for s in [ActScheme::Int16, ActScheme::Int8, ActScheme::F32] {
            assert!(!s.wide_differs());
            assert_eq!((s.rows_scheme(1), s.rows_scheme(8)), (s, s));
        }
    }
}
