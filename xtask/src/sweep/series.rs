//! Repetitions of a sweep's cells (`--repeat N`), interleaved across cells rather than
//! run back to back, and `--until-ci`'s verdict on them. The per-cell readings (each
//! rate's geometric mean and interval, kiln/peer from the pairs of each repetition) are
//! the summary's sheet ([`super::summary::sheet_of_rows`]).

use super::plan::{Cell, Engine, Plan};
use super::summary::{RunState, UntilCi};
use crate::verdict::sheet::Sheet;

/// How a sweep repeats its cells and whom it measures beside kiln.
#[derive(clap::Args, Clone, Debug)]
pub struct SeriesFlags {
    /// Run every cell N times, one row per repetition; repetitions are interleaved
    /// across cells (all cells once, then all again), never back to back.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeat: u32,
    /// Measure a peer engine beside kiln on every cell: `llama-bench=PATH`, llama.cpp's
    /// benchmark on the same weights (exported with `kiln export-gguf`), interleaved with
    /// kiln's runs (kiln, peer; peer, kiln; ...).
    #[arg(long, value_name = "llama-bench=PATH", value_parser = crate::peer::peer_arg)]
    pub peer: Option<crate::peer::PeerSpec>,
    /// Before each cell, wait (up to --quiet-timeout) for a quiet machine instead of only
    /// marking a cell measured on a busy one as disturbed.
    #[arg(long)]
    pub require_quiet: bool,
    /// The bound of --require-quiet's wait, seconds.
    #[arg(long, value_parser = crate::args::count(0), value_name = "SECS", default_value_t = 300)]
    pub quiet_timeout: u64,
    /// Other processes' CPU, in cores, above which the machine counts as busy.
    #[arg(long, value_name = "CPUS", default_value_t = 0.5, value_parser = busy_cpus_arg)]
    pub busy_cpus: f64,
}

impl Default for SeriesFlags {
    /// One run of each cell, no peer, disturbed cells marked but not waited out: what the
    /// flags' defaults give, for sweeps that build their flags in code.
    fn default() -> Self {
        use clap::{Args, FromArgMatches};
        // The clap attributes above are the one statement of the defaults.
        let matches = SeriesFlags::augment_args(clap::Command::new("series"))
            .try_get_matches_from(["series"])
            .expect("the series flags parse from no arguments");
        SeriesFlags::from_arg_matches(&matches).expect("the series flags parse from no arguments")
    }
}

fn busy_cpus_arg(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("{s:?}: expected a number of CPUs, 0 or more (such as 0.5)")),
    }
}

impl SeriesFlags {
    /// The busy limit of the quiet check.
    pub fn limits(&self) -> crate::quiet::Limits {
        crate::quiet::Limits { others_cpus: self.busy_cpus }
    }

    /// How long `--require-quiet` waits; `None` without it.
    pub fn quiet_wait(&self) -> Option<std::time::Duration> {
        self.require_quiet.then(|| std::time::Duration::from_secs(self.quiet_timeout))
    }
}

/// `base` with every cell repeated `repeat` times, repetition-major so a cell's
/// repetitions are spread over the whole run. With `peer`, each repetition of a cell is
/// followed or preceded by the peer's run of it, alternating (kiln, peer; peer, kiln;
/// ...), so a drift in the machine's speed falls on both engines alike.
pub fn expand(base: &Plan, repeat: u32, peer: bool) -> Plan {
    let mut cells = Vec::with_capacity(base.cells.len() * repeat as usize * if peer { 2 } else { 1 });
    for r in 1..=repeat {
        for cell in &base.cells {
            let with = |engine| Cell { repetition: r, engine, ..cell.clone() };
            if !peer {
                cells.push(with(Engine::Kiln));
            } else if r % 2 == 1 {
                cells.extend([with(Engine::Kiln), with(Engine::Peer)]);
            } else {
                cells.extend([with(Engine::Peer), with(Engine::Kiln)]);
            }
        }
    }
    Plan { cells, ..base.clone() }
}

/// The sheet of a `--until-ci` sweep, from its rows: per cell and engine each rate's
/// geometric mean with the confidence sequence's 95% interval of the mean log rate (valid
/// however many repetitions the run added), kiln/peer the same way, and the verdict:
/// whether every interval is under `target_pct`, with `stopped` (the stopping rule's
/// line) once the run has ended. Returns the sheet and that verdict.
pub fn sequential_sheet(
    rows: &[super::rows::Row],
    target_pct: f64,
    stopped: Option<String>,
) -> (Sheet, bool) {
    let state = RunState { until_ci: Some(UntilCi { target_pct, stopped }), ..RunState::default() };
    super::summary::sheet_and_verdict(rows, &state)
}

/// [`sequential_sheet`] as the terminal prints it, and its verdict.
#[cfg(test)]
pub fn sequential(rows: &[super::rows::Row], target_pct: f64) -> (String, bool) {
    let (sheet, narrow) = sequential_sheet(rows, target_pct, None);
    (sheet.markdown(), narrow)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap as Map;

    use super::super::plan::{CellKey, CellTemplate, Named, Prompt};
    use super::super::rows::Row;
    use super::super::summary;
    use super::*;
    use crate::verdict::reading::{Method, Reading};

    fn base() -> Plan {
        Plan::grid(
            &["a".to_string(), "b".to_string()],
            &[Prompt::Tokens(8)],
            &CellTemplate { max_tokens: 4, warmup_tokens: 0, named: Named { models: true, prompts: true } },
        )
    }

    #[test]
    fn the_default_is_what_no_flags_give() {
        let d = SeriesFlags::default();
        assert_eq!((d.repeat, d.require_quiet, d.quiet_timeout, d.busy_cpus), (1, false, 300, 0.5));
        assert!(d.peer.is_none());
        assert_eq!(d.quiet_wait(), None);
    }

    #[test]
    fn repetitions_interleave_across_cells_and_engines_alternate() {
        let labels = |p: &Plan| p.cells.iter().map(Cell::label).collect::<Vec<_>>();
        assert_eq!(labels(&expand(&base(), 2, false)), ["a@8", "b@8", "a@8#2", "b@8#2"]);
        assert_eq!(
            labels(&expand(&base(), 2, true)),
            ["a@8", "a@8+peer", "b@8", "b@8+peer", "a@8#2+peer", "a@8#2", "b@8#2+peer", "b@8#2"]
        );
        // Every (repetition, engine) of a cell has its own key, so a resumed sweep runs
        // only the missing ones.
        let p = expand(&base(), 3, true);
        let keys: std::collections::BTreeSet<CellKey> = p.cells.iter().map(Cell::key).collect();
        assert_eq!(keys.len(), p.cells.len());
    }

    fn row(cell: &Cell, status: &str, decode: f64, prefill: f64) -> Row {
        Row {
            model: cell.model.clone(),
            prompt_target_len: cell.prompt_target_len(),
            status: status.into(),
            decode_tok_s: Some(decode),
            prefill_tok_s: Some(prefill),
            repetition: cell.repetition,
            engine: if cell.engine == Engine::Peer { "llama-bench".into() } else { "kiln".into() },
            engine_version: if cell.engine == Engine::Peer {
                "llama.cpp b1 (abc)".into()
            } else {
                "0.1".into()
            },
            ..Row::default()
        }
    }

    fn sheet_of(plan: &Plan, rows: &Map<CellKey, Row>) -> Sheet {
        summary::sheet(&summary::pair(plan, rows), None)
    }

    /// The table row of `cell` (and `engine`, with a peer).
    fn row_of<'a>(sheet: &'a Sheet, cell: &str, engine: Option<&str>) -> Vec<&'a str> {
        let t = &sheet.tables[0];
        let r = t
            .rows
            .iter()
            .find(|r| r[0].text == cell && engine.is_none_or(|e| r[1].text.starts_with(e)))
            .unwrap_or_else(|| panic!("no row {cell} {engine:?} in {}", sheet.markdown()));
        r.iter().map(|c| c.text.as_str()).collect()
    }

    #[test]
    fn the_summary_gives_readings_per_cell_and_paired_ratios() {
        let plan = expand(&base(), 3, true);
        let mut rows: Map<CellKey, Row> = Map::new();
        for c in &plan.cells {
            let r = c.repetition as f64;
            let (status, d, p) = match (c.model.as_str(), c.engine) {
                ("a", Engine::Kiln) => ("ok", 20.0 * r, 200.0),
                ("a", Engine::Peer) => ("ok", 10.0 * r, 400.0),
                // b's peer fails every time: its rows say so and b has no ratio.
                (_, Engine::Peer) => ("FAIL:peer", 0.0, 0.0),
                _ => ("ok", 9.0 + r, 90.0),
            };
            rows.insert(c.key(), row(c, status, d, p));
        }
        let sheet = sheet_of(&plan, &rows);
        let t = &sheet.tables[0];
        assert_eq!(
            t.columns,
            [
                "cell",
                "engine",
                "ok / ran",
                "decode tok/s",
                "prefill tok/s",
                "decode kiln/peer",
                "prefill kiln/peer",
                "status"
            ]
        );
        // Decode 20, 40, 60: the geometric mean 36.34 with Student's t on the logs,
        // positive however wide; the cell's text is the Reading's, written once.
        let a = row_of(&sheet, "a@8", Some("kiln"));
        let want = Reading::of(&[20.0, 40.0, 60.0], Method::T).unwrap().text();
        assert_eq!(a[3], want);
        assert!(a[3].starts_with("36.34 [9.14, 144.5] (n=3, within a factor of"), "{}", a[3]);
        // Every ratio 2 (and 0.5): an interval of no width is flagged, never shown bare.
        assert_eq!(a[5], "2.000 [2.000, 2.000] (n=3, zero width: every value equal, no measured spread)");
        assert!(a[6].starts_with("0.500 [0.500, 0.500]"), "{}", a[6]);
        assert_eq!(a[7], "ok");
        let peer = row_of(&sheet, "a@8", Some("peer (llama.cpp b1 (abc))"));
        assert_eq!(peer[2], "3 / 3");
        assert!(peer[3].starts_with("18.17 ["), "{}", peer[3]);
        let b = row_of(&sheet, "b@8", Some("kiln"));
        assert_eq!(&b[5..7], ["", ""], "no ratio without the peer's rows");
        let bp = row_of(&sheet, "b@8", Some("peer"));
        assert_eq!((bp[2], bp[3], bp[7]), ("0 / 3", "-", "3 FAIL:peer"));
        assert!(
            sheet.markdown().contains(&format!("| a@8 | kiln | 3 / 3 | {want} |")),
            "{}",
            sheet.markdown()
        );
    }

    #[test]
    fn without_a_peer_the_summary_has_no_ratio_columns() {
        let plan = expand(&base(), 2, false);
        let rows: Map<CellKey, Row> =
            plan.cells.iter().map(|c| (c.key(), row(c, "ok", 10.0, 100.0))).collect();
        let sheet = sheet_of(&plan, &rows);
        assert_eq!(sheet.tables[0].columns, ["cell", "ok / ran", "decode tok/s", "prefill tok/s", "status"]);
        let a = row_of(&sheet, "a@8", None);
        assert!(a[2].starts_with("10.00 [10.00, 10.00] (n=2, zero width"), "{a:?}");
    }

    fn until_ci_row(rep: u32, d: f64) -> Row {
        Row {
            model: "a".into(),
            prompt_target_len: Some(8),
            status: "ok".into(),
            decode_tok_s: Some(d),
            prefill_tok_s: Some(100.0),
            repetition: rep,
            engine: "kiln".into(),
            ..Row::default()
        }
    }

    #[test]
    fn a_sequential_sweep_judges_every_interval_against_the_target() {
        let steady: Vec<Row> =
            (1..=5).map(|r| until_ci_row(r, [10.0, 10.1, 9.9, 10.0, 10.05][r as usize - 1])).collect();
        let (text, narrow) = sequential(&steady, 3.0);
        assert!(narrow, "{text}");
        assert!(text.contains("| a@8 | 5 / 5 | 10.01 ["), "{text}");
        assert!(text.contains("--until-ci 3%: every interval is under ±3% after 5 repetitions"), "{text}");
        assert!(text.contains("confidence sequence"), "{text}");
        let (text, narrow) = sequential(&steady[..3], 3.0);
        assert!(!narrow && text.contains("(n=3: no interval)"), "{text}");
        assert!(text.contains("2 of 2 intervals are not under ±3% after 3 repetitions"), "{text}");
        let noisy: Vec<Row> =
            (1..=5).map(|r| until_ci_row(r, [5.0, 15.0, 8.0, 12.0, 10.0][r as usize - 1])).collect();
        assert!(!sequential(&noisy, 3.0).1);
        assert!(!sequential(&[], 3.0).1, "no rows: nothing converged");
        // The stopping rule's line is the sheet's last note.
        let (sheet, _) = sequential_sheet(&steady, 3.0, Some("stopping rule: converged".into()));
        assert_eq!(sheet.notes.last().map(String::as_str), Some("stopping rule: converged"));
    }

    #[test]
    fn no_interval_width_past_100_percent_is_printed_as_a_percentage() {
        // The issue's `±146885.8%`: rates a thousandfold apart, n=4.
        let wild: Vec<Row> =
            (1..=4).map(|r| until_ci_row(r, [1.0, 3000.0, 2.0, 5000.0][r as usize - 1])).collect();
        for text in [sequential(&wild, 5.0).0, {
            let plan = expand(&base(), 4, false);
            let rows: Map<CellKey, Row> = plan
                .cells
                .iter()
                .map(|c| {
                    (c.key(), row(c, "ok", [1.0, 3000.0, 2.0, 5000.0][c.repetition as usize - 1], 100.0))
                })
                .collect();
            sheet_of(&plan, &rows).markdown()
        }] {
            assert!(text.contains("within a factor of"), "{text}");
            for pct in text.split('±').skip(1) {
                let v: f64 = pct.split('%').next().unwrap().parse().unwrap_or(0.0);
                assert!(v <= 100.0, "±{v}% printed: {text}");
            }
        }
    }
}
