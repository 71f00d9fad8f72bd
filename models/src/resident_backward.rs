//! Resident training through the decoder layers' hand-written backward.
//!
//! Under plain Candle autograd a resident layer's backward is a chain of
//! generic kernels with every intermediate gradient added into fresh zeros
//! (`decoder_backward.rs` says what that costs). Here each layer's training
//! forward runs outside the graph ([`ManualBackward::forward_train`], keeping
//! its activations) and joins the graph as one node, [`LayerNode`], whose
//! backward is the layer's written-out one. Candle's backward gives a node
//! only its input's gradient back, so the weight gradients it produces go to a
//! [`WeightGrads`] store that [`crate::Llama::backward`] merges into the
//! `GradStore`.
//!
//! The store makes misuse loud rather than silent: a plain `loss.backward()`
//! (which cannot see the store) leaves gradients in it, and the next training
//! forward refuses to run until they are taken.
use candle_core::backprop::GradStore;
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use streamer_core::{ManualBackward, SavedActivations};

/// Where the layer nodes' weight gradients wait for [`crate::Llama::backward`],
/// and whether the hand-written path is on.
#[derive(Default)]
pub(crate) struct WeightGrads {
    on: AtomicBool,
    grads: Mutex<Vec<(Tensor, Tensor)>>,
    /// Layer nodes of the current graph whose backward has not run yet.
    pending: Mutex<usize>,
}

impl WeightGrads {
    pub(crate) fn set_enabled(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    pub(crate) fn enabled(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    fn lock<T>(m: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>> {
        m.lock().map_err(|_| {
            candle_core::Error::Msg("resident backward: a previous backward panicked".into())
        })
    }

    /// Called before a training forward: the previous step's gradients must
    /// have been collected.
    pub(crate) fn begin(&self) -> Result<()> {
        let mut g = Self::lock(&self.grads)?;
        if !g.is_empty() {
            let n = g.len();
            g.clear();
            bail!(
                "{n} layer weight gradients of the previous backward were never collected: with \
                 the hand-written resident backward on (Llama::set_fused_backward), take \
                 gradients with Llama::backward(&loss), not loss.backward(); they are dropped now"
            );
        }
        *Self::lock(&self.pending)? = 0;
        Ok(())
    }

    /// Moves the collected weight gradients into `store` (adding to any there).
    pub(crate) fn collect(&self, store: &mut GradStore) -> Result<()> {
        let pending = *Self::lock(&self.pending)?;
        let grads = std::mem::take(&mut *Self::lock(&self.grads)?);
        if pending != 0 {
            bail!(
                "resident backward: {pending} layers did not run their backward (was the loss \
                 computed from this forward's output?)"
            );
        }
        for (w, g) in grads {
            let g = match store.remove(&w) {
                Some(prev) => (prev + g)?,
                None => g,
            };
            store.insert(&w, g);
        }
        Ok(())
    }
}

/// One layer in the graph: the forward already computed (its output handed
/// out by `fwd`), the backward the layer's own.
struct LayerNode<L> {
    layer: L,
    y: Tensor,
    saved: Mutex<Option<SavedActivations>>,
    store: Arc<WeightGrads>,
}

/// `layer(x)` for a training step: the output, recorded as one graph node
/// whose backward is `man`'s.
pub(crate) fn layer_node<L: ManualBackward + Clone + Send + Sync + 'static>(
    layer: &L,
    x: &Tensor,
    extras: &[Tensor],
    store: &Arc<WeightGrads>,
) -> Result<Tensor> {
    let (y, saved) = layer.forward_train(&x.detach(), extras)?;
    // `fwd` hands out this tensor's storage as the node's output.
    let whole = |t: &Tensor| t.is_contiguous() && t.layout().start_offset() == 0;
    let y = if whole(&y) { y } else { y.copy()? };
    *WeightGrads::lock(&store.pending)? += 1;
    x.apply_op1(LayerNode {
        layer: layer.clone(),
        y,
        saved: Mutex::new(Some(saved)),
        store: store.clone(),
    })
}

impl<L: ManualBackward + Send + Sync + 'static> CustomOp1 for LayerNode<L> {
    fn name(&self) -> &'static str {
        "decoder-layer"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        let (s, l) = self.y.storage_and_layout();
        match &*s {
            candle_core::Storage::Cpu(c) if l.is_contiguous() && l.start_offset() == 0 => {
                Ok((c.clone(), l.shape().clone()))
            }
            _ => bail!("resident backward: the layer output is not a whole CPU tensor"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (s, l) = self.y.storage_and_layout();
        match &*s {
            candle_core::Storage::Cuda(c) => Ok((c.try_clone(l)?, l.shape().clone())),
            _ => bail!("resident backward: the layer output is not on the GPU"),
        }
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let saved = WeightGrads::lock(&self.saved)?.take().ok_or_else(|| {
            candle_core::Error::Msg("resident backward: a layer's backward ran twice".into())
        })?;
        let (dx, grads) = self.layer.backward(saved, grad)?;
        let detached: Vec<(Tensor, Tensor)> =
            grads.into_iter().map(|(w, g)| (w, g.detach())).collect();
        WeightGrads::lock(&self.store.grads)?.extend(detached);
        let mut pending = WeightGrads::lock(&self.store.pending)?;
        *pending = pending.saturating_sub(1);
        Ok(Some(dx.detach()))
    }
}
