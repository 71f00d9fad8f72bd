//! LoRA on a frozen base against PEFT: adapters written by PEFT
//! (`tests/fixtures/hf/lora-peft`, on the `llama-4x` base) load and give PEFT's
//! logits, loss and every adapter gradient (f32 relative error <= 1e-4), on a
//! resident base and on a streamed trainable one whose own weights stay
//! frozen; merged weights give PEFT's merged logits; our saves use PEFT's
//! names and read back; bad adapters are errors naming file and field.
use super::families::fixture;
use super::fused_mlp::rel_err;
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Optimizer, ParamsAdamW, VarBuilder};
use std::collections::HashMap;
use std::path::PathBuf;
use streamer_autograd::ActivationPolicy;
use streamer_models::{Llama, LlamaConfig, LoraAdapters, LoraConfig};

const TOL: f64 = 1e-4;

struct Fx {
    base: PathBuf,
    adapters: PathBuf,
    cfg: LlamaConfig,
    reference: HashMap<String, Tensor>,
}

fn load() -> Result<Fx> {
    let base = fixture("llama-4x")?;
    let adapters = base.with_file_name("lora-peft");
    let cfg = LlamaConfig::from_json_file(base.join("config.json"))?;
    let reference = crate::families::reference(&adapters)?;
    Ok(Fx {
        base,
        adapters,
        cfg,
        reference,
    })
}

impl Fx {
    fn get(&self, k: &str) -> Result<&Tensor> {
        self.reference.get(k).with_context(|| format!("no {k}"))
    }

    fn inputs(&self, dev: &Device) -> Result<(Tensor, Tensor)> {
        let t =
            |k: &str| -> Result<Tensor> { Ok(self.get(k)?.to_dtype(DType::U32)?.to_device(dev)?) };
        Ok((t("tokens")?, t("targets")?))
    }

    fn weights(&self) -> PathBuf {
        self.base.join("model.safetensors")
    }
}

fn check(what: &str, got: &Tensor, want: &Tensor) -> Result<()> {
    crate::common::ensure_close(what, got, want, TOL)
}

/// The fixture's base streamed and trainable in `dtype`, PEFT's adapters on.
fn streamed_with_peft(fx: &Fx, dev: &Device, dtype: DType) -> Result<Llama> {
    let stream = crate::common::stream(dev, dtype, 1);
    let streamed = Llama::from_safetensors(&[fx.weights()], &fx.cfg, stream)?.into_trainable()?;
    streamed.set_lora(Some(LoraAdapters::load_peft(&fx.adapters, &fx.cfg, dev)?))?;
    Ok(streamed)
}

/// The fixture, its base streamed in `dtype` with PEFT's adapters on, and
/// its inputs and targets.
fn peft_fixture(dev: &Device, dtype: DType) -> Result<(Fx, Llama, (Tensor, Tensor))> {
    let fx = load()?;
    let streamed = streamed_with_peft(&fx, dev, dtype)?;
    let xy = fx.inputs(dev)?;
    Ok((fx, streamed, xy))
}

/// Each adapter of `model`: its name, its gradient in `grads` and PEFT's.
fn adapter_grads(
    fx: &Fx,
    model: &Llama,
    grads: &candle_core::backprop::GradStore,
    dev: &Device,
) -> Result<Vec<(String, Tensor, Tensor)>> {
    let adapters = model.lora()?.context("adapters on")?;
    let mut out = Vec::new();
    for (name, v) in adapters.vars() {
        let g = grads
            .get(v.as_tensor())
            .with_context(|| format!("no gradient for {name}"))?;
        let want = fx.get(&format!("grad.{name}"))?.to_device(dev)?;
        out.push((name, g.clone(), want));
    }
    Ok(out)
}

/// Logits, loss and each adapter's gradient of `model` (adapters on) against PEFT.
fn matches_peft(fx: &Fx, model: &Llama, dev: &Device, what: &str) -> Result<()> {
    let (x, y) = fx.inputs(dev)?;
    let loss = model.loss(&x, &y)?;
    check(&format!("{what} loss"), &loss, fx.get("loss")?)?;
    let grads = model.backward(&loss)?;
    let adapters = model.lora()?.context("adapters on")?;
    let vars = adapters.vars();
    ensure!(vars.len() == 16, "{} adapter tensors", vars.len());
    for (name, v) in &vars {
        let g = grads
            .get(v.as_tensor())
            .with_context(|| format!("{what}: no gradient for {name}"))?;
        check(
            &format!("{what} grad {name}"),
            g,
            fx.get(&format!("grad.{name}"))?,
        )?;
    }
    model.set_training(false);
    check(
        &format!("{what} logits"),
        &model.forward(&x)?,
        fx.get("logits")?,
    )?;
    Ok(())
}

fn lora_peft_adapters_match_peft_resident_and_streamed(dev: &Device) -> Result<()> {
    let fx = load()?;
    let resident = Llama::load_resident(&[fx.weights()], &fx.cfg, DType::F32, dev)?;
    resident.set_lora(Some(LoraAdapters::load_peft(&fx.adapters, &fx.cfg, dev)?))?;
    matches_peft(&fx, &resident, dev, "resident")?;
    let streamed = streamed_with_peft(&fx, dev, DType::F32)?;
    let (x, y) = fx.inputs(dev)?;
    let grads = streamed.backward(&streamed.loss(&x, &y)?)?;
    // The base layers are frozen: no gradient comes back for them.
    for (name, v) in streamed.parameters() {
        if name.starts_with("model.layers.") {
            ensure!(
                grads.get(v.as_tensor()).is_none(),
                "frozen {name} has a gradient"
            );
        }
    }
    streamed.zero_grad()?;
    matches_peft(&fx, &streamed, dev, "streamed")?;
    // Each layer visited once for both sequences, run one at a time: the
    // adapters' gradients (extras, summed over the pieces) are PEFT's.
    streamed.set_training(true);
    let layers = streamed.trainable_layers().context("trainable")?;
    layers.set_micro_batch_rows(Some(1))?;
    streamed.zero_grad()?;
    matches_peft(&fx, &streamed, dev, "streamed, one sequence at a time")?;
    layers.set_micro_batch_rows(None)?;
    // Taking the adapters off gives the base model back.
    streamed.set_lora(None)?;
    let base = Llama::load_resident(&[fx.weights()], &fx.cfg, DType::F32, dev)?;
    let d = rel_err(&streamed.forward(&x)?, &base.forward(&x)?)?;
    ensure!(d <= TOL, "adapters off: {d:.2e}");
    Ok(())
}
candle_streamer::test_device!(lora_peft_adapters_match_peft_resident_and_streamed);

/// A streamed base computing in bf16 converts the f32 adapters in each
/// layer; their gradients come back on the f32 adapters, in f32, with
/// PEFT's values to bf16's precision, over two steps, and no other tensor
/// keeps one. A bf16 forward and backward of the fixture puts each gradient
/// 2.4e-2 to 6.2e-2 (relative to its largest value) from PEFT's f32 one on
/// the CPU: the bound is 1e-1, while a gradient lost or counted twice is off
/// by 1 or more. (The f32 tests above never convert the adapters.)
fn lora_bf16_base_gives_the_f32_adapters_their_gradients(dev: &Device) -> Result<()> {
    let (fx, streamed, (x, y)) = peft_fixture(dev, DType::BF16)?;
    for step in 0..2 {
        let grads = streamed.backward(&streamed.loss(&x, &y)?)?;
        for (name, g, want) in adapter_grads(&fx, &streamed, &grads, dev)? {
            ensure!(
                g.dtype() == DType::F32,
                "{name}: a {:?} gradient",
                g.dtype()
            );
            let e = rel_err(&g, &want)?;
            ensure!(
                e <= 1e-1,
                "step {step}: {name}'s bf16 gradient off by {e:.2e}"
            );
        }
        // Every gradient is the adapters', the base's or the outer weights'.
        let adapters = streamed.lora()?.context("adapters on")?;
        let owners = adapters.vars().len() + streamed.parameters().len();
        let held = grads.get_ids().count();
        ensure!(held <= owners, "{held} gradients for {owners} variables");
        streamed.zero_grad()?;
    }
    Ok(())
}
candle_streamer::test_device!(lora_bf16_base_gives_the_f32_adapters_their_gradients);

/// The streamed blocks read the adapters as they were at the forward: a
/// `Var::set` of every adapter between the forward and its backward (here to
/// zeros, which would zero every `A` gradient) leaves the gradients PEFT's,
/// f32 relative error <= 1e-4.
fn lora_backward_reads_the_adapters_of_its_forward(dev: &Device) -> Result<()> {
    let (fx, streamed, (x, y)) = peft_fixture(dev, DType::F32)?;
    let loss = streamed.loss(&x, &y)?;
    let adapters = streamed.lora()?.context("adapters on")?;
    for (_, v) in adapters.vars() {
        v.set(&v.as_tensor().zeros_like()?)?;
    }
    let grads = streamed.backward(&loss)?;
    for (name, g, want) in adapter_grads(&fx, &streamed, &grads, dev)? {
        check(&format!("{name} after Var::set"), &g, &want)?;
    }
    Ok(())
}
candle_streamer::test_device!(lora_backward_reads_the_adapters_of_its_forward);

fn lora_merge_and_save_round_trip(dev: &Device) -> Result<()> {
    let fx = load()?;
    let model = Llama::load_resident(&[fx.weights()], &fx.cfg, DType::F32, dev)?;
    model.set_lora(Some(LoraAdapters::load_peft(&fx.adapters, &fx.cfg, dev)?))?;
    let (x, _) = fx.inputs(dev)?;
    // The kv cache sees the adapters too: cached calls give the full forward's logits.
    let full = model.forward(&x)?;
    let first = model.forward_cached(&x.narrow(1, 0, 10)?)?;
    let rest = model.forward_cached(&x.narrow(1, 10, x.dim(1)? - 10)?)?;
    check(
        "cached logits",
        &candle_core::Tensor::cat(&[first, rest], 1)?,
        &full,
    )?;
    model.clear_cache()?;
    let merged = model.merged_weights()?;
    let vb = VarBuilder::from_tensors(merged, DType::F32, dev);
    let plain = Llama::resident(vb, &fx.cfg)?;
    check(
        "merged logits",
        &plain.forward(&x)?,
        fx.get("logits_merged")?,
    )?;
    // Our save has PEFT's tensor names and config, and reads back exactly.
    // Its own folder: the CPU and CUDA variants of this test run at once.
    let dir = super::common::temp_dir("lora", "save")?;
    let adapters = model.lora()?.context("adapters")?;
    adapters.save_peft(&dir, Some("llama-4x"))?;
    let ours = candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &Device::Cpu)?;
    let peft = candle_core::safetensors::load(
        fx.adapters.join("adapter_model.safetensors"),
        &Device::Cpu,
    )?;
    let mut a: Vec<&String> = ours.keys().collect();
    let mut b: Vec<&String> = peft.keys().collect();
    a.sort();
    b.sort();
    ensure!(a == b, "tensor names differ: {a:?} vs {b:?}");
    for (k, t) in &peft {
        ensure!(rel_err(&ours[k], t)? == 0.0, "{k} changed on save");
    }
    let again = LoraAdapters::load_peft(&dir, &fx.cfg, dev)?;
    ensure!(again.config() == adapters.config());
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
candle_streamer::test_device!(lora_merge_and_save_round_trip);

/// candle-nn's AdamW over `model`'s adapters at learning rate `lr`.
pub(crate) fn adapters_adamw(model: &Llama, lr: f64) -> Result<candle_nn::AdamW> {
    let vars = model.lora()?.context("adapters")?.vars();
    let params = ParamsAdamW {
        lr,
        ..Default::default()
    };
    Ok(candle_nn::AdamW::new(
        vars.into_iter().map(|(_, v)| v).collect(),
        params,
    )?)
}

/// Fine-tuning only the adapters of a streamed frozen base: the loss falls and
/// the base's weights do not change.
fn lora_trains_adapters_on_a_frozen_streamed_base(dev: &Device) -> Result<()> {
    let fx = load()?;
    let stream = crate::common::stream(dev, DType::F32, 0);
    let model = Llama::from_safetensors(&[fx.weights()], &fx.cfg, stream)?.into_trainable()?;
    let lcfg = LoraConfig::new(4, 16.0, 0.1, &["q_proj", "k_proj", "up_proj"])?;
    model.set_lora(Some(LoraAdapters::init(&lcfg, &fx.cfg, dev, 0)?))?;
    let before: Vec<Vec<f32>> = model
        .parameters()
        .iter()
        .map(|(_, v)| v.as_tensor().flatten_all()?.to_vec1())
        .collect::<candle_core::Result<_>>()?;
    let mut opt = adapters_adamw(&model, 3e-2)?;
    let (x, y) = fx.inputs(dev)?;
    let losses = crate::common::train_adapters(&model, &mut opt, (&x, &y), 15)?;
    ensure!(losses[14] < 0.8 * losses[0], "loss {losses:?}");
    let after: Vec<Vec<f32>> = model
        .parameters()
        .iter()
        .map(|(_, v)| v.as_tensor().flatten_all()?.to_vec1())
        .collect::<candle_core::Result<_>>()?;
    ensure!(before == after, "the frozen base changed");
    Ok(())
}
candle_streamer::test_device!(lora_trains_adapters_on_a_frozen_streamed_base);

fn lora_bad_adapters_are_named(dev: &Device) -> Result<()> {
    let fx = load()?;
    let e = LoraConfig::new(4, 8.0, 0.0, &["q_proj", "qkv"])
        .unwrap_err()
        .to_string();
    ensure!(e.contains("target_modules") && e.contains("qkv"), "{e}");
    ensure!(LoraConfig::new(4, 8.0, 0.0, &[])
        .unwrap_err()
        .to_string()
        .contains("names no module"));
    ensure!(LoraConfig::new(0, 8.0, 0.0, &["q_proj"])
        .unwrap_err()
        .to_string()
        .contains("r = 0"));
    ensure!(LoraConfig::new(4, 8.0, 1.0, &["q_proj"])
        .unwrap_err()
        .to_string()
        .contains("lora_dropout"));
    let text = std::fs::read_to_string(fx.adapters.join("adapter_config.json"))?;
    let file = fx.adapters.join("adapter_config.json");
    for (field, value, want) in [
        ("use_dora", serde_json::json!(true), "use_dora = true"),
        ("bias", serde_json::json!("all"), "bias = \"all\""),
        (
            "rank_pattern",
            serde_json::json!({"q_proj": 8}),
            "rank_pattern",
        ),
        (
            "target_modules",
            serde_json::json!(".*proj"),
            "target_modules",
        ),
        ("peft_type", serde_json::json!("IA3"), "peft_type"),
    ] {
        let mut v: serde_json::Value = serde_json::from_str(&text)?;
        v[field] = value;
        let e = LoraConfig::from_peft_json(&v.to_string(), &file)
            .unwrap_err()
            .to_string();
        ensure!(
            e.contains(want) && e.contains("adapter_config.json"),
            "{field}: {e}"
        );
    }
    // Adapters for another base: the error names the tensor or the layer.
    let wider = LlamaConfig {
        intermediate_size: 96,
        ..fx.cfg.clone()
    };
    let fewer = LlamaConfig {
        num_hidden_layers: 1,
        ..fx.cfg.clone()
    };
    let bases: [(&LlamaConfig, &[&str]); 2] = [
        (&wider, &["down_proj.lora_A.weight", "shape"]),
        (&fewer, &["layers.1"]),
    ];
    for (base, needles) in bases {
        let e = LoraAdapters::load_peft(&fx.adapters, base, dev)
            .unwrap_err()
            .to_string();
        ensure!(needles.iter().all(|n| e.contains(n)), "{e}");
    }
    let model = Llama::load_resident(&[fx.weights()], &fx.cfg, DType::F32, dev)?;
    let small = LoraAdapters::init(&LoraConfig::new(2, 4.0, 0.0, &["v_proj"])?, &fewer, dev, 0)?;
    ensure!(model
        .set_lora(Some(small))
        .unwrap_err()
        .to_string()
        .contains("num_hidden_layers"));
    Ok(())
}
candle_streamer::test_device!(lora_bad_adapters_are_named);

/// LoRA dropout on a streamed base: backward recomputes each layer, so its
/// masks must be the forward's. The adapter gradient then predicts the change
/// of the loss under the same seed (a directional finite difference of f32
/// losses: agreement to 2%), and training off means no dropout.
fn lora_dropout_replays_in_streamed_backward(dev: &Device) -> Result<()> {
    lora_dropout_replays(dev, None)
}
candle_streamer::test_device!(lora_dropout_replays_in_streamed_backward);

/// The same with each layer run over one sequence at a time in one visit
/// (`set_micro_batch_rows`): each piece's masks are replayed too.
fn lora_dropout_replays_piece_by_piece(dev: &Device) -> Result<()> {
    lora_dropout_replays(dev, Some(1))
}
candle_streamer::test_device!(lora_dropout_replays_piece_by_piece);

fn lora_dropout_replays(dev: &Device, micro: Option<usize>) -> Result<()> {
    let fx = load()?;
    let stream = crate::common::stream(dev, DType::F32, 1);
    let model = Llama::from_safetensors(&[fx.weights()], &fx.cfg, stream)?.into_trainable()?;
    let lcfg = LoraConfig::new(4, 8.0, 0.3, &["q_proj", "down_proj"])?;
    let adapters = LoraAdapters::load_peft(&fx.adapters, &fx.cfg, dev)?;
    // The fixture's values (B nonzero) under a config with dropout.
    let fresh = LoraAdapters::init(&lcfg, &fx.cfg, dev, 0)?;
    for (name, dst) in fresh.vars() {
        if let Some((_, v)) = adapters.vars().into_iter().find(|(n, _)| *n == name) {
            dst.set(v.as_tensor())?;
        }
    }
    model.set_lora(Some(fresh))?;
    let layers = model.trainable_layers().context("trainable")?;
    layers.set_activation_policy(ActivationPolicy::Recompute)?;
    layers.set_micro_batch_rows(micro)?;
    let (x, y) = fx.inputs(dev)?;
    layers.set_seed(11);
    let loss0 = model.loss(&x, &y)?;
    let grads = model.backward(&loss0)?;
    let vars = model.lora()?.context("adapters")?.vars();
    let (name, v) = vars
        .iter()
        .find(|(n, _)| n.contains("layers.0.mlp.down_proj.lora_B"))
        .context("down_proj B")?;
    let g = grads
        .get(v.as_tensor())
        .with_context(|| format!("no gradient for {name}"))?;
    let eps = 1e-2;
    let dir = (g / g.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()? as f64)?;
    let predicted = (g * &dir)?.sum_all()?.to_scalar::<f32>()? as f64 * eps;
    let base = v.as_tensor().copy()?;
    v.set(&(&base + (&dir * eps)?)?)?;
    layers.set_seed(11);
    let loss1 = model.loss(&x, &y)?;
    model.zero_grad()?;
    let actual = (loss1.to_scalar::<f32>()? - loss0.to_scalar::<f32>()?) as f64;
    ensure!(
        (actual - predicted).abs() <= 0.02 * predicted.abs(),
        "loss moved {actual:.6} where the gradient predicts {predicted:.6}"
    );
    // Kept activations (no recompute) give the same adapter gradients: they
    // are keyed by the extras the forward handed the layers (on CUDA, whose
    // default policy keeps, none came back before this was fixed).
    v.set(&base)?;
    layers.set_activation_policy(ActivationPolicy::Keep {
        device_bytes: 1 << 30,
    })?;
    layers.set_seed(11);
    let loss_k = model.loss(&x, &y)?;
    let grads_k = model.backward(&loss_k)?;
    model.zero_grad()?;
    let gk = grads_k
        .get(v.as_tensor())
        .with_context(|| format!("kept activations: no gradient for {name}"))?;
    let e = rel_err(gk, g)?;
    // The same masks either way (a wrong one would be off by O(1)); on CUDA
    // the recompute's GEMMs may sum in another order than the forward's
    // (1.5e-6 measured on the H200), so allow f32 rounding of a few sums.
    let tol = if x.device().is_cuda() { 1e-5 } else { 1e-6 };
    ensure!(e <= tol, "{name}: kept against recomputed {e:.2e}");
    // Out of training mode the dropout is off: the same logits every call.
    model.set_training(false);
    let (a, b) = (model.forward(&x)?, model.forward(&x)?);
    ensure!(rel_err(&a, &b)? == 0.0, "inference is not deterministic");
    Ok(())
}

/// The adapters' AdamW run over 4 sequences, with the sequences as 1, 2 and 4
/// micro-batches one after another (`lora_loss_and_grads`): the same loss
/// curve over 12 steps (f32, relative error <= 1e-5: only the order of the
/// sums differs) and the same adapters at the end (<= 1e-4: AdamW divides by
/// the root of the second moment, which scales the sums' rounding up).
fn lora_micro_batches_train_as_the_whole_batch(dev: &Device) -> Result<()> {
    let fx = load()?;
    let n = 12;
    let ids: Vec<u32> = (0..4 * (n + 1))
        .map(|i| ((i * 37 + 11) % fx.cfg.vocab_size) as u32)
        .collect();
    let all = Tensor::from_vec(ids, (4, n + 1), dev)?;
    let (x, y) = (all.narrow(1, 0, n)?, all.narrow(1, 1, n)?);
    let run = |micro: usize| -> Result<(Vec<f32>, Vec<Tensor>)> {
        let stream = crate::common::stream(dev, DType::F32, 0);
        let model = Llama::from_safetensors(&[fx.weights()], &fx.cfg, stream)?.into_trainable()?;
        let lcfg = LoraConfig::new(4, 16.0, 0.0, &["q_proj", "v_proj", "down_proj"])?;
        model.set_lora(Some(LoraAdapters::init(&lcfg, &fx.cfg, dev, 3)?))?;
        let vars = model.lora()?.context("adapters")?.vars();
        let mut opt = adapters_adamw(&model, 1e-2)?;
        let mut losses = Vec::new();
        for _ in 0..12 {
            let (loss, grads) = model.lora_loss_and_grads(&x, &y, micro)?;
            losses.push(loss);
            opt.step(&grads)?;
            model.zero_grad()?;
        }
        let weights = vars.iter().map(|(_, v)| v.as_tensor().copy());
        Ok((losses, weights.collect::<candle_core::Result<_>>()?))
    };
    let (want_losses, want) = run(1)?;
    ensure!(
        want_losses[11] < 0.9 * want_losses[0],
        "the adapters did not train: {want_losses:?}"
    );
    for micro in [2, 4] {
        let (losses, got) = run(micro)?;
        for (s, (a, b)) in losses.iter().zip(&want_losses).enumerate() {
            let e = ((a - b) / b).abs();
            ensure!(
                e <= 1e-5,
                "{micro} micro-batches, step {s}: loss {a} vs {b}"
            );
        }
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let what = format!("{micro} micro-batches, adapter {i}");
            crate::common::ensure_close(&what, g, w, 1e-4)?;
        }
    }
    let stream = crate::common::stream(dev, DType::F32, 0);
    let model = Llama::from_safetensors(&[fx.weights()], &fx.cfg, stream)?.into_trainable()?;
    crate::common::expect_err(model.lora_loss_and_grads(&x, &y, 2), &["no LoRA adapters"])?;
    let lcfg = LoraConfig::new(4, 16.0, 0.0, &["q_proj"])?;
    model.set_lora(Some(LoraAdapters::init(&lcfg, &fx.cfg, dev, 3)?))?;
    crate::common::expect_err(
        model.lora_loss_and_grads(&x, &y, 3),
        &["4 sequences", "3 equal micro-batches"],
    )?;
    Ok(())
}
candle_streamer::test_device!(lora_micro_batches_train_as_the_whole_batch);
