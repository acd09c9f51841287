//! `lily bench`: prefill tok/s, decode tok/s and time to first token, the
//! median of several runs after one warm-up run.

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use lily_cpu::{CpuModel, Logits};

use crate::ModelArgs;

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt tokens (random ids, seeded)
    #[arg(long, default_value_t = 512)]
    pub prompt_len: usize,
    /// Tokens decoded greedily after the prompt
    #[arg(long, default_value_t = 32)]
    pub gen: usize,
    /// Timed runs (after one warm-up); the median is reported
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Print one JSON object instead of a table
    #[arg(long)]
    pub json: bool,
}

struct Run {
    prefill_s: f64,
    ttft_s: f64,
    decode_s: f64,
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

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.prompt_len == 0 || a.runs == 0 {
        bail!("--prompt-len and --runs must be at least 1");
    }
    let source = a.model.source();
    let t0 = Instant::now();
    let (cfg, w) = source.load()?;
    let load_s = t0.elapsed().as_secs_f64();
    let vocab = cfg.vocab_size as u64;
    let model = CpuModel::new(cfg, w);
    // Seeded prompt ids (LCG), spread over the vocabulary.
    let mut s = 0x1234_5678u64;
    let prompt: Vec<u32> = (0..a.prompt_len)
        .map(|_| {
            s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            ((s >> 33) % vocab) as u32
        })
        .collect();
    let once = |gen: usize| -> Result<Run> {
        let mut st = model.new_state();
        let t = Instant::now();
        let logits = model.prefill(&prompt, &mut st, Logits::Last)?;
        let prefill_s = t.elapsed().as_secs_f64();
        let mut tok = argmax(&logits);
        let ttft_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for _ in 0..gen {
            tok = argmax(&model.decode(tok, &mut st)?);
        }
        Ok(Run { prefill_s, ttft_s, decode_s: t.elapsed().as_secs_f64() })
    };
    once(a.gen.min(2))?; // warm-up: page in weights, spin up threads
    let runs: Vec<Run> = (0..a.runs).map(|_| once(a.gen)).collect::<Result<_>>()?;
    let prefill_tps = median(runs.iter().map(|r| a.prompt_len as f64 / r.prefill_s).collect());
    let decode_tps = if a.gen > 0 { median(runs.iter().map(|r| a.gen as f64 / r.decode_s).collect()) } else { 0.0 };
    let ttft_ms = median(runs.iter().map(|r| r.ttft_s * 1e3).collect());
    if a.json {
        let j = serde_json::json!({
            "model": source.describe(),
            "device": "cpu",
            "threads": rayon::current_num_threads(),
            "prompt_len": a.prompt_len,
            "gen": a.gen,
            "runs": a.runs,
            "load_s": load_s,
            "prefill_tok_s": prefill_tps,
            "decode_tok_s": decode_tps,
            "ttft_ms": ttft_ms,
        });
        println!("{j}");
    } else {
        println!("model {}  device cpu ({} threads)  load {:.2}s", source.describe(), rayon::current_num_threads(), load_s);
        println!("{:>10} {:>6} {:>16} {:>16} {:>12}", "prompt", "gen", "prefill tok/s", "decode tok/s", "ttft ms");
        println!("{:>10} {:>6} {:>16.1} {:>16.2} {:>12.1}", a.prompt_len, a.gen, prefill_tps, decode_tps, ttft_ms);
        println!("(median of {} runs after a warm-up)", a.runs);
    }
    Ok(())
}
