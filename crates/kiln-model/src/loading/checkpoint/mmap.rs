//! Read-only memory maps of checkpoint files, shareable with kiln-core's [`Buffer`] views.
//!
//! [`Buffer`]: kiln_core::Buffer

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_core::SharedBytes;
use memmap2::Mmap;

use crate::error::{ModelError, Result};

/// A whole file mapped read-only. Weights viewed in place keep it alive through an `Arc`.
pub(crate) struct MappedFile {
    path: PathBuf,
    map: Mmap,
}

impl MappedFile {
    /// Maps `path`. Mapping reads nothing: pages come in when a tensor is first touched.
    pub(crate) fn open(path: &Path) -> Result<Arc<Self>> {
        let io = |cause| ModelError::Io { path: path.to_path_buf(), cause };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the file is opened read-only and kiln never writes to it, so the mapped
        // bytes cannot change through this process, and `Mmap` only hands out shared
        // `&[u8]`. The remaining risk is another process truncating or rewriting the file
        // while it is mapped (a truncation turns later reads of the lost pages into
        // SIGBUS); that is the same contract every mmap-based loader (safetensors,
        // llama.cpp, mlx) asks of its user: do not modify a checkpoint while it runs.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Ok(Arc::new(MappedFile { path: path.to_path_buf(), map }))
    }

    /// The file's path, for messages.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl SharedBytes for MappedFile {
    fn bytes(&self) -> &[u8] {
        &self.map
    }
}
