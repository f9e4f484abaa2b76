//! `cargo xtask bench-longprompt`: models x prompt lengths, model-major, through the
//! estimate, backstop and OOM-record layers; an SVG of the rates goes beside the CSV.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use xshell::Shell;

use crate::console::usage;
use crate::fsx::real_path;
use crate::plot;
use crate::sweep::plan::{self, Named, Plan, Prompt};
use crate::sweep::rows;
use crate::sweep::series;
use crate::sweep::slurm::{RunnerFlags, RunnerKind};
use crate::sweep::{HarnessEnv, Session, SweepFlags, user_path};

/// Flags of `cargo xtask bench-longprompt`.
#[derive(clap::Args)]
pub struct BenchLongprompt {
    /// Models, comma- or space-separated: synthetic:<profile>, a directory under
    /// ./models/, or a path [default on the CPU: synthetic:tiny, synthetic:smollm-135m,
    /// synthetic:qwen2.5-0.5b; on a GPU: synthetic:qwen2.5-0.5b, synthetic:llama-3.2-1b,
    /// synthetic:llama-3.1-8b].
    #[arg(long, value_name = "LIST", value_parser = plan::models_arg)]
    models: Option<plan::Models>,
    /// Prompt lengths in tokens, e.g. "512 2048 8192" [default: "128 512 2048" on the
    /// CPU, "512 2048 8192 32768" on a GPU].
    // Hyphen values reach the ladder parser, so `--lengths -5` gets its message.
    #[arg(long, value_name = "LADDER", value_parser = plan::ladder_arg, allow_hyphen_values = true)]
    lengths: Option<plan::Ladder>,
    /// Append to FILE, running only the cells that have no row in it.
    #[arg(long, value_name = "FILE")]
    resume: Option<PathBuf>,
    #[command(flatten)]
    sweep: SweepFlags,
    /// With --until-ci, repetitions are added (from at least 4, two at a time with a
    /// peer) until every interval of the rates and ratios is narrow enough.
    #[command(flatten)]
    seq: crate::verdict::SequentialFlags,
}

impl BenchLongprompt {
    pub fn run(self, sh: &Shell) -> Result<ExitCode> {
        let harness_env = HarnessEnv::read()?;
        let resume = match &self.resume {
            Some(file) => {
                let file = user_path(file)?;
                if let Some(out) = &self.sweep.output
                    && real_path(&user_path(out)?) != real_path(&file)
                {
                    usage!(
                        "--resume {} and --output {} differ: a resumed sweep appends to the file it resumes",
                        file.display(),
                        out.display()
                    );
                }
                Some(file)
            }
            None => None,
        };
        if self.seq.margin.is_some() {
            usage!("--margin judges paired ratios: bench-longprompt has --until-ci, not --margin");
        }
        if self.seq.until_ci.is_some() && self.sweep.runner.slurm()?.is_some() {
            usage!("--until-ci decides after each round of repetitions: it applies to the local runner only");
        }
        let session = Session::prepare(&sh.current_dir(), "longprompt", &self.sweep, harness_env.clone())?;
        let d = session.defaults().clone();
        let named = Named { models: self.models.is_some(), prompts: self.lengths.is_some() };
        let template = self.sweep.cell_template(&d, named)?;
        let models = self.models.map_or(d.models, |m| m.0);
        let prompts: Vec<Prompt> =
            self.lengths.map_or(d.lengths, |l| l.0).into_iter().map(Prompt::Tokens).collect();
        let base = Plan::grid(&models, &prompts, &template);
        let peer = self.sweep.series.peer.is_some();
        let knobs = session.knobs(&template);
        let output = match resume {
            Some(path) => session.open_output(path, true, &knobs)?,
            None => {
                let path = match &self.sweep.output {
                    Some(p) => user_path(p)?,
                    None => session.default_output("longprompt")?,
                };
                session.open_output(path, false, &knobs)?
            }
        };
        let csv = output.path.clone();
        let Some(target) = self.seq.until_ci else {
            let plan = series::expand(&base, self.sweep.series.repeat, peer);
            let code = session.sweep(&plan, output, &self.sweep)?;
            if !plots_here(&self.sweep.runner) {
                return Ok(code);
            }
            return plot_beside(&csv, code);
        };
        // --until-ci: rounds of repetitions on the same CSV, each resuming the last.
        use crate::verdict::sequence::Stopped;
        let started = std::time::Instant::now();
        let step = if peer { 2 } else { 1 };
        let mut repeat = self.sweep.series.repeat.max(4);
        let (mut session, mut output) = (Some(session), Some(output));
        let mut last_dir = None;
        let (code, stopped) = loop {
            let t0 = std::time::Instant::now();
            let s = match session.take() {
                Some(s) => s,
                None => Session::prepare(&sh.current_dir(), "longprompt", &self.sweep, harness_env.clone())?,
            };
            let out = match output.take() {
                Some(o) => o,
                None => s.open_output(csv.clone(), true, &knobs)?,
            };
            let (code, dir) = s.sweep_into(&series::expand(&base, repeat, peer), out, &self.sweep)?;
            last_dir = dir.or(last_dir);
            let (_, narrow) = series::sequential(&rows::read_rows(&csv)?, target);
            if code != ExitCode::SUCCESS {
                break (code, Stopped::Ended("the last round failed or was interrupted".into()));
            }
            if narrow {
                break (code, Stopped::Converged);
            }
            if repeat as usize + step > self.seq.max_pairs() {
                break (code, Stopped::MaxPairs(repeat as usize));
            }
            if let Some(max) = self.seq.max_time
                && started.elapsed() + t0.elapsed() * step as u32 / repeat.max(1) > max
            {
                break (code, Stopped::MaxTime);
            }
            repeat += step as u32;
            eprintln!("--until-ci {target}%: an interval is still wider; repetition {repeat} of every cell");
        };
        // The verdict the terminal prints is the one the run directory keeps and its page shows.
        let stopped = Some(format!("{}; {repeat} repetitions", stopped.describe(target)));
        let (sheet, _) = series::sequential_sheet(&rows::read_rows(&csv)?, target, stopped);
        if let Some(dir) = &last_dir {
            crate::sweep::summary::write_or_warn(dir, &sheet);
            crate::report::write_or_warn(dir);
        }
        crate::console::out(&format!("\n{}", sheet.markdown()))?;
        plot_beside(&csv, code)
    }
}

/// The plot beside the CSV; the exit code passes through.
fn plot_beside(csv: &std::path::Path, code: ExitCode) -> Result<ExitCode> {
    let svg = csv.with_extension("svg");
    match rows::read_rows(csv).and_then(|rows| plot::write_svg(&svg, &panels(&rows))) {
        Ok(_) => eprintln!("plot: {}", svg.display()),
        Err(e) => eprintln!("warning: no plot beside {}: {e:#}", csv.display()),
    }
    Ok(code)
}

/// Whether the sweep's rows are in its CSV when it returns, so the plot is drawn here: not
/// after a Slurm dry run (nothing ran) or a submission without `--wait` (`cargo xtask
/// merge` draws it once the tasks end).
fn plots_here(runner: &RunnerFlags) -> bool {
    runner.runner == RunnerKind::Local || (runner.wait && !runner.dry_run)
}

/// Decode and prefill tok/s against prompt length, one series per model (and engine,
/// with `--peer`): the geometric mean of a cell's repetitions with its 95% interval (the
/// summary's reading of the cell), each
/// repetition a point beside it; a cell without a measurement is marked on the axis and
/// listed with its status. Models more than 10x apart get a panel each.
pub fn panels(rows: &[rows::Row]) -> Vec<plot::Panel> {
    panels_by(rows, crate::verdict::reading::Method::T)
}

/// [`panels`] with the intervals taken as the run's summary took them (`--until-ci`: the
/// confidence sequence).
pub fn panels_by(rows: &[rows::Row], method: crate::verdict::reading::Method) -> Vec<plot::Panel> {
    let name =
        |r: &rows::Row| if r.is_peer() { format!("{} ({})", r.model, r.engine) } else { r.model.clone() };
    let mut names: Vec<String> = Vec::new();
    for r in rows {
        if !names.contains(&name(r)) {
            names.push(name(r));
        }
    }
    let panel = |metric: &str, rate: fn(&rows::Row) -> Option<f64>| {
        let mut marks = Vec::new();
        let series = names
            .iter()
            .map(|n| {
                let mut lens: Vec<u64> =
                    rows.iter().filter(|r| &name(r) == n).filter_map(|r| r.prompt_target_len).collect();
                lens.sort_unstable();
                lens.dedup();
                let mut s = plot::Series::points(n.clone(), Vec::new());
                s.join = true;
                for len in lens {
                    let cell: Vec<&rows::Row> =
                        rows.iter().filter(|r| &name(r) == n && r.prompt_target_len == Some(len)).collect();
                    let values: Vec<f64> =
                        cell.iter().filter(|r| r.status == "ok").filter_map(|r| rate(r)).collect();
                    match crate::verdict::reading::Reading::of(&values, method) {
                        Some(r) => {
                            s.points.push(plot::Point { x: len as f64, y: r.estimate, interval: r.interval });
                            if values.len() > 1 {
                                s.samples.extend(values.iter().map(|v| (len as f64, *v)));
                            }
                        }
                        None => {
                            let mut statuses: Vec<&str> = cell.iter().map(|r| r.status.as_str()).collect();
                            statuses.sort_unstable();
                            statuses.dedup();
                            marks.push(plot::Mark {
                                series: n.clone(),
                                x: len as f64,
                                label: statuses.join(", "),
                            });
                        }
                    }
                }
                s
            })
            .collect();
        plot::Panel {
            series,
            marks,
            split_when_spread: true,
            ..plot::Panel::new(
                metric,
                plot::Axis::log("prompt length (tokens)"),
                plot::Axis::from_zero(format!("{metric} (tok/s)")),
            )
        }
    };
    vec![panel("decode", |r| r.decode_tok_s), panel("prefill", |r| r.prefill_tok_s)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slurm_run_plots_here_only_when_it_waited_for_its_rows() {
        let slurm = |dry_run, wait| RunnerFlags {
            runner: RunnerKind::Slurm,
            dry_run,
            wait,
            ..RunnerFlags::default()
        };
        assert!(plots_here(&RunnerFlags::default()));
        assert!(plots_here(&slurm(false, true)));
        assert!(!plots_here(&slurm(true, false)) && !plots_here(&slurm(false, false)));
    }

    fn row(model: &str, len: u64, status: &str, decode: Option<f64>, prefill: Option<f64>) -> rows::Row {
        rows::Row {
            model: model.into(),
            prompt_target_len: Some(len),
            status: status.into(),
            decode_tok_s: decode,
            prefill_tok_s: prefill,
            ..rows::Row::default()
        }
    }

    /// The recorded default sweep (benchmarks/cpu_vm_2026-11-30_longprompt.csv, written
    /// before the knob columns, so read here by name).
    fn recorded_sweep() -> Vec<rows::Row> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../benchmarks/cpu_vm_2026-11-30_longprompt.csv");
        let mut rdr = csv::Reader::from_path(path).unwrap();
        let h = rdr.headers().unwrap().clone();
        let col = |r: &csv::StringRecord, name: &str| {
            r.get(h.iter().position(|x| x == name).unwrap()).unwrap().to_string()
        };
        rdr.records()
            .map(|r| {
                let r = r.unwrap();
                row(
                    &col(&r, "model"),
                    col(&r, "prompt_target_len").parse().unwrap(),
                    &col(&r, "status"),
                    col(&r, "decode_tok_s").parse().ok(),
                    col(&r, "prefill_tok_s").parse().ok(),
                )
            })
            .collect()
    }

    #[test]
    fn the_recorded_sweep_gives_each_model_its_panel_at_the_ladder_lengths() {
        let rows = recorded_sweep();
        let l = plot::raster::check("longprompt", &panels(&rows));
        // synthetic:tiny decodes at thousands of tok/s, the others at tens: one panel each,
        // decode and prefill, so no model is flattened onto the axis.
        let titles: Vec<&str> = l.panels.iter().map(|p| p.title.as_str()).collect();
        assert_eq!(
            titles,
            [
                "decode: synthetic:tiny",
                "decode: synthetic:smollm-135m",
                "decode: synthetic:qwen2.5-0.5b",
                "prefill: synthetic:tiny",
                "prefill: synthetic:smollm-135m",
                "prefill: synthetic:qwen2.5-0.5b"
            ]
        );
        for p in &l.panels {
            let ticks: Vec<&str> = p.x_ticks.iter().map(|t| t.label.as_str()).collect();
            assert_eq!(ticks, ["128", "512", "2048"], "{}", p.title);
        }
        // The skipped 2048-token cells are marked and listed, not drawn as values.
        assert_eq!(l.panels[0].notes[0].0, "synthetic:tiny: SKIP:context at 2048");
        assert_eq!(l.panels[0].series[0].points.len(), 2);
        assert_eq!(l.panels[2].notes.len(), 0);
    }

    #[test]
    fn repetitions_are_points_around_a_mean_with_its_interval_and_the_peer_its_own_series() {
        // The one-thread run of docs/benchmark_results/peer-longprompt-qwen2.5-0.5b-epyc-avx2-2vcpu-2026-12-01.md.
        let m = "synthetic:qwen2.5-0.5b@4bit-g32";
        let recorded = [
            (512, [(34.1, 64.3, 14.9, 34.0), (36.6, 79.3, 23.6, 47.0)]),
            (2048, [(21.0, 53.0, 13.7, 38.1), (30.4, 71.6, 14.3, 38.3)]),
            (8192, [(16.2, 47.7, 5.3, 30.0), (17.5, 51.0, 5.7, 31.7)]),
        ];
        let mut rows = Vec::new();
        for (len, reps) in recorded {
            for (k, (kd, kp, pd, pp)) in reps.into_iter().enumerate() {
                let rep = k as u32 + 1;
                rows.push(rows::Row {
                    repetition: rep,
                    engine: "kiln".into(),
                    ..row(m, len, "ok", Some(kd), Some(kp))
                });
                rows.push(rows::Row {
                    repetition: rep,
                    engine: "llama-bench".into(),
                    ..row(m, len, "ok", Some(pd), Some(pp))
                });
            }
        }
        rows.push(rows::Row {
            repetition: 1,
            engine: "kiln".into(),
            ..row(m, 32768, "FAIL:timeout", None, None)
        });
        let l = plot::raster::check("repeat", &panels(&rows));
        assert_eq!(l.panels.len(), 2, "within 10x: one panel per metric");
        let p = &l.panels[0];
        assert_eq!(p.legend_entries, [m.to_string(), format!("{m} (llama-bench)")]);
        for s in &p.series {
            assert_eq!((s.points.len(), s.samples.len(), s.intervals.len()), (3, 6, 3), "{}", s.name);
        }
        assert_eq!(
            p.x_ticks.iter().map(|t| t.label.as_str()).collect::<Vec<_>>(),
            ["512", "2048", "8192", "32768"]
        );
        assert_eq!(p.notes[0].0, format!("{m}: FAIL:timeout at 32768"));
    }
}
