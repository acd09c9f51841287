//! The HTTP side: routes, handlers, SSE streams, authentication and metrics.

mod chat;
mod completions;
mod sse;

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{MatchedPath, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::{FutureExt, StreamExt};
use lily_engine::assets::TextAssets;
use lily_engine::generate::FinishReason;
use serde_json::{json, Value};
use subtle::ConstantTimeEq;

use crate::api::Common;
use crate::engine::{EngineShared, Job, Outcome, PushError};
use crate::error::ApiError;
use crate::steer::Steering;
use crate::ServerConfig;

use self::chat::chat;
use self::completions::completions;

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
        "prompt_tokens_details": {"cached_tokens": o.cached_tokens},
    })
}

fn finish_reason(o: &Outcome) -> &'static str {
    match o.finish {
        FinishReason::Length => "length",
        _ if o.tool_calls > 0 => "tool_calls",
        _ => "stop",
    }
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
