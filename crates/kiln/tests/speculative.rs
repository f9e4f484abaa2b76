//! `--speculative` through the real binary: generate's greedy text is identical with and
//! without it (prompt lookup and a draft model), the exactness gate's recipes each log
//! their fixed line and speculate or not as documented, bench-decode reports acceptance,
//! and bad speculative input exits 2 naming it.

mod util;

use util::{Dir, Run};

/// Extra environment variables of one run.
type Env<'a> = &'a [(&'a str, &'a str)];

/// A prompt the model must repeat: prompt lookup finds its continuations.
const PROMPT: &str = "kiln kiln fire clay kiln kiln fire clay kiln kiln fire clay kiln kiln fire clay";

fn generate(dir: &Dir, model: &str, extra: &[&str], env: &[(&str, &str)]) -> Run {
    let mut args = vec!["generate", "-m", model, "-p", PROMPT, "-n", "48"];
    args.extend_from_slice(extra);
    dir.run_env(&args, env).expect_code(0)
}

/// The `speculative: ... drafted=D accepted=A ...` summary's counts.
fn counts(run: &Run) -> (u64, u64) {
    let err = run.stderr();
    let line = err
        .lines()
        .find(|l| l.starts_with("speculative: "))
        .unwrap_or_else(|| panic!("no speculative summary{}", run.describe()));
    let field = |name: &str| -> u64 {
        line.split(' ')
            .find_map(|w| w.strip_prefix(name))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {line:?}{}", run.describe()))
    };
    (field("drafted="), field("accepted="))
}

#[test]
fn greedy_text_is_identical_with_and_without_speculation() {
    let dir = Dir::new();
    for model in ["synthetic:tiny", "synthetic:tiny-qwen@8bit"] {
        let classic = generate(&dir, model, &[], &[]);
        assert!(!classic.stderr().contains("speculative"), "{}", classic.describe());
        for extra in [&["--speculative"][..], &["--speculative", "--draft-tokens", "2", "--kv-dtype", "f32"]]
        {
            let spec = generate(&dir, model, extra, &[]);
            assert_eq!(spec.stdout(), classic.stdout(), "{}{}", classic.describe(), spec.describe());
            assert!(spec.stderr().contains("INFO speculative gate outcome=exact "), "{}", spec.describe());
            let (drafted, accepted) = counts(&spec);
            assert!(drafted > 0 && accepted > 0, "{}", spec.describe());
        }
    }
    // A draft model: the target itself (every draft accepted) and the small drafter.
    let classic = generate(&dir, "synthetic:tiny", &[], &[]);
    for draft in ["synthetic:tiny", "synthetic:tiny-draft"] {
        let spec = generate(&dir, "synthetic:tiny", &["--speculative", "--model-draft", draft], &[]);
        assert_eq!(spec.stdout(), classic.stdout(), "{}", spec.describe());
        assert!(spec.stderr().contains("drafter=draft-model"), "{}", spec.describe());
        let (drafted, accepted) = counts(&spec);
        if draft == "synthetic:tiny" {
            assert!(drafted > 0 && accepted == drafted, "{}", spec.describe());
        }
    }
}

/// With a temperature the rejection rule runs; a seed still reproduces the text.
#[test]
fn sampled_speculation_reproduces_from_its_seed() {
    let dir = Dir::new();
    for draft in [&[][..], &["--model-draft", "synthetic:tiny-draft"]] {
        let mut extra = vec!["--speculative", "--temperature", "0.8", "--top-p", "0.9", "--seed", "7"];
        extra.extend_from_slice(draft);
        let a = generate(&dir, "synthetic:tiny", &extra, &[]);
        let b = generate(&dir, "synthetic:tiny", &extra, &[]);
        assert_eq!(a.stdout(), b.stdout(), "{}{}", a.describe(), b.describe());
        assert!(a.stderr().contains("speculative: drafter="), "{}", a.describe());
    }
}

/// The seed's gate table, with `KILN_SPEC_TEST_INEXACT=wide` making the probe inexact
/// while `qmv_wide` is on (as a wide kernel that rounds differently would), plus `always`
/// for the two outcomes that need the narrow retry to fail too.
#[test]
fn every_gate_recipe_logs_its_line_and_acts_on_it() {
    let dir = Dir::new();
    let classic = generate(&dir, "synthetic:tiny", &[], &[]);
    let wide = ("KILN_SPEC_TEST_INEXACT", "wide");
    let always = ("KILN_SPEC_TEST_INEXACT", "always");
    let pin = ("KILN_QMV_WIDE", "1");
    let allow = ("KILN_SPEC_ALLOW_INEXACT", "1");
    // (environment, the line, whether it speculates)
    let table: [(Env, &str, bool); 6] = [
        // 1. default environment: the gate drops qmv_wide and the retry is exact.
        (
            &[wide],
            "WARN speculative gate outcome=exact-without-qmv-wide model=synthetic:tiny k=4 kv_dtype=f16 qmv_wide=off:",
            true,
        ),
        // 2. the override alone is inert: the retry runs first and is exact.
        (
            &[wide, allow],
            "WARN speculative gate outcome=exact-without-qmv-wide model=synthetic:tiny k=4 kv_dtype=f16 qmv_wide=off:",
            true,
        ),
        // 3. the operator's pin alone: no retry, declined.
        (
            &[wide, pin],
            "WARN speculative gate outcome=declined-pinned model=synthetic:tiny k=4 kv_dtype=f16 qmv_wide=on:",
            false,
        ),
        // 4. the fast-kernel recipe: pinned wide and allowed inexact.
        (
            &[wide, pin, allow],
            "WARN speculative gate outcome=inexact-allowed model=synthetic:tiny k=4 kv_dtype=f16 qmv_wide=on:",
            true,
        ),
        // Inexact either way: the switch is restored, then declined or allowed.
        (
            &[always],
            "WARN speculative gate outcome=inexact-declined model=synthetic:tiny k=4 kv_dtype=f16 qmv_wide=on:",
            false,
        ),
        (
            &[always, allow],
            "WARN speculative gate outcome=inexact-allowed model=synthetic:tiny k=4 kv_dtype=f16 qmv_wide=on:",
            true,
        ),
    ];
    for (env, line, speculates) in table {
        let run = generate(&dir, "synthetic:tiny", &["--speculative"], env);
        let err = run.stderr();
        assert_eq!(
            err.matches("speculative gate outcome=").count(),
            1,
            "one decision per key{}",
            run.describe()
        );
        assert!(err.lines().any(|l| l.starts_with(line)), "expected {line:?}{}", run.describe());
        let (drafted, _) = counts(&run);
        assert_eq!(drafted > 0, speculates, "{}", run.describe());
        // kiln's kernels are exact either way, so even the allowed runs match.
        assert_eq!(run.stdout(), classic.stdout(), "{}", run.describe());
    }
}

/// `KILN_ACT_PRECISION=int16-wide8` gives the wide kernel's rows 8-bit codes, so a verify
/// block really differs from the single-token chain: with no test hook the gate's probe
/// finds it inexact, drops `qmv_wide` and speculates on the per-row path, whose text is the
/// classic run's (every row then takes 16-bit codes, as a lone row does).
#[test]
fn the_wide8_scheme_is_probed_inexact_and_drops_the_wide_path() {
    let dir = Dir::new();
    let scheme = ("KILN_ACT_PRECISION", "int16-wide8");
    // The verify block (K + 1 = 5 rows) runs wide whatever a cached crossover says.
    let wide = ("KILN_QMV_CROSSOVER", "2");
    let classic = generate(&dir, "synthetic:tiny", &[], &[scheme, wide]);
    let run = generate(&dir, "synthetic:tiny", &["--speculative"], &[scheme, wide]);
    let line = "WARN speculative gate outcome=exact-without-qmv-wide model=synthetic:tiny k=4 kv_dtype=f16 qmv_wide=off:";
    assert!(run.stderr().lines().any(|l| l.starts_with(line)), "expected {line:?}{}", run.describe());
    let (drafted, _) = counts(&run);
    assert!(drafted > 0, "{}", run.describe());
    assert_eq!(run.stdout(), classic.stdout(), "{}{}", classic.describe(), run.describe());
    // The default scheme's classic text is the same: a lone row rounds as int16 does.
    assert_eq!(classic.stdout(), generate(&dir, "synthetic:tiny", &[], &[]).stdout());
}

#[test]
fn bench_decode_reports_acceptance_only_when_speculating() {
    let dir = Dir::new();
    let base = ["bench-decode", "-m", "synthetic:tiny", "-p", PROMPT, "-n", "40", "--warmup-tokens", "4"];
    let classic = dir.run(&base).expect_code(0);
    assert!(!classic.json().keys().any(|k| k.starts_with("spec_")), "{}", classic.describe());
    let mut args = base.to_vec();
    args.extend(["--speculative", "--draft-tokens", "3"]);
    let run = dir.run(&args).expect_code(0);
    let j = run.json();
    assert_eq!(j["spec_drafter"], "prompt-lookup", "{}", run.describe());
    assert_eq!(j["spec_draft_tokens"], 3);
    assert_eq!(j["spec_gate"], "exact");
    let drafted = j["spec_drafted"].as_u64().unwrap();
    let accepted = j["spec_accepted"].as_u64().unwrap();
    assert!(drafted > 0 && accepted <= drafted, "{}", run.describe());
    let rate = j["spec_acceptance"].as_f64().unwrap();
    assert!((rate - accepted as f64 / drafted as f64).abs() < 1e-12);
    assert!(j["decode_tok_s"].as_f64().unwrap() > 0.0);
    let steps = j["decode_steps"].as_u64().unwrap();
    assert!((1..=35).contains(&steps), "{}", run.describe());
    args.extend(["--format", "csv"]);
    let csv = dir.run(&args).expect_code(0);
    let out = csv.stdout();
    let header = out.lines().next().unwrap_or_default();
    assert!(header.ends_with("spec_drafter,spec_draft_tokens,spec_gate,spec_drafted,spec_accepted,spec_acceptance,spec_verifies"), "{}", csv.describe());
}

#[test]
fn bad_speculative_input_exits_2_naming_it() {
    let dir = Dir::new();
    let cases: [(&[&str], Env, &str); 5] = [
        (&["--draft-tokens", "3"], &[], "need --speculative"),
        (
            &["--speculative", "--draft-tokens", "0"],
            &[],
            "invalid --draft-tokens 0: accepted values are 1 to 32",
        ),
        (&["--speculative", "--model-draft", "synthetic:tiny-qwen-draft"], &[], "invalid --model-draft"),
        (&["--speculative"], &[("KILN_SPEC_ALLOW_INEXACT", "yes")], "KILN_SPEC_ALLOW_INEXACT"),
        (
            &["--speculative"],
            &[("KILN_SPEC_TEST_INEXACT", "sometimes")],
            "accepted values are always or wide",
        ),
    ];
    for (extra, env, want) in cases {
        let mut args = vec!["generate", "-m", "synthetic:tiny", "-p", "hi", "-n", "4"];
        args.extend_from_slice(extra);
        let run = dir.run_env(&args, env).expect_code(2);
        assert!(run.stderr().contains(want), "expected {want:?}{}", run.describe());
    }
}
