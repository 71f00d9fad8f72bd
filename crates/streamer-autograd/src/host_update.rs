//! The machinery every host optimizer shares: validating and converting
//! gradients, finite checks, the in-place op that gives an update kernel
//! `&mut` access to a `Var`'s CPU storage, and the one AVX2 trampoline and
//! chunked parallel loop that every [`Kernel`] runs through.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{
    bail, CpuStorage, DType, Device, Error, InplaceOp2, Layout, Result, Tensor, Var,
};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::state::{Noise, StateBuf, StateElem};

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
        streamer_core::faults::check(streamer_core::faults::FaultPoint::OptimizerGradient, || {
            let name = names.get(i).map(String::as_str).unwrap_or("?");
            format!("{what}: the gradient of param {i} ({name})")
        })?;
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

impl StateBuf {
    /// The first NaN or infinity, with its index (here beside the parallel
    /// scan it uses, so that `state` stays below the update kernels).
    pub(crate) fn first_non_finite(&self) -> Option<(usize, f32)> {
        match self {
            Self::F32(v) => first_non_finite(v),
            Self::Bf16(v) => v
                .iter()
                .position(|x| !x.is_finite())
                .map(|i| (i, v[i].to_f32())),
        }
    }
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
    buffers: impl Iterator<Item = (usize, &'static str, &'a StateBuf)>,
) -> Result<()> {
    let name = |i: usize| names.get(i).map(String::as_str).unwrap_or("?");
    for (i, var) in vars.iter().enumerate() {
        if let Some((j, x)) = first_non_finite_tensor(var.as_tensor())? {
            bail!("{what}: param {i} ({}) is {x} at element {j}", name(i))
        }
    }
    for (i, label, buf) in buffers {
        if let Some((j, x)) = buf.first_non_finite() {
            bail!(
                "{what}: {label} of param {i} ({}) is {x} at element {j}",
                name(i)
            )
        }
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

/// The elementwise part of an update rule: one fused pass over a chunk of a
/// parameter, its f32 gradient and its state buffers (all of one length, f32
/// or bf16: [`StateElem`]). Written as plain indexed loops so LLVM vectorises
/// them; [`update_param`] runs them in 64K-element chunks in parallel, through
/// an AVX2 build where the CPU has it.
pub(crate) trait Kernel {
    /// The per-step constants of the update.
    type Consts: Copy + Send + Sync;
    /// Updates `p` in place; `bufs` are the parameter's state buffers in the
    /// rule's order; `first` says the parameter was never stepped before;
    /// `noise` gives the random bits of bf16 state's stochastic rounding.
    fn chunk<P: Master, S: StateElem>(
        p: &mut [P],
        g: &[f32],
        bufs: &mut [&mut [S]],
        first: bool,
        k: &Self::Consts,
        noise: Noise,
    );
}

/// # Safety
/// The CPU must support AVX2 (checked by the caller with
/// `is_x86_feature_detected!`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn chunk_avx2<K: Kernel, P: Master, S: StateElem>(
    p: &mut [P],
    g: &[f32],
    bufs: &mut [&mut [S]],
    first: bool,
    k: &K::Consts,
    noise: Noise,
) {
    K::chunk(p, g, bufs, first, k, noise)
}

/// Whether the AVX2 build of the kernels may run here.
#[inline]
fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn chunk<K: Kernel, P: Master, S: StateElem>(
    p: &mut [P],
    g: &[f32],
    bufs: &mut [&mut [S]],
    first: bool,
    k: &K::Consts,
    noise: Noise,
) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 support was just checked at run time; no FMA is enabled,
        // so the results are bit-identical to the generic build.
        unsafe { chunk_avx2::<K, P, S>(p, g, bufs, first, k, noise) };
        return;
    }
    K::chunk(p, g, bufs, first, k, noise)
}

/// One parameter: in one piece when small, else in parallel chunks of
/// [`CHUNK`] elements, each with the matching pieces of every buffer.
fn param<K: Kernel, P: Master, S: StateElem>(
    p: &mut [P],
    g: &[f32],
    mut bufs: Vec<&mut [S]>,
    first: bool,
    k: &K::Consts,
    noise: Noise,
) {
    if p.len() <= CHUNK {
        chunk::<K, P, S>(p, g, &mut bufs, first, k, noise);
        return;
    }
    let mut pieces: Vec<Vec<&mut [S]>> = (0..p.len().div_ceil(CHUNK))
        .map(|_| Vec::with_capacity(bufs.len()))
        .collect();
    for b in bufs {
        for (c, s) in b.chunks_mut(CHUNK).enumerate() {
            pieces[c].push(s);
        }
    }
    p.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(pieces.par_iter_mut())
        .enumerate()
        .for_each(|(c, ((p, g), b))| {
            chunk::<K, P, S>(p, g, b, first, k, noise.at_offset(c * CHUNK))
        });
}

/// One parameter of element type `P` with its state buffers (all of one dtype).
fn param_any_state<K: Kernel, P: Master>(
    p: &mut [P],
    g: &[f32],
    bufs: &mut [StateBuf],
    first: bool,
    k: &K::Consts,
    noise: Noise,
) -> Result<()> {
    if bufs.iter().all(|b| matches!(b, StateBuf::F32(_))) {
        let b = bufs.iter_mut().filter_map(StateBuf::as_f32_mut).collect();
        param::<K, P, f32>(p, g, b, first, k, noise);
    } else if bufs.iter().all(|b| matches!(b, StateBuf::Bf16(_))) {
        let b = bufs.iter_mut().filter_map(StateBuf::as_bf16_mut).collect();
        param::<K, P, bf16>(p, g, b, first, k, noise);
    } else {
        bail!("a parameter's state buffers mix f32 and bf16");
    }
    Ok(())
}

/// Runs kernel `K` over `var` (in place, under its write lock) with its f32
/// CPU gradient `grad` and its state buffers, each of `var`'s element count;
/// `noise` seeds bf16 state's stochastic rounding (a mix of step and param).
pub(crate) fn update_param<K: Kernel>(
    op: &'static str,
    var: &Var,
    grad: &Tensor,
    bufs: &mut [StateBuf],
    first: bool,
    (k, noise): (&K::Consts, Noise),
) -> Result<()> {
    let n = var.elem_count();
    if let Some(b) = bufs.iter().find(|b| b.len() != n) {
        bail!(
            "{op}: a state buffer has {} elements, the param (shape {:?}) {n}",
            b.len(),
            var.dims()
        )
    }
    HostUpdate::run(op, var, grad, |p, g| match p {
        MasterSlice::F32(p) => param_any_state::<K, f32>(p, g, bufs, first, k, noise),
        MasterSlice::BF16(p) => param_any_state::<K, bf16>(p, g, bufs, first, k, noise),
        MasterSlice::F16(p) => param_any_state::<K, f16>(p, g, bufs, first, k, noise),
    })
}
