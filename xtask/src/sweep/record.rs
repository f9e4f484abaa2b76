//! The persistent OOM record, `benchmarks/.oom-record`: one CSV line per real out of
//! memory, `model,prompt_target_len,date,commit,peak_bytes,source_csv,device`. Appends and
//! rewrites hold an exclusive lock on a sidecar `.lock` file, reads a shared one, so
//! concurrent sweeps (on one machine or on a shared filesystem) neither interleave nor
//! lose lines, and a prune can replace the file atomically.

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rustix::fs::{FlockOperation, flock};

/// The documented field order.
pub const FIELDS: [&str; 7] =
    ["model", "prompt_target_len", "date", "commit", "peak_bytes", "source_csv", "device"];

/// One line of the record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordLine {
    /// The model as the sweep named it.
    pub model: String,
    /// The prompt length that ran out of memory.
    pub prompt_target_len: u64,
    /// When (UTC, RFC 3339).
    pub date: String,
    /// The commit of the harness and engine.
    pub commit: String,
    /// The bytes the cell needed when it was refused; empty when it did not say.
    pub peak_bytes: Option<u64>,
    /// The CSV the OOM row went to.
    pub source_csv: String,
    /// The device it happened on; `None` applies everywhere.
    pub device: Option<String>,
}

impl RecordLine {
    /// Whether this line pre-skips `model` at `len` on `device`.
    pub fn applies(&self, model: &str, len: u64, device: &str) -> bool {
        self.model == model
            && self.prompt_target_len <= len
            && self.device.as_deref().is_none_or(|d| d == device)
    }

    fn to_fields(&self) -> [String; 7] {
        [
            self.model.clone(),
            self.prompt_target_len.to_string(),
            self.date.clone(),
            self.commit.clone(),
            self.peak_bytes.map(|b| b.to_string()).unwrap_or_default(),
            self.source_csv.clone(),
            self.device.clone().unwrap_or_default(),
        ]
    }

    /// The line as it is written in the file (without the newline).
    pub fn to_csv_line(&self) -> Result<String> {
        let mut w = csv::WriterBuilder::new().has_headers(false).from_writer(Vec::new());
        w.write_record(self.to_fields())?;
        let bytes = w.into_inner().map_err(|e| anyhow::anyhow!("{}", e.error()))?;
        Ok(String::from_utf8(bytes)?.trim_end_matches(['\r', '\n']).to_string())
    }
}

/// A line that could not be used, with why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Malformed {
    /// 1-based line number in the file.
    pub line: u64,
    /// The line's text.
    pub text: String,
    /// What is wrong and what is accepted.
    pub why: String,
}

/// One entry of the file, in order: a usable line or a malformed one. Comments (`#`) and
/// blank lines are kept as `Other` so a rewrite preserves them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// A usable line.
    Line { line: u64, text: String, record: RecordLine },
    /// A line that is skipped with a warning.
    Malformed(Malformed),
    /// A comment or a blank line.
    Other { text: String },
}

/// Parses the file's text. Never fails: a bad line becomes [`Entry::Malformed`].
pub fn parse(text: &str) -> Vec<Entry> {
    text.split_inclusive('\n')
        .enumerate()
        .map(|(i, raw)| {
            let text = raw.trim_end_matches(['\r', '\n']).to_string();
            let line = i as u64 + 1;
            if text.trim().is_empty() || text.trim_start().starts_with('#') {
                return Entry::Other { text };
            }
            match parse_line(&text) {
                Ok(record) => Entry::Line { line, text, record },
                Err(why) => Entry::Malformed(Malformed { line, text, why }),
            }
        })
        .collect()
}

fn parse_line(text: &str) -> Result<RecordLine, String> {
    let mut rdr = csv::ReaderBuilder::new().has_headers(false).flexible(true).from_reader(text.as_bytes());
    let rec = match rdr.records().next() {
        Some(Ok(rec)) => rec,
        Some(Err(e)) => return Err(format!("not a CSV line ({e})")),
        None => return Err("empty".into()),
    };
    let n = rec.len();
    if !(6..=7).contains(&n) {
        return Err(format!("has {n} fields, expected 6 or 7 ({})", FIELDS.join(",")));
    }
    let model = rec[0].trim().to_string();
    if model.is_empty() {
        return Err("the model field is empty".into());
    }
    let len = rec[1].trim();
    let prompt_target_len =
        len.parse().map_err(|_| format!("prompt_target_len {len:?} is not a non-negative integer"))?;
    let peak = rec[4].trim();
    let peak_bytes = if peak.is_empty() {
        None
    } else {
        Some(peak.parse().map_err(|_| format!("peak_bytes {peak:?} is not empty or an integer"))?)
    };
    let device = rec.get(6).map(str::trim).filter(|d| !d.is_empty()).map(str::to_string);
    Ok(RecordLine {
        model,
        prompt_target_len,
        date: rec[2].trim().to_string(),
        commit: rec[3].trim().to_string(),
        peak_bytes,
        source_csv: rec[5].to_string(),
        device,
    })
}

/// The record file at a path, with its sidecar lock.
#[derive(Clone, Debug)]
pub struct RecordFile {
    path: PathBuf,
}

/// A held `flock`; released when dropped (the descriptor closes).
struct Lock {
    _file: File,
}

impl RecordFile {
    /// The record at `path`; nothing is created until the first append.
    pub fn new(path: PathBuf) -> Self {
        RecordFile { path }
    }

    /// Where it lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock_path(&self) -> PathBuf {
        let mut name = self.path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
        name.push(".lock");
        self.path.with_file_name(name)
    }

    fn lock(&self, op: FlockOperation) -> Result<Lock> {
        let lock_path = self.lock_path();
        if let Some(dir) = lock_path.parent().filter(|d| !d.as_os_str().is_empty()) {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .with_context(|| format!("opening the record lock {}", lock_path.display()))?;
        flock(&file, op).with_context(|| format!("locking {}", lock_path.display()))?;
        Ok(Lock { _file: file })
    }

    /// Reads every entry under a shared lock. A missing file is an empty record.
    pub fn read(&self) -> Result<Vec<Entry>> {
        if !self.path.exists() {
            return Ok(Vec::new());
        }
        let _lock = self.lock(FlockOperation::LockShared)?;
        self.read_unlocked()
    }

    fn read_unlocked(&self) -> Result<Vec<Entry>> {
        match fs::read(&self.path) {
            Ok(bytes) => Ok(parse(&String::from_utf8_lossy(&bytes))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(e).with_context(|| format!("reading the OOM record {}", self.path.display())),
        }
    }

    /// Appends one line under the exclusive lock. When the file does not end with a
    /// newline (a hand edit, a crash), one is written first so lines never merge.
    pub fn append(&self, line: &RecordLine) -> Result<()> {
        let text = line.to_csv_line()?;
        let _lock = self.lock(FlockOperation::LockExclusive)?;
        let mut file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(&self.path)
            .with_context(|| format!("opening the OOM record {}", self.path.display()))?;
        let len = file.metadata()?.len();
        let mut out = String::new();
        if len > 0 {
            let mut last = [0u8; 1];
            file.seek(SeekFrom::End(-1))?;
            file.read_exact(&mut last)?;
            if last[0] != b'\n' {
                out.push('\n');
            }
        }
        out.push_str(&text);
        out.push('\n');
        file.write_all(out.as_bytes())
            .and_then(|()| file.sync_data())
            .with_context(|| format!("appending to the OOM record {}", self.path.display()))
    }

    /// Removes the usable lines `remove` selects and, when `drop_malformed`, the malformed
    /// ones, under the exclusive lock, by writing a new file beside the old one and
    /// renaming it over. Returns what was removed. A missing file removes nothing.
    pub fn prune(
        &self,
        remove: impl Fn(&RecordLine) -> bool,
        drop_malformed: bool,
        dry_run: bool,
    ) -> Result<Vec<Entry>> {
        let _lock = self.lock(FlockOperation::LockExclusive)?;
        if !self.path.exists() {
            return Ok(Vec::new());
        }
        let entries = self.read_unlocked()?;
        let (gone, kept): (Vec<Entry>, Vec<Entry>) = entries.into_iter().partition(|e| match e {
            Entry::Line { record, .. } => remove(record),
            Entry::Malformed(_) => drop_malformed,
            Entry::Other { .. } => false,
        });
        if gone.is_empty() || dry_run {
            return Ok(gone);
        }
        let mut text = String::new();
        for e in &kept {
            let line = match e {
                Entry::Line { text, .. } | Entry::Other { text } => text,
                Entry::Malformed(m) => &m.text,
            };
            text.push_str(line);
            text.push('\n');
        }
        let dir = self.path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let mut tmp = tempfile_in(dir, &self.path)?;
        tmp.1
            .write_all(text.as_bytes())
            .and_then(|()| tmp.1.sync_all())
            .with_context(|| format!("writing {}", tmp.0.display()))?;
        fs::rename(&tmp.0, &self.path)
            .with_context(|| format!("replacing {} with {}", self.path.display(), tmp.0.display()))?;
        Ok(gone)
    }
}

/// A new file beside `target` for an atomic replace (same directory, same filesystem).
fn tempfile_in(dir: &Path, target: &Path) -> Result<(PathBuf, File)> {
    let base = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    for attempt in 0..100u32 {
        let path = dir.join(format!("{base}.tmp.{}.{attempt}", std::process::id()));
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(f) => return Ok((path, f)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("creating {}", path.display())),
        }
    }
    anyhow::bail!("could not create a temporary file beside {}", target.display())
}

/// What a sweep sees of the record: re-read before each cell (another sweep may have
/// appended), each malformed line warned about once.
pub struct RecordView {
    file: RecordFile,
    warned: BTreeSet<(u64, String)>,
}

impl RecordView {
    /// A view of `file`.
    pub fn new(file: RecordFile) -> Self {
        RecordView { file, warned: BTreeSet::new() }
    }

    /// The file behind it.
    pub fn file(&self) -> &RecordFile {
        &self.file
    }

    /// The usable lines now, warning on stderr about malformed ones not yet warned about.
    pub fn lines(&mut self) -> Result<Vec<(u64, String, RecordLine)>> {
        let mut out = Vec::new();
        for e in self.file.read()? {
            match e {
                Entry::Line { line, text, record } => out.push((line, text, record)),
                Entry::Malformed(m) => {
                    if self.warned.insert((m.line, m.text.clone())) {
                        eprintln!(
                            "warning: {}:{}: ignoring malformed OOM-record line {:?}: {}",
                            self.file.path.display(),
                            m.line,
                            m.text,
                            m.why
                        );
                    }
                }
                Entry::Other { .. } => {}
            }
        }
        Ok(out)
    }

    /// The first line that pre-skips `model` at `len` on `device`, with its line number
    /// and text.
    pub fn matching(&mut self, model: &str, len: u64, device: &str) -> Result<Option<(u64, String)>> {
        Ok(self
            .lines()?
            .into_iter()
            .find(|(_, _, r)| r.applies(model, len, device))
            .map(|(line, text, _)| (line, text)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(model: &str, len: u64, device: Option<&str>) -> RecordLine {
        RecordLine {
            model: model.into(),
            prompt_target_len: len,
            date: "2026-01-02T03:04:05Z".into(),
            commit: "abc1234".into(),
            peak_bytes: Some(1234),
            source_csv: "benchmarks/a, b.csv".into(),
            device: device.map(str::to_string),
        }
    }

    #[test]
    fn a_line_round_trips_through_the_file_format() {
        let l = line("synthetic:tiny", 2048, Some("cpu:Some CPU (16 GiB)"));
        let text = l.to_csv_line().unwrap();
        assert_eq!(
            text,
            "synthetic:tiny,2048,2026-01-02T03:04:05Z,abc1234,1234,\"benchmarks/a, b.csv\",cpu:Some CPU (16 GiB)"
        );
        match &parse(&text)[..] {
            [Entry::Line { line: 1, record, .. }] => assert_eq!(record, &l),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn six_fields_apply_everywhere_and_seven_to_one_device() {
        let entries = parse("m,512,d,c,,src.csv\nm,512,d,c,,src.csv,gpu-a\n");
        let recs: Vec<&RecordLine> = entries
            .iter()
            .map(|e| match e {
                Entry::Line { record, .. } => record,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(recs[0].device, None);
        assert_eq!(recs[0].peak_bytes, None);
        assert!(recs[0].applies("m", 512, "gpu-b"));
        assert!(recs[0].applies("m", 4096, "anything"));
        assert!(!recs[0].applies("m", 511, "gpu-b"));
        assert!(!recs[0].applies("other", 4096, "gpu-b"));
        assert!(recs[1].applies("m", 512, "gpu-a"));
        assert!(!recs[1].applies("m", 512, "gpu-b"));
    }

    #[test]
    fn malformed_lines_are_reported_with_their_number() {
        let text = "# written by hand\n\nm,32768\nm,2o48,d,c,,s\nm,512,d,c,lots,s\nm,512,d,c,,s\n,1,d,c,,s\nm,1,d,c,,s,dev,extra\n";
        let entries = parse(text);
        let bad: Vec<(u64, &str)> = entries
            .iter()
            .filter_map(|e| match e {
                Entry::Malformed(m) => Some((m.line, m.why.as_str())),
                _ => None,
            })
            .collect();
        assert_eq!(bad.len(), 5, "{bad:?}");
        assert_eq!(bad[0].0, 3);
        assert!(bad[0].1.contains("has 2 fields"), "{}", bad[0].1);
        assert_eq!(bad[1].0, 4);
        assert!(bad[1].1.contains("\"2o48\""), "{}", bad[1].1);
        assert_eq!(bad[2].0, 5);
        assert_eq!(bad[3].0, 7);
        assert_eq!(bad[4].0, 8);
        assert!(matches!(entries[5], Entry::Line { line: 6, .. }));
        assert!(matches!(entries[0], Entry::Other { .. }));
    }

    #[test]
    fn append_never_merges_with_an_unterminated_last_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/.oom-record");
        let file = RecordFile::new(path.clone());
        assert!(file.read().unwrap().is_empty());
        file.append(&line("a", 1, None)).unwrap();
        fs::write(&path, format!("{}m,327", fs::read_to_string(&path).unwrap())).unwrap();
        file.append(&line("b", 2, Some("dev"))).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 3, "{text}");
        assert!(text.ends_with('\n'));
        let entries = file.read().unwrap();
        assert!(matches!(&entries[1], Entry::Malformed(m) if m.line == 2 && m.text == "m,327"));
        assert!(matches!(&entries[2], Entry::Line { record, .. } if record.model == "b"));
        assert!(dir.path().join("sub/.oom-record.lock").exists());
    }

    #[test]
    fn prune_replaces_the_file_and_keeps_the_rest_verbatim() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".oom-record");
        fs::write(&path, "# keep me\nm,512,d,c,,s\nm,2048,d,c,,s,dev\nbroken\nn,512,d,c,,s\n").unwrap();
        let file = RecordFile::new(path.clone());
        let dry = file.prune(|r| r.model == "m", false, true).unwrap();
        assert_eq!(dry.len(), 2);
        assert_eq!(fs::read_to_string(&path).unwrap().lines().count(), 5);
        let gone = file.prune(|r| r.model == "m", true, false).unwrap();
        assert_eq!(gone.len(), 3);
        assert_eq!(fs::read_to_string(&path).unwrap(), "# keep me\nn,512,d,c,,s\n");
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 2, "a temporary file was left behind: {names:?}");
    }

    #[test]
    fn the_view_finds_the_first_applicable_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".oom-record");
        fs::write(&path, "m,32768\nm,2048,d,c,,s,other-device\nm,8192,d,c,,s\n").unwrap();
        let mut view = RecordView::new(RecordFile::new(path));
        assert_eq!(view.matching("m", 4096, "here").unwrap(), None);
        let (n, text) = view.matching("m", 8192, "here").unwrap().unwrap();
        assert_eq!((n, text.as_str()), (3, "m,8192,d,c,,s"));
        assert_eq!(view.matching("m", 2048, "other-device").unwrap().unwrap().0, 2);
        assert_eq!(view.warned.len(), 1);
    }
}
