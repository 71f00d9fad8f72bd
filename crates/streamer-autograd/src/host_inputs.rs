//! Block inputs kept in page-locked host memory between forward and backward
//! ([`crate::ActivationPolicy::OffloadInputs`]).
//!
//! Recompute keeps one tensor per block on the device, its input: at long
//! sequences those alone can outgrow the GPU. Here each input goes to the host
//! on the offload stream while the next block computes, and comes back on the
//! same stream while the block after it (in reverse order) runs its backward,
//! so neither copy sits on the compute stream's path. Host buffers are
//! allocated and page-locked once per block and reused every step.
use candle_core::{Device, Result, Tensor};
use streamer_core::Offloader;

#[derive(Default)]
pub(crate) struct HostInputs {
    off: Option<Offloader>,
    bufs: Vec<Option<Tensor>>,
}

impl HostInputs {
    fn off(&mut self, device: &Device) -> Result<&mut Offloader> {
        if self.off.is_none() {
            self.off = Some(Offloader::new(device)?);
        }
        Ok(self.off.as_mut().expect("created above"))
    }

    /// Starts copying block `i`'s input `h` to its host buffer; returns that
    /// buffer (what the step saves in place of `h`).
    pub(crate) fn save(&mut self, i: usize, h: &Tensor) -> Result<Tensor> {
        if self.bufs.len() <= i {
            self.bufs.resize(i + 1, None);
        }
        let fits = self.bufs[i]
            .as_ref()
            .is_some_and(|b| b.shape() == h.shape() && b.dtype() == h.dtype());
        if !fits {
            let buf = self.off(h.device())?.host_buffer(h.shape(), h.dtype())?;
            self.bufs[i] = Some(buf);
        }
        let buf = self.bufs[i].clone().expect("allocated above");
        let off = self.off(h.device())?;
        // The copy before the newest may release its device source now: it
        // was issued one block ago, so the compute stream does not stall.
        off.release_sources_but(1)?;
        // SAFETY: `buf` is this offloader's host buffer; the host never reads
        // or writes it: only `fetch` reads it back, on the same stream after
        // this copy.
        unsafe { off.enqueue(h, &buf)? };
        Ok(buf)
    }

    /// Lets every offloaded input's device memory go (end of the forward).
    pub(crate) fn settle(&mut self) -> Result<()> {
        match &mut self.off {
            Some(o) => o.release_sources(),
            None => Ok(()),
        }
    }

    /// The device copy of a saved host input, ordered before any compute
    /// issued after this call.
    pub(crate) fn fetch(&mut self, host: &Tensor, device: &Device) -> Result<Tensor> {
        let off = self.off(device)?;
        // SAFETY: `host` is one of this offloader's buffers (from `save`), and
        // the host does not write it; the next `save` into it is ordered after
        // this read on the same stream.
        unsafe { off.fetch(host) }
    }

    /// Waits for the copies (end of the backward), so nothing stays pending.
    pub(crate) fn finish(&mut self) -> Result<()> {
        match &mut self.off {
            Some(o) => o.synchronize(),
            None => Ok(()),
        }
    }
}
