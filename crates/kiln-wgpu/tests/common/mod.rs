//! What the kiln-wgpu tests share: the Vulkan adapter they run on, or a skip with its
//! reason (a failure when `KILN_TEST_VULKAN=required`, as CI sets it); and the forward's
//! comparison with the CPU's, which the model tests run under several schemes.
#![allow(dead_code)] // each test binary uses what it needs

use kiln_core::MemoryPool;
use kiln_model::{EngineOptions, LoadOptions, LoadedModel, Session};
use kiln_protocol::ActScheme;
use kiln_wgpu::{Backend, WgpuEngine, WgpuError, WgpuExec};

/// Whether a missing Vulkan adapter fails the tests (`KILN_TEST_VULKAN=required`) or skips
/// them (unset).
fn required() -> bool {
    match std::env::var("KILN_TEST_VULKAN") {
        Ok(v) if v == "required" => true,
        Ok(v) => {
            panic!("KILN_TEST_VULKAN={v}: accepted is `required` (or unset, to skip without an adapter)")
        }
        Err(_) => false,
    }
}

/// The Vulkan adapter with its pool limited to `limit` bytes, or `None` (printed) when
/// there is none and it is not required.
pub fn vulkan(limit: Option<u64>) -> Option<WgpuExec> {
    match WgpuExec::open(Backend::Vulkan, limit) {
        Ok(e) => Some(e),
        Err(e @ WgpuError::NoAdapter { .. }) => {
            if required() {
                panic!("KILN_TEST_VULKAN=required and {e} (install mesa-vulkan-drivers for lavapipe)");
            }
            eprintln!(
                "skipped: {e}; install mesa-vulkan-drivers, or set KILN_TEST_VULKAN=required to fail here"
            );
            None
        }
        Err(e) => panic!("opening the Vulkan adapter: {e}"),
    }
}

pub fn load(name: &str) -> LoadedModel {
    let pool = MemoryPool::unlimited();
    kiln_model::load(&format!("synthetic:{name}"), &LoadOptions { pool, quantize: None }).unwrap()
}

pub fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 37 + 11) % vocab) as u32).collect()
}

/// kiln-cuda's `LOGIT_TOLERANCE`: how far the device's logits may be from the CPU's, as a
/// share of the largest CPU logit's magnitude. Here the device feeds each product f32
/// activations and keeps the cache in f16; the CPU quantizes activations to 16-bit codes
/// per block and keeps its own f16 cache. 1% still fails on any wrong step (a skipped
/// bias, a shifted position or a missing residual move the logits by tens of percent).
pub const LOGIT_TOLERANCE: f32 = 0.01;

pub fn worst(dev: &[f32], cpu: &[f32]) -> f32 {
    assert_eq!(dev.len(), cpu.len());
    let scale = cpu.iter().fold(0f32, |m, v| m.max(v.abs()));
    dev.iter().zip(cpu).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale
}

pub fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0
}

/// The gap between the best and second-best logit, as a share of the largest magnitude.
pub fn margin(v: &[f32]) -> f32 {
    let mut s: Vec<f32> = v.to_vec();
    s.sort_by(|a, b| b.total_cmp(a));
    let scale = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    (s[0] - s[1]) / scale
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The forward of `name` on the Vulkan adapter under `act` against the CPU's forward under
/// the process's scheme (`KILN_ACT_PRECISION`): logits within `tolerance` of the largest
/// CPU logit over a prefill and 8 decode steps, and the same greedy token wherever the
/// CPU's is clear by twice the tolerance. Returns the worst difference.
pub fn compare_with_cpu(name: &str, act: ActScheme, tolerance: f32) -> f32 {
    let Some(exec) = vulkan(None) else { return 0.0 };
    let m = load(name);
    let vocab = m.config.vocab_size;
    let ids = prompt(20, vocab);
    let pool = MemoryPool::unlimited();
    let mut cpu = Session::new(&m, &pool, EngineOptions::default()).unwrap();
    let mut dev = WgpuEngine::new(&exec, &m.config, &m.weights).unwrap();
    dev.set_act_scheme(act).unwrap();
    let mut cache = dev.new_cache(64).unwrap();

    let mut want = cpu.prefill(&ids).unwrap().to_vec();
    let mut got = dev.prefill(&mut cache, &ids, 0).unwrap().to_vec();
    let mut worst_seen = worst(&got, &want);
    assert!(worst_seen <= tolerance, "{name} prefill: logits differ by {worst_seen}");
    let mut agreed = 0;
    for step in 0..=8 {
        if margin(&want) > 2.0 * tolerance {
            assert_eq!(argmax(&got), argmax(&want), "{name} step {step}: a different greedy token");
            agreed += 1;
        }
        if step == 8 {
            break;
        }
        // Both are fed the CPU's greedy token.
        let next = argmax(&want) as u32;
        want = cpu.decode_step(next).unwrap().to_vec();
        got = dev.decode(&mut cache, next).unwrap().to_vec();
        let d = worst(&got, &want);
        worst_seen = worst_seen.max(d);
        assert!(d <= tolerance, "{name} decode step {step}: logits differ by {d}");
    }
    assert_eq!(cache.len(), 28);
    assert!(agreed >= 4, "{name}: only {agreed} steps had a clear greedy token to compare");
    eprintln!(
        "{name} under {} on {}{}: worst logit difference {worst_seen:.3e} of the largest logit; {agreed} greedy tokens compared",
        act.as_str(),
        exec.name(),
        if exec.packed_dot() { " (packed dot products)" } else { "" }
    );
    worst_seen
}

/// How far the device's logits may be from the CPU's when both run the same integer
/// scheme: the products' integers are the CPU's, and only float rounding differs (the
/// epilogue's fma where the driver splits it, attention's order, RMSNorm's sums). Where
/// no cached key or value rounds to another f16 the logits agree to about 4e-7 (`int8` on
/// lavapipe); one such flip, which last-bit differences cause now and then, moves them
/// by about 1.5e-4 (`int16`, and 8-bit weights' 16-bit codes). A tenth of
/// [`LOGIT_TOLERANCE`]; a wrong code or scale moves them by far more.
pub const SAME_SCHEME_TOLERANCE: f32 = 1e-3;
