//! `lily generate`: one prompt in, the answer streamed out (reasoning dimmed),
//! and a stats line on stderr. Also the pieces `lily chat` shares.

use std::io::{IsTerminal, Read, Write};

use anyhow::{bail, Context, Result};
use clap::Args;
use lily_cli::backend::{Backend, BackendSnapshot, BackendState};
use lily_engine::assets::TextAssets;
use lily_engine::generate::{GenerateRequest, Generation, OnToken};
use lily_engine::parse::{Event, OutputParser, ToolCall};
use lily_engine::sampling::{SamplingOverrides, SamplingParams};
use lily_engine::sequences::{chat_marks, CacheOptions, Sequences};
use lily_model::chat_template::RenderOptions;
use serde_json::{json, Value};

use crate::{DeviceArgs, ModelArgs};

/// Sampling flags; anything not given comes from generation_config.json.
#[derive(Args, Clone, Debug, Default)]
pub struct SamplingArgs {
    /// 0 = greedy
    #[arg(long)]
    pub temperature: Option<f32>,
    /// 0 = off
    #[arg(long)]
    pub top_k: Option<usize>,
    #[arg(long)]
    pub top_p: Option<f32>,
    #[arg(long)]
    pub min_p: Option<f32>,
    #[arg(long)]
    pub presence_penalty: Option<f32>,
    #[arg(long)]
    pub frequency_penalty: Option<f32>,
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    /// Makes sampled runs repeatable
    #[arg(long)]
    pub seed: Option<u64>,
    /// Greedy decoding (same as --temperature 0)
    #[arg(long)]
    pub greedy: bool,
    /// Stop when this text appears (repeatable); it is not printed
    #[arg(long)]
    pub stop: Vec<String>,
    /// Most tokens to generate
    #[arg(long, default_value_t = 2048)]
    pub max_tokens: usize,
}

impl SamplingArgs {
    pub fn params(&self, defaults: &SamplingParams) -> Result<SamplingParams> {
        SamplingOverrides {
            temperature: if self.greedy {
                Some(0.0)
            } else {
                self.temperature
            },
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
        }
        .apply(defaults)
    }
}

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// The user message (read from stdin when absent)
    #[arg(long)]
    pub prompt: Option<String>,
    /// A system message
    #[arg(long)]
    pub system: Option<String>,
    /// Answer without thinking first
    #[arg(long)]
    pub no_think: bool,
    /// Feed the prompt as it is, without the chat template
    #[arg(long)]
    pub raw: bool,
    /// Do not print the reasoning
    #[arg(long)]
    pub hide_reasoning: bool,
    /// Print one JSON object at the end instead of streaming text
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// A loaded model with its tokenizer, template and defaults.
pub struct Runner {
    pub model: Backend,
    pub assets: TextAssets,
}

impl Runner {
    pub fn load(m: &ModelArgs, d: &DeviceArgs) -> Result<Runner> {
        let model = d.load(m, true)?;
        let assets = TextAssets::load(&m.source(), model.cfg().vocab_size)?;
        Ok(Runner { model, assets })
    }

    /// Render the conversation with the chat template, ready for the answer.
    pub fn chat_prompt(&self, messages: &[Value], think: bool) -> Result<Vec<u32>> {
        let opts = RenderOptions {
            add_generation_prompt: true,
            enable_thinking: think,
            preserve_thinking: false,
        };
        let text = self.assets.template.render(messages, None, &opts)?;
        self.assets.tokenizer.encode(&text)
    }

    /// Generate from prompt ids, passing parsed events to `sink` as they come;
    /// `sink` returning false cancels.
    /// Generate for `prompt` (through `seqs`: the state and prompt cache a
    /// chat keeps from turn to turn), passing the parsed output to `sink`.
    pub fn run(
        &self,
        seqs: &mut Sequences<BackendState, BackendSnapshot>,
        prompt: Vec<u32>,
        in_reasoning: bool,
        s: &SamplingArgs,
        sink: &mut dyn FnMut(Event) -> bool,
    ) -> Result<(Generation, Vec<ToolCall>)> {
        let marks = match self.assets.tokenizer.token_id("<|im_start|>") {
            Some(t) => chat_marks(&prompt, t),
            None => Vec::new(),
        };
        let req = GenerateRequest {
            prompt,
            sampling: s.params(&self.assets.generation.sampling)?,
            max_tokens: s.max_tokens,
            stop_ids: self.assets.generation.eos_token_ids.clone(),
            stop_strings: s.stop.clone(),
        };
        let mut parser = OutputParser::new(in_reasoning, None);
        let mut calls = Vec::new();
        let mut keep = true;
        let mut feed = |evs: Vec<Event>, calls: &mut Vec<ToolCall>, keep: &mut bool| {
            for e in evs {
                if let Event::ToolCall(c) = &e {
                    calls.push(c.clone());
                }
                if *keep && !sink(e) {
                    *keep = false;
                }
            }
        };
        let g = seqs.generate(
            &self.model,
            &self.assets.tokenizer,
            &req,
            &marks,
            OnToken::Id(&mut |_| true),
            &mut |piece| {
                feed(parser.push(piece), &mut calls, &mut keep);
                keep
            },
        )?;
        feed(parser.finish(), &mut calls, &mut keep);
        Ok((g, calls))
    }
}

/// Prints reasoning dimmed (on a terminal) and the answer plainly.
pub struct Printer {
    pub show_reasoning: bool,
    tty: bool,
    in_reasoning: bool,
    pub reasoning: String,
    pub content: String,
}

impl Printer {
    pub fn new(show_reasoning: bool) -> Printer {
        Printer {
            show_reasoning,
            tty: std::io::stdout().is_terminal(),
            in_reasoning: false,
            reasoning: String::new(),
            content: String::new(),
        }
    }

    pub fn event(&mut self, e: &Event) {
        let mut out = std::io::stdout().lock();
        match e {
            Event::Reasoning(t) => {
                self.reasoning.push_str(t);
                if self.show_reasoning {
                    if !self.in_reasoning && self.tty {
                        let _ = write!(out, "\x1b[2m");
                    }
                    self.in_reasoning = true;
                    let _ = write!(out, "{t}");
                }
            }
            Event::Content(t) => {
                self.end_reasoning(&mut out);
                self.content.push_str(t);
                let _ = write!(out, "{t}");
            }
            Event::ToolCall(c) => {
                self.end_reasoning(&mut out);
                let _ = writeln!(out, "\n[tool call] {}({})", c.name, c.arguments_json());
            }
        }
        let _ = out.flush();
    }

    fn end_reasoning(&mut self, out: &mut impl Write) {
        if self.in_reasoning {
            let _ = write!(out, "{}\n\n", if self.tty { "\x1b[0m" } else { "" });
            self.in_reasoning = false;
        }
    }

    pub fn finish(&mut self) {
        let mut out = std::io::stdout().lock();
        self.end_reasoning(&mut out);
        let _ = writeln!(out);
    }
}

pub fn stats_line(g: &Generation) -> String {
    let s = &g.stats;
    format!(
        "prompt {} tok ({} cached) | ttft {:.0} ms | prefill {:.1} tok/s | decode {:.1} tok/s | {} tok generated | finish {}",
        s.prompt_tokens,
        s.cached_tokens,
        s.ttft.as_secs_f64() * 1e3,
        s.prefill_tok_s(),
        s.decode_tok_s(),
        s.generated_tokens,
        g.finish.as_str()
    )
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let prompt_text = match &a.prompt {
        Some(p) => p.clone(),
        None => {
            let mut t = String::new();
            std::io::stdin()
                .read_to_string(&mut t)
                .context("reading the prompt from stdin")?;
            t
        }
    };
    if prompt_text.is_empty() && a.system.is_none() {
        bail!("empty prompt: give --prompt TEXT or text on stdin");
    }
    let r = Runner::load(&a.model, &a.device)?;
    let think = !a.no_think && !a.raw;
    let prompt = if a.raw {
        r.assets.tokenizer.encode(&prompt_text)?
    } else {
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(json!({"role": "system", "content": s}));
        }
        msgs.push(json!({"role": "user", "content": prompt_text}));
        r.chat_prompt(&msgs, think)?
    };
    let mut printer = Printer::new(!a.hide_reasoning);
    let json_mode = a.json;
    let mut seqs = Sequences::new(CacheOptions::off());
    let (g, calls) = r.run(&mut seqs, prompt, think, &a.sampling, &mut |e| {
        if json_mode {
            match &e {
                Event::Reasoning(t) => printer.reasoning.push_str(t),
                Event::Content(t) => printer.content.push_str(t),
                Event::ToolCall(_) => {}
            }
        } else {
            printer.event(&e);
        }
        true
    })?;
    if json_mode {
        let j = json!({
            "text": g.text,
            "reasoning": printer.reasoning,
            "content": printer.content,
            "tool_calls": calls.iter().map(|c| json!({"name": c.name, "arguments": c.arguments_json()})).collect::<Vec<_>>(),
            "finish_reason": g.finish.as_str(),
            "tokens": g.tokens,
            "usage": {"prompt_tokens": g.stats.prompt_tokens, "completion_tokens": g.stats.generated_tokens},
            "ttft_ms": g.stats.ttft.as_secs_f64() * 1e3,
            "prefill_tok_s": g.stats.prefill_tok_s(),
            "decode_tok_s": g.stats.decode_tok_s(),
        });
        println!("{j}");
    } else {
        printer.finish();
    }
    eprintln!("{}", stats_line(&g));
    Ok(())
}
