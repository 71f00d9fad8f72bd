//! What a streamed full fine-tune, or a LoRA run on a streamed frozen base,
//! holds in host memory, said before anything is loaded or page-locked, and
//! refused when the host does not have it.
use crate::config::LlamaConfig;
use candle_core::{DType, Result};
use streamer_autograd::{OptimizerPlace, StateDtype};

/// The settings of a streamed full fine-tune that decide its host memory.
#[derive(Clone, Copy, Debug)]
pub struct TrainSetup {
    /// The host masters' dtype (f32 for full fine-tuning).
    pub master_dtype: DType,
    /// Where AdamW runs.
    pub place: OptimizerPlace,
    /// AdamW's moments (host optimizer).
    pub state: StateDtype,
    /// Training on a GPU (with [`OptimizerPlace::Device`] the embedding,
    /// norm and head masters then live on the device).
    pub cuda: bool,
    /// Block inputs offloaded to the host (`ActivationPolicy::OffloadInputs`):
    /// `(sequences a step, seq, compute dtype)`.
    pub offload_inputs: Option<(usize, usize, DType)>,
}

/// Host bytes of a streamed full fine-tune, by part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostPlan {
    /// The masters the optimizer updates.
    pub masters: usize,
    /// AdamW's first and second moments (host optimizer).
    pub moments: usize,
    /// f32 gradient buffers: page-locked per decoder-layer master, and the
    /// embedding, norm and head gradients brought to the host for the step
    /// (host optimizer; the device optimizer copies stepped masters back
    /// instead).
    pub gradients: usize,
    /// Offloaded block inputs.
    pub activations: usize,
}

impl HostPlan {
    /// The plan of training `cfg` as `setup` says.
    pub fn for_training(cfg: &LlamaConfig, setup: &TrainSetup) -> Self {
        let all = cfg.num_params();
        let outer = cfg.outer_params();
        let layers = all - outer;
        let host_opt = setup.place == OptimizerPlace::Host;
        let on_host = if !host_opt && setup.cuda { layers } else { all };
        let activations = offloaded_inputs(cfg, setup.offload_inputs);
        Self {
            masters: on_host * setup.master_dtype.size_in_bytes(),
            moments: if host_opt {
                2 * all * setup.state.size_in_bytes()
            } else {
                0
            },
            gradients: if host_opt { (layers + outer) * 4 } else { 0 },
            activations,
        }
    }

    /// The plan of LoRA adapters trained on a streamed frozen base of `cfg`:
    /// its masters (each decoder layer's `layer_bytes`, what it streams:
    /// packed bytes for a quantized base; the embedding, norm and head in
    /// `dtype`) and the block inputs offloaded (`(sequences a micro-batch,
    /// seq, dtype)`). The adapters, their gradients and AdamW live on the
    /// device.
    pub fn for_lora(
        cfg: &LlamaConfig,
        layer_bytes: usize,
        dtype: DType,
        offload_inputs: Option<(usize, usize, DType)>,
    ) -> Self {
        Self {
            masters: streamed_masters_bytes(cfg, layer_bytes, dtype),
            moments: 0,
            gradients: 0,
            activations: offloaded_inputs(cfg, offload_inputs),
        }
    }

    /// Everything.
    pub fn total(&self) -> usize {
        self.masters + self.moments + self.gradients + self.activations
    }

    /// Refuses a plan larger than `available` bytes, naming the parts and
    /// what would make it smaller.
    pub fn check_fits(&self, available: usize) -> Result<()> {
        if self.total() <= available {
            return Ok(());
        }
        // Only moments on the host have a smaller setting to suggest.
        let hint = match self.moments {
            0 => "",
            _ => {
                "; bf16 moments (--optimizer-state bf16) or the device optimizer \
                  (--optimizer device) need less"
            }
        };
        Err(streamer_device::Error::OutOfMemory {
            needed: self.total(),
            free: available,
            what: format!(
                "the host has {:.1} GiB available but training needs {self}{hint}",
                gib(available)
            ),
        }
        .into())
    }
}

/// Host bytes of a streamed frozen model's masters: each decoder layer's
/// `layer_bytes` (what it streams; packed bytes for a quantized base) and
/// the embedding, norm and head in `dtype`.
pub fn streamed_masters_bytes(cfg: &LlamaConfig, layer_bytes: usize, dtype: DType) -> usize {
    cfg.num_hidden_layers * layer_bytes + cfg.outer_params() * dtype.size_in_bytes()
}

/// Host bytes of the block inputs `ActivationPolicy::OffloadInputs` keeps,
/// for `(sequences, seq, dtype)`: every layer's but the first's (the
/// caller's, which stays where it is).
fn offloaded_inputs(cfg: &LlamaConfig, offload: Option<(usize, usize, DType)>) -> usize {
    offload.map_or(0, |(b, n, dt)| {
        cfg.num_hidden_layers.saturating_sub(1) * b * n * cfg.hidden_size * dt.size_in_bytes()
    })
}

fn gib(b: usize) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

impl std::fmt::Display for HostPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.1} GiB of host memory (masters {:.1}, AdamW moments {:.1}, gradients {:.1}, \
             offloaded activations {:.1})",
            gib(self.total()),
            gib(self.masters),
            gib(self.moments),
            gib(self.gradients),
            gib(self.activations)
        )
    }
}
