//! A stand-in for `kiln serve` in the harness's own tests: it speaks the contracted
//! start-up lines (`kernel configuration: ...`, `listening on http://...`), `GET /health`
//! and streaming OpenAI completions with usage, and can be told (by `STAND_IN_*`
//! variables, test-only, never read by kiln) to misbehave the ways a real server can: a
//! slow start, a malformed usage, dying mid-run, text that depends on the kernel arm.
//! It generates deterministic text from the prompt; it does no inference.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

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
    eprintln!(
        "2026-01-01T00:00:00Z  INFO kiln_serve: kernel configuration: isa=scalar threads=1 qmv_wide={} qmv_wide_pinned={}",
        if on { "on" } else { "off" },
        if pinned { "yes" } else { "no" }
    );
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
        eprintln!("2026-01-01T00:00:00Z  INFO kiln_serve: listening on http://{addr}");
        loop {
            let Ok((sock, _)) = listener.accept().await else { continue };
            tokio::spawn(handle(sock, on));
        }
    });
}

/// Completion requests seen so far.
static REQUESTS: AtomicU64 = AtomicU64::new(0);

async fn handle(mut sock: TcpStream, on: bool) {
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
        std::process::exit(3);
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
    let token_ms = env_u64("STAND_IN_TOKEN_MS").max(1);
    for i in 0..max {
        tokio::time::sleep(Duration::from_millis(token_ms)).await;
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
    let usage = json!({"choices": [], "usage": {
        "prompt_tokens": words, "completion_tokens": completion, "total_tokens": words as u64 + max,
        "prompt_tokens_details": {"cached_tokens": 0}}});
    let _ = sock.write_all(format!("data: {usage}\n\ndata: [DONE]\n\n").as_bytes()).await;
    let _ = sock.shutdown().await;
}
