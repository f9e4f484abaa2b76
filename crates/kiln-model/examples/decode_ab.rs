//! Fused against unfused decode steps in one process, alternating step by step, with wall
//! and CPU time per token and the share of read bandwidth / bytes per token reached.
//!
//! ```text
//! cargo run --release -p kiln-model --example decode_ab -- MODEL THREADS POSITIONS [STEPS] [ROUNDS]
//! ```
//!
//! `MODEL` is a synthetic profile (`smollm-135m`, `qwen2.5-0.5b@4bit-g32`, ...). Each round
//! prefills two caches to `POSITIONS` tokens, then runs `STEPS` (default 64) decode steps
//! on each, fused and unfused ([`Transformer::set_fused_decode`]) in the order A B, B A,
//! ..., so a drift in the machine's speed falls on both alike, and checks the two give
//! the same logits bit for bit. A round starts with a read-bandwidth probe (256 MiB,
//! best of 3) on the same pool. Bytes per token are the weights read per step plus the f16
//! keys and values read at the round's mean depth. CPU time is the process's user +
//! system time (every thread, spinning workers included) over the steps of one variant.

use std::time::{Duration, Instant};

use kiln_core::MemoryPool;
use kiln_core::bandwidth::{self, ReadBuffer};
use kiln_model::{AttentionKind, KvCache, KvDtype, Logits, SeqChunk, Transformer, Workspace, synthetic};

/// The process's CPU time so far (user + system, all threads).
fn cpu_time() -> Duration {
    // SAFETY: `getrusage` only writes the struct it is given, which is zeroed and ours.
    let usage = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

#[derive(Default, Clone, Copy)]
struct Tally {
    wall: Duration,
    cpu: Duration,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: decode_ab MODEL THREADS POSITIONS [STEPS] [ROUNDS]";
    let name = args.first().expect(usage);
    let num = |i: usize, default: Option<usize>| -> usize {
        args.get(i).map(|s| s.parse().expect(usage)).or(default).expect(usage)
    };
    let (threads, positions, steps, rounds) = (num(1, None), num(2, None), num(3, Some(64)), num(4, Some(3)));
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a rayon pool");
    let mem = MemoryPool::unlimited();
    let model = synthetic::load_with_seed(name, 1, &mem).expect("a synthetic profile");
    let c = &model.config;
    let weights_bytes = model.weights.bytes_read_per_token() as f64;
    let kv_per_position = (2 * c.num_hidden_layers * c.kv_dim() * 2) as f64;
    let prompt: Vec<u32> = (0..positions as u32).map(|i| (i * 37 + 5) % c.vocab_size as u32).collect();
    let buf = ReadBuffer::new(256 << 20);
    println!(
        "| round | bandwidth GB/s | fused ms/token | unfused ms/token | unfused/fused wall | unfused/fused CPU | fused CPU ms/token | fused share | unfused share |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    pool.install(|| {
        for round in 0..rounds {
            let bw = bandwidth::measure(&buf, 3).bytes_per_s;
            let ts = [false, true].map(|fused| {
                let mut t =
                    Transformer::new(c, &model.weights, AttentionKind::Streaming).expect("a transformer");
                t.set_fused_decode(fused);
                t
            });
            let mut ws = [0, 1].map(|_| Workspace::empty(c, &mem).expect("a workspace"));
            let mut caches = [0, 1].map(|_| KvCache::new(ts[0].kv_layout(KvDtype::F16), &mem));
            let mut next = 0u32;
            for i in 0..2 {
                let seq = &mut [SeqChunk { cache: &mut caches[i], tokens: &prompt }];
                let logits = ts[i].forward(&mut ws[i], seq, Logits::Last).expect("a prefill");
                next = kiln_model::ops::argmax(logits) as u32;
            }
            let mut tally = [Tally::default(); 2];
            let mut last = [Vec::new(), Vec::new()];
            for step in 0..steps {
                let order = if step % 2 == 0 { [0, 1] } else { [1, 0] };
                for i in order {
                    let (w0, c0) = (Instant::now(), cpu_time());
                    let seq = &mut [SeqChunk { cache: &mut caches[i], tokens: &[next] }];
                    let logits = ts[i].forward(&mut ws[i], seq, Logits::Last).expect("a decode step");
                    tally[i].wall += w0.elapsed();
                    tally[i].cpu += cpu_time() - c0;
                    last[i].clear();
                    last[i].extend_from_slice(logits);
                }
                assert!(
                    last[0].iter().zip(&last[1]).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "fused and unfused logits differ at step {step}"
                );
                next = kiln_model::ops::argmax(&last[0]) as u32;
            }
            let per = |d: Duration| d.as_secs_f64() * 1e3 / steps as f64;
            let (unfused, fused) = (tally[0], tally[1]);
            let bytes = weights_bytes + kv_per_position * (positions as f64 + steps as f64 / 2.0);
            let share = |t: Tally| bytes / (t.wall.as_secs_f64() / steps as f64) / bw;
            println!(
                "| {round} | {:.1} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |",
                bw / 1e9,
                per(fused.wall),
                per(unfused.wall),
                unfused.wall.as_secs_f64() / fused.wall.as_secs_f64(),
                unfused.cpu.as_secs_f64() / fused.cpu.as_secs_f64(),
                per(fused.cpu),
                share(fused),
                share(unfused),
            );
        }
    });
}
