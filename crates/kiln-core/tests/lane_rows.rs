//! Matrices stored in `Layout::LaneRows` (blocks of 16 rows transposed within): the
//! reordering and its inverse lose nothing, a matrix that does not fit is left alone, and
//! every product of one (`qmv`, `qmv_wide`, `qmm`, `qmv_many`, on every ISA path this CPU
//! runs: the lane-row kernel reads it as stored on AVX-512, the other paths a row-major
//! copy) has the bits of the same product of the row-major matrix, which are
//! `reference::qmv_int`'s.

mod common;

use std::sync::Arc;

use kiln_core::act_precision::ActScheme;
use kiln_core::format::QuantSpec;
use kiln_core::kernels::{
    Isa, QmvPart, qmm_scheme_on, qmm_sgemm, qmv_many_on, qmv_on, qmv_scheme_on, qmv_wide_scheme_on, reference,
};
use kiln_core::matrix::{LANE_ROWS, Layout, QuantizedMatrix, ScaleData, ScaleDtype};
use kiln_core::quantize::quantize_as;
use kiln_core::{Buffer, SharedBytes};

use common::Rng;

fn matrix(rng: &mut Rng, n: usize, k: usize, bits: u32, group: usize, dtype: ScaleDtype) -> QuantizedMatrix {
    let w: Vec<f32> = (0..n * k).map(|_| rng.sym(0.5)).collect();
    quantize_as(&w, n, k, QuantSpec::new(bits, group).unwrap(), dtype).unwrap()
}

fn lane_rows(w: &QuantizedMatrix) -> QuantizedMatrix {
    let mut l = w.to_row_major();
    assert!(l.into_lane_rows(), "{}x{} {} should fit", w.n(), w.k(), w.spec());
    assert_eq!(l.layout(), Layout::LaneRows);
    l
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
}

fn scale_values(s: &ScaleData) -> Vec<f32> {
    (0..s.len()).map(|i| s.get(i)).collect()
}

#[test]
fn the_layout_is_a_transpose_within_blocks_and_comes_back_whole() {
    let mut rng = Rng(7);
    for (g, dtype) in [(32, ScaleDtype::F16), (64, ScaleDtype::Bf16), (128, ScaleDtype::F32)] {
        let (n, k) = (48, 384);
        let w = matrix(&mut rng, n, k, 4, g, dtype);
        let l = lane_rows(&w);
        let wpr = k / 8;
        // Word j of row r sits at block * 16 * wpr + j * 16 + r % 16.
        for r in [0, 5, 15, 16, 31, 47] {
            for j in [0, 1, wpr - 1] {
                let at = r / LANE_ROWS * LANE_ROWS * wpr + j * LANE_ROWS + r % LANE_ROWS;
                assert_eq!(l.packed()[at], w.row_words(r)[j], "row {r} word {j}");
            }
            for gi in 0..k / g {
                assert_eq!(l.scales().get(l.group_index(r, gi)), w.scales().get(w.group_index(r, gi)));
                assert_eq!(l.biases().get(l.group_index(r, gi)), w.biases().get(w.group_index(r, gi)));
            }
            let (mut a, mut b) = (vec![0f32; k], vec![0f32; k]);
            w.dequantize_row(r, &mut a);
            l.dequantize_row(r, &mut b);
            assert!(same_bits(&a, &b), "row {r} dequantizes differently");
        }
        let back = l.to_row_major();
        assert_eq!(back.layout(), Layout::RowMajor);
        assert_eq!(back.packed(), w.packed());
        assert!(same_bits(&scale_values(back.scales()), &scale_values(w.scales())));
        assert!(same_bits(&scale_values(back.biases()), &scale_values(w.biases())));
        // Converting twice is converting once.
        let mut twice = lane_rows(&w);
        assert!(twice.into_lane_rows());
        assert_eq!(twice.packed(), l.packed());
    }
}

#[test]
fn matrices_that_do_not_fit_stay_row_major() {
    let mut rng = Rng(8);
    // 8-bit codes; N not a multiple of 16; K not a multiple of 64.
    for (n, k, bits, g) in [(32, 128, 8, 32), (37, 128, 4, 32), (40, 128, 4, 64), (32, 96, 4, 32)] {
        let mut w = matrix(&mut rng, n, k, bits, g, ScaleDtype::F16);
        let before = w.packed().to_vec();
        assert!(!w.fits_lane_rows() && !w.into_lane_rows(), "{n}x{k} {bits}-bit g{g}");
        assert_eq!(w.layout(), Layout::RowMajor);
        assert_eq!(w.packed(), &before[..]);
    }
    // Packed words viewed in shared bytes (a memory-mapped checkpoint) are read-only.
    let w = matrix(&mut rng, 32, 128, 4, 32, ScaleDtype::F16);
    let bytes: Arc<dyn SharedBytes> = Arc::new(bytemuck::cast_slice::<u32, u8>(w.packed()).to_vec());
    let len = bytes.bytes().len();
    let packed = Buffer::<u32>::from_shared(bytes, 0, len, None).unwrap();
    let scales = ScaleData::from_f32(&scale_values(w.scales()), ScaleDtype::F16);
    let biases = ScaleData::from_f32(&scale_values(w.biases()), ScaleDtype::F16);
    let mut shared = QuantizedMatrix::new(32, 128, w.spec(), packed, scales, biases).unwrap();
    assert!(!shared.into_lane_rows());
    assert_eq!(shared.layout(), Layout::RowMajor);
}

/// Every product of a lane-row matrix against the row-major one and the definition.
#[test]
fn products_of_lane_row_matrices_have_the_row_major_bits() {
    let mut rng = Rng(9);
    let quick = std::env::var_os("KILN_QUICK_KERNEL_TESTS").is_some_and(|v| v == "1");
    let ms: &[usize] = if quick { &[1, 2, 17] } else { &[1, 2, 3, 8, 9, 16, 17, 40] };
    for (g, k) in [(32, 64), (32, 320), (64, 192), (128, 384)] {
        for dtype in [ScaleDtype::F16, ScaleDtype::Bf16, ScaleDtype::F32] {
            let n = 48;
            let w = matrix(&mut rng, n, k, 4, g, dtype);
            let l = lane_rows(&w);
            for &m in ms {
                let x: Vec<f32> = (0..m * k).map(|_| rng.sym(2.0)).collect();
                // The f32 sgemm path dequantizes rows.
                let (mut a, mut b) = (vec![0f32; m * n], vec![f32::NAN; m * n]);
                qmm_sgemm(&x, m, &w, &mut a);
                qmm_sgemm(&x, m, &l, &mut b);
                assert!(same_bits(&a, &b), "qmm_sgemm (g{g} {} k {k} m {m})", dtype.as_str());
                for act in [ActScheme::Int16, ActScheme::Int8, ActScheme::Int16Wide8] {
                    let what = |kernel: &str, isa: Isa| {
                        format!(
                            "{kernel} on {} (g{g} {} k {k} m {m} {})",
                            isa.as_str(),
                            dtype.as_str(),
                            act.as_str()
                        )
                    };
                    let one_row = reference::qmv_int(&x, m, &w, act).unwrap();
                    let wide = reference::qmv_wide_int(&x, m, &w, act).unwrap();
                    for isa in Isa::available() {
                        let mut y = vec![f32::NAN; m * n];
                        for (xr, yr) in x.chunks_exact(k).zip(y.chunks_exact_mut(n)) {
                            qmv_scheme_on(isa, act, xr, &l, yr);
                        }
                        assert!(same_bits(&y, &one_row), "{}", what("qmv per row", isa));
                        let mut y = vec![f32::NAN; m * n];
                        qmv_wide_scheme_on(isa, act, &x, m, &l, &mut y);
                        assert!(same_bits(&y, &wide), "{}", what("qmv_wide", isa));
                        let mut y = vec![f32::NAN; m * n];
                        qmm_scheme_on(isa, act, &x, m, &l, &mut y);
                        assert!(same_bits(&y, &one_row), "{}", what("qmm", isa));
                    }
                }
            }
        }
    }
}

/// `qmv_many` over lane-row parts (a decode step's q|k|v of smollm-135m, and a mix of
/// layouts) against one `qmv` per row-major part plus its bias, at one to three threads.
#[test]
fn qmv_many_of_lane_row_parts_has_the_bits_of_qmv_per_part() {
    let mut rng = Rng(10);
    let k = 576;
    let row_major: Vec<QuantizedMatrix> =
        [576, 192, 192].iter().map(|&n| matrix(&mut rng, n, k, 4, 64, ScaleDtype::F16)).collect();
    let all: Vec<QuantizedMatrix> = row_major.iter().map(lane_rows).collect();
    let mixed: Vec<QuantizedMatrix> = row_major
        .iter()
        .enumerate()
        .map(|(i, w)| if i == 1 { w.to_row_major() } else { lane_rows(w) })
        .collect();
    let x: Vec<f32> = (0..k).map(|_| rng.sym(2.0)).collect();
    let biases: Vec<Vec<f32>> =
        row_major.iter().map(|w| (0..w.n()).map(|_| rng.sym(1.0)).collect()).collect();
    for isa in Isa::available() {
        let expected: Vec<Vec<f32>> = row_major
            .iter()
            .zip(&biases)
            .map(|(w, b)| {
                let mut y = vec![0f32; w.n()];
                qmv_on(isa, &x, w, &mut y);
                y.iter_mut().zip(b).for_each(|(v, bv)| *v += bv);
                y
            })
            .collect();
        for (name, mats) in [("lane-row parts", &all), ("mixed layouts", &mixed)] {
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                let mut ys: Vec<Vec<f32>> = mats.iter().map(|w| vec![f32::NAN; w.n()]).collect();
                pool.install(|| {
                    let mut parts: Vec<QmvPart<'_>> = mats
                        .iter()
                        .zip(ys.iter_mut())
                        .zip(&biases)
                        .map(|((w, y), b)| QmvPart { w, y, bias: Some(b) })
                        .collect();
                    qmv_many_on(isa, &x, &mut parts);
                });
                for (p, (y, e)) in ys.iter().zip(&expected).enumerate() {
                    assert!(same_bits(y, e), "{name}, part {p}, {} at {threads} threads", isa.as_str());
                }
            }
        }
    }
}
