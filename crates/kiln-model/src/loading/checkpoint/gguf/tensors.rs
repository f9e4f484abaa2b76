//! GGUF tensor types and their exact mapping to kiln's MLX-affine format.
//!
//! Every block type kiln accepts is an affine code per element with one scale and one
//! offset per 32 elements, so it becomes a kiln group of 32 without rounding anything:
//!
//! | type | ggml value | kiln codes | scale | bias |
//! |---|---|---|---|---|
//! | Q4_0 | `d * (q - 8)` | 4-bit `q` | `d` (f16) | `-8d` (f16, exact) |
//! | Q4_1 | `d * q + m` | 4-bit `q` | `d` (f16) | `m` (f16) |
//! | Q8_0 | `d * q`, `q` signed | 8-bit `q + 128` | `d` (f16) | `-128d` (f16, exact) |
//! | Q4_K | `d*sc * q - dmin*mn` per 32 | 4-bit `q` | `d*sc` (f32, exact) | `-(dmin*mn)` (f32, exact) |
//! | Q5_K | the same with 5-bit `q` | 5-bit `q` | `d*sc` (f32) | `-(dmin*mn)` (f32) |
//!
//! In each case `scale * code + bias` rounds once to the value ggml's own dequantizer
//! computes, so dequantization is bit-exact. F32, F16 and BF16 are widened to f32 (exact).
//! Q6_K has a scale per 16 elements, finer than kiln's smallest group (32), and Q2_K and
//! Q3_K likewise; they, the legacy Q5_0/Q5_1/Q8_1 and every i-quant have no exact kiln
//! form and are refused by name.

use half::{bf16, f16};

/// The ggml tensor types a GGUF file may declare (kiln loads some of them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub(crate) enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

/// Elements in a K-quant super-block.
const QK_K: u64 = 256;

impl GgmlType {
    /// Names of every type [`Self::from_code`] knows, for messages.
    pub(crate) const KNOWN_NAMES: &'static str = "F32, F16, BF16, F64, I8-I64, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, \
         Q8_1, Q2_K-Q8_K, the IQ types, TQ1_0, TQ2_0 and MXFP4";

    /// Names of the types kiln loads, for messages.
    pub(crate) const LOADABLE: &'static str = "F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K";

    /// The type with ggml's numeric code, if known.
    pub(crate) fn from_code(code: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match code {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2_K,
            11 => Q3_K,
            12 => Q4_K,
            13 => Q5_K,
            14 => Q6_K,
            15 => Q8_K,
            16 => IQ2_XXS,
            17 => IQ2_XS,
            18 => IQ3_XXS,
            19 => IQ1_S,
            20 => IQ4_NL,
            21 => IQ3_S,
            22 => IQ2_S,
            23 => IQ4_XS,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => IQ1_M,
            30 => BF16,
            34 => TQ1_0,
            35 => TQ2_0,
            39 => MXFP4,
            _ => return None,
        })
    }

    /// ggml's name for the type.
    pub(crate) fn name(self) -> String {
        format!("{self:?}")
    }

    /// (elements per block, bytes per block).
    fn block(self) -> (u64, u64) {
        use GgmlType::*;
        match self {
            F32 | I32 => (1, 4),
            F16 | BF16 | I16 => (1, 2),
            I8 => (1, 1),
            I64 | F64 => (1, 8),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 36),
            Q2_K => (QK_K, 84),
            Q3_K => (QK_K, 110),
            Q4_K => (QK_K, 144),
            Q5_K => (QK_K, 176),
            Q6_K => (QK_K, 210),
            Q8_K => (QK_K, 292),
            IQ2_XXS => (QK_K, 66),
            IQ2_XS => (QK_K, 74),
            IQ3_XXS => (QK_K, 98),
            IQ1_S => (QK_K, 50),
            IQ4_NL => (32, 18),
            IQ3_S => (QK_K, 110),
            IQ2_S => (QK_K, 82),
            IQ4_XS => (QK_K, 136),
            IQ1_M => (QK_K, 56),
            TQ1_0 => (QK_K, 54),
            TQ2_0 => (QK_K, 66),
            MXFP4 => (32, 17),
        }
    }

    /// Bytes of a tensor of `elements` elements whose rows are `row` elements long; an
    /// error when rows are not whole blocks.
    pub(crate) fn byte_len(self, row: u64, elements: u64) -> Result<u64, String> {
        let (per, bytes) = self.block();
        if !row.is_multiple_of(per) {
            return Err(format!(
                "rows of {row} elements are not whole {} blocks of {per} elements",
                self.name()
            ));
        }
        (elements / per).checked_mul(bytes).ok_or_else(|| "byte size overflows".to_string())
    }

    /// The kiln form of a matrix of this type, or why there is none.
    pub(crate) fn kiln_form(self) -> Result<Form, String> {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 => Ok(Form::Dense),
            Q4_0 | Q4_1 => Ok(Form::Quantized { bits: 4, f32_scales: false }),
            Q8_0 => Ok(Form::Quantized { bits: 8, f32_scales: false }),
            Q4_K => Ok(Form::Quantized { bits: 4, f32_scales: true }),
            Q5_K => Ok(Form::Quantized { bits: 5, f32_scales: true }),
            Q6_K | Q2_K | Q3_K => Err(format!(
                "{} has a scale per 16 elements, finer than kiln's smallest group of 32, so it has no \
                 exact kiln form: accepted types are {}",
                self.name(),
                Self::LOADABLE
            )),
            other => {
                Err(format!("{} has no exact kiln form: accepted types are {}", other.name(), Self::LOADABLE))
            }
        }
    }
}

/// How a GGUF matrix is held in kiln.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Form {
    /// Widened to f32.
    Dense,
    /// Groups of 32 with `bits`-bit codes; scales and biases in f32 or f16.
    Quantized {
        /// Code width.
        bits: u32,
        /// Scales and biases stored as f32 (else f16).
        f32_scales: bool,
    },
}

/// Elements per kiln group of every GGUF block type kiln loads.
pub(crate) const GROUP: usize = 32;

/// One group of 32 decoded from a block: codes, scale and bias, as kiln stores them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Group {
    /// Unsigned codes.
    pub codes: [u8; GROUP],
    /// Scale.
    pub scale: f32,
    /// Bias.
    pub bias: f32,
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K/Q5_K super-block (ggml's
/// `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Decodes the groups of one row of `ty` (a quantized type) from its bytes, calling `f`
/// with each group in element order.
pub(crate) fn decode_row(ty: GgmlType, row: &[u8], mut f: impl FnMut(Group)) {
    let mut g = Group { codes: [0; GROUP], scale: 0.0, bias: 0.0 };
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let size = if ty == GgmlType::Q4_0 { 18 } else { 20 };
            for b in row.chunks_exact(size) {
                let d = f16_at(b, 0);
                let qs = &b[size - 16..];
                for (j, &q) in qs.iter().enumerate() {
                    g.codes[j] = q & 0xF;
                    g.codes[j + 16] = q >> 4;
                }
                g.scale = d;
                g.bias = if ty == GgmlType::Q4_0 { -8.0 * d } else { f16_at(b, 2) };
                f(g);
            }
        }
        GgmlType::Q8_0 => {
            for b in row.chunks_exact(34) {
                let d = f16_at(b, 0);
                for j in 0..32 {
                    g.codes[j] = (b[2 + j] as i8 as i16 + 128) as u8;
                }
                g.scale = d;
                g.bias = -128.0 * d;
                f(g);
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let size = if ty == GgmlType::Q4_K { 144 } else { 176 };
            for b in row.chunks_exact(size) {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let scales = &b[4..16];
                let (qh, qs) =
                    if ty == GgmlType::Q4_K { (&b[0..0], &b[16..144]) } else { (&b[16..48], &b[48..176]) };
                for sub in 0..8 {
                    let (sc, mn) = scale_min_k4(sub, scales);
                    let ql = &qs[32 * (sub / 2)..32 * (sub / 2) + 32];
                    for l in 0..32 {
                        let low = if sub % 2 == 0 { ql[l] & 0xF } else { ql[l] >> 4 };
                        let high = if ty == GgmlType::Q5_K { ((qh[l] >> sub) & 1) << 4 } else { 0 };
                        g.codes[l] = low | high;
                    }
                    g.scale = d * f32::from(sc);
                    g.bias = -(dmin * f32::from(mn));
                    f(g);
                }
            }
        }
        other => unreachable!("decode_row called on {other:?}, which kiln_form refuses"),
    }
}

/// Widens `row`'s bytes of a float type into `out`.
pub(crate) fn widen_row(ty: GgmlType, row: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        other => unreachable!("widen_row called on {other:?}, which is not a float type"),
    }
}

/// Packs one row's codes (`bits` wide, element 0 in the low bits of word 0) into `words`.
pub(crate) fn pack_codes(codes: impl Iterator<Item = u8>, bits: u32, words: &mut [u32]) {
    let mut acc = 0u64;
    let mut filled = 0u32;
    let mut at = 0;
    for c in codes {
        acc |= u64::from(c) << filled;
        filled += bits;
        if filled >= 32 {
            words[at] = acc as u32;
            at += 1;
            acc >>= 32;
            filled -= 32;
        }
    }
    debug_assert_eq!(filled, 0, "rows are whole words");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k_quant_scales_follow_ggml() {
        // Sub-blocks 0-3 read the low 6 bits; 4-7 combine nibbles with the top bits of
        // bytes 0-3 (scales) and 4-7 (mins).
        let q = [0xC1, 0x02, 0x03, 0x04, 0x45, 0x06, 0x07, 0x08, 0x9A, 0x0B, 0x0C, 0x0D];
        assert_eq!(scale_min_k4(0, &q), (1, 5));
        assert_eq!(scale_min_k4(4, &q), (0xA | (3 << 4), 0x9 | (1 << 4)));
    }

    #[test]
    fn packs_little_endian_bit_streams() {
        let mut w = [0u32; 5];
        pack_codes((0..32).map(|i| (i % 32) as u8), 5, &mut w);
        let bit = |p: usize| (w[p / 32] >> (p % 32)) & 1;
        for i in 0..32 {
            let code: u32 = (0..5).map(|b| bit(5 * i + b) << b).sum();
            assert_eq!(code as usize, i);
        }
        let mut w = [0u32; 1];
        pack_codes([1u8, 2, 3, 4, 5, 6, 7, 8].into_iter(), 4, &mut w);
        assert_eq!(w[0], 0x8765_4321);
    }

    #[test]
    fn q8_0_codes_are_offset_by_128_and_exact() {
        let mut block = vec![0u8; 34];
        block[..2].copy_from_slice(&f16::from_f32(0.5).to_bits().to_le_bytes());
        block[2] = (-128i8) as u8;
        block[3] = 127;
        let mut seen = Vec::new();
        decode_row(GgmlType::Q8_0, &block, |g| seen.push(g));
        let g = seen[0];
        assert_eq!((g.codes[0], g.codes[1], g.codes[2]), (0, 255, 128));
        assert_eq!(g.scale * f32::from(g.codes[0]) + g.bias, -64.0);
        assert_eq!(g.scale * f32::from(g.codes[1]) + g.bias, 63.5);
    }

    #[test]
    fn refused_types_are_named_with_the_accepted_ones() {
        let e = GgmlType::Q6_K.kiln_form().unwrap_err();
        assert!(e.contains("Q6_K") && e.contains("16 elements") && e.contains("Q4_K"), "{e}");
        let e = GgmlType::IQ4_NL.kiln_form().unwrap_err();
        assert!(e.contains("IQ4_NL") && e.contains("Q8_0"), "{e}");
    }
}
