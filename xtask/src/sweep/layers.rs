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
    Report(Box<EstimateReport>),
    /// The engine refused the cell by rule (exit 2), with its reason.
    ByRule(String),
    /// The engine found no model where the cell names one (exit 2, `model not found:`).
    MissingModel(String),
    /// The estimate failed otherwise, with the reason.
    Failed(String),
}

/// The memory a GPU backend's cells allocate from, as the harness knows it: what the
/// estimate layer prices a cell's peak against on the device, in place of the engine's
/// verdict (`fits`), which may be against host memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceBudget {
    /// The device's memory, or the memory limit when that is smaller.
    pub bytes: u64,
    /// Where the figure comes from, for the skip's reason.
    pub what: String,
}

impl DeviceBudget {
    /// The budget of `device` (a GPU as nvidia-smi names it) with `memory` bytes, under
    /// the memory limit `limit` (`--memory-limit` or `KILN_MEMORY_LIMIT`) when smaller.
    pub fn new(device: &str, memory: u64, limit: Option<u64>) -> DeviceBudget {
        match limit {
            Some(l) if l < memory => DeviceBudget {
                bytes: l,
                what: format!("the memory limit, below the {memory} bytes of {device}"),
            },
            _ => DeviceBudget { bytes: memory, what: format!("the memory of {device}") },
        }
    }
}

/// The estimate layer's verdict: the model's presence and the context first (rules, as the
/// engine answers them), then the budget unless the layer
/// is turned off (`--no-estimate`). With the layer off, a failed estimate does not stop the
/// cell: the user asked for the real run. The budget is `device`'s when the cells run on
/// a GPU whose memory is known, else the engine's own (its `fits`, against the pool's
/// limit).
pub fn judge_estimate(
    facts: &EstimateFacts,
    estimate_on: bool,
    device: Option<&DeviceBudget>,
) -> Option<Skip> {
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
            if let (true, Some(d)) = (estimate_on, device) {
                if r.total_bytes <= d.bytes {
                    return None;
                }
                return Some(Skip::new(
                    Status::OomEstimate,
                    format!(
                        "estimated peak {} bytes (weights {}, kv {}, scratch {}) is above the budget of {} bytes ({})",
                        r.total_bytes, r.weights_bytes, r.kv_bytes, r.scratch_bytes, d.bytes, d.what
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
            expert_slots: None,
            experts_bytes: None,
            moe_layers: None,
            moe_experts: None,
            moe_top_k: None,
            expert_slot_bytes: None,
            device: None,
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
            demand_bytes: None,
            source_csv: "s".into(),
            device: Some("dev".into()),
        }
    }

    #[test]
    fn estimate_context_comes_before_the_budget_and_survives_no_estimate() {
        let over = EstimateFacts::Report(Box::new(report(100, 30, 128, false)));
        assert_eq!(judge_estimate(&over, true, None).unwrap().status, Status::Context);
        assert_eq!(judge_estimate(&over, false, None).unwrap().status, Status::Context);
        let big = EstimateFacts::Report(Box::new(report(100, 28, 128, false)));
        assert_eq!(judge_estimate(&big, true, None).unwrap().status, Status::OomEstimate);
        assert_eq!(judge_estimate(&big, false, None), None);
        let fine = EstimateFacts::Report(Box::new(report(100, 28, 128, true)));
        assert_eq!(judge_estimate(&fine, true, None), None);
        let failed = EstimateFacts::Failed("boom".into());
        assert_eq!(judge_estimate(&failed, true, None).unwrap().status, Status::Estimate);
        assert_eq!(judge_estimate(&failed, false, None), None);
        let rule = EstimateFacts::ByRule("bad".into());
        assert_eq!(judge_estimate(&rule, false, None).unwrap().status, Status::Unsupported);
        let missing = EstimateFacts::MissingModel("model not found: x".into());
        assert_eq!(judge_estimate(&missing, false, None).unwrap().status, Status::MissingModel);
        // The engine's own verdict stands, whatever the numbers beside it say.
        let mut trusted = report(100, 28, 128, true);
        trusted.within_context = false;
        let skip = judge_estimate(&EstimateFacts::Report(Box::new(trusted)), true, None).unwrap();
        assert_eq!(skip.status, Status::Context);
        assert!(skip.reason.contains("context of 128 tokens"), "{}", skip.reason);
        assert_eq!(judge_estimate(&EstimateFacts::NotApplicable, true, None), None);
    }

    #[test]
    fn on_a_gpu_the_budget_is_the_devices_memory_not_the_hosts() {
        const GIB: u64 = 1 << 30;
        let h200 = DeviceBudget::new("NVIDIA H200 (143771 MiB)", 143771 << 20, None);
        assert_eq!(h200.bytes, 143771 << 20);
        assert_eq!(h200.what, "the memory of NVIDIA H200 (143771 MiB)");
        // The limit counts only when smaller than the device.
        let limited = DeviceBudget::new("G", 100 * GIB, Some(GIB));
        assert_eq!(limited.bytes, GIB);
        assert!(limited.what.starts_with("the memory limit"), "{}", limited.what);
        assert_eq!(DeviceBudget::new("G", 100 * GIB, Some(200 * GIB)).bytes, 100 * GIB);
        // A peak above host memory (the engine's limit: fits false) but within the GPU's
        // memory runs; one above the GPU's is skipped although the engine saw no limit.
        let mut host_limited = report(100, 28, 128, false);
        (host_limited.total_bytes, host_limited.weights_bytes) = (100 * GIB, 100 * GIB - 50);
        host_limited.memory_limit_bytes = Some(24 * GIB);
        let facts = EstimateFacts::Report(Box::new(host_limited.clone()));
        assert_eq!(judge_estimate(&facts, true, None).unwrap().status, Status::OomEstimate);
        assert_eq!(judge_estimate(&facts, true, Some(&h200)), None);
        let mut unlimited = host_limited;
        (unlimited.total_bytes, unlimited.weights_bytes) = (200 * GIB, 200 * GIB - 50);
        (unlimited.memory_limit_bytes, unlimited.fits) = (None, true);
        let facts = EstimateFacts::Report(Box::new(unlimited));
        assert_eq!(judge_estimate(&facts, true, None), None);
        let skip = judge_estimate(&facts, true, Some(&h200)).unwrap();
        assert_eq!(skip.status, Status::OomEstimate);
        assert!(
            skip.reason
                .ends_with("the budget of 150754820096 bytes (the memory of NVIDIA H200 (143771 MiB))"),
            "{}",
            skip.reason
        );
        // --no-estimate turns the device budget off too; the context rule still holds.
        assert_eq!(judge_estimate(&facts, false, Some(&h200)), None);
        let over = EstimateFacts::Report(Box::new(report(100, 30, 128, true)));
        assert_eq!(judge_estimate(&over, true, Some(&h200)).unwrap().status, Status::Context);
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
