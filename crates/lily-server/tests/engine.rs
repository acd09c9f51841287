//! The engine side of the server without HTTP: the worker on a scripted model
//! (events split into reasoning / content / tool calls, log-probabilities,
//! cancellation, failures), the job queue, steering for `tool_choice`, which
//! steps a backend may choose on the device, and the API key comparison.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use lily_engine::assets::TextAssets;
use lily_engine::generate::{generate, FinishReason, GenerateRequest, Model, Picked};
use lily_engine::sampling::{GenerationConfig, Logprobs, Sampler, SamplingParams};
use lily_engine::sequences::CacheOptions;
use lily_model::chat_template::ChatTemplate;
use lily_model::tokenizer::Tokenizer;
use lily_server::engine::{
    worker, CancelGuard, EngineShared, Job, JobEvent, JobQueue, OutputMode, Piece, PushError,
};
use lily_server::http::key_matches;
use lily_server::metrics::Metrics;
use lily_server::steer::{Steered, Steering};
use serde_json::json;

const VOCAB: usize = 248_320;
const IM_END: u32 = 248_046;

/// Emits a fixed token sequence (then repeats its last token); `fail_at`
/// makes decode fail (or panic) at that step.
struct Scripted {
    script: Vec<u32>,
    fail_at: Option<(usize, bool)>,
}

impl Model for Scripted {
    type State = (usize, usize);
    fn new_state(&self) -> Result<(usize, usize)> {
        Ok((0, 0))
    }
    fn prefill(&self, tokens: &[u32], st: &mut (usize, usize)) -> Result<Vec<f32>> {
        let p = st.1 + tokens.len();
        *st = (p, p);
        Ok(self.logits(0))
    }
    fn decode(&self, _t: u32, st: &mut (usize, usize)) -> Result<Vec<f32>> {
        st.1 += 1;
        let i = st.1 - st.0;
        if let Some((at, panic)) = self.fail_at {
            if i == at {
                if panic {
                    panic!("scripted panic");
                }
                bail!("scripted failure");
            }
        }
        Ok(self.logits(i))
    }
    fn position(&self, st: &(usize, usize)) -> usize {
        st.1
    }
    fn reset(&self, st: &mut (usize, usize)) -> Result<()> {
        *st = (0, 0);
        Ok(())
    }
    type Snapshot = (usize, usize);
    fn snapshot(&self, st: &(usize, usize)) -> Result<(usize, usize)> {
        Ok(*st)
    }
    fn restore(&self, snap: &(usize, usize), st: &mut (usize, usize)) -> Result<()> {
        *st = *snap;
        Ok(())
    }
    fn snapshot_bytes(&self, _: &(usize, usize)) -> usize {
        16
    }
}

impl Scripted {
    fn logits(&self, i: usize) -> Vec<f32> {
        let mut l = vec![0.0; VOCAB];
        l[self.script[i.min(self.script.len() - 1)] as usize] = 10.0;
        l
    }
}

fn assets() -> TextAssets {
    TextAssets {
        tokenizer: Tokenizer::builtin(),
        template: ChatTemplate::builtin(),
        generation: GenerationConfig::qwen_default(),
    }
}

fn shared(cap: usize) -> Arc<EngineShared> {
    Arc::new(EngineShared {
        queue: JobQueue::new(cap),
        metrics: Metrics::default(),
        abort_all: AtomicBool::new(false),
    })
}

fn job(
    output: OutputMode,
    max_tokens: usize,
) -> (
    Job,
    tokio::sync::mpsc::UnboundedReceiver<JobEvent>,
    CancelGuard,
) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let guard = CancelGuard(Arc::new(AtomicBool::new(false)));
    let j = Job {
        prompt: vec![1, 2, 3],
        sampling: SamplingParams::greedy(),
        max_tokens,
        stop: vec![],
        output,
        steering: Steering {
            eos: vec![IM_END],
            ..Default::default()
        },
        logprobs: None,
        events: tx,
        cancel: guard.0.clone(),
        received: Instant::now(),
        queued: None,
    };
    (j, rx, guard)
}

/// Runs the worker over the given jobs (the queue is closed first, so it
/// ends), with a prompt cache.
fn run<M: Model>(model: &M, sh: &Arc<EngineShared>, jobs: Vec<Job>) {
    for j in jobs {
        sh.queue.push(j).unwrap();
    }
    sh.queue.close();
    worker(model, &assets(), sh, CacheOptions::mib(16));
}

fn drain(rx: &mut tokio::sync::mpsc::UnboundedReceiver<JobEvent>) -> Vec<JobEvent> {
    let mut v = Vec::new();
    while let Ok(e) = rx.try_recv() {
        v.push(e);
    }
    v
}

fn pieces(evs: &[JobEvent]) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::new();
    for e in evs {
        if let JobEvent::Delta { piece: Some(p), .. } = e {
            match (out.last_mut(), p) {
                (Some(Piece::Reasoning(a)), Piece::Reasoning(b)) => a.push_str(b),
                (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(b),
                _ => out.push(p.clone()),
            }
        }
    }
    out
}

fn script(text: &str, eos: bool) -> Vec<u32> {
    let mut s = Tokenizer::builtin().encode(text).unwrap();
    if eos {
        s.push(IM_END);
    }
    s
}

#[test]
fn chat_output_is_split_into_reasoning_content_and_tool_calls() {
    let text = "Think first.\n</think>\n\nCalling.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
    let model = Scripted {
        script: script(text, true),
        fail_at: None,
    };
    let tools = vec![
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}),
    ];
    let sh = shared(4);
    let (mut j, mut rx, _g) = job(
        OutputMode::Chat {
            in_reasoning: true,
            tools: Some(tools),
        },
        200,
    );
    j.logprobs = Some(2);
    run(&model, &sh, vec![j]);
    let evs = drain(&mut rx);
    let p = pieces(&evs);
    assert_eq!(p.len(), 3, "{p:?}");
    assert_eq!(p[0], Piece::Reasoning("Think first.".into()));
    assert_eq!(p[1], Piece::Content("Calling.\n".into()));
    let Piece::ToolCall(c) = &p[2] else {
        panic!("{p:?}")
    };
    assert_eq!(c.name, "get_weather");
    assert_eq!(c.arguments_json(), r#"{"city":"Paris","days":3}"#);
    let Some(JobEvent::Done(o)) = evs.last() else {
        panic!("no Done: {evs:?}")
    };
    assert_eq!(
        (o.finish, o.tool_calls, o.prompt_tokens),
        (FinishReason::Stop, 1, 3)
    );
    assert_eq!(o.completion_tokens, script(text, false).len());
    // One log-probability per generated token, across the events.
    let n_lp: usize = evs
        .iter()
        .map(|e| match e {
            JobEvent::Delta { logprobs, .. } => logprobs.len(),
            JobEvent::Done(o) => o.logprobs.len(),
            _ => 0,
        })
        .sum();
    assert_eq!(n_lp, o.completion_tokens);
    assert_eq!(
        sh.metrics.generation_tokens.load(Ordering::Relaxed) as usize,
        o.completion_tokens
    );
    assert_eq!(sh.metrics.ttft.count(), 1);
}

#[test]
fn raw_output_and_token_limit() {
    let model = Scripted {
        script: script("one two three four five six seven", false),
        fail_at: None,
    };
    let sh = shared(4);
    let (j, mut rx, _g) = job(OutputMode::Raw, 3);
    run(&model, &sh, vec![j]);
    let evs = drain(&mut rx);
    assert_eq!(pieces(&evs), vec![Piece::Content("one two three".into())]);
    let Some(JobEvent::Done(o)) = evs.last() else {
        panic!()
    };
    assert_eq!((o.finish, o.completion_tokens), (FinishReason::Length, 3));
}

#[test]
fn a_cancelled_job_stops_and_the_next_one_runs() {
    let model = Scripted {
        script: script("a b c d e f g h i j k l m n o p", false),
        fail_at: None,
    };
    let sh = shared(4);
    let (j1, mut rx1, g1) = job(OutputMode::Raw, 1000);
    let (j2, mut rx2, _g2) = job(OutputMode::Raw, 2);
    let (j3, rx3, _g3) = job(OutputMode::Raw, 5);
    drop(g1); // the client went away before the job started
    drop(rx3); // this client's stream was dropped: sending fails, the job stops
    run(&model, &sh, vec![j1, j2, j3]);
    assert!(drain(&mut rx1).is_empty());
    assert!(matches!(drain(&mut rx2).last(), Some(JobEvent::Done(_))));
    assert!(sh
        .metrics
        .render(0, 4)
        .contains("lily_requests_finished_total{finish_reason=\"cancelled\"} 2"));
    assert_eq!(sh.metrics.running.load(Ordering::SeqCst), 0);
}

#[test]
fn engine_errors_and_panics_fail_only_their_job() {
    for panic in [false, true] {
        let model = Scripted {
            script: script("x y z w", false),
            fail_at: Some((2, panic)),
        };
        let sh = shared(4);
        let (j1, mut rx1, _g1) = job(OutputMode::Raw, 10);
        let (j2, mut rx2, _g2) = job(OutputMode::Raw, 1);
        run(&model, &sh, vec![j1, j2]);
        let e1 = drain(&mut rx1);
        match e1.last() {
            Some(JobEvent::Failed {
                message,
                shutdown: false,
            }) => {
                assert!(
                    message.contains(if panic {
                        "panicked"
                    } else {
                        "scripted failure"
                    }),
                    "{message}"
                )
            }
            other => panic!("{other:?}"),
        }
        // The failure at step 2 does not touch a job that needs one token.
        assert!(matches!(drain(&mut rx2).last(), Some(JobEvent::Done(_))));
    }
}

#[test]
fn abort_all_fails_running_and_queued_jobs_as_shutdown() {
    let model = Scripted {
        script: script("a b c d e f", false),
        fail_at: None,
    };
    let sh = shared(4);
    sh.abort_all.store(true, Ordering::SeqCst);
    let (j1, mut rx1, _g1) = job(OutputMode::Raw, 10);
    run(&model, &sh, vec![j1]);
    assert!(matches!(
        drain(&mut rx1).last(),
        Some(JobEvent::Failed { shutdown: true, .. })
    ));
}

#[test]
fn queue_is_bounded_skips_cancelled_jobs_and_closes() {
    let q = JobQueue::new(2);
    let (a, _ra, ga) = job(OutputMode::Raw, 1);
    let (b, _rb, _gb) = job(OutputMode::Raw, 1);
    let (c, _rc, _gc) = job(OutputMode::Raw, 1);
    let (c2, _rc2, _gc2) = job(OutputMode::Raw, 1);
    q.push(a).unwrap();
    q.push(b).unwrap();
    assert_eq!(q.push(c).unwrap_err(), PushError::Full);
    drop(ga); // a's client leaves: its place frees up
    assert_eq!(q.push(c2).unwrap(), 1);
    assert_eq!(q.len(), 2);
    q.close();
    let (d, _rd, _gd) = job(OutputMode::Raw, 1);
    assert_eq!(q.push(d).unwrap_err(), PushError::Closed);
    assert!(q.pop().is_some() && q.try_pop().is_some());
    assert!(q.pop().is_none());
}

#[test]
fn queue_pop_waits_for_a_job() {
    let q = Arc::new(JobQueue::new(2));
    let q2 = q.clone();
    let t = std::thread::spawn(move || q2.pop().map(|j| j.max_tokens));
    std::thread::sleep(Duration::from_millis(50));
    let (a, _ra, _ga) = job(OutputMode::Raw, 7);
    q.push(a).unwrap();
    assert_eq!(t.join().unwrap(), Some(7));
}

/// A model that always wants to end at once: `tool_choice` steering must
/// still produce the call's opening, after the reasoning when thinking.
#[test]
fn steering_forces_the_tool_call_prefix() {
    let tok = Tokenizer::builtin();
    let think_end = tok.token_id("</think>");
    let eos_first = Scripted {
        script: vec![IM_END],
        fail_at: None,
    };
    let prefix = tok.encode("<tool_call>\n<function=get_weather>\n").unwrap();
    let plan = Steering {
        answer_prefix: Some(prefix.clone()),
        in_reasoning: false,
        think_end,
        tool_call_open: tok.token_id("<tool_call>"),
        eos: vec![IM_END],
        ..Default::default()
    };
    let req = GenerateRequest {
        prompt: vec![1],
        sampling: SamplingParams::greedy(),
        max_tokens: 50,
        stop_ids: vec![IM_END],
        stop_strings: vec![],
    };
    let g = generate(
        &Steered {
            inner: &eos_first,
            plan: &plan,
        },
        &tok,
        &req,
        &mut |_| true,
    )
    .unwrap();
    assert_eq!(g.tokens, prefix);
    assert_eq!(g.finish, FinishReason::Stop);

    // Thinking: EOS is banned during the reasoning; the prefix follows `</think>`.
    let mut s = tok.encode("hmm").unwrap();
    s.push(think_end.unwrap());
    s.push(IM_END);
    let thinker = Scripted {
        script: s.clone(),
        fail_at: None,
    };
    let plan = Steering {
        in_reasoning: true,
        answer_prefix: Some(tok.encode("\n\n<tool_call>\n<function=").unwrap()),
        ..plan
    };
    let g = generate(
        &Steered {
            inner: &thinker,
            plan: &plan,
        },
        &tok,
        &req,
        &mut |_| true,
    )
    .unwrap();
    let text = tok.decode(&g.tokens, false).unwrap();
    assert!(
        text.starts_with("hmm</think>\n\n<tool_call>\n<function="),
        "{text:?}"
    );

    // Without a prefix owed, the model's EOS is kept.
    let free = Steering {
        eos: vec![IM_END],
        ..Default::default()
    };
    let g = generate(
        &Steered {
            inner: &eos_first,
            plan: &free,
        },
        &tok,
        &req,
        &mut |_| true,
    )
    .unwrap();
    assert!(g.tokens.is_empty());
}

#[test]
fn test_script_forces_the_whole_output() {
    let tok = Tokenizer::builtin();
    let m = Scripted {
        script: script("ignored model output", false),
        fail_at: None,
    };
    let forced = tok.encode("exactly this").unwrap();
    let plan = Steering {
        script: Some(forced.clone()),
        eos: vec![IM_END],
        ..Default::default()
    };
    let req = GenerateRequest {
        prompt: vec![1],
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: 5,
            seed: Some(1),
            ..SamplingParams::greedy()
        },
        max_tokens: 50,
        stop_ids: vec![IM_END],
        stop_strings: vec![],
    };
    let g = generate(
        &Steered {
            inner: &m,
            plan: &plan,
        },
        &tok,
        &req,
        &mut |_| true,
    )
    .unwrap();
    assert_eq!(g.text, "exactly this");
    assert_eq!(g.finish, FinishReason::Stop);
}

#[test]
fn logprobs_are_a_log_softmax() {
    let tok = Tokenizer::builtin();
    let mut logits = vec![0.0f32; VOCAB];
    logits[5] = 3.0;
    logits[7] = 2.0;
    logits[VOCAB - 1] = 100.0; // a padding row past the tokenizer: ignored
    let lp = lily_server::engine::token_logprob(&tok, 7, &Logprobs::of(&logits, tok.len(), 7, 3));
    let z: f64 = 3f64.exp() + 2f64.exp() + (tok.len() - 2) as f64;
    assert!(
        (lp.logprob as f64 - (2.0 - z.ln())).abs() < 1e-4,
        "{}",
        lp.logprob
    );
    assert_eq!(lp.top.len(), 3);
    assert_eq!(lp.top[0].0, tok.decode(&[5], false).unwrap());
    assert!(lp.top[0].1 > lp.top[1].1 && lp.top[1].1 >= lp.top[2].1);
    // One-hot (forced) logits: 0 for the token, -9999 (not -inf) for the rest.
    let mut hot = vec![f32::NEG_INFINITY; VOCAB];
    hot[9] = 0.0;
    let lp = lily_server::engine::token_logprob(&tok, 9, &Logprobs::of(&hot, tok.len(), 9, 2));
    assert_eq!(lp.logprob, 0.0);
    assert_eq!(lp.top[1].1, -9999.0);
}

#[test]
fn api_key_comparison() {
    assert!(key_matches(b"secret-key", b"secret-key"));
    assert!(!key_matches(b"secret-kez", b"secret-key"));
    assert!(!key_matches(b"secret", b"secret-key"));
    assert!(!key_matches(b"secret-key-and-more", b"secret-key"));
    assert!(!key_matches(b"", b"secret-key"));
}

/// A backend that chooses tokens itself (as the GPU does): its logits say
/// one thing, its own choice another, so the output shows which path ran.
struct Chooser {
    host: Scripted,
    device: Vec<u32>,
    /// (steps that returned logits, steps that returned a chosen id)
    calls: std::cell::Cell<(usize, usize)>,
}

impl Chooser {
    fn new(host: &str, device: &str) -> Chooser {
        Chooser {
            host: Scripted {
                script: script(host, true),
                fail_at: None,
            },
            device: script(device, true),
            calls: Default::default(),
        }
    }
    fn logit_step(&self) {
        let (l, p) = self.calls.get();
        self.calls.set((l + 1, p));
    }
    /// The device's choice, with one-hot log-probabilities when asked.
    fn pick(&self, st: &(usize, usize), lp: Option<usize>) -> Picked {
        let (l, p) = self.calls.get();
        self.calls.set((l, p + 1));
        let id = self.device[(st.1 - st.0).min(self.device.len() - 1)];
        Picked {
            id,
            logprobs: lp.map(|n| Logprobs::forced(id, VOCAB, n)),
        }
    }
}

impl Model for Chooser {
    type State = (usize, usize);
    fn new_state(&self) -> Result<(usize, usize)> {
        Ok((0, 0))
    }
    fn prefill(&self, tokens: &[u32], st: &mut (usize, usize)) -> Result<Vec<f32>> {
        self.logit_step();
        self.host.prefill(tokens, st)
    }
    fn decode(&self, t: u32, st: &mut (usize, usize)) -> Result<Vec<f32>> {
        self.logit_step();
        self.host.decode(t, st)
    }
    fn position(&self, st: &(usize, usize)) -> usize {
        st.1
    }
    fn reset(&self, st: &mut (usize, usize)) -> Result<()> {
        self.host.reset(st)
    }
    type Snapshot = (usize, usize);
    fn snapshot(&self, st: &(usize, usize)) -> Result<(usize, usize)> {
        self.host.snapshot(st)
    }
    fn restore(&self, snap: &(usize, usize), st: &mut (usize, usize)) -> Result<()> {
        self.host.restore(snap, st)
    }
    fn snapshot_bytes(&self, snap: &(usize, usize)) -> usize {
        self.host.snapshot_bytes(snap)
    }
    fn prefill_pick(
        &self,
        tokens: &[u32],
        st: &mut (usize, usize),
        _: &mut Sampler,
        lp: Option<usize>,
    ) -> Result<Picked> {
        let p = st.1 + tokens.len();
        *st = (p, p);
        Ok(self.pick(st, lp))
    }
    fn decode_pick(
        &self,
        _t: u32,
        st: &mut (usize, usize),
        _: &mut Sampler,
        lp: Option<usize>,
    ) -> Result<Picked> {
        st.1 += 1;
        Ok(self.pick(st, lp))
    }
}

/// The backend chooses, log-probabilities or not: they come back with its
/// choice (no logits to the host).
#[test]
fn the_worker_lets_the_backend_choose_with_or_without_logprobs() {
    for logprobs in [None, Some(1)] {
        let model = Chooser::new("from logits", "from the device");
        let sh = shared(4);
        let (mut j, mut rx, _g) = job(OutputMode::Raw, 50);
        j.logprobs = logprobs;
        run(&model, &sh, vec![j]);
        let evs = drain(&mut rx);
        let n = script("from the device", false).len();
        assert_eq!(pieces(&evs), vec![Piece::Content("from the device".into())]);
        assert_eq!(
            model.calls.get(),
            (0, script("from the device", true).len())
        );
        match logprobs {
            None => {}
            Some(_) => {
                let Some(JobEvent::Done(o)) = evs.last() else {
                    panic!("{evs:?}")
                };
                let lp: usize = evs
                    .iter()
                    .map(|e| {
                        if let JobEvent::Delta { logprobs, .. } = e {
                            logprobs.len()
                        } else {
                            0
                        }
                    })
                    .sum();
                assert_eq!(lp + o.logprobs.len(), n);
            }
        }
    }
}

/// Steering keeps the device's choice on free steps, replaces it on forced
/// ones (the model still runs), and takes the logits where it must change
/// them (end-of-sequence ids banned until a call is made).
#[test]
fn steering_chooses_on_the_device_where_it_can() {
    let tok = Tokenizer::builtin();
    let req = GenerateRequest {
        prompt: vec![1],
        sampling: SamplingParams::greedy(),
        max_tokens: 50,
        stop_ids: vec![IM_END],
        stop_strings: vec![],
    };
    let steered = |m: &Chooser, plan: &Steering| {
        generate(&Steered { inner: m, plan }, &tok, &req, &mut |_| true).unwrap()
    };

    let free = Steering {
        eos: vec![IM_END],
        ..Default::default()
    };
    let m = Chooser::new("from logits", "from the device");
    assert_eq!(steered(&m, &free).text, "from the device");
    assert_eq!(m.calls.get().0, 0);

    // the test hook forces every step: the device runs each, its choice is dropped
    let forced = Steering {
        script: Some(tok.encode("forced").unwrap()),
        ..free.clone()
    };
    let m = Chooser::new("from logits", "from the device");
    let g = steered(&m, &forced);
    assert_eq!(g.text, "forced");
    assert_eq!(m.calls.get(), (0, g.tokens.len() + 1));

    // tool_choice: EOS is banned (host logits) until the forced prefix, then free again
    let prefix = tok.encode("<tool_call>\n<function=f>\n").unwrap();
    let plan = Steering {
        answer_prefix: Some(prefix.clone()),
        tool_call_open: tok.token_id("<tool_call>"),
        ..free.clone()
    };
    let m = Chooser {
        device: [prefix.clone(), script("x y", true)].concat(),
        ..Chooser::new("", "")
    };
    let g = steered(&m, &plan);
    assert_eq!(g.text, "<tool_call>\n<function=f>\nx y");
    assert_eq!(m.calls.get(), (0, g.tokens.len() + 1));
    let thinking = Steering {
        in_reasoning: true,
        think_end: tok.token_id("</think>"),
        ..plan
    };
    let m = Chooser::new("hmm</think>", "ignored");
    let g = steered(&m, &thinking);
    assert!(
        g.text.starts_with("hmm</think><tool_call>\n<function=f>\n"),
        "{:?}",
        g.text
    );
    // the reasoning (EOS banned) came from the logits, the answer from the device
    let reasoning = tok.encode("hmm</think>").unwrap().len();
    assert_eq!(m.calls.get().0, reasoning);
}
