//! What a streamed full fine-tune of a decoder holds on the GPU during a
//! step, by part, and the fastest settings whose step fits a device budget
//! (`train_lm --device-budget`).
//!
//! The figures are upper estimates from the shapes, not measurements: each
//! part counts what the step allocates at its widest (a piece's recompute and
//! backward through one layer, the head and loss over one chunk). The budget
//! itself is enforced by the driver ([`streamer_core::DeviceCap`]), so an
//! estimate that is too low fails with an out-of-memory error, never by
//! using more than the budget.
use crate::config::LlamaConfig;
use crate::host_plan::{HostPlan, TrainSetup};
use crate::step_rates::StepRates;
use crate::step_shape::StepShape;
use candle_core::{bail, DType, Result};
use streamer_autograd::{ActivationPolicy, OptimizerPlace, StateDtype};

/// Bytes held by the CUDA context, cuBLAS workspaces and the allocator's
/// slack, whatever the model.
pub(crate) const RUNTIME_BYTES: usize = 1 << 30;

/// The settings a device plan decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepSettings {
    /// Where AdamW runs (its moments on the device with `Device`).
    pub place: OptimizerPlace,
    /// AdamW's moments' element type.
    pub state: StateDtype,
    /// Block inputs kept in host memory between forward and backward
    /// (`ActivationPolicy::OffloadInputs`) instead of on the device
    /// (`ActivationPolicy::Recompute`).
    pub offload_inputs: bool,
    /// Sequences a layer runs over at a time (all of a step's sequences pass
    /// through a layer in one visit of its weights).
    pub piece_rows: usize,
    /// Decoder layers resident at once (the slot window).
    pub window: usize,
    /// Device bytes for the activations of the last layers, kept from the
    /// forward for the backward instead of recomputed
    /// (`ActivationPolicy::Keep`); 0 recomputes every layer. Only with the
    /// inputs kept on the device.
    pub keep_bytes: usize,
}

impl StepSettings {
    /// The streamed layers' activation policy these settings stand for.
    pub fn activation_policy(&self) -> ActivationPolicy {
        if self.offload_inputs {
            ActivationPolicy::OffloadInputs
        } else if self.keep_bytes > 0 {
            ActivationPolicy::Keep {
                device_bytes: self.keep_bytes,
            }
        } else {
            ActivationPolicy::Recompute
        }
    }
}

/// A step's device bytes, by part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevicePlan {
    /// The settings this plan is for.
    pub settings: StepSettings,
    /// Slots: each holds a layer in the compute dtype and its f32 masters
    /// staged for the cast.
    pub slots: usize,
    /// Embedding, final norm and head in the compute dtype, and their f32
    /// gradients.
    pub outer: usize,
    /// Device optimizer: the moments of every weight, and the f32 masters of
    /// the embedding, norm and head.
    pub optimizer: usize,
    /// Every layer's input, saved for its recompute (none when offloaded).
    pub saved_inputs: usize,
    /// Tensors of the whole step's rows: the embedding's output, the final
    /// hidden state and their gradients, a layer's input and output, and
    /// with offloaded inputs the next one brought back ahead of its backward.
    pub step_rows: usize,
    /// One piece's recompute and backward through one layer, and the f32
    /// weight gradients of two layers in flight.
    pub layer_work: usize,
    /// One chunk of the head and the loss (its logits, their f32 softmax and
    /// gradient).
    pub loss_chunk: usize,
    /// Activations kept for the backward (the settings' `keep_bytes`).
    pub kept: usize,
    /// CUDA context, library workspaces, allocator slack.
    pub runtime: usize,
}

impl DevicePlan {
    /// The estimate for `cfg` stepped with `settings` at `shape`.
    pub fn estimate(cfg: &LlamaConfig, shape: StepShape, settings: StepSettings) -> Self {
        let b = shape.dtype.size_in_bytes();
        let h = cfg.hidden_size;
        let layer = cfg.layer_params();
        let outer = cfg.outer_params();
        let tokens = shape.rows * shape.seq;
        let piece = settings.piece_rows.min(shape.rows) * shape.seq;
        let per_token = layer_work_per_token(cfg, shape.dtype);
        // The loss never runs over more rows than the step has.
        let chunk = crate::cross_entropy::linear_cross_entropy_chunk(cfg.vocab_size, shape.dtype)
            .min(tokens);
        Self {
            settings,
            slots: settings.window * layer * (b + 4),
            outer: outer * (b + 4),
            optimizer: match settings.place {
                OptimizerPlace::Device => {
                    2 * settings.state.size_in_bytes() * cfg.num_params() + 4 * outer
                }
                OptimizerPlace::Host => 0,
            },
            saved_inputs: if settings.offload_inputs {
                0
            } else {
                cfg.num_hidden_layers * tokens * h * b
            },
            step_rows: (6 + usize::from(settings.offload_inputs)) * tokens * h * b,
            layer_work: piece * per_token + 2 * layer * 4,
            loss_chunk: 2 * chunk * cfg.vocab_size * 4,
            kept: settings.keep_bytes,
            runtime: RUNTIME_BYTES,
        }
    }

    /// Everything.
    pub fn total(&self) -> usize {
        self.slots
            + self.outer
            + self.optimizer
            + self.saved_inputs
            + self.step_rows
            + self.layer_work
            + self.loss_chunk
            + self.kept
            + self.runtime
    }

    /// The fastest settings whose step fits `budget` bytes of a device of
    /// `device_total` bytes, with the default choices ([`PlanChoices`]) and
    /// no host limit: see [`Self::choose_among`].
    pub fn choose(cfg: &LlamaConfig, shape: StepShape, budget: (usize, usize)) -> Result<Self> {
        let limits = PlanLimits {
            device_budget: budget.0,
            device_total: budget.1,
            host_available: None,
        };
        Self::choose_among(cfg, shape, limits, PlanChoices::default())
    }

    /// The fastest settings among `choices` whose step fits the device
    /// budget and whose host plan ([`HostPlan`]) fits the host: f32 moments
    /// before bf16 (f32 is exact; bf16 halves the moments where f32 does not
    /// fit), the device optimizer before the host one (no gradients or
    /// masters cross PCIe for the step), inputs kept on the device before
    /// offloaded, then the largest pieces (fewer, larger GEMMs). Pieces
    /// divide the step's sequences. With the inputs on the device, what the
    /// budget has left keeps the last layers' activations (no recompute for
    /// them). A budget larger than the device, one smaller than the smallest
    /// plan (host optimizer, offloaded inputs, one sequence at a time, one
    /// layer resident), or a host too small for every plan the device holds
    /// is an error naming the numbers.
    pub fn choose_among(
        cfg: &LlamaConfig,
        shape: StepShape,
        limits: PlanLimits,
        choices: PlanChoices,
    ) -> Result<Self> {
        limits.check(shape)?;
        let mut host_refusal = None;
        for settings in choices.candidates(cfg, shape) {
            let plan = Self::estimate(cfg, shape, settings);
            if plan.total() > limits.device_budget {
                continue;
            }
            let host = host_plan(cfg, shape, &settings);
            match limits.host_available.map(|a| host.check_fits(a)) {
                Some(Err(e)) => host_refusal = host_refusal.or(Some(e)),
                _ => return Ok(plan.keeping(limits.device_budget - plan.total(), cfg, shape)),
            }
        }
        if let Some(e) = host_refusal {
            bail!("no plan that fits the device budget fits the host: {e}");
        }
        Err(Self::too_small(cfg, shape, &limits, &choices))
    }

    /// The error of a device budget under the smallest plan of `choices`.
    fn too_small(
        cfg: &LlamaConfig,
        shape: StepShape,
        limits: &PlanLimits,
        choices: &PlanChoices,
    ) -> candle_core::Error {
        let (Some(&place), Some(&state)) = (choices.places.last(), choices.states.last()) else {
            return candle_core::Error::Msg(
                "a device plan needs at least one optimizer place and one moment dtype".into(),
            );
        };
        let smallest = Self::estimate(
            cfg,
            shape,
            StepSettings {
                place,
                state,
                offload_inputs: true,
                piece_rows: 1,
                window: 1,
                keep_bytes: 0,
            },
        );
        streamer_device::Error::OutOfMemory {
            needed: smallest.total(),
            free: limits.device_budget,
            what: format!(
                "device budget {:.1} GiB is below the smallest plan for {} x {} tokens a step: \
                 {smallest}",
                gib(limits.device_budget),
                shape.rows,
                shape.seq
            ),
        }
        .into()
    }
}

/// What a plan must fit: the device budget, the device, and the host memory
/// available (`None`: not checked).
#[derive(Clone, Copy, Debug)]
pub struct PlanLimits {
    /// Bytes the step may hold on the device.
    pub device_budget: usize,
    /// The device's total bytes.
    pub device_total: usize,
    /// Host bytes available for the plan's masters, moments, gradients and
    /// offloaded activations.
    pub host_available: Option<usize>,
}

impl PlanLimits {
    /// Refuses a budget over the device and an empty step.
    fn check(&self, shape: StepShape) -> Result<()> {
        if self.device_budget > self.device_total {
            return Err(streamer_device::Error::OutOfMemory {
                needed: self.device_budget,
                free: self.device_total,
                what: format!(
                    "device budget {:.1} GiB is larger than the device ({:.1} GiB)",
                    gib(self.device_budget),
                    gib(self.device_total)
                ),
            }
            .into());
        }
        if shape.rows == 0 || shape.seq == 0 {
            bail!("a step of {} x {} tokens", shape.rows, shape.seq);
        }
        Ok(())
    }
}

/// What the planner may pick from, each list in order of preference.
#[derive(Clone, Copy, Debug)]
pub struct PlanChoices<'a> {
    /// Where AdamW may run.
    pub places: &'a [OptimizerPlace],
    /// AdamW's moments' element types.
    pub states: &'a [StateDtype],
}

impl Default for PlanChoices<'_> {
    /// Either place, f32 moments where they fit and bf16 where not.
    fn default() -> Self {
        Self {
            places: &[OptimizerPlace::Device, OptimizerPlace::Host],
            states: &[StateDtype::F32, StateDtype::Bf16],
        }
    }
}

impl PlanChoices<'_> {
    /// Every setting the planner tries, fastest first.
    fn candidates(&self, cfg: &LlamaConfig, shape: StepShape) -> Vec<StepSettings> {
        let pieces: Vec<usize> = (1..=shape.rows)
            .rev()
            .filter(|p| shape.rows % p == 0)
            .collect();
        let mut out = Vec::new();
        for &state in self.states {
            for &place in self.places {
                for offload_inputs in [false, true] {
                    out.extend(pieces.iter().map(|&piece_rows| StepSettings {
                        place,
                        state,
                        offload_inputs,
                        piece_rows,
                        window: 2.min(cfg.num_hidden_layers),
                        keep_bytes: 0,
                    }));
                }
            }
        }
        out
    }
}

/// The host side of a plan on a GPU: f32 masters, the settings' optimizer
/// and moments, offloaded inputs for the whole step.
pub fn host_plan(cfg: &LlamaConfig, shape: StepShape, s: &StepSettings) -> HostPlan {
    HostPlan::for_training(
        cfg,
        &TrainSetup {
            master_dtype: DType::F32,
            place: s.place,
            state: s.state,
            cuda: true,
            offload_inputs: s
                .offload_inputs
                .then_some((shape.rows, shape.seq, shape.dtype)),
        },
    )
}

impl DevicePlan {
    /// This plan with `room` bytes more for kept activations, when its inputs
    /// stay on the device and the room holds at least one layer's.
    fn keeping(mut self, room: usize, cfg: &LlamaConfig, shape: StepShape) -> Self {
        if !self.settings.offload_inputs && room >= kept_layer_bytes(cfg, shape) {
            self.settings.keep_bytes = room;
            self.kept = room;
        }
        self
    }

    /// The step this plan is expected to take on a device measured as
    /// `rates`: the compute of every piece through every layer (a forward,
    /// a backward, and for layers not kept a recompute) and the head, against
    /// the copies of the masters (up twice, gradients down once, in f32) and
    /// of offloaded inputs, which overlap it. The host optimizer is taken to
    /// overlap the backward.
    pub fn expect(&self, cfg: &LlamaConfig, shape: StepShape, rates: &StepRates) -> Expectation {
        let s = &self.settings;
        let layers = cfg.num_hidden_layers;
        let pieces = shape.rows.div_ceil(s.piece_rows) as f64;
        // Rates were measured over `rates.piece_rows` sequences: scale to ours.
        let scale = s.piece_rows as f64 / rates.piece_rows.max(1) as f64;
        let (f, b) = (
            rates.layer_forward_s * scale,
            rates.layer_backward_s * scale,
        );
        let kept = (s.keep_bytes / kept_layer_bytes(cfg, shape).max(1)).min(layers);
        let tokens = (shape.rows * shape.seq) as f64;
        let head = rates.head_s * tokens / (rates.piece_rows * shape.seq).max(1) as f64;
        let compute_s = pieces * (layers as f64 * (f + b) + (layers - kept) as f64 * f) + head;
        let masters = (4 * cfg.layer_params() * layers) as f64;
        let offloaded = if s.offload_inputs {
            tokens * (layers * cfg.hidden_size * shape.dtype.size_in_bytes()) as f64
        } else {
            0.0
        };
        let h2d_s = (2.0 * masters + offloaded) / rates.h2d_bytes_per_s;
        let d2h_s = (masters + offloaded) / rates.d2h_bytes_per_s;
        Expectation {
            compute_s,
            h2d_s,
            d2h_s,
            tokens_per_s: tokens / compute_s.max(h2d_s).max(d2h_s),
        }
    }
}

/// Device bytes per token of one layer's recompute and backward: the MLP's
/// gate, up, activation and their gradients, the attention's projections,
/// output, statistics and their gradients, the input, output and input
/// gradient.
pub(crate) fn layer_work_per_token(cfg: &LlamaConfig, dtype: DType) -> usize {
    let b = dtype.size_in_bytes();
    b * (6 * cfg.intermediate_size + 13 * cfg.hidden_size) + 8 * cfg.num_attention_heads
}

/// One layer's kept activations for a whole step: what the decoder layer's
/// `ManualBackward::saved_bytes` counts (its inputs, the normed inputs, the
/// attention's q, k, v and output, the MLP's gate and up, the
/// softmax statistics), without adapters.
pub(crate) fn kept_layer_bytes(cfg: &LlamaConfig, shape: StepShape) -> usize {
    let rows = shape.rows * shape.seq;
    let (q, kv) = (
        cfg.num_attention_heads * cfg.head_dim(),
        cfg.num_kv_heads() * cfg.head_dim(),
    );
    let per_row = crate::decoder_backward::kept_elems_per_row(
        cfg.hidden_size,
        (q, kv),
        cfg.intermediate_size,
        cfg.qk_norm(),
    );
    rows * per_row * shape.dtype.size_in_bytes() + rows * cfg.num_attention_heads * 4
}

/// A plan's expected step (see [`DevicePlan::expect`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Expectation {
    /// Seconds of GPU compute.
    pub compute_s: f64,
    /// Seconds of host-to-device copies.
    pub h2d_s: f64,
    /// Seconds of device-to-host copies.
    pub d2h_s: f64,
    /// Tokens a second at the slowest of the three.
    pub tokens_per_s: f64,
}

impl std::fmt::Display for Expectation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let bound = if self.compute_s >= self.h2d_s.max(self.d2h_s) {
            "compute"
        } else {
            "PCIe"
        };
        write!(
            f,
            "about {:.0} tokens/s ({bound}-bound: {:.2} s of compute, {:.2} s of copies up, \
             {:.2} s down a step)",
            self.tokens_per_s, self.compute_s, self.h2d_s, self.d2h_s
        )
    }
}

/// Bytes in GiB, for the plans' messages.
pub(crate) fn gib(b: usize) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

impl std::fmt::Display for DevicePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.settings;
        write!(
            f,
            "{:.1} GiB of device memory (layer slots {:.1}, embedding and head {:.1}, \
             optimizer {:.1}, saved layer inputs {:.1}, whole-step rows {:.1}, one layer's \
             work {:.1}, loss chunk {:.1}, kept activations {:.1}, runtime {:.1}) with the {:?} \
             optimizer ({:?} moments), inputs {}, {} sequences a piece, {} layers resident",
            gib(self.total()),
            gib(self.slots),
            gib(self.outer),
            gib(self.optimizer),
            gib(self.saved_inputs),
            gib(self.step_rows),
            gib(self.layer_work),
            gib(self.loss_chunk),
            gib(self.kept),
            gib(self.runtime),
            s.place,
            s.state,
            if s.offload_inputs {
                "offloaded to the host"
            } else {
                "kept on the device"
            },
            s.piece_rows,
            s.window
        )
    }
}
