//! Prompts of an exact length for benchmarks: ordinary English text, encoded with the
//! model's tokenizer (with its special tokens, so BOS comes first where the model wants
//! one), repeated until there are enough tokens, then cut to exactly N.

use anyhow::Context;
use kiln_model::Tokenizer;

use crate::exit::usage;

/// Text the prompts are made of: prose, so a real tokenizer sees typical token lengths.
const FILLER: &str = "The kiln was built into the side of the hill, where the clay came \
    out of the ground already damp. Every spring the potters cleaned the flues, stacked the \
    shelves with bowls and jars, and sealed the door with bricks and mud. The fire burned \
    for three days and three nights; someone always watched it, feeding wood through the \
    side ports and reading the colour of the flame. When it was over they waited another \
    two days before opening the door, because a pot that cools too fast will crack. ";

/// Exactly `n` tokens of filler text.
pub fn of_length(tokenizer: &Tokenizer, n: usize) -> anyhow::Result<Vec<u32>> {
    if n == 0 {
        return Err(usage("invalid --prompt-tokens 0: a prompt needs at least 1 token"));
    }
    let mut ids = tokenizer.encode(FILLER, true).context("encoding the benchmark prompt")?;
    let body = tokenizer.encode(FILLER, false).context("encoding the benchmark prompt")?;
    if body.is_empty() {
        anyhow::bail!("the tokenizer encodes the benchmark text to no tokens");
    }
    while ids.len() < n {
        ids.extend_from_slice(&body);
    }
    ids.truncate(n);
    Ok(ids)
}

/// `text` encoded with the model's special tokens.
pub fn of_text(tokenizer: &Tokenizer, text: &str) -> anyhow::Result<Vec<u32>> {
    let ids = tokenizer.encode(text, true).context("encoding the prompt")?;
    if ids.is_empty() {
        return Err(usage("invalid --prompt: it encodes to no tokens; give some text"));
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use kiln_model::tokenizer::ByteTokenizer;

    use super::*;

    #[test]
    fn exact_lengths_start_with_bos() {
        let t = Tokenizer::Bytes(ByteTokenizer);
        for n in [1, 2, 100, 5000] {
            let ids = of_length(&t, n).unwrap();
            assert_eq!(ids.len(), n);
            assert_eq!(ids[0], ByteTokenizer::BOS);
        }
        assert!(of_length(&t, 0).is_err());
    }
}
