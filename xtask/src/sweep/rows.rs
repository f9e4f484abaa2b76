//! The result CSV: the exact header, one typed row per cell, each written in one write
//! and flushed so an interrupted sweep keeps every finished row, the file locked for the
//! run's lifetime, and read back strictly for `--resume`.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use rustix::fs::{FlockOperation, flock};
use serde::{Deserialize, Serialize};

use super::classify::Status;
use super::plan::CellKey;
use crate::console::usage;

/// The fingerprint every sweep's rows carry, in this order: when, where and with what
/// build a row was measured, then the GPU software it ran on (the NVIDIA driver's version
/// and the CUDA version it supports, empty off a GPU). The decode sweeps' header and
/// bench-offload-copy's take it from here, between their own columns
/// ([`with_fingerprint`]).
pub const FINGERPRINT: [&str; 9] = [
    "date",
    "host",
    "device",
    "backend",
    "kiln_version",
    "commit",
    "features",
    "driver_version",
    "cuda_version",
];

/// The fingerprint before `driver_version` and `cuda_version` were added at its end: files
/// written then are still read (merge, report, plots), with those two columns empty.
pub const FINGERPRINT_BEFORE_DRIVER: [&str; 7] =
    ["date", "host", "device", "backend", "kiln_version", "commit", "features"];

/// A header: `head`, then [`FINGERPRINT`], then `tail`. `N` must be their total length,
/// checked when the constant is built.
pub const fn with_fingerprint<const H: usize, const T: usize, const N: usize>(
    head: [&'static str; H],
    tail: [&'static str; T],
) -> [&'static str; N] {
    with_fingerprint_of(head, &FINGERPRINT, tail)
}

/// A header: `head`, then `fingerprint` (this one or an earlier one), then `tail`.
pub const fn with_fingerprint_of<const H: usize, const T: usize, const N: usize>(
    head: [&'static str; H],
    fingerprint: &[&'static str],
    tail: [&'static str; T],
) -> [&'static str; N] {
    let f = fingerprint.len();
    assert!(H + f + T == N, "a header's length is its columns and the fingerprint's");
    let mut out = [""; N];
    let mut i = 0;
    while i < N {
        out[i] = if i < H {
            head[i]
        } else if i < H + f {
            fingerprint[i - H]
        } else {
            tail[i - H - f]
        };
        i += 1;
    }
    out
}

/// The header, exactly: the measurement, the [`FINGERPRINT`], the token counts, the engine
/// knobs' columns (kiln-protocol's list, `KNOB_COLUMNS`) and the cell's identity.
pub const HEADER: [&str; 34] =
    concat(&[&HEADER_HEAD, &FINGERPRINT, &HEADER_TOKENS, &kiln_protocol::KNOB_COLUMNS, &HEADER_TAIL]);

/// The header before the fingerprint's `driver_version` and `cuda_version`: such a file
/// is read (its rows with those columns empty) but not resumed, since rows appended to
/// it would not match its header.
pub const HEADER_BEFORE_DRIVER: [&str; 32] = concat(&[
    &HEADER_HEAD,
    &FINGERPRINT_BEFORE_DRIVER,
    &HEADER_TOKENS,
    &kiln_protocol::KNOB_COLUMNS,
    &HEADER_TAIL,
]);

/// The columns before the fingerprint.
const HEADER_HEAD: [&str; 10] = [
    "model",
    "model_path",
    "prompt_tokens",
    "generated_tokens",
    "prefill_ms",
    "prefill_tok_s",
    "decode_ms",
    "decode_tok_s",
    "peak_bytes",
    "max_rss_bytes",
];

/// The token counts, between the fingerprint and the knobs.
const HEADER_TOKENS: [&str; 2] = ["max_tokens", "warmup_tokens"];

/// The columns after the knobs.
const HEADER_TAIL: [&str; 8] = [
    "prompt",
    "prompt_target_len",
    "status",
    "repetition",
    "engine",
    "engine_version",
    "reason",
    "disturbed",
];

/// `parts` end to end, in a constant; `N` must be their total length.
const fn concat<const N: usize>(parts: &[&[&'static str]]) -> [&'static str; N] {
    let mut out = [""; N];
    let (mut i, mut p) = (0, 0);
    while p < parts.len() {
        let mut j = 0;
        while j < parts[p].len() {
            out[i] = parts[p][j];
            i += 1;
            j += 1;
        }
        p += 1;
    }
    assert!(i == N, "the header's parts do not add up to its length");
    out
}

/// One row. Measurements are empty when the cell was not measured; a knob is empty when
/// the engine's default applied.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// The model as named.
    pub model: String,
    /// Where the engine found it (from its report or estimate), else the model as named.
    pub model_path: String,
    /// Prompt tokens run.
    pub prompt_tokens: Option<u64>,
    /// Tokens decoded.
    pub generated_tokens: Option<u64>,
    /// Prefill wall time.
    pub prefill_ms: Option<f64>,
    /// Prefill rate.
    pub prefill_tok_s: Option<f64>,
    /// Measured decode wall time.
    pub decode_ms: Option<f64>,
    /// Measured decode rate.
    pub decode_tok_s: Option<f64>,
    /// The pool's peak; for `SKIP:oom`, what the cell needed when refused.
    pub peak_bytes: Option<u64>,
    /// Maximum resident set size.
    pub max_rss_bytes: Option<u64>,
    /// When the row was written (UTC, RFC 3339).
    pub date: String,
    /// Host name.
    pub host: String,
    /// Device (processor, memory, limit).
    pub device: String,
    /// `cpu`, `cuda`, `metal`.
    pub backend: String,
    /// Engine version.
    pub kiln_version: String,
    /// Commit, `-dirty` when dirty.
    pub commit: String,
    /// Build features, then the `KILN_*` environment of the cell.
    pub features: String,
    /// The NVIDIA driver's version when the row ran on a GPU; empty otherwise.
    #[serde(default)]
    pub driver_version: String,
    /// The CUDA version that driver supports; empty off a GPU.
    #[serde(default)]
    pub cuda_version: String,
    /// Tokens asked for.
    pub max_tokens: u64,
    /// Decode steps before the timed ones.
    pub warmup_tokens: u64,
    /// `--attention`; empty for the engine's default.
    pub attention: String,
    /// `--prefill-chunk`; empty for the engine's default.
    pub prefill_chunk: Option<u64>,
    /// `--kv-dtype`; empty for the engine's default.
    pub kv_dtype: String,
    /// The memory limit (`--memory-limit` or `KILN_MEMORY_LIMIT`) in bytes; empty for none.
    pub memory_limit_bytes: Option<u64>,
    /// `--threads`; empty for the engine's default.
    pub threads: Option<u64>,
    /// The prompt text, empty for a token-count prompt.
    pub prompt: String,
    /// The prompt length asked for, empty for a text prompt.
    pub prompt_target_len: Option<u64>,
    /// Exactly one status.
    pub status: String,
    /// Which repetition of its cell the row measures, from 1 (`--repeat`).
    pub repetition: u32,
    /// What ran the cell: `kiln`, or the peer's program (`llama-bench`).
    pub engine: String,
    /// That engine's version: kiln's, or the peer's own version string.
    pub engine_version: String,
    /// Why a row that is not `ok` has no measurement, in one line; empty for `ok`.
    pub reason: String,
    /// Empty when the machine was quiet while the cell ran; else what else was running.
    pub disturbed: String,
}

/// Every setting that changes what a cell measures: a resumed sweep must use the same.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Knobs {
    /// `--max-tokens`.
    pub max_tokens: u64,
    /// `--warmup-tokens`.
    pub warmup_tokens: u64,
    /// `--attention`.
    pub attention: String,
    /// `--prefill-chunk`.
    pub prefill_chunk: Option<u64>,
    /// `--kv-dtype`.
    pub kv_dtype: String,
    /// The memory limit in bytes.
    pub memory_limit_bytes: Option<u64>,
    /// `--threads`.
    pub threads: Option<u64>,
}

impl Knobs {
    /// The engine knobs `k` as the CSV records them (the memory limit in bytes, a knob
    /// left at the engine's default empty), token counts left at zero.
    pub fn of_engine(k: &kiln_protocol::Knobs, memory_limit_bytes: Option<u64>) -> Knobs {
        Knobs {
            max_tokens: 0,
            warmup_tokens: 0,
            attention: k.attention.map(|a| a.to_string()).unwrap_or_default(),
            prefill_chunk: k.prefill_chunk,
            kv_dtype: k.kv_dtype.map(|d| d.to_string()).unwrap_or_default(),
            memory_limit_bytes,
            threads: k.threads,
        }
    }

    /// The knobs that differ between `self` (the file's) and `run` (this run's), as
    /// `--flag file-value` / `run-value` pairs for a message.
    pub fn differences(&self, run: &Knobs) -> Vec<String> {
        let show = |v: Option<String>| v.filter(|s| !s.is_empty()).unwrap_or_else(|| "(default)".into());
        let n = |v: Option<u64>| show(v.map(|v| v.to_string()));
        let t = |v: &str| show(Some(v.to_string()));
        let pairs = [
            ("--max-tokens", n(Some(self.max_tokens)), n(Some(run.max_tokens))),
            ("--warmup-tokens", n(Some(self.warmup_tokens)), n(Some(run.warmup_tokens))),
            ("--attention", t(&self.attention), t(&run.attention)),
            ("--prefill-chunk", n(self.prefill_chunk), n(run.prefill_chunk)),
            ("--kv-dtype", t(&self.kv_dtype), t(&run.kv_dtype)),
            ("--memory-limit (bytes)", n(self.memory_limit_bytes), n(run.memory_limit_bytes)),
            ("--threads", n(self.threads), n(run.threads)),
        ];
        pairs
            .into_iter()
            .filter(|(_, a, b)| a != b)
            .map(|(flag, file, run)| format!("{flag} {file} in the file, {run} in this run"))
            .collect()
    }
}

impl Row {
    /// The cell this row belongs to.
    pub fn key(&self) -> CellKey {
        CellKey {
            model: self.model.clone(),
            prompt_target_len: self.prompt_target_len,
            prompt: self.prompt.clone(),
            repetition: self.repetition.max(1),
            peer: self.is_peer(),
        }
    }

    /// Whether a peer engine (not kiln) measured this row.
    pub fn is_peer(&self) -> bool {
        !self.engine.is_empty() && self.engine != super::plan::Engine::KILN
    }

    /// The knobs the row was measured with.
    pub fn knobs(&self) -> Knobs {
        Knobs {
            max_tokens: self.max_tokens,
            warmup_tokens: self.warmup_tokens,
            attention: self.attention.clone(),
            prefill_chunk: self.prefill_chunk,
            kv_dtype: self.kv_dtype.clone(),
            memory_limit_bytes: self.memory_limit_bytes,
            threads: self.threads,
        }
    }

    /// Writes `k` into the row's knob columns.
    pub fn set_knobs(&mut self, k: &Knobs) {
        self.max_tokens = k.max_tokens;
        self.warmup_tokens = k.warmup_tokens;
        self.attention = k.attention.clone();
        self.prefill_chunk = k.prefill_chunk;
        self.kv_dtype = k.kv_dtype.clone();
        self.memory_limit_bytes = k.memory_limit_bytes;
        self.threads = k.threads;
    }

    /// The first rate or time that is NaN, infinite or negative, with its column.
    fn impossible_measurement(&self) -> Option<(&'static str, f64)> {
        [
            ("prefill_ms", self.prefill_ms),
            ("prefill_tok_s", self.prefill_tok_s),
            ("decode_ms", self.decode_ms),
            ("decode_tok_s", self.decode_tok_s),
        ]
        .into_iter()
        .find_map(|(col, v)| v.filter(|v| !v.is_finite() || *v < 0.0).map(|v| (col, v)))
    }

    /// Whether every field holds what a finished row holds; `Err` says what does not.
    fn check(&self) -> Result<(), String> {
        let status = Status::parse(&self.status)
            .ok_or_else(|| format!("status {:?} is not one of the documented statuses", self.status))?;
        if self.model.is_empty() {
            return Err("the model is empty".into());
        }
        if chrono::NaiveDateTime::parse_from_str(&self.date, "%Y-%m-%dT%H:%M:%SZ").is_err() {
            return Err(format!("date {:?} is not YYYY-MM-DDTHH:MM:SSZ", self.date));
        }
        if self.prompt_target_len.is_some() != self.prompt.is_empty() {
            return Err("exactly one of prompt and prompt_target_len must be set".into());
        }
        if status == Status::Ok {
            let measured = [
                self.prompt_tokens.is_some(),
                self.generated_tokens.is_some(),
                self.prefill_ms.is_some(),
                self.prefill_tok_s.is_some(),
                self.decode_ms.is_some(),
                self.decode_tok_s.is_some(),
                // A peer reports no pool peak.
                self.peak_bytes.is_some() || self.is_peer(),
            ];
            if measured.contains(&false) {
                return Err("an ok row lacks one of its measurements".into());
            }
        }
        Ok(())
    }
}

/// Rounds a rate or a duration for the record: three decimals are below any noise.
pub fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// The CSV being written, locked (`flock`, exclusive) until it is dropped: a second sweep
/// on the same file is refused instead of interleaving rows with this one.
pub struct CsvOut {
    path: PathBuf,
    file: File,
}

impl CsvOut {
    /// Opens `path` for writing and takes its lock without waiting; another run holding
    /// it is a usage error naming the file and `flag`, the flag that chose it. Nothing is
    /// truncated before the lock is held.
    fn open_locked(path: &Path, create: bool, flag: &str) -> Result<File> {
        if create && let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .truncate(false)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => Ok(file),
            Err(e) if e == rustix::io::Errno::WOULDBLOCK => usage!(
                "{} is being written by another run (it holds the file's lock): wait for it to end, or pass another {flag}",
                path.display()
            ),
            Err(e) => Err(e).with_context(|| format!("locking {}", path.display())),
        }
    }

    /// Creates (or empties) `path` under its lock and writes the header.
    pub fn create(path: &Path) -> Result<CsvOut> {
        Self::create_with_header(path, &HEADER, "--output")
    }

    /// Creates (or empties) `path` under its lock and writes `header`: for a sweep whose
    /// rows are not [`Row`]s (written with [`Self::write_record`]). `flag` is the flag
    /// that chose the path (`--output`, `--out-dir`), for the refusal when it is locked.
    pub fn create_with_header(path: &Path, header: &[&str], flag: &str) -> Result<CsvOut> {
        let file = Self::open_locked(path, true, flag)?;
        file.set_len(0).with_context(|| format!("emptying {}", path.display()))?;
        let mut out = CsvOut { path: path.to_path_buf(), file };
        out.write_line(format!("{}\n", header.join(",")).as_bytes())?;
        Ok(out)
    }

    /// Opens an earlier sweep's CSV to append to (`--resume`) under its lock, and reads
    /// its finished rows. A last row cut short (no newline: a crash or a full disk) is
    /// removed, with a warning, so the rows appended after it stay whole.
    pub fn resume(path: &Path) -> Result<(CsvOut, Vec<Row>)> {
        let mut file = Self::open_locked(path, false, "--output")?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).with_context(|| format!("reading {}", path.display()))?;
        let (rows, whole, header) = parse_rows(&bytes, path)?;
        if header != HEADER {
            usage!(
                "{} was written before the driver_version and cuda_version columns: it is read (merge, report) but not resumed, since new rows would not match its header; pass a new --output",
                path.display()
            );
        }
        if whole < bytes.len() {
            eprintln!(
                "warning: {}: removing a last row cut short ({:?}); its cell runs again",
                path.display(),
                String::from_utf8_lossy(&bytes[whole..])
            );
            file.set_len(whole as u64).with_context(|| format!("truncating {}", path.display()))?;
        }
        file.seek(SeekFrom::End(0))?;
        Ok((CsvOut { path: path.to_path_buf(), file }, rows))
    }

    /// Writes one row, in one write, and flushes it to the file.
    pub fn write(&mut self, row: &Row) -> Result<()> {
        self.write_record(row)
    }

    /// Writes one serialisable row, in one write, and flushes it to the file.
    pub fn write_record(&mut self, row: &impl Serialize) -> Result<()> {
        let mut w = csv::WriterBuilder::new().has_headers(false).from_writer(Vec::new());
        w.serialize(row).with_context(|| format!("writing a row to {}", self.path.display()))?;
        let bytes = w.into_inner().map_err(|e| anyhow::anyhow!("{}", e.error()))?;
        self.write_line(&bytes)
    }

    fn write_line(&mut self, bytes: &[u8]) -> Result<()> {
        let context = || format!("writing {}", self.path.display());
        let n = self.file.write(bytes).with_context(context)?;
        if n != bytes.len() {
            bail!(
                "writing {}: only {n} of {} bytes were written (disk full or a file-size limit?)",
                self.path.display(),
                bytes.len()
            );
        }
        self.file.sync_data().with_context(context)
    }
}

/// Reads the finished rows of a CSV written by a sweep (for its plot, and in tests); see
/// [`parse_rows`]. Only a regular file is read ([`crate::fsx`]).
pub fn read_rows(path: &Path) -> Result<Vec<Row>> {
    let bytes = crate::fsx::read_regular_bounded(path, crate::fsx::MAX_RUN_FILE_BYTES)?;
    rows_from_bytes(&bytes, path)
}

/// The finished rows of `bytes`, a sweep's CSV read from `path`; see [`parse_rows`].
pub fn rows_from_bytes(bytes: &[u8], path: &Path) -> Result<Vec<Row>> {
    Ok(parse_rows(bytes, path)?.0)
}

/// Whether `first_line` is a sweep header this harness reads: the current one, or one
/// from before the fingerprint's driver columns.
pub fn is_sweep_header(first_line: &str) -> bool {
    [&HEADER[..], &HEADER_BEFORE_DRIVER[..]].iter().any(|h| first_line == h.join(","))
}

/// The finished rows of a sweep's CSV and the byte length of its whole lines. The header
/// must be the exact one. A row is finished only when it is whole: it ends with its
/// newline, has every column, every value parses, its status is a documented one and an
/// `ok` row has its measurements. Any other row is warned about and left out, so its cell
/// runs again.
fn parse_rows(bytes: &[u8], path: &Path) -> Result<(Vec<Row>, usize, &'static [&'static str])> {
    let mut rdr = csv::ReaderBuilder::new().has_headers(false).flexible(true).from_reader(bytes);
    let mut rec = csv::ByteRecord::new();
    let read = rdr.read_byte_record(&mut rec).unwrap_or(false)
        && bytes.get((rdr.position().byte() as usize).wrapping_sub(1)) == Some(&b'\n');
    let found = [&HEADER[..], &HEADER_BEFORE_DRIVER[..]]
        .into_iter()
        .find(|h| read && rec.iter().eq(h.iter().map(|c| c.as_bytes())));
    let Some(found) = found else {
        usage!(
            "{} does not start with the sweep header: expected {:?}, found {:?}",
            path.display(),
            HEADER.join(","),
            String::from_utf8_lossy(bytes.split(|&b| b == b'\n').next().unwrap_or_default())
        );
    };
    let header = csv::ByteRecord::from(found.to_vec());
    let mut whole = rdr.position().byte() as usize;
    let mut rows = Vec::new();
    loop {
        let line = rdr.position().line();
        let read = rdr.read_byte_record(&mut rec);
        let end = rdr.position().byte() as usize;
        let terminated = bytes.get(end.wrapping_sub(1)) == Some(&b'\n');
        if terminated {
            whole = end;
        }
        let row = match read {
            Ok(false) => break,
            Err(e) => Err(format!("not CSV ({e})")),
            Ok(true) if !terminated => {
                Err("it has no newline at its end: it was cut short while being written".into())
            }
            Ok(true) if rec.len() != found.len() => {
                Err(format!("it has {} fields, expected {}", rec.len(), found.len()))
            }
            Ok(true) => match rec.deserialize::<Row>(Some(&header)) {
                // No engine reports such a rate or time, and the harness writes none: the
                // file was changed after it was written. Refused, not left out: leaving it
                // out would run the cell again, and summarising it would print NaN.
                Ok(row) => {
                    if let Some((col, v)) = row.impossible_measurement() {
                        usage!(
                            "{}: line {line}: column {col} is {v}: a measurement must be a finite non-negative number",
                            path.display()
                        );
                    }
                    row.check().map(|()| row)
                }
                Err(e) => Err(e.to_string()),
            },
        };
        match row {
            Ok(row) => rows.push(row),
            Err(why) => eprintln!(
                "warning: {}:{line}: ignoring an unfinished or malformed row: {why}; its cell runs again",
                path.display()
            ),
        }
    }
    Ok((rows, whole, found))
}

/// The CSV a sweep writes, locked for the run, and the rows it already holds when resumed.
pub struct Output {
    /// The CSV.
    pub path: PathBuf,
    /// The open, locked file.
    pub csv: CsvOut,
    /// Rows already in it (`--resume`).
    pub resumed: Option<Vec<Row>>,
}

/// `rows` as a CSV written before the driver columns existed: [`HEADER_BEFORE_DRIVER`],
/// and each row without its `driver_version` and `cuda_version`.
#[cfg(test)]
pub(crate) fn before_driver_csv(rows: &[Row]) -> String {
    let at = HEADER.iter().position(|&c| c == "driver_version").unwrap();
    let mut out = csv::Writer::from_writer(Vec::new());
    out.write_record(HEADER_BEFORE_DRIVER).unwrap();
    for r in rows {
        let mut w = csv::WriterBuilder::new().has_headers(false).from_writer(Vec::new());
        w.serialize(r).unwrap();
        let text = w.into_inner().unwrap();
        let rec = csv::ReaderBuilder::new()
            .has_headers(false)
            .from_reader(&text[..])
            .records()
            .next()
            .unwrap()
            .unwrap();
        let old: Vec<&str> =
            rec.iter().enumerate().filter(|&(i, _)| i != at && i != at + 1).map(|(_, v)| v).collect();
        out.write_record(&old).unwrap();
    }
    String::from_utf8(out.into_inner().unwrap()).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(model: &str, len: Option<u64>, status: &str) -> Row {
        Row {
            model: model.into(),
            model_path: model.into(),
            prompt_tokens: len,
            generated_tokens: Some(8),
            prefill_ms: Some(1.0),
            prefill_tok_s: Some(2.0),
            decode_ms: Some(3.0),
            decode_tok_s: Some(12.5),
            peak_bytes: Some(100),
            date: "2026-01-01T00:00:00Z".into(),
            max_tokens: 8,
            prompt: if len.is_none() { "Hello, \"world\"".into() } else { String::new() },
            prompt_target_len: len,
            status: status.into(),
            features: "none; KILN_QMV_WIDE=0".into(),
            repetition: 1,
            engine: "kiln".into(),
            ..Row::default()
        }
    }

    #[test]
    fn the_header_is_exact_and_matches_the_row_struct() {
        assert_eq!(
            HEADER.join(","),
            "model,model_path,prompt_tokens,generated_tokens,prefill_ms,prefill_tok_s,decode_ms,decode_tok_s,\
             peak_bytes,max_rss_bytes,date,host,device,backend,kiln_version,commit,features,\
             driver_version,cuda_version,max_tokens,warmup_tokens,attention,prefill_chunk,kv_dtype,memory_limit_bytes,threads,prompt,\
             prompt_target_len,status,repetition,engine,engine_version,reason,disturbed"
        );
        let mut w = csv::Writer::from_writer(Vec::new());
        w.serialize(row("m", Some(1), "ok")).unwrap();
        let text = String::from_utf8(w.into_inner().unwrap()).unwrap();
        assert_eq!(text.lines().next().unwrap(), HEADER.join(","));
    }

    #[test]
    fn rows_are_flushed_one_by_one_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out/x.csv");
        let mut out = CsvOut::create(&path).unwrap();
        out.write(&row("a", Some(512), "ok")).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap().lines().count(), 2, "not flushed");
        out.write(&row("b", None, "SKIP:oom")).unwrap();
        drop(out);
        let (mut out, rows) = CsvOut::resume(&path).unwrap();
        assert_eq!(rows.len(), 2);
        out.write(&row("d", Some(2), "ok")).unwrap();
        let rows = read_rows(&path).unwrap();
        assert_eq!(rows.iter().map(|r| r.model.as_str()).collect::<Vec<_>>(), ["a", "b", "d"]);
        assert_eq!(rows[0], row("a", Some(512), "ok"));
        assert_eq!(rows[1].prompt, "Hello, \"world\"");
        assert_eq!(rows[1].key().prompt_target_len, None);
    }

    /// The text of one row as the sweep writes it, newline included.
    fn line(r: &Row) -> String {
        let mut w = csv::WriterBuilder::new().has_headers(false).from_writer(Vec::new());
        w.serialize(r).unwrap();
        String::from_utf8(w.into_inner().unwrap()).unwrap()
    }

    #[test]
    fn only_whole_rows_are_finished() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.csv");
        let header = format!("{}\n", HEADER.join(","));
        let ok = line(&row("a", Some(1), "ok"));
        // A row cut inside its last field (`disturbed`, `load high` cut to `load`), and
        // one cut after a whole field: neither is finished.
        let mut skip = row("b", Some(2), "SKIP:oom_backstop");
        skip.disturbed = "load high".into();
        let backstop = line(&skip);
        let cut_reason = backstop.trim_end().strip_suffix(" high").unwrap().to_string();
        let cut_field = backstop.trim_end().strip_suffix("load high").unwrap().to_string();
        for (tail, why) in [(&cut_reason, "cut inside the reason"), (&cut_field, "cut after a comma")] {
            fs::write(&path, format!("{header}{backstop}{tail}")).unwrap();
            let rows = read_rows(&path).unwrap();
            assert_eq!(rows.len(), 1, "{why}: {rows:?}");
            assert_eq!(rows[0].status, "SKIP:oom_backstop");
        }
        // Resuming removes the cut tail, so the next row starts on its own line and the
        // cut one is never completed by a later newline.
        let (mut out, rows) = CsvOut::resume(&path).unwrap();
        assert_eq!(rows.len(), 1);
        out.write(&row("c", Some(3), "ok")).unwrap();
        drop(out);
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            format!("{header}{backstop}{}", line(&row("c", Some(3), "ok")))
        );
        // Whole lines that are not finished rows: a status outside the vocabulary, a field
        // missing, a number past u64, an ok row without its measurements, a bad date.
        let mut no_rate = row("f", Some(6), "ok");
        no_rate.decode_tok_s = None;
        let mut bad_date = row("g", Some(7), "ok");
        bad_date.date = "2026-01-01".into();
        let bad = [
            line(&row("a", Some(1), "o")),
            ok.replacen(",ok\n", "\n", 1).replacen("a,a,1,", "a,a,", 1),
            ok.replacen(",1,", ",18446744073709551616,", 1),
            line(&no_rate),
            line(&bad_date),
        ];
        fs::write(&path, format!("{header}{}{ok}", bad.concat())).unwrap();
        let rows = read_rows(&path).unwrap();
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_eq!(rows[0], row("a", Some(1), "ok"));
    }

    #[test]
    fn a_nan_infinite_or_negative_measurement_is_an_error_naming_line_and_column() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.csv");
        let header = format!("{}\n", HEADER.join(","));
        let ok = line(&row("a", Some(1), "ok"));
        for (col, v, shown) in [
            ("decode_tok_s", f64::NAN, "NaN"),
            ("prefill_ms", f64::INFINITY, "inf"),
            ("decode_ms", -3.0, "-3"),
        ] {
            let mut bad = row("b", Some(2), "ok");
            match col {
                "decode_tok_s" => bad.decode_tok_s = Some(v),
                "prefill_ms" => bad.prefill_ms = Some(v),
                _ => bad.decode_ms = Some(v),
            }
            let text = format!("{header}{ok}{}", line(&bad));
            fs::write(&path, &text).unwrap();
            for e in [read_rows(&path).unwrap_err(), CsvOut::resume(&path).err().unwrap()] {
                assert!(e.downcast_ref::<crate::console::UsageError>().is_some(), "{e:#}");
                let e = e.to_string();
                assert!(
                    e.contains(&format!("x.csv: line 3: column {col} is {shown}: a measurement must be")),
                    "{e}"
                );
            }
            // Nothing was removed from the file.
            assert_eq!(fs::read_to_string(&path).unwrap(), text);
        }
    }

    #[test]
    fn a_second_writer_is_refused_while_the_first_holds_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.csv");
        let mut first = CsvOut::create(&path).unwrap();
        first.write(&row("a", Some(1), "ok")).unwrap();
        for second in [CsvOut::create(&path).map(|_| ()), CsvOut::resume(&path).map(|_| ())] {
            let e = second.expect_err("a second writer got the lock");
            assert!(e.downcast_ref::<crate::console::UsageError>().is_some(), "{e:#}");
            assert!(e.to_string().contains("being written by another run"), "{e:#}");
        }
        // The refused create truncated nothing.
        assert_eq!(read_rows(&path).unwrap().len(), 1);
        drop(first);
        assert!(CsvOut::resume(&path).is_ok());
    }

    #[test]
    fn knob_differences_name_the_flag_and_both_values() {
        let a = row("a", Some(1), "ok").knobs();
        let mut b = a.clone();
        b.max_tokens = 16;
        b.attention = "naive".into();
        assert_eq!(
            a.differences(&b),
            [
                "--max-tokens 8 in the file, 16 in this run",
                "--attention (default) in the file, naive in this run"
            ]
        );
        assert!(a.differences(&a).is_empty());
    }

    #[test]
    fn a_file_from_before_the_driver_columns_is_read_but_not_resumed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.csv");
        let current = row("a", Some(1), "ok");
        fs::write(&path, before_driver_csv(std::slice::from_ref(&current))).unwrap();
        assert!(is_sweep_header(&HEADER_BEFORE_DRIVER.join(",")) && is_sweep_header(&HEADER.join(",")));
        assert_eq!(
            read_rows(&path).unwrap(),
            [current],
            "an older file's row reads with empty driver columns"
        );
        let e = CsvOut::resume(&path).err().expect("resumed an older header");
        assert!(e.downcast_ref::<crate::console::UsageError>().is_some(), "{e:#}");
        assert!(
            e.to_string().contains("written before the driver_version and cuda_version columns"),
            "{e:#}"
        );
        // A row of the current width under the old header is malformed, not misread.
        fs::write(&path, format!("{}\n{}", HEADER_BEFORE_DRIVER.join(","), line(&row("b", Some(2), "ok"))))
            .unwrap();
        assert!(read_rows(&path).unwrap().is_empty());
    }

    #[test]
    fn a_foreign_csv_is_not_resumed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.csv");
        fs::write(&path, "a,b\n1,2\n").unwrap();
        assert!(read_rows(&path).unwrap_err().to_string().contains("does not start with the sweep header"));
    }
}
