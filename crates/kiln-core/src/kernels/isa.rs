//! The instruction-set paths of the kernels and the CPU features that decide which runs:
//! the one place kiln detects CPU features, below everything that dispatches on them.

use std::sync::OnceLock;

/// An instruction-set path of the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Isa {
    /// x86-64 with AVX-512F, BW and VL and VNNI besides the AVX2 set: the integer dots of
    /// `qmv` and of 4-bit tiles with `vpdpbusd` / `vpdpwssd`, and the kernel of `qmv_wide`
    /// and `qmm` with a weight row per 32-bit lane for 4-bit weights; the rest runs its AVX2
    /// code.
    Avx512Vnni,
    /// x86-64 with AVX-512F, BW and VL besides the AVX2 set (no VNNI): as
    /// [`Isa::Avx512Vnni`] with 512-bit `vpmaddubsw` / `vpmaddwd` for the dots.
    Avx512,
    /// x86-64 with AVX2, FMA and F16C, detected at run time.
    Avx2,
    /// aarch64 NEON (always present there).
    Neon,
    /// Plain Rust, every target.
    Portable,
}

/// The CPU features the paths need, as detected (or as a test states them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuFeatures {
    /// AVX2, FMA and F16C.
    pub avx2: bool,
    /// AVX-512F, AVX-512BW and AVX-512VL.
    pub avx512bw: bool,
    /// AVX-512 VNNI.
    pub avx512vnni: bool,
    /// AVX-VNNI: the VEX-encoded 256-bit `vpdpbusd`, on CPUs that may lack AVX-512. No
    /// kernel path takes it yet; the compute-roof probe (`crate::roofs`) measures it.
    pub avx_vnni: bool,
    /// aarch64 (NEON is always there).
    pub neon: bool,
}

impl CpuFeatures {
    /// This CPU's features, detected once.
    pub fn detected() -> CpuFeatures {
        static DETECTED: OnceLock<CpuFeatures> = OnceLock::new();
        *DETECTED.get_or_init(detect_features)
    }

    /// Whether a CPU with these features runs `isa`.
    pub fn runs(self, isa: Isa) -> bool {
        match isa {
            Isa::Avx512Vnni => self.avx2 && self.avx512bw && self.avx512vnni,
            Isa::Avx512 => self.avx2 && self.avx512bw,
            Isa::Avx2 => self.avx2,
            Isa::Neon => self.neon,
            Isa::Portable => true,
        }
    }

    /// The paths a CPU with these features runs, best first.
    pub fn paths(self) -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|&i| self.runs(i)).collect()
    }

    /// The best path a CPU with these features runs.
    pub fn best(self) -> Isa {
        Isa::ALL.into_iter().find(|&i| self.runs(i)).unwrap_or(Isa::Portable)
    }
}

#[cfg(target_arch = "x86_64")]
fn detect_features() -> CpuFeatures {
    CpuFeatures {
        avx2: is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"),
        avx512bw: is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl"),
        avx512vnni: is_x86_feature_detected!("avx512vnni"),
        avx_vnni: is_x86_feature_detected!("avxvnni"),
        neon: false,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_features() -> CpuFeatures {
    CpuFeatures { neon: cfg!(target_arch = "aarch64"), ..CpuFeatures::default() }
}

impl Isa {
    /// Every path, best first.
    pub const ALL: [Isa; 5] = [Isa::Avx512Vnni, Isa::Avx512, Isa::Avx2, Isa::Neon, Isa::Portable];

    /// The best path this CPU runs, detected once.
    pub fn detected() -> Isa {
        CpuFeatures::detected().best()
    }

    /// Whether this CPU can run the path (detected once, then cached).
    pub fn is_available(self) -> bool {
        CpuFeatures::detected().runs(self)
    }

    /// Every path this CPU can run, best first.
    pub fn available() -> Vec<Isa> {
        CpuFeatures::detected().paths()
    }

    /// The path's name in reports: `avx512_vnni`, `avx512`, `avx2`, `neon`, `portable`.
    pub fn as_str(self) -> &'static str {
        match self {
            Isa::Avx512Vnni => "avx512_vnni",
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Neon => "neon",
            Isa::Portable => "portable",
        }
    }
}
