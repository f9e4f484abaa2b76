//! What the x86 kernel files share, below all of them, so none names another's types:
//! which integer dots a path runs ([`Dots`]), the tiled kernels' loop order, when tiles
//! are quantized in parallel, and the traits each instruction set implements for the row
//! loop ([`RowDots`]), the eight-row tiles ([`PairTotals`]) and the small tiles
//! ([`SmallTotals`]).

use std::arch::x86_64::__m256i;

use crate::kernels::isa::Isa;
use crate::kernels::tile::{Block, XTile};

/// The loop order of the tiled kernels.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Order {
    /// Each weight row once, every tile against it (`qmv_wide`): one pass over the
    /// weights with the row hot in L1.
    RowOuter,
    /// Each tile against a task's whole block of weight rows (`qmm`): the block stays in
    /// L2 while the activation tile is hot in L1.
    TileOuter,
}

/// Which integer dots `qmv` runs: the x86 path's.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub(in crate::kernels) enum Dots {
    /// AVX2's 256-bit dots.
    Avx2,
    /// 512-bit `vpmaddubsw` / `vpmaddwd`.
    Avx512,
    /// 512-bit `vpdpbusd` / `vpdpwssd`.
    Avx512Vnni,
}

impl Dots {
    /// The dots of an x86 path (any other path gets AVX2's, which its caller never asks).
    pub(in crate::kernels) fn of(isa: Isa) -> Dots {
        match isa {
            Isa::Avx512Vnni => Dots::Avx512Vnni,
            Isa::Avx512 => Dots::Avx512,
            _ => Dots::Avx2,
        }
    }
}

/// Tiles at least this many rows are quantized in parallel: below it (a batched decode
/// step) the region's wake-up would cost more than the work.
pub(super) const PARALLEL_QUANTIZE_ROWS: usize = 32;

/// The integer dots of a step of eight groups, lane = group: AVX2's `chunk8` and
/// `chunk8_split` (`row.rs`), or AVX-512's (`avx512.rs`). Every implementation gives the same
/// exact sums, so the float work after them, and every output, is bit-identical across
/// them.
pub(super) trait RowDots {
    /// `row::chunk8`'s contract.
    ///
    /// # Safety
    /// The CPU must have the features of the row loop the implementation is compiled into.
    unsafe fn chunk8<const BITS: u32, const G: usize>(w: &[u8], x: &[Block], ng: usize) -> __m256i;

    /// `row::chunk8_split`'s contract.
    ///
    /// # Safety
    /// As [`RowDots::chunk8`].
    unsafe fn chunk8_split<const G: usize>(w: &[u8], xh: &[Block], xl: &[Block], ng: usize) -> __m256i;
}

/// The exact integer totals, lane = activation row, of 4-bit groups against `T` rows of
/// an eight-slot tile: a g32 pair's ([`PairTotals::pair`]) or one g64 / g128 group's
/// ([`PairTotals::group`]).
pub(super) trait PairTotals {
    /// `(first group, second group)` of a g32 pair. `wv` is the pair's 32 packed bytes (the high 16 zero for a last lone group), `x`
    /// the pair's `T` activation blocks and `xlo` their low planes, or null when the codes
    /// are not split.
    ///
    /// # Safety
    /// The implementation's features are available; `x` (and a non-null `xlo`) are
    /// readable for `T` blocks.
    unsafe fn pair<const T: usize>(wv: __m256i, x: *const Block, xlo: *const Block) -> (__m256i, __m256i);

    /// The exact totals, lane = activation row, of one 4-bit group of `G` = 64 or 128
    /// against `T` rows: `w0` is the group's first 32 packed bytes and `w1` its second
    /// (g128; zero at g64), `x[r]` row `r`'s first block and `x[stride + r]` its second
    /// (g128), `xlo` the low planes laid out as `x`, or null when the codes are not split.
    ///
    /// # Safety
    /// The implementation's features are available; `x` (and a non-null `xlo`) are
    /// readable for `T` blocks (`stride + T` at g128).
    unsafe fn group<const G: usize, const T: usize>(
        w0: __m256i,
        w1: __m256i,
        x: *const Block,
        xlo: *const Block,
        stride: usize,
    ) -> __m256i;
}

/// The integer dots of a small tile's rows: for each of `T` rows, groups `g0 .. g0 + ng`
/// (`ng <= 8`) of one weight row, lane `j` = group `g0 + j`, zero beyond `ng`.
pub(super) trait SmallTotals {
    /// # Safety
    /// The implementation's features are available.
    unsafe fn rows<const BITS: u32, const G: usize, const T: usize>(
        wrow: &[u8],
        xt: &XTile,
        g0: usize,
        ng: usize,
    ) -> [__m256i; T];
}
