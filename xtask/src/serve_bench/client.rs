//! The OpenAI-format streaming client: one request over HTTP/1.1 (hyper), its SSE events
//! parsed as they arrive, and what the request measured: TTFT, every inter-token latency,
//! TPOT, end-to-end time, output tokens and the error if any. It knows nothing of kiln:
//! any server speaking `/v1/completions` or `/v1/chat/completions` with SSE will do.

use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::net::TcpStream;

/// Which OpenAI endpoint the requests go to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Endpoint {
    /// `POST /v1/completions` with a text prompt.
    Completions,
    /// `POST /v1/chat/completions` with one user message.
    Chat,
}

/// Where the server is: `http://host:port` plus an optional path prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// `host:port`, as connected to and sent in `Host`.
    pub authority: String,
    /// The path before `/v1/...`, without a trailing slash (usually empty).
    pub prefix: String,
}

impl Target {
    /// Parses `--url`: `http://host:port[/prefix]`. https is not spoken.
    pub fn parse(url: &str) -> Result<Target, String> {
        let uri: Uri = url.parse().map_err(|e| format!("--url {url:?}: {e}: expected http://host:port"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => {
                return Err(format!(
                    "--url {url:?}: scheme {other} is not supported: expected http://host:port"
                ));
            }
            None => return Err(format!("--url {url:?}: no scheme: expected http://host:port")),
        }
        let Some(auth) = uri.authority() else {
            return Err(format!("--url {url:?}: no host: expected http://host:port"));
        };
        let authority = match auth.port_u16() {
            Some(_) => auth.as_str().to_string(),
            None => format!("{}:80", auth.host()),
        };
        let prefix = uri.path().trim_end_matches('/').to_string();
        Ok(Target { authority, prefix })
    }

    /// The target at `addr` (`ip:port`), no prefix.
    pub fn at(addr: std::net::SocketAddr) -> Target {
        Target { authority: addr.to_string(), prefix: String::new() }
    }

    /// `http://host:port[/prefix]`.
    pub fn url(&self) -> String {
        format!("http://{}{}", self.authority, self.prefix)
    }
}

/// A prompt: text, or token ids (exact lengths; `/v1/completions` only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Text the server tokenizes.
    Text(String),
    /// Token ids, sent as the `prompt` array.
    Ids(Vec<u32>),
}

/// One request to send.
#[derive(Clone, Debug)]
pub struct RequestSpec {
    /// A stable key: the same request in another run or arm has the same key.
    pub key: String,
    /// The prompt.
    pub prompt: Prompt,
    /// `max_tokens`.
    pub max_tokens: u64,
    /// `ignore_eos`.
    pub ignore_eos: bool,
    /// The `model` field.
    pub model: String,
    /// The endpoint.
    pub endpoint: Endpoint,
    /// Send `"speculative": true` (kiln's extension: ask for a speculative slot).
    pub speculative: bool,
    /// Send `response_format: {"type": "json_object"}`: the server masks every step, and
    /// a kiln server reports the mask's time in `usage.structured`.
    pub json_object: bool,
}

impl RequestSpec {
    /// The JSON body: greedy, streamed, usage in the last event.
    pub fn body(&self) -> Value {
        let mut body = json!({
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": true,
            "stream_options": {"include_usage": true},
            "ignore_eos": self.ignore_eos,
        });
        if self.speculative {
            body["speculative"] = json!(true);
        }
        if self.json_object {
            body["response_format"] = json!({"type": "json_object"});
        }
        match (&self.prompt, self.endpoint) {
            (Prompt::Text(t), Endpoint::Completions) => body["prompt"] = json!(t),
            (Prompt::Ids(ids), _) => body["prompt"] = json!(ids),
            (Prompt::Text(t), Endpoint::Chat) => body["messages"] = json!([{"role": "user", "content": t}]),
        }
        body
    }

    fn path(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

/// Where the output-token count of a request came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TokensFrom {
    /// The server's `usage.completion_tokens`.
    Usage,
    /// Counted content and reasoning_content deltas (no usage, or a malformed one).
    Deltas,
}

/// What one request measured. Times are milliseconds from the request's start.
#[derive(Clone, Debug, Serialize)]
pub struct RequestResult {
    /// The request's key.
    pub key: String,
    /// Start, in ms since the level began.
    pub start_ms: f64,
    /// Whether it completed.
    pub ok: bool,
    /// Why not.
    pub error: Option<String>,
    /// The HTTP status, when one came.
    pub http_status: Option<u16>,
    /// Time to the first content or reasoning token.
    pub ttft_ms: Option<f64>,
    /// (E2E - TTFT) / (output tokens - 1), when there are at least two tokens.
    pub tpot_ms: Option<f64>,
    /// End-to-end time.
    pub e2e_ms: Option<f64>,
    /// Gaps between consecutive token-carrying events.
    pub itl_ms: Vec<f64>,
    /// The first and the last event with a choice, text or not: where a server sends one
    /// event per token (kiln does, even while a token's text is held back), the request's
    /// first and last token.
    pub choice_span_ms: Option<(f64, f64)>,
    /// Output tokens, per `tokens_from`.
    pub output_tokens: u64,
    /// Where `output_tokens` came from.
    pub tokens_from: TokensFrom,
    /// Token-carrying deltas counted.
    pub deltas: u64,
    /// Why usage was not used although present.
    pub usage_problem: Option<String>,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// `usage.speculative.drafted` (kiln's extension), when the request speculated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec_drafted: Option<u64>,
    /// `usage.speculative.accepted`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec_accepted: Option<u64>,
    /// `usage.structured.masks` (kiln's extension), when the output was constrained.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub masks: Option<u64>,
    /// `usage.structured.mask_ms`: the server's time computing and applying those masks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mask_ms: Option<f64>,
    /// FNV-1a 64 of the generated text (content then reasoning), hex.
    pub output_hash: String,
}

impl RequestResult {
    fn failed(key: &str, start_ms: f64, error: String) -> RequestResult {
        RequestResult {
            key: key.to_string(),
            start_ms,
            ok: false,
            error: Some(error),
            http_status: None,
            ttft_ms: None,
            tpot_ms: None,
            e2e_ms: None,
            itl_ms: Vec::new(),
            choice_span_ms: None,
            output_tokens: 0,
            tokens_from: TokensFrom::Deltas,
            deltas: 0,
            usage_problem: None,
            prompt_tokens: None,
            cached_tokens: None,
            spec_drafted: None,
            spec_accepted: None,
            masks: None,
            mask_ms: None,
            output_hash: String::new(),
        }
    }
}

/// FNV-1a, 64 bits: a stable hash of the output text (stable across builds, unlike std's).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// What the SSE stream said, event by event.
#[derive(Debug, Default)]
pub struct StreamState {
    buf: Vec<u8>,
    /// Arrival times (since the request's start) of events that carried text.
    pub token_times: Vec<Duration>,
    /// The generated text: content, then reasoning.
    pub text: String,
    /// The reasoning text.
    pub reasoning: String,
    /// Usage, when an event carried one.
    pub usage: Option<Value>,
    /// Arrival of the first event with a choice, text or not: a server that holds back
    /// the text of a token it cannot decode yet still sends one when it has a token.
    pub first_choice: Option<Duration>,
    /// Arrival of the last event with a choice (the finish chunk, when one is sent).
    pub last_choice: Option<Duration>,
    /// `data: [DONE]` seen.
    pub done: bool,
    /// An `error` object in an event.
    pub error: Option<String>,
}

impl StreamState {
    /// Feeds received bytes; complete lines are parsed. A malformed event is an error.
    pub fn feed(&mut self, bytes: &[u8], at: Duration) -> Result<(), String> {
        self.buf.extend_from_slice(bytes);
        while let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line);
            self.line(line.trim_end_matches(['\n', '\r']), at)?;
        }
        Ok(())
    }

    /// Parses what is left after the body ended.
    pub fn finish(&mut self, at: Duration) -> Result<(), String> {
        if !self.buf.is_empty() {
            let rest = String::from_utf8_lossy(&std::mem::take(&mut self.buf)).into_owned();
            self.line(rest.trim_end_matches(['\n', '\r']), at)?;
        }
        Ok(())
    }

    fn line(&mut self, line: &str, at: Duration) -> Result<(), String> {
        let Some(data) = line.strip_prefix("data:") else {
            // Blank separators, comments (`: ...`), `event:`/`id:` lines.
            return Ok(());
        };
        let data = data.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let v: Value = serde_json::from_str(data).map_err(|e| {
            let head: String = data.chars().take(120).collect();
            format!("malformed SSE event ({e}): {head}")
        })?;
        if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
            self.error =
                Some(err.get("message").and_then(Value::as_str).unwrap_or(&err.to_string()).to_string());
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            self.usage = Some(u.clone());
        }
        let mut carried = false;
        if let Some(choices) = v.get("choices").and_then(Value::as_array) {
            if !choices.is_empty() {
                self.first_choice.get_or_insert(at);
                self.last_choice = Some(at);
            }
            for c in choices {
                let delta = c.get("delta");
                let pieces = [
                    (c.get("text"), false),
                    (delta.and_then(|d| d.get("content")), false),
                    (delta.and_then(|d| d.get("reasoning_content")), true),
                ];
                for (piece, reasoning) in pieces {
                    if let Some(s) = piece.and_then(Value::as_str).filter(|s| !s.is_empty()) {
                        if reasoning {
                            self.reasoning.push_str(s);
                        } else {
                            self.text.push_str(s);
                        }
                        carried = true;
                    }
                }
            }
        }
        if carried {
            self.token_times.push(at);
        }
        Ok(())
    }
}

/// `usage.completion_tokens` when it is a non-negative integer; otherwise why not.
pub fn usage_tokens(usage: &Value) -> Result<u64, String> {
    match usage.get("completion_tokens") {
        Some(Value::Number(n)) => n.as_u64().ok_or_else(|| format!("usage.completion_tokens is {n}")),
        Some(other) => Err(format!("usage.completion_tokens is {other}")),
        None => Err("usage has no completion_tokens".into()),
    }
}

/// Turns a finished stream into the request's measurements.
pub fn measure(key: &str, start_ms: f64, status: u16, st: &StreamState, e2e: Duration) -> RequestResult {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let deltas = st.token_times.len() as u64;
    let mut r = RequestResult::failed(key, start_ms, String::new());
    r.http_status = Some(status);
    r.e2e_ms = Some(ms(e2e));
    r.deltas = deltas;
    r.ttft_ms = st.token_times.first().or(st.first_choice.as_ref()).map(|&t| ms(t));
    r.itl_ms = st.token_times.windows(2).map(|w| ms(w[1] - w[0])).collect();
    r.choice_span_ms = st.first_choice.zip(st.last_choice).map(|(a, b)| (ms(a), ms(b)));
    let (tokens, from) = match &st.usage {
        Some(u) => match usage_tokens(u) {
            Ok(n) => (n, TokensFrom::Usage),
            Err(why) => {
                r.usage_problem = Some(why);
                (deltas, TokensFrom::Deltas)
            }
        },
        None => (deltas, TokensFrom::Deltas),
    };
    r.output_tokens = tokens;
    r.tokens_from = from;
    if let Some(u) = &st.usage {
        r.prompt_tokens = u.get("prompt_tokens").and_then(Value::as_u64);
        r.cached_tokens = u.pointer("/prompt_tokens_details/cached_tokens").and_then(Value::as_u64);
        r.spec_drafted = u.pointer("/speculative/drafted").and_then(Value::as_u64);
        r.spec_accepted = u.pointer("/speculative/accepted").and_then(Value::as_u64);
        r.masks = u.pointer("/structured/masks").and_then(Value::as_u64);
        r.mask_ms = u.pointer("/structured/mask_ms").and_then(Value::as_f64);
    }
    if let (Some(ttft), true) = (r.ttft_ms, tokens >= 2) {
        r.tpot_ms = Some((ms(e2e) - ttft) / (tokens - 1) as f64);
    }
    let mut all = st.text.clone();
    all.push_str(&st.reasoning);
    r.output_hash = format!("{:016x}", fnv1a64(all.as_bytes()));
    r.error = match (&st.error, deltas) {
        (Some(e), _) => Some(format!("server error event: {e}")),
        // Tokens whose text is held back (partial UTF-8) still count when usage says so.
        (None, 0) if !(from == TokensFrom::Usage && tokens > 0) => Some("the stream carried no token".into()),
        (None, _) if !st.done && st.usage.is_none() => Some("the stream ended without [DONE]".into()),
        _ => None,
    };
    r.ok = r.error.is_none();
    r
}

/// Sends `spec` and measures it; every failure (connect, reset, 5xx, timeout, a broken
/// stream) comes back as a failed result, never as an error of the caller.
pub async fn send(target: &Target, spec: &RequestSpec, timeout: Duration, start_ms: f64) -> RequestResult {
    send_signalling(target, spec, timeout, start_ms, None).await
}

/// [`send`], firing `first` when the stream's first event with a choice arrives (the
/// request is admitted and decoding). A request that fails first drops it unfired.
pub async fn send_signalling(
    target: &Target,
    spec: &RequestSpec,
    timeout: Duration,
    start_ms: f64,
    first: Option<tokio::sync::oneshot::Sender<()>>,
) -> RequestResult {
    let began = Instant::now();
    match tokio::time::timeout(timeout, exchange(target, spec, began, first)).await {
        Ok(Ok((status, st))) if status == StatusCode::OK.as_u16() => {
            measure(&spec.key, start_ms, status, &st, began.elapsed())
        }
        Ok(Ok((status, st))) => {
            let mut r =
                RequestResult::failed(&spec.key, start_ms, format!("HTTP {status}: {}", st.text.trim()));
            r.http_status = Some(status);
            r
        }
        Ok(Err(e)) => RequestResult::failed(&spec.key, start_ms, e),
        Err(_) => {
            RequestResult::failed(&spec.key, start_ms, format!("timed out after {} s", timeout.as_secs_f64()))
        }
    }
}

async fn exchange(
    target: &Target,
    spec: &RequestSpec,
    began: Instant,
    mut first: Option<tokio::sync::oneshot::Sender<()>>,
) -> Result<(u16, StreamState), String> {
    let stream = TcpStream::connect(&target.authority)
        .await
        .map_err(|e| format!("connecting to {}: {e}", target.authority))?;
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("HTTP handshake: {e}"))?;
    let conn = tokio::spawn(conn);
    let uri = format!("{}{}", target.prefix, spec.path());
    let req = Request::post(uri)
        .header(hyper::header::HOST, &target.authority)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .header(hyper::header::ACCEPT, "text/event-stream")
        .body(Full::new(Bytes::from(spec.body().to_string())))
        .map_err(|e| format!("building the request: {e}"))?;
    let mut res = sender.send_request(req).await.map_err(|e| format!("sending the request: {e}"))?;
    let status = res.status().as_u16();
    let mut st = StreamState::default();
    if status != StatusCode::OK.as_u16() {
        // Keep a short excerpt of the error body for the record.
        let body = res.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        st.text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
        conn.abort();
        return Ok((status, st));
    }
    while let Some(frame) = res.frame().await {
        let frame = frame.map_err(|e| format!("reading the stream: {e}"))?;
        if let Some(data) = frame.data_ref() {
            st.feed(data, began.elapsed())?;
            if st.first_choice.is_some()
                && let Some(tx) = first.take()
            {
                let _ = tx.send(());
            }
        }
    }
    st.finish(began.elapsed())?;
    conn.abort();
    Ok((status, st))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn urls_parse_to_an_authority_and_a_prefix() {
        let t = Target::parse("http://127.0.0.1:8000").unwrap();
        assert_eq!((t.authority.as_str(), t.prefix.as_str()), ("127.0.0.1:8000", ""));
        let t = Target::parse("http://box/api/").unwrap();
        assert_eq!((t.authority.as_str(), t.prefix.as_str()), ("box:80", "/api"));
        assert!(Target::parse("https://x:1").unwrap_err().contains("scheme https is not supported"));
        assert!(Target::parse("localhost:8000").is_err());
    }

    #[test]
    fn content_and_reasoning_deltas_both_count_and_usage_wins_when_valid() {
        let mut st = StreamState::default();
        let ev = |v: Value| format!("data: {v}\n\n");
        st.feed(ev(json!({"choices":[{"delta":{"reasoning_content":"think"}}]})).as_bytes(), ms(10)).unwrap();
        // An event split across reads.
        let e2 = ev(json!({"choices":[{"delta":{"content":"hi"}}]}));
        st.feed(&e2.as_bytes()[..7], ms(15)).unwrap();
        st.feed(&e2.as_bytes()[7..], ms(20)).unwrap();
        st.feed(ev(json!({"choices":[{"delta":{"content":""}}]})).as_bytes(), ms(25)).unwrap();
        st.feed(ev(json!({"choices":[{"text":"!"}]})).as_bytes(), ms(40)).unwrap();
        st.feed(
            ev(json!({"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":2},"speculative":{"drafted":8,"accepted":5},"structured":{"masks":3,"mask_ms":0.25}}}))
                .as_bytes(),
            ms(41),
        )
        .unwrap();
        st.feed(b"data: [DONE]\n\n", ms(42)).unwrap();
        let r = measure("k", 0.0, 200, &st, ms(50));
        assert!(r.ok, "{r:?}");
        assert_eq!(st.first_choice, Some(ms(10)));
        assert_eq!(r.choice_span_ms, Some((10.0, 40.0)), "the usage event has no choice");
        assert_eq!((r.deltas, r.output_tokens, r.tokens_from), (3, 3, TokensFrom::Usage));
        assert_eq!(r.ttft_ms, Some(10.0));
        assert_eq!(r.itl_ms, vec![10.0, 20.0]);
        assert_eq!(r.tpot_ms, Some(20.0));
        assert_eq!((r.prompt_tokens, r.cached_tokens), (Some(5), Some(2)));
        assert_eq!((r.spec_drafted, r.spec_accepted), (Some(8), Some(5)));
        assert_eq!((r.masks, r.mask_ms), (Some(3), Some(0.25)));
        assert_eq!(r.output_hash, format!("{:016x}", fnv1a64(b"hi!think")));
    }

    #[test]
    fn a_malformed_usage_falls_back_to_counted_deltas() {
        let mut st = StreamState::default();
        st.feed(
            b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"text\":\"b\"}]}\n\n",
            ms(5),
        )
        .unwrap();
        st.feed(
            b"data: {\"choices\":[],\"usage\":{\"completion_tokens\":{\"n\":2}}}\n\ndata: [DONE]\n\n",
            ms(6),
        )
        .unwrap();
        let r = measure("k", 0.0, 200, &st, ms(9));
        assert!(r.ok);
        assert_eq!((r.output_tokens, r.tokens_from), (2, TokensFrom::Deltas));
        assert_eq!(r.usage_problem.as_deref(), Some("usage.completion_tokens is {\"n\":2}"));
        assert_eq!(
            usage_tokens(&json!({"completion_tokens": -1})).unwrap_err(),
            "usage.completion_tokens is -1"
        );
    }

    #[test]
    fn tokens_whose_text_is_held_back_still_count_when_usage_says_so() {
        let mut st = StreamState::default();
        let held = b"data: {\"choices\":[{\"text\":\"\",\"finish_reason\":\"length\"}]}\n\n";
        st.feed(held, ms(30)).unwrap();
        st.feed(b"data: {\"choices\":[],\"usage\":{\"completion_tokens\":1}}\n\ndata: [DONE]\n\n", ms(31))
            .unwrap();
        let r = measure("k", 0.0, 200, &st, ms(32));
        assert!(r.ok, "{r:?}");
        assert_eq!((r.ttft_ms, r.output_tokens, r.deltas), (Some(30.0), 1, 0));
        let ids = RequestSpec {
            key: "k".into(),
            prompt: Prompt::Ids(vec![5, 6]),
            max_tokens: 1,
            ignore_eos: true,
            model: "m".into(),
            endpoint: Endpoint::Completions,
            speculative: false,
            json_object: false,
        };
        assert_eq!(ids.body()["prompt"], json!([5, 6]));
        assert!(ids.body().get("response_format").is_none());
        let json_object = RequestSpec { json_object: true, ..ids.clone() };
        assert_eq!(json_object.body()["response_format"], json!({"type": "json_object"}));
        assert!(ids.body().get("speculative").is_none(), "only a speculative request names the extension");
        let spec = RequestSpec { speculative: true, ..ids };
        assert_eq!(spec.body()["speculative"], json!(true));
    }

    #[test]
    fn broken_streams_fail_the_request() {
        let mut st = StreamState::default();
        assert!(st.feed(b"data: {not json\n", ms(1)).unwrap_err().starts_with("malformed SSE event"));
        let empty = StreamState { done: true, ..StreamState::default() };
        assert_eq!(
            measure("k", 0.0, 200, &empty, ms(1)).error.as_deref(),
            Some("the stream carried no token")
        );
        let mut cut = StreamState::default();
        cut.feed(b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n", ms(1)).unwrap();
        assert_eq!(
            measure("k", 0.0, 200, &cut, ms(2)).error.as_deref(),
            Some("the stream ended without [DONE]")
        );
    }

    #[test]
    fn fnv1a64_matches_its_published_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a64(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x85944171f73967e8);
    }
}
