//! Which batch sizes M run `qmv_wide` and which run `qmv` once per row, chosen from a
//! measurement on this machine, so that a batched product is never slower than its rows
//! one by one.
//!
//! `qmv_wide` reads each weight row once for every activation row, `qmv` per row reads the
//! weights M times; which is faster depends on how compute-bound the wide kernel is on
//! this CPU at this thread count (on a 2-vCPU Zen 3 host, per row won at M = 2 and 4).
//! Under the default scheme both give the same bits row for row, so the choice changes no
//! output; under `int16-wide8` it also chooses the wide rows' 8-bit codes (see
//! [`crate::act_precision`]).
//!
//! The measurement ([`calibrate`]) times both at M = 2 to 8 on synthetic weights of a
//! decode-sized shape (4-bit g32, 4864 x 896, the MLP of a 0.5B model), rotating through
//! 64 MiB, more bytes than most last-level caches hold, so the weights stream from memory
//! as in a decode step (a CPU with a larger cache, such as a 260 MiB L3, holds part of
//! them); M = 9 to 15 (one eight-row tile and a small one) follow M = 8. The result is
//! cached per CPU model, thread count, path, activation scheme and engine build
//! ([`build_id`]: a rebuilt kiln may have other kernels) in
//! `$XDG_CACHE_HOME/kiln/qmv-crossover` (else `~/.cache/kiln/qmv-crossover`), a small text
//! file replaced atomically; a line that does not parse is measured again, never an
//! error. A measurement taken while other processes kept the CPUs busy (more than
//! `KILN_QMV_CROSSOVER_BUSY_LIMIT` CPUs, [`BusyLimit`]) is used for that boot but not
//! cached: a crossover timed under a neighbour's load would otherwise be followed on the
//! quiet machine until someone remeasured. `KILN_QMV_CROSSOVER` skips or forces the
//! measurement ([`CrossoverSetting`]); the `KILN_QMV_WIDE` pin overrides all of it
//! ([`crate::wide`]).

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::act_precision::ActScheme;
use crate::buffer::Buffer;
use crate::format::QuantSpec;
use crate::kernels::{Isa, qmv_batch_limit, qmv_scheme_on, qmv_wide_scheme_on};
use crate::matrix::{QuantizedMatrix, ScaleData, ScaleDtype};
pub use crate::wide::Crossover;

/// The environment variable choosing how the crossover is found.
pub const CROSSOVER_ENV: &str = "KILN_QMV_CROSSOVER";

/// The environment variable bounding the other processes' load under which a measurement
/// is cached.
pub const BUSY_LIMIT_ENV: &str = "KILN_QMV_CROSSOVER_BUSY_LIMIT";

/// The batch sizes [`calibrate`] times; larger ones below the `qmm` limit follow the last.
pub const MEASURED_ROWS: std::ops::RangeInclusive<usize> = 2..=8;

/// The name of the cache file under the cache directory's `kiln` folder.
pub const CACHE_FILE: &str = "qmv-crossover";

/// What `KILN_QMV_CROSSOVER` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrossoverSetting {
    /// Unset, empty or `measure`: the cached measurement, else measure and cache it.
    Measure,
    /// `remeasure`: measure even when a measurement is cached, and replace it.
    Remeasure,
    /// A number from 2 to 16: no measurement, wide from that M on (16: per row for every
    /// M below the `qmm` limit).
    From(usize),
}

impl CrossoverSetting {
    /// Accepted values, for messages.
    pub const ACCEPTED: &'static str = "measure (the default), remeasure, or a batch size from 2 to 16";

    /// Parses a value (surrounding spaces and case ignored; empty is the default).
    pub fn parse(value: &str) -> Result<CrossoverSetting, String> {
        let v = value.trim().to_ascii_lowercase();
        match v.as_str() {
            "" | "measure" => Ok(CrossoverSetting::Measure),
            "remeasure" => Ok(CrossoverSetting::Remeasure),
            n => match n.parse::<usize>() {
                Ok(m) if (2..=16).contains(&m) => Ok(CrossoverSetting::From(m)),
                _ => {
                    Err(format!("invalid {CROSSOVER_ENV} {value:?}: accepted values are {}", Self::ACCEPTED))
                }
            },
        }
    }

    /// The setting `KILN_QMV_CROSSOVER` asks for, or the error naming a bad value.
    pub fn from_env() -> Result<CrossoverSetting, String> {
        Self::parse(&crate::env::setting_env(CROSSOVER_ENV, Self::ACCEPTED)?)
    }
}

/// How busy the other processes may keep the CPUs while the crossover is measured for the
/// measurement to be cached, in CPUs (`KILN_QMV_CROSSOVER_BUSY_LIMIT`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum BusyLimit {
    /// Cache only when the others used less than this many CPUs (`0` never caches).
    Below(f64),
    /// `none`: cache whatever the load.
    None,
}

impl BusyLimit {
    /// The default: half a CPU.
    pub const DEFAULT: BusyLimit = BusyLimit::Below(0.5);

    /// Accepted values, for messages.
    pub const ACCEPTED: &'static str = "a number of CPUs >= 0 (default 0.5; 0 never caches), or none";

    /// Parses a value (surrounding spaces and case ignored; empty is the default).
    pub fn parse(value: &str) -> Result<BusyLimit, String> {
        let v = value.trim().to_ascii_lowercase();
        match v.as_str() {
            "" => Ok(BusyLimit::DEFAULT),
            "none" => Ok(BusyLimit::None),
            n => match n.parse::<f64>() {
                Ok(x) if x.is_finite() && x >= 0.0 => Ok(BusyLimit::Below(x)),
                _ => {
                    Err(format!("invalid {BUSY_LIMIT_ENV} {value:?}: accepted values are {}", Self::ACCEPTED))
                }
            },
        }
    }

    /// The limit `KILN_QMV_CROSSOVER_BUSY_LIMIT` asks for, or the error naming a bad value.
    pub fn from_env() -> Result<BusyLimit, String> {
        Self::parse(&crate::env::setting_env(BUSY_LIMIT_ENV, Self::ACCEPTED)?)
    }

    /// Whether a measurement taken while the others used `others` CPUs (`None`: unknown,
    /// as without `/proc`) may be cached.
    pub fn allows(self, others: Option<f64>) -> bool {
        match (self, others) {
            (BusyLimit::None, _) | (_, None) => true,
            (BusyLimit::Below(limit), Some(o)) => o < limit,
        }
    }
}

/// What one measurement gave: [`calibrate`]'s timings and the CPUs other processes used
/// meanwhile ([`OthersLoad`]), `None` where that cannot be read.
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    /// `(m, per_row_s, wide_s)` rows.
    pub timings: Vec<(usize, f64, f64)>,
    /// Other processes' CPU use during the measurement, in CPUs.
    pub others_cpus: Option<f64>,
}

/// A sample of the machine's busy CPU time and this process's own, to tell how much CPU
/// other processes used between two samples (Linux `/proc/stat` and `/proc/self/stat`,
/// both in clock ticks).
#[derive(Clone, Copy, Debug)]
pub struct OthersLoad {
    busy: u64,
    own: u64,
    at: Instant,
}

impl OthersLoad {
    /// Samples now; `None` without a readable `/proc`.
    pub fn sample() -> Option<OthersLoad> {
        let at = Instant::now();
        let busy = busy_ticks(&std::fs::read_to_string("/proc/stat").ok()?)?;
        let own = own_ticks(&std::fs::read_to_string("/proc/self/stat").ok()?)?;
        Some(OthersLoad { busy, own, at })
    }

    /// The CPUs other processes used on average since this sample (never below 0).
    pub fn others_since(&self) -> Option<f64> {
        let now = OthersLoad::sample()?;
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        let secs = now.at.duration_since(self.at).as_secs_f64();
        if hz <= 0 || secs <= 0.0 {
            return None;
        }
        let others = now.busy.saturating_sub(self.busy) as f64 - now.own.saturating_sub(self.own) as f64;
        Some((others / hz as f64 / secs).max(0.0))
    }
}

/// The machine's busy ticks from `/proc/stat`'s first line: user, nice, system, irq,
/// softirq and steal (a hypervisor's neighbours count as load too).
fn busy_ticks(stat: &str) -> Option<u64> {
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let f: Vec<u64> = line.split_whitespace().map(|v| v.parse().ok()).collect::<Option<_>>()?;
    let at = |i: usize| f.get(i).copied().unwrap_or(0);
    (f.len() >= 4).then(|| at(0) + at(1) + at(2) + at(5) + at(6) + at(7))
}

/// This process's user and system ticks, all threads, from `/proc/self/stat` (fields 14
/// and 15; the command name before them may hold spaces, so they are counted from its
/// closing parenthesis).
fn own_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// Where the crossover in force came from, for the kernel configuration line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrossoverSource {
    /// Measured now (and cached when the cache could be written).
    Measured,
    /// Measured now while other processes used more CPU than `KILN_QMV_CROSSOVER_BUSY_LIMIT`
    /// allows, in hundredths of a CPU: used for this boot, not cached.
    MeasuredBusy {
        /// The others' load during the measurement, in hundredths of a CPU.
        others_centi: u32,
    },
    /// Read from the cache file.
    Cached,
    /// Set by `KILN_QMV_CROSSOVER=<M>`.
    Env,
    /// `KILN_QMV_WIDE` pins the kernel: nothing was measured.
    Pinned,
    /// Nothing cached and this command does not measure: `qmv_wide` at every M.
    Default,
}

impl CrossoverSource {
    /// The name in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            CrossoverSource::Measured => "measured",
            CrossoverSource::MeasuredBusy { .. } => "measured-busy",
            CrossoverSource::Cached => "cached",
            CrossoverSource::Env => "env",
            CrossoverSource::Pinned => "pinned",
            CrossoverSource::Default => "default",
        }
    }
}

/// What a machine's measurement is cached under: the CPU model, the thread count, the
/// kernels' path, the activation scheme, the calibration shape, and the engine build that
/// measured it (a rebuilt kiln may have other kernels, so it measures again).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheKey {
    /// The CPU's model name (`/proc/cpuinfo`), or `unknown`.
    pub cpu: String,
    /// Worker threads.
    pub threads: usize,
    /// The kernels' path.
    pub isa: Isa,
    /// The activation scheme.
    pub scheme: ActScheme,
    /// The running executable ([`build_id`]).
    pub build: String,
}

impl CacheKey {
    /// The key for this CPU, the current rayon pool and the running executable.
    pub fn current(scheme: ActScheme) -> CacheKey {
        CacheKey {
            cpu: cpu_model(),
            threads: rayon::current_num_threads(),
            isa: Isa::detected(),
            scheme,
            build: build_id(),
        }
    }

    /// The machine part of the key: what one cache line stands for, whichever build
    /// measured it.
    fn slot(&self) -> String {
        let cpu: String = self.cpu.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
        format!(
            "cpu={} threads={} isa={} act={} shape={}",
            cpu.trim(),
            self.threads,
            self.isa.as_str(),
            self.scheme.as_str(),
            shape_name()
        )
    }

    /// The key as the cache file's first field (control characters in the CPU name become
    /// spaces, and spaces or control characters in the build underscores, so a line always
    /// splits in two).
    pub fn line_key(&self) -> String {
        let build: String =
            self.build.chars().map(|c| if c.is_control() || c == ' ' { '_' } else { c }).collect();
        format!("{} build={build}", self.slot())
    }
}

/// The running executable as the cache key names it: its size and modification time
/// (`<bytes>-<seconds>.<nanoseconds>`), which change whenever it is rebuilt or installed
/// anew; `unknown` where they cannot be read.
pub fn build_id() -> String {
    let meta = std::env::current_exe().and_then(std::fs::metadata);
    let id = meta.ok().and_then(|m| {
        let t = m.modified().ok()?.duration_since(std::time::UNIX_EPOCH).ok()?;
        Some(format!("{}-{}.{:09}", m.len(), t.as_secs(), t.subsec_nanos()))
    });
    id.unwrap_or_else(|| "unknown".to_string())
}

/// The CPU's model name from `/proc/cpuinfo`, or `unknown`.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_string())
}

/// The cache file: `$XDG_CACHE_HOME/kiln/qmv-crossover` when that variable is an absolute
/// path, else `$HOME/.cache/kiln/qmv-crossover`; `None` without either.
pub fn cache_path() -> Option<PathBuf> {
    let xdg = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).filter(|p| p.is_absolute());
    let base = xdg.or_else(|| {
        std::env::var_os("HOME").map(PathBuf::from).filter(|p| p.is_absolute()).map(|h| h.join(".cache"))
    })?;
    Some(base.join("kiln").join(CACHE_FILE))
}

/// One cached measurement: the crossover and the CPUs other processes used while it was
/// measured (`None` for a line written before the load was recorded, or where `/proc`
/// could not tell).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CacheEntry {
    /// The measured crossover.
    pub crossover: Crossover,
    /// Other processes' CPU use during the measurement, in CPUs.
    pub others_cpus: Option<f64>,
}

impl From<Crossover> for CacheEntry {
    /// An entry whose load is not known.
    fn from(crossover: Crossover) -> Self {
        CacheEntry { crossover, others_cpus: None }
    }
}

impl CacheEntry {
    /// The value after the key's tab: the crossover, then `others=<CPUs>` when known.
    fn parse(v: &str) -> Option<CacheEntry> {
        let mut parts = v.trim().split('\t');
        let crossover = Crossover::parse(parts.next()?)?;
        let others_cpus = match parts.next() {
            None => None,
            Some(o) => {
                let x = o.strip_prefix("others=")?.parse::<f64>().ok()?;
                if !(x.is_finite() && x >= 0.0) {
                    return None;
                }
                Some(x)
            }
        };
        if parts.next().is_some() {
            return None;
        }
        Some(CacheEntry { crossover, others_cpus })
    }
}

impl fmt::Display for CacheEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.others_cpus {
            Some(o) => write!(f, "{}\tothers={o:.2}", self.crossover),
            None => write!(f, "{}", self.crossover),
        }
    }
}

/// The entry cached under `key` in the file's text, if a line for it parses.
pub fn lookup(text: &str, key: &CacheKey) -> Option<CacheEntry> {
    let want = key.line_key();
    text.lines()
        .filter_map(|l| l.split_once('\t'))
        .find(|(k, _)| *k == want)
        .and_then(|(_, v)| CacheEntry::parse(v))
}

/// The file's text with `key`'s line set to `e`: other well-formed lines are kept in
/// order, except those of the same machine slot measured by another build or by none
/// (replaced, so the file does not grow with every rebuild); lines that do not parse are
/// dropped.
pub fn updated(text: &str, key: &CacheKey, e: CacheEntry) -> String {
    let want = key.line_key();
    let bare = key.slot();
    let slot = format!("{bare} build=");
    let mut out = String::new();
    for (k, v) in text.lines().filter_map(|l| l.split_once('\t')) {
        // A line without a build (written before builds were keyed) is the slot's too.
        let same_slot = k.starts_with(&slot) || k == bare;
        if !same_slot
            && !k.is_empty()
            && let Some(old) = CacheEntry::parse(v)
        {
            out.push_str(&format!("{k}\t{old}\n"));
        }
    }
    out.push_str(&format!("{want}\t{e}\n"));
    out
}

/// The largest cache file read: a line per machine slot is a few hundred bytes, so a
/// file past this is not kiln's cache.
pub const CACHE_MAX_BYTES: u64 = 1 << 20;

/// The bytes of the cache file at `path`: `Ok(None)` when there is none, `Err` (the
/// warning to print) when something other than a regular file of at most
/// [`CACHE_MAX_BYTES`] is there. The file is opened without blocking, so a FIFO put in
/// its place cannot stop the process, and checked after opening (what was opened is what
/// is read); a symlink to a regular file is followed, one to a device is refused.
fn read_cache_file(path: &Path) -> Result<Option<Vec<u8>>, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let refused = |what: String| {
        format!(
            "ignoring the qmv crossover cache {}: {what}; accepted is a regular file of at most {CACHE_MAX_BYTES} bytes, measuring again",
            path.display()
        )
    };
    let file = match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(refused(format!("cannot open it ({e})"))),
    };
    let meta = file.metadata().map_err(|e| refused(format!("cannot stat it ({e})")))?;
    if !meta.file_type().is_file() {
        return Err(refused(format!("it is {}, not a regular file", file_kind(&meta.file_type()))));
    }
    if meta.len() > CACHE_MAX_BYTES {
        return Err(refused(format!("it holds {} bytes", meta.len())));
    }
    let mut bytes = Vec::new();
    file.take(CACHE_MAX_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| refused(format!("cannot read it ({e})")))?;
    if bytes.len() as u64 > CACHE_MAX_BYTES {
        return Err(refused(format!("it grew past {CACHE_MAX_BYTES} bytes while read")));
    }
    Ok(Some(bytes))
}

/// What a file type is, for messages.
fn file_kind(t: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "not a regular file"
    }
}

/// Reads `key`'s entry from the cache file at `path`: `Ok(None)` for a missing file or
/// key, or a corrupt line (measure again); `Err` is the warning for a path that holds
/// something other than a regular file of bounded size (measure again, after saying so).
pub fn read_cached(path: &Path, key: &CacheKey) -> Result<Option<CacheEntry>, String> {
    Ok(read_cache_file(path)?.and_then(|bytes| lookup(&String::from_utf8_lossy(&bytes), key)))
}

/// Writes `key`'s entry into the cache file at `path`, replacing the file atomically
/// (a temporary file beside it, then a rename), creating its folder. Other keys' lines
/// are kept when the old file is a readable cache; whatever else was at `path` (a FIFO, a
/// link to a device) is replaced by the new file, never read.
pub fn write_cached(path: &Path, key: &CacheKey, e: CacheEntry) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let old = read_cache_file(path)
        .ok()
        .flatten()
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{CACHE_FILE}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, updated(&old, key, e))?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// The calibration shape, as the cache key names it.
const SHAPE_NAME: &str = "q4g32-4864x896";

/// The calibration shape and the layout its matrices are stored in (as the CPU backend
/// stores a model's: [`crate::kernels::lane_rows_preferred`]), as the cache key names them.
fn shape_name() -> String {
    if crate::kernels::lane_rows_preferred() { format!("{SHAPE_NAME}-lanes") } else { SHAPE_NAME.to_string() }
}
const SHAPE_N: usize = 4864;
const SHAPE_K: usize = 896;
/// Bytes of weights the calibration rotates through: more than most last-level caches, so
/// they stream from memory as a decode step's do.
const ROTATION_BYTES: usize = 64 << 20;
/// Products per timed pass: about 17 MiB of weights. The rotation carries on from pass to
/// pass, so every product still finds its matrix out of cache.
const PASS_PRODUCTS: usize = 8;
/// Measurements of each kernel at each M; the fastest counts.
const REPEATS: usize = 3;

/// Times per-row `qmv` and `qmv_wide` at each M of [`MEASURED_ROWS`] under `scheme` on
/// the current rayon pool, interleaved and the fastest of [`REPEATS`] passes of
/// [`PASS_PRODUCTS`] products kept: returns `(m, per_row_s, wide_s)` rows for
/// [`Crossover::from_timings`]. Takes a few hundred milliseconds (most of it making the
/// weights) and about 64 MiB for them, freed on return.
pub fn calibrate(scheme: ActScheme) -> Vec<(usize, f64, f64)> {
    let spec = QuantSpec::new(4, 32).expect("4-bit g32 is a supported geometry");
    let words = SHAPE_N * spec.words_per_row(SHAPE_K);
    let count = ROTATION_BYTES.div_ceil(words * 4).max(1);
    let gpr = SHAPE_N * (SHAPE_K / 32);
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let scales: Vec<f32> = (0..gpr).map(|i| 0.01 + (i % 7) as f32 * 1e-3).collect();
    let biases: Vec<f32> = (0..gpr).map(|i| -0.05 + (i % 5) as f32 * 1e-2).collect();
    let mats: Vec<QuantizedMatrix> = (0..count)
        .map(|_| {
            let packed: Vec<u32> = (0..words).map(|_| next() as u32).collect();
            let mut w = QuantizedMatrix::new(
                SHAPE_N,
                SHAPE_K,
                spec,
                Buffer::from(packed),
                ScaleData::from_f32(&scales, ScaleDtype::F16),
                ScaleData::from_f32(&biases, ScaleDtype::F16),
            )
            .expect("the calibration shape is valid");
            // Stored as a model's weights are, so the kernels timed are the ones it runs.
            crate::kernels::store_for_cpu(&mut w);
            w
        })
        .collect();
    let max_m = *MEASURED_ROWS.end();
    let x: Vec<f32> = (0..max_m * SHAPE_K).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.02).collect();
    let mut y = vec![0f32; max_m * SHAPE_N];
    let isa = Isa::detected();
    let mut rot = 0usize;
    let mut pass = |m: usize, wide: bool| -> f64 {
        let start = Instant::now();
        for _ in 0..PASS_PRODUCTS {
            let w = &mats[rot % count];
            rot += 1;
            let (x, y) = (&x[..m * SHAPE_K], &mut y[..m * SHAPE_N]);
            if wide {
                qmv_wide_scheme_on(isa, scheme, x, m, w, y);
            } else {
                for (xr, yr) in x.chunks_exact(SHAPE_K).zip(y.chunks_exact_mut(SHAPE_N)) {
                    qmv_scheme_on(isa, scheme, xr, w, yr);
                }
            }
        }
        start.elapsed().as_secs_f64()
    };
    // One untimed pass wakes the pool and warms the code.
    pass(2, true);
    let mut out = Vec::new();
    for m in MEASURED_ROWS.filter(|&m| m < qmv_batch_limit(SHAPE_K, SHAPE_N)) {
        let (mut per_row, mut wide) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..REPEATS {
            per_row = per_row.min(pass(m, false));
            wide = wide.min(pass(m, true));
        }
        out.push((m, per_row, wide));
    }
    out
}

/// [`calibrate`], with the CPU other processes used while it ran.
pub fn measure(scheme: ActScheme) -> Measurement {
    let before = OthersLoad::sample();
    let timings = calibrate(scheme);
    Measurement { timings, others_cpus: before.and_then(|b| b.others_since()) }
}

/// The crossover this process should run and where it came from, following
/// `setting`: a pin (`pinned`, from `KILN_QMV_WIDE`) needs none; `From(m)` sets it;
/// otherwise the cache at `path` under `key`, else `measure()` (written to the cache,
/// with the others' load beside it, when there is a path and `busy` allows that load; a
/// failed write only loses the cache). An entry cached while others used more CPU than
/// `busy` allows now is measured again. `measure` is `None` for a command that never
/// measures (it would cost its own timing and memory): then the cached entry is used
/// whatever its load, an uncached key gets [`Crossover::ALL_WIDE`], and `remeasure`
/// reads the cache too. A cache path holding something other than a regular file is
/// warned about once on stderr and treated as no cache.
pub fn resolve(
    setting: CrossoverSetting,
    pinned: bool,
    key: &CacheKey,
    path: Option<&Path>,
    busy: BusyLimit,
    measure: Option<impl FnOnce() -> Measurement>,
) -> (Crossover, CrossoverSource) {
    if pinned {
        return (Crossover::ALL_WIDE, CrossoverSource::Pinned);
    }
    let cached = || {
        path.and_then(|p| {
            read_cached(p, key).unwrap_or_else(|warning| {
                eprintln!("warning: {warning}");
                None
            })
        })
    };
    let measure = match (setting, measure) {
        (CrossoverSetting::From(m), _) => return (Crossover::wide_from(m), CrossoverSource::Env),
        (_, None) => {
            return cached().map_or((Crossover::ALL_WIDE, CrossoverSource::Default), |e| {
                (e.crossover, CrossoverSource::Cached)
            });
        }
        (CrossoverSetting::Measure, Some(measure)) => {
            if let Some(e) = cached().filter(|e| busy.allows(e.others_cpus)) {
                return (e.crossover, CrossoverSource::Cached);
            }
            measure
        }
        (CrossoverSetting::Remeasure, Some(measure)) => measure,
    };
    let m = measure();
    let c = Crossover::from_timings(&m.timings);
    if let Some(others) = m.others_cpus.filter(|&o| !busy.allows(Some(o))) {
        let others_centi = (others * 100.0).round().clamp(0.0, u32::MAX as f64) as u32;
        return (c, CrossoverSource::MeasuredBusy { others_centi });
    }
    if let Some(p) = path {
        let _ = write_cached(p, key, CacheEntry { crossover: c, others_cpus: m.others_cpus });
    }
    (c, CrossoverSource::Measured)
}

/// Resolves the crossover from the environment (`KILN_QMV_CROSSOVER`, `KILN_QMV_WIDE`,
/// `KILN_ACT_PRECISION`, `KILN_QMV_CROSSOVER_BUSY_LIMIT`) for the current rayon pool, measuring if need be and `may_measure`
/// allows, and installs it for [`crate::kernels::select_kernel`]. Run it inside the pool
/// the kernels will use.
pub fn configure_from_env(may_measure: bool) -> Result<(Crossover, CrossoverSource), String> {
    let setting = CrossoverSetting::from_env()?;
    let busy = BusyLimit::from_env()?;
    let scheme = ActScheme::from_env()?;
    let key = CacheKey::current(scheme);
    let path = cache_path();
    let measurer = may_measure.then_some(|| measure(scheme));
    let pinned = crate::wide::qmv_wide_pinned_by_operator();
    let (c, source) = resolve(setting, pinned, &key, path.as_deref(), busy, measurer);
    crate::wide::set_crossover(c);
    Ok((c, source))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lk(text: &str, key: &CacheKey) -> Option<Crossover> {
        lookup(text, key).map(|e| e.crossover)
    }

    fn key(threads: usize) -> CacheKey {
        CacheKey {
            cpu: "Test CPU\t9".into(),
            threads,
            isa: Isa::Portable,
            scheme: ActScheme::Int16,
            build: "1234-5.000000006".into(),
        }
    }

    #[test]
    fn another_build_measures_again_and_replaces_the_slot_s_line() {
        let (a, other_slot) = (key(2), key(3));
        let rebuilt = CacheKey { build: "999-7.000000000".into(), ..key(2) };
        let text = updated(
            &updated("", &other_slot, Crossover::ALL_WIDE.into()),
            &a,
            Crossover::wide_from(4).into(),
        );
        assert_eq!(lk(&text, &a), Some(Crossover::wide_from(4)));
        assert_eq!(lk(&text, &rebuilt), None, "a rebuilt engine must not follow the old one's line");
        let after = updated(&text, &rebuilt, Crossover::wide_from(6).into());
        assert_eq!(lk(&after, &rebuilt), Some(Crossover::wide_from(6)));
        assert_eq!(lk(&after, &a), None, "the old build's line is replaced");
        assert_eq!(lk(&after, &other_slot), Some(Crossover::ALL_WIDE));
        assert_eq!(after.lines().count(), 2);
        // A line from before builds were keyed is replaced too.
        let legacy = format!("{}\t2-15\n", a.slot());
        assert_eq!(lk(&legacy, &a), None);
        assert_eq!(updated(&legacy, &a, Crossover::ALL_WIDE.into()).lines().count(), 1);
        // A build with spaces or control characters still gives a line of two fields.
        let odd = CacheKey { build: "a b\tc\n".into(), ..key(2) };
        let t = updated("", &odd, Crossover::ALL_WIDE.into());
        assert_eq!((t.lines().count(), t.matches('\t').count()), (1, 1));
        assert_eq!(lk(&t, &odd), Some(Crossover::ALL_WIDE));
    }

    #[test]
    fn this_executable_has_a_build_id() {
        let id = build_id();
        assert_ne!(id, "unknown");
        assert_eq!(id, build_id(), "the same executable gives the same id");
        let (len, time) = id.split_once('-').expect("<bytes>-<time>");
        assert!(len.parse::<u64>().unwrap() > 0 && time.contains('.'), "{id}");
    }

    #[test]
    fn timings_choose_per_row_where_it_is_faster() {
        // Per row wins at 2 and 4; wide at 3 and from 5 on; 9..15 follow 8.
        let t = [
            (2, 1.0, 1.2),
            (3, 1.5, 1.4),
            (4, 2.0, 2.1),
            (5, 2.5, 2.0),
            (6, 3.0, 2.0),
            (7, 3.5, 2.0),
            (8, 4.0, 2.0),
        ];
        let c = Crossover::from_timings(&t);
        assert_eq!(c.to_string(), "3,5-15");
        assert!(!c.wide_at(2) && c.wide_at(3) && !c.wide_at(4) && c.wide_at(15));
        assert!(!c.wide_at(1) && !c.wide_at(16));
        // A tie goes to the wide kernel (one pass over the weights).
        assert!(Crossover::from_timings(&[(2, 1.0, 1.0)]).wide_at(2));
        // Per row at 8: 9..15 per row too, smaller unmeasured M stay wide.
        let c = Crossover::from_timings(&[(8, 1.0, 2.0)]);
        assert_eq!(c.to_string(), "2-7");
        assert_eq!(Crossover::from_timings(&[]), Crossover::ALL_WIDE);
    }

    #[test]
    fn the_display_form_parses_back() {
        for c in [
            Crossover::ALL_WIDE,
            Crossover::from_bits(0),
            Crossover::wide_from(5),
            Crossover::from_bits(0b1010_1100),
        ] {
            assert_eq!(Crossover::parse(&c.to_string()), Some(c), "{c}");
        }
        assert_eq!(Crossover::ALL_WIDE.to_string(), "2-15");
        assert_eq!(Crossover::wide_from(16).to_string(), "none");
        for bad in ["", "1-5", "2-16", "5-3", "x", "2,,3", "-"] {
            assert_eq!(Crossover::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn settings_parse_and_bad_ones_are_named() {
        assert_eq!(CrossoverSetting::parse(""), Ok(CrossoverSetting::Measure));
        assert_eq!(CrossoverSetting::parse(" Measure "), Ok(CrossoverSetting::Measure));
        assert_eq!(CrossoverSetting::parse("remeasure"), Ok(CrossoverSetting::Remeasure));
        assert_eq!(CrossoverSetting::parse("2"), Ok(CrossoverSetting::From(2)));
        assert_eq!(CrossoverSetting::parse("16"), Ok(CrossoverSetting::From(16)));
        for bad in ["1", "17", "wide", "-3"] {
            let e = CrossoverSetting::parse(bad).unwrap_err();
            assert!(
                e.contains(CROSSOVER_ENV) && e.contains(&format!("{bad:?}")) && e.contains("remeasure"),
                "{e}"
            );
        }
    }

    #[test]
    fn the_cache_keeps_other_keys_and_drops_corrupt_lines() {
        let (a, b) = (key(1), key(2));
        let text = updated("", &a, Crossover::wide_from(4).into());
        assert_eq!(lk(&text, &a), Some(Crossover::wide_from(4)));
        assert_eq!(lk(&text, &b), None);
        // A control character in the CPU name cannot split the line.
        assert_eq!(text.lines().count(), 1);
        assert_eq!(text.matches('\t').count(), 1);
        let corrupt = format!("{text}garbage\n{}\tnot-a-set\n\u{0}\u{1}", b.line_key());
        assert_eq!(lk(&corrupt, &b), None);
        let fixed = updated(&corrupt, &b, Crossover::ALL_WIDE.into());
        assert_eq!(lk(&fixed, &a), Some(Crossover::wide_from(4)));
        assert_eq!(lk(&fixed, &b), Some(Crossover::ALL_WIDE));
        assert_eq!(fixed.lines().count(), 2);
    }

    #[test]
    fn resolve_measures_once_then_reads_the_cache() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kiln").join(CACHE_FILE);
        let k = key(2);
        let timings = || vec![(2, 1.0, 2.0), (8, 3.0, 2.0)];
        let quiet = || Measurement { timings: timings(), others_cpus: Some(0.1) };
        let measured = std::cell::Cell::new(0);
        let go = |setting, pinned| {
            resolve(
                setting,
                pinned,
                &k,
                Some(&path),
                BusyLimit::DEFAULT,
                Some(|| {
                    measured.set(measured.get() + 1);
                    quiet()
                }),
            )
        };
        let never = None::<fn() -> Measurement>;
        let other = key(7);
        let r = resolve(CrossoverSetting::Remeasure, false, &other, Some(&path), BusyLimit::DEFAULT, never);
        assert_eq!(r, (Crossover::ALL_WIDE, CrossoverSource::Default));
        let want = Crossover::from_timings(&timings());
        assert_eq!(go(CrossoverSetting::Measure, false), (want, CrossoverSource::Measured));
        assert_eq!(go(CrossoverSetting::Measure, false), (want, CrossoverSource::Cached));
        assert_eq!(go(CrossoverSetting::Remeasure, false), (want, CrossoverSource::Measured));
        assert_eq!(go(CrossoverSetting::From(5), false), (Crossover::wide_from(5), CrossoverSource::Env));
        assert_eq!(go(CrossoverSetting::Measure, true), (Crossover::ALL_WIDE, CrossoverSource::Pinned));
        assert_eq!(measured.get(), 2);
        // A command that never measures reads the cache, even when asked to remeasure.
        let r = resolve(CrossoverSetting::Remeasure, false, &k, Some(&path), BusyLimit::DEFAULT, never);
        assert_eq!(r, (want, CrossoverSource::Cached));
        // A corrupt file is measured again and repaired, never an error.
        std::fs::write(&path, b"\xff\xfe garbage\n\tmore").unwrap();
        assert_eq!(go(CrossoverSetting::Measure, false), (want, CrossoverSource::Measured));
        assert_eq!(read_cached(&path, &k).unwrap().map(|e| e.crossover), Some(want));
        assert_eq!(measured.get(), 3);
        // No leftover temporary file.
        let names: Vec<_> =
            std::fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, [CACHE_FILE]);
        // An unwritable place only loses the cache.
        let blocked = dir.path().join("file");
        std::fs::write(&blocked, b"").unwrap();
        let p = blocked.join("kiln").join(CACHE_FILE);
        let r = resolve(CrossoverSetting::Measure, false, &k, Some(&p), BusyLimit::DEFAULT, Some(quiet));
        assert_eq!(r, (want, CrossoverSource::Measured));
    }

    fn quiet2() -> Measurement {
        Measurement { timings: vec![(2, 1.0, 2.0)], others_cpus: Some(0.0) }
    }

    #[test]
    fn a_cache_path_that_is_no_regular_file_is_ignored_never_waited_on() {
        let dir = tempfile::tempdir().unwrap();
        let k = key(2);
        let timings = vec![(2, 1.0, 2.0)];
        let want = Crossover::from_timings(&timings);
        let go = |path: &Path| {
            resolve(
                CrossoverSetting::Measure,
                false,
                &k,
                Some(path),
                BusyLimit::DEFAULT,
                Some(|| Measurement { timings: timings.clone(), others_cpus: Some(0.0) }),
            )
        };
        // A FIFO nobody writes to: opening or reading it would block for ever.
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = read_cached(&fifo, &k).unwrap_err();
        assert!(err.contains("a FIFO, not a regular file") && err.contains("fifo"), "{err}");
        // The boot measures and replaces the FIFO with a real cache.
        assert_eq!(go(&fifo), (want, CrossoverSource::Measured));
        assert!(std::fs::metadata(&fifo).unwrap().is_file());
        // A link to an endless device, and a folder.
        let zero = dir.path().join("zero");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let err = read_cached(&zero, &k).unwrap_err();
        assert!(err.contains("a character device"), "{err}");
        assert_eq!(go(&zero).1, CrossoverSource::Measured);
        let folder = dir.path().join("folder");
        std::fs::create_dir(&folder).unwrap();
        assert!(read_cached(&folder, &k).unwrap_err().contains("a directory"));
        // A regular file past the bound is refused before it is read.
        let big = dir.path().join("big");
        std::fs::File::create(&big).unwrap().set_len(CACHE_MAX_BYTES + 1).unwrap();
        assert!(read_cached(&big, &k).unwrap_err().contains("bytes"));
        assert_eq!(read_cached(&dir.path().join("missing"), &k), Ok(None));
    }

    #[test]
    fn cache_lines_carry_the_load_and_old_lines_still_read() {
        let a = key(2);
        let e = CacheEntry { crossover: Crossover::wide_from(4), others_cpus: Some(0.25) };
        let text = updated("", &a, e);
        assert_eq!(lookup(&text, &a), Some(e));
        let legacy = format!("{}\t{}\n", a.line_key(), Crossover::wide_from(4));
        assert_eq!(lookup(&legacy, &a), Some(Crossover::wide_from(4).into()));
        for bad in ["others=-1", "others=NaN", "others=x", "load=0.1", "others=0.1\textra"] {
            let t = format!("{}\t{}\t{bad}\n", a.line_key(), Crossover::wide_from(4));
            assert_eq!(lookup(&t, &a), None, "{bad}");
        }
    }

    #[test]
    fn a_measurement_under_load_is_used_but_not_cached() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kiln").join(CACHE_FILE);
        let k = key(2);
        let busy_t = vec![(2, 2.0, 1.0), (8, 4.0, 2.0)];
        let loaded = || Measurement { timings: busy_t.clone(), others_cpus: Some(1.26) };
        let go = |limit| resolve(CrossoverSetting::Measure, false, &k, Some(&path), limit, Some(loaded));
        let want = Crossover::from_timings(&busy_t);
        assert_eq!(go(BusyLimit::DEFAULT), (want, CrossoverSource::MeasuredBusy { others_centi: 126 }));
        assert_eq!(go(BusyLimit::DEFAULT).1.as_str(), "measured-busy");
        assert!(!path.exists(), "a busy measurement reached the cache");
        // The next quiet boot measures again and caches.
        let quiet = Measurement { timings: vec![(2, 1.0, 2.0)], others_cpus: Some(0.0) };
        let r =
            resolve(CrossoverSetting::Measure, false, &k, Some(&path), BusyLimit::DEFAULT, Some(|| quiet));
        assert_eq!(r.1, CrossoverSource::Measured);
        assert!(path.exists());
        // `none` caches whatever the load; a load that cannot be read counts as quiet.
        assert_eq!(go(BusyLimit::None).1, CrossoverSource::Cached);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(go(BusyLimit::None).1, CrossoverSource::Measured);
        // That entry was taken disturbed, and the file says so: a boot under the default
        // limit measures again instead of following it.
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.ends_with("\tothers=1.26\n"), "{text:?}");
        assert_eq!(read_cached(&path, &k).unwrap().and_then(|e| e.others_cpus), Some(1.26));
        assert_eq!(go(BusyLimit::DEFAULT), (want, CrossoverSource::MeasuredBusy { others_centi: 126 }));
        let r = resolve(CrossoverSetting::Measure, false, &k, Some(&path), BusyLimit::DEFAULT, Some(quiet2));
        assert_eq!(r.1, CrossoverSource::Measured, "a quiet measurement replaces the disturbed entry");
        assert_eq!(go(BusyLimit::DEFAULT).1, CrossoverSource::Cached);
        // A command that never measures still follows a disturbed entry: it has nothing better.
        write_cached(&path, &k, CacheEntry { crossover: want, others_cpus: Some(3.0) }).unwrap();
        let never = None::<fn() -> Measurement>;
        let r = resolve(CrossoverSetting::Measure, false, &k, Some(&path), BusyLimit::DEFAULT, never);
        assert_eq!(r, (want, CrossoverSource::Cached));
        assert!(BusyLimit::Below(0.0).allows(None) && !BusyLimit::Below(0.0).allows(Some(0.0)));
        assert!(BusyLimit::DEFAULT.allows(Some(0.49)) && !BusyLimit::DEFAULT.allows(Some(0.5)));
    }

    #[test]
    fn busy_limits_parse_and_bad_ones_are_named() {
        assert_eq!(BusyLimit::parse(""), Ok(BusyLimit::DEFAULT));
        assert_eq!(BusyLimit::parse(" NONE "), Ok(BusyLimit::None));
        assert_eq!(BusyLimit::parse("0"), Ok(BusyLimit::Below(0.0)));
        assert_eq!(BusyLimit::parse("1.5"), Ok(BusyLimit::Below(1.5)));
        for bad in ["-1", "nan", "inf", "x", "1e999"] {
            let e = BusyLimit::parse(bad).unwrap_err();
            assert!(
                e.contains(BUSY_LIMIT_ENV) && e.contains(&format!("{bad:?}")) && e.contains("none"),
                "{e}"
            );
        }
    }

    #[test]
    fn proc_stat_lines_give_busy_and_own_ticks() {
        let stat = "cpu  100 5 20 900 7 3 2 11 0 0\ncpu0 50 2 10 450 3 1 1 5 0 0\n";
        assert_eq!(busy_ticks(stat), Some(100 + 5 + 20 + 3 + 2 + 11));
        assert_eq!(busy_ticks("cpu0 1 2 3 4\n"), None);
        assert_eq!(busy_ticks("cpu  1 x 3 4\n"), None);
        assert_eq!(busy_ticks(""), None);
        // A command name with spaces and parentheses does not shift the fields.
        let own = "4242 (kiln (x) y) S 1 2 3 4 5 6 7 8 9 10 17 4 0 0 20 0 3 0 1 2 3";
        assert_eq!(own_ticks(own), Some(21));
        assert_eq!(own_ticks("4242 (kiln) S 1 2"), None);
        // On Linux the live files parse, and an idle wait shows no negative load.
        if let Some(s) = OthersLoad::sample() {
            std::thread::sleep(std::time::Duration::from_millis(30));
            assert!(s.others_since().is_some_and(|o| o >= 0.0));
        }
    }
}
