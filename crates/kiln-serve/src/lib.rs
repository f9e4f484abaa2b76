//! kiln-serve: an OpenAI-compatible server over kiln-model. One scheduler thread owns
//! the engine and every cache and batches all decoding requests into one forward per
//! step ([`scheduler`]); an axum app ([`http::app`]) checks requests, hands them to the
//! scheduler over a channel and streams the tokens back. `kiln serve` is the binary's
//! front end; tests build the same [`Server`] and bind port 0. [`conn::serve`] is the
//! connection loop the binary runs the app on (header, keep-alive and connection bounds).
//! [`tokenize`] answers `/tokenize` and `/detokenize`.
#![deny(missing_docs)]

pub mod access_log;
pub mod api;
mod body;
pub mod conn;
pub mod error;
pub mod http;
pub mod logprobs;
pub mod metrics;
pub mod prompt_cache;
pub mod scheduler;
pub mod structured;
pub mod text;
pub mod tokenize;
pub mod tools;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, OnceLock};

use kiln_model::{Engine, EngineOptions, LoadOptions, LoadedModel};
use tokio::sync::watch;

pub use conn::ConnLimits;
pub use error::{ApiError, ServeError};
pub use http::app;
pub use scheduler::SchedulerOptions;
pub use text::ThinkTags;

/// Everything a server is made of.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The model to load (`synthetic:...`, a directory).
    pub model: String,
    /// The name clients send as `model` and `/v1/models` lists.
    pub model_id: String,
    /// How to load it (the pool every byte is counted in).
    pub load: LoadOptions,
    /// How the forward runs.
    pub engine: EngineOptions,
    /// Slots, prefill chunking, the prompt cache and speculation.
    pub scheduler: SchedulerOptions,
    /// The draft model of speculative slots; prompt lookup when `None`.
    pub model_draft: Option<String>,
    /// Requests waiting for a slot before new ones get 429.
    pub max_queue: usize,
    /// Largest request body; larger ones get 413.
    pub max_body_bytes: usize,
    /// How long a request's body may take to arrive after its headers; later ones get 408.
    pub body_timeout: std::time::Duration,
    /// When set, `/v1/*` requires `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Reasoning is the text between these tags on the chat endpoint.
    pub think_tags: ThinkTags,
    /// A chat template that replaces the model's own (`kiln serve --chat-template`), for
    /// a model whose template lacks what a client needs (tool syntax); its BOS and EOS
    /// texts, when it names none, are the model's.
    pub chat_template: Option<kiln_model::chat_template::ChatTemplate>,
}

/// State the handlers and the scheduler share.
pub struct Shared {
    /// The configuration.
    pub config: ServerConfig,
    /// The loaded model, once loading is done.
    model: OnceLock<Arc<LoadedModel>>,
    /// The structured-output parser factory of the model's vocabulary, built at the
    /// first request that constrains its output (or the reason it cannot be).
    grammars: OnceLock<Result<structured::Grammars, String>>,
    /// The permits of the grammar compiles running at once ([`structured::admit`]).
    grammar_workers: Arc<tokio::sync::Semaphore>,
    /// Counters for `/metrics`.
    pub metrics: Arc<metrics::Metrics>,
    commands: Mutex<Sender<scheduler::Command>>,
    draining: AtomicBool,
    /// Random per boot, so response ids differ across boots and servers.
    boot_id: u64,
    next_id: AtomicU64,
    fatal: watch::Sender<Option<Arc<ServeError>>>,
}

impl Shared {
    /// The model, once loaded.
    pub fn model(&self) -> Option<&Arc<LoadedModel>> {
        self.model.get()
    }

    /// The structured-output parser factory of `model`'s vocabulary, built once; a 400
    /// naming `field` when the vocabulary cannot be read as bytes.
    pub fn grammars(&self, model: &LoadedModel, field: &str) -> Result<&structured::Grammars, ApiError> {
        let built = self.grammars.get_or_init(|| {
            structured::Grammars::new(
                &model.tokenizer,
                model.config.vocab_size,
                &scheduler::eos_tokens(model),
            )
        });
        built.as_ref().map_err(|e| {
            ApiError::invalid(field, format!("{field} is not available for this model's tokenizer: {e}"))
        })
    }

    /// Whether the server stopped admitting requests.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Stops admitting requests: new ones get 503, running ones continue.
    pub fn begin_drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Whether requests are queued or running.
    pub fn busy(&self) -> bool {
        self.metrics.queue_depth.load(Ordering::Relaxed) + self.metrics.active_slots.load(Ordering::Relaxed)
            > 0
    }

    /// Fails every queued and running request now.
    pub fn cancel_all(&self) {
        self.send(scheduler::Command::CancelAll);
    }

    /// A new request id.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// A new response id, `<prefix>-<boot>-<n>`: the boot part is random per boot and `n`
    /// counts this boot's responses, so no two responses of any boots share an id.
    pub fn response_id(&self, prefix: &str) -> String {
        format!("{prefix}-{:016x}-{}", self.boot_id, self.next_id())
    }

    /// Hands a command to the scheduler; false when it is gone.
    pub(crate) fn send(&self, c: scheduler::Command) -> bool {
        self.commands.lock().unwrap_or_else(|e| e.into_inner()).send(c).is_ok()
    }
}

/// A running scheduler and the state its HTTP app serves from.
pub struct Server {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    /// Starts the scheduler thread, which loads the model and then serves jobs. When
    /// `workers` is given the thread runs inside that rayon pool, so the kernels' parallel
    /// regions fork among its workers.
    pub fn start(config: ServerConfig, workers: Option<Arc<rayon::ThreadPool>>) -> std::io::Result<Server> {
        let (tx, rx) = std::sync::mpsc::channel();
        let (fatal, _) = watch::channel(None);
        let shared = Arc::new(Shared {
            config,
            model: OnceLock::new(),
            grammars: OnceLock::new(),
            grammar_workers: structured::admit::workers(),
            metrics: Arc::default(),
            commands: Mutex::new(tx),
            draining: AtomicBool::new(false),
            boot_id: random_u64(),
            next_id: AtomicU64::new(1),
            fatal,
        });
        let state = shared.clone();
        let thread = std::thread::Builder::new().name("kiln-scheduler".into()).spawn(move || {
            let run = || {
                if let Err(e) = load_and_run(&state, rx) {
                    state.fatal.send_replace(Some(Arc::new(*e)));
                }
            };
            match workers {
                Some(pool) => pool.install(run),
                None => run(),
            }
        })?;
        Ok(Server { shared, thread: Some(thread) })
    }

    /// The shared state (for [`http::app`]).
    pub fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    /// Resolves when the scheduler failed (the model did not load, or the workspace did
    /// not fit), with the reason.
    pub async fn failed(&self) -> Arc<ServeError> {
        let mut rx = self.shared.fatal.subscribe();
        if let Ok(v) = rx.wait_for(Option::is_some).await
            && let Some(e) = v.clone()
        {
            return e;
        }
        std::future::pending().await
    }

    /// Stops the scheduler after its current step and waits for it.
    pub fn stop(mut self) {
        self.shared.send(scheduler::Command::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The `system_fingerprint` of every completion and chunk: kiln's version, the commit it
/// was built from (`unknown` outside a git checkout) and the backend, as
/// `kiln-<version>-<commit>-<backend>`.
pub fn system_fingerprint() -> &'static str {
    concat!("kiln-", env!("CARGO_PKG_VERSION"), "-", env!("BUILD_COMMIT"), "-cpu")
}

/// 64 random bits from the standard library's OS-seeded hasher keys, mixed with the time
/// and the process id.
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    h.write_u128(nanos);
    h.write_u32(std::process::id());
    h.finish()
}

fn load_and_run(
    shared: &Shared,
    rx: std::sync::mpsc::Receiver<scheduler::Command>,
) -> Result<(), Box<ServeError>> {
    let c = &shared.config;
    let started = std::time::Instant::now();
    let load_err = |source| Box::new(ServeError::Load { model: c.model.clone(), source });
    let mut model = kiln_model::load(&c.model, &c.load).map_err(load_err)?;
    model.prepare_for_cpu();
    if let Some(t) = &c.chat_template {
        let own = model.chat_template.take();
        let mut t = t.clone();
        t.bos_token = t.bos_token.or_else(|| own.as_ref().and_then(|o| o.bos_token.clone()));
        t.eos_token = t.eos_token.or_else(|| own.as_ref().and_then(|o| o.eos_token.clone()));
        model.chat_template = Some(t);
    }
    let model = Arc::new(model);
    let engine = Engine::new(&model, &c.load.pool, c.engine).map_err(load_err)?;
    let draft = match &c.model_draft {
        Some(name) => {
            let mut d = kiln_model::load(name, &c.load)
                .map_err(|source| Box::new(ServeError::Load { model: name.clone(), source }))?;
            d.prepare_for_cpu();
            Some(d)
        }
        None => None,
    };
    let sched = scheduler::Scheduler::new(
        &model,
        engine,
        draft.as_ref(),
        &c.load.pool,
        c.scheduler,
        shared.metrics.clone(),
    )
    .map_err(load_err)?;
    let _ = shared.model.set(model.clone());
    tracing::info!(
        "model loaded: {} ({} layers, context {} tokens) in {:.2} s; {} slots, prefill chunk {}, prompt cache {} bytes",
        c.model,
        model.config.num_hidden_layers,
        model.config.max_position_embeddings,
        started.elapsed().as_secs_f64(),
        c.scheduler.parallel,
        c.scheduler.prefill_chunk,
        c.scheduler.prompt_cache_bytes,
    );
    sched.run(rx);
    Ok(())
}
