//! Device-to-host offload of gradients on a dedicated stream, into page-locked
//! host buffers allocated once, overlapping the compute that follows.
//!
//! On CUDA: the offload stream waits for an event recorded on the compute stream
//! after the gradient was produced, copies it to the host, and records a done
//! event. The device gradient is kept alive until the compute stream has been
//! told to wait for that event, so its memory is not reused before the copy.
//! On the CPU the copy is a plain in-place memory copy.
use candle_core::{DType, Device, Result, Shape, Tensor};

/// A page-locked bounce buffer and the `(host address, offset, len)` pieces
/// that land in it.
#[cfg(feature = "cuda")]
type Bounce = (
    cudarc::driver::PinnedHostSlice<u8>,
    Vec<(usize, usize, usize)>,
);

#[cfg(feature = "cuda")]
struct Pending {
    keep: Vec<Tensor>,
    done: cudarc::driver::CudaEvent,
    start: cudarc::driver::CudaEvent,
    bytes: u64,
    /// The partial pages at the ends of the host buffer are not page-locked: they
    /// land in this page-locked bounce buffer and are copied over on the CPU
    /// after `done`, as `(host address, bounce offset, len)`.
    bounce: Option<Bounce>,
}

/// A point in the offload stream: waiting on it waits for every copy enqueued
/// before it was taken. Can be waited on from another thread.
pub struct OffloadMarker {
    #[cfg(feature = "cuda")]
    event: Option<cudarc::driver::CudaEvent>,
}

impl OffloadMarker {
    /// Blocks the calling thread until the copies before the marker have landed.
    pub fn wait(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(e) = &self.event {
            e.synchronize().map_err(candle_core::Error::wrap)?;
        }
        Ok(())
    }
}

/// Queue of device-to-host copies (see the module docs).
pub struct Offloader {
    device: Device,
    /// Host buffers handed out by `host_buffer`, kept page-locked while alive
    /// (the registration first in the pair, so it is dropped before the memory).
    #[cfg(feature = "cuda")]
    pins: Vec<(Option<crate::cuda::PinnedRegion>, Tensor)>,
    #[cfg(feature = "cuda")]
    stream: Option<std::sync::Arc<cudarc::driver::CudaStream>>,
    #[cfg(feature = "cuda")]
    pending: Vec<Pending>,
    bytes: u64,
    seconds: f64,
}

impl Offloader {
    /// An offloader for gradients computed on `device`.
    pub fn new(device: &Device) -> Result<Self> {
        #[cfg(feature = "cuda")]
        let stream = match device {
            Device::Cuda(d) => Some(
                d.cuda_stream()
                    .context()
                    .new_stream()
                    .map_err(candle_core::Error::wrap)?,
            ),
            _ => None,
        };
        Ok(Self {
            device: device.clone(),
            #[cfg(feature = "cuda")]
            pins: Vec::new(),
            #[cfg(feature = "cuda")]
            stream,
            #[cfg(feature = "cuda")]
            pending: Vec::new(),
            bytes: 0,
            seconds: 0.0,
        })
    }

    /// A zeroed host buffer, page-locked when offloading from a GPU. Allocate
    /// these once and reuse them.
    pub fn host_buffer(&mut self, shape: &Shape, dtype: DType) -> Result<Tensor> {
        let t = Tensor::zeros(shape, dtype, &Device::Cpu)?;
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = &self.device {
            let (ptr, bytes) = crate::host::host_bytes(&t)?;
            let pin = crate::cuda::PinnedRegion::register(
                d.cuda_stream().context(),
                ptr as *mut u8,
                bytes,
            )?;
            self.pins.push((pin, t.clone()));
        }
        Ok(t)
    }

    /// Enqueues the copy of `src` (on the device, any layout) into `dst` (a host
    /// buffer from [`Self::host_buffer`] with the same shape and dtype). `dst`
    /// must not be read before [`Self::synchronize`].
    pub fn enqueue(&mut self, src: &Tensor, dst: &Tensor) -> Result<()> {
        if src.shape() != dst.shape() || src.dtype() != dst.dtype() {
            candle_core::bail!(
                "offload: source {:?} {:?} does not match host buffer {:?} {:?}",
                src.dims(),
                src.dtype(),
                dst.dims(),
                dst.dtype()
            );
        }
        let bytes = (src.elem_count() * src.dtype().size_in_bytes()) as u64;
        self.bytes += bytes;
        match &self.device {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                use cudarc::driver::sys::CUevent_flags;
                let w = candle_core::Error::wrap;
                let src = src.contiguous()?;
                let stream = self.stream.as_ref().expect("cuda offloader has a stream");
                let compute = d.cuda_stream();
                let ready = compute.record_event(None).map_err(w)?;
                stream.wait(&ready).map_err(w)?;
                let start = stream
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(w)?;
                let (host, n) = crate::host::host_bytes(dst)?;
                let dev_ptr = crate::cuda::device_ptr(&src)?;
                let pieces: Vec<_> = crate::cuda::page_pieces(host as usize, n).collect();
                let ends: usize = pieces.iter().filter(|p| !p.2).map(|p| p.1).sum();
                let mut bounce = if ends > 0 {
                    // SAFETY: every byte read back from it is first written by a copy below.
                    let b = unsafe {
                        d.cuda_stream()
                            .context()
                            .alloc_pinned_with_flags::<u8>(ends, 0)
                    }
                    .map_err(w)?;
                    Some((b, Vec::new()))
                } else {
                    None
                };
                let mut at = 0;
                for (off, len, whole) in pieces {
                    // SAFETY: `src` is kept alive in `pending` until the compute stream
                    // waits on `done`; the host side is page-locked (whole pages of a
                    // registered buffer, or the bounce buffer) and not read before
                    // `synchronize`.
                    unsafe {
                        if whole {
                            crate::cuda::dtoh_async(
                                (host as *mut u8).add(off),
                                dev_ptr + off as u64,
                                len,
                                stream,
                            )?;
                        } else if let Some((b, list)) = bounce.as_mut() {
                            let p = b.as_mut_ptr().map_err(w)?.add(at);
                            crate::cuda::dtoh_async(p, dev_ptr + off as u64, len, stream)?;
                            list.push((host as usize + off, at, len));
                            at += len;
                        }
                    }
                }
                let done = stream
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(w)?;
                self.pending.push(Pending {
                    keep: vec![src],
                    done,
                    start,
                    bytes,
                    bounce,
                });
            }
            _ => {
                let t = std::time::Instant::now();
                let src = src.to_device(&Device::Cpu)?.contiguous()?;
                dst.flatten_all()?.slice_set(&src.flatten_all()?, 0, 0)?;
                self.seconds += t.elapsed().as_secs_f64();
            }
        }
        Ok(())
    }

    /// A marker after every copy enqueued so far.
    pub fn marker(&self) -> Result<OffloadMarker> {
        #[cfg(feature = "cuda")]
        if let Some(stream) = &self.stream {
            let e = stream
                .record_event(None)
                .map_err(candle_core::Error::wrap)?;
            return Ok(OffloadMarker { event: Some(e) });
        }
        Ok(OffloadMarker {
            #[cfg(feature = "cuda")]
            event: None,
        })
    }

    /// Lets the device reuse the memory of gradients whose copies have been
    /// issued: the compute stream waits (on the device) for those copies.
    pub fn release_sources(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = &self.device {
            let compute = d.cuda_stream();
            for p in self.pending.iter_mut() {
                if !p.keep.is_empty() {
                    compute.wait(&p.done).map_err(candle_core::Error::wrap)?;
                    p.keep.clear();
                }
            }
        }
        Ok(())
    }

    /// Waits for every copy; host buffers may be read afterwards.
    pub fn synchronize(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            let w = candle_core::Error::wrap;
            self.release_sources()?;
            for p in self.pending.drain(..) {
                p.done.synchronize().map_err(w)?;
                self.seconds += p.start.elapsed_ms(&p.done).map_err(w)? as f64 / 1e3;
                let _ = p.bytes;
                if let Some((b, list)) = &p.bounce {
                    let src = b.as_slice().map_err(w)?;
                    for &(host, at, len) in list {
                        // SAFETY: `host..host+len` lies in the caller's host buffer
                        // (from `host_buffer`), which nothing reads until now.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                src.as_ptr().add(at),
                                host as *mut u8,
                                len,
                            )
                        };
                    }
                }
            }
        }
        Ok(())
    }

    /// Bytes and seconds of copies completed so far; resets the counters.
    pub fn take_counters(&mut self) -> (u64, f64) {
        let r = (self.bytes, self.seconds);
        self.bytes = 0;
        self.seconds = 0.0;
        r
    }
}

impl Drop for Offloader {
    fn drop(&mut self) {
        let _ = self.synchronize();
    }
}
