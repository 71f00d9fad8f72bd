//! Dtype conversion that uses the project's own cast kernel on CUDA (the kernel
//! the pool runs after copying f32 masters for bf16/f16 compute).
use candle_core::{DType, Result, Tensor};

/// Converts `t` to `dtype`. On CUDA, f32 <-> bf16/f16 runs our cast kernel on the
/// device's stream; everything else (and the CPU) uses Candle's `to_dtype`. Both
/// round to nearest even, so the results are identical.
pub fn convert(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        return Ok(t.clone());
    }
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = t.device() {
        if crate::cuda::has_cast(t.dtype(), dtype) {
            let src = t.contiguous()?;
            let n = src.elem_count();
            let (dst, dst_ptr) = crate::cuda::alloc_flat(dev, dtype, n)?;
            let mem = streamer_device::CudaMemory::of(&src)?;
            let src_ptr = mem.address()?;
            let stream = dev.cuda_stream();
            // SAFETY: both buffers hold n elements and live (src via `src`, dst via
            // `dst`) past the kernel, which runs on the same stream as their users.
            unsafe {
                crate::cuda::cast(dev, &stream, src.dtype(), src_ptr.get(), dtype, dst_ptr, n)?
            };
            drop(src_ptr);
            drop(mem);
            return dst.reshape(t.shape());
        }
    }
    t.to_dtype(dtype)
}
