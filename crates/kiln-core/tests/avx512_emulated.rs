//! The AVX-512 `qmv` paths, the AVX-512 eight-row tiles of `qmv_wide` / `qmm` for 4-bit
//! weights, and `qmv_wide`'s lane-row kernel, bit for bit against AVX2 and `reference::qmv_int`, on every geometry,
//! scale dtype and integer scheme.
//!
//! On a CPU with AVX-512 the paths run natively (and `kernels.rs` runs them beside every
//! other path). On one without, the row loop runs under an emulator: the inputs are
//! prepared natively ([`EmulatedQmv`]), this process's readable memory is written out, and
//! `scripts/emulate/bochs_call.py` calls the row loop on Bochs's CPU models, giving back the
//! outputs: the AVX-512 path on its default model (Cannon Lake: AVX-512F/BW/VL, no VNNI)
//! and the VNNI path on its Sapphire Rapids model (AVX-512 VNNI; the wheel has no AMX).
//! `KILN_TEST_BOCHS_PYTHON` names a Python with `bochscpu-python`
//! (scripts/emulate/requirements.txt); CI sets it. Without it, and without AVX-512, this
//! test says so and checks nothing. `KILN_TEST_BOCHS_FORCE=1` runs the emulator on an
//! AVX-512 CPU too.

#![cfg(target_arch = "x86_64")]

mod common;

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use kiln_core::Buffer;
use kiln_core::act_precision::ActScheme;
use kiln_core::format::{QuantSpec, write_code};
use kiln_core::kernels::emulated::{EmulatedLaneRows, EmulatedQmv, EmulatedTile};
use kiln_core::kernels::{Isa, qmv_scheme_on, qmv_wide_scheme_on, reference};
use kiln_core::matrix::{QuantizedMatrix, ScaleData, ScaleDtype};

use common::Rng;

struct Case {
    label: String,
    w: QuantizedMatrix,
    x: Vec<f32>,
    act: ActScheme,
}

fn matrix(
    n: usize,
    k: usize,
    bits: u32,
    g: usize,
    dtype: ScaleDtype,
    rng: &mut Rng,
    extreme: bool,
) -> QuantizedMatrix {
    let spec = QuantSpec::new(bits, g).unwrap();
    let mut packed = vec![0u32; n * spec.words_per_row(k)];
    for row in packed.chunks_exact_mut(spec.words_per_row(k)) {
        for j in 0..k {
            let c =
                if extreme { spec.max_code() } else { (rng.next() % u64::from(spec.max_code() + 1)) as u32 };
            write_code(row, j, bits, c);
        }
    }
    let gpr = k / g;
    let scales: Vec<f32> = (0..n * gpr).map(|_| rng.sym(0.05) + 0.001f32.copysign(rng.sym(1.0))).collect();
    let biases: Vec<f32> = (0..n * gpr).map(|_| rng.sym(0.6)).collect();
    QuantizedMatrix::new(
        n,
        k,
        spec,
        Buffer::from(packed),
        ScaleData::from_f32(&scales, dtype),
        ScaleData::from_f32(&biases, dtype),
    )
    .unwrap()
}

/// Every geometry, dtype and scheme, at a K with whole steps of eight groups and at one
/// with a partial last step (for g32 an odd number of groups: a lone half block), and
/// codes at their extremes against activations whose low plane is -128.
fn cases() -> Vec<Case> {
    let mut rng = Rng(0xa512);
    let mut out = Vec::new();
    for bits in [4u32, 8] {
        let acts: &[ActScheme] =
            if bits == 4 { &[ActScheme::Int16, ActScheme::Int8] } else { &[ActScheme::Int16] };
        for g in [32usize, 64, 128] {
            for dtype in [ScaleDtype::F16, ScaleDtype::Bf16, ScaleDtype::F32] {
                for &act in acts {
                    for (groups, extreme) in [(16, false), (13, false), (5, true)] {
                        let (n, k) = (19, groups * g);
                        let w = matrix(n, k, bits, g, dtype, &mut rng, extreme);
                        let x: Vec<f32> = if extreme {
                            (0..k).map(|j| if j % g == 0 { 3.0 } else { 3.0 * 32384.0 / 32512.0 }).collect()
                        } else {
                            (0..k).map(|i| if i % 97 == 5 { rng.sym(8.0) } else { rng.sym(1.0) }).collect()
                        };
                        let label = format!(
                            "{bits}-bit g{g} {dtype:?} {act:?} k={k}{}",
                            if extreme { " extreme" } else { "" }
                        );
                        out.push(Case { label, w, x, act });
                    }
                }
            }
        }
    }
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// The AVX2 outputs, checked against the reference's bits: what every path must give.
fn expected(case: &Case) -> Vec<f32> {
    let mut y = vec![0f32; case.w.n()];
    qmv_scheme_on(Isa::Avx2, case.act, &case.x, &case.w, &mut y);
    let want = reference::qmv_int(&case.x, 1, &case.w, case.act).unwrap();
    assert_eq!(bits(&y), bits(&want), "{}: AVX2 against the reference", case.label);
    y
}

#[test]
fn avx512_qmv_matches_avx2_bit_for_bit() {
    assert!(Isa::Avx2.is_available(), "kiln's x86 tests need AVX2");
    let cases = cases();
    let native: Vec<Isa> = [Isa::Avx512, Isa::Avx512Vnni].into_iter().filter(|i| i.is_available()).collect();
    if !native.is_empty() && !forced() {
        for case in &cases {
            let want = expected(case);
            for &isa in &native {
                let mut q = EmulatedQmv::new(isa, case.act, &case.x, &case.w);
                assert_eq!(bits(q.run_native()), bits(&want), "{} on {}", case.label, isa.as_str());
            }
        }
        eprintln!("avx512_emulated: {} cases natively on {:?}", cases.len(), native);
        return;
    }
    let Some(python) = std::env::var_os("KILN_TEST_BOCHS_PYTHON") else {
        eprintln!(
            "avx512_emulated: this CPU lacks AVX-512 and KILN_TEST_BOCHS_PYTHON is unset: nothing checked \
             (see scripts/emulate/requirements.txt)"
        );
        return;
    };
    for (isa, model) in EMULATED {
        let prepared: Vec<EmulatedQmv<'_>> =
            cases.iter().map(|c| EmulatedQmv::new(isa, c.act, &c.x, &c.w)).collect();
        let dir = tempfile::tempdir().unwrap();
        let calls: Vec<EmuCall> = prepared
            .iter()
            .map(|q| EmuCall { entry: EmulatedQmv::entry(), arg: q.arg(), out: q.out_bytes() })
            .collect();
        emulate(&python, dir.path(), &calls, model);
        for (i, (case, q)) in cases.iter().zip(&prepared).enumerate() {
            let got = std::fs::read(dir.path().join(format!("out-{i}.bin"))).unwrap();
            let got: Vec<u32> =
                got.chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().unwrap())).collect();
            assert_eq!(got.len(), q.out().len());
            assert_eq!(got, bits(&expected(case)), "{} on {} emulated as {model}", case.label, isa.as_str());
            // The native copy was never written: the outputs came from the emulator.
            assert!(q.out().iter().all(|&v| v == 0.0));
        }
        eprintln!("avx512_emulated: {} cases of {} on the emulated {model}", cases.len(), isa.as_str());
    }
}

/// The x86 paths the emulator runs where the CPU lacks them, each on the Bochs CPU model
/// that has exactly its features: AVX-512 without VNNI on Cannon Lake (so no VNNI
/// instruction can hide in that path: one there is #UD), VNNI on Sapphire Rapids.
const EMULATED: [(Isa, &str); 2] = [(Isa::Avx512, "cannonlake"), (Isa::Avx512Vnni, "sapphire_rapids")];

/// Runs `calls` on the emulated CPU `model` (a name `bochs_call.py` knows): each writes
/// `out-<i>.bin` into `dir`.
fn emulate(python: &std::ffi::OsStr, dir: &Path, calls: &[EmuCall], model: &str) {
    snapshot(dir, calls, model);
    let mut cmd = Command::new(python);
    cmd.arg(script()).arg(dir);
    if let Some(shim) = glibc_shim(dir) {
        cmd.env("LD_PRELOAD", shim);
    }
    let out = cmd.output().expect("running the emulator's Python");
    assert!(
        out.status.success(),
        "the emulator failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// 4-bit weights at every group size and dtype, both integer schemes, against tiles of
/// 8, 5, 2 and 4 activation rows (in turn from case to case): the eight-row tiles and the
/// small ones `qmv_wide` and `qmm` run on AVX-512's dots.
fn tile_cases() -> Vec<(Case, usize)> {
    let four_bit = cases().into_iter().filter(|c| c.w.spec().bits() == 4);
    four_bit
        .enumerate()
        .map(|(i, mut c)| {
            let rows = [8, 5, 2, 4][i % 4];
            let k = c.w.k();
            let mut rng = Rng(k as u64 * 7 + i as u64);
            // The case's row first (extreme rows stay extreme), then random rows.
            for _ in 1..rows {
                c.x.extend((0..k).map(|_| rng.sym(2.0)));
            }
            c.label = format!("{} rows={rows}", c.label);
            (c, rows)
        })
        .collect()
}

/// AVX2's `qmv_wide` over the tile's rows, checked against the reference's bits.
fn expected_tile(case: &Case, rows: usize) -> Vec<f32> {
    let mut y = vec![0f32; rows * case.w.n()];
    qmv_wide_scheme_on(Isa::Avx2, case.act, &case.x, rows, &case.w, &mut y);
    let want = reference::qmv_int(&case.x, rows, &case.w, case.act.rows_scheme(rows)).unwrap();
    assert_eq!(bits(&y), bits(&want), "{}: AVX2 qmv_wide against the reference", case.label);
    y
}

/// The tiles of 4-bit weights on AVX-512, bit for bit against AVX2's
/// `qmv_wide` and `reference::qmv_int`: natively where the CPU has AVX-512, else under
/// the emulator as `qmv`'s row loop is.
#[test]
fn avx512_tiles_match_avx2_bit_for_bit() {
    assert!(Isa::Avx2.is_available(), "kiln's x86 tests need AVX2");
    let cases = tile_cases();
    let native: Vec<Isa> = [Isa::Avx512, Isa::Avx512Vnni].into_iter().filter(|i| i.is_available()).collect();
    if !native.is_empty() && !forced() {
        for (case, rows) in &cases {
            let want = expected_tile(case, *rows);
            for &isa in &native {
                let mut t = EmulatedTile::new(isa, case.act, &case.x, *rows, &case.w);
                assert_eq!(bits(&t.run_native()), bits(&want), "{} on {}", case.label, isa.as_str());
            }
        }
        eprintln!("avx512_emulated: {} tile cases natively on {:?}", cases.len(), native);
        return;
    }
    let Some(python) = std::env::var_os("KILN_TEST_BOCHS_PYTHON") else {
        eprintln!("avx512_emulated: no AVX-512 and KILN_TEST_BOCHS_PYTHON is unset: no tile checked");
        return;
    };
    for (isa, model) in EMULATED {
        let prepared: Vec<EmulatedTile<'_>> =
            cases.iter().map(|(c, rows)| EmulatedTile::new(isa, c.act, &c.x, *rows, &c.w)).collect();
        let dir = tempfile::tempdir().unwrap();
        let calls: Vec<EmuCall> = prepared
            .iter()
            .map(|t| EmuCall { entry: EmulatedTile::entry(), arg: t.arg(), out: t.out_bytes() })
            .collect();
        emulate(&python, dir.path(), &calls, model);
        for (i, ((case, rows), t)) in cases.iter().zip(&prepared).enumerate() {
            let got = std::fs::read(dir.path().join(format!("out-{i}.bin"))).unwrap();
            let got: Vec<f32> =
                got.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
            assert_eq!(got.len(), t.out().len());
            assert_eq!(
                bits(&t.to_rows(&got)),
                bits(&expected_tile(case, *rows)),
                "{} on {} emulated as {model}",
                case.label,
                isa.as_str()
            );
            assert!(t.out().iter().all(|&v| v == 0.0));
        }
        eprintln!("avx512_emulated: {} tile cases of {} on the emulated {model}", cases.len(), isa.as_str());
    }
}

/// The lane-row kernel's cases: the tiles' 4-bit cases with K a multiple of 64 (2 to 8
/// rows), and a third of them again with 12 rows (one pass of more than eight, as a decode
/// step of 9 to 16 rows runs) and with 20 (passes outer, 16 rows then 4, as a prefill runs);
/// and another third on 32 weight rows stored in `Layout::LaneRows`, read as stored, at one
/// row (a decode step's `qmv`) or the case's rows.
fn lane_row_cases() -> Vec<(Case, usize)> {
    let base: Vec<(Case, usize)> =
        tile_cases().into_iter().filter(|(c, rows)| *rows >= 2 && c.w.k() % 64 == 0).collect();
    let mut more = Vec::new();
    for (i, (c, rows)) in base.iter().enumerate().filter(|(i, _)| i % 3 == 0) {
        let m = if i % 2 == 0 { 12 } else { 20 };
        let k = c.w.k();
        let mut rng = Rng(k as u64 * 11 + i as u64);
        let mut x = c.x.clone();
        x.extend((0..(m - rows) * k).map(|_| rng.sym(2.0)));
        let w = matrix(c.w.n(), k, 4, c.w.spec().group_size(), c.w.scales().dtype(), &mut rng, false);
        more.push((Case { label: format!("{} rows={m}", c.label), w, x, act: c.act }, m));
    }
    for (i, (c, rows)) in base.iter().enumerate().filter(|(i, _)| i % 3 == 1) {
        let m = if i % 2 == 0 { 1 } else { *rows };
        let k = c.w.k();
        let mut rng = Rng(k as u64 * 13 + i as u64);
        let mut w = matrix(32, k, 4, c.w.spec().group_size(), c.w.scales().dtype(), &mut rng, false);
        assert!(w.into_lane_rows());
        let x = c.x[..m * k].to_vec();
        more.push((Case { label: format!("{} lane-row layout rows={m}", c.label), w, x, act: c.act }, m));
    }
    base.into_iter().chain(more).collect()
}

/// Weight rows per task in the lane-row cases: the cases' 19 rows are two tasks, the
/// second starting past row 0 with a partial block.
const LANE_ROW_TASK: usize = 16;

/// The lane-row kernel of `qmv_wide` and `qmm` (a weight row per 32-bit lane, 4-bit weights
/// with `K` a multiple of 64) on AVX-512, bit for bit against AVX2's `qmv_wide` and
/// `reference::qmv_int`: natively where the CPU has AVX-512 (both paths), else its
/// `vpmaddubsw` form under the emulator.
#[test]
fn avx512_lane_rows_match_avx2_bit_for_bit() {
    assert!(Isa::Avx2.is_available(), "kiln's x86 tests need AVX2");
    let cases = lane_row_cases();
    assert!(cases.len() >= 50, "{} lane-row cases", cases.len());
    let native: Vec<Isa> = [Isa::Avx512, Isa::Avx512Vnni].into_iter().filter(|i| i.is_available()).collect();
    if !native.is_empty() && !forced() {
        for (case, rows) in &cases {
            let want = expected_tile(case, *rows);
            for &isa in &native {
                let mut t = EmulatedLaneRows::new(isa, case.act, &case.x, *rows, LANE_ROW_TASK, &case.w)
                    .unwrap_or_else(|| panic!("{}: the lane-row kernel refused it", case.label));
                assert_eq!(bits(t.run_native()), bits(&want), "{} on {}", case.label, isa.as_str());
            }
        }
        eprintln!("avx512_emulated: {} lane-row cases natively on {:?}", cases.len(), native);
        return;
    }
    let Some(python) = std::env::var_os("KILN_TEST_BOCHS_PYTHON") else {
        eprintln!(
            "avx512_emulated: no AVX-512 and KILN_TEST_BOCHS_PYTHON is unset: no lane-row case checked"
        );
        return;
    };
    for (isa, model) in EMULATED {
        let prepared: Vec<EmulatedLaneRows<'_>> = cases
            .iter()
            .map(|(c, rows)| {
                EmulatedLaneRows::new(isa, c.act, &c.x, *rows, LANE_ROW_TASK, &c.w).expect("taken")
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let calls: Vec<EmuCall> = prepared
            .iter()
            .map(|t| EmuCall { entry: EmulatedLaneRows::entry(), arg: t.arg(), out: t.out_bytes() })
            .collect();
        emulate(&python, dir.path(), &calls, model);
        for (i, ((case, rows), t)) in cases.iter().zip(&prepared).enumerate() {
            let got = std::fs::read(dir.path().join(format!("out-{i}.bin"))).unwrap();
            let got: Vec<u32> =
                got.chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().unwrap())).collect();
            let label = &case.label;
            assert_eq!(
                got,
                bits(&expected_tile(case, *rows)),
                "{label} on {} emulated as {model}",
                isa.as_str()
            );
            assert!(t.out().iter().all(|&v| v == 0.0));
        }
        eprintln!(
            "avx512_emulated: {} lane-row cases of {} on the emulated {model}",
            cases.len(),
            isa.as_str()
        );
    }
}

/// `KILN_TEST_BOCHS_FORCE=1`: run the emulator even on a CPU with AVX-512, to check the
/// emulated path itself.
fn forced() -> bool {
    std::env::var_os("KILN_TEST_BOCHS_FORCE").is_some_and(|v| v == "1")
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/emulate/bochs_call.py")
}

/// One call for the emulator: the entry, its argument, and where its outputs lie.
struct EmuCall {
    entry: usize,
    arg: usize,
    out: (usize, usize),
}

/// This process's readable memory (`mem.bin`) and the calls (`snapshot.json`).
fn snapshot(dir: &Path, calls: &[EmuCall], model: &str) {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let mut mem = std::fs::File::open("/proc/self/mem").unwrap();
    let mut bin = std::io::BufWriter::new(std::fs::File::create(dir.join("mem.bin")).unwrap());
    let (mut regions, mut offset) = (Vec::new(), 0u64);
    let mut buf = Vec::new();
    for line in maps.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (range, perms, name) = (f[0], f[1], f.get(5).copied().unwrap_or(""));
        if !perms.starts_with('r') || matches!(name, "[vvar]" | "[vvar_vclock]" | "[vsyscall]") {
            continue;
        }
        let (a, b) = range.split_once('-').unwrap();
        let (start, end) = (u64::from_str_radix(a, 16).unwrap(), u64::from_str_radix(b, 16).unwrap());
        buf.resize((end - start) as usize, 0);
        if mem.seek(SeekFrom::Start(start)).is_err() || mem.read_exact(&mut buf).is_err() {
            continue;
        }
        bin.write_all(&buf).unwrap();
        regions.push(serde_json::json!({
            "start": start, "len": end - start, "offset": offset, "exec": perms.as_bytes()[2] == b'x',
        }));
        offset += end - start;
    }
    bin.flush().unwrap();
    let calls: Vec<_> = calls
        .iter()
        .map(|c| serde_json::json!({ "entry": c.entry, "arg": c.arg, "out": c.out.0, "out_len": c.out.1 }))
        .collect();
    let meta =
        serde_json::json!({ "regions": regions, "fs_base": fs_base(), "calls": calls, "cpu_model": model });
    std::fs::write(dir.join("snapshot.json"), meta.to_string()).unwrap();
}

/// The thread pointer (`fs:0` holds it on x86-64 Linux).
fn fs_base() -> u64 {
    let v: u64;
    // SAFETY: reads the thread control block's self pointer, always mapped.
    unsafe { std::arch::asm!("mov {}, fs:0", out(reg) v, options(nostack, readonly, preserves_flags)) };
    v
}

/// `bochscpu-python`'s wheel needs two glibc 2.38 symbols; on an older glibc a preloaded
/// shim gives them (built with the system's `cc`).
fn glibc_shim(dir: &Path) -> Option<PathBuf> {
    let src = dir.join("shim.c");
    std::fs::write(
        &src,
        "#include <stdlib.h>\n#include <stdio.h>\n#include <stdarg.h>\n\
         unsigned long long __isoc23_strtoull(const char *s, char **e, int b) { return strtoull(s, e, b); }\n\
         int __isoc23_sscanf(const char *s, const char *f, ...) { va_list a; va_start(a, f); int r = vsscanf(s, f, a); va_end(a); return r; }\n",
    )
    .unwrap();
    let so = dir.join("libshim.so");
    let ok = Command::new("cc").args(["-shared", "-fPIC", "-O2", "-o"]).arg(&so).arg(&src).status();
    ok.is_ok_and(|s| s.success()).then_some(so)
}
