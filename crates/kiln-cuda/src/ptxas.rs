//! ptxas's resource report (`ptxas -v`), read per kernel: registers, stack frame, spill
//! stores and loads, shared memory. The spill check (`scripts/cuda/ptxas-check.sh`, the
//! `ptxas_spills` test) fails when any kernel spills.

/// One kernel's resources on one architecture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelResources {
    /// The kernel's symbol.
    pub name: String,
    /// The target (`sm_90`).
    pub arch: String,
    /// Registers per thread.
    pub registers: u32,
    /// Stack frame bytes per thread.
    pub stack_bytes: u32,
    /// Bytes of spill stores.
    pub spill_stores: u32,
    /// Bytes of spill loads.
    pub spill_loads: u32,
    /// Static shared memory per block.
    pub shared_bytes: u32,
}

impl KernelResources {
    /// Whether the kernel spills registers to local memory.
    pub fn spills(&self) -> bool {
        self.spill_stores > 0 || self.spill_loads > 0
    }
}

fn number_before(line: &str, unit: &str) -> Option<u32> {
    let at = line.find(unit)?;
    line[..at].split([' ', ',']).rfind(|s| !s.is_empty())?.parse().ok()
}

/// Reads every kernel of a `ptxas -v` report. A kernel whose properties or register
/// line is missing is left out, so a caller comparing against the kernels it expects
/// sees it missing.
pub fn parse(report: &str) -> Vec<KernelResources> {
    let mut out = Vec::new();
    let mut cur: Option<KernelResources> = None;
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            if let Some(k) = cur.take() {
                out.push(k);
            }
            let mut parts = rest.split('\'');
            let name = parts.next().unwrap_or_default().to_string();
            let arch = parts.nth(1).unwrap_or_default().to_string();
            cur = Some(KernelResources {
                name,
                arch,
                registers: u32::MAX,
                stack_bytes: 0,
                spill_stores: 0,
                spill_loads: 0,
                shared_bytes: 0,
            });
        } else if let Some(k) = cur.as_mut() {
            if line.contains("bytes stack frame") {
                k.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
                k.spill_stores = number_before(line, "bytes spill stores").unwrap_or(u32::MAX);
                k.spill_loads = number_before(line, "bytes spill loads").unwrap_or(u32::MAX);
            } else if line.contains("Used ") && line.contains(" registers") {
                k.registers = number_before(line, "registers").unwrap_or(u32::MAX);
                k.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    if let Some(k) = cur.take() {
        out.push(k);
    }
    out.retain(|k| k.registers != u32::MAX);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // Recorded from ptxas 12.9 on attn.cu before its launch bounds named blocks per
    // multiprocessor: the 64-wide split kernel spilled on sm_80.
    const REPORT: &str = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kiln_attn_split_d64' for 'sm_80'
ptxas info    : Function properties for kiln_attn_split_d64
    8 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 8 bytes cumulative stack size, 8448 bytes smem, 412 bytes cmem[0], 8 bytes cmem[2]
ptxas info    : Compile time = 155.990 ms
ptxas info    : Compiling entry function 'kiln_rope_f32' for 'sm_80'
ptxas info    : Function properties for kiln_rope_f32
    40 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 40 bytes cumulative stack size, 380 bytes cmem[0]
";

    #[test]
    fn reads_registers_spills_and_shared_memory_per_kernel() {
        let k = parse(REPORT);
        assert_eq!(k.len(), 2);
        assert_eq!(
            k[0],
            KernelResources {
                name: "kiln_attn_split_d64".into(),
                arch: "sm_80".into(),
                registers: 64,
                stack_bytes: 8,
                spill_stores: 8,
                spill_loads: 4,
                shared_bytes: 8448,
            }
        );
        assert!(k[0].spills());
        // A stack frame without spills (the trigonometric range reduction) is no spill.
        assert_eq!((k[1].stack_bytes, k[1].spills(), k[1].registers), (40, false, 32));
    }
}
