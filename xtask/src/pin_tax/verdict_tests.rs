//! Tests of what a pin-tax run says: the wording of an A/A run, the verdicts and widths
//! of `verdict::reading`, the fit's caveat, the cost-ratio plot, the report's skipped
//! cells, and a recorded run whose summary.md, readings.json and report.html say what
//! the terminal said.

use super::abba::Mode;
use super::analysis::{self, Design, Judge, SheetInput};
use super::arms::{AaEnv, Arm, Order, order_arg};
use super::records::{Better, CellDef, CellMeasure, MetricDef, PassRecord};

fn pass(boot: usize, arm: Arm, n: usize, cell: &str, metric: &str, v: f64) -> PassRecord {
    PassRecord {
        boot,
        arm,
        pass: n,
        ok: true,
        reason: None,
        invalid: None,
        disturbed: None,
        quiet: None,
        elapsed_s: 1.0,
        cells: vec![CellMeasure {
            cell: cell.into(),
            requests: 1,
            failed: 0,
            first_error: None,
            metrics: [(metric.to_string(), v)].into(),
            hashes: Default::default(),
            prompt_tokens: None,
            cached_tokens: None,
            invalid: None,
            detail: None,
        }],
    }
}

fn defs(metric: &'static str, better: Better) -> Vec<CellDef> {
    vec![CellDef { name: "decode B=2".into(), metrics: vec![MetricDef { name: metric, better }] }]
}

fn judge() -> Judge {
    Judge { trust_pct: 4.0, margin_pct: None, sequential: false }
}

fn sheet_of(rows: &[analysis::TaxRow], design: Design, aa: Option<&super::records::NoiseFloor>) -> String {
    analysis::sheet(&SheetInput {
        rows,
        design,
        judge: &judge(),
        unit: "pass",
        secs_per_pair: Some(60.0),
        aa,
    })
    .markdown()
}

fn sweep() -> super::sweep::Sweep {
    super::sweep::Sweep {
        concurrency: vec![2],
        rounds: 1,
        decode_prompt: 16,
        max_tokens: 32,
        prefix: 256,
        suffix: 4,
        cache_requests: 4,
        prefill_tokens: 256,
        chunked_tokens: 1024,
        prefill_requests: 2,
        served: "m".into(),
        skipped: Default::default(),
    }
}

#[test]
fn an_aa_summary_never_speaks_of_a_pin_or_a_tax() {
    let d = Design::SWEEP.aa();
    let (a1, a2) = (Arm::A1(AaEnv::Wide), Arm::A2(AaEnv::Wide));
    let order = Order(vec![a1, a2, a2, a1]);
    let ps = vec![
        pass(1, a1, 1, "decode B=2", "output tok/s", 100.0),
        pass(2, a2, 1, "decode B=2", "output tok/s", 101.0),
        pass(3, a2, 1, "decode B=2", "output tok/s", 99.0),
        pass(4, a1, 1, "decode B=2", "output tok/s", 100.0),
    ];
    let rows = analysis::analyse(&defs("output tok/s", Better::Higher), &order, &ps, 4.0, d);
    let f = super::aa::floor("d", "r", "sweep", &rows);
    let s = sheet_of(&rows, d, Some(&f));
    let lower = s.to_lowercase();
    assert!(!lower.contains("tax") && !lower.contains("pin"), "{s}");
    assert!(s.starts_with("A/A noise floor, A2/A1 (both slots run wide): the difference between identical arms: 0 of 1 intervals exclude 1 (false-positive rate 0%, nominal 5%)"), "{s}");
    assert!(s.contains("| cell | metric | A2 | A1 | A2/A1 |"), "{s}");
    // The plot of an A/A run is titled as one.
    let p = &super::plots::sweep(&rows, d, 5.0)[0];
    assert!(p.title.starts_with("A/A noise floor") && !p.title.to_lowercase().contains("pin"), "{}", p.title);
}

#[test]
fn wide_intervals_print_as_a_factor() {
    let order = order_arg("1 0 0 1").unwrap();
    let ps = vec![
        pass(1, Arm::Wide, 1, "decode B=2", "output tok/s", 100.0),
        pass(2, Arm::Narrow, 1, "decode B=2", "output tok/s", 60.0),
        pass(3, Arm::Narrow, 1, "decode B=2", "output tok/s", 140.0),
        pass(4, Arm::Wide, 1, "decode B=2", "output tok/s", 100.0),
    ];
    let rows = analysis::analyse(&defs("output tok/s", Better::Higher), &order, &ps, 4.0, Design::SWEEP);
    let s = sheet_of(&rows, Design::SWEEP, None);
    // Ratios 0.6 and 1.4 at n=2: an interval of about 0.005 to 200.
    assert!(s.contains("(n=2, within a factor of 2"), "{s}");
    // No percentage past 100 and no interval printed as `lo to hi`.
    let pcts = s.split('±').skip(1).filter_map(|w| w.split('%').next()?.parse::<f64>().ok());
    let digit = |c: char| c.is_ascii_digit();
    let lo_to_hi =
        s.match_indices(" to ").any(|(i, _)| s[..i].ends_with(digit) && s[i + 4..].starts_with(digit));
    assert!(pcts.into_iter().all(|p| p <= 100.0) && !lo_to_hi, "{s}");
    assert!(s.contains("undecided at ±5%"), "{s}");
}

#[test]
fn the_fit_says_in_its_line_when_its_rows_are_untrusted() {
    let order = order_arg("1 0 0 1").unwrap();
    let tpot = |b, arm, v| pass(b, arm, 1, "decode B=2", "TPOT ms", v);
    // Narrow +2 ms, each arm's spread far over 4%.
    let ps = vec![
        tpot(1, Arm::Wide, 10.0),
        tpot(2, Arm::Narrow, 12.0),
        tpot(3, Arm::Narrow, 16.1),
        tpot(4, Arm::Wide, 14.0),
    ];
    let rows = analysis::analyse(&defs("TPOT ms", Better::Lower), &order, &ps, 4.0, Design::SWEEP);
    let fit = sweep().fit(&rows, None).unwrap();
    let md = crate::verdict::sheet::Sheet { tables: vec![fit], ..Default::default() }.markdown();
    let line = md.lines().find(|l| l.starts_with("| per forward")).expect(&md);
    assert!(line.contains("not a tax: every one of its rows untrusted"), "{line}");
    // A clean row with an A/A run showing 25% false positives: the caveat says that.
    let ps = vec![
        tpot(1, Arm::Wide, 10.0),
        tpot(2, Arm::Narrow, 12.0),
        tpot(3, Arm::Narrow, 12.1),
        tpot(4, Arm::Wide, 10.05),
    ];
    let rows = analysis::analyse(&defs("TPOT ms", Better::Lower), &order, &ps, 4.0, Design::SWEEP);
    let md = crate::verdict::sheet::Sheet {
        tables: vec![sweep().fit(&rows, Some(25.0)).unwrap()],
        ..Default::default()
    }
    .markdown();
    let line = md.lines().find(|l| l.starts_with("| per forward")).expect(&md);
    assert!(
        line.contains("not a tax: the A/A run it cites shows a 25% false-positive rate (nominal 5%)"),
        "{line}"
    );
    // The headline does not call it a tax either.
    let mut floor = super::aa::floor("d", "r", "sweep", &[]);
    floor.metrics.insert(
        "TPOT ms".into(),
        super::records::Floor {
            cells: 4,
            false_positives: 1,
            mean_half_width_pct: None,
            pairs: 4,
            typical: None,
            widest: None,
        },
    );
    let head = analysis::headline(&rows, Design::SWEEP, &judge(), Some(&floor));
    assert!(head.starts_with("qmv_wide pin, narrow/wide: no verdict to act on: the A/A run it cites shows a 25% false-positive rate"), "{head}");
    assert!(!head.contains("costs"), "{head}");
}

#[test]
fn the_mixed_mode_labels_its_rows_for_what_they_are() {
    let order = Order(vec![Arm::A, Arm::B, Arm::B, Arm::A]);
    let row = |metric: &'static str, a: f64, b: f64| {
        let ps = vec![
            pass(1, Arm::A, 1, "window", metric, a),
            pass(2, Arm::B, 1, "window", metric, b),
            pass(3, Arm::B, 1, "window", metric, b * 1.01),
            pass(4, Arm::A, 1, "window", metric, a * 1.001),
        ];
        let defs = vec![CellDef {
            name: "window".into(),
            metrics: vec![MetricDef { name: metric, better: Better::Higher }],
        }];
        analysis::analyse(&defs, &order, &ps, 4.0, Design::MIXED).remove(0)
    };
    // A's classic streams slower: a bystander cost.
    assert_eq!(
        row(analysis::BYSTANDERS, 10.0, 12.0).verdict,
        "bystander cost: A's classic streams are slower by more than 5%"
    );
    // The speculative stream is no bystander.
    let spec = row("speculative tok/s", 10.0, 20.0).verdict;
    assert_eq!(spec, "the speculative stream itself: A is worse by more than 5%");
    assert!(!spec.contains("bystander"));
}

#[test]
fn the_plot_is_log_scale_around_one_with_a_margin_band_and_cost_ratios() {
    let order = order_arg("1 0 0 1").unwrap();
    let ps = vec![
        pass(1, Arm::Wide, 1, "decode B=2", "output tok/s", 100.0),
        pass(2, Arm::Narrow, 1, "decode B=2", "output tok/s", 80.0),
        pass(3, Arm::Narrow, 1, "decode B=2", "output tok/s", 80.0),
        pass(4, Arm::Wide, 1, "decode B=2", "output tok/s", 100.0),
    ];
    let rows = analysis::analyse(&defs("output tok/s", Better::Higher), &order, &ps, 4.0, Design::SWEEP);
    let p = &super::plots::sweep(&rows, Design::SWEEP, 5.0)[0];
    assert_eq!(p.y.scale, crate::plot::Scale::Log);
    let refs: Vec<f64> = p.refs.iter().map(|r| r.y).collect();
    assert_eq!(refs, [1.05, 1.0, 1.0 / 1.05]);
    // tok/s 0.8: a cost ratio of 1.25.
    assert!((p.series[0].points[0].y - 1.25).abs() < 1e-9, "{:?}", p.series[0].points);
}

#[test]
fn the_report_lists_skipped_cells_and_never_says_none_beside_them() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("passes.jsonl"), "{\"boot\":1,\"arm\":\"wide\",\"pass\":1,\"ok\":true}\n")
        .unwrap();
    std::fs::write(
        d.path().join("env.json"),
        r#"{"command": ["xtask", "qmv-pin-tax"], "qmv_pin_tax": {"skipped": {"chunked prefill 1024": "1024 prompt plus 1 generated tokens exceed the model's context of 512 tokens"}}}"#,
    )
    .unwrap();
    let html = crate::report::page(&crate::report::Run::load(d.path()).unwrap());
    assert!(!html.contains("none: every cell was measured"), "{html}");
    assert!(
        html.contains("<td>chunked prefill 1024</td>") && html.contains("SKIP:context: 1024 prompt"),
        "{html}"
    );
    // A cell that failed in a pass that counts is listed too.
    std::fs::write(
        d.path().join("passes.jsonl"),
        "{\"boot\":1,\"arm\":\"wide\",\"pass\":1,\"ok\":true,\"cells\":[{\"cell\":\"decode B=8\",\"requests\":8,\"failed\":2,\"first_error\":\"HTTP 503\"}]}\n",
    )
    .unwrap();
    let html = crate::report::page(&crate::report::Run::load(d.path()).unwrap());
    assert!(html.contains("<p>2 cell(s) without a measurement:</p>"), "{html}");
    assert!(html.contains("2 of 8 requests failed; first: HTTP 503"), "{html}");
}

/// A recorded run (docs/benchmark_results/qmv-pin-tax-cpu-epyc-2cpu-2026-11-30.md's
/// decode B=2 and B=8 as four ABBA pairs) rendered as the driver renders it: every verdict
/// the terminal printed is in summary.md, readings.json and report.html word for word.
#[test]
fn summary_md_readings_and_the_report_say_what_the_terminal_said() {
    let order = order_arg("1 0 0 1 0 1 1 0").unwrap();
    let cells = vec![
        CellDef {
            name: "decode B=2".into(),
            metrics: vec![
                MetricDef { name: "output tok/s", better: Better::Higher },
                MetricDef { name: "TPOT ms", better: Better::Lower },
            ],
        },
        CellDef {
            name: "decode B=8".into(),
            metrics: vec![
                MetricDef { name: "output tok/s", better: Better::Higher },
                MetricDef { name: "TPOT ms", better: Better::Lower },
            ],
        },
    ];
    let wide = [(41.3, 47.1), (40.8, 48.0), (42.0, 46.2), (41.1, 47.5)];
    let narrow = [(52.6, 37.0), (51.0, 38.2), (53.9, 36.1), (50.2, 39.0)];
    let b8 = [(92.0, 86.0), (66.4, 120.3)];
    let mut passes = Vec::new();
    let (mut wi, mut ni) = (0, 0);
    for (i, &arm) in order.0.iter().enumerate() {
        let (tok, tpot) = if arm == Arm::Wide {
            wi += 1;
            wide[wi - 1]
        } else {
            ni += 1;
            narrow[ni - 1]
        };
        let b = if arm == Arm::Wide { b8[0] } else { b8[1] };
        let mut p = pass(i + 1, arm, 1, "decode B=2", "output tok/s", tok);
        p.cells[0].metrics.insert("TPOT ms".into(), tpot);
        let mut c8 = p.cells[0].clone();
        c8.cell = "decode B=8".into();
        c8.metrics =
            [("output tok/s".to_string(), b.0 * (1.0 + i as f64 * 0.01)), ("TPOT ms".to_string(), b.1)]
                .into();
        p.cells.push(c8);
        if i == 5 {
            p.disturbed = Some("other processes used 1.2 CPUs".into());
        }
        passes.push(p);
    }
    let rows = analysis::analyse_with(&cells, &order, &passes, &judge(), Design::SWEEP);
    let mut sheet = analysis::sheet(&SheetInput {
        rows: &rows,
        design: Design::SWEEP,
        judge: &judge(),
        unit: "pass",
        secs_per_pair: Some(75.0),
        aa: None,
    });
    sheet.tables.push(sweep().fit(&rows, None).unwrap());
    sheet.notes.extend(analysis::notes(&analysis::findings(&passes, "pass"), &[], "pass"));
    let dir = tempfile::tempdir().unwrap();
    let mut jsonl = String::new();
    for p in &passes {
        jsonl.push_str(&serde_json::to_string(p).unwrap());
        jsonl.push('\n');
    }
    std::fs::write(dir.path().join("passes.jsonl"), jsonl).unwrap();
    std::fs::write(dir.path().join("env.json"), r#"{"command": ["xtask", "qmv-pin-tax"]}"#).unwrap();
    let terminal = super::finish(dir.path(), &sheet, "cpu: Test CPU").unwrap();
    let summary = std::fs::read_to_string(dir.path().join("summary.md")).unwrap();
    assert_eq!(summary, terminal);
    let back = crate::verdict::sheet::Sheet::read(dir.path()).unwrap().unwrap();
    assert_eq!(back.texts(), sheet.texts());
    let html = crate::report::page(&crate::report::Run::load(dir.path()).unwrap());
    let judged: Vec<&crate::verdict::sheet::Cell> =
        sheet.tables.iter().flat_map(|t| t.rows.iter().flatten()).filter(|c| c.judged.is_some()).collect();
    assert_eq!(judged.len(), 4, "{terminal}");
    for c in &judged {
        let j = c.judged.as_ref().unwrap();
        // The cell's text is the reading's and the verdict's, as verdict::reading words them.
        assert_eq!(c.text, format!("{} {}", j.reading.ratio_text(), j.text("pairs", Some(75.0))));
        assert!(terminal.contains(&c.text), "{} not in {terminal}", c.text);
        assert!(html.contains(&crate::plot::escape(&c.text)), "{} not in the page", c.text);
    }
    for t in sheet.texts() {
        assert!(html.contains(&crate::plot::escape(t)), "{t} not in the page");
    }
    assert!(html.contains(&crate::plot::escape(&sheet.headline)), "{}", sheet.headline);
    // The disturbed pass is in its rows' readings and verdicts.
    assert!(terminal.contains("1 disturbed"), "{terminal}");
    assert!(rows.iter().all(|r| r.verdict.contains("1 of 4 pairs disturbed")), "{terminal}");
}
