//! `cargo xtask bench-longprompt`: models x prompt lengths, model-major, through the
//! estimate, backstop and OOM-record layers; an SVG of the rates goes beside the CSV.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use xshell::Shell;

use crate::args::user_path;
use crate::console::usage;
use crate::fsx::real_path;
use crate::plot;
use crate::sweep::panels::panels;
use crate::sweep::plan::{self, Named, Plan, Prompt};
use crate::sweep::rows;
use crate::sweep::series;
use crate::sweep::slurm::{RunnerFlags, RunnerKind};
use crate::sweep::{HarnessEnv, Session, SweepFlags};

/// Flags of `cargo xtask bench-longprompt`.
#[derive(clap::Args)]
pub struct BenchLongprompt {
    /// Models, comma- or space-separated: synthetic:<profile>, a directory under
    /// ./models/, or a path [default on the CPU: synthetic:tiny, synthetic:smollm-135m,
    /// synthetic:qwen2.5-0.5b; on a GPU: synthetic:qwen2.5-0.5b, synthetic:llama-3.2-1b,
    /// synthetic:llama-3.1-8b].
    #[arg(short = 'm', long, alias = "model", value_name = "LIST", value_parser = plan::models_arg)]
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
    /// --until-ci and its budgets, in repetitions of every cell.
    #[command(flatten)]
    seq: crate::verdict::RepetitionFlags,
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
        let session = Session::prepare(&sh.current_dir(), "longprompt", &self.sweep, harness_env)?;
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
        if self.seq.until_ci.is_none() {
            let plan = series::expand(&base, self.sweep.series.repeat, peer);
            let code = session.sweep(&plan, output, &self.sweep)?;
            if !plots_here(&self.sweep.runner) {
                return Ok(code);
            }
            return plot_beside(&csv, code);
        }
        // --until-ci: rounds of repetitions, one run directory and one CSV.
        let code = crate::sweep::rounds::until_ci(session, output, &self.sweep, &base, &self.seq)?;
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
