//! The Llama decoder of `streamer-models`: resident and streamed execution agree,
//! the kv cache gives the logits of a full forward, checkpoints round-trip, bad
//! checkpoints fail with the tensor's name, training resumes exactly, and the tiny
//! preset learns.
use crate::common::stream;
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{ParamsAdamW, VarBuilder, VarMap};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use streamer_core::WeightSource;
use streamer_device::Error;
use streamer_models::{
    check_weights, generate, init_weights, parse_bytes, prefetch_for_budget, sample_token,
    train_loop, ByteCorpus, Llama, LlamaConfig, LmTrainer, LoopOptions, OptimizerPlace, SplitMix64,
};

/// A micro config: 3 layers of width 32, 4 query heads / 2 key-value heads of 8.
fn micro(tied: bool) -> LlamaConfig {
    LlamaConfig {
        max_position_embeddings: 64,
        tie_word_embeddings: tied,
        ..LlamaConfig::bytes(32, 3, 4, 2)
    }
}

fn tokens(dev: &Device, b: usize, n: usize, seed: u64) -> Result<Tensor> {
    let mut rng = SplitMix64::new(seed);
    let v: Vec<u32> = (0..b * n).map(|_| rng.below(256) as u32).collect();
    Ok(Tensor::from_vec(v, (b, n), dev)?)
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    // Host masters' gradients live on the CPU, resident ones on the device.
    let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    let b = b.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    Ok(a.sub(&b)?.abs()?.max_all()?.to_scalar::<f32>()?)
}

fn temp_dir(name: &str) -> Result<PathBuf> {
    crate::common::temp_dir("models", name)
}

/// The error text of `r`, or an error when `r` succeeded.
pub(crate) fn err_of<T>(r: candle_core::Result<T>) -> Result<String> {
    match r {
        Ok(_) => anyhow::bail!("expected an error"),
        Err(e) => Ok(e.to_string()),
    }
}

/// The error of `r`, which must fail, to match with
/// `streamer_device::Error::find`.
pub(crate) fn fail<T>(r: candle_core::Result<T>) -> Result<candle_core::Error> {
    match r {
        Ok(_) => anyhow::bail!("expected an error"),
        Err(e) => Ok(e),
    }
}

fn llama_logits_resident_equal_streamed_f32(dev: &Device) -> Result<()> {
    for tied in [false, true] {
        let cfg = micro(tied);
        let w = init_weights(&cfg, 1)?;
        let vb = VarBuilder::from_tensors(w.clone(), DType::F32, dev);
        let resident = Llama::resident(vb, &cfg)?;
        let x = tokens(dev, 2, 17, 5)?;
        let want = resident.forward(&x)?;
        ensure!(want.dims() == [2, 17, 256]);
        for prefetch in [0, 1, 2] {
            let streamed = Llama::from_tensors(w.clone(), &cfg, stream(dev, DType::F32, prefetch))?;
            let got = streamed.forward(&x)?;
            let d = max_diff(&got, &want)?;
            ensure!(d < 1e-4, "tied {tied} prefetch {prefetch}: max |diff| {d}");
            let stats = streamed.stats()?.expect("streamed");
            ensure!(stats.peak_resident_blocks <= prefetch + 1);
        }
    }
    Ok(())
}
candle_streamer::test_device!(llama_logits_resident_equal_streamed_f32);

fn llama_kv_cache_matches_full_forward(dev: &Device) -> Result<()> {
    let cfg = LlamaConfig {
        max_position_embeddings: 16,
        ..micro(false)
    };
    let w = init_weights(&cfg, 3)?;
    let resident = Llama::resident(VarBuilder::from_tensors(w.clone(), DType::F32, dev), &cfg)?;
    let streamed = Llama::from_tensors(w, &cfg, stream(dev, DType::F32, 1))?;
    let x = tokens(dev, 2, 14, 9)?;
    for (name, model) in [("resident", &resident), ("streamed", &streamed)] {
        let full = model.forward(&x)?;
        // A prompt of 5, then 1, 1 and 7 tokens: each call's logits are the full
        // forward's at the same positions (f32; chunked attention rounds apart).
        let mut at = 0;
        for n in [5, 1, 1, 7] {
            let got = model.forward_cached(&x.narrow(1, at, n)?)?;
            let d = max_diff(&got, &full.narrow(1, at, n)?)?;
            ensure!(
                d < 1e-4,
                "{name}: positions {at}..{}: max |diff| {d}",
                at + n
            );
            at += n;
            ensure!(
                model.cached_positions()? == at,
                "{name}: cache holds {}",
                model.cached_positions()?
            );
        }
        // Past max_position_embeddings (16): a clear error, and the cache is emptied.
        let e = err_of(model.forward_cached(&x.narrow(1, 0, 3)?))?;
        ensure!(e.contains("max_position_embeddings = 16"), "{name}: {e}");
        ensure!(
            model.cached_positions()? == 0,
            "{name}: cache not cleared after an error"
        );
        // Cleared, it starts over at position 0.
        let got = model.forward_cached(&x.narrow(1, 0, 4)?)?;
        ensure!(
            max_diff(&got, &full.narrow(1, 0, 4)?)? < 1e-4,
            "{name}: after clearing"
        );
        model.clear_cache()?;
        ensure!(model.cached_positions()? == 0);
        if name == "streamed" {
            // The outer weights' device copies live for one cached sequence:
            // a change between sequences is seen by the next one.
            let params = model.parameters();
            let (_, embed) = params
                .iter()
                .find(|(n, _)| n == "model.embed_tokens.weight")
                .expect("a streamed model's embedding is a host master");
            embed.set(&embed.as_tensor().affine(0.5, 0.0)?)?;
            let full = model.forward(&x)?;
            let got = model.forward_cached(&x.narrow(1, 0, 4)?)?;
            ensure!(
                max_diff(&got, &full.narrow(1, 0, 4)?)? < 1e-4,
                "streamed: outer weights changed between sequences"
            );
            model.clear_cache()?;
        }
    }
    // Training mode refuses the cache.
    let trainable = Llama::from_tensors(init_weights(&cfg, 3)?, &cfg, stream(dev, DType::F32, 1))?
        .into_trainable()?;
    let e = err_of(trainable.forward_cached(&x.narrow(1, 0, 2)?))?;
    ensure!(e.contains("training mode"), "{e}");
    Ok(())
}
candle_streamer::test_device!(llama_kv_cache_matches_full_forward);

fn llama_generate_with_cache_equals_recompute(dev: &Device) -> Result<()> {
    // A context of 16: a prompt of 5 and 20 new tokens cross it, so both the
    // cached steps and the sliding-window steps run.
    let cfg = LlamaConfig {
        max_position_embeddings: 16,
        ..micro(true)
    };
    let w = init_weights(&cfg, 4)?;
    for model in [
        Llama::resident(VarBuilder::from_tensors(w.clone(), DType::F32, dev), &cfg)?,
        Llama::from_tensors(w.clone(), &cfg, stream(dev, DType::F32, 0))?,
    ] {
        let prompt = [72u32, 101, 108, 108, 111];
        let mut seen = Vec::new();
        // Sampling at temperature 1.5 depends on every logit, not only the largest.
        let (temp, seed) = (1.5, 7);
        let got = generate(&model, &prompt, 20, temp, 1.0, seed, |t| seen.push(t))?;
        ensure!(got == seen && model.cached_positions()? == 0);
        // Reference: the same sampler, every step a full forward over the last 16
        // tokens.
        let mut rng = SplitMix64::new(seed);
        let mut all = prompt.to_vec();
        for (step, &t) in got.iter().enumerate() {
            let window = &all[all.len().saturating_sub(16)..];
            let logits = model.forward(&Tensor::new(window, dev)?.unsqueeze(0)?)?;
            let want = sample_token(&logits.get(0)?.get(window.len() - 1)?, temp, 1.0, &mut rng)?;
            ensure!(want == t, "step {step}: generated {t}, reference {want}");
            all.push(t);
        }
    }
    Ok(())
}
candle_streamer::test_device!(llama_generate_with_cache_equals_recompute);

fn llama_logits_resident_equal_streamed_bf16(dev: &Device) -> Result<()> {
    let cfg = micro(false);
    let w = init_weights(&cfg, 2)?;
    let x = tokens(dev, 2, 12, 6)?;
    let f32_ref =
        Llama::resident(VarBuilder::from_tensors(w.clone(), DType::F32, dev), &cfg)?.forward(&x)?;
    let resident = Llama::resident(VarBuilder::from_tensors(w.clone(), DType::BF16, dev), &cfg)?
        .forward(&x)?;
    // f32 masters, bf16 compute: the pool converts after each copy.
    let streamed = Llama::from_tensors(w, &cfg, stream(dev, DType::BF16, 1))?.forward(&x)?;
    ensure!(streamed.dtype() == DType::BF16);
    // Same bf16 weights, same ops: equal up to bf16 rounding of a few ulps.
    let scale = f32_ref.abs()?.max_all()?.to_scalar::<f32>()?;
    let d = max_diff(&streamed, &resident)?;
    ensure!(
        d <= 0.02 * scale,
        "bf16 streamed vs bf16 resident: {d} (logit scale {scale})"
    );
    // Against the f32 model: bf16 rounding of weights and activations.
    let d = max_diff(&streamed, &f32_ref)?;
    ensure!(
        d <= 0.05 * scale,
        "bf16 streamed vs f32: {d} (logit scale {scale})"
    );
    Ok(())
}
candle_streamer::test_device!(llama_logits_resident_equal_streamed_bf16);

fn llama_gradients_streamed_equal_resident(dev: &Device) -> Result<()> {
    for tied in [false, true] {
        let cfg = micro(tied);
        let w = init_weights(&cfg, 3)?;
        let x = tokens(dev, 2, 9, 7)?;
        let y = tokens(dev, 2, 9, 8)?;
        // Resident: candle-nn variables, plain backprop.
        let varmap = VarMap::new();
        {
            let mut data = varmap.data().lock().expect("varmap");
            for (k, t) in &w {
                data.insert(k.clone(), Var::from_tensor(&t.to_device(dev)?)?);
            }
        }
        let resident = Llama::resident(VarBuilder::from_varmap(&varmap, DType::F32, dev), &cfg)?;
        let loss_r = resident.loss(&x, &y)?;
        let grads_r = resident.backward(&loss_r)?;
        // Streamed and trainable.
        let model = Llama::from_tensors(w, &cfg, stream(dev, DType::F32, 1))?.into_trainable()?;
        let loss_s = model.loss(&x, &y)?;
        ensure!(max_diff(&loss_s, &loss_r)? < 1e-5);
        let grads_s = model.backward(&loss_s)?;
        let data = varmap.data().lock().expect("varmap");
        let params = model.parameters();
        ensure!(
            params.len() == data.len(),
            "{} vs {}",
            params.len(),
            data.len()
        );
        for (name, var) in params {
            let gs = grads_s.get(var.as_tensor()).expect("streamed grad");
            let gr = grads_r.get(data[&name].as_tensor()).expect("resident grad");
            let scale = gr.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-6);
            let d = max_diff(gs, gr)?;
            ensure!(
                d <= 1e-4 * scale.max(1.0),
                "tied {tied}: grad of {name}: {d} (scale {scale})"
            );
        }
    }
    Ok(())
}
candle_streamer::test_device!(llama_gradients_streamed_equal_resident);

/// Splits `w` into two shards plus a `model.safetensors.index.json`.
fn write_shards(w: &HashMap<String, Tensor>, dir: &Path) -> Result<PathBuf> {
    let mut a = HashMap::new();
    let mut b = HashMap::new();
    let mut map = serde_json::Map::new();
    for (k, t) in w {
        let (m, f) = if k.contains("layers.0") || k.starts_with("lm_head") {
            (&mut a, "model-00001-of-00002.safetensors")
        } else {
            (&mut b, "model-00002-of-00002.safetensors")
        };
        m.insert(k.clone(), t.clone());
        map.insert(k.clone(), serde_json::json!(f));
    }
    candle_core::safetensors::save(&a, dir.join("model-00001-of-00002.safetensors"))?;
    candle_core::safetensors::save(&b, dir.join("model-00002-of-00002.safetensors"))?;
    let index = dir.join("model.safetensors.index.json");
    let text = serde_json::json!({ "metadata": {}, "weight_map": map }).to_string();
    std::fs::write(&index, text)?;
    Ok(index)
}

fn llama_checkpoint_roundtrip_identical_logits(dev: &Device) -> Result<()> {
    let dir = temp_dir("roundtrip")?;
    let cfg = micro(true);
    let x = tokens(dev, 2, 10, 9)?;
    let model = Llama::from_tensors(init_weights(&cfg, 4)?, &cfg, stream(dev, DType::F32, 1))?;
    let want = model.forward(&x)?;
    let path = dir.join("model.safetensors");
    model.save_safetensors(&path)?;
    ensure!(!dir.join("model.safetensors.tmp").exists());
    // Streamed from the file, resident from the file, streamed from shards.
    let streamed = Llama::from_safetensors(&[&path], &cfg, stream(dev, DType::F32, 0))?;
    ensure!(max_diff(&streamed.forward(&x)?, &want)? == 0.0);
    let resident = Llama::load_resident(&[&path], &cfg, DType::F32, dev)?;
    ensure!(max_diff(&resident.forward(&x)?, &want)? < 1e-4);
    let index = write_shards(&model.weights()?, &dir)?;
    let sharded = Llama::from_safetensors(&[&index], &cfg, stream(dev, DType::F32, 1))?;
    ensure!(max_diff(&sharded.forward(&x)?, &want)? == 0.0);
    // dtype conversion on load: a bf16 checkpoint into f32 masters equals the
    // f32 weights rounded to bf16.
    let bf: HashMap<String, Tensor> = model
        .weights()?
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_dtype(DType::BF16)?)))
        .collect::<candle_core::Result<_>>()?;
    let bf_path = dir.join("bf16.safetensors");
    candle_core::safetensors::save(&bf, &bf_path)?;
    let from_bf = Llama::from_safetensors(&[&bf_path], &cfg, stream(dev, DType::F32, 1))?;
    let rounded: HashMap<String, Tensor> = bf
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_dtype(DType::F32)?)))
        .collect::<candle_core::Result<_>>()?;
    let want_bf = Llama::from_tensors(rounded, &cfg, stream(dev, DType::F32, 1))?.forward(&x)?;
    ensure!(max_diff(&from_bf.forward(&x)?, &want_bf)? == 0.0);
    for (n, v) in from_bf.parameters() {
        ensure!(v.dtype() == DType::F32, "{n} is {:?}", v.dtype());
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
candle_streamer::test_device!(llama_checkpoint_roundtrip_identical_logits);

fn llama_config_weight_mismatch_names_tensor(dev: &Device) -> Result<()> {
    let cfg = micro(false);
    let w = init_weights(&cfg, 5)?;
    let s = |c: &LlamaConfig, w: &HashMap<String, Tensor>| {
        Llama::from_tensors(w.clone(), c, stream(dev, DType::F32, 1))
    };
    // Configs that disagree with the weights, and what each error must name.
    let cases = [
        // Fewer key-value heads in the config than in the weights.
        (
            LlamaConfig {
                num_key_value_heads: Some(1),
                ..cfg.clone()
            },
            [
                "model.layers.0.self_attn.k_proj.weight",
                "num_key_value_heads",
            ],
        ),
        // A wider MLP.
        (
            LlamaConfig {
                intermediate_size: 256,
                ..cfg.clone()
            },
            ["mlp.gate_proj.weight", "intermediate_size"],
        ),
        // More layers than the weights have.
        (
            LlamaConfig {
                num_hidden_layers: 4,
                ..cfg.clone()
            },
            ["model.layers.3.", "num_hidden_layers = 4"],
        ),
        // Fewer.
        (
            LlamaConfig {
                num_hidden_layers: 2,
                ..cfg.clone()
            },
            ["model.layers.2.", "num_hidden_layers is 2"],
        ),
    ];
    for (c, needles) in cases {
        let e = err_of(s(&c, &w))?;
        ensure!(needles.iter().all(|n| e.contains(n)), "{e}");
    }
    // The key-value heads' mismatch is a typed shape error naming the weight.
    let c = LlamaConfig {
        num_key_value_heads: Some(1),
        ..cfg.clone()
    };
    let e = fail(s(&c, &w))?;
    ensure!(
        matches!(Error::find(&e), Some(Error::Shape { what, .. })
            if what.contains("model.layers.0.self_attn.k_proj.weight")),
        "{e}"
    );
    // Untied config, tied weights: the head is missing.
    let mut v = w.clone();
    v.remove("lm_head.weight");
    let e = err_of(s(&cfg, &v))?;
    ensure!(
        e.contains("lm_head.weight") && e.contains("tie_word_embeddings = false"),
        "{e}"
    );
    // A missing layer weight, an extra tensor, a mis-shaped one.
    let mut v = w.clone();
    v.remove("model.layers.1.mlp.up_proj.weight");
    let e = err_of(s(&cfg, &v))?;
    ensure!(e.contains("model.layers.1.mlp.up_proj.weight"), "{e}");
    let mut v = w.clone();
    v.insert(
        "model.layers.1.extra.weight".into(),
        Tensor::zeros(4, DType::F32, &Device::Cpu)?,
    );
    let e = err_of(s(&cfg, &v))?;
    ensure!(e.contains("model.layers.1.extra.weight"), "{e}");
    let mut v = w.clone();
    v.insert(
        "model.norm.weight".into(),
        Tensor::ones(31, DType::F32, &Device::Cpu)?,
    );
    let e = err_of(s(&cfg, &v))?;
    ensure!(e.contains("model.norm.weight") && e.contains("[31]"), "{e}");
    // The same check guards resident loading, before any VarBuilder.
    let dir = temp_dir("mismatch")?;
    let path = dir.join("m.safetensors");
    candle_core::safetensors::save(&w, &path)?;
    let c = LlamaConfig {
        num_key_value_heads: Some(1),
        ..cfg.clone()
    };
    let e = fail(Llama::load_resident(&[&path], &c, DType::F32, dev))?;
    ensure!(
        matches!(Error::find(&e), Some(Error::Checkpoint { path: p, reason })
            if p == &path && reason.contains("k_proj.weight")),
        "{e}"
    );
    // A config that is wrong in itself names the field.
    let e = err_of(LlamaConfig::from_json(r#"{"hidden_size": 32}"#))?;
    ensure!(e.contains("intermediate_size"), "{e}");
    let c = LlamaConfig {
        num_attention_heads: 3,
        ..cfg.clone()
    };
    let e = err_of(c.validate())?;
    ensure!(e.contains("num_attention_heads"), "{e}");
    check_weights(&WeightSource::Tensors(w), &cfg)?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
candle_streamer::test_device!(llama_config_weight_mismatch_names_tensor);

fn llama_truncated_or_foreign_file_errors_cleanly(dev: &Device) -> Result<()> {
    let dir = temp_dir("truncated")?;
    let cfg = micro(false);
    let path = dir.join("model.safetensors");
    candle_core::safetensors::save(&init_weights(&cfg, 6)?, &path)?;
    let bytes = std::fs::read(&path)?;
    let cut = dir.join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() / 2])?;
    let e = fail(Llama::from_safetensors(
        &[&cut],
        &cfg,
        stream(dev, DType::F32, 1),
    ))?;
    ensure!(
        matches!(Error::find(&e), Some(Error::Checkpoint { path, .. }) if path == &cut),
        "{e}"
    );
    let e = err_of(Llama::load_resident(&[&cut], &cfg, DType::F32, dev))?;
    ensure!(e.contains("cut.safetensors"), "{e}");
    let text = dir.join("notes.safetensors");
    std::fs::write(&text, "this is not a safetensors file\n")?;
    let e = err_of(Llama::from_safetensors(
        &[&text],
        &cfg,
        stream(dev, DType::F32, 1),
    ))?;
    ensure!(e.contains("notes.safetensors"), "{e}");
    // A shard index that names a missing shard.
    let index = dir.join("model.safetensors.index.json");
    std::fs::write(
        &index,
        r#"{"weight_map": {"model.norm.weight": "gone.safetensors"}}"#,
    )?;
    let e = fail(Llama::from_safetensors(
        &[&index],
        &cfg,
        stream(dev, DType::F32, 1),
    ))?;
    ensure!(
        matches!(Error::find(&e), Some(Error::Checkpoint { path, .. })
            if path.ends_with("gone.safetensors")),
        "{e}"
    );
    // Nothing was written over.
    ensure!(std::fs::read(&path)? == bytes);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
candle_streamer::test_device!(llama_truncated_or_foreign_file_errors_cleanly);

fn corpus() -> Result<ByteCorpus> {
    let text = "It was the best of times, it was the worst of times. ".repeat(40);
    Ok(ByteCorpus::new(text.into_bytes()))
}

fn params_of(t: &LmTrainer) -> Result<Vec<(String, Vec<f32>)>> {
    t.model()
        .parameters()
        .into_iter()
        .map(|(n, v)| Ok((n, v.as_tensor().flatten_all()?.to_vec1::<f32>()?)))
        .collect()
}

fn llama_resume_matches_uninterrupted(dev: &Device) -> Result<()> {
    let cfg = micro(false);
    let corpus = corpus()?;
    let adam = ParamsAdamW {
        lr: 3e-3,
        weight_decay: 0.01,
        ..Default::default()
    };
    let opts = |steps, dir: Option<PathBuf>| LoopOptions {
        seed: 11,
        lr: 3e-3,
        warmup: 3,
        save_every: Some(2),
        checkpoint_dir: dir,
        ..crate::common::loop_options(steps, 16)
    };
    for overlap in [false, true] {
        let mut a = LmTrainer::new(
            Llama::from_tensors(init_weights(&cfg, 7)?, &cfg, stream(dev, DType::F32, 1))?,
            adam.clone(),
        )?;
        a.set_overlap(overlap);
        let la = train_loop(&mut a, &corpus, &opts(4, None), |_| {})?;
        let dir = temp_dir("resume")?;
        let mut b = LmTrainer::new(
            Llama::from_tensors(init_weights(&cfg, 7)?, &cfg, stream(dev, DType::F32, 1))?,
            adam.clone(),
        )?;
        b.set_overlap(overlap);
        let lb1 = train_loop(&mut b, &corpus, &opts(2, Some(dir.clone())), |_| {})?;
        drop(b);
        let mut c = LmTrainer::resume(&dir, stream(dev, DType::F32, 0), adam.clone())?;
        c.set_overlap(overlap);
        ensure!(c.steps_done() == 2);
        let lb2 = train_loop(&mut c, &corpus, &opts(4, Some(dir.clone())), |_| {})?;
        let lb: Vec<_> = lb1.into_iter().chain(lb2).collect();
        // Bit-identical on the CPU (deterministic kernels); on CUDA, attention's
        // backward may sum in a different order from run to run: 1e-5.
        let tol = if dev.is_cpu() { 0.0 } else { 1e-5 };
        let close = |x: &[f32], y: &[f32]| {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| (p - q).abs() <= tol)
        };
        let (la_v, lb_v): (Vec<f32>, Vec<f32>) = (
            la.iter().map(|l| l.1).collect(),
            lb.iter().map(|l| l.1).collect(),
        );
        ensure!(close(&la_v, &lb_v), "losses {la:?} vs {lb:?}");
        for ((n, x), (m, y)) in params_of(&a)?.into_iter().zip(params_of(&c)?) {
            ensure!(n == m);
            ensure!(close(&x, &y), "overlap {overlap}: {n} differs after resume");
        }
        // Only the last save's files remain, and a corrupt checkpoint is refused
        // without touching anything.
        let files = streamer_models::CheckpointFiles::read(&dir)?;
        ensure!(files.step == 4 && files.weights.exists() && files.optimizer.exists());
        ensure!(!dir.join("weights-00000002.safetensors").exists());
        let good = std::fs::read(&files.weights)?;
        std::fs::write(&files.weights, &good[..good.len() - 7])?;
        let e = err_of(LmTrainer::resume(
            &dir,
            stream(dev, DType::F32, 0),
            adam.clone(),
        ))?;
        ensure!(e.contains("weights-00000004.safetensors"), "{e}");
        ensure!(std::fs::read(&files.weights)?.len() == good.len() - 7);
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}
candle_streamer::test_device!(llama_resume_matches_uninterrupted);

/// `LmTrainer` with its AdamW on the device (`OptimizerPlace::Device`: the
/// layers stepped during backward, the embedding, norm and head after, their
/// masters moved to the device on CUDA) against
/// the overlapped host optimizer, over 4 steps with a save at step 2 that the
/// host optimizer resumes from (the state file is the same). The arithmetic
/// is the same: bit-identical on the CPU, 1e-5 on CUDA (attention's backward
/// may sum in another order from run to run).
fn llama_device_optimizer_matches_host(dev: &Device) -> Result<()> {
    let cfg = micro(false);
    let corpus = corpus()?;
    let adam = ParamsAdamW {
        lr: 3e-3,
        weight_decay: 0.01,
        ..Default::default()
    };
    let opts = |steps, dir: Option<PathBuf>| LoopOptions {
        seed: 5,
        lr: 3e-3,
        warmup: 2,
        save_every: Some(2),
        checkpoint_dir: dir,
        ..crate::common::loop_options(steps, 16)
    };
    let model = || {
        Llama::from_tensors(
            init_weights(&cfg, 9).unwrap(),
            &cfg,
            stream(dev, DType::F32, 1),
        )
    };
    let mut host = LmTrainer::new(model()?, adam.clone())?;
    host.set_overlap(true);
    let lh = train_loop(&mut host, &corpus, &opts(4, None), |_| {})?;
    let dir = temp_dir("device-opt")?;
    let mut device = LmTrainer::new_on(model()?, adam.clone(), OptimizerPlace::Device)?;
    ensure!(device.device_optimizer().is_some() && device.optimizer().is_none());
    // On CUDA the embedding, norm and head masters live where their moments do.
    for (name, v) in device.model().parameters() {
        let outer = !name.starts_with("model.layers.");
        ensure!(
            v.device().is_cuda() == (outer && dev.is_cuda()),
            "{name} is on {:?}",
            v.device().location()
        );
    }
    let ld1 = train_loop(&mut device, &corpus, &opts(2, Some(dir.clone())), |_| {})?;
    drop(device);
    let mut resumed =
        LmTrainer::resume_on(&dir, stream(dev, DType::F32, 1), adam, OptimizerPlace::Host)?;
    resumed.set_overlap(true);
    let ld2 = train_loop(&mut resumed, &corpus, &opts(4, Some(dir.clone())), |_| {})?;
    let tol = if dev.is_cpu() { 0.0 } else { 1e-5 };
    let ld: Vec<f32> = ld1.iter().chain(&ld2).map(|l| l.1).collect();
    let lh: Vec<f32> = lh.iter().map(|l| l.1).collect();
    ensure!(
        ld.len() == lh.len() && ld.iter().zip(&lh).all(|(a, b)| (a - b).abs() <= tol),
        "losses: device then host {ld:?}, host {lh:?}"
    );
    for ((n, x), (_, y)) in params_of(&host)?.into_iter().zip(params_of(&resumed)?) {
        let d = x
            .iter()
            .zip(&y)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        ensure!(d <= tol, "{n}: max |host - device| {d}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
candle_streamer::test_device!(llama_device_optimizer_matches_host);

fn llama_train_loop_reduces_loss_on_corpus(dev: &Device) -> Result<()> {
    // What `train_lm --preset tiny` runs (the library's loop on the shipped
    // corpus), for a few steps, at the micro size so that a debug build takes a
    // second or two (the `tiny` preset itself takes about 4 s a step there).
    let cfg = micro(false);
    // From the package root at build time, or the working directory (a test
    // binary carried to another machine runs from the repository root there).
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let path = [
        root.join("data/corpus.txt"),
        Path::new("data/corpus.txt").to_path_buf(),
    ]
    .into_iter()
    .find(|p| p.exists())
    .ok_or_else(|| anyhow::anyhow!("data/corpus.txt not found from {}", root.display()))?;
    let corpus = ByteCorpus::from_file(&path)?;
    ensure!(corpus.len() > 100_000);
    let model = Llama::from_tensors(init_weights(&cfg, 0)?, &cfg, stream(dev, DType::F32, 1))?;
    let mut t = LmTrainer::new(model, ParamsAdamW::default())?;
    let opts = crate::common::loop_options(8, 32);
    let losses = train_loop(&mut t, &corpus, &opts, |_| {})?;
    let first = losses[0].1;
    let last = losses[5..].iter().map(|l| l.1).sum::<f32>() / 3.0;
    ensure!(
        (first - 256f32.ln()).abs() < 0.1,
        "initial loss {first} should be near ln 256"
    );
    ensure!(last < first - 0.5, "loss {first} -> {last}: {losses:?}");
    Ok(())
}
candle_streamer::test_device!(llama_train_loop_reduces_loss_on_corpus);

fn llama_hf_config_json_parses(_dev: &Device) -> Result<()> {
    // The fields of a published Llama 3.2 1B config.json (others are ignored).
    let text = r#"{
      "architectures": ["LlamaForCausalLM"], "attention_bias": false, "bos_token_id": 128000,
      "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
      "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
      "mlp_bias": false, "model_type": "llama", "num_attention_heads": 32,
      "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
      "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"},
      "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
      "vocab_size": 128256
    }"#;
    let cfg = LlamaConfig::from_json(text)?;
    ensure!(cfg.num_kv_heads() == 8 && cfg.head_dim() == 64 && cfg.tie_word_embeddings);
    ensure!(cfg.layer_params() == LlamaConfig::llama_1b().layer_params());
    let inv = cfg.inv_freq();
    ensure!(inv.len() == 32 && inv[0] == 1.0);
    // The lowest frequencies are divided by the factor (llama3 scaling).
    let plain = 1.0 / 500000f64.powf(62.0 / 64.0);
    ensure!((inv[31] - plain / 32.0).abs() < 1e-12 * plain);
    let back = LlamaConfig::from_json(&cfg.to_json()?)?;
    ensure!(back == cfg);
    let e = err_of(LlamaConfig::from_json(&text.replace("llama3", "yarn")))?;
    ensure!(e.contains("rope_scaling.rope_type"), "{e}");
    for p in ["tiny", "350m", "1b", "3b"] {
        LlamaConfig::preset(p)?.validate()?;
    }
    let m = LlamaConfig::llama_3b().num_params() as f64 / 1e9;
    ensure!((2.5..3.5).contains(&m), "3b preset has {m} B parameters");
    Ok(())
}
candle_streamer::test_device!(llama_hf_config_json_parses);

fn llama_budget_and_sampling(_dev: &Device) -> Result<()> {
    ensure!(parse_bytes("2GiB")? == 2 << 30);
    ensure!(parse_bytes("1.5G")? == 1_500_000_000);
    ensure!(parse_bytes("4096")? == 4096);
    ensure!(parse_bytes("3 parsecs").is_err());
    let cfg = LlamaConfig::llama_3b();
    let per = streamer_models::checkpoint::layer_bytes(&cfg, DType::BF16);
    ensure!(prefetch_for_budget(&cfg, DType::BF16, 2 * per + 1)? == 1);
    ensure!(prefetch_for_budget(&cfg, DType::BF16, 100 * per)? == cfg.num_hidden_layers - 1);
    ensure!(prefetch_for_budget(&cfg, DType::BF16, per - 1).is_err());
    let logits = Tensor::new(&[0f32, 5.0, 1.0, 4.9], &Device::Cpu)?;
    let mut rng = SplitMix64::new(1);
    ensure!(sample_token(&logits, 0.0, 1.0, &mut rng)? == 1);
    // top-p 0.5 keeps only the most likely token.
    for _ in 0..20 {
        ensure!(sample_token(&logits, 1.0, 0.5, &mut rng)? == 1);
    }
    // top-p 0.9 keeps tokens 1 and 3, never 0 or 2.
    let picks: Vec<u32> = (0..200)
        .map(|_| sample_token(&logits, 1.0, 0.9, &mut rng))
        .collect::<candle_core::Result<_>>()?;
    ensure!(picks.iter().all(|&p| p == 1 || p == 3) && picks.contains(&3));
    Ok(())
}
candle_streamer::test_device!(llama_budget_and_sampling);

/// A micro Llama 3.1-style `config.json` (theta 500000, llama3 scaling whose
/// original context of 16 puts the four frequencies in all three regimes) in
/// transformers 4.x's layout: top-level `rope_theta` and `rope_scaling`.
fn hf4_config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 32, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "attention_bias": false, "mlp_bias": false, "attention_dropout": 0.0,
        "tie_word_embeddings": false, "torch_dtype": "float32", "pretraining_tp": 1,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        "transformers_version": "4.46.0"
    })
}

/// The same model as transformers 5.x writes it: `rope_parameters` holds theta
/// and the scaling, `layer_types` names each layer's attention.
fn hf5_config() -> serde_json::Value {
    let mut v = hf4_config();
    let o = v.as_object_mut().expect("object");
    o.remove("rope_theta");
    o.remove("rope_scaling");
    o.remove("torch_dtype");
    o.insert("dtype".into(), "float32".into());
    o.insert("transformers_version".into(), "5.17.0".into());
    o.insert(
        "layer_types".into(),
        serde_json::json!(["full_attention", "full_attention"]),
    );
    o.insert(
        "rope_parameters".into(),
        serde_json::json!({"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}),
    );
    v
}

fn with(mut v: serde_json::Value, edits: serde_json::Value) -> serde_json::Value {
    let o = v.as_object_mut().expect("object");
    for (k, x) in edits.as_object().expect("object") {
        if x.is_null() && k != "sliding_window" {
            o.remove(k);
        } else {
            o.insert(k.clone(), x.clone());
        }
    }
    v
}

fn parse(v: &serde_json::Value) -> candle_core::Result<LlamaConfig> {
    LlamaConfig::from_json(&v.to_string())
}

fn llama_config_hf4_and_hf5_layouts_agree(dev: &Device) -> Result<()> {
    let c4 = parse(&hf4_config())?;
    let c5 = parse(&hf5_config())?;
    ensure!(c4 == c5, "4.x {c4:?}\n5.x {c5:?}");
    ensure!(c5.rope_theta == 500000.0, "{c5:?}");
    let s = c5.rope_scaling.as_ref().expect("llama3 scaling read");
    ensure!(s.rope_type == "llama3" && s.factor == 8.0 && s.original_max_position_embeddings == 16);
    // Identical logits from the two parses; the scaling changes them.
    let w = init_weights(&c4, 7)?;
    let x = tokens(dev, 1, 48, 3)?;
    let logits = |c: &LlamaConfig| -> Result<Tensor> {
        let vb = VarBuilder::from_tensors(w.clone(), DType::F32, dev);
        Ok(Llama::resident(vb, c)?.forward(&x)?)
    };
    let (l4, l5) = (logits(&c4)?, logits(&c5)?);
    ensure!(max_diff(&l4, &l5)? == 0.0);
    let unscaled = LlamaConfig {
        rope_scaling: None,
        ..c4.clone()
    };
    let d = max_diff(&l4, &logits(&unscaled)?)?;
    let scale = l4.abs()?.max_all()?.to_scalar::<f32>()?;
    // (Small random weights keep attention near uniform, so the rope moves the
    // logits little; the tables themselves move a lot.)
    ensure!(
        d > 1e-4 * scale,
        "llama3 scaling changed the logits by only {d} of {scale}"
    );
    let cos = |c: &LlamaConfig| -> Result<Tensor> {
        Ok(streamer_models::Rope::new(c, DType::F32, dev)?.extras(48)?[0].clone())
    };
    let d = max_diff(&cos(&c5)?, &cos(&unscaled)?)?;
    ensure!(
        d > 0.1,
        "llama3 scaling moved the rotary tables by only {d}"
    );
    // A 5.x default rope, rope_parameters keyed by layer type, and both layouts
    // written at once (agreeing) all read as their 4.x equivalent.
    let plain4 = with(hf4_config(), serde_json::json!({"rope_scaling": null}));
    let plain5 = with(
        hf5_config(),
        serde_json::json!({"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}),
    );
    ensure!(parse(&plain4)? == parse(&plain5)? && parse(&plain5)?.rope_scaling.is_none());
    let rp = hf5_config()["rope_parameters"].clone();
    let keyed = with(
        hf5_config(),
        serde_json::json!({"rope_parameters": {"full_attention": rp}}),
    );
    ensure!(parse(&keyed)? == c4);
    let both = with(hf5_config(), serde_json::json!({"rope_theta": 500000}));
    ensure!(parse(&both)? == c4);
    // 5.x without a theta anywhere takes the default 10000.
    let no_theta = with(
        hf5_config(),
        serde_json::json!({"rope_parameters": {"rope_type": "default"}}),
    );
    ensure!(parse(&no_theta)?.rope_theta == 10000.0);
    // Our own files round-trip.
    ensure!(LlamaConfig::from_json(&c5.to_json()?)? == c5);
    Ok(())
}
candle_streamer::test_device!(llama_config_hf4_and_hf5_layouts_agree);

fn llama_config_families_read_their_windows(_dev: &Device) -> Result<()> {
    let llama = parse(&hf4_config())?;
    let fam = |edits: serde_json::Value| parse(&with(hf4_config(), edits));
    let windowed = |c: &LlamaConfig| (0..2).map(|i| c.layer_window(i)).collect::<Vec<_>>();
    // Mistral: the window applies to every layer; null is dense; absent is
    // transformers' default 4096. The rest is Llama's.
    for (window, want) in [
        (serde_json::json!(null), None),
        (serde_json::json!(16), Some(16)),
        (serde_json::json!(4096), Some(4096)),
    ] {
        let m = fam(serde_json::json!({"model_type": "mistral", "sliding_window": window}))?;
        ensure!(
            m.sliding_window == want && windowed(&m) == vec![want; 2],
            "{m:?}"
        );
        let same = LlamaConfig {
            model_type: "mistral".into(),
            sliding_window: want,
            ..llama.clone()
        };
        ensure!(m == same, "window {window}: {m:?}");
    }
    let m = fam(serde_json::json!({"model_type": "mistral"}))?;
    ensure!(m.sliding_window == Some(4096), "{m:?}");
    // Qwen: no window unless use_sliding_window; then layers from
    // max_window_layers on slide (4.x), or as layer_types says (5.x).
    for use_w in [serde_json::json!(false), serde_json::json!(null)] {
        let q = fam(
            serde_json::json!({"model_type": "qwen2", "sliding_window": 16,
            "use_sliding_window": use_w}),
        )?;
        ensure!(
            q.sliding_window.is_none() && windowed(&q) == vec![None; 2],
            "{q:?}"
        );
    }
    let q = fam(
        serde_json::json!({"model_type": "qwen2", "sliding_window": 16,
        "use_sliding_window": true, "max_window_layers": 1}),
    )?;
    ensure!(windowed(&q) == vec![None, Some(16)], "{q:?}");
    ensure!(q.qkv_bias() && !q.o_bias() && !q.qk_norm());
    ensure!(
        LlamaConfig::from_json(&q.to_json()?)? == q,
        "qwen2 round trip"
    );
    let q = fam(
        serde_json::json!({"model_type": "qwen3", "sliding_window": 16,
        "use_sliding_window": true, "layer_types": ["sliding_attention", "full_attention"]}),
    )?;
    ensure!(windowed(&q) == vec![Some(16), None], "{q:?}");
    ensure!(
        q.head_dim() == 128 && q.qk_norm() && !q.qkv_bias(),
        "qwen3 defaults: {q:?}"
    );
    ensure!(
        LlamaConfig::from_json(&q.to_json()?)? == q,
        "qwen3 round trip"
    );
    let l = fam(serde_json::json!({"attention_bias": true}))?;
    ensure!(l.qkv_bias() && l.o_bias());
    // Linear rope scaling divides every frequency by the factor.
    let lin = fam(serde_json::json!({"rope_scaling": {"type": "linear", "factor": 2.0}}))?;
    let plain = LlamaConfig {
        rope_scaling: None,
        ..lin.clone()
    };
    for (a, b) in lin.inv_freq().iter().zip(plain.inv_freq()) {
        ensure!((a * 2.0 - b).abs() <= 1e-15 * b, "linear {a} vs {b}");
    }
    Ok(())
}
candle_streamer::test_device!(llama_config_families_read_their_windows);

/// A sliding window of 6 (Mistral): positions before the window's length give
/// the dense model's logits, later ones differ (the window masks); streamed
/// equals resident; the kv cache (queries aligned after the cached keys, each
/// window reaching back from there) gives the full forward's logits; streamed
/// gradients (the hand-written backward, windowed) equal resident autograd's.
fn llama_sliding_window_masks_beyond_the_window(dev: &Device) -> Result<()> {
    let cfg = parse(&with(
        hf4_config(),
        serde_json::json!({"model_type": "mistral", "sliding_window": 6}),
    ))?;
    let dense = LlamaConfig {
        sliding_window: None,
        ..cfg.clone()
    };
    let w = init_weights(&cfg, 3)?;
    let vb = VarBuilder::from_tensors(w.clone(), DType::F32, dev);
    let model = Llama::resident(vb.clone(), &cfg)?;
    let x = tokens(dev, 2, 20, 1)?;
    let (got, full) = (
        model.forward(&x)?,
        Llama::resident(vb, &dense)?.forward(&x)?,
    );
    let d = max_diff(&got.narrow(1, 0, 6)?, &full.narrow(1, 0, 6)?)?;
    ensure!(d < 1e-5, "within the window: {d}");
    let d = max_diff(&got.narrow(1, 6, 14)?, &full.narrow(1, 6, 14)?)?;
    ensure!(d > 1e-3, "past the window the logits moved by only {d}");
    let streamed = Llama::from_tensors(w.clone(), &cfg, stream(dev, DType::F32, 1))?;
    ensure!(max_diff(&streamed.forward(&x)?, &got)? < 1e-4);
    let mut at = 0;
    for n in [7, 1, 5, 7] {
        let c = model.forward_cached(&x.narrow(1, at, n)?)?;
        let d = max_diff(&c, &got.narrow(1, at, n)?)?;
        ensure!(d < 1e-4, "cached positions {at}..{}: {d}", at + n);
        at += n;
    }
    // Gradients: streamed trainable (hand-written backward) vs resident autograd.
    let vars = crate::common::vars_on(&w, dev)?;
    let resident = Llama::resident(crate::common::var_builder(&vars, DType::F32, dev), &cfg)?;
    let y = tokens(dev, 2, 20, 2)?;
    let want = resident.loss(&x, &y)?.backward()?;
    let trainable = Llama::from_tensors(w, &cfg, stream(dev, DType::F32, 1))?.into_trainable()?;
    let grads = trainable.backward(&trainable.loss(&x, &y)?)?;
    for (name, v) in trainable.parameters() {
        let g = grads.get(v.as_tensor()).context("streamed gradient")?;
        let r = want
            .get(vars[&name].as_tensor())
            .context("resident gradient")?;
        let scale = r.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-12);
        ensure!(max_diff(g, r)? <= 1e-4 * scale, "{name}");
    }
    Ok(())
}
candle_streamer::test_device!(llama_sliding_window_masks_beyond_the_window);

/// Unsupported `config.json` fields and the words their error must name (unsupported_cases_a).
fn unsupported_cases_a() -> Vec<(serde_json::Value, serde_json::Value, Vec<&'static str>)> {
    vec![
        (
            hf4_config(),
            serde_json::json!({"model_type": "qwen2", "attention_bias": true}),
            vec!["attention_bias = true", "qwen2"],
        ),
        (
            hf4_config(),
            serde_json::json!({"model_type": "qwen2", "use_sliding_window": "yes"}),
            vec!["use_sliding_window", "yes"],
        ),
        (
            hf4_config(),
            serde_json::json!({"model_type": "gemma"}),
            vec!["model_type", "gemma"],
        ),
        (
            hf4_config(),
            serde_json::json!({"hidden_act": "gelu"}),
            vec!["hidden_act", "gelu"],
        ),
        (
            hf4_config(),
            serde_json::json!({"model_type": "mistral", "attention_bias": true}),
            vec!["attention_bias = true", "mistral"],
        ),
        (
            hf4_config(),
            serde_json::json!({"mlp_bias": true}),
            vec!["mlp_bias = true"],
        ),
        (
            hf4_config(),
            serde_json::json!({"attention_dropout": 0.1}),
            vec!["attention_dropout = 0.1"],
        ),
        (
            hf4_config(),
            serde_json::json!({"sliding_window": 0}),
            vec!["sliding_window = 0"],
        ),
        (
            hf4_config(),
            serde_json::json!({"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
            vec!["rope_scaling.rope_type", "dynamic"],
        ),
        (
            hf4_config(),
            serde_json::json!({"rope_scaling": {"rope_type": "llama3", "type": "yarn"}}),
            vec!["rope_scaling", "yarn"],
        ),
    ]
}

/// Unsupported `config.json` fields and the words their error must name (unsupported_cases_b).
fn unsupported_cases_b() -> Vec<(serde_json::Value, serde_json::Value, Vec<&'static str>)> {
    let rp = |edits: serde_json::Value| {
        let mut r = hf5_config()["rope_parameters"].clone();
        for (k, v) in edits.as_object().expect("object") {
            r[k] = v.clone();
        }
        serde_json::json!({ "rope_parameters": r })
    };
    vec![
        (
            hf5_config(),
            rp(serde_json::json!({"rope_type": "yarn"})),
            vec!["rope_parameters.rope_type", "yarn"],
        ),
        (
            hf5_config(),
            rp(serde_json::json!({"rope_type": "dynamic"})),
            vec!["rope_parameters.rope_type", "dynamic"],
        ),
        (
            hf5_config(),
            rp(serde_json::json!({"partial_rotary_factor": 0.5})),
            vec!["rope_parameters.partial_rotary_factor = 0.5"],
        ),
        (
            hf5_config(),
            rp(serde_json::json!({"factor": "eight"})),
            vec!["rope_parameters.factor", "eight"],
        ),
        (
            hf5_config(),
            serde_json::json!({"rope_theta": 10000.0}),
            vec!["rope_theta = 10000", "rope_parameters.rope_theta = 500000"],
        ),
        (
            hf5_config(),
            serde_json::json!({"rope_scaling": {"rope_type": "llama3", "factor": 32.0}}),
            vec!["rope_scaling", "rope_parameters", "disagree"],
        ),
        (
            hf5_config(),
            serde_json::json!({"layer_types": ["full_attention", "chunked_attention"]}),
            vec!["layer_types[1]", "chunked_attention"],
        ),
        (
            hf5_config(),
            serde_json::json!({"layer_types": ["full_attention"]}),
            vec!["layer_types", "num_hidden_layers = 2"],
        ),
        (
            hf5_config(),
            serde_json::json!({"rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}),
            vec!["rope_parameters", "full_attention", "sliding_attention"],
        ),
        (
            hf4_config(),
            serde_json::json!({"head_dim": 7}),
            vec!["head dimension 7"],
        ),
    ]
}

fn llama_config_unsupported_fields_are_named(_dev: &Device) -> Result<()> {
    let cases = unsupported_cases_a()
        .into_iter()
        .chain(unsupported_cases_b());
    for (base, edits, want) in cases {
        let e = fail(parse(&with(base, edits.clone())))?;
        ensure!(
            matches!(Error::find(&e), Some(Error::Config { .. })),
            "{edits}: {e}"
        );
        let e = e.to_string();
        ensure!(want.iter().all(|w| e.contains(w)), "{edits}: {e}");
    }
    // Fields that do not change the math are ignored.
    let extra = with(
        hf5_config(),
        serde_json::json!({"bos_token_id": 1, "use_cache": true, "initializer_range": 0.02}),
    );
    ensure!(parse(&extra)? == parse(&hf5_config())?);
    Ok(())
}
candle_streamer::test_device!(llama_config_unsupported_fields_are_named);

/// Every bit of a trainer's weights and AdamW moments, and its step counts.
/// Weights' bits, moments' bits, optimizer steps, trainer steps.
type TrainerBits = (Vec<Vec<u32>>, Vec<Vec<u32>>, usize, usize);

fn trainer_bits(t: &LmTrainer) -> Result<TrainerBits> {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let w = params_of(t)?.iter().map(|(_, v)| bits(v)).collect();
    let opt = t.optimizer().expect("host optimizer");
    let m = (0..opt.vars().len())
        .flat_map(|i| {
            let (m, v) = opt.moments(i).expect("moments");
            [bits(&m), bits(&v)]
        })
        .collect();
    Ok((w, m, opt.step_count(), t.steps_done()))
}

fn checkpoint_listing(dir: &Path) -> Result<(String, Vec<String>)> {
    let mut names: Vec<String> = std::fs::read_dir(dir)?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_>>()?;
    names.sort();
    Ok((std::fs::read_to_string(dir.join("checkpoint.json"))?, names))
}

fn llama_trainer_refuses_non_finite_steps_and_saves(dev: &Device) -> Result<()> {
    let cfg = micro(false);
    let corpus = corpus()?;
    let dir = temp_dir("non-finite")?;
    let adam = ParamsAdamW {
        lr: 1e-3,
        ..Default::default()
    };
    let model = Llama::from_tensors(init_weights(&cfg, 1)?, &cfg, stream(dev, DType::F32, 1))?;
    let mut t = LmTrainer::new(model, adam.clone())?;
    let (x, y) = corpus.batch(0, 0, 2, 16, dev)?;
    t.step(&x, &y)?;
    t.save(&dir)?;
    let saved = checkpoint_listing(&dir)?;
    let params = t.model().parameters();
    let var = |name: &str| -> Result<Var> {
        let found = params.iter().find(|(n, _)| n == name);
        found
            .map(|(_, v)| v.clone())
            .ok_or_else(|| anyhow::anyhow!("no {name}"))
    };
    // An infinite loss (a finite but huge final norm overflows the logits) is
    // refused before backward.
    let norm = var("model.norm.weight")?;
    let good_norm = norm.as_tensor().copy()?;
    norm.set(&good_norm.affine(0.0, 3e38)?)?;
    let before = trainer_bits(&t)?;
    let e = err_of(t.step(&x, &y))?;
    ensure!(e.contains("loss is") && e.contains("refused"), "{e}");
    ensure!(
        trainer_bits(&t)? == before,
        "a refused step changed the trainer"
    );
    norm.set(&good_norm)?;
    // A NaN learning rate is refused by the optimizer before it changes anything.
    let before = trainer_bits(&t)?;
    t.set_learning_rate(f64::NAN);
    let e = err_of(t.step(&x, &y))?;
    ensure!(e.contains("learning rate") && e.contains("NaN"), "{e}");
    ensure!(
        trainer_bits(&t)? == before,
        "a refused step changed the trainer"
    );
    t.set_learning_rate(1e-3);
    t.step(&x, &y)?;
    // A NaN weight is never saved; the previous checkpoint stays as it was.
    let q = var("model.layers.1.self_attn.q_proj.weight")?;
    q.set(&q.as_tensor().affine(1.0, f64::NAN)?)?;
    let e = err_of(t.save(&dir))?;
    ensure!(
        e.contains("not saving") && e.contains("q_proj") && e.contains("NaN"),
        "{e}"
    );
    ensure!(checkpoint_listing(&dir)? == saved);
    // Overlapped: a refusal after some layers may have stepped blocks every
    // further step and save.
    let model = Llama::from_tensors(init_weights(&cfg, 1)?, &cfg, stream(dev, DType::F32, 1))?;
    let mut t = LmTrainer::new(model, adam)?;
    t.set_overlap(true);
    t.set_learning_rate(f64::NAN);
    ensure!(err_of(t.step(&x, &y))?.contains("learning rate"));
    t.set_learning_rate(1e-3);
    let e = err_of(t.step(&x, &y))?;
    ensure!(e.contains("resume from the last checkpoint"), "{e}");
    let e = err_of(t.save(&dir))?;
    ensure!(e.contains("not saving") && e.contains("part-way"), "{e}");
    ensure!(checkpoint_listing(&dir)? == saved);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
candle_streamer::test_device!(llama_trainer_refuses_non_finite_steps_and_saves);

fn llama_loop_options_are_checked_before_work(_dev: &Device) -> Result<()> {
    let cfg = micro(false);
    let corpus = corpus()?;
    let ok = LoopOptions {
        lr: 1e-3,
        ..crate::common::loop_options(1, 16)
    };
    ok.check(&cfg, &corpus)?;
    for (o, want) in [
        (
            LoopOptions {
                seq: 65,
                ..ok.clone()
            },
            "seq = 65 is beyond the model's context (max_position_embeddings = 64)",
        ),
        (
            LoopOptions {
                seq: 0,
                ..ok.clone()
            },
            "seq (0)",
        ),
        (
            LoopOptions {
                batch: 0,
                ..ok.clone()
            },
            "batch (0)",
        ),
        (
            LoopOptions {
                micro_batches: 0,
                ..ok.clone()
            },
            "micro_batches (0)",
        ),
        (
            LoopOptions {
                batch: usize::MAX,
                ..ok.clone()
            },
            "2^40",
        ),
        (
            LoopOptions {
                lr: f64::NAN,
                ..ok.clone()
            },
            "learning rate",
        ),
        (
            LoopOptions {
                lr: f64::INFINITY,
                ..ok.clone()
            },
            "learning rate",
        ),
        (
            LoopOptions {
                lr: -1.0,
                ..ok.clone()
            },
            "learning rate",
        ),
        (
            LoopOptions {
                lr: 0.0,
                ..ok.clone()
            },
            "learning rate",
        ),
        (
            LoopOptions {
                save_every: Some(0),
                ..ok.clone()
            },
            "save_every",
        ),
    ] {
        let e = err_of(o.check(&cfg, &corpus))?;
        ensure!(e.contains(want), "{o:?}: {e}");
    }
    let short = ByteCorpus::new(vec![b'a'; 17]);
    ensure!(err_of(ok.check(&cfg, &short))?.contains("17 tokens"));
    let big_ids = streamer_models::TokenCorpus::from_tokens(vec![300; 100]);
    let e = err_of(ok.check(&cfg, &big_ids))?;
    ensure!(
        e.contains("token id 300") && e.contains("vocab_size = 256"),
        "{e}"
    );
    Ok(())
}
candle_streamer::test_device!(llama_loop_options_are_checked_before_work);

fn cli_flags_are_checked_with_their_values(_dev: &Device) -> Result<()> {
    use candle_streamer::cli;
    ensure!(cli::seq_len(Some(512), 64, 512)? == 512);
    ensure!(cli::seq_len(None, 2048, 512)? == 512);
    let e = err_of(cli::seq_len(Some(100000), 64, 512))?;
    ensure!(
        e.contains("--seq 100000") && e.contains("max_position_embeddings = 512"),
        "{e}"
    );
    ensure!(err_of(cli::seq_len(Some(0), 64, 512))?.contains("--seq 0"));
    ensure!(
        cli::prefetch("--prefetch", None, 1)? == 0 && cli::prefetch("--prefetch", None, 4)? == 1
    );
    ensure!(cli::prefetch("--prefetch", Some(3), 4)? == 3);
    ensure!(err_of(cli::prefetch("--prefetch", Some(4), 4))?.contains("--prefetch 4"));
    ensure!(err_of(cli::weight_decay("--weight-decay", 0.5, 2.0))?.contains("below 1"));
    ensure!(err_of(cli::weight_decay("--weight-decay", -0.1, 1e-3))?.contains("-0.1"));
    ensure!(err_of(cli::non_negative("--temperature", f64::NAN))?.contains("NaN"));
    for bad in [0.0, 1.5, f64::NAN] {
        ensure!(err_of(cli::fraction("--top-p", bad))?.contains("--top-p"));
    }
    ensure!(err_of(cli::learning_rate("--lr", f64::NEG_INFINITY))?.contains("-inf"));
    // --resume with another preset: both configs named, the differing fields listed.
    let (tiny, big) = (LlamaConfig::tiny(), LlamaConfig::llama_350m());
    ensure!(tiny.preset_name() == Some("tiny") && micro(false).preset_name().is_none());
    let path = Path::new("ckpt/config.json");
    cli::same_config("--preset tiny", &tiny, path, &tiny)?;
    let e = err_of(cli::same_config("--preset 350m", &big, path, &tiny))?;
    ensure!(
        e.contains("--preset 350m")
            && e.contains("ckpt/config.json (tiny)")
            && e.contains("hidden_size: 1024 vs 128"),
        "{e}"
    );
    Ok(())
}
candle_streamer::test_device!(cli_flags_are_checked_with_their_values);

/// The normals `init_weights` makes in pieces on every core are, bit for
/// bit, those of one sequential SplitMix64 stream (Box-Muller, two per pair
/// of draws), for lengths around the piece size, odd ones included; and
/// `SplitMix64::after` is the stream after that many draws.
#[test]
fn init_normals_in_pieces_are_one_stream() -> Result<()> {
    use streamer_models::checkpoint::normals;
    use streamer_models::SplitMix64;
    let sequential = |seed: u64, n: usize, std: f64| -> Vec<f32> {
        let mut rng = SplitMix64::new(seed);
        let mut v = Vec::with_capacity(n);
        while v.len() < n {
            let u1 = rng.uniform().max(1e-300);
            let u2 = rng.uniform();
            let r = (-2.0 * u1.ln()).sqrt() * std;
            let a = 2.0 * std::f64::consts::PI * u2;
            v.push((r * a.cos()) as f32);
            if v.len() < n {
                v.push((r * a.sin()) as f32);
            }
        }
        v
    };
    for n in [
        0,
        1,
        7,
        (1 << 16) - 1,
        1 << 16,
        (1 << 16) + 1,
        3 * (1 << 16) + 5,
    ] {
        let (got, want) = (normals(42, n, 0.02), sequential(42, n, 0.02));
        let same = got.len() == n
            && got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        ensure!(same, "n = {n}: the pieces differ from the stream");
    }
    let mut rng = SplitMix64::new(9);
    (0..1000).for_each(|_| {
        rng.next_u64();
    });
    ensure!(SplitMix64::after(9, 1000).next_u64() == rng.next_u64());
    Ok(())
}
