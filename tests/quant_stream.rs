//! A streamed Llama over a quantized base (`Llama::streamed_quantized`):
//! its logits equal those of the same model built from the CPU-dequantized
//! weights (streamed: bit for bit; resident: within a stated tolerance),
//! QLoRA trains adapters on it with the loss curve of LoRA on the dense
//! dequantized base, the pool copies the packed bytes (not dense ones; a
//! layer's seven in one copy, its image), and bad input is refused naming
//! the tensor.
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Optimizer, ParamsAdamW, VarBuilder};
use std::collections::HashMap;
use streamer_core::WeightSource;
use streamer_models::{init_weights, Llama, LlamaConfig, LoraAdapters, LoraConfig, LORA_TARGETS};
use streamer_models::{is_quantizable, QuantizedWeights, QUANTIZABLE};
use streamer_quant::{FourBitType, QuantScheme};

/// The formats under test, by name: NF4 plain and nested, int8, fp8.
fn schemes() -> Vec<(&'static str, QuantScheme)> {
    let nf4 = |double| QuantScheme::FourBit {
        kind: FourBitType::Nf4,
        blocksize: 64,
        double,
    };
    vec![
        ("nf4", nf4(false)),
        ("nf4 nested", nf4(true)),
        ("int8", QuantScheme::Int8),
        ("fp8", QuantScheme::Fp8 { per_row: true }),
    ]
}

/// The tiny preset's dense weights and their quantization.
fn base(scheme: QuantScheme) -> Result<(LlamaConfig, HashMap<String, Tensor>, QuantizedWeights)> {
    let cfg = LlamaConfig::tiny();
    let w = init_weights(&cfg, 7)?;
    let q = QuantizedWeights::quantize_source(&WeightSource::Tensors(w.clone()), &cfg, scheme)?;
    Ok((cfg, w, q))
}

/// `dense` with every quantized weight replaced by its CPU dequantization.
fn dequantized(
    dense: &HashMap<String, Tensor>,
    q: &QuantizedWeights,
) -> Result<HashMap<String, Tensor>> {
    let mut w = dense.clone();
    for (name, t) in q.dequantized()? {
        w.insert(name, t);
    }
    Ok(w)
}

/// Token ids `(2, 24)` and their next-token targets.
fn tokens(dev: &Device) -> Result<(Tensor, Tensor)> {
    let ids: Vec<u32> = (0..50u32).map(|i| (i * 37 + 11) % 256).collect();
    let x = Tensor::from_vec(ids[..48].to_vec(), (2, 24), dev)?;
    let y = Tensor::from_vec(ids[1..49].to_vec(), (2, 24), dev)?;
    Ok((x, y))
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let d = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?.abs()?;
    Ok(d.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

fn quant_stream_logits_equal_the_dequantized_model(dev: &Device) -> Result<()> {
    let dtype = crate::common::compute_dtype(dev);
    for (what, scheme) in schemes() {
        let (cfg, w, q) = base(scheme)?;
        let stream = crate::common::stream(dev, dtype, 1);
        let src = WeightSource::Tensors(w.clone());
        let quantized = Llama::streamed_quantized(&src, &q, &cfg, stream.clone())?;
        let deq = dequantized(&w, &q)?;
        let streamed = Llama::from_tensors(deq.clone(), &cfg, stream)?;
        let resident = Llama::resident(VarBuilder::from_tensors(deq, dtype, dev), &cfg)?;
        let (x, _) = tokens(dev)?;
        let got = quantized.forward(&x)?;
        // The same dequantized weights through the same streamed code: equal.
        let d = max_abs_diff(&got, &streamed.forward(&x)?)?;
        ensure!(
            d == 0.0,
            "{what}: streamed quantized vs streamed dequantized differ by {d}"
        );
        // Resident: the same math, its own kernels' order of operations
        // (f32 on the CPU, bf16 on CUDA).
        let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
        let want = resident.forward(&x)?;
        crate::common::ensure_close(
            &format!("{what}: vs resident dequantized"),
            &got,
            &want,
            tol,
        )?;
    }
    Ok(())
}
candle_streamer::test_device!(quant_stream_logits_equal_the_dequantized_model);

/// A layer with only some of its weights quantized keeps those as buffers
/// (and host masters) of their own, the whole layers' seven are one image
/// each, and the model gives the dequantized model's logits.
fn quant_stream_partly_quantized_layer_stays_loose(dev: &Device) -> Result<()> {
    let dtype = crate::common::compute_dtype(dev);
    let cfg = LlamaConfig::tiny();
    let w = init_weights(&cfg, 7)?;
    let scheme = schemes()[0].1;
    let mut q = QuantizedWeights::default();
    for (name, t) in &w {
        let left_dense = name.starts_with("model.layers.1.") && !name.contains(".mlp.");
        if is_quantizable(name) && !left_dense {
            let values = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            q.insert_host(name, scheme.quantize(name, &values, t.dims())?)?;
        }
    }
    ensure!(
        q.image_bytes(0).is_some() && q.image_bytes(1).is_none(),
        "images: layer 0 {:?}, layer 1 {:?}",
        q.image_bytes(0),
        q.image_bytes(1)
    );
    let stream = crate::common::stream(dev, dtype, 1);
    let src = WeightSource::Tensors(w.clone());
    let quantized = Llama::streamed_quantized(&src, &q, &cfg, stream.clone())?;
    let streamed = Llama::from_tensors(dequantized(&w, &q)?, &cfg, stream)?;
    let (x, _) = tokens(dev)?;
    let d = max_abs_diff(&quantized.forward(&x)?, &streamed.forward(&x)?)?;
    ensure!(d == 0.0, "partly quantized vs dequantized differ by {d}");
    let masters = quantized.weights()?;
    for (name, want) in [
        ("model.layers.0.quantized_weights", true),
        ("model.layers.0.mlp.up_proj.weight", false),
        ("model.layers.1.quantized_weights", false),
        ("model.layers.1.mlp.up_proj.weight", true),
    ] {
        ensure!(
            masters.contains_key(name) == want,
            "{name}: a host master {}",
            if want { "missing" } else { "unexpected" }
        );
    }
    Ok(())
}
candle_streamer::test_device!(quant_stream_partly_quantized_layer_stays_loose);

fn quant_stream_copies_the_packed_bytes(dev: &Device) -> Result<()> {
    let dtype = crate::common::compute_dtype(dev);
    for (what, scheme) in schemes() {
        let (cfg, w, q) = base(scheme)?;
        let stream = crate::common::stream(dev, dtype, 1);
        let model = Llama::streamed_quantized(&WeightSource::Tensors(w), &q, &cfg, stream)?;
        let (x, _) = tokens(dev)?;
        let before = model.stats()?.context("streamed")?;
        model.forward(&x)?;
        let after = model.stats()?.context("streamed")?;
        let (loads, bytes) = (
            after.loads - before.loads,
            after.h2d_bytes - before.h2d_bytes,
        );
        ensure!(loads > 0, "{what}: no layer was loaded");
        // A layer's copy: its image (the packed linear weights, aligned)
        // and its two f32 norms.
        let layers = cfg.num_hidden_layers;
        let image = q.image_bytes(0).context("layer 0 has no image")?;
        let padding = 6 * 255;
        ensure!(
            (q.packed_bytes() / layers..=q.packed_bytes() / layers + padding).contains(&image),
            "{what}: a {image}-byte image for {} packed bytes a layer",
            q.packed_bytes() / layers
        );
        let per_layer = (image + 2 * cfg.hidden_size * 4) as u64;
        ensure!(
            bytes == loads * per_layer,
            "{what}: {bytes} bytes for {loads} layer loads, expected {per_layer} a layer"
        );
        // The dense layer's f32 masters.
        let dense = cfg.layer_params() * 4;
        ensure!(
            per_layer < dense as u64,
            "{what}: {per_layer} packed vs {dense} dense bytes"
        );
    }
    Ok(())
}
candle_streamer::test_device!(quant_stream_copies_the_packed_bytes);

/// Losses of 20 LoRA steps (r 4 on every projection, no dropout) on `model`.
fn lora_losses(model: Llama, cfg: &LlamaConfig, dev: &Device) -> Result<Vec<f32>> {
    let model = model.into_trainable()?;
    let lcfg = LoraConfig::new(4, 8.0, 0.0, &LORA_TARGETS)?;
    model.set_lora(Some(LoraAdapters::init(&lcfg, cfg, dev, 3)?))?;
    let vars = model.lora()?.context("adapters")?.vars();
    let params = ParamsAdamW {
        lr: 1e-2,
        ..Default::default()
    };
    let mut opt = candle_nn::AdamW::new(vars.iter().map(|(_, v)| v.clone()).collect(), params)?;
    let (x, y) = tokens(dev)?;
    crate::common::train_adapters(&model, &mut opt, (&x, &y), 20)
}

fn quant_stream_qlora_follows_lora_on_the_dequantized_base(dev: &Device) -> Result<()> {
    let dtype = crate::common::compute_dtype(dev);
    let (cfg, w, q) = base(schemes()[0].1)?;
    let stream = crate::common::stream(dev, dtype, 1);
    let quantized =
        Llama::streamed_quantized(&WeightSource::Tensors(w.clone()), &q, &cfg, stream.clone())?;
    let dense = Llama::from_tensors(dequantized(&w, &q)?, &cfg, stream)?;
    let got = lora_losses(quantized, &cfg, dev)?;
    let want = lora_losses(dense, &cfg, dev)?;
    // The same dequantized weights, adapters and batches: the same curve
    // (bit for bit is expected; 1e-6 relative allowed a step).
    for (s, (g, w)) in got.iter().zip(&want).enumerate() {
        ensure!(
            (g - w).abs() <= 1e-6 * w.abs(),
            "step {s}: QLoRA {g} vs LoRA {w}\n{got:?}\n{want:?}"
        );
    }
    ensure!(got[19] < 0.9 * got[0], "QLoRA did not learn: {got:?}");
    Ok(())
}
candle_streamer::test_device!(quant_stream_qlora_follows_lora_on_the_dequantized_base);

fn quant_stream_bad_input_names_the_tensor(dev: &Device) -> Result<()> {
    let dtype = crate::common::compute_dtype(dev);
    let (cfg, w, q) = base(schemes()[0].1)?;
    let stream = crate::common::stream(dev, dtype, 1);
    let src = WeightSource::Tensors(w.clone());
    let name = "model.layers.1.self_attn.q_proj.weight";
    let expect_err = |r: candle_core::Result<Llama>, words: &[&str]| -> Result<()> {
        let Err(e) = r else {
            anyhow::bail!("accepted, expected an error with {words:?}")
        };
        let msg = e.to_string();
        ensure!(
            words.iter().all(|w| msg.contains(w)),
            "error {msg:?} lacks {words:?}"
        );
        Ok(())
    };
    // A quantized tensor of the wrong shape for the config.
    let mut bad = q.clone();
    let values = vec![0.5f32; 128 * 64];
    let scheme = schemes()[0].1;
    bad.insert_host(name, scheme.quantize(name, &values, &[64, 128])?)?;
    expect_err(
        Llama::streamed_quantized(&src, &bad, &cfg, stream.clone()),
        &[name, "[64, 128]"],
    )?;
    // A weight that stays dense (a norm) given quantized.
    let mut bad = q.clone();
    let norm = "model.layers.0.input_layernorm.weight";
    bad.insert_host(norm, scheme.quantize(norm, &vec![1.0; 128], &[128])?)?;
    expect_err(
        Llama::streamed_quantized(&src, &bad, &cfg, stream.clone()),
        &[norm],
    )?;
    // A packed buffer of the wrong length.
    let layout = scheme.layout(name, &[128, 128])?;
    let e = QuantizedWeights::default()
        .insert_packed(layout, vec![0; 10])
        .err();
    ensure!(
        e.is_some_and(|e| e.to_string().contains(name)),
        "short buffer accepted"
    );
    // Full fine-tuning of the quantized base: refused before any copy.
    let model = Llama::streamed_quantized(&src, &q, &cfg, stream.clone())?.into_trainable()?;
    let loads = model.stats()?.context("streamed")?.loads;
    let (x, y) = tokens(dev)?;
    let e = model
        .loss(&x, &y)
        .err()
        .context("full fine-tune accepted")?;
    ensure!(
        e.to_string()
            .contains("model.layers.0.mlp.down_proj.weight"),
        "{e}"
    );
    ensure!(
        model.stats()?.context("streamed")?.loads == loads,
        "copied before refusing"
    );
    // A LoRA merge needs the targets dense.
    let lcfg = LoraConfig::new(4, 8.0, 0.0, &["q_proj"])?;
    model.set_lora(Some(LoraAdapters::init(&lcfg, &cfg, dev, 3)?))?;
    let e = model
        .merged_weights()
        .err()
        .context("merge into a quantized base accepted")?;
    ensure!(e.to_string().contains("quantized"), "{e}");
    let mut packed = HashMap::new();
    for i in 0..cfg.num_hidden_layers {
        let n = format!("model.layers.{i}.{}", QUANTIZABLE[0]);
        packed.insert(n, Tensor::zeros(8, DType::U8, &Device::Cpu)?);
    }
    let a = model.lora()?.context("adapters")?;
    let e = a
        .merge_into(&mut packed)
        .err()
        .context("merge into packed bytes accepted")?;
    let first = "model.layers.0.self_attn.q_proj.weight";
    ensure!(
        e.to_string().contains(first) && e.to_string().contains("quantized"),
        "{e}"
    );
    Ok(())
}
candle_streamer::test_device!(quant_stream_bad_input_names_the_tensor);

fn quant_stream_masters_share_the_packed_buffers(dev: &Device) -> Result<()> {
    let (cfg, w, q) = base(schemes()[0].1)?;
    let stream = crate::common::stream(dev, crate::common::compute_dtype(dev), 1);
    let model = Llama::streamed_quantized(&WeightSource::Tensors(w), &q, &cfg, stream)?;
    // A layer's host master is its image, which the packed buffers are
    // views of (no second copy), and the only master of its seven weights.
    let name = "model.layers.2.mlp.up_proj.weight";
    let image = "model.layers.2.quantized_weights";
    let mut masters = model.weights()?;
    ensure!(
        !masters.contains_key(name),
        "{name} has a master of its own"
    );
    let theirs = masters.remove(image).context("the layer's image")?;
    let ours = q.dequantized()?.remove(name).context("packed")?;
    ensure!(
        theirs.dtype() == DType::U8 && Some(theirs.elem_count()) == q.image_bytes(2),
        "master {image} is {:?} of {:?}, image {:?} bytes",
        theirs.dtype(),
        theirs.dims(),
        q.image_bytes(2)
    );
    let (a, b) = (
        theirs.storage_and_layout().0,
        q.packed_tensor(name)
            .context("packed")?
            .storage_and_layout()
            .0,
    );
    ensure!(
        std::ptr::eq(&*a, &*b),
        "{name}: the master is a copy of the packed buffer"
    );
    ensure!(ours.dims() == [384, 128], "{:?}", ours.dims());
    Ok(())
}
candle_streamer::test_device!(quant_stream_masters_share_the_packed_buffers);

fn quant_stream_packed_buffer_dequantizes_as_its_tensor(dev: &Device) -> Result<()> {
    let values: Vec<f32> = (0..96 * 64)
        .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 4e3)
        .collect();
    let mut all = schemes();
    all.push(("fp4", QuantScheme::parse("fp4")?));
    all.push(("fp8 tensor scale", QuantScheme::Fp8 { per_row: false }));
    for (what, scheme) in all {
        let t = scheme.quantize("w", &values, &[96, 64])?;
        let layout = t.layout();
        let bytes = t.to_bytes();
        ensure!(
            bytes.len() == layout.bytes(),
            "{what}: {} bytes",
            bytes.len()
        );
        ensure!(
            layout == scheme.layout("w", &[96, 64])?,
            "{what}: layout without data differs"
        );
        let want = Tensor::from_vec(t.dequantize_bf16(), (96, 64), dev)?;
        let on_dev = Tensor::from_vec(bytes.clone(), bytes.len(), dev)?;
        let got = streamer_quant::dequantize(&on_dev, &layout)?;
        ensure!(
            got.dtype() == DType::BF16 && got.dims() == [96, 64],
            "{what}: {:?}",
            got.shape()
        );
        ensure!(max_abs_diff(&got, &want)? == 0.0, "{what}: not bit for bit");
        // Bad buffers: another dtype, another length.
        let f = on_dev.to_dtype(DType::F32)?;
        ensure!(
            streamer_quant::dequantize(&f, &layout).is_err(),
            "{what}: f32 buffer accepted"
        );
        let short = on_dev.narrow(0, 0, bytes.len() - 1)?;
        let e = streamer_quant::dequantize(&short, &layout)
            .err()
            .context("short buffer accepted")?;
        ensure!(e.to_string().contains("w:"), "{what}: {e}");
    }
    Ok(())
}
candle_streamer::test_device!(quant_stream_packed_buffer_dequantizes_as_its_tensor);

/// A seeded quantized base made a layer at a time
/// (`QuantizedWeights::quantize_init`, `train_lm --quantize` without
/// `--model`) has the bytes of the whole init quantized at once, and a LoRA
/// run's host plan counts what such a base holds: each layer's streamed
/// masters and the dense embedding, norm and head.
#[test]
fn quant_stream_seeded_base_and_its_host_plan() -> Result<()> {
    use streamer_models::{init_weights_where, is_quantizable, HostPlan, LayerFootprint};
    for (what, scheme) in schemes() {
        let (cfg, w, whole) = base(scheme)?;
        let layered = QuantizedWeights::quantize_init(&cfg, scheme, 7)?;
        ensure!(layered.names() == whole.names(), "{what}: names differ");
        for name in whole.names() {
            let bytes = |q: &QuantizedWeights| -> Result<Vec<u8>> {
                Ok(q.packed_tensor(&name).context("packed")?.to_vec1::<u8>()?)
            };
            ensure!(
                layered.layout(&name) == whole.layout(&name) && bytes(&layered)? == bytes(&whole)?,
                "{what}: {name} differs from the whole init's"
            );
        }
        let dtype = DType::BF16;
        let dense = init_weights_where(&cfg, 7, |n| !is_quantizable(n))?;
        // Masters in the compute dtype, as `train_lm` makes a LoRA base's.
        let stream = streamer_core::StreamConfig {
            master_dtype: Some(dtype),
            ..crate::common::stream(&Device::Cpu, dtype, 1)
        };
        let model =
            Llama::streamed_quantized(&WeightSource::Tensors(dense), &layered, &cfg, stream)?;
        let layers = model
            .streamed_layers()
            .context("streamed")?
            .masters()
            .bytes();
        let outer: usize = (w.iter())
            .filter(|(n, _)| !n.starts_with("model.layers."))
            .map(|(_, t)| t.elem_count() * dtype.size_in_bytes())
            .sum();
        let slot = LayerFootprint::of_base(&cfg, dtype, None, Some(scheme))?.slot;
        let plan = HostPlan::for_lora(&cfg, slot, dtype, None);
        ensure!(
            plan.masters == layers + outer && plan.total() == plan.masters,
            "{what}: {plan:?} against {layers} bytes of layers and {outer} outer"
        );
        // Offloaded inputs: every layer's but the first's, for 2 x 24 tokens.
        let offload = HostPlan::for_lora(&cfg, slot, dtype, Some((2, 24, dtype)));
        let inputs = (cfg.num_hidden_layers - 1) * 2 * 24 * cfg.hidden_size * 2;
        ensure!(offload.activations == inputs, "{what}: {offload:?}");
    }
    Ok(())
}

/// Quantizing a base as it loads tells the stream's setup hook each weight
/// done (`SetupEvent::Quantized`, 1 to 7 a layer's worth of weights), before
/// the blocks' masters.
#[test]
fn quant_stream_on_load_reports_each_weight() -> Result<()> {
    use std::sync::{Arc, Mutex};
    use streamer_core::{SetupEvent, SetupHook};
    let (cfg, w, _) = base(schemes()[0].1)?;
    let heard: Arc<Mutex<Vec<SetupEvent>>> = Arc::default();
    let log = heard.clone();
    let stream = streamer_core::StreamConfig {
        on_setup: Some(SetupHook::new(move |e| log.lock().expect("log").push(e))),
        ..crate::common::stream(&Device::Cpu, DType::F32, 1)
    };
    let src = WeightSource::Tensors(w);
    Llama::streamed_quantize_on_load(&src, schemes()[0].1, &cfg, stream)?;
    let heard = heard.lock().expect("log").clone();
    let total = QUANTIZABLE.len() * cfg.num_hidden_layers;
    let want: Vec<SetupEvent> = (1..=total)
        .map(|done| SetupEvent::Quantized { done, total })
        .collect();
    ensure!(
        heard.len() > total && heard[..total] == want[..],
        "{heard:?}"
    );
    ensure!(
        matches!(heard[total], SetupEvent::Masters { done: 1, .. }),
        "{:?} after the weights",
        heard[total]
    );
    Ok(())
}
