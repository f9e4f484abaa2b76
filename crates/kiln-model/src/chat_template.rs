//! Chat templates from `tokenizer_config.json`, rendered with minijinja.

/// A chat template and the special tokens it refers to.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    /// The Jinja source.
    pub source: String,
    /// The BOS token's text, if the tokenizer config names one.
    pub bos_token: Option<String>,
    /// The EOS token's text, if the tokenizer config names one.
    pub eos_token: Option<String>,
}
