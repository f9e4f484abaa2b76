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
use crate::api::{self, Endpoint, GenerationRequest, ParsedRequest};
use crate::body;
use crate::error::ApiError;
use crate::logprobs;
use crate::scheduler::{Command, Event, Failure, FinishReason, Job, TokenLogprob};
use crate::shared::{Shared, system_fingerprint};
use crate::structured::admit;
use crate::text::{Channel, Detokenizer, Emitter, Piece};
use crate::tools::{self, CallSyntax, ToolCall};

/// The app: `/health`, `/metrics`, `/v1/models` (and `/v1/models/{id}`), `/v1/chat/completions`,
/// `/v1/completions`, `/tokenize`, `/detokenize` and `/tokenizer_info`, serving from `shared`.
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
        .route("/tokenizer_info", get(tokenizer_info))
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
        "/v1/chat/completions" | "/v1/completions" | "/tokenize" | "/detokenize" => "POST",
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

async fn tokenizer_info(State(s): State<Arc<Shared>>) -> Response {
    let result =
        s.model().ok_or_else(loading).and_then(|m| crate::tokenize::tokenizer_info(&s.config.model_id, m));
    counted_answer(&s, "/tokenizer_info", result)
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
    counted_answer(s, path, result)
}

/// `result` as the response, JSON or the error, counted under `path` in `/metrics`.
fn counted_answer(s: &Shared, path: &'static str, result: Result<Value, ApiError>) -> Response {
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
        Ok(started) if started.request.first().stream => stream_response(started).into_response(),
        Ok(started) => collect(started).await,
        Err(e) => e.into_response(),
    };
    s.metrics.request(endpoint.path(), response.status().as_u16());
    response
}

/// A request whose every choice the scheduler has given a slot (or finished).
struct Started {
    endpoint: Endpoint,
    id: String,
    model_id: String,
    /// The `system_fingerprint` the server answers with (it names the backend).
    fingerprint: String,
    model: Arc<LoadedModel>,
    request: ParsedRequest,
    choices: Vec<Choice>,
    /// For the request's log line.
    stats: Arc<RequestStats>,
}

/// One choice: its events and what they have made so far.
struct Choice {
    /// `None` once the choice ended and its receiver was closed.
    events: Option<UnboundedReceiver<Event>>,
    cached_tokens: usize,
    progress: Progress,
    /// The prompt's log-probabilities (after the first token), when echoed with them.
    prompt_logprobs: Option<Vec<TokenLogprob>>,
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
    // The constraint is the request's: compiled once, off the HTTP workers and with its
    // first mask, before the request joins the queue; each choice gets its own copy.
    if let Some(c) = request.choices[0].constraint.take() {
        let (shared, m, mut c) = (Arc::clone(s), Arc::clone(&model), *c);
        let field = c.field;
        let compiled = admit::compile(&s.grammar_workers, field, admit::COMPILE_BUDGET, move |cancel| {
            shared.grammars(&m, field)?.compile(&mut c, cancel)?;
            Ok(c)
        })
        .await?;
        for choice in &mut request.choices {
            choice.constraint = Some(Box::new(compiled.clone()));
        }
    }
    let count = request.choices.len();
    let max_queue = s.config.max_queue;
    if count > max_queue {
        let (field, what) = if request.prompts() > 1 {
            ("prompt", format!("{} prompts times n {}", request.prompts(), request.n))
        } else {
            ("n", format!("n {}", request.n))
        };
        return Err(ApiError::invalid(
            field,
            format!(
                "{what} make {count} sequences, more than the server's queue holds (--max-queue {max_queue}): \
                 accepted are at most {max_queue} sequences per request"
            ),
        ));
    }
    stats.set_prompt_tokens(request.prompt_tokens());
    let depth = s.metrics.queue_depth.fetch_add(count as u64, Ordering::Relaxed);
    if depth + count as u64 > max_queue as u64 {
        s.metrics.queue_depth.fetch_sub(count as u64, Ordering::Relaxed);
        return Err(ApiError::status(
            StatusCode::TOO_MANY_REQUESTS,
            "queue_full",
            format!("{depth} requests are already waiting, the limit (--max-queue): retry later"),
        ));
    }
    let mut receivers = Vec::with_capacity(count);
    for (k, choice) in request.choices.iter().enumerate() {
        let (tx, rx) = unbounded_channel();
        if !s.send(Command::Submit(Job { request: choice.clone(), events: tx })) {
            s.metrics.queue_depth.fetch_sub((count - k) as u64, Ordering::Relaxed);
            return Err(gone());
        }
        receivers.push(rx);
    }
    let tags = (endpoint == Endpoint::Chat).then(|| s.config.think_tags.clone());
    let mut choices = Vec::with_capacity(count);
    // Every choice's first events: a failure to start is the request's error, and the
    // prompt's log-probabilities are known before any text is sent. Choices not yet
    // admitted only buffer their events meanwhile.
    for (mut rx, choice) in receivers.into_iter().zip(&request.choices) {
        let cached_tokens = match rx.recv().await {
            Some(Event::Started { cached_tokens }) => cached_tokens,
            Some(Event::Failed(f)) => return Err(failed(f)),
            Some(_) | None => return Err(gone()),
        };
        let prompt_logprobs = if choice.prompt_logprobs {
            match rx.recv().await {
                Some(Event::PromptLogprobs(l)) => Some(l),
                Some(Event::Failed(f)) => return Err(failed(f)),
                Some(_) | None => return Err(gone()),
            }
        } else {
            None
        };
        choices.push(Choice {
            events: Some(rx),
            cached_tokens,
            progress: Progress::new(choice, tags.clone()),
            prompt_logprobs,
        });
    }
    // The other choices of a prompt share its first choice's prompt log-probabilities.
    if request.first().echo && request.first().logprobs.is_some() {
        for k in 0..count {
            if choices[k].prompt_logprobs.is_none() {
                choices[k].prompt_logprobs = choices[k - k % request.n].prompt_logprobs.clone();
            }
        }
    }
    Ok(Started {
        endpoint,
        id: s.response_id(if endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" }),
        model_id: s.config.model_id.clone(),
        fingerprint: system_fingerprint(s.config.backend.capabilities().name),
        model,
        request,
        choices,
        stats,
    })
}

/// The client's status and body for a job the scheduler failed: the one place a
/// scheduler failure becomes HTTP. An out-of-memory is the server's state, not the
/// request's fault: 503, as a memory limit without room is.
fn failed(f: Failure) -> ApiError {
    let unavailable = StatusCode::SERVICE_UNAVAILABLE;
    match f {
        Failure::ShuttingDown => ApiError::status(
            unavailable,
            "shutting_down",
            "the server is shutting down and its grace period ran out",
        ),
        Failure::MemoryLimit(message) => ApiError::status(unavailable, "memory_limit", message),
        Failure::Sampling(e) => api::sampling_error(e),
        Failure::OutOfMemory(message) => ApiError::status(unavailable, "out_of_memory", message),
        Failure::Engine(message) => {
            ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "engine_error", message)
        }
        // The request's grammar outgrew what can be enforced after it was accepted (a
        // lexer whose expressions grow with each token): the request's fault, named.
        Failure::Grammar { field, message } => ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!("{field} could not be enforced past the tokens generated so far: {message}"),
            param: Some(field.to_string()),
            code: "grammar_error",
        },
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
    /// Log-probabilities of tokens received and not yet sent.
    logprobs: Vec<TokenLogprob>,
    /// Masks and their nanoseconds, when the request's output was constrained.
    structured: Option<(u64, u64)>,
}

impl Progress {
    fn new(request: &GenerationRequest, tags: Option<crate::text::ThinkTags>) -> Self {
        Progress {
            detok: Detokenizer::default(),
            emitter: Emitter::new(request.stop.clone(), tags),
            completion_tokens: 0,
            finish: None,
            speculative: None,
            logprobs: Vec::new(),
            structured: None,
        }
    }

    /// Takes one event; returns the text it releases, or the failure.
    fn on(&mut self, model: &LoadedModel, event: Option<Event>) -> Result<Vec<Piece>, ApiError> {
        let decode = |ids: &[u32]| model.tokenizer.decode(ids);
        let internal = |e: kiln_model::ModelError| {
            ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "detokenize", e.to_string())
        };
        if self.finish.is_some() {
            // A stop string ended the text: what the scheduler sent since is dropped.
            return Ok(Vec::new());
        }
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
            Some(Event::Logprob(l)) => {
                self.logprobs.push(l);
                Ok(Vec::new())
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
            Some(Event::Failed(f)) => Err(failed(f)),
            Some(Event::Started { .. } | Event::PromptLogprobs(_)) | None => Err(gone()),
        }
    }
}

impl Started {
    /// The usage so far, summed over the choices (each prompt's tokens counted once).
    fn usage(&self) -> Value {
        let prompt = self.request.prompt_tokens();
        let completion: usize = self.choices.iter().map(|c| c.progress.completion_tokens).sum();
        let cached: usize = self.choices.iter().step_by(self.request.n).map(|c| c.cached_tokens).sum();
        let mut usage = json!({
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        });
        let spec: Vec<(u64, u64)> = self.choices.iter().filter_map(|c| c.progress.speculative).collect();
        if !spec.is_empty() {
            let (drafted, accepted) = spec.iter().fold((0, 0), |(d, a), &(x, y)| (d + x, a + y));
            usage["speculative"] = json!({"drafted": drafted, "accepted": accepted});
        }
        let masked: Vec<(u64, u64)> = self.choices.iter().filter_map(|c| c.progress.structured).collect();
        if !masked.is_empty() {
            let (masks, nanos) = masked.iter().fold((0, 0), |(m, n), &(x, y)| (m + x, n + y));
            usage["structured"] = json!({"masks": masks, "mask_ms": nanos as f64 / 1e6});
        }
        usage
    }

    fn completion_tokens(&self) -> usize {
        self.choices.iter().map(|c| c.progress.completion_tokens).sum()
    }

    /// The prompt's text as the completion's `echo` puts it before the answer.
    fn echo_text(&self, k: usize) -> Result<String, ApiError> {
        self.model
            .tokenizer
            .decode(&self.request.choices[k].prompt)
            .map_err(|e| ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "detokenize", e.to_string()))
    }

    /// Log-probabilities of `entries` in the endpoint's shape; for a completion, `echo`
    /// puts choice `k`'s prompt tokens first (the first with null values) and `offset`
    /// counts characters before the first token, and advances past the last.
    fn logprobs(&self, k: usize, entries: &[TokenLogprob], echo: bool, offset: &mut usize) -> Value {
        let tok = &self.model;
        match self.endpoint {
            Endpoint::Chat => {
                let content: Vec<Value> = entries
                    .iter()
                    .map(|e| {
                        let mut v = logprobs::chat_entry(tok, e.token, e.logprob);
                        v["top_logprobs"] =
                            e.top.iter().map(|&(t, l)| logprobs::chat_entry(tok, t, l)).collect();
                        v
                    })
                    .collect();
                json!({"content": content})
            }
            Endpoint::Completions => {
                let mut c = logprobs::CompletionLogprobs::default();
                if echo {
                    let prompt = &self.request.choices[k].prompt;
                    c.push_first(tok, prompt[0], offset);
                    for e in self.choices[k].prompt_logprobs.iter().flatten() {
                        c.push(tok, e, offset);
                    }
                }
                for e in entries {
                    c.push(tok, e, offset);
                }
                c.into_value()
            }
        }
    }
}

/// Waits for the whole generation and answers with one JSON object.
async fn collect(mut st: Started) -> Response {
    let first = st.request.first().clone();
    let mut bodies = Vec::with_capacity(st.choices.len());
    for k in 0..st.choices.len() {
        let (mut content, mut reasoning) = (String::new(), String::new());
        let mut logprobs = Vec::new();
        let mut events = st.choices[k].events.take().expect("a choice's events");
        while st.choices[k].progress.finish.is_none() {
            let event = events.recv().await;
            let event = st.choices[k].progress.on(&st.model, event);
            st.stats.set_completion_tokens(st.completion_tokens());
            match event {
                Ok(pieces) => {
                    for piece in pieces {
                        match piece.channel {
                            Channel::Content => content.push_str(&piece.text),
                            Channel::Reasoning => reasoning.push_str(&piece.text),
                        }
                    }
                    logprobs.append(&mut st.choices[k].progress.logprobs);
                }
                Err(e) => return e.into_response(),
            }
        }
        // A stop string ended it: the scheduler frees the slot at its next step.
        drop(events);
        let mut finish = st.choices[k].progress.finish.unwrap_or(FinishReason::Stop).as_str();
        let logprobs = match first.logprobs {
            Some(_) => st.logprobs(k, &logprobs, first.echo, &mut 0),
            None => Value::Null,
        };
        let body = match st.endpoint {
            Endpoint::Chat => {
                let mut message = json!({"role": "assistant", "content": content});
                if let Some((before, calls)) =
                    call_syntax(&st).and_then(|syntax| tools::parse_calls(syntax, &content))
                {
                    message["content"] = if before.is_empty() { Value::Null } else { Value::String(before) };
                    message["tool_calls"] = Value::Array(
                        calls.iter().enumerate().map(|(i, c)| tool_call_object(&st.id, k, i, c)).collect(),
                    );
                    finish = "tool_calls";
                }
                if !reasoning.is_empty() {
                    message["reasoning_content"] = Value::String(reasoning);
                }
                json!({"index": k, "message": message, "logprobs": logprobs, "finish_reason": finish})
            }
            Endpoint::Completions => {
                if first.echo {
                    match st.echo_text(k) {
                        Ok(prompt) => content.insert_str(0, &prompt),
                        Err(e) => return e.into_response(),
                    }
                }
                json!({"index": k, "text": content, "logprobs": logprobs, "finish_reason": finish})
            }
        };
        bodies.push(body);
    }
    let created = unix_now();
    let object = match st.endpoint {
        Endpoint::Chat => "chat.completion",
        Endpoint::Completions => "text_completion",
    };
    Json(json!({
        "id": st.id, "object": object, "created": created, "model": st.model_id,
        "system_fingerprint": st.fingerprint, "choices": bodies, "usage": st.usage(),
    }))
    .into_response()
}

/// The call syntax to parse a response's output with: the request's tools', unless
/// `tool_choice` is `none`.
fn call_syntax(st: &Started) -> Option<CallSyntax> {
    st.request.first().tools.as_ref().filter(|t| t.parses_calls()).map(|t| t.syntax)
}

/// The `id` of choice `k`'s call `i`: unique as the response's id is.
fn tool_call_id(response_id: &str, k: usize, i: usize) -> String {
    let unique = response_id.split_once('-').map_or(response_id, |(_, rest)| rest);
    if k == 0 { format!("call_{unique}-{i}") } else { format!("call_{unique}-{k}-{i}") }
}

/// One call as OpenAI's `message.tool_calls[i]`.
fn tool_call_object(response_id: &str, k: usize, i: usize, c: &ToolCall) -> Value {
    json!({
        "id": tool_call_id(response_id, k, i), "type": "function",
        "function": {"name": c.name, "arguments": c.arguments},
    })
}

/// State of one event stream.
struct StreamState {
    st: Started,
    created: u64,
    queue: std::collections::VecDeque<String>,
    /// Characters of each completion choice's text sent so far (`text_offset`).
    offsets: Vec<usize>,
    /// The choice polled first next time, so no choice starves the others.
    next: usize,
    ended: bool,
    /// Per choice, content held back while it may still be the opening of a tool call
    /// (requests with tools); `None` once it cannot, or without tools.
    held: Vec<Option<String>>,
}

impl StreamState {
    fn chunk(&self, k: usize, delta: Value, logprobs: Value, finish: Option<&str>) -> String {
        let choice = match self.st.endpoint {
            Endpoint::Chat => {
                json!({"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
            Endpoint::Completions => json!({
                "index": k, "text": delta.get("content").cloned().unwrap_or(Value::String(String::new())),
                "logprobs": logprobs, "finish_reason": finish,
            }),
        };
        let mut c = json!({
            "id": self.st.id, "object": self.object(), "created": self.created, "model": self.st.model_id,
            "system_fingerprint": self.st.fingerprint, "choices": [choice],
        });
        let first = self.st.request.first();
        if first.continuous_usage {
            // The counts so far, the token this chunk carries included.
            c["usage"] = self.st.usage();
        } else if first.include_usage {
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

    /// The log-probabilities choice `k` has received and not sent, in the chunk's shape
    /// (null when the request asks for none).
    fn take_logprobs(&mut self, k: usize, echo: bool) -> Value {
        if self.st.request.first().logprobs.is_none() {
            return Value::Null;
        }
        let entries = std::mem::take(&mut self.st.choices[k].progress.logprobs);
        if entries.is_empty() && !echo {
            return Value::Null;
        }
        let mut offset = self.offsets[k];
        let v = self.st.logprobs(k, &entries, echo, &mut offset);
        self.offsets[k] = offset;
        v
    }

    /// The chunks of choice `k`'s `pieces`, the log-probabilities received with them on
    /// the first; one empty chunk carries them when there is no text.
    fn pieces(&mut self, k: usize, pieces: Vec<Piece>, token: bool) {
        let pieces = self.release(k, pieces);
        let held = pieces.is_empty();
        if held && !(token && self.st.choices[k].progress.finish.is_none()) {
            // Nothing to send yet: log-probabilities wait for the next chunk.
            return;
        }
        let mut logprobs = self.take_logprobs(k, false);
        if held {
            // One chunk per sampled token even while its text is held back (an
            // incomplete character, a possible stop string, tag or tool call), so
            // clients can time every token.
            let c = self.chunk(k, json!({"content": ""}), logprobs, None);
            self.queue.push_back(c);
            return;
        }
        for piece in pieces {
            let delta = match piece.channel {
                Channel::Content => json!({"content": piece.text}),
                Channel::Reasoning => json!({"reasoning_content": piece.text}),
            };
            let c = self.chunk(k, delta, std::mem::replace(&mut logprobs, Value::Null), None);
            self.queue.push_back(c);
        }
    }

    /// Choice `k`'s pieces less the content held back while it may open a tool call;
    /// what turns out to be plain text is released with the piece that shows it.
    fn release(&mut self, k: usize, pieces: Vec<Piece>) -> Vec<Piece> {
        let syntax = call_syntax(&self.st);
        let mut out = Vec::with_capacity(pieces.len());
        for mut piece in pieces {
            if piece.channel == Channel::Content
                && let Some(held) = &mut self.held[k]
            {
                held.push_str(&piece.text);
                if syntax.is_some_and(|syntax| tools::may_be_call(syntax, held)) {
                    continue;
                }
                // Plain text after all: send what was held, and stop looking for a call.
                piece.text = std::mem::take(held);
                self.held[k] = None;
            }
            out.push(piece);
        }
        out
    }

    fn finish_choice(&mut self, k: usize) {
        let mut finish = self.st.choices[k].progress.finish.unwrap_or(FinishReason::Stop).as_str();
        if let Some(held) = self.held[k].take() {
            match call_syntax(&self.st).and_then(|syntax| tools::parse_calls(syntax, &held)) {
                Some((before, calls)) => {
                    if !before.is_empty() {
                        let c = self.chunk(k, json!({"content": before}), Value::Null, None);
                        self.queue.push_back(c);
                    }
                    // As OpenAI streams a call: its index, id, type and name with empty
                    // arguments first, then the arguments.
                    for (i, call) in calls.iter().enumerate() {
                        let head = json!({"tool_calls": [{
                            "index": i, "id": tool_call_id(&self.st.id, k, i), "type": "function",
                            "function": {"name": call.name, "arguments": ""},
                        }]});
                        let c = self.chunk(k, head, Value::Null, None);
                        self.queue.push_back(c);
                        let args =
                            json!({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]});
                        let c = self.chunk(k, args, Value::Null, None);
                        self.queue.push_back(c);
                    }
                    finish = "tool_calls";
                }
                None if !held.is_empty() => {
                    let c = self.chunk(k, json!({"content": held}), Value::Null, None);
                    self.queue.push_back(c);
                }
                None => {}
            }
        }
        let logprobs = self.take_logprobs(k, false);
        let c = self.chunk(k, json!({}), logprobs, Some(finish));
        self.queue.push_back(c);
        // A stop string ended it: the scheduler frees the slot at its next step.
        self.st.choices[k].events = None;
        if self.st.choices.iter().all(|c| c.events.is_none()) {
            self.finish();
        }
    }

    fn finish(&mut self) {
        if self.st.request.first().include_usage {
            let u = json!({
                "id": self.st.id, "object": self.object(), "created": self.created, "model": self.st.model_id,
                "system_fingerprint": self.st.fingerprint, "choices": [], "usage": self.st.usage(),
            });
            self.queue.push_back(u.to_string());
        }
        self.queue.push_back("[DONE]".into());
        self.ended = true;
        self.st.stats.end_stream();
    }

    /// The next event of any choice still running, with the choice's position.
    async fn next_event(&mut self) -> (usize, Option<Event>) {
        let count = self.st.choices.len();
        let start = self.next;
        let choices = &mut self.st.choices;
        let (k, event) = std::future::poll_fn(|cx| {
            for step in 0..count {
                let k = (start + step) % count;
                if let Some(rx) = choices[k].events.as_mut()
                    && let std::task::Poll::Ready(e) = rx.poll_recv(cx)
                {
                    return std::task::Poll::Ready((k, e));
                }
            }
            std::task::Poll::Pending
        })
        .await;
        self.next = (k + 1) % count;
        (k, event)
    }
}

/// Streams the generation as server-sent events. Dropping the stream (the client went
/// away) drops the event receivers, which frees the slots at the scheduler's next step.
fn stream_response(st: Started) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let count = st.choices.len();
    let held = vec![call_syntax(&st).map(|_| String::new()); count];
    let mut state = StreamState {
        st,
        created: unix_now(),
        queue: Default::default(),
        offsets: vec![0; count],
        next: 0,
        ended: false,
        held,
    };
    let first = state.st.request.first().clone();
    for k in 0..count {
        match state.st.endpoint {
            Endpoint::Chat => {
                let c = state.chunk(k, json!({"role": "assistant", "content": ""}), Value::Null, None);
                state.queue.push_back(c);
            }
            Endpoint::Completions if first.echo => {
                // The prompt first, with its log-probabilities.
                let logprobs = state.take_logprobs(k, true);
                match state.st.echo_text(k) {
                    Ok(text) => {
                        let c = state.chunk(k, json!({"content": text}), logprobs, None);
                        state.queue.push_back(c);
                    }
                    Err(e) => {
                        state.queue.push_back(e.body().to_string());
                        state.queue.push_back("[DONE]".into());
                        state.ended = true;
                        break;
                    }
                }
            }
            Endpoint::Completions => {}
        }
    }
    Sse::new(stream::unfold(state, |mut state| async move {
        loop {
            if let Some(data) = state.queue.pop_front() {
                return Some((Ok(SseEvent::default().data(line_safe(data))), state));
            }
            if state.ended {
                return None;
            }
            let (k, event) = state.next_event().await;
            let token = matches!(event, Some(Event::Token(_)));
            let event = state.st.choices[k].progress.on(&state.st.model, event);
            state.st.stats.set_completion_tokens(state.st.completion_tokens());
            match event {
                Ok(pieces) => {
                    state.pieces(k, pieces, token);
                    if state.st.choices[k].progress.finish.is_some() {
                        state.finish_choice(k);
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

/// `json` with the characters some line readers take for line ends escaped: U+2028,
/// U+2029 and U+0085 are valid raw inside a JSON string, and serde_json leaves them raw,
/// but Python's `str.splitlines` (httpx's `aiter_lines`, so guidellm) splits an event
/// there and then fails to parse either half. In JSON text they can only stand inside
/// strings, where `\uXXXX` means the same character.
fn line_safe(json: String) -> String {
    if !json.contains(['\u{2028}', '\u{2029}', '\u{85}']) {
        return json;
    }
    let mut out = String::with_capacity(json.len() + 12);
    for c in json.chars() {
        match c {
            '\u{2028}' => out.push_str("\\u2028"),
            '\u{2029}' => out.push_str("\\u2029"),
            '\u{85}' => out.push_str("\\u0085"),
            c => out.push(c),
        }
    }
    out
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_json_has_no_character_a_line_reader_splits_on() {
        let text = "a\u{2028}b\u{2029}c\u{85}d\ne";
        let data = line_safe(json!({"content": text}).to_string());
        for c in ['\u{2028}', '\u{2029}', '\u{85}', '\n', '\r'] {
            assert!(!data.contains(c), "{data:?} holds {c:?}");
        }
        assert_eq!(data.lines().count(), 1);
        let back: Value = serde_json::from_str(&data).unwrap();
        assert_eq!(back["content"], text, "the escapes mean the same characters");
        assert_eq!(line_safe("[DONE]".into()), "[DONE]");
    }

    #[test]
    fn each_scheduler_failure_has_its_status_and_code() {
        let oom = kiln_model::ModelError::from(kiln_core::OutOfMemory {
            requested: 8,
            tag: kiln_core::Tag::Kv,
            in_use: 0,
            limit: 4,
        });
        let cases = [
            (Failure::ShuttingDown, 503, "shutting_down"),
            (Failure::MemoryLimit("no room".into()), 503, "memory_limit"),
            (Failure::Engine("boom".into()), 500, "engine_error"),
            (Failure::engine(&oom), 503, "out_of_memory"),
            (
                Failure::Sampling(kiln_model::ModelError::InvalidArgument {
                    what: "top-p".into(),
                    message: "must be in (0, 1]".into(),
                }),
                400,
                "invalid_value",
            ),
        ];
        for (f, status, code) in cases {
            let e = failed(f);
            assert_eq!((e.status.as_u16(), e.code), (status, code), "{e}");
        }
        let e = failed(Failure::ShuttingDown);
        assert_eq!(e.message, "the server is shutting down and its grace period ran out");
        let e = failed(Failure::engine(&oom));
        assert!(e.message.starts_with("out of memory:"), "{e}");
    }

    #[test]
    fn keys_compare_by_content() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(constant_time_eq(b"", b""));
    }
}
