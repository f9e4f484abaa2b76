//! `cargo xtask serve-bench`: a load generator for OpenAI-compatible servers. It targets
//! `--url` or boots `kiln serve -m MODEL` itself, drives closed-loop concurrency levels
//! or an open-loop Poisson rate, and writes per-request lines, per-level statistics, a
//! markdown table and a plot under `benchmarks/runs/<stamp>-serve-bench/`.

pub mod calibrate;
pub mod client;
pub mod load;
pub mod output;
pub mod stats;

use std::ffi::OsString;
use std::future::Future;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use xshell::Shell;

use self::calibrate::{PromptKind, PromptPlan};
use self::client::{Endpoint, RequestSpec, Target};
use self::load::Arrival;
use self::output::{Files, LevelSummary};
use crate::child::{self, Shutdown};
use crate::console::{self, usage};
use crate::quiet;
use crate::server::{self, Ready, Server, ServerSpec};

/// Flags of `cargo xtask serve-bench`.
#[derive(clap::Args, Debug)]
pub struct ServeBench {
    /// The server to measure, e.g. http://127.0.0.1:8000 (any OpenAI-compatible server).
    #[arg(long, value_name = "URL", conflicts_with = "model")]
    url: Option<String>,
    /// Boot `kiln serve -m MODEL` and measure it (synthetic:<profile>, a directory, a path).
    #[arg(short = 'm', long, alias = "models", value_name = "MODEL")]
    model: Option<String>,
    /// Closed loop: the concurrency levels, comma- or space-separated.
    #[arg(long, value_name = "LIST", default_value = "1,2,4,8", value_parser = list_arg)]
    concurrency: Levels,
    /// Open loop instead: Poisson arrivals at R requests per second.
    #[arg(long, value_name = "R")]
    rate: Option<f64>,
    /// Measured requests per level [default: 4 per stream of the level, at least 8; 32 at a rate].
    #[arg(long, value_parser = crate::args::count_usize(0), value_name = "N")]
    requests: Option<usize>,
    /// Warm-up rounds per level, discarded: each is one request per stream.
    #[arg(long, value_parser = crate::args::count_usize(0), value_name = "R", default_value_t = 1)]
    warmup_rounds: usize,
    /// Prompt length in tokens, as the server counts them (exact as token ids; text is
    /// calibrated against the server's count).
    #[arg(long, value_parser = crate::args::count(0), value_name = "N", default_value_t = 128)]
    prompt_tokens: u64,
    /// The first N prompt tokens are the same in every request (exercises a prompt cache).
    #[arg(long, value_parser = crate::args::count(0), value_name = "N", default_value_t = 0)]
    shared_prefix: u64,
    /// How prompts are sent: token ids (completions only) or calibrated text [default: ids
    /// on completions, text on chat].
    #[arg(long, value_enum, value_name = "KIND")]
    prompt_kind: Option<PromptKind>,
    /// `max_tokens` of every request.
    #[arg(long, value_parser = crate::args::count(0), value_name = "N", default_value_t = 32)]
    max_tokens: u64,
    /// Send `ignore_eos` (true: every request generates max_tokens).
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    ignore_eos: bool,
    /// The endpoint.
    #[arg(long, value_enum, default_value_t = Endpoint::Completions)]
    endpoint: Endpoint,
    /// Send `response_format: {"type": "json_object"}` with every measured request, so the
    /// server masks each step; a kiln server's mask time then fills the summary's mask
    /// column (run once with and once without to price it).
    #[arg(long)]
    json_object: bool,
    /// The `model` field of requests [default: the -m value (the booted server is named
    /// so) or its --served-model-name, else "default"].
    #[arg(long, value_name = "NAME")]
    served_model: Option<String>,
    /// Seconds before one request is failed as timed out, 1 to 86400 (0 would fail every request at once).
    #[arg(long, value_name = "SECS", default_value_t = 300, allow_hyphen_values = true,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    request_timeout: u64,
    /// Other processes' CPU, in cores, above which a level counts as disturbed (measured
    /// over each level's requests; a server booted here is not another process, one at
    /// --url on this machine is).
    #[arg(long, value_name = "CPUS", default_value_t = 0.5, value_parser = busy_cpus_arg)]
    busy_cpus: f64,
    /// Booting: the port kiln serve binds (0: a free one, read from its log).
    #[arg(long, value_name = "PORT", default_value_t = 0)]
    port: u16,
    /// Booting: seconds to wait for /health.
    #[arg(long, value_parser = crate::args::count(0), value_name = "SECS", default_value_t = 600)]
    boot_timeout: u64,
    /// Booting kiln serve, and where run directories go.
    #[command(flatten)]
    boot: crate::run_dir::BootArgs,
}

/// A list of positive integers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Levels(pub Vec<usize>);

/// Parses `1,2,4,8` or `"1 2 4 8"`.
pub fn list_arg(s: &str) -> Result<Levels, String> {
    let items: Vec<&str> = s.split([',', ' ']).filter(|x| !x.is_empty()).collect();
    if items.is_empty() {
        return Err("empty list: expected positive integers such as 1,2,4,8".into());
    }
    items
        .iter()
        .map(|x| match x.parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("{x:?} is not a positive integer: expected a list such as 1,2,4,8")),
        })
        .collect::<Result<_, _>>()
        .map(Levels)
}

fn busy_cpus_arg(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("{s:?}: expected a number of CPUs, 0 or more (such as 0.5)")),
    }
}

/// One level of the run.
#[derive(Clone, Debug)]
struct Level {
    label: String,
    arrival: Arrival,
    warmup: usize,
    requests: usize,
}

impl ServeBench {
    pub fn run(self, sh: &Shell) -> Result<ExitCode> {
        let root = sh.current_dir();
        if self.url.is_none() && self.model.is_none() {
            usage!("serve-bench needs a server: --url http://host:port, or -m MODEL to boot kiln serve");
        }
        if let Some(r) = self.rate
            && !(r.is_finite() && r > 0.0)
        {
            usage!("--rate {r}: expected a positive number of requests per second");
        }
        if self.shared_prefix > self.prompt_tokens {
            usage!(
                "--shared-prefix {} is longer than --prompt-tokens {}: expected at most the prompt length",
                self.shared_prefix,
                self.prompt_tokens
            );
        }
        if self.prompt_kind() == PromptKind::Ids && self.endpoint == Endpoint::Chat {
            usage!("--prompt-kind ids needs --endpoint completions: chat messages are text");
        }
        if self.max_tokens == 0 {
            usage!("--max-tokens 0: expected at least 1");
        }
        let url_target = match &self.url {
            Some(u) => match Target::parse(u) {
                Ok(t) => Some(t),
                Err(e) => usage!("{e}"),
            },
            None => None,
        };
        // Where the run directory goes is checked before kiln is built: a build of minutes
        // must not end in a refusal of the flag.
        let runs_dir = self.boot.runs_dir(&root)?;
        crate::run_dir::check_dir_flag(&runs_dir, "--runs-dir", "run directories")?;
        let shutdown = Shutdown::install()?;
        let engine = match &self.model {
            Some(_) => match self.boot.engine(&root, &shutdown)? {
                Ok(e) => Some(e),
                Err(sig) => {
                    eprintln!("interrupted by {} during the build", child::signal_name(sig));
                    return Ok(ExitCode::from(child::exit_code_for(sig)));
                }
            },
            None => None,
        };
        if engine.is_some() && self.port != 0 && server::port_answers(self.port) {
            anyhow::bail!(
                "port {} already answers on 127.0.0.1: stop whatever holds it or pick another --port",
                self.port
            );
        }
        let run_dir = crate::run_dir::create_run_dir(&runs_dir, "serve-bench")?;
        let (mut env, device) = crate::run_dir::fingerprint(&root, engine.as_ref());
        let levels = self.levels();
        env["serve_bench"] = serde_json::json!({
            "target": self.url,
            "model": self.model,
            "levels": levels.iter().map(|l| &l.label).collect::<Vec<_>>(),
            "requests": levels.iter().map(|l| l.requests).collect::<Vec<_>>(),
            "warmup_rounds": self.warmup_rounds,
            "prompt_tokens": self.prompt_tokens,
            "shared_prefix": self.shared_prefix,
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
            "prompt_kind": self.prompt_kind(),
            "endpoint": self.endpoint,
            "json_object": self.json_object,
            "request_timeout_s": self.request_timeout,
            "served_model": self.served_model,
            "serve_args": self.boot.serve_args,
            "busy_cpus": self.busy_cpus,
            "percentiles": "linear interpolation between closest ranks (type 7, numpy's default)",
        });
        crate::run_dir::write_env_json(&run_dir, &env)?;
        eprintln!("serve-bench: run directory {}", display(&root, &run_dir));

        let booted = match (&engine, &self.model) {
            (Some(e), Some(model)) => {
                let mut args: Vec<OsString> = vec![
                    "serve".into(),
                    "-m".into(),
                    model.into(),
                    "--port".into(),
                    self.port.to_string().into(),
                ];
                args.extend(
                    crate::kiln_build::backend_args_unless_given(e.backend, &self.boot.serve_args)
                        .into_iter()
                        .map(OsString::from),
                );
                let (sized, warnings) = boot_sizes(&levels, &self.boot.serve_args);
                for w in warnings {
                    eprintln!("warning: {w}");
                }
                args.extend(sized.into_iter().map(OsString::from));
                args.extend(server::served_name(model, &self.boot.serve_args).1);
                args.extend(self.boot.serve_args.iter().map(OsString::from));
                let spec = ServerSpec {
                    bin: e.bin.clone(),
                    args,
                    env: Vec::new(),
                    log: run_dir.join("server.log"),
                    cwd: root.clone(),
                };
                let srv = Server::start(&spec)?;
                eprintln!("booting {} serve -m {model} (pid {})", display(&root, &e.bin), srv.pid());
                match srv.wait_ready(&shutdown, Duration::from_secs(self.boot_timeout)) {
                    Ready::Up { addr, after_s } => {
                        eprintln!("server ready at http://{addr} after {after_s:.1} s");
                        Some((srv, Target::at(addr)))
                    }
                    Ready::Interrupted(sig) => {
                        srv.stop(Duration::from_secs(5))?;
                        eprintln!("interrupted by {} while the server booted", child::signal_name(sig));
                        return Ok(ExitCode::from(child::exit_code_for(sig)));
                    }
                    Ready::Died(how) => {
                        anyhow::bail!(
                            "kiln serve {how} before it was ready; its log: {}",
                            srv.log_path().display()
                        )
                    }
                    Ready::TimedOut => {
                        srv.stop(Duration::from_secs(5))?;
                        anyhow::bail!(
                            "kiln serve was not ready after {} s (--boot-timeout)",
                            self.boot_timeout
                        )
                    }
                }
            }
            _ => None,
        };
        if booted.is_none()
            && let Some(w) = queue_warning(&levels)
        {
            eprintln!("warning: {w}");
        }
        let (server_proc, target) = match booted {
            Some((s, t)) => (Some(s), t),
            None => (None, url_target.context("a target")?),
        };
        let booted_name = self.model.as_ref().map(|m| server::served_name(m, &self.boot.serve_args).0);
        let served = self.served_model.clone().or(booted_name).unwrap_or_else(|| "default".into());
        let outcome = self.drive(&target, &served, &levels, &run_dir, server_proc.as_ref(), &shutdown);
        if let Some(s) = server_proc {
            let st = s.stop(Duration::from_secs(10))?;
            if st.killed {
                eprintln!("warning: kiln serve ignored SIGTERM for 10 s and was killed ({})", st.ended);
            }
        }
        let Driven { done, interrupted, server_died, prompt_note } = outcome?;
        let md = output::markdown(&done);
        let cpu_client: f64 = done.iter().map(|l| l.client_cpu_s).sum();
        let cpu_server: Option<f64> = done.iter().map(|l| l.server_cpu_s).sum();
        let mut text = format!("serve-bench against {} ({})\n\n{md}\n", target.url(), served);
        // A server booted here on the CUDA kernels' host execution: its figures are the CPU's.
        if engine.is_some() {
            text.insert_str(0, &crate::machine::host_execution_notes([device.as_str()]));
        }
        text.push_str(&format!(
            "client CPU over the measured requests: {cpu_client:.2} s{}\n",
            cpu_server.filter(|s| *s > 0.0).map_or(String::new(), |s| format!(
                " ({:.1}% of the server's {s:.2} s)",
                100.0 * cpu_client / s
            ))
        ));
        text.push_str("percentiles: linear interpolation between closest ranks (numpy's default)\n");
        if let Some(note) = &prompt_note {
            text.push_str(&format!("{note}\n"));
        }
        if let Some(sig) = interrupted {
            text.push_str(&format!("interrupted by {}: partial results\n", child::signal_name(sig)));
        }
        if let Some(why) = &server_died {
            text.push_str(&format!("stopped: {why}; partial results\n"));
        }
        std::fs::write(run_dir.join("summary.md"), &text).context("writing summary.md")?;
        if !done.is_empty() {
            crate::plot::write_svg(
                &run_dir.join("serve-bench.svg"),
                &output::panels(&done, self.rate.is_some()),
            )?;
        }
        crate::report::write_or_warn(&run_dir);
        console::out(&format!("\n{text}"))?;
        eprintln!("results: {}", display(&root, &run_dir));
        if let Some(sig) = interrupted {
            return Ok(ExitCode::from(child::exit_code_for(sig)));
        }
        if let Some(why) = server_died {
            eprintln!("exit 1: {why}");
            return Ok(ExitCode::FAILURE);
        }
        let failed: Vec<String> = done
            .iter()
            .filter(|l| l.failed > 0)
            .map(|l| format!("{}: {} of {} failed", l.level, l.failed, l.requests))
            .collect();
        if failed.is_empty() {
            Ok(ExitCode::SUCCESS)
        } else {
            eprintln!("exit 1: requests failed ({})", failed.join("; "));
            Ok(ExitCode::FAILURE)
        }
    }

    fn levels(&self) -> Vec<Level> {
        match self.rate {
            Some(rate) => vec![Level {
                label: format!("rate={rate}"),
                arrival: Arrival::Open { rate, seed: 0x0a11_17a1 },
                warmup: self.warmup_rounds,
                requests: self.requests.unwrap_or(32),
            }],
            None => self
                .concurrency
                .0
                .iter()
                .map(|&c| Level {
                    label: format!("c={c}"),
                    arrival: Arrival::Closed(c),
                    warmup: self.warmup_rounds * c,
                    requests: self.requests.unwrap_or((4 * c).max(8)),
                })
                .collect(),
        }
    }

    fn prompt_kind(&self) -> PromptKind {
        self.prompt_kind.unwrap_or(match self.endpoint {
            Endpoint::Completions => PromptKind::Ids,
            Endpoint::Chat => PromptKind::Text,
        })
    }

    fn spec(&self, prompt: &PromptPlan, served: &str, key: String, seed: u64) -> RequestSpec {
        RequestSpec {
            key,
            prompt: prompt.prompt(seed),
            max_tokens: self.max_tokens,
            ignore_eos: self.ignore_eos,
            model: served.to_string(),
            endpoint: self.endpoint,
            speculative: false,
            json_object: self.json_object,
        }
    }

    /// Runs every level; a level's failures are counted, never fatal. Stops at a signal,
    /// and when the server it booted has died (after the level it died in is written).
    fn drive(
        &self,
        target: &Target,
        served: &str,
        levels: &[Level],
        run_dir: &Path,
        srv: Option<&Server>,
        shutdown: &Shutdown,
    ) -> Result<Driven> {
        let rt =
            tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting tokio")?;
        let mut files = Files::create(run_dir)?;
        let timeout = Duration::from_secs(self.request_timeout);
        let mut done = Vec::new();
        let interrupted =
            |done, sig| Ok(Driven { done, interrupted: Some(sig), server_died: None, prompt_note: None });
        let (prompt, prompt_note) = match self.prompt_kind() {
            PromptKind::Ids => (
                PromptPlan {
                    kind: PromptKind::Ids,
                    units: self.prompt_tokens,
                    shared: self.shared_prefix,
                    tail: 0,
                },
                None,
            ),
            PromptKind::Text => {
                let cal = calibrate::calibrate(
                    target,
                    self.endpoint,
                    served,
                    self.prompt_tokens,
                    self.shared_prefix,
                    timeout,
                );
                let cal = match rt.block_on(until_signal(shutdown, cal)) {
                    Ok(c) => c,
                    Err(sig) => return interrupted(done, sig),
                };
                for r in &cal.probes {
                    files.request("calibration", true, r)?;
                }
                files.flush()?;
                eprintln!("{}", cal.note);
                (cal.plan, Some(cal.note))
            }
        };
        // A booted server that is gone: how, and where its log is. Failed requests may mean
        // it is dying: it is given a moment to finish, so the death is what gets reported.
        let died = |failed: bool, when: &str| {
            let srv = srv?;
            let how = if failed { srv.exited_within(Duration::from_secs(1)) } else { srv.exited() }?;
            Some(format!("kiln serve {how} {when} (its log: {})", srv.log_path().display()))
        };
        for (li, level) in levels.iter().enumerate() {
            if let Some(sig) = shutdown.pending() {
                return interrupted(done, sig);
            }
            if let Some(why) = died(false, &format!("before level {}", level.label)) {
                eprintln!("{why}: stopping; the levels already measured are kept");
                return Ok(Driven { done, interrupted: None, server_died: Some(why), prompt_note });
            }
            let seed_base = (li as u64 + 1) << 32;
            let warm: Vec<RequestSpec> = (0..level.warmup)
                .map(|i| {
                    let seed = seed_base | (1 << 31) | i as u64;
                    self.spec(&prompt, served, format!("{}/warmup/{i}", level.label), seed)
                })
                .collect();
            let measured: Vec<RequestSpec> = (0..level.requests)
                .map(|i| self.spec(&prompt, served, format!("{}/{i}", level.label), seed_base | i as u64))
                .collect();
            if !warm.is_empty() {
                let run = match rt
                    .block_on(until_signal(shutdown, load::run(target, warm, level.arrival, timeout)))
                {
                    Ok(r) => r,
                    Err(sig) => return interrupted(done, sig),
                };
                for r in &run.results {
                    files.request(&level.label, true, r)?;
                }
                let failed = run.results.iter().any(|r| !r.ok);
                if let Some(why) = died(failed, &format!("during the warm-up of level {}", level.label)) {
                    files.flush()?;
                    eprintln!("{why}: stopping; the levels already measured are kept");
                    return Ok(Driven { done, interrupted: None, server_died: Some(why), prompt_note });
                }
            }
            // What else ran beside the measured requests: the client is this process, a
            // booted server is ours too.
            let probe = quiet::Probe::start(&srv.map(|s| vec![s.pid()]).unwrap_or_default());
            let cpu0 = quiet::self_cpu_seconds();
            let srv0 = srv.and_then(Server::cpu_seconds);
            let run = match rt
                .block_on(until_signal(shutdown, load::run(target, measured, level.arrival, timeout)))
            {
                Ok(r) => r,
                Err(sig) => return interrupted(done, sig),
            };
            let cpu1 = quiet::self_cpu_seconds();
            let srv1 = srv.and_then(Server::cpu_seconds);
            let (conc, rate) = match level.arrival {
                Arrival::Closed(c) => (Some(c), None),
                Arrival::Open { rate, .. } => (None, Some(rate)),
            };
            let mut l =
                LevelSummary::of(level.label.clone(), conc, rate, &run.results, run.wall.as_secs_f64());
            l.prompt_tokens_asked = Some(self.prompt_tokens);
            l.client_cpu_s = match (cpu0, cpu1) {
                (Some(a), Some(b)) => b - a,
                _ => 0.0,
            };
            l.server_cpu_s = match (srv0, srv1) {
                (Some(a), Some(b)) => Some(b - a),
                _ => None,
            };
            // /proc counts CPU in hundredths of a second: a level shorter than a second is
            // judged over a second, or a busy machine would read as quiet.
            if probe.is_some() {
                std::thread::sleep(MIN_PROBE.saturating_sub(run.wall));
            }
            let limits = quiet::Limits { others_cpus: self.busy_cpus };
            l.disturbed = probe.and_then(|p| p.finish()).and_then(|r| r.busy(limits)).unwrap_or_default();
            for r in &run.results {
                files.request(&level.label, false, r)?;
            }
            files.level(&l)?;
            let first_error = run.results.iter().find_map(|r| r.error.clone());
            eprintln!(
                "[{}/{}] {}: {} ok, {} failed{}; {:.1} output tok/s, TTFT p50 {:.1} ms, TPOT p50 {:.1} ms{}",
                li + 1,
                levels.len(),
                l.level,
                l.ok,
                l.failed,
                if l.bad_usage > 0 {
                    format!(" ({} on counted deltas: malformed usage)", l.bad_usage)
                } else {
                    String::new()
                },
                l.output_tok_s,
                l.ttft.median.unwrap_or(f64::NAN),
                l.tpot.median.unwrap_or(f64::NAN),
                first_error.map_or(String::new(), |e| format!("; first error: {e}"))
            );
            if !l.disturbed.is_empty() {
                eprintln!("    disturbed: {}", l.disturbed);
            }
            let gone = died(l.failed > 0, &format!("during level {}", l.level));
            done.push(l);
            if let Some(why) = gone {
                eprintln!("{why}: stopping; the levels already measured are kept");
                return Ok(Driven { done, interrupted: None, server_died: Some(why), prompt_note });
            }
        }
        Ok(Driven { done, interrupted: None, server_died: None, prompt_note })
    }
}

/// How [`ServeBench::drive`] ended.
struct Driven {
    /// The levels measured, each written.
    done: Vec<LevelSummary>,
    /// The signal that stopped the run.
    interrupted: Option<i32>,
    /// The booted server died: what happened, in a sentence.
    server_died: Option<String>,
    /// What the calibration of text prompts found.
    prompt_note: Option<String>,
}

/// The shortest window the busy-machine probe judges a level over.
const MIN_PROBE: Duration = Duration::from_secs(1);

/// kiln serve's `--max-queue` when none is given.
const KILN_DEFAULT_MAX_QUEUE: usize = 256;

/// The most requests of any level that can be in the server at once: a closed loop's C,
/// an open loop's every request (a slow server lets them pile up).
fn most_in_flight(levels: &[Level]) -> usize {
    levels
        .iter()
        .map(|l| match l.arrival {
            Arrival::Closed(c) => c,
            Arrival::Open { .. } => l.requests.max(l.warmup),
        })
        .max()
        .unwrap_or(1)
}

/// The value a `--serve-arg` gives `flag` (`--flag=N` or `--flag N` split over two), if any.
fn serve_arg_value(serve_args: &[String], flag: &str) -> Option<Option<usize>> {
    let at = serve_args.iter().position(|a| a == flag || a.starts_with(&format!("{flag}=")))?;
    let v = match serve_args[at].split_once('=') {
        Some((_, v)) => Some(v),
        None => serve_args.get(at + 1).map(String::as_str),
    };
    Some(v.and_then(|v| v.parse().ok()))
}

/// What a boot serve-bench owns is sized to the run: `--parallel` = the widest closed
/// level (C streams decode together) and `--max-queue` = the most requests in flight, so
/// no request is refused with 429 by construction; a `--serve-arg` that sets either wins,
/// with a warning when it is too small for the run.
fn boot_sizes(levels: &[Level], serve_args: &[String]) -> (Vec<String>, Vec<String>) {
    let widest = levels
        .iter()
        .filter_map(|l| match l.arrival {
            Arrival::Closed(c) => Some(c),
            Arrival::Open { .. } => None,
        })
        .max()
        .unwrap_or(1);
    let in_flight = most_in_flight(levels);
    let mut args = Vec::new();
    let mut warnings = Vec::new();
    match serve_arg_value(serve_args, "--parallel") {
        None => args.extend(["--parallel".to_string(), widest.to_string()]),
        Some(Some(n)) if n < widest => warnings.push(format!(
            "--serve-arg sets --parallel {n}, below the widest level's {widest} streams: the rest wait for a slot"
        )),
        Some(_) => {}
    }
    match serve_arg_value(serve_args, "--max-queue") {
        None => args.extend(["--max-queue".to_string(), in_flight.max(1).to_string()]),
        Some(Some(n)) if n < in_flight => warnings.push(format!(
            "--serve-arg sets --max-queue {n}, below the {in_flight} requests the run can have in flight: the server may refuse some with 429"
        )),
        Some(_) => {}
    }
    (args, warnings)
}

/// The warning for a server serve-bench did not boot, whose queue limit it cannot size,
/// when the run can have more requests in flight than kiln serve's default queue holds.
fn queue_warning(levels: &[Level]) -> Option<String> {
    let n = most_in_flight(levels);
    (n > KILN_DEFAULT_MAX_QUEUE).then(|| {
        format!(
            "the run can have {n} requests in flight at once; a server whose queue holds fewer (kiln serve's default --max-queue is {KILN_DEFAULT_MAX_QUEUE}) refuses the rest with 429, which are counted as failed: raise its limit to measure the level"
        )
    })
}

/// Runs `fut` unless a signal arrives first (checked every 50 ms).
pub async fn until_signal<T>(shutdown: &Shutdown, fut: impl Future<Output = T>) -> Result<T, i32> {
    let watch = async {
        loop {
            if let Some(sig) = shutdown.pending() {
                return sig;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::select! {
        v = fut => Ok(v),
        sig = watch => Err(sig),
    }
}

fn display(root: &Path, p: &Path) -> String {
    p.strip_prefix(root).unwrap_or(p).display().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn level_lists_take_commas_or_spaces_and_refuse_zero() {
        assert_eq!(list_arg("1,2,4,8").unwrap(), Levels(vec![1, 2, 4, 8]));
        assert_eq!(list_arg("1 2  3").unwrap(), Levels(vec![1, 2, 3]));
        assert_eq!(
            list_arg("1,0").unwrap_err(),
            "\"0\" is not a positive integer: expected a list such as 1,2,4,8"
        );
        assert!(list_arg(" ").is_err());
    }

    #[test]
    fn a_request_timeout_of_0_or_past_a_day_is_refused_naming_the_flag() {
        #[derive(clap::Parser, Debug)]
        struct Cli {
            #[command(flatten)]
            flags: ServeBench,
        }
        use clap::Parser;
        for bad in ["0", "86401", "-1"] {
            let e = Cli::try_parse_from(["serve-bench", "--request-timeout", bad]).unwrap_err();
            assert!(e.to_string().contains("--request-timeout"), "{bad}: {e}");
            assert_eq!(e.exit_code(), 2, "{bad}: {e}");
        }
        let ok = Cli::try_parse_from(["serve-bench", "--request-timeout", "1"]).unwrap();
        assert_eq!(ok.flags.request_timeout, 1);
    }

    fn closed(c: usize) -> Level {
        Level { label: format!("c={c}"), arrival: Arrival::Closed(c), warmup: c, requests: 4 * c }
    }

    #[test]
    fn an_owned_boot_is_sized_so_no_request_is_refused_by_construction() {
        let levels = [closed(1), closed(2000), closed(16)];
        let (args, warn) = boot_sizes(&levels, &[]);
        assert_eq!(args, ["--parallel", "2000", "--max-queue", "2000"]);
        assert!(warn.is_empty());
        let open = [Level {
            label: "rate=4".into(),
            arrival: Arrival::Open { rate: 4.0, seed: 1 },
            warmup: 1,
            requests: 300,
        }];
        assert_eq!(boot_sizes(&open, &[]).0, ["--parallel", "1", "--max-queue", "300"]);
        // A --serve-arg wins, with a warning when it is too small for the run.
        let given = ["--max-queue=256".to_string(), "--parallel".to_string(), "4000".to_string()];
        let (args, warn) = boot_sizes(&levels, &given);
        assert!(args.is_empty(), "{args:?}");
        assert_eq!(warn.len(), 1);
        assert!(warn[0].starts_with("--serve-arg sets --max-queue 256, below the 2000 requests"), "{warn:?}");
        // A server it did not boot: only a warning, past kiln's default queue.
        assert!(queue_warning(&[closed(256)]).is_none());
        let w = queue_warning(&levels).unwrap();
        assert!(
            w.starts_with("the run can have 2000 requests in flight at once;") && w.contains("429"),
            "{w}"
        );
    }
}
