//! The engine a server runs on: [`EngineBuilder`] makes it on the scheduler thread, once
//! the model is loaded, for whichever backend the binary chose ([`CpuEngine`] here; the
//! `kiln` binary adds the device backends), and runs the scheduler over it through
//! [`RunScheduler`]. This crate names no backend but the CPU.

use std::sync::Arc;

use kiln_model::{Engine, EngineOptions, LoadedModel};

use crate::metrics::Metrics;
use crate::scheduler::{Command, Scheduler, SchedulerOptions};

/// How the server's engine is made: on the scheduler thread, once the model is loaded,
/// by the backend the server runs on. [`CpuEngine`] is kiln-model's engine; the `kiln`
/// binary gives one per `--backend`, so this crate names no backend but the CPU.
pub trait EngineBuilder: Send + Sync + std::fmt::Debug {
    /// What the backend runs (the binary checks the server's flags against it).
    fn capabilities(&self) -> kiln_model::Capabilities;

    /// Builds the engine over `model` with `options` and runs the scheduler on it:
    /// `run.run(engine)`, which returns when the server stops.
    fn build_and_run<'a>(
        &self,
        model: &'a LoadedModel,
        options: EngineOptions,
        run: RunScheduler<'a>,
    ) -> kiln_model::Result<()>;
}

/// The CPU backend: kiln-model's [`Engine`] over the load options' pool.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuEngine;

impl EngineBuilder for CpuEngine {
    fn capabilities(&self) -> kiln_model::Capabilities {
        kiln_model::backend::CPU
    }

    fn build_and_run<'a>(
        &self,
        model: &'a LoadedModel,
        options: EngineOptions,
        run: RunScheduler<'a>,
    ) -> kiln_model::Result<()> {
        let pool = run.pool.clone();
        run.run(Engine::new(model, &pool, options)?)
    }
}

/// What the scheduler needs beside its engine, handed to [`EngineBuilder::build_and_run`].
pub struct RunScheduler<'a> {
    pub(crate) model: &'a LoadedModel,
    pub(crate) draft: Option<&'a LoadedModel>,
    pub(crate) pool: &'a kiln_core::MemoryPool,
    pub(crate) engine_options: EngineOptions,
    pub(crate) options: SchedulerOptions,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) rx: std::sync::mpsc::Receiver<Command>,
    pub(crate) ready: &'a dyn Fn(),
}

impl RunScheduler<'_> {
    /// Runs the scheduler over `engine` until the server stops.
    pub fn run<B: kiln_model::BackendEngine>(self, engine: B) -> kiln_model::Result<()> {
        let sched = Scheduler::new(
            self.model,
            engine,
            self.engine_options,
            self.draft,
            self.pool,
            self.options,
            self.metrics,
        )?;
        (self.ready)();
        sched.run(self.rx);
        Ok(())
    }
}
