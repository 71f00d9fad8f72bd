//! The one way this crate launches its CUDA kernels (`kernels/src/decoder.cu`)
//! on Candle storages: [`launch`] finds `{kernel}_{dtype}`, checks that every
//! buffer has the dtype the kernel takes, keeps a typed view of each buffer
//! alive across the launch, and returns driver failures as Candle errors.
//! [`View`] and [`device_ptr_mut`] give cuBLASLt (`lt.rs`) the same typed
//! access, so no caller matches on dtypes itself.
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Shape};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaStream, CudaView, DevicePtr, DevicePtrMut, LaunchArgs, LaunchConfig, PushKernelArg,
    SyncOnDrop,
};
use half::{bf16, f16};

pub(crate) use streamer_device::grid_stride as grid;

/// One kernel argument, in the kernel's parameter order.
pub(crate) enum Arg<'a> {
    /// A buffer of the launch's dtype (the kernel's `T*`), from an element offset.
    Buf(&'a CudaStorage, usize),
    /// A `float*` buffer from an element offset, whatever the launch's dtype.
    F32Buf(&'a CudaStorage, usize),
    /// A `uint32_t*` buffer from an element offset (token ids, targets).
    U32Buf(&'a CudaStorage, usize),
    /// A null pointer: an optional operand that is absent.
    Null,
    /// An `int`.
    I32(i32),
    /// A `float`.
    F32(f32),
    /// A `size_t`.
    Usize(usize),
}

/// The elements of a storage from an offset, typed by its dtype.
pub(crate) enum View<'a> {
    Bf16(CudaView<'a, bf16>),
    F16(CudaView<'a, f16>),
    F32(CudaView<'a, f32>),
    U32(CudaView<'a, u32>),
}

impl<'a> View<'a> {
    /// `s` from element `offset`, which must be of dtype `want`.
    pub(crate) fn of(s: &'a CudaStorage, offset: usize, want: DType) -> Result<Self> {
        if s.dtype() != want {
            bail!("kernel operand: {:?} where {want:?} is expected", s.dtype());
        }
        Ok(match &s.slice {
            CudaStorageSlice::BF16(x) => View::Bf16(x.slice(offset..)),
            CudaStorageSlice::F16(x) => View::F16(x.slice(offset..)),
            CudaStorageSlice::F32(x) => View::F32(x.slice(offset..)),
            CudaStorageSlice::U32(x) => View::U32(x.slice(offset..)),
            _ => bail!("kernel operand: no kernel takes {:?}", s.dtype()),
        })
    }

    fn push<'b>(&'b self, b: &mut LaunchArgs<'b>) {
        match self {
            View::Bf16(v) => b.arg(v),
            View::F16(v) => b.arg(v),
            View::F32(v) => b.arg(v),
            View::U32(v) => b.arg(v),
        };
    }

    /// The device address, with the guard that must live until the work
    /// using it is enqueued.
    pub(crate) fn device_ptr<'s>(
        &'s self,
        stream: &'s CudaStream,
    ) -> (CUdeviceptr, SyncOnDrop<'s>) {
        match self {
            View::Bf16(v) => v.device_ptr(stream),
            View::F16(v) => v.device_ptr(stream),
            View::F32(v) => v.device_ptr(stream),
            View::U32(v) => v.device_ptr(stream),
        }
    }
}

/// The device address of a whole storage for writing, with its guard.
pub(crate) fn device_ptr_mut<'s>(
    s: &'s mut CudaStorage,
    stream: &'s CudaStream,
) -> Result<(CUdeviceptr, SyncOnDrop<'s>)> {
    let dt = s.dtype();
    Ok(match &mut s.slice {
        CudaStorageSlice::BF16(x) => x.device_ptr_mut(stream),
        CudaStorageSlice::F16(x) => x.device_ptr_mut(stream),
        CudaStorageSlice::F32(x) => x.device_ptr_mut(stream),
        _ => bail!("kernel output: no kernel writes {dt:?}"),
    })
}

/// A fresh storage of `n` elements of `dt`.
///
/// # Safety
/// The contents are uninitialised: the caller's kernel must write every
/// element before anything reads it.
pub(crate) unsafe fn alloc(dev: &CudaDevice, dt: DType, n: usize) -> Result<CudaStorage> {
    // SAFETY: forwarded from the caller.
    unsafe { dev.alloc_uninit(&Shape::from(n), dt) }
}

/// A zeroed storage of `n` elements of `dt`.
pub(crate) fn zeros(dev: &CudaDevice, dt: DType, n: usize) -> Result<CudaStorage> {
    dev.zeros_impl(&Shape::from(n), dt)
}

/// What is pushed for one [`Arg`]: buffers as typed views, scalars by value.
enum Bound<'a> {
    View(View<'a>),
    Ptr(u64),
    I32(i32),
    F32(f32),
    Usize(usize),
}

impl<'a> Arg<'a> {
    fn bind(&self, dt: DType) -> Result<Bound<'a>> {
        Ok(match *self {
            Arg::Buf(s, o) => Bound::View(View::of(s, o, dt)?),
            Arg::F32Buf(s, o) => Bound::View(View::of(s, o, DType::F32)?),
            Arg::U32Buf(s, o) => Bound::View(View::of(s, o, DType::U32)?),
            Arg::Null => Bound::Ptr(0),
            Arg::I32(v) => Bound::I32(v),
            Arg::F32(v) => Bound::F32(v),
            Arg::Usize(v) => Bound::Usize(v),
        })
    }
}

/// Launches `decoder.cu`'s `{kernel}_{dt}` (dt: bf16, f16 or f32) on `dev`'s
/// stream with `args` in order, after checking every buffer's dtype.
///
/// # Safety
/// `args` must be the kernel's parameters in order and type, and each buffer
/// must hold, past its offset, every element the kernel reads or writes under
/// `cfg`; an output's contents are the kernel's to write.
pub(crate) unsafe fn launch(
    dev: &CudaDevice,
    kernel: &str,
    dt: DType,
    cfg: LaunchConfig,
    args: &[Arg<'_>],
) -> Result<()> {
    let suffix = streamer_device::kernel_suffix(dt, "decoder kernels")?;
    let name = format!("{kernel}_{suffix}");
    let f = streamer_kernels::function(dev, &streamer_kernels::DECODER, &name)?.into_function();
    let bound = args
        .iter()
        .map(|a| a.bind(dt))
        .collect::<Result<Vec<_>>>()?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    for a in &bound {
        match a {
            Bound::View(v) => v.push(&mut b),
            Bound::Ptr(p) => {
                b.arg(p);
            }
            Bound::I32(v) => {
                b.arg(v);
            }
            Bound::F32(v) => {
                b.arg(v);
            }
            Bound::Usize(v) => {
                b.arg(v);
            }
        }
    }
    // SAFETY: the caller guarantees the parameters and the buffers' sizes; the
    // views in `bound` live until the launch is enqueued.
    unsafe { b.launch(cfg) }.map_err(candle_core::Error::wrap)?;
    Ok(())
}

/// The start offset of a contiguous operand, or an error naming it.
pub(crate) fn contiguous(l: &Layout, what: &str) -> Result<usize> {
    if !l.is_contiguous() {
        bail!(
            "decoder kernels: {what} must be contiguous, got {:?}",
            l.shape()
        );
    }
    Ok(l.start_offset())
}

/// One 256-thread block per row.
pub(crate) fn row_grid(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}
