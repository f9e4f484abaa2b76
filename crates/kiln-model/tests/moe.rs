//! Mixture-of-experts models and the expert offload cache: the geometry rules on every
//! branch, the cache's eviction and counters, and decode with any legal slot count giving
//! the tokens of decode with every expert resident.

use kiln_core::{MemoryPool, Tag};
use kiln_model::expert_cache::{self, slot_bytes_for};
use kiln_model::synthetic;
use kiln_model::{
    CacheGeometryError, EngineOptions, ExpertCache, KvDtype, MoeConfig, Session, SlotCap,
    check_cache_geometry,
};

const QWEN3: MoeConfig = MoeConfig {
    experts: 128,
    top_k: 8,
    expert_intermediate_size: 768,
    norm_topk_prob: true,
    shared_expert_intermediate_size: None,
};

fn cap(slots: Option<u64>) -> SlotCap {
    SlotCap { backend: "test", slots, reason: "a test cap".into() }
}

#[test]
fn the_geometry_accepts_from_the_floor_to_the_smaller_of_the_total_and_the_cap() {
    let ok = |s, c| check_cache_geometry("m", &QWEN3, 48, s, 100, &cap(c));
    for (s, c) in [(8, None), (6144, None), (2457, Some(2457)), (8, Some(8))] {
        let g = ok(s, c).unwrap_or_else(|e| panic!("{s} slots, cap {c:?}: {e}"));
        assert_eq!((g.slots, g.top_k, g.total()), (s, 8, 6144));
        assert_eq!(g.cache_bytes(), s as u64 * 100);
    }
}

#[test]
fn below_the_floor_is_refused_naming_the_geometry_the_rule_and_the_range() {
    let e =
        check_cache_geometry("synthetic:qwen3-30b-a3b", &QWEN3, 48, 7, 100, &cap(Some(1000))).unwrap_err();
    assert!(matches!(e, CacheGeometryError::BelowFloor { slots: 7, top_k: 8, .. }), "{e:?}");
    let msg = e.to_string();
    for needle in
        ["synthetic:qwen3-30b-a3b @ cache_slots=7", "floor of top-k = 8", "8 to 1000", "test backend"]
    {
        assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
    }
    // The floor is checked first: 0 slots is below it whatever the cap.
    let e = check_cache_geometry("m", &QWEN3, 48, 0, 100, &cap(Some(0))).unwrap_err();
    assert!(matches!(e, CacheGeometryError::BelowFloor { .. }), "{e:?}");
}

#[test]
fn above_the_total_is_refused_before_the_cap() {
    let e = check_cache_geometry("m", &QWEN3, 48, 6145, 100, &cap(Some(10))).unwrap_err();
    assert!(matches!(e, CacheGeometryError::AboveTotal { total: 6144, .. }), "{e:?}");
    let msg = e.to_string();
    for needle in ["m @ cache_slots=6145", "layers x experts = 48 x 128 = 6144", "8 to 6144"] {
        assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
    }
}

#[test]
fn above_the_cap_is_refused_naming_the_backend_and_the_cap() {
    let e = check_cache_geometry("m", &QWEN3, 48, 2458, 100, &cap(Some(2457))).unwrap_err();
    assert!(matches!(e, CacheGeometryError::AboveCap { cap: 2457, .. }), "{e:?}");
    let msg = e.to_string();
    for needle in ["m @ cache_slots=2458", "test backend's slot limit of 2457", "a test cap"] {
        assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
    }
}

#[test]
fn the_cpu_cap_is_the_slots_that_fit_in_the_limit_after_the_weights() {
    let c = SlotCap::cpu(1000, 300, 100);
    assert_eq!(c.slots, Some(7));
    assert!(c.reason.contains("memory limit") && c.reason.contains("per slot"), "{}", c.reason);
    assert_eq!(SlotCap::cpu(100, 300, 100).slots, Some(0));
    assert_eq!(SlotCap::cpu(u64::MAX, 300, 100).slots, None);
}

#[test]
fn a_dense_model_refuses_expert_slots() {
    let info = synthetic::inspect("tiny").unwrap();
    let e =
        expert_cache::cpu_geometry("synthetic:tiny", &info.config, info.expert_slot_bytes, 4, 0, u64::MAX)
            .unwrap_err();
    assert!(e.to_string().contains("synthetic:tiny") && e.to_string().contains("qwen3_moe"), "{e}");
}

#[test]
fn the_cache_takes_exactly_its_planned_slots_and_evicts_the_least_recently_used() {
    let pool = MemoryPool::unlimited();
    let model = synthetic::load_with_seed("tiny-moe", 3, &pool).unwrap();
    let store = model.weights.experts.as_ref().unwrap();
    let slot = slot_bytes_for(&model.config).unwrap();
    // The plan's slot size (from the config) is the loaded store's.
    assert_eq!(expert_cache::slot_bytes_of(store), slot);
    let geometry = expert_cache::cpu_geometry("tiny-moe", &model.config, Some(slot), 3, 0, u64::MAX).unwrap();
    let mut cache = ExpertCache::new(store, geometry, &pool).unwrap();
    assert_eq!(pool.stats().by_tag[Tag::Experts.as_str()].live, 3 * slot);

    let touch = |c: &mut ExpertCache, l, e| {
        let got = c.get(store, l, e);
        // The slot holds the store's bytes.
        let want = store.get(l, e);
        for (a, b) in got.parts().iter().zip(want.parts()) {
            assert_eq!(a.packed(), b.packed());
        }
    };
    for (l, e) in [(0, 1), (0, 2), (1, 5)] {
        touch(&mut cache, l, e);
    }
    assert_eq!((cache.stats().hits, cache.stats().misses), (0, 3));
    touch(&mut cache, 0, 1); // hit; (0, 2) is now the least recently used
    touch(&mut cache, 1, 7); // evicts (0, 2)
    assert!(cache.is_resident(0, 1) && cache.is_resident(1, 5) && cache.is_resident(1, 7));
    assert!(!cache.is_resident(0, 2));
    let s = cache.stats();
    assert_eq!((s.hits, s.misses), (1, 4));
    assert_eq!(s.bytes_copied, 4 * store.expert_bytes() as u64);
    assert!((s.miss_rate() - 0.8).abs() < 1e-9);
    drop(cache);
    assert_eq!(pool.stats().by_tag[Tag::Experts.as_str()].live, 0);
}

/// Greedy tokens of `name` decoded with `slots` (None: every expert resident), and the
/// cache's counters.
fn greedy(name: &str, slots: Option<usize>, n: usize) -> (Vec<u32>, Option<(u64, u64)>) {
    let pool = MemoryPool::unlimited();
    let model = synthetic::load_with_seed(name, 11, &pool).unwrap();
    let options = EngineOptions { kv_dtype: KvDtype::F32, expert_slots: slots, ..EngineOptions::default() };
    let mut s = Session::new(&model, &pool, options).unwrap();
    let tokens = s.generate_greedy(&[256, 72, 101, 108, 108, 111], n).unwrap();
    let stats = s.engine().transformer().expert_cache().map(|c| (c.stats().hits, c.stats().misses));
    (tokens, stats)
}

#[test]
fn decode_with_any_legal_slot_count_gives_the_all_resident_tokens() {
    for name in ["tiny-moe", "tiny-qwen2-moe"] {
        let (want, none) = greedy(name, None, 24);
        assert!(none.is_none());
        assert!(want.iter().collect::<std::collections::BTreeSet<_>>().len() > 1, "{name}: {want:?}");
        // 2 layers x 8 experts, top-2: the floor, two in between, and the total.
        for slots in [2, 3, 7, 16] {
            let (got, stats) = greedy(name, Some(slots), 24);
            assert_eq!(got, want, "{name} with {slots} slots");
            let (hits, misses) = stats.unwrap();
            assert!(misses >= 2, "{name} with {slots} slots: {misses} misses");
            if slots == 16 {
                assert!(misses <= 16 && hits > 0, "{name}: every expert is copied at most once");
            }
        }
    }
}

#[test]
fn an_illegal_slot_count_is_refused_before_the_cache_is_allocated() {
    let pool = MemoryPool::unlimited();
    let model = synthetic::load_with_seed("tiny-moe", 1, &pool).unwrap();
    let before = pool.stats().live_bytes;
    for slots in [1, 17] {
        let options = EngineOptions { expert_slots: Some(slots), ..EngineOptions::default() };
        let e = Session::new(&model, &pool, options).err().expect("refused");
        assert!(e.to_string().contains(&format!("cache_slots={slots}")), "{e}");
        assert_eq!(pool.stats().live_bytes, before);
    }
}

#[test]
fn published_moe_shapes_have_the_published_sizes() {
    let q = synthetic::inspect("qwen3-30b-a3b").unwrap().config;
    let moe = q.moe.unwrap();
    assert_eq!((q.num_hidden_layers, moe.experts, moe.top_k, moe.norm_topk_prob), (48, 128, 8, true));
    let m = synthetic::inspect("mixtral-8x7b").unwrap().config;
    assert_eq!((m.num_hidden_layers, m.moe.unwrap().experts, m.moe.unwrap().top_k), (32, 8, 2));
    // One qwen3-30b-a3b expert at 4 bits, group 64, bf16 scales: 3 x (768 x 2048 / 2 + 2 x 768 x 32 x 2).
    assert_eq!(slot_bytes_for(&q), Some(3 * (786_432 + 2 * 49_152)));
    // About 17 GB of 4-bit weights, like the mlx-community conversion.
    let b = synthetic::inspect("qwen3-30b-a3b").unwrap().weight_bytes;
    assert!((16_000_000_000..18_500_000_000).contains(&b), "{b}");
}
