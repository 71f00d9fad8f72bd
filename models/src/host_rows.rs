//! The token rows of an embedding table kept on the host (a streamed model's
//! cached decode), brought to the device through one page-locked buffer.
//!
//! A packed step of `generate_batch` feeds thousands of prompt rows: 4,800
//! rows of an 8B model's bf16 table are 39 MB. In `benches/generate.rs` in a
//! 24 GiB cap, about 20 ms of every 275 ms step passed on the host between
//! the step's start and its first layer's launch, the GPU idle and the copy
//! stream idle for most of it (the "decode layers issued" span before the
//! first layer's); the work there that grows with the rows was this lookup:
//! Candle's `index_select` into fresh pageable memory, then its pageable
//! copy. Here the rows are gathered in parallel into a page-locked buffer
//! made once (grown when a step needs more rows) and copied by DMA.
use candle_core::{bail, Device, Result, Tensor};

/// The reused page-locked buffer of [`HostRows::lookup`].
#[derive(Default)]
pub(crate) struct HostRows {
    #[cfg(feature = "cuda")]
    staging: std::sync::Mutex<Option<cuda::Staging>>,
}

impl HostRows {
    /// The rows of `table` (a host `(vocab, hidden)` tensor) for `ids` (u32,
    /// any shape) on `device`, in the table's dtype: shape `ids.dims() +
    /// (hidden,)`. An id at or beyond `vocab` is an error naming it.
    pub(crate) fn lookup(&self, table: &Tensor, ids: &Tensor, device: &Device) -> Result<Tensor> {
        if !table.device().is_cpu() {
            bail!("host embedding lookup: the table is not on the host");
        }
        let ids = ids.to_device(&Device::Cpu)?;
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = device {
            let mut dims = ids.dims().to_vec();
            let flat = ids.flatten_all()?.to_vec1::<u32>()?;
            let mut staging = self
                .staging
                .lock()
                .map_err(|_| candle_core::Error::Msg("host embedding rows poisoned".into()))?;
            let rows = cuda::lookup(&mut staging, table, &flat, d)?;
            dims.push(table.dim(1)?);
            return rows.reshape(dims);
        }
        crate::embedding(&table.detach(), &ids)?.to_device(device)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::PinnedHostSlice;
    use candle_core::{bail, CudaDevice, Device, Result, Tensor};
    use rayon::prelude::*;

    /// Page-locked bytes (write-combined: written here, read by the DMA).
    pub(super) type Staging = PinnedHostSlice<u8>;

    /// `table`'s rows for `ids` as `(ids.len(), hidden)` on `device`,
    /// complete when this returns (so `staging` is free again).
    pub(super) fn lookup(
        staging: &mut Option<Staging>,
        table: &Tensor,
        ids: &[u32],
        device: &CudaDevice,
    ) -> Result<Tensor> {
        let (vocab, hidden) = table.dims2()?;
        if let Some((r, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            bail!("embedding: token id {id} of position {r} is outside the vocabulary of {vocab}");
        }
        let row = hidden * table.dtype().size_in_bytes();
        let bytes = ids.len() * row;
        let shape = candle_core::Shape::from((ids.len(), hidden));
        if bytes == 0 {
            return Tensor::zeros(shape, table.dtype(), &Device::Cuda(device.clone()));
        }
        let buf = buffer(staging, device, bytes)?;
        let table = table.contiguous()?;
        let (src, n) = streamer_core::host_bytes(&table)?;
        // SAFETY: `host_bytes` gives the contiguous table's own storage, which
        // `table` keeps alive and unchanged for this scope.
        let src = unsafe { std::slice::from_raw_parts(src, n) };
        let out = buf.as_mut_slice().map_err(candle_core::Error::wrap)?;
        out[..bytes]
            .par_chunks_mut(row)
            .zip(ids.par_iter())
            .for_each(|(o, &id)| o.copy_from_slice(&src[id as usize * row..][..row]));
        // Complete when it returns, so the buffer is free for the next step.
        streamer_core::upload(&out[..bytes], &shape, table.dtype(), device)
    }

    /// The staging buffer of `device`'s context with room for `bytes`,
    /// replaced by a larger one (half as large again) when it has not.
    fn buffer<'a>(
        staging: &'a mut Option<Staging>,
        device: &CudaDevice,
        bytes: usize,
    ) -> Result<&'a mut PinnedHostSlice<u8>> {
        let ctx = device.cuda_stream().context().clone();
        let fits = staging
            .as_ref()
            .is_some_and(|s| s.len() >= bytes && std::sync::Arc::ptr_eq(s.context(), &ctx));
        if !fits {
            *staging = None; // freed before the larger one is made
            let len = bytes + bytes / 2;
            // SAFETY: the buffer's bytes are only read after `lookup` writes
            // them (it copies the first `bytes` it has just filled).
            let buf = unsafe { ctx.alloc_pinned::<u8>(len) }.map_err(candle_core::Error::wrap)?;
            *staging = Some(buf);
        }
        Ok(staging.as_mut().expect("set above"))
    }
}
