//! Chat templates: a model folder's Jinja template that turns `messages`
//! into the prompt text the model was tuned on, rendered as transformers'
//! `apply_chat_template` renders it (`trim_blocks`, `lstrip_blocks`, loop
//! controls, `raise_exception`, the `bos_token` / `eos_token` strings and
//! `add_generation_prompt`), with Python's string methods that templates call.
//!
//! The template comes from `chat_template.jinja` or `tokenizer_config.json`'s
//! `chat_template` (a string, or a list of named templates of which `default`
//! is used). Tools, documents and multimodal content are not supported: a
//! message is a `role` and a text `content`.
//!
//! ```
//! use streamer_models::{ChatMessage, ChatTemplate};
//! let t = ChatTemplate::new(
//!     "{% for m in messages %}<{{ m.role }}>{{ m.content.strip() }}{% endfor %}\
//!      {% if add_generation_prompt %}<assistant>{% endif %}",
//!     "",
//!     "",
//! );
//! let text = t.render(&[ChatMessage::new("user", " Hi ")], true)?;
//! assert_eq!(text, "<user>Hi<assistant>");
//! # Ok::<(), candle_core::Error>(())
//! ```
use candle_core::{bail, Result};
use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde::Serialize;
use serde_json::Value;
use std::path::Path;

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ... (the template decides what it accepts).
    pub role: String,
    /// The message's text.
    pub content: String,
}

impl ChatMessage {
    /// A message of `role` saying `content`.
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A chat template and the special tokens' text it may insert.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    source: String,
    bos: String,
    eos: String,
}

impl ChatTemplate {
    /// A template from its Jinja source and the `bos_token` / `eos_token` text.
    pub fn new(source: &str, bos: &str, eos: &str) -> Self {
        Self {
            source: source.into(),
            bos: bos.into(),
            eos: eos.into(),
        }
    }

    /// The template of a Hugging Face folder (`chat_template.jinja`, else
    /// `tokenizer_config.json`'s `chat_template`); `None` when it has none.
    pub fn from_folder(dir: &Path) -> Result<Option<Self>> {
        let config = dir.join("tokenizer_config.json");
        let cfg: Value = match std::fs::read_to_string(&config) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", config.display())))?,
            Err(_) => Value::Null,
        };
        let token = |key: &str| match &cfg[key] {
            Value::String(s) => s.clone(),
            Value::Object(o) => o
                .get("content")
                .and_then(Value::as_str)
                .unwrap_or("")
                .into(),
            _ => String::new(),
        };
        let jinja = dir.join("chat_template.jinja");
        let source = match std::fs::read_to_string(&jinja) {
            Ok(s) => s,
            Err(_) => match named_template(&cfg["chat_template"], &config)? {
                Some(s) => s,
                None => return Ok(None),
            },
        };
        Ok(Some(Self::new(
            &source,
            &token("bos_token"),
            &token("eos_token"),
        )))
    }

    /// The prompt text of `messages`, ending with the assistant's turn
    /// opened when `add_generation_prompt`. A template's
    /// `raise_exception(...)` (e.g. roles that do not alternate) and Jinja
    /// errors come back as errors with the template's message.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
            },
        );
        let ctx = minijinja::context! {
            messages => messages,
            bos_token => &self.bos,
            eos_token => &self.eos,
            add_generation_prompt => add_generation_prompt,
        };
        env.render_str(&self.source, ctx)
            .map_err(|e| candle_core::Error::Msg(format!("chat template: {}", describe(&e))))
    }
}

/// A Jinja error's own message (a template's `raise_exception` text first).
fn describe(e: &JinjaError) -> String {
    match e.detail() {
        Some(d) => d.to_string(),
        None => e.to_string(),
    }
}

/// `chat_template` as a string, or the `default` of a list of
/// `{name, template}`; `None` when absent.
fn named_template(v: &Value, config: &Path) -> Result<Option<String>> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        Value::Array(list) => {
            let named = |n: &str| {
                list.iter()
                    .find(|t| t["name"] == n)
                    .and_then(|t| t["template"].as_str())
            };
            match named("default") {
                Some(s) => Ok(Some(s.into())),
                None => bail!(
                    "{}: chat_template lists no template named \"default\" (names: {:?})",
                    config.display(),
                    list.iter()
                        .filter_map(|t| t["name"].as_str())
                        .collect::<Vec<_>>()
                ),
            }
        }
        other => bail!(
            "{}: chat_template must be a string or a list of named templates, got {other}",
            config.display()
        ),
    }
}
