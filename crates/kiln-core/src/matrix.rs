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

/// Rows per block of the [`Layout::LaneRows`] layout: one per 32-bit lane of a 512-bit
/// register.
pub const LANE_ROWS: usize = 16;

/// How a matrix's packed words, scales and biases are ordered in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Row by row, as checkpoints store them: row `r`'s words, then row `r + 1`'s.
    RowMajor,
    /// Blocks of [`LANE_ROWS`] rows, each block's values column by column: word `j` of
    /// the block's 16 rows side by side, then word `j + 1`'s (and likewise group `g`'s
    /// scale, and bias, of the 16 rows). A block occupies the bytes it does row-major,
    /// transposed within. The AVX-512 lane-row kernel reads it as stored, one 64-byte
    /// load per word of 16 rows, where from row-major bytes it transposes every block in
    /// registers for each product (see [`QuantizedMatrix::into_lane_rows`]). Only 4-bit
    /// matrices whose N is a multiple of 16 and K of 64 take it.
    LaneRows,
}

/// The environment variable choosing how the CPU backend stores its weights.
pub const WEIGHT_LAYOUT_ENV: &str = "KILN_WEIGHT_LAYOUT";

/// What `KILN_WEIGHT_LAYOUT` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutSetting {
    /// The default (unset or empty): [`Layout::LaneRows`] for every matrix that fits where
    /// the CPU's kernels read that layout (`kernels::lane_rows_preferred`), row-major
    /// elsewhere.
    Auto,
    /// Every matrix as the checkpoint stores it (the layout before the lane-row one, kept
    /// to measure one against the other).
    RowMajor,
}

impl LayoutSetting {
    /// Accepted values, for messages.
    pub const ACCEPTED: &'static str = "auto, row-major";

    /// Parses a `KILN_WEIGHT_LAYOUT` value (surrounding spaces and case ignored; empty is
    /// the default).
    pub fn parse(value: &str) -> Result<LayoutSetting, String> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(LayoutSetting::Auto),
            "row-major" => Ok(LayoutSetting::RowMajor),
            other => {
                Err(format!("invalid {WEIGHT_LAYOUT_ENV} {other:?}: accepted values are {}", Self::ACCEPTED))
            }
        }
    }

    /// The setting `KILN_WEIGHT_LAYOUT` asks for, or the error naming a bad value.
    pub fn from_env() -> Result<LayoutSetting, String> {
        Self::parse(&crate::env::setting_env(WEIGHT_LAYOUT_ENV, Self::ACCEPTED)?)
    }
}

/// A quantized `W[N, K]` (N output features, K input features), validated on creation.
#[derive(Debug)]
pub struct QuantizedMatrix {
    n: usize,
    k: usize,
    spec: QuantSpec,
    layout: Layout,
    packed: Buffer<u32>,
    scales: ScaleData,
    biases: ScaleData,
}

/// Each block of `LANE_ROWS * per_row` values, row-major, transposed to column-major
/// (`inverse`: back). `data` holds whole blocks.
fn transpose_blocks<T: Copy + Default>(data: &mut [T], per_row: usize, inverse: bool) {
    let block = LANE_ROWS * per_row;
    assert!(data.len().is_multiple_of(block.max(1)));
    let mut tmp = vec![T::default(); block];
    for b in data.chunks_exact_mut(block.max(1)) {
        tmp.copy_from_slice(b);
        for r in 0..LANE_ROWS {
            for j in 0..per_row {
                let (rm, cm) = (r * per_row + j, j * LANE_ROWS + r);
                if inverse {
                    b[rm] = tmp[cm];
                } else {
                    b[cm] = tmp[rm];
                }
            }
        }
    }
}

/// Reorders one row-major tensor of whole blocks of 16 rows, `per_row` values a row (a
/// matrix's packed words, or its scales or biases), into [`Layout::LaneRows`] in place:
/// for a maker that writes a matrix's bytes itself and then builds it with
/// [`QuantizedMatrix::stored_as_lane_rows`].
pub fn lane_rows_in_place<T: Copy + Default>(data: &mut [T], per_row: usize) {
    transpose_blocks(data, per_row, false);
}

impl ScaleData {
    /// [`transpose_blocks`] on the values; `false` (nothing done) when they are a view of
    /// shared bytes.
    fn transpose_blocks(&mut self, per_row: usize, inverse: bool) -> bool {
        match self {
            ScaleData::F16(b) => b.owned_mut().map(|v| transpose_blocks(v, per_row, inverse)).is_some(),
            ScaleData::Bf16(b) => b.owned_mut().map(|v| transpose_blocks(v, per_row, inverse)).is_some(),
            ScaleData::F32(b) => b.owned_mut().map(|v| transpose_blocks(v, per_row, inverse)).is_some(),
        }
    }

    fn is_shared(&self) -> bool {
        match self {
            ScaleData::F16(b) => b.is_shared(),
            ScaleData::Bf16(b) => b.is_shared(),
            ScaleData::F32(b) => b.is_shared(),
        }
    }

    /// An owned copy.
    fn copied(&self) -> ScaleData {
        match self {
            ScaleData::F16(b) => ScaleData::F16(b.to_vec().into()),
            ScaleData::Bf16(b) => ScaleData::Bf16(b.to_vec().into()),
            ScaleData::F32(b) => ScaleData::F32(b.to_vec().into()),
        }
    }
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
        Ok(QuantizedMatrix { n, k, spec, layout: Layout::RowMajor, packed, scales, biases })
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

    /// How the packed words, scales and biases are ordered.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Whether a `bits`-bit `[n, k]` matrix can be stored in [`Layout::LaneRows`]: 4-bit
    /// codes, N a multiple of 16 and K of 64.
    pub fn lane_rows_geometry(n: usize, k: usize, bits: u32) -> bool {
        bits == 4 && n.is_multiple_of(LANE_ROWS) && k.is_multiple_of(64)
    }

    /// This matrix, built from values its maker already stored in [`Layout::LaneRows`]
    /// ([`lane_rows_in_place`] on each row-major tensor), marked so; `None` where the
    /// geometry has no such layout ([`Self::lane_rows_geometry`]).
    pub fn stored_as_lane_rows(self) -> Option<QuantizedMatrix> {
        Self::lane_rows_geometry(self.n, self.k, self.spec.bits())
            .then_some(QuantizedMatrix { layout: Layout::LaneRows, ..self })
    }

    /// Whether [`Self::into_lane_rows`] can reorder this matrix: 4-bit codes, N a multiple
    /// of 16 and K of 64, its three tensors owned rather than views of shared bytes.
    pub fn fits_lane_rows(&self) -> bool {
        Self::lane_rows_geometry(self.n, self.k, self.spec.bits())
            && !self.packed.is_shared()
            && !self.scales.is_shared()
            && !self.biases.is_shared()
    }

    /// Reorders the matrix in place into [`Layout::LaneRows`] (no second copy: one block's
    /// worth of scratch). Returns whether it is now in that layout; a matrix that does not
    /// [fit](Self::fits_lane_rows) is left as it is.
    pub fn into_lane_rows(&mut self) -> bool {
        if self.layout == Layout::LaneRows {
            return true;
        }
        if !self.fits_lane_rows() {
            return false;
        }
        let (wpr, gpr) = (self.spec.words_per_row(self.k), self.spec.groups_per_row(self.k));
        let packed = self.packed.owned_mut().expect("owned: checked by fits_lane_rows");
        transpose_blocks(packed, wpr, false);
        assert!(self.scales.transpose_blocks(gpr, false) && self.biases.transpose_blocks(gpr, false));
        self.layout = Layout::LaneRows;
        true
    }

    /// An owned row-major copy (of a matrix in any layout): for the paths that read rows.
    pub fn to_row_major(&self) -> QuantizedMatrix {
        let (wpr, gpr) = (self.spec.words_per_row(self.k), self.spec.groups_per_row(self.k));
        let mut packed = self.packed.to_vec();
        let (mut scales, mut biases) = (self.scales.copied(), self.biases.copied());
        if self.layout == Layout::LaneRows {
            transpose_blocks(&mut packed, wpr, true);
            assert!(scales.transpose_blocks(gpr, true) && biases.transpose_blocks(gpr, true));
        }
        QuantizedMatrix { layout: Layout::RowMajor, packed: packed.into(), scales, biases, ..*self }
    }

    /// All packed words, in the matrix's [`Layout`].
    pub fn packed(&self) -> &[u32] {
        &self.packed
    }

    /// The packed words of row `r`.
    ///
    /// # Panics
    /// When the matrix is not row-major (its rows are not contiguous): use
    /// [`Self::to_row_major`] or [`Self::dequantize_row`].
    pub fn row_words(&self, r: usize) -> &[u32] {
        assert_eq!(self.layout, Layout::RowMajor, "row_words of a {:?} matrix", self.layout);
        let w = self.spec.words_per_row(self.k);
        &self.packed[r * w..(r + 1) * w]
    }

    /// Index of row `r`'s group `g` in [`Self::scales`] and [`Self::biases`].
    pub fn group_index(&self, r: usize, g: usize) -> usize {
        let gpr = self.spec.groups_per_row(self.k);
        match self.layout {
            Layout::RowMajor => r * gpr + g,
            Layout::LaneRows => (r / LANE_ROWS * gpr + g) * LANE_ROWS + r % LANE_ROWS,
        }
    }

    /// Per-group scales, `N * K / group_size` in the matrix's [`Layout`] (row-major
    /// `[n, k / group_size]`; see [`Self::group_index`]).
    pub fn scales(&self) -> &ScaleData {
        &self.scales
    }

    /// Per-group biases, ordered as [`Self::scales`].
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
        let gathered: Vec<u32>;
        let words = match self.layout {
            Layout::RowMajor => self.row_words(r),
            Layout::LaneRows => {
                let wpr = self.spec.words_per_row(self.k);
                let base = r / LANE_ROWS * LANE_ROWS * wpr + r % LANE_ROWS;
                gathered = (0..wpr).map(|j| self.packed[base + j * LANE_ROWS]).collect();
                &gathered
            }
        };
        let g = self.spec.group_size();
        let bits = self.spec.bits();
        for (gi, chunk) in out.chunks_exact_mut(g).enumerate() {
            let at = self.group_index(r, gi);
            let (s, b) = (self.scales.get(at), self.biases.get(at));
            for (j, o) in chunk.iter_mut().enumerate() {
                let q = read_code(words, gi * g + j, bits) as f32;
                *o = s * q + b;
            }
        }
    }
}

#[cfg(test)]
mod layout_tests {
    use super::*;

    #[test]
    fn the_layout_setting_parses_and_names_bad_values() {
        assert_eq!(LayoutSetting::parse(""), Ok(LayoutSetting::Auto));
        assert_eq!(LayoutSetting::parse(" Auto "), Ok(LayoutSetting::Auto));
        assert_eq!(LayoutSetting::parse("ROW-MAJOR"), Ok(LayoutSetting::RowMajor));
        let e = LayoutSetting::parse("lanes").unwrap_err();
        assert!(e.contains(WEIGHT_LAYOUT_ENV) && e.contains("\"lanes\"") && e.contains("row-major"), "{e}");
    }
}
