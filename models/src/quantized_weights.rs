//! A quantized base (QLoRA's frozen weights): the seven linear weights of
//! every decoder layer as packed byte buffers (`streamer_quant`'s
//! [`PackedLayout`]), by Hugging Face name. A streamed model keeps each as
//! a u8 host master, the pool copies the packed bytes, and the layer's
//! builder dequantizes them on the device into bf16
//! ([`Llama::streamed_quantized`](crate::Llama::streamed_quantized)).
//! Everything else (norms, embedding, head, biases) stays dense.
use crate::config::{split_layer_name, LlamaConfig};
use candle_core::{DType, Device, Result, Tensor};
use std::collections::{BTreeMap, HashMap};
use streamer_core::{SetupEvent, SetupHook, WeightSource};
use streamer_quant::{HostTensor, PackedLayout, QuantScheme};

/// The weights of a decoder layer that may be quantized, relative to the
/// layer (`model.layers.{i}.`).
pub const QUANTIZABLE: [&str; 7] = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
];

fn quant(e: streamer_quant::QuantError) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// The local name (relative to the layer) of a layer's quantized weights
/// held as one buffer: what the layer's streamed block reads and the pool
/// copies as one master.
pub(crate) const LAYER_IMAGE: &str = "quantized_weights";

/// Offsets of the packed buffers in a layer's image are aligned to this many
/// bytes (the pool's slot alignment: the kernels' vector loads).
const IMAGE_ALIGN: usize = 256;

/// Quantized linear weights by Hugging Face name, each a packed u8 buffer on
/// the host and its layout. Once a decoder layer has all seven, they are
/// moved into one buffer of the layer (its image, each weight a view of
/// it): a streamed layer then copies one host master instead of seven, and
/// every copy costs the driver's per-copy overhead and a pageable piece at
/// each end (only whole pages are page-locked). Cloning shares the buffers.
#[derive(Clone, Default)]
pub struct QuantizedWeights {
    entries: BTreeMap<String, (PackedLayout, Tensor)>,
    /// Layer index -> its image (each of the layer's entries is a view of
    /// it, at its layout's start offset).
    images: BTreeMap<usize, Tensor>,
}

/// What a streamed decoder layer reads packed: each quantized weight's
/// layout by name relative to the layer and, where the layer has an image,
/// the weight's offset in it.
#[derive(Clone, Default)]
pub(crate) struct LayerPacking {
    /// Layout and offset in the image (`None`: a buffer of its own).
    pub(crate) weights: HashMap<String, (PackedLayout, Option<usize>)>,
    /// Bytes of the layer's image, if it has one.
    pub(crate) image_bytes: Option<usize>,
}

impl LayerPacking {
    /// Whether the layer reads nothing packed.
    pub(crate) fn is_empty(&self) -> bool {
        self.weights.is_empty()
    }
}

/// The decoder layer `name` belongs to, if any.
fn layer_of(name: &str) -> Option<usize> {
    split_layer_name(name).map(|(i, _)| i)
}

impl QuantizedWeights {
    /// Quantized tensors by Hugging Face name (a loader's output), packed
    /// one at a time (each host tensor is dropped once packed).
    pub fn from_host(tensors: HashMap<String, HostTensor>) -> Result<Self> {
        let mut out = Self::default();
        for (name, t) in tensors {
            out.insert_host(&name, t)?;
        }
        Ok(out)
    }

    /// Adds `t` under `name`.
    pub fn insert_host(&mut self, name: &str, t: HostTensor) -> Result<()> {
        let t = t.with_name(name);
        self.insert_packed(t.layout(), t.to_bytes())
    }

    /// Adds a packed buffer of `layout` (named by it); a buffer of another
    /// length is an error naming the tensor.
    pub fn insert_packed(&mut self, layout: PackedLayout, bytes: Vec<u8>) -> Result<()> {
        layout.check_len(bytes.len()).map_err(quant)?;
        let n = bytes.len();
        // A variable from the start: the streamed model's host master is then
        // this buffer itself, not a copy (a 70B NF4 base is 39 GB).
        let t = candle_core::Var::from_vec(bytes, n, &Device::Cpu)?
            .as_tensor()
            .clone();
        let name = layout.name().to_string();
        self.entries.insert(name.clone(), (layout, t));
        match layer_of(&name) {
            Some(i) => self.seal(i),
            None => Ok(()),
        }
    }

    /// Moves layer `i`'s seven packed buffers into one image once it has
    /// them all (a replaced buffer makes a new image); until then, and for
    /// a layer quantized in part, each stays a buffer of its own.
    fn seal(&mut self, i: usize) -> Result<()> {
        self.images.remove(&i);
        let prefix = format!("model.layers.{i}.");
        let names: Vec<String> = QUANTIZABLE.iter().map(|l| format!("{prefix}{l}")).collect();
        if !names.iter().all(|n| self.entries.contains_key(n)) {
            return Ok(());
        }
        let (offsets, len) = image_offsets(names.iter().map(|n| self.entries[n].0.bytes()));
        let mut image = vec![0u8; len];
        for (at, name) in offsets.iter().zip(&names) {
            let bytes = self.entries[name].1.to_vec1::<u8>()?;
            image[*at..*at + bytes.len()].copy_from_slice(&bytes);
        }
        // A variable, so that the streamed model's host master is the image
        // itself, not a copy.
        let image = candle_core::Var::from_vec(image, len, &Device::Cpu)?
            .as_tensor()
            .clone();
        for (at, name) in offsets.iter().zip(&names) {
            let entry = self.entries.get_mut(name).expect("checked above");
            entry.1 = image.narrow(0, *at, entry.0.bytes())?;
        }
        self.images.insert(i, image);
        Ok(())
    }

    /// Every quantizable weight of `cfg` read from `src` (any float dtype)
    /// and quantized with `scheme`, one tensor at a time: the dense model is
    /// never in memory at once.
    pub fn quantize_source(
        src: &WeightSource,
        cfg: &LlamaConfig,
        scheme: QuantScheme,
    ) -> Result<Self> {
        Self::quantize_source_watched(src, cfg, scheme, None)
    }

    /// [`Self::quantize_source`], each weight done told to `watch` as a
    /// [`SetupEvent::Quantized`] (a big base takes minutes).
    pub fn quantize_source_watched(
        src: &WeightSource,
        cfg: &LlamaConfig,
        scheme: QuantScheme,
        watch: Option<&SetupHook>,
    ) -> Result<Self> {
        let total = quantizable(cfg).len();
        let mut out = Self::default();
        out.quantize_all(
            src,
            cfg,
            scheme,
            |_| true,
            |done| {
                if let Some(h) = watch {
                    h.emit(SetupEvent::Quantized { done, total });
                }
            },
        )?;
        Ok(out)
    }

    /// The quantizable weights of `cfg` that `take` accepts, read from `src`
    /// and quantized with `scheme` one tensor at a time, `done` told the
    /// count after each.
    fn quantize_all(
        &mut self,
        src: &WeightSource,
        cfg: &LlamaConfig,
        scheme: QuantScheme,
        take: impl Fn(&str) -> bool,
        done: impl Fn(usize),
    ) -> Result<()> {
        let names = quantizable(cfg).into_iter().filter(|(n, _)| take(n));
        for (i, (name, shape)) in names.enumerate() {
            let values = src
                .load(&name, DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let t = scheme.quantize(&name, &values, &shape).map_err(quant)?;
            drop(values);
            self.insert_host(&name, t)?;
            done(i + 1);
        }
        Ok(())
    }

    /// Every quantizable weight of `cfg` as [`crate::init_weights`] makes it
    /// for `seed`, quantized with `scheme` a layer at a time: the same bytes
    /// as quantizing the whole init, in about its packed bytes of host
    /// memory and one layer's dense weights (the whole init of a 70B model
    /// is 280 GB of f32).
    pub fn quantize_init(cfg: &LlamaConfig, scheme: QuantScheme, seed: u64) -> Result<Self> {
        let mut out = Self::default();
        for i in 0..cfg.num_hidden_layers {
            let prefix = format!("model.layers.{i}.");
            let layer = crate::checkpoint::init_weights_where(cfg, seed, |n| {
                n.starts_with(&prefix) && is_quantizable(n)
            })?;
            let layer = WeightSource::Tensors(layer);
            out.quantize_all(&layer, cfg, scheme, |n| n.starts_with(&prefix), |_| ())?;
        }
        Ok(out)
    }

    /// Every quantizable weight of `cfg` as a valid packed buffer of random
    /// codes whose values lie within about `±magnitude` (made layer by
    /// layer, without dense weights): a quantized base of any size for
    /// benches, in about its packed bytes of host memory.
    pub fn synthetic(
        cfg: &LlamaConfig,
        scheme: QuantScheme,
        seed: u64,
        magnitude: f32,
    ) -> Result<Self> {
        use rayon::prelude::*;
        // Tensor by tensor on every core: a 70B base is 36 GiB of codes.
        let made = quantizable(cfg)
            .into_par_iter()
            .enumerate()
            .map(|(k, (name, shape))| {
                let layout = scheme.layout(&name, &shape).map_err(quant)?;
                let bytes = layout.synthetic(seed.wrapping_add(k as u64), magnitude);
                Ok((layout, bytes))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut out = Self::default();
        for (layout, bytes) in made {
            out.insert_packed(layout, bytes)?;
        }
        Ok(out)
    }

    /// Whether `name` is quantized here.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The quantized weights' names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.entries.keys().cloned().collect()
    }

    /// The names [`Self::over`] adds to a source: each layer image's, and
    /// each quantized weight's outside an image.
    pub(crate) fn source_names(&self) -> Vec<String> {
        self.source_tensors().map(|(n, _)| n).collect()
    }

    /// Each tensor [`Self::over`] adds, by its source name: the layers'
    /// images and the quantized weights outside one.
    fn source_tensors(&self) -> impl Iterator<Item = (String, &Tensor)> {
        let images = self.images.iter().map(|(i, t)| (image_name(*i), t));
        let loose = (self.entries.iter())
            .filter(|(n, _)| layer_of(n).is_none_or(|i| !self.images.contains_key(&i)))
            .map(|(n, (_, t))| (n.clone(), t));
        images.chain(loose)
    }

    /// The layout of `name`, if quantized.
    pub fn layout(&self, name: &str) -> Option<&PackedLayout> {
        self.entries.get(name).map(|(l, _)| l)
    }

    /// The packed buffer of `name` (a 1-D u8 host tensor), if quantized.
    pub fn packed_tensor(&self, name: &str) -> Option<&Tensor> {
        self.entries.get(name).map(|(_, t)| t)
    }

    /// Bytes of layer `i`'s image (its seven packed buffers, each at a
    /// 256-byte aligned offset), if it has one.
    pub fn image_bytes(&self, i: usize) -> Option<usize> {
        self.images.get(&i).map(Tensor::elem_count)
    }

    /// Bytes of every packed buffer: what streaming the quantized weights
    /// once copies, but for the images' alignment padding.
    pub fn packed_bytes(&self) -> usize {
        self.entries.values().map(|(l, _)| l.bytes()).sum()
    }

    /// Every quantized weight dequantized on the CPU (bf16, of its shape):
    /// the dense reference the streamed path is compared with.
    pub fn dequantized(&self) -> Result<HashMap<String, Tensor>> {
        (self.entries.iter())
            .map(|(n, (l, t))| Ok((n.clone(), streamer_quant::dequantize(t, l)?)))
            .collect()
    }

    /// One source of every weight: the layers' images and the packed
    /// buffers outside one (u8, shared, not copied) and `src`'s other tensors
    /// as it holds them (in-memory ones shared; a dense copy of a quantized
    /// weight in `src` is skipped).
    pub(crate) fn over(&self, src: &WeightSource) -> Result<WeightSource> {
        let mut all: HashMap<String, Tensor> = (self.source_tensors())
            .map(|(n, t)| (n, t.clone()))
            .collect();
        for name in src.names().into_iter().filter(|n| !self.contains(n)) {
            // Shared where in memory: the masters made from this source copy
            // them once (`WeightSource::load_master`).
            let t = src.read(&name)?;
            all.insert(name, t);
        }
        Ok(WeightSource::Tensors(all))
    }

    /// What layer `i` reads packed ([`LayerPacking`]).
    pub(crate) fn layer_packing(&self, i: usize) -> LayerPacking {
        let prefix = format!("model.layers.{i}.");
        let image = self.images.get(&i);
        // In an image, a weight's view starts at its offset.
        let weights = (self.entries.iter())
            .filter_map(|(n, (l, t))| {
                let local = n.strip_prefix(&prefix)?;
                let at = image.map(|_| t.layout().start_offset());
                Some((local.to_string(), (l.clone(), at)))
            })
            .collect();
        LayerPacking {
            weights,
            image_bytes: image.map(Tensor::elem_count),
        }
    }

    /// Fails unless every quantized weight is a linear weight of a decoder
    /// layer of `cfg` (norms, embedding, head and biases stay dense) of the
    /// shape `cfg` implies; errors name the tensor.
    pub fn check(&self, cfg: &LlamaConfig) -> Result<()> {
        let expected: HashMap<String, Vec<usize>> = quantizable(cfg).into_iter().collect();
        for (name, (layout, _)) in &self.entries {
            let Some(shape) = expected.get(name) else {
                return Err(streamer_device::Error::Config {
                    field: format!("quantized tensor {name:?}"),
                    reason: format!(
                        "is not a linear weight of a decoder layer of this config ({} layers; \
                         quantizable: {QUANTIZABLE:?}): norms, embedding, head and biases stay dense",
                        cfg.num_hidden_layers
                    ),
                }
                .into());
            };
            streamer_device::Error::check_shape(layout.shape(), shape, || {
                let what = format!("quantized tensor {name:?}");
                (what, format!("{shape:?}, as the config implies"))
            })?;
        }
        Ok(())
    }
}

/// Where buffers of `sizes` bytes (in [`QUANTIZABLE`] order) lie in a
/// layer's image, and the image's length.
pub(crate) fn image_offsets(sizes: impl Iterator<Item = usize>) -> (Vec<usize>, usize) {
    let (mut offsets, mut len) = (Vec::new(), 0usize);
    for n in sizes {
        let at = len.next_multiple_of(IMAGE_ALIGN);
        offsets.push(at);
        len = at + n;
    }
    (offsets, len)
}

/// The source name of layer `i`'s image.
fn image_name(i: usize) -> String {
    format!("model.layers.{i}.{LAYER_IMAGE}")
}

/// Whether the Hugging Face name `name` is a quantizable weight
/// (`model.layers.{i}.` and one of [`QUANTIZABLE`]).
pub fn is_quantizable(name: &str) -> bool {
    split_layer_name(name).is_some_and(|(_, local)| QUANTIZABLE.contains(&local))
}

/// The quantizable weights of `cfg` and their shapes, layer by layer.
fn quantizable(cfg: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    (cfg.weight_shapes().into_iter())
        .filter(|(n, _, _)| is_quantizable(n))
        .map(|(n, s, _)| (n, s))
        .collect()
}
