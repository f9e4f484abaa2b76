//! The key/value cache of one sequence: keys and values after RoPE, stored as f16 (or
//! f32) in blocks of [`KV_BLOCK_TOKENS`] positions, each block allocated from the pool
//! under [`Tag::Kv`] when the sequence first needs it. A block never moves once
//! allocated, so growing the cache never holds two copies.
//!
//! Inside a block the layout is `[layer][key|value][kv_head][position][head_dim]`, so the
//! keys of one head over a run of positions are contiguous, which is what attention
//! reads tile by tile.

use half::f16;
use half::slice::HalfFloatSliceExt;
use kiln_core::kernels::attn::{KvRun, KvSource};
use kiln_core::{MemoryPool, OutOfMemory, PoolVec, Tag};

use crate::loading::config::ModelConfig;

/// Positions per block. Attention tiles are powers of two no larger than this, so a tile
/// never straddles two blocks.
pub const KV_BLOCK_TOKENS: usize = 256;

/// Storage type of cached keys and values: the protocol's `--kv-dtype` knob.
pub use kiln_protocol::KvDtype;

/// The shape of a model's cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Decoder layers.
    pub layers: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Storage type.
    pub dtype: KvDtype,
}

impl KvLayout {
    /// The layout of `config`'s cache stored as `dtype`.
    pub fn new(config: &ModelConfig, dtype: KvDtype) -> Self {
        KvLayout {
            layers: config.num_hidden_layers,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            dtype,
        }
    }

    /// Values in one block.
    pub fn block_values(&self) -> usize {
        self.layers * 2 * self.kv_heads * KV_BLOCK_TOKENS * self.head_dim
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> u64 {
        (self.block_values() * self.dtype.size()) as u64
    }

    /// Blocks holding `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(KV_BLOCK_TOKENS)
    }

    /// Bytes a cache of `tokens` positions holds (whole blocks).
    pub fn bytes_for(&self, tokens: usize) -> u64 {
        self.blocks_for(tokens) as u64 * self.block_bytes()
    }

    fn offset(&self, layer: usize, value: bool, head: usize, slot: usize) -> usize {
        (((layer * 2 + value as usize) * self.kv_heads + head) * KV_BLOCK_TOKENS + slot) * self.head_dim
    }
}

enum Blocks {
    F16(Vec<PoolVec<f16>>),
    F32(Vec<PoolVec<f32>>),
}

/// One sequence's cache.
pub struct KvCache {
    layout: KvLayout,
    pool: MemoryPool,
    blocks: Blocks,
    len: usize,
}

impl KvCache {
    /// An empty cache; nothing is allocated until [`Self::reserve`].
    pub fn new(layout: KvLayout, pool: &MemoryPool) -> Self {
        let blocks = match layout.dtype {
            KvDtype::F16 => Blocks::F16(Vec::new()),
            KvDtype::F32 => Blocks::F32(Vec::new()),
        };
        KvCache { layout, pool: pool.clone(), blocks, len: 0 }
    }

    /// The cache's shape.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Positions stored.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the allocated blocks can hold.
    pub fn capacity(&self) -> usize {
        self.block_count() * KV_BLOCK_TOKENS
    }

    fn block_count(&self) -> usize {
        match &self.blocks {
            Blocks::F16(b) => b.len(),
            Blocks::F32(b) => b.len(),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.block_count() as u64 * self.layout.block_bytes()
    }

    /// Allocates blocks until `tokens` positions fit.
    pub fn reserve(&mut self, tokens: usize) -> Result<(), OutOfMemory> {
        let n = self.layout.block_values();
        while self.capacity() < tokens {
            match &mut self.blocks {
                Blocks::F16(b) => b.push(self.pool.alloc_zeroed(Tag::Kv, n)?),
                Blocks::F32(b) => b.push(self.pool.alloc_zeroed(Tag::Kv, n)?),
            }
        }
        Ok(())
    }

    /// Writes the key and value rows (`kv_heads * head_dim` each) of position `pos` in
    /// `layer`. The position must be reserved; it counts once [`Self::commit`] says so.
    pub fn store(&mut self, layer: usize, pos: usize, key: &[f32], value: &[f32]) {
        let (block, slot) = (pos / KV_BLOCK_TOKENS, pos % KV_BLOCK_TOKENS);
        let d = self.layout.head_dim;
        for (is_value, row) in [(false, key), (true, value)] {
            for (head, src) in row.chunks_exact(d).enumerate() {
                let at = self.layout.offset(layer, is_value, head, slot);
                match &mut self.blocks {
                    Blocks::F16(b) => b[block][at..at + d].convert_from_f32_slice(src),
                    Blocks::F32(b) => b[block][at..at + d].copy_from_slice(src),
                }
            }
        }
    }

    /// Counts `n` more positions as stored (after every layer wrote them).
    pub fn commit(&mut self, n: usize) {
        assert!(self.len + n <= self.capacity(), "KvCache::commit: {n} positions beyond the reserved blocks");
        self.len += n;
    }

    /// Forgets every position from `len` on (the blocks stay allocated).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Makes this cache hold the first `n` positions of `src` (a prompt cache adopting a
    /// cached prefix): whatever it held is forgotten, blocks are reserved for `n`
    /// positions, and the blocks covering them are copied whole. Only the `n` positions
    /// count afterwards. Panics when the layouts differ or `src` holds fewer than `n`
    /// positions; on a refused allocation nothing counts as stored.
    pub fn copy_prefix_from(&mut self, src: &KvCache, n: usize) -> Result<(), OutOfMemory> {
        assert_eq!(self.layout, src.layout, "KvCache::copy_prefix_from: layouts differ");
        assert!(
            n <= src.len,
            "KvCache::copy_prefix_from: {n} positions asked of a cache holding {}",
            src.len
        );
        self.len = 0;
        self.reserve(n)?;
        let blocks = self.layout.blocks_for(n);
        match (&mut self.blocks, &src.blocks) {
            (Blocks::F16(dst), Blocks::F16(from)) => {
                for (d, s) in dst.iter_mut().zip(from).take(blocks) {
                    d.copy_from_slice(s);
                }
            }
            (Blocks::F32(dst), Blocks::F32(from)) => {
                for (d, s) in dst.iter_mut().zip(from).take(blocks) {
                    d.copy_from_slice(s);
                }
            }
            _ => unreachable!("equal layouts have equal storage types"),
        }
        self.len = n;
        Ok(())
    }

    /// Copies keys (or values) of `head` in `layer` at positions `start..start + n` into
    /// `out` (`n * head_dim` values) as f32. The run must lie inside one block.
    pub fn read(&self, layer: usize, value: bool, head: usize, start: usize, n: usize, out: &mut [f32]) {
        let out = &mut out[..n * self.layout.head_dim];
        match self.run(layer, value, head, start, n) {
            KvRun::F16(s) => s.convert_to_f32_slice(out),
            KvRun::F32(s) => out.copy_from_slice(s),
        }
    }

    /// `layer` of the cache as a source for [`kiln_core::kernels::attn::decode`].
    pub fn layer(&self, layer: usize) -> LayerKv<'_> {
        LayerKv { cache: self, layer }
    }

    /// The stored keys (or values) of `head` in `layer` at positions `start..start + n`,
    /// as they are held: the fused decode kernel reads them in place. The run must lie
    /// inside one block.
    pub fn run(&self, layer: usize, value: bool, head: usize, start: usize, n: usize) -> KvRun<'_> {
        let (block, slot) = (start / KV_BLOCK_TOKENS, start % KV_BLOCK_TOKENS);
        assert!(slot + n <= KV_BLOCK_TOKENS, "KvCache::run: a run must not straddle blocks");
        let d = self.layout.head_dim;
        let at = self.layout.offset(layer, value, head, slot);
        match &self.blocks {
            Blocks::F16(b) => KvRun::F16(&b[block][at..at + n * d]),
            Blocks::F32(b) => KvRun::F32(&b[block][at..at + n * d]),
        }
    }
}

/// One layer of a cache, as the fused decode kernel reads it.
pub struct LayerKv<'a> {
    cache: &'a KvCache,
    layer: usize,
}

impl KvSource for LayerKv<'_> {
    fn block(&self) -> usize {
        KV_BLOCK_TOKENS
    }

    fn run(&self, value: bool, head: usize, start: usize, n: usize) -> KvRun<'_> {
        self.cache.run(self.layer, value, head, start, n)
    }
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("layout", &self.layout)
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(dtype: KvDtype) -> KvLayout {
        KvLayout { layers: 2, kv_heads: 2, head_dim: 4, dtype }
    }

    #[test]
    fn grows_in_blocks_counted_by_the_pool() {
        let pool = MemoryPool::unlimited();
        let l = layout(KvDtype::F16);
        let mut c = KvCache::new(l, &pool);
        assert_eq!(pool.stats().live_bytes, 0);
        c.reserve(1).unwrap();
        assert_eq!(c.capacity(), KV_BLOCK_TOKENS);
        assert_eq!(pool.stats().by_tag["kv"].live, l.block_bytes());
        c.reserve(KV_BLOCK_TOKENS + 1).unwrap();
        assert_eq!(pool.stats().by_tag["kv"].live, 2 * l.block_bytes());
        assert_eq!(l.bytes_for(KV_BLOCK_TOKENS + 1), 2 * l.block_bytes());
        drop(c);
        assert_eq!(pool.stats().live_bytes, 0);
    }

    #[test]
    fn a_refused_block_is_out_of_memory() {
        let l = layout(KvDtype::F32);
        let pool = MemoryPool::with_limit(l.block_bytes() + 10);
        let mut c = KvCache::new(l, &pool);
        c.reserve(10).unwrap();
        let e = c.reserve(KV_BLOCK_TOKENS + 10).unwrap_err();
        assert_eq!(e.tag, Tag::Kv);
        assert_eq!(c.capacity(), KV_BLOCK_TOKENS);
    }

    #[test]
    fn a_copied_prefix_reads_back_and_forgets_the_rest() {
        for dtype in [KvDtype::F16, KvDtype::F32] {
            let pool = MemoryPool::unlimited();
            let l = layout(dtype);
            let mut src = KvCache::new(l, &pool);
            let n = KV_BLOCK_TOKENS + 3;
            src.reserve(n).unwrap();
            for pos in 0..n {
                let key: Vec<f32> = (0..8).map(|i| (pos * 8 + i) as f32).collect();
                let value: Vec<f32> = key.iter().map(|k| -k).collect();
                for layer in 0..2 {
                    src.store(layer, pos, &key, &value);
                }
            }
            src.commit(n);
            let mut dst = KvCache::new(l, &pool);
            dst.reserve(5).unwrap();
            dst.commit(5);
            dst.copy_prefix_from(&src, KV_BLOCK_TOKENS + 1).unwrap();
            assert_eq!(dst.len(), KV_BLOCK_TOKENS + 1);
            let (mut a, mut b) = ([0f32; 4], [0f32; 4]);
            for pos in [0, 7, KV_BLOCK_TOKENS - 1, KV_BLOCK_TOKENS] {
                for (layer, value, head) in [(0, false, 0), (1, true, 1)] {
                    src.read(layer, value, head, pos, 1, &mut a);
                    dst.read(layer, value, head, pos, 1, &mut b);
                    assert_eq!(a, b, "{dtype:?} position {pos}");
                }
            }
            assert_eq!(dst.capacity(), 2 * KV_BLOCK_TOKENS);
        }
    }

    #[test]
    fn stores_and_reads_back_per_head() {
        for dtype in [KvDtype::F16, KvDtype::F32] {
            let pool = MemoryPool::unlimited();
            let mut c = KvCache::new(layout(dtype), &pool);
            c.reserve(KV_BLOCK_TOKENS + 2).unwrap();
            let key: Vec<f32> = (0..8).map(|i| i as f32 * 0.5).collect();
            let value: Vec<f32> = (0..8).map(|i| -(i as f32)).collect();
            let pos = KV_BLOCK_TOKENS + 1;
            c.store(1, pos, &key, &value);
            c.commit(pos + 1);
            let mut out = [0f32; 8];
            c.read(1, false, 1, pos, 1, &mut out);
            assert_eq!(&out[..4], &key[4..]);
            c.read(1, true, 0, pos - 1, 2, &mut out);
            assert_eq!(&out[4..], &value[..4]);
            assert_eq!(&out[..4], &[0.0; 4]);
        }
    }
}
