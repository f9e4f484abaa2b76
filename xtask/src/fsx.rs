//! Files another run (or a person) left behind. Reading one: only a regular file, opened
//! without blocking and read under a size bound (a FIFO would block the reader forever,
//! a link to `/dev/zero` would fill memory; both are refused, naming the file). Naming
//! one: its real path, and whether two paths are one file however spelled.

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::console::usage;

/// The bound for a file a run wrote (a CSV, a JSONL, a log, a summary): far above any
/// a run writes, far below what would exhaust memory.
pub const MAX_RUN_FILE_BYTES: u64 = 1 << 30;

/// The regular file at `path` (a symbolic link is followed), open to read, with its
/// length: for a reader that streams it. The file is opened with `O_NONBLOCK`, so opening
/// a FIFO does not wait for a writer, and its type is read from the opened file (`fstat`),
/// so what is read is what was checked. Anything but a regular file is a usage error
/// naming the path and what is accepted.
pub fn open_regular(path: &Path) -> Result<(File, u64)> {
    let context = || format!("reading {}", path.display());
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
        .open(path)
        .with_context(context)?;
    let meta = file.metadata().with_context(context)?;
    let kind = meta.file_type();
    if !kind.is_file() {
        let what = if kind.is_fifo() {
            "a FIFO (named pipe)"
        } else if kind.is_dir() {
            "a directory"
        } else if kind.is_char_device() {
            "a character device"
        } else if kind.is_block_device() {
            "a block device"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        };
        usage!("{} is {what}: only a regular file is read there", path.display());
    }
    Ok((file, meta.len()))
}

/// The bytes of the regular file at `path` ([`open_regular`]), at most `max_bytes` of
/// them: a larger file is a usage error naming the path and the bound.
pub fn read_regular_bounded(path: &Path, max_bytes: u64) -> Result<Vec<u8>> {
    let context = || format!("reading {}", path.display());
    let (file, len) = open_regular(path)?;
    let too_big = |size: u64| {
        anyhow::Error::new(crate::console::UsageError(format!(
            "{} is {size} bytes or more: at most {max_bytes} bytes are read from it",
            path.display()
        )))
    };
    if len > max_bytes {
        return Err(too_big(len));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(max_bytes.saturating_add(1)).read_to_end(&mut bytes).with_context(context)?;
    // It grew while it was read.
    if bytes.len() as u64 > max_bytes {
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}

/// [`read_regular_bounded`] as UTF-8 text.
pub fn read_text_bounded(path: &Path, max_bytes: u64) -> Result<String> {
    String::from_utf8(read_regular_bounded(path, max_bytes)?).map_err(|e| {
        anyhow::Error::new(crate::console::UsageError(format!(
            "{} is not UTF-8 text (byte {} is not): only a text file is read there",
            path.display(),
            e.utf8_error().valid_up_to()
        )))
    })
}

/// [`read_text_bounded`], with `None` when there is no file at `path`.
pub fn read_text_if_any(path: &Path, max_bytes: u64) -> Result<Option<String>> {
    match read_text_bounded(path, max_bytes) {
        Ok(t) => Ok(Some(t)),
        Err(e) if is_not_found(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Whether `e` says there was no file.
pub fn is_not_found(e: &anyhow::Error) -> bool {
    e.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == ErrorKind::NotFound)
}

/// `path` with its symlinks resolved; when it does not exist yet, its directory's real
/// path joined with its name (following a dangling link to where it points).
pub fn real_path(path: &Path) -> PathBuf {
    if let Ok(p) = fs::canonicalize(path) {
        return p;
    }
    let mut path = path.to_path_buf();
    for _ in 0..40 {
        match fs::read_link(&path) {
            Ok(to) => path = path.parent().map_or(to.clone(), |d| d.join(&to)),
            Err(_) => break,
        }
    }
    match (path.parent().filter(|d| !d.as_os_str().is_empty()), path.file_name()) {
        (Some(dir), Some(name)) => fs::canonicalize(dir).map_or(path.clone(), |d| d.join(name)),
        _ => path,
    }
}

/// Whether `a` and `b` name one file, however spelled: a symlink, `./`, `..` (the real
/// paths agree, also for a file not created yet), or a hard link (same device and inode).
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    real_path(a) == real_path(b)
        || match (fs::metadata(a), fs::metadata(b)) {
            (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
            _ => false,
        }
}

/// Writes `bytes` to `path` through a synced temporary file beside it (named with this
/// process's id, so two writers never share one) and a rename: a reader sees the old file
/// or the new one, never a part.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let written = (|| {
        let mut f = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(bytes).with_context(|| format!("writing {}", tmp.display()))?;
        f.sync_all().with_context(|| format!("syncing {}", tmp.display()))
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn only_a_regular_file_under_the_bound_is_read() {
        let d = tempfile::tempdir().unwrap();
        let ok = d.path().join("ok.csv");
        fs::write(&ok, "a,b\n").unwrap();
        assert_eq!(read_text_bounded(&ok, 4).unwrap(), "a,b\n");
        let e = read_text_bounded(&ok, 3).unwrap_err().to_string();
        assert!(e.contains("ok.csv is 4 bytes or more: at most 3 bytes"), "{e}");
        // A FIFO with no writer: refused at once, not waited on.
        let fifo = d.path().join("results.csv");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let t = Instant::now();
        let e = read_regular_bounded(&fifo, 1 << 20).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(e.downcast_ref::<crate::console::UsageError>().is_some());
        let e = e.to_string();
        assert!(e.contains("results.csv is a FIFO (named pipe): only a regular file"), "{e}");
        // A link to /dev/zero: followed, and refused as the device it is.
        let zero = d.path().join("summary.md");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let e = read_regular_bounded(&zero, 1 << 20).unwrap_err().to_string();
        assert!(e.contains("summary.md is a character device"), "{e}");
        let e = read_regular_bounded(d.path(), 1 << 20).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        assert!(read_text_if_any(&d.path().join("none"), 1).unwrap().is_none());
    }
}
