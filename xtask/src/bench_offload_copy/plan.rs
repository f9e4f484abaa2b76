//! What a run walks: the models (with a default per backend), each model's expert shape
//! as the engine's estimate reports it, the slot counts of its geometries (the seed's
//! defaults unless named), and the (batch, miss rate) cells of one geometry.

use std::collections::BTreeMap;

use kiln_protocol::EstimateReport;

use crate::sweep::plan::{Cell, Engine, Named, Prompt};

/// The suffix that keys this sweep's OOMs in the shared record.
pub(super) const RECORD_SUFFIX: &str = "+expert-slots";

/// The models of a run without `--models`: the small MoE profiles on the CPU, the large
/// ones on a GPU.
pub(super) fn default_models(gpu: bool) -> Vec<String> {
    let names: &[&str] = if gpu {
        &["synthetic:qwen3-30b-a3b", "synthetic:mixtral-8x7b", "synthetic:qwen1.5-moe-a2.7b"]
    } else {
        &["synthetic:tiny-moe", "synthetic:tiny-qwen2-moe"]
    };
    names.iter().map(|n| n.to_string()).collect()
}

/// A model's expert shape, as the engine's estimate reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Shape {
    pub(super) layers: u64,
    pub(super) experts: u64,
    pub(super) slot_bytes: u64,
}

impl Shape {
    pub(super) fn of(r: &EstimateReport) -> Option<Shape> {
        Some(Shape { layers: r.moe_layers?, experts: r.moe_experts?, slot_bytes: r.expert_slot_bytes? })
    }

    /// The seed's defaults: the experts of one layer, and 0.4 x layers x experts
    /// (rounded down, as `int()` does), each once.
    pub(super) fn default_slots(self) -> Vec<u64> {
        let mut v = vec![self.experts, 4 * self.layers * self.experts / 10];
        v.dedup();
        v
    }
}

/// The cells of one geometry, batch-major: every miss rate at each batch size.
pub(super) fn cells(batches: &[u64], rates: &[f64]) -> Vec<(u64, f64)> {
    batches.iter().flat_map(|&b| rates.iter().map(move |&r| (b, r))).collect()
}

/// The sweep cell the runner and the OOM layers see for `model` at length `len`: the
/// model's estimate at one token, a `bench-expert-copy` child's logs, or (keyed
/// `<model>+expert-slots` at the slot count) a geometry in the backstop and the record.
pub(super) fn cell(model: String, len: u64) -> Cell {
    Cell {
        model,
        prompt: Prompt::Tokens(len),
        max_tokens: 1,
        warmup_tokens: 0,
        named: Named { models: false, prompts: false },
        env: BTreeMap::new(),
        repetition: 1,
        engine: Engine::Kiln,
    }
}

/// The key of the geometry `model` at `slots` in the OOM layers.
pub(super) fn record_key(model: &str, slots: u64) -> Cell {
    cell(format!("{model}{RECORD_SUFFIX}"), slots)
}

#[cfg(test)]
mod tests {
    use super::super::rows::size;
    use super::*;

    #[test]
    fn default_slots_follow_the_seed() {
        let qwen3 = Shape { layers: 48, experts: 128, slot_bytes: 1 };
        assert_eq!(qwen3.default_slots(), vec![128, 2457]);
        let tiny = Shape { layers: 2, experts: 8, slot_bytes: 1 };
        assert_eq!(tiny.default_slots(), vec![8, 6]);
        assert_eq!(size(47 << 30), "47.0 GiB");
        assert_eq!(size(512), "512 B");
    }

    #[test]
    fn a_geometry_walks_every_rate_at_each_batch() {
        assert_eq!(cells(&[1, 4], &[0.0, 1.0]), [(1, 0.0), (1, 1.0), (4, 0.0), (4, 1.0)]);
        let key = record_key("synthetic:tiny-moe", 6);
        assert_eq!((key.model.as_str(), key.layer_len()), ("synthetic:tiny-moe+expert-slots", 6));
    }
}
