//! What a serve-bench run writes: the per-level summary derived from its requests, the
//! per-request JSON lines and per-level CSV (both appended and flushed as each level
//! ends), the markdown table and the SVG plot.

use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;

use super::client::{RequestResult, TokensFrom};
use super::stats::Summary;
use crate::plot::{Axis, Panel, Series};

/// One level's results.
#[derive(Clone, Debug, Serialize)]
pub struct LevelSummary {
    /// `c=4` or `rate=2`.
    pub level: String,
    /// Closed-loop concurrency.
    pub concurrency: Option<usize>,
    /// Open-loop rate, requests per second.
    pub rate: Option<f64>,
    /// Measured requests (warm-up excluded).
    pub requests: usize,
    /// Completed.
    pub ok: usize,
    /// Failed.
    pub failed: usize,
    /// Completed on counted deltas because usage was malformed.
    pub bad_usage: usize,
    /// From the first send to the last completion, seconds.
    pub wall_s: f64,
    /// Output tokens of completed requests.
    pub output_tokens: u64,
    /// Output tokens per second of wall time.
    pub output_tok_s: f64,
    /// Completed requests per second of wall time.
    pub req_s: f64,
    /// Time to first token, ms.
    pub ttft: Summary,
    /// Time per output token after the first, ms.
    pub tpot: Summary,
    /// Every inter-token latency, ms.
    pub itl: Summary,
    /// End to end, ms.
    pub e2e: Summary,
    /// The client's own CPU seconds over the measured requests.
    pub client_cpu_s: f64,
    /// The server's CPU seconds over them, when the harness booted it.
    pub server_cpu_s: Option<f64>,
    /// The prompt length asked for (`--prompt-tokens`), when the caller says.
    pub prompt_tokens_asked: Option<u64>,
    /// The mean `usage.prompt_tokens` the server counted over completed requests.
    pub prompt_tokens_served: Option<f64>,
    /// The server's structured-output mask time per mask, microseconds, over completed
    /// requests that report it (`usage.structured`, kiln's extension).
    pub mask_us: Option<f64>,
    /// Empty when the machine was quiet while the level's requests ran; else what else
    /// was running (other processes' CPU over the busy limit).
    pub disturbed: String,
}

impl LevelSummary {
    /// Summarises `results` measured over `wall_s`.
    pub fn of(
        level: String,
        concurrency: Option<usize>,
        rate: Option<f64>,
        results: &[RequestResult],
        wall_s: f64,
    ) -> Self {
        let ok: Vec<&RequestResult> = results.iter().filter(|r| r.ok).collect();
        let output_tokens: u64 = ok.iter().map(|r| r.output_tokens).sum();
        let per_s = |x: f64| if wall_s > 0.0 { x / wall_s } else { 0.0 };
        LevelSummary {
            level,
            concurrency,
            rate,
            requests: results.len(),
            ok: ok.len(),
            failed: results.len() - ok.len(),
            bad_usage: ok
                .iter()
                .filter(|r| r.usage_problem.is_some() && r.tokens_from == TokensFrom::Deltas)
                .count(),
            wall_s,
            output_tokens,
            output_tok_s: per_s(output_tokens as f64),
            req_s: per_s(ok.len() as f64),
            ttft: Summary::of(ok.iter().filter_map(|r| r.ttft_ms)),
            tpot: Summary::of(ok.iter().filter_map(|r| r.tpot_ms)),
            itl: Summary::of(ok.iter().flat_map(|r| r.itl_ms.iter().copied())),
            e2e: Summary::of(ok.iter().filter_map(|r| r.e2e_ms)),
            client_cpu_s: 0.0,
            server_cpu_s: None,
            prompt_tokens_asked: None,
            prompt_tokens_served: {
                let counted: Vec<u64> = ok.iter().filter_map(|r| r.prompt_tokens).collect();
                (!counted.is_empty()).then(|| counted.iter().sum::<u64>() as f64 / counted.len() as f64)
            },
            mask_us: {
                let (masks, mask_ms) = ok
                    .iter()
                    .filter_map(|r| r.masks.zip(r.mask_ms))
                    .fold((0u64, 0f64), |(n, t), (m, ms)| (n + m, t + ms));
                (masks > 0).then(|| 1e3 * mask_ms / masks as f64)
            },
            disturbed: String::new(),
        }
    }

    /// Whether the server counted this level's prompts more than 5% off the asked length.
    pub fn prompt_off(&self) -> bool {
        matches!((self.prompt_tokens_asked, self.prompt_tokens_served), (Some(a), Some(s)) if super::calibrate::off(a, s))
    }

    /// The x of this level on a plot: its concurrency or its rate.
    pub fn x(&self) -> f64 {
        self.concurrency.map_or(self.rate.unwrap_or(0.0), |c| c as f64)
    }
}

/// The CSV header; [`csv_record`] follows it.
pub fn csv_header() -> Vec<String> {
    let mut h: Vec<String> = [
        "level",
        "concurrency",
        "rate",
        "requests",
        "ok",
        "failed",
        "bad_usage",
        "wall_s",
        "output_tokens",
        "output_tok_s",
        "req_s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for m in ["ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"] {
        for s in ["mean", "p50", "p90", "p95", "p99"] {
            h.push(format!("{m}_{s}"));
        }
    }
    h.extend(["client_cpu_s".to_string(), "server_cpu_s".to_string()]);
    h.extend(["prompt_tokens_asked".to_string(), "prompt_tokens_served".to_string()]);
    h.push("mask_us".to_string());
    h.push("disturbed".to_string());
    h
}

fn num(v: Option<f64>) -> String {
    v.map_or_else(String::new, |x| format!("{x:.3}"))
}

/// One CSV record.
pub fn csv_record(l: &LevelSummary) -> Vec<String> {
    let mut r = vec![
        l.level.clone(),
        l.concurrency.map_or_else(String::new, |c| c.to_string()),
        num(l.rate),
        l.requests.to_string(),
        l.ok.to_string(),
        l.failed.to_string(),
        l.bad_usage.to_string(),
        format!("{:.3}", l.wall_s),
        l.output_tokens.to_string(),
        format!("{:.3}", l.output_tok_s),
        format!("{:.3}", l.req_s),
    ];
    for s in [&l.ttft, &l.tpot, &l.itl, &l.e2e] {
        r.extend(s.columns().into_iter().map(num));
    }
    r.push(format!("{:.3}", l.client_cpu_s));
    r.push(num(l.server_cpu_s));
    r.push(l.prompt_tokens_asked.map_or_else(String::new, |a| a.to_string()));
    r.push(num(l.prompt_tokens_served));
    r.push(num(l.mask_us));
    r.push(l.disturbed.clone());
    r
}

/// The run's files, opened before the first level.
pub struct Files {
    jsonl: BufWriter<File>,
    csv: csv::Writer<File>,
}

impl Files {
    /// Creates `requests.jsonl` and `levels.csv` in `dir`.
    pub fn create(dir: &Path) -> Result<Files> {
        let p = dir.join("requests.jsonl");
        let jsonl = OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(&p)
            .with_context(|| format!("creating {}", p.display()))?;
        let p = dir.join("levels.csv");
        let mut csv = csv::Writer::from_path(&p).with_context(|| format!("creating {}", p.display()))?;
        csv.write_record(csv_header())?;
        csv.flush()?;
        Ok(Files { jsonl: BufWriter::new(jsonl), csv })
    }

    /// Appends one request's line, tagged with its level and whether it was warm-up.
    pub fn request(&mut self, level: &str, warmup: bool, r: &RequestResult) -> Result<()> {
        let mut v = serde_json::to_value(r)?;
        v["level"] = level.into();
        v["warmup"] = warmup.into();
        writeln!(self.jsonl, "{v}")?;
        Ok(())
    }

    /// Flushes the request lines written so far.
    pub fn flush(&mut self) -> Result<()> {
        self.jsonl.flush().context("writing requests.jsonl")
    }

    /// Appends a level's row and flushes both files.
    pub fn level(&mut self, l: &LevelSummary) -> Result<()> {
        self.jsonl.flush()?;
        self.csv.write_record(csv_record(l))?;
        self.csv.flush()?;
        Ok(())
    }
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| if x >= 100.0 { format!("{x:.0}") } else { format!("{x:.1}") })
}

/// Below this many values a percentile is read off the largest few, not estimated: its
/// cell says how many values it rests on.
pub const FEW_FOR_A_PERCENTILE: usize = 100;

/// `p50 / p99` of one latency; a p99 of fewer than [`FEW_FOR_A_PERCENTILE`] values says
/// how many (`812 / 1290 (p99 of 8)`), since it is then about the largest of them.
fn p50_p99(s: &Summary) -> String {
    let few =
        if s.n > 0 && s.n < FEW_FOR_A_PERCENTILE { format!(" (p99 of {})", s.n) } else { String::new() };
    format!("{} / {}{few}", ms(s.median), ms(s.p99))
}

/// The markdown table: one row per level.
pub fn markdown(levels: &[LevelSummary]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| level | ok | failed | output tok/s | req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | E2E p50 / p99 ms | client CPU | prompt tok asked / counted | machine |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for l in levels {
        let cpu = match l.server_cpu_s {
            Some(srv) if srv > 0.0 => {
                format!("{:.2} s ({:.1}% of server)", l.client_cpu_s, 100.0 * l.client_cpu_s / srv)
            }
            _ => format!("{:.2} s", l.client_cpu_s),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.1} | {:.2} | {} | {} | {} | {} | {} | {} | {} |",
            l.level,
            l.ok,
            l.failed,
            l.output_tok_s,
            l.req_s,
            p50_p99(&l.ttft),
            p50_p99(&l.tpot),
            p50_p99(&l.itl),
            p50_p99(&l.e2e),
            cpu,
            prompt_cell(l),
            if l.disturbed.is_empty() { "quiet" } else { "disturbed" }
        );
    }
    let few: Vec<String> = levels
        .iter()
        .filter(|l| l.ttft.n > 0 && l.ttft.n < FEW_FOR_A_PERCENTILE)
        .map(|l| format!("{} on {}", l.level, l.ttft.n))
        .collect();
    if !few.is_empty() {
        let _ = writeln!(
            s,
            "\nrequests per percentile: {}. A p99 of fewer than {FEW_FOR_A_PERCENTILE} values is about the largest of them (interpolated between the two largest), not an estimate of the tail: run more --requests for one",
            few.join(", ")
        );
    }
    let busy: Vec<String> = levels
        .iter()
        .filter(|l| !l.disturbed.is_empty())
        .map(|l| format!("{} ({})", l.level, l.disturbed))
        .collect();
    if !busy.is_empty() {
        let _ = writeln!(
            s,
            "\ndisturbed: the machine was busy while these levels ran, so their figures may be another load's too: {}",
            busy.join("; ")
        );
    }
    let off: Vec<String> = levels
        .iter()
        .filter(|l| l.prompt_off())
        .map(|l| format!("{} ({})", l.level, prompt_cell(l).trim_end_matches(" !")))
        .collect();
    if !off.is_empty() {
        let _ = writeln!(
            s,
            "\n! the server counted prompts more than 5% off the asked length at {}: its tokenizer is not the one the prompts were sized for",
            off.join(", ")
        );
    }
    let masked: Vec<String> =
        levels.iter().filter_map(|l| l.mask_us.map(|us| format!("{} {us:.1} us", l.level))).collect();
    if !masked.is_empty() {
        let _ = writeln!(
            s,
            "\nstructured-output mask per token, the server's time (usage.structured): {}",
            masked.join(", ")
        );
    }
    s
}

fn prompt_cell(l: &LevelSummary) -> String {
    let served = l.prompt_tokens_served.map_or_else(
        || "-".to_string(),
        |v| if v.fract() == 0.0 { format!("{v:.0}") } else { format!("{v:.1}") },
    );
    let asked = l.prompt_tokens_asked.map_or_else(|| "-".to_string(), |a| a.to_string());
    format!("{asked} / {served}{}", if l.prompt_off() { " !" } else { "" })
}

/// The plot: one panel per latency (TTFT, TPOT, ITL, E2E: p50 and p99, ms) and one of
/// throughput, against the level. Concurrency levels sit on a log axis labelled at the
/// levels that ran; a rate on a linear one.
pub fn panels(levels: &[LevelSummary], open_loop: bool) -> Vec<Panel> {
    let x = || if open_loop { Axis::linear("request rate (req/s)") } else { Axis::log("concurrent streams") };
    let line = |name: &str, f: &dyn Fn(&LevelSummary) -> Option<f64>| {
        Series::line(name, levels.iter().filter_map(|l| Some((l.x(), f(l)?))).collect())
    };
    let latency = |metric: &str,
                   p50: &dyn Fn(&LevelSummary) -> Option<f64>,
                   p99: &dyn Fn(&LevelSummary) -> Option<f64>| {
        Panel {
            series: vec![line(&format!("{metric} p50"), p50), line(&format!("{metric} p99"), p99)],
            split_when_spread: true,
            ..Panel::new(metric, x(), Axis::from_zero(format!("{metric} (ms)")))
        }
    };
    vec![
        latency("TTFT", &|l| l.ttft.median, &|l| l.ttft.p99),
        latency("TPOT", &|l| l.tpot.median, &|l| l.tpot.p99),
        latency("ITL", &|l| l.itl.median, &|l| l.itl.p99),
        latency("E2E", &|l| l.e2e.median, &|l| l.e2e.p99),
        Panel {
            series: vec![line("output tok/s", &|l| Some(l.output_tok_s))],
            ..Panel::new("throughput", x(), Axis::from_zero("output (tok/s)"))
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ok: bool, ttft: f64, tokens: u64) -> RequestResult {
        RequestResult {
            key: "k".into(),
            start_ms: 0.0,
            ok,
            error: (!ok).then(|| "boom".into()),
            http_status: Some(200),
            ttft_ms: Some(ttft),
            tpot_ms: Some(2.0),
            e2e_ms: Some(ttft + 10.0),
            itl_ms: vec![1.0, 3.0],
            choice_span_ms: None,
            output_tokens: tokens,
            tokens_from: TokensFrom::Usage,
            deltas: tokens,
            usage_problem: None,
            prompt_tokens: None,
            cached_tokens: None,
            spec_drafted: None,
            spec_accepted: None,
            masks: None,
            mask_ms: None,
            output_hash: String::new(),
        }
    }

    #[test]
    fn the_mask_time_is_per_mask_over_the_requests_that_report_it() {
        let masked = |masks: u64, ms: f64| RequestResult {
            masks: Some(masks),
            mask_ms: Some(ms),
            ..req(true, 10.0, 4)
        };
        let failed = RequestResult { masks: Some(1), mask_ms: Some(100.0), ..req(false, 10.0, 4) };
        let l = LevelSummary::of("c=2".into(), Some(2), None, &[masked(4, 1.0), masked(6, 4.0), failed], 1.0);
        // 5 ms over 10 masks; the failed request does not count.
        assert_eq!(l.mask_us, Some(500.0));
        assert!(
            markdown(std::slice::from_ref(&l))
                .contains("mask per token, the server's time (usage.structured): c=2 500.0 us")
        );
        let plain = LevelSummary::of("c=1".into(), Some(1), None, &[req(true, 10.0, 4)], 1.0);
        assert_eq!(plain.mask_us, None);
        assert!(!markdown(std::slice::from_ref(&plain)).contains("mask per token"));
        let at = csv_header().iter().position(|h| h == "mask_us").unwrap();
        assert_eq!(csv_record(&plain)[at], "");
        assert_eq!(csv_record(&l)[at], "500.000");
    }

    #[test]
    fn a_level_counts_failures_and_summarises_only_completed_requests() {
        let rs = [req(true, 10.0, 4), req(true, 30.0, 6), req(false, 1000.0, 9)];
        let l = LevelSummary::of("c=2".into(), Some(2), None, &rs, 2.0);
        assert_eq!((l.requests, l.ok, l.failed, l.output_tokens), (3, 2, 1, 10));
        assert_eq!((l.output_tok_s, l.req_s), (5.0, 1.0));
        assert_eq!(l.ttft.mean, Some(20.0));
        assert_eq!(l.itl.n, 4);
        assert_eq!(csv_record(&l).len(), csv_header().len());
        let md = markdown(&[l]);
        // Two requests: the p99 says what it rests on.
        assert!(md.contains("| c=2 | 2 | 1 | 5.0 | 1.00 | 20.0 / 29.8 (p99 of 2) |"), "{md}");
    }

    /// Levels from docs/benchmark_results/serve-streams-epyc-avx2-2vcpu-2026-11-30.md:
    /// streams, mean TTFT (s), mean step (ms), aggregate tok/s; p99s set above them.
    fn recorded_levels() -> Vec<LevelSummary> {
        [(1, 3.4, 93.6, 10.76), (2, 5.8, 244.5, 8.18), (4, 10.0, 320.6, 12.48), (8, 20.1, 516.6, 15.43)]
            .iter()
            .map(|&(c, ttft_s, step_ms, tok_s)| {
                let sum = |median: f64, p99: f64| Summary {
                    n: 32,
                    mean: Some(median),
                    median: Some(median),
                    p90: Some(p99 * 0.9),
                    p95: Some(p99 * 0.95),
                    p99: Some(p99),
                };
                let mut l = LevelSummary::of(format!("c={c}"), Some(c), None, &[], 10.0);
                l.ttft = sum(ttft_s * 1e3, ttft_s * 1.4e3);
                l.tpot = sum(step_ms, step_ms * 1.2);
                l.itl = sum(step_ms, step_ms * 14.0);
                l.e2e = sum(ttft_s * 1e3 + 63.0 * step_ms, (ttft_s * 1e3 + 63.0 * step_ms) * 1.3);
                l.output_tok_s = tok_s;
                l
            })
            .collect()
    }

    #[test]
    fn the_levels_plot_labels_the_levels_that_ran_and_splits_far_apart_percentiles() {
        let l = crate::plot::raster::check("serve-bench", &panels(&recorded_levels(), false));
        for p in &l.panels {
            let ticks: Vec<&str> = p.x_ticks.iter().map(|t| t.label.as_str()).collect();
            assert_eq!(ticks, ["1", "2", "4", "8"], "{}", p.title);
        }
        let titles: Vec<&str> = l.panels.iter().map(|p| p.title.as_str()).collect();
        // ITL's p99 is 14x its median: a panel each; the others share theirs.
        assert_eq!(titles, ["TTFT", "TPOT", "ITL: ITL p50", "ITL: ITL p99", "E2E", "throughput"]);
        // An open-loop run has one rate: a linear axis around it.
        let mut one = recorded_levels();
        one.truncate(1);
        (one[0].concurrency, one[0].rate) = (None, Some(2.0));
        let l = crate::plot::raster::check("serve-bench-rate", &panels(&one, true));
        assert!(l.panels[0].x_ticks.iter().any(|t| t.value == 2.0), "{:?}", l.panels[0].x_ticks);
    }

    #[test]
    fn asked_and_counted_prompt_tokens_are_shown_and_a_mismatch_flagged() {
        let counted = |n: u64| RequestResult { prompt_tokens: Some(n), ..req(true, 10.0, 4) };
        let mut exact = LevelSummary::of("c=1".into(), Some(1), None, &[counted(32), counted(32)], 1.0);
        exact.prompt_tokens_asked = Some(32);
        let mut off = LevelSummary::of("c=2".into(), Some(2), None, &[counted(196), counted(197)], 1.0);
        off.prompt_tokens_asked = Some(32);
        let md = markdown(&[exact.clone(), off]);
        assert!(md.contains("| 32 / 32 | quiet |\n"), "{md}");
        assert!(md.contains("| 32 / 196.5 ! | quiet |\n"), "{md}");
        assert!(md.contains("more than 5% off the asked length at c=2 (32 / 196.5):"), "{md}");
        assert!(!markdown(&[exact]).contains("5% off"));
    }
}
