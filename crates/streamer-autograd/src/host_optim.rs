//! `HostOptimizer`: the one skeleton of the host (CPU) optimizers. It holds
//! the parameters, their state buffers (f32 or bf16), the step counters and
//! the names params are saved under; checks every gradient before any
//! parameter changes (a failed step changes nothing); steps subsets for the
//! overlapped step; and saves and loads its state in one format ([`crate::optim_state`]). What
//! differs between optimizers is an [`UpdateRule`]: hyper-parameters, which
//! buffers they need, and the fused kernel ([`crate::CpuAdamW`] is
//! `HostOptimizer<AdamWUpdate>`, [`crate::CpuSgd`] is
//! `HostOptimizer<SgdUpdate>`).

use candle_core::backprop::GradStore;
use candle_core::{bail, Result, Tensor, Var};
use candle_nn::Optimizer;
use rayon::prelude::*;

use crate::host_update::{check_state_finite, check_vars, grads_for, prepare_grads};
use crate::optim_state::{self, SavedState, StateWriter};
use crate::state::{Noise, StateBuf, StateDtype};
use std::borrow::Cow;

/// Each rule implements it beside its definition (`adamw`, `sgd`), so that
/// this skeleton does not depend on the rules built on it.
pub(crate) mod sealed {
    pub trait Sealed {}
}

/// One state buffer of an update rule: the prefix its saved tensors carry
/// (`<prefix>.<param name>`) and its name in error messages.
pub type BufferName = (&'static str, &'static str);

/// An update rule of a [`HostOptimizer`]: its hyper-parameters, the f32
/// buffers it keeps per parameter and its fused in-place kernel. Implemented
/// by [`crate::AdamWUpdate`] and [`crate::SgdUpdate`] (sealed).
pub trait UpdateRule: sealed::Sealed + Send + Sync + 'static {
    /// The hyper-parameters.
    type Params: Clone + std::fmt::Debug + Send + Sync;
    /// The optimizer's name in errors, and the `kind` of its saved state.
    const KIND: &'static str;
    /// Every buffer any hyper-parameters of this rule can use.
    const ALL_BUFFERS: &'static [BufferName];
    /// Refuses hyper-parameters that would write non-finite values into the
    /// parameters, naming the value.
    fn check(p: &Self::Params) -> Result<()>;
    /// The buffers `p` needs per parameter (a sub-list of `ALL_BUFFERS`).
    fn buffers(p: &Self::Params) -> &'static [BufferName];
    /// The learning rate.
    fn lr(p: &Self::Params) -> f64;
    /// Sets the learning rate.
    fn set_lr(p: &mut Self::Params, lr: f64);
    /// The hyper-parameters as saved metadata: `(key, value)`, floats as
    /// numbers (written so they read back exactly), flags as booleans.
    fn to_meta(p: &Self::Params) -> Vec<(&'static str, MetaValue)>;
    /// Reads the hyper-parameters back: `get(key, flag)` returns the value
    /// saved under `key` (a boolean where `flag`), or an error naming it.
    fn from_meta(get: &dyn Fn(&str, bool) -> Result<MetaValue>) -> Result<Self::Params>;
    /// Updates one parameter in place with its f32 CPU gradient (see
    /// [`ParamStep`]).
    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn update(p: &Self::Params, s: ParamStep<'_>) -> Result<()>;
}

/// One parameter's update at step `t`: `bufs` are its buffers in
/// [`UpdateRule::buffers`] order, `first` says it was never stepped before,
/// `noise` seeds bf16 state's rounding.
pub(crate) struct ParamStep<'a> {
    pub(crate) t: usize,
    pub(crate) var: &'a Var,
    pub(crate) grad: &'a Tensor,
    pub(crate) bufs: &'a mut [StateBuf],
    pub(crate) first: bool,
    pub(crate) noise: Noise,
}

/// A saved hyper-parameter.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MetaValue {
    /// A finite number.
    F64(f64),
    /// A flag.
    Bool(bool),
}

impl MetaValue {
    /// The number, or an error naming `key`.
    pub fn f64(self, key: &str) -> Result<f64> {
        match self {
            Self::F64(v) => Ok(v),
            Self::Bool(b) => bail!("optimizer state: metadata {key:?} = {b} is not a number"),
        }
    }

    /// The flag, or an error naming `key`.
    pub fn bool(self, key: &str) -> Result<bool> {
        match self {
            Self::Bool(b) => Ok(b),
            Self::F64(v) => bail!("optimizer state: metadata {key:?} = {v} is not a bool"),
        }
    }
}

/// A host optimizer: parameters that are contiguous CPU tensors of f32, bf16
/// or f16, updated in place by the rule `R` (one fused, vectorised pass per
/// parameter, rayon across parameters and 64K-element chunks), with f32
/// state whatever the parameter dtype (or bf16:
/// [`HostOptimizer::with_state_dtype`]). Gradients may be on any device and
/// of any float dtype (converted to f32 on the CPU first); a parameter
/// without a gradient is skipped, like candle-nn.
///
/// # Stepping a subset (overlapped step)
/// [`HostOptimizer::step`] is [`HostOptimizer::begin_step`] followed by
/// [`HostOptimizer::step_params`] on every parameter. To step a block's
/// parameters as soon as its gradients land, call `begin_step()` once per
/// optimizer step, then `step_params`/`step_tensors` on disjoint subsets;
/// stepping a parameter twice within one step is an error.
#[derive(Debug)]
pub struct HostOptimizer<R: UpdateRule> {
    vars: Vec<Var>,
    /// Per param, its buffers in `R::buffers(&params)` order.
    bufs: Vec<Vec<StateBuf>>,
    /// The buffers' element type.
    state_dtype: StateDtype,
    /// The step at which each param was last updated (0: never).
    last_step: Vec<usize>,
    names: Vec<String>,
    params: R::Params,
    t: usize,
}

impl<R: UpdateRule> HostOptimizer<R> {
    /// Creates the optimizer over `vars` (contiguous CPU tensors of f32, bf16
    /// or f16) with zeroed f32 state. Params are named `"0"`, `"1"`, ... in
    /// saved state unless [`HostOptimizer::set_param_names`] says otherwise.
    pub fn new(vars: Vec<Var>, params: R::Params) -> Result<Self> {
        Self::with_state_dtype(vars, params, StateDtype::F32)
    }

    /// [`HostOptimizer::new`] with state buffers of `dtype`: bf16 halves
    /// their memory, stored with stochastic rounding ([`StateDtype`]); the
    /// update math is f32 either way. State is saved in its own dtype, and
    /// a file of either dtype loads into either.
    pub fn with_state_dtype(vars: Vec<Var>, params: R::Params, dtype: StateDtype) -> Result<Self> {
        check_vars(R::KIND, &vars)?;
        R::check(&params)?;
        let n = vars.len();
        let mut s = Self {
            vars,
            bufs: Vec::new(),
            state_dtype: dtype,
            last_step: vec![0; n],
            names: (0..n).map(|i| i.to_string()).collect(),
            params,
            t: 0,
        };
        s.alloc_bufs();
        Ok(s)
    }

    fn alloc_bufs(&mut self) {
        let k = R::buffers(&self.params).len();
        let dtype = self.state_dtype;
        self.bufs = self
            .vars
            .iter()
            // One allocation each: `vec![buf; k]` would clone (write) them.
            .map(|v| {
                (0..k)
                    .map(|_| StateBuf::zeros(dtype, v.elem_count()))
                    .collect()
            })
            .collect();
    }

    /// The element type of the state buffers.
    pub fn state_dtype(&self) -> StateDtype {
        self.state_dtype
    }

    /// Bytes of state buffers per parameter element (0 for plain SGD,
    /// 8 for AdamW in f32, 4 in bf16).
    pub fn state_bytes_per_param(&self) -> usize {
        R::buffers(&self.params).len() * self.state_dtype.size_in_bytes()
    }

    /// The parameters, in the order indices refer to.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The hyper-parameters.
    pub fn params(&self) -> &R::Params {
        &self.params
    }

    /// Replaces the hyper-parameters (the bias correction and the like take
    /// them at the next step), after checking them. Hyper-parameters that need
    /// other buffers (momentum turned on or off) reset the state.
    pub fn set_params(&mut self, params: R::Params) -> Result<()> {
        R::check(&params)?;
        let reset = R::buffers(&params) != R::buffers(&self.params);
        self.params = params;
        if reset {
            self.alloc_bufs();
            self.last_step.iter_mut().for_each(|s| *s = 0);
        }
        Ok(())
    }

    /// The number of steps begun so far (the `t` of a bias correction).
    pub fn step_count(&self) -> usize {
        self.t
    }

    /// Buffer `k` (in the rule's order) of param `idx`, in f32.
    pub(crate) fn buffer(&self, idx: usize, k: usize) -> Option<Cow<'_, [f32]>> {
        self.bufs.get(idx)?.get(k).map(StateBuf::to_f32)
    }

    /// The names params are saved under (default: their indices).
    pub fn param_names(&self) -> &[String] {
        &self.names
    }

    /// Sets the names params are saved under: one per param, unique.
    pub fn set_param_names(&mut self, names: Vec<String>) -> Result<()> {
        optim_state::check_names(R::KIND, &names, self.vars.len())?;
        self.names = names;
        Ok(())
    }

    /// Starts a new optimizer step: increments the step count. Follow with
    /// [`HostOptimizer::step_params`] or [`HostOptimizer::step_tensors`].
    pub fn begin_step(&mut self) {
        self.t += 1;
    }

    /// [`HostOptimizer::begin_step`], then updates every param that has a
    /// gradient in `grads`. All gradients are validated before any param
    /// changes; on error nothing changed, the step count included.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        R::check(&self.params)?;
        let updates = grads_for(R::KIND, &self.vars, grads, None)?;
        // Validate at the next step count, then keep it only on success.
        let t = self.t + 1;
        let prepared = prepare_grads(
            R::KIND,
            &self.vars,
            &self.names,
            &self.last_step,
            t,
            &updates,
        )?;
        self.t = t;
        self.apply(prepared)
    }

    /// Updates the params `which` (indices into [`HostOptimizer::vars`]) that
    /// have a gradient in `grads`, within the step opened by
    /// [`HostOptimizer::begin_step`]. All are validated before any changes.
    pub fn step_params(&mut self, grads: &GradStore, which: &[usize]) -> Result<()> {
        let updates = grads_for(R::KIND, &self.vars, grads, Some(which))?;
        self.step_tensors(&updates)
    }

    /// Updates param `idx` with gradient `grad` for each `(idx, grad)`, within
    /// the step opened by [`HostOptimizer::begin_step`]. Shapes, indices and
    /// conversions are all checked before any param changes; each param may
    /// be stepped once per step.
    pub fn step_tensors(&mut self, updates: &[(usize, &Tensor)]) -> Result<()> {
        R::check(&self.params)?;
        let prepared = prepare_grads(
            R::KIND,
            &self.vars,
            &self.names,
            &self.last_step,
            self.t,
            updates,
        )?;
        self.apply(prepared)
    }

    /// Checks that every parameter and every state buffer is finite (one read
    /// pass, no copy); the error names the first offending param, buffer and
    /// element. Call before saving.
    pub fn check_finite(&self) -> Result<()> {
        let labels = R::buffers(&self.params);
        let bufs = self.bufs.iter().enumerate().flat_map(|(i, bs)| {
            bs.iter()
                .zip(labels)
                .map(move |(b, (_, label))| (i, *label, b))
        });
        check_state_finite(R::KIND, &self.vars, &self.names, bufs)
    }

    fn apply(&mut self, grads: Vec<Option<Tensor>>) -> Result<()> {
        let (p, t) = (&self.params, self.t);
        self.vars
            .par_iter()
            .zip(self.bufs.par_iter_mut())
            .zip(self.last_step.par_iter_mut())
            .zip(grads.par_iter())
            .enumerate()
            .try_for_each(|(i, (((var, bufs), last), grad))| {
                let Some(grad) = grad else { return Ok(()) };
                let first = *last == 0;
                let noise = Noise::new(t, i);
                R::update(
                    p,
                    ParamStep {
                        t,
                        var,
                        grad,
                        bufs,
                        first,
                        noise,
                    },
                )?;
                *last = t;
                Ok(())
            })
    }

    /// Saves the state buffers (`<buffer>.<name>`: `m.` and `v.` for AdamW,
    /// `momentum.` for SGD with momentum), the per-param last step, the step
    /// count and the hyper-parameters to a safetensors file (written to a
    /// temporary file, fsynced, then renamed).
    pub fn save<P: AsRef<std::path::Path>>(&self, path: P) -> Result<()> {
        let mut w = StateWriter::new(R::KIND, self.t, &self.last_step);
        for (key, value) in R::to_meta(&self.params) {
            match value {
                MetaValue::F64(v) => w.meta(key, v),
                MetaValue::Bool(b) => w.meta_str(key, b.to_string()),
            }
        }
        let labels = R::buffers(&self.params);
        for (k, (prefix, _)) in labels.iter().enumerate() {
            for ((name, var), bufs) in self.names.iter().zip(&self.vars).zip(&self.bufs) {
                w.state(format!("{prefix}.{name}"), var.dims(), &bufs[k]);
            }
        }
        w.write(path.as_ref())
    }

    /// Loads state written by [`HostOptimizer::save`]: buffers, step count and
    /// hyper-parameters (call [`Optimizer::set_learning_rate`] afterwards to
    /// override the learning rate). The file is checked completely (kind,
    /// param count, hyper-parameters, every tensor's presence, dtype and
    /// shape, no buffer the hyper-parameters do not use) before anything
    /// changes; errors name the offending tensor or value.
    pub fn load<P: AsRef<std::path::Path>>(&mut self, path: P) -> Result<()> {
        let saved = SavedState::read(path.as_ref(), R::KIND, self.vars.len())?;
        let params = saved.blame(R::from_meta(&|key, flag| {
            Ok(if flag {
                match saved.meta_str(key)?.as_str() {
                    "true" => MetaValue::Bool(true),
                    "false" => MetaValue::Bool(false),
                    other => {
                        return Err(saved.bad(format!(
                            "optimizer state: metadata {key:?} = {other:?} is not a bool"
                        )))
                    }
                }
            } else {
                MetaValue::F64(saved.meta_f64(key)?)
            })
        }))?;
        saved.blame(R::check(&params))?;
        let labels = R::buffers(&params);
        let st = saved.tensors()?;
        for (prefix, _) in R::ALL_BUFFERS.iter().filter(|b| !labels.contains(b)) {
            for name in &self.names {
                let name = format!("{prefix}.{name}");
                if SavedState::has_tensor(&st, &name) {
                    return Err(saved.bad(format!(
                        "optimizer state: tensor {name:?} present but {params:?} use no {prefix} buffer"
                    )));
                }
            }
        }
        let mut bufs = Vec::with_capacity(self.vars.len());
        let dtype = self.state_dtype;
        for (name, var) in self.names.iter().zip(&self.vars) {
            let read = |(prefix, _): &BufferName| {
                saved.state_tensor(&st, &format!("{prefix}.{name}"), var.dims(), dtype)
            };
            bufs.push(labels.iter().map(read).collect::<Result<Vec<_>>>()?);
        }
        drop(st);
        self.bufs = bufs;
        self.last_step = saved.last_step;
        self.t = saved.step;
        self.params = params;
        Ok(())
    }
}

impl<R: UpdateRule> Optimizer for HostOptimizer<R> {
    type Config = R::Params;

    fn new(vars: Vec<Var>, params: R::Params) -> Result<Self> {
        HostOptimizer::new(vars, params)
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        HostOptimizer::step(self, grads)
    }

    fn learning_rate(&self) -> f64 {
        R::lr(&self.params)
    }

    fn set_learning_rate(&mut self, lr: f64) {
        R::set_lr(&mut self.params, lr)
    }
}
