//! `kiln serve` against bad input and hostile clients, through the real binary: empty API
//! keys, binding beyond loopback without a key, duration flags out of range, slots no
//! workspace can hold, request logs, response ids across boots, wrong methods, and slow or
//! oversized requests under a lowered open-file limit. A failure prints the server's
//! stderr.

#[path = "../../kiln-serve/tests/client/mod.rs"]
mod client;
// Shared with the other binary tests; not every helper is used here.
#[allow(dead_code)]
mod common;
#[allow(dead_code)]
mod util;

use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use common::Serve;
use util::Dir;

/// How long a command that should stop at once may run before the test calls it hung.
const QUICK: Duration = Duration::from_secs(60);

/// Spawns `cmd` and waits for it, killing it after `within`. Returns the output and
/// whether it was killed.
fn spawn_bounded(mut cmd: std::process::Command, within: Duration) -> (Output, bool) {
    let mut child = cmd.spawn().expect("starting kiln");
    let t = Instant::now();
    let mut killed = false;
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > within {
            let _ = child.kill();
            killed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    (child.wait_with_output().unwrap(), killed)
}

/// `kiln ARGS` with `env`, killed after `within` (a server that should have refused its
/// arguments would otherwise run forever). Returns the output and whether it was killed.
fn run_bounded(args: &[&str], env: &[(&str, &str)], within: Duration) -> (Output, bool) {
    let dir = Dir::new();
    let mut cmd = dir.command(args);
    cmd.envs(env.iter().copied()).stdout(Stdio::piped()).stderr(Stdio::piped());
    spawn_bounded(cmd, within)
}

fn describe(args: &[&str], out: &Output, killed: bool) -> String {
    format!(
        "\n\ncommand: kiln {}\nstatus: {}{}\n---- stderr ----\n{}\n",
        args.join(" "),
        out.status,
        if killed { " (killed: it did not stop by itself)" } else { "" },
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs `args` and expects exit 2 with every one of `needles` on stderr.
fn expect_usage(args: &[&str], env: &[(&str, &str)], needles: &[&str]) {
    let (out, killed) = run_bounded(args, env, QUICK);
    let d = describe(args, &out, killed);
    assert_eq!(out.status.code(), Some(2), "{d}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    for n in needles {
        assert!(stderr.contains(n), "stderr lacks {n:?}{d}");
    }
}

#[test]
fn an_empty_api_key_is_refused_at_start_naming_where_it_came_from() {
    expect_usage(
        &["serve", "-m", "synthetic:tiny", "--port", "0", "--api-key", ""],
        &[],
        &["invalid --api-key", "empty"],
    );
    expect_usage(
        &["serve", "-m", "synthetic:tiny", "--port", "0"],
        &[("KILN_API_KEY", "")],
        &["invalid KILN_API_KEY", "empty", "unset KILN_API_KEY"],
    );
    // A key no client can send is refused too, not left to answer every request 401.
    expect_usage(
        &["serve", "-m", "synthetic:tiny", "--port", "0", "--api-key", "secret "],
        &[],
        &["invalid --api-key", "whitespace"],
    );
}

#[test]
fn binding_beyond_loopback_without_a_key_logs_one_warning() {
    let warning = "without an API key";
    let s = Serve::start(&["-m", "synthetic:tiny", "--host", "0.0.0.0"]);
    let n = s.log().iter().filter(|l| l.contains(warning)).count();
    assert_eq!(n, 1, "one warning line expected{}", s.stderr());
    assert!(s.log().iter().any(|l| l.contains("WARN") && l.contains(warning)), "{}", s.stderr());
    drop(s);
    for args in [
        &["-m", "synthetic:tiny", "--host", "0.0.0.0", "--api-key", "k"][..],
        &["-m", "synthetic:tiny", "--host", "127.0.0.1"][..],
    ] {
        let s = Serve::start(args);
        assert!(
            !s.log().iter().any(|l| l.contains(warning)),
            "no warning expected for {args:?}{}",
            s.stderr()
        );
    }
}

#[test]
fn every_duration_flag_is_range_checked_at_parse_time() {
    // 1e300 panicked at start and 1e19 at SIGTERM (skipping the drain); the rest were
    // accepted or refused without the range.
    for bad in ["1e300", "1e19", "86400.5", "-1", "nan", "inf", "soon"] {
        expect_usage(
            &["serve", "-m", "synthetic:tiny", "--port", "0", "--shutdown-grace", bad],
            &[],
            &["--shutdown-grace", "accepted values are seconds from 0 to 86400"],
        );
    }
    for bad in ["-1", "18446744073709551616", "3600001", "0.5"] {
        expect_usage(
            &["bench-expert-copy", "-m", "synthetic:tiny-moe", "--expert-slots", "4", "--min-time-ms", bad],
            &[],
            &["--min-time-ms", "accepted values are whole milliseconds from 0 to 3600000"],
        );
    }
}

#[test]
fn the_longest_grace_still_drains_on_sigterm_and_exits_0() {
    let mut s = Serve::start(&["-m", "synthetic:tiny", "--shutdown-grace", "86400"]);
    s.signal(libc::SIGTERM);
    s.wait_for("shutting down");
    let status = s.wait_exit(QUICK);
    assert_eq!(status.code(), Some(0), "{}", s.stderr());
    assert!(s.log().iter().any(|l| l.contains("stopped")), "{}", s.stderr());
}

#[test]
fn slots_no_workspace_can_hold_are_exit_2_naming_parallel() {
    // The reason is said once (a load error's reason was printed twice).
    let args = ["serve", "-m", "synthetic:tiny", "--port", "0", "--parallel", "100000000000"];
    let (out, killed) = run_bounded(&args, &[], QUICK);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.matches("invalid --parallel").count(), 1, "{}", describe(&args, &out, killed));

    // 2^64 - 1 slots overflowed the workspace's size and exited 3 "out of memory for
    // scratch" without naming the flag.
    expect_usage(
        &["serve", "-m", "synthetic:tiny", "--port", "0", "--parallel", "18446744073709551615"],
        &[],
        &["invalid --parallel", "18446744073709551615 slots", "accepted values are 1 to"],
    );
    expect_usage(
        &["serve", "-m", "synthetic:tiny", "--port", "0", "--memory-limit", "64MiB", "--parallel", "1000000"],
        &[],
        &["invalid --parallel", "--prefill-chunk 512", "accepted values are 1 to"],
    );
}

fn completion(model: &str) -> serde_json::Value {
    serde_json::json!({"model": model, "prompt": "ids", "max_tokens": 2, "temperature": 0})
}

#[test]
fn sampling_fields_are_refused_by_their_own_names() {
    let s = Serve::start(&["-m", "synthetic:tiny"]);
    // 1e-50 passes a double-precision range check but is 0 in the sampler's single
    // precision; it was reported as `param: temperature`.
    for (field, value) in [
        ("top_p", serde_json::json!(1e-50)),
        ("top_p", serde_json::json!(0)),
        ("temperature", serde_json::json!(-1)),
    ] {
        let mut body = completion("synthetic:tiny");
        body[field] = value.clone();
        let r = client::post(s.addr, "/v1/completions", &body);
        assert_eq!(r.status, 400, "{field}={value}: {}", r.body);
        let e = &r.json()["error"];
        assert_eq!(e["param"], field, "{field}={value}: {}", r.body);
        assert!(e["message"].as_str().unwrap().starts_with(field), "{}", r.body);
    }
}

#[test]
fn a_wrong_method_gets_an_openai_error_body_with_405() {
    let s = Serve::start(&["-m", "synthetic:tiny"]);
    for (method, path, accepted) in [
        ("POST", "/v1/models", "GET"),
        ("GET", "/v1/completions", "POST"),
        ("DELETE", "/v1/chat/completions", "POST"),
        ("POST", "/health", "GET"),
    ] {
        let r = client::request(s.addr, method, path, b"", &[]);
        assert_eq!(r.status, 405, "{method} {path}: {}", r.body);
        let e = &r.json()["error"];
        assert_eq!(e["type"], "invalid_request_error", "{}", r.body);
        assert_eq!(e["code"], "method_not_allowed", "{}", r.body);
        let message = e["message"].as_str().unwrap();
        assert!(
            message.contains(method) && message.contains(&format!("accepted is {accepted}")),
            "{message}"
        );
        assert!(r.header("allow").is_some_and(|a| a.contains(accepted)), "{:?}", r.headers);
    }
}

/// The commit the binary under test was built from, as the fingerprint writes it.
fn built_commit() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

#[test]
fn response_ids_differ_across_boots_and_carry_a_system_fingerprint() {
    let fingerprint = format!("kiln-{}-{}-cpu", env!("CARGO_PKG_VERSION"), built_commit());
    let mut ids = Vec::new();
    for _ in 0..2 {
        let s = Serve::start(&["-m", "synthetic:tiny"]);
        let r = client::post(s.addr, "/v1/completions", &completion("synthetic:tiny"));
        assert_eq!(r.status, 200, "{}{}", r.body, s.stderr());
        assert_eq!(r.json()["system_fingerprint"], fingerprint.as_str(), "{}", r.body);
        ids.push(r.json()["id"].as_str().unwrap().to_string());
        let chat = serde_json::json!({
            "model": "synthetic:tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "stream": true, "stream_options": {"include_usage": true},
        });
        let r = client::post(s.addr, "/v1/chat/completions", &chat);
        assert_eq!(r.status, 200, "{}", r.body);
        let chunks: Vec<serde_json::Value> =
            r.events().iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).unwrap()).collect();
        assert!(chunks.len() >= 3, "{}", r.body);
        for c in &chunks {
            assert_eq!(c["system_fingerprint"], fingerprint.as_str(), "{c}");
            assert_eq!(c["id"], chunks[0]["id"], "one id per stream: {}", r.body);
        }
        ids.push(chunks[0]["id"].as_str().unwrap().to_string());
    }
    // Both boots count from 1; the ids must still differ.
    let unique: std::collections::BTreeSet<_> = ids.iter().collect();
    assert_eq!(unique.len(), ids.len(), "{ids:?}");
    assert!(ids[0].starts_with("cmpl-") && ids[1].starts_with("chatcmpl-"), "{ids:?}");
}

/// Opens a connection and writes `bytes` (a request or part of one) to it.
fn raw(addr: std::net::SocketAddr, bytes: &[u8]) -> std::net::TcpStream {
    use std::io::Write;
    let mut c = std::net::TcpStream::connect(addr).expect("connecting to the server");
    c.write_all(bytes).unwrap();
    c
}

/// Reads from `c` until the server closes it or `within` passes; returns what came and
/// whether the server closed the connection.
fn read_until_closed(c: &mut std::net::TcpStream, within: Duration) -> (String, bool) {
    use std::io::Read;
    c.set_read_timeout(Some(within)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf) {
            Ok(0) => return (String::from_utf8_lossy(&got).into_owned(), true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            // A reset is the server closing too.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return (String::from_utf8_lossy(&got).into_owned(), true);
            }
            Err(_) => return (String::from_utf8_lossy(&got).into_owned(), false),
        }
    }
}

/// `GET /health` on a fresh connection, answered within `within`: its status, or `None`.
fn health_within(addr: std::net::SocketAddr, within: Duration) -> Option<u16> {
    let mut c = raw(addr, b"GET /health HTTP/1.1\r\nHost: kiln\r\nConnection: close\r\n\r\n");
    let (reply, _) = read_until_closed(&mut c, within);
    reply.split_whitespace().nth(1).and_then(|s| s.parse().ok())
}

#[test]
fn slow_clients_under_a_low_open_file_limit_do_not_starve_health() {
    // 96 descriptors: the default --max-connections becomes 96 - 64 = 32. The header
    // timeout is long so that the connection cap, not the timeout, is what is tested.
    let s = Serve::start_with(&["-m", "synthetic:tiny", "--header-timeout", "600"], &[], Some((96, 96)));
    // 100 clients that send part of their headers and then nothing: without a cap they
    // took every descriptor and /health stopped answering.
    let mut slow: Vec<_> = (0..100).map(|_| raw(s.addr, b"GET /health HTTP/1.1\r\nHost: kiln\r\n")).collect();
    for i in 0..5 {
        assert_eq!(
            health_within(s.addr, Duration::from_secs(20)),
            Some(200),
            "health check {i}{}",
            s.stderr()
        );
    }
    // A completion still runs, on a connection of its own.
    let r = client::post(s.addr, "/v1/completions", &completion("synthetic:tiny"));
    assert_eq!(r.status, 200, "{}{}", r.body, s.stderr());
    // The oldest slow clients were the ones closed to make room.
    let (_, closed) = read_until_closed(&mut slow[0], Duration::from_secs(20));
    assert!(closed, "the oldest slow connection is still open{}", s.stderr());
    if let Ok(fds) = std::fs::read_dir(format!("/proc/{}/fd", s.pid())) {
        assert!(fds.count() <= 96, "{}", s.stderr());
    }
}

#[test]
fn an_oversized_content_length_is_refused_with_413_before_the_body() {
    let s = Serve::start(&["-m", "synthetic:tiny", "--max-body-bytes", "1MiB"]);
    // A billion bytes announced, none sent: the answer must not wait for them.
    let mut c = raw(
        s.addr,
        b"POST /v1/completions HTTP/1.1\r\nHost: kiln\r\nContent-Type: application/json\r\n\
          Content-Length: 1000000000\r\n\r\n",
    );
    let (reply, _) = read_until_closed(&mut c, Duration::from_secs(20));
    assert!(reply.starts_with("HTTP/1.1 413"), "{reply:?}{}", s.stderr());
    assert!(reply.contains("\"code\":\"body_too_large\"") && reply.contains("--max-body-bytes"), "{reply}");
}

#[test]
fn slow_bodies_headers_and_idle_connections_are_bounded() {
    let s = Serve::start(&[
        "-m",
        "synthetic:tiny",
        "--body-timeout",
        "1",
        "--header-timeout",
        "1",
        "--keep-alive-timeout",
        "1",
    ]);
    // A body announced as 100 bytes of which 10 come: 408 once --body-timeout passes.
    let mut c =
        raw(s.addr, b"POST /v1/completions HTTP/1.1\r\nHost: kiln\r\nContent-Length: 100\r\n\r\n{\"model\":");
    let (reply, _) = read_until_closed(&mut c, Duration::from_secs(20));
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply:?}{}", s.stderr());
    assert!(reply.contains("\"code\":\"body_timeout\"") && reply.contains("--body-timeout"), "{reply}");
    // Headers that never finish: the connection is closed once --header-timeout passes.
    let mut c = raw(s.addr, b"GET /health HTTP/1.1\r\nHost: kiln\r\n");
    let (reply, closed) = read_until_closed(&mut c, Duration::from_secs(20));
    assert!(closed, "a connection with unfinished headers stayed open: {reply:?}{}", s.stderr());
    // A keep-alive connection: answered, then closed once idle past --keep-alive-timeout.
    let mut c = raw(s.addr, b"GET /health HTTP/1.1\r\nHost: kiln\r\n\r\n");
    let (reply, closed) = read_until_closed(&mut c, Duration::from_secs(20));
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply:?}{}", s.stderr());
    assert!(closed, "an idle keep-alive connection stayed open{}", s.stderr());
    drop(s);
    // Without keep-alive every response closes its connection.
    let s = Serve::start(&["-m", "synthetic:tiny", "--keep-alive-timeout", "0"]);
    let mut c = raw(s.addr, b"GET /health HTTP/1.1\r\nHost: kiln\r\n\r\n");
    let (reply, closed) = read_until_closed(&mut c, Duration::from_secs(20));
    assert!(reply.starts_with("HTTP/1.1 200") && closed, "{reply:?}{}", s.stderr());
}

#[test]
fn connection_flags_are_range_checked() {
    for (flag, bad, range) in [
        ("--header-timeout", "0", "accepted values are seconds above 0 to 3600"),
        ("--header-timeout", "1e9", "accepted values are seconds above 0 to 3600"),
        ("--body-timeout", "-1", "accepted values are seconds above 0 to 3600"),
        ("--keep-alive-timeout", "nan", "accepted values are seconds from 0 to 3600"),
    ] {
        expect_usage(&["serve", "-m", "synthetic:tiny", "--port", "0", flag, bad], &[], &[flag, range]);
    }
    expect_usage(
        &["serve", "-m", "synthetic:tiny", "--port", "0", "--max-connections", "0"],
        &[],
        &["invalid --max-connections 0", "accepted values are 1 to"],
    );
    // More connections than descriptors: refused, naming the limit.
    let args = ["serve", "-m", "synthetic:tiny", "--port", "0", "--max-connections", "200"];
    let (out, killed) = run_limited(&args, 128, QUICK);
    let d = describe(&args, &out, killed);
    assert_eq!(out.status.code(), Some(2), "{d}");
    assert!(
        d.contains("invalid --max-connections 200: accepted values are 1 to 64") && d.contains("128"),
        "{d}"
    );
}

#[test]
fn the_soft_open_file_limit_is_raised_to_the_hard_one_for_connections() {
    // A soft limit of 100 leaves room for 36 connections; the hard limit of 400 for 336.
    let s = Serve::start_with(&["-m", "synthetic:tiny", "--max-connections", "300"], &[], Some((100, 400)));
    let line = s.wait_for("connection limits: ");
    assert!(line.contains("max_connections=300 header_timeout=10s body_timeout=30s keep_alive=5s"), "{line}");
    if let Ok(limits) = std::fs::read_to_string(format!("/proc/{}/limits", s.pid())) {
        let open = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
        assert_eq!(open.split_whitespace().collect::<Vec<_>>()[3..5], ["400", "400"], "{open}");
    }
    drop(s);
    // Without the flag the default grows with --parallel and --max-queue.
    let s = Serve::start_with(
        &["-m", "synthetic:tiny", "--parallel", "4", "--max-queue", "2000"],
        &[],
        Some((4096, 4096)),
    );
    assert!(s.wait_for("connection limits: ").contains("max_connections=2068 "), "{}", s.stderr());
}

/// [`run_bounded`] with the open-file limit lowered to `nofile`.
fn run_limited(args: &[&str], nofile: u64, within: Duration) -> (Output, bool) {
    use std::os::unix::process::CommandExt;
    let dir = Dir::new();
    let mut cmd = dir.command(args);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let limit = libc::rlimit { rlim_cur: nofile as libc::rlim_t, rlim_max: nofile as libc::rlim_t };
    // SAFETY: the closure runs in the forked child before exec and calls only setrlimit,
    // which is async-signal-safe, on a value copied into it.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    spawn_bounded(cmd, within)
}

/// The request lines among `lines` (text format).
fn request_lines(s: &Serve, path: &str, status: u16) -> Vec<String> {
    let needle = format!("method=POST path={path} status={status}");
    s.log().into_iter().filter(|l| l.contains(" request ") && l.contains(&needle)).collect()
}

/// Waits (bounded) for a log line `pick` finds.
fn wait_line(s: &Serve, pick: impl Fn(&Serve) -> Option<String>) -> String {
    let t = Instant::now();
    loop {
        if let Some(l) = pick(s) {
            return l;
        }
        assert!(t.elapsed() < QUICK, "no such request line{}", s.stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn every_request_is_logged_once_with_its_status_tokens_and_error() {
    let s = Serve::start(&["-m", "synthetic:tiny"]);
    let r = client::post(s.addr, "/v1/completions", &completion("synthetic:tiny"));
    assert_eq!(r.status, 200, "{}", r.body);
    let prompt = r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    let line = wait_line(&s, |s| request_lines(s, "/v1/completions", 200).pop());
    assert!(line.contains(" INFO "), "{line}");
    assert!(line.contains("latency_ms="), "{line}");
    assert!(line.contains(&format!("prompt_tokens={prompt} completion_tokens=2")), "{line}");
    assert!(!line.contains("error="), "{line}");

    let mut bad = completion("synthetic:tiny");
    bad["top_p"] = serde_json::json!(2);
    assert_eq!(client::post(s.addr, "/v1/completions", &bad).status, 400);
    let line = wait_line(&s, |s| request_lines(s, "/v1/completions", 400).pop());
    assert!(line.contains("error=\"top_p 2 is out of range"), "{line}");

    let r = client::request(s.addr, "POST", "/v1/nowhere", b"{}", &[]);
    assert_eq!(r.status, 404);
    let line = wait_line(&s, |s| request_lines(s, "/v1/nowhere", 404).pop());
    assert!(line.contains("error=\"no route for POST /v1/nowhere\""), "{line}");

    // A stream is logged when it ends, once, with what it sent.
    let mut body = completion("synthetic:tiny");
    body["max_tokens"] = serde_json::json!(5);
    body["ignore_eos"] = serde_json::json!(true);
    body["stream"] = serde_json::json!(true);
    body["prompt"] = serde_json::json!("a stream");
    let r = client::post(s.addr, "/v1/completions", &body);
    assert_eq!(r.events().last().map(String::as_str), Some("[DONE]"), "{}", r.body);
    let line = wait_line(&s, |s| {
        request_lines(s, "/v1/completions", 200).into_iter().find(|l| l.contains("completion_tokens=5"))
    });
    assert!(!line.contains("error="), "{line}");
    assert_eq!(request_lines(&s, "/v1/completions", 200).len(), 2, "{}", s.stderr());
}

#[test]
fn request_lines_in_json_logs_carry_the_same_fields() {
    let s = Serve::start(&["-m", "synthetic:tiny", "--log-format", "json"]);
    let mut bad = completion("synthetic:tiny");
    bad["model"] = serde_json::json!("nonesuch");
    // An unknown model is OpenAI's 404 `model_not_found`.
    let r = client::post(s.addr, "/v1/completions", &bad);
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(client::post(s.addr, "/v1/completions", &completion("synthetic:tiny")).status, 200);
    let fields = |status: u64| {
        move |s: &Serve| {
            s.log().iter().find_map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).ok()?;
                let f = &v["fields"];
                (f["message"] == "request" && f["path"] == "/v1/completions" && f["status"] == status)
                    .then(|| l.clone())
            })
        }
    };
    let line: serde_json::Value = serde_json::from_str(&wait_line(&s, fields(404))).unwrap();
    let f = &line["fields"];
    assert_eq!(f["method"], "POST", "{line}");
    assert!(f["latency_ms"].as_f64().is_some(), "{line}");
    assert!(f["error"].as_str().unwrap().contains("the model \"nonesuch\" does not exist"), "{line}");
    let line: serde_json::Value = serde_json::from_str(&wait_line(&s, fields(200))).unwrap();
    let f = &line["fields"];
    assert_eq!(f["completion_tokens"], 2, "{line}");
    assert!(f["prompt_tokens"].as_u64().is_some_and(|n| n > 0), "{line}");
    assert!(f.get("error").is_none(), "{line}");
}

#[test]
fn a_blank_model_name_and_a_zero_body_limit_are_refused_at_start() {
    // The first served model "" (no client can name it); the second answered every POST 413.
    for name in ["", "  ", "a\u{7}b"] {
        expect_usage(
            &["serve", "-m", "synthetic:tiny", "--port", "0", "--served-model-name", name],
            &[],
            &["invalid --served-model-name", "non-blank"],
        );
    }
    for zero in ["0", "0MiB"] {
        expect_usage(
            &["serve", "-m", "synthetic:tiny", "--port", "0", "--max-body-bytes", zero],
            &[],
            &["invalid --max-body-bytes", "1 byte or more"],
        );
    }
}

#[test]
fn a_chat_template_file_is_checked_at_start_and_replaces_the_model_s() {
    let dir = Dir::new();
    let bad = dir.path().join("bad.jinja");
    std::fs::write(&bad, "{% for %}").unwrap();
    let bad = bad.to_str().unwrap().to_string();
    expect_usage(
        &["serve", "-m", "synthetic:tiny", "--port", "0", "--chat-template", &bad],
        &[],
        &["invalid --chat-template", "bad.jinja"],
    );
    expect_usage(
        &["serve", "-m", "synthetic:tiny", "--port", "0", "--chat-template", "/nonexistent/t.jinja"],
        &[],
        &["invalid --chat-template", "no such file"],
    );
    // A FIFO would block the start for ever if it were opened.
    let fifo = dir.path().join("t.fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    expect_usage(
        &["serve", "-m", "synthetic:tiny", "--port", "0", "--chat-template", fifo.to_str().unwrap()],
        &[],
        &["invalid --chat-template", "a FIFO"],
    );
    let good = dir.path().join("tools.jinja");
    let template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}\
                    {% if tools %}<tool_call>{% endif %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
    std::fs::write(&good, template).unwrap();
    let s = Serve::start(&["-m", "synthetic:tiny", "--chat-template", good.to_str().unwrap()]);
    let info = client::get(s.addr, "/tokenizer_info");
    assert_eq!(info.status, 200, "{}{}", info.body, s.stderr());
    assert_eq!(info.json()["chat_template"], template, "{}", info.body);
    // The chat endpoint renders through it: /tokenize counts its text.
    let messages = serde_json::json!({"messages": [{"role": "user", "content": "hi"}]});
    let t = client::post(s.addr, "/tokenize", &messages).json();
    let text = client::post(s.addr, "/detokenize", &serde_json::json!({"tokens": t["tokens"]})).json();
    assert_eq!(text["prompt"], "<|user|>hi\n<|assistant|>", "{text}");
}
