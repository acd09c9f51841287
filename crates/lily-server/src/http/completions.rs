//! `/v1/completions`: the handler and the collected and streamed answers.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::sse::{failed, sse, usage_frame, Render};
use super::{failure, finish_reason, random_id, read_json, unix_now, usage, AppState};
use crate::api::{parse_completion, CompletionRequest, Prompt};
use crate::engine::{CancelGuard, Job, JobEvent, OutputMode, Piece, TokenLogprob};
use crate::error::ApiError;

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

pub(super) async fn completions(State(app): State<AppState>, req: Request) -> Response {
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
        queued: None,
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
                frames.push(usage_frame(&chunk("", None, None), &o));
            }
            (frames, true)
        }
        Some(JobEvent::Failed { message, shutdown }) => failed(Some((&message, shutdown))),
        None => failed(None),
    });
    sse(rx, guard, first, render)
}
