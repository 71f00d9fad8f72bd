//! `Linear` with its bias and activation fused into the matrix product.
//!
//! candle-nn's `Linear` runs a GEMM, then a separate broadcast add for the bias,
//! then the activation: three passes over the output, each through Candle's
//! generic element-wise kernels. On CUDA, [`FusedLinear`] is one cuBLASLt call
//! whose epilogue adds the bias and applies GELU (tanh form, like Candle's
//! `gelu`) while the tile is still in registers. Elsewhere (f32 on CUDA, the
//! CPU) it runs the same three Candle ops. Backward (Candle autograd)
//! recomputes the pre-activation with plain ops, so the layer trains like
//! candle-nn's.
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
        let y = x2.apply_op3(
            &self.weight.contiguous()?,
            &self.bias.contiguous()?,
            LtOp(self.epilogue),
        )?;
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

/// `d gelu(z) / dz` for the tanh form, in f32.
fn gelu_grad(z: &Tensor) -> Result<Tensor> {
    const C: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
    const A: f64 = 0.044_715;
    let z = z.to_dtype(DType::F32)?;
    let z2 = z.sqr()?;
    let u = ((&z * (z2.affine(A, 1.0)?))? * C)?;
    let t = u.tanh()?;
    let du = (z2.affine(3.0 * A, 1.0)? * C)?;
    let left = (t.affine(0.5, 0.5))?;
    let right = ((&z * 0.5)? * ((t.sqr()?.affine(-1.0, 1.0))? * du)?)?;
    left + right
}

/// The op over `(x: (rows, in), w: (out, in), b: (out,))`: cuBLASLt on CUDA,
/// Candle's ops on the CPU; backward by Candle's ops on both.
struct LtOp(Epilogue);

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
        let lin = FusedLinear::new(cpu_tensor(sw, lw)?, cpu_tensor(sb, lb)?, self.0)?;
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
        lt::forward(self.0, (sx, lx), (sw, lw), (sb, lb))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dz = match self.0 {
            Epilogue::Bias => grad.clone(),
            Epilogue::BiasGelu => {
                let z = x.matmul(&w.t()?)?.broadcast_add(b)?;
                (grad.to_dtype(DType::F32)? * gelu_grad(&z)?)?.to_dtype(grad.dtype())?
            }
        };
        let dx = dz.matmul(w)?;
        let dw = dz.t()?.matmul(x)?;
        let db = dz.to_dtype(DType::F32)?.sum(0)?.to_dtype(b.dtype())?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

#[cfg(feature = "cuda")]
mod lt {
    use super::Epilogue;
    use candle_core::backend::BackendStorage;
    use candle_core::{CudaStorage, DType, Layout, Result, Shape};
    use cudarc::cublaslt::{Activation, CudaBlasLT, Matmul, MatmulConfig};
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};

    /// One cuBLASLt handle (and its 32 MiB workspace) per compute stream, made on
    /// first use. Keyed by stream, not by GPU: cuBLASLt launches on the handle's
    /// stream, which must be the one the output was allocated on (two Candle
    /// devices on one GPU have different streams).
    fn handle(dev: &candle_core::CudaDevice) -> Result<Arc<CudaBlasLT>> {
        static HANDLES: OnceLock<Mutex<HashMap<usize, Arc<CudaBlasLT>>>> = OnceLock::new();
        let stream = dev.cuda_stream();
        let key = stream.cu_stream() as usize;
        let mut map = HANDLES
            .get_or_init(Default::default)
            .lock()
            .map_err(|_| candle_core::Error::Msg("fused-linear: handle cache poisoned".into()))?;
        if let Some(h) = map.get(&key) {
            return Ok(h.clone());
        }
        let h = Arc::new(CudaBlasLT::new(stream).map_err(candle_core::Error::wrap)?);
        map.insert(key, h.clone());
        Ok(h)
    }

    pub(super) fn forward(
        ep: Epilogue,
        (sx, lx): (&CudaStorage, &Layout),
        (sw, lw): (&CudaStorage, &Layout),
        (sb, lb): (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)> {
        let (rows, k) = lx.shape().dims2()?;
        let (m, _) = lw.shape().dims2()?;
        for (what, l) in [("input", lx), ("weight", lw), ("bias", lb)] {
            if !l.is_contiguous() {
                candle_core::bail!("fused-linear: {what} must be contiguous");
            }
        }
        let dev = sx.device.clone();
        let blas = handle(&dev)?;
        // Column-major view: C (m = out, n = rows) = W (m x k, stored as k x m,
        // transposed) times X^T (k x n, the row-major X as stored).
        let cfg = MatmulConfig {
            transa: true,
            transb: false,
            transc: false,
            m: m as u64,
            n: rows as u64,
            k: k as u64,
            alpha: 1.0,
            lda: k as i64,
            ldb: k as i64,
            beta: 0.0,
            ldc: m as i64,
            stride_a: None,
            stride_b: None,
            stride_c: None,
            stride_bias: None,
            batch_size: None,
        };
        let act = match ep {
            Epilogue::Bias => None,
            Epilogue::BiasGelu => Some(Activation::Gelu),
        };
        macro_rules! run {
            ($t:ty) => {{
                let x = sx.as_cuda_slice::<$t>()?.slice(lx.start_offset()..);
                let w = sw.as_cuda_slice::<$t>()?.slice(lw.start_offset()..);
                let b = sb.as_cuda_slice::<$t>()?.slice(lb.start_offset()..);
                // SAFETY: every element is written by the GEMM (beta = 0).
                let mut out = unsafe { dev.alloc::<$t>(rows * m)? };
                // SAFETY: the sizes above match the buffers (contiguous, checked shapes).
                unsafe { blas.matmul(cfg, &w, &x, &mut out, Some(&b), act.as_ref()) }
                    .map_err(candle_core::Error::wrap)?;
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        let storage = match sx.dtype() {
            DType::BF16 => run!(half::bf16),
            DType::F16 => run!(half::f16),
            dt => candle_core::bail!("fused-linear: CUDA path takes bf16/f16, got {dt:?}"),
        };
        Ok((storage, Shape::from((rows, m))))
    }
}
