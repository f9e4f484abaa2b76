//! One log line per request, at INFO (WARN for a 5xx): method, path, status, latency and,
//! for the completion endpoints, prompt and completion tokens, and the error message of
//! a 4xx or 5xx. The line is written when the response body is done, so a stream is
//! logged when it ends, with its latency to the last chunk; a client that went away
//! before its response is logged with status 499 (nginx's convention), and one that left
//! mid-stream with the stream's status and an error saying so.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{Method, header};
use axum::middleware::Next;
use axum::response::Response;
use http_body_util::BodyExt;

/// Status logged for a request whose client went away before its response.
pub const CLIENT_GONE: u16 = 499;

/// What the handlers learn about a request for its log line; shared through the
/// request's extensions.
#[derive(Debug, Default)]
pub struct RequestStats {
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    error: Mutex<Option<String>>,
    stream_ended: AtomicBool,
}

/// "Not set" in the token counters.
const UNSET: u64 = u64::MAX;

impl RequestStats {
    fn new() -> Self {
        RequestStats {
            prompt_tokens: AtomicU64::new(UNSET),
            completion_tokens: AtomicU64::new(UNSET),
            ..Default::default()
        }
    }

    /// The prompt's tokens.
    pub fn set_prompt_tokens(&self, n: usize) {
        self.prompt_tokens.store(n as u64, Ordering::Relaxed);
    }

    /// Tokens sent so far.
    pub fn set_completion_tokens(&self, n: usize) {
        self.completion_tokens.store(n as u64, Ordering::Relaxed);
    }

    /// The error the client was sent (the first one counts).
    pub fn set_error(&self, message: &str) {
        let mut e = self.error.lock().unwrap_or_else(|e| e.into_inner());
        if e.is_none() {
            *e = Some(message.to_string());
        }
    }

    /// The stream sent its last event (`[DONE]`).
    pub fn end_stream(&self) {
        self.stream_ended.store(true, Ordering::Relaxed);
    }

    fn get(counter: &AtomicU64) -> Option<u64> {
        Some(counter.load(Ordering::Relaxed)).filter(|&n| n != UNSET)
    }
}

/// The message of an error response, which [`crate::ApiError`] attaches so the log line
/// can carry it.
#[derive(Clone, Debug)]
pub(crate) struct ErrorMessage(pub String);

/// The log line of one request, written when dropped.
struct Line {
    method: Method,
    path: String,
    started: Instant,
    stats: Arc<RequestStats>,
    status: Option<u16>,
    streaming: bool,
}

impl Drop for Line {
    fn drop(&mut self) {
        let latency_ms = (self.started.elapsed().as_secs_f64() * 1e4).round() / 10.0;
        let status = self.status.unwrap_or(CLIENT_GONE);
        if self.status.is_none() {
            self.stats.set_error("the client went away before the response");
        } else if self.streaming && !self.stats.stream_ended.load(Ordering::Relaxed) {
            self.stats.set_error("the client went away before the stream ended");
        }
        let error = self.stats.error.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let prompt_tokens = RequestStats::get(&self.stats.prompt_tokens);
        let completion_tokens = RequestStats::get(&self.stats.completion_tokens);
        let (method, path, error) = (self.method.as_str(), self.path.as_str(), error.as_deref());
        if status >= 500 {
            tracing::warn!(
                method = %method,
                path = %path,
                status,
                latency_ms,
                prompt_tokens,
                completion_tokens,
                error,
                "request"
            );
        } else {
            tracing::info!(
                method = %method,
                path = %path,
                status,
                latency_ms,
                prompt_tokens,
                completion_tokens,
                error,
                "request"
            );
        }
    }
}

/// The middleware: gives the request its [`RequestStats`] and logs it when its response
/// body is done (or dropped).
pub(crate) async fn log_requests(mut req: Request, next: Next) -> Response {
    let stats = Arc::new(RequestStats::new());
    req.extensions_mut().insert(stats.clone());
    let mut line = Line {
        method: req.method().clone(),
        path: req.uri().path().to_string(),
        started: Instant::now(),
        stats,
        status: None,
        streaming: false,
    };
    let mut response = next.run(req).await;
    line.status = Some(response.status().as_u16());
    if let Some(ErrorMessage(m)) = response.extensions_mut().remove::<ErrorMessage>() {
        line.stats.set_error(&m);
    }
    line.streaming = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    response.map(move |body| {
        Body::new(body.inspect_frame(move |_| {
            let _written_when_dropped = &line;
        }))
    })
}
