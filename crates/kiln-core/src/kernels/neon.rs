//! NEON kernels (aarch64) for 4- and 8-bit weights at every group size.
//!
//! They follow the integer scheme of [`super::act`] with natural-order activation codes
//! held as 16 bits (every scheme's codes, 8-bit ones included, fit): per 16 packed bytes the codes are unpacked in registers (4-bit: `and 0x0F` and
//! `>> 4`, zipped back into element order), widened to 16 bits and multiplied into i32
//! lanes with `vmlal_s16`, once per weight group and reused for up to eight activation
//! rows. The float work is [`Lanes`], so the outputs are bit-identical to the AVX2 and
//! portable kernels'. NEON is part of the aarch64 baseline: no run-time detection.

use std::arch::aarch64::*;

use super::act::{ActCodes, GroupQuant, GroupTerms, Lanes, TILE_ROWS, XRows};
use super::drive;
use super::portable::widen;
use crate::matrix::QuantizedMatrix;

/// `y[m, n] = x[m, k] W^T` for 4- or 8-bit weights with activation codes `codes`;
/// `qmv`, `qmv_wide` and `qmm` alike.
pub(super) fn matmul(x: &[f32], m: usize, w: &QuantizedMatrix, y: &mut [f32], codes: ActCodes) {
    let (n, k) = (w.n(), w.k());
    let spec = w.spec();
    let (bits, g) = (spec.bits(), spec.group_size());
    assert!(bits == 4 || bits == 8, "the NEON kernels take 4- and 8-bit weights only");
    let gpr = k / g;
    let xq = XRows::new(x, m, k, g, codes);
    let row_bytes = k * bits as usize / 8;
    let packed: &[u8] = bytemuck::cast_slice(w.packed());
    let rpt = drive::rows_per_task(n, w.bytes_read() / n);
    drive::rows_multi(y, m, n, rpt, |rows, outs| {
        let (mut s, mut b) = (vec![0f32; gpr], vec![0f32; gpr]);
        let mut lanes = vec![Lanes::default(); m];
        let mut tot = [0i32; TILE_ROWS];
        let r0 = rows.start;
        for r in rows {
            widen(w.scales(), r * gpr, &mut s);
            widen(w.biases(), r * gpr, &mut b);
            let wrow = &packed[r * row_bytes..(r + 1) * row_bytes];
            lanes.fill(Lanes::default());
            for gi in 0..gpr {
                let wg = &wrow[gi * g * bits as usize / 8..(gi + 1) * g * bits as usize / 8];
                for t0 in (0..m).step_by(TILE_ROWS) {
                    let rows_t = TILE_ROWS.min(m - t0);
                    // SAFETY: NEON is part of the aarch64 baseline, so every aarch64 CPU
                    // runs the `#[target_feature(enable = "neon")]` function.
                    unsafe { group_dots(bits, wg, &xq.codes, k, gi * g, t0, rows_t, &mut tot) };
                    for (i, &t) in tot.iter().enumerate().take(rows_t) {
                        let xi = (t0 + i) * gpr + gi;
                        let x = GroupQuant { sx: xq.sx[xi], xsum: xq.xsum[xi], qsum: xq.qsum[xi] };
                        lanes[t0 + i].add_group(
                            gi,
                            codes.center(),
                            GroupTerms { tot: t, s: s[gi], b: b[gi], x },
                        );
                    }
                }
            }
            for (out, l) in outs.iter_mut().zip(&lanes) {
                out[r - r0] = l.finish();
            }
        }
    });
}

/// Integer dots of one weight group (`wg`, its packed bytes) with activation rows
/// `t0 .. t0 + rows` (codes of row `i` start at `i * k`; the group starts at element `e0`).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "neon")]
fn group_dots(
    bits: u32,
    wg: &[u8],
    xcodes: &[i16],
    k: usize,
    e0: usize,
    t0: usize,
    rows: usize,
    tot: &mut [i32],
) {
    let mut acc = [vdupq_n_s32(0); TILE_ROWS];
    // Elements per 16 packed bytes.
    let epc = if bits == 4 { 32 } else { 16 };
    for (c, wc) in wg.chunks_exact(16).enumerate() {
        let wv = load_u8x16(wc);
        // Codes in element order, widened to 16 bits: 4 vectors (4-bit) or 2 (8-bit).
        let mut wq = [vdupq_n_s16(0); 4];
        let nv = if bits == 4 {
            let lo = vandq_u8(wv, vdupq_n_u8(0x0F));
            let hi = vshrq_n_u8::<4>(wv);
            let first = vzip1q_u8(lo, hi);
            let second = vzip2q_u8(lo, hi);
            wq[0] = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(first)));
            wq[1] = vreinterpretq_s16_u16(vmovl_high_u8(first));
            wq[2] = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(second)));
            wq[3] = vreinterpretq_s16_u16(vmovl_high_u8(second));
            4
        } else {
            wq[0] = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(wv)));
            wq[1] = vreinterpretq_s16_u16(vmovl_high_u8(wv));
            2
        };
        for (i, a) in acc.iter_mut().enumerate().take(rows) {
            let base = (t0 + i) * k + e0 + c * epc;
            let xs = &xcodes[base..base + epc];
            for (v, xv) in wq.iter().take(nv).zip(xs.chunks_exact(8)) {
                let xr = load_s16x8(xv);
                *a = vmlal_s16(*a, vget_low_s16(*v), vget_low_s16(xr));
                *a = vmlal_high_s16(*a, *v, xr);
            }
        }
    }
    for (t, a) in tot.iter_mut().zip(&acc).take(rows) {
        *t = vaddvq_s32(*a);
    }
}

#[target_feature(enable = "neon")]
fn load_u8x16(b: &[u8]) -> uint8x16_t {
    assert!(b.len() >= 16);
    // SAFETY: `b` has at least 16 readable bytes (asserted); NEON loads are unaligned.
    unsafe { vld1q_u8(b.as_ptr()) }
}

#[target_feature(enable = "neon")]
fn load_s16x8(v: &[i16]) -> int16x8_t {
    assert!(v.len() >= 8);
    // SAFETY: `v` has at least 8 readable i16 (asserted); NEON loads are unaligned.
    unsafe { vld1q_s16(v.as_ptr()) }
}
