//! The project's main job: train a multi-block MLP streamed through the residency
//! pool, with the optimizer on the host, to imitate a fixed random teacher.
//!
//!     cargo run --release --example train_mlp                     # CPU, about a minute
//!     cargo run --release --example train_mlp -- --resume         # continue from the last save
//!     cargo run --release --features cuda --example train_mlp -- --width 4096 --hidden 16384 --blocks 8 --batch 8192
//!     cargo run --release --features cuda --example train_mlp -- --width 4096 --hidden 16384 --blocks 8 --batch 8192 --device-budget 8GiB
//!
//! Writes `<out>/loss.csv`, `<out>/loss.svg`, `<out>/weights-<step>.safetensors`,
//! `<out>/optimizer-<step>.safetensors` and `<out>/progress.json`. A save
//! writes the step's two files, then `progress.json` naming them (each
//! atomically), then removes the previous save's: a run killed at any moment
//! resumes from a complete, consistent save.
#[path = "common/device_flags.rs"]
mod device_flags;
#[path = "common/loss_curve.rs"]
mod loss_curve;
#[path = "common/save_flags.rs"]
mod save_flags;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Optimizer, ParamsAdamW};
use candle_streamer::cli;
use candle_streamer::report::Progress;
use clap::Parser;
use device_flags::DeviceFlags;
use loss_curve::{read_losses, write_curve, CurveLabels};
use rand::{rngs::StdRng, Rng, SeedableRng};
use save_flags::SaveFlags;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;
use streamer_autograd::{
    ActivationPolicy, OptimizerPlace, PlacedAdamW, Train, TrainableSequential,
};
use streamer_core::{BlockSpec, DeviceCap, StreamConfig, StreamedSequential};
use streamer_models::{fused_mlp, parse_bytes, MlpPlan, MlpShape};

#[derive(Parser, Debug)]
#[command(about = "Train a streamed MLP to imitate a random teacher network")]
struct Args {
    /// Number of MLP blocks (each Linear(w,h), GELU, Linear(h,w)).
    #[arg(long, default_value_t = 4)]
    blocks: usize,
    /// Block width w.
    #[arg(long, default_value_t = 256)]
    width: usize,
    /// Block hidden size h.
    #[arg(long, default_value_t = 512)]
    hidden: usize,
    /// Rows per batch (tokens per step).
    #[arg(long, default_value_t = 128)]
    batch: usize,
    /// Total optimizer steps (a resumed run continues up to this count).
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// AdamW decoupled weight decay.
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// Seed of the teacher, the initial student and the data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    run_on: DeviceFlags,
    /// Blocks loaded ahead of the one computing (window = prefetch + 1; default 1).
    #[arg(long)]
    prefetch: Option<usize>,
    /// Output folder.
    #[arg(long, default_value = "runs/train_mlp")]
    out: PathBuf,
    #[command(flatten)]
    save: SaveFlags,
    /// What training keeps for backward: recompute, keep:BYTES (e.g. keep:8GiB)
    /// or auto[:FRACTION] of free device memory (default auto:0.5).
    #[arg(long)]
    activations: Option<String>,
    /// Where AdamW runs: `host` (CpuAdamW, moments in host memory; the
    /// default) or `device` (DeviceAdamW: moments on the GPU, 8 bytes per
    /// parameter, each block stepped there during backward instead of
    /// sending its gradients to the host).
    #[arg(long)]
    optimizer: Option<String>,
    /// The most device memory the run may use in all ("8GiB"): the
    /// optimizer's place, the activations kept and the blocks resident are
    /// then chosen so that the step fits (printed before anything loads), and
    /// the rest of the GPU is held back so that nothing can use more.
    #[arg(long)]
    device_budget: Option<String>,
}

/// What a run decides: the optimizer's place, the blocks loaded ahead, the
/// activation policy; with `--device-budget` its plan and the cap holding the
/// rest of the GPU (released when dropped, after the run).
struct Decided {
    place: OptimizerPlace,
    prefetch: usize,
    policy: ActivationPolicy,
    _cap: Option<DeviceCap>,
}

/// The flags' settings, or with `--device-budget` the plan's (the flags it
/// decides may not be given beside it), checked before any work.
fn decide(a: &Args, dev: &Device, dtype: DType) -> Result<Decided> {
    let prefetch = check_args(a)?;
    let Some(text) = &a.device_budget else {
        return Ok(Decided {
            place: a
                .optimizer
                .as_deref()
                .unwrap_or("host")
                .parse()
                .context("--optimizer")?,
            prefetch,
            policy: cli::activation_policy(a.activations.as_deref().unwrap_or("auto"), dev)?,
            _cap: None,
        });
    };
    let given = [
        ("--optimizer", a.optimizer.is_some()),
        ("--activations", a.activations.is_some()),
        ("--prefetch", a.prefetch.is_some()),
    ];
    if let Some((flag, _)) = given.iter().find(|(_, given)| *given) {
        bail!("--device-budget chooses what {flag} sets: give one or the other");
    }
    let budget = parse_bytes(text).with_context(|| format!("--device-budget {text:?}"))?;
    let Some(total) = streamer_core::device_total_memory(dev)? else {
        bail!("--device-budget {text}: it budgets a CUDA device, and this run is on the CPU");
    };
    let shape = MlpShape {
        blocks: a.blocks,
        width: a.width,
        hidden: a.hidden,
        rows: a.batch,
        dtype,
    };
    let plan = MlpPlan::choose(shape, (budget, total))
        .with_context(|| format!("--device-budget {text}"))?;
    println!("train_mlp: device plan for --device-budget {text}: {plan}");
    let cap = DeviceCap::hold(dev, budget).with_context(|| format!("--device-budget {text}"))?;
    let s = plan.settings;
    Ok(Decided {
        place: s.place,
        prefetch: s.window.min(a.blocks) - 1,
        policy: s.activation_policy(),
        _cap: Some(cap),
    })
}

/// `Linear(w,h), GELU, Linear(h,w)` as `FusedMlp`: bias and GELU in the GEMM
/// epilogues, and a hand-written backward (no recompute GEMM, no autograd).
fn blocks(a: &Args) -> Vec<BlockSpec> {
    let (w, h) = (a.width, a.hidden);
    (0..a.blocks)
        .map(|i| BlockSpec::new(format!("layers.{i}"), move |vb| fused_mlp(w, h, vb)))
        .collect()
}

/// Seeded random weights (the CPU's own RNG in Candle cannot be seeded).
fn random_weights(a: &Args, rng: &mut StdRng, gain: f32) -> Result<HashMap<String, Tensor>> {
    let mut m = HashMap::new();
    let mut put = |name: String, shape: &[usize], std: f32, rng: &mut StdRng| -> Result<()> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * std * 1.732)
            .collect();
        m.insert(name, Tensor::from_vec(v, shape, &Device::Cpu)?);
        Ok(())
    };
    for i in 0..a.blocks {
        // Up, then down, each weight then bias: the order of the draws.
        for (name, out, inp) in [("up", a.hidden, a.width), ("down", a.width, a.hidden)] {
            let std = gain / (inp as f32).sqrt();
            put(format!("layers.{i}.{name}.weight"), &[out, inp], std, rng)?;
            put(format!("layers.{i}.{name}.bias"), &[out], 0.02, rng)?;
        }
    }
    Ok(m)
}

/// AdamW over the student's weights, its state named after them (so a saved
/// state loads only into the same model).
fn optimizer(
    a: &Args,
    student: &TrainableSequential,
    place: OptimizerPlace,
) -> Result<PlacedAdamW> {
    let params = ParamsAdamW {
        lr: a.lr,
        weight_decay: a.weight_decay,
        ..Default::default()
    };
    let dev = student.inner().config().device.clone();
    let mut opt = PlacedAdamW::new(student.trainable_vars()?, params, place, &dev)?;
    opt.set_param_names(student.parameters().into_iter().map(|(n, _)| n).collect())?;
    Ok(opt)
}

/// The loss plot's labels.
const LABELS: CurveLabels = CurveLabels {
    title: "train_mlp: loss",
    ylabel: "MSE",
    series: "student",
};

/// Every flag checked before any work: sizes positive and not absurd, a finite
/// positive learning rate, `--prefetch` within the model. Returns the prefetch.
fn check_args(a: &Args) -> Result<usize> {
    cli::count("--blocks", a.blocks, 1 << 16)?;
    cli::count("--width", a.width, 1 << 20)?;
    cli::count("--hidden", a.hidden, 1 << 20)?;
    cli::count("--batch", a.batch, 1 << 24)?;
    cli::count("--steps", a.steps, 1 << 40)?;
    cli::count("--save-every", a.save.save_every, 1 << 40)?;
    cli::learning_rate("--lr", a.lr)?;
    cli::weight_decay("--weight-decay", a.weight_decay, a.lr)?;
    let params = (2 * a.width * a.hidden + a.width + a.hidden) as u128 * a.blocks as u128;
    if params > 1 << 38 {
        bail!(
            "--blocks {} --width {} --hidden {}: {params} parameters is beyond 2^38",
            a.blocks,
            a.width,
            a.hidden
        );
    }
    if (a.batch as u128) * (a.width.max(a.hidden) as u128) > 1 << 36 {
        bail!(
            "--batch {} x --hidden/--width {}: activations beyond 2^36 elements",
            a.batch,
            a.width.max(a.hidden)
        );
    }
    Ok(cli::prefetch("--prefetch", a.prefetch, a.blocks)?)
}

/// What `progress.json` records: the step and the files of its save.
struct Saved {
    step: usize,
    weights: PathBuf,
    optimizer: PathBuf,
}

/// `--resume`: the save progress.json names, after checking that the saved
/// run had this run's sizes (the error names both).
fn resume_from(a: &Args, progress_path: &std::path::Path) -> Result<Saved> {
    let progress: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(progress_path)
            .with_context(|| format!("--resume: no {}", progress_path.display()))?,
    )
    .with_context(|| format!("--resume: {} is not JSON", progress_path.display()))?;
    for (flag, key, ours) in [
        ("--blocks", "blocks", a.blocks),
        ("--width", "width", a.width),
        ("--hidden", "hidden", a.hidden),
    ] {
        // (Files from before sizes were recorded are checked by the weights' shapes.)
        if let Some(saved) = progress.get(key).and_then(|v| v.as_u64()) {
            if saved != ours as u64 {
                bail!(
                    "--resume: {flag} {ours} differs from the saved run's {key} {saved} ({})",
                    progress_path.display()
                );
            }
        }
    }
    let step = progress["step"]
        .as_u64()
        .context("progress.json has no step")? as usize;
    // Saves from before files were named by step used fixed names.
    let file = |key: &str, legacy: &str| -> Result<PathBuf> {
        let name = progress[key].as_str().unwrap_or(legacy);
        let what = format!("{} field {key:?}", progress_path.display());
        Ok(streamer_core::sibling_file(&a.out, name, &what)?)
    };
    Ok(Saved {
        step,
        weights: file("weights", "weights.safetensors")?,
        optimizer: file("optimizer", "optimizer.safetensors")?,
    })
}

/// Saves weights, optimizer state and progress as one consistent set (see the
/// module docs); `previous` is the save it replaces, removed last.
fn save_run(
    a: &Args,
    student: &TrainableSequential,
    opt: &PlacedAdamW,
    step: usize,
    losses: &[(usize, f32)],
    previous: &mut Option<(PathBuf, PathBuf)>,
) -> Result<()> {
    // Never save a NaN or an infinity (the previous save stays).
    opt.check_finite()
        .with_context(|| format!("not saving step {step} into {}", a.out.display()))?;
    let w = a.out.join(format!("weights-{step:08}.safetensors"));
    let o = a.out.join(format!("optimizer-{step:08}.safetensors"));
    student.inner().save_safetensors(&w)?;
    opt.save(&o)?;
    write_curve(&a.out, losses, &LABELS)?;
    let name = |p: &PathBuf| p.file_name().map(|n| n.to_string_lossy().into_owned());
    let progress = serde_json::json!({
        "step": step, "blocks": a.blocks, "width": a.width, "hidden": a.hidden,
        "weights": name(&w), "optimizer": name(&o),
    });
    streamer_device::write_atomic(&a.out.join("progress.json"), &progress.to_string())?;
    if let Some((pw, po)) = previous.replace((w.clone(), o.clone())) {
        for p in [pw, po] {
            if p != w && p != o {
                let _ = std::fs::remove_file(p);
            }
        }
    }
    Ok(())
}

/// The student and its optimizer: fresh, or with `--resume` the saved weights,
/// optimizer state, step and losses, and the files of that save (which the
/// next save replaces).
type Student = (
    TrainableSequential,
    PlacedAdamW,
    usize,
    Vec<(usize, f32)>,
    Option<(PathBuf, PathBuf)>,
);

fn student(
    a: &Args,
    (cfg, place): (&StreamConfig, OptimizerPlace),
    rng: &mut StdRng,
) -> Result<Student> {
    if !a.save.resume {
        let init = random_weights(a, rng, 1.0)?;
        let student = StreamedSequential::from_tensors(init, blocks(a), cfg.clone())?.train();
        let opt = optimizer(a, &student, place)?;
        return Ok((student, opt, 0, Vec::new(), None));
    }
    let saved = resume_from(a, &a.out.join("progress.json"))?;
    let student = StreamedSequential::from_safetensors(&[&saved.weights], blocks(a), cfg.clone())
        .context("--resume: the saved weights do not fit this --blocks/--width/--hidden")?
        .train();
    let mut opt = optimizer(a, &student, place)?;
    opt.load(&saved.optimizer)?;
    opt.set_learning_rate(a.lr);
    // loss.csv is written before progress.json: drop rows past the saved step.
    let losses = read_losses(&a.out.join("loss.csv"), saved.step)?;
    let files = Some((saved.weights, saved.optimizer));
    Ok((student, opt, saved.step, losses, files))
}

fn print_header(
    a: &Args,
    student: &TrainableSequential,
    cfg: &StreamConfig,
    start: usize,
) -> Result<()> {
    let params: usize = student
        .parameters()
        .iter()
        .map(|(_, v)| v.elem_count())
        .sum();
    println!(
        "train_mlp: {} blocks w{} h{} ({:.1} M params, {:.1} MiB in {:?} per block), batch {}, {:?}, prefetch {}, steps {start}..{}",
        a.blocks,
        a.width,
        a.hidden,
        params as f64 / 1e6,
        (params / a.blocks * cfg.dtype.size_in_bytes()) as f64 / 1048576.0,
        cfg.dtype,
        a.batch,
        cfg.device.location(),
        cfg.prefetch_ahead,
        a.steps
    );
    Ok(())
}

/// The inputs of step `step`: seeded by `(seed, step)` only, so a resumed run
/// sees the data an uninterrupted one would.
fn batch(a: &Args, step: usize, dev: &Device) -> Result<Tensor> {
    let mut drng = StdRng::seed_from_u64(a.seed ^ (step as u64).wrapping_mul(0x9E37_79B9));
    let xv: Vec<f32> = (0..a.batch * a.width)
        .map(|_| drng.random::<f32>() * 2.0 - 1.0)
        .collect();
    Ok(Tensor::from_vec(xv, (a.batch, a.width), dev)?)
}

fn main() -> Result<()> {
    let a = Args::parse();
    let (dev, dtype) = a.run_on.resolve()?;
    let decided = decide(&a, &dev, dtype)?;
    let (prefetch, policy) = (decided.prefetch, decided.policy);
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let cfg = StreamConfig {
        device: dev.clone(),
        prefetch_ahead: prefetch,
        dtype,
        master_dtype: Some(DType::F32),
        ..Default::default()
    };
    let mut rng = StdRng::seed_from_u64(a.seed);
    // The teacher: fixed by the seed, run streamed for inference only.
    let teacher_weights = random_weights(&a, &mut rng, 1.0)?;
    let teacher = StreamedSequential::from_tensors(
        teacher_weights,
        blocks(&a),
        StreamConfig {
            master_dtype: None,
            ..cfg.clone()
        },
    )?;
    let (student, mut opt, start, mut losses, mut previous) =
        student(&a, (&cfg, decided.place), &mut rng)?;
    student.set_activation_policy(policy)?;
    if start >= a.steps {
        println!(
            "already at step {start} of {}: nothing to do (raise --steps)",
            a.steps
        );
        return Ok(());
    }
    print_header(&a, &student, &cfg, start)?;
    // A bar on a terminal; plain lines every --log-every steps in a log.
    let progress = Progress::new(start, a.steps, a.save.log_every);
    let t0 = Instant::now();
    for step in start..a.steps {
        let x = batch(&a, step, &dev)?.to_dtype(dtype)?;
        let target = teacher.forward(&x)?.to_dtype(DType::F32)?;
        let y = student.forward(&x)?;
        let loss = y.to_dtype(DType::F32)?.sub(&target)?.sqr()?.mean_all()?;
        let l = loss.to_scalar::<f32>()?;
        if !l.is_finite() {
            bail!("loss is {l} at step {step}: refused before backward (weights and the last save unchanged)");
        }
        // The optimizer refuses a non-finite gradient before changing anything.
        match opt.place() {
            OptimizerPlace::Host => opt.step(&student.backward(&loss)?)?,
            // Each block's weights are stepped on the device during backward.
            OptimizerPlace::Device => drop(opt.backward_step(&student, &loss)?),
        }
        student.zero_grad()?;
        losses.push((step + 1, l));
        let done = step + 1 - start;
        let tps = (done * a.batch) as f64 / t0.elapsed().as_secs_f64();
        progress.update(step + 1, l, tps);
        if (step + 1) % a.save.save_every == 0 && step + 1 < a.steps {
            save_run(&a, &student, &opt, step + 1, &losses, &mut previous)?;
        }
    }
    progress.finish();
    save_run(&a, &student, &opt, a.steps, &losses, &mut previous)?;
    let first = losses.first().map(|l| l.1).unwrap_or(f32::NAN);
    let last = losses.last().map(|l| l.1).unwrap_or(f32::NAN);
    println!(
        "loss {first:.5} -> {last:.5} over {} steps ({:.1} s)",
        losses.len(),
        t0.elapsed().as_secs_f64()
    );
    println!("student {}", student.stats()?);
    println!(
        "wrote {}/{{loss.csv, loss.svg, weights-<step>.safetensors, optimizer-<step>.safetensors, progress.json}}",
        a.out.display()
    );
    Ok(())
}
