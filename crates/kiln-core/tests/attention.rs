//! The fused decode attention kernels, on every path this CPU runs, against the exact
//! two-pass softmax of `attn::reference`, within the bound `reference::error_bound`
//! derives from f32 rounding; over the head sizes, group sizes, lengths (across tile and
//! cache-block edges), storage types and key-range splits kiln runs.

mod common;

use half::f16;
use kiln_core::kernels::Isa;
use kiln_core::kernels::attn::{self, DecodeShape, KvRun, KvSource, TILE_KEYS, reference};

use common::Rng;

/// Positions per cache block in kiln-model: runs never straddle one.
const BLOCK: usize = 256;

/// One decode case: queries, and keys and values already rounded to f16 (so the f16 and
/// f32 storage hold the same numbers).
struct Case {
    shape: DecodeShape,
    q: Vec<f32>,
    k16: Vec<f16>,
    v16: Vec<f16>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl Case {
    fn new(group: usize, head_dim: usize, n: usize, q_mag: f32, seed: u64) -> Case {
        let shape = DecodeShape::new(group, head_dim);
        let mut rng = Rng(seed);
        let q: Vec<f32> = (0..group * head_dim).map(|_| rng.sym(q_mag)).collect();
        let k16: Vec<f16> = (0..n * head_dim).map(|_| f16::from_f32(rng.sym(2.0))).collect();
        let v16: Vec<f16> = (0..n * head_dim).map(|_| f16::from_f32(rng.sym(1.0))).collect();
        let k = k16.iter().map(|x| x.to_f32()).collect();
        let v = v16.iter().map(|x| x.to_f32()).collect();
        Case { shape, q, k16, v16, k, v }
    }

    fn runs(&self, f16: bool, a: usize, b: usize) -> (KvRun<'_>, KvRun<'_>) {
        let hd = self.shape.head_dim;
        let r = a * hd..b * hd;
        if f16 {
            (KvRun::F16(&self.k16[r.clone()]), KvRun::F16(&self.v16[r]))
        } else {
            (KvRun::F32(&self.k[r.clone()]), KvRun::F32(&self.v[r]))
        }
    }

    /// Folds positions `lo..hi` into a fresh state, one run per cache block.
    fn state(&self, isa: Isa, f16: bool, lo: usize, hi: usize) -> Vec<f32> {
        let mut st = vec![0f32; self.shape.state_len()];
        attn::init(&self.shape, &mut st);
        let mut a = lo;
        while a < hi {
            let b = hi.min((a / BLOCK + 1) * BLOCK);
            let (k, v) = self.runs(f16, a, b);
            attn::fold(isa, &self.shape, &self.q, k, v, &mut st);
            a = b;
        }
        st
    }

    /// The output with the keys split at `cuts` into ranges whose states are merged.
    fn output(&self, isa: Isa, f16: bool, cuts: &[usize]) -> Vec<f32> {
        let n = self.k.len() / self.shape.head_dim;
        let mut edges = vec![0];
        edges.extend(cuts.iter().copied().filter(|&c| c > 0 && c < n));
        edges.push(n);
        let mut st = self.state(isa, f16, edges[0], edges[1]);
        for w in edges[1..].windows(2) {
            let part = self.state(isa, f16, w[0], w[1]);
            attn::merge(&self.shape, &mut st, &part);
        }
        let mut out = vec![0f32; self.shape.group * self.shape.head_dim];
        attn::finish(&self.shape, &st, &mut out);
        out
    }

    /// Corrections each weight may pass through: tiles and block runs folded, merges.
    fn rescales(&self, cuts: usize) -> usize {
        let n = self.k.len() / self.shape.head_dim;
        n.div_ceil(TILE_KEYS) + n.div_ceil(BLOCK) + 2 * (cuts + 1)
    }

    fn check(&self, isa: Isa, f16: bool, cuts: &[usize], what: &str) {
        let got = self.output(isa, f16, cuts);
        let want = reference::attend(&self.shape, &self.q, &self.k, &self.v);
        let bound = reference::error_bound(&self.shape, &self.q, &self.k, &self.v, self.rescales(cuts.len()));
        for (i, ((&g, &w), &b)) in got.iter().zip(&want).zip(&bound).enumerate() {
            let err = (g as f64 - w).abs();
            assert!(
                err <= b,
                "{what} {} f16={f16} cuts={cuts:?}: output {i} is {g}, exact {w}, error {err:e} over the bound {b:e}",
                isa.as_str()
            );
        }
    }
}

/// Set to 1 (CI's aarch64 run under qemu) for a reduced grid: every head size, path and
/// tile edge still runs, with fewer group sizes and lengths (docs/environment-variables.md).
const QUICK_ENV: &str = "KILN_QUICK_KERNEL_TESTS";

fn quick() -> bool {
    std::env::var_os(QUICK_ENV).is_some_and(|v| v == "1")
}

#[test]
fn every_path_matches_the_reference_across_shapes_and_lengths() {
    let lengths: &[usize] =
        if quick() { &[1, 9, 64, 257] } else { &[1, 7, 8, 9, 63, 64, 65, 255, 256, 257, 700] };
    let shapes: &[(usize, &[usize])] = if quick() {
        &[(64, &[3]), (128, &[6]), (80, &[5]), (6, &[2])]
    } else {
        &[(64, &[1, 3, 7, 8]), (128, &[1, 2, 6, 12]), (80, &[5]), (6, &[2])]
    };
    let mut seed = 1;
    for isa in Isa::available() {
        for &(hd, groups) in shapes {
            for &g in groups {
                for &n in lengths {
                    seed += 1;
                    let case = Case::new(g, hd, n, 1.5, seed);
                    for f16 in [true, false] {
                        case.check(isa, f16, &[], &format!("g={g} hd={hd} n={n}"));
                    }
                }
            }
        }
    }
}

#[test]
fn split_key_ranges_merge_to_the_whole() {
    for isa in Isa::available() {
        for (hd, g, n) in [(64, 3, 1536), (128, 7, 600), (64, 16, 513)] {
            let case = Case::new(g, hd, n, 2.0, n as u64);
            for cuts in [vec![BLOCK], vec![100, 101, 400], vec![1, n - 1], vec![64, 128, 192, 256, 320]] {
                case.check(isa, true, &cuts, &format!("g={g} hd={hd} n={n}"));
            }
        }
    }
}

#[test]
fn peaked_and_flat_softmax_stay_within_the_bound() {
    // Large queries make one key dominate (scores spread over tens of units, so the
    // running maximum moves and the output is rescaled often); zero queries give the
    // plain mean of the values.
    for isa in Isa::available() {
        for (mag, seed) in [(40.0, 7), (0.0, 8)] {
            let case = Case::new(4, 64, 777, mag, seed);
            case.check(isa, true, &[300], &format!("q magnitude {mag}"));
        }
    }
}

#[test]
fn f16_and_f32_storage_of_the_same_values_give_identical_outputs() {
    for isa in Isa::available() {
        let case = Case::new(3, 64, 300, 1.0, 11);
        let (a, b) = (case.output(isa, true, &[BLOCK]), case.output(isa, false, &[BLOCK]));
        assert_eq!(a, b, "{}", isa.as_str());
    }
}

/// The AVX-512 path keeps AVX2's scores, exponentials and order of accumulation, so its
/// outputs are AVX2's bits (heads of 64 and 128, the ones it takes; one head and more
/// heads than one register tile holds; lengths across tile and block edges).
#[test]
fn avx512_path_gives_the_avx2_bits() {
    let wide: Vec<Isa> =
        Isa::available().into_iter().filter(|i| matches!(i, Isa::Avx512Vnni | Isa::Avx512)).collect();
    if wide.is_empty() {
        eprintln!("no AVX-512 on this CPU: the AVX-512 attention path was not run");
        return;
    }
    let mut seed = 500;
    for (hd, groups) in [(64, &[1, 3, 7, 13][..]), (128, &[1, 4, 5])] {
        for &g in groups {
            for n in [1, 9, 64, 65, 300] {
                seed += 1;
                let case = Case::new(g, hd, n, 1.5, seed);
                for f16 in [true, false] {
                    let want = case.output(Isa::Avx2, f16, &[BLOCK / 2]);
                    for &isa in &wide {
                        let got = case.output(isa, f16, &[BLOCK / 2]);
                        assert!(
                            got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{} g={g} hd={hd} n={n} f16={f16}: outputs differ from avx2's",
                            isa.as_str()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn empty_states_merge_and_finish_as_nothing() {
    let case = Case::new(2, 64, 10, 1.0, 3);
    let shape = case.shape;
    let mut empty = vec![0f32; shape.state_len()];
    attn::init(&shape, &mut empty);
    let mut out = vec![1f32; 2 * 64];
    attn::finish(&shape, &empty, &mut out);
    assert!(out.iter().all(|&x| x == 0.0));
    let full = case.state(Isa::detected(), true, 0, 10);
    let mut merged = empty.clone();
    attn::merge(&shape, &mut merged, &full);
    assert_eq!(merged, full);
    let mut back = full.clone();
    attn::merge(&shape, &mut back, &empty);
    assert_eq!(back, full);
    let (k, v) = case.runs(true, 0, 0);
    attn::fold(Isa::detected(), &shape, &case.q, k, v, &mut back);
    assert_eq!(back, full);
}

#[test]
#[should_panic(expected = "keys and values must share a storage type")]
fn mixed_storage_types_are_refused() {
    let case = Case::new(1, 8, 2, 1.0, 5);
    let mut st = vec![0f32; case.shape.state_len()];
    attn::init(&case.shape, &mut st);
    attn::fold(Isa::Portable, &case.shape, &case.q, KvRun::F16(&case.k16), KvRun::F32(&case.v), &mut st);
}

/// A cache laid out as kiln-model's: blocks of [`BLOCK`] positions, each
/// `[key|value][kv_head][position][head_dim]`.
struct Blocks {
    data: Vec<f16>,
    /// The same values in f32, served instead when `f32` is set.
    data32: Vec<f32>,
    f32: bool,
    kv_heads: usize,
    head_dim: usize,
}

impl Blocks {
    fn new(kv_heads: usize, head_dim: usize, n: usize, seed: u64) -> Blocks {
        let mut rng = Rng(seed);
        let data = (0..n.div_ceil(BLOCK) * 2 * kv_heads * BLOCK * head_dim)
            .map(|_| f16::from_f32(rng.sym(1.5)))
            .collect::<Vec<_>>();
        let data32 = data.iter().map(|x| x.to_f32()).collect();
        Blocks { data, data32, f32: false, kv_heads, head_dim }
    }

    fn at(&self, value: bool, head: usize, pos: usize) -> usize {
        let (b, slot) = (pos / BLOCK, pos % BLOCK);
        (((b * 2 + value as usize) * self.kv_heads + head) * BLOCK + slot) * self.head_dim
    }

    /// Keys or values of `head` at positions `0..n` as f32, position-major.
    fn gather(&self, value: bool, head: usize, n: usize) -> Vec<f32> {
        (0..n)
            .flat_map(|p| {
                let a = self.at(value, head, p);
                self.data[a..a + self.head_dim].iter().map(|x| x.to_f32())
            })
            .collect()
    }
}

impl KvSource for Blocks {
    fn block(&self) -> usize {
        BLOCK
    }

    fn run(&self, value: bool, head: usize, start: usize, n: usize) -> KvRun<'_> {
        assert!(start % BLOCK + n <= BLOCK, "a run straddles a block");
        let a = self.at(value, head, start);
        if self.f32 {
            KvRun::F32(&self.data32[a..a + n * self.head_dim])
        } else {
            KvRun::F16(&self.data[a..a + n * self.head_dim])
        }
    }
}

#[test]
fn decode_rows_match_one_row_decodes_bit_for_bit_at_any_thread_count() {
    let (kvh, g, hd) = (3, 3, 64);
    let shape = DecodeShape::new(g, hd);
    let q_dim = kvh * g * hd;
    // Rows 0..5 at positions 1020..1025: one crosses into the fifth block; the work is
    // above the serial threshold, so the two-thread pool splits it.
    let (start, rows) = (1020, 5);
    let cache = Blocks::new(kvh, hd, start + rows, 9);
    let mut rng = Rng(4);
    let q: Vec<f32> = (0..rows * q_dim).map(|_| rng.sym(1.0)).collect();
    let run = |threads: usize, rows_q: &[f32], at: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        let mut out = rows_q.to_vec();
        pool.install(|| attn::decode(&shape, kvh, &mut out, at, &cache));
        out
    };
    let together = run(2, &q, start);
    for r in 0..rows {
        let row = &q[r * q_dim..(r + 1) * q_dim];
        for threads in [1, 2] {
            let alone = run(threads, row, start + r);
            assert_eq!(alone, together[r * q_dim..(r + 1) * q_dim], "row {r}, {threads} threads");
        }
        // And the row is right: against the exact answer, head by head.
        let n = start + r + 1;
        for h in 0..kvh {
            let (k, v) = (cache.gather(false, h, n), cache.gather(true, h, n));
            let qh = &row[h * g * hd..(h + 1) * g * hd];
            let want = reference::attend(&shape, qh, &k, &v);
            let rescales = n.div_ceil(TILE_KEYS) + 2 * n.div_ceil(BLOCK);
            let bound = reference::error_bound(&shape, qh, &k, &v, rescales);
            let got = &together[r * q_dim + h * g * hd..r * q_dim + (h + 1) * g * hd];
            for i in 0..g * hd {
                let err = (got[i] as f64 - want[i]).abs();
                assert!(
                    err <= bound[i],
                    "row {r} head {h} value {i}: {} vs {} (bound {:e})",
                    got[i],
                    want[i],
                    bound[i]
                );
            }
        }
    }
}

#[test]
fn rows_beyond_the_state_budget_go_in_batches_with_the_same_results() {
    // Groups of 16 heads of 128 over 4,097+ positions: 17 spans of 2,080 state values per
    // row, so 32 rows need more than `STATE_VALUES` and go in two batches.
    let (kvh, g, hd, start, rows) = (1, 16, 128, 4096usize, 32);
    let shape = DecodeShape::new(g, hd);
    assert!(rows * (start + 1).div_ceil(attn::SPAN_KEYS) * shape.state_len() > attn::STATE_VALUES);
    let cache = Blocks::new(kvh, hd, start + rows, 21);
    let q_dim = kvh * g * hd;
    let mut rng = Rng(6);
    let q: Vec<f32> = (0..rows * q_dim).map(|_| rng.sym(1.0)).collect();
    let mut together = q.clone();
    attn::decode(&shape, kvh, &mut together, start, &cache);
    for r in [0, rows / 2, rows - 1] {
        let mut alone = q[r * q_dim..(r + 1) * q_dim].to_vec();
        attn::decode(&shape, kvh, &mut alone, start + r, &cache);
        assert_eq!(alone, together[r * q_dim..(r + 1) * q_dim], "row {r}");
    }
}

/// The exact answer of a prefill from position `start` for every row and head, and the
/// bound (one rescale per tile of keys), `[rows, kv_heads * group * head_dim]` each.
fn prefill_reference(cache: &Blocks, shape: &DecodeShape, q: &[f32], start: usize) -> (Vec<f64>, Vec<f64>) {
    let (kvh, g, hd) = (cache.kv_heads, shape.group, shape.head_dim);
    let q_dim = kvh * g * hd;
    let (mut want, mut bound) = (Vec::with_capacity(q.len()), Vec::with_capacity(q.len()));
    for r in 0..q.len() / q_dim {
        let n = start + r + 1;
        for h in 0..kvh {
            let (k, v) = (cache.gather(false, h, n), cache.gather(true, h, n));
            let o = r * q_dim + h * g * hd;
            let qh = &q[o..o + g * hd];
            want.extend(reference::attend(shape, qh, &k, &v));
            bound.extend(reference::error_bound(shape, qh, &k, &v, n.div_ceil(attn::PREFILL_KEYS) + 2));
        }
    }
    (want, bound)
}

/// Checks a prefill's output `got` against [`prefill_reference`]'s answer and bound.
fn check_prefill(exact: &(Vec<f64>, Vec<f64>), q_dim: usize, got: &[f32], what: &str) {
    for (i, ((&g, &w), &b)) in got.iter().zip(&exact.0).zip(&exact.1).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= b,
            "{what}: row {} value {}: {g} vs exact {w} (error {err:e}, bound {b:e})",
            i / q_dim,
            i % q_dim
        );
    }
}

/// The tiled prefill on every path this CPU runs, against the exact answer: heads of 64
/// and 128 (and widths that are not a whole register tile), groups of 1, 2 and 7, both
/// storage types, chunks from position 0 and after a cached prefix, row counts and
/// positions off the block and tile edges.
#[test]
fn prefill_matches_the_reference_across_shapes_and_starts() {
    let shapes: &[(usize, &[usize])] = if quick() {
        &[(64, &[7]), (128, &[2]), (80, &[1])]
    } else {
        &[(64, &[1, 2, 7]), (128, &[1, 2, 7]), (80, &[5]), (6, &[2])]
    };
    let spans: &[(usize, usize)] =
        if quick() { &[(0, 70), (300, 67)] } else { &[(0, 65), (0, 200), (300, 130), (1000, 77)] };
    let kvh = 2;
    let mut seed = 900;
    for &(hd, groups) in shapes {
        for &g in groups {
            let shape = DecodeShape::new(g, hd);
            let q_dim = kvh * g * hd;
            for &(start, rows) in spans {
                seed += 1;
                let mut cache = Blocks::new(kvh, hd, start + rows, seed);
                let mut rng = Rng(seed + 7);
                let q: Vec<f32> = (0..rows * q_dim).map(|_| rng.sym(1.5)).collect();
                let exact = prefill_reference(&cache, &shape, &q, start);
                for isa in Isa::available() {
                    for f32 in [false, true] {
                        cache.f32 = f32;
                        let mut got = q.clone();
                        let mut tmp = vec![0f32; got.len()];
                        attn::prefill_on(isa, &shape, kvh, &mut got, &mut tmp, start, &cache);
                        let what =
                            format!("{} g={g} hd={hd} start={start} rows={rows} f32={f32}", isa.as_str());
                        check_prefill(&exact, q_dim, &got, &what);
                    }
                }
            }
        }
    }
}

/// Large queries (one key dominates, the running maximum moves often) stay within the
/// bound; and a prefill's bits do not depend on the thread count, nor (for equal values)
/// on the storage type.
#[test]
fn prefill_is_exact_enough_when_peaked_and_independent_of_threads() {
    let (kvh, g, hd, start, rows) = (2, 3, 64, 100, 150);
    let shape = DecodeShape::new(g, hd);
    let mut cache = Blocks::new(kvh, hd, start + rows, 77);
    let mut rng = Rng(78);
    let q: Vec<f32> = (0..rows * kvh * g * hd).map(|_| rng.sym(30.0)).collect();
    let exact = prefill_reference(&cache, &shape, &q, start);
    for isa in Isa::available() {
        let run = |cache: &Blocks, threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let (mut out, mut tmp) = (q.clone(), vec![0f32; q.len()]);
            pool.install(|| attn::prefill_on(isa, &shape, kvh, &mut out, &mut tmp, start, cache));
            out
        };
        cache.f32 = false;
        let one = run(&cache, 1);
        check_prefill(&exact, kvh * g * hd, &one, &format!("{} peaked", isa.as_str()));
        assert_eq!(one, run(&cache, 2), "{}: one thread against two", isa.as_str());
        cache.f32 = true;
        assert_eq!(one, run(&cache, 2), "{}: f16 storage against f32", isa.as_str());
    }
}
