//! The result CSV: the exact header, one typed row per cell, flushed after every row so
//! an interrupted sweep keeps every finished row, and read back for `--resume`.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use super::plan::CellKey;

/// The header, exactly.
pub const HEADER: [&str; 21] = [
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
    "date",
    "host",
    "device",
    "backend",
    "kiln_version",
    "commit",
    "features",
    "max_tokens",
    "prompt",
    "prompt_target_len",
    "status",
];

/// One row. Measurements are empty when the cell was not measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// The model as named.
    pub model: String,
    /// The engine's resolved path, or the harness's when the engine did not run.
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
    /// Tokens asked for.
    pub max_tokens: u64,
    /// The prompt text, empty for a token-count prompt.
    pub prompt: String,
    /// The prompt length asked for, empty for a text prompt.
    pub prompt_target_len: Option<u64>,
    /// Exactly one status.
    pub status: String,
}

impl Row {
    /// The cell this row belongs to.
    pub fn key(&self) -> CellKey {
        CellKey {
            model: self.model.clone(),
            prompt_target_len: self.prompt_target_len,
            prompt: self.prompt.clone(),
        }
    }
}

/// Rounds a rate or a duration for the record: three decimals are below any noise.
pub fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// The CSV being written.
pub struct CsvOut {
    path: PathBuf,
    writer: csv::Writer<File>,
}

impl CsvOut {
    /// Creates (or truncates) `path` and writes the header.
    pub fn create(path: &Path) -> Result<CsvOut> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let mut writer = csv::WriterBuilder::new().has_headers(false).from_writer(file);
        writer.write_record(HEADER)?;
        writer.flush().with_context(|| format!("writing {}", path.display()))?;
        Ok(CsvOut { path: path.to_path_buf(), writer })
    }

    /// Opens an existing CSV to append to (`--resume`), making sure it ends with a newline.
    pub fn append(path: &Path) -> Result<CsvOut> {
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {} to resume", path.display()))?;
        if file.metadata()?.len() > 0 {
            let mut last = [0u8; 1];
            file.seek(SeekFrom::End(-1))?;
            file.read_exact(&mut last)?;
            if last[0] != b'\n' {
                file.write_all(b"\n")?;
            }
        }
        let writer = csv::WriterBuilder::new().has_headers(false).from_writer(file);
        Ok(CsvOut { path: path.to_path_buf(), writer })
    }

    /// Writes one row and flushes it to the file.
    pub fn write(&mut self, row: &Row) -> Result<()> {
        self.writer.serialize(row).with_context(|| format!("writing a row to {}", self.path.display()))?;
        self.writer.flush().with_context(|| format!("writing {}", self.path.display()))
    }
}

/// Reads the rows of a CSV written by a sweep, for `--resume`. The header must be the
/// exact one; a row that does not parse (a line cut by a crash) is warned about and left
/// out, so its cell runs again.
pub fn read_rows(path: &Path) -> Result<Vec<Row>> {
    let mut rdr = csv::ReaderBuilder::new()
        .flexible(true)
        .from_path(path)
        .with_context(|| format!("opening {} to resume", path.display()))?;
    let header = rdr.headers().with_context(|| format!("reading the header of {}", path.display()))?.clone();
    if header.iter().ne(HEADER) {
        bail!(
            "{} does not start with the sweep header: expected {:?}, found {:?}",
            path.display(),
            HEADER.join(","),
            header.iter().collect::<Vec<_>>().join(",")
        );
    }
    let mut rows = Vec::new();
    for (i, rec) in rdr.records().enumerate() {
        let line = i + 2;
        match rec.map_err(anyhow::Error::from).and_then(|r| Ok(r.deserialize::<Row>(Some(&header))?)) {
            Ok(row) => rows.push(row),
            Err(e) => eprintln!(
                "warning: {}:{line}: ignoring an unreadable row ({e}); its cell runs again",
                path.display()
            ),
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(model: &str, len: Option<u64>, status: &str) -> Row {
        Row {
            model: model.into(),
            model_path: model.into(),
            prompt_tokens: len,
            decode_tok_s: Some(12.5),
            date: "2026-01-01T00:00:00Z".into(),
            max_tokens: 8,
            prompt: if len.is_none() { "Hello, \"world\"".into() } else { String::new() },
            prompt_target_len: len,
            status: status.into(),
            features: "none; KILN_QMV_WIDE=0".into(),
            ..Row::default()
        }
    }

    #[test]
    fn the_header_is_exact_and_matches_the_row_struct() {
        assert_eq!(
            HEADER.join(","),
            "model,model_path,prompt_tokens,generated_tokens,prefill_ms,prefill_tok_s,decode_ms,decode_tok_s,\
             peak_bytes,max_rss_bytes,date,host,device,backend,kiln_version,commit,features,max_tokens,prompt,\
             prompt_target_len,status"
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
        let mut text = fs::read_to_string(&path).unwrap();
        text.push_str("c,c,1");
        fs::write(&path, text).unwrap();
        let mut out = CsvOut::append(&path).unwrap();
        out.write(&row("d", Some(2), "ok")).unwrap();
        let rows = read_rows(&path).unwrap();
        assert_eq!(rows.iter().map(|r| r.model.as_str()).collect::<Vec<_>>(), ["a", "b", "d"]);
        assert_eq!(rows[0], row("a", Some(512), "ok"));
        assert_eq!(rows[1].prompt, "Hello, \"world\"");
        assert_eq!(rows[1].key().prompt_target_len, None);
    }

    #[test]
    fn a_foreign_csv_is_not_resumed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.csv");
        fs::write(&path, "a,b\n1,2\n").unwrap();
        assert!(read_rows(&path).unwrap_err().to_string().contains("does not start with the sweep header"));
    }
}
