//! `kiln bench-expert-copy`: measures one expert-cache geometry (a MoE model, S slots, a
//! batch size, a miss rate) and prints one JSON object (docs/engine-protocol.md).
//!
//! The geometry is checked by the engine's one rule function before anything is
//! allocated (exit 2 naming the rule and the cap), then the model is loaded (its experts
//! are the backing store), the read bandwidth is measured in this process, the cache is
//! built and filled, and decode steps are simulated: every step routes `batch` rows
//! through every layer to `top_k` distinct experts each, each choice a miss with
//! probability `miss_rate` (an expert not resident, copied in) or else a hit (one
//! resident), from a seeded generator. What the routing achieved is reported beside what
//! was asked (a layer whose experts are all resident cannot miss, one with none resident
//! cannot hit). Copy GB/s, expert-fetch time per token and the copy's share of the read
//! bandwidth come from the cache's own counters.

use std::time::{Duration, Instant};

use anyhow::Context;
use kiln_core::bandwidth::{self, ReadBuffer};
use kiln_model::ExpertCache;
use kiln_protocol::OffloadCopyReport;
use rand_core::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::args::ExpertCopyArgs;
use crate::exit::usage;
use crate::runtime;

/// Passes over the bandwidth buffer; the best one is reported.
const BANDWIDTH_PASSES: usize = 5;

/// Runs the measurement on the worker pool and prints its record.
pub fn run(args: ExpertCopyArgs) -> anyhow::Result<()> {
    // It measures host copies into the CPU backend's expert cache: never a device run.
    let _ = crate::backend::check(&args.run, crate::backend::Asks::default())?;
    runtime::in_pool(args.run.threads, |threads| measure(args, threads))
}

fn measure(args: ExpertCopyArgs, threads: usize) -> anyhow::Result<()> {
    let pool = runtime::pool(&args.run)?;
    let Some(slots) = args.run.expert_slots else {
        return Err(usage("bench-expert-copy needs --expert-slots S: the geometry to measure"));
    };
    if !(0.0..=1.0).contains(&args.miss_rate) {
        return Err(usage(format!("invalid --miss-rate {}: accepted values are 0 to 1", args.miss_rate)));
    }
    if args.batch_size == 0 {
        return Err(usage("invalid --batch-size 0: accepted values are 1 or more"));
    }
    if args.steps == 0 {
        return Err(usage("invalid --steps 0: accepted values are 1 or more"));
    }
    let bw_bytes = kiln_protocol::parse_bandwidth_bytes(&args.bandwidth_bytes)
        .map_err(|e| usage(format!("invalid --bandwidth-bytes: {e}")))? as usize;
    let name = &args.run.model;
    let load_opts = runtime::load_options(&args.run, &pool);
    let info = kiln_model::inspect(name, &load_opts).with_context(|| format!("reading model {name}"))?;
    // The rules, before anything is allocated.
    let geometry =
        runtime::expert_geometry(&args.run, &info.config, info.expert_slot_bytes, info.weight_bytes, &pool)?
            .expect("--expert-slots is set");
    let model = kiln_model::load(name, &load_opts).with_context(|| format!("loading model {name}"))?;
    let store = model.weights.experts.as_ref().context("a MoE model has an expert store")?;

    let buf = ReadBuffer::new(bw_bytes);
    let bw = bandwidth::measure(&buf, BANDWIDTH_PASSES);
    drop(buf);

    let mut cache =
        ExpertCache::new(store, geometry.clone(), &pool).context("allocating the expert cache")?;
    let (layers, experts, top_k) = (geometry.layers, geometry.experts, geometry.top_k);
    // Fill every slot first, spread over the layers, so misses evict as in a long run.
    for i in 0..slots {
        cache.get(store, i % layers, (i / layers) % experts);
    }
    cache.reset_stats();

    let mut rng = Xoshiro256PlusPlus::seed_from_u64(args.seed);
    let min_time = Duration::from_millis(args.min_time_ms);
    let mut chosen: Vec<usize> = Vec::with_capacity(top_k);
    let mut resident: Vec<usize> = Vec::with_capacity(experts);
    let mut absent: Vec<usize> = Vec::with_capacity(experts);
    let mut steps = 0u64;
    let mut fetch = Duration::ZERO;
    let started = Instant::now();
    while steps < args.steps && (steps == 0 || started.elapsed() < min_time) {
        for layer in 0..layers {
            for _ in 0..args.batch_size {
                chosen.clear();
                for _ in 0..top_k {
                    resident.clear();
                    absent.clear();
                    for e in (0..experts).filter(|e| !chosen.contains(e)) {
                        if cache.is_resident(layer, e) { resident.push(e) } else { absent.push(e) }
                    }
                    let miss = unit(rng.next_u64()) < args.miss_rate;
                    let pool_of = match (miss, resident.is_empty(), absent.is_empty()) {
                        (true, _, false) | (false, true, _) => &absent,
                        _ => &resident,
                    };
                    let e = pool_of[(rng.next_u64() % pool_of.len() as u64) as usize];
                    chosen.push(e);
                    let t = Instant::now();
                    std::hint::black_box(cache.get(store, layer, e));
                    fetch += t.elapsed();
                }
            }
        }
        steps += 1;
    }
    let s = cache.stats();
    let tokens = steps * args.batch_size as u64;
    let copy_s = s.copy_ns as f64 / 1e9;
    let copy_gb_s = (s.misses > 0 && copy_s > 0.0).then(|| s.bytes_copied as f64 / copy_s / 1e9);
    let report = OffloadCopyReport {
        model: name.clone(),
        model_path: model.source.display_path(),
        cache_slots: slots as u64,
        slot_bytes: geometry.slot_bytes,
        cache_bytes: geometry.cache_bytes(),
        layers: layers as u64,
        experts: experts as u64,
        top_k: top_k as u64,
        batch_size: args.batch_size as u64,
        miss_rate: args.miss_rate,
        steps,
        tokens,
        fetches: s.hits + s.misses,
        hits: s.hits,
        misses: s.misses,
        measured_miss_rate: s.miss_rate(),
        bytes_copied: s.bytes_copied,
        copy_ms: copy_s * 1e3,
        copy_gb_s,
        fetch_ms: fetch.as_secs_f64() * 1e3,
        fetch_us_per_token: fetch.as_secs_f64() * 1e6 / tokens as f64,
        read_bandwidth_gb_s: bw.gb_s(),
        copy_share: copy_gb_s.map(|c| c / bw.gb_s()),
        peak_bytes: pool.stats().peak_bytes,
        memory_limit_bytes: runtime::limit_bytes(&pool),
        backend: "cpu".into(),
        threads: threads as u64,
        kiln_version: env!("CARGO_PKG_VERSION").into(),
    };
    report.write_json(std::io::stdout().lock()).context("writing the result")
}

/// A uniform f64 in `[0, 1)` from the top 53 bits of a word.
fn unit(word: u64) -> f64 {
    (word >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}
