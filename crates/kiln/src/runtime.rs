//! Turning the shared options into a runtime: the worker threads, the memory pool, and
//! the engine and load options every command uses.

use anyhow::Context;
use kiln_core::MemoryPool;
use kiln_core::size::parse_size;
use kiln_model::{EngineOptions, LoadOptions};

use crate::cli::RunArgs;
use crate::exit::usage;

/// Sets the rayon global pool to `threads` workers (default: rayon's own choice) and
/// returns the number of workers.
pub fn init_threads(threads: Option<usize>) -> anyhow::Result<usize> {
    if let Some(n) = threads {
        if n == 0 {
            return Err(usage("invalid --threads 0: accepted values are 1 or more"));
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("starting the worker threads")?;
    }
    Ok(rayon::current_num_threads())
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
