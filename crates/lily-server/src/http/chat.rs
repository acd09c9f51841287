//! `/v1/chat/completions`: the handler, prompt rendering, and the collected
//! and streamed answers.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use lily_model::chat_template::RenderOptions;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::sse::{failed, sse, usage_frame, Render};
use super::{failure, finish_reason, random_id, read_json, unix_now, usage, App, AppState};
use crate::api::{parse_chat, ChatRequest, ToolChoice};
use crate::engine::{CancelGuard, Job, JobEvent, OutputMode, Piece, TokenLogprob};
use crate::error::ApiError;

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

pub(super) async fn chat(State(app): State<AppState>, req: Request) -> Response {
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
        queued: None,
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
                frames.push(usage_frame(&chunk(json!({}), None, None), &o));
            }
            (frames, true)
        }
        Some(JobEvent::Failed { message, shutdown }) => failed(Some((&message, shutdown))),
        None => failed(None),
    });
    sse(rx, guard, first, render)
}
