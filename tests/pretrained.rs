//! A Hugging Face model folder as the unit: `tokenizer.json` through the
//! `tokenizers` crate gives the ids Python's `tokenizers` gave
//! (`tests/fixtures/hf/llama-tokenizer/tokenizer_cases.json`),
//! `Llama::from_pretrained` checks config, tokenizer and weights against each
//! other before loading, places the model resident or streamed, and the model
//! fine-tunes on a corpus tokenized by its own tokenizer.
use super::families::fixture;
use super::models::{err_of, fail};
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::ParamsAdamW;
use std::path::{Path, PathBuf};
use streamer_models::{
    train_loop, Decay, Llama, LmTrainer, LoopOptions, OptimizerPlace, Placement, Pretrained,
    TextTokenizer,
};

fn temp_dir(name: &str) -> Result<PathBuf> {
    crate::common::temp_dir("pretrained", name)
}

/// A copy of the tokenizer fixture's folder to edit.
fn copy_fixture(name: &str) -> Result<PathBuf> {
    let src = fixture("llama-tokenizer")?;
    let dst = temp_dir(name)?;
    for e in std::fs::read_dir(&src)? {
        let e = e?;
        std::fs::copy(e.path(), dst.join(e.file_name()))?;
    }
    Ok(dst)
}

fn tokenizer_matches_python_tokenizers(_dev: &Device) -> Result<()> {
    let dir = fixture("llama-tokenizer")?;
    let tok = TextTokenizer::from_file(dir.join("tokenizer.json"))?;
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_cases.json"))?)?;
    ensure!(tok.id_count() as u64 == cases["vocab_size"].as_u64().context("vocab_size")?);
    let list = cases["cases"].as_array().context("cases")?;
    ensure!(list.len() >= 4);
    for c in list {
        let text = c["text"].as_str().context("text")?;
        let want: Vec<u32> = serde_json::from_value(c["ids"].clone())?;
        let got = tok.encode(text)?;
        ensure!(got == want, "{text:?}: {got:?} vs Python's {want:?}");
        // Byte-level BPE: decoding gives the text back.
        ensure!(tok.decode(&got)? == text, "{text:?} decodes differently");
    }
    ensure!(tok.token_id("</s>").is_some() && tok.eos_id() == tok.token_id("</s>"));
    let e = err_of(TextTokenizer::from_file(dir.join("nope.json")))?;
    ensure!(e.contains("nope.json") && e.contains("tokenizer"), "{e}");
    let e = err_of(TextTokenizer::from_file(dir.join("config.json")))?;
    ensure!(e.contains("config.json"), "{e}");
    Ok(())
}
candle_streamer::test_device!(tokenizer_matches_python_tokenizers);

fn from_pretrained_resident_and_streamed_agree(dev: &Device) -> Result<()> {
    let dir = fixture("llama-tokenizer")?;
    let resident = Llama::from_pretrained(
        &dir,
        Placement::Resident {
            device: dev.clone(),
            dtype: DType::F32,
        },
    )?;
    ensure!(!resident.model.is_streamed());
    let tok = resident
        .tokenizer
        .as_ref()
        .context("the fixture has a tokenizer")?;
    ensure!(resident.eos_token_id == tok.token_id("</s>"));
    // A budget of one layer: streamed through a window of one.
    let one_layer = streamer_models::checkpoint::layer_bytes(resident.model.config(), DType::F32);
    let streamed = Llama::from_pretrained(
        &dir,
        Placement::Budget {
            device: dev.clone(),
            dtype: DType::F32,
            budget: one_layer,
        },
    )?;
    ensure!(streamed.model.is_streamed());
    let ids = tok.encode("a single man in possession of a good fortune")?;
    let x = Tensor::new(ids.as_slice(), dev)?.unsqueeze(0)?;
    let (a, b) = (resident.model.forward(&x)?, streamed.model.forward(&x)?);
    let d = (&a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
    ensure!(d < 1e-5, "resident vs streamed: {d}");
    // A cached decode of the streamed model (on a GPU its untied embedding's
    // rows are looked up in host memory) gives the same logits, and records
    // no graph there: one would keep every layer's activations alive.
    let c = streamed.model.forward_cached(&x)?;
    streamed.model.clear_cache()?;
    let d = (&a - &c)?.abs()?.max_all()?.to_scalar::<f32>()?;
    ensure!(d < 1e-5, "resident vs streamed, cached: {d}");
    ensure!(!c.track_op(), "a cached streamed decode recorded a graph");
    let big = Llama::from_pretrained(
        &dir,
        Placement::Budget {
            device: dev.clone(),
            dtype: DType::F32,
            budget: 1 << 30,
        },
    )?;
    ensure!(!big.model.is_streamed());
    Ok(())
}
candle_streamer::test_device!(from_pretrained_resident_and_streamed_agree);

/// A weight budget holding 3 of the tiny preset's 4 layers keeps the first
/// resident and streams the other 3 through a window of two: its logits equal
/// the resident model's, a forward copies 3 layers' bytes, and it does not
/// train. A budget of 2 layers streams all 4 through them.
fn from_pretrained_budget_keeps_first_layers(dev: &Device) -> Result<()> {
    use streamer_models::{checkpoint::layer_bytes, init_weights, split_for_budget, LlamaConfig};
    let cfg = LlamaConfig::preset("tiny")?;
    let dir = temp_dir("budget-split")?;
    std::fs::write(dir.join("config.json"), cfg.to_json()?)?;
    candle_core::safetensors::save(&init_weights(&cfg, 5)?, dir.join("model.safetensors"))?;
    let layer = layer_bytes(&cfg, DType::F32);
    ensure!(split_for_budget(&cfg, DType::F32, 3 * layer)? == (1, 1));
    ensure!(split_for_budget(&cfg, DType::F32, 2 * layer)? == (1, 0));
    let budget = |layers: usize| Placement::Budget {
        device: dev.clone(),
        dtype: DType::F32,
        budget: layers * layer,
    };
    let place = |p| Llama::from_pretrained(&dir, p).map(|p| p.model);
    let resident = place(budget(4))?;
    let split = place(budget(3))?;
    ensure!(!resident.is_streamed() && split.is_streamed());
    let x = Tensor::new(&[[3u32, 1, 4, 1, 5, 9, 2, 6]], dev)?;
    let bytes = |m: &Llama| -> Result<u64> { Ok(m.stats()?.context("streamed")?.h2d_bytes) };
    let before = bytes(&split)?;
    let (a, b) = (resident.forward(&x)?, split.forward(&x)?);
    let d = (&a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
    ensure!(d < 1e-5, "resident vs split: {d}");
    let copied = bytes(&split)? - before;
    ensure!(
        copied == 3 * layer as u64,
        "a forward copied {copied} bytes, 3 layers are {}",
        3 * layer
    );
    let e = err_of(split.into_trainable())?;
    ensure!(e.contains("streamed_keeping"), "{e}");
    let all = place(budget(2))?;
    let (a2, b2) = (a, all.forward(&x)?);
    let d = (&a2 - b2)?.abs()?.max_all()?.to_scalar::<f32>()?;
    ensure!(d < 1e-5, "resident vs streamed: {d}");
    Ok(())
}
candle_streamer::test_device!(from_pretrained_budget_keeps_first_layers);

fn load_cpu(dir: &Path) -> candle_core::Result<Pretrained> {
    Llama::from_pretrained(
        dir,
        Placement::Resident {
            device: Device::Cpu,
            dtype: DType::F32,
        },
    )
}

fn from_pretrained_loads_a_weights_only_folder(_dev: &Device) -> Result<()> {
    // A folder written with config.json and model.safetensors only (a base
    // whose tokenizer lives elsewhere): it loads without a tokenizer, and
    // gives the whole folder's logits on ids from a tokenizer read separately.
    let whole_dir = fixture("llama-tokenizer")?;
    let d = temp_dir("weights-only")?;
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(whole_dir.join(f), d.join(f))?;
    }
    let bare = load_cpu(&d)?;
    ensure!(bare.tokenizer.is_none() && bare.files.tokenizer.is_none());
    let tok = TextTokenizer::from_file(whole_dir.join("tokenizer.json"))?;
    let ids = tok.encode("a single man in possession of a good fortune")?;
    let x = Tensor::new(ids.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
    let whole = load_cpu(&whole_dir)?;
    let diff = (bare.model.forward(&x)? - whole.model.forward(&x)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    ensure!(diff == 0.0, "weights-only folder: logits differ by {diff}");
    Ok(())
}
candle_streamer::test_device!(from_pretrained_loads_a_weights_only_folder);

fn from_pretrained_names_a_bad_weights_file_once(_dev: &Device) -> Result<()> {
    let d = copy_fixture("bad-weights")?;
    let w = d.join("model.safetensors");
    std::fs::write(&w, b"not a safetensors file")?;
    let err = fail(load_cpu(&d))?;
    ensure!(
        matches!(streamer_device::Error::find(&err),
            Some(streamer_device::Error::Checkpoint { path, .. }) if *path == w),
        "{err}"
    );
    let e = err.to_string();
    let path = w.display().to_string();
    ensure!(e.matches(path.as_str()).count() == 1, "{e}");
    ensure!(e.contains("cannot read it as safetensors"), "{e}");
    Ok(())
}
candle_streamer::test_device!(from_pretrained_names_a_bad_weights_file_once);

fn from_pretrained_mismatches_are_named(_dev: &Device) -> Result<()> {
    // A config whose vocabulary is smaller than the tokenizer's.
    let d = copy_fixture("small-vocab")?;
    let p = d.join("config.json");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p)?)?;
    c["vocab_size"] = 200.into();
    std::fs::write(&p, c.to_string())?;
    let e = err_of(load_cpu(&d))?;
    for w in [
        "vocabulary mismatch",
        "300 token ids",
        "vocab_size = 200",
        "config.json",
        "tokenizer.json",
    ] {
        ensure!(e.contains(w), "missing {w:?}: {e}");
    }
    // A larger config vocabulary (padded embedding) passes the tokenizer check
    // and fails on the weights' shape, naming the tensor.
    c["vocab_size"] = 320.into();
    std::fs::write(&p, c.to_string())?;
    let e = err_of(load_cpu(&d))?;
    ensure!(
        e.contains("model.embed_tokens.weight") && e.contains("vocab_size"),
        "{e}"
    );
    // No weights, no config.
    let d = copy_fixture("no-weights")?;
    std::fs::remove_file(d.join("model.safetensors"))?;
    let e = err_of(load_cpu(&d))?;
    ensure!(e.contains("model.safetensors.index.json"), "{e}");
    std::fs::remove_file(d.join("config.json"))?;
    ensure!(err_of(load_cpu(&d))?.contains("config.json"));
    ensure!(err_of(load_cpu(&d.join("absent")))?.contains("absent"));
    Ok(())
}
candle_streamer::test_device!(from_pretrained_mismatches_are_named);

fn tokenized_corpora_text_and_jsonl(_dev: &Device) -> Result<()> {
    let tok = TextTokenizer::from_file(fixture("llama-tokenizer")?.join("tokenizer.json"))?;
    let d = temp_dir("corpus")?;
    let eos = tok.token_id("</s>").context("eos")?;
    std::fs::write(d.join("a.txt"), "Hello, world!")?;
    let c = tok.corpus_from_file(d.join("a.txt"), None)?;
    ensure!(c.len() == tok.encode("Hello, world!")?.len());
    std::fs::write(
        d.join("b.jsonl"),
        "{\"text\": \"Hello, world!\"}\n\n{\"text\": \"a single man\", \"id\": 2}\n",
    )?;
    let c = tok.corpus_from_file(d.join("b.jsonl"), Some(eos))?;
    let (h, m) = (tok.encode("Hello, world!")?, tok.encode("a single man")?);
    let want: Vec<u32> = [h, vec![eos], m, vec![eos]].concat();
    ensure!(
        c.tokens() == want.as_slice(),
        "{:?} vs {want:?}",
        c.tokens()
    );
    std::fs::write(
        d.join("c.jsonl"),
        "{\"text\": \"ok\"}\n{\"body\": \"no\"}\n",
    )?;
    let e = err_of(tok.corpus_from_file(d.join("c.jsonl"), None))?;
    ensure!(
        e.contains("c.jsonl") && e.contains("line 2") && e.contains("\"text\""),
        "{e}"
    );
    std::fs::write(d.join("d.jsonl"), "{\"text\": 3}\nnot json\n")?;
    let e = err_of(tok.corpus_from_file(d.join("d.jsonl"), None))?;
    ensure!(e.contains("line 1"), "{e}");
    Ok(())
}
candle_streamer::test_device!(tokenized_corpora_text_and_jsonl);

/// Full fine-tuning of the folder's model, streamed with host AdamW, on text
/// tokenized by its tokenizer: the loss falls.
fn from_pretrained_fine_tunes_on_its_tokenizer(dev: &Device) -> Result<()> {
    let dir = fixture("llama-tokenizer")?;
    let stream = crate::common::stream(dev, DType::F32, 1);
    let p = Llama::from_pretrained(&dir, Placement::Streamed(stream))?;
    let d = temp_dir("finetune")?;
    let text = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. ";
    std::fs::write(d.join("corpus.txt"), text.repeat(8))?;
    let corpus = p
        .tokenizer
        .as_ref()
        .context("the fixture has a tokenizer")?
        .corpus_from_file(d.join("corpus.txt"), None)?;
    let adam = ParamsAdamW {
        lr: 1e-2,
        ..Default::default()
    };
    let mut trainer = LmTrainer::new(p.model, adam)?;
    let opts = crate::common::loop_options(12, 16);
    let losses = train_loop(&mut trainer, &corpus, &opts, |_| {})?;
    let (first, last) = (losses[0].1, losses[losses.len() - 1].1);
    ensure!(last < 0.7 * first, "loss {first} -> {last}");
    Ok(())
}
candle_streamer::test_device!(from_pretrained_fine_tunes_on_its_tokenizer);

/// A folder loaded resident fine-tunes with the same trainer as a streamed
/// one (its weights become variables; the optimizer on the host for a CPU
/// model, on the device for a GPU one) and gives the streamed run's losses.
fn from_pretrained_resident_fine_tunes_as_streamed(dev: &Device) -> Result<()> {
    let dir = fixture("llama-tokenizer")?;
    let d = temp_dir("finetune-resident")?;
    let text = "It is a truth universally acknowledged, that a single man in possession of a good fortune. ";
    std::fs::write(d.join("corpus.txt"), text.repeat(8))?;
    let place = if dev.is_cpu() {
        OptimizerPlace::Host
    } else {
        OptimizerPlace::Device
    };
    let opts = LoopOptions {
        warmup: 3,
        decay: Decay::Cosine { min_ratio: 0.1 },
        ..crate::common::loop_options(10, 16)
    };
    let adam = ParamsAdamW {
        lr: opts.lr,
        ..Default::default()
    };
    let mut curves = Vec::new();
    for placement in [
        Placement::Resident {
            device: dev.clone(),
            dtype: DType::F32,
        },
        Placement::Streamed(super::families::stream(dev, DType::F32)),
    ] {
        let p = Llama::from_pretrained(&dir, placement)?;
        let corpus = p
            .tokenizer
            .as_ref()
            .context("the fixture has a tokenizer")?
            .corpus_from_file(d.join("corpus.txt"), None)?;
        let mut trainer = LmTrainer::new_on(p.model, adam.clone(), place)?;
        ensure!(
            trainer.model().parameters().len() == trainer.model().config().weight_shapes().len(),
            "every weight is a parameter"
        );
        curves.push(train_loop(&mut trainer, &corpus, &opts, |_| {})?);
    }
    let (resident, streamed) = (&curves[0], &curves[1]);
    for ((s, r), (_, st)) in resident.iter().zip(streamed) {
        let e = ((r - st) / st).abs();
        ensure!(e <= 1e-4, "step {s}: resident loss {r} vs streamed {st}");
    }
    let (first, last) = (resident[0].1, resident[resident.len() - 1].1);
    ensure!(last < 0.8 * first, "loss {first} -> {last}");
    Ok(())
}
candle_streamer::test_device!(from_pretrained_resident_fine_tunes_as_streamed);
