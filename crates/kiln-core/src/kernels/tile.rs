//! The block layout the AVX2 kernels read activation codes in (x86-64 only; NEON and the
//! portable kernels read codes in element order, see [`super::act::XRows`]).
//!
//! Codes are laid out in 64-byte blocks, one per 32 bytes of packed weights, so a block of
//! weights and its block of activations are read with the same stride:
//! - 4-bit weights: a block covers 64 elements; byte `i` of the packed block holds element
//!   `2i` in its low nibble and `2i + 1` in its high nibble, so the activation block holds
//!   the even elements in bytes `0..32` and the odd ones in bytes `32..64`. A trailing
//!   half block (group size 32, K an odd number of groups) leaves bytes `16..32` and
//!   `48..64` zero.
//! - 4-bit weights under `int16` ([`ActCodes::I16Split`]): two such 8-bit planes, the high
//!   one in `blocks` and the low one in `lo` with the same layout, each code being
//!   `256 * hi + lo` ([`super::act::split_code`]).
//! - 8-bit weights: a block covers 32 elements, stored as 32 little-endian `i16`.
//!
//! A tile holds up to eight activation rows with their blocks interleaved
//! (`[block][slot][64 bytes]`), so one pointer walks all rows of the tile, and its scales
//! and sums transposed (`[group][8 lanes]`, lane = row) so the float work for a group is one
//! vector operation for the whole tile.
//!
//! Its functions are `inline(always)` so that the AVX2 kernels, which call them from a
//! `#[target_feature]` function, get them compiled for AVX2.

use super::act::{ActCodes, TILE_ROWS, quantize_group, split_code};

/// One 64-byte block of activation codes, aligned so a block never straddles a cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Block(pub [u8; 64]);

const ZERO_BLOCK: Block = Block([0; 64]);

/// Activation rows quantized for weights of one width and group size.
pub(crate) struct XTile {
    /// Slots per block: 1, 2, 4 or 8 (rows beyond `rows` are zero).
    pub slots: usize,
    /// Real activation rows, `1..=slots`.
    pub rows: usize,
    /// `[block][slot]` blocks (for split codes, their high planes).
    pub blocks: Vec<Block>,
    /// The low planes of split codes, laid out as `blocks`; empty for other codes.
    pub lo: Vec<Block>,
    /// Scales: `[slot][group, padded to 8]` (lane = group) for up to
    /// [`GROUP_LANE_ROWS`] slots, else `[group][8]` (lane = row). Padding is zero.
    pub sx: Vec<f32>,
    /// Exact group sums, laid out as `sx`.
    pub xsum: Vec<f32>,
    /// Sums of each group's codes, laid out as `sx`.
    pub qsum: Vec<i32>,
}

/// Activation elements per 64-byte block for `codes`.
pub(crate) fn elems_per_block(codes: ActCodes) -> usize {
    match codes {
        ActCodes::I8Deinterleaved | ActCodes::I16Split => 64,
        ActCodes::I16 => 32,
    }
}

/// Blocks per activation row of `k` elements.
pub(crate) fn blocks_per_row(codes: ActCodes, k: usize) -> usize {
    k.div_ceil(elems_per_block(codes))
}

/// `n` rounded up to a multiple of 8.
pub(crate) fn pad8(n: usize) -> usize {
    n.div_ceil(8) * 8
}

/// One row's codes, scales and sums in the block layout.
struct RowCodes {
    blocks: Vec<Block>,
    lo: Vec<Block>,
    sx: Vec<f32>,
    xsum: Vec<f32>,
    qsum: Vec<i32>,
}

/// Quantizes one activation row per group of `g` into the block layout.
#[inline(always)]
fn quantize_row(x: &[f32], g: usize, codes: ActCodes) -> RowCodes {
    let k = x.len();
    let gpr = k / g;
    let mut blocks = vec![ZERO_BLOCK; blocks_per_row(codes, k)];
    let mut lo = Vec::new();
    let mut sx = vec![0f32; pad8(gpr)];
    let mut xsum = vec![0f32; pad8(gpr)];
    let mut qsum = vec![0i32; pad8(gpr)];
    let mut q = vec![0i16; k];
    for (gi, (xs, qs)) in x.chunks_exact(g).zip(q.chunks_exact_mut(g)).enumerate() {
        let gq = quantize_group(xs, codes.max_code(), qs);
        (sx[gi], xsum[gi], qsum[gi]) = (gq.sx, gq.xsum, gq.qsum);
    }
    match codes {
        ActCodes::I8Deinterleaved => {
            // Per 64 elements: even ones to bytes 0..32, odd ones to 32..64 (a trailing
            // half block fills 0..16 and 32..48).
            for (blk, qc) in blocks.iter_mut().zip(q.chunks(64)) {
                for (i, pair) in qc.chunks_exact(2).enumerate() {
                    blk.0[i] = (pair[0] as i8) as u8;
                    blk.0[32 + i] = (pair[1] as i8) as u8;
                }
            }
        }
        ActCodes::I16Split => {
            // Both planes de-interleaved as the 8-bit codes are.
            lo = blocks.clone();
            for ((bh, bl), qc) in blocks.iter_mut().zip(lo.iter_mut()).zip(q.chunks(64)) {
                for (i, pair) in qc.chunks_exact(2).enumerate() {
                    let ((h0, l0), (h1, l1)) = (split_code(pair[0]), split_code(pair[1]));
                    (bh.0[i], bh.0[32 + i]) = (h0 as u8, h1 as u8);
                    (bl.0[i], bl.0[32 + i]) = (l0 as u8, l1 as u8);
                }
            }
        }
        ActCodes::I16 => {
            for (blk, qc) in blocks.iter_mut().zip(q.chunks(32)) {
                for (i, &c) in qc.iter().enumerate() {
                    blk.0[2 * i..2 * i + 2].copy_from_slice(&c.to_le_bytes());
                }
            }
        }
    }
    RowCodes { blocks, lo, sx, xsum, qsum }
}

/// Rows up to which a tile keeps `qmv`'s layout of scales (lane = group); larger tiles
/// are padded to eight rows and transposed (lane = row).
pub(crate) const GROUP_LANE_ROWS: usize = 4;

/// Slot count for a tile of `rows` rows: the rows themselves up to
/// [`GROUP_LANE_ROWS`], else eight.
pub(crate) fn slots_for(rows: usize) -> usize {
    debug_assert!((1..=TILE_ROWS).contains(&rows));
    if rows <= GROUP_LANE_ROWS { rows } else { TILE_ROWS }
}

impl XTile {
    /// One activation row in the vector layout `qmv` reads: scales and sums `[group]`
    /// (lane = group), and blocks, padded with zeros to a whole number of eight groups.
    #[inline(always)]
    pub fn vector(x: &[f32], g: usize, codes: ActCodes) -> XTile {
        let RowCodes { mut blocks, mut lo, sx, xsum, qsum } = quantize_row(x, g, codes);
        let chunk_blocks = (8 * g).div_ceil(elems_per_block(codes));
        let padded = blocks.len().div_ceil(chunk_blocks) * chunk_blocks;
        blocks.resize(padded, ZERO_BLOCK);
        if !lo.is_empty() {
            lo.resize(padded, ZERO_BLOCK);
        }
        XTile { slots: 1, rows: 1, blocks, lo, sx, xsum, qsum }
    }

    /// Up to eight rows (`x` holds `rows * k` values) in the tile layout: blocks
    /// `[block][slot]`; scales and sums `[slot][group, padded to 8]` (lane = group, as
    /// `qmv` has them) for up to [`GROUP_LANE_ROWS`] rows, else `[group][8]` (lane = row,
    /// zero beyond `rows`).
    #[inline(always)]
    pub fn tile(x: &[f32], rows: usize, k: usize, g: usize, codes: ActCodes) -> XTile {
        assert!((1..=TILE_ROWS).contains(&rows), "a tile holds 1 to 8 rows, got {rows}");
        assert_eq!(x.len(), rows * k);
        let gpr = k / g;
        let gp = pad8(gpr);
        let nblocks = blocks_per_row(codes, k);
        let slots = slots_for(rows);
        let mut blocks = vec![ZERO_BLOCK; nblocks * slots];
        let mut lo = if codes == ActCodes::I16Split { blocks.clone() } else { Vec::new() };
        let mut sx = vec![0f32; gp * TILE_ROWS];
        let mut xsum = vec![0f32; gp * TILE_ROWS];
        let mut qsum = vec![0i32; gp * TILE_ROWS];
        for (r, xr) in x.chunks_exact(k).enumerate() {
            let rc = quantize_row(xr, g, codes);
            for b in 0..nblocks {
                blocks[b * slots + r] = rc.blocks[b];
            }
            for (b, blk) in rc.lo.iter().enumerate() {
                lo[b * slots + r] = *blk;
            }
            if slots <= GROUP_LANE_ROWS {
                sx[r * gp..(r + 1) * gp].copy_from_slice(&rc.sx);
                xsum[r * gp..(r + 1) * gp].copy_from_slice(&rc.xsum);
                qsum[r * gp..(r + 1) * gp].copy_from_slice(&rc.qsum);
            } else {
                for gi in 0..gpr {
                    sx[gi * TILE_ROWS + r] = rc.sx[gi];
                    xsum[gi * TILE_ROWS + r] = rc.xsum[gi];
                    qsum[gi * TILE_ROWS + r] = rc.qsum[gi];
                }
            }
        }
        XTile { slots, rows, blocks, lo, sx, xsum, qsum }
    }

    /// Whether the codes are split into two planes ([`ActCodes::I16Split`]).
    #[inline]
    pub fn split(&self) -> bool {
        !self.lo.is_empty()
    }

    /// Splits `m` rows of `x` into tiles of at most eight rows (the kernels quantize tiles
    /// on the pool, `x86::quantize_tiles`; tests compare with this).
    #[cfg(test)]
    pub fn tiles(x: &[f32], m: usize, k: usize, g: usize, codes: ActCodes) -> Vec<XTile> {
        (0..m)
            .step_by(TILE_ROWS)
            .map(|r0| {
                let rows = TILE_ROWS.min(m - r0);
                XTile::tile(&x[r0 * k..(r0 + rows) * k], rows, k, g, codes)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::act::I8_MAX;

    #[test]
    fn four_bit_codes_are_deinterleaved_per_block() {
        let k = 96; // one full block and one half block at group size 32
        let x: Vec<f32> = (0..k).map(|i| (i as f32) - 40.0).collect();
        let t = XTile::vector(&x, 32, ActCodes::I8Deinterleaved);
        // Two blocks of codes, padded with zero blocks to a whole step of eight groups.
        assert_eq!(t.blocks.len(), 4);
        assert!(t.blocks[2..].iter().all(|b| b.0 == [0; 64]));
        let b: Vec<u8> = t.blocks.iter().flat_map(|b| b.0).collect();
        let code = |e: usize| {
            let g = e / 32;
            let mut q = [0i16; 32];
            quantize_group(&x[g * 32..(g + 1) * 32], I8_MAX, &mut q);
            q[e % 32] as i8
        };
        assert_eq!(b[0] as i8, code(0));
        assert_eq!(b[32] as i8, code(1));
        assert_eq!(b[5] as i8, code(10));
        assert_eq!(b[37] as i8, code(11));
        // Half block: elements 64..96 fill bytes 0..16 and 32..48 of the second block.
        assert_eq!(b[64] as i8, code(64));
        assert_eq!(b[64 + 32] as i8, code(65));
        assert!(b[64 + 16..64 + 32].iter().all(|&v| v == 0));
        assert!(b[64 + 48..128].iter().all(|&v| v == 0));
        // The largest magnitude of each group maps to +-127 exactly: element 0 is -40.
        assert_eq!(b[0] as i8, -127);
        assert_eq!(t.xsum[0], x[..32].iter().sum::<f32>());
        assert_eq!(t.sx.len(), 8);
        assert_eq!(t.sx[3], 0.0);
    }

    #[test]
    fn split_codes_fill_two_planes_that_recombine() {
        let k = 96;
        let x: Vec<f32> = (0..k).map(|i| ((i * 29 % 83) as f32) * 0.37 - 15.0).collect();
        let t = XTile::vector(&x, 32, ActCodes::I16Split);
        assert!(t.split() && t.lo.len() == t.blocks.len());
        let mut q = vec![0i16; k];
        for (xs, qs) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)) {
            quantize_group(xs, ActCodes::I16Split.max_code(), qs);
        }
        for (e, &c) in q.iter().enumerate() {
            let (blk, i) = (e / 64, (e % 64) / 2 + if e % 2 == 1 { 32 } else { 0 });
            let (hi, lo) = (t.blocks[blk].0[i] as i8, t.lo[blk].0[i] as i8);
            assert_eq!(256 * i32::from(hi) + i32::from(lo), i32::from(c), "element {e}");
        }
        let t3 = &XTile::tiles(&[x.clone(), x.clone(), x].concat(), 3, k, 32, ActCodes::I16Split)[0];
        assert_eq!(t3.lo[3 + 2].0, t.lo[1].0);
        assert!(!XTile::vector(&[1.0; 64], 64, ActCodes::I8Deinterleaved).split());
    }

    #[test]
    fn tiles_interleave_rows_and_transpose_scales() {
        let (m, k, g) = (3, 64, 64);
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32) - 50.0).collect();
        let ts = XTile::tiles(&x, m, k, g, ActCodes::I16);
        assert_eq!(ts.len(), 1);
        let t = &ts[0];
        assert_eq!((t.slots, t.rows), (3, 3));
        assert_eq!(t.blocks.len(), 2 * 3);
        for r in 0..m {
            let single = XTile::vector(&x[r * k..(r + 1) * k], g, ActCodes::I16);
            assert_eq!(t.blocks[r].0, single.blocks[0].0);
            assert_eq!(t.blocks[3 + r].0, single.blocks[1].0);
            // Lane = group, one padded row of scales per activation row.
            assert_eq!(t.sx[8 * r], single.sx[0]);
            assert_eq!(t.xsum[8 * r], single.xsum[0]);
            assert_eq!(t.sx[8 * r + 1..8 * r + 8], [0.0; 7]);
        }
        // Six rows: padded to eight slots, scales transposed (lane = row).
        let x6: Vec<f32> = (0..6 * k).map(|i| ((i * 13 % 29) as f32) - 14.0).collect();
        let t6 = &XTile::tiles(&x6, 6, k, g, ActCodes::I16)[0];
        assert_eq!((t6.slots, t6.rows), (8, 6));
        assert!(t6.blocks[6].0.iter().all(|&v| v == 0));
        let single = XTile::vector(&x6[5 * k..6 * k], g, ActCodes::I16);
        assert_eq!(t6.sx[5], single.sx[0]);
        assert_eq!(t6.sx[6..8], [0.0; 2]);
    }
}
