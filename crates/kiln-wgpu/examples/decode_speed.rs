//! Decode speed of the wgpu forward beside the CPU forward, measured in one run on the
//! same model: `cargo run --release -p kiln-wgpu --example decode_speed -- [MODEL]
//! [PROMPT_TOKENS] [STEPS] [ROUNDS]` (defaults `synthetic:smollm-135m`, 64, 32, 3). The
//! device runs its product variants interleaved, round after round: `f32`, `int8` with
//! packed dot products, `int8` on the plain path, `int16` (packed), so a change of load
//! on the host touches them alike; each variant's median over the rounds is printed. The
//! CPU forward runs its own scheme (`KILN_ACT_PRECISION`, default `int16`). On lavapipe
//! the "device" is the CPU: its figures are no GPU measurement, only "lavapipe on <CPU>".

use std::time::Instant;

use kiln_core::MemoryPool;
use kiln_model::{EngineOptions, LoadOptions, Session};
use kiln_protocol::ActScheme;
use kiln_wgpu::{Backend, WgpuEngine, WgpuExec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let name = args.first().map_or("synthetic:smollm-135m", String::as_str);
    let prompt_tokens: usize = args.get(1).map_or(Ok(64), |s| s.parse())?;
    let steps: usize = args.get(2).map_or(Ok(32), |s| s.parse())?;
    let rounds: usize = args.get(3).map_or(Ok(3), |s| s.parse())?;
    let m = kiln_model::load(name, &LoadOptions { pool: MemoryPool::unlimited(), quantize: None })?;
    let vocab = m.config.vocab_size;
    let ids: Vec<u32> = (0..prompt_tokens).map(|i| ((i * 37 + 11) % vocab) as u32).collect();
    let argmax = |v: &[f32]| v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |p| p.0) as u32;

    let pool = MemoryPool::unlimited();
    let mut cpu = Session::new(&m, &pool, EngineOptions::default())?;
    let mut next = argmax(cpu.prefill(&ids)?);
    let t = Instant::now();
    for _ in 0..steps {
        next = argmax(cpu.decode_step(next)?);
    }
    let cpu_tps = steps as f64 / t.elapsed().as_secs_f64();

    let exec = WgpuExec::open(Backend::Vulkan, None)?;
    let variants = [
        ("f32", ActScheme::F32, false),
        ("int8 packed", ActScheme::Int8, false),
        ("int8 plain", ActScheme::Int8, true),
        ("int16 packed", ActScheme::Int16, false),
    ];
    let mut tps = vec![Vec::new(); variants.len()];
    for _ in 0..rounds {
        for (v, &(label, act, plain)) in variants.iter().enumerate() {
            exec.force_plain_dot(plain);
            if act != ActScheme::F32 && !plain && !exec.packed_dot() {
                println!("{label}: the adapter has no packed dot products; skipped");
                continue;
            }
            let mut dev = WgpuEngine::new(&exec, &m.config, &m.weights)?;
            dev.set_act_scheme(act)?;
            let mut cache = dev.new_cache(prompt_tokens + steps + 1)?;
            let mut next = argmax(dev.prefill(&mut cache, &ids, 0)?);
            let t = Instant::now();
            for _ in 0..steps {
                next = argmax(dev.decode(&mut cache, next)?);
            }
            tps[v].push(steps as f64 / t.elapsed().as_secs_f64());
        }
    }
    exec.force_plain_dot(false);
    println!(
        "model {name}, prompt {prompt_tokens} tokens, {steps} decode steps, {rounds} interleaved rounds"
    );
    println!("cpu forward ({}): {cpu_tps:.2} tok/s", kiln_core::act_precision::act_scheme().as_str());
    let f32_median = median(&mut tps[0].clone());
    for (v, &(label, _, _)) in variants.iter().enumerate() {
        if tps[v].is_empty() {
            continue;
        }
        let all: Vec<String> = tps[v].iter().map(|t| format!("{t:.2}")).collect();
        let med = median(&mut tps[v]);
        println!(
            "wgpu {label:<13} on {}: median {med:.2} tok/s decode ({}); / f32 {:.3}, / cpu {:.3}",
            exec.name(),
            all.join(" "),
            med / f32_median,
            med / cpu_tps
        );
    }
    let st = exec.stats();
    println!("device pool peak {} bytes of a limit of {}", st.peak_bytes, exec.pool().limit());
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
