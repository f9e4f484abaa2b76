//! A small blocking HTTP/1.1 client for the server tests: one request per connection
//! (`Connection: close`), chunked bodies decoded, SSE `data:` lines split out. Every
//! read has a timeout so a hung server fails the test instead of hanging it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde_json::Value;

/// How long any read may block.
pub const READ_TIMEOUT: Duration = Duration::from_secs(120);

/// A response.
#[derive(Debug)]
pub struct Reply {
    /// The status code.
    pub status: u16,
    /// Header lines, lowercased names.
    pub headers: Vec<(String, String)>,
    /// The body, de-chunked.
    pub body: String,
}

impl Reply {
    /// The body as JSON; panics with the body when it is not.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// The `data:` payloads of an event stream, in order.
    pub fn events(&self) -> Vec<String> {
        self.body.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// Opens a connection and sends a request with `extra` header lines.
pub fn send(addr: SocketAddr, method: &str, path: &str, body: &[u8], extra: &[(&str, &str)]) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connecting to the server");
    s.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in extra {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    s
}

/// A full request and response.
pub fn request(addr: SocketAddr, method: &str, path: &str, body: &[u8], extra: &[(&str, &str)]) -> Reply {
    read_reply(send(addr, method, path, body, extra))
}

/// `GET path`.
pub fn get(addr: SocketAddr, path: &str) -> Reply {
    request(addr, "GET", path, b"", &[])
}

/// `POST path` with a JSON body.
pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    request(addr, "POST", path, body.to_string().as_bytes(), &[])
}

/// Reads a whole response from `s`.
pub fn read_reply(s: TcpStream) -> Reply {
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).expect("reading the status line");
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).expect("reading a header");
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let chunked = headers.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let mut body = Vec::new();
    if chunked {
        loop {
            line.clear();
            r.read_line(&mut line).expect("reading a chunk size");
            let size =
                usize::from_str_radix(line.trim(), 16).unwrap_or_else(|_| panic!("bad chunk size {line:?}"));
            if size == 0 {
                break;
            }
            let mut chunk = vec![0; size + 2];
            r.read_exact(&mut chunk).expect("reading a chunk");
            body.extend_from_slice(&chunk[..size]);
        }
    } else {
        r.read_to_end(&mut body).expect("reading the body");
    }
    Reply { status, headers, body: String::from_utf8_lossy(&body).into_owned() }
}

/// The concatenated `content` (chat) or `text` (completions) of a stream's chunks, and
/// its final usage object if one came.
pub fn stream_text(reply: &Reply) -> (String, Option<Value>) {
    let mut text = String::new();
    let mut usage = None;
    for e in reply.events() {
        if e == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&e).unwrap_or_else(|err| panic!("bad event {e:?}: {err}"));
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            usage = Some(u.clone());
        }
        for c in v["choices"].as_array().into_iter().flatten() {
            if let Some(t) = c["delta"]["content"].as_str() {
                text.push_str(t);
            }
            if let Some(t) = c["text"].as_str() {
                text.push_str(t);
            }
        }
    }
    (text, usage)
}
