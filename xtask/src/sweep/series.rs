//! Repetitions of a sweep's cells (`--repeat N`), interleaved across cells rather than
//! run back to back, and what the summary says about them: per cell and engine the mean,
//! standard deviation and 95% interval of each rate, and, with a peer, kiln's ratio to
//! it from the pairs of each repetition.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::classify::Status;
use super::plan::{Cell, Engine, Plan};
use super::summary::Finished;
use crate::student_t::{self, Interval};

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

/// The rates of one engine on one cell, over its repetitions.
#[derive(Default)]
struct Rates {
    /// By repetition: (decode, prefill) tok/s.
    ok: BTreeMap<u32, (f64, f64)>,
    runs: usize,
    disturbed: usize,
    version: String,
}

fn fmt_rate(v: f64) -> String {
    if v >= 100.0 { format!("{v:.0}") } else { format!("{v:.1}") }
}

/// `gmean [lo, hi] (n=N, sd X%)` over the logs, or `gmean (n=1: no interval)`; a
/// zero-width interval says so.
fn fmt_interval(i: Option<Interval>) -> String {
    match i {
        None => "-".into(),
        Some(Interval { mean, ci95: None, .. }) => format!("{} (n=1: no interval)", fmt_rate(mean)),
        Some(i @ Interval { mean, sd, n, ci95: Some((lo, hi)) }) => {
            let flag = if i.zero_width() { format!(", {}", student_t::ZERO_WIDTH) } else { String::new() };
            format!(
                "{} [{}, {}] (n={n}, sd {:.1}%{flag})",
                fmt_rate(mean),
                fmt_rate(lo),
                fmt_rate(hi),
                100.0 * (sd.exp() - 1.0)
            )
        }
    }
}

fn fmt_ratio(i: Option<Interval>) -> String {
    match i {
        None => "-".into(),
        Some(Interval { mean, ci95: None, .. }) => format!("{mean:.3}x (n=1: no interval)"),
        Some(i @ Interval { mean, ci95: Some((lo, hi)), n, .. }) => {
            let flag = if i.zero_width() { format!(", {}", student_t::ZERO_WIDTH) } else { String::new() };
            format!("{mean:.3}x [{lo:.3}, {hi:.3}] (n={n}{flag})")
        }
    }
}

/// Whether the summary has anything to add to the one-row-per-cell table.
pub fn applies(plan: &Plan) -> bool {
    plan.cells.iter().any(|c| c.repetition > 1 || c.engine == Engine::Peer)
}

/// The statistics section of the summary: per cell, each engine's decode and prefill
/// tok/s as the geometric mean with the 95% interval of the mean of their logs (a rate's
/// interval is multiplicative and never negative) over its ok repetitions (with how many
/// ran), and
/// with a peer kiln/peer for each rate, the geometric mean of the per-repetition ratios
/// with its 95% interval (paired t on the log ratios).
pub fn render(plan: &Plan, finished: &[Finished<'_>]) -> String {
    let mut by_cell: Vec<(String, BTreeMap<Engine, Rates>)> = Vec::new();
    for f in finished {
        let base = f.cell.base_label();
        let i = match by_cell.iter().position(|(b, _)| *b == base) {
            Some(i) => i,
            None => {
                by_cell.push((base, BTreeMap::new()));
                by_cell.len() - 1
            }
        };
        let rates = by_cell[i].1.entry(f.cell.engine).or_default();
        let Some(row) = f.row else { continue };
        rates.runs += 1;
        rates.disturbed += usize::from(!row.disturbed.is_empty());
        if rates.version.is_empty() {
            rates.version = row.engine_version.clone();
        }
        if row.status == Status::Ok.as_str()
            && let (Some(d), Some(p)) = (row.decode_tok_s, row.prefill_tok_s)
        {
            rates.ok.insert(f.cell.repetition, (d, p));
        }
    }
    let peer = plan.cells.iter().any(|c| c.engine == Engine::Peer);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "per cell over its repetitions: tok/s geometric mean [95% interval, from the mean of the logs] (n = ok repetitions, sd of the logs as a percentage):\n"
    );
    if peer {
        let _ = writeln!(
            s,
            "| cell | engine | ok / ran | decode tok/s | prefill tok/s | decode kiln/peer | prefill kiln/peer |"
        );
        let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|");
    } else {
        let _ = writeln!(s, "| cell | ok / ran | decode tok/s | prefill tok/s |");
        let _ = writeln!(s, "|---|---:|---:|---:|");
    }
    for (label, engines) in &by_cell {
        let label = label.replace('|', "\\|");
        for (engine, r) in engines {
            let decode: Vec<f64> = r.ok.values().map(|v| v.0).collect();
            let prefill: Vec<f64> = r.ok.values().map(|v| v.1).collect();
            let (d, p) = (
                fmt_interval(student_t::log_interval(&decode)),
                fmt_interval(student_t::log_interval(&prefill)),
            );
            let mut counts = format!("{} / {}", r.ok.len(), r.runs);
            if r.disturbed > 0 {
                counts.push_str(&format!(" ({} disturbed)", r.disturbed));
            }
            if !peer {
                let _ = writeln!(s, "| {label} | {counts} | {d} | {p} |");
                continue;
            }
            let name = match engine {
                Engine::Kiln => "kiln".to_string(),
                Engine::Peer if r.version.is_empty() => "peer".to_string(),
                Engine::Peer => format!("peer ({})", r.version.replace('|', "\\|")),
            };
            let (rd, rp) = match (engine, engines.get(&Engine::Peer)) {
                (Engine::Kiln, Some(other)) => {
                    let pairs = |k: fn(&(f64, f64)) -> f64| -> Vec<(f64, f64)> {
                        r.ok.iter().filter_map(|(rep, v)| Some((k(v), k(other.ok.get(rep)?)))).collect()
                    };
                    (
                        fmt_ratio(student_t::paired_ratio(&pairs(|v| v.0))),
                        fmt_ratio(student_t::paired_ratio(&pairs(|v| v.1))),
                    )
                }
                _ => (String::new(), String::new()),
            };
            let _ = writeln!(s, "| {label} | {name} | {counts} | {d} | {p} | {rd} | {rp} |");
        }
    }
    if peer {
        let _ = writeln!(
            s,
            "\nkiln/peer: geometric mean of the ratios of the repetitions where both ran, with a 95% interval \
             (paired t on the log ratios); above 1 kiln is faster"
        );
    }
    s
}

/// The statistics of a `--until-ci` sweep, from its rows: per cell and engine the
/// geometric mean of each rate over its ok repetitions with the confidence sequence's
/// 95% interval of the mean log rate (valid however many repetitions the run added), and
/// with a peer kiln/peer per repetition the same way. Returns the section and whether
/// every interval is bounded and narrower than `target_pct`.
pub fn sequential(rows: &[super::rows::Row], target_pct: f64) -> (String, bool) {
    use crate::verdict::sequence;
    // Per (model, prompt length), per engine (peer or not), per repetition: the rates.
    type Reps = BTreeMap<u32, (f64, f64)>;
    let mut by: BTreeMap<(String, Option<u64>), BTreeMap<bool, Reps>> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.status == Status::Ok.as_str()) {
        let (Some(d), Some(p)) = (r.decode_tok_s, r.prefill_tok_s) else { continue };
        let peer = r.engine != "kiln" && !r.engine.is_empty();
        by.entry((r.model.clone(), r.prompt_target_len))
            .or_default()
            .entry(peer)
            .or_default()
            .insert(r.repetition, (d, p));
    }
    let mut narrow = !by.is_empty();
    let show = |i: Option<Interval>, narrow: &mut bool| -> String {
        let Some(i) = i else {
            *narrow = false;
            return "-".into();
        };
        match i.ci95 {
            Some(ci) => {
                let h = sequence::half_width_pct(i.mean, ci);
                *narrow &= h < target_pct;
                format!("{} [{}, {}] (n={}, ±{h:.1}%)", fmt_rate(i.mean), fmt_rate(ci.0), fmt_rate(ci.1), i.n)
            }
            None => {
                *narrow = false;
                format!("{} (n={}: not bounded yet, it needs 4)", fmt_rate(i.mean), i.n)
            }
        }
    };
    let log_seq = |v: Vec<f64>| -> Option<Interval> {
        let logs: Vec<f64> = v.iter().filter(|x| **x > 0.0).map(|x| x.ln()).collect();
        let i = sequence::interval(&logs)?;
        Some(Interval { mean: i.mean.exp(), ci95: i.ci95.map(|(lo, hi)| (lo.exp(), hi.exp())), ..i })
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "--until-ci {target_pct}%: per cell, tok/s geometric mean [95% interval from the confidence sequence on the logs, valid however many repetitions ran] (n, half-width):\n"
    );
    let _ = writeln!(
        s,
        "| cell | engine | decode tok/s | prefill tok/s | decode kiln/peer | prefill kiln/peer |"
    );
    let _ = writeln!(s, "|---|---|---:|---:|---:|---:|");
    for ((model, len), engines) in &by {
        let cell = format!("{}@{}", model.replace('|', "\\|"), len.map_or("text".into(), |l| l.to_string()));
        for (peer, reps) in engines {
            let d = show(log_seq(reps.values().map(|v| v.0).collect()), &mut narrow);
            let p = show(log_seq(reps.values().map(|v| v.1).collect()), &mut narrow);
            let (rd, rp) = match (peer, engines.get(&true)) {
                (false, Some(other)) => {
                    let pairs = |k: fn(&(f64, f64)) -> f64| -> Vec<(f64, f64)> {
                        reps.iter().filter_map(|(rep, v)| Some((k(v), k(other.get(rep)?)))).collect()
                    };
                    (
                        show(sequence::paired_ratio(&pairs(|v| v.0)), &mut narrow),
                        show(sequence::paired_ratio(&pairs(|v| v.1)), &mut narrow),
                    )
                }
                _ => (String::new(), String::new()),
            };
            let engine = if *peer { "peer" } else { "kiln" };
            let _ = writeln!(s, "| {cell} | {engine} | {d} | {p} | {rd} | {rp} |");
        }
    }
    (s, narrow)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap as Map;

    use super::super::plan::{CellKey, CellTemplate, Named, Prompt};
    use super::super::rows::Row;
    use super::super::summary;
    use super::*;

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
        assert!(
            !applies(&base()) && applies(&expand(&base(), 2, false)) && applies(&expand(&base(), 1, true))
        );
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

    #[test]
    fn the_summary_gives_intervals_per_cell_and_paired_ratios() {
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
        let text = render(&plan, &summary::pair(&plan, &rows));
        // Decode 20, 40, 60: geometric mean 36.3, interval exp(mean ± 4.303 sd / sqrt 3)
        // of the logs, positive however wide.
        assert!(text.contains("| a@8 | kiln | 3 / 3 | 36.3 [9.1, 144] (n=3, sd 74.3%) |"), "{text}");
        // Every ratio 2 (and 0.5): an interval of no width is flagged, never shown bare.
        assert!(
            text.contains(
                "| 2.000x [2.000, 2.000] (n=3, zero width: every value equal, no measured spread) | 0.500x [0.500, 0.500] (n=3, zero width"
            ),
            "{text}"
        );
        assert!(text.contains("| a@8 | peer (llama.cpp b1 (abc)) | 3 / 3 | 18.2 [4.6, 72.2] (n=3"), "{text}");
        assert!(
            text.contains(
                "| b@8 | kiln | 3 / 3 | 11.0 [8.7, 13.8] (n=3, sd 9.5%) | 90.0 [90.0, 90.0] (n=3, sd 0.0%, zero width: every value equal, no measured spread) | - | - |"
            ),
            "{text}"
        );
        assert!(text.contains("| b@8 | peer (llama.cpp b1 (abc)) | 0 / 3 | - | - |"), "{text}");
    }

    #[test]
    fn without_a_peer_the_summary_has_no_ratio_columns() {
        let plan = expand(&base(), 2, false);
        let rows: Map<CellKey, Row> =
            plan.cells.iter().map(|c| (c.key(), row(c, "ok", 10.0, 100.0))).collect();
        let text = render(&plan, &summary::pair(&plan, &rows));
        assert!(text.contains("| cell | ok / ran | decode tok/s | prefill tok/s |"), "{text}");
        assert!(text.contains("| a@8 | 2 / 2 | 10.0 [10.0, 10.0] (n=2, sd 0.0%, zero width"), "{text}");
        assert!(text.contains("| 100 [100, 100] (n=2, sd 0.0%, zero width"), "{text}");
    }

    #[test]
    fn a_sequential_sweep_judges_every_interval_against_the_target() {
        let mk = |rep: u32, d: f64| Row {
            model: "a".into(),
            prompt_target_len: Some(8),
            status: "ok".into(),
            decode_tok_s: Some(d),
            prefill_tok_s: Some(100.0),
            repetition: rep,
            engine: "kiln".into(),
            ..Row::default()
        };
        let steady: Vec<Row> =
            (1..=5).map(|r| mk(r, [10.0, 10.1, 9.9, 10.0, 10.05][r as usize - 1])).collect();
        let (text, narrow) = sequential(&steady, 3.0);
        assert!(narrow, "{text}");
        assert!(text.contains("| a@8 | kiln | 10.0 ["), "{text}");
        assert!(text.contains("(n=5, ±"), "{text}");
        let (text, narrow) = sequential(&steady[..3], 3.0);
        assert!(!narrow && text.contains("(n=3: not bounded yet, it needs 4)"), "{text}");
        let noisy: Vec<Row> = (1..=5).map(|r| mk(r, [5.0, 15.0, 8.0, 12.0, 10.0][r as usize - 1])).collect();
        assert!(!sequential(&noisy, 3.0).1);
        assert!(!sequential(&[], 3.0).1, "no rows: nothing converged");
    }
}
