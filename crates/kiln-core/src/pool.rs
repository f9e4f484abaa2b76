//! The memory pool: every large allocation (weights, KV cache, scratch) is counted here
//! against a byte limit, with live and peak counters per tag. Running out is an
//! [`OutOfMemory`] value whose message starts `out of memory:`; it is never a panic or an
//! abort, so a caller can report it and exit with the documented code.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::arena::Arena;
use crate::size::{HumanBytes, SizeParseError, parse_size};

/// Environment variable holding the pool limit (`512MiB`, `2GiB`, plain bytes).
pub const MEMORY_LIMIT_ENV: &str = "KILN_MEMORY_LIMIT";

/// Share of physical memory (or of the cgroup limit, when lower) used as the default
/// limit when neither `KILN_MEMORY_LIMIT` nor an explicit limit is given. The rest is left
/// for the process image, the allocator's own overhead and the rest of the machine.
pub const DEFAULT_LIMIT_FRACTION: f64 = 0.85;

/// What an allocation is for, so a peak can be broken down.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tag {
    /// Model parameters.
    Weights,
    /// Attention key/value cache.
    Kv,
    /// Activations and other per-forward temporaries.
    Scratch,
    /// The resident slots of a MoE model's expert cache.
    Experts,
    /// Anything else.
    Other,
}

impl Tag {
    /// Every tag, in display order.
    pub const ALL: [Tag; 5] = [Tag::Weights, Tag::Kv, Tag::Scratch, Tag::Experts, Tag::Other];

    /// The tag's name in reports (`weights`, `kv`, `scratch`, `experts`, `other`).
    pub fn as_str(self) -> &'static str {
        match self {
            Tag::Weights => "weights",
            Tag::Kv => "kv",
            Tag::Scratch => "scratch",
            Tag::Experts => "experts",
            Tag::Other => "other",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A request the pool refused. The message starts `out of memory:` and names the
/// request, what is in use and the limit.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct OutOfMemory {
    /// Bytes asked for.
    pub requested: u64,
    /// What they were for.
    pub tag: Tag,
    /// Bytes held when the request came.
    pub in_use: u64,
    /// The pool's limit.
    pub limit: u64,
}

impl fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.limit == u64::MAX {
            write!(
                f,
                "out of memory: the system refused {} ({} bytes) for {} with {} ({} bytes) in use",
                HumanBytes(self.requested),
                self.requested,
                self.tag,
                HumanBytes(self.in_use),
                self.in_use,
            )
        } else {
            write!(
                f,
                "out of memory: requested {} ({} bytes) for {} with {} ({} bytes) in use, \
                 limit {} ({} bytes)",
                HumanBytes(self.requested),
                self.requested,
                self.tag,
                HumanBytes(self.in_use),
                self.in_use,
                HumanBytes(self.limit),
                self.limit,
            )
        }
    }
}

/// The pool limit could not be determined from the environment.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid {MEMORY_LIMIT_ENV}: {cause}")]
pub struct LimitError {
    /// Why the value is unusable (in the message, not chained, so it is printed once).
    pub cause: LimitCause,
}

/// Why `KILN_MEMORY_LIMIT` is unusable.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LimitCause {
    /// The value is not a size.
    #[error(transparent)]
    Size(#[from] SizeParseError),
    /// The value is not UTF-8 text.
    #[error(
        "the value is not UTF-8 text: accepted values are sizes such as 512MiB, 2GiB or a number of bytes"
    )]
    NotUtf8,
}

/// Hands the heap memory freed so far back to the system (glibc's `malloc_trim`; nothing
/// elsewhere). The pool keeps weights in an arena of their own, outside the heap
/// ([`MemoryPool::alloc_zeroed`]), so what a model load allocates and frees on the heap
/// (building a tokenizer, decoding a tensor's scales) is no longer reused by the weights
/// that follow, and the allocator keeps such freed memory resident unless asked. kiln's
/// loaders call this once the tokenizer is built, before the weights, so the load's peak
/// is not their sum (a GGUF of the Qwen2.5-0.5B shape peaked about 260 MB higher without
/// it), and once the load is done.
pub fn return_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator's own arenas; it
    // takes no pointer and may be called from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// A cloneable handle to one pool; all clones share counters and limit.
#[derive(Clone)]
pub struct MemoryPool {
    inner: Arc<Inner>,
}

struct Inner {
    limit: u64,
    state: Mutex<State>,
    /// Where [`Tag::Weights`] allocations go.
    arena: Mutex<Arena>,
}

#[derive(Default)]
struct State {
    live: [u64; 5],
    peak: [u64; 5],
    at_peak: [u64; 5],
    total: u64,
    peak_total: u64,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the counters half-updated (every
        // update is a handful of integer stores), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn acquire(&self, tag: Tag, bytes: u64) -> Result<(), OutOfMemory> {
        let mut s = self.lock();
        let new_total = s.total.checked_add(bytes).filter(|&t| t <= self.limit);
        let Some(new_total) = new_total else {
            return Err(OutOfMemory { requested: bytes, tag, in_use: s.total, limit: self.limit });
        };
        s.total = new_total;
        let i = tag.index();
        s.live[i] += bytes;
        s.peak[i] = s.peak[i].max(s.live[i]);
        if s.total > s.peak_total {
            s.peak_total = s.total;
            s.at_peak = s.live;
        }
        Ok(())
    }

    fn release(&self, tag: Tag, bytes: u64) {
        let mut s = self.lock();
        s.total -= bytes;
        s.live[tag.index()] -= bytes;
    }
}

impl MemoryPool {
    /// A pool refusing anything that would take the live total above `limit` bytes.
    pub fn with_limit(limit: u64) -> Self {
        MemoryPool {
            inner: Arc::new(Inner { limit, state: Mutex::new(State::default()), arena: Mutex::default() }),
        }
    }

    /// A pool that only counts; the system allocator is still asked fallibly, so a
    /// refusal there is an [`OutOfMemory`] too.
    pub fn unlimited() -> Self {
        Self::with_limit(u64::MAX)
    }

    /// The limit named by `KILN_MEMORY_LIMIT`, if the variable is set.
    pub fn limit_from_env() -> Result<Option<u64>, LimitError> {
        match std::env::var(MEMORY_LIMIT_ENV) {
            Ok(v) => parse_size(&v).map(Some).map_err(|e| LimitError { cause: e.into() }),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(LimitError { cause: LimitCause::NotUtf8 }),
        }
    }

    /// The default limit: [`DEFAULT_LIMIT_FRACTION`] of the memory this process may use
    /// (physical memory, or the cgroup limit when lower); unlimited when unknown.
    pub fn default_limit() -> u64 {
        match available_memory() {
            Some(bytes) => (bytes as f64 * DEFAULT_LIMIT_FRACTION) as u64,
            None => u64::MAX,
        }
    }

    /// A pool whose limit is `KILN_MEMORY_LIMIT` when set, else [`Self::default_limit`].
    pub fn from_env() -> Result<Self, LimitError> {
        Ok(Self::with_limit(Self::limit_from_env()?.unwrap_or_else(Self::default_limit)))
    }

    /// The limit in bytes (`u64::MAX` when unlimited).
    pub fn limit(&self) -> u64 {
        self.inner.limit
    }

    /// Counts `bytes` against the limit under `tag` until the returned lease is dropped.
    /// Used for memory the pool does not allocate itself, such as mapped weights.
    pub fn reserve(&self, tag: Tag, bytes: u64) -> Result<Lease, OutOfMemory> {
        self.inner.acquire(tag, bytes)?;
        Ok(Lease { pool: Arc::clone(&self.inner), tag, bytes })
    }

    /// `len` elements' room in the weight arena (huge pages where the system gives them),
    /// or `None` when the system refuses.
    pub(crate) fn arena_slot<T>(&self, len: usize) -> Option<crate::arena::Slot<T>> {
        self.inner.arena.lock().unwrap_or_else(|p| p.into_inner()).take::<T>(len)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> PoolStats {
        let s = self.inner.lock();
        let by_tag = Tag::ALL
            .iter()
            .map(|&t| {
                let i = t.index();
                let stats = TagStats { live: s.live[i], peak: s.peak[i], at_peak: s.at_peak[i] };
                (t.as_str().to_string(), stats)
            })
            .collect();
        PoolStats {
            limit_bytes: (self.inner.limit != u64::MAX).then_some(self.inner.limit),
            live_bytes: s.total,
            peak_bytes: s.peak_total,
            by_tag,
        }
    }
}

impl fmt::Debug for MemoryPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryPool").field("limit", &self.inner.limit).finish_non_exhaustive()
    }
}

/// Bytes counted against a pool until dropped.
pub struct Lease {
    pool: Arc<Inner>,
    tag: Tag,
    bytes: u64,
}

impl Lease {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// What the bytes are for.
    pub fn tag(&self) -> Tag {
        self.tag
    }

    /// Counts `extra` more bytes under the same tag.
    pub fn grow(&mut self, extra: u64) -> Result<(), OutOfMemory> {
        self.pool.acquire(self.tag, extra)?;
        self.bytes += extra;
        Ok(())
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.pool.release(self.tag, self.bytes);
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease").field("tag", &self.tag).field("bytes", &self.bytes).finish()
    }
}

/// Counters of one tag.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TagStats {
    /// Bytes held now.
    pub live: u64,
    /// Most bytes this tag ever held.
    pub peak: u64,
    /// Bytes this tag held at the moment of the pool-wide peak.
    pub at_peak: u64,
}

/// A snapshot of a pool's counters.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PoolStats {
    /// The limit, absent when unlimited.
    pub limit_bytes: Option<u64>,
    /// Bytes held now.
    pub live_bytes: u64,
    /// Most bytes ever held at once.
    pub peak_bytes: u64,
    /// The same, per tag.
    pub by_tag: BTreeMap<String, TagStats>,
}

/// Memory this process may use: physical memory, or the cgroup v2 limit when lower.
pub fn available_memory() -> Option<u64> {
    let physical = physical_memory();
    let cgroup = cgroup_limit();
    match (physical, cgroup) {
        (Some(p), Some(c)) => Some(p.min(c)),
        (p, c) => p.or(c),
    }
}

/// Installed physical memory, when the platform says.
pub fn physical_memory() -> Option<u64> {
    #[cfg(unix)]
    {
        // SAFETY: sysconf only reads system configuration; both names are valid on every
        // unix libc supports.
        let (pages, page) =
            unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
        if pages > 0 && page > 0 {
            return Some(pages as u64 * page as u64);
        }
        None
    }
    #[cfg(not(unix))]
    {
        None
    }
}

fn cgroup_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/sys/fs/cgroup/memory.max").ok()?;
    text.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_live_and_peak_per_tag() {
        let pool = MemoryPool::with_limit(1000);
        let w = pool.reserve(Tag::Weights, 600).unwrap();
        let k = pool.reserve(Tag::Kv, 300).unwrap();
        drop(k);
        let s = pool.reserve(Tag::Scratch, 100).unwrap();
        let stats = pool.stats();
        assert_eq!(stats.live_bytes, 700);
        assert_eq!(stats.peak_bytes, 900);
        assert_eq!(stats.by_tag["kv"], TagStats { live: 0, peak: 300, at_peak: 300 });
        assert_eq!(stats.by_tag["weights"].at_peak, 600);
        assert_eq!(stats.by_tag["scratch"].at_peak, 0);
        drop((w, s));
        assert_eq!(pool.stats().live_bytes, 0);
    }

    #[test]
    fn refusal_is_a_value_with_a_stable_message() {
        let pool = MemoryPool::with_limit(1 << 20);
        let _held = pool.reserve(Tag::Weights, 800 << 10).unwrap();
        let e = pool.alloc_zeroed::<f32>(Tag::Kv, 100_000).unwrap_err();
        assert_eq!(e.requested, 400_000);
        assert_eq!(e.in_use, 800 << 10);
        let msg = e.to_string();
        assert!(msg.starts_with("out of memory: requested 390.62 KiB (400000 bytes) for kv"), "{msg}");
        assert!(msg.contains("limit 1.00 MiB (1048576 bytes)"), "{msg}");
        // The refused request left nothing behind.
        assert_eq!(pool.stats().live_bytes, 800 << 10);
    }

    #[test]
    fn a_lease_grows_within_the_limit() {
        let pool = MemoryPool::with_limit(100);
        let mut l = pool.reserve(Tag::Kv, 40).unwrap();
        l.grow(60).unwrap();
        assert!(l.grow(1).is_err());
        assert_eq!(l.bytes(), 100);
        drop(l);
        assert_eq!(pool.stats().live_bytes, 0);
    }

    #[test]
    fn huge_requests_do_not_overflow() {
        let pool = MemoryPool::unlimited();
        let _a = pool.reserve(Tag::Other, u64::MAX - 10).unwrap();
        assert!(pool.reserve(Tag::Other, 100).is_err());
        let pool = MemoryPool::with_limit(10);
        assert!(pool.alloc_zeroed::<u64>(Tag::Other, usize::MAX).is_err());
    }

    #[test]
    fn default_limit_is_a_fraction_of_memory() {
        if let Some(mem) = available_memory() {
            let limit = MemoryPool::default_limit();
            assert!(limit < mem && limit > mem / 2);
        }
    }
}
