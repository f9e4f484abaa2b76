//! Where `qmm` should take over from `qmv_wide`: both integer kernels and the f32
//! `qmm_sgemm` (dequantized tiles + `matrixmultiply::sgemm`) at M from 4 to 128, on three
//! shapes (two input widths), all threads. Run by hand (`cargo bench -p kiln-benches --bench crossover`);
//! `qmv_batch_limit` is set from what it shows (see docs/benchmarks.md).
//!
//! Ids: `crossover_<kernel>/q<bits>_g64_n<N>_k<K>_m<M>/t<threads>`.

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use kiln_benches::{
    Rotation, SHAPES, all_threads, bench_name, matrix_bytes, pool, random_activations, smoke_run,
};
use kiln_core::QuantizedMatrix;
use kiln_core::kernels::{qmm, qmm_sgemm, qmv, qmv_wide};

const MS: [usize; 8] = [4, 8, 12, 16, 24, 32, 64, 128];

/// A product `y[m, n] = x[m, k] W^T`.
type Product = fn(&[f32], usize, &QuantizedMatrix, &mut [f32]);

fn main() {
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_secs(1))
        .configure_from_args();
    let t = all_threads();
    let p = pool(t);
    let kernels: [(&str, Product); 4] = [
        ("crossover_qmv_wide", qmv_wide),
        ("crossover_qmm", qmm),
        ("crossover_qmm_sgemm", qmm_sgemm),
        ("crossover_qmv_per_row", |x, _m, w, y| {
            for (xr, yr) in x.chunks_exact(w.k()).zip(y.chunks_exact_mut(w.n())) {
                qmv(xr, w, yr);
            }
        }),
    ];
    // Qwen2.5-0.5B gate/up (short rows: a tile's activations stay in L1 much longer),
    // Llama-3.1-8B q/o (square) and gate/up (wide N).
    for shape in [SHAPES[0], SHAPES[3], SHAPES[4]] {
        for bits in [4, 8] {
            let mut rot: Option<Rotation> = None;
            let x = random_activations(128, shape.k, 3);
            for m in MS {
                for (name, f) in kernels {
                    let (group, case, value) = bench_name(name, bits, shape, m, t);
                    let mut g = c.benchmark_group(group);
                    g.sampling_mode(SamplingMode::Flat)
                        .throughput(Throughput::Bytes(matrix_bytes(shape, bits) as u64));
                    let mut y = vec![0f32; m * shape.n];
                    let xm = &x[..m * shape.k];
                    g.bench_function(BenchmarkId::new(case, value), |b| {
                        let rot = rot.get_or_insert_with(|| Rotation::new(shape, bits, smoke_run()));
                        b.iter_custom(|iters| {
                            p.install(|| {
                                let t0 = Instant::now();
                                for _ in 0..iters {
                                    f(xm, m, rot.next_matrix(), &mut y);
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
    c.final_summary();
}
