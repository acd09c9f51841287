//! `lily chat`: an interactive conversation. Each turn goes through the chat
//! template with the whole history; Ctrl-C stops the answer being written,
//! not the program; end of input exits.

use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Result;
use clap::Args;
use lily_engine::generate::Generation;
use lily_engine::sequences::{CacheOptions, Sequences};
use serde_json::{json, Value};

use crate::generate::{stats_line, Printer, Runner, SamplingArgs};
use crate::{DeviceArgs, ModelArgs};

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// A system message for the conversation
    #[arg(long)]
    pub system: Option<String>,
    /// Start with thinking off (toggle with /think and /no_think)
    #[arg(long)]
    pub no_think: bool,
    /// Do not print the reasoning
    #[arg(long)]
    pub hide_reasoning: bool,
    /// Memory the prompt cache may hold, in MiB (0 turns it off) [default:
    /// on a GPU, half of the device memory left free, at most 16 GiB; 2 GiB of host memory on the CPU]
    #[arg(long)]
    pub prompt_cache_mib: Option<usize>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

const HELP: &str = "commands: /think  /no_think  /reset  /system TEXT  /stats  /help  /exit  (Ctrl-C stops an answer, Ctrl-D exits)";

pub fn run(a: ChatArgs) -> Result<()> {
    let r = Runner::load(&a.model, &a.device)?;
    // each turn resumes after the previous one instead of prefilling the conversation again
    let cache_mib = match a.prompt_cache_mib {
        Some(m) => m,
        None => r.model.prompt_cache_default_mib()?,
    };
    let mut seqs = Sequences::new(CacheOptions::mib(cache_mib));
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        // Ctrl-C cancels the answer in progress; at the prompt it is ignored.
        ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))?;
    }
    let tty = std::io::stdin().is_terminal();
    let mut think = !a.no_think;
    let mut system = a.system.clone();
    let mut history: Vec<Value> = Vec::new();
    let mut last: Option<Generation> = None;
    if tty {
        eprintln!("lily chat: {HELP}");
    }
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        if tty {
            eprint!("{}> ", if think { "" } else { "(no think) " });
            let _ = std::io::stderr().flush();
        }
        let Some(line) = lines.next() else { break };
        let line = line?;
        interrupted.store(false, Ordering::SeqCst);
        let input = line.trim();
        if input.is_empty() {
            continue;
        }
        if let Some(cmd) = input.strip_prefix('/') {
            let (name, arg) = cmd
                .split_once(' ')
                .map(|(n, a)| (n, a.trim()))
                .unwrap_or((cmd, ""));
            match name {
                "think" => {
                    think = true;
                    eprintln!("thinking on");
                }
                "no_think" | "nothink" => {
                    think = false;
                    eprintln!("thinking off");
                }
                "reset" => {
                    history.clear();
                    eprintln!("conversation cleared");
                }
                "system" => {
                    system = (!arg.is_empty()).then(|| arg.to_string());
                    history.clear();
                    eprintln!(
                        "{} (conversation cleared)",
                        if system.is_some() {
                            "system message set"
                        } else {
                            "system message removed"
                        }
                    );
                }
                "stats" => match &last {
                    Some(g) => eprintln!("{}", stats_line(g)),
                    None => eprintln!("no answer yet"),
                },
                "exit" | "quit" => break,
                "help" => eprintln!("{HELP}"),
                other => eprintln!("unknown command /{other}; {HELP}"),
            }
            continue;
        }
        let mut msgs: Vec<Value> = system
            .iter()
            .map(|s| json!({"role": "system", "content": s}))
            .collect();
        msgs.extend(history.iter().cloned());
        msgs.push(json!({"role": "user", "content": input}));
        let prompt = match r.chat_prompt(&msgs, think) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("error: {e:#}");
                continue;
            }
        };
        let mut printer = Printer::new(!a.hide_reasoning);
        let stop = interrupted.clone();
        let res = r.run(&mut seqs, prompt, think, &a.sampling, &mut |e| {
            printer.event(&e);
            !stop.load(Ordering::SeqCst)
        });
        printer.finish();
        match res {
            Ok((g, _calls)) => {
                if interrupted.load(Ordering::SeqCst) {
                    eprintln!("[stopped]");
                }
                history.push(json!({"role": "user", "content": input}));
                history.push(json!({"role": "assistant", "content": printer.content, "reasoning_content": printer.reasoning}));
                last = Some(g);
            }
            Err(e) => eprintln!("error: {e:#}"),
        }
    }
    Ok(())
}
