//! What a sweep prints at the end, derived from its rows: a markdown table (model x prompt
//! length, decode and prefill tok/s or the status), the tally, and the exit status.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::classify::Status;
use super::plan::{Cell, CellKey, Engine, Plan};
use super::rows::Row;

/// A cell and its row, when it has one.
pub struct Finished<'a> {
    /// The cell.
    pub cell: &'a Cell,
    /// Its row: from this run or from the resumed file.
    pub row: Option<&'a Row>,
}

/// Pairs every cell of `plan` with its row.
pub fn pair<'a>(plan: &'a Plan, rows: &'a BTreeMap<CellKey, Row>) -> Vec<Finished<'a>> {
    plan.cells.iter().map(|cell| Finished { cell, row: rows.get(&cell.key()) }).collect()
}

fn status_of(row: &Row) -> Option<Status> {
    Status::parse(&row.status)
}

fn rate(v: Option<f64>) -> String {
    v.map_or_else(|| "?".into(), |v| if v >= 100.0 { format!("{v:.0}") } else { format!("{v:.1}") })
}

/// A cell measured once: its rates, or its status.
fn single_cell(row: Option<&Row>) -> String {
    match row {
        None => "not run".to_string(),
        Some(r) if r.status == Status::Ok.as_str() => {
            format!("{} / {}", rate(r.decode_tok_s), rate(r.prefill_tok_s))
        }
        Some(r) => r.status.clone(),
    }
}

/// A cell of a `--repeat` sweep: the geometric mean of each rate over kiln's ok
/// repetitions with their count, or, when none is ok, the first repetition's status.
fn repeated_cell(cell: &Cell, finished: &[Finished<'_>]) -> String {
    let base = cell.base_label();
    let runs: Vec<&Finished<'_>> =
        finished.iter().filter(|f| f.cell.engine == Engine::Kiln && f.cell.base_label() == base).collect();
    let ok: Vec<(f64, f64)> = runs
        .iter()
        .filter_map(|f| f.row)
        .filter(|r| r.status == Status::Ok.as_str())
        .filter_map(|r| Some((r.decode_tok_s?, r.prefill_tok_s?)))
        .collect();
    if ok.is_empty() {
        let first = runs.iter().find_map(|f| f.row.map(|r| r.status.clone()));
        return format!("{} (0 of {} ok)", first.unwrap_or_else(|| "not run".into()), runs.len());
    }
    let g = |k: fn(&(f64, f64)) -> f64| {
        crate::student_t::log_interval(&ok.iter().map(k).collect::<Vec<_>>()).map(|i| i.mean)
    };
    format!("{} / {} (n={} of {})", rate(g(|v| v.0)), rate(g(|v| v.1)), ok.len(), runs.len())
}

/// The markdown table and the tally lines.
pub fn render(plan: &Plan, finished: &[Finished<'_>], interrupted: Option<&str>) -> String {
    // Figures of the CUDA kernels' host execution are the CPU's: said before any of them.
    let mut s = crate::machine::host_execution_notes(
        finished.iter().filter_map(|f| f.row).map(|r| r.device.as_str()),
    );
    if !s.is_empty() {
        s.push('\n');
    }
    let by_length = !plan.lengths.is_empty();
    let columns: Vec<String> =
        if by_length { plan.lengths.iter().map(u64::to_string).collect() } else { vec!["prompt".into()] };
    let repeated = plan.cells.iter().any(|c| c.repetition > 1);
    if repeated {
        let _ = writeln!(
            s,
            "decode / prefill tok/s, the geometric mean over the cell's ok repetitions (n = how many), or why the cell has no measurement:\n"
        );
    } else {
        let _ = writeln!(s, "decode / prefill tok/s, or why the cell has no measurement:\n");
    }
    let _ = writeln!(s, "| model | {} |", columns.join(" | "));
    let _ = writeln!(s, "|---|{}", "---:|".repeat(columns.len()));
    for model in &plan.models {
        // One column per prompt: kiln's run, or with --repeat the summary of all its
        // repetitions, never one repetition standing for the rest (the intervals over
        // repetitions and engines follow in their own section).
        let cells: Vec<String> = finished
            .iter()
            .filter(|f| &f.cell.model == model && f.cell.repetition == 1 && f.cell.engine == Engine::Kiln)
            .map(|f| if repeated { repeated_cell(f.cell, finished) } else { single_cell(f.row) })
            .collect();
        let _ = writeln!(s, "| {} | {} |", model.replace('|', "\\|"), cells.join(" | "));
    }
    let _ = writeln!(s);
    let total = finished.len();
    let mut tally: BTreeMap<&str, usize> = BTreeMap::new();
    for f in finished {
        *tally.entry(f.row.map_or("not run", |r| r.status.as_str())).or_default() += 1;
    }
    let counts: Vec<String> = Status::ALL
        .iter()
        .map(|st| st.as_str())
        .chain(["not run"])
        .filter_map(|name| tally.get(name).map(|n| format!("{n} {name}")))
        .collect();
    let _ = writeln!(s, "{total} cells: {}", counts.join(", "));
    let list = |pred: &dyn Fn(Status) -> bool| -> Vec<String> {
        finished
            .iter()
            .filter_map(|f| {
                let r = f.row?;
                let st = status_of(r)?;
                pred(st).then(|| format!("{} ({st})", f.cell.label()))
            })
            .collect()
    };
    let skipped = list(&|st| st.is_skip());
    let _ = writeln!(s, "skipped {} of {total} cells: {}", skipped.len(), none_or(&skipped));
    let disturbed: Vec<String> = finished
        .iter()
        .filter_map(|f| f.row.filter(|r| !r.disturbed.is_empty()).map(|_| f.cell.label()))
        .collect();
    if !disturbed.is_empty() {
        let _ = writeln!(
            s,
            "disturbed {} of {total} cells (other processes were busy while they ran; see the disturbed column): {}",
            disturbed.len(),
            disturbed.join(", ")
        );
    }
    let failed = list(&|st| st.is_failure());
    if !failed.is_empty() {
        let _ = writeln!(s, "failed {} of {total} cells: {}", failed.len(), failed.join(", "));
    }
    if let Some(why) = interrupted {
        // A cell the interruption cancelled (a Slurm task) has a row, but did not finish.
        let cancelled = finished
            .iter()
            .filter(|f| f.row.is_some_and(|r| status_of(r) == Some(Status::SlurmCancelled)))
            .count();
        let done = finished.iter().filter(|f| f.row.is_some()).count() - cancelled;
        let also = if cancelled > 0 { format!(" ({cancelled} cancelled)") } else { String::new() };
        let _ = writeln!(
            s,
            "interrupted by {why} after {done} of {total} cells{also}; every finished row is kept"
        );
    }
    s
}

fn none_or(items: &[String]) -> String {
    if items.is_empty() { "none".into() } else { items.join(", ") }
}

/// The exit status of a finished (not interrupted) sweep: 1 when a cell failed, when a
/// cell whose coordinates the user named could not run by rule, or when nothing at all
/// was measured; 0 otherwise (skips of cells derived from defaults and out-of-memory
/// results are results).
pub fn exit_status(finished: &[Finished<'_>]) -> (u8, Vec<String>) {
    let mut reasons = Vec::new();
    let mut measured = false;
    for f in finished {
        let Some(st) = f.row.and_then(status_of) else { continue };
        if st == Status::Ok {
            measured = true;
        } else if st.is_failure() {
            reasons.push(format!("{} failed ({st})", f.cell.label()));
        } else if st.is_by_rule() && f.cell.named_for(st) {
            reasons.push(format!("{} was named explicitly but cannot run ({st})", f.cell.label()));
        }
    }
    if !measured {
        reasons.push("nothing was measured".into());
    }
    (u8::from(!reasons.is_empty()), reasons)
}

#[cfg(test)]
mod tests {
    use super::super::plan::{CellTemplate, Named, Prompt};
    use super::*;

    fn plan(named: Named) -> Plan {
        Plan::grid(
            &["a".to_string(), "b".to_string()],
            &[Prompt::Tokens(512), Prompt::Tokens(2048)],
            &CellTemplate { max_tokens: 8, warmup_tokens: 0, named },
        )
    }

    fn rows(plan: &Plan, statuses: &[&str]) -> BTreeMap<CellKey, Row> {
        plan.cells
            .iter()
            .zip(statuses)
            .filter(|(_, s)| !s.is_empty())
            .map(|(c, s)| {
                let row = Row {
                    model: c.model.clone(),
                    prompt_target_len: c.prompt_target_len(),
                    decode_tok_s: Some(12.345),
                    prefill_tok_s: Some(1234.5),
                    status: s.to_string(),
                    ..Row::default()
                };
                (c.key(), row)
            })
            .collect()
    }

    fn exit(named: Named, statuses: &[&str]) -> u8 {
        let p = plan(named);
        let r = rows(&p, statuses);
        exit_status(&pair(&p, &r)).0
    }

    const DEFAULTS: Named = Named { models: false, prompts: false };
    const EXPLICIT: Named = Named { models: true, prompts: true };
    const MODELS_ONLY: Named = Named { models: true, prompts: false };

    #[test]
    fn derived_skips_and_ooms_exit_zero() {
        assert_eq!(exit(DEFAULTS, &["ok", "SKIP:context", "SKIP:missing_model", "SKIP:unsupported"]), 0);
        assert_eq!(exit(EXPLICIT, &["ok", "SKIP:oom", "SKIP:oom_backstop", "SKIP:oom_record"]), 0);
        assert_eq!(exit(EXPLICIT, &["ok", "SKIP:oom_estimate", "ok", "ok"]), 0);
        assert_eq!(exit(MODELS_ONLY, &["ok", "SKIP:context", "ok", "SKIP:context"]), 0);
    }

    #[test]
    fn explicit_by_rule_skips_failures_and_nothing_measured_exit_one() {
        assert_eq!(exit(EXPLICIT, &["ok", "SKIP:context", "ok", "ok"]), 1);
        assert_eq!(exit(MODELS_ONLY, &["ok", "ok", "SKIP:missing_model", "SKIP:missing_model"]), 1);
        assert_eq!(exit(DEFAULTS, &["ok", "FAIL:timeout", "ok", "ok"]), 1);
        assert_eq!(exit(DEFAULTS, &["ok", "FAIL:no_output", "ok", "ok"]), 1);
        assert_eq!(exit(DEFAULTS, &["SKIP:oom", "SKIP:oom_backstop", "SKIP:oom_record", "SKIP:oom"]), 1);
        assert_eq!(exit(DEFAULTS, &["", "", "", ""]), 1);
    }

    #[test]
    fn the_summary_shows_rates_statuses_and_the_tally() {
        let p = plan(DEFAULTS);
        let mut r = rows(&p, &["ok", "SKIP:oom", "SKIP:context", ""]);
        r.get_mut(&p.cells[0].key()).unwrap().disturbed = "other processes used 1.20 CPUs".into();
        let text = render(&p, &pair(&p, &r), Some("SIGINT"));
        assert!(text.contains("| model | 512 | 2048 |"), "{text}");
        assert!(text.contains("| a | 12.3 / 1234 | SKIP:oom |"), "{text}");
        assert!(text.contains("| b | SKIP:context | not run |"), "{text}");
        assert!(text.contains("4 cells: 1 ok, 1 SKIP:oom, 1 SKIP:context, 1 not run"), "{text}");
        assert!(text.contains("skipped 2 of 4 cells: a@2048 (SKIP:oom), b@512 (SKIP:context)"), "{text}");
        assert!(text.contains("interrupted by SIGINT after 3 of 4 cells"), "{text}");
        assert!(text.contains("disturbed 1 of 4 cells (other processes were busy"), "{text}");
        assert!(text.contains("see the disturbed column): a@512\n"), "{text}");
    }

    #[test]
    fn a_summary_of_the_host_execution_says_its_figures_are_not_a_gpus() {
        let p = plan(DEFAULTS);
        let mut r = rows(&p, &["ok", "ok", "ok", ""]);
        for row in r.values_mut() {
            row.device = "cuda:host execution on Some CPU (24 GiB)".into();
        }
        let text = render(&p, &pair(&p, &r), None);
        let first = text.lines().next().unwrap_or("");
        assert_eq!(
            first,
            "figures are the CUDA kernels' host execution on Some CPU (24 GiB), not a GPU (KILN_CUDA_EMULATE=1)",
            "{text}"
        );
        assert_eq!(text.matches("host execution").count(), 1, "one line per device{text}");
        // A GPU's or the CPU's rows carry no such line.
        for device in ["cuda:NVIDIA H200 (143771 MiB)", "cpu:Some CPU (24 GiB)"] {
            for row in r.values_mut() {
                row.device = device.into();
            }
            let text = render(&p, &pair(&p, &r), None);
            assert!(!text.contains("host execution"), "{text}");
        }
    }

    #[test]
    fn cells_a_slurm_interrupt_cancelled_do_not_count_as_finished() {
        let p = plan(DEFAULTS);
        let r = rows(&p, &["ok", "FAIL:slurm_cancelled", "FAIL:slurm_cancelled", "FAIL:slurm_cancelled"]);
        let text = render(&p, &pair(&p, &r), Some("SIGINT"));
        assert!(
            text.contains(
                "interrupted by SIGINT after 1 of 4 cells (3 cancelled); every finished row is kept"
            ),
            "{text}"
        );
    }

    #[test]
    fn with_repeat_the_main_table_summarises_every_repetition() {
        // Repetition 1 of a@512 ran at 10 tok/s, 2 and 3 at 40: the table must not show
        // repetition 1 as the cell's figure but the geometric mean of all three.
        let p = super::super::series::expand(&plan(DEFAULTS), 3, false);
        let mut r: BTreeMap<CellKey, Row> = BTreeMap::new();
        for c in &p.cells {
            let (d, status) = match (c.model.as_str(), c.prompt_target_len().unwrap_or(0), c.repetition) {
                ("a", 512, 1) => (10.0, "ok"),
                ("a", 512, _) => (40.0, "ok"),
                ("b", 2048, _) => (1.0, "SKIP:context"),
                ("b", 512, 2) => (1.0, "FAIL:timeout"),
                _ => (20.0, "ok"),
            };
            let row = Row {
                model: c.model.clone(),
                prompt_target_len: c.prompt_target_len(),
                decode_tok_s: Some(d),
                prefill_tok_s: Some(100.0 * d),
                status: status.to_string(),
                repetition: c.repetition,
                ..Row::default()
            };
            r.insert(c.key(), row);
        }
        let text = render(&p, &pair(&p, &r), None);
        assert!(text.contains("geometric mean over the cell's ok repetitions"), "{text}");
        // (10 * 40 * 40)^(1/3) = 25.2; prefill 100 times that.
        assert!(text.contains("| a | 25.2 / 2520 (n=3 of 3) | 20.0 / 2000 (n=3 of 3) |"), "{text}");
        assert!(text.contains("| b | 20.0 / 2000 (n=2 of 3) | SKIP:context (0 of 3 ok) |"), "{text}");
    }
}
