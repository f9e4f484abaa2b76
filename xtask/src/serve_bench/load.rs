//! Load shapes: prompts of a given length with an optional shared prefix, a closed loop
//! (C workers, each sending its next request when the last one ends) and an open loop
//! (Poisson arrivals at R requests per second).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::client::{self, RequestResult, RequestSpec, Target};

/// Common four-letter English words: one token each with its leading space in most BPE
/// tokenizers, five bytes in a byte-level one, so prompts of one length have one token
/// count whatever their seed.
const WORDS: [&str; 48] = [
    "time", "year", "work", "life", "hand", "part", "case", "week", "fact", "home", "room", "book", "area",
    "word", "side", "kind", "head", "city", "name", "team", "face", "door", "line", "body", "back", "idea",
    "game", "land", "king", "food", "road", "view", "rate", "hour", "form", "plan", "girl", "love", "fire",
    "town", "wife", "bank", "role", "news", "card", "heat", "rain", "tree",
];

/// splitmix64: a tiny, seedable, stable generator for prompts and arrival times.
#[derive(Clone, Debug)]
pub struct SplitMix(pub u64);

impl SplitMix {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// An exponential variate with rate `rate` (mean 1 / rate): Poisson gaps.
    pub fn exponential(&mut self, rate: f64) -> f64 {
        -self.unit().ln() / rate
    }
}

/// `n` words from `seed`, each with a leading space.
pub fn words(n: u64, seed: u64) -> String {
    let mut rng = SplitMix(seed);
    let mut s = String::with_capacity(n as usize * 6);
    for _ in 0..n {
        s.push(' ');
        s.push_str(WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]);
    }
    s
}

/// A prompt of about `tokens` tokens whose first `shared` are the same for every request
/// (seed 0) and the rest unique to `seed`.
pub fn prompt(tokens: u64, shared: u64, seed: u64) -> String {
    let shared = shared.min(tokens);
    let mut p = words(shared, 0x5eed);
    p.push_str(&words(tokens - shared, seed.wrapping_mul(0x9e37_79b9).wrapping_add(1)));
    p
}

/// Token ids of a prompt: ASCII-range ids (32 to 126), present in any vocabulary of a
/// byte-level or BPE tokenizer; the first `shared` come from one seed, the rest from
/// `seed`. Sent as ids, the prompt's length is exact.
pub fn prompt_ids(tokens: u64, shared: u64, seed: u64) -> Vec<u32> {
    let shared = shared.min(tokens);
    let draw = |n: u64, seed: u64| {
        let mut rng = SplitMix(seed);
        (0..n).map(move |_| 32 + (rng.next_u64() % 95) as u32)
    };
    draw(shared, 0x5eed)
        .chain(draw(tokens - shared, seed.wrapping_mul(0x9e37_79b9).wrapping_add(1)))
        .collect()
}

/// How requests arrive.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arrival {
    /// C requests in flight at all times.
    Closed(usize),
    /// Poisson arrivals at this many requests per second, seeded.
    Open {
        /// Requests per second.
        rate: f64,
        /// The generator's seed.
        seed: u64,
    },
}

/// What a level's requests measured, and its wall time.
#[derive(Debug)]
pub struct LevelRun {
    /// One per request, in the order they were given.
    pub results: Vec<RequestResult>,
    /// From the first send to the last completion.
    pub wall: Duration,
}

/// Sends `specs` with the arrival shape; every request ends as a result.
pub async fn run(target: &Target, specs: Vec<RequestSpec>, arrival: Arrival, timeout: Duration) -> LevelRun {
    let began = Instant::now();
    let n = specs.len();
    let specs = Arc::new(specs);
    let target = Arc::new(target.clone());
    let mut tasks = Vec::new();
    match arrival {
        Arrival::Closed(c) => {
            let next = Arc::new(AtomicUsize::new(0));
            for _ in 0..c.max(1).min(n.max(1)) {
                let (specs, target, next) = (specs.clone(), target.clone(), next.clone());
                tasks.push(tokio::spawn(async move {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(spec) = specs.get(i) else { break };
                        let start = began.elapsed().as_secs_f64() * 1e3;
                        out.push((i, client::send(&target, spec, timeout, start).await));
                    }
                    out
                }));
            }
        }
        Arrival::Open { rate, seed } => {
            let mut rng = SplitMix(seed);
            let mut at = Duration::ZERO;
            for i in 0..n {
                if i > 0 {
                    at += Duration::from_secs_f64(rng.exponential(rate));
                }
                tokio::time::sleep_until((began + at).into()).await;
                let (specs, target) = (specs.clone(), target.clone());
                tasks.push(tokio::spawn(async move {
                    let start = began.elapsed().as_secs_f64() * 1e3;
                    vec![(i, client::send(&target, &specs[i], timeout, start).await)]
                }));
            }
        }
    }
    let mut all: Vec<(usize, RequestResult)> = Vec::with_capacity(n);
    for t in tasks {
        match t.await {
            Ok(v) => all.extend(v),
            Err(e) => eprintln!("warning: a request task ended abnormally: {e}"),
        }
    }
    all.sort_by_key(|(i, _)| *i);
    LevelRun { results: all.into_iter().map(|(_, r)| r).collect(), wall: began.elapsed() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_share_exactly_their_prefix() {
        let a = prompt(20, 8, 1);
        let b = prompt(20, 8, 2);
        assert_eq!(a.split(' ').count(), 21);
        let (wa, wb): (Vec<&str>, Vec<&str>) = (a.split(' ').collect(), b.split(' ').collect());
        assert_eq!(wa[..9], wb[..9]);
        assert_ne!(wa[9..], wb[9..]);
        assert_eq!(prompt(20, 8, 1), a, "prompts are deterministic");
        assert_eq!(prompt(4, 10, 1).split(' ').count(), 5, "the prefix is capped by the length");
        let (a, b) = (prompt_ids(20, 8, 1), prompt_ids(20, 8, 2));
        assert_eq!((a.len(), a[..8] == b[..8], a[8..] == b[8..]), (20, true, false));
        assert!(a.iter().all(|&t| (32..127).contains(&t)));
    }

    #[test]
    fn poisson_gaps_have_the_rates_mean() {
        let mut rng = SplitMix(7);
        let n = 20_000;
        let mean = (0..n).map(|_| rng.exponential(4.0)).sum::<f64>() / n as f64;
        assert!((mean - 0.25).abs() < 0.01, "{mean}");
    }
}
