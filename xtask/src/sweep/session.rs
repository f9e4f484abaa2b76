//! The session: everything prepared before the first cell (the engine binary, the
//! machine, the commit, the run directory with its env.json), and where the CSV goes.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::json;

use super::classify;
use super::driver::{Driver, RowMeta, now};
use super::flags::{Defaults, HarnessEnv, SweepFlags};
use super::layers::{Backstop, FakeOom, OomLayers};
use super::plan::{CellTemplate, Plan};
use super::record::{RecordFile, RecordView};
use super::rows::{CsvOut, Knobs, Output};
use super::runner::{EngineKnobs, LocalRunner};
use crate::args::user_path;
use crate::child::{self as shutdown, Shutdown};
use crate::console::usage;
use crate::kiln_build::{self, Backend, BackendArg, BackendFeatures, EnginePackage};
use crate::machine::{self, Machine};
use crate::peer::PeerRunner;

/// Everything prepared before the first cell: the engine binary, the machine, the commit,
/// the checked knobs. Nothing is built until [`Session::sweep`], so every flag is checked
/// first.
pub struct Session {
    root: PathBuf,
    machine: Machine,
    backend: Backend,
    /// Build features, `None` for a binary the harness did not build.
    features: Option<Vec<String>>,
    kiln_bin: PathBuf,
    /// Build `kiln` before the first cell.
    build: bool,
    kiln_version: String,
    commit: String,
    kiln_env: BTreeMap<String, String>,
    device: String,
    /// `--memory-limit` or `KILN_MEMORY_LIMIT` as given, which the device string names.
    memory_limit: Option<String>,
    command: String,
    defaults: Defaults,
    shutdown: Shutdown,
    harness_env: HarnessEnv,
    engine_knobs: EngineKnobs,
    memory_limit_bytes: Option<u64>,
    record_path: PathBuf,
    /// Where the run directory goes (`--runs-dir`).
    runs_dir: PathBuf,
    /// The cells run here (`--runner local`), where `--resume` applies.
    local: bool,
    /// `--measure-roofs`.
    measure_roofs: bool,
}

impl Session {
    /// Checks the flags, probes the machine and chooses the backend and the binary.
    pub fn prepare(
        root: &Path,
        command: &str,
        flags: &SweepFlags,
        harness_env: HarnessEnv,
    ) -> Result<Session> {
        let (engine_knobs, memory_limit_bytes) = flags.engine_knobs()?;
        flags.runner.slurm()?;
        let shutdown = Shutdown::install()?;
        let machine = Machine::probe();
        let prebuilt = match flags.kiln_bin.clone().or_else(|| harness_env.kiln_bin.clone()) {
            Some(p) => Some(user_path(&p)?),
            None => None,
        };
        let pkg = EnginePackage::read(root);
        let (backend, features, kiln_bin, kiln_version, build) = match prebuilt {
            Some(bin) => {
                if !bin.is_file() {
                    usage!(
                        "--kiln-bin (or KILN_BENCH_KILN_BIN) {}: no such file: expected a built kiln binary",
                        bin.display()
                    );
                }
                let backend = match flags.backend {
                    BackendArg::Auto | BackendArg::Cpu => Backend::Cpu,
                    BackendArg::Cuda => Backend::Cuda,
                    BackendArg::Metal => Backend::Metal,
                    BackendArg::Vulkan => Backend::Vulkan,
                };
                let version = pkg.as_ref().map(|p| p.version.clone()).unwrap_or_default();
                (backend, None, bin, version, false)
            }
            None => {
                let pkg = pkg?;
                let choice = match kiln_build::choose_for(&machine, flags.backend, &pkg) {
                    Ok(c) => c,
                    Err(e) => usage!("{e}"),
                };
                if let Some(note) = &choice.note {
                    eprintln!("note: {note}");
                }
                let bin = pkg.binary("release");
                if flags.no_build && !bin.is_file() {
                    usage!(
                        "--no-build: no kiln binary at {}: run without --no-build to build it",
                        bin.display()
                    );
                }
                (choice.backend, Some(choice.backend.features()), bin, pkg.version.clone(), !flags.no_build)
            }
        };
        if flags.measure_roofs && backend != Backend::Cpu {
            usage!(
                "--measure-roofs with --backend {}: it measures the CPU's roofs, which bound only the CPU's kernels; use --backend cpu",
                backend.as_str()
            );
        }
        if flags.measure_roofs && flags.runner.runner != super::slurm::RunnerKind::Local {
            usage!("--measure-roofs applies to the local runner only: a Slurm node's rows keep no roofs");
        }
        let kiln_env = machine::kiln_env();
        let limit = flags.memory_limit.clone().or_else(|| kiln_env.get("KILN_MEMORY_LIMIT").cloned());
        let device = machine.device(backend.as_str(), limit.as_deref());
        let record_path = match &flags.oom_record {
            Some(p) => user_path(p)?,
            None => root.join("benchmarks/.oom-record"),
        };
        let runs_dir = match &flags.runs_dir {
            Some(d) => user_path(d)?,
            None => root.join("benchmarks/runs"),
        };
        // The directories the run writes into, checked before the output CSV (or anything
        // else) is created: a file where one should be is named with its flag.
        crate::run_dir::check_dir_flag(&runs_dir, "--runs-dir", "run directories")?;
        crate::run_dir::check_file_flag(&record_path, "--oom-record")?;
        if let Some(out) = &flags.output {
            crate::run_dir::check_file_flag(&user_path(out)?, "--output")?;
        }
        Ok(Session {
            root: root.to_path_buf(),
            commit: machine::commit(root),
            // The host execution runs the CUDA kernels on the CPU, one block at a time: it
            // gets the CPU's ladder, not the one a GPU is judged on.
            defaults: Defaults::for_backend(if machine.on_device(backend.as_str()) {
                backend
            } else {
                Backend::Cpu
            }),
            machine,
            backend,
            features,
            kiln_bin,
            build,
            kiln_version,
            kiln_env,
            device,
            memory_limit: limit,
            command: command.to_string(),
            shutdown,
            harness_env,
            engine_knobs,
            memory_limit_bytes,
            record_path,
            runs_dir,
            local: flags.runner.runner == super::slurm::RunnerKind::Local,
            measure_roofs: flags.measure_roofs,
        })
    }

    /// The knobs of `template`'s cells as the CSV records them.
    pub fn knobs(&self, template: &CellTemplate) -> Knobs {
        Knobs {
            max_tokens: template.max_tokens,
            warmup_tokens: template.warmup_tokens,
            ..self.engine_row_knobs()
        }
    }

    /// The engine knobs as the CSV records them, token counts left at zero.
    fn engine_row_knobs(&self) -> Knobs {
        Knobs::of_engine(&self.engine_knobs, self.memory_limit_bytes)
    }

    /// Opens the CSV under its lock: created (or emptied), or resumed when `resume`, in
    /// which case its rows must have been measured with `knobs`. The OOM record is never
    /// an output, however it is spelled.
    pub fn open_output(&self, path: PathBuf, resume: bool, knobs: &Knobs) -> Result<Output> {
        self.check_output(&path)?;
        if !resume {
            let csv = CsvOut::create(&path)?;
            return Ok(Output { path, csv, resumed: None });
        }
        if !path.is_file() {
            usage!("--resume {}: no such file: expected a CSV written by an earlier sweep", path.display());
        }
        let (csv, rows) = CsvOut::resume(&path)?;
        if let Some(row) = rows.iter().find(|r| &r.knobs() != knobs) {
            let diff = row.knobs().differences(knobs);
            usage!(
                "--resume {}: its rows were measured with other settings ({}): resume with the same ones, or pass a new --output",
                path.display(),
                diff.join("; ")
            );
        }
        Ok(Output { path, csv, resumed: Some(rows) })
    }

    /// Refuses `path` as an output when it is the OOM record, however it is spelled
    /// (a link, `..`, a hard link): every sweep's CSV is checked here before it is opened.
    pub fn check_output(&self, path: &Path) -> Result<()> {
        if crate::fsx::same_file(path, &self.record_path) {
            usage!(
                "{} is the OOM record ({}): pass another --output",
                path.display(),
                self.record_path.display()
            );
        }
        Ok(())
    }

    /// What the estimate layer prices cells against on a GPU: its memory, or the memory
    /// limit when smaller (never host memory); `None` off a GPU.
    fn device_budget(&self) -> Option<super::layers::DeviceBudget> {
        let (gpu, memory) = self.machine.device_memory(self.backend.as_str())?;
        Some(super::layers::DeviceBudget::new(gpu, memory, self.memory_limit_bytes))
    }

    /// Whether the cells run on a GPU: a GPU backend, not the host execution of its kernels.
    pub fn is_gpu(&self) -> bool {
        self.machine.on_device(self.backend.as_str())
    }

    /// The backend's defaults.
    pub fn defaults(&self) -> &Defaults {
        &self.defaults
    }

    /// `benchmarks/<backend>_<host>_<date>_<kind>.csv`, or the first free
    /// `..._<kind>-N.csv` when an earlier run already wrote that file.
    pub fn default_output(&self, kind: &str) -> Result<PathBuf> {
        let stem = default_stem(self.backend.as_str(), &self.machine.host, kind);
        let (path, taken) = unused_path(&self.root.join("benchmarks"), &stem)?;
        if let Some(first) = taken {
            eprintln!("{}", taken_note(&self.display(&first), &self.display(&path), self.local));
        }
        Ok(path)
    }

    fn display(&self, p: &Path) -> String {
        p.strip_prefix(&self.root).unwrap_or(p).display().to_string()
    }

    /// Builds the engine when asked, then runs `plan` into `output` and returns the exit
    /// status.
    pub fn sweep(self, plan: &Plan, output: Output, flags: &SweepFlags) -> Result<ExitCode> {
        Ok(self.sweep_into(plan, output, flags)?.0)
    }

    /// [`Session::sweep`], with the run directory a local sweep wrote (where a task that
    /// judges the rows afterwards, as `--until-ci` does, keeps its readings).
    pub fn sweep_into(
        self,
        plan: &Plan,
        output: Output,
        flags: &SweepFlags,
    ) -> Result<(ExitCode, Option<PathBuf>)> {
        let slurm = flags.runner.slurm()?;
        if slurm.is_some() && (flags.series.peer.is_some() || flags.series.require_quiet) {
            usage!(
                "--peer and --require-quiet apply to the local runner only: a Slurm task runs one kiln cell on whatever node it gets"
            );
        }
        if let Some(slurm) = &slurm {
            // A dry run prints the batch scripts only: nothing to build.
            if !slurm.dry_run
                && let Some(code) = self.build_engine()?
            {
                return Ok((code, None));
            }
            return Ok((self.submit_slurm(plan, output, flags, slurm)?, None));
        }
        eprintln!("sweep: {} cells", plan.cells.len());
        let started = match self.start_with(&output.path, flags, Some(plan))? {
            Ok(s) => s,
            Err(code) => return Ok((code, None)),
        };
        let runner = &mut started.runner();
        let peer = flags.series.peer.clone().map(|spec| started.peer_runner(spec));
        let mut driver = started.driver(plan, flags, &output.path, peer);
        let (code, sheet) = driver.run(runner, output)?;
        // Every row is on disk: the readings the terminal printed, and the page a person
        // opens first, drawn from those files.
        super::summary::write_or_warn(&started.run_dir, &sheet);
        crate::report::write_or_warn(&started.run_dir);
        Ok((ExitCode::from(code), Some(started.run_dir.clone())))
    }

    /// On `vulkan` and `metal`, asks the built engine which adapter it runs on: the rows'
    /// device, driver and pre-skip budget are then the adapter's.
    /// Its output is logged in `run_dir` (`000-adapter.stdout` / `.stderr`); `Some` is the
    /// signal that interrupted it.
    fn find_adapter(&mut self, run_dir: &Path) -> Result<Option<i32>> {
        let base = run_dir.join("000-adapter");
        let backend = self.backend.as_str();
        if let super::runner::Ran::Interrupted(sig) =
            super::adapter::find(&mut self.machine, &self.kiln_bin, backend, &base, &self.shutdown)?
        {
            return Ok(Some(sig));
        }
        if self.machine.adapter.is_some() {
            self.device = self.machine.device(backend, self.memory_limit.as_deref());
        }
        Ok(None)
    }

    /// Builds the engine when the session was asked to; `Some(code)` when a signal ended
    /// the build.
    fn build_engine(&self) -> Result<Option<ExitCode>> {
        if self.build {
            if let Some(sig) = kiln_build::build_release(&self.root, self.backend, &self.shutdown)? {
                eprintln!("interrupted by {} during the build", shutdown::signal_name(sig));
                return Ok(Some(ExitCode::from(shutdown::exit_code_for(sig))));
            }
            if !self.kiln_bin.is_file() {
                anyhow::bail!("the build left no kiln binary at {}", self.kiln_bin.display());
            }
        }
        Ok(None)
    }

    /// Builds the engine when asked, creates the run directory with its env.json, and
    /// hands over what any sweep needs to run cells: the runner's settings, the OOM
    /// layers and the rows' fingerprint. `Err(code)` when a signal ended the build.
    pub fn start(self, output: &Path, flags: &SweepFlags) -> Result<Result<Started, ExitCode>> {
        self.start_with(output, flags, None)
    }

    /// [`Session::start`] for a sweep of `plan`, whose models, lengths and token counts
    /// env.json records with the knobs.
    fn start_with(
        mut self,
        output: &Path,
        flags: &SweepFlags,
        plan: Option<&Plan>,
    ) -> Result<Result<Started, ExitCode>> {
        if let Some(code) = self.build_engine()? {
            return Ok(Err(code));
        }
        let cell_timeout = flags.cell_timeout.map(Duration::from_secs).unwrap_or(self.defaults.cell_timeout);
        let knobs = self.engine_knobs.clone();
        // Each row takes its token counts from its cell.
        let row_knobs = self.engine_row_knobs();
        let run_dir = crate::run_dir::create_run_dir(&self.runs_dir, &self.command)?;
        if let Some(sig) = self.find_adapter(&run_dir)? {
            eprintln!("interrupted by {} while the engine named its adapter", shutdown::signal_name(sig));
            return Ok(Err(ExitCode::from(shutdown::exit_code_for(sig))));
        }
        self.write_env_json(&run_dir, output, &self.record_path, cell_timeout, flags, plan)?;
        eprintln!(
            "kiln {} ({}); device {}; run directory {}",
            self.display(&self.kiln_bin),
            self.backend.as_str(),
            self.device,
            self.display(&run_dir)
        );
        if self.harness_env.ignore_record {
            eprintln!("KILN_BENCH_IGNORE_OOM_RECORD=1: the OOM record does not pre-skip cells in this run");
        }
        Ok(Ok(Started {
            user_cwd: std::env::current_dir().context("reading the current directory")?,
            run_dir,
            knobs,
            row_knobs,
            cell_timeout,
            session: self,
        }))
    }

    /// `--runner slurm`: the run directory under the shared one (not created in a dry
    /// run), env.json, the spec every task reads, and the submission. The OOM record
    /// defaults to `<shared-dir>/.oom-record`, where every node sees it.
    fn submit_slurm(
        &self,
        plan: &Plan,
        output: Output,
        flags: &SweepFlags,
        slurm: &super::slurm::SlurmOptions,
    ) -> Result<ExitCode> {
        if output.resumed.is_some() {
            usage!(
                "--resume applies to the local runner only: `cargo xtask merge RUN_DIR` joins a Slurm run's rows"
            );
        }
        let record = match &flags.oom_record {
            Some(_) => self.record_path.clone(),
            None => slurm.shared_dir.join(".oom-record"),
        };
        let cell_timeout = flags.cell_timeout.map(Duration::from_secs).unwrap_or(self.defaults.cell_timeout);
        let run_dir = if slurm.dry_run {
            let stamp = chrono::Utc::now().format("%Y%m%dT%H%M%SZ");
            slurm.shared_dir.join(format!("{stamp}-{}", self.command))
        } else {
            let dir = crate::run_dir::create_run_dir(&slurm.shared_dir, &self.command)?;
            self.write_env_json(&dir, &output.path, &record, cell_timeout, flags, Some(plan))?;
            eprintln!(
                "sweep: {} cells on Slurm; kiln {} ({}); run directory {}",
                plan.cells.len(),
                self.display(&self.kiln_bin),
                self.backend.as_str(),
                dir.display()
            );
            dir
        };
        let limit = flags.memory_limit.clone().or_else(|| self.kiln_env.get("KILN_MEMORY_LIMIT").cloned());
        let spec = super::task::TaskSpec {
            command: self.command.clone(),
            plan: plan.clone(),
            arrays: Vec::new(),
            kiln: self.kiln_bin.clone(),
            workdir: self.root.clone(),
            user_cwd: std::env::current_dir().context("reading the current directory")?,
            knobs: self.engine_knobs.clone(),
            row_knobs: self.engine_row_knobs(),
            cell_timeout_s: cell_timeout.as_secs(),
            estimate_on: !flags.no_estimate,
            record,
            ignore_record: self.harness_env.ignore_record,
            fake_oom: self.harness_env.fake_oom.clone(),
            source_csv: self.display(&output.path),
            output: output.path.clone(),
            backend: self.backend.as_str().to_string(),
            commit: self.commit.clone(),
            features: self.features.clone(),
            kiln_env: self.kiln_env.clone(),
            kiln_version: self.kiln_version.clone(),
            memory_limit: limit,
            busy_cpus: flags.series.limits().others_cpus,
        };
        // The CSV holds the header until `merge` replaces it; a dry run leaves none.
        drop(output.csv);
        if slurm.dry_run {
            let _ = fs::remove_file(&output.path);
        }
        let code = super::slurm::submit(&run_dir, spec, slurm, &self.shutdown)?;
        Ok(ExitCode::from(code))
    }

    fn write_env_json(
        &self,
        run_dir: &Path,
        output: &Path,
        record: &Path,
        cell_timeout: Duration,
        flags: &SweepFlags,
        plan: Option<&Plan>,
    ) -> Result<()> {
        let knobs = &self.engine_knobs;
        let mut env = json!({
            "command": std::env::args().collect::<Vec<_>>(),
            "started": now(),
            "commit": self.commit,
            "backend": self.backend.as_str(),
            "features": self.features,
            "kiln_bin": self.kiln_bin,
            "kiln_version": self.kiln_version,
            "host": self.machine.host,
            "os": self.machine.os,
            "cpu": self.machine.cpu,
            "cpus": self.machine.cpus,
            "memory_bytes": self.machine.memory_bytes,
            "gpus": self.machine.gpus,
            "driver_version": self.machine.driver_version,
            "cuda_version": self.machine.cuda_version,
            "device": self.device,
            "device_budget_bytes": self.device_budget().map(|b| b.bytes),
            "kiln_env": self.kiln_env,
            "output": output,
            "oom_record": record,
            "estimate_layer": !flags.no_estimate,
            "memory_limit": knobs.memory_limit,
            "prefill_chunk": knobs.prefill_chunk,
            "attention": knobs.attention,
            "cell_timeout_s": cell_timeout.as_secs(),
            "repeat": flags.series.repeat,
            "require_quiet": flags.series.require_quiet,
            "quiet_timeout_s": flags.series.quiet_timeout,
            "busy_cpus": flags.series.busy_cpus,
            "peer": flags.series.peer.as_ref().map(|p| format!("{}={}", p.program, p.path.display())),
            "kv_dtype": knobs.kv_dtype,
            "threads": knobs.threads,
        });
        // What the cells measure: every setting a comparison of two runs must see.
        if let Some(plan) = plan {
            let distinct = |f: &dyn Fn(&super::plan::Cell) -> u64| {
                let mut v: Vec<u64> = plan.cells.iter().map(f).collect();
                v.sort_unstable();
                v.dedup();
                match v.as_slice() {
                    [one] => json!(one),
                    many => json!(many),
                }
            };
            let mut texts: Vec<&str> = Vec::new();
            for c in &plan.cells {
                if let super::plan::Prompt::Text(t) = &c.prompt
                    && !texts.contains(&t.as_str())
                {
                    texts.push(t);
                }
            }
            env["max_tokens"] = distinct(&|c| c.max_tokens);
            env["warmup_tokens"] = distinct(&|c| c.warmup_tokens);
            env["models"] = json!(plan.models);
            env["lengths"] = json!(plan.lengths);
            env["prompt_texts"] = json!(texts);
        }
        let path = run_dir.join("env.json");
        fs::write(&path, serde_json::to_string_pretty(&env)? + "\n")
            .with_context(|| format!("writing {}", path.display()))
    }
}

/// A session whose engine is built and whose run directory exists: what a sweep needs to
/// launch cells through [`LocalRunner`], judge them with the OOM layers and fingerprint
/// its rows.
pub struct Started {
    session: Session,
    user_cwd: PathBuf,
    run_dir: PathBuf,
    /// Passed to every engine call.
    pub knobs: EngineKnobs,
    /// The engine knobs as the decode CSV records them.
    pub row_knobs: Knobs,
    /// Per cell.
    pub cell_timeout: Duration,
}

impl Started {
    /// The run directory.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// Signals and child exits: one shutdown point for the run.
    pub fn shutdown(&self) -> &Shutdown {
        &self.session.shutdown
    }

    /// A runner of local `kiln` children with this run's settings.
    pub fn runner(&self) -> LocalRunner<'_> {
        let s = &self.session;
        LocalRunner {
            kiln: s.kiln_bin.clone(),
            workdir: s.root.clone(),
            user_cwd: self.user_cwd.clone(),
            run_dir: self.run_dir.clone(),
            knobs: self.knobs.clone(),
            backend: s.backend,
            cell_timeout: self.cell_timeout,
            host: s.machine.host.clone(),
            device: s.device.clone(),
            device_budget: s.device_budget(),
            measure_roofs: s.measure_roofs,
            shutdown: &s.shutdown,
            memory_events: classify::memory_events_path(),
        }
    }

    /// The runner of `--peer`'s cells, with this run's directories, threads and timeout.
    /// The driver of `plan`'s cells into the CSV at `csv`, with `peer` beside kiln: what a
    /// sweep and every round of a `--until-ci` run walk the cells with.
    pub(super) fn driver<'a>(
        &'a self,
        plan: &'a Plan,
        flags: &SweepFlags,
        csv: &Path,
        peer: Option<PeerRunner<'a>>,
    ) -> Driver<'a> {
        Driver {
            roofs: Default::default(),
            meta: self.meta(),
            shutdown: self.shutdown(),
            plan,
            layers: self.layers(),
            estimate_on: !flags.no_estimate,
            source_csv: self.display(csv),
            model_paths: BTreeMap::new(),
            knobs: self.row_knobs.clone(),
            peer,
            quiet: (flags.series.limits(), flags.series.quiet_wait()),
        }
    }

    pub fn peer_runner(&self, spec: crate::peer::PeerSpec) -> PeerRunner<'_> {
        let s = &self.session;
        PeerRunner {
            spec,
            kiln: s.kiln_bin.clone(),
            workdir: s.root.clone(),
            user_cwd: self.user_cwd.clone(),
            run_dir: self.run_dir.clone(),
            export_dir: s.root.join("target/peer-gguf"),
            threads: s.engine_knobs.threads,
            timeout: self.cell_timeout,
            shutdown: &s.shutdown,
            exported: BTreeMap::new(),
            version: String::new(),
        }
    }

    /// The OOM layers (backstop, the persistent record, the fake-OOM hook), fresh.
    pub fn layers(&self) -> OomLayers {
        OomLayers {
            backstop: Backstop::default(),
            record: RecordView::new(RecordFile::new(self.session.record_path.clone())),
            ignore_record: self.session.harness_env.ignore_record,
            fake: FakeOom::new(self.session.harness_env.fake_oom.clone()),
        }
    }

    /// The fingerprint of every row.
    pub(crate) fn meta(&self) -> RowMeta {
        let s = &self.session;
        let (driver_version, cuda_version) = s.machine.gpu_software(s.backend.as_str());
        RowMeta {
            driver_version,
            cuda_version,
            root: s.root.clone(),
            host: s.machine.host.clone(),
            backend: s.backend.as_str().to_string(),
            commit: s.commit.clone(),
            features: s.features.clone(),
            kiln_env: s.kiln_env.clone(),
            kiln_version: s.kiln_version.clone(),
        }
    }

    /// `p` relative to the workspace root when it is inside it.
    pub fn display(&self, p: &Path) -> String {
        self.session.display(p)
    }
}

/// `<backend>_<host>_<date>_<kind>`: a default output's name without its extension (the
/// host with anything but letters, digits and `-` made `_`). .gitignore covers it.
fn default_stem(backend: &str, host: &str, kind: &str) -> String {
    let host: String =
        host.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
    format!("{backend}_{host}_{}_{kind}", chrono::Utc::now().format("%Y-%m-%d"))
}

/// `dir/<stem>.csv`, or when that exists the first free `dir/<stem>-N.csv` (N from 2)
/// together with the taken first name: a default output never overwrites what an
/// earlier run measured.
/// The name is claimed by creating the file (`create_new`), so two sweeps started at once
/// never pick the same one.
fn unused_path(dir: &Path, stem: &str) -> Result<(PathBuf, Option<PathBuf>)> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let first = dir.join(format!("{stem}.csv"));
    for i in 1..10_000 {
        let p = if i == 1 { first.clone() } else { dir.join(format!("{stem}-{i}.csv")) };
        match fs::OpenOptions::new().write(true).create_new(true).open(&p) {
            Ok(_) => return Ok((p, (i > 1).then(|| first.clone()))),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("creating {}", p.display())),
        }
    }
    anyhow::bail!("no free output name for {stem} in {}", dir.display())
}

/// The note when the default output of today is taken: the file written instead, and,
/// where `--resume` applies (the local runner), how to finish the earlier run instead.
fn taken_note(first: &str, path: &str, local: bool) -> String {
    if local {
        format!(
            "note: {first} exists; writing {path} (pass --resume {} to finish that run instead)",
            crate::shell::quote(first)
        )
    } else {
        format!("note: {first} exists; the merged rows go to {path}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_taken_output_note_offers_resume_only_where_it_applies() {
        let local = taken_note("benchmarks/a.csv", "benchmarks/a-2.csv", true);
        assert!(local.ends_with("(pass --resume benchmarks/a.csv to finish that run instead)"), "{local}");
        let slurm = taken_note("benchmarks/a.csv", "benchmarks/a-2.csv", false);
        assert_eq!(slurm, "note: benchmarks/a.csv exists; the merged rows go to benchmarks/a-2.csv");
    }

    /// A default run leaves no untracked file in the checkout: every default CSV name, its
    /// `-N` successors and the plots beside them are gitignored, and the committed record
    /// stays tracked.
    #[test]
    fn default_outputs_are_gitignored_and_the_committed_record_stays_tracked() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let git = |args: &[&str]| std::process::Command::new("git").current_dir(root).args(args).output();
        match git(&["rev-parse", "--is-inside-work-tree"]) {
            Ok(o) if o.status.success() => {}
            _ => return eprintln!("not a git checkout: .gitignore was not checked"),
        }
        for kind in ["longprompt", "decode", "offload-copy"] {
            let stem = default_stem("cpu", "build host.local", kind);
            for name in [
                format!("{stem}.csv"),
                format!("{stem}.svg"),
                format!("{stem}-2.csv"),
                format!("{stem}-2.svg"),
            ] {
                let path = format!("benchmarks/{name}");
                let o = git(&["check-ignore", "-q", "--no-index", &path]).unwrap();
                assert!(
                    o.status.success(),
                    "{path} is not gitignored: a default run would leave it untracked"
                );
            }
        }
        for tracked in ["benchmarks/cpu_vm_2026-11-30_longprompt.csv", "benchmarks/corpus/quality-en.txt"] {
            let o = git(&["ls-files", "--error-unmatch", tracked]).unwrap();
            assert!(o.status.success(), "{tracked} is no longer tracked");
        }
        let o = git(&["check-ignore", "-q", "--no-index", "benchmarks/corpus/quality-en.txt"]).unwrap();
        assert!(!o.status.success(), "the corpus is gitignored");
    }

    #[test]
    fn default_outputs_never_overwrite_an_earlier_run() {
        let dir = tempfile::tempdir().unwrap();
        let (p, taken) = unused_path(dir.path(), "cpu_h_2026-11-30_longprompt").unwrap();
        assert_eq!(p, dir.path().join("cpu_h_2026-11-30_longprompt.csv"));
        assert!(taken.is_none());
        // Claimed at once: the next call, as from a sweep started in the same second,
        // gets the next name.
        let (p2, taken) = unused_path(dir.path(), "cpu_h_2026-11-30_longprompt").unwrap();
        assert_eq!(p2, dir.path().join("cpu_h_2026-11-30_longprompt-2.csv"));
        assert_eq!(taken, Some(p));
        let (p3, _) = unused_path(dir.path(), "cpu_h_2026-11-30_longprompt").unwrap();
        assert_eq!(p3, dir.path().join("cpu_h_2026-11-30_longprompt-3.csv"));
    }
}
