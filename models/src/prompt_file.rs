//! A JSONL file of prompts and the JSONL file of their results, for batch
//! generation (`examples/generate.rs --prompts`): parsing each input line,
//! one output line per input line, and resuming an interrupted run.
//!
//! Input: one JSON object a line with `prompt` (text) or chat `messages` (a
//! list of `{"role": ..., "content": ...}`, rendered by the model's chat
//! template, [`crate::ChatTemplate`]) and optionally `max_tokens`,
//! `temperature`, `top_p`, `seed` and `stop` (a string or a list of strings);
//! `id` and `metadata` are copied to the output unread. Any other field (of a
//! line or of a message) is an error naming it: it might have been meant to
//! change the result. Blank lines are skipped.
//!
//! Output: `{"line": N, ...}` per input line `N` (1-based), with `text`,
//! `prompt_tokens`, `tokens` and `finish_reason`, or `error`. Each is
//! appended in one write and synced, so a run killed at any point leaves
//! complete lines and at most one partial last line, which
//! [`OutputFile::open_resume`] cuts off before appending again.
//!
//! ```
//! use streamer_models::prompt_file::{parse_prompt_line, PromptLine};
//! let p = parse_prompt_line(3, r#"{"prompt": "Hi", "max_tokens": 5, "stop": "\n"}"#)?;
//! assert_eq!((p.line, p.prompt.as_str(), p.max_tokens, p.stop), (3, "Hi", Some(5), vec!["\n".to_string()]));
//! let e = parse_prompt_line(4, r#"{"prompt": "Hi", "logprobs": 2}"#).unwrap_err();
//! assert!(e.to_string().contains("line 4") && e.to_string().contains("`logprobs`"));
//! # Ok::<(), candle_core::Error>(())
//! ```
use crate::ChatMessage;
use candle_core::Result;
use serde_json::{Map, Value};
use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

/// One input line.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptLine {
    /// Its line number in the file (1-based).
    pub line: usize,
    /// The text to continue (empty when `messages` is given).
    pub prompt: String,
    /// A conversation to render with the chat template instead.
    pub messages: Option<Vec<ChatMessage>>,
    /// New tokens at most (default: the command's).
    pub max_tokens: Option<usize>,
    /// Sampling temperature (default: the command's).
    pub temperature: Option<f64>,
    /// Nucleus mass (default: the command's).
    pub top_p: Option<f64>,
    /// Sampling seed (default: the command's).
    pub seed: Option<u64>,
    /// Strings that end the generation; the text is cut before the first.
    pub stop: Vec<String>,
    /// `id` and `metadata` as given, for the output line.
    pub passthrough: Map<String, Value>,
}

/// Parses input line `line` (1-based) of a prompts file. Errors name the line
/// and the field.
pub fn parse_prompt_line(line: usize, text: &str) -> Result<PromptLine> {
    let v: Value = serde_json::from_str(text)
        .map_err(|e| candle_core::Error::Msg(format!("line {line}: not valid JSON: {e}")))?;
    // Plain messages (no `bail!`): they go into output lines, where a
    // captured backtrace (RUST_BACKTRACE) does not belong.
    let Value::Object(obj) = v else {
        return Err(msg(format!(
            "line {line}: expected a JSON object with a \"prompt\", got {v}"
        )));
    };
    let mut p = PromptLine {
        line,
        prompt: String::new(),
        messages: None,
        max_tokens: None,
        temperature: None,
        top_p: None,
        seed: None,
        stop: Vec::new(),
        passthrough: Map::new(),
    };
    let mut prompt = None;
    for (k, v) in obj {
        let bad = |want: &str| format!("line {line}: `{k}` must be {want}, got {v}");
        match k.as_str() {
            "prompt" => prompt = Some(v.as_str().ok_or_else(|| msg(bad("a string")))?.to_string()),
            "max_tokens" => {
                p.max_tokens = Some(
                    v.as_u64()
                        .ok_or_else(|| msg(bad("a non-negative integer")))?
                        as usize,
                )
            }
            "temperature" => {
                p.temperature =
                    Some(number(&v, 0.0, f64::INFINITY).ok_or_else(|| msg(bad("a number >= 0")))?)
            }
            "top_p" => {
                p.top_p = Some(number(&v, 0.0, 1.0).ok_or_else(|| msg(bad("a number in [0, 1]")))?)
            }
            "seed" => {
                p.seed = Some(
                    v.as_u64()
                        .ok_or_else(|| msg(bad("a non-negative integer")))?,
                )
            }
            "stop" => {
                p.stop =
                    stops(&v).ok_or_else(|| msg(bad("a non-empty string or a list of them")))?
            }
            "id" | "metadata" => {
                p.passthrough.insert(k, v);
            }
            "messages" => p.messages = Some(messages(line, &v)?),
            _ => {
                return Err(msg(format!(
                    "line {line}: unsupported field `{k}` (known: prompt, messages, max_tokens, \
                 temperature, top_p, seed, stop, id, metadata)"
                )))
            }
        }
    }
    match (prompt, &p.messages) {
        (Some(text), None) => p.prompt = text,
        (None, Some(_)) => {}
        (Some(_), Some(_)) => {
            return Err(msg(format!(
                "line {line}: give \"prompt\" or \"messages\", not both"
            )))
        }
        (None, None) => {
            return Err(msg(format!(
                "line {line}: no \"prompt\" or \"messages\" field"
            )))
        }
    }
    Ok(p)
}

/// A line's `messages`: a non-empty list of `{"role", "content"}` strings.
fn messages(line: usize, v: &Value) -> Result<Vec<ChatMessage>> {
    let list = match v.as_array() {
        Some(l) if !l.is_empty() => l,
        _ => {
            return Err(msg(format!(
                "line {line}: `messages` must be a non-empty list of {{\"role\", \"content\"}}, got {v}"
            )))
        }
    };
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let obj = m.as_object().ok_or_else(|| {
                msg(format!(
                    "line {line}: messages[{i}] must be an object, got {m}"
                ))
            })?;
            if let Some(k) = obj.keys().find(|k| *k != "role" && *k != "content") {
                return Err(msg(format!(
                    "line {line}: messages[{i}] has `{k}`, which is not supported (role and text \
                     content only)"
                )));
            }
            let field = |k: &str| {
                obj.get(k)
                    .and_then(Value::as_str)
                    .ok_or_else(|| msg(format!("line {line}: messages[{i}].{k} must be a string")))
            };
            Ok(ChatMessage::new(field("role")?, field("content")?))
        })
        .collect()
}

fn msg(s: String) -> candle_core::Error {
    candle_core::Error::Msg(s)
}

/// `v` as a finite number in `[lo, hi]`.
fn number(v: &Value, lo: f64, hi: f64) -> Option<f64> {
    v.as_f64()
        .filter(|x| x.is_finite() && (lo..=hi).contains(x))
}

/// `stop`: a string or a list of strings, none empty (an empty stop string
/// would end every generation at once).
fn stops(v: &Value) -> Option<Vec<String>> {
    let list = match v {
        Value::String(s) => vec![s.clone()],
        Value::Array(a) => a
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()?,
        _ => return None,
    };
    list.iter().all(|s| !s.is_empty()).then_some(list)
}

/// Where the earliest stop string of `stop` begins in `text`, if any.
pub fn find_stop(text: &str, stop: &[String]) -> Option<usize> {
    stop.iter().filter_map(|s| text.find(s.as_str())).min()
}

/// What became of one input line.
#[derive(Clone, Debug, PartialEq)]
pub enum LineOutcome<'a> {
    /// Generated text (cut before a stop string).
    Text {
        /// The text.
        text: &'a str,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Tokens generated.
        tokens: usize,
        /// `length`, `eos`, `stop` or `context`.
        finish_reason: &'a str,
    },
    /// Why the line has no result.
    Error(&'a str),
}

/// The output line (no newline) for input line `line`.
pub fn output_line(line: usize, passthrough: &Map<String, Value>, outcome: &LineOutcome) -> String {
    let mut o = Map::new();
    o.insert("line".into(), line.into());
    o.extend(passthrough.iter().map(|(k, v)| (k.clone(), v.clone())));
    match outcome {
        LineOutcome::Text {
            text,
            prompt_tokens,
            tokens,
            finish_reason,
        } => {
            o.insert("text".into(), (*text).into());
            o.insert("prompt_tokens".into(), (*prompt_tokens).into());
            o.insert("tokens".into(), (*tokens).into());
            o.insert("finish_reason".into(), (*finish_reason).into());
        }
        LineOutcome::Error(e) => {
            o.insert("error".into(), (*e).into());
        }
    }
    Value::Object(o).to_string()
}

/// An output file opened for appending results.
#[derive(Debug)]
pub struct OutputFile {
    file: File,
}

impl OutputFile {
    /// Opens (or creates) `path` and returns the input lines it already
    /// holds results for. A last line without its newline (a run killed
    /// mid-write) is cut off; a complete line that is not an output line
    /// of this format is an error naming it.
    pub fn open_resume(path: &Path) -> Result<(Self, BTreeSet<usize>)> {
        let ctx = |e: std::io::Error| msg(format!("{}: {e}", path.display()));
        let mut file = OpenOptions::new()
            .read(true)
            .create(true)
            .append(true)
            .open(path)
            .map_err(ctx)?;
        let mut text = String::new();
        file.read_to_string(&mut text).map_err(ctx)?;
        let complete = text.rfind('\n').map_or(0, |i| i + 1);
        let done = completed_lines(&text[..complete])
            .map_err(|e| msg(format!("{}: {e}", path.display())))?;
        if complete < text.len() {
            file.set_len(complete as u64).map_err(ctx)?;
            file.seek(SeekFrom::End(0)).map_err(ctx)?;
        }
        Ok((Self { file }, done))
    }

    /// Appends `line` and a newline in one write, then syncs it to disk.
    pub fn append(&mut self, line: &str) -> Result<()> {
        let mut buf = Vec::with_capacity(line.len() + 1);
        buf.extend_from_slice(line.as_bytes());
        buf.push(b'\n');
        self.file.write_all(&buf)?;
        self.file.sync_data()?;
        Ok(())
    }
}

/// The input line numbers that complete output lines `text` (each ending in
/// a newline) hold.
pub fn completed_lines(text: &str) -> Result<BTreeSet<usize>> {
    let mut done = BTreeSet::new();
    for (i, l) in text.lines().enumerate() {
        if l.trim().is_empty() {
            continue;
        }
        let line = serde_json::from_str::<Value>(l)
            .ok()
            .and_then(|v| v.get("line").and_then(Value::as_u64));
        match line {
            Some(n) => done.insert(n as usize),
            None => {
                return Err(msg(format!(
                    "output line {} is not a result of this command (no \"line\" number): {l:.80}",
                    i + 1
                )))
            }
        };
    }
    Ok(done)
}
