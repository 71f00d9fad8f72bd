//! The keys and values of a batched decode's host slots ([`crate::batch_kv`])
//! in page-locked host memory, for batches whose kv cache the device cannot
//! hold (FlexGen and ZeRO-Inference keep it there for the same reason).
//!
//! Per layer the host slots' keys (and values) are one buffer laid out as the
//! device part's packed tensor, `(kv_heads, slots, capacity, head_dim)`. At a
//! layer of a step the part the step needs (every head's slots up to the last
//! one in the step, positions up to the longest of them) comes to the device
//! (a 2D copy a head, enqueued on the compute stream, not waited for), takes
//! the step's new rows there and is attended over; the new rows alone go back
//! (one small copy) and are put in their slots on the host at the start of
//! the next step, once the copies have completed
//! ([`streamer_device::HostBuffer`] waits for them). A step thus moves each
//! host sequence's cache up once per layer: the planner (`crate::batch_plan`)
//! counts those bytes, at the full capacity, with the weights' copies.
use candle_core::{bail, DType, Device, Result, Tensor};
use rayon::prelude::*;
use streamer_device::{HostBuffer, Region};

/// The host slots' caches, every layer.
pub(crate) struct HostKv {
    slots: usize,
    layers: Vec<Option<HostLayer>>,
}

/// One layer's host keys and values, and the rows of the last step still to
/// place.
struct HostLayer {
    k: HostBuffer,
    v: HostBuffer,
    /// The last step's new rows, `(kv_heads, rows, head_dim)`, as copied back.
    new_k: HostBuffer,
    new_v: HostBuffer,
    /// Where they go: `(slot, first position, rows)` in row order; empty when
    /// none wait.
    placed: Vec<(usize, usize, usize)>,
    heads: usize,
    /// Bytes of one position of one head.
    row: usize,
    capacity: usize,
}

impl HostKv {
    pub(crate) fn new(layers: usize, slots: usize) -> Self {
        Self {
            slots,
            layers: (0..layers).map(|_| None).collect(),
        }
    }

    /// Layer `layer`'s first `slots` host slots, their first `len`
    /// positions, as `(1, heads, slots * len, d)` keys and values on
    /// `device` (the layer's host part is made, zero, at its first step).
    pub(crate) fn upload(
        &mut self,
        (layer, slots, len): (usize, usize, usize),
        (heads, d): (usize, usize),
        dtype: DType,
        device: &Device,
        capacity: usize,
    ) -> Result<(Tensor, Tensor)> {
        if slots > self.slots || len > capacity {
            bail!(
                "kv cache: {slots} host slots of {len} positions asked of {} of {capacity}",
                self.slots
            );
        }
        let (used, all) = (slots, self.slots);
        let Some(entry) = self.layers.get_mut(layer) else {
            bail!("kv cache has no layer {layer}")
        };
        let row = d * dtype.size_in_bytes();
        if entry.is_none() {
            let bytes = heads * all * capacity * row;
            *entry = Some(HostLayer {
                k: HostBuffer::zeroed(bytes, device)?,
                v: HostBuffer::zeroed(bytes, device)?,
                new_k: HostBuffer::zeroed(0, device)?,
                new_v: HostBuffer::zeroed(0, device)?,
                placed: Vec::new(),
                heads,
                row,
                capacity,
            });
        }
        let l = entry.as_ref().expect("made above");
        if (l.heads, l.row, l.capacity) != (heads, row, capacity) {
            bail!(
                "kv cache: layer {layer}'s host part holds {} heads of {} bytes a row at capacity {}, \
                 a step brings {heads} of {row} at {capacity}",
                l.heads,
                l.row,
                l.capacity
            );
        }
        let shape = candle_core::Shape::from((1, heads, used * len, d));
        let region = Region {
            at: 0,
            blocks: heads,
            block_stride: all * capacity * row,
            rows: used,
            pitch: capacity * row,
            len: len * row,
        };
        Ok((
            l.k.upload_region(region, &shape, dtype, device)?,
            l.v.upload_region(region, &shape, dtype, device)?,
        ))
    }

    /// Copies layer `layer`'s new rows `(1, heads, rows, d)` of the host
    /// slots back, to be placed at `placed` (`(slot, first position, rows)`
    /// in row order) by the next [`HostKv::flush`].
    pub(crate) fn keep_new_rows(
        &mut self,
        layer: usize,
        (k, v): (&Tensor, &Tensor),
        placed: Vec<(usize, usize, usize)>,
    ) -> Result<()> {
        let Some(Some(l)) = self.layers.get_mut(layer) else {
            bail!("kv cache: layer {layer}'s host part was not uploaded")
        };
        let bytes = k.elem_count() * k.dtype().size_in_bytes();
        if l.new_k.len() < bytes {
            // Half as large again, so that growing steps do not page-lock
            // anew every time.
            let dev = k.device();
            l.new_k = HostBuffer::zeroed(bytes + bytes / 2, dev)?;
            l.new_v = HostBuffer::zeroed(bytes + bytes / 2, dev)?;
        }
        l.new_k.download(0, k)?;
        l.new_v.download(0, v)?;
        l.placed = placed;
        Ok(())
    }

    /// Puts every layer's rows of the last step in their slots (waiting for
    /// their copies), layers in parallel.
    pub(crate) fn flush(&mut self) -> Result<()> {
        self.layers
            .par_iter_mut()
            .flatten()
            .try_for_each(HostLayer::place)
    }

    /// Forgets the rows of a step that failed.
    pub(crate) fn discard(&mut self) {
        for l in self.layers.iter_mut().flatten() {
            l.placed.clear();
        }
    }

    /// Lays every layer's slots out for `capacity` positions, keeping what
    /// they hold (a larger capacity only).
    pub(crate) fn grow(&mut self, capacity: usize) -> Result<()> {
        self.flush()?;
        let slots = self.slots;
        for l in self.layers.iter_mut().flatten() {
            if capacity > l.capacity {
                l.k = relaid(
                    &l.k,
                    (l.heads * slots, l.capacity * l.row),
                    capacity * l.row,
                )?;
                l.v = relaid(
                    &l.v,
                    (l.heads * slots, l.capacity * l.row),
                    capacity * l.row,
                )?;
                l.capacity = capacity;
            }
        }
        Ok(())
    }
}

impl HostLayer {
    /// Copies the last step's rows into their slots.
    fn place(&mut self) -> Result<()> {
        if self.placed.is_empty() {
            return Ok(());
        }
        let rows: usize = self.placed.iter().map(|p| p.2).sum();
        let slots = self.k.len() / (self.heads * self.capacity * self.row).max(1);
        let placed = std::mem::take(&mut self.placed);
        for (new, cache) in [(&self.new_k, &mut self.k), (&self.new_v, &mut self.v)] {
            let (new, cache) = (new.bytes()?, cache.bytes_mut()?);
            for h in 0..self.heads {
                let mut at = h * rows;
                for &(slot, pos, n) in &placed {
                    let to = ((h * slots + slot) * self.capacity + pos) * self.row;
                    let len = n * self.row;
                    cache[to..to + len].copy_from_slice(&new[at * self.row..][..len]);
                    at += n;
                }
            }
        }
        Ok(())
    }
}

/// `old`'s `runs` (count, bytes each) spread to `stride` bytes apart, in a
/// new buffer for the same device.
fn relaid(old: &HostBuffer, (runs, len): (usize, usize), stride: usize) -> Result<HostBuffer> {
    let mut new = HostBuffer::zeroed(runs * stride, old.device())?;
    let (src, dst) = (old.bytes()?, new.bytes_mut()?);
    for r in 0..runs {
        dst[r * stride..][..len].copy_from_slice(&src[r * len..][..len]);
    }
    Ok(new)
}
