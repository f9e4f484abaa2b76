//! mlx-lm's reference runs as the fixture scripts record them
//! (scripts/fixtures/make_model_fixtures.py, make_moe_fixtures.py), the tolerances derived
//! from them, and kiln's runs measured against them; shared by the reference tests.
//!
//! Tolerances come from the fixture. The script records how far mlx's own forward moves
//! when it rounds what kiln rounds (per configuration: the KV cache as f32 or f16, and for
//! quantized models activations entering 4- and 8-bit matmuls as integer codes per
//! group, with the kernels' exact-sum bias term): the largest move of any logit, and the
//! largest move of a step's top-2 margin. kiln's own rounding is another draw of the same
//! noise, so it may move logits by [`LOGIT_FACTOR`] times as much, plus [`F32_FLOOR`] for
//! f32 arithmetic in another order; a step whose reference margin is within
//! [`MARGIN_FACTOR`] times the margin move (plus twice the floor) is a near tie, where
//! kiln may pick either token, and ends the free-running comparison. A wrong weight,
//! rotation, mask or head mapping moves logits by whole units.

// Each test binary uses its own part of this module.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::Path;

use kiln_core::MemoryPool;
use kiln_model::ops::argmax;
use kiln_model::{EngineOptions, LoadedModel, Session};

/// kiln's rounding against the simulated one: the same rounding rule applied to
/// activations that differ by f32 noise, which flips codes and redraws the noise (measured
/// ratios 0.9 to 1.25 on the dense fixtures).
pub const LOGIT_FACTOR: f32 = 2.0;

/// The same for a step's top-2 margin, which decides the near ties.
pub const MARGIN_FACTOR: f32 = 2.0;

/// Absolute slack for f32 arithmetic in another order than mlx's: logits in the fixtures
/// reach about 60 to 70, and kiln's f32 path meets mlx's within 6e-5.
pub const F32_FLOOR: f32 = 5e-4;

/// One recorded mlx-lm run.
pub struct Reference {
    /// The reference's name, for messages.
    pub name: String,
    /// The prompt (the chat template applied to one user message).
    pub prompt_ids: Vec<u32>,
    /// `[positions, vocab]`: the last prompt positions' logits.
    pub prompt_logits: Vec<f32>,
    /// The greedy continuation.
    pub greedy_ids: Vec<u32>,
    /// `[steps, vocab]`: step 0 is the last prompt position's logits.
    pub step_logits: Vec<f32>,
    /// Each step's top-2 margin.
    pub margins: Vec<f32>,
    /// The script's metadata: package versions, recorded moves, `greedy_safe`.
    pub meta: HashMap<String, String>,
}

/// The run recorded as `references/{name}.safetensors` under the fixture directory `fixtures`.
pub fn reference(fixtures: &Path, name: &str) -> Reference {
    let bytes = std::fs::read(fixtures.join(format!("references/{name}.safetensors"))).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let words = |t: &str| -> Vec<[u8; 4]> {
        st.tensor(t).unwrap().data().chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]).collect()
    };
    let u32s = |t: &str| words(t).into_iter().map(u32::from_le_bytes).collect::<Vec<_>>();
    let f32s = |t: &str| words(t).into_iter().map(f32::from_le_bytes).collect::<Vec<_>>();
    Reference {
        name: name.to_string(),
        prompt_ids: u32s("prompt_ids"),
        prompt_logits: f32s("prompt_logits"),
        greedy_ids: u32s("greedy_ids"),
        step_logits: f32s("step_logits"),
        margins: f32s("margins"),
        meta: meta.metadata().clone().unwrap_or_default(),
    }
}

/// Tolerances for one configuration.
#[derive(Clone, Copy, Debug)]
pub struct Tolerance {
    /// Largest |kiln - reference| allowed.
    pub logit: f32,
    /// A reference margin at or below this is a near tie.
    pub near_tie: f32,
    /// The fixture promises no near tie in the whole run.
    pub clear: bool,
}

impl Reference {
    /// A number the script recorded in the metadata.
    pub fn recorded(&self, key: &str) -> f32 {
        let v = self.meta.get(key).unwrap_or_else(|| panic!("{} lacks {key}", self.name));
        v.parse().unwrap_or_else(|e| panic!("{}: {key} = {v:?}: {e}", self.name))
    }

    /// The tolerances of configuration `config`.
    pub fn tolerance(&self, config: &str) -> Tolerance {
        let clear = self.meta.get("greedy_safe").is_some_and(|s| s.split(',').any(|c| c == config));
        Tolerance {
            logit: LOGIT_FACTOR * self.recorded(&format!("logit/{config}")) + F32_FLOOR,
            near_tie: MARGIN_FACTOR * self.recorded(&format!("margin/{config}")) + 2.0 * F32_FLOOR,
            clear,
        }
    }
}

/// The largest |kiln - reference| over the recorded logits, with the reference's tokens
/// fed; each step's argmax must be the reference's unless the step is a near tie.
pub fn max_deviation(
    model: &LoadedModel,
    pool: &MemoryPool,
    r: &Reference,
    opts: EngineOptions,
    tol: Tolerance,
) -> f32 {
    let vocab = model.config.vocab_size;
    let mut s = Session::new(model, pool, opts).unwrap();
    let all = s.prefill_all_logits(&r.prompt_ids).unwrap();
    let p = r.prompt_ids.len();
    let recorded = r.prompt_logits.len() / vocab;
    let mut dev = 0f32;
    for (a, b) in all[(p - recorded) * vocab..].iter().zip(&r.prompt_logits) {
        dev = dev.max((a - b).abs());
    }
    let mut row = all[(p - 1) * vocab..].to_vec();
    for (i, want) in r.step_logits.chunks_exact(vocab).enumerate() {
        for (a, b) in row.iter().zip(want) {
            dev = dev.max((a - b).abs());
        }
        if r.margins[i] > tol.near_tie {
            assert_eq!(argmax(&row) as u32, r.greedy_ids[i], "{}: step {i}, margin {}", r.name, r.margins[i]);
        }
        if i + 1 < r.greedy_ids.len() {
            row = s.decode_step(r.greedy_ids[i]).unwrap().to_vec();
        }
    }
    dev
}

/// Steps of kiln's own greedy decode equal to the reference's before the first near tie.
pub fn greedy_agreement(
    model: &LoadedModel,
    pool: &MemoryPool,
    r: &Reference,
    opts: EngineOptions,
    tol: Tolerance,
) -> usize {
    let mut s = Session::new(model, pool, opts).unwrap();
    let ours = s.generate_greedy(&r.prompt_ids, r.greedy_ids.len()).unwrap();
    for (i, (a, b)) in ours.iter().zip(&r.greedy_ids).enumerate() {
        if r.margins[i] <= tol.near_tie {
            return i;
        }
        assert_eq!(
            a, b,
            "{}: greedy step {i} (margin {}): {ours:?} vs {:?}",
            r.name, r.margins[i], r.greedy_ids
        );
    }
    ours.len()
}
