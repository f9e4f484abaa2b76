//! A synthetic MoE model's file-backed host tier: the routed experts' bytes (exactly what
//! the in-memory arena would hold at its end) written once to a file in a directory,
//! then mapped read-only, so the backing store an expert cache copies from lives in the
//! page cache, which the kernel can drop and re-read, rather than in memory kiln owns.
//!
//! The file is named by the profile, quantization, seed and a format version, so two
//! machines (or two runs) with the same name and seed map the same bytes. It is written
//! in batches to `<name>.tmp.<pid>` and renamed into place when complete, so a file under
//! the final name is always whole. An existing file is reused when its length is right
//! and its first and last batches match what generation gives; otherwise it is written
//! again.

use std::fs::{self, File};
use std::io::Write;
use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_core::SharedBytes;
use kiln_core::size::HumanBytes;
use memmap2::Mmap;

use super::generate::{Segment, fill, words_of};
use crate::error::{ModelError, Result};

/// Bumped whenever the bytes generation gives for a name and seed change.
pub const FORMAT_VERSION: u32 = 1;

/// Words generated and written per batch (256 MiB), the most memory writing holds.
const BATCH_WORDS: usize = 32 << 20;

/// The mapped file.
struct ExpertFile {
    map: Mmap,
}

impl SharedBytes for ExpertFile {
    fn bytes(&self) -> &[u8] {
        &self.map
    }
}

/// The file holding the experts of the model `key` names, in `dir`.
pub fn path(dir: &Path, key: &str) -> PathBuf {
    dir.join(format!("{key}-v{FORMAT_VERSION}.experts"))
}

/// Maps the file of `segs` (the experts of the model `key` names) in `dir`, writing it
/// first when it is missing or not what generation gives.
pub(super) fn open(dir: &Path, key: &str, segs: &[Segment]) -> Result<Arc<dyn SharedBytes>> {
    let file = path(dir, key);
    let batches = batches(segs);
    let bytes = words_of(segs) as u64 * 8;
    if !matches(&file, segs, &batches, bytes)? {
        write(dir, &file, segs, &batches, bytes)?;
    }
    let io = |cause| ModelError::Io { path: file.clone(), cause };
    let f = File::open(&file).map_err(io)?;
    // SAFETY: the file is opened read-only and kiln never writes to it once it is under
    // its final name (writes go to a temporary name, then one rename), so the mapped bytes
    // do not change through this process, and `Mmap` hands out only shared `&[u8]`. As
    // for a checkpoint, another process truncating the file while it is mapped would turn
    // reads of the lost pages into SIGBUS: the directory is kiln's cache, not to be edited.
    let map = unsafe { Mmap::map(&f) }.map_err(io)?;
    if map.len() as u64 != bytes {
        return Err(ModelError::Checkpoint {
            path: file,
            message: format!(
                "the expert file changed while it was opened ({} bytes, {bytes} expected)",
                map.len()
            ),
        });
    }
    Ok(Arc::new(ExpertFile { map }))
}

/// Consecutive runs of segments of at most [`BATCH_WORDS`] (one segment may exceed it).
fn batches(segs: &[Segment]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut words) = (0, 0);
    for (i, s) in segs.iter().enumerate() {
        if words > 0 && words + s.words() > BATCH_WORDS {
            out.push(start..i);
            (start, words) = (i, 0);
        }
        words += s.words();
    }
    if start < segs.len() {
        out.push(start..segs.len());
    }
    out
}

/// Generates one batch.
fn generate(segs: &[Segment]) -> Vec<u64> {
    let n = words_of(segs);
    let mut words: Vec<u64> = Vec::with_capacity(n);
    fill(segs, &mut words.spare_capacity_mut()[..n]);
    // SAFETY: `fill` wrote every one of the first `n` slots, within the capacity.
    unsafe { words.set_len(n) };
    words
}

/// Whether `file` exists with `bytes` bytes whose first and last batches are what
/// generation gives (a cheap check against a stale or foreign file).
fn matches(file: &Path, segs: &[Segment], batches: &[std::ops::Range<usize>], bytes: u64) -> Result<bool> {
    let io = |cause| ModelError::Io { path: file.to_path_buf(), cause };
    let f = match File::open(file) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io(e)),
    };
    if f.metadata().map_err(io)?.len() != bytes {
        return Ok(false);
    }
    let mut at = 0u64;
    let mut starts = Vec::with_capacity(batches.len());
    for b in batches {
        starts.push(at);
        at += words_of(&segs[b.clone()]) as u64 * 8;
    }
    for i in [0, batches.len() - 1] {
        let want = generate(&segs[batches[i].clone()]);
        let want: &[u8] = bytemuck::cast_slice(&want);
        let mut got = vec![0u8; want.len()];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut got, starts[i]).map_err(io)?;
        if got != want {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Writes the file in batches under a temporary name, then renames it into place.
fn write(
    dir: &Path,
    file: &Path,
    segs: &[Segment],
    batches: &[std::ops::Range<usize>],
    bytes: u64,
) -> Result<()> {
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |cause| ModelError::Io { path: p, cause }
    };
    fs::create_dir_all(dir).map_err(io(dir))?;
    let free = free_bytes(dir).map_err(io(dir))?;
    // What an older copy under the final name frees when it is replaced.
    let old = fs::metadata(file).map(|m| m.len()).unwrap_or(0);
    if free + old < bytes {
        return Err(ModelError::Checkpoint {
            path: dir.to_path_buf(),
            message: format!(
                "writing the synthetic experts needs {} in this directory and {} is free; free some space or \
                 point KILN_SYNTHETIC_EXPERT_DIR at a directory with room",
                HumanBytes(bytes),
                HumanBytes(free + old)
            ),
        });
    }
    let tmp = file.with_extension(format!("tmp.{}", std::process::id()));
    let result = (|| {
        let mut f = File::create(&tmp).map_err(io(&tmp))?;
        for b in batches {
            let words = generate(&segs[b.clone()]);
            f.write_all(bytemuck::cast_slice(&words)).map_err(io(&tmp))?;
        }
        f.flush().map_err(io(&tmp))?;
        drop(f);
        fs::rename(&tmp, file).map_err(io(file))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Bytes free to an unprivileged writer on the file system holding `dir`.
fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "a NUL byte in the path"))?;
    let mut st = MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path and `st` points at writable memory for one
    // `statvfs`, which the call fills on success (checked before reading it).
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it initialised `st`.
    let st = unsafe { st.assume_init() };
    // The fields' types differ between platforms (u64 here, u32 or c_ulong elsewhere).
    #[allow(clippy::unnecessary_cast)]
    let free = st.f_bavail as u64 * st.f_frsize as u64;
    Ok(free)
}

#[cfg(test)]
mod tests {
    use kiln_core::{MemoryPool, Tag};

    use crate::forward::engine::{EngineOptions, Session};
    use crate::forward::kv_cache::KvDtype;
    use crate::loading::synthetic::{self, HostTier};

    const NAME: &str = "tiny-moe";
    const SEED: u64 = 11;

    fn the_file(dir: &std::path::Path) -> std::path::PathBuf {
        super::path(dir, &format!("{NAME}@4bit-g64-seed{SEED:016x}"))
    }

    /// Greedy tokens of [`NAME`] with its experts in `tier`, through a cache of `slots`.
    fn greedy(tier: &HostTier, slots: Option<usize>) -> Vec<u32> {
        let pool = MemoryPool::unlimited();
        let model = synthetic::load_in(NAME, SEED, &pool, tier).unwrap();
        let options =
            EngineOptions { kv_dtype: KvDtype::F32, expert_slots: slots, ..EngineOptions::default() };
        let mut s = Session::new(&model, &pool, options).unwrap();
        s.generate_greedy(&[256, 72, 101, 108, 108, 111], 24).unwrap()
    }

    /// The file holds the arena's expert bytes: every expert matches, decode gives the
    /// in-memory tier's tokens (all resident and through a cache), and the pool counts
    /// everything but the experts, as `inspect_in` predicts.
    #[test]
    fn a_file_backed_tier_gives_the_in_memory_tiers_bytes_and_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let file = HostTier::File(dir.path().join("experts"));
        let (mem_pool, file_pool) = (MemoryPool::unlimited(), MemoryPool::unlimited());
        let in_mem = synthetic::load_in(NAME, SEED, &mem_pool, &HostTier::Memory).unwrap();
        let in_file = synthetic::load_in(NAME, SEED, &file_pool, &file).unwrap();
        let (a, b) = (in_mem.weights.experts.as_ref().unwrap(), in_file.weights.experts.as_ref().unwrap());
        assert_eq!(a.total(), b.total());
        for id in 0..a.total() {
            for (x, y) in a.by_id(id).parts().iter().zip(b.by_id(id).parts()) {
                assert_eq!(x.packed(), y.packed(), "expert {id}");
                for (p, q) in [(x.scales(), y.scales()), (x.biases(), y.biases())] {
                    assert_eq!(p.dtype(), q.dtype());
                    assert!((0..p.len()).all(|i| p.get(i).to_bits() == q.get(i).to_bits()), "expert {id}");
                }
            }
        }
        let experts =
            synthetic::generate::expert_bytes(&in_mem.config, synthetic::parse(NAME).unwrap().quant);
        assert!(experts > 0);
        assert_eq!(std::fs::metadata(the_file(dir.path().join("experts").as_path())).unwrap().len(), experts);
        let (m, f) = (
            mem_pool.stats().by_tag[Tag::Weights.as_str()].live,
            file_pool.stats().by_tag[Tag::Weights.as_str()].live,
        );
        assert_eq!(m - f, experts);
        assert_eq!(f, synthetic::inspect_in(NAME, &file).unwrap().weight_bytes);
        assert_eq!(m, synthetic::inspect_in(NAME, &HostTier::Memory).unwrap().weight_bytes);
        for slots in [None, Some(3)] {
            assert_eq!(greedy(&file, slots), greedy(&HostTier::Memory, slots), "slots {slots:?}");
        }
    }

    /// A second load maps the file already there; a file whose bytes or length are wrong
    /// is written again, never used.
    #[test]
    fn the_file_is_reused_when_right_and_rewritten_when_not() {
        let dir = tempfile::tempdir().unwrap();
        let tier = HostTier::File(dir.path().to_path_buf());
        let want = greedy(&HostTier::Memory, None);
        assert_eq!(greedy(&tier, None), want);
        let file = the_file(dir.path());
        let made = std::fs::metadata(&file).unwrap().modified().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(greedy(&tier, None), want);
        assert_eq!(std::fs::metadata(&file).unwrap().modified().unwrap(), made, "a right file was rewritten");
        // One flipped byte in the first batch, then a truncated file.
        let mut bytes = std::fs::read(&file).unwrap();
        bytes[100] ^= 0xff;
        std::fs::write(&file, &bytes).unwrap();
        assert_eq!(greedy(&tier, None), want);
        assert_eq!(std::fs::read(&file).unwrap()[100], bytes[100] ^ 0xff);
        std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
        assert_eq!(greedy(&tier, None), want);
        assert_eq!(std::fs::metadata(&file).unwrap().len() as usize, bytes.len());
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left.len(), 1, "temporary files left: {left:?}");
    }

    /// A directory that cannot be created is an error naming it.
    #[test]
    fn an_unusable_directory_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = dir.path().join("a-file");
        std::fs::write(&blocker, b"x").unwrap();
        let tier = HostTier::File(blocker.join("sub"));
        let e = synthetic::load_in(NAME, SEED, &MemoryPool::unlimited(), &tier).err().expect("refused");
        assert!(e.to_string().contains("a-file"), "{e}");
    }
}
