//! LoRA adapters in PEFT's layout, on a frozen (streamed or resident) base.
//!
//! An adapted projection computes `x W^T + scale * dropout(x) A^T B^T` with
//! `A (r, in)`, `B (out, r)` and `scale = lora_alpha / r` (PEFT's `LoraLayer`).
//! The adapters are small `Var`s on the compute device; the model hands them
//! to every decoder layer as extra inputs ([`crate::Llama::set_lora`]), so a
//! streamed base trains them through the trainer's extras gradients while its
//! own weights stay frozen (no gradient transfer). Files are PEFT's:
//! `adapter_config.json` and `adapter_model.safetensors` with tensor names such
//! as `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, so
//! PEFT loads ours and we load PEFT's. [`LoraAdapters::merge_into`] folds them
//! into the base weights.
use crate::config::LlamaConfig;
use candle_core::{bail, DType, Device, Result, Tensor, Var, D};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// The projections an adapter can target, by Hugging Face module name.
pub const LORA_TARGETS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// The decoder-layer path of a target (`self_attn.q_proj`, `mlp.up_proj`).
fn module_path(target: usize) -> String {
    let group = if target < 4 { "self_attn" } else { "mlp" };
    format!("{group}.{}", LORA_TARGETS[target])
}

/// `(in, out)` of a target's projection in `cfg`.
pub(crate) fn dims(cfg: &LlamaConfig, target: usize) -> (usize, usize) {
    let (h, m) = (cfg.hidden_size, cfg.intermediate_size);
    let (q, kv) = (
        cfg.num_attention_heads * cfg.head_dim(),
        cfg.num_kv_heads() * cfg.head_dim(),
    );
    [(h, q), (h, kv), (h, kv), (q, h), (h, m), (h, m), (m, h)][target]
}

/// A LoRA configuration (PEFT's `LoraConfig` fields that this implements).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// Rank of each adapter.
    pub r: usize,
    /// Scale numerator: the update is multiplied by `lora_alpha / r`.
    pub lora_alpha: f64,
    /// Dropout on the adapter's input while training, in `[0, 1)`.
    pub lora_dropout: f64,
    /// Hugging Face module names of the adapted projections ([`LORA_TARGETS`]).
    pub target_modules: Vec<String>,
}

impl LoraConfig {
    /// A checked configuration.
    pub fn new(r: usize, lora_alpha: f64, lora_dropout: f64, targets: &[&str]) -> Result<Self> {
        let c = Self {
            r,
            lora_alpha,
            lora_dropout,
            target_modules: targets.iter().map(|s| s.to_string()).collect(),
        };
        c.targets()?;
        Ok(c)
    }

    /// `lora_alpha / r`.
    pub fn scale(&self) -> f64 {
        self.lora_alpha / self.r as f64
    }

    /// The targets as indices into [`LORA_TARGETS`] (sorted), after checking
    /// every field: a positive rank, a finite alpha, dropout in `[0, 1)`, and
    /// target modules that name at least one projection and nothing else.
    pub fn targets(&self) -> Result<Vec<usize>> {
        if self.r == 0 || self.r > 1 << 16 {
            bail!("LoRA field r = {} must be in 1..=65536", self.r);
        }
        if !self.lora_alpha.is_finite() {
            bail!("LoRA field lora_alpha = {} is not finite", self.lora_alpha);
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            bail!(
                "LoRA field lora_dropout = {} must be in [0, 1)",
                self.lora_dropout
            );
        }
        if self.target_modules.is_empty() {
            bail!("LoRA field target_modules names no module (choose from {LORA_TARGETS:?})");
        }
        let mut out = Vec::new();
        for m in &self.target_modules {
            match LORA_TARGETS.iter().position(|t| t == m) {
                Some(i) if !out.contains(&i) => out.push(i),
                Some(_) => {}
                None => bail!(
                    "LoRA field target_modules: {m:?} names no projection of this decoder (choose from {LORA_TARGETS:?})"
                ),
            }
        }
        out.sort_unstable();
        Ok(out)
    }

    /// Reads PEFT's `adapter_config.json` text (`file` names it in errors).
    /// Fields whose math is not implemented are errors naming them
    /// (`use_dora`, `use_rslora`, `bias` other than `"none"`, `fan_in_fan_out`,
    /// `modules_to_save`, `layers_to_transform`, `rank_pattern`,
    /// `alpha_pattern`); `target_modules` may be a list or `"all-linear"`.
    pub fn from_peft_json(text: &str, file: &Path) -> Result<Self> {
        let f = file.display();
        let v: Value = serde_json::from_str(text)
            .map_err(|e| candle_core::Error::Msg(format!("{f}: not JSON: {e}")))?;
        let field = |k: &str| v.get(k).filter(|x| !x.is_null());
        if let Some(t) = field("peft_type").and_then(Value::as_str) {
            if t != "LORA" {
                bail!("{f}: field peft_type = {t:?} is not supported (only \"LORA\")");
            }
        }
        check_unsupported(&v, &f.to_string())?;
        let r = field("r").and_then(Value::as_u64).unwrap_or(8) as usize;
        let alpha = field("lora_alpha").and_then(Value::as_f64).unwrap_or(8.0);
        let dropout = field("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0);
        let targets: Vec<String> = match field("target_modules") {
            Some(Value::String(s)) if s == "all-linear" => {
                LORA_TARGETS.iter().map(|s| s.to_string()).collect()
            }
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_str().map(String::from).ok_or_else(|| {
                        candle_core::Error::Msg(format!(
                            "{f}: field target_modules has a non-string entry {x}"
                        ))
                    })
                })
                .collect::<Result<_>>()?,
            Some(other) => bail!(
                "{f}: field target_modules = {other} is not supported (a list of module names or \"all-linear\")"
            ),
            None => bail!("{f}: no field target_modules"),
        };
        let c = Self {
            r,
            lora_alpha: alpha,
            lora_dropout: dropout,
            target_modules: targets,
        };
        c.targets()
            .map_err(|e| candle_core::Error::Msg(format!("{f}: {e}")))?;
        Ok(c)
    }

    /// PEFT's `adapter_config.json` for this configuration.
    pub fn to_peft_json(&self, base_model: Option<&str>) -> Result<String> {
        let v = serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "lora_dropout": self.lora_dropout,
            "target_modules": self.target_modules,
            "bias": "none",
            "fan_in_fan_out": false,
            "use_rslora": false,
            "use_dora": false,
            "inference_mode": false,
            "init_lora_weights": true,
            "modules_to_save": null,
            "layers_to_transform": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "base_model_name_or_path": base_model,
        });
        serde_json::to_string_pretty(&v).map_err(candle_core::Error::wrap)
    }
}

/// PEFT fields whose math is not implemented: errors naming field and value.
fn check_unsupported(v: &Value, f: &str) -> Result<()> {
    let set = |k: &str| -> Option<&Value> {
        v.get(k).filter(|x| match x {
            Value::Null | Value::Bool(false) => false,
            Value::Object(o) => !o.is_empty(),
            Value::Array(a) => !a.is_empty(),
            _ => true,
        })
    };
    for k in [
        "use_dora",
        "use_rslora",
        "fan_in_fan_out",
        "modules_to_save",
        "layers_to_transform",
        "layers_pattern",
        "rank_pattern",
        "alpha_pattern",
        "exclude_modules",
        "lora_bias",
        "layer_replication",
        "use_qalora",
        "use_bdlora",
        "target_parameters",
        "trainable_token_indices",
    ] {
        if let Some(x) = set(k) {
            bail!("{f}: LoRA field {k} = {x} is not supported");
        }
    }
    match v.get("bias").and_then(Value::as_str) {
        None | Some("none") => Ok(()),
        Some(b) => bail!("{f}: LoRA field bias = {b:?} is not supported (only \"none\")"),
    }
}

/// What the decoder layers read at each forward: the adapted projections,
/// the scale, the dropout and whether it is on.
#[derive(Clone, Debug)]
pub(crate) struct LoraLayout {
    /// Indices into [`LORA_TARGETS`], sorted.
    pub(crate) targets: Vec<usize>,
    pub(crate) scale: f64,
    pub(crate) dropout: f32,
    pub(crate) training: bool,
}

impl LoraLayout {
    /// Extra tensors per layer: `A`, `B` for each target.
    pub(crate) fn per_layer(&self) -> usize {
        2 * self.targets.len()
    }

    /// `x W^T (+ b)` from `base`, plus the adapter of `target` when adapted:
    /// `ab` are this layer's `[A, B, A, B, ...]` in target order.
    pub(crate) fn apply(
        &self,
        target: usize,
        x: &Tensor,
        base: Tensor,
        ab: &[Tensor],
    ) -> Result<Tensor> {
        let Some(k) = self.targets.iter().position(|&t| t == target) else {
            return Ok(base);
        };
        // The adapters stay in their own dtype (f32 as PEFT keeps them); the
        // conversion is part of the graph, so their gradients come back in it.
        let (a, b) = (
            ab[2 * k].to_dtype(x.dtype())?,
            ab[2 * k + 1].to_dtype(x.dtype())?,
        );
        let x = if self.training && self.dropout > 0.0 {
            streamer_autograd::dropout(x, self.dropout)?
        } else {
            x.clone()
        };
        // As rows: one GEMM each for A and B, not one batched GEMM of r
        // columns a sequence. On the H200 the plain forward of an 8B LoRA
        // layer took 24 ms against 18 ms for the hand-written backward's
        // forward, which multiplies rows
        // (`benches/results/qlora-spill-timeline-h200.json`).
        let width = x.dim(D::Minus1)?;
        let rows = x.reshape(((), width))?;
        let delta = rows.matmul(&a.t()?)?.matmul(&b.t()?)?;
        let delta = (delta.reshape(base.shape())? * self.scale)?;
        base + delta
    }
}

/// What a hand-written backward keeps of one adapter's forward: its `A`,
/// `B` (the layer's extras, whose gradients it returns), `u = x' A^T` and,
/// with dropout, the elements it kept (`x' = m * x` with `m` the scaled
/// mask: `dropout_scale` of them), a byte each rather than the mask in the
/// compute dtype.
pub(crate) struct LoraSaved {
    pub(crate) a: Tensor,
    pub(crate) b: Tensor,
    pub(crate) u: Tensor,
    pub(crate) keep: Option<Tensor>,
}

impl LoraLayout {
    /// Whether this forward draws dropout masks.
    pub(crate) fn drops(&self) -> bool {
        self.training && self.dropout > 0.0
    }

    /// As [`LoraLayout::apply`] for a `(rows, in)` input, also returning what
    /// [`LoraLayout::backward_term`] needs. The mask is `dropout_keep`'s, the
    /// same draw (and so the same bits) as `apply`'s `dropout(x)` at this
    /// point of the layer.
    pub(crate) fn apply_saved(
        &self,
        target: usize,
        x: &Tensor,
        base: Tensor,
        ab: &[Tensor],
    ) -> Result<(Tensor, Option<LoraSaved>)> {
        let Some(k) = self.targets.iter().position(|&t| t == target) else {
            return Ok((base, None));
        };
        let (a, b) = (ab[2 * k].clone(), ab[2 * k + 1].clone());
        let keep = if self.drops() {
            Some(streamer_autograd::dropout_keep(
                x.dims(),
                self.dropout,
                x.device(),
            )?)
        } else {
            None
        };
        let xd = self.masked(x, keep.as_ref())?;
        let u = xd.matmul(&a.detach().to_dtype(x.dtype())?.t()?)?;
        let delta = u.matmul(&b.detach().to_dtype(x.dtype())?.t()?)?;
        let y = (base + (delta * self.scale)?)?;
        Ok((y, Some(LoraSaved { a, b, u, keep })))
    }

    /// `m * x` for the scaled mask of the kept elements `keep` (`x` itself
    /// without dropout).
    fn masked(&self, x: &Tensor, keep: Option<&Tensor>) -> Result<Tensor> {
        match self.mask(x, keep)? {
            Some(m) => x.mul(&m),
            None => Ok(x.clone()),
        }
    }

    /// The scaled mask of the kept elements `keep`, in `x`'s dtype.
    fn mask(&self, x: &Tensor, keep: Option<&Tensor>) -> Result<Option<Tensor>> {
        keep.map(|k| streamer_autograd::dropout_scale(k, self.dropout, x.dtype()))
            .transpose()
    }

    /// The adapter's part of the backward of `y = base + s (m x) A^T B^T`
    /// given `dy (rows, out)`: pushes `(A, dA)` and `(B, dB)`, each gradient
    /// in its adapter's dtype, and returns its term of `dx` (in `dy`'s).
    pub(crate) fn backward_term(
        &self,
        saved: &LoraSaved,
        x: &Tensor,
        dy: &Tensor,
        grads: &mut Vec<(Tensor, Tensor)>,
    ) -> Result<Tensor> {
        let dt = dy.dtype();
        let (a, b) = (
            saved.a.detach().to_dtype(dt)?,
            saved.b.detach().to_dtype(dt)?,
        );
        // Made once from the kept bytes, for the input and its gradient.
        let m = self.mask(x, saved.keep.as_ref())?;
        let xd = match &m {
            Some(m) => x.mul(m)?,
            None => x.clone(),
        };
        let d_b = (dy.t()?.matmul(&saved.u)? * self.scale)?;
        let du = (dy.matmul(&b)? * self.scale)?;
        let d_a = du.t()?.matmul(&xd)?;
        let dxd = du.matmul(&a)?;
        grads.push((saved.a.clone(), d_a.to_dtype(saved.a.dtype())?));
        grads.push((saved.b.clone(), d_b.to_dtype(saved.b.dtype())?));
        match &m {
            Some(m) => dxd.mul(m),
            None => Ok(dxd),
        }
    }
}

/// The model's adapters, shared (an `Arc`) with every layer it builds, like
/// the kv cache: a streamed model rebuilds its layers on every call.
/// The adapters and the layout the layers read from them.
type LoraState = Option<(LoraLayout, Arc<LoraAdapters>)>;

#[derive(Debug, Default)]
pub(crate) struct LoraSlot {
    state: Mutex<LoraState>,
}

impl LoraSlot {
    fn lock(&self) -> Result<std::sync::MutexGuard<'_, LoraState>> {
        self.state
            .lock()
            .map_err(|_| candle_core::Error::Msg("LoRA state poisoned by a panic".into()))
    }

    pub(crate) fn layout(&self) -> Result<Option<LoraLayout>> {
        Ok(self.lock()?.as_ref().map(|(l, _)| l.clone()))
    }

    pub(crate) fn adapters(&self) -> Result<Option<Arc<LoraAdapters>>> {
        Ok(self.lock()?.as_ref().map(|(_, a)| a.clone()))
    }

    pub(crate) fn set(&self, a: Option<Arc<LoraAdapters>>, training: bool) -> Result<()> {
        *self.lock()? = match a {
            Some(a) => Some((a.layout(training)?, a)),
            None => None,
        };
        Ok(())
    }

    pub(crate) fn set_training(&self, on: bool) -> Result<()> {
        if let Some((l, _)) = self.lock()?.as_mut() {
            l.training = on;
        }
        Ok(())
    }
}

/// One adapter: its PEFT name prefix and its `A (r, in)`, `B (out, r)`.
#[derive(Debug)]
struct Adapter {
    prefix: String,
    a: Var,
    b: Var,
}

/// Every layer's adapters for one [`LoraConfig`], as `Var`s.
#[derive(Debug)]
pub struct LoraAdapters {
    cfg: LoraConfig,
    layers: usize,
    /// Layer-major, then target order.
    adapters: Vec<Adapter>,
}

/// PEFT's name prefix of layer `i`'s adapter on `target`.
fn peft_prefix(i: usize, target: usize) -> String {
    format!("base_model.model.model.layers.{i}.{}", module_path(target))
}

impl LoraAdapters {
    /// Fresh adapters as PEFT initialises them: `A` uniform in `±1 /
    /// sqrt(in)` (Kaiming-uniform with `a = sqrt(5)`), `B` zero, so the
    /// adapted model starts as the base. f32 on `device`, seeded.
    pub fn init(cfg: &LoraConfig, model: &LlamaConfig, device: &Device, seed: u64) -> Result<Self> {
        let targets = cfg.targets()?;
        let mut rng = crate::checkpoint::SplitMix64::new(seed);
        let mut adapters = Vec::new();
        for i in 0..model.num_hidden_layers {
            for &t in &targets {
                let (fan_in, out) = dims(model, t);
                let bound = 1.0 / (fan_in as f64).sqrt();
                let a: Vec<f32> = (0..cfg.r * fan_in)
                    .map(|_| ((rng.uniform() * 2.0 - 1.0) * bound) as f32)
                    .collect();
                let a = Tensor::from_vec(a, (cfg.r, fan_in), device)?;
                let b = Tensor::zeros((out, cfg.r), DType::F32, device)?;
                adapters.push(Adapter {
                    prefix: peft_prefix(i, t),
                    a: Var::from_tensor(&a)?,
                    b: Var::from_tensor(&b)?,
                });
            }
        }
        Ok(Self {
            cfg: cfg.clone(),
            layers: model.num_hidden_layers,
            adapters,
        })
    }

    /// Reads PEFT's `adapter_config.json` and `adapter_model.safetensors` from
    /// `dir` for a base of configuration `model`, as f32 `Var`s on `device`.
    /// Every tensor's name and shape is checked against the base before any is
    /// loaded; errors name the file and the tensor.
    pub fn load_peft(dir: impl AsRef<Path>, model: &LlamaConfig, device: &Device) -> Result<Self> {
        let dir = dir.as_ref();
        let cfg_file = dir.join("adapter_config.json");
        let text = std::fs::read_to_string(&cfg_file).map_err(|e| {
            candle_core::Error::Msg(format!("cannot read {}: {e}", cfg_file.display()))
        })?;
        let cfg = LoraConfig::from_peft_json(&text, &cfg_file)?;
        let file = dir.join("adapter_model.safetensors");
        let src = streamer_core::WeightSource::safetensors(&[&file])?;
        let expected = Self::expected(&cfg, model)?;
        let wanted: std::collections::BTreeSet<&String> = expected.iter().map(|(n, _)| n).collect();
        let f = file.display();
        for (name, shape) in &expected {
            if !src.contains(name) {
                bail!(
                    "{f}: no tensor {name} (target_modules {:?}, {} layers)",
                    cfg.target_modules,
                    model.num_hidden_layers
                );
            }
            let (got, _) = src.meta(name)?;
            if got.dims() != shape.as_slice() {
                bail!("{f}: tensor {name} has shape {:?} but r = {} and the base model imply {shape:?}", got.dims(), cfg.r);
            }
        }
        if let Some(extra) = src.names().into_iter().find(|n| !wanted.contains(n)) {
            bail!(
                "{f}: tensor {extra} fits no adapter of target_modules {:?} on this base",
                cfg.target_modules
            );
        }
        let mut adapters = Vec::new();
        for pair in expected.chunks(2) {
            let load = |n: &str| -> Result<Var> {
                Var::from_tensor(&src.load(n, DType::F32)?.to_device(device)?)
            };
            let prefix = pair[0].0.trim_end_matches(".lora_A.weight").to_string();
            adapters.push(Adapter {
                a: load(&pair[0].0)?,
                b: load(&pair[1].0)?,
                prefix,
            });
        }
        Ok(Self {
            cfg,
            layers: model.num_hidden_layers,
            adapters,
        })
    }

    /// PEFT's tensor names and shapes for `cfg` on `model`, `A` then `B` of
    /// each adapter, layer-major.
    fn expected(cfg: &LoraConfig, model: &LlamaConfig) -> Result<Vec<(String, Vec<usize>)>> {
        let targets = cfg.targets()?;
        let mut out = Vec::new();
        for i in 0..model.num_hidden_layers {
            for &t in &targets {
                let (fan_in, o) = dims(model, t);
                let p = peft_prefix(i, t);
                out.push((format!("{p}.lora_A.weight"), vec![cfg.r, fan_in]));
                out.push((format!("{p}.lora_B.weight"), vec![o, cfg.r]));
            }
        }
        Ok(out)
    }

    /// Writes `adapter_config.json` and `adapter_model.safetensors` (f32) into
    /// `dir` (created if needed), each through a temporary file and a rename.
    pub fn save_peft(&self, dir: impl AsRef<Path>, base_model: Option<&str>) -> Result<()> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| {
            candle_core::Error::Msg(format!("cannot create {}: {e}", dir.display()))
        })?;
        let tensors: HashMap<String, Tensor> = self
            .vars()
            .into_iter()
            .map(|(n, v)| Ok((n, v.as_tensor().to_device(&Device::Cpu)?)))
            .collect::<Result<_>>()?;
        streamer_device::save_atomic(&tensors, &dir.join("adapter_model.safetensors"))?;
        streamer_device::write_atomic(
            &dir.join("adapter_config.json"),
            &self.cfg.to_peft_json(base_model)?,
        )
    }

    /// The configuration.
    pub fn config(&self) -> &LoraConfig {
        &self.cfg
    }

    /// Every adapter variable under its PEFT name (what an optimizer steps).
    pub fn vars(&self) -> Vec<(String, Var)> {
        self.adapters
            .iter()
            .flat_map(|a| {
                [
                    (format!("{}.lora_A.weight", a.prefix), a.a.clone()),
                    (format!("{}.lora_B.weight", a.prefix), a.b.clone()),
                ]
            })
            .collect()
    }

    /// Checks that the adapters were made for `model` (layer count and shapes).
    pub(crate) fn check_base(&self, model: &LlamaConfig) -> Result<()> {
        let expected = Self::expected(&self.cfg, model)?;
        let vars = self.vars();
        if self.layers != model.num_hidden_layers || expected.len() != vars.len() {
            bail!(
                "LoRA adapters for {} layers do not fit a base of num_hidden_layers = {}",
                self.layers,
                model.num_hidden_layers
            );
        }
        for ((name, shape), (_, v)) in expected.iter().zip(&vars) {
            if v.dims() != shape.as_slice() {
                bail!(
                    "LoRA tensor {name} has shape {:?} but the base implies {shape:?}",
                    v.dims()
                );
            }
        }
        Ok(())
    }

    pub(crate) fn layout(&self, training: bool) -> Result<LoraLayout> {
        Ok(LoraLayout {
            targets: self.cfg.targets()?,
            scale: self.cfg.scale(),
            dropout: self.cfg.lora_dropout as f32,
            training,
        })
    }

    /// `[A, B, ...]` of every layer on `device`, the extras the layers read:
    /// the variables themselves, in their own dtype, when they live there.
    /// The layers convert them to the compute dtype, so a streamed trainer
    /// hands their gradients straight to the variables instead of running a
    /// Candle backward through a conversion per adapter (448 at 8B, about
    /// 106 ms of host time a micro-batch with the GPU idle in
    /// `qlora-plan-timeline-8edefba-h100.txt`).
    pub(crate) fn extras(&self, device: &Device) -> Result<Vec<Tensor>> {
        let mut out = Vec::with_capacity(2 * self.adapters.len());
        for a in &self.adapters {
            for v in [&a.a, &a.b] {
                out.push(v.as_tensor().to_device(device)?);
            }
        }
        Ok(out)
    }

    /// Folds the adapters into base weights (Hugging Face names):
    /// `W += scale * B A` for every adapted projection, in `W`'s dtype.
    /// A target held quantized (packed u8 bytes) is an error naming it,
    /// before any weight is changed.
    pub fn merge_into(&self, weights: &mut HashMap<String, Tensor>) -> Result<()> {
        let scale = self.cfg.scale();
        for a in &self.adapters {
            let name = format!(
                "{}.weight",
                a.prefix.trim_start_matches("base_model.model.")
            );
            if weights.get(&name).is_some_and(|w| !w.dtype().is_float()) {
                return Err(streamer_device::Error::Dtype {
                    what: format!("LoRA merge target {name:?}"),
                    got: weights[&name].dtype(),
                    expected: "a dense float weight (it is quantized: merge into a dequantized \
                               copy, or keep the adapter separate)"
                        .into(),
                }
                .into());
            }
        }
        for a in &self.adapters {
            let name = format!(
                "{}.weight",
                a.prefix.trim_start_matches("base_model.model.")
            );
            let Some(w) = weights.get(&name) else {
                bail!("merge: the base weights have no {name}");
            };
            let delta = a.b.as_tensor().matmul(a.a.as_tensor())?;
            let delta = (delta * scale)?.to_device(w.device())?;
            let merged = (w.to_dtype(DType::F32)? + delta)?.to_dtype(w.dtype())?;
            weights.insert(name, merged);
        }
        Ok(())
    }
}
