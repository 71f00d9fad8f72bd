//! Device-to-host offload of gradients on a dedicated stream, into page-locked
//! host buffers allocated once, overlapping the compute that follows.
//!
//! On CUDA: the offload stream waits for an event recorded on the compute stream
//! after the gradient was produced, copies it to the host, and records a done
//! event. The device gradient is kept alive until the compute stream has been
//! told to wait for that event, so its memory is not reused before the copy.
//! On the CPU the copy is a plain in-place memory copy.
use candle_core::{DType, Device, Result, Shape, Tensor};

#[cfg(feature = "cuda")]
struct Pending {
    keep: Vec<Tensor>,
    done: cudarc::driver::CudaEvent,
    start: cudarc::driver::CudaEvent,
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

/// Queue of device-to-host copies (see the module docs). For the training
/// crate: [`Offloader::enqueue`] is `unsafe` because its destination is written
/// behind the host's back until the copy is waited for.
#[doc(hidden)]
pub struct Offloader {
    device: Device,
    /// Host buffers handed out by `host_buffer`, kept page-locked while alive
    /// (the registration first in the pair, so it is dropped before the memory).
    #[cfg(feature = "cuda")]
    pins: Vec<(Option<crate::pages::PinnedRegion>, Tensor)>,
    #[cfg(feature = "cuda")]
    stream: Option<std::sync::Arc<cudarc::driver::CudaStream>>,
    #[cfg(feature = "cuda")]
    pending: Vec<Pending>,
    bytes: u64,
    seconds: f64,
    /// An error of [`Self::settle`], returned by the next call that enqueues
    /// or waits.
    deferred: Option<candle_core::Error>,
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
            deferred: None,
        })
    }

    /// A zeroed host buffer. When offloading from a GPU it is a view into a
    /// slightly larger allocation, starting on a page boundary and padded to
    /// whole pages, so every page it touches is its own and is page-locked: copies
    /// into it are asynchronous DMA. Allocate these once and reuse them.
    pub fn host_buffer(&mut self, shape: &Shape, dtype: DType) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = &self.device {
            let page = crate::pages::page_size();
            let es = dtype.size_in_bytes();
            let n = shape.elem_count();
            let page_elems = page / es;
            let flat = Tensor::zeros(n + 2 * page_elems, dtype, &Device::Cpu)?;
            let (base, _) = crate::host::host_bytes(&flat)?;
            let skip = ((base as usize).next_multiple_of(page) - base as usize) / es;
            let t = flat.narrow(0, skip, n)?.reshape(shape)?;
            let (ptr, bytes) = crate::host::host_bytes(&t)?;
            // SAFETY: the padded range lies inside `flat` (two spare pages), and
            // `pins` keeps a view of `flat` alive after the registration, which
            // is dropped first (declared first in the pair).
            let pin = unsafe {
                crate::pages::PinnedRegion::register(
                    d.cuda_stream().context(),
                    ptr as *mut u8,
                    bytes.next_multiple_of(page),
                )?
            };
            self.pins.push((pin, t.clone()));
            return Ok(t);
        }
        Tensor::zeros(shape, dtype, &Device::Cpu)
    }

    /// Enqueues the copy of `src` (on the device, any layout) into `dst` (a host
    /// buffer from [`Self::host_buffer`] with the same shape and dtype).
    ///
    /// # Safety
    /// On CUDA the copy is asynchronous DMA into `dst`'s memory: `dst` (and every
    /// tensor sharing its storage) must not be read or written until
    /// [`Self::synchronize`] returns or a [`Self::marker`] taken after this call
    /// has been waited on, and `dst` must be a buffer from this offloader's
    /// [`Self::host_buffer`] (it keeps that memory alive and page-locked for as
    /// long as the offloader lives; any other buffer must outlive the copy).
    #[doc(hidden)]
    pub unsafe fn enqueue(&mut self, src: &Tensor, dst: &Tensor) -> Result<()> {
        self.take_deferred()?;
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
                let src = src.contiguous()?;
                let stream = self.stream.as_ref().expect("cuda offloader has a stream");
                let compute = d.cuda_stream();
                let start = copy_start(stream, &compute)?;
                let (host, n) = crate::host::host_bytes(dst)?;
                let mem = streamer_device::CudaMemory::of(&src)?;
                let dev_ptr = mem.address()?;
                // SAFETY: `src` is kept alive in `pending` until the compute stream
                // waits on `done`; `dst` comes from `host_buffer` (page-aligned and
                // page-locked whole) and is not touched before `synchronize` or a
                // later marker's wait (this function's contract).
                unsafe { crate::cuda::dtoh_async(host as *mut u8, dev_ptr.get(), n, stream)? };
                drop(dev_ptr);
                drop(mem);
                let done = timed_event(stream)?;
                self.pending.push(Pending {
                    keep: vec![src],
                    done,
                    start,
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

    /// Like [`Self::release_sources`] for all but the newest `keep` copies, so
    /// the compute stream never waits for a copy it has just issued (a block's
    /// input offloaded while the next block runs).
    pub fn release_sources_but(&mut self, keep: usize) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = &self.device {
            let compute = d.cuda_stream();
            let old = self.pending.len().saturating_sub(keep);
            for p in self.pending[..old].iter_mut() {
                if !p.keep.is_empty() {
                    compute.wait(&p.done).map_err(candle_core::Error::wrap)?;
                    p.keep.clear();
                }
            }
        }
        #[cfg(not(feature = "cuda"))]
        let _ = keep;
        Ok(())
    }

    /// Copies `src` (a host buffer of this offloader, written by
    /// [`Self::enqueue`]) back into a new device tensor, on the offload stream
    /// after every copy enqueued before; the compute stream waits for it (on
    /// the device) before any work issued after this call, so the result can
    /// be used at once and the copy overlaps the compute issued before.
    ///
    /// # Safety
    /// `src` must be a buffer from this offloader's [`Self::host_buffer`], and
    /// must not be written by the host until the copy has completed (a later
    /// [`Self::synchronize`] or marker wait).
    #[doc(hidden)]
    pub unsafe fn fetch(&mut self, src: &Tensor) -> Result<Tensor> {
        self.take_deferred()?;
        match &self.device {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                let w = candle_core::Error::wrap;
                let stream = self.stream.as_ref().expect("cuda offloader has a stream");
                let compute = d.cuda_stream();
                // Allocated (and zeroed) on the compute stream: the copy waits for that.
                let dst = Tensor::zeros(src.shape(), src.dtype(), &self.device)?;
                let start = copy_start(stream, &compute)?;
                let (host, n) = crate::host::host_bytes(src)?;
                let mem = streamer_device::CudaMemory::of(&dst)?;
                let dev_ptr = mem.address()?;
                // SAFETY: `dst` is freed (if at all) on the compute stream, which
                // waits for `done` below first; `src` is page-locked memory of
                // this offloader that the host leaves alone until the copy is
                // done (this fn's contract), and earlier copies into it are
                // ahead of this one on the same stream.
                unsafe { crate::cuda::htod_async(dev_ptr.get(), host, n, stream)? };
                drop(dev_ptr);
                drop(mem);
                let done = timed_event(stream)?;
                compute.wait(&done).map_err(w)?;
                self.bytes += n as u64;
                self.pending.push(Pending {
                    keep: Vec::new(),
                    done,
                    start,
                });
                Ok(dst)
            }
            _ => src.to_device(&self.device)?.copy(),
        }
    }

    /// Waits for every copy; host buffers may be read afterwards.
    pub fn synchronize(&mut self) -> Result<()> {
        self.take_deferred()?;
        #[cfg(feature = "cuda")]
        {
            // Driver errors stay `Error::Cuda`, so `Drop` can record their code.
            let w = |e: cudarc::driver::DriverError| candle_core::Error::Cuda(Box::new(e));
            self.release_sources()?;
            for p in self.pending.drain(..) {
                p.done.synchronize().map_err(w)?;
                self.seconds += p.start.elapsed_ms(&p.done).map_err(w)? as f64 / 1e3;
            }
        }
        Ok(())
    }

    /// Waits for every copy, on a path that already has an error to return
    /// (cleaning up after a failed step): an error of its own is kept and
    /// returned by this offloader's next `enqueue`, `fetch` or `synchronize`.
    pub fn settle(&mut self) {
        if let Err(e) = self.synchronize() {
            self.deferred.get_or_insert(e);
        }
    }

    /// The error [`Self::settle`] kept, if any (taken).
    fn take_deferred(&mut self) -> Result<()> {
        self.deferred.take().map_or(Ok(()), Err)
    }

    /// Bytes and seconds of copies completed so far; resets the counters.
    pub fn take_counters(&mut self) -> (u64, f64) {
        let r = (self.bytes, self.seconds);
        self.bytes = 0;
        self.seconds = 0.0;
        r
    }
}

/// Makes the copy `stream` wait for the work queued so far on `compute` (the
/// tensors a copy reads or writes), and marks there where the copy starts.
#[cfg(feature = "cuda")]
fn copy_start(
    stream: &cudarc::driver::CudaStream,
    compute: &cudarc::driver::CudaStream,
) -> Result<cudarc::driver::CudaEvent> {
    let ready = compute
        .record_event(None)
        .map_err(candle_core::Error::wrap)?;
    stream.wait(&ready).map_err(candle_core::Error::wrap)?;
    timed_event(stream)
}

/// An event on `stream` that can time the copies between two of them.
#[cfg(feature = "cuda")]
fn timed_event(stream: &cudarc::driver::CudaStream) -> Result<cudarc::driver::CudaEvent> {
    use cudarc::driver::sys::CUevent_flags;
    stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(candle_core::Error::wrap)
}

impl Drop for Offloader {
    /// Waits for copies in flight (they write host buffers about to be freed).
    /// No caller is left to take an error: on CUDA it is recorded on the
    /// context (cudarc's `record_err`), whose next checked call returns it.
    fn drop(&mut self) {
        let r = self.synchronize();
        #[cfg(feature = "cuda")]
        if let (Err(err), Some(stream)) = (&r, &self.stream) {
            streamer_device::cuda::record_dropped_error(stream.context(), err);
        }
        // On the CPU there is nothing in flight and `synchronize` cannot fail.
        debug_assert!(cfg!(feature = "cuda") || r.is_ok());
    }
}
