//! Tokenizers: Hugging Face `tokenizer.json` through the `tokenizers` crate, and the
//! byte-level tokenizer synthetic models use (one token per byte, then specials).

use std::path::Path;

use crate::error::{ModelError, Result};

/// Turns text into token ids and back.
pub enum Tokenizer {
    /// One token per byte; ids 256 and 257 are BOS and EOS.
    Bytes(ByteTokenizer),
    /// A Hugging Face tokenizer.
    Hf(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    /// Loads `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let t = tokenizers::Tokenizer::from_file(path).map_err(|e| ModelError::Tokenizer {
            path: path.to_path_buf(),
            message: format!("not a usable Hugging Face tokenizer.json: {e}"),
        })?;
        Ok(Tokenizer::Hf(Box::new(t)))
    }

    /// Loads `tokenizer.json` from a checkpoint directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !crate::loading::source::regular_file(&path)? {
            return Err(ModelError::Tokenizer {
                path,
                message: "missing: kiln reads Hugging Face tokenizer.json files \
                          (a sentencepiece tokenizer.model or tiktoken file alone is not supported)"
                    .into(),
            });
        }
        Self::from_file(&path)
    }

    /// Tokens in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Bytes(_) => ByteTokenizer::MIN_VOCAB,
            Tokenizer::Hf(t) => t.get_vocab_size(true),
        }
    }

    /// Token ids of `text`; `add_special` adds what the tokenizer's post-processor adds
    /// (BOS for Llama 3, nothing for Qwen2).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Bytes(b) => Ok(b.encode(text, add_special)),
            Tokenizer::Hf(t) => t
                .encode(text, add_special)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| ModelError::Tokenizer { path: "tokenizer.json".into(), message: e.to_string() }),
        }
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match self {
            Tokenizer::Bytes(b) => Ok(b.decode(ids)),
            Tokenizer::Hf(t) => t
                .decode(ids, true)
                .map_err(|e| ModelError::Tokenizer { path: "tokenizer.json".into(), message: e.to_string() }),
        }
    }

    /// The id of `token` in the vocabulary, if present.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match self {
            Tokenizer::Bytes(_) => None,
            Tokenizer::Hf(t) => t.token_to_id(token),
        }
    }
}

/// One token per byte of UTF-8; ids 256 and 257 are the specials, and every id above them
/// (the rest of a synthetic profile's vocabulary) decodes to a word of its own: a space and
/// a few lowercase letters spelling the id, so a synthetic model's sampled tokens
/// become text at the rate a real tokenizer's would (streams and their timings are
/// meaningful), while prompts are still encoded byte by byte.
#[derive(Clone, Copy, Debug)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// Beginning of sequence.
    pub const BOS: u32 = 256;
    /// End of sequence.
    pub const EOS: u32 = 257;
    /// Smallest vocabulary that holds every byte and both specials.
    pub const MIN_VOCAB: usize = 258;

    /// Bytes of `text` as ids, after BOS when `add_special`.
    pub fn encode(&self, text: &str, add_special: bool) -> Vec<u32> {
        let mut ids = Vec::with_capacity(text.len() + 1);
        if add_special {
            ids.push(Self::BOS);
        }
        ids.extend(text.bytes().map(u32::from));
        ids
    }

    /// Text of `ids`: runs of byte ids as UTF-8 (invalid sequences replaced), each id above
    /// the specials as its word, the specials skipped.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut text = String::new();
        let mut bytes = Vec::new();
        for &id in ids {
            if let Ok(byte) = u8::try_from(id) {
                bytes.push(byte);
            } else if id >= Self::MIN_VOCAB as u32 {
                text.push_str(&String::from_utf8_lossy(&bytes));
                bytes.clear();
                push_word(&mut text, id - Self::MIN_VOCAB as u32);
            }
        }
        text.push_str(&String::from_utf8_lossy(&bytes));
        text
    }
}

/// Appends a space and the base-26 spelling of `n` in lowercase letters, least significant
/// first (so `0` is " a" and the whole u32 range fits in seven letters).
fn push_word(text: &mut String, mut n: u32) {
    text.push(' ');
    loop {
        text.push(char::from(b'a' + (n % 26) as u8));
        n /= 26;
        if n == 0 {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_skip_specials() {
        let t = ByteTokenizer;
        let ids = t.encode("héllo", true);
        assert_eq!(ids[0], ByteTokenizer::BOS);
        assert_eq!(ids.len(), 7);
        let mut with_eos = ids.clone();
        with_eos.push(ByteTokenizer::EOS);
        assert_eq!(t.decode(&with_eos), "héllo");
    }

    #[test]
    fn ids_above_the_specials_are_words_and_keep_bytes_around_them_whole() {
        let t = ByteTokenizer;
        let min = ByteTokenizer::MIN_VOCAB as u32;
        assert_eq!(t.decode(&[min]), " a");
        assert_eq!(t.decode(&[min + 27]), " bb");
        assert_eq!(t.decode(&[u32::from(b'h'), u32::from(b'i'), min + 25, ByteTokenizer::EOS]), "hi z");
        // A character's bytes split by a word token are each replaced, not joined across it.
        let e_acute = "é".as_bytes();
        assert_eq!(t.decode(&[u32::from(e_acute[0]), min, u32::from(e_acute[1])]), "\u{fffd} a\u{fffd}");
        // Decoding is prefix-stable wherever a prefix ends on a whole character.
        let ids = [u32::from(b'o'), min + 3, u32::from(e_acute[0]), u32::from(e_acute[1]), min + 700];
        let whole = t.decode(&ids);
        for cut in [1, 2, 4] {
            assert!(whole.starts_with(&t.decode(&ids[..cut])), "cut {cut}: {whole:?}");
        }
        assert!(t.decode(&[u32::MAX]).len() <= 8);
    }
}
