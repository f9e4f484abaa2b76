//! `kiln export-gguf`: any model kiln holds, written as a GGUF file llama.cpp loads, with
//! the very weights kiln computes with wherever the two formats coincide.
//!
//! | kiln matrix | GGUF block | how |
//! |---|---|---|
//! | 4-bit, groups of 32k, scale and bias exact in f16 | Q4_1 | each group of 32k becomes k blocks with its scale `d` and bias `m`; codes as they are |
//! | 8-bit, bias = -128 * scale, scale exact in f16 | Q8_0 | `d` = scale, `q` = code - 128 |
//! | anything else (other widths, a scale or bias f16 cannot hold, dense) | F32 | the dequantized values, exact |
//!
//! Q4_1 computes `d * q + m`, kiln `scale * code + bias`: the same value from the same
//! three numbers, so a 4-bit model with f16-exact groups (every synthetic profile, every
//! Q4_1 or Q4_0 GGUF kiln loaded) is exported without changing a weight. Norms and biases
//! are F32 (kiln holds them in f32). llama.cpp's permutation of llama's Q and K rows is
//! applied on the way out, as the loader undoes it on the way in.
//!
//! The tokenizer: a synthetic model's byte tokenizer becomes a SentencePiece vocabulary
//! of byte tokens (`<0x00>`..`<0xFF>`, the space as `▁`, then `<s>`, `</s>` and unused
//! control fillers), which both kiln's loader and llama.cpp encode byte for byte; a model loaded from a GGUF file keeps
//! that file's tokenizer metadata; a checkpoint's byte-level BPE `tokenizer.json` becomes
//! a `gpt2` vocabulary with its merges. Any other tokenizer is refused by name.
//!
//! The destination must be a new path or a regular file (a FIFO or a device is refused);
//! the file is written beside it under a temporary name, synced, and renamed over it, so
//! a reader never sees half a file ([`crate::output::AtomicFile`]).

use std::io::BufWriter;
use std::path::{Path, PathBuf};

use half::f16;
use kiln_core::QuantizedMatrix;
use kiln_core::format::read_code;

use super::header::Value;
use super::tensors::GgmlType;
use super::writer::{self, MetaValue, TensorDesc};
use crate::error::{ModelError, Result};
use crate::forward::weights::{LinearWeight, ModelWeights};
use crate::loading::config::{Architecture, ModelConfig, RopeScaling};
use crate::loading::source::ModelSource;
use crate::loading::tokenizer::{ByteTokenizer, Tokenizer};
use crate::model::LoadedModel;
use crate::output::AtomicFile;

/// How each matrix was written, for the caller's report.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExportReport {
    /// The file written.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    /// Matrices written as Q4_1 blocks, exactly.
    pub q4_1: usize,
    /// Matrices written as Q8_0 blocks, exactly.
    pub q8_0: usize,
    /// Matrices written as F32 values, with why each was not a block type.
    pub f32: Vec<(String, String)>,
}

/// The stored row of a llama Q or K matrix holding kiln's row `r` of `n`, for `heads`
/// heads: the inverse of the loader's unpermutation.
fn permuted_row(s: usize, n: usize, heads: usize) -> usize {
    // llama.cpp stores row h*hd + 2a + b where Hugging Face has h*hd + b*hd/2 + a.
    let hd = n / heads;
    let (h, i) = (s / hd, s % hd);
    let (a, b) = (i / 2, i % 2);
    h * hd + b * (hd / 2) + a
}

/// Which kiln row feeds each stored row.
#[derive(Clone, Copy)]
enum Rows {
    Same,
    Permute { heads: usize },
}

impl Rows {
    fn kiln_row(self, stored: usize, n: usize) -> usize {
        match self {
            Rows::Same => stored,
            Rows::Permute { heads } => permuted_row(stored, n, heads),
        }
    }
}

/// One tensor to write: where its values come from.
enum Source<'a> {
    Vector(&'a [f32], Rows),
    Matrix(&'a LinearWeight, Rows),
}

/// The block type a matrix is written as, or why it is F32.
fn choose(w: &LinearWeight) -> std::result::Result<GgmlType, String> {
    let q = match w {
        LinearWeight::Dense(_) => return Err("kiln holds it dense".into()),
        LinearWeight::Quantized(q) => q,
    };
    let spec = q.spec();
    if spec.group_size() % 32 != 0 {
        return Err(format!("groups of {} are not whole blocks of 32", spec.group_size()));
    }
    let exact = |x: f32| f16::from_f32(x).to_f32() == x;
    let (scales, biases) = (q.scales(), q.biases());
    match spec.bits() {
        4 => {
            for i in 0..scales.len() {
                let (s, b) = (scales.get(i), biases.get(i));
                if !exact(s) || !exact(b) {
                    return Err(format!("group {i}'s scale {s} or bias {b} is not exact in f16"));
                }
            }
            Ok(GgmlType::Q4_1)
        }
        8 => {
            for i in 0..scales.len() {
                let (s, b) = (scales.get(i), biases.get(i));
                if !exact(s) || b != -128.0 * s {
                    return Err(format!(
                        "group {i}'s bias {b} is not -128 x its scale {s} in f16 (Q8_0 has no bias)"
                    ));
                }
            }
            Ok(GgmlType::Q8_0)
        }
        bits => Err(format!("{bits}-bit codes have no GGUF block kiln writes exactly")),
    }
}

/// Bytes of one stored row of `ty` with `k` elements.
fn row_bytes(ty: GgmlType, k: usize) -> usize {
    match ty {
        GgmlType::Q4_1 => k / 32 * 20,
        GgmlType::Q8_0 => k / 32 * 34,
        _ => k * 4,
    }
}

/// Appends kiln row `r` of `q` as Q4_1 or Q8_0 blocks.
fn blocks(q: &QuantizedMatrix, r: usize, ty: GgmlType, out: &mut Vec<u8>) {
    let (k, spec) = (q.k(), q.spec());
    let words = q.row_words(r);
    let gpr = spec.groups_per_row(k);
    for blk in 0..k / 32 {
        let g = r * gpr + blk * 32 / spec.group_size();
        let d = f16::from_f32(q.scales().get(g));
        out.extend_from_slice(&d.to_le_bytes());
        let code = |j: usize| read_code(words, blk * 32 + j, spec.bits());
        if ty == GgmlType::Q4_1 {
            out.extend_from_slice(&f16::from_f32(q.biases().get(g)).to_le_bytes());
            for j in 0..16 {
                out.push((code(j) | (code(j + 16) << 4)) as u8);
            }
        } else {
            for j in 0..32 {
                out.push((code(j) as i32 - 128) as i8 as u8);
            }
        }
    }
}

fn f32_bytes(values: &[f32], out: &mut Vec<u8>) {
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// The bytes of one tensor.
fn tensor_bytes(src: &Source<'_>, ty: GgmlType) -> Vec<u8> {
    let mut out = Vec::new();
    match *src {
        Source::Vector(v, rows) => {
            let n = v.len();
            let reordered: Vec<f32> = (0..n).map(|s| v[rows.kiln_row(s, n)]).collect();
            f32_bytes(&reordered, &mut out);
        }
        Source::Matrix(w, rows) => {
            let (n, k) = (w.n(), w.k());
            out.reserve(n * row_bytes(ty, k));
            let mut row = vec![0f32; k];
            // GGUF stores rows: a matrix in the CPU's lane-row layout is copied back first.
            let row_major = match w {
                LinearWeight::Quantized(q) if q.layout() != kiln_core::Layout::RowMajor => {
                    Some(q.to_row_major())
                }
                _ => None,
            };
            for s in 0..n {
                let r = rows.kiln_row(s, n);
                match (w, ty) {
                    (LinearWeight::Quantized(q), GgmlType::Q4_1 | GgmlType::Q8_0) => {
                        blocks(row_major.as_ref().unwrap_or(q), r, ty, &mut out)
                    }
                    _ => {
                        w.row(r, &mut row);
                        f32_bytes(&row, &mut out);
                    }
                }
            }
        }
    }
    out
}

fn arch_name(c: &ModelConfig, out: &Path) -> Result<&'static str> {
    match c.architecture {
        Architecture::Llama => Ok("llama"),
        Architecture::Qwen2 => Ok("qwen2"),
        other => Err(export_error(
            out,
            format!(
                "architecture {other:?} has no GGUF form kiln's loader reads back: accepted are llama and qwen2"
            ),
        )),
    }
}

fn export_error(path: &Path, message: impl Into<String>) -> ModelError {
    ModelError::Export { path: path.to_path_buf(), message: message.into() }
}

/// The architecture's metadata keys.
fn model_metadata(c: &ModelConfig, out: &Path) -> Result<Vec<(String, MetaValue)>> {
    let arch = arch_name(c, out)?;
    let k = |s: &str| format!("{arch}.{s}");
    let u = |x: usize| MetaValue::U32(x as u32);
    let mut m = vec![
        ("general.architecture".to_string(), MetaValue::Str(arch.into())),
        ("general.name".to_string(), MetaValue::Str("kiln export".into())),
        (k("context_length"), u(c.max_position_embeddings)),
        (k("embedding_length"), u(c.hidden_size)),
        (k("block_count"), u(c.num_hidden_layers)),
        (k("feed_forward_length"), u(c.intermediate_size)),
        (k("attention.head_count"), u(c.num_attention_heads)),
        (k("attention.head_count_kv"), u(c.num_key_value_heads)),
        (k("attention.key_length"), u(c.head_dim)),
        (k("attention.value_length"), u(c.head_dim)),
        (k("attention.layer_norm_rms_epsilon"), MetaValue::F32(c.rms_norm_eps)),
        (k("rope.freq_base"), MetaValue::F32(c.rope_theta)),
        (k("rope.dimension_count"), u(c.head_dim)),
    ];
    match c.rope_scaling {
        None => {}
        Some(RopeScaling::Linear { factor }) => {
            m.push((k("rope.scaling.type"), MetaValue::Str("linear".into())));
            m.push((k("rope.scaling.factor"), MetaValue::F32(factor)));
        }
        Some(RopeScaling::Llama3 { .. }) => {
            return Err(export_error(
                out,
                "Llama 3.1 rope scaling is a rope_freqs tensor in GGUF, which kiln's loader does not read \
                 back: accepted rope scalings are none and linear",
            ));
        }
    }
    if c.mlp_bias {
        return Err(export_error(
            out,
            "MLP biases have no GGUF tensor kiln's loader reads: accepted is none",
        ));
    }
    Ok(m)
}

/// The byte tokenizer as a SentencePiece vocabulary of byte tokens.
fn byte_vocab(c: &ModelConfig) -> Vec<(String, MetaValue)> {
    let v = c.vocab_size;
    let mut tokens = Vec::with_capacity(v);
    let mut types = Vec::with_capacity(v);
    for i in 0..v {
        let (t, ty) = match i {
            // SentencePiece turns spaces into U+2581 before it looks tokens up, so the
            // space byte's token is that character (a normal token), not `<0x20>`.
            0x20 => ("\u{2581}".to_string(), 1),
            0..=255 => (format!("<0x{i:02X}>"), 6),
            _ if i == ByteTokenizer::BOS as usize => ("<s>".to_string(), 3),
            _ if i == ByteTokenizer::EOS as usize => ("</s>".to_string(), 3),
            // Control tokens, so text from them is skipped as the byte tokenizer skips
            // ids past its vocabulary.
            _ => (format!("<unused_{i}>"), 3),
        };
        tokens.push(t);
        types.push(ty);
    }
    vec![
        ("tokenizer.ggml.model".into(), MetaValue::Str("llama".into())),
        ("tokenizer.ggml.tokens".into(), MetaValue::Strs(tokens)),
        ("tokenizer.ggml.scores".into(), MetaValue::F32s(vec![0.0; v])),
        ("tokenizer.ggml.token_type".into(), MetaValue::I32s(types)),
        ("tokenizer.ggml.bos_token_id".into(), MetaValue::U32(ByteTokenizer::BOS)),
        ("tokenizer.ggml.eos_token_id".into(), MetaValue::U32(ByteTokenizer::EOS)),
        // The byte tokenizer puts BOS first whatever the architecture.
        ("tokenizer.ggml.add_bos_token".into(), MetaValue::Bool(true)),
        ("tokenizer.ggml.add_space_prefix".into(), MetaValue::Bool(false)),
    ]
}

/// The tokenizer metadata of the GGUF file the model came from, in llama.cpp's types.
fn gguf_vocab(file: &Path, out: &Path) -> Result<Vec<(String, MetaValue)>> {
    let parsed = super::meta::Parsed::open(file)?;
    let mut m = Vec::new();
    for (key, v) in &parsed.header.metadata {
        if !key.starts_with("tokenizer.") {
            continue;
        }
        let bad = || export_error(out, format!("{}: metadata {key} has an unexpected type", file.display()));
        let mv = match (key.as_str(), v) {
            ("tokenizer.ggml.scores", Value::Array(a)) => MetaValue::F32s(
                a.iter()
                    .map(|x| if let Value::F64(f) = x { Ok(*f as f32) } else { Err(bad()) })
                    .collect::<Result<_>>()?,
            ),
            ("tokenizer.ggml.token_type", Value::Array(a)) => MetaValue::I32s(
                a.iter()
                    .map(|x| match x {
                        Value::I64(i) => Ok(*i as i32),
                        Value::U64(i) => Ok(*i as i32),
                        _ => Err(bad()),
                    })
                    .collect::<Result<_>>()?,
            ),
            (_, Value::Array(_)) => MetaValue::Strs(super::header::as_strings(v).ok_or_else(bad)?),
            (_, Value::Str(s)) => MetaValue::Str(s.clone()),
            (_, Value::Bool(b)) => MetaValue::Bool(*b),
            (_, Value::U64(n)) => MetaValue::U32(u32::try_from(*n).map_err(|_| bad())?),
            (_, Value::I64(n)) => MetaValue::U32(u32::try_from(*n).map_err(|_| bad())?),
            (_, Value::F64(x)) => MetaValue::F32(*x as f32),
        };
        m.push((key.clone(), mv));
    }
    Ok(m)
}

/// A Hugging Face byte-level BPE tokenizer as a `gpt2` vocabulary.
fn bpe_vocab(tk: &tokenizers::Tokenizer, c: &ModelConfig, out: &Path) -> Result<Vec<(String, MetaValue)>> {
    let refuse = |why: &str| {
        export_error(out, format!("the tokenizer {why}: accepted is a byte-level BPE tokenizer.json"))
    };
    let doc: serde_json::Value = serde_json::from_str(
        &tk.to_string(false).map_err(|e| refuse(&format!("cannot be serialized ({e})")))?,
    )
    .map_err(|e| refuse(&format!("is not JSON ({e})")))?;
    let model = &doc["model"];
    if model["type"] != "BPE" || model["byte_fallback"] == true {
        return Err(refuse(&format!("is a {} model", model["type"])));
    }
    let vocab = model["vocab"].as_object().ok_or_else(|| refuse("has no vocabulary"))?;
    let mut tokens = vec![String::new(); c.vocab_size];
    let mut types = vec![5i32; c.vocab_size];
    for (t, id) in vocab {
        if let Some(i) = id.as_u64().map(|i| i as usize).filter(|&i| i < tokens.len()) {
            tokens[i] = t.clone();
            types[i] = 1;
        }
    }
    for a in doc["added_tokens"].as_array().into_iter().flatten() {
        if let (Some(i), Some(t)) = (a["id"].as_u64().map(|i| i as usize), a["content"].as_str())
            && i < tokens.len()
        {
            tokens[i] = t.to_string();
            types[i] = if a["special"] == true { 3 } else { 4 };
        }
    }
    for (i, t) in tokens.iter_mut().enumerate() {
        if t.is_empty() {
            *t = format!("[PAD{i}]");
        }
    }
    let merges: Vec<String> = model["merges"]
        .as_array()
        .ok_or_else(|| refuse("has no merges"))?
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => Ok(s.clone()),
            serde_json::Value::Array(p) if p.len() == 2 => {
                Ok(format!("{} {}", p[0].as_str().unwrap_or_default(), p[1].as_str().unwrap_or_default()))
            }
            _ => Err(refuse("has a merge that is not two tokens")),
        })
        .collect::<Result<_>>()?;
    let pre = if c.architecture == Architecture::Qwen2 { "qwen2" } else { "llama-bpe" };
    let mut m = vec![
        ("tokenizer.ggml.model".into(), MetaValue::Str("gpt2".into())),
        ("tokenizer.ggml.pre".into(), MetaValue::Str(pre.into())),
        ("tokenizer.ggml.tokens".into(), MetaValue::Strs(tokens)),
        ("tokenizer.ggml.token_type".into(), MetaValue::I32s(types)),
        ("tokenizer.ggml.merges".into(), MetaValue::Strs(merges)),
    ];
    if let Some(b) = c.bos_token_id {
        m.push(("tokenizer.ggml.bos_token_id".into(), MetaValue::U32(b)));
    }
    if let Some(&e) = c.eos_token_ids.first() {
        m.push(("tokenizer.ggml.eos_token_id".into(), MetaValue::U32(e)));
    }
    Ok(m)
}

/// Every tensor in llama.cpp's names and order, with its values' source.
fn tensors<'a>(c: &ModelConfig, w: &'a ModelWeights) -> Vec<(String, Source<'a>)> {
    let llama = c.architecture == Architecture::Llama;
    let (q_rows, k_rows) = if llama {
        (Rows::Permute { heads: c.num_attention_heads }, Rows::Permute { heads: c.num_key_value_heads })
    } else {
        (Rows::Same, Rows::Same)
    };
    let mut t = vec![("token_embd.weight".to_string(), Source::Matrix(&w.embed_tokens, Rows::Same))];
    for (i, l) in w.layers.iter().enumerate() {
        let b = |s: &str| format!("blk.{i}.{s}");
        t.push((b("attn_norm.weight"), Source::Vector(&l.input_layernorm.weight, Rows::Same)));
        for (name, lin, rows) in [
            ("attn_q", &l.q_proj, q_rows),
            ("attn_k", &l.k_proj, k_rows),
            ("attn_v", &l.v_proj, Rows::Same),
            ("attn_output", &l.o_proj, Rows::Same),
        ] {
            t.push((b(&format!("{name}.weight")), Source::Matrix(&lin.weight, rows)));
            if let Some(bias) = &lin.bias {
                t.push((b(&format!("{name}.bias")), Source::Vector(bias, rows)));
            }
        }
        t.push((b("ffn_norm.weight"), Source::Vector(&l.post_attention_layernorm.weight, Rows::Same)));
        // Only dense architectures get this far: `arch_name` refuses the MoE ones by name.
        if let Some(mlp) = l.mlp.dense() {
            t.push((b("ffn_gate.weight"), Source::Matrix(&mlp.gate_proj.weight, Rows::Same)));
            t.push((b("ffn_up.weight"), Source::Matrix(&mlp.up_proj.weight, Rows::Same)));
            t.push((b("ffn_down.weight"), Source::Matrix(&mlp.down_proj.weight, Rows::Same)));
        }
    }
    t.push(("output_norm.weight".to_string(), Source::Vector(&w.norm.weight, Rows::Same)));
    if let Some(head) = &w.lm_head {
        t.push(("output.weight".to_string(), Source::Matrix(&head.weight, Rows::Same)));
    }
    t
}

/// Writes `model` to `out` as GGUF, atomically; see the module documentation for what
/// each tensor becomes.
pub fn export(model: &LoadedModel, out: &Path) -> Result<ExportReport> {
    let c = &model.config;
    let mut metadata = model_metadata(c, out)?;
    metadata.extend(match (&model.source, &model.tokenizer) {
        (_, Tokenizer::Bytes(_)) => byte_vocab(c),
        (ModelSource::Gguf(file), _) => gguf_vocab(file, out)?,
        (_, Tokenizer::Hf(tk)) => bpe_vocab(tk, c, out)?,
    });
    let list = tensors(c, &model.weights);
    let mut report = ExportReport { path: out.to_path_buf(), ..ExportReport::default() };
    let mut descs = Vec::with_capacity(list.len());
    for (name, src) in &list {
        let (dims, ty) = match src {
            Source::Vector(v, _) => (vec![v.len() as u64], GgmlType::F32),
            Source::Matrix(w, _) => {
                let ty = match choose(w) {
                    Ok(ty) => ty,
                    Err(why) => {
                        report.f32.push((name.clone(), why));
                        GgmlType::F32
                    }
                };
                match ty {
                    GgmlType::Q4_1 => report.q4_1 += 1,
                    GgmlType::Q8_0 => report.q8_0 += 1,
                    _ => {}
                }
                (vec![w.k() as u64, w.n() as u64], ty)
            }
        };
        let bytes = match src {
            Source::Vector(v, _) => v.len() * 4,
            Source::Matrix(w, _) => w.n() * row_bytes(ty, w.k()),
        } as u64;
        descs.push(TensorDesc { name: name.clone(), dims, ty, bytes });
    }
    let file_type = if report.f32.is_empty() && report.q8_0 == 0 {
        Some(3) // MOSTLY_Q4_1
    } else if report.f32.is_empty() && report.q4_1 == 0 {
        Some(7) // MOSTLY_Q8_0
    } else {
        None
    };
    if let Some(ft) = file_type {
        metadata.push(("general.file_type".into(), MetaValue::U32(ft)));
    }
    let mut file = AtomicFile::create(out)?;
    let tmp = file.tmp_path().to_path_buf();
    let io = |cause: std::io::Error| ModelError::Io { path: tmp.clone(), cause };
    let mut w = BufWriter::with_capacity(1 << 20, file.file());
    let mut total = writer::write_header(&mut w, &metadata, &descs).map_err(io)?;
    for ((_, src), d) in list.iter().zip(&descs) {
        let bytes = tensor_bytes(src, d.ty);
        debug_assert_eq!(bytes.len() as u64, d.bytes, "{}", d.name);
        writer::write_tensor(&mut w, &bytes).map_err(io)?;
        total += bytes.len().next_multiple_of(writer::ALIGNMENT as usize) as u64;
    }
    w.into_inner().map_err(|e| io(e.into_error()))?;
    file.commit()?;
    report.bytes = total;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_row_permutation_is_the_inverse_of_the_loaders() {
        // The loader's mapping, restated: kiln row r comes from stored row h*hd + 2a + b.
        let load = |r: usize, n: usize, heads: usize| {
            let hd = n / heads;
            let (h, i) = (r / hd, r % hd);
            let (b, a) = (i / (hd / 2), i % (hd / 2));
            h * hd + 2 * a + b
        };
        for (n, heads) in [(8, 1), (64, 4), (96, 3)] {
            for s in 0..n {
                assert_eq!(load(permuted_row(s, n, heads), n, heads), s, "n {n} heads {heads} row {s}");
            }
        }
    }
}
