//! `qmv_wide` and `qmm` for 4-bit weights on AVX-512 with one weight row per 32-bit lane
//! (`vpdpbusd` with VNNI, `vpmaddubsw` and `vpmaddwd` without).
//!
//! The other wide kernels hold one weight row's codes in a register and meet each
//! activation row with it: every (weight row, activation row, group) leaves 16 lanes of
//! partial sums to fold into one before the group's float work, and those folds cost more
//! than the multiplies from two activation rows on (`qmv_wide` at M = 8 took 4.3-5.3x the
//! time of M = 1). Here nothing is folded:
//! - A block of 16 weight rows is read 32 bytes (64 codes) of each row at a time, so lane
//!   `r` of register `c` holds bytes `4c .. 4c + 4` of row `r`: elements `8c .. 8c + 8`,
//!   the even ones in the low nibbles and the odd ones in the high ones. A matrix stored in
//!   [`Layout::LaneRows`] holds its blocks that way, and each register is one 64-byte load;
//!   a row-major one is transposed in registers (16 loads, 8 inserts and 24 shuffles per
//!   1024 codes, shared by every activation row, for every product), which at M = 2 was
//!   most of what a second row cost over one. Only a lane-row matrix takes this kernel at
//!   M = 1.
//! - Each activation row's codes are stored eight elements at a time as the four even
//!   ones then the four odd ones ([`Acts`]), so the four codes lane `r` needs are one
//!   32-bit word, broadcast into every lane (from memory into `vpdpbusd`): lane `r`
//!   accumulates row `r`'s exact group dot (u4 * i8, at most 128 * 15 * 128 per lane over a
//!   128-group; split codes as `256 * high + low`, at most 62.7M, exact in i32).
//! - The float work of [`crate::kernels::act::Lanes`] runs with lane = weight row, into
//!   eight accumulators per activation row (group `g` into accumulator `g % 8`) summed in
//!   `Lanes`' order at the end. The 16 rows' scales and biases come a window of groups at
//!   a time (32 bytes of each row: 16 groups of a 16-bit dtype, 8 of f32), transposed as
//!   the codes are (a lane-row matrix stores each group's 16 values side by side) and widened
//!   from their stored dtype once per window ([`widen_window`], [`widen_stored`]):
//!   gathering them per group instead cost more than the multiplies on AMD's Zen 5, where
//!   at g32 `qmv_wide` at M = 2 took 4x the time of `qmv` at M = 1.
//!
//! The integer sums are exact and the float operations are `Lanes`' in its order, so every
//! output has the bits of [`crate::kernels::reference::qmv_int`], as the other kernels'
//! do. Taken for 4-bit weights at group sizes 32, 64 and 128 with `K` a multiple of 64,
//! under `int16` (split planes) and `int8` codes; a block's rows past `N` are clamped
//! copies of its last row whose lanes are never stored. Up to 16 activation rows meet each
//! block of weights once (a decode step's, read from memory); more rows (a prefill's) walk
//! a task's blocks in passes of sixteen, the weights in L2 from the first pass on.

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx512::dot_u4_i8;
use super::scales::{packed_bytes, scale_bytes};
use super::traits::PARALLEL_QUANTIZE_ROWS;
use crate::kernels::act::{ActCodes, quantize_group};
use crate::kernels::drive;
use crate::matrix::{LANE_ROWS, Layout, QuantizedMatrix, ScaleData};

/// Weight rows per block: one per 32-bit lane of a 512-bit register, the blocks of
/// [`Layout::LaneRows`].
const ROWS: usize = LANE_ROWS;

/// Activation rows per pass over a block: each holds eight float accumulators of 16 lanes
/// (8 KiB for all, in L1); more rows read the block again, from L2. Sixteen rather than
/// eight: each pass transposes the block's weights again, and halving the passes of a
/// 300-row `qmm` (g32, Qwen2.5-0.5B's MLP shapes) took it to 0.82-0.87x of its time at one
/// thread and 0.79-0.96x at two, on a Xeon with AVX-512 VNNI.
const PASS_ROWS: usize = 16;

/// Elements per transposed unit: 32 bytes of 4-bit codes per row.
const UNIT: usize = 64;

/// Blocks ahead whose bytes the pass that streams the weights from memory asks for into
/// L2, in address order: eight lines of codes per unit (a block is `8 * k / 64` lines over
/// `k / 64` units) and the block's scale and bias lines beside them. The next block's lines
/// alone arrived late for a decode step's few rows: on a 2-vCPU Zen 4 EPYC (g32, 2
/// threads, ten interleaved pairs), `qmv_wide` at M = 2 on 4864 x 896 took 0.76x the time
/// with lines three blocks ahead too (0.191 against 0.246 ms). Those were asked for as the
/// block is read, a line of each of its sixteen rows at a time, rows `k / 2` bytes apart;
/// asked for in address order instead, M = 2 on 896 x 4864 (rows of 2432 bytes, a block of
/// 38 KiB) took 0.77x the time (0.126 against 0.158 ms), M = 4 0.84x and M = 8 0.89x, and
/// 4864 x 896 0.93-0.98x; `qmm` at M = 300 was unchanged (three interleaved rounds each).
const FAR_BLOCKS: usize = 3;

/// Units ahead, along the block's own rows (into the next block's past its end), whose lines
/// a block asks for into L1. The next block's whole lines, asked for over this one, were 38
/// KiB on 896 x 4864, more than L1 holds beside the activation codes.
const NEAR_UNITS: usize = 4;

/// Bytes ahead of the unit being read whose codes a pass that streams a [`Layout::LaneRows`]
/// matrix from memory asks for into L2: there a block's codes are read in address order, so
/// one distance serves every shape, where [`FAR_BLOCKS`] ahead is 21 KiB on 4864 x 896 and
/// 114 KiB on 896 x 4864. On a 2-vCPU Zen 4 EPYC (g32, 2 threads, 3 interleaved rounds) 16
/// KiB took M = 1 on 896 x 4864 to 0.91x the time of three blocks ahead and M = 2 to 0.90x,
/// with 4864 x 896 unchanged; 2 and 4 KiB were late (1.05-1.39x), 8 KiB within noise of 16.
const FAR_BYTES: usize = 16 << 10;

/// Whether this kernel takes `m` rows against `w` under `codes`.
///
/// A matrix stored in [`Layout::LaneRows`] is taken from one row on (a decode step's
/// `qmv`, whose row loop reads rows); a row-major one from two.
pub(in crate::kernels) fn takes(w: &QuantizedMatrix, m: usize, codes: ActCodes) -> bool {
    let spec = w.spec();
    (m >= 2 || (m == 1 && w.layout() == Layout::LaneRows))
        && spec.bits() == 4
        && matches!(spec.group_size(), 32 | 64 | 128)
        && w.k().is_multiple_of(UNIT)
        && matches!(codes, ActCodes::I8Deinterleaved | ActCodes::I16Split)
}

/// Activation rows quantized per group for this kernel.
struct Acts {
    k: usize,
    gpr: usize,
    /// `[row][k]` codes (for split codes their high planes), every eight elements stored
    /// as the four even ones then the four odd ones.
    hi: Vec<u8>,
    /// The low planes of split codes, laid out as `hi`; empty for 8-bit codes.
    lo: Vec<u8>,
    /// `[row][group]` scales.
    sx: Vec<f32>,
    /// `[row][group]` exact sums.
    xsum: Vec<f32>,
    /// `[row][group]` sums of the codes times the weights' centre, negated (the start of
    /// a group's integer sum).
    ncq: Vec<i32>,
}

/// Quantizes `m` rows of `k` activations per group of `g`, on the pool from
/// [`PARALLEL_QUANTIZE_ROWS`] rows on, as the tiles are.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
unsafe fn quantize(x: &[f32], m: usize, k: usize, g: usize, codes: ActCodes) -> Acts {
    use rayon::prelude::*;
    assert_eq!(x.len(), m * k);
    let gpr = k / g;
    let split = codes == ActCodes::I16Split;
    let mut a = Acts {
        k,
        gpr,
        hi: vec![0; m * k],
        lo: if split { vec![0; m * k] } else { Vec::new() },
        sx: vec![0.0; m * gpr],
        xsum: vec![0.0; m * gpr],
        ncq: vec![0; m * gpr],
    };
    let threads = rayon::current_num_threads();
    let per = if m < PARALLEL_QUANTIZE_ROWS || threads == 1 { m } else { m.div_ceil(4 * threads) }.max(1);
    let mut lo_parts: Box<dyn Iterator<Item = &mut [u8]>> = if split {
        Box::new(a.lo.chunks_mut(per * k))
    } else {
        Box::new(std::iter::repeat_with(<&mut [u8]>::default))
    };
    let mut jobs = Vec::new();
    for ((((xs, hi), sx), xsum), ncq) in x
        .chunks(per * k)
        .zip(a.hi.chunks_mut(per * k))
        .zip(a.sx.chunks_mut(per * gpr))
        .zip(a.xsum.chunks_mut(per * gpr))
        .zip(a.ncq.chunks_mut(per * gpr))
    {
        let lo = lo_parts.next().expect("a low plane per chunk");
        jobs.push(RowsOut { xs, hi, lo, sx, xsum, ncq });
    }
    drop(lo_parts);
    let one = |j: RowsOut<'_>| {
        // SAFETY: this function's caller guarantees AVX2, FMA and F16C; every core rayon
        // runs this on is the same CPU.
        unsafe { quantize_rows(j, g, codes) }
    };
    if jobs.len() == 1 {
        jobs.into_iter().for_each(one);
    } else {
        jobs.into_par_iter().for_each(one);
    }
    a
}

/// One run of rows' activations and the pieces of [`Acts`] they fill.
struct RowsOut<'a> {
    xs: &'a [f32],
    hi: &'a mut [u8],
    /// Empty unless the codes are split.
    lo: &'a mut [u8],
    sx: &'a mut [f32],
    xsum: &'a mut [f32],
    ncq: &'a mut [i32],
}

/// Quantizes the rows of `o` (compiled for AVX2: the quantizer is `inline(always)`).
#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_rows(o: RowsOut<'_>, g: usize, codes: ActCodes) {
    let split = !o.lo.is_empty();
    let mut q = vec![0i16; g];
    // Rows are whole groups long, so group `i` of the run starts at element `i * g`.
    for (i, xs) in o.xs.chunks_exact(g).enumerate() {
        let gq = quantize_group(xs, codes.max_code(), &mut q);
        (o.sx[i], o.xsum[i], o.ncq[i]) = (gq.sx, gq.xsum, -(codes.center() * gq.qsum));
        let at = i * g..(i + 1) * g;
        if split {
            store_split(&q, &mut o.hi[at.clone()], &mut o.lo[at]);
        } else {
            store_bytes(&q, &mut o.hi[at]);
        }
    }
}

/// Within every 16 bytes, each eight's even elements then its odd ones: the order
/// [`Acts`] stores codes in.
const EVEN_ODD: [i8; 16] = [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15];

/// Stores 16-bit codes `q` as their two 8-bit planes, each eight elements' even ones then
/// odd ones, 16 codes at a time: `hi = (q + 128) >> 8` and `lo = q - 256 * hi`, both within
/// `i8`, as [`crate::kernels::act::split_code`] gives them.
#[target_feature(enable = "avx2")]
fn store_split(q: &[i16], hi: &mut [u8], lo: &mut [u8]) {
    assert!(q.len().is_multiple_of(16) && hi.len() == q.len() && lo.len() == q.len());
    for ((q, h), l) in q.chunks_exact(16).zip(hi.chunks_exact_mut(16)).zip(lo.chunks_exact_mut(16)) {
        // SAFETY: AVX2 is this function's feature; the load reads the 16 codes of a
        // checked chunk and the stores write 8 bytes into checked 16-byte chunks.
        unsafe {
            let v = _mm256_loadu_si256(q.as_ptr().cast());
            let vh = _mm256_srai_epi16::<8>(_mm256_add_epi16(v, _mm256_set1_epi16(128)));
            let vl = _mm256_sub_epi16(v, _mm256_slli_epi16::<8>(vh));
            // Per 128 bits: eight high codes then eight low ones, exact (both in i8), then
            // each eight put in even-odd order.
            let order = _mm256_broadcastsi128_si256(_mm_loadu_si128(EVEN_ODD.as_ptr().cast()));
            let b = _mm256_shuffle_epi8(_mm256_packs_epi16(vh, vl), order);
            let (b0, b1) = (_mm256_castsi256_si128(b), _mm256_extracti128_si256::<1>(b));
            _mm_storel_epi64(h.as_mut_ptr().cast(), b0);
            _mm_storel_epi64(h[8..].as_mut_ptr().cast(), b1);
            _mm_storel_epi64(l.as_mut_ptr().cast(), _mm_unpackhi_epi64(b0, b0));
            _mm_storel_epi64(l[8..].as_mut_ptr().cast(), _mm_unpackhi_epi64(b1, b1));
        }
    }
}

/// Stores codes `q` (within `i8`) as bytes, each eight elements' even ones then odd ones,
/// 16 at a time.
#[target_feature(enable = "avx2")]
fn store_bytes(q: &[i16], out: &mut [u8]) {
    assert!(q.len().is_multiple_of(16) && out.len() == q.len());
    for (q, o) in q.chunks_exact(16).zip(out.chunks_exact_mut(16)) {
        // SAFETY: AVX2 is this function's feature; the load reads the 16 codes of a
        // checked chunk and the store writes a checked 16-byte chunk.
        unsafe {
            let v = _mm256_loadu_si256(q.as_ptr().cast());
            let b = _mm_packs_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
            let b = _mm_shuffle_epi8(b, _mm_loadu_si128(EVEN_ODD.as_ptr().cast()));
            _mm_storeu_si128(o.as_mut_ptr().cast(), b);
        }
    }
}

/// Activation rows [`PreparedRows`] holds at most (the entry's output slices live in a
/// fixed array).
pub(crate) const MAX_PREPARED_ROWS: usize = 32;

/// Up to [`MAX_PREPARED_ROWS`] activation rows quantized for this kernel, for an emulator
/// to run it on (see `kernels::emulated`): [`rows_with`] computes from them without
/// allocating.
pub(crate) struct PreparedRows {
    acts: Acts,
    m: usize,
}

impl PreparedRows {
    /// The `m` (2 to [`MAX_PREPARED_ROWS`], from 1 for a matrix in [`Layout::LaneRows`])
    /// rows of `x` for `w` under `codes`, or `None`
    /// where the kernel does not take them ([`takes`]).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    pub(crate) unsafe fn new(
        x: &[f32],
        m: usize,
        w: &QuantizedMatrix,
        codes: ActCodes,
    ) -> Option<PreparedRows> {
        if !takes(w, m, codes) || m > MAX_PREPARED_ROWS {
            return None;
        }
        // SAFETY: forwarded from this function's contract.
        let acts = unsafe { quantize(x, m, w.k(), w.spec().group_size(), codes) };
        Some(PreparedRows { acts, m })
    }
}

/// Every weight row of `w` against `p`'s rows, on the calling thread, in tasks of
/// `rows_per_task` rows (a multiple of 16) as the pool would run them: `out[i * n + r]` is
/// activation row `i`'s output for weight row `r`. Allocates nothing.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512F/BW/VL, and VNNI when `vnni`; `p` was
/// prepared for `w`.
pub(crate) unsafe fn rows_with(
    vnni: bool,
    w: &QuantizedMatrix,
    p: &PreparedRows,
    rows_per_task: usize,
    out: &mut [f32],
) {
    let n = w.n();
    assert_eq!(out.len(), p.m * n);
    assert!(rows_per_task > 0 && rows_per_task.is_multiple_of(ROWS), "{rows_per_task} rows per task");
    for r0 in (0..n).step_by(rows_per_task) {
        let r1 = (r0 + rows_per_task).min(n);
        let mut parts: [&mut [f32]; MAX_PREPARED_ROWS] = Default::default();
        for (part, o) in parts.iter_mut().zip(out.chunks_exact_mut(n)) {
            *part = &mut o[r0..r1];
        }
        // SAFETY: forwarded from this function's contract.
        unsafe { rows_any(vnni, w, &p.acts, r0..r1, &mut parts[..p.m]) }
    }
}

/// `y[m, n] = x[m, k] W^T` (`qmv_wide`'s batches and `qmm`'s prefills), every output with
/// the bits of `reference::qmv_int` under `codes`' scheme.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512F/BW/VL, and VNNI when `vnni`;
/// [`takes`] holds.
pub(in crate::kernels) unsafe fn matmul(
    vnni: bool,
    x: &[f32],
    m: usize,
    w: &QuantizedMatrix,
    y: &mut [f32],
    codes: ActCodes,
) {
    debug_assert!(takes(w, m, codes));
    // SAFETY: this function's caller guarantees AVX2, FMA and F16C.
    let acts = unsafe { quantize(x, m, w.k(), w.spec().group_size(), codes) };
    let rpt = drive::rows_per_task(w.n(), w.bytes_read() / w.n()).next_multiple_of(ROWS);
    drive::rows_multi(y, m, w.n(), rpt, |rows, outs| {
        // SAFETY: this function's caller guarantees the features; every core rayon runs
        // this closure on is the same CPU.
        unsafe { rows_any(vnni, w, &acts, rows, outs) }
    });
}

/// [`crate::kernels::qmv_many`] for parts all in [`Layout::LaneRows`] (of one group size):
/// the row quantized once, every part's blocks in one parallel region, each task adding its
/// rows' bias.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512F/BW/VL, and VNNI when `vnni`; [`takes`]
/// holds for every part at one row.
pub(in crate::kernels) unsafe fn many(
    vnni: bool,
    x: &[f32],
    parts: &mut [crate::kernels::part::QmvPart<'_>],
    codes: ActCodes,
) {
    let Some(first) = parts.first() else { return };
    let (k, g) = (first.w.k(), first.w.spec().group_size());
    // `takes` at one row is a lane-row matrix's.
    assert!(parts.iter().all(|p| takes(p.w, 1, codes) && p.w.k() == k && p.w.spec().group_size() == g));
    // SAFETY: this function's caller guarantees AVX2, FMA and F16C.
    let acts = unsafe { quantize(x, 1, k, g, codes) };
    drive::parts(parts, |w, bias, rows, out| {
        // SAFETY: this function's caller guarantees the features; every core rayon runs
        // this closure on is the same CPU.
        unsafe { rows_any(vnni, w, &acts, rows.clone(), &mut [&mut *out]) };
        crate::kernels::part::add_bias(bias, rows, out);
    });
}

/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512F/BW/VL, and VNNI when `vnni`.
unsafe fn rows_any(vnni: bool, w: &QuantizedMatrix, a: &Acts, rows: Range<usize>, outs: &mut [&mut [f32]]) {
    // SAFETY: forwarded from this function's contract.
    unsafe { if vnni { rows_vnni(w, a, rows, outs) } else { rows_bw(w, a, rows, outs) } }
}

macro_rules! rows_on {
    ($name:ident, $features:tt, $vnni:expr) => {
        #[target_feature(enable = $features)]
        fn $name(w: &QuantizedMatrix, a: &Acts, rows: Range<usize>, outs: &mut [&mut [f32]]) {
            // SAFETY: this function is compiled with the features `task` needs.
            unsafe {
                if w.layout() == Layout::LaneRows {
                    by_geometry::<$vnni, true>(w, a, rows, outs)
                } else {
                    by_geometry::<$vnni, false>(w, a, rows, outs)
                }
            }
        }
    };
}

rows_on!(rows_vnni, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni", true);
rows_on!(rows_bw, "avx2,fma,f16c,avx512f,avx512bw,avx512vl", false);

/// [`task`] for `w`'s group size and `a`'s codes (split or not).
///
/// # Safety
/// The CPU must support AVX-512F/BW/VL, and VNNI when `VNNI`.
#[inline(always)]
unsafe fn by_geometry<const VNNI: bool, const STORED: bool>(
    w: &QuantizedMatrix,
    a: &Acts,
    rows: Range<usize>,
    outs: &mut [&mut [f32]],
) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        match (w.spec().group_size(), a.lo.is_empty()) {
            (32, false) => task::<32, true, VNNI, STORED>(w, a, rows, outs),
            (32, true) => task::<32, false, VNNI, STORED>(w, a, rows, outs),
            (64, false) => task::<64, true, VNNI, STORED>(w, a, rows, outs),
            (64, true) => task::<64, false, VNNI, STORED>(w, a, rows, outs),
            (128, false) => task::<128, true, VNNI, STORED>(w, a, rows, outs),
            (128, true) => task::<128, false, VNNI, STORED>(w, a, rows, outs),
            (g, _) => unreachable!("lane-row kernel at g{g}: `takes` refuses it"),
        }
    }
}

/// One task's weight rows, in blocks of 16, against every activation row, sixteen at a time.
///
/// # Safety
/// The CPU must support AVX-512F/BW/VL, and VNNI when `VNNI`.
#[inline(always)]
unsafe fn task<const G: usize, const SPLIT: bool, const VNNI: bool, const STORED: bool>(
    w: &QuantizedMatrix,
    a: &Acts,
    rows: Range<usize>,
    outs: &mut [&mut [f32]],
) {
    let m = outs.len();
    // SAFETY: `task`'s callers have AVX-512F.
    let (zf, zi) = unsafe { (_mm512_setzero_ps(), _mm512_setzero_si512()) };
    let mut scratch = Scratch {
        out: [[0.0; ROWS]; PASS_ROWS],
        scales: Window::ZERO,
        biases: Window::ZERO,
        lanes: [[zf; 8]; PASS_ROWS],
        first: [zi; PASS_ROWS],
    };
    // A macro, not a closure: a closure has no target features of its own, so the
    // intrinsics of `block` inlined into it would be calls. `$few`: the pass is a decode
    // step's, all of its at most [`PASS_ROWS`] rows.
    macro_rules! one {
        ($b0:expr, $m0:expr, $few:literal) => {{
            let (b0, m0) = ($b0, $m0);
            let nr = ROWS.min(rows.end - b0);
            let mt = PASS_ROWS.min(m - m0);
            // Far lines on the pass that streams the weights from memory: a decode step's
            // one pass, into the next task's rows too (read next, by one thread or the
            // other); a prefill's first pass, within its task (the passes after it find
            // the task's blocks in L2, and the next task's first pass asks for its own).
            let far = m0 == 0 && (m <= PASS_ROWS || b0 + FAR_BLOCKS * ROWS < rows.end);
            // SAFETY: forwarded from this function's contract.
            unsafe { block::<G, SPLIT, VNNI, $few, STORED>(w, a, b0, nr, m0..m0 + mt, far, &mut scratch) };
            for (i, o) in scratch.out.iter().enumerate().take(mt) {
                let to = &mut outs[m0 + i][b0 - rows.start..b0 - rows.start + nr];
                // A whole block's 16 outputs as one fixed-size copy: as a slice copy of a
                // runtime length, each was a call to `memcpy`, 2% of a prefill's time.
                match <&mut [f32; ROWS]>::try_from(&mut *to) {
                    Ok(to) => *to = *o,
                    Err(_) => to.copy_from_slice(&o[..nr]),
                }
            }
        }};
    }
    if m > PASS_ROWS {
        // A prefill's rows: each pass of sixteen rows (its codes hot in L1) walks the task's
        // block of weights, which stays in L2 from the first pass on.
        for m0 in (0..m).step_by(PASS_ROWS) {
            for b0 in rows.clone().step_by(ROWS) {
                one!(b0, m0, false);
            }
        }
    } else {
        // A decode step's: each block of weights once from memory, in one pass.
        for b0 in rows.clone().step_by(ROWS) {
            one!(b0, 0, true);
        }
    }
}

/// Weight rows `b0 .. b0 + nr` (`nr <= 16`) against activation rows `acts` (at most 16):
/// `scratch.out[i][r]` is activation row `acts.start + i`'s output for weight row `b0 + r`.
/// `far` asks for the block [`FAR_BLOCKS`] ahead into L2 as well as nearer lines into L1;
/// `FEW` is a decode step's pass (at most [`PASS_ROWS`] rows in all); `STORED`, that `w` is
/// in [`Layout::LaneRows`], so its codes, scales and biases are read as they are stored,
/// with no transposes.
///
/// # Safety
/// The CPU must support AVX-512F/BW/VL, and VNNI when `VNNI`.
#[inline(always)]
unsafe fn block<const G: usize, const SPLIT: bool, const VNNI: bool, const FEW: bool, const STORED: bool>(
    w: &QuantizedMatrix,
    a: &Acts,
    b0: usize,
    nr: usize,
    acts: Range<usize>,
    far: bool,
    scratch: &mut Scratch,
) {
    let (m0, mt) = (acts.start, acts.len());
    assert!((1..=ROWS).contains(&nr) && b0 + nr <= w.n() && (1..=PASS_ROWS).contains(&mt));
    assert!(m0 + mt <= a.hi.len() / a.k && (!SPLIT || a.lo.len() == a.hi.len()));
    assert!(a.k == w.k() && a.gpr * G == a.k);
    let (k, gpr) = (a.k, a.gpr);
    assert!(
        a.ncq.len() >= (m0 + mt) * gpr && a.sx.len() >= (m0 + mt) * gpr && a.xsum.len() >= (m0 + mt) * gpr
    );
    let (ncq_at, sx_at, xsum_at) = (a.ncq.as_ptr(), a.sx.as_ptr(), a.xsum.as_ptr());
    let row_bytes = k / 2;
    let packed = packed_bytes(w);
    // Lanes past `nr` read the block's last row again; they are never stored.
    // The rows' codes, and their scales and biases in their stored bytes (read a window of
    // groups at a time). A loop, not `array::from_fn`, whose closure was not inlined: its
    // 48 calls per block were 1.5% of a prefill.
    let (sall, ball) = (scale_bytes(w.scales()), scale_bytes(w.biases()));
    let size = w.scales().dtype().size();
    let srow = gpr * size;
    let none: [&[u8]; ROWS] = [&[]; ROWS];
    let (mut wrows, mut srows, mut brows) = (none, none, none);
    if STORED {
        // The block, whole (N is a multiple of 16 in this layout), as stored.
        assert!(nr == ROWS && b0.is_multiple_of(ROWS));
    } else {
        for r in 0..ROWS {
            let at = b0 + r.min(nr - 1);
            wrows[r] = &packed[at * row_bytes..(at + 1) * row_bytes];
            srows[r] = &sall[at * srow..(at + 1) * srow];
            brows[r] = &ball[at * srow..(at + 1) * srow];
        }
    }
    // STORED: the block's codes, 512 bytes per unit (word `c` of the unit's 16 rows at
    // `64 * c`), and its scales and biases, 16 per group.
    let block_codes = if STORED { &packed[b0 * row_bytes..(b0 + ROWS) * row_bytes] } else { &packed[..0] };
    let sgroup = (b0 / ROWS) * gpr * ROWS;
    // Groups per 32-byte window: 16 of a 16-bit dtype, 8 of f32.
    let window = 32 / size;
    // SAFETY: this function's contract gives every intrinsic here its features; each `o`
    // holds 16 f32 and the store is unaligned; the reads through `ncq_at`, `sx_at` and
    // `xsum_at` are of the pass's rows' groups, within the vectors (asserted above).
    unsafe {
        let low4 = _mm512_set1_epi8(0x0F);
        // Both 4-bit schemes centre the weight codes on 8.
        const _: () = assert!(ActCodes::I16Split.center() == ActCodes::I8Deinterleaved.center());
        let centre = _mm512_set1_ps(ActCodes::I16Split.center() as f32);
        // The pass's rows' accumulators start at zero; the rows past `mt` are not touched.
        for l in scratch.lanes.iter_mut().take(mt) {
            *l = [_mm512_setzero_ps(); 8];
        }
        // Units per window of scales and biases.
        let window_units = (window * G / UNIT).max(1);
        let units = k / UNIT;
        // Lines of a block's scales (and of its biases) to ask for per unit.
        let scale_lines_per_unit = (ROWS * srow).div_ceil(64 * units);
        // STORED: lines of scales (and of biases) per unit's groups.
        let group_lines = ((UNIT / G).max(1) * ROWS * size).div_ceil(64);
        for u in 0..units {
            if STORED {
                // The scale and bias lines of the groups [`NEAR_UNITS`] units ahead into L1,
                // past the block's end the next block's (stored right after it).
                let at = b0 * srow + ROWS * size * ((u + NEAR_UNITS) * UNIT / G);
                let (sb, bb) = (sall.as_ptr().wrapping_add(at), ball.as_ptr().wrapping_add(at));
                for j in 0..group_lines {
                    _mm_prefetch::<_MM_HINT_T0>(sb.wrapping_add(64 * j).cast::<i8>());
                    _mm_prefetch::<_MM_HINT_T0>(bb.wrapping_add(64 * j).cast::<i8>());
                }
            }
            if !STORED && far && u % window_units == 0 {
                // The next window's scale and bias lines of the block's rows (after its last
                // window, the next block's first), a window ahead: unasked, each window's 32
                // lines were misses the weights' prefetches did not cover. On a 2-vCPU Zen 4
                // EPYC (g32, 2 threads, ten interleaved pairs) `qmv_wide` on 4864 x 896 took
                // 0.88x the time at M = 2 and 0.92x at M = 4 with them; 896 x 4864 and `qmm`
                // were unchanged.
                let next = 32 * (u / window_units + 1);
                let (sb, bb) = (sall.as_ptr(), ball.as_ptr());
                for r in 0..ROWS {
                    let at = if next < srow { (b0 + r) * srow + next } else { (b0 + ROWS + r) * srow };
                    _mm_prefetch::<_MM_HINT_T0>(sb.wrapping_add(at).cast::<i8>());
                    _mm_prefetch::<_MM_HINT_T0>(bb.wrapping_add(at).cast::<i8>());
                }
            }
            if far {
                // This unit's share of the block [`FAR_BLOCKS`] ahead, into L2 in address
                // order (past the matrix's end for its last blocks, where a prefetch is a
                // no-op): eight lines of codes, and of its scales and biases the lines that
                // spread them over the block's units.
                let fb = b0 + FAR_BLOCKS * ROWS;
                let codes = if STORED {
                    packed.as_ptr().wrapping_add(b0 * row_bytes + 512 * u + FAR_BYTES)
                } else {
                    packed.as_ptr().wrapping_add(fb * row_bytes + 8 * 64 * u)
                };
                for j in 0..8 {
                    _mm_prefetch::<_MM_HINT_T1>(codes.wrapping_add(64 * j).cast::<i8>());
                }
                let per = scale_lines_per_unit;
                let at = fb * srow + per * 64 * u;
                let (sb, bb) = (sall.as_ptr().wrapping_add(at), ball.as_ptr().wrapping_add(at));
                for j in 0..per {
                    _mm_prefetch::<_MM_HINT_T1>(sb.wrapping_add(64 * j).cast::<i8>());
                    _mm_prefetch::<_MM_HINT_T1>(bb.wrapping_add(64 * j).cast::<i8>());
                }
            }
            if STORED {
                // The unit [`NEAR_UNITS`] ahead into L1 (its eight lines), past the block's
                // end the next block's.
                let near = packed.as_ptr().wrapping_add(b0 * row_bytes + 512 * (u + NEAR_UNITS));
                for j in 0..8 {
                    _mm_prefetch::<_MM_HINT_T0>(near.wrapping_add(64 * j).cast::<i8>());
                }
            } else if u % 2 == 0 {
                // Each row's line [`NEAR_UNITS`] units ahead into L1, past the block's end
                // the next block's rows'.
                let (ahead, unit) = ((u + NEAR_UNITS) / units, (u + NEAR_UNITS) % units);
                let near = packed.as_ptr().wrapping_add((b0 + ahead * ROWS) * row_bytes + 32 * unit);
                for r in 0..ROWS {
                    _mm_prefetch::<_MM_HINT_T0>(near.wrapping_add(r * row_bytes).cast::<i8>());
                }
            }
            let z = if STORED {
                let unit: &[u8; 512] =
                    block_codes[512 * u..512 * (u + 1)].try_into().expect("a unit of codes");
                let mut z = [low4; 8];
                for (c, zc) in z.iter_mut().enumerate() {
                    *zc = _mm512_loadu_si512(unit[64 * c..].as_ptr().cast());
                }
                z
            } else {
                transpose(&wrows, 32 * u, 32)
            };
            // Loops, not closures: a closure has no target features of its own, so an
            // intrinsic in one is a call unless the inliner folds it first.
            let (mut even, mut odd) = ([low4; 8], [low4; 8]);
            for c in 0..8 {
                even[c] = _mm512_and_si512(z[c], low4);
                odd[c] = _mm512_and_si512(_mm512_srli_epi16::<4>(z[c]), low4);
            }
            // One group's work (`$h`: which of the unit's groups) over chunks `$c0 .. $c0 +
            // $nc`, constants, so every index into `even` and `odd` is one and both stay in
            // registers (a runtime range kept them on the stack, a reload per `vpdpbusd`).
            macro_rules! group {
                ($h:expr, $c0:expr, $nc:expr) => {{
                    let g = if G == 128 { u / 2 } else { u * (UNIT / G) + $h };
                    if G == 128 && u % 2 == 0 {
                        for (i, f) in scratch.first.iter_mut().enumerate().take(mt) {
                            let (hi, lo) = unit_codes::<SPLIT>(a, (m0 + i) * k + UNIT * u);
                            *f = dots::<SPLIT, VNNI, $c0, $nc>(&even, &odd, hi, lo, _mm512_setzero_si512());
                        }
                    } else {
                        if g % window == 0 {
                            if STORED {
                                let (at, len) = (sgroup + g * ROWS, window.min(gpr - g));
                                widen_stored(w.scales(), at, len, &mut scratch.scales);
                                widen_stored(w.biases(), at, len, &mut scratch.biases);
                            } else {
                                widen_window(w.scales(), &srows, 32 * (g / window), &mut scratch.scales);
                                widen_window(w.biases(), &brows, 32 * (g / window), &mut scratch.biases);
                            }
                        }
                        let s = _mm512_load_ps(scratch.scales.0[g % window].as_ptr());
                        let b = _mm512_load_ps(scratch.biases.0[g % window].as_ptr());
                        let bc = _mm512_fmadd_ps(s, centre, b);
                        for (i, l) in scratch.lanes.iter_mut().enumerate().take(mt) {
                            // A decode step's rows (`FEW`) read these unchecked (within the
                            // pass's rows' groups, asserted above), so nothing splits the read
                            // from its use and each is broadcast from memory into its
                            // instruction; read checked, `ncq` and `sx` were loads into
                            // general registers and broadcasts from there. On a 2-vCPU Zen 4
                            // EPYC (g32, 2 threads, eight interleaved pairs) `qmv_wide` M = 2
                            // on 4864 x 896 took 0.90x the time with the weights in cache and
                            // 0.92x from memory, 896 x 4864 0.98x / 0.95x; but `qmm` at M = 300
                            // took 1.015-1.018x, so a prefill's passes keep the checked reads.
                            let gi = (m0 + i) * gpr + g;
                            let (ncq, sx, xsum) = if FEW {
                                (*ncq_at.add(gi), *sx_at.add(gi), *xsum_at.add(gi))
                            } else {
                                (a.ncq[gi], a.sx[gi], a.xsum[gi])
                            };
                            // The sum starts at minus the centre's share, so it ends centred.
                            let start = if G == 128 { scratch.first[i] } else { _mm512_setzero_si512() };
                            let start = _mm512_add_epi32(start, _mm512_set1_epi32(ncq));
                            let (hi, lo) = unit_codes::<SPLIT>(a, (m0 + i) * k + UNIT * u);
                            let centred = dots::<SPLIT, VNNI, $c0, $nc>(&even, &odd, hi, lo, start);
                            let acc = &mut l[g % 8];
                            *acc = _mm512_fmadd_ps(
                                _mm512_cvtepi32_ps(centred),
                                _mm512_mul_ps(s, _mm512_set1_ps(sx)),
                                *acc,
                            );
                            *acc = _mm512_fmadd_ps(bc, _mm512_set1_ps(xsum), *acc);
                        }
                    }
                }};
            }
            // The groups this unit holds (g32: two) or ends (g128: the second unit of one).
            if G == 32 {
                group!(0, 0, 4);
                group!(1, 4, 4);
            } else {
                group!(0, 0, 8);
            }
        }
        for (o, l) in scratch.out.iter_mut().zip(&scratch.lanes).take(mt) {
            let sum = _mm512_add_ps(
                _mm512_add_ps(_mm512_add_ps(l[0], l[4]), _mm512_add_ps(l[2], l[6])),
                _mm512_add_ps(_mm512_add_ps(l[1], l[5]), _mm512_add_ps(l[3], l[7])),
            );
            _mm512_storeu_ps(o.as_mut_ptr(), sum);
        }
    }
}

/// Bytes `off .. off + len` (`len` 1 to 32; bytes past it read as zero) of the 16 rows,
/// transposed: lane `r` of register `c` is the `c`-th 32-bit word of row `r`'s bytes.
///
/// # Safety
/// The CPU must support AVX-512F/BW/VL.
#[inline(always)]
unsafe fn transpose(wrows: &[&[u8]; ROWS], off: usize, len: usize) -> [__m512i; 8] {
    assert!((1..=32).contains(&len));
    // SAFETY: for every intrinsic here, this function's contract gives AVX-512F/BW/VL; each
    // load is of `len` bytes inside a row (asserted by the slicing), a masked load reading
    // none of the bytes past them.
    unsafe {
        let load = |row: &[u8]| {
            let row = &row[off..off + len];
            if len == 32 {
                _mm256_loadu_si256(row.as_ptr().cast())
            } else {
                _mm256_maskz_loadu_epi8(u32::MAX >> (32 - len), row.as_ptr().cast())
            }
        };
        // Rows p and p + 8 side by side: each 256-bit half is then an 8 x 8 transpose.
        let mut v = [_mm512_setzero_si512(); 8];
        for (p, vp) in v.iter_mut().enumerate() {
            let (lo, hi) = (load(wrows[p]), load(wrows[p + 8]));
            *vp = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
        }
        let t = [
            _mm512_unpacklo_epi32(v[0], v[1]),
            _mm512_unpackhi_epi32(v[0], v[1]),
            _mm512_unpacklo_epi32(v[2], v[3]),
            _mm512_unpackhi_epi32(v[2], v[3]),
            _mm512_unpacklo_epi32(v[4], v[5]),
            _mm512_unpackhi_epi32(v[4], v[5]),
            _mm512_unpacklo_epi32(v[6], v[7]),
            _mm512_unpackhi_epi32(v[6], v[7]),
        ];
        // Per 128 bits, u[d] (d < 4) holds word d of rows 0..3 (of 8..11 in the high half),
        // word d + 4 in the odd quarters; u[d + 4] the same for rows 4..7 and 12..15.
        let u = [
            _mm512_unpacklo_epi64(t[0], t[2]),
            _mm512_unpackhi_epi64(t[0], t[2]),
            _mm512_unpacklo_epi64(t[1], t[3]),
            _mm512_unpackhi_epi64(t[1], t[3]),
            _mm512_unpacklo_epi64(t[4], t[6]),
            _mm512_unpackhi_epi64(t[4], t[6]),
            _mm512_unpacklo_epi64(t[5], t[7]),
            _mm512_unpackhi_epi64(t[5], t[7]),
        ];
        let even_q = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
        let odd_q = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
        let mut z = [_mm512_setzero_si512(); 8];
        for d in 0..4 {
            z[d] = _mm512_permutex2var_epi64(u[d], even_q, u[d + 4]);
            z[d + 4] = _mm512_permutex2var_epi64(u[d], odd_q, u[d + 4]);
        }
        z
    }
}

/// One activation row's codes for one unit, from byte `at` of [`Acts::hi`] and
/// [`Acts::lo`] (`hi` again for 8-bit codes): checked once here, so the unit's 16 to 32
/// word reads need no checks of their own.
#[inline(always)]
fn unit_codes<const SPLIT: bool>(a: &Acts, at: usize) -> (&[u8; UNIT], &[u8; UNIT]) {
    let hi: &[u8; UNIT] = a.hi[at..at + UNIT].try_into().expect("a unit of codes");
    let lo: &[u8; UNIT] = if SPLIT { a.lo[at..at + UNIT].try_into().expect("a unit of codes") } else { hi };
    (hi, lo)
}

/// `start` plus one activation row's exact integer dot with the 16 rows over chunks `C0 ..
/// C0 + NC` (within `0..8`) of a unit whose codes are `hi` (and `lo`).
///
/// # Safety
/// The CPU must support AVX-512F/BW, and VNNI when `VNNI`.
#[inline(always)]
unsafe fn dots<const SPLIT: bool, const VNNI: bool, const C0: usize, const NC: usize>(
    even: &[__m512i; 8],
    odd: &[__m512i; 8],
    hi: &[u8; UNIT],
    lo: &[u8; UNIT],
    start: __m512i,
) -> __m512i {
    // SAFETY: for every intrinsic here, this function's contract gives AVX-512F/BW, and VNNI
    // when `VNNI`.
    unsafe {
        // Four sums, each plane's even and odd elements apart: half as long a chain of
        // `vpdpbusd` as two would be, which a decode step's few rows cannot hide.
        let zero = _mm512_setzero_si512();
        let (mut h_even, mut h_odd, mut l_even, mut l_odd) =
            if SPLIT { (zero, zero, start, zero) } else { (start, zero, zero, zero) };
        for c in C0..C0 + NC {
            let o = 8 * c;
            h_even = dot_u4_i8::<VNNI>(h_even, even[c], word(hi, o));
            h_odd = dot_u4_i8::<VNNI>(h_odd, odd[c], word(hi, o + 4));
            if SPLIT {
                l_even = dot_u4_i8::<VNNI>(l_even, even[c], word(lo, o));
                l_odd = dot_u4_i8::<VNNI>(l_odd, odd[c], word(lo, o + 4));
            }
        }
        let h = _mm512_add_epi32(h_even, h_odd);
        if SPLIT { _mm512_add_epi32(_mm512_slli_epi32::<8>(h), _mm512_add_epi32(l_even, l_odd)) } else { h }
    }
}

/// The 32-bit word at byte `o` of a unit's codes in every lane.
///
/// # Safety
/// The CPU must support AVX-512F.
#[inline(always)]
unsafe fn word(codes: &[u8; UNIT], o: usize) -> __m512i {
    let b: [u8; 4] = codes[o..o + 4].try_into().expect("four bytes");
    // SAFETY: this function's contract gives AVX-512F.
    unsafe { _mm512_set1_epi32(i32::from_le_bytes(b)) }
}

/// A window of groups' scales (or biases) for a block's 16 rows, widened to f32: `0[j][r]`
/// is row `r`'s value for the window's group `j` (16 groups for 16-bit dtypes, 8 for
/// f32).
#[repr(C, align(64))]
struct Window([[f32; ROWS]; 16]);

impl Window {
    const ZERO: Window = Window([[0.0; ROWS]; 16]);
}

/// A task's space for its blocks, made once per task: a block writes each part before it
/// reads it.
struct Scratch {
    /// One pass's outputs.
    out: [[f32; ROWS]; PASS_ROWS],
    /// The block's current windows of scales and biases.
    scales: Window,
    biases: Window,
    /// Eight accumulators per activation row of a pass, lane = weight row: 8 KiB, of which a
    /// block zeroes its pass's rows only (zeroing all of them was an 8 KiB memset per block,
    /// even for a decode step's two rows).
    lanes: [[__m512; 8]; PASS_ROWS],
    /// g128: the integer sums of a group's first unit, until its second is added.
    first: [__m512i; PASS_ROWS],
}

/// Fills `out` with `len` (at most a window's) groups of a [`Layout::LaneRows`] block's
/// scales (or biases) `sd`, from index `at` on (16 values per group, lane = row), widened
/// with the dtype's own conversion as [`widen_window`] widens them.
///
/// # Safety
/// The CPU must support AVX-512F.
#[inline(always)]
unsafe fn widen_stored(sd: &ScaleData, at: usize, len: usize, out: &mut Window) {
    // SAFETY: this function's contract gives AVX-512F; each load is of 16 values of a
    // checked slice, and `out`'s rows are 64-byte aligned.
    unsafe {
        let o = &mut out.0[..len];
        match sd {
            ScaleData::F16(v) => {
                for (j, v) in o.iter_mut().zip(v[at..at + len * ROWS].chunks_exact(ROWS)) {
                    _mm512_store_ps(j.as_mut_ptr(), _mm512_cvtph_ps(_mm256_loadu_si256(v.as_ptr().cast())));
                }
            }
            ScaleData::Bf16(v) => {
                for (j, v) in o.iter_mut().zip(v[at..at + len * ROWS].chunks_exact(ROWS)) {
                    let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(v.as_ptr().cast()));
                    _mm512_store_ps(j.as_mut_ptr(), _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h)));
                }
            }
            ScaleData::F32(v) => {
                for (j, v) in o.iter_mut().zip(v[at..at + len * ROWS].chunks_exact(ROWS)) {
                    _mm512_store_ps(j.as_mut_ptr(), _mm512_loadu_ps(v.as_ptr()));
                }
            }
        }
    }
}

/// Fills `out` with the window at byte `off` of each row's stored scales (or biases) `rows`:
/// the 32 bytes there (fewer, zero-padded, at a row's end) transposed as the weights are
/// ([`transpose`]), so lane `r` of word `c` holds row `r`'s values `2c` and `2c + 1`
/// (16-bit dtypes) or `c` (f32), then widened with the dtype's own conversion
/// (`vcvtph2ps`; bf16 by a 16-bit shift), the values the other kernels use.
///
/// # Safety
/// The CPU must support AVX-512F/BW/VL.
#[inline(always)]
unsafe fn widen_window(sd: &ScaleData, rows: &[&[u8]; ROWS], off: usize, out: &mut Window) {
    // SAFETY: this function's contract gives AVX-512F/BW/VL; `out`'s rows are 64-byte
    // aligned.
    unsafe {
        let z = transpose(rows, off, 32.min(rows[0].len() - off));
        let o = &mut out.0;
        for (c, &zc) in z.iter().enumerate() {
            match sd {
                ScaleData::F32(_) => _mm512_store_ps(o[c].as_mut_ptr(), _mm512_castsi512_ps(zc)),
                ScaleData::F16(_) => {
                    let (lo, hi) =
                        (_mm512_cvtepi32_epi16(zc), _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(zc)));
                    _mm512_store_ps(o[2 * c].as_mut_ptr(), _mm512_cvtph_ps(lo));
                    _mm512_store_ps(o[2 * c + 1].as_mut_ptr(), _mm512_cvtph_ps(hi));
                }
                ScaleData::Bf16(_) => {
                    let hi = _mm512_and_si512(zc, _mm512_set1_epi32(0xFFFF_0000u32 as i32));
                    _mm512_store_ps(o[2 * c].as_mut_ptr(), _mm512_castsi512_ps(_mm512_slli_epi32::<16>(zc)));
                    _mm512_store_ps(o[2 * c + 1].as_mut_ptr(), _mm512_castsi512_ps(hi));
                }
            }
        }
    }
}
