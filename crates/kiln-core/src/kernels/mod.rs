//! Quantized matrix kernels and their dispatcher.
//!
//! `quantized_matmul(x[M, K], W[N, K]) -> y[M, N]` picks:
//! - M = 1: `qmv`, one activation row per pass over the weights;
//! - 2 <= M < `qmv_batch_limit(K, N)`: `qmv_wide` (one pass, each weight group reused for
//!   every row of a tile) when the process-wide switch is on and the measured crossover
//!   ([`crate::crossover`]) says it beats `qmv` once per row at this M (or `KILN_QMV_WIDE`
//!   pins it on), else `qmv` once per row;
//! - M >= the limit: `qmm`, a tiled GEMM.
//!
//! **How they compute.** For 4- and 8-bit weights every kernel, on every ISA, follows one
//! integer scheme: the activations of each weight group are quantized to integer codes
//! with one f32 scale `sx_g` per group and row (16-bit codes by default; 8-bit codes for
//! 4-bit weights under `KILN_ACT_PRECISION=int8`, see [`crate::act_precision`]), the
//! group's dot product is an exact integer sum, and
//! `y = sum_g s_g * sx_g * (sum_j q_j xq_j - c sum_j xq_j) + (b_g + c s_g) * xsum_g`, with the
//! weight codes centred on `c = 2^(bits - 1)` (which halves the activations' rounding error)
//! and `xsum_g` the exact group sum, is accumulated in one fixed float order.
//! So `qmv`, `qmv_wide` and `qmm` give bit-identical rows, on AVX2, NEON and the portable
//! path alike, under each scheme; [`reference::qmv_int`] defines the result exactly. The
//! price is the activation rounding, at most half a code step per element (see
//! [`ActivationPrecision`]). The opt-in `KILN_ACT_PRECISION=int16-wide8` breaks the
//! identity on purpose: `qmv_wide` then gives 4-bit weights 8-bit codes (one `maddubs`
//! plane, about half the wide kernel's integer work) while `qmv` and `qmm` keep 16-bit
//! ones, so a batched row equals [`reference::qmv_int`] under `int8` and a row run alone
//! equals it under `int16`. `KILN_ACT_PRECISION=f32` turns the integer scheme off for
//! every width, as the reference for quality measurements. Other widths (2, 3, 5, 6 bits)
//! keep f32 activations: `qmv` and `qmv_wide` share one per-row loop, and `qmm`
//! dequantizes tiles to f32 for `matrixmultiply::sgemm`.
//!
//! All kernels thread with rayon over weight rows, on the current pool: run inside a
//! one-thread pool's `install` for a single-thread measurement.
//!
//! This module is the only place that detects CPU features ([`Isa`], cached after the
//! first call); the memory bandwidth probe (`bandwidth.rs`) asks it too, and only
//! compiles its own AVX2 loop under `cfg(target_arch)`.

pub mod attn;
pub mod reference;

mod act;
mod drive;
#[cfg(target_arch = "x86_64")]
#[doc(hidden)]
pub mod emulated;
mod isa;
#[cfg(target_arch = "aarch64")]
mod neon;
mod part;
mod portable;
#[cfg(target_arch = "x86_64")]
mod tile;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::sync::OnceLock;

pub use self::isa::{CpuFeatures, Isa};
pub use self::part::QmvPart;
use self::part::add_bias;
use crate::act_precision::{ActScheme, act_scheme};
use crate::matrix::{Layout, QuantizedMatrix};
use crate::wide::{crossover, qmv_wide_enabled, qmv_wide_pinned_by_operator, wide_for};

/// Which kernel runs a product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelChoice {
    /// One activation row, one pass.
    Qmv,
    /// The wide switch is off: `qmv` once per activation row.
    QmvPerRow,
    /// Several rows per pass over the weights.
    QmvWide,
    /// Tiled GEMM.
    Qmm,
}

/// How the kernels treat activations for a weight width: what their error depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ActivationPrecision {
    /// f32 activations: only f32 rounding (2-, 3-, 5-, 6-bit weights, or
    /// `KILN_ACT_PRECISION=f32`).
    F32,
    /// 8-bit codes per group: `sx = max|x| / 127`, `|x - sx * xq| <= sx / 2` (4-bit weights
    /// under `int8`, codes centred on 8: a group's error is at most
    /// `|s| * sum_j |q_j - 8| * sx / 2`).
    Int8,
    /// 16-bit codes per group for 4-bit weights (`int16`, the default):
    /// `sx = max|x| / 32512`, `|x - sx * xq| <= sx / 2`, codes centred on 8.
    Int16Split,
    /// 16-bit codes per group: `sx = max|x| / 32767`, `|x - sx * xq| <= sx / 2` (8-bit
    /// weights, codes centred on 128).
    Int16,
}

impl ActivationPrecision {
    /// The precision for `bits`-bit weights under this process's scheme (the same on every
    /// ISA and for every kernel).
    pub fn for_bits(bits: u32) -> ActivationPrecision {
        Self::for_scheme(bits, act_scheme())
    }

    /// The precision for `bits`-bit weights under `scheme`.
    pub fn for_scheme(bits: u32, scheme: ActScheme) -> ActivationPrecision {
        match act::ActCodes::for_weight_bits(bits, scheme) {
            Some(act::ActCodes::I8Deinterleaved) => ActivationPrecision::Int8,
            Some(act::ActCodes::I16Split) => ActivationPrecision::Int16Split,
            Some(act::ActCodes::I16) => ActivationPrecision::Int16,
            None => ActivationPrecision::F32,
        }
    }

    /// The largest activation code, `None` for f32: a group's scale is `max|x| / code`.
    pub fn max_code(self) -> Option<f32> {
        match self {
            ActivationPrecision::F32 => None,
            ActivationPrecision::Int8 => Some(act::I8_MAX),
            ActivationPrecision::Int16Split => Some(act::I16_SPLIT_MAX),
            ActivationPrecision::Int16 => Some(act::I16_MAX),
        }
    }
}

/// The smallest M for which `qmm` runs instead of the vector kernels: 16, for every shape.
///
/// Set from the crossover benchmark (`cargo bench -p kiln-benches --bench crossover`, see
/// docs/benchmarks.md), at M from 4 to 128 on n4864_k896, n4096_k4096 and n14336_k4096,
/// 4- and 8-bit, all threads. Up to M = 8 the integer `qmm` and `qmv_wide` are the same
/// computation (one tile of rows, so their loop orders coincide); from 9 to 15 they are
/// within the measurement's noise; from 16 on `qmm`, which keeps each tile of activation
/// rows hot while it walks a cache-sized block of weight rows, was faster on every shape
/// and width, by a few percent at 16 and 10-20% at 64-128. The f32 alternative
/// ([`qmm_sgemm`]) was 3-20x slower than both at every M measured, so no shape has a later
/// crossover. The shape parameters stay so an ISA whose crossover moves with K or N can
/// say so.
pub fn qmv_batch_limit(_k: usize, _n: usize) -> usize {
    16
}

/// The kernel [`quantized_matmul`] runs for an `[m, k] x [n, k]^T` product now (it
/// depends on the wide switch and, unless `KILN_QMV_WIDE` pins it, on the measured
/// crossover: see [`crate::wide`] and [`crate::crossover`]).
pub fn select_kernel(m: usize, k: usize, n: usize) -> KernelChoice {
    if m <= 1 {
        KernelChoice::Qmv
    } else if m < qmv_batch_limit(k, n) {
        if wide_for(m, qmv_wide_enabled(), qmv_wide_pinned_by_operator(), crossover()) {
            KernelChoice::QmvWide
        } else {
            KernelChoice::QmvPerRow
        }
    } else {
        KernelChoice::Qmm
    }
}

fn check_shapes(what: &str, x: &[f32], m: usize, w: &QuantizedMatrix, y: &[f32]) {
    assert_eq!(x.len(), m * w.k(), "{what}: x must hold m * K = {} * {} values", m, w.k());
    assert_eq!(y.len(), m * w.n(), "{what}: y must hold m * N = {} * {} values", m, w.n());
}

fn check_isa(what: &str, isa: Isa) {
    assert!(isa.is_available(), "{what}: the {} kernels cannot run on this CPU", isa.as_str());
}

/// `y[m, n] = x[m, k] W^T`, dispatched as the module documentation says.
pub fn quantized_matmul(x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32]) {
    check_shapes("quantized_matmul", x, m, w, y);
    match select_kernel(m, w.k(), w.n()) {
        KernelChoice::Qmv => qmv(x, w, y),
        KernelChoice::QmvPerRow => {
            let (k, n) = (w.k(), w.n());
            for (xr, yr) in x.chunks_exact(k).zip(y.chunks_exact_mut(n)) {
                qmv(xr, w, yr);
            }
        }
        KernelChoice::QmvWide => qmv_wide(x, m, w, y),
        KernelChoice::Qmm => qmm(x, m, w, y),
    }
}

/// One activation row: `y[n] = W x`.
pub fn qmv(x: &[f32], w: &QuantizedMatrix, y: &mut [f32]) {
    qmv_on(Isa::detected(), x, w, y)
}

/// Several activation rows in one pass over the weights.
pub fn qmv_wide(x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32]) {
    qmv_wide_on(Isa::detected(), x, m, w, y)
}

/// Tiled GEMM for large M.
pub fn qmm(x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32]) {
    qmm_on(Isa::detected(), x, m, w, y)
}

/// The codes of the integer scheme `w` runs under `scheme`, if its width has one and
/// `scheme` is not `f32`.
fn integer_codes(w: &QuantizedMatrix, scheme: ActScheme) -> Option<act::ActCodes> {
    act::ActCodes::for_weight_bits(w.spec().bits(), scheme)
}

/// [`qmv`] on a chosen path (tests and benchmarks compare paths with it).
///
/// # Panics
/// When `isa` is not available on this CPU, or the shapes do not match.
pub fn qmv_on(isa: Isa, x: &[f32], w: &QuantizedMatrix, y: &mut [f32]) {
    qmv_scheme_on(isa, act_scheme(), x, w, y)
}

/// [`qmv_on`] under a chosen activation scheme instead of this process's.
///
/// # Panics
/// As [`qmv_on`].
pub fn qmv_scheme_on(isa: Isa, scheme: ActScheme, x: &[f32], w: &QuantizedMatrix, y: &mut [f32]) {
    check_shapes("qmv", x, 1, w, y);
    check_isa("qmv", isa);
    if w.layout() == Layout::LaneRows {
        return lane_rows(isa, integer_codes(w, scheme), x, 1, w, y, |rm, y| {
            qmv_scheme_on(isa, scheme, x, rm, y)
        });
    }
    match (isa, integer_codes(w, scheme)) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512Vnni | Isa::Avx512 | Isa::Avx2, Some(codes)) => {
            // SAFETY: `check_isa` confirmed the path's features at run time.
            unsafe { x86::qmv(x86::Dots::of(isa), x, w, y, codes) }
        }
        #[cfg(target_arch = "aarch64")]
        (Isa::Neon, Some(codes)) => neon::matmul(x, 1, w, y, codes),
        (_, codes) => portable::matmul(x, 1, w, y, codes),
    }
}

/// Several `qmv`s of one activation row, in one parallel region: the decode step's q, k
/// and v (or gate and up) read the same normed row, so the row is quantized once and the
/// weight rows of every matrix are split across the pool together, which wakes the
/// threads once instead of once per matrix (see `drive::parts` for the task sizes).
///
/// Each output is bit-identical to [`qmv`] followed by `y[i] += bias[i]`: every row is
/// computed by the same kernel from the same codes, and a row's value does not depend on
/// the task it falls in.
///
/// # Panics
/// When a part's shapes do not match `x` or its bias.
pub fn qmv_many(x: &[f32], parts: &mut [QmvPart<'_>]) {
    qmv_many_on(Isa::detected(), x, parts)
}

/// [`qmv_many`] on a chosen path.
///
/// # Panics
/// When `isa` is not available on this CPU, or the shapes do not match.
pub fn qmv_many_on(isa: Isa, x: &[f32], parts: &mut [QmvPart<'_>]) {
    check_isa("qmv_many", isa);
    for p in parts.iter() {
        check_shapes("qmv_many", x, 1, p.w, p.y);
        if let Some(b) = p.bias {
            assert_eq!(b.len(), p.w.n(), "qmv_many: the bias must hold N = {} values", p.w.n());
        }
    }
    let scheme = act_scheme();
    let Some(first) = parts.first() else { return };
    let (codes, group) = (integer_codes(first.w, scheme), first.w.spec().group_size());
    let shared =
        parts.iter().all(|p| integer_codes(p.w, scheme) == codes && p.w.spec().group_size() == group);
    let lane_rows = parts.iter().any(|p| p.w.layout() == Layout::LaneRows);
    #[cfg(target_arch = "x86_64")]
    if let (Isa::Avx512Vnni | Isa::Avx512, Some(codes), true) = (isa, codes, shared)
        // At one row the lane-row kernel takes lane-row matrices only.
        && parts.iter().all(|p| x86::lanerows::takes(p.w, 1, codes))
    {
        // SAFETY: `check_isa` confirmed the path's features at run time; `takes` holds
        // for every part.
        return unsafe { x86::lanerows::many(isa == Isa::Avx512Vnni, x, parts, codes) };
    }
    match (isa, codes, shared && !lane_rows) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512Vnni | Isa::Avx512 | Isa::Avx2, Some(codes), true) => {
            // SAFETY: `check_isa` confirmed the path's features at run time.
            unsafe { x86::qmv_many(x86::Dots::of(isa), x, parts, codes) }
        }
        _ => {
            for p in parts.iter_mut() {
                qmv_scheme_on(isa, scheme, x, p.w, p.y);
                add_bias(p.bias, 0..p.w.n(), p.y);
            }
        }
    }
}

/// A product of `m` rows with a matrix in [`Layout::LaneRows`]: the AVX-512 lane-row kernel,
/// which reads that layout as stored, where it takes the product; else `row_major` on a
/// row-major copy (every other path reads rows; a matrix is only stored this way where
/// the lane-row kernel runs, so this is for tests and forced paths).
fn lane_rows(
    isa: Isa,
    codes: Option<act::ActCodes>,
    x: &[f32],
    m: usize,
    w: &QuantizedMatrix,
    y: &mut [f32],
    row_major: impl FnOnce(&QuantizedMatrix, &mut [f32]),
) {
    #[cfg(target_arch = "x86_64")]
    if let (Isa::Avx512Vnni | Isa::Avx512, Some(codes)) = (isa, codes)
        && x86::lanerows::takes(w, m, codes)
    {
        // SAFETY: the caller's `check_isa` confirmed the path's features at run time;
        // `takes` holds.
        return unsafe { x86::lanerows::matmul(isa == Isa::Avx512Vnni, x, m, w, y, codes) };
    }
    let _ = (isa, codes, x, m);
    row_major(&w.to_row_major(), y)
}

/// Whether the CPU backend should store 4-bit matrices in [`Layout::LaneRows`]: where
/// `KILN_WEIGHT_LAYOUT` leaves it to kiln (`auto`), this CPU runs the AVX-512 lane-row
/// kernel, and this process's activation scheme gives 4-bit weights codes it takes. There
/// the kernel reads each block of 16 rows with one load per word instead of transposing it
/// in registers for every product, which took `qmv_wide` at M = 2 from 1.45-1.48x the time
/// of `qmv` at M = 1 to 1.02-1.04x (docs/benchmarks.md, "The lane-row layout").
pub fn lane_rows_preferred() -> bool {
    use crate::matrix::LayoutSetting;
    static PREFERRED: OnceLock<bool> = OnceLock::new();
    *PREFERRED.get_or_init(|| {
        let setting = LayoutSetting::from_env().unwrap_or(LayoutSetting::Auto);
        let codes = act::ActCodes::for_weight_bits(4, act_scheme());
        let wide_codes = act::ActCodes::for_weight_bits(4, act_scheme().rows_scheme(2));
        let taken = |c: Option<act::ActCodes>| {
            matches!(c, Some(act::ActCodes::I8Deinterleaved | act::ActCodes::I16Split))
        };
        setting == LayoutSetting::Auto
            && matches!(Isa::detected(), Isa::Avx512Vnni | Isa::Avx512)
            && taken(codes)
            && taken(wide_codes)
    })
}

/// Stores `w` as the CPU backend stores its weights: reordered into [`Layout::LaneRows`]
/// where [`lane_rows_preferred`] and the matrix fits ([`QuantizedMatrix::into_lane_rows`]).
/// Returns whether it is now in that layout.
pub fn store_for_cpu(w: &mut QuantizedMatrix) -> bool {
    lane_rows_preferred() && w.into_lane_rows()
}

/// [`qmv_wide`] on a chosen path.
///
/// # Panics
/// When `isa` is not available on this CPU, or the shapes do not match.
pub fn qmv_wide_on(isa: Isa, x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32]) {
    qmv_wide_scheme_on(isa, act_scheme(), x, m, w, y)
}

/// [`qmv_wide_on`] under a chosen activation scheme (for `int16-wide8`, the codes of
/// [`ActScheme::rows_scheme`]`(m)`).
///
/// # Panics
/// As [`qmv_wide_on`].
pub fn qmv_wide_scheme_on(
    isa: Isa,
    scheme: ActScheme,
    x: &[f32],
    m: usize,
    w: &QuantizedMatrix,
    y: &mut [f32],
) {
    check_shapes("qmv_wide", x, m, w, y);
    check_isa("qmv_wide", isa);
    if w.layout() == Layout::LaneRows {
        let codes = integer_codes(w, scheme.rows_scheme(m));
        return lane_rows(isa, codes, x, m, w, y, |rm, y| qmv_wide_scheme_on(isa, scheme, x, m, rm, y));
    }
    // `int16-wide8` gives these rows 8-bit codes from two rows on.
    match (isa, integer_codes(w, scheme.rows_scheme(m))) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512Vnni | Isa::Avx512 | Isa::Avx2, Some(codes)) => {
            // SAFETY: `check_isa` confirmed the path's features at run time (AVX2, FMA
            // and F16C on every x86 path, and the AVX-512 ones its dots use).
            unsafe { x86::qmv_wide(x86::Dots::of(isa), x, m, w, y, codes) }
        }
        #[cfg(target_arch = "aarch64")]
        (Isa::Neon, Some(codes)) => neon::matmul(x, m, w, y, codes),
        (_, codes) => portable::matmul(x, m, w, y, codes),
    }
}

/// [`qmm`] on a chosen path.
///
/// # Panics
/// When `isa` is not available on this CPU, or the shapes do not match.
pub fn qmm_on(isa: Isa, x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32]) {
    qmm_scheme_on(isa, act_scheme(), x, m, w, y)
}

/// [`qmm_on`] under a chosen activation scheme.
///
/// # Panics
/// As [`qmm_on`].
pub fn qmm_scheme_on(isa: Isa, scheme: ActScheme, x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32]) {
    check_shapes("qmm", x, m, w, y);
    check_isa("qmm", isa);
    if w.layout() == Layout::LaneRows {
        return lane_rows(isa, integer_codes(w, scheme), x, m, w, y, |rm, y| {
            qmm_scheme_on(isa, scheme, x, m, rm, y)
        });
    }
    let Some(codes) = integer_codes(w, scheme) else {
        return portable::qmm_sgemm(x, m, w, y);
    };
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni | Isa::Avx512 | Isa::Avx2 => {
            // SAFETY: `check_isa` confirmed the path's features at run time (AVX2, FMA
            // and F16C on every x86 path, and the AVX-512 ones its dots use).
            unsafe { x86::qmm(x86::Dots::of(isa), x, m, w, y, codes) }
        }
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::matmul(x, m, w, y, codes),
        _ => portable::matmul(x, m, w, y, Some(codes)),
    }
}

/// `qmm` by dequantizing tiles of weight rows to f32 and multiplying them with
/// `matrixmultiply::sgemm`: f32 activations, any width. [`qmm`] uses it for widths without
/// an integer path; it is public so benchmarks can measure it against the integer `qmm`.
pub fn qmm_sgemm(x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32]) {
    check_shapes("qmm_sgemm", x, m, w, y);
    if w.layout() != Layout::RowMajor {
        // It dequantizes rows.
        return portable::qmm_sgemm(x, m, &w.to_row_major(), y);
    }
    portable::qmm_sgemm(x, m, w, y)
}

#[cfg(test)]
mod tests {
    /// The crate's sources, every `.rs` file under `src/`, as (path, text).
    fn sources() -> Vec<(std::path::PathBuf, String)> {
        let mut out = Vec::new();
        let mut dirs = vec![std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let text = std::fs::read_to_string(&path).unwrap();
                    out.push((path, text));
                }
            }
        }
        out
    }

    /// The AVX-512 dots are `inline(always)` functions with no target features of their
    /// own; a closure in them is a function of its own with none either, so its
    /// intrinsics become calls whenever the inliner does not fold it first. That happened
    /// once (single-stream decode at a third of its speed, every output still right), so
    /// the file keeps to loops and named `inline(always)` helpers.
    #[test]
    fn the_avx512_dots_hold_no_closures() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/kernels/x86/avx512.rs");
        let text = std::fs::read_to_string(&path).unwrap();
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            assert!(
                !code.contains("|(") && !code.contains("(|") && !code.contains("= |"),
                "{}:{}: a closure in the AVX-512 dots: {line}",
                path.display(),
                i + 1
            );
        }
    }

    #[test]
    fn cpu_features_are_detected_in_one_place() {
        let this = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/kernels/isa.rs");
        let needle = concat!("is_x86_feature", "_detected!");
        let needle_arm = concat!("is_aarch64_feature", "_detected!");
        for (path, text) in sources() {
            if path != this {
                assert!(
                    !text.contains(needle) && !text.contains(needle_arm),
                    "{} detects CPU features itself: ask kernels::Isa instead",
                    path.display()
                );
            }
        }
    }
}
