//! The safetensors files of a checkpoint directory, single or sharded, memory-mapped, and
//! an index from tensor name to the file and byte range that hold it. Only headers are
//! parsed here; no tensor byte is read.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_core::SharedBytes;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use super::mmap::MappedFile;
use crate::error::{ModelError, Result};

/// Name of the single-file layout.
pub(crate) const SINGLE_FILE: &str = "model.safetensors";
/// Name of the sharded layout's index.
pub(crate) const INDEX_FILE: &str = "model.safetensors.index.json";

/// Where one tensor lives.
#[derive(Clone, Debug)]
pub(crate) struct TensorRef {
    /// Index into [`Checkpoint::files`].
    pub file: usize,
    /// Element type as stored.
    pub dtype: Dtype,
    /// Shape as stored.
    pub shape: Vec<usize>,
    /// First byte in the file.
    pub start: usize,
    /// One past the last byte in the file.
    pub end: usize,
}

impl TensorRef {
    /// Elements in the tensor.
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes in the file.
    pub fn byte_len(&self) -> usize {
        self.end - self.start
    }

    /// Entry `i` along the first axis of a tensor of `shape[0]` equal entries (one
    /// expert of a stack), as a tensor of its own over the same bytes: no byte is read.
    pub fn entry(&self, i: usize) -> TensorRef {
        let count = self.shape[0];
        let per = self.byte_len() / count;
        TensorRef {
            file: self.file,
            dtype: self.dtype,
            shape: self.shape[1..].to_vec(),
            start: self.start + i * per,
            end: self.start + (i + 1) * per,
        }
    }
}

/// The mapped files of a checkpoint and the tensors they hold.
pub(crate) struct Checkpoint {
    /// The index, the single file, or the directory when files were found by name.
    origin: PathBuf,
    files: Vec<Arc<MappedFile>>,
    tensors: HashMap<String, TensorRef>,
}

impl Checkpoint {
    /// Opens the weights in `dir`: `model.safetensors.index.json` and the shards it names,
    /// else `model.safetensors`, else every `model*.safetensors` file (as mlx-lm globs).
    pub(crate) fn open(dir: &Path) -> Result<Self> {
        let index = dir.join(INDEX_FILE);
        if crate::loading::source::regular_file(&index)? {
            return Self::open_index(dir, &index);
        }
        let single = dir.join(SINGLE_FILE);
        if crate::loading::source::regular_file(&single)? {
            return Self::open_files(&single, std::slice::from_ref(&single));
        }
        let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|cause| ModelError::Io { path: dir.to_path_buf(), cause })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.is_file()
                    && p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("model") && n.ends_with(".safetensors"))
            })
            .collect();
        if found.is_empty() {
            return Err(ModelError::Checkpoint {
                path: dir.to_path_buf(),
                message: format!(
                    "no weights found: expected {SINGLE_FILE}, {INDEX_FILE} with the shards it \
                     names, or model*.safetensors files"
                ),
            });
        }
        found.sort();
        Self::open_files(dir, &found)
    }

    fn open_index(dir: &Path, index: &Path) -> Result<Self> {
        let bad = |message: String| ModelError::Checkpoint { path: index.to_path_buf(), message };
        let text = std::fs::read_to_string(index)
            .map_err(|cause| ModelError::Io { path: index.to_path_buf(), cause })?;
        let value: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let Some(Value::Object(map)) = value.get("weight_map") else {
            return Err(bad("expected a \"weight_map\" object from tensor names to shard files".into()));
        };
        // Shards in name order, so the load order (and the pool's peak) is deterministic.
        let mut wanted: BTreeMap<String, Vec<&str>> = BTreeMap::new();
        for (tensor, file) in map {
            let Value::String(file) = file else {
                return Err(bad(format!("weight_map entry {tensor:?} is {file}, expected a file name")));
            };
            if file.contains('/') || file.contains('\\') || file == ".." {
                return Err(bad(format!(
                    "weight_map entry {tensor:?} names {file:?}: expected a file in the same directory"
                )));
            }
            wanted.entry(file.clone()).or_default().push(tensor);
        }
        if wanted.is_empty() {
            return Err(bad("weight_map is empty: expected at least one tensor".into()));
        }
        let paths: Vec<PathBuf> = wanted.keys().map(|f| dir.join(f)).collect();
        for p in &paths {
            if !crate::loading::source::regular_file(p)? {
                return Err(bad(format!(
                    "weight_map names shard {}, which does not exist",
                    p.file_name().map(|n| n.to_string_lossy()).unwrap_or_default()
                )));
            }
        }
        let ck = Self::open_files(index, &paths)?;
        for (i, (file, tensors)) in wanted.iter().enumerate() {
            for t in tensors {
                match ck.tensors.get(*t) {
                    Some(r) if r.file == i => {}
                    Some(r) => {
                        return Err(bad(format!(
                            "weight_map puts {t} in {file}, but it is in {}",
                            wanted.keys().nth(r.file).map_or("another shard", String::as_str)
                        )));
                    }
                    None => {
                        return Err(bad(format!("weight_map puts {t} in {file}, which does not hold it")));
                    }
                }
            }
        }
        Ok(ck)
    }

    fn open_files(origin: &Path, paths: &[PathBuf]) -> Result<Self> {
        let mut files = Vec::with_capacity(paths.len());
        let mut tensors: HashMap<String, TensorRef> = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let mapped = MappedFile::open(path)?;
            let (header_len, meta) =
                SafeTensors::read_metadata(mapped.bytes()).map_err(|e| ModelError::Checkpoint {
                    path: path.clone(),
                    message: format!("not a valid safetensors file: {e}"),
                })?;
            let data_start = 8 + header_len;
            for (name, info) in meta.tensors() {
                let (begin, end) = info.data_offsets;
                let r = TensorRef {
                    file: i,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: data_start + begin,
                    end: data_start + end,
                };
                if let Some(prev) = tensors.insert(name.clone(), r) {
                    return Err(ModelError::Checkpoint {
                        path: path.clone(),
                        message: format!(
                            "tensor {name} is also in {}: each tensor must be stored once",
                            paths[prev.file].display()
                        ),
                    });
                }
            }
            files.push(mapped);
        }
        Ok(Checkpoint { origin: origin.to_path_buf(), files, tensors })
    }

    /// The tensor called `name`, if stored.
    pub(crate) fn get(&self, name: &str) -> Option<&TensorRef> {
        self.tensors.get(name)
    }

    /// Whether a tensor called `name` is stored.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The mapped file holding `t`.
    pub(crate) fn file(&self, t: &TensorRef) -> &Arc<MappedFile> {
        &self.files[t.file]
    }

    /// The path of the file holding `t`.
    pub(crate) fn path(&self, t: &TensorRef) -> &Path {
        self.files[t.file].path()
    }

    /// The raw little-endian bytes of `t`.
    pub(crate) fn bytes(&self, t: &TensorRef) -> &[u8] {
        &self.files[t.file].bytes()[t.start..t.end]
    }

    /// Where the tensor list came from: the index, the single file, or the directory.
    pub(crate) fn origin(&self) -> &Path {
        &self.origin
    }

    /// The file names of every weight file, for messages about tensors that are missing.
    pub(crate) fn describe_files(&self) -> String {
        let names: Vec<String> = self
            .files
            .iter()
            .map(|f| f.path().file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default())
            .collect();
        names.join(", ")
    }
}
