//! Raw CUDA work of the pool: launches of our conversion, comparison and
//! delay kernels, slot allocation and views over slots. The copies and the
//! memory-pool queries are `streamer_device`'s.
use candle_core::{CudaDevice, DType, Result, Tensor};
use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
pub(crate) use streamer_device::cuda::{dtoh_async, htod_async};
use streamer_device::grid_stride;

/// Bytes a master takes in a staging buffer (256-byte aligned for the casts).
pub(crate) fn stage_len(bytes: usize) -> usize {
    bytes.div_ceil(256) * 256
}

/// Whether our cast kernel covers this conversion.
pub(crate) fn has_cast(from: DType, to: DType) -> bool {
    matches!(
        (from, to),
        (DType::F32, DType::BF16)
            | (DType::F32, DType::F16)
            | (DType::BF16, DType::F32)
            | (DType::F16, DType::F32)
    )
}

/// Enqueues our cast kernel on `stream`, converting `n` elements at `src` into `dst`.
///
/// # Safety
/// `src` and `dst` must be device buffers of at least `n` elements of `from`/`to`,
/// alive until the stream passes the kernel.
pub(crate) unsafe fn cast(
    dev: &CudaDevice,
    stream: &CudaStream,
    from: DType,
    src: u64,
    to: DType,
    dst: u64,
    n: usize,
) -> Result<()> {
    let name = match (from, to) {
        (DType::F32, DType::BF16) => "cast_f32_bf16",
        (DType::F32, DType::F16) => "cast_f32_f16",
        (DType::BF16, DType::F32) => "cast_bf16_f32",
        (DType::F16, DType::F32) => "cast_f16_f32",
        _ => candle_core::bail!("no cast kernel from {from:?} to {to:?}"),
    };
    if n == 0 {
        return Ok(());
    }
    let func = streamer_kernels::function(dev, &streamer_kernels::CAST, name)?;
    let cfg = grid_stride(n);
    let mut b = stream.launch_builder(&func);
    b.arg(&src).arg(&dst).arg(&n);
    // SAFETY: the kernel reads n elements at `src` and writes n at `dst`, which
    // the caller guarantees are live device buffers of those dtypes.
    unsafe { b.launch(cfg) }.map_err(candle_core::Error::wrap)?;
    Ok(())
}

/// Enqueues a kernel on `stream` that sets the u32 at `flag` to 1 when the `n`
/// bytes at `x` and `y` differ (it leaves it alone when they are equal).
///
/// # Safety
/// `x` and `y` must be 16-byte aligned device buffers of at least `n` bytes and
/// `flag` a device u32, all alive until the stream passes the kernel.
pub(crate) unsafe fn bytes_differ(
    dev: &CudaDevice,
    stream: &CudaStream,
    (x, y, n): (u64, u64, usize),
    flag: u64,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let func = streamer_kernels::function(dev, &streamer_kernels::CAST, "bytes_differ")?;
    let mut l = stream.launch_builder(&func);
    l.arg(&x).arg(&y).arg(&n).arg(&flag);
    // SAFETY: the kernel reads n bytes at x and y and writes one u32 at flag,
    // which the caller guarantees are live device memory.
    unsafe { l.launch(grid_stride(n / 16)) }.map_err(candle_core::Error::wrap)?;
    Ok(())
}

/// Allocates a flat device tensor of `elems` elements of `dtype` and returns it with
/// its raw device address (stable for the tensor's life), for the pool's slots.
pub(crate) fn alloc_flat(
    dev: &CudaDevice,
    dtype: DType,
    elems: usize,
) -> Result<(candle_core::Tensor, u64)> {
    use candle_core::{op::BackpropOp, CudaStorage, Storage, Tensor};
    use cudarc::driver::DevicePtr;
    let stream = dev.cuda_stream();
    macro_rules! alloc {
        ($t:ty) => {{
            let s = dev.alloc_zeros::<$t>(elems)?;
            let ptr = {
                let (p, _guard) = s.device_ptr(&stream);
                p
            };
            (CudaStorage::wrap_cuda_slice(s, dev.clone()), ptr)
        }};
    }
    let (storage, ptr) = match dtype {
        DType::BF16 => alloc!(half::bf16),
        DType::F16 => alloc!(half::f16),
        DType::F32 => alloc!(f32),
        DType::F64 => alloc!(f64),
        dt => candle_core::bail!("slots hold float weights, got {dt:?}"),
    };
    let t = Tensor::from_storage(Storage::Cuda(storage), elems, BackpropOp::none(), false);
    Ok((t, ptr))
}

/// Enqueues a kernel that waits `ns` nanoseconds on `stream` (slow-transfer tests).
pub(crate) fn delay(dev: &CudaDevice, stream: &CudaStream, ns: u64) -> Result<()> {
    let func = streamer_kernels::function(dev, &streamer_kernels::DELAY, "spin_ns")?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&func);
    b.arg(&ns);
    // SAFETY: the kernel takes one u64 by value and touches no memory.
    unsafe { b.launch(cfg) }.map_err(candle_core::Error::wrap)?;
    Ok(())
}

/// A u8 Candle tensor over `len` bytes of existing device memory at `ptr`
/// (a packed master in a slot).
///
/// # Safety
/// `ptr` must point to `len` bytes inside an allocation that outlives the
/// tensor, and the tensor's storage must never be dropped (it would free
/// memory it does not own): the pool forgets a clone of it.
pub(crate) unsafe fn alias_bytes(dev: &CudaDevice, ptr: u64, len: usize) -> Result<Tensor> {
    // SAFETY: `ptr` holds `len` bytes inside an allocation that outlives the
    // slice, which is never dropped (the caller forgets it): this fn's contract.
    let slice = unsafe { dev.cuda_stream().upgrade_device_ptr::<u8>(ptr, len) };
    Ok(streamer_device::slice_tensor(slice, dev, len))
}

/// A variable of `dtype` and `shape` over device memory at `ptr` (see
/// [`alias_bytes`] for the contract: the same, for variables).
///
/// # Safety
/// As [`alias_bytes`].
pub(crate) unsafe fn alias_var(
    dev: &CudaDevice,
    ptr: u64,
    dtype: DType,
    shape: &candle_core::Shape,
) -> Result<candle_core::Var> {
    use candle_core::{op::BackpropOp, CudaStorage, Storage, Tensor};
    let stream = dev.cuda_stream();
    let n = shape.elem_count();
    // SAFETY (each arm): `ptr` holds n elements of this dtype inside an
    // allocation that outlives the slice, which is never dropped (the caller
    // forgets it): this fn's contract.
    let storage = match dtype {
        DType::BF16 => CudaStorage::wrap_cuda_slice(
            unsafe { stream.upgrade_device_ptr::<half::bf16>(ptr, n) },
            dev.clone(),
        ),
        DType::F16 => CudaStorage::wrap_cuda_slice(
            unsafe { stream.upgrade_device_ptr::<half::f16>(ptr, n) },
            dev.clone(),
        ),
        DType::F32 => CudaStorage::wrap_cuda_slice(
            unsafe { stream.upgrade_device_ptr::<f32>(ptr, n) },
            dev.clone(),
        ),
        DType::F64 => CudaStorage::wrap_cuda_slice(
            unsafe { stream.upgrade_device_ptr::<f64>(ptr, n) },
            dev.clone(),
        ),
        dt => candle_core::bail!("slots hold float weights, got {dt:?}"),
    };
    let t = Tensor::from_storage(
        Storage::Cuda(storage),
        shape.clone(),
        BackpropOp::none(),
        true,
    );
    candle_core::Var::from_tensor(&t)
}
