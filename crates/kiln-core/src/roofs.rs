//! The machine's compute roofs, measured by register-only loops: per instruction set the
//! CPU has, how many int8 multiply-accumulates (the integer dots of the quantized kernels)
//! and f32 fused multiply-adds the worker pool's threads complete per second, all threads
//! at once. With the read bandwidth ([`crate::bandwidth`]) they are the two roofs of a
//! roofline: a kernel that does few operations per byte it reads is bounded by the
//! bandwidth, one that does many by the compute roof, and its share of the roof that
//! bounds it says how far it is from the machine's limit.
//!
//! **Counting.** Rates are in operations per second, and one multiply-accumulate counts
//! as **two** operations (a multiply and an add), the usual convention of peak-rate
//! figures; [`ops`] is the formula, and each probe's loop stores its accumulators so a
//! test checks that it did exactly the multiply-accumulates the formula counts.
//!
//! **The loops.** Each probe is inline assembly, so the compiler can neither hoist nor
//! fold the arithmetic: independent accumulators (ten, or six chains for the AVX2 int8
//! triple) so the throughput, not the latency, of the instruction is measured, operands
//! in registers, nothing read from memory inside the loop. The probes:
//! - [`Probe::Int8Avx512Vnni`]: `vpdpbusd zmm` (64 u8 x i8 products summed into 16 i32
//!   lanes per instruction);
//! - [`Probe::Int8AvxVnni`]: `{vex} vpdpbusd ymm` (32 per instruction), on CPUs with
//!   AVX-VNNI;
//! - [`Probe::Int8Avx2`]: the AVX2 chain the kernels use without VNNI, `vpmaddubsw ymm`
//!   (32 u8 x i8 products into 16 i16 pairs), `vpmaddwd ymm` against ones (into 8 i32),
//!   `vpaddd` into the accumulator: 32 multiply-accumulates per chain step;
//! - [`Probe::F32FmaAvx512`] and [`Probe::F32FmaAvx2`]: `vfmadd231ps` on zmm (16 lanes)
//!   and ymm (8 lanes).
//!
//! AMX (`tdpbusd` on tiles) is not probed: detecting it is not stable in Rust's standard
//! library yet, and no host this crate is built on has it; a probe that never ran here is
//! not offered.

use std::time::Instant;

use crate::kernels::CpuFeatures;

/// Passes a measurement takes by default; the best one is reported.
pub const DEFAULT_PASSES: usize = 5;

/// Loop iterations per thread and pass by default: ten million and more
/// multiply-accumulate instructions per thread, some milliseconds at any probe's rate,
/// far beyond the cost of starting the threads.
pub const DEFAULT_ITERS: u64 = 1 << 21;

/// A compute-roof probe: one instruction (or chain) on one register width.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Probe {
    /// AVX-512 VNNI `vpdpbusd` on zmm registers.
    Int8Avx512Vnni,
    /// AVX-VNNI `vpdpbusd` on ymm registers (VEX-encoded).
    Int8AvxVnni,
    /// AVX2 `vpmaddubsw` + `vpmaddwd` + `vpaddd` on ymm registers.
    Int8Avx2,
    /// AVX-512F `vfmadd231ps` on zmm registers.
    F32FmaAvx512,
    /// FMA `vfmadd231ps` on ymm registers.
    F32FmaAvx2,
}

/// What a probe multiplies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RoofKind {
    /// u8 x i8 products summed in i32: the quantized kernels' integer dots.
    Int8,
    /// f32 fused multiply-adds.
    F32,
}

impl Probe {
    /// Every probe, the int8 ones first, widest first.
    pub const ALL: [Probe; 5] =
        [Probe::Int8Avx512Vnni, Probe::Int8AvxVnni, Probe::Int8Avx2, Probe::F32FmaAvx512, Probe::F32FmaAvx2];

    /// The probe's name in reports and benchmark ids.
    pub fn as_str(self) -> &'static str {
        match self {
            Probe::Int8Avx512Vnni => "int8_avx512_vnni",
            Probe::Int8AvxVnni => "int8_avx_vnni",
            Probe::Int8Avx2 => "int8_avx2",
            Probe::F32FmaAvx512 => "f32_fma_avx512",
            Probe::F32FmaAvx2 => "f32_fma_avx2",
        }
    }

    /// The probe of a name [`Probe::as_str`] gives.
    pub fn from_name(name: &str) -> Option<Probe> {
        Probe::ALL.into_iter().find(|p| p.as_str() == name)
    }

    /// The instructions timed, for a report's legend.
    pub fn instructions(self) -> &'static str {
        match self {
            Probe::Int8Avx512Vnni => "vpdpbusd zmm",
            Probe::Int8AvxVnni => "{vex} vpdpbusd ymm",
            Probe::Int8Avx2 => "vpmaddubsw + vpmaddwd + vpaddd ymm",
            Probe::F32FmaAvx512 => "vfmadd231ps zmm",
            Probe::F32FmaAvx2 => "vfmadd231ps ymm",
        }
    }

    /// What it multiplies.
    pub fn kind(self) -> RoofKind {
        match self {
            Probe::Int8Avx512Vnni | Probe::Int8AvxVnni | Probe::Int8Avx2 => RoofKind::Int8,
            Probe::F32FmaAvx512 | Probe::F32FmaAvx2 => RoofKind::F32,
        }
    }

    /// Multiply-accumulates one accumulator step does: the products of one `vpdpbusd`,
    /// of one `vpmaddubsw` chain, or the lanes of one `vfmadd231ps`.
    pub fn macs_per_step(self) -> u64 {
        match self {
            Probe::Int8Avx512Vnni => 64,
            Probe::Int8AvxVnni | Probe::Int8Avx2 => 32,
            Probe::F32FmaAvx512 => 16,
            Probe::F32FmaAvx2 => 8,
        }
    }

    /// Accumulator steps one loop iteration does (independent accumulators).
    pub fn steps_per_iter(self) -> u64 {
        match self {
            // Three constants and two registers per chain fill AVX2's sixteen.
            Probe::Int8Avx2 => 6,
            _ => 10,
        }
    }

    /// Whether a CPU with these features runs the probe.
    pub fn runs_on(self, f: CpuFeatures) -> bool {
        if !cfg!(target_arch = "x86_64") {
            return false;
        }
        match self {
            Probe::Int8Avx512Vnni => f.avx512bw && f.avx512vnni,
            Probe::Int8AvxVnni => f.avx2 && f.avx_vnni,
            Probe::Int8Avx2 | Probe::F32FmaAvx2 => f.avx2,
            Probe::F32FmaAvx512 => f.avx512bw,
        }
    }
}

/// The probes a CPU with these features runs, in [`Probe::ALL`]'s order. Empty off
/// x86-64: no loop is written for other CPUs yet.
pub fn probes(f: CpuFeatures) -> Vec<Probe> {
    Probe::ALL.into_iter().filter(|p| p.runs_on(f)).collect()
}

/// The probes this CPU runs.
pub fn available() -> Vec<Probe> {
    probes(CpuFeatures::detected())
}

/// Operations `threads` threads do running `iters` iterations of `probe`'s loop each:
/// threads x iterations x steps per iteration x multiply-accumulates per step x 2 (one
/// multiply-accumulate is two operations).
pub fn ops(probe: Probe, threads: usize, iters: u64) -> u64 {
    threads as u64 * iters * probe.steps_per_iter() * probe.macs_per_step() * 2
}

/// One measured roof.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct ComputeRoof {
    /// The probe.
    pub probe: Probe,
    /// Operations per second (a multiply-accumulate is two), best pass.
    pub ops_per_s: f64,
    /// Threads that ran it at once.
    pub threads: usize,
}

impl ComputeRoof {
    /// TOPS (10^12 operations per second).
    pub fn tops(&self) -> f64 {
        self.ops_per_s / 1e12
    }
}

/// Runs `iters` iterations of `probe`'s loop on the calling thread and returns the sum of
/// its accumulators' lanes: with the loop's operands (every byte 1, every float 1.0), one
/// per multiply-accumulate done, so `iters * steps_per_iter * macs_per_step` (modulo 2^32
/// for the integer probes). `None` when this CPU does not run the probe.
pub fn run_loop(probe: Probe, iters: u64) -> Option<u64> {
    if !probe.runs_on(CpuFeatures::detected()) {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `runs_on` checked above that the CPU has the probe's instructions.
        Some(unsafe { x86::run(probe, iters) })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = iters;
        None
    }
}

/// Runs `iters` iterations of `probe`'s loop on every thread of the current rayon pool at
/// once (`rayon::broadcast`); returns the sum of every thread's [`run_loop`].
pub fn run_on_pool(probe: Probe, iters: u64) -> Option<u64> {
    let sums = rayon::broadcast(|_| run_loop(probe, iters));
    sums.into_iter().try_fold(0u64, |a, s| Some(a.wrapping_add(s?)))
}

/// Measures `probe` on every thread of the current rayon pool at once: the best of
/// `passes` passes of `iters` iterations per thread, over the wall time of the whole
/// pass (so a thread that starts late or runs slow counts against the roof). `None`
/// when this CPU does not run the probe.
pub fn measure(probe: Probe, iters: u64, passes: usize) -> Option<ComputeRoof> {
    if !probe.runs_on(CpuFeatures::detected()) {
        return None;
    }
    let threads = rayon::current_num_threads();
    let mut best = f64::INFINITY;
    let mut sink = 0u64;
    for _ in 0..passes.max(1) {
        let t = Instant::now();
        sink = sink.wrapping_add(run_on_pool(probe, iters)?);
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(sink);
    Some(ComputeRoof { probe, ops_per_s: ops(probe, threads, iters) as f64 / best, threads })
}

/// Measures every probe this CPU runs, on the current rayon pool.
pub fn measure_all(iters: u64, passes: usize) -> Vec<ComputeRoof> {
    available().into_iter().filter_map(|p| measure(p, iters, passes)).collect()
}

/// The highest roof of `kind` among `roofs`: the roof a kernel of that kind is held to.
pub fn best(roofs: &[ComputeRoof], kind: RoofKind) -> Option<ComputeRoof> {
    roofs
        .iter()
        .filter(|r| r.probe.kind() == kind)
        .copied()
        .max_by(|a, b| a.ops_per_s.total_cmp(&b.ops_per_s))
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The probes' loops. Each fills its constant registers from `ONES` (every byte 1, or
    //! every f32 1.0), zeroes its accumulators, runs `iters` iterations of independent
    //! accumulator steps, and stores the accumulators to `out`, which [`run`] sums.

    use std::arch::asm;

    use super::Probe;

    /// Every byte 1 (as u8 and as i8 operands), every i16 lane 1 (`0x0101` would be
    /// wrong: the i16 ones are a separate constant), every f32 1.0.
    const BYTE_ONES: u32 = 0x0101_0101;
    const WORD_ONES: u32 = 0x0001_0001;
    const F32_ONE: u32 = 0x3f80_0000;

    /// Runs `probe`'s loop and returns the sum of its accumulators' lanes (integer lanes
    /// wrap at 2^32; f32 lanes are exact while below 2^24).
    ///
    /// # Safety
    /// The CPU must run `probe` ([`Probe::runs_on`]).
    pub(super) unsafe fn run(probe: Probe, iters: u64) -> u64 {
        if iters == 0 {
            return 0;
        }
        let mut out = [0u32; 16 * 10];
        match probe {
            // SAFETY: the caller checked the probe's features; `out` holds 10 zmm.
            Probe::Int8Avx512Vnni => unsafe { vnni512(iters, &mut out) },
            // SAFETY: as above; `out` holds 10 ymm.
            Probe::Int8AvxVnni => unsafe { avx_vnni(iters, &mut out) },
            // SAFETY: as above; `out` holds 6 ymm.
            Probe::Int8Avx2 => unsafe { maddubs(iters, &mut out) },
            // SAFETY: as above; `out` holds 10 zmm.
            Probe::F32FmaAvx512 => unsafe { fma512(iters, &mut out) },
            // SAFETY: as above; `out` holds 10 ymm.
            Probe::F32FmaAvx2 => unsafe { fma256(iters, &mut out) },
        }
        match probe.kind() {
            super::RoofKind::Int8 => out.iter().fold(0u64, |a, &v| a.wrapping_add(v as u64)),
            super::RoofKind::F32 => out.iter().map(|&v| f32::from_bits(v) as u64).sum(),
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn vnni512(iters: u64, out: &mut [u32; 160]) {
        // SAFETY: registers only, then ten 64-byte stores into `out` (640 bytes); the
        // features are enabled on this function and checked by the caller.
        unsafe {
            asm!(
                "vpbroadcastd zmm0, {ones:e}",
                "vmovdqa64 zmm1, zmm0",
                "vpxord zmm2, zmm2, zmm2", "vpxord zmm3, zmm3, zmm3", "vpxord zmm4, zmm4, zmm4",
                "vpxord zmm5, zmm5, zmm5", "vpxord zmm6, zmm6, zmm6", "vpxord zmm7, zmm7, zmm7",
                "vpxord zmm8, zmm8, zmm8", "vpxord zmm9, zmm9, zmm9", "vpxord zmm10, zmm10, zmm10",
                "vpxord zmm11, zmm11, zmm11",
                "2:",
                "vpdpbusd zmm2, zmm0, zmm1", "vpdpbusd zmm3, zmm0, zmm1", "vpdpbusd zmm4, zmm0, zmm1",
                "vpdpbusd zmm5, zmm0, zmm1", "vpdpbusd zmm6, zmm0, zmm1", "vpdpbusd zmm7, zmm0, zmm1",
                "vpdpbusd zmm8, zmm0, zmm1", "vpdpbusd zmm9, zmm0, zmm1", "vpdpbusd zmm10, zmm0, zmm1",
                "vpdpbusd zmm11, zmm0, zmm1",
                "dec {n}",
                "jnz 2b",
                "vmovdqu32 [{out}], zmm2", "vmovdqu32 [{out} + 64], zmm3", "vmovdqu32 [{out} + 128], zmm4",
                "vmovdqu32 [{out} + 192], zmm5", "vmovdqu32 [{out} + 256], zmm6",
                "vmovdqu32 [{out} + 320], zmm7", "vmovdqu32 [{out} + 384], zmm8",
                "vmovdqu32 [{out} + 448], zmm9", "vmovdqu32 [{out} + 512], zmm10",
                "vmovdqu32 [{out} + 576], zmm11",
                "vzeroupper",
                ones = in(reg) BYTE_ONES,
                n = inout(reg) iters => _,
                out = in(reg) out.as_mut_ptr(),
                out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _,
                out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _,
                out("zmm10") _, out("zmm11") _,
                options(nostack),
            );
        }
    }

    #[target_feature(enable = "avx2,avxvnni")]
    unsafe fn avx_vnni(iters: u64, out: &mut [u32; 160]) {
        // SAFETY: registers only, then ten 32-byte stores into `out`; the VEX encoding
        // (`{vex}`) runs on AVX-VNNI CPUs without AVX-512, which the caller checked.
        unsafe {
            asm!(
                "vmovd xmm0, {ones:e}",
                "vpbroadcastd ymm0, xmm0",
                "vmovdqa ymm1, ymm0",
                "vpxor ymm2, ymm2, ymm2", "vpxor ymm3, ymm3, ymm3", "vpxor ymm4, ymm4, ymm4",
                "vpxor ymm5, ymm5, ymm5", "vpxor ymm6, ymm6, ymm6", "vpxor ymm7, ymm7, ymm7",
                "vpxor ymm8, ymm8, ymm8", "vpxor ymm9, ymm9, ymm9", "vpxor ymm10, ymm10, ymm10",
                "vpxor ymm11, ymm11, ymm11",
                "2:",
                "{{vex}} vpdpbusd ymm2, ymm0, ymm1", "{{vex}} vpdpbusd ymm3, ymm0, ymm1",
                "{{vex}} vpdpbusd ymm4, ymm0, ymm1", "{{vex}} vpdpbusd ymm5, ymm0, ymm1",
                "{{vex}} vpdpbusd ymm6, ymm0, ymm1", "{{vex}} vpdpbusd ymm7, ymm0, ymm1",
                "{{vex}} vpdpbusd ymm8, ymm0, ymm1", "{{vex}} vpdpbusd ymm9, ymm0, ymm1",
                "{{vex}} vpdpbusd ymm10, ymm0, ymm1", "{{vex}} vpdpbusd ymm11, ymm0, ymm1",
                "dec {n}",
                "jnz 2b",
                "vmovdqu [{out}], ymm2", "vmovdqu [{out} + 32], ymm3", "vmovdqu [{out} + 64], ymm4",
                "vmovdqu [{out} + 96], ymm5", "vmovdqu [{out} + 128], ymm6", "vmovdqu [{out} + 160], ymm7",
                "vmovdqu [{out} + 192], ymm8", "vmovdqu [{out} + 224], ymm9",
                "vmovdqu [{out} + 256], ymm10", "vmovdqu [{out} + 288], ymm11",
                "vzeroupper",
                ones = in(reg) BYTE_ONES,
                n = inout(reg) iters => _,
                out = in(reg) out.as_mut_ptr(),
                out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _, out("ymm4") _,
                out("ymm5") _, out("ymm6") _, out("ymm7") _, out("ymm8") _, out("ymm9") _,
                out("ymm10") _, out("ymm11") _,
                options(nostack),
            );
        }
    }

    #[target_feature(enable = "avx2")]
    unsafe fn maddubs(iters: u64, out: &mut [u32; 160]) {
        // SAFETY: registers only, then six 32-byte stores into `out`; AVX2 is enabled on
        // this function and checked by the caller.
        unsafe {
            asm!(
                "vmovd xmm0, {ones:e}",
                "vpbroadcastd ymm0, xmm0",
                "vmovdqa ymm1, ymm0",
                "vmovd xmm2, {words:e}",
                "vpbroadcastd ymm2, xmm2",
                "vpxor ymm9, ymm9, ymm9", "vpxor ymm10, ymm10, ymm10", "vpxor ymm11, ymm11, ymm11",
                "vpxor ymm12, ymm12, ymm12", "vpxor ymm13, ymm13, ymm13", "vpxor ymm14, ymm14, ymm14",
                "2:",
                "vpmaddubsw ymm3, ymm0, ymm1", "vpmaddubsw ymm4, ymm0, ymm1", "vpmaddubsw ymm5, ymm0, ymm1",
                "vpmaddubsw ymm6, ymm0, ymm1", "vpmaddubsw ymm7, ymm0, ymm1", "vpmaddubsw ymm8, ymm0, ymm1",
                "vpmaddwd ymm3, ymm3, ymm2", "vpmaddwd ymm4, ymm4, ymm2", "vpmaddwd ymm5, ymm5, ymm2",
                "vpmaddwd ymm6, ymm6, ymm2", "vpmaddwd ymm7, ymm7, ymm2", "vpmaddwd ymm8, ymm8, ymm2",
                "vpaddd ymm9, ymm9, ymm3", "vpaddd ymm10, ymm10, ymm4", "vpaddd ymm11, ymm11, ymm5",
                "vpaddd ymm12, ymm12, ymm6", "vpaddd ymm13, ymm13, ymm7", "vpaddd ymm14, ymm14, ymm8",
                "dec {n}",
                "jnz 2b",
                "vmovdqu [{out}], ymm9", "vmovdqu [{out} + 32], ymm10", "vmovdqu [{out} + 64], ymm11",
                "vmovdqu [{out} + 96], ymm12", "vmovdqu [{out} + 128], ymm13", "vmovdqu [{out} + 160], ymm14",
                "vzeroupper",
                ones = in(reg) BYTE_ONES,
                words = in(reg) WORD_ONES,
                n = inout(reg) iters => _,
                out = in(reg) out.as_mut_ptr(),
                out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _, out("ymm4") _,
                out("ymm5") _, out("ymm6") _, out("ymm7") _, out("ymm8") _, out("ymm9") _,
                out("ymm10") _, out("ymm11") _, out("ymm12") _, out("ymm13") _, out("ymm14") _,
                options(nostack),
            );
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn fma512(iters: u64, out: &mut [u32; 160]) {
        // SAFETY: registers only, then ten 64-byte stores into `out`; AVX-512F is enabled
        // on this function and checked by the caller.
        unsafe {
            asm!(
                "vpbroadcastd zmm0, {one:e}",
                "vmovaps zmm1, zmm0",
                "vpxord zmm2, zmm2, zmm2", "vpxord zmm3, zmm3, zmm3", "vpxord zmm4, zmm4, zmm4",
                "vpxord zmm5, zmm5, zmm5", "vpxord zmm6, zmm6, zmm6", "vpxord zmm7, zmm7, zmm7",
                "vpxord zmm8, zmm8, zmm8", "vpxord zmm9, zmm9, zmm9", "vpxord zmm10, zmm10, zmm10",
                "vpxord zmm11, zmm11, zmm11",
                "2:",
                "vfmadd231ps zmm2, zmm0, zmm1", "vfmadd231ps zmm3, zmm0, zmm1", "vfmadd231ps zmm4, zmm0, zmm1",
                "vfmadd231ps zmm5, zmm0, zmm1", "vfmadd231ps zmm6, zmm0, zmm1", "vfmadd231ps zmm7, zmm0, zmm1",
                "vfmadd231ps zmm8, zmm0, zmm1", "vfmadd231ps zmm9, zmm0, zmm1", "vfmadd231ps zmm10, zmm0, zmm1",
                "vfmadd231ps zmm11, zmm0, zmm1",
                "dec {n}",
                "jnz 2b",
                "vmovdqu32 [{out}], zmm2", "vmovdqu32 [{out} + 64], zmm3", "vmovdqu32 [{out} + 128], zmm4",
                "vmovdqu32 [{out} + 192], zmm5", "vmovdqu32 [{out} + 256], zmm6",
                "vmovdqu32 [{out} + 320], zmm7", "vmovdqu32 [{out} + 384], zmm8",
                "vmovdqu32 [{out} + 448], zmm9", "vmovdqu32 [{out} + 512], zmm10",
                "vmovdqu32 [{out} + 576], zmm11",
                "vzeroupper",
                one = in(reg) F32_ONE,
                n = inout(reg) iters => _,
                out = in(reg) out.as_mut_ptr(),
                out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _,
                out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _,
                out("zmm10") _, out("zmm11") _,
                options(nostack),
            );
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn fma256(iters: u64, out: &mut [u32; 160]) {
        // SAFETY: registers only, then ten 32-byte stores into `out`; AVX2 and FMA are
        // enabled on this function and checked by the caller.
        unsafe {
            asm!(
                "vmovd xmm0, {one:e}",
                "vbroadcastss ymm0, xmm0",
                "vmovaps ymm1, ymm0",
                "vxorps ymm2, ymm2, ymm2", "vxorps ymm3, ymm3, ymm3", "vxorps ymm4, ymm4, ymm4",
                "vxorps ymm5, ymm5, ymm5", "vxorps ymm6, ymm6, ymm6", "vxorps ymm7, ymm7, ymm7",
                "vxorps ymm8, ymm8, ymm8", "vxorps ymm9, ymm9, ymm9", "vxorps ymm10, ymm10, ymm10",
                "vxorps ymm11, ymm11, ymm11",
                "2:",
                "vfmadd231ps ymm2, ymm0, ymm1", "vfmadd231ps ymm3, ymm0, ymm1", "vfmadd231ps ymm4, ymm0, ymm1",
                "vfmadd231ps ymm5, ymm0, ymm1", "vfmadd231ps ymm6, ymm0, ymm1", "vfmadd231ps ymm7, ymm0, ymm1",
                "vfmadd231ps ymm8, ymm0, ymm1", "vfmadd231ps ymm9, ymm0, ymm1", "vfmadd231ps ymm10, ymm0, ymm1",
                "vfmadd231ps ymm11, ymm0, ymm1",
                "dec {n}",
                "jnz 2b",
                "vmovdqu [{out}], ymm2", "vmovdqu [{out} + 32], ymm3", "vmovdqu [{out} + 64], ymm4",
                "vmovdqu [{out} + 96], ymm5", "vmovdqu [{out} + 128], ymm6", "vmovdqu [{out} + 160], ymm7",
                "vmovdqu [{out} + 192], ymm8", "vmovdqu [{out} + 224], ymm9",
                "vmovdqu [{out} + 256], ymm10", "vmovdqu [{out} + 288], ymm11",
                "vzeroupper",
                one = in(reg) F32_ONE,
                n = inout(reg) iters => _,
                out = in(reg) out.as_mut_ptr(),
                out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _, out("ymm4") _,
                out("ymm5") _, out("ymm6") _, out("ymm7") _, out("ymm8") _, out("ymm9") _,
                out("ymm10") _, out("ymm11") _,
                options(nostack),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_multiply_accumulate_counts_two_operations() {
        // One thread, one iteration of ten vpdpbusd zmm: 10 x 64 products, 1280 operations.
        assert_eq!(ops(Probe::Int8Avx512Vnni, 1, 1), 1280);
        // The AVX2 chain: six steps of 32 products, two threads, three iterations.
        assert_eq!(ops(Probe::Int8Avx2, 2, 3), 2 * 3 * 6 * 32 * 2);
        assert_eq!(ops(Probe::F32FmaAvx2, 1, 1), 10 * 8 * 2);
        assert_eq!(ops(Probe::F32FmaAvx512, 4, 1), 4 * 10 * 16 * 2);
        assert_eq!(ops(Probe::Int8AvxVnni, 1, 5), 5 * 10 * 32 * 2);
    }

    #[test]
    fn the_dispatcher_offers_only_probes_the_features_run() {
        let none = CpuFeatures::default();
        assert!(probes(none).is_empty());
        let avx2 = CpuFeatures { avx2: true, ..none };
        let zen4 = CpuFeatures { avx512bw: true, avx512vnni: true, ..avx2 };
        let alder = CpuFeatures { avx_vnni: true, ..avx2 };
        if cfg!(target_arch = "x86_64") {
            assert_eq!(probes(avx2), [Probe::Int8Avx2, Probe::F32FmaAvx2]);
            assert_eq!(
                probes(zen4),
                [Probe::Int8Avx512Vnni, Probe::Int8Avx2, Probe::F32FmaAvx512, Probe::F32FmaAvx2]
            );
            assert_eq!(probes(alder), [Probe::Int8AvxVnni, Probe::Int8Avx2, Probe::F32FmaAvx2]);
            // AVX-512 without VNNI: the zmm FMA, not the VNNI probe.
            let skylake = CpuFeatures { avx512bw: true, ..avx2 };
            assert!(!probes(skylake).contains(&Probe::Int8Avx512Vnni));
            assert!(probes(skylake).contains(&Probe::F32FmaAvx512));
            // VNNI flags without the AVX2 set run nothing.
            assert!(probes(CpuFeatures { avx512vnni: true, avx_vnni: true, ..none }).is_empty());
        } else {
            assert!(probes(zen4).is_empty() && probes(alder).is_empty());
        }
        // This CPU's list is the dispatcher's answer for its detected features.
        assert_eq!(available(), probes(CpuFeatures::detected()));
    }

    #[test]
    fn each_loop_does_exactly_the_multiply_accumulates_counted() {
        // With every operand 1, each product adds one to its lane: the lanes' sum is the
        // multiply-accumulates the loop did, which the ops formula counts twice.
        for probe in Probe::ALL {
            for iters in [1, 7, 1000] {
                let got = run_loop(probe, iters);
                if probe.runs_on(CpuFeatures::detected()) {
                    assert_eq!(got, Some(ops(probe, 1, iters) / 2), "{probe:?} at {iters}");
                } else {
                    assert_eq!(got, None, "{probe:?} does not run here");
                }
            }
            assert_eq!(run_loop(probe, 0).unwrap_or(0), 0);
        }
        // Every thread of the pool runs its loop.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        for probe in available() {
            assert_eq!(pool.install(|| run_on_pool(probe, 5)), Some(ops(probe, 3, 5) / 2), "{probe:?}");
        }
    }

    #[test]
    fn names_round_trip_and_the_best_roof_is_per_kind() {
        for p in Probe::ALL {
            assert_eq!(Probe::from_name(p.as_str()), Some(p));
        }
        assert_eq!(Probe::from_name("amx_int8"), None);
        let r = |probe, ops_per_s| ComputeRoof { probe, ops_per_s, threads: 2 };
        let roofs = [r(Probe::Int8Avx2, 1e12), r(Probe::Int8Avx512Vnni, 2e12), r(Probe::F32FmaAvx2, 3e11)];
        assert_eq!(best(&roofs, RoofKind::Int8).map(|r| r.probe), Some(Probe::Int8Avx512Vnni));
        assert_eq!(best(&roofs, RoofKind::F32).map(|r| r.probe), Some(Probe::F32FmaAvx2));
        assert!(best(&roofs[..0], RoofKind::Int8).is_none());
    }
}
