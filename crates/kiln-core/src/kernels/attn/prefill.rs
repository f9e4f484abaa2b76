//! Tiled prefill attention: blocks of query rows against tiles of keys with an online
//! softmax, in the pool's threads.
//!
//! A task is one key/value head and one block of [`PREFILL_ROWS`] query rows. Its
//! queries (every head of the group for every row of the block) are transposed once,
//! scaled, into `[head][width][row]`, so a vector holds one head's query at consecutive
//! rows. Each tile of [`PREFILL_KEYS`] keys and values is converted to f32 once per task
//! and serves every head of the group and every row of the block: the scores of a chunk
//! of rows come out as `[key][row]` (a key broadcast against the rows' queries), the
//! softmax update is then lane-wise (each lane a row, its own maximum and sum, no
//! horizontal reduction), and the values go into a transposed accumulator `[width][row]`
//! the same way (a value broadcast against the rows' weights), rescaled as it is loaded.
//!
//! The causal mask is decided per tile and chunk of rows: a tile wholly after a chunk's
//! last position is skipped, a tile wholly before its first position runs unmasked, and
//! only the tiles across the diagonal compare positions.
//!
//! The products run on a register tile of `R` keys (or widths) by `QV` vectors of rows,
//! on whatever vector type the path has ([`Lanes`]): 16 f32 lanes on AVX-512 (8 by 3,
//! 24 accumulators of 32 registers), 8 on AVX2 (6 by 2, 12 of 16), and plain arrays of 8
//! that the compiler vectorises on the portable path (4 by 2). The widths and keys a tile
//! holds are padded with zeros up to a multiple of `R`, so every register tile is whole.
//!
//! Every path computes the same thing up to f32 rounding; [`super::reference::attend`]
//! is the exact answer the tests hold them to, within [`super::reference::error_bound`]
//! with one rescale per tile.

use rayon::prelude::*;

use super::prefill_tile::{Job, P8, Scratch, task};
pub use super::prefill_tile::{PREFILL_KEYS, PREFILL_ROWS};
use super::tile::{DecodeShape, KvSource};
use crate::kernels::Isa;

/// Attention of query rows over a cache, for prefill: `q` (`[rows, kv_heads * group *
/// head_dim]`, as [`super::decode`] takes it; row `r` at position `start + r`, seeing keys
/// `0..=start + r`) is replaced by the output. `tmp` is scratch of `q`'s length.
///
/// Tasks (block of [`PREFILL_ROWS`] rows, key/value head) run on the current rayon pool.
/// A row's result does not depend on the thread count, but it is not [`super::decode`]'s
/// bits: this is the path for chunks too long to run as decodes.
///
/// # Panics
/// When `q` is not whole rows, `tmp` is shorter than `q`, `isa` cannot run here, or the
/// last position is past `2^24`.
pub fn prefill_on(
    isa: Isa,
    shape: &DecodeShape,
    kv_heads: usize,
    q: &mut [f32],
    tmp: &mut [f32],
    start: usize,
    src: &impl KvSource,
) {
    assert!(isa.is_available(), "attn::prefill: the {} path cannot run on this CPU", isa.as_str());
    let (g, hd) = (shape.group, shape.head_dim);
    let w = g * hd;
    let q_dim = kv_heads * w;
    assert!(
        q_dim > 0 && q.len().is_multiple_of(q_dim),
        "attn::prefill: q must hold whole rows of {q_dim} values"
    );
    assert!(tmp.len() >= q.len(), "attn::prefill: tmp must hold as many values as q ({})", q.len());
    let rows = q.len() / q_dim;
    if rows == 0 {
        return;
    }
    // The causal mask compares positions as f32 lanes: exact below 2^24.
    assert!(
        start + rows <= 1 << 24,
        "attn::prefill: positions up to {} are past the 2^24 the mask compares exactly",
        start + rows
    );
    let path = Path::of(isa);
    // `tmp` as [block][kv head][row of the block][group * head_dim]: task `b * kv_heads + h`
    // owns one piece (the last block's pieces are shorter).
    let queries: &[f32] = q;
    let blocks = rows.div_ceil(PREFILL_ROWS);
    let mut pieces: Vec<&mut [f32]> = Vec::with_capacity(blocks * kv_heads);
    let mut rest = &mut tmp[..q.len()];
    for b in 0..blocks {
        let nr = PREFILL_ROWS.min(rows - b * PREFILL_ROWS);
        for _ in 0..kv_heads {
            let (piece, tail) = std::mem::take(&mut rest).split_at_mut(nr * w);
            pieces.push(piece);
            rest = tail;
        }
    }
    let task = |scratch: &mut Scratch, (i, out): (usize, &mut &mut [f32])| {
        let (b, h) = (i / kv_heads, i % kv_heads);
        let r0 = b * PREFILL_ROWS;
        let job = Job { shape, q: queries, q_dim, h, r0, nr: out.len() / w, pos0: start + r0, src };
        path.run(&job, scratch, out);
    };
    let make = || Scratch::new(shape, path.r());
    if rayon::current_num_threads() > 1 && pieces.len() > 1 {
        pieces.par_iter_mut().enumerate().for_each_init(make, task);
    } else {
        let mut scratch = make();
        pieces.iter_mut().enumerate().for_each(|t| task(&mut scratch, t));
    }
    let mut at = 0;
    for b in 0..blocks {
        let r0 = b * PREFILL_ROWS;
        let nr = PREFILL_ROWS.min(rows - r0);
        for h in 0..kv_heads {
            for i in 0..nr {
                let o = (r0 + i) * q_dim + h * w;
                q[o..o + w].copy_from_slice(&tmp[at + i * w..at + (i + 1) * w]);
            }
            at += nr * w;
        }
    }
}

/// [`prefill_on`] on the best path this CPU has.
pub fn prefill(
    shape: &DecodeShape,
    kv_heads: usize,
    q: &mut [f32],
    tmp: &mut [f32],
    start: usize,
    src: &impl KvSource,
) {
    prefill_on(Isa::detected(), shape, kv_heads, q, tmp, start, src);
}

/// Which kernel a prefill runs.
#[derive(Clone, Copy)]
enum Path {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

impl Path {
    fn of(isa: Isa) -> Path {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni | Isa::Avx512 => Path::Avx512,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => Path::Avx2,
            _ => Path::Portable,
        }
    }

    /// Keys (and widths) per register tile.
    fn r(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Path::Avx512 => super::prefill_x86::R512,
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 => super::prefill_x86::R256,
            Path::Portable => PORTABLE_R,
        }
    }

    fn run<S: KvSource>(self, job: &Job<'_, S>, scratch: &mut Scratch, out: &mut [f32]) {
        match self {
            // SAFETY: `Path::of` chose these paths for an `Isa` that `prefill_on` found
            // available, whose features include the ones the functions are compiled for.
            #[cfg(target_arch = "x86_64")]
            Path::Avx512 => unsafe { super::prefill_x86::task512(job, scratch, out) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 => unsafe { super::prefill_x86::task256(job, scratch, out) },
            // SAFETY: the portable lanes need no CPU feature.
            Path::Portable => unsafe { task::<P8, 2, PORTABLE_R, S>(job, scratch, out) },
        }
    }
}

/// Register-tile keys of the portable path.
const PORTABLE_R: usize = 4;
