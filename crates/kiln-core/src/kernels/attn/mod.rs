//! Fused decode attention: the query heads that share one key/value head read that head's
//! cached keys and values once, straight from their f16 (or f32) storage, with an online
//! softmax, so a decode step costs one pass over the cache and no repacking.
//!
//! The unit of work is a *partial state* of one key/value head over a range of keys: per
//! query head of the group a running maximum `m`, a running sum `l` of `e^(s - m)` and an
//! unnormalised output `acc = sum e^(s - m) v`. [`fold`] adds a run of keys to a state,
//! [`merge`] joins the states of two disjoint ranges (so one head's keys can be split over
//! threads), and [`finish`] divides out the sum. Within a run, keys go in tiles of
//! [`TILE_KEYS`]: scores for the tile, one max and rescale per head, then the values.
//! [`decode`] drives them for whole rows over a [`KvSource`] (kiln-model's cache, or a
//! benchmark's buffer): tasks over (row, key/value head, span of keys), merged in order.
//!
//! Prefill chunks too long to run as decodes go through [`prefill`] instead: blocks of
//! query rows against tiles of keys, products on register tiles (see its module).
//!
//! Every path computes the same thing up to f32 rounding (the order of the products in
//! a score and of the terms in a sum differ); [`reference::attend`] is the exact answer
//! the tests hold them to, with a tolerance derived from that rounding.
//!
//! The dispatcher here picks the path from [`Isa`]: on AVX-512 hosts, heads of 64 and 128
//! accumulate their values in registers (`x86::fold512`, AVX2's bits), AVX2 (F16C
//! conversion in registers, FMA) takes the other head sizes that are a multiple of 8 there
//! and every one on AVX2 hosts, the portable path the rest and other targets, where it
//! converts each tile with `half`'s slice conversion (which uses the CPU's f16
//! instructions where it finds them) and leaves the loops to the compiler.

pub mod reference;

mod portable;
mod prefill;
mod prefill_tile;
#[cfg(target_arch = "x86_64")]
mod prefill_x86;
mod tile;
#[cfg(target_arch = "x86_64")]
mod x86;

use rayon::prelude::*;

use super::Isa;
use crate::math::exp;

pub use self::prefill::{PREFILL_KEYS, PREFILL_ROWS, prefill, prefill_on};
pub use self::tile::{DecodeShape, KvRun, KvSource, MAX_GROUP, MAX_HEAD_DIM, TILE_KEYS};

/// Sets `state` to the empty range: maxima at negative infinity, sums and outputs at 0.
pub fn init(shape: &DecodeShape, state: &mut [f32]) {
    let state = &mut state[..shape.state_len()];
    let (m, rest) = state.split_at_mut(shape.group);
    m.fill(f32::NEG_INFINITY);
    rest.fill(0.0);
}

/// Folds the keys and values of one run (`keys.len() / head_dim` positions) into
/// `state`, for the group's queries `q` (`[group, head_dim]`), on the path `isa`.
///
/// # Panics
/// When `isa` cannot run here, the run lengths differ or are not whole positions, the
/// runs are of different storage types, or a slice is shorter than the shape says.
pub fn fold(isa: Isa, shape: &DecodeShape, q: &[f32], keys: KvRun<'_>, values: KvRun<'_>, state: &mut [f32]) {
    let (g, hd) = (shape.group, shape.head_dim);
    assert!(isa.is_available(), "attn::fold: the {} path cannot run on this CPU", isa.as_str());
    assert_eq!(keys.len(), values.len(), "attn::fold: keys and values must hold as many values");
    assert!(keys.len().is_multiple_of(hd), "attn::fold: runs must hold whole positions of {hd} values");
    assert!(
        matches!((keys, values), (KvRun::F16(_), KvRun::F16(_)) | (KvRun::F32(_), KvRun::F32(_))),
        "attn::fold: keys and values must share a storage type"
    );
    assert!(q.len() >= g * hd, "attn::fold: q must hold group * head_dim = {} values", g * hd);
    let state = &mut state[..shape.state_len()];
    if keys.is_empty() {
        return;
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni | Isa::Avx512 if x86::fold512_takes(hd) => {
            // SAFETY: `is_available` above confirmed AVX-512F/BW/VL besides AVX2, FMA and
            // F16C, the features the function is compiled for; `fold512_takes` admitted
            // the head size; the lengths it relies on were checked above.
            unsafe { x86::fold512(shape, &q[..g * hd], keys, values, state) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni | Isa::Avx512 | Isa::Avx2 if hd.is_multiple_of(8) => {
            // SAFETY: `is_available` above confirmed AVX2, FMA and F16C, the features the
            // function is compiled for; the lengths it relies on were checked above.
            unsafe { x86::fold(shape, &q[..g * hd], keys, values, state) }
        }
        _ => portable::fold(shape, &q[..g * hd], keys, values, state),
    }
}

/// [`fold`] on the best path this CPU has.
pub fn fold_detected(shape: &DecodeShape, q: &[f32], keys: KvRun<'_>, values: KvRun<'_>, state: &mut [f32]) {
    fold(Isa::detected(), shape, q, keys, values, state);
}

/// Joins `from` (the state of a key range disjoint from `into`'s) into `into`.
pub fn merge(shape: &DecodeShape, into: &mut [f32], from: &[f32]) {
    let (g, hd) = (shape.group, shape.head_dim);
    let (m, rest) = into[..shape.state_len()].split_at_mut(g);
    let (l, acc) = rest.split_at_mut(g);
    let (fm, frest) = from[..shape.state_len()].split_at(g);
    let (fl, facc) = frest.split_at(g);
    for j in 0..g {
        if fm[j] == f32::NEG_INFINITY {
            continue;
        }
        let acc = &mut acc[j * hd..(j + 1) * hd];
        let facc = &facc[j * hd..(j + 1) * hd];
        if m[j] == f32::NEG_INFINITY {
            (m[j], l[j]) = (fm[j], fl[j]);
            acc.copy_from_slice(facc);
            continue;
        }
        let mx = m[j].max(fm[j]);
        let (a, b) = (exp(m[j] - mx), exp(fm[j] - mx));
        l[j] = l[j] * a + fl[j] * b;
        m[j] = mx;
        for (o, &f) in acc.iter_mut().zip(facc) {
            *o = *o * a + f * b;
        }
    }
}

/// Writes the attention output of each query head, `acc / l`, into `out`
/// (`[group, head_dim]`). A head that saw no key gets zeros.
pub fn finish(shape: &DecodeShape, state: &[f32], out: &mut [f32]) {
    let (g, hd) = (shape.group, shape.head_dim);
    let (_, rest) = state[..shape.state_len()].split_at(g);
    let (l, acc) = rest.split_at(g);
    for j in 0..g {
        let inv = if l[j] > 0.0 { 1.0 / l[j] } else { 0.0 };
        for (o, &a) in out[j * hd..(j + 1) * hd].iter_mut().zip(&acc[j * hd..(j + 1) * hd]) {
            *o = a * inv;
        }
    }
}

/// Keys per task of [`decode`]: one block of kiln-model's cache, so a 512-position decode
/// of a model with three key/value heads already has six tasks to share between threads.
/// Fixed, not derived from the thread count, so the float order of a row depends on its
/// position alone.
pub const SPAN_KEYS: usize = 256;

/// Cached values (keys and values of every key/value head) below which [`decode`] runs on
/// the calling thread, where handing tasks to the other threads would cost more than they
/// save. One core folds about 2.5 values a nanosecond (on a 2-vCPU Zen 4 EPYC, attention
/// was 16% of SmolLM2-135M's two-thread decode samples at 300 to 700 positions, about
/// 75 us per layer for 190K values), so 32K values are about 13 us of work, and a decode
/// step's workers are spinning for its tasks (`KILN_SPIN_US`). At 256K, as before, every
/// layer of SmolLM2 (384 values a position) ran its attention on one thread up to 683
/// positions, and the Qwen2.5-0.5B shape (256) up to 1024, while the other thread waited:
/// from 1 << 18 to 1 << 15, eight interleaved pairs of a 300-token prompt and 128 new
/// tokens there decoded 1.08x (SmolLM2 Q4_1) and 1.06x (the Qwen shape) as fast, and a
/// 24-token prompt with 96 new ones 1.01x and 1.03x.
pub const SERIAL_VALUES: usize = 1 << 15;

/// f32 values of partial states [`decode`] holds at once, at most (4 MiB), unless one row
/// alone needs more.
pub const STATE_VALUES: usize = 1 << 20;

/// Attention of query rows over a cache: `q` (`[rows, kv_heads * group * head_dim]`, the
/// group of key/value head `h` contiguous at `h * group * head_dim`; row `r` at position
/// `start + r`, so it sees keys `0..=start + r`) is replaced by the output.
///
/// Each row is computed exactly as a one-row decode at its position: its keys go in
/// fixed spans of [`SPAN_KEYS`] whose states merge in order, whatever the thread count
/// and the other rows, so a verify of several rows reproduces decode bit for bit. Tasks
/// (row, key/value head, span) run on the current rayon pool once the cache is long
/// enough ([`SERIAL_VALUES`]).
pub fn decode(shape: &DecodeShape, kv_heads: usize, q: &mut [f32], start: usize, src: &impl KvSource) {
    let (w, sl) = (shape.group * shape.head_dim, shape.state_len());
    let q_dim = kv_heads * w;
    assert!(q.len().is_multiple_of(q_dim), "attn::decode: q must hold whole rows of {q_dim} values");
    let rows = q.len() / q_dim;
    let tasks = |r: usize| kv_heads * (start + r + 1).div_ceil(SPAN_KEYS);
    // Rows go in batches whose partial states fit in STATE_VALUES (one row at least), so
    // a long verify over a long cache does not hold every row's states at once.
    let mut r0 = 0;
    while r0 < rows {
        let (mut r1, mut n) = (r0 + 1, tasks(r0));
        while r1 < rows && (n + tasks(r1)) * sl <= STATE_VALUES {
            n += tasks(r1);
            r1 += 1;
        }
        decode_rows(shape, kv_heads, &mut q[r0 * q_dim..r1 * q_dim], start + r0, src);
        r0 = r1;
    }
}

/// [`decode`] of one batch of rows.
fn decode_rows(shape: &DecodeShape, kv_heads: usize, q: &mut [f32], start: usize, src: &impl KvSource) {
    let (w, sl) = (shape.group * shape.head_dim, shape.state_len());
    let q_dim = kv_heads * w;
    let rows = q.len() / q_dim;
    let isa = Isa::detected();
    // Each (row, head) owns `spans(row)` consecutive tasks.
    let spans = |r: usize| (start + r + 1).div_ceil(SPAN_KEYS);
    let mut tasks = Vec::new();
    for r in 0..rows {
        let end = start + r + 1;
        for h in 0..kv_heads {
            for sp in 0..spans(r) {
                let lo = sp * SPAN_KEYS;
                tasks.push((r, h, lo, end.min(lo + SPAN_KEYS)));
            }
        }
    }
    let keys: usize = tasks.iter().map(|t| t.3 - t.2).sum();
    let parallel = rayon::current_num_threads() > 1 && 2 * keys * shape.head_dim >= SERIAL_VALUES;
    let mut states = vec![0f32; tasks.len() * sl];
    let queries: &[f32] = q;
    let block = src.block();
    let task = |(st, &(r, h, lo, hi)): (&mut [f32], &(usize, usize, usize, usize))| {
        let qh = &queries[r * q_dim + h * w..r * q_dim + (h + 1) * w];
        init(shape, st);
        let mut a = lo;
        while a < hi {
            let b = hi.min((a / block + 1) * block);
            fold(isa, shape, qh, src.run(false, h, a, b - a), src.run(true, h, a, b - a), st);
            a = b;
        }
    };
    if parallel {
        states.par_chunks_mut(sl).zip(tasks.par_iter()).for_each(task);
    } else {
        states.chunks_mut(sl).zip(tasks.iter()).for_each(task);
    }
    let mut rest = &mut states[..];
    for r in 0..rows {
        for h in 0..kv_heads {
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(spans(r) * sl);
            rest = tail;
            let (first, parts) = mine.split_at_mut(sl);
            for part in parts.chunks(sl) {
                merge(shape, first, part);
            }
            let o = r * q_dim + h * w;
            finish(shape, first, &mut q[o..o + w]);
        }
    }
}
