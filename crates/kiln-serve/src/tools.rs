//! Tool calling: a request's `tools` and `tool_choice`, the call syntax of the served
//! model (Hermes/Qwen `<tool_call>{json}</tool_call>`, Llama 3.1's bare JSON object), the
//! grammar that forces a call (`tool_choice` `required` or a named function), and the
//! parser that turns the model's output back into OpenAI `tool_calls`. A call that does
//! not parse is left in the output as text.

use kiln_model::LoadedModel;
use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::structured::{self, Constraint};

/// How the served model writes a tool call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallSyntax {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, as Qwen2.5 and
    /// Hermes templates ask for (and the plain rendering of a model without a template).
    Hermes,
    /// One JSON object `{"name": ..., "parameters": {...}}`, as Llama 3.1's template asks.
    LlamaJson,
}

impl CallSyntax {
    /// The syntax `model`'s chat template asks for; `None` when its template does not
    /// render tools at all.
    pub fn of(model: &LoadedModel) -> Option<CallSyntax> {
        match &model.chat_template {
            None => Some(CallSyntax::Hermes),
            Some(t) if t.source.contains("<tool_call>") => Some(CallSyntax::Hermes),
            Some(t) if t.source.contains("\"parameters\"") && t.source.contains("tools") => {
                Some(CallSyntax::LlamaJson)
            }
            Some(_) => None,
        }
    }

    /// The JSON key the call's arguments go under.
    fn arguments_key(self) -> &'static str {
        match self {
            CallSyntax::Hermes => "arguments",
            CallSyntax::LlamaJson => "parameters",
        }
    }
}

/// What `tool_choice` asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// Never call (the tools are still rendered; the output is not parsed for calls).
    None,
    /// The model decides; its output is parsed for calls.
    Auto,
    /// One call of any of the tools, forced by the mask.
    Required,
    /// One call of this function, forced by the mask.
    Named(String),
}

/// A request's tools.
#[derive(Clone, Debug)]
pub struct Tools {
    /// How the model writes calls.
    pub syntax: CallSyntax,
    /// The tools as the request sent them (`{"type": "function", "function": {...}}`).
    pub tools: Vec<Value>,
    /// What `tool_choice` asks for.
    pub choice: ToolChoice,
}

/// One parsed call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// Its arguments as JSON text (OpenAI sends them as a string).
    pub arguments: String,
}

/// The request's `tools` and `tool_choice`, checked against `model`'s call syntax.
pub fn from_request(obj: &Map<String, Value>, model: &LoadedModel) -> Result<Option<Tools>, ApiError> {
    let tools = match obj.get("tools") {
        None | Some(Value::Null) => {
            return match obj.get("tool_choice") {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) if s == "none" => Ok(None),
                Some(_) => {
                    Err(ApiError::invalid("tool_choice", "tool_choice needs tools: the request has none"))
                }
            };
        }
        Some(Value::Array(t)) if t.is_empty() => return Ok(None),
        Some(Value::Array(t)) => t,
        Some(_) => return Err(ApiError::invalid("tools", "tools must be an array of function tools")),
    };
    let mut names = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let bad = |m: String| ApiError::invalid(format!("tools[{i}]"), m);
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(format!(
                "tools[{i}].type must be \"function\": kiln implements function tools only"
            )));
        }
        let Some(Value::Object(f)) = t.get("function") else {
            return Err(bad(format!("tools[{i}].function must be an object with a name")));
        };
        let Some(name) = f.get("name").and_then(Value::as_str).filter(|n| !n.is_empty()) else {
            return Err(bad(format!("tools[{i}].function.name must be a non-empty string")));
        };
        if let Some(p) = f.get("parameters")
            && !p.is_object()
            && !p.is_null()
        {
            return Err(bad(format!("tools[{i}].function.parameters must be a JSON schema object")));
        }
        if names.contains(&name) {
            return Err(bad(format!("tools[{i}].function.name {name:?} is given twice")));
        }
        names.push(name);
    }
    let choice = match obj.get("tool_choice") {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "unsupported tool_choice {s:?}: accepted are \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
                    ),
                ));
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"));
            match name {
                Some(n) if names.contains(&n) => ToolChoice::Named(n.to_string()),
                Some(n) => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        format!(
                            "tool_choice names the function {n:?}, which is not in tools: accepted are {names:?}"
                        ),
                    ));
                }
                None => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        "tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    ));
                }
            }
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}",
            ));
        }
    };
    let Some(syntax) = CallSyntax::of(model) else {
        return Err(ApiError::invalid(
            "tools",
            "the model's chat template does not render tools: kiln knows the <tool_call> syntax of Qwen2.5/Hermes \
             templates and the JSON calls of Llama 3.1's",
        ));
    };
    Ok(Some(Tools { syntax, tools: tools.clone(), choice }))
}

impl Tools {
    /// Whether the output is parsed for calls.
    pub fn parses_calls(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The grammar of a forced call: one call of the named function, or of any tool for
    /// `required`; `None` when the model chooses.
    pub fn constraint(&self) -> Option<Constraint> {
        let wanted: Vec<(usize, &Value)> = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => self.tools.iter().enumerate().collect(),
            ToolChoice::Named(n) => {
                self.tools.iter().enumerate().filter(|(_, t)| function_name(t) == Some(n.as_str())).collect()
            }
        };
        let key = self.syntax.arguments_key();
        let mut parts = Vec::new();
        let alternatives: Vec<Value> = wanted
            .iter()
            .map(|&(i, t)| {
                let f = &t["function"];
                let params = match f.get("parameters") {
                    Some(p @ Value::Object(_)) => {
                        parts.push((format!("tools[{i}].function.parameters"), p.clone()));
                        p.clone()
                    }
                    _ => json!({"type": "object"}),
                };
                json!({
                    "type": "object",
                    "properties": {"name": {"const": f["name"]}, key: params},
                    "required": ["name", key],
                    "additionalProperties": false,
                })
            })
            .collect();
        let mut schema = if alternatives.len() == 1 {
            alternatives.into_iter().next().unwrap_or_default()
        } else {
            json!({"anyOf": alternatives})
        };
        schema["x-guidance"] = structured::compact();
        let c = match self.syntax {
            CallSyntax::Hermes => Constraint::lark(
                "tool_choice",
                format!("start: \"<tool_call>\\n\" call \"\\n</tool_call>\"\ncall: %json {schema}"),
            ),
            CallSyntax::LlamaJson => Constraint::json_schema("tool_choice", schema),
        };
        Some(c.with_parts(parts))
    }
}

fn function_name(tool: &Value) -> Option<&str> {
    tool.get("function").and_then(|f| f.get("name")).and_then(Value::as_str)
}

/// The calls in `text`, and the text before them, when `text` is calls in `syntax` (and
/// only blank text after them); `None` when there is no call or one is malformed, so
/// the whole text is the answer.
pub fn parse_calls(syntax: CallSyntax, text: &str) -> Option<(String, Vec<ToolCall>)> {
    match syntax {
        CallSyntax::Hermes => {
            const OPEN: &str = "<tool_call>";
            const CLOSE: &str = "</tool_call>";
            let start = text.find(OPEN)?;
            let before = text[..start].trim_end().to_string();
            let mut rest = &text[start..];
            let mut calls = Vec::new();
            while let Some(r) = rest.strip_prefix(OPEN) {
                let end = r.find(CLOSE)?;
                calls.push(call_object(&r[..end], "arguments")?);
                rest = r[end + CLOSE.len()..].trim_start();
            }
            rest.is_empty().then_some((before, calls))
        }
        CallSyntax::LlamaJson => {
            let body = text.trim();
            let body = body.strip_prefix("<|python_tag|>").unwrap_or(body);
            if !body.starts_with('{') {
                return None;
            }
            Some((String::new(), vec![call_object(body, "parameters")?]))
        }
    }
}

/// One call's JSON object: a string `name` and an object of arguments under `key`
/// (`arguments` also accepted for Llama, `parameters` for Hermes, as models mix them).
fn call_object(json_text: &str, key: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(json_text.trim()).ok()?;
    let o = v.as_object()?;
    let name = o.get("name")?.as_str()?.to_string();
    let other = if key == "arguments" { "parameters" } else { "arguments" };
    let args = match o.get(key).or_else(|| o.get(other)) {
        Some(a @ Value::Object(_)) => a.to_string(),
        // Some models write the arguments as a JSON string, as OpenAI sends them.
        Some(Value::String(s)) if serde_json::from_str::<Value>(s).is_ok_and(|v| v.is_object()) => s.clone(),
        None => "{}".to_string(),
        _ => return None,
    };
    Some(ToolCall { name, arguments: args })
}

/// Whether streamed text so far may still turn out to be a call in `syntax` (it is a
/// prefix of a call's opening, or starts with one), so a stream holds it back.
pub fn may_be_call(syntax: CallSyntax, text: &str) -> bool {
    let t = text.trim_start();
    let open = match syntax {
        CallSyntax::Hermes => "<tool_call>",
        CallSyntax::LlamaJson => "{",
    };
    open.starts_with(t)
        || t.starts_with(open)
        || (syntax == CallSyntax::LlamaJson && "<|python_tag|>".starts_with(t))
}

/// An assistant message's `tool_calls` as the model wrote them, for the plain rendering
/// of a model without a chat template.
pub fn plain_calls(calls: &[Value]) -> String {
    let mut s = String::new();
    for c in calls {
        let f = &c["function"];
        // OpenAI sends the arguments as JSON text; the model wrote them as an object.
        let args = match f["arguments"].as_str().map(serde_json::from_str::<Value>) {
            Some(Ok(parsed)) => parsed,
            _ => f["arguments"].clone(),
        };
        s.push_str(&format!("<tool_call>{}</tool_call>", json!({"name": f["name"], "arguments": args})));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, args: &str) -> ToolCall {
        ToolCall { name: name.into(), arguments: args.into() }
    }

    #[test]
    fn hermes_calls_parse_with_the_text_before_them() {
        // Recorded from Qwen2.5-0.5B-Instruct.
        let out =
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        assert_eq!(
            parse_calls(CallSyntax::Hermes, out),
            Some((String::new(), vec![call("get_weather", "{\"city\":\"Paris\"}")]))
        );
        let two = "Let me look.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n\
                   <tool_call>\n{\"name\": \"b\", \"arguments\": {\"x\": 1}}\n</tool_call>\n";
        assert_eq!(
            parse_calls(CallSyntax::Hermes, two),
            Some(("Let me look.".into(), vec![call("a", "{}"), call("b", "{\"x\":1}")]))
        );
        // Arguments as a JSON string, as some fine-tunes write them.
        let s = "<tool_call>{\"name\": \"a\", \"arguments\": \"{\\\"x\\\": 2}\"}</tool_call>";
        assert_eq!(parse_calls(CallSyntax::Hermes, s), Some((String::new(), vec![call("a", "{\"x\": 2}")])));
    }

    #[test]
    fn malformed_hermes_calls_stay_text() {
        for out in [
            "no call here",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par",
            "<tool_call>\n{\"name\": \"get_weather\" \"arguments\": {}}\n</tool_call>",
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": 3, \"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"a\", \"arguments\": [1]}</tool_call>",
            "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call> and then some text",
        ] {
            assert_eq!(parse_calls(CallSyntax::Hermes, out), None, "{out:?}");
        }
    }

    #[test]
    fn llama_json_calls_parse_and_malformed_ones_stay_text() {
        // Recorded from Llama-3.1-8B-Instruct.
        let out = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}";
        assert_eq!(
            parse_calls(CallSyntax::LlamaJson, out),
            Some((String::new(), vec![call("get_weather", "{\"city\":\"Paris\",\"unit\":\"celsius\"}")]))
        );
        let tagged = "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}";
        assert_eq!(parse_calls(CallSyntax::LlamaJson, tagged), Some((String::new(), vec![call("f", "{}")])));
        for out in [
            "The weather in Paris is sunny.",
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Par",
            "{\"parameters\": {}}",
            "{\"name\": \"f\", \"parameters\": {}} trailing",
        ] {
            assert_eq!(parse_calls(CallSyntax::LlamaJson, out), None, "{out:?}");
        }
    }

    #[test]
    fn streams_hold_text_only_while_it_may_open_a_call() {
        assert!(may_be_call(CallSyntax::Hermes, ""));
        assert!(may_be_call(CallSyntax::Hermes, "\n<tool"));
        assert!(may_be_call(CallSyntax::Hermes, "<tool_call>\n{\"na"));
        assert!(!may_be_call(CallSyntax::Hermes, "Hello"));
        assert!(may_be_call(CallSyntax::LlamaJson, " {\"name\""));
        assert!(!may_be_call(CallSyntax::LlamaJson, "The"));
    }
}
