//! Launches described as data: for each kernel family, the checks on its shape, the
//! kernel's name, its grid and block, its arguments in parameter order, and the bytes of
//! each buffer it reads or writes. The host execution ([`crate::host`]) and the driver
//! (`crate::device`, feature `cuda`) run the same [`Launch`], so what the tests run on
//! the CPU is what the device is given. Nothing here touches a driver.
//!
//! Buffers are passed as 64-bit addresses: device pointers on the device, host pointers
//! in the host execution.

use kiln_core::{QuantSpec, ScaleDtype, validate_geometry};

use crate::error::CudaError;

/// Weight rows per `qmv` block (one warp each), `KILN_QMV_ROWS` in qmv.cu.
pub const QMV_ROWS_PER_BLOCK: u32 = 4;
/// Threads per `qmv` block.
pub const QMV_THREADS: u32 = QMV_ROWS_PER_BLOCK * 32;
/// The most activation rows `qmv_wide` takes, `KILN_QMV_WIDE_MAX` in qmv.cu.
pub const QMV_WIDE_MAX_ROWS: usize = 8;
/// The device's rule for a product of `m` activation rows, the one place it is decided:
/// `qmv` for one row, `qmv_wide` up to [`QMV_WIDE_MAX_ROWS`] (both give a row the same
/// bits at any M), `qmm` beyond. Nothing is measured: the rule is fixed.
pub fn product_kernel(m: usize) -> &'static str {
    match m {
        0 | 1 => "qmv",
        m if m <= QMV_WIDE_MAX_ROWS => "qmv_wide",
        _ => "qmm",
    }
}

/// The batch sizes that run `qmv_wide` under [`product_kernel`], as the kernel
/// configuration line says them (`2-8`).
pub fn wide_rows() -> String {
    format!("2-{QMV_WIDE_MAX_ROWS}")
}

/// Threads per RMSNorm block (one block per row).
pub const NORM_THREADS: u32 = 256;
/// Threads per block of the element-wise kernels.
pub const ELEMENTWISE_THREADS: u32 = 256;
/// Threads per RoPE block (one block per row).
pub const ROPE_THREADS: u32 = 128;
/// Keys per attention span, `KILN_ATTN_SPAN` in attn.cu (kiln-core's `SPAN_KEYS`).
pub const ATTN_SPAN: usize = 256;
/// Threads per attention block.
pub const ATTN_THREADS: u32 = 128;
/// The most query heads per key/value head the attention kernels take.
pub const ATTN_MAX_GROUP: usize = 8;
/// The widest head the attention kernels take.
pub const ATTN_MAX_HEAD_DIM: usize = 256;

/// One kernel argument, as the kernel's parameter holds it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    /// A buffer's address.
    Ptr(u64),
    /// A 32-bit signed integer.
    I32(i32),
    /// A 32-bit float.
    F32(f32),
}

impl Arg {
    /// The address of the value, as `cuLaunchKernel`'s parameter array takes it.
    pub fn as_param(&self) -> *mut std::ffi::c_void {
        match self {
            Arg::Ptr(v) => v as *const u64 as *mut std::ffi::c_void,
            Arg::I32(v) => v as *const i32 as *mut std::ffi::c_void,
            Arg::F32(v) => v as *const f32 as *mut std::ffi::c_void,
        }
    }
}

/// A kernel launch: name, geometry and arguments.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    /// The kernel's symbol (`kiln_qmv_b4_sf16_af16`).
    pub kernel: String,
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// Arguments in parameter order.
    pub args: Vec<Arg>,
}

impl Launch {
    /// The module (kernel source file) that holds the kernel.
    pub fn module(&self) -> &'static str {
        module_of(&self.kernel)
    }
}

/// The module of a kernel name.
pub fn module_of(kernel: &str) -> &'static str {
    if kernel.starts_with("kiln_qmv") {
        "qmv"
    } else if kernel.starts_with("kiln_qmm") {
        "qmm"
    } else if kernel.starts_with("kiln_attn") || kernel.starts_with("kiln_kv") {
        "attn"
    } else {
        "elementwise"
    }
}

/// Storage of the activations a projection reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Act {
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
}

impl Act {
    fn tag(self) -> &'static str {
        match self {
            Act::F16 => "f16",
            Act::Bf16 => "bf16",
        }
    }
}

/// Storage of a kernel's output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Out {
    /// f32.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
}

impl Out {
    fn tag(self) -> &'static str {
        match self {
            Out::F32 => "f32",
            Out::F16 => "f16",
            Out::Bf16 => "bf16",
        }
    }

    /// Bytes per value.
    pub fn size(self) -> usize {
        match self {
            Out::F32 => 4,
            Out::F16 | Out::Bf16 => 2,
        }
    }
}

fn scale_tag(d: ScaleDtype) -> &'static str {
    match d {
        ScaleDtype::F16 => "f16",
        ScaleDtype::Bf16 => "bf16",
        ScaleDtype::F32 => "f32",
    }
}

fn int(kernel: &'static str, what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::shape(kernel, format!("{what} = {v} exceeds {}", i32::MAX)))
}

fn blocks(kernel: &'static str, what: &str, v: usize) -> Result<u32, CudaError> {
    u32::try_from(v)
        .map_err(|_| CudaError::shape(kernel, format!("{v} blocks along {what} exceed {}", u32::MAX)))
}

/// The shape of a quantized projection `y[m, n] = x[m, k] W[n, k]^T`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QmvShape {
    /// Output features (weight rows).
    pub n: usize,
    /// Input features.
    pub k: usize,
    /// Activation rows: 1 runs `qmv`, 2..=[`QMV_WIDE_MAX_ROWS`] `qmv_wide`.
    pub m: usize,
    /// Width and group size (4 or 8 bits).
    pub spec: QuantSpec,
    /// Storage of the scales and biases.
    pub scales: ScaleDtype,
    /// Storage of the activations.
    pub act: Act,
}

/// The buffers of a quantized projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QmvBuffers {
    /// Packed codes, `n * k * bits / 32` words.
    pub packed: u64,
    /// Scales, `n * k / group` values.
    pub scales: u64,
    /// Biases, as many.
    pub biases: u64,
    /// Activations `[m, k]`.
    pub x: u64,
    /// Output `[m, n]`, f32.
    pub y: u64,
}

impl QmvShape {
    /// Checks the shape against the kernels.
    pub fn check(&self) -> Result<(), CudaError> {
        validate_geometry(self.n, self.k, self.spec)?;
        let bits = self.spec.bits();
        if bits != 4 && bits != 8 {
            return Err(CudaError::shape("qmv", format!("{bits}-bit weights: accepted widths are 4 and 8")));
        }
        if !(1..=QMV_WIDE_MAX_ROWS).contains(&self.m) {
            return Err(CudaError::shape(
                "qmv",
                format!(
                    "{} activation rows: accepted are 1..={QMV_WIDE_MAX_ROWS} (products of more rows run qmm)",
                    self.m
                ),
            ));
        }
        int("qmv", "K * M", self.k * self.m)?;
        int("qmv", "N * M", self.n * self.m)?;
        Ok(())
    }

    /// The kernel's name.
    pub fn kernel(&self) -> String {
        let family = if self.m == 1 { "qmv" } else { "qmv_wide" };
        format!("kiln_{family}_b{}_s{}_a{}", self.spec.bits(), scale_tag(self.scales), self.act.tag())
    }

    /// Bytes of the packed codes.
    pub fn packed_bytes(&self) -> usize {
        self.n * self.k * self.spec.bits() as usize / 8
    }

    /// Bytes of the scales (and of the biases).
    pub fn scale_bytes(&self) -> usize {
        self.n * self.spec.groups_per_row(self.k) * self.scales.size()
    }

    /// Bytes of the activations.
    pub fn x_bytes(&self) -> usize {
        self.m * self.k * 2
    }

    /// Bytes of the output.
    pub fn y_bytes(&self) -> usize {
        self.m * self.n * 4
    }

    /// The launch. The packed codes and the activations are read 16 bytes at a time, so
    /// their addresses must be multiples of 16 (device allocations are; a view into one
    /// must keep it).
    pub fn launch(&self, b: QmvBuffers) -> Result<Launch, CudaError> {
        self.check()?;
        for (what, a) in [("packed weights", b.packed), ("activations", b.x)] {
            if !a.is_multiple_of(16) {
                return Err(CudaError::shape(
                    "qmv",
                    format!("{what} at address {a:#x}: the kernels need a multiple of 16"),
                ));
            }
        }
        let group_log2 = (self.spec.group_size() / 32).trailing_zeros() as i32;
        Ok(Launch {
            kernel: self.kernel(),
            grid: [blocks("qmv", "x", self.n.div_ceil(QMV_ROWS_PER_BLOCK as usize))?, 1, 1],
            block: [QMV_THREADS, 1, 1],
            args: vec![
                Arg::Ptr(b.packed),
                Arg::Ptr(b.scales),
                Arg::Ptr(b.biases),
                Arg::Ptr(b.x),
                Arg::Ptr(b.y),
                Arg::I32(int("qmv", "N", self.n)?),
                Arg::I32(int("qmv", "K", self.k)?),
                Arg::I32(group_log2),
                Arg::I32(self.m as i32),
            ],
        })
    }
}

/// Weight rows per `qmm` block (four warps of eight).
pub const QMM_ROWS_PER_BLOCK: u32 = 32;
/// Activation rows per `qmm` block (one tensor-core tile).
pub const QMM_M_TILE: u32 = 16;
/// Threads per `qmm` block.
pub const QMM_THREADS: u32 = 128;

/// The shape of a quantized product on the tensor cores, `y[m, n] = x[m, k] W[n, k]^T`
/// for any number of activation rows (prefill).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QmmShape {
    /// Output features (weight rows).
    pub n: usize,
    /// Input features.
    pub k: usize,
    /// Activation rows, at least 1.
    pub m: usize,
    /// Width and group size (4 or 8 bits).
    pub spec: QuantSpec,
    /// Storage of the scales and biases.
    pub scales: ScaleDtype,
    /// Storage of the activations (the weights are rounded to it for the tensor cores).
    pub act: Act,
}

impl QmmShape {
    /// The kernel's name.
    pub fn kernel(&self) -> String {
        format!("kiln_qmm_b{}_s{}_a{}", self.spec.bits(), scale_tag(self.scales), self.act.tag())
    }

    /// The launch; the buffers are [`QmvBuffers`]' (sizes as [`QmvShape`]'s for `m` rows).
    pub fn launch(&self, b: QmvBuffers) -> Result<Launch, CudaError> {
        validate_geometry(self.n, self.k, self.spec)?;
        let bits = self.spec.bits();
        if bits != 4 && bits != 8 {
            return Err(CudaError::shape("qmm", format!("{bits}-bit weights: accepted widths are 4 and 8")));
        }
        if self.m == 0 {
            return Err(CudaError::shape("qmm", "0 activation rows: at least 1 is needed"));
        }
        int("qmm", "K * M", self.k * self.m)?;
        int("qmm", "N * M", self.n * self.m)?;
        Ok(Launch {
            kernel: self.kernel(),
            grid: [
                blocks("qmm", "x", self.n.div_ceil(QMM_ROWS_PER_BLOCK as usize))?,
                blocks("qmm", "y", self.m.div_ceil(QMM_M_TILE as usize))?,
                1,
            ],
            block: [QMM_THREADS, 1, 1],
            args: vec![
                Arg::Ptr(b.packed),
                Arg::Ptr(b.scales),
                Arg::Ptr(b.biases),
                Arg::Ptr(b.x),
                Arg::Ptr(b.y),
                Arg::I32(self.n as i32),
                Arg::I32(self.k as i32),
                Arg::I32(self.spec.group_size() as i32),
                Arg::I32(self.m as i32),
            ],
        })
    }
}

/// RMSNorm of `rows` rows of width `d` (f32 in) into `out` storage.
pub fn rms_norm(
    rows: usize,
    d: usize,
    eps: f32,
    out: Out,
    x: u64,
    weight: u64,
    y: u64,
) -> Result<Launch, CudaError> {
    if rows == 0 || d == 0 {
        return Err(CudaError::shape(
            "rms_norm",
            format!("[{rows}, {d}]: both dimensions must be at least 1"),
        ));
    }
    int("rms_norm", "rows * d", rows * d)?;
    Ok(Launch {
        kernel: format!("kiln_rms_norm_o{}", out.tag()),
        grid: [blocks("rms_norm", "x", rows)?, 1, 1],
        block: [NORM_THREADS, 1, 1],
        args: vec![Arg::Ptr(x), Arg::Ptr(weight), Arg::Ptr(y), Arg::I32(d as i32), Arg::F32(eps)],
    })
}

fn elementwise_grid(kernel: &'static str, len: usize) -> Result<(u32, i32), CudaError> {
    if len == 0 {
        return Err(CudaError::shape(kernel, "0 elements: at least 1 is needed"));
    }
    let n = int(kernel, "length", len)?;
    Ok((blocks(kernel, "x", len.div_ceil(ELEMENTWISE_THREADS as usize))?, n))
}

/// `out = silu(gate) * up` over `len` f32 values.
pub fn silu_mul(len: usize, out: Out, gate: u64, up: u64, y: u64) -> Result<Launch, CudaError> {
    let (g, n) = elementwise_grid("silu_mul", len)?;
    Ok(Launch {
        kernel: format!("kiln_silu_mul_o{}", out.tag()),
        grid: [g, 1, 1],
        block: [ELEMENTWISE_THREADS, 1, 1],
        args: vec![Arg::Ptr(gate), Arg::Ptr(up), Arg::Ptr(y), Arg::I32(n)],
    })
}

/// `x += y` over `len` f32 values.
pub fn add(len: usize, x: u64, y: u64) -> Result<Launch, CudaError> {
    let (g, n) = elementwise_grid("add", len)?;
    Ok(Launch {
        kernel: "kiln_add_f32".into(),
        grid: [g, 1, 1],
        block: [ELEMENTWISE_THREADS, 1, 1],
        args: vec![Arg::Ptr(x), Arg::Ptr(y), Arg::I32(n)],
    })
}

/// `y[r, j] += bias[j]` over `len` f32 values of rows `n` wide.
pub fn add_bias(len: usize, n: usize, y: u64, bias: u64) -> Result<Launch, CudaError> {
    let (g, l) = elementwise_grid("add_bias", len)?;
    if n == 0 || !len.is_multiple_of(n) {
        return Err(CudaError::shape(
            "add_bias",
            format!("{len} values in rows of {n}: the length must be a multiple of a width of at least 1"),
        ));
    }
    Ok(Launch {
        kernel: "kiln_add_bias_f32".into(),
        grid: [g, 1, 1],
        block: [ELEMENTWISE_THREADS, 1, 1],
        args: vec![Arg::Ptr(y), Arg::Ptr(bias), Arg::I32(n as i32), Arg::I32(l)],
    })
}

/// Rotary embeddings in place on `x[rows, heads * head_dim]` (f32), row `r` at
/// `positions[r]` (i32), with `head_dim / 2` f32 frequencies at `inv_freq`.
pub fn rope(
    rows: usize,
    heads: usize,
    head_dim: usize,
    x: u64,
    positions: u64,
    inv_freq: u64,
) -> Result<Launch, CudaError> {
    if rows == 0 || heads == 0 || head_dim < 2 || !head_dim.is_multiple_of(2) {
        return Err(CudaError::shape(
            "rope",
            format!(
                "{rows} rows of {heads} heads of {head_dim}: rows and heads at least 1, head_dim even and at least 2"
            ),
        ));
    }
    int("rope", "rows * heads * head_dim", rows * heads * head_dim)?;
    Ok(Launch {
        kernel: "kiln_rope_f32".into(),
        grid: [blocks("rope", "x", rows)?, 1, 1],
        block: [ROPE_THREADS, 1, 1],
        args: vec![
            Arg::Ptr(x),
            Arg::Ptr(positions),
            Arg::Ptr(inv_freq),
            Arg::I32(heads as i32),
            Arg::I32((head_dim / 2) as i32),
        ],
    })
}

/// The shape of an embedding lookup in a quantized `[vocab, d]` table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmbedShape {
    /// Tokens looked up.
    pub rows: usize,
    /// Table rows.
    pub vocab: usize,
    /// Embedding width.
    pub d: usize,
    /// Width and group size (any of the format's).
    pub spec: QuantSpec,
    /// Storage of the scales and biases.
    pub scales: ScaleDtype,
}

/// The buffers of an embedding lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmbedBuffers {
    /// Packed codes of the table.
    pub packed: u64,
    /// Scales.
    pub scales: u64,
    /// Biases.
    pub biases: u64,
    /// Token ids, `rows` i32.
    pub tokens: u64,
    /// Output `[rows, d]`, f32.
    pub out: u64,
}

impl EmbedShape {
    /// The launch.
    pub fn launch(&self, b: EmbedBuffers) -> Result<Launch, CudaError> {
        validate_geometry(self.vocab, self.d, self.spec)?;
        if self.rows == 0 {
            return Err(CudaError::shape("embed", "0 tokens: at least 1 is needed"));
        }
        int("embed", "rows * d", self.rows * self.d)?;
        int("embed", "vocab * d", self.vocab * self.d)?;
        Ok(Launch {
            kernel: format!("kiln_embed_s{}", scale_tag(self.scales)),
            grid: [
                blocks("embed", "x", self.rows)?,
                blocks("embed", "y", self.d.div_ceil(ELEMENTWISE_THREADS as usize))?,
                1,
            ],
            block: [ELEMENTWISE_THREADS, 1, 1],
            args: vec![
                Arg::Ptr(b.packed),
                Arg::Ptr(b.scales),
                Arg::Ptr(b.biases),
                Arg::Ptr(b.tokens),
                Arg::Ptr(b.out),
                Arg::I32(self.vocab as i32),
                Arg::I32(self.d as i32),
                Arg::I32(self.spec.bits() as i32),
                Arg::I32(self.spec.group_size() as i32),
            ],
        })
    }
}

/// The shape of one layer's decode attention over an f16 cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Query rows; row `r` sits at position `start + r`.
    pub rows: usize,
    /// Position of the first row.
    pub start: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Query heads per key/value head.
    pub group: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Positions the cache holds per head (its stride).
    pub capacity: usize,
    /// Storage of the output.
    pub out: Out,
}

/// The buffers of decode attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnBuffers {
    /// Queries `[rows, kv_heads * group * head_dim]`, f32.
    pub q: u64,
    /// Keys `[kv_heads, capacity, head_dim]`, f16.
    pub keys: u64,
    /// Values, as the keys.
    pub values: u64,
    /// Scratch for the span states, [`AttnShape::scratch_bytes`].
    pub scratch: u64,
    /// Output `[rows, kv_heads * group * head_dim]`.
    pub out: u64,
}

impl AttnShape {
    /// Checks the shape against the kernels.
    pub fn check(&self) -> Result<(), CudaError> {
        if self.rows == 0 || self.kv_heads == 0 {
            return Err(CudaError::shape("attention", "rows and kv_heads must be at least 1"));
        }
        if !(1..=ATTN_MAX_GROUP).contains(&self.group) {
            return Err(CudaError::shape(
                "attention",
                format!("{} query heads per key/value head: accepted are 1..={ATTN_MAX_GROUP}", self.group),
            ));
        }
        if !(1..=ATTN_MAX_HEAD_DIM).contains(&self.head_dim) {
            return Err(CudaError::shape(
                "attention",
                format!("head_dim {}: accepted are 1..={ATTN_MAX_HEAD_DIM}", self.head_dim),
            ));
        }
        if self.start + self.rows > self.capacity {
            return Err(CudaError::shape(
                "attention",
                format!(
                    "rows at positions {}..{} do not fit a cache of {} positions",
                    self.start,
                    self.start + self.rows,
                    self.capacity
                ),
            ));
        }
        int("attention", "kv_heads * capacity * head_dim", self.kv_heads * self.capacity * self.head_dim)?;
        int("attention", "scratch values", self.scratch_bytes() / 4)?;
        Ok(())
    }

    /// Spans of the longest row.
    pub fn max_spans(&self) -> usize {
        (self.start + self.rows).div_ceil(ATTN_SPAN)
    }

    /// f32 values of one span state: kiln-core's `DecodeShape::state_len`.
    pub fn state_len(&self) -> usize {
        self.group * (self.head_dim + 2)
    }

    /// Bytes of scratch the split kernel writes.
    pub fn scratch_bytes(&self) -> usize {
        self.rows * self.kv_heads * self.max_spans() * self.state_len() * 4
    }

    /// Bytes of the queries (and of an f32 output).
    pub fn q_bytes(&self) -> usize {
        self.rows * self.kv_heads * self.group * self.head_dim * 4
    }

    /// Bytes of the output.
    pub fn out_bytes(&self) -> usize {
        self.rows * self.kv_heads * self.group * self.head_dim * self.out.size()
    }

    /// Bytes of the key cache (and of the value cache).
    pub fn cache_bytes(&self) -> usize {
        self.kv_heads * self.capacity * self.head_dim * 2
    }

    /// The split kernel's width: the narrowest of 64, 128 and 256 that holds a head.
    pub fn split_width(&self) -> usize {
        match self.head_dim {
            0..=64 => 64,
            65..=128 => 128,
            _ => 256,
        }
    }

    /// The two launches, split then merge, in that order on one stream.
    pub fn launches(&self, b: AttnBuffers) -> Result<[Launch; 2], CudaError> {
        self.check()?;
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        let common =
            [Arg::I32(self.kv_heads as i32), Arg::I32(self.group as i32), Arg::I32(self.head_dim as i32)];
        let mut split_args = vec![Arg::Ptr(b.q), Arg::Ptr(b.keys), Arg::Ptr(b.values), Arg::Ptr(b.scratch)];
        split_args.extend(common);
        split_args.extend([
            Arg::I32(self.capacity as i32),
            Arg::I32(self.start as i32),
            Arg::I32(self.max_spans() as i32),
            Arg::F32(scale),
        ]);
        let mut merge_args = vec![Arg::Ptr(b.scratch), Arg::Ptr(b.out)];
        merge_args.extend(common);
        merge_args.extend([Arg::I32(self.start as i32), Arg::I32(self.max_spans() as i32)]);
        let (kv, rows) = (blocks("attention", "y", self.kv_heads)?, blocks("attention", "z", self.rows)?);
        Ok([
            Launch {
                kernel: format!("kiln_attn_split_d{}", self.split_width()),
                grid: [blocks("attention", "x", self.max_spans())?, kv, rows],
                block: [ATTN_THREADS, 1, 1],
                args: split_args,
            },
            Launch {
                kernel: format!("kiln_attn_merge_o{}", self.out.tag()),
                grid: [kv, rows, 1],
                block: [ATTN_THREADS, 1, 1],
                args: merge_args,
            },
        ])
    }
}

/// Writes `rows` new positions' keys and values (`[rows, kv_heads * head_dim]` f32 each)
/// into an f16 cache `[kv_heads, capacity, head_dim]` at positions `start..start + rows`.
#[allow(clippy::too_many_arguments)]
pub fn kv_store(
    rows: usize,
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    start: usize,
    k: u64,
    v: u64,
    keys: u64,
    values: u64,
) -> Result<Launch, CudaError> {
    if rows == 0 || kv_heads == 0 || head_dim == 0 {
        return Err(CudaError::shape("kv_store", "rows, kv_heads and head_dim must be at least 1"));
    }
    if start + rows > capacity {
        return Err(CudaError::shape(
            "kv_store",
            format!("positions {start}..{} do not fit a cache of {capacity} positions", start + rows),
        ));
    }
    int("kv_store", "kv_heads * capacity * head_dim", kv_heads * capacity * head_dim)?;
    Ok(Launch {
        kernel: "kiln_kv_store_f16".into(),
        grid: [blocks("kv_store", "x", rows)?, blocks("kv_store", "y", kv_heads)?, 1],
        block: [ATTN_THREADS, 1, 1],
        args: vec![
            Arg::Ptr(k),
            Arg::Ptr(v),
            Arg::Ptr(keys),
            Arg::Ptr(values),
            Arg::I32(kv_heads as i32),
            Arg::I32(head_dim as i32),
            Arg::I32(capacity as i32),
            Arg::I32(start as i32),
        ],
    })
}

/// The most experts a route picks per row.
pub const MOE_MAX_TOP_K: usize = 64;

/// The MoE router: per row of `logits` (`[rows, experts]` f32), the `top_k` experts
/// (`[rows, top_k]` i32, ascending) and their weights (`[rows, top_k]` f32), as
/// kiln-model's `moe::route`.
pub fn moe_route(
    rows: usize,
    experts: usize,
    top_k: usize,
    norm: bool,
    logits: u64,
    chosen: u64,
    weights: u64,
) -> Result<Launch, CudaError> {
    if rows == 0 || experts == 0 {
        return Err(CudaError::shape("moe_route", "rows and experts must be at least 1"));
    }
    if !(1..=experts.min(MOE_MAX_TOP_K)).contains(&top_k) {
        return Err(CudaError::shape(
            "moe_route",
            format!("top_k {top_k} of {experts} experts: accepted are 1..={}", experts.min(MOE_MAX_TOP_K)),
        ));
    }
    int("moe_route", "rows * experts", rows * experts)?;
    Ok(Launch {
        kernel: "kiln_moe_route".into(),
        grid: [blocks("moe_route", "x", rows.div_ceil(32))?, 1, 1],
        block: [32, 1, 1],
        args: vec![
            Arg::Ptr(logits),
            Arg::Ptr(chosen),
            Arg::Ptr(weights),
            Arg::I32(rows as i32),
            Arg::I32(experts as i32),
            Arg::I32(top_k as i32),
            Arg::I32(norm as i32),
        ],
    })
}

/// Copies rows `rows_idx[i]` (i32) of `x` (`[_, width]`, 16-bit values) to row `i` of `out`
/// for `i < m`: the rows routed to one expert. The indices must lie inside `x`.
pub fn gather_rows(m: usize, width: usize, x: u64, rows_idx: u64, out: u64) -> Result<Launch, CudaError> {
    if m == 0 || width == 0 {
        return Err(CudaError::shape("gather_rows", "rows and width must be at least 1"));
    }
    int("gather_rows", "m * width", m * width)?;
    Ok(Launch {
        kernel: "kiln_gather_rows_u16".into(),
        grid: [blocks("gather_rows", "x", m)?, blocks("gather_rows", "y", width.div_ceil(256))?, 1],
        block: [ELEMENTWISE_THREADS, 1, 1],
        args: vec![Arg::Ptr(x), Arg::Ptr(rows_idx), Arg::Ptr(out), Arg::I32(width as i32)],
    })
}

/// Adds one expert's output back: `out[rows_idx[i]] += weights[i] * ye[i]` for its `m`
/// distinct rows (`ye` `[m, hidden]` f32). Launched per expert in ascending order.
pub fn moe_accumulate(
    m: usize,
    hidden: usize,
    out: u64,
    ye: u64,
    rows_idx: u64,
    weights: u64,
) -> Result<Launch, CudaError> {
    if m == 0 || hidden == 0 {
        return Err(CudaError::shape("moe_accumulate", "rows and hidden must be at least 1"));
    }
    int("moe_accumulate", "m * hidden", m * hidden)?;
    Ok(Launch {
        kernel: "kiln_moe_accumulate".into(),
        grid: [blocks("moe_accumulate", "x", m)?, blocks("moe_accumulate", "y", hidden.div_ceil(256))?, 1],
        block: [ELEMENTWISE_THREADS, 1, 1],
        args: vec![
            Arg::Ptr(out),
            Arg::Ptr(ye),
            Arg::Ptr(rows_idx),
            Arg::Ptr(weights),
            Arg::I32(hidden as i32),
        ],
    })
}

/// Every kernel name the launch builders can produce, for the tables the host execution
/// and the embedded modules are checked against.
pub fn all_kernels() -> Vec<String> {
    let mut v = Vec::new();
    for family in ["qmv", "qmv_wide", "qmm"] {
        for bits in [4, 8] {
            for s in ["f16", "bf16", "f32"] {
                for a in ["f16", "bf16"] {
                    v.push(format!("kiln_{family}_b{bits}_s{s}_a{a}"));
                }
            }
        }
    }
    for o in ["f16", "bf16", "f32"] {
        v.push(format!("kiln_rms_norm_o{o}"));
        v.push(format!("kiln_silu_mul_o{o}"));
        v.push(format!("kiln_embed_s{o}"));
        v.push(format!("kiln_attn_merge_o{o}"));
    }
    v.push("kiln_add_f32".into());
    v.push("kiln_add_bias_f32".into());
    v.push("kiln_rope_f32".into());
    v.push("kiln_kv_store_f16".into());
    v.push("kiln_moe_route".into());
    v.push("kiln_gather_rows_u16".into());
    v.push("kiln_moe_accumulate".into());
    for d in [64, 128, 256] {
        v.push(format!("kiln_attn_split_d{d}"));
    }
    v.sort();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(bits: u32, g: usize) -> QuantSpec {
        QuantSpec::new(bits, g).unwrap()
    }

    fn bufs() -> QmvBuffers {
        QmvBuffers { packed: 0x100, scales: 2, biases: 3, x: 0x200, y: 5 }
    }

    #[test]
    fn qmv_picks_the_kernel_by_rows_and_covers_every_weight_row() {
        let mut s =
            QmvShape { n: 13, k: 256, m: 1, spec: spec(4, 64), scales: ScaleDtype::Bf16, act: Act::F16 };
        let l = s.launch(bufs()).unwrap();
        assert_eq!(l.kernel, "kiln_qmv_b4_sbf16_af16");
        assert_eq!(l.grid, [4, 1, 1]);
        assert_eq!(l.block, [128, 1, 1]);
        assert_eq!(l.args[7], Arg::I32(1), "g64 is 2 chunks of 32 per group");
        assert_eq!(l.module(), "qmv");
        s.m = 8;
        assert_eq!(s.launch(bufs()).unwrap().kernel, "kiln_qmv_wide_b4_sbf16_af16");
        s.n = 16;
        assert_eq!(s.launch(bufs()).unwrap().grid, [4, 1, 1]);
    }

    #[test]
    fn qmv_refuses_widths_rows_and_geometry_it_does_not_take() {
        let base = QmvShape { n: 8, k: 128, m: 1, spec: spec(4, 32), scales: ScaleDtype::F16, act: Act::F16 };
        let e = QmvShape { spec: spec(3, 32), ..base }.launch(bufs()).unwrap_err().to_string();
        assert!(e.contains("3-bit") && e.contains("4 and 8"), "{e}");
        let e = QmvShape { m: 9, ..base }.launch(bufs()).unwrap_err().to_string();
        assert!(e.contains("9 activation rows") && e.contains("1..=8"), "{e}");
        assert!(QmvShape { m: 0, ..base }.launch(bufs()).is_err());
        let e = QmvShape { k: 100, ..base }.launch(bufs()).unwrap_err();
        assert!(matches!(e, CudaError::Geometry(_)), "{e}");
        let e = base.launch(QmvBuffers { x: 0x208, ..bufs() }).unwrap_err().to_string();
        assert!(e.contains("activations at address 0x208") && e.contains("multiple of 16"), "{e}");
    }

    #[test]
    fn qmm_tiles_cover_every_row_and_column() {
        let s = QmmShape { n: 37, k: 128, m: 33, spec: spec(4, 32), scales: ScaleDtype::F16, act: Act::Bf16 };
        let l = s.launch(bufs()).unwrap();
        assert_eq!((l.kernel.as_str(), l.grid, l.module()), ("kiln_qmm_b4_sf16_abf16", [2, 3, 1], "qmm"));
        assert!(QmmShape { m: 0, ..s }.launch(bufs()).is_err());
        assert!(QmmShape { spec: spec(6, 32), ..s }.launch(bufs()).is_err());
    }

    #[test]
    fn qmv_buffer_sizes_follow_the_format() {
        let s =
            QmvShape { n: 4096, k: 4096, m: 3, spec: spec(4, 64), scales: ScaleDtype::F16, act: Act::Bf16 };
        assert_eq!(s.packed_bytes(), 4096 * 4096 / 2);
        assert_eq!(s.scale_bytes(), 4096 * 64 * 2);
        assert_eq!(s.x_bytes(), 3 * 4096 * 2);
        assert_eq!(s.y_bytes(), 3 * 4096 * 4);
        let s8 = QmvShape { spec: spec(8, 128), scales: ScaleDtype::F32, ..s };
        assert_eq!(s8.packed_bytes(), 4096 * 4096);
        assert_eq!(s8.scale_bytes(), 4096 * 32 * 4);
    }

    #[test]
    fn attention_geometry_scratch_and_limits() {
        let s = AttnShape {
            rows: 3,
            start: 510,
            kv_heads: 2,
            group: 7,
            head_dim: 64,
            capacity: 1024,
            out: Out::F16,
        };
        assert_eq!(s.max_spans(), 3, "the last row sees 513 keys");
        assert_eq!(s.scratch_bytes(), 3 * 2 * 3 * 7 * 66 * 4);
        let bufs = AttnBuffers { q: 1, keys: 2, values: 3, scratch: 4, out: 5 };
        let [split, merge] = s.launches(bufs).unwrap();
        assert_eq!(split.kernel, "kiln_attn_split_d64");
        assert_eq!(split.grid, [3, 2, 3]);
        assert_eq!(merge.kernel, "kiln_attn_merge_of16");
        assert_eq!(merge.grid, [2, 3, 1]);
        assert_eq!(split.args.last(), Some(&Arg::F32(0.125)));
        assert_eq!(AttnShape { head_dim: 65, ..s }.split_width(), 128);
        assert_eq!(AttnShape { head_dim: 200, ..s }.split_width(), 256);
        let e = AttnShape { group: 9, ..s }.launches(bufs).unwrap_err().to_string();
        assert!(e.contains("1..=8"), "{e}");
        let e = AttnShape { capacity: 512, ..s }.launches(bufs).unwrap_err().to_string();
        assert!(e.contains("510..513") && e.contains("512 positions"), "{e}");
        assert!(AttnShape { head_dim: 257, ..s }.launches(bufs).is_err());
        let l = kv_store(3, 2, 64, 1024, 510, 1, 2, 3, 4).unwrap();
        assert_eq!((l.kernel.as_str(), l.grid, l.module()), ("kiln_kv_store_f16", [3, 2, 1], "attn"));
        let e = kv_store(3, 2, 64, 512, 510, 1, 2, 3, 4).unwrap_err().to_string();
        assert!(e.contains("510..513"), "{e}");
    }

    #[test]
    fn elementwise_grids_cover_every_element() {
        let l = silu_mul(257, Out::Bf16, 1, 2, 3).unwrap();
        assert_eq!((l.kernel.as_str(), l.grid), ("kiln_silu_mul_obf16", [2, 1, 1]));
        assert_eq!(add(256, 1, 2).unwrap().grid, [1, 1, 1]);
        assert!(add(0, 1, 2).is_err());
        assert_eq!(add_bias(257, 257, 1, 2).unwrap().args[2], Arg::I32(257));
        assert!(add_bias(256, 3, 1, 2).unwrap_err().to_string().contains("multiple"));
        assert_eq!(rms_norm(5, 896, 1e-6, Out::F32, 1, 2, 3).unwrap().grid, [5, 1, 1]);
        assert!(rope(1, 2, 7, 1, 2, 3).unwrap_err().to_string().contains("even"));
        let l = moe_route(33, 60, 4, true, 1, 2, 3).unwrap();
        assert_eq!(
            (l.kernel.as_str(), l.grid, l.block, l.module()),
            ("kiln_moe_route", [2, 1, 1], [32, 1, 1], "elementwise")
        );
        let e = moe_route(1, 4, 5, true, 1, 2, 3).unwrap_err().to_string();
        assert!(e.contains("top_k 5 of 4") && e.contains("1..=4"), "{e}");
        let e = EmbedShape { rows: 2, vocab: 10, d: 300, spec: spec(4, 64), scales: ScaleDtype::F16 };
        let l = e.launch(EmbedBuffers { packed: 1, scales: 2, biases: 3, tokens: 4, out: 5 });
        assert!(matches!(l, Err(CudaError::Geometry(_))));
        let e = EmbedShape { d: 320, ..e };
        let l = e.launch(EmbedBuffers { packed: 1, scales: 2, biases: 3, tokens: 4, out: 5 }).unwrap();
        assert_eq!(l.grid, [2, 2, 1]);
    }

    #[test]
    fn every_kernel_name_maps_to_a_module() {
        let all = all_kernels();
        assert_eq!(all.len(), 36 + 12 + 6 + 3 + 1);
        for k in &all {
            assert!(["qmv", "qmm", "attn", "elementwise"].contains(&module_of(k)), "{k}");
        }
    }
}
