//! `CpuSgd`: fused, multi-threaded SGD with momentum on host (CPU) parameters.

use candle_core::backprop::GradStore;
use candle_core::{bail, Result, Tensor, Var};
use candle_nn::Optimizer;
use rayon::prelude::*;

use crate::adamw::{
    check_state_finite, check_vars, grads_for, has_avx2, prepare_grads, HostUpdate, Master,
    MasterSlice, CHUNK,
};
use crate::optim_state::{self, SavedState, StateWriter};

/// Hyper-parameters of [`CpuSgd`], with PyTorch's `torch.optim.SGD` meaning.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamsSgd {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor `mu` (0: plain SGD, no momentum buffer).
    pub momentum: f64,
    /// Dampening of the gradient added to the momentum buffer.
    pub dampening: f64,
    /// L2 penalty added to the gradient (`g += wd * p`, coupled like PyTorch).
    pub weight_decay: f64,
    /// Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
    pub nesterov: bool,
}

impl Default for ParamsSgd {
    fn default() -> Self {
        Self {
            lr: 0.01,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

impl ParamsSgd {
    fn check(&self) -> Result<()> {
        for (name, v) in [
            ("learning rate", self.lr),
            ("momentum", self.momentum),
            ("dampening", self.dampening),
            ("weight_decay", self.weight_decay),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                bail!("CpuSgd: {name} must be finite and >= 0, got {v}")
            }
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            bail!(
                "CpuSgd: nesterov needs momentum > 0 and dampening == 0 (momentum {}, dampening {})",
                self.momentum,
                self.dampening
            )
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug)]
struct SgdConsts {
    lr: f32,
    momentum: f32,
    one_minus_dampening: f32,
    weight_decay: f32,
    use_wd: bool,
    nesterov: bool,
}

/// One fused SGD pass over a chunk, PyTorch's order of operations:
/// `d = g + wd*p; buf = first ? d : mu*buf + (1-damp)*d;
/// d = nesterov ? d + mu*buf : buf; p -= lr*d`. Without momentum and weight
/// decay this is candle-nn's `SGD` (`p - g*lr`) exactly.
#[inline(always)]
fn sgd_chunk_generic<P: Master>(
    p: &mut [P],
    g: &[f32],
    buf: Option<&mut [f32]>,
    first: bool,
    k: &SgdConsts,
) {
    let n = p.len();
    let g = &g[..n];
    match buf {
        None => {
            for i in 0..n {
                let pi = p[i].to_f32();
                let d = if k.use_wd {
                    g[i] + pi * k.weight_decay
                } else {
                    g[i]
                };
                p[i] = P::from_f32(pi - d * k.lr);
            }
        }
        Some(buf) => {
            let buf = &mut buf[..n];
            for i in 0..n {
                let pi = p[i].to_f32();
                let d = if k.use_wd {
                    g[i] + pi * k.weight_decay
                } else {
                    g[i]
                };
                let b = if first {
                    d
                } else {
                    buf[i] * k.momentum + d * k.one_minus_dampening
                };
                buf[i] = b;
                let d = if k.nesterov { d + b * k.momentum } else { b };
                p[i] = P::from_f32(pi - d * k.lr);
            }
        }
    }
}

/// # Safety
/// The CPU must support AVX2 (checked by the caller at run time).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sgd_chunk_avx2<P: Master>(
    p: &mut [P],
    g: &[f32],
    buf: Option<&mut [f32]>,
    first: bool,
    k: &SgdConsts,
) {
    sgd_chunk_generic(p, g, buf, first, k)
}

fn sgd_chunk<P: Master>(
    p: &mut [P],
    g: &[f32],
    buf: Option<&mut [f32]>,
    first: bool,
    k: &SgdConsts,
) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 support was just checked at run time; no FMA is enabled,
        // so the results are bit-identical to the generic build.
        unsafe { sgd_chunk_avx2(p, g, buf, first, k) };
        return;
    }
    sgd_chunk_generic(p, g, buf, first, k)
}

fn sgd_param<P: Master>(
    p: &mut [P],
    g: &[f32],
    buf: Option<&mut [f32]>,
    first: bool,
    k: &SgdConsts,
) {
    if p.len() <= CHUNK {
        sgd_chunk(p, g, buf, first, k);
        return;
    }
    match buf {
        None => p
            .par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .for_each(|(p, g)| sgd_chunk(p, g, None, first, k)),
        Some(buf) => p
            .par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .zip(buf.par_chunks_mut(CHUNK))
            .for_each(|((p, g), b)| sgd_chunk(p, g, Some(b), first, k)),
    }
}

/// SGD on host (CPU) parameters, with optional momentum, dampening, coupled
/// weight decay and Nesterov momentum (PyTorch's `torch.optim.SGD`): one fused
/// pass per parameter (read p, g, buf; write p, buf in place), vectorised,
/// with rayon across parameters and 64K-element chunks.
///
/// With `momentum == 0` and `weight_decay == 0` it equals candle-nn's `SGD`
/// exactly in f32. The momentum buffer (f32, whatever the parameter dtype) of
/// a param is set to its first gradient, as in PyTorch. Params, gradients,
/// missing gradients and the subset/overlapped step work as in
/// [`crate::CpuAdamW`]: [`CpuSgd::step`] = [`CpuSgd::begin_step`] +
/// [`CpuSgd::step_params`] over all params.
///
/// ```
/// use candle_core::{Device, Var};
/// use candle_nn::Optimizer;
/// use streamer_autograd::{CpuSgd, ParamsSgd};
/// let w = Var::new(&[1f32, 2.], &Device::Cpu)?;
/// let mut opt = CpuSgd::new(vec![w.clone()], ParamsSgd { lr: 0.1, momentum: 0.9, ..Default::default() })?;
/// let loss = w.as_tensor().sqr()?.sum_all()?;
/// opt.step(&loss.backward()?)?;
/// let w = w.as_tensor().to_vec1::<f32>()?; // p - lr * 2p
/// assert!((w[0] - 0.8).abs() < 1e-6 && (w[1] - 1.6).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug)]
pub struct CpuSgd {
    vars: Vec<Var>,
    /// Momentum buffers (empty vectors when `momentum == 0`).
    bufs: Vec<Vec<f32>>,
    last_step: Vec<usize>,
    names: Vec<String>,
    params: ParamsSgd,
    t: usize,
}

const SGD: &str = "CpuSgd";

impl CpuSgd {
    /// Creates the optimizer over `vars` (contiguous CPU tensors of f32, bf16
    /// or f16). Momentum buffers are allocated when `momentum != 0`.
    pub fn new(vars: Vec<Var>, params: ParamsSgd) -> Result<Self> {
        check_vars(SGD, &vars)?;
        params.check()?;
        let n = vars.len();
        let mut s = Self {
            vars,
            bufs: Vec::new(),
            last_step: vec![0; n],
            names: (0..n).map(|i| i.to_string()).collect(),
            params,
            t: 0,
        };
        s.alloc_bufs();
        Ok(s)
    }

    fn alloc_bufs(&mut self) {
        let with = self.params.momentum != 0.0;
        self.bufs = self
            .vars
            .iter()
            .map(|v| {
                if with {
                    vec![0f32; v.elem_count()]
                } else {
                    Vec::new()
                }
            })
            .collect();
    }

    /// The parameters, in the order indices refer to.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The hyper-parameters.
    pub fn params(&self) -> &ParamsSgd {
        &self.params
    }

    /// Replaces the hyper-parameters. Turning momentum on or off resets the
    /// momentum buffers.
    pub fn set_params(&mut self, params: ParamsSgd) -> Result<()> {
        params.check()?;
        let reset = (params.momentum != 0.0) != (self.params.momentum != 0.0);
        self.params = params;
        if reset {
            self.alloc_bufs();
            self.last_step.iter_mut().for_each(|s| *s = 0);
        }
        Ok(())
    }

    /// The number of steps begun so far.
    pub fn step_count(&self) -> usize {
        self.t
    }

    /// The momentum buffer of param `idx` (empty without momentum).
    pub fn momentum_buffer(&self, idx: usize) -> Option<&[f32]> {
        self.bufs.get(idx).map(|b| &b[..])
    }

    /// The names params are saved under (default: their indices).
    pub fn param_names(&self) -> &[String] {
        &self.names
    }

    /// Sets the names params are saved under: one per param, unique.
    pub fn set_param_names(&mut self, names: Vec<String>) -> Result<()> {
        optim_state::check_names(SGD, &names, self.vars.len())?;
        self.names = names;
        Ok(())
    }

    /// Starts a new optimizer step; follow with [`CpuSgd::step_params`] or
    /// [`CpuSgd::step_tensors`].
    pub fn begin_step(&mut self) {
        self.t += 1;
    }

    /// [`CpuSgd::begin_step`], then updates every param that has a gradient
    /// in `grads`. All gradients are validated before any param changes.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.params.check()?;
        let updates = grads_for(SGD, &self.vars, grads, None)?;
        self.t += 1;
        let prepared = prepare_grads(
            SGD,
            &self.vars,
            &self.names,
            &self.last_step,
            self.t,
            &updates,
        );
        match prepared {
            Ok(prepared) => self.apply(prepared),
            Err(e) => {
                self.t -= 1;
                Err(e)
            }
        }
    }

    /// Updates the params `which` that have a gradient in `grads`, within the
    /// step opened by [`CpuSgd::begin_step`].
    pub fn step_params(&mut self, grads: &GradStore, which: &[usize]) -> Result<()> {
        let updates = grads_for(SGD, &self.vars, grads, Some(which))?;
        self.step_tensors(&updates)
    }

    /// Updates param `idx` with `grad` for each `(idx, grad)`, within the step
    /// opened by [`CpuSgd::begin_step`]; everything is checked first.
    pub fn step_tensors(&mut self, updates: &[(usize, &Tensor)]) -> Result<()> {
        self.params.check()?;
        let prepared = prepare_grads(
            SGD,
            &self.vars,
            &self.names,
            &self.last_step,
            self.t,
            updates,
        )?;
        self.apply(prepared)
    }

    /// Checks that every parameter and momentum buffer is finite (one read
    /// pass, no copy); the error names the first offending param and element.
    /// Call before saving.
    pub fn check_finite(&self) -> Result<()> {
        let bufs = self
            .bufs
            .iter()
            .enumerate()
            .map(|(i, b)| (i, "momentum buffer", &b[..]));
        check_state_finite(SGD, &self.vars, &self.names, bufs)
    }

    fn apply(&mut self, grads: Vec<Option<Tensor>>) -> Result<()> {
        let p = &self.params;
        let k = SgdConsts {
            lr: p.lr as f32,
            momentum: p.momentum as f32,
            one_minus_dampening: (1.0 - p.dampening) as f32,
            weight_decay: p.weight_decay as f32,
            use_wd: p.weight_decay != 0.0,
            nesterov: p.nesterov,
        };
        let with_momentum = p.momentum != 0.0;
        let t = self.t;
        self.vars
            .par_iter()
            .zip(self.bufs.par_iter_mut())
            .zip(self.last_step.par_iter_mut())
            .zip(grads.par_iter())
            .try_for_each(|(((var, buf), last), grad)| {
                let Some(grad) = grad else { return Ok(()) };
                let first = *last == 0;
                let buf = with_momentum.then_some(&mut buf[..]);
                HostUpdate::run("cpu-sgd", var, grad, |p, g| {
                    match p {
                        MasterSlice::F32(p) => sgd_param(p, g, buf, first, &k),
                        MasterSlice::BF16(p) => sgd_param(p, g, buf, first, &k),
                        MasterSlice::F16(p) => sgd_param(p, g, buf, first, &k),
                    }
                    Ok(())
                })?;
                *last = t;
                Ok(())
            })
    }

    /// Saves the momentum buffers (`momentum.<name>`, when momentum is on),
    /// the per-param last step, the step count and the hyper-parameters to a
    /// safetensors file (written to `<path>.tmp`, then renamed).
    pub fn save<P: AsRef<std::path::Path>>(&self, path: P) -> Result<()> {
        let mut w = StateWriter::new(SGD, self.t, &self.last_step);
        w.meta("lr", self.params.lr);
        w.meta("momentum", self.params.momentum);
        w.meta("dampening", self.params.dampening);
        w.meta("weight_decay", self.params.weight_decay);
        w.meta_str("nesterov", self.params.nesterov.to_string());
        if self.params.momentum != 0.0 {
            for ((name, var), b) in self.names.iter().zip(&self.vars).zip(&self.bufs) {
                w.tensor(format!("momentum.{name}"), var.dims(), b);
            }
        }
        w.write(path.as_ref())
    }

    /// Loads state written by [`CpuSgd::save`] (buffers, step count and
    /// hyper-parameters), after checking the whole file; errors name the
    /// offending tensor and nothing changes on error.
    pub fn load<P: AsRef<std::path::Path>>(&mut self, path: P) -> Result<()> {
        let saved = SavedState::read(path.as_ref(), SGD, self.vars.len())?;
        let nesterov = match saved.meta_str("nesterov")?.as_str() {
            "true" => true,
            "false" => false,
            other => bail!("optimizer state: metadata \"nesterov\" = {other:?} is not a bool"),
        };
        let params = ParamsSgd {
            lr: saved.meta_f64("lr")?,
            momentum: saved.meta_f64("momentum")?,
            dampening: saved.meta_f64("dampening")?,
            weight_decay: saved.meta_f64("weight_decay")?,
            nesterov,
        };
        params.check()?;
        let st = saved.tensors()?;
        let mut bufs = Vec::with_capacity(self.vars.len());
        for (name, var) in self.names.iter().zip(&self.vars) {
            let name = format!("momentum.{name}");
            if params.momentum != 0.0 {
                bufs.push(saved.f32_tensor(&st, &name, var.dims())?);
            } else {
                if SavedState::has_tensor(&st, &name) {
                    bail!("optimizer state: tensor {name:?} present but momentum is 0")
                }
                bufs.push(Vec::new());
            }
        }
        drop(st);
        self.bufs = bufs;
        self.last_step = saved.last_step;
        self.t = saved.step;
        self.params = params;
        Ok(())
    }
}

impl Optimizer for CpuSgd {
    type Config = ParamsSgd;

    fn new(vars: Vec<Var>, params: ParamsSgd) -> Result<Self> {
        CpuSgd::new(vars, params)
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        CpuSgd::step(self, grads)
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr
    }
}
