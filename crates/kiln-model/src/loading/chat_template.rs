//! Chat templates as Hugging Face checkpoints carry them (`chat_template.jinja`, or
//! `chat_template` in `tokenizer_config.json` as a string or a list of named templates),
//! rendered with minijinja the way `transformers`' `apply_chat_template` renders them with
//! Jinja2: blocks trimmed, Python string and dict methods (`.strip()`, `.items()`, ...),
//! `raise_exception`, `strftime_now`, and a `tojson` that writes what Python's
//! `json.dumps` writes.

mod pyjson;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Serde};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;
use serde_json::Value as Json;

use crate::error::{ModelError, Result};

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (or what the template knows).
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into() }
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// An assistant message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// A chat template and the special tokens it refers to.
///
/// The rendered text already holds the special tokens the template writes (Llama 3's
/// `<|begin_of_text|>` among them), so encode it with `add_special = false`, as
/// `apply_chat_template(tokenize=True)` does.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    /// The Jinja source.
    pub source: String,
    /// The BOS token's text, if the tokenizer config names one.
    pub bos_token: Option<String>,
    /// The EOS token's text, if the tokenizer config names one.
    pub eos_token: Option<String>,
    /// The file the template came from, for messages.
    pub origin: PathBuf,
}

/// File names a checkpoint keeps its template and special tokens in.
const TEMPLATE_FILE: &str = "chat_template.jinja";
const TEMPLATE_JSON_FILE: &str = "chat_template.json";
const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
const SPECIAL_TOKENS_FILE: &str = "special_tokens_map.json";

impl ChatTemplate {
    /// A template from its source; the source is compiled now so a syntax error is
    /// reported at load time, naming `origin`.
    pub fn new(
        source: impl Into<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
        origin: impl Into<PathBuf>,
    ) -> Result<Self> {
        let t = ChatTemplate { source: source.into(), bos_token, eos_token, origin: origin.into() };
        let env = environment();
        env.template_from_named_str("chat_template", &t.source).map_err(|e| t.error(&e))?;
        Ok(t)
    }

    /// The template of the checkpoint in `dir`, or `None` when it has none. Looks in
    /// `chat_template.jinja`, then `chat_template.json`, then `tokenizer_config.json`
    /// (the order `transformers` uses); BOS and EOS come from `tokenizer_config.json`,
    /// else `special_tokens_map.json`.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        let config = read_json_if_present(&config_path)?;
        let specials_path = dir.join(SPECIAL_TOKENS_FILE);
        let specials = read_json_if_present(&specials_path)?;
        let token = |name: &str| -> Result<Option<String>> {
            if let Some(c) = &config
                && let Some(t) = special_token(c, name, &config_path)?
            {
                return Ok(Some(t));
            }
            match &specials {
                Some(s) => special_token(s, name, &specials_path),
                None => Ok(None),
            }
        };
        let (bos, eos) = (token("bos_token")?, token("eos_token")?);
        let jinja = dir.join(TEMPLATE_FILE);
        if crate::loading::source::regular_file(&jinja)? {
            let source = std::fs::read_to_string(&jinja)
                .map_err(|cause| ModelError::Io { path: jinja.clone(), cause })?;
            return Self::new(source, bos, eos, jinja).map(Some);
        }
        let json_path = dir.join(TEMPLATE_JSON_FILE);
        if let Some(j) = read_json_if_present(&json_path)?
            && let Some(source) = template_field(&j, &json_path)?
        {
            return Self::new(source, bos, eos, json_path).map(Some);
        }
        match &config {
            Some(c) => match template_field(c, &config_path)? {
                Some(source) => Self::new(source, bos, eos, config_path).map(Some),
                None => Ok(None),
            },
            None => Ok(None),
        }
    }

    /// The template applied to one user message, ready for the assistant's answer: what
    /// `kiln generate` sends the model for a prompt.
    pub fn render_prompt(&self, prompt: &str) -> Result<String> {
        self.render(&[ChatMessage::user(prompt)], true)
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where the
    /// assistant's reply begins.
    pub fn render<M: Serialize>(&self, messages: &[M], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// [`Self::render`] with extra template variables, as `apply_chat_template`'s keyword
    /// arguments: `tools` (a list of JSON schemas), `date_string`, `enable_thinking`, ...
    pub fn render_with<M: Serialize>(
        &self,
        messages: &[M],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Json>,
    ) -> Result<String> {
        let env = environment();
        let template =
            env.template_from_named_str("chat_template", &self.source).map_err(|e| self.error(&e))?;
        let mut ctx: BTreeMap<&str, Value> = BTreeMap::new();
        // `apply_chat_template` always defines these, as None when absent.
        ctx.insert("tools", Value::from(()));
        ctx.insert("documents", Value::from(()));
        if let Some(b) = &self.bos_token {
            ctx.insert("bos_token", Value::from(b.as_str()));
        }
        if let Some(e) = &self.eos_token {
            ctx.insert("eos_token", Value::from(e.as_str()));
        }
        for (k, v) in extra {
            ctx.insert(k.as_str(), Value::from(Serde(v)));
        }
        ctx.insert("messages", Value::from(Serde(messages)));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        template.render(ctx).map_err(|e| self.error(&e))
    }

    fn error(&self, e: &Error) -> ModelError {
        let mut message = format!("chat template: {e}");
        let mut source = std::error::Error::source(e);
        while let Some(s) = source {
            message.push_str(&format!(": {s}"));
            source = s.source();
        }
        ModelError::Tokenizer { path: self.origin.clone(), message }
    }
}

/// The environment Hugging Face renders templates in, rebuilt per render (cheap, and it
/// keeps `ChatTemplate` a plain, cloneable value).
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    // Hugging Face's Jinja2 environment trims the newline after a block tag and the
    // indentation before one; neither setting can fail to build.
    if let Ok(syntax) = SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build() {
        env.set_syntax(syntax);
    }
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// Today's local time in a `strftime` format, as `datetime.now().strftime(format)`.
fn strftime_now(format: String) -> Result<Value, Error> {
    use chrono::format::{Item, StrftimeItems};
    let items: Vec<Item<'_>> = StrftimeItems::new(&format).collect();
    if items.iter().any(|i| matches!(i, Item::Error)) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format {format:?}"),
        ));
    }
    Ok(Value::from(chrono::Local::now().format_with_items(items.into_iter()).to_string()))
}

fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let opts = pyjson::Options::from_kwargs(&kwargs)?;
    Ok(Value::from_safe_string(pyjson::dumps(value, &opts)?))
}

fn read_json_if_present(path: &Path) -> Result<Option<Json>> {
    if !crate::loading::source::regular_file(path)? {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(path).map_err(|cause| ModelError::Io { path: path.to_path_buf(), cause })?;
    serde_json::from_str(&text).map(Some).map_err(|e| ModelError::Tokenizer {
        path: path.to_path_buf(),
        message: format!("not valid JSON: {e}"),
    })
}

/// A special token's text: a string, or an `AddedToken` object's `content`; `None` when
/// absent or null.
fn special_token(config: &Json, name: &str, path: &Path) -> Result<Option<String>> {
    match config.get(name) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Object(o)) => match o.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(ModelError::Tokenizer {
                path: path.to_path_buf(),
                message: format!(
                    "{name} is an object without a string \"content\": expected a string or an AddedToken"
                ),
            }),
        },
        Some(other) => Err(ModelError::Tokenizer {
            path: path.to_path_buf(),
            message: format!("{name} is {other}: expected a string, null or an AddedToken object"),
        }),
    }
}

/// The `chat_template` field: a string, or a list of `{"name", "template"}` objects of
/// which the one named `default` is used.
fn template_field(config: &Json, path: &Path) -> Result<Option<String>> {
    let bad = |message: String| ModelError::Tokenizer { path: path.to_path_buf(), message };
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Array(list)) => {
            let mut names = Vec::new();
            for entry in list {
                let name = entry.get("name").and_then(Json::as_str);
                let template = entry.get("template").and_then(Json::as_str);
                match (name, template) {
                    (Some("default"), Some(t)) => return Ok(Some(t.to_string())),
                    (Some(n), Some(_)) => names.push(n.to_string()),
                    _ => {
                        return Err(bad(format!(
                            "chat_template entry {entry} lacks a string \"name\" and \"template\""
                        )));
                    }
                }
            }
            Err(bad(format!(
                "chat_template lists templates {} but none named \"default\", which kiln uses",
                names.join(", ")
            )))
        }
        Some(other) => {
            Err(bad(format!("chat_template is {other}: expected a string or a list of named templates")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpl(src: &str) -> ChatTemplate {
        ChatTemplate::new(src, Some("<s>".into()), Some("</s>".into()), "t.jinja").unwrap()
    }

    #[test]
    fn python_methods_and_trimmed_blocks() {
        let t = tmpl(
            "{{ bos_token }}{% for m in messages %}\n  {{ m.role.upper() }}: {{ m.content.strip() }}|\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}",
        );
        let out = t.render(&[ChatMessage::user("  hi  "), ChatMessage::assistant("yo")], true).unwrap();
        assert_eq!(out, "<s>  USER: hi|\n  ASSISTANT: yo|\nA:");
    }

    #[test]
    fn raise_exception_is_an_error_naming_the_file() {
        let t = tmpl("{{ raise_exception('only user and assistant roles are supported') }}");
        let e = t.render(&[ChatMessage::user("x")], false).unwrap_err().to_string();
        assert!(e.starts_with("t.jinja: chat template:"), "{e}");
        assert!(e.contains("only user and assistant roles are supported"), "{e}");
    }

    #[test]
    fn syntax_errors_surface_at_construction() {
        let e = ChatTemplate::new("{% for %}", None, None, "tokenizer_config.json").unwrap_err().to_string();
        assert!(e.starts_with("tokenizer_config.json: chat template:"), "{e}");
    }

    #[test]
    fn strftime_now_formats_today() {
        let out = tmpl("{{ strftime_now('%Y') }}").render::<ChatMessage>(&[], false).unwrap();
        assert_eq!(out.len(), 4);
        assert!(out.chars().all(|c| c.is_ascii_digit()), "{out}");
        assert!(tmpl("{{ strftime_now('%Q') }}").render::<ChatMessage>(&[], false).is_err());
    }

    #[test]
    fn template_fields_and_special_tokens() {
        let p = Path::new("tokenizer_config.json");
        let list = serde_json::json!({"chat_template": [
            {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]});
        assert_eq!(template_field(&list, p).unwrap().as_deref(), Some("D"));
        let no_default = serde_json::json!({"chat_template": [{"name": "tool_use", "template": "T"}]});
        let e = template_field(&no_default, p).unwrap_err().to_string();
        assert!(e.contains("tool_use") && e.contains("default"), "{e}");
        let c = serde_json::json!({"bos_token": {"__type": "AddedToken", "content": "<s>"},
                                   "eos_token": "</s>", "unk_token": null});
        assert_eq!(special_token(&c, "bos_token", p).unwrap().as_deref(), Some("<s>"));
        assert_eq!(special_token(&c, "eos_token", p).unwrap().as_deref(), Some("</s>"));
        assert_eq!(special_token(&c, "unk_token", p).unwrap(), None);
        assert!(special_token(&serde_json::json!({"bos_token": 3}), "bos_token", p).is_err());
    }
}
