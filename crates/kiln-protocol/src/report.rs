//! The two reports, as the engine writes them and the harness reads them: exactly one
//! JSON object on one line of stdout, or (`--format csv`) a header line and one row of the
//! scalar fields. Reading is strict: a missing protocol field, a wrong type or an
//! impossible value is an error naming the field; fields an engine adds later are ignored.

use std::collections::BTreeMap;
use std::io::{self, Write};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Why a report could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Stdout held more than one non-empty line.
    #[error("expected one JSON line on stdout, got {0} lines")]
    Lines(usize),
    /// The line is not the report's JSON; `field` names the offending field when known.
    #[error("malformed result: {}{source}", field.as_ref().map(|f| format!("field `{f}`: ")).unwrap_or_default())]
    Json {
        /// The field whose value is wrong.
        field: Option<String>,
        /// serde_json's account.
        source: serde_json::Error,
    },
    /// A value of the right type that cannot be true.
    #[error("{field} is {value}: {expected}")]
    Impossible {
        /// The field.
        field: &'static str,
        /// Its value, as text.
        value: String,
        /// What would be accepted.
        expected: String,
    },
}

/// `kiln bench-decode --format json`: the protocol's fields, then kiln's additions
/// (optional when reading, so any engine that speaks the protocol is understood).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecodeReport {
    /// MODEL as given.
    pub model: String,
    /// The resolved path, or `synthetic:<profile>`.
    pub model_path: String,
    /// Tokens in the prompt actually run.
    pub prompt_tokens: u64,
    /// Tokens decoded (EOS does not stop a measurement).
    pub generated_tokens: u64,
    /// Wall time of the prefill.
    pub prefill_ms: f64,
    /// `prompt_tokens / prefill seconds`.
    pub prefill_tok_s: f64,
    /// Wall time of the measured decode steps (after the warm-up).
    pub decode_ms: f64,
    /// Measured decode tokens per second.
    pub decode_tok_s: f64,
    /// The memory pool's peak.
    pub peak_bytes: u64,
    /// Maximum resident set size; null where the platform cannot say.
    pub max_rss_bytes: Option<u64>,
    /// Process start to model ready.
    pub startup_ms: f64,
    /// Process start to the first token out of the prefill.
    pub first_token_ms: f64,
    /// `cpu`, `cuda`, `metal`.
    pub backend: String,
    /// Worker threads.
    pub threads: u64,
    /// The engine's version.
    pub kiln_version: String,
    /// `streaming` or `naive`.
    pub attention: String,
    /// 0 = the whole prompt in one forward.
    pub prefill_chunk: u64,
    /// The pool's limit; null when unlimited.
    pub memory_limit_bytes: Option<u64>,
    /// kiln: tokens asked for.
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// kiln: decode steps before the timed ones.
    #[serde(default)]
    pub warmup_tokens: Option<u64>,
    /// kiln: timed decode steps.
    #[serde(default)]
    pub decode_steps: Option<u64>,
    /// kiln: `f16` or `f32`.
    #[serde(default)]
    pub kv_dtype: Option<String>,
    /// kiln: whether the wide quantized kernels ran.
    #[serde(default)]
    pub qmv_wide: Option<bool>,
    /// kiln: bytes of weights loaded.
    #[serde(default)]
    pub weights_bytes: Option<u64>,
    /// kiln: what `kiln estimate` predicts for this run.
    #[serde(default)]
    pub estimated_peak_bytes: Option<u64>,
    /// kiln: weight bytes one decode step reads.
    #[serde(default)]
    pub bytes_read_per_token: Option<u64>,
    /// kiln (`--measure-bandwidth`): the best read bandwidth measured.
    #[serde(default)]
    pub read_bandwidth_bytes_per_s: Option<f64>,
    /// kiln (`--measure-bandwidth`): time the probe took, outside the clock.
    #[serde(default)]
    pub bandwidth_probe_ms: Option<f64>,
    /// kiln (`--measure-bandwidth`): decode's share of that bandwidth.
    #[serde(default)]
    pub decode_bandwidth_share: Option<f64>,
    /// kiln (`--speculative`): the drafter. The `spec_*` fields are present only in a
    /// speculative run, so other records keep exactly [`DECODE_FIELDS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_drafter: Option<String>,
    /// kiln (`--speculative`): draft tokens per verify (K).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_draft_tokens: Option<u64>,
    /// kiln (`--speculative`): the exactness gate's outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_gate: Option<String>,
    /// kiln (`--speculative`): tokens drafted over the whole run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_drafted: Option<u64>,
    /// kiln (`--speculative`): drafted tokens accepted over the whole run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_accepted: Option<u64>,
    /// kiln (`--speculative`): `spec_accepted / spec_drafted`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_acceptance: Option<f64>,
    /// kiln (`--speculative`): verify forwards run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_verifies: Option<u64>,
    /// kiln (`--expert-slots`): resident expert slots. The `expert_*` fields are present
    /// only in a run with an expert cache, so other records keep exactly [`DECODE_FIELDS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_slots: Option<u64>,
    /// kiln (`--expert-slots`): bytes of all slots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_cache_bytes: Option<u64>,
    /// kiln (`--expert-slots`): expert lookups that found the expert resident (timed steps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_hits: Option<u64>,
    /// kiln (`--expert-slots`): lookups that copied the expert in (timed steps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_misses: Option<u64>,
    /// kiln (`--expert-slots`): bytes those misses copied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_bytes_copied: Option<u64>,
    /// kiln (`--expert-slots`): time those copies took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_copy_ms: Option<f64>,
    /// kiln: the batch sizes M that run `qmv_wide` (`2-15`, `3,5-15`, `none`), as the
    /// wide switch, its pin and the measured crossover decide together. JSON only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qmv_wide_rows: Option<String>,
    /// kiln: the activation scheme the products ran (`KILN_ACT_PRECISION`, or the
    /// backend's own: `int16` on the CPU, `f16` on a GPU). JSON only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub act_scheme: Option<crate::ActScheme>,
    /// Per tag (`weights`, `kv`, `scratch`, `experts`, `other`): bytes held at the peak.
    /// JSON only.
    pub peak_breakdown: BTreeMap<String, u64>,
    /// kiln (`--measure-roofs`): the machine's roofs measured beside the run and the run's
    /// shares of them. JSON only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub roofs: Option<RoofsReport>,
}

/// `kiln bench-decode --measure-roofs`: the compute roofs and the read bandwidth measured
/// in the same process before the model loads, prefill's share of the compute roof and
/// decode's share of the bandwidth roof. Operations count a multiply-accumulate as two.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoofsReport {
    /// The compute roof the prefill is held to: the highest int8 probe for quantized
    /// weights (`int8_avx512_vnni`), the highest f32 probe for unquantized ones.
    pub compute_roof: String,
    /// Its operations per second, all the run's threads at once.
    pub compute_roof_ops_per_s: f64,
    /// Every probe measured, operations per second by name.
    pub compute_probes: BTreeMap<String, f64>,
    /// Time the compute probes took, outside the clock.
    pub compute_probe_ms: f64,
    /// The best read bandwidth of the same process, bytes per second.
    pub read_bandwidth_bytes_per_s: f64,
    /// Operations of the prefill: its layer products (2 * n * k per product and prompt
    /// token), the LM head's one row, and causal attention's two products.
    pub prefill_ops: f64,
    /// The attention part of `prefill_ops`.
    pub prefill_attention_ops: f64,
    /// Weight bytes the prefill reads (each matrix once).
    pub prefill_bytes: f64,
    /// `prefill_ops` over the prefill's time.
    pub prefill_ops_per_s: f64,
    /// `prefill_ops_per_s / compute_roof_ops_per_s`.
    pub prefill_compute_share: f64,
    /// Operations of one decode step's layer products and LM head (attention not counted).
    pub decode_ops_per_token: f64,
    /// Weight bytes one decode step reads ([`DecodeReport::bytes_read_per_token`]).
    pub decode_bytes_per_token: f64,
    /// Decode tokens per second times `decode_bytes_per_token`, over the read bandwidth.
    pub decode_bandwidth_share: f64,
}

/// The scalar fields of [`DecodeReport`] in output order: the protocol's first (the
/// first [`DecodeReport::PROTOCOL_FIELDS`]), then kiln's. The CSV form has exactly these
/// columns; the JSON form has these and `peak_breakdown`.
pub const DECODE_FIELDS: [&str; 29] = [
    "model",
    "model_path",
    "prompt_tokens",
    "generated_tokens",
    "prefill_ms",
    "prefill_tok_s",
    "decode_ms",
    "decode_tok_s",
    "peak_bytes",
    "max_rss_bytes",
    "startup_ms",
    "first_token_ms",
    "backend",
    "threads",
    "kiln_version",
    "attention",
    "prefill_chunk",
    "memory_limit_bytes",
    "max_tokens",
    "warmup_tokens",
    "decode_steps",
    "kv_dtype",
    "qmv_wide",
    "weights_bytes",
    "estimated_peak_bytes",
    "bytes_read_per_token",
    "read_bandwidth_bytes_per_s",
    "bandwidth_probe_ms",
    "decode_bandwidth_share",
];

/// The columns a speculative run adds after [`DECODE_FIELDS`] (`kiln bench-decode
/// --speculative`).
pub const SPEC_FIELDS: [&str; 7] = [
    "spec_drafter",
    "spec_draft_tokens",
    "spec_gate",
    "spec_drafted",
    "spec_accepted",
    "spec_acceptance",
    "spec_verifies",
];

/// The columns a run with an expert cache adds (`kiln bench-decode --expert-slots`),
/// after [`SPEC_FIELDS`] when both apply.
pub const EXPERT_FIELDS: [&str; 6] = [
    "expert_slots",
    "expert_cache_bytes",
    "expert_hits",
    "expert_misses",
    "expert_bytes_copied",
    "expert_copy_ms",
];

impl DecodeReport {
    /// How many of [`DECODE_FIELDS`] the protocol requires (the rest are kiln's).
    pub const PROTOCOL_FIELDS: usize = 18;

    /// Parses a `bench-decode` stdout; `Ok(None)` when it printed nothing.
    pub fn parse(stdout: &str) -> Result<Option<DecodeReport>, ReportError> {
        let Some(r) = parse::<DecodeReport>(stdout)? else { return Ok(None) };
        for (field, v) in [
            ("prefill_ms", r.prefill_ms),
            ("prefill_tok_s", r.prefill_tok_s),
            ("decode_ms", r.decode_ms),
            ("decode_tok_s", r.decode_tok_s),
            ("startup_ms", r.startup_ms),
            ("first_token_ms", r.first_token_ms),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(ReportError::Impossible {
                    field,
                    value: v.to_string(),
                    expected: "expected a finite non-negative number".into(),
                });
            }
        }
        Ok(Some(r))
    }

    /// Writes the JSON form: one object on one line.
    pub fn write_json(&self, out: impl Write) -> io::Result<()> {
        write_json(self, out)
    }

    /// Writes the CSV form: the header of [`DECODE_FIELDS`] (then [`SPEC_FIELDS`] for a
    /// speculative run, [`EXPERT_FIELDS`] for a run with an expert cache) and one row.
    pub fn write_csv(&self, out: impl Write) -> io::Result<()> {
        let mut fields: Vec<&str> = DECODE_FIELDS.to_vec();
        if self.spec_drafter.is_some() {
            fields.extend(SPEC_FIELDS);
        }
        if self.expert_slots.is_some() {
            fields.extend(EXPERT_FIELDS);
        }
        write_csv(self, &fields, out)
    }
}

/// `kiln estimate`: the protocol's fields, then kiln's additions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EstimateReport {
    /// MODEL as given.
    pub model: String,
    /// The resolved path, or `synthetic:<profile>`: where the engine found the model.
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
    /// The limit the run would have; null when unlimited.
    pub memory_limit_bytes: Option<u64>,
    /// `total_bytes <= memory_limit_bytes`.
    pub fits: bool,
    /// The model's context: prompt plus generated tokens must fit.
    pub context_length: u64,
    /// `streaming` or `naive`.
    pub attention: String,
    /// 0 = the whole prompt in one forward.
    pub prefill_chunk: u64,
    /// Whether prompt plus generated tokens fit the context: the engine's rule, which the
    /// harness follows instead of repeating it.
    pub within_context: bool,
    /// kiln: `f16` or `f32`.
    #[serde(default)]
    pub kv_dtype: Option<String>,
    /// kiln: the forward pass's workspace.
    #[serde(default)]
    pub workspace_bytes: Option<u64>,
    /// kiln: the naive attention's score matrix (0 when streaming).
    #[serde(default)]
    pub attention_scores_bytes: Option<u64>,
    /// kiln (`--expert-slots`): resident expert slots; present only with a cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_slots: Option<u64>,
    /// kiln (`--expert-slots`): bytes of the slots, part of `total_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts_bytes: Option<u64>,
    /// kiln, a MoE model only: decoder layers, each with `moe_experts` routed experts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_layers: Option<u64>,
    /// kiln, a MoE model only: routed experts per layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_experts: Option<u64>,
    /// kiln, a MoE model only: experts each token routes to (the cache's floor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_top_k: Option<u64>,
    /// kiln, a MoE model only: bytes of one expert-cache slot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_slot_bytes: Option<u64>,
    /// kiln, `--backend vulkan|metal` only: the adapter the run would take, whose memory
    /// (or the memory limit, when smaller) is `memory_limit_bytes`. Not a CSV column.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<DeviceDesc>,
}

/// A device as its driver names it: what `kiln estimate --backend vulkan|metal` prices a
/// run against, and what the harness records as the rows' device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceDesc {
    /// The adapter's name (`llvmpipe (LLVM 15.0.6, 256 bits)`, `Apple M1 Ultra`, ...).
    pub name: String,
    /// The backend that drives it (`vulkan`, `metal`).
    pub backend: String,
    /// The driver's name (`llvmpipe`, `NVIDIA`, ...), empty when the driver gives none.
    pub driver: String,
    /// The driver's version text (`Mesa 22.3.6 (LLVM 15.0.6)`, ...).
    pub driver_info: String,
    /// The kind of device (`DiscreteGpu`, `IntegratedGpu`, `Cpu`, ...).
    pub device_type: String,
    /// The device's memory in bytes: Vulkan's largest device-local heap, Metal's
    /// recommended working set, else the adapter's largest buffer.
    pub memory_bytes: u64,
    /// Which of those `memory_bytes` is.
    pub memory_source: String,
}

/// The columns an estimate with an expert cache adds after [`ESTIMATE_FIELDS`].
pub const ESTIMATE_EXPERT_FIELDS: [&str; 2] = ["expert_slots", "experts_bytes"];

/// The fields of [`EstimateReport`] in output order (all scalar: the CSV form has exactly
/// these columns).
pub const ESTIMATE_FIELDS: [&str; 17] = [
    "model",
    "model_path",
    "prompt_tokens",
    "max_tokens",
    "weights_bytes",
    "kv_bytes",
    "scratch_bytes",
    "total_bytes",
    "memory_limit_bytes",
    "fits",
    "context_length",
    "attention",
    "prefill_chunk",
    "within_context",
    "kv_dtype",
    "workspace_bytes",
    "attention_scores_bytes",
];

impl EstimateReport {
    /// Parses an `estimate` stdout; `Ok(None)` when it printed nothing.
    pub fn parse(stdout: &str) -> Result<Option<EstimateReport>, ReportError> {
        let Some(r) = parse::<EstimateReport>(stdout)? else { return Ok(None) };
        let parts = r
            .weights_bytes
            .checked_add(r.kv_bytes)
            .and_then(|s| s.checked_add(r.scratch_bytes))
            .and_then(|s| s.checked_add(r.experts_bytes.unwrap_or(0)));
        if parts.is_none_or(|p| p > r.total_bytes) {
            return Err(ReportError::Impossible {
                field: "total_bytes",
                value: r.total_bytes.to_string(),
                expected: format!(
                    "expected at least weights {} + kv {} + scratch {} + experts {}",
                    r.weights_bytes,
                    r.kv_bytes,
                    r.scratch_bytes,
                    r.experts_bytes.unwrap_or(0)
                ),
            });
        }
        let fits = r.memory_limit_bytes.is_none_or(|l| r.total_bytes <= l);
        if fits != r.fits {
            return Err(ReportError::Impossible {
                field: "fits",
                value: r.fits.to_string(),
                expected: format!("expected {fits} for total_bytes {} and the limit", r.total_bytes),
            });
        }
        Ok(Some(r))
    }

    /// Writes the JSON form: one object on one line.
    pub fn write_json(&self, out: impl Write) -> io::Result<()> {
        write_json(self, out)
    }

    /// Writes the CSV form: the header of [`ESTIMATE_FIELDS`] (then
    /// [`ESTIMATE_EXPERT_FIELDS`] with an expert cache) and one row.
    pub fn write_csv(&self, out: impl Write) -> io::Result<()> {
        let mut fields: Vec<&str> = ESTIMATE_FIELDS.to_vec();
        if self.expert_slots.is_some() {
            fields.extend(ESTIMATE_EXPERT_FIELDS);
        }
        write_csv(self, &fields, out)
    }
}

/// `kiln bench-expert-copy`: one expert-cache geometry measured (a profile, S slots, a
/// batch size, a miss rate), with the read bandwidth measured in the same process.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OffloadCopyReport {
    /// MODEL as given.
    pub model: String,
    /// The resolved path, or `synthetic:<profile>`.
    pub model_path: String,
    /// Resident slots (S).
    pub cache_slots: u64,
    /// Bytes of one slot (one expert).
    pub slot_bytes: u64,
    /// Bytes of all slots.
    pub cache_bytes: u64,
    /// Decoder layers.
    pub layers: u64,
    /// Routed experts per layer.
    pub experts: u64,
    /// Experts each token routes to.
    pub top_k: u64,
    /// Sequences decoded together (rows per step).
    pub batch_size: u64,
    /// The miss rate asked for.
    pub miss_rate: f64,
    /// Decode steps measured.
    pub steps: u64,
    /// Tokens measured: steps x batch size.
    pub tokens: u64,
    /// Expert lookups.
    pub fetches: u64,
    /// Lookups that found the expert resident.
    pub hits: u64,
    /// Lookups that copied it in.
    pub misses: u64,
    /// `misses / fetches`: what the routing achieved.
    pub measured_miss_rate: f64,
    /// Bytes the misses copied.
    pub bytes_copied: u64,
    /// Time the copies took.
    pub copy_ms: f64,
    /// `bytes_copied / copy time`, GB/s (10^9); null without a miss.
    pub copy_gb_s: Option<f64>,
    /// Wall time of every lookup, copies included.
    pub fetch_ms: f64,
    /// `fetch_ms / tokens`, in microseconds.
    pub fetch_us_per_token: f64,
    /// The best read bandwidth of the same process, GB/s.
    pub read_bandwidth_gb_s: f64,
    /// `copy_gb_s / read_bandwidth_gb_s`; null without a miss.
    pub copy_share: Option<f64>,
    /// The memory pool's peak.
    pub peak_bytes: u64,
    /// The pool's limit; null when unlimited.
    pub memory_limit_bytes: Option<u64>,
    /// `cpu`, `cuda`, `metal`.
    pub backend: String,
    /// Worker threads.
    pub threads: u64,
    /// The engine's version.
    pub kiln_version: String,
}

impl OffloadCopyReport {
    /// Parses a `bench-expert-copy` stdout; `Ok(None)` when it printed nothing.
    pub fn parse(stdout: &str) -> Result<Option<OffloadCopyReport>, ReportError> {
        let Some(r) = parse::<OffloadCopyReport>(stdout)? else { return Ok(None) };
        for (field, v) in [
            ("miss_rate", Some(r.miss_rate)),
            ("measured_miss_rate", Some(r.measured_miss_rate)),
            ("copy_ms", Some(r.copy_ms)),
            ("copy_gb_s", r.copy_gb_s),
            ("fetch_ms", Some(r.fetch_ms)),
            ("fetch_us_per_token", Some(r.fetch_us_per_token)),
            ("read_bandwidth_gb_s", Some(r.read_bandwidth_gb_s)),
            ("copy_share", r.copy_share),
        ] {
            if v.is_some_and(|v| !v.is_finite() || v < 0.0) {
                return Err(ReportError::Impossible {
                    field,
                    value: format!("{v:?}"),
                    expected: "expected a finite non-negative number".into(),
                });
            }
        }
        if r.hits + r.misses != r.fetches {
            return Err(ReportError::Impossible {
                field: "fetches",
                value: r.fetches.to_string(),
                expected: format!("expected hits {} + misses {}", r.hits, r.misses),
            });
        }
        Ok(Some(r))
    }

    /// Writes the JSON form: one object on one line.
    pub fn write_json(&self, out: impl Write) -> io::Result<()> {
        write_json(self, out)
    }
}

fn write_json(value: &impl Serialize, mut out: impl Write) -> io::Result<()> {
    serde_json::to_writer(&mut out, value)?;
    out.write_all(b"\n")?;
    out.flush()
}

/// The header and one row, the columns `fields`, each value as JSON writes it (a string
/// without its quotes, null as an empty cell), quoted as CSV needs.
fn write_csv(value: &impl Serialize, fields: &[&str], mut out: impl Write) -> io::Result<()> {
    let map = match serde_json::to_value(value)? {
        serde_json::Value::Object(m) => m,
        _ => return Err(io::Error::other("a report serialises to a JSON object")),
    };
    let cell = |name: &str| -> String {
        let text = match map.get(name) {
            None | Some(serde_json::Value::Null) => String::new(),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(v) => v.to_string(),
        };
        if text.contains([',', '"', '\n', '\r']) {
            format!("\"{}\"", text.replace('"', "\"\""))
        } else {
            text
        }
    };
    let header = fields.join(",");
    let row: Vec<String> = fields.iter().map(|f| cell(f)).collect();
    out.write_all(format!("{header}\n{}\n", row.join(",")).as_bytes())?;
    out.flush()
}

/// The one JSON line of `stdout`, or `None` when stdout holds nothing but whitespace.
fn the_line(stdout: &str) -> Result<Option<&str>, ReportError> {
    let lines: Vec<&str> = stdout.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    match lines[..] {
        [] => Ok(None),
        [one] => Ok(Some(one)),
        _ => Err(ReportError::Lines(lines.len())),
    }
}

fn parse<T: DeserializeOwned>(stdout: &str) -> Result<Option<T>, ReportError> {
    let Some(line) = the_line(stdout)? else { return Ok(None) };
    serde_json::from_str(line).map(Some).map_err(|source| {
        let field = key_before(line, source.column())
            .filter(|_| source.is_data() && !source.to_string().starts_with("missing field"))
            .map(str::to_string);
        ReportError::Json { field, source }
    })
}

/// The object key whose value ends at or before 1-based `column` of `line`: serde_json
/// reports a type error at the end of the offending value, so this names the field.
fn key_before(line: &str, column: usize) -> Option<&str> {
    let head = line.get(..column.min(line.len()))?;
    let colon = head.rfind("\":")?;
    let start = head[..colon].rfind('"')? + 1;
    Some(&head[start..colon])
}

#[cfg(test)]
mod tests {
    use super::*;

    const DECODE: &str = r#"{"model":"synthetic:tiny","model_path":"synthetic:tiny","prompt_tokens":512,"generated_tokens":16,"prefill_ms":120.5,"prefill_tok_s":4249.0,"decode_ms":40.0,"decode_tok_s":400.0,"peak_bytes":1000,"peak_breakdown":{"weights":600,"kv":300,"scratch":100,"other":0},"max_rss_bytes":5000,"startup_ms":3.0,"first_token_ms":130.0,"backend":"cpu","threads":2,"kiln_version":"0.1.0","attention":"streaming","prefill_chunk":0,"memory_limit_bytes":null,"later_field":1}"#;

    const ESTIMATE: &str = r#"{"model":"m","model_path":"m","prompt_tokens":1,"max_tokens":2,"weights_bytes":1,"kv_bytes":2,"scratch_bytes":3,"total_bytes":6,"memory_limit_bytes":10,"fits":true,"context_length":4096,"attention":"streaming","prefill_chunk":0,"within_context":true}"#;

    #[test]
    fn a_protocol_only_decode_report_parses() {
        let r = DecodeReport::parse(&format!("\n{DECODE}\n")).unwrap().unwrap();
        assert_eq!(r.prompt_tokens, 512);
        assert_eq!(r.memory_limit_bytes, None);
        assert_eq!(r.peak_breakdown["kv"], 300);
        assert_eq!(r.kv_dtype, None);
        assert_eq!(DecodeReport::parse("  \n").unwrap(), None);
    }

    #[test]
    fn malformed_decode_reports_name_the_field() {
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
        let overflow = DECODE.replace("\"peak_bytes\":1000", "\"peak_bytes\":18446744073709551616");
        assert!(DecodeReport::parse(&overflow).unwrap_err().to_string().contains("peak_bytes"));
    }

    #[test]
    fn the_field_lists_are_the_structs_own() {
        let r = DecodeReport::parse(DECODE).unwrap().unwrap();
        let mut json = Vec::new();
        r.write_json(&mut json).unwrap();
        let text = String::from_utf8(json).unwrap();
        assert!(text.ends_with("}\n") && text.lines().count() == 1);
        let keys = json_keys_in_order(&text);
        let mut want: Vec<&str> = DECODE_FIELDS.to_vec();
        want.push("peak_breakdown");
        assert_eq!(keys, want);
        assert_eq!(DecodeReport::parse(&text).unwrap().unwrap(), r, "the JSON form round-trips");
        let e = EstimateReport::parse(ESTIMATE).unwrap().unwrap();
        let mut json = Vec::new();
        e.write_json(&mut json).unwrap();
        assert_eq!(json_keys_in_order(&String::from_utf8(json).unwrap()), ESTIMATE_FIELDS);
    }

    #[test]
    fn the_csv_form_is_the_header_and_one_row() {
        let mut r = DecodeReport::parse(DECODE).unwrap().unwrap();
        r.model = "a, \"b\"".into();
        let mut csv = Vec::new();
        r.write_csv(&mut csv).unwrap();
        let text = String::from_utf8(csv).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0], DECODE_FIELDS.join(","));
        assert!(lines[1].starts_with("\"a, \"\"b\"\"\",synthetic:tiny,512,16,120.5,"), "{}", lines[1]);
        assert!(lines[1].contains(",streaming,0,,"), "null is an empty cell: {}", lines[1]);
    }

    #[test]
    fn an_estimate_is_checked_for_its_sum_and_its_verdict() {
        let r = EstimateReport::parse(ESTIMATE).unwrap().unwrap();
        assert!(r.fits && r.within_context);
        let bad = ESTIMATE.replace("\"total_bytes\":6", "\"total_bytes\":5");
        assert!(EstimateReport::parse(&bad).unwrap_err().to_string().contains("total_bytes is 5"));
        let lie = ESTIMATE.replace("\"memory_limit_bytes\":10", "\"memory_limit_bytes\":5");
        assert!(EstimateReport::parse(&lie).unwrap_err().to_string().contains("fits is true"));
        let neg = ESTIMATE.replace("\"kv_bytes\":2", "\"kv_bytes\":-2");
        assert!(EstimateReport::parse(&neg).is_err());
        let old = ESTIMATE.replace(",\"within_context\":true", "");
        assert!(EstimateReport::parse(&old).unwrap_err().to_string().contains("within_context"));
    }

    /// The top-level keys of a one-line JSON object, in the order written.
    fn json_keys_in_order(text: &str) -> Vec<String> {
        let mut keys = Vec::new();
        let mut depth = 0;
        let mut chars = text.char_indices().peekable();
        while let Some((i, c)) = chars.next() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                '"' => {
                    let start = i + 1;
                    let mut end = start;
                    for (j, c) in chars.by_ref() {
                        if c == '"' {
                            end = j;
                            break;
                        }
                    }
                    if depth == 1 && text[end + 1..].starts_with(':') {
                        keys.push(text[start..end].to_string());
                    }
                }
                _ => {}
            }
        }
        keys
    }
}
