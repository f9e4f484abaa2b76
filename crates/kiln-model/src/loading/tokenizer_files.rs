//! The Hugging Face tokenizer files of any model kiln loads (`tokenizer.json` and
//! `tokenizer_config.json`), so that tools counting tokens on the client side (load
//! generators, `transformers.AutoTokenizer`) count them as kiln does. A Hugging Face or
//! GGUF tokenizer is written as `tokenizers` holds it; the byte tokenizer of synthetic
//! models is rebuilt as an equivalent byte-level BPE without merges (below).

use serde_json::{Value, json};

use super::chat_template::ChatTemplate;
use super::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::loading::tokenizer::{ByteTokenizer, Tokenizer};
use crate::model::TextModel;

/// The text of the byte tokenizer's BOS token in `tokenizer.json` (as `kiln export-gguf`
/// names it).
pub const BYTE_BOS: &str = "<s>";
/// The text of the byte tokenizer's EOS token.
pub const BYTE_EOS: &str = "</s>";

/// The chat template equivalent to how kiln writes a chat for a model without one: one
/// `role: content` line per message, then `assistant: ` (kiln-serve's `render_plain`),
/// after the text of the tokens the tokenizer adds in front (BOS where it adds one), since
/// `apply_chat_template` encodes without special tokens.
pub fn plain_chat_template(prefix: &str) -> String {
    format!(
        "{prefix}{{%- for message in messages -%}}\
         {{{{- message['role'] + ': ' -}}}}\
         {{%- if message['content'] is string -%}}{{{{- message['content'] -}}}}\
         {{%- else -%}}{{%- for part in message['content'] -%}}{{{{- part['text'] -}}}}{{%- endfor -%}}\
         {{%- endif -%}}\
         {{{{- '\\n' -}}}}\
         {{%- endfor -%}}\
         {{%- if add_generation_prompt -%}}{{{{- 'assistant: ' -}}}}{{%- endif -%}}"
    )
}

/// `tokenizer.json` of `model`.
pub fn tokenizer_json(model: &TextModel) -> Result<String> {
    let serialize = |t: &tokenizers::Tokenizer| {
        t.to_string(false).map_err(|e| ModelError::Tokenizer {
            path: "tokenizer.json".into(),
            message: format!("the tokenizer could not be written as tokenizer.json: {e}"),
        })
    };
    match &model.tokenizer {
        Tokenizer::Hf(t) => serialize(t),
        Tokenizer::Bytes(_) => {
            // Parsed back before it is written, so what is written is what `tokenizers`
            // (and so `transformers`) reads.
            let doc = byte_tokenizer_json(model.config.vocab_size).to_string();
            let t = doc.parse::<tokenizers::Tokenizer>().map_err(|e| ModelError::Tokenizer {
                path: "tokenizer.json".into(),
                message: format!("the byte tokenizer's tokenizer.json does not parse: {e}"),
            })?;
            serialize(&t)
        }
    }
}

/// `tokenizer_config.json` of `model`: the tokenizer class, BOS and EOS, the context as
/// `model_max_length`, and the chat template the server uses (the model's, or the plain
/// rendering of a model without one).
pub fn tokenizer_config(model: &TextModel) -> Result<Value> {
    tokenizer_config_of(&model.config, &model.tokenizer, model.chat_template.as_ref())
}

/// [`tokenizer_config`] of a model's parts, for a caller holding a loaded model (the
/// server's `/tokenizer_info`).
pub fn tokenizer_config_of(
    config: &ModelConfig,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
) -> Result<Value> {
    let text = |id: Option<u32>| id.and_then(|id| token_text(tokenizer, id));
    let bos = template.and_then(|t| t.bos_token.clone()).or_else(|| text(config.bos_token_id));
    let eos =
        template.and_then(|t| t.eos_token.clone()).or_else(|| text(config.eos_token_ids.first().copied()));
    let chat_template = match template {
        Some(t) => Some(t.source.clone()),
        None => plain_prefix(tokenizer)?.map(|p| plain_chat_template(&p)),
    };
    Ok(json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "model_max_length": config.max_position_embeddings,
        "clean_up_tokenization_spaces": false,
        "chat_template": chat_template,
    }))
}

/// The text of token `id`.
fn token_text(t: &Tokenizer, id: u32) -> Option<String> {
    match t {
        Tokenizer::Bytes(_) if id == ByteTokenizer::BOS => Some(BYTE_BOS.into()),
        Tokenizer::Bytes(_) if id == ByteTokenizer::EOS => Some(BYTE_EOS.into()),
        Tokenizer::Bytes(_) => None,
        Tokenizer::Hf(t) => t.id_to_token(id),
    }
}

/// The text of what encoding with special tokens adds in front of a text: the template
/// of a model without one writes it so that the rendered chat, encoded without special
/// tokens as `apply_chat_template` does, is the server's prompt. `None` when the
/// tokenizer adds tokens elsewhere (after the text), which a template cannot reproduce.
fn plain_prefix(t: &Tokenizer) -> Result<Option<String>> {
    let (with, without) = (t.encode("a", true)?, t.encode("a", false)?);
    let Some(at) = with.windows(without.len()).position(|w| w == without.as_slice()) else {
        return Ok(None);
    };
    if at + without.len() != with.len() {
        return Ok(None);
    }
    let mut prefix = String::new();
    for &id in &with[..at] {
        match token_text(t, id) {
            Some(s) => prefix.push_str(&s),
            None => return Ok(None),
        }
    }
    Ok(Some(prefix))
}

/// GPT-2's byte-to-character table: the character a byte-level pre-tokenizer turns each
/// byte into (printable Latin-1 stays itself, the rest moves past U+0100).
fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let printable =
            (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
        let code = if printable {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).unwrap_or('\0');
    }
    table
}

/// The byte tokenizer as a `tokenizer.json` document: a byte-level pre-tokenizer (one
/// character per byte, no splitting), a BPE model whose ids 0 to 255 are the bytes and
/// which has no merges (so every byte stays one token, as kiln encodes), BOS and EOS as
/// special tokens 256 and 257 with BOS added in front, and every id above them up to
/// `vocab_size` as the word kiln decodes it to (a space and letters), reachable only by
/// decoding.
fn byte_tokenizer_json(vocab_size: usize) -> Value {
    let chars = byte_chars();
    let mut vocab = serde_json::Map::new();
    for (b, c) in chars.iter().enumerate() {
        vocab.insert(c.to_string(), json!(b));
    }
    vocab.insert(BYTE_BOS.into(), json!(ByteTokenizer::BOS));
    vocab.insert(BYTE_EOS.into(), json!(ByteTokenizer::EOS));
    for id in ByteTokenizer::MIN_VOCAB..vocab_size {
        let word = ByteTokenizer.decode(&[id as u32]);
        let encoded: String = word.bytes().map(|b| chars[b as usize]).collect();
        vocab.insert(encoded, json!(id));
    }
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
               "normalized": false, "special": true})
    };
    let byte_level =
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(ByteTokenizer::BOS, BYTE_BOS), special(ByteTokenizer::EOS, BYTE_EOS)],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": BYTE_BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": BYTE_BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BYTE_BOS: {"id": BYTE_BOS, "ids": [ByteTokenizer::BOS], "tokens": [BYTE_BOS]}},
        },
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []},
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loading::chat_template::{ChatMessage, ChatTemplate};

    fn synthetic(name: &str) -> TextModel {
        crate::loading::synthetic::load_text(name).unwrap()
    }

    /// Texts whose bytes cover every kind a byte-level tokenizer treats apart: spaces and
    /// newlines, punctuation, multi-byte characters, control bytes, and words that are
    /// spelled like the decoded words of the ids past the specials.
    const TEXTS: &[&str] = &[
        "",
        "hello world",
        "  two  spaces\nand\ttabs\r\n",
        "héllo, wörld! 你好 🎉",
        "\u{0}\u{1}\u{7f} control",
        " a bb zz abc",
        "<tag> </tag> <|im_start|>",
    ];

    #[test]
    fn the_byte_tokenizer_file_encodes_and_decodes_as_kiln_does() {
        let m = synthetic("tiny");
        let t: tokenizers::Tokenizer = tokenizer_json(&m).unwrap().parse().unwrap();
        assert_eq!(t.get_vocab_size(true), m.config.vocab_size);
        for text in TEXTS {
            for special in [false, true] {
                let kiln = ByteTokenizer.encode(text, special);
                let hf = t.encode(*text, special).unwrap().get_ids().to_vec();
                assert_eq!(hf, kiln, "{text:?} with special tokens {special}");
            }
        }
        // Every id decodes to kiln's text, the words past the specials included, and the
        // specials are skipped.
        let ids: Vec<u32> = (0..m.config.vocab_size as u32).filter(|i| *i < 0x80 || *i >= 256).collect();
        assert_eq!(t.decode(&ids, true).unwrap(), ByteTokenizer.decode(&ids));
        let utf8: Vec<u32> = "wörld 🎉".bytes().map(u32::from).collect();
        assert_eq!(t.decode(&utf8, true).unwrap(), "wörld 🎉");
    }

    #[test]
    fn the_config_names_the_specials_context_and_the_plain_template() {
        let m = synthetic("tiny");
        let c = tokenizer_config(&m).unwrap();
        assert_eq!(c["bos_token"], BYTE_BOS);
        assert_eq!(c["eos_token"], BYTE_EOS);
        assert_eq!(c["model_max_length"], m.config.max_position_embeddings);
        // The template, rendered as transformers would and encoded without special tokens,
        // gives BOS and then the plain rendering's bytes.
        let t = ChatTemplate::new(
            c["chat_template"].as_str().unwrap(),
            Some(BYTE_BOS.into()),
            Some(BYTE_EOS.into()),
            "tokenizer_config.json",
        )
        .unwrap();
        let messages = [ChatMessage::system("be brief"), ChatMessage::user("hi\nthere")];
        let text = t.render(&messages, true).unwrap();
        assert_eq!(text, "<s>system: be brief\nuser: hi\nthere\nassistant: ");
        let hf: tokenizers::Tokenizer = tokenizer_json(&m).unwrap().parse().unwrap();
        let ids = hf.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        assert_eq!(ids, ByteTokenizer.encode("system: be brief\nuser: hi\nthere\nassistant: ", true));
        // Content given as parts renders as their text.
        let parts = serde_json::json!([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]);
        let parts: Vec<Value> = serde_json::from_value(parts).unwrap();
        assert_eq!(t.render(&parts, false).unwrap(), "<s>user: ab\n");
    }

    #[test]
    fn every_byte_has_its_own_character() {
        let chars = byte_chars();
        let distinct: std::collections::BTreeSet<char> = chars.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
        assert_eq!(chars[b' ' as usize], '\u{120}');
        assert_eq!(chars[b'a' as usize], 'a');
    }
}
