//! The device forward's checks of `model/` on GPU 0 (feature `cuda`, `KILN_TEST_CUDA=1`):
//! the whole forward through the driver against kiln-model's CPU forward, the plan against
//! the device pool's peak, and the refusals. Without the variable it says it checked
//! nothing: CI has no GPU. `scripts/device/cuda-check.sh` runs it on a GPU host.
#![cfg(feature = "cuda")]

mod model;

use kiln_cuda::Exec;

fn gpu(limit: u64) -> Exec {
    Exec::cuda_limited(0, Some(limit)).unwrap_or_else(|e| panic!("KILN_TEST_CUDA=1 but {e}"))
}

#[test]
fn the_device_forward_matches_the_cpu_forward_on_the_gpu() {
    if std::env::var_os("KILN_TEST_CUDA").is_none_or(|v| v != "1") {
        eprintln!("KILN_TEST_CUDA is not 1: the device forward was not run on a GPU");
        return;
    }
    eprintln!("device 0: {}", gpu(u64::MAX).name());
    // One thread drives the device, so the checks run in turn here.
    for name in ["tiny", "tiny-qwen", "tiny@8bit"] {
        model::compare_with_cpu(&gpu, name);
    }
    model::prefill_in_chunks_of_up_to_eight_equals_decoding_token_by_token_bit_for_bit(&gpu);
    model::every_rows_logits_match_the_last_rows_and_the_cpus(&gpu);
    model::the_plan_is_the_device_pools_peak_and_a_smaller_limit_is_out_of_memory(&gpu);
    model::bad_tokens_and_models_the_device_forward_does_not_run_are_refused_by_name(&gpu);
    model::decode_graphs_give_the_same_bits_and_update_only_the_positional_nodes(&gpu);
    eprintln!("device forward: every check passed on the GPU");
}
