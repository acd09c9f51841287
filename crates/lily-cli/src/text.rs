//! `lily tokenize` and `lily detokenize`.

use std::io::Read;

use anyhow::{Context, Result};
use clap::Args;
use lily_model::tokenizer::Tokenizer;
use lily_model::ModelSource;

use crate::ModelArgs;

#[derive(Args)]
pub struct TokenizeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Print a JSON array instead of space-separated ids
    #[arg(long)]
    pub json: bool,
    /// The text, or - to read it from stdin
    pub text: String,
}

#[derive(Args)]
pub struct DetokenizeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Drop special tokens such as <|im_end|>
    #[arg(long)]
    pub skip_special: bool,
    /// Ids, comma- or space-separated (or a JSON array); - reads them from stdin
    pub ids: String,
}

/// A checkpoint directory or any directory holding a tokenizer.json; the
/// synthetic models use the built-in Qwen3.6 vocabulary.
fn tokenizer(m: &ModelArgs) -> Result<Tokenizer> {
    match m.source() {
        ModelSource::Dir(d) => Tokenizer::from_dir(&d),
        ModelSource::Synthetic(_) => Ok(Tokenizer::builtin()),
    }
}

fn arg_or_stdin(s: &str) -> Result<String> {
    if s == "-" {
        let mut t = String::new();
        std::io::stdin()
            .read_to_string(&mut t)
            .context("reading stdin")?;
        Ok(t)
    } else {
        Ok(s.to_string())
    }
}

pub fn tokenize(a: TokenizeArgs) -> Result<()> {
    let tok = tokenizer(&a.model)?;
    let ids = tok.encode(&arg_or_stdin(&a.text)?)?;
    if a.json {
        println!("{}", serde_json::to_string(&ids)?);
    } else {
        println!(
            "{}",
            ids.iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    Ok(())
}

pub fn detokenize(a: DetokenizeArgs) -> Result<()> {
    let tok = tokenizer(&a.model)?;
    let raw = arg_or_stdin(&a.ids)?;
    let ids: Vec<u32> = raw
        .split(|c: char| c == ',' || c.is_whitespace() || c == '[' || c == ']')
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u32>()
                .with_context(|| format!("{s:?} is not a token id"))
        })
        .collect::<Result<_>>()?;
    print!("{}", tok.decode(&ids, a.skip_special)?);
    Ok(())
}
