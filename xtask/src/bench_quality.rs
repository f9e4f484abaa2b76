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
use std::io::{BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use xshell::Shell;

use crate::child::Shutdown;
use crate::engine::{Backend, EnginePackage, build_release};
use crate::machine::{self, Machine};

/// The corpus shipped with kiln (see its header for the licence).
const DEFAULT_CORPUS: &str = "benchmarks/corpus/quality-en.txt";
/// First bytes of a `kiln score` file.
const MAGIC: &[u8; 8] = b"KILNLP01";

/// Flags of `cargo xtask bench-quality`.
#[derive(clap::Args)]
pub struct BenchQuality {
    /// Models, comma-separated (anything `kiln -m` accepts) [default: synthetic:tiny@4bit].
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    models: Vec<String>,
    /// Activation schemes to measure, comma-separated `KILN_ACT_PRECISION` values (int16,
    /// int8, f32; `int` is int8).
    #[arg(long, value_name = "LIST", value_delimiter = ',', default_value = "int16,int8")]
    schemes: Vec<String>,
    /// The text to score.
    #[arg(long, value_name = "FILE", default_value = DEFAULT_CORPUS)]
    corpus: PathBuf,
    /// Tokens per window.
    #[arg(long, value_name = "N", default_value_t = 512)]
    window: usize,
    /// First scored position of each window (earlier ones are context).
    #[arg(long, value_name = "P", default_value_t = 256)]
    first_scored: usize,
    /// Windows scored at most (the shipped corpus fills 13 windows of the defaults).
    #[arg(long, value_name = "N", default_value_t = 16)]
    max_windows: usize,
    /// Worker threads of every `kiln` run.
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
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

/// One row of the report.
#[derive(Debug, Serialize)]
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
    /// Share of positions whose most likely token is the same.
    pub top1_agree: f64,
    /// Root mean square change of the next token's probability.
    pub rms_dp: f64,
}

/// Accumulates per-position comparisons into [`Stats`].
#[derive(Default)]
pub struct Accumulator {
    klds: Vec<f64>,
    nll_ref: f64,
    nll: f64,
    agree: usize,
    dp2: f64,
}

impl Accumulator {
    /// Adds one position: reference and measured log-probabilities over the vocabulary,
    /// and the id of the next token.
    pub fn add(&mut self, lp_ref: &[f32], lp: &[f32], target: usize) {
        let mut kld = 0f64;
        for (&r, &m) in lp_ref.iter().zip(lp) {
            let r = f64::from(r);
            if r > f64::NEG_INFINITY {
                kld += r.exp() * (r - f64::from(m));
            }
        }
        // Rounding can make a tiny divergence negative; the true value is not.
        self.klds.push(kld.max(0.0));
        self.nll_ref -= f64::from(lp_ref[target]);
        self.nll -= f64::from(lp[target]);
        if argmax(lp_ref) == argmax(lp) {
            self.agree += 1;
        }
        let dp = f64::from(lp[target]).exp() - f64::from(lp_ref[target]).exp();
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
    fn open(path: &Path) -> Result<LpFile> {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let mut reader = BufReader::with_capacity(1 << 20, file);
        let mut magic = [0u8; 8];
        reader.read_exact(&mut magic).with_context(|| format!("reading {}", path.display()))?;
        if &magic != MAGIC {
            bail!("{}: not a kiln score file (magic {magic:?}, expected {MAGIC:?})", path.display());
        }
        let mut len = [0u8; 4];
        reader.read_exact(&mut len).with_context(|| format!("reading {}", path.display()))?;
        let mut json = vec![0u8; u32::from_le_bytes(len) as usize];
        reader.read_exact(&mut json).with_context(|| format!("reading {}", path.display()))?;
        let header: LpHeader =
            serde_json::from_slice(&json).with_context(|| format!("{}: malformed header", path.display()))?;
        Ok(LpFile { header, reader, path: path.to_path_buf() })
    }

    /// Reads the next record into `lp`, returning the next token's id.
    fn next(&mut self, lp: &mut [f32], buf: &mut Vec<u8>) -> Result<usize> {
        buf.resize(4 + 4 * lp.len(), 0);
        self.reader.read_exact(buf).with_context(|| format!("{}: truncated record", self.path.display()))?;
        let target = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        for (o, c) in lp.iter_mut().zip(buf[4..].chunks_exact(4)) {
            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        if target >= lp.len() {
            bail!("{}: next-token id {target} outside the vocabulary of {}", self.path.display(), lp.len());
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
        let tr = r.next(&mut lr, &mut buf)?;
        let tm = m.next(&mut lm, &mut buf)?;
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
        if !self.corpus.is_file() {
            bail!(
                "invalid --corpus {}: no such file (the shipped corpus is {DEFAULT_CORPUS})",
                self.corpus.display()
            );
        }
        for s in &self.schemes {
            if !["int16", "int8", "int", "f32"].contains(&s.as_str()) {
                bail!("invalid --schemes entry {s:?}: accepted values are int16, int8, int, f32");
            }
        }
        let compares = self
            .compare
            .iter()
            .map(|c| match c.split_once('=') {
                Some((name, file)) if !name.is_empty() && Path::new(file).is_file() => {
                    Ok((name.to_string(), PathBuf::from(file)))
                }
                _ => bail!("invalid --compare {c:?}: give NAME=FILE with an existing log-probability file"),
            })
            .collect::<Result<Vec<_>>>()?;
        if let Some(r) = &self.reference
            && (!r.is_file() || self.models.len() > 1)
        {
            bail!(
                "invalid --reference {}: give an existing log-probability file, with at most one model",
                r.display()
            );
        }
        let stamp = chrono::Local::now().format("%Y%m%d-%H%M%S").to_string();
        let out_dir =
            self.out_dir.clone().unwrap_or_else(|| root.join(format!("benchmarks/runs/quality-{stamp}")));
        std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
        let machine = Machine::probe();
        let commit = machine::commit(&root);
        let env =
            machine::kiln_env().into_iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ");
        let models = if self.models.is_empty() {
            vec!["synthetic:tiny@4bit".to_string()]
        } else {
            self.models.clone()
        };
        let csv_path = out_dir.join("quality.csv");
        let mut csv =
            csv::Writer::from_path(&csv_path).with_context(|| format!("creating {}", csv_path.display()))?;
        let mut rows = Vec::new();
        for (mi, model) in models.iter().enumerate() {
            let (ref_path, reference) = match &self.reference {
                Some(r) => (r.clone(), None),
                None => {
                    let p = out_dir.join(format!("m{mi}-reference.lp"));
                    let summary = self.score(&kiln, model, "f32", "f32", &p)?;
                    (p, Some(summary))
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
                        let m = self.score(&kiln, model, &scheme, "f16", &path)?;
                        (path, Some(m))
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
                csv.serialize(&row).context("writing a CSV row")?;
                csv.flush().with_context(|| format!("writing {}", csv_path.display()))?;
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
        std::fs::write(&md_path, markdown(&rows, &machine, &commit, &self))
            .with_context(|| format!("writing {}", md_path.display()))?;
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
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", std::fs::read_to_string(&md_path)?)?;
        eprintln!("wrote {} and {}", csv_path.display(), md_path.display());
        Ok(ExitCode::SUCCESS)
    }

    /// Runs `kiln score` for one model and scheme.
    fn score(&self, kiln: &Path, model: &str, scheme: &str, kv: &str, out: &Path) -> Result<ScoreSummary> {
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
        let output = cmd.output().with_context(|| format!("running {}", kiln.display()))?;
        if !output.status.success() {
            bail!(
                "kiln score for {model} (KILN_ACT_PRECISION={scheme}) failed ({}):\n{}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let line = String::from_utf8_lossy(&output.stdout);
        serde_json::from_str(line.trim())
            .with_context(|| format!("kiln score for {model} (KILN_ACT_PRECISION={scheme}) printed {line:?}"))
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
    let speed = |v: f64| if v.is_finite() { format!("{v:.1}") } else { "n/a".to_string() };
    s.push_str("| model | scheme | positions | PPL ref | PPL | PPL change | mean KLD (SE) | median KLD | p99 KLD | max KLD | top-1 agree | RMS dp | tok/s ref | tok/s |\n");
    s.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {:.4} | {:.4} | {:+.3}% | {:.3e} ({:.1e}) | {:.3e} | {:.3e} | {:.3e} | {:.2}% | {:.2e} | {} | {} |\n",
            r.model,
            r.scheme,
            r.positions,
            r.ppl_ref,
            r.ppl,
            r.ppl_change_pct,
            r.kld_mean,
            r.kld_se,
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

/// What the quality plot needs of a row: from a run's rows, or read back from its CSV.
#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    /// The model.
    pub model: String,
    /// The scheme (or a compared engine's name).
    pub scheme: String,
    /// Mean KL divergence from the reference, nats.
    pub kld_mean: f64,
    /// Its standard error.
    pub kld_se: f64,
    /// Share of positions with the reference's most likely token.
    pub top1_agree: f64,
}

impl Scored {
    /// From a row of quality.csv, keyed by its header; `None` when a value is missing.
    pub fn from_csv(m: &std::collections::BTreeMap<String, String>) -> Option<Scored> {
        let f = |k: &str| m.get(k)?.parse::<f64>().ok();
        Some(Scored {
            model: m.get("model")?.clone(),
            scheme: m.get("scheme")?.clone(),
            kld_mean: f("kld_mean")?,
            kld_se: f("kld_se")?,
            top1_agree: f("top1_agree")?,
        })
    }
}

/// The quality plot: mean KL divergence (log axis, with its 95% interval) and top-1
/// agreement per scheme, one series per model; schemes are categories, never joined.
pub fn panels(rows: &[Scored]) -> Vec<crate::plot::Panel> {
    use crate::plot::{Axis, Panel, Point, Series};
    let mut schemes: Vec<String> = Vec::new();
    let mut models: Vec<String> = Vec::new();
    for r in rows {
        if !schemes.contains(&r.scheme) {
            schemes.push(r.scheme.clone());
        }
        if !models.contains(&r.model) {
            models.push(r.model.clone());
        }
    }
    let at = |r: &Scored| schemes.iter().position(|s| *s == r.scheme).unwrap_or(0) as f64;
    let series = |f: &dyn Fn(&Scored) -> Point| -> Vec<Series> {
        models
            .iter()
            .map(|m| Series::points(m.clone(), rows.iter().filter(|r| r.model == *m).map(f).collect()))
            .collect()
    };
    let kld = |r: &Scored| {
        let half = 1.96 * r.kld_se;
        Point {
            x: at(r),
            y: r.kld_mean,
            interval: (r.kld_mean - half > 0.0).then_some((r.kld_mean - half, r.kld_mean + half)),
        }
    };
    vec![
        Panel {
            series: series(&kld),
            ..Panel::new(
                "mean KL divergence from the reference",
                Axis::categories("scheme", schemes.clone()),
                Axis::log("mean KLD (nats)"),
            )
        },
        Panel {
            series: series(&|r| Point::from((at(r), 100.0 * r.top1_agree))),
            ..Panel::new(
                "top-1 agreement with the reference",
                Axis::categories("scheme", schemes.clone()),
                Axis::linear("top-1 agreement (%)"),
            )
        },
    ]
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
