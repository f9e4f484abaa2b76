//! Every kiln-wgpu kernel, executed on the Vulkan adapter (lavapipe in CI), against
//! kiln-core's references (`reference::matmul_f64`, `reference::qmv_wide`,
//! `attn::reference`, `QuantizedMatrix::dequantize_row`) or an f64 evaluation of
//! kiln-model's formula, within the named bounds below. They are kiln-cuda's host-test
//! bounds (tests/common/mod.rs there), with the changes this backend's arithmetic needs,
//! each said where it is made: activations are f32 here (exact inputs, as the CUDA tests'
//! f16 activations are), and Vulkan's precision rules let a driver evaluate `fma` as a
//! product and a sum and give `exp`, `sqrt` and division a few ulp. Outputs are poisoned
//! with NaN before each dispatch, so an element a kernel fails to write fails. The
//! integer-scheme products are held to the CPU's integer reference (`reference::qmv_int`,
//! `reference::qmv_int_group_sums`): the same integer group sums bit for bit, on the packed
//! and the plain dot-product path.

mod common;

use half::f16;
use kiln_core::kernels::attn::{DecodeShape, reference as attn_ref};
use kiln_core::kernels::reference;
use kiln_core::matrix::ScaleData;
use kiln_core::quantize::quantize_as;
use kiln_core::{QuantSpec, QuantizedMatrix, ScaleDtype, Tag};
use kiln_protocol::ActScheme;
use kiln_wgpu::kernels::{self, AttnShape, EmbedShape, IntCodes, IntProduct, ProductShape, Weights};
use kiln_wgpu::{Dispatch, Mem, WgpuExec};

/// f32 unit roundoff.
const U: f64 = 1.0 / 16_777_216.0;

fn gamma(n: usize) -> f64 {
    let nu = n as f64 * U;
    nu / (1.0 - nu)
}

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-a, a).
    fn sym(&mut self, a: f32) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
    }
}

fn up<T: bytemuck::Pod>(e: &WgpuExec, v: &[T]) -> Mem {
    e.upload(Tag::Scratch, v).unwrap()
}

fn nans(e: &WgpuExec, n: usize) -> Mem {
    up(e, &vec![f32::NAN; n])
}

fn run(e: &WgpuExec, d: Dispatch<'_>) {
    e.dispatch(&d).unwrap();
}

fn read_f32(e: &WgpuExec, m: &Mem, n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    e.read(m, 0, &mut v).unwrap();
    v
}

/// Raw storage of scales or biases, the checkpoint's bytes.
fn raw(d: &ScaleData) -> Vec<u8> {
    match d {
        ScaleData::F16(b) => b.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
        ScaleData::Bf16(b) => b.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
        ScaleData::F32(b) => b.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

struct DevW {
    packed: Mem,
    scales: Mem,
    biases: Mem,
}

impl DevW {
    fn new(e: &WgpuExec, w: &QuantizedMatrix) -> DevW {
        DevW { packed: up(e, w.packed()), scales: up(e, &raw(w.scales())), biases: up(e, &raw(w.biases())) }
    }

    fn w(&self) -> Weights<'_> {
        Weights { packed: &self.packed, scales: &self.scales, biases: &self.biases }
    }
}

fn product(e: &WgpuExec, shape: ProductShape, w: &DevW, x: &[f32]) -> Vec<f32> {
    let bx = up(e, x);
    let by = nans(e, shape.m * shape.n);
    run(e, shape.dispatch(w.w(), &bx, 0, &by, 0).unwrap());
    read_f32(e, &by, shape.m * shape.n)
}

/// `QMV_BOUND`: kiln-cuda's derivation (per 32-element chunk a 32-term fma chain, two fmas
/// into the lane's accumulator over its C = ceil(K / 32 / L) chunks for L lanes per
/// feature, a tree of at most 5 levels), with
/// every fma charged two roundings, as Vulkan lets a driver split it:
/// `|y - exact| <= gamma(2 (C + 40)) * sum_c (|s| sum_j |q_j - c0| |x_j| + |bc| sum_j |x_j|)`.
fn qmv_bound(w: &QuantizedMatrix, x: &[f32], r: usize, lanes: usize) -> f64 {
    let (k, g, bits) = (w.k(), w.spec().group_size(), w.spec().bits());
    let gpr = k / g;
    let c0 = (1u32 << (bits - 1)) as f32;
    let lanes_chunks = (k / 32).div_ceil(lanes);
    let row = w.row_words(r);
    let mut mag = 0f64;
    for gi in 0..gpr {
        let (s, b) = (w.scales().get(r * gpr + gi), w.biases().get(r * gpr + gi));
        let bc = s.mul_add(c0, b) as f64;
        for (j, &xj) in x.iter().enumerate().skip(gi * g).take(g) {
            let q = kiln_core::format::read_code(row, j, bits) as f64 - c0 as f64;
            mag += (s as f64 * q).abs() * xj.abs() as f64 + bc.abs() * xj.abs() as f64;
        }
    }
    gamma(2 * (lanes_chunks + 40)) * mag
}

/// The reference's own bound: `gamma(K) * sum_j |w_j x_j|`.
fn reference_bound(wd: &[f32], x: &[f32]) -> f64 {
    gamma(x.len()) * wd.iter().zip(x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum::<f64>()
}

#[test]
fn qmv_and_qmv_wide_match_the_reference_within_their_bound_and_each_other_bit_for_bit() {
    let Some(e) = common::vulkan(None) else { return };
    let mut rng = Rng(0x5eed);
    let n = 13;
    let mut worst = 0f64;
    // The GPUs' rule (1 to 32 lanes by K) and the CPU adapters' single lane, on this adapter.
    for lanes_of in [|k| kernels::qmv_lanes(k, false), |k| kernels::qmv_lanes(k, true)] {
        for bits in [4u32, 8] {
            for (g, ks) in [(32usize, [96usize, 2112]), (64, [128, 2112]), (128, [256, 1152])] {
                let spec = QuantSpec::new(bits, g).unwrap();
                for sd in [ScaleDtype::F16, ScaleDtype::Bf16, ScaleDtype::F32] {
                    for k in ks {
                        let wf: Vec<f32> = (0..n * k).map(|_| rng.sym(1.0)).collect();
                        let w = quantize_as(&wf, n, k, spec, sd).unwrap();
                        let dw = DevW::new(&e, &w);
                        let wd = reference::dequantize(&w);
                        let m = 8;
                        let x: Vec<f32> = (0..m * k).map(|_| rng.sym(2.0)).collect();
                        let exact = reference::matmul_f64(&x, m, &w);
                        let mut refy = vec![0f32; m * n];
                        reference::qmv_wide(&x, m, &w, &mut refy);
                        let shape = ProductShape { n, k, m, spec, scales: sd, lanes: lanes_of(k) };
                        let wide = product(&e, shape, &dw, &x);
                        let wide3 = product(&e, ProductShape { m: 3, ..shape }, &dw, &x[..3 * k]);
                        for i in 0..m {
                            let xi = &x[i * k..(i + 1) * k];
                            let one = product(&e, ProductShape { m: 1, ..shape }, &dw, xi);
                            for r in 0..n {
                                let at = format!("{bits}-bit g{g} {sd:?} k {k} row {i} out {r}");
                                let (y, ex) = (wide[i * n + r], exact[i * n + r]);
                                let bound = qmv_bound(&w, xi, r, shape.lanes);
                                assert!(
                                    (y as f64 - ex).abs() <= bound,
                                    "{at}: {y} vs exact {ex}, bound {bound}"
                                );
                                let rb = reference_bound(&wd[r * k..(r + 1) * k], xi);
                                let rr = refy[i * n + r] as f64;
                                assert!((y as f64 - rr).abs() <= bound + rb, "{at}: {y} vs reference {rr}");
                                assert_eq!(
                                    y.to_bits(),
                                    one[r].to_bits(),
                                    "{at}: qmv_wide (m 8) and qmv differ"
                                );
                                if i < 3 {
                                    assert_eq!(
                                        y.to_bits(),
                                        wide3[i * n + r].to_bits(),
                                        "{at}: m 8 and m 3 differ"
                                    );
                                }
                                if bound > 0.0 {
                                    worst = worst.max((y as f64 - ex).abs() / bound);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    eprintln!("qmv: worst error / QMV_BOUND = {worst:.3e}");
}

/// `QMM_BOUND`: kiln-cuda's, for f32 activations (no rounding of the activations or of
/// the dequantized weights to 16 bits): the weight `s q + b` is within `3u |w|` of exact
/// and a K-term f32 dot product within `gamma(K + 1)`, charged twice (a split fma):
/// `3u sum |w x| + 2 gamma(K + 1) sum |w x|`.
fn qmm_bound(w: &[f32], x: &[f32]) -> f64 {
    let mag: f64 = w.iter().zip(x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
    3.0 * U * mag + 2.0 * gamma(x.len() + 1) * mag
}

#[test]
fn qmm_matches_the_exact_product_within_its_bound_and_rows_do_not_depend_on_m() {
    let Some(e) = common::vulkan(None) else { return };
    let mut rng = Rng(0x9a11);
    let n = 70; // two workgroups of 64 features, the second partial
    for bits in [4u32, 8] {
        for (g, k) in [(32usize, 96usize), (64, 320), (128, 256)] {
            let spec = QuantSpec::new(bits, g).unwrap();
            for sd in [ScaleDtype::F16, ScaleDtype::Bf16, ScaleDtype::F32] {
                let wf: Vec<f32> = (0..n * k).map(|_| rng.sym(1.0)).collect();
                let w = quantize_as(&wf, n, k, spec, sd).unwrap();
                let dw = DevW::new(&e, &w);
                let wd = reference::dequantize(&w);
                let m = 33; // five tiles of 8 rows, the last with one
                let x: Vec<f32> = (0..m * k).map(|_| rng.sym(2.0)).collect();
                let exact = reference::matmul_f64(&x, m, &w);
                let shape = ProductShape { n, k, m, spec, scales: sd, lanes: 1 };
                let y = product(&e, shape, &dw, &x);
                let y17 = product(&e, ProductShape { m: 17, ..shape }, &dw, &x[..17 * k]);
                for i in 0..m {
                    for r in 0..n {
                        let at = format!("{bits}-bit g{g} {sd:?} k {k} row {i} out {r}");
                        let (got, ex) = (y[i * n + r], exact[i * n + r]);
                        let bound = qmm_bound(&wd[r * k..(r + 1) * k], &x[i * k..(i + 1) * k]);
                        assert!((got as f64 - ex).abs() <= bound, "{at}: {got} vs exact {ex}, bound {bound}");
                        if i < 17 {
                            assert_eq!(got.to_bits(), y17[i * n + r].to_bits(), "{at}: m 33 and m 17 differ");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn rms_norm_matches_the_f64_formula_within_its_bound() {
    // RMS_NORM_BOUND: kiln-cuda's (gamma(d) for the sum of squares, u each for the mean, the
    // sqrt, the division and the two products) with Vulkan's precision for the sqrt (as
    // 1 / inverseSqrt: 2 ulp and a division) and the division (2.5 ulp) in place of u each,
    // 4u for each: (gamma(d) + 16u) |exact|, the output being f32.
    let Some(e) = common::vulkan(None) else { return };
    let mut rng = Rng(7);
    for d in [7usize, 256, 896, 1000] {
        let rows = 3;
        let x: Vec<f32> = (0..rows * d).map(|_| rng.sym(3.0)).collect();
        let wt: Vec<f32> = (0..d).map(|_| 1.0 + rng.sym(0.5)).collect();
        let eps = 1e-6f32;
        let (bx, bw, by) = (up(&e, &x), up(&e, &wt), nans(&e, (rows + 1) * d));
        // Rows 1.. of the output, as the forward writes a gathered row.
        run(&e, kernels::rms_norm(rows, d, eps, &bx, 0, &bw, &by, 1).unwrap());
        let y = read_f32(&e, &by, (rows + 1) * d);
        for r in 0..rows {
            let xr = &x[r * d..(r + 1) * d];
            let ms = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            for j in 0..d {
                let ex = xr[j] as f64 * inv * wt[j] as f64;
                let got = y[(r + 1) * d + j] as f64;
                let bound = (gamma(d) + 16.0 * U) * ex.abs() + f64::from(f32::MIN_POSITIVE);
                assert!((got - ex).abs() <= bound, "d {d} row {r} [{j}]: {got} vs {ex}");
            }
        }
    }
}

#[test]
fn silu_mul_add_and_bias_match_their_formulas() {
    // SILU_BOUND: kiln-cuda's (the exp's error, then u each for the sum, the division and
    // the product) with Vulkan's precision for exp, (3 + 2|x|) ulp of the result, in place
    // of kiln-core's EXP_REL_ERROR: ((3 + 2|g|) 2^-23 + 5u) |exact|.
    let Some(e) = common::vulkan(None) else { return };
    let mut rng = Rng(11);
    let len = 1000;
    let gate: Vec<f32> = (0..len).map(|_| rng.sym(12.0)).collect();
    let upv: Vec<f32> = (0..len).map(|_| rng.sym(2.0)).collect();
    let (bg, bu, by) = (up(&e, &gate), up(&e, &upv), nans(&e, len));
    run(&e, kernels::silu_mul(len, &bg, &bu, &by).unwrap());
    let y = read_f32(&e, &by, len);
    for i in 0..len {
        let g = gate[i] as f64;
        let ex = g / (1.0 + (-g).exp()) * upv[i] as f64;
        let bound = ((3.0 + 2.0 * g.abs()) / 8_388_608.0 + 5.0 * U) * ex.abs() + f64::from(f32::MIN_POSITIVE);
        assert!((y[i] as f64 - ex).abs() <= bound, "[{i}]: {} vs {ex}", y[i]);
    }
    let x: Vec<f32> = (0..len).map(|_| rng.sym(5.0)).collect();
    let yv: Vec<f32> = (0..len).map(|_| rng.sym(5.0)).collect();
    let want: Vec<u32> = x.iter().zip(&yv).map(|(a, b)| (a + b).to_bits()).collect();
    let (bx, byv) = (up(&e, &x), up(&e, &yv));
    run(&e, kernels::add(len, &bx, &byv).unwrap());
    let got: Vec<u32> = read_f32(&e, &bx, len).iter().map(|v| v.to_bits()).collect();
    assert_eq!(got, want, "the residual add is one f32 addition per element");
    let n = 40;
    let bias: Vec<f32> = (0..n).map(|_| rng.sym(3.0)).collect();
    let want: Vec<u32> = yv.iter().enumerate().map(|(i, v)| (v + bias[i % n]).to_bits()).collect();
    let (byv, bb) = (up(&e, &yv), up(&e, &bias));
    run(&e, kernels::add_bias(len, n, &byv, &bb).unwrap());
    let got: Vec<u32> = read_f32(&e, &byv, len).iter().map(|v| v.to_bits()).collect();
    assert_eq!(got, want, "the bias is one f32 addition per element, broadcast over rows");
}

#[test]
fn rope_rotates_as_kiln_model_does_for_default_and_scaled_frequencies() {
    // The angles are kiln-model's (`Rope::angles`, on the host); the kernel rotates. A
    // driver may fuse a product into the difference, so ROPE_DEVICE_BOUND, kiln-cuda's
    // bound for a device: (|x1| + |x2|) 2^-23 + 2u |out| per element.
    let Some(e) = common::vulkan(None) else { return };
    let mut rng = Rng(3);
    for (head_dim, scaling) in [
        (8usize, None),
        (64, Some(kiln_model::config::RopeScaling::Linear { factor: 4.0 })),
        (
            128,
            Some(kiln_model::config::RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            }),
        ),
    ] {
        let half = head_dim / 2;
        let heads = 3;
        let rope = kiln_model::rope::Rope::with_params(head_dim, 500_000.0, scaling);
        let positions = [0usize, 17, 4099];
        let rows = positions.len();
        let mut cs = vec![0f32; 2 * rows * half];
        for (r, &p) in positions.iter().enumerate() {
            let (c, s) = cs.split_at_mut(rows * half);
            rope.angles(p, &mut c[r * half..(r + 1) * half], &mut s[r * half..(r + 1) * half]);
        }
        let x0: Vec<f32> = (0..(rows + 1) * heads * head_dim).map(|_| rng.sym(4.0)).collect();
        let (bx, bc) = (up(&e, &x0), up(&e, &cs));
        // Rows 1.. of x, as a sequence inside a batch.
        run(&e, kernels::rope(rows, heads, half, &bx, 1, &bc).unwrap());
        let x = read_f32(&e, &bx, x0.len());
        let mut want = x0.clone();
        let w = heads * head_dim;
        for (r, &p) in positions.iter().enumerate() {
            let (mut c, mut s) = (vec![0f32; half], vec![0f32; half]);
            rope.angles(p, &mut c, &mut s);
            rope.apply(&mut want[(r + 1) * w..(r + 2) * w], &c, &s);
        }
        assert_eq!(&x[..w], &x0[..w], "row 0 is not touched");
        for (i, (&g, &wv)) in x.iter().zip(&want).enumerate() {
            let h = i % head_dim;
            let base = i - h;
            let mag = (x0[base + h % half].abs() + x0[base + half + h % half].abs()) as f64;
            let bound = mag * 2f64.powi(-23) + 2.0 * U * wv.abs() as f64;
            assert!((g as f64 - wv as f64).abs() <= bound, "head_dim {head_dim} [{i}]: {g} vs {wv}");
        }
    }
}

#[test]
fn embedding_rows_are_the_formats_dequantization_bit_for_bit() {
    let Some(e) = common::vulkan(None) else { return };
    let mut rng = Rng(5);
    for bits in [2u32, 3, 4, 5, 6, 8] {
        for g in [32usize, 64, 128] {
            for sd in [ScaleDtype::F16, ScaleDtype::Bf16, ScaleDtype::F32] {
                let (vocab, d) = (11, 2 * g + g * (bits as usize % 2));
                let spec = QuantSpec::new(bits, g).unwrap();
                let wf: Vec<f32> = (0..vocab * d).map(|_| rng.sym(1.0)).collect();
                let table = quantize_as(&wf, vocab, d, spec, sd).unwrap();
                let dw = DevW::new(&e, &table);
                let tokens: Vec<i32> = vec![10, 0, 3, -1, 11, 3];
                let shape = EmbedShape { rows: tokens.len(), vocab, d, spec, scales: sd };
                let (bt, bo) = (up(&e, &tokens), nans(&e, tokens.len() * d));
                run(&e, shape.dispatch(dw.w(), &bt, &bo).unwrap());
                let out = read_f32(&e, &bo, tokens.len() * d);
                let mut row = vec![0f32; d];
                for (i, &t) in tokens.iter().enumerate() {
                    let got = &out[i * d..(i + 1) * d];
                    if !(0..vocab as i32).contains(&t) {
                        assert!(got.iter().all(|v| v.is_nan()), "token {t} outside the vocabulary is NaN");
                        continue;
                    }
                    table.dequantize_row(t as usize, &mut row);
                    let gb: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                    let wb: Vec<u32> = row.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(gb, wb, "{bits}-bit g{g} {sd:?} token {t}");
                }
            }
        }
    }
}

#[test]
fn kv_store_rounds_new_keys_and_values_to_f16_in_place() {
    let Some(e) = common::vulkan(None) else { return };
    let mut rng = Rng(21);
    let (kv_heads, head_dim, capacity, start, rows) = (3usize, 80usize, 40usize, 29usize, 4usize);
    let n = (rows + 2) * kv_heads * head_dim;
    // Beyond f16's range (to infinity), subnormals, a NaN and ties.
    let mut k: Vec<f32> = (0..n).map(|_| rng.sym(70_000.0) * rng.sym(1.0)).collect();
    let mut v: Vec<f32> = (0..n).map(|_| rng.sym(1e-4)).collect();
    k[kv_heads * head_dim * 2 + 3] = f32::NAN;
    v[kv_heads * head_dim * 2 + 5] = 1.0 + 1.0 / 2048.0; // a tie, to even (1.0)
    v[kv_heads * head_dim * 2 + 7] = -1.0 - 3.0 / 2048.0; // a tie, to even (up)
    let old: Vec<u16> = (0..kv_heads * capacity * head_dim).map(|i| i as u16).collect();
    let (bk, bv, bkc, bvc) = (up(&e, &k), up(&e, &v), up(&e, &old), up(&e, &old));
    // Rows 2.. of k and v, as a sequence inside a batch.
    run(&e, kernels::kv_store(rows, kv_heads, head_dim, capacity, start, 2, &bk, &bv, &bkc, &bvc).unwrap());
    let read16 = |m: &Mem| {
        let mut w = vec![0u16; old.len()];
        e.read(m, 0, &mut w).unwrap();
        w
    };
    let (kc, vc) = (read16(&bkc), read16(&bvc));
    for h in 0..kv_heads {
        for p in 0..capacity {
            for d in 0..head_dim {
                let at = (h * capacity + p) * head_dim + d;
                let (wk, wv) = if (start..start + rows).contains(&p) {
                    let i = ((p - start + 2) * kv_heads + h) * head_dim + d;
                    (f16::from_f32(k[i]).to_bits(), f16::from_f32(v[i]).to_bits())
                } else {
                    (old[at], old[at])
                };
                assert_eq!((kc[at], vc[at]), (wk, wv), "head {h} position {p} [{d}]");
            }
        }
    }
}

#[test]
fn decode_attention_matches_the_exact_softmax_within_kiln_cores_bound() {
    // ATTN_BOUND: kiln-core's attn::reference::error_bound with kiln-cuda's charge of
    // 64 + 3 + spans corrections per weight. Here a weight passes through two exps (its
    // span's and the merge's), each within Vulkan's (3 + 2|x|) ulp, which that charge
    // covers.
    let Some(e) = common::vulkan(None) else { return };
    let mut rng = Rng(99);
    let kv_heads = 2;
    for (group, head_dim) in [(1usize, 64usize), (4, 80), (7, 128), (8, 32), (2, 256)] {
        for (start, rows) in [(0usize, 1usize), (4, 1), (254, 3), (600, 2)] {
            let capacity = start + rows + 5;
            let keys: Vec<u16> =
                (0..kv_heads * capacity * head_dim).map(|_| f16::from_f32(rng.sym(1.5)).to_bits()).collect();
            let values: Vec<u16> =
                (0..kv_heads * capacity * head_dim).map(|_| f16::from_f32(rng.sym(2.0)).to_bits()).collect();
            let qdim = kv_heads * group * head_dim;
            let q: Vec<f32> = (0..rows * qdim).map(|_| rng.sym(2.0)).collect();
            let shape = AttnShape { rows, start, kv_heads, group, head_dim, capacity };
            let run_attn = |shape: AttnShape, q: &[f32]| -> Vec<f32> {
                let (bq, bk, bv) = (up(&e, q), up(&e, &keys), up(&e, &values));
                let scratch = nans(&e, shape.scratch_bytes() / 4);
                let out = nans(&e, shape.rows * qdim);
                let [split, merge] = shape.dispatches(&bq, 0, &bk, &bv, &scratch, &out, 0).unwrap();
                run(&e, split);
                run(&e, merge);
                read_f32(&e, &out, shape.rows * qdim)
            };
            let got = run_attn(shape, &q);
            let ds = DecodeShape::new(group, head_dim);
            for r in 0..rows {
                let len = start + r + 1;
                let spans = len.div_ceil(kernels::ATTN_SPAN);
                for h in 0..kv_heads {
                    let f = |c: &[u16]| -> Vec<f32> {
                        c[h * capacity * head_dim..(h * capacity + len) * head_dim]
                            .iter()
                            .map(|&b| f16::from_bits(b).to_f32())
                            .collect()
                    };
                    let (k, v) = (f(&keys), f(&values));
                    let qh = &q[r * qdim + h * group * head_dim..r * qdim + (h + 1) * group * head_dim];
                    let exact = attn_ref::attend(&ds, qh, &k, &v);
                    let bound = attn_ref::error_bound(&ds, qh, &k, &v, 64 + 3 + spans);
                    for i in 0..group * head_dim {
                        let o = got[r * qdim + h * group * head_dim + i] as f64;
                        let b = bound[i] + f64::from(f32::MIN_POSITIVE);
                        assert!(
                            (o - exact[i]).abs() <= b,
                            "group {group} hd {head_dim} start {start} row {r} head {h} [{i}]: {o} vs {} (bound {b})",
                            exact[i]
                        );
                    }
                }
            }
            // A verify's rows are the one-row decodes at their positions, bit for bit.
            if rows > 1 {
                for r in 0..rows {
                    let one = AttnShape { rows: 1, start: start + r, ..shape };
                    let single = run_attn(one, &q[r * qdim..(r + 1) * qdim]);
                    let a: Vec<u32> = got[r * qdim..(r + 1) * qdim].iter().map(|v| v.to_bits()).collect();
                    let b: Vec<u32> = single.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(a, b, "group {group} hd {head_dim} row {r}");
                }
            }
        }
    }
}

#[test]
fn shapes_the_kernels_do_not_take_are_refused_by_name() {
    let Some(e) = common::vulkan(None) else { return };
    let m = up(&e, &[0u32; 64]);
    let spec = QuantSpec::new(3, 32).unwrap();
    let w = Weights { packed: &m, scales: &m, biases: &m };
    let err = ProductShape { n: 1, k: 32, m: 1, spec, scales: ScaleDtype::F16, lanes: 1 }
        .dispatch(w, &m, 0, &m, 0)
        .err()
        .unwrap();
    assert_eq!(err.to_string(), "invalid qmv shape: 3-bit weights: accepted are 4 and 8 bits");
    let spec = QuantSpec::new(4, 32).unwrap();
    let err = ProductShape { n: 64, k: 32, m: 1, spec, scales: ScaleDtype::F16, lanes: 1 }
        .dispatch(w, &m, 0, &m, 0)
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("y: 256 bytes, 4096 needed") || err.to_string().contains("needed"),
        "{err}"
    );
    let err = ProductShape { n: 1, k: 32, m: 1, spec, scales: ScaleDtype::F16, lanes: 3 }
        .dispatch(w, &m, 0, &m, 0)
        .err()
        .unwrap();
    assert_eq!(err.to_string(), "invalid qmv shape: 3 lanes: accepted are 1, 2, 4, 8, 16, 32");
    let a = AttnShape { rows: 1, start: 0, kv_heads: 1, group: 1, head_dim: 512, capacity: 4 };
    assert!(a.check().unwrap_err().to_string().contains("head_dim 512"));
}

/// What an integer-scheme product gives on the device: its outputs, its integer group
/// sums, and its activations' per-group words (sx, xsum, qsum).
struct IntRun {
    y: Vec<f32>,
    sums: Vec<i32>,
    groups: Vec<(f32, f32, i32)>,
}

/// The integer-scheme product of `x` on the device with the packed (`packed`) or plain dot
/// products.
fn int_product(e: &WgpuExec, p: IntProduct, w: &DevW, x: &[f32], packed: bool) -> IntRun {
    let s = p.shape;
    let bx = up(e, x);
    let act = up(e, &vec![0xdead_beef_u32; p.act_bytes() / 4]);
    let by = nans(e, s.m * s.n);
    let gpr = s.k / s.spec.group_size();
    let bs = nans(e, s.m * s.n * gpr);
    run(e, p.quantize(&bx, 0, &act).unwrap());
    run(e, p.product(w.w(), &act, &by, 0, packed).unwrap());
    run(e, p.group_sums(w.w(), &act, &bs, packed).unwrap());
    let sums = read_f32(e, &bs, s.m * s.n * gpr).iter().map(|v| v.to_bits() as i32).collect();
    let mut info = vec![0u32; s.m * gpr * 4];
    e.read(&act, p.info_off() * 4, &mut info).unwrap();
    let groups =
        info.chunks_exact(4).map(|w| (f32::from_bits(w[0]), f32::from_bits(w[1]), w[2] as i32)).collect();
    IntRun { y: read_f32(e, &by, s.m * s.n), sums, groups }
}

/// kiln-core's integer epilogue (`Lanes`) over the CPU's group sums and activation groups
/// for row `i`, output `r`: with `fused` its fmas as one rounding each (the CPU's, so
/// `reference::qmv_int`'s bits), else each as a product and a sum (what Vulkan lets a driver
/// do, and lavapipe does).
fn int_epilogue(
    w: &QuantizedMatrix,
    sums: &[i32],
    groups: &[reference::ActGroup],
    i: usize,
    r: usize,
    fused: bool,
) -> f32 {
    let (n, gpr) = (w.n(), w.k() / w.spec().group_size());
    let c = 1i32 << (w.spec().bits() - 1);
    let fma = |a: f32, b: f32, acc: f32| if fused { a.mul_add(b, acc) } else { a * b + acc };
    let mut lanes = [0f32; 8];
    for gi in 0..gpr {
        let a = groups[i * gpr + gi];
        let (s, b) = (w.scales().get(r * gpr + gi), w.biases().get(r * gpr + gi));
        let l = &mut lanes[gi % 8];
        *l = fma((sums[(i * n + r) * gpr + gi] - c * a.qsum) as f32, s * a.sx, *l);
        *l = fma(fma(s, c as f32, b), a.xsum, *l);
    }
    let l = lanes;
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// Activations for the integer tests: uniform in [-2, 2) with the awkward groups the
/// CPU's quantizer handles apart in row 1 (when there are rows enough): an all-zero group,
/// a group with one large value among tiny ones (a wide span for the exact sum), and
/// values that land on code halves (ties to even).
fn int_activations(rng: &mut Rng, m: usize, k: usize, g: usize) -> Vec<f32> {
    let mut x: Vec<f32> = (0..m * k).map(|_| rng.sym(2.0)).collect();
    if m > 1 && k / g >= 3 {
        let row = &mut x[k..2 * k];
        row[..g].fill(0.0);
        for (j, v) in row[g..2 * g].iter_mut().enumerate() {
            *v = if j == 5 { 3.0e4 } else { rng.sym(1.0e-3) };
        }
        for (j, v) in row[2 * g..3 * g].iter_mut().enumerate() {
            // amax 127 gives inv 1: codes are the values, and x.5 ties to even.
            *v = if j == 0 { 127.0 } else { (j as f32 - 40.0) + 0.5 };
        }
    }
    x
}

#[test]
fn integer_schemes_give_the_cpus_group_sums_bit_for_bit_and_its_products_on_both_dot_paths() {
    let Some(e) = common::vulkan(None) else { return };
    let adapter_packed = e.packed_dot();
    eprintln!("{}: packed integer dot products {}", e.name(), if adapter_packed { "yes" } else { "no" });
    let mut rng = Rng(0x1d07);
    let n = 70; // two workgroups of 64 features, the second partial
    let (mut outputs, mut same_bits, mut split_bits, mut worst) = (0usize, 0usize, 0usize, 0f64);
    for scheme in [ActScheme::Int8, ActScheme::Int16] {
        for bits in [4u32, 8] {
            let codes = IntCodes::for_weight_bits(bits, scheme).unwrap();
            for (g, k) in [(32usize, 96usize), (32, 352), (64, 640), (128, 256), (128, 1152)] {
                let spec = QuantSpec::new(bits, g).unwrap();
                let sd = [ScaleDtype::F16, ScaleDtype::Bf16, ScaleDtype::F32][(k / g) % 3];
                let wf: Vec<f32> = (0..n * k).map(|_| rng.sym(1.0)).collect();
                let w = quantize_as(&wf, n, k, spec, sd).unwrap();
                let dw = DevW::new(&e, &w);
                // qmv (1 row), qmv_wide (3 and 8 rows), qmm (17 rows: three tiles).
                for m in [1usize, 3, 8, 17] {
                    let x = int_activations(&mut rng, m, k, g);
                    let want = reference::qmv_int(&x, m, &w, scheme).unwrap();
                    let want_sums = reference::qmv_int_group_sums(&x, m, &w, scheme).unwrap();
                    let want_groups = reference::act_groups(&x, m, k, g, bits, scheme).unwrap();
                    let shape = ProductShape { n, k, m, spec, scales: sd, lanes: 1 };
                    let p = IntProduct { shape, codes };
                    let paths: &[bool] = if adapter_packed { &[true, false] } else { &[false] };
                    let mut first: Option<Vec<f32>> = None;
                    for &packed in paths {
                        let at = format!(
                            "{} {bits}-bit g{g} {sd:?} k {k} m {m} {}",
                            scheme.as_str(),
                            if packed { "packed" } else { "plain" }
                        );
                        let IntRun { y, sums, groups } = int_product(&e, p, &dw, &x, packed);
                        for (idx, (a, b)) in groups.iter().zip(&want_groups).enumerate() {
                            let (i, gi) = (idx / (k / g), idx % (k / g));
                            let bits_of = |v: f32| v.to_bits();
                            assert_eq!(
                                (bits_of(a.0), bits_of(a.1), a.2),
                                (bits_of(b.sx), bits_of(b.xsum), b.qsum),
                                "{at}: row {i} group {gi}'s scale, sum and code sum (device {a:?}, CPU {b:?})"
                            );
                        }
                        assert_eq!(sums.len(), want_sums.len());
                        for (idx, (a, b)) in sums.iter().zip(&want_sums).enumerate() {
                            let gpr = k / g;
                            let (i, r, gi) = (idx / (n * gpr), idx / gpr % n, idx % gpr);
                            assert_eq!(a, b, "{at}: the group sum of row {i} out {r} group {gi}");
                        }
                        for i in 0..m {
                            for r in 0..n {
                                let (got, cpu) = (y[i * n + r], want[i * n + r]);
                                let bound = qmv_bound(&w, &x[i * k..(i + 1) * k], r, 1);
                                assert!(
                                    (got as f64 - cpu as f64).abs() <= bound,
                                    "{at} row {i} out {r}: {got} vs the CPU's {cpu}, bound {bound}"
                                );
                                // The CPU's epilogue over the CPU's integers and groups, its
                                // fmas fused (the CPU's own bits) or split, as the driver
                                // evaluates them: the device's is one of the two.
                                let fused = int_epilogue(&w, &want_sums, &want_groups, i, r, true);
                                let split = int_epilogue(&w, &want_sums, &want_groups, i, r, false);
                                assert_eq!(fused.to_bits(), cpu.to_bits(), "{at}: the epilogue is the CPU's");
                                assert!(
                                    got.to_bits() == fused.to_bits() || got.to_bits() == split.to_bits(),
                                    "{at} row {i} out {r}: {got} is neither the CPU's {fused} nor its split-fma {split}"
                                );
                                outputs += 1;
                                same_bits += usize::from(got.to_bits() == cpu.to_bits());
                                split_bits += usize::from(got.to_bits() == split.to_bits());
                                if bound > 0.0 {
                                    worst = worst.max((got as f64 - cpu as f64).abs() / bound);
                                }
                            }
                        }
                        // Both paths compute the same operations on the same integers.
                        match &first {
                            None => first = Some(y),
                            Some(f) => assert!(
                                f.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()),
                                "{at}: the packed and the plain path differ"
                            ),
                        }
                    }
                }
            }
        }
    }
    eprintln!(
        "integer products: {same_bits} of {outputs} outputs the CPU's bits, {split_bits} its split-fma bits; \
         worst difference / QMV_BOUND {worst:.3e}"
    );
}

#[test]
fn integer_rows_do_not_depend_on_m_and_a_non_finite_group_makes_its_row_nan() {
    let Some(e) = common::vulkan(None) else { return };
    let mut rng = Rng(0x7a11);
    let (n, k, g) = (9, 256, 64);
    for bits in [4u32, 8] {
        let spec = QuantSpec::new(bits, g).unwrap();
        let wf: Vec<f32> = (0..n * k).map(|_| rng.sym(1.0)).collect();
        let w = quantize_as(&wf, n, k, spec, ScaleDtype::F16).unwrap();
        let dw = DevW::new(&e, &w);
        let codes = IntCodes::for_weight_bits(bits, ActScheme::Int8).unwrap();
        let mut x: Vec<f32> = (0..12 * k).map(|_| rng.sym(2.0)).collect();
        x[k + 70] = f32::INFINITY;
        x[2 * k + 3] = f32::NAN;
        let shape = ProductShape { n, k, m: 12, spec, scales: ScaleDtype::F16, lanes: 1 };
        let packed = e.packed_dot();
        let all = int_product(&e, IntProduct { shape, codes }, &dw, &x, packed).y;
        let want = reference::qmv_int(&x, 12, &w, ActScheme::Int8).unwrap();
        for i in 0..12 {
            let xi = &x[i * k..(i + 1) * k];
            let one_shape = ProductShape { m: 1, ..shape };
            let one = int_product(&e, IntProduct { shape: one_shape, codes }, &dw, xi, packed).y;
            for r in 0..n {
                let (a, b) = (all[i * n + r], one[r]);
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{bits}-bit row {i} out {r}: m 12 {a} and m 1 {b} differ"
                );
                assert_eq!(a.is_nan(), want[i * n + r].is_nan(), "{bits}-bit row {i} out {r}");
                assert_eq!(a.is_nan(), i == 1 || i == 2, "{bits}-bit row {i} out {r}: {a}");
            }
        }
    }
}

#[test]
fn integer_products_refuse_codes_no_scheme_gives_those_weights() {
    let Some(e) = common::vulkan(None) else { return };
    let spec = QuantSpec::new(8, 32).unwrap();
    let shape = ProductShape { n: 4, k: 64, m: 1, spec, scales: ScaleDtype::F32, lanes: 1 };
    let p = IntProduct { shape, codes: IntCodes::I8 };
    let x = up(&e, &[0f32; 64]);
    let act = up(&e, &[0u8; 4096]);
    let err = p.quantize(&x, 0, &act).err().unwrap();
    assert!(err.to_string().contains("I8 codes with 8-bit weights"), "{err}");
    assert_eq!(IntCodes::for_weight_bits(4, ActScheme::F32), None);
    assert_eq!(IntCodes::for_weight_bits(4, ActScheme::Int16Wide8), None);
    assert_eq!(IntCodes::for_weight_bits(8, ActScheme::Int8), Some(IntCodes::I16));
}
