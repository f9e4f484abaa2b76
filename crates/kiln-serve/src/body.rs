//! Request bodies are read whole before any handler runs, within bounds: a
//! `Content-Length` over `--max-body-bytes` is answered 413 before a byte of the body is
//! read, a body that grows past the limit is cut off with 413, and one that has not
//! arrived within `--body-timeout` of its headers is answered 408. A slow or lying client
//! holds its connection for the timeout at most.

use std::error::Error as _;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::shared::Shared;

fn too_large(limit: usize) -> ApiError {
    ApiError::status(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        format!("the request body is over the limit of {limit} bytes (--max-body-bytes)"),
    )
}

/// The middleware.
pub(crate) async fn read_body(State(s): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let limit = s.config.max_body_bytes;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return too_large(limit).into_response();
    }
    let (parts, body) = req.into_parts();
    let timeout = s.config.body_timeout;
    let bytes = match tokio::time::timeout(timeout, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(e)) if over_limit(&e) => return too_large(limit).into_response(),
        Ok(Err(e)) => {
            return ApiError::bad_request("invalid_body", format!("the request body could not be read: {e}"))
                .into_response();
        }
        Err(_) => {
            return ApiError::status(
                StatusCode::REQUEST_TIMEOUT,
                "body_timeout",
                format!(
                    "the request body did not arrive within {} s of its headers (--body-timeout)",
                    timeout.as_secs_f64()
                ),
            )
            .into_response();
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}

/// Whether reading stopped at the size limit.
fn over_limit(e: &axum::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = e.source();
    while let Some(c) = cause {
        if c.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cause = c.source();
    }
    false
}
