//! Keys and values of the positions already seen, per decoder layer, so that
//! generation feeds each new token alone instead of the whole prefix again.
//!
//! The cache belongs to the [`crate::Llama`] and is shared (an `Arc`) with every
//! decoder layer it builds, resident or streamed: a streamed model rebuilds its
//! layers on every call, so a layer cannot keep state itself. A layer uses its
//! slot only when a call asks for it (see [`crate::DecoderLayer`]'s extras), so
//! ordinary forwards and training never touch the cache.
use candle_core::{bail, Result, Tensor};
use std::sync::{Mutex, MutexGuard};

/// One layer's `(k, v)`, each `(batch, kv_heads, positions, head_dim)`, after
/// the rotary embedding; `None` before the first cached call.
type Slot = Option<(Tensor, Tensor)>;

/// Every layer's [`Slot`].
/// A streamed model's embedding, final norm and head on the device.
type Outer = (Tensor, Tensor, Tensor);

/// A batched decode's state ([`crate::batch_generate`]): every sequence
/// slot keeps its own keys and values per layer, and the step in flight says
/// which rows of the packed call belong to which slot.
#[derive(Debug)]
struct Batched {
    /// `[sequence slot][layer]`.
    slots: Vec<Vec<Slot>>,
    /// The call in flight: `(slot, rows)` in row order.
    step: Vec<(usize, usize)>,
}

#[derive(Debug)]
pub(crate) struct KvCache {
    layers: Mutex<Vec<Slot>>,
    batched: Mutex<Option<Batched>>,
    /// The device copies of a streamed model's outer weights for the cached
    /// sequence: uploaded at its first call, not at every token (they are the
    /// size of several layers), and dropped with the cache.
    outer: Mutex<Option<Outer>>,
}

impl KvCache {
    /// An empty cache for `layers` decoder layers.
    pub(crate) fn new(layers: usize) -> Self {
        Self {
            layers: Mutex::new(vec![None; layers]),
            batched: Mutex::new(None),
            outer: Mutex::new(None),
        }
    }

    fn lock(&self) -> Result<MutexGuard<'_, Vec<Slot>>> {
        self.layers
            .lock()
            .map_err(|_| candle_core::Error::Msg("kv cache poisoned by a panic".into()))
    }

    /// Positions cached (those of layer 0; every layer holds the same number
    /// after a complete call).
    pub(crate) fn positions(&self) -> Result<usize> {
        match self.lock()?.first() {
            Some(Some((k, _))) => k.dim(2),
            _ => Ok(0),
        }
    }

    /// Forgets every cached position (and the outer weights' copies).
    pub(crate) fn clear(&self) -> Result<()> {
        self.lock()?.iter_mut().for_each(|s| *s = None);
        *self.lock_outer()? = None;
        Ok(())
    }

    fn lock_outer(&self) -> Result<MutexGuard<'_, Option<Outer>>> {
        self.outer
            .lock()
            .map_err(|_| candle_core::Error::Msg("kv cache poisoned by a panic".into()))
    }

    /// The outer weights' device copies of this cached sequence, made by
    /// `make` at its first call (no position cached yet).
    pub(crate) fn outer_or(&self, make: impl FnOnce() -> Result<Outer>) -> Result<Outer> {
        // A batch keeps its copies from `begin_batch` to `end_batch`.
        let fresh = self.positions()? == 0 && self.lock_batched()?.is_none();
        let mut outer = self.lock_outer()?;
        if fresh || outer.is_none() {
            *outer = Some(make()?);
        }
        Ok(outer.clone().expect("set above"))
    }

    /// Appends this call's `k`, `v` to layer `layer`'s slot and returns the keys
    /// and values of every position so far. On an error the slot is unchanged.
    pub(crate) fn extend(&self, layer: usize, k: Tensor, v: Tensor) -> Result<(Tensor, Tensor)> {
        let mut slots = self.lock()?;
        let Some(slot) = slots.get_mut(layer) else {
            bail!("kv cache has no slot for layer {layer}")
        };
        let (k, v) = match slot.as_ref() {
            Some((pk, pv)) => (Tensor::cat(&[pk, &k], 2)?, Tensor::cat(&[pv, &v], 2)?),
            None => (k, v),
        };
        *slot = Some((k.clone(), v.clone()));
        Ok((k, v))
    }

    fn lock_batched(&self) -> Result<MutexGuard<'_, Option<Batched>>> {
        self.batched
            .lock()
            .map_err(|_| candle_core::Error::Msg("kv cache poisoned by a panic".into()))
    }

    /// Starts batched decoding with `slots` empty sequence slots (the
    /// single-sequence cache and the outer weights' copies are emptied).
    pub(crate) fn begin_batch(&self, slots: usize) -> Result<()> {
        self.clear()?;
        let layers = self.lock()?.len();
        *self.lock_batched()? = Some(Batched {
            slots: vec![vec![None; layers]; slots],
            step: Vec::new(),
        });
        Ok(())
    }

    /// Ends batched decoding, dropping every slot.
    pub(crate) fn end_batch(&self) -> Result<()> {
        *self.lock_batched()? = None;
        self.clear()
    }

    /// Sets the rows of the next packed call: `(slot, rows)` in row order
    /// (empty: no call in flight).
    pub(crate) fn set_step(&self, step: Vec<(usize, usize)>) -> Result<()> {
        match self.lock_batched()?.as_mut() {
            Some(b) => b.step = step,
            None if step.is_empty() => {}
            None => bail!("kv cache: a batched step outside begin_batch/end_batch"),
        }
        Ok(())
    }

    /// The packed call in flight, if batched decoding is on and a call is.
    pub(crate) fn step(&self) -> Result<Option<Vec<(usize, usize)>>> {
        Ok(self
            .lock_batched()?
            .as_ref()
            .filter(|b| !b.step.is_empty())
            .map(|b| b.step.clone()))
    }

    /// Positions cached for sequence slot `slot` (layer 0's).
    pub(crate) fn slot_positions(&self, slot: usize) -> Result<usize> {
        match self
            .lock_batched()?
            .as_ref()
            .and_then(|b| b.slots.get(slot))
        {
            Some(layers) => match layers.first() {
                Some(Some((k, _))) => k.dim(2),
                _ => Ok(0),
            },
            None => bail!("kv cache: no batch slot {slot}"),
        }
    }

    /// Empties sequence slot `slot` for the next sequence.
    pub(crate) fn clear_slot(&self, slot: usize) -> Result<()> {
        match self
            .lock_batched()?
            .as_mut()
            .and_then(|b| b.slots.get_mut(slot))
        {
            Some(layers) => layers.iter_mut().for_each(|s| *s = None),
            None => bail!("kv cache: no batch slot {slot}"),
        }
        Ok(())
    }

    /// [`KvCache::extend`] for sequence slot `slot` of a batch.
    pub(crate) fn extend_slot(
        &self,
        layer: usize,
        slot: usize,
        k: Tensor,
        v: Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let mut batched = self.lock_batched()?;
        let Some(s) = batched
            .as_mut()
            .and_then(|b| b.slots.get_mut(slot))
            .and_then(|l| l.get_mut(layer))
        else {
            bail!("kv cache has no batch slot {slot} for layer {layer}")
        };
        let (k, v) = match s.as_ref() {
            Some((pk, pv)) => (Tensor::cat(&[pk, &k], 2)?, Tensor::cat(&[pv, &v], 2)?),
            None => (k.contiguous()?, v.contiguous()?),
        };
        *s = Some((k.clone(), v.clone()));
        Ok((k, v))
    }
}
