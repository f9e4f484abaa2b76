//! The plan of a sweep: the list of cells, derived from defaults or named on the command
//! line, and the parsers that validate its inputs before anything runs.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::classify::Status;

/// How a cell's prompt is given to the engine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Prompt {
    /// `--prompt-tokens N`: the engine builds a prompt of N tokens.
    Tokens(u64),
    /// `--prompt TEXT`.
    Text(String),
}

/// One measurement: a model at a prompt, with everything the engine is told.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cell {
    /// The model as the user or the defaults named it.
    pub model: String,
    /// The prompt.
    pub prompt: Prompt,
    /// Tokens decoded and measured.
    pub max_tokens: u64,
    /// Tokens decoded before the measurement starts.
    pub warmup_tokens: u64,
    /// Which of the cell's coordinates were named on the command line (the rest were
    /// derived from defaults); see [`Cell::named_for`].
    pub named: Named,
    /// Variables set for this cell's engine process on top of the inherited environment
    /// (an A/B arm pins one here).
    pub env: BTreeMap<String, String>,
    /// Which repetition of the cell this is, from 1 (`--repeat`).
    pub repetition: u32,
    /// Which engine runs it: kiln, or the peer named by `--peer`.
    pub engine: Engine,
}

/// The engine a cell measures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Engine {
    /// kiln, through the layers and the runner.
    #[default]
    Kiln,
    /// The `--peer` engine (llama.cpp's llama-bench), on the same model file.
    Peer,
}

impl Engine {
    /// The `engine` column for kiln; a peer's row names its program.
    pub const KILN: &'static str = "kiln";
}

impl Cell {
    /// The prompt length the OOM layers key on: the target length, or 0 for a text
    /// prompt (its token count is known only after it ran). A model that cannot hold a
    /// short prompt cannot hold a long one, so an OOM recorded at 0 pre-skips every length.
    pub fn layer_len(&self) -> u64 {
        match self.prompt {
            Prompt::Tokens(n) => n,
            Prompt::Text(_) => 0,
        }
    }

    /// Whether the user named what a by-rule skip with `status` is about, so that the skip
    /// makes the run exit 1. A missing model is about the model alone; a context or
    /// geometry refusal is about the model at this prompt, so both must have been named.
    /// A by-rule skip of a cell derived from defaults is expected output.
    pub fn named_for(&self, status: Status) -> bool {
        match status {
            Status::MissingModel => self.named.models,
            _ => self.named.models && self.named.prompts,
        }
    }

    /// The `prompt_target_len` column: empty for a text prompt.
    pub fn prompt_target_len(&self) -> Option<u64> {
        match self.prompt {
            Prompt::Tokens(n) => Some(n),
            Prompt::Text(_) => None,
        }
    }

    /// The `prompt` column: the text, empty for a token-count prompt.
    pub fn prompt_text(&self) -> &str {
        match &self.prompt {
            Prompt::Tokens(_) => "",
            Prompt::Text(t) => t,
        }
    }

    /// The identity `--resume` matches rows on.
    pub fn key(&self) -> CellKey {
        CellKey {
            model: self.model.clone(),
            prompt_target_len: self.prompt_target_len(),
            prompt: self.prompt_text().to_string(),
            repetition: self.repetition,
            peer: self.engine == Engine::Peer,
        }
    }

    /// A short name for messages and file names: `model@len` or `model@text`, then
    /// `#r` for a repetition after the first and `+peer` for the peer's run.
    pub fn label(&self) -> String {
        let mut s = match self.prompt {
            Prompt::Tokens(n) => format!("{}@{n}", self.model),
            Prompt::Text(_) => format!("{}@text", self.model),
        };
        if self.repetition > 1 {
            s.push_str(&format!("#{}", self.repetition));
        }
        if self.engine == Engine::Peer {
            s.push_str("+peer");
        }
        s
    }
}

impl fmt::Display for Cell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

/// What identifies a cell's row in a CSV.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CellKey {
    /// `model` column.
    pub model: String,
    /// `prompt_target_len` column.
    pub prompt_target_len: Option<u64>,
    /// `prompt` column.
    pub prompt: String,
    /// `repetition` column.
    pub repetition: u32,
    /// Whether the row is the peer's (`engine` column other than kiln).
    pub peer: bool,
}

/// The cells of a sweep in the order they run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Plan {
    /// Cells, model-major, length-minor.
    pub cells: Vec<Cell>,
    /// The models in plan order (rows of the summary).
    pub models: Vec<String>,
    /// The prompt lengths in plan order (columns of the summary); empty for text prompts.
    pub lengths: Vec<u64>,
}

/// Which parts of a plan the user named.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Named {
    /// `--models` was given.
    pub models: bool,
    /// The prompt (lengths or text) was given.
    pub prompts: bool,
}

/// What every cell shares.
#[derive(Clone, Debug)]
pub struct CellTemplate {
    /// Tokens decoded and measured.
    pub max_tokens: u64,
    /// Warm-up tokens.
    pub warmup_tokens: u64,
    /// Which coordinates the user named.
    pub named: Named,
}

impl CellTemplate {
    /// Checks the token counts by the protocol's warm-up rule
    /// (`kiln_protocol::timed_decode_steps`): the prefill yields the first generated
    /// token and warm-up steps are part of the generated tokens, so at least one timed
    /// decode step must remain.
    pub fn validate(&self) -> Result<(), String> {
        kiln_protocol::timed_decode_steps(self.max_tokens, self.warmup_tokens)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}

impl Plan {
    /// Models x prompts, model-major.
    pub fn grid(models: &[String], prompts: &[Prompt], t: &CellTemplate) -> Plan {
        let cells = models
            .iter()
            .flat_map(|m| {
                prompts.iter().map(move |p| Cell {
                    model: m.clone(),
                    prompt: p.clone(),
                    max_tokens: t.max_tokens,
                    warmup_tokens: t.warmup_tokens,
                    named: t.named,
                    env: BTreeMap::new(),
                    repetition: 1,
                    engine: Engine::Kiln,
                })
            })
            .collect();
        let lengths = prompts
            .iter()
            .filter_map(|p| match p {
                Prompt::Tokens(n) => Some(*n),
                Prompt::Text(_) => None,
            })
            .collect();
        Plan { cells, models: models.to_vec(), lengths }
    }
}

/// A validated `--lengths`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ladder(pub Vec<u64>);

/// A validated `--models`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Models(pub Vec<String>);

/// `--lengths` for clap: a usage error (exit 2) before anything runs.
pub fn ladder_arg(s: &str) -> Result<Ladder, String> {
    parse_ladder(s).map(Ladder)
}

/// `--models` for clap.
pub fn models_arg(s: &str) -> Result<Models, String> {
    parse_models(s).map(Models)
}

/// Parses a ladder such as `"512 2048 8192"` (spaces or commas). Every entry must be a
/// plain non-negative integer; the first one that is not is named.
pub fn parse_ladder(s: &str) -> Result<Vec<u64>, String> {
    let tokens: Vec<&str> = s.split([' ', ',', '\t', '\n']).filter(|t| !t.is_empty()).collect();
    if tokens.is_empty() {
        return Err("the ladder is empty: expected non-negative integers such as \"512 2048 8192\"".into());
    }
    let mut out: Vec<u64> = Vec::with_capacity(tokens.len());
    for t in tokens {
        let n = if t.bytes().all(|b| b.is_ascii_digit()) { t.parse().ok() } else { None };
        let Some(n) = n else {
            return Err(format!(
                "`{t}` is not a non-negative integer: expected prompt lengths in tokens such as \"512 2048 8192\""
            ));
        };
        if out.contains(&n) {
            return Err(format!("`{t}` appears twice in the ladder: each length runs once"));
        }
        out.push(n);
    }
    Ok(out)
}

/// Parses a model list such as `"synthetic:tiny,synthetic:small"` (commas or spaces).
pub fn parse_models(s: &str) -> Result<Vec<String>, String> {
    let models: Vec<String> =
        s.split([' ', ',', '\t', '\n']).filter(|t| !t.is_empty()).map(str::to_string).collect();
    if models.is_empty() {
        return Err(
            "no model given: expected synthetic:<profile>, a directory under ./models/, or a path".into()
        );
    }
    let mut seen = Vec::new();
    for m in &models {
        if seen.contains(&m) {
            return Err(format!("model `{m}` appears twice: each model runs once"));
        }
        seen.push(m);
    }
    Ok(models)
}

/// The cells `KILN_BENCH_FAKE_OOM="model:len[,model:len...]"` names. The model may hold
/// colons itself (`synthetic:tiny:512`): the length is after the last one.
pub fn parse_fake_oom(s: &str) -> Result<Vec<(String, u64)>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            let bad =
                || format!("KILN_BENCH_FAKE_OOM entry `{t}` is not model:len (such as synthetic:tiny:512)");
            let (model, len) = t.rsplit_once(':').ok_or_else(bad)?;
            if model.is_empty() || !len.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad());
            }
            Ok((model.to_string(), len.parse().map_err(|_| bad())?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ladders_accept_spaces_and_commas() {
        assert_eq!(parse_ladder("512 2048  8192,32768").unwrap(), vec![512, 2048, 8192, 32768]);
        assert_eq!(parse_ladder("0").unwrap(), vec![0]);
    }

    #[test]
    fn ladders_name_the_offending_token() {
        for (input, token) in [("512 2o48", "`2o48`"), ("32k", "`32k`"), ("-1", "`-1`"), ("+5", "`+5`")] {
            let e = parse_ladder(input).unwrap_err();
            assert!(e.contains(token), "{input}: {e}");
        }
        assert!(parse_ladder("  ").unwrap_err().contains("empty"));
        assert!(parse_ladder("99999999999999999999999").is_err());
        assert!(parse_ladder("512 512").unwrap_err().contains("twice"));
    }

    #[test]
    fn models_and_fake_oom_entries() {
        assert_eq!(parse_models("a,b c").unwrap(), vec!["a", "b", "c"]);
        assert!(parse_models(" , ").is_err());
        assert!(parse_models("a a").is_err());
        assert_eq!(
            parse_fake_oom("synthetic:tiny:512, m:0").unwrap(),
            vec![("synthetic:tiny".to_string(), 512), ("m".to_string(), 0)]
        );
        assert!(parse_fake_oom("synthetic:tiny").unwrap_err().contains("`synthetic:tiny`"));
        assert!(parse_fake_oom(":5").is_err());
        assert!(parse_fake_oom("m:5k").is_err());
        assert!(parse_fake_oom("").unwrap().is_empty());
    }

    #[test]
    fn token_counts_leave_a_timed_step() {
        let t = |max_tokens, warmup_tokens| {
            CellTemplate { max_tokens, warmup_tokens, named: Named { models: false, prompts: false } }
                .validate()
        };
        assert!(t(32, 4).is_ok() && t(2, 0).is_ok() && t(6, 4).is_ok());
        assert!(t(0, 0).unwrap_err().contains("--max-tokens 0"));
        assert!(t(5, 4).unwrap_err().contains("expected a warm-up below 4"));
        // Counts at the top of the range are refused, not overflowed.
        assert!(t(u64::MAX, u64::MAX).is_err());
        assert!(t(u64::MAX, u64::MAX - 2).is_ok());
    }

    #[test]
    fn the_grid_is_model_major_and_knows_what_was_named() {
        let models = vec!["a".to_string(), "b".to_string()];
        let prompts = vec![Prompt::Tokens(1), Prompt::Tokens(2)];
        let mut t =
            CellTemplate { max_tokens: 4, warmup_tokens: 1, named: Named { models: true, prompts: false } };
        let plan = Plan::grid(&models, &prompts, &t);
        let labels: Vec<String> = plan.cells.iter().map(Cell::label).collect();
        assert_eq!(labels, ["a@1", "a@2", "b@1", "b@2"]);
        assert!(plan.cells.iter().all(|c| !c.named_for(Status::Context)));
        assert!(plan.cells.iter().all(|c| c.named_for(Status::MissingModel)));
        t.named.prompts = true;
        assert!(Plan::grid(&models, &prompts, &t).cells.iter().all(|c| c.named_for(Status::Context)));
        t.named.models = false;
        assert!(Plan::grid(&models, &prompts, &t).cells.iter().all(|c| !c.named_for(Status::MissingModel)));
        let text = Plan::grid(&models, &[Prompt::Text("hi".into())], &t);
        assert_eq!(text.cells[0].layer_len(), 0);
        assert_eq!(text.cells[0].prompt_target_len(), None);
        assert!(text.lengths.is_empty());
    }
}
