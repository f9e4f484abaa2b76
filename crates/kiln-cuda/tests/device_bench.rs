//! Kernel speed on GPU 0 (feature `cuda`, `KILN_TEST_CUDA=1`): `qmv` at M = 1 and
//! `qmv_wide` at M = 8 on the projections of a 4-bit g64 Llama-3.1-8B layer and its LM
//! head, each as GB/s of weights read and as a share of a device-to-device copy measured in
//! the same run (a copy reads and writes its bytes: 2 x bytes / time), and M = 8's time
//! over M = 1's. Each matrix is held in four copies used in turn (more than the L2), and
//! each figure is the best of five timed passes of 20 launches after a warm-up. Prints
//! one table; asserts nothing about speed. Without the variable it says it ran nothing.
//! `scripts/device/cuda-check.sh` runs it.
#![cfg(feature = "cuda")]

use std::time::Instant;

use kiln_core::{QuantSpec, ScaleDtype, Tag};
use kiln_cuda::launch::{Act, QmvBuffers, QmvShape};
use kiln_cuda::{Exec, Mem};

const COPIES: usize = 4;

fn best_of<F: FnMut()>(exec: &Exec, mut f: F, launches: usize) -> f64 {
    f();
    exec.synchronize().unwrap();
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..launches {
            f();
        }
        exec.synchronize().unwrap();
        best = best.min(t.elapsed().as_secs_f64() / launches as f64);
    }
    best
}

#[test]
fn qmv_bandwidth_against_a_device_copy() {
    if std::env::var_os("KILN_TEST_CUDA").is_none_or(|v| v != "1") {
        eprintln!("KILN_TEST_CUDA is not 1: no kernel was timed on a GPU");
        return;
    }
    let exec = Exec::cuda(0).unwrap_or_else(|e| panic!("KILN_TEST_CUDA=1 but {e}"));
    let bytes = 1usize << 30;
    let src = exec.alloc(Tag::Scratch, bytes).unwrap();
    let mut dst = exec.alloc(Tag::Scratch, bytes).unwrap();
    let copy_s = best_of(&exec, || exec.copy(&mut dst, &src).unwrap(), 4);
    let copy_bw = 2.0 * bytes as f64 / copy_s;
    drop((src, dst));
    println!("device: {}", exec.name());
    println!("device-to-device copy of 1 GiB: {:.1} GB/s (read + write)", copy_bw / 1e9);
    println!("shape (N x K)        M=1 us   GB/s  share   M=8 us  M8/M1");
    let spec = QuantSpec::new(4, 64).unwrap();
    for (what, n, k) in [
        ("q/o 4096x4096", 4096, 4096),
        ("k/v 1024x4096", 1024, 4096),
        ("gate/up 14336x4096", 14336, 4096),
        ("down 4096x14336", 4096, 14336),
        ("head 128256x4096", 128256, 4096),
    ] {
        let s1 = QmvShape { n, k, m: 1, spec, scales: ScaleDtype::F16, act: Act::F16 };
        let weights: Vec<[Mem; 3]> = (0..COPIES)
            .map(|_| {
                [
                    exec.alloc(Tag::Weights, s1.packed_bytes()).unwrap(),
                    exec.alloc(Tag::Weights, s1.scale_bytes()).unwrap(),
                    exec.alloc(Tag::Weights, s1.scale_bytes()).unwrap(),
                ]
            })
            .collect();
        // Zeroed codes, scales and biases: the kernels' work does not depend on the values.
        let x = exec.upload(Tag::Scratch, &vec![0u16; 8 * k]).unwrap();
        let y = exec.alloc(Tag::Scratch, 8 * n * 4).unwrap();
        let time = |m: usize| {
            let shape = QmvShape { m, ..s1 };
            let mut i = 0;
            best_of(
                &exec,
                || {
                    let [p, s, b] = &weights[i % COPIES];
                    i += 1;
                    let l = shape
                        .launch(QmvBuffers {
                            packed: p.addr(),
                            scales: s.addr(),
                            biases: b.addr(),
                            x: x.addr(),
                            y: y.addr(),
                        })
                        .unwrap();
                    // SAFETY: every buffer is sized by the shape's own byte counts and alive.
                    unsafe { exec.launch(&l) }.unwrap();
                },
                20,
            )
        };
        let (t1, t8) = (time(1), time(8));
        let read = (s1.packed_bytes() + 2 * s1.scale_bytes()) as f64;
        println!(
            "{what:<20} {:>7.1} {:>6.0} {:>5.0}% {:>8.1} {:>6.2}",
            t1 * 1e6,
            read / t1 / 1e9,
            100.0 * read / t1 / copy_bw,
            t8 * 1e6,
            t8 / t1
        );
    }
}
