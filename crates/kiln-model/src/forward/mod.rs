//! The forward pass over a loaded model, behind the [`backend`] seam every engine implements: [`weights`] (the structs loaders fill) with the
//! routed experts' [`experts`] store and its [`expert_cache`], one [`transformer`] forward
//! over any mix of sequences ([`attention`], [`rope`], [`moe`], [`ops`]), the
//! [`kv_cache`], the [`workspace`] the [`plan`] sizes, the [`engine`] that drives prefill
//! and decode, [`logprobs`] (log-softmax and a text's scores, for `kiln score` and the
//! server), [`sampling`], and [`speculative`] decoding on top.

pub mod attention;
pub mod backend;
pub mod engine;
pub mod expert_cache;
pub mod experts;
pub mod kv_cache;
pub mod logprobs;
pub mod moe;
pub mod ops;
pub mod plan;
pub mod rope;
pub mod sampling;
pub mod speculative;
pub mod transformer;
pub mod weights;
pub mod workspace;
