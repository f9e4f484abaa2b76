//! The activation scheme of the 4- and 8-bit kernels (`KILN_ACT_PRECISION`): a knob that
//! crosses the process boundary (the engine runs it, the harness sweeps it and reads it
//! back from reports), so its names, its parse and its accepted values live here, once.
//! kiln-core's `act_precision` says what each scheme computes.

/// The environment variable choosing the scheme.
pub const ACT_PRECISION_ENV: &str = "KILN_ACT_PRECISION";

/// How the 4- and 8-bit kernels treat activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ActScheme {
    /// 16-bit integer codes per weight group for every integer width (the default).
    Int16,
    /// 8-bit integer codes per group for 4-bit weights, 16-bit for 8-bit weights.
    Int8,
    /// `Int16` for one row and for `qmm`; `Int8` for the rows of `qmv_wide` (M >= 2).
    Int16Wide8,
    /// f32 activations (the reference).
    F32,
    /// f16 activations with f32 accumulation: the device backends' products (cuda,
    /// vulkan, metal). The CPU's kernels do not run it; a backend that cannot honour a
    /// scheme refuses it by name (kiln-model's `Capabilities`).
    F16,
}

impl ActScheme {
    /// Accepted values, for messages.
    pub const ACCEPTED: &'static str = "int16, int8 (or int), int16-wide8, f32, f16";

    /// Every scheme, the CPU's default first.
    pub const ALL: [ActScheme; 5] =
        [ActScheme::Int16, ActScheme::Int8, ActScheme::Int16Wide8, ActScheme::F32, ActScheme::F16];

    /// Parses a `KILN_ACT_PRECISION` value (surrounding spaces and case ignored; empty is
    /// the default).
    pub fn parse(value: &str) -> Result<ActScheme, String> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "int16" => Ok(ActScheme::Int16),
            "int" | "int8" => Ok(ActScheme::Int8),
            "int16-wide8" => Ok(ActScheme::Int16Wide8),
            "f32" => Ok(ActScheme::F32),
            "f16" => Ok(ActScheme::F16),
            other => {
                Err(format!("invalid {ACT_PRECISION_ENV} {other:?}: accepted values are {}", Self::ACCEPTED))
            }
        }
    }

    /// The scheme `KILN_ACT_PRECISION` asks for (unset or empty: the CPU's default), or
    /// the error naming a bad value, a value that is not UTF-8 included.
    pub fn from_env() -> Result<ActScheme, String> {
        Ok(Self::asked_in_env()?.unwrap_or(ActScheme::Int16))
    }

    /// The scheme `KILN_ACT_PRECISION` names, `None` when it is unset or empty (each
    /// backend then runs its own default), or the error naming a bad value.
    pub fn asked_in_env() -> Result<Option<ActScheme>, String> {
        match std::env::var(ACT_PRECISION_ENV) {
            Ok(v) if v.trim().is_empty() => Ok(None),
            Ok(v) => Self::parse(&v).map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(format!("invalid {ACT_PRECISION_ENV}: not UTF-8; accepted values are {}", Self::ACCEPTED))
            }
        }
    }

    /// The name reports use: `int16`, `int8`, `f32`.
    pub fn as_str(self) -> &'static str {
        match self {
            ActScheme::Int16 => "int16",
            ActScheme::Int8 => "int8",
            ActScheme::Int16Wide8 => "int16-wide8",
            ActScheme::F32 => "f32",
            ActScheme::F16 => "f16",
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

/// Read back by its name, as [`ActScheme::parse`] takes it (a report's `act_scheme`).
impl<'de> serde::Deserialize<'de> for ActScheme {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        ActScheme::parse(&name).map_err(serde::de::Error::custom)
    }
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
