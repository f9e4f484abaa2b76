//! The layers that decide whether a cell runs, in the documented order: model present,
//! estimate (context and budget), within-sweep backstop, persistent record, fake-OOM hook.
//! They decide from facts (a report, a status, the record) and never look at the machine,
//! so the same decisions hold when the cell runs somewhere else.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Result;

use super::classify::Status;
use super::plan::Cell;
use super::record::{RecordLine, RecordView};
use kiln_protocol::EstimateReport;

/// A decision not to launch a cell.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skip {
    /// The row's status.
    pub status: Status,
    /// One line saying why, for stderr.
    pub reason: String,
}

impl Skip {
    fn new(status: Status, reason: impl Into<String>) -> Skip {
        Skip { status, reason: reason.into() }
    }
}

/// What `kiln estimate` said about a cell.
#[derive(Clone, Debug)]
pub enum EstimateFacts {
    /// The layer does not apply (a text prompt, whose token count is unknown beforehand).
    NotApplicable,
    /// The engine's prediction.
    Report(EstimateReport),
    /// The engine refused the cell by rule (exit 2), with its reason.
    ByRule(String),
    /// The engine found no model where the cell names one (exit 2, `model not found:`).
    MissingModel(String),
    /// The estimate failed otherwise, with the reason.
    Failed(String),
}

/// The estimate layer's verdict: the model's presence and the context first (rules, as the
/// engine answers them), then the budget unless the layer
/// is turned off (`--no-estimate`). With the layer off, a failed estimate does not stop the
/// cell: the user asked for the real run.
pub fn judge_estimate(facts: &EstimateFacts, estimate_on: bool) -> Option<Skip> {
    match facts {
        EstimateFacts::NotApplicable => None,
        EstimateFacts::ByRule(reason) => Some(Skip::new(Status::Unsupported, reason.clone())),
        EstimateFacts::MissingModel(reason) => Some(Skip::new(Status::MissingModel, reason.clone())),
        EstimateFacts::Failed(reason) if estimate_on => {
            Some(Skip::new(Status::Estimate, format!("kiln estimate failed: {reason}")))
        }
        EstimateFacts::Failed(_) => None,
        EstimateFacts::Report(r) => {
            // The engine's verdict: the harness does not repeat its context rule.
            if !r.within_context {
                return Some(Skip::new(
                    Status::Context,
                    format!(
                        "{} prompt plus {} generated tokens exceed the model's context of {} tokens",
                        r.prompt_tokens, r.max_tokens, r.context_length
                    ),
                ));
            }
            if estimate_on && !r.fits {
                let limit =
                    r.memory_limit_bytes.map_or_else(|| "no limit".to_string(), |b| format!("{b} bytes"));
                return Some(Skip::new(
                    Status::OomEstimate,
                    format!(
                        "estimated peak {} bytes (weights {}, kv {}, scratch {}) is above the budget of {limit}",
                        r.total_bytes, r.weights_bytes, r.kv_bytes, r.scratch_bytes
                    ),
                ));
            }
            None
        }
    }
}

/// The within-sweep monotonic backstop, keyed per model: after an OOM at length L, every
/// later cell of that model at length >= L is skipped.
#[derive(Clone, Debug, Default)]
pub struct Backstop {
    lowest_oom: BTreeMap<String, u64>,
}

impl Backstop {
    /// Notes an OOM of `model` at `len`.
    pub fn note_oom(&mut self, model: &str, len: u64) {
        let e = self.lowest_oom.entry(model.to_string()).or_insert(len);
        *e = (*e).min(len);
    }

    /// The OOM length that skips `model` at `len`, if any.
    pub fn blocks(&self, model: &str, len: u64) -> Option<u64> {
        self.lowest_oom.get(model).copied().filter(|&l| l <= len)
    }
}

/// The cells `KILN_BENCH_FAKE_OOM` names.
#[derive(Clone, Debug, Default)]
pub struct FakeOom {
    cells: BTreeSet<(String, u64)>,
}

impl FakeOom {
    /// From parsed `model:len` entries.
    pub fn new(entries: Vec<(String, u64)>) -> FakeOom {
        FakeOom { cells: entries.into_iter().collect() }
    }

    /// Whether `cell` is one of them.
    pub fn names(&self, cell: &Cell) -> bool {
        cell.prompt_target_len().is_some_and(|len| self.cells.contains(&(cell.model.clone(), len)))
    }
}

/// Layers 3 to 5 and what feeds them.
pub struct OomLayers {
    /// Layer 3.
    pub backstop: Backstop,
    /// Layer 4, read before each cell.
    pub record: RecordView,
    /// `KILN_BENCH_IGNORE_OOM_RECORD=1`: no pre-skip, appends continue.
    pub ignore_record: bool,
    /// Layer 5.
    pub fake: FakeOom,
}

impl OomLayers {
    /// The verdict of the backstop, then the record (for `device`), then the fake hook.
    /// A fake OOM comes back as `SKIP:oom`, which the caller feeds back like a real one.
    pub fn judge(&mut self, cell: &Cell, device: &str) -> Result<Option<Skip>> {
        let len = cell.layer_len();
        if let Some(at) = self.backstop.blocks(&cell.model, len) {
            return Ok(Some(Skip::new(
                Status::OomBackstop,
                format!("{} ran out of memory at length {at} earlier in this sweep", cell.model),
            )));
        }
        if !self.ignore_record
            && let Some((line, text)) = self.record.matching(&cell.model, len, device)?
        {
            return Ok(Some(Skip::new(
                Status::OomRecord,
                format!("{}:{line}: {text}", self.record.file().path().display()),
            )));
        }
        if self.fake.names(cell) {
            return Ok(Some(Skip::new(Status::Oom, "KILN_BENCH_FAKE_OOM names this cell")));
        }
        Ok(None)
    }

    /// Feeds a finished cell's status back: only an exact `SKIP:oom` reaches the backstop
    /// and the record; `line` is what would be appended. Returns whether it was appended.
    pub fn observe(
        &mut self,
        cell: &Cell,
        status: Status,
        line: impl FnOnce() -> RecordLine,
    ) -> Result<bool> {
        if status != Status::Oom {
            return Ok(false);
        }
        self.backstop.note_oom(&cell.model, cell.layer_len());
        self.record.file().append(&line())?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::super::plan::{Named, Prompt};
    use super::super::record::RecordFile;
    use super::*;

    fn cell(model: &str, len: u64) -> Cell {
        Cell {
            model: model.into(),
            prompt: Prompt::Tokens(len),
            max_tokens: 8,
            warmup_tokens: 0,
            named: Named { models: false, prompts: false },
            env: BTreeMap::new(),
            repetition: 1,
            engine: super::super::plan::Engine::Kiln,
        }
    }

    fn report(prompt: u64, max: u64, ctx: u64, fits: bool) -> EstimateReport {
        EstimateReport {
            attention: "streaming".into(),
            prefill_chunk: 0,
            within_context: prompt + max <= ctx,
            kv_dtype: None,
            workspace_bytes: None,
            attention_scores_bytes: None,
            model: "m".into(),
            model_path: "m".into(),
            prompt_tokens: prompt,
            max_tokens: max,
            weights_bytes: 10,
            kv_bytes: 20,
            scratch_bytes: 30,
            total_bytes: 60,
            memory_limit_bytes: Some(50),
            fits,
            context_length: ctx,
        }
    }

    fn record_line(model: &str, len: u64) -> RecordLine {
        RecordLine {
            model: model.into(),
            prompt_target_len: len,
            date: "d".into(),
            commit: "c".into(),
            peak_bytes: None,
            source_csv: "s".into(),
            device: Some("dev".into()),
        }
    }

    #[test]
    fn estimate_context_comes_before_the_budget_and_survives_no_estimate() {
        let over = EstimateFacts::Report(report(100, 30, 128, false));
        assert_eq!(judge_estimate(&over, true).unwrap().status, Status::Context);
        assert_eq!(judge_estimate(&over, false).unwrap().status, Status::Context);
        let big = EstimateFacts::Report(report(100, 28, 128, false));
        assert_eq!(judge_estimate(&big, true).unwrap().status, Status::OomEstimate);
        assert_eq!(judge_estimate(&big, false), None);
        let fine = EstimateFacts::Report(report(100, 28, 128, true));
        assert_eq!(judge_estimate(&fine, true), None);
        let failed = EstimateFacts::Failed("boom".into());
        assert_eq!(judge_estimate(&failed, true).unwrap().status, Status::Estimate);
        assert_eq!(judge_estimate(&failed, false), None);
        let rule = EstimateFacts::ByRule("bad".into());
        assert_eq!(judge_estimate(&rule, false).unwrap().status, Status::Unsupported);
        let missing = EstimateFacts::MissingModel("model not found: x".into());
        assert_eq!(judge_estimate(&missing, false).unwrap().status, Status::MissingModel);
        // The engine's own verdict stands, whatever the numbers beside it say.
        let mut trusted = report(100, 28, 128, true);
        trusted.within_context = false;
        let skip = judge_estimate(&EstimateFacts::Report(trusted), true).unwrap();
        assert_eq!(skip.status, Status::Context);
        assert!(skip.reason.contains("context of 128 tokens"), "{}", skip.reason);
        assert_eq!(judge_estimate(&EstimateFacts::NotApplicable, true), None);
    }

    #[test]
    fn backstop_is_monotonic_and_per_model() {
        let mut b = Backstop::default();
        b.note_oom("a", 2048);
        assert_eq!(b.blocks("a", 2048), Some(2048));
        assert_eq!(b.blocks("a", 8192), Some(2048));
        assert_eq!(b.blocks("a", 512), None);
        assert_eq!(b.blocks("b", 8192), None);
        b.note_oom("a", 8192);
        assert_eq!(b.blocks("a", 4096), Some(2048));
        b.note_oom("a", 512);
        assert_eq!(b.blocks("a", 512), Some(512));
    }

    #[test]
    fn only_an_exact_oom_feeds_backstop_and_record() {
        let dir = tempfile::tempdir().unwrap();
        let file = RecordFile::new(dir.path().join(".oom-record"));
        let mut layers = OomLayers {
            backstop: Backstop::default(),
            record: RecordView::new(file.clone()),
            ignore_record: false,
            fake: FakeOom::new(vec![("a".into(), 512)]),
        };
        let c = cell("a", 512);
        for st in Status::ALL.into_iter().filter(|&s| s != Status::Oom) {
            assert!(!layers.observe(&c, st, || record_line("a", 512)).unwrap(), "{st}");
        }
        assert!(!file.path().exists());
        assert_eq!(layers.judge(&c, "dev").unwrap().unwrap().status, Status::Oom);
        assert!(layers.observe(&c, Status::Oom, || record_line("a", 512)).unwrap());
        assert_eq!(layers.judge(&cell("a", 1024), "dev").unwrap().unwrap().status, Status::OomBackstop);
        assert_eq!(layers.judge(&cell("b", 1024), "dev").unwrap(), None);
        assert_eq!(file.read().unwrap().len(), 1);
    }

    #[test]
    fn the_record_pre_skips_unless_ignored_and_only_on_its_device() {
        let dir = tempfile::tempdir().unwrap();
        let file = RecordFile::new(dir.path().join(".oom-record"));
        file.append(&record_line("a", 2048)).unwrap();
        let mut layers = OomLayers {
            backstop: Backstop::default(),
            record: RecordView::new(file),
            ignore_record: false,
            fake: FakeOom::default(),
        };
        let skip = layers.judge(&cell("a", 4096), "dev").unwrap().unwrap();
        assert_eq!(skip.status, Status::OomRecord);
        assert!(skip.reason.ends_with(":1: a,2048,d,c,,s,dev"), "{}", skip.reason);
        assert_eq!(layers.judge(&cell("a", 1024), "dev").unwrap(), None);
        assert_eq!(layers.judge(&cell("a", 4096), "other").unwrap(), None);
        layers.ignore_record = true;
        assert_eq!(layers.judge(&cell("a", 4096), "dev").unwrap(), None);
    }
}
