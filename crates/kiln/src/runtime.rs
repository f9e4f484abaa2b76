//! Turning the shared options into a runtime: the worker threads, the memory pool, and
//! the engine and load options every command uses.

use anyhow::Context;
use kiln_core::MemoryPool;
use kiln_core::size::parse_size;
use kiln_model::{EngineOptions, LoadOptions};

use crate::cli::RunArgs;
use crate::exit::usage;

/// Checks `--threads`: 1 or more when given.
pub fn check_threads(threads: Option<usize>) -> anyhow::Result<()> {
    if threads == Some(0) {
        return Err(usage("invalid --threads 0: accepted values are 1 or more"));
    }
    Ok(())
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
    kiln_core::act_precision::ActScheme::from_env().map_err(usage)?;
    let mut builder = rayon::ThreadPoolBuilder::new();
    if let Some(n) = threads {
        builder = builder.num_threads(n);
    }
    let pool = builder.build().context("starting the worker threads")?;
    pool.install(|| f(rayon::current_num_threads()))
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
        attention: args.attention.into(),
        prefill_chunk: args.prefill_chunk,
        kv_dtype: args.kv_dtype.into(),
    }
}

/// Options of loading.
pub fn load_options(args: &RunArgs, pool: &MemoryPool) -> LoadOptions {
    LoadOptions { pool: pool.clone(), quantize: args.quantize.as_deref().and_then(|b| b.parse().ok()) }
}

/// The pool's limit as the protocol reports it (null when unlimited).
pub fn limit_bytes(pool: &MemoryPool) -> Option<u64> {
    (pool.limit() != u64::MAX).then_some(pool.limit())
}
