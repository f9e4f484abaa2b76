//! What `bench-decode` and `bench-longprompt` share: their flags (`flags`), the session
//! (`session`: build, machine, commit, run directory, env.json), and the driver
//! (`driver`) that walks a plan through the layers and the runner, writing one flushed row
//! per cell; `rounds` repeats a sweep's cells until its intervals are narrow
//! (`--until-ci`), as one run.
//!
//! The plan (`plan`), the layers that decide whether a cell runs (`layers`, `record`)
//! and the runner that executes one cell (`runner`) stay apart: the driver only moves
//! facts between them.

pub mod adapter;
pub mod classify;
pub mod driver;
pub mod flags;
pub mod layers;
pub mod panels;
pub mod plan;
pub mod record;
pub mod roofs;
pub mod rounds;
pub mod rows;
pub mod runner;
pub mod series;
pub mod session;
pub mod slurm;
pub mod summary;
pub mod task;

pub use flags::{HarnessEnv, SweepFlags};
pub use session::Session;
