//! `kiln` on GGUF files: every subcommand takes `-m FILE.gguf`, a malformed file
//! (truncated, a tensor's data offset out of range, an unknown tensor type, an
//! architecture kiln does not run, a NaN or infinite float) exits 2 naming the tensor or key, `kiln score`
//! writes the documented log-probability file, and a qwen2 file runs while a qwen2 file
//! holding a block type kiln refuses exits 2 naming the tensor and type.

mod util;

use std::path::{Path, PathBuf};

use util::Dir;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../kiln-model/tests/fixtures/gguf/llama-tiny.gguf")
}

/// A copy of the fixture in `dir`, changed by `edit`.
fn edited(dir: &Dir, name: &str, edit: impl FnOnce(&mut Vec<u8>)) -> String {
    let mut bytes = std::fs::read(fixture()).unwrap();
    edit(&mut bytes);
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    path.to_str().unwrap().to_string()
}

/// Offset of the descriptor fields after tensor `name`'s name: n_dims (u32), dims (u64
/// each), type (u32), offset (u64).
fn descriptor(bytes: &[u8], name: &str) -> usize {
    let mut key = (name.len() as u64).to_le_bytes().to_vec();
    key.extend_from_slice(name.as_bytes());
    bytes.windows(key.len()).position(|w| w == key.as_slice()).expect("tensor in the fixture") + key.len()
}

/// Sets the f32 metadata value of `key` (its type, 6, then four bytes follow the key).
fn set_f32(bytes: &mut [u8], key: &str, value: f32) {
    let at = descriptor(bytes, key);
    assert_eq!(bytes[at..at + 4], 6u32.to_le_bytes(), "{key} is an f32 in the fixture");
    bytes[at + 4..at + 8].copy_from_slice(&value.to_le_bytes());
}

#[test]
fn generate_estimate_and_bench_decode_take_a_gguf_file() {
    let dir = Dir::new();
    let m = fixture();
    let m = m.to_str().unwrap();
    dir.run(&["generate", "-m", m, "-p", "hello", "-n", "4"]).expect_code(0);
    let est = dir.run(&["estimate", "-m", m, "--prompt-tokens", "8"]).expect_code(0);
    assert!(est.json()["weights_bytes"].as_u64().unwrap() > 0, "{}", est.describe());
    dir.run(&["bench-decode", "-m", m, "--prompt-tokens", "8", "-n", "2"]).expect_code(0);
}

#[test]
fn a_qwen2_gguf_file_generates_and_its_unsupported_block_type_exits_2_by_name() {
    let dir = Dir::new();
    let gguf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../kiln-model/tests/fixtures/gguf");
    let m = gguf.join("qwen2-tiny.gguf");
    let m = m.to_str().unwrap();
    dir.run(&["generate", "-m", m, "-p", "hello", "-n", "4"]).expect_code(0);
    dir.run(&["bench-decode", "-m", m, "--prompt-tokens", "8", "-n", "2"]).expect_code(0);
    let bad = gguf.join("qwen2-tiny-q5_0.gguf");
    let run = dir.run(&["generate", "-m", bad.to_str().unwrap(), "-p", "hi", "-n", "1"]).expect_code(2);
    for n in ["blk.1.ffn_down.weight", "Q5_0", "accepted types"] {
        assert!(run.stderr().contains(n), "stderr lacks {n:?}{}", run.describe());
    }
}

/// A change to a file's bytes.
type Edit = Box<dyn FnOnce(&mut Vec<u8>)>;

#[test]
fn malformed_files_exit_2_naming_the_tensor_or_key() {
    let dir = Dir::new();
    let cases: Vec<(&str, Edit, Vec<&str>)> = vec![
        (
            "truncated.gguf",
            Box::new(|b: &mut Vec<u8>| b.truncate(b.len() - 100)),
            vec!["tensor", "runs past the end"],
        ),
        (
            "offset.gguf",
            Box::new(|b: &mut Vec<u8>| {
                let at = descriptor(b, "blk.1.ffn_up.weight") + 4 + 16 + 4;
                b[at + 5] = 0x40;
            }),
            vec!["tensor blk.1.ffn_up.weight", "runs past the end"],
        ),
        (
            "type.gguf",
            Box::new(|b: &mut Vec<u8>| {
                let at = descriptor(b, "blk.0.attn_k.weight") + 4 + 16;
                b[at] = 200;
            }),
            vec!["tensor blk.0.attn_k.weight", "unknown tensor type 200"],
        ),
        (
            "q6k.gguf",
            Box::new(|b: &mut Vec<u8>| {
                // Q6_K is a known type with no exact kiln form; rows of 64 are not whole
                // Q6_K blocks either, so the parser names the tensor first.
                let at = descriptor(b, "blk.0.attn_k.weight") + 4 + 16;
                b[at] = 14;
            }),
            vec!["tensor blk.0.attn_k.weight", "Q6_K"],
        ),
        (
            "arch.gguf",
            Box::new(|b: &mut Vec<u8>| {
                let at = descriptor(b, "general.architecture") + 4 + 8;
                b[at..at + 5].copy_from_slice(b"gemma");
            }),
            vec!["general.architecture", "\"gemma\"", "llama, qwen2"],
        ),
        // Non-finite floats are refused by key, never read as the default.
        (
            "nan-freq-base.gguf",
            Box::new(|b: &mut Vec<u8>| set_f32(b, "llama.rope.freq_base", f32::NAN)),
            vec!["metadata llama.rope.freq_base", "NaN is not finite"],
        ),
        (
            "inf-eps.gguf",
            Box::new(|b: &mut Vec<u8>| set_f32(b, "llama.attention.layer_norm_rms_epsilon", f32::INFINITY)),
            vec!["metadata llama.attention.layer_norm_rms_epsilon", "inf is not finite"],
        ),
    ];
    for (name, edit, needles) in cases {
        let path = edited(&dir, name, edit);
        for args in [
            vec!["estimate", "-m", path.as_str(), "--prompt-tokens", "4"],
            vec!["generate", "-m", path.as_str(), "-p", "hi", "-n", "1"],
        ] {
            let run = dir.run(&args).expect_code(2);
            let err = run.stderr();
            for n in &needles {
                assert!(err.contains(n), "{name}: stderr lacks {n:?}{}", run.describe());
            }
        }
    }
}

#[test]
fn score_writes_header_and_one_record_per_scored_position() {
    let dir = Dir::new();
    let text = dir.path().join("text.txt");
    std::fs::write(&text, "the quick brown fox jumps over the lazy dog. ".repeat(20)).unwrap();
    let out = dir.path().join("lp.bin");
    let m = fixture();
    let run = dir
        .run(&[
            "score",
            "-m",
            m.to_str().unwrap(),
            "--text-file",
            text.to_str().unwrap(),
            "--window",
            "32",
            "--first-scored",
            "16",
            "--max-windows",
            "2",
            "--output",
            out.to_str().unwrap(),
        ])
        .expect_code(0);
    let summary = run.json();
    assert_eq!(summary["positions"].as_u64(), Some(2 * 15), "{}", run.describe());
    let bytes = std::fs::read(&out).unwrap();
    assert_eq!(&bytes[..8], b"KILNLP01");
    let len = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[12..12 + len]).unwrap();
    let vocab = header["vocab"].as_u64().unwrap() as usize;
    assert_eq!(vocab, 373);
    assert_eq!(bytes.len(), 12 + len + 30 * (4 + 4 * vocab));
    // Each record's log-probabilities exponentiate to a distribution.
    let rec = &bytes[12 + len..12 + len + 4 + 4 * vocab];
    let p: f64 =
        rec[4..].chunks_exact(4).map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())).exp()).sum();
    assert!((p - 1.0).abs() < 1e-4, "probabilities sum to {p}");
    // The token ids the score ran on.
    let ids = dir
        .run(&["score", "-m", m.to_str().unwrap(), "--text-file", text.to_str().unwrap(), "--ids-only"])
        .expect_code(0);
    let ids: Vec<u32> = serde_json::from_str(ids.stdout().trim()).unwrap();
    assert!(ids.len() > 64);
    let run = dir.run_env(
        &["score", "-m", m.to_str().unwrap(), "--text-file", text.to_str().unwrap(), "--output", "x"],
        &[("KILN_ACT_PRECISION", "int4")],
    );
    let run = run.expect_code(2);
    assert!(run.stderr().contains("KILN_ACT_PRECISION"), "{}", run.describe());
}

#[test]
fn export_gguf_writes_a_file_kiln_runs_and_refuses_what_it_cannot_write() {
    let dir = Dir::new();
    let out = dir.path().join("qwen.gguf");
    let out = out.to_str().unwrap();
    let run = dir.run(&["export-gguf", "synthetic:tiny-qwen@4bit-g32", out]).expect_code(0);
    assert!(run.stdout().contains("matrices as Q4_1, 0 as Q8_0, 0 as F32"), "{}", run.describe());
    // The file runs, and scores a text exactly as the synthetic model does: the same
    // tokens (the byte vocabulary) through the same weights.
    dir.run(&["generate", "-m", out, "-p", "kiln", "-n", "4"]).expect_code(0);
    let text = dir.path().join("text.txt");
    std::fs::write(&text, "the kiln fires the same bytes twice, and the logits agree. ".repeat(3)).unwrap();
    let score = |m: &str, file: &str| {
        let o = dir.path().join(file);
        let args = [
            "score",
            "-m",
            m,
            "--text-file",
            text.to_str().unwrap(),
            "--window",
            "32",
            "--first-scored",
            "16",
        ];
        let run = dir.run(&[&args[..], &["--output", o.to_str().unwrap()]].concat()).expect_code(0);
        let nll = run.json()["mean_nll"].as_f64().unwrap();
        (nll, std::fs::read(o).unwrap())
    };
    let (a, fa) = score("synthetic:tiny-qwen@4bit-g32", "a.logprobs");
    let (b, fb) = score(out, "b.logprobs");
    assert_eq!(a, b, "mean negative log-likelihood");
    // The records after each file's header (magic, length, JSON naming the model).
    let body = |f: &[u8]| f[12 + u32::from_le_bytes(f[8..12].try_into().unwrap()) as usize..].to_vec();
    assert!(body(&fa) == body(&fb), "the log-probabilities differ");
    // A GGUF model is exported again with its own tokenizer metadata.
    let again = dir.path().join("again.gguf");
    let again = again.to_str().unwrap();
    let fx = fixture();
    dir.run(&["export-gguf", fx.to_str().unwrap(), again]).expect_code(0);
    dir.run(&["generate", "-m", again, "-p", "hello", "-n", "4"]).expect_code(0);
    // Llama 3.1 rope scaling has no form kiln reads back: exit 2, naming it, no file.
    let refused = dir.path().join("tiny.gguf");
    let run = dir.run(&["export-gguf", "synthetic:tiny", refused.to_str().unwrap()]).expect_code(2);
    assert!(run.stderr().contains("accepted rope scalings are none and linear"), "{}", run.describe());
    assert!(!refused.exists());
}
