//! The token rules both sides count by: the warm-up rule (how many of the generated
//! tokens are timed) and the context rule (how many positions a sequence may hold). The
//! engine refuses by them and the harness plans by them, so neither keeps its own copy.

/// Why a run's token counts leave nothing to time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WarmupError {
    /// `--max-tokens 0`: nothing is generated.
    #[error("--max-tokens 0: expected 1 or more generated tokens")]
    NoTokens,
    /// The warm-up steps take every decode step.
    #[error(
        "--warmup-tokens {warmup_tokens} leaves no timed decode step with --max-tokens {max_tokens}: \
         expected a warm-up below {}",
        max_tokens.saturating_sub(1)
    )]
    NoTimedStep {
        /// Tokens generated.
        max_tokens: u64,
        /// Decode steps before the timed ones.
        warmup_tokens: u64,
    },
}

/// The warm-up rule: of `max_tokens` generated tokens the first comes out of the
/// prefill and each other from one decode step, the first `warmup_tokens` of those
/// steps untimed; at least one step must be timed (a warm-up of 0 times every step,
/// even none). Returns the timed decode steps.
pub fn timed_decode_steps(max_tokens: u64, warmup_tokens: u64) -> Result<u64, WarmupError> {
    if max_tokens == 0 {
        return Err(WarmupError::NoTokens);
    }
    let steps = max_tokens - 1;
    // Written without `warmup + 1`, which would wrap at u64::MAX.
    if warmup_tokens > 0 && warmup_tokens >= steps {
        return Err(WarmupError::NoTimedStep { max_tokens, warmup_tokens });
    }
    Ok(steps - warmup_tokens.min(steps))
}

/// A sequence that would not fit its model's context.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{requested} positions requested, beyond the model's context of {limit}")]
pub struct ContextExceeded {
    /// The positions the sequence would hold (saturated at `usize::MAX`).
    pub requested: usize,
    /// The model's context (`max_position_embeddings`).
    pub limit: usize,
}

/// The context rule: a sequence holding `used` positions may take `new` more when
/// `used + new` is at most the model's `context`.
pub fn check_context(used: usize, new: usize, context: usize) -> Result<(), ContextExceeded> {
    match used.checked_add(new) {
        Some(requested) if requested <= context => Ok(()),
        sum => Err(ContextExceeded { requested: sum.unwrap_or(usize::MAX), limit: context }),
    }
}

/// Tokens a sequence holding `used` positions may still take under [`check_context`].
pub fn context_room(used: usize, context: usize) -> usize {
    context.saturating_sub(used)
}
