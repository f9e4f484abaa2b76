//! Prompts of the asked length in the server's own tokens. Token ids are exact; text
//! (the chat endpoint, or `--prompt-kind text`) is calibrated against the server: two
//! probes of different word counts give the server's tokens per word and its fixed
//! overhead (a chat template, a BOS token), from which the word counts for the asked
//! length follow, and a third probe of those words says what the server counts.

use std::time::Duration;

use serde::Serialize;

use super::client::{Endpoint, Prompt, RequestResult, RequestSpec, Target};
use super::load::{self, Arrival};

/// How prompts are sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PromptKind {
    /// Token ids (completions only): the asked length exactly.
    Ids,
    /// Words of common English, calibrated against the server's count.
    Text,
}

/// What every request's prompt is made of.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PromptPlan {
    /// Ids or text.
    pub kind: PromptKind,
    /// Ids: the tokens; text: the words.
    pub units: u64,
    /// Of those, the first `shared` are the same in every request.
    pub shared: u64,
    /// Text: bytes of filler after the words, for a tokenizer that counts every byte
    /// (a word is several tokens there, so whole words alone would miss the length).
    pub tail: u64,
}

impl PromptPlan {
    /// The prompt of the request seeded `seed`.
    pub fn prompt(&self, seed: u64) -> Prompt {
        match self.kind {
            PromptKind::Ids => Prompt::Ids(load::prompt_ids(self.units, self.shared, seed)),
            PromptKind::Text => {
                let mut text = load::prompt(self.units, self.shared, seed);
                if self.tail > 0 {
                    text.push(' ');
                    text.push_str(&"x".repeat(self.tail as usize - 1));
                }
                Prompt::Text(text)
            }
        }
    }
}

/// The text plan for `tokens` prompt tokens, `shared` of them a common prefix, from two
/// probes: `n1` words counted as `p1` tokens, `n2` as `p2`. Where a word is several
/// tokens (a byte-level tokenizer: five, one per byte), the words are rounded down and a
/// tail of filler bytes makes up the rest. `None` when the counts do not grow with the
/// words (a server that counts something else).
pub fn fit(probes: [(u64, u64); 2], tokens: u64, shared: u64) -> Option<PromptPlan> {
    let [(n1, p1), (n2, p2)] = probes;
    if n2 <= n1 || p2 <= p1 {
        return None;
    }
    let per_word = (p2 - p1) as f64 / (n2 - n1) as f64;
    let overhead = p1 as f64 - per_word * n1 as f64;
    let room = tokens as f64 - overhead;
    let (words, tail) = if per_word >= 2.0 {
        let words = (room / per_word).floor().max(1.0);
        (words as u64, (room - words * per_word).round().max(0.0) as u64)
    } else {
        ((room / per_word).round().max(1.0) as u64, 0)
    };
    // The shared prefix is words too, and carries none of the overhead.
    let shared_words = ((shared as f64 / per_word).round() as u64).min(words);
    Some(PromptPlan { kind: PromptKind::Text, units: words, shared: shared_words, tail })
}

/// The calibration's outcome.
pub struct Calibrated {
    /// The plan every measured request follows.
    pub plan: PromptPlan,
    /// The probes sent, for requests.jsonl.
    pub probes: Vec<RequestResult>,
    /// One line saying what was found.
    pub note: String,
}

fn probe(endpoint: Endpoint, served: &str, words: u64, seed: u64) -> RequestSpec {
    RequestSpec {
        key: format!("calibration/{words}-words"),
        prompt: Prompt::Text(load::prompt(words, 0, seed)),
        max_tokens: 1,
        ignore_eos: true,
        model: served.to_string(),
        endpoint,
        speculative: false,
        json_object: false,
    }
}

/// Text prompts of `tokens` tokens as the server counts them (`shared` of them common to
/// every request). Without counts from the server, one word per token is sent and the
/// note says why.
pub async fn calibrate(
    target: &Target,
    endpoint: Endpoint,
    served: &str,
    tokens: u64,
    shared: u64,
    timeout: Duration,
) -> Calibrated {
    let mut probes = Vec::new();
    // Short enough that a byte-level tokenizer's count stays inside the context.
    let n1 = (tokens / 8).max(4);
    let mut counts = Vec::new();
    for (i, n) in [n1, 2 * n1].into_iter().enumerate() {
        let run = load::run(
            target,
            vec![probe(endpoint, served, n, 0xca11_0000 + i as u64)],
            Arrival::Closed(1),
            timeout,
        )
        .await;
        let r = run.results.into_iter().next();
        counts.push(r.as_ref().filter(|r| r.ok).and_then(|r| r.prompt_tokens).map(|p| (n, p)));
        probes.extend(r);
    }
    let asked = PromptPlan { kind: PromptKind::Text, units: tokens, shared, tail: 0 };
    let (Some(a), Some(b)) = (counts[0], counts[1]) else {
        let why =
            probes.iter().find_map(|r| r.error.clone()).unwrap_or_else(|| "no usage.prompt_tokens".into());
        return Calibrated {
            plan: asked,
            probes,
            note: format!(
                "prompt calibration failed ({why}): sending {tokens} words, one per token as most BPE tokenizers count them"
            ),
        };
    };
    let Some(plan) = fit([a, b], tokens, shared) else {
        return Calibrated {
            plan: asked,
            probes,
            note: format!(
                "prompt calibration failed ({} words counted {} tokens, {} words {}): sending {tokens} words",
                a.0, a.1, b.0, b.1
            ),
        };
    };
    let mut check_spec = probe(endpoint, served, plan.units, 0xca11_0002);
    check_spec.prompt = PromptPlan { shared: 0, ..plan.clone() }.prompt(0xca11_0002);
    let check = load::run(target, vec![check_spec], Arrival::Closed(1), timeout).await;
    let counted = check.results.first().filter(|r| r.ok).and_then(|r| r.prompt_tokens);
    probes.extend(check.results);
    let note = format!(
        "prompt calibration: the server counted {} words as {} tokens and {} as {}; sending {} words ({} shared{}) for {tokens} tokens, counted as {}",
        a.0,
        a.1,
        b.0,
        b.1,
        plan.units,
        plan.shared,
        if plan.tail > 0 { format!(", then {} filler bytes", plan.tail) } else { String::new() },
        counted.map_or_else(|| "unknown".to_string(), |c| c.to_string())
    );
    Calibrated { plan, probes, note }
}

/// Whether `served` prompt tokens (the mean the server counted) is more than 5% off
/// `asked`.
pub fn off(asked: u64, served: f64) -> bool {
    asked > 0 && ((served - asked as f64) / asked as f64).abs() > 0.05
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fit_recovers_the_tokens_per_word_and_the_overhead() {
        let plan = |units, shared, tail| Some(PromptPlan { kind: PromptKind::Text, units, shared, tail });
        // One token per word and a BOS: 32 tokens are 31 words.
        assert_eq!(fit([(4, 5), (8, 9)], 32, 0), plan(31, 0, 0));
        // A byte-level tokenizer (5 bytes a word) under a 19-token chat template: 21 words
        // are 105 tokens, and 4 filler bytes make the 128.
        assert_eq!(fit([(4, 39), (8, 59)], 128, 64), plan(21, 13, 4));
        assert_eq!(fit([(4, 40), (8, 60)], 10, 0), plan(1, 0, 0), "at least one word");
        assert_eq!(fit([(4, 9), (8, 9)], 32, 0), None, "counts that do not grow");
        // The tail is filler bytes after the words.
        let Some(p) = plan(2, 0, 3) else { unreachable!() };
        let Prompt::Text(t) = p.prompt(1) else { panic!("a text prompt") };
        assert_eq!(t.len(), 2 * 5 + 3, "{t:?}");
        assert!(t.ends_with(" xx"), "{t:?}");
    }

    #[test]
    fn more_than_five_percent_off_is_flagged() {
        assert!(off(32, 196.0) && off(100, 94.0));
        assert!(!off(32, 32.0) && !off(100, 105.0) && !off(0, 3.0));
    }
}
