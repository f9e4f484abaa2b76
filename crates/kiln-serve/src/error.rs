//! Errors: [`ApiError`] is what a client sees (an HTTP status and an OpenAI-style body
//! `{"error": {"message", "type", "param", "code"}}`); [`ServeError`] is what stops the
//! server itself.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// A refused or failed request, as the client sees it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What went wrong and what would be accepted.
    pub message: String,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// A short machine-readable code.
    pub code: &'static str,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.into()),
            code: "invalid_value",
        }
    }

    /// A 400 about the request as a whole.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), param: None, code }
    }

    /// Any other status.
    pub fn status(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), param: None, code }
    }

    /// The OpenAI error type for the status.
    pub fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            400 | 404 | 405 | 413 => "invalid_request_error",
            401 => "authentication_error",
            429 => "rate_limit_error",
            503 => "service_unavailable",
            _ => "server_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// What stops the server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The address could not be bound (in use, not permitted, not local).
    #[error("cannot listen on {addr}: {source}; choose another --port or --host, or stop what holds it")]
    Bind {
        /// The address asked for.
        addr: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The model could not be loaded or prepared.
    #[error("loading model {model}: {source}")]
    Load {
        /// The model asked for.
        model: String,
        /// Why.
        #[source]
        source: kiln_model::ModelError,
    },
    /// Serving failed (an I/O error on the listener).
    #[error("serving: {0}")]
    Io(#[from] std::io::Error),
    /// The scheduler thread stopped unexpectedly.
    #[error("the scheduler thread stopped: {0}")]
    Scheduler(String),
}
