//! Every command's arguments as clap parses them, and the argument types several commands
//! share (`RunArgs`, `SpecArgs`, `SecondsRange`): a leaf the commands import, so no command
//! module and the command line import each other.

use std::time::Duration;

use clap::{Args, ValueEnum};
use kiln_protocol::{Attention, Backend, KvDtype};

pub const MODEL_HELP: &str = "synthetic:<profile>[@4bit|@8bit|@4bit-g32], a directory under ./models/, a path \
     to a checkpoint directory or to a .gguf file (profiles: tiny, tiny-qwen, smollm-135m, qwen2.5-0.5b, llama-3.2-1b, \
     qwen2.5-7b, llama-3.1-8b; mixture of experts: tiny-moe, tiny-qwen2-moe, qwen1.5-moe-a2.7b, qwen3-30b-a3b, \
     mixtral-8x7b; drafters for --model-draft: tiny-draft, tiny-qwen-draft, smollm-draft, qwen2.5-draft, qwen2.5-7b-draft, mistral-draft, llama-3-draft)";

/// A count flag: a non-negative integer. Negative numbers reach this parser (see
/// `cli::with_negative_values`), so `-n -1` is refused with the accepted range.
fn count(s: &str) -> Result<usize, String> {
    let accepted = format!("accepted values are 0 to {}", usize::MAX);
    match s.parse::<usize>() {
        Ok(n) => Ok(n),
        Err(_) if s.len() > 1 && s.starts_with('-') && s[1..].bytes().all(|b| b.is_ascii_digit()) => {
            Err(format!("{s} is negative: {accepted}"))
        }
        Err(e) => Err(format!("{e}: {accepted}")),
    }
}

/// Arguments of `kiln export-gguf`.
#[derive(Args, Debug)]
pub struct ExportArgs {
    /// The model to write.
    #[arg(value_name = "MODEL", help = MODEL_HELP)]
    pub model: String,
    /// The GGUF file to write (replaced atomically if it exists).
    #[arg(value_name = "OUT.gguf")]
    pub out: std::path::PathBuf,
    /// Load with this quantization first (as `--quantize` elsewhere).
    #[arg(long, value_name = "BITS", value_parser = ["4", "8"])]
    pub quantize: Option<String>,
    /// Worker threads for loading.
    #[arg(long, value_name = "N", value_parser = count)]
    pub threads: Option<usize>,
}

/// Output format of bench-decode and estimate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// One JSON object on one line.
    Json,
    /// A header line and one row.
    Csv,
}

/// Options shared by every command that runs or plans a model, `kiln serve` included
/// (which gives `--prefill-chunk` its own default). The knobs among them are the
/// protocol's types (kiln-protocol's `Knobs`).
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// The model.
    #[arg(short, long, value_name = "MODEL", help = MODEL_HELP)]
    pub model: String,
    /// Memory pool limit (`512MiB`, `2GiB`, bytes); overrides KILN_MEMORY_LIMIT. Default:
    /// 85% of physical memory, or of the cgroup limit when lower.
    #[arg(long, value_name = "SIZE")]
    pub memory_limit: Option<String>,
    /// Prompt tokens per prefill forward; 0 runs the whole prompt in one forward.
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = count)]
    pub prefill_chunk: usize,
    /// Attention implementation.
    #[arg(long, value_enum, default_value_t = Attention::Streaming)]
    pub attention: Attention,
    /// KV cache storage type.
    #[arg(long, value_enum, default_value_t = KvDtype::F16)]
    pub kv_dtype: KvDtype,
    /// Quantize an unquantized checkpoint on load to this many bits (group 64); a quantized
    /// one keeps its own quantization (with a warning).
    #[arg(long, value_name = "BITS", value_parser = ["4", "8"])]
    pub quantize: Option<String>,
    /// Worker threads, 1 to 4 per available CPU. Default: RAYON_NUM_THREADS, else one per
    /// CPU.
    #[arg(long, value_name = "N", value_parser = count)]
    pub threads: Option<usize>,
    /// Keep S routed experts resident in an expert cache (a MoE model only), copying the
    /// others in from their backing store on use. Accepted: the router's top-k to layers x
    /// experts, and what the memory limit holds. Default: every expert resident.
    #[arg(long, value_name = "S", value_parser = count)]
    pub expert_slots: Option<usize>,
    /// Where the forward pass runs: `cpu`, or `cuda` (an NVIDIA GPU; a kiln built with the
    /// `cuda` feature, docs/cuda.md).
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    pub backend: Backend,
}

/// Speculative decoding, shared by `generate` and `bench-decode`.
#[derive(Args, Debug, Clone)]
pub struct SpecArgs {
    /// Decode speculatively: draft tokens (by prompt lookup, or with --model-draft),
    /// verify them in one forward. Greedy output is identical to decoding without it
    /// when the exactness gate finds the verify exact (see docs/environment-variables.md).
    #[arg(long)]
    pub speculative: bool,
    /// Tokens drafted per verify (K; the verify forward runs K + 1 positions). Default 4.
    #[arg(long, value_name = "K", value_parser = count)]
    pub draft_tokens: Option<usize>,
    /// A draft model of the same vocabulary instead of prompt lookup (same forms as
    /// --model; synthetic profiles have drafters such as synthetic:qwen2.5-draft).
    #[arg(long, value_name = "MODEL")]
    pub model_draft: Option<String>,
}

/// `kiln generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Model, memory and attention options.
    #[command(flatten)]
    pub run: RunArgs,
    /// The prompt.
    #[arg(short, long)]
    pub prompt: String,
    /// Tokens to generate at most (EOS stops earlier).
    #[arg(short = 'n', long = "max-tokens", value_name = "N", default_value_t = 128, value_parser = count)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 (or below 1e-6) is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Sample only from the K most likely tokens; 0 keeps all.
    #[arg(long, value_name = "K", default_value_t = 0, value_parser = count)]
    pub top_k: usize,
    /// Sample only from the smallest set of tokens whose probability reaches P.
    #[arg(long, value_name = "P", default_value_t = 1.0)]
    pub top_p: f32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Use the prompt as it is, without the model's chat template.
    #[arg(long)]
    pub no_chat_template: bool,
    /// Speculative decoding.
    #[command(flatten)]
    pub spec: SpecArgs,
}

/// `kiln bench-decode`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model, memory and attention options.
    #[command(flatten)]
    pub run: RunArgs,
    /// The prompt text (encoded with the model's special tokens, no chat template).
    #[arg(short, long, conflicts_with = "prompt_tokens", required_unless_present = "prompt_tokens")]
    pub prompt: Option<String>,
    /// Build a prompt of exactly N tokens.
    #[arg(long, value_name = "N", value_parser = count)]
    pub prompt_tokens: Option<usize>,
    /// Tokens to generate: the first comes out of the prefill, each other from one decode
    /// step. EOS does not stop the measurement.
    #[arg(short = 'n', long = "max-tokens", value_name = "N", default_value_t = 128, value_parser = count)]
    pub max_tokens: usize,
    /// Decode steps run before the timed ones.
    #[arg(long, value_name = "W", default_value_t = 0, value_parser = count)]
    pub warmup_tokens: usize,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Json)]
    pub format: Format,
    /// Measure the read bandwidth (a 1 GiB buffer, outside the pool) before loading the
    /// model, and report decode speed as a share of bandwidth / bytes read per token.
    #[arg(long)]
    pub measure_bandwidth: bool,
    /// Measure the machine's compute roofs (register-only int8 and f32 loops on the run's
    /// threads) and the read bandwidth before loading the model, and report prefill's
    /// share of the compute roof and decode's share of the bandwidth (CPU backend only).
    #[arg(long)]
    pub measure_roofs: bool,
    /// Speculative decoding (greedy); the record gains the acceptance counts.
    #[command(flatten)]
    pub spec: SpecArgs,
}

/// `kiln estimate`.
#[derive(Args, Debug)]
pub struct EstimateArgs {
    /// Model, memory and attention options.
    #[command(flatten)]
    pub run: RunArgs,
    /// Prompt length of the run to predict.
    #[arg(long, value_name = "N", value_parser = count)]
    pub prompt_tokens: usize,
    /// Tokens the run generates.
    #[arg(short = 'n', long = "max-tokens", value_name = "N", default_value_t = 128, value_parser = count)]
    pub max_tokens: usize,
    /// Accepted so a bench-decode command line can be reused; warmup steps are part of
    /// the generated tokens and change nothing here.
    #[arg(long, value_name = "W", default_value_t = 0, hide = true, value_parser = count)]
    pub warmup_tokens: usize,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Json)]
    pub format: Format,
}

/// `kiln bench-expert-copy`.
#[derive(Args, Debug)]
pub struct ExpertCopyArgs {
    /// Model, memory and --expert-slots (required: the geometry measured).
    #[command(flatten)]
    pub run: RunArgs,
    /// Rows (sequences) per simulated decode step.
    #[arg(long, value_name = "B", default_value_t = 1, value_parser = count)]
    pub batch_size: usize,
    /// Share of expert choices that miss the cache, 0 to 1.
    #[arg(long, value_name = "R", default_value_t = 0.5)]
    pub miss_rate: f64,
    /// Most decode steps to simulate.
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub steps: u64,
    /// Keep simulating steps (up to --steps) until this much time has passed, 0 to
    /// 3600000 ms; at least one step runs.
    #[arg(long, value_name = "MS", default_value_t = 300, allow_hyphen_values = true,
          value_parser = parse_min_time_ms)]
    pub min_time_ms: u64,
    /// Bytes of the read-bandwidth buffer, outside the pool (`1GiB`, `64MiB`).
    #[arg(long, value_name = "SIZE", default_value = "1GiB")]
    pub bandwidth_bytes: String,
    /// Seed of the routing.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// `kiln score`.
#[derive(Args, Debug)]
pub struct ScoreArgs {
    /// Model, memory and attention options.
    #[command(flatten)]
    pub run: RunArgs,
    /// The text to score (UTF-8).
    #[arg(long, value_name = "FILE")]
    pub text_file: std::path::PathBuf,
    /// Tokens per window, BOS included when the tokenizer adds one.
    #[arg(long, value_name = "N", default_value_t = 512, value_parser = count)]
    pub window: usize,
    /// First position of each window whose next token is scored (the ones before it are
    /// context only).
    #[arg(long, value_name = "P", default_value_t = 256, value_parser = count)]
    pub first_scored: usize,
    /// Score at most this many windows.
    #[arg(long, value_name = "N", value_parser = count)]
    pub max_windows: Option<usize>,
    /// The log-probability file to write (docs/engine-protocol.md).
    #[arg(long, value_name = "FILE", required_unless_present = "ids_only")]
    pub output: Option<std::path::PathBuf>,
    /// Print the text's token ids as a JSON array and exit.
    #[arg(long)]
    pub ids_only: bool,
}

/// The longest `--min-time-ms` of bench-expert-copy: an hour.
pub const MAX_MIN_TIME_MS: u64 = 3_600_000;

fn parse_min_time_ms(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(ms) if ms <= MAX_MIN_TIME_MS => Ok(ms),
        _ => Err(format!("accepted values are whole milliseconds from 0 to {MAX_MIN_TIME_MS} (an hour)")),
    }
}

/// Which durations a seconds flag accepts: from `min` (0 included or not) to `max`.
#[derive(Clone, Copy, Debug)]
pub struct SecondsRange {
    /// The lower bound.
    pub min: f64,
    /// Whether the lower bound itself is accepted.
    pub min_included: bool,
    /// The upper bound, accepted.
    pub max: f64,
}

impl SecondsRange {
    /// Parses `s` as seconds (a decimal number) inside the range.
    ///
    /// Every duration flag goes through this at parse time, so a value no `Duration` or
    /// `Instant` can hold (`1e300`, `1e19`, NaN, a negative) is a usage error naming the
    /// flag (clap adds it) and the range, never a panic later.
    pub fn parse(self, s: &str) -> Result<Duration, String> {
        let accepted = || {
            let low =
                if self.min_included { format!("from {}", self.min) } else { format!("above {}", self.min) };
            format!("accepted values are seconds {low} to {}", self.max)
        };
        let v: f64 = s.trim().parse().map_err(|_| format!("not a number of seconds: {}", accepted()))?;
        let above_min = if self.min_included { v >= self.min } else { v > self.min };
        if !(v.is_finite() && above_min && v <= self.max) {
            return Err(accepted());
        }
        Ok(Duration::from_secs_f64(v))
    }
}
