//! The fused decode step (q|k|v and gate|up each in one parallel region, biases added by
//! the tasks, `kiln_core::qmv_many`) against the unfused one (every projection on its
//! own): the logits of every step must be bit-identical, on a model with q/k/v biases and
//! an untied head and on one without biases and with a tied (embedding) head, at 4 and 8
//! bits, at one, two and three threads.

use kiln_core::MemoryPool;
use kiln_model::{
    AttentionKind, KvCache, KvDtype, LoadedModel, Logits, SeqChunk, Transformer, Workspace, synthetic,
};

/// The logits of a prefill of `prompt` then `steps` greedy decode steps, concatenated.
fn run(model: &LoadedModel, pool: &MemoryPool, fused: bool, prompt: &[u32], steps: usize) -> Vec<f32> {
    let mut t = Transformer::new(&model.config, &model.weights, AttentionKind::Streaming).unwrap();
    t.set_fused_decode(fused);
    let mut ws = Workspace::empty(&model.config, pool).unwrap();
    let mut cache = KvCache::new(t.kv_layout(KvDtype::F16), pool);
    let mut all = Vec::new();
    let mut tokens = prompt.to_vec();
    for _ in 0..=steps {
        let logits =
            t.forward(&mut ws, &mut [SeqChunk { cache: &mut cache, tokens: &tokens }], Logits::Last).unwrap();
        all.extend_from_slice(logits);
        let next = kiln_model::ops::argmax(logits) as u32;
        tokens = vec![next];
    }
    all
}

fn assert_fused_matches_unfused(name: &str) {
    let pool = MemoryPool::unlimited();
    let model = synthetic::load_with_seed(name, 7, &pool).unwrap();
    let prompt: Vec<u32> = (0..9u32).map(|i| (i * 37 + 5) % 250).collect();
    for threads in [1, 2, 3] {
        let rayon = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        let (fused, unfused) =
            rayon.install(|| (run(&model, &pool, true, &prompt, 6), run(&model, &pool, false, &prompt, 6)));
        assert_eq!(fused.len(), unfused.len());
        let differing = fused.iter().zip(&unfused).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(
            differing, 0,
            "{name} at {threads} threads: {differing} logits differ between fused and unfused decode"
        );
    }
}

#[test]
fn fused_decode_is_bit_identical_with_qkv_biases_and_untied_head() {
    let model = synthetic::inspect("tiny-qwen").unwrap();
    assert!(
        model.config.attention_bias && !model.config.tie_word_embeddings,
        "the profile must keep its biases"
    );
    assert_fused_matches_unfused("tiny-qwen");
    assert_fused_matches_unfused("tiny-qwen@8bit");
}

#[test]
fn fused_decode_is_bit_identical_without_biases_and_tied_head() {
    let model = synthetic::inspect("tiny").unwrap();
    assert!(
        !model.config.attention_bias && model.config.tie_word_embeddings,
        "the profile must stay bias-free and tied"
    );
    assert_fused_matches_unfused("tiny");
    assert_fused_matches_unfused("tiny@4bit-g32");
}

/// The logits of `steps` batched greedy decode steps of two sequences (M = 2 rows a
/// step, each after its own prefill), concatenated.
fn run_batched(model: &LoadedModel, pool: &MemoryPool, fused: bool, steps: usize) -> Vec<f32> {
    let mut t = Transformer::new(&model.config, &model.weights, AttentionKind::Streaming).unwrap();
    t.set_fused_decode(fused);
    let mut ws = Workspace::empty(&model.config, pool).unwrap();
    let (mut a, mut b) =
        (KvCache::new(t.kv_layout(KvDtype::F16), pool), KvCache::new(t.kv_layout(KvDtype::F16), pool));
    let vocab = model.config.vocab_size;
    let mut next = [0u32; 2];
    for (i, cache) in [&mut a, &mut b].into_iter().enumerate() {
        let prompt: Vec<u32> = (0..7 + 2 * i as u32).map(|j| (j * 31 + 11 * i as u32 + 3) % 250).collect();
        let logits = t.forward(&mut ws, &mut [SeqChunk { cache, tokens: &prompt }], Logits::Last).unwrap();
        next[i] = kiln_model::ops::argmax(logits) as u32;
    }
    let mut all = Vec::new();
    for _ in 0..steps {
        let (ta, tb) = ([next[0]], [next[1]]);
        let mut seqs = [SeqChunk { cache: &mut a, tokens: &ta }, SeqChunk { cache: &mut b, tokens: &tb }];
        let logits = t.forward(&mut ws, &mut seqs, Logits::Last).unwrap();
        for (n, row) in next.iter_mut().zip(logits.chunks_exact(vocab)) {
            *n = kiln_model::ops::argmax(row) as u32;
        }
        all.extend_from_slice(logits);
    }
    all
}

/// A batched step whose kernels run one row at a time (the measured crossover put `qmv`
/// per row ahead of `qmv_wide` at M = 2) fuses each row's q|k|v and gate|up as a decode
/// step does: the logits are those of the unfused step, and of the wide kernel, bit for
/// bit.
#[test]
fn per_row_batched_steps_fuse_each_row_and_keep_the_bits() {
    let pool = MemoryPool::unlimited();
    for name in ["tiny-qwen", "tiny@4bit-g32"] {
        let model = synthetic::load_with_seed(name, 7, &pool).unwrap();
        let rayon = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let (per_row_fused, per_row_unfused) = rayon.install(|| {
            kiln_core::wide::set_crossover(kiln_core::wide::Crossover::wide_from(16));
            assert_eq!(
                kiln_core::kernels::select_kernel(2, 64, 64),
                kiln_core::kernels::KernelChoice::QmvPerRow
            );
            (run_batched(&model, &pool, true, 5), run_batched(&model, &pool, false, 5))
        });
        let wide = rayon.install(|| {
            kiln_core::wide::set_crossover(kiln_core::wide::Crossover::ALL_WIDE);
            run_batched(&model, &pool, true, 5)
        });
        for (what, other) in [("unfused", &per_row_unfused), ("qmv_wide", &wide)] {
            let differing =
                per_row_fused.iter().zip(other).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            assert_eq!(
                differing, 0,
                "{name}: {differing} logits differ between fused per-row and {what} steps"
            );
        }
    }
}
