//! Moving a tensor to another device by its own elements only.
//!
//! Candle's `Tensor::to_device` copies the whole storage behind a view: one
//! head `narrow`ed out of a 16 GiB host tensor sends all 16 GiB to the GPU, and
//! `contiguous()` first does not help, since such a view already counts as
//! contiguous. [`to_device_compact`] copies such a view's elements on its own
//! device first.
use candle_core::{CpuStorage, Device, Result, Storage, Tensor};

/// `t` on `dev`, moving only `t`'s elements when `t` is a contiguous view of
/// part of a larger storage (a compact copy on `t`'s device first: a plain
/// memcpy there). A strided view moves as Candle moves it, whole storage and
/// all: compacting it on a GPU would take Candle's strided-copy kernel, which
/// indexes in 32 bits.
pub fn to_device_compact(t: &Tensor, dev: &Device) -> Result<Tensor> {
    if t.device().same_device(dev) {
        return Ok(t.clone());
    }
    if t.is_contiguous() && !covers_storage(t) {
        t.force_contiguous()?.to_device(dev)
    } else {
        t.to_device(dev)
    }
}

/// Whether `t` is exactly its storage: contiguous from offset 0, and as long
/// as the storage (a storage whose length is unknown here counts as longer).
pub fn covers_storage(t: &Tensor) -> bool {
    let (storage, layout) = t.storage_and_layout();
    layout.is_contiguous()
        && layout.start_offset() == 0
        && storage_len(&storage) == Some(t.elem_count())
}

/// Elements in a storage, for the dtypes the project moves.
fn storage_len(s: &Storage) -> Option<usize> {
    match s {
        Storage::Cpu(c) => match c {
            CpuStorage::U8(v) => Some(v.len()),
            CpuStorage::U32(v) => Some(v.len()),
            CpuStorage::I64(v) => Some(v.len()),
            CpuStorage::BF16(v) => Some(v.len()),
            CpuStorage::F16(v) => Some(v.len()),
            CpuStorage::F32(v) => Some(v.len()),
            CpuStorage::F64(v) => Some(v.len()),
            _ => None,
        },
        #[cfg(feature = "cuda")]
        Storage::Cuda(c) => cuda_len(c),
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

#[cfg(feature = "cuda")]
fn cuda_len(c: &candle_core::CudaStorage) -> Option<usize> {
    use candle_core::backend::BackendStorage;
    use candle_core::DType;
    use half::{bf16, f16};
    let n = match c.dtype() {
        DType::U8 => c.as_cuda_slice::<u8>().ok()?.len(),
        DType::U32 => c.as_cuda_slice::<u32>().ok()?.len(),
        DType::I64 => c.as_cuda_slice::<i64>().ok()?.len(),
        DType::BF16 => c.as_cuda_slice::<bf16>().ok()?.len(),
        DType::F16 => c.as_cuda_slice::<f16>().ok()?.len(),
        DType::F32 => c.as_cuda_slice::<f32>().ok()?.len(),
        DType::F64 => c.as_cuda_slice::<f64>().ok()?.len(),
        _ => return None,
    };
    Some(n)
}
