//! The persistent OOM record, `benchmarks/.oom-record`: one CSV line per real out of
//! memory, `model,prompt_target_len,date,commit,peak_bytes,source_csv,device` (the
//! `peak_bytes` field holds what the cell needed when refused: the bytes in use plus the
//! refused request, [`RecordLine::demand_bytes`]). Appends and
//! rewrites hold an exclusive lock on a sidecar `.lock` file beside the record's real
//! path (symlinks resolved), reads a shared one, so concurrent sweeps (on one machine or
//! on a shared filesystem) neither interleave nor lose lines, and a prune can replace the
//! file atomically. A line is trusted only when it is whole: seven fields and its newline.

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rustix::fs::{FlockOperation, flock};

use crate::fsx::real_path;

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
    /// What the cell needed when it was refused: the bytes in use plus the refused
    /// request (the file's `peak_bytes` field); empty when the engine did not say.
    pub demand_bytes: Option<u64>,
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
            self.demand_bytes.map(|b| b.to_string()).unwrap_or_default(),
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

/// A size as a reader takes it in, with the exact count beside it: `1.2 GiB (1288490188
/// bytes)`, `512 B (512 bytes)`.
pub fn bytes_text(bytes: u64) -> String {
    format!("{} ({bytes} bytes)", crate::console::human_bytes(bytes))
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

/// An entry with the exact bytes of its line, terminator included, so a rewrite keeps
/// every line it does not remove byte for byte (CRLF, bytes that are not UTF-8).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawEntry {
    /// The parsed entry.
    pub entry: Entry,
    /// The line as it is in the file.
    pub bytes: Vec<u8>,
}

/// Parses the file's text. Never fails: a bad line becomes [`Entry::Malformed`].
#[cfg(test)]
pub fn parse(text: &str) -> Vec<Entry> {
    parse_bytes(text.as_bytes()).into_iter().map(|r| r.entry).collect()
}

/// Parses the file's bytes. A last line without its newline was cut short (a crash, a
/// full disk, a file-size limit) and is malformed, as is a line that is not UTF-8.
pub fn parse_bytes(bytes: &[u8]) -> Vec<RawEntry> {
    bytes
        .split_inclusive(|&b| b == b'\n')
        .enumerate()
        .map(|(i, raw)| {
            let line = i as u64 + 1;
            let body = raw.strip_suffix(b"\n").unwrap_or(raw);
            let body = body.strip_suffix(b"\r").unwrap_or(body);
            let text = String::from_utf8_lossy(body).into_owned();
            let entry = if text.trim().is_empty() || text.trim_start().starts_with('#') {
                Entry::Other { text }
            } else if std::str::from_utf8(body).is_err() {
                Entry::Malformed(Malformed { line, text, why: "is not UTF-8 text".into() })
            } else if !raw.ends_with(b"\n") {
                Entry::Malformed(Malformed {
                    line,
                    text,
                    why: "has no newline at its end: it was cut short while being written".into(),
                })
            } else {
                match parse_line(&text) {
                    Ok(record) => Entry::Line { line, text, record },
                    Err(why) => Entry::Malformed(Malformed { line, text, why }),
                }
            };
            RawEntry { entry, bytes: raw.to_vec() }
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
    if n != FIELDS.len() {
        return Err(format!(
            "has {n} fields, expected {} ({}; an empty device applies everywhere)",
            FIELDS.len(),
            FIELDS.join(",")
        ));
    }
    let model = rec[0].trim().to_string();
    if model.is_empty() {
        return Err("the model field is empty".into());
    }
    let len = rec[1].trim();
    let prompt_target_len =
        len.parse().map_err(|_| format!("prompt_target_len {len:?} is not a non-negative integer"))?;
    let peak = rec[4].trim();
    let demand_bytes = if peak.is_empty() {
        None
    } else {
        Some(peak.parse().map_err(|_| format!("peak_bytes {peak:?} is not empty or an integer"))?)
    };
    let device = Some(rec[6].trim()).filter(|d| !d.is_empty()).map(str::to_string);
    Ok(RecordLine {
        model,
        prompt_target_len,
        date: rec[2].trim().to_string(),
        commit: rec[3].trim().to_string(),
        demand_bytes,
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

    /// The file the path names: symlinks resolved, so two spellings of one record share
    /// one lock and a rewrite replaces the link's target, not the link.
    pub fn real_path(&self) -> PathBuf {
        real_path(&self.path)
    }

    fn lock_path(&self) -> PathBuf {
        let real = self.real_path();
        let mut name = real.file_name().map(|n| n.to_os_string()).unwrap_or_default();
        name.push(".lock");
        real.with_file_name(name)
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
        Ok(self.read_raw_unlocked()?.into_iter().map(|r| r.entry).collect())
    }

    fn read_raw_unlocked(&self) -> Result<Vec<RawEntry>> {
        // Only a regular file is read: a FIFO named as the record would block every cell.
        match crate::fsx::read_regular_bounded(&self.path, crate::fsx::MAX_RUN_FILE_BYTES) {
            Ok(bytes) => Ok(parse_bytes(&bytes)),
            Err(e) if crate::fsx::is_not_found(&e) => Ok(Vec::new()),
            Err(e) => Err(e).with_context(|| format!("reading the OOM record {}", self.path.display())),
        }
    }

    /// Appends one line under the exclusive lock, in one write, its newline last: a write
    /// cut short leaves a line without its newline, which readers refuse. When the file
    /// does not end with a newline (a hand edit, a crash), one is written first so lines
    /// never merge; the cut line stays malformed (it lacks fields).
    pub fn append(&self, line: &RecordLine) -> Result<()> {
        let text = line.to_csv_line()?;
        let _lock = self.lock(FlockOperation::LockExclusive)?;
        let mut file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(&self.path)
            .with_context(|| format!("opening the OOM record {}", self.path.display()))?;
        let meta = file.metadata()?;
        if !meta.file_type().is_file() {
            // A FIFO or a device: what is written there would be lost, not recorded.
            crate::console::usage!(
                "the OOM record {} is not a regular file: name a file (or a new path) with --oom-record",
                self.path.display()
            );
        }
        let len = meta.len();
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
        let context = || format!("appending to the OOM record {}", self.path.display());
        let written = file.write(out.as_bytes()).with_context(context)?;
        if written != out.len() {
            anyhow::bail!(
                "appending to the OOM record {}: only {written} of {} bytes were written (disk full or a file-size limit?)",
                self.path.display(),
                out.len()
            );
        }
        file.sync_data().with_context(context)
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
        let entries = self.read_raw_unlocked()?;
        let (gone, kept): (Vec<RawEntry>, Vec<RawEntry>) =
            entries.into_iter().partition(|r| match &r.entry {
                Entry::Line { record, .. } => remove(record),
                Entry::Malformed(_) => drop_malformed,
                Entry::Other { .. } => false,
            });
        let gone: Vec<Entry> = gone.into_iter().map(|r| r.entry).collect();
        if gone.is_empty() || dry_run {
            return Ok(gone);
        }
        let bytes: Vec<u8> = kept.into_iter().flat_map(|r| r.bytes).collect();
        // Replace the file the path names, in its own directory (a rename is atomic only
        // within one filesystem), keeping its permissions.
        let target = self.real_path();
        let dir = target.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let mut tmp = TempFile::create(dir, &target)?;
        if let Ok(meta) = fs::metadata(&target) {
            let _ = tmp.file.set_permissions(meta.permissions());
        }
        tmp.file
            .write_all(&bytes)
            .and_then(|()| tmp.file.sync_all())
            .with_context(|| format!("writing {}", tmp.path.display()))?;
        tmp.persist(&target)?;
        Ok(gone)
    }
}

/// A temporary file beside its target for an atomic replace; removed when dropped unless
/// it was persisted, so an error leaves nothing behind.
struct TempFile {
    path: PathBuf,
    file: File,
    persisted: bool,
}

impl TempFile {
    fn create(dir: &Path, target: &Path) -> Result<TempFile> {
        let base = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        for attempt in 0..100u32 {
            let path = dir.join(format!("{base}.tmp.{}.{attempt}", std::process::id()));
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(file) => return Ok(TempFile { path, file, persisted: false }),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e).with_context(|| format!("creating {}", path.display())),
            }
        }
        anyhow::bail!("could not create a temporary file beside {}", target.display())
    }

    fn persist(mut self, target: &Path) -> Result<()> {
        fs::rename(&self.path, target)
            .with_context(|| format!("replacing {} with {}", target.display(), self.path.display()))?;
        self.persisted = true;
        Ok(())
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.persisted {
            let _ = fs::remove_file(&self.path);
        }
    }
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
            demand_bytes: Some(1234),
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
        match &parse(&format!("{text}\n"))[..] {
            [Entry::Line { line: 1, record, .. }] => assert_eq!(record, &l),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_empty_device_applies_everywhere_and_a_named_one_to_that_device() {
        let entries = parse("m,512,d,c,,src.csv,\nm,512,d,c,,src.csv,gpu-a\n");
        let recs: Vec<&RecordLine> = entries
            .iter()
            .map(|e| match e {
                Entry::Line { record, .. } => record,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(recs[0].device, None);
        assert_eq!(recs[0].demand_bytes, None);
        assert!(recs[0].applies("m", 512, "gpu-b"));
        assert!(recs[0].applies("m", 4096, "anything"));
        assert!(!recs[0].applies("m", 511, "gpu-b"));
        assert!(!recs[0].applies("other", 4096, "gpu-b"));
        assert!(recs[1].applies("m", 512, "gpu-a"));
        assert!(!recs[1].applies("m", 512, "gpu-b"));
    }

    #[test]
    fn malformed_lines_are_reported_with_their_number() {
        let text = "# written by hand\n\nm,32768\nm,2o48,d,c,,s,\nm,512,d,c,lots,s,\nm,512,d,c,,s,\n,1,d,c,,s,\nm,1,d,c,,s,dev,extra\n";
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
    fn a_fifo_named_as_the_record_is_refused_never_waited_on() {
        use rustix::fs::{CWD, FileType, Mode, mknodat};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("oom-record");
        mknodat(CWD, &path, FileType::Fifo, Mode::from_raw_mode(0o600), 0).unwrap();
        let file = RecordFile::new(path.clone());
        // Reading blocked for ever; appending wrote the line into the pipe and lost it.
        let e = format!("{:#}", file.read().unwrap_err());
        assert!(e.contains("a FIFO") && e.contains("oom-record"), "{e}");
        let e = format!("{:#}", file.append(&line("a", 1, None)).unwrap_err());
        assert!(e.contains("not a regular file") && e.contains("--oom-record"), "{e}");
    }

    #[test]
    fn append_never_merges_with_an_unterminated_last_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/.oom-record");
        let file = RecordFile::new(path.clone());
        assert!(file.read().unwrap().is_empty());
        file.append(&line("a", 1, None)).unwrap();
        // A write cut by a full disk: the whole line but its newline.
        let cut = line("z", 8, Some("dev")).to_csv_line().unwrap();
        fs::write(&path, format!("{}{cut}", fs::read_to_string(&path).unwrap())).unwrap();
        let entries = file.read().unwrap();
        assert!(
            matches!(&entries[1], Entry::Malformed(m) if m.why.contains("no newline")),
            "a line without its newline was trusted: {entries:?}"
        );
        fs::write(&path, format!("{}m,327", fs::read_to_string(&path).unwrap().replace(&cut, ""))).unwrap();
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
        fs::write(&path, "# keep me\nm,512,d,c,,s,\nm,2048,d,c,,s,dev\nbroken\nn,512,d,c,,s,\n").unwrap();
        let file = RecordFile::new(path.clone());
        let dry = file.prune(|r| r.model == "m", false, true).unwrap();
        assert_eq!(dry.len(), 2);
        assert_eq!(fs::read_to_string(&path).unwrap().lines().count(), 5);
        let gone = file.prune(|r| r.model == "m", true, false).unwrap();
        assert_eq!(gone.len(), 3);
        assert_eq!(fs::read_to_string(&path).unwrap(), "# keep me\nn,512,d,c,,s,\n");
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 2, "a temporary file was left behind: {names:?}");
    }

    #[test]
    fn prune_keeps_the_lines_it_does_not_remove_byte_for_byte() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".oom-record");
        let mut bytes = b"# caf\xe9 in Latin-1\r\nm,512,d,c,,s,\r\nn,512,d,c,,s,dev\xff\r\n".to_vec();
        bytes.extend_from_slice(b"gone,1,d,c,,s,\nlast,1,d,c,,s,");
        fs::write(&path, &bytes).unwrap();
        let file = RecordFile::new(path.clone());
        let gone = file.prune(|r| r.model == "gone", false, false).unwrap();
        assert_eq!(gone.len(), 1);
        let want =
            [&bytes[..bytes.len() - b"gone,1,d,c,,s,\nlast,1,d,c,,s,".len()], b"last,1,d,c,,s,"].concat();
        assert_eq!(fs::read(&path).unwrap(), want);
        // The CRLF line is usable; the non-UTF-8 one and the unterminated one are not.
        let entries = file.read().unwrap();
        assert!(matches!(&entries[1], Entry::Line { record, .. } if record.model == "m"), "{entries:?}");
        assert!(matches!(&entries[2], Entry::Malformed(m) if m.why.contains("UTF-8")), "{entries:?}");
        assert!(matches!(&entries[3], Entry::Malformed(m) if m.why.contains("newline")), "{entries:?}");
    }

    #[test]
    fn prune_through_a_symlink_replaces_the_target_and_keeps_the_link() {
        let dir = tempfile::tempdir().unwrap();
        let real_dir = dir.path().join("real");
        fs::create_dir(&real_dir).unwrap();
        let target = real_dir.join("record");
        fs::write(&target, "a,1,d,c,,s,\nb,1,d,c,,s,\n").unwrap();
        let link = dir.path().join(".oom-record");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let file = RecordFile::new(link.clone());
        assert_eq!(file.prune(|r| r.model == "a", false, false).unwrap().len(), 1);
        assert!(fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link was replaced");
        assert_eq!(fs::read_to_string(&target).unwrap(), "b,1,d,c,,s,\n");
        // The temporary file went to the target's directory, and nothing is left over.
        let mut names: Vec<_> = fs::read_dir(&real_dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        assert_eq!(names, ["record", "record.lock"]);
        // Both spellings lock the same file.
        assert_eq!(RecordFile::new(link).lock_path(), RecordFile::new(target).lock_path());
    }

    #[test]
    fn the_view_finds_the_first_applicable_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".oom-record");
        fs::write(&path, "m,32768\nm,2048,d,c,,s,other-device\nm,8192,d,c,,s,\n").unwrap();
        let mut view = RecordView::new(RecordFile::new(path));
        assert_eq!(view.matching("m", 4096, "here").unwrap(), None);
        let (n, text) = view.matching("m", 8192, "here").unwrap().unwrap();
        assert_eq!((n, text.as_str()), (3, "m,8192,d,c,,s,"));
        assert_eq!(view.matching("m", 2048, "other-device").unwrap().unwrap().0, 2);
        assert_eq!(view.warned.len(), 1);
    }
}
