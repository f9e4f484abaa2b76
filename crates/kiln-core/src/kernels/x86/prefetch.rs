//! The prefetch policy: which scheme a kernel takes, at what distance, and the hints.

use std::arch::x86_64::*;

/// Rows of packed weights ahead of the current one whose scales and biases are
/// prefetched (they stream beside the codes, an eighth of their bytes).
pub(super) const SCALE_PREFETCH_ROWS: usize = 4;

/// How the packed stream is prefetched while a kernel walks it.
///
/// The hardware prefetchers alone leave the kernels short of the bandwidth a plain sum
/// reaches, so the kernels ask for the lines ahead of the ones they read. Into L1 only (one
/// level, 2 KiB ahead, the best single distance measured) suits short rows. Long rows need
/// two levels: a line in flight from memory into L1 holds one of L1's few miss buffers,
/// and once the activation codes are too large to stay in L1 beside the weights
/// (K = 14336: 14 KiB of 8-bit codes, 28 KiB of 16-bit ones), each code line reloaded from
/// L2 waited behind those buffers, and such rows read at 45-60% of the bandwidth. Asking
/// for lines far ahead into L2 and near ahead into L1 (then a short L2 hit) lifted them to
/// 80-90% on the development machine, 8-bit K = 4096 by about a tenth, and left 4-bit
/// K = 4096 level or a little ahead. The far level costs an instruction per line, which
/// compute-bound loops cannot spare: it slowed `qmv` on 151936 x 896 (short rows, a fixed
/// cost per row) by 5-8% on one thread, and `qmv_wide` at M = 2 on 14336 x 4096 by 5-10%,
/// while it sped M = 2 on 4096 x 14336 (28 KiB of codes) by 10-20%.
#[derive(Clone, Copy)]
pub(super) enum Prefetch {
    /// Into L1, [`PREFETCH_L1_ONLY`] ahead.
    L1,
    /// Into L2, [`PREFETCH_FAR`] ahead, and into L1, [`PREFETCH_NEAR`] ahead.
    TwoLevel,
}

/// Distance of the one-level scheme (1-2 KiB measured best; 4 KiB no better, 8 KiB worse).
pub(super) const PREFETCH_L1_ONLY: usize = 2048;
/// Distances of the two-level scheme: 6-8 KiB into L2 (4 KiB was too close), about 1.5 KiB
/// into L1 (0.75-1.5 KiB measured alike).
pub(super) const PREFETCH_FAR: usize = 8192;
/// See [`PREFETCH_FAR`].
pub(super) const PREFETCH_NEAR: usize = 1536;
/// Bytes of activation codes from which `qmv` (memory-bound) takes the two-level scheme:
/// 4 KiB (4-bit K = 4096, 8-bit K = 2048) and up.
pub(super) const QMV_TWO_LEVEL_CODE_BYTES: usize = 4 << 10;
/// The same for the tiles of up to four rows of `qmv_wide` and `qmm` (compute-bound): 24
/// KiB, three quarters of the L1 data cache.
pub(super) const TILE_TWO_LEVEL_CODE_BYTES: usize = 24 << 10;

impl Prefetch {
    /// The scheme for `qmv` on rows of `k` `bits`-bit codes.
    pub(super) fn for_qmv(k: usize, bits: u32) -> Prefetch {
        Prefetch::by_code_bytes(code_bytes(1, k, bits), QMV_TWO_LEVEL_CODE_BYTES)
    }

    /// The scheme for a tile of `slots` activation rows against rows of `k` `bits`-bit codes.
    pub(super) fn for_tile(slots: usize, k: usize, bits: u32) -> Prefetch {
        Prefetch::by_code_bytes(code_bytes(slots, k, bits), TILE_TWO_LEVEL_CODE_BYTES)
    }

    fn by_code_bytes(bytes: usize, two_level_from: usize) -> Prefetch {
        if bytes >= two_level_from { Prefetch::TwoLevel } else { Prefetch::L1 }
    }
}

/// Asks for the cache lines ahead of `row[off .. off + len]` by [`Prefetch::TwoLevel`]
/// when `TWO_LEVEL`, else by [`Prefetch::L1`]; they may lie past the row (in the next
/// row, or past the matrix, where the hint is dropped).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn prefetch_ahead<const TWO_LEVEL: bool>(row: &[u8], off: usize, len: usize) {
    let at = row.as_ptr().wrapping_add(off);
    // A prefetch is a hint: it never faults, so an address past the end is fine.
    for line in (0..len).step_by(64) {
        if TWO_LEVEL {
            _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(PREFETCH_FAR + line).cast());
            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_NEAR + line).cast());
        } else {
            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_L1_ONLY + line).cast());
        }
    }
}

/// Bytes of activation codes for `slots` rows of `k` elements: 8-bit codes for 4-bit
/// weights, 16-bit ones for 8-bit weights.
pub(super) fn code_bytes(slots: usize, k: usize, bits: u32) -> usize {
    slots * k * if bits == 4 { 1 } else { 2 }
}

/// Asks, into L1 and all at once, for the lines [`PREFETCH_L1_ONLY`] beyond
/// `row[off .. off + len]`: eight-row tiles, compute-bound, ask for a whole row's worth as
/// they start each row.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn prefetch_burst(row: &[u8], off: usize, len: usize) {
    let base = row.as_ptr().wrapping_add(off + PREFETCH_L1_ONLY);
    for line in (0..len).step_by(64) {
        // A hint: it never faults, so an address past the end is fine.
        _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(line).cast());
    }
}

/// Asks for the cache line holding `bytes[off]`, if `off` is in bounds.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn prefetch_line(bytes: &[u8], off: usize) {
    if let Some(p) = bytes.get(off) {
        _mm_prefetch::<_MM_HINT_T0>((p as *const u8).cast());
    }
}
