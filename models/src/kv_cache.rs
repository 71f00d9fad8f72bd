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

#[derive(Debug)]
pub(crate) struct KvCache {
    layers: Mutex<Vec<Slot>>,
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
        let fresh = self.positions()? == 0;
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
}
