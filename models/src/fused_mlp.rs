//! The GELU MLP block `down(gelu(up(x)))` with a backward written out.
//!
//! As a `Module` it is two [`FusedLinear`]s (Candle autograd works through
//! it). As a streamed block it also implements
//! [`streamer_core::ManualBackward`]: the training forward keeps the input,
//! the pre-activation `z` and `h = gelu(z)`, and the backward is four GEMMs on
//! CUDA (bf16/f16) with everything else in their cuBLASLt epilogues:
//!
//! | GEMM | epilogue | gives |
//! | --- | --- | --- |
//! | `g^T h` | `BGRADB` | `dW_down`, `db_down` |
//! | `g W_down` | none, then one `gelu'` pass | `dz = (g W_down) * gelu'(z)` |
//! | `dz^T x` | `BGRADB` | `dW_up`, `db_up` |
//! | `dz W_up` | none | `dx` |
//!
//! No recomputed GEMM and one element-wise pass: cuBLASLt's `DGELU_BGRAD`
//! epilogue would fuse it, but measured slower than the plain GEMM plus the
//! pass on the H200 (`benches/results/gemm-h200.json`). Elsewhere (the CPU, f32) the
//! same formulas run as Candle ops: that path is the reference the tests hold
//! the CUDA path to.
use crate::ops::gelu::gelu_grad;
use crate::{Epilogue, FusedLinear};
use candle_core::{DType, Module, Result, Shape, Tensor};
use candle_nn::VarBuilder;
use streamer_core::{Block, ManualBackward, SavedActivations};

/// `down(gelu(up(x)))`, weights in candle-nn `Linear` layout: `up.weight`
/// `(hidden, dim)`, `up.bias` `(hidden,)`, `down.weight` `(dim, hidden)`,
/// `down.bias` `(dim,)`. Input `(..., dim)`, output `(..., dim)`.
#[derive(Clone, Debug)]
pub struct FusedMlp {
    up_w: Tensor,
    up_b: Tensor,
    down_w: Tensor,
    down_b: Tensor,
}

/// A [`FusedMlp`] reading `up.*` and `down.*` from `vb`.
pub fn fused_mlp(dim: usize, hidden: usize, vb: VarBuilder) -> Result<FusedMlp> {
    let up = vb.pp("up");
    let down = vb.pp("down");
    FusedMlp::new(
        up.get((hidden, dim), "weight")?,
        up.get(hidden, "bias")?,
        down.get((dim, hidden), "weight")?,
        down.get(dim, "bias")?,
    )
}

impl FusedMlp {
    /// From the two layers' weights and biases (one dtype, one device).
    pub fn new(up_w: Tensor, up_b: Tensor, down_w: Tensor, down_b: Tensor) -> Result<Self> {
        let (hidden, dim) = up_w.dims2()?;
        let want: [(&str, &Tensor, Vec<usize>); 3] = [
            ("up.bias", &up_b, vec![hidden]),
            ("down.weight", &down_w, vec![dim, hidden]),
            ("down.bias", &down_b, vec![dim]),
        ];
        for (name, t, dims) in want {
            if t.dims() != dims.as_slice() || t.dtype() != up_w.dtype() {
                candle_core::bail!(
                    "FusedMlp: {name} must be {dims:?} {:?} (up.weight is {:?}), got {:?} {:?}",
                    up_w.dtype(),
                    up_w.dims(),
                    t.dims(),
                    t.dtype()
                );
            }
            if !t.device().same_device(up_w.device()) {
                candle_core::bail!("FusedMlp: {name} is on another device than up.weight");
            }
        }
        Ok(Self {
            up_w,
            up_b,
            down_w,
            down_b,
        })
    }

    fn dims(&self) -> (usize, usize) {
        let (hidden, dim) = self.up_w.dims2().expect("checked in new");
        (dim, hidden)
    }

    /// Whether this input runs the cuBLASLt path.
    fn fused(&self, x: &Tensor) -> bool {
        x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F16)
    }

    /// `x` as `(rows, dim)` after checking it, and the output's dims.
    fn rows(&self, x: &Tensor) -> Result<(Tensor, Vec<usize>)> {
        let (dim, _) = self.dims();
        if x.dims().last() != Some(&dim) || x.dtype() != self.up_w.dtype() {
            candle_core::bail!(
                "FusedMlp: input {:?} {:?} must end in {dim} and be {:?}",
                x.dims(),
                x.dtype(),
                self.up_w.dtype()
            );
        }
        if !x.device().same_device(self.up_w.device()) {
            candle_core::bail!("FusedMlp: input is on another device than the weights");
        }
        let rows = x.elem_count() / dim;
        Ok((x.reshape((rows, dim))?.contiguous()?, x.dims().to_vec()))
    }
}

impl Module for FusedMlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let up = FusedLinear::new(self.up_w.clone(), self.up_b.clone(), Epilogue::BiasGelu)?;
        let down = FusedLinear::new(self.down_w.clone(), self.down_b.clone(), Epilogue::Bias)?;
        down.forward(&up.forward(x)?)
    }
}

impl Block for FusedMlp {
    fn forward(&self, x: &Tensor, _extras: &[Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![Module::forward(self, x)?])
    }

    fn manual(&self) -> Option<&dyn ManualBackward> {
        Some(self)
    }
}

impl FusedMlp {
    /// The saved activations `[x, z, h]` (`x` as rows): the up projection,
    /// keeping its pre-activation.
    fn up_saved(&self, x2: Tensor) -> Result<SavedActivations> {
        let (z, h) = if self.fused(&x2) {
            #[cfg(feature = "cuda")]
            {
                let (h, z) = crate::ops::lt::linear(&x2, &self.up_w, &self.up_b, true, true)?;
                (z.expect("asked for the pre-activation"), h)
            }
            #[cfg(not(feature = "cuda"))]
            unreachable!("no CUDA tensors without the cuda feature")
        } else {
            let z = x2.matmul(&self.up_w.t()?)?.broadcast_add(&self.up_b)?;
            let h = z.gelu()?;
            (z, h)
        };
        Ok(SavedActivations(vec![x2, z, h]))
    }
}

impl ManualBackward for FusedMlp {
    fn forward_train(&self, x: &Tensor, _extras: &[Tensor]) -> Result<(Tensor, SavedActivations)> {
        let (x2, dims) = self.rows(x)?;
        let saved = self.up_saved(x2)?;
        let h = &saved.0[2];
        let y = if self.fused(h) {
            #[cfg(feature = "cuda")]
            {
                crate::ops::lt::linear(h, &self.down_w, &self.down_b, false, false)?.0
            }
            #[cfg(not(feature = "cuda"))]
            unreachable!("no CUDA tensors without the cuda feature")
        } else {
            h.matmul(&self.down_w.t()?)?.broadcast_add(&self.down_b)?
        };
        Ok((y.reshape(dims)?, saved))
    }

    /// Backward reads `x`, `z` and `h`, never the output: the recompute skips
    /// the down projection (half of the block's forward FLOPs).
    fn recompute_ctx(
        &self,
        x: &Tensor,
        _extras: &[Tensor],
        _ctx: &streamer_core::BlockCtx,
    ) -> Result<SavedActivations> {
        self.up_saved(self.rows(x)?.0)
    }

    fn saved_bytes(&self, x: &Shape, dtype: DType) -> usize {
        let (dim, hidden) = self.dims();
        let rows = x.elem_count() / dim.max(1);
        rows * (dim + 2 * hidden) * dtype.size_in_bytes()
    }

    fn backward(
        &self,
        saved: SavedActivations,
        grad: &Tensor,
    ) -> Result<(Tensor, Vec<(Tensor, Tensor)>)> {
        let [x, z, h]: [Tensor; 3] = saved.0.try_into().map_err(|_| {
            candle_core::Error::Msg(
                "FusedMlp: backward needs the 3 saved activations of its forward".into(),
            )
        })?;
        let (dim, _) = self.dims();
        let (rows, _) = x.dims2()?;
        if grad.elem_count() != rows * dim || grad.dtype() != x.dtype() {
            candle_core::bail!(
                "FusedMlp: output gradient {:?} {:?} does not match the forward's output ({rows}, {dim}) {:?}",
                grad.dims(),
                grad.dtype(),
                x.dtype()
            );
        }
        let g = grad.reshape((rows, dim))?.contiguous()?;
        let (dx, dw1, db1, dw2, db2) = if self.fused(&g) {
            self.backward_fused(&x, &z, &h, &g)?
        } else {
            self.backward_ops(&x, &z, &h, &g)?
        };
        let grads = vec![
            (self.up_w.clone(), dw1),
            (self.up_b.clone(), db1),
            (self.down_w.clone(), dw2),
            (self.down_b.clone(), db2),
        ];
        Ok((dx.reshape(grad.dims())?, grads))
    }
}

type MlpGrads = (Tensor, Tensor, Tensor, Tensor, Tensor);

impl FusedMlp {
    #[cfg(feature = "cuda")]
    fn backward_fused(&self, x: &Tensor, z: &Tensor, h: &Tensor, g: &Tensor) -> Result<MlpGrads> {
        use crate::ops::lt::{input_grad, weight_grad};
        let missing =
            || candle_core::Error::Msg("FusedMlp: cuBLASLt returned no bias gradient".into());
        let (dw2, db2) = weight_grad(g, h, true)?;
        // A plain GEMM and one GELU' pass: the GEMM's DGELU_BGRAD epilogue
        // took 9.27 ms where the plain GEMM takes 6.92 (w4096 h16384, 32K
        // rows, H200); the bias gradient comes free from the next GEMM's
        // BGRADB instead.
        let (dh, _) = input_grad(g, &self.down_w, None)?;
        let dz = crate::ops::decoder::gelu_backward(&dh, z)?;
        drop(dh);
        let (dw1, db1) = weight_grad(&dz, x, true)?;
        let (dx, _) = input_grad(&dz, &self.up_w, None)?;
        Ok((
            dx,
            dw1,
            db1.ok_or_else(missing)?,
            dw2,
            db2.ok_or_else(missing)?,
        ))
    }

    #[cfg(not(feature = "cuda"))]
    fn backward_fused(&self, x: &Tensor, z: &Tensor, h: &Tensor, g: &Tensor) -> Result<MlpGrads> {
        self.backward_ops(x, z, h, g)
    }

    /// The backward as Candle ops (bias sums and GELU' in f32).
    fn backward_ops(&self, x: &Tensor, z: &Tensor, h: &Tensor, g: &Tensor) -> Result<MlpGrads> {
        let dt = g.dtype();
        let col_sum = |t: &Tensor| t.to_dtype(DType::F32)?.sum(0)?.to_dtype(dt);
        let dw2 = g.t()?.matmul(h)?;
        let db2 = col_sum(g)?;
        let dh = g.matmul(&self.down_w)?;
        let dz = (dh.to_dtype(DType::F32)? * gelu_grad(z)?)?.to_dtype(dt)?;
        let db1 = col_sum(&dz)?;
        let dw1 = dz.t()?.matmul(x)?;
        let dx = dz.matmul(&self.up_w)?;
        Ok((dx, dw1, db1, dw2, db2))
    }
}
