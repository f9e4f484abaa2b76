//! Files kiln writes (`kiln export-gguf`, `kiln score`): only a new path or a regular
//! file is accepted as the destination, and the content goes to a temporary file beside
//! it that is synced and renamed over it, so a reader sees the old file or the whole new
//! one, and an error or a kill leaves no half-written file under the asked-for name.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};

use crate::error::{ModelError, Result};
use crate::loading::source::not_regular;

/// The file `path` names, checked as a destination: a new path, or a regular file to
/// replace (a symbolic link is followed, so the link stays and its target is replaced).
/// A FIFO, a device, a socket or a directory is [`ModelError::NotRegularOutput`].
pub fn destination(path: &Path) -> Result<PathBuf> {
    let io_err = |cause: io::Error| ModelError::Io { path: path.to_path_buf(), cause };
    match fs::metadata(path) {
        Ok(meta) => match not_regular(&meta.file_type()) {
            None => fs::canonicalize(path).map_err(io_err),
            Some(kind) => Err(ModelError::NotRegularOutput { path: path.to_path_buf(), kind }),
        },
        // Nothing there; a dangling link is written through to where it points.
        Err(e) if e.kind() == io::ErrorKind::NotFound => match fs::read_link(path) {
            Ok(to) => Ok(path.parent().map_or(to.clone(), |d| d.join(&to))),
            Err(_) => Ok(path.to_path_buf()),
        },
        Err(e) => Err(io_err(e)),
    }
}

/// A file being written: a temporary file beside its destination, renamed over it by
/// [`AtomicFile::commit`] and removed when dropped uncommitted.
#[derive(Debug)]
pub struct AtomicFile {
    target: PathBuf,
    tmp: PathBuf,
    file: Option<File>,
}

impl AtomicFile {
    /// Checks `path` with [`destination`] and creates the temporary file beside it,
    /// under a name no other writer of the same destination uses.
    pub fn create(path: &Path) -> Result<AtomicFile> {
        let target = destination(path)?;
        let dir = target.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let name = target
            .file_name()
            .ok_or_else(|| ModelError::NotRegularOutput {
                path: path.to_path_buf(),
                kind: "not a file name",
            })?
            .to_string_lossy()
            .into_owned();
        for attempt in 0..100u32 {
            let tmp = dir.join(format!(".{name}.tmp-{}-{attempt}", std::process::id()));
            match OpenOptions::new().write(true).create_new(true).open(&tmp) {
                Ok(file) => return Ok(AtomicFile { target, tmp, file: Some(file) }),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(cause) => return Err(ModelError::Io { path: tmp, cause }),
            }
        }
        Err(ModelError::Io {
            path: path.to_path_buf(),
            cause: io::Error::other("no free temporary name beside it"),
        })
    }

    /// The temporary file, to write to.
    pub fn file(&mut self) -> &mut File {
        self.file.as_mut().expect("an AtomicFile holds its file until committed")
    }

    /// The temporary file's path, for messages.
    pub fn tmp_path(&self) -> &Path {
        &self.tmp
    }

    /// Syncs the temporary file and renames it over the destination.
    pub fn commit(mut self) -> Result<()> {
        let file = self.file.take().expect("an AtomicFile is committed once");
        file.sync_all().map_err(|cause| ModelError::Io { path: self.tmp.clone(), cause })?;
        drop(file);
        fs::rename(&self.tmp, &self.target)
            .map_err(|cause| ModelError::Io { path: self.target.clone(), cause })?;
        // Renamed: nothing is left to remove.
        self.tmp = PathBuf::new();
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.tmp.as_os_str().is_empty() {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn only_new_paths_and_regular_files_are_destinations() {
        let dir = tempfile::tempdir().unwrap();
        let new = dir.path().join("new.bin");
        assert_eq!(destination(&new).unwrap(), new);
        let file = dir.path().join("old.bin");
        fs::write(&file, b"old").unwrap();
        assert!(destination(&file).is_ok());
        let fifo = dir.path().join("fifo");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        for (p, kind) in
            [(fifo.as_path(), "a FIFO"), (dir.path(), "a directory"), (Path::new("/dev/null"), "a device")]
        {
            match destination(p) {
                Err(ModelError::NotRegularOutput { kind: k, .. }) => assert_eq!(k, kind, "{}", p.display()),
                other => panic!("{}: {other:?}", p.display()),
            }
        }
    }

    #[test]
    fn a_commit_replaces_the_file_and_a_drop_leaves_it_alone() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("out.bin");
        fs::write(&file, b"old").unwrap();
        let link = dir.path().join("link.bin");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let mut a = AtomicFile::create(&link).unwrap();
        a.file().write_all(b"half").unwrap();
        let tmp = a.tmp_path().to_path_buf();
        drop(a);
        assert!(!tmp.exists());
        assert_eq!(fs::read(&file).unwrap(), b"old");
        let mut a = AtomicFile::create(&link).unwrap();
        a.file().write_all(b"new").unwrap();
        a.commit().unwrap();
        assert_eq!(fs::read(&file).unwrap(), b"new");
        assert!(fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link stays a link");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 2, "no temporary file is left");
    }
}
