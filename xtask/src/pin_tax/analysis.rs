//! From the passes to the result: per cell and metric the ratio of the two arms
//! (narrow/wide in the sweep, B/A in the mixed mode, A2/A1 in an A/A run: a [`Design`])
//! as one [`Reading`] of its ABBA pairs, judged at the margin ([`Judged`]); each arm's
//! spread against the trust limit, disturbed pairs, the contamination rule, and the
//! [`Sheet`] every page prints: headline, tables and notes, each text written once here.

use std::collections::{BTreeMap, BTreeSet};

use super::arms::{AaEnv, Arm, Order};
use super::records::{Better, BootRecord, CellDef, NoiseFloor, PassRecord};
use super::stats;
use crate::verdict::reading::{self, Judged, Method, Reading, Verdict};
use crate::verdict::sheet::{Cell, Sheet, Table};

/// What a run compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The sweep: the pinned arm (narrow) against wide.
    Sweep,
    /// The mixed mode: B against A, whose classic streams are the bystanders.
    Mixed,
    /// An A/A run: two slots running one environment, whose true ratio is 1.
    Aa,
}

/// The metric of the mixed mode whose streams are the bystanders of the speculative one.
pub const BYSTANDERS: &str = "classic tok/s per stream";

/// Which arms a mode compares, and which way round.
#[derive(Clone, Copy, Debug)]
pub struct Design {
    /// The ratio's numerator arm.
    pub num: Arm,
    /// Its denominator arm.
    pub den: Arm,
    /// Whether the numerator is the arm that carries the pin (the sweep's narrow arm, an
    /// A/A run's A2), so a cost is the numerator's; else the denominator's (the mixed
    /// mode's A).
    pub num_pinned: bool,
    /// What is compared.
    pub kind: Kind,
    /// The environment both slots run in this design's A/A run ([`Design::aa`]).
    pub aa_env: AaEnv,
}

impl Design {
    /// The sweep: narrow/wide.
    pub const SWEEP: Design =
        Design { num: Arm::Narrow, den: Arm::Wide, num_pinned: true, kind: Kind::Sweep, aa_env: AaEnv::Wide };
    /// The mixed mode: B/A, the cost carried by A's bystanders.
    pub const MIXED: Design =
        Design { num: Arm::B, den: Arm::A, num_pinned: false, kind: Kind::Mixed, aa_env: AaEnv::A };

    /// This design's A/A run: both slots run [`Design::aa_env`], named `A1` (the
    /// denominator's slot, which the default orders open with) and `A2`; the ratio is
    /// A2/A1, whose true value is 1.
    pub fn aa(self) -> Design {
        Design {
            num: Arm::A2(self.aa_env),
            den: Arm::A1(self.aa_env),
            num_pinned: true,
            kind: Kind::Aa,
            aa_env: self.aa_env,
        }
    }

    /// `narrow/wide`, `B/A`, `A2/A1`.
    pub fn ratio_name(&self) -> String {
        format!("{}/{}", self.num.as_str(), self.den.as_str())
    }

    /// What the run is, for a title: never a pin or a tax for an A/A run.
    pub fn title(&self) -> String {
        match self.kind {
            Kind::Sweep => "qmv_wide pin, narrow/wide".into(),
            Kind::Mixed => "qmv_wide pin beside a speculative stream, B/A".into(),
            Kind::Aa => format!(
                "A/A noise floor, A2/A1 (both slots run {}): the difference between identical arms",
                self.aa_env.arm().as_str()
            ),
        }
    }

    /// What a row at `metric` means when `worse` is worse beyond the margin `m`.
    fn worse_text(&self, metric: &str, worse: Arm, m: f64) -> String {
        match self.kind {
            Kind::Aa => format!("a false positive: identical arms differ by more than {m}%"),
            Kind::Sweep if worse == self.num => format!("the pin costs more than {m}%"),
            Kind::Sweep => format!("the pin gains more than {m}%"),
            Kind::Mixed if metric == BYSTANDERS && worse == Arm::A => {
                format!("bystander cost: A's classic streams are slower by more than {m}%")
            }
            Kind::Mixed if metric == BYSTANDERS => {
                format!("no bystander cost: A's classic streams are faster by more than {m}%")
            }
            Kind::Mixed => {
                format!("the speculative stream itself: {} is worse by more than {m}%", worse.as_str())
            }
        }
    }

    /// What a row at `metric` means when both arms are the same within the margin `m`.
    fn same_text(&self, metric: &str, m: f64) -> String {
        match self.kind {
            Kind::Aa => format!("the identical arms agree within ±{m}%"),
            Kind::Sweep => format!("no pin cost beyond ±{m}%"),
            Kind::Mixed if metric == BYSTANDERS => format!("no bystander cost beyond ±{m}%"),
            Kind::Mixed => format!("the speculative stream itself: A and B the same within ±{m}%"),
        }
    }

    /// `ratio` (num/den of a metric that improves `better`) turned so that above 1 is
    /// always the pinned arm's (or A2's) cost: a time as pinned/other, a rate as
    /// other/pinned.
    pub fn cost_ratio(&self, better: Better, ratio: &Reading) -> Reading {
        let pinned_over_other = self.num_pinned;
        let higher_is_better = better == Better::Higher;
        if pinned_over_other != higher_is_better { ratio.clone() } else { invert(ratio) }
    }

    /// The arms of a cost ratio at `better`: (numerator, denominator).
    pub fn cost_arms(&self, better: Better) -> (Arm, Arm) {
        let (pinned, other) = if self.num_pinned { (self.num, self.den) } else { (self.den, self.num) };
        match better {
            Better::Lower => (pinned, other),
            Better::Higher => (other, pinned),
        }
    }
}

/// The reading of `1 / x`.
fn invert(r: &Reading) -> Reading {
    Reading {
        estimate: 1.0 / r.estimate,
        interval: r.interval.map(|(lo, hi)| (1.0 / hi, 1.0 / lo)),
        ..r.clone()
    }
}

/// One line of the result: a cell and a metric.
#[derive(Clone, Debug)]
pub struct TaxRow {
    /// The cell.
    pub cell: String,
    /// The metric.
    pub metric: String,
    /// Which way it improves.
    pub better: Better,
    /// Measured passes that count, numerator arm.
    pub num_n: usize,
    /// Same, denominator arm.
    pub den_n: usize,
    /// The numerator arm's counted passes.
    pub num: Option<Reading>,
    /// The denominator arm's.
    pub den: Option<Reading>,
    /// num/den over the ABBA pairs, judged at the margin.
    pub judged: Option<Judged>,
    /// Spread of each arm's passes, percent.
    pub spread_num: Option<f64>,
    /// Same, denominator.
    pub spread_den: Option<f64>,
    /// Outputs differed: reported, never averaged in.
    pub contaminated: bool,
    /// Why the row's verdict is not one to act on: an arm's spread over the trust
    /// limit, disturbed pairs, an interval of no width.
    pub caveats: Vec<String>,
    /// What the row means, in words (its caveats first).
    pub verdict: String,
    /// The ABBA pairs: (numerator boot, denominator boot) means.
    pub pairs: Vec<(f64, f64)>,
}

impl TaxRow {
    /// The ratio num/den, when there is one.
    pub fn ratio(&self) -> Option<&Reading> {
        self.judged.as_ref().map(|j| &j.reading)
    }

    /// Whether the row counts towards a result: not contaminated, with a ratio.
    pub fn reported(&self) -> bool {
        !self.contaminated && self.judged.is_some()
    }
}

/// The contamination rule: kiln's kernels are bit-identical across the switch, so a
/// request (same key: same cell, pass and index) must produce the same text in every boot
/// of both arms. Returns, per cell, the keys whose completed outputs differ.
pub fn contaminated(passes: &[PassRecord]) -> BTreeMap<String, Vec<String>> {
    let mut seen: BTreeMap<(String, String), BTreeSet<(Arm, String)>> = BTreeMap::new();
    for p in passes {
        for c in &p.cells {
            for (k, h) in &c.hashes {
                seen.entry((c.cell.clone(), k.clone())).or_default().insert((p.arm, h.clone()));
            }
        }
    }
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for ((cell, key), hs) in seen {
        let distinct: BTreeSet<&String> = hs.iter().map(|(_, h)| h).collect();
        if distinct.len() > 1 {
            out.entry(cell).or_default().push(key);
        }
    }
    out
}

/// How rows are judged.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Judge {
    /// An arm's spread trusted up to this percentage.
    pub trust_pct: f64,
    /// `--margin`: the verdict's margin; [`reading::DEFAULT_MARGIN_PCT`] without one.
    pub margin_pct: Option<f64>,
    /// `--until-ci`: intervals from the confidence sequence (valid at any stopping time)
    /// instead of the fixed-n t interval.
    pub sequential: bool,
}

impl Judge {
    /// The margin every ratio is judged at, percent.
    pub fn margin(&self) -> f64 {
        self.margin_pct.unwrap_or(reading::DEFAULT_MARGIN_PCT)
    }

    /// How the intervals were taken.
    pub fn method(&self) -> Method {
        if self.sequential { Method::Sequence } else { Method::T }
    }
}

/// The rows with fixed-n intervals and the default margin.
#[cfg(test)]
pub fn analyse(
    cells: &[CellDef],
    order: &Order,
    passes: &[PassRecord],
    trust_pct: f64,
    design: Design,
) -> Vec<TaxRow> {
    analyse_with(cells, order, passes, &Judge { trust_pct, margin_pct: None, sequential: false }, design)
}

/// The rows: one per cell and metric.
pub fn analyse_with(
    cells: &[CellDef],
    order: &Order,
    passes: &[PassRecord],
    judge: &Judge,
    design: Design,
) -> Vec<TaxRow> {
    let dirty = contaminated(passes);
    let mut rows = Vec::new();
    for cell in cells {
        for m in &cell.metrics {
            // Per-pass values of measured passes that count.
            let value = |p: &PassRecord| -> Option<f64> {
                if !p.ok || p.invalid.is_some() || p.pass == 0 {
                    return None;
                }
                // A cell with a failed request fails itself, not its pass.
                let c = p.cells.iter().find(|c| c.cell == cell.name)?;
                if c.failed > 0 {
                    return None;
                }
                c.metrics.get(m.name).copied()
            };
            let arm_values = |arm: Arm| -> (Vec<f64>, usize) {
                let counted: Vec<(&PassRecord, f64)> =
                    passes.iter().filter(|p| p.arm == arm).filter_map(|p| Some((p, value(p)?))).collect();
                let disturbed = counted.iter().filter(|(p, _)| p.disturbed.is_some()).count();
                (counted.into_iter().map(|(_, v)| v).collect(), disturbed)
            };
            let ((nv, nd), (wv, wd)) = (arm_values(design.num), arm_values(design.den));
            // Each boot's value per pass number, and whether it was disturbed; a pair
            // compares its two boots over the pass numbers that count in both, so a pass
            // lost in one boot drops its partner too (the same pass of every boot sends
            // the same requests).
            let by_pass = |boot: usize| -> BTreeMap<usize, (f64, bool)> {
                passes
                    .iter()
                    .filter(|p| p.boot == boot + 1)
                    .filter_map(|p| Some((p.pass, (value(p)?, p.disturbed.is_some()))))
                    .collect()
            };
            let pairs: Vec<(f64, f64, bool)> = order
                .pairs_of(design.num, design.den)
                .into_iter()
                .filter_map(|(n, w)| {
                    let (n, w) = (by_pass(n), by_pass(w));
                    let both: Vec<usize> = n.keys().filter(|k| w.contains_key(k)).copied().collect();
                    let mean = |m: &BTreeMap<usize, (f64, bool)>| {
                        both.iter().map(|k| m[k].0).sum::<f64>() / both.len() as f64
                    };
                    let disturbed = both.iter().any(|k| n[k].1 || w[k].1);
                    (!both.is_empty()).then(|| (mean(&n), mean(&w), disturbed))
                })
                .filter(|(n, w, _)| *n > 0.0 && *w > 0.0)
                .collect();
            let disturbed_pairs = pairs.iter().filter(|p| p.2).count();
            let pairs: Vec<(f64, f64)> = pairs.into_iter().map(|(n, w, _)| (n, w)).collect();
            let judged = stats::ratio(&pairs, judge.sequential)
                .map(|r| r.disturbed(disturbed_pairs).judge(m.better, judge.margin()));
            let arm = |v: &[f64], d: usize| Reading::of(v, Method::T).map(|r| r.disturbed(d));
            let mut row = TaxRow {
                cell: cell.name.clone(),
                metric: m.name.to_string(),
                better: m.better,
                num_n: nv.len(),
                den_n: wv.len(),
                num: arm(&nv, nd),
                den: arm(&wv, wd),
                judged,
                spread_num: stats::spread_pct(&nv),
                spread_den: stats::spread_pct(&wv),
                contaminated: dirty.contains_key(&cell.name),
                caveats: Vec::new(),
                verdict: String::new(),
                pairs,
            };
            row.caveats = caveats(&row, judge.trust_pct, design);
            row.verdict = verdict(&row, judge, design);
            rows.push(row);
        }
    }
    rows
}

/// Why a row's verdict is not one to act on.
fn caveats(r: &TaxRow, trust_pct: f64, design: Design) -> Vec<String> {
    let mut out: Vec<String> = [(design.num.as_str(), r.spread_num), (design.den.as_str(), r.spread_den)]
        .iter()
        .filter_map(|(a, s)| {
            s.filter(|s| *s > trust_pct).map(|s| format!("{a} spread {s:.1}% over the {trust_pct}% limit"))
        })
        .collect();
    if let Some(x) = r.ratio() {
        if x.disturbed > 0 {
            out.push(format!("{} of {} pairs disturbed", x.disturbed, x.n));
        }
        if x.zero_width() {
            out.push("zero-width interval: every pair's ratio equal, no measured spread".into());
        }
    }
    out
}

/// What a row means, in words: its caveats, then what its verdict says of the arms.
fn verdict(r: &TaxRow, judge: &Judge, design: Design) -> String {
    if r.contaminated {
        return "contaminated: outputs differ across arms; excluded".into();
    }
    let Some(j) = &r.judged else {
        return no_pair(r, design);
    };
    let m = judge.margin();
    let meaning = match &j.verdict {
        Verdict::Same => design.same_text(&r.metric, m),
        Verdict::Regressed => design.worse_text(&r.metric, design.num, m),
        Verdict::Improved => design.worse_text(&r.metric, design.den, m),
        Verdict::Undecided { .. } => "no verdict yet".into(),
        Verdict::NoInterval if j.reading.n >= 2 => {
            "no verdict yet: the sequential interval is not bounded yet (it needs 4 pairs)".into()
        }
        Verdict::NoInterval => "no verdict: one pair gives no interval".into(),
    };
    if r.caveats.is_empty() { meaning } else { format!("untrusted ({}): {meaning}", r.caveats.join("; ")) }
}

/// Why a row has no ratio: an arm without a counted measurement, or (each arm has some)
/// no ABBA pair whose two boots both counted the same pass or window.
fn no_pair(r: &TaxRow, design: Design) -> String {
    let (num, den) = (design.num.as_str(), design.den.as_str());
    match (r.num_n, r.den_n) {
        (0, 0) => "no counted measurement in either arm".into(),
        (0, _) => format!("no counted measurement in arm {num} ({den} has n={})", r.den_n),
        (_, 0) => format!("no counted measurement in arm {den} ({num} has n={})", r.num_n),
        (a, b) => format!(
            "no ABBA pair: {num} has n={a} and {den} n={b} counted, but never in the same pass or window of both boots of a pair (each is compared only with its own pass or window in its partner)"
        ),
    }
}

fn pct(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.1}%"))
}

/// The table of rows: each arm's reading, the judged ratio, the spreads and what the row
/// means. `secs_per_pair` turns an undecided verdict's pairs into time.
pub fn table(
    rows: &[TaxRow],
    design: Design,
    judge: &Judge,
    unit: &str,
    secs_per_pair: Option<f64>,
) -> Table {
    let (n, d) = (design.num.as_str(), design.den.as_str());
    let units = plural(unit);
    let m = judge.margin();
    let reading = |r: &Option<Reading>| r.clone().map_or_else(|| Cell::text("-"), Cell::reading);
    Table {
        title: format!("{} per cell and metric", design.ratio_name()),
        legend: format!(
            "{n} and {d}: the geometric mean of the arm's counted {units} (95% interval, n {units}); {n}/{d}: the geometric mean of the ABBA pairs' ratios, {}, judged at ±{m}% (same: the whole interval within the margin; regressed or improved: {n} worse or better than {d} beyond it; undecided: neither yet); spread = (max - min) / mean of an arm's counted {units}, trusted up to {}%",
            judge.method().describe(),
            judge.trust_pct
        ),
        columns: [
            "cell",
            "metric",
            n,
            d,
            &design.ratio_name(),
            &format!("spread {n}"),
            &format!("spread {d}"),
            "reading",
        ]
        .iter()
        .map(|c| c.to_string())
        .collect(),
        rows: rows
            .iter()
            .map(|r| {
                let ratio = match (&r.judged, r.contaminated) {
                    (_, true) => Cell::text("excluded"),
                    (Some(j), false) => Cell::judged(j.clone(), "pairs", secs_per_pair),
                    (None, false) => Cell::text("-"),
                };
                vec![
                    Cell::text(r.cell.clone()),
                    Cell::text(r.metric.clone()),
                    reading(&r.num),
                    reading(&r.den),
                    ratio,
                    Cell::text(pct(r.spread_num)),
                    Cell::text(pct(r.spread_den)),
                    Cell::text(r.verdict.clone()),
                ]
            })
            .collect(),
    }
}

/// Why a run's rows give no verdict to act on: rows with caveats, and an A/A false-positive
/// rate above the nominal 5% (`aa_fp_pct`, from the A/A run the result cites).
pub fn run_caveats(rows: &[&TaxRow], aa_fp_pct: Option<f64>) -> Vec<String> {
    let mut out = Vec::new();
    let untrusted = rows.iter().filter(|r| !r.caveats.is_empty()).count();
    if untrusted > 0 {
        let all = if untrusted == rows.len() {
            "every one".to_string()
        } else {
            format!("{untrusted} of {}", rows.len())
        };
        out.push(format!(
            "{all} of its rows untrusted (spread over the limit, disturbed pairs or no measured spread)"
        ));
    }
    if let Some(fp) = aa_fp_pct.filter(|fp| *fp > 5.0) {
        out.push(format!("the A/A run it cites shows a {fp:.0}% false-positive rate (nominal 5%)"));
    }
    out
}

/// The one-line answer: what the rows say of the arms, or why they say nothing to act on.
/// `aa` is the run's own noise floor (an A/A run) or the one it cites.
pub fn headline(rows: &[TaxRow], design: Design, judge: &Judge, aa: Option<&NoiseFloor>) -> String {
    let reported: Vec<&TaxRow> = rows.iter().filter(|r| r.reported()).collect();
    let m = judge.margin();
    let title = design.title();
    if reported.is_empty() {
        return format!("{title}: no row has a ratio, so there is no verdict");
    }
    let count = |f: &dyn Fn(&Verdict) -> bool| -> Vec<&TaxRow> {
        reported.iter().copied().filter(|r| r.judged.as_ref().is_some_and(|j| f(&j.verdict))).collect()
    };
    let num_worse = count(&|v| *v == Verdict::Regressed);
    let den_worse = count(&|v| *v == Verdict::Improved);
    let same = count(&|v| *v == Verdict::Same).len();
    let open = reported.len() - num_worse.len() - den_worse.len() - same;
    let names = |rs: &[&TaxRow]| -> String {
        // At most four named: the table names every row.
        let mut named: Vec<String> = rs.iter().take(4).map(|r| format!("{} {}", r.cell, r.metric)).collect();
        if rs.len() > 4 {
            named.push(format!("{} more", rs.len() - 4));
        }
        if named.is_empty() { String::new() } else { format!(" ({})", named.join(", ")) }
    };
    let n = reported.len();
    let (num, den) = (design.num.as_str(), design.den.as_str());
    let as_measured = format!(
        "{num} is worse than {den} by more than {m}% in {} of {n} rows{}, better in {}{}, the same within ±{m}% in {same}, undecided in {open}",
        num_worse.len(),
        names(&num_worse),
        den_worse.len(),
        names(&den_worse)
    );
    if design.kind == Kind::Aa {
        let (fp, cells) = aa.map_or((0, 0), |f| {
            f.metrics.values().fold((0, 0), |a, x| (a.0 + x.false_positives, a.1 + x.cells))
        });
        let widest =
            reported.iter().filter_map(|r| r.ratio()).filter(|r| r.interval.is_some()).max_by(|a, b| {
                a.half_width_pct().unwrap_or(0.0).total_cmp(&b.half_width_pct().unwrap_or(0.0))
            });
        return format!(
            "{title}: {fp} of {cells} intervals exclude 1 (false-positive rate {}, nominal 5%); {as_measured}{}",
            if cells > 0 { format!("{:.0}%", 100.0 * fp as f64 / cells as f64) } else { "unknown".into() },
            widest.map_or(String::new(), |w| format!("; the widest interval is {}", w.width()))
        );
    }
    let caveats = run_caveats(&reported, aa.and_then(|f| f.false_positive_pct()));
    if !caveats.is_empty() {
        return format!("{title}: no verdict to act on: {}; as measured, {as_measured}", caveats.join("; "));
    }
    match design.kind {
        Kind::Mixed => {
            let by = reported.iter().find(|r| r.metric == BYSTANDERS);
            format!(
                "{title}: {}; in all, {as_measured}",
                by.map_or("the classic streams have no ratio".to_string(), |r| format!(
                    "{} {}",
                    r.metric, r.verdict
                ))
            )
        }
        _ => format!(
            "{title}: the pin costs more than {m}% in {} of {n} rows{}, gains more than {m}% in {}{}, no cost beyond ±{m}% in {same}, undecided in {open}",
            num_worse.len(),
            names(&num_worse),
            den_worse.len(),
            names(&den_worse)
        ),
    }
}

/// Everything the summary says beyond the table: failed, disturbed and contaminated.
pub struct Findings {
    /// `boot N (arm) pass P: reason`.
    pub failed: Vec<String>,
    /// `boot N (arm) pass P, cell: reason`: cells that failed in a pass that counts.
    pub failed_cells: Vec<String>,
    /// `boot N (arm) pass P: why`.
    pub disturbed: Vec<String>,
    /// `boot N (arm) pass P: why`: completed but not counted.
    pub invalid: Vec<String>,
    /// Cell -> differing keys.
    pub contaminated: BTreeMap<String, Vec<String>>,
}

/// Collects the findings.
pub fn findings(passes: &[PassRecord], unit: &str) -> Findings {
    let label = |p: &PassRecord| {
        let what = if p.pass == 0 { "warm-up".to_string() } else { format!("{unit} {}", p.pass) };
        format!("boot {} ({}) {what}", p.boot, p.arm.as_str())
    };
    Findings {
        failed: passes
            .iter()
            .filter(|p| !p.ok)
            .map(|p| format!("{}: {}", label(p), p.reason.clone().unwrap_or_default()))
            .collect(),
        failed_cells: passes
            .iter()
            .filter(|p| p.ok)
            .flat_map(|p| {
                super::records::cell_failures(&p.cells).into_iter().map(move |f| format!("{}, {f}", label(p)))
            })
            .collect(),
        disturbed: passes
            .iter()
            .filter_map(|p| p.disturbed.as_ref().map(|d| format!("{}: {d}", label(p))))
            .collect(),
        invalid: passes
            .iter()
            .filter(|p| p.ok)
            .filter_map(|p| p.invalid.as_ref().map(|d| format!("{}: {d}", label(p))))
            .collect(),
        contaminated: contaminated(passes),
    }
}

/// The summary's notes after its tables: failed boots and passes, failed cells, invalid
/// and disturbed passes, contaminated cells and the boots' timings, one line each.
pub fn notes(fnd: &Findings, boots: &[BootRecord], unit: &str) -> Vec<String> {
    let mut s = Vec::new();
    let failed_boots: Vec<String> = boots
        .iter()
        .filter_map(|b| b.failure.as_ref().map(|f| format!("boot {} ({}): {f}", b.boot, b.arm.as_str())))
        .collect();
    let mut list = |title: &str, items: &[String]| {
        s.push(format!("{title}: {}", items.len()));
        s.extend(items.iter().map(|i| format!("- {i}")));
    };
    list("failed boots", &failed_boots);
    let units = plural(unit);
    list(&format!("failed {units}"), &fnd.failed);
    if !fnd.failed_cells.is_empty() {
        list(&format!("failed cells (their {units} count for the other cells)"), &fnd.failed_cells);
    }
    if unit != "pass" {
        list(&format!("invalid {units} (completed, not counted)"), &fnd.invalid);
    }
    list(&format!("disturbed {units} (measured while other processes were busy)"), &fnd.disturbed);
    let dirty: Vec<String> = fnd
        .contaminated
        .iter()
        .map(|(c, keys)| format!("{c}: {} request(s) differ, e.g. {}", keys.len(), keys[0]))
        .collect();
    list("contaminated cells (reported, excluded from every verdict)", &dirty);
    if let Some(t) = boot_timings(boots) {
        s.push(t);
    }
    s
}

/// The summary's sheet before the driver's own notes: headline, the rows' table, and the
/// findings.
pub struct SheetInput<'a> {
    /// The rows.
    pub rows: &'a [TaxRow],
    /// What they compare.
    pub design: Design,
    /// How they were judged.
    pub judge: &'a Judge,
    /// `pass` or `window`.
    pub unit: &'a str,
    /// Seconds one more pair of boots takes, for the undecided verdicts' budgets.
    pub secs_per_pair: Option<f64>,
    /// The run's own noise floor (an A/A run) or the one it cites.
    pub aa: Option<&'a NoiseFloor>,
}

/// The sheet of a run: headline and the rows' table (the driver adds the fit, the
/// noise floor and its notes).
pub fn sheet(i: &SheetInput) -> Sheet {
    Sheet {
        task: "qmv-pin-tax".into(),
        headline: headline(i.rows, i.design, i.judge, i.aa),
        tables: vec![table(i.rows, i.design, i.judge, i.unit, i.secs_per_pair)],
        notes: Vec::new(),
        roofline: None,
    }
}

/// `passes`, `windows`.
pub fn plural(unit: &str) -> String {
    if unit.ends_with('s') { format!("{unit}es") } else { format!("{unit}s") }
}

/// Mean per-boot timings: what the driver adds around the server's own start-up.
pub fn boot_timings(boots: &[BootRecord]) -> Option<String> {
    if boots.is_empty() {
        return None;
    }
    let n = boots.len() as f64;
    let mean = |f: &dyn Fn(&BootRecord) -> f64| boots.iter().map(f).sum::<f64>() / n;
    let ready: Vec<f64> = boots.iter().filter_map(|b| b.ready_after_s).collect();
    Some(format!(
        "per boot (mean of {}): port preflight and spawn {:.3} s; spawn to ready {} (the server's start-up plus at most 50 ms of polling); stop {:.3} s; quiet check {:.2} s",
        boots.len(),
        mean(&|b| b.preflight_s),
        if ready.is_empty() {
            "-".to_string()
        } else {
            format!("{:.2} s", ready.iter().sum::<f64>() / ready.len() as f64)
        },
        mean(&|b| b.stop_s),
        mean(&|b| b.quiet_check_s)
    ))
}

#[cfg(test)]
mod tests {
    use super::super::arms::order_arg;
    use super::super::records::{CellMeasure, MetricDef};
    use super::*;

    fn pass(boot: usize, arm: Arm, n: usize, tok_s: f64, hash: &str) -> PassRecord {
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
                cell: "decode B=2".into(),
                requests: 2,
                failed: 0,
                first_error: None,
                metrics: [("output tok/s".to_string(), tok_s)].into(),
                hashes: [(format!("decode B=2/p{n}/0"), hash.to_string())].into(),
                prompt_tokens: None,
                cached_tokens: None,
                invalid: None,
                detail: None,
            }],
        }
    }

    fn cells() -> Vec<CellDef> {
        vec![CellDef {
            name: "decode B=2".into(),
            metrics: vec![MetricDef { name: "output tok/s", better: Better::Higher }],
        }]
    }

    #[test]
    fn a_cell_whose_outputs_differ_across_arms_is_contaminated_and_excluded() {
        let order = order_arg("1 0").unwrap();
        let same = vec![pass(1, Arm::Wide, 1, 100.0, "aa"), pass(2, Arm::Narrow, 1, 90.0, "aa")];
        assert!(contaminated(&same).is_empty());
        let rows = analyse(&cells(), &order, &same, 4.0, Design::SWEEP);
        assert!(!rows[0].contaminated);
        // One pair gives a point estimate, never a verdict: the row says so.
        assert_eq!(rows[0].verdict, "no verdict: one pair gives no interval");
        assert_eq!(rows[0].judged.as_ref().unwrap().verdict, Verdict::NoInterval);
        let differ = vec![pass(1, Arm::Wide, 1, 100.0, "aa"), pass(2, Arm::Narrow, 1, 90.0, "bb")];
        assert_eq!(contaminated(&differ)["decode B=2"], vec!["decode B=2/p1/0".to_string()]);
        let rows = analyse(&cells(), &order, &differ, 4.0, Design::SWEEP);
        assert!(rows[0].contaminated);
        assert_eq!(rows[0].verdict, "contaminated: outputs differ across arms; excluded");
    }

    #[test]
    fn warm_up_and_failed_passes_never_count_and_pairs_give_an_interval() {
        let order = order_arg("1 0 0 1").unwrap();
        let mut ps = vec![
            pass(1, Arm::Wide, 0, 1.0, "a"),
            pass(1, Arm::Wide, 1, 100.0, "a"),
            pass(2, Arm::Narrow, 1, 90.0, "a"),
            pass(3, Arm::Narrow, 1, 91.0, "a"),
            pass(4, Arm::Wide, 1, 101.0, "a"),
        ];
        let mut bad = pass(4, Arm::Wide, 1, 5.0, "a");
        bad.ok = false;
        ps.push(bad);
        let rows = analyse(&cells(), &order, &ps, 4.0, Design::SWEEP);
        let r = &rows[0];
        assert_eq!((r.num_n, r.den_n), (2, 2));
        let ratio = r.ratio().unwrap();
        assert_eq!(ratio.n, 2);
        assert!((ratio.estimate - (0.9f64 * (91.0 / 101.0)).sqrt()).abs() < 1e-12);
        let (lo, hi) = ratio.interval.unwrap();
        assert!(lo < ratio.estimate && ratio.estimate < hi && hi < 1.0, "{lo} {hi}");
        // Throughput 0.9x, the whole interval below 1 / 1.05: regressed, the pin's cost.
        assert_eq!(r.judged.as_ref().unwrap().verdict, Verdict::Regressed);
        assert_eq!(r.verdict, "the pin costs more than 5%");
        // Its cost ratio: a rate as wide/narrow, above 1.
        let c = Design::SWEEP.cost_ratio(Better::Higher, ratio);
        assert!((c.estimate * ratio.estimate - 1.0).abs() < 1e-12 && c.interval.unwrap().0 > 1.0);
        assert_eq!(Design::SWEEP.cost_arms(Better::Higher), (Arm::Wide, Arm::Narrow));
        assert_eq!(Design::MIXED.cost_arms(Better::Higher), (Arm::B, Arm::A));
        let fnd = findings(&ps, "pass");
        // A pass lost in one boot drops its partner: only pass 2 counts in both boots.
        let mut p2 = vec![pass(1, Arm::Wide, 1, 100.0, "a"), pass(2, Arm::Narrow, 2, 80.0, "a")];
        p2.push(pass(1, Arm::Wide, 2, 50.0, "a"));
        let r = &analyse(&cells(), &order_arg("1 0").unwrap(), &p2, 4.0, Design::SWEEP)[0];
        assert!((r.ratio().unwrap().estimate - 80.0 / 50.0).abs() < 1e-12, "{:?}", r.judged);
        assert_eq!((r.num_n, r.den_n), (1, 2), "each arm still counts all its passes");
        assert_eq!(fnd.failed, vec!["boot 4 (wide) pass 1: ".to_string()]);
    }

    #[test]
    fn each_arm_with_data_but_no_pair_and_zero_width_intervals_say_what_they_are() {
        // Each arm has one counted pass, but in different pass numbers: there is no pair,
        // and the verdict must not claim an arm has no data.
        let order = order_arg("1 0").unwrap();
        let mut lost = pass(2, Arm::Narrow, 1, 90.0, "a");
        lost.ok = false;
        let ps = vec![pass(1, Arm::Wide, 1, 100.0, "a"), lost, pass(2, Arm::Narrow, 2, 90.0, "a")];
        let r = &analyse(&cells(), &order, &ps, 4.0, Design::SWEEP)[0];
        assert_eq!((r.num_n, r.den_n, r.ratio()), (1, 1, None));
        assert!(r.verdict.starts_with("no ABBA pair: narrow has n=1 and wide n=1 counted"), "{}", r.verdict);
        let ps = vec![pass(1, Arm::Wide, 1, 100.0, "a")];
        let r = &analyse(&cells(), &order, &ps, 4.0, Design::SWEEP)[0];
        assert_eq!(r.verdict, "no counted measurement in arm narrow (wide has n=1)");
        // Two pairs with the same ratio: an interval of no width is no certainty.
        let order = order_arg("1 0 0 1").unwrap();
        let ps = vec![
            pass(1, Arm::Wide, 1, 100.0, "a"),
            pass(2, Arm::Narrow, 1, 90.0, "a"),
            pass(3, Arm::Narrow, 1, 90.0, "a"),
            pass(4, Arm::Wide, 1, 100.0, "a"),
        ];
        let r = &analyse(&cells(), &order, &ps, 4.0, Design::SWEEP)[0];
        assert!(r.verdict.starts_with("untrusted (zero-width interval"), "{}", r.verdict);
        let judge = Judge { trust_pct: 4.0, margin_pct: None, sequential: false };
        let t = table(std::slice::from_ref(r), Design::SWEEP, &judge, "pass", None);
        assert!(t.rows[0][4].text.contains(crate::verdict::student_t::ZERO_WIDTH), "{:?}", t.rows[0][4]);
    }

    #[test]
    fn a_margin_judges_every_ratio_and_the_sequence_widens_the_interval() {
        // Four pairs with ratios 0.99, 1.01, 1.00, 1.00: inside ±5%.
        let order = order_arg("1 0 0 1 0 1 1 0").unwrap();
        let tok = [100.0, 99.0, 101.0, 100.0, 100.0, 100.0, 100.0, 100.0];
        let ps: Vec<PassRecord> =
            order.0.iter().enumerate().map(|(i, &arm)| pass(i + 1, arm, 1, tok[i], "a")).collect();
        let judge = Judge { trust_pct: 4.0, margin_pct: Some(5.0), sequential: false };
        let r = &analyse_with(&cells(), &order, &ps, &judge, Design::SWEEP)[0];
        assert_eq!(r.pairs.len(), 4);
        assert_eq!(r.judged.as_ref().unwrap().verdict, Verdict::Same, "{}", r.verdict);
        assert_eq!(r.verdict, "no pin cost beyond ±5%");
        // The same pairs under the sequence: 4 pairs is where it becomes bounded; its
        // interval is wider than the fixed-n one.
        let seq = Judge { sequential: true, ..judge };
        let s = &analyse_with(&cells(), &order, &ps, &seq, Design::SWEEP)[0];
        let (flo, fhi) = r.ratio().unwrap().interval.unwrap();
        let (slo, shi) = s.ratio().unwrap().interval.unwrap();
        assert!(slo < flo && shi > fhi, "{slo} {shi} vs {flo} {fhi}");
        // Two pairs are not enough for a bounded sequence, and the row says so.
        let two = order_arg("1 0 0 1").unwrap();
        let s = &analyse_with(&cells(), &two, &ps[..4], &seq, Design::SWEEP)[0];
        assert!(s.verdict.contains("the sequential interval is not bounded yet"), "{}", s.verdict);
        let t = table(std::slice::from_ref(s), Design::SWEEP, &seq, "pass", None);
        assert!(t.rows[0][4].text.contains("undecided: n=2, no interval yet"), "{:?}", t.rows[0][4]);
    }
}
