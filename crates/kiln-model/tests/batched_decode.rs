//! Batched decode (B sequences, one forward, projections with M = B) against B
//! single-sequence decodes: bit-identical with the wide switch off (every row then meets
//! the same `qmv` as alone) and with it on (`qmv_wide` and `qmm` give bit-identical rows
//! to `qmv`, see kiln_core::kernels), and the two switch settings agree with each other.
//!
//! The switch is process-wide, so this file is its own test binary and only the one test
//! below touches it.

use kiln_core::MemoryPool;
use kiln_core::wide::{qmv_wide_enabled, set_qmv_wide};
use kiln_model::ops::argmax;
use kiln_model::{Engine, EngineOptions, KvCache, synthetic};

/// Prefills three sequences of different lengths, then decodes `steps` tokens for all of
/// them, batched or one by one; returns every step's logits per sequence.
fn run(name: &str, batched: bool, steps: usize) -> Vec<Vec<f32>> {
    let pool = MemoryPool::unlimited();
    let model = synthetic::load_with_seed(name, 21, &pool).unwrap();
    let mut engine = Engine::new(&model, &pool, EngineOptions::default()).unwrap();
    let vocab = model.config.vocab_size;
    let prompts: Vec<Vec<u32>> = [5usize, 17, 300]
        .iter()
        .map(|&n| (0..n as u32).map(|i| (i * 13 + n as u32) % 250).collect())
        .collect();
    let mut caches: Vec<KvCache> = prompts.iter().map(|_| engine.new_cache()).collect();
    let mut next: Vec<u32> =
        prompts.iter().zip(&mut caches).map(|(p, c)| argmax(engine.prefill(c, p).unwrap()) as u32).collect();
    let mut out = Vec::new();
    for _ in 0..steps {
        let logits: Vec<f32> = if batched {
            engine.decode_batch(&mut caches, &next).unwrap().to_vec()
        } else {
            let mut all = Vec::with_capacity(caches.len() * vocab);
            for (c, &t) in caches.iter_mut().zip(&next) {
                all.extend_from_slice(engine.decode(c, t).unwrap());
            }
            all
        };
        // Each run feeds back its own argmax: identical runs stay identical, and where
        // rounding may differ only the first step, whose inputs are the same, is compared.
        next = logits.chunks(vocab).map(|l| argmax(l) as u32).collect();
        out.push(logits);
    }
    for (c, p) in caches.iter().zip(&prompts) {
        assert_eq!(c.len(), p.len() + steps);
    }
    out
}

#[test]
fn batched_decode_matches_single_sequence_decode() {
    let initial = qmv_wide_enabled();
    for name in ["tiny", "tiny-qwen"] {
        set_qmv_wide(false);
        let single = run(name, false, 6);
        let batched = run(name, true, 6);
        assert_eq!(single, batched, "{name}: with qmv_wide off every row must be bit-identical");

        // With the switch on the prefills (M = 5 and 17) and the batched steps (M = 3) run
        // `qmv_wide`, whose rows are bit-identical to `qmv`'s: every step's logits match.
        set_qmv_wide(true);
        let single_on = run(name, false, 6);
        let batched_on = run(name, true, 6);
        assert_eq!(single_on, batched_on, "{name}: with qmv_wide on every row must be bit-identical");
        assert_eq!(single_on, single, "{name}: the wide switch must not change an output");
    }
    set_qmv_wide(initial);
}
