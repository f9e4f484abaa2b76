//! What `bench-kernels --compare` says, as one [`Sheet`]: each benchmark's B/A time ratio
//! as a [`Reading`] judged at the margin, a headline that answers "did this change regress
//! a kernel?", and the kernel and read-bandwidth benchmarks in tables of their own (the
//! read bandwidth measures the machine, not the change). The terminal, the report file, the
//! pull-request comment and `readings.json` all print this sheet's cells; none judges a
//! ratio again.

use std::collections::BTreeMap;

use crate::verdict::reading::{Better, Judged, Method, Reading, Verdict, duration_text};
use crate::verdict::sequence::Stopped;
use crate::verdict::sheet::{Cell, Sheet, Table};

use super::render::{bandwidth_threads, fmt_time, parse_kernel_id};

/// The title of the kernel benchmarks' table (the comment lists its changed rows).
pub(super) const KERNEL_TABLE: &str = "Kernel benchmarks";
/// The title of the read-bandwidth benchmarks' table.
pub(super) const BANDWIDTH_TABLE: &str =
    "The machine's roofs: read bandwidth and compute (they measure the machine, not the change)";

/// One benchmark's pairs.
pub(super) struct Compared {
    pub(super) id: String,
    /// (A ns, B ns) per round.
    pub(super) pairs: Vec<(f64, f64)>,
    /// Bytes one iteration reads, when the benchmark declares them.
    pub(super) bytes: Option<u64>,
    /// With `--until-ci`: why its rounds stopped.
    pub(super) stopped: Option<Stopped>,
    /// The wall time of its rounds together (both runs of each, with their starts), in
    /// seconds: what one more round costs, on average.
    pub(super) wall_s: f64,
}

/// Which tree a run measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Side {
    /// REV.
    A,
    /// The working tree.
    B,
}

impl Compared {
    /// Mean time per iteration of one side over the rounds.
    fn mean_ns(&self, side: Side) -> f64 {
        let pick = |p: &(f64, f64)| if side == Side::A { p.0 } else { p.1 };
        self.pairs.iter().map(pick).sum::<f64>() / self.pairs.len().max(1) as f64
    }

    /// GB/s (10^9 bytes per second) of one side, at its mean time.
    fn gb_s(&self, side: Side) -> Option<f64> {
        self.bytes.map(|b| b as f64 / self.mean_ns(side))
    }

    /// What one more round of this benchmark takes, in seconds.
    fn secs_per_round(&self) -> Option<f64> {
        (!self.pairs.is_empty() && self.wall_s > 0.0).then(|| self.wall_s / self.pairs.len() as f64)
    }

    /// A roof of the machine (the read bandwidth or a compute roof), not a kernel.
    fn is_bandwidth(&self) -> bool {
        bandwidth_threads(&self.id).is_some() || super::target::compute_roof_id(&self.id).is_some()
    }
}

/// How the comparison is judged.
#[derive(Clone, Copy, Debug)]
pub(super) struct Judging {
    /// `--until-ci`: the confidence sequence's intervals, and the target half-width.
    pub(super) until_ci: Option<f64>,
    /// The verdict's margin in percent (`--margin`, else `--noise-threshold` as a
    /// percentage, else [`crate::verdict::reading::DEFAULT_MARGIN_PCT`]).
    pub(super) margin_pct: f64,
}

impl Judging {
    fn method(&self) -> Method {
        if self.until_ci.is_some() { Method::Sequence } else { Method::T }
    }
}

/// B/A over the rounds: the fixed-n t interval, or with `method` Sequence the confidence
/// sequence's (valid however many rounds the run chose to add).
pub(super) fn ratio(pairs: &[(f64, f64)], method: Method) -> Option<Reading> {
    let ba: Vec<(f64, f64)> = pairs.iter().map(|(a, b)| (*b, *a)).collect();
    Reading::of_pairs(&ba, method)
}

/// The verdict on the B/A time ratio of `pairs` (below 1: B is faster).
pub(super) fn judged(pairs: &[(f64, f64)], judging: &Judging) -> Option<Judged> {
    ratio(pairs, judging.method()).map(|r| r.judge(Better::Lower, judging.margin_pct))
}

/// Each side's read bandwidth per thread count: the highest of its `read_bandwidth`
/// benchmarks' GB/s, as the baseline report takes it.
fn bandwidth(results: &[Compared], side: Side) -> BTreeMap<usize, f64> {
    let mut bw = BTreeMap::new();
    for c in results {
        if let (Some(t), Some(g)) = (bandwidth_threads(&c.id), c.gb_s(side)) {
            let e = bw.entry(t).or_insert(g);
            *e = f64::max(*e, g);
        }
    }
    bw
}

/// The tally of one table's verdicts.
#[derive(Default)]
struct Tally {
    regressed: usize,
    improved: usize,
    same: usize,
    undecided: usize,
    /// The most more rounds any undecided benchmark would likely need.
    more_rounds: usize,
    /// What those rounds would take, benchmark after benchmark, in seconds.
    more_secs: f64,
    /// Whether every undecided benchmark's count of rounds is known.
    all_counted: bool,
}

impl Tally {
    fn of(rows: &[(Option<Judged>, Option<f64>)]) -> Tally {
        let mut t = Tally { all_counted: true, ..Tally::default() };
        for (j, secs) in rows {
            match j.as_ref().map(|j| &j.verdict) {
                Some(Verdict::Regressed) => t.regressed += 1,
                Some(Verdict::Improved) => t.improved += 1,
                Some(Verdict::Same) => t.same += 1,
                _ => {
                    t.undecided += 1;
                    match j.as_ref().and_then(|j| j.more_needed()) {
                        Some(k) => {
                            let k = k.max(1);
                            t.more_rounds = t.more_rounds.max(k);
                            t.more_secs += secs.unwrap_or(f64::NAN) * k as f64;
                        }
                        None => t.all_counted = false,
                    }
                }
            }
        }
        t
    }

    fn total(&self) -> usize {
        self.regressed + self.improved + self.same + self.undecided
    }

    /// `1 regressed, 0 improved, 3 same, 1 undecided (of 5)`.
    fn counts(&self) -> String {
        format!(
            "{} regressed, {} improved, {} same, {} undecided (of {})",
            self.regressed,
            self.improved,
            self.same,
            self.undecided,
            self.total()
        )
    }

    /// What would settle the undecided: `about 12 more rounds each would likely settle
    /// them (about 20 min)`; empty when no count is known.
    fn settle(&self) -> String {
        if self.more_rounds == 0 {
            return String::new();
        }
        let time = if self.more_secs.is_finite() {
            format!(", {}", duration_text(self.more_secs))
        } else {
            String::new()
        };
        let some = if self.all_counted { "" } else { " (some never, their estimate sits on the margin)" };
        format!("; up to {} more rounds each would likely settle them{time}{some}", self.more_rounds)
    }
}

/// The one line that answers "did this change regress a kernel?", with the tallies.
fn headline(kernels: &Tally, bandwidth: &Tally, m: f64) -> String {
    let n = kernels.total();
    let answer = if n == 0 {
        "no kernel benchmark was compared".to_string()
    } else if kernels.regressed > 0 {
        format!("yes: {} of {n} kernel benchmarks regressed by more than {m}%", kernels.regressed)
    } else if kernels.undecided > 0 {
        format!(
            "not known: {} of {n} kernel benchmarks are undecided at ±{m}%{}",
            kernels.undecided,
            kernels.settle()
        )
    } else {
        format!("no: each of {n} kernel benchmarks is the same within ±{m}% or improved")
    };
    let mut s =
        format!("Did this change regress a kernel? {answer}. Kernels at ±{m}%: {}.", kernels.counts());
    if bandwidth.total() > 0 {
        s.push_str(&format!(
            " The machine's roofs (read bandwidth, compute), which measure the machine and not the change: {}.",
            bandwidth.counts()
        ));
    }
    s
}

/// The comparison's sheet.
pub(super) fn sheet(
    rev: &str,
    sha: &str,
    rounds: usize,
    judging: &Judging,
    results: &[Compared],
    missing: &[String],
) -> Sheet {
    let m = judging.margin_pct;
    let sequential = judging.until_ci.is_some();
    let (bw_a, bw_b) = (bandwidth(results, Side::A), bandwidth(results, Side::B));
    let mut columns: Vec<String> = [
        "benchmark",
        "A (mean of rounds)",
        "B (mean of rounds)",
        "B/A (95% interval)",
        &format!("verdict at ±{m}%"),
        "GB/s A / B",
    ]
    .map(str::to_string)
    .to_vec();
    let mut kernel_columns = columns.clone();
    kernel_columns.push("% of read BW A / B".into());
    if sequential {
        columns.push("stopped".into());
        kernel_columns.push("stopped".into());
    }
    let mut kernel_rows = Vec::new();
    let mut bandwidth_rows = Vec::new();
    let (mut kernel_verdicts, mut bandwidth_verdicts) = (Vec::new(), Vec::new());
    for c in results {
        let gbs = |side| c.gb_s(side).map_or("n/a".to_string(), |g| format!("{g:.1}"));
        let j = judged(&c.pairs, judging);
        let secs = c.secs_per_round();
        let (ratio_cell, verdict_cell) = match &j {
            Some(j) => (
                Cell { text: j.reading.ratio_text(), reading: Some(j.reading.clone()), judged: None },
                Cell { text: j.text("rounds", secs), reading: None, judged: Some(j.clone()) },
            ),
            None => (Cell::text(format!("- (n={})", c.pairs.len())), Cell::text("no rounds")),
        };
        let mut row = vec![
            Cell::text(format!("`{}`", c.id)),
            Cell::text(fmt_time(c.mean_ns(Side::A))),
            Cell::text(fmt_time(c.mean_ns(Side::B))),
            ratio_cell,
            verdict_cell,
            Cell::text(format!("{} / {}", gbs(Side::A), gbs(Side::B))),
        ];
        if c.is_bandwidth() {
            bandwidth_verdicts.push((j, secs));
        } else {
            let threads = parse_kernel_id(&c.id).map(|k| k.threads);
            let share =
                |side, bw: &BTreeMap<usize, f64>| match (c.gb_s(side), threads.and_then(|t| bw.get(&t))) {
                    (Some(g), Some(b)) => format!("{:.0}%", 100.0 * g / b),
                    _ => "n/a".to_string(),
                };
            row.push(Cell::text(format!("{} / {}", share(Side::A, &bw_a), share(Side::B, &bw_b))));
            kernel_verdicts.push((j, secs));
        }
        if let Some(t) = judging.until_ci {
            let why = c.stopped.as_ref().map_or("-".to_string(), |st| {
                st.describe(t).trim_start_matches("stopping rule: ").to_string()
            });
            row.push(Cell::text(why));
        }
        if c.is_bandwidth() { bandwidth_rows.push(row) } else { kernel_rows.push(row) }
    }
    let method = judging.method();
    let legend = format!(
        "A = `{rev}` ({}), B = the working tree. Each benchmark ran {} rounds in ABBA order (A B, \
         B A, ...), each run a fresh criterion process. B/A is the geometric mean of the rounds' \
         B/A time ratios (below 1: B is faster) with its {}. The verdict is `same` only when the \
         whole interval lies within ±{m}%, `regressed` or `improved` only when it lies wholly \
         beyond; otherwise `undecided`, with about how many more rounds would likely settle it \
         and how long they would take at the rounds' measured wall time.",
        &sha[..sha.len().min(12)],
        match judging.until_ci {
            Some(t) => format!("at least {rounds} and until the interval's half-width was under {t}%"),
            None => rounds.to_string(),
        },
        method.describe(),
    );
    let mut tables =
        vec![Table { title: KERNEL_TABLE.into(), legend, columns: kernel_columns, rows: kernel_rows }];
    let mut notes = Vec::new();
    if bw_a.is_empty() {
        notes.push("Read bandwidth: not in this comparison, so no percentages of it.".to_string());
    } else {
        let list: Vec<String> = bw_a
            .iter()
            .map(|(t, a)| {
                format!(
                    "{a:.1} / {} GB/s with {t} thread(s)",
                    bw_b.get(t).map_or("-".into(), |b| format!("{b:.1}"))
                )
            })
            .collect();
        tables.push(Table {
            title: BANDWIDTH_TABLE.into(),
            legend: format!(
                "Read bandwidth A / B (the highest `read_bandwidth` measurement of each side): {}. \
                 A kernel's `% of read BW` is its GB/s over its own side's figure, so a side \
                 measured under more load is judged against the bandwidth it had.",
                list.join(", ")
            ),
            columns,
            rows: bandwidth_rows,
        });
    }
    if !missing.is_empty() {
        notes.push(format!("In one tree only (not compared): {}", missing.join(", ")));
    }
    Sheet {
        task: "bench-kernels --compare".into(),
        headline: headline(&Tally::of(&kernel_verdicts), &Tally::of(&bandwidth_verdicts), m),
        tables,
        notes,
        roofline: None,
    }
}

/// The markdown section of the comparison: its heading and the sheet.
pub(super) fn section(rev: &str, sha: &str, sheet: &Sheet) -> String {
    format!(
        "### Interleaved comparison: `{rev}` ({}) = A, the working tree = B\n\n{}",
        &sha[..sha.len().min(12)],
        sheet.markdown()
    )
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A recorded comparison: a clear regression, a kernel that stayed the same, the n=2
    /// pair whose interval spans a factor of 160 either way, a benchmark of one round,
    /// and two read-bandwidth benchmarks measured on a loaded machine.
    pub(in super::super) fn recorded() -> Vec<Compared> {
        let c = |id: &str, pairs: Vec<(f64, f64)>, bytes| Compared {
            id: id.into(),
            pairs,
            bytes,
            stopped: None,
            wall_s: 8.0 * 4.0,
        };
        vec![
            c(
                "qmv/q4_g64_n4096_k4096_m1/t1",
                vec![(100.0, 130.0), (102.0, 134.0), (98.0, 128.0)],
                Some(2000),
            ),
            c("qmv/q4_g64_n4096_k4096_m1/t2", vec![(100.0, 100.1), (100.0, 99.9), (100.0, 100.0)], None),
            c("qmv_wide/q4_g64_n4096_k4096_m8/t1", vec![(100.0, 88.8), (100.0, 197.7)], None),
            c("qmm/q4_g64_n4096_k4096_m16/t1", vec![(100.0, 130.0)], None),
            c("read_bandwidth/sum_1024MiB_start/t1", vec![(25.0, 40.0), (30.0, 20.0)], Some(1000)),
            c("read_bandwidth/sum_1024MiB_end/t1", vec![(26.0, 33.0), (31.0, 22.0)], Some(1000)),
            c("compute_roof/int8_avx512_vnni/t1", vec![(50.0, 52.0), (50.0, 49.0)], None),
        ]
    }

    pub(in super::super) fn judging() -> Judging {
        Judging { until_ci: None, margin_pct: 5.0 }
    }

    #[test]
    fn a_two_round_interval_wider_than_the_margin_is_undecided_never_within_noise() {
        let s = sheet("main", "0123456789abcdef", 2, &judging(), &recorded(), &[]);
        let md = section("main", "0123456789abcdef", &s);
        let row = md.lines().find(|l| l.contains("qmv_wide/q4_g64")).unwrap();
        assert!(
            row.contains("1.325 [0.008, 214.047] (n=2, within a factor of 161.5)")
                && !row.contains("within noise"),
            "{row}"
        );
        // 24 more rounds at the 16 s each of these two: about 6 min.
        assert!(
            row.contains("| undecided at ±5%: about 24 more rounds would likely settle it (about 6 min) |"),
            "{row}"
        );
        // No width prints as a percentage past 100.
        for width in md.split('±').skip(1) {
            let pct: String = width.chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
            assert!(pct.parse::<f64>().is_ok_and(|v| v <= 100.0), "±{pct} in {md}");
        }
    }

    #[test]
    fn the_headline_counts_kernels_apart_from_the_read_bandwidth() {
        let s = sheet("main", "0123456789abcdef", 2, &judging(), &recorded(), &["`x/y/t1`".into()]);
        assert!(
            s.headline.starts_with(
                "Did this change regress a kernel? yes: 1 of 4 kernel benchmarks regressed by more than 5%. \
                 Kernels at ±5%: 1 regressed, 0 improved, 1 same, 2 undecided (of 4). The machine's roofs \
                 (read bandwidth, compute), which measure the machine and not the change: 0 regressed, 0 improved, 0 same, 3 undecided (of 3)."
            ),
            "{}",
            s.headline
        );
        let md = s.markdown();
        // 2000 bytes in 100 ns: 20 GB/s, 55% of A's 36.4; in 130.7 ns: 15.3 GB/s, 42% of B's 36.4
        // (each side's higher read-bandwidth figure, start or end).
        let t1 = md.lines().find(|l| l.contains("qmv/q4_g64_n4096_k4096_m1/t1")).unwrap();
        assert!(
            t1.contains("| 100.0 ns | 130.7 ns | 1.307 [") && t1.contains("regressed by more than 5%"),
            "{t1}"
        );
        assert!(t1.contains("| 20.0 / 15.3 | 55% / 42% |"), "{t1}");
        assert!(md.contains("36.4 / 36.4 GB/s with 1 thread(s)"), "{md}");
        let t2 = md.lines().find(|l| l.contains("m1/t2")).unwrap();
        assert!(t2.contains("same within ±5%"), "{t2}");
        let one = md.lines().find(|l| l.contains("qmm/")).unwrap();
        assert!(one.contains("| 1.300 (n=1: no interval) | undecided: n=1, no interval yet |"), "{one}");
        assert!(md.contains("In one tree only (not compared): `x/y/t1`"), "{md}");
        // The kernels' table comes first, the bandwidth's after it, each with its rows only.
        let (k, b) = (md.find(KERNEL_TABLE).unwrap(), md.find(BANDWIDTH_TABLE).unwrap());
        assert!(
            k < b
                && md[b..].contains("read_bandwidth/")
                && md[b..].contains("| `compute_roof/int8_avx512_vnni/t1` |")
                && !md[..b].contains("| `read_bandwidth/")
                && !md[..b].contains("| `compute_roof/"),
            "{md}"
        );
    }

    #[test]
    fn with_no_regression_the_headline_says_whether_the_rest_is_known() {
        let quiet = |pairs: Vec<(f64, f64)>| {
            vec![Compared {
                id: "qmv/q4_g64_n1_k1_m1/t1".into(),
                pairs,
                bytes: None,
                stopped: None,
                wall_s: 60.0,
            }]
        };
        let s = sheet(
            "main",
            "0123",
            2,
            &judging(),
            &quiet(vec![(100.0, 100.1), (100.0, 99.9), (100.0, 100.0)]),
            &[],
        );
        assert!(
            s.headline.starts_with("Did this change regress a kernel? no: each of 1 kernel benchmarks"),
            "{}",
            s.headline
        );
        let s = sheet("main", "0123", 2, &judging(), &quiet(vec![(100.0, 98.0), (100.0, 104.0)]), &[]);
        assert!(
            s.headline.starts_with("Did this change regress a kernel? not known: 1 of 1 kernel benchmarks are undecided at ±5%; up to "),
            "{}",
            s.headline
        );
        assert!(s.headline.contains("more rounds each would likely settle them, about "), "{}", s.headline);
    }

    #[test]
    fn a_sequential_comparison_names_its_interval_and_why_it_stopped() {
        let results = [
            Compared {
                id: "qmv/a/t1".into(),
                pairs: vec![(100.0, 130.0), (101.0, 131.0), (99.0, 129.0), (100.0, 130.5), (100.0, 129.5)],
                bytes: None,
                stopped: Some(Stopped::Decided(5.0)),
                wall_s: 50.0,
            },
            Compared {
                id: "qmv/b/t1".into(),
                pairs: vec![(100.0, 100.5), (100.0, 99.5), (100.0, 100.0), (100.0, 100.2)],
                bytes: None,
                stopped: Some(Stopped::MaxPairs(4)),
                wall_s: 40.0,
            },
        ];
        let judging = Judging { until_ci: Some(1.0), margin_pct: 5.0 };
        let md = sheet("main", "0123456789abcdef", 4, &judging, &results, &[]).markdown();
        assert!(md.contains("confidence sequence on the logs"), "{md}");
        assert!(md.contains("| verdict at ±5% | GB/s A / B | % of read BW A / B | stopped |"), "{md}");
        let a = md.lines().find(|l| l.contains("qmv/a/t1")).unwrap();
        assert!(
            a.contains("| regressed by more than 5% |") && a.contains("| decided, every reported ratio"),
            "{a}"
        );
        let b = md.lines().find(|l| l.contains("qmv/b/t1")).unwrap();
        assert!(b.contains("| --max-pairs 4 reached"), "{b}");
        assert!(md.contains("Read bandwidth: not in this comparison"), "{md}");
    }
}
