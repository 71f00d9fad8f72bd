//! How a LoRA step on a streamed frozen base uses a device budget
//! (`train_lm --lora-r R --device-budget B`): its sequences as micro-batches
//! run one after another ([`Llama::lora_loss_and_grads`]), and the
//! activations each micro-batch's forward keeps for its backward instead of
//! recomputing them.
//!
//! Fewer micro-batches visit the base fewer times (a visit copies every layer
//! twice: for the forward and, in reverse, for the backward); smaller ones
//! keep more of their layers' activations in the budget. A quantized base
//! copies few bytes a visit, so in a small budget it pays to split the step
//! until every layer's activations are kept; a bf16 base copies four times as
//! many and may do better recomputing. The plan takes the split with the
//! fastest expected step from the measured rates ([`StepRates`]).
//!
//! As with the full fine-tune's [`crate::DevicePlan`], the bytes are upper
//! estimates from the shapes, and the driver enforces the budget itself.
//!
//! [`Llama::lora_loss_and_grads`]: crate::Llama::lora_loss_and_grads
use crate::config::LlamaConfig;
use crate::device_plan::{kept_layer_bytes, layer_work_per_token, Expectation, RUNTIME_BYTES};
use crate::lora::{dims, LoraConfig};
use crate::step_rates::StepRates;
use crate::step_shape::StepShape;
use candle_core::{bail, Result};
use streamer_autograd::ActivationPolicy;

/// Decoder layers resident at once: the one computing and the next arriving.
const WINDOW: usize = 2;

/// The allocator's slack over kept activations, as a share of them (1/20):
/// the LoRA budget test (`tests/lora_budget.rs`, `350m` shapes, an H100)
/// ran out of memory in a plan that counted none and filled its budget.
const SLACK_SHARE: usize = 20;

/// What a LoRA step holds: the model, its adapters and the step's shape.
#[derive(Clone, Copy, Debug)]
pub struct LoraStep<'a> {
    /// The base's configuration.
    pub cfg: &'a LlamaConfig,
    /// The adapters'.
    pub lora: &'a LoraConfig,
    /// Sequences a step (all micro-batches), tokens each, compute dtype.
    pub shape: StepShape,
    /// Bytes one decoder layer of the base copies to the device (packed
    /// bytes for a quantized base).
    pub layer_bytes: usize,
}

/// A LoRA step's split and what it keeps, in a device budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoraPlan {
    /// Micro-batches run one after another.
    pub micro_batches: usize,
    /// Sequences a micro-batch.
    pub micro_rows: usize,
    /// Every layer's saved input in page-locked host memory
    /// (`ActivationPolicy::OffloadInputs`: every layer recomputed) rather
    /// than on the device.
    pub offload_inputs: bool,
    /// Layers whose activations a micro-batch's forward keeps (the last
    /// ones); the others are recomputed in its backward.
    pub kept_layers: usize,
    /// The kept activations' device bytes.
    pub kept_bytes: usize,
    /// The bytes `ActivationPolicy::Keep` is given: the kept activations and
    /// less than one layer's more, so that exactly `kept_layers` are kept.
    pub keep_bytes: usize,
    /// Device bytes besides the kept activations, at their widest (the
    /// allocator's slack over the kept ones included).
    pub other_bytes: usize,
    /// Bytes copied to the device a step.
    pub h2d_bytes: usize,
    /// Bytes copied from the device a step (offloaded inputs).
    pub d2h_bytes: usize,
}

impl LoraStep<'_> {
    /// Device bytes a micro-batch of `rows` sequences keeps for one layer
    /// (what the adapted decoder layer's `saved_bytes` counts).
    pub fn kept_per_layer(&self, rows: usize) -> usize {
        let shape = StepShape { rows, ..self.shape };
        let tokens = rows * self.shape.seq;
        kept_layer_bytes(self.cfg, shape) + tokens * self.lora_saved_per_token()
    }

    /// Bytes an adapted layer keeps per token besides the base's: each
    /// adapter's `u = x A^T` in the compute dtype, and with dropout each
    /// adapter's kept input elements (a byte each).
    fn lora_saved_per_token(&self) -> usize {
        let targets = self.lora.targets().unwrap_or_default();
        let masks: usize = if self.lora.lora_dropout > 0.0 {
            targets.iter().map(|&t| dims(self.cfg, t).0).sum()
        } else {
            0
        };
        self.lora.r * targets.len() * self.shape.dtype.size_in_bytes() + masks
    }

    /// The largest input width among the adapted projections.
    fn widest_adapter_input(&self) -> usize {
        let targets = self.lora.targets().unwrap_or_default();
        (targets.iter().map(|&t| dims(self.cfg, t).0).max()).unwrap_or(0)
    }

    /// Adapter parameters of the whole model.
    fn adapter_params(&self) -> usize {
        let targets = self.lora.targets().unwrap_or_default();
        let per_layer: usize = targets
            .iter()
            .map(|&t| {
                let (fan_in, out) = dims(self.cfg, t);
                self.lora.r * (fan_in + out)
            })
            .sum();
        per_layer * self.cfg.num_hidden_layers
    }

    /// Device bytes a micro-batch of `rows` sequences holds besides its
    /// kept activations, with every layer's input saved for its recompute.
    fn other_bytes(&self, rows: usize) -> usize {
        let (cfg, b) = (self.cfg, self.shape.dtype.size_in_bytes());
        let tokens = rows * self.shape.seq;
        let dense_layer = cfg.layer_params() * b;
        // A quantized layer is dequantized on the device before its GEMMs.
        let dequantized = if self.layer_bytes < dense_layer {
            dense_layer
        } else {
            0
        };
        let outer = cfg.outer_params() * b;
        let chunk =
            crate::cross_entropy::linear_cross_entropy_chunk(cfg.vocab_size, self.shape.dtype)
                .min(tokens);
        // f32 adapters, the forward's copy of them (the trainer's snapshot),
        // their gradients (two while micro-batches accumulate) and AdamW's
        // two moments.
        let adapters = 6 * 4 * self.adapter_params();
        // An adapter's backward with dropout holds its scaled mask, the
        // masked input, that input's gradient and its masked product at once.
        let dropout = match self.lora.lora_dropout > 0.0 {
            true => 4 * self.widest_adapter_input() * b,
            false => 0,
        };
        WINDOW * self.layer_bytes
            + dequantized
            + outer
            + adapters
            + cfg.num_hidden_layers * tokens * cfg.hidden_size * b
            + 6 * tokens * cfg.hidden_size * b
            + tokens * (layer_work_per_token(cfg, self.shape.dtype) + dropout)
            + 2 * chunk * cfg.vocab_size * 4
            + RUNTIME_BYTES
    }
}

impl LoraPlan {
    /// The step as `micro_batches` micro-batches in `budget` device bytes:
    /// with the inputs on the device, keeping as many layers' activations as
    /// the rest leaves room for; with them offloaded, recomputing every
    /// layer. `None` where the rest alone does not fit (or the split is not
    /// even).
    pub fn estimate(
        step: &LoraStep,
        micro_batches: usize,
        offload_inputs: bool,
        budget: usize,
    ) -> Option<Self> {
        let rows = step.shape.rows;
        if micro_batches == 0 || rows % micro_batches != 0 {
            return None;
        }
        let micro_rows = rows / micro_batches;
        let layers = step.cfg.num_hidden_layers;
        let input =
            micro_rows * step.shape.seq * step.cfg.hidden_size * step.shape.dtype.size_in_bytes();
        let weights = micro_batches * 2 * layers * step.layer_bytes;
        let mut plan = Self {
            micro_batches,
            micro_rows,
            offload_inputs,
            kept_layers: 0,
            kept_bytes: 0,
            keep_bytes: 0,
            other_bytes: step.other_bytes(micro_rows),
            h2d_bytes: weights,
            d2h_bytes: 0,
        };
        if offload_inputs {
            // The inputs leave the device, bar the one coming back ahead of
            // its layer's backward; each crosses PCIe once each way.
            plan.other_bytes = plan.other_bytes - layers * input + input;
            plan.h2d_bytes += micro_batches * layers * input;
            plan.d2h_bytes = micro_batches * layers * input;
            return (plan.other_bytes <= budget).then_some(plan);
        }
        let free = budget.checked_sub(plan.other_bytes)?;
        let layer = step.kept_per_layer(micro_rows);
        // A kept layer's input is among what it keeps: no longer saved apart;
        // the allocator's slack over it is not.
        let per = (layer - input + layer / SLACK_SHARE).max(1);
        plan.kept_layers = (free / per).min(layers);
        plan.kept_bytes = plan.kept_layers * layer;
        plan.keep_bytes = match plan.kept_layers {
            0 => 0,
            k => k * layer + layer / 2,
        };
        plan.other_bytes -= plan.kept_layers * input;
        plan.other_bytes += plan.kept_layers * (layer / SLACK_SHARE);
        Some(plan)
    }

    /// The layers' activation policy this plan stands for.
    pub fn activation_policy(&self) -> ActivationPolicy {
        match (self.offload_inputs, self.keep_bytes) {
            (true, _) => ActivationPolicy::OffloadInputs,
            (false, 0) => ActivationPolicy::Recompute,
            (false, device_bytes) => ActivationPolicy::Keep { device_bytes },
        }
    }

    /// The split of the step's sequences, and the place of the layers'
    /// inputs, with the fastest expected step at `rates` in `budget` device
    /// bytes (among equals the fewest micro-batches, inputs on the device).
    /// A budget under the smallest plan (one sequence at a time, inputs
    /// offloaded) is an error naming both.
    pub fn choose(step: &LoraStep, budget: usize, rates: &StepRates) -> Result<Self> {
        let rows = step.shape.rows;
        let mut best: Option<(Self, f64)> = None;
        for m in (1..=rows).filter(|m| rows % m == 0) {
            for offload in [false, true] {
                let Some(plan) = Self::estimate(step, m, offload, budget) else {
                    continue;
                };
                let speed = plan.expect(step, rates).tokens_per_s;
                if best.is_none_or(|(_, s)| speed > s) {
                    best = Some((plan, speed));
                }
            }
        }
        if let Some((plan, _)) = best {
            return Ok(plan);
        }
        let smallest = Self::estimate(step, rows, true, usize::MAX).map_or(0, |p| p.total());
        bail!(
            "device budget {:.2} GiB is under the smallest LoRA plan for {rows} sequences of {} \
             tokens ({:.2} GiB: one sequence at a time, inputs offloaded to the host)",
            gib(budget),
            step.shape.seq,
            gib(smallest)
        )
    }

    /// The step's expected seconds of compute and copies at `rates`: each
    /// micro-batch runs every layer's forward and backward and the
    /// recomputed layers' forward again, copies every layer twice, and with
    /// offloaded inputs copies each layer's input out and back.
    pub fn expect(&self, step: &LoraStep, rates: &StepRates) -> Expectation {
        let layers = step.cfg.num_hidden_layers;
        let scale = self.micro_rows as f64 / rates.piece_rows.max(1) as f64;
        let (f, b) = (
            rates.layer_forward_s * scale,
            rates.layer_backward_s * scale,
        );
        let recomputed = (layers - self.kept_layers) as f64;
        let m = self.micro_batches as f64;
        let compute_s = m * (layers as f64 * (f + b) + recomputed * f + rates.head_s * scale);
        let h2d_s = self.h2d_bytes as f64 / rates.h2d_bytes_per_s;
        let d2h_s = self.d2h_bytes as f64 / rates.d2h_bytes_per_s;
        let tokens = (step.shape.rows * step.shape.seq) as f64;
        Expectation {
            compute_s,
            h2d_s,
            d2h_s,
            tokens_per_s: tokens / compute_s.max(h2d_s).max(d2h_s),
        }
    }

    /// Device bytes in all.
    pub fn total(&self) -> usize {
        self.kept_bytes + self.other_bytes
    }
}

fn gib(b: usize) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

impl std::fmt::Display for LoraPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} micro-batch(es) of {} sequences one after another, each ",
            self.micro_batches, self.micro_rows,
        )?;
        if self.offload_inputs {
            write!(
                f,
                "recomputing every layer from inputs offloaded to the host"
            )?;
        } else {
            write!(
                f,
                "keeping the activations of {} layers ({:.1} GiB; the rest recomputed)",
                self.kept_layers,
                gib(self.kept_bytes)
            )?;
        }
        write!(
            f,
            ", {:.1} GiB besides; {:.1} GB copied to the device a step",
            gib(self.other_bytes),
            self.h2d_bytes as f64 / 1e9
        )
    }
}
