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
pub mod engine;
pub mod error;
pub mod http;
pub mod logprobs;
pub mod metrics;
pub mod prompt_cache;
pub mod scheduler;
mod shared;
pub mod structured;
pub mod text;
pub mod tokenize;
pub mod tools;

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::watch;

pub use conn::ConnLimits;
pub use engine::{CpuEngine, EngineBuilder, RunScheduler};
pub use error::{ApiError, ServeError};
pub use http::app;
pub use scheduler::SchedulerOptions;
pub use shared::{ServerConfig, Shared, system_fingerprint};
pub use text::ThinkTags;

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
    let draft = match &c.model_draft {
        Some(name) => {
            let mut d = kiln_model::load(name, &c.load)
                .map_err(|source| Box::new(ServeError::Load { model: name.clone(), source }))?;
            d.prepare_for_cpu();
            Some(d)
        }
        None => None,
    };
    let ready = || {
        let _ = shared.model.set(model.clone());
        tracing::info!(
            "model loaded: {} ({} layers, context {} tokens) on {} in {:.2} s; {} slots, prefill chunk {}, \
             prompt cache {} bytes",
            c.model,
            model.config.num_hidden_layers,
            model.config.max_position_embeddings,
            c.backend.capabilities().name,
            started.elapsed().as_secs_f64(),
            c.scheduler.parallel,
            c.scheduler.prefill_chunk,
            c.scheduler.prompt_cache_bytes,
        );
    };
    let run = RunScheduler {
        model: &model,
        draft: draft.as_ref(),
        pool: &c.load.pool,
        engine_options: c.engine,
        options: c.scheduler,
        metrics: shared.metrics.clone(),
        rx,
        ready: &ready,
    };
    c.backend.build_and_run(&model, c.engine, run).map_err(load_err)
}
