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
        if !crate::source::regular_file(&path)? {
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

/// One token per byte of UTF-8; ids at and above 256 are specials or padding.
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

    /// Text of the byte ids among `ids` (others skipped), invalid UTF-8 replaced.
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().filter_map(|&i| u8::try_from(i).ok()).collect();
        String::from_utf8_lossy(&bytes).into_owned()
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
        with_eos.push(90_000);
        assert_eq!(t.decode(&with_eos), "héllo");
    }
}
