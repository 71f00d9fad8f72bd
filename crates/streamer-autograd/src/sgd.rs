//! `CpuSgd`: fused, multi-threaded SGD with momentum on host (CPU)
//! parameters: the [`HostOptimizer`] skeleton over the [`SgdUpdate`] rule.

use std::borrow::Cow;

use candle_core::{bail, Result};

use crate::host_optim::{BufferName, HostOptimizer, MetaValue, ParamStep, UpdateRule};
use crate::host_update::{update_param, Kernel, Master};
use crate::state::{Noise, StateElem};

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

/// The per-step constants of the SGD update, in f32.
#[derive(Clone, Copy, Debug)]
struct SgdConsts {
    lr: f32,
    momentum: f32,
    one_minus_dampening: f32,
    weight_decay: f32,
    use_wd: bool,
    nesterov: bool,
}

impl SgdConsts {
    fn new(p: &ParamsSgd) -> Self {
        Self {
            lr: p.lr as f32,
            momentum: p.momentum as f32,
            one_minus_dampening: (1.0 - p.dampening) as f32,
            weight_decay: p.weight_decay as f32,
            use_wd: p.weight_decay != 0.0,
            nesterov: p.nesterov,
        }
    }

    /// The gradient with the coupled weight decay added (`g + wd * p`).
    #[inline(always)]
    fn decayed(&self, g: f32, p: f32) -> f32 {
        if self.use_wd {
            g + p * self.weight_decay
        } else {
            g
        }
    }
}

/// One fused SGD pass over a chunk, PyTorch's order of operations:
/// `d = g + wd*p; buf = first ? d : mu*buf + (1-damp)*d;
/// d = nesterov ? d + mu*buf : buf; p -= lr*d`. Without momentum and weight
/// decay this is candle-nn's `SGD` (`p - g*lr`) exactly.
struct SgdKernel;

impl Kernel for SgdKernel {
    type Consts = SgdConsts;

    #[inline(always)]
    fn chunk<P: Master, S: StateElem>(
        p: &mut [P],
        g: &[f32],
        bufs: &mut [&mut [S]],
        first: bool,
        k: &SgdConsts,
        noise: Noise,
    ) {
        let n = p.len();
        let g = &g[..n];
        let Some(buf) = bufs.first_mut() else {
            for i in 0..n {
                let pi = p[i].to_f32();
                let d = k.decayed(g[i], pi);
                p[i] = P::from_f32(pi - d * k.lr);
            }
            return;
        };
        let buf = &mut buf[..n];
        for i in 0..n {
            let pi = p[i].to_f32();
            let d = k.decayed(g[i], pi);
            let b = if first {
                d
            } else {
                buf[i].load() * k.momentum + d * k.one_minus_dampening
            };
            buf[i] = S::store(b, noise.bits(i));
            let d = if k.nesterov { d + b * k.momentum } else { b };
            p[i] = P::from_f32(pi - d * k.lr);
        }
    }
}

/// The SGD rule of [`CpuSgd`]: a momentum buffer per parameter when
/// `momentum != 0` (saved as `momentum.<name>`), none otherwise.
#[derive(Debug)]
pub struct SgdUpdate;

impl crate::host_optim::sealed::Sealed for SgdUpdate {}

const MOMENTUM: &[BufferName] = &[("momentum", "momentum buffer")];

impl UpdateRule for SgdUpdate {
    type Params = ParamsSgd;
    const KIND: &'static str = "CpuSgd";
    const ALL_BUFFERS: &'static [BufferName] = MOMENTUM;

    fn check(p: &ParamsSgd) -> Result<()> {
        p.check()
    }

    fn buffers(p: &ParamsSgd) -> &'static [BufferName] {
        if p.momentum != 0.0 {
            MOMENTUM
        } else {
            &[]
        }
    }

    fn lr(p: &ParamsSgd) -> f64 {
        p.lr
    }

    fn set_lr(p: &mut ParamsSgd, lr: f64) {
        p.lr = lr
    }

    fn to_meta(p: &ParamsSgd) -> Vec<(&'static str, MetaValue)> {
        vec![
            ("lr", MetaValue::F64(p.lr)),
            ("momentum", MetaValue::F64(p.momentum)),
            ("dampening", MetaValue::F64(p.dampening)),
            ("weight_decay", MetaValue::F64(p.weight_decay)),
            ("nesterov", MetaValue::Bool(p.nesterov)),
        ]
    }

    fn from_meta(get: &dyn Fn(&str, bool) -> Result<MetaValue>) -> Result<ParamsSgd> {
        let f = |key: &str| get(key, false)?.f64(key);
        Ok(ParamsSgd {
            lr: f("lr")?,
            momentum: f("momentum")?,
            dampening: f("dampening")?,
            weight_decay: f("weight_decay")?,
            nesterov: get("nesterov", true)?.bool("nesterov")?,
        })
    }

    // The trait is sealed: its state types stay crate-private.
    #[allow(private_interfaces)]
    fn update(p: &ParamsSgd, s: ParamStep<'_>) -> Result<()> {
        let k = SgdConsts::new(p);
        update_param::<SgdKernel>("cpu-sgd", s.var, s.grad, s.bufs, s.first, (&k, s.noise))
    }
}

/// SGD on host (CPU) parameters, with optional momentum, dampening, coupled
/// weight decay and Nesterov momentum (PyTorch's `torch.optim.SGD`): one fused
/// pass per parameter (read p, g, buf; write p, buf in place), vectorised,
/// with rayon across parameters and 64K-element chunks.
///
/// With `momentum == 0` and `weight_decay == 0` it equals candle-nn's `SGD`
/// exactly in f32. The momentum buffer (f32, whatever the parameter dtype) of
/// a param is set to its first gradient, as in PyTorch; turning momentum on or
/// off with [`HostOptimizer::set_params`] resets it. Params, gradients,
/// missing gradients, the overlapped step and saving work as in
/// [`HostOptimizer`].
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
pub type CpuSgd = HostOptimizer<SgdUpdate>;

impl CpuSgd {
    /// The momentum buffer of param `idx` in f32 (empty without momentum).
    pub fn momentum_buffer(&self, idx: usize) -> Option<Cow<'_, [f32]>> {
        if idx >= self.vars().len() {
            return None;
        }
        Some(self.buffer(idx, 0).unwrap_or(Cow::Borrowed(&[])))
    }
}
