//! The device forward pass ([`kiln_cuda::model`]) run through the host execution of its
//! kernels, through the checks in `model/`.
#![cfg(feature = "host-exec")]

mod model;

use kiln_cuda::Exec;

fn host(limit: u64) -> Exec {
    Exec::host(limit)
}

#[test]
fn the_device_forward_matches_the_cpu_forward_on_a_llama_shape() {
    model::compare_with_cpu(&host, "tiny");
}

#[test]
fn the_device_forward_matches_the_cpu_forward_on_a_qwen_shape_with_biases_and_an_untied_head() {
    model::compare_with_cpu(&host, "tiny-qwen");
}

#[test]
fn eight_bit_weights_match_too() {
    model::compare_with_cpu(&host, "tiny@8bit");
}

#[test]
fn prefill_in_chunks_of_up_to_eight_equals_decoding_token_by_token_bit_for_bit() {
    model::prefill_in_chunks_of_up_to_eight_equals_decoding_token_by_token_bit_for_bit(&host);
}

#[test]
fn every_rows_logits_match_the_last_rows_and_the_cpus() {
    model::every_rows_logits_match_the_last_rows_and_the_cpus(&host);
}

#[test]
fn the_plan_is_the_device_pools_peak_and_a_smaller_limit_is_out_of_memory() {
    model::the_plan_is_the_device_pools_peak_and_a_smaller_limit_is_out_of_memory(&host);
}

#[test]
fn bad_tokens_and_models_the_device_forward_does_not_run_are_refused_by_name() {
    model::bad_tokens_and_models_the_device_forward_does_not_run_are_refused_by_name(&host);
}

#[test]
fn decode_graphs_give_the_same_bits_and_update_only_the_positional_nodes() {
    model::decode_graphs_give_the_same_bits_and_update_only_the_positional_nodes(&host);
}
