//! The decoder layer's hand-written training backward (what streamed training
//! runs) against Candle autograd through the layer's ordinary forward, for the
//! input and every weight, in f32 and (on CUDA) bf16.
use super::fused_mlp::rel_err;
use crate::common::ensure_close;
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use streamer_core::Block;
use streamer_models::{DecoderLayer, Llama, LlamaConfig, Rope};

fn decoder_manual_backward_matches_autograd(dev: &Device) -> Result<()> {
    // GQA (4 query heads over 2 kv heads), head_dim 16, an odd sequence length.
    let cfg = LlamaConfig {
        intermediate_size: 96,
        ..LlamaConfig::bytes(64, 1, 4, 2)
    };
    let (b, n) = (2, 23);
    let mut dts = vec![(DType::F32, 1e-4)];
    if dev.is_cuda() {
        dts.push((DType::BF16, 4e-2));
    }
    for (dt, tol) in dts {
        let mut vars: HashMap<String, Var> = HashMap::new();
        for (name, shape, _) in cfg.weight_shapes() {
            if let Some(local) = name.strip_prefix("model.layers.0.") {
                let std = if local.ends_with("layernorm.weight") {
                    0.1
                } else {
                    0.15
                };
                let mut t = Tensor::randn(0f32, std, shape, &Device::Cpu)?;
                if local.ends_with("layernorm.weight") {
                    t = (t + 1.0)?;
                }
                vars.insert(
                    local.to_string(),
                    Var::from_tensor(&t.to_dtype(dt)?.to_device(dev)?)?,
                );
            }
        }
        let layer = DecoderLayer::new(&cfg, crate::common::var_builder(&vars, dt, dev))?;
        let extras = Rope::new(&cfg, dt, dev)?.extras(n)?;
        let x = Var::from_tensor(
            &Tensor::randn(0f32, 1.0, (b, n, 64), &Device::Cpu)?
                .to_dtype(dt)?
                .to_device(dev)?,
        )?;
        let g = Tensor::randn(0f32, 1.0, (b, n, 64), &Device::Cpu)?
            .to_dtype(dt)?
            .to_device(dev)?;
        // Reference: Candle autograd through Block::forward.
        let y_ref = layer.forward(x.as_tensor(), &extras)?.remove(0);
        let want = (&y_ref * &g)?.to_dtype(DType::F32)?.sum_all()?.backward()?;
        let man = layer
            .manual()
            .expect("decoder layers have a hand-written backward");
        let (y, saved) = man.forward_train(&x.as_tensor().detach(), &extras)?;
        let err = rel_err(&y, &y_ref)?;
        ensure!(err <= tol, "{dt:?} output: {err:.2e} > {tol:.0e}");
        let (dx, grads) = man.backward(saved, &g)?;
        let err = rel_err(&dx, want.get(x.as_tensor()).expect("dx"))?;
        ensure!(err <= tol, "{dt:?} dx: {err:.2e} > {tol:.0e}");
        ensure!(grads.len() == 9, "{} weight gradients", grads.len());
        for (name, v) in &vars {
            let (_, got) = grads
                .iter()
                .find(|(w, _)| w.id() == v.as_tensor().id())
                .ok_or_else(|| anyhow::anyhow!("no gradient for {name}"))?;
            let err = rel_err(got, want.get(v.as_tensor()).expect("reference"))?;
            ensure!(err <= tol, "{dt:?} grad of {name}: {err:.2e} > {tol:.0e}");
        }
        let err = man
            .forward_train(&x.as_tensor().detach(), &extras[..1])
            .expect_err("one extra");
        ensure!(err.to_string().contains("extras [cos, sin]"), "{err}");
    }
    Ok(())
}
candle_streamer::test_device!(decoder_manual_backward_matches_autograd);

/// A layer built from plain tensors (a frozen streamed layer's weights are
/// plain views of a pool slot) gets no projection weight gradients from the
/// hand-written backward (their GEMMs are skipped: nothing could consume
/// them), and the same input gradient as the layer over variables (to 1e-6:
/// the skipped products do not feed it, but the CUDA attention backward sums
/// dq with atomics, in no fixed order).
fn decoder_backward_skips_constant_weights(dev: &Device) -> Result<()> {
    let cfg = LlamaConfig {
        intermediate_size: 96,
        ..LlamaConfig::bytes(64, 1, 4, 2)
    };
    let (b, n) = (2, 11);
    let mut plain = HashMap::new();
    let mut vars = HashMap::new();
    for (name, t) in streamer_models::init_weights(&cfg, 5)? {
        if let Some(local) = name.strip_prefix("model.layers.0.") {
            let t = t.to_device(dev)?;
            vars.insert(local.to_string(), Var::from_tensor(&t)?.as_tensor().clone());
            plain.insert(local.to_string(), t);
        }
    }
    let extras = Rope::new(&cfg, DType::F32, dev)?.extras(n)?;
    let x = Tensor::randn(0f32, 1.0, (b, n, 64), dev)?;
    let g = Tensor::randn(0f32, 1.0, (b, n, 64), dev)?;
    let run = |ws: HashMap<String, Tensor>| -> Result<(Tensor, Vec<(Tensor, Tensor)>)> {
        let layer = DecoderLayer::new(&cfg, VarBuilder::from_tensors(ws, DType::F32, dev))?;
        let man = layer.manual().expect("hand-written backward");
        let (_, saved) = man.forward_train(&x, &extras)?;
        Ok(man.backward(saved, &g)?)
    };
    let (dx_var, grads_var) = run(vars)?;
    let (dx_plain, grads_plain) = run(plain)?;
    ensure!(
        grads_var.len() == 9,
        "{} gradients over variables",
        grads_var.len()
    );
    // Only the two norms' weight gradients remain (cheap, computed with dx).
    ensure!(
        grads_plain.len() == 2,
        "{} gradients for constant weights, expected the 2 norms'",
        grads_plain.len()
    );
    let e = rel_err(&dx_plain, &dx_var)?;
    ensure!(e <= 1e-6, "dx differs by {e:.2e}");
    Ok(())
}
candle_streamer::test_device!(decoder_backward_skips_constant_weights);

/// A resident 2-layer model over a `VarMap` (f32 or bf16) and a token batch.
fn resident_model(dev: &Device, dt: DType) -> Result<(candle_nn::VarMap, Llama, Tensor, Tensor)> {
    let cfg = LlamaConfig {
        intermediate_size: 96,
        tie_word_embeddings: false,
        ..LlamaConfig::bytes(64, 2, 4, 2)
    };
    let varmap = candle_nn::VarMap::new();
    {
        let mut data = varmap.data().lock().expect("fresh varmap");
        for (k, t) in streamer_models::init_weights(&cfg, 3)? {
            data.insert(k, Var::from_tensor(&t.to_dtype(dt)?.to_device(dev)?)?);
        }
    }
    let model = Llama::resident(VarBuilder::from_varmap(&varmap, dt, dev), &cfg)?;
    let ids: Vec<u32> = (0..2 * 19u32).map(|i| (i * 37 + 11) % 256).collect();
    let x = Tensor::from_vec(ids.clone(), (2, 19), dev)?;
    let y = Tensor::from_vec(
        ids.iter().map(|t| (t * 7 + 1) % 256).collect(),
        (2, 19),
        dev,
    )?;
    Ok((varmap, model, x, y))
}

fn resident_fused_backward_matches_autograd(dev: &Device) -> Result<()> {
    let mut dts = vec![(DType::F32, 1e-4)];
    if dev.is_cuda() {
        dts.push((DType::BF16, 4e-2));
    }
    for (dt, tol) in dts {
        let (varmap, model, x, y) = resident_model(dev, dt)?;
        let loss_ref = model.loss(&x, &y)?;
        let want = model.backward(&loss_ref)?;
        model.set_fused_backward(true)?;
        let loss = model.loss(&x, &y)?;
        let got = model.backward(&loss)?;
        let (a, b) = (loss.to_scalar::<f32>()?, loss_ref.to_scalar::<f32>()?);
        ensure!(
            (a - b).abs() <= 1e-5 * b.abs(),
            "{dt:?} loss {a} vs autograd {b}"
        );
        let vars = varmap.data().lock().expect("varmap").clone();
        ensure!(vars.len() == 2 * 9 + 3, "{} variables", vars.len());
        for (name, v) in &vars {
            let g = got
                .get(v.as_tensor())
                .ok_or_else(|| anyhow::anyhow!("no gradient for {name}"))?;
            let err = rel_err(g, want.get(v.as_tensor()).expect("reference gradient"))?;
            ensure!(err <= tol, "{dt:?} grad of {name}: {err:.2e} > {tol:.0e}");
        }
        // A plain loss.backward() cannot see the layers' weight gradients: the
        // next training forward says so instead of training on without them.
        let _ = model.loss(&x, &y)?.backward()?;
        let err = model.loss(&x, &y).expect_err("uncollected gradients");
        ensure!(err.to_string().contains("Llama::backward"), "{err}");
        let loss = model.loss(&x, &y)?;
        ensure!(model
            .backward(&loss)?
            .get(vars["model.layers.1.mlp.up_proj.weight"].as_tensor())
            .is_some());
        // Cached decoding keeps its own path with the switch on: the prompt's
        // logits through the kv cache equal the plain forward's.
        model.clear_cache()?;
        let cached = model.forward_cached(&x)?;
        model.set_fused_backward(false)?;
        let plain = model.forward(&x)?;
        let err = rel_err(&cached, &plain)?;
        ensure!(
            err <= tol,
            "{dt:?} cached logits with the switch on: {err:.2e}"
        );
        ensure!(
            model.cached_positions()? == x.dim(1)?,
            "the cache holds the prompt"
        );
    }
    Ok(())
}
candle_streamer::test_device!(resident_fused_backward_matches_autograd);

/// The trainer's recompute (`ManualBackward::recompute_ctx`, which skips the
/// output's last GEMM) saves what the training forward saves, and
/// `saved_bytes` counts exactly what that takes, for a decoder
/// layer and a `FusedMlp` block, in f32 and (on CUDA) bf16: to 1e-6 of each
/// tensor's largest value (the same kernels on the same inputs). With LoRA on
/// down_proj the recompute still runs it (its adapter part is saved):
/// `lora_dropout_replays_in_streamed_backward` checks that path, recomputed
/// against kept.
fn recompute_saves_what_forward_saves(dev: &Device) -> Result<()> {
    use streamer_core::{BlockCtx, ManualBackward};
    let same =
        |what: &str, man: &dyn ManualBackward, x: &Tensor, extras: &[Tensor]| -> Result<()> {
            let (_, want) = man.forward_train(x, extras)?;
            let ctx = BlockCtx::training(0, dev, 7, false);
            let got = man.recompute_ctx(x, extras, &ctx)?;
            ensure!(
                got.0.len() == want.0.len(),
                "{what}: {} saved tensors, forward saves {}",
                got.0.len(),
                want.0.len()
            );
            for (k, (a, b)) in got.0.iter().zip(&want.0).enumerate() {
                ensure_close(&format!("{what}: saved {k}"), a, b, 1e-6)?;
            }
            // What a plan reserves for kept activations is what they take
            // (the rotary tables, shared by every layer, apart).
            let bytes = |ts: &[Tensor]| -> usize {
                ts.iter()
                    .map(|t| t.elem_count() * t.dtype().size_in_bytes())
                    .sum()
            };
            let kept = bytes(&want.0) - bytes(extras);
            let counted = man.saved_bytes(x.shape(), x.dtype());
            ensure!(
                counted == kept,
                "{what}: saved_bytes {counted}, the saved tensors take {kept}"
            );
            Ok(())
        };
    let cfg = LlamaConfig {
        intermediate_size: 96,
        ..LlamaConfig::bytes(64, 1, 4, 2)
    };
    let mut dts = vec![DType::F32];
    if dev.is_cuda() {
        dts.push(DType::BF16);
    }
    for dt in dts {
        let mut ws = HashMap::new();
        for (name, t) in streamer_models::init_weights(&cfg, 9)? {
            if let Some(local) = name.strip_prefix("model.layers.0.") {
                ws.insert(local.to_string(), t.to_dtype(dt)?.to_device(dev)?);
            }
        }
        let layer = DecoderLayer::new(&cfg, VarBuilder::from_tensors(ws, dt, dev))?;
        let extras = Rope::new(&cfg, dt, dev)?.extras(13)?;
        let x = Tensor::randn(0f32, 1.0, (2, 13, 64), dev)?.to_dtype(dt)?;
        let man = layer.manual().expect("hand-written backward");
        same(&format!("decoder layer {dt:?}"), man, &x, &extras)?;
        let mlp = {
            let [w1, b1, w2, b2] = super::fused_mlp::mlp_weights(64, 96, dev, dt)?;
            streamer_models::FusedMlp::new(w1, b1, w2, b2)?
        };
        let man = mlp.manual().expect("hand-written backward");
        same(&format!("FusedMlp {dt:?}"), man, &x, &[])?;
    }
    Ok(())
}
candle_streamer::test_device!(recompute_saves_what_forward_saves);
