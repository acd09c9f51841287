//! Server metrics, rendered in the Prometheus text exposition format at
//! `GET /metrics`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use lily_engine::prompt_cache::CacheStats;
use lily_engine::sequences::Sequences;

/// A cumulative histogram with fixed bucket bounds (seconds).
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<HistInner>,
}

#[derive(Default)]
struct HistInner {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            inner: Mutex::new(HistInner {
                counts: vec![0; bounds.len()],
                ..Default::default()
            }),
        }
    }

    pub fn observe(&self, d: Duration) {
        let v = d.as_secs_f64();
        let mut h = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            h.counts[i] += 1;
        }
        h.sum += v;
        h.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).count
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let h = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut acc = 0;
        for (b, c) in self.bounds.iter().zip(&h.counts) {
            acc += c;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {acc}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.count);
        let _ = writeln!(out, "{name}_sum {}", h.sum);
        let _ = writeln!(out, "{name}_count {}", h.count);
    }
}

const TTFT_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
/// The parts of a time to first token: from a millisecond (a short prompt's
/// preparation) up.
const PHASE_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56,
];
const E2E_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

pub struct Metrics {
    /// (route, status) -> count
    http: Mutex<BTreeMap<(String, u16), u64>>,
    /// finish reason -> count of generation requests that ended that way
    finished: Mutex<BTreeMap<&'static str, u64>>,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub rejected: AtomicU64,
    pub running: AtomicU64,
    pub ttft: Histogram,
    /// The parts of the time to first token: the request's preparation
    /// (arrival to queue), its wait in the queue, the engine's own time to
    /// the first token (restoring a cached prefix, the prefill, the first step)
    pub prepare: Histogram,
    pub queue_wait: Histogram,
    pub first_token: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    /// the prompt cache, as the worker last saw it
    pub cache: Mutex<CacheView>,
}

/// The prompt cache's figures for `/metrics`.
#[derive(Clone, Copy, Debug, Default)]
pub struct CacheView {
    pub stats: CacheStats,
    /// snapshots that could not be taken
    pub failed: u64,
    pub budget: usize,
}

impl CacheView {
    pub fn of<St, Sn>(seqs: &Sequences<St, Sn>) -> CacheView {
        CacheView {
            stats: seqs.stats(),
            failed: seqs.failed(),
            budget: seqs.options().budget,
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            http: Mutex::new(BTreeMap::new()),
            finished: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            running: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BUCKETS),
            prepare: Histogram::new(PHASE_BUCKETS),
            queue_wait: Histogram::new(PHASE_BUCKETS),
            first_token: Histogram::new(PHASE_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            cache: Mutex::new(CacheView::default()),
        }
    }
}

impl Metrics {
    pub fn http_request(&self, route: &str, status: u16) {
        let mut m = self.http.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry((route.to_string(), status)).or_default() += 1;
    }

    pub fn finished(&self, reason: &'static str) {
        let mut m = self.finished.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry(reason).or_default() += 1;
    }

    pub fn render(&self, queue_depth: usize, queue_capacity: usize) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let _ = writeln!(
            out,
            "# HELP lily_http_requests_total HTTP requests answered, by route and status.\n# TYPE lily_http_requests_total counter"
        );
        for ((route, status), n) in self.http.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(
                out,
                "lily_http_requests_total{{route=\"{}\",status=\"{status}\"}} {n}",
                escape(route)
            );
        }
        let _ = writeln!(
            out,
            "# HELP lily_requests_finished_total Generation requests that ended, by finish reason.\n# TYPE lily_requests_finished_total counter"
        );
        for (reason, n) in self
            .finished
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "lily_requests_finished_total{{finish_reason=\"{reason}\"}} {n}"
            );
        }
        counter(
            &mut out,
            "lily_prompt_tokens_total",
            "Prompt tokens processed.",
            self.prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "lily_generation_tokens_total",
            "Tokens generated.",
            self.generation_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "lily_requests_rejected_total",
            "Requests refused because the queue was full.",
            self.rejected.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "lily_queue_depth",
            "Requests waiting for the engine.",
            queue_depth as u64,
        );
        gauge(
            &mut out,
            "lily_queue_capacity",
            "Most requests that may wait for the engine.",
            queue_capacity as u64,
        );
        gauge(
            &mut out,
            "lily_requests_running",
            "Requests the engine is generating for.",
            self.running.load(Ordering::Relaxed),
        );
        let c = *self.cache.lock().unwrap_or_else(|e| e.into_inner());
        for (name, help, v) in [
            (
                "lily_prompt_cache_hits_total",
                "Prompts that resumed from a cached prefix.",
                c.stats.hits,
            ),
            (
                "lily_prompt_cache_misses_total",
                "Prompts with no cached prefix.",
                c.stats.misses,
            ),
            (
                "lily_prompt_cache_hit_tokens_total",
                "Prompt tokens restored from the cache instead of prefilled.",
                c.stats.hit_tokens,
            ),
            (
                "lily_prompt_cache_evictions_total",
                "Snapshots dropped to stay under the budget.",
                c.stats.evictions,
            ),
            (
                "lily_prompt_cache_failures_total",
                "Snapshots that could not be taken (each emptied the cache).",
                c.failed,
            ),
        ] {
            counter(&mut out, name, help, v);
        }
        for (name, help, v) in [
            (
                "lily_prompt_cache_bytes",
                "Bytes the prompt cache's snapshots hold.",
                c.stats.bytes,
            ),
            (
                "lily_prompt_cache_entries",
                "Snapshots the prompt cache holds.",
                c.stats.entries,
            ),
            (
                "lily_prompt_cache_budget_bytes",
                "Most bytes the prompt cache may hold.",
                c.budget,
            ),
        ] {
            gauge(&mut out, name, help, v as u64);
        }
        self.ttft.render(
            &mut out,
            "lily_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
        );
        self.prepare.render(
            &mut out,
            "lily_request_prepare_seconds",
            "Time from a generation request's arrival to its queueing: parsing, the chat template, the tokenizer.",
        );
        self.queue_wait.render(
            &mut out,
            "lily_request_queue_seconds",
            "Time a generation request waited in the queue for the engine.",
        );
        self.first_token.render(
            &mut out,
            "lily_engine_first_token_seconds",
            "The engine's time to a request's first token: restoring a cached prefix, the prefill, the first step.",
        );
        self.itl.render(
            &mut out,
            "lily_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
        );
        self.e2e.render(
            &mut out,
            "lily_request_duration_seconds",
            "Time from a generation request's arrival to its end.",
        );
        out
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
