//! Synthetic models: the real shapes of published checkpoints, with weights drawn from a
//! seeded generator directly in MLX-quantized form, and the byte-level tokenizer.
//!
//! A synthetic model behaves like a checkpoint of its shape in time and memory (the
//! kernels' cost does not depend on the values) while needing no download. Names are
//! `<profile>[@4bit|@8bit]`; 4-bit group 64 with bf16 scales, as mlx-community ships its
//! conversions, is the default.
//!
//! Every tensor gets its own seed, and every chunk of a tensor a seed derived from it, so
//! generation (`synthetic/generate.rs`) runs in parallel and yields the same bytes on
//! every machine and thread count. Packed codes are uniform random words (any word is a
//! valid set of codes); each group's scale is drawn around `1 / (code std * sqrt(K))` and
//! its bias centres the codes on zero, so every layer's outputs keep unit-order
//! magnitudes.
//!
//! The shapes are a catalogue of their own (`synthetic/profiles.rs`); this file parses
//! names, chooses where a MoE model's routed experts live ([`HostTier`]) and loads or
//! inspects a model.

mod generate;
pub mod host_tier;
mod profiles;

pub use profiles::{PROFILES, Profile, accepted_profiles, drafter_for};

use std::path::PathBuf;

use kiln_core::{MemoryPool, QuantSpec};

use crate::error::{ModelError, Result};
use crate::loading::config::ModelConfig;
use crate::loading::source::ModelSource;
use crate::loading::tokenizer::{ByteTokenizer, Tokenizer};
use crate::model::{LoadOptions, LoadedModel, ModelInfo, TextModel};

/// The environment variable naming the directory of file-backed host tiers.
pub const EXPERT_DIR_ENV: &str = "KILN_SYNTHETIC_EXPERT_DIR";

/// Where a synthetic MoE model keeps its routed experts (the backing store an expert
/// cache copies from).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostTier {
    /// In the weights arena, counted by the memory pool (the default).
    Memory,
    /// In a file in this directory, written once per name and seed ([`host_tier`]) and
    /// mapped read-only: in the page cache, not counted by the pool.
    File(PathBuf),
}

impl HostTier {
    /// [`EXPERT_DIR_ENV`]'s choice: a directory when set and not empty, else memory.
    pub fn from_env() -> HostTier {
        match std::env::var_os(EXPERT_DIR_ENV) {
            Some(dir) if !dir.is_empty() => HostTier::File(PathBuf::from(dir)),
            _ => HostTier::Memory,
        }
    }
}

/// The environment variable setting the synthetic routers' skew.
pub const ROUTER_SKEW_ENV: &str = "KILN_SYNTHETIC_ROUTER_SKEW";

/// The largest router skew accepted.
pub const MAX_ROUTER_SKEW: f32 = 8.0;

/// [`ROUTER_SKEW_ENV`]'s router skew: the half spread of each MoE router's per-expert
/// logit bias, from 0 (no bias: random router weights alone, nearly uniform routing) to
/// [`MAX_ROUTER_SKEW`]; unset or empty gives [`generate::ROUTER_SKEW`].
pub fn router_skew_from_env() -> Result<f32> {
    let raw = match std::env::var(ROUTER_SKEW_ENV) {
        Ok(v) if !v.trim().is_empty() => v,
        Ok(_) | Err(std::env::VarError::NotPresent) => return Ok(generate::ROUTER_SKEW),
        Err(std::env::VarError::NotUnicode(v)) => v.to_string_lossy().into_owned(),
    };
    raw.trim().parse::<f32>().ok().filter(|s| (0.0..=MAX_ROUTER_SKEW).contains(s)).ok_or_else(|| {
        ModelError::InvalidArgument {
            what: format!("{ROUTER_SKEW_ENV}={raw}"),
            message: format!("accepted values are numbers from 0 to {MAX_ROUTER_SKEW}"),
        }
    })
}

/// The seed [`load`] uses.
pub const DEFAULT_SEED: u64 = 0x6b69_6c6e_5eed_0001;

/// Group size of every synthetic quantized matrix.
pub const GROUP_SIZE: usize = 64;

/// A parsed synthetic name: profile and quantization.
#[derive(Clone, Copy, Debug)]
pub struct SyntheticSpec {
    /// The shape.
    pub profile: &'static Profile,
    /// Quantization of every linear layer and the embedding.
    pub quant: QuantSpec,
}

/// Parses `<profile>[@4bit|@8bit|@4bit-g32]`; `@4bit-g32` is 4-bit in groups of 32, the
/// layout of llama.cpp's Q4_1 blocks (what `kiln export-gguf` writes it as, unchanged).
pub fn parse(name: &str) -> Result<SyntheticSpec> {
    let unknown = || ModelError::UnknownSynthetic { name: name.to_string(), accepted: accepted_profiles() };
    let (base, bits, group) = match name.split_once('@') {
        None => (name, 4, GROUP_SIZE),
        Some((base, "4bit")) => (base, 4, GROUP_SIZE),
        Some((base, "8bit")) => (base, 8, GROUP_SIZE),
        Some((base, "4bit-g32")) => (base, 4, 32),
        Some(_) => return Err(unknown()),
    };
    let profile = PROFILES.iter().find(|p| p.name == base).ok_or_else(unknown)?;
    let quant = QuantSpec::new(bits, group).map_err(|_| unknown())?;
    Ok(SyntheticSpec { profile, quant })
}

/// Configuration and weight bytes of a synthetic model, without generating it, with its
/// experts where [`HostTier::from_env`] puts them.
pub fn inspect(name: &str) -> Result<ModelInfo> {
    inspect_in(name, &HostTier::from_env())
}

/// [`inspect`] with the experts in `tier`: a file-backed tier's experts are not counted.
pub fn inspect_in(name: &str, tier: &HostTier) -> Result<ModelInfo> {
    let spec = parse(name)?;
    let config = spec.profile.config(spec.quant);
    let mut weight_bytes = weight_bytes(&config, spec.quant);
    if matches!(tier, HostTier::File(_)) {
        weight_bytes -= generate::expert_bytes(&config, spec.quant);
    }
    let expert_slot_bytes = crate::forward::expert_cache::slot_bytes_for(&config);
    Ok(ModelInfo {
        source: ModelSource::Synthetic(name.to_string()),
        config,
        weight_bytes,
        expert_slot_bytes,
    })
}

/// Builds a synthetic model with [`DEFAULT_SEED`], its experts where
/// [`HostTier::from_env`] puts them.
pub fn load(name: &str, opts: &LoadOptions) -> Result<LoadedModel> {
    load_with(name, DEFAULT_SEED, &opts.pool, &HostTier::from_env(), router_skew_from_env()?)
}

/// Builds a synthetic model from `seed`; the same name and seed give the same weights on
/// every machine. Every byte is counted in `pool` under [`kiln_core::Tag::Weights`].
pub fn load_with_seed(name: &str, seed: u64, pool: &MemoryPool) -> Result<LoadedModel> {
    load_in(name, seed, pool, &HostTier::Memory)
}

/// Builds a synthetic model from `seed` with its routed experts in `tier` (a dense model
/// has none, and ignores it). The bytes are the same in either tier; only a
/// [`HostTier::Memory`] model's experts are counted in `pool`.
pub fn load_in(name: &str, seed: u64, pool: &MemoryPool, tier: &HostTier) -> Result<LoadedModel> {
    load_with(name, seed, pool, tier, generate::ROUTER_SKEW)
}

/// [`load_in`] with MoE routers biased by `router_skew` (see [`router_skew_from_env`]).
pub fn load_with(
    name: &str,
    seed: u64,
    pool: &MemoryPool,
    tier: &HostTier,
    router_skew: f32,
) -> Result<LoadedModel> {
    let spec = parse(name)?;
    let config = spec.profile.config(spec.quant);
    let tier = if config.moe.is_some() { tier } else { &HostTier::Memory };
    let key = format!(
        "{}@{}bit-g{}-seed{seed:016x}",
        spec.profile.name,
        spec.quant.bits(),
        spec.quant.group_size()
    );
    let weights = match tier {
        HostTier::Memory => generate::generate(&config, spec.quant, seed, pool, None, router_skew)?,
        HostTier::File(dir) => {
            let place = |experts: &[generate::Segment]| host_tier::open(dir, &key, experts);
            generate::generate(&config, spec.quant, seed, pool, Some(&place), router_skew)?
        }
    };
    Ok(LoadedModel {
        source: ModelSource::Synthetic(name.to_string()),
        config,
        weights,
        tokenizer: Tokenizer::Bytes(ByteTokenizer),
        chat_template: None,
    })
}

/// The configuration and tokenizer of a synthetic model, without generating its weights.
pub fn load_text(name: &str) -> Result<TextModel> {
    let spec = parse(name)?;
    Ok(TextModel {
        source: ModelSource::Synthetic(name.to_string()),
        config: spec.profile.config(spec.quant),
        tokenizer: Tokenizer::Bytes(ByteTokenizer),
        chat_template: None,
    })
}

/// Bytes [`load_with_seed`] counts under the weights tag for `config` with its experts
/// in memory: every tensor, each aligned to a cache line in one arena.
pub fn weight_bytes(config: &ModelConfig, quant: QuantSpec) -> u64 {
    generate::arena_bytes(config, quant)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forward::weights::LinearWeight;

    /// The skew moves routing: with no bias the tiny MoE's routes differ from the
    /// default's, and the experts' bytes do not.
    #[test]
    fn the_router_skew_changes_the_routers_only() {
        let pool = MemoryPool::unlimited();
        let a = load_with("tiny-moe", 2, &pool, &HostTier::Memory, generate::ROUTER_SKEW).unwrap();
        let b = load_with("tiny-moe", 2, &pool, &HostTier::Memory, 0.0).unwrap();
        let (ea, eb) = (a.weights.experts.as_ref().unwrap(), b.weights.experts.as_ref().unwrap());
        assert!((0..ea.total()).all(|i| ea.by_id(i).gate_proj.packed() == eb.by_id(i).gate_proj.packed()));
        let bias = |m: &LoadedModel| {
            let crate::forward::weights::Mlp::Moe(moe) = &m.weights.layers[0].mlp else {
                panic!("a MoE layer")
            };
            moe.router.bias.as_ref().unwrap().iter().copied().collect::<Vec<f32>>()
        };
        let (ba, bb) = (bias(&a), bias(&b));
        assert!(ba.iter().all(|v| v.abs() <= generate::ROUTER_SKEW) && ba.iter().any(|v| v.abs() > 0.5));
        assert!(bb.iter().all(|&v| v == 0.0), "{bb:?}");
    }

    #[test]
    fn names_parse_with_and_without_suffix() {
        assert_eq!(parse("tiny").unwrap().quant.bits(), 4);
        assert_eq!(parse("qwen2.5-0.5b@8bit").unwrap().quant.bits(), 8);
        assert_eq!(parse("llama-3.1-8b@4bit").unwrap().profile.name, "llama-3.1-8b");
        let g32 = parse("smollm-135m@4bit-g32").unwrap().quant;
        assert_eq!((g32.bits(), g32.group_size()), (4, 32));
        for bad in ["nope", "tiny@3bit", "tiny@", "@4bit"] {
            let e = parse(bad).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, ModelError::UnknownSynthetic { .. }), "{bad}");
            assert!(msg.contains(bad) && msg.contains("qwen2.5-0.5b") && msg.contains("@8bit"), "{msg}");
        }
    }

    #[test]
    fn every_published_profile_has_a_drafter_of_its_vocabulary() {
        for p in PROFILES.iter().filter(|p| !p.is_drafter()) {
            let d = drafter_for(p.name).unwrap_or_else(|| panic!("{} has no drafter", p.name));
            assert_eq!(parse(d).unwrap().profile.vocab_size, p.vocab_size, "{}", p.name);
            assert!(
                parse(d).unwrap().profile.max_position_embeddings >= p.max_position_embeddings.min(32_768)
            );
        }
        assert_eq!(drafter_for("qwen2.5-0.5b"), Some("qwen2.5-draft"));
        assert_eq!(drafter_for("qwen2.5-draft"), None);
    }

    #[test]
    fn inspect_predicts_the_bytes_generation_counts() {
        for name in ["tiny", "tiny-qwen", "tiny@8bit", "tiny-moe", "tiny-qwen2-moe"] {
            let pool = MemoryPool::unlimited();
            let info = inspect(name).unwrap();
            let model = load_with_seed(name, 7, &pool).unwrap();
            assert_eq!(pool.stats().by_tag["weights"].live, info.weight_bytes, "{name}");
            assert_eq!(pool.stats().live_bytes, info.weight_bytes, "{name}");
            drop(model);
            assert_eq!(pool.stats().live_bytes, 0);
        }
    }

    #[test]
    fn published_shapes_divide_into_groups() {
        for p in &PROFILES {
            let c = p.config(QuantSpec::new(4, GROUP_SIZE).unwrap());
            for k in [c.hidden_size, c.intermediate_size, c.q_dim(), c.mlp_width()] {
                assert_eq!(k % GROUP_SIZE, 0, "{}: K = {k}", p.name);
            }
            assert!(c.vocab_size >= ByteTokenizer::MIN_VOCAB);
            assert_eq!(c.num_attention_heads % c.num_key_value_heads, 0);
        }
        // qwen2.5-0.5b at 4 bits: about 0.28 GB like the mlx-community conversion.
        let b = inspect("qwen2.5-0.5b").unwrap().weight_bytes;
        assert!((250_000_000..300_000_000).contains(&b), "{b}");
    }

    #[test]
    fn dequantized_weights_are_centred_and_scaled() {
        let pool = MemoryPool::unlimited();
        let m = load_with_seed("tiny", 1, &pool).unwrap();
        let LinearWeight::Quantized(w) = &m.weights.layers[0].mlp.dense().unwrap().gate_proj.weight else {
            panic!("quantized")
        };
        let mut row = vec![0f32; w.k()];
        let (mut sum, mut sq, mut count) = (0f64, 0f64, 0usize);
        for r in 0..w.n() {
            w.dequantize_row(r, &mut row);
            for &v in &row {
                assert!(v.is_finite());
                sum += v as f64;
                sq += (v * v) as f64;
                count += 1;
            }
        }
        let mean = sum / count as f64;
        let std = (sq / count as f64 - mean * mean).sqrt();
        let want = 1.0 / (w.k() as f64).sqrt();
        assert!(mean.abs() < 0.05 * want, "mean {mean}");
        assert!((std / want - 1.0).abs() < 0.2, "std {std} want {want}");
    }
}
