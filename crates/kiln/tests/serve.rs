//! `kiln serve` as a user runs it: the real binary on an ephemeral port with a synthetic
//! model (and one MoE checkpoint). The contracted log lines, greedy text equal to `kiln generate`'s, echoed
//! prompt log-probabilities equal to `kiln score`'s, a second
//! server on a taken port, SIGTERM during streams, JSON logs, and a model that does not
//! load. A failure prints the server's whole stderr.

#[path = "../../kiln-serve/tests/client/mod.rs"]
mod client;
// Shared with the other binary tests; not every helper is used here.
#[allow(dead_code)]
mod common;
#[allow(dead_code)]
mod util;

use std::time::{Duration, Instant};

use client::{get, post, send, stream_text};
use common::Serve;
use serde_json::{Value, json};
use util::Dir;

fn greedy(prompt: &str, n: usize) -> Value {
    json!({"model": "synthetic:tiny", "prompt": prompt, "max_tokens": n, "temperature": 0})
}

#[test]
fn logs_the_kernel_configuration_then_serves_the_same_greedy_text_as_generate() {
    let s = Serve::start(&["-m", "synthetic:tiny", "--threads", "1"]);
    let log = s.log();
    let kernel = log.iter().position(|l| l.contains("kernel configuration: isa=")).expect("kernel line");
    let listening = log.iter().position(|l| l.contains("listening on http://")).unwrap();
    assert!(kernel < listening, "the kernel line must come before binding{}", s.stderr());
    let line = &log[kernel];
    assert!(line.contains("threads=1 qmv_wide=on qmv_wide_pinned=no"), "{line}");

    let prompt = "The potters sealed the door with bricks and mud";
    let r = post(s.addr, "/v1/completions", &greedy(prompt, 40));
    assert_eq!(r.status, 200, "{}{}", r.body, s.stderr());
    let server_text = r.json()["choices"][0]["text"].as_str().unwrap().to_string();
    let run =
        Dir::new().run(&["generate", "-m", "synthetic:tiny", "-p", prompt, "-n", "40", "--threads", "1"]);
    assert!(run.output.status.success(), "{}", run.describe());
    let generated = run.stdout();
    let generated = generated.strip_suffix('\n').unwrap_or(&generated);
    // `kiln generate` never writes a trailing incomplete character; the server sends it
    // as U+FFFD.
    assert_eq!(server_text.trim_end_matches('\u{fffd}'), generated.trim_end_matches('\u{fffd}'));

    // Idle, the server sleeps: over a second it uses a small fraction of a CPU.
    if let Some(before) = cpu_ticks(s.pid()) {
        std::thread::sleep(Duration::from_secs(1));
        let used = cpu_ticks(s.pid()).unwrap() - before;
        assert!(used <= 20, "{used} CPU ticks (1/100 s) in one idle second: the server is polling");
    }
}

/// The `qmv_wide` crossover: measured at the first boot and cached under
/// `$XDG_CACHE_HOME/kiln`, read back at the next, measured again over a corrupt file, set
/// by `KILN_QMV_CROSSOVER=<M>`, overridden by the `KILN_QMV_WIDE` pin; each boot's kernel
/// line reports the rows that run wide and where the choice came from.
#[test]
fn the_crossover_is_measured_once_cached_and_reported_on_the_kernel_line() {
    let cache = tempfile::tempdir().unwrap();
    let xdg = cache.path().to_str().unwrap().to_string();
    let file = cache.path().join("kiln").join("qmv-crossover");
    // A busy CI machine must not turn the first boot into `measured-busy`: this test is
    // about the cache, so it caches whatever the load (the busy rule has its own test).
    let boot = |env: &[(&str, &str)]| {
        let mut all = vec![("XDG_CACHE_HOME", xdg.as_str()), ("KILN_QMV_CROSSOVER_BUSY_LIMIT", "none")];
        all.extend_from_slice(env);
        let s = Serve::start_env(&["-m", "synthetic:tiny", "--threads", "1"], &all);
        let line = s.wait_for("kernel configuration: isa=");
        let field = |name: &str| {
            line.split(' ')
                .find_map(|w| w.strip_prefix(name))
                .unwrap_or_else(|| panic!("no {name} in {line:?}"))
                .to_string()
        };
        (field("qmv_wide_rows="), field("qmv_crossover="))
    };
    let (rows, source) = boot(&[]);
    assert_eq!(source, "measured");
    assert!(rows == "none" || rows.starts_with(|c: char| c.is_ascii_digit()), "{rows}");
    let text = std::fs::read_to_string(&file).unwrap();
    // The crossover, then the others' load during its measurement when /proc told it.
    let entry = text.trim_end().split('\t').nth(1);
    assert!(text.contains("threads=1 ") && entry == Some(rows.as_str()), "{text:?}");
    assert_eq!(boot(&[]), (rows.clone(), "cached".to_string()));
    // A line another kiln build measured is not followed: its kernels may differ.
    let (slot, _) = text.split_once(" build=").expect("the line names its build");
    std::fs::write(&file, format!("{slot} build=1-2.000000003\t{rows}\n")).unwrap();
    assert_eq!(boot(&[]).1, "measured");
    let text = std::fs::read_to_string(&file).unwrap();
    assert_eq!(text.lines().count(), 1, "the other build's line is replaced: {text:?}");
    assert!(!text.contains("build=1-2.000000003"), "{text:?}");
    std::fs::write(&file, b"\xff garbage\n").unwrap();
    assert_eq!(boot(&[]).1, "measured");
    assert!(std::fs::read_to_string(&file).unwrap().contains("threads=1 "));
    assert_eq!(boot(&[("KILN_QMV_CROSSOVER", "5")]), ("5-15".to_string(), "env".to_string()));
    assert_eq!(boot(&[("KILN_QMV_WIDE", "1")]), ("2-15".to_string(), "pinned".to_string()));
    assert_eq!(boot(&[("KILN_QMV_WIDE", "0")]), ("none".to_string(), "pinned".to_string()));
    let bad =
        Dir::new().run_env(&["serve", "-m", "synthetic:tiny"], &[("KILN_QMV_CROSSOVER", "1")]).expect_code(2);
    assert!(
        bad.stderr().contains("invalid KILN_QMV_CROSSOVER \"1\": accepted values are"),
        "{}",
        bad.describe()
    );
}

/// A crossover measured while other processes keep the CPUs busy is used for that boot
/// but never cached: with a limit of 0 CPUs every measurement counts as busy, so the
/// kernel line says `measured-busy`, a warning names the load, no cache file appears,
/// and the next boot measures again. A bad limit is refused by name (exit 2).
#[test]
fn a_crossover_measured_under_load_is_not_cached() {
    let cache = tempfile::tempdir().unwrap();
    let xdg = cache.path().to_str().unwrap().to_string();
    let env = [("XDG_CACHE_HOME", xdg.as_str()), ("KILN_QMV_CROSSOVER_BUSY_LIMIT", "0")];
    for _ in 0..2 {
        let s = Serve::start_env(&["-m", "synthetic:tiny", "--threads", "1"], &env);
        let line = s.wait_for("kernel configuration: isa=");
        assert!(line.contains(" qmv_crossover=measured-busy"), "{line}");
        let warned = s.wait_for("measured while other processes used");
        assert!(warned.contains("not cached"), "{warned}");
    }
    assert!(!cache.path().join("kiln").join("qmv-crossover").exists(), "a busy measurement was cached");
    let bad = Dir::new()
        .run_env(&["serve", "-m", "synthetic:tiny"], &[("KILN_QMV_CROSSOVER_BUSY_LIMIT", "-1")])
        .expect_code(2);
    assert!(
        bad.stderr().contains("invalid KILN_QMV_CROSSOVER_BUSY_LIMIT \"-1\": accepted values are"),
        "{}",
        bad.describe()
    );
}

/// The default id is the checkpoint's own name, never its path; the path is an unknown
/// model (OpenAI's 404), and `GET /v1/models/{id}` answers the id.
#[test]
fn a_checkpoint_is_served_under_its_directory_name_not_its_path() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../kiln-model/tests/fixtures/models/llama3-tiny");
    let path = dir.to_str().unwrap();
    let s = Serve::start(&["-m", path, "--threads", "1"]);
    let models = get(s.addr, "/v1/models").json();
    assert_eq!(models["data"][0]["id"], "llama3-tiny", "{models}{}", s.stderr());
    let one = get(s.addr, "/v1/models/llama3-tiny");
    assert_eq!(one.status, 200, "{}", one.body);
    assert_eq!(one.json()["id"], "llama3-tiny");
    let ok =
        post(s.addr, "/v1/completions", &json!({"model": "llama3-tiny", "prompt": "hi", "max_tokens": 2}));
    assert_eq!(ok.status, 200, "{}{}", ok.body, s.stderr());
    let by_path = post(s.addr, "/v1/completions", &json!({"model": path, "prompt": "hi", "max_tokens": 2}));
    assert_eq!(by_path.status, 404, "{}", by_path.body);
    assert_eq!(by_path.json()["error"]["code"], "model_not_found", "{}", by_path.body);
    assert!(!get(s.addr, "/v1/models").body.contains(path), "the path leaks to clients");
}

#[test]
fn a_moe_model_with_an_expert_cache_serves_the_all_resident_greedy_text() {
    let s = Serve::start(&["-m", "synthetic:tiny-moe", "--expert-slots", "3", "--threads", "1"]);
    let prompt = "The kiln held eight experts";
    let mut body = greedy(prompt, 24);
    body["model"] = json!("synthetic:tiny-moe");
    let r = post(s.addr, "/v1/completions", &body);
    assert_eq!(r.status, 200, "{}{}", r.body, s.stderr());
    let server_text = r.json()["choices"][0]["text"].as_str().unwrap().to_string();
    let run =
        Dir::new().run(&["generate", "-m", "synthetic:tiny-moe", "-p", prompt, "-n", "24", "--threads", "1"]);
    assert!(run.output.status.success(), "{}", run.describe());
    let generated = run.stdout();
    let generated = generated.strip_suffix('\n').unwrap_or(&generated);
    assert_eq!(server_text.trim_end_matches('\u{fffd}'), generated.trim_end_matches('\u{fffd}'));
}

#[test]
fn an_illegal_expert_cache_geometry_exits_2_before_loading() {
    let r = Dir::new().run(&["serve", "-m", "synthetic:tiny-moe", "--expert-slots", "1", "--port", "0"]);
    assert_eq!(r.output.status.code(), Some(2), "{}", r.describe());
    assert!(
        r.stderr().contains("synthetic:tiny-moe @ cache_slots=1") && r.stderr().contains("top-k = 2"),
        "{}",
        r.describe()
    );
}

/// User plus system CPU time of process `pid` in clock ticks, where /proc exists.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are the 14th and 15th.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

#[test]
fn the_qmv_wide_pin_shows_in_the_kernel_line_and_json_logs_carry_the_messages() {
    let s = Serve::start_env(&["-m", "synthetic:tiny", "--log-format", "json"], &[("KILN_QMV_WIDE", "0")]);
    let log = s.log();
    let messages: Vec<String> = log
        .iter()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
            v["fields"]["message"].as_str().unwrap_or_else(|| panic!("no fields.message: {l}")).to_string()
        })
        .collect();
    assert!(
        messages.iter().any(|m| m.contains("kernel configuration: isa=")
            && m.ends_with(
                "qmv_wide=off qmv_wide_pinned=yes qmv_wide_rows=none qmv_crossover=pinned act=int16"
            )),
        "{messages:?}"
    );
    assert!(
        messages.iter().any(|m| m.starts_with(&format!("listening on http://{}", s.addr))),
        "{messages:?}"
    );
}

#[test]
fn a_second_server_on_the_same_port_exits_2_naming_it() {
    let s = Serve::start(&["-m", "synthetic:tiny"]);
    let port = s.addr.port().to_string();
    let r = Dir::new().run(&["serve", "-m", "synthetic:tiny", "--port", &port]);
    assert_eq!(r.output.status.code(), Some(2), "{}", r.describe());
    assert!(r.stderr().contains(&format!("127.0.0.1:{port}")), "{}", r.describe());
    assert_eq!(get(s.addr, "/health").status, 200, "the first server must be unharmed");
}

#[test]
fn sigterm_during_streams_finishes_them_and_exits_0() {
    // A model slow enough, and streams long enough, that they are still running when the
    // signal comes and when the refused request is sent.
    // The grace is long so a busy machine still finishes the streams inside it (the test
    // of a grace running out is the next one).
    let mut s = Serve::start(&[
        "-m",
        "synthetic:smollm-135m",
        "--served-model-name",
        "slow",
        "--parallel",
        "3",
        "--shutdown-grace",
        "600",
    ]);
    let mut body = greedy("a long answer please", 96);
    body["model"] = json!("slow");
    body["ignore_eos"] = json!(true);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let conns: Vec<_> =
        (0..3).map(|_| send(s.addr, "POST", "/v1/completions", body.to_string().as_bytes(), &[])).collect();
    // Wait until all three hold a slot.
    let t = Instant::now();
    loop {
        let m = get(s.addr, "/metrics").body;
        if m.lines().any(|l| l == "kiln_active_slots 3") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "the streams never started{}", s.stderr());
        std::thread::sleep(Duration::from_millis(10));
    }
    s.signal(libc::SIGTERM);
    s.wait_for("shutting down");
    let mut late = greedy("too late", 2);
    late["model"] = json!("slow");
    let refused = post(s.addr, "/v1/completions", &late);
    assert_eq!(refused.status, 503, "{}", refused.body);
    for c in conns {
        let reply = client::read_reply(c);
        assert_eq!(reply.status, 200);
        assert_eq!(reply.events().last().map(String::as_str), Some("[DONE]"), "{}", reply.body);
        let events = reply.events();
        let last: Value = serde_json::from_str(&events[events.len() - 3]).unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "length", "{}{}", reply.body, s.stderr());
        let usage = stream_text(&reply).1.expect("a usage chunk");
        assert_eq!(usage["completion_tokens"], 96, "{}", reply.body);
    }
    let status = s.wait_exit(Duration::from_secs(60));
    assert_eq!(status.code(), Some(0), "{}", s.stderr());
}

#[test]
fn a_model_that_does_not_load_exits_2() {
    let r = Dir::new().run(&["serve", "-m", "synthetic:nonesuch", "--port", "0"]);
    assert_eq!(r.output.status.code(), Some(2), "{}", r.describe());
    assert!(r.stderr().contains("unknown synthetic model"), "{}", r.describe());
    let r = Dir::new().run(&["serve", "-m", "synthetic:tiny", "--port", "0", "--parallel", "0"]);
    assert_eq!(r.output.status.code(), Some(2), "{}", r.describe());
    assert!(r.stderr().contains("--parallel"), "{}", r.describe());
}

#[test]
fn streams_still_running_when_the_grace_ends_get_an_error_event_and_the_server_exits_0() {
    let mut s = Serve::start(&[
        "-m",
        "synthetic:smollm-135m",
        "--served-model-name",
        "slow",
        "--shutdown-grace",
        "0.3",
    ]);
    let mut body = greedy("a very long answer please", 1500);
    body["model"] = json!("slow");
    body["ignore_eos"] = json!(true);
    body["stream"] = json!(true);
    let conn = send(s.addr, "POST", "/v1/completions", body.to_string().as_bytes(), &[]);
    let t = Instant::now();
    while !get(s.addr, "/metrics").body.lines().any(|l| l == "kiln_active_slots 1") {
        assert!(t.elapsed() < Duration::from_secs(60), "the stream never started{}", s.stderr());
        std::thread::sleep(Duration::from_millis(10));
    }
    s.signal(libc::SIGINT);
    s.wait_for("shutdown grace over");
    let reply = client::read_reply(conn);
    let events = reply.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{}", reply.body);
    let error: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(error["error"]["code"], "shutting_down", "{}", reply.body);
    assert_eq!(s.wait_exit(Duration::from_secs(30)).code(), Some(0), "{}", s.stderr());
}

#[test]
fn a_moe_checkpoint_with_an_expert_cache_serves_the_greedy_text_of_generate() {
    // kiln-model's Qwen3-MoE fixture, stacked 4-bit experts; tests/moe_checkpoints.rs ties
    // `kiln generate` on it to mlx-lm's greedy tokens.
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../kiln-model/tests/fixtures/moe/qwen3-moe-tiny-4bit");
    let s = Serve::start(&["-m", model, "--expert-slots", "2", "--threads", "1"]);
    let prompt = "The kiln held eight experts";
    // Served under the directory's name, not its path.
    let body = json!({"model": "qwen3-moe-tiny-4bit", "prompt": prompt, "max_tokens": 24, "temperature": 0});
    let r = post(s.addr, "/v1/completions", &body);
    assert_eq!(r.status, 200, "{}{}", r.body, s.stderr());
    let server_text = r.json()["choices"][0]["text"].as_str().unwrap().to_string();
    let run = Dir::new().run(&["generate", "-m", model, "-p", prompt, "-n", "24", "--no-chat-template"]);
    assert!(run.output.status.success(), "{}", run.describe());
    let generated = run.stdout();
    let generated = generated.strip_suffix('\n').unwrap_or(&generated);
    assert_eq!(
        server_text.trim_end_matches('\u{fffd}'),
        generated.trim_end_matches('\u{fffd}'),
        "{}",
        s.stderr()
    );
}

/// `echo` with `logprobs` and `max_tokens: 0` (lm-evaluation-harness's loglikelihood)
/// answers the values `kiln score` writes for the same text, to the last digit: the same
/// function computes both. Run on a quantized model so the quantized kernels are in it.
#[test]
fn echoed_prompt_logprobs_equal_kiln_score_s_for_the_same_text() {
    let model = "synthetic:tiny-qwen@4bit-g32";
    let text = "The potters sealed the door with bricks and mud, then lit the fire at dawn.";
    let dir = Dir::new();
    let file = dir.path().join("text.txt");
    std::fs::write(&file, text).unwrap();
    let s = Serve::start(&["-m", model, "--threads", "1"]);
    let body = json!({"model": model, "prompt": text, "max_tokens": 0, "echo": true, "logprobs": 5});
    let r = post(s.addr, "/v1/completions", &body);
    assert_eq!(r.status, 200, "{}{}", r.body, s.stderr());
    let v = r.json();
    let window = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    let out = dir.path().join("lp.bin");
    let w = window.to_string();
    let run = dir
        .run(&[
            "score",
            "-m",
            model,
            "--threads",
            "1",
            "--text-file",
            file.to_str().unwrap(),
            "--window",
            &w,
            "--first-scored",
            "0",
            "--max-windows",
            "1",
            "--output",
            out.to_str().unwrap(),
        ])
        .expect_code(0);
    let bytes = std::fs::read(&out).unwrap();
    let len = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[12..12 + len]).unwrap();
    let vocab = header["vocab"].as_u64().unwrap() as usize;
    let records: Vec<(u32, Vec<f32>)> = bytes[12 + len..]
        .chunks_exact(4 + 4 * vocab)
        .map(|r| {
            let target = u32::from_le_bytes(r[..4].try_into().unwrap());
            (target, r[4..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect())
        })
        .collect();
    assert_eq!(records.len(), window - 1, "{}", run.describe());
    let l = &v["choices"][0]["logprobs"];
    let lps = l["token_logprobs"].as_array().unwrap();
    assert_eq!(lps.len(), window, "{v}");
    assert!(lps[0].is_null(), "{v}");
    let start = r.body.find("\"token_logprobs\":[").expect("token_logprobs") + "\"token_logprobs\":[".len();
    let printed: Vec<&str> = r.body[start..start + r.body[start..].find(']').unwrap()].split(',').collect();
    assert_eq!(printed.len(), window, "{}", r.body);
    for (p, (target, lp)) in records.iter().enumerate() {
        let served = lps[p + 1].as_f64().unwrap();
        // Equal as single-precision values: every digit the server prints, score wrote.
        assert_eq!(
            served as f32,
            lp[*target as usize],
            "position {}: {served} vs {}",
            p + 1,
            lp[*target as usize]
        );
        // And printed with every digit of the single-precision value: the printed
        // number, read by a correctly rounding parser (serde_json's default one may be
        // an ulp off), is the value score wrote.
        assert_eq!(printed[p + 1].parse::<f64>(), Ok(f64::from(lp[*target as usize])), "position {}", p + 1);
        let mut best: Vec<f32> = lp.clone();
        best.sort_by(|a, b| b.total_cmp(a));
        let top = l["top_logprobs"][p + 1].as_object().unwrap();
        let mut got: Vec<f32> = top.values().map(|x| x.as_f64().unwrap() as f32).collect();
        got.sort_by(|a, b| b.total_cmp(a));
        // Alternatives whose texts coincide keep one entry.
        assert!(!got.is_empty() && got.len() <= 5, "{top:?}");
        assert_eq!(got[0], best[0], "position {}: {top:?}", p + 1);
        assert!(got.iter().all(|g| best[..5].contains(g)), "position {}: {top:?} vs {:?}", p + 1, &best[..5]);
    }
}
