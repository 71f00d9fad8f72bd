//! Chat templates (`ChatTemplate`) against jinja2 set up as transformers'
//! `apply_chat_template` sets it up, on the cases
//! `tests/fixtures/make_chat_templates.py` wrote: ChatML, Llama 3 and Mistral
//! styles, with and without the generation prompt, and a template's
//! `raise_exception`; and how a folder's template is found.
use anyhow::{ensure, Context, Result};
use serde_json::Value;
use std::path::PathBuf;
use streamer_models::{ChatMessage, ChatTemplate};

fn fixtures() -> Result<Value> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat/templates.json");
    Ok(serde_json::from_str(
        &std::fs::read_to_string(&p).context("templates.json")?,
    )?)
}

#[test]
fn chat_templates_render_as_jinja2() -> Result<()> {
    let f = fixtures()?;
    let cases = f["cases"].as_array().context("cases")?;
    ensure!(cases.len() == 24, "{} cases", cases.len());
    for (i, c) in cases.iter().enumerate() {
        let t = &f["templates"][c["template"].as_str().context("template")?];
        let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
        let template = ChatTemplate::new(&s(&t["source"]), &s(&t["bos"]), &s(&t["eos"]));
        let messages: Vec<ChatMessage> = c["messages"]
            .as_array()
            .context("messages")?
            .iter()
            .map(|m| ChatMessage::new(&s(&m["role"]), &s(&m["content"])))
            .collect();
        let got = template.render(&messages, c["add_generation_prompt"] == true);
        match (&c["text"], got) {
            (Value::String(want), Ok(got)) => {
                ensure!(
                    &got == want,
                    "case {i} ({}): {got:?} != {want:?}",
                    c["template"]
                )
            }
            (Value::Null, Err(e)) => {
                let want = s(&c["error"]);
                ensure!(
                    e.to_string().contains(&want),
                    "case {i}: {e} lacks {want:?}"
                )
            }
            (want, got) => anyhow::bail!("case {i}: jinja2 gave {want}, ours {got:?}"),
        }
    }
    Ok(())
}

/// `chat_template.jinja` first, else `tokenizer_config.json`'s string or
/// named list (its `default`), the special tokens as strings or objects;
/// none at all is `None`, a list without `default` an error naming the names.
#[test]
fn chat_template_found_in_folders() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("chat-template-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let cfg = dir.join("tokenizer_config.json");
    let hi = [ChatMessage::new("user", "hi")];
    ensure!(
        ChatTemplate::from_folder(&dir)?.is_none(),
        "no files, no template"
    );
    std::fs::write(
        &cfg,
        r#"{"chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
            "bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>"}"#,
    )?;
    let t = ChatTemplate::from_folder(&dir)?.context("string template")?;
    ensure!(t.render(&hi, true)? == "<s>hi</s>");
    std::fs::write(
        &cfg,
        r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages|length }}"}]}"#,
    )?;
    let t = ChatTemplate::from_folder(&dir)?.context("named list")?;
    ensure!(t.render(&hi, true)? == "D1");
    std::fs::write(dir.join("chat_template.jinja"), "J{{ messages[0].role }}")?;
    let t = ChatTemplate::from_folder(&dir)?.context("jinja file")?;
    ensure!(t.render(&hi, true)? == "Juser");
    std::fs::remove_file(dir.join("chat_template.jinja"))?;
    std::fs::write(
        &cfg,
        r#"{"chat_template": [{"name": "rag", "template": "R"}]}"#,
    )?;
    let e = ChatTemplate::from_folder(&dir)
        .expect_err("no default")
        .to_string();
    ensure!(e.contains("\"default\"") && e.contains("rag"), "{e}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
