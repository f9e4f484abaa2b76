//! Turning the shared options into a runtime: the worker threads, the memory pool, and
//! the engine and load options every command uses.

use anyhow::Context;
use kiln_core::MemoryPool;
use kiln_core::size::parse_size;
use kiln_model::{EngineOptions, LoadOptions};

use crate::args::RunArgs;
use crate::exit::usage;

/// Worker threads allowed per CPU the process may use: more only add scheduling and
/// memory costs (100000 threads turn a millisecond run into minutes).
pub const MAX_THREADS_PER_CPU: usize = 4;

/// The most worker threads `--threads` (or RAYON_NUM_THREADS) may ask for:
/// [`MAX_THREADS_PER_CPU`] times the available parallelism.
pub fn max_threads() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    cpus.saturating_mul(MAX_THREADS_PER_CPU)
}

/// Checks `--threads` (1 to [`max_threads`]) and, when it is not given, the
/// RAYON_NUM_THREADS rayon would read instead.
pub fn check_threads(threads: Option<usize>) -> anyhow::Result<()> {
    let max = max_threads();
    let accepted = format!("accepted values are 1 to {max} ({MAX_THREADS_PER_CPU} per available CPU)");
    match threads {
        Some(n) if n == 0 || n > max => Err(usage(format!("invalid --threads {n}: {accepted}"))),
        Some(_) => Ok(()),
        None => match std::env::var("RAYON_NUM_THREADS") {
            // rayon treats 0 and unparsable values as unset.
            Ok(v) if v.trim().parse::<usize>().is_ok_and(|n| n > max) => {
                Err(usage(format!("invalid RAYON_NUM_THREADS {v}: {accepted}, or 0 for one per CPU")))
            }
            _ => Ok(()),
        },
    }
}

/// Warns on stderr when `--quantize` is given for a model that is quantized already: the
/// checkpoint's own quantization is used and the flag changes nothing.
pub fn warn_ignored_quantize(args: &RunArgs, config: &kiln_model::ModelConfig) {
    if let (Some(bits), Some(q)) = (&args.quantize, &config.quantization) {
        eprintln!(
            "warning: --quantize {bits} ignored: {} is already quantized ({}-bit, group {}); \
             its own quantization is used",
            args.model,
            q.default.bits(),
            q.default.group_size()
        );
    }
}

/// The positions a run needs, prompt plus generated tokens, or a usage error naming the
/// flags when the sum overflows. `prompt_flag` is true when the prompt's length is
/// `--prompt-tokens` itself rather than an encoded text.
pub fn sequence_tokens(prompt: usize, prompt_flag: bool, max_tokens: usize) -> anyhow::Result<usize> {
    prompt.checked_add(max_tokens).ok_or_else(|| {
        let what = if prompt_flag {
            format!("--prompt-tokens {prompt} with --max-tokens {max_tokens}")
        } else {
            format!("--max-tokens {max_tokens} with a prompt of {prompt} tokens")
        };
        usage(format!(
            "invalid {what}: the sum overflows; accepted values keep prompt plus generated tokens \
             within the model's context"
        ))
    })
}
/// Runs `f` on a worker of a new rayon pool of `threads` workers (default: rayon's own
/// choice, RAYON_NUM_THREADS or one per CPU), passing it the number of workers. Driving
/// the run from inside the pool means the forward's many short parallel regions are
/// forked and joined among the workers themselves, instead of each being handed to the
/// pool and its end signalled back to a thread outside it.
pub fn in_pool<R: Send>(
    threads: Option<usize>,
    f: impl FnOnce(usize) -> anyhow::Result<R> + Send,
) -> anyhow::Result<R> {
    check_threads(threads)?;
    let mut builder = rayon::ThreadPoolBuilder::new();
    if let Some(n) = threads {
        builder = builder.num_threads(n);
    }
    let pool = builder.build().context("starting the worker threads")?;
    pool.install(|| {
        // One-shot commands never measure the crossover (it would cost their own timing
        // and memory): they follow a cached measurement, else run qmv_wide at every M.
        configure_kernels(false)?;
        f(rayon::current_num_threads())
    })
}

/// Checks every environment variable the engine reads, once, at the start of every
/// command (exit 2 naming the variable and what it accepts): the kernel settings
/// (`KILN_ACT_PRECISION`, `KILN_WEIGHT_LAYOUT`, `KILN_QMV_CROSSOVER`,
/// `KILN_QMV_CROSSOVER_BUSY_LIMIT`, `KILN_SPIN_US`), `KILN_MEMORY_LIMIT`,
/// `KILN_SPEC_ALLOW_INEXACT`, `KILN_CUDA_EMULATE`, `KILN_CUDA_GRAPHS`,
/// `KILN_SYNTHETIC_ROUTER_SKEW` and `RAYON_NUM_THREADS`'s form. A command that never
/// reaches a variable still refuses a bad value in it, so the same environment fails the
/// same way under every command; no command checks them again.
pub fn check_env() -> anyhow::Result<()> {
    kiln_core::act_precision::ActScheme::from_env().map_err(usage)?;
    kiln_core::matrix::LayoutSetting::from_env().map_err(usage)?;
    kiln_core::crossover::CrossoverSetting::from_env().map_err(usage)?;
    kiln_core::crossover::BusyLimit::from_env().map_err(usage)?;
    kiln_core::workers::SpinBudget::from_env().map_err(usage)?;
    MemoryPool::limit_from_env()?;
    kiln_model::speculative::GatePolicy::from_env().map_err(|e| usage(e.to_string()))?;
    emulate_from_env()?;
    graphs_from_env()?;
    kiln_model::synthetic::router_skew_from_env()?;
    check_rayon_env(std::env::var_os("RAYON_NUM_THREADS"))
}

/// Refuses a RAYON_NUM_THREADS that is not a number (rayon would silently ignore it);
/// its range is [`check_threads`]'s, where the value is used.
fn check_rayon_env(value: Option<std::ffi::OsString>) -> anyhow::Result<()> {
    let Some(value) = value else { return Ok(()) };
    let text = value.to_string_lossy();
    if text.trim().is_empty() || text.trim().parse::<usize>().is_ok() {
        return Ok(());
    }
    Err(usage(format!(
        "invalid RAYON_NUM_THREADS {text:?}: accepted values are 0 (one per CPU) or a number of threads from 1 to {}",
        max_threads()
    )))
}

/// Installs the `qmv_wide` crossover for the current rayon pool
/// ([`kiln_core::crossover::configure_from_env`]): from `KILN_QMV_CROSSOVER`, the
/// `KILN_QMV_WIDE` pin, or the cache, measuring on a miss when `may_measure`.
pub fn configure_kernels(
    may_measure: bool,
) -> anyhow::Result<(kiln_core::crossover::Crossover, kiln_core::crossover::CrossoverSource)> {
    kiln_core::crossover::configure_from_env(may_measure).map_err(usage)
}

/// The pool: `--memory-limit` when given, else KILN_MEMORY_LIMIT, else the default share
/// of memory.
pub fn pool(args: &RunArgs) -> anyhow::Result<MemoryPool> {
    match &args.memory_limit {
        Some(text) => {
            let limit = parse_size(text).map_err(|e| usage(format!("invalid --memory-limit: {e}")))?;
            Ok(MemoryPool::with_limit(limit))
        }
        None => Ok(MemoryPool::from_env()?),
    }
}

/// Options of the forward pass.
pub fn engine_options(args: &RunArgs) -> EngineOptions {
    EngineOptions {
        attention: args.attention,
        prefill_chunk: args.prefill_chunk,
        kv_dtype: args.kv_dtype,
        expert_slots: args.expert_slots,
    }
}

/// Checks `--expert-slots` against the CPU backend's geometry rules for `config`, whose
/// experts take `slot_bytes` a slot and whose weights take `weight_bytes` of `pool`'s
/// limit, before anything is allocated for it; `None` without the flag.
pub fn expert_geometry(
    args: &RunArgs,
    config: &kiln_model::ModelConfig,
    slot_bytes: Option<u64>,
    weight_bytes: u64,
    pool: &MemoryPool,
) -> anyhow::Result<Option<kiln_model::CacheGeometry>> {
    let Some(slots) = args.expert_slots else { return Ok(None) };
    let g = kiln_model::expert_cache::cpu_geometry(
        &args.model,
        config,
        slot_bytes,
        slots,
        weight_bytes,
        pool.limit(),
    )?;
    Ok(Some(g))
}

/// Options of loading.
pub fn load_options(args: &RunArgs, pool: &MemoryPool) -> LoadOptions {
    LoadOptions { pool: pool.clone(), quantize: args.quantize.as_deref().and_then(|b| b.parse().ok()) }
}

/// The pool's limit as the protocol reports it (null when unlimited).
pub fn limit_bytes(pool: &MemoryPool) -> Option<u64> {
    (pool.limit() != u64::MAX).then_some(pool.limit())
}

/// Runs `--backend cuda` on the host execution of the kernels when `1`.
pub const EMULATE_ENV: &str = kiln_protocol::CUDA_EMULATE_ENV;

/// A `0`/`1` switch read from `name`, by the protocol's one rule
/// ([`kiln_protocol::switch_value`]): unset or empty is `default`, anything else is
/// refused naming the variable.
fn switch_env(name: &str, default: bool) -> anyhow::Result<bool> {
    kiln_protocol::switch_value(name, std::env::var_os(name).as_deref(), default).map_err(usage)
}

/// Whether `KILN_CUDA_EMULATE` asks for the host execution (default no).
pub fn emulate_from_env() -> anyhow::Result<bool> {
    switch_env(EMULATE_ENV, false)
}

/// Replays device decode steps as CUDA graphs unless `0`.
pub const GRAPHS_ENV: &str = "KILN_CUDA_GRAPHS";

/// Whether `KILN_CUDA_GRAPHS` leaves decode graphs on (default yes).
pub fn graphs_from_env() -> anyhow::Result<bool> {
    switch_env(GRAPHS_ENV, true)
}
