//! The OpenAI request bodies kiln accepts, checked field by field: a field of the wrong
//! type or out of range is a 400 naming it; a field kiln does not implement is refused by
//! name unless it carries the value that means "off", which clients send by default.
//! A request becomes one [`GenerationRequest`] per choice: `n` per prompt, and a
//! completion may carry a list of prompts.

use kiln_model::chat_template::ChatMessage;
use kiln_model::{LoadedModel, LogitAdjustments, ModelError, SamplingParams};
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::structured::{self, Constraint};
use crate::tools::{self, Tools};

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
}

impl Endpoint {
    /// The endpoint's path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }
}

/// A checked request, ready for the scheduler.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// How to choose tokens.
    pub sampling: SamplingParams,
    /// Logit bias and penalties, applied to the logits row before `sampling`.
    pub adjust: LogitAdjustments,
    /// Keep generating past EOS until `max_tokens`.
    pub ignore_eos: bool,
    /// Strings that end generation.
    pub stop: Vec<String>,
    /// Stream as server-sent events.
    pub stream: bool,
    /// Add a usage chunk at the end of the stream.
    pub include_usage: bool,
    /// Put the usage so far on every chunk (`stream_options.continuous_usage_stats`, as
    /// vLLM has it: only together with `include_usage`).
    pub continuous_usage: bool,
    /// Ask for a speculative slot (`"speculative": true`, kiln's extension).
    pub speculative: bool,
    /// What the output is constrained to (`response_format`, `guided_*`, a forced tool
    /// call); such a request never decodes speculatively.
    pub constraint: Option<Box<Constraint>>,
    /// The request's tools, whose calls are parsed out of the output.
    pub tools: Option<Box<Tools>>,
    /// Log-probabilities of each sampled token with this many most likely alternatives
    /// (chat's `top_logprobs`, a completion's `logprobs`); `None` for none.
    pub logprobs: Option<usize>,
    /// Put the prompt's text before the completion (a completion's `echo`).
    pub echo: bool,
    /// Compute the prompt's own log-probabilities (`echo` with `logprobs`; set on the
    /// first choice of each prompt only, the others share its values).
    pub prompt_logprobs: bool,
}

/// A checked request: its choices in the order of their `index` (prompt `i`'s choice
/// `j` at `i * n + j`).
#[derive(Clone, Debug)]
pub struct ParsedRequest {
    /// One request per choice.
    pub choices: Vec<GenerationRequest>,
    /// Choices per prompt.
    pub n: usize,
}

impl ParsedRequest {
    /// The first choice, which every field but the prompt, the seed and
    /// `prompt_logprobs` is shared with.
    pub fn first(&self) -> &GenerationRequest {
        &self.choices[0]
    }

    /// Distinct prompts.
    pub fn prompts(&self) -> usize {
        self.choices.len() / self.n
    }

    /// Prompt tokens over the distinct prompts (the usage's `prompt_tokens`).
    pub fn prompt_tokens(&self) -> usize {
        self.choices.iter().step_by(self.n).map(|c| c.prompt.len()).sum()
    }
}

/// The most choices per prompt (`n`).
pub const MAX_N: usize = 16;
/// The most alternatives per token on chat completions (`top_logprobs`), as OpenAI has it.
pub const MAX_TOP_LOGPROBS: usize = 20;
/// The most alternatives per token on completions (`logprobs`), as OpenAI's legacy
/// endpoint has it.
pub const MAX_COMPLETION_LOGPROBS: usize = 5;

/// Fields each endpoint understands.
const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "stop",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "ignore_eos",
    "stream",
    "stream_options",
    "user",
    "n",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logit_bias",
    "speculative",
];
/// Fields of `stream_options`.
const STREAM_OPTIONS: &[&str] = &["include_usage", "continuous_usage_stats"];
const CHAT_FIELDS: &[&str] =
    &["messages", "max_completion_tokens", "top_logprobs", "parallel_tool_calls", "tools", "tool_choice"];
const COMPLETION_FIELDS: &[&str] = &["prompt", "echo", "best_of"];

/// Parses and checks a request body for `endpoint`; `model_id` is the served model's
/// name, `model` the loaded model (tokenizer, template, context).
pub fn parse(
    endpoint: Endpoint,
    body: &[u8],
    model_id: &str,
    model: &LoadedModel,
) -> Result<ParsedRequest, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request("invalid_json", format!("the request body is not valid JSON: {e}"))
    })?;
    let Value::Object(obj) = value else {
        return Err(ApiError::bad_request("invalid_json", "the request body must be a JSON object"));
    };
    let extra = match endpoint {
        Endpoint::Chat => CHAT_FIELDS,
        Endpoint::Completions => COMPLETION_FIELDS,
    };
    for key in obj.keys() {
        let known = |list: &[&str]| list.contains(&key.as_str());
        if !known(COMMON_FIELDS) && !known(structured::FIELDS) && !known(extra) {
            return Err(ApiError::invalid(
                key.as_str(),
                format!("unsupported field {key:?}: kiln does not implement it on {}", endpoint.path()),
            ));
        }
    }
    refuse_unless_off(&obj)?;
    let fields = structured::from_request(&obj)?;
    let tools = match endpoint {
        Endpoint::Chat => tools::from_request(&obj, model)?,
        Endpoint::Completions => None,
    };
    let constraint = structured::one(fields, tools.as_ref().and_then(Tools::constraint))?;

    match obj.get("model") {
        Some(Value::String(m)) if m == model_id => {}
        Some(Value::String(m)) => return Err(model_not_found(m, model_id)),
        Some(_) => return Err(ApiError::invalid("model", "model must be a string")),
        None => {
            return Err(ApiError::invalid(
                "model",
                format!("model is required: this server serves {model_id:?}"),
            ));
        }
    }

    let (n, echo, logprobs) = choices_and_logprobs(&obj, endpoint)?;
    let prompts = match endpoint {
        Endpoint::Chat => vec![chat_prompt(&obj, model)?],
        Endpoint::Completions => completion_prompts(&obj, model)?,
    };
    let prompt_field = if endpoint == Endpoint::Chat { "messages" } else { "prompt" };
    let context = model.config.max_position_embeddings;
    // Checked against the longest prompt: one limit holds for every choice. At least one
    // token must be left to generate.
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    if kiln_protocol::check_context(longest, 1, context).is_err() {
        return Err(ApiError::invalid(
            prompt_field,
            format!(
                "the prompt is {longest} tokens, past the model's context of {context} tokens \
                 (at least one token must be left to generate)"
            ),
        ));
    }
    let least = if echo { 0 } else { 1 };
    let room = kiln_protocol::context_room(longest, context);
    let max_tokens = match max_tokens_field(&obj, endpoint)? {
        Some((name, n)) => {
            if n < least {
                let accepted = if endpoint == Endpoint::Completions {
                    "1 or more (0 only with echo: true)"
                } else {
                    "1 or more"
                };
                return Err(ApiError::invalid(
                    name,
                    format!("{name} {n} is out of range: accepted values are {accepted}"),
                ));
            }
            let n = n as usize;
            if n > room {
                return Err(ApiError::invalid(
                    name,
                    format!(
                        "{name} {n} plus the prompt's {longest} tokens exceed the model's context of {context} tokens: \
                         accepted values are {least} to {room}"
                    ),
                ));
            }
            Some(n)
        }
        None => None,
    };

    let temperature = opt_f64(&obj, "temperature")?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature",
            format!("temperature {temperature} is out of range: accepted values are 0 to 2"),
        ));
    }
    let top_p = opt_f64(&obj, "top_p")?.unwrap_or(1.0);
    // The sampler works in single precision: a positive top_p below its smallest
    // positive value would become 0 there.
    if !(top_p > 0.0 && top_p <= 1.0 && top_p as f32 > 0.0) {
        return Err(ApiError::invalid(
            "top_p",
            format!(
                "top_p {top_p} is out of range: accepted values are in (0, 1] and at least {:e} \
                 (the smallest positive single-precision number)",
                f32::from_bits(1)
            ),
        ));
    }
    let top_k = match opt_i64(&obj, "top_k")? {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!(
                    "top_k {k} is out of range: accepted values are 1 or more, or 0 or -1 for all tokens"
                ),
            ));
        }
    };
    let seed = match opt_i64(&obj, "seed")? {
        Some(s) => s as u64,
        None => fresh_seed(),
    };
    let ignore_eos = opt_bool(&obj, "ignore_eos")?.unwrap_or(false);
    let speculative = opt_bool(&obj, "speculative")?.unwrap_or(false);
    let stream = opt_bool(&obj, "stream")?.unwrap_or(false);
    let (include_usage, continuous_usage) = match obj.get("stream_options") {
        None | Some(Value::Null) => (false, false),
        Some(Value::Object(o)) => {
            if let Some(k) = o.keys().find(|k| !STREAM_OPTIONS.contains(&k.as_str())) {
                return Err(ApiError::invalid(
                    "stream_options",
                    format!(
                        "unsupported field stream_options.{k}: accepted are {}",
                        STREAM_OPTIONS.join(" and ")
                    ),
                ));
            }
            if !stream {
                return Err(ApiError::invalid(
                    "stream_options",
                    "stream_options is only allowed when stream is true",
                ));
            }
            let flag = |name: &str| match o.get(name) {
                None | Some(Value::Null) => Ok(false),
                Some(Value::Bool(b)) => Ok(*b),
                Some(_) => Err(ApiError::invalid(
                    "stream_options",
                    format!("stream_options.{name} must be a boolean"),
                )),
            };
            let (include, continuous) = (flag("include_usage")?, flag("continuous_usage_stats")?);
            // vLLM's rule: usage on every chunk only when the usage chunk is asked for too.
            (include, include && continuous)
        }
        Some(_) => return Err(ApiError::invalid("stream_options", "stream_options must be an object")),
    };
    let stop = match obj.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.len() > 4 {
                return Err(ApiError::invalid(
                    "stop",
                    format!("stop has {} strings: at most 4 are accepted", items.len()),
                ));
            }
            items
                .iter()
                .map(|i| match i {
                    Value::String(s) => Ok(s.clone()),
                    _ => Err(ApiError::invalid("stop", "stop must be a string or an array of strings")),
                })
                .collect::<Result<_, _>>()?
        }
        Some(_) => return Err(ApiError::invalid("stop", "stop must be a string or an array of strings")),
    };
    if let Some(u) = obj.get("user")
        && !u.is_string()
    {
        return Err(ApiError::invalid("user", "user must be a string"));
    }
    let min_p = opt_f64(&obj, "min_p")?.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::invalid(
            "min_p",
            format!("min_p {min_p} is out of range: accepted values are 0 to 1"),
        ));
    }
    let sampling = SamplingParams {
        temperature: temperature as f32,
        top_k,
        top_p: top_p as f32,
        min_p: min_p as f32,
        seed,
    };
    sampling.validate().map_err(sampling_error)?;
    let adjust = adjustments(&obj, model.config.vocab_size)?;
    let mut choices = Vec::with_capacity(prompts.len() * n);
    for prompt in prompts {
        for j in 0..n {
            let index = choices.len() as u64;
            choices.push(GenerationRequest {
                max_tokens: max_tokens.unwrap_or(kiln_protocol::context_room(prompt.len(), context)),
                prompt: prompt.clone(),
                // Choice k samples with seed + k: a seeded request reproduces, and its
                // choices differ.
                sampling: SamplingParams { seed: seed.wrapping_add(index), ..sampling },
                adjust: adjust.clone(),
                ignore_eos,
                stop: stop.clone(),
                stream,
                include_usage,
                continuous_usage,
                speculative,
                logprobs,
                echo,
                prompt_logprobs: echo && logprobs.is_some() && j == 0,
                constraint: constraint.clone().map(Box::new),
                tools: tools.clone().map(Box::new),
            });
        }
    }
    Ok(ParsedRequest { choices, n })
}

/// `n` (with `best_of`, which must equal it), `echo`, and the alternatives per token of
/// `logprobs`/`top_logprobs`, checked for `endpoint`.
fn choices_and_logprobs(
    obj: &Map<String, Value>,
    endpoint: Endpoint,
) -> Result<(usize, bool, Option<usize>), ApiError> {
    let n = match opt_i64(obj, "n")? {
        None => 1,
        Some(n) if (1..=MAX_N as i64).contains(&n) => n as usize,
        Some(n) => {
            return Err(ApiError::invalid(
                "n",
                format!("n {n} is out of range: accepted values are 1 to {MAX_N}"),
            ));
        }
    };
    if let Some(b) = opt_i64(obj, "best_of")?
        && b != n as i64
    {
        return Err(ApiError::invalid(
            "best_of",
            format!(
                "unsupported best_of {b}: kiln returns every sequence it generates, so best_of must equal n ({n}) \
                 or be left out"
            ),
        ));
    }
    match endpoint {
        Endpoint::Chat => {
            let on = opt_bool(obj, "logprobs")?.unwrap_or(false);
            let top = match opt_i64(obj, "top_logprobs")? {
                None => None,
                Some(k) if (0..=MAX_TOP_LOGPROBS as i64).contains(&k) => Some(k as usize),
                Some(k) => {
                    return Err(ApiError::invalid(
                        "top_logprobs",
                        format!(
                            "top_logprobs {k} is out of range: accepted values are 0 to {MAX_TOP_LOGPROBS}"
                        ),
                    ));
                }
            };
            if top.is_some_and(|k| k > 0) && !on {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "top_logprobs needs logprobs: true (it is the number of alternatives per token)",
                ));
            }
            Ok((n, false, on.then(|| top.unwrap_or(0))))
        }
        Endpoint::Completions => {
            let echo = opt_bool(obj, "echo")?.unwrap_or(false);
            let logprobs = match obj.get("logprobs") {
                None | Some(Value::Null) => None,
                Some(Value::Number(v)) => match v.as_i64() {
                    Some(k) if (0..=MAX_COMPLETION_LOGPROBS as i64).contains(&k) => Some(k as usize),
                    _ => {
                        return Err(ApiError::invalid(
                            "logprobs",
                            format!(
                                "logprobs {v} is out of range: accepted values are integers 0 to \
                                 {MAX_COMPLETION_LOGPROBS} (alternatives per token) or null"
                            ),
                        ));
                    }
                },
                Some(_) => {
                    return Err(ApiError::invalid(
                        "logprobs",
                        format!(
                            "logprobs must be an integer 0 to {MAX_COMPLETION_LOGPROBS} (alternatives per token) or null \
                             on /v1/completions"
                        ),
                    ));
                }
            };
            Ok((n, echo, logprobs))
        }
    }
}

/// `logit_bias`, `repetition_penalty`, `frequency_penalty` and `presence_penalty`,
/// checked against `vocab` token ids.
fn adjustments(obj: &Map<String, Value>, vocab: usize) -> Result<LogitAdjustments, ApiError> {
    let mut a = LogitAdjustments::default();
    for (name, slot) in
        [("frequency_penalty", &mut a.frequency_penalty), ("presence_penalty", &mut a.presence_penalty)]
    {
        let v = opt_f64(obj, name)?.unwrap_or(0.0);
        if !(-2.0..=2.0).contains(&v) {
            return Err(ApiError::invalid(
                name,
                format!("{name} {v} is out of range: accepted values are -2 to 2"),
            ));
        }
        *slot = v as f32;
    }
    let r = opt_f64(obj, "repetition_penalty")?.unwrap_or(1.0);
    // Single precision: a positive value below its smallest would become 0, a huge one
    // infinite.
    if !(r > 0.0 && (r as f32) > 0.0 && (r as f32).is_finite()) {
        return Err(ApiError::invalid(
            "repetition_penalty",
            format!(
                "repetition_penalty {r} is out of range: accepted values are above 0 (1 = off, above 1 \
                 discourages repeats) and representable in single precision"
            ),
        ));
    }
    a.repetition_penalty = r as f32;
    match obj.get("logit_bias") {
        None | Some(Value::Null) => {}
        Some(Value::Object(map)) => {
            for (key, value) in map {
                let id = match key.parse::<u32>() {
                    Ok(id) if (id as usize) < vocab && key == &id.to_string() => id,
                    _ => {
                        return Err(ApiError::invalid(
                            "logit_bias",
                            format!(
                                "logit_bias key {key:?} is not a token id of this model: accepted keys are \
                                 token ids 0 to {} written as decimal strings",
                                vocab.saturating_sub(1)
                            ),
                        ));
                    }
                };
                let bias = match value.as_f64() {
                    Some(b) if (-100.0..=100.0).contains(&b) => b as f32,
                    _ => {
                        return Err(ApiError::invalid(
                            "logit_bias",
                            format!(
                                "logit_bias[{key:?}] {value} is out of range: accepted values are numbers -100 to 100"
                            ),
                        ));
                    }
                };
                a.logit_bias.push((id, bias));
            }
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "logit_bias",
                "logit_bias must be an object mapping token ids (as strings) to numbers -100 to 100",
            ));
        }
    }
    a.validate(vocab).map_err(sampling_error)?;
    Ok(a)
}

/// A sampler's refusal as a 400 naming the request field it is about (`top_p` for the
/// sampler's `top-p`), not a fixed one.
pub fn sampling_error(e: ModelError) -> ApiError {
    match e {
        ModelError::InvalidArgument { what, message } => {
            let field = what.replace('-', "_");
            ApiError::invalid(field.clone(), format!("{field} {message}"))
        }
        other => ApiError::bad_request("invalid_sampling", other.to_string()),
    }
}

/// The 404 OpenAI answers for a model it does not serve, naming the one this server does.
pub fn model_not_found(asked: &str, model_id: &str) -> ApiError {
    ApiError {
        status: axum::http::StatusCode::NOT_FOUND,
        code: "model_not_found",
        ..ApiError::invalid(
            "model",
            format!("the model {asked:?} does not exist: this server serves {model_id:?}"),
        )
    }
}

/// A seed for a request that names none: different per request, as OpenAI's are.
fn fresh_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos ^ COUNTER.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Refuses fields kiln does not implement unless they carry their "off" value.
fn refuse_unless_off(obj: &Map<String, Value>) -> Result<(), ApiError> {
    let unsupported = |name: &str, accepted: &str| {
        Err(ApiError::invalid(name, format!("unsupported {name}: kiln implements only {accepted}")))
    };
    for (name, value) in obj {
        let off = match name.as_str() {
            "parallel_tool_calls" => matches!(value, Value::Null | Value::Bool(_)),
            _ => true,
        };
        if !off {
            let accepted = match name.as_str() {
                "parallel_tool_calls" => "a boolean",
                _ => "0",
            };
            return unsupported(name, &format!("{name} = {accepted}"));
        }
    }
    Ok(())
}

fn max_tokens_field(
    obj: &Map<String, Value>,
    endpoint: Endpoint,
) -> Result<Option<(&'static str, i64)>, ApiError> {
    let names: &[&'static str] = match endpoint {
        Endpoint::Chat => &["max_completion_tokens", "max_tokens"],
        Endpoint::Completions => &["max_tokens"],
    };
    for &name in names {
        if let Some(n) = opt_i64(obj, name)? {
            return Ok(Some((name, n)));
        }
    }
    Ok(None)
}

fn opt_f64(obj: &Map<String, Value>, name: &str) -> Result<Option<f64>, ApiError> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(_) => Err(ApiError::invalid(name, format!("{name} must be a number"))),
    }
}

fn opt_i64(obj: &Map<String, Value>, name: &str) -> Result<Option<i64>, ApiError> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_i64() {
            Some(i) => Ok(Some(i)),
            // A whole number past 64 signed bits (u64's upper half, or 1e300).
            None if n.is_u64() || n.as_f64().is_some_and(|f| f.fract() == 0.0) => Err(ApiError::invalid(
                name,
                format!(
                    "{name} {n} is out of range: accepted are integers from {} to {}",
                    i64::MIN,
                    i64::MAX
                ),
            )),
            None => Err(ApiError::invalid(name, format!("{name} must be an integer, got {n}"))),
        },
        Some(_) => Err(ApiError::invalid(name, format!("{name} must be an integer"))),
    }
}

fn opt_bool(obj: &Map<String, Value>, name: &str) -> Result<Option<bool>, ApiError> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::invalid(name, format!("{name} must be a boolean"))),
    }
}

/// The chat's messages through the model's template, or, for a model without one (the
/// synthetic models), the plain rendering [`render_plain`].
fn chat_prompt(obj: &Map<String, Value>, model: &LoadedModel) -> Result<Vec<u32>, ApiError> {
    chat_tokens(obj, model, true, None)
}

/// The token ids of `obj`'s `messages`, rendered as [`chat_prompt`] renders them, with
/// the generation prompt when `add_generation_prompt`; `add_special` overrides whether
/// the tokenizer adds its special tokens (by default: not after a chat template, which
/// writes them itself; yes for the plain rendering).
pub(crate) fn chat_tokens(
    obj: &Map<String, Value>,
    model: &LoadedModel,
    add_generation_prompt: bool,
    add_special: Option<bool>,
) -> Result<Vec<u32>, ApiError> {
    let messages = match obj.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => return Err(ApiError::invalid("messages", "messages must not be empty")),
        Some(_) => {
            return Err(ApiError::invalid(
                "messages",
                "messages must be an array of {role, content} objects",
            ));
        }
        None => return Err(ApiError::invalid("messages", "messages is required")),
    };
    let mut parsed = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        parsed.push(message(i, m)?);
    }
    let tools = match obj.get("tools") {
        Some(Value::Array(t)) if !t.is_empty() => Some(t),
        _ => None,
    };
    let tokens = match &model.chat_template {
        Some(t) => {
            let values: Vec<Value> = parsed.iter().map(Message::template_value).collect();
            let mut extra = Map::new();
            if let Some(tools) = tools {
                extra.insert("tools".into(), Value::Array(tools.clone()));
            }
            let text = t.render_with(&values, add_generation_prompt, &extra).map_err(|e| {
                ApiError::invalid("messages", format!("the model's chat template refused the messages: {e}"))
            })?;
            model.tokenizer.encode(&text, add_special.unwrap_or(false))
        }
        None => {
            let mut plain: Vec<ChatMessage> = Vec::with_capacity(parsed.len() + 1);
            if let Some(tools) = tools {
                // One line naming the tools and how to call them, as a template's system
                // text would.
                let list: Vec<String> = tools.iter().map(Value::to_string).collect();
                plain.push(ChatMessage::new(
                    "tools",
                    format!(
                        "{} (call one as <tool_call>{{\"name\": ..., \"arguments\": {{...}}}}</tool_call>)",
                        list.join(" ")
                    ),
                ));
            }
            plain.extend(parsed.iter().map(Message::plain));
            let mut text = render_plain(&plain);
            if !add_generation_prompt {
                text.truncate(text.len() - PLAIN_GENERATION_PROMPT.len());
            }
            model.tokenizer.encode(&text, add_special.unwrap_or(true))
        }
    };
    let tokens =
        tokens.map_err(|e| ApiError::invalid("messages", format!("the messages cannot be encoded: {e}")))?;
    if tokens.is_empty() {
        return Err(ApiError::invalid("messages", "the messages encode to no tokens"));
    }
    Ok(tokens)
}

/// How a chat is written for a model without a chat template: one `role: content` line
/// per message, then `assistant: ` where the answer begins.
pub fn render_plain(messages: &[ChatMessage]) -> String {
    let mut s = String::new();
    for m in messages {
        s.push_str(&m.role);
        s.push_str(": ");
        s.push_str(&m.content);
        s.push('\n');
    }
    s.push_str(PLAIN_GENERATION_PROMPT);
    s
}

/// Where the answer begins in [`render_plain`].
const PLAIN_GENERATION_PROMPT: &str = "assistant: ";

/// One checked chat message: its text (none for an assistant message that only calls
/// tools), its tool calls, and the call a tool message answers.
struct Message {
    role: String,
    content: Option<String>,
    name: Option<String>,
    tool_calls: Option<Vec<Value>>,
    tool_call_id: Option<String>,
}

impl Message {
    /// The message as chat templates read it (Hugging Face's shape): tool calls'
    /// `arguments` as objects, as vLLM hands them to templates.
    fn template_value(&self) -> Value {
        let mut m = Map::new();
        m.insert("role".into(), Value::String(self.role.clone()));
        m.insert("content".into(), self.content.clone().map_or(Value::Null, Value::String));
        if let Some(n) = &self.name {
            m.insert("name".into(), Value::String(n.clone()));
        }
        if let Some(calls) = &self.tool_calls {
            let calls = calls
                .iter()
                .map(|c| {
                    let mut c = c.clone();
                    if let Some(a) = c["function"]["arguments"].as_str()
                        && let Ok(parsed) = serde_json::from_str::<Value>(a)
                    {
                        c["function"]["arguments"] = parsed;
                    }
                    c
                })
                .collect();
            m.insert("tool_calls".into(), Value::Array(calls));
        }
        if let Some(id) = &self.tool_call_id {
            m.insert("tool_call_id".into(), Value::String(id.clone()));
        }
        Value::Object(m)
    }

    /// The message for [`render_plain`]: calls written as the model would write them.
    fn plain(&self) -> ChatMessage {
        let mut text = self.content.clone().unwrap_or_default();
        if let Some(calls) = &self.tool_calls {
            text.push_str(&tools::plain_calls(calls));
        }
        ChatMessage::new(self.role.clone(), text)
    }
}

fn message(i: usize, m: &Value) -> Result<Message, ApiError> {
    let param = format!("messages[{i}]");
    let Value::Object(o) = m else {
        return Err(ApiError::invalid(
            param,
            format!("messages[{i}] must be an object with role and content"),
        ));
    };
    if let Some(k) =
        o.keys().find(|k| !matches!(k.as_str(), "role" | "content" | "name" | "tool_calls" | "tool_call_id"))
    {
        return Err(ApiError::invalid(
            format!("messages[{i}].{k}"),
            format!(
                "unsupported field messages[{i}].{k}: accepted are role, content, name, tool_calls and tool_call_id"
            ),
        ));
    }
    let role = match o.get("role") {
        Some(Value::String(r))
            if matches!(r.as_str(), "system" | "developer" | "user" | "assistant" | "tool") =>
        {
            r.clone()
        }
        Some(Value::String(r)) => {
            return Err(ApiError::invalid(
                format!("messages[{i}].role"),
                format!("unsupported role {r:?}: accepted are system, developer, user, assistant and tool"),
            ));
        }
        _ => {
            return Err(ApiError::invalid(
                format!("messages[{i}].role"),
                format!("messages[{i}].role must be a string"),
            ));
        }
    };
    let tool_calls = match o.get("tool_calls") {
        None | Some(Value::Null) => None,
        Some(Value::Array(calls)) if role == "assistant" => {
            for (j, c) in calls.iter().enumerate() {
                let f = c.get("function");
                let ok = f.and_then(|f| f.get("name")).is_some_and(Value::is_string)
                    && f.and_then(|f| f.get("arguments")).is_some_and(|a| a.is_string() || a.is_object());
                if !ok {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].tool_calls[{j}]"),
                        format!(
                            "messages[{i}].tool_calls[{j}] must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}"
                        ),
                    ));
                }
            }
            Some(calls.clone())
        }
        Some(_) => {
            return Err(ApiError::invalid(
                format!("messages[{i}].tool_calls"),
                format!("messages[{i}].tool_calls must be an array, on an assistant message"),
            ));
        }
    };
    let tool_call_id = match o.get("tool_call_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) => Some(id.clone()),
        Some(_) => {
            return Err(ApiError::invalid(
                format!("messages[{i}].tool_call_id"),
                format!("messages[{i}].tool_call_id must be a string"),
            ));
        }
    };
    let name = o.get("name").and_then(Value::as_str).map(str::to_string);
    let content = match o.get("content") {
        Some(Value::String(c)) => Some(c.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    _ => {
                        return Err(ApiError::invalid(
                            format!("messages[{i}].content"),
                            format!(
                                "messages[{i}].content parts must be {{\"type\": \"text\", \"text\": ...}}: kiln reads text only"
                            ),
                        ));
                    }
                }
            }
            Some(text)
        }
        // An assistant message that only calls tools has no text.
        None | Some(Value::Null) if tool_calls.is_some() => None,
        _ => {
            return Err(ApiError::invalid(
                format!("messages[{i}].content"),
                format!(
                    "messages[{i}].content must be a string or an array of text parts (null only beside tool_calls)"
                ),
            ));
        }
    };
    Ok(Message { role, content, name, tool_calls, tool_call_id })
}

/// The prompts of a completion: a string, a list of token ids, or a list of either.
fn completion_prompts(obj: &Map<String, Value>, model: &LoadedModel) -> Result<Vec<Vec<u32>>, ApiError> {
    const SHAPES: &str = "prompt must be a string, an array of token ids, or a non-empty array of strings or of \
                          token-id arrays";
    match obj.get("prompt") {
        Some(Value::String(s)) => Ok(vec![text_prompt(s, "prompt", model)?]),
        Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_number) => {
            Ok(vec![id_prompt(items, "prompt", model)?])
        }
        Some(Value::Array(items)) if !items.is_empty() => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let field = format!("prompt[{i}]");
                match item {
                    Value::String(s) => text_prompt(s, &field, model),
                    Value::Array(ids) if !ids.is_empty() => id_prompt(ids, &field, model),
                    _ => Err(ApiError::invalid(
                        "prompt",
                        format!("{field} is neither a string nor token ids: {SHAPES}"),
                    )),
                }
            })
            .collect(),
        Some(_) => Err(ApiError::invalid("prompt", SHAPES)),
        None => Err(ApiError::invalid("prompt", "prompt is required")),
    }
}

/// A text prompt's token ids (the tokenizer's special tokens added); `field` names it.
fn text_prompt(text: &str, field: &str, model: &LoadedModel) -> Result<Vec<u32>, ApiError> {
    let ids =
        text_tokens(text, field, model, true).map_err(|e| ApiError { param: Some("prompt".into()), ..e })?;
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", format!("{field} encodes to no tokens")));
    }
    Ok(ids)
}

/// A prompt given as token ids, each checked against the vocabulary.
fn id_prompt(items: &[Value], field: &str, model: &LoadedModel) -> Result<Vec<u32>, ApiError> {
    let vocab = model.config.vocab_size;
    items
        .iter()
        .map(|item| match item.as_u64() {
            Some(t) if (t as usize) < vocab => Ok(t as u32),
            _ => Err(ApiError::invalid(
                "prompt",
                format!(
                    "{field}: token id {item} is outside the vocabulary: accepted ids are 0 to {}",
                    vocab - 1
                ),
            )),
        })
        .collect()
}

/// The token ids of a text prompt (the request field `field`), with the tokenizer's
/// special tokens when `add_special`, as `/v1/completions` encodes its prompt.
pub(crate) fn text_tokens(
    text: &str,
    field: &str,
    model: &LoadedModel,
    add_special: bool,
) -> Result<Vec<u32>, ApiError> {
    model
        .tokenizer
        .encode(text, add_special)
        .map_err(|e| ApiError::invalid(field, format!("the {field} cannot be encoded: {e}")))
}

#[cfg(test)]
mod tests {
    use kiln_model::chat_template::ChatTemplate;

    use super::*;

    fn template(name: &str) -> ChatTemplate {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../kiln-model/tests/fixtures/models/templates")
            .join(name);
        let source = std::fs::read_to_string(&path).unwrap();
        ChatTemplate::new(source, Some("<|begin_of_text|>".into()), None, path).unwrap()
    }

    /// A tool round trip's history as a client sends it: the call with `content: null`
    /// and its arguments as JSON text, then the tool's answer.
    fn history() -> (Vec<Value>, Map<String, Value>) {
        let messages = json_messages(serde_json::json!([
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        ]));
        let mut extra = Map::new();
        extra.insert(
            "tools".into(),
            serde_json::json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]),
        );
        (messages, extra)
    }

    fn json_messages(v: Value) -> Vec<Value> {
        v.as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, m)| message(i, m).unwrap().template_value())
            .collect()
    }

    #[test]
    fn qwen_template_renders_tools_calls_and_results_as_its_model_expects() {
        let (messages, extra) = history();
        let text = template("qwen2.5-instruct.jinja").render_with(&messages, true, &extra).unwrap();
        assert!(
            text.contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""),
            "{text}"
        );
        assert!(
            text.contains("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>"),
            "{text}"
        );
        assert!(
            text.contains("<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>"),
            "{text}"
        );
        assert!(text.ends_with("<|im_start|>assistant\n"), "{text}");
    }

    #[test]
    fn llama_template_renders_tools_calls_and_results_as_its_model_expects() {
        let (messages, extra) = history();
        let text = template("llama-3.2-instruct.jinja").render_with(&messages, true, &extra).unwrap();
        assert!(text.contains("\"name\": \"get_weather\""), "{text}");
        assert!(
            text.contains("<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}<|eot_id|>"),
            "{text}"
        );
        // The template writes a string result through `tojson` (a string is iterable in
        // Jinja), as transformers renders it.
        assert!(text.contains("<|start_header_id|>ipython<|end_header_id|>\n\n\"21 C\"<|eot_id|>"), "{text}");
    }

    #[test]
    fn tool_messages_are_checked() {
        let bad = [
            serde_json::json!({"role": "assistant", "content": null}),
            serde_json::json!({"role": "user", "content": "x", "tool_calls": []}),
            serde_json::json!({"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f"}}]}),
            serde_json::json!({"role": "tool", "content": "x", "tool_call_id": 5}),
        ];
        for m in bad {
            assert!(message(0, &m).is_err(), "{m}");
        }
    }
}
