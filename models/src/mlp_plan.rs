//! What a streamed MLP training step (`train_mlp`: blocks of [`crate::FusedMlp`],
//! Linear(w, h), GELU, Linear(h, w), imitating a streamed teacher of the
//! same shapes) holds on the GPU, by part, and the fastest settings whose
//! step fits a device budget (`train_mlp --device-budget`).
//!
//! As for the decoder ([`crate::DevicePlan`]) the parts are upper estimates
//! from the shapes, and the budget itself is enforced by the driver
//! ([`streamer_core::DeviceCap`]): an estimate that is too low fails with an
//! out-of-memory error, never by using more than the budget.
use crate::device_plan::{gib, RUNTIME_BYTES};
use candle_core::{DType, Result};
use streamer_autograd::{ActivationPolicy, OptimizerPlace};

/// The shapes of an MLP training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlpShape {
    /// Blocks.
    pub blocks: usize,
    /// Block width w (the rows' width).
    pub width: usize,
    /// Block hidden size h.
    pub hidden: usize,
    /// Rows a step.
    pub rows: usize,
    /// The compute dtype (the masters are f32).
    pub dtype: DType,
}

impl MlpShape {
    /// Parameters of one block: two weights and two biases.
    pub fn block_params(&self) -> usize {
        2 * self.width * self.hidden + self.width + self.hidden
    }

    /// Bytes a block keeps for its backward when not recomputed: its input,
    /// pre-activation and activation (`FusedMlp::saved_bytes`).
    pub fn kept_block_bytes(&self) -> usize {
        self.rows * (self.width + 2 * self.hidden) * self.dtype.size_in_bytes()
    }
}

/// The settings an MLP plan decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlpSettings {
    /// Where AdamW runs (its f32 moments on the device with `Device`).
    pub place: OptimizerPlace,
    /// Blocks resident at once in the student's and the teacher's windows.
    pub window: usize,
    /// Device bytes for the last blocks' activations, kept from the forward
    /// for the backward instead of recomputed; 0 recomputes every block.
    pub keep_bytes: usize,
}

impl MlpSettings {
    /// The student's activation policy these settings stand for.
    pub fn activation_policy(&self) -> ActivationPolicy {
        match self.keep_bytes {
            0 => ActivationPolicy::Recompute,
            device_bytes => ActivationPolicy::Keep { device_bytes },
        }
    }
}

/// An MLP step's device bytes, by part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlpPlan {
    /// The settings this plan is for.
    pub settings: MlpSettings,
    /// The student's slots (a block in the compute dtype and its f32 masters
    /// staged for the cast) and the teacher's (compute dtype only).
    pub slots: usize,
    /// Device optimizer: f32 moments of every parameter.
    pub optimizer: usize,
    /// Every block's input, saved for its recompute.
    pub saved_inputs: usize,
    /// Tensors of the whole step: the input, the student's output and its
    /// gradient, the teacher's output and the loss in f32.
    pub step_rows: usize,
    /// One block's recompute and backward, and the f32 weight gradients of
    /// two blocks in flight.
    pub block_work: usize,
    /// Activations kept for the backward (the settings' `keep_bytes`).
    pub kept: usize,
    /// CUDA context, library workspaces, allocator slack.
    pub runtime: usize,
}

impl MlpPlan {
    /// The estimate for `shape` stepped with `settings`.
    pub fn estimate(shape: MlpShape, settings: MlpSettings) -> Self {
        let b = shape.dtype.size_in_bytes();
        let (w, h, rows) = (shape.width, shape.hidden, shape.rows);
        let p = shape.block_params();
        let window = settings.window.min(shape.blocks);
        Self {
            settings,
            slots: window * p * (b + 4) + window * p * b,
            optimizer: match settings.place {
                OptimizerPlace::Device => 8 * p * shape.blocks,
                OptimizerPlace::Host => 0,
            },
            saved_inputs: shape.blocks * rows * w * b,
            step_rows: rows * w * (3 * b + 3 * 4),
            // The recomputed x, z, h; the output gradient, dh, dz and dx;
            // two blocks' gradients in the compute dtype and in f32.
            block_work: shape.kept_block_bytes() + rows * (2 * w + 2 * h) * b + 2 * p * (b + 4),
            kept: settings.keep_bytes,
            runtime: RUNTIME_BYTES,
        }
    }

    /// Everything.
    pub fn total(&self) -> usize {
        self.slots
            + self.optimizer
            + self.saved_inputs
            + self.step_rows
            + self.block_work
            + self.kept
            + self.runtime
    }

    /// The fastest settings whose step fits `budget` bytes of a device of
    /// `device_total` bytes: the device optimizer before the host one (no
    /// gradients cross PCIe), two blocks resident before one (the next
    /// block's copy overlaps this one's compute); what the budget has left
    /// keeps the last blocks' activations when it holds one block's. A
    /// budget larger than the device, or one under the smallest plan (host
    /// optimizer, one block resident, every block recomputed), is an error
    /// naming the numbers.
    pub fn choose(shape: MlpShape, (budget, device_total): (usize, usize)) -> Result<Self> {
        if budget > device_total {
            return Err(streamer_device::Error::OutOfMemory {
                needed: budget,
                free: device_total,
                what: format!(
                    "device budget {:.2} GiB is larger than the device ({:.2} GiB)",
                    gib(budget),
                    gib(device_total)
                ),
            }
            .into());
        }
        if shape.blocks == 0 || shape.rows == 0 {
            candle_core::bail!(
                "an MLP step of {} blocks and {} rows",
                shape.blocks,
                shape.rows
            );
        }
        for place in [OptimizerPlace::Device, OptimizerPlace::Host] {
            for window in [2, 1] {
                let settings = MlpSettings {
                    place,
                    window,
                    keep_bytes: 0,
                };
                let plan = Self::estimate(shape, settings);
                if plan.total() <= budget {
                    return Ok(plan.keeping(budget - plan.total(), shape));
                }
            }
        }
        let smallest = Self::estimate(
            shape,
            MlpSettings {
                place: OptimizerPlace::Host,
                window: 1,
                keep_bytes: 0,
            },
        );
        Err(streamer_device::Error::OutOfMemory {
            needed: smallest.total(),
            free: budget,
            what: format!(
                "device budget {:.2} GiB is below the smallest plan for {} blocks of w{} h{} \
                 over {} rows a step: {smallest}",
                gib(budget),
                shape.blocks,
                shape.width,
                shape.hidden,
                shape.rows
            ),
        }
        .into())
    }

    /// This plan with `room` bytes more for kept activations, when the room
    /// holds at least one block's.
    fn keeping(mut self, room: usize, shape: MlpShape) -> Self {
        if room >= shape.kept_block_bytes() {
            self.settings.keep_bytes = room;
            self.kept = room;
        }
        self
    }
}

impl std::fmt::Display for MlpPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.2} GiB of device memory (block slots {:.2}, optimizer {:.2}, saved block inputs \
             {:.2}, whole-step rows {:.2}, one block's work {:.2}, kept activations {:.2}, \
             runtime {:.2}) with the {:?} optimizer, {} blocks resident",
            gib(self.total()),
            gib(self.slots),
            gib(self.optimizer),
            gib(self.saved_inputs),
            gib(self.step_rows),
            gib(self.block_work),
            gib(self.kept),
            gib(self.runtime),
            self.settings.place,
            self.settings.window
        )
    }
}
