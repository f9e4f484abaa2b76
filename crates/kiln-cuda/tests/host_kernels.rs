//! Every kernel of kiln-cuda run on the host: the `.cu` source compiled through
//! `host_shim.h` (feature `host-exec`, on by default), through the checks in `common/`.
#![cfg(feature = "host-exec")]

mod common;

use common::{Backend, Buf};
use kiln_cuda::{Launch, host, launch};

/// Host memory for the host execution, 16-byte aligned (as the launch builders require of
/// what the kernels read 16 bytes at a time), handed to the kernels by address.
struct HostBuf {
    ptr: *mut u128,
    words: usize,
    bytes: usize,
}

impl Buf for HostBuf {
    fn addr(&self) -> u64 {
        self.ptr as u64
    }

    fn read(&self) -> Vec<u8> {
        // SAFETY: `ptr` owns `words` u128s (at least `bytes` bytes), initialised at
        // creation; no launch is running (they are synchronous).
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<u8>(), self.bytes) }.to_vec()
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` and `words` came from `Box::into_raw` of a boxed slice of that length.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.words)) });
    }
}

struct Host;

impl Backend for Host {
    type B<'a> = HostBuf;

    fn upload(&self, bytes: &[u8]) -> HostBuf {
        let words = bytes.len().div_ceil(16).max(1);
        let mut v = vec![0u128; words].into_boxed_slice();
        bytemuck::cast_slice_mut::<u128, u8>(&mut v)[..bytes.len()].copy_from_slice(bytes);
        HostBuf { ptr: Box::into_raw(v).cast::<u128>(), words, bytes: bytes.len() }
    }

    fn run(&self, l: &Launch) {
        // SAFETY: the checks size every buffer with the launch builders' byte counts and
        // keep them alive across the call; host buffers never alias one another.
        unsafe { host::run(l) }.unwrap_or_else(|e| panic!("{}: {e}", l.kernel));
    }

    fn host_libm(&self) -> bool {
        true
    }
}

#[test]
fn the_host_execution_holds_every_kernel_the_builders_name() {
    let kernels: Vec<String> = host::kernels().into_iter().filter(|k| !k.starts_with("kiln_test_")).collect();
    assert_eq!(kernels, launch::all_kernels());
}

/// Set in the child the next test starts; read by nothing else.
const ABORT_CHILD: &str = "KILN_TEST_HOST_ABORT_CHILD";

#[test]
fn a_shuffle_reached_by_part_of_a_warp_aborts_with_a_message() {
    if std::env::var_os(ABORT_CHILD).is_some() {
        // The abort below must not leave a core file in the crate directory.
        let none = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: setrlimit reads the struct it is given; lowering one's own core limit
        // has no other effect.
        unsafe { libc::setrlimit(libc::RLIMIT_CORE, &none) };
        let out = Host.upload(&[0u8; 128]);
        let l = Launch {
            kernel: "kiln_test_partial_warp".into(),
            grid: [1, 1, 1],
            block: [32, 1, 1],
            args: vec![kiln_cuda::Arg::Ptr(out.addr())],
        };
        Host.run(&l);
        unreachable!("the host execution ran a shuffle half a warp reached");
    }
    let name = "a_shuffle_reached_by_part_of_a_warp_aborts_with_a_message";
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(ABORT_CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the child succeeded: {stderr}");
    assert!(
        stderr.contains("kiln host execution: a warp operation was reached by only part of the warp"),
        "status {:?}, stderr:\n{stderr}",
        out.status
    );
}

#[test]
fn qmv_and_qmv_wide_match_the_reference_within_their_bound_and_each_other_bit_for_bit() {
    common::qmv_and_qmv_wide_match_the_reference_within_their_bound_and_each_other_bit_for_bit(&Host);
}

#[test]
fn rms_norm_matches_the_f64_formula_within_its_bound() {
    common::rms_norm_matches_the_f64_formula_within_its_bound(&Host);
}

#[test]
fn silu_mul_and_add_match_their_formulas() {
    common::silu_mul_and_add_match_their_formulas(&Host);
}

#[test]
fn rope_rotates_as_kiln_model_does_for_default_and_scaled_frequencies() {
    common::rope_rotates_as_kiln_model_does_for_default_and_scaled_frequencies(&Host);
}

#[test]
fn embedding_rows_are_the_formats_dequantization_bit_for_bit() {
    common::embedding_rows_are_the_formats_dequantization_bit_for_bit(&Host);
}

#[test]
fn decode_attention_matches_the_exact_softmax_within_kiln_cores_bound() {
    common::decode_attention_matches_the_exact_softmax_within_kiln_cores_bound(&Host);
}

#[test]
fn kv_store_rounds_new_keys_and_values_to_f16_in_place() {
    common::kv_store_rounds_new_keys_and_values_to_f16_in_place(&Host);
}

#[test]
fn qmm_matches_the_exact_product_within_its_bound_and_rows_do_not_depend_on_m() {
    common::qmm_matches_the_exact_product_within_its_bound_and_rows_do_not_depend_on_m(&Host);
}

#[test]
fn moe_route_picks_kiln_models_experts_and_weights() {
    common::moe_route_picks_kiln_models_experts_and_weights(&Host);
}

#[test]
fn moe_gather_and_accumulate_follow_kiln_models_expert_loop() {
    common::moe_gather_and_accumulate_follow_kiln_models_expert_loop(&Host);
}
