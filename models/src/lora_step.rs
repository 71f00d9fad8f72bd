//! A LoRA step's loss and adapter gradients over micro-batches run one after
//! another (gradient accumulation).
//!
//! Each micro-batch is its own forward and backward, so it visits every
//! layer's weights once and holds only its own activations: a step of many
//! sequences then keeps every layer's activations inside a small device
//! budget instead of recomputing most layers. A quantized base is a few GB
//! of PCIe bytes a visit, so the extra visits cost less than the recompute
//! they save. The result is the step over all the rows at once (the mean of
//! equal micro-batches' mean losses, and its gradients).
use crate::llama::Llama;
use candle_core::backprop::GradStore;
use candle_core::{bail, Result, Tensor};
use streamer_autograd::accumulate_grad;

impl Llama {
    /// The mean loss over `tokens`' rows and the gradients of the LoRA
    /// adapters' variables, with the rows run as `micro_batches` equal
    /// micro-batches one after another. One micro-batch is
    /// `backward(loss(tokens, targets))` exactly. The model needs adapters
    /// ([`Llama::set_lora`]); `micro_batches` must divide the rows.
    pub fn lora_loss_and_grads(
        &self,
        tokens: &Tensor,
        targets: &Tensor,
        micro_batches: usize,
    ) -> Result<(f32, GradStore)> {
        let rows = tokens.dim(0)?;
        if micro_batches == 0 || rows % micro_batches != 0 {
            bail!(
                "lora_loss_and_grads: {rows} sequences do not split into {micro_batches} equal \
                 micro-batches"
            );
        }
        let Some(adapters) = self.lora()? else {
            bail!("lora_loss_and_grads: the model has no LoRA adapters (set_lora first)");
        };
        let vars = adapters.vars();
        let per = rows / micro_batches;
        let mut total = 0f32;
        let mut acc: Option<GradStore> = None;
        // Host spans on the pool's timeline: where a micro-batch's host time
        // goes between the GPU's layers.
        let mut t = std::time::Instant::now();
        for m in 0..micro_batches {
            let x = tokens.narrow(0, m * per, per)?;
            let y = targets.narrow(0, m * per, per)?;
            let loss = self.loss(&x, &y)?;
            self.host_span("micro-batch loss issued", &mut t)?;
            total += loss.to_scalar::<f32>()?;
            self.host_span("micro-batch loss read", &mut t)?;
            let mut grads = self.backward(&loss)?;
            self.host_span("micro-batch backward", &mut t)?;
            match acc.as_mut() {
                None => acc = Some(grads),
                Some(acc) => {
                    for (_, v) in &vars {
                        if let Some(g) = grads.remove(v.as_tensor()) {
                            accumulate_grad(acc, v.as_tensor(), g)?;
                        }
                    }
                }
            }
            drop(loss);
            self.host_span("micro-batch gradients summed, the loss freed", &mut t)?;
        }
        let mut grads = acc.expect("at least one micro-batch");
        if micro_batches > 1 {
            let scale = 1.0 / micro_batches as f64;
            for (_, v) in &vars {
                if let Some(g) = grads.remove(v.as_tensor()) {
                    grads.insert(v.as_tensor(), g.affine(scale, 0.0)?);
                }
            }
        }
        Ok((total / micro_batches as f32, grads))
    }
}
