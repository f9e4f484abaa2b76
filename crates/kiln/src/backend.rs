//! `--backend`: where a command's forward pass runs. `cpu` is kiln-model's forward on the
//! worker pool; `cuda` (a kiln built with the `cuda` feature) is kiln-cuda's device
//! forward on GPU 0, or, with `KILN_CUDA_EMULATE=1`, the same launches through the host
//! execution of the kernels (for tests and CI: slow, and not a GPU measurement). The
//! one-sequence commands (`generate`, `bench-decode`) run either through [`Runner`];
//! `estimate` prices the device's plan; `serve`, `score` and `bench-expert-copy` run on
//! the CPU only and refuse `cuda` by name. docs/cuda.md says what the device forward runs.

use kiln_model::{Engine, EngineOptions, KvCache, LoadedModel};
use kiln_protocol::{Attention, Backend, KvDtype};

use crate::args::RunArgs;
use crate::exit::usage;

/// The device a `cuda` run holds: kiln-cuda's executor, or nothing a build without the
/// feature can make.
#[cfg(feature = "cuda")]
pub type DeviceExec = kiln_cuda::Exec;
/// The device a `cuda` run holds: none in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub enum DeviceExec {}

/// Checks `--backend` against this build and against the options given with it.
/// `command` names the command for a refusal; `runs_cuda` is whether it has a device path.
pub fn check(args: &RunArgs, command: &str, runs_cuda: bool, speculative: bool) -> anyhow::Result<Backend> {
    match args.backend {
        Backend::Cpu => Ok(Backend::Cpu),
        Backend::Metal => Err(usage(
            "invalid --backend metal: kiln has no Metal backend yet (docs/architecture.md); accepted values \
             are cpu and cuda",
        )),
        Backend::Cuda => {
            if !cfg!(feature = "cuda") {
                return Err(usage(
                    "invalid --backend cuda: this kiln was built without the `cuda` feature; build it with \
                     `cargo build --release -p kiln --features cuda` (docs/cuda.md), or use --backend cpu",
                ));
            }
            if !runs_cuda {
                return Err(usage(format!(
                    "invalid --backend cuda: kiln {command} runs on the cpu backend only for now (the device \
                     forward runs generate, bench-decode and estimate); use --backend cpu"
                )));
            }
            let refuse = |what: &str| {
                usage(format!(
                    "invalid {what} with --backend cuda: the device forward does not run it yet (docs/cuda.md); \
                     drop it or use --backend cpu"
                ))
            };
            if speculative {
                return Err(refuse("--speculative"));
            }
            if args.attention != Attention::Streaming {
                return Err(refuse("--attention naive"));
            }
            if args.kv_dtype != KvDtype::F16 {
                return Err(refuse("--kv-dtype f32"));
            }
            if args.expert_slots.is_some() {
                return Err(refuse("--expert-slots"));
            }
            // The device runs f16 activations: an integer (or f32) scheme asked for would
            // be silently ignored, and a record would name a scheme that never ran.
            if let Some(v) = std::env::var_os(kiln_protocol::ACT_PRECISION_ENV).filter(|v| !v.is_empty()) {
                return Err(usage(format!(
                    "invalid {}={} with --backend cuda: the device kernels run f16 activations and \
                     honour no KILN_ACT_PRECISION scheme; unset it, or use --backend cpu",
                    kiln_protocol::ACT_PRECISION_ENV,
                    v.to_string_lossy()
                )));
            }
            Ok(Backend::Cuda)
        }
    }
}

/// Opens the device of a `cuda` run (none for `cpu`): GPU 0, its pool limited by its free
/// memory or `--memory-limit` / `KILN_MEMORY_LIMIT` when smaller; or the host execution
/// under `KILN_CUDA_EMULATE=1`, limited as the CPU pool would be. Says on stderr which.
pub fn open(args: &RunArgs, backend: Backend) -> anyhow::Result<Option<DeviceExec>> {
    if backend != Backend::Cuda {
        return Ok(None);
    }
    open_device(args).map(Some)
}

#[cfg(feature = "cuda")]
fn open_device(args: &RunArgs) -> anyhow::Result<DeviceExec> {
    use anyhow::Context;
    let explicit = match &args.memory_limit {
        Some(text) => Some(
            kiln_core::size::parse_size(text).map_err(|e| usage(format!("invalid --memory-limit: {e}")))?,
        ),
        None => kiln_core::MemoryPool::limit_from_env()?,
    };
    // KILN_CUDA_GRAPHS was checked with every other variable before the command ran.
    if crate::runtime::emulate_from_env()? {
        let limit = crate::runtime::pool(args)?.limit();
        let name = crate::runtime::EMULATE_ENV;
        eprintln!("kiln: --backend cuda on the host execution ({name}=1): the kernels run on the CPU");
        return Ok(kiln_cuda::Exec::host(limit));
    }
    let exec = kiln_cuda::Exec::cuda_limited(0, explicit).context("opening CUDA device 0")?;
    eprintln!("kiln: --backend cuda on {} (device pool limit {} bytes)", exec.name(), exec.pool().limit());
    Ok(exec)
}

#[cfg(not(feature = "cuda"))]
fn open_device(_: &RunArgs) -> anyhow::Result<DeviceExec> {
    unreachable!("check refuses --backend cuda in a build without the feature")
}

/// Rows of the largest device forward of a prompt of `prompt_tokens` run in chunks of
/// `chunk` (0: kiln-cuda's default chunk).
#[cfg(feature = "cuda")]
pub fn device_rows(chunk: usize, prompt_tokens: usize) -> usize {
    kiln_cuda::model::prefill_rows(chunk, prompt_tokens)
}

/// One sequence's forward, on either backend. One per command: the size difference of
/// the variants costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Runner<'m> {
    /// kiln-model's engine and cache.
    Cpu {
        /// The engine.
        engine: Engine<'m>,
        /// The sequence's cache.
        cache: KvCache,
    },
    /// kiln-cuda's device engine and cache.
    #[cfg(feature = "cuda")]
    Cuda {
        /// The engine.
        engine: kiln_cuda::DeviceEngine<'m>,
        /// The sequence's cache, of a fixed capacity.
        cache: kiln_cuda::DeviceCache,
        /// Prompt tokens per prefill forward (0: all).
        chunk: usize,
    },
}

impl<'m> Runner<'m> {
    /// A runner for one sequence of up to `capacity` positions whose prompt is
    /// `prompt_tokens` long: on `device` when given, else on the CPU through `pool`.
    pub fn new(
        model: &'m LoadedModel,
        pool: &kiln_core::MemoryPool,
        options: EngineOptions,
        device: Option<&'m DeviceExec>,
        capacity: usize,
        prompt_tokens: usize,
    ) -> anyhow::Result<Self> {
        use anyhow::Context;
        match device {
            None => {
                let engine = Engine::new(model, pool, options).context("preparing the forward pass")?;
                let cache = engine.new_cache();
                Ok(Runner::Cpu { engine, cache })
            }
            #[cfg(feature = "cuda")]
            Some(exec) => Self::device(exec, model, options.prefill_chunk, capacity, prompt_tokens),
            #[cfg(not(feature = "cuda"))]
            Some(d) => {
                let _ = (capacity, prompt_tokens);
                match *d {}
            }
        }
    }

    /// A runner on `exec` for one sequence of up to `capacity` positions whose prompt is
    /// `prompt_tokens` long, prefilled in chunks of `chunk`: the weights copied, the
    /// workspace and the whole cache allocated before anything runs.
    #[cfg(feature = "cuda")]
    pub fn device(
        exec: &'m DeviceExec,
        model: &LoadedModel,
        chunk: usize,
        capacity: usize,
        prompt_tokens: usize,
    ) -> anyhow::Result<Self> {
        use anyhow::Context;
        let mut engine = kiln_cuda::DeviceEngine::new(exec, &model.config, &model.weights)
            .context("copying the weights to the device")?;
        engine.set_graphs(crate::runtime::graphs_from_env()?);
        let rows = device_rows(chunk, prompt_tokens);
        engine.reserve(rows, capacity, 1).context("allocating the device workspace")?;
        let cache = engine.new_cache(capacity).context("allocating the device KV cache")?;
        Ok(Runner::Cuda { engine, cache, chunk })
    }

    /// Runs the prompt, returning its last token's logits.
    pub fn prefill(&mut self, ids: &[u32]) -> anyhow::Result<&[f32]> {
        match self {
            Runner::Cpu { engine, cache } => Ok(engine.prefill(cache, ids)?),
            #[cfg(feature = "cuda")]
            Runner::Cuda { engine, cache, chunk } => Ok(engine.prefill(cache, ids, *chunk)?),
        }
    }

    /// One decode step.
    pub fn decode(&mut self, token: u32) -> anyhow::Result<&[f32]> {
        match self {
            Runner::Cpu { engine, cache } => Ok(engine.decode(cache, token)?),
            #[cfg(feature = "cuda")]
            Runner::Cuda { engine, cache, .. } => Ok(engine.decode(cache, token)?),
        }
    }
}
