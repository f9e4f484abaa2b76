//! Every type of the contract read back from what it writes: a knob's `Display` through
//! `FromStr`, [`Knobs::to_args`] through [`Knobs::from_args`], each of `kiln serve`'s
//! lines through its `parse`, as a plain log line and inside a JSON one.

use std::net::SocketAddr;

use kiln_protocol::{
    Attention, Backend, GateOutcome, KNOB_COLUMNS, KNOBS, KernelChangedLine, KernelConfigLine, Knobs,
    KvDtype, ListeningLine, SpecGateLine, UsageError, WarmupError, check_context, context_room,
    timed_decode_steps,
};

/// `message` as `kiln serve --log-format text` and `--log-format json` log it.
fn logged(message: &str) -> [String; 2] {
    [
        format!("2026-12-01T00:00:00.000000Z  INFO kiln_serve::scheduler: {message}"),
        format!(
            r#"{{"timestamp":"2026-12-01T00:00:00Z","level":"INFO","fields":{{"message":{}}}}}"#,
            serde_json::to_string(message).unwrap()
        ),
    ]
}

#[test]
fn enum_knobs_read_back_what_they_write() {
    for &a in Attention::ALL {
        assert_eq!(a.to_string().parse::<Attention>(), Ok(a));
        assert_eq!(serde_json::to_string(&a).unwrap(), format!("\"{a}\""));
    }
    for &k in KvDtype::ALL {
        assert_eq!(k.to_string().parse::<KvDtype>(), Ok(k));
        assert_eq!(serde_json::to_string(&k).unwrap(), format!("\"{k}\""));
    }
    for &b in Backend::ALL {
        assert_eq!(b.to_string().parse::<Backend>(), Ok(b));
    }
    assert_eq!(Attention::ALL.len(), 2);
    assert_eq!(KvDtype::ALL.len(), 2);
    assert_eq!(Backend::ALL.len(), 4);
    let e = "sparse".parse::<Attention>().unwrap_err();
    assert_eq!(e.to_string(), "invalid --attention \"sparse\": accepted values are streaming, naive");
    assert!("bf16".parse::<KvDtype>().unwrap_err().to_string().contains("f16, f32"));
}

#[test]
fn knobs_read_back_their_command_line() {
    let every = Knobs {
        memory_limit: Some("512MiB".into()),
        prefill_chunk: Some(0),
        attention: Some(Attention::Naive),
        kv_dtype: Some(KvDtype::F32),
        threads: Some(3),
    };
    let some = Knobs { kv_dtype: Some(KvDtype::F16), threads: Some(1), ..Knobs::default() };
    for knobs in [Knobs::default(), some, every.clone()] {
        assert_eq!(Knobs::from_args(&knobs.to_args()), Ok(knobs.clone()), "{:?}", knobs.to_args());
        let json = serde_json::to_string(&knobs).unwrap();
        assert_eq!(serde_json::from_str::<Knobs>(&json).unwrap(), knobs);
    }
    assert_eq!(
        every.to_args(),
        [
            "--attention",
            "naive",
            "--prefill-chunk",
            "0",
            "--kv-dtype",
            "f32",
            "--memory-limit",
            "512MiB",
            "--threads",
            "3"
        ]
    );
    // Every knob of the list is on the command line once, in the list's order.
    let flags: Vec<_> = every.to_args().into_iter().step_by(2).collect();
    assert_eq!(flags, KNOBS.map(|k| k.flag.to_string()));
    assert_eq!(KNOB_COLUMNS, ["attention", "prefill_chunk", "kv_dtype", "memory_limit_bytes", "threads"]);
    assert_eq!(Knobs::from_args(&["--threads=2"]), Ok(Knobs { threads: Some(2), ..Knobs::default() }));
}

#[test]
fn knobs_refuse_what_the_engine_would_refuse_naming_it() {
    let e = Knobs::from_args(&["--memory-limit", "12XB"]).unwrap_err();
    assert!(e.to_string().starts_with("invalid --memory-limit \"12XB\""), "{e}");
    assert!(
        Knobs::from_args(&["--quantize", "4"])
            .unwrap_err()
            .to_string()
            .contains("--attention, --prefill-chunk")
    );
    assert!(Knobs::from_args(&["--threads"]).unwrap_err().to_string().contains("a value after the flag"));
    assert!(
        Knobs::from_args(&["--threads", "-1"]).unwrap_err().to_string().contains("invalid --threads \"-1\"")
    );
}

#[test]
fn the_kernel_line_reads_back() {
    let crossover = || (Some("3,5-15".to_string()), Some("measured".to_string()));
    for (wide, pinned, (rows, source), act) in [
        (true, false, crossover(), Some(kiln_protocol::ActScheme::Int16Wide8)),
        (false, true, (None, None), None),
    ] {
        let k = KernelConfigLine {
            isa: "avx2".into(),
            threads: 4,
            qmv_wide: wide,
            qmv_wide_pinned: pinned,
            qmv_wide_rows: rows,
            qmv_crossover: source,
            act,
        };
        let text = k.to_string();
        assert!(text.starts_with("kernel configuration: isa=avx2 threads=4 qmv_wide="), "{text}");
        for line in logged(&text) {
            assert_eq!(KernelConfigLine::parse(&line), Some(k.clone()), "{line}");
            assert_eq!(KernelChangedLine::parse(&line), None, "{line}");
        }
    }
    assert_eq!(
        KernelConfigLine::parse("kernel configuration: isa=avx2 threads=x qmv_wide=on qmv_wide_pinned=no"),
        None
    );
    assert_eq!(
        KernelConfigLine::parse("kernel configuration: isa=avx2 threads=2 qmv_wide=yes qmv_wide_pinned=no"),
        None
    );
}

#[test]
fn the_switch_change_reads_back() {
    for (wide, pinned) in [(false, false), (true, true)] {
        let c = KernelChangedLine { qmv_wide: wide, qmv_wide_pinned: pinned };
        let text = c.to_string();
        assert!(text.ends_with(": the speculative gate switched qmv_wide for the whole process"), "{text}");
        for line in logged(&text) {
            assert_eq!(KernelChangedLine::parse(&line), Some(c), "{line}");
            assert_eq!(KernelConfigLine::parse(&line), None, "{line}");
            // Its prose says "speculative gate" too: it is not a gate line.
            assert_eq!(SpecGateLine::parse(&line), None, "{line}");
        }
    }
}

#[test]
fn every_gate_outcome_reads_back() {
    use GateOutcome::*;
    for outcome in [Exact, ExactWithoutWide, InexactAllowed, InexactDeclined, DeclinedPinned] {
        assert_eq!(outcome.to_string().parse::<GateOutcome>(), Ok(outcome));
        let g = SpecGateLine {
            outcome,
            model: "synthetic:tiny".into(),
            k: 4,
            kv_dtype: KvDtype::F32,
            qmv_wide: outcome != ExactWithoutWide,
            reason: outcome.explanation().into(),
        };
        for line in logged(&g.to_string()) {
            assert_eq!(SpecGateLine::parse(&line), Some(g.clone()), "{line}");
        }
    }
    assert!("exactish".parse::<GateOutcome>().is_err());
}

#[test]
fn the_listening_line_reads_back() {
    for addr in ["127.0.0.1:8080", "[::1]:41234", "0.0.0.0:1"] {
        let l = ListeningLine { addr: addr.parse::<SocketAddr>().unwrap() };
        assert_eq!(l.to_string(), format!("listening on http://{addr}"));
        for line in logged(&l.to_string()) {
            assert_eq!(ListeningLine::parse(&line), Some(l), "{line}");
        }
    }
    assert_eq!(ListeningLine::parse("listening on http://nowhere"), None);
}

#[test]
fn the_warm_up_rule_leaves_a_timed_step() {
    assert_eq!(timed_decode_steps(0, 0), Err(WarmupError::NoTokens));
    assert_eq!(timed_decode_steps(1, 0), Ok(0), "no warm-up times every step, even none");
    assert_eq!(timed_decode_steps(32, 4), Ok(27));
    assert_eq!(timed_decode_steps(6, 4), Ok(1));
    assert_eq!(timed_decode_steps(5, 4), Err(WarmupError::NoTimedStep { max_tokens: 5, warmup_tokens: 4 }));
    assert!(timed_decode_steps(u64::MAX, u64::MAX).is_err());
    assert_eq!(timed_decode_steps(u64::MAX, 1), Ok(u64::MAX - 2));
    assert_eq!(
        timed_decode_steps(4, 4).unwrap_err().to_string(),
        "--warmup-tokens 4 leaves no timed decode step with --max-tokens 4: expected a warm-up below 3"
    );
}

#[test]
fn the_context_rule_counts_every_position() {
    assert_eq!(check_context(100, 28, 128), Ok(()));
    let e = check_context(100, 29, 128).unwrap_err();
    assert_eq!((e.requested, e.limit), (129, 128));
    assert_eq!(check_context(usize::MAX, 1, 128).unwrap_err().requested, usize::MAX);
    assert_eq!(context_room(100, 128), 28);
    assert_eq!(context_room(200, 128), 0);
    // The room is exactly what the rule admits.
    for used in [0, 1, 127, 128] {
        let room = context_room(used, 128);
        assert!(check_context(used, room, 128).is_ok());
        assert!(check_context(used, room + 1, 128).is_err());
    }
}

#[test]
fn a_usage_error_says_its_message_only() {
    assert_eq!(
        UsageError("invalid --threads 0: accepted values are 1 to 8".into()).to_string(),
        "invalid --threads 0: accepted values are 1 to 8"
    );
}
