//! The embedding, final norm and head masters of a streamed model whose
//! optimizer steps them on the host (`LmTrainer` with `OptimizerPlace::Host`).
//!
//! Every step the forward copies these f32 masters to the device and the
//! backward brings their gradients back: 4.2 GB each way at Llama 3.1 8B's
//! vocabulary. Through Candle's copies both are pageable, and the gradients
//! land in fresh host memory, which the GPU machine first-touches at about
//! 6.6 GB/s (`benches/results/pin-probe-h200.txt`). In the 8B step in a
//! 24 GiB cap the GPU sat idle 4.7 s of 12.4 s between the last layer's
//! backward and the next step's first layer, where these copies and the host
//! step run (`benches/results/big-train-8b-cap24-timeline-h200.json`). Here
//! the masters' pages are locked in place, so the forward's copies are DMA,
//! and the gradients come down by DMA into page-locked buffers made once and
//! reused every step.
use candle_core::{Device, Result, Tensor, TensorId, Var};
use std::collections::HashMap;
use streamer_core::Offloader;

/// Page-locked gradient buffers and pinned masters for the outer weights.
pub(crate) struct OuterHost {
    /// Copies the gradients down on a stream of their own.
    off: Offloader,
    /// Each master's gradient buffer (its shape and dtype), by the master's
    /// id.
    bufs: HashMap<TensorId, Tensor>,
    /// The masters' pages locked in place (each guard holds its master).
    #[cfg(feature = "cuda")]
    _pins: Vec<streamer_core::PinnedHost>,
}

impl OuterHost {
    /// Pins `masters` (host variables) for copies to `device`, and makes
    /// their gradient buffers.
    pub(crate) fn new(device: &Device, masters: &[&Var]) -> Result<Self> {
        let mut off = Offloader::new(device)?;
        let mut bufs = HashMap::new();
        for m in masters {
            if !m.device().is_cpu() {
                candle_core::bail!("outer masters to pin must be on the host");
            }
            bufs.insert(m.id(), off.host_buffer(m.shape(), m.dtype())?);
        }
        Ok(Self {
            #[cfg(feature = "cuda")]
            _pins: pin(device, masters)?,
            off,
            bufs,
        })
    }

    /// `master` copied to `device` by DMA from its locked pages, or `None`
    /// when it is not one of these masters or its pages could not be locked
    /// (the caller then copies it the plain way).
    pub(crate) fn copy_up(&self, master: &Var, device: &Device) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = device {
            let id = master.as_tensor().id();
            if let Some(p) = self
                ._pins
                .iter()
                .find(|p| p.is_pinned() && p.tensor().id() == id)
            {
                return p.to_device(d).map(Some);
            }
        }
        let _ = (master, device);
        Ok(None)
    }

    /// Brings each `(master, gradient on the device)` down into the master's
    /// buffer, in the master's dtype, all the copies queued before one wait.
    /// Returns `(master, buffer)` pairs.
    ///
    /// # Safety
    /// The buffers are rewritten by DMA during the next call: no tensor this
    /// call returned may be read while a later call runs (drop them, or be
    /// done with them, first).
    pub(crate) unsafe fn bring_down(
        &mut self,
        grads: Vec<(Var, Tensor)>,
    ) -> Result<Vec<(Var, Tensor)>> {
        let mut out = Vec::with_capacity(grads.len());
        for (master, g) in grads {
            let Some(buf) = self.bufs.get(&master.id()) else {
                candle_core::bail!(
                    "no gradient buffer for an outer master of shape {:?}",
                    master.dims()
                );
            };
            let g = g.to_dtype(master.dtype())?;
            // SAFETY: `buf` is this offloader's host buffer; nothing reads it
            // before the `synchronize` below: this call's tensors are handed
            // out after it, and the previous call's are not read during this
            // one (this function's contract).
            unsafe { self.off.enqueue(&g, buf)? };
            out.push((master, buf.clone()));
        }
        self.off.synchronize()?;
        Ok(out)
    }
}

/// Locks the pages of each master in place for DMA from it (a master whose
/// registration fails stays pageable: its copies are slower, not wrong).
#[cfg(feature = "cuda")]
fn pin(device: &Device, masters: &[&Var]) -> Result<Vec<streamer_core::PinnedHost>> {
    let Device::Cuda(d) = device else {
        return Ok(Vec::new());
    };
    masters
        .iter()
        .map(|m| streamer_core::PinnedHost::new(d, m.as_tensor()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    /// Gradients land in the master's buffer in the master's dtype, equal to
    /// the device gradient converted; the next call rewrites the same buffer
    /// (the contract callers rely on: step before the next backward); a
    /// gradient of a master without a buffer is an error naming its shape.
    #[test]
    fn gradients_come_down_into_reused_buffers() -> Result<()> {
        let dev = Device::Cpu;
        let m = Var::from_tensor(&Tensor::zeros((3, 4), DType::F32, &dev)?)?;
        let mut host = OuterHost::new(&dev, &[&m])?;
        let g = |k: f32| -> Result<Tensor> {
            (Tensor::arange(0f32, 12.0, &dev)?.reshape((3, 4))? * k as f64)?.to_dtype(DType::BF16)
        };
        // SAFETY (each call): `first` is only read between the calls.
        let first = unsafe { host.bring_down(vec![(m.clone(), g(1.0)?)])? };
        assert_eq!(first.len(), 1);
        let want: Vec<f32> = (0..12).map(|i| i as f32).collect();
        assert_eq!(first[0].1.dtype(), DType::F32);
        assert_eq!(first[0].1.flatten_all()?.to_vec1::<f32>()?, want);
        unsafe { host.bring_down(vec![(m.clone(), g(2.0)?)])? };
        let again: Vec<f32> = want.iter().map(|v| 2.0 * v).collect();
        assert_eq!(first[0].1.flatten_all()?.to_vec1::<f32>()?, again);
        let other = Var::from_tensor(&Tensor::zeros((2, 2), DType::F32, &dev)?)?;
        let e = unsafe { host.bring_down(vec![(other, Tensor::zeros((2, 2), DType::F32, &dev)?)]) }
            .expect_err("no buffer for that master");
        assert!(e.to_string().contains("[2, 2]"), "{e}");
        Ok(())
    }
}
