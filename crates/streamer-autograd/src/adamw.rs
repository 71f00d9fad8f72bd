//! `CpuAdamW`: a fused, vectorised, multi-threaded AdamW that updates host
//! (CPU) parameters in place, numerically equal to candle-nn's `AdamW` in f32:
//! the [`HostOptimizer`] skeleton over the [`AdamWUpdate`] rule.

use std::borrow::Cow;

use candle_core::{bail, Result};
use candle_nn::ParamsAdamW;

use crate::host_optim::{BufferName, HostOptimizer, MetaValue, ParamStep, UpdateRule};
use crate::host_update::{update_param, Kernel, Master};
use crate::state::{Noise, StateElem};

/// Rejects AdamW hyper-parameters that would write NaN or infinities into
/// the parameters (or flip their sign through the decay), naming the value.
pub(crate) fn check_adamw_params(what: &str, p: &ParamsAdamW) -> Result<()> {
    if !(p.lr.is_finite() && p.lr >= 0.0) {
        bail!(
            "{what}: learning rate must be finite and >= 0, got {}",
            p.lr
        )
    }
    for (name, b) in [("beta1", p.beta1), ("beta2", p.beta2)] {
        if !(0.0..1.0).contains(&b) {
            bail!("{what}: {name} must be in [0, 1), got {b}")
        }
    }
    if !(p.eps.is_finite() && p.eps > 0.0) {
        bail!("{what}: eps must be finite and > 0, got {}", p.eps)
    }
    if !(p.weight_decay.is_finite() && p.weight_decay >= 0.0 && p.lr * p.weight_decay < 1.0) {
        bail!(
            "{what}: weight_decay must be finite, >= 0 and below 1 / lr, got {} (lr {})",
            p.weight_decay,
            p.lr
        )
    }
    Ok(())
}

/// The per-step constants of the AdamW update, rounded to f32 exactly as
/// candle-nn's tensor ops round their f64 scalars.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamConsts {
    pub(crate) beta1: f32,
    pub(crate) one_minus_beta1: f32,
    pub(crate) beta2: f32,
    pub(crate) one_minus_beta2: f32,
    pub(crate) scale_m: f32,
    pub(crate) scale_v: f32,
    pub(crate) decay: f32,
    pub(crate) eps: f32,
    pub(crate) lr: f32,
}

impl AdamConsts {
    pub(crate) fn new(p: &ParamsAdamW, t: usize) -> Self {
        let t = t.min(i32::MAX as usize) as i32;
        Self {
            beta1: p.beta1 as f32,
            one_minus_beta1: (1.0 - p.beta1) as f32,
            beta2: p.beta2 as f32,
            one_minus_beta2: (1.0 - p.beta2) as f32,
            scale_m: (1.0 / (1.0 - p.beta1.powi(t))) as f32,
            scale_v: (1.0 / (1.0 - p.beta2.powi(t))) as f32,
            decay: (1.0 - p.lr * p.weight_decay) as f32,
            eps: p.eps as f32,
            lr: p.lr as f32,
        }
    }
}

/// One fused AdamW pass over a chunk. The operations and their order are
/// those of candle-nn's `AdamW::step` (each tensor op rounds to f32), so in
/// f32 the result is the same; written as a plain indexed loop over slices of
/// equal length so LLVM vectorises it.
pub(crate) struct AdamKernel;

impl Kernel for AdamKernel {
    type Consts = AdamConsts;

    #[inline(always)]
    fn chunk<P: Master, S: StateElem>(
        p: &mut [P],
        g: &[f32],
        bufs: &mut [&mut [S]],
        _first: bool,
        k: &AdamConsts,
        noise: Noise,
    ) {
        let [m, v] = bufs else { return };
        let n = p.len();
        let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
        for i in 0..n {
            let gi = g[i];
            let mi = m[i].load() * k.beta1 + gi * k.one_minus_beta1;
            let vi = v[i].load() * k.beta2 + (gi * gi) * k.one_minus_beta2;
            // bf16 state: one hash gives m and v 16 random bits each (f32
            // state ignores them and the hash is optimised away).
            let r = noise.bits(i);
            m[i] = S::store(mi, r);
            v[i] = S::store(vi, r >> 16);
            let m_hat = mi * k.scale_m;
            let v_hat = vi * k.scale_v;
            let theta = p[i].to_f32() * k.decay;
            let adjusted = m_hat / (v_hat.sqrt() + k.eps);
            p[i] = P::from_f32(theta - adjusted * k.lr);
        }
    }
}

/// The AdamW rule of [`CpuAdamW`]: first and second moments `m`, `v` per
/// parameter (saved as `m.<name>`, `v.<name>`).
#[derive(Debug)]
pub struct AdamWUpdate;

impl crate::host_optim::sealed::Sealed for AdamWUpdate {}

pub(crate) const ADAMW: &str = "CpuAdamW";
const MOMENTS: &[BufferName] = &[("m", "first moment m"), ("v", "second moment v")];

impl UpdateRule for AdamWUpdate {
    type Params = ParamsAdamW;
    const KIND: &'static str = ADAMW;
    const ALL_BUFFERS: &'static [BufferName] = MOMENTS;

    fn check(p: &ParamsAdamW) -> Result<()> {
        check_adamw_params(ADAMW, p)
    }

    fn buffers(_: &ParamsAdamW) -> &'static [BufferName] {
        MOMENTS
    }

    fn lr(p: &ParamsAdamW) -> f64 {
        p.lr
    }

    fn set_lr(p: &mut ParamsAdamW, lr: f64) {
        p.lr = lr
    }

    fn to_meta(p: &ParamsAdamW) -> Vec<(&'static str, MetaValue)> {
        [
            ("lr", p.lr),
            ("beta1", p.beta1),
            ("beta2", p.beta2),
            ("eps", p.eps),
            ("weight_decay", p.weight_decay),
        ]
        .into_iter()
        .map(|(k, v)| (k, MetaValue::F64(v)))
        .collect()
    }

    fn from_meta(get: &dyn Fn(&str, bool) -> Result<MetaValue>) -> Result<ParamsAdamW> {
        let f = |key: &str| get(key, false)?.f64(key);
        Ok(ParamsAdamW {
            lr: f("lr")?,
            beta1: f("beta1")?,
            beta2: f("beta2")?,
            eps: f("eps")?,
            weight_decay: f("weight_decay")?,
        })
    }

    // The trait is sealed: its state types stay crate-private.
    #[allow(private_interfaces)]
    fn update(p: &ParamsAdamW, s: ParamStep<'_>) -> Result<()> {
        let k = AdamConsts::new(p, s.t);
        update_param::<AdamKernel>("cpu-adamw", s.var, s.grad, s.bufs, s.first, (&k, s.noise))
    }
}

/// AdamW on host (CPU) parameters: one fused, vectorised pass per parameter
/// (read p, g, m, v; write p, m, v in place on the `Var`'s storage), with
/// rayon across parameters and across 64K-element chunks of large ones.
///
/// The update is candle-nn's `AdamW` (decoupled weight decay
/// `theta *= 1 - lr * wd`, then `theta -= lr * m_hat / (sqrt(v_hat) + eps)`
/// with bias-corrected moments), with the same f32 operations in the same
/// order, so f32 parameters follow candle-nn's `AdamW` exactly.
///
/// Parameters must be contiguous CPU tensors of f32, bf16 or f16; the moments
/// are f32 whatever the parameter dtype, or bf16 with
/// [`HostOptimizer::with_state_dtype`]. Gradients, missing gradients, the
/// overlapped step and saving work as in [`HostOptimizer`].
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use candle_nn::{Optimizer, ParamsAdamW};
/// use streamer_autograd::CpuAdamW;
/// let w = Var::new(&[1f32, 2., 3.], &Device::Cpu)?;
/// let mut opt = CpuAdamW::new(vec![w.clone()], ParamsAdamW { lr: 0.1, ..Default::default() })?;
/// let loss = w.as_tensor().sqr()?.sum_all()?;
/// opt.step(&loss.backward()?)?;
/// assert!(w.as_tensor().to_vec1::<f32>()?[0] < 1.0);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub type CpuAdamW = HostOptimizer<AdamWUpdate>;

/// AdamW's first and second moments `(m, v)` of one parameter, in f32.
pub type Moments<'a> = (Cow<'a, [f32]>, Cow<'a, [f32]>);

impl CpuAdamW {
    /// The first and second moments `(m, v)` of param `idx`, in f32
    /// (borrowed with f32 state, converted with bf16 state).
    pub fn moments(&self, idx: usize) -> Option<Moments<'_>> {
        Some((self.buffer(idx, 0)?, self.buffer(idx, 1)?))
    }
}
