//! Token embedding with a scatter-add backward.
//!
//! candle-nn's `Embedding` is `index_select`, whose gradient is Candle's
//! `index_add`: on CUDA that kernel loops over every token in one thread per
//! column, 4 ms per 8192 tokens of a 2048-wide table on the H200 (14 % of a
//! two-layer `1b` training step, `benches/results/lm-layer-ncu-h200-fused.txt`). Here the
//! backward adds each token's gradient row into an f32 table with atomics (one
//! block per token), then rounds once to the table's dtype. The CPU keeps
//! Candle's `index_add` in f32.
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

/// Rows of `table (vocab, hidden)` for `ids` (u32, any shape): output
/// `ids.dims() + (hidden,)`, differentiable in the table. An id at or beyond
/// `vocab` is an error on the CPU; on CUDA its row reads as Candle's
/// `index_select` does and its gradient is dropped.
pub fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let (vocab, hidden) = table.dims2()?;
    if ids.dtype() != DType::U32 {
        bail!("embedding: token ids must be u32, got {:?}", ids.dtype());
    }
    if !ids.device().same_device(table.device()) {
        bail!("embedding: token ids and table are on different devices");
    }
    if vocab > i32::MAX as usize || hidden > i32::MAX as usize {
        bail!("embedding: table ({vocab}, {hidden}) is too large for the kernels");
    }
    let mut dims = ids.dims().to_vec();
    let flat = ids.flatten_all()?.contiguous()?;
    let rows = table.contiguous()?.apply_op2(&flat, Embed)?;
    dims.push(hidden);
    rows.reshape(dims)
}

struct Embed;

impl CustomOp2 for Embed {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (vocab, hidden) = l1.shape().dims2()?;
        crate::cross_entropy::token_ids(s2, l2, vocab, "embedding: token id", "position")?;
        let out = s1.index_select(s2, l1, l2, 0)?;
        Ok((out, Shape::from((l2.shape().elem_count(), hidden))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (_, hidden) = l1.shape().dims2()?;
        let out = s1.index_select(s2, l1, l2, 0)?;
        Ok((out, Shape::from((l2.shape().elem_count(), hidden))))
    }

    fn bwd(
        &self,
        table: &Tensor,
        ids: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (vocab, hidden) = table.dims2()?;
        let g = grad.contiguous()?;
        #[cfg(feature = "cuda")]
        if g.device().is_cuda() {
            let (si, li) = ids.storage_and_layout();
            let (sg, lg) = g.storage_and_layout();
            let (candle_core::Storage::Cuda(si), candle_core::Storage::Cuda(sg)) = (&*si, &*sg)
            else {
                bail!("embedding backward: ids and gradient must be on the GPU");
            };
            let acc = crate::ops::decoder::embedding_bwd((si, li), (sg, lg), vocab)?;
            let acc = Tensor::from_storage(
                candle_core::Storage::Cuda(acc),
                (vocab, hidden),
                candle_core::op::BackpropOp::none(),
                false,
            );
            return Ok((Some(acc.to_dtype(table.dtype())?), None));
        }
        let acc = Tensor::zeros((vocab, hidden), DType::F32, g.device())?.index_add(
            ids,
            &g.to_dtype(DType::F32)?,
            0,
        )?;
        Ok((Some(acc.to_dtype(table.dtype())?), None))
    }
}
