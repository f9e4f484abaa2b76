//! The tiled prefill attention's kernel, below the dispatcher ([`super::prefill`]) that
//! picks a path: the lane abstraction, a task's job and scratch, the task itself (one
//! block of query rows of one key/value head against every key tile it sees, with an
//! online softmax lane by lane), and the portable lanes. The x86 lanes are in
//! `prefill_x86.rs`.

use half::slice::HalfFloatSliceExt;

use super::tile::{DecodeShape, KvRun, KvSource};

/// Query rows per task: a chunk of rows is 48 lanes on AVX-512 (three vectors; 16 on AVX2
/// and the portable path), and one tile of keys converted to f32 serves `group * 48`
/// queries.
pub const PREFILL_ROWS: usize = 48;

/// Keys per tile: one softmax update (maximum, rescale) per tile and row. A divisor of
/// kiln-model's cache block, so tiles never straddle blocks there.
pub const PREFILL_KEYS: usize = 64;

/// A vector of f32 lanes as a path holds them. Every method is `unsafe`: the CPU must
/// have the features of the path, and a pointer must address `N` values.
pub(super) trait Lanes: Copy {
    /// Lanes per vector.
    const N: usize;

    /// `N` values from `p`.
    unsafe fn load(p: *const f32) -> Self;
    /// Writes the lanes to `p`.
    unsafe fn store(self, p: *mut f32);
    /// Every lane `x`.
    unsafe fn splat(x: f32) -> Self;
    /// `a * b + c`, fused where the path has FMA.
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
    /// `a * b`.
    unsafe fn mul(a: Self, b: Self) -> Self;
    /// `a + b`.
    unsafe fn add(a: Self, b: Self) -> Self;
    /// Lane-wise maximum.
    unsafe fn max(a: Self, b: Self) -> Self;
    /// `e^(a - b)`, lane by lane: [`crate::math::exp`]'s constants and range reduction,
    /// within [`crate::math::EXP_REL_ERROR`] of the exact value (AVX2 and the portable
    /// lanes give its bits; AVX-512 fuses its operations).
    unsafe fn exp_sub(a: Self, b: Self) -> Self;
    /// `x` where `pos >= key`, else `other`, lane by lane.
    unsafe fn keep_ge(x: Self, pos: Self, key: Self, other: Self) -> Self;
}

/// One task's inputs: key/value head `h`, query rows `r0..r0 + nr` at positions `pos0..`.
pub(super) struct Job<'a, S> {
    pub shape: &'a DecodeShape,
    /// Every row of the prefill, `[rows, q_dim]`.
    pub q: &'a [f32],
    pub q_dim: usize,
    pub h: usize,
    pub r0: usize,
    pub nr: usize,
    pub pos0: usize,
    pub src: &'a S,
}

/// A task's buffers, reused by the tasks one thread runs.
pub(super) struct Scratch {
    /// Queries `[group][head_dim][PREFILL_ROWS]`, scaled.
    qt: Vec<f32>,
    /// Output accumulators, `[group][padded head_dim][PREFILL_ROWS]`.
    ot: Vec<f32>,
    /// Running maxima and sums, `[group][PREFILL_ROWS]`.
    m: Vec<f32>,
    l: Vec<f32>,
    /// Keys `[padded PREFILL_KEYS][head_dim]` and values `[PREFILL_KEYS][padded head_dim]`.
    k: Vec<f32>,
    v: Vec<f32>,
    /// Scores and weights of a chunk of rows, `[padded PREFILL_KEYS][chunk lanes]`.
    s: Vec<f32>,
    /// A converted run of f16 values.
    conv: Vec<f32>,
}

impl Scratch {
    pub(super) fn new(shape: &DecodeShape, r: usize) -> Scratch {
        let (g, hd) = (shape.group, shape.head_dim);
        let (hdp, nkp) = (hd.next_multiple_of(r), PREFILL_KEYS.next_multiple_of(r));
        Scratch {
            qt: vec![0.0; g * hd * PREFILL_ROWS],
            ot: vec![0.0; g * hdp * PREFILL_ROWS],
            m: vec![0.0; g * PREFILL_ROWS],
            l: vec![0.0; g * PREFILL_ROWS],
            k: vec![0.0; nkp * hd],
            v: vec![0.0; PREFILL_KEYS * hdp],
            s: vec![0.0; nkp * PREFILL_ROWS],
            conv: vec![0.0; PREFILL_KEYS * hd],
        }
    }
}

/// `run` (`n` positions of `hd` values) as f32 into `dst`, row `t` at `t * stride`.
fn convert(run: KvRun<'_>, n: usize, hd: usize, conv: &mut [f32], dst: &mut [f32], stride: usize) {
    let src: &[f32] = match run {
        KvRun::F32(s) => s,
        KvRun::F16(s) => {
            s.convert_to_f32_slice(&mut conv[..n * hd]);
            &conv[..n * hd]
        }
    };
    for t in 0..n {
        dst[t * stride..t * stride + hd].copy_from_slice(&src[t * hd..(t + 1) * hd]);
    }
}

/// One task on the lanes `V`: chunks of `QV` vectors of rows, register tiles of `R` keys
/// (or widths) by `QV` vectors.
///
/// # Safety
/// The CPU must have the features `V`'s methods need; `PREFILL_ROWS` is a multiple of
/// `QV * V::N`; the scratch was made for this shape and `R`; `out` holds `nr` rows of
/// `group * head_dim`.
#[inline(always)]
pub(super) unsafe fn task<V: Lanes, const QV: usize, const R: usize, S: KvSource>(
    job: &Job<'_, S>,
    sc: &mut Scratch,
    out: &mut [f32],
) {
    let shape = job.shape;
    let (g, hd) = (shape.group, shape.head_dim);
    let hdp = hd.next_multiple_of(R);
    let ql = QV * V::N;
    debug_assert!(PREFILL_ROWS.is_multiple_of(ql));
    let (nr, pos0) = (job.nr, job.pos0);
    let chunks = nr.div_ceil(ql);
    // Queries, transposed and scaled; rows past `nr` are zeros.
    for j in 0..g {
        for i in 0..PREFILL_ROWS {
            let row = (i < nr).then(|| {
                let o = (job.r0 + i) * job.q_dim + (job.h * g + j) * hd;
                &job.q[o..o + hd]
            });
            for d in 0..hd {
                sc.qt[(j * hd + d) * PREFILL_ROWS + i] = row.map_or(0.0, |r| r[d] * shape.scale);
            }
        }
    }
    sc.ot.fill(0.0);
    sc.m.fill(f32::NEG_INFINITY);
    sc.l.fill(0.0);
    // Padding of the key and value tiles stays zero: key rows past a tile's keys (their
    // scores are never read) and value widths past `hd` (their sums are never read).
    sc.k.fill(0.0);
    sc.v.fill(0.0);
    let end = pos0 + nr;
    let block = job.src.block();
    let mut t0 = 0;
    while t0 < end {
        let nk = PREFILL_KEYS.min(end - t0).min((t0 / block + 1) * block - t0);
        convert(job.src.run(false, job.h, t0, nk), nk, hd, &mut sc.conv, &mut sc.k, hd);
        convert(job.src.run(true, job.h, t0, nk), nk, hd, &mut sc.conv, &mut sc.v, hdp);
        if nk < PREFILL_KEYS {
            // A short last tile: keys past it are zero (a longer earlier tile's would do,
            // but zeros keep the padded scores finite and cheap).
            sc.k[nk * hd..].fill(0.0);
        }
        let nkp = nk.next_multiple_of(R);
        for c in 0..chunks {
            let (i0, i1) = (c * ql, (c * ql + ql).min(nr));
            let (first, last) = (pos0 + i0, pos0 + i1 - 1);
            if t0 > last {
                continue;
            }
            let masked = t0 + nk - 1 > first;
            for j in 0..g {
                // SAFETY: the caller guarantees the features; every pointer below
                // addresses whole vectors inside the scratch buffers, whose sizes
                // `Scratch::new` derived from this shape and `R`.
                unsafe {
                    let qt = sc.qt.as_ptr().add(j * hd * PREFILL_ROWS + i0);
                    let s = sc.s.as_mut_ptr();
                    scores::<V, QV, R>(qt, hd, sc.k.as_ptr(), nkp, s);
                    let st = j * PREFILL_ROWS + i0;
                    let corr = softmax::<V, QV>(
                        s,
                        nk,
                        t0,
                        masked.then_some(first),
                        sc.m.as_mut_ptr().add(st),
                        sc.l.as_mut_ptr().add(st),
                    );
                    let ot = sc.ot.as_mut_ptr().add(j * hdp * PREFILL_ROWS + i0);
                    values::<V, QV, R>(s, nk, sc.v.as_ptr(), hdp, corr, ot);
                }
            }
        }
        t0 += nk;
    }
    // Normalise and transpose back: row `i`, head `j` into `out[i][j * hd..]`.
    let w = g * hd;
    for j in 0..g {
        for i in 0..nr {
            let l = sc.l[j * PREFILL_ROWS + i];
            let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
            for d in 0..hd {
                out[i * w + j * hd + d] = sc.ot[(j * hdp + d) * PREFILL_ROWS + i] * inv;
            }
        }
    }
}

/// Scores of one chunk of rows against a tile: `s[t][lane] = sum_d q[d][lane] k[t][d]` for
/// keys `t < nkp` (a multiple of `R`), `R` keys by `QV` vectors at a time.
///
/// # Safety
/// Features of `V`; `qt` addresses `hd` rows of `QV` vectors, `PREFILL_ROWS` apart; `k`
/// holds `nkp` keys of `hd`; `s` holds `nkp` rows of `QV` vectors.
#[inline(always)]
unsafe fn scores<V: Lanes, const QV: usize, const R: usize>(
    qt: *const f32,
    hd: usize,
    k: *const f32,
    nkp: usize,
    s: *mut f32,
) {
    let ql = QV * V::N;
    let mut t0 = 0;
    while t0 < nkp {
        // SAFETY: the caller's bounds: keys `t0..t0 + R <= nkp`, widths `d < hd`, rows
        // of `QV` vectors.
        unsafe {
            let mut acc = [[V::splat(0.0); QV]; R];
            let kt = k.add(t0 * hd);
            for d in 0..hd {
                let mut qv = [V::splat(0.0); QV];
                for (c, x) in qv.iter_mut().enumerate() {
                    *x = V::load(qt.add(d * PREFILL_ROWS + c * V::N));
                }
                for (r, ar) in acc.iter_mut().enumerate() {
                    let b = V::splat(*kt.add(r * hd + d));
                    for (a, &x) in ar.iter_mut().zip(&qv) {
                        *a = V::fma(b, x, *a);
                    }
                }
            }
            for (r, ar) in acc.iter().enumerate() {
                for (c, &a) in ar.iter().enumerate() {
                    a.store(s.add((t0 + r) * ql + c * V::N));
                }
            }
        }
        t0 += R;
    }
}

/// The online softmax of one chunk of rows over a tile's `nk` scores (`s`, `[key][lane]`):
/// the running maxima `m` and sums `l` (a vector of rows each) take the tile, the scores
/// become weights `e^(s - m)`, and the factor the chunk's output must be rescaled by is
/// returned. With `mask` (the chunk's first position), key `t0 + t` is dropped for the
/// rows before it (weight 0).
///
/// # Safety
/// Features of `V`; `s` holds `nk >= 1` rows of `QV` vectors; `m` and `l` hold `QV`
/// vectors.
#[inline(always)]
unsafe fn softmax<V: Lanes, const QV: usize>(
    s: *mut f32,
    nk: usize,
    t0: usize,
    mask: Option<usize>,
    m: *mut f32,
    l: *mut f32,
) -> [V; QV] {
    let ql = QV * V::N;
    // SAFETY: the caller's bounds.
    unsafe {
        let mut pos = [V::splat(0.0); QV];
        if let Some(first) = mask {
            let mut lanes = [0f32; 64];
            for (i, x) in lanes[..ql].iter_mut().enumerate() {
                *x = (first + i) as f32;
            }
            for (c, p) in pos.iter_mut().enumerate() {
                *p = V::load(lanes.as_ptr().add(c * V::N));
            }
        }
        let neg = V::splat(f32::NEG_INFINITY);
        let mut old = [neg; QV];
        let mut mx = [neg; QV];
        for c in 0..QV {
            old[c] = V::load(m.add(c * V::N));
            mx[c] = old[c];
        }
        for t in 0..nk {
            let key = V::splat((t0 + t) as f32);
            for c in 0..QV {
                let mut x = V::load(s.add(t * ql + c * V::N));
                if mask.is_some() {
                    x = V::keep_ge(x, pos[c], key, neg);
                }
                mx[c] = V::max(mx[c], x);
            }
        }
        let zero = V::splat(0.0);
        let mut sum = [zero; QV];
        for t in 0..nk {
            let key = V::splat((t0 + t) as f32);
            for c in 0..QV {
                let at = s.add(t * ql + c * V::N);
                let mut p = V::exp_sub(V::load(at), mx[c]);
                if mask.is_some() {
                    p = V::keep_ge(p, pos[c], key, zero);
                }
                p.store(at);
                sum[c] = V::add(sum[c], p);
            }
        }
        let mut corr = [zero; QV];
        for c in 0..QV {
            // A row's first tile has its maximum at negative infinity and nothing to
            // rescale: the factor is e^-inf's clamp, tiny, times zeros.
            corr[c] = V::exp_sub(old[c], mx[c]);
            V::add(V::mul(V::load(l.add(c * V::N)), corr[c]), sum[c]).store(l.add(c * V::N));
            mx[c].store(m.add(c * V::N));
        }
        corr
    }
}

/// `o[d][lane] = o[d][lane] * corr[lane] + sum_t p[t][lane] v[t][d]` for widths
/// `d < hdp` (a multiple of `R`), `R` widths by `QV` vectors at a time.
///
/// # Safety
/// Features of `V`; `p` holds `nk` rows of `QV` vectors; `v` holds `nk` rows of `hdp`;
/// `o` addresses `hdp` rows of `QV` vectors, `PREFILL_ROWS` apart.
#[inline(always)]
unsafe fn values<V: Lanes, const QV: usize, const R: usize>(
    p: *const f32,
    nk: usize,
    v: *const f32,
    hdp: usize,
    corr: [V; QV],
    o: *mut f32,
) {
    let ql = QV * V::N;
    let mut d0 = 0;
    while d0 < hdp {
        // SAFETY: the caller's bounds: widths `d0..d0 + R <= hdp`, keys `t < nk`.
        unsafe {
            let mut acc = [[V::splat(0.0); QV]; R];
            for (r, ar) in acc.iter_mut().enumerate() {
                for (c, a) in ar.iter_mut().enumerate() {
                    *a = V::mul(V::load(o.add((d0 + r) * PREFILL_ROWS + c * V::N)), corr[c]);
                }
            }
            for t in 0..nk {
                let mut pv = [V::splat(0.0); QV];
                for (c, x) in pv.iter_mut().enumerate() {
                    *x = V::load(p.add(t * ql + c * V::N));
                }
                let vt = v.add(t * hdp + d0);
                for (r, ar) in acc.iter_mut().enumerate() {
                    let b = V::splat(*vt.add(r));
                    for (a, &x) in ar.iter_mut().zip(&pv) {
                        *a = V::fma(b, x, *a);
                    }
                }
            }
            for (r, ar) in acc.iter().enumerate() {
                for (c, &a) in ar.iter().enumerate() {
                    a.store(o.add((d0 + r) * PREFILL_ROWS + c * V::N));
                }
            }
        }
        d0 += R;
    }
}

/// Eight f32 lanes in plain Rust, for the portable path.
#[derive(Clone, Copy)]
pub(super) struct P8([f32; 8]);

impl P8 {
    #[inline(always)]
    fn zip(a: Self, b: Self, f: impl Fn(f32, f32) -> f32) -> Self {
        P8(std::array::from_fn(|i| f(a.0[i], b.0[i])))
    }
}

impl Lanes for P8 {
    const N: usize = 8;

    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller guarantees eight values at `p`.
        P8(unsafe { p.cast::<[f32; 8]>().read_unaligned() })
    }

    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller guarantees room for eight values at `p`.
        unsafe { p.cast::<[f32; 8]>().write_unaligned(self.0) }
    }

    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        P8([x; 8])
    }

    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        P8(std::array::from_fn(|i| a.0[i] * b.0[i] + c.0[i]))
    }

    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        Self::zip(a, b, |x, y| x * y)
    }

    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        Self::zip(a, b, |x, y| x + y)
    }

    #[inline(always)]
    unsafe fn max(a: Self, b: Self) -> Self {
        Self::zip(a, b, f32::max)
    }

    #[inline(always)]
    unsafe fn exp_sub(a: Self, b: Self) -> Self {
        Self::zip(a, b, |x, y| crate::math::exp(x - y))
    }

    #[inline(always)]
    unsafe fn keep_ge(x: Self, pos: Self, key: Self, other: Self) -> Self {
        P8(std::array::from_fn(|i| if pos.0[i] >= key.0[i] { x.0[i] } else { other.0[i] }))
    }
}
