//! Shared helpers for kiln criterion benchmarks: the model shapes, random quantized
//! weights made fast enough that a 145 MB matrix costs a fraction of a second, enough
//! copies of each to defeat the last-level cache, and the benchmark naming scheme that
//! `cargo xtask bench-kernels` parses.

#![deny(missing_docs)]

use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use kiln_core::bandwidth::{DEFAULT_BYTES, ReadBuffer};
use kiln_core::format::QuantSpec;
use kiln_core::matrix::{QuantizedMatrix, ScaleData, ScaleDtype};
use kiln_core::{Buffer, KernelChoice, MemoryPool, PoolVec, Tag};

/// A weight matrix shape: `n` output features (rows of W), `k` input features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Output features.
    pub n: usize,
    /// Input features.
    pub k: usize,
    /// Where the shape comes from.
    pub model: &'static str,
}

/// The shapes of the kernel benchmarks: Qwen2.5-0.5B's MLP and vocabulary projection and
/// Llama-3.1-8B's attention and MLP projections.
pub const SHAPES: [Shape; 6] = [
    Shape { n: 4864, k: 896, model: "qwen2.5-0.5b gate/up" },
    Shape { n: 896, k: 4864, model: "qwen2.5-0.5b down" },
    Shape { n: 151936, k: 896, model: "qwen2.5-0.5b lm_head" },
    Shape { n: 4096, k: 4096, model: "llama-3.1-8b q/o" },
    Shape { n: 14336, k: 4096, model: "llama-3.1-8b gate/up" },
    Shape { n: 4096, k: 14336, model: "llama-3.1-8b down" },
];

/// Least bytes of weights the copies of one matrix span together: three times a 32 MiB
/// last-level cache.
pub const MIN_ROTATION_BYTES: usize = 96 << 20;

/// Bytes of weights the copies of one matrix span together, so every product reads its
/// weights from memory, as decode does: three times this machine's largest cache (sysfs
/// names it on Linux; some hosts have 260 MiB of L3), and never under
/// [`MIN_ROTATION_BYTES`].
pub fn rotation_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| largest_cache_bytes().map_or(0, |b| b.saturating_mul(3)).max(MIN_ROTATION_BYTES))
}

/// The largest cache cpu0's sysfs lists, in bytes; `None` where there is no such list.
fn largest_cache_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("size")).ok())
        .filter_map(|s| cache_size_bytes(&s))
        .max()
}

/// Parses a sysfs cache size (`266240K`, `32M`, `512`) by kiln's size syntax, in which
/// `K`, `M` and `G` alone are binary units as in sysfs; `None` for anything else.
pub fn cache_size_bytes(text: &str) -> Option<usize> {
    usize::try_from(kiln_protocol::parse_size(text).ok()?).ok()
}

/// The group size of the benchmarks (mlx-community's default).
pub const GROUP_SIZE: usize = 64;

/// The dtype of the benchmarks' scales and biases.
pub const SCALE_DTYPE: ScaleDtype = ScaleDtype::F16;

/// The benchmark name `cargo xtask bench-kernels` parses:
/// `<kernel>/q<bits>_g<group>_n<N>_k<K>_m<M>/t<threads>`.
pub fn bench_name(
    kernel: &str,
    bits: u32,
    shape: Shape,
    m: usize,
    threads: usize,
) -> (String, String, String) {
    (
        kernel.to_string(),
        format!("q{bits}_g{GROUP_SIZE}_n{}_k{}_m{m}", shape.n, shape.k),
        format!("t{threads}"),
    )
}

/// The kernel name used in benchmark ids for a dispatcher choice.
pub fn kernel_name(choice: KernelChoice) -> &'static str {
    match choice {
        KernelChoice::Qmv => "qmv",
        KernelChoice::QmvPerRow => "qmv_per_row",
        KernelChoice::QmvWide => "qmv_wide",
        KernelChoice::Qmm => "qmm",
    }
}

/// xorshift64*: fast, seeded random words for weights and activations.
pub struct Rng(u64);

impl Rng {
    /// A generator from a non-zero seed.
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [-a, a).
    pub fn sym(&mut self, a: f32) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
    }
}

/// A random quantized matrix: random codes (every word random), f16 scales of both signs
/// and biases of the size real checkpoints have.
pub fn random_matrix(shape: Shape, bits: u32, seed: u64) -> QuantizedMatrix {
    random_matrix_grouped(shape, bits, GROUP_SIZE, seed)
}

/// [`random_matrix`] at group size `group` (a probe of another checkpoint's geometry).
/// Its buffers come from a pool's weight allocations, as a loaded model's do (huge pages
/// where the system gives them), so a product streams its weights as decode does.
pub fn random_matrix_grouped(shape: Shape, bits: u32, group: usize, seed: u64) -> QuantizedMatrix {
    let spec = QuantSpec::new(bits, group).expect("benchmark spec is valid");
    let mut rng = Rng::new(seed);
    let words = shape.n * spec.words_per_row(shape.k);
    let mut packed = weights(words);
    for pair in packed.chunks_mut(2) {
        let v = rng.next_u64();
        pair[0] = v as u32;
        if let Some(w) = pair.get_mut(1) {
            *w = (v >> 32) as u32;
        }
    }
    let groups = shape.n * spec.groups_per_row(shape.k);
    let scales: Vec<f32> = (0..groups).map(|_| rng.sym(0.02)).collect();
    let biases: Vec<f32> = (0..groups).map(|_| rng.sym(0.2)).collect();
    QuantizedMatrix::new(
        shape.n,
        shape.k,
        spec,
        Buffer::from_pool(packed),
        pooled_scales(&scales, SCALE_DTYPE),
        pooled_scales(&biases, SCALE_DTYPE),
    )
    .expect("benchmark geometry is valid")
}

/// `len` zeroed elements allocated as a model's weights are.
fn weights<T: bytemuck::Zeroable + Copy>(len: usize) -> PoolVec<T> {
    static POOL: std::sync::OnceLock<MemoryPool> = std::sync::OnceLock::new();
    POOL.get_or_init(MemoryPool::unlimited)
        .alloc_zeroed(Tag::Weights, len)
        .expect("benchmark weights fit in memory")
}

/// [`ScaleData::from_f32`] in [`weights`] buffers.
fn pooled_scales(values: &[f32], dtype: ScaleDtype) -> ScaleData {
    fn fill<T: bytemuck::Pod>(values: &[f32], f: impl Fn(f32) -> T) -> Buffer<T> {
        let mut v = weights::<T>(values.len());
        for (o, &x) in v.iter_mut().zip(values) {
            *o = f(x);
        }
        Buffer::from_pool(v)
    }
    match dtype {
        ScaleDtype::F16 => ScaleData::F16(fill(values, half::f16::from_f32)),
        ScaleDtype::Bf16 => ScaleData::Bf16(fill(values, half::bf16::from_f32)),
        ScaleDtype::F32 => ScaleData::F32(fill(values, |x| x)),
    }
}

/// Bytes one product reads from a benchmark matrix: packed codes, scales and biases.
pub fn matrix_bytes(shape: Shape, bits: u32) -> usize {
    let groups = shape.n * (shape.k / GROUP_SIZE);
    shape.n * shape.k * bits as usize / 8 + 2 * groups * SCALE_DTYPE.size()
}

/// Copies of one random matrix's geometry (each with its own random contents) spanning
/// at least [`rotation_bytes`], used in turn so no product finds its weights in cache.
pub struct Rotation {
    mats: Vec<QuantizedMatrix>,
    next: usize,
}

impl Rotation {
    /// Makes the copies for `shape` at `bits`.
    /// With `single`, one copy only (a smoke run that measures nothing).
    pub fn new(shape: Shape, bits: u32, single: bool) -> Rotation {
        Rotation::grouped(shape, bits, GROUP_SIZE, single)
    }

    /// [`Rotation::new`] at group size `group`. The copies are stored as the CPU backend
    /// stores a model's weights (`kiln_core::kernels::store_for_cpu`): in the lane-row
    /// layout where `kiln_core::kernels::lane_rows_preferred` says so (`KILN_WEIGHT_LAYOUT=row-major`
    /// keeps them row-major), so the kernels timed are the ones a model runs.
    pub fn grouped(shape: Shape, bits: u32, group: usize, single: bool) -> Rotation {
        let first = random_matrix_grouped(shape, bits, group, 1);
        let copies = if single { 1 } else { rotation_bytes().div_ceil(first.bytes_read()).max(1) };
        let mut mats = vec![first];
        mats.extend((1..copies).map(|i| random_matrix_grouped(shape, bits, group, 1 + i as u64)));
        for w in &mut mats {
            kiln_core::kernels::store_for_cpu(w);
        }
        Rotation { mats, next: 0 }
    }

    /// The next matrix in turn.
    pub fn next_matrix(&mut self) -> &QuantizedMatrix {
        let w = &self.mats[self.next];
        self.next = (self.next + 1) % self.mats.len();
        w
    }

    /// Bytes one product reads: packed codes, scales and biases of one matrix.
    pub fn bytes_per_product(&self) -> usize {
        self.mats[0].bytes_read()
    }

    /// Number of copies.
    pub fn copies(&self) -> usize {
        self.mats.len()
    }
}

/// Whether criterion was asked for a smoke run (`--test`: one iteration of each bench,
/// results not kept), in which case the benches skip work that only matters for timing.
pub fn smoke_run() -> bool {
    std::env::args().any(|a| a == "--test")
}

/// Random activations, `m * k` values.
pub fn random_activations(m: usize, k: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..m * k).map(|_| rng.sym(1.0)).collect()
}

/// A rayon pool of `threads` threads.
pub fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("building a rayon pool")
}

/// Threads of the "all threads" configuration.
pub fn all_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Benchmarks `read_bandwidth/sum_<MiB>MiB_<when>/t<threads>`: one full read of a buffer far
/// beyond the last-level cache (1 MiB in a smoke run), kept in `buf` across calls. Kernel
/// benchmarks run it first and last, so a shared machine's load shows as a gap.
pub fn read_bandwidth(c: &mut Criterion, threads: &[usize], buf: &mut Option<ReadBuffer>, when: &str) {
    let bytes = if smoke_run() { 1 << 20 } else { DEFAULT_BYTES };
    let mut g = c.benchmark_group("read_bandwidth");
    g.sampling_mode(SamplingMode::Flat).throughput(Throughput::Bytes(bytes as u64));
    for &t in threads {
        let p = pool(t);
        g.bench_function(BenchmarkId::new(format!("sum_{}MiB_{when}", bytes >> 20), format!("t{t}")), |b| {
            let buf = buf.get_or_insert_with(|| ReadBuffer::new(bytes));
            b.iter(|| p.install(|| buf.sum()));
        });
    }
    g.finish();
}

/// Loop iterations per thread in one iteration of a `compute_roof` benchmark: about a
/// million multiply-accumulate instructions per thread, so starting the threads costs
/// little against the loop.
pub const ROOF_ITERS: u64 = 1 << 16;

/// Benchmarks `compute_roof/<probe>/t<threads>`: every compute-roof probe this CPU runs
/// (`kiln_core::roofs`), on all of a pool's threads at once. Its throughput is in elements,
/// each element one operation (a multiply-accumulate counts two), so the harness reads
/// operations per second where criterion prints elements per second.
pub fn compute_roofs(c: &mut Criterion, threads: &[usize]) {
    let iters = if smoke_run() { 1 } else { ROOF_ITERS };
    let mut g = c.benchmark_group("compute_roof");
    g.sampling_mode(SamplingMode::Flat);
    for &t in threads {
        let p = pool(t);
        for probe in kiln_core::roofs::available() {
            g.throughput(Throughput::Elements(kiln_core::roofs::ops(probe, t, iters)));
            g.bench_function(BenchmarkId::new(probe.as_str(), format!("t{t}")), |b| {
                b.iter(|| p.install(|| kiln_core::roofs::run_on_pool(probe, iters)));
            });
        }
    }
    g.finish();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_sizes_parse_as_sysfs_writes_them() {
        assert_eq!(cache_size_bytes("266240K\n"), Some(266240 << 10));
        assert_eq!(cache_size_bytes("32M"), Some(32 << 20));
        assert_eq!(cache_size_bytes("1G"), Some(1 << 30));
        assert_eq!(cache_size_bytes("4096"), Some(4096));
        for bad in ["", "K", "12Q", "-1K", "99999999999999999999K"] {
            assert_eq!(cache_size_bytes(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_rotation_never_spans_less_than_its_floor() {
        assert!(rotation_bytes() >= MIN_ROTATION_BYTES);
        if let Some(llc) = largest_cache_bytes() {
            assert!(rotation_bytes() >= llc * 3, "{} under three caches of {llc}", rotation_bytes());
        }
    }
}
