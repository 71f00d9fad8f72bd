//! Write-backs of device-stepped masters into their host masters. A master's
//! partial pages at either end are not page-locked, and a copy into pageable
//! memory would block the host until the GPU reaches it, so they land in
//! page-locked bounce buffers (per master) and are copied into place by
//! [`WriteBack::finish`] once the transfer stream has passed them.
use super::DeviceMaster;
use candle_core::{CudaDevice, DType, Device, Result, Shape, Tensor};
use cudarc::driver::CudaStream;
use std::collections::HashMap;

pub(super) struct WriteBack {
    /// Allocates the page-locked bounce buffers.
    bounce: crate::Offloader,
    /// Per master, its bounce buffer.
    bufs: HashMap<usize, Tensor>,
    /// Host copies left for `finish`: `(dst, src, bytes)`.
    pending: Vec<(usize, usize, usize)>,
}

impl WriteBack {
    pub(super) fn new(dev: &CudaDevice) -> Result<Self> {
        Ok(Self {
            bounce: crate::Offloader::new(&Device::Cuda(dev.clone()))?,
            bufs: HashMap::new(),
            pending: Vec::new(),
        })
    }

    /// Enqueues the copy of a device master copy into its host master: whole
    /// page-locked pages directly, the pageable rest through a bounce buffer
    /// (`finish` copies it into place).
    ///
    /// # Safety
    /// `host..host + n` is the master's memory, untouched until `finish`;
    /// `t.address` holds its device copy until `transfer` passes the copies.
    pub(super) unsafe fn enqueue(
        &mut self,
        t: &DeviceMaster,
        (host, n, pinned): (*mut u8, usize, bool),
        transfer: &CudaStream,
    ) -> Result<()> {
        let page = crate::pages::page_size();
        for (off, len, whole) in crate::pages::page_pieces(host as usize, n) {
            let src = t.address + off as u64;
            if whole && pinned {
                // SAFETY: a page-locked range of the master (this fn's contract).
                unsafe { crate::cuda::dtoh_async(host.add(off), src, len, transfer)? };
                continue;
            }
            let size = if pinned { 2 * page } else { n };
            if !self.bufs.contains_key(&t.master) {
                let buf = self.bounce.host_buffer(&Shape::from(size), DType::U8)?;
                self.bufs.insert(t.master, buf);
            }
            let (b, _) = crate::host::host_bytes(&self.bufs[&t.master])?;
            // Head at 0 and tail at one page in; everything at its offset when
            // the master is not page-locked at all.
            let at = if !pinned {
                off
            } else if off == 0 {
                0
            } else {
                page
            };
            // SAFETY: `at + len <= size` (a head or tail is under one page); the
            // bounce buffer is page-locked whole and read only after the stream
            // passes this copy (`synchronize`).
            unsafe { crate::cuda::dtoh_async(b.add(at) as *mut u8, src, len, transfer)? };
            self.pending
                .push((host as usize + off, b as usize + at, len));
        }
        Ok(())
    }

    /// Copies the bounced pieces into their masters.
    ///
    /// # Safety
    /// The stream the copies were enqueued on has passed them (synchronised).
    pub(super) unsafe fn finish(&mut self) {
        for (dst, src, len) in self.pending.drain(..) {
            // SAFETY: `src` lies in a bounce buffer this owns, filled by a
            // copy the stream has passed (this fn's contract); `dst` lies in
            // a live host master that nothing touches until the pool's
            // `synchronize` returns (`write_back_masters`' contract).
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
        }
    }
}
