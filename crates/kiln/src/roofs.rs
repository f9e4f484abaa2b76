//! `kiln bench-decode --measure-roofs`: the machine's compute roofs measured on the run's
//! worker threads before the model loads (`kiln_core::roofs`), and what a forward counts,
//! so the record gives prefill's share of the compute roof and decode's share of the
//! read bandwidth.
//!
//! **What is counted.** Operations count a multiply-accumulate as two. A token's layer
//! products are 2 * n * k per matrix it runs through (q, k, v, o, and the MLP's gate, up
//! and down; for a mixture of experts the router, the shared expert and its gate, and
//! `top_k` routed experts); the LM head runs one row per forward (the prefill asks for the
//! last token's logits only); causal attention over a fresh cache adds, per layer, two
//! products (scores and values) of `heads * head_dim` multiply-accumulates for each of the
//! `P * (P + 1) / 2` query-key pairs of a `P`-token prompt. Norms, RoPE, the softmax,
//! activation functions, the quantization of activations and the scales of the integer
//! sums are not counted. A decode step's count is its layer products and LM head
//! (attention over the cache is not counted there).

use std::collections::BTreeMap;
use std::time::Instant;

use kiln_core::roofs::{self, ComputeRoof, RoofKind};
use kiln_model::config::ModelConfig;
use kiln_model::weights::{DenseMlp, Linear, LinearWeight, Mlp, ModelWeights};
use kiln_protocol::RoofsReport;

/// Passes of each probe; the best is reported.
const PASSES: usize = roofs::DEFAULT_PASSES;

/// The roofs as measured, with the time they took.
pub struct Measured {
    roofs: Vec<ComputeRoof>,
    ms: f64,
}

/// Measures every compute roof this CPU runs on the current pool's threads; the time is
/// the caller's to exclude from its clock.
pub fn measure() -> (Measured, std::time::Duration) {
    let t = Instant::now();
    let roofs = roofs::measure_all(roofs::DEFAULT_ITERS, PASSES);
    let spent = t.elapsed();
    (Measured { roofs, ms: spent.as_secs_f64() * 1e3 }, spent)
}

/// Operations of a forward, as the module's documentation counts them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ForwardOps {
    /// One token's layer products.
    pub per_token: f64,
    /// One row of the LM head.
    pub head_row: f64,
    /// Per layer and query-key pair: both attention products.
    pub attention_per_pair: f64,
    /// Decoder layers.
    pub layers: usize,
    /// Whether every product runs on quantized weights (the int8 roof holds them).
    pub quantized: bool,
}

fn product(w: &LinearWeight) -> f64 {
    2.0 * w.n() as f64 * w.k() as f64
}

fn linear(l: &Linear) -> f64 {
    product(&l.weight)
}

fn dense(m: &DenseMlp) -> f64 {
    linear(&m.gate_proj) + linear(&m.up_proj) + linear(&m.down_proj)
}

impl ForwardOps {
    /// The counts of `weights` under `config`.
    pub fn of(weights: &ModelWeights, config: &ModelConfig) -> ForwardOps {
        let routed = weights.experts.as_ref().map_or(0.0, |e| {
            if e.total() == 0 {
                return 0.0;
            }
            let one: f64 = e.get(0, 0).parts().iter().map(|q| 2.0 * q.n() as f64 * q.k() as f64).sum();
            e.top_k() as f64 * one
        });
        let mut quantized = true;
        let mut note = |w: &LinearWeight| quantized &= matches!(w, LinearWeight::Quantized(_));
        let per_token = weights
            .layers
            .iter()
            .map(|l| {
                for p in [&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj] {
                    note(&p.weight);
                }
                let mlp = match &l.mlp {
                    Mlp::Dense(d) => {
                        for p in [&d.gate_proj, &d.up_proj, &d.down_proj] {
                            note(&p.weight);
                        }
                        dense(d)
                    }
                    Mlp::Moe(m) => {
                        linear(&m.router)
                            + m.shared_expert.as_ref().map_or(0.0, dense)
                            + m.shared_expert_gate.as_ref().map_or(0.0, linear)
                            + routed
                    }
                };
                linear(&l.q_proj) + linear(&l.k_proj) + linear(&l.v_proj) + linear(&l.o_proj) + mlp
            })
            .sum();
        let head_row = match &weights.lm_head {
            Some(h) => linear(h),
            None => product(&weights.embed_tokens),
        };
        ForwardOps {
            per_token,
            head_row,
            attention_per_pair: 2.0 * 2.0 * config.num_attention_heads as f64 * config.head_dim as f64,
            layers: weights.layers.len(),
            quantized,
        }
    }

    /// Causal attention's operations over a fresh cache for a `prompt`-token prefill.
    pub fn prefill_attention(&self, prompt: usize) -> f64 {
        let pairs = prompt as f64 * (prompt as f64 + 1.0) / 2.0;
        self.layers as f64 * self.attention_per_pair * pairs
    }

    /// The prefill's operations for a `prompt`-token prompt.
    pub fn prefill(&self, prompt: usize) -> f64 {
        prompt as f64 * self.per_token + self.head_row + self.prefill_attention(prompt)
    }

    /// One decode step's operations (attention not counted).
    pub fn decode_per_token(&self) -> f64 {
        self.per_token + self.head_row
    }
}

/// What the run measured, for [`report`].
pub struct Run {
    /// The prefill's operations' count.
    pub ops: ForwardOps,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// The prefill's time in seconds.
    pub prefill_s: f64,
    /// Weight bytes the prefill reads (each matrix once) and one decode step reads.
    pub bytes_per_token: f64,
    /// Decode tokens per second.
    pub decode_tok_s: f64,
    /// Read bandwidth of the same process, bytes per second.
    pub bandwidth: f64,
}

/// The record's roofs and shares; `None` when no compute roof of the kind the weights
/// need was measured (a CPU none of the probes runs on).
pub fn report(m: &Measured, run: &Run) -> Option<RoofsReport> {
    let kind = if run.ops.quantized { RoofKind::Int8 } else { RoofKind::F32 };
    let roof = roofs::best(&m.roofs, kind)?;
    let prefill_ops = run.ops.prefill(run.prompt_tokens);
    let prefill_ops_per_s = prefill_ops / run.prefill_s;
    Some(RoofsReport {
        compute_roof: roof.probe.as_str().into(),
        compute_roof_ops_per_s: roof.ops_per_s,
        compute_probes: m
            .roofs
            .iter()
            .map(|r| (r.probe.as_str().to_string(), r.ops_per_s))
            .collect::<BTreeMap<_, _>>(),
        compute_probe_ms: m.ms,
        read_bandwidth_bytes_per_s: run.bandwidth,
        prefill_ops,
        prefill_attention_ops: run.ops.prefill_attention(run.prompt_tokens),
        prefill_bytes: run.bytes_per_token,
        prefill_ops_per_s,
        prefill_compute_share: prefill_ops_per_s / roof.ops_per_s,
        decode_ops_per_token: run.ops.decode_per_token(),
        decode_bytes_per_token: run.bytes_per_token,
        decode_bandwidth_share: run.decode_tok_s * run.bytes_per_token / run.bandwidth,
    })
}

/// The human line on stderr.
pub fn describe(r: &RoofsReport, threads: usize) -> String {
    format!(
        "roofs ({threads} thread(s)): compute {:.2} TOPS ({}), read bandwidth {:.1} GB/s; \
         prefill {:.3} TOPS = {:.1}% of the compute roof; decode {:.1} GB/s = {:.1}% of the bandwidth roof",
        r.compute_roof_ops_per_s / 1e12,
        r.compute_roof,
        r.read_bandwidth_bytes_per_s / 1e9,
        r.prefill_ops_per_s / 1e12,
        100.0 * r.prefill_compute_share,
        r.decode_bandwidth_share * r.read_bandwidth_bytes_per_s / 1e9,
        100.0 * r.decode_bandwidth_share,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ops() -> ForwardOps {
        // The Qwen2.5-0.5B shape: 24 layers, 14 heads of 64, q 896x896, k/v 128x896,
        // o 896x896, gate/up 4864x896, down 896x4864, a tied head of 151936x896.
        let per_layer = 2.0 * (896.0 * 896.0 * 2.0 + 128.0 * 896.0 * 2.0 + 4864.0 * 896.0 * 3.0);
        ForwardOps {
            per_token: 24.0 * per_layer,
            head_row: 2.0 * 151936.0 * 896.0,
            attention_per_pair: 4.0 * 14.0 * 64.0,
            layers: 24,
            quantized: true,
        }
    }

    #[test]
    fn a_forward_counts_its_products_its_head_row_and_causal_attention() {
        let o = ops();
        // 0.716 GOP per token in the layer products, as the issue counts the Qwen shape.
        assert!((o.per_token / 1e9 - 0.716).abs() < 0.001, "{}", o.per_token);
        // One token: one pair per layer.
        assert_eq!(o.prefill_attention(1), 24.0 * 4.0 * 14.0 * 64.0);
        // 512 tokens: 512 * 513 / 2 pairs.
        assert_eq!(o.prefill_attention(512), 24.0 * 4.0 * 14.0 * 64.0 * 131_328.0);
        assert_eq!(o.prefill(512), 512.0 * o.per_token + o.head_row + o.prefill_attention(512));
        assert_eq!(o.decode_per_token(), o.per_token + o.head_row);
    }

    #[test]
    fn the_shares_are_of_the_roof_the_weights_need() {
        let m = Measured {
            roofs: vec![
                ComputeRoof { probe: roofs::Probe::Int8Avx2, ops_per_s: 0.7e12, threads: 2 },
                ComputeRoof { probe: roofs::Probe::Int8Avx512Vnni, ops_per_s: 1.4e12, threads: 2 },
                ComputeRoof { probe: roofs::Probe::F32FmaAvx512, ops_per_s: 0.3e12, threads: 2 },
            ],
            ms: 100.0,
        };
        let run = Run {
            ops: ops(),
            prompt_tokens: 512,
            prefill_s: 2.5,
            bytes_per_token: 300e6,
            decode_tok_s: 100.0,
            bandwidth: 40e9,
        };
        let r = report(&m, &run).unwrap();
        assert_eq!(r.compute_roof, "int8_avx512_vnni");
        assert!((r.prefill_compute_share - run.ops.prefill(512) / 2.5 / 1.4e12).abs() < 1e-12);
        assert!((r.decode_bandwidth_share - 0.75).abs() < 1e-12);
        assert_eq!(r.compute_probes.len(), 3);
        let line = describe(&r, 2);
        assert!(
            line.contains("of the compute roof")
                && line.contains("decode 30.0 GB/s = 75.0% of the bandwidth roof"),
            "{line}"
        );
        // Unquantized weights are held to the f32 roof; no probe of that kind, no report.
        let dense = Run { ops: ForwardOps { quantized: false, ..ops() }, ..run };
        assert_eq!(report(&m, &dense).unwrap().compute_roof, "f32_fma_avx512");
        assert!(report(&Measured { roofs: Vec::new(), ms: 0.0 }, &dense).is_none());
    }
}
