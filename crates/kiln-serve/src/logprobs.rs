//! Log-probabilities in OpenAI's shapes: a chat choice's `logprobs.content[]` entries
//! (`{token, logprob, bytes, top_logprobs}`) and a completion choice's `logprobs`
//! (`{tokens, token_logprobs, top_logprobs, text_offset}`). A token's text is its own
//! decoding (special tokens decode to nothing); `bytes` are that text's UTF-8 bytes, or
//! for the byte tokenizer the token's byte itself.

use kiln_model::{LoadedModel, Tokenizer};
use serde_json::{Map, Value, json};

use crate::scheduler::TokenLogprob;

/// A token's text and bytes.
pub fn token_text(model: &LoadedModel, token: u32) -> (String, Vec<u8>) {
    match &model.tokenizer {
        Tokenizer::Bytes(_) if token < 256 => {
            let byte = [token as u8];
            (String::from_utf8_lossy(&byte).into_owned(), byte.to_vec())
        }
        t => {
            let text = t.decode(&[token]).unwrap_or_default();
            let bytes = text.as_bytes().to_vec();
            (text, bytes)
        }
    }
}

/// One `{token, logprob, bytes}` object of a chat choice's log-probabilities.
pub fn chat_entry(model: &LoadedModel, token: u32, logprob: f32) -> Value {
    let (text, bytes) = token_text(model, token);
    json!({"token": text, "logprob": logprob, "bytes": bytes})
}

/// A completion choice's log-probabilities, built token by token.
#[derive(Default)]
pub struct CompletionLogprobs {
    tokens: Vec<Value>,
    token_logprobs: Vec<Value>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<Value>,
}

impl CompletionLogprobs {
    /// The first token of an echoed prompt, which has no log-probability (null).
    pub fn push_first(&mut self, model: &LoadedModel, token: u32, offset: &mut usize) {
        self.push_token(model, token, offset);
        self.token_logprobs.push(Value::Null);
        self.top_logprobs.push(Value::Null);
    }

    /// A token with its log-probability and alternatives (a map from each
    /// alternative's text to its log-probability; alternatives whose texts coincide keep
    /// the most likely one, as OpenAI's map does).
    pub fn push(&mut self, model: &LoadedModel, e: &TokenLogprob, offset: &mut usize) {
        self.push_token(model, e.token, offset);
        self.token_logprobs.push(json!(e.logprob));
        let mut top = Map::new();
        for &(t, l) in &e.top {
            let (text, _) = token_text(model, t);
            top.entry(text).or_insert(json!(l));
        }
        self.top_logprobs.push(Value::Object(top));
    }

    fn push_token(&mut self, model: &LoadedModel, token: u32, offset: &mut usize) {
        let (text, _) = token_text(model, token);
        self.text_offset.push(json!(*offset));
        *offset += text.chars().count();
        self.tokens.push(Value::String(text));
    }

    /// The `logprobs` object.
    pub fn into_value(self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::MemoryPool;
    use kiln_model::LoadOptions;

    fn tiny() -> LoadedModel {
        kiln_model::load("synthetic:tiny", &LoadOptions { pool: MemoryPool::unlimited(), quantize: None })
            .unwrap()
    }

    #[test]
    fn completion_logprobs_have_openai_s_four_lists_with_a_null_first_echo_token() {
        let m = tiny();
        let mut c = CompletionLogprobs::default();
        let mut offset = 0;
        c.push_first(&m, 256, &mut offset); // BOS: no text
        c.push(
            &m,
            &TokenLogprob { token: u32::from(b'h'), logprob: -1.5, top: vec![(105, -0.25), (104, -1.5)] },
            &mut offset,
        );
        c.push(&m, &TokenLogprob { token: u32::from(b'i'), logprob: -0.25, top: vec![] }, &mut offset);
        let v = c.into_value();
        assert_eq!(v["tokens"], json!(["", "h", "i"]));
        assert_eq!(v["token_logprobs"], json!([null, -1.5, -0.25]));
        assert_eq!(v["top_logprobs"], json!([null, {"i": -0.25, "h": -1.5}, {}]));
        assert_eq!(v["text_offset"], json!([0, 0, 1]));
        assert_eq!(offset, 2);
    }

    #[test]
    fn a_chat_entry_carries_the_token_s_text_and_bytes() {
        let m = tiny();
        assert_eq!(
            chat_entry(&m, u32::from(b'A'), -0.5),
            json!({"token": "A", "logprob": -0.5, "bytes": [65]})
        );
        // Half of a UTF-8 character: the byte itself, the text its replacement.
        let e = chat_entry(&m, 0xc3, -2.0);
        assert_eq!(e["bytes"], json!([0xc3]));
        assert_eq!(e["token"], "\u{fffd}");
        // A word token of the synthetic vocabulary decodes to its word.
        assert_eq!(chat_entry(&m, 258, -1.0)["token"], " a");
    }
}
