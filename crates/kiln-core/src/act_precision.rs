//! The process-wide activation scheme of the 4- and 8-bit kernels, read once from
//! `KILN_ACT_PRECISION` (the [`ActScheme`] knob itself, its names and its parse, is
//! kiln-protocol's, so the harness reads the same list).
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

pub use kiln_protocol::{ACT_PRECISION_ENV, ActScheme};

/// The scheme of this process: `KILN_ACT_PRECISION` read once. A bad value, and `f16`
/// (the device backends' scheme, which these kernels do not run), fall back to the
/// default here: the `kiln` binary refuses both before any kernel runs (for `f16`, its
/// check of the backend's capabilities).
pub fn act_scheme() -> ActScheme {
    static SCHEME: OnceLock<ActScheme> = OnceLock::new();
    *SCHEME.get_or_init(|| match ActScheme::from_env() {
        Ok(ActScheme::F16) | Err(_) => ActScheme::Int16,
        Ok(s) => s,
    })
}
