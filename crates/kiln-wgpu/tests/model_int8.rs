//! The wgpu forward under `int8` against the CPU's forward under `int8`, on the tiny
//! synthetic models, on the packed and the plain dot-product path: the CPU's activation
//! scheme is read once per process, so this binary sets `KILN_ACT_PRECISION=int8` before
//! any test touches the engine (tests/model.rs covers `int16`, the CPU's default).

mod common;

use std::sync::Once;

use kiln_core::act_precision::{ACT_PRECISION_ENV, ActScheme, act_scheme};

/// Selects `int8` for this process's CPU kernels; every test calls it first.
fn int8_activations() {
    static SET: Once = Once::new();
    SET.call_once(|| {
        // SAFETY: every test of this binary calls this function before anything else, and
        // `Once` makes all of them wait until it returns, so no other thread reads or
        // writes the environment while it is being set.
        unsafe { std::env::set_var(ACT_PRECISION_ENV, "int8") };
    });
    assert_eq!(act_scheme(), ActScheme::Int8);
}

#[test]
fn the_int8_forward_matches_the_cpus_int8_forward_closely_on_both_dot_paths() {
    int8_activations();
    // 4-bit weights take 8-bit codes, 8-bit weights 16-bit codes, as on the CPU.
    for name in ["tiny", "tiny-qwen", "tiny@8bit"] {
        common::compare_with_cpu(name, ActScheme::Int8, common::SAME_SCHEME_TOLERANCE);
    }
}

#[test]
fn the_plain_path_gives_the_packed_paths_logits_bit_for_bit() {
    int8_activations();
    let Some(exec) = common::vulkan(None) else { return };
    let m = common::load("tiny-qwen");
    let ids = common::prompt(12, m.config.vocab_size);
    let run = |plain: bool| {
        exec.force_plain_dot(plain);
        let mut dev = kiln_wgpu::WgpuEngine::new(&exec, &m.config, &m.weights).unwrap();
        dev.set_act_scheme(ActScheme::Int8).unwrap();
        assert_eq!(
            dev.products_desc(),
            format!("act=int8 dot={}", if exec.packed_dot() { "packed" } else { "plain" })
        );
        let mut cache = dev.new_cache(16).unwrap();
        let first = dev.prefill(&mut cache, &ids, 0).unwrap().to_vec();
        let next = dev.decode(&mut cache, 7).unwrap().to_vec();
        (common::bits(&first), common::bits(&next))
    };
    let packed = run(false);
    let plain = run(true);
    exec.force_plain_dot(false);
    assert!(packed == plain, "the two dot-product paths give different logits");
}
