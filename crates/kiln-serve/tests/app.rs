//! The server in-process on synthetic:tiny, bound to port 0: both endpoints streaming and
//! not, usage, batched greedy decoding against sequential, the prompt cache, stop
//! strings, the malformed-request table, disconnects, queue and memory limits, the API
//! key, the penalties, min-p and logit bias against a decode outside the server, the
//! tokenizer endpoints against the completion endpoints' prompt counts, log-probabilities
//! (chat and completion shapes, echo) against the model's own, `n` choices and lists of
//! prompts.

mod client;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use client::{get, post, request, send, stream_text};
use kiln_core::MemoryPool;
use kiln_model::{
    EngineOptions, LoadOptions, LogitAdjustments, Penalizer, Sampler, SamplingParams, Session, WorkspaceShape,
};
use kiln_serve::{SchedulerOptions, Server, ServerConfig, Shared, ThinkTags};
use serde_json::{Value, json};

const MODEL: &str = "synthetic:tiny";

struct TestServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    server: Option<Server>,
    rt: Option<tokio::runtime::Runtime>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(5));
        }
        if let Some(s) = self.server.take() {
            s.stop();
        }
    }
}

fn config() -> ServerConfig {
    ServerConfig {
        model: MODEL.into(),
        model_id: "tiny".into(),
        load: LoadOptions { pool: MemoryPool::unlimited(), quantize: None },
        engine: EngineOptions::default(),
        scheduler: SchedulerOptions {
            parallel: 8,
            prefill_chunk: 32,
            prompt_cache_bytes: 64 << 20,
            speculative: false,
            spec_slots: 1,
            draft_tokens: 4,
        },
        model_draft: None,
        max_queue: 256,
        max_body_bytes: 64 << 10,
        body_timeout: Duration::from_secs(30),
        api_key: None,
        think_tags: ThinkTags::default(),
        chat_template: None,
        backend: Arc::new(kiln_serve::CpuEngine),
    }
}

fn boot(config: ServerConfig) -> TestServer {
    let server = Server::start(config, None).expect("starting the scheduler");
    let shared = server.shared();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap();
    let app = kiln_serve::app(shared.clone());
    // The connection loop `kiln serve` runs, with its default bounds.
    rt.spawn(kiln_serve::conn::serve(
        listener,
        app,
        kiln_serve::ConnLimits::default(),
        std::future::pending(),
    ));
    let t = Instant::now();
    while get(addr, "/health").status != 200 {
        assert!(t.elapsed() < Duration::from_secs(60), "the model did not load in 60 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    TestServer { addr, shared, server: Some(server), rt: Some(rt) }
}

fn completion(prompt: &str, max_tokens: usize) -> Value {
    json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

fn text_of(reply: &client::Reply) -> String {
    assert_eq!(reply.status, 200, "{}", reply.body);
    let v = reply.json();
    v["choices"][0]["text"].as_str().or(v["choices"][0]["message"]["content"].as_str()).unwrap().to_string()
}

fn metric(addr: SocketAddr, name: &str) -> f64 {
    let m = get(addr, "/metrics");
    m.body
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {name} in\n{}", m.body))
        .parse()
        .unwrap()
}

#[test]
fn both_endpoints_stream_and_answer_with_consistent_usage() {
    let s = boot(config());
    let models = get(s.addr, "/v1/models").json();
    assert_eq!(models["data"][0]["id"], "tiny");

    let prompt = "The kiln was built into the side of the hill";
    let whole = post(s.addr, "/v1/completions", &completion(prompt, 12));
    let text = text_of(&whole);
    let v = whole.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // Byte tokenizer: one token per byte after BOS.
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len() + 1);
    assert_eq!(v["usage"]["completion_tokens"], 12);
    assert_eq!(v["usage"]["total_tokens"], prompt.len() + 1 + 12);
    assert!(v["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());

    let mut body = completion(prompt, 12);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let streamed = post(s.addr, "/v1/completions", &body);
    assert_eq!(streamed.status, 200);
    assert!(streamed.header("content-type").unwrap().starts_with("text/event-stream"));
    let events = streamed.events();
    assert_eq!(events.last().unwrap(), "[DONE]", "{}", streamed.body);
    // One chunk per token (its text possibly held back), perhaps one flushing held text
    // at the end, the finish chunk, the usage chunk and [DONE].
    assert!((12 + 3..=12 + 4).contains(&events.len()), "{} events: {}", events.len(), streamed.body);
    let (stext, usage) = stream_text(&streamed);
    assert_eq!(stext, text, "streamed and whole greedy text differ");
    assert_eq!(usage.unwrap()["completion_tokens"], 12);

    let chat = json!({
        "model": "tiny", "messages": [{"role": "user", "content": "hello"}],
        "max_completion_tokens": 8, "temperature": 0, "ignore_eos": true,
    });
    let c = post(s.addr, "/v1/chat/completions", &chat);
    let ctext = text_of(&c);
    let cv = c.json();
    assert_eq!(cv["object"], "chat.completion");
    assert_eq!(cv["choices"][0]["message"]["role"], "assistant");
    let plain = kiln_serve::api::render_plain(&[kiln_model::chat_template::ChatMessage::user("hello")]);
    assert_eq!(cv["usage"]["prompt_tokens"], plain.len() + 1);
    assert_eq!(cv["usage"]["completion_tokens"], 8);
    let mut chat_stream = chat.clone();
    chat_stream["stream"] = json!(true);
    let cs = post(s.addr, "/v1/chat/completions", &chat_stream);
    let first: Value = serde_json::from_str(&cs.events()[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(stream_text(&cs).0, ctext);
    let last: Value = serde_json::from_str(&cs.events()[cs.events().len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");

    // Sampled decoding with a seed reproduces itself.
    let sampled = json!({"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0.9,
                         "top_p": 0.95, "top_k": 40, "seed": 7, "ignore_eos": true});
    let a = text_of(&post(s.addr, "/v1/completions", &sampled));
    let b = text_of(&post(s.addr, "/v1/completions", &sampled));
    assert_eq!(a, b, "a seeded sample must reproduce");
}

/// guidellm's default streaming body asks for `continuous_usage_stats`; vLLM then puts
/// the usage so far on every chunk, and the final usage chunk as `include_usage` does.
#[test]
fn continuous_usage_stats_put_the_usage_so_far_on_every_chunk() {
    let s = boot(config());
    let prompt = "The kiln was built into the side of the hill";
    let chat_prompt = kiln_serve::api::render_plain(&[kiln_model::chat_template::ChatMessage::user(prompt)]);
    let mut completion_body = completion(prompt, 10);
    let mut chat_body = json!({"model": "tiny", "messages": [{"role": "user", "content": prompt}],
                               "max_tokens": 10, "temperature": 0, "ignore_eos": true});
    for (path, body, prompt_tokens) in [
        ("/v1/completions", &mut completion_body, prompt.len() + 1),
        ("/v1/chat/completions", &mut chat_body, chat_prompt.len() + 1),
    ] {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
        let r = post(s.addr, path, body);
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        let events = r.events();
        assert_eq!(events.last().unwrap(), "[DONE]", "{}", r.body);
        let chunks: Vec<Value> =
            events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
        let (last, content) = chunks.split_last().unwrap();
        // The usage chunk of include_usage, with the totals.
        assert_eq!(last["choices"], json!([]), "{path}: {last}");
        assert_eq!(last["usage"]["completion_tokens"], 10, "{path}: {last}");
        let mut previous = 0;
        for c in content {
            let u = &c["usage"];
            assert!(u.is_object(), "{path}: a chunk without usage: {c}");
            let done = u["completion_tokens"].as_u64().unwrap();
            assert!(done >= previous, "{path}: completion_tokens went back: {c}");
            assert_eq!(u["prompt_tokens"], prompt_tokens, "{path}: {c}");
            assert_eq!(u["total_tokens"].as_u64().unwrap(), prompt_tokens as u64 + done, "{path}: {c}");
            previous = done;
        }
        // Each sampled token's chunk counts it: the first content chunk counts one token,
        // the finish chunk all of them.
        let first_token = content.iter().position(|c| c["usage"]["completion_tokens"] == 1);
        assert!(first_token.is_some(), "{path}: no chunk counted the first token: {}", r.body);
        assert_eq!(content.last().unwrap()["usage"]["completion_tokens"], 10, "{path}: {}", r.body);
        assert_eq!(content.last().unwrap()["choices"][0]["finish_reason"], "length");

        // Without include_usage the flag adds nothing, as in vLLM.
        body["stream_options"] = json!({"continuous_usage_stats": true});
        let r = post(s.addr, path, body);
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        for e in r.events().iter().filter(|e| *e != "[DONE]") {
            let v: Value = serde_json::from_str(e).unwrap();
            assert!(v.get("usage").is_none(), "{path}: usage without include_usage: {v}");
        }
        body["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": "yes"});
        let r = post(s.addr, path, body);
        assert_eq!(r.status, 400, "{path}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], "stream_options");
    }
}

/// `GET /v1/models/{id}` answers the served model, ids with a slash included, and OpenAI's
/// 404 `model_not_found` for any other id.
#[test]
fn one_model_is_retrieved_by_its_id_and_an_unknown_id_is_404() {
    let mut c = config();
    c.model_id = "kiln/tiny".into();
    let s = boot(c);
    let list = get(s.addr, "/v1/models").json();
    let one = get(s.addr, "/v1/models/kiln/tiny");
    assert_eq!(one.status, 200, "{}", one.body);
    assert_eq!(one.json(), list["data"][0]);
    assert_eq!(one.json()["object"], "model");
    for other in ["/v1/models/tiny", "/v1/models/kiln/tiny/x", "/v1/models/kiln%2Ftinyx"] {
        let r = get(s.addr, other);
        assert_eq!(r.status, 404, "{other}: {}", r.body);
        assert_eq!(r.json()["error"]["code"], "model_not_found", "{other}: {}", r.body);
        assert!(r.json()["error"]["message"].as_str().unwrap().contains("\"kiln/tiny\""), "{}", r.body);
    }
    // Requests name it the same way.
    let mut body = completion("hi", 2);
    body["model"] = json!("kiln/tiny");
    assert_eq!(post(s.addr, "/v1/completions", &body).status, 200);
}

#[test]
fn concurrent_greedy_requests_match_sequential_ones_bit_for_bit() {
    let s = boot(config());
    let prompts: Vec<String> = (0..8)
        .map(|i| format!("request {i}: {}", "the fire burned for three days ".repeat(i % 3 + 1)))
        .collect();
    let sequential: Vec<String> =
        prompts.iter().map(|p| text_of(&post(s.addr, "/v1/completions", &completion(p, 24)))).collect();
    let steps_before = metric(s.addr, "kiln_decode_steps_total");
    let batch_before = metric(s.addr, "kiln_batch_size_sum");
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (addr, body) = (s.addr, completion(p, 24));
            std::thread::spawn(move || text_of(&post(addr, "/v1/completions", &body)))
        })
        .collect();
    let concurrent: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(concurrent, sequential);
    let steps = metric(s.addr, "kiln_decode_steps_total") - steps_before;
    let rows = metric(s.addr, "kiln_batch_size_sum") - batch_before;
    // 8 x 23 decode rows; had nothing been batched that would take 184 forwards.
    assert!(rows / steps > 1.5, "{rows} rows in {steps} decode steps: decoding was not batched");
}

#[test]
fn a_prompt_cache_hit_returns_the_same_text_and_reports_cached_tokens() {
    let s = boot(config());
    let prompt = "Every spring the potters cleaned the flues and stacked the shelves with bowls and jars.";
    let miss = post(s.addr, "/v1/completions", &completion(prompt, 16));
    let miss_text = text_of(&miss);
    assert_eq!(miss.json()["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let hit = post(s.addr, "/v1/completions", &completion(prompt, 16));
    assert_eq!(text_of(&hit), miss_text);
    let n = prompt.len() + 1;
    assert_eq!(hit.json()["usage"]["prompt_tokens_details"]["cached_tokens"], n - 1);
    assert_eq!(metric(s.addr, "kiln_prompt_cache_hits_total"), 1.0);
    // A longer prompt sharing the prefix adopts it and prefills the rest.
    let longer = format!("{prompt} They sealed the door.");
    let fresh = {
        let mut c = config();
        c.scheduler.prompt_cache_bytes = 0;
        boot(c)
    };
    let expect = text_of(&post(fresh.addr, "/v1/completions", &completion(&longer, 16)));
    let ext = post(s.addr, "/v1/completions", &completion(&longer, 16));
    assert_eq!(text_of(&ext), expect);
    let cached = ext.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached as usize >= n, "cached {cached} of a prompt whose first {n} tokens were cached");
}

#[test]
fn a_stop_string_ends_the_text_before_it() {
    let s = boot(config());
    // A prompt whose greedy continuation on the tiny random model has printable runs.
    let prompt = "1 2 3 4";
    let full = text_of(&post(s.addr, "/v1/completions", &completion(prompt, 40)));
    let chars: Vec<char> = full.chars().collect();
    let Some(at) =
        (5..chars.len().saturating_sub(3)).find(|&i| chars[i..i + 2].iter().all(|c| *c != '\u{fffd}'))
    else {
        panic!("no usable stop string in {full:?}");
    };
    let stop: String = chars[at..at + 2].iter().collect();
    let mut body = completion(prompt, 40);
    body["stop"] = json!([stop]);
    let r = post(s.addr, "/v1/completions", &body);
    let text = text_of(&r);
    let expect = &full[..full.find(&stop).unwrap()];
    assert_eq!(text, expect);
    assert_eq!(r.json()["choices"][0]["finish_reason"], "stop");
}

fn with_logprobs(base: &Value) -> Value {
    let mut b = base.clone();
    b["logprobs"] = json!(true);
    b
}

/// Body, expected status, and why.
fn malformed_table() -> Vec<(String, u16, &'static str)> {
    let mut t: Vec<(String, u16, &'static str)> = Vec::new();
    let ok_c = json!({"model": "tiny", "prompt": "hi", "max_tokens": 2});
    let ok_chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    for raw in [
        "",
        "{",
        "[",
        "null",
        "42",
        "\"text\"",
        "{\"model\": }",
        "{'model': 'tiny'}",
        "[1,2]",
        "true",
        "{\"a\":1,}",
    ] {
        t.push((raw.to_string(), 400, "not a JSON object"));
    }
    let with = |base: &Value, key: &str, v: Value| {
        let mut b = base.clone();
        b[key] = v;
        b.to_string()
    };
    let without = |base: &Value, key: &str| {
        let mut b = base.clone();
        b.as_object_mut().unwrap().remove(key);
        b.to_string()
    };
    for base in [&ok_c, &ok_chat] {
        t.push((without(base, "model"), 400, "no model"));
        // A model this server does not serve is OpenAI's 404; a model that is not a
        // string is a malformed request.
        for v in [json!("other"), json!(""), json!("Tiny"), json!("synthetic:tiny")] {
            t.push((with(base, "model", v), 404, "unknown model"));
        }
        for v in [json!(1), json!(null), json!(["tiny"])] {
            t.push((with(base, "model", v), 400, "model not a string"));
        }
        for v in [json!(0), json!(-1), json!(1.5), json!("8"), json!(1_000_000), json!(true), json!([2])] {
            t.push((with(base, "max_tokens", v), 400, "bad max_tokens"));
        }
        for v in [json!(-0.1), json!(2.01), json!(100), json!("1"), json!([]), json!({})] {
            t.push((with(base, "temperature", v), 400, "bad temperature"));
        }
        for v in [json!(0), json!(-0.5), json!(1.01), json!("0.5"), json!(false)] {
            t.push((with(base, "top_p", v), 400, "bad top_p"));
        }
        for v in [json!(-2), json!(0.5), json!("5")] {
            t.push((with(base, "top_k", v), 400, "bad top_k"));
        }
        for v in [json!("1"), json!(1.5), json!([]), json!(18446744073709551615u64), json!(1e300)] {
            t.push((with(base, "seed", v), 400, "bad seed"));
        }
        for v in [json!(1), json!("yes")] {
            t.push((with(base, "ignore_eos", v.clone()), 400, "bad ignore_eos"));
            t.push((with(base, "stream", v), 400, "bad stream"));
        }
        for v in [json!(5), json!([1]), json!(["a", "b", "c", "d", "e"]), json!({"s": 1})] {
            t.push((with(base, "stop", v), 400, "bad stop"));
        }
        for v in [json!(0), json!(17), json!(-1), json!(1.5), json!("2"), json!(true)] {
            t.push((with(base, "n", v), 400, "bad n"));
        }
        t.push((with(base, "best_of", json!(3)), 400, "best_of other than n"));
        for (k, v) in [
            ("tools", json!([{"type": "code_interpreter"}])),
            ("functions", json!([])),
            ("response_format", json!({"type": "xml"})),
            ("suffix", json!("x")),
            ("unknown_field", json!(1)),
        ] {
            t.push((with(base, k, v), 400, "unsupported field"));
        }
        for (k, v) in [
            ("presence_penalty", json!(2.5)),
            ("presence_penalty", json!("1")),
            ("frequency_penalty", json!(-2.01)),
            ("repetition_penalty", json!(0)),
            ("repetition_penalty", json!(-1)),
            ("repetition_penalty", json!(1e300)),
            ("min_p", json!(-0.1)),
            ("min_p", json!(1.5)),
            ("logit_bias", json!({"abc": 1})),
            ("logit_bias", json!({"999999": 1})),
            ("logit_bias", json!({"01": 1})),
            ("logit_bias", json!({"1": 101})),
            ("logit_bias", json!({"1": "x"})),
            ("logit_bias", json!([1])),
        ] {
            t.push((with(base, k, v), 400, "sampling field out of range"));
        }
        t.push((
            with(base, "stream_options", json!({"include_usage": true})),
            400,
            "stream_options without stream",
        ));
        t.push((with(base, "stream_options", json!(true)), 400, "stream_options not an object"));
        t.push((with(base, "user", json!(5)), 400, "user not a string"));
    }
    t.push((without(&ok_c, "prompt"), 400, "no prompt"));
    for v in [
        json!(null),
        json!(5),
        json!({}),
        json!([]),
        json!([1, "a"]),
        json!([999_999]),
        json!([-1]),
        json!(["a", 5]),
        json!([[]]),
        json!([["a"]]),
        json!([[1], [999_999]]),
        json!([{"text": "a"}]),
    ] {
        t.push((with(&ok_c, "prompt", v), 400, "bad prompt"));
    }
    for v in [json!(true), json!(6), json!(-1), json!(1.5), json!("1")] {
        t.push((with(&ok_c, "logprobs", v), 400, "bad completion logprobs"));
    }
    t.push((with(&ok_c, "echo", json!("yes")), 400, "bad echo"));
    t.push((with(&ok_c, "max_tokens", json!(0)), 400, "max_tokens 0 without echo"));
    t.push((with(&ok_c, "top_logprobs", json!(2)), 400, "top_logprobs on completions"));
    for v in [json!(1), json!("true")] {
        t.push((with(&ok_chat, "logprobs", v), 400, "bad chat logprobs"));
    }
    for v in [json!(21), json!(-1), json!(2.5)] {
        t.push((with(&with_logprobs(&ok_chat), "top_logprobs", v), 400, "bad top_logprobs"));
    }
    t.push((with(&ok_chat, "top_logprobs", json!(3)), 400, "top_logprobs without logprobs"));
    t.push((with(&ok_chat, "echo", json!(true)), 400, "echo on chat"));
    t.push((with(&ok_c, "prompt", json!("x".repeat(2000))), 400, "prompt past the context"));
    t.push((without(&ok_chat, "messages"), 400, "no messages"));
    for v in [
        json!([]),
        json!(null),
        json!("hi"),
        json!([1]),
        json!([{"content": "hi"}]),
        json!([{"role": "user"}]),
        json!([{"role": "robot", "content": "x"}]),
        json!([{"role": "assistant", "content": null}]),
        json!([{"role": 5, "content": "x"}]),
        json!([{"role": "user", "content": 5}]),
        json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        json!([{"role": "user", "content": "hi", "tool_calls": []}]),
        json!([{"role": "user", "content": "x".repeat(2000)}]),
    ] {
        t.push((with(&ok_chat, "messages", v), 400, "bad messages"));
    }
    t.push((with(&ok_chat, "max_completion_tokens", json!(0)), 400, "max_completion_tokens 0"));
    t.push(("x".repeat(70 << 10), 413, "body over the limit"));
    t
}

#[test]
fn malformed_requests_get_the_right_status_and_the_server_keeps_serving() {
    let s = boot(config());
    let table = malformed_table();
    assert!(table.len() >= 100, "{} cases", table.len());
    for (i, (body, status, why)) in table.iter().enumerate() {
        let path = if body.contains("messages") { "/v1/chat/completions" } else { "/v1/completions" };
        let r = request(s.addr, "POST", path, body.as_bytes(), &[("Content-Type", "application/json")]);
        assert_eq!(r.status, *status, "case {i} ({why}): {path} {body:.200}\n{}", r.body);
        let e = r.json();
        let err = &e["error"];
        assert!(err["message"].as_str().is_some_and(|m| !m.is_empty()), "case {i}: {}", r.body);
        assert!(
            err["type"].is_string() && err["code"].is_string() && err.get("param").is_some(),
            "{}",
            r.body
        );
    }
    // An unknown model says so by code, as OpenAI does.
    let unknown =
        post(s.addr, "/v1/completions", &json!({"model": "other", "prompt": "hi", "max_tokens": 1}));
    assert_eq!(unknown.status, 404, "{}", unknown.body);
    assert_eq!(unknown.json()["error"]["code"], "model_not_found", "{}", unknown.body);
    assert_eq!(unknown.json()["error"]["type"], "invalid_request_error", "{}", unknown.body);
    // Unknown routes and methods, too.
    assert_eq!(get(s.addr, "/v2/nothing").status, 404);
    // A wrong method gets an OpenAI error body and the Allow header, as a client expects.
    for (method, path, allow) in
        [("GET", "/v1/completions", "POST"), ("DELETE", "/v1/models", "GET"), ("POST", "/health", "GET")]
    {
        let r = request(s.addr, method, path, b"", &[]);
        assert_eq!(r.status, 405, "{method} {path}: {}", r.body);
        assert!(r.header("allow").is_some_and(|a| a.contains(allow)), "{method} {path}: no Allow {allow}");
        let e = r.json();
        assert_eq!(e["error"]["type"], "invalid_request_error", "{method} {path}: {}", r.body);
        assert_eq!(e["error"]["code"], "method_not_allowed", "{method} {path}: {}", r.body);
    }
    // Still serving.
    text_of(&post(s.addr, "/v1/completions", &completion("still there?", 4)));
    assert_eq!(get(s.addr, "/health").status, 200);
}

#[test]
fn clients_dropping_mid_stream_free_their_slots() {
    let s = boot(config());
    let mut body = completion("drop me", 400);
    body["stream"] = json!(true);
    let bytes = body.to_string();
    let handles: Vec<_> = (0..100)
        .map(|_| {
            let (addr, bytes) = (s.addr, bytes.clone());
            std::thread::spawn(move || {
                let mut conn = send(addr, "POST", "/v1/completions", bytes.as_bytes(), &[]);
                // Read the headers and a little of the stream, then hang up.
                let mut buf = [0u8; 256];
                let _ = std::io::Read::read(&mut conn, &mut buf);
                drop(conn);
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let t = Instant::now();
    loop {
        let (active, queued) = (metric(s.addr, "kiln_active_slots"), metric(s.addr, "kiln_queue_depth"));
        if active == 0.0 && queued == 0.0 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{active} slots, {queued} queued 30 s after every client left"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Far fewer tokens than 100 x 400 were generated.
    assert!(metric(s.addr, "kiln_generated_tokens_total") < 100.0 * 400.0 / 2.0);
    text_of(&post(s.addr, "/v1/completions", &completion("next", 4)));
}

#[test]
fn a_full_queue_answers_429() {
    // A model slow enough that a long request holds the only slot for seconds.
    let mut c = config();
    c.model = "synthetic:smollm-135m".into();
    c.model_id = "tiny".into();
    c.scheduler.parallel = 1;
    c.max_queue = 1;
    let s = boot(c);
    let mut long = completion("hold the slot", 1500);
    long["stream"] = json!(true);
    let mut holder = send(s.addr, "POST", "/v1/completions", long.to_string().as_bytes(), &[]);
    let mut buf = [0u8; 64];
    let _ = std::io::Read::read(&mut holder, &mut buf);
    let waiter = send(s.addr, "POST", "/v1/completions", long.to_string().as_bytes(), &[]);
    let t = Instant::now();
    while metric(s.addr, "kiln_queue_depth") < 1.0 {
        assert!(t.elapsed() < Duration::from_secs(30), "the second request never queued");
        std::thread::sleep(Duration::from_millis(10));
    }
    let r = post(s.addr, "/v1/completions", &completion("one too many", 2));
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "queue_full");
    drop(holder);
    drop(waiter);
}

#[test]
fn a_request_that_can_never_fit_is_refused_naming_the_limit() {
    let info = kiln_model::synthetic::inspect("tiny").unwrap();
    let mut c = config();
    let layout = kiln_model::KvLayout::new(&info.config, kiln_model::KvDtype::F16);
    let ws = WorkspaceShape {
        rows: c.scheduler.parallel + c.scheduler.prefill_chunk,
        logit_rows: c.scheduler.parallel,
    };
    let limit = info.weight_bytes + ws.bytes(&info.config) + layout.block_bytes() + 1024;
    c.load.pool = MemoryPool::with_limit(limit);
    c.scheduler.prompt_cache_bytes = 0;
    let s = boot(c);
    // Fits in one block of 256 positions.
    text_of(&post(s.addr, "/v1/completions", &completion("small", 8)));
    // Needs two blocks: past the limit whatever else is running.
    let r = post(s.addr, "/v1/completions", &completion("large", 600));
    assert_eq!(r.status, 503, "{}", r.body);
    let m = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(m.contains(&limit.to_string()) && m.contains("memory limit"), "{m}");
    text_of(&post(s.addr, "/v1/completions", &completion("small again", 8)));
}

#[test]
fn an_api_key_is_required_when_set() {
    let mut c = config();
    c.api_key = Some("sesame".into());
    let s = boot(c);
    let body = completion("hi", 2).to_string();
    let none = request(s.addr, "POST", "/v1/completions", body.as_bytes(), &[]);
    assert_eq!(none.status, 401);
    assert_eq!(none.json()["error"]["type"], "authentication_error");
    let wrong =
        request(s.addr, "POST", "/v1/completions", body.as_bytes(), &[("Authorization", "Bearer sesamE")]);
    assert_eq!(wrong.status, 401);
    assert_eq!(request(s.addr, "GET", "/v1/models", b"", &[]).status, 401);
    let right =
        request(s.addr, "POST", "/v1/completions", body.as_bytes(), &[("Authorization", "Bearer sesame")]);
    assert_eq!(right.status, 200, "{}", right.body);
    // Health and metrics stay open for probes.
    assert_eq!(get(s.addr, "/health").status, 200);
    assert_eq!(get(s.addr, "/metrics").status, 200);
    let _ = &s.shared;
}

/// Two-character strings that occur exactly once in `text`, the first before the second,
/// without U+FFFD: think tags whose effect on `text` is known.
fn unique_pair(text: &str) -> Option<(String, String)> {
    let chars: Vec<char> = text.chars().collect();
    let once = |s: &str| text.matches(s).count() == 1;
    let candidates: Vec<(usize, String)> = (0..chars.len().saturating_sub(1))
        .map(|i| (i, chars[i..i + 2].iter().collect::<String>()))
        .filter(|(_, s)| !s.contains('\u{fffd}') && once(s))
        .collect();
    for (i, open) in &candidates {
        for (j, close) in &candidates {
            if *j >= i + 3 && !open.contains(close.as_str()) {
                return Some((open.clone(), close.clone()));
            }
        }
    }
    None
}

#[test]
fn text_between_think_tags_streams_as_reasoning_content() {
    let plain = boot(config());
    let mut found = None;
    for i in 0..20 {
        let body = json!({
            "model": "tiny", "messages": [{"role": "user", "content": format!("{i} 2 3 4")}],
            "max_tokens": 48, "temperature": 0, "ignore_eos": true,
        });
        let full = text_of(&post(plain.addr, "/v1/chat/completions", &body));
        if let Some(tags) = unique_pair(&full) {
            found = Some((body, full, tags));
            break;
        }
    }
    let (mut body, full, (open, close)) = found.expect("no greedy output with usable tags");
    let (a, b) = (full.find(&open).unwrap(), full.find(&close).unwrap());
    let reasoning = &full[a + open.len()..b];
    let content = format!("{}{}", &full[..a], &full[b + close.len()..]);

    let mut c = config();
    c.think_tags = ThinkTags { open, close };
    let s = boot(c);
    let r = post(s.addr, "/v1/chat/completions", &body).json();
    assert_eq!(r["choices"][0]["message"]["reasoning_content"], reasoning);
    assert_eq!(r["choices"][0]["message"]["content"], content);
    body["stream"] = json!(true);
    let streamed = post(s.addr, "/v1/chat/completions", &body);
    let mut got_reasoning = String::new();
    for e in streamed.events().iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        if let Some(t) = v["choices"][0]["delta"]["reasoning_content"].as_str() {
            got_reasoning.push_str(t);
        }
    }
    assert_eq!(got_reasoning, reasoning);
    assert_eq!(stream_text(&streamed).0, content);
}

#[test]
fn an_out_of_memory_mid_step_fails_that_request_only() {
    let info = kiln_model::synthetic::inspect("tiny").unwrap();
    let mut c = config();
    // Whole-prompt prefill: the workspace grows with the prompt, which admission (KV
    // only) does not plan, so a long prompt runs out of memory inside the forward.
    c.scheduler.prefill_chunk = 0;
    c.scheduler.prompt_cache_bytes = 0;
    let layout = kiln_model::KvLayout::new(&info.config, kiln_model::KvDtype::F16);
    let small = WorkspaceShape { rows: c.scheduler.parallel, logit_rows: c.scheduler.parallel };
    let large = WorkspaceShape { rows: 501, logit_rows: c.scheduler.parallel };
    let headroom = layout.bytes_for(501 + 8) + 4096;
    assert!(large.bytes(&info.config) - small.bytes(&info.config) > headroom);
    c.load.pool = MemoryPool::with_limit(info.weight_bytes + small.bytes(&info.config) + headroom);
    let s = boot(c);
    let r = post(s.addr, "/v1/completions", &completion(&"x".repeat(500), 8));
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "out_of_memory", "{}", r.body);
    assert!(r.json()["error"]["message"].as_str().unwrap().starts_with("out of memory:"), "{}", r.body);
    // The server is unharmed and serves what fits.
    text_of(&post(s.addr, "/v1/completions", &completion("short", 8)));
    // The gauges are published just after the last token is sent: wait for them, bounded.
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(s.addr, "kiln_active_slots") != 0.0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(metric(s.addr, "kiln_active_slots"), 0.0);
}

#[test]
fn penalties_min_p_and_logit_bias_are_accepted_applied_and_range_checked() {
    let s = boot(config());
    let tokenizer = &s.shared.model().expect("loaded").tokenizer;
    let id = |c: &str| {
        let ids = tokenizer.encode(c, false).unwrap();
        assert_eq!(ids.len(), 1, "{c:?} is {ids:?}");
        ids[0]
    };
    let (a, b) = (id("a"), id("b"));
    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});
    let plain = json!({"model": "tiny", "prompt": "hi", "max_tokens": 3});
    let fields = [
        ("presence_penalty", json!(1.5), json!(2.5)),
        ("frequency_penalty", json!(-2), json!(3)),
        ("repetition_penalty", json!(1.3), json!(0)),
        ("min_p", json!(0.05), json!(1.01)),
        ("logit_bias", json!({a.to_string(): -100, b.to_string(): 3.5}), json!({"-1": 1})),
    ];
    for (path, base) in [("/v1/chat/completions", &chat), ("/v1/completions", &plain)] {
        for (field, good, bad) in &fields {
            for stream in [false, true] {
                let mut body = base.clone();
                body[*field] = good.clone();
                body["stream"] = json!(stream);
                let r = post(s.addr, path, &body);
                assert_eq!(r.status, 200, "{path} {field}={good}: {}", r.body);
            }
            let mut body = base.clone();
            body[*field] = bad.clone();
            let r = post(s.addr, path, &body);
            assert_eq!(r.status, 400, "{path} {field}={bad}: {}", r.body);
            let e = r.json();
            assert_eq!(e["error"]["param"], *field, "{}", r.body);
            let message = e["error"]["message"].as_str().unwrap();
            assert!(message.starts_with(field) && message.contains("accepted"), "{message}");
        }
    }

    // Through the server each field changes the output exactly as the sampling module's
    // transforms do on a decode of the same model outside the server.
    let model =
        kiln_model::load(MODEL, &LoadOptions { pool: MemoryPool::unlimited(), quantize: None }).unwrap();
    let pool = MemoryPool::unlimited();
    let reference = |prompt: &str, sampling: SamplingParams, adjust: LogitAdjustments| {
        let ids = model.tokenizer.encode(prompt, true).unwrap();
        let mut session = Session::new(&model, &pool, EngineOptions::default()).unwrap();
        let mut sampler = Sampler::new(sampling, model.config.vocab_size).unwrap();
        let mut penalizer = Penalizer::new(adjust, &ids);
        let mut logits = session.prefill(&ids).unwrap().to_vec();
        let mut out = Vec::new();
        while out.len() < 8 {
            penalizer.apply(&mut logits);
            let t = sampler.sample(&logits);
            penalizer.observe(t);
            out.push(t);
            logits = session.decode_step(t).unwrap().to_vec();
        }
        model.tokenizer.decode(&out).unwrap()
    };
    let served = |prompt: &str, extra: Value| {
        let mut body =
            json!({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": true});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        text_of(&post(s.addr, "/v1/completions", &body))
    };
    let greedy = SamplingParams::default();
    let plain_text = reference("The kiln", greedy, LogitAdjustments::default());
    assert_eq!(served("The kiln", json!({})), plain_text);
    let (sa, sb) = (a.to_string(), b.to_string());
    let bias = vec![(a, 100.0), (b, 100.0)];
    let cases = [
        (
            json!({"logit_bias": {&sa: 100}}),
            LogitAdjustments { logit_bias: vec![(a, 100.0)], ..Default::default() },
        ),
        (
            json!({"logit_bias": {&sa: 100, &sb: 100}, "frequency_penalty": 2}),
            LogitAdjustments { logit_bias: bias.clone(), frequency_penalty: 2.0, ..Default::default() },
        ),
        (
            json!({"logit_bias": {&sa: 100, &sb: 100}, "presence_penalty": 2}),
            LogitAdjustments { logit_bias: bias.clone(), presence_penalty: 2.0, ..Default::default() },
        ),
        (json!({"frequency_penalty": 2}), LogitAdjustments { frequency_penalty: 2.0, ..Default::default() }),
        (json!({"presence_penalty": -2}), LogitAdjustments { presence_penalty: -2.0, ..Default::default() }),
        (
            json!({"repetition_penalty": 3}),
            LogitAdjustments { repetition_penalty: 3.0, ..Default::default() },
        ),
    ];
    for (fields, adjust) in cases {
        let want = reference("The kiln", greedy, adjust);
        assert_ne!(want, plain_text, "{fields} changes nothing on this model: pick a case that does");
        assert_eq!(served("The kiln", fields.clone()), want, "{fields}");
    }
    // A bias of 100 makes greedy decoding pick that token every step.
    assert_eq!(served("The kiln", json!({"logit_bias": {&sa: 100}})), "a".repeat(8));
    // The repetition penalty counts the prompt too: the prompt's "a"s push "a" below "b"
    // when both have a bias of 100 (a positive logit divided by the penalty).
    let both = json!({&sa: 100, &sb: 100});
    let first = |prompt: &str| {
        let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "ignore_eos": true, "logit_bias": both, "repetition_penalty": 2});
        text_of(&post(s.addr, "/v1/completions", &body))
    };
    assert_eq!(first("aaaa"), "b");
    assert_eq!(first("bbbb"), "a");
    // min-p when sampling: the same seed draws the same tokens as the reference, and
    // differently from sampling without min-p.
    let sampled = SamplingParams { temperature: 1.0, seed: 7, ..Default::default() };
    let with_min_p =
        reference("The kiln", SamplingParams { min_p: 0.5, ..sampled }, LogitAdjustments::default());
    assert_ne!(with_min_p, reference("The kiln", sampled, LogitAdjustments::default()));
    assert_eq!(served("The kiln", json!({"temperature": 1, "seed": 7, "min_p": 0.5})), with_min_p);
}

#[test]
fn tokenize_counts_what_the_completion_endpoints_count_and_detokenize_inverts_it() {
    let mut c = config();
    c.api_key = Some("sesame".into());
    let s = boot(c);
    let auth = [("Authorization", "Bearer sesame"), ("Content-Type", "application/json")];
    let call = |path: &str, body: &Value| request(s.addr, "POST", path, body.to_string().as_bytes(), &auth);
    let prompt = "The kiln was built into the side of the hill";
    let messages = json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]);

    // The same ids the completion endpoints count as prompt_tokens.
    let t = call("/tokenize", &json!({"model": "tiny", "prompt": prompt}));
    assert_eq!(t.status, 200, "{}", t.body);
    let t = t.json();
    let ids: Vec<u64> = t["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(t["count"], ids.len());
    assert_eq!(t["max_model_len"], s.shared.model().unwrap().config.max_position_embeddings);
    let done = call("/v1/completions", &json!({"model": "tiny", "prompt": prompt, "max_tokens": 1}));
    assert_eq!(done.status, 200, "{}", done.body);
    assert_eq!(done.json()["usage"]["prompt_tokens"], ids.len());
    // The ids as a prompt give the same completion as the text.
    let by_ids =
        call("/v1/completions", &json!({"model": "tiny", "prompt": ids, "max_tokens": 4, "temperature": 0}));
    let by_text = call(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(text_of(&by_ids), text_of(&by_text));

    let chat = call("/tokenize", &json!({"messages": messages}));
    assert_eq!(chat.status, 200, "{}", chat.body);
    let chat_count = chat.json()["count"].as_u64().unwrap();
    let done = call("/v1/chat/completions", &json!({"model": "tiny", "messages": messages, "max_tokens": 1}));
    assert_eq!(done.status, 200, "{}", done.body);
    assert_eq!(done.json()["usage"]["prompt_tokens"], chat_count);

    // Without the generation prompt ("assistant: ") and without BOS.
    let bare = call("/tokenize", &json!({"messages": messages, "add_generation_prompt": false}));
    assert_eq!(
        bare.json()["count"].as_u64().unwrap(),
        chat_count - "assistant: ".len() as u64,
        "{}",
        bare.body
    );
    let no_bos = call("/tokenize", &json!({"prompt": prompt, "add_special_tokens": false}));
    assert_eq!(no_bos.json()["count"].as_u64().unwrap(), ids.len() as u64 - 1, "{}", no_bos.body);

    // Detokenize gives the text back.
    let back = call("/detokenize", &json!({"model": "tiny", "tokens": no_bos.json()["tokens"]}));
    assert_eq!(back.status, 200, "{}", back.body);
    assert_eq!(back.json()["prompt"], prompt);
    let back = call("/detokenize", &json!({"tokens": ids}));
    assert_eq!(back.json()["prompt"], prompt, "BOS is skipped: {}", back.body);

    // llama-server's shape: content, special tokens only with add_special.
    let llama = call("/tokenize", &json!({"content": prompt}));
    assert_eq!(llama.json()["tokens"], no_bos.json()["tokens"], "{}", llama.body);
    let llama = call("/tokenize", &json!({"content": prompt, "add_special": true}));
    assert_eq!(llama.json()["tokens"], json!(ids), "{}", llama.body);
    assert_eq!(call("/detokenize", &json!({"tokens": ids})).json()["content"], prompt);

    // Bad input is a 400 naming the field; another model a 404; no key a 401.
    for (path, body, param) in [
        ("/tokenize", json!({}), "prompt"),
        ("/tokenize", json!({"prompt": prompt, "messages": messages}), "prompt"),
        ("/tokenize", json!({"prompt": 5}), "prompt"),
        ("/tokenize", json!({"prompt": prompt, "add_generation_prompt": true}), "add_generation_prompt"),
        ("/tokenize", json!({"prompt": prompt, "add_special_tokens": "no"}), "add_special_tokens"),
        ("/tokenize", json!({"prompt": prompt, "return_token_strs": true}), "return_token_strs"),
        ("/tokenize", json!({"messages": []}), "messages"),
        ("/tokenize", json!({"messages": [{"role": "robot", "content": "x"}]}), "messages[0].role"),
        ("/tokenize", json!({"content": 5}), "content"),
        ("/tokenize", json!({"content": prompt, "prompt": prompt}), "prompt"),
        ("/tokenize", json!({"prompt": prompt, "add_special": true}), "add_special"),
        ("/detokenize", json!({}), "tokens"),
        ("/detokenize", json!({"tokens": "abc"}), "tokens"),
        ("/detokenize", json!({"tokens": [1, 999_999]}), "tokens"),
        ("/detokenize", json!({"tokens": [-1]}), "tokens"),
        ("/detokenize", json!({"tokens": [1], "prompt": "x"}), "prompt"),
    ] {
        let r = call(path, &body);
        assert_eq!(r.status, 400, "{path} {body}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{path} {body}: {}", r.body);
    }
    let r = call("/tokenize", &json!({"model": "other", "prompt": prompt}));
    assert_eq!(r.status, 404, "{}", r.body);
    let r = request(s.addr, "POST", "/tokenize", json!({"prompt": prompt}).to_string().as_bytes(), &[]);
    assert_eq!(r.status, 401, "{}", r.body);
    let r = request(s.addr, "POST", "/detokenize", json!({"tokens": [1]}).to_string().as_bytes(), &[]);
    assert_eq!(r.status, 401, "{}", r.body);
    let r = request(s.addr, "GET", "/tokenize", b"", &auth);
    assert_eq!(r.status, 405, "{}", r.body);
}

/// The log-probabilities of `ids[1..]` under the model, and of the token after them (the
/// last row), as `kiln score` computes them: [`kiln_model::logprobs::score_sequence`]
/// over a fresh cache with the server's engine options.
fn scored(ids: &[u32]) -> Vec<Vec<f32>> {
    let pool = MemoryPool::unlimited();
    let model =
        kiln_model::load(MODEL, &LoadOptions { pool: pool.clone(), quantize: None }).expect("loading tiny");
    let mut engine = kiln_model::Engine::new(&model, &pool, config().engine).unwrap();
    let mut cache = engine.new_cache();
    let mut rows = Vec::new();
    kiln_model::logprobs::score_sequence(&mut engine, &mut cache, ids, 0, |_, _, lp| rows.push(lp.to_vec()))
        .unwrap();
    rows
}

/// The greedy continuation of `ids` and each token's log-softmax row, decoded outside
/// the server.
fn greedy_rows(ids: &[u32], n: usize) -> Vec<(u32, Vec<f32>)> {
    let pool = MemoryPool::unlimited();
    let model =
        kiln_model::load(MODEL, &LoadOptions { pool: pool.clone(), quantize: None }).expect("loading tiny");
    let mut session = Session::new(&model, &pool, EngineOptions::default()).unwrap();
    let mut logits = session.prefill(ids).unwrap().to_vec();
    let mut out = Vec::new();
    while out.len() < n {
        let mut lp = vec![0f32; logits.len()];
        kiln_model::logprobs::log_softmax(&logits, &mut lp);
        let t = kiln_model::ops::argmax(&logits) as u32;
        out.push((t, lp));
        logits = session.decode_step(t).unwrap().to_vec();
    }
    out
}

fn close(a: f64, b: f32) -> bool {
    (a - f64::from(b)).abs() <= 1e-5 * (1.0 + f64::from(b).abs())
}

#[test]
fn chat_logprobs_and_top_logprobs_come_in_openai_s_shape_streamed_and_not() {
    let s = boot(config());
    let prompt = "Tell me about the kiln";
    let body = json!({
        "model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 6,
        "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 3,
    });
    let r = post(s.addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().expect("logprobs.content").clone();
    assert_eq!(content.len(), 6, "{v}");
    let plain = kiln_serve::api::render_plain(&[kiln_model::chat_template::ChatMessage::user(prompt)]);
    let ids = s.shared.model().unwrap().tokenizer.encode(&plain, true).unwrap();
    let want = greedy_rows(&ids, 6);
    let mut text = String::new();
    for (e, (token, lp)) in content.iter().zip(&want) {
        // The set of keys: serde_json keeps insertion order in this workspace (llguidance
        // turns on `preserve_order`).
        let mut keys: Vec<&str> = e.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["bytes", "logprob", "token", "top_logprobs"], "{e}");
        text.push_str(e["token"].as_str().unwrap());
        assert!(close(e["logprob"].as_f64().unwrap(), lp[*token as usize]), "{e} vs {}", lp[*token as usize]);
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{e}");
        // Greedy: the chosen token is the most likely one, the list sorted.
        assert_eq!(top[0]["token"], e["token"], "{e}");
        assert_eq!(top[0]["logprob"], e["logprob"], "{e}");
        let values: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(values.windows(2).all(|w| w[0] >= w[1]), "{values:?}");
        for t in top {
            assert!(t["bytes"].is_array() && t["token"].is_string(), "{t}");
        }
    }
    assert_eq!(text, text_of(&r), "the tokens' texts spell the content");

    // Streamed: the same entries, spread over the chunks.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let sr = post(s.addr, "/v1/chat/completions", &streamed);
    let mut entries = Vec::new();
    for e in sr.events().iter().filter(|e| *e != "[DONE]") {
        let c: Value = serde_json::from_str(e).unwrap();
        if let Some(l) = c["choices"][0]["logprobs"]["content"].as_array() {
            entries.extend(l.iter().cloned());
        }
    }
    assert_eq!(entries, content, "{}", sr.body);

    // Without top_logprobs: the chosen token only; without logprobs: null.
    let mut only = body.clone();
    only.as_object_mut().unwrap().remove("top_logprobs");
    let o = post(s.addr, "/v1/chat/completions", &only).json();
    assert_eq!(o["choices"][0]["logprobs"]["content"][0]["top_logprobs"], json!([]), "{o}");
    only.as_object_mut().unwrap().remove("logprobs");
    let o = post(s.addr, "/v1/chat/completions", &only).json();
    assert!(o["choices"][0]["logprobs"].is_null(), "{o}");
}

#[test]
fn completion_logprobs_with_echo_and_no_tokens_are_the_prompt_s_scores() {
    let s = boot(config());
    let prompt = "The potters sealed the door with bricks and mud, then lit the fire.";
    let ids = s.shared.model().unwrap().tokenizer.encode(prompt, true).unwrap();
    let rows = scored(&ids);
    // lm-evaluation-harness's loglikelihood request.
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 1,
                      "temperature": 0});
    let r = post(s.addr, "/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let c = &v["choices"][0];
    assert_eq!(c["text"], prompt, "{v}");
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 0);
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    let l = &c["logprobs"];
    let tokens: Vec<&str> = l["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(tokens.len(), ids.len());
    assert_eq!(tokens.concat(), prompt, "BOS has no text");
    let lps = l["token_logprobs"].as_array().unwrap();
    assert!(lps[0].is_null() && l["top_logprobs"][0].is_null(), "{l}");
    for (p, lp) in lps.iter().enumerate().skip(1) {
        // Exactly the value score writes: f32 through JSON and back.
        let want = rows[p - 1][ids[p] as usize];
        assert_eq!(lp.as_f64().unwrap() as f32, want, "position {p}");
        let top = l["top_logprobs"][p].as_object().unwrap();
        assert_eq!(top.len(), 1, "{top:?}");
        let best = rows[p - 1].iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(top.values().next().unwrap().as_f64().unwrap() as f32, best);
    }
    let offsets: Vec<u64> =
        l["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap()).collect();
    assert_eq!(offsets[0], 0);
    assert_eq!(offsets[1], 0);
    assert_eq!(*offsets.last().unwrap(), prompt.len() as u64 - 1);

    // Streamed, the same values come in the first chunk.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let sr = post(s.addr, "/v1/completions", &streamed);
    let first: Value = serde_json::from_str(&sr.events()[0]).unwrap();
    assert_eq!(first["choices"][0]["logprobs"], *l, "{}", sr.body);
    assert_eq!(stream_text(&sr).0, prompt);

    // With tokens to generate: the prompt's entries, then the completion's, the text
    // the prompt then the answer.
    let mut more = body.clone();
    more["max_tokens"] = json!(4);
    more["ignore_eos"] = json!(true);
    let m = post(s.addr, "/v1/completions", &more).json();
    let ml = &m["choices"][0]["logprobs"];
    assert_eq!(ml["tokens"].as_array().unwrap().len(), ids.len() + 4, "{m}");
    assert_eq!(ml["token_logprobs"].as_array().unwrap()[..ids.len()], lps[..], "{m}");
    let answer = text_of(&post(s.addr, "/v1/completions", &completion(prompt, 4)));
    assert_eq!(m["choices"][0]["text"], format!("{prompt}{answer}"));
    let want = greedy_rows(&ids, 4);
    for (k, (token, lp)) in want.iter().enumerate() {
        let got = ml["token_logprobs"][ids.len() + k].as_f64().unwrap();
        assert!(close(got, lp[*token as usize]), "generated token {k}: {got} vs {}", lp[*token as usize]);
    }
    // Echo without logprobs: the text only.
    let plain = json!({"model": "tiny", "prompt": prompt, "max_tokens": 0, "echo": true});
    let p = post(s.addr, "/v1/completions", &plain).json();
    assert_eq!(p["choices"][0]["text"], prompt, "{p}");
    assert!(p["choices"][0]["logprobs"].is_null(), "{p}");
}

#[test]
fn n_greedy_choices_are_identical_share_the_prompt_and_sum_their_usage() {
    let s = boot(config());
    let prompt = "Every spring the potters cleaned the flues and stacked the shelves.";
    let one = text_of(&post(s.addr, "/v1/completions", &completion(prompt, 5)));
    let hits = metric(s.addr, "kiln_prompt_cache_hits_total");
    let fresh = boot(config());
    let mut body = completion(&format!("{prompt} Again."), 5);
    body["n"] = json!(3);
    body["best_of"] = json!(3);
    let r = post(fresh.addr, "/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    let texts: Vec<&str> = choices.iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert!(texts.iter().all(|t| *t == texts[0]), "{texts:?}");
    for (k, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], k);
    }
    assert_eq!(v["usage"]["completion_tokens"], 15, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len() + " Again.".len() + 1, "{v}");
    // The second and third choices waited for the first's prefill and adopted its
    // prompt from its live slot: the prompt ran once, plus its last token for each.
    let tokens = prompt.len() + " Again.".len() + 1;
    assert_eq!(metric(fresh.addr, "kiln_prefill_tokens_total"), (tokens + 2) as f64);
    assert_eq!(metric(fresh.addr, "kiln_prompt_cache_hits_total"), 2.0);
    drop(fresh);
    assert_eq!(metric(s.addr, "kiln_prompt_cache_hits_total"), hits);

    // Chat, streamed: every chunk names its choice; each choice's text is the greedy one.
    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 5,
                      "temperature": 0, "ignore_eos": true, "n": 2, "stream": true,
                      "stream_options": {"include_usage": true}});
    let whole = {
        let mut b = chat.clone();
        b["n"] = json!(1);
        b["stream"] = json!(false);
        b.as_object_mut().unwrap().remove("stream_options");
        text_of(&post(s.addr, "/v1/chat/completions", &b))
    };
    let sr = post(s.addr, "/v1/chat/completions", &chat);
    let mut per = [String::new(), String::new()];
    let (mut roles, mut finishes) = (0, 0);
    let mut usage = Value::Null;
    for e in sr.events().iter().filter(|e| *e != "[DONE]") {
        let c: Value = serde_json::from_str(e).unwrap();
        if !c["usage"].is_null() {
            usage = c["usage"].clone();
        }
        for ch in c["choices"].as_array().unwrap() {
            let k = ch["index"].as_u64().unwrap() as usize;
            per[k].push_str(ch["delta"]["content"].as_str().unwrap_or(""));
            roles += usize::from(ch["delta"]["role"] == "assistant");
            finishes += usize::from(ch["finish_reason"] == "length");
        }
    }
    assert_eq!(per, [whole.clone(), whole], "{}", sr.body);
    assert_eq!((roles, finishes), (2, 2), "{}", sr.body);
    assert_eq!(usage["completion_tokens"], 10, "{}", sr.body);

    // Seeded sampling: each choice has its own seed, the request as a whole reproduces.
    let sampled = json!({"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 1.0,
                         "seed": 11, "ignore_eos": true, "n": 3});
    let a = post(s.addr, "/v1/completions", &sampled).json();
    let b = post(s.addr, "/v1/completions", &sampled).json();
    assert_eq!(a["choices"], b["choices"]);
    let texts: Vec<&str> =
        a["choices"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert!(texts[0] != texts[1] || texts[1] != texts[2], "{texts:?}");
    assert_eq!(one, text_of(&post(s.addr, "/v1/completions", &completion(prompt, 5))));
}

#[test]
fn a_list_of_prompts_gives_n_choices_each_indexed_prompt_major() {
    let mut c = config();
    c.max_queue = 5;
    let s = boot(c);
    let prompts = ["The kiln was built into the hill", "Bowls and jars"];
    let single: Vec<String> =
        prompts.iter().map(|p| text_of(&post(s.addr, "/v1/completions", &completion(p, 4)))).collect();
    let tokenizer = &s.shared.model().unwrap().tokenizer;
    let ids: Vec<Vec<u32>> = prompts.iter().map(|p| tokenizer.encode(p, true).unwrap()).collect();
    for (prompt, stream) in [(json!(prompts), false), (json!(ids), false), (json!(prompts), true)] {
        let mut body = completion("", 4);
        body["prompt"] = prompt.clone();
        body["n"] = json!(2);
        body["stream"] = json!(stream);
        let r = post(s.addr, "/v1/completions", &body);
        assert_eq!(r.status, 200, "{prompt}: {}", r.body);
        let mut texts = vec![String::new(); 4];
        if stream {
            for e in r.events().iter().filter(|e| *e != "[DONE]") {
                let v: Value = serde_json::from_str(e).unwrap();
                for ch in v["choices"].as_array().unwrap() {
                    texts[ch["index"].as_u64().unwrap() as usize].push_str(ch["text"].as_str().unwrap());
                }
            }
        } else {
            let v = r.json();
            for (k, ch) in v["choices"].as_array().unwrap().iter().enumerate() {
                assert_eq!(ch["index"], k);
                texts[k] = ch["text"].as_str().unwrap().to_string();
            }
            assert_eq!(v["usage"]["prompt_tokens"], ids[0].len() + ids[1].len(), "each prompt counted once");
            assert_eq!(v["usage"]["completion_tokens"], 16);
        }
        // Prompt i's choice j is index i * n + j.
        assert_eq!(
            texts,
            [single[0].clone(), single[0].clone(), single[1].clone(), single[1].clone()],
            "{prompt}"
        );
    }
    // More sequences than the queue holds: a 400 naming the field that multiplies them.
    let mut body = completion("x", 2);
    body["n"] = json!(6);
    let r = post(s.addr, "/v1/completions", &body);
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "n", "{}", r.body);
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("--max-queue 5"), "{}", r.body);
    body["n"] = json!(2);
    body["prompt"] = json!(["a", "b", "c"]);
    let r = post(s.addr, "/v1/completions", &body);
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "prompt", "{}", r.body);
}

#[test]
fn a_seed_past_64_signed_bits_is_refused_naming_the_range() {
    let s = boot(config());
    let body = json!({"model": "tiny", "prompt": "x", "max_tokens": 1, "seed": 18446744073709551615u64});
    let r = post(s.addr, "/v1/completions", &body);
    assert_eq!(r.status, 400, "{}", r.body);
    let e = &r.json()["error"];
    assert_eq!(e["param"], "seed");
    let m = e["message"].as_str().unwrap();
    assert!(m.contains("out of range") && m.contains("-9223372036854775808 to 9223372036854775807"), "{m}");
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "x", "max_tokens": 1, "seed": 1.5}),
    );
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("must be an integer"), "{}", r.body);
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "x", "max_tokens": 1, "seed": i64::MIN}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn tokenizer_info_gives_what_a_remote_tokenizer_reads() {
    let mut c = config();
    c.api_key = Some("sesame".into());
    let s = boot(c);
    assert_eq!(get(s.addr, "/tokenizer_info").status, 401, "behind the key, as /tokenize is");
    let r = request(s.addr, "GET", "/tokenizer_info", b"", &[("Authorization", "Bearer sesame")]);
    assert_eq!(r.status, 200, "{}", r.body);
    let info = r.json();
    // lm-evaluation-harness's RemoteTokenizer reads these four.
    for key in ["eos_token", "bos_token", "pad_token", "chat_template"] {
        assert!(info.get(key).is_some(), "{key} missing: {info}");
    }
    assert!(info["eos_token"].is_string() && info["chat_template"].is_string(), "{info}");
    assert_eq!(info["model"], "tiny");
    // The same special tokens and template as the tokenizer_config.json that
    // `kiln export-tokenizer` writes for a client-side tokenizer.
    let m = s.shared.model().unwrap();
    let written =
        kiln_model::tokenizer_files::tokenizer_config_of(&m.config, &m.tokenizer, m.chat_template.as_ref())
            .unwrap();
    for key in ["eos_token", "bos_token", "chat_template", "model_max_length"] {
        assert_eq!(info[key], written[key], "{key}");
    }
    // A wrong method names the one accepted.
    let r = request(s.addr, "GET", "/tokenize", b"", &[("Authorization", "Bearer sesame")]);
    assert_eq!(r.status, 405);
    assert!(r.body.contains("accepted is POST"), "{}", r.body);
}
