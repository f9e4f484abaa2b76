//! Portable kernels in plain Rust, parallel over weight rows.
//!
//! - 4- and 8-bit weights follow the integer scheme of the SIMD kernels (activations
//!   quantized per group by [`super::act`], exact integer group dots, the float order of
//!   [`Lanes`]), so on every target their outputs are bit-identical to AVX2's and NEON's.
//! - 2-, 3-, 5- and 6-bit weights keep f32 activations: per group `s * sum(q x) + b * sum(x)`.
//! - [`qmm_sgemm`] dequantizes tiles of weight rows to f32 and multiplies with
//!   `matrixmultiply::sgemm`: the GEMM for widths without an integer path.
//!
//! In every case one weight row is unpacked once per task and reused for every activation
//! row, so `qmv`, `qmv_wide` and the integer `qmm` compute each output the same way.

use std::ops::Range;

use super::act::{ActCodes, GroupQuant, GroupTerms, Lanes, XRows};
use super::drive;
use crate::matrix::{QuantizedMatrix, ScaleData};

/// Bytes of unpacked codes (one byte per element) a task keeps for its block of rows.
const CODE_BLOCK_BYTES: usize = 256 << 10;
/// Bytes of dequantized f32 weights one `sgemm` tile holds: half a typical L2.
const SGEMM_TILE_BYTES: usize = 512 << 10;

/// Widens `out.len()` scales or biases starting at `start` to f32.
pub(crate) fn widen(sd: &ScaleData, start: usize, out: &mut [f32]) {
    match sd {
        ScaleData::F16(v) => {
            for (o, h) in out.iter_mut().zip(&v[start..]) {
                *o = h.to_f32();
            }
        }
        ScaleData::Bf16(v) => {
            for (o, h) in out.iter_mut().zip(&v[start..]) {
                *o = h.to_f32();
            }
        }
        ScaleData::F32(v) => out.copy_from_slice(&v[start..start + out.len()]),
    }
}

/// Unpacks codes `e0 .. e0 + out.len()` of a row's bit stream; `e0` is a multiple of 32,
/// so it starts on a word boundary for every width.
pub(crate) fn unpack(row: &[u32], bits: u32, e0: usize, out: &mut [u8]) {
    debug_assert_eq!(e0 % 32, 0);
    let w0 = e0 * bits as usize / 32;
    match bits {
        8 => {
            for (o, w) in out.chunks_exact_mut(4).zip(&row[w0..]) {
                o.copy_from_slice(&w.to_le_bytes());
            }
        }
        4 => {
            for (o, &w) in out.chunks_exact_mut(8).zip(&row[w0..]) {
                for (i, v) in o.iter_mut().enumerate() {
                    *v = ((w >> (4 * i)) & 0xF) as u8;
                }
            }
        }
        2 => {
            for (o, &w) in out.chunks_exact_mut(16).zip(&row[w0..]) {
                for (i, v) in o.iter_mut().enumerate() {
                    *v = ((w >> (2 * i)) & 0x3) as u8;
                }
            }
        }
        _ => {
            // Widths that straddle words: a 64-bit bit buffer refilled a word at a time,
            // never reading past the words the range covers.
            let mask = (1u64 << bits) - 1;
            let (mut buf, mut have, mut wi) = (0u64, 0u32, w0);
            for o in out.iter_mut() {
                if have < bits {
                    buf |= u64::from(row[wi]) << have;
                    wi += 1;
                    have += 32;
                }
                *o = (buf & mask) as u8;
                buf >>= bits;
                have -= bits;
            }
        }
    }
}

/// Unpacks rows `rows` of `w` into `codes` (`rows.len() * k` bytes) and widens their
/// scales and biases into `s` and `b` (`rows.len() * groups per row`).
fn unpack_rows(w: &QuantizedMatrix, rows: Range<usize>, codes: &mut [u8], s: &mut [f32], b: &mut [f32]) {
    let (k, bits) = (w.k(), w.spec().bits());
    let gpr = w.spec().groups_per_row(k);
    for (i, r) in rows.enumerate() {
        unpack(w.row_words(r), bits, 0, &mut codes[i * k..(i + 1) * k]);
        widen(w.scales(), r * gpr, &mut s[i * gpr..(i + 1) * gpr]);
        widen(w.biases(), r * gpr, &mut b[i * gpr..(i + 1) * gpr]);
    }
}

/// Rows per task: enough work per task, and a block of unpacked codes that stays in L2.
fn block_rows(w: &QuantizedMatrix) -> usize {
    let by_cache = (CODE_BLOCK_BYTES / w.k()).max(1);
    drive::rows_per_task(w.n(), w.bytes_read() / w.n()).min(by_cache)
}

/// `y[m, n] = x[m, k] W^T` for any width and any `m`: the integer scheme with `codes`
/// when there are some (4 and 8 bits, not `f32`), f32 activations otherwise.
pub(crate) fn matmul(x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32], codes: Option<ActCodes>) {
    match codes {
        Some(codes) => int_rows(x, m, w, y, codes),
        None => f32_rows(x, m, w, y),
    }
}

/// The integer scheme: quantized activations, exact integer group dots, [`Lanes`].
fn int_rows(x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32], codes_kind: ActCodes) {
    let (n, k, g) = (w.n(), w.k(), w.spec().group_size());
    let gpr = k / g;
    let xq = XRows::new(x, m, k, g, codes_kind);
    let rpt = block_rows(w);
    drive::rows_multi(y, m, n, rpt, |rows, outs| {
        let nr = rows.len();
        let mut codes = vec![0u8; nr * k];
        let (mut s, mut b) = (vec![0f32; nr * gpr], vec![0f32; nr * gpr]);
        unpack_rows(w, rows, &mut codes, &mut s, &mut b);
        let center = codes_kind.center();
        for (i, out) in outs.iter_mut().enumerate() {
            let xc = &xq.codes[i * k..(i + 1) * k];
            for (j, o) in out.iter_mut().enumerate() {
                let mut lanes = Lanes::default();
                let wc = &codes[j * k..(j + 1) * k];
                for gi in 0..gpr {
                    let span = gi * g..(gi + 1) * g;
                    let xi = i * gpr + gi;
                    let x = GroupQuant { sx: xq.sx[xi], xsum: xq.xsum[xi], qsum: xq.qsum[xi] };
                    let tot = int_dot(&wc[span.clone()], &xc[span]);
                    lanes.add_group(
                        gi,
                        center,
                        GroupTerms { tot, s: s[j * gpr + gi], b: b[j * gpr + gi], x },
                    );
                }
                *o = lanes.finish();
            }
        }
    });
}

/// Exact integer dot of unsigned codes and activation codes (at most 128 * 255 * 32767,
/// which fits an i32). Every code width is held as i16 here, so this one loop serves them
/// all.
#[inline]
fn int_dot(w: &[u8], x: &[i16]) -> i32 {
    w.iter().zip(x).map(|(&a, &b)| i32::from(a) * i32::from(b)).sum()
}

/// f32 activations: per group `s * sum(q x) + b * sum(x)`, accumulated in order.
fn f32_rows(x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32]) {
    let (n, k, g) = (w.n(), w.k(), w.spec().group_size());
    let gpr = k / g;
    // Exact group sums of x, rounded once, as the integer scheme keeps them.
    let xsum: Vec<f32> =
        x.chunks_exact(g).map(|c| c.iter().map(|&v| f64::from(v)).sum::<f64>() as f32).collect();
    let rpt = block_rows(w);
    drive::rows_multi(y, m, n, rpt, |rows, outs| {
        let nr = rows.len();
        let mut codes = vec![0u8; nr * k];
        let (mut s, mut b) = (vec![0f32; nr * gpr], vec![0f32; nr * gpr]);
        unpack_rows(w, rows, &mut codes, &mut s, &mut b);
        for (i, out) in outs.iter_mut().enumerate() {
            let xr = &x[i * k..(i + 1) * k];
            for (j, o) in out.iter_mut().enumerate() {
                let wc = &codes[j * k..(j + 1) * k];
                let mut acc = 0f32;
                for gi in 0..gpr {
                    let span = gi * g..(gi + 1) * g;
                    let qx = f32_dot(&wc[span.clone()], &xr[span]);
                    acc += s[j * gpr + gi] * qx + b[j * gpr + gi] * xsum[i * gpr + gi];
                }
                *o = acc;
            }
        }
    });
}

/// `sum(q x)` over a group in eight interleaved lanes (so the compiler can vectorise it)
/// summed as a tree.
#[inline]
fn f32_dot(q: &[u8], x: &[f32]) -> f32 {
    let mut l = [0f32; 8];
    for (qc, xc) in q.chunks_exact(8).zip(x.chunks_exact(8)) {
        for i in 0..8 {
            l[i] += f32::from(qc[i]) * xc[i];
        }
    }
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// Dequantizes rows `rows` into `out` (`rows.len() * k`) exactly as
/// [`QuantizedMatrix::dequantize_row`] does: `scale * q + bias`, rounded after each step.
fn dequantize_rows(w: &QuantizedMatrix, rows: Range<usize>, codes: &mut [u8], out: &mut [f32]) {
    let (k, g, bits) = (w.k(), w.spec().group_size(), w.spec().bits());
    let gpr = k / g;
    let (mut s, mut b) = (vec![0f32; gpr], vec![0f32; gpr]);
    for (i, r) in rows.enumerate() {
        unpack(w.row_words(r), bits, 0, codes);
        widen(w.scales(), r * gpr, &mut s);
        widen(w.biases(), r * gpr, &mut b);
        for (gi, (o, q)) in out[i * k..(i + 1) * k].chunks_exact_mut(g).zip(codes.chunks_exact(g)).enumerate()
        {
            for (ov, &qv) in o.iter_mut().zip(q) {
                *ov = s[gi] * f32::from(qv) + b[gi];
            }
        }
    }
}

/// `qmm` by dequantizing tiles of weight rows to f32 and calling `matrixmultiply::sgemm`:
/// exact f32 activations, for any width.
pub(crate) fn qmm_sgemm(x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32]) {
    let (n, k) = (w.n(), w.k());
    let tile = (SGEMM_TILE_BYTES / (4 * k)).max(8);
    let rpt = drive::rows_per_task(n, w.bytes_read() / n).max(tile.min(n));
    drive::rows_multi(y, m, n, rpt, |rows, outs| {
        let mut codes = vec![0u8; k];
        let mut wt = vec![0f32; tile * k];
        let mut c = vec![0f32; m * tile];
        let r0 = rows.start;
        for t0 in rows.clone().step_by(tile) {
            let nt = tile.min(rows.end - t0);
            dequantize_rows(w, t0..t0 + nt, &mut codes, &mut wt[..nt * k]);
            // SAFETY: `x` holds m * k values read with row stride k; `wt` holds nt * k
            // values read as the k x nt matrix W_tile^T (row stride 1, column stride k);
            // `c` holds at least m * nt values written as an m x nt matrix with row stride
            // nt. All three are live, distinct allocations for the whole call.
            unsafe {
                matrixmultiply::sgemm(
                    m,
                    k,
                    nt,
                    1.0,
                    x.as_ptr(),
                    k as isize,
                    1,
                    wt.as_ptr(),
                    1,
                    k as isize,
                    0.0,
                    c.as_mut_ptr(),
                    nt as isize,
                    1,
                );
            }
            for (i, out) in outs.iter_mut().enumerate() {
                out[t0 - r0..t0 - r0 + nt].copy_from_slice(&c[i * nt..(i + 1) * nt]);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{QuantSpec, SUPPORTED_BITS, read_code, write_code};

    #[test]
    fn unpack_matches_read_code_for_every_width() {
        for &bits in &SUPPORTED_BITS {
            let spec = QuantSpec::new(bits, 32).unwrap();
            let k = 160;
            let mut row = vec![0u32; spec.words_per_row(k)];
            for j in 0..k {
                write_code(&mut row, j, bits, (j as u32 * 11 + 5) % (spec.max_code() + 1));
            }
            for e0 in [0, 32, 96] {
                let mut out = vec![0u8; 64];
                unpack(&row, bits, e0, &mut out);
                for (j, &v) in out.iter().enumerate() {
                    assert_eq!(u32::from(v), read_code(&row, e0 + j, bits), "bits {bits} e0 {e0} j {j}");
                }
            }
        }
    }
}
