//! The WGSL kernels kiln-wgpu compiles: their names, sources (`shaders/`, each after
//! `common.wgsl`) and the storage buffers each binds. A leaf: the executor compiles them,
//! `kernels` builds their dispatches. Also the kernel-choice rules that depend on the
//! adapter: `qmv`'s lanes per output feature, and the integer products' packed or plain
//! dot products ([`Kernel::QmvInt`], [`Kernel::QmvIntPlain`]).

/// Lanes `qmv` gives one output feature of a K-wide row on a GPU: enough that each lane
/// sums about four 32-element chunks, at most 32 (a power of two). On a CPU adapter
/// (lavapipe) one lane per feature: there a workgroup's tree of barriers costs more than
/// it saves (2.5x on smollm-135m's projections, docs/metal.md). It depends on K and the
/// adapter alone, never on M, so a row's bits do not depend on M.
pub fn qmv_lanes(k: usize, cpu_adapter: bool) -> usize {
    if cpu_adapter { 1 } else { (k / 32).div_ceil(4).next_power_of_two().clamp(1, 32) }
}

const COMMON: &str = include_str!("../shaders/common.wgsl");
const WEIGHTS: &str = include_str!("../shaders/weights.wgsl");
const DOT_PACKED: &str = include_str!("../shaders/dot_packed.wgsl");
const DOT_PLAIN: &str = include_str!("../shaders/dot_plain.wgsl");

/// One WGSL kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// `qmv` and `qmv_wide` (M <= 8).
    Qmv,
    /// `qmm` (any M).
    Qmm,
    /// The activations' quantization for the integer schemes.
    ActQuant,
    /// The integer-scheme product (any M) with WGSL's packed 4 x 8-bit dot products.
    QmvInt,
    /// The integer-scheme product (any M) in plain i32 arithmetic.
    QmvIntPlain,
    /// The quantized embedding lookup.
    Embed,
    /// RMSNorm.
    RmsNorm,
    /// RoPE from host cosines and sines.
    Rope,
    /// The store of new keys and values into the f16 cache.
    KvStore,
    /// Attention's span states.
    AttnSplit,
    /// Attention's merge of the span states.
    AttnMerge,
    /// SiLU-and-multiply.
    SiluMul,
    /// The residual add.
    Add,
    /// The bias add.
    AddBias,
}

impl Kernel {
    /// Every kernel.
    pub const ALL: [Kernel; 14] = [
        Kernel::Qmv,
        Kernel::Qmm,
        Kernel::ActQuant,
        Kernel::QmvInt,
        Kernel::QmvIntPlain,
        Kernel::Embed,
        Kernel::RmsNorm,
        Kernel::Rope,
        Kernel::KvStore,
        Kernel::AttnSplit,
        Kernel::AttnMerge,
        Kernel::SiluMul,
        Kernel::Add,
        Kernel::AddBias,
    ];

    /// The kernel's name.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Qmv => "qmv",
            Kernel::Qmm => "qmm",
            Kernel::ActQuant => "act_quant",
            Kernel::QmvInt => "qmv_int",
            Kernel::QmvIntPlain => "qmv_int_plain",
            Kernel::Embed => "embed",
            Kernel::RmsNorm => "rms_norm",
            Kernel::Rope => "rope",
            Kernel::KvStore => "kv_store",
            Kernel::AttnSplit => "attn_split",
            Kernel::AttnMerge => "attn_merge",
            Kernel::SiluMul => "silu_mul",
            Kernel::Add => "add",
            Kernel::AddBias => "add_bias",
        }
    }

    fn body(self) -> &'static str {
        match self {
            Kernel::Qmv => include_str!("../shaders/qmv.wgsl"),
            Kernel::Qmm => include_str!("../shaders/qmm.wgsl"),
            Kernel::ActQuant => include_str!("../shaders/act_quant.wgsl"),
            Kernel::QmvInt | Kernel::QmvIntPlain => include_str!("../shaders/qmv_int.wgsl"),
            Kernel::Embed => include_str!("../shaders/embed.wgsl"),
            Kernel::RmsNorm => include_str!("../shaders/rms_norm.wgsl"),
            Kernel::Rope => include_str!("../shaders/rope.wgsl"),
            Kernel::KvStore => include_str!("../shaders/kv_store.wgsl"),
            Kernel::AttnSplit => include_str!("../shaders/attn_split.wgsl"),
            Kernel::AttnMerge => include_str!("../shaders/attn_merge.wgsl"),
            Kernel::SiluMul => include_str!("../shaders/silu_mul.wgsl"),
            Kernel::Add => include_str!("../shaders/add.wgsl"),
            Kernel::AddBias => include_str!("../shaders/add_bias.wgsl"),
        }
    }

    /// The WGSL source: common.wgsl, then (for the kernels reading quantized weights)
    /// weights.wgsl, then (for the integer products) the 4 x 8-bit dot products, then the
    /// kernel.
    pub fn source(self) -> String {
        let weights = match self {
            Kernel::Qmv | Kernel::Qmm | Kernel::QmvInt | Kernel::QmvIntPlain | Kernel::Embed => WEIGHTS,
            _ => "",
        };
        let dot = match self {
            Kernel::QmvInt => DOT_PACKED,
            Kernel::QmvIntPlain => DOT_PLAIN,
            _ => "",
        };
        format!("{COMMON}\n{weights}\n{dot}\n{}", self.body())
    }

    /// Storage buffers bound after the parameters.
    pub fn storage_buffers(self) -> usize {
        match self {
            Kernel::Qmv | Kernel::Qmm | Kernel::QmvInt | Kernel::QmvIntPlain | Kernel::Embed => 5,
            Kernel::KvStore | Kernel::AttnSplit => 4,
            Kernel::RmsNorm | Kernel::SiluMul => 3,
            Kernel::Rope | Kernel::AttnMerge | Kernel::Add | Kernel::AddBias | Kernel::ActQuant => 2,
        }
    }
}
