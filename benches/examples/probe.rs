//! A quick probe for tuning kernels on a shared machine: alternates one kernel product
//! with one read-bandwidth pass and reports the best of each, so load from other
//! processes shows up as noise in both rather than as a bias in their ratio.
//!
//! With one thread it also reports the best thread CPU time, which time slices lost to
//! other processes do not inflate.
//!
//! `cargo run --release -p kiln-benches --example probe -- <kernel> <bits> <n> <k> <m> <threads> [reps] [hot|cold] [g<group>]`
//! with kernel one of `qmv`, `qmv_wide`, `qmv_per_row`, `qmm`, `qmm_sgemm`; or `vpdpbusd`,
//! which measures one thread's `vpdpbusd` rate (AVX-512 VNNI) and prints the time the
//! `M x K` by `N x K` product's integer multiplies alone would take at it under `int16`
//! (two 8-bit planes: `2 * M * N * K / 64` instructions), the floor of any 4-bit kernel here.
//! The matrices are stored as the CPU backend stores a model's (the lane-row layout on an
//! AVX-512 host; `KILN_WEIGHT_LAYOUT=row-major` for rows).

use std::time::Instant;

use kiln_benches::{Rotation, Shape, pool, random_activations};
use kiln_core::bandwidth::ReadBuffer;
use kiln_core::kernels::{qmm, qmm_sgemm, qmv, qmv_wide};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 6 {
        eprintln!("usage: probe <kernel> <bits> <n> <k> <m> <threads> [reps] [hot|cold] [g<group>]");
        std::process::exit(2);
    }
    let refuse = |what: String| -> ! {
        eprintln!("probe: {what}");
        std::process::exit(2)
    };
    let num = |i: usize| {
        args[i]
            .parse::<usize>()
            .unwrap_or_else(|e| refuse(format!("argument {i} ({:?}): {e}; expected a whole number", args[i])))
    };
    let kernel = args[0].as_str();
    let (bits, n, k, m, threads) = (num(1) as u32, num(2), num(3), num(4), num(5));
    if kernel == "vpdpbusd" {
        vnni_floor(n, k, m, threads);
        return;
    }
    let reps = if args.len() > 6 { num(6) } else { 20 };
    let shape = Shape { n, k, model: "probe" };
    // An 8th argument "hot" keeps one copy (cache-resident
    // when it fits), to see the compute-bound speed.
    let hot = args.get(7).is_some_and(|a| a == "hot");
    // A last argument `g<size>` sets the group size (the benchmarks' 64 by default).
    let group = match args.iter().skip(7).find(|a| a.starts_with('g')) {
        None => kiln_benches::GROUP_SIZE,
        Some(a) => a[1..]
            .parse::<usize>()
            .ok()
            .filter(|g| [32, 64, 128].contains(g))
            .unwrap_or_else(|| refuse(format!("group size {a:?}: expected g32, g64 or g128"))),
    };
    // Stored as the CPU backend stores a model's weights (`KILN_WEIGHT_LAYOUT`).
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

/// Prints one thread's `vpdpbusd` rate, with register operands and with a 32-bit word
/// broadcast from memory (the lane-row kernel's form), and the `int16` floor of an
/// `m x k` by `n x k` product at that rate over `threads` threads.
fn vnni_floor(n: usize, k: usize, m: usize, threads: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if !std::arch::is_x86_feature_detected!("avx512vnni") {
            eprintln!("vpdpbusd: this CPU has no AVX-512 VNNI");
            std::process::exit(2);
        }
        let iters = 20_000_000usize;
        let words = [7i32; 16];
        let best = |f: &dyn Fn() -> i32| {
            (0..10)
                .map(|_| {
                    let c = thread_cpu();
                    std::hint::black_box(f());
                    thread_cpu() - c
                })
                .fold(f64::INFINITY, f64::min)
        };
        // SAFETY: AVX-512 VNNI (and so F/BW) was detected above.
        let reg = (iters * 12) as f64 / best(&|| unsafe { vnni::chains(iters, None) });
        // SAFETY: as above.
        let mem = (iters * 12) as f64 / best(&|| unsafe { vnni::chains(iters, Some(&words)) });
        let ops = 2.0 * (m * n * k) as f64 / 64.0;
        println!(
            "vpdpbusd zmm, one thread: {:.2} G/s (registers), {:.2} G/s (a word broadcast from memory); \
             int16 floor of m{m} n{n} k{k} at t{threads}: {:.3} ms",
            reg / 1e9,
            mem / 1e9,
            ops / (mem * threads as f64) * 1e3
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (n, k, m, threads);
        eprintln!("vpdpbusd: x86-64 only");
        std::process::exit(2);
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use std::arch::x86_64::*;

    /// Twelve independent chains of `iters` `vpdpbusd` each (more than its latency times
    /// its throughput), the third operand a register or, with `words`, broadcast from them.
    ///
    /// # Safety
    /// The CPU must support AVX-512F/BW and VNNI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn chains(iters: usize, words: Option<&[i32; 16]>) -> i32 {
        let a = _mm512_set1_epi8(3);
        let b = _mm512_set1_epi8(5);
        let mut acc = [_mm512_setzero_si512(); 12];
        match words {
            None => {
                for _ in 0..iters {
                    for v in acc.iter_mut() {
                        *v = _mm512_dpbusd_epi32(*v, a, b);
                    }
                }
            }
            Some(w) => {
                for _ in 0..iters {
                    for (j, v) in acc.iter_mut().enumerate() {
                        *v = _mm512_dpbusd_epi32(*v, a, _mm512_set1_epi32(w[j]));
                    }
                }
            }
        }
        let mut s = _mm512_setzero_si512();
        for v in acc {
            s = _mm512_add_epi32(s, v);
        }
        _mm512_reduce_add_epi32(s)
    }
}
