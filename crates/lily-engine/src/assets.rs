//! The text side of a model: tokenizer, chat template and generation defaults,
//! from the checkpoint directory, or Lily's built-in Qwen3.6 ones.

use anyhow::{bail, Result};
use lily_model::chat_template::ChatTemplate;
use lily_model::tokenizer::Tokenizer;
use lily_model::ModelSource;

use crate::sampling::GenerationConfig;

pub struct TextAssets {
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    pub generation: GenerationConfig,
}

impl TextAssets {
    /// `vocab_rows`: the model's embedding rows; a tokenizer with more ids
    /// than that cannot drive the model.
    pub fn load(source: &ModelSource, vocab_rows: usize) -> Result<TextAssets> {
        let builtin = || TextAssets {
            tokenizer: Tokenizer::builtin(),
            template: ChatTemplate::builtin(),
            generation: GenerationConfig::qwen_default(),
        };
        let a = match source {
            ModelSource::Synthetic(_) => builtin(),
            ModelSource::Dir(dir) => {
                let tokenizer = if dir.join("tokenizer.json").exists() {
                    Tokenizer::from_dir(dir)?
                } else {
                    let t = Tokenizer::builtin();
                    if t.len() > vocab_rows {
                        bail!(
                            "{} has no tokenizer.json, and the built-in Qwen3.6 tokenizer ({} ids) does not fit the model's {vocab_rows} vocabulary rows",
                            dir.display(),
                            t.len()
                        );
                    }
                    t
                };
                let template = ChatTemplate::from_dir(dir)?.unwrap_or_else(ChatTemplate::builtin);
                let mut generation =
                    GenerationConfig::from_dir(dir)?.unwrap_or_else(GenerationConfig::qwen_default);
                if generation.eos_token_ids.is_empty() {
                    generation.eos_token_ids = GenerationConfig::qwen_default().eos_token_ids;
                }
                TextAssets {
                    tokenizer,
                    template,
                    generation,
                }
            }
        };
        if a.tokenizer.len() > vocab_rows {
            bail!(
                "the tokenizer has {} ids but the model only {vocab_rows} vocabulary rows",
                a.tokenizer.len()
            );
        }
        Ok(a)
    }
}
