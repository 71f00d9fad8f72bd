//! streamer-core: `StreamedSequential` against plain resident Candle, the window,
//! ties, loading, statistics and every construction/call error.
use crate::common::insert_linear;
use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{linear, Linear, VarBuilder};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use streamer_core::{
    AcrossCalls, Block, BlockSpec, StreamConfig, StreamedSequential, TransitionKind,
};

/// Asserts |a - b| <= atol + rtol * |b| element-wise, in f64 on the CPU.
pub fn assert_close(a: &Tensor, b: &Tensor, atol: f64, rtol: f64, what: &str) -> Result<()> {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes differ");
    let a = a
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    let b = b
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    let mut worst = (0usize, 0f64);
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(x.is_finite(), "{what}: non-finite value at {i}");
        let excess = (x - y).abs() - (atol + rtol * y.abs());
        if excess > worst.1 {
            worst = (i, excess);
        }
    }
    assert!(
        worst.1 <= 0.0,
        "{what}: element {} is {} vs {} (atol {atol}, rtol {rtol})",
        worst.0,
        a[worst.0],
        b[worst.0]
    );
    Ok(())
}

/// The reference tolerance for a compute dtype (the figures).
pub fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::BF16 => 8e-3,
        DType::F16 => 1e-3,
        _ => 0.0,
    }
}

/// `Linear(w,h), GELU, Linear(h,w)`: the benchmark's block.
pub fn mlp(vb: VarBuilder, w: usize, h: usize) -> candle_core::Result<impl Module> {
    let up = linear(w, h, vb.pp("up"))?;
    let down = linear(h, w, vb.pp("down"))?;
    Ok(move |x: &Tensor| down.forward(&up.forward(x)?.gelu()?))
}

/// Random weights for `mlp` blocks `layers.{i}` with the given hidden sizes.
pub fn mlp_weights(w: usize, hidden: &[usize]) -> Result<HashMap<String, Tensor>> {
    let mut m = HashMap::new();
    for (i, &h) in hidden.iter().enumerate() {
        let s1 = 1.0 / (w as f64).sqrt();
        let s2 = 1.0 / (h as f64).sqrt();
        insert_linear(&mut m, &format!("layers.{i}.up"), (h, w), s1 as f32)?;
        insert_linear(&mut m, &format!("layers.{i}.down"), (w, h), s2 as f32)?;
    }
    Ok(m)
}

pub fn mlp_blocks(w: usize, hidden: &[usize]) -> Vec<BlockSpec> {
    hidden
        .iter()
        .enumerate()
        .map(|(i, &h)| BlockSpec::module(format!("layers.{i}"), move |vb| mlp(vb, w, h)))
        .collect()
}

/// The same blocks run resident with plain Candle (weights moved to `dev` in `dtype`).
pub fn resident_forward(
    weights: &HashMap<String, Tensor>,
    blocks: &[BlockSpec],
    x: &Tensor,
    extras: &[Tensor],
    dtype: DType,
    dev: &Device,
) -> Result<Vec<Tensor>> {
    let on_dev: HashMap<String, Tensor> = weights
        .iter()
        .map(|(k, v)| Ok((k.clone(), v.to_dtype(dtype)?.to_device(dev)?)))
        .collect::<Result<_>>()?;
    let vb = VarBuilder::from_tensors(on_dev, dtype, dev);
    let mut h = x.clone();
    let mut out = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        out = b.build(vb.pp(b.prefix()))?.forward(&h, extras)?;
        if i + 1 < blocks.len() {
            h = out[0].clone();
        }
    }
    Ok(out)
}

fn cfg(dev: &Device, dtype: DType, prefetch: usize) -> StreamConfig {
    StreamConfig {
        device: dev.clone(),
        prefetch_ahead: prefetch,
        dtype,
        ..Default::default()
    }
}

fn streamed_matches_resident(dev: &Device) -> Result<()> {
    let hidden = [24, 40, 16, 56, 32];
    let weights = mlp_weights(16, &hidden)?;
    let blocks = mlp_blocks(16, &hidden);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let x = Tensor::randn(0f32, 1.0, (5, 16), &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(dev)?;
        let want = resident_forward(&weights, &blocks, &x, &[], dtype, dev)?;
        for prefetch in 0..=3 {
            let model = StreamedSequential::from_tensors(
                weights.clone(),
                blocks.clone(),
                cfg(dev, dtype, prefetch),
            )?;
            let got = model.forward(&x)?;
            assert_eq!(got.dtype(), dtype);
            assert_close(
                &got,
                &want[0],
                tol(dtype),
                tol(dtype),
                &format!("{dtype:?} prefetch {prefetch}"),
            )?;
            let st = model.stats()?;
            assert_eq!(st.loads, hidden.len() as u64);
            assert!(st.peak_resident_blocks <= prefetch + 1);
            assert_eq!(st.resident_blocks, 0, "every block retires after the call");
        }
    }
    Ok(())
}
candle_streamer::test_device!(streamed_matches_resident);

/// A block with a non-trainable buffer, an extra input and two outputs.
struct Scaled {
    lin: Linear,
    scale: Tensor,
}

impl Block for Scaled {
    fn forward(&self, x: &Tensor, extras: &[Tensor]) -> candle_core::Result<Vec<Tensor>> {
        let mut y = self.lin.forward(x)?.broadcast_mul(&self.scale)?;
        if let Some(bias) = extras.first() {
            y = y.broadcast_add(bias)?;
        }
        let summary = y.sum_keepdim(D::Minus1)?;
        Ok(vec![y, summary])
    }
}

fn scaled(vb: VarBuilder, i: usize, o: usize) -> candle_core::Result<Scaled> {
    Ok(Scaled {
        lin: linear(i, o, vb.pp("lin"))?,
        scale: vb.get(o, "scale")?,
    })
}

fn heterogeneous_blocks_extras_and_tuple_outputs(dev: &Device) -> Result<()> {
    let dims = [8usize, 64, 8, 8, 200, 8];
    let mut weights = HashMap::new();
    let mut blocks = Vec::new();
    for i in 0..dims.len() - 1 {
        let (a, b) = (dims[i], dims[i + 1]);
        insert_linear(&mut weights, &format!("b{i}.lin"), (b, a), 0.3)?;
        weights.insert(
            format!("b{i}.scale"),
            Tensor::rand(0.5f32, 1.5, b, &Device::Cpu)?,
        );
        blocks.push(BlockSpec::new(format!("b{i}"), move |vb| scaled(vb, a, b)));
    }
    // The extra is broadcast over the feature axis, so every block can add it.
    let x = Tensor::randn(0f32, 1.0, (3, 8), dev)?;
    let extra = Tensor::randn(0f32, 1.0, (3, 1), dev)?;
    let want = resident_forward(
        &weights,
        &blocks,
        &x,
        std::slice::from_ref(&extra),
        DType::F32,
        dev,
    )?;
    for prefetch in [0, 2] {
        let model = StreamedSequential::from_tensors(
            weights.clone(),
            blocks.clone(),
            cfg(dev, DType::F32, prefetch),
        )?;
        let got = model.forward_with(&x, std::slice::from_ref(&extra))?;
        assert_eq!(got.len(), 2, "the last block's whole output is returned");
        assert_close(&got[0], &want[0], 1e-5, 1e-5, "first output")?;
        assert_close(&got[1], &want[1], 1e-5, 1e-5, "second output")?;
        // Slots are sized to the largest block, which is the 64x8 + 8x200 pair's larger one.
        let largest = 200 * 8 + 200 + 200;
        let st = model.stats()?;
        assert!(st.slot_bytes >= (prefetch + 1) * largest * 4);
    }
    Ok(())
}
candle_streamer::test_device!(heterogeneous_blocks_extras_and_tuple_outputs);

fn window_never_exceeded(dev: &Device) -> Result<()> {
    let hidden = [8; 7];
    let weights = mlp_weights(8, &hidden)?;
    for prefetch in 0..=3 {
        let model = StreamedSequential::from_tensors(
            weights.clone(),
            mlp_blocks(8, &hidden),
            cfg(dev, DType::F32, prefetch),
        )?;
        let max_seen = Arc::new(AtomicUsize::new(0));
        let count = Arc::new(AtomicUsize::new(0));
        let (m, c) = (max_seen.clone(), count.clone());
        model.set_observer(Some(Arc::new(move |t| {
            m.fetch_max(t.resident_blocks, Ordering::SeqCst);
            c.fetch_add(1, Ordering::SeqCst);
            assert!(t.resident_blocks <= prefetch + 1, "window exceeded: {t:?}");
        })))?;
        let x = Tensor::randn(0f32, 1.0, (2, 8), dev)?;
        for _ in 0..3 {
            model.forward(&x)?;
        }
        // Three transitions per block per call: load, compute start, evict.
        assert_eq!(count.load(Ordering::SeqCst), 3 * 3 * hidden.len());
        assert_eq!(
            max_seen.load(Ordering::SeqCst),
            (prefetch + 1).min(hidden.len())
        );
        let st = model.stats()?;
        assert_eq!(st.transitions.len(), 3 * 3 * hidden.len());
        // Loads happen in block order and each block computes after its load.
        let loads: Vec<usize> = st
            .transitions
            .iter()
            .filter(|t| t.kind == TransitionKind::LoadIssued)
            .map(|t| t.block)
            .collect();
        assert_eq!(
            loads[..hidden.len()],
            (0..hidden.len()).collect::<Vec<_>>()[..]
        );
    }
    Ok(())
}
candle_streamer::test_device!(window_never_exceeded);

fn slow_transfers_keep_results_exact(dev: &Device) -> Result<()> {
    let hidden = [32, 32, 32, 32];
    let weights = mlp_weights(32, &hidden)?;
    let blocks = mlp_blocks(32, &hidden);
    let x = Tensor::randn(0f32, 1.0, (4, 32), dev)?;
    let want = resident_forward(&weights, &blocks, &x, &[], DType::F32, dev)?;
    let mut c = cfg(dev, DType::F32, 1);
    c.transfer_delay = Some(std::time::Duration::from_micros(if dev.is_cuda() {
        2000
    } else {
        200
    }));
    let model = StreamedSequential::from_tensors(weights, blocks, c)?;
    for it in 0..100 {
        let got = model.forward(&x)?;
        assert_close(&got, &want[0], 1e-5, 1e-5, &format!("iteration {it}"))?;
    }
    let st = model.stats()?;
    assert_eq!(st.loads, 400);
    if dev.is_cuda() {
        // Compute had to wait for the slow copies, and the stall was measured.
        assert!(st.stall_seconds > 0.1, "stall {} s", st.stall_seconds);
    }
    Ok(())
}
candle_streamer::test_device!(slow_transfers_keep_results_exact);

fn tied_weights_within_and_across_blocks(dev: &Device) -> Result<()> {
    let mut weights = mlp_weights(12, &[12, 12])?;
    // Within block 0: down.weight is up.weight (square). Across: block 1's up
    // weight is block 0's up weight. One in-memory tensor under three names.
    let shared = weights["layers.0.up.weight"].clone();
    weights.insert("layers.0.down.weight".into(), shared.clone());
    weights.insert("layers.1.up.weight".into(), shared.clone());
    let blocks = mlp_blocks(12, &[12, 12]);
    let x = Tensor::randn(0f32, 1.0, (3, 12), dev)?;
    let want = resident_forward(&weights, &blocks, &x, &[], DType::F32, dev)?;
    let model =
        StreamedSequential::from_tensors(weights.clone(), blocks.clone(), cfg(dev, DType::F32, 1))?;
    // 8 names, 6 distinct tensors.
    assert_eq!(model.masters().len(), 6);
    let got = model.forward(&x)?;
    assert_close(&got, &want[0], 1e-5, 1e-5, "tied")?;
    // Block 0 copies its tied weight once: 12*12 + 12 + 12 floats; block 1 all four.
    let st = model.stats()?;
    assert_eq!(st.h2d_bytes, 4 * ((144 + 24) + (144 * 2 + 24)));

    // The same ties declared by name, as a safetensors file stores them once.
    let mut stored = weights.clone();
    stored.remove("layers.0.down.weight");
    stored.remove("layers.1.up.weight");
    let dir = tempdir("tied")?;
    let path = dir.join("tied.safetensors");
    candle_core::safetensors::save(&stored, &path)?;
    let mut c = cfg(dev, DType::F32, 1);
    c.aliases = vec![
        ("layers.0.down.weight".into(), "layers.0.up.weight".into()),
        ("layers.1.up.weight".into(), "layers.0.up.weight".into()),
    ];
    let model = StreamedSequential::from_safetensors(&[&path], blocks, c)?;
    assert_eq!(model.masters().len(), 6);
    assert_close(&model.forward(&x)?, &want[0], 1e-5, 1e-5, "tied by alias")?;
    Ok(())
}
candle_streamer::test_device!(tied_weights_within_and_across_blocks);

pub fn tempdir(tag: &str) -> Result<std::path::PathBuf> {
    let d = std::env::temp_dir().join(format!(
        "streamer-test-{tag}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

fn loads_safetensors_files_and_shards(dev: &Device) -> Result<()> {
    let hidden = [16, 24, 16];
    let weights = mlp_weights(8, &hidden)?;
    let blocks = mlp_blocks(8, &hidden);
    let x = Tensor::randn(0f32, 1.0, (2, 8), dev)?;
    let want = resident_forward(&weights, &blocks, &x, &[], DType::F32, dev)?;
    let dir = tempdir("st")?;
    let single = dir.join("model.safetensors");
    candle_core::safetensors::save(&weights, &single)?;
    let model =
        StreamedSequential::from_safetensors(&[&single], blocks.clone(), cfg(dev, DType::F32, 1))?;
    assert_close(&model.forward(&x)?, &want[0], 1e-5, 1e-5, "single file")?;

    // Two shards and a Hugging Face index naming them.
    let (mut a, mut b) = (HashMap::new(), HashMap::new());
    let mut map = serde_json::Map::new();
    for (k, v) in &weights {
        let (shard, file) = if k.starts_with("layers.0") {
            (&mut a, "s-1.safetensors")
        } else {
            (&mut b, "s-2.safetensors")
        };
        shard.insert(k.clone(), v.clone());
        map.insert(k.clone(), file.into());
    }
    candle_core::safetensors::save(&a, dir.join("s-1.safetensors"))?;
    candle_core::safetensors::save(&b, dir.join("s-2.safetensors"))?;
    let index = dir.join("model.safetensors.index.json");
    std::fs::write(
        &index,
        serde_json::json!({ "metadata": {}, "weight_map": map }).to_string(),
    )?;
    let model =
        StreamedSequential::from_safetensors(&[&index], blocks.clone(), cfg(dev, DType::BF16, 2))?;
    let want16 = resident_forward(
        &weights,
        &blocks,
        &x.to_dtype(DType::BF16)?,
        &[],
        DType::BF16,
        dev,
    )?;
    assert_close(
        &model.forward(&x.to_dtype(DType::BF16)?)?,
        &want16[0],
        8e-3,
        8e-3,
        "shards, bf16",
    )?;
    // Masters are converted once, at load.
    assert!(model.masters().iter().all(|m| m.var.dtype() == DType::BF16));
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
candle_streamer::test_device!(loads_safetensors_files_and_shards);

fn masters_unchanged_after_many_calls(dev: &Device) -> Result<()> {
    let hidden = [16, 16, 16];
    let weights = mlp_weights(16, &hidden)?;
    let model = StreamedSequential::from_tensors(
        weights,
        mlp_blocks(16, &hidden),
        cfg(dev, DType::F32, 1),
    )?;
    let before: Vec<Vec<f32>> = model
        .parameters()
        .iter()
        .map(|(_, v)| v.as_tensor().flatten_all()?.to_vec1::<f32>())
        .collect::<candle_core::Result<_>>()?;
    let x = Tensor::randn(0f32, 1.0, (4, 16), dev)?;
    let first = model
        .forward(&x)?
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    for _ in 0..50 {
        model.forward(&x)?;
    }
    let last = model
        .forward(&x)?
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    assert_eq!(first, last, "the same input gives bit-identical outputs");
    for ((name, v), b) in model.parameters().iter().zip(before) {
        assert_eq!(
            v.as_tensor().flatten_all()?.to_vec1::<f32>()?,
            b,
            "master {name} changed"
        );
        assert!(v.device().is_cpu(), "master {name} must live on the host");
    }
    Ok(())
}
candle_streamer::test_device!(masters_unchanged_after_many_calls);

fn timeline_and_stats_report(dev: &Device) -> Result<()> {
    let hidden = [16, 16];
    let weights = mlp_weights(16, &hidden)?;
    let dir = tempdir("tl")?;
    let mut c = cfg(dev, DType::F32, 1);
    c.timeline = true;
    // A folder that does not exist yet is created.
    let path = dir.join("new").join("trace.json");
    c.timeline_path = Some(path.clone());
    let model = StreamedSequential::from_tensors(weights, mlp_blocks(16, &hidden), c)?;
    let x = Tensor::randn(0f32, 1.0, (4, 16), dev)?;
    model.forward(&x)?;
    model.write_timeline(None)?;
    let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    let events = trace["traceEvents"].as_array().unwrap();
    let count = |cat: &str| events.iter().filter(|e| e["cat"] == cat).count();
    assert_eq!(count("h2d"), 2);
    assert_eq!(count("compute"), 2);
    let st = model.stats()?;
    assert_eq!(st.h2d_bytes, 2 * 4 * (16 * 16 * 2 + 32));
    assert!(st.h2d_seconds > 0.0 && st.compute_seconds > 0.0);
    let text = st.to_string();
    assert!(
        text.contains("h2d") && text.contains("peak 2 blocks"),
        "{text}"
    );
    model.reset_stats()?;
    let st = model.stats()?;
    assert_eq!((st.loads, st.h2d_bytes, st.transitions.len()), (0, 0, 0));
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
candle_streamer::test_device!(timeline_and_stats_report);

#[track_caller]
fn err_text<T>(r: candle_core::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

fn construction_errors_name_the_problem(dev: &Device) -> Result<()> {
    let hidden = [16, 32];
    let weights = mlp_weights(8, &hidden)?;
    let blocks = mlp_blocks(8, &hidden);
    // A block over the slot budget.
    let mut c = cfg(dev, DType::F32, 1);
    c.slot_budget_bytes = Some(2000);
    let e = err_text(StreamedSequential::from_tensors(
        weights.clone(),
        blocks.clone(),
        c,
    ));
    assert!(
        e.contains("layers.1") && e.contains("slot_budget_bytes") && e.contains("2000"),
        "{e}"
    );
    // A missing weight.
    let mut w = weights.clone();
    w.remove("layers.1.down.bias");
    let e = err_text(StreamedSequential::from_tensors(
        w,
        blocks.clone(),
        cfg(dev, DType::F32, 1),
    ));
    assert!(e.contains("layers.1.down.bias") && e.contains("[8]"), "{e}");
    // An unexpected weight under a block's prefix (strict).
    let mut w = weights.clone();
    w.insert(
        "layers.0.extra".into(),
        Tensor::zeros(3, DType::F32, &Device::Cpu)?,
    );
    let e = err_text(StreamedSequential::from_tensors(
        w,
        blocks.clone(),
        cfg(dev, DType::F32, 1),
    ));
    assert!(
        e.contains("layers.0.extra") && e.contains("does not use"),
        "{e}"
    );
    // A mis-shaped weight.
    let mut w = weights.clone();
    w.insert(
        "layers.0.up.weight".into(),
        Tensor::zeros((16, 9), DType::F32, &Device::Cpu)?,
    );
    let e = StreamedSequential::from_tensors(w, blocks.clone(), cfg(dev, DType::F32, 1))
        .err()
        .expect("a mis-shaped weight is refused");
    assert!(
        matches!(streamer_device::Error::find(&e),
            Some(streamer_device::Error::Shape { what, got, .. })
                if what.contains("layers.0.up.weight") && got == &[16, 9]),
        "{e}"
    );
    assert!(e.to_string().contains("[16, 8]"), "{e}");
    // A non-float dtype request.
    let e =
        StreamedSequential::from_tensors(weights.clone(), blocks.clone(), cfg(dev, DType::U32, 1))
            .err()
            .expect("a U32 model is refused");
    assert!(
        matches!(streamer_device::Error::find(&e),
            Some(streamer_device::Error::Config { field, .. }) if field == "StreamConfig.dtype"),
        "{e}"
    );
    Ok(())
}
candle_streamer::test_device!(construction_errors_name_the_problem);

fn call_errors_come_before_any_copy(dev: &Device) -> Result<()> {
    let hidden = [16, 32];
    let weights = mlp_weights(8, &hidden)?;
    let model = StreamedSequential::from_tensors(
        weights.clone(),
        mlp_blocks(8, &hidden),
        cfg(dev, DType::F32, 1),
    )?;
    // Wrong dtype.
    let x16 = Tensor::zeros((2, 8), DType::F16, dev)?;
    let e = model
        .forward(&x16)
        .expect_err("an f16 input into an f32 model");
    assert!(
        matches!(
            streamer_device::Error::find(&e),
            Some(&streamer_device::Error::Dtype {
                got: DType::F16,
                ..
            })
        ),
        "{e}"
    );
    assert!(e.to_string().contains("F32"), "{e}");
    // Wrong device (a CPU tensor into a CUDA model).
    if dev.is_cuda() {
        let e = err_text(model.forward(&Tensor::zeros((2, 8), DType::F32, &Device::Cpu)?));
        assert!(e.contains("Cpu"), "{e}");
    }
    assert_eq!(model.stats()?.loads, 0, "no copy was issued");
    // A block that calls its own model: reentrant.
    let slot: Arc<OnceLock<Arc<StreamedSequential>>> = Arc::new(OnceLock::new());
    let s2 = slot.clone();
    let mut blocks = mlp_blocks(8, &hidden);
    blocks[1] = BlockSpec::module("layers.1", move |vb| {
        let inner = mlp(vb, 8, 32)?;
        let s3 = s2.clone();
        Ok(move |x: &Tensor| match s3.get() {
            Some(m) => m.forward(x),
            None => inner.forward(x),
        })
    });
    let m = Arc::new(StreamedSequential::from_tensors(
        weights,
        blocks,
        cfg(dev, DType::F32, 1),
    )?);
    slot.set(m.clone()).ok();
    let e = err_text(m.forward(&Tensor::zeros((2, 8), DType::F32, dev)?));
    assert!(e.contains("reentrant"), "{e}");
    // The failed call left the pool usable: nothing stays resident.
    assert_eq!(m.stats()?.resident_blocks, 0);
    Ok(())
}
candle_streamer::test_device!(call_errors_come_before_any_copy);

fn prefetch_across_calls_keeps_results_and_window(dev: &Device) -> Result<()> {
    let hidden = [16, 24, 8, 16, 32];
    let weights = mlp_weights(8, &hidden)?;
    let blocks = mlp_blocks(8, &hidden);
    for prefetch in 0..=3 {
        let mut c = cfg(dev, DType::F32, prefetch);
        // SAFETY: nothing changes the masters during this test.
        c.prefetch_across_calls = Some(unsafe { AcrossCalls::promise_masters_unchanged() });
        let model = StreamedSequential::from_tensors(weights.clone(), blocks.clone(), c)?;
        let max_seen = Arc::new(AtomicUsize::new(0));
        let m = max_seen.clone();
        model.set_observer(Some(Arc::new(move |t| {
            m.fetch_max(t.resident_blocks, Ordering::SeqCst);
        })))?;
        for _ in 0..3 {
            let x = Tensor::randn(0f32, 1.0, (3, 8), dev)?;
            let want = resident_forward(&weights, &blocks, &x, &[], DType::F32, dev)?;
            let what = format!("prefetch {prefetch}");
            assert_close(&model.forward(&x)?, &want[0], 1e-5, 1e-5, &what)?;
        }
        let st = model.stats()?;
        // The first blocks of the next call are already loading (or loaded).
        assert_eq!(st.resident_blocks, prefetch + 1);
        assert!(max_seen.load(Ordering::SeqCst) <= prefetch + 1);
        // Three calls load each block three times, plus the early loads for a fourth.
        assert_eq!(st.loads as usize, 3 * hidden.len() + prefetch + 1);
        model.evict_all()?;
        assert_eq!(model.stats()?.resident_blocks, 0);
    }
    Ok(())
}
candle_streamer::test_device!(prefetch_across_calls_keeps_results_and_window);

/// Without the cross-call promise, a master changed between calls (here every
/// weight of the first and last blocks, the ones a cross-call prefetch would
/// have loaded early) is what the next call computes with.
fn changed_masters_are_seen_by_the_next_call(dev: &Device) -> Result<()> {
    let hidden = [16, 24, 8];
    let mut weights = mlp_weights(8, &hidden)?;
    let blocks = mlp_blocks(8, &hidden);
    for prefetch in 0..=2 {
        let model = StreamedSequential::from_tensors(
            weights.clone(),
            blocks.clone(),
            cfg(dev, DType::F32, prefetch),
        )?;
        let x = Tensor::randn(0f32, 1.0, (3, 8), dev)?;
        model.forward(&x)?;
        for (name, var) in model.parameters() {
            if name.starts_with("layers.0.") || name.starts_with("layers.2.") {
                let new = (var.as_tensor() * -1.5)?;
                var.set(&new)?;
                weights.insert(name, new);
            }
        }
        let want = resident_forward(&weights, &blocks, &x, &[], DType::F32, dev)?;
        let what = format!("prefetch {prefetch}");
        assert_close(&model.forward(&x)?, &want[0], 1e-5, 1e-5, &what)?;
    }
    Ok(())
}
candle_streamer::test_device!(changed_masters_are_seen_by_the_next_call);

fn freed_device_memory_is_kept_then_trimmed(dev: &Device) -> Result<()> {
    use streamer_core::{pooled_idle_bytes, retain_freed_device_memory, trim_device_memory};
    const BYTES: usize = 256 << 20;
    retain_freed_device_memory(dev)?;
    let _sum = Tensor::ones(BYTES / 4, DType::F32, dev)?
        .sum_all()?
        .to_scalar::<f32>()?;
    // The tensor is freed (stream-ordered) and the device synchronised: with
    // CUDA's default pool its memory would be back with the driver now.
    dev.synchronize()?;
    let kept = pooled_idle_bytes(dev)?;
    trim_device_memory(dev)?;
    let after = pooled_idle_bytes(dev)?;
    if dev.is_cuda() {
        anyhow::ensure!(kept >= BYTES, "pool kept {kept} bytes, expected >= {BYTES}");
        // Other tests share the device and may free memory meanwhile: only
        // require that this test's block went back.
        anyhow::ensure!(
            after < BYTES,
            "pool still holds {after} bytes after trimming"
        );
    } else {
        anyhow::ensure!(kept == 0 && after == 0, "the CPU has no device pool");
    }
    Ok(())
}
candle_streamer::test_device!(freed_device_memory_is_kept_then_trimmed);

/// A block that multiplies by its one weight.
struct Weighted(Tensor);

impl Block for Weighted {
    fn forward(&self, x: &Tensor, _extras: &[Tensor]) -> candle_core::Result<Vec<Tensor>> {
        Ok(vec![x.matmul(&self.0.t()?)?])
    }
}

/// What a block's builder saw: whether it was discovering, the weight's
/// strides, and its values on the host in f32.
type Seen = (bool, Vec<usize>, Vec<Vec<f32>>);

/// Construction runs each builder once on the host only to learn its
/// weights: the builder sees `discovering()` and zero-cost stand-ins of the
/// compute dtype (no f32 master is converted), and never again. The builds
/// that compute see the real weights with `discovering()` false.
fn builders_see_stand_ins_only_while_discovering(dev: &Device) -> Result<()> {
    let w = Tensor::randn(0f32, 1.0, (4, 3), &Device::Cpu)?;
    let weights = HashMap::from([("b0.w".to_string(), w.clone())]);
    let seen: Arc<std::sync::Mutex<Vec<Seen>>> = Arc::default();
    let log = seen.clone();
    let block = BlockSpec::new("b0", move |vb| {
        let w = vb.get((4, 3), "w")?;
        let host = w.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.to_vec2()?;
        let entry = (streamer_core::discovering(), w.stride().to_vec(), host);
        log.lock().expect("log").push(entry);
        Ok(Weighted(w))
    });
    let stream = StreamConfig {
        master_dtype: Some(DType::F32),
        ..cfg(dev, DType::BF16, 0)
    };
    let model = StreamedSequential::from_tensors(weights, vec![block], stream)?;
    {
        let seen = seen.lock().expect("log");
        anyhow::ensure!(seen.len() == 1, "one discovery build, got {}", seen.len());
        let (discovering, stride, values) = &seen[0];
        anyhow::ensure!(*discovering, "the construction build is a discovery");
        anyhow::ensure!(
            stride == &[0, 0],
            "a stand-in has no memory: stride {stride:?}"
        );
        anyhow::ensure!(
            values.iter().flatten().all(|v| *v == 0.0),
            "stand-ins are zero"
        );
    }
    anyhow::ensure!(!streamer_core::discovering(), "the flag is restored");
    let x = Tensor::randn(0f32, 1.0, (2, 3), dev)?.to_dtype(DType::BF16)?;
    model.forward(&x)?;
    let want = w
        .to_dtype(DType::BF16)?
        .to_dtype(DType::F32)?
        .to_vec2::<f32>()?;
    let seen = seen.lock().expect("log");
    anyhow::ensure!(seen.len() >= 2, "the forward builds the block again");
    for (discovering, _, values) in &seen[1..] {
        anyhow::ensure!(!discovering, "a build that computes is not a discovery");
        anyhow::ensure!(
            values == &want,
            "a build that computes sees the real weight"
        );
    }
    Ok(())
}
candle_streamer::test_device!(builders_see_stand_ins_only_while_discovering);

/// `WeightSource::load_master` and `load` copy a view (not at its
/// storage's start) into storage of their own, and read a safetensors
/// file's bytes, converting to the asked dtype bit for bit as Candle's
/// `to_dtype` does (the conversions done in their own pass and the ones
/// left to Candle).
fn load_master_copies_views_into_own_storage(_dev: &Device) -> Result<()> {
    // Several of the copy's chunks (2^18 elements); values that round in
    // bf16 and f16.
    let base = (Tensor::arange(0f32, (600_000 * 7) as f32, &Device::Cpu)? * 1.000_123)?
        .reshape((600_000, 7))?;
    let view = base.narrow(0, 1000, 200_000)?;
    let bits = |t: &Tensor| -> Result<Vec<u64>> {
        let t = t.flatten_all()?;
        Ok(match t.dtype() {
            DType::F64 => t.to_vec1::<f64>()?.iter().map(|v| v.to_bits()).collect(),
            DType::F32 => t
                .to_vec1::<f32>()?
                .iter()
                .map(|v| v.to_bits() as u64)
                .collect(),
            _ => t
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()?
                .iter()
                .map(|v| v.to_bits() as u64)
                .collect(),
        })
    };
    let sources = [
        view.clone(),
        view.to_dtype(DType::BF16)?,
        view.to_dtype(DType::F16)?,
    ];
    // The same tensors in a file: masters made from the mapped bytes.
    let dir = tempdir("master")?;
    let file = dir.join("w.safetensors");
    let named: HashMap<String, Tensor> = (sources.iter().enumerate())
        .map(|(i, t)| (format!("w{i}"), t.contiguous().expect("contiguous")))
        .collect();
    candle_core::safetensors::save(&named, &file)?;
    let from_file = streamer_core::WeightSource::safetensors(&[&file])?;
    for (i, source) in sources.into_iter().enumerate() {
        let src = streamer_core::WeightSource::Tensors(HashMap::from([(
            "w".to_string(),
            source.clone(),
        )]));
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            let what = format!("file {:?} -> {dtype:?}", source.dtype());
            let want = source.to_dtype(dtype)?;
            let name = format!("w{i}");
            let master = from_file.load_master(&name, dtype)?;
            anyhow::ensure!(master.dtype() == dtype, "{what}");
            anyhow::ensure!(bits(&master)? == bits(&want)?, "{what}: values differ");
            let loaded = from_file.load(&name, dtype)?;
            anyhow::ensure!(bits(&loaded)? == bits(&want)?, "{what}: load differs");
            let what = format!("{:?} -> {dtype:?}", source.dtype());
            let master = src.load_master("w", dtype)?;
            let (a, b) = (master.storage_and_layout().0, source.storage_and_layout().0);
            anyhow::ensure!(
                !std::ptr::eq(&*a, &*b),
                "{what}: the master shares the caller's storage"
            );
            drop((a, b));
            anyhow::ensure!(
                master.dtype() == dtype && master.dims() == [200_000, 7],
                "{what}"
            );
            anyhow::ensure!(
                bits(&master)? == bits(&want)?,
                "{what}: values differ from to_dtype"
            );
            let loaded = src.load("w", dtype)?;
            anyhow::ensure!(
                bits(&loaded)? == bits(&want)?,
                "{what}: load differs from to_dtype"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
candle_streamer::test_device!(load_master_copies_views_into_own_storage);

/// `StreamConfig::on_setup` hears every block's masters in order, then (on a
/// CUDA device) page-locking every master's bytes, then the end with the
/// same times `setup_times` gives.
fn setup_hook_hears_every_phase(dev: &Device) -> Result<()> {
    use streamer_core::{SetupEvent, SetupHook};
    let n = 3;
    let mut weights = HashMap::new();
    let blocks = (0..n)
        .map(|i| {
            let w = Tensor::randn(0f32, 1.0, (4, 3), &Device::Cpu).expect("randn");
            weights.insert(format!("b{i}.w"), w);
            BlockSpec::new(format!("b{i}"), |vb| Ok(Weighted(vb.get((4, 3), "w")?)))
        })
        .collect();
    let heard: Arc<std::sync::Mutex<Vec<SetupEvent>>> = Arc::default();
    let log = heard.clone();
    let stream = StreamConfig {
        master_dtype: Some(DType::F32),
        on_setup: Some(SetupHook::new(move |e| log.lock().expect("log").push(e))),
        ..cfg(dev, DType::F32, 0)
    };
    let model = StreamedSequential::from_tensors(weights, blocks, stream)?;
    let heard = heard.lock().expect("log").clone();
    let mut want: Vec<SetupEvent> = (1..=n)
        .map(|done| SetupEvent::Masters { done, total: n })
        .collect();
    if dev.is_cuda() {
        want.push(SetupEvent::PageLock { bytes: n * 12 * 4 });
    }
    want.push(SetupEvent::Built(model.setup_times()));
    anyhow::ensure!(heard == want, "{heard:?}");
    Ok(())
}
candle_streamer::test_device!(setup_hook_hears_every_phase);
