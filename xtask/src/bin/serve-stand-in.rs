//! A stand-in for `kiln serve` in the harness's own tests: it speaks the contracted
//! start-up lines (`kernel configuration: ...`, `listening on http://...`), `GET /health`
//! and streaming OpenAI completions with usage, and can be told (by `STAND_IN_*`
//! variables, test-only, never read by kiln) to misbehave the ways a real server can: a
//! slow start, a malformed usage, dying mid-run (exiting, or by SIGKILL), answering 500
//! from some request on while staying up, text that depends on the kernel arm, a
//! probe of the exactness gate that is not exact, a known extra cost per token in the
//! narrow arm (`STAND_IN_NARROW_TOKEN_MS`). A request with `"speculative": true`
//! gets kiln's usage extension and, the first time, the gate's line, decided from
//! `KILN_QMV_WIDE` and `KILN_SPEC_ALLOW_INEXACT` as kiln decides it (the probe's result
//! from `STAND_IN_PROBE`: `exact`, the default; `inexact-wide`; `inexact`).
//! It generates deterministic text from the prompt; it does no inference.

use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use kiln_protocol::{GateOutcome, KernelChangedLine, KernelConfigLine, KvDtype, ListeningLine, SpecGateLine};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn env_u64(k: &str) -> u64 {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(0)
}

fn flag(k: &str) -> bool {
    std::env::var(k).is_ok_and(|v| v == "1")
}

/// The arm as kiln's switch reads it: unset is on; 0, false, no, off (any case) are off.
fn wide() -> (bool, bool) {
    match std::env::var("KILN_QMV_WIDE") {
        Ok(v) => (!matches!(v.to_ascii_lowercase().as_str(), "0" | "false" | "no" | "off"), true),
        Err(_) => (true, false),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) != Some("serve") {
        eprintln!("usage: serve-stand-in serve -m MODEL [--port P]");
        std::process::exit(2);
    }
    let port: u16 =
        args.iter().position(|a| a == "--port").and_then(|i| args.get(i + 1)?.parse().ok()).unwrap_or(0);
    std::thread::sleep(Duration::from_millis(env_u64("STAND_IN_START_DELAY_MS")));
    let (on, pinned) = wide();
    WIDE_AFTER.store(on, Ordering::SeqCst);
    // No crossover fields: the stand-in runs no kernels, as a kiln before the crossover.
    let kernels = KernelConfigLine {
        isa: "scalar".into(),
        threads: 1,
        qmv_wide: on,
        qmv_wide_pinned: pinned,
        qmv_wide_rows: None,
        qmv_crossover: None,
        act: None,
    };
    eprintln!("2026-01-01T00:00:00Z  INFO kiln_serve: {kernels}");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio");
    rt.block_on(async move {
        let listener = match TcpListener::bind(("127.0.0.1", port)).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("ERROR binding 127.0.0.1:{port}: {e}");
                std::process::exit(1);
            }
        };
        let addr = listener.local_addr().expect("local address");
        eprintln!("2026-01-01T00:00:00Z  INFO kiln_serve: {}", ListeningLine { addr });
        loop {
            let Ok((sock, _)) = listener.accept().await else { continue };
            tokio::spawn(handle(sock, on, pinned));
        }
    });
}

/// Completion requests seen so far.
static REQUESTS: AtomicU64 = AtomicU64::new(0);

/// The switch after the gate's decision.
static WIDE_AFTER: AtomicBool = AtomicBool::new(true);
static GATE: Once = Once::new();

/// The gate's decision as docs/environment-variables.md orders it: `(outcome, speculates)`.
fn gate(on: bool, pinned: bool) -> (GateOutcome, bool) {
    let probe = std::env::var("STAND_IN_PROBE").unwrap_or_default();
    let exact = |wide: bool| match probe.as_str() {
        "inexact" => false,
        "inexact-wide" => !wide,
        _ => true,
    };
    let allow = std::env::var("KILN_SPEC_ALLOW_INEXACT").is_ok_and(|v| v == "1");
    WIDE_AFTER.store(on, Ordering::SeqCst);
    if exact(on) {
        return (GateOutcome::Exact, true);
    }
    if !pinned && on && exact(false) {
        WIDE_AFTER.store(false, Ordering::SeqCst);
        return (GateOutcome::ExactWithoutWide, true);
    }
    match (allow, pinned) {
        (true, _) => (GateOutcome::InexactAllowed, true),
        (false, true) => (GateOutcome::DeclinedPinned, false),
        (false, false) => (GateOutcome::InexactDeclined, false),
    }
}

async fn handle(mut sock: TcpStream, on: bool, pinned: bool) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        match sock.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
        }
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let len: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap_or(0))
        })
        .unwrap_or(0);
    while buf.len() < head_end + len {
        match sock.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
        }
    }
    let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
    if path == "/health" {
        let _ = sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok").await;
        return;
    }
    let body: Value = serde_json::from_slice(&buf[head_end..head_end + len]).unwrap_or(Value::Null);
    let n = REQUESTS.fetch_add(1, Ordering::SeqCst) + 1;
    let die_after = env_u64("STAND_IN_DIE_AFTER");
    let die_arm = std::env::var("STAND_IN_DIE_ARM").ok();
    let arm = if on { "1" } else { "0" };
    if die_after > 0 && n > die_after && die_arm.as_deref().is_none_or(|a| a == arm) {
        eprintln!("ERROR stand-in: dying after {die_after} requests, as told");
        if flag("STAND_IN_DIE_BY_SIGKILL") {
            // As the OOM killer or an operator's kill -9 would end it.
            let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
        }
        std::process::exit(3);
    }
    let fail_after = env_u64("STAND_IN_FAIL_AFTER");
    if fail_after > 0 && n > fail_after {
        let body = r#"{"error":{"message":"failing as told","type":"server_error"}}"#;
        let _ = sock
            .write_all(
                format!(
                    "HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                )
                .as_bytes(),
            )
            .await;
        return;
    }
    let prompt = match &body["prompt"] {
        Value::String(s) => s.clone(),
        Value::Null => body["messages"].to_string(),
        ids => ids.to_string(),
    };
    let prompt_tokens = body["prompt"].as_array().map_or_else(|| prompt.split_whitespace().count(), Vec::len);
    let max = body["max_tokens"].as_u64().unwrap_or(16);
    let chat = path.ends_with("/chat/completions");
    let mut seed: u64 =
        prompt.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    if !on && flag("STAND_IN_DIVERGE_NARROW") {
        seed ^= 1;
    }
    let _ = sock
        .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\nconnection: close\r\n\r\n")
        .await;
    // A known injected cost: the narrow arm (qmv_wide off) takes this much longer per token.
    let extra = if on { 0 } else { env_u64("STAND_IN_NARROW_TOKEN_MS") };
    let token_ms = env_u64("STAND_IN_TOKEN_MS").max(1) + extra;
    let mut speculates = false;
    if body["speculative"] == json!(true) {
        GATE.call_once(|| {
            let (outcome, _) = gate(on, pinned);
            let after = WIDE_AFTER.load(Ordering::SeqCst);
            let line = SpecGateLine {
                outcome,
                model: "stand-in".into(),
                k: 4,
                kv_dtype: KvDtype::F16,
                qmv_wide: after,
                reason: "as the stand-in decided".into(),
            };
            eprintln!("2026-01-01T00:00:00Z  WARN kiln_serve::scheduler: {line}");
            if after != on {
                let changed = KernelChangedLine { qmv_wide: after, qmv_wide_pinned: false };
                eprintln!("2026-01-01T00:00:00Z  WARN kiln_serve::scheduler: {changed}");
            }
        });
        speculates = gate_speculates();
    }
    // A speculating stream decodes twice as fast, as if half of every draft were accepted.
    let step =
        if speculates { Duration::from_micros(token_ms * 500) } else { Duration::from_millis(token_ms) };
    for i in 0..max {
        tokio::time::sleep(step).await;
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        let word = format!(" w{}", (seed >> 33) % 1000);
        let ev = if chat {
            let key = if flag("STAND_IN_REASONING") && i < max / 2 { "reasoning_content" } else { "content" };
            json!({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {key: word}}]})
        } else {
            json!({"object": "text_completion", "choices": [{"index": 0, "text": word}]})
        };
        if sock.write_all(format!("data: {ev}\n\n").as_bytes()).await.is_err() {
            return;
        }
    }
    let completion = if flag("STAND_IN_BAD_USAGE") { json!({"n": max}) } else { json!(max) };
    let words = prompt_tokens;
    let mut usage = json!({"choices": [], "usage": {
        "prompt_tokens": words, "completion_tokens": completion, "total_tokens": words as u64 + max,
        "prompt_tokens_details": {"cached_tokens": 0}}});
    if speculates {
        usage["usage"]["speculative"] = json!({"drafted": max, "accepted": max / 2});
    }
    let _ = sock.write_all(format!("data: {usage}\n\ndata: [DONE]\n\n").as_bytes()).await;
    let _ = sock.shutdown().await;
}

/// Whether the gate's decision (made once per process) lets streams speculate.
fn gate_speculates() -> bool {
    let (on, pinned) = wide();
    // The decision is a pure function of the environment, so it can be replayed; the
    // switch it set is kept from the first call.
    let wide_now = WIDE_AFTER.load(Ordering::SeqCst);
    let (_, speculates) = gate(on, pinned);
    WIDE_AFTER.store(wide_now, Ordering::SeqCst);
    speculates
}
