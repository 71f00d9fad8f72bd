//! `HostPlan`: the host memory of a streamed full fine-tune, said before any
//! weight is loaded, against what the trainer then allocates; a plan larger
//! than the host is refused with its numbers. `DevicePlan` (a decoder) and
//! `MlpPlan` (`FusedMlp` blocks): device memory by part, and the settings
//! chosen for a device budget. `LoraPlan`: a LoRA step's micro-batches and
//! kept activations in a device budget.
use super::models::{err_of, fail};
use anyhow::{ensure, Result};
use candle_core::{DType, Device};
use candle_nn::ParamsAdamW;
use streamer_autograd::ActivationPolicy;
use streamer_device::Error;
use streamer_models::{
    device_plan::host_plan, init_weights, DevicePlan, HostPlan, Llama, LlamaConfig, LmTrainer,
    LoraAdapters, LoraConfig, LoraPlan, LoraStep, OptimizerPlace, PlanChoices, PlanLimits,
    StateDtype, StepRates, StepSettings, StepShape, TrainSetup, LORA_TARGETS,
};

fn setup(place: OptimizerPlace, state: StateDtype) -> TrainSetup {
    TrainSetup {
        master_dtype: DType::F32,
        place,
        state,
        cuda: false,
        offload_inputs: None,
    }
}

/// The plan's masters and moments are what a trainer over `tiny` holds.
#[test]
fn host_plan_matches_the_trainers_buffers() -> Result<()> {
    let cfg = LlamaConfig::tiny();
    for state in [StateDtype::F32, StateDtype::Bf16] {
        let plan = HostPlan::for_training(&cfg, &setup(OptimizerPlace::Host, state));
        let stream = crate::common::stream(&Device::Cpu, DType::F32, 1);
        let model = Llama::from_tensors(init_weights(&cfg, 0)?, &cfg, stream)?;
        let t = LmTrainer::new_with(model, ParamsAdamW::default(), OptimizerPlace::Host, state)?;
        let params = t.model().parameters();
        let masters: usize = params
            .iter()
            .map(|(_, v)| v.elem_count() * v.dtype().size_in_bytes())
            .sum();
        let n: usize = params.iter().map(|(_, v)| v.elem_count()).sum();
        let opt = t.optimizer().expect("host optimizer");
        ensure!(
            plan.masters == masters,
            "{state:?}: masters {} vs {masters}",
            plan.masters
        );
        ensure!(
            plan.moments == n * opt.state_bytes_per_param(),
            "{state:?}: moments {} vs {}",
            plan.moments,
            n * opt.state_bytes_per_param()
        );
        ensure!(
            plan.gradients == n * 4,
            "{state:?}: gradients {}",
            plan.gradients
        );
    }
    Ok(())
}

/// Llama 3.1 8B: 16 bytes a parameter with f32 moments on the host (120 GiB:
/// more than the 110 GiB a 128 GiB machine leaves), 12 with bf16 moments, 4
/// with the device optimizer.
#[test]
fn host_plan_of_8b_and_its_refusal() -> Result<()> {
    let cfg = LlamaConfig::llama31_8b();
    let n = cfg.num_params();
    let f32s = HostPlan::for_training(&cfg, &setup(OptimizerPlace::Host, StateDtype::F32));
    let bf16 = HostPlan::for_training(&cfg, &setup(OptimizerPlace::Host, StateDtype::Bf16));
    let dev = HostPlan::for_training(
        &cfg,
        &TrainSetup {
            cuda: true,
            ..setup(OptimizerPlace::Device, StateDtype::F32)
        },
    );
    ensure!(f32s.total() == 16 * n, "{f32s}");
    ensure!(bf16.total() == 12 * n, "{bf16}");
    let layers = cfg.layer_params() * cfg.num_hidden_layers;
    ensure!(dev.total() == 4 * layers, "{dev}");
    let e = fail(f32s.check_fits(110 << 30))?;
    ensure!(
        matches!(Error::find(&e), Some(&Error::OutOfMemory { needed, free, .. })
            if needed == f32s.total() && free == 110 << 30),
        "{e}"
    );
    let err = e.to_string();
    ensure!(
        err.contains("110.0 GiB available") && err.contains("--optimizer-state bf16"),
        "{err:?}"
    );
    bf16.check_fits(110 << 30)?;
    // Offloaded inputs: every layer's but the first, in the compute dtype.
    let off = HostPlan::for_training(
        &cfg,
        &TrainSetup {
            offload_inputs: Some((8, 2048, DType::BF16)),
            ..setup(OptimizerPlace::Host, StateDtype::Bf16)
        },
    );
    ensure!(off.activations == 31 * 8 * 2048 * 4096 * 2);
    Ok(())
}

/// Qwen2.5 14B's shapes have its published parameter count (14,770,033,664
/// with q/k/v biases and an untied head); its f32 layer masters alone, with
/// the device optimizer, take 49.2 GiB of host memory.
#[test]
fn qwen25_14b_shapes() -> Result<()> {
    let cfg = LlamaConfig::qwen25_14b();
    ensure!(cfg.num_params() == 14_770_033_664, "{}", cfg.num_params());
    let dev = HostPlan::for_training(
        &cfg,
        &TrainSetup {
            cuda: true,
            ..setup(OptimizerPlace::Device, StateDtype::F32)
        },
    );
    ensure!(dev.total() == 4 * 48 * 275_268_608, "{dev}");
    Ok(())
}

fn shape_8b(rows: usize) -> StepShape {
    StepShape {
        rows,
        seq: 2048,
        dtype: DType::BF16,
    }
}

/// A device plan's parts: they add up; saved inputs are every layer's input
/// in the compute dtype unless offloaded; the device optimizer holds f32
/// moments of every weight and the outer weights' f32 masters; a layer's
/// work grows with the sequences a piece, the slots with the window.
#[test]
fn device_plan_parts() -> Result<()> {
    let cfg = LlamaConfig::llama31_8b();
    let s = StepSettings {
        place: OptimizerPlace::Device,
        state: StateDtype::F32,
        offload_inputs: false,
        piece_rows: 8,
        window: 2,
        keep_bytes: 0,
    };
    let p = DevicePlan::estimate(&cfg, shape_8b(32), s);
    let sum = p.slots
        + p.outer
        + p.optimizer
        + p.saved_inputs
        + p.step_rows
        + p.layer_work
        + p.loss_chunk
        + p.kept
        + p.runtime;
    ensure!(p.total() == sum, "{p}");
    ensure!(p.saved_inputs == 32 * 32 * 2048 * 4096 * 2, "{p}");
    let layers = cfg.layer_params() * cfg.num_hidden_layers;
    ensure!(p.optimizer == 8 * cfg.num_params() + 4 * (cfg.num_params() - layers));
    let off = DevicePlan::estimate(
        &cfg,
        shape_8b(32),
        StepSettings {
            place: OptimizerPlace::Host,
            offload_inputs: true,
            ..s
        },
    );
    ensure!(off.saved_inputs == 0 && off.optimizer == 0, "{off}");
    let half = DevicePlan::estimate(&cfg, shape_8b(32), StepSettings { piece_rows: 4, ..s });
    ensure!(half.layer_work < p.layer_work && half.step_rows == p.step_rows);
    let one = DevicePlan::estimate(&cfg, shape_8b(32), StepSettings { window: 1, ..s });
    ensure!(2 * one.slots == p.slots);
    Ok(())
}

/// The planner picks the fastest settings that fit and says what it picked:
/// everything on the device when the device is large, the host optimizer
/// and offloaded inputs in 24 GiB; every plan it returns fits its budget;
/// too large and too small budgets are refused naming the numbers.
#[test]
fn device_plan_choice_and_refusals() -> Result<()> {
    let cfg = LlamaConfig::llama31_8b();
    let big = DevicePlan::choose(&cfg, shape_8b(8), (139 << 30, 140 << 30))?;
    ensure!(
        big.settings
            == StepSettings {
                place: OptimizerPlace::Device,
                state: StateDtype::F32,
                offload_inputs: false,
                piece_rows: 8,
                window: 2,
                keep_bytes: big.settings.keep_bytes,
            },
        "{big}"
    );
    // What the budget has left keeps activations: the plan fills it.
    ensure!(
        big.settings.keep_bytes > 0 && big.kept == big.settings.keep_bytes,
        "{big}"
    );
    ensure!(big.total() == 139 << 30, "{big}");
    let host = DevicePlan::choose_among(
        &cfg,
        shape_8b(8),
        limits(139, None),
        PlanChoices {
            places: &[OptimizerPlace::Host],
            states: &[StateDtype::F32],
        },
    )?;
    ensure!(host.settings.place == OptimizerPlace::Host, "{host}");
    // bf16 moments on the device: half the optimizer's bytes for the
    // moments; the outer weights' f32 masters stay.
    let outer = 4 * (cfg.num_params() - cfg.layer_params() * cfg.num_hidden_layers);
    let half = DevicePlan::estimate(
        &cfg,
        shape_8b(8),
        StepSettings {
            state: StateDtype::Bf16,
            ..big.settings
        },
    );
    ensure!(half.optimizer == 4 * cfg.num_params() + outer, "{half}");
    ensure!(big.optimizer == 8 * cfg.num_params() + outer, "{big}");
    let small = DevicePlan::choose(&cfg, shape_8b(32), (24 << 30, 140 << 30))?;
    ensure!(
        small.settings.place == OptimizerPlace::Host
            && small.settings.offload_inputs
            && small.settings.keep_bytes == 0,
        "{small}"
    );
    ensure!(32 % small.settings.piece_rows == 0, "{small}");
    for gib in [16usize, 20, 24, 32, 48, 64, 96, 139] {
        if let Ok(p) = DevicePlan::choose(&cfg, shape_8b(32), (gib << 30, 140 << 30)) {
            ensure!(p.total() <= gib << 30, "{gib} GiB: {p}");
        }
    }
    let e = fail(DevicePlan::choose(
        &cfg,
        shape_8b(8),
        (200 << 30, 140 << 30),
    ))?;
    ensure!(
        matches!(Error::find(&e), Some(&Error::OutOfMemory { needed, free, .. })
            if needed == 200 << 30 && free == 140 << 30),
        "{e}"
    );
    let e = fail(DevicePlan::choose(&cfg, shape_8b(8), (4 << 30, 140 << 30)))?;
    ensure!(
        matches!(Error::find(&e), Some(&Error::OutOfMemory { needed, free, .. })
            if needed > free && free == 4 << 30),
        "{e}"
    );
    ensure!(e.to_string().contains("below the smallest plan"), "{e}");
    Ok(())
}

fn limits(device_budget_gib: usize, host_gib: Option<usize>) -> PlanLimits {
    PlanLimits {
        device_budget: device_budget_gib << 30,
        device_total: 140 << 30,
        host_available: host_gib.map(|g| g << 30),
    }
}

/// With the host's memory in the plan, the planner keeps f32 moments where
/// device and host hold them and halves them where not: 8B on an H200 keeps
/// everything on the device in f32; in 24 GiB with a 110 GiB host the host
/// optimizer's f32 moments (64 GB) do not fit beside the masters and
/// gradients, so it takes bf16; a 14B model's f32 moments fit only a
/// 139 GiB device (with the inputs offloaded), a 100 GiB budget takes the
/// device optimizer with bf16 moments, and a 24 GiB one fits no host. Every chosen plan's
/// host side fits, and a host too small for any plan is refused, naming it.
#[test]
fn device_plan_fits_the_host() -> Result<()> {
    let (b8, b14) = (LlamaConfig::llama31_8b(), LlamaConfig::qwen25_14b());
    let d = PlanChoices::default();
    let big = DevicePlan::choose_among(&b8, shape_8b(8), limits(139, Some(110)), d)?;
    ensure!(
        (big.settings.place, big.settings.state) == (OptimizerPlace::Device, StateDtype::F32),
        "{big}"
    );
    let small = DevicePlan::choose_among(&b8, shape_8b(32), limits(24, Some(110)), d)?;
    ensure!(
        (small.settings.place, small.settings.state) == (OptimizerPlace::Host, StateDtype::Bf16)
            && small.settings.offload_inputs,
        "{small}"
    );
    // Without the host in the plan, the same budget keeps f32 moments.
    let blind = DevicePlan::choose_among(&b8, shape_8b(32), limits(24, None), d)?;
    ensure!(blind.settings.state == StateDtype::F32, "{blind}");
    // 14B on an H200: f32 moments fit the device once the inputs go to the
    // host; in 100 GiB only bf16 moments do.
    let q = DevicePlan::choose_among(&b14, shape_8b(8), limits(139, Some(110)), d)?;
    ensure!(
        (
            q.settings.place,
            q.settings.state,
            q.settings.offload_inputs
        ) == (OptimizerPlace::Device, StateDtype::F32, true),
        "{q}"
    );
    let q100 = DevicePlan::choose_among(&b14, shape_8b(8), limits(100, Some(110)), d)?;
    ensure!(
        (q100.settings.place, q100.settings.state) == (OptimizerPlace::Device, StateDtype::Bf16),
        "{q100}"
    );
    for (cfg, rows, p) in [
        (&b8, 8, &big),
        (&b8, 32, &small),
        (&b14, 8, &q),
        (&b14, 8, &q100),
    ] {
        let host = host_plan(cfg, shape_8b(rows), &p.settings);
        ensure!(host.total() <= 110 << 30, "{p}: {host}");
    }
    let host_14b = host_plan(&b14, shape_8b(8), &q100.settings);
    // f32 masters of the 48 layers, nothing else on the host.
    ensure!(host_14b.masters == 4 * b14.layer_params() * b14.num_hidden_layers);
    ensure!(
        host_14b.moments == 0 && host_14b.gradients == 0,
        "{host_14b}"
    );
    let err = err_of(DevicePlan::choose_among(
        &b14,
        shape_8b(8),
        limits(24, Some(110)),
        d,
    ))?;
    ensure!(
        err.contains("fits the host") && err.contains("110.0 GiB available"),
        "{err}"
    );
    Ok(())
}

/// A plan's expected step from measured rates, against the same arithmetic
/// written out here: every piece runs a forward and a backward through every
/// layer and a recompute through the layers not kept, the head costs its
/// measured time per token, masters go up twice and down once in f32
/// with offloaded inputs both ways, and the slowest of the three sets the
/// pace.
#[test]
fn device_plan_expectation() -> Result<()> {
    let cfg = LlamaConfig::llama31_8b();
    let rates = StepRates {
        piece_rows: 8,
        layer_forward_s: 0.1,
        layer_backward_s: 0.2,
        head_s: 0.05,
        h2d_bytes_per_s: 50e9,
        d2h_bytes_per_s: 50e9,
    };
    let s = StepSettings {
        place: OptimizerPlace::Host,
        state: StateDtype::F32,
        offload_inputs: false,
        piece_rows: 8,
        window: 2,
        keep_bytes: 0,
    };
    let shape = shape_8b(32);
    let tokens = 32.0 * 2048.0;
    // Timed over 8 sequences, the head runs over 32.
    let head_s = 0.05 * 4.0;
    let e = DevicePlan::estimate(&cfg, shape, s).expect(&cfg, shape, &rates);
    let want = 4.0 * 32.0 * 0.4 + head_s;
    ensure!((e.compute_s - want).abs() < 1e-9 * want, "{e:?} vs {want}");
    let masters = 4.0 * (cfg.layer_params() * 32) as f64;
    ensure!((e.h2d_s - 2.0 * masters / 50e9).abs() < 1e-9, "{e:?}");
    ensure!((e.d2h_s - masters / 50e9).abs() < 1e-9, "{e:?}");
    ensure!(
        (e.tokens_per_s - tokens / want).abs() < 1e-6 * e.tokens_per_s,
        "{e:?}"
    );
    // Three layers kept: three fewer recomputes a piece. A layer keeps x,
    // x_mid and h2 (4096 wide), q and o (4096), k and v (1024), gate and up
    // (14336), and its softmax statistics in f32 (32 heads).
    let rows = 32 * 2048;
    let layer = rows * (3 * 4096 + 2 * 4096 + 2 * 1024 + 2 * 14336) * 2 + rows * 32 * 4;
    let kept = StepSettings {
        keep_bytes: 3 * layer,
        ..s
    };
    let k = DevicePlan::estimate(&cfg, shape, kept).expect(&cfg, shape, &rates);
    ensure!(
        (e.compute_s - k.compute_s - 4.0 * 3.0 * 0.1).abs() < 1e-9,
        "{k:?} vs {e:?}"
    );
    // Offloaded inputs cross both ways; slow copies set the pace.
    let slow = StepRates {
        h2d_bytes_per_s: 1e9,
        ..rates
    };
    let off = StepSettings {
        offload_inputs: true,
        ..s
    };
    let o = DevicePlan::estimate(&cfg, shape, off).expect(&cfg, shape, &slow);
    let inputs = tokens * 32.0 * 4096.0 * 2.0;
    ensure!(
        (o.h2d_s - (2.0 * masters + inputs) / 1e9).abs() < 1e-6,
        "{o:?}"
    );
    ensure!((o.tokens_per_s - tokens / o.h2d_s).abs() < 1e-6, "{o:?}");
    ensure!(o.to_string().contains("PCIe-bound"), "{o}");
    Ok(())
}

/// `MlpPlan` (`train_mlp --device-budget`): its parts are the bytes computed
/// here from the shapes (w4096 h16384 x8 blocks, 8,192 rows, bf16); a large
/// budget takes the device optimizer and keeps activations in what is left,
/// filling it; a budget without room for the device optimizer's f32 moments
/// takes the host one; every chosen plan fits its budget; a budget over the
/// device or under the smallest plan (host optimizer, one block resident,
/// every block recomputed) is refused with the numbers.
#[test]
fn mlp_plan_choice_and_refusals() -> Result<()> {
    use streamer_models::{MlpPlan, MlpSettings, MlpShape};
    let shape = MlpShape {
        blocks: 8,
        width: 4096,
        hidden: 16384,
        rows: 8192,
        dtype: DType::BF16,
    };
    let p = 2 * 4096 * 16384 + 4096 + 16384;
    ensure!(shape.block_params() == p);
    let device = MlpSettings {
        place: OptimizerPlace::Device,
        window: 2,
        keep_bytes: 0,
    };
    let e = MlpPlan::estimate(shape, device);
    // Student slots: bf16 and staged f32; the teacher's: bf16.
    ensure!(e.slots == 2 * p * 6 + 2 * p * 2, "{e}");
    ensure!(e.optimizer == 8 * 8 * p, "{e}");
    ensure!(e.saved_inputs == 8 * 8192 * 4096 * 2, "{e}");
    let kept_block = 8192 * (4096 + 2 * 16384) * 2;
    ensure!(shape.kept_block_bytes() == kept_block);
    ensure!(
        e.block_work == kept_block + 8192 * (2 * 4096 + 2 * 16384) * 2 + 2 * p * 6,
        "{e}"
    );
    ensure!(e.runtime == 1 << 30, "{e}");
    let host = MlpPlan::estimate(
        shape,
        MlpSettings {
            place: OptimizerPlace::Host,
            ..device
        },
    );
    ensure!(host.optimizer == 0 && host.total() + 8 * 8 * p == e.total());
    let total = 80usize << 30;
    let big = MlpPlan::choose(shape, (64 << 30, total))?;
    ensure!(
        big.settings.place == OptimizerPlace::Device && big.settings.window == 2,
        "{big}"
    );
    ensure!(
        big.total() == 64 << 30 && big.kept == big.settings.keep_bytes,
        "{big}"
    );
    ensure!(
        big.settings.activation_policy()
            == ActivationPolicy::Keep {
                device_bytes: big.kept
            },
        "{big}"
    );
    // 12 GiB: the f32 moments (8.6 GB) do not fit beside the rest.
    let small = MlpPlan::choose(shape, (12 << 30, total))?;
    ensure!(small.settings.place == OptimizerPlace::Host, "{small}");
    for gib in [6usize, 8, 12, 16, 24, 32, 48, 80] {
        if let Ok(plan) = MlpPlan::choose(shape, (gib << 30, total)) {
            ensure!(plan.total() <= gib << 30, "{gib} GiB: {plan}");
        }
    }
    let e = fail(MlpPlan::choose(shape, (100 << 30, total)))?;
    ensure!(
        matches!(Error::find(&e), Some(&Error::OutOfMemory { needed, free, .. })
            if needed == 100 << 30 && free == total),
        "{e}"
    );
    let smallest = MlpPlan::estimate(
        shape,
        MlpSettings {
            place: OptimizerPlace::Host,
            window: 1,
            keep_bytes: 0,
        },
    );
    let e = fail(MlpPlan::choose(shape, (2 << 30, total)))?;
    ensure!(
        matches!(Error::find(&e), Some(&Error::OutOfMemory { needed, free, .. })
            if needed == smallest.total() && free == 2 << 30),
        "{e}"
    );
    ensure!(e.to_string().contains("below the smallest plan"), "{e}");
    ensure!(smallest.settings.activation_policy() == ActivationPolicy::Recompute);
    Ok(())
}

fn lora_all(dropout: f64) -> Result<LoraConfig> {
    Ok(LoraConfig::new(16, 32.0, dropout, &LORA_TARGETS)?)
}

/// Bytes one NF4 layer of `cfg` copies: half a byte a weight and an f32
/// absmax per block of 64 (norms apart: a rounding error).
fn nf4_layer_bytes(cfg: &LlamaConfig) -> usize {
    cfg.layer_params() / 2 + cfg.layer_params() / 64 * 4
}

/// Rates of an H100-like device at 8B shapes over one 2,048-token sequence.
fn rates_8b(h2d: f64) -> StepRates {
    StepRates {
        piece_rows: 1,
        layer_forward_s: 0.0016,
        layer_backward_s: 0.0022,
        head_s: 0.004,
        h2d_bytes_per_s: h2d,
        d2h_bytes_per_s: h2d,
    }
}

/// A LoRA plan keeps what the trainer keeps: with the plan's bytes per layer
/// for `k` layers (and half a layer to spare) a micro-batch's forward keeps
/// `k` layers of a tiny adapted model, with a byte less than `k` layers
/// `k - 1`. So its count of a layer's activations is the layer's own,
/// adapters and dropout masks included, to within half a layer.
#[test]
fn lora_plan_counts_what_a_layer_keeps() -> Result<()> {
    let cfg = LlamaConfig::tiny();
    let lcfg = lora_all(0.05)?;
    let (rows, seq) = (4, 16);
    let step = LoraStep {
        cfg: &cfg,
        lora: &lcfg,
        shape: StepShape {
            rows,
            seq,
            dtype: DType::F32,
        },
        layer_bytes: cfg.layer_params() * 4,
    };
    let stream = crate::common::stream(&Device::Cpu, DType::F32, 1);
    let model = Llama::from_tensors(init_weights(&cfg, 0)?, &cfg, stream)?.into_trainable()?;
    model.set_lora(Some(LoraAdapters::init(&lcfg, &cfg, &Device::Cpu, 0)?))?;
    let layers = model.trainable_layers().expect("trainable");
    let ids: Vec<u32> = (0..rows * seq).map(|i| (i * 7 % 97) as u32).collect();
    let x = candle_core::Tensor::from_vec(ids, (rows, seq), &Device::Cpu)?;
    for micro in [1, 2] {
        let layer = step.kept_per_layer(rows / micro);
        for (bytes, want) in [
            (2 * layer + layer / 2, 2),
            (3 * layer - 1, 2),
            (4 * layer, 4),
        ] {
            layers.set_activation_policy(ActivationPolicy::Keep {
                device_bytes: bytes,
            })?;
            model.lora_loss_and_grads(&x, &x, micro)?;
            model.zero_grad()?;
            let kept = layers.kept_blocks()?;
            ensure!(
                kept == want,
                "{micro} micro-batches, keep {bytes} bytes ({layer} a layer): kept {kept} layers, \
                 expected {want}"
            );
        }
    }
    Ok(())
}

/// The LoRA plan at Llama 3.1 8B's shapes, 8 x 2,048 tokens, r 16 on every
/// projection. With an NF4 base in 24 GiB it splits the step until every
/// layer's activations are kept (and no further), within the budget; dropout
/// keeps each adapter's input mask (a layer keeps more); its expected speed is the formula of its docs; with a bf16 base
/// and a slow link it runs the step at once and recomputes; a budget under
/// the smallest plan is refused naming both sizes; more budget never keeps
/// fewer layers.
#[test]
fn lora_plan_choice_at_8b() -> Result<()> {
    let cfg = LlamaConfig::llama31_8b();
    let lcfg = lora_all(0.0)?;
    let nf4 = LoraStep {
        cfg: &cfg,
        lora: &lcfg,
        shape: shape_8b(8),
        layer_bytes: nf4_layer_bytes(&cfg),
    };
    let budget = 24 << 30;
    let rates = rates_8b(50e9);
    let p = LoraPlan::choose(&nf4, budget, &rates)?;
    ensure!(p.total() <= budget, "{p}");
    ensure!(p.kept_layers == 32 && p.micro_batches > 1, "{p}");
    let fewer = LoraPlan::estimate(&nf4, p.micro_batches / 2, false, budget).expect("fits");
    ensure!(
        fewer.kept_layers < 32,
        "{fewer} keeps every layer: {p} splits too far"
    );
    let dropout = lora_all(0.05)?;
    let masked = LoraStep {
        lora: &dropout,
        ..nf4
    };
    // q, k, v, gate and up read the hidden state, o the attention output,
    // down the MLP's: one kept-element byte each a token.
    let masks = 2048 * (6 * 4096 + 14336);
    ensure!(masked.kept_per_layer(1) == nf4.kept_per_layer(1) + masks);
    let (m, k) = (p.micro_batches as f64, p.kept_layers as f64);
    let scale = p.micro_rows as f64;
    let compute =
        m * (32.0 * (0.0016 + 0.0022) * scale + (32.0 - k) * 0.0016 * scale + 0.004 * scale);
    let h2d = (p.micro_batches * 2 * 32 * nf4.layer_bytes) as f64 / 50e9;
    let want = (8.0 * 2048.0) / compute.max(h2d);
    let got = p.expect(&nf4, &rates).tokens_per_s;
    ensure!(
        (got - want).abs() <= 1e-9 * want,
        "expected {got} tokens/s, formula {want}"
    );
    let dense = LoraStep {
        layer_bytes: cfg.layer_params() * 2,
        ..nf4
    };
    let d = LoraPlan::choose(&dense, budget, &rates_8b(10e9))?;
    ensure!(
        d.micro_batches == 1 && d.kept_layers < 32 && d.total() <= budget,
        "{d}"
    );
    let mut last = 0;
    for gib in [12, 16, 24, 40, 80] {
        let q = LoraPlan::estimate(&nf4, 1, false, gib << 30);
        let kept = q.map_or(0, |q| q.kept_layers);
        ensure!(
            kept >= last,
            "{gib} GiB keeps {kept} layers, less than {last}"
        );
        last = kept;
    }
    for m in [1, 2, 4, 8] {
        for offload in [false, true] {
            if let Some(q) = LoraPlan::estimate(&nf4, m, offload, budget) {
                ensure!(q.total() <= budget, "{q}: over the budget");
            }
        }
    }
    // At 70B shapes the inputs of 80 layers do not fit beside the rest: the
    // plan may offload them (every layer recomputed, each input out and back).
    let cfg70 = LlamaConfig::llama31_70b();
    let s70 = LoraStep {
        cfg: &cfg70,
        layer_bytes: nf4_layer_bytes(&cfg70),
        shape: shape_8b(4),
        ..nf4
    };
    ensure!(LoraPlan::estimate(&s70, 1, false, budget).is_none());
    let off = LoraPlan::estimate(&s70, 1, true, budget).expect("offloaded inputs fit");
    let input = 4 * 2048 * 8192 * 2;
    ensure!(
        off.d2h_bytes == 80 * input
            && off.h2d_bytes == 2 * 80 * s70.layer_bytes + 80 * input
            && off.activation_policy() == ActivationPolicy::OffloadInputs
            && off.total() <= budget,
        "{off}"
    );
    ensure!(
        p.activation_policy()
            == ActivationPolicy::Keep {
                device_bytes: p.keep_bytes
            }
    );
    let e = LoraPlan::choose(&nf4, 2 << 30, &rates)
        .unwrap_err()
        .to_string();
    ensure!(
        e.contains("device budget 2.00 GiB") && e.contains("smallest LoRA plan"),
        "{e}"
    );
    Ok(())
}

/// The largest full fine-tune of the published Llama and Qwen shapes that
/// the GPU machine's host (128 GiB, about 110 available) holds is Qwen2.5
/// 14B's (measured: `benches/results/README.md`): the next, Qwen2.5 32B
/// (64 layers of width 5120, MLP 27648), has 31.2 B layer parameters, whose
/// f32 masters alone (116 GiB) exceed the host in every plan, and Llama 3.1
/// 70B's more so. The planner refuses both, naming the host.
#[test]
fn largest_full_fine_tune_on_this_host() -> Result<()> {
    let qwen32 = LlamaConfig {
        intermediate_size: 27648,
        num_hidden_layers: 64,
        ..LlamaConfig::qwen25_14b()
    };
    // Its published count: 32,763,876,352 (untied head, q/k/v biases).
    ensure!(
        qwen32.num_params() == 32_763_876_352,
        "{}",
        qwen32.num_params()
    );
    let layers = qwen32.layer_params() * qwen32.num_hidden_layers;
    ensure!(4 * layers > 110 << 30, "{layers}");
    for cfg in [&qwen32, &LlamaConfig::llama31_70b()] {
        let err = err_of(DevicePlan::choose_among(
            cfg,
            shape_8b(8),
            limits(139, Some(110)),
            PlanChoices::default(),
        ))?;
        ensure!(err.contains("fits the host"), "{err}");
    }
    // 14B fits the same limits (`device_plan_fits_the_host` says how).
    DevicePlan::choose_among(
        &LlamaConfig::qwen25_14b(),
        shape_8b(8),
        limits(139, Some(110)),
        PlanChoices::default(),
    )?;
    Ok(())
}
