//! `CpuAdamW`: a fused, vectorised, multi-threaded AdamW that updates host
//! (CPU) parameters in place, numerically equal to candle-nn's `AdamW` in f32.
//!
//! Also holds the machinery shared with [`crate::CpuSgd`]: validating and
//! converting gradients, and the in-place op that gives the update kernels
//! `&mut` access to a `Var`'s CPU storage.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{
    bail, CpuStorage, DType, Device, Error, InplaceOp2, Layout, Result, Tensor, Var,
};
use candle_nn::{Optimizer, ParamsAdamW};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::optim_state::{self, SavedState, StateWriter};

/// Elements per parallel task inside one parameter (256 KiB of f32 per stream).
pub(crate) const CHUNK: usize = 1 << 16;

/// A parameter element type the kernels can update: the math runs in f32.
pub(crate) trait Master: Copy + Send + Sync {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl Master for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Master for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl Master for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

/// The parameter's elements, borrowed mutably from its CPU storage.
pub(crate) enum MasterSlice<'a> {
    F32(&'a mut [f32]),
    BF16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

/// An in-place op on a parameter whose source is its (f32, contiguous, CPU)
/// gradient; `F` receives the parameter's elements and the gradient's.
pub(crate) struct HostUpdate<F> {
    name: &'static str,
    f: Mutex<Option<F>>,
}

impl<F> HostUpdate<F>
where
    F: FnOnce(MasterSlice<'_>, &[f32]) -> Result<()>,
{
    /// Runs `f` on `var`'s storage and `grad`'s, holding the var's write lock.
    pub(crate) fn run(name: &'static str, var: &Var, grad: &Tensor, f: F) -> Result<()> {
        let op = Self {
            name,
            f: Mutex::new(Some(f)),
        };
        var.as_tensor().inplace_op2(grad, &op)
    }
}

impl<F> InplaceOp2 for HostUpdate<F>
where
    F: FnOnce(MasterSlice<'_>, &[f32]) -> Result<()>,
{
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        src: &CpuStorage,
        src_l: &Layout,
    ) -> Result<()> {
        let Some((ds, de)) = dst_l.contiguous_offsets() else {
            bail!("{}: parameter is not contiguous ({:?})", self.name, dst_l)
        };
        let Some((gs, ge)) = src_l.contiguous_offsets() else {
            bail!("{}: gradient is not contiguous ({:?})", self.name, src_l)
        };
        if de - ds != ge - gs {
            bail!(
                "{}: parameter has {} elements, gradient {}",
                self.name,
                de - ds,
                ge - gs
            )
        }
        let g = match src {
            CpuStorage::F32(g) => &g[gs..ge],
            other => bail!(
                "{}: gradient must be f32, got {:?}",
                self.name,
                other.dtype()
            ),
        };
        let p = match dst {
            CpuStorage::F32(p) => MasterSlice::F32(&mut p[ds..de]),
            CpuStorage::BF16(p) => MasterSlice::BF16(&mut p[ds..de]),
            CpuStorage::F16(p) => MasterSlice::F16(&mut p[ds..de]),
            other => bail!(
                "{}: parameter must be f32, bf16 or f16, got {:?}",
                self.name,
                other.dtype()
            ),
        };
        let f = self
            .f
            .lock()
            .map_err(|_| Error::Msg(format!("{}: poisoned update", self.name)))?
            .take();
        match f {
            Some(f) => f(p, g),
            None => bail!("{}: update ran twice", self.name),
        }
    }
}

/// Checks that every var is a contiguous CPU tensor of a float dtype the
/// kernels support; returns `(element count, dims)` per var.
pub(crate) fn check_vars(what: &str, vars: &[Var]) -> Result<()> {
    for (i, var) in vars.iter().enumerate() {
        if !matches!(var.device(), Device::Cpu) {
            bail!(
                "{what}: param {i} (shape {:?}) is on {:?}; host optimizers need CPU params",
                var.dims(),
                var.device().location()
            )
        }
        if !matches!(var.dtype(), DType::F32 | DType::BF16 | DType::F16) {
            bail!(
                "{what}: param {i} (shape {:?}) has dtype {:?}; expected f32, bf16 or f16",
                var.dims(),
                var.dtype()
            )
        }
        if !var.is_contiguous() {
            bail!(
                "{what}: param {i} (shape {:?}) is not contiguous",
                var.dims()
            )
        }
    }
    Ok(())
}

/// Validates a set of `(param index, gradient)` updates against `vars` and
/// converts each gradient to a contiguous f32 CPU tensor. Nothing is modified;
/// any error names the param index (and its name) and the offending values. A
/// gradient holding a NaN or an infinity is refused, so it never reaches a
/// parameter or a moment.
///
/// `last_step[i] == t` marks param `i` as already stepped at step `t`.
pub(crate) fn prepare_grads(
    what: &str,
    vars: &[Var],
    names: &[String],
    last_step: &[usize],
    t: usize,
    updates: &[(usize, &Tensor)],
) -> Result<Vec<Option<Tensor>>> {
    if t == 0 {
        bail!("{what}: begin_step() must be called before stepping params")
    }
    let mut out: Vec<Option<Tensor>> = vec![None; vars.len()];
    for &(i, g) in updates {
        let Some(var) = vars.get(i) else {
            bail!(
                "{what}: param index {i} out of range ({} params)",
                vars.len()
            )
        };
        if out[i].is_some() {
            bail!("{what}: param {i} given twice in one update")
        }
        if last_step[i] == t {
            bail!("{what}: param {i} was already stepped at step {t}")
        }
        if g.dims() != var.dims() {
            bail!(
                "{what}: gradient shape mismatch for param {i}: param {:?}, gradient {:?}",
                var.dims(),
                g.dims()
            )
        }
        let g = g
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .contiguous()?;
        if let Some((j, x)) = first_non_finite_tensor(&g)? {
            let name = names.get(i).map(String::as_str).unwrap_or("?");
            bail!(
                "{what}: the gradient of param {i} ({name}) is {x} at element {j}; \
                 the step is refused and no parameter or optimizer state was changed"
            )
        }
        out[i] = Some(g);
    }
    Ok(out)
}

/// The first element of `x` that is NaN or infinite, with its index: a
/// branch-free scan (vectorised), in parallel over chunks of large slices.
pub(crate) fn first_non_finite(x: &[f32]) -> Option<(usize, f32)> {
    let bad = |c: &[f32]| c.iter().fold(false, |acc, v| acc | !v.is_finite());
    let chunk = if x.len() <= CHUNK {
        bad(x).then_some(0)
    } else {
        x.par_chunks(CHUNK)
            .enumerate()
            .filter(|(_, c)| bad(c))
            .map(|(k, _)| k)
            .min()
    }?;
    let start = chunk * CHUNK;
    x[start..]
        .iter()
        .position(|v| !v.is_finite())
        .map(|j| (start + j, x[start + j]))
}

/// [`first_non_finite`] over a CPU tensor's elements (f32, bf16 or f16, read
/// in place: no copy).
pub(crate) fn first_non_finite_tensor(t: &Tensor) -> Result<Option<(usize, f32)>> {
    let (storage, layout) = t.storage_and_layout();
    let Some((a, b)) = layout.contiguous_offsets() else {
        bail!(
            "finite check: tensor of shape {:?} is not contiguous",
            t.dims()
        )
    };
    let widen = |v: Vec<f32>| first_non_finite(&v);
    Ok(match &*storage {
        candle_core::Storage::Cpu(CpuStorage::F32(v)) => first_non_finite(&v[a..b]),
        candle_core::Storage::Cpu(CpuStorage::BF16(v)) => {
            widen(v[a..b].iter().map(|x| x.to_f32()).collect())
        }
        candle_core::Storage::Cpu(CpuStorage::F16(v)) => {
            widen(v[a..b].iter().map(|x| x.to_f32()).collect())
        }
        _ => bail!(
            "finite check: tensor of shape {:?} must be an f32, bf16 or f16 CPU tensor, got {:?} on {:?}",
            t.dims(),
            t.dtype(),
            t.device().location()
        ),
    })
}

/// Checks that every var and every state buffer (`(label, values)`) is
/// finite; the error names the first offending param and element.
pub(crate) fn check_state_finite<'a>(
    what: &str,
    vars: &[Var],
    names: &[String],
    buffers: impl Iterator<Item = (usize, &'static str, &'a [f32])>,
) -> Result<()> {
    let name = |i: usize| names.get(i).map(String::as_str).unwrap_or("?");
    for (i, var) in vars.iter().enumerate() {
        if let Some((j, x)) = first_non_finite_tensor(var.as_tensor())? {
            bail!("{what}: param {i} ({}) is {x} at element {j}", name(i))
        }
    }
    for (i, label, buf) in buffers {
        if let Some((j, x)) = first_non_finite(buf) {
            bail!(
                "{what}: {label} of param {i} ({}) is {x} at element {j}",
                name(i)
            )
        }
    }
    Ok(())
}

/// Rejects AdamW hyper-parameters that would write NaN or infinities into
/// the parameters (or flip their sign through the decay), naming the value.
pub(crate) fn check_adamw_params(p: &ParamsAdamW) -> Result<()> {
    if !(p.lr.is_finite() && p.lr >= 0.0) {
        bail!(
            "{ADAMW}: learning rate must be finite and >= 0, got {}",
            p.lr
        )
    }
    for (name, b) in [("beta1", p.beta1), ("beta2", p.beta2)] {
        if !(0.0..1.0).contains(&b) {
            bail!("{ADAMW}: {name} must be in [0, 1), got {b}")
        }
    }
    if !(p.eps.is_finite() && p.eps > 0.0) {
        bail!("{ADAMW}: eps must be finite and > 0, got {}", p.eps)
    }
    if !(p.weight_decay.is_finite() && p.weight_decay >= 0.0 && p.lr * p.weight_decay < 1.0) {
        bail!(
            "{ADAMW}: weight_decay must be finite, >= 0 and below 1 / lr, got {} (lr {})",
            p.weight_decay,
            p.lr
        )
    }
    Ok(())
}

/// Collects `(index, gradient)` for the params in `which` that have a
/// gradient in `grads` (params without one are skipped).
pub(crate) fn grads_for<'a>(
    what: &str,
    vars: &[Var],
    grads: &'a GradStore,
    which: Option<&[usize]>,
) -> Result<Vec<(usize, &'a Tensor)>> {
    let mut out = Vec::new();
    let mut push = |i: usize| -> Result<()> {
        let Some(var) = vars.get(i) else {
            bail!(
                "{what}: param index {i} out of range ({} params)",
                vars.len()
            )
        };
        if let Some(g) = grads.get(var.as_tensor()) {
            out.push((i, g));
        }
        Ok(())
    };
    match which {
        Some(which) => which.iter().try_for_each(|&i| push(i))?,
        None => (0..vars.len()).try_for_each(&mut push)?,
    }
    Ok(out)
}

/// The per-step constants of the AdamW update, rounded to f32 exactly as
/// candle-nn's tensor ops round their f64 scalars.
#[derive(Clone, Copy, Debug)]
struct AdamConsts {
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    scale_m: f32,
    scale_v: f32,
    decay: f32,
    eps: f32,
    lr: f32,
}

impl AdamConsts {
    fn new(p: &ParamsAdamW, t: usize) -> Self {
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
#[inline(always)]
fn adamw_chunk_generic<P: Master>(
    p: &mut [P],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    k: &AdamConsts,
) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let gi = g[i];
        let mi = m[i] * k.beta1 + gi * k.one_minus_beta1;
        let vi = v[i] * k.beta2 + (gi * gi) * k.one_minus_beta2;
        m[i] = mi;
        v[i] = vi;
        let m_hat = mi * k.scale_m;
        let v_hat = vi * k.scale_v;
        let theta = p[i].to_f32() * k.decay;
        let adjusted = m_hat / (v_hat.sqrt() + k.eps);
        p[i] = P::from_f32(theta - adjusted * k.lr);
    }
}

/// # Safety
/// The CPU must support AVX2 (checked by the caller with
/// `is_x86_feature_detected!`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn adamw_chunk_avx2<P: Master>(
    p: &mut [P],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    k: &AdamConsts,
) {
    adamw_chunk_generic(p, g, m, v, k)
}

/// Whether the AVX2 build of the kernels may run here.
#[inline]
pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn adamw_chunk<P: Master>(p: &mut [P], g: &[f32], m: &mut [f32], v: &mut [f32], k: &AdamConsts) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 support was just checked at run time; no FMA is enabled,
        // so the results are bit-identical to the generic build.
        unsafe { adamw_chunk_avx2(p, g, m, v, k) };
        return;
    }
    adamw_chunk_generic(p, g, m, v, k)
}

fn adamw_param<P: Master>(p: &mut [P], g: &[f32], m: &mut [f32], v: &mut [f32], k: &AdamConsts) {
    if p.len() <= CHUNK {
        adamw_chunk(p, g, m, v, k);
        return;
    }
    p.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .for_each(|(((p, g), m), v)| adamw_chunk(p, g, m, v, k));
}

/// AdamW's f32 state for one parameter.
#[derive(Debug, Clone)]
pub(crate) struct AdamState {
    pub(crate) m: Vec<f32>,
    pub(crate) v: Vec<f32>,
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
/// are f32 whatever the parameter dtype. Gradients may be on any device and of
/// any float dtype: they are converted to f32 on the CPU first. A parameter
/// without a gradient is skipped (its moments do not decay), like candle-nn.
///
/// # Stepping a subset (overlapped step)
/// [`CpuAdamW::step`] is [`CpuAdamW::begin_step`] followed by
/// [`CpuAdamW::step_params`] on every parameter. To step a block's parameters
/// as soon as its gradients land, call `begin_step()` once per optimizer step,
/// then `step_params`/`step_tensors` on disjoint subsets; stepping a parameter
/// twice within one step is an error.
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
#[derive(Debug)]
pub struct CpuAdamW {
    vars: Vec<Var>,
    pub(crate) states: Vec<AdamState>,
    /// The step at which each param was last updated (0: never).
    pub(crate) last_step: Vec<usize>,
    pub(crate) names: Vec<String>,
    pub(crate) params: ParamsAdamW,
    pub(crate) t: usize,
}

const ADAMW: &str = "CpuAdamW";

impl CpuAdamW {
    /// Creates the optimizer over `vars` (contiguous CPU tensors of f32, bf16
    /// or f16) with zeroed f32 moments. Params are named `"0"`, `"1"`, ... in
    /// saved state unless [`CpuAdamW::set_param_names`] says otherwise.
    pub fn new(vars: Vec<Var>, params: ParamsAdamW) -> Result<Self> {
        check_vars(ADAMW, &vars)?;
        check_adamw_params(&params)?;
        let states = vars
            .iter()
            .map(|var| {
                let n = var.elem_count();
                AdamState {
                    m: vec![0f32; n],
                    v: vec![0f32; n],
                }
            })
            .collect();
        let n = vars.len();
        Ok(Self {
            vars,
            states,
            last_step: vec![0; n],
            names: (0..n).map(|i| i.to_string()).collect(),
            params,
            t: 0,
        })
    }

    /// The parameters, in the order indices refer to.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The hyper-parameters.
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    /// Replaces the hyper-parameters (takes effect at the next `begin_step`).
    /// Values that would make the update non-finite are refused at the next step.
    pub fn set_params(&mut self, params: ParamsAdamW) {
        self.params = params;
    }

    /// The number of steps begun so far (the `t` of the bias correction).
    pub fn step_count(&self) -> usize {
        self.t
    }

    /// The first and second moments `(m, v)` of param `idx`, in f32.
    pub fn moments(&self, idx: usize) -> Option<(&[f32], &[f32])> {
        self.states.get(idx).map(|s| (&s.m[..], &s.v[..]))
    }

    /// The names params are saved under (default: their indices).
    pub fn param_names(&self) -> &[String] {
        &self.names
    }

    /// Sets the names params are saved under: one per param, unique.
    pub fn set_param_names(&mut self, names: Vec<String>) -> Result<()> {
        optim_state::check_names(ADAMW, &names, self.vars.len())?;
        self.names = names;
        Ok(())
    }

    /// Starts a new optimizer step: increments `t` (for the bias correction).
    /// Follow with [`CpuAdamW::step_params`] or [`CpuAdamW::step_tensors`].
    pub fn begin_step(&mut self) {
        self.t += 1;
    }

    /// [`CpuAdamW::begin_step`], then updates every param that has a gradient
    /// in `grads`. All gradients are validated before any param changes.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        check_adamw_params(&self.params)?;
        let updates = grads_for(ADAMW, &self.vars, grads, None)?;
        // Validate before bumping `t`, so a failed step changes nothing.
        self.t += 1;
        let prepared = prepare_grads(
            ADAMW,
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

    /// Updates the params `which` (indices into [`CpuAdamW::vars`]) that have
    /// a gradient in `grads`, within the step opened by
    /// [`CpuAdamW::begin_step`]. All are validated before any changes.
    pub fn step_params(&mut self, grads: &GradStore, which: &[usize]) -> Result<()> {
        let updates = grads_for(ADAMW, &self.vars, grads, Some(which))?;
        self.step_tensors(&updates)
    }

    /// Updates param `idx` with gradient `grad` for each `(idx, grad)`, within
    /// the step opened by [`CpuAdamW::begin_step`]. Shapes, indices and
    /// conversions are all checked before any param changes; each param may
    /// be stepped once per step.
    pub fn step_tensors(&mut self, updates: &[(usize, &Tensor)]) -> Result<()> {
        check_adamw_params(&self.params)?;
        let prepared = prepare_grads(
            ADAMW,
            &self.vars,
            &self.names,
            &self.last_step,
            self.t,
            updates,
        )?;
        self.apply(prepared)
    }

    /// Checks that every parameter and both moments of every parameter are
    /// finite (one read pass, no copy); the error names the first offending
    /// param and element. Call before saving.
    pub fn check_finite(&self) -> Result<()> {
        let moments = self.states.iter().enumerate().flat_map(|(i, s)| {
            [
                (i, "first moment m", &s.m[..]),
                (i, "second moment v", &s.v[..]),
            ]
        });
        check_state_finite(ADAMW, &self.vars, &self.names, moments)
    }

    fn apply(&mut self, grads: Vec<Option<Tensor>>) -> Result<()> {
        let k = AdamConsts::new(&self.params, self.t);
        let t = self.t;
        self.vars
            .par_iter()
            .zip(self.states.par_iter_mut())
            .zip(self.last_step.par_iter_mut())
            .zip(grads.par_iter())
            .try_for_each(|(((var, state), last), grad)| {
                let Some(grad) = grad else { return Ok(()) };
                let AdamState { m, v } = state;
                HostUpdate::run("cpu-adamw", var, grad, |p, g| {
                    match p {
                        MasterSlice::F32(p) => adamw_param(p, g, m, v, &k),
                        MasterSlice::BF16(p) => adamw_param(p, g, m, v, &k),
                        MasterSlice::F16(p) => adamw_param(p, g, m, v, &k),
                    }
                    Ok(())
                })?;
                *last = t;
                Ok(())
            })
    }

    /// Saves the moments (`m.<name>`, `v.<name>`), the per-param last step,
    /// the step count and the hyper-parameters to a safetensors file (written
    /// to `<path>.tmp`, then renamed).
    pub fn save<P: AsRef<std::path::Path>>(&self, path: P) -> Result<()> {
        let mut w = StateWriter::new(ADAMW, self.t, &self.last_step);
        w.meta("lr", self.params.lr);
        w.meta("beta1", self.params.beta1);
        w.meta("beta2", self.params.beta2);
        w.meta("eps", self.params.eps);
        w.meta("weight_decay", self.params.weight_decay);
        for ((name, var), s) in self.names.iter().zip(&self.vars).zip(&self.states) {
            w.tensor(format!("m.{name}"), var.dims(), &s.m);
            w.tensor(format!("v.{name}"), var.dims(), &s.v);
        }
        w.write(path.as_ref())
    }

    /// Loads state written by [`CpuAdamW::save`]: moments, step count and
    /// hyper-parameters (call [`Optimizer::set_learning_rate`] afterwards to
    /// override the learning rate). The file is checked completely (kind,
    /// param count, every tensor's presence, dtype and shape) before anything
    /// changes; errors name the offending tensor.
    pub fn load<P: AsRef<std::path::Path>>(&mut self, path: P) -> Result<()> {
        let saved = SavedState::read(path.as_ref(), ADAMW, self.vars.len())?;
        let params = ParamsAdamW {
            lr: saved.meta_f64("lr")?,
            beta1: saved.meta_f64("beta1")?,
            beta2: saved.meta_f64("beta2")?,
            eps: saved.meta_f64("eps")?,
            weight_decay: saved.meta_f64("weight_decay")?,
        };
        let st = saved.tensors()?;
        let mut states = Vec::with_capacity(self.vars.len());
        for (name, var) in self.names.iter().zip(&self.vars) {
            let m = saved.f32_tensor(&st, &format!("m.{name}"), var.dims())?;
            let v = saved.f32_tensor(&st, &format!("v.{name}"), var.dims())?;
            states.push(AdamState { m, v });
        }
        drop(st);
        self.states = states;
        self.last_step = saved.last_step;
        self.t = saved.step;
        self.params = params;
        Ok(())
    }
}

impl Optimizer for CpuAdamW {
    type Config = ParamsAdamW;

    fn new(vars: Vec<Var>, params: ParamsAdamW) -> Result<Self> {
        CpuAdamW::new(vars, params)
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        CpuAdamW::step(self, grads)
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr
    }
}
