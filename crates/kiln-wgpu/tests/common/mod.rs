//! What the kiln-wgpu tests share: the Vulkan adapter they run on, or a skip with its
//! reason (a failure when `KILN_TEST_VULKAN=required`, as CI sets it).
#![allow(dead_code)] // each test binary uses what it needs

use kiln_wgpu::{Backend, WgpuError, WgpuExec};

/// Whether a missing Vulkan adapter fails the tests (`KILN_TEST_VULKAN=required`) or skips
/// them (unset).
fn required() -> bool {
    match std::env::var("KILN_TEST_VULKAN") {
        Ok(v) if v == "required" => true,
        Ok(v) => {
            panic!("KILN_TEST_VULKAN={v}: accepted is `required` (or unset, to skip without an adapter)")
        }
        Err(_) => false,
    }
}

/// The Vulkan adapter with its pool limited to `limit` bytes, or `None` (printed) when
/// there is none and it is not required.
pub fn vulkan(limit: Option<u64>) -> Option<WgpuExec> {
    match WgpuExec::open(Backend::Vulkan, limit) {
        Ok(e) => Some(e),
        Err(e @ WgpuError::NoAdapter { .. }) => {
            if required() {
                panic!("KILN_TEST_VULKAN=required and {e} (install mesa-vulkan-drivers for lavapipe)");
            }
            eprintln!(
                "skipped: {e}; install mesa-vulkan-drivers, or set KILN_TEST_VULKAN=required to fail here"
            );
            None
        }
        Err(e) => panic!("opening the Vulkan adapter: {e}"),
    }
}
