//! What the scheduler thread and the HTTP app share: the server's configuration, the
//! [`Shared`] state the routes serve from (the loaded model once it is there, the
//! scheduler's command channel, the readiness flags), and the `system_fingerprint`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, OnceLock};

use kiln_model::{EngineOptions, LoadOptions, LoadedModel};
use tokio::sync::watch;

use crate::error::{ApiError, ServeError};
use crate::scheduler::{self, SchedulerOptions};
use crate::text::ThinkTags;
use crate::{metrics, structured};

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
    /// The backend the engine runs on ([`crate::CpuEngine`] unless the binary picks
    /// another).
    pub backend: Arc<dyn crate::engine::EngineBuilder>,
}

/// State the handlers and the scheduler share.
pub struct Shared {
    /// The configuration.
    pub config: ServerConfig,
    /// The loaded model, once loading is done.
    pub(crate) model: OnceLock<Arc<LoadedModel>>,
    /// The structured-output parser factory of the model's vocabulary, built at the
    /// first request that constrains its output (or the reason it cannot be).
    pub(crate) grammars: OnceLock<Result<structured::Grammars, String>>,
    /// The permits of the grammar compiles running at once ([`structured::admit`]).
    pub(crate) grammar_workers: Arc<tokio::sync::Semaphore>,
    /// Counters for `/metrics`.
    pub metrics: Arc<metrics::Metrics>,
    pub(crate) commands: Mutex<Sender<scheduler::Command>>,
    pub(crate) draining: AtomicBool,
    /// Random per boot, so response ids differ across boots and servers.
    pub(crate) boot_id: u64,
    pub(crate) next_id: AtomicU64,
    pub(crate) fatal: watch::Sender<Option<Arc<ServeError>>>,
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

/// The `system_fingerprint` of every completion and chunk: kiln's version, the commit it
/// was built from (`unknown` outside a git checkout) and the backend, as
/// `kiln-<version>-<commit>-<backend>`.
pub fn system_fingerprint(backend: &str) -> String {
    concat!("kiln-", env!("CARGO_PKG_VERSION"), "-", env!("BUILD_COMMIT"), "-").to_string() + backend
}
