//! The spill check (feature `cuda`): every embedded module's PTX through `ptxas -v` for
//! sm_80 and sm_90, with the ptxas build.rs used; fails when any kernel spills registers
//! to local memory or is missing from the report. `scripts/cuda/ptxas-check.sh` runs it.
#![cfg(feature = "cuda")]

use kiln_cuda::launch::{all_kernels, module_of};
use kiln_cuda::modules::{MODULES, PTXAS};
use kiln_cuda::ptxas;

#[test]
fn no_kernel_spills_on_sm_80_or_sm_90() {
    let dir = std::env::temp_dir().join(format!("kiln-cuda-ptxas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut failures = Vec::new();
    for m in MODULES {
        let ptx = dir.join(format!("{}.ptx", m.name));
        std::fs::write(&ptx, m.ptx).unwrap();
        for arch in ["sm_80", "sm_90"] {
            let out = std::process::Command::new(PTXAS)
                .args(["-v", "-O3", &format!("-arch={arch}")])
                .arg(&ptx)
                .arg("-o")
                .arg(dir.join(format!("{}.{arch}.cubin", m.name)))
                .output()
                .unwrap_or_else(|e| panic!("cannot run {PTXAS}: {e}"));
            let report = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "ptxas failed on {} for {arch}:\n{report}", m.name);
            let kernels = ptxas::parse(&report);
            for k in &kernels {
                println!(
                    "{:<28} {arch}  {:>3} registers  {:>5} B smem  {:>3} B stack  spills {}/{} B",
                    k.name, k.registers, k.shared_bytes, k.stack_bytes, k.spill_stores, k.spill_loads
                );
                if k.spills() {
                    failures.push(format!(
                        "{} on {arch} spills {} B stores, {} B loads",
                        k.name, k.spill_stores, k.spill_loads
                    ));
                }
            }
            for want in all_kernels().into_iter().filter(|k| module_of(k) == m.name) {
                if !kernels.iter().any(|k| k.name == want) {
                    failures.push(format!("{want} is missing from ptxas's report for {arch}"));
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "register spills:\n{}", failures.join("\n"));
}
