//! `cargo xtask qmv-pin-tax`: what the rest of a `kiln serve` process pays when
//! `qmv_wide` is pinned off, priced by interleaved (ABBA) boots of both arms, each pinned
//! explicitly. `abba` boots and measures, `arms` says which arm a boot is, `stats` and
//! `analysis` turn passes into the tax; `sweep` (the batched-decode cells) and `mixed`
//! (one speculative stream beside classic ones) are the modes, each an [`abba::Mode`].

pub mod aa;
pub mod abba;
pub mod analysis;
pub mod arms;
pub mod mixed;
pub mod plots;
mod records;
pub mod stats;
pub mod sweep;

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use xshell::Shell;

use self::abba::{Mode, Plan};
use self::arms::{Order, mixed_order_arg, order_arg};
use crate::child::{self, Shutdown};
use crate::console::{self, usage};
use crate::quiet::Limits;
use crate::serve_bench::list_arg;

/// `--mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeArg {
    /// Batched decode at each concurrency, a prompt-cache hit, and prefill controls.
    Sweep,
    /// Windows of one speculative stream beside classic streams; arms A and B.
    Mixed,
}

/// Flags of `cargo xtask qmv-pin-tax`.
#[derive(clap::Args, Debug)]
pub struct QmvPinTax {
    /// What to measure.
    #[arg(long, value_enum)]
    mode: ModeArg,
    /// The model kiln serve loads.
    #[arg(
        short = 'm',
        long,
        alias = "models",
        value_name = "MODEL",
        default_value = "synthetic:qwen2.5-0.5b"
    )]
    model: String,
    /// Boot order. Sweep: 1 = wide (KILN_QMV_WIDE=1), 0 = narrow (KILN_QMV_WIDE=0)
    /// [default: "1 0 0 1 0 1 1 0"]. Mixed: A = default environment, B = KILN_QMV_WIDE=1
    /// KILN_SPEC_ALLOW_INEXACT=1 [default: "A B B A"]. As many of each.
    #[arg(long, value_name = "ARMS")]
    order: Option<String>,
    /// Sweep: measured passes per boot, after one discarded warm-up pass [default: 2].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    passes: Option<u64>,
    /// Mixed: measured windows per boot, after one discarded warm-up window [default: 2].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    windows: Option<u64>,
    /// Mixed: classic streams beside the speculative one in each window.
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=64))]
    classic_streams: u64,
    /// Mixed: the speculative stream's max_tokens [default: sized from the boot's previous
    /// window to outlast the classic streams; the first window gets max-tokens x (K + 1)].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    spec_max_tokens: Option<u64>,
    /// Mixed: tokens of the passage the speculative prompt repeats (2.5 times).
    #[arg(long, value_name = "N", default_value_t = 48, value_parser = clap::value_parser!(u64).range(2..))]
    passage_tokens: u64,
    /// Mixed: kiln serve's --draft-tokens (K).
    #[arg(long, value_name = "K", default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=32))]
    draft_tokens: u64,
    /// Mixed: seconds the speculative stream may take to end after the classic streams.
    #[arg(long, value_parser = crate::args::count(0), value_name = "SECS", default_value_t = 120)]
    drain_timeout: u64,
    /// The port every boot binds; nothing may answer on it before a boot.
    #[arg(long, value_name = "PORT", default_value_t = 8113, value_parser = clap::value_parser!(u16).range(1..))]
    port: u16,
    /// Batched-decode levels B, comma- or space-separated.
    #[arg(long, value_name = "LIST", default_value = "1,2,4,8", value_parser = list_arg)]
    concurrency: crate::serve_bench::Levels,
    /// Requests each stream of a decode cell sends per pass, one after another (not the
    /// ABBA pairs, which --order and --until-ci set; older commands spelled it rounds).
    #[arg(long = "requests-per-stream", alias = "rounds", value_parser = crate::args::count_usize(0), value_name = "N", default_value_t = 1)]
    rounds: usize,
    /// Tokens generated per decode request (mixed: per classic stream) [default: 32; mixed: 64].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(2..))]
    max_tokens: Option<u64>,
    /// Prompt tokens of a decode request.
    #[arg(long, value_parser = crate::args::count(0), value_name = "N", default_value_t = 16)]
    decode_prompt: u64,
    /// The prompt-cache cell's shared prefix, tokens.
    #[arg(long, value_parser = crate::args::count(0), value_name = "N", default_value_t = 256)]
    prefix_tokens: u64,
    /// Its per-request suffix: the M of the cache-hit forward, inside qmv_wide's window.
    #[arg(long, value_parser = crate::args::count(0), value_name = "N", default_value_t = 4)]
    suffix_tokens: u64,
    /// Measured cache hits per pass.
    #[arg(long, value_parser = crate::args::count_usize(0), value_name = "N", default_value_t = 4)]
    cache_requests: usize,
    /// The uncached prefill control's prompt, tokens.
    #[arg(long, value_parser = crate::args::count(0), value_name = "N", default_value_t = 256)]
    prefill_tokens: u64,
    /// The chunked prefill control's prompt, tokens (longer than the server's prefill chunk).
    #[arg(long, value_parser = crate::args::count(0), value_name = "N", default_value_t = 1024)]
    chunked_tokens: u64,
    /// Requests per prefill control per pass.
    #[arg(long, value_parser = crate::args::count_usize(0), value_name = "N", default_value_t = 2)]
    prefill_requests: usize,
    /// Seconds to wait between boots.
    #[arg(long, value_parser = crate::args::count(0), value_name = "SECS", default_value_t = 2)]
    cooldown: u64,
    /// Wait (up to --quiet-timeout) for a quiet machine before each boot and pass,
    /// instead of only marking passes measured on a busy one as disturbed.
    #[arg(long)]
    require_quiet: bool,
    /// The bound of --require-quiet's wait, seconds.
    #[arg(long, value_parser = crate::args::count(0), value_name = "SECS", default_value_t = 300)]
    quiet_timeout: u64,
    /// Other processes' CPU, in cores, above which the machine counts as busy.
    #[arg(long, value_name = "CPUS", default_value_t = 0.5)]
    busy_cpus: f64,
    /// An arm's spread (max - min over mean) trusted up to this percentage.
    #[arg(long, value_name = "PCT", default_value_t = 4.0)]
    trust_limit: f64,
    /// Seconds to wait for a boot's /health.
    #[arg(long, value_parser = crate::args::count(0), value_name = "SECS", default_value_t = 600)]
    boot_timeout: u64,
    /// Seconds between SIGTERM and SIGKILL of a server's group.
    #[arg(long, value_parser = crate::args::count(0), value_name = "SECS", default_value_t = 10)]
    grace: u64,
    /// Seconds before one request fails as timed out, 1 to 86400 (0 would fail every request at once).
    #[arg(long, value_name = "SECS", default_value_t = 300, allow_hyphen_values = true,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    request_timeout: u64,
    /// Booting kiln serve, and where run directories go.
    #[command(flatten)]
    boot: crate::run_dir::BootArgs,
    /// Where the dated record goes [default: the run directory].
    #[arg(long, value_name = "DIR", conflicts_with_all = ["repo_record", "no_record"])]
    record_dir: Option<PathBuf>,
    /// Write the dated record into the repository's docs/benchmark_results, to commit it.
    #[arg(long, conflicts_with = "no_record")]
    repo_record: bool,
    /// Write no dated record (the run directory still has everything).
    #[arg(long)]
    no_record: bool,
    /// The sequential rule, its budgets and the equivalence margin.
    #[command(flatten)]
    seq: crate::verdict::SequentialFlags,
    /// A/A: both slots of every pair run the same environment (the sweep's wide arm, the
    /// mixed mode's A), to measure this machine's false-positive rate and interval width
    /// per metric; the run writes aa.json, which later A/B runs on the same device cite.
    #[arg(long)]
    aa: bool,
}

impl QmvPinTax {
    pub fn run(self, sh: &Shell) -> Result<ExitCode> {
        let root = sh.current_dir();
        // Up front, before anything is built or booted: an inherited pin collapses the arms.
        let vars: &[&str] = match self.mode {
            ModeArg::Sweep => &arms::ARM_VARS,
            ModeArg::Mixed => &arms::MIXED_ARM_VARS,
        };
        let inherited = arms::inherited_arm_vars(vars, |k| std::env::var(k).ok());
        if !inherited.is_empty() {
            usage!(
                "{} is set in the environment: the driver pins each arm itself, and an inherited value would make both arms one kernel; unset it and run again",
                inherited.join(", ")
            );
        }
        let order = match (self.mode, self.order.as_deref()) {
            (ModeArg::Sweep, o) => order_arg(o.unwrap_or(arms::DEFAULT_ORDER)),
            (ModeArg::Mixed, o) => mixed_order_arg(o.unwrap_or(arms::DEFAULT_MIXED_ORDER)),
        };
        let order = match order {
            Ok(o) => o,
            Err(e) => usage!("--order: {e}"),
        };
        match (self.mode, self.passes, self.windows) {
            (ModeArg::Sweep, _, Some(_)) => {
                usage!("--windows is for --mode mixed: the sweep measures --passes")
            }
            (ModeArg::Mixed, Some(_), _) => {
                usage!("--passes is for --mode sweep: the mixed mode measures --windows")
            }
            _ => {}
        }
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !positive(self.trust_limit) || !(positive(self.busy_cpus) || self.busy_cpus == 0.0) {
            usage!("--trust-limit and --busy-cpus: expected positive numbers");
        }
        let runs_dir = self.boot.runs_dir(&root)?;
        // `None`: the run directory, made later.
        let record_dir = match &self.record_dir {
            Some(d) => Some(crate::args::user_path(d)?),
            None => self.repo_record.then(|| root.join("docs/benchmark_results")),
        };
        let shutdown = Shutdown::install()?;
        let engine = match self.boot.engine(&root, &shutdown)? {
            Ok(e) => e,
            Err(sig) => {
                eprintln!("interrupted by {} during the build", child::signal_name(sig));
                return Ok(ExitCode::from(child::exit_code_for(sig)));
            }
        };
        crate::run_dir::check_writable(&runs_dir, "--runs-dir")?;
        if !self.no_record
            && let Some(dir) = &record_dir
        {
            let flag = if self.repo_record { "--repo-record" } else { "--record-dir" };
            crate::run_dir::check_writable(dir, flag)?;
        }
        let ctx = Ctx { root, runs_dir, record_dir, engine, order, shutdown };
        match self.mode {
            ModeArg::Sweep => {
                let mut mode = sweep::Sweep {
                    concurrency: self.concurrency.0.clone(),
                    rounds: self.rounds.max(1),
                    decode_prompt: self.decode_prompt,
                    max_tokens: self.max_tokens.unwrap_or(32),
                    prefix: self.prefix_tokens,
                    suffix: self.suffix_tokens,
                    cache_requests: self.cache_requests.max(1),
                    prefill_tokens: self.prefill_tokens,
                    chunked_tokens: self.chunked_tokens,
                    prefill_requests: self.prefill_requests.max(1),
                    served: crate::server::served_name(&self.model, &self.boot.serve_args).0,
                    skipped: Default::default(),
                };
                mode.skipped = context_skips(&ctx.engine, &self.model, &mode.shapes());
                for (cell, why) in &mode.skipped {
                    eprintln!("{cell}: SKIP:context: {why}");
                }
                if mode.skipped.len() == mode.cells().len() {
                    usage!(
                        "no cell fits the context of {}: every cell is SKIP:context; pass shorter --decode-prompt, --max-tokens, --prefix-tokens, --prefill-tokens and --chunked-tokens",
                        self.model
                    );
                }
                self.drive(&mode, self.passes.unwrap_or(2), ctx)
            }
            ModeArg::Mixed => {
                let mode = mixed::Mixed::new(
                    self.classic_streams as usize,
                    self.max_tokens.unwrap_or(64),
                    self.decode_prompt,
                    self.spec_max_tokens,
                    self.passage_tokens,
                    self.draft_tokens as usize,
                    Duration::from_secs(self.drain_timeout),
                    crate::server::served_name(&self.model, &self.boot.serve_args).0,
                );
                self.drive(&mode, self.windows.unwrap_or(2), ctx)
            }
        }
    }

    /// Boots the order with `mode`, then analyses, summarises, plots and records.
    fn drive<M: Mode + std::fmt::Debug>(&self, mode: &M, passes: u64, ctx: Ctx) -> Result<ExitCode> {
        let Ctx { root, runs_dir, record_dir, engine, order, shutdown } = ctx;
        let unit = mode.unit();
        // An A/A run's slots are arms of their own (A1, A2) running one environment, so
        // every record names what the boot was and what it ran.
        let (design, order) = if self.aa {
            let (base, aa) = (mode.design(), mode.design().aa());
            (aa, order.renamed([base.den, base.num], [aa.den, aa.num]))
        } else {
            (mode.design(), order)
        };
        let run_dir = crate::run_dir::create_run_dir(&runs_dir, "qmv-pin-tax")?;
        let (mut env, device) = crate::run_dir::fingerprint(&root, Some(&engine));
        env["qmv_pin_tax"] = serde_json::json!({
            "mode": mode.name(),
            "model": self.model,
            "order": order.tokens(),
            "arms": order.0.iter().map(|a| a.to_string()).collect::<std::collections::BTreeSet<_>>(),
            "passes": passes,
            "unit": unit,
            "sizes": format!("{mode:?}"),
            "port": self.port,
            "cells": mode.cells().iter().map(|c| c.name.clone()).collect::<Vec<_>>(),
            "skipped": mode.skipped().into_iter().collect::<std::collections::BTreeMap<_, _>>(),
            "serve_args": self.boot.serve_args,
            "cooldown_s": self.cooldown,
            "require_quiet": self.require_quiet,
            "busy_cpus": self.busy_cpus,
            "trust_limit_pct": self.trust_limit,
            "statistics": if self.seq.until_ci.is_some() {
                format!("{} = geometric mean of ABBA pair ratios; 95% CI = Gaussian-mixture t confidence sequence on log ratios (valid at any stopping time)", design.ratio_name())
            } else {
                format!("{} = geometric mean of ABBA pair ratios; 95% CI = paired t interval on log ratios", design.ratio_name())
            },
            "until_ci_pct": self.seq.until_ci,
            "max_pairs": self.seq.until_ci.map(|_| self.seq.max_pairs()),
            "max_time_s": self.seq.max_time.map(|d| d.as_secs_f64()),
            "margin_pct": self.seq.margin,
            "aa": self.aa,
        });
        crate::run_dir::write_env_json(&run_dir, &env)?;
        eprintln!(
            "qmv-pin-tax --mode {}: {} boots ({}), 1 warm-up + {passes} {} each, {} cells; run directory {}",
            mode.name(),
            order.0.len(),
            order.tokens(),
            analysis::plural(unit),
            mode.cells().len(),
            display(&root, &run_dir)
        );
        let plan = Plan {
            order: order.clone(),
            passes: passes as usize,
            port: self.port,
            model: self.model.clone(),
            kiln_bin: engine.bin.clone(),
            engine_args: crate::kiln_build::backend_args_unless_given(engine.backend, &self.boot.serve_args),
            serve_args: self.boot.serve_args.clone(),
            boot_timeout: Duration::from_secs(self.boot_timeout),
            grace: Duration::from_secs(self.grace),
            cooldown: Duration::from_secs(self.cooldown),
            require_quiet: self.require_quiet,
            quiet_timeout: Duration::from_secs(self.quiet_timeout),
            busy: Limits { others_cpus: self.busy_cpus },
            request_timeout: Duration::from_secs(self.request_timeout),
            run_dir: run_dir.clone(),
            cwd: root.clone(),
            first_boot: 0,
            deadline: self.seq.until_ci.and(self.seq.max_time).map(|d| std::time::Instant::now() + d),
        };
        let skipped = mode.skipped();
        let cells: Vec<records::CellDef> =
            mode.cells().into_iter().filter(|c| !skipped.iter().any(|(s, _)| *s == c.name)).collect();
        let judge = analysis::Judge {
            trust_pct: self.trust_limit,
            margin_pct: self.seq.margin,
            sequential: self.seq.until_ci.is_some(),
        };
        let started = std::time::Instant::now();
        let (out, order, stopped, scheduled) =
            self.run_blocks(mode, design, &plan, &cells, &judge, &shutdown)?;
        let rows = analysis::analyse_with(&cells, &order, &out.passes, &judge, design);
        let fnd = analysis::findings(&out.passes, unit);
        let run_name = run_dir.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned());
        let pairs_run = order.pairs_of(design.num, design.den).len();
        let secs_per_pair = (pairs_run > 0).then(|| started.elapsed().as_secs_f64() / pairs_run as f64);
        // An A/A run's own floor; an A/B run cites the latest A/A run of its own mode.
        let (own, cited) = if self.aa {
            let f = aa::floor(&device, &run_name, mode.name(), &rows);
            aa::write(&run_dir, &f)?;
            (Some(f), None)
        } else {
            (None, aa::latest(&runs_dir, &device, mode.name(), &run_dir))
        };
        let floor = own.as_ref().or(cited.as_ref().map(|(_, f)| f));
        let mut sheet = analysis::sheet(&analysis::SheetInput {
            rows: &rows,
            design,
            judge: &judge,
            unit,
            secs_per_pair,
            aa: floor,
        });
        // The fit names the arms it subtracts (narrow - wide); an A/A run has neither.
        if let Some(t) =
            mode.fit(&rows, floor.and_then(records::NoiseFloor::false_positive_pct)).filter(|_| !self.aa)
        {
            sheet.tables.push(t);
        }
        match (&own, &cited) {
            (Some(f), _) => {
                sheet.tables.push(aa::table(f));
                sheet.notes.push(format!(
                    "A/A run: slots A1 and A2 both run {}, so every difference between them is noise; aa.json keeps this floor for later A/B runs of --mode {} on this device",
                    design.aa_env.arm(),
                    mode.name()
                ));
            }
            (None, Some((dir, f))) => {
                sheet.notes.push(format!(
                    "the latest A/A run of --mode {} on this device ({}), for reading the intervals above:",
                    mode.name(),
                    display(&root, dir)
                ));
                sheet.notes.extend(aa::describe(f));
            }
            (None, None) => sheet.notes.push(format!(
                "no A/A run of --mode {} on this device under {}: `--aa` measures its false-positive rate and interval width",
                mode.name(),
                display(&root, &runs_dir)
            )),
        }
        let notes = &mut sheet.notes;
        if !skipped.is_empty() {
            notes.push(format!("skipped cells (never sent): {}", skipped.len()));
            notes.extend(skipped.iter().map(|(cell, why)| format!("- {cell}: SKIP:context: {why}")));
        }
        notes.extend(analysis::notes(&fnd, &out.boots, unit));
        if let (Some(target), Some(stopped)) = (self.seq.until_ci, &stopped) {
            notes.push(format!("{}; {pairs_run} pairs, {} boots", stopped.describe(target), order.0.len()));
        }
        let planned = scheduled * (passes as usize + 1);
        notes.push(format!("{} written: {} of {planned} planned", analysis::plural(unit), out.passes.len()));
        // Samples per arm: an arm without a counted measurement leaves no ratio at all.
        let empty: Vec<&str> = [design.num, design.den]
            .iter()
            .filter(|&&arm| {
                !out.passes.iter().any(|p| p.arm == arm && p.ok && p.invalid.is_none() && p.pass > 0)
            })
            .map(|a| a.as_str())
            .collect();
        if let Some(sig) = out.interrupted {
            notes.push(format!("interrupted by {}: partial summary", child::signal_name(sig)));
        }
        if let Some(why) = &out.aborted {
            notes.push(format!("stopped early: {why}"));
        }
        let text = finish(&run_dir, &sheet, &device)?;
        let svg = run_dir.join("tax.svg");
        if let Err(e) = crate::plot::write_svg(&svg, &mode.panels(&rows, &out.passes, design, judge.margin()))
        {
            eprintln!("warning: no plot: {e:#}");
        }
        let record = if self.no_record || out.passes.is_empty() {
            None
        } else {
            Some(write_record(
                record_dir.as_deref().unwrap_or(&run_dir),
                &device,
                &env,
                self,
                &out,
                &text,
                &svg,
            )?)
        };
        crate::report::write_or_warn(&run_dir);
        console::out(&format!("\n{text}"))?;
        if let Some(r) = &record {
            eprintln!("record: {}", display(&root, r));
        }
        eprintln!("results: {}", display(&root, &run_dir));
        if let Some(sig) = out.interrupted {
            return Ok(ExitCode::from(child::exit_code_for(sig)));
        }
        let mut reasons = Vec::new();
        let aborted = out.aborted.is_some();
        if let Some(why) = out.aborted {
            reasons.push(why);
        }
        if !fnd.failed.is_empty() {
            reasons.push(format!("{} {} failed", fnd.failed.len(), analysis::plural(unit)));
        }
        if !fnd.failed_cells.is_empty() {
            reasons.push(format!("{} cells failed in a counted {unit}", fnd.failed_cells.len()));
        }
        if !empty.is_empty() && !aborted {
            reasons.push(format!("no counted {unit} for arm {}", empty.join(", ")));
        }
        if !fnd.contaminated.is_empty() {
            reasons
                .push(format!("{} cells contaminated (outputs differ across arms)", fnd.contaminated.len()));
        }
        for r in &reasons {
            eprintln!("exit 1: {r}");
        }
        Ok(if reasons.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
    }
}

/// Writes the run's summary: summary.md (the terminal's text: the host-execution notes,
/// then the sheet's markdown) and readings.json (the sheet itself, which pages render).
/// Returns the text the terminal prints.
pub fn finish(run_dir: &Path, sheet: &crate::verdict::sheet::Sheet, device: &str) -> Result<String> {
    // Figures of the CUDA kernels' host execution are the CPU's: said before any of them.
    let mut text = crate::machine::host_execution_notes([device]);
    text.push_str(&sheet.markdown());
    fs::write(run_dir.join("summary.md"), &text).context("writing summary.md")?;
    sheet.write(run_dir)?;
    Ok(text)
}

/// The cells of `shapes` (name, longest prompt, max_tokens) that cannot fit the model's
/// context, with the reason, by the engine's own rule (`kiln estimate`'s
/// `within_context`), as bench-longprompt's `SKIP:context`. When the estimate cannot
/// answer (another server's binary, a model it cannot read), every cell runs and the
/// server's own refusal fails the cell.
fn context_skips(
    engine: &crate::run_dir::Engine,
    model: &str,
    shapes: &[(String, u64, u64)],
) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    for (cell, prompt, max_tokens) in shapes {
        let run = std::process::Command::new(&engine.bin)
            .args(["estimate", "-m", model, "--prompt-tokens", &prompt.to_string()])
            .args(["--max-tokens", &max_tokens.to_string()])
            .args(crate::kiln_build::backend_args(engine.backend))
            .stdin(std::process::Stdio::null())
            .output();
        let report = match &run {
            Ok(o) if o.status.success() => {
                kiln_protocol::EstimateReport::parse(&String::from_utf8_lossy(&o.stdout))
            }
            _ => Ok(None),
        };
        match report {
            Ok(Some(r)) if !r.within_context => {
                out.insert(
                    cell.clone(),
                    format!(
                        "{} prompt plus {} generated tokens exceed the model's context of {} tokens",
                        r.prompt_tokens, r.max_tokens, r.context_length
                    ),
                );
            }
            Ok(Some(_)) => {}
            _ => {
                let why = match &run {
                    Ok(o) => crate::sweep::classify::reason_line(&String::from_utf8_lossy(&o.stderr)),
                    Err(e) => e.to_string(),
                };
                eprintln!(
                    "warning: kiln estimate could not check the cells against the model's context ({why}); every cell runs"
                );
                return std::collections::BTreeMap::new();
            }
        }
    }
    out
}

impl QmvPinTax {
    /// Runs the order, then (with `--until-ci`) further ABBA blocks of four boots, until
    /// every reported ratio's interval is narrow enough, every ratio is decided at the
    /// margin, or a budget ends the run. Returns every boot and pass, the order actually
    /// run, why the sequential run stopped, and how many boots were scheduled.
    fn run_blocks<M: Mode>(
        &self,
        mode: &M,
        design: analysis::Design,
        plan: &Plan,
        cells: &[records::CellDef],
        judge: &analysis::Judge,
        shutdown: &Shutdown,
    ) -> Result<(abba::Outcome, Order, Option<crate::verdict::sequence::Stopped>, usize)> {
        use crate::verdict::sequence::Stopped;
        let started = std::time::Instant::now();
        let mut all = abba::Outcome::default();
        let mut full = Order(Vec::new());
        let mut block = plan.order.clone();
        let mut scheduled = 0usize;
        let stopped = loop {
            let t0 = std::time::Instant::now();
            let p = Plan { order: block.clone(), first_boot: full.0.len(), ..plan.clone() };
            let out = abba::run(mode, &p, shutdown)?;
            scheduled += block.0.len();
            // Only the boots that ran: the budget or a signal may end a block early.
            full.0.extend(block.0.iter().copied().take(out.boots.len()));
            all.boots.extend(out.boots);
            all.passes.extend(out.passes);
            all.interrupted = out.interrupted;
            all.aborted = out.aborted;
            let Some(target) = self.seq.until_ci else { break None };
            if out.out_of_time {
                break Some(Stopped::MaxTime);
            }
            if let Some(sig) = all.interrupted {
                break Some(Stopped::Ended(format!("interrupted by {}", child::signal_name(sig))));
            }
            if let Some(why) = &all.aborted {
                break Some(Stopped::Ended(why.clone()));
            }
            let rows = analysis::analyse_with(cells, &full, &all.passes, judge, design);
            let reported: Vec<&analysis::TaxRow> = rows.iter().filter(|r| !r.contaminated).collect();
            let widths: Vec<Option<f64>> =
                reported.iter().map(|r| r.ratio().and_then(|x| x.half_width_pct())).collect();
            if widths.iter().all(|w| w.is_some_and(|w| w < target)) {
                break Some(Stopped::Converged);
            }
            if let Some(m) = judge.margin_pct
                && reported.iter().all(|r| r.judged.as_ref().is_some_and(|j| j.decided()))
            {
                break Some(Stopped::Decided(m));
            }
            let pairs = full.pairs_of(design.num, design.den).len();
            if pairs + 2 > self.seq.max_pairs() {
                break Some(Stopped::MaxPairs(pairs));
            }
            // The next block takes about as long as the last one per boot.
            let per_boot = t0.elapsed() / block.0.len().max(1) as u32;
            if let Some(max) = self.seq.max_time
                && started.elapsed() + per_boot * 4 > max
            {
                break Some(Stopped::MaxTime);
            }
            let widest = reported
                .iter()
                .zip(&widths)
                .max_by(|a, b| a.1.unwrap_or(f64::INFINITY).total_cmp(&b.1.unwrap_or(f64::INFINITY)));
            if let Some((r, _)) = widest {
                eprintln!(
                    "--until-ci {target}%: {pairs} pairs; widest interval {} ({} {}); adding 4 boots; {}",
                    r.ratio().map_or("not bounded yet".to_string(), |x| x.width()),
                    r.cell,
                    r.metric,
                    self.seq.budget().eta(pairs, started.elapsed(), Some(2.0 * per_boot.as_secs_f64()))
                );
            }
            // ABBA blocks alternate which arm opens them, so a drift cancels across blocks.
            let last_open = full.0.get(full.0.len().saturating_sub(4)).copied().unwrap_or(design.num);
            let (a, b) =
                if last_open == design.num { (design.den, design.num) } else { (design.num, design.den) };
            block = Order(vec![a, b, b, a]);
        };
        Ok((all, full, stopped, scheduled))
    }
}

/// A short, file-name-safe name for the device: `cpu-epyc-9r14-2cpu`.
pub fn device_slug(backend: &str, cpu: &str, cpus: usize) -> String {
    const NOISE: [&str; 9] = ["amd", "intel", "r", "tm", "processor", "cpu", "core", "with", "apple"];
    let words: Vec<String> = cpu
        .to_lowercase()
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty() && !NOISE.contains(w) && !w.ends_with("-core"))
        .take(2)
        .map(str::to_string)
        .collect();
    let mut s = backend.to_string();
    for w in words {
        s.push('-');
        s.push_str(&w);
    }
    format!("{s}-{cpus}cpu")
}

fn write_record(
    dir: &Path,
    device: &str,
    env: &serde_json::Value,
    flags: &QmvPinTax,
    out: &abba::Outcome,
    summary: &str,
    svg: &Path,
) -> Result<PathBuf> {
    let backend = env["backend"].as_str().unwrap_or("cpu");
    let cpu = env["cpu"].as_str().unwrap_or("unknown");
    let cpus = env["cpus"].as_u64().unwrap_or(0) as usize;
    let date = chrono::Utc::now().format("%Y-%m-%d");
    let mut kind = match flags.mode {
        ModeArg::Sweep => String::new(),
        ModeArg::Mixed => "mixed-".to_string(),
    };
    if flags.aa {
        kind.insert_str(0, "aa-");
    }
    let stem = format!("qmv-pin-tax-{kind}{}-{date}", device_slug(backend, cpu, cpus));
    let mut path = dir.join(format!("{stem}.md"));
    let mut i = 2;
    while path.exists() {
        path = dir.join(format!("{stem}-{i}.md"));
        i += 1;
    }
    let mut s = String::new();
    let what = if flags.aa { "A/A noise floor (identical arms A1 and A2)" } else { "qmv_wide pin tax" };
    let _ = writeln!(s, "# {what}, --mode {}: {device}, {date}\n", flags.mode_name());
    let section = match flags.mode {
        _ if flags.aa => "Running until the answer is known",
        ModeArg::Sweep => "Reading the tax",
        ModeArg::Mixed => "The mixed mode: bystanders of a speculative stream",
    };
    let _ = writeln!(
        s,
        "Generated by `cargo xtask qmv-pin-tax`; how to read it: docs/benchmarks.md, \"{section}\".\n"
    );
    let _ = writeln!(s, "| | |\n|---|---|");
    let args: Vec<&str> =
        env["command"].as_array().map(|a| a.iter().filter_map(|v| v.as_str()).collect()).unwrap_or_default();
    let (command, command_block) = command_row(&crate::shell::typed_command(&args));
    let rows: [(&str, String); 10] = [
        ("command", command),
        ("commit", env["commit"].as_str().unwrap_or("unknown").to_string()),
        ("host", env["host"].as_str().unwrap_or("").to_string()),
        ("device", device.to_string()),
        ("model", flags.model.clone()),
        ("order", env["qmv_pin_tax"]["order"].as_str().unwrap_or("").to_string()),
        (
            "passes",
            format!(
                "1 warm-up + {} measured {} per boot",
                env["qmv_pin_tax"]["passes"],
                analysis::plural(env["qmv_pin_tax"]["unit"].as_str().unwrap_or("pass"))
            ),
        ),
        (
            "cells",
            env["qmv_pin_tax"]["cells"].as_array().map_or(String::new(), |a| {
                a.iter().filter_map(|v| v.as_str()).collect::<Vec<_>>().join(", ")
            }),
        ),
        ("inherited KILN_*", env["kiln_env"].to_string()),
        ("started", env["started"].as_str().unwrap_or("").to_string()),
    ];
    for (k, v) in rows {
        let _ = writeln!(s, "| {k} | {v} |");
    }
    if let Some(block) = command_block {
        let _ = writeln!(s, "\nThe command:\n\n{block}");
    }
    let _ = writeln!(s, "\n## Result\n\n{summary}");
    let plot = path.with_extension("svg");
    if fs::copy(svg, &plot).is_ok()
        && let Some(name) = plot.file_name()
    {
        let _ = writeln!(s, "![the plot of the result]({})\n", name.to_string_lossy());
    }
    if flags.mode == ModeArg::Mixed {
        window_table(&mut s, out);
    } else {
        prompt_table(&mut s, out);
    }
    let _ = writeln!(s, "## Boots\n");
    let _ = writeln!(
        s,
        "| boot | arm | kernel line | gate line | ready after s | stop s | SIGKILL needed | failure |"
    );
    let _ = writeln!(s, "|---:|---|---|---|---:|---:|---|---|");
    for b in &out.boots {
        let k = b.kernel.as_ref().map_or("-".to_string(), |k| {
            format!("isa={} threads={} qmv_wide={} pinned={}", k.isa, k.threads, k.qmv_wide, k.pinned)
        });
        let g = b.gate.as_ref().map_or("-".to_string(), |g| {
            format!("outcome={} k={} kv_dtype={} qmv_wide={}", g.outcome, g.k, g.kv_dtype, g.qmv_wide)
        });
        let _ = writeln!(
            s,
            "| {} | {} | {k} | {g} | {} | {:.2} | {} | {} |",
            b.boot,
            b.arm.as_str(),
            b.ready_after_s.map_or("-".into(), |r| format!("{r:.2}")),
            b.stop_s,
            if b.killed { "yes" } else { "no" },
            b.failure.as_deref().unwrap_or("")
        );
    }
    fs::write(&path, s).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// The record's `command` cell for `line` (a command line quoted for a shell): a code span,
/// `|` escaped for the table, or, when the line holds a newline or a backtick that a
/// table cell cannot carry, a pointer to the fenced block returned beside it.
fn command_row(line: &str) -> (String, Option<String>) {
    if line.contains(['\n', '\r', '`']) {
        let fence = "~~~~~~~~";
        return ("(below the table)".into(), Some(format!("{fence}sh\n{line}\n{fence}\n")));
    }
    (format!("`{}`", line.replace('|', "\\|")), None)
}

/// The mixed record's per-window table, from each window's RESULT.
fn window_table(s: &mut String, out: &abba::Outcome) {
    let _ = writeln!(s, "## Windows\n");
    let _ = writeln!(
        s,
        "Each window's RESULT (its line in passes.jsonl). Overlap: the share of the classic streams' decode span the speculative stream decoded through (at least 95% to count); drained: it ended before the next window.\n"
    );
    let _ = writeln!(
        s,
        "| boot | arm | window | counted | overlap | drained | classic tok/s per stream | speculative tok/s | acceptance % | speculative max_tokens | why not |"
    );
    let _ = writeln!(s, "|---:|---|---|---|---:|---|---:|---:|---:|---:|---|");
    let num = |v: Option<&f64>| v.map_or("-".to_string(), |x| format!("{x:.2}"));
    for p in &out.passes {
        let what = if p.pass == 0 { "warm-up".to_string() } else { p.pass.to_string() };
        let Some(c) = p.cells.first() else {
            let _ = writeln!(
                s,
                "| {} | {} | {what} | no | - | - | - | - | - | - | {} |",
                p.boot,
                p.arm.as_str(),
                p.reason.as_deref().unwrap_or("")
            );
            continue;
        };
        let r = c.detail.as_ref().map(|d| &d["RESULT"]);
        let field = |k: &str| r.map(|r| r[k].clone()).unwrap_or_default();
        let counted = p.ok && p.invalid.is_none() && p.pass > 0;
        let _ = writeln!(
            s,
            "| {} | {} | {what} | {} | {} | {} | {} | {} | {} | {} | {} |",
            p.boot,
            p.arm.as_str(),
            if counted { "yes" } else { "no" },
            field("overlap").as_f64().map_or("-".into(), |x| format!("{:.1}%", 100.0 * x)),
            field("drained").as_bool().map_or("-", |d| if d { "yes" } else { "no" }),
            num(c.metrics.get("classic tok/s per stream")),
            num(c.metrics.get("speculative tok/s")),
            num(c.metrics.get("acceptance %")),
            field("spec_max_tokens"),
            p.reason.as_deref().or(p.invalid.as_deref()).unwrap_or(if p.pass == 0 { "warm-up" } else { "" })
        );
    }
    let _ = writeln!(s);
}

/// The sweep record's prompt-token table.
fn prompt_table(s: &mut String, out: &abba::Outcome) {
    let _ = writeln!(s, "## Prompt tokens as the server counted them\n");
    let _ = writeln!(
        s,
        "The first completed request of each cell in the first measured pass that has one: its prefill forward's M is prompt minus cached tokens (split by the server's prefill chunk).\n"
    );
    let _ = writeln!(s, "| cell | prompt tokens | cached tokens | M of the prefill |\n|---|---:|---:|---:|");
    let mut seen = std::collections::BTreeSet::new();
    for c in out.passes.iter().filter(|p| p.ok && p.pass > 0).flat_map(|p| p.cells.iter()) {
        if c.prompt_tokens.is_none() || !seen.insert(c.cell.clone()) {
            continue;
        }
        let p = c.prompt_tokens.unwrap_or(0);
        let cached = c.cached_tokens.unwrap_or(0);
        let _ = writeln!(
            s,
            "| {} | {p} | {} | {} |",
            c.cell,
            c.cached_tokens.map_or("-".into(), |x| x.to_string()),
            p.saturating_sub(cached)
        );
    }
    let _ = writeln!(s);
}

impl QmvPinTax {
    fn mode_name(&self) -> &'static str {
        match self.mode {
            ModeArg::Sweep => "sweep",
            ModeArg::Mixed => "mixed",
        }
    }
}

/// What `run` prepared for `drive`.
struct Ctx {
    root: PathBuf,
    runs_dir: PathBuf,
    record_dir: Option<PathBuf>,
    engine: crate::run_dir::Engine,
    order: Order,
    shutdown: Shutdown,
}

fn display(root: &Path, p: &Path) -> String {
    p.strip_prefix(root).unwrap_or(p).display().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_slugs_keep_the_model_words() {
        assert_eq!(device_slug("cpu", "AMD EPYC 9R14 96-Core Processor", 2), "cpu-epyc-9r14-2cpu");
        assert_eq!(device_slug("cpu", "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz", 8), "cpu-xeon-gold-8cpu");
        assert_eq!(device_slug("metal", "Apple M3 Ultra", 24), "metal-m3-ultra-24cpu");
    }

    #[test]
    fn a_request_timeout_of_0_is_refused_naming_the_flag() {
        #[derive(clap::Parser, Debug)]
        struct Cli {
            #[command(flatten)]
            flags: QmvPinTax,
        }
        use clap::Parser;
        for bad in ["0", "86401", "-1"] {
            let e = Cli::try_parse_from(["qmv-pin-tax", "--request-timeout", bad]).unwrap_err();
            assert!(e.to_string().contains("--request-timeout"), "{bad}: {e}");
            assert_eq!(e.exit_code(), 2, "{bad}: {e}");
        }
    }

    #[test]
    fn the_command_row_pastes_back_as_the_words_typed() {
        let argv = ["/r/target/debug/xtask", "qmv-pin-tax", "--order", "1 0 0 1", "--serve-arg=--x=it's"];
        let (cell, block) = command_row(&crate::shell::typed_command(&argv));
        assert_eq!(cell, r"`cargo xtask qmv-pin-tax --order '1 0 0 1' '--serve-arg=--x=it'\''s'`");
        assert!(block.is_none());
        // A pipe is escaped for the table; a newline or backtick moves the line to a block.
        assert_eq!(command_row("a '|' b").0, r"`a '\|' b`");
        let (cell, block) = command_row("cargo xtask x 'a\nb' '`'");
        assert_eq!(
            (cell.as_str(), block.unwrap()),
            ("(below the table)", "~~~~~~~~sh\ncargo xtask x 'a\nb' '`'\n~~~~~~~~\n".to_string())
        );
    }
}

/// Issue 40's items, each seen failing on the code before it: an A/A run worded as one,
/// verdicts and widths from `verdict::reading`, the fit's caveat, the cost-ratio plot,
/// the report's skipped cells, and summary.md and report.html equal to the terminal.
#[cfg(test)]
mod verdict_tests;
