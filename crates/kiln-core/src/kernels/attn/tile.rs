//! What every decode-attention path shares, below the dispatcher that chooses one: the
//! shape and key/value run types, the tile loop with its online softmax ([`drive`]), and
//! the exponential sums whose fixed order gives every path the same bits.

use std::mem::MaybeUninit;

use half::f16;

use crate::math::{exp, max};

/// Keys per tile: one maximum and one rescale of the output per tile and head.
pub const TILE_KEYS: usize = 64;

/// The widest head the kernels take.
pub const MAX_HEAD_DIM: usize = 512;

/// The most query heads per key/value head the kernels take.
pub const MAX_GROUP: usize = 64;

/// A run of cached keys or values of one head: `n * head_dim` values, position-major.
#[derive(Clone, Copy, Debug)]
pub enum KvRun<'a> {
    /// Half-precision storage.
    F16(&'a [f16]),
    /// Single-precision storage.
    F32(&'a [f32]),
}

/// Where [`super::decode`] (and the prefill kernel) finds one layer's cached keys and values.
pub trait KvSource: Sync {
    /// Positions per storage block: a run never straddles two.
    fn block(&self) -> usize;

    /// The keys (`value` false) or values of key/value `head` at positions
    /// `start..start + n`, all inside one block.
    fn run(&self, value: bool, head: usize, start: usize, n: usize) -> KvRun<'_>;
}

impl<'a> KvRun<'a> {
    /// Values in the run.
    pub fn len(&self) -> usize {
        match self {
            KvRun::F16(s) => s.len(),
            KvRun::F32(s) => s.len(),
        }
    }

    /// Whether the run is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values `start..start + len`.
    pub fn slice(&self, start: usize, len: usize) -> KvRun<'a> {
        match *self {
            KvRun::F16(s) => KvRun::F16(&s[start..start + len]),
            KvRun::F32(s) => KvRun::F32(&s[start..start + len]),
        }
    }

    /// Bytes per stored value.
    pub fn value_bytes(&self) -> usize {
        match self {
            KvRun::F16(_) => 2,
            KvRun::F32(_) => 4,
        }
    }

    /// Value `i` as f32.
    pub fn get(&self, i: usize) -> f32 {
        match self {
            KvRun::F16(s) => s[i].to_f32(),
            KvRun::F32(s) => s[i],
        }
    }
}

/// The geometry of one key/value head's decode: its query heads and their width.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeShape {
    /// Query heads sharing the key/value head.
    pub group: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Factor on every score, `1 / sqrt(head_dim)` for standard attention.
    pub scale: f32,
}

impl DecodeShape {
    /// `group` query heads of width `head_dim`, scores scaled by `1 / sqrt(head_dim)`.
    /// Panics outside `1..=MAX_GROUP` and `1..=MAX_HEAD_DIM`.
    pub fn new(group: usize, head_dim: usize) -> Self {
        assert!((1..=MAX_GROUP).contains(&group), "DecodeShape: group {group} is outside 1..={MAX_GROUP}");
        assert!(
            (1..=MAX_HEAD_DIM).contains(&head_dim),
            "DecodeShape: head_dim {head_dim} is outside 1..={MAX_HEAD_DIM}"
        );
        DecodeShape { group, head_dim, scale: 1.0 / (head_dim as f32).sqrt() }
    }

    /// f32 values of one partial state: `group` maxima, `group` sums, `group * head_dim`
    /// accumulators.
    pub fn state_len(&self) -> usize {
        self.group * (self.head_dim + 2)
    }
}

/// What a path supplies for one tile of at most [`TILE_KEYS`] keys. The score buffer is
/// left uninitialised between tiles (zeroing 16 KiB per tile cost more than the softmax):
/// `scores` initialises exactly the entries `accumulate` and the softmax read.
pub(crate) trait TileOps {
    /// Initialises `s[j * TILE_KEYS + t] = scale * q_j . k_t` for every head `j` and key
    /// `t < nk` (`keys` holds exactly `nk` positions). Entries past `nk` may be written.
    ///
    /// # Safety
    /// The CPU must have the features the path is compiled for; `s` holds at least
    /// `group * TILE_KEYS` entries.
    unsafe fn scores(shape: &DecodeShape, q: &[f32], keys: KvRun<'_>, nk: usize, s: &mut [MaybeUninit<f32>]);

    /// `acc_j += sum_t p[j * TILE_KEYS + t] v_t` for every head `j` and key `t < nk`
    /// (`values` holds exactly `nk` positions).
    ///
    /// # Safety
    /// The CPU must have the features the path is compiled for; the entries of `p` read
    /// are initialised.
    unsafe fn accumulate(
        shape: &DecodeShape,
        p: &[MaybeUninit<f32>],
        values: KvRun<'_>,
        nk: usize,
        acc: &mut [f32],
    );

    /// [`exp_sum`], on the path's own vectors where it has them: the same bits.
    ///
    /// # Safety
    /// The CPU must have the features the path is compiled for.
    #[inline(always)]
    unsafe fn exp_sum(x: &mut [f32], shift: f32) -> f32 {
        exp_sum(x, shift)
    }
}

/// The tile loop every path shares; inlined into each path's entry point so the softmax
/// update between the two products is compiled with that path's features.
///
/// # Safety
/// The CPU must have the features `O` is compiled for.
#[inline(always)]
pub(crate) unsafe fn drive<O: TileOps>(
    shape: &DecodeShape,
    q: &[f32],
    keys: KvRun<'_>,
    values: KvRun<'_>,
    state: &mut [f32],
) {
    let (g, hd) = (shape.group, shape.head_dim);
    let n = keys.len() / hd;
    let (m, rest) = state.split_at_mut(g);
    let (l, acc) = rest.split_at_mut(g);
    let mut s = [MaybeUninit::<f32>::uninit(); MAX_GROUP * TILE_KEYS];
    let mut t0 = 0;
    while t0 < n {
        let nk = TILE_KEYS.min(n - t0);
        let (kt, vt) = (keys.slice(t0 * hd, nk * hd), values.slice(t0 * hd, nk * hd));
        // SAFETY: the caller guarantees the features.
        unsafe { O::scores(shape, q, kt, nk, &mut s) };
        for j in 0..g {
            // SAFETY: `scores` initialised these `nk` entries of head `j`, inside `s`
            // since `j < group <= MAX_GROUP` and `nk <= TILE_KEYS`.
            let sj = unsafe {
                std::slice::from_raw_parts_mut(s.as_mut_ptr().add(j * TILE_KEYS).cast::<f32>(), nk)
            };
            let mx = max(sj).max(m[j]);
            let corr = exp(m[j] - mx);
            // SAFETY: the caller guarantees the features.
            let sum = unsafe { O::exp_sum(sj, mx) };
            l[j] = l[j] * corr + sum;
            m[j] = mx;
            if corr != 1.0 {
                for a in &mut acc[j * hd..(j + 1) * hd] {
                    *a *= corr;
                }
            }
        }
        // SAFETY: as above.
        unsafe { O::accumulate(shape, &s, vt, nk, acc) };
        t0 += nk;
    }
}

/// Replaces each value by `e^(v - shift)` and returns their sum, in eight lanes.
#[inline(always)]
pub(crate) fn exp_sum(x: &mut [f32], shift: f32) -> f32 {
    let mut lanes = [0f32; 8];
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        for i in 0..8 {
            c[i] = exp(c[i] - shift);
            lanes[i] += c[i];
        }
    }
    exp_sum_finish(lanes, chunks.into_remainder(), shift)
}

/// The end every [`exp_sum`] shares, so the paths give the same bits: the values that do
/// not fill eight lanes (`rest`) replaced and summed in order, and the eight lanes' sums
/// joined in a fixed tree.
#[inline(always)]
pub(crate) fn exp_sum_finish(lanes: [f32; 8], rest: &mut [f32], shift: f32) -> f32 {
    let mut tail = 0f32;
    for v in rest {
        *v = exp(*v - shift);
        tail += *v;
    }
    ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7])) + tail
}
