//! The executor on the Vulkan adapter (lavapipe in CI): device memory counted in the pool
//! and refused past its limit as `out of memory:`, copies that round-trip, a plan that
//! counts and runs nothing, and the adapter's description for a fingerprint.

mod common;

use kiln_core::Tag;
use kiln_wgpu::kernels;
use kiln_wgpu::{WgpuError, WgpuExec};

#[test]
fn device_memory_is_counted_refused_over_the_limit_and_round_trips() {
    let Some(e) = common::vulkan(Some(1000)) else { return };
    assert_eq!(e.pool().limit(), 1000);
    // 3 values: 12 bytes, and an odd-length upload (padded on the device, counted as asked).
    let m = e.upload(Tag::Weights, &[1.5f32, -2.0, 3.25]).unwrap();
    let odd = e.upload(Tag::Weights, &[7u16, 8, 9]).unwrap();
    assert_eq!((m.bytes(), odd.bytes()), (12, 6));
    let mut back = [0f32; 2];
    e.read(&m, 4, &mut back).unwrap();
    assert_eq!(back, [-2.0, 3.25]);
    let mut twin = e.alloc(Tag::Scratch, 12).unwrap();
    e.copy(&mut twin, &m).unwrap();
    e.read(&twin, 0, &mut back).unwrap();
    assert_eq!(back, [1.5, -2.0]);
    e.write(&mut twin, 8, bytemuck::bytes_of(&9.5f32)).unwrap();
    let mut all = [0f32; 3];
    e.read(&twin, 0, &mut all).unwrap();
    assert_eq!(all, [1.5, -2.0, 9.5]);
    drop(twin);
    let err = e.alloc(Tag::Kv, 983).err().expect("over the limit");
    assert!(err.is_out_of_memory() && err.to_string().starts_with("out of memory:"), "{err}");
    assert!(err.to_string().contains("kv"), "{err}");
    let kv = e.alloc(Tag::Kv, 982).unwrap();
    let st = e.stats();
    assert_eq!((st.live_bytes, st.peak_bytes), (1000, 1000));
    assert_eq!(st.by_tag["weights"].peak, 18);
    drop((m, odd, kv));
    assert_eq!(e.stats().live_bytes, 0);
}

#[test]
fn a_buffer_larger_than_the_adapter_binds_is_out_of_memory() {
    let Some(e) = common::vulkan(None) else { return };
    let max = e.max_binding_bytes();
    if max >= e.pool().limit() {
        eprintln!("skipped: the pool's limit {} is below the largest binding {max}", e.pool().limit());
        return;
    }
    let err = e.alloc(Tag::Kv, max as usize + 4).err().expect("above the largest binding");
    assert!(matches!(err, WgpuError::DeviceOutOfMemory { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.starts_with("out of memory: the wgpu device refused"), "{msg}");
    assert!(msg.contains("largest storage buffer binding"), "{msg}");
    assert_eq!(e.stats().live_bytes, 0, "a refusal holds nothing");
}

#[test]
fn a_plan_counts_allocations_and_runs_nothing() {
    let p = WgpuExec::plan(100);
    assert!(p.adapter().is_none() && p.name() == "plan");
    let a = p.alloc(Tag::Weights, 60).unwrap();
    let b = p.alloc(Tag::Scratch, 40).unwrap();
    assert!(p.alloc(Tag::Kv, 1).err().unwrap().to_string().starts_with("out of memory:"));
    let d = kernels::add(10, &a, &b).unwrap();
    let e = p.dispatch(&d).unwrap_err();
    assert_eq!(e.to_string(), "the wgpu backend does not run add: a plan counts memory and runs nothing");
    drop((a, b));
    assert_eq!(p.stats().peak_bytes, 100);
}

#[test]
fn the_adapter_is_described_for_a_fingerprint() {
    let Some(e) = common::vulkan(None) else { return };
    let a = e.adapter().expect("a device");
    assert_eq!(a.backend, "vulkan");
    assert!(!a.name.is_empty() && !a.driver.is_empty(), "{a:?}");
    assert!(a.memory_bytes > 0, "{a:?}");
    assert!(e.pool().limit() <= a.memory_bytes);
    assert_eq!(a.memory_source, "the Vulkan device-local heap", "{a:?}");
    assert!(e.name().ends_with("(vulkan)"), "{}", e.name());
    eprintln!("{a:?}");
}

#[test]
fn the_executor_and_its_buffers_move_between_threads() {
    // A serving thread opens or receives the executor and owns it with every engine and
    // cache built on it (the executor is Send, not Sync: its queued dispatches are one
    // thread's).
    fn send<T: Send>() {}
    send::<WgpuExec>();
    send::<kiln_wgpu::Mem>();
    send::<kiln_wgpu::WgpuCache>();
}
