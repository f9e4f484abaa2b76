//! The fast kernels (`qmv`, `qmv_wide`, `qmm`, on every ISA path this CPU runs) against
//! the scalar references and against the exact product in f64, with tolerances derived
//! from the format below; the dispatcher and the wide switch; and the recorded answer to
//! "are `qmv_wide` and per-row `qmv` bit-identical?" (yes, on every path, under each
//! integer activation scheme, and equal to the bits `reference::qmv_int` defines).

mod common;

use std::sync::Mutex;

use kiln_core::act_precision::ActScheme;
use kiln_core::crossover::Crossover;
use kiln_core::format::{QuantSpec, SUPPORTED_BITS, write_code};
use kiln_core::kernels::{
    self, ActivationPrecision, Isa, KernelChoice, qmm_on, qmm_scheme_on, qmv_batch_limit, qmv_on,
    qmv_scheme_on, qmv_wide_on, qmv_wide_scheme_on, reference, select_kernel,
};
use kiln_core::matrix::{QuantizedMatrix, ScaleData, ScaleDtype};
use kiln_core::wide::{
    crossover, qmv_wide_enabled, qmv_wide_pinned_by_operator, set_crossover, set_qmv_wide, wide_for,
};
use kiln_core::{Buffer, quantized_matmul};

use common::Rng;

// ---------------------------------------------------------------------------------------
// Tolerances.
//
// Every bound is |computed - exact| <= bound, where "exact" is `reference::matmul_f64`:
// the f64 product of x with the *dequantized f32* weights w = fl(fl(s * q) + b).
//
// 1. Format term. The integer kernels and the f32-activation kernels compute with
//    s * q + b unrounded, so against the exact product of the rounded weights they differ
//    by sum_j |x_j| * |fl(fl(s q) + b) - (s q + b)| <= sum_j |x_j| * u * (2 |s| q_j + |b|)
//    (one rounding of s q, one of the sum, which is at most |s q| + |b| plus a u^2 term
//    that FORMAT_SLACK covers).
// 2. Activation term (integer scheme). Per group, sx = fl(amax / qmax),
//    inv = fl(qmax / amax) and xq_j = round(fl(x_j * inv)), so
//    sx * xq_j - x_j = sx * e + x_j * ((1 + e1)(1 + e2)(1 + e3) - 1) with |e| <= 1/2 and
//    |e_i| <= u: |x_j - sx xq_j| <= sx / 2 + ACT_ROUNDINGS * u * amax (times GAMMA_SLACK).
//    The kernels compute s * sx * sum_j (q_j - c) xq_j + (b + c s) * sum_j x_j with
//    c = 2^(bits - 1), exactly s q + b per element, so the activation rounding meets
//    s (q_j - c): the group contributes |s| * delta_g * sum_j |q_j - c|.
// 3. Accumulation term. Each path sums its terms through at most `depth` roundings;
//    with gamma_n = n u / (1 - n u) <= GAMMA_SLACK * n u (n u < 1% here), the error is
//    at most gamma_depth * sum of the terms' magnitudes:
//    - integer scheme: a term t * (s sx) or (b + c s) * xsum carries INT_TERM_ROUNDINGS
//      own roundings (cvt of the i32 sum and the s * sx product, or the fused b + c s and
//      the rounded xsum), then
//      2 FMAs per group in its lane (ceil(groups / 8) groups per lane) and the
//      LANE_TREE_ADDS of the final 8-lane sum;
//    - f32-activation scheme: G / 8 + 3 roundings for a group's 8-lane dot (one more for
//      the product), 2 for s * qx + b * xsum (plus the rounded xsum), 1 per group into the
//      sequential accumulator;
//    - sgemm and the scalar reference: dot products of length K over the rounded weights:
//      K products and K - 1 additions in some order, so K + 1 roundings suffice.
// ---------------------------------------------------------------------------------------

/// f32 unit roundoff, 2^-24.
const U: f64 = f32::EPSILON as f64 / 2.0;
/// gamma_n <= GAMMA_SLACK * n * u while n * u <= 0.0099 (n here is at most a few thousand).
const GAMMA_SLACK: f64 = 1.01;
/// Covers the u^2 terms of the format bound.
const FORMAT_SLACK: f64 = 1.0 + 4.0 * U;
/// f32 roundings in an activation code's reconstruction: inv, x * inv, sx.
const ACT_ROUNDINGS: f64 = 3.0;
/// Own roundings of an integer-scheme term before accumulation.
const INT_TERM_ROUNDINGS: f64 = 2.0;
/// Additions in the final sum of eight lanes.
const LANE_TREE_ADDS: f64 = 3.0;
/// Own roundings of an f32-activation group term beyond its dot: s * qx, b * xsum, their
/// sum, and the rounded xsum.
const F32_TERM_ROUNDINGS: f64 = 4.0;

/// Which computation a result came from, for its bound.
#[derive(Clone, Copy, Debug)]
enum Scheme {
    /// Quantized activations (4- and 8-bit weights, every kernel and ISA), weight codes
    /// centred on `center`.
    Integer { qmax: f64, center: f64 },
    /// f32 activations, per-group loop (other widths, `qmv` and `qmv_wide`).
    F32Groups,
    /// Dequantized f32 weights, dot products of length K (`sgemm`, the reference).
    DequantDot,
}

fn scheme_for(bits: u32, act: ActScheme) -> Scheme {
    match ActivationPrecision::for_scheme(bits, act).max_code() {
        Some(qmax) => Scheme::Integer { qmax: f64::from(qmax), center: f64::from(1u32 << (bits - 1)) },
        None => Scheme::F32Groups,
    }
}

/// A test case: W, x and everything the bounds need.
struct Case {
    w: QuantizedMatrix,
    codes: Vec<u32>,
    s: Vec<f64>,
    b: Vec<f64>,
    deq: Vec<f32>,
    x: Vec<f32>,
    m: usize,
    exact: Vec<f64>,
}

impl Case {
    fn new(n: usize, k: usize, m: usize, bits: u32, g: usize, dtype: ScaleDtype, seed: u64) -> Case {
        let spec = QuantSpec::new(bits, g).unwrap();
        let mut rng = Rng(seed);
        let gpr = k / g;
        let mut packed = vec![0u32; n * spec.words_per_row(k)];
        let mut codes = vec![0u32; n * k];
        for r in 0..n {
            let row = &mut packed[r * spec.words_per_row(k)..(r + 1) * spec.words_per_row(k)];
            for j in 0..k {
                let c = (rng.next() % u64::from(spec.max_code() + 1)) as u32;
                codes[r * k + j] = c;
                write_code(row, j, bits, c);
            }
        }
        // Scales of both signs (MLX makes them negative when the larger extreme is), and
        // biases of the size quantized weights have.
        let scales: Vec<f32> =
            (0..n * gpr).map(|_| rng.sym(0.05) + 0.001f32.copysign(rng.sym(1.0))).collect();
        let biases: Vec<f32> = (0..n * gpr).map(|_| rng.sym(0.6)).collect();
        let sd = ScaleData::from_f32(&scales, dtype);
        let bd = ScaleData::from_f32(&biases, dtype);
        let s: Vec<f64> = (0..n * gpr).map(|i| f64::from(sd.get(i))).collect();
        let b: Vec<f64> = (0..n * gpr).map(|i| f64::from(bd.get(i))).collect();
        let w = QuantizedMatrix::new(n, k, spec, Buffer::from(packed), sd, bd).unwrap();
        // Activations with an outlier now and then, as real ones have.
        let x: Vec<f32> = (0..m * k).map(|i| if i % 97 == 5 { rng.sym(8.0) } else { rng.sym(1.0) }).collect();
        let deq = reference::dequantize(&w);
        let exact = reference::matmul_f64(&x, m, &w);
        Case { w, codes, s, b, deq, x, m, exact }
    }

    /// The bound on |computed - exact| for output (i, r) of a result from `scheme`.
    fn bound(&self, scheme: Scheme, i: usize, r: usize) -> f64 {
        let (k, g) = (self.w.k(), self.w.spec().group_size());
        let gpr = k / g;
        let xr = &self.x[i * k..(i + 1) * k];
        let mut format = 0f64;
        let mut act = 0f64;
        let mut magnitude = 0f64;
        let mut dot_magnitude = 0f64;
        for gi in 0..gpr {
            let (s, b) = (self.s[r * gpr + gi], self.b[r * gpr + gi]);
            let span = gi * g..(gi + 1) * g;
            let xs = &xr[span.clone()];
            let qs = &self.codes[r * k + gi * g..r * k + (gi + 1) * g];
            let amax = xs.iter().fold(0f64, |a, &v| a.max(f64::from(v).abs()));
            let sum_abs_x: f64 = xs.iter().map(|&v| f64::from(v).abs()).sum();
            let sum_q_abs_x: f64 = qs.iter().zip(xs).map(|(&q, &v)| f64::from(q) * f64::from(v).abs()).sum();
            format += U * FORMAT_SLACK * (2.0 * s.abs() * sum_q_abs_x + b.abs() * sum_abs_x);
            let deq = &self.deq[r * k + gi * g..r * k + (gi + 1) * g];
            dot_magnitude +=
                deq.iter().zip(xs).map(|(&w, &v)| f64::from(w).abs() * f64::from(v).abs()).sum::<f64>();
            match scheme {
                Scheme::Integer { qmax, center } => {
                    let delta = GAMMA_SLACK * (amax / qmax * (1.0 + U) / 2.0 + ACT_ROUNDINGS * U * amax);
                    let sum_dq: f64 = qs.iter().map(|&q| (f64::from(q) - center).abs()).sum();
                    let sum_dq_abs_x: f64 = qs
                        .iter()
                        .zip(xs)
                        .map(|(&q, &v)| (f64::from(q) - center).abs() * f64::from(v).abs())
                        .sum();
                    act += s.abs() * delta * sum_dq;
                    // |s sx t| <= |s| sum_j |q_j - c| (|x_j| + delta),
                    // |(b + c s) xsum| <= (|b| + c |s|) sum |x| (its rounding is counted).
                    magnitude +=
                        s.abs() * (sum_dq_abs_x + delta * sum_dq) + (b.abs() + center * s.abs()) * sum_abs_x;
                }
                Scheme::F32Groups => magnitude += s.abs() * sum_q_abs_x + b.abs() * sum_abs_x,
                Scheme::DequantDot => {}
            }
        }
        let gpr = gpr as f64;
        match scheme {
            Scheme::Integer { .. } => {
                let depth = INT_TERM_ROUNDINGS + 2.0 * (gpr / 8.0).ceil() + LANE_TREE_ADDS;
                format + act + GAMMA_SLACK * depth * U * magnitude
            }
            Scheme::F32Groups => {
                let depth = (g / 8) as f64 + LANE_TREE_ADDS + 1.0 + F32_TERM_ROUNDINGS + gpr;
                format + GAMMA_SLACK * depth * U * magnitude
            }
            Scheme::DequantDot => GAMMA_SLACK * (k as f64 + 1.0) * U * dot_magnitude,
        }
    }

    /// Asserts `y` within `scheme`'s bound of the exact product, and within the sum of
    /// both bounds of the scalar reference's result.
    fn check(&self, what: &str, scheme: Scheme, y: &[f32], reference_y: &[f32]) {
        let n = self.w.n();
        for i in 0..self.m {
            for r in 0..n {
                let idx = i * n + r;
                let bound = self.bound(scheme, i, r);
                let err = (f64::from(y[idx]) - self.exact[idx]).abs();
                assert!(
                    err <= bound,
                    "{what}: y[{i}, {r}] = {} but exact {} (error {err:.3e} > bound {bound:.3e})",
                    y[idx],
                    self.exact[idx]
                );
                let ref_bound = bound + self.bound(Scheme::DequantDot, i, r);
                let diff = (f64::from(y[idx]) - f64::from(reference_y[idx])).abs();
                assert!(
                    diff <= ref_bound,
                    "{what}: y[{i}, {r}] = {} but reference {} (difference {diff:.3e} > {ref_bound:.3e})",
                    y[idx],
                    reference_y[idx]
                );
            }
        }
    }

    fn label(&self, kernel: &str, isa: Isa) -> String {
        let spec = self.w.spec();
        format!(
            "{kernel} on {} ({spec}, {} scales, n {} k {} m {})",
            isa.as_str(),
            self.w.scales().dtype().as_str(),
            self.w.n(),
            self.w.k(),
            self.m
        )
    }
}

/// Set to 1 to run a reduced grid of shapes: every kernel, width, group size, path and
/// tail still runs, on fewer activation row counts and scale dtypes. CI sets it for the
/// aarch64 run under qemu, where the full grid takes far too long
/// (docs/environment-variables.md).
const QUICK_ENV: &str = "KILN_QUICK_KERNEL_TESTS";

fn quick() -> bool {
    std::env::var_os(QUICK_ENV).is_some_and(|v| v == "1")
}

/// The scale dtypes tried for the `i`-th input width: all three on the first width, f16
/// alone on the others in quick mode.
fn dtypes(i: usize) -> &'static [ScaleDtype] {
    if quick() && i > 0 { &DTYPES[..1] } else { &DTYPES }
}

/// Input widths (multiples of the group size) that exercise every tail: one group, fewer
/// than eight, more than eight with a remainder, and for g32 an odd number of groups
/// (a trailing half block of 4-bit codes).
fn ks(g: usize) -> Vec<usize> {
    let mut v = vec![g, 3 * g, 14 * g];
    if g == 32 {
        v.push(9 * 32);
    }
    v
}

/// Activation rows tried for each shape; `all_m` runs every M from 1 to 33.
fn ms(all_m: bool) -> Vec<usize> {
    if quick() {
        // One row, a small tile, a full tile plus one, and two tiles plus one.
        vec![1, 3, 9, 17]
    } else if all_m {
        (1..=33).collect()
    } else {
        vec![1, 2, 3, 5, 8, 9, 12, 16, 17, 33]
    }
}

const DTYPES: [ScaleDtype; 3] = [ScaleDtype::F16, ScaleDtype::Bf16, ScaleDtype::F32];

/// The integer activation schemes that differ for `bits`-bit weights: both for 4 bits,
/// `int16` alone for 8 bits (whose codes are 16-bit under both).
fn int_schemes(bits: u32) -> &'static [ActScheme] {
    if bits == 4 { &[ActScheme::Int16, ActScheme::Int8] } else { &[ActScheme::Int16] }
}

/// Runs each kernel on each available path for one case under activation scheme `act`;
/// returns the outputs of every kernel and path, so callers can compare them bit for bit.
fn run_all(case: &Case, act: ActScheme) -> Vec<(String, Vec<f32>)> {
    let (n, k, m) = (case.w.n(), case.w.k(), case.m);
    let mut out = Vec::new();
    let tag = |what: &str, isa| format!("{} [{}]", case.label(what, isa), act.as_str());
    for isa in Isa::available() {
        let mut per_row = vec![0f32; m * n];
        for (xr, yr) in case.x.chunks_exact(k).zip(per_row.chunks_exact_mut(n)) {
            qmv_scheme_on(isa, act, xr, &case.w, yr);
        }
        out.push((tag("qmv per row", isa), per_row));
        let mut wide = vec![0f32; m * n];
        qmv_wide_scheme_on(isa, act, &case.x, m, &case.w, &mut wide);
        out.push((tag("qmv_wide", isa), wide));
        let mut mm = vec![0f32; m * n];
        qmm_scheme_on(isa, act, &case.x, m, &case.w, &mut mm);
        out.push((tag("qmm", isa), mm));
    }
    out
}

fn reference_y(case: &Case) -> Vec<f32> {
    let mut y = vec![0f32; case.m * case.w.n()];
    reference::qmm(&case.x, case.m, &case.w, &mut y);
    y
}

fn bits_identical(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
}

#[test]
fn integer_kernels_stay_within_the_derived_bound() {
    let mut seed = 1;
    for bits in [4, 8] {
        for g in [32, 64, 128] {
            for (ki, k) in ks(g).into_iter().enumerate() {
                for (di, &dtype) in dtypes(ki).iter().enumerate() {
                    // Every M from 1 to 33 on one shape per width and group size.
                    let all_m = di == 0 && ki == 1;
                    for m in ms(all_m) {
                        seed += 1;
                        let case = Case::new(37, k, m, bits, g, dtype, seed);
                        let refy = reference_y(&case);
                        for &act in int_schemes(bits) {
                            let scheme = scheme_for(bits, act);
                            for (what, y) in run_all(&case, act) {
                                case.check(&what, scheme, &y, &refy);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The recorded answer: on every path and under each integer activation scheme,
/// `qmv_wide`, per-row `qmv` and `qmm` give bit-identical outputs for 4- and 8-bit weights
/// (one integer scheme, one float order), every path gives the same bits as every other,
/// and those bits are the ones the scalar definition `reference::qmv_int` computes.
#[test]
fn qmv_wide_and_per_row_qmv_are_bit_identical() {
    let mut seed = 1000;
    for bits in [4, 8] {
        for g in [32, 64, 128] {
            for (ki, k) in ks(g).into_iter().enumerate() {
                for &dtype in dtypes(ki) {
                    // 40 rows: `qmm` quantizes its tiles on the pool from 32 rows on.
                    let rows: &[usize] = if quick() { &[2, 9, 17, 40] } else { &[2, 3, 8, 9, 17, 40] };
                    for &m in rows {
                        seed += 1;
                        let case = Case::new(21, k, m, bits, g, dtype, seed);
                        for &act in int_schemes(bits) {
                            let defined = reference::qmv_int(&case.x, m, &case.w, act).unwrap();
                            for (what, y) in &run_all(&case, act) {
                                assert!(
                                    bits_identical(&defined, y),
                                    "{what} differs from reference::qmv_int"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// `int16-wide8`: `qmv_wide` over two rows or more gives 4-bit weights `int8`'s bits, a
/// row run alone (`qmv`, and `qmv_wide` over one row) and `qmm` keep `int16`'s, each
/// equal to `reference::qmv_int` under that scheme on every path; so for 4-bit weights
/// the wide kernel is not interchangeable with per-row `qmv` under this scheme, while
/// 8-bit weights run identically to `int16`.
#[test]
fn int16_wide8_gives_wide_rows_int8_codes_and_single_rows_int16() {
    let act = ActScheme::Int16Wide8;
    let mut seed = 5000;
    for bits in [4, 8] {
        for g in [32, 64, 128] {
            let k = ks(g)[1];
            for m in [1, 2, 3, 5, 8, 9, 17] {
                seed += 1;
                let case = Case::new(19, k, m, bits, g, ScaleDtype::F16, seed);
                let n = case.w.n();
                let single = reference::qmv_int(&case.x, m, &case.w, ActScheme::Int16).unwrap();
                let wide_rows = if m >= 2 && bits == 4 { ActScheme::Int8 } else { ActScheme::Int16 };
                let wide_def = reference::qmv_int(&case.x, m, &case.w, wide_rows).unwrap();
                assert!(bits_identical(
                    &reference::qmv_wide_int(&case.x, m, &case.w, act).unwrap(),
                    &wide_def
                ));
                assert!(bits_identical(&reference::qmv_int(&case.x, m, &case.w, act).unwrap(), &single));
                let refy = reference_y(&case);
                for isa in Isa::available() {
                    let what = |k: &str| format!("{} [int16-wide8]", case.label(k, isa));
                    let mut per_row = vec![0f32; m * n];
                    for (xr, yr) in case.x.chunks_exact(k).zip(per_row.chunks_exact_mut(n)) {
                        qmv_scheme_on(isa, act, xr, &case.w, yr);
                    }
                    assert!(bits_identical(&per_row, &single), "{}", what("qmv per row"));
                    let mut mm = vec![0f32; m * n];
                    qmm_scheme_on(isa, act, &case.x, m, &case.w, &mut mm);
                    assert!(bits_identical(&mm, &single), "{}", what("qmm"));
                    let mut wide = vec![0f32; m * n];
                    qmv_wide_scheme_on(isa, act, &case.x, m, &case.w, &mut wide);
                    assert!(bits_identical(&wide, &wide_def), "{}", what("qmv_wide"));
                    case.check(&what("qmv_wide"), scheme_for(bits, wide_rows), &wide, &refy);
                    if m >= 2 && bits == 4 {
                        assert!(
                            !bits_identical(&wide, &per_row),
                            "{}: no row rounded differently",
                            what("qmv_wide")
                        );
                    }
                }
            }
        }
    }
}

/// Rows of Llama-sized width (more than 8192 elements, where the activation codes no
/// longer sit in L1 beside the weights), with a partial last step of five groups: exact
/// against the other paths and within the bound.
#[test]
fn long_rows_stay_exact() {
    for bits in [4, 8] {
        for g in [32, 64, 128] {
            for (i, &dtype) in dtypes(1).iter().enumerate() {
                let k = 8192 + 13 * g;
                let case = Case::new(19, k, 2, bits, g, dtype, 7000 + 10 * g as u64 + i as u64);
                let refy = reference_y(&case);
                for &act in int_schemes(bits) {
                    let results = run_all(&case, act);
                    for (what, y) in &results {
                        case.check(what, scheme_for(bits, act), y, &refy);
                    }
                    let (first_what, first) = &results[0];
                    for (what, y) in &results[1..] {
                        assert!(bits_identical(first, y), "{what} differs in its bits from {first_what}");
                    }
                }
            }
        }
    }
}

#[test]
fn other_widths_take_f32_activations_within_their_bound() {
    let mut seed = 5000;
    for bits in SUPPORTED_BITS.into_iter().filter(|b| ![4, 8].contains(b)) {
        assert_eq!(ActivationPrecision::for_bits(bits), ActivationPrecision::F32);
        for g in [32, 64, 128] {
            // These widths take the portable loops on every path: quick mode tries the
            // shortest and the longest input width only.
            let widths = ks(g);
            let widths = if quick() { vec![widths[0], widths[2]] } else { widths };
            for (ki, k) in widths.into_iter().enumerate() {
                for &dtype in dtypes(ki) {
                    let rows: &[usize] = if quick() { &[1, 9] } else { &[1, 2, 5, 9, 33] };
                    for &m in rows {
                        seed += 1;
                        let case = Case::new(19, k, m, bits, g, dtype, seed);
                        let refy = reference_y(&case);
                        for isa in Isa::available() {
                            let (n, kk) = (case.w.n(), case.w.k());
                            let mut per_row = vec![0f32; m * n];
                            for (xr, yr) in case.x.chunks_exact(kk).zip(per_row.chunks_exact_mut(n)) {
                                qmv_on(isa, xr, &case.w, yr);
                            }
                            case.check(&case.label("qmv per row", isa), Scheme::F32Groups, &per_row, &refy);
                            let mut wide = vec![0f32; m * n];
                            qmv_wide_on(isa, &case.x, m, &case.w, &mut wide);
                            case.check(&case.label("qmv_wide", isa), Scheme::F32Groups, &wide, &refy);
                            // The same per-row loop: bit-identical here too.
                            assert!(
                                bits_identical(&per_row, &wide),
                                "{}",
                                case.label("qmv_wide vs qmv", isa)
                            );
                            let mut mm = vec![0f32; m * n];
                            qmm_on(isa, &case.x, m, &case.w, &mut mm);
                            case.check(&case.label("qmm (sgemm)", isa), Scheme::DequantDot, &mm, &refy);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn sgemm_qmm_on_four_and_eight_bits_is_f32_exact_to_its_bound() {
    for (i, bits) in [4, 8].into_iter().enumerate() {
        for m in [1, 16, 33] {
            let case = Case::new(45, 448, m, bits, 64, ScaleDtype::F16, 9000 + i as u64 * 100 + m as u64);
            let mut y = vec![0f32; m * case.w.n()];
            kernels::qmm_sgemm(&case.x, m, &case.w, &mut y);
            case.check("qmm_sgemm", Scheme::DequantDot, &y, &reference_y(&case));
        }
    }
}

/// Worst-case codes: every weight code at its maximum and every activation at the
/// group's maximum magnitude, so the integer sums reach their largest values (4-bit
/// `int8`: 8 products of 15 * 127 per i16 lane at g128; `int16`: 128 * 15 * 32512 per
/// group, and a low plane of -128 everywhere; 8-bit: 128 * 255 * 32767 per group).
#[test]
fn extreme_codes_do_not_overflow_the_integer_sums() {
    for bits in [4, 8] {
        for g in [32, 64, 128] {
            let spec = QuantSpec::new(bits, g).unwrap();
            let (n, k) = (9, 4 * g);
            let mut packed = vec![0u32; n * spec.words_per_row(k)];
            for row in packed.chunks_exact_mut(spec.words_per_row(k)) {
                for j in 0..k {
                    write_code(row, j, bits, spec.max_code());
                }
            }
            let gpr = k / g;
            let w = QuantizedMatrix::new(
                n,
                k,
                spec,
                Buffer::from(packed),
                ScaleData::from_f32(&vec![0.5; n * gpr], ScaleDtype::F32),
                ScaleData::from_f32(&vec![-1.0; n * gpr], ScaleDtype::F32),
            )
            .unwrap();
            for &act in int_schemes(bits) {
                for sign in [1.0f32, -1.0] {
                    let x = vec![3.0 * sign; 2 * k];
                    // Each output: k * (0.5 * max_code - 1) * 3 * sign, exact in f32.
                    let want = k as f32 * (0.5 * spec.max_code() as f32 - 1.0) * 3.0 * sign;
                    // All but each group's first activation at the `int16` code
                    // 32384 = 256 * 127 - 128: its low plane is -128 everywhere.
                    let mut low = x.clone();
                    for (j, v) in low.iter_mut().enumerate() {
                        if j % g != 0 {
                            *v *= 32384.0 / 32512.0;
                        }
                    }
                    let low_want = reference::qmv_int(&low, 2, &w, act).unwrap();
                    for isa in Isa::available() {
                        let mut y = vec![0f32; 2 * n];
                        qmv_wide_scheme_on(isa, act, &x, 2, &w, &mut y);
                        let mut y1 = vec![0f32; n];
                        qmv_scheme_on(isa, act, &x[..k], &w, &mut y1);
                        for v in y.iter().chain(&y1) {
                            assert!(
                                (v - want).abs() <= want.abs() * 1e-6,
                                "{bits}-bit g{g} {act:?} on {isa:?}: {v} != {want}"
                            );
                        }
                        qmv_wide_scheme_on(isa, act, &low, 2, &w, &mut y);
                        qmv_scheme_on(isa, act, &low[..k], &w, &mut y1);
                        assert!(
                            bits_identical(&y, &low_want) && bits_identical(&y1, &low_want[..n]),
                            "{bits}-bit g{g} {act:?} on {isa:?}: {y:?} {y1:?} != {low_want:?}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn non_finite_activations_give_non_finite_outputs() {
    for bits in [2, 4, 8] {
        let mut case = Case::new(5, 128, 2, bits, 64, ScaleDtype::F16, 77);
        case.x[3] = f32::NAN;
        case.x[128 + 70] = f32::INFINITY;
        for (what, y) in ActScheme::ALL.iter().flat_map(|&act| run_all(&case, act)) {
            for r in 0..5 {
                assert!(!y[r].is_finite() && !y[5 + r].is_finite(), "{what}: row {r} is finite");
            }
        }
    }
}

/// The switch is process-global: every test that sets it holds this lock.
static SWITCH: Mutex<()> = Mutex::new(());

#[test]
fn dispatch_follows_the_batch_limit_and_the_wide_switch() {
    let _guard = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let before = qmv_wide_enabled();
    let (k, n) = (256, 40);
    let limit = qmv_batch_limit(k, n);
    assert!(limit > 2, "the limit must leave room for qmv_wide");
    for on in [true, false] {
        set_qmv_wide(on);
        let narrow = if on { KernelChoice::QmvWide } else { KernelChoice::QmvPerRow };
        assert_eq!(select_kernel(1, k, n), KernelChoice::Qmv);
        assert_eq!(select_kernel(2, k, n), narrow);
        assert_eq!(select_kernel(limit - 1, k, n), narrow);
        assert_eq!(select_kernel(limit, k, n), KernelChoice::Qmm);
        assert_eq!(select_kernel(limit + 100, k, n), KernelChoice::Qmm);
        // quantized_matmul gives the chosen kernel's bits.
        for m in [1, 2, limit - 1, limit] {
            let case = Case::new(n, k, m, 4, 64, ScaleDtype::Bf16, 31 + m as u64);
            let mut y = vec![0f32; m * n];
            quantized_matmul(&case.x, m, &case.w, &mut y);
            let mut want = vec![0f32; m * n];
            match select_kernel(m, k, n) {
                KernelChoice::Qmv => kernels::qmv(&case.x, &case.w, &mut want),
                KernelChoice::QmvPerRow => {
                    for (xr, yr) in case.x.chunks_exact(k).zip(want.chunks_exact_mut(n)) {
                        kernels::qmv(xr, &case.w, yr);
                    }
                }
                KernelChoice::QmvWide => kernels::qmv_wide(&case.x, m, &case.w, &mut want),
                KernelChoice::Qmm => kernels::qmm(&case.x, m, &case.w, &mut want),
            }
            assert!(bits_identical(&y, &want), "m {m}, switch {on}");
        }
    }
    set_qmv_wide(before);
}

/// The measured crossover picks `qmv_wide` or `qmv` per row for each M (the switch on and
/// not pinned), and since both give the same bits row for row under the default scheme,
/// whatever it picks `quantized_matmul` gives the bits of both.
#[test]
fn the_crossover_picks_per_m_and_every_pick_gives_the_same_bits() {
    let _guard = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let (before, before_c) = (qmv_wide_enabled(), crossover());
    let (k, n) = (288, 40);
    set_qmv_wide(true);
    let act = kiln_core::act_precision::act_scheme();
    for c in [Crossover::ALL_WIDE, Crossover::wide_from(16), Crossover::from_bits(0b1010_1010_1010_1000)] {
        set_crossover(c);
        for m in 2..qmv_batch_limit(k, n) {
            // A `KILN_QMV_WIDE` pin in the test's environment forces wide at every M.
            let wide_here = wide_for(m, true, qmv_wide_pinned_by_operator(), c);
            let want = if wide_here { KernelChoice::QmvWide } else { KernelChoice::QmvPerRow };
            assert_eq!(select_kernel(m, k, n), want, "m {m}, crossover {c}");
            let case = Case::new(n, k, m, 4, 32, ScaleDtype::F16, 77 + m as u64);
            let mut y = vec![0f32; m * n];
            quantized_matmul(&case.x, m, &case.w, &mut y);
            let mut wide = vec![0f32; m * n];
            kernels::qmv_wide(&case.x, m, &case.w, &mut wide);
            let mut per_row = vec![0f32; m * n];
            for (xr, yr) in case.x.chunks_exact(k).zip(per_row.chunks_exact_mut(n)) {
                kernels::qmv(xr, &case.w, yr);
            }
            if !act.wide_differs() {
                assert!(bits_identical(&y, &wide) && bits_identical(&y, &per_row), "m {m}, crossover {c}");
            }
            assert!(bits_identical(&y, if wide_here { &wide } else { &per_row }), "m {m}, crossover {c}");
        }
    }
    set_crossover(before_c);
    set_qmv_wide(before);
}

#[test]
fn the_detected_path_is_available_and_the_best_one() {
    let isa = Isa::detected();
    assert!(isa.is_available());
    assert_eq!(Isa::available()[0], isa);
    assert!(Isa::available().contains(&Isa::Portable));
    #[cfg(target_arch = "x86_64")]
    {
        use std::is_x86_feature_detected as has;
        let avx2 = has!("avx2") && has!("fma") && has!("f16c");
        let avx512 = avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl");
        let want = if avx512 && has!("avx512vnni") {
            Isa::Avx512Vnni
        } else if avx512 {
            Isa::Avx512
        } else if avx2 {
            Isa::Avx2
        } else {
            Isa::Portable
        };
        assert_eq!(isa, want);
    }
    #[cfg(target_arch = "aarch64")]
    assert_eq!(isa, Isa::Neon);
}

#[test]
fn the_dispatcher_picks_the_best_path_a_feature_set_runs() {
    use kiln_core::kernels::CpuFeatures;
    let f =
        |avx2, avx512bw, avx512vnni, neon| CpuFeatures { avx2, avx512bw, avx512vnni, avx_vnni: false, neon };
    for (features, best, paths) in [
        (
            f(true, true, true, false),
            Isa::Avx512Vnni,
            &[Isa::Avx512Vnni, Isa::Avx512, Isa::Avx2, Isa::Portable][..],
        ),
        (f(true, true, false, false), Isa::Avx512, &[Isa::Avx512, Isa::Avx2, Isa::Portable][..]),
        (f(true, false, true, false), Isa::Avx2, &[Isa::Avx2, Isa::Portable][..]),
        (f(true, false, false, false), Isa::Avx2, &[Isa::Avx2, Isa::Portable][..]),
        // AVX-512 without the AVX2 set (no such CPU, but no path may assume it).
        (f(false, true, true, false), Isa::Portable, &[Isa::Portable][..]),
        (f(false, false, false, true), Isa::Neon, &[Isa::Neon, Isa::Portable][..]),
        (f(false, false, false, false), Isa::Portable, &[Isa::Portable][..]),
    ] {
        assert_eq!(features.best(), best, "{features:?}");
        assert_eq!(features.paths(), paths, "{features:?}");
    }
    assert_eq!(CpuFeatures::detected().best(), Isa::detected());
}
