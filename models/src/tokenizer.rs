//! Hugging Face `tokenizer.json` files through the `tokenizers` crate (the
//! library transformers itself uses), and corpora tokenized by them for
//! fine-tuning: plain text, or JSONL with a `"text"` field per line.
use crate::config::LlamaConfig;
use crate::train::TokenCorpus;
use candle_core::{bail, Result};
use std::path::{Path, PathBuf};

/// A tokenizer read from a `tokenizer.json`.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("path", &self.path)
            .field("ids", &self.id_count())
            .finish()
    }
}

fn err(path: &Path, what: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("{}: {what}", path.display()))
}

impl TextTokenizer {
    /// Reads a `tokenizer.json`; a missing or unreadable file is an error
    /// naming it.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if !path.is_file() {
            bail!(
                "{}: no such tokenizer file (a Hugging Face tokenizer.json is needed for this model's vocabulary)",
                path.display()
            );
        }
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| err(path, format!("not a readable tokenizer.json: {e}")))?;
        Ok(Self {
            inner,
            path: path.to_path_buf(),
        })
    }

    /// The file it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One past the largest token id (added and special tokens included): the
    /// rows of the embedding this tokenizer needs.
    pub fn id_count(&self) -> usize {
        self.inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1)
    }

    /// Checks that every id fits the model's embedding: an error naming both
    /// files and both sizes when the tokenizer has more ids than
    /// `vocab_size`. A larger `vocab_size` is accepted: published models pad
    /// the embedding (Qwen2: 151936 rows for 151665 tokens).
    pub fn check_vocab(&self, cfg: &LlamaConfig, config_file: &Path) -> Result<()> {
        let n = self.id_count();
        if n > cfg.vocab_size {
            bail!(
                "vocabulary mismatch: {} has {n} token ids but {} has vocab_size = {} (ids {}..{n} \
                 would index past the embedding)",
                self.path.display(),
                config_file.display(),
                cfg.vocab_size,
                cfg.vocab_size
            );
        }
        Ok(())
    }

    /// Token ids of `text` (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let e = self
            .inner
            .encode(text, false)
            .map_err(|e| err(&self.path, format!("cannot encode: {e}")))?;
        Ok(e.get_ids().to_vec())
    }

    /// Text of `ids` (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| err(&self.path, format!("cannot decode {} ids: {e}", ids.len())))
    }

    /// The end-of-text id by its usual names (`</s>`, `<|endoftext|>`,
    /// `<|end_of_text|>`, `<eos>`), if the vocabulary has one.
    pub fn eos_id(&self) -> Option<u32> {
        ["</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>"]
            .iter()
            .find_map(|t| self.token_id(t))
    }

    /// The id of a token string, if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// A training corpus: the file's text encoded, or for a `.jsonl` file each
    /// line's `"text"` field encoded, the documents joined by `separator` (an
    /// end-of-text id) when given. Errors name the file and the line.
    pub fn corpus_from_file(
        &self,
        path: impl AsRef<Path>,
        separator: Option<u32>,
    ) -> Result<TokenCorpus> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| err(path, format!("cannot read the corpus as UTF-8 text: {e}")))?;
        let jsonl = path.extension().is_some_and(|e| e == "jsonl");
        let docs: Vec<String> = if jsonl {
            jsonl_texts(path, &text)?
        } else {
            vec![text]
        };
        let mut tokens = Vec::new();
        for d in &docs {
            tokens.extend(self.encode(d)?);
            tokens.extend(separator);
        }
        if tokens.is_empty() {
            bail!("{}: the corpus encodes to no tokens", path.display());
        }
        Ok(TokenCorpus::from_tokens(tokens))
    }
}

/// The `"text"` string of every non-blank line of a JSONL file.
fn jsonl_texts(path: &Path, text: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| err(path, format!("line {}: not JSON: {e}", i + 1)))?;
        match v.get("text") {
            Some(serde_json::Value::String(s)) => out.push(s.clone()),
            Some(other) => bail!(
                "{}: line {}: field \"text\" is not a string ({other})",
                path.display(),
                i + 1
            ),
            None => bail!(
                "{}: line {}: no field \"text\" (each line must be an object with a \"text\" string)",
                path.display(),
                i + 1
            ),
        }
    }
    Ok(out)
}
