//! The costs that bound `serve-bench`'s aggregate decode at B streams over one stream, all
//! measured in one process, interleaved round by round, so a drift in the machine's speed
//! falls on every figure alike:
//!
//! - `P`: a whole prompt's prefill (one forward, the last row's logits);
//! - `s_b`: a decode step of `b` sequences (one token each) at the depth the streams reach
//!   halfway through their generation, for `b` in 1, 2, 4, 8;
//! - `m_p`: what a decode row adds to a prefill forward (the prompt with `B - 1` decode rows
//!   beside it, against the prompt alone, over `B - 1`).
//!
//! ```text
//! cargo run --release -p kiln-model --example serve_floor -- MODEL THREADS PROMPT NEW [B] [ROUNDS]
//! ```
//!
//! `MODEL` is anything `kiln` loads (`synthetic:qwen2.5-0.5b@4bit-g32`, a `.gguf` path). The
//! crossover and the activation scheme come from the environment as `kiln serve` takes them
//! (`KILN_QMV_CROSSOVER`, `KILN_ACT_PRECISION`, ...).
//!
//! It prints, per round and as medians, the figures and the bound they give. B requests
//! arriving at once, each of `PROMPT` tokens and `NEW` tokens out (the first from its
//! prefill, `NEW - 1` from decode steps), take at least
//!
//! ```text
//! W_B >= B * P + (NEW - 1) * s_1 + (B - 1) * (NEW - 1) * min(m_s, m_p),   m_s = (s_B - s_1) / (B - 1)
//! ```
//!
//! as long as a step of `k <= B` rows costs at least the chord `s_1 + (k - 1) m_s` (it
//! prints whether the measured widths do): every prompt is prefilled
//! (the whole B P, however it is chunked); the stream that finishes its prefill last still
//! needs its `NEW - 1` steps after it, each at least a one-row step; and every other
//! stream's decode rows ride either in those steps or in a prefill forward, each adding at
//! least the cheaper of the two marginal costs. One stream takes `P + (NEW - 1) s_1`, so
//! aggregate decode at B streams over one stream is at most `B (P + (NEW - 1) s_1) / W_B`.
//!
//! `m_p` is the difference of two forwards of a whole prompt, so one round's can be far off
//! (near zero, which only loosens the bound); the medians of the default five rounds are
//! what to read.

use std::time::Instant;

use kiln_core::MemoryPool;
use kiln_model::{AttentionKind, KvCache, KvDtype, LoadOptions, Logits, SeqChunk, Transformer, Workspace};

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: serve_floor MODEL THREADS PROMPT NEW [B] [ROUNDS]";
    let spec = args.first().unwrap_or_else(|| {
        eprintln!("{usage}");
        std::process::exit(2)
    });
    let num = |i: usize, default: Option<usize>| -> usize {
        match args.get(i) {
            Some(s) => s.parse().unwrap_or_else(|e| {
                eprintln!("serve_floor: argument {} ({s:?}): {e}; expected a whole number\n{usage}", i + 1);
                std::process::exit(2)
            }),
            None => default.unwrap_or_else(|| {
                eprintln!("{usage}");
                std::process::exit(2)
            }),
        }
    };
    let (threads, prompt_len, new, b, rounds) =
        (num(1, None), num(2, None), num(3, None), num(4, Some(8)), num(5, Some(5)));
    if !(1..=1024).contains(&threads) || prompt_len == 0 || new < 2 || !(2..=64).contains(&b) || rounds == 0 {
        eprintln!(
            "serve_floor: accepted are THREADS 1 to 1024, PROMPT and ROUNDS at least 1, NEW at least 2, B 2 to 64\n{usage}"
        );
        std::process::exit(2);
    }
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a rayon pool");
    let mem = MemoryPool::unlimited();
    let mut model = kiln_model::load(spec, &LoadOptions { pool: mem.clone(), quantize: None })
        .unwrap_or_else(|e| {
            eprintln!("serve_floor: model {spec:?}: {e}");
            std::process::exit(2)
        });
    model.prepare_for_cpu();
    let c = &model.config;
    if prompt_len.saturating_add(new) > c.max_position_embeddings {
        eprintln!(
            "serve_floor: PROMPT + NEW ({prompt_len} + {new}) is past the model's {} positions\n{usage}",
            c.max_position_embeddings
        );
        std::process::exit(2);
    }
    let vocab = c.vocab_size as u32;
    // B + 1 distinct prompts: one per stream's cache, and one prefilled afresh beside decode
    // rows for m_p.
    let prompts: Vec<Vec<u32>> = (0..=b as u32)
        .map(|s| (0..prompt_len as u32).map(|i| (i * 37 + s * 101 + 5) % vocab).collect())
        .collect();
    let widths: Vec<usize> =
        [1, 2, 4, 8].into_iter().filter(|&w| w <= b).chain((b > 8).then_some(b)).collect();
    let depth = prompt_len + new / 2;
    let grow: Vec<u32> = (0..depth - prompt_len).map(|i| (i as u32 * 13 + 3) % vocab).collect();
    let steps = 16;
    // Turns of the prompt with and without decode rows beside it, per round.
    const TURNS: usize = 6;
    println!(
        "model {spec}, {threads} threads, prompt {prompt_len}, {new} tokens out, B = {b}, steps at depth {depth}"
    );
    let (mut ps, mut mps) = (Vec::new(), Vec::new());
    let mut ss: Vec<Vec<f64>> = widths.iter().map(|_| Vec::new()).collect();
    pool.install(|| {
        kiln_core::crossover::configure_from_env(true).unwrap_or_else(|e| {
            eprintln!("serve_floor: {e}");
            std::process::exit(2)
        });
        let t = Transformer::new(c, &model.weights, AttentionKind::Streaming).expect("a transformer");
        let mut ws = Workspace::empty(c, &mem).expect("a workspace");
        let layout = t.kv_layout(KvDtype::F16);
        for round in 0..rounds {
            // P: each stream's prompt prefilled whole, into its own cache.
            let mut caches: Vec<KvCache> = (0..b).map(|_| KvCache::new(layout, &mem)).collect();
            let mut p_round = Vec::new();
            for (cache, prompt) in caches.iter_mut().zip(&prompts) {
                let t0 = Instant::now();
                t.forward(&mut ws, &mut [SeqChunk { cache, tokens: prompt }], Logits::Last)
                    .expect("a prefill");
                p_round.push(t0.elapsed().as_secs_f64());
            }
            let p = median(&mut p_round);
            // m_p: the extra prompt with B - 1 decode rows beside it, and alone, in turns; the
            // decode rows' caches go back to the prompt's length after each.
            let (mut with, mut alone) = (0.0, 0.0);
            for turn in 0..TURNS {
                for mixed in if turn % 2 == 0 { [true, false] } else { [false, true] } {
                    let mut pc = KvCache::new(layout, &mem);
                    let mut seqs = vec![SeqChunk { cache: &mut pc, tokens: &prompts[b] }];
                    let tok = [7u32];
                    if mixed {
                        for cache in caches[..b - 1].iter_mut() {
                            seqs.push(SeqChunk { cache, tokens: &tok });
                        }
                    }
                    let t0 = Instant::now();
                    t.forward(&mut ws, &mut seqs, Logits::Last).expect("a mixed forward");
                    let dt = t0.elapsed().as_secs_f64();
                    drop(seqs);
                    for cache in caches[..b - 1].iter_mut() {
                        cache.truncate(prompt_len);
                    }
                    if mixed { with += dt } else { alone += dt }
                }
            }
            let mp = (with - alone) / TURNS as f64 / (b - 1) as f64;
            // s_b: steps of b rows at `depth`, the widths in turns.
            let tok = [11u32];
            for cache in caches.iter_mut() {
                // Grow every cache to `depth` (one row at a time would be a long warm-up).
                t.forward(&mut ws, &mut [SeqChunk { cache, tokens: &grow }], Logits::None)
                    .expect("a prefill");
            }
            let mut s_round = vec![0.0; widths.len()];
            for step in 0..steps {
                let order: Vec<usize> = if step % 2 == 0 {
                    (0..widths.len()).collect()
                } else {
                    (0..widths.len()).rev().collect()
                };
                for wi in order {
                    let w = widths[wi];
                    let mut seqs: Vec<SeqChunk> =
                        caches[..w].iter_mut().map(|cache| SeqChunk { cache, tokens: &tok }).collect();
                    let t0 = Instant::now();
                    t.forward(&mut ws, &mut seqs, Logits::Last).expect("a decode step");
                    s_round[wi] += t0.elapsed().as_secs_f64();
                    drop(seqs);
                    for cache in caches[..w].iter_mut() {
                        cache.truncate(depth);
                    }
                }
            }
            for (s, total) in ss.iter_mut().zip(&s_round) {
                s.push(total / steps as f64);
            }
            ps.push(p);
            mps.push(mp);
            let cells: Vec<String> = widths
                .iter()
                .zip(&s_round)
                .map(|(w, s)| format!("s_{w} {:.2} ms", s / steps as f64 * 1e3))
                .collect();
            println!("round {round}: P {:.1} ms, m_p {:.2} ms/row, {}", p * 1e3, mp * 1e3, cells.join(", "));
        }
    });
    let p = median(&mut ps);
    let mp = median(&mut mps);
    let s: Vec<f64> = ss.iter_mut().map(|v| median(v)).collect();
    let (s1, sb) = (s[0], *s.last().unwrap());
    let ms = (sb - s1) / (b - 1) as f64;
    let n1 = (new - 1) as f64;
    let one = p + n1 * s1;
    let floor = b as f64 * p + n1 * s1 + (b - 1) as f64 * n1 * ms.min(mp);
    let cells: Vec<String> = widths.iter().zip(&s).map(|(w, v)| format!("s_{w} {:.2} ms", v * 1e3)).collect();
    println!(
        "medians: P {:.1} ms, m_p {:.2} ms/row, m_s {:.2} ms/row, {}",
        p * 1e3,
        mp * 1e3,
        ms * 1e3,
        cells.join(", ")
    );
    let chord: Vec<String> = widths
        .iter()
        .zip(&s)
        .filter(|&(&w, _)| w > 1 && w < b)
        .map(|(&w, &v)| {
            let line = s1 + (w - 1) as f64 * ms;
            format!(
                "s_{w} {} the chord ({:.2} against {:.2} ms)",
                if v >= line { "is on or above" } else { "is BELOW" },
                v * 1e3,
                line * 1e3
            )
        })
        .collect();
    if !chord.is_empty() {
        println!("{}", chord.join("; "));
    }
    println!(
        "one stream: {:.2} s per request, {:.1} tok/s; {b} streams: at least {:.2} s, at most {:.1} tok/s, \
         at most {:.2}x one stream",
        one,
        new as f64 / one,
        floor,
        (b * new) as f64 / floor,
        b as f64 * one / floor
    );
}
