//! `--mode mixed`: what classic streams pay for sharing a server with a speculative one.
//! A window starts one speculative stream (`"speculative": true`, a prompt that repeats a
//! passage, so prompt lookup drafts well) and, once it is decoding, N classic streams; the classic
//! streams' decode rates are the reported quantity. The window counts only when the
//! speculative stream decoded through at least [`MIN_OVERLAP`] of the classic streams'
//! decode span and had drained before the next window began; each window's timeline,
//! overlap, drain and validity go into its line of `passes.jsonl`.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;

use super::abba::Mode;
use super::analysis::{Design, TaxRow};
use super::records::{Better, CellDef, CellMeasure, MetricDef, PassRecord};
use crate::plot::Panel;
use crate::serve_bench::client::{self, Endpoint, Prompt, RequestResult, RequestSpec, Target};
use crate::serve_bench::load;

/// The share of the window the speculative stream must have decoded through.
pub const MIN_OVERLAP: f64 = 0.95;

/// The cell every window is.
pub const CELL: &str = "window";

const CLASSIC: MetricDef = MetricDef { name: super::analysis::BYSTANDERS, better: Better::Higher };
const SPEC: MetricDef = MetricDef { name: "speculative tok/s", better: Better::Higher };
const ACCEPT: MetricDef = MetricDef { name: "acceptance %", better: Better::Higher };

/// The mixed mode's sizes.
#[derive(Debug)]
pub struct Mixed {
    /// Classic streams per window.
    pub classic_streams: usize,
    /// Tokens each classic stream generates.
    pub max_tokens: u64,
    /// Prompt tokens of a classic stream.
    pub decode_prompt: u64,
    /// The speculative stream's budget; `None`: sized from the previous window.
    pub spec_max_tokens: Option<u64>,
    /// Tokens of the passage the speculative prompt repeats.
    pub passage_tokens: u64,
    /// `--draft-tokens` of every boot.
    pub draft_tokens: usize,
    /// How long after the classic streams end the speculative stream may take to drain.
    pub drain_timeout: Duration,
    /// The `model` field.
    pub served: String,
    /// The budget learned from the run's first window, for every later one.
    learned: Cell<Option<u64>>,
}

impl Mixed {
    /// The mode with its sizes.
    #[allow(clippy::too_many_arguments, reason = "one call site, every size named there")]
    pub fn new(
        classic_streams: usize,
        max_tokens: u64,
        decode_prompt: u64,
        spec_max_tokens: Option<u64>,
        passage_tokens: u64,
        draft_tokens: usize,
        drain_timeout: Duration,
        served: String,
    ) -> Mixed {
        Mixed {
            classic_streams,
            max_tokens,
            decode_prompt,
            spec_max_tokens,
            passage_tokens,
            draft_tokens,
            drain_timeout,
            served,
            learned: Cell::new(None),
        }
    }

    /// The most the speculative stream can need: every verify accepting all K drafts
    /// while each classic stream decodes one token per step.
    fn ceiling(&self) -> u64 {
        self.max_tokens * (self.draft_tokens as u64 + 1)
    }

    /// The speculative stream's `max_tokens` for a window: the flag, else the run's
    /// first window (the first boot's warm-up) gets the ceiling and every later window
    /// what that window's speculative rate needs to cover the classic span, half again
    /// plus one verify. Fixed for the rest of the run, so every boot of both arms sends
    /// the same requests.
    fn budget(&self) -> u64 {
        self.spec_max_tokens.or(self.learned.get()).unwrap_or_else(|| self.ceiling())
    }

    fn learn(&self, classic: Option<Span>, spec: &RequestResult) {
        if self.spec_max_tokens.is_some() || self.learned.get().is_some() {
            return;
        }
        let (Some(w), Some(s)) = (classic, Span::of(spec)) else { return };
        let decoded = spec.output_tokens.saturating_sub(1) as f64;
        if s.last_ms <= s.first_ms || decoded <= 0.0 {
            return;
        }
        let per_ms = decoded / (s.last_ms - s.first_ms);
        let need = per_ms * (w.last_ms - s.first_ms.min(w.first_ms)) * 1.5;
        let n =
            (need.ceil() as u64 + self.draft_tokens as u64 + 1).clamp(self.max_tokens, 2 * self.ceiling());
        self.learned.set(Some(n));
    }

    fn request(&self, key: String, prompt: Vec<u32>, max_tokens: u64, speculative: bool) -> RequestSpec {
        RequestSpec {
            key,
            prompt: Prompt::Ids(prompt),
            max_tokens,
            ignore_eos: true,
            model: self.served.clone(),
            endpoint: Endpoint::Completions,
            speculative,
            json_object: false,
        }
    }
}

/// The speculative prompt: a passage, again, and its first half once more, so the
/// continuation the text asks for is already in it (what prompt lookup drafts from).
pub fn passage_prompt(tokens: u64, seed: u64) -> Vec<u32> {
    let p = load::prompt_ids(tokens, 0, seed);
    let mut v = p.clone();
    v.extend_from_slice(&p);
    v.extend_from_slice(&p[..p.len() / 2]);
    v
}

fn seed(pass: usize, i: usize) -> u64 {
    ((pass as u64) << 24) ^ i as u64 ^ 0x6d17_0000_0000
}

/// One stream's decode span: its first and last token, ms since the window began.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Span {
    /// The first token's arrival.
    pub first_ms: f64,
    /// The last token's arrival.
    pub last_ms: f64,
}

impl Span {
    /// A request's span: its first and last event with a choice (kiln sends one per
    /// token, even while a token's text is held back, which a random synthetic model's
    /// bytes often are), after the request's start.
    pub fn of(r: &RequestResult) -> Option<Span> {
        let (a, b) = r.choice_span_ms?;
        Some(Span { first_ms: r.start_ms + a, last_ms: r.start_ms + b })
    }

    fn len(&self) -> f64 {
        self.last_ms - self.first_ms
    }
}

/// The classic streams' decode span: from the first classic token to the last.
pub fn classic_window(classic: &[Span]) -> Option<Span> {
    let first = classic.iter().map(|s| s.first_ms).reduce(f64::min)?;
    let last = classic.iter().map(|s| s.last_ms).reduce(f64::max)?;
    Some(Span { first_ms: first, last_ms: last })
}

/// Whether a window counts, and why not.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Validity {
    /// The classic streams' decode span.
    pub window: Option<Span>,
    /// The share of it the speculative stream decoded through.
    pub overlap: f64,
    /// The speculative stream ended before the next window could begin.
    pub drained: bool,
    /// It held a speculative slot (the usage extension came back).
    pub speculated: bool,
    /// Whether the window counts.
    pub valid: bool,
    /// Why not.
    pub why: Option<String>,
}

/// The validity rule: the speculative stream decoded through at least [`MIN_OVERLAP`] of
/// the classic span, drained, and speculated.
pub fn validity(classic: &[Span], spec: Option<Span>, drained: bool, speculated: bool) -> Validity {
    let window = classic_window(classic);
    let overlap = match (window, spec) {
        (Some(w), Some(s)) if w.len() > 0.0 => {
            let inside = s.last_ms.min(w.last_ms) - s.first_ms.max(w.first_ms);
            (inside / w.len()).clamp(0.0, 1.0)
        }
        _ => 0.0,
    };
    let why = if !window.is_some_and(|w| w.len() > 0.0) {
        Some("the classic streams decoded for no measurable time (raise --max-tokens)".to_string())
    } else if !drained {
        Some("the speculative stream had not drained when the next window was due".to_string())
    } else if !speculated {
        Some("the speculative stream held no speculative slot (no usage.speculative came back)".to_string())
    } else if overlap < MIN_OVERLAP {
        Some(format!(
            "the speculative stream decoded through {:.1}% of the window (at least {:.0}% required)",
            100.0 * overlap,
            100.0 * MIN_OVERLAP
        ))
    } else {
        None
    };
    Validity { window, overlap, drained, speculated, valid: why.is_none(), why }
}

/// A stream's decode rate: the tokens after its first, over its span.
fn rate(r: &RequestResult) -> Option<f64> {
    let s = Span::of(r).filter(|s| s.len() > 0.0)?;
    (r.ok && r.output_tokens >= 2).then(|| 1000.0 * (r.output_tokens - 1) as f64 / s.len())
}

fn stream_json(r: &RequestResult) -> serde_json::Value {
    json!({
        "key": r.key,
        "ok": r.ok,
        "span": Span::of(r),
        "output_tokens": r.output_tokens,
        "tok_s": rate(r),
        "drafted": r.spec_drafted,
        "accepted": r.spec_accepted,
    })
}

impl Mode for Mixed {
    fn name(&self) -> &'static str {
        "mixed"
    }

    fn unit(&self) -> &'static str {
        "window"
    }

    fn cells(&self) -> Vec<CellDef> {
        vec![CellDef { name: CELL.into(), metrics: vec![CLASSIC, SPEC, ACCEPT] }]
    }

    fn design(&self) -> Design {
        Design::MIXED
    }

    fn panels(
        &self,
        _rows: &[TaxRow],
        passes: &[PassRecord],
        _design: Design,
        _margin_pct: f64,
    ) -> Vec<Panel> {
        super::plots::mixed(passes, [CLASSIC.name, SPEC.name])
    }

    fn server_args(&self) -> Vec<OsString> {
        // Every stream of a window has a slot, and exactly one slot speculates.
        let slots = self.classic_streams + 1;
        [
            "--parallel",
            &slots.to_string(),
            "--spec-slots",
            "1",
            "--draft-tokens",
            &self.draft_tokens.to_string(),
        ]
        .iter()
        .map(OsString::from)
        .collect()
    }

    async fn run_pass(&self, target: &Target, pass: usize, timeout: Duration) -> Vec<CellMeasure> {
        let budget = self.budget();
        let began = Instant::now();
        let at = || began.elapsed().as_secs_f64() * 1e3;
        let spec = self.request(
            format!("{CELL}/p{pass}/speculative"),
            passage_prompt(self.passage_tokens, seed(pass, 999)),
            budget,
            true,
        );
        // The speculative stream first, and the classic streams, all at once, only when
        // its first token is out: its longer prompt is prefilled and it is decoding, so
        // it covers the classic span from the span's start whatever order the server
        // admits requests in. A speculative request that fails releases them at once.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let spec_task = {
            let (t, s, start) = (target.clone(), spec, at());
            tokio::spawn(async move { client::send_signalling(&t, &s, timeout, start, Some(tx)).await })
        };
        let _ = tokio::time::timeout(timeout, rx).await;
        let classic_tasks: Vec<_> = (0..self.classic_streams)
            .map(|i| {
                let r = self.request(
                    format!("{CELL}/p{pass}/c{i}"),
                    load::prompt_ids(self.decode_prompt, 0, seed(pass, i)),
                    self.max_tokens,
                    false,
                );
                let (t, start) = (target.clone(), at());
                tokio::spawn(async move { client::send(&t, &r, timeout, start).await })
            })
            .collect();
        let mut classic = Vec::with_capacity(classic_tasks.len());
        for (i, t) in classic_tasks.into_iter().enumerate() {
            classic.push(t.await.unwrap_or_else(|e| {
                failed(format!("{CELL}/p{pass}/c{i}"), format!("the request task ended abnormally: {e}"))
            }));
        }
        let classic_end = at();
        // The drain: the speculative stream must end on its own before the next window.
        let mut spec_task = spec_task;
        let (spec, drained) = match tokio::time::timeout(self.drain_timeout, &mut spec_task).await {
            Ok(r) => (
                r.unwrap_or_else(|e| {
                    failed(
                        format!("{CELL}/p{pass}/speculative"),
                        format!("the request task ended abnormally: {e}"),
                    )
                }),
                true,
            ),
            Err(_) => {
                // Dropping the connection cancels the stream at the server's next token.
                spec_task.abort();
                let mut r = failed(format!("{CELL}/p{pass}/speculative"), String::new());
                r.ok = true;
                r.error = None;
                (r, false)
            }
        };
        let spans: Vec<Span> = classic.iter().filter(|r| r.ok).filter_map(Span::of).collect();
        let v = validity(&spans, Span::of(&spec), drained, spec.spec_drafted.is_some());
        self.learn(v.window, &spec);
        let all: Vec<&RequestResult> = classic.iter().chain(std::iter::once(&spec)).collect();
        let failed_n = all.iter().filter(|r| !r.ok).count();
        let mut metrics = BTreeMap::new();
        let rates: Vec<f64> = classic.iter().filter(|r| r.ok).filter_map(rate).collect();
        if rates.len() == classic.len() && !rates.is_empty() {
            metrics.insert(CLASSIC.name.to_string(), rates.iter().sum::<f64>() / rates.len() as f64);
        }
        if let Some(r) = rate(&spec) {
            metrics.insert(SPEC.name.to_string(), r);
        }
        if let (Some(d), Some(a)) = (spec.spec_drafted, spec.spec_accepted)
            && d > 0
        {
            metrics.insert(ACCEPT.name.to_string(), 100.0 * a as f64 / d as f64);
        }
        let detail = json!({
            "RESULT": {
                "valid": v.valid,
                "why": v.why,
                "overlap": v.overlap,
                "drained": v.drained,
                "speculated": v.speculated,
                "window": v.window,
                "classic_end_ms": classic_end,
                "spec_max_tokens": budget,
                "speculative": stream_json(&spec),
                "classic": classic.iter().map(stream_json).collect::<Vec<_>>(),
            }
        });
        vec![CellMeasure {
            cell: CELL.into(),
            requests: all.len(),
            failed: failed_n,
            first_error: all.iter().find_map(|r| r.error.clone()),
            metrics,
            // Classic greedy outputs must match across arms; the speculative stream's
            // may differ in arm B by design (inexact-allowed), so it is left out.
            hashes: classic.iter().filter(|r| r.ok).map(|r| (r.key.clone(), r.output_hash.clone())).collect(),
            prompt_tokens: spec.prompt_tokens,
            cached_tokens: spec.cached_tokens,
            invalid: if failed_n == 0 { v.why.clone() } else { None },
            detail: Some(detail),
        }]
    }
}

fn failed(key: String, error: String) -> RequestResult {
    let mut r = client::measure(&key, 0.0, 0, &client::StreamState::default(), Duration::ZERO);
    r.ok = false;
    r.error = Some(error);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(a: f64, b: f64) -> Span {
        Span { first_ms: a, last_ms: b }
    }

    #[test]
    fn a_window_counts_only_when_the_speculative_stream_covers_and_drains() {
        let classic = [span(100.0, 1000.0), span(110.0, 1100.0), span(100.0, 1050.0)];
        assert_eq!(classic_window(&classic), Some(span(100.0, 1100.0)));
        // Covers the whole span and more: overlap 1.
        let v = validity(&classic, Some(span(90.0, 1500.0)), true, true);
        assert!(v.valid, "{v:?}");
        assert_eq!(v.overlap, 1.0);
        // Starts 40 ms late and ends 10 ms early: 950 of 1000 ms, exactly the limit.
        let v = validity(&classic, Some(span(140.0, 1090.0)), true, true);
        assert!((v.overlap - 0.95).abs() < 1e-12 && v.valid, "{v:?}");
        // Finished early: 90% of the window.
        let v = validity(&classic, Some(span(100.0, 1000.0)), true, true);
        assert!(!v.valid);
        assert_eq!(
            v.why.as_deref(),
            Some("the speculative stream decoded through 90.0% of the window (at least 95% required)")
        );
        // Decoded entirely before the window: no overlap at all.
        assert_eq!(validity(&classic, Some(span(0.0, 50.0)), true, true).overlap, 0.0);
        // Covered, but still running when the next window was due.
        let v = validity(&classic, Some(span(90.0, 1500.0)), false, true);
        assert!(!v.drained && !v.valid);
        assert!(v.why.unwrap().contains("had not drained"));
        // Covered and drained, but decoded classically (no speculative slot).
        let v = validity(&classic, Some(span(90.0, 1500.0)), true, false);
        assert!(v.why.unwrap().contains("held no speculative slot"));
        // No speculative token, or no classic span.
        assert!(!validity(&classic, None, true, true).valid);
        let v = validity(&[span(5.0, 5.0)], Some(span(0.0, 9.0)), true, true);
        assert!(v.why.unwrap().contains("no measurable time"));
    }

    #[test]
    fn the_speculative_prompt_repeats_its_passage_and_the_budget_adapts() {
        let p = passage_prompt(10, 3);
        assert_eq!(p.len(), 25);
        assert_eq!(p[..10], p[10..20]);
        assert_eq!(p[20..], p[..5]);
        let m = Mixed::new(4, 20, 8, None, 10, 4, Duration::from_secs(1), "m".into());
        assert_eq!(m.budget(), 100, "the run's first window gets the ceiling");
        // 50 tokens over 490 ms after its first token; the classic span is 100..600 ms.
        let mut r = failed("s".into(), String::new());
        (r.start_ms, r.choice_span_ms, r.output_tokens) = (0.0, Some((110.0, 600.0)), 50);
        m.learn(Some(span(100.0, 600.0)), &r);
        // 0.1 token/ms over 500 ms, half again, plus one verify: 75 + 5.
        assert_eq!(m.budget(), 80);
        r.output_tokens = 10;
        m.learn(Some(span(100.0, 600.0)), &r);
        assert_eq!(m.budget(), 80, "learned once, for the whole run");
        let fixed = Mixed::new(4, 20, 8, Some(7), 10, 4, Duration::from_secs(1), "m".into());
        fixed.learn(Some(span(100.0, 600.0)), &r);
        assert_eq!(fixed.budget(), 7);
    }
}
