//! `cargo xtask bench-longprompt`: models x prompt lengths, model-major, through the
//! estimate, backstop and OOM-record layers; an SVG of the rates goes beside the CSV.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use xshell::Shell;

use crate::console::usage;
use crate::plot;
use crate::sweep::plan::{self, Named, Plan, Prompt};
use crate::sweep::record::real_path;
use crate::sweep::rows;
use crate::sweep::series;
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
            return plot_beside(&csv, code);
        };
        // --until-ci: rounds of repetitions on the same CSV, each resuming the last.
        use crate::verdict::sequence::Stopped;
        let started = std::time::Instant::now();
        let step = if peer { 2 } else { 1 };
        let mut repeat = self.sweep.series.repeat.max(4);
        let (mut session, mut output) = (Some(session), Some(output));
        let (code, stopped, text) = loop {
            let t0 = std::time::Instant::now();
            let s = match session.take() {
                Some(s) => s,
                None => Session::prepare(&sh.current_dir(), "longprompt", &self.sweep, harness_env.clone())?,
            };
            let out = match output.take() {
                Some(o) => o,
                None => s.open_output(csv.clone(), true, &knobs)?,
            };
            let code = s.sweep(&series::expand(&base, repeat, peer), out, &self.sweep)?;
            let (text, narrow) = series::sequential(&rows::read_rows(&csv)?, target);
            if code != ExitCode::SUCCESS {
                break (code, Stopped::Ended("the last round failed or was interrupted".into()), text);
            }
            if narrow {
                break (code, Stopped::Converged, text);
            }
            if repeat as usize + step > self.seq.max_pairs() {
                break (code, Stopped::MaxPairs(repeat as usize), text);
            }
            if let Some(max) = self.seq.max_time
                && started.elapsed() + t0.elapsed() * step as u32 / repeat.max(1) > max
            {
                break (code, Stopped::MaxTime, text);
            }
            repeat += step as u32;
            eprintln!("--until-ci {target}%: an interval is still wider; repetition {repeat} of every cell");
        };
        crate::console::out(&format!("\n{text}\n{}; {repeat} repetitions\n", stopped.describe(target)))?;
        plot_beside(&csv, code)
    }
}

/// The plot beside the CSV; the exit code passes through.
fn plot_beside(csv: &std::path::Path, code: ExitCode) -> Result<ExitCode> {
    let svg = csv.with_extension("svg");
    match rows::read_rows(csv).and_then(|rows| plot::write_svg(&svg, &panels(&rows))) {
        Ok(()) => eprintln!("plot: {}", svg.display()),
        Err(e) => eprintln!("warning: no plot beside {}: {e:#}", csv.display()),
    }
    Ok(code)
}

/// Decode and prefill tok/s against prompt length, one line per model; a cell without a
/// measurement is marked on the axis with its status.
pub fn panels(rows: &[rows::Row]) -> Vec<plot::Panel> {
    let mut models: Vec<&str> = Vec::new();
    for r in rows {
        if !models.contains(&r.model.as_str()) {
            models.push(&r.model);
        }
    }
    let panel = |title: &str, rate: fn(&rows::Row) -> Option<f64>| plot::Panel {
        title: title.to_string(),
        x_label: "prompt tokens".into(),
        y_label: "tok/s".into(),
        log_x: true,
        series: models
            .iter()
            .map(|m| plot::Series {
                name: m.to_string(),
                points: rows
                    .iter()
                    .filter(|r| r.model == *m && r.status == "ok")
                    .filter_map(|r| Some((r.prompt_target_len? as f64, rate(r)?)))
                    .collect(),
            })
            .collect(),
        marks: rows
            .iter()
            .filter(|r| r.status != "ok")
            .filter_map(|r| {
                Some(plot::Mark {
                    series: r.model.clone(),
                    x: r.prompt_target_len? as f64,
                    label: r.status.clone(),
                })
            })
            .collect(),
    };
    vec![panel("decode", |r| r.decode_tok_s), panel("prefill", |r| r.prefill_tok_s)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plot_has_a_line_per_model_and_marks_skipped_cells() {
        let row = |model: &str, len: u64, status: &str, decode: Option<f64>| rows::Row {
            model: model.into(),
            prompt_target_len: Some(len),
            status: status.into(),
            decode_tok_s: decode,
            prefill_tok_s: decode.map(|d| d * 10.0),
            ..rows::Row::default()
        };
        let rs = [
            row("a", 128, "ok", Some(50.0)),
            row("a", 512, "ok", Some(40.0)),
            row("b", 128, "ok", Some(20.0)),
            row("b", 512, "SKIP:oom", None),
        ];
        let p = panels(&rs);
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].series.iter().map(|s| s.points.len()).collect::<Vec<_>>(), [2, 1]);
        assert_eq!(p[1].series[0].points[1], (512.0, 400.0));
        assert_eq!(p[0].marks.len(), 1);
        assert_eq!((p[0].marks[0].series.as_str(), p[0].marks[0].label.as_str()), ("b", "SKIP:oom"));
    }
}
