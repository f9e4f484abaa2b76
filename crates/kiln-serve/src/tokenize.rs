//! `POST /tokenize` and `POST /detokenize` in vLLM's shapes (and llama-server's): a
//! prompt or a chat's messages to the token ids the completion endpoints would count as
//! `prompt_tokens`, and token ids back to text; `GET /tokenizer_info`, vLLM's summary of
//! the tokenizer (special tokens and chat template), which lm-evaluation-harness's remote
//! tokenizer reads before it tokenizes through the server.

use kiln_model::LoadedModel;
use serde_json::{Map, Value, json};

use crate::api::{self, model_not_found};
use crate::error::ApiError;

const TOKENIZE_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "tools",
    "add_special_tokens",
    "add_generation_prompt",
    "content",
    "add_special",
];
const DETOKENIZE_FIELDS: &[&str] = &["model", "tokens"];

/// The body of a `/tokenize` or `/detokenize` request as an object, its fields checked
/// against `accepted` and its optional `model` against the served id.
fn object(
    body: &[u8],
    path: &str,
    accepted: &[&str],
    model_id: &str,
) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request("invalid_json", format!("the request body is not valid JSON: {e}"))
    })?;
    let Value::Object(obj) = value else {
        return Err(ApiError::bad_request("invalid_json", "the request body must be a JSON object"));
    };
    if let Some(key) = obj.keys().find(|k| !accepted.contains(&k.as_str())) {
        return Err(ApiError::invalid(
            key.as_str(),
            format!("unsupported field {key:?}: {path} accepts {}", accepted.join(", ")),
        ));
    }
    match obj.get("model") {
        None | Some(Value::Null) => {}
        Some(Value::String(m)) if m == model_id => {}
        Some(Value::String(m)) => return Err(model_not_found(m, model_id)),
        Some(_) => return Err(ApiError::invalid("model", "model must be a string")),
    }
    Ok(obj)
}

fn opt_bool(obj: &Map<String, Value>, name: &str) -> Result<Option<bool>, ApiError> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::invalid(name, format!("{name} must be a boolean"))),
    }
}

/// `GET /tokenizer_info`: the fields of the `tokenizer_config.json` that `kiln
/// export-tokenizer` writes (`tokenizer_class`, `bos_token`, `eos_token`, `pad_token`,
/// `model_max_length`, `chat_template`: the template the chat endpoint renders), and the
/// served model's id.
pub fn tokenizer_info(model_id: &str, model: &LoadedModel) -> Result<Value, ApiError> {
    let mut info = kiln_model::tokenizer_files::tokenizer_config_of(
        &model.config,
        &model.tokenizer,
        model.chat_template.as_ref(),
    )
    .map_err(|e| {
        ApiError::status(axum::http::StatusCode::INTERNAL_SERVER_ERROR, "tokenizer", e.to_string())
    })?;
    if let Value::Object(o) = &mut info {
        o.entry("pad_token").or_insert(Value::Null);
        o.insert("model".into(), json!(model_id));
    }
    Ok(info)
}

/// `POST /tokenize`: `{"prompt": "..."}` (special tokens added unless
/// `add_special_tokens: false`, as `/v1/completions` encodes a prompt) or
/// `{"messages": [...]}` (through the chat template with the generation prompt unless
/// `add_generation_prompt: false`, as `/v1/chat/completions` renders them) to
/// `{"tokens": [...], "count": N, "max_model_len": M}`; or, in llama-server's shape,
/// `{"content": "..."}` (special tokens only with `add_special: true`) to the same answer.
pub fn tokenize(body: &[u8], model_id: &str, model: &LoadedModel) -> Result<Value, ApiError> {
    let obj = object(body, "/tokenize", TOKENIZE_FIELDS, model_id)?;
    if let Some(content) = obj.get("content") {
        // llama-server's shape: special tokens only when `add_special` asks for them.
        if let Some(k) = ["prompt", "messages", "tools", "add_special_tokens", "add_generation_prompt"]
            .into_iter()
            .find(|k| obj.contains_key(*k))
        {
            return Err(ApiError::invalid(
                k,
                format!(
                    "{k} is vLLM's field and content llama-server's: send prompt or content, not both shapes"
                ),
            ));
        }
        let Value::String(text) = content else {
            return Err(ApiError::invalid("content", "content must be a string"));
        };
        let tokens =
            api::text_tokens(text, "content", model, opt_bool(&obj, "add_special")?.unwrap_or(false))?;
        return Ok(answer(tokens, model));
    }
    if obj.contains_key("add_special") {
        return Err(ApiError::invalid(
            "add_special",
            "add_special goes with content (llama-server's shape); with prompt or messages send add_special_tokens",
        ));
    }
    let add_special = opt_bool(&obj, "add_special_tokens")?;
    let tokens = match (obj.get("prompt"), obj.get("messages")) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid("prompt", "send either prompt or messages, not both"));
        }
        (Some(Value::String(text)), None) => {
            if opt_bool(&obj, "add_generation_prompt")?.is_some() {
                return Err(ApiError::invalid(
                    "add_generation_prompt",
                    "add_generation_prompt applies to messages only, not to a prompt",
                ));
            }
            if obj.contains_key("tools") {
                return Err(ApiError::invalid("tools", "tools apply to messages only, not to a prompt"));
            }
            api::text_tokens(text, "prompt", model, add_special.unwrap_or(true))?
        }
        (Some(_), None) => return Err(ApiError::invalid("prompt", "prompt must be a string")),
        (None, Some(_)) => {
            let generation = opt_bool(&obj, "add_generation_prompt")?.unwrap_or(true);
            // Checked as the chat endpoint checks them, and rendered the same way.
            crate::tools::from_request(&obj, model)?;
            api::chat_tokens(&obj, model, generation, add_special)?
        }
        (None, None) => {
            return Err(ApiError::invalid("prompt", "prompt (a string) or messages (a chat) is required"));
        }
    };
    Ok(answer(tokens, model))
}

fn answer(tokens: Vec<u32>, model: &LoadedModel) -> Value {
    json!({
        "count": tokens.len(),
        "max_model_len": model.config.max_position_embeddings,
        "tokens": tokens,
    })
}

/// `POST /detokenize`: `{"tokens": [...]}` to `{"prompt": "..."}` (and the same text as
/// `content`, llama-server's name), special tokens skipped.
pub fn detokenize(body: &[u8], model_id: &str, model: &LoadedModel) -> Result<Value, ApiError> {
    let obj = object(body, "/detokenize", DETOKENIZE_FIELDS, model_id)?;
    let vocab = model.config.vocab_size;
    let bad = || {
        ApiError::invalid(
            "tokens",
            format!(
                "tokens must be an array of token ids: accepted ids are 0 to {}",
                vocab.saturating_sub(1)
            ),
        )
    };
    let ids = match obj.get("tokens") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|t| match t.as_u64() {
                Some(id) if (id as usize) < vocab => Ok(id as u32),
                _ => Err(ApiError::invalid(
                    "tokens",
                    format!(
                        "token id {t} is outside the vocabulary: accepted ids are 0 to {}",
                        vocab.saturating_sub(1)
                    ),
                )),
            })
            .collect::<Result<Vec<u32>, _>>()?,
        None => return Err(ApiError::invalid("tokens", "tokens is required")),
        Some(_) => return Err(bad()),
    };
    let text = model
        .tokenizer
        .decode(&ids)
        .map_err(|e| ApiError::invalid("tokens", format!("the tokens cannot be decoded: {e}")))?;
    Ok(json!({"prompt": text, "content": text}))
}
