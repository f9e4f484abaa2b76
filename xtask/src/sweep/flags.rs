//! The flags every bench command shares, the defaults that depend on the backend, and
//! the harness's own environment variables: read and checked before anything is built.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;

use super::plan;
use super::runner::EngineKnobs;
use crate::args::count;
use crate::console::usage;
use crate::kiln_build::{Backend, BackendArg};
use kiln_protocol::{Attention, KvDtype};

/// Flags every bench command shares.
#[derive(clap::Args, Clone, Debug)]
pub struct SweepFlags {
    /// Tokens generated per cell: the first comes from the prefill, the warm-up steps are
    /// part of them [default: 32 on the CPU, 128 on a GPU].
    #[arg(long, value_name = "N", value_parser = count(0))]
    pub max_tokens: Option<u64>,
    /// Decode steps run before the timed ones.
    #[arg(long, value_name = "W", default_value_t = 4, value_parser = count(0))]
    pub warmup_tokens: u64,
    /// The CSV to write [default: benchmarks/<backend>_<host>_<date>_<command>.csv].
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Passed to the engine: the memory pool's limit (bytes, or 512MiB, 4GiB, ...).
    #[arg(long, value_name = "SIZE")]
    pub memory_limit: Option<String>,
    /// Passed to the engine: prefill in chunks of N tokens (0 = one forward).
    #[arg(long, value_name = "N", value_parser = count(0))]
    pub prefill_chunk: Option<u64>,
    /// Passed to the engine: the attention implementation.
    #[arg(long, value_enum)]
    pub attention: Option<Attention>,
    /// Passed to the engine: the KV cache's storage type.
    #[arg(long, value_enum)]
    pub kv_dtype: Option<KvDtype>,
    /// Passed to the engine: worker threads [default: the engine's].
    #[arg(long, value_name = "N", value_parser = count(1))]
    pub threads: Option<u64>,
    /// Seconds before a cell is killed [default: 1800 on the CPU, 900 on a GPU].
    #[arg(long, value_name = "SECS", value_parser = count(1))]
    pub cell_timeout: Option<u64>,
    /// Every kiln cell measures the CPU's compute roofs and read bandwidth beside its run
    /// (`kiln bench-decode --measure-roofs`, a few seconds each); the summary and
    /// report.html place each cell's prefill and decode under them. CPU backend, local
    /// runner only.
    #[arg(long)]
    pub measure_roofs: bool,
    /// Turn the estimate layer off: launch cells whose estimate is above the budget.
    #[arg(long)]
    pub no_estimate: bool,
    /// Do not build kiln; use the release binary already in the target directory.
    #[arg(long)]
    pub no_build: bool,
    /// Use this kiln binary instead of building one (also KILN_BENCH_KILN_BIN).
    #[arg(long, value_name = "PATH")]
    pub kiln_bin: Option<PathBuf>,
    /// The backend to build and run.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    pub backend: BackendArg,
    /// The persistent OOM record [default: benchmarks/.oom-record].
    #[arg(long, value_name = "FILE")]
    pub oom_record: Option<PathBuf>,
    /// Where run directories (env.json, per-cell logs) go [default: benchmarks/runs].
    #[arg(long, value_name = "DIR")]
    pub runs_dir: Option<PathBuf>,
    #[command(flatten)]
    pub series: super::series::SeriesFlags,
    /// `--runner` and the Slurm options.
    #[command(flatten)]
    pub runner: super::slurm::RunnerFlags,
}

impl SweepFlags {
    /// The knobs passed to every engine call, checked before anything is built: a
    /// `--memory-limit` (or an inherited `KILN_MEMORY_LIMIT`) the engine would refuse is a
    /// usage error naming it and the accepted forms.
    pub fn engine_knobs(&self) -> Result<(EngineKnobs, Option<u64>)> {
        let limit = match &self.memory_limit {
            Some(text) => match kiln_protocol::parse_size(text) {
                Ok(b) => Some(b),
                Err(e) => usage!("--memory-limit: {e}"),
            },
            None => match std::env::var_os("KILN_MEMORY_LIMIT") {
                None => None,
                Some(v) => match v.to_str().map(kiln_protocol::parse_size) {
                    Some(Ok(b)) => Some(b),
                    Some(Err(e)) => usage!("KILN_MEMORY_LIMIT (inherited by every cell): {e}"),
                    None => {
                        usage!("KILN_MEMORY_LIMIT={v:?} is not UTF-8: expected a size such as 512MiB or 2GiB")
                    }
                },
            },
        };
        let knobs = EngineKnobs {
            memory_limit: self.memory_limit.clone(),
            prefill_chunk: self.prefill_chunk,
            attention: self.attention,
            kv_dtype: self.kv_dtype,
            threads: self.threads,
        };
        Ok((knobs, limit))
    }

    /// The cell template these flags and the backend's defaults give, checked the way
    /// the engine counts tokens; a bad combination is a usage error (exit 2).
    pub fn cell_template(&self, defaults: &Defaults, named: plan::Named) -> Result<plan::CellTemplate> {
        let template = plan::CellTemplate {
            max_tokens: self.max_tokens.unwrap_or(defaults.max_tokens),
            warmup_tokens: self.warmup_tokens,
            named,
        };
        if let Err(e) = template.validate() {
            crate::console::usage!("{e}");
        }
        Ok(template)
    }
}

/// The defaults that depend on the backend.
#[derive(Clone, Debug)]
pub struct Defaults {
    /// Models of a default sweep.
    pub models: Vec<String>,
    /// Prompt lengths of a default sweep.
    pub lengths: Vec<u64>,
    /// `--max-tokens`.
    pub max_tokens: u64,
    /// `--cell-timeout`.
    pub cell_timeout: Duration,
}

impl Defaults {
    /// On the CPU, a sweep that finishes in about a minute on a 2-core machine (the
    /// 2048-token cells of tiny and smollm-135m are skipped by their contexts, which is
    /// expected output); on a GPU, the ladder long-prompt work is judged on.
    pub fn for_backend(backend: Backend) -> Defaults {
        if backend.is_gpu() {
            Defaults {
                models: vec![
                    "synthetic:qwen2.5-0.5b".into(),
                    "synthetic:llama-3.2-1b".into(),
                    "synthetic:llama-3.1-8b".into(),
                ],
                lengths: vec![512, 2048, 8192, 32768],
                max_tokens: 128,
                cell_timeout: Duration::from_secs(900),
            }
        } else {
            Defaults {
                models: vec![
                    "synthetic:tiny".into(),
                    "synthetic:smollm-135m".into(),
                    "synthetic:qwen2.5-0.5b".into(),
                ],
                lengths: vec![128, 512, 2048],
                max_tokens: 32,
                cell_timeout: Duration::from_secs(1800),
            }
        }
    }
}

/// The harness's own variables, read once and validated before anything runs.
#[derive(Clone, Debug, Default)]
pub struct HarnessEnv {
    /// `KILN_BENCH_FAKE_OOM`.
    pub fake_oom: Vec<(String, u64)>,
    /// `KILN_BENCH_IGNORE_OOM_RECORD=1`.
    pub ignore_record: bool,
    /// `KILN_BENCH_KILN_BIN`.
    pub kiln_bin: Option<PathBuf>,
}

impl HarnessEnv {
    /// Reads the variables; a malformed one is a usage error naming it.
    pub fn read() -> Result<HarnessEnv> {
        let var = |k: &str| std::env::var_os(k).map(|v| v.to_string_lossy().into_owned());
        let fake_oom = match var("KILN_BENCH_FAKE_OOM") {
            Some(v) => match plan::parse_fake_oom(&v) {
                Ok(f) => f,
                Err(e) => usage!("{e}"),
            },
            None => Vec::new(),
        };
        let ignore_record = match var("KILN_BENCH_IGNORE_OOM_RECORD").as_deref().map(str::trim) {
            None | Some("" | "0") => false,
            Some("1") => true,
            Some(other) => {
                usage!("KILN_BENCH_IGNORE_OOM_RECORD={other:?}: expected 1 (ignore the record) or 0")
            }
        };
        let kiln_bin = var("KILN_BENCH_KILN_BIN").filter(|v| !v.is_empty()).map(PathBuf::from);
        // The engine refuses any other value in every cell; the device name depends on it.
        if let Err(e) = crate::machine::cuda_emulation(std::env::var_os("KILN_CUDA_EMULATE").as_deref()) {
            usage!("{e} (inherited by every cell)");
        }
        Ok(HarnessEnv { fake_oom, ignore_record, kiln_bin })
    }
}
