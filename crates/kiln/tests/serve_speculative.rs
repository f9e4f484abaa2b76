//! Speculative decoding in the real `kiln serve`: a request with `"speculative": true`
//! (or every request under `--speculative`) returns the same greedy text as a classic
//! one, reports its acceptance counts in `usage.speculative` and in /metrics, and the
//! exactness gate's fixed line reaches the server's log. Bad speculative flags exit 2.

#[path = "../../kiln-serve/tests/client/mod.rs"]
mod client;
// Shared with the other binary tests; not every helper is used here.
#[allow(dead_code)]
mod common;
#[allow(dead_code)]
mod util;

use std::time::{Duration, Instant};

use client::{get, post, stream_text};
use common::Serve;
use serde_json::{Value, json};
use util::Dir;

/// Extra environment variables of one server.
type Env<'a> = &'a [(&'a str, &'a str)];

/// A prompt the model must repeat: prompt lookup finds its continuations.
const PROMPT: &str = "kiln kiln fire clay kiln kiln fire clay kiln kiln fire clay kiln kiln fire clay";

/// `kiln serve -m synthetic:tiny --threads 1 ARGS` with extra environment variables.
fn start(args: &[&str], env: Env) -> Serve {
    let mut all = vec!["-m", "synthetic:tiny", "--threads", "1"];
    all.extend_from_slice(args);
    Serve::start_env(&all, env)
}

/// A greedy completion of [`PROMPT`]; returns its text and usage.
fn complete(s: &Serve, speculative: Option<bool>, stream: bool) -> (String, Value) {
    let mut body = json!({"model": "synthetic:tiny", "prompt": PROMPT, "max_tokens": 40,
        "temperature": 0, "ignore_eos": true});
    if let Some(on) = speculative {
        body["speculative"] = json!(on);
    }
    if stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    let r = post(s.addr, "/v1/completions", &body);
    assert_eq!(r.status, 200, "{}{}", r.body, s.stderr());
    if stream {
        let (text, usage) = stream_text(&r);
        (text, usage.unwrap_or_else(|| panic!("no usage chunk: {}{}", r.body, s.stderr())))
    } else {
        let j = r.json();
        (j["choices"][0]["text"].as_str().unwrap().to_string(), j["usage"].clone())
    }
}

/// The value of counter or gauge `name` in /metrics.
fn metric(s: &Serve, name: &str) -> u64 {
    let m = get(s.addr, "/metrics");
    m.body
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics:\n{}", m.body))
}

fn counts(usage: &Value) -> Option<(u64, u64)> {
    let s = usage.get("speculative")?;
    Some((s["drafted"].as_u64().unwrap(), s["accepted"].as_u64().unwrap()))
}

#[test]
fn speculative_requests_return_the_classic_text_and_report_acceptance() {
    let s = start(&["--parallel", "4", "--spec-slots", "1"], &[]);
    let (classic, usage) = complete(&s, None, false);
    assert!(counts(&usage).is_none(), "a classic request has no speculative usage: {usage}");
    assert_eq!(usage["completion_tokens"], 40);
    for stream in [false, true] {
        let (text, usage) = complete(&s, Some(true), stream);
        assert_eq!(text, classic, "stream={stream}{}", s.stderr());
        let (drafted, accepted) = counts(&usage).unwrap_or_else(|| panic!("no usage.speculative: {usage}"));
        assert!(drafted > 0 && accepted > 0 && accepted <= drafted, "{usage}");
        assert_eq!(usage["completion_tokens"], 40, "{usage}");
    }
    let line = s.wait_for("speculative gate outcome=");
    assert!(
        line.contains("INFO") && line.contains("outcome=exact model=synthetic:tiny k=4 kv_dtype=f16"),
        "{line}"
    );

    // Four at once with one speculative slot: the slot's holder verifies on its own,
    // the others decode in the joint forward; every text is the classic one.
    let texts: Vec<(String, Value)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4).map(|_| scope.spawn(|| complete(&s, Some(true), false))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(texts.iter().all(|(t, _)| *t == classic), "{texts:?}{}", s.stderr());
    assert!(texts.iter().any(|(_, u)| counts(u).is_some_and(|(d, _)| d > 0)), "{texts:?}");

    assert!(metric(&s, "kiln_spec_drafted_tokens_total") > 0);
    assert!(metric(&s, "kiln_spec_accepted_tokens_total") > 0);
    assert!(metric(&s, "kiln_spec_verifies_total") > 0);
    // The gauges are published just after the last token is sent: wait (bounded).
    let t = Instant::now();
    while metric(&s, "kiln_spec_active_slots") + metric(&s, "kiln_active_slots") > 0 {
        assert!(t.elapsed() < Duration::from_secs(10), "slots still held{}", s.stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
    let lines = s.log().iter().filter(|l| l.contains("speculative gate outcome=")).count();
    assert_eq!(lines, 1, "one gate decision per key{}", s.stderr());
}

/// `--speculative` speculates for every request; the gate's recipes act in the server
/// as in `kiln generate` (the pin alone declines; the default drops qmv_wide).
#[test]
fn the_gate_recipes_reach_the_server_log() {
    let classic = complete(&start(&[], &[]), Some(false), false).0;
    let cases: [(Env, &str, bool); 2] = [
        (&[("KILN_SPEC_TEST_INEXACT", "wide")], "WARN", true),
        (&[("KILN_SPEC_TEST_INEXACT", "wide"), ("KILN_QMV_WIDE", "1")], "WARN", false),
    ];
    for (env, level, speculates) in cases {
        let s = start(&["--speculative"], env);
        let (text, usage) = complete(&s, None, false);
        assert_eq!(text, classic, "{env:?}{}", s.stderr());
        let line = s.wait_for("speculative gate outcome=");
        let want = if speculates {
            "outcome=exact-without-qmv-wide model=synthetic:tiny k=4 kv_dtype=f16 qmv_wide=off:"
        } else {
            "outcome=declined-pinned model=synthetic:tiny k=4 kv_dtype=f16 qmv_wide=on:"
        };
        assert!(line.contains(level) && line.contains(want), "{line}{}", s.stderr());
        // Dropping the wide kernel changes what the start-up kernel line said: logged.
        let changed = "kernel configuration changed: qmv_wide=off qmv_wide_pinned=no:";
        if speculates {
            let line = s.wait_for("kernel configuration changed:");
            assert!(line.contains("WARN") && line.contains(changed), "{line}{}", s.stderr());
        } else {
            assert!(!s.stderr().contains("kernel configuration changed:"), "{}", s.stderr());
        }
        let (drafted, _) = counts(&usage).unwrap_or_else(|| panic!("no usage.speculative: {usage}"));
        assert_eq!(drafted > 0, speculates, "{usage}");
    }
}

#[test]
fn bad_speculative_flags_exit_2() {
    let cases: [(&[&str], Env, &str); 3] = [
        (&["--draft-tokens", "0"], &[], "invalid --draft-tokens 0"),
        (&[], &[("KILN_SPEC_ALLOW_INEXACT", "maybe")], "KILN_SPEC_ALLOW_INEXACT"),
        (&["--model-draft", "synthetic:tiny-qwen-draft"], &[], "share the target's vocabulary"),
    ];
    for (args, env, want) in cases {
        let mut all = vec!["serve", "-m", "synthetic:tiny", "--port", "0"];
        all.extend_from_slice(args);
        let r = Dir::new().run_env(&all, env);
        assert_eq!(r.output.status.code(), Some(2), "{}", r.describe());
        assert!(r.stderr().contains(want), "expected {want:?}{}", r.describe());
    }
}
