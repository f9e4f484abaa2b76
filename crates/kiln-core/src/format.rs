//! The MLX affine quantization format: which widths and group sizes exist, the shape
//! rules a quantized matrix must obey, and the little-endian bit stream the codes live in.
//!
//! For a row of `W[N, K]`, each group of `group_size` consecutive elements has one scale
//! and one bias, and `w = scale * q + bias` with `q` unsigned in `[0, 2^bits - 1]`. A row's
//! codes are one little-endian bit stream stored in `u32` words: element 0 occupies the
//! low bits of word 0, and 3-, 5- and 6-bit codes straddle word boundaries. This matches
//! `mlx.core.quantize` bit for bit, so mlx-community checkpoints load unchanged.

use std::fmt;

/// Quantization widths the format defines.
pub const SUPPORTED_BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];
/// Group sizes the format defines.
pub const SUPPORTED_GROUP_SIZES: [usize; 3] = [32, 64, 128];

/// A quantization width and group size that passed validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct QuantSpec {
    bits: u32,
    group_size: usize,
}

impl QuantSpec {
    /// Validates `bits` and `group_size` against the format.
    pub fn new(bits: u32, group_size: usize) -> Result<Self, GeometryError> {
        if !SUPPORTED_BITS.contains(&bits) {
            return Err(GeometryError::UnsupportedBits { bits });
        }
        if !SUPPORTED_GROUP_SIZES.contains(&group_size) {
            return Err(GeometryError::UnsupportedGroupSize { group_size });
        }
        Ok(QuantSpec { bits, group_size })
    }

    /// Bits per code.
    pub fn bits(self) -> u32 {
        self.bits
    }

    /// Elements sharing one scale and one bias.
    pub fn group_size(self) -> usize {
        self.group_size
    }

    /// The largest code, `2^bits - 1`.
    pub fn max_code(self) -> u32 {
        (1u32 << self.bits) - 1
    }

    /// `u32` words holding one row of `k` codes.
    pub fn words_per_row(self, k: usize) -> usize {
        k * self.bits as usize / 32
    }

    /// Groups (scale/bias pairs) in one row of `k` elements.
    pub fn groups_per_row(self, k: usize) -> usize {
        k / self.group_size
    }
}

impl fmt::Display for QuantSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-bit g{}", self.bits, self.group_size)
    }
}

/// Why a quantized geometry was refused. Each message names the shape and the rule.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    /// The width is not one the format defines.
    #[error("unsupported quantization bits {bits}: accepted values are 2, 3, 4, 5, 6, 8")]
    UnsupportedBits {
        /// The refused width.
        bits: u32,
    },
    /// The group size is not one the format defines.
    #[error("unsupported quantization group size {group_size}: accepted values are 32, 64, 128")]
    UnsupportedGroupSize {
        /// The refused group size.
        group_size: usize,
    },
    /// A dimension is zero.
    #[error("matrix [{n}, {k}] is empty: both dimensions must be at least 1")]
    Empty {
        /// Output features.
        n: usize,
        /// Input features.
        k: usize,
    },
    /// K is not a whole number of groups.
    #[error(
        "matrix [{n}, {k}] cannot be quantized with group size {group_size}: \
         K = {k} must be a multiple of the group size"
    )]
    KNotMultipleOfGroup {
        /// Output features.
        n: usize,
        /// Input features.
        k: usize,
        /// The group size in use.
        group_size: usize,
    },
    /// A tensor of the quantized triple has the wrong number of elements.
    #[error(
        "{what} of a {spec} matrix [{n}, {k}] has {got} elements, expected {expected} \
         ({rule})"
    )]
    WrongLength {
        /// Which tensor: "packed weights", "scales" or "biases".
        what: &'static str,
        /// The spec in use.
        spec: QuantSpec,
        /// Output features.
        n: usize,
        /// Input features.
        k: usize,
        /// Elements found.
        got: usize,
        /// Elements required.
        expected: usize,
        /// The rule, in words.
        rule: &'static str,
    },
    /// Scales and biases are stored in different dtypes.
    #[error("scales are {scales} but biases are {biases}: both must have the same dtype")]
    ScaleDtypeMismatch {
        /// Dtype of the scales.
        scales: &'static str,
        /// Dtype of the biases.
        biases: &'static str,
    },
}

/// Checks that a `[n, k]` matrix can be quantized with `spec`. This is the public rule
/// sweeps use to skip a geometry before printing anything for it.
pub fn validate_geometry(n: usize, k: usize, spec: QuantSpec) -> Result<(), GeometryError> {
    if n == 0 || k == 0 {
        return Err(GeometryError::Empty { n, k });
    }
    if !k.is_multiple_of(spec.group_size()) {
        return Err(GeometryError::KNotMultipleOfGroup { n, k, group_size: spec.group_size() });
    }
    // group_size is a multiple of 32, so k * bits is always a whole number of u32 words.
    Ok(())
}

/// Reads code `j` of a row's little-endian bit stream.
#[inline]
pub fn read_code(row: &[u32], j: usize, bits: u32) -> u32 {
    let bit = j * bits as usize;
    let word = bit / 32;
    let shift = (bit % 32) as u32;
    let mask = (1u64 << bits) - 1;
    let lo = row[word] as u64 >> shift;
    let v = if shift + bits > 32 { lo | ((row[word + 1] as u64) << (32 - shift)) } else { lo };
    (v & mask) as u32
}

/// Writes code `j` into a row's bit stream; the target bits must be zero beforehand.
#[inline]
pub fn write_code(row: &mut [u32], j: usize, bits: u32, code: u32) {
    let bit = j * bits as usize;
    let word = bit / 32;
    let shift = (bit % 32) as u32;
    let v = (code as u64) << shift;
    row[word] |= v as u32;
    if shift + bits > 32 {
        row[word + 1] |= (v >> 32) as u32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_for_every_width() {
        for &bits in &SUPPORTED_BITS {
            let k = 96;
            let spec = QuantSpec::new(bits, 32).unwrap();
            let mut row = vec![0u32; spec.words_per_row(k)];
            let codes: Vec<u32> = (0..k as u32).map(|i| (i * 7 + 3) % (spec.max_code() + 1)).collect();
            for (j, &c) in codes.iter().enumerate() {
                write_code(&mut row, j, bits, c);
            }
            for (j, &c) in codes.iter().enumerate() {
                assert_eq!(read_code(&row, j, bits), c, "bits {bits} element {j}");
            }
        }
    }

    #[test]
    fn four_bit_element_zero_is_the_low_nibble() {
        let mut row = vec![0u32; 1];
        write_code(&mut row, 0, 4, 0xA);
        write_code(&mut row, 1, 4, 0x3);
        write_code(&mut row, 7, 4, 0xF);
        assert_eq!(row[0], 0xF000_003A);
    }

    #[test]
    fn three_bit_codes_straddle_words() {
        let mut row = vec![0u32; 3];
        // Element 10 occupies bits 30..33.
        write_code(&mut row, 10, 3, 0b101);
        assert_eq!(row[0], 0b01 << 30);
        assert_eq!(row[1], 0b1);
        assert_eq!(read_code(&row, 10, 3), 0b101);
    }

    #[test]
    fn geometry_errors_name_the_shape_and_the_rule() {
        let spec = QuantSpec::new(4, 64).unwrap();
        let e = validate_geometry(4096, 1000, spec).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("[4096, 1000]") && msg.contains("multiple of the group size"), "{msg}");
        assert!(QuantSpec::new(7, 64).unwrap_err().to_string().contains("2, 3, 4, 5, 6, 8"));
        assert!(QuantSpec::new(4, 48).unwrap_err().to_string().contains("32, 64, 128"));
        assert!(validate_geometry(0, 64, spec).is_err());
        assert!(validate_geometry(3, 128, spec).is_ok());
    }
}
