//! The portable decode attention path: each key and value is converted to f32 once
//! (through `half`'s slice conversion for an f16 cache) and used for every head of the
//! group; the products run in eight independent lanes the compiler vectorises.

use std::mem::MaybeUninit;

use half::slice::HalfFloatSliceExt;

use super::tile::{DecodeShape, KvRun, MAX_HEAD_DIM, TILE_KEYS, TileOps, drive};

/// Folds a run into `state` on the portable path (see [`super::fold`]).
pub(super) fn fold(shape: &DecodeShape, q: &[f32], keys: KvRun<'_>, values: KvRun<'_>, state: &mut [f32]) {
    // SAFETY: the portable path needs no CPU feature.
    unsafe { drive::<Portable>(shape, q, keys, values, state) }
}

struct Portable;

/// `run` as f32: borrowed when it already is, else converted into `buf`.
fn as_f32<'a>(run: KvRun<'a>, buf: &'a mut [f32; MAX_HEAD_DIM]) -> &'a [f32] {
    match run {
        KvRun::F32(s) => s,
        KvRun::F16(s) => {
            let out = &mut buf[..s.len()];
            s.convert_to_f32_slice(out);
            out
        }
    }
}

impl TileOps for Portable {
    unsafe fn scores(shape: &DecodeShape, q: &[f32], keys: KvRun<'_>, nk: usize, s: &mut [MaybeUninit<f32>]) {
        let hd = shape.head_dim;
        let mut buf = [0f32; MAX_HEAD_DIM];
        for t in 0..nk {
            // One key at a time, converted once for every head of the group.
            let kt = as_f32(keys.slice(t * hd, hd), &mut buf);
            for (j, qj) in q.chunks_exact(hd).enumerate() {
                s[j * TILE_KEYS + t].write(shape.scale * dot(qj, kt));
            }
        }
    }

    unsafe fn accumulate(
        shape: &DecodeShape,
        p: &[MaybeUninit<f32>],
        values: KvRun<'_>,
        nk: usize,
        acc: &mut [f32],
    ) {
        let hd = shape.head_dim;
        let mut buf = [0f32; MAX_HEAD_DIM];
        for t in 0..nk {
            let vt = as_f32(values.slice(t * hd, hd), &mut buf);
            for (j, aj) in acc.chunks_exact_mut(hd).enumerate() {
                // SAFETY: the caller guarantees the weights of keys `t < nk` are initialised.
                let w = unsafe { p[j * TILE_KEYS + t].assume_init() };
                for (a, &x) in aj.iter_mut().zip(vt) {
                    *a += w * x;
                }
            }
        }
    }
}

/// `a . b` in eight independent lanes.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7])) + tail
}
