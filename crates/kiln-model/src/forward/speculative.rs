//! Speculative decoding: a [`Drafter`] proposes up to K tokens, one forward verifies the
//! pending token and the K drafts together (K + 1 positions, so the projections run with
//! M = K + 1), the longest prefix the target agrees with is kept and the cache is rolled
//! back past the rest. Greedy output is identical to classic greedy decoding as long as
//! the verify block's logits equal the single-token chain's, which the
//! [`ExactnessGate`] checks once per shape before the first verify and otherwise sends the
//! stream back to classic decoding.

mod drafter;
mod gate;
mod stream;
mod verify;

pub use drafter::{Draft, DraftModel, Drafter, PromptLookup, check_vocabulary};
pub use gate::{
    ALLOW_INEXACT_ENV, ExactnessGate, GateKey, GateOutcome, GatePolicy, GateReport, ProcessSwitch,
    TEST_INEXACT_ENV, TestInexact, WideSwitch,
};
pub use stream::{DEFAULT_DRAFT_TOKENS, PROBE_DRAWS, SpecStats, SpecStep, SpecStream, probe_block};
pub use verify::{Accepted, accept_greedy, accept_sampled};
