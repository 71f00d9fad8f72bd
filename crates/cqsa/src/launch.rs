//! What the portable and the Hopper attention kernels are launched with: the
//! grid, the scalar arguments in the kernels' order, the band's clamping and
//! one backward call's views. Below both launchers (`cuda`, `hopper`), so
//! neither depends on the other for them.
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchArgs, PushKernelArg};
use candle_core::{bail, CudaDevice, Result};
pub(crate) use streamer_device::allow_smem;

use crate::packed::Fused;
use crate::{AttentionShape, Scores};

pub(crate) fn grid(x: usize, y: usize, z: usize) -> Result<(u32, u32, u32)> {
    if y > 65535 || z > 65535 || x > i32::MAX as usize {
        bail!("cqsa: launch grid ({x}, {y}, {z}) too large")
    }
    Ok((x as u32, y as u32, z as u32))
}

pub(crate) fn to_i32(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("cqsa: {what} = {x} exceeds i32")))
}

/// Margin of the band's open ends (`BAND_PAD` in the kernel): a missing lower
/// bound is `lo = -(nq + BAND_PAD)`, a missing upper one `hi = nk + BAND_PAD`,
/// beyond any `j - i` of the call even with the kernels' tile padding.
const BAND_PAD: i64 = 256;

/// The scalar arguments every attention kernel takes after its pointers, in the
/// kernels' order: `hq, hkv, nq, nk, [d,] scale, lo, hi, cap` (the band clamped
/// to its open ends `[-(nq + BAND_PAD), nk + BAND_PAD]`, which mean no bound;
/// the soft-cap 0 for none).
pub(crate) struct KernelArgs {
    hq: i32,
    hkv: i32,
    nq: i32,
    nk: i32,
    /// The head dim (the delta kernel takes it alone).
    pub(crate) d: i32,
    /// The score scale (the dq conversion takes it alone).
    pub(crate) scale: f32,
    lo: i32,
    hi: i32,
    cap: f32,
}

/// The band `(lo, hi)` as the kernels take it for a block of `nq` queries and
/// `nk` keys: a missing bound at its open end, a given one clamped to
/// `[-(nq + BAND_PAD), nk + BAND_PAD]` (beyond, it hides nothing more, or
/// everything already), which keeps the kernels' int sums of a row or key and a
/// bound in range. The caller has checked that `nq + nk + 4 BAND_PAD` fits an i32.
pub(crate) fn kernel_band(nq: usize, nk: usize, lo: Option<i64>, hi: Option<i64>) -> (i32, i32) {
    let (open_lo, open_hi) = (-(nq as i64 + BAND_PAD), nk as i64 + BAND_PAD);
    let bound = |b: Option<i64>, open: i64| b.map_or(open, |x| x.clamp(open_lo, open_hi)) as i32;
    (bound(lo, open_lo), bound(hi, open_hi))
}

impl KernelArgs {
    pub(crate) fn new(dims: &AttentionShape, sc: &Scores) -> Result<Self> {
        to_i32(
            dims.nq + dims.nk + 4 * BAND_PAD as usize,
            "seq_q + seq_k + 1024",
        )?;
        let (lo, hi) = kernel_band(dims.nq, dims.nk, sc.lo, sc.hi);
        Ok(Self {
            hq: to_i32(dims.hq, "heads_q")?,
            hkv: to_i32(dims.hkv, "heads_kv")?,
            nq: to_i32(dims.nq, "seq_q")?,
            nk: to_i32(dims.nk, "seq_k")?,
            d: to_i32(dims.d, "head_dim")?,
            scale: sc.scale,
            lo,
            hi,
            cap: sc.softcap.unwrap_or(0.0),
        })
    }

    /// The name infix of the tensor-core kernels: `cap_` for the soft-capping
    /// instances.
    pub(crate) fn cap_infix(&self) -> &'static str {
        if self.cap > 0.0 {
            "cap_"
        } else {
            ""
        }
    }

    /// The score scale.
    pub(crate) fn scale(&self) -> f32 {
        self.scale
    }

    /// Pushes the arguments; `with_d` for the simple kernels, which take the head
    /// dim at run time.
    pub(crate) fn push<'a>(&'a self, b: &mut LaunchArgs<'a>, with_d: bool) {
        b.arg(&self.hq).arg(&self.hkv).arg(&self.nq).arg(&self.nk);
        if with_d {
            b.arg(&self.d);
        }
        b.arg(&self.scale)
            .arg(&self.lo)
            .arg(&self.hi)
            .arg(&self.cap);
    }
}

/// What every backward kernel reads, in the order of its first arguments.
pub(crate) struct BwdInputs<'a, T> {
    pub(crate) q: CudaView<'a, T>,
    pub(crate) k: CudaView<'a, T>,
    pub(crate) v: CudaView<'a, T>,
    pub(crate) g: CudaView<'a, T>,
    pub(crate) lse: CudaView<'a, f32>,
    /// `do . o` per row, written by the delta kernel.
    pub(crate) delta: CudaSlice<f32>,
}

impl<T> BwdInputs<'_, T> {
    /// Pushes q, k, v, grad_o, lse and delta.
    pub(crate) fn push<'b>(&'b self, b: &mut LaunchArgs<'b>) {
        b.arg(&self.q)
            .arg(&self.k)
            .arg(&self.v)
            .arg(&self.g)
            .arg(&self.lse)
            .arg(&self.delta);
    }
}

/// The inputs of one backward call as device views, and its outputs.
pub(crate) struct Backward<'a, T> {
    pub(crate) dev: &'a CudaDevice,
    pub(crate) sfx: &'static str,
    pub(crate) dims: AttentionShape,
    pub(crate) args: KernelArgs,
    /// A packed call's documents (tensor-core kernels only).
    pub(crate) packed: Option<&'a Fused>,
    pub(crate) inputs: BwdInputs<'a, T>,
    pub(crate) dq: CudaSlice<T>,
    pub(crate) dk: CudaSlice<T>,
    pub(crate) dv: CudaSlice<T>,
}
