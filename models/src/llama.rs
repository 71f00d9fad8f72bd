//! The Llama-family decoder: RMSNorm, rotary embedding, grouped-query attention
//! through `cqsa::attention`, SwiGLU MLP. A [`DecoderLayer`] is a
//! `streamer_core::Block`, so the same code runs resident (a loop over layers)
//! or streamed (`StreamedSequential`, trainable through `TrainableSequential`).
use crate::checkpoint::check_weights;
use crate::config::LlamaConfig;
use crate::kv_cache::KvCache;
use crate::lora::{LoraAdapters, LoraLayout, LoraSlot};
use crate::quantized_weights::QuantizedWeights;
use crate::resident_backward::{layer_node, WeightGrads};
use candle_core::backprop::GradStore;
use candle_core::{bail, DType, Device, Module, Result, Tensor, Var, D};
use candle_nn::{linear_b, linear_no_bias, Linear, VarBuilder};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use streamer_autograd::{Train, TrainableSequential};
use streamer_core::{
    Block, BlockCtx, BlockSpec, StreamConfig, StreamStats, StreamedSequential, WeightSource,
};

/// Root-mean-square normalisation: `x / sqrt(mean(x^2) + eps) * weight`, with
/// the statistics in f32 whatever the input dtype.
///
/// [`Module::forward`] runs candle-nn's fused kernel (which multiplies by the
/// weight before rounding to the input dtype), differentiable through
/// [`crate::ops::fused::rms_norm`]; [`RmsNorm::forward_unfused`] spells it out in
/// plain ops in Hugging Face's order (the normalised value is rounded to the input
/// dtype before the weight multiplies it).
#[derive(Clone, Debug)]
pub struct RmsNorm {
    pub(crate) weight: Tensor,
    pub(crate) eps: f64,
}

impl RmsNorm {
    /// Reads `weight` of shape `(size,)` from `vb`.
    pub fn new(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            weight: vb.get(size, "weight")?,
            eps,
        })
    }

    /// Wraps an existing weight.
    pub fn from_weight(weight: Tensor, eps: f64) -> Self {
        Self { weight, eps }
    }

    /// The weight.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The same normalisation in plain differentiable Candle ops.
    pub fn forward_unfused(&self, x: &Tensor) -> Result<Tensor> {
        let dt = x.dtype();
        let xf = x.to_dtype(DType::F32)?;
        let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
        let y = xf.broadcast_div(&(ms + self.eps)?.sqrt()?)?;
        y.to_dtype(dt)?.broadcast_mul(&self.weight)
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match x.dtype() {
            DType::F32 | DType::F16 | DType::BF16 => {
                crate::ops::fused::rms_norm(x, &self.weight, self.eps)
            }
            _ => self.forward_unfused(x),
        }
    }
}

/// Applies the rotary embedding in Hugging Face's "rotate half" layout:
/// `x * cos + rotate_half(x) * sin` with `x` of shape `(batch, heads, seq, head_dim)`
/// and `cos`, `sin` of shape `(seq, head_dim / 2)`: candle-nn's fused kernel,
/// differentiable in `x` through [`crate::ops::fused::rope`].
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if cos.track_op() || sin.track_op() {
        // Trainable tables: only the plain ops give their gradients.
        return apply_rope_unfused(x, cos, sin);
    }
    crate::ops::fused::rope(x, cos, sin)
}

/// [`apply_rope`] in plain differentiable Candle ops.
pub fn apply_rope_unfused(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let cos = Tensor::cat(&[cos, cos], D::Minus1)?
        .unsqueeze(0)?
        .unsqueeze(0)?;
    let sin = Tensor::cat(&[sin, sin], D::Minus1)?
        .unsqueeze(0)?
        .unsqueeze(0)?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
    let rot = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(&cos)? + rot.broadcast_mul(&sin)?
}

/// The rotary tables for positions `0..max_position_embeddings`, built once and
/// handed to every layer as its `extras`.
#[derive(Clone, Debug)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    /// Tables of shape `(max_position_embeddings, head_dim / 2)`, computed in f64
    /// and stored in `dtype` on `device`.
    pub fn new(cfg: &LlamaConfig, dtype: DType, device: &Device) -> Result<Self> {
        let inv = cfg.inv_freq();
        let n = cfg.max_position_embeddings;
        let mut cos = Vec::with_capacity(n * inv.len());
        let mut sin = Vec::with_capacity(n * inv.len());
        for p in 0..n {
            for f in &inv {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        let mk = |v: Vec<f32>| {
            Tensor::from_vec(v, (n, inv.len()), &Device::Cpu)?
                .to_dtype(dtype)?
                .to_device(device)
        };
        Ok(Self {
            cos: mk(cos)?,
            sin: mk(sin)?,
        })
    }

    /// `[cos, sin]` for positions `0..seq`, each `(seq, head_dim / 2)`.
    pub fn extras(&self, seq: usize) -> Result<Vec<Tensor>> {
        self.extras_at(0, seq)
    }

    /// `[cos, sin]` for the given positions, one row each (a packed batch
    /// of sequences at different positions).
    pub fn extras_for(&self, positions: &[u32]) -> Result<Vec<Tensor>> {
        let max = self.cos.dim(0)?;
        if let Some(p) = positions.iter().find(|&&p| p as usize >= max) {
            bail!("position {p} is past max_position_embeddings = {max}");
        }
        let at = Tensor::new(positions, self.cos.device())?;
        Ok(vec![
            self.cos.index_select(&at, 0)?,
            self.sin.index_select(&at, 0)?,
        ])
    }

    /// `[cos, sin]` for positions `start..start + seq`.
    pub fn extras_at(&self, start: usize, seq: usize) -> Result<Vec<Tensor>> {
        let max = self.cos.dim(0)?;
        if start + seq > max {
            bail!(
                "positions {start}..{} go past max_position_embeddings = {max}",
                start + seq
            );
        }
        Ok(vec![
            self.cos.narrow(0, start, seq)?,
            self.sin.narrow(0, start, seq)?,
        ])
    }
}

/// One decoder layer: `x + attn(norm(x))`, then `x + mlp(norm(x))`.
///
/// Weights (Hugging Face names, relative to the layer's `VarBuilder`):
/// `input_layernorm.weight`, `self_attn.{q,k,v,o}_proj.weight`,
/// `post_attention_layernorm.weight`, `mlp.{gate,up,down}_proj.weight`; by
/// family ([`LlamaConfig::qkv_bias`], [`LlamaConfig::o_bias`],
/// [`LlamaConfig::qk_norm`]) `self_attn.{q,k,v}_proj.bias`,
/// `self_attn.o_proj.bias` and `self_attn.{q,k}_norm.weight` (RMSNorm over each
/// head's `head_dim` before the rotary embedding, Qwen3).
///
/// A layer with a sliding window ([`LlamaConfig::layer_window`]) attends
/// through cqsa's window mask (each query sees its `sliding_window` most
/// recent keys, itself included), in every path: resident, streamed, the kv
/// cache and the hand-written backward.
///
/// Extras: `[cos, sin]` for the call's positions. A layer built by a [`Llama`]
/// keeps a slot of the model's kv cache: a call whose `BlockCtx::kv_cache` is
/// set ([`Llama::forward_cached`] asks for it) appends this call's keys and
/// values to it and attends over every cached position. The older way to ask,
/// a third extra `[cos, sin, _]` of any value, still works.
#[derive(Clone)]
pub struct DecoderLayer {
    pub(crate) input_layernorm: RmsNorm,
    pub(crate) q_proj: Linear,
    pub(crate) k_proj: Linear,
    pub(crate) v_proj: Linear,
    pub(crate) o_proj: Linear,
    pub(crate) post_attention_layernorm: RmsNorm,
    pub(crate) gate_proj: Linear,
    pub(crate) up_proj: Linear,
    pub(crate) down_proj: Linear,
    /// Qwen3's per-head RMSNorms of the queries and keys.
    pub(crate) qk_norm: Option<(RmsNorm, RmsNorm)>,
    /// Attention window (keys a query sees, itself included); `None` dense.
    pub(crate) window: Option<usize>,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    /// The model's kv cache and this layer's index in it.
    cache: Option<(Arc<KvCache>, usize)>,
    /// The model's LoRA adapters (handed over as extras) and its layer count.
    lora: Option<(Arc<LoraSlot>, usize)>,
}

impl DecoderLayer {
    /// Builds layer 0 of `cfg` over `vb` (see [`DecoderLayer::for_layer`]).
    pub fn new(cfg: &LlamaConfig, vb: VarBuilder) -> Result<Self> {
        Self::for_layer(cfg, 0, vb)
    }

    /// Builds layer `index` of `cfg` (its attention window comes from
    /// `layer_types`) over `vb` (rooted at `model.layers.{index}`).
    pub fn for_layer(cfg: &LlamaConfig, index: usize, vb: VarBuilder) -> Result<Self> {
        let (h, m, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
        let (nq, nkv) = (cfg.num_attention_heads, cfg.num_kv_heads());
        let attn = vb.pp("self_attn");
        let mlp = vb.pp("mlp");
        let qkv_b = cfg.qkv_bias();
        let qk_norm = if cfg.qk_norm() {
            Some((
                RmsNorm::new(d, cfg.rms_norm_eps, attn.pp("q_norm"))?,
                RmsNorm::new(d, cfg.rms_norm_eps, attn.pp("k_norm"))?,
            ))
        } else {
            None
        };
        Ok(Self {
            input_layernorm: RmsNorm::new(h, cfg.rms_norm_eps, vb.pp("input_layernorm"))?,
            q_proj: linear_b(h, nq * d, qkv_b, attn.pp("q_proj"))?,
            k_proj: linear_b(h, nkv * d, qkv_b, attn.pp("k_proj"))?,
            v_proj: linear_b(h, nkv * d, qkv_b, attn.pp("v_proj"))?,
            o_proj: linear_b(nq * d, h, cfg.o_bias(), attn.pp("o_proj"))?,
            post_attention_layernorm: RmsNorm::new(
                h,
                cfg.rms_norm_eps,
                vb.pp("post_attention_layernorm"),
            )?,
            gate_proj: linear_no_bias(h, m, mlp.pp("gate_proj"))?,
            up_proj: linear_no_bias(h, m, mlp.pp("up_proj"))?,
            down_proj: linear_no_bias(m, h, mlp.pp("down_proj"))?,
            qk_norm,
            window: cfg.layer_window(index),
            heads: nq,
            kv_heads: nkv,
            head_dim: d,
            cache: None,
            lora: None,
        })
    }

    /// This layer as layer `index` of a model whose kv cache is `cache`.
    fn with_cache(mut self, cache: &Arc<KvCache>, index: usize) -> Self {
        self.cache = Some((cache.clone(), index));
        self
    }

    /// This layer in a model of `layers` layers whose adapters are in `slot`.
    fn with_lora(mut self, slot: &Arc<LoraSlot>, layers: usize) -> Self {
        self.lora = Some((slot.clone(), layers));
        self
    }

    /// The model's adapter layout when adapters are on, and the extras split
    /// into the layer's own (`[cos, sin]` or `[cos, sin, flag]`) and this
    /// layer's `[A, B, ...]` (every layer's adapters come last, layer-major).
    pub(crate) fn split_lora<'a>(&self, extras: &'a [Tensor]) -> Result<LayerExtras<'a>> {
        let Some((slot, layers)) = &self.lora else {
            return Ok((extras, None));
        };
        let Some(layout) = slot.layout()? else {
            return Ok((extras, None));
        };
        let per = layout.per_layer();
        let index = self.cache.as_ref().map_or(0, |(_, i)| *i);
        let Some(base) = extras.len().checked_sub(layers * per) else {
            bail!(
                "a LoRA decoder layer needs {} adapter tensors after its extras, got {} extras",
                layers * per,
                extras.len()
            );
        };
        let ab = &extras[base + index * per..base + (index + 1) * per];
        Ok((&extras[..base], Some((layout, ab))))
    }

    /// The adapters' layout and rank when they are on.
    pub(crate) fn lora_layout(&self) -> Result<Option<(LoraLayout, usize)>> {
        let Some((slot, _)) = &self.lora else {
            return Ok(None);
        };
        let (Some(layout), Some(a)) = (slot.layout()?, slot.adapters()?) else {
            return Ok(None);
        };
        Ok(Some((layout, a.config().r)))
    }

    /// The layer's weights under their names relative to the layer.
    pub fn named_weights(&self) -> Vec<(&'static str, Tensor)> {
        let mut w = self.core_weights();
        let biases = [
            ("self_attn.q_proj.bias", &self.q_proj),
            ("self_attn.k_proj.bias", &self.k_proj),
            ("self_attn.v_proj.bias", &self.v_proj),
            ("self_attn.o_proj.bias", &self.o_proj),
        ];
        for (name, l) in biases {
            if let Some(b) = l.bias() {
                w.push((name, b.clone()));
            }
        }
        if let Some((qn, kn)) = &self.qk_norm {
            w.push(("self_attn.q_norm.weight", qn.weight().clone()));
            w.push(("self_attn.k_norm.weight", kn.weight().clone()));
        }
        w
    }

    /// cqsa's left window for this layer: HF's `sliding_window = w` shows a
    /// query its `w` most recent keys, itself included (`i - j < w`), which
    /// is `window_left = w - 1`.
    pub(crate) fn window_left(&self) -> Option<usize> {
        self.window.map(|w| w.saturating_sub(1))
    }

    /// The scores of this layer's causal attention (with its window) for the
    /// low-level cqsa ops, with the query and key positions aligned.
    pub(crate) fn scores(&self) -> cqsa::Scores {
        cqsa::Scores {
            lo: self.window_left().map(|w| -(w as i64)),
            hi: Some(0),
            ..cqsa::Scores::dense(1.0 / (self.head_dim as f32).sqrt())
        }
    }

    /// `(b, n, heads * head_dim)` projections as `(b, heads, n, head_dim)`, with
    /// the per-head norm (Qwen3's q/k norms) applied first when given.
    fn heads_normed(
        &self,
        t: Tensor,
        b: usize,
        n: usize,
        heads: usize,
        norm: Option<&RmsNorm>,
    ) -> Result<Tensor> {
        let t = t.reshape((b, n, heads, self.head_dim))?;
        let t = match norm {
            Some(nm) => nm.forward(&t)?,
            None => t,
        };
        t.transpose(1, 2)?.contiguous()
    }

    /// The weights every layer has.
    fn core_weights(&self) -> Vec<(&'static str, Tensor)> {
        vec![
            (
                "input_layernorm.weight",
                self.input_layernorm.weight().clone(),
            ),
            ("self_attn.q_proj.weight", self.q_proj.weight().clone()),
            ("self_attn.k_proj.weight", self.k_proj.weight().clone()),
            ("self_attn.v_proj.weight", self.v_proj.weight().clone()),
            ("self_attn.o_proj.weight", self.o_proj.weight().clone()),
            (
                "post_attention_layernorm.weight",
                self.post_attention_layernorm.weight().clone(),
            ),
            ("mlp.gate_proj.weight", self.gate_proj.weight().clone()),
            ("mlp.up_proj.weight", self.up_proj.weight().clone()),
            ("mlp.down_proj.weight", self.down_proj.weight().clone()),
        ]
    }

    pub(crate) fn heads(&self, t: Tensor, b: usize, n: usize, heads: usize) -> Result<Tensor> {
        t.reshape((b, n, heads, self.head_dim))?
            .transpose(1, 2)?
            .contiguous()
    }
}

impl Block for DecoderLayer {
    /// `x`: hidden states `(batch, seq, hidden)`; `extras`: `[cos, sin]`, each
    /// `(seq, head_dim / 2)` in the compute dtype. Returns the new hidden states.
    fn forward(&self, x: &Tensor, extras: &[Tensor]) -> Result<Vec<Tensor>> {
        self.forward_kv(x, extras, false)
    }

    /// As `forward`, with the kv cache in use when `ctx.kv_cache` asks.
    fn forward_ctx(
        &self,
        x: &Tensor,
        extras: &[Tensor],
        ctx: &streamer_core::BlockCtx,
    ) -> Result<Vec<Tensor>> {
        self.forward_kv(x, extras, ctx.kv_cache)
    }

    /// The hand-written backward (`decoder_backward.rs`), which covers every
    /// family (biases and Qwen3's q/k norms included) and LoRA adapters (their
    /// gradients come back as the gradients of the extras holding them).
    fn manual(&self) -> Option<&dyn streamer_core::ManualBackward> {
        Some(self)
    }
}

impl DecoderLayer {
    /// The layer's forward; `kv` (or a third extra, the older way to ask)
    /// attends over the kv cache and extends it.
    fn forward_kv(&self, x: &Tensor, extras: &[Tensor], kv: bool) -> Result<Vec<Tensor>> {
        let (extras, lora) = self.split_lora(extras)?;
        // Projection `t` of LORA_TARGETS, with its adapter when it has one.
        let proj = |t: usize, l: &Linear, h: &Tensor| -> Result<Tensor> {
            match &lora {
                Some((layout, ab)) => layout.apply(t, h, l.forward(h)?, ab),
                None => l.forward(h),
            }
        };
        let (cos, sin, cached) = match extras {
            [cos, sin] => (cos, sin, kv),
            [cos, sin, _] => (cos, sin, true),
            _ => bail!(
                "a Llama decoder layer needs extras [cos, sin] (or [cos, sin, cache flag]), got {} tensors",
                extras.len()
            ),
        };
        let (b, n, _) = x.dims3()?;
        let h = self.input_layernorm.forward(x)?;
        let (qn, kn) = match &self.qk_norm {
            Some((qn, kn)) => (Some(qn), Some(kn)),
            None => (None, None),
        };
        let q = self.heads_normed(proj(0, &self.q_proj, &h)?, b, n, self.heads, qn)?;
        let k = self.heads_normed(proj(1, &self.k_proj, &h)?, b, n, self.kv_heads, kn)?;
        let v = self.heads(proj(2, &self.v_proj, &h)?, b, n, self.kv_heads)?;
        let q = apply_rope(&q, cos, sin)?;
        let k = apply_rope(&k, cos, sin)?;
        // Bottom-right aligned: with cached keys, new query i sits at position
        // past + i, and its window reaches back from there.
        let opts = cqsa::AttentionOpts {
            causal: true,
            window_left: self.window_left(),
            ..Default::default()
        };
        // Cached: attend over the earlier positions too (causal masking is aligned
        // bottom-right, so new query i sees every cached key and new keys 0..=i).
        let o = match (cached, &self.cache) {
            (false, _) => cqsa::attention(&q, &k, &v, &opts)?,
            (true, Some((cache, i))) => match cache.step()? {
                Some(_) => attend_packed(cache, *i, (&q, &k, &v), &opts)?,
                None => {
                    let (k, v) = cache.extend(*i, k, v)?;
                    cqsa::attention(&q, &k, &v, &opts)?
                }
            },
            (true, None) => bail!("this decoder layer was built without a kv cache"),
        };
        let o = o
            .transpose(1, 2)?
            .reshape((b, n, self.heads * self.head_dim))?;
        let attn = proj(3, &self.o_proj, &o)?;
        // The residual add with the norm after it, and SwiGLU: one kernel each
        // on CUDA when nothing is tracked (plain differentiable ops otherwise).
        let n2 = &self.post_attention_layernorm;
        let (x, h) = crate::ops::fused::add_rms_norm(x, &attn, n2.weight(), n2.eps)?;
        let g = proj(4, &self.gate_proj, &h)?;
        let u = proj(5, &self.up_proj, &h)?;
        let x = (&x + proj(6, &self.down_proj, &crate::ops::fused::swiglu(&g, &u)?)?)?;
        Ok(vec![x])
    }
}

/// Attention of a packed batched step ([`crate::batch_generate`]): `q`, `k`,
/// `v` are `(1, heads, rows, head_dim)` holding each sequence's new rows one
/// after another; each sequence's rows attend to its own slot of the cache and
/// nothing else, exactly as a call of that sequence alone would: one call over
/// each part of the packed cache (the device slots', the host slots'), whose
/// documents are the slots (`crate::batch_kv`). Returns `(1, heads, rows,
/// head_dim)`.
fn attend_packed(
    cache: &KvCache,
    layer: usize,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    opts: &cqsa::AttentionOpts,
) -> Result<Tensor> {
    if q.dim(0)? != 1 {
        bail!(
            "a packed batched step needs (1, heads, rows, head_dim) queries, got {:?}",
            q.dims()
        );
    }
    let mut outs = Vec::with_capacity(2);
    for p in cache.extend_packed(layer, k, v)? {
        let opts = cqsa::AttentionOpts {
            cu_seqlens_q: Some(p.cu_seqlens_q),
            cu_seqlens_k: Some(p.cu_seqlens_k),
            // The cache is on the device already; planning would only cost time.
            mode: cqsa::Mode::Resident,
            ..opts.clone()
        };
        let q = q.narrow(2, p.rows.start, p.rows.len())?.contiguous()?;
        outs.push(cqsa::attention(&q, &p.k, &p.v, &opts)?);
    }
    match outs.len() {
        1 => Ok(outs.pop().expect("one")),
        _ => Tensor::cat(&outs, 2),
    }
}

/// A layer's own extras, and its LoRA layout with its `[A, B, ...]` when on.
pub(crate) type LayerExtras<'a> = (&'a [Tensor], Option<(LoraLayout, &'a [Tensor])>);

/// The layers of a [`Llama`], in one of three placements.
enum Layers {
    /// Ordinary Candle: every layer's weights on the compute device.
    Resident(Vec<DecoderLayer>),
    /// Weights on the host, streamed through a window of device slots.
    Streamed(Box<StreamedSequential>),
    /// Streamed and trainable (recompute-based backward, host gradients).
    Trainable(Box<TrainableSequential>),
}

/// The weights outside the layers.
enum Outer {
    /// On the compute device (maybe variables of a `VarMap`).
    Resident {
        embed: Tensor,
        norm: Tensor,
        head: Tensor,
    },
    /// Masters (what an optimizer updates), copied to the device when they are
    /// on the host and converted to the compute dtype on every forward
    /// (differentiably). On the host, except under a trainer whose optimizer
    /// runs on the device ([`Llama::outer_masters_to_device`]).
    Host {
        embed: Var,
        norm: Var,
        head: Option<Var>,
    },
}

/// A Llama-family decoder: token embedding, decoder layers, final RMSNorm, head.
///
/// Built resident ([`Llama::resident`], the ordinary Candle way from a
/// `VarBuilder`), or streamed ([`Llama::streamed`], [`Llama::from_safetensors`]):
/// then the layers are `StreamedSequential` blocks whose weights live on the
/// host, and the embedding, norm and head are host masters copied to the device
/// at each forward. [`Llama::into_trainable`] makes a streamed model trainable.
pub struct Llama {
    cfg: LlamaConfig,
    device: Device,
    dtype: DType,
    rope: Rope,
    outer: Outer,
    layers: Layers,
    /// Keys and values of earlier positions, for [`Llama::forward_cached`].
    kv: Arc<KvCache>,
    /// The hand-written resident backward's switch and weight gradients
    /// ([`Llama::set_fused_backward`]).
    fused: Arc<WeightGrads>,
    /// LoRA adapters ([`Llama::set_lora`]), shared with the layers.
    lora: Arc<LoraSlot>,
    /// A resident model made trainable ([`Llama::into_trainable`]): its
    /// weights as variables, under their Hugging Face names.
    resident_vars: Vec<(String, Var)>,
    /// The weights held quantized ([`Llama::streamed_quantized`]), sorted.
    quantized: Vec<String>,
    /// Rows per chunk of the head and loss ([`Llama::set_loss_chunk`]; 0: auto).
    loss_chunk: Arc<std::sync::atomic::AtomicUsize>,
    /// The last training forward's device copies of host masters, as leaf
    /// variables, with their masters ([`Llama::outer_grads_to_masters`]).
    outer_leaves: Arc<std::sync::Mutex<Vec<(Var, Var)>>>,
    /// The host masters of the embedding, norm and head pinned, with
    /// page-locked buffers for their gradients ([`Llama::pin_outer_masters`]).
    outer_host: Arc<std::sync::Mutex<Option<crate::outer_host::OuterHost>>>,
    /// Decoder layers kept on the device ahead of the streamed ones
    /// ([`Llama::streamed_keeping`]; inference only), layer 0 first.
    front: Vec<DecoderLayer>,
    /// The page-locked buffer of a cached decode's host embedding lookups.
    host_rows: Arc<crate::host_rows::HostRows>,
}

/// How [`Llama::loss`] runs the head and the cross-entropy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LossChunk {
    /// In one piece while the logits and their gradient take at most an
    /// eighth of the device memory free at the call (on the CPU: while the
    /// logits are at most 512 MiB), else in chunks of about 512 MiB of logits.
    #[default]
    Auto,
    /// Always in chunks of this many rows (`batch x seq` rows in all).
    Rows(usize),
}

/// The streamed decoder layers; a layer with quantized weights in `quant`
/// dequantizes them from its slot when it is built.
fn layer_blocks(
    cfg: &LlamaConfig,
    (cache, lora): (&Arc<KvCache>, &Arc<LoraSlot>),
    quant: Option<&QuantizedWeights>,
    from: usize,
) -> Vec<BlockSpec> {
    let layers = cfg.num_hidden_layers;
    (from..layers)
        .map(|i| {
            let (c, cache, lora) = (cfg.clone(), cache.clone(), lora.clone());
            let packed = Arc::new(quant.map(|q| q.layer_packing(i)).unwrap_or_default());
            BlockSpec::new(format!("model.layers.{i}"), move |vb| {
                let vb = crate::dequant_backend::dequantizing(vb, &packed);
                model_layer(&c, i, vb, (&cache, &lora))
            })
        })
        .collect()
}

/// Decoder layer `i` read from `src` onto `device` in `dtype`, as
/// [`Llama::resident`] builds one.
fn device_layer(
    src: &WeightSource,
    cfg: &LlamaConfig,
    i: usize,
    (cache, lora): (&Arc<KvCache>, &Arc<LoraSlot>),
    (device, dtype): (&Device, DType),
) -> Result<DecoderLayer> {
    let weights = cfg
        .layer_weights(i)
        .into_iter()
        .map(|(name, ..)| {
            let t = src.load(&name, dtype)?.to_device(device)?;
            Ok((name, t))
        })
        .collect::<Result<HashMap<_, _>>>()?;
    let vb = VarBuilder::from_tensors(weights, dtype, device).pp(format!("model.layers.{i}"));
    model_layer(cfg, i, vb, (cache, lora))
}

/// Decoder layer `i` over `vb` (names relative to the layer), on the
/// model's kv cache and LoRA slot, however its weights are placed.
fn model_layer(
    cfg: &LlamaConfig,
    i: usize,
    vb: VarBuilder,
    (cache, lora): (&Arc<KvCache>, &Arc<LoraSlot>),
) -> Result<DecoderLayer> {
    Ok(DecoderLayer::for_layer(cfg, i, vb)?
        .with_cache(cache, i)
        .with_lora(lora, cfg.num_hidden_layers))
}

impl Llama {
    /// The ordinary Candle model over `vb` (Hugging Face names from the root; the
    /// compute dtype and device are `vb`'s). With a `VarBuilder` over a `VarMap`
    /// it trains with any candle-nn optimizer.
    pub fn resident(vb: VarBuilder, cfg: &LlamaConfig) -> Result<Self> {
        cfg.validate()?;
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let embed = vb.get((v, h), "model.embed_tokens.weight")?;
        let norm = vb.get(h, "model.norm.weight")?;
        let head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            vb.get((v, h), "lm_head.weight")?
        };
        let kv = Arc::new(KvCache::new(cfg.num_hidden_layers));
        let lora = Arc::new(LoraSlot::default());
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| model_layer(cfg, i, vb.pp(format!("model.layers.{i}")), (&kv, &lora)))
            .collect::<Result<Vec<_>>>()?;
        let outer = Outer::Resident { embed, norm, head };
        let layers = Layers::Resident(layers);
        Self::assemble(cfg, (vb.device(), vb.dtype()), outer, layers, kv, lora)
    }

    /// The model of these parts, with nothing fused, cached or adapted yet.
    fn assemble(
        cfg: &LlamaConfig,
        (device, dtype): (&Device, DType),
        outer: Outer,
        layers: Layers,
        kv: Arc<KvCache>,
        lora: Arc<LoraSlot>,
    ) -> Result<Self> {
        Ok(Self {
            cfg: cfg.clone(),
            device: device.clone(),
            dtype,
            rope: Rope::new(cfg, dtype, device)?,
            outer,
            layers,
            kv,
            fused: Default::default(),
            lora,
            resident_vars: Vec::new(),
            quantized: Vec::new(),
            loss_chunk: Default::default(),
            outer_leaves: Default::default(),
            outer_host: Default::default(),
            front: Vec::new(),
            host_rows: Default::default(),
        })
    }

    /// Resident, from safetensors files (or a `model.safetensors.index.json`),
    /// memory-mapped, converted to `dtype` on `device`. The files are checked
    /// against `cfg` first (missing, unexpected and mis-shaped tensors).
    pub fn load_resident<P: AsRef<Path>>(
        paths: &[P],
        cfg: &LlamaConfig,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        cfg.validate()?;
        let files = streamer_core::expand_paths(paths)?;
        let src = WeightSource::safetensors(&files)?;
        check_weights(&src, cfg).map_err(|e| checkpoint_mismatch(paths, e))?;
        // SAFETY: the files are mapped read-only and must not be truncated while
        // the model is built (candle's own contract for mmaped VarBuilders).
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, device)? };
        Self::resident(vb, cfg)
    }

    /// Streamed: the layers' weights go from `src` into host masters (in
    /// `stream.master_dtype()`), and visit `stream.device` through a window of
    /// `stream.prefetch_ahead + 1` layers; the embedding, norm and head are host
    /// masters too. `src` is checked against `cfg` first.
    pub fn streamed(src: &WeightSource, cfg: &LlamaConfig, stream: StreamConfig) -> Result<Self> {
        Self::streamed_over(src, (None, 0), cfg, stream)
    }

    /// [`Llama::streamed`] with the first `resident_layers` decoder layers
    /// kept on `stream.device` in `stream.dtype` (copied once, never
    /// streamed) and only the others streamed: on a device that holds part
    /// of a model, a step then copies only the layers that do not fit, as
    /// accelerate's `device_map="auto"` does. Inference only
    /// ([`Llama::into_trainable`] refuses it: train [`Llama::streamed`]).
    /// Keeping every layer is an error naming [`Llama::resident`]; 0 is
    /// [`Llama::streamed`].
    pub fn streamed_keeping(
        src: &WeightSource,
        cfg: &LlamaConfig,
        stream: StreamConfig,
        resident_layers: usize,
    ) -> Result<Self> {
        if resident_layers >= cfg.num_hidden_layers {
            bail!(
                "streamed_keeping: keeping {resident_layers} of {} decoder layers leaves none to \
                 stream; a model whose layers all stay on the device is Llama::resident",
                cfg.num_hidden_layers
            );
        }
        Self::streamed_over(src, (None, resident_layers), cfg, stream)
    }

    /// [`Llama::streamed`] over a quantized base: the weights in `quant`
    /// (Hugging Face names; linear weights of the decoder layers) are host
    /// masters of packed bytes, copied as such and dequantized into bf16 on
    /// the device when their layer is built; every other weight comes from
    /// `src` as in [`Llama::streamed`] (a dense copy of a quantized weight in
    /// `src` is ignored). Checked before anything loads: `quant` against
    /// `cfg` ([`QuantizedWeights::check`]), `src` for the rest. Such a model
    /// trains LoRA adapters only ([`Llama::set_lora`]): a training forward
    /// without adapters is an error naming a quantized weight.
    pub fn streamed_quantized(
        src: &WeightSource,
        quant: &QuantizedWeights,
        cfg: &LlamaConfig,
        stream: StreamConfig,
    ) -> Result<Self> {
        let mut model = Self::streamed_over(&quant.over(src)?, (Some(quant), 0), cfg, stream)?;
        model.quantized = quant.names();
        Ok(model)
    }

    /// [`Llama::streamed_quantized`] with every linear weight of the decoder
    /// layers read from `src` and quantized with `scheme` as it is loaded,
    /// one tensor at a time ([`QuantizedWeights::quantize_source`]), each
    /// told to the stream's `on_setup` hook.
    pub fn streamed_quantize_on_load(
        src: &WeightSource,
        scheme: streamer_quant::QuantScheme,
        cfg: &LlamaConfig,
        stream: StreamConfig,
    ) -> Result<Self> {
        check_weights(src, cfg)?;
        let watch = stream.on_setup.as_ref();
        let quant = QuantizedWeights::quantize_source_watched(src, cfg, scheme, watch)?;
        Self::streamed_quantized(src, &quant, cfg, stream)
    }

    /// [`Llama::streamed`], the names in `quant` (when given) packed in `src`,
    /// the first `keep` layers on the device ([`Llama::streamed_keeping`]).
    fn streamed_over(
        src: &WeightSource,
        (quant, keep): (Option<&QuantizedWeights>, usize),
        cfg: &LlamaConfig,
        stream: StreamConfig,
    ) -> Result<Self> {
        cfg.validate()?;
        stream.validate()?;
        // The quantized weights' names and the source's names for them
        // (layers' images): neither is a dense weight `src` must hold.
        let packed: Vec<String> = (quant.into_iter())
            .flat_map(|q| q.names().into_iter().chain(q.source_names()))
            .collect();
        if let Some(q) = quant {
            q.check(cfg)?;
        }
        crate::checkpoint::check_weights_except(src, cfg, &packed)?;
        let md = stream.master_dtype();
        let host = |name: &str| src.load_master(name, md);
        let outer = Outer::Host {
            embed: host("model.embed_tokens.weight")?,
            norm: host("model.norm.weight")?,
            head: if cfg.tie_word_embeddings {
                None
            } else {
                Some(host("lm_head.weight")?)
            },
        };
        let kv = Arc::new(KvCache::new(cfg.num_hidden_layers));
        let lora = Arc::new(LoraSlot::default());
        let place = (&stream.device, stream.dtype);
        let front = (0..keep)
            .map(|i| device_layer(src, cfg, i, (&kv, &lora), place))
            .collect::<Result<Vec<_>>>()?;
        let blocks = layer_blocks(cfg, (&kv, &lora), quant, keep);
        let seq = StreamedSequential::from_source(src, blocks, stream.clone())?;
        let layers = Layers::Streamed(Box::new(seq));
        let mut model = Self::assemble(cfg, place, outer, layers, kv, lora)?;
        model.front = front;
        Ok(model)
    }

    /// [`Llama::streamed`] from safetensors files (or a
    /// `model.safetensors.index.json`), memory-mapped straight into the masters.
    pub fn from_safetensors<P: AsRef<Path>>(
        paths: &[P],
        cfg: &LlamaConfig,
        stream: StreamConfig,
    ) -> Result<Self> {
        let src = WeightSource::safetensors(paths)?;
        cfg.validate()?;
        check_weights(&src, cfg).map_err(|e| checkpoint_mismatch(paths, e))?;
        Self::streamed(&src, cfg, stream)
    }

    /// [`Llama::streamed`] from named in-memory tensors.
    pub fn from_tensors(
        tensors: HashMap<String, Tensor>,
        cfg: &LlamaConfig,
        stream: StreamConfig,
    ) -> Result<Self> {
        Self::streamed(&WeightSource::Tensors(tensors), cfg, stream)
    }

    /// Makes a model trainable (in training mode). A streamed model's layers
    /// become a `TrainableSequential`; a resident model's weights become
    /// variables (a weight that already is one, as from a `VarMap`, is kept,
    /// others are copied once) in the model's own dtype and device, trained
    /// through the decoder layers' hand-written backward
    /// ([`Llama::set_fused_backward`]); [`Llama::parameters`] then lists them.
    /// A trainable model is returned as it is. A resident model with LoRA
    /// adapters is an error (the hand-written backward has none: stream it).
    pub fn into_trainable(self) -> Result<Self> {
        if matches!(self.layers, Layers::Resident(_)) {
            return if self.resident_vars.is_empty() {
                self.resident_into_trainable()
            } else {
                Ok(self)
            };
        }
        if !self.front.is_empty() {
            bail!(
                "into_trainable: the first {} decoder layers of this model stay on the device \
                 (Llama::streamed_keeping), which is for inference; build it with Llama::streamed \
                 to train",
                self.front.len()
            );
        }
        let layers = match self.layers {
            Layers::Streamed(s) => Layers::Trainable(Box::new(s.train())),
            other => other,
        };
        let model = Self { layers, ..self };
        model.lora.set_training(true)?;
        model.freeze_for_lora()?;
        Ok(model)
    }

    /// [`Llama::into_trainable`] for a resident model.
    fn resident_into_trainable(self) -> Result<Self> {
        if self.lora.adapters()?.is_some() {
            bail!(
                "into_trainable: a resident model with LoRA adapters does not train through the \
                 hand-written backward; load it streamed (Placement::Streamed) to train adapters"
            );
        }
        let vars = self
            .device_weights_named()?
            .into_iter()
            .map(|(n, t)| Ok((n, Var::from_tensor(&t)?)))
            .collect::<Result<Vec<_>>>()?;
        let tensors = vars
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        let vb = VarBuilder::from_tensors(tensors, self.dtype, &self.device);
        let mut model = Self::resident(vb, &self.cfg)?;
        model.loss_chunk = self.loss_chunk.clone();
        model.set_fused_backward(true)?;
        model.resident_vars = vars;
        Ok(model)
    }

    /// A resident model's weights on its device under their Hugging Face
    /// names (a tied head is not repeated), as [`Llama::weights`] names them.
    fn device_weights_named(&self) -> Result<Vec<(String, Tensor)>> {
        let (Outer::Resident { embed, norm, head }, Layers::Resident(ls)) =
            (&self.outer, &self.layers)
        else {
            bail!("device_weights_named: for resident models");
        };
        let mut out = vec![
            ("model.embed_tokens.weight".to_string(), embed.clone()),
            ("model.norm.weight".to_string(), norm.clone()),
        ];
        if !self.cfg.tie_word_embeddings {
            out.push(("lm_head.weight".to_string(), head.clone()));
        }
        for (i, l) in ls.iter().enumerate() {
            for (n, t) in l.named_weights() {
                out.push((format!("model.layers.{i}.{n}"), t));
            }
        }
        Ok(out)
    }

    /// Puts LoRA adapters on the model (or, with `None`, takes them off):
    /// every layer adds `scale * dropout(x) A^T B^T` to its adapted
    /// projections, the adapters handed over as extra inputs. A trainable
    /// streamed model's own weights (its layers', and the embedding, final norm
    /// and head) are frozen while adapters are on (no gradient for them) and
    /// unfrozen when they come off;
    /// [`Llama::backward`] then gives the adapters' gradients (keyed by
    /// [`LoraAdapters::vars`]). Adapters made for another shape of model are
    /// an error, and so is the resident hand-written backward
    /// ([`Llama::set_fused_backward`]), which has no adapters.
    pub fn set_lora(&self, adapters: Option<LoraAdapters>) -> Result<()> {
        if let Some(a) = &adapters {
            a.check_base(&self.cfg)?;
            if self.fused.enabled() {
                bail!("set_lora: the resident hand-written backward is on (set_fused_backward(false) first)");
            }
        }
        let training = self.is_training() || self.lora.layout()?.is_some_and(|l| l.training);
        self.lora.set(adapters.map(Arc::new), training)?;
        self.freeze_for_lora()
    }

    /// The adapters on the model, if any.
    pub fn lora(&self) -> Result<Option<Arc<LoraAdapters>>> {
        self.lora.adapters()
    }

    /// A trainable model's layer weights frozen while adapters are on.
    fn freeze_for_lora(&self) -> Result<()> {
        let Layers::Trainable(t) = &self.layers else {
            return Ok(());
        };
        // Quantized (packed) weights stay frozen either way.
        let names: Vec<String> = (t.parameters().into_iter())
            .filter(|(_, v)| v.dtype().is_float())
            .map(|(n, _)| n)
            .collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        t.set_trainable(&names, self.lora.adapters()?.is_none())
    }

    /// Every weight with the adapters folded in (`W += scale * B A`), as
    /// [`Llama::weights`] gives them: what a merged checkpoint holds.
    pub fn merged_weights(&self) -> Result<HashMap<String, Tensor>> {
        self.require_dense("merging LoRA adapters into the base weights")?;
        let mut w = self.weights()?;
        if let Some(a) = self.lora.adapters()? {
            a.merge_into(&mut w)?;
        }
        Ok(w)
    }

    /// The weights held quantized (packed bytes; [`Llama::streamed_quantized`]),
    /// sorted; empty for a dense model.
    pub fn quantized_weights(&self) -> &[String] {
        &self.quantized
    }

    /// Fails, naming the first quantized weight, when the model has any:
    /// `what` needs every base weight dense.
    pub fn require_dense(&self, what: &str) -> Result<()> {
        match self.quantized.first() {
            None => Ok(()),
            Some(name) => Err(streamer_device::Error::Dtype {
                what: format!("{what}: weight {name:?}"),
                got: DType::U8,
                expected: format!(
                    "a dense float weight; it is quantized (as are {} others), a frozen base \
                     that only LoRA adapters train on",
                    self.quantized.len() - 1
                ),
            }
            .into()),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The compute device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Whether the layers are streamed (trainable or not).
    pub fn is_streamed(&self) -> bool {
        !matches!(self.layers, Layers::Resident(_))
    }

    /// Whether backward goes through [`Llama::backward`] (streamed and trainable).
    pub fn is_trainable(&self) -> bool {
        matches!(self.layers, Layers::Trainable(_))
    }

    /// The streamed layers (trainable or not), for their timeline and
    /// statistics; `None` when resident.
    pub fn streamed_layers(&self) -> Option<&StreamedSequential> {
        match &self.layers {
            Layers::Resident(_) => None,
            Layers::Streamed(s) => Some(s),
            Layers::Trainable(t) => Some(t.inner()),
        }
    }

    /// Records host work `name` from `*start` to now on the streamed layers'
    /// timeline (when one is recorded) and moves `*start` to now.
    pub(crate) fn host_span(&self, name: &str, start: &mut std::time::Instant) -> Result<()> {
        let now = std::time::Instant::now();
        if let Some(s) = self.streamed_layers() {
            s.record_host_span(name, *start, now)?;
        }
        *start = now;
        Ok(())
    }

    /// The streamed layers' statistics (copies, stalls, residency), if streamed.
    pub fn stats(&self) -> Result<Option<StreamStats>> {
        self.streamed_layers().map(|s| s.stats()).transpose()
    }

    /// Bytes of host-memory kv cache copied to the device by the batched
    /// decodes of this model so far (`BatchLimits::host_kv`).
    pub fn host_kv_bytes_copied(&self) -> usize {
        self.kv.host_bytes_copied()
    }

    /// Training mode: a trainable model's forwards save what backward needs,
    /// and LoRA dropout ([`Llama::set_lora`]) is active (on any model).
    pub fn set_training(&self, on: bool) {
        if let Layers::Trainable(t) = &self.layers {
            t.set_training(on)
        }
        // Only a poisoned lock fails here; the adapters then error at forward.
        let _ = self.lora.set_training(on);
    }

    /// Whether a trainable model is in training mode (false for the others).
    pub fn is_training(&self) -> bool {
        matches!(&self.layers, Layers::Trainable(t) if t.is_training())
    }

    fn device_weights(&self) -> Result<(Tensor, Tensor, Tensor)> {
        match &self.outer {
            Outer::Resident { embed, norm, head } => {
                Ok((embed.clone(), norm.clone(), head.clone()))
            }
            Outer::Host { embed, norm, head } => {
                let mut leaves = Vec::new();
                let mut to = |v: &Var| self.device_copy(v, &mut leaves);
                let e = to(embed)?;
                let hd = match head {
                    Some(h) => to(h)?,
                    None => e.clone(),
                };
                let n = to(norm)?;
                *self
                    .outer_leaves
                    .lock()
                    .map_err(|_| candle_core::Error::Msg("outer leaves: poisoned".into()))? =
                    leaves;
                Ok((e, n, hd))
            }
        }
    }

    /// A streamed model's embedding master, when a cached decode looks its
    /// rows up on the host: an untied embedding still in host memory. It
    /// then takes no device memory (2.1 GB at Llama 3.1 70B's shapes), and a
    /// decode step copies only its rows.
    fn host_embedding(&self, kv: bool) -> Option<&Var> {
        match &self.outer {
            Outer::Host {
                embed,
                head: Some(_),
                ..
            } if kv && !embed.device().same_device(&self.device) => Some(embed),
            _ => None,
        }
    }

    /// The outer weights a cached decode keeps on the device for its batch:
    /// [`Self::device_weights`], but for an embedding looked up on the host
    /// ([`Self::host_embedding`]), whose place holds an empty tensor.
    fn decode_weights(&self) -> Result<(Tensor, Tensor, Tensor)> {
        match (&self.outer, self.host_embedding(true)) {
            (
                Outer::Host {
                    norm,
                    head: Some(head),
                    ..
                },
                Some(_),
            ) => {
                let mut leaves = Vec::new();
                let empty = Tensor::zeros(0, self.dtype, &self.device)?;
                let norm = self.device_copy(norm, &mut leaves)?;
                Ok((empty, norm, self.device_copy(head, &mut leaves)?))
            }
            _ => self.device_weights(),
        }
    }

    /// Master `v` on the compute device in the compute dtype. A host master
    /// of a training model becomes a leaf variable (listed in `leaves`) whose
    /// gradient [`Llama::outer_grads_to_masters`] hands to the master: through
    /// `to_device` and `to_dtype` nodes the graph would keep the f32 device
    /// copy alive until backward (4.2 GB for Llama 3 8B's embedding and head).
    fn device_copy(&self, v: &Var, leaves: &mut Vec<(Var, Var)>) -> Result<Tensor> {
        let on_host = !v.device().same_device(&self.device);
        let src = if on_host {
            v.as_tensor().detach()
        } else {
            v.as_tensor().clone()
        };
        let pinned = match on_host {
            true => self
                .lock_outer_host()?
                .as_ref()
                .map(|h| h.copy_up(v, &self.device)),
            false => None,
        };
        let t = match pinned.transpose()?.flatten() {
            Some(t) => Ok(t),
            None => src.to_device(&self.device),
        }
        .and_then(|t| t.to_dtype(self.dtype))
        .map_err(|e| {
            e.context(format!(
                "copying a host weight of shape {:?} to the device",
                v.dims()
            ))
        })?;
        // LoRA freezes the outer weights: no gradient, no leaf.
        let trains = self.is_training() && self.lora.adapters()?.is_none();
        if !(on_host && trains) {
            return Ok(if on_host { t.detach() } else { t });
        }
        let leaf = Var::from_tensor(&t)?;
        leaves.push((leaf.clone(), v.clone()));
        Ok(leaf.as_tensor().clone())
    }

    /// Moves the gradients of the last training forward's device copies of
    /// host masters (embedding, final norm, head) in `grads` to the masters,
    /// in the masters' dtype and device. [`Llama::backward`] does this; call
    /// it on a `GradStore` taken another way (the layers' overlapped step).
    pub fn outer_grads_to_masters(&self, grads: &mut GradStore) -> Result<()> {
        for (master, g) in self.take_leaf_grads(grads)? {
            let g = g.to_dtype(master.dtype())?.to_device(master.device())?;
            streamer_autograd::accumulate_grad(grads, master.as_tensor(), g)?;
        }
        Ok(())
    }

    /// The last training forward's leaf copies of host masters, taken: each
    /// master with its leaf's gradient in `grads` (removed from it).
    fn take_leaf_grads(&self, grads: &mut GradStore) -> Result<Vec<(Var, Tensor)>> {
        let leaves = std::mem::take(
            &mut *self
                .outer_leaves
                .lock()
                .map_err(|_| candle_core::Error::Msg("outer leaves: poisoned".into()))?,
        );
        Ok(leaves
            .into_iter()
            .filter_map(|(leaf, master)| grads.remove(leaf.as_tensor()).map(|g| (master, g)))
            .collect())
    }

    /// Locks the pages of a streamed model's embedding, norm and head host
    /// masters in place and makes page-locked buffers for their gradients,
    /// for a trainer that steps them on the host: the forward's copies of
    /// them become DMA, and [`Llama::outer_grads_down`] brings their
    /// gradients down by DMA. Nothing to do for masters already on the
    /// device.
    pub(crate) fn pin_outer_masters(&self) -> Result<()> {
        let Outer::Host { embed, norm, head } = &self.outer else {
            return Ok(());
        };
        if !embed.device().is_cpu() || self.device.is_cpu() {
            return Ok(());
        }
        let masters: Vec<&Var> = [Some(embed), Some(norm), head.as_ref()]
            .into_iter()
            .flatten()
            .collect();
        let pinned = crate::outer_host::OuterHost::new(&self.device, &masters)?;
        *self.lock_outer_host()? = Some(pinned);
        Ok(())
    }

    fn lock_outer_host(
        &self,
    ) -> Result<std::sync::MutexGuard<'_, Option<crate::outer_host::OuterHost>>> {
        self.outer_host
            .lock()
            .map_err(|_| candle_core::Error::Msg("outer host buffers: poisoned".into()))
    }

    /// [`Llama::outer_grads_to_masters`] through the page-locked buffers of
    /// [`Llama::pin_outer_masters`] when it ran (else the same as it).
    ///
    /// # Safety
    /// The gradients it leaves in `grads` are those buffers, which the next
    /// call rewrites by DMA: none of them may be read while a later call runs
    /// (step with them, then drop them).
    pub(crate) unsafe fn outer_grads_down(&self, grads: &mut GradStore) -> Result<()> {
        let mut host = self.lock_outer_host()?;
        let Some(host) = host.as_mut() else {
            return self.outer_grads_to_masters(grads);
        };
        let on_device = self.take_leaf_grads(grads)?;
        // SAFETY: forwarded to the caller (the buffers are not read during a
        // later call).
        for (master, g) in unsafe { host.bring_down(on_device)? } {
            streamer_autograd::accumulate_grad(grads, master.as_tensor(), g)?;
        }
        Ok(())
    }

    /// Logits `(batch, seq, vocab)` in the compute dtype for `tokens`, a
    /// `(batch, seq)` tensor of u32 token ids (any device). Position `t` sees
    /// tokens `0..=t` (causal).
    pub fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        let n = self.check_tokens(tokens)?;
        self.run(tokens, self.rope.extras(n)?, false)
    }

    /// Logits for `tokens` `(batch, seq)` placed after the positions already in
    /// the kv cache, whose keys and values they attend to; their own keys and
    /// values join the cache. The first call (empty cache) is an ordinary forward
    /// that also fills it; each later one can feed only the newest tokens, which
    /// is what makes generation linear instead of quadratic. Inference only (an
    /// error in training mode), one caller at a time (the cache is the model's).
    /// The batch must stay the same across calls, and
    /// cached plus new positions must fit in `max_position_embeddings`. A failed
    /// call clears the cache. See [`Llama::clear_cache`].
    pub fn forward_cached(&self, tokens: &Tensor) -> Result<Tensor> {
        if self.is_training() {
            bail!("forward_cached: the model is in training mode (call set_training(false))");
        }
        let r = (|| {
            let n = self.check_tokens(tokens)?;
            let past = self.kv.positions()?;
            self.run(tokens, self.rope.extras_at(past, n)?, true)
        })();
        if r.is_err() {
            self.kv.clear()?;
        }
        r
    }

    /// One packed step of batched decoding ([`crate::batch_generate`]):
    /// `tokens` are the new tokens of several sequences one after another,
    /// `positions` each token's position in its own sequence, and `step`
    /// `(slot, rows)` says which rows belong to which sequence slot of the
    /// kv cache (started by `begin_batch`). Every layer runs once over all
    /// rows (one visit of its weights for the whole batch); attention stays
    /// within each sequence. Returns the logits `(step.len(), vocab)` of each
    /// sequence's last row.
    pub(crate) fn forward_packed(
        &self,
        tokens: &[u32],
        positions: &[u32],
        step: Vec<(usize, usize)>,
    ) -> Result<Tensor> {
        if self.is_training() {
            bail!("batched decoding: the model is in training mode (call set_training(false))");
        }
        let mut last = Vec::with_capacity(step.len());
        let mut end = 0u32;
        for &(_, n) in &step {
            end += n as u32;
            last.push(end - 1);
        }
        if tokens.len() != end as usize || positions.len() != tokens.len() {
            bail!(
                "batched decoding: {} tokens and {} positions for a step of {end} rows",
                tokens.len(),
                positions.len()
            );
        }
        let mut t = std::time::Instant::now();
        let extras = self.rope.extras_for(positions)?;
        // On the host: `hidden` copies them where the embedding is.
        let tokens = Tensor::new(tokens, &Device::Cpu)?.unsqueeze(0)?;
        self.kv.begin_step(step)?;
        self.host_span("decode inputs", &mut t)?;
        let r = self.hidden(&tokens, extras, true);
        self.kv.end_step(r.is_ok())?;
        let (h, head) = r?;
        self.host_span("decode layers issued", &mut t)?;
        let last = Tensor::new(last.as_slice(), &self.device)?;
        let h = h.squeeze(0)?.index_select(&last, 0)?;
        let logits = Linear::new(head, None)
            .forward(&h)
            .map_err(|e| e.context("in the head (final norm and vocabulary projection)"));
        self.host_span("decode head issued", &mut t)?;
        logits
    }

    /// Starts batched decoding with `slots` sequence slots in the kv cache,
    /// the last `host_slots` of them in host memory.
    pub(crate) fn begin_batch(&self, slots: usize, host_slots: usize) -> Result<()> {
        self.kv.begin_batch(slots, host_slots)
    }

    /// Ends batched decoding and empties the kv cache.
    pub(crate) fn end_batch(&self) -> Result<()> {
        self.kv.end_batch()
    }

    /// Makes room in every slot of a batch for `need` positions; `hint`: how
    /// long the sequences in flight may grow.
    pub(crate) fn reserve_batch(&self, need: usize, hint: usize) -> Result<()> {
        self.kv.reserve(need, hint)
    }

    /// Empties one sequence slot of a batch for the next sequence.
    pub(crate) fn clear_batch_slot(&self, slot: usize) -> Result<()> {
        self.kv.clear_slot(slot)
    }

    /// Positions held by one sequence slot of a batch.
    pub(crate) fn batch_slot_positions(&self, slot: usize) -> Result<usize> {
        self.kv.slot_positions(slot)
    }

    /// Positions held in the kv cache ([`Llama::forward_cached`]).
    pub fn cached_positions(&self) -> Result<usize> {
        self.kv.positions()
    }

    /// Empties the kv cache, e.g. before an unrelated prompt.
    pub fn clear_cache(&self) -> Result<()> {
        self.kv.clear()
    }

    /// The sequence length of `tokens`, checked to be `(batch, seq)` u32.
    fn check_tokens(&self, tokens: &Tensor) -> Result<usize> {
        let (b, n) = tokens.dims2()?;
        if tokens.dtype() != DType::U32 {
            bail!(
                "tokens must be u32, got {:?} (shape ({b}, {n}))",
                tokens.dtype()
            );
        }
        Ok(n)
    }

    /// Embedding, layers (with `extras`, and their kv caches when `kv`),
    /// final norm and head.
    fn run(&self, tokens: &Tensor, extras: Vec<Tensor>, kv: bool) -> Result<Tensor> {
        let (h, head) = self.hidden(tokens, extras, kv)?;
        Linear::new(head, None)
            .forward(&h)
            .map_err(|e| e.context("in the head (final norm and vocabulary projection)"))
    }

    /// The final hidden states `(batch, seq, hidden)` (after the final norm)
    /// and the head's weight on the device, for [`Llama::run`] and the loss.
    fn hidden(
        &self,
        tokens: &Tensor,
        mut extras: Vec<Tensor>,
        kv: bool,
    ) -> Result<(Tensor, Tensor)> {
        if self.is_training() && self.lora.adapters()?.is_none() {
            self.require_dense("full fine-tuning (training without LoRA adapters)")?;
        }
        // The hand-written resident path is a training forward: no cache, no adapters.
        let fused = self.fused.enabled() && !kv && self.lora.adapters()?.is_none();
        if let Some(a) = self.lora.adapters()? {
            // A cached decode records no graph through the adapters either.
            let ab = a.extras(&self.device)?;
            extras.extend(ab.into_iter().map(|t| if kv { t.detach() } else { t }));
        }
        let mut t = std::time::Instant::now();
        let host_embed = self.host_embedding(kv);
        let (embed, norm, head) = match &self.outer {
            Outer::Host { .. } if kv => self.kv.outer_or(|| self.decode_weights())?,
            _ => self.device_weights()?,
        };
        if kv {
            self.host_span("decode outer weights", &mut t)?;
        }
        // A trainable model's own weights are frozen while adapters are on: the
        // embedding, final norm and head too (PEFT's default), so no gradient is
        // computed for them or copied back to their host masters.
        let frozen = matches!(self.layers, Layers::Trainable(_)) && self.lora.adapters()?.is_some();
        // A cached decode is inference only: a graph recorded from the
        // variables would keep every layer's activations until the logits drop.
        let (embed, norm, head) = if frozen || kv {
            (embed.detach(), norm.detach(), head.detach())
        } else {
            (embed, norm, head)
        };
        let x = match host_embed {
            // The rows looked up on the host, then copied: a few KiB a step.
            // Detached: a lookup in the variable itself would make Candle
            // record every layer's ops after it, keeping each layer's
            // activations (and a quantized layer's dequantized weights) alive
            // until the step's logits drop.
            Some(table) => self
                .host_rows
                .lookup(table.as_tensor(), tokens, &self.device)?
                .to_dtype(self.dtype)?,
            None => crate::embedding(&embed, &tokens.to_device(&self.device)?)?,
        };
        if kv {
            self.host_span("decode embedding", &mut t)?;
        }
        let h = match &self.layers {
            Layers::Resident(ls) if fused && x.track_op() => {
                self.fused.begin()?;
                let mut h = x;
                for l in ls {
                    h = layer_node(l, &h, &extras, &self.fused)?;
                }
                h
            }
            Layers::Resident(ls) => self.device_layers(ls, x, &extras, kv)?,
            Layers::Streamed(s) => {
                let x = self.device_layers(&self.front, x, &extras, kv)?;
                match kv {
                    true => s.forward_cached_with(&x, &extras)?.swap_remove(0),
                    false => s.forward_with(&x, &extras)?.swap_remove(0),
                }
            }
            Layers::Trainable(t) if kv => t.forward_cached_with(&x, &extras)?.swap_remove(0),
            Layers::Trainable(t) => t.forward_with(&x, &extras)?.swap_remove(0),
        };
        let h = RmsNorm::from_weight(norm, self.cfg.rms_norm_eps).forward(&h)?;
        Ok((h, head))
    }

    /// `h` through decoder layers on the device, `layers[0]` first (the kv
    /// cache in use when `kv`).
    fn device_layers(
        &self,
        layers: &[DecoderLayer],
        mut h: Tensor,
        extras: &[Tensor],
        kv: bool,
    ) -> Result<Tensor> {
        for (i, l) in layers.iter().enumerate() {
            let ctx = BlockCtx::inference(i, &self.device).with_kv_cache(kv);
            h = l.forward_ctx(&h, extras, &ctx)?.swap_remove(0);
        }
        Ok(h)
    }

    /// Mean next-token cross-entropy (f32 scalar) of `forward(tokens)` against
    /// `targets`, both `(batch, seq)` u32. Where the logits would take much of
    /// the device, the head and the loss run a chunk of rows at a time
    /// ([`Llama::set_loss_chunk`]).
    pub fn loss(&self, tokens: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let (b, n) = tokens.dims2()?;
        let v = self.cfg.vocab_size;
        if targets.dims() != [b, n] {
            bail!(
                "targets have shape {:?}, expected ({b}, {n})",
                targets.dims()
            );
        }
        if targets.dtype() != DType::U32 {
            bail!("targets must be u32, got {:?}", targets.dtype());
        }
        if targets.device().is_cpu() {
            // Checked here where it is free; on the device an out-of-range
            // target makes the loss NaN (see `cross_entropy`).
            if let Some(t) = targets
                .flatten_all()?
                .to_vec1::<u32>()?
                .into_iter()
                .find(|&t| t as usize >= v)
            {
                bail!("target token {t} is outside the vocabulary of {v} (vocab_size)");
            }
        }
        self.check_tokens(tokens)?;
        let mut t = std::time::Instant::now();
        let extras = self.rope.extras(n)?;
        self.host_span("loss: rotary tables", &mut t)?;
        let (h, head) = self.hidden(tokens, extras, false)?;
        self.host_span("loss: layers issued", &mut t)?;
        let h = h.reshape((b * n, self.cfg.hidden_size))?;
        let targets = targets.to_device(&self.device)?.flatten_all()?;
        let head_err =
            |e: candle_core::Error| e.context("in the head (final norm and vocabulary projection)");
        match self.loss_chunk_rows(b * n)? {
            Some(chunk) => crate::cross_entropy::linear_cross_entropy(&h, &head, &targets, chunk),
            // In the logits' dtype: no f32 copy of (batch x seq x vocab) logits.
            None => crate::cross_entropy(&Linear::new(head, None).forward(&h)?, &targets),
        }
        .map_err(head_err)
    }

    /// Sets how [`Llama::loss`] runs the head and the cross-entropy: whole, or
    /// a chunk of rows at a time ([`crate::cross_entropy::linear_cross_entropy`]:
    /// no `(rows, vocab)` logits exist, and the backward computes each chunk's
    /// logits again). Both give the same loss and gradients.
    pub fn set_loss_chunk(&self, chunk: LossChunk) -> Result<()> {
        let rows = match chunk {
            LossChunk::Auto => 0,
            LossChunk::Rows(0) => bail!("set_loss_chunk: chunks of 0 rows"),
            LossChunk::Rows(r) => r,
        };
        self.loss_chunk
            .store(rows, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// The rows per chunk for a loss over `rows` rows, or `None` for one piece.
    fn loss_chunk_rows(&self, rows: usize) -> Result<Option<usize>> {
        let (v, dtype) = (self.cfg.vocab_size, self.dtype);
        let chunk = match self.loss_chunk.load(std::sync::atomic::Ordering::Relaxed) {
            0 => crate::cross_entropy::linear_cross_entropy_chunk(v, dtype),
            r => return Ok(Some(r)),
        };
        let logits = rows * v * dtype.size_in_bytes();
        let whole = match streamer_device::free_device_memory(&self.device)? {
            Some(free) => 2 * logits <= free / 8,
            None => chunk >= rows,
        };
        Ok((!whole).then_some(chunk))
    }

    /// Gradients of `loss` for every parameter: through the streamed layers
    /// (recomputed in reverse) on a trainable model, by plain Candle backprop on
    /// a resident one. A trainable model's gradients are f32 host tensors keyed
    /// by the variables of [`Llama::parameters`]; its layers' gradients
    /// accumulate until [`Llama::zero_grad`].
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        match &self.layers {
            Layers::Trainable(t) => {
                let mut grads = t.backward(loss)?;
                self.outer_grads_to_masters(&mut grads)?;
                Ok(grads)
            }
            Layers::Resident(_) => {
                let mut grads = loss.backward()?;
                if self.fused.enabled() {
                    self.fused.collect(&mut grads)?;
                }
                Ok(grads)
            }
            Layers::Streamed(_) => {
                bail!(
                    "backward on a streamed model that is not trainable: call into_trainable first"
                )
            }
        }
    }

    /// Resident training through the decoder layers' hand-written backward
    /// (`decoder_backward.rs`) instead of Candle autograd: same gradients,
    /// each produced once, without autograd's zero-filled accumulators. While
    /// it is on, a forward that tracks gradients runs each layer as one graph
    /// node, and the layers' weight gradients come only from
    /// [`Llama::backward`] (a plain `loss.backward()` cannot see them: the next
    /// training forward then errors). Resident models only.
    pub fn set_fused_backward(&self, on: bool) -> Result<()> {
        let Layers::Resident(_) = &self.layers else {
            bail!("set_fused_backward: for resident models (streamed training already uses the hand-written backward)");
        };
        if on && self.lora.adapters()?.is_some() {
            bail!("set_fused_backward: the model has LoRA adapters, which the hand-written backward does not cover");
        }
        self.fused.set_enabled(on);
        Ok(())
    }

    /// Clears the trainable layers' accumulated host gradients.
    pub fn zero_grad(&self) -> Result<()> {
        match &self.layers {
            Layers::Trainable(t) => t.zero_grad(),
            _ => Ok(()),
        }
    }

    /// Moves a streamed model's embedding, final norm and head masters (not the
    /// layers') to the compute device, in their dtype, for an optimizer that
    /// steps them there: with a large vocabulary they are gigabytes, and on the
    /// host every step would copy them up, their gradients down (where Candle
    /// accumulates them on one CPU thread) and the stepped weights both ways.
    /// A resident model, or one already moved, is returned as it is.
    pub fn outer_masters_to_device(self) -> Result<Self> {
        let Outer::Host { embed, norm, head } = &self.outer else {
            return Ok(self);
        };
        let to = |v: &Var| -> Result<Var> {
            if v.device().same_device(&self.device) {
                Ok(v.clone())
            } else {
                Var::from_tensor(&v.as_tensor().to_device(&self.device)?)
            }
        };
        let outer = Outer::Host {
            embed: to(embed)?,
            norm: to(norm)?,
            head: head.as_ref().map(to).transpose()?,
        };
        Ok(Self { outer, ..self })
    }

    /// The trainable layers (for the overlapped optimizer step), if any.
    pub fn trainable_layers(&self) -> Option<&TrainableSequential> {
        match &self.layers {
            Layers::Trainable(t) => Some(t),
            _ => None,
        }
    }

    /// Every master of a streamed model as `(name, variable)`: embedding,
    /// final norm, head (unless tied), then the layers' weights in order. The
    /// layers' are on the host; the first three too, unless
    /// [`Llama::outer_masters_to_device`] moved them. A resident model made
    /// trainable ([`Llama::into_trainable`]) gives its variables in the same
    /// order; other resident models have none (their variables are those of
    /// their `VarMap`).
    pub fn parameters(&self) -> Vec<(String, Var)> {
        let mut out = Vec::new();
        if let Outer::Host { embed, norm, head } = &self.outer {
            out.push(("model.embed_tokens.weight".to_string(), embed.clone()));
            out.push(("model.norm.weight".to_string(), norm.clone()));
            if let Some(h) = head {
                out.push(("lm_head.weight".to_string(), h.clone()));
            }
        }
        match &self.layers {
            Layers::Streamed(s) => out.extend(s.parameters()),
            Layers::Trainable(t) => out.extend(t.parameters()),
            Layers::Resident(_) => out.extend(self.resident_vars.iter().cloned()),
        }
        out
    }

    /// Every weight under its Hugging Face name, as host tensors (a tied head is
    /// not repeated). Streamed models give their masters themselves (no copy).
    pub fn weights(&self) -> Result<HashMap<String, Tensor>> {
        let mut named = match &self.layers {
            Layers::Resident(_) => self.device_weights_named()?,
            _ => self
                .parameters()
                .into_iter()
                .map(|(n, v)| (n, v.as_tensor().clone()))
                .collect(),
        };
        for (i, l) in self.front.iter().enumerate() {
            named.extend(
                (l.named_weights().into_iter()).map(|(n, t)| (format!("model.layers.{i}.{n}"), t)),
            );
        }
        named
            .into_iter()
            .map(|(n, t)| Ok((n, t.to_device(&Device::Cpu)?)))
            .collect()
    }

    /// Writes every weight (Hugging Face names, the masters' dtype for a streamed
    /// model) to one safetensors file through `<path>.tmp` and a rename: an
    /// interrupted save leaves the previous file as it was.
    pub fn save_safetensors(&self, path: impl AsRef<Path>) -> Result<()> {
        streamer_device::save_atomic(&self.weights()?, path.as_ref())
    }
}

/// A mismatch between the files `paths` (the first of them named) and the
/// config, from [`check_weights`]: a [`streamer_device::Error::Checkpoint`].
fn checkpoint_mismatch<P: AsRef<Path>>(paths: &[P], e: candle_core::Error) -> candle_core::Error {
    let Some(path) = paths.first() else {
        return e;
    };
    let reason = match streamer_device::Error::find(&e) {
        Some(typed) => typed.to_string(),
        None => e.to_string(),
    };
    streamer_device::Error::Checkpoint {
        path: path.as_ref().to_path_buf(),
        reason,
    }
    .into()
}
