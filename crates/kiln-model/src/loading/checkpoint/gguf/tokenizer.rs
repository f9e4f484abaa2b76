//! The tokenizer and chat template a GGUF file carries in its metadata, rebuilt as a
//! `tokenizers` object: GPT-2 style byte-level BPE (`tokenizer.ggml.model = "gpt2"`: tokens,
//! merges, token types and the pre-tokenizer `tokenizer.ggml.pre` names) and
//! SentencePiece-style BPE (`"llama"`: tokens, scores and byte fallback). The rebuilt
//! tokenizer is written as a `tokenizer.json` document and parsed by `tokenizers`, so it
//! follows the same code paths as a Hugging Face checkpoint's.

use std::collections::BTreeMap;

use serde_json::{Value as Json, json};

use super::meta::{Meta, MetaError};

/// ggml token types (`tokenizer.ggml.token_type`).
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

/// Llama 3's split (`llama-bpe`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split (`qwen2`): digits one at a time.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Pre-tokenizer names kiln knows, for messages.
const PRE_NAMES: &str = "default, gpt2, smollm, llama-bpe, llama3, qwen2";

/// The GPT-2 byte-level pre-tokenizer `pre` names, as a `tokenizer.json` value.
fn byte_level_pre(pre: &str) -> Result<Json, String> {
    let split = |regex: &str| json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false});
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    Ok(match pre {
        "default" | "gpt2" => byte_level(true),
        // SmolLM's tokenizer.json: every digit its own token, then GPT-2's split.
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        "llama-bpe" | "llama3" => {
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false)]})
        }
        "qwen2" => json!({"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level(false)]}),
        other => {
            return Err(format!(
                "unsupported tokenizer.ggml.pre {other:?}: accepted pre-tokenizers are {PRE_NAMES}"
            ));
        }
    })
}

/// The tokenizer of `meta` as a `tokenizer.json` document.
pub(crate) fn tokenizer_json(meta: &Meta<'_>) -> Result<Json, MetaError> {
    let model = meta.str("tokenizer.ggml.model")?;
    let tokens = meta.strings("tokenizer.ggml.tokens")?;
    let types: Vec<i64> = match meta.get("tokenizer.ggml.token_type") {
        Some(_) => meta.ints("tokenizer.ggml.token_type")?,
        None => vec![1; tokens.len()],
    };
    if types.len() != tokens.len() {
        return Err(meta.invalid(
            "tokenizer.ggml.token_type",
            format!("{} entries, expected one per token ({})", types.len(), tokens.len()),
        ));
    }
    let mut vocab = serde_json::Map::new();
    for (id, t) in tokens.iter().enumerate() {
        // A later duplicate would shadow an earlier id; the first one wins, as in llama.cpp.
        vocab.entry(t.clone()).or_insert(json!(id));
    }
    let added: Vec<Json> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, ty))| **ty == TYPE_CONTROL || **ty == TYPE_USER_DEFINED)
        .map(|(id, (t, ty))| {
            json!({"id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": *ty == TYPE_CONTROL})
        })
        .collect();
    let token_at = |key: &str| -> Result<Option<String>, MetaError> {
        match meta.opt_u64(key)? {
            None => Ok(None),
            Some(id) => tokens.get(id as usize).cloned().map(Some).ok_or_else(|| {
                meta.invalid(key, format!("id {id} is outside the vocabulary of {}", tokens.len()))
            }),
        }
    };
    let bos = token_at("tokenizer.ggml.bos_token_id")?;
    let (body, default_add_bos) = match model.as_str() {
        "gpt2" => {
            let pre = match meta.get("tokenizer.ggml.pre") {
                Some(_) => meta.str("tokenizer.ggml.pre")?,
                None => "default".to_string(),
            };
            let pre_tokenizer =
                byte_level_pre(&pre).map_err(|m| meta.unsupported("tokenizer.ggml.pre", m))?;
            let merges = meta
                .strings("tokenizer.ggml.merges")?
                .into_iter()
                .map(|m| match m.split_once(' ') {
                    Some((a, b)) => Ok(json!([a, b])),
                    None => {
                        Err(meta.invalid("tokenizer.ggml.merges", format!("merge {m:?} is not two tokens")))
                    }
                })
                .collect::<Result<Vec<_>, _>>()?;
            let body = json!({
                "normalizer": null,
                "pre_tokenizer": pre_tokenizer,
                "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
                "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                          "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                          "ignore_merges": false, "vocab": vocab, "merges": merges},
            });
            (body, false)
        }
        "llama" => {
            let scores = meta.floats("tokenizer.ggml.scores")?;
            if scores.len() != tokens.len() {
                return Err(meta.invalid(
                    "tokenizer.ggml.scores",
                    format!("{} entries, expected one per token ({})", scores.len(), tokens.len()),
                ));
            }
            let prefix = match meta.get("tokenizer.ggml.add_space_prefix") {
                Some(_) => meta.bool("tokenizer.ggml.add_space_prefix")?,
                None => true,
            };
            let mut normalizers = Vec::new();
            if prefix {
                normalizers.push(json!({"type": "Prepend", "prepend": "\u{2581}"}));
            }
            normalizers.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}));
            let mut decoders = vec![
                json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
                json!({"type": "ByteFallback"}),
                json!({"type": "Fuse"}),
            ];
            if prefix {
                decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
            }
            let unk = token_at("tokenizer.ggml.unknown_token_id")?;
            let body = json!({
                "normalizer": {"type": "Sequence", "normalizers": normalizers},
                "pre_tokenizer": null,
                "decoder": {"type": "Sequence", "decoders": decoders},
                "model": {"type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
                          "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
                          "ignore_merges": false, "vocab": vocab, "merges": spm_merges(&tokens, &types, &scores)},
            });
            (body, true)
        }
        other => {
            return Err(meta.unsupported(
                "tokenizer.ggml.model",
                format!("unsupported tokenizer.ggml.model {other:?}: accepted models are gpt2 and llama"),
            ));
        }
    };
    let add_bos = match meta.get("tokenizer.ggml.add_bos_token") {
        Some(_) => meta.bool("tokenizer.ggml.add_bos_token")?,
        None => default_add_bos,
    };
    let post_processor = match (&bos, add_bos) {
        (Some(b), true) => {
            let id = meta.opt_u64("tokenizer.ggml.bos_token_id")?.unwrap_or_default();
            json!({"type": "TemplateProcessing",
                   "single": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                   "pair": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                            {"Sequence": {"id": "B", "type_id": 1}}],
                   "special_tokens": {b.as_str(): {"id": b, "ids": [id], "tokens": [b]}}})
        }
        _ => Json::Null,
    };
    let mut doc = json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
                         "post_processor": post_processor});
    if let (Json::Object(d), Json::Object(b)) = (&mut doc, body) {
        d.extend(b);
    }
    Ok(doc)
}

/// Merges for a SentencePiece BPE vocabulary: every way a token splits into two tokens,
/// the merges producing higher-scored tokens first (SentencePiece applies the best-scored
/// merge first), ties broken by the merged token's id and then the left piece's length.
fn spm_merges(tokens: &[String], types: &[i64], scores: &[f64]) -> Vec<Json> {
    let ids: BTreeMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    let mut merges = Vec::new();
    for (id, t) in tokens.iter().enumerate() {
        if types[id] != 1 {
            continue;
        }
        for (at, _) in t.char_indices().skip(1) {
            let (a, b) = t.split_at(at);
            if ids.contains_key(a) && ids.contains_key(b) {
                merges.push((scores[id], id, a.len(), a, b));
            }
        }
    }
    merges.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
    merges.into_iter().map(|(_, _, _, a, b)| json!([a, b])).collect()
}

#[cfg(test)]
mod tests {
    use super::super::header::Value;
    use super::*;

    fn strs(v: &[&str]) -> Value {
        Value::Array(v.iter().map(|s| Value::Str(s.to_string())).collect())
    }

    fn build(map: &BTreeMap<String, Value>) -> Result<tokenizers::Tokenizer, MetaError> {
        let meta = Meta { map, path: std::path::Path::new("t.gguf") };
        Ok(tokenizer_json(&meta)?.to_string().parse::<tokenizers::Tokenizer>().unwrap())
    }

    /// A SentencePiece vocabulary: specials, two byte tokens, pieces with scores.
    fn spm() -> BTreeMap<String, Value> {
        let tokens = ["<unk>", "<s>", "</s>", "<0xC3>", "<0xA9>", "\u{2581}", "a", "b", "ab", "\u{2581}ab"];
        let types = [2, 3, 3, 6, 6, 1, 1, 1, 1, 1];
        let scores = [0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -0.5, -0.1];
        BTreeMap::from([
            ("tokenizer.ggml.model".to_string(), Value::Str("llama".into())),
            ("tokenizer.ggml.tokens".to_string(), strs(&tokens)),
            (
                "tokenizer.ggml.token_type".to_string(),
                Value::Array(types.iter().map(|&t| Value::I64(t)).collect()),
            ),
            (
                "tokenizer.ggml.scores".to_string(),
                Value::Array(scores.iter().map(|&s| Value::F64(s)).collect()),
            ),
            ("tokenizer.ggml.bos_token_id".to_string(), Value::U64(1)),
            ("tokenizer.ggml.unknown_token_id".to_string(), Value::U64(0)),
        ])
    }

    #[test]
    fn sentencepiece_merges_by_score_falls_back_to_bytes_and_adds_bos() {
        let t = build(&spm()).unwrap();
        let e = t.encode("ab ab", true).unwrap();
        assert_eq!(e.get_ids(), &[1, 9, 9]);
        // "é" is not a piece: its UTF-8 bytes are.
        let e = t.encode("é", false).unwrap();
        assert_eq!(e.get_ids(), &[5, 3, 4]);
        assert_eq!(t.decode(&[1, 9, 9, 5, 3, 4], true).unwrap(), "ab ab é");
    }

    #[test]
    fn gpt2_with_smollm_splits_digits_and_unknown_pre_is_named() {
        let tokens = ["<|im_start|>", "1", "2", "12", "\u{120}", "a", "\u{120}a"];
        let mut m = BTreeMap::from([
            ("tokenizer.ggml.model".to_string(), Value::Str("gpt2".into())),
            ("tokenizer.ggml.pre".to_string(), Value::Str("smollm".into())),
            ("tokenizer.ggml.tokens".to_string(), strs(&tokens)),
            (
                "tokenizer.ggml.token_type".to_string(),
                Value::Array([3, 1, 1, 1, 1, 1, 1].map(Value::I64).to_vec()),
            ),
            ("tokenizer.ggml.merges".to_string(), strs(&["1 2", "\u{120} a"])),
        ]);
        let t = build(&m).unwrap();
        // Digits one per token even though "12" is a merge; the control token is whole.
        assert_eq!(t.encode("<|im_start|>12 a", false).unwrap().get_ids(), &[0, 1, 2, 6]);
        m.insert("tokenizer.ggml.pre".into(), Value::Str("tekken".into()));
        let e = build(&m).unwrap_err().to_string();
        assert!(e.contains("tokenizer.ggml.pre") && e.contains("\"tekken\"") && e.contains("smollm"), "{e}");
    }
}
