//! The token trie llguidance computes masks over, built from kiln's own tokenizers: the
//! bytes every token id stands for, the end-of-sequence ids, and a tokenizer for the
//! literal strings of a grammar.

use std::sync::Arc;

use kiln_model::Tokenizer;
use kiln_model::tokenizer::ByteTokenizer;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// A vocabulary as llguidance sees it.
pub struct Vocab {
    trie: TokTrie,
}

impl Vocab {
    /// The vocabulary of `tokenizer` padded to the model's `vocab_size` rows (ids past the
    /// tokenizer's are special tokens no grammar ever allows), ending sequences at `eos`.
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize, eos: &[u32]) -> Result<Self, String> {
        let mut words = match tokenizer {
            Tokenizer::Bytes(_) => byte_tokenizer_words(vocab_size),
            Tokenizer::Hf(t) => {
                let json: serde_json::Value =
                    serde_json::from_str(&t.to_string(false).map_err(|e| e.to_string())?)
                        .map_err(|e| e.to_string())?;
                llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| e.to_string())?
            }
        };
        if words.len() > vocab_size {
            return Err(format!(
                "the tokenizer has {} tokens, more than the model's {vocab_size} logits",
                words.len()
            ));
        }
        for (id, w) in words.iter_mut().enumerate() {
            // An id the tokenizer does not spell (a gap in its vocabulary): a special token
            // of its own, never part of any text.
            if w.is_empty() {
                *w = special(&format!("<[{id}]>"));
            }
        }
        while words.len() < vocab_size {
            let id = words.len();
            words.push(special(&format!("<[{id}]>")));
        }
        let first = *eos.first().ok_or("the model names no end-of-sequence token")?;
        let info = TokRxInfo::new(vocab_size as u32, first);
        let mut trie = TokTrie::from(&info, &words);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(eos);
        }
        Ok(Vocab { trie })
    }

    /// The environment llguidance's parser factory takes.
    pub fn into_env(self) -> TokEnv {
        Arc::new(self)
    }
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Greedy longest-match tokenization: llguidance uses it for a grammar's literal
    /// strings, where any tokenization that spells the bytes will do.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }
}

/// A special token's entry in the trie: the marker byte, then its name.
fn special(name: &str) -> Vec<u8> {
    let mut w = Vec::with_capacity(name.len() + 1);
    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
    w.extend_from_slice(name.as_bytes());
    w
}

/// The synthetic models' byte tokenizer: ids 0 to 255 are bytes, BOS and EOS are special,
/// and every id above them is the word it decodes to.
fn byte_tokenizer_words(vocab_size: usize) -> Vec<Vec<u8>> {
    let bt = ByteTokenizer;
    (0..vocab_size.max(ByteTokenizer::MIN_VOCAB) as u32)
        .map(|id| match id {
            0..=255 => vec![id as u8],
            ByteTokenizer::BOS => special("<s>"),
            ByteTokenizer::EOS => special("</s>"),
            _ => bt.decode(&[id]).into_bytes(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokenizer_ids_spell_what_they_decode_to() {
        let v = Vocab::new(&Tokenizer::Bytes(ByteTokenizer), 300, &[ByteTokenizer::EOS]).unwrap();
        let t = &v.trie;
        assert_eq!(t.vocab_size(), 300);
        assert_eq!(t.token(u32::from(b'{')), b"{");
        assert_eq!(t.token(ByteTokenizer::MIN_VOCAB as u32 + 27), b" bb");
        assert!(t.is_special_token(ByteTokenizer::EOS));
        assert_eq!(t.eos_token(), ByteTokenizer::EOS);
        assert_eq!(t.greedy_tokenize(b"{\"a\""), vec![123, 34, 97, 34]);
    }

    #[test]
    fn hugging_face_tokens_are_their_bytes() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../kiln-model/tests/fixtures/models/qwen2-tiny");
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let n = tok.vocab_size();
        let v = Vocab::new(&tok, n + 5, &[0]).unwrap();
        // Every ordinary token's bytes decode to the tokenizer's own text of it.
        let mut checked = 0;
        for id in 0..n as u32 {
            if v.trie.is_special_token(id) {
                continue;
            }
            let text = tok.decode(&[id]).unwrap();
            if text.contains('\u{fffd}') {
                continue; // part of a character
            }
            assert_eq!(v.trie.token(id), text.as_bytes(), "token {id}");
            checked += 1;
        }
        assert!(checked > n / 2, "{checked} of {n}");
        assert!(v.trie.is_special_token(n as u32 + 4), "padding ids are special");
    }
}
