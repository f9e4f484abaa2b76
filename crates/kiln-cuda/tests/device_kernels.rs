//! The kernel checks of `common/` on a GPU (feature `cuda`): with `KILN_TEST_CUDA=1` the
//! embedded cubins (or PTX) are launched through the driver on device 0 and held to the
//! same references and bounds as the host execution; RoPE, whose double `cos` and `sin`
//! come from the device's library, gets its device bound instead of bit equality. Without
//! the variable the test says it checked nothing: CI has no GPU.
//! `scripts/device/cuda-check.sh` runs it on a GPU host.
#![cfg(feature = "cuda")]

mod common;

use common::{Backend, Buf};
use kiln_core::Tag;
use kiln_cuda::Launch;
use kiln_cuda::device::{Device, DeviceBuffer};

impl Buf for DeviceBuffer<'_> {
    fn addr(&self) -> u64 {
        DeviceBuffer::addr(self)
    }

    fn read(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.bytes()];
        self.download(&mut v).unwrap_or_else(|e| panic!("download: {e}"));
        v
    }
}

struct Gpu(Device);

impl Backend for Gpu {
    type B<'a> = DeviceBuffer<'a>;

    fn upload<'a>(&'a self, bytes: &[u8]) -> DeviceBuffer<'a> {
        let mut b = self.0.alloc(Tag::Scratch, bytes.len()).unwrap_or_else(|e| panic!("alloc: {e}"));
        b.upload(bytes).unwrap_or_else(|e| panic!("upload: {e}"));
        b
    }

    fn run(&self, l: &Launch) {
        // SAFETY: the checks allocate every buffer on this device with the launch
        // builders' byte counts and keep them alive until after the synchronize.
        unsafe { self.0.launch(l) }.unwrap_or_else(|e| panic!("{}: {e}", l.kernel));
        self.0.synchronize().unwrap_or_else(|e| panic!("{} failed on the device: {e}", l.kernel));
    }

    fn host_libm(&self) -> bool {
        false
    }
}

#[test]
fn every_kernel_matches_its_reference_on_the_gpu() {
    if std::env::var_os("KILN_TEST_CUDA").is_none_or(|v| v != "1") {
        eprintln!("KILN_TEST_CUDA is not 1: no kernel was run on a GPU");
        return;
    }
    // One thread drives the device: its context is current on this thread only.
    let gpu = Gpu(Device::open(0).unwrap_or_else(|e| panic!("KILN_TEST_CUDA=1 but {e}")));
    eprintln!(
        "device 0: {} (compute capability {}.{}, image {:?}, {} bytes)",
        gpu.0.name(),
        gpu.0.capability().0,
        gpu.0.capability().1,
        gpu.0.image(),
        gpu.0.total_bytes()
    );
    type Case = fn(&Gpu);
    let cases: [(&str, Case); 10] = [
        ("qmv", common::qmv_and_qmv_wide_match_the_reference_within_their_bound_and_each_other_bit_for_bit),
        ("rms_norm", common::rms_norm_matches_the_f64_formula_within_its_bound),
        ("silu_mul, add", common::silu_mul_and_add_match_their_formulas),
        ("rope", common::rope_rotates_as_kiln_model_does_for_default_and_scaled_frequencies),
        ("embed", common::embedding_rows_are_the_formats_dequantization_bit_for_bit),
        ("attention", common::decode_attention_matches_the_exact_softmax_within_kiln_cores_bound),
        ("kv_store", common::kv_store_rounds_new_keys_and_values_to_f16_in_place),
        ("qmm", common::qmm_matches_the_exact_product_within_its_bound_and_rows_do_not_depend_on_m),
        ("moe_route", common::moe_route_picks_kiln_models_experts_and_weights),
        ("moe gather, accumulate", common::moe_gather_and_accumulate_follow_kiln_models_expert_loop),
    ];
    for (name, case) in cases {
        let t = std::time::Instant::now();
        case(&gpu);
        eprintln!("ok: {name} ({:.1} s)", t.elapsed().as_secs_f64());
    }
    let st = gpu.0.pool().stats();
    assert_eq!(st.live_bytes, 0, "every device buffer was freed");
    eprintln!("device pool peak {} bytes", st.peak_bytes);
}
