//! The WGSL kernels (`shaders/`, each compiled with `common.wgsl`) and their dispatches as
//! data: every builder checks its shape and the sizes of the buffers it is given, and
//! returns a [`Dispatch`] for [`crate::WgpuExec::dispatch`]. wgpu bounds-checks every
//! storage access, so a wrong size here is a wrong answer, never a wild write; the checks
//! make it a named error instead.
//!
//! Activations on this backend are f32 everywhere, so no kernel needs the shader-f16
//! feature; the KV cache is f16, packed two to a `u32`. The products read f32 activations
//! and accumulate in f32 (`qmv`, `qmm`: the `f32` scheme), or, under the CPU's integer
//! schemes (`int8`, `int16`), quantize them per weight group to integer codes first
//! ([`IntProduct`]: kiln-core's codes, exact integer group sums, its float epilogue).

use kiln_core::{QuantSpec, ScaleDtype};
use kiln_protocol::ActScheme;

use crate::error::WgpuError;
use crate::exec::{Dispatch, Mem};
use crate::shaders::Kernel;
pub use crate::shaders::qmv_lanes;

/// Rows a `qmv` dispatch takes (`qmv_wide` up to here); more rows run `qmm`.
pub const QMV_WIDE_MAX_ROWS: usize = 8;
/// Keys per attention span (one workgroup's share of a row's keys).
pub const ATTN_SPAN: usize = 256;
/// The widest head the attention kernels take.
pub const MAX_HEAD_DIM: usize = 256;
/// Workgroups per dimension the builders use before wrapping into a second dimension.
const WRAP: usize = 65535;

fn sdt(d: ScaleDtype) -> u32 {
    match d {
        ScaleDtype::F16 => 0,
        ScaleDtype::Bf16 => 1,
        ScaleDtype::F32 => 2,
    }
}

fn dtype_bytes(d: ScaleDtype) -> usize {
    match d {
        ScaleDtype::F16 | ScaleDtype::Bf16 => 2,
        ScaleDtype::F32 => 4,
    }
}

/// `n` workgroups as x, y counts of at most 65535 each.
fn wrap(n: usize) -> [u32; 3] {
    if n <= WRAP { [n as u32, 1, 1] } else { [WRAP as u32, n.div_ceil(WRAP) as u32, 1] }
}

fn u32_of(kernel: &'static str, what: &str, v: usize) -> Result<u32, WgpuError> {
    u32::try_from(v).map_err(|_| WgpuError::shape(kernel, format!("{what} {v}: at most {}", u32::MAX)))
}

fn need(kernel: &'static str, what: &str, m: &Mem, bytes: usize) -> Result<(), WgpuError> {
    if m.bytes() < bytes {
        return Err(WgpuError::shape(kernel, format!("{what}: {} bytes, {bytes} needed", m.bytes())));
    }
    Ok(())
}

/// A quantized matrix's buffers (the checkpoint's bytes).
#[derive(Clone, Copy)]
pub struct Weights<'a> {
    /// Packed codes, row-major.
    pub packed: &'a Mem,
    /// Scales in the checkpoint's dtype.
    pub scales: &'a Mem,
    /// Biases in the checkpoint's dtype.
    pub biases: &'a Mem,
}

/// The shape of a product `y[M, N] = x[M, K] W[N, K]^T` over a quantized matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProductShape {
    /// Output features (rows of W).
    pub n: usize,
    /// Input features.
    pub k: usize,
    /// Activation rows.
    pub m: usize,
    /// Bits and group size.
    pub spec: QuantSpec,
    /// The scales' and biases' storage.
    pub scales: ScaleDtype,
    /// `qmv`'s lanes per output feature, a power of two up to 32 ([`qmv_lanes`]).
    pub lanes: usize,
}

impl ProductShape {
    /// Bytes of the packed codes.
    pub fn packed_bytes(&self) -> usize {
        self.n * self.spec.words_per_row(self.k) * 4
    }

    /// Bytes of the scales (and of the biases).
    pub fn scale_bytes(&self) -> usize {
        self.n * (self.k / self.spec.group_size()) * dtype_bytes(self.scales)
    }

    fn check(&self, kernel: &'static str) -> Result<(), WgpuError> {
        let bits = self.spec.bits();
        if bits != 4 && bits != 8 {
            return Err(WgpuError::shape(kernel, format!("{bits}-bit weights: accepted are 4 and 8 bits")));
        }
        if self.n == 0 || self.m == 0 || self.k == 0 || !self.k.is_multiple_of(self.spec.group_size()) {
            return Err(WgpuError::shape(
                kernel,
                format!(
                    "n {} k {} m {}: each must be at least 1 and k a multiple of the group size {}",
                    self.n,
                    self.k,
                    self.m,
                    self.spec.group_size()
                ),
            ));
        }
        if !self.lanes.is_power_of_two() || self.lanes > 32 {
            return Err(WgpuError::shape(
                kernel,
                format!("{} lanes: accepted are 1, 2, 4, 8, 16, 32", self.lanes),
            ));
        }
        u32_of(kernel, "m * k", self.m * self.k)?;
        u32_of(kernel, "m * n", self.m * self.n)?;
        Ok(())
    }

    /// The dispatch: `qmv` for M <= [`QMV_WIDE_MAX_ROWS`] (a row's bits do not depend on
    /// M), `qmm` above (nor do its rows'). `x_row`/`y_row` are the first rows of x and y
    /// used.
    pub fn dispatch<'a>(
        &self,
        w: Weights<'a>,
        x: &'a Mem,
        x_row: usize,
        y: &'a Mem,
        y_row: usize,
    ) -> Result<Dispatch<'a>, WgpuError> {
        let kernel = if self.m <= QMV_WIDE_MAX_ROWS { Kernel::Qmv } else { Kernel::Qmm };
        let name = kernel.name();
        self.check(name)?;
        need(name, "packed", w.packed, self.packed_bytes())?;
        need(name, "scales", w.scales, self.scale_bytes())?;
        need(name, "biases", w.biases, self.scale_bytes())?;
        need(name, "x", x, (x_row + self.m) * self.k * 4)?;
        need(name, "y", y, (y_row + self.m) * self.n * 4)?;
        let params = vec![
            self.n as u32,
            self.k as u32,
            self.m as u32,
            self.spec.bits(),
            self.spec.group_size() as u32,
            sdt(self.scales),
            u32_of(name, "x offset", x_row * self.k)?,
            u32_of(name, "y offset", y_row * self.n)?,
            self.lanes as u32,
        ];
        let groups = if kernel == Kernel::Qmv {
            wrap(self.n.div_ceil(64 / self.lanes))
        } else {
            [self.n.div_ceil(64) as u32, self.m.div_ceil(8) as u32, 1]
        };
        Ok(Dispatch { kernel, params, buffers: vec![w.packed, w.scales, w.biases, x, y], groups })
    }
}

/// The activation codes an integer-scheme product reads: kiln-core's `ActCodes` for the
/// weights' width and the scheme (crates/kiln-core/src/kernels/act.rs), the same ranges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntCodes {
    /// 8-bit codes in `[-127, 127]`: 4-bit weights under `int8`.
    I8,
    /// 16-bit codes in `[-32512, 32512]`: 4-bit weights under `int16`.
    I16Split,
    /// 16-bit codes in `[-32767, 32767]`: 8-bit weights under `int8` and `int16`.
    I16,
}

impl IntCodes {
    /// The codes `bits`-bit weights take under `scheme`, as the CPU's kernels choose them;
    /// `None` for `f32` (and for the schemes this backend does not run: `f16`,
    /// `int16-wide8`) and for other widths.
    pub fn for_weight_bits(bits: u32, scheme: ActScheme) -> Option<IntCodes> {
        match (bits, scheme) {
            (4, ActScheme::Int8) => Some(IntCodes::I8),
            (4, ActScheme::Int16) => Some(IntCodes::I16Split),
            (8, ActScheme::Int8 | ActScheme::Int16) => Some(IntCodes::I16),
            _ => None,
        }
    }

    /// The largest code magnitude (kiln-core's `I8_MAX`, `I16_SPLIT_MAX`, `I16_MAX`).
    pub fn max_code(self) -> f32 {
        match self {
            IntCodes::I8 => 127.0,
            IntCodes::I16Split => 32512.0,
            IntCodes::I16 => 32767.0,
        }
    }

    /// Whether the codes are 16-bit: two byte planes per row.
    pub fn wide(self) -> bool {
        self != IntCodes::I8
    }
}

/// Bytes of the quantized activations ([`IntProduct::act_bytes`]) of `rows` rows of at
/// most `k` values in groups of at least 32, under any codes: a buffer this large takes
/// every integer product of up to `rows` rows and `k` inputs.
pub fn act_bytes_at_most(rows: usize, k: usize) -> usize {
    rows * (2 * k + k / 32 * 16)
}

/// A product under an integer activation scheme: the activations of `x` quantized into an
/// `act` buffer ([`IntProduct::quantize`], `act_quant`), then the product read from it
/// ([`IntProduct::product`], `qmv_int` for every M, its packed or plain form). The output
/// is kiln-core's `reference::qmv_int` under the same scheme: the same codes, scales and
/// integer group sums, and its float epilogue in its order (the same bits wherever the
/// driver fuses `fma`; the group sum `xsum` may differ from the CPU's by one rounding in
/// groups whose values span more than about 2^22).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IntProduct {
    /// The product's shape (`lanes` unused).
    pub shape: ProductShape,
    /// The activation codes.
    pub codes: IntCodes,
}

impl IntProduct {
    /// Where the per-group words start in the `act` buffer, in 4-byte words: after the
    /// codes of the product's rows. Per row and group four words follow: the scale `sx`,
    /// the sum `xsum` (f32 bits), the code sum `qsum` and the high bytes' sum (i32).
    pub fn info_off(&self) -> usize {
        let planes = if self.codes.wide() { 2 } else { 1 };
        self.shape.m * planes * self.shape.k / 4
    }

    /// Bytes of the `act` buffer: the codes, then four words per row and group.
    pub fn act_bytes(&self) -> usize {
        (self.info_off() + self.shape.m * (self.shape.k / self.shape.spec.group_size()) * 4) * 4
    }

    fn check(&self, kernel: &'static str) -> Result<(), WgpuError> {
        self.shape.check(kernel)?;
        if IntCodes::for_weight_bits(self.shape.spec.bits(), ActScheme::Int8) != Some(self.codes)
            && IntCodes::for_weight_bits(self.shape.spec.bits(), ActScheme::Int16) != Some(self.codes)
        {
            return Err(WgpuError::shape(
                kernel,
                format!(
                    "{:?} codes with {}-bit weights: not a scheme's codes",
                    self.codes,
                    self.shape.spec.bits()
                ),
            ));
        }
        u32_of(kernel, "act words", self.act_bytes() / 4)?;
        Ok(())
    }

    /// The quantization of the `m` rows of `x` from row `x_row` into `act`.
    pub fn quantize<'a>(&self, x: &'a Mem, x_row: usize, act: &'a Mem) -> Result<Dispatch<'a>, WgpuError> {
        let name = "act_quant";
        self.check(name)?;
        let s = &self.shape;
        need(name, "x", x, (x_row + s.m) * s.k * 4)?;
        need(name, "act", act, self.act_bytes())?;
        let groups = s.m * (s.k / s.spec.group_size());
        Ok(Dispatch {
            kernel: Kernel::ActQuant,
            params: vec![
                s.m as u32,
                s.k as u32,
                s.spec.group_size() as u32,
                self.codes.max_code().to_bits(),
                self.codes.wide() as u32,
                (s.spec.bits() == 4) as u32,
                u32_of(name, "x offset", x_row * s.k)?,
                self.info_off() as u32,
            ],
            buffers: vec![x, act],
            groups: wrap(groups.div_ceil(64)),
        })
    }

    fn product_dispatch<'a>(
        &self,
        w: Weights<'a>,
        act: &'a Mem,
        y: &'a Mem,
        y_row: usize,
        packed_dot: bool,
        sums: bool,
    ) -> Result<Dispatch<'a>, WgpuError> {
        let kernel = if packed_dot { Kernel::QmvInt } else { Kernel::QmvIntPlain };
        let name = kernel.name();
        self.check(name)?;
        let s = &self.shape;
        need(name, "packed", w.packed, s.packed_bytes())?;
        need(name, "scales", w.scales, s.scale_bytes())?;
        need(name, "biases", w.biases, s.scale_bytes())?;
        need(name, "act", act, self.act_bytes())?;
        let outs = if sums { s.m * s.n * (s.k / s.spec.group_size()) } else { (y_row + s.m) * s.n };
        need(name, "y", y, outs * 4)?;
        Ok(Dispatch {
            kernel,
            params: vec![
                s.n as u32,
                s.k as u32,
                s.m as u32,
                s.spec.bits(),
                s.spec.group_size() as u32,
                sdt(s.scales),
                u32_of(name, "y offset", y_row * s.n)?,
                self.codes.wide() as u32,
                self.info_off() as u32,
                sums as u32,
            ],
            buffers: vec![w.packed, w.scales, w.biases, act, y],
            groups: [s.n.div_ceil(64) as u32, s.m.div_ceil(8) as u32, 1],
        })
    }

    /// The product of the quantized rows in `act` into `y` from row `y_row`, with WGSL's
    /// packed dot products (`packed_dot`, where the adapter has them) or plain i32
    /// arithmetic: the same integers either way.
    pub fn product<'a>(
        &self,
        w: Weights<'a>,
        act: &'a Mem,
        y: &'a Mem,
        y_row: usize,
        packed_dot: bool,
    ) -> Result<Dispatch<'a>, WgpuError> {
        self.product_dispatch(w, act, y, y_row, packed_dot, false)
    }

    /// For the tests: the product's exact integer group sums `sum_j q_j xq_j` instead of
    /// its outputs, as `i32` in `sums` (`[m, n, groups]`).
    pub fn group_sums<'a>(
        &self,
        w: Weights<'a>,
        act: &'a Mem,
        sums: &'a Mem,
        packed_dot: bool,
    ) -> Result<Dispatch<'a>, WgpuError> {
        self.product_dispatch(w, act, sums, 0, packed_dot, true)
    }
}

/// The embedding lookup of `rows` tokens (i32) from a `[vocab, d]` quantized table.
#[derive(Clone, Copy, Debug)]
pub struct EmbedShape {
    /// Tokens.
    pub rows: usize,
    /// Table rows.
    pub vocab: usize,
    /// Row width.
    pub d: usize,
    /// Bits (2 to 8) and group size.
    pub spec: QuantSpec,
    /// The scales' storage.
    pub scales: ScaleDtype,
}

impl EmbedShape {
    /// The dispatch: `out` gets `[rows, d]` f32, NaN for a token outside the vocabulary.
    pub fn dispatch<'a>(
        &self,
        w: Weights<'a>,
        tokens: &'a Mem,
        out: &'a Mem,
    ) -> Result<Dispatch<'a>, WgpuError> {
        let name = "embed";
        if !self.d.is_multiple_of(self.spec.group_size())
            || !(self.d * self.spec.bits() as usize).is_multiple_of(32)
        {
            return Err(WgpuError::shape(name, format!("d {}: a whole number of groups and words", self.d)));
        }
        let p =
            ProductShape { n: self.vocab, k: self.d, m: 1, spec: self.spec, scales: self.scales, lanes: 1 };
        need(name, "packed", w.packed, p.packed_bytes())?;
        need(name, "scales", w.scales, p.scale_bytes())?;
        need(name, "tokens", tokens, self.rows * 4)?;
        need(name, "out", out, self.rows * self.d * 4)?;
        let len = u32_of(name, "rows * d", self.rows * self.d)?;
        Ok(Dispatch {
            kernel: Kernel::Embed,
            params: vec![
                self.rows as u32,
                self.vocab as u32,
                self.d as u32,
                self.spec.bits(),
                self.spec.group_size() as u32,
                sdt(self.scales),
            ],
            buffers: vec![w.packed, w.scales, w.biases, tokens, out],
            groups: wrap((len as usize).div_ceil(64)),
        })
    }
}

/// RMSNorm of `rows` rows of `d` from `x` (starting at row `x_row`) into `out` (at row
/// `out_row`), with weights `w`.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm<'a>(
    rows: usize,
    d: usize,
    eps: f32,
    x: &'a Mem,
    x_row: usize,
    w: &'a Mem,
    out: &'a Mem,
    out_row: usize,
) -> Result<Dispatch<'a>, WgpuError> {
    let name = "rms_norm";
    need(name, "x", x, (x_row + rows) * d * 4)?;
    need(name, "w", w, d * 4)?;
    need(name, "out", out, (out_row + rows) * d * 4)?;
    Ok(Dispatch {
        kernel: Kernel::RmsNorm,
        params: vec![
            u32_of(name, "rows", rows)?,
            u32_of(name, "d", d)?,
            eps.to_bits(),
            u32_of(name, "x offset", x_row * d)?,
            u32_of(name, "out offset", out_row * d)?,
        ],
        buffers: vec![x, w, out],
        groups: wrap(rows),
    })
}

/// RoPE over `rows` rows of `heads` heads of `2 * half` values in `x` (from row `x_row`),
/// with `cs` holding `[rows, half]` cosines then `[rows, half]` sines.
pub fn rope<'a>(
    rows: usize,
    heads: usize,
    half: usize,
    x: &'a Mem,
    x_row: usize,
    cs: &'a Mem,
) -> Result<Dispatch<'a>, WgpuError> {
    let name = "rope";
    need(name, "x", x, (x_row + rows) * heads * 2 * half * 4)?;
    need(name, "cos/sin", cs, 2 * rows * half * 4)?;
    let len = u32_of(name, "pairs", rows * heads * half)?;
    Ok(Dispatch {
        kernel: Kernel::Rope,
        params: vec![
            rows as u32,
            heads as u32,
            half as u32,
            u32_of(name, "x offset", x_row * heads * 2 * half)?,
        ],
        buffers: vec![x, cs],
        groups: wrap((len as usize).div_ceil(64)),
    })
}

/// The KV store: rows `row..row + rows` of `k` and `v` (`[rows, kv_heads, head_dim]` f32)
/// into positions `start..` of the f16 caches (`[kv_heads, capacity, head_dim]`).
#[allow(clippy::too_many_arguments)]
pub fn kv_store<'a>(
    rows: usize,
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    start: usize,
    row: usize,
    k: &'a Mem,
    v: &'a Mem,
    keys: &'a Mem,
    values: &'a Mem,
) -> Result<Dispatch<'a>, WgpuError> {
    let name = "kv_store";
    if !head_dim.is_multiple_of(2) || start + rows > capacity {
        return Err(WgpuError::shape(
            name,
            format!(
                "head_dim {head_dim}, rows {start}..{} of {capacity}: an even head_dim, rows inside",
                start + rows
            ),
        ));
    }
    need(name, "k", k, (row + rows) * kv_heads * head_dim * 4)?;
    need(name, "v", v, (row + rows) * kv_heads * head_dim * 4)?;
    need(name, "keys", keys, kv_heads * capacity * head_dim * 2)?;
    need(name, "values", values, kv_heads * capacity * head_dim * 2)?;
    let len = u32_of(name, "pairs", rows * kv_heads * head_dim / 2)?;
    Ok(Dispatch {
        kernel: Kernel::KvStore,
        params: vec![
            rows as u32,
            kv_heads as u32,
            head_dim as u32,
            u32_of(name, "capacity", capacity)?,
            start as u32,
            row as u32,
        ],
        buffers: vec![k, v, keys, values],
        groups: wrap((len as usize).div_ceil(64)),
    })
}

/// Decode attention of `rows` query rows at positions `start..start + rows` over one
/// sequence's f16 cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Query rows.
    pub rows: usize,
    /// The first row's position.
    pub start: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Query heads per key/value head.
    pub group: usize,
    /// Values per head.
    pub head_dim: usize,
    /// Positions the cache holds.
    pub capacity: usize,
}

impl AttnShape {
    /// Spans of the longest row.
    pub fn spans(&self) -> usize {
        (self.start + self.rows).div_ceil(ATTN_SPAN)
    }

    /// Bytes of the span states for `rows` rows over a cache of `capacity` positions.
    pub fn scratch_bytes(&self) -> usize {
        self.rows * self.kv_heads * self.group * self.capacity.div_ceil(ATTN_SPAN) * (self.head_dim + 2) * 4
    }

    /// Refuses what the kernels do not take, by name.
    pub fn check(&self) -> Result<(), WgpuError> {
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) || self.head_dim > MAX_HEAD_DIM {
            return Err(WgpuError::shape(
                "attention",
                format!("head_dim {}: accepted are even sizes up to {MAX_HEAD_DIM}", self.head_dim),
            ));
        }
        if self.kv_heads == 0 || self.group == 0 || self.rows == 0 || self.start + self.rows > self.capacity {
            return Err(WgpuError::shape(
                "attention",
                format!(
                    "{} kv heads of group {}, rows {}..{} of {}: at least one head and row, rows inside the cache",
                    self.kv_heads,
                    self.group,
                    self.start,
                    self.start + self.rows,
                    self.capacity
                ),
            ));
        }
        Ok(())
    }

    /// The split and merge dispatches: `q` `[rows, heads, head_dim]` f32 from row `q_row`,
    /// `out` the same shape from row `out_row`, `scratch` at least
    /// [`AttnShape::scratch_bytes`].
    #[allow(clippy::too_many_arguments)]
    pub fn dispatches<'a>(
        &self,
        q: &'a Mem,
        q_row: usize,
        keys: &'a Mem,
        values: &'a Mem,
        scratch: &'a Mem,
        out: &'a Mem,
        out_row: usize,
    ) -> Result<[Dispatch<'a>; 2], WgpuError> {
        self.check()?;
        let name = "attention";
        let heads = self.kv_heads * self.group;
        let qd = heads * self.head_dim;
        need(name, "q", q, (q_row + self.rows) * qd * 4)?;
        need(name, "out", out, (out_row + self.rows) * qd * 4)?;
        need(name, "keys", keys, self.kv_heads * self.capacity * self.head_dim * 2)?;
        need(name, "values", values, self.kv_heads * self.capacity * self.head_dim * 2)?;
        need(name, "scratch", scratch, self.scratch_bytes())?;
        let spans_stride = self.capacity.div_ceil(ATTN_SPAN) as u32;
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        let split = Dispatch {
            kernel: Kernel::AttnSplit,
            params: vec![
                self.rows as u32,
                self.start as u32,
                heads as u32,
                self.group as u32,
                self.head_dim as u32,
                self.capacity as u32,
                spans_stride,
                scale.to_bits(),
                q_row as u32,
            ],
            buffers: vec![q, keys, values, scratch],
            groups: [self.spans() as u32, heads as u32, self.rows as u32],
        };
        let merge = Dispatch {
            kernel: Kernel::AttnMerge,
            params: vec![
                self.rows as u32,
                self.start as u32,
                heads as u32,
                self.head_dim as u32,
                spans_stride,
                out_row as u32,
            ],
            buffers: vec![scratch, out],
            groups: [heads as u32, self.rows as u32, 1],
        };
        Ok([split, merge])
    }
}

/// `out = silu(g) * u` over `len` values.
pub fn silu_mul<'a>(len: usize, g: &'a Mem, u: &'a Mem, out: &'a Mem) -> Result<Dispatch<'a>, WgpuError> {
    let name = "silu_mul";
    for (what, m) in [("gate", g), ("up", u), ("out", out)] {
        need(name, what, m, len * 4)?;
    }
    Ok(Dispatch {
        kernel: Kernel::SiluMul,
        params: vec![u32_of(name, "len", len)?],
        buffers: vec![g, u, out],
        groups: wrap(len.div_ceil(64)),
    })
}

/// `x += y` over `len` values.
pub fn add<'a>(len: usize, x: &'a Mem, y: &'a Mem) -> Result<Dispatch<'a>, WgpuError> {
    need("add", "x", x, len * 4)?;
    need("add", "y", y, len * 4)?;
    Ok(Dispatch {
        kernel: Kernel::Add,
        params: vec![u32_of("add", "len", len)?],
        buffers: vec![x, y],
        groups: wrap(len.div_ceil(64)),
    })
}

/// `y[i] += b[i % n]` over `len` values.
pub fn add_bias<'a>(len: usize, n: usize, y: &'a Mem, b: &'a Mem) -> Result<Dispatch<'a>, WgpuError> {
    need("add_bias", "y", y, len * 4)?;
    need("add_bias", "bias", b, n * 4)?;
    Ok(Dispatch {
        kernel: Kernel::AddBias,
        params: vec![u32_of("add_bias", "len", len)?, n as u32],
        buffers: vec![y, b],
        groups: wrap(len.div_ceil(64)),
    })
}
