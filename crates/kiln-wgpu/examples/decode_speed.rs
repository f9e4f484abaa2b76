//! Decode speed of the wgpu forward beside the CPU forward, measured in one run on the
//! same model: `cargo run --release -p kiln-wgpu --example decode_speed -- [MODEL]
//! [PROMPT_TOKENS] [STEPS]` (defaults `synthetic:smollm-135m`, 64, 32). On lavapipe the
//! "device" is the CPU: its figures are no GPU measurement, only "lavapipe on <CPU>".

use std::time::Instant;

use kiln_core::MemoryPool;
use kiln_model::{EngineOptions, LoadOptions, Session};
use kiln_wgpu::{Backend, WgpuEngine, WgpuExec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let name = args.first().map_or("synthetic:smollm-135m", String::as_str);
    let prompt_tokens: usize = args.get(1).map_or(Ok(64), |s| s.parse())?;
    let steps: usize = args.get(2).map_or(Ok(32), |s| s.parse())?;
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
    let mut dev = WgpuEngine::new(&exec, &m.config, &m.weights)?;
    let mut cache = dev.new_cache(prompt_tokens + steps + 1)?;
    let t = Instant::now();
    let mut next = argmax(dev.prefill(&mut cache, &ids, 0)?);
    let prefill_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for _ in 0..steps {
        next = argmax(dev.decode(&mut cache, next)?);
    }
    let dev_tps = steps as f64 / t.elapsed().as_secs_f64();
    println!("model {name}, prompt {prompt_tokens} tokens, {steps} decode steps");
    println!("cpu forward: {cpu_tps:.2} tok/s");
    println!(
        "wgpu forward on {}: {dev_tps:.2} tok/s decode, prefill {:.1} tok/s; ratio wgpu/cpu {:.3}",
        exec.name(),
        prompt_tokens as f64 / prefill_s,
        dev_tps / cpu_tps
    );
    let st = exec.stats();
    println!("device pool peak {} bytes of a limit of {}", st.peak_bytes, exec.pool().limit());
    Ok(())
}
