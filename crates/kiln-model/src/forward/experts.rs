//! The routed experts of a mixture-of-experts model in their backing store: every
//! layer's experts, each three MLX-quantized matrices (gate, up, down), viewed in place
//! in whatever holds them (a synthetic model's host tier, or a memory-mapped checkpoint).
//! The forward reads them from here directly when every expert is resident, or through
//! an [`crate::forward::expert_cache::ExpertCache`] that copies them into a few resident slots.

use kiln_core::QuantizedMatrix;

use crate::error::{ModelError, Result};

/// One routed expert: a SwiGLU MLP of quantized matrices.
#[derive(Debug)]
pub struct Expert {
    /// `[expert_intermediate, hidden]`.
    pub gate_proj: QuantizedMatrix,
    /// `[expert_intermediate, hidden]`.
    pub up_proj: QuantizedMatrix,
    /// `[hidden, expert_intermediate]`.
    pub down_proj: QuantizedMatrix,
}

impl Expert {
    /// The three matrices, in slot order.
    pub fn parts(&self) -> [&QuantizedMatrix; 3] {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
    }

    /// Bytes of packed weights, scales and biases: what a miss copies.
    pub fn bytes(&self) -> usize {
        self.parts().iter().map(|m| m.bytes_read()).sum()
    }
}

/// Every routed expert of a model, indexed by (layer, expert).
#[derive(Debug)]
pub struct ExpertStore {
    layers: usize,
    experts: usize,
    top_k: usize,
    all: Vec<Expert>,
}

impl ExpertStore {
    /// A store of `layers x experts` experts given layer by layer; every expert must have
    /// the shape and quantization of the first, so any slot can hold any expert.
    pub fn new(layers: usize, experts: usize, top_k: usize, all: Vec<Expert>) -> Result<Self> {
        if all.len() != layers * experts || all.is_empty() {
            return Err(ModelError::WeightShape {
                tensor: "experts".into(),
                expected: format!("{layers} layers x {experts} experts"),
                found: format!("{} experts", all.len()),
            });
        }
        let shape =
            |e: &Expert| e.parts().map(|m| (m.n(), m.k(), m.spec(), m.scales().dtype(), m.bytes_read()));
        let first = shape(&all[0]);
        if let Some(i) = all.iter().position(|e| shape(e) != first) {
            return Err(ModelError::WeightShape {
                tensor: format!("model.layers.{}.mlp.experts.{}", i / experts, i % experts),
                expected: "the shape and quantization of every other expert".into(),
                found: "a different one".into(),
            });
        }
        Ok(ExpertStore { layers, experts, top_k, all })
    }

    /// Decoder layers.
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// Routed experts per layer.
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Experts each token is routed to.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// Every expert of every layer: `layers x experts`.
    pub fn total(&self) -> usize {
        self.all.len()
    }

    /// Bytes of one expert (every expert has the same).
    pub fn expert_bytes(&self) -> usize {
        self.all[0].bytes()
    }

    /// Expert `expert` of layer `layer`.
    pub fn get(&self, layer: usize, expert: usize) -> &Expert {
        &self.all[layer * self.experts + expert]
    }

    /// The expert at flat index `id` (`layer * experts + expert`).
    pub fn by_id(&self, id: usize) -> &Expert {
        &self.all[id]
    }
}
