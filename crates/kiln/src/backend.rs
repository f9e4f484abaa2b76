//! `--backend`: where a command's forward pass runs, through kiln-model's backend seam.
//! `cpu` is kiln-model's [`Engine`] on the worker pool; `cuda` (a kiln built with the
//! `cuda` feature) is kiln-cuda's device engine on GPU 0, or, with `KILN_CUDA_EMULATE=1`,
//! the same launches through the host execution of the kernels (for tests and CI: slow,
//! and not a GPU measurement).
//!
//! This module is the one place that names backends: [`check`] compares a command's needs
//! with the chosen backend's `Capabilities` (one refusal rule for every command), and
//! [`with_engine`] builds the backend's engine and hands it to a command's generic body
//! ([`EngineTask`]). A new backend adds its arm here and its knob value.

use anyhow::Context;
use kiln_model::{
    BackendEngine, Capabilities, Engine, EngineOptions, LoadedModel, MemoryPlan, ModelConfig, Needs, RunShape,
};
use kiln_protocol::{ActScheme, Backend};

use crate::args::RunArgs;
use crate::exit::usage;

/// A backend checked against this build and a command's needs.
#[derive(Clone, Copy, Debug)]
pub struct Chosen {
    /// Which.
    pub backend: Backend,
    /// What it runs.
    pub caps: Capabilities,
    /// The activation scheme its products run (`KILN_ACT_PRECISION`, or its own default).
    pub act: ActScheme,
}

/// What a command asks beside `--attention`, `--kv-dtype`, `--expert-slots` and the
/// activation scheme, which every command's [`RunArgs`] carry.
#[derive(Clone, Copy, Debug, Default)]
pub struct Asks {
    /// `--speculative`.
    pub speculative: bool,
    /// Several sequences per forward and prefix sharing (`kiln serve`).
    pub serving: bool,
}

/// What `backend` runs, when this build has it.
pub fn capabilities(backend: Backend) -> anyhow::Result<Capabilities> {
    match backend {
        Backend::Cpu => Ok(kiln_model::backend::CPU),
        #[cfg(feature = "cuda")]
        Backend::Cuda => Ok(kiln_cuda::backend::CAPABILITIES),
        #[cfg(not(feature = "cuda"))]
        Backend::Cuda => Err(usage(
            "invalid --backend cuda: this kiln was built without the `cuda` feature; build it with \
             `cargo build --release -p kiln --features cuda` (docs/cuda.md), or use --backend cpu",
        )),
        #[cfg(feature = "vulkan")]
        Backend::Vulkan => Ok(kiln_wgpu::backend::CAPABILITIES),
        #[cfg(not(feature = "vulkan"))]
        Backend::Vulkan => Err(usage(
            "invalid --backend vulkan: this kiln was built without the `vulkan` feature; build it with \
             `cargo build --release -p kiln --features vulkan` (docs/metal.md), or use --backend cpu",
        )),
        #[cfg(feature = "metal")]
        Backend::Metal => Ok(Capabilities { name: "metal", ..kiln_wgpu::backend::CAPABILITIES }),
        #[cfg(not(feature = "metal"))]
        Backend::Metal => Err(usage(
            "invalid --backend metal: this kiln was built without the `metal` feature; build it on macOS with \
             `cargo build --release -p kiln --features metal` (docs/metal.md), or use --backend cpu",
        )),
    }
}

/// Checks `--backend` against this build, and the command's needs against what the
/// backend runs: the first need it does not meet is refused (exit 2), naming the flag,
/// the backend and what it runs instead.
pub fn check(args: &RunArgs, asks: Asks) -> anyhow::Result<Chosen> {
    let caps = capabilities(args.backend)?;
    let act = ActScheme::asked_in_env().map_err(usage)?;
    let needs = Needs {
        attention: args.attention,
        kv_dtype: args.kv_dtype,
        act,
        expert_slots: args.expert_slots.is_some(),
        speculative: asks.speculative,
        batched_decode: asks.serving,
        prompt_cache: asks.serving,
    };
    caps.check(&needs).map_err(|e| usage(e.to_string()))?;
    Ok(Chosen { backend: args.backend, caps, act: caps.act_scheme(act) })
}

/// A command's body, generic over the engine it runs on.
pub trait EngineTask {
    /// What it returns.
    type Out;
    /// Runs on `engine`. `label` names where it runs (`cpu`, or the device's name).
    fn run<B: BackendEngine>(self, engine: B, label: &str) -> anyhow::Result<Self::Out>;
}

/// Builds the chosen backend's engine over `model` (the weights copied to the device for
/// `cuda`, which is opened here and says on stderr where it runs) and runs `task` on it.
pub fn with_engine<T: EngineTask>(
    chosen: &Chosen,
    args: &RunArgs,
    model: &LoadedModel,
    pool: &kiln_core::MemoryPool,
    options: EngineOptions,
    task: T,
) -> anyhow::Result<T::Out> {
    match chosen.backend {
        Backend::Cpu => {
            let engine = Engine::new(model, pool, options).context("preparing the forward pass")?;
            task.run(engine, "cpu")
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda => {
            let exec = open_device(args)?;
            let engine = cuda_engine(&exec, model, &options)?;
            let label = exec.name();
            task.run(engine, &label)
        }
        #[cfg(any(feature = "vulkan", feature = "metal"))]
        Backend::Vulkan | Backend::Metal => {
            let exec = open_wgpu(args, chosen.backend)?;
            let mut engine = kiln_wgpu::WgpuEngine::new(&exec, &model.config, &model.weights)
                .context("copying the weights to the device")?;
            engine.set_act_scheme(chosen.act).map_err(kiln_model::ModelError::from)?;
            say_wgpu(chosen.backend, &engine);
            let label = exec.name();
            task.run(kiln_wgpu::backend::WgpuBackend { engine, prefill_chunk: options.prefill_chunk }, &label)
        }
        #[allow(unreachable_patterns)]
        _ => {
            let _ = args;
            unreachable!("check refuses a backend this build lacks")
        }
    }
}

/// The chosen backend's memory plan of `shape` (no engine built, no device opened).
pub fn plan(
    chosen: &Chosen,
    config: &ModelConfig,
    weights_bytes: u64,
    shape: &RunShape,
) -> kiln_model::Result<MemoryPlan> {
    match chosen.backend {
        Backend::Cpu => <Engine<'_> as BackendEngine>::plan(config, weights_bytes, shape),
        #[cfg(feature = "cuda")]
        Backend::Cuda => <kiln_cuda::DeviceEngine<'_> as BackendEngine>::plan(config, weights_bytes, shape),
        #[cfg(any(feature = "vulkan", feature = "metal"))]
        Backend::Vulkan | Backend::Metal => {
            <kiln_wgpu::backend::WgpuBackend<'_> as BackendEngine>::plan(config, weights_bytes, shape)
        }
        #[allow(unreachable_patterns)]
        _ => unreachable!("check refuses a backend this build lacks"),
    }
}

/// The batch sizes a device backend's products run `qmv_wide` for (`2-8`), as the
/// kernel-configuration line says them.
pub fn device_wide_rows(chosen: &Chosen) -> String {
    match chosen.backend {
        #[cfg(feature = "cuda")]
        Backend::Cuda => kiln_cuda::launch::wide_rows(),
        #[cfg(any(feature = "vulkan", feature = "metal"))]
        Backend::Vulkan | Backend::Metal => format!("2-{}", kiln_wgpu::kernels::QMV_WIDE_MAX_ROWS),
        _ => "none".into(),
    }
}

/// Whether the weights stay in host memory for the CPU's kernels (repacked for them).
pub fn runs_on_host(chosen: &Chosen) -> bool {
    chosen.backend == Backend::Cpu
}

/// The engine a `kiln serve` runs on: built on the scheduler thread, so a device's
/// context lives on the thread that launches on it.
pub fn server_engine(chosen: &Chosen, args: &RunArgs) -> std::sync::Arc<dyn kiln_serve::EngineBuilder> {
    match chosen.backend {
        #[cfg(feature = "cuda")]
        Backend::Cuda => std::sync::Arc::new(CudaServer { args: args.clone() }),
        #[cfg(any(feature = "vulkan", feature = "metal"))]
        Backend::Vulkan | Backend::Metal => std::sync::Arc::new(WgpuServer {
            args: args.clone(),
            backend: chosen.backend,
            caps: chosen.caps,
            act: chosen.act,
        }),
        _ => {
            let _ = args;
            std::sync::Arc::new(kiln_serve::CpuEngine)
        }
    }
}

/// `kiln serve --backend cuda`'s engine.
#[cfg(feature = "cuda")]
#[derive(Debug)]
struct CudaServer {
    args: RunArgs,
}

#[cfg(feature = "cuda")]
impl kiln_serve::EngineBuilder for CudaServer {
    fn capabilities(&self) -> Capabilities {
        kiln_cuda::backend::CAPABILITIES
    }

    fn build_and_run<'a>(
        &self,
        model: &'a LoadedModel,
        options: EngineOptions,
        run: kiln_serve::RunScheduler<'a>,
    ) -> kiln_model::Result<()> {
        let exec = open_device(&self.args).map_err(device_error)?;
        let engine = cuda_engine(&exec, model, &options).map_err(device_error)?;
        run.run(engine)
    }
}

/// The device engine over `model` on `exec`: the weights copied to the device, CUDA graphs
/// as `KILN_CUDA_GRAPHS` says, the prefill chunk of `options`. The one-shot commands and
/// `kiln serve` build it here alike.
#[cfg(feature = "cuda")]
fn cuda_engine<'m>(
    exec: &'m kiln_cuda::Exec,
    model: &'m LoadedModel,
    options: &EngineOptions,
) -> anyhow::Result<kiln_cuda::DeviceEngine<'m>> {
    let graphs = crate::runtime::graphs_from_env()?;
    let mut engine = kiln_cuda::DeviceEngine::new(exec, &model.config, &model.weights)
        .context("copying the weights to the device")?;
    engine.set_graphs(graphs);
    engine.set_prefill_chunk(options.prefill_chunk);
    Ok(engine)
}

/// `kiln serve --backend vulkan|metal`'s engine, built on the scheduler thread (a wgpu
/// executor stays on the thread that opened it).
#[cfg(any(feature = "vulkan", feature = "metal"))]
#[derive(Debug)]
struct WgpuServer {
    args: RunArgs,
    backend: Backend,
    caps: Capabilities,
    act: ActScheme,
}

#[cfg(any(feature = "vulkan", feature = "metal"))]
impl kiln_serve::EngineBuilder for WgpuServer {
    fn capabilities(&self) -> Capabilities {
        self.caps
    }

    fn build_and_run<'a>(
        &self,
        model: &'a LoadedModel,
        options: EngineOptions,
        run: kiln_serve::RunScheduler<'a>,
    ) -> kiln_model::Result<()> {
        let exec = open_wgpu(&self.args, self.backend).map_err(device_error)?;
        let mut engine = kiln_wgpu::WgpuEngine::new(&exec, &model.config, &model.weights)?;
        engine.set_act_scheme(self.act)?;
        say_wgpu(self.backend, &engine);
        run.run(kiln_wgpu::backend::WgpuBackend { engine, prefill_chunk: options.prefill_chunk })
    }
}

/// The device pool's limit the user gave: `--memory-limit`, else `KILN_MEMORY_LIMIT`
/// (`None`: the device's own memory).
#[cfg(any(feature = "cuda", feature = "vulkan", feature = "metal"))]
fn explicit_limit(args: &RunArgs) -> anyhow::Result<Option<u64>> {
    Ok(match &args.memory_limit {
        Some(text) => Some(
            kiln_core::size::parse_size(text).map_err(|e| usage(format!("invalid --memory-limit: {e}")))?,
        ),
        None => kiln_core::MemoryPool::limit_from_env()?,
    })
}

/// The adapter a `--backend vulkan|metal` run would take, without opening a device, and
/// the limit its pool would have: the adapter's memory, or `--memory-limit` /
/// `KILN_MEMORY_LIMIT` when smaller. `None` for cpu and cuda (`kiln estimate` opens no
/// CUDA device; its harness reads the GPU's memory from nvidia-smi).
pub fn adapter(chosen: &Chosen, args: &RunArgs) -> anyhow::Result<Option<(kiln_protocol::DeviceDesc, u64)>> {
    match chosen.backend {
        #[cfg(any(feature = "vulkan", feature = "metal"))]
        Backend::Vulkan | Backend::Metal => {
            let which = if chosen.backend == Backend::Metal {
                kiln_wgpu::Backend::Metal
            } else {
                kiln_wgpu::Backend::Vulkan
            };
            let explicit = explicit_limit(args)?;
            let a = kiln_wgpu::AdapterDesc::probe(which)
                .map_err(kiln_model::ModelError::from)
                .with_context(|| format!("finding the {} adapter", chosen.backend))?;
            let limit = kiln_wgpu::pool::device_limit(a.memory_bytes, &[explicit]);
            let desc = kiln_protocol::DeviceDesc {
                name: a.name,
                backend: a.backend.into(),
                driver: a.driver,
                driver_info: a.driver_info,
                device_type: a.device_type,
                memory_bytes: a.memory_bytes,
                memory_source: a.memory_source.into(),
            };
            Ok(Some((desc, limit)))
        }
        _ => {
            let _ = args;
            Ok(None)
        }
    }
}

/// A device that did not open (or take the weights) for `kiln serve`'s scheduler thread,
/// as the model error the server reports at start, in the class the one-shot commands
/// give the same error: out of memory (exit 3), usage (exit 2) or other (exit 1).
#[cfg(any(feature = "cuda", feature = "vulkan", feature = "metal"))]
fn device_error(e: anyhow::Error) -> kiln_model::ModelError {
    use crate::exit::Kind;
    use kiln_model::BackendErrorKind;
    let kind = match crate::exit::classify(&e) {
        Kind::OutOfMemory => BackendErrorKind::OutOfMemory,
        Kind::Usage => BackendErrorKind::Usage,
        Kind::BrokenPipe | Kind::Other => BackendErrorKind::Other,
    };
    kiln_model::ModelError::backend(kind, std::io::Error::other(format!("{e:#}")))
}

/// Opens the first wgpu adapter of `backend` (Vulkan or Metal), its pool limited by the
/// device's memory or `--memory-limit` / `KILN_MEMORY_LIMIT` when smaller. Says on stderr
/// which adapter runs.
#[cfg(any(feature = "vulkan", feature = "metal"))]
fn open_wgpu(args: &RunArgs, backend: Backend) -> anyhow::Result<kiln_wgpu::WgpuExec> {
    let explicit = explicit_limit(args)?;
    let which =
        if backend == Backend::Metal { kiln_wgpu::Backend::Metal } else { kiln_wgpu::Backend::Vulkan };
    let exec = kiln_wgpu::WgpuExec::open(which, explicit)
        .map_err(kiln_model::ModelError::from)
        .with_context(|| format!("opening the {backend} device"))?;
    eprintln!(
        "kiln: --backend {backend} on {} (device pool limit {} bytes)",
        exec.name(),
        exec.pool().limit()
    );
    Ok(exec)
}

/// Says on stderr what the wgpu products run: the activation scheme (`act=`) and, for the
/// integer schemes, whether WGSL's packed dot products are used (`dot=packed|plain`).
#[cfg(any(feature = "vulkan", feature = "metal"))]
fn say_wgpu(backend: Backend, engine: &kiln_wgpu::WgpuEngine<'_>) {
    eprintln!("kiln: --backend {backend} products: {}", engine.products_desc());
}

/// Opens GPU 0, its pool limited by its free memory or `--memory-limit` /
/// `KILN_MEMORY_LIMIT` when smaller; or the host execution under `KILN_CUDA_EMULATE=1`,
/// limited as the CPU pool would be. Says on stderr which.
#[cfg(feature = "cuda")]
fn open_device(args: &RunArgs) -> anyhow::Result<kiln_cuda::Exec> {
    let explicit = explicit_limit(args)?;
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
