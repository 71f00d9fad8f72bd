//! Host bytes that tensors are copied into and out of without waiting: the
//! batched decode's kv cache in host memory (`streamer_models`' `host_kv`).
//!
//! For a CUDA device the bytes are page-locked (cacheable: the host reads
//! them back) and every copy is enqueued on the device's stream and not
//! waited for; the buffer records each copy, and a host access
//! ([`HostBuffer::bytes`], [`HostBuffer::bytes_mut`]) or dropping the buffer
//! first waits for the copies enqueued so far. So no host access can see a
//! copy half done or change bytes a copy still reads, whatever the caller
//! does. For the CPU the bytes are an ordinary vector and copies are plain.
use candle_core::{bail, DType, Device, Result, Shape, Tensor};

/// A strided part of a [`HostBuffer`]: from byte `at`, `blocks` blocks
/// `block_stride` bytes apart, each of `rows` runs of `len` bytes `pitch`
/// bytes apart (e.g. the first slots and positions of every head of a kv
/// cache laid out as `(heads, slots, capacity, head_dim)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// First byte.
    pub at: usize,
    /// Blocks.
    pub blocks: usize,
    /// Bytes from one block's start to the next's.
    pub block_stride: usize,
    /// Runs in a block.
    pub rows: usize,
    /// Bytes from one run's start to the next's.
    pub pitch: usize,
    /// Bytes of a run.
    pub len: usize,
}

impl Region {
    /// `n` bytes from `at`, in one run.
    pub fn flat(at: usize, n: usize) -> Self {
        Self {
            at,
            blocks: 1,
            block_stride: n,
            rows: 1,
            pitch: n,
            len: n,
        }
    }

    /// Bytes the region holds.
    pub fn bytes(&self) -> usize {
        self.blocks * self.rows * self.len
    }

    /// One past the region's last byte (`None` on overflow).
    fn end(&self) -> Option<usize> {
        if self.bytes() == 0 {
            return Some(self.at);
        }
        let last = (self.blocks - 1)
            .checked_mul(self.block_stride)?
            .checked_add((self.rows - 1).checked_mul(self.pitch)?)?;
        self.at.checked_add(last)?.checked_add(self.len)
    }

    /// Each run's first byte, blocks then rows.
    fn runs(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.blocks).flat_map(move |b| {
            (0..self.rows).map(move |r| self.at + b * self.block_stride + r * self.pitch)
        })
    }
}

/// Host bytes with asynchronous copies to and from one device (see the
/// module's documentation).
pub struct HostBuffer {
    inner: Inner,
    device: Device,
}

enum Inner {
    Plain(Vec<u8>),
    #[cfg(feature = "cuda")]
    Pinned(cudarc::driver::PinnedHostSlice<u8>),
}

impl HostBuffer {
    /// `len` zero bytes, page-locked when `device` is a CUDA device.
    pub fn zeroed(len: usize, device: &Device) -> Result<Self> {
        let inner = match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                let ctx = d.cuda_stream().context().clone();
                // SAFETY: the memory is zeroed below before anything reads it.
                let mut p = unsafe { crate::pages::alloc_readable::<u8>(&ctx, len.max(1)) }?;
                zero(p.as_mut_slice().map_err(candle_core::Error::wrap)?);
                Inner::Pinned(p)
            }
            _ => Inner::Plain(vec![0; len]),
        };
        Ok(Self {
            inner,
            device: device.clone(),
        })
    }

    /// The device it was made for.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes held (a CUDA buffer of 0 bytes holds 1).
    pub fn len(&self) -> usize {
        match &self.inner {
            Inner::Plain(v) => v.len(),
            #[cfg(feature = "cuda")]
            Inner::Pinned(p) => p.len(),
        }
    }

    /// Whether it holds no byte.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes, once every copy enqueued so far has completed.
    pub fn bytes(&self) -> Result<&[u8]> {
        match &self.inner {
            Inner::Plain(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Inner::Pinned(p) => p.as_slice().map_err(candle_core::Error::wrap),
        }
    }

    /// The bytes for writing, once every copy enqueued so far has completed.
    pub fn bytes_mut(&mut self) -> Result<&mut [u8]> {
        match &mut self.inner {
            Inner::Plain(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Inner::Pinned(p) => p.as_mut_slice().map_err(candle_core::Error::wrap),
        }
    }

    /// A tensor of `shape` and `dtype` on `device` holding the runs of
    /// `region` one after another (`Region::flat` for plain bytes). On a
    /// CUDA device the copy (one 2D copy a block) is enqueued on its stream,
    /// which runs it before any later work on the tensor; this does not wait
    /// for it.
    pub fn upload_region(
        &self,
        region: Region,
        shape: &Shape,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        self.check_region(region, shape.elem_count() * dtype.size_in_bytes())?;
        let n = region.bytes();
        match (&self.inner, device) {
            #[cfg(feature = "cuda")]
            (Inner::Pinned(p), Device::Cuda(d)) => cuda::upload(p, region, (shape, dtype), d),
            (Inner::Plain(v), _) => {
                let mut packed = Vec::with_capacity(n);
                for at in region.runs() {
                    packed.extend_from_slice(&v[at..at + region.len]);
                }
                Tensor::from_raw_buffer(&packed, dtype, shape.dims(), &Device::Cpu)?
                    .to_device(device)
            }
            #[cfg(feature = "cuda")]
            _ => bail!(
                "host buffer: made for another device than {:?}",
                device.location()
            ),
        }
    }

    /// Enqueues the copy of `region` into `dst` on `stream` (of `dst`'s
    /// device), without waiting for it: for copies that run beside the
    /// compute stream, ordered against it by the caller's events.
    ///
    /// # Safety
    /// `dst` must be a contiguous CUDA tensor of `region.bytes()` bytes; no
    /// work may read or write `dst` until `stream` has passed the copy
    /// (make other streams wait for an event recorded after it), and `dst`
    /// must not be freed before.
    #[cfg(feature = "cuda")]
    pub unsafe fn upload_region_on(
        &self,
        region: Region,
        dst: &Tensor,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> Result<()> {
        if !dst.is_contiguous() {
            bail!("host buffer: a copy into a non-contiguous tensor");
        }
        self.check_region(region, dst.elem_count() * dst.dtype().size_in_bytes())?;
        match &self.inner {
            // SAFETY: the sizes were checked above; the rest is this fn's
            // contract.
            Inner::Pinned(p) => unsafe { cuda::copy_into(p, region, dst, stream) },
            Inner::Plain(_) => bail!("host buffer: not page-locked (made for the CPU)"),
        }
    }

    /// Copies the bytes of `t` (any device) to `at..`. From a CUDA tensor the
    /// copy is enqueued on its device's stream after the work that makes
    /// `t`; this does not wait for it.
    pub fn download(&mut self, at: usize, t: &Tensor) -> Result<()> {
        let n = t.elem_count() * t.dtype().size_in_bytes();
        self.check_region(Region::flat(at, n), n)?;
        let t = t.contiguous()?;
        match (&mut self.inner, t.device()) {
            #[cfg(feature = "cuda")]
            (Inner::Pinned(p), Device::Cuda(_)) => cuda::download(p, at, &t),
            (Inner::Plain(v), _) => {
                let host = t.to_device(&Device::Cpu)?.flatten_all()?;
                v[at..at + n].copy_from_slice(&tensor_bytes(&host)?);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            _ => bail!(
                "host buffer: made for another device than {:?}",
                t.device().location()
            ),
        }
    }

    /// `region` holds a tensor's `n` bytes and lies in the buffer.
    fn check_region(&self, region: Region, n: usize) -> Result<()> {
        if region.bytes() != n {
            bail!(
                "host buffer: a region of {} bytes for a tensor of {n} bytes",
                region.bytes()
            );
        }
        if region.end().is_none_or(|end| end > self.len()) {
            bail!(
                "host buffer: {n} bytes ({region:?}) outside its {} bytes",
                self.len()
            );
        }
        Ok(())
    }
}

/// Zeroes `bytes` with a few threads: page-locked caches run to tens of GB,
/// which one thread fills at about 10 GB/s.
#[cfg(feature = "cuda")]
fn zero(bytes: &mut [u8]) {
    const PIECE: usize = 256 << 20;
    std::thread::scope(|s| {
        for part in bytes.chunks_mut(bytes.len().div_ceil(8).max(PIECE)) {
            s.spawn(move || part.fill(0));
        }
    });
}

/// The native-endian bytes of a one-dimensional host tensor.
fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    macro_rules! bytes {
        ($t:ty) => {
            t.to_vec1::<$t>()?
                .iter()
                .flat_map(|x| x.to_ne_bytes())
                .collect()
        };
    }
    Ok(match t.dtype() {
        DType::BF16 => bytes!(half::bf16),
        DType::F16 => bytes!(half::f16),
        DType::F32 => bytes!(f32),
        DType::F64 => bytes!(f64),
        DType::U32 => bytes!(u32),
        DType::U8 => t.to_vec1::<u8>()?,
        dt => bail!("host buffer: unsupported dtype {dt:?}"),
    })
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::Region;
    use crate::cuda::{check, dtoh_async, CudaMemory};
    use candle_core::{bail, CudaDevice, DType, Device, Result, Shape, Tensor};
    use cudarc::driver::{HostSlice, PinnedHostSlice};

    fn same_context(p: &PinnedHostSlice<u8>, d: &CudaDevice) -> Result<()> {
        if !std::sync::Arc::ptr_eq(p.context(), d.cuda_stream().context()) {
            bail!("host buffer: page-locked for another CUDA context");
        }
        Ok(())
    }

    pub(super) fn upload(
        p: &PinnedHostSlice<u8>,
        r: Region,
        (shape, dtype): (&Shape, DType),
        d: &CudaDevice,
    ) -> Result<Tensor> {
        let dst = Tensor::zeros(shape, dtype, &Device::Cuda(d.clone()))?;
        // SAFETY: `dst` is new and holds `r.bytes()` bytes (checked by the
        // caller); the copy runs on its device's stream, before any later
        // use of it.
        unsafe { copy_into(p, r, &dst, &d.cuda_stream()) }?;
        Ok(dst)
    }

    /// Enqueues the copy of `r` into `dst` on `stream`, one 2D copy a block.
    ///
    /// # Safety
    /// `dst` must be a contiguous CUDA tensor of at least `r.bytes()` bytes
    /// in `p`'s context, and `r` must lie in `p`; nothing may read or write
    /// `dst` until `stream` has passed the copy, nor free it before.
    pub(super) unsafe fn copy_into(
        p: &PinnedHostSlice<u8>,
        r: Region,
        dst: &Tensor,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> Result<()> {
        use cudarc::driver::sys;
        let Device::Cuda(d) = dst.device() else {
            bail!("host buffer: a copy into a non-CUDA tensor")
        };
        same_context(p, d)?;
        if r.bytes() == 0 {
            return Ok(());
        }
        let mem = CudaMemory::of(dst)?;
        let to = mem.address()?;
        // SAFETY: the slice is used only by the copies below, on `stream`;
        // its guard records them on the buffer, whose host accesses and drop
        // wait for them.
        let (src, _record) = unsafe { p.stream_synced_slice(stream) };
        for b in 0..r.blocks {
            // Offsets 0 and no arrays: a plain copy between host and device
            // memory.
            let copy = sys::CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_HOST,
                srcHost: src[r.at + b * r.block_stride..].as_ptr() as *const _,
                srcDevice: 0,
                srcArray: std::ptr::null_mut(),
                srcPitch: r.pitch,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                dstHost: std::ptr::null_mut(),
                dstDevice: to.get() + (b * r.rows * r.len) as u64,
                dstArray: std::ptr::null_mut(),
                dstPitch: r.len,
                WidthInBytes: r.len,
                Height: r.rows,
            };
            // SAFETY: the block's runs lie in the buffer and `dst` holds
            // `blocks x rows x len` bytes (this fn's contract); the buffer
            // outlives the copy (its drop waits for it) and the host writes
            // it only after the copy (`bytes_mut` waits); the caller keeps
            // `dst` untouched and alive until `stream` passes the copy.
            let rc = unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream.cu_stream()) };
            check(rc, "cuMemcpy2DAsync")?;
        }
        Ok(())
    }

    pub(super) fn download(p: &mut PinnedHostSlice<u8>, at: usize, t: &Tensor) -> Result<()> {
        let Device::Cuda(d) = t.device() else {
            bail!("host buffer: download from a non-CUDA tensor")
        };
        same_context(p, d)?;
        let n = t.elem_count() * t.dtype().size_in_bytes();
        if n == 0 {
            return Ok(());
        }
        let stream = d.cuda_stream();
        let mem = CudaMemory::of(t)?;
        let from = mem.address()?;
        // SAFETY: as in `upload`, the guard records the copy on the buffer.
        let (dst, _record) = unsafe { p.stream_synced_mut_slice(&stream) };
        // SAFETY: `dst[at..at + n]` lies in the page-locked buffer (checked by
        // the caller), which the host reads only after the copy (`bytes`
        // waits); `t` holds `n` bytes, read on its own stream in order, and
        // its memory is freed in stream order after the copy.
        unsafe { dtoh_async(dst[at..].as_mut_ptr(), from.get(), n, &stream) }
    }
}
