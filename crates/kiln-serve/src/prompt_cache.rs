//! The prompt cache: KV caches of finished requests, keyed by the tokens they hold, kept
//! least-recently-used first under a byte budget. A new request adopts the longest
//! cached prefix of its prompt (copied, so the entry stays for others) and prefills only
//! the rest.

use kiln_model::SeqCache;

/// Prefixes shorter than this are not worth a lookup hit: every prompt shares its first
/// few tokens (BOS, the template's header), and adopting those saves nothing measurable.
pub const MIN_PREFIX_TOKENS: usize = 16;

struct Entry<C> {
    tokens: Vec<u32>,
    cache: C,
    last_used: u64,
}

/// Cached sequences under a byte budget, in the backend's own caches (device memory on
/// a GPU backend).
pub struct PromptCache<C> {
    entries: Vec<Entry<C>>,
    budget: u64,
    clock: u64,
}

/// A prefix found for a prompt.
pub struct Hit<'a, C> {
    /// The cache holding it.
    pub cache: &'a C,
    /// Positions to adopt.
    pub tokens: usize,
}

impl<C: SeqCache> PromptCache<C> {
    /// An empty cache holding at most `budget` bytes (0 disables it).
    pub fn new(budget: u64) -> Self {
        PromptCache { entries: Vec::new(), budget, clock: 0 }
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.cache.bytes()).sum()
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The longest cached prefix of `prompt` that leaves at least one prompt token to
    /// run (the forward that samples the first token needs one), if it is at least
    /// [`MIN_PREFIX_TOKENS`] long. Marks the entry used.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<Hit<'_, C>> {
        let usable = prompt.len().saturating_sub(1);
        let (best, len) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, common_prefix(&e.tokens, prompt).min(usable)))
            .max_by_key(|&(i, len)| (len, self.entries[i].last_used))?;
        if len < MIN_PREFIX_TOKENS {
            return None;
        }
        self.clock += 1;
        let e = &mut self.entries[best];
        e.last_used = self.clock;
        Some(Hit { cache: &e.cache, tokens: len })
    }

    /// Keeps `cache`, which holds `tokens`, evicting least recently used entries to stay
    /// within the budget. An entry whose tokens are a prefix of `tokens` is replaced; a
    /// cache larger than the whole budget is dropped.
    pub fn insert(&mut self, tokens: Vec<u32>, cache: C) {
        debug_assert_eq!(tokens.len(), cache.len());
        if cache.bytes() > self.budget || tokens.len() < MIN_PREFIX_TOKENS {
            return;
        }
        self.entries.retain(|e| !(e.tokens.len() <= tokens.len() && tokens.starts_with(&e.tokens)));
        if self.entries.iter().any(|e| e.tokens.starts_with(&tokens)) {
            return;
        }
        while self.bytes() + cache.bytes() > self.budget && self.evict_one() {}
        self.clock += 1;
        self.entries.push(Entry { tokens, cache, last_used: self.clock });
    }

    /// Drops the least recently used entry; false when there was none.
    pub fn evict_one(&mut self) -> bool {
        match self.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used) {
            Some((i, _)) => {
                self.entries.swap_remove(i);
                true
            }
            None => false,
        }
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use kiln_core::MemoryPool;
    use kiln_model::{KvCache, KvDtype, KvLayout};

    use super::*;

    fn cache_of(pool: &MemoryPool, n: usize) -> KvCache {
        let mut c = KvCache::new(KvLayout { layers: 1, kv_heads: 1, head_dim: 2, dtype: KvDtype::F32 }, pool);
        c.reserve(n).unwrap();
        c.commit(n);
        c
    }

    #[test]
    fn the_longest_prefix_wins_and_one_token_is_left_to_run() {
        let pool = MemoryPool::unlimited();
        let mut pc = PromptCache::new(u64::MAX);
        let a: Vec<u32> = (0..40).collect();
        let mut b: Vec<u32> = (0..20).collect();
        b.extend(100..120);
        pc.insert(a.clone(), cache_of(&pool, 40));
        pc.insert(b.clone(), cache_of(&pool, 40));
        assert_eq!(pc.lookup(&a).unwrap().tokens, 39);
        let mut q: Vec<u32> = (0..30).collect();
        q.push(7);
        assert_eq!(pc.lookup(&q).unwrap().tokens, 30);
        assert_eq!(pc.lookup(&b[..25]).unwrap().tokens, 24);
        assert!(pc.lookup(&[0, 1, 2, 3]).is_none(), "below the minimum prefix");
        assert!(pc.lookup(&[5; 40]).is_none());
    }

    #[test]
    fn the_budget_evicts_the_least_recently_used() {
        let pool = MemoryPool::unlimited();
        let one = cache_of(&pool, 20).bytes();
        let mut pc = PromptCache::new(2 * one);
        let seq = |start: u32| -> Vec<u32> { (start..start + 20).collect() };
        pc.insert(seq(0), cache_of(&pool, 20));
        pc.insert(seq(100), cache_of(&pool, 20));
        assert!(pc.lookup(&seq(0)).is_some());
        pc.insert(seq(200), cache_of(&pool, 20));
        assert_eq!(pc.len(), 2);
        assert!(pc.lookup(&seq(100)).is_none(), "the least recently used went");
        assert!(pc.lookup(&seq(0)).is_some());
        assert!(pc.bytes() <= 2 * one);
        let mut none = PromptCache::new(0);
        none.insert(seq(0), cache_of(&pool, 20));
        assert!(none.is_empty());
    }

    #[test]
    fn a_longer_sequence_replaces_its_prefix() {
        let pool = MemoryPool::unlimited();
        let mut pc = PromptCache::new(u64::MAX);
        let long: Vec<u32> = (0..30).collect();
        pc.insert(long[..20].to_vec(), cache_of(&pool, 20));
        pc.insert(long.clone(), cache_of(&pool, 30));
        assert_eq!(pc.len(), 1);
        pc.insert(long[..25].to_vec(), cache_of(&pool, 25));
        assert_eq!(pc.len(), 1, "a prefix of a held entry adds nothing");
    }
}
