//! `kiln serve`: the OpenAI-compatible server. Sets up logging and the kernels' worker
//! pool, logs the kernel configuration, binds, starts kiln-serve's scheduler (which
//! loads the model while `/health` answers 503) and serves until SIGINT or SIGTERM, then
//! drains: no new requests, in-flight ones get `--shutdown-grace` to finish, the rest are
//! cancelled, and the process exits 0. docs/serve.md describes every flag.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use kiln_core::kernels::Isa;
use kiln_core::size::parse_size;
use kiln_core::wide::{qmv_wide_enabled, qmv_wide_pinned_by_operator};
use kiln_serve::{ConnLimits, SchedulerOptions, Server, ServerConfig, Shared, ThinkTags};

use crate::args::{RunArgs, SecondsRange};
use crate::exit::usage;
use crate::runtime;

/// The environment variable holding the API key when `--api-key` is not given.
pub const API_KEY_ENV: &str = "KILN_API_KEY";

/// `--shutdown-grace`: 0 (cancel at once) to a day.
const GRACE: SecondsRange = SecondsRange { min: 0.0, min_included: true, max: 86_400.0 };
/// `--header-timeout`, `--body-timeout`: above 0, to an hour.
const TIMEOUT: SecondsRange = SecondsRange { min: 0.0, min_included: false, max: 3_600.0 };
/// `--keep-alive-timeout`: 0 (no keep-alive) to an hour.
const KEEP_ALIVE: SecondsRange = SecondsRange { min: 0.0, min_included: true, max: 3_600.0 };
/// `--max-connections` when not given, unless `--parallel` plus `--max-queue` (plus 64)
/// is more, or the open-file limit allows fewer.
const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Descriptors kept for the server's own files (stdio, the listener, the runtime's,
/// model files, /proc) beside its connections.
const FD_RESERVE: u64 = 64;

/// `--prefill-chunk` of `kiln serve`, which shares [`RunArgs`]' flag with another default.
const PREFILL_CHUNK_HELP: &str = "Prompt tokens run per step over all requests still reading their prompts; \
     they share the step's forward with the decoding requests. 0 runs every prompt whole";

/// Log line format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line; the message is `fields.message`.
    Json,
}

/// `kiln serve`.
#[derive(Args, Debug)]
#[command(mut_arg("prefill_chunk", |a| a.default_value("512").help(PREFILL_CHUNK_HELP)))]
pub struct ServeArgs {
    /// Model, memory, attention, KV dtype, quantization, threads and expert slots, as
    /// every command takes them; `--prefill-chunk` has its own default and meaning here.
    #[command(flatten)]
    pub run: RunArgs,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to bind; 0 picks a free one (the `listening on` line names it).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Slots: requests decoded together, in one forward per step.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub parallel: usize,
    /// Byte budget of the prompt cache (`256MiB`, bytes); 0 disables it.
    #[arg(long, value_name = "SIZE", default_value = "256MiB")]
    pub prompt_cache_bytes: String,
    /// Requests waiting for a slot before new ones get 429.
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub max_queue: usize,
    /// Largest request body (`1MiB`, bytes); larger ones get 413.
    #[arg(long, value_name = "SIZE", default_value = "4MiB")]
    pub max_body_bytes: String,
    /// Seconds a request's headers may take to arrive, from the connection opening or the
    /// previous response ending; the connection is closed after that. Above 0, to 3600.
    #[arg(long, value_name = "SECONDS", default_value = "10", allow_hyphen_values = true,
          value_parser = |s: &str| TIMEOUT.parse(s))]
    pub header_timeout: Duration,
    /// Seconds a request's body may take to arrive after its headers; later ones get 408.
    /// Above 0, to 3600.
    #[arg(long, value_name = "SECONDS", default_value = "30", allow_hyphen_values = true,
          value_parser = |s: &str| TIMEOUT.parse(s))]
    pub body_timeout: Duration,
    /// Seconds an idle keep-alive connection stays open; 0 closes every connection after
    /// its response. 0 to 3600.
    #[arg(long, value_name = "SECONDS", default_value = "5", allow_hyphen_values = true,
          value_parser = |s: &str| KEEP_ALIVE.parse(s))]
    pub keep_alive_timeout: Duration,
    /// Connections open at once; at the limit a new one closes the oldest without a
    /// request in flight. Default: 1024, or --parallel + --max-queue + 64 when more, at
    /// most the open-file limit (raised to its hard limit at start) less 64.
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,
    /// Require `Authorization: Bearer KEY` on /v1/*; default: KILN_API_KEY when set.
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Seconds in-flight requests get to finish after SIGINT or SIGTERM, 0 to 86400.
    #[arg(long, value_name = "SECONDS", default_value = "30", allow_hyphen_values = true,
          value_parser = |s: &str| GRACE.parse(s))]
    pub shutdown_grace: Duration,
    /// Log line format on stderr.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Name clients send as `model` and /v1/models lists; default: the synthetic name, a
    /// GGUF file's general.name (else its file stem), or the checkpoint directory's name.
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// A Jinja chat template file that replaces the model's own on the chat endpoint
    /// (and in /tokenizer_info), as vLLM's and llama-server's flag does: for a model whose
    /// template has no tool syntax. Its BOS and EOS texts are the model's.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<std::path::PathBuf>,
    /// Tag that opens reasoning on the chat endpoint.
    #[arg(long, value_name = "TAG", default_value = "<think>")]
    pub think_open: String,
    /// Tag that closes reasoning.
    #[arg(long, value_name = "TAG", default_value = "</think>")]
    pub think_close: String,
    /// Every request asks for a speculative slot, not only those sending
    /// `"speculative": true`.
    #[arg(long)]
    pub speculative: bool,
    /// Speculative slots: requests decoding speculatively at once; the others decode in
    /// the joint forward.
    #[arg(long, value_name = "S", default_value_t = 1)]
    pub spec_slots: usize,
    /// Tokens drafted per verify (K; the verify forward runs K + 1 positions).
    #[arg(long, value_name = "K", default_value_t = kiln_model::speculative::DEFAULT_DRAFT_TOKENS)]
    pub draft_tokens: usize,
    /// A draft model of the same vocabulary for speculative slots, instead of prompt lookup.
    #[arg(long, value_name = "MODEL")]
    pub model_draft: Option<String>,
}

/// The largest `--chat-template` file read: real templates are a few KiB to tens of KiB.
const MAX_CHAT_TEMPLATE_BYTES: u64 = 1 << 20;

/// The `--chat-template` file, compiled now so a bad one is refused at start (exit 2
/// naming the file): a regular file (a FIFO would block the start) of at most
/// [`MAX_CHAT_TEMPLATE_BYTES`], UTF-8, whose Jinja compiles.
fn read_chat_template(path: &std::path::Path) -> anyhow::Result<kiln_model::chat_template::ChatTemplate> {
    use std::io::Read;
    let bad = |why: String| {
        usage(format!(
            "invalid --chat-template {}: {why}; accepted is a regular file of Jinja text of at most {MAX_CHAT_TEMPLATE_BYTES} bytes",
            path.display()
        ))
    };
    match kiln_model::source::regular_file(path) {
        Ok(true) => {}
        Ok(false) => return Err(bad("no such file".into())),
        Err(e) => return Err(bad(e.to_string())),
    }
    let file = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let mut text = String::new();
    let read = file.take(MAX_CHAT_TEMPLATE_BYTES + 1).read_to_string(&mut text);
    match read {
        Err(e) => return Err(bad(format!("not UTF-8 text ({e})"))),
        Ok(n) if n as u64 > MAX_CHAT_TEMPLATE_BYTES => return Err(bad("it is larger".into())),
        Ok(_) => {}
    }
    kiln_model::chat_template::ChatTemplate::new(text, None, None, path).map_err(|e| bad(e.to_string()))
}

/// Runs the server until a signal stops it.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    init_logging(args.log_format);
    runtime::check_threads(args.run.threads)?;
    let asks = crate::backend::Asks { speculative: args.speculative, serving: true };
    let chosen = crate::backend::check(&args.run, asks)?;
    if args.parallel == 0 {
        return Err(usage("invalid --parallel 0: accepted values are 1 or more"));
    }
    if !(1..=crate::speculate::MAX_DRAFT_TOKENS).contains(&args.draft_tokens) {
        return Err(usage(format!(
            "invalid --draft-tokens {}: accepted values are 1 to {}",
            args.draft_tokens,
            crate::speculate::MAX_DRAFT_TOKENS
        )));
    }
    if args.max_queue == 0 {
        return Err(usage("invalid --max-queue 0: accepted values are 1 or more"));
    }
    if args.think_open.is_empty() || args.think_close.is_empty() {
        return Err(usage("invalid --think-open/--think-close: the tags must not be empty"));
    }
    let prompt_cache_bytes = parse_size(&args.prompt_cache_bytes)
        .map_err(|e| usage(format!("invalid --prompt-cache-bytes: {e}")))?;
    let max_body_bytes =
        parse_size(&args.max_body_bytes).map_err(|e| usage(format!("invalid --max-body-bytes: {e}")))?;
    if max_body_bytes == 0 {
        // Every POST would be answered 413: no request could be served.
        return Err(usage(format!(
            "invalid --max-body-bytes {:?}: accepted values are 1 byte or more (`4MiB`, bytes)",
            args.max_body_bytes
        )));
    }
    if let Some(name) = &args.served_model_name
        && (name.trim().is_empty() || name.chars().any(char::is_control))
    {
        return Err(usage(format!(
            "invalid --served-model-name {name:?}: accepted is a non-blank name without control characters"
        )));
    }
    let limits = ConnLimits {
        header_timeout: args.header_timeout,
        keep_alive: (!args.keep_alive_timeout.is_zero()).then_some(args.keep_alive_timeout),
        max_connections: max_connections(
            args.max_connections,
            raise_open_file_limit(),
            DEFAULT_MAX_CONNECTIONS.max(args.parallel.saturating_add(args.max_queue).saturating_add(64)),
        )?,
    };
    let run_args = &args.run;
    let pool = runtime::pool(run_args)?;
    if run_args.expert_slots.is_some() {
        // The geometry is checked, naming the model, before anything is loaded.
        let info = kiln_model::inspect(&run_args.model, &runtime::load_options(run_args, &pool))
            .with_context(|| format!("reading model {}", run_args.model))?;
        runtime::expert_geometry(run_args, &info.config, info.expert_slot_bytes, info.weight_bytes, &pool)?;
    }
    let chat_template = match &args.chat_template {
        Some(path) => Some(read_chat_template(path)?),
        None => None,
    };
    let api_key = api_key(args.api_key.as_deref(), std::env::var_os(API_KEY_ENV))?;
    let config = ServerConfig {
        model: run_args.model.clone(),
        model_id: match &args.served_model_name {
            Some(name) => name.clone(),
            // A model that does not resolve fails to load with its own message; until then
            // it is listed under what was typed.
            None => kiln_model::ModelSource::resolve(&run_args.model)
                .and_then(|source| kiln_model::default_model_id(&source))
                .unwrap_or_else(|_| run_args.model.clone()),
        },
        load: runtime::load_options(run_args, &pool),
        engine: runtime::engine_options(run_args),
        scheduler: SchedulerOptions {
            parallel: args.parallel,
            prefill_chunk: run_args.prefill_chunk,
            prompt_cache_bytes,
            speculative: args.speculative,
            // A backend without a verify forward holds no speculative slot: a request
            // asking for speculation decodes in the joint forward.
            spec_slots: if chosen.caps.speculative { args.spec_slots } else { 0 },
            draft_tokens: args.draft_tokens,
        },
        model_draft: args.model_draft.clone(),
        max_queue: args.max_queue,
        max_body_bytes: usize::try_from(max_body_bytes).unwrap_or(usize::MAX),
        body_timeout: args.body_timeout,
        api_key,
        think_tags: ThinkTags { open: args.think_open.clone(), close: args.think_close.clone() },
        chat_template,
        backend: crate::backend::server_engine(&chosen, run_args),
    };

    let mut builder = rayon::ThreadPoolBuilder::new().thread_name(|i| format!("kiln-worker-{i}"));
    if let Some(n) = run_args.threads {
        builder = builder.num_threads(n);
    }
    let workers = Arc::new(builder.build().context("starting the worker threads")?);
    let kernels = if crate::backend::runs_on_host(&chosen) {
        // A server batches: it measures the crossover on its own workers when none is cached.
        let (_, crossover_source) = workers.install(|| runtime::configure_kernels(true))?;
        if let kiln_core::crossover::CrossoverSource::MeasuredBusy { others_centi } = crossover_source {
            tracing::warn!(
                "the qmv_wide crossover was measured while other processes used {:.2} CPUs: it is used for \
                 this boot but not cached (KILN_QMV_CROSSOVER_BUSY_LIMIT); boot again on a quiet machine to cache it",
                f64::from(others_centi) / 100.0
            );
        }
        kiln_protocol::KernelConfigLine {
            isa: Isa::detected().as_str().to_string(),
            threads: workers.current_num_threads(),
            qmv_wide: qmv_wide_enabled(),
            qmv_wide_pinned: qmv_wide_pinned_by_operator(),
            qmv_wide_rows: Some(kiln_core::wide::wide_rows().to_string()),
            qmv_crossover: Some(crossover_source.as_str().to_string()),
            act: Some(chosen.act),
        }
    } else {
        // The device's products choose by rows alone (`kiln_cuda::launch::product_kernel`):
        // `qmv` for one, `qmv_wide` up to its limit, `qmm` beyond; nothing is measured.
        kiln_protocol::KernelConfigLine {
            isa: chosen.caps.name.to_string(),
            threads: workers.current_num_threads(),
            qmv_wide: true,
            qmv_wide_pinned: false,
            qmv_wide_rows: Some(crate::backend::device_wide_rows(&chosen)),
            qmv_crossover: Some("fixed".into()),
            act: Some(chosen.act),
        }
    };
    tracing::info!("{kernels}");

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kiln-http")
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    let server = rt.block_on(serve(&args.host, args.port, config, limits, workers, args.shutdown_grace))?;
    server.stop();
    tracing::info!("stopped");
    Ok(())
}

async fn serve(
    host: &str,
    port: u16,
    config: ServerConfig,
    limits: ConnLimits,
    workers: Arc<rayon::ThreadPool>,
    grace: Duration,
) -> anyhow::Result<Server> {
    let addr = if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
    let listener = std::net::TcpListener::bind(&addr).map_err(|e| {
        usage(format!("cannot listen on {addr}: {e}; choose another --port or --host, or stop what holds it"))
    })?;
    listener.set_nonblocking(true).context("configuring the listener")?;
    let listener = tokio::net::TcpListener::from_std(listener).context("configuring the listener")?;
    let local = listener.local_addr().context("reading the bound address")?;
    let keyless = config.api_key.is_none();
    let body_timeout = config.body_timeout;
    let server = Server::start(config, Some(workers)).context("starting the scheduler thread")?;
    tracing::info!("{}", kiln_protocol::ListeningLine { addr: local });
    tracing::info!(
        "connection limits: max_connections={} header_timeout={:?} body_timeout={:?} keep_alive={}",
        limits.max_connections,
        limits.header_timeout,
        body_timeout,
        limits.keep_alive.map_or_else(|| "off".to_string(), |d| format!("{d:?}")),
    );
    if keyless && !local.ip().is_loopback() {
        tracing::warn!(
            "serving {local} without an API key: anyone who can reach this address can use the server; \
             set --api-key or {API_KEY_ENV}, or bind a loopback address such as 127.0.0.1"
        );
    }
    let shared = server.shared();
    let app = kiln_serve::app(shared.clone());
    let serving = kiln_serve::conn::serve(listener, app, limits, shutdown(shared, grace));
    tokio::select! {
        () = serving => {}
        e = server.failed() => return Err(anyhow::Error::new(e)),
    }
    Ok(server)
}

/// Raises the process's soft open-file limit (`ulimit -n`) to its hard limit, as servers
/// commonly do, and returns the soft limit then in force; `None` when unlimited or
/// unknown. Every connection holds a descriptor.
fn raise_open_file_limit() -> Option<u64> {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one `rlimit` through a pointer to this live local.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } != 0 {
        return None;
    }
    if rl.rlim_cur < rl.rlim_max {
        let raised = libc::rlimit { rlim_cur: rl.rlim_max, rlim_max: rl.rlim_max };
        // SAFETY: setrlimit reads one `rlimit` through a pointer to this live local.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            rl = raised;
        }
    }
    // rlim_t is u64 on Linux, not on every Unix.
    #[allow(clippy::unnecessary_cast)]
    let soft = rl.rlim_cur as u64;
    (rl.rlim_cur != libc::RLIM_INFINITY).then_some(soft)
}

/// `--max-connections`, checked against the open-file limit `nofile` less
/// [`FD_RESERVE`]: more connections than descriptors would make accepting fail (and
/// `/health` stop answering) before the limit is reached.
/// `wanted` is the default when the limit allows it.
fn max_connections(flag: Option<usize>, nofile: Option<u64>, wanted: usize) -> anyhow::Result<usize> {
    let room = nofile.map(|n| usize::try_from(n.saturating_sub(FD_RESERVE)).unwrap_or(usize::MAX));
    let why = |n: u64| {
        format!("the open-file limit (ulimit -n) of {n} less {FD_RESERVE} kept for the server's own files")
    };
    match (flag, room, nofile) {
        (Some(0), _, _) => Err(usage(format!(
            "invalid --max-connections 0: accepted values are 1 to {}",
            room.map_or_else(|| "any count".to_string(), |r| r.to_string())
        ))),
        (Some(n), Some(r), Some(limit)) if n > r => Err(usage(format!(
            "invalid --max-connections {n}: accepted values are 1 to {r}, {}; lower it or raise the limit",
            why(limit)
        ))),
        (Some(n), _, _) => Ok(n),
        (None, Some(0), Some(limit)) => {
            Err(usage(format!("{} leaves no room for connections: raise the limit (ulimit -n)", why(limit))))
        }
        (None, Some(r), _) => Ok(r.min(wanted)),
        (None, None, _) => Ok(wanted),
    }
}

/// The API key from `--api-key`, else from `KILN_API_KEY`; `None` when neither is set.
/// An empty key would silently turn authentication off, and one with surrounding
/// whitespace or control characters could never be sent in a header, so both are usage
/// errors naming where the key came from.
fn api_key(flag: Option<&str>, env: Option<std::ffi::OsString>) -> anyhow::Result<Option<String>> {
    let (key, source) = match (flag, env) {
        (Some(k), _) => (k.to_string(), "--api-key".to_string()),
        (None, Some(v)) => match v.into_string() {
            Ok(k) => (k, API_KEY_ENV.to_string()),
            Err(_) => return Err(usage(format!("invalid {API_KEY_ENV}: the key is not valid UTF-8"))),
        },
        (None, None) => return Ok(None),
    };
    let unset = if source == API_KEY_ENV {
        format!("unset {API_KEY_ENV}")
    } else {
        "leave --api-key out".to_string()
    };
    if key.is_empty() {
        return Err(usage(format!(
            "invalid {source}: the key is empty, which would turn authentication off; give a non-empty key, \
             or {unset} to serve without one"
        )));
    }
    if key.trim() != key || key.chars().any(char::is_control) {
        return Err(usage(format!(
            "invalid {source}: the key has leading or trailing whitespace or a control character, which no \
             client can send in an Authorization header; accepted is a key of printable characters"
        )));
    }
    Ok(Some(key))
}

/// Resolves on SIGINT or SIGTERM once the requests already taken are done, or once
/// `grace` has passed and the rest were cancelled. Until then the listener stays open and
/// new requests get 503.
async fn shutdown(shared: Arc<Shared>, grace: Duration) {
    wait_for_signal().await;
    tracing::info!("shutting down: refusing new requests, {:.1} s for in-flight ones", grace.as_secs_f64());
    shared.begin_drain();
    let deadline = tokio::time::Instant::now() + grace;
    // Only while draining: look at the scheduler's gauges every few milliseconds.
    while shared.busy() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if shared.busy() {
        tracing::info!("shutdown grace over: cancelling the requests still running");
        shared.cancel_all();
    }
}

#[cfg(unix)]
async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(e) => {
            tracing::warn!("cannot watch SIGTERM ({e}); only SIGINT stops the server");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(not(unix))]
async fn wait_for_signal() {
    let _ = tokio::signal::ctrl_c().await;
}

fn init_logging(format: LogFormat) {
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_target(false);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
