//! Training over many steps against transformers + `torch.optim.AdamW`:
//! `tests/fixtures/hf/llama-train30` (written by
//! `tests/fixtures/make_train_fixture.py`) holds a tiny random Llama, 30
//! batches, the learning rate of each step (linear warm-up, then cosine) and
//! what PyTorch computed in f32: every step's loss and every weight after the
//! last step. Our trainer, from the same checkpoint on the same batches, must
//! give every loss within 1e-4 relative and every final weight within 1e-5
//! (max abs difference over the reference's max abs value, per tensor), both
//! streamed and resident, with the optimizer on the host and on the device
//! (measured on the CPU: 2.3e-7 and 3.4e-7).
//! Our learning-rate schedule (`lr_at`) must give PyTorch's rates to 1e-12.
use super::families::{fixture, stream};
use super::fused_mlp::rel_err;
use super::models::err_of;
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::ParamsAdamW;
use std::collections::HashMap;
use streamer_models::train::lr_at;
use streamer_models::{
    Decay, Llama, LlamaConfig, LmTrainer, LoopOptions, LossChunk, OptimizerPlace, StateDtype,
};

const LOSS_TOL: f64 = 1e-4;
const WEIGHT_TOL: f64 = 1e-5;
/// The fixture's schedule and optimizer (see the script).
const PEAK: f64 = 2e-3;
const WARMUP: usize = 5;
const WEIGHT_DECAY: f64 = 0.1;

struct Curve {
    cfg: LlamaConfig,
    weights: std::path::PathBuf,
    reference: HashMap<String, Tensor>,
}

impl Curve {
    fn load() -> Result<Self> {
        let dir = fixture("llama-train30")?;
        Ok(Self {
            cfg: LlamaConfig::from_json_file(dir.join("config.json"))?,
            weights: dir.join("model.safetensors"),
            reference: crate::families::reference(&dir)?,
        })
    }

    fn get(&self, name: &str) -> Result<&Tensor> {
        self.reference
            .get(name)
            .with_context(|| format!("llama-train30 reference has no {name}"))
    }

    fn steps(&self) -> Result<usize> {
        Ok(self.get("losses")?.dim(0)?)
    }

    /// Step `s`'s `(tokens, targets)` as u32 on `dev`.
    fn batch(&self, s: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
        let t = |k: &str| -> Result<Tensor> {
            Ok(self.get(k)?.get(s)?.to_dtype(DType::U32)?.to_device(dev)?)
        };
        Ok((t("tokens")?, t("targets")?))
    }

    fn options(&self) -> Result<LoopOptions> {
        let (_, batch, seq) = self.get("tokens")?.dims3()?;
        Ok(LoopOptions {
            steps: self.steps()?,
            batch,
            micro_batches: 1,
            seq,
            seed: 0,
            lr: PEAK,
            warmup: WARMUP,
            decay: Decay::Cosine { min_ratio: 0.0 },
            save_every: None,
            checkpoint_dir: None,
        })
    }
}

fn model(c: &Curve, dev: &Device, streamed: bool) -> Result<Llama> {
    Ok(if streamed {
        Llama::from_safetensors(&[&c.weights], &c.cfg, stream(dev, DType::F32))?
    } else {
        Llama::load_resident(&[&c.weights], &c.cfg, DType::F32, dev)?
    })
}

/// How a run is set up and how close it must come.
struct Run {
    streamed: bool,
    place: OptimizerPlace,
    state: StateDtype,
    loss_chunk: LossChunk,
    loss_tol: f64,
    weight_tol: f64,
}

impl Run {
    fn exact(streamed: bool, place: OptimizerPlace) -> Self {
        Self {
            streamed,
            place,
            state: StateDtype::F32,
            loss_chunk: LossChunk::Auto,
            loss_tol: LOSS_TOL,
            weight_tol: WEIGHT_TOL,
        }
    }
}

/// Trains 30 steps as the fixture did and compares every loss and final weight.
fn curve_matches(dev: &Device, run: Run) -> Result<()> {
    let Run {
        streamed,
        place,
        state,
        loss_chunk,
        loss_tol,
        weight_tol,
    } = run;
    let what = format!(
        "{} model, {place:?} optimizer, {state:?} state, loss {loss_chunk:?}",
        if streamed { "streamed" } else { "resident" }
    );
    let c = Curve::load()?;
    let opts = c.options()?;
    let params = ParamsAdamW {
        lr: PEAK,
        weight_decay: WEIGHT_DECAY,
        ..Default::default()
    };
    let m = model(&c, dev, streamed)?;
    m.set_loss_chunk(loss_chunk)?;
    let mut trainer = LmTrainer::new_with(m, params, place, state)?;
    let want_losses = c.get("losses")?.to_vec1::<f32>()?;
    let (mut worst_loss, mut worst_weight) = (0f64, 0f64);
    for (s, want) in want_losses.iter().enumerate() {
        trainer.set_learning_rate(lr_at(&opts, s));
        let (x, y) = c.batch(s, dev)?;
        let got = trainer.step(&x, &y)?;
        let e = ((got - want) / want).abs() as f64;
        worst_loss = worst_loss.max(e);
        ensure!(
            e <= loss_tol,
            "{what}: step {s} loss {got} vs transformers' {want} (relative {e:.2e} > {loss_tol:.0e})"
        );
    }
    let weights = trainer.model().weights()?;
    let mut n = 0;
    for (name, want) in c.reference.iter() {
        let Some(p) = name.strip_prefix("final.") else {
            continue;
        };
        let got = weights
            .get(p)
            .with_context(|| format!("{what}: no weight {p}"))?;
        let e = rel_err(&got.to_dtype(DType::F32)?, want)?;
        worst_weight = worst_weight.max(e);
        ensure!(
            e <= weight_tol,
            "{what}: {p} after {} steps: relative error {e:.2e} > {weight_tol:.0e}",
            want_losses.len()
        );
        n += 1;
    }
    ensure!(
        n == c.cfg.weight_shapes().len(),
        "{what}: {n} final weights checked"
    );
    eprintln!(
        "{what}: largest relative error: loss {worst_loss:.2e}, final weight {worst_weight:.2e}"
    );
    Ok(())
}

#[test]
fn lr_schedule_matches_pytorch() -> Result<()> {
    let c = Curve::load()?;
    let opts = c.options()?;
    let want = c.get("lr")?.to_vec1::<f64>()?;
    ensure!(want.len() == opts.steps, "{} rates", want.len());
    for (s, w) in want.iter().enumerate() {
        let got = lr_at(&opts, s);
        ensure!(
            (got - w).abs() <= 1e-12 * w.abs().max(1e-30),
            "step {s}: lr {got} vs {w}"
        );
    }
    // The floor: half way down to it and never below it.
    let floor = LoopOptions {
        decay: Decay::Cosine { min_ratio: 0.1 },
        ..opts.clone()
    };
    let last = lr_at(&floor, opts.steps - 1);
    ensure!(last > 0.1 * PEAK && last < 0.11 * PEAK, "last lr {last}");
    Ok(())
}

fn streamed_host_curve_matches_transformers(dev: &Device) -> Result<()> {
    curve_matches(dev, Run::exact(true, OptimizerPlace::Host))
}

fn streamed_device_curve_matches_transformers(dev: &Device) -> Result<()> {
    curve_matches(dev, Run::exact(true, OptimizerPlace::Device))
}

/// CPU only: a GPU-resident model has no host masters (LmTrainer refuses it,
/// see `resident_gpu_host_optimizer_is_refused`).
#[test]
fn resident_host_curve_matches_transformers() -> Result<()> {
    curve_matches(&Device::Cpu, Run::exact(false, OptimizerPlace::Host))
}

fn resident_device_curve_matches_transformers(dev: &Device) -> Result<()> {
    curve_matches(dev, Run::exact(false, OptimizerPlace::Device))
}

#[cfg(feature = "cuda")]
#[test]
fn resident_gpu_host_optimizer_is_refused() -> Result<()> {
    let dev = &candle_streamer::test_utils::cuda_device()?;
    let c = Curve::load()?;
    let err = LmTrainer::new_on(
        model(&c, dev, false)?,
        ParamsAdamW::default(),
        OptimizerPlace::Host,
    )
    .err()
    .context("a GPU-resident model with the host optimizer was accepted")?;
    ensure!(
        err.to_string().contains("OptimizerPlace::Device"),
        "unexpected error: {err}"
    );
    Ok(())
}

#[test]
fn schedule_parse_rejects_bad_text() -> Result<()> {
    for bad in [
        "",
        "linear",
        "cosine:",
        "cosine:2",
        "cosine:-0.1",
        "cosine:x",
    ] {
        ensure!(Decay::parse(bad).is_err(), "{bad:?} accepted");
    }
    ensure!(Decay::parse("constant")? == Decay::Constant);
    ensure!(Decay::parse("cosine:0.1")? == Decay::Cosine { min_ratio: 0.1 });
    Ok(())
}

/// bf16 moments (stochastically rounded) against transformers' f32 state:
/// the losses stay within 1e-3 relative over the 30 steps and the final
/// weights within 5e-3 (measured on the CPU: 5.7e-5 and 4.0e-4).
fn streamed_host_bf16_state_curve_stays_near_transformers(dev: &Device) -> Result<()> {
    curve_matches(
        dev,
        Run {
            state: StateDtype::Bf16,
            loss_tol: 1e-3,
            weight_tol: 5e-3,
            ..Run::exact(true, OptimizerPlace::Host)
        },
    )
}

/// The head and loss in chunks of 7 of the 48 rows (the path a large
/// vocabulary takes), streamed and resident.
fn chunked_loss_curve_matches_transformers(dev: &Device) -> Result<()> {
    for streamed in [true, false] {
        curve_matches(
            dev,
            Run {
                loss_chunk: LossChunk::Rows(7),
                ..Run::exact(streamed, OptimizerPlace::Device)
            },
        )?;
    }
    Ok(())
}

candle_streamer::test_device!(streamed_host_curve_matches_transformers);
candle_streamer::test_device!(chunked_loss_curve_matches_transformers);
candle_streamer::test_device!(streamed_host_bf16_state_curve_stays_near_transformers);
candle_streamer::test_device!(streamed_device_curve_matches_transformers);
candle_streamer::test_device!(resident_device_curve_matches_transformers);

/// `benches/loss_curve_transformers.py` draws `TokenCorpus::batch`'s windows
/// in Python for the GPU curve comparison; these offsets are what it gives
/// (its `batch` over the tokens 0..100000).
#[test]
fn corpus_batches_match_the_python_sampler() -> Result<()> {
    let corpus = streamer_models::TokenCorpus::from_tokens((0..100_000).collect());
    for (seed, step, batch, seq, want) in [
        (5, 3, 4, 16, vec![9531u32, 10284, 65731, 2348]),
        (0, 123_456_789, 3, 1000, vec![5149, 98474, 42955]),
    ] {
        let (x, y) = corpus.batch(seed, step, batch, seq, &Device::Cpu)?;
        let first: Vec<u32> = x.narrow(1, 0, 1)?.flatten_all()?.to_vec1()?;
        ensure!(
            first == want,
            "seed {seed} step {step}: offsets {first:?}, Python {want:?}"
        );
        let y0: Vec<u32> = y.narrow(1, 0, 1)?.flatten_all()?.to_vec1()?;
        ensure!(y0.iter().zip(&want).all(|(a, b)| *a == b + 1));
    }
    Ok(())
}

/// `step_micro`: two micro-batches of one sequence give the step over both
/// at once (losses 1e-5, weights 1e-5 relative after 10 steps), streamed (one
/// weight visit for both; overlapped host step or not, device optimizer) and
/// resident (one after another); a bad split is refused.
fn micro_batches_equal_one_batch(dev: &Device) -> Result<()> {
    let c = Curve::load()?;
    let params = ParamsAdamW {
        lr: PEAK,
        weight_decay: WEIGHT_DECAY,
        ..Default::default()
    };
    for (streamed, overlap, place) in [
        (true, true, OptimizerPlace::Host),
        (true, false, OptimizerPlace::Host),
        (true, false, OptimizerPlace::Device),
        (false, false, OptimizerPlace::Device),
    ] {
        if !streamed && !dev.is_cpu() && place == OptimizerPlace::Host {
            continue;
        }
        let mut runs = Vec::new();
        for micro in [1, 2] {
            let mut t = LmTrainer::new_on(model(&c, dev, streamed)?, params.clone(), place)?;
            t.set_overlap(overlap);
            let mut losses = Vec::new();
            for s in 0..10 {
                let (x, y) = c.batch(s, dev)?;
                losses.push(t.step_micro(&x, &y, micro)?);
            }
            runs.push((losses, t.model().weights()?));
        }
        let what = format!("streamed {streamed}, overlap {overlap}, {place:?}");
        for (s, (a, b)) in runs[0].0.iter().zip(&runs[1].0).enumerate() {
            ensure!(
                ((a - b) / a).abs() <= 1e-5,
                "{what}: step {s} loss {a} vs {b} in micro-batches"
            );
        }
        for (name, w) in &runs[0].1 {
            let e = rel_err(&runs[1].1[name], w)?;
            ensure!(
                e <= 1e-5,
                "{what}: {name} differs by {e:.2e} after micro-batches"
            );
        }
    }
    let mut t = LmTrainer::new_on(
        model(&c, dev, true)?,
        params.clone(),
        OptimizerPlace::Device,
    )?;
    let (x, y) = c.batch(0, dev)?;
    let err = err_of(t.step_micro(&x, &y, 3))?;
    ensure!(err.contains("do not split into 3"), "{err:?}");
    ensure!(t.steps_done() == 0, "a refused step counted");
    Ok(())
}
candle_streamer::test_device!(micro_batches_equal_one_batch);
