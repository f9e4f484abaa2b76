//! A quick probe for tuning kernels on a shared machine: alternates one kernel product
//! with one read-bandwidth pass and reports the best of each, so load from other
//! processes shows up as noise in both rather than as a bias in their ratio.
//!
//! With one thread it also reports the best thread CPU time, which time slices lost to
//! other processes do not inflate.
//!
//! `cargo run --release -p kiln-benches --example probe -- <kernel> <bits> <n> <k> <m> <threads> [reps] [hot|cold] [g<group>]`
//! with kernel one of `qmv`, `qmv_wide`, `qmv_per_row`, `qmm`, `qmm_sgemm`.

use std::time::Instant;

use kiln_benches::{Rotation, Shape, pool, random_activations};
use kiln_core::bandwidth::ReadBuffer;
use kiln_core::kernels::{qmm, qmm_sgemm, qmv, qmv_wide};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 6 {
        eprintln!("usage: probe <kernel> <bits> <n> <k> <m> <threads> [reps]");
        std::process::exit(2);
    }
    let num =
        |i: usize| args[i].parse::<usize>().unwrap_or_else(|e| panic!("argument {i} ({}): {e}", args[i]));
    let kernel = args[0].as_str();
    let (bits, n, k, m, threads) = (num(1) as u32, num(2), num(3), num(4), num(5));
    let reps = if args.len() > 6 { num(6) } else { 20 };
    let shape = Shape { n, k, model: "probe" };
    // An 8th argument "hot" keeps one copy (cache-resident
    // when it fits), to see the compute-bound speed.
    let hot = args.get(7).is_some_and(|a| a == "hot");
    // A last argument `g<size>` sets the group size (the benchmarks' 64 by default).
    let group = args
        .iter()
        .skip(7)
        .find_map(|a| a.strip_prefix('g').map(|g| g.parse().unwrap_or_else(|e| panic!("group {a}: {e}"))))
        .unwrap_or(kiln_benches::GROUP_SIZE);
    let mut rot = Rotation::grouped(shape, bits, group, hot);
    let x = random_activations(m, k, 5);
    let mut y = vec![0f32; m * n];
    let buf = ReadBuffer::new(if hot { 1 << 20 } else { 128 << 20 });
    let p = pool(threads);
    let (mut best_k, mut best_b) = (f64::INFINITY, f64::INFINITY);
    let (mut cpu_k, mut cpu_b) = (f64::INFINITY, f64::INFINITY);
    p.install(|| {
        for _ in 0..reps {
            let (t, c) = (Instant::now(), thread_cpu());
            if !hot {
                std::hint::black_box(buf.sum());
            }
            best_b = best_b.min(t.elapsed().as_secs_f64());
            cpu_b = cpu_b.min(thread_cpu() - c);
            let w = rot.next_matrix();
            let (t, c) = (Instant::now(), thread_cpu());
            match kernel {
                "qmv" => qmv(&x[..k], w, &mut y[..n]),
                "qmv_wide" => qmv_wide(&x, m, w, &mut y),
                "qmm" => qmm(&x, m, w, &mut y),
                "qmm_sgemm" => qmm_sgemm(&x, m, w, &mut y),
                "qmv_per_row" => {
                    for (xr, yr) in x.chunks_exact(k).zip(y.chunks_exact_mut(n)) {
                        qmv(xr, w, yr);
                    }
                }
                other => panic!("unknown kernel {other}"),
            }
            best_k = best_k.min(t.elapsed().as_secs_f64());
            cpu_k = cpu_k.min(thread_cpu() - c);
        }
    });
    let bytes = rot.bytes_per_product() as f64;
    let kbw = bytes / best_k / 1e9;
    let rbw = buf.bytes() as f64 / best_b / 1e9;
    println!(
        "{kernel} q{bits} n{n} k{k} m{m} t{threads}: {:.3} ms, {kbw:.2} GB/s, read {rbw:.2} GB/s, {:.1}% of read, {} copies",
        best_k * 1e3,
        100.0 * kbw / rbw,
        rot.copies()
    );
    if threads == 1 {
        let (kc, rc) = (bytes / cpu_k / 1e9, buf.bytes() as f64 / cpu_b / 1e9);
        println!(
            "  thread CPU time: {:.3} ms, {kc:.2} GB/s, read {rc:.2} GB/s, {:.1}% of read",
            cpu_k * 1e3,
            100.0 * kc / rc
        );
    }
}

/// CPU time of the calling thread, in seconds.
fn thread_cpu() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec and the clock id is a constant Linux
    // defines; the call only writes `ts`.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}
