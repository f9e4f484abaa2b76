//! criterion benchmarks of the fused decode attention kernel at decode depths, beside the
//! machine's read bandwidth measured in the same run, and of the tiled prefill kernel.
//!
//! Ids: `read_bandwidth/sum_1024MiB_{start,end}/t<threads>` (as in the kernel benchmarks)
//! and `attn_decode/<model>_d<depth>/t<threads>`: one decode step of one layer of the
//! model's attention (every key/value head, its query heads, one new row at position
//! `depth - 1`) over an f16 cache, through [`attn::decode`], the driver kiln-model runs.
//! Throughput is the keys and values read (bytes), so criterion reports GB/s to set
//! against the bandwidth; copies of the cache spanning three last-level caches are used
//! in turn, so every step reads from memory as decode does after the weights passed.
//!
//! `attn_prefill/<model>_n<length>/t<threads>`: one layer's attention of a whole prompt
//! of `length` rows from position 0 over an f16 cache, through [`attn::prefill`], the
//! kernel kiln-model runs for prefill chunks longer than 64 rows (lengths 512, 2048 and
//! 8192, but none past [`PREFILL_MAX_FLOPS`]). Throughput is the f32
//! operations the causal products need (`4 * head_dim` per query head and key a row
//! sees: a multiply and an add in each of the two products), so criterion's elements/s
//! are flop/s, to set against the machine's f32 FMA rate.

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use half::f16;
use kiln_benches::{Rng, all_threads, pool, read_bandwidth, rotation_bytes, smoke_run};
use kiln_core::kernels::attn::{self, DecodeShape, KvRun, KvSource};

/// Decode depths measured (the list).
const DEPTHS: [usize; 5] = [128, 512, 2048, 8192, 32768];

/// Prompt lengths of the prefill benchmarks.
const PREFILL_LENGTHS: [usize; 3] = [512, 2048, 8192];

/// The most flops one prefill benchmark's iteration may take: qwen2.5-0.5b's layer at 8192
/// (about 1.4 s on one Zen 4 core). llama-3.1-8b at 8192 would take five times that, ten
/// samples at each thread count, so it is left out.
const PREFILL_MAX_FLOPS: usize = 4 * 64 * 14 * 8192 * 8193 / 2;

/// The attention geometry of a model: query heads per key/value head, key/value heads and
/// head width.
struct Model {
    name: &'static str,
    group: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// smollm-135m (9 query heads, 3 key/value heads of 64), qwen2.5-0.5b (14 and 2 of 64) and
/// llama-3.1-8b (32 and 8 of 128).
const MODELS: [Model; 3] = [
    Model { name: "smollm-135m", group: 3, kv_heads: 3, head_dim: 64 },
    Model { name: "qwen2.5-0.5b", group: 7, kv_heads: 2, head_dim: 64 },
    Model { name: "llama-3.1-8b", group: 4, kv_heads: 8, head_dim: 128 },
];

const SAMPLES: usize = 10;
const WARM_UP: Duration = Duration::from_millis(250);
const MEASUREMENT: Duration = Duration::from_millis(700);

/// Positions per block of the benchmark's cache, as kiln-model's.
const BLOCK: usize = 256;

/// One copy of a layer's cache: `[key|value][kv_head][position][head_dim]`.
struct Layer<'a> {
    data: &'a [f16],
    kv_heads: usize,
    depth: usize,
    head_dim: usize,
}

impl KvSource for Layer<'_> {
    fn block(&self) -> usize {
        BLOCK
    }

    fn run(&self, value: bool, head: usize, start: usize, n: usize) -> KvRun<'_> {
        let at = ((value as usize * self.kv_heads + head) * self.depth + start) * self.head_dim;
        KvRun::F16(&self.data[at..at + n * self.head_dim])
    }
}

fn main() {
    let mut c = Criterion::default()
        .sample_size(SAMPLES)
        .warm_up_time(WARM_UP)
        .measurement_time(MEASUREMENT)
        .configure_from_args();
    let all = all_threads();
    let threads = if all > 1 { vec![1, all] } else { vec![1] };
    let mut buf = None;
    read_bandwidth(&mut c, &threads, &mut buf, "start");
    // A smoke run (CI) takes the two shortest depths only: one and two cache blocks.
    let depths = if smoke_run() { &DEPTHS[..2] } else { &DEPTHS[..] };
    for model in &MODELS {
        for &depth in depths {
            decode(&mut c, model, depth, &threads);
        }
    }
    let lengths = if smoke_run() { &PREFILL_LENGTHS[..1] } else { &PREFILL_LENGTHS[..] };
    for model in &MODELS {
        for &n in lengths {
            if prefill_flops(model, n) <= PREFILL_MAX_FLOPS {
                prefill(&mut c, model, n, &threads);
            }
        }
    }
    read_bandwidth(&mut c, &threads, &mut buf, "end");
    c.final_summary();
}

fn decode(c: &mut Criterion, model: &Model, depth: usize, threads: &[usize]) {
    let smoke = smoke_run();
    let (g, kvh, hd) = (model.group, model.kv_heads, model.head_dim);
    let layer_values = 2 * kvh * depth * hd;
    let bytes = layer_values * 2;
    // Made on first use, so a filtered run never fills caches it does not measure.
    let mut cache: Option<Vec<f16>> = None;
    let copies = if smoke { 1 } else { rotation_bytes().div_ceil(bytes).max(2) };
    let shape = DecodeShape::new(g, hd);
    let mut rng = Rng::new(depth as u64);
    let q0: Vec<f32> = (0..kvh * g * hd).map(|_| rng.sym(1.0)).collect();
    let mut q = q0.clone();
    let mut group = c.benchmark_group("attn_decode");
    group.sampling_mode(SamplingMode::Flat).throughput(Throughput::Bytes(bytes as u64));
    for &t in threads {
        let p = pool(t);
        group.bench_function(BenchmarkId::new(format!("{}_d{depth}", model.name), format!("t{t}")), |b| {
            let data = cache.get_or_insert_with(|| {
                let mut rng = Rng::new(7);
                (0..copies * layer_values).map(|_| f16::from_f32(rng.sym(1.0))).collect()
            });
            let mut i = 0;
            b.iter_custom(|iters| {
                p.install(|| {
                    let t0 = Instant::now();
                    for _ in 0..iters {
                        let layer = Layer {
                            data: &data[i * layer_values..(i + 1) * layer_values],
                            kv_heads: kvh,
                            depth,
                            head_dim: hd,
                        };
                        q.copy_from_slice(&q0);
                        attn::decode(&shape, kvh, &mut q, depth - 1, &layer);
                        i = (i + 1) % copies;
                    }
                    t0.elapsed()
                })
            });
        });
    }
    group.finish();
    std::hint::black_box(&q);
}

/// The f32 operations of one layer's causal prefill of `n` rows: row `r` sees `r + 1`
/// keys, and each query head and key cost `4 * head_dim` (a multiply and an add in the
/// score and in the values).
fn prefill_flops(model: &Model, n: usize) -> usize {
    4 * model.head_dim * model.kv_heads * model.group * n * (n + 1) / 2
}

fn prefill(c: &mut Criterion, model: &Model, n: usize, threads: &[usize]) {
    let (g, kvh, hd) = (model.group, model.kv_heads, model.head_dim);
    let shape = DecodeShape::new(g, hd);
    let mut rng = Rng::new(n as u64 + 1);
    let data: Vec<f16> = (0..2 * kvh * n * hd).map(|_| f16::from_f32(rng.sym(1.0))).collect();
    let layer = Layer { data: &data, kv_heads: kvh, depth: n, head_dim: hd };
    let q0: Vec<f32> = (0..n * kvh * g * hd).map(|_| rng.sym(1.0)).collect();
    let (mut q, mut tmp) = (q0.clone(), vec![0f32; q0.len()]);
    let flops = prefill_flops(model, n);
    let mut group = c.benchmark_group("attn_prefill");
    group.sampling_mode(SamplingMode::Flat).throughput(Throughput::Elements(flops as u64));
    for &t in threads {
        let p = pool(t);
        group.bench_function(BenchmarkId::new(format!("{}_n{n}", model.name), format!("t{t}")), |b| {
            b.iter_custom(|iters| {
                p.install(|| {
                    let mut spent = Duration::ZERO;
                    for _ in 0..iters {
                        q.copy_from_slice(&q0);
                        let t0 = Instant::now();
                        attn::prefill(&shape, kvh, &mut q, &mut tmp, 0, &layer);
                        spent += t0.elapsed();
                    }
                    spent
                })
            });
        });
    }
    group.finish();
    std::hint::black_box(&q);
}
