//! Compiling a request's constraint when it is accepted: on tokio's blocking pool, at
//! most [`COMPILE_WORKERS`] at once, each within [`COMPILE_BUDGET`]. The HTTP workers
//! never run a grammar (so `/health` and every stream's events keep flowing), and the
//! scheduler receives a constraint whose first mask is already computed (so no running
//! stream waits for a stranger's grammar).

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use tokio::sync::Semaphore;

use super::{CancelSlot, Constraint};
use crate::error::ApiError;

/// Grammars compiled at once; more requests wait their turn without holding a thread.
pub const COMPILE_WORKERS: usize = 2;

/// The wall time one request's grammar may take to compile and give its first mask,
/// waiting for a compile worker not counted; past it the request is a 400 naming its
/// field (docs/serve.md, "Structured outputs").
pub const COMPILE_BUDGET: Duration = Duration::from_secs(5);

/// The permits of [`COMPILE_WORKERS`].
pub fn workers() -> Arc<Semaphore> {
    Arc::new(Semaphore::new(COMPILE_WORKERS))
}

/// Runs `job` (compiling the constraint of the request's `field` and its first mask,
/// making its matcher cancellable through the slot it is given) off the async workers,
/// once one of `workers`' permits is free, within `budget`: the compiled constraint, or
/// the 400 naming the field (refused by llguidance, or over the budget).
pub async fn compile(
    workers: &Arc<Semaphore>,
    field: &'static str,
    budget: Duration,
    job: impl FnOnce(&CancelSlot) -> Result<Constraint, ApiError> + Send + 'static,
) -> Result<Constraint, ApiError> {
    let permit = Arc::clone(workers).acquire_owned().await.map_err(|_| {
        ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "shutting_down", "the server is shutting down")
    })?;
    let cancel = CancelSlot::default();
    let job = {
        let cancel = cancel.clone();
        tokio::task::spawn_blocking(move || {
            // Held until the compile really ends, even when the request gave up on it:
            // an over-budget grammar still occupies its worker, never one more.
            let _permit = permit;
            job(&cancel)
        })
    };
    match tokio::time::timeout(budget, job).await {
        Ok(Ok(compiled)) => compiled,
        Ok(Err(_)) => {
            Err(ApiError::invalid(field, format!("{field} cannot be enforced: the grammar compiler failed")))
        }
        Err(_) => {
            cancel.cancel();
            Err(ApiError::invalid(
                field,
                format!(
                    "{field} cannot be enforced: compiling it and its first token mask took longer than \
                     the server's budget of {} s; accepted are grammars that compile within it",
                    budget.as_secs_f64()
                ),
            ))
        }
    }
}
