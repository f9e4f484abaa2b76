//! The expert offload cache: S resident slots, counted by the pool under
//! [`Tag::Experts`], holding copies of the routed experts a MoE forward uses, while every
//! expert lives in its backing store ([`ExpertStore`]).
//!
//! **Geometry.** [`check_cache_geometry`] is the one place the rules live, and it runs
//! before anything is allocated: S is at least the router's top-k (the floor: every
//! expert one token routes to in one layer must be resident at once), at most layers x
//! experts (the total: more slots than experts could never be filled), and at most the
//! backend's slot cap ([`SlotCap`]; the CPU backend's comes from the memory limit). Its
//! error names the geometry, the rule and the cap. Nothing is ever clamped to fit.
//!
//! **Eviction.** Least recently used: every lookup stamps its slot with a clock; a miss
//! takes an empty slot while there is one, else the slot with the oldest stamp. A miss
//! copies the expert's packed weights, scales and biases (the three matrices, each part
//! 64-byte aligned in the slot) and rebuilds the slot's views; hits, misses, bytes
//! copied and copy time are counted ([`CacheStats`]). The bytes in a slot are the
//! backing store's bytes, so the cache changes speed, never a result.
//!
//! **Copying.** A miss's nine parts are copied as one job by [`kiln_core::copy`]: all
//! the bytes split evenly into four runs per worker thread, written with non-temporal
//! stores on x86-64 when the slot is 1 MiB or more. Every page of every slot is written
//! when the cache is built, so no miss pays a first-touch page fault.

pub use crate::error::CacheGeometryError;

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use kiln_core::size::HumanBytes;
use kiln_core::{Buffer, Lease, MemoryPool, OutOfMemory, QuantizedMatrix, ScaleData, SharedBytes, Tag};

use crate::error::{ModelError, Result};
use crate::forward::experts::{Expert, ExpertStore};
use crate::forward::weights::ModelWeights;
use crate::loading::config::{ModelConfig, MoeConfig};

/// Alignment of every part inside a slot, in bytes: one cache line.
pub(crate) const PART_ALIGN: usize = 64;

/// The most slots a backend can hold, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotCap {
    /// The backend (`cpu`).
    pub backend: &'static str,
    /// The most slots; `None` when the backend sets no limit.
    pub slots: Option<u64>,
    /// Where the number comes from, for messages.
    pub reason: String,
}

impl SlotCap {
    /// The CPU backend's cap: the slots that fit in the memory limit after the bytes
    /// already resident (the weights), at `slot_bytes` each. An unlimited pool sets no cap.
    pub fn cpu(memory_limit: u64, resident_bytes: u64, slot_bytes: u64) -> SlotCap {
        if memory_limit == u64::MAX {
            return SlotCap { backend: "cpu", slots: None, reason: "no memory limit".into() };
        }
        let room = memory_limit.saturating_sub(resident_bytes);
        SlotCap {
            backend: "cpu",
            slots: Some(room / slot_bytes.max(1)),
            reason: format!(
                "memory limit {} less {} of weights, {} per slot",
                HumanBytes(memory_limit),
                HumanBytes(resident_bytes),
                HumanBytes(slot_bytes)
            ),
        }
    }
}

/// A legal cache geometry, as [`check_cache_geometry`] returns it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheGeometry {
    /// Resident slots (S).
    pub slots: usize,
    /// Bytes of one slot (one expert, parts aligned).
    pub slot_bytes: u64,
    /// Experts each token routes to (the floor).
    pub top_k: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Routed experts per layer.
    pub experts: usize,
}

impl CacheGeometry {
    /// Bytes of all slots.
    pub fn cache_bytes(&self) -> u64 {
        self.slots as u64 * self.slot_bytes
    }

    /// layers x experts.
    pub fn total(&self) -> usize {
        self.layers * self.experts
    }
}

/// Bytes of one slot holding an expert of `moe` in a model of residual width `hidden`
/// quantized with `bits`/`group_size` and scales of `scale_size` bytes: the three
/// matrices' packed words, scales and biases, each part rounded up to 64 bytes.
pub fn slot_bytes(hidden: usize, moe: &MoeConfig, bits: usize, group_size: usize, scale_size: usize) -> u64 {
    let i = moe.expert_intermediate_size;
    let part = |b: usize| b.next_multiple_of(PART_ALIGN) as u64;
    // gate and up are [i, hidden], down is [hidden, i]: the same element count.
    let packed = part(i * hidden * bits / 8);
    let scales = part(i * hidden / group_size * scale_size);
    3 * (packed + 2 * scales)
}

/// Bytes of one slot for `config`'s experts (quantized as its `quantization` says), or
/// `None` for a dense or unquantized model.
pub fn slot_bytes_for(config: &ModelConfig) -> Option<u64> {
    let moe = config.moe.as_ref()?;
    let spec = config.quantization.as_ref()?.default;
    // Synthetic and mlx-community checkpoints store scales and biases as bf16.
    Some(slot_bytes(config.hidden_size, moe, spec.bits() as usize, spec.group_size(), 2))
}

/// Bytes of one slot holding `store`'s experts as they are loaded (each part of each
/// matrix aligned as a slot aligns it).
pub fn slot_bytes_of(store: &ExpertStore) -> u64 {
    Layout::of(store.by_id(0)).bytes as u64
}

/// The CPU backend's checked geometry of `slots` slots of `slot_bytes` (as
/// [`ModelInfo::expert_slot_bytes`](crate::ModelInfo) or [`slot_bytes_of`] give them;
/// `None` when the experts are not quantized) for `config`'s model, whose weights take
/// `weight_bytes` of a pool limited to `memory_limit`.
pub fn cpu_geometry(
    model: &str,
    config: &ModelConfig,
    slot_bytes: Option<u64>,
    slots: usize,
    weight_bytes: u64,
    memory_limit: u64,
) -> Result<CacheGeometry> {
    let (Some(moe), Some(slot)) = (config.moe.as_ref(), slot_bytes) else {
        return Err(ModelError::InvalidArgument {
            what: format!("--expert-slots {slots}"),
            message: format!(
                "{model} is not a quantized mixture-of-experts model (model_type {}); the expert cache \
                 applies to qwen2_moe, qwen3_moe and mixtral models",
                config.architecture.as_str()
            ),
        });
    };
    let cap = SlotCap::cpu(memory_limit, weight_bytes, slot);
    Ok(check_cache_geometry(model, moe, config.num_hidden_layers, slots, slot, &cap)?)
}

/// Checks `slots` against the CPU backend's rules for a loaded model (the weights in
/// `pool` so far count against its limit) and allocates the cache.
pub fn build(
    config: &ModelConfig,
    weights: &ModelWeights,
    slots: usize,
    pool: &MemoryPool,
) -> Result<ExpertCache> {
    let resident = pool.stats().live_bytes;
    let store = weights.experts.as_ref();
    let geometry =
        cpu_geometry("the model", config, store.map(slot_bytes_of), slots, resident, pool.limit())?;
    let store = store.ok_or_else(|| ModelError::InvalidArgument {
        what: format!("--expert-slots {slots}"),
        message: "the model has no routed experts".into(),
    })?;
    Ok(ExpertCache::new(store, geometry, pool)?)
}

/// Checks a cache of `slots` slots of `slot_bytes` for `model` (`layers` layers of
/// `moe`) against the floor, the total and `cap`, in that order, before anything is
/// allocated.
pub fn check_cache_geometry(
    model: &str,
    moe: &MoeConfig,
    layers: usize,
    slots: usize,
    slot_bytes: u64,
    cap: &SlotCap,
) -> Result<CacheGeometry, CacheGeometryError> {
    let total = layers * moe.experts;
    let most = match cap.slots {
        Some(c) if c < total as u64 => format!("{c} (the {} backend's slot limit)", cap.backend),
        _ => format!("{total} (layers x experts)"),
    };
    if slots < moe.top_k {
        return Err(CacheGeometryError::BelowFloor { model: model.into(), slots, top_k: moe.top_k, most });
    }
    if slots > total {
        return Err(CacheGeometryError::AboveTotal {
            model: model.into(),
            slots,
            layers,
            experts: moe.experts,
            total,
            top_k: moe.top_k,
        });
    }
    if let Some(c) = cap.slots
        && slots as u64 > c
    {
        return Err(CacheGeometryError::AboveCap {
            model: model.into(),
            slots,
            backend: cap.backend,
            cap: c,
            reason: cap.reason.clone(),
        });
    }
    Ok(CacheGeometry { slots, slot_bytes, top_k: moe.top_k, layers, experts: moe.experts })
}

/// What the cache has done since it was made (or since [`ExpertCache::reset_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct CacheStats {
    /// Lookups that found the expert resident.
    pub hits: u64,
    /// Lookups that copied it in.
    pub misses: u64,
    /// Bytes copied by misses.
    pub bytes_copied: u64,
    /// Time spent copying, in nanoseconds.
    pub copy_ns: u64,
}

impl CacheStats {
    /// Misses over lookups (0 when there were none).
    pub fn miss_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 { 0.0 } else { self.misses as f64 / n as f64 }
    }
}

/// Where each part of an expert sits in a slot: (start, end) byte ranges for packed,
/// scales and biases of gate, up and down.
#[derive(Clone, Copy, Debug)]
struct Layout {
    parts: [(usize, usize); 9],
    bytes: usize,
}

impl Layout {
    fn of(expert: &Expert) -> Layout {
        let mut parts = [(0, 0); 9];
        let mut at = 0;
        for (i, len) in expert.parts().iter().flat_map(|m| part_bytes(m).map(<[u8]>::len)).enumerate() {
            parts[i] = (at, at + len);
            at = (at + len).next_multiple_of(PART_ALIGN);
        }
        Layout { parts, bytes: at }
    }
}

/// The raw bytes of a matrix's packed words, scales and biases.
fn part_bytes(m: &QuantizedMatrix) -> [&[u8]; 3] {
    [bytemuck::cast_slice(m.packed()), scale_bytes(m.scales()), scale_bytes(m.biases())]
}

fn scale_bytes(s: &ScaleData) -> &[u8] {
    match s {
        ScaleData::F16(b) => bytemuck::cast_slice(b),
        ScaleData::Bf16(b) => bytemuck::cast_slice(b),
        ScaleData::F32(b) => bytemuck::cast_slice(b),
    }
}

/// One slot's memory, counted by the pool while it lives.
struct SlotMem {
    words: Vec<u64>,
    _lease: Lease,
}

impl SharedBytes for SlotMem {
    fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.words)
    }
}

struct Slot {
    mem: Arc<SlotMem>,
    /// The flat id (`layer * experts + expert`) of the expert held, with its views.
    held: Option<(usize, Expert)>,
    last_used: u64,
}

/// S resident expert slots in front of an [`ExpertStore`]; see the module docs.
pub struct ExpertCache {
    geometry: CacheGeometry,
    layout: Layout,
    slots: Vec<Slot>,
    /// Slot holding each expert (flat id), or `usize::MAX`.
    slot_of: Vec<usize>,
    clock: u64,
    stats: CacheStats,
}

impl fmt::Debug for ExpertCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExpertCache").field("geometry", &self.geometry).field("stats", &self.stats).finish()
    }
}

impl ExpertCache {
    /// Allocates the slots of `geometry` (checked by [`check_cache_geometry`]) for
    /// `store`'s experts from `pool` under [`Tag::Experts`], empty.
    pub fn new(store: &ExpertStore, geometry: CacheGeometry, pool: &MemoryPool) -> Result<Self, OutOfMemory> {
        let layout = Layout::of(store.by_id(0));
        debug_assert_eq!(layout.bytes as u64, geometry.slot_bytes, "slot_bytes disagrees with the store");
        let words = layout.bytes.div_ceil(8);
        // One refusal check for the whole cache before any slot is allocated.
        let all = pool.reserve(Tag::Experts, geometry.slots as u64 * words as u64 * 8)?;
        drop(all);
        let mut slots = Vec::with_capacity(geometry.slots);
        for _ in 0..geometry.slots {
            let lease = pool.reserve(Tag::Experts, words as u64 * 8)?;
            // Written now, not left to the allocator's lazily mapped zero pages: the page
            // faults belong to allocation, not to the first miss a slot takes.
            let mut w = vec![0u64; words];
            prefault(&mut w);
            let mem = Arc::new(SlotMem { words: w, _lease: lease });
            slots.push(Slot { mem, held: None, last_used: 0 });
        }
        Ok(ExpertCache {
            geometry,
            layout,
            slots,
            slot_of: vec![usize::MAX; store.total()],
            clock: 0,
            stats: CacheStats::default(),
        })
    }

    /// The geometry.
    pub fn geometry(&self) -> &CacheGeometry {
        &self.geometry
    }

    /// Counters since creation or the last reset.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Zeroes the counters (the slots keep what they hold).
    pub fn reset_stats(&mut self) {
        self.stats = CacheStats::default();
    }

    /// Whether expert `expert` of `layer` is resident.
    pub fn is_resident(&self, layer: usize, expert: usize) -> bool {
        self.slot_of[layer * self.geometry.experts + expert] != usize::MAX
    }

    /// Expert `expert` of `layer`, copied into a slot first when it is not resident.
    pub fn get(&mut self, store: &ExpertStore, layer: usize, expert: usize) -> &Expert {
        let id = layer * self.geometry.experts + expert;
        self.clock += 1;
        let s = match self.slot_of[id] {
            usize::MAX => {
                let s = self.victim();
                self.fill(store, s, id);
                s
            }
            s => {
                self.stats.hits += 1;
                s
            }
        };
        self.slots[s].last_used = self.clock;
        &self.slots[s].held.as_ref().expect("a filled slot").1
    }

    /// An empty slot, else the least recently used one.
    fn victim(&self) -> usize {
        let mut best = 0;
        for (i, s) in self.slots.iter().enumerate() {
            if s.held.is_none() {
                return i;
            }
            if s.last_used < self.slots[best].last_used {
                best = i;
            }
        }
        best
    }

    /// Copies expert `id` from `store` into slot `s`, evicting what it held.
    fn fill(&mut self, store: &ExpertStore, s: usize, id: usize) {
        let slot = &mut self.slots[s];
        if let Some((old, views)) = slot.held.take() {
            self.slot_of[old] = usize::MAX;
            drop(views);
        }
        let src = store.by_id(id);
        let t = Instant::now();
        {
            let mem = Arc::get_mut(&mut slot.mem).expect("a slot's views are dropped before it is refilled");
            let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut mem.words);
            let parts = src.parts();
            let sources = parts.iter().flat_map(|m| part_bytes(m));
            let mut jobs: Vec<(&[u8], &mut [u8])> = Vec::with_capacity(9);
            let mut rest = dst;
            let mut at = 0;
            for (bytes, &(start, end)) in sources.zip(self.layout.parts.iter()) {
                let (_, tail) = std::mem::take(&mut rest).split_at_mut(start - at);
                let (part, tail) = tail.split_at_mut(end - start);
                jobs.push((bytes, part));
                rest = tail;
                at = end;
            }
            kiln_core::copy::copy_ranges(jobs);
        }
        self.stats.copy_ns += t.elapsed().as_nanos() as u64;
        self.stats.misses += 1;
        self.stats.bytes_copied += src.bytes() as u64;
        let views = self.views(&slot_mem(&self.slots[s]), src);
        self.slots[s].held = Some((id, views));
        self.slot_of[id] = s;
    }

    /// Views of a slot's bytes as the matrices of `like` (same shapes and dtypes).
    fn views(&self, mem: &Arc<SlotMem>, like: &Expert) -> Expert {
        let bytes: Arc<dyn SharedBytes> = mem.clone();
        let p = &self.layout.parts;
        let view = |m: &QuantizedMatrix, i: usize| -> QuantizedMatrix {
            let packed = Buffer::from_shared(bytes.clone(), p[i].0, p[i].1, None).expect("aligned slot part");
            let scale = |s: &ScaleData, (a, b): (usize, usize)| match s {
                ScaleData::F16(_) => {
                    ScaleData::F16(Buffer::from_shared(bytes.clone(), a, b, None).expect("aligned"))
                }
                ScaleData::Bf16(_) => {
                    ScaleData::Bf16(Buffer::from_shared(bytes.clone(), a, b, None).expect("aligned"))
                }
                ScaleData::F32(_) => {
                    ScaleData::F32(Buffer::from_shared(bytes.clone(), a, b, None).expect("aligned"))
                }
            };
            QuantizedMatrix::new(
                m.n(),
                m.k(),
                m.spec(),
                packed,
                scale(m.scales(), p[i + 1]),
                scale(m.biases(), p[i + 2]),
            )
            .expect("a slot holds the store's geometry")
        };
        Expert {
            gate_proj: view(&like.gate_proj, 0),
            up_proj: view(&like.up_proj, 3),
            down_proj: view(&like.down_proj, 6),
        }
    }
}

/// Writes one word in every 4 KiB page `words` touches (a store the optimiser may not
/// drop), by address: the slice need not start on a page boundary, so its first and last
/// pages may be partial.
fn prefault(words: &mut [u64]) {
    const PAGE: usize = 4096;
    let start = words.as_ptr() as usize;
    let mut i = 0;
    while i < words.len() {
        *std::hint::black_box(&mut words[i]) = 0;
        // The first word of the next page.
        let next = (start + i * 8 + 1).next_multiple_of(PAGE);
        i = (next - start).div_ceil(8);
    }
    if let Some(last) = words.last_mut() {
        *std::hint::black_box(last) = 0;
    }
}

fn slot_mem(s: &Slot) -> Arc<SlotMem> {
    Arc::clone(&s.mem)
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use half::bf16;
    use kiln_core::{MemoryPool, QuantSpec};

    use super::*;
    use crate::loading::config::MoeConfig;

    /// A store of `n` experts of `[rows, cols]` matrices, each expert's bytes distinct.
    fn store(n: usize, rows: usize, cols: usize) -> ExpertStore {
        let spec = QuantSpec::new(4, 64).unwrap();
        let m = |seed: u32| {
            let packed: Vec<u32> = (0..rows * cols / 8).map(|i| (i as u32).wrapping_mul(seed | 1)).collect();
            let scales = vec![bf16::from_f32(seed as f32); rows * cols / 64];
            QuantizedMatrix::new(
                rows,
                cols,
                spec,
                packed.into(),
                ScaleData::Bf16(scales.clone().into()),
                ScaleData::Bf16(scales.into()),
            )
            .unwrap()
        };
        let all = (0..n as u32)
            .map(|e| Expert { gate_proj: m(3 * e + 1), up_proj: m(3 * e + 2), down_proj: m(3 * e + 3) })
            .collect();
        ExpertStore::new(1, n, 1, all).unwrap()
    }

    fn geometry(store: &ExpertStore, slots: usize) -> CacheGeometry {
        let moe = MoeConfig {
            experts: store.experts(),
            top_k: 1,
            expert_intermediate_size: 0,
            norm_topk_prob: true,
            shared_expert_intermediate_size: None,
        };
        let slot = Layout::of(store.by_id(0)).bytes as u64;
        let cap = SlotCap { backend: "cpu", slots: None, reason: String::new() };
        check_cache_geometry("test", &moe, 1, slots, slot, &cap).unwrap()
    }

    /// Slots of qwen3-30b-a3b's size (2.65 MB), which the allocator maps lazily: every page must be
    /// resident as soon as the cache is built, before any miss (`mincore`).
    #[test]
    fn every_slot_page_is_resident_before_the_first_miss() {
        let store = store(2, 1024, 1536);
        let pool = MemoryPool::unlimited();
        let cache = ExpertCache::new(&store, geometry(&store, 2), &pool).unwrap();
        let page = 4096;
        for slot in &cache.slots {
            let bytes = slot.mem.bytes();
            let start = bytes.as_ptr() as usize / page * page;
            let end = (bytes.as_ptr() as usize + bytes.len()).next_multiple_of(page);
            let mut vec = vec![0u8; (end - start) / page];
            // SAFETY: `start..end` covers the slot's own allocation rounded out to whole
            // pages, all mapped; `vec` has one byte per page, as mincore writes.
            let rc = unsafe { libc::mincore(start as *mut libc::c_void, end - start, vec.as_mut_ptr()) };
            assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
            let missing = vec.iter().filter(|&&v| v & 1 == 0).count();
            assert_eq!(missing, 0, "{missing} of {} pages of a slot are not resident", vec.len());
        }
    }

    /// A filled slot holds the store's bytes exactly, through the streamed copy (slots of
    /// 1 MiB or more) and after an eviction.
    #[test]
    fn a_filled_slot_holds_the_stores_bytes() {
        let store = store(3, 1024, 1536);
        let pool = MemoryPool::unlimited();
        let mut cache = ExpertCache::new(&store, geometry(&store, 2), &pool).unwrap();
        assert!(cache.geometry.slot_bytes >= kiln_core::copy::STREAM_MIN as u64);
        for e in [0, 1, 2, 0] {
            let got = cache.get(&store, 0, e);
            for (g, w) in got.parts().iter().zip(store.get(0, e).parts()) {
                assert_eq!(part_bytes(g), part_bytes(w), "expert {e}");
            }
        }
        assert_eq!(cache.stats().misses, 4);
    }
}
