//! kiln's quantizer, dequantizer and reference kernels against fixtures produced by
//! `mlx.core` (see scripts/fixtures/make_quant_fixtures.py for versions and inputs).

use std::path::{Path, PathBuf};

use kiln_core::format::read_code;
use kiln_core::kernels::reference;
use kiln_core::matrix::{QuantizedMatrix, ScaleDtype};
use kiln_core::quantize::quantize_as;
use kiln_core::{Buffer, QuantSpec, ScaleData};
use safetensors::SafeTensors;

struct Fixture {
    name: String,
    spec: QuantSpec,
    dtype: ScaleDtype,
    n: usize,
    k: usize,
    m: usize,
    w: Vec<f32>,
    x: Vec<f32>,
    packed: Vec<u32>,
    scales: Vec<f32>,
    biases: Vec<f32>,
    dequantized: Vec<f32>,
    y: Vec<f32>,
}

fn fixtures() -> Vec<Fixture> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quantize");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    paths.sort();
    assert_eq!(paths.len(), 30, "expected 18 f32 + 6 f16 + 6 bf16 fixtures in {}", dir.display());
    paths.iter().map(|p| load(p)).collect()
}

fn load(path: &Path) -> Fixture {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |name: &str| -> (Vec<f32>, Vec<usize>) {
        let t = st.tensor(name).unwrap();
        assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
        (bytemuck_cast(t.data()), t.shape().to_vec())
    };
    let (w, wshape) = f32s("w");
    let (x, xshape) = f32s("x");
    let packed_t = st.tensor("packed").unwrap();
    assert_eq!(packed_t.dtype(), safetensors::Dtype::U32);
    let packed: Vec<u32> =
        packed_t.data().chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
    let bits: u32 = meta["bits"].parse().unwrap();
    let g: usize = meta["group_size"].parse().unwrap();
    let dtype = match meta["dtype"].as_str() {
        "f32" => ScaleDtype::F32,
        "f16" => ScaleDtype::F16,
        "bf16" => ScaleDtype::Bf16,
        other => panic!("unknown dtype {other}"),
    };
    Fixture {
        name: path.file_stem().unwrap().to_string_lossy().into_owned(),
        spec: QuantSpec::new(bits, g).unwrap(),
        dtype,
        n: wshape[0],
        k: wshape[1],
        m: xshape[0],
        w,
        x,
        packed,
        scales: f32s("scales").0,
        biases: f32s("biases").0,
        dequantized: f32s("dequantized").0,
        y: f32s("y").0,
    }
}

fn bytemuck_cast(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn mlx_matrix(f: &Fixture) -> QuantizedMatrix {
    QuantizedMatrix::new(
        f.n,
        f.k,
        f.spec,
        Buffer::from_vec(f.packed.clone()),
        ScaleData::from_f32(&f.scales, f.dtype),
        ScaleData::from_f32(&f.biases, f.dtype),
    )
    .unwrap()
}

#[test]
fn quantize_reproduces_mlx_bit_for_bit() {
    for f in fixtures() {
        let q = quantize_as(&f.w, f.n, f.k, f.spec, f.dtype).unwrap();
        let ours = q.packed();
        let mismatch = ours.iter().zip(&f.packed).position(|(a, b)| a != b);
        assert!(
            mismatch.is_none(),
            "{}: packed word {} differs: {:#x} vs mlx {:#x}",
            f.name,
            mismatch.unwrap(),
            ours[mismatch.unwrap()],
            f.packed[mismatch.unwrap()]
        );
        for i in 0..f.scales.len() {
            assert_eq!(q.scales().get(i).to_bits(), f.scales[i].to_bits(), "{}: scale {i}", f.name);
            assert_eq!(q.biases().get(i).to_bits(), f.biases[i].to_bits(), "{}: bias {i}", f.name);
        }
    }
}

#[test]
fn dequantize_matches_mlx() {
    for f in fixtures() {
        let q = mlx_matrix(&f);
        let ours = reference::dequantize(&q);
        let g = f.spec.group_size();
        for (i, (&a, &b)) in ours.iter().zip(&f.dequantized).enumerate() {
            let (r, j) = (i / f.k, i % f.k);
            let gi = r * (f.k / g) + j / g;
            let code = read_code(q.row_words(r), j, f.spec.bits()) as f32;
            let (s, bias) = (f.scales[gi], f.biases[gi]);
            match f.dtype {
                // mlx computes in f32 too; allow for a fused multiply-add on its side.
                ScaleDtype::F32 => {
                    let tol = b.abs().max(bias.abs()) * f32::EPSILON;
                    assert!((a - b).abs() <= tol, "{}: element {i}: {a} vs mlx {b}", f.name);
                }
                // mlx computes `scale * q + bias` in the input dtype, rounding after each
                // operation; kiln widens to f32 and rounds once. Emulating mlx's two
                // roundings must reproduce it exactly.
                ScaleDtype::F16 => {
                    let p = half::f16::from_f32(s * code).to_f32();
                    let e = half::f16::from_f32(p + bias).to_f32();
                    assert_eq!(e.to_bits(), b.to_bits(), "{}: element {i}", f.name);
                    assert_eq!(a, s * code + bias);
                }
                ScaleDtype::Bf16 => {
                    let p = half::bf16::from_f32(s * code).to_f32();
                    let e = half::bf16::from_f32(p + bias).to_f32();
                    assert_eq!(e.to_bits(), b.to_bits(), "{}: element {i}", f.name);
                    assert_eq!(a, s * code + bias);
                }
            }
        }
    }
}

#[test]
fn reference_kernels_match_mlx_quantized_matmul() {
    for f in fixtures().into_iter().filter(|f| f.dtype == ScaleDtype::F32) {
        let q = mlx_matrix(&f);
        let exact = reference::matmul_f64(&f.x, f.m, &q);
        let mut y = vec![0f32; f.m * f.n];
        reference::qmm(&f.x, f.m, &q, &mut y);
        for i in 0..y.len() {
            // Both are f32 sums of K products; each is within K * eps * sum|w x| of the
            // exact value, so they are within twice that of each other.
            let row = i / f.n;
            let col = i % f.n;
            let wd = reference::dequantize(&q);
            let mag: f64 =
                (0..f.k).map(|j| (wd[col * f.k + j] as f64 * f.x[row * f.k + j] as f64).abs()).sum();
            let tol = 2.0 * f.k as f64 * f32::EPSILON as f64 * mag;
            assert!(
                (y[i] as f64 - f.y[i] as f64).abs() <= tol,
                "{}: y[{i}] {} vs mlx {}",
                f.name,
                y[i],
                f.y[i]
            );
            assert!(
                (exact[i] - f.y[i] as f64).abs() <= tol,
                "{}: exact {} vs mlx {}",
                f.name,
                exact[i],
                f.y[i]
            );
        }
    }
}
