//! The keys and values of a batched decode's host slots ([`crate::batch_kv`])
//! in page-locked host memory, for batches whose kv cache the device cannot
//! hold (FlexGen and ZeRO-Inference keep it there for the same reason).
//!
//! Per layer the host slots' keys (and values) are one buffer laid out as the
//! device part's packed tensor, `(kv_heads, slots, capacity, head_dim)`. At a
//! layer of a step the part the step needs (every head's slots up to the last
//! one in the step, positions up to the longest of them) comes to the device
//! (a 2D copy a head; on CUDA on a stream of its own, two layers ahead: see
//! `ring`), takes the step's new rows there and is attended over; the new
//! rows alone go back (one small copy) and are put in their slots on the host
//! at the start of the next step, once the copies have completed
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
    /// Every layer's layout, fixed by the first upload (the capacity grows
    /// with [`HostKv::grow`]).
    layout: Option<Layout>,
    /// Where the step's new rows go, the same in every layer: `(slot, first
    /// position, rows)` in row order.
    placed: Vec<(usize, usize, usize)>,
    /// The device buffers the copies land in, on CUDA.
    #[cfg(feature = "cuda")]
    ring: Option<ring::Ring>,
}

/// What a step brings up from each layer's host part: the first `slots`
/// slots, their first `len` positions, of `heads` heads of `d` values in
/// `dtype`, laid out for `capacity` positions a slot.
#[derive(Clone, Debug)]
pub(crate) struct KvUpload {
    pub(crate) slots: usize,
    pub(crate) len: usize,
    pub(crate) heads: usize,
    pub(crate) d: usize,
    pub(crate) dtype: DType,
    pub(crate) device: Device,
    pub(crate) capacity: usize,
}

impl KvUpload {
    /// The device tensors' shape, `(1, heads, slots * len, d)`.
    fn shape(&self) -> candle_core::Shape {
        (1, self.heads, self.slots * self.len, self.d).into()
    }
}

/// The layout of every layer's host part: `(heads, slots, capacity, d)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Layout {
    heads: usize,
    /// Bytes of one position of one head.
    row: usize,
    capacity: usize,
}

/// One layer's host keys and values, and the rows of the step in flight.
struct HostLayer {
    k: HostBuffer,
    v: HostBuffer,
    /// The step's new rows, `(kv_heads, rows, head_dim)`, as copied back.
    new_k: HostBuffer,
    new_v: HostBuffer,
    /// Whether they came back and wait to be placed.
    fresh: bool,
}

impl HostKv {
    pub(crate) fn new(layers: usize, slots: usize) -> Self {
        Self {
            slots,
            layers: (0..layers).map(|_| None).collect(),
            layout: None,
            placed: Vec::new(),
            #[cfg(feature = "cuda")]
            ring: None,
        }
    }

    /// Layer `layer`'s first `step.slots` host slots, their first `step.len`
    /// positions, as `(1, heads, slots * len, d)` keys and values on the
    /// step's device (the layer's host part is made, zero, at its first
    /// step). On a CUDA device the copies run on a stream of their own, two
    /// layers ahead (`ring`).
    pub(crate) fn upload(&mut self, layer: usize, step: &KvUpload) -> Result<(Tensor, Tensor)> {
        if step.slots > self.slots || step.len > step.capacity {
            bail!(
                "kv cache: {} host slots of {} positions asked of {} of {}",
                step.slots,
                step.len,
                self.slots,
                step.capacity
            );
        }
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = &step.device {
            return self.upload_ahead(layer, step, d);
        }
        let region = self.region(step);
        let l = self.layer(layer, step)?;
        let shape = step.shape();
        Ok((
            l.k.upload_region(region, &shape, step.dtype, &step.device)?,
            l.v.upload_region(region, &shape, step.dtype, &step.device)?,
        ))
    }

    /// `upload` on CUDA: waits (on the compute stream) for this layer's
    /// copies, issued ahead, and issues the next two layers'.
    #[cfg(feature = "cuda")]
    fn upload_ahead(
        &mut self,
        layer: usize,
        step: &KvUpload,
        d: &candle_core::CudaDevice,
    ) -> Result<(Tensor, Tensor)> {
        let elems = step.heads * self.slots * step.capacity * step.d;
        if self
            .ring
            .as_ref()
            .is_none_or(|r| !r.holds(elems, step.dtype))
        {
            self.ring = None; // waits for its copies before freeing its buffers
            self.ring = Some(ring::Ring::new(d, elems, step.dtype)?);
        }
        let region = self.region(step);
        for ahead in [layer, layer + 1, layer + 2] {
            if ahead < self.layers.len() {
                self.layer(ahead, step)?;
                let l = self.layers[ahead].as_ref().expect("made above");
                let ring = self.ring.as_mut().expect("made above");
                ring.issue(ahead, (&l.k, &l.v), region, &step.shape())?;
            }
        }
        self.ring
            .as_mut()
            .expect("made above")
            .take(layer, &step.shape())
    }

    /// The part of a layer's buffer a step brings up.
    fn region(&self, step: &KvUpload) -> Region {
        let row = step.d * step.dtype.size_in_bytes();
        Region {
            at: 0,
            blocks: step.heads,
            block_stride: self.slots * step.capacity * row,
            rows: step.slots,
            pitch: step.capacity * row,
            len: step.len * row,
        }
    }

    /// Layer `layer`'s host part, made (zero) at its first use; the step's
    /// geometry checked against every layer's layout.
    fn layer(&mut self, layer: usize, step: &KvUpload) -> Result<&HostLayer> {
        let want = Layout {
            heads: step.heads,
            row: step.d * step.dtype.size_in_bytes(),
            capacity: step.capacity,
        };
        match self.layout {
            None => self.layout = Some(want),
            Some(l) if l != want => {
                bail!("kv cache: the host parts hold {l:?}, a step brings {want:?} (layer {layer})")
            }
            Some(_) => {}
        }
        let Some(entry) = self.layers.get_mut(layer) else {
            bail!("kv cache has no layer {layer}")
        };
        if entry.is_none() {
            let bytes = want.heads * self.slots * want.capacity * want.row;
            let device = &step.device;
            *entry = Some(HostLayer {
                k: HostBuffer::zeroed(bytes, device)?,
                v: HostBuffer::zeroed(bytes, device)?,
                new_k: HostBuffer::zeroed(0, device)?,
                new_v: HostBuffer::zeroed(0, device)?,
                fresh: false,
            });
        }
        Ok(entry.as_ref().expect("made above"))
    }

    /// Starts a step whose new rows go to `placed` (`(slot, first position,
    /// rows)` in row order), after the last step's are in place.
    pub(crate) fn begin_step(&mut self, placed: Vec<(usize, usize, usize)>) -> Result<()> {
        self.flush()?;
        self.placed = placed;
        Ok(())
    }

    /// Copies layer `layer`'s new rows `(1, heads, rows, d)` of the host
    /// slots back, to be placed by the next [`HostKv::flush`].
    pub(crate) fn keep_new_rows(&mut self, layer: usize, (k, v): (&Tensor, &Tensor)) -> Result<()> {
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
        l.fresh = true;
        Ok(())
    }

    /// Puts every layer's rows of the last step in their slots (waiting for
    /// their copies), layers in parallel.
    fn flush(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(r) = &mut self.ring {
            r.new_step();
        }
        if let Some(layout) = self.layout {
            let (slots, placed) = (self.slots, &self.placed);
            self.layers
                .par_iter_mut()
                .flatten()
                .try_for_each(|l| l.place(placed, slots, layout))?;
        }
        self.placed.clear();
        Ok(())
    }

    /// Forgets the rows of a step that failed.
    pub(crate) fn discard(&mut self) {
        self.placed.clear();
        for l in self.layers.iter_mut().flatten() {
            l.fresh = false;
        }
    }

    /// Lays every layer's slots out for `capacity` positions, keeping what
    /// they hold (a larger capacity only).
    pub(crate) fn grow(&mut self, capacity: usize) -> Result<()> {
        self.flush()?;
        let Some(layout) = self.layout.filter(|l| capacity > l.capacity) else {
            return Ok(());
        };
        let runs = (layout.heads * self.slots, layout.capacity * layout.row);
        for l in self.layers.iter_mut().flatten() {
            l.k = relaid(&l.k, runs, capacity * layout.row)?;
            l.v = relaid(&l.v, runs, capacity * layout.row)?;
        }
        self.layout = Some(Layout { capacity, ..layout });
        Ok(())
    }
}

impl HostLayer {
    /// Copies the step's rows, come back, to `placed` in the `slots` slots
    /// laid out as `layout`.
    fn place(
        &mut self,
        placed: &[(usize, usize, usize)],
        slots: usize,
        layout: Layout,
    ) -> Result<()> {
        if !std::mem::take(&mut self.fresh) {
            return Ok(());
        }
        let Layout {
            heads,
            row,
            capacity,
        } = layout;
        let rows: usize = placed.iter().map(|p| p.2).sum();
        for (new, cache) in [(&self.new_k, &mut self.k), (&self.new_v, &mut self.v)] {
            let (new, cache) = (new.bytes()?, cache.bytes_mut()?);
            for h in 0..heads {
                let mut at = h * rows;
                for &(slot, pos, n) in placed {
                    let to = ((h * slots + slot) * capacity + pos) * row;
                    let len = n * row;
                    cache[to..to + len].copy_from_slice(&new[at * row..][..len]);
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

/// The CUDA copies of the host parts, on a stream of their own.
///
/// A step's layer `l` waits for its copy only on the compute stream, and
/// issues those of layers `l + 1` and `l + 2` into the next two of three
/// device buffers. The copies of the weights, on the pool's transfer stream,
/// wait for the compute that frees their slot; copies issued there and here
/// together share one copy engine, and when layer `l`'s kv copy was issued
/// with its own layer it queued behind the next layer's weights, so the
/// compute of `l` waited for both and the weights after it for that compute
/// (70B NF4 in 24 GiB on an H100: 99.2 generated tokens/s with 75 host
/// sequences against 102.5 without, 0.72 of the PCIe floor). Issued two
/// layers ahead, a kv copy is ready before the weights it would have waited
/// behind.
#[cfg(feature = "cuda")]
mod ring {
    use super::HostBuffer;
    use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaStream};
    use candle_core::{bail, CudaDevice, DType, Device, Result, Shape, Tensor};
    use std::sync::Arc;
    use streamer_device::Region;

    const BUFFERS: usize = 3;

    pub(super) struct Ring {
        stream: Arc<CudaStream>,
        compute: Arc<CudaStream>,
        /// Flat keys and values buffers of `elems` elements each.
        bufs: Vec<(Tensor, Tensor)>,
        elems: usize,
        dtype: DType,
        /// The layer each buffer was issued for in this step, and the event
        /// after its copies.
        ready: Vec<Option<(usize, CudaEvent)>>,
    }

    fn w(e: impl std::error::Error + Send + Sync + 'static) -> candle_core::Error {
        candle_core::Error::wrap(e)
    }

    impl Ring {
        pub(super) fn new(d: &CudaDevice, elems: usize, dtype: DType) -> Result<Self> {
            let compute = d.cuda_stream();
            let dev = Device::Cuda(d.clone());
            let bufs = (0..BUFFERS)
                .map(|_| {
                    Ok((
                        Tensor::zeros(elems, dtype, &dev)?,
                        Tensor::zeros(elems, dtype, &dev)?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            let stream = compute.context().new_stream().map_err(w)?;
            // The buffers' allocation and zeroing come first.
            stream.join(&compute).map_err(w)?;
            Ok(Self {
                stream,
                compute,
                bufs,
                elems,
                dtype,
                ready: (0..BUFFERS).map(|_| None).collect(),
            })
        }

        /// Whether the buffers hold `elems` elements of `dtype`.
        pub(super) fn holds(&self, elems: usize, dtype: DType) -> bool {
            self.elems >= elems && self.dtype == dtype
        }

        /// Forgets which layers were issued (a new step brings new rows).
        pub(super) fn new_step(&mut self) {
            self.ready.iter_mut().for_each(|r| *r = None);
        }

        /// The buffer views of `shape` for `layer`.
        fn views(&self, layer: usize, shape: &Shape) -> Result<(Tensor, Tensor)> {
            let n = shape.elem_count();
            if n > self.elems {
                bail!(
                    "kv cache: a host part of {n} elements for buffers of {}",
                    self.elems
                );
            }
            let (k, v) = &self.bufs[layer % BUFFERS];
            Ok((
                k.narrow(0, 0, n)?.reshape(shape)?,
                v.narrow(0, 0, n)?.reshape(shape)?,
            ))
        }

        /// Enqueues `layer`'s copies (unless issued this step already).
        pub(super) fn issue(
            &mut self,
            layer: usize,
            (k, v): (&HostBuffer, &HostBuffer),
            region: Region,
            shape: &Shape,
        ) -> Result<()> {
            let b = layer % BUFFERS;
            if self.ready[b].as_ref().is_some_and(|(l, _)| *l == layer) {
                return Ok(());
            }
            let (dk, dv) = self.views(layer, shape)?;
            // The buffer's last reader, layer - 3's attention, is enqueued on
            // the compute stream before this point.
            self.stream.join(&self.compute).map_err(w)?;
            // SAFETY: the views are contiguous (the flat buffers' first
            // elements) of the region's size (checked inside); this stream
            // writes them after the compute stream's earlier work (the join
            // above), the compute stream reads them only after the event
            // recorded below (`take`), and the buffers live until this ring
            // drops, which waits for this stream first.
            unsafe {
                k.upload_region_on(region, &dk, &self.stream)?;
                v.upload_region_on(region, &dv, &self.stream)?;
            }
            let done = self.stream.record_event(None).map_err(w)?;
            self.ready[b] = Some((layer, done));
            Ok(())
        }

        /// `layer`'s keys and values, the compute stream waiting for their
        /// copies.
        pub(super) fn take(&mut self, layer: usize, shape: &Shape) -> Result<(Tensor, Tensor)> {
            let Some((l, done)) = &self.ready[layer % BUFFERS] else {
                bail!("kv cache: layer {layer}'s host part was not issued")
            };
            if *l != layer {
                bail!("kv cache: layer {layer}'s buffer holds layer {l}");
            }
            self.compute.wait(done).map_err(w)?;
            self.views(layer, shape)
        }
    }

    impl Drop for Ring {
        fn drop(&mut self) {
            // The buffers are freed on the compute stream: this stream's
            // copies into them end first.
            if let Err(e) = self.stream.synchronize() {
                streamer_device::record_dropped_error(self.stream.context(), &w(e));
            }
        }
    }
}
