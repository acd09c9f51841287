//! Server-sent-events plumbing shared by the streamed chat and completion
//! answers: the event stream, its `[DONE]` ending, and error frames.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::HeaderValue;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::Stream;
use tokio::sync::mpsc::UnboundedReceiver;

use serde_json::{json, Value};

use super::usage;
use crate::engine::{CancelGuard, JobEvent, Outcome};
use crate::error::ApiError;

pub(super) fn error_frame(message: &str, shutdown: bool) -> String {
    let e = if shutdown {
        ApiError::shutting_down()
    } else {
        ApiError::internal(message)
    };
    let mut body = e.body();
    body["error"]["message"] = message.into();
    body.to_string()
}

/// The `include_usage` frame after the last chunk: `empty_chunk` (a chunk
/// with no content) with no choices and the request's token counts.
pub(super) fn usage_frame(empty_chunk: &str, o: &Outcome) -> String {
    let mut u = serde_json::from_str::<Value>(empty_chunk).unwrap_or_default();
    u["choices"] = json!([]);
    u["usage"] = usage(o);
    u.to_string()
}

/// The end of a stream the engine did not finish: its error (`None`: the
/// engine dropped the request), as the payloads and "over" of a [`Render`].
pub(super) fn failed(error: Option<(&str, bool)>) -> (Vec<String>, bool) {
    let (message, shutdown) = error.unwrap_or(("the engine dropped the request", false));
    (vec![error_frame(message, shutdown)], true)
}

/// Turns the events of one job into SSE `data:` payloads; `None` = the
/// channel closed. Returns the payloads and whether the stream is over.
pub(super) type Render = Box<dyn FnMut(Option<JobEvent>) -> (Vec<String>, bool) + Send>;

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

pub(super) fn sse(
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
