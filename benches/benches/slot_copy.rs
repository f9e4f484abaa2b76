//! criterion benchmarks of an expert-cache slot fill (kiln-core's `copy_ranges`, which
//! `ExpertCache` calls on a miss) at the slot sizes of the synthetic MoE profiles, with
//! plain and non-temporal stores, beside the machine's read bandwidth measured in the same
//! run.
//!
//! Ids: `read_bandwidth/sum_1024MiB_{start,end}/t<threads>` (as in the kernel benchmarks)
//! and `slot_copy/<plain|streaming>_<profile>_<bytes>B/t<threads>`. One iteration copies
//! one slot laid out as an expert is (three matrices, each packed words, scales and
//! biases, every part 64-byte aligned); throughput is the bytes copied, so criterion's
//! GB/s is bytes copied per second (a copy reads and writes each byte). Sources and
//! destinations are used in turn over three times the largest cache each (`rotation_bytes`), so every
//! fill reads and writes memory, as a miss in a long decode does.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use kiln_benches::{all_threads, pool, read_bandwidth, rotation_bytes, smoke_run};
use kiln_core::copy::{Stores, copy_ranges_with};

/// (profile, packed bytes of one matrix, scale bytes of one matrix) for 4-bit group-64
/// experts with bf16 scales and biases: a matrix of n x k has n k / 2 packed bytes and
/// n k / 64 x 2 bytes each of scales and biases.
const SLOTS: [(&str, usize, usize); 2] = [
    // hidden 2048, expert intermediate 768
    ("qwen3-30b-a3b", 2048 * 768 / 2, 2048 * 768 / 32),
    // hidden 2048, expert intermediate 1408
    ("qwen1.5-moe-a2.7b", 2048 * 1408 / 2, 2048 * 1408 / 32),
];

/// The nine parts' (offset, length) in a slot, each 64-byte aligned, and the slot's bytes.
fn layout(packed: usize, scales: usize) -> (Vec<(usize, usize)>, usize) {
    let mut parts = Vec::with_capacity(9);
    let mut at = 0;
    for len in [packed, scales, scales].repeat(3) {
        parts.push((at, len));
        at = (at + len).next_multiple_of(64);
    }
    (parts, at)
}

fn main() {
    let mut c = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    let t = all_threads();
    let p = pool(t);
    let mut bw = None;
    read_bandwidth(&mut c, &[t], &mut bw, "start");
    for (profile, packed, scales) in SLOTS {
        let (parts, bytes) = layout(packed, scales);
        // `cargo bench` passes `--bench`; `cargo test --benches` (CI's smoke run, one
        // iteration each) does not, and gets one buffer of each.
        let measuring = !smoke_run() && std::env::args().any(|a| a == "--bench");
        let copies = if measuring { rotation_bytes().div_ceil(bytes) } else { 1 };
        let mut copied = vec![false; copies];
        // Distinct contents, every page touched before timing.
        let src: Vec<Vec<u8>> = (0..copies).map(|i| vec![i as u8 ^ 0x5a; bytes]).collect();
        let mut dst: Vec<Vec<u8>> = (0..copies).map(|_| vec![1u8; bytes]).collect();
        let mut g = c.benchmark_group("slot_copy");
        g.sampling_mode(SamplingMode::Flat).throughput(Throughput::Bytes(bytes as u64));
        for (name, stores) in [("plain", Stores::Plain), ("streaming", Stores::Streaming)] {
            let mut next = 0;
            g.bench_function(BenchmarkId::new(format!("{name}_{profile}_{bytes}B"), format!("t{t}")), |b| {
                b.iter(|| {
                    let (s, d) = (&src[next], &mut dst[next]);
                    copied[next] = true;
                    next = (next + 1) % copies;
                    let mut rest: &mut [u8] = d;
                    let mut pairs = Vec::with_capacity(9);
                    let mut end = 0;
                    for &(at, len) in &parts {
                        let (_, tail) = std::mem::take(&mut rest).split_at_mut(at - end);
                        let (part, tail) = tail.split_at_mut(len);
                        pairs.push((&s[at..at + len], part));
                        rest = tail;
                        end = at + len;
                    }
                    p.install(|| copy_ranges_with(pairs, stores));
                });
            });
        }
        g.finish();
        let same =
            |s: &Vec<u8>, d: &Vec<u8>| parts.iter().all(|&(at, len)| s[at..at + len] == d[at..at + len]);
        assert!(copied[0], "no slot was copied");
        let checked = src.iter().zip(&dst).zip(&copied).filter(|&(_, &c)| c);
        assert!(checked.clone().all(|((s, d), _)| same(s, d)), "a slot copy lost bytes");
    }
    read_bandwidth(&mut c, &[t], &mut bw, "end");
    c.final_summary();
}
