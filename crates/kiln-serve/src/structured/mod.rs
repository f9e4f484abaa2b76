//! Structured outputs: a request's `response_format` (`json_object`, `json_schema`),
//! vLLM's `guided_json`, `guided_regex` and `guided_choice`, and the call syntax a forced
//! tool call must follow, compiled by llguidance into a [`Matcher`] that gives the tokens
//! allowed next. The scheduler masks every other token out of the slot's logits row
//! before sampling, each step, and ends the sequence when the grammar ends.
//!
//! A grammar is a stranger's program: it is compiled, and its first mask computed, when
//! the request is accepted, off the HTTP workers and within a budget ([`admit`]), so a
//! grammar that cannot be enforced is the request's 400 and no running stream waits on it.

pub mod admit;
pub mod budget;
mod vocab;

use std::fmt;
use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::SimpleVob;
use llguidance::{CancellationHandle, Matcher, ParserFactory};
use serde_json::{Map, Value, json};

use crate::error::ApiError;

pub use vocab::Vocab;

/// The most strings a `guided_choice` may list: llguidance's parser refuses a row of more
/// than 2,000 items, and the alternatives of one rule share a row with the rule's own.
pub const MAX_GUIDED_CHOICES: usize = 1_000;

/// The longest an error body quotes of llguidance's message: its first line, so no
/// parser state or grammar dump reaches a client.
const MAX_ERROR_CHARS: usize = 300;

/// What a request constrains its output to, compiled once the server's vocabulary is
/// known ([`Grammars::compile`]).
#[derive(Clone)]
pub struct Constraint {
    /// The request field the constraint comes from, named by its errors.
    pub field: &'static str,
    grammar: TopLevelGrammar,
    /// Boxed: a matcher is large, and requests travel in channels.
    guide: Option<Box<Guide>>,
    /// The JSON schemas the grammar embeds, each under the request field it came from
    /// (a tool's `parameters`): when the whole fails to compile, the first part that
    /// fails alone is the field named.
    parts: Vec<(String, Value)>,
}

/// A compiled constraint's state in one sequence: the matcher, and the first mask,
/// computed when the request was accepted so the scheduler's first step does not.
#[derive(Clone)]
pub struct Guide {
    field: &'static str,
    matcher: Matcher,
    first: Option<SimpleVob>,
}

impl Guide {
    /// The request field the constraint came from.
    pub fn field(&self) -> &'static str {
        self.field
    }

    /// Sets every logit the grammar does not allow next to minus infinity. Errors when
    /// the matcher has failed (no token would be allowed).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let allowed = match self.first.take() {
            Some(first) => first,
            None => self.matcher.compute_mask_or_eos().map_err(|e| brief(&e.to_string()))?,
        };
        let n = logits.len();
        allowed.iter_unset_entries(|i| {
            if i < n {
                logits[i] = f32::NEG_INFINITY;
            }
        });
        Ok(())
    }

    /// Moves the grammar past `token`.
    pub fn consume_token(&mut self, token: u32) -> Result<(), String> {
        self.first = None;
        self.matcher.consume_token(token).map_err(|e| brief(&e.to_string()))
    }

    /// Whether the grammar has ended (only EOS may follow).
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }
}

impl fmt::Debug for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Constraint")
            .field("field", &self.field)
            .field("compiled", &self.guide.is_some())
            .finish()
    }
}

impl Constraint {
    /// Output that is one JSON value of `schema`, compact (no whitespace outside strings)
    /// unless the schema's own `x-guidance` options say otherwise.
    pub fn json_schema(field: &'static str, mut schema: Value) -> Self {
        if let Value::Object(o) = &mut schema
            && !o.contains_key("x-guidance")
        {
            o.insert("x-guidance".into(), compact());
        }
        Constraint {
            field,
            grammar: TopLevelGrammar::from_json_schema(schema),
            guide: None,
            parts: Vec::new(),
        }
    }

    /// Output that matches the regular expression `rx` (Rust `regex` syntax) whole.
    pub fn regex(field: &'static str, rx: &str) -> Self {
        Constraint { field, grammar: TopLevelGrammar::from_regex(rx), guide: None, parts: Vec::new() }
    }

    /// Output that is a Lark grammar's `start` rule (llguidance's dialect).
    pub fn lark(field: &'static str, grammar: String) -> Self {
        Constraint { field, grammar: TopLevelGrammar::from_lark(grammar), guide: None, parts: Vec::new() }
    }

    /// `self`, whose embedded schemas came from the fields `parts` names.
    pub fn with_parts(mut self, parts: Vec<(String, Value)>) -> Self {
        self.parts = parts;
        self
    }

    /// The guide, once compiled; the scheduler takes it for the request's slot.
    pub fn take_guide(&mut self) -> Option<Box<Guide>> {
        self.guide.take()
    }
}

/// The JSON options of an embedded schema: compact separators and no free whitespace, so
/// the mask leaves a model no room to pad its output with blanks until `max_tokens`.
pub fn compact() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ",", "key_separator": ":"})
}

/// The one constraint of a request: its structured-output fields' (`fields`, from
/// [`from_request`]) or `forced_tool`, a `tool_choice` that forces a call; both is refused.
/// With [`from_request`], the one home of the rule "at most one constraint".
pub fn one(
    fields: Option<Constraint>,
    forced_tool: Option<Constraint>,
) -> Result<Option<Constraint>, ApiError> {
    match (fields, forced_tool) {
        (Some(c), Some(_)) => Err(ApiError::invalid(
            "tool_choice",
            format!(
                "tool_choice forces a tool call and {} constrains the output too: send one of them",
                c.field
            ),
        )),
        (c, None) => Ok(c),
        (None, forced) => Ok(forced),
    }
}

/// The constraint of a request's structured-output fields, if any: `response_format`,
/// `guided_json`, `guided_regex`, `guided_choice` (at most one of them; [`one`] adds a
/// forced tool call to that rule).
pub fn from_request(obj: &Map<String, Value>) -> Result<Option<Constraint>, ApiError> {
    let given: Vec<&str> =
        FIELDS.iter().copied().filter(|f| obj.get(*f).is_some_and(|v| !v.is_null())).collect();
    if given.len() > 1 {
        return Err(ApiError::invalid(
            given[1],
            format!(
                "{} and {} both constrain the output: send at most one of {}",
                given[0],
                given[1],
                FIELDS.join(", ")
            ),
        ));
    }
    let Some(&field) = given.first() else { return Ok(None) };
    let value = &obj[field];
    match field {
        "response_format" => response_format(value),
        "guided_json" => match value {
            Value::Object(_) | Value::Bool(_) => {
                budget::check_schema(field, value)?;
                Ok(Some(Constraint::json_schema(field, value.clone())))
            }
            Value::String(s) => match serde_json::from_str::<Value>(s) {
                Ok(v) => {
                    budget::check_schema(field, &v)?;
                    Ok(Some(Constraint::json_schema(field, v)))
                }
                Err(e) => Err(ApiError::invalid(field, format!("guided_json is not a JSON schema: {e}"))),
            },
            _ => Err(ApiError::invalid(
                field,
                "guided_json must be a JSON schema (an object or its JSON text)",
            )),
        },
        "guided_regex" => match value {
            Value::String(rx) => {
                budget::check_regex(field, field, rx)?;
                Ok(Some(Constraint::regex(field, rx)))
            }
            _ => Err(ApiError::invalid(field, "guided_regex must be a string")),
        },
        "guided_choice" => {
            let choices = match value {
                Value::Array(items) if !items.is_empty() => {
                    items.iter().map(|i| i.as_str().map(str::to_string)).collect::<Option<Vec<_>>>()
                }
                _ => None,
            };
            let Some(choices) = choices else {
                return Err(ApiError::invalid(field, "guided_choice must be a non-empty array of strings"));
            };
            if choices.len() > MAX_GUIDED_CHOICES {
                return Err(ApiError::invalid(
                    field,
                    format!(
                        "guided_choice lists {} strings: accepted are at most {MAX_GUIDED_CHOICES} \
                         (a larger set fits guided_regex or a JSON schema enum)",
                        choices.len()
                    ),
                ));
            }
            let alternatives: Vec<String> = choices.iter().map(|c| lark_string(c)).collect();
            Ok(Some(Constraint::lark(field, format!("start: {}", alternatives.join(" | ")))))
        }
        _ => unreachable!("FIELDS lists the fields matched above"),
    }
}

/// The fields that constrain the output, in the order they are checked.
pub const FIELDS: &[&str] = &["response_format", "guided_json", "guided_regex", "guided_choice"];

fn response_format(value: &Value) -> Result<Option<Constraint>, ApiError> {
    const FIELD: &str = "response_format";
    let Value::Object(o) = value else {
        return Err(ApiError::invalid(FIELD, "response_format must be an object with a type"));
    };
    let kind = o.get("type").and_then(Value::as_str);
    let allowed: &[&str] = match kind {
        Some("text") | Some("json_object") => &["type"],
        Some("json_schema") => &["type", "json_schema"],
        _ => {
            return Err(ApiError::invalid(
                FIELD,
                format!(
                    "unsupported response_format.type {}: accepted are \"text\", \"json_object\" and \"json_schema\"",
                    o.get("type").map_or_else(|| "(missing)".to_string(), Value::to_string)
                ),
            ));
        }
    };
    if let Some(k) = o.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(ApiError::invalid(
            FIELD,
            format!("unsupported field response_format.{k}: accepted are {}", allowed.join(" and ")),
        ));
    }
    match kind {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::json_schema(FIELD, json!({"type": "object"})))),
        _ => {
            let Some(Value::Object(js)) = o.get("json_schema") else {
                return Err(ApiError::invalid(
                    FIELD,
                    "response_format.json_schema must be an object with name and schema",
                ));
            };
            for k in js.keys() {
                if !matches!(k.as_str(), "name" | "schema" | "strict" | "description") {
                    return Err(ApiError::invalid(
                        FIELD,
                        format!(
                            "unsupported field response_format.json_schema.{k}: accepted are name, description, schema and strict"
                        ),
                    ));
                }
            }
            match js.get("name") {
                Some(Value::String(_)) => {}
                _ => {
                    return Err(ApiError::invalid(
                        FIELD,
                        "response_format.json_schema.name must be a string",
                    ));
                }
            }
            if let Some(s) = js.get("strict")
                && !s.is_boolean()
                && !s.is_null()
            {
                return Err(ApiError::invalid(FIELD, "response_format.json_schema.strict must be a boolean"));
            }
            // OpenAI's default schema, when none is given, is any JSON object.
            let schema = match js.get("schema") {
                None | Some(Value::Null) => json!({"type": "object"}),
                Some(s @ (Value::Object(_) | Value::Bool(_))) => s.clone(),
                Some(_) => {
                    return Err(ApiError::invalid(
                        FIELD,
                        "response_format.json_schema.schema must be a JSON schema object",
                    ));
                }
            };
            budget::check_schema(FIELD, &schema)?;
            Ok(Some(Constraint::json_schema(FIELD, schema)))
        }
    }
}

/// `s` as a Lark string literal (a JSON string is one).
pub fn lark_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// The parser factory of the served model's vocabulary: built once, at the first request
/// that needs it, and shared by every request after.
pub struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    /// The factory of `tokenizer`'s vocabulary padded to `vocab_size` logits, with `eos`
    /// the tokens that end a sequence.
    pub fn new(tokenizer: &kiln_model::Tokenizer, vocab_size: usize, eos: &[u32]) -> Result<Self, String> {
        let env = Vocab::new(tokenizer, vocab_size, eos)?.into_env();
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        // Grammar warnings go to the request's error, not to stderr.
        factory.quiet();
        // Errors name what is wrong, without the parser's state and the grammar (which
        // are the server's internals, and can be megabytes).
        factory.limits_mut().verbose_errors = false;
        Ok(Grammars { factory })
    }

    /// Compiles `c` and computes its first mask (a grammar llguidance refuses, or whose
    /// first mask fails, is a 400 naming the request's field). The matcher is cancellable
    /// through `cancel`, which holds its handle while the first mask is computed.
    pub fn compile(&self, c: &mut Constraint, cancel: &CancelSlot) -> Result<(), ApiError> {
        let field = c.field;
        let refused = |e: &str| -> ApiError {
            // The part at fault, when the grammar embeds the request's schemas.
            for (name, schema) in &c.parts {
                let alone = Constraint::json_schema(field, schema.clone()).grammar;
                let failed = match self.factory.create_parser(alone) {
                    Err(e) => Some(e.to_string()),
                    Ok(p) => Matcher::new(Ok(p)).get_error(),
                };
                if let Some(e) = failed {
                    return ApiError::invalid(
                        name.as_str(),
                        format!("{name} cannot be enforced: {}", brief(&e)),
                    );
                }
            }
            ApiError::invalid(field, format!("{field} cannot be enforced: {}", brief(e)))
        };
        for (name, schema) in &c.parts {
            budget::check_schema(name, schema)?;
        }
        let parser = self.factory.create_parser(c.grammar.clone()).map_err(|e| refused(&e.to_string()))?;
        let mut matcher = Matcher::new(Ok(parser)).into_cancellable();
        if let Some(e) = matcher.get_error() {
            return Err(refused(&e));
        }
        if let Some(h) = matcher.cancellation_handle() {
            cancel.set(h);
        }
        let first = matcher.compute_mask_or_eos().map_err(|e| refused(&e.to_string()))?;
        if first.is_zero() {
            return Err(refused("no token can start the output"));
        }
        c.guide = Some(Box::new(Guide { field, matcher, first: Some(first) }));
        Ok(())
    }
}

/// Where a compile puts its matcher's cancellation handle, so the request's budget can
/// stop a first mask that runs too long.
#[derive(Clone, Default)]
pub struct CancelSlot(Arc<Mutex<Option<CancellationHandle>>>);

impl CancelSlot {
    fn set(&self, h: CancellationHandle) {
        let mut slot = self.0.lock().unwrap_or_else(|p| p.into_inner());
        *slot = Some(h);
    }

    /// Cancels the matcher, if one was made.
    pub fn cancel(&self) {
        if let Some(h) = self.0.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            h.cancel();
        }
    }
}

/// The first line of llguidance's message `e`, at most [`MAX_ERROR_CHARS`] characters.
pub fn brief(e: &str) -> String {
    let line = e.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("the grammar failed");
    let mut out: String = line.chars().take(MAX_ERROR_CHARS).collect();
    if out.len() < line.len() {
        out.push_str("...");
    }
    out
}
