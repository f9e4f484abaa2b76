//! The HTTP app: routes, the API-key check, and the two completion endpoints, which
//! check a request, hand it to the scheduler and turn its events into an OpenAI response
//! or a server-sent event stream (`data: {...}` chunks, then `data: [DONE]`).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Extension, Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use kiln_model::LoadedModel;
use serde_json::{Value, json};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::access_log::{self, RequestStats};
use crate::api::{self, Endpoint, GenerationRequest};
use crate::body;
use crate::error::ApiError;
use crate::scheduler::{Command, Event, FinishReason, Job};
use crate::text::{Channel, Detokenizer, Emitter, Piece};
use crate::tools::{self, CallSyntax, ToolCall};
use crate::{Shared, system_fingerprint};

/// The app: `/health`, `/metrics`, `/v1/models` (and `/v1/models/{id}`), `/v1/chat/completions`,
/// `/v1/completions`, `/tokenize` and `/detokenize`, serving from `shared`.
pub fn app(shared: Arc<Shared>) -> Router {
    let limit = shared.config.max_body_bytes;
    let v1 = Router::new()
        .route("/v1/models", get(models))
        // Ids may hold slashes (`org/name`), as Hugging Face names do.
        .route("/v1/models/{*id}", get(model))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        // vLLM serves these beside /v1, behind the same key.
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .layer(middleware::from_fn_with_state(shared.clone(), authorize));
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(v1)
        .fallback(not_found)
        // After every route: it applies to the routes present when it is called.
        .method_not_allowed_fallback(method_not_allowed)
        // Outermost last: the log sees every answer, bodies are read before any handler.
        .layer(middleware::from_fn_with_state(shared.clone(), body::read_body))
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn(access_log::log_requests))
        .with_state(shared)
}

async fn health(State(s): State<Arc<Shared>>) -> Response {
    if s.draining() {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "shutting down"}))).into_response();
    }
    match s.model() {
        Some(_) => (StatusCode::OK, Json(json!({"status": "ok"}))).into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "loading model"}))).into_response(),
    }
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    let text = s.metrics.render(&s.config.load.pool);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// The served model as OpenAI's model object.
fn model_object(s: &Shared) -> Value {
    let created = s.model().map(|_| unix_now()).unwrap_or(0);
    json!({"id": s.config.model_id, "object": "model", "created": created, "owned_by": "kiln"})
}

async fn models(State(s): State<Arc<Shared>>) -> Response {
    Json(json!({"object": "list", "data": [model_object(&s)]})).into_response()
}

async fn model(State(s): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    if id == s.config.model_id {
        Json(model_object(&s)).into_response()
    } else {
        api::model_not_found(&id, &s.config.model_id).into_response()
    }
}

async fn not_found(req: Request) -> Response {
    ApiError::status(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no route for {} {}", req.method(), req.uri().path()),
    )
    .into_response()
}

/// A known path with the wrong method: 405 with an OpenAI error body naming the method
/// each path accepts (axum adds the `Allow` header).
async fn method_not_allowed(req: Request) -> Response {
    let path = req.uri().path();
    let accepted = match path {
        "/v1/chat/completions" | "/v1/completions" => "POST",
        _ => "GET",
    };
    ApiError::status(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("method {} is not allowed on {path}: accepted is {accepted}", req.method()),
    )
    .into_response()
}

/// Requires `Authorization: Bearer <key>` when a key is configured, compared in
/// constant time.
async fn authorize(State(s): State<Arc<Shared>>, headers: HeaderMap, req: Request, next: Next) -> Response {
    if let Some(key) = &s.config.api_key {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !constant_time_eq(given.as_bytes(), key.as_bytes()) {
            return ApiError::status(
                StatusCode::UNAUTHORIZED,
                "invalid_api_key",
                "missing or wrong API key: send Authorization: Bearer <key> with the server's --api-key",
            )
            .into_response();
        }
    }
    next.run(req).await
}

/// Equality whose time depends only on the lengths, not on where the bytes differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

async fn tokenize(State(s): State<Arc<Shared>>, body: Result<Bytes, BytesRejection>) -> Response {
    tokenizer_endpoint(&s, "/tokenize", body, crate::tokenize::tokenize)
}

async fn detokenize(State(s): State<Arc<Shared>>, body: Result<Bytes, BytesRejection>) -> Response {
    tokenizer_endpoint(&s, "/detokenize", body, crate::tokenize::detokenize)
}

/// Answers a tokenizer endpoint with `answer`'s JSON once the model is loaded.
fn tokenizer_endpoint(
    s: &Shared,
    path: &'static str,
    body: Result<Bytes, BytesRejection>,
    answer: fn(&[u8], &str, &LoadedModel) -> Result<Value, ApiError>,
) -> Response {
    let result = body_bytes(s, body).and_then(|body| {
        let model = s.model().ok_or_else(loading)?;
        answer(&body, &s.config.model_id, model)
    });
    let response = match result {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    };
    s.metrics.request(path, response.status().as_u16());
    response
}

/// The body, or the error for one over the limit or unreadable.
fn body_bytes(s: &Shared, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::status(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                format!(
                    "the request body is over the limit of {} bytes (--max-body-bytes)",
                    s.config.max_body_bytes
                ),
            )
        } else {
            ApiError::bad_request("invalid_body", format!("the request body could not be read: {r}"))
        }
    })
}

/// The 503 of a request that arrives before the model is loaded.
fn loading() -> ApiError {
    ApiError::status(
        StatusCode::SERVICE_UNAVAILABLE,
        "loading",
        "the model is still loading: retry when GET /health answers 200",
    )
}

async fn chat(
    State(s): State<Arc<Shared>>,
    Extension(stats): Extension<Arc<RequestStats>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(Endpoint::Chat, s, stats, body).await
}

async fn completions(
    State(s): State<Arc<Shared>>,
    Extension(stats): Extension<Arc<RequestStats>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(Endpoint::Completions, s, stats, body).await
}

async fn generate(
    endpoint: Endpoint,
    s: Arc<Shared>,
    stats: Arc<RequestStats>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let response = match start(endpoint, &s, stats, body).await {
        Ok(started) if started.request.stream => stream_response(started).into_response(),
        Ok(started) => collect(started).await,
        Err(e) => e.into_response(),
    };
    s.metrics.request(endpoint.path(), response.status().as_u16());
    response
}

/// A request the scheduler has given a slot.
struct Started {
    endpoint: Endpoint,
    id: String,
    model_id: String,
    model: Arc<LoadedModel>,
    request: GenerationRequest,
    cached_tokens: usize,
    events: UnboundedReceiver<Event>,
    reasoning: bool,
    shared: Arc<Shared>,
    /// For the request's log line.
    stats: Arc<RequestStats>,
}

async fn start(
    endpoint: Endpoint,
    s: &Arc<Shared>,
    stats: Arc<RequestStats>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Started, ApiError> {
    let body = body_bytes(s, body)?;
    if s.draining() {
        return Err(ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting_down",
            "the server is shutting down",
        ));
    }
    let model = s.model().cloned().ok_or_else(loading)?;
    let mut request = api::parse(endpoint, &body, &s.config.model_id, &model)?;
    if let Some(c) = request.constraint.as_mut() {
        s.grammars(&model, c.field)?.compile(c)?;
    }
    stats.set_prompt_tokens(request.prompt.len());
    let depth = s.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
    if depth >= s.config.max_queue as u64 {
        s.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::status(
            StatusCode::TOO_MANY_REQUESTS,
            "queue_full",
            format!("{depth} requests are already waiting, the limit (--max-queue): retry later"),
        ));
    }
    let (tx, mut rx) = unbounded_channel();
    if !s.send(Command::Submit(Job { request: request.clone(), events: tx })) {
        s.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
        return Err(gone());
    }
    match rx.recv().await {
        Some(Event::Started { cached_tokens }) => Ok(Started {
            endpoint,
            id: s.response_id(if endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" }),
            model_id: s.config.model_id.clone(),
            model,
            request,
            cached_tokens,
            events: rx,
            reasoning: endpoint == Endpoint::Chat,
            shared: s.clone(),
            stats,
        }),
        Some(Event::Failed(e)) => Err(e),
        Some(_) | None => Err(gone()),
    }
}

fn gone() -> ApiError {
    ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "the scheduler is not running")
}

/// Text and counts of one generation as events arrive.
struct Progress {
    detok: Detokenizer,
    emitter: Emitter,
    completion_tokens: usize,
    finish: Option<FinishReason>,
    /// Drafted and accepted tokens, when the request held a speculative slot.
    speculative: Option<(u64, u64)>,
    /// Masks and their nanoseconds, when the request's output was constrained.
    structured: Option<(u64, u64)>,
}

impl Progress {
    fn new(st: &Started) -> Self {
        let tags = st.reasoning.then(|| st.shared.config.think_tags.clone());
        Progress {
            detok: Detokenizer::default(),
            emitter: Emitter::new(st.request.stop.clone(), tags),
            completion_tokens: 0,
            finish: None,
            speculative: None,
            structured: None,
        }
    }

    /// Takes one event; returns the text it releases, or the failure.
    fn on(&mut self, model: &LoadedModel, event: Option<Event>) -> Result<Vec<Piece>, ApiError> {
        let decode = |ids: &[u32]| model.tokenizer.decode(ids);
        let internal = |e: kiln_model::ModelError| {
            ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "detokenize", e.to_string())
        };
        match event {
            Some(Event::Token(t)) => {
                self.completion_tokens += 1;
                let text = self.detok.push(t, decode).map_err(internal)?;
                let pieces = self.emitter.push(&text);
                if self.emitter.stopped() {
                    self.finish = Some(FinishReason::Stop);
                }
                Ok(pieces)
            }
            Some(Event::Done(r)) => {
                self.finish = Some(r);
                let text = self.detok.finish(decode).map_err(internal)?;
                let mut pieces = self.emitter.push(&text);
                pieces.extend(self.emitter.finish());
                if self.emitter.stopped() {
                    self.finish = Some(FinishReason::Stop);
                }
                Ok(pieces)
            }
            Some(Event::Speculation { drafted, accepted }) => {
                self.speculative = Some((drafted, accepted));
                Ok(Vec::new())
            }
            Some(Event::Structured { masks, mask_nanos }) => {
                self.structured = Some((masks, mask_nanos));
                Ok(Vec::new())
            }
            Some(Event::Failed(e)) => Err(e),
            Some(Event::Started { .. }) | None => Err(gone()),
        }
    }

    fn usage(&self, st: &Started) -> Value {
        let prompt = st.request.prompt.len();
        let mut usage = json!({
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": st.cached_tokens},
        });
        if let Some((drafted, accepted)) = self.speculative {
            usage["speculative"] = json!({"drafted": drafted, "accepted": accepted});
        }
        if let Some((masks, nanos)) = self.structured {
            usage["structured"] = json!({"masks": masks, "mask_ms": nanos as f64 / 1e6});
        }
        usage
    }
}

/// Waits for the whole generation and answers with one JSON object.
async fn collect(mut st: Started) -> Response {
    let mut p = Progress::new(&st);
    let (mut content, mut reasoning) = (String::new(), String::new());
    while p.finish.is_none() {
        let event = st.events.recv().await;
        let event = p.on(&st.model, event);
        st.stats.set_completion_tokens(p.completion_tokens);
        match event {
            Ok(pieces) => {
                for piece in pieces {
                    match piece.channel {
                        Channel::Content => content.push_str(&piece.text),
                        Channel::Reasoning => reasoning.push_str(&piece.text),
                    }
                }
            }
            Err(e) => return e.into_response(),
        }
    }
    // A stop string ended it: the scheduler frees the slot at its next step.
    st.events.close();
    let mut finish = p.finish.unwrap_or(FinishReason::Stop).as_str();
    let created = unix_now();
    let body = match st.endpoint {
        Endpoint::Chat => {
            let mut message = json!({"role": "assistant", "content": content});
            if let Some((before, calls)) =
                call_syntax(&st).and_then(|syntax| tools::parse_calls(syntax, &content))
            {
                message["content"] = if before.is_empty() { Value::Null } else { Value::String(before) };
                message["tool_calls"] = Value::Array(
                    calls.iter().enumerate().map(|(i, c)| tool_call_object(&st.id, i, c)).collect(),
                );
                finish = "tool_calls";
            }
            if !reasoning.is_empty() {
                message["reasoning_content"] = Value::String(reasoning);
            }
            json!({
                "id": st.id, "object": "chat.completion", "created": created, "model": st.model_id,
                "system_fingerprint": system_fingerprint(),
                "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish}],
                "usage": p.usage(&st),
            })
        }
        Endpoint::Completions => json!({
            "id": st.id, "object": "text_completion", "created": created, "model": st.model_id,
            "system_fingerprint": system_fingerprint(),
            "choices": [{"index": 0, "text": content, "logprobs": null, "finish_reason": finish}],
            "usage": p.usage(&st),
        }),
    };
    Json(body).into_response()
}

/// The call syntax to parse a response's output with: the request's tools', unless
/// `tool_choice` is `none`.
fn call_syntax(st: &Started) -> Option<CallSyntax> {
    st.request.tools.as_ref().filter(|t| t.parses_calls()).map(|t| t.syntax)
}

/// The `id` of a response's call `i`: unique as the response's id is.
fn tool_call_id(response_id: &str, i: usize) -> String {
    let unique = response_id.split_once('-').map_or(response_id, |(_, rest)| rest);
    format!("call_{unique}-{i}")
}

/// One call as OpenAI's `message.tool_calls[i]`.
fn tool_call_object(response_id: &str, i: usize, c: &ToolCall) -> Value {
    json!({
        "id": tool_call_id(response_id, i), "type": "function",
        "function": {"name": c.name, "arguments": c.arguments},
    })
}

/// State of one event stream.
struct StreamState {
    st: Started,
    progress: Progress,
    created: u64,
    queue: std::collections::VecDeque<String>,
    ended: bool,
    /// Content held back while it may still be the opening of a tool call (requests with
    /// tools); `None` once it cannot, or without tools.
    held: Option<String>,
}

impl StreamState {
    fn chunk(&self, delta: Value, finish: Option<&str>) -> String {
        let choice = match self.st.endpoint {
            Endpoint::Chat => json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}),
            Endpoint::Completions => json!({
                "index": 0, "text": delta.get("content").cloned().unwrap_or(Value::String(String::new())),
                "logprobs": null, "finish_reason": finish,
            }),
        };
        let mut c = json!({
            "id": self.st.id, "object": self.object(), "created": self.created, "model": self.st.model_id,
            "system_fingerprint": system_fingerprint(), "choices": [choice],
        });
        if self.st.request.continuous_usage {
            // The counts so far, the token this chunk carries included.
            c["usage"] = self.progress.usage(&self.st);
        } else if self.st.request.include_usage {
            c["usage"] = Value::Null;
        }
        c.to_string()
    }

    fn object(&self) -> &'static str {
        match self.st.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        }
    }

    fn pieces(&mut self, pieces: Vec<Piece>) {
        for mut piece in pieces {
            if piece.channel == Channel::Content
                && let Some(held) = &mut self.held
            {
                held.push_str(&piece.text);
                if call_syntax(&self.st).is_some_and(|syntax| tools::may_be_call(syntax, held)) {
                    continue;
                }
                // Plain text after all: send what was held, and stop looking for a call.
                piece.text = std::mem::take(held);
                self.held = None;
            }
            let delta = match piece.channel {
                Channel::Content => json!({"content": piece.text}),
                Channel::Reasoning => json!({"reasoning_content": piece.text}),
            };
            let c = self.chunk(delta, None);
            self.queue.push_back(c);
        }
    }

    fn finish(&mut self) {
        let mut finish = self.progress.finish.unwrap_or(FinishReason::Stop).as_str();
        if let Some(held) = self.held.take() {
            match call_syntax(&self.st).and_then(|syntax| tools::parse_calls(syntax, &held)) {
                Some((before, calls)) => {
                    if !before.is_empty() {
                        let c = self.chunk(json!({"content": before}), None);
                        self.queue.push_back(c);
                    }
                    // As OpenAI streams a call: its index, id, type and name with empty
                    // arguments first, then the arguments.
                    for (i, call) in calls.iter().enumerate() {
                        let head = json!({"tool_calls": [{
                            "index": i, "id": tool_call_id(&self.st.id, i), "type": "function",
                            "function": {"name": call.name, "arguments": ""},
                        }]});
                        let c = self.chunk(head, None);
                        self.queue.push_back(c);
                        let args =
                            json!({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]});
                        let c = self.chunk(args, None);
                        self.queue.push_back(c);
                    }
                    finish = "tool_calls";
                }
                None if !held.is_empty() => {
                    let c = self.chunk(json!({"content": held}), None);
                    self.queue.push_back(c);
                }
                None => {}
            }
        }
        let c = self.chunk(json!({}), Some(finish));
        self.queue.push_back(c);
        if self.st.request.include_usage {
            let u = json!({
                "id": self.st.id, "object": self.object(), "created": self.created, "model": self.st.model_id,
                "system_fingerprint": system_fingerprint(), "choices": [], "usage": self.progress.usage(&self.st),
            });
            self.queue.push_back(u.to_string());
        }
        self.queue.push_back("[DONE]".into());
        self.ended = true;
        self.st.stats.end_stream();
        self.st.events.close();
    }
}

/// Streams the generation as server-sent events. Dropping the stream (the client went
/// away) drops the event receiver, which frees the slot at the scheduler's next step.
fn stream_response(st: Started) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let progress = Progress::new(&st);
    let held = call_syntax(&st).map(|_| String::new());
    let mut state =
        StreamState { st, progress, created: unix_now(), queue: Default::default(), ended: false, held };
    if state.st.endpoint == Endpoint::Chat {
        let c = state.chunk(json!({"role": "assistant", "content": ""}), None);
        state.queue.push_back(c);
    }
    Sse::new(stream::unfold(state, |mut state| async move {
        loop {
            if let Some(data) = state.queue.pop_front() {
                return Some((Ok(SseEvent::default().data(data)), state));
            }
            if state.ended {
                return None;
            }
            let event = state.st.events.recv().await;
            let token = matches!(event, Some(Event::Token(_)));
            let event = state.progress.on(&state.st.model, event);
            state.st.stats.set_completion_tokens(state.progress.completion_tokens);
            match event {
                Ok(pieces) => {
                    let queued = state.queue.len();
                    state.pieces(pieces);
                    if token && state.queue.len() == queued && state.progress.finish.is_none() {
                        // One chunk per sampled token even while its text is held back
                        // (an incomplete character, a possible stop string, tag or tool
                        // call), so clients can time every token.
                        let c = state.chunk(json!({"content": ""}), None);
                        state.queue.push_back(c);
                    }
                    if state.progress.finish.is_some() {
                        state.finish();
                    }
                }
                Err(e) => {
                    // The request failed mid-stream: an error event ends this stream only.
                    state.st.stats.set_error(&e.message);
                    state.st.stats.end_stream();
                    state.queue.push_back(e.body().to_string());
                    state.queue.push_back("[DONE]".into());
                    state.ended = true;
                }
            }
        }
    }))
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_by_content() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(constant_time_eq(b"", b""));
    }
}
