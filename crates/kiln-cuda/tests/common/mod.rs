//! The kernel checks shared by the host execution (`host_kernels.rs`) and the device
//! (`device_kernels.rs`): every kernel on small shapes with tails, against kiln-core's
//! references (`reference::matmul_f64`, `reference::qmv`, `attn::reference`,
//! `QuantizedMatrix::dequantize_row`) or an f64 evaluation of kiln-model's formula, within
//! the named, derived bounds below. Outputs are poisoned with NaN before each launch, so
//! an element a kernel fails to write fails. A [`Backend`] owns the buffers and runs the
//! launches.
#![allow(dead_code)] // each test binary uses the cases it runs

use half::{bf16, f16};
use kiln_core::kernels::attn::{DecodeShape, reference as attn_ref};
use kiln_core::kernels::reference;
use kiln_core::math::EXP_REL_ERROR;
use kiln_core::matrix::ScaleData;
use kiln_core::quantize::quantize_as;
use kiln_core::{QuantSpec, QuantizedMatrix, ScaleDtype};
use kiln_cuda::launch::{self, Act, Out};
use kiln_cuda::{AttnBuffers, AttnShape, EmbedBuffers, EmbedShape, Launch, QmmShape, QmvBuffers, QmvShape};

/// A buffer of a backend.
pub trait Buf {
    /// Its address, for a launch argument.
    fn addr(&self) -> u64;
    /// Its bytes, after the launches.
    fn read(&self) -> Vec<u8>;
}

/// Where the kernels run: the host execution or a GPU.
pub trait Backend {
    /// A buffer holding a copy of the bytes it was made from.
    type B<'a>: Buf
    where
        Self: 'a;
    /// A buffer initialised with `bytes`.
    fn upload<'a>(&'a self, bytes: &[u8]) -> Self::B<'a>;
    /// Runs `l` to completion.
    fn run(&self, l: &Launch);
    /// Whether `cos` and `sin` in double round as the host's C library does, so RoPE can
    /// be checked bit for bit against kiln-model's formula (true on the host).
    fn host_libm(&self) -> bool;
}

fn up<'a, T: bytemuck::Pod, E: Backend>(be: &'a E, v: &[T]) -> E::B<'a> {
    be.upload(bytemuck::cast_slice(v))
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// f32 unit roundoff.
const U: f64 = 1.0 / 16_777_216.0;
/// Half an ulp of an f16 value, relative.
const F16_ROUND: f64 = 1.0 / 2048.0;
/// Half an ulp of a bf16 value, relative.
const BF16_ROUND: f64 = 1.0 / 256.0;

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

/// Raw storage of scales or biases, the checkpoint's bytes.
fn raw(d: &ScaleData) -> Vec<u8> {
    match d {
        ScaleData::F16(b) => b.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
        ScaleData::Bf16(b) => b.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
        ScaleData::F32(b) => b.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// Activations rounded to `act`: the bits the kernel reads, and their exact f32 values.
fn activations(rng: &mut Rng, len: usize, act: Act) -> (Vec<u16>, Vec<f32>) {
    let mut bits = Vec::with_capacity(len);
    let mut vals = Vec::with_capacity(len);
    for _ in 0..len {
        let v = rng.sym(2.0);
        let (b, f) = match act {
            Act::F16 => {
                let h = f16::from_f32(v);
                (h.to_bits(), h.to_f32())
            }
            Act::Bf16 => {
                let h = bf16::from_f32(v);
                (h.to_bits(), h.to_f32())
            }
        };
        bits.push(b);
        vals.push(f);
    }
    (bits, vals)
}

fn out_value(out: Out, bits: &[u8], i: usize) -> f64 {
    match out {
        Out::F32 => f32::from_le_bytes(bits[4 * i..4 * i + 4].try_into().unwrap()) as f64,
        Out::F16 => f16::from_bits(u16::from_le_bytes([bits[2 * i], bits[2 * i + 1]])).to_f64(),
        Out::Bf16 => bf16::from_bits(u16::from_le_bytes([bits[2 * i], bits[2 * i + 1]])).to_f64(),
    }
}

/// The storage's absolute rounding floor: half the spacing of f16's subnormals, 2^-25
/// (bf16 and f32 have f32's range; their floor is below the tests' other terms).
fn out_floor(out: Out) -> f64 {
    match out {
        Out::F16 => 1.0 / 33_554_432.0,
        Out::F32 | Out::Bf16 => f64::from(f32::MIN_POSITIVE),
    }
}

fn out_round(out: Out) -> f64 {
    match out {
        Out::F32 => 0.0,
        Out::F16 => F16_ROUND,
        Out::Bf16 => BF16_ROUND,
    }
}

/// An output buffer of `n` values of `out`, every value NaN.
fn poisoned(out: Out, n: usize) -> Vec<u8> {
    match out {
        Out::F32 => f32::NAN.to_le_bytes().repeat(n),
        Out::F16 => f16::NAN.to_bits().to_le_bytes().repeat(n),
        Out::Bf16 => bf16::NAN.to_bits().to_le_bytes().repeat(n),
    }
}

/// `QMV_BOUND`: how far `qmv`/`qmv_wide` may land from the exact product.
///
/// The kernel computes, per 32-element chunk c of a row (inside one group, scale s, bias
/// b, centre c0 = 2^(bits-1)), `dq = sum_j (q_j - c0) x_j` (a 32-term fmaf chain; the
/// codes minus the centre are exact), `xs = sum_j x_j`, then `acc = fma(s, dq, acc)` and
/// `acc = fma(bc, xs, acc)` with `bc = fma(s, c0, b)` (one rounding), and the warp sums
/// the lanes' accumulators (5 levels). Each term of the expansion
/// `sum_c s dq_c + bc xs_c` passes through at most 32 (chunk sum) + 2 (the two fmas and
/// bc) + C (a lane's accumulator over its C = ceil(K / 1024) chunks) + 5 (butterfly)
/// roundings, so by the standard bound for sums of products,
/// `|y - exact| <= gamma(C + 40) * sum_c (|s| sum_j |q_j - c0| |x_j| + |bc| sum_j |x_j|)`.
/// The activations are exact in f32 (they are f16 or bf16), and the dequantized weights
/// are exact in the reference, so `reference::matmul_f64` is the exact product.
fn qmv_bound(w: &QuantizedMatrix, x: &[f32], r: usize) -> f64 {
    let (k, g, bits) = (w.k(), w.spec().group_size(), w.spec().bits());
    let gpr = k / g;
    let c0 = (1u32 << (bits - 1)) as f32;
    let lanes_chunks = (k / 32).div_ceil(32);
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
    gamma(lanes_chunks + 40) * mag
}

/// The reference's own bound: `reference::qmv` dequantizes exactly and sums K products in
/// order, `gamma(K) * sum_j |w_j x_j|`.
fn reference_bound(wd: &[f32], x: &[f32]) -> f64 {
    gamma(x.len()) * wd.iter().zip(x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum::<f64>()
}

fn qmv_run(be: &impl Backend, shape: QmvShape, w: &QuantizedMatrix, xbits: &[u16]) -> Vec<f32> {
    let (scales, biases) = (raw(w.scales()), raw(w.biases()));
    let (bp, bs, bb) = (up(be, w.packed()), be.upload(&scales), be.upload(&biases));
    let (bx, by) = (up(be, xbits), be.upload(&poisoned(Out::F32, shape.m * shape.n)));
    assert_eq!((size_of_val(w.packed()), scales.len()), (shape.packed_bytes(), shape.scale_bytes()));
    assert_eq!(size_of_val(xbits), shape.x_bytes());
    let l = shape
        .launch(QmvBuffers {
            packed: bp.addr(),
            scales: bs.addr(),
            biases: bb.addr(),
            x: bx.addr(),
            y: by.addr(),
        })
        .unwrap();
    be.run(&l);
    f32s(&by.read())
}

pub fn qmv_and_qmv_wide_match_the_reference_within_their_bound_and_each_other_bit_for_bit(be: &impl Backend) {
    let mut rng = Rng(0x5eed);
    let n = 13; // four blocks of four rows, the last one with a single row
    let mut worst = 0f64;
    for bits in [4u32, 8] {
        for (g, ks) in [(32usize, [96usize, 2112]), (64, [128, 2112]), (128, [256, 1152])] {
            let spec = QuantSpec::new(bits, g).unwrap();
            for sd in [ScaleDtype::F16, ScaleDtype::Bf16, ScaleDtype::F32] {
                for act in [Act::F16, Act::Bf16] {
                    for k in ks {
                        let wf: Vec<f32> = (0..n * k).map(|_| rng.sym(1.0)).collect();
                        let w = quantize_as(&wf, n, k, spec, sd).unwrap();
                        let wd = reference::dequantize(&w);
                        let m = 8;
                        let (xbits, x) = activations(&mut rng, m * k, act);
                        let exact = reference::matmul_f64(&x, m, &w);
                        let mut refy = vec![0f32; m * n];
                        reference::qmv_wide(&x, m, &w, &mut refy);
                        let wide = qmv_run(be, QmvShape { n, k, m, spec, scales: sd, act }, &w, &xbits);
                        let wide3 =
                            qmv_run(be, QmvShape { n, k, m: 3, spec, scales: sd, act }, &w, &xbits[..3 * k]);
                        for i in 0..m {
                            let xi = &x[i * k..(i + 1) * k];
                            let one = qmv_run(
                                be,
                                QmvShape { n, k, m: 1, spec, scales: sd, act },
                                &w,
                                &xbits[i * k..(i + 1) * k],
                            );
                            for r in 0..n {
                                let at = format!("{bits}-bit g{g} {sd:?} {act:?} k {k} row {i} out {r}");
                                let (y, e) = (wide[i * n + r], exact[i * n + r]);
                                let bound = qmv_bound(&w, xi, r);
                                assert!(
                                    (y as f64 - e).abs() <= bound,
                                    "{at}: {y} vs exact {e}, bound {bound}"
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
                                    worst = worst.max((y as f64 - e).abs() / bound);
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

pub fn rms_norm_matches_the_f64_formula_within_its_bound(be: &impl Backend) {
    // RMS_NORM_BOUND: the sum of d squares costs gamma(d) relatively, the mean, the sqrt,
    // the division and the two products u each, so the output is within
    // (gamma(d) / 2 + 5u) relatively of exact in f32 (first order), plus the storage's
    // half ulp; charged as (gamma(d) + 8u + round) |exact|.
    let mut rng = Rng(7);
    for d in [7usize, 256, 896, 1000] {
        for out in [Out::F32, Out::F16, Out::Bf16] {
            let rows = 3;
            let x: Vec<f32> = (0..rows * d).map(|_| rng.sym(3.0)).collect();
            let wt: Vec<f32> = (0..d).map(|_| 1.0 + rng.sym(0.5)).collect();
            let eps = 1e-6f32;
            let (bx, bw, by) = (up(be, &x), up(be, &wt), be.upload(&poisoned(out, rows * d)));
            be.run(&launch::rms_norm(rows, d, eps, out, bx.addr(), bw.addr(), by.addr()).unwrap());
            let y = by.read();
            for r in 0..rows {
                let xr = &x[r * d..(r + 1) * d];
                let ms = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
                let inv = 1.0 / (ms + eps as f64).sqrt();
                for j in 0..d {
                    let e = xr[j] as f64 * inv * wt[j] as f64;
                    let got = out_value(out, &y, r * d + j);
                    let bound = (gamma(d) + 8.0 * U + out_round(out)) * e.abs() + out_floor(out);
                    assert!((got - e).abs() <= bound, "d {d} {out:?} row {r} [{j}]: {got} vs {e}");
                }
            }
        }
    }
}

pub fn silu_mul_and_add_match_their_formulas(be: &impl Backend) {
    // SILU_BOUND: e^-g is off by EXP_REL_ERROR (kiln-core's charge for an f32 exp), and
    // its share of 1 + e^-g is below 1; the sum, the division and the product add u each:
    // (EXP_REL_ERROR + 5u) |exact| plus the storage's half ulp (and, for f16's
    // subnormals, its absolute floor).
    let mut rng = Rng(11);
    let len = 1000;
    let gate: Vec<f32> = (0..len).map(|_| rng.sym(12.0)).collect();
    let upv: Vec<f32> = (0..len).map(|_| rng.sym(2.0)).collect();
    for out in [Out::F32, Out::F16, Out::Bf16] {
        let (bg, bu, by) = (up(be, &gate), up(be, &upv), be.upload(&poisoned(out, len)));
        be.run(&launch::silu_mul(len, out, bg.addr(), bu.addr(), by.addr()).unwrap());
        let y = by.read();
        for i in 0..len {
            let g = gate[i] as f64;
            let e = g / (1.0 + (-g).exp()) * upv[i] as f64;
            let got = out_value(out, &y, i);
            let bound = (EXP_REL_ERROR + 5.0 * U + out_round(out)) * e.abs() + out_floor(out);
            assert!((got - e).abs() <= bound, "{out:?} [{i}]: {got} vs {e}");
        }
    }
    let x: Vec<f32> = (0..len).map(|_| rng.sym(5.0)).collect();
    let y: Vec<f32> = (0..len).map(|_| rng.sym(5.0)).collect();
    let want: Vec<u32> = x.iter().zip(&y).map(|(a, b)| (a + b).to_bits()).collect();
    let (bx, by) = (up(be, &x), up(be, &y));
    be.run(&launch::add(len, bx.addr(), by.addr()).unwrap());
    let got: Vec<u32> = f32s(&bx.read()).iter().map(|v| v.to_bits()).collect();
    assert_eq!(got, want, "the residual add is one f32 addition per element");
    // The bias: rows of 40 (not a multiple of the block), each element one f32 addition.
    let n = 40;
    let bias: Vec<f32> = (0..n).map(|_| rng.sym(3.0)).collect();
    let want: Vec<u32> = y.iter().enumerate().map(|(i, v)| (v + bias[i % n]).to_bits()).collect();
    let (by, bb) = (up(be, &y), up(be, &bias));
    be.run(&launch::add_bias(len, n, by.addr(), bb.addr()).unwrap());
    let got: Vec<u32> = f32s(&by.read()).iter().map(|v| v.to_bits()).collect();
    assert_eq!(got, want, "the bias is one f32 addition per element, broadcast over rows");
}

/// kiln-model's `Rope::apply` for one row, from the same frequencies: f32 angle, cosine
/// and sine in f64 rounded to f32, then `x1 c - x2 s` and `x2 c + x1 s` in f32.
fn rope_reference(x: &mut [f32], pos: usize, inv_freq: &[f32]) {
    let half = inv_freq.len();
    for head in x.chunks_exact_mut(2 * half) {
        for (i, &f) in inv_freq.iter().enumerate() {
            let a = (pos as f32 * f) as f64;
            let (c, s) = (a.cos() as f32, a.sin() as f32);
            let (x1, x2) = (head[i], head[i + half]);
            head[i] = x1 * c - x2 * s;
            head[i + half] = x2 * c + x1 * s;
        }
    }
}

pub fn rope_rotates_as_kiln_model_does_for_default_and_scaled_frequencies(be: &impl Backend) {
    // The kernel evaluates the same operations as kiln-model; on the host (the same C
    // library's cos and sin) the bits agree. On a device, cos and sin in double may
    // differ from the host's in the last place of a double, which can move the rounded
    // f32 by one ulp: ROPE_DEVICE_BOUND = (|x1| + |x2|) * 2^-23 + 2u |out| per element.
    let mut rng = Rng(3);
    for head_dim in [8usize, 64, 128] {
        let half = head_dim / 2;
        let heads = 3;
        let positions: Vec<i32> = vec![0, 17, 4099];
        // Default frequencies (theta 500000), then the same divided by 8 past the middle,
        // as llama3 and linear scaling make them: the kernel takes any table.
        let mut inv_freq: Vec<f32> =
            (0..half).map(|i| (1.0 / 500_000f64.powf((2 * i) as f64 / head_dim as f64)) as f32).collect();
        for f in &mut inv_freq[half / 2..] {
            *f /= 8.0;
        }
        let rows = positions.len();
        let x0: Vec<f32> = (0..rows * heads * head_dim).map(|_| rng.sym(4.0)).collect();
        let (bx, bp, bf) = (up(be, &x0), up(be, &positions), up(be, &inv_freq));
        be.run(&launch::rope(rows, heads, head_dim, bx.addr(), bp.addr(), bf.addr()).unwrap());
        let x = f32s(&bx.read());
        let mut want = x0.clone();
        for (r, &p) in positions.iter().enumerate() {
            rope_reference(
                &mut want[r * heads * head_dim..(r + 1) * heads * head_dim],
                p as usize,
                &inv_freq,
            );
        }
        if be.host_libm() {
            let got: Vec<u32> = x.iter().map(|v| v.to_bits()).collect();
            let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "head_dim {head_dim}");
        } else {
            for (i, (&g, &w)) in x.iter().zip(&want).enumerate() {
                let h = i % head_dim;
                let (a, b) = (h % half, half + h % half);
                let base = i - h;
                let mag = (x0[base + a].abs() + x0[base + b].abs()) as f64;
                let bound = mag * 2f64.powi(-23) + 2.0 * U * w.abs() as f64;
                assert!((g as f64 - w as f64).abs() <= bound, "head_dim {head_dim} [{i}]: {g} vs {w}");
            }
        }
    }
}

pub fn embedding_rows_are_the_formats_dequantization_bit_for_bit(be: &impl Backend) {
    let mut rng = Rng(5);
    for bits in [2u32, 3, 4, 5, 6, 8] {
        for g in [32usize, 64, 128] {
            for sd in [ScaleDtype::F16, ScaleDtype::Bf16, ScaleDtype::F32] {
                let (vocab, d) = (11, 2 * g + g * (bits as usize % 2)); // some rows not a multiple of 256
                let spec = QuantSpec::new(bits, g).unwrap();
                let wf: Vec<f32> = (0..vocab * d).map(|_| rng.sym(1.0)).collect();
                let table = quantize_as(&wf, vocab, d, spec, sd).unwrap();
                let (scales, biases) = (raw(table.scales()), raw(table.biases()));
                let tokens: Vec<i32> = vec![10, 0, 3, -1, 11, 3];
                let shape = EmbedShape { rows: tokens.len(), vocab, d, spec, scales: sd };
                let (bp, bs, bb) = (up(be, table.packed()), be.upload(&scales), be.upload(&biases));
                let (bt, bo) = (up(be, &tokens), be.upload(&poisoned(Out::F32, tokens.len() * d)));
                let l = shape
                    .launch(EmbedBuffers {
                        packed: bp.addr(),
                        scales: bs.addr(),
                        biases: bb.addr(),
                        tokens: bt.addr(),
                        out: bo.addr(),
                    })
                    .unwrap();
                be.run(&l);
                let out = f32s(&bo.read());
                let mut row = vec![0f32; d];
                for (i, &t) in tokens.iter().enumerate() {
                    let got = &out[i * d..(i + 1) * d];
                    if !(0..vocab as i32).contains(&t) {
                        assert!(got.iter().all(|v| v.is_nan()), "token {t} outside the vocabulary is NaN");
                        continue;
                    }
                    table.dequantize_row(t as usize, &mut row);
                    let g_bits: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                    let w_bits: Vec<u32> = row.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(g_bits, w_bits, "{bits}-bit g{g} {sd:?} token {t}");
                }
            }
        }
    }
}

struct Cache {
    keys: Vec<u16>,
    values: Vec<u16>,
}

fn attn_run(be: &impl Backend, shape: AttnShape, q: &[f32], cache: &Cache) -> Vec<u8> {
    assert_eq!((size_of_val(q), size_of_val(&cache.keys[..])), (shape.q_bytes(), shape.cache_bytes()));
    let (bq, bk, bv) = (up(be, q), up(be, &cache.keys), up(be, &cache.values));
    let scratch = be.upload(&poisoned(Out::F32, shape.scratch_bytes() / 4));
    let out = be.upload(&poisoned(shape.out, shape.out_bytes() / shape.out.size()));
    let [split, merge] = shape
        .launches(AttnBuffers {
            q: bq.addr(),
            keys: bk.addr(),
            values: bv.addr(),
            scratch: scratch.addr(),
            out: out.addr(),
        })
        .unwrap();
    be.run(&split);
    be.run(&merge);
    out.read()
}

pub fn decode_attention_matches_the_exact_softmax_within_kiln_cores_bound(be: &impl Backend) {
    // ATTN_BOUND: kiln-core's attn::reference::error_bound, the f32 rounding bound of an
    // online softmax, charged for the corrections a weight can pass through here: one per
    // key a warp folds after it (at most 64 of a span's 256), the three merges of the
    // warps' states and one per span merged. The f16 and bf16 outputs add their half ulp.
    let mut rng = Rng(99);
    let kv_heads = 2;
    for (group, head_dim) in [(1usize, 64usize), (4, 80), (7, 128), (8, 32), (2, 256)] {
        for (start, rows) in [(0usize, 1usize), (4, 1), (254, 3), (600, 2)] {
            for out in [Out::F32, Out::F16, Out::Bf16] {
                let capacity = start + rows + 5;
                let cache = Cache {
                    keys: (0..kv_heads * capacity * head_dim)
                        .map(|_| f16::from_f32(rng.sym(1.5)).to_bits())
                        .collect(),
                    values: (0..kv_heads * capacity * head_dim)
                        .map(|_| f16::from_f32(rng.sym(2.0)).to_bits())
                        .collect(),
                };
                let qdim = kv_heads * group * head_dim;
                let q: Vec<f32> = (0..rows * qdim).map(|_| rng.sym(2.0)).collect();
                let shape = AttnShape { rows, start, kv_heads, group, head_dim, capacity, out };
                let got = attn_run(be, shape, &q, &cache);
                let ds = DecodeShape::new(group, head_dim);
                for r in 0..rows {
                    let len = start + r + 1;
                    let spans = len.div_ceil(launch::ATTN_SPAN);
                    for h in 0..kv_heads {
                        let f = |c: &[u16]| -> Vec<f32> {
                            c[h * capacity * head_dim..(h * capacity + len) * head_dim]
                                .iter()
                                .map(|&b| f16::from_bits(b).to_f32())
                                .collect()
                        };
                        let (k, v) = (f(&cache.keys), f(&cache.values));
                        let qh = &q[r * qdim + h * group * head_dim..r * qdim + (h + 1) * group * head_dim];
                        let exact = attn_ref::attend(&ds, qh, &k, &v);
                        let bound = attn_ref::error_bound(&ds, qh, &k, &v, 64 + 3 + spans);
                        for e in 0..group * head_dim {
                            let o = out_value(out, &got, r * qdim + h * group * head_dim + e);
                            let b = bound[e] + out_round(out) * exact[e].abs() + out_floor(out);
                            assert!(
                                (o - exact[e]).abs() <= b,
                                "group {group} hd {head_dim} start {start} row {r} head {h} [{e}] {out:?}: \
                                 {o} vs {} (bound {b})",
                                exact[e]
                            );
                        }
                    }
                }
                // A verify's rows are the one-row decodes at their positions, bit for bit.
                if rows > 1 {
                    for r in 0..rows {
                        let one = AttnShape { rows: 1, start: start + r, ..shape };
                        let single = attn_run(be, one, &q[r * qdim..(r + 1) * qdim], &cache);
                        let n = qdim * out.size();
                        assert_eq!(
                            &got[r * n..(r + 1) * n],
                            &single[..],
                            "group {group} hd {head_dim} row {r}"
                        );
                    }
                }
            }
        }
    }
}

pub fn kv_store_rounds_new_keys_and_values_to_f16_in_place(be: &impl Backend) {
    let mut rng = Rng(21);
    let (kv_heads, head_dim, capacity, start, rows) = (3usize, 80usize, 40usize, 29usize, 4usize);
    let k: Vec<f32> = (0..rows * kv_heads * head_dim).map(|_| rng.sym(70_000.0) * rng.sym(1.0)).collect();
    let v: Vec<f32> = (0..rows * kv_heads * head_dim).map(|_| rng.sym(1e-4)).collect();
    let old: Vec<u16> = (0..kv_heads * capacity * head_dim).map(|i| i as u16).collect();
    let (bk, bv, bkc, bvc) = (up(be, &k), up(be, &v), up(be, &old), up(be, &old));
    let l = launch::kv_store(
        rows,
        kv_heads,
        head_dim,
        capacity,
        start,
        bk.addr(),
        bv.addr(),
        bkc.addr(),
        bvc.addr(),
    );
    be.run(&l.unwrap());
    let u16s =
        |b: Vec<u8>| -> Vec<u16> { b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect() };
    let (kc, vc) = (u16s(bkc.read()), u16s(bvc.read()));
    for h in 0..kv_heads {
        for p in 0..capacity {
            for d in 0..head_dim {
                let at = (h * capacity + p) * head_dim + d;
                let (wk, wv) = if (start..start + rows).contains(&p) {
                    let i = ((p - start) * kv_heads + h) * head_dim + d;
                    (f16::from_f32(k[i]).to_bits(), f16::from_f32(v[i]).to_bits())
                } else {
                    (old[at], old[at])
                };
                assert_eq!((kc[at], vc[at]), (wk, wv), "head {h} position {p} [{d}]");
            }
        }
    }
}

/// `QMM_BOUND`: how far `qmm` may land from the exact product. The kernel dequantizes each
/// weight as the format does (`s * q + b`, two f32 roundings) and rounds it to the
/// activations' dtype for the tensor cores (half an ulp, `r` = 2^-11 for f16, 2^-8 for
/// bf16, and for f16 an absolute floor of 2^-25 below its normal range), so the weights it
/// multiplies are within `(r + 3u) |w| + floor` of the exact ones. The products of two
/// 16-bit values are exact in f32; the tensor cores sum each step of 16 into the f32
/// accumulator in an order and with internal roundings of their own, charged as twice the
/// bound of a K-term f32 sum: `2 gamma(K + 1) sum |w x| (1 + r)`.
fn qmm_bound(w: &[f32], x: &[f32], act: Act) -> f64 {
    let (r, floor) = match act {
        Act::F16 => (F16_ROUND, 1.0 / 33_554_432.0),
        Act::Bf16 => (BF16_ROUND, 0.0),
    };
    let mag: f64 = w.iter().zip(x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
    let xs: f64 = x.iter().map(|&b| (b as f64).abs()).sum();
    (r + 3.0 * U) * mag + floor * xs + 2.0 * gamma(x.len() + 1) * mag * (1.0 + r)
}

fn qmm_run(be: &impl Backend, shape: QmmShape, w: &QuantizedMatrix, xbits: &[u16]) -> Vec<f32> {
    let (scales, biases) = (raw(w.scales()), raw(w.biases()));
    let (bp, bs, bb) = (up(be, w.packed()), be.upload(&scales), be.upload(&biases));
    let (bx, by) = (up(be, xbits), be.upload(&poisoned(Out::F32, shape.m * shape.n)));
    assert_eq!(xbits.len(), shape.m * shape.k);
    let l = shape
        .launch(QmvBuffers {
            packed: bp.addr(),
            scales: bs.addr(),
            biases: bb.addr(),
            x: bx.addr(),
            y: by.addr(),
        })
        .unwrap();
    be.run(&l);
    f32s(&by.read())
}

pub fn qmm_matches_the_exact_product_within_its_bound_and_rows_do_not_depend_on_m(be: &impl Backend) {
    let mut rng = Rng(0x9a11);
    let n = 37; // two blocks of 32 weight rows, the second partial, and a partial warp tile
    for bits in [4u32, 8] {
        for (g, k) in [(32usize, 96usize), (64, 320), (128, 256)] {
            let spec = QuantSpec::new(bits, g).unwrap();
            for sd in [ScaleDtype::F16, ScaleDtype::Bf16, ScaleDtype::F32] {
                for act in [Act::F16, Act::Bf16] {
                    let wf: Vec<f32> = (0..n * k).map(|_| rng.sym(1.0)).collect();
                    let w = quantize_as(&wf, n, k, spec, sd).unwrap();
                    let wd = reference::dequantize(&w);
                    let m = 33; // three tiles of 16 rows, the last with one
                    let (xbits, x) = activations(&mut rng, m * k, act);
                    let exact = reference::matmul_f64(&x, m, &w);
                    let y = qmm_run(be, QmmShape { n, k, m, spec, scales: sd, act }, &w, &xbits);
                    let y17 =
                        qmm_run(be, QmmShape { n, k, m: 17, spec, scales: sd, act }, &w, &xbits[..17 * k]);
                    for i in 0..m {
                        for r in 0..n {
                            let at = format!("{bits}-bit g{g} {sd:?} {act:?} k {k} row {i} out {r}");
                            let (got, e) = (y[i * n + r], exact[i * n + r]);
                            let bound = qmm_bound(&wd[r * k..(r + 1) * k], &x[i * k..(i + 1) * k], act);
                            assert!(
                                (got as f64 - e).abs() <= bound,
                                "{at}: {got} vs exact {e}, bound {bound}"
                            );
                            if i < 17 {
                                assert_eq!(
                                    got.to_bits(),
                                    y17[i * n + r].to_bits(),
                                    "{at}: m 33 and m 17 differ"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// kiln-model's `moe::route`: softmax, the top-k probabilities (ties to the lower
/// index), ascending by expert, renormalised when `norm` is set.
fn route_reference(logits: &[f32], top_k: usize, norm: bool) -> (Vec<i32>, Vec<f32>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut p: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = p.iter().sum();
    for v in &mut p {
        *v /= sum;
    }
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    let mut experts: Vec<usize> = order[..top_k].to_vec();
    experts.sort_unstable();
    let mut weights: Vec<f32> = experts.iter().map(|&e| p[e]).collect();
    if norm {
        let s: f32 = weights.iter().sum();
        for w in &mut weights {
            *w /= s;
        }
    }
    (experts.iter().map(|&e| e as i32).collect(), weights)
}

pub fn moe_route_picks_kiln_models_experts_and_weights(be: &impl Backend) {
    // Bit for bit on the host (the same operations, in the same order, and the C
    // library's exp). On a device, expf may differ in the last place: ROUTE_DEVICE_BOUND
    // charges each weight (EXP_REL_ERROR + 4u) relatively for the exp, the sum and the
    // division, doubled when renormalised.
    let mut rng = Rng(77);
    let rows = 37; // two blocks, the second partial
    for experts in [8usize, 60, 128] {
        for top_k in [1usize, 2, 8] {
            for norm in [false, true] {
                let mut logits: Vec<f32> = (0..rows * experts).map(|_| rng.sym(4.0)).collect();
                // Exact ties, which must go to the lower index.
                for r in 0..rows {
                    logits[r * experts + experts - 1] = logits[r * experts + 1];
                }
                let bl = up(be, &logits);
                let (bc, bw) =
                    (up(be, &vec![-1i32; rows * top_k]), be.upload(&poisoned(Out::F32, rows * top_k)));
                be.run(
                    &launch::moe_route(rows, experts, top_k, norm, bl.addr(), bc.addr(), bw.addr()).unwrap(),
                );
                let chosen: Vec<i32> =
                    bc.read().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect();
                let weights = f32s(&bw.read());
                for r in 0..rows {
                    let at = format!("{experts} experts top {top_k} norm {norm} row {r}");
                    let (we, ww) = route_reference(&logits[r * experts..(r + 1) * experts], top_k, norm);
                    assert_eq!(&chosen[r * top_k..(r + 1) * top_k], &we[..], "{at}");
                    let got = &weights[r * top_k..(r + 1) * top_k];
                    if be.host_libm() {
                        let g: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                        let w: Vec<u32> = ww.iter().map(|v| v.to_bits()).collect();
                        assert_eq!(g, w, "{at}");
                    } else {
                        let rel = (EXP_REL_ERROR + 4.0 * U) * if norm { 2.0 } else { 1.0 };
                        for (g, w) in got.iter().zip(&ww) {
                            assert!(((g - w) as f64).abs() <= rel * (*w as f64).abs(), "{at}: {g} vs {w}");
                        }
                    }
                }
            }
        }
    }
}

pub fn moe_gather_and_accumulate_follow_kiln_models_expert_loop(be: &impl Backend) {
    // Three experts over 9 rows, each row routed to two of them; the experts run in
    // ascending order and their outputs add up as kiln-model's loop adds them, bit for bit.
    let mut rng = Rng(31);
    let (rows, hidden) = (9usize, 300usize);
    let x: Vec<u16> = (0..rows * hidden).map(|_| f16::from_f32(rng.sym(3.0)).to_bits()).collect();
    let bx = up(be, &x);
    let mut want = vec![0f32; rows * hidden];
    let bout = up(be, &want);
    for e in 0..3usize {
        let members: Vec<i32> = (0..rows as i32).filter(|&r| !(r as usize + e).is_multiple_of(3)).collect();
        let weights: Vec<f32> = members.iter().map(|_| rng.sym(1.0)).collect();
        let m = members.len();
        let (bidx, bw) = (up(be, &members), up(be, &weights));
        let bxe = be.upload(&vec![0xffu8; m * hidden * 2]);
        be.run(&launch::gather_rows(m, hidden, bx.addr(), bidx.addr(), bxe.addr()).unwrap());
        let xe = bxe.read();
        for (i, &r) in members.iter().enumerate() {
            let got: Vec<u16> = xe[i * hidden * 2..(i + 1) * hidden * 2]
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect();
            assert_eq!(&got[..], &x[r as usize * hidden..(r as usize + 1) * hidden], "expert {e} row {r}");
        }
        // Stand-in for the expert's output.
        let ye: Vec<f32> = (0..m * hidden).map(|_| rng.sym(2.0)).collect();
        let bye = up(be, &ye);
        be.run(&launch::moe_accumulate(m, hidden, bout.addr(), bye.addr(), bidx.addr(), bw.addr()).unwrap());
        for (i, &r) in members.iter().enumerate() {
            let dst = &mut want[r as usize * hidden..(r as usize + 1) * hidden];
            for (d, &y) in dst.iter_mut().zip(&ye[i * hidden..(i + 1) * hidden]) {
                *d += weights[i] * y;
            }
        }
    }
    let got: Vec<u32> = f32s(&bout.read()).iter().map(|v| v.to_bits()).collect();
    let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
    assert_eq!(got, want);
}
