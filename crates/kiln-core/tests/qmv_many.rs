//! `qmv_many` (several matrices on one activation row in one parallel region, biases added
//! by the tasks) against one `qmv` per matrix followed by the bias: bit-identical on every
//! ISA path this CPU runs, at one to three threads, for the decode shapes of smollm-135m
//! (q|k|v 576 + 192 + 192 rows, gate|up 1536 + 1536) and for parts that do not share a
//! group size or a width (which run one at a time).

mod common;

use kiln_core::format::QuantSpec;
use kiln_core::kernels::{Isa, QmvPart, qmv_many_on, qmv_on};
use kiln_core::matrix::{QuantizedMatrix, ScaleDtype};
use kiln_core::quantize::quantize_as;

use common::Rng;

fn matrix(rng: &mut Rng, n: usize, k: usize, bits: u32, group: usize, dtype: ScaleDtype) -> QuantizedMatrix {
    let w: Vec<f32> = (0..n * k).map(|_| rng.sym(0.5)).collect();
    quantize_as(&w, n, k, QuantSpec::new(bits, group).unwrap(), dtype).unwrap()
}

/// Runs `qmv_many_on` and one `qmv_on` per part on every available path and thread count;
/// asserts every output bit matches.
fn check(what: &str, mats: &[(QuantizedMatrix, bool)], rng: &mut Rng) {
    let k = mats[0].0.k();
    let x: Vec<f32> = (0..k).map(|_| rng.sym(2.0)).collect();
    let biases: Vec<Option<Vec<f32>>> =
        mats.iter().map(|(w, b)| b.then(|| (0..w.n()).map(|_| rng.sym(1.0)).collect())).collect();
    for isa in Isa::available() {
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let mut fused: Vec<Vec<f32>> = mats.iter().map(|(w, _)| vec![f32::NAN; w.n()]).collect();
            let mut alone: Vec<Vec<f32>> = mats.iter().map(|(w, _)| vec![0.0; w.n()]).collect();
            pool.install(|| {
                let mut parts: Vec<QmvPart<'_>> = mats
                    .iter()
                    .zip(fused.iter_mut())
                    .zip(&biases)
                    .map(|(((w, _), y), b)| QmvPart { w, y, bias: b.as_deref() })
                    .collect();
                qmv_many_on(isa, &x, &mut parts);
                for (((w, _), y), b) in mats.iter().zip(alone.iter_mut()).zip(&biases) {
                    qmv_on(isa, &x, w, y);
                    if let Some(b) = b {
                        for (v, &bv) in y.iter_mut().zip(b) {
                            *v += bv;
                        }
                    }
                }
            });
            for (p, (f, a)) in fused.iter().zip(&alone).enumerate() {
                let bad = f.iter().zip(a).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
                assert_eq!(
                    bad,
                    0,
                    "{what}, part {p}, {} at {threads} threads: {bad} outputs differ",
                    isa.as_str()
                );
            }
        }
    }
}

#[test]
fn qmv_many_matches_one_qmv_per_matrix() {
    let mut rng = Rng(12);
    for (bits, group, dtype) in
        [(4, 32, ScaleDtype::F16), (4, 64, ScaleDtype::Bf16), (8, 64, ScaleDtype::F32)]
    {
        let qkv = [
            (matrix(&mut rng, 576, 576, bits, group, dtype), true),
            (matrix(&mut rng, 192, 576, bits, group, dtype), true),
            (matrix(&mut rng, 192, 576, bits, group, dtype), false),
        ];
        check(&format!("q|k|v {bits}-bit g{group}"), &qkv, &mut rng);
        let gate_up = [
            (matrix(&mut rng, 1536, 576, bits, group, dtype), false),
            (matrix(&mut rng, 1536, 576, bits, group, dtype), false),
        ];
        check(&format!("gate|up {bits}-bit g{group}"), &gate_up, &mut rng);
        let one = [(matrix(&mut rng, 37, 128, bits, group, dtype), true)];
        check(&format!("one small matrix {bits}-bit g{group}"), &one, &mut rng);
    }
}

#[test]
fn parts_of_different_geometry_still_match() {
    let mut rng = Rng(13);
    let mixed = [
        (matrix(&mut rng, 64, 256, 4, 32, ScaleDtype::F16), true),
        (matrix(&mut rng, 96, 256, 4, 64, ScaleDtype::F16), false),
        (matrix(&mut rng, 40, 256, 8, 64, ScaleDtype::F16), true),
        (matrix(&mut rng, 24, 256, 3, 64, ScaleDtype::F16), true),
    ];
    check("mixed widths and groups", &mixed, &mut rng);
}

#[test]
#[should_panic(expected = "qmv_many: the bias must hold N = 8 values")]
fn a_short_bias_is_refused() {
    let mut rng = Rng(14);
    let w = matrix(&mut rng, 8, 64, 4, 64, ScaleDtype::F16);
    let (x, mut y, b) = (vec![0.0; 64], vec![0.0; 8], vec![0.0; 7]);
    qmv_many_on(Isa::Portable, &x, &mut [QmvPart { w: &w, y: &mut y, bias: Some(&b) }]);
}
