//! `cargo xtask bench-offload-copy` end to end, the seed's before/after: the real xtask
//! against the real `kiln` on synthetic:tiny-moe (2 layers x 8 experts, top-2, slots of
//! 13824 bytes), with a memory limit as the test's slot cap: 451000 bytes hold the
//! weights (354560) and 6 slots, so the derived defaults [8, 6] split into one refused
//! geometry and one measured one.

// Shared with the sweep tests; not every helper is used here.
#[allow(dead_code)]
mod util;

use util::{Run, Sandbox};

const MOE: &str = "synthetic:tiny-moe";
/// The test cap: the CPU backend's slot limit becomes 6.
const CAP: [&str; 2] = ["--memory-limit", "451000"];
/// Cells as short as a measurement can be: the scenarios are about which cells run.
const FAST: [&str; 6] = ["--steps", "1", "--min-time-ms", "0", "--bandwidth-bytes", "4MiB"];

fn run(sb: &Sandbox, extra: &[&str]) -> Run {
    let mut a: Vec<&str> = vec!["--models", MOE];
    a.extend_from_slice(&FAST);
    a.extend_from_slice(extra);
    sb.run("bench-offload-copy", &a)
}

/// Table headers (geometry line then column titles) and the row lines under each.
fn tables(stdout: &str) -> Vec<(String, usize)> {
    let lines: Vec<&str> = stdout.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].contains(" @ cache_slots=") && !lines[i].contains("SKIP") {
            assert!(
                lines.get(i + 1).is_some_and(|l| l.trim_start().starts_with("batch")),
                "no column titles under {:?}",
                lines[i]
            );
            let rows =
                lines[i + 2..].iter().take_while(|l| l.starts_with("  ") && !l.trim().is_empty()).count();
            out.push((lines[i].to_string(), rows));
            i += 2 + rows;
        } else {
            i += 1;
        }
    }
    out
}

#[test]
fn a_default_run_skips_the_refused_derived_geometry_measures_the_rest_and_exits_0() {
    let sb = Sandbox::new();
    let r = run(&sb, &CAP);
    r.expect_code(0)
        .expect_stdout(
            "synthetic:tiny-moe @ cache_slots=8 (108.0 KiB): SKIPPED -- 8 exceeds the cpu backend's slot limit of 6 (memory limit",
        )
        .expect_stdout("skipped 1 of 2 combinations: synthetic:tiny-moe@8");
    assert_eq!(r.stdout.matches("SKIPPED").count(), 1, "{r}");
    assert!(r.stdout.trim_end().ends_with("skipped 1 of 2 combinations: synthetic:tiny-moe@8"), "{r}");
    // One table, no orphan header: 4 batch sizes x 4 miss rates under it.
    let t = tables(&r.stdout);
    assert_eq!(t.len(), 1, "{t:?}{r}");
    assert!(t[0].0.starts_with("synthetic:tiny-moe @ cache_slots=6 ("), "{t:?}");
    assert_eq!(t[0].1, 16, "{r}");
    assert_eq!(r.stdout.matches("  batch ").count(), t.len(), "every column header has its rows{r}");
    let rows = sb.rows(&sb.csv());
    let ok: Vec<_> = rows.iter().filter(|x| x.get("status") == "ok").collect();
    assert_eq!(ok.len(), 16, "{r}");
    assert!(ok.iter().all(|x| x.get("cache_slots") == "6"), "never clamped");
    let refused: Vec<_> = rows.iter().filter(|x| x.get("status") == "SKIP:unsupported").collect();
    assert_eq!(refused.len(), 16);
    assert!(refused.iter().all(|x| x.get("cache_slots") == "8" && x.get("copy_gb_s").is_empty()));
    // The rows carry the sweeps' fingerprint; the measurements are there.
    for col in ["date", "host", "device", "backend", "commit", "features", "kiln_version"] {
        assert!(!ok[0].get(col).is_empty(), "{col} is empty");
    }
    assert_eq!(ok[0].get("memory_limit_bytes"), "451000");
    let full = ok.iter().find(|x| x.get("miss_rate") == "1.0" || x.get("miss_rate") == "1").unwrap();
    assert!(full.get("copy_gb_s").parse::<f64>().unwrap() > 0.0 && full.get("measured_miss_rate") == "1.0");
    assert!(sb.csv().with_extension("md").is_file() && sb.csv().with_extension("svg").is_file());
}

#[test]
fn the_refused_geometry_named_by_hand_exits_1() {
    let sb = Sandbox::new();
    let mut extra = CAP.to_vec();
    extra.extend(["--cache-slots", "8"]);
    let r = run(&sb, &extra);
    r.expect_code(1).expect_stdout("skipped 1 of 1 combinations: synthetic:tiny-moe@8");
    r.expect_stderr("exit 1: the run measured nothing");
    r.expect_stderr("measured nothing: synthetic:tiny-moe@8");
    assert!(tables(&r.stdout).is_empty(), "no header for a refused geometry{r}");
}

#[test]
fn an_explicit_legal_subset_exits_0_with_every_row() {
    let sb = Sandbox::new();
    let r = run(&sb, &["--cache-slots", "2,6", "--batch-sizes", "1,4", "--miss-rates", "0,0.5,1"]);
    r.expect_code(0).expect_stdout("skipped 0 of 2 combinations");
    let t = tables(&r.stdout);
    assert_eq!(t.iter().map(|(_, n)| *n).collect::<Vec<_>>(), vec![6, 6], "{t:?}{r}");
    assert_eq!(sb.rows(&sb.csv()).iter().filter(|x| x.get("status") == "ok").count(), 12);
}

#[test]
fn an_oom_is_a_row_fed_to_the_backstop_and_the_record_and_the_sweep_goes_on() {
    let sb = Sandbox::new();
    let r = sb.run_with(
        "bench-offload-copy",
        &[
            "--models",
            MOE,
            "--cache-slots",
            "2,6",
            "--batch-sizes",
            "1,4",
            "--miss-rates",
            "0",
            "--steps",
            "1",
            "--min-time-ms",
            "0",
            "--bandwidth-bytes",
            "4MiB",
        ],
        &[("KILN_BENCH_FAKE_OOM", "synthetic:tiny-moe+expert-slots:2")],
    );
    // Nothing measured: exit 1; the OOM is a row, not a geometry refusal.
    r.expect_code(1)
        .expect_stdout("SKIP:oom")
        .expect_stdout("skipped 1 of 2 combinations: synthetic:tiny-moe@6");
    assert!(!r.stdout.contains("SKIPPED"), "{r}");
    let statuses: Vec<(String, String)> = sb
        .rows(&sb.csv())
        .iter()
        .map(|x| (format!("{}/{}", x.get("cache_slots"), x.get("batch_size")), x.get("status").to_string()))
        .collect();
    let want: Vec<(String, String)> = [
        ("2/1", "SKIP:oom"),
        ("2/4", "SKIP:oom_backstop"),
        ("6/1", "SKIP:oom_backstop"),
        ("6/4", "SKIP:oom_backstop"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(statuses, want, "{r}");
    let lines = sb.record_lines();
    assert_eq!(lines.len(), 1, "{lines:?}{r}");
    assert!(lines[0].starts_with("synthetic:tiny-moe+expert-slots,2,"), "{lines:?}");
}

#[test]
fn a_missing_or_dense_model_named_with_models_gets_rows_and_exits_1() {
    // Without --cache-slots, as the defect was found: no row and exit 0 before.
    let sb = Sandbox::new();
    let r = sb.run(
        "bench-offload-copy",
        &[
            "--models",
            "synthetic:tiny-moe,no-such-model,synthetic:tiny",
            "--memory-limit",
            "451000",
            "--batch-sizes",
            "1",
            "--miss-rates",
            "0,1",
            "--steps",
            "1",
            "--min-time-ms",
            "0",
            "--bandwidth-bytes",
            "4MiB",
        ],
    );
    r.expect_code(1)
        .expect_stdout("no-such-model: SKIP:missing_model -- ")
        .expect_stdout("synthetic:tiny: SKIP:unsupported -- not a mixture-of-experts model")
        .expect_stderr("measured nothing: no-such-model, synthetic:tiny");
    let statuses: Vec<(String, String)> = sb
        .rows(&sb.csv())
        .iter()
        .map(|x| {
            (
                format!("{}@{}/{}", x.get("model"), x.get("cache_slots"), x.get("miss_rate")),
                x.get("status").into(),
            )
        })
        .collect();
    // The derived slot counts of the MoE model (8 refused under the cap, 6 measured);
    // the others have no shape, so their rows sit at 0 slots.
    let want: Vec<(String, String)> = [
        ("synthetic:tiny-moe@8/0.0", "SKIP:unsupported"),
        ("synthetic:tiny-moe@8/1.0", "SKIP:unsupported"),
        ("synthetic:tiny-moe@6/0.0", "ok"),
        ("synthetic:tiny-moe@6/1.0", "ok"),
        ("no-such-model@0/0.0", "SKIP:missing_model"),
        ("no-such-model@0/1.0", "SKIP:missing_model"),
        ("synthetic:tiny@0/0.0", "SKIP:unsupported"),
        ("synthetic:tiny@0/1.0", "SKIP:unsupported"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(statuses, want, "{r}");
}

#[test]
fn the_oom_record_is_never_the_output() {
    let sb = Sandbox::new();
    std::fs::write(sb.record(), "").unwrap();
    let link = sb.path("record-link.csv");
    std::os::unix::fs::symlink(sb.record(), &link).unwrap();
    for out in [sb.record(), link] {
        let r = run(&sb, &["--output", out.to_str().unwrap()]);
        r.expect_code(2).expect_stderr("is the OOM record");
        assert_eq!(std::fs::read(sb.record()).unwrap(), b"", "the record was overwritten{r}");
    }
}

#[test]
fn bad_flags_are_exit_2_naming_the_flag_before_any_cell_runs() {
    let sb = Sandbox::new();
    let cases: [(&[&str], &[&str]); 3] = [
        (&["--bandwidth-bytes", "4KiB"], &["--bandwidth-bytes", "accepted values are 1MiB or more"]),
        (&["--steps", "-1"], &["--steps", "-1 is negative: accepted values are 1 to"]),
        (&["--threads", "0"], &["--threads", "0: accepted values are 1 to"]),
    ];
    for (args, needles) in cases {
        let mut a = vec!["--models", MOE];
        a.extend_from_slice(args);
        let r = sb.run("bench-offload-copy", &a);
        r.expect_code(2);
        for n in needles {
            r.expect_stderr(n);
        }
        assert!(!r.stderr.contains("unexpected argument"), "{r}");
    }
    assert!(!sb.path("runs").exists(), "a cell ran");
}
