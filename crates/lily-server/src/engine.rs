//! The engine side of the server: a bounded queue of jobs and one worker
//! thread that owns the model and runs them.
//!
//! A [`Job`] is everything the engine needs to generate for one request, plus
//! the request's way back: an unbounded channel of [`JobEvent`]s (so a slow
//! reader never stalls the engine; what it holds is bounded by the request's
//! token limit) and a cancel flag, set when the client goes away (the HTTP
//! side drops its [`CancelGuard`]) and checked at every generated token.
//!
//! The worker takes one job at a time and runs the engine's `generate` loop on
//! it. The queue is built for a batching worker to come: [`JobQueue::pop`]
//! blocks for the first job and [`JobQueue::try_pop`] takes more without
//! waiting, each job carries its own sampling, stop rules, steering and event
//! channel, and the worker's per-job code (`run_job`) depends on the model only
//! through [`Model`], so a backend that decodes many sequences per step can
//! replace the loop without touching the HTTP side.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use lily_engine::assets::TextAssets;
use lily_engine::generate::{FinishReason, GenerateRequest, Model, OnToken};
use lily_engine::parse::{Event, OutputParser, ToolCall};
use lily_engine::sampling::{Logprobs, SamplingParams};
use lily_engine::sequences::{chat_marks, CacheOptions, Sequences};
use serde_json::Value;
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::{CacheView, Metrics};
use crate::steer::{SteerState, Steered, Steering};

/// How the generated text is split.
#[derive(Clone, Debug)]
pub enum OutputMode {
    /// Chat: reasoning / content / tool calls, by [`OutputParser`].
    Chat {
        in_reasoning: bool,
        tools: Option<Vec<Value>>,
    },
    /// Completions: the text as it is (sent as [`Piece::Content`]).
    Raw,
}

pub struct Job {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub output: OutputMode,
    pub steering: Steering,
    /// Report log-probabilities, with this many alternatives per token.
    pub logprobs: Option<usize>,
    pub events: UnboundedSender<JobEvent>,
    pub cancel: Arc<AtomicBool>,
    /// When the request arrived (time to first token counts from here).
    pub received: Instant,
    /// When it joined the queue (set by `JobQueue::push`): the time before
    /// it is the request's preparation (parsing, the chat template, the
    /// tokenizer), the time after it until the engine takes it its wait.
    pub queued: Option<Instant>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
    ToolCall(ToolCall),
}

/// Log-probability of one generated token, and the most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

#[derive(Debug)]
pub enum JobEvent {
    /// New output; `logprobs` are those of the tokens generated since the last
    /// event (text can be held back for a while: a tag or stop string in the making).
    Delta {
        piece: Option<Piece>,
        logprobs: Vec<TokenLogprob>,
    },
    Done(Outcome),
    /// The engine failed on this request (or is shutting down).
    Failed {
        message: String,
        shutdown: bool,
    },
}

#[derive(Clone, Debug)]
pub struct Outcome {
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    /// leading prompt tokens the prompt cache restored
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub tool_calls: usize,
    pub logprobs: Vec<TokenLogprob>,
}

/// Sets the cancel flag when dropped: the HTTP side holds one for as long as
/// someone is waiting for the answer.
pub struct CancelGuard(pub Arc<AtomicBool>);

impl Drop for CancelGuard {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum PushError {
    Full,
    Closed,
}

/// Bounded FIFO of jobs. Jobs whose client has gone are dropped from it
/// without running, and do not count against its capacity.
pub struct JobQueue {
    inner: Mutex<QueueInner>,
    cv: Condvar,
    capacity: usize,
}

struct QueueInner {
    jobs: VecDeque<Job>,
    closed: bool,
}

impl JobQueue {
    pub fn new(capacity: usize) -> JobQueue {
        JobQueue {
            inner: Mutex::new(QueueInner {
                jobs: VecDeque::new(),
                closed: false,
            }),
            cv: Condvar::new(),
            capacity,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, QueueInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a job; on success, returns how many jobs of departed clients were
    /// dropped to make room.
    pub fn push(&self, mut job: Job) -> Result<usize, PushError> {
        job.queued = Some(Instant::now());
        let mut q = self.lock();
        if q.closed {
            return Err(PushError::Closed);
        }
        let mut dropped = 0;
        if q.jobs.len() >= self.capacity {
            let before = q.jobs.len();
            q.jobs.retain(|j| !j.cancel.load(Ordering::SeqCst));
            dropped = before - q.jobs.len();
        }
        if q.jobs.len() >= self.capacity {
            return Err(PushError::Full);
        }
        q.jobs.push_back(job);
        self.cv.notify_one();
        Ok(dropped)
    }

    /// The next job, waiting for one; `None` once the queue is closed and empty.
    pub fn pop(&self) -> Option<Job> {
        let mut q = self.lock();
        loop {
            if let Some(j) = q.jobs.pop_front() {
                return Some(j);
            }
            if q.closed {
                return None;
            }
            q = self.cv.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The next job if one is waiting (for a worker that batches).
    pub fn try_pop(&self) -> Option<Job> {
        self.lock().jobs.pop_front()
    }

    pub fn len(&self) -> usize {
        self.lock().jobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// No more jobs are taken; the worker ends once it has emptied the queue.
    pub fn close(&self) {
        self.lock().closed = true;
        self.cv.notify_all();
    }
}

/// What the worker shares with the HTTP side.
pub struct EngineShared {
    pub queue: JobQueue,
    pub metrics: Metrics,
    /// Set at the end of the shutdown grace period: every job stops at its next token.
    pub abort_all: AtomicBool,
}

/// The worker loop: runs until the queue is closed and empty. Its sequence
/// state and prompt cache (`cache`) live as long as it does.
pub fn worker<M: Model>(
    model: &M,
    assets: &TextAssets,
    shared: &EngineShared,
    cache: CacheOptions,
) {
    let mut seqs = Sequences::<SteerState<M::State>, M::Snapshot>::new(cache);
    let im_start = assets.tokenizer.token_id("<|im_start|>");
    while let Some(job) = shared.queue.pop() {
        if job.cancel.load(Ordering::SeqCst) {
            shared.metrics.finished("cancelled");
            continue;
        }
        if shared.abort_all.load(Ordering::SeqCst) {
            let _ = job.events.send(JobEvent::Failed {
                message: "the server is shutting down".into(),
                shutdown: true,
            });
            shared.metrics.finished("aborted");
            continue;
        }
        shared.metrics.running.fetch_add(1, Ordering::SeqCst);
        let started = Instant::now();
        if let Some(q) = job.queued {
            shared.metrics.prepare.observe(q - job.received);
            shared.metrics.queue_wait.observe(started - q);
        }
        let res = std::panic::catch_unwind(AssertUnwindSafe(|| {
            run_job(model, assets, &job, shared, &mut seqs, im_start, started)
        }));
        if res.is_err() {
            // a panic may have left the state or a snapshot half written
            seqs.drop_all();
        }
        *shared
            .metrics
            .cache
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = CacheView::of(&seqs);
        shared.metrics.running.fetch_sub(1, Ordering::SeqCst);
        shared.metrics.e2e.observe(job.received.elapsed());
        let failure = match res {
            Ok(Ok(reason)) => {
                shared.metrics.finished(reason);
                None
            }
            Ok(Err(e)) => Some(format!("{e:#}")),
            Err(p) => Some(
                match p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                {
                    Some(m) => format!("the engine panicked: {m}"),
                    None => "the engine panicked".to_string(),
                },
            ),
        };
        if let Some(message) = failure {
            shared.metrics.finished("error");
            let _ = job.events.send(JobEvent::Failed {
                message,
                shutdown: false,
            });
        }
    }
}

/// Runs one job; returns the finish reason for the metrics.
fn run_job<M: Model>(
    model: &M,
    assets: &TextAssets,
    job: &Job,
    shared: &EngineShared,
    seqs: &mut Sequences<SteerState<M::State>, M::Snapshot>,
    im_start: Option<u32>,
    started: Instant,
) -> anyhow::Result<&'static str> {
    let tok = &assets.tokenizer;
    let req = GenerateRequest {
        prompt: job.prompt.clone(),
        sampling: job.sampling.clone(),
        max_tokens: job.max_tokens,
        stop_ids: assets.generation.eos_token_ids.clone(),
        stop_strings: job.stop.clone(),
    };
    let steered = Steered {
        inner: model,
        plan: &job.steering,
    };
    let mut parser = match &job.output {
        OutputMode::Chat {
            in_reasoning,
            tools,
        } => Some(OutputParser::new(*in_reasoning, tools.as_deref())),
        OutputMode::Raw => None,
    };
    // Log-probabilities of tokens whose text has not gone out yet.
    let pending_lp = std::cell::RefCell::new(Vec::<TokenLogprob>::new());
    let mut tool_calls = 0usize;
    let mut last_token: Option<Instant> = None;
    let metrics = &shared.metrics;
    let cancelled = || job.cancel.load(Ordering::SeqCst) || shared.abort_all.load(Ordering::SeqCst);
    metrics
        .prompt_tokens
        .fetch_add(job.prompt.len() as u64, Ordering::Relaxed);

    // `logits` is there when log-probabilities were asked for (then every
    // step brings its logits to the host; otherwise the backend may choose
    // on the device and only the id comes back).
    let mut on_token = |id: u32, lp: Option<&Logprobs>| -> bool {
        if cancelled() {
            return false;
        }
        let now = Instant::now();
        match last_token {
            None => {
                metrics.ttft.observe(now - job.received);
                metrics.first_token.observe(now - started);
            }
            Some(t) => metrics.itl.observe(now - t),
        }
        last_token = Some(now);
        metrics.generation_tokens.fetch_add(1, Ordering::Relaxed);
        if let Some(lp) = lp {
            pending_lp.borrow_mut().push(token_logprob(tok, id, lp));
        }
        true
    };
    let mut sent_ok = true;
    let mut send = |pieces: Vec<Piece>, tool_calls: &mut usize| -> bool {
        for p in pieces {
            if matches!(p, Piece::ToolCall(_)) {
                *tool_calls += 1;
            }
            let ev = JobEvent::Delta {
                piece: Some(p),
                logprobs: std::mem::take(&mut *pending_lp.borrow_mut()),
            };
            sent_ok &= job.events.send(ev).is_ok();
        }
        sent_ok
    };
    let to_pieces = |evs: Vec<Event>| -> Vec<Piece> {
        evs.into_iter()
            .map(|e| match e {
                Event::Reasoning(s) => Piece::Reasoning(s),
                Event::Content(s) => Piece::Content(s),
                Event::ToolCall(c) => Piece::ToolCall(c),
            })
            .collect()
    };
    let mut on_text = |piece: &str| -> bool {
        let pieces = match parser.as_mut() {
            Some(p) => to_pieces(p.push(piece)),
            None => vec![Piece::Content(piece.to_string())],
        };
        // A closed channel means nobody waits for the answer any more.
        send(pieces, &mut tool_calls) && !cancelled()
    };
    // a chat prompt is saved at its message boundaries as well
    let marks = match (&job.output, im_start) {
        (OutputMode::Chat { .. }, Some(s)) => chat_marks(&job.prompt, s),
        _ => Vec::new(),
    };
    let g = if let Some(n) = job.logprobs {
        let mut f = |id: u32, lp: &Logprobs| on_token(id, Some(lp));
        seqs.generate(
            &steered,
            tok,
            &req,
            &marks,
            OnToken::WithLogprobs(n, &mut f),
            &mut on_text,
        )?
    } else {
        let mut f = |id: u32| on_token(id, None);
        seqs.generate(
            &steered,
            tok,
            &req,
            &marks,
            OnToken::Id(&mut f),
            &mut on_text,
        )?
    };
    if g.finish == FinishReason::Cancelled {
        if shared.abort_all.load(Ordering::SeqCst) && !job.cancel.load(Ordering::SeqCst) {
            let _ = job.events.send(JobEvent::Failed {
                message: "the server is shutting down".into(),
                shutdown: true,
            });
            return Ok("aborted");
        }
        return Ok("cancelled");
    }
    let rest = match parser.as_mut() {
        Some(p) => to_pieces(p.finish()),
        None => vec![],
    };
    send(rest, &mut tool_calls);
    let lp = pending_lp.take();
    let reason = match g.finish {
        FinishReason::Length => "length",
        _ if tool_calls > 0 => "tool_calls",
        _ => "stop",
    };
    let _ = job.events.send(JobEvent::Done(Outcome {
        finish: g.finish,
        prompt_tokens: g.stats.prompt_tokens,
        cached_tokens: g.stats.cached_tokens,
        completion_tokens: g.tokens.len(),
        tool_calls,
        logprobs: lp,
    }));
    Ok(reason)
}

/// A step's log-probabilities as the API reports them: token texts, and
/// -9999 for an impossible token (JSON has no infinity).
pub fn token_logprob(
    tok: &lily_model::tokenizer::Tokenizer,
    id: u32,
    lp: &Logprobs,
) -> TokenLogprob {
    let finite = |v: f32| {
        if v.is_finite() {
            v.max(-9999.0)
        } else {
            -9999.0
        }
    };
    let text = |t: u32| tok.decode(&[t], false).unwrap_or_default();
    TokenLogprob {
        token: text(id),
        logprob: finite(lp.chosen),
        top: lp.top.iter().map(|&(t, v)| (text(t), finite(v))).collect(),
    }
}

/// Keeps the worker's thread handle and waits for it at the end.
pub struct WorkerHandle {
    pub thread: std::thread::JoinHandle<()>,
}

impl WorkerHandle {
    /// Wait at most `timeout` for the worker to end.
    pub fn join_timeout(self, timeout: Duration) -> bool {
        let t0 = Instant::now();
        while !self.thread.is_finished() {
            if t0.elapsed() > timeout {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.thread.join();
        true
    }
}
