//! The scheduler: one thread owning the engine, every KV cache and the prompt cache.
//! Handlers send it [`Job`]s over a channel and read [`Event`]s back.
//!
//! Each step it takes new jobs, drops the ones whose client went away, admits waiting
//! jobs first come first served while a slot is free and the memory plan allows, and
//! then runs ONE forward holding every decoding slot's next token (M = B rows through the
//! quantized kernels) together with prefill chunks of the slots still reading their
//! prompts, at most `prefill_chunk` prompt tokens per step in all. Tokens are sampled
//! and sent as soon as the forward returns. With nothing to do it blocks on the channel.
//!
//! Speculative slots (`--spec-slots`, held by the first decoding requests that ask for
//! speculation, or by every request with `--speculative`) leave the joint forward: after
//! it, each runs its own verify forward of K + 1 positions through
//! `kiln_model::speculative`, so a verify block never shares a forward with other
//! sequences. A stream the exactness gate declines returns to the joint forward.
//!
//! A request for its prompt's log-probabilities (`echo` with `logprobs`) prefills whole
//! in its own forward, every row's logits computed, through the function `kiln score`
//! uses ([`kiln_model::logprobs::score_sequence`]). A job whose prompt another slot is
//! still prefilling waits for it and then adopts its KV prefix, as the choices of an
//! `n > 1` request do.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::Instant;

use kiln_core::{MemoryPool, Tag};
use kiln_model::speculative::{
    DraftModel, Drafter, ExactnessGate, GateKey, PromptLookup, SpecStats, SpecStream,
};
use kiln_model::{
    BackendEngine, EngineOptions, KvDtype, LoadedModel, Logits, Penalizer, Sampler, SeqCache, SeqChunk,
    WorkspaceShape,
};
use tokio::sync::mpsc::UnboundedSender;

use crate::api::GenerationRequest;
use crate::metrics::Metrics;
use crate::prompt_cache::PromptCache;

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The model sampled an end-of-sequence token (or a stop string matched).
    Stop,
    /// `max_tokens` were generated.
    Length,
}

impl FinishReason {
    /// The OpenAI name.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What the scheduler tells a handler about its job.
#[derive(Debug)]
pub enum Event {
    /// The job has a slot; `cached_tokens` of its prompt came from the prompt cache.
    Started {
        /// Prompt tokens adopted from the prompt cache.
        cached_tokens: usize,
    },
    /// A sampled token (EOS is never sent).
    Token(u32),
    /// The log-probability of the token the next [`Event::Token`] carries, sent just
    /// before it when the request asks for `logprobs`.
    Logprob(TokenLogprob),
    /// The log-probabilities of the prompt's tokens after the first, sent after
    /// [`Event::Started`] when the request asks for `prompt_logprobs`.
    PromptLogprobs(Vec<TokenLogprob>),
    /// The request held a speculative slot: its drafted and accepted tokens, sent just
    /// before [`Event::Done`].
    Speculation {
        /// Tokens drafted and checked by a verify.
        drafted: u64,
        /// Of those, tokens accepted.
        accepted: u64,
    },
    /// The request's output was constrained: the masks computed for it so far and their
    /// time, sent before each [`Event::Token`] and just before [`Event::Done`] (each
    /// replaces the last).
    Structured {
        /// Token masks computed (one per sampled token, and one for a final EOS).
        masks: u64,
        /// Nanoseconds computing and applying them.
        mask_nanos: u64,
    },
    /// Generation ended.
    Done(FinishReason),
    /// The job failed; nothing more follows.
    Failed(Failure),
}

/// A token's log-probability under the model's own distribution (the raw logits'
/// log-softmax: before logit bias, penalties and temperature) and the most likely
/// alternatives there.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprob {
    /// `token`'s entry in the log-probability row `lp`, with `top` alternatives.
    pub fn of(lp: &[f32], token: u32, top: usize) -> Self {
        TokenLogprob { token, logprob: lp[token as usize], top: kiln_model::logprobs::top_logprobs(lp, top) }
    }
}

/// A request handed to the scheduler.
pub struct Job {
    /// What to generate.
    pub request: GenerationRequest,
    /// Where events go; dropping the receiver cancels the job at the next step.
    pub events: UnboundedSender<Event>,
}

/// What handlers and the shutdown path send the scheduler.
pub enum Command {
    /// Run a job.
    Submit(Job),
    /// Fail every job now (the shutdown grace ran out).
    CancelAll,
    /// Stop the thread once the current step is done.
    Stop,
}

/// How the scheduler runs.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerOptions {
    /// Slots: sequences decoded together at most.
    pub parallel: usize,
    /// Prompt tokens run per step over all prefilling slots; 0 runs every prompt whole.
    pub prefill_chunk: usize,
    /// Byte budget of the prompt cache; 0 disables it.
    pub prompt_cache_bytes: u64,
    /// Every request asks for speculation, not only those sending `"speculative": true`.
    pub speculative: bool,
    /// Slots that may decode speculatively at once.
    pub spec_slots: usize,
    /// Tokens drafted per verify (K).
    pub draft_tokens: usize,
}

/// A job holding a slot.
struct Slot<'m, C> {
    job: Job,
    cache: C,
    sampler: Sampler,
    /// Logit bias and penalties with the sequence's token counts, when the request has
    /// any; such a slot never decodes speculatively.
    penalizer: Option<Penalizer>,
    /// The slot's logits row after the penalizer and the structured-output mask.
    adjusted: Vec<f32>,
    /// The structured-output grammar's state, when the request constrains its output;
    /// such a slot never decodes speculatively.
    matcher: Option<Box<crate::structured::Guide>>,
    /// Masks computed for the slot, and their nanoseconds.
    masks: (u64, u64),
    /// The log-softmax of the slot's last logits row, when it asks for log-probabilities.
    logprobs: Vec<f32>,
    /// Prompt tokens in the cache.
    prefilled: usize,
    /// Tokens sampled and sent.
    generated: Vec<u32>,
    /// KV bytes the memory plan set aside for the whole sequence.
    planned_bytes: u64,
    /// Admission order, to pick whom to fail on an out-of-memory.
    admitted: u64,
    done: Option<Outcome>,
    /// The speculative stream while the slot holds a speculative slot.
    spec: Option<SpecStream<'m>>,
    /// Counts of the speculation, once the slot held a speculative slot.
    spec_stats: Option<SpecStats>,
}

enum Outcome {
    Finished(FinishReason),
    Cancelled,
    Failed(Failure),
}

impl<C: SeqCache> Slot<'_, C> {
    fn decoding(&self) -> bool {
        self.prefilled == self.job.request.prompt.len()
    }

    /// The tokens the cache holds, in order.
    fn cached_tokens(&self) -> Vec<u32> {
        let prompt = &self.job.request.prompt;
        let mut t = Vec::with_capacity(self.cache.len());
        t.extend_from_slice(&prompt[..self.cache.len().min(prompt.len())]);
        let fed = self.cache.len().saturating_sub(prompt.len());
        t.extend_from_slice(&self.generated[..fed]);
        t
    }
}

/// The workspace a step of `parallel` decoding slots plus a prefill chunk of `chunk`
/// tokens needs (or a verify of `verify` positions); `None` when it overflows.
fn workspace_shape(parallel: usize, chunk: usize, verify: usize) -> Option<WorkspaceShape> {
    Some(WorkspaceShape { rows: parallel.checked_add(chunk)?.max(verify), logit_rows: parallel.max(verify) })
}

/// The refusal of a `--parallel` whose workspace does not fit in `room` bytes (what the
/// memory limit leaves beside the weights), naming the flag and the slots that would fit.
fn too_many_slots(
    config: &kiln_model::ModelConfig,
    parallel: usize,
    chunk: usize,
    verify: usize,
    room: u64,
) -> kiln_model::ModelError {
    let fits = |p: usize| {
        workspace_shape(p, chunk, verify).and_then(|s| s.checked_bytes(config)).is_some_and(|b| b <= room)
    };
    // The workspace grows by one activation row and one logit row per slot.
    let per_slot = 4 * (WorkspaceShape::values_per_row(config) as u64 + config.vocab_size as u64);
    let mut most = usize::try_from(room / per_slot.max(1)).unwrap_or(usize::MAX).min(parallel);
    while most > 0 && !fits(most) {
        most -= 1;
    }
    let need = workspace_shape(parallel, chunk, verify)
        .and_then(|s| s.checked_bytes(config))
        .map_or_else(|| "more than 2^64".to_string(), |b| b.to_string());
    let accepted = if most == 0 {
        "not even 1 slot fits: lower --prefill-chunk or raise --memory-limit".to_string()
    } else {
        format!("accepted values are 1 to {most} here (or lower --prefill-chunk, or raise --memory-limit)")
    };
    kiln_model::ModelError::InvalidArgument {
        what: "--parallel".into(),
        message: format!(
            "{parallel} slots with --prefill-chunk {chunk} need a workspace of {need} bytes, past the {room} \
             bytes the memory limit leaves beside the weights: {accepted}"
        ),
    }
}

/// What one slot contributes to a forward.
#[derive(Clone, Copy)]
enum Part {
    Decode,
    Prefill(usize),
}

/// The scheduler's state over an engine of any backend; [`Scheduler::run`] is its loop.
pub struct Scheduler<'m, B: BackendEngine> {
    model: &'m LoadedModel,
    engine: B,
    /// The CPU pool: a draft model's engine counts its memory here.
    pool: MemoryPool,
    /// How the engine runs (a draft model's engine runs the same way).
    engine_options: EngineOptions,
    kv_dtype: KvDtype,
    options: SchedulerOptions,
    metrics: Arc<Metrics>,
    eos: Vec<u32>,
    waiting: std::collections::VecDeque<Job>,
    slots: Vec<Slot<'m, B::Cache>>,
    draft: Option<&'m LoadedModel>,
    gate: ExactnessGate,
    model_name: String,
    prompt_cache: PromptCache<B::Cache>,
    admitted: u64,
}

impl<'m, B: BackendEngine> Scheduler<'m, B> {
    /// A scheduler over `engine`, its workspace sized for the largest step now. `draft`
    /// is the draft model of speculative slots (prompt lookup when none), run on the CPU
    /// through `pool` with `engine_options`; the exactness gate's policy is read from the
    /// environment.
    pub fn new(
        model: &'m LoadedModel,
        mut engine: B,
        engine_options: EngineOptions,
        draft: Option<&'m LoadedModel>,
        pool: &MemoryPool,
        options: SchedulerOptions,
        metrics: Arc<Metrics>,
    ) -> kiln_model::Result<Self> {
        let parallel = options.parallel.max(1);
        let verify = options.draft_tokens + 1;
        let room = engine.memory_limit().saturating_sub(engine.memory_stats().live_bytes);
        let shape = workspace_shape(parallel, options.prefill_chunk, verify)
            .filter(|s| s.checked_bytes(&model.config).is_some_and(|b| b <= room))
            .ok_or_else(|| too_many_slots(&model.config, parallel, options.prefill_chunk, verify, room))?;
        engine.reserve(shape, model.config.max_position_embeddings)?;
        if let Some(d) = draft {
            kiln_model::speculative::check_vocabulary(d, model.config.vocab_size)?;
        }
        let gate = ExactnessGate::from_env()?;
        let eos = eos_tokens(model);
        Ok(Scheduler {
            model,
            engine,
            pool: pool.clone(),
            engine_options,
            kv_dtype: engine_options.kv_dtype,
            options: SchedulerOptions { parallel, ..options },
            metrics,
            eos,
            waiting: Default::default(),
            slots: Vec::with_capacity(parallel),
            draft,
            gate,
            model_name: model.source.display_path(),
            prompt_cache: PromptCache::new(options.prompt_cache_bytes),
            admitted: 0,
        })
    }

    /// Runs until [`Command::Stop`] or until every sender is gone.
    pub fn run(mut self, commands: Receiver<Command>) {
        loop {
            if self.slots.is_empty() && self.waiting.is_empty() {
                // Idle: block until there is work, no polling.
                match commands.recv() {
                    Ok(c) => {
                        if !self.command(c) {
                            return;
                        }
                    }
                    Err(_) => return,
                }
            }
            loop {
                match commands.try_recv() {
                    Ok(c) => {
                        if !self.command(c) {
                            return;
                        }
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            }
            self.step();
        }
    }

    /// Handles one command; false means stop.
    fn command(&mut self, c: Command) -> bool {
        match c {
            Command::Submit(job) => self.waiting.push_back(job),
            Command::CancelAll => {
                for job in self.waiting.drain(..) {
                    let _ = job.events.send(Event::Failed(Failure::ShuttingDown));
                    self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
                }
                for s in &mut self.slots {
                    s.done = Some(Outcome::Failed(Failure::ShuttingDown));
                }
                self.retire();
            }
            Command::Stop => return false,
        }
        true
    }

    /// One scheduling step.
    fn step(&mut self) {
        let t = Instant::now();
        for s in &mut self.slots {
            if s.job.events.is_closed() {
                s.done = Some(Outcome::Cancelled);
            }
        }
        self.retire();
        self.admit();
        let scored = self.score_prompts();
        let forward = self.forward();
        let verify = self.speculate();
        let forward = [scored, forward, verify].into_iter().flatten().reduce(|a, b| a + b);
        let step = t.elapsed();
        if let Some(f) = forward {
            self.metrics.step_nanos.fetch_add(step.as_nanos() as u64, Ordering::Relaxed);
            self.metrics.forward_nanos.fetch_add(f.as_nanos() as u64, Ordering::Relaxed);
        }
    }

    /// Admits waiting jobs in order while a slot is free and the memory plan allows.
    fn admit(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|j| !j.events.is_closed());
        let mut left = before - self.waiting.len();
        while self.slots.len() < self.options.parallel {
            let Some(job) = self.waiting.front() else { break };
            if self.shares_a_prefilling_prompt(&job.request.prompt) {
                // Its prefix is adopted once that prefill is done: a step or a few.
                break;
            }
            let need = self.engine.cache_bytes_for(self.capacity(&job.request));
            match self.plan_room(need) {
                Room::Fits => {}
                Room::Later if !self.slots.is_empty() => break,
                Room::Later => {
                    // Nothing runs that could free memory: waiting would never end.
                    let job = self.waiting.pop_front().expect("a front job");
                    left += 1;
                    let _ = job.events.send(Event::Failed(Failure::MemoryLimit(format!(
                        "the request needs {need} bytes of KV cache and the memory limit of {} bytes \
                         (--memory-limit) leaves no room for it",
                        self.engine.memory_limit()
                    ))));
                    continue;
                }
                Room::Never(message) => {
                    let job = self.waiting.pop_front().expect("a front job");
                    left += 1;
                    let _ = job.events.send(Event::Failed(Failure::MemoryLimit(message)));
                    continue;
                }
            }
            let job = self.waiting.pop_front().expect("a front job");
            left += 1;
            self.start(job, need);
        }
        self.metrics.queue_depth.fetch_sub(left as u64, Ordering::Relaxed);
        self.publish();
    }

    /// Positions a request's cache holds at most: its prompt and its tokens, within the
    /// model's context.
    fn capacity(&self, request: &GenerationRequest) -> usize {
        let tokens = request.prompt.len().saturating_add(request.max_tokens);
        tokens.clamp(1, self.model.config.max_position_embeddings)
    }

    /// Whether a slot still prefilling holds the same prompt, long enough to share.
    fn shares_a_prefilling_prompt(&self, prompt: &[u32]) -> bool {
        prompt.len() > crate::prompt_cache::MIN_PREFIX_TOKENS
            && self.slots.iter().any(|s| !s.decoding() && s.job.request.prompt == prompt)
    }

    /// Whether `need` more KV bytes fit now, after evicting prompt-cache entries, or ever.
    fn plan_room(&mut self, need: u64) -> Room {
        let limit = self.engine.memory_limit();
        let stats = self.engine.memory_stats();
        let tag = |t: Tag| stats.by_tag.get(t.as_str()).map_or(0, |s| s.live);
        let fixed = tag(Tag::Weights) + tag(Tag::Scratch) + tag(Tag::Experts) + tag(Tag::Other);
        if fixed.saturating_add(need) > limit {
            return Room::Never(format!(
                "the request needs {need} bytes of KV cache (prompt plus max_tokens), but with the weights and \
                 workspace ({fixed} bytes) that is past the memory limit of {limit} bytes (--memory-limit); \
                 send a shorter prompt or a lower max_tokens"
            ));
        }
        loop {
            let held: u64 = self.slots.iter().map(|s| s.cache.bytes()).sum();
            let planned: u64 = self.slots.iter().map(|s| s.planned_bytes.max(s.cache.bytes())).sum();
            let live = self.engine.memory_stats().live_bytes;
            let committed = live.saturating_sub(held).saturating_add(planned);
            if committed.saturating_add(need) <= limit {
                return Room::Fits;
            }
            if !self.prompt_cache.evict_one() {
                return Room::Later;
            }
        }
    }

    /// Gives `job` a slot, adopting a cached prefix when one matches.
    fn start(&mut self, mut job: Job, planned_bytes: u64) {
        let sampler = match Sampler::new(job.request.sampling, self.model.config.vocab_size) {
            Ok(s) => s,
            Err(e) => {
                let _ = job.events.send(Event::Failed(Failure::Sampling(e)));
                return;
            }
        };
        let adjust = &job.request.adjust;
        let penalizer = (!adjust.is_off()).then(|| Penalizer::new(adjust.clone(), &job.request.prompt));
        let matcher = job.request.constraint.as_mut().and_then(|c| c.take_guide());
        let request = &job.request;
        if request.max_tokens == 0 && !request.prompt_logprobs {
            // Nothing to compute (an echo without log-probabilities).
            if job.events.send(Event::Started { cached_tokens: 0 }).is_ok() {
                let _ = job.events.send(Event::Done(FinishReason::Length));
            }
            return;
        }
        let capacity = self.capacity(&job.request);
        let mut cache = match self.engine.new_cache(capacity) {
            Ok(c) => c,
            Err(e) => {
                let _ = job.events.send(Event::Failed(Failure::engine(&e)));
                return;
            }
        };
        let mut cached = 0;
        // The prompt's log-probabilities need every prompt row computed: no prefix.
        if !request.prompt_logprobs {
            let prompt = &request.prompt;
            let usable = prompt.len().saturating_sub(1);
            // The longest prefix a live slot holds (a sibling choice), if it beats the
            // prompt cache's.
            let live = self
                .slots
                .iter()
                .map(|s| (s, common_prefix(&s.cached_tokens(), prompt).min(usable)))
                .filter(|&(_, n)| n >= crate::prompt_cache::MIN_PREFIX_TOKENS)
                .max_by_key(|&(_, n)| n);
            let hit = self.prompt_cache.lookup(prompt).map(|h| (h.cache, h.tokens));
            let best = match (live, hit) {
                (Some((s, n)), Some((_, m))) if n > m => Some((&s.cache, n)),
                (_, Some(h)) => Some(h),
                (Some((s, n)), None) => Some((&s.cache, n)),
                (None, None) => None,
            };
            if let Some((from, n)) = best {
                match self.engine.copy_prefix(&mut cache, from, n) {
                    Ok(()) => cached = n,
                    // The copy failed part way: start the sequence empty.
                    Err(_) => cache.truncate(0),
                }
            }
        }
        if cached > 0 {
            self.metrics.prompt_cache_hits.fetch_add(1, Ordering::Relaxed);
            self.metrics.prompt_cache_hit_tokens.fetch_add(cached as u64, Ordering::Relaxed);
        }
        if job.events.send(Event::Started { cached_tokens: cached }).is_err() {
            return;
        }
        self.admitted += 1;
        self.slots.push(Slot {
            job,
            cache,
            sampler,
            penalizer,
            adjusted: Vec::new(),
            matcher,
            masks: (0, 0),
            logprobs: Vec::new(),
            prefilled: cached,
            generated: Vec::new(),
            planned_bytes,
            admitted: self.admitted,
            done: None,
            spec: None,
            spec_stats: None,
        });
    }

    /// Runs one forward over every slot with work; returns its duration.
    fn forward(&mut self) -> Option<std::time::Duration> {
        let mut budget = match self.options.prefill_chunk {
            0 => usize::MAX,
            c => c,
        };
        let parts: Vec<Option<Part>> = self
            .slots
            .iter()
            .map(|s| {
                if s.spec.is_some() {
                    // Decodes in its own verify forward (`speculate`).
                    return None;
                }
                if s.job.request.prompt_logprobs && !s.decoding() {
                    // Prefills in its own forward (`score_prompts`).
                    return None;
                }
                if s.decoding() {
                    return Some(Part::Decode);
                }
                let left = s.job.request.prompt.len() - s.prefilled;
                let n = left.min(budget);
                budget -= n;
                (n > 0).then_some(Part::Prefill(n))
            })
            .collect();
        if parts.iter().all(Option::is_none) {
            return None;
        }
        let decode_rows = parts.iter().filter(|p| matches!(p, Some(Part::Decode))).count();
        let mut seqs: Vec<SeqChunk<'_, B::Cache>> = Vec::with_capacity(self.slots.len());
        let mut order = Vec::with_capacity(self.slots.len());
        for (i, (s, part)) in self.slots.iter_mut().zip(&parts).enumerate() {
            let tokens = match part {
                None => continue,
                Some(Part::Decode) => {
                    std::slice::from_ref(s.generated.last().expect("a decoding slot has sampled"))
                }
                Some(Part::Prefill(n)) => &s.job.request.prompt[s.prefilled..s.prefilled + n],
            };
            seqs.push(SeqChunk { cache: &mut s.cache, tokens });
            order.push(i);
        }
        let t = Instant::now();
        let result = self.engine.forward(&mut seqs, Logits::Last);
        let took = t.elapsed();
        drop(seqs);
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                // An out-of-memory fails the youngest request in the forward, not the
                // server; the others run again next step. Any other engine error fails
                // every request in the forward.
                let victims: Vec<usize> = if e.is_out_of_memory() {
                    order.iter().copied().max_by_key(|&i| self.slots[i].admitted).into_iter().collect()
                } else {
                    order.clone()
                };
                for i in victims {
                    self.slots[i].done = Some(Outcome::Failed(Failure::engine(&e)));
                }
                self.retire();
                return Some(took);
            }
        };
        if decode_rows > 0 {
            self.metrics.batch(decode_rows);
        }
        let vocab = self.model.config.vocab_size;
        for (row, &i) in order.iter().enumerate() {
            let s = &mut self.slots[i];
            if let Some(Part::Prefill(n)) = parts[i] {
                s.prefilled += n;
                self.metrics.prefill_tokens.fetch_add(n as u64, Ordering::Relaxed);
                if !s.decoding() {
                    continue;
                }
            }
            sample_and_send(s, &logits[row * vocab..(row + 1) * vocab], &self.eos, &self.metrics);
        }
        self.retire();
        Some(took)
    }

    /// Prefills every newly admitted slot that asks for its prompt's log-probabilities,
    /// each in its own forward with every row's logits, sends them, and samples the first
    /// token from the last row. Returns the time spent.
    fn score_prompts(&mut self) -> Option<std::time::Duration> {
        let mut took = None;
        for s in &mut self.slots {
            if !s.job.request.prompt_logprobs || s.prefilled != 0 || s.done.is_some() {
                continue;
            }
            let prompt = &s.job.request.prompt;
            let top = s.job.request.logprobs.unwrap_or(0);
            let mut scored = Vec::with_capacity(prompt.len().saturating_sub(1));
            let mut last = Vec::new();
            let t = Instant::now();
            let result = kiln_model::logprobs::score_sequence(
                &mut self.engine,
                &mut s.cache,
                prompt,
                0,
                |pos, row, lp| match prompt.get(pos + 1) {
                    Some(&next) => scored.push(TokenLogprob::of(lp, next, top)),
                    None => last.extend_from_slice(row),
                },
            );
            *took.get_or_insert(std::time::Duration::ZERO) += t.elapsed();
            if let Err(e) = result {
                s.done = Some(Outcome::Failed(Failure::engine(&e)));
                continue;
            }
            s.prefilled = prompt.len();
            self.metrics.prefill_tokens.fetch_add(prompt.len() as u64, Ordering::Relaxed);
            if s.job.events.send(Event::PromptLogprobs(scored)).is_err() {
                s.done = Some(Outcome::Cancelled);
            } else if s.job.request.max_tokens == 0 {
                s.done = Some(Outcome::Finished(FinishReason::Length));
            } else {
                sample_and_send(s, &last, &self.eos, &self.metrics);
            }
        }
        self.retire();
        took
    }

    /// Hands free speculative slots to decoding slots that ask for one, then runs one
    /// speculative step (draft, gate, verify forward) for every slot holding one, and
    /// sends the tokens it accepted. Returns the time spent in those steps.
    fn speculate(&mut self) -> Option<std::time::Duration> {
        let key =
            GateKey { model: self.model_name.clone(), k: self.options.draft_tokens, kv_dtype: self.kv_dtype };
        let declined = self.gate.decided(&key).is_some_and(|o| !o.speculates());
        let mut held = self.slots.iter().filter(|s| s.spec.is_some()).count();
        for s in &mut self.slots {
            if held >= self.options.spec_slots || declined {
                break;
            }
            // The speculative stream samples the model's rows as they are: a request with
            // a logit bias or penalties decodes in the joint forward.
            // So does one asking for log-probabilities, which need every row, and one
            // whose output a grammar constrains.
            let wants = (self.options.speculative || s.job.request.speculative)
                && s.penalizer.is_none()
                && s.job.request.logprobs.is_none()
                && s.matcher.is_none();
            if !wants || s.spec.is_some() || s.spec_stats.is_some() || s.done.is_some() || !s.decoding() {
                continue;
            }
            let Some((&pending, fed)) = s.generated.split_last() else { continue };
            let drafter: Box<dyn Drafter + 'm> = match self.draft {
                Some(d) => {
                    match DraftModel::new(
                        d,
                        self.model.config.vocab_size,
                        &self.pool,
                        self.engine_options,
                        s.sampler.params(),
                    ) {
                        Ok(d) => Box::new(d),
                        Err(e) => {
                            s.done = Some(Outcome::Failed(Failure::engine(&e)));
                            continue;
                        }
                    }
                }
                None => Box::new(PromptLookup::default()),
            };
            let mut history = s.job.request.prompt.clone();
            history.extend_from_slice(fed);
            s.spec = Some(SpecStream::new(drafter, key.clone(), &history, pending));
            s.spec_stats = Some(SpecStats::default());
            held += 1;
        }
        let mut took = None;
        for s in &mut self.slots {
            let Some(stream) = s.spec.as_mut() else { continue };
            if s.done.is_some() {
                continue;
            }
            let want = s.job.request.max_tokens.saturating_sub(s.generated.len()).max(1);
            let before = stream.stats();
            let wide_before = kiln_core::wide::qmv_wide_enabled();
            let t = Instant::now();
            let result = stream.step(&mut self.engine, &mut s.cache, &mut s.sampler, &mut self.gate, want);
            *took.get_or_insert(std::time::Duration::ZERO) += t.elapsed();
            let step = match result {
                Ok(step) => step,
                Err(e) => {
                    s.done = Some(Outcome::Failed(Failure::engine(&e)));
                    continue;
                }
            };
            if let Some(report) = &step.gate {
                if report.outcome.is_warning() {
                    tracing::warn!("{}", report.message());
                } else {
                    tracing::info!("{}", report.message());
                }
            }
            let wide_after = kiln_core::wide::qmv_wide_enabled();
            if wide_after != wide_before {
                // The start-up kernel line no longer says what every stream runs.
                let changed = kiln_protocol::KernelChangedLine {
                    qmv_wide: wide_after,
                    qmv_wide_pinned: kiln_core::wide::qmv_wide_pinned_by_operator(),
                };
                tracing::warn!("{changed}");
            }
            let after = stream.stats();
            let m = &self.metrics;
            m.spec_drafted_tokens.fetch_add(after.drafted - before.drafted, Ordering::Relaxed);
            m.spec_accepted_tokens.fetch_add(after.accepted - before.accepted, Ordering::Relaxed);
            m.spec_verifies.fetch_add(after.verifies - before.verifies, Ordering::Relaxed);
            s.spec_stats = Some(after);
            if stream.declined() {
                // Back to the joint forward, from the same state.
                s.spec = None;
            }
            for token in step.tokens {
                if self.eos.contains(&token) && !s.job.request.ignore_eos {
                    s.done = Some(Outcome::Finished(FinishReason::Stop));
                    break;
                }
                s.generated.push(token);
                m.generated_tokens.fetch_add(1, Ordering::Relaxed);
                if s.job.events.send(Event::Token(token)).is_err() {
                    s.done = Some(Outcome::Cancelled);
                    break;
                }
                if s.generated.len() >= s.job.request.max_tokens {
                    s.done = Some(Outcome::Finished(FinishReason::Length));
                    break;
                }
            }
            // The cache holds every token but the last one sent; drop positions of
            // tokens accepted past a stop.
            let keep = s.job.request.prompt.len() + s.generated.len().saturating_sub(1);
            if s.cache.len() > keep {
                s.cache.truncate(keep);
            }
        }
        self.retire();
        took
    }

    /// Ends every slot with an outcome: tells its handler, and keeps its cache in the
    /// prompt cache unless it failed.
    fn retire(&mut self) {
        let mut i = 0;
        while i < self.slots.len() {
            if self.slots[i].done.is_none() {
                i += 1;
                continue;
            }
            let mut s = self.slots.swap_remove(i);
            let keep = match s.done.take() {
                Some(Outcome::Finished(r)) => {
                    if let Some(st) = s.spec_stats {
                        let _ = s
                            .job
                            .events
                            .send(Event::Speculation { drafted: st.drafted, accepted: st.accepted });
                    }
                    if s.matcher.is_some() {
                        let (masks, mask_nanos) = s.masks;
                        let _ = s.job.events.send(Event::Structured { masks, mask_nanos });
                    }
                    let _ = s.job.events.send(Event::Done(r));
                    true
                }
                Some(Outcome::Failed(e)) => {
                    let _ = s.job.events.send(Event::Failed(e));
                    false
                }
                Some(Outcome::Cancelled) | None => true,
            };
            if keep && self.options.prompt_cache_bytes > 0 {
                let tokens = s.cached_tokens();
                self.prompt_cache.insert(tokens, s.cache);
            }
        }
        // Keep admission order so FIFO fairness holds within the forward too.
        self.slots.sort_by_key(|s| s.admitted);
        self.publish();
    }

    fn publish(&self) {
        self.metrics.active_slots.store(self.slots.len() as u64, Ordering::Relaxed);
        let speculating = self.slots.iter().filter(|s| s.spec.is_some()).count();
        self.metrics.spec_active_slots.store(speculating as u64, Ordering::Relaxed);
        self.metrics.prompt_cache_bytes.store(self.prompt_cache.bytes(), Ordering::Relaxed);
    }
}

/// Samples `s`'s next token from its logits `row` (after its penalizer), and sends it
/// (with its log-probability when asked for) unless it ends the sequence.
fn sample_and_send<C>(s: &mut Slot<'_, C>, row: &[f32], eos: &[u32], metrics: &Metrics) {
    let token = if s.penalizer.is_none() && s.matcher.is_none() {
        s.sampler.sample(row)
    } else {
        s.adjusted.clear();
        s.adjusted.extend_from_slice(row);
        if let Some(p) = &s.penalizer {
            p.apply(&mut s.adjusted);
        }
        if let Some(m) = &mut s.matcher {
            let t = Instant::now();
            let masked = m.mask(&mut s.adjusted);
            let took = t.elapsed();
            metrics.mask(took);
            s.masks.0 += 1;
            s.masks.1 += took.as_nanos() as u64;
            if let Err(message) = masked {
                s.done = Some(Outcome::Failed(Failure::Grammar { field: m.field(), message }));
                return;
            }
        }
        s.sampler.sample(&s.adjusted)
    };
    // The mask allows EOS only where the grammar may end.
    if eos.contains(&token) && (!s.job.request.ignore_eos || s.matcher.is_some()) {
        s.done = Some(Outcome::Finished(FinishReason::Stop));
        return;
    }
    if let Some(p) = &mut s.penalizer {
        p.observe(token);
    }
    let mut grammar_ended = false;
    if let Some(m) = &mut s.matcher {
        if let Err(message) = m.consume_token(token) {
            s.done = Some(Outcome::Failed(Failure::Grammar { field: m.field(), message }));
            return;
        }
        grammar_ended = m.is_stopped();
    }
    s.generated.push(token);
    metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
    if let Some(top) = s.job.request.logprobs {
        // The model's distribution, before bias, penalties and temperature (vLLM's default).
        s.logprobs.resize(row.len(), 0.0);
        kiln_model::logprobs::log_softmax(row, &mut s.logprobs);
        if s.job.events.send(Event::Logprob(TokenLogprob::of(&s.logprobs, token, top))).is_err() {
            s.done = Some(Outcome::Cancelled);
            return;
        }
    }
    // The masks' totals so far travel ahead of each token: a stop string can end the
    // request on the handler's side before the scheduler's last count arrives.
    let counted = s.matcher.is_none()
        || s.job.events.send(Event::Structured { masks: s.masks.0, mask_nanos: s.masks.1 }).is_ok();
    if !counted || s.job.events.send(Event::Token(token)).is_err() {
        s.done = Some(Outcome::Cancelled);
    } else if grammar_ended {
        s.done = Some(Outcome::Finished(FinishReason::Stop));
    } else if s.generated.len() >= s.job.request.max_tokens {
        s.done = Some(Outcome::Finished(FinishReason::Length));
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

enum Room {
    Fits,
    Later,
    Never(String),
}

/// The tokens that end a sequence: the config's EOS ids and the chat template's end
/// token, as `kiln generate` stops.
pub fn eos_tokens(model: &LoadedModel) -> Vec<u32> {
    let mut eos = model.config.eos_token_ids.clone();
    let template_eos = model.chat_template.as_ref().and_then(|t| t.eos_token.as_deref());
    eos.extend(template_eos.and_then(|t| model.tokenizer.token_to_id(t)));
    eos
}

/// Why the scheduler failed a job. The scheduler says what happened; `http` alone turns
/// it into the client's status and body.
#[derive(Debug)]
pub enum Failure {
    /// The shutdown grace period ran out before the job finished.
    ShuttingDown,
    /// The memory limit leaves no room for the request's KV cache, now or ever: how much
    /// it needs and what to change.
    MemoryLimit(String),
    /// The sampler refused the request's sampling parameters.
    Sampling(kiln_model::ModelError),
    /// The engine ran out of memory in a forward (its `out of memory:` message).
    OutOfMemory(String),
    /// Any other engine error, with its message.
    Engine(String),
    /// A structured-output grammar failed mid-sequence (the mask left no token, or
    /// rejected the one sampled, or the grammar outgrew the parser's limits): the
    /// request's field and what failed.
    Grammar {
        /// The request field the constraint came from.
        field: &'static str,
        /// llguidance's reason, its first line.
        message: String,
    },
}

impl Failure {
    /// A failed engine call: an out-of-memory, or any other engine error.
    pub(crate) fn engine(e: &kiln_model::ModelError) -> Failure {
        if e.is_out_of_memory() {
            Failure::OutOfMemory(e.to_string())
        } else {
            Failure::Engine(e.to_string())
        }
    }
}
