//! criterion benchmarks of the quantized kernels on real model shapes, single- and
//! multi-threaded, beside the machine's read bandwidth measured in the same run.
//!
//! Ids: `read_bandwidth/sum_1024MiB_{start,end}/t<threads>` (measured first and last, so a
//! shared machine's load shows as a gap between the two; reports use the higher),
//! `compute_roof/<probe>/t<threads>` (each compute-roof probe the CPU runs, right after the
//! first bandwidth reading: `kiln_core::roofs`; throughput in operations, a
//! multiply-accumulate counting two) and
//! `<kernel>/q<bits>_g64_n<N>_k<K>_m<M>/t<threads>`, where the kernel is the one the
//! dispatcher runs at that M (`qmv` at M = 1, `qmv_wide` and `qmv_per_row` below
//! `qmv_batch_limit`, `qmm` from it on) under the default activation scheme (`int16`);
//! 4-bit weights are measured under `int8` too, as `<kernel>_int8` (the scheme
//! dimension: `KILN_ACT_PRECISION`, docs/environment-variables.md). Throughput is the matrix's bytes (packed codes +
//! scales + biases) per product, so criterion reports GB/s; each product reads its weights
//! from memory (copies of the matrix spanning three last-level caches are used in turn).

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use kiln_benches::{
    Rotation, SHAPES, Shape, all_threads, bench_name, compute_roofs, matrix_bytes, pool, random_activations,
    read_bandwidth, smoke_run,
};
use kiln_core::act_precision::ActScheme;
use kiln_core::kernels::{Isa, qmm_scheme_on, qmv_batch_limit, qmv_scheme_on, qmv_wide_scheme_on};

/// Activation rows measured (the list).
const MS: [usize; 6] = [1, 2, 4, 8, 12, 16];
/// Weight widths measured.
const BITS: [u32; 2] = [4, 8];
/// Samples per benchmark: memory-bound kernels vary little between samples, so ten
/// (criterion's minimum) resolve a 1-2% change while keeping the full run short.
const SAMPLES: usize = 10;
/// Warm-up per benchmark (it also faults in the pages of every copy of the matrix).
const WARM_UP: Duration = Duration::from_millis(250);
/// Least measurement time; longer when ten samples of one product need more.
const MIN_MEASUREMENT: Duration = Duration::from_millis(700);

fn main() {
    let mut c = Criterion::default()
        .sample_size(SAMPLES)
        .warm_up_time(WARM_UP)
        .measurement_time(MIN_MEASUREMENT)
        .configure_from_args();
    let threads = thread_counts();
    let mut buf = None;
    read_bandwidth(&mut c, &threads, &mut buf, "start");
    compute_roofs(&mut c, &threads);
    for shape in SHAPES {
        for bits in BITS {
            kernels(&mut c, shape, bits, &threads);
        }
    }
    read_bandwidth(&mut c, &threads, &mut buf, "end");
    c.final_summary();
}

/// One thread, and every thread when the machine has more than one.
fn thread_counts() -> Vec<usize> {
    let all = all_threads();
    if all > 1 { vec![1, all] } else { vec![1] }
}

/// What one benchmark runs.
#[derive(Clone, Copy)]
enum Kernel {
    Qmv,
    QmvPerRow,
    QmvWide,
    Qmm,
}

impl Kernel {
    fn name(self) -> &'static str {
        match self {
            Kernel::Qmv => "qmv",
            Kernel::QmvPerRow => "qmv_per_row",
            Kernel::QmvWide => "qmv_wide",
            Kernel::Qmm => "qmm",
        }
    }

    /// The kernels the dispatcher can run at `m` rows: both vector paths below the limit.
    fn at(m: usize, limit: usize) -> Vec<Kernel> {
        if m == 1 {
            vec![Kernel::Qmv]
        } else if m < limit {
            vec![Kernel::QmvWide, Kernel::QmvPerRow]
        } else {
            vec![Kernel::Qmm]
        }
    }

    fn run(self, scheme: ActScheme, x: &[f32], m: usize, rot: &mut Rotation, y: &mut [f32]) {
        let w = rot.next_matrix();
        let (k, n) = (w.k(), w.n());
        let isa = Isa::detected();
        match self {
            Kernel::Qmv => qmv_scheme_on(isa, scheme, x, w, y),
            Kernel::QmvPerRow => {
                for (xr, yr) in x.chunks_exact(k).zip(y.chunks_exact_mut(n)) {
                    qmv_scheme_on(isa, scheme, xr, w, yr);
                }
            }
            Kernel::QmvWide => qmv_wide_scheme_on(isa, scheme, x, m, w, y),
            Kernel::Qmm => qmm_scheme_on(isa, scheme, x, m, w, y),
        }
    }
}

/// The activation schemes measured for `bits`-bit weights, with the suffix of their
/// kernel names: the default, and for 4-bit weights (where the schemes differ) `int8`.
fn schemes(bits: u32) -> &'static [(ActScheme, &'static str)] {
    if bits == 4 { &[(ActScheme::Int16, ""), (ActScheme::Int8, "_int8")] } else { &[(ActScheme::Int16, "")] }
}

/// A guess of the machine's read bandwidth per thread, only to size measurement times.
const GUESS_BYTES_PER_S_PER_THREAD: f64 = 7e9;

fn kernels(c: &mut Criterion, shape: Shape, bits: u32, threads: &[usize]) {
    let smoke = smoke_run();
    // Made on first use, so a filtered run never builds matrices it does not measure.
    let mut rot: Option<Rotation> = None;
    let x = random_activations(*MS.iter().max().unwrap_or(&1), shape.k, 7);
    let limit = qmv_batch_limit(shape.k, shape.n);
    let bytes = matrix_bytes(shape, bits);
    for &t in threads {
        let p = pool(t);
        for m in MS {
            for (kernel, &(scheme, suffix)) in
                Kernel::at(m, limit).into_iter().flat_map(|k| schemes(bits).iter().map(move |s| (k, s)))
            {
                let name = format!("{}{suffix}", kernel.name());
                let (group, case, value) = bench_name(&name, bits, shape, m, t);
                let mut g = c.benchmark_group(group);
                let passes = if matches!(kernel, Kernel::QmvPerRow) { m } else { 1 };
                let guess = bytes as f64 * passes as f64 / (GUESS_BYTES_PER_S_PER_THREAD * t as f64);
                let wanted = Duration::from_secs_f64(guess * SAMPLES as f64 * 1.5);
                g.sampling_mode(SamplingMode::Flat)
                    .throughput(Throughput::Bytes(bytes as u64))
                    .measurement_time(wanted.max(MIN_MEASUREMENT));
                let mut y = vec![0f32; m * shape.n];
                let xm = &x[..m * shape.k];
                g.bench_function(BenchmarkId::new(case, value), |b| {
                    let rot = rot.get_or_insert_with(|| Rotation::new(shape, bits, smoke));
                    b.iter_custom(|iters| {
                        p.install(|| {
                            let t0 = Instant::now();
                            for _ in 0..iters {
                                kernel.run(scheme, xm, m, rot, &mut y);
                            }
                            t0.elapsed()
                        })
                    });
                });
                g.finish();
            }
        }
    }
}
