//! From the passes to the tax: per cell and metric the ratio of the two arms (narrow/wide
//! in the sweep, B/A in the mixed mode: a [`Design`]) with its 95% interval from the ABBA
//! pairs, each arm's spread against the trust limit, the samples each arm has, the
//! contamination rule, a verdict, and the text of the summary and of the dated record.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use super::abba::{Better, BootRecord, CellDef, PassRecord};
use super::arms::{AaEnv, Arm, Order};
use super::stats::{self, Ratio};
use crate::verdict::equivalence::Equivalence;

/// Which arms a mode compares, and which way round.
#[derive(Clone, Copy, Debug)]
pub struct Design {
    /// The ratio's numerator arm.
    pub num: Arm,
    /// Its denominator arm.
    pub den: Arm,
    /// Whether the numerator is the arm that carries the pin (the sweep's narrow arm),
    /// so the cost is the numerator's; else it is the denominator's (the mixed mode's A).
    pub num_pinned: bool,
    /// How the verdict names the cost: `the pin costs`, `bystander cost`.
    pub cost_name: &'static str,
    /// The same, before a signed figure: `pin`, `bystander cost`.
    pub cost_short: &'static str,
    /// How the verdict names a negative cost: `the pin gains`.
    pub gain_name: &'static str,
    /// The environment both slots run in this design's A/A run ([`Design::aa`]).
    pub aa_env: AaEnv,
}

impl Design {
    /// The sweep: narrow/wide.
    pub const SWEEP: Design = Design {
        num: Arm::Narrow,
        den: Arm::Wide,
        num_pinned: true,
        cost_name: "the pin costs",
        cost_short: "pin",
        gain_name: "the pin gains",
        aa_env: AaEnv::Wide,
    };
    /// The mixed mode: B/A, the cost carried by A's bystanders.
    pub const MIXED: Design = Design {
        num: Arm::B,
        den: Arm::A,
        num_pinned: false,
        cost_name: "bystander cost",
        cost_short: "bystander cost",
        gain_name: "the pin gains",
        aa_env: AaEnv::A,
    };

    /// This design's A/A run: both slots run [`Design::aa_env`], named `A1` (the
    /// denominator's slot, which the default orders open with) and `A2`; the ratio is
    /// A2/A1, whose true value is 1.
    pub fn aa(self) -> Design {
        Design {
            num: Arm::A2(self.aa_env),
            den: Arm::A1(self.aa_env),
            num_pinned: true,
            cost_name: "A2 is slower than A1 by",
            cost_short: "A2 against A1",
            gain_name: "A2 is faster than A1 by",
            aa_env: self.aa_env,
        }
    }

    /// `narrow/wide`, `B/A`.
    pub fn ratio_name(&self) -> String {
        format!("{}/{}", self.num.as_str(), self.den.as_str())
    }

    /// The pinned arm's cost in percent of the other's (positive: the pin costs).
    pub fn cost_pct(&self, better: Better, ratio: f64) -> f64 {
        let r = if self.num_pinned { ratio } else { 1.0 / ratio };
        cost_pct(better, r)
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
    /// Measured passes that count, per arm.
    pub num_n: usize,
    /// Same, wide.
    pub den_n: usize,
    /// Mean of the narrow passes.
    pub num_mean: Option<f64>,
    /// Mean of the wide passes.
    pub den_mean: Option<f64>,
    /// num / den over the ABBA pairs.
    pub ratio: Option<Ratio>,
    /// Spread of each arm's passes, percent.
    pub spread_num: Option<f64>,
    /// Same, wide.
    pub spread_den: Option<f64>,
    /// Outputs differed: reported, never averaged in.
    pub contaminated: bool,
    /// What the numbers say.
    pub verdict: String,
    /// The verdict at `--margin`, when one was given.
    pub equivalence: Option<Equivalence>,
    /// The ABBA pairs: (numerator boot, denominator boot) means.
    pub pairs: Vec<(f64, f64)>,
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
    /// `--margin`: the equivalence verdict at this percentage.
    pub margin_pct: Option<f64>,
    /// `--until-ci`: intervals from the confidence sequence (valid at any stopping time)
    /// instead of the fixed-n t interval.
    pub sequential: bool,
}

/// The tax table with fixed-n intervals and no margin.
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

/// The tax table.
pub fn analyse_with(
    cells: &[CellDef],
    order: &Order,
    passes: &[PassRecord],
    judge: &Judge,
    design: Design,
) -> Vec<TaxRow> {
    let trust_pct = judge.trust_pct;
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
            let arm_values =
                |arm: Arm| -> Vec<f64> { passes.iter().filter(|p| p.arm == arm).filter_map(value).collect() };
            let (nv, wv) = (arm_values(design.num), arm_values(design.den));
            // Each boot's value per pass number; a pair compares its two boots over the
            // pass numbers that count in both, so a pass lost in one boot drops its
            // partner too (the same pass of every boot sends the same requests).
            let by_pass = |boot: usize| -> BTreeMap<usize, f64> {
                passes
                    .iter()
                    .filter(|p| p.boot == boot + 1)
                    .filter_map(|p| Some((p.pass, value(p)?)))
                    .collect()
            };
            let pairs: Vec<(f64, f64)> = order
                .pairs_of(design.num, design.den)
                .into_iter()
                .filter_map(|(n, w)| {
                    let (n, w) = (by_pass(n), by_pass(w));
                    let both: Vec<usize> = n.keys().filter(|k| w.contains_key(k)).copied().collect();
                    let mean =
                        |m: &BTreeMap<usize, f64>| both.iter().map(|k| m[k]).sum::<f64>() / both.len() as f64;
                    (!both.is_empty()).then(|| (mean(&n), mean(&w)))
                })
                .collect();
            let pairs: Vec<(f64, f64)> = pairs.into_iter().filter(|(n, w)| *n > 0.0 && *w > 0.0).collect();
            let ratio = if judge.sequential {
                crate::verdict::sequence::paired_ratio(&pairs).map(|i| Ratio {
                    pairs: i.n,
                    ratio: i.mean,
                    ci95: i.ci95,
                })
            } else {
                stats::ratio(&pairs)
            };
            let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
            let mut row = TaxRow {
                cell: cell.name.clone(),
                metric: m.name.to_string(),
                better: m.better,
                num_n: nv.len(),
                den_n: wv.len(),
                num_mean: mean(&nv),
                den_mean: mean(&wv),
                ratio,
                spread_num: stats::spread_pct(&nv),
                spread_den: stats::spread_pct(&wv),
                contaminated: dirty.contains_key(&cell.name),
                verdict: String::new(),
                equivalence: None,
                pairs,
            };
            row.verdict = verdict(&row, trust_pct, design);
            if let Some(margin) = judge.margin_pct
                && !row.contaminated
            {
                let eq = equivalence(&row.pairs, margin, judge.sequential);
                let n = row.pairs.len();
                let text = eq.as_ref().map_or_else(
                    || format!("undecided at {margin}% (too few pairs for an interval; {n} so far)"),
                    |v| crate::verdict::equivalence::describe(v, margin, n),
                );
                row.verdict = format!("{text}; {}", row.verdict);
                row.equivalence = eq;
            }
            rows.push(row);
        }
    }
    rows
}

/// The equivalence verdict of paired (num, den) boot means at `margin`: the fixed-n
/// TOST (the 90% t interval inside the bounds), or with `sequential` the confidence
/// sequence's 95% interval; `None` while there is no interval.
fn equivalence(pairs: &[(f64, f64)], margin: f64, sequential: bool) -> Option<Equivalence> {
    use crate::verdict::{equivalence as eq, sequence};
    if sequential {
        let r = sequence::paired_ratio(pairs)?;
        r.ci95?;
        Some(eq::judge(&r, margin, sequence::half_factor))
    } else {
        let logs: Vec<f64> = pairs.iter().map(|(n, w)| (n / w).ln()).collect();
        Some(eq::tost(&logs, margin)?.verdict)
    }
}

/// The narrow arm's cost in percent of the wide arm's (positive: the pin costs).
pub fn cost_pct(better: Better, ratio: f64) -> f64 {
    match better {
        Better::Higher => 100.0 * (1.0 / ratio - 1.0),
        Better::Lower => 100.0 * (ratio - 1.0),
    }
}

fn verdict(r: &TaxRow, trust_pct: f64, design: Design) -> String {
    if r.contaminated {
        return "contaminated: outputs differ across arms; excluded".into();
    }
    let Some(ratio) = r.ratio else {
        return no_pair(r, design);
    };
    let untrusted: Vec<String> = [(design.num.as_str(), r.spread_num), (design.den.as_str(), r.spread_den)]
        .iter()
        .filter_map(|(a, s)| s.filter(|s| *s > trust_pct).map(|s| format!("{a} spread {s:.1}%")))
        .collect();
    let cost = design.cost_pct(r.better, ratio.ratio);
    let n = ratio.pairs;
    let Some((lo, hi)) = ratio.ci95 else {
        if n >= 2 {
            return format!(
                "n={n} pairs: the sequential interval is not bounded yet (it needs 4 pairs), cannot support a verdict ({} {cost:+.1}% is an estimate)",
                design.cost_short
            );
        }
        return format!(
            "one pair (n=1): no interval, cannot support a verdict ({} {cost:+.1}% is one estimate)",
            design.cost_short
        );
    };
    if !untrusted.is_empty() {
        return format!(
            "untrusted: {} over the {trust_pct}% limit ({} {cost:+.1}%, n={n} pairs)",
            untrusted.join(", "),
            design.cost_short
        );
    }
    if lo == hi {
        return format!(
            "zero-width interval (n={n} pairs, every pair's ratio equal): no measured spread, cannot support a verdict"
        );
    }
    if lo <= 1.0 && 1.0 <= hi {
        format!("no tax detected ({cost:+.1}%, interval spans 1, n={n} pairs)")
    } else if cost > 0.0 {
        format!("{} {cost:.1}% (n={n} pairs)", design.cost_name)
    } else {
        format!("{} {:.1}% (n={n} pairs)", design.gain_name, -cost)
    }
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

fn f(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| if x.abs() >= 100.0 { format!("{x:.0}") } else { format!("{x:.2}") })
}

fn pct(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.1}%"))
}

/// The markdown tax table.
pub fn table(rows: &[TaxRow], design: Design) -> String {
    let mut s = String::new();
    let (n, d) = (design.num.as_str(), design.den.as_str());
    let _ = writeln!(
        s,
        "| cell | metric | {n} n | {d} n | {n} mean | {d} mean | pairs | {n}/{d} | 95% CI | spread {n} | spread {d} | verdict |"
    );
    let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|");
    for r in rows {
        let (pairs, ratio, ci) = match r.ratio {
            Some(x) => (
                x.pairs.to_string(),
                format!("{:.4}", x.ratio),
                x.ci95.map_or_else(
                    || format!("- (n={}: no interval)", x.pairs),
                    |(lo, hi)| {
                        let flag = if lo == hi { " (zero width)" } else { "" };
                        format!("{lo:.4} to {hi:.4}{flag}")
                    },
                ),
            ),
            None => ("0".into(), "-".into(), "-".into()),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.cell,
            r.metric,
            r.num_n,
            r.den_n,
            f(r.num_mean),
            f(r.den_mean),
            pairs,
            ratio,
            ci,
            pct(r.spread_num),
            pct(r.spread_den),
            r.verdict
        );
    }
    s
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
                super::abba::cell_failures(&p.cells).into_iter().map(move |f| format!("{}, {f}", label(p)))
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

/// The summary printed at the end (also the body of the record).
pub fn summary(
    rows: &[TaxRow],
    fnd: &Findings,
    boots: &[BootRecord],
    trust_pct: f64,
    design: Design,
    unit: &str,
) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{} per cell and metric: the geometric mean of the ABBA pairs' ratios, 95% CI by a paired t interval on their logs; spread = (max - min) / mean of an arm's measured {}, trusted up to {trust_pct}%\n",
        design.ratio_name(),
        plural(unit)
    );
    s.push_str(&table(rows, design));
    let _ = writeln!(s);
    let failed_boots: Vec<String> = boots
        .iter()
        .filter_map(|b| b.failure.as_ref().map(|f| format!("boot {} ({}): {f}", b.boot, b.arm.as_str())))
        .collect();
    let list = |s: &mut String, title: &str, items: &[String]| {
        let _ = writeln!(s, "{title}: {}", items.len());
        for i in items {
            let _ = writeln!(s, "- {i}");
        }
    };
    list(&mut s, "failed boots", &failed_boots);
    let units = plural(unit);
    list(&mut s, &format!("failed {units}"), &fnd.failed);
    if !fnd.failed_cells.is_empty() {
        list(&mut s, &format!("failed cells (their {units} count for the other cells)"), &fnd.failed_cells);
    }
    if unit != "pass" {
        list(&mut s, &format!("invalid {units} (completed, not counted)"), &fnd.invalid);
    }
    list(&mut s, &format!("disturbed {units} (measured while other processes were busy)"), &fnd.disturbed);
    let dirty: Vec<String> = fnd
        .contaminated
        .iter()
        .map(|(c, keys)| format!("{c}: {} request(s) differ, e.g. {}", keys.len(), keys[0]))
        .collect();
    list(&mut s, "contaminated cells (reported, excluded from the tax)", &dirty);
    if let Some(t) = boot_timings(boots) {
        let _ = writeln!(s, "{t}");
    }
    s
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
    use super::super::abba::{CellMeasure, MetricDef};
    use super::super::arms::order_arg;
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
        assert_eq!(
            rows[0].verdict,
            "one pair (n=1): no interval, cannot support a verdict (pin +11.1% is one estimate)"
        );
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
        let ratio = r.ratio.unwrap();
        assert_eq!(ratio.pairs, 2);
        assert!((ratio.ratio - (0.9f64 * (91.0 / 101.0)).sqrt()).abs() < 1e-12);
        let (lo, hi) = ratio.ci95.unwrap();
        assert!(lo < ratio.ratio && ratio.ratio < hi && hi < 1.0, "{lo} {hi}");
        // Throughput 0.9x: the narrow arm needs 11.1% more time per token.
        assert!(r.verdict.starts_with("the pin costs 11."), "{}", r.verdict);
        assert_eq!(cost_pct(Better::Lower, 1.25), 25.0);
        let fnd = findings(&ps, "pass");
        // A pass lost in one boot drops its partner: only pass 2 counts in both boots.
        let mut p2 = vec![pass(1, Arm::Wide, 1, 100.0, "a"), pass(2, Arm::Narrow, 2, 80.0, "a")];
        p2.push(pass(1, Arm::Wide, 2, 50.0, "a"));
        let r = &analyse(&cells(), &order_arg("1 0").unwrap(), &p2, 4.0, Design::SWEEP)[0];
        assert!((r.ratio.unwrap().ratio - 80.0 / 50.0).abs() < 1e-12, "{:?}", r.ratio);
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
        assert_eq!((r.num_n, r.den_n, r.ratio), (1, 1, None));
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
        assert!(r.verdict.starts_with("zero-width interval (n=2 pairs"), "{}", r.verdict);
        assert!(table(std::slice::from_ref(r), Design::SWEEP).contains("(zero width)"));
    }

    #[test]
    fn a_margin_gives_the_equivalence_verdict_beside_the_old_one() {
        // Four pairs with ratios 0.99, 1.01, 1.00, 1.00: inside ±5% at 90% (TOST).
        let order = order_arg("1 0 0 1 0 1 1 0").unwrap();
        let tok = [100.0, 99.0, 101.0, 100.0, 100.0, 100.0, 100.0, 100.0];
        let ps: Vec<PassRecord> =
            order.0.iter().enumerate().map(|(i, &arm)| pass(i + 1, arm, 1, tok[i], "a")).collect();
        let judge = Judge { trust_pct: 4.0, margin_pct: Some(5.0), sequential: false };
        let r = &analyse_with(&cells(), &order, &ps, &judge, Design::SWEEP)[0];
        assert_eq!(r.pairs.len(), 4);
        assert_eq!(r.equivalence, Some(Equivalence::Equivalent), "{}", r.verdict);
        assert!(r.verdict.starts_with("equivalent within 5%; no tax detected"), "{}", r.verdict);
        // The same pairs under the sequence: 4 pairs is where it becomes bounded; its
        // interval is wider than the fixed-n one.
        let seq = Judge { sequential: true, ..judge };
        let s = &analyse_with(&cells(), &order, &ps, &seq, Design::SWEEP)[0];
        let (flo, fhi) = r.ratio.unwrap().ci95.unwrap();
        let (slo, shi) = s.ratio.unwrap().ci95.unwrap();
        assert!(slo < flo && shi > fhi, "{slo} {shi} vs {flo} {fhi}");
        // Two pairs are not enough for a bounded sequence, and the row says so.
        let two = order_arg("1 0 0 1").unwrap();
        let s = &analyse_with(&cells(), &two, &ps[..4], &seq, Design::SWEEP)[0];
        assert!(s.verdict.contains("the sequential interval is not bounded yet"), "{}", s.verdict);
        assert!(s.verdict.starts_with("undecided at 5%"), "{}", s.verdict);
    }
}
