//! `cargo xtask bench-quality`: what kiln's arithmetic costs in output quality, measured
//! like llama.cpp's `perplexity --kl-divergence`.
//!
//! For each model, a reference pass (`kiln score` with `KILN_ACT_PRECISION=f32` and an
//! f32 KV cache: the weights as stored, no activation rounding) writes the
//! log-probabilities of every scored position of a corpus; then one measured pass per
//! activation scheme (`KILN_ACT_PRECISION`, with the default f16 cache) writes its own.
//! Per position the harness takes the KL divergence `sum p_ref (log p_ref - log p)`,
//! whether the top-1 tokens agree, the measured negative log-likelihood of the next token
//! and the change of that token's probability. Rows (one per model and scheme: perplexity
//! of both passes, mean KLD with its standard error, median, p99 and max, top-1
//! agreement, RMS probability change, scoring speed) go to a CSV, flushed as each is
//! written, and a markdown table beside it, both fingerprinted with the commit, host,
//! CPU and `KILN_*` environment.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use xshell::Shell;

use crate::args::count;
use crate::child::Shutdown;
use crate::console::{self, usage};
use crate::fsx::write_atomic;
use crate::kiln_build::{Backend, EnginePackage, build_release};
use crate::machine::{self, Machine};
use crate::sweep::classify::ChildExit;
use crate::sweep::rows::CsvOut;
use crate::sweep::runner::{Ran, run_logged};

/// The corpus shipped with kiln (see its header for the licence).
pub mod plot;

pub use self::plot::{Scored, panels};

const DEFAULT_CORPUS: &str = "benchmarks/corpus/quality-en.txt";
/// First bytes of a `kiln score` file.
const MAGIC: &[u8; 8] = b"KILNLP01";

/// Flags of `cargo xtask bench-quality`.
#[derive(clap::Args)]
pub struct BenchQuality {
    /// Models, comma-separated (anything `kiln -m` accepts) [default: synthetic:tiny@4bit].
    #[arg(short = 'm', long, alias = "model", value_name = "LIST", value_delimiter = ',')]
    models: Vec<String>,
    /// Activation schemes to measure, comma-separated `KILN_ACT_PRECISION` values (int16,
    /// int8, int16-wide8, f32; `int` is int8).
    #[arg(long, value_name = "LIST", value_delimiter = ',', default_value = "int16,int8")]
    schemes: Vec<String>,
    /// The text to score.
    #[arg(long, value_name = "FILE", default_value = DEFAULT_CORPUS)]
    corpus: PathBuf,
    /// Tokens per window.
    #[arg(long, value_name = "N", default_value_t = 512, value_parser = count(2))]
    window: u64,
    /// First scored position of each window (earlier ones are context).
    #[arg(long, value_name = "P", default_value_t = 256, value_parser = count(0))]
    first_scored: u64,
    /// Windows scored at most (the shipped corpus fills 13 windows of the defaults).
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = count(1))]
    max_windows: u64,
    /// Worker threads of every `kiln` run.
    #[arg(long, value_name = "N", value_parser = count(1))]
    threads: Option<u64>,
    /// Use this `kiln` binary instead of building one (also KILN_BENCH_KILN_BIN).
    #[arg(long, value_name = "PATH")]
    kiln_bin: Option<PathBuf>,
    /// Use this log-probability file as the reference of the (single) model instead of
    /// scoring one: a reference from an earlier run, with the same corpus and windows.
    #[arg(long, value_name = "FILE")]
    reference: Option<PathBuf>,
    /// Also compare a log-probability file another engine wrote for the first model
    /// (`NAME=FILE`, repeatable; scripts/quality/mlx_logprobs.py and llama_cpp_logprobs.py
    /// write them for mlx-lm and llama.cpp), as a row whose scheme is NAME.
    #[arg(long, value_name = "NAME=FILE")]
    compare: Vec<String>,
    /// Directory for the CSV, the markdown table and the log-probability files
    /// [default: benchmarks/runs/quality-<timestamp>].
    #[arg(long, value_name = "DIR")]
    out_dir: Option<PathBuf>,
}

/// The JSON header of a log-probability file (the fields the harness reads).
#[derive(Debug, Deserialize)]
struct LpHeader {
    vocab: usize,
    positions: usize,
}

/// The JSON line `kiln score` prints.
#[derive(Debug, Deserialize)]
struct ScoreSummary {
    positions: usize,
    perplexity: f64,
    tokens_per_s: f64,
}

/// The CSV header, exactly: [`Row`]'s fields in order.
const HEADER: [&str; 21] = [
    "model",
    "scheme",
    "positions",
    "ppl_ref",
    "ppl",
    "ppl_change_pct",
    "kld_mean",
    "kld_se",
    "kld_median",
    "kld_p99",
    "kld_max",
    "kld_floor",
    "top1_agree",
    "rms_dp",
    "ref_tok_s",
    "tok_s",
    "commit",
    "host",
    "cpu",
    "kiln_env",
    "timestamp",
];

/// One row of the report.
#[derive(Debug, Default, Serialize)]
struct Row {
    model: String,
    scheme: String,
    positions: usize,
    ppl_ref: f64,
    ppl: f64,
    ppl_change_pct: f64,
    kld_mean: f64,
    kld_se: f64,
    kld_median: f64,
    kld_p99: f64,
    kld_max: f64,
    kld_floor: f64,
    top1_agree: f64,
    rms_dp: f64,
    ref_tok_s: f64,
    tok_s: f64,
    commit: String,
    host: String,
    cpu: String,
    kiln_env: String,
    timestamp: String,
}

/// Quality statistics of measured log-probabilities against reference ones.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Stats {
    /// Positions compared.
    pub positions: usize,
    /// Perplexity of the reference: exp of the mean negative log-likelihood of the next token.
    pub ppl_ref: f64,
    /// Perplexity of the measured pass.
    pub ppl: f64,
    /// Mean KL divergence (reference || measured), in nats.
    pub kld_mean: f64,
    /// Standard error of the mean KLD.
    pub kld_se: f64,
    /// Median KLD.
    pub kld_median: f64,
    /// 99th percentile KLD (nearest rank).
    pub kld_p99: f64,
    /// Largest KLD.
    pub kld_max: f64,
    /// The measurement floor: the mean KLD of the reference against itself after a
    /// round trip through the stored precision (f32). A mean KLD near it is
    /// indistinguishable from 0.
    pub kld_floor: f64,
    /// Share of positions whose most likely token is the same.
    pub top1_agree: f64,
    /// Root mean square change of the next token's probability.
    pub rms_dp: f64,
}

/// Accumulates per-position comparisons into [`Stats`].
#[derive(Default)]
pub struct Accumulator {
    klds: Vec<f64>,
    floors: Vec<f64>,
    nll_ref: f64,
    nll: f64,
    agree: usize,
    dp2: f64,
}

/// `log(sum(exp(v)))` in f64; `-inf` when every entry is `-inf`.
fn log_sum_exp(v: impl Iterator<Item = f64> + Clone) -> f64 {
    let max = v.clone().fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return max;
    }
    max + v.map(|x| (x - max).exp()).sum::<f64>().ln()
}

/// `KL(p || q)` of two log-probability vectors already normalised in f64; a token the
/// reference gives probability 0 adds nothing, one only the measured pass gives 0 adds
/// an infinite divergence (the true value). Never clamped: rounding can make a tiny
/// divergence negative, and clamping each position would turn that noise into a bias.
fn kld(p: &[f64], q: &[f64]) -> f64 {
    p.iter().zip(q).filter(|(r, _)| **r > f64::NEG_INFINITY).map(|(&r, &m)| r.exp() * (r - m)).sum()
}

/// `lp` renormalised in f64: the stored f32 values sum to 1 only to about 1e-7, which is
/// more than the divergences of two matching engines.
fn renormalised(lp: &[f32], out: &mut Vec<f64>) {
    let lse = log_sum_exp(lp.iter().map(|&x| f64::from(x)));
    out.clear();
    out.extend(lp.iter().map(|&x| f64::from(x) - lse));
}

impl Accumulator {
    /// Adds one position: reference and measured log-probabilities over the vocabulary
    /// (each with at least one finite entry, none NaN or `+inf`), and the id of the next
    /// token. Both distributions are renormalised in f64 first.
    pub fn add(&mut self, lp_ref: &[f32], lp: &[f32], target: usize) {
        let (mut r, mut m, mut rt) = (Vec::new(), Vec::new(), Vec::new());
        renormalised(lp_ref, &mut r);
        renormalised(lp, &mut m);
        self.klds.push(kld(&r, &m));
        // The measurement floor: the reference against itself after a round trip
        // through the stored precision (f32), renormalised as any file is.
        let stored: Vec<f32> = r.iter().map(|&x| x as f32).collect();
        renormalised(&stored, &mut rt);
        self.floors.push(kld(&r, &rt));
        self.nll_ref -= r[target];
        self.nll -= m[target];
        if argmax(lp_ref) == argmax(lp) {
            self.agree += 1;
        }
        let dp = m[target].exp() - r[target].exp();
        self.dp2 += dp * dp;
    }

    /// The statistics so far.
    pub fn finish(&self) -> Stats {
        let n = self.klds.len();
        if n == 0 {
            return Stats::default();
        }
        let nf = n as f64;
        let mean = self.klds.iter().sum::<f64>() / nf;
        let var =
            if n > 1 { self.klds.iter().map(|k| (k - mean).powi(2)).sum::<f64>() / (nf - 1.0) } else { 0.0 };
        let mut sorted = self.klds.clone();
        sorted.sort_by(f64::total_cmp);
        let median = if n % 2 == 1 { sorted[n / 2] } else { (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0 };
        let rank = |q: f64| sorted[((q * nf).ceil() as usize).clamp(1, n) - 1];
        Stats {
            positions: n,
            ppl_ref: (self.nll_ref / nf).exp(),
            ppl: (self.nll / nf).exp(),
            kld_mean: mean,
            kld_se: (var / nf).sqrt(),
            kld_median: median,
            kld_p99: rank(0.99),
            kld_max: sorted[n - 1],
            kld_floor: if self.floors.is_empty() { 0.0 } else { self.floors.iter().sum::<f64>() / nf },
            top1_agree: self.agree as f64 / nf,
            rms_dp: (self.dp2 / nf).sqrt(),
        }
    }
}

fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// A `kiln score` file opened for reading, positioned at its first record.
struct LpFile {
    header: LpHeader,
    reader: BufReader<File>,
    path: PathBuf,
}

impl LpFile {
    /// Opens `path` and reads its header. Every size the file states (the header's
    /// length, then `positions` records of `4 + 4 x vocab` bytes) is checked against the
    /// file's length before anything is allocated for it.
    fn open(path: &Path) -> Result<LpFile> {
        // A score file the engine wrote into the out directory: only a regular one is read.
        let (file, file_len) = crate::fsx::open_regular(path)?;
        let mut reader = BufReader::with_capacity(1 << 20, file);
        let mut magic = [0u8; 8];
        reader.read_exact(&mut magic).with_context(|| format!("reading {}", path.display()))?;
        if &magic != MAGIC {
            bail!("{}: not a kiln score file (magic {magic:?}, expected {MAGIC:?})", path.display());
        }
        let mut len = [0u8; 4];
        reader.read_exact(&mut len).with_context(|| format!("reading {}", path.display()))?;
        let len = u64::from(u32::from_le_bytes(len));
        let file_len = file_len.max(12);
        if len > file_len - 12 {
            bail!(
                "{}: the header claims {len} bytes but the file has {} after its first 12: a truncated or corrupt kiln score file",
                path.display(),
                file_len - 12
            );
        }
        let mut json = vec![0u8; len as usize];
        reader.read_exact(&mut json).with_context(|| format!("reading {}", path.display()))?;
        let header: LpHeader =
            serde_json::from_slice(&json).with_context(|| format!("{}: malformed header", path.display()))?;
        let body = file_len - 12 - len;
        let want = (header.vocab as u64)
            .checked_mul(4)
            .and_then(|v| v.checked_add(4))
            .and_then(|r| r.checked_mul(header.positions as u64));
        if header.vocab == 0 || want != Some(body) {
            bail!(
                "{}: the header's {} positions of a vocabulary of {} need {} bytes of records, the file has {body}:                  a truncated or corrupt kiln score file",
                path.display(),
                header.positions,
                header.vocab,
                want.map_or_else(|| "more than 2^64".to_string(), |w| w.to_string())
            );
        }
        Ok(LpFile { header, reader, path: path.to_path_buf() })
    }

    /// Reads record `position` into `lp`, returning the next token's id. A NaN or `+inf`
    /// log-probability, or a record whose every entry is `-inf`, is an error naming the
    /// file, the position and the token; `-inf` alone is a probability of 0.
    fn next(&mut self, position: usize, lp: &mut [f32], buf: &mut Vec<u8>) -> Result<usize> {
        buf.resize(4 + 4 * lp.len(), 0);
        self.reader.read_exact(buf).with_context(|| format!("{}: truncated record", self.path.display()))?;
        let target = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        for (o, c) in lp.iter_mut().zip(buf[4..].chunks_exact(4)) {
            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        if target >= lp.len() {
            bail!(
                "{}: position {position}: next-token id {target} outside the vocabulary of {}",
                self.path.display(),
                lp.len()
            );
        }
        if let Some(t) = lp.iter().position(|v| v.is_nan() || *v == f32::INFINITY) {
            bail!(
                "{}: position {position}: the log-probability of token {t} is {}: expected finite numbers (or -inf for a probability of 0)",
                self.path.display(),
                lp[t]
            );
        }
        if lp.iter().all(|v| *v == f32::NEG_INFINITY) {
            bail!(
                "{}: position {position}: every log-probability is -inf: expected a distribution",
                self.path.display()
            );
        }
        Ok(target)
    }
}

/// Compares two `kiln score` files position by position.
pub fn compare(reference: &Path, measured: &Path) -> Result<Stats> {
    let (mut r, mut m) = (LpFile::open(reference)?, LpFile::open(measured)?);
    if r.header.vocab != m.header.vocab || r.header.positions != m.header.positions {
        bail!(
            "{} and {} do not score the same positions (vocab {} vs {}, positions {} vs {}): \
             run both with the same model, corpus and windows",
            reference.display(),
            measured.display(),
            r.header.vocab,
            m.header.vocab,
            r.header.positions,
            m.header.positions
        );
    }
    let v = r.header.vocab;
    let (mut lr, mut lm, mut buf) = (vec![0f32; v], vec![0f32; v], Vec::new());
    let mut acc = Accumulator::default();
    for i in 0..r.header.positions {
        let tr = r.next(i, &mut lr, &mut buf)?;
        let tm = m.next(i, &mut lm, &mut buf)?;
        if tr != tm {
            bail!(
                "position {i}: the next token is {tr} in the reference but {tm} measured: the token streams differ"
            );
        }
        acc.add(&lr, &lm, tr);
    }
    Ok(acc.finish())
}

impl BenchQuality {
    pub fn run(self, sh: &Shell) -> Result<ExitCode> {
        let root = sh.current_dir();
        // Every flag is checked before anything is built or scored.
        if !self.corpus.is_file() {
            usage!(
                "invalid --corpus {}: no such file (the shipped corpus is {DEFAULT_CORPUS})",
                self.corpus.display()
            );
        }
        for s in &self.schemes {
            // The engine's own list (kiln-protocol), so a scheme it gains is accepted here.
            if s.trim().is_empty() || kiln_protocol::ActScheme::parse(s).is_err() {
                usage!(
                    "invalid --schemes entry {s:?}: accepted values are {}",
                    kiln_protocol::ActScheme::ACCEPTED
                );
            }
        }
        let compares = self
            .compare
            .iter()
            .map(|c| match c.split_once('=') {
                Some((name, file)) if !name.is_empty() && Path::new(file).is_file() => {
                    Ok((name.to_string(), PathBuf::from(file)))
                }
                _ => usage!("invalid --compare {c:?}: give NAME=FILE with an existing log-probability file"),
            })
            .collect::<Result<Vec<_>>>()?;
        if let Some(r) = &self.reference
            && (!r.is_file() || self.models.len() > 1)
        {
            usage!(
                "invalid --reference {}: give an existing log-probability file, with at most one model",
                r.display()
            );
        }
        let stamp = chrono::Local::now().format("%Y%m%d-%H%M%S").to_string();
        let out_dir =
            self.out_dir.clone().unwrap_or_else(|| root.join(format!("benchmarks/runs/quality-{stamp}")));
        if out_dir.exists() && !out_dir.is_dir() {
            usage!("invalid --out-dir {}: it exists and is not a directory", out_dir.display());
        }
        // The rows go to a CSV locked for the run and flushed as each is written; it
        // replaces quality.csv only when the run is complete, so a rerun into the same
        // directory loses nothing before it has measured, and a second run at once is
        // refused on the lock.
        let csv_path = out_dir.join("quality.csv");
        let partial_path = out_dir.join("quality.partial.csv");
        let mut csv = CsvOut::create_with_header(&partial_path, &HEADER, "--out-dir")?;
        let shutdown = Shutdown::install()?;
        let kiln = match self
            .kiln_bin
            .clone()
            .or_else(|| std::env::var_os("KILN_BENCH_KILN_BIN").map(PathBuf::from))
        {
            Some(p) => p,
            None => {
                if let Some(sig) = build_release(&root, Backend::Cpu, &shutdown)? {
                    return Ok(ExitCode::from(crate::child::exit_code_for(sig)));
                }
                EnginePackage::read(&root)?.binary("release")
            }
        };
        let machine = Machine::probe();
        let commit = machine::commit(&root);
        let env =
            machine::kiln_env().into_iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ");
        let models = if self.models.is_empty() {
            vec!["synthetic:tiny@4bit".to_string()]
        } else {
            self.models.clone()
        };
        let mut rows = Vec::new();
        let interrupted = |sig: i32| {
            eprintln!(
                "interrupted by {}: kiln score's process group was killed; the rows measured so far are in {} ({} is unchanged)",
                crate::child::signal_name(sig),
                partial_path.display(),
                csv_path.display()
            );
            Ok(ExitCode::from(crate::child::exit_code_for(sig)))
        };
        for (mi, model) in models.iter().enumerate() {
            let (ref_path, reference) = match &self.reference {
                Some(r) => (r.clone(), None),
                None => {
                    let p = out_dir.join(format!("m{mi}-reference.lp"));
                    match self.score(&kiln, model, "f32", "f32", &p, &shutdown)? {
                        Ran::Done(summary) => (p, Some(summary)),
                        Ran::Interrupted(sig) => return interrupted(sig),
                    }
                }
            };
            let extra = if mi == 0 { compares.as_slice() } else { &[] };
            let passes = self
                .schemes
                .iter()
                .map(|s| (s.clone(), None))
                .chain(extra.iter().map(|(n, f)| (n.clone(), Some(f.clone()))));
            for (scheme, file) in passes {
                let (path, measured) = match file {
                    Some(f) => (f, None),
                    None => {
                        let path = out_dir.join(format!("m{mi}-{scheme}.lp"));
                        match self.score(&kiln, model, &scheme, "f16", &path, &shutdown)? {
                            Ran::Done(m) => (path, Some(m)),
                            Ran::Interrupted(sig) => return interrupted(sig),
                        }
                    }
                };
                let s = compare(&ref_path, &path)?;
                let row = Row {
                    model: model.clone(),
                    scheme: scheme.clone(),
                    positions: s.positions,
                    ppl_ref: s.ppl_ref,
                    ppl: s.ppl,
                    ppl_change_pct: (s.ppl / s.ppl_ref - 1.0) * 100.0,
                    kld_mean: s.kld_mean,
                    kld_se: s.kld_se,
                    kld_median: s.kld_median,
                    kld_p99: s.kld_p99,
                    kld_max: s.kld_max,
                    kld_floor: s.kld_floor,
                    top1_agree: s.top1_agree,
                    rms_dp: s.rms_dp,
                    ref_tok_s: reference.as_ref().map_or(f64::NAN, |r| r.tokens_per_s),
                    tok_s: measured.as_ref().map_or(f64::NAN, |m| m.tokens_per_s),
                    commit: commit.clone(),
                    host: machine.host.clone(),
                    cpu: machine.cpu.clone(),
                    kiln_env: env.clone(),
                    timestamp: chrono::Local::now().to_rfc3339(),
                };
                csv.write_record(&row)?;
                if let Some(reference) = &reference
                    && ((reference.perplexity - s.ppl_ref).abs() > 1e-3 * s.ppl_ref
                        || reference.positions != s.positions)
                {
                    bail!("the reference file disagrees with its own run's summary: {}", ref_path.display());
                }
                rows.push(row);
            }
        }
        let md_path = out_dir.join("quality.md");
        let md = markdown(&rows, &machine, &commit, &self);
        write_atomic(&md_path, md.as_bytes())?;
        // Still under the lock: the finished CSV replaces the old one in one rename.
        std::fs::rename(&partial_path, &csv_path)
            .with_context(|| format!("renaming {} to {}", partial_path.display(), csv_path.display()))?;
        drop(csv);
        let scored: Vec<Scored> = rows
            .iter()
            .map(|r| Scored {
                model: r.model.clone(),
                scheme: r.scheme.clone(),
                kld_mean: r.kld_mean,
                kld_se: r.kld_se,
                top1_agree: r.top1_agree,
            })
            .collect();
        if let Err(e) = crate::plot::write_svg(&out_dir.join("quality.svg"), &panels(&scored)) {
            eprintln!("warning: no quality.svg: {e:#}");
        }
        crate::report::write_or_warn(&out_dir);
        console::out(&format!("{md}\n"))?;
        eprintln!("wrote {} and {}", csv_path.display(), md_path.display());
        Ok(ExitCode::SUCCESS)
    }

    /// Runs `kiln score` for one model and scheme as every task runs a child: in its own
    /// process group, dying with the harness, stopped on SIGINT, SIGTERM or SIGHUP; its
    /// stdout and stderr go beside `out` (`.stdout`, `.stderr`).
    fn score(
        &self,
        kiln: &Path,
        model: &str,
        scheme: &str,
        kv: &str,
        out: &Path,
        shutdown: &Shutdown,
    ) -> Result<Ran<ScoreSummary>> {
        let mut cmd = Command::new(kiln);
        cmd.args(["score", "-m", model, "--kv-dtype", kv, "--text-file"])
            .arg(&self.corpus)
            .args(["--window", &self.window.to_string(), "--first-scored", &self.first_scored.to_string()])
            .args(["--max-windows", &self.max_windows.to_string(), "--output"])
            .arg(out)
            .env("KILN_ACT_PRECISION", scheme);
        if let Some(t) = self.threads {
            cmd.args(["--threads", &t.to_string()]);
        }
        eprintln!("scoring {model} with KILN_ACT_PRECISION={scheme}, {kv} cache");
        let what = format!("kiln score for {model} (KILN_ACT_PRECISION={scheme})");
        let (exit, stdout, stderr) =
            match run_logged(cmd, &what, &out.with_extension(""), Duration::MAX, shutdown)? {
                Ran::Done(x) => x,
                Ran::Interrupted(sig) => return Ok(Ran::Interrupted(sig)),
            };
        if exit != ChildExit::Code(0) {
            bail!("{what} failed ({exit}):\n{stderr}");
        }
        serde_json::from_str(stdout.trim())
            .map(Ran::Done)
            .with_context(|| format!("{what} printed {stdout:?}"))
    }
}

fn markdown(rows: &[Row], machine: &Machine, commit: &str, flags: &BenchQuality) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "## bench-quality at {commit} on {} ({}, {} CPUs)\n\n",
        machine.host, machine.cpu, machine.cpus
    ));
    s.push_str(&format!(
        "Corpus {}, windows of {} tokens scored from position {}, at most {} windows. Reference: \
         {}; measured passes use the f16 cache and name their KILN_ACT_PRECISION scheme (other \
         engines' files given with --compare name themselves).\n\n",
        flags.corpus.display(),
        flags.window,
        flags.first_scored,
        flags.max_windows,
        flags.reference.as_ref().map_or_else(
            || "KILN_ACT_PRECISION=f32 with an f32 KV cache".to_string(),
            |r| format!("the file {}", r.display())
        ),
    ));
    s.push_str(
        "Each distribution is renormalised in f64 before the divergence and no position is \
         clamped. KLD floor: the mean KLD of the reference against itself after a round trip \
         through the stored precision (f32); a mean KLD within a few times it is \
         indistinguishable from 0.\n\n",
    );
    let speed = |v: f64| if v.is_finite() { format!("{v:.1}") } else { "n/a".to_string() };
    s.push_str("| model | scheme | positions | PPL ref | PPL | PPL change | mean KLD (SE) | KLD floor | median KLD | p99 KLD | max KLD | top-1 agree | RMS dp | tok/s ref | tok/s |\n");
    s.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {:.4} | {:.4} | {:+.3}% | {:.3e} ({:.1e}) | {:.1e} | {:.3e} | {:.3e} | {:.3e} | {:.2}% | {:.2e} | {} | {} |\n",
            r.model,
            r.scheme,
            r.positions,
            r.ppl_ref,
            r.ppl,
            r.ppl_change_pct,
            r.kld_mean,
            r.kld_se,
            r.kld_floor,
            r.kld_median,
            r.kld_p99,
            r.kld_max,
            r.top1_agree * 100.0,
            r.rms_dp,
            speed(r.ref_tok_s),
            speed(r.tok_s)
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ln(v: &[f64]) -> Vec<f32> {
        v.iter().map(|p| p.ln() as f32).collect()
    }

    #[test]
    fn kld_perplexity_and_agreement_match_hand_values() {
        let mut acc = Accumulator::default();
        // Position 1: identical distributions, target 0.
        acc.add(&ln(&[0.5, 0.25, 0.25]), &ln(&[0.5, 0.25, 0.25]), 0);
        // Position 2: p = (0.5, 0.5), q = (0.25, 0.75), target 1.
        // KLD = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln 2 + 0.5 ln(2/3) = 0.5 ln(4/3).
        acc.add(&ln(&[0.5, 0.5]), &ln(&[0.25, 0.75]), 1);
        let s = acc.finish();
        let k2 = 0.5 * (4.0f64 / 3.0).ln();
        assert_eq!(s.positions, 2);
        assert!((s.kld_mean - k2 / 2.0).abs() < 1e-6, "{s:?}");
        // Sample standard deviation of {0, k2} is k2 / sqrt(2); SE divides by sqrt(2).
        assert!((s.kld_se - k2 / 2.0).abs() < 1e-6, "{s:?}");
        assert!((s.kld_median - k2 / 2.0).abs() < 1e-6);
        assert!((s.kld_max - k2).abs() < 1e-6 && (s.kld_p99 - k2).abs() < 1e-6);
        // Reference NLL: -ln 0.5 twice -> PPL 2. Measured: -ln 0.5, -ln 0.75.
        assert!((s.ppl_ref - 2.0).abs() < 1e-6);
        assert!((s.ppl - (0.5f64 * 0.75).powf(-0.5)).abs() < 1e-6);
        // Argmax: same at position 1; at 2 the reference ties (first index 0), measured picks 1.
        assert!((s.top1_agree - 0.5).abs() < 1e-12);
        // dp: 0 then 0.75 - 0.5.
        assert!((s.rms_dp - (0.0625f64 / 2.0).sqrt()).abs() < 1e-6);
    }

    /// A deterministic spread of logits over `v` tokens, as log-probabilities in f32.
    fn log_softmax(v: usize, seed: u64) -> Vec<f32> {
        let mut x = seed;
        let logits: Vec<f64> = (0..v)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 11) as f64 / (1u64 << 53) as f64) * 12.0
            })
            .collect();
        let lse = log_sum_exp(logits.iter().copied());
        logits.iter().map(|l| (l - lse) as f32).collect()
    }

    #[test]
    fn an_unnormalised_copy_of_a_distribution_diverges_by_nothing() {
        // The measured pass is the reference shifted by +-1e-7 per position: its
        // probabilities sum to 1 only to 1e-7, as f32 log-softmax output does. Taken
        // as stored, the per-position KLDs are -+1e-7, and clamping each at 0 scored
        // the pair about 5e-8; renormalised they are the same distribution.
        let mut acc = Accumulator::default();
        for pos in 0..200u64 {
            let r = log_softmax(1000, pos);
            let c = if pos % 2 == 0 { 1e-7 } else { -1e-7 } * (1.0 + (pos % 7) as f32 / 7.0);
            let m: Vec<f32> = r.iter().map(|x| x + c).collect();
            acc.add(&r, &m, (pos as usize * 31) % 1000);
        }
        let s = acc.finish();
        assert!(s.kld_mean.abs() < 1e-11, "{s:?}");
        assert!(s.kld_max < 1e-10, "{s:?}");
        // The floor is tiny and is what the same file scores against itself.
        assert!(s.kld_floor >= 0.0 && s.kld_floor < 1e-11, "{s:?}");
        assert!((s.ppl - s.ppl_ref).abs() < 1e-9 * s.ppl_ref, "{s:?}");
    }

    #[test]
    fn a_real_divergence_is_kept_whole_and_stands_above_the_floor() {
        // p = (0.5, 0.5), q = (0.25, 0.75), both stored scaled by 2 (sum 2, log + ln 2):
        // renormalised, the divergence is the hand value 0.5 ln(4/3).
        let shift = 2f64.ln();
        let stored = |v: &[f64]| v.iter().map(|p| (p.ln() + shift) as f32).collect::<Vec<_>>();
        let mut acc = Accumulator::default();
        acc.add(&stored(&[0.5, 0.5]), &stored(&[0.25, 0.75]), 1);
        let s = acc.finish();
        let want = 0.5 * (4.0f64 / 3.0).ln();
        assert!((s.kld_mean - want).abs() < 1e-7, "{s:?}");
        assert!((s.ppl_ref - 2.0).abs() < 1e-6 && (s.ppl - 4.0 / 3.0).abs() < 1e-6, "{s:?}");
        assert!(s.kld_floor < 1e-12 && s.kld_mean > 1e6 * s.kld_floor, "{s:?}");
    }

    /// Writes a kiln score file of `records` (next token, log-probabilities).
    fn lp_file(path: &Path, vocab: usize, records: &[(u32, Vec<f32>)]) {
        let json = format!(r#"{{"vocab":{vocab},"positions":{}}}"#, records.len());
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&(json.len() as u32).to_le_bytes());
        b.extend_from_slice(json.as_bytes());
        for (t, lp) in records {
            b.extend_from_slice(&t.to_le_bytes());
            for v in lp {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
        std::fs::write(path, b).unwrap();
    }

    #[test]
    fn sizes_in_a_file_are_checked_against_its_length_before_allocating() {
        let dir = tempfile::tempdir().unwrap();
        // Twelve bytes claiming a 4 GiB header.
        let short = dir.path().join("short.lp");
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&u32::MAX.to_le_bytes());
        std::fs::write(&short, b).unwrap();
        let e = format!("{:#}", compare(&short, &short).unwrap_err());
        assert!(e.contains("short.lp") && e.contains("claims 4294967295 bytes"), "{e}");
        // A small header claiming records the file does not hold, or a vocabulary whose
        // records overflow.
        for (name, json) in [
            ("positions.lp", r#"{"vocab":4,"positions":1000000000}"#),
            ("vocab.lp", r#"{"vocab":18446744073709551615,"positions":2}"#),
            ("zero.lp", r#"{"vocab":0,"positions":0}"#),
        ] {
            let p = dir.path().join(name);
            let mut b = MAGIC.to_vec();
            b.extend_from_slice(&(json.len() as u32).to_le_bytes());
            b.extend_from_slice(json.as_bytes());
            std::fs::write(&p, b).unwrap();
            let e = format!("{:#}", compare(&p, &p).unwrap_err());
            assert!(e.contains(name) && e.contains("bytes of records"), "{e}");
        }
    }

    #[test]
    fn non_finite_log_probabilities_are_an_error_naming_file_and_position() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good.lp");
        let half = (0.5f32).ln();
        lp_file(&good, 2, &[(0, vec![half, half]), (1, vec![half, half])]);
        for (name, bad) in [
            ("nan.lp", vec![f32::NAN, f32::NAN]),
            ("inf.lp", vec![f32::INFINITY, half]),
            ("empty.lp", vec![f32::NEG_INFINITY, f32::NEG_INFINITY]),
        ] {
            let p = dir.path().join(name);
            lp_file(&p, 2, &[(0, vec![half, half]), (1, bad)]);
            for (a, b) in [(&good, &p), (&p, &good)] {
                let e = format!("{:#}", compare(a, b).unwrap_err());
                assert!(e.contains(name) && e.contains("position 1"), "{e}");
            }
        }
        // -inf alone is a probability of 0: accepted, and a divergence when only the
        // measured pass gives a token none.
        let zero = dir.path().join("zero.lp");
        lp_file(&zero, 2, &[(0, vec![0.0, f32::NEG_INFINITY]), (1, vec![0.0, f32::NEG_INFINITY])]);
        let s = compare(&zero, &good).unwrap();
        assert!((s.kld_mean - 2f64.ln()).abs() < 1e-6, "{s:?}");
        assert_eq!(compare(&good, &zero).unwrap().kld_mean, f64::INFINITY);
    }

    #[test]
    fn a_fifo_for_a_score_file_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good.lp");
        lp_file(&good, 2, &[(0, vec![0.0, f32::NEG_INFINITY])]);
        let fifo = dir.path().join("measured.lp");
        use rustix::fs::{CWD, FileType, Mode, mknodat};
        mknodat(CWD, &fifo, FileType::Fifo, Mode::from_raw_mode(0o600), 0).unwrap();
        // Opening a FIFO without O_NONBLOCK would wait here for a writer, forever.
        let e = compare(&good, &fifo).unwrap_err();
        assert!(e.downcast_ref::<console::UsageError>().is_some(), "{e:#}");
        assert!(e.to_string().contains("measured.lp is a FIFO (named pipe)"), "{e:#}");
    }

    #[test]
    fn the_header_is_the_row_struct() {
        let mut w = csv::WriterBuilder::new().has_headers(true).from_writer(Vec::new());
        w.serialize(Row::default()).unwrap();
        let text = String::from_utf8(w.into_inner().unwrap()).unwrap();
        assert_eq!(text.lines().next().unwrap(), HEADER.join(","));
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let mut acc = Accumulator::default();
        for i in 0..200 {
            acc.klds.push(i as f64);
        }
        let s = acc.finish();
        assert_eq!(s.kld_p99, 197.0);
        assert_eq!(s.kld_median, 99.5);
        assert_eq!(s.kld_max, 199.0);
    }

    #[test]
    fn the_recorded_schemes_plot_as_categories_with_their_intervals() {
        // docs/benchmark_results/quality-smollm2-epyc-avx2-2vcpu-2026-12-01.md.
        let m = "SmolLM2-135M-Instruct.Q4_1.gguf";
        let rows: Vec<Scored> = [
            ("int16", 4.074e-7, 9.1e-9, 1.0),
            ("int8", 2.217e-3, 3.3e-5, 0.9671),
            ("llama.cpp", 2.751e-3, 3.8e-5, 0.9626),
            ("mlx-gguf", 1.920e-8, 5.9e-10, 1.0),
            ("mlx-q4g64", 4.097e-1, 5.1e-3, 0.6112),
        ]
        .iter()
        .map(|&(scheme, kld_mean, kld_se, top1_agree)| Scored {
            model: m.into(),
            scheme: scheme.into(),
            kld_mean,
            kld_se,
            top1_agree,
        })
        .collect();
        let l = crate::plot::raster::check("quality", &panels(&rows));
        let p = &l.panels[0];
        let ticks: Vec<&str> = p.x_ticks.iter().map(|t| t.label.as_str()).collect();
        assert_eq!(ticks, ["int16", "int8", "llama.cpp", "mlx-gguf", "mlx-q4g64"]);
        assert!(p.series[0].line.is_none(), "schemes are not a trend");
        assert_eq!(p.series[0].intervals.len(), 5);
        // Seven decades apart, on a log axis: every point is off the axis and inside.
        assert!(p.y_ticks.len() >= 3, "{:?}", p.y_ticks);
    }
}
