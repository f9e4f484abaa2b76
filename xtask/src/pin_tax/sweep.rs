//! `--mode sweep`: the cells of the batched-decode sweep. Concurrency levels of batched
//! decode, a prompt-cache cell whose adopted suffix is short enough that its forward's M
//! falls inside the `qmv_wide` window, and uncached and chunked prefill as controls.
//! Prompts are token ids, so every length (and so every forward's M) is exact.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::time::Duration;

use super::abba::Mode;
use super::analysis::{Design, TaxRow};
use super::records::{Better, CellDef, CellMeasure, MetricDef, PassRecord};
use crate::serve_bench::client::{Endpoint, Prompt, RequestSpec, Target};
use crate::serve_bench::load::{self, Arrival};
use crate::serve_bench::output::LevelSummary;
use crate::verdict::fit::{self, Obs, Per};
use crate::verdict::sheet::{Cell, Table};

/// The sweep's sizes.
#[derive(Clone, Debug)]
pub struct Sweep {
    /// Batched-decode levels B.
    pub concurrency: Vec<usize>,
    /// Requests per stream in a decode cell.
    pub rounds: usize,
    /// Prompt tokens of a decode request.
    pub decode_prompt: u64,
    /// Tokens generated per decode request.
    pub max_tokens: u64,
    /// The prompt-cache cell's shared prefix.
    pub prefix: u64,
    /// Its per-request suffix: the M of the cache-hit prefill forward.
    pub suffix: u64,
    /// Measured cache-hit requests per pass.
    pub cache_requests: usize,
    /// The uncached prefill control's prompt length.
    pub prefill_tokens: u64,
    /// The chunked prefill control's prompt length (beyond the server's chunk).
    pub chunked_tokens: u64,
    /// Requests per prefill control per pass.
    pub prefill_requests: usize,
    /// The `model` field.
    pub served: String,
    /// Cells that cannot run by rule (their prompt and output exceed the model's
    /// context), with the reason: never sent.
    pub skipped: BTreeMap<String, String>,
}

const TOK_S: MetricDef = MetricDef { name: "output tok/s", better: Better::Higher };
const TPOT: MetricDef = MetricDef { name: "TPOT ms", better: Better::Lower };
const TTFT: MetricDef = MetricDef { name: "TTFT ms", better: Better::Lower };

impl Sweep {
    /// Each cell's name (as [`Mode::cells`] gives it), its longest prompt and its
    /// `max_tokens`: what must fit the model's context.
    pub fn shapes(&self) -> Vec<(String, u64, u64)> {
        let names = self.cells().into_iter().map(|c| c.name);
        let mut sizes: Vec<(u64, u64)> =
            self.concurrency.iter().map(|_| (self.decode_prompt, self.max_tokens)).collect();
        sizes.extend([(self.prefix + self.suffix, 1), (self.prefill_tokens, 1), (self.chunked_tokens, 1)]);
        names.zip(sizes).map(|(n, (p, m))| (n, p, m)).collect()
    }

    fn spec(&self, key: String, tokens: u64, shared: u64, seed: u64, max_tokens: u64) -> RequestSpec {
        RequestSpec {
            key,
            prompt: Prompt::Ids(load::prompt_ids(tokens, shared, seed)),
            max_tokens,
            ignore_eos: true,
            model: self.served.clone(),
            endpoint: Endpoint::Completions,
            speculative: false,
            json_object: false,
        }
    }
}

/// The cells whose measured quantity holds one forward inside the `qmv_wide` window, as
/// observations of the fit: each decode level B >= 2 (TPOT: one forward of M = B per
/// output token) and the prompt-cache hit (TTFT: one forward of M = the suffix per
/// request), each with the mean and standard error of its pairs' narrow - wide ms.
pub fn fit_obs(rows: &[TaxRow], suffix: u64) -> Vec<Obs> {
    let mut obs = Vec::new();
    for r in rows.iter().filter(|r| !r.contaminated) {
        let m = match r.cell.strip_prefix("decode B=").and_then(|b| b.parse::<f64>().ok()) {
            Some(b) if b >= 2.0 && r.metric == TPOT.name => b,
            None if r.cell.starts_with("prompt-cache hit") && r.metric == TTFT.name => suffix as f64,
            _ => continue,
        };
        let d: Vec<f64> = r.pairs.iter().map(|(n, w)| n - w).collect();
        let Some(i) = crate::verdict::student_t::interval(&d).filter(|i| i.n >= 2) else { continue };
        obs.push(Obs { cell: r.cell.clone(), forwards: 1.0, m, y: i.mean, se: i.sd / (i.n as f64).sqrt() });
    }
    obs
}

/// The per-forward fit's table: one row per model (a constant per forward or per token),
/// the better fit first. `caveat` is said in every row when the rows the fit rests on
/// give no verdict to act on, so a figure is never read as a tax without it.
pub fn fit_table(obs: &[Obs], caveat: Option<&str>) -> Table {
    let mut t = Table {
        title: "per-forward fit".into(),
        legend: "narrow - wide ms of each cell with one forward in the window (TPOT of decode B >= 2, TTFT of the prompt-cache hit; mean of its pairs, weighted by 1 / se^2), as one constant per forward or per token (row), the better fit first; 95% intervals".into(),
        columns: ["model", "narrow - wide", "one constant?", "residuals", "caveat"].iter().map(|c| c.to_string()).collect(),
        rows: Vec::new(),
    };
    let caveat = caveat.map_or_else(|| "none".to_string(), |c| format!("not a tax: {c}"));
    let fits = fit::both(obs);
    if fits.is_empty() {
        t.rows.push(vec![
            Cell::text("-"),
            Cell::text("no cell has two pairs with a spread: nothing to fit"),
            Cell::text("-"),
            Cell::text("-"),
            Cell::text(caveat),
        ]);
        return t;
    }
    for f in &fits {
        let per = match f.per {
            Per::Forward => "per forward",
            Per::Token => "per token",
        };
        let test = match (f.explains(), f.p) {
            (Some(true), Some(p)) => format!(
                "chi2 {:.2} on {} df, p = {p:.3}: one constant explains the {} cells",
                f.chi2,
                f.df,
                f.df + 1
            ),
            (Some(false), Some(p)) => format!(
                "chi2 {:.2} on {} df, p = {p:.3}: one constant does not explain the {} cells (interval widened by sqrt(chi2 / df))",
                f.chi2,
                f.df,
                f.df + 1
            ),
            _ => "one cell: no test of whether one constant explains the cells".to_string(),
        };
        let residuals: Vec<String> = f.residuals.iter().map(|(c, r)| format!("{c} {r:+.3} ms")).collect();
        t.rows.push(vec![
            Cell::text(per),
            Cell::text(format!(
                "{:+.3} ms [{:+.3}, {:+.3}] (95%, n={} cells)",
                f.beta,
                f.ci95.0,
                f.ci95.1,
                f.residuals.len()
            )),
            Cell::text(test),
            Cell::text(residuals.join(", ")),
            Cell::text(caveat.clone()),
        ]);
    }
    t
}

/// The rows a fit of `obs` rests on.
pub fn fit_rows<'a>(rows: &'a [TaxRow], obs: &[Obs]) -> Vec<&'a TaxRow> {
    rows.iter().filter(|r| r.reported() && fit_metric(r) && obs.iter().any(|o| o.cell == r.cell)).collect()
}

/// Whether a row's metric is the one its cell's fit takes (TPOT of decode, TTFT of the
/// cache hit).
fn fit_metric(r: &TaxRow) -> bool {
    if r.cell.starts_with("decode B=") { r.metric == TPOT.name } else { r.metric == TTFT.name }
}

fn seed(cell: usize, pass: usize, i: usize) -> u64 {
    ((cell as u64) << 48) ^ ((pass as u64) << 24) ^ i as u64 ^ 0x7a11_0000_0000
}

fn measure(
    cell: &str,
    results: &[crate::serve_bench::client::RequestResult],
    wall: f64,
    metrics: &[MetricDef],
) -> CellMeasure {
    let l = LevelSummary::of(cell.to_string(), None, None, results, wall);
    let mut m = BTreeMap::new();
    for d in metrics {
        let v = match d.name {
            "output tok/s" => (l.ok > 0).then_some(l.output_tok_s),
            "TPOT ms" => l.tpot.mean,
            "TTFT ms" => l.ttft.mean,
            _ => None,
        };
        if let Some(v) = v {
            m.insert(d.name.to_string(), v);
        }
    }
    CellMeasure {
        cell: cell.to_string(),
        requests: l.requests,
        failed: l.failed,
        first_error: results.iter().find_map(|r| r.error.clone()),
        metrics: m,
        hashes: results.iter().filter(|r| r.ok).map(|r| (r.key.clone(), r.output_hash.clone())).collect(),
        prompt_tokens: results.iter().filter(|r| r.ok).find_map(|r| r.prompt_tokens),
        cached_tokens: results.iter().filter(|r| r.ok).find_map(|r| r.cached_tokens),
        invalid: None,
        detail: None,
    }
}

impl Mode for Sweep {
    fn name(&self) -> &'static str {
        "sweep"
    }

    fn cells(&self) -> Vec<CellDef> {
        let mut v: Vec<CellDef> = self
            .concurrency
            .iter()
            .map(|b| CellDef { name: format!("decode B={b}"), metrics: vec![TOK_S, TPOT] })
            .collect();
        v.push(CellDef { name: format!("prompt-cache hit (suffix {})", self.suffix), metrics: vec![TTFT] });
        v.push(CellDef { name: format!("uncached prefill {}", self.prefill_tokens), metrics: vec![TTFT] });
        v.push(CellDef { name: format!("chunked prefill {}", self.chunked_tokens), metrics: vec![TTFT] });
        v
    }

    fn design(&self) -> Design {
        Design::SWEEP
    }

    fn panels(
        &self,
        rows: &[TaxRow],
        _passes: &[PassRecord],
        design: Design,
        margin_pct: f64,
    ) -> Vec<crate::plot::Panel> {
        super::plots::sweep(rows, design, margin_pct)
    }

    fn fit(&self, rows: &[TaxRow], aa_fp_pct: Option<f64>) -> Option<Table> {
        let obs = fit_obs(rows, self.suffix);
        let caveats = super::analysis::run_caveats(&fit_rows(rows, &obs), aa_fp_pct);
        Some(fit_table(&obs, (!caveats.is_empty()).then(|| caveats.join("; ")).as_deref()))
    }

    fn server_args(&self) -> Vec<OsString> {
        // Every stream of the widest level gets a slot, so B streams decode together, and
        // the queue holds them all, so none is refused with 429 by construction.
        let widest = self.concurrency.iter().copied().max().unwrap_or(1).to_string();
        vec!["--parallel".into(), widest.clone().into(), "--max-queue".into(), widest.into()]
    }

    async fn run_pass(&self, target: &Target, pass: usize, timeout: Duration) -> Vec<CellMeasure> {
        let defs = self.cells();
        let mut out = Vec::with_capacity(defs.len());
        let mut ci = 0;
        for &b in &self.concurrency {
            let name = &defs[ci].name;
            if self.skipped.contains_key(name) {
                ci += 1;
                continue;
            }
            let specs: Vec<RequestSpec> = (0..b * self.rounds.max(1))
                .map(|i| {
                    self.spec(
                        format!("{name}/p{pass}/{i}"),
                        self.decode_prompt,
                        0,
                        seed(ci, pass, i),
                        self.max_tokens,
                    )
                })
                .collect();
            let run = load::run(target, specs, Arrival::Closed(b), timeout).await;
            out.push(measure(name, &run.results, run.wall.as_secs_f64(), &defs[ci].metrics));
            ci += 1;
        }
        // Prompt cache: one request adopts the prefix, then each hit prefills only its suffix.
        let name = &defs[ci].name;
        if !self.skipped.contains_key(name) {
            out.push(self.cache_cell(target, pass, timeout, ci, name, &defs[ci].metrics).await);
        }
        ci += 1;
        for tokens in [self.prefill_tokens, self.chunked_tokens] {
            let name = &defs[ci].name;
            if self.skipped.contains_key(name) {
                ci += 1;
                continue;
            }
            let specs: Vec<RequestSpec> = (0..self.prefill_requests)
                .map(|i| self.spec(format!("{name}/p{pass}/{i}"), tokens, 0, seed(ci, pass, i), 1))
                .collect();
            let run = load::run(target, specs, Arrival::Closed(1), timeout).await;
            out.push(measure(name, &run.results, run.wall.as_secs_f64(), &defs[ci].metrics));
            ci += 1;
        }
        out
    }

    fn skipped(&self) -> Vec<(String, String)> {
        self.skipped.iter().map(|(c, why)| (c.clone(), why.clone())).collect()
    }
}

impl Sweep {
    /// The prompt-cache cell of one pass: a priming request, then the hits.
    async fn cache_cell(
        &self,
        target: &Target,
        pass: usize,
        timeout: Duration,
        ci: usize,
        name: &str,
        metrics: &[MetricDef],
    ) -> CellMeasure {
        let total = self.prefix + self.suffix;
        let prime =
            self.spec(format!("{name}/p{pass}/prime"), total, self.prefix, seed(ci, pass, 999_999), 1);
        let primed = load::run(target, vec![prime], Arrival::Closed(1), timeout).await;
        let hits: Vec<RequestSpec> = (0..self.cache_requests)
            .map(|i| self.spec(format!("{name}/p{pass}/{i}"), total, self.prefix, seed(ci, pass, i), 1))
            .collect();
        let run = load::run(target, hits, Arrival::Closed(1), timeout).await;
        let mut m = measure(name, &run.results, run.wall.as_secs_f64(), metrics);
        if let Some(p) = primed.results.first() {
            m.requests += 1;
            if !p.ok {
                m.failed += 1;
                m.first_error = m.first_error.or_else(|| p.error.clone());
            } else {
                m.hashes.insert(p.key.clone(), p.output_hash.clone());
            }
        }
        m
    }
}

#[cfg(test)]
mod fit_tests {
    use super::super::records::Better;
    use super::*;
    use crate::verdict::sheet::Sheet;

    fn row(cell: &str, metric: &str, pairs: Vec<(f64, f64)>) -> TaxRow {
        TaxRow {
            cell: cell.into(),
            metric: metric.into(),
            better: Better::Lower,
            num_n: pairs.len(),
            den_n: pairs.len(),
            num: None,
            den: None,
            judged: None,
            spread_num: None,
            spread_den: None,
            contaminated: false,
            caveats: Vec::new(),
            verdict: String::new(),
            pairs,
        }
    }

    #[test]
    fn the_fit_takes_the_cells_with_one_forward_in_the_window() {
        // Narrow - wide: TPOT +2 ms at B = 2 and 4 and TTFT +2 ms on the cache hit, each
        // +-0.1 over two pairs; B = 1 and the uncached control are not in the window.
        let rows = vec![
            row("decode B=1", "TPOT ms", vec![(10.0, 10.0), (10.0, 10.0)]),
            row("decode B=2", "TPOT ms", vec![(12.1, 10.0), (11.9, 10.0)]),
            row("decode B=2", "output tok/s", vec![(80.0, 100.0), (80.0, 100.0)]),
            row("decode B=4", "TPOT ms", vec![(14.1, 12.0), (13.9, 12.0)]),
            row("prompt-cache hit (suffix 4)", "TTFT ms", vec![(22.1, 20.0), (21.9, 20.0)]),
            row("uncached prefill 256", "TTFT ms", vec![(50.0, 40.0), (50.0, 40.0)]),
        ];
        let obs = fit_obs(&rows, 4);
        let cells: Vec<(&str, f64)> = obs.iter().map(|o| (o.cell.as_str(), o.m)).collect();
        assert_eq!(cells, [("decode B=2", 2.0), ("decode B=4", 4.0), ("prompt-cache hit (suffix 4)", 4.0)]);
        assert!(obs.iter().all(|o| (o.y - 2.0).abs() < 1e-9 && (o.se - 0.1).abs() < 1e-9), "{obs:?}");
        let text = Sheet { tables: vec![fit_table(&obs, None)], ..Sheet::default() }.markdown();
        // Equal taxes at M = 2 and 4: a constant per forward explains them exactly.
        let first = text.lines().find(|l| l.starts_with("| per ")).unwrap();
        assert!(first.starts_with("| per forward | +2.000 ms [+1.887, +2.113] (95%, n=3 cells)"), "{text}");
        assert!(first.contains("one constant explains the 3 cells") && first.ends_with("| none |"), "{text}");
        assert!(text.contains("| per token |") && text.contains("does not explain"), "{text}");
        assert!(fit_table(&[], None).rows[0][1].text.contains("nothing to fit"));
    }
}
