//! Host gradient buffers of the streamed weights: f32, one per distinct weight,
//! allocated once (page-locked on CUDA), filled by device-to-host copies that
//! overlap the next block's compute, accumulating across backward calls until
//! zeroed. Tied weights (several blocks) sum.
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor};
use streamer_core::{HostMasters, Offloader};

pub(crate) struct HostGrads {
    /// The gradient of each master, once allocated.
    acc: Vec<Option<Tensor>>,
    /// Landing buffers for gradients added to an existing one.
    land: Vec<Option<Tensor>>,
    /// `acc` holds a gradient (since the last zero).
    has: Vec<bool>,
    /// This backward wrote `acc` directly / landed into `land`.
    wrote: Vec<bool>,
    landed: Vec<bool>,
    offloader: Option<Offloader>,
    shapes: Vec<candle_core::Shape>,
}

impl HostGrads {
    pub(crate) fn new(n: usize) -> Self {
        Self {
            acc: vec![None; n],
            land: vec![None; n],
            has: vec![false; n],
            wrote: vec![false; n],
            landed: vec![false; n],
            offloader: None,
            shapes: Vec::new(),
        }
    }

    pub(crate) fn begin(&mut self, device: &Device, masters: &HostMasters) -> Result<()> {
        if self.offloader.is_none() {
            self.offloader = Some(Offloader::new(device)?);
            self.shapes = masters.iter().map(|m| m.shape().clone()).collect();
        }
        self.wrote.iter_mut().for_each(|w| *w = false);
        self.landed.iter_mut().for_each(|w| *w = false);
        Ok(())
    }

    fn off(&mut self) -> &mut Offloader {
        self.offloader
            .as_mut()
            .expect("begin() creates the offloader")
    }

    /// Sends master `m`'s gradient `g` (on the device, compute dtype) to the host.
    pub(crate) fn offload(&mut self, m: usize, g: &Tensor) -> Result<()> {
        streamer_core::faults::check(streamer_core::faults::FaultPoint::GradientOffload, || {
            format!("the gradient of weight {m} (shape {:?})", g.dims())
        })?;
        // Convert on the device (our cast kernel on CUDA): the optimizer gets f32.
        let g32 = streamer_core::convert(g, DType::F32)?;
        let shape = self.shapes[m].clone();
        if !self.has[m] && !self.wrote[m] {
            if self.acc[m].is_none() {
                self.acc[m] = Some(self.off().host_buffer(&shape, DType::F32)?);
            }
            let dst = self.acc[m].clone().expect("allocated above");
            // SAFETY: `dst` is this offloader's `host_buffer`; it is read only
            // after `finish` synchronises (`collect`) or, by the overlapped
            // optimizer, after waiting on a marker taken after this copy
            // (`written` + `marker`), and nothing writes it until then. The
            // caller's `GradStore` from an earlier backward holds these buffers
            // too: `TrainableSequential::backward` documents that the next
            // backward rewrites them, so they are not to be read during one.
            unsafe { self.off().enqueue(&g32, &dst)? };
            self.wrote[m] = true;
        } else {
            if self.landed[m] {
                // A weight tied across three or more blocks: fold the previous
                // landing into the sum before reusing the buffer.
                self.off().synchronize()?;
                self.fold(m)?;
            }
            if self.land[m].is_none() {
                self.land[m] = Some(self.off().host_buffer(&shape, DType::F32)?);
            }
            let dst = self.land[m].clone().expect("allocated above");
            // SAFETY: `dst` is this offloader's `host_buffer`, private to this
            // struct; `fold` reads it only after `synchronize` (above, or in
            // `finish`).
            unsafe { self.off().enqueue(&g32, &dst)? };
            self.landed[m] = true;
        }
        Ok(())
    }

    fn fold(&mut self, m: usize) -> Result<()> {
        let (Some(acc), Some(land)) = (&self.acc[m], &self.land[m]) else {
            return Ok(());
        };
        let sum = acc.add(land)?;
        acc.flatten_all()?.slice_set(&sum.flatten_all()?, 0, 0)?;
        self.landed[m] = false;
        Ok(())
    }

    /// A marker after every copy issued so far (see `Offloader::marker`).
    pub(crate) fn marker(&self) -> Result<streamer_core::OffloadMarker> {
        self.offloader
            .as_ref()
            .expect("begin() creates the offloader")
            .marker()
    }

    /// Master `m`'s gradient buffer, if this backward wrote it directly and
    /// nothing is waiting to be folded into it.
    pub(crate) fn written(&self, m: usize) -> Option<Tensor> {
        if self.wrote[m] && !self.landed[m] {
            self.acc[m].clone()
        } else {
            None
        }
    }

    pub(crate) fn release_sources(&mut self) -> Result<()> {
        match &mut self.offloader {
            Some(o) => o.release_sources(),
            None => Ok(()),
        }
    }

    /// Waits for the copies and folds accumulations into the sums.
    pub(crate) fn finish(&mut self) -> Result<()> {
        self.off().synchronize()?;
        for m in 0..self.acc.len() {
            if self.landed[m] {
                self.fold(m)?;
            }
            if self.wrote[m] {
                self.has[m] = true;
                self.wrote[m] = false;
            }
        }
        Ok(())
    }

    /// After a failed backward: waits for copies in flight and forgets this
    /// backward's partial gradients; gradients accumulated before stay intact.
    pub(crate) fn abort(&mut self) {
        if let Some(o) = &mut self.offloader {
            o.settle();
        }
        self.wrote.iter_mut().for_each(|w| *w = false);
        self.landed.iter_mut().for_each(|w| *w = false);
    }

    pub(crate) fn zero(&mut self) {
        self.has.iter_mut().for_each(|h| *h = false);
    }

    /// The gradients held, by master index.
    pub(crate) fn collect(&self) -> Result<Vec<(usize, Tensor)>> {
        Ok((0..self.acc.len())
            .filter(|&m| self.has[m])
            .filter_map(|m| self.acc[m].clone().map(|t| (m, t)))
            .collect())
    }

    pub(crate) fn take_counters(&mut self) -> (u64, f64) {
        match &mut self.offloader {
            Some(o) => o.take_counters(),
            None => (0, 0.0),
        }
    }
}

/// A cheap fingerprint of a host master: its address and 64 sampled values.
/// Any optimizer step or `Var::set` changes it; a change to a single unsampled
/// element would not be seen (documented on `backward`).
pub(crate) fn fingerprint(t: &Tensor) -> Result<u64> {
    use candle_core::{CpuStorage, Storage};
    let (s, l) = t.storage_and_layout();
    let Storage::Cpu(cs) = &*s else {
        candle_core::bail!("masters live on the host");
    };
    let n = t.elem_count();
    let start = l.start_offset();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ (&*s as *const Storage as u64);
    let step = (n / 64).max(1);
    let mut mix = |bits: u64| {
        h ^= bits;
        h = h.wrapping_mul(0x0100_0000_01b3);
    };
    for i in (0..n).step_by(step) {
        let j = start + i;
        match cs {
            CpuStorage::F32(v) => mix(v[j].to_bits() as u64),
            CpuStorage::F64(v) => mix(v[j].to_bits()),
            CpuStorage::BF16(v) => mix(v[j].to_bits() as u64),
            CpuStorage::F16(v) => mix(v[j].to_bits() as u64),
            _ => {}
        }
    }
    Ok(h)
}

/// Adds `g` to the gradient `grads` holds for `t` (or sets it).
pub fn accumulate_grad(grads: &mut GradStore, t: &Tensor, g: Tensor) -> Result<()> {
    let g = match grads.remove(t) {
        Some(prev) => prev.add(&g)?,
        None => g,
    };
    grads.insert(t, g);
    Ok(())
}
