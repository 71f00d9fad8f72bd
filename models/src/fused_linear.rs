//! `Linear` with its bias and activation fused into the matrix product.
//!
//! candle-nn's `Linear` runs a GEMM, then a separate broadcast add for the bias,
//! then the activation: three passes over the output, each through Candle's
//! generic element-wise kernels. On CUDA, [`FusedLinear`] is one cuBLASLt call
//! whose epilogue adds the bias and applies GELU (tanh form, like Candle's
//! `gelu`) while the tile is still in registers. Elsewhere (f32 on CUDA, the
//! CPU) it runs the same three Candle ops. When a gradient may flow, the CUDA
//! forward also keeps the pre-activation (cuBLASLt's `GELU_AUX_BIAS`), so the
//! backward needs no extra GEMM: the input gradient is one GEMM, the weight
//! gradient another whose epilogue also sums the bias gradient (`BGRADB`),
//! and GELU' is one f32 pass over the kept pre-activation. A whole MLP whose
//! GELU' also lives in a GEMM epilogue is [`crate::FusedMlp`].
use crate::ops::gelu::gelu_grad;
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;

/// Activation applied after the bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    /// `x W^T + b`.
    Bias,
    /// `gelu(x W^T + b)`, tanh approximation (Candle's `Tensor::gelu`).
    BiasGelu,
}

/// `epilogue(x W^T + b)` with `W` of shape `(out, in)` and `b` of shape `(out,)`,
/// the layout and names (`weight`, `bias`) of candle-nn's `Linear`.
#[derive(Clone, Debug)]
pub struct FusedLinear {
    weight: Tensor,
    bias: Tensor,
    epilogue: Epilogue,
}

/// A [`FusedLinear`] reading `weight` and `bias` from `vb`, like `candle_nn::linear`.
pub fn fused_linear(
    in_dim: usize,
    out_dim: usize,
    epilogue: Epilogue,
    vb: VarBuilder,
) -> Result<FusedLinear> {
    let weight = vb.get((out_dim, in_dim), "weight")?;
    let bias = vb.get(out_dim, "bias")?;
    FusedLinear::new(weight, bias, epilogue)
}

impl FusedLinear {
    /// From a weight `(out, in)` and a bias `(out,)` of the same dtype and device.
    pub fn new(weight: Tensor, bias: Tensor, epilogue: Epilogue) -> Result<Self> {
        let (out, _) = weight.dims2().map_err(|_| {
            candle_core::Error::Msg(format!(
                "FusedLinear: weight must be (out, in), got {:?}",
                weight.dims()
            ))
        })?;
        if bias.dims() != [out] || bias.dtype() != weight.dtype() {
            candle_core::bail!(
                "FusedLinear: bias must be ({out},) {:?} like the weight, got {:?} {:?}",
                weight.dtype(),
                bias.dims(),
                bias.dtype()
            );
        }
        Ok(Self {
            weight,
            bias,
            epilogue,
        })
    }

    /// The same computation with plain Candle ops (the fallback and the reference).
    pub fn forward_unfused(&self, x: &Tensor) -> Result<Tensor> {
        let z = x
            .broadcast_matmul(&self.weight.t()?)?
            .broadcast_add(&self.bias)?;
        match self.epilogue {
            Epilogue::Bias => Ok(z),
            Epilogue::BiasGelu => z.gelu(),
        }
    }
}

impl Module for FusedLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let in_dim = self.weight.dim(1)?;
        if x.dims().last() != Some(&in_dim) {
            candle_core::bail!(
                "FusedLinear: input {:?} does not end in the weight's in-features {in_dim}",
                x.dims()
            );
        }
        if x.dtype() != self.weight.dtype() || !x.device().same_device(self.weight.device()) {
            candle_core::bail!(
                "FusedLinear: input is {:?} on {:?}, the weight {:?} on {:?}",
                x.dtype(),
                x.device().location(),
                self.weight.dtype(),
                self.weight.device().location()
            );
        }
        let fused = match x.device() {
            // The CPU runs the same custom op (so its backward is what CI tests),
            // computing with Candle's ops.
            candle_core::Device::Cpu => true,
            d => d.is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F16),
        };
        if !fused {
            return self.forward_unfused(x);
        }
        let rows = x.elem_count() / in_dim;
        let mut out_dims = x.dims().to_vec();
        *out_dims.last_mut().expect("rank >= 1") = self.weight.dim(0)?;
        let x2 = x.reshape((rows, in_dim))?.contiguous()?;
        let keep_z = self.epilogue == Epilogue::BiasGelu
            && (x.track_op() || self.weight.track_op() || self.bias.track_op());
        let op = LtOp {
            epilogue: self.epilogue,
            keep_z,
            z: std::sync::Mutex::new(None),
        };
        let y = x2.apply_op3(&self.weight.contiguous()?, &self.bias.contiguous()?, op)?;
        y.reshape(out_dims)
    }
}

/// A tensor over (a copy of) a contiguous CPU storage.
fn cpu_tensor(s: &candle_core::CpuStorage, l: &candle_core::Layout) -> Result<Tensor> {
    use candle_core::{op::BackpropOp, Storage};
    if !l.is_contiguous() {
        candle_core::bail!("fused-linear: operands must be contiguous");
    }
    let len = match s {
        candle_core::CpuStorage::F32(v) => v.len(),
        candle_core::CpuStorage::F64(v) => v.len(),
        candle_core::CpuStorage::BF16(v) => v.len(),
        candle_core::CpuStorage::F16(v) => v.len(),
        _ => candle_core::bail!("fused-linear: float operands only (f32, f64, bf16, f16)"),
    };
    let all = Tensor::from_storage(Storage::Cpu(s.clone()), len, BackpropOp::none(), false);
    all.narrow(0, l.start_offset(), l.shape().elem_count())?
        .reshape(l.shape())
}

/// The op over `(x: (rows, in), w: (out, in), b: (out,))`: cuBLASLt on CUDA,
/// Candle's ops on the CPU. `z` holds the pre-activation the CUDA forward kept
/// (`keep_z`), so the backward does not recompute it.
struct LtOp {
    epilogue: Epilogue,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    keep_z: bool,
    z: std::sync::Mutex<Option<Tensor>>,
}

impl candle_core::CustomOp3 for LtOp {
    fn name(&self) -> &'static str {
        "fused-linear"
    }

    fn cpu_fwd(
        &self,
        sx: &candle_core::CpuStorage,
        lx: &candle_core::Layout,
        sw: &candle_core::CpuStorage,
        lw: &candle_core::Layout,
        sb: &candle_core::CpuStorage,
        lb: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let lin = FusedLinear::new(cpu_tensor(sw, lw)?, cpu_tensor(sb, lb)?, self.epilogue)?;
        let y = lin.forward_unfused(&cpu_tensor(sx, lx)?)?.contiguous()?;
        let shape = y.shape().clone();
        let (st, l) = y.storage_and_layout();
        match &*st {
            candle_core::Storage::Cpu(c) if l.start_offset() == 0 => Ok((c.clone(), shape)),
            _ => candle_core::bail!("fused-linear: unexpected CPU result layout"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &candle_core::Layout,
        sw: &candle_core::CudaStorage,
        lw: &candle_core::Layout,
        sb: &candle_core::CudaStorage,
        lb: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use candle_core::backend::BackendStorage;
        let (n, k) = lx.shape().dims2()?;
        let (m, _) = lw.shape().dims2()?;
        for (what, l) in [("input", lx), ("weight", lw), ("bias", lb)] {
            if !l.is_contiguous() {
                candle_core::bail!("fused-linear: {what} must be contiguous");
            }
        }
        let (dev, dt) = (sx.device().clone(), sx.dtype());
        let gelu = self.epilogue == Epilogue::BiasGelu;
        let ops = (
            (sx, lx.start_offset()),
            (sw, lw.start_offset()),
            (sb, lb.start_offset()),
        );
        let (y, z) = crate::ops::lt::linear_raw(
            &dev,
            dt,
            ops.0,
            ops.1,
            ops.2,
            (n, m, k),
            gelu,
            self.keep_z,
        )?;
        if let Some(z) = z {
            let z = Tensor::from_storage(
                candle_core::Storage::Cuda(z),
                (n, m),
                candle_core::op::BackpropOp::none(),
                false,
            );
            *self
                .z
                .lock()
                .map_err(|_| candle_core::Error::Msg("fused-linear: lock poisoned".into()))? =
                Some(z);
        }
        Ok((y, candle_core::Shape::from((n, m))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let kept = self
            .z
            .lock()
            .map_err(|_| candle_core::Error::Msg("fused-linear: lock poisoned".into()))?
            .take();
        let z = || match &kept {
            Some(z) => Ok(z.clone()),
            None => x.matmul(&w.t()?)?.broadcast_add(b),
        };
        let dz = match self.epilogue {
            Epilogue::Bias => grad.contiguous()?,
            Epilogue::BiasGelu => {
                (grad.to_dtype(DType::F32)? * gelu_grad(&z()?)?)?.to_dtype(grad.dtype())?
            }
        };
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let (dx, _) = crate::ops::lt::input_grad(&dz, w, None)?;
            let (dw, db) = crate::ops::lt::weight_grad(&dz, x, true)?;
            return Ok((Some(dx), Some(dw), db));
        }
        let dx = dz.matmul(w)?;
        let dw = dz.t()?.matmul(x)?;
        let db = dz.to_dtype(DType::F32)?.sum(0)?.to_dtype(b.dtype())?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}
