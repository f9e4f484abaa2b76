//! Structured outputs: a request's `response_format` (`json_object`, `json_schema`),
//! vLLM's `guided_json`, `guided_regex` and `guided_choice`, and the call syntax a forced
//! tool call must follow, compiled by llguidance into a [`Matcher`] that gives the tokens
//! allowed next. The scheduler masks every other token out of the slot's logits row
//! before sampling, each step, and ends the sequence when the grammar ends.

mod vocab;

use std::fmt;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{Map, Value, json};

use crate::error::ApiError;

pub use vocab::Vocab;

/// What a request constrains its output to, compiled once the server's vocabulary is
/// known ([`Grammars::compile`]).
#[derive(Clone)]
pub struct Constraint {
    /// The request field the constraint comes from, named by its errors.
    pub field: &'static str,
    grammar: TopLevelGrammar,
    /// Boxed: a matcher is large, and requests travel in channels.
    matcher: Option<Box<Matcher>>,
}

impl fmt::Debug for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Constraint")
            .field("field", &self.field)
            .field("compiled", &self.matcher.is_some())
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
        Constraint { field, grammar: TopLevelGrammar::from_json_schema(schema), matcher: None }
    }

    /// Output that matches the regular expression `rx` (Rust `regex` syntax) whole.
    pub fn regex(field: &'static str, rx: &str) -> Self {
        Constraint { field, grammar: TopLevelGrammar::from_regex(rx), matcher: None }
    }

    /// Output that is a Lark grammar's `start` rule (llguidance's dialect).
    pub fn lark(field: &'static str, grammar: String) -> Self {
        Constraint { field, grammar: TopLevelGrammar::from_lark(grammar), matcher: None }
    }

    /// The matcher, once compiled; the scheduler takes it for the request's slot.
    pub fn take_matcher(&mut self) -> Option<Box<Matcher>> {
        self.matcher.take()
    }
}

/// The JSON options of an embedded schema: compact separators and no free whitespace, so
/// the mask leaves a model no room to pad its output with blanks until `max_tokens`.
pub fn compact() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ",", "key_separator": ":"})
}

/// The constraint of a request's structured-output fields, if any: `response_format`,
/// `guided_json`, `guided_regex`, `guided_choice` (at most one of them).
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
            Value::Object(_) | Value::Bool(_) => Ok(Some(Constraint::json_schema(field, value.clone()))),
            Value::String(s) => match serde_json::from_str::<Value>(s) {
                Ok(v) => Ok(Some(Constraint::json_schema(field, v))),
                Err(e) => Err(ApiError::invalid(field, format!("guided_json is not a JSON schema: {e}"))),
            },
            _ => Err(ApiError::invalid(
                field,
                "guided_json must be a JSON schema (an object or its JSON text)",
            )),
        },
        "guided_regex" => match value {
            Value::String(rx) => Ok(Some(Constraint::regex(field, rx))),
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
        Ok(Grammars { factory })
    }

    /// Compiles `c` (a schema llguidance refuses is a 400 naming the request's field).
    pub fn compile(&self, c: &mut Constraint) -> Result<(), ApiError> {
        let refused = |e: String| ApiError::invalid(c.field, format!("{} cannot be enforced: {e}", c.field));
        let parser = self.factory.create_parser(c.grammar.clone()).map_err(|e| refused(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(refused(e));
        }
        c.matcher = Some(Box::new(matcher));
        Ok(())
    }
}

/// The token mask of one step: sets every logit the matcher does not allow next to minus
/// infinity. Errors when the matcher has failed (no token would be allowed).
pub fn mask(matcher: &mut Matcher, logits: &mut [f32]) -> Result<(), String> {
    let allowed = matcher.compute_mask_or_eos().map_err(|e| e.to_string())?;
    let n = logits.len();
    allowed.iter_unset_entries(|i| {
        if i < n {
            logits[i] = f32::NEG_INFINITY;
        }
    });
    Ok(())
}
