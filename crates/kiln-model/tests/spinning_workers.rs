//! The forward pass with the workers spinning between its regions
//! (`kiln_core::workers`): a greedy decode in a two-thread pool, where the other worker
//! spins, gives the same logits, bit for bit, as in a one-thread pool, where nothing
//! spins; and once the decode is over the spinner parks.

use std::time::{Duration, Instant};

use kiln_core::MemoryPool;
use kiln_core::workers;
use kiln_model::{
    AttentionKind, KvCache, KvDtype, LoadedModel, Logits, SeqChunk, Transformer, Workspace, synthetic,
};

/// The logits of a prefill of `prompt` then `steps` greedy decode steps, concatenated.
fn run(model: &LoadedModel, pool: &MemoryPool, prompt: &[u32], steps: usize) -> Vec<f32> {
    let t = Transformer::new(&model.config, &model.weights, AttentionKind::Streaming).unwrap();
    let mut ws = Workspace::empty(&model.config, pool).unwrap();
    let mut cache = KvCache::new(t.kv_layout(KvDtype::F16), pool);
    let mut all = Vec::new();
    let mut tokens = prompt.to_vec();
    for _ in 0..=steps {
        let logits =
            t.forward(&mut ws, &mut [SeqChunk { cache: &mut cache, tokens: &tokens }], Logits::Last).unwrap();
        all.extend_from_slice(logits);
        tokens = vec![kiln_model::ops::argmax(logits) as u32];
    }
    all
}

#[test]
fn spinning_workers_change_no_logit_and_park_after_the_last_step() {
    let two_cpus = std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2);
    let pool = MemoryPool::unlimited();
    let prompt: Vec<u32> = (0..7u32).map(|i| (i * 41 + 3) % 250).collect();
    for name in ["tiny", "tiny-qwen"] {
        let model = synthetic::load_with_seed(name, 11, &pool).unwrap();
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let two = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let alone = one.install(|| run(&model, &pool, &prompt, 8));
        let (spun, warmth) = two.install(|| {
            let logits = run(&model, &pool, &prompt, 8);
            // The driver's state the forwards used (this call is one more touch of it).
            (logits, workers::keep_warm())
        });
        let differing = alone.iter().zip(&spun).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!((alone.len(), differing), (spun.len(), 0), "{name}: logits differ with a spinning worker");
        if !two_cpus || workers::spin_budget() == workers::SpinBudget::OFF {
            continue;
        }
        let w = warmth.expect("a two-thread pool on two CPUs spins");
        // No forward follows: within the budget the spinner gives up and rayon parks it.
        let deadline = Instant::now() + Duration::from_secs(60);
        while w.spinning() + w.pending() > 0 {
            assert!(
                Instant::now() < deadline,
                "{name}: a worker is still spinning a minute after the last step"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
