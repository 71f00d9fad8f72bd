//! `PlacedAdamW`: AdamW on the host ([`CpuAdamW`]) or with its moments on the
//! GPU ([`DeviceAdamW`]), chosen at run time (a trainer's `--optimizer` flag),
//! behind one set of calls. Both save the same state files.
use candle_core::backprop::GradStore;
use candle_core::{Device, Result, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};

use crate::{CpuAdamW, DeviceAdamW, StateDtype, TrainableSequential};

/// Where AdamW keeps its moments and does its arithmetic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerPlace {
    /// [`CpuAdamW`]: moments in host memory, the update on host threads
    /// (overlapped with a streamed backward by `backward_step`).
    Host,
    /// [`DeviceAdamW`]: moments on the GPU (8 bytes per parameter); streamed
    /// weights are stepped there while staged for backward and copied back
    /// instead of their gradients (`backward_step_device`).
    Device,
}

impl std::str::FromStr for OptimizerPlace {
    type Err = candle_core::Error;

    /// `host` or `device`; anything else is an error naming the value.
    fn from_str(s: &str) -> Result<Self> {
        let choices = [("host", Self::Host), ("device", Self::Device)];
        crate::state::parse_choice("optimizer placement", s, &choices)
    }
}

/// AdamW where [`OptimizerPlace`] says.
#[derive(Debug)]
pub enum PlacedAdamW {
    /// On the host.
    Host(CpuAdamW),
    /// Moments on the device.
    Device(DeviceAdamW),
}

impl PlacedAdamW {
    /// AdamW over `vars`; `device` is where [`OptimizerPlace::Device`] keeps
    /// the moments.
    pub fn new(
        vars: Vec<Var>,
        params: ParamsAdamW,
        place: OptimizerPlace,
        device: &Device,
    ) -> Result<Self> {
        Self::with_state_dtype(vars, params, place, device, StateDtype::F32)
    }

    /// [`PlacedAdamW::new`] with moments of `state` (bf16 rounds them
    /// stochastically, the same bits in either place).
    pub fn with_state_dtype(
        vars: Vec<Var>,
        params: ParamsAdamW,
        place: OptimizerPlace,
        device: &Device,
        state: StateDtype,
    ) -> Result<Self> {
        Ok(match place {
            OptimizerPlace::Host => Self::Host(CpuAdamW::with_state_dtype(vars, params, state)?),
            OptimizerPlace::Device => {
                Self::Device(DeviceAdamW::with_state_dtype(vars, params, device, state)?)
            }
        })
    }

    /// Where it runs.
    pub fn place(&self) -> OptimizerPlace {
        match self {
            Self::Host(_) => OptimizerPlace::Host,
            Self::Device(_) => OptimizerPlace::Device,
        }
    }

    /// Sets the names params are saved under.
    pub fn set_param_names(&mut self, names: Vec<String>) -> Result<()> {
        match self {
            Self::Host(o) => o.set_param_names(names),
            Self::Device(o) => o.set_param_names(names),
        }
    }

    /// Loads a state file (either optimizer's).
    pub fn load<P: AsRef<std::path::Path>>(&mut self, path: P) -> Result<()> {
        match self {
            Self::Host(o) => o.load(path),
            Self::Device(o) => o.load(path),
        }
    }

    /// Saves the state (`CpuAdamW`'s format either way).
    pub fn save<P: AsRef<std::path::Path>>(&self, path: P) -> Result<()> {
        match self {
            Self::Host(o) => o.save(path),
            Self::Device(o) => o.save(path),
        }
    }

    /// Steps begun so far.
    pub fn step_count(&self) -> usize {
        match self {
            Self::Host(o) => o.step_count(),
            Self::Device(o) => o.step_count(),
        }
    }

    /// Checks that every parameter and moment is finite (before a save).
    pub fn check_finite(&self) -> Result<()> {
        match self {
            Self::Host(o) => o.check_finite(),
            Self::Device(o) => o.check_finite(),
        }
    }

    /// Steps the params `which` within the step a `backward_step` opened.
    pub fn step_params(&mut self, grads: &GradStore, which: &[usize]) -> Result<()> {
        match self {
            Self::Host(o) => o.step_params(grads, which),
            Self::Device(o) => o.step_params(grads, which),
        }
    }

    /// Backward through `model` with its streamed weights stepped as their
    /// gradients complete: on a host thread (`backward_step`) or on the
    /// device (`backward_step_device`). Returns the other weights' gradients.
    pub fn backward_step(
        &mut self,
        model: &TrainableSequential,
        loss: &Tensor,
    ) -> Result<GradStore> {
        match self {
            Self::Host(o) => model.backward_step(loss, o),
            Self::Device(o) => model.backward_step_device(loss, o),
        }
    }
}

impl Optimizer for PlacedAdamW {
    type Config = ParamsAdamW;

    /// On the host (use [`PlacedAdamW::new`] to choose).
    fn new(vars: Vec<Var>, params: ParamsAdamW) -> Result<Self> {
        Ok(Self::Host(CpuAdamW::new(vars, params)?))
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        match self {
            Self::Host(o) => o.step(grads),
            Self::Device(o) => o.step(grads),
        }
    }

    fn learning_rate(&self) -> f64 {
        match self {
            Self::Host(o) => o.learning_rate(),
            Self::Device(o) => o.learning_rate(),
        }
    }

    fn set_learning_rate(&mut self, lr: f64) {
        match self {
            Self::Host(o) => o.set_learning_rate(lr),
            Self::Device(o) => o.set_learning_rate(lr),
        }
    }
}
