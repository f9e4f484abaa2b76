//! [`QuantizedMatrix`]: a validated `W[N, K]` in the MLX affine format, holding packed
//! codes and per-group scales and biases in the dtype the checkpoint stored them in.

use half::{bf16, f16};

use crate::buffer::Buffer;
use crate::format::{GeometryError, QuantSpec, read_code, validate_geometry};

/// Dtype of a matrix's scales and biases.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScaleDtype {
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
    /// IEEE single precision.
    F32,
}

impl ScaleDtype {
    /// The dtype's name as safetensors writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            ScaleDtype::F16 => "F16",
            ScaleDtype::Bf16 => "BF16",
            ScaleDtype::F32 => "F32",
        }
    }

    /// Bytes per value.
    pub fn size(self) -> usize {
        match self {
            ScaleDtype::F16 | ScaleDtype::Bf16 => 2,
            ScaleDtype::F32 => 4,
        }
    }
}

/// Per-group scales or biases, stored as the checkpoint had them.
#[derive(Debug)]
pub enum ScaleData {
    /// Half precision.
    F16(Buffer<f16>),
    /// bfloat16.
    Bf16(Buffer<bf16>),
    /// Single precision.
    F32(Buffer<f32>),
}

impl ScaleData {
    /// The storage dtype.
    pub fn dtype(&self) -> ScaleDtype {
        match self {
            ScaleData::F16(_) => ScaleDtype::F16,
            ScaleData::Bf16(_) => ScaleDtype::Bf16,
            ScaleData::F32(_) => ScaleDtype::F32,
        }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            ScaleData::F16(b) => b.len(),
            ScaleData::Bf16(b) => b.len(),
            ScaleData::F32(b) => b.len(),
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of storage.
    pub fn byte_len(&self) -> usize {
        self.len() * self.dtype().size()
    }

    /// Value `i`, widened to f32 (exact for every storage dtype).
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            ScaleData::F16(b) => b[i].to_f32(),
            ScaleData::Bf16(b) => b[i].to_f32(),
            ScaleData::F32(b) => b[i],
        }
    }

    /// Stores f32 values as `dtype`, rounding to nearest even.
    pub fn from_f32(values: &[f32], dtype: ScaleDtype) -> Self {
        match dtype {
            ScaleDtype::F16 => {
                ScaleData::F16(values.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>().into())
            }
            ScaleDtype::Bf16 => {
                ScaleData::Bf16(values.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>().into())
            }
            ScaleDtype::F32 => ScaleData::F32(values.to_vec().into()),
        }
    }
}

/// A quantized `W[N, K]` (N output features, K input features), validated on creation.
#[derive(Debug)]
pub struct QuantizedMatrix {
    n: usize,
    k: usize,
    spec: QuantSpec,
    packed: Buffer<u32>,
    scales: ScaleData,
    biases: ScaleData,
}

impl QuantizedMatrix {
    /// Assembles a matrix from its three tensors, checking every length against the
    /// geometry: packed `[n, k * bits / 32]`, scales and biases `[n, k / group_size]`.
    pub fn new(
        n: usize,
        k: usize,
        spec: QuantSpec,
        packed: Buffer<u32>,
        scales: ScaleData,
        biases: ScaleData,
    ) -> Result<Self, GeometryError> {
        validate_geometry(n, k, spec)?;
        let words = n * spec.words_per_row(k);
        if packed.len() != words {
            return Err(GeometryError::WrongLength {
                what: "packed weights",
                spec,
                n,
                k,
                got: packed.len(),
                expected: words,
                rule: "N * K * bits / 32 u32 words",
            });
        }
        let groups = n * spec.groups_per_row(k);
        for (what, t) in [("scales", &scales), ("biases", &biases)] {
            if t.len() != groups {
                return Err(GeometryError::WrongLength {
                    what,
                    spec,
                    n,
                    k,
                    got: t.len(),
                    expected: groups,
                    rule: "one per group: N * K / group_size",
                });
            }
        }
        if scales.dtype() != biases.dtype() {
            return Err(GeometryError::ScaleDtypeMismatch {
                scales: scales.dtype().as_str(),
                biases: biases.dtype().as_str(),
            });
        }
        Ok(QuantizedMatrix { n, k, spec, packed, scales, biases })
    }

    /// Output features (rows).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Input features (columns).
    pub fn k(&self) -> usize {
        self.k
    }

    /// Width and group size.
    pub fn spec(&self) -> QuantSpec {
        self.spec
    }

    /// All packed words, row-major.
    pub fn packed(&self) -> &[u32] {
        &self.packed
    }

    /// The packed words of row `r`.
    pub fn row_words(&self, r: usize) -> &[u32] {
        let w = self.spec.words_per_row(self.k);
        &self.packed[r * w..(r + 1) * w]
    }

    /// Per-group scales, row-major `[n, k / group_size]`.
    pub fn scales(&self) -> &ScaleData {
        &self.scales
    }

    /// Per-group biases, row-major `[n, k / group_size]`.
    pub fn biases(&self) -> &ScaleData {
        &self.biases
    }

    /// Bytes a full pass over the matrix reads: packed codes, scales and biases.
    pub fn bytes_read(&self) -> usize {
        self.packed.len() * 4 + self.scales.byte_len() + self.biases.byte_len()
    }

    /// Dequantizes row `r` into `out` (length K), exactly as the format defines:
    /// `scale * q + bias` in f32, rounded after the product and after the sum.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.k, "dequantize_row: output length must equal K");
        let words = self.row_words(r);
        let g = self.spec.group_size();
        let gpr = self.spec.groups_per_row(self.k);
        let bits = self.spec.bits();
        for (gi, chunk) in out.chunks_exact_mut(g).enumerate() {
            let s = self.scales.get(r * gpr + gi);
            let b = self.biases.get(r * gpr + gi);
            for (j, o) in chunk.iter_mut().enumerate() {
                let q = read_code(words, gi * g + j, bits) as f32;
                *o = s * q + b;
            }
        }
    }
}
