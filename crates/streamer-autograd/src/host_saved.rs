//! What a training forward keeps in page-locked host memory until its
//! backward: block inputs ([`crate::ActivationPolicy::OffloadInputs`]) and
//! the activations of spilled blocks ([`crate::ActivationPolicy::Spill`]).
//!
//! Recompute keeps one tensor per block on the device, its input: at long
//! sequences those alone can outgrow the GPU. Here each input goes to the host
//! on the offload stream while the next block computes, and comes back on the
//! same stream while the block after it (in reverse order) runs its backward,
//! so neither copy sits on the compute stream's path. A spilled block's
//! activations travel the same way: out while the next block runs its
//! forward, back while the block after it runs its backward, so the block
//! needs no recompute and the device holds its activations only in flight.
//! Host buffers are allocated and page-locked once and reused every step.
use candle_core::{Device, Result, Tensor, TensorId};
use streamer_core::{Offloader, SavedActivations};

/// Tensors smaller than this stay on the device when a block spills: their
/// copies would cost more in latency than they free.
const SPILL_MIN_BYTES: usize = 1 << 20;

#[derive(Default)]
pub(crate) struct HostSaved {
    off: Option<Offloader>,
    bufs: Vec<Option<Tensor>>,
    /// Spilled activations' host buffers, by block, piece and tensor.
    acts: Vec<Vec<Vec<Option<Tensor>>>>,
    /// Copies each recent block enqueued, oldest first (the current block's
    /// last): their sources stay on the device while the blocks after them
    /// run, so the compute stream does not wait for copies still under way.
    recent: std::collections::VecDeque<usize>,
}

/// A spilled piece's activations: host buffers at `moved`, device tensors elsewhere.
pub(crate) struct Spilled {
    acts: SavedActivations,
    moved: Vec<usize>,
}

/// Fills `slot` with a host buffer shaped like `like` unless it holds one.
fn buffer_for(off: &mut Offloader, slot: &mut Option<Tensor>, like: &Tensor) -> Result<Tensor> {
    let fits = slot
        .as_ref()
        .is_some_and(|b| b.shape() == like.shape() && b.dtype() == like.dtype());
    if !fits {
        *slot = Some(off.host_buffer(like.shape(), like.dtype())?);
    }
    Ok(slot.clone().expect("filled above"))
}

impl HostSaved {
    fn off(&mut self, device: &Device) -> Result<&mut Offloader> {
        if self.off.is_none() {
            self.off = Some(Offloader::new(device)?);
        }
        Ok(self.off.as_mut().expect("created above"))
    }

    /// A new block begins: copies issued more than `lag` blocks ago release
    /// their device sources (the compute stream waits for them from here).
    /// One block suffices for a block input; a spilled block's activations
    /// take longer over PCIe than a block's forward, so spills use two.
    pub(crate) fn next_block(&mut self, device: &Device, lag: usize) -> Result<()> {
        while self.recent.len() > lag {
            self.recent.pop_front();
        }
        let keep = self.recent.iter().sum();
        self.recent.push_back(0);
        self.off(device)?.release_sources_but(keep)
    }

    /// Counts a copy of the current block.
    fn count_copy(&mut self) {
        match self.recent.back_mut() {
            Some(n) => *n += 1,
            None => self.recent.push_back(1),
        }
    }

    /// Starts copying block `i`'s input `h` to its host buffer; returns that
    /// buffer (what the step saves in place of `h`).
    pub(crate) fn save(&mut self, i: usize, h: &Tensor) -> Result<Tensor> {
        if self.bufs.len() <= i {
            self.bufs.resize(i + 1, None);
        }
        let mut slot = self.bufs[i].take();
        let buf = buffer_for(self.off(h.device())?, &mut slot, h);
        self.bufs[i] = slot;
        let buf = buf?;
        // SAFETY: `buf` is this offloader's host buffer; the host never reads
        // or writes it: only `fetch` reads it back, on the same stream after
        // this copy.
        unsafe { self.off(h.device())?.enqueue(h, &buf)? };
        self.count_copy();
        Ok(buf)
    }

    /// Starts copying piece `p` of block `i`'s activations to host buffers:
    /// every tensor of at least [`SPILL_MIN_BYTES`] except those in `keep`
    /// (the block's extras, whose ids a hand-written backward keys their
    /// gradients by). [`Self::bring_acts`] turns the result back.
    pub(crate) fn spill(
        &mut self,
        (i, p): (usize, usize),
        mut acts: SavedActivations,
        keep: &[TensorId],
    ) -> Result<Spilled> {
        if self.acts.len() <= i {
            self.acts.resize_with(i + 1, Vec::new);
        }
        if self.acts[i].len() <= p {
            self.acts[i].resize_with(p + 1, Vec::new);
        }
        let mut slots = std::mem::take(&mut self.acts[i][p]);
        slots.resize(acts.0.len().max(slots.len()), None);
        let mut moved = Vec::new();
        let r = (|| {
            for (k, t) in acts.0.iter_mut().enumerate() {
                let bytes = t.elem_count() * t.dtype().size_in_bytes();
                if bytes < SPILL_MIN_BYTES || keep.contains(&t.id()) {
                    continue;
                }
                let off = self.off(t.device())?;
                let buf = buffer_for(off, &mut slots[k], t)?;
                // SAFETY: as in `save`: the host leaves `buf` alone, and only
                // `bring_acts` reads it, on the same stream after this copy.
                unsafe { off.enqueue(t, &buf)? };
                self.count_copy();
                *t = buf;
                moved.push(k);
            }
            Ok(())
        })();
        self.acts[i][p] = slots;
        r.map(|()| Spilled { acts, moved })
    }

    /// A spilled piece's activations back on `device`, ordered before any
    /// compute issued after this call.
    pub(crate) fn bring_acts(&mut self, s: Spilled, device: &Device) -> Result<SavedActivations> {
        let Spilled { mut acts, moved } = s;
        for k in moved {
            // SAFETY: the buffer came from `spill` (this offloader's), and the
            // host does not write it; the next spill into it is ordered after
            // this read on the same stream.
            acts.0[k] = unsafe { self.off(device)?.fetch(&acts.0[k])? };
        }
        Ok(acts)
    }

    /// Lets every offloaded tensor's device memory go (end of the forward).
    pub(crate) fn settle(&mut self) -> Result<()> {
        self.recent.clear();
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
