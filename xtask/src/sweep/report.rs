//! The engine's reports as typed structs, parsed strictly from a child's stdout: exactly
//! one JSON object on one line (docs/engine-protocol.md). A missing field, a wrong type or
//! an impossible value is an error; fields the protocol may grow later are ignored.

use std::collections::BTreeMap;

use anyhow::{Result, bail};
use serde::Deserialize;
use serde::de::DeserializeOwned;

/// `kiln bench-decode --format json`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct DecodeReport {
    /// MODEL as given.
    pub model: String,
    /// The resolved path, or `synthetic:<profile>`.
    pub model_path: String,
    /// Tokens in the prompt actually run.
    pub prompt_tokens: u64,
    /// Tokens decoded.
    pub generated_tokens: u64,
    /// Wall time of the prefill.
    pub prefill_ms: f64,
    /// Prefill rate.
    pub prefill_tok_s: f64,
    /// Wall time of the measured decode steps.
    pub decode_ms: f64,
    /// Measured decode rate.
    pub decode_tok_s: f64,
    /// The memory pool's peak.
    pub peak_bytes: u64,
    /// Bytes per tag at the peak.
    pub peak_breakdown: BTreeMap<String, u64>,
    /// Maximum resident set size; kiln writes null where the platform cannot say.
    pub max_rss_bytes: Option<u64>,
    /// Process start to model ready.
    pub startup_ms: f64,
    /// Process start to the first token.
    pub first_token_ms: f64,
    /// `cpu`, `cuda`, `metal`.
    pub backend: String,
    /// Worker threads.
    pub threads: u64,
    /// The engine's version.
    pub kiln_version: String,
    /// `streaming` or `naive`.
    pub attention: String,
    /// 0 = whole prompt in one forward.
    pub prefill_chunk: u64,
    /// The pool's limit.
    pub memory_limit_bytes: Option<u64>,
}

/// `kiln estimate`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct EstimateReport {
    /// MODEL as given.
    pub model: String,
    /// The resolved path, or `synthetic:<profile>`.
    pub model_path: String,
    /// Prompt tokens of the predicted run.
    pub prompt_tokens: u64,
    /// Generated tokens of the predicted run.
    pub max_tokens: u64,
    /// Weights part of the peak.
    pub weights_bytes: u64,
    /// KV-cache part of the peak.
    pub kv_bytes: u64,
    /// Scratch part of the peak.
    pub scratch_bytes: u64,
    /// Predicted peak.
    pub total_bytes: u64,
    /// The limit the run would have.
    pub memory_limit_bytes: Option<u64>,
    /// `total_bytes <= memory_limit_bytes`.
    pub fits: bool,
    /// The model's context: prompt plus generated tokens must fit.
    pub context_length: u64,
}

/// The one JSON line of `stdout`, or `None` when stdout holds nothing but whitespace.
fn the_line(stdout: &str) -> Result<Option<&str>> {
    let lines: Vec<&str> = stdout.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    match lines[..] {
        [] => Ok(None),
        [one] => Ok(Some(one)),
        _ => bail!("expected one JSON line on stdout, got {} lines", lines.len()),
    }
}

fn parse<T: DeserializeOwned>(stdout: &str) -> Result<Option<T>> {
    let Some(line) = the_line(stdout)? else { return Ok(None) };
    match serde_json::from_str(line) {
        Ok(value) => Ok(Some(value)),
        Err(e) => match key_before(line, e.column()) {
            Some(key) if e.is_data() && !e.to_string().starts_with("missing field") => {
                bail!("malformed result: field `{key}`: {e}")
            }
            _ => bail!("malformed result: {e}"),
        },
    }
}

/// The object key whose value ends at or before 1-based `column` of `line`: serde_json
/// reports a type error at the end of the offending value, so this names the field.
fn key_before(line: &str, column: usize) -> Option<&str> {
    let head = line.get(..column.min(line.len()))?;
    let colon = head.rfind("\":")?;
    let start = head[..colon].rfind('"')? + 1;
    Some(&head[start..colon])
}

impl DecodeReport {
    /// Parses a `bench-decode` stdout; `Ok(None)` when it printed nothing.
    pub fn parse(stdout: &str) -> Result<Option<DecodeReport>> {
        let Some(r) = parse::<DecodeReport>(stdout)? else { return Ok(None) };
        for (name, v) in [
            ("prefill_ms", r.prefill_ms),
            ("prefill_tok_s", r.prefill_tok_s),
            ("decode_ms", r.decode_ms),
            ("decode_tok_s", r.decode_tok_s),
            ("startup_ms", r.startup_ms),
            ("first_token_ms", r.first_token_ms),
        ] {
            if !v.is_finite() || v < 0.0 {
                bail!("{name} is {v}: expected a finite non-negative number");
            }
        }
        Ok(Some(r))
    }
}

impl EstimateReport {
    /// Parses an `estimate` stdout; `Ok(None)` when it printed nothing.
    pub fn parse(stdout: &str) -> Result<Option<EstimateReport>> {
        let Some(r) = parse::<EstimateReport>(stdout)? else { return Ok(None) };
        let parts = r.weights_bytes.checked_add(r.kv_bytes).and_then(|s| s.checked_add(r.scratch_bytes));
        if parts.is_none_or(|p| p > r.total_bytes) {
            bail!(
                "total_bytes {} is below weights {} + kv {} + scratch {}",
                r.total_bytes,
                r.weights_bytes,
                r.kv_bytes,
                r.scratch_bytes
            );
        }
        Ok(Some(r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DECODE: &str = r#"{"model":"synthetic:tiny","model_path":"synthetic:tiny","prompt_tokens":512,"generated_tokens":16,"prefill_ms":120.5,"prefill_tok_s":4249.0,"decode_ms":40.0,"decode_tok_s":400.0,"peak_bytes":1000,"peak_breakdown":{"weights":600,"kv":300,"scratch":100,"other":0},"max_rss_bytes":5000,"startup_ms":3.0,"first_token_ms":130.0,"backend":"cpu","threads":2,"kiln_version":"0.1.0","attention":"streaming","prefill_chunk":0,"memory_limit_bytes":null,"later_field":1}"#;

    #[test]
    fn a_decode_report_parses() {
        let r = DecodeReport::parse(&format!("\n{DECODE}\n")).unwrap().unwrap();
        assert_eq!(r.prompt_tokens, 512);
        assert_eq!(r.memory_limit_bytes, None);
        assert_eq!(r.peak_breakdown["kv"], 300);
        assert_eq!(DecodeReport::parse("  \n").unwrap(), None);
    }

    #[test]
    fn malformed_decode_reports_are_errors() {
        let wrong_type = DECODE.replace("\"prompt_tokens\":512", "\"prompt_tokens\":\"512\"");
        let e = DecodeReport::parse(&wrong_type).unwrap_err().to_string();
        assert!(e.starts_with("malformed result: field `prompt_tokens`: invalid type: string"), "{e}");
        let nested = DECODE.replace("\"kv\":300", "\"kv\":-300");
        let e = DecodeReport::parse(&nested).unwrap_err().to_string();
        assert!(e.contains("field `kv`"), "{e}");
        let missing = DECODE.replace("\"decode_tok_s\":400.0,", "");
        let e = DecodeReport::parse(&missing).unwrap_err().to_string();
        assert!(e.starts_with("malformed result: missing field `decode_tok_s`"), "{e}");
        let negative = DECODE.replace("\"decode_ms\":40.0", "\"decode_ms\":-1.0");
        assert!(DecodeReport::parse(&negative).unwrap_err().to_string().contains("decode_ms"));
        assert!(DecodeReport::parse(&format!("{DECODE}\n{DECODE}")).is_err());
        assert!(DecodeReport::parse("{\"model\":").is_err());
        assert!(DecodeReport::parse("model,prompt_tokens\nx,1").is_err());
    }

    #[test]
    fn an_estimate_parses_and_checks_its_sum() {
        let ok = r#"{"model":"m","model_path":"m","prompt_tokens":1,"max_tokens":2,"weights_bytes":1,"kv_bytes":2,"scratch_bytes":3,"total_bytes":6,"memory_limit_bytes":10,"fits":true,"context_length":4096,"attention":"streaming","prefill_chunk":0}"#;
        let r = EstimateReport::parse(ok).unwrap().unwrap();
        assert!(r.fits);
        assert_eq!(r.memory_limit_bytes, Some(10));
        let bad = ok.replace("\"total_bytes\":6", "\"total_bytes\":5");
        assert!(EstimateReport::parse(&bad).unwrap_err().to_string().contains("total_bytes 5"));
        let neg = ok.replace("\"kv_bytes\":2", "\"kv_bytes\":-2");
        assert!(EstimateReport::parse(&neg).is_err());
    }
}
