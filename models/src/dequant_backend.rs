//! A `VarBuilder` that dequantizes: a decoder layer built over it reads its
//! quantized weights as dense bf16 tensors, made on the device from the
//! packed bytes its streamed slot holds (`streamer_quant::dequantize`; a
//! layer's image, [`QuantizedWeights`](crate::QuantizedWeights), is one
//! master read once and cut into its weights), and every other weight as
//! the slot holds it. The layer's code (forward and
//! hand-written backward) is the dense layer's, unchanged; the dequantized
//! tensors are fresh (no variable, no autograd node), so the base gets no
//! weight gradient while adapters' gradients flow through them.
use crate::quantized_weights::{LayerPacking, LAYER_IMAGE};
use candle_core::{DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use std::sync::Arc;
use streamer_quant::PackedLayout;

/// Reads the names in `packing` (relative to `inner`'s prefix) as packed
/// buffers and dequantizes them; everything else comes from `inner`.
struct Dequantizing<'a> {
    inner: VarBuilder<'a>,
    packing: Arc<LayerPacking>,
}

impl Dequantizing<'_> {
    /// The dense tensor of `name` (packed as `layout`) in `dtype`, checked
    /// against the shape asked for (when one is).
    fn dense(
        &self,
        name: &str,
        (layout, at): &(PackedLayout, Option<usize>),
        want: Option<&Shape>,
        dtype: DType,
    ) -> Result<Tensor> {
        if let Some(s) = want {
            streamer_device::Error::check_shape(layout.shape(), s.dims(), || {
                let what = format!("quantized tensor {:?}", layout.name());
                (what, format!("{:?}, as the layer expects", s.dims()))
            })?;
        }
        let bytes = match (at, self.packing.image_bytes) {
            (Some(at), Some(len)) => (self.inner)
                .get_with_hints_dtype(len, LAYER_IMAGE, Init::Const(0.), DType::U8)?
                .narrow(0, *at, layout.bytes())?,
            _ => (self.inner).get_with_hints_dtype(
                layout.bytes(),
                name,
                Init::Const(0.),
                DType::U8,
            )?,
        };
        if streamer_core::discovering() {
            // The streamed model is learning what the layer reads (the bytes,
            // just recorded), not computing: dequantizing here would cost a
            // whole model's dequantization on the host.
            return streamer_core::stand_in(&Shape::from_dims(layout.shape()), dtype);
        }
        streamer_quant::dequantize(&bytes, layout)?.to_dtype(dtype)
    }
}

impl SimpleBackend for Dequantizing<'_> {
    fn get(&self, s: Shape, name: &str, h: Init, dtype: DType, _dev: &Device) -> Result<Tensor> {
        match self.packing.weights.get(name) {
            Some(w) => self.dense(name, w, Some(&s), dtype),
            None => self.inner.get_with_hints_dtype(s, name, h, dtype),
        }
    }

    fn get_unchecked(&self, name: &str, dtype: DType, _dev: &Device) -> Result<Tensor> {
        match self.packing.weights.get(name) {
            Some(w) => self.dense(name, w, None, dtype),
            None => self.inner.get_unchecked_dtype(name, dtype),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        // A weight in the layer's image is no name of the slot's own.
        self.packing.weights.contains_key(name) || self.inner.contains_tensor(name)
    }
}

/// `vb` with the names in `packing` (relative to `vb`'s prefix) read as
/// packed buffers and dequantized; with nothing packed, `vb` itself.
pub(crate) fn dequantizing<'a>(vb: VarBuilder<'a>, packing: &Arc<LayerPacking>) -> VarBuilder<'a> {
    if packing.is_empty() {
        return vb;
    }
    let (dtype, device) = (vb.dtype(), vb.device().clone());
    let backend = Dequantizing {
        inner: vb,
        packing: packing.clone(),
    };
    VarBuilder::from_backend(Box::new(backend), dtype, device)
}
