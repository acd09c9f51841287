//! `lily bench`: prefill tok/s at each prompt length, decode tok/s at each
//! context length, and time to first token; the median of several runs after
//! one warm-up run. On CUDA, decode is greedy on the device, as the engine
//! runs it: each step is queued before the previous one's token reaches the
//! host, and only the chosen id comes back.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use lily_cli::backend::Backend;
use lily_engine::generate::Model;
use lily_engine::sampling::argmax;
use serde_json::json;

use crate::{DeviceArgs, ModelArgs};

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Prompt lengths to time prefill at (default: 512,4096,16384 on CUDA, 128 on the CPU)
    #[arg(long, value_delimiter = ',')]
    pub prompt_len: Vec<usize>,
    /// Context lengths to time decode at (default: 512,4096,32768 on CUDA, 128 on the CPU)
    #[arg(long, value_delimiter = ',')]
    pub context: Vec<usize>,
    /// Tokens decoded at each context (default: 128 on CUDA, 16 on the CPU)
    #[arg(long)]
    pub gen: Option<usize>,
    /// Timed runs (after one warm-up); the median is reported
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Print one JSON object instead of a table
    #[arg(long)]
    pub json: bool,
    /// CUDA: also time each kernel group of one decode step at each context
    /// (events inside the captured step) against the bytes it must move, and
    /// of each prompt's last prefill chunk against the FLOPs it computes
    #[arg(long)]
    pub profile: bool,
    /// How a decode context is reached: `prefill` runs all of it; `zeros`
    /// (CUDA) prefills at most 512 tokens and leaves the rest of the KV cache
    /// zeroed, for decode at long context (131k) without a minutes-long
    /// prefill; a decode step's work depends on its position, not on the
    /// cache's contents
    #[arg(long, value_enum, default_value_t = Fill::Prefill)]
    pub fill: Fill,
    /// CUDA diagnostic: build the kernels with their timeline records and,
    /// after each context's timed runs, write one decode step's timeline
    /// (every launch: its blocks' start, release from the PDL wait, exit) to
    /// DIR/trace-<context>.csv (tools/trace_step.py sums it per kernel). The
    /// records cost registers and stores: the run's tok/s are not speed figures
    #[arg(long, value_name = "DIR")]
    pub trace: Option<std::path::PathBuf>,
    /// With --trace, also record when each block passes the phase mark N of
    /// its kernel (`TRACE_MARK(N)` in the .cu sources; 0: none)
    #[arg(long, value_name = "N", default_value_t = 0, requires = "trace")]
    pub trace_mark: u32,
    /// CUDA diagnostic: launch each decode step kernel by kernel instead of
    /// replaying its captured CUDA graph (what the graph saves)
    #[arg(long)]
    pub eager: bool,
    /// CUDA diagnostic: launch every kernel without programmatic dependent
    /// launch (what PDL saves)
    #[arg(long)]
    pub no_pdl: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Fill {
    Prefill,
    Zeros,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Seeded prompt ids spread over the vocabulary.
fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    let mut s = 0x1234_5678u64;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// Prefill `toks` and choose the next token; returns (seconds to the chosen id, the id, state).
fn prefill(b: &Backend, toks: &[u32]) -> Result<(f64, u32, lily_cli::backend::BackendState)> {
    let mut st = Model::new_state(b)?;
    let t = Instant::now();
    let tok = match (b, &mut st) {
        (Backend::Cuda(m), lily_cli::backend::BackendState::Cuda(s)) => {
            m.prefill_greedy(s, toks)?
        }
        _ => argmax(&b.prefill(toks, &mut st)?),
    };
    Ok((t.elapsed().as_secs_f64(), tok, st))
}

/// Decode `gen` greedy tokens after `st`; returns seconds and the last token.
fn decode(
    b: &Backend,
    st: &mut lily_cli::backend::BackendState,
    mut tok: u32,
    gen: usize,
) -> Result<(f64, u32)> {
    let t = Instant::now();
    if let (Backend::Cuda(m), lily_cli::backend::BackendState::Cuda(s)) = (b, &mut *st) {
        // as the engine decodes greedily: each step queued before the
        // previous token reaches the host
        m.decode_greedy_run(s, gen, m.cfg.vocab_size, &mut |id| {
            tok = id;
            Ok(true)
        })?;
        return Ok((t.elapsed().as_secs_f64(), tok));
    }
    for _ in 0..gen {
        tok = argmax(&b.decode(tok, st)?);
    }
    Ok((t.elapsed().as_secs_f64(), tok))
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let t0 = Instant::now();
    // room for the longest prompt, or the longest context plus the warm-up
    // and the timed decode segments that follow it (and --trace's two steps)
    let longest = a
        .prompt_len
        .iter()
        .chain(a.context.iter())
        .max()
        .copied()
        .unwrap_or(32_768)
        .max(if a.context.is_empty() { 32_768 } else { 0 })
        + (a.runs + 1) * a.gen.unwrap_or(128)
        + if a.trace.is_some() { 2 } else { 0 };
    let dev = DeviceArgs {
        max_seq: a.device.max_seq.max(longest),
        ..a.device.clone()
    };
    let mut opts = dev.options();
    opts.cuda.graphs = !a.eager;
    opts.gpu.pdl = !a.no_pdl;
    opts.gpu.build.trace = a.trace.is_some();
    opts.gpu.build.trace_mark = a.trace_mark;
    let b = dev.load_with(&a.model, &opts, !a.json)?;
    let load_s = t0.elapsed().as_secs_f64();
    let cuda = matches!(b, Backend::Cuda(_));
    if (a.trace.is_some() || a.eager || a.no_pdl) && !cuda {
        bail!("--trace, --eager and --no-pdl are CUDA diagnostics: they need --device cuda");
    }
    let prompts = if a.prompt_len.is_empty() {
        if cuda {
            vec![512, 4096, 16_384]
        } else {
            vec![128]
        }
    } else {
        a.prompt_len.clone()
    };
    let contexts = if a.context.is_empty() {
        if cuda {
            vec![512, 4096, 32_768]
        } else {
            vec![128]
        }
    } else {
        a.context.clone()
    };
    let gen = a.gen.unwrap_or(if cuda { 128 } else { 16 });
    let vocab = b.cfg().vocab_size.min(248_077);
    // the device's copy bandwidth: with the bytes a decode step must move it
    // gives the step's floor, and each figure's share of it
    let bandwidth = match &b {
        Backend::Cuda(m) => Some(m.gpu.copy_bandwidth()?),
        _ => None,
    };
    let (mut prefill_rows, mut decode_rows) = (Vec::new(), Vec::new());
    for &p in &prompts {
        if p == 0 {
            bail!("prompt lengths must be at least 1");
        }
        let toks = prompt(p, vocab);
        prefill(&b, &toks[..p.min(64)])?; // warm-up
        let times: Vec<f64> = (0..a.runs)
            .map(|_| prefill(&b, &toks).map(|r| r.0))
            .collect::<Result<_>>()?;
        let s = median(times);
        let mut row = json!({"prompt_len": p, "prefill_tok_s": p as f64 / s, "ttft_ms": s * 1e3});
        if let (Backend::Cuda(m), true) = (&b, a.profile) {
            // the last chunk of one more prefill, group by group
            let mut st = m.new_state()?;
            let (pos, n, secs) = m.profile_prefill(&mut st, &toks)?;
            row["profile_chunk"] = json!({"pos": pos, "tokens": n});
            row["profile"] = json!(secs
                .iter()
                .map(|x| {
                    let flops = x.count as f64
                        * lily_cuda::model::prefill_group_flops(&m.cfg, x.name, n, pos);
                    json!({"group": x.name, "us": x.us, "flops": flops, "count": x.count})
                })
                .collect::<Vec<_>>());
        }
        prefill_rows.push(row);
    }
    for &c in &contexts {
        // one prefill per context, then a warm-up step and `runs` timed
        // segments of `gen` tokens back to back (contexts c, c + gen, ...):
        // decode speed depends on the context length, not on which tokens
        // fill it, and a second prefill of a long prompt would cost minutes
        let real = if a.fill == Fill::Zeros {
            c.clamp(1, 512)
        } else {
            c.max(1)
        };
        let toks = prompt(real, vocab);
        let (_, tok, mut st) = prefill(&b, &toks)?;
        if real < c {
            match (&b, &mut st) {
                (Backend::Cuda(m), lily_cli::backend::BackendState::Cuda(s)) => {
                    m.advance_unfilled(s, c - real)?
                }
                _ => bail!("--fill zeros needs the CUDA backend"),
            }
        }
        // warm-up (captures the CUDA graph)
        let (_, mut tok) = decode(&b, &mut st, tok, 2.min(gen))?;
        let mut times = Vec::new();
        for _ in 0..a.runs {
            let (secs, last) = decode(&b, &mut st, tok, gen)?;
            times.push(secs);
            tok = last;
        }
        let s = median(times);
        let mut row = json!({"context": c, "gen": gen, "decode_tok_s": gen as f64 / s, "ms_per_token": s * 1e3 / gen as f64,
            "context_fill": if real < c { "zeros" } else { "prefill" }});
        if let (Backend::Cuda(m), Some(bw)) = (&b, bandwidth) {
            // the bytes of the middle step of the timed segments
            let bytes = m.decode_step_bytes(c + (a.runs * gen) / 2);
            let floor_tok_s = bw / bytes as f64;
            row["step_bytes"] = json!(bytes);
            row["floor_tok_s"] = json!(floor_tok_s);
            row["pct_of_floor"] = json!(100.0 * (gen as f64 / s) / floor_tok_s);
            if let Some(dir) = &a.trace {
                // two steps after emptying the rings: the last is whole
                m.gpu.trace_clear()?;
                decode(&b, &mut st, tok, 2)?;
                let steps = lily_cuda::trace::last_step(&m.gpu.trace_records()?);
                std::fs::create_dir_all(dir)?;
                let path = dir.join(format!("trace-{c}.csv"));
                std::fs::write(&path, lily_cuda::trace::launches_csv(&steps))
                    .with_context(|| format!("writing {}", path.display()))?;
                eprintln!(
                    "lily: {} launches of one decode step at context {c} -> {}",
                    steps.len(),
                    path.display()
                );
            }
            if a.profile {
                // the state is spent after this: the profiled step replays
                if let lily_cli::backend::BackendState::Cuda(cs) = &mut st {
                    let secs = m.profile_decode(cs, 5)?;
                    let (whole, graph) = m.profile_decode_graph(cs, 20)?;
                    row["graph_step_us"] = json!(whole);
                    row["profile"] = json!(secs
                        .iter()
                        .map(|x| {
                            let g = graph.iter().find(|g| g.0 == x.name).map(|g| g.1);
                            json!({"group": x.name, "us": x.us, "graph_us": g, "bytes": x.bytes, "count": x.count})
                        })
                        .collect::<Vec<_>>());
                }
            }
        }
        decode_rows.push(row);
    }
    let report = json!({
        "model": a.model.source().describe(),
        "weights": b.weight_format().describe(),
        "device": b.device_name(),
        "runs": a.runs,
        "load_s": load_s,
        "copy_bandwidth_gb_s": bandwidth.map(|b| b / 1e9),
        "greedy_head": head_path(&b),
        "launch": {"graphs": !a.eager, "pdl": !a.no_pdl, "trace": a.trace.is_some()},
        "prefill": prefill_rows,
        "decode": decode_rows,
    });
    if a.json {
        println!("{report}");
        return Ok(());
    }
    println!(
        "model {} ({})  device {}  load {:.1}s  (median of {} runs after a warm-up)",
        a.model.source().describe(),
        b.weight_format().describe(),
        b.device_name(),
        load_s,
        a.runs
    );
    println!("{:>12} {:>16} {:>12}", "prompt", "prefill tok/s", "ttft ms");
    for r in &prefill_rows {
        println!(
            "{:>12} {:>16.1} {:>12.1}",
            r["prompt_len"],
            r["prefill_tok_s"].as_f64().unwrap(),
            r["ttft_ms"].as_f64().unwrap()
        );
    }
    if let Some(bw) = bandwidth {
        println!(
            "decode floor: the bytes a step must move over the copy bandwidth, {:.0} GB/s",
            bw / 1e9
        );
        println!("greedy lm_head: {}", head_path(&b));
    }
    if a.fill == Fill::Zeros {
        println!("decode contexts past 512 tokens: KV cache zeroed, not prefilled (--fill zeros)");
    }
    if a.eager || a.no_pdl || a.trace.is_some() {
        println!(
            "diagnostic launch (not speed figures of the product): graphs {}, PDL {}, trace build {}",
            !a.eager,
            !a.no_pdl,
            a.trace.is_some()
        );
    }
    println!(
        "{:>12} {:>8} {:>16} {:>12} {:>14} {:>10}",
        "context", "gen", "decode tok/s", "ms/token", "floor tok/s", "% floor"
    );
    for r in &decode_rows {
        let f = |k: &str| {
            r[k].as_f64()
                .map(|x| format!("{x:.1}"))
                .unwrap_or_else(|| "-".into())
        };
        println!(
            "{:>12} {:>8} {:>16.2} {:>12.3} {:>14} {:>10}",
            r["context"],
            r["gen"],
            r["decode_tok_s"].as_f64().unwrap(),
            r["ms_per_token"].as_f64().unwrap(),
            f("floor_tok_s"),
            f("pct_of_floor")
        );
    }
    for r in &prefill_rows {
        let Some(p) = r["profile"].as_array() else {
            continue;
        };
        let total: f64 = p.iter().map(|x| x["us"].as_f64().unwrap()).sum();
        let flops: f64 = p.iter().map(|x| x["flops"].as_f64().unwrap()).sum();
        println!(
            "\nprefill of {} tokens, its last chunk ({} tokens after {}): events between the \
             groups, summed over the layers; the last row's lm_head included",
            r["prompt_len"], r["profile_chunk"]["tokens"], r["profile_chunk"]["pos"]
        );
        println!(
            "{:>16} {:>6} {:>10} {:>10} {:>10} {:>8}",
            "group", "count", "us", "GFLOP", "TFLOP/s", "share"
        );
        for x in p
            .iter()
            .chain([&json!({"group": "chunk", "us": total, "flops": flops, "count": ""})])
        {
            let (us, fl) = (x["us"].as_f64().unwrap(), x["flops"].as_f64().unwrap());
            println!(
                "{:>16} {:>6} {:>10.1} {:>10.1} {:>10.1} {:>7.1}%",
                x["group"].as_str().unwrap(),
                x["count"].to_string().trim_matches('"'),
                us,
                fl / 1e9,
                fl / (us * 1e-6) / 1e12,
                100.0 * us / total
            );
        }
    }
    for r in &decode_rows {
        let (Some(p), Some(bw)) = (r["profile"].as_array(), bandwidth) else {
            continue;
        };
        let total: f64 = p.iter().map(|x| x["us"].as_f64().unwrap()).sum();
        let whole = r["graph_step_us"].as_f64().unwrap_or(f64::NAN);
        let bytes: f64 = p.iter().map(|x| x["bytes"].as_f64().unwrap()).sum();
        println!(
            "\none decode step at context {}: 'eager' = events between the groups of the step \
             launched kernel by kernel (median of 5); 'graph' = what the group costs inside the \
             captured step (whole-step replay time minus the time without the group; GB/s and share from it)",
            r["context"]
        );
        println!(
            "{:>16} {:>6} {:>10} {:>10} {:>12} {:>10} {:>8} {:>10}",
            "group", "count", "eager us", "graph us", "MB moved", "GB/s", "share", "floor us"
        );
        let mut accounted = 0.0;
        for x in p {
            let (us, by) = (x["us"].as_f64().unwrap(), x["bytes"].as_f64().unwrap());
            let g = x["graph_us"].as_f64().unwrap_or(f64::NAN);
            accounted += g;
            println!(
                "{:>16} {:>6} {:>10.1} {:>10.1} {:>12.2} {:>10.0} {:>7.1}% {:>10.1}",
                x["group"].as_str().unwrap(),
                x["count"],
                us,
                g,
                by / 1e6,
                by / (g * 1e-6) / 1e9,
                100.0 * g / whole,
                by / bw * 1e6
            );
        }
        println!(
            "{:>16} {:>6} {:>10.1} {:>10.1} {:>12.2} {:>10.0} {:>7.1}% {:>10.1}",
            "step",
            "",
            total,
            whole,
            bytes / 1e6,
            bytes / (whole * 1e-6) / 1e9,
            100.0 * accounted / whole,
            bytes / bw * 1e6
        );
    }
    Ok(())
}

/// Which lm_head a greedy CUDA decode step runs (its bytes are the floor's).
fn head_path(b: &Backend) -> &'static str {
    match b {
        Backend::Cuda(m) if m.head_screened() => {
            "screened through an int8 copy, the candidate rows exact in bf16 (the full product's argmax; --greedy-head full: the full bf16 product)"
        }
        Backend::Cuda(_) => "the full bf16 product",
        _ => "the full product",
    }
}
