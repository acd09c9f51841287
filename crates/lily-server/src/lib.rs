//! `lily serve`: an OpenAI-compatible HTTP server over the engine.
//!
//! Endpoints: `POST /v1/chat/completions` and `POST /v1/completions` (both
//! streamed over SSE or not), `GET /v1/models`, `GET /health`, `GET /metrics`
//! (Prometheus text). Errors come in OpenAI's shape.
//!
//! Layout: [`http`] parses and checks requests ([`api`]), renders the chat
//! template and tokenizes (on tokio's blocking pool), and puts a [`engine::Job`]
//! on the bounded [`engine::JobQueue`]; one engine thread owns the model and
//! runs the jobs ([`engine::worker`]), sending events back over a channel per
//! job. [`serve`] is generic over the backend ([`Model`]): the model is built
//! on the engine thread by the closure given, so a backend need not be `Send`.

pub mod api;
pub mod engine;
pub mod error;
pub mod http;
pub mod metrics;
pub mod steer;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use lily_engine::assets::TextAssets;
use lily_engine::generate::Model;
use lily_engine::sequences::CacheOptions;

use crate::engine::{EngineShared, JobQueue, WorkerHandle};
use crate::metrics::Metrics;

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub host: String,
    /// 0 = any free port (the one taken is printed)
    pub port: u16,
    pub api_key: Option<String>,
    /// Most tokens of a sequence, prompt and completion together
    pub max_seq: usize,
    /// Most requests waiting for the engine (beyond the one it runs)
    pub queue: usize,
    pub served_model_name: String,
    /// Other names a request's `model` may use
    pub model_aliases: Vec<String>,
    /// Thinking on unless a request says otherwise
    pub default_thinking: bool,
    /// Honour the test-only request fields `lily_test_script` / `lily_test_delay_ms`
    pub test_hooks: bool,
    /// On SIGINT/SIGTERM, how long running requests may go on before they are cancelled
    pub shutdown_timeout: Duration,
    pub max_body_bytes: usize,
    /// The prompt cache's budget and snapshot interval
    pub prompt_cache: CacheOptions,
}

/// Runs the server until SIGINT or SIGTERM. `make_model` runs on the engine
/// thread; its error ends `serve` before anything is bound.
pub fn serve<M, F>(make_model: F, assets: TextAssets, cfg: ServerConfig) -> Result<()>
where
    M: Model + 'static,
    F: FnOnce() -> Result<M> + Send + 'static,
{
    let assets = Arc::new(assets);
    let shared = Arc::new(EngineShared {
        queue: JobQueue::new(cfg.queue),
        metrics: Metrics::default(),
        abort_all: Default::default(),
    });
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
    let thread = {
        let (assets, shared) = (assets.clone(), shared.clone());
        let cfg_cache = cfg.prompt_cache;
        std::thread::Builder::new()
            .name("lily-engine".into())
            .spawn(move || {
                let model = match make_model() {
                    Ok(m) => m,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                engine::worker(&model, &assets, &shared, cfg_cache);
            })?
    };
    let worker = WorkerHandle { thread };
    ready_rx
        .recv()
        .context("the engine thread ended while loading the model")??;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let app = Arc::new(http::App::new(cfg.clone(), assets, shared.clone()));
    let res = rt.block_on(run_http(app, shared.clone(), &cfg));
    shared.abort_all.store(true, Ordering::SeqCst);
    shared.queue.close();
    if !worker.join_timeout(Duration::from_secs(10)) {
        eprintln!("lily serve: the engine did not stop in time; exiting anyway");
    }
    rt.shutdown_timeout(Duration::from_secs(1));
    res
}

async fn run_http(
    app: Arc<http::App>,
    shared: Arc<EngineShared>,
    cfg: &ServerConfig,
) -> Result<()> {
    let listener = tokio::net::TcpListener::bind((cfg.host.as_str(), cfg.port))
        .await
        .with_context(|| format!("binding {}:{}", cfg.host, cfg.port))?;
    let addr = listener.local_addr()?;
    let host = if addr.is_ipv6() {
        format!("[{}]", addr.ip())
    } else {
        addr.ip().to_string()
    };
    eprintln!(
        "lily serve: model {:?}, listening on http://{host}:{}",
        cfg.served_model_name,
        addr.port()
    );

    let (signalled_tx, signalled) = tokio::sync::watch::channel(false);
    {
        // First signal: stop taking requests, let running ones finish for
        // `shutdown_timeout`, then cancel what is left. Second signal: cancel now.
        let (shared, app, grace) = (shared.clone(), app.clone(), cfg.shutdown_timeout);
        tokio::spawn(async move {
            wait_signal().await;
            eprintln!("lily serve: shutting down (waiting up to {:?} for running requests; a second signal cancels them)", grace);
            app.shutting_down.store(true, Ordering::SeqCst);
            let _ = signalled_tx.send(true);
            tokio::select! {
                _ = tokio::time::sleep(grace) => {}
                _ = wait_signal() => {}
            }
            shared.abort_all.store(true, Ordering::SeqCst);
        });
    }
    let router = http::router(app);
    let shutdown_signal = {
        let mut s = signalled.clone();
        async move {
            let _ = s.wait_for(|&v| v).await;
        }
    };
    let hard_stop = {
        let mut s = signalled.clone();
        let limit = cfg.shutdown_timeout + Duration::from_secs(5);
        async move {
            if s.wait_for(|&v| v).await.is_err() {
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(limit).await;
        }
    };
    let server = axum::serve(listener, router).with_graceful_shutdown(shutdown_signal);
    tokio::select! {
        r = server => r.context("the HTTP server failed")?,
        _ = hard_stop => eprintln!("lily serve: connections still open after the grace period; closing them"),
    }
    eprintln!("lily serve: stopped");
    Ok(())
}

async fn wait_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
