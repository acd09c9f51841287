//! The HTTP side: routes, handlers, SSE streams, authentication and metrics.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Path, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::{FutureExt, Stream, StreamExt};
use lily_engine::assets::TextAssets;
use lily_engine::generate::FinishReason;
use lily_model::chat_template::RenderOptions;
use serde_json::{json, Map, Value};
use subtle::ConstantTimeEq;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::api::{
    parse_chat, parse_completion, ChatRequest, Common, CompletionRequest, Prompt, ToolChoice,
};
use crate::engine::{
    CancelGuard, EngineShared, Job, JobEvent, Outcome, OutputMode, Piece, PushError, TokenLogprob,
};
use crate::error::ApiError;
use crate::steer::Steering;
use crate::ServerConfig;

pub struct App {
    pub cfg: ServerConfig,
    pub assets: Arc<TextAssets>,
    pub engine: Arc<EngineShared>,
    pub shutting_down: AtomicBool,
    pub created: u64,
    think_end: Option<u32>,
    tool_call_open: Option<u32>,
}

type AppState = Arc<App>;

impl App {
    pub fn new(cfg: ServerConfig, assets: Arc<TextAssets>, engine: Arc<EngineShared>) -> App {
        let think_end = assets.tokenizer.token_id("</think>");
        let tool_call_open = assets.tokenizer.token_id("<tool_call>");
        App {
            cfg,
            assets,
            engine,
            shutting_down: AtomicBool::new(false),
            created: unix_now(),
            think_end,
            tool_call_open,
        }
    }

    fn check_open(&self) -> Result<(), ApiError> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(ApiError::shutting_down());
        }
        Ok(())
    }

    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m)
                if m != self.cfg.served_model_name
                    && !self.cfg.model_aliases.iter().any(|a| a == m) =>
            {
                Err(ApiError::model_not_found(m))
            }
            _ => Ok(()),
        }
    }

    /// Tokens to generate at most, after checking the prompt fits `--max-seq`.
    fn budget(
        &self,
        prompt_tokens: usize,
        max_tokens: Option<usize>,
        param: &str,
    ) -> Result<usize, ApiError> {
        let max = self.cfg.max_seq;
        if prompt_tokens >= max {
            return Err(ApiError::invalid(
                param,
                format!(
                    "This model's maximum context length is {max} tokens. However, your request has {prompt_tokens} input tokens, \
                     which leaves no room to generate. Please reduce the length of the input."
                ),
            )
            .code("context_length_exceeded"));
        }
        match max_tokens {
            Some(m) if prompt_tokens + m > max => Err(ApiError::invalid(
                "max_tokens",
                format!(
                    "This model's maximum context length is {max} tokens. However, you requested {} tokens ({prompt_tokens} in the input, \
                     {m} for the completion). Please reduce the length of the input or of the completion.",
                    prompt_tokens + m
                ),
            )
            .code("context_length_exceeded")),
            Some(m) => Ok(m),
            None => Ok(max - prompt_tokens),
        }
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        self.assets
            .tokenizer
            .encode(text)
            .map_err(|e| ApiError::bad_request(format!("{e:#}")))
    }

    fn steering(&self, common: &Common, in_reasoning: bool) -> Result<Steering, ApiError> {
        let mut s = Steering {
            in_reasoning,
            think_end: self.think_end,
            tool_call_open: self.tool_call_open,
            eos: self.assets.generation.eos_token_ids.clone(),
            ..Default::default()
        };
        let n = self.assets.tokenizer.len();
        if let Some(&(bad, _)) = common.logit_bias.iter().find(|(t, _)| *t as usize >= n) {
            return Err(ApiError::invalid(
                format!("logit_bias.{bad}"),
                format!("token id {bad} is outside the vocabulary (0..{n})"),
            ));
        }
        s.bias = common.logit_bias.clone();
        if self.cfg.test_hooks {
            if let Some(script) = &common.test_script {
                s.script = Some(self.encode(script)?);
            }
            s.delay = Duration::from_millis(common.test_delay_ms);
        }
        Ok(s)
    }

    fn submit(&self, job: Job) -> Result<(), ApiError> {
        match self.engine.queue.push(job) {
            Ok(dropped) => {
                for _ in 0..dropped {
                    self.engine.metrics.finished("cancelled");
                }
                Ok(())
            }
            Err(PushError::Full) => {
                self.engine.metrics.rejected.fetch_add(1, Ordering::Relaxed);
                Err(ApiError::queue_full(self.engine.queue.capacity()))
            }
            Err(PushError::Closed) => Err(ApiError::shutting_down()),
        }
    }
}

pub fn router(app: AppState) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route_layer(middleware::from_fn_with_state(app.clone(), auth));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::not_found("Unknown route").into_response() })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed().into_response() })
        .layer(middleware::from_fn_with_state(app.clone(), track))
        .with_state(app)
}

/// Counts every answer by route and status, and turns a panic in a handler
/// into a 500 (the server goes on).
async fn track(State(app): State<AppState>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| "unmatched".to_string());
    let resp = match AssertUnwindSafe(next.run(req)).catch_unwind().await {
        Ok(r) => r,
        Err(_) => ApiError::internal("internal error while handling the request").into_response(),
    };
    app.engine
        .metrics
        .http_request(&route, resp.status().as_u16());
    resp
}

/// `Authorization: Bearer KEY`, compared in constant time.
async fn auth(State(app): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &app.cfg.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| {
                s.get(..7)
                    .filter(|p| p.eq_ignore_ascii_case("bearer "))
                    .map(|_| s[7..].trim())
            });
        match given {
            None => {
                return ApiError::unauthorized(
                    "Missing API key: send it as the header `Authorization: Bearer KEY`",
                )
                .into_response();
            }
            Some(g) if !key_matches(g.as_bytes(), key.as_bytes()) => {
                return ApiError::unauthorized("Incorrect API key provided").into_response();
            }
            Some(_) => {}
        }
    }
    next.run(req).await
}

/// Compares `given` with `key` in time that depends only on their lengths
/// (the key's is fixed for the server's life), never on where they differ.
pub fn key_matches(given: &[u8], key: &[u8]) -> bool {
    let mut padded = vec![0u8; key.len()];
    let n = given.len().min(key.len());
    padded[..n].copy_from_slice(&given[..n]);
    let same_len = (given.len() as u64).ct_eq(&(key.len() as u64));
    bool::from(padded.as_slice().ct_eq(key) & same_len)
}

async fn health(State(app): State<AppState>) -> Response {
    if app.shutting_down.load(Ordering::SeqCst) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "shutting_down"})),
        )
            .into_response();
    }
    axum::Json(json!({"status": "ok"})).into_response()
}

async fn metrics(State(app): State<AppState>) -> Response {
    let text = app
        .engine
        .metrics
        .render(app.engine.queue.len(), app.engine.queue.capacity());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

fn model_object(app: &App) -> Value {
    json!({
        "id": app.cfg.served_model_name,
        "object": "model",
        "created": app.created,
        "owned_by": "lily",
        "max_model_len": app.cfg.max_seq,
    })
}

async fn models(State(app): State<AppState>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_object(&app)]})).into_response()
}

async fn model(State(app): State<AppState>, Path(id): Path<String>) -> Response {
    match app.check_model(Some(&id)) {
        Ok(()) => axum::Json(model_object(&app)).into_response(),
        Err(e) => e.into_response(),
    }
}

/// The body as JSON, at most `limit` bytes.
///
/// An oversized body is still read (and dropped) up to a bound before the 413
/// goes out: closing a connection with unread data resets it, and the client
/// would see a broken pipe instead of the answer.
async fn read_json(req: Request, limit: usize) -> Result<Value, ApiError> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse::<u64>().ok());
    let drain_cap = limit.saturating_mul(4).max(8 << 20);
    let mut stream = req.into_body().into_data_stream();
    let too_large = |mut stream: axum::body::BodyDataStream, mut seen: usize| async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while seen <= drain_cap {
            match tokio::time::timeout_at(deadline, stream.next()).await {
                Ok(Some(Ok(chunk))) => seen += chunk.len(),
                _ => break,
            }
        }
        Err(ApiError::too_large(limit))
    };
    if declared.is_some_and(|n| n > limit as u64) {
        return if declared.is_some_and(|n| n <= drain_cap as u64) {
            too_large(stream, 0).await
        } else {
            Err(ApiError::too_large(limit))
        };
    }
    let mut buf = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk
            .map_err(|e| ApiError::bad_request(format!("could not read the request body: {e}")))?;
        if buf.len() + chunk.len() > limit {
            let seen = buf.len() + chunk.len();
            drop(buf);
            return too_large(stream, seen).await;
        }
        buf.extend_from_slice(&chunk);
    }
    if buf.iter().all(u8::is_ascii_whitespace) {
        return Err(
            ApiError::bad_request("The request body is empty: expected a JSON object")
                .code("invalid_json"),
        );
    }
    serde_json::from_slice(&buf).map_err(|e| {
        ApiError::bad_request(format!("The request body is not valid JSON: {e}"))
            .code("invalid_json")
    })
}

static ID_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A random-looking id of `n` hex digits (not for security).
fn random_id(n: usize) -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut s = String::new();
    while s.len() < n {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(ID_COUNTER.fetch_add(1, Ordering::Relaxed));
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos(),
        );
        s.push_str(&format!("{:016x}", h.finish()));
    }
    s.truncate(n);
    s
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn usage(o: &Outcome) -> Value {
    json!({
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "total_tokens": o.prompt_tokens + o.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    })
}

fn finish_reason(o: &Outcome) -> &'static str {
    match o.finish {
        FinishReason::Length => "length",
        _ if o.tool_calls > 0 => "tool_calls",
        _ => "stop",
    }
}

fn error_frame(message: &str, shutdown: bool) -> String {
    let e = if shutdown {
        ApiError::shutting_down()
    } else {
        ApiError::internal(message)
    };
    let mut body = e.body();
    body["error"]["message"] = message.into();
    body.to_string()
}

fn failure(message: String, shutdown: bool) -> ApiError {
    if shutdown {
        let mut e = ApiError::shutting_down();
        e.message = message;
        e
    } else {
        ApiError::internal(message)
    }
}

// ------------------------------------------------------------ chat

fn tool_call_json(c: &lily_engine::parse::ToolCall, index: Option<usize>) -> Value {
    let mut m = Map::new();
    if let Some(i) = index {
        m.insert("index".into(), i.into());
    }
    m.insert("id".into(), format!("call_{}", random_id(24)).into());
    m.insert("type".into(), "function".into());
    m.insert(
        "function".into(),
        json!({"name": c.name, "arguments": c.arguments_json()}),
    );
    Value::Object(m)
}

fn chat_logprobs(lp: &[TokenLogprob]) -> Value {
    let item = |t: &str, l: f32| json!({"token": t, "logprob": l, "bytes": t.as_bytes()});
    let content: Vec<Value> = lp
        .iter()
        .map(|t| {
            let mut v = item(&t.token, t.logprob);
            v["top_logprobs"] = t.top.iter().map(|(s, l)| item(s, *l)).collect();
            v
        })
        .collect();
    json!({"content": content, "refusal": null})
}

async fn chat(State(app): State<AppState>, req: Request) -> Response {
    match chat_inner(app, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat_inner(app: AppState, req: Request) -> Result<Response, ApiError> {
    let received = Instant::now();
    app.check_open()?;
    let body = read_json(req, app.cfg.max_body_bytes).await?;
    let r = parse_chat(&body)?;
    drop(body);
    app.check_model(r.common.model.as_deref())?;
    let think = r.enable_thinking.unwrap_or(app.cfg.default_thinking);
    let app2 = app.clone();
    let (r, prompt) = tokio::task::spawn_blocking(move || {
        let p = chat_prompt(&app2, &r, think);
        (r, p)
    })
    .await
    .map_err(|e| ApiError::internal(format!("preparing the prompt failed: {e}")))?;
    let prompt = prompt?;
    let max_tokens = app.budget(prompt.len(), r.common.max_tokens, "messages")?;
    let mut steering = app.steering(&r.common, think)?;
    let prefix = match &r.tool_choice {
        ToolChoice::Named(n) => Some(format!("<tool_call>\n<function={n}>\n")),
        ToolChoice::Required => Some("<tool_call>\n<function=".to_string()),
        _ => None,
    };
    if let Some(p) = prefix {
        let p = if think { format!("\n\n{p}") } else { p };
        steering.answer_prefix = Some(app.encode(&p)?);
    }
    let tools = match r.tool_choice {
        ToolChoice::None => None,
        _ => r.tools.clone(),
    };
    let (tx, rx) = unbounded_channel();
    let guard = CancelGuard(Arc::new(AtomicBool::new(false)));
    let job = Job {
        prompt,
        sampling: r.common.sampling(&app.assets.generation.sampling)?,
        max_tokens,
        stop: r.common.stop.clone(),
        output: OutputMode::Chat {
            in_reasoning: think,
            tools,
        },
        steering,
        logprobs: r.logprobs,
        events: tx,
        cancel: guard.0.clone(),
        received,
    };
    app.submit(job)?;
    let id = format!("chatcmpl-{}", random_id(24));
    let created = unix_now();
    let model = app.cfg.served_model_name.clone();
    if r.common.stream {
        return Ok(chat_stream(rx, guard, id, created, model, &r));
    }
    chat_collect(rx, guard, id, created, model, &r).await
}

fn chat_prompt(app: &App, r: &ChatRequest, think: bool) -> Result<Vec<u32>, ApiError> {
    let opts = RenderOptions {
        add_generation_prompt: true,
        enable_thinking: think,
        preserve_thinking: r.preserve_thinking,
    };
    let tools = match r.tool_choice {
        ToolChoice::None => None,
        _ => r.tools.as_deref(),
    };
    let text = app
        .assets
        .template
        .render(&r.messages, tools, &opts)
        .map_err(|e| {
            ApiError::invalid(
                "messages",
                format!("The messages could not be rendered: {e:#}"),
            )
        })?;
    app.encode(&text)
}

async fn chat_collect(
    mut rx: UnboundedReceiver<JobEvent>,
    guard: CancelGuard,
    id: String,
    created: u64,
    model: String,
    r: &ChatRequest,
) -> Result<Response, ApiError> {
    let (mut reasoning, mut content, mut calls, mut lps) =
        (String::new(), String::new(), Vec::new(), Vec::new());
    let outcome = loop {
        match rx.recv().await {
            Some(JobEvent::Delta { piece, logprobs }) => {
                lps.extend(logprobs);
                match piece {
                    Some(Piece::Reasoning(s)) => reasoning.push_str(&s),
                    Some(Piece::Content(s)) => content.push_str(&s),
                    Some(Piece::ToolCall(c)) => calls.push(tool_call_json(&c, None)),
                    None => {}
                }
            }
            Some(JobEvent::Done(o)) => break o,
            Some(JobEvent::Failed { message, shutdown }) => return Err(failure(message, shutdown)),
            None => return Err(ApiError::internal("the engine dropped the request")),
        }
    };
    drop(guard);
    lps.extend(outcome.logprobs.iter().cloned());
    let mut message = Map::new();
    message.insert("role".into(), "assistant".into());
    message.insert(
        "content".into(),
        if content.is_empty() && !calls.is_empty() {
            Value::Null
        } else {
            content.into()
        },
    );
    message.insert(
        "reasoning_content".into(),
        if reasoning.is_empty() {
            Value::Null
        } else {
            reasoning.into()
        },
    );
    if !calls.is_empty() {
        message.insert("tool_calls".into(), Value::Array(calls));
    }
    let body = json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": Value::Object(message),
            "logprobs": if r.logprobs.is_some() { chat_logprobs(&lps) } else { Value::Null },
            "finish_reason": finish_reason(&outcome),
        }],
        "usage": usage(&outcome),
    });
    Ok(axum::Json(body).into_response())
}

/// Turns the events of one job into SSE `data:` payloads; `None` = the
/// channel closed. Returns the payloads and whether the stream is over.
type Render = Box<dyn FnMut(Option<JobEvent>) -> (Vec<String>, bool) + Send>;

/// The SSE body of a streamed answer. Dropping it (the client went away)
/// drops its [`CancelGuard`], which stops the generation at its next token.
struct EventStream {
    rx: UnboundedReceiver<JobEvent>,
    _guard: CancelGuard,
    render: Render,
    out: VecDeque<String>,
    ended: bool,
}

impl Stream for EventStream {
    type Item = Result<SseEvent, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if let Some(d) = this.out.pop_front() {
                return Poll::Ready(Some(Ok(SseEvent::default().data(d))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            match this.rx.poll_recv(cx) {
                Poll::Ready(ev) => {
                    let closed = ev.is_none();
                    let (frames, end) = (this.render)(ev);
                    this.out.extend(frames);
                    if end || closed {
                        this.out.push_back("[DONE]".to_string());
                        this.ended = true;
                    }
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

fn sse(
    rx: UnboundedReceiver<JobEvent>,
    guard: CancelGuard,
    first: Vec<String>,
    render: Render,
) -> Response {
    let stream = EventStream {
        rx,
        _guard: guard,
        render,
        out: first.into(),
        ended: false,
    };
    let mut r = Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(10)))
        .into_response();
    r.headers_mut()
        .insert("x-accel-buffering", HeaderValue::from_static("no"));
    r
}

fn chat_stream(
    rx: UnboundedReceiver<JobEvent>,
    guard: CancelGuard,
    id: String,
    created: u64,
    model: String,
    r: &ChatRequest,
) -> Response {
    let include_usage = r.common.include_usage;
    let want_lp = r.logprobs.is_some();
    let chunk = move |delta: Value, lp: Option<&[TokenLogprob]>, finish: Option<&str>| -> String {
        let mut c = json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{
                "index": 0,
                "delta": delta,
                "logprobs": match lp { Some(l) if want_lp => chat_logprobs(l), _ => Value::Null },
                "finish_reason": finish,
            }],
        });
        if include_usage {
            c["usage"] = Value::Null;
        }
        c.to_string()
    };
    let first = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        None,
        None,
    )];
    let mut n_calls = 0usize;
    let render: Render = Box::new(move |ev| match ev {
        Some(JobEvent::Delta { piece, logprobs }) => {
            let lp = Some(logprobs.as_slice());
            let delta = match piece {
                Some(Piece::Reasoning(s)) => json!({"reasoning_content": s}),
                Some(Piece::Content(s)) => json!({"content": s}),
                Some(Piece::ToolCall(c)) => {
                    n_calls += 1;
                    json!({"tool_calls": [tool_call_json(&c, Some(n_calls - 1))]})
                }
                None => json!({}),
            };
            (vec![chunk(delta, lp, None)], false)
        }
        Some(JobEvent::Done(o)) => {
            let mut frames = vec![chunk(json!({}), Some(&o.logprobs), Some(finish_reason(&o)))];
            if include_usage {
                let mut u = serde_json::from_str::<Value>(&chunk(json!({}), None, None))
                    .unwrap_or_default();
                u["choices"] = json!([]);
                u["usage"] = usage(&o);
                frames.push(u.to_string());
            }
            (frames, true)
        }
        Some(JobEvent::Failed { message, shutdown }) => {
            (vec![error_frame(&message, shutdown)], true)
        }
        None => (
            vec![error_frame("the engine dropped the request", false)],
            true,
        ),
    });
    sse(rx, guard, first, render)
}

// ------------------------------------------------------------ completions

fn completion_logprobs(lp: &[TokenLogprob], offset: &mut usize) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top = Vec::new();
    let mut offsets = Vec::new();
    for t in lp {
        tokens.push(Value::from(t.token.clone()));
        token_logprobs.push(Value::from(t.logprob));
        let mut m = Map::new();
        for (s, l) in &t.top {
            m.entry(s.clone()).or_insert(Value::from(*l));
        }
        top.push(Value::Object(m));
        offsets.push(Value::from(*offset));
        *offset += t.token.len();
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
}

async fn completions(State(app): State<AppState>, req: Request) -> Response {
    match completions_inner(app, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn completions_inner(app: AppState, req: Request) -> Result<Response, ApiError> {
    let received = Instant::now();
    app.check_open()?;
    let body = read_json(req, app.cfg.max_body_bytes).await?;
    let r = parse_completion(&body)?;
    drop(body);
    app.check_model(r.common.model.as_deref())?;
    let app2 = app.clone();
    let (r, prompt) = tokio::task::spawn_blocking(move || {
        let p = match &r.prompt {
            Prompt::Text(t) => app2.encode(t),
            Prompt::Tokens(ids) => {
                let n = app2.assets.tokenizer.len();
                match ids.iter().find(|&&i| i as usize >= n) {
                    Some(bad) => Err(ApiError::invalid(
                        "prompt",
                        format!("token id {bad} is outside the vocabulary (0..{n})"),
                    )),
                    None => Ok(ids.clone()),
                }
            }
        };
        (r, p)
    })
    .await
    .map_err(|e| ApiError::internal(format!("preparing the prompt failed: {e}")))?;
    let prompt = prompt?;
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    // OpenAI's default for completions is 16 tokens.
    let max_tokens = app.budget(
        prompt.len(),
        Some(r.common.max_tokens.unwrap_or(16)),
        "prompt",
    )?;
    let steering = app.steering(&r.common, false)?;
    let echo_text = if r.echo {
        match &r.prompt {
            Prompt::Text(t) => t.clone(),
            Prompt::Tokens(ids) => app.assets.tokenizer.decode(ids, false).unwrap_or_default(),
        }
    } else {
        String::new()
    };
    let (tx, rx) = unbounded_channel();
    let guard = CancelGuard(Arc::new(AtomicBool::new(false)));
    let job = Job {
        prompt,
        sampling: r.common.sampling(&app.assets.generation.sampling)?,
        max_tokens,
        stop: r.common.stop.clone(),
        output: OutputMode::Raw,
        steering,
        logprobs: r.logprobs,
        events: tx,
        cancel: guard.0.clone(),
        received,
    };
    app.submit(job)?;
    let id = format!("cmpl-{}", random_id(24));
    let created = unix_now();
    let model = app.cfg.served_model_name.clone();
    if r.common.stream {
        return Ok(completion_stream(
            rx, guard, id, created, model, &r, echo_text,
        ));
    }
    completion_collect(rx, guard, id, created, model, &r, echo_text).await
}

async fn completion_collect(
    mut rx: UnboundedReceiver<JobEvent>,
    guard: CancelGuard,
    id: String,
    created: u64,
    model: String,
    r: &CompletionRequest,
    mut text: String,
) -> Result<Response, ApiError> {
    let mut lps = Vec::new();
    let outcome = loop {
        match rx.recv().await {
            Some(JobEvent::Delta { piece, logprobs }) => {
                lps.extend(logprobs);
                if let Some(Piece::Content(s) | Piece::Reasoning(s)) = piece {
                    text.push_str(&s);
                }
            }
            Some(JobEvent::Done(o)) => break o,
            Some(JobEvent::Failed { message, shutdown }) => return Err(failure(message, shutdown)),
            None => return Err(ApiError::internal("the engine dropped the request")),
        }
    };
    drop(guard);
    lps.extend(outcome.logprobs.iter().cloned());
    let body = json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "text": text,
            "logprobs": if r.logprobs.is_some() { completion_logprobs(&lps, &mut 0) } else { Value::Null },
            "finish_reason": finish_reason(&outcome),
        }],
        "usage": usage(&outcome),
    });
    Ok(axum::Json(body).into_response())
}

fn completion_stream(
    rx: UnboundedReceiver<JobEvent>,
    guard: CancelGuard,
    id: String,
    created: u64,
    model: String,
    r: &CompletionRequest,
    echo: String,
) -> Response {
    let include_usage = r.common.include_usage;
    let want_lp = r.logprobs.is_some();
    let mut offset = echo.len();
    let chunk = move |text: &str, lp: Option<Value>, finish: Option<&str>| -> String {
        let mut c = json!({
            "id": id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}],
        });
        if include_usage {
            c["usage"] = Value::Null;
        }
        c.to_string()
    };
    let first = if echo.is_empty() {
        vec![]
    } else {
        vec![chunk(&echo, None, None)]
    };
    let render: Render = Box::new(move |ev| match ev {
        Some(JobEvent::Delta { piece, logprobs }) => {
            let lp = want_lp.then(|| completion_logprobs(&logprobs, &mut offset));
            let text = match piece {
                Some(Piece::Content(s) | Piece::Reasoning(s)) => s,
                _ => String::new(),
            };
            (vec![chunk(&text, lp, None)], false)
        }
        Some(JobEvent::Done(o)) => {
            let lp = want_lp.then(|| completion_logprobs(&o.logprobs, &mut offset));
            let mut frames = vec![chunk("", lp, Some(finish_reason(&o)))];
            if include_usage {
                let mut u =
                    serde_json::from_str::<Value>(&chunk("", None, None)).unwrap_or_default();
                u["choices"] = json!([]);
                u["usage"] = usage(&o);
                frames.push(u.to_string());
            }
            (frames, true)
        }
        Some(JobEvent::Failed { message, shutdown }) => {
            (vec![error_frame(&message, shutdown)], true)
        }
        None => (
            vec![error_frame("the engine dropped the request", false)],
            true,
        ),
    });
    sse(rx, guard, first, render)
}
