//! Parity with Hugging Face transformers: tiny random checkpoints of each family
//! and layout (`tests/fixtures/hf/`, written by `tests/fixtures/make_fixtures.py`
//! with the versions in `VERSIONS.txt`) and transformers' own logits, loss and
//! every parameter's gradient for them. Our resident and streamed (trainable)
//! models must match at f32 relative error <= 1e-4 (max abs difference over the
//! reference's max abs value, per tensor); bf16 within 3e-2.
use super::fused_mlp::rel_err;
use crate::common::ensure_close as check;
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use streamer_core::StreamConfig;
use streamer_models::{Llama, LlamaConfig};

const F32_TOL: f64 = 1e-4;
/// bf16 logits may be off the f32 reference by at most this multiple of
/// transformers' own bf16 error on the same checkpoint.
const BF16_FACTOR: f64 = 2.0;

/// A fixture folder, from the package root at build time or the working
/// directory (a test binary carried to another machine runs from the
/// repository root there).
pub(crate) fn fixture(name: &str) -> Result<PathBuf> {
    let rel = PathBuf::from("tests/fixtures/hf").join(name);
    [
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(&rel),
        rel.clone(),
    ]
    .into_iter()
    .find(|p| p.join("config.json").exists())
    .with_context(|| format!("fixture {} not found", rel.display()))
}

struct Fixture {
    cfg: LlamaConfig,
    /// `model.safetensors` or the shard index.
    weights: PathBuf,
    /// transformers' outputs (see the module docs).
    reference: HashMap<String, Tensor>,
}

fn load(name: &str) -> Result<Fixture> {
    let dir = fixture(name)?;
    let cfg = LlamaConfig::from_json_file(dir.join("config.json"))?;
    let index = dir.join("model.safetensors.index.json");
    let weights = if index.exists() {
        index
    } else {
        dir.join("model.safetensors")
    };
    Ok(Fixture {
        cfg,
        weights,
        reference: reference(&dir)?,
    })
}

/// The transformers outputs that a fixture folder keeps
/// (`reference.safetensors`), on the CPU.
pub(crate) fn reference(dir: &Path) -> Result<HashMap<String, Tensor>> {
    let path = dir.join("reference.safetensors");
    Ok(candle_core::safetensors::load(path, &Device::Cpu)?)
}

impl Fixture {
    fn get(&self, name: &str) -> Result<&Tensor> {
        self.reference
            .get(name)
            .with_context(|| format!("reference has no {name}"))
    }

    /// `tokens` and `targets` as u32 on `dev`, their first `n` positions.
    fn inputs(&self, dev: &Device, n: usize) -> Result<(Tensor, Tensor)> {
        let t = |k: &str| -> Result<Tensor> {
            Ok(self
                .get(k)?
                .narrow(1, 0, n)?
                .to_dtype(DType::U32)?
                .to_device(dev)?)
        };
        Ok((t("tokens")?, t("targets")?))
    }

    fn seq(&self) -> Result<usize> {
        Ok(self.get("tokens")?.dim(1)?)
    }

    /// `got` against the reference tensor `key`, at the f32 bound.
    fn check(&self, what: &str, got: &Tensor, key: &str) -> Result<()> {
        check(what, got, self.get(key)?, F32_TOL)
    }

    /// Each parameter's gradient in `grads` against the reference `grad.<name>`.
    fn check_grads<'a>(
        &self,
        what: &str,
        grads: &candle_core::backprop::GradStore,
        params: impl IntoIterator<Item = (&'a String, &'a Var)>,
    ) -> Result<()> {
        for (p, v) in params {
            let g = grads
                .get(v.as_tensor())
                .with_context(|| format!("{what}: no gradient for {p}"))?;
            self.check(&format!("{what} grad {p}"), g, &format!("grad.{p}"))?;
        }
        Ok(())
    }

    /// A resident model (f32, Candle autograd) over `vars`.
    fn resident(&self, vars: &HashMap<String, Var>, dev: &Device) -> Result<Llama> {
        let vb = crate::common::var_builder(vars, DType::F32, dev);
        Ok(Llama::resident(vb, &self.cfg)?)
    }

    /// Every checkpoint tensor as an f32 variable on `dev`.
    fn vars(&self, dev: &Device) -> Result<HashMap<String, Var>> {
        let files = streamer_core::expand_paths(&[&self.weights])?;
        let mut vars = HashMap::new();
        for f in files {
            for (k, t) in candle_core::safetensors::load(&f, dev)? {
                vars.insert(k, Var::from_tensor(&t.to_dtype(DType::F32)?)?);
            }
        }
        Ok(vars)
    }
}

/// Resident (variables, plain Candle autograd) against every reference tensor.
fn resident_matches(fx: &Fixture, dev: &Device, name: &str) -> Result<()> {
    let vars = fx.vars(dev)?;
    let model = fx.resident(&vars, dev)?;
    let (x, y) = fx.inputs(dev, fx.seq()?)?;
    let logits = model.forward(&x)?;
    fx.check(&format!("{name} resident logits"), &logits, "logits")?;
    let loss = model.loss(&x, &y)?;
    fx.check(&format!("{name} resident loss"), &loss, "loss")?;
    let grads = model.backward(&loss)?;
    let mut n = 0;
    for (k, want) in fx.reference.iter().filter(|(k, _)| k.starts_with("grad.")) {
        let p = &k["grad.".len()..];
        let v = vars
            .get(p)
            .with_context(|| format!("{name}: no weight {p}"))?;
        let g = grads
            .get(v.as_tensor())
            .with_context(|| format!("{name}: no gradient for {p}"))?;
        check(&format!("{name} resident grad {p}"), g, want, F32_TOL)?;
        n += 1;
    }
    ensure!(
        n == fx.cfg.weight_shapes().len(),
        "{name}: {n} gradients checked"
    );
    // The file loader gives the same logits.
    let loaded = Llama::load_resident(&[&fx.weights], &fx.cfg, DType::F32, dev)?;
    let logits = loaded.forward(&x)?;
    fx.check(&format!("{name} load_resident logits"), &logits, "logits")?;
    Ok(())
}

/// Streamed through a window of two layers in `dtype`, f32 host masters.
pub(crate) fn stream(dev: &Device, dtype: DType) -> StreamConfig {
    crate::common::stream(dev, dtype, 1)
}

/// Streamed and trainable (host masters, recomputed or hand-written backward).
fn streamed_matches(fx: &Fixture, dev: &Device, name: &str) -> Result<()> {
    let model = Llama::from_safetensors(&[&fx.weights], &fx.cfg, stream(dev, DType::F32))?
        .into_trainable()?;
    let (x, y) = fx.inputs(dev, fx.seq()?)?;
    let loss = model.loss(&x, &y)?;
    fx.check(&format!("{name} streamed loss"), &loss, "loss")?;
    let grads = model.backward(&loss)?;
    let params = model.parameters();
    ensure!(
        params.len() == fx.cfg.weight_shapes().len(),
        "{name}: {} parameters",
        params.len()
    );
    fx.check_grads(
        &format!("{name} streamed"),
        &grads,
        params.iter().map(|(p, v)| (p, v)),
    )?;
    model.set_training(false);
    let logits = model.forward(&x)?;
    fx.check(&format!("{name} streamed logits"), &logits, "logits")?;
    Ok(())
}

/// Resident with the hand-written layer backward (`Llama::set_fused_backward`).
fn resident_fused_matches(fx: &Fixture, dev: &Device, name: &str) -> Result<()> {
    let vars = fx.vars(dev)?;
    let model = fx.resident(&vars, dev)?;
    model.set_fused_backward(true)?;
    let (x, y) = fx.inputs(dev, fx.seq()?)?;
    let loss = model.loss(&x, &y)?;
    fx.check(&format!("{name} fused loss"), &loss, "loss")?;
    let grads = model.backward(&loss)?;
    fx.check_grads(&format!("{name} fused"), &grads, &vars)
}

fn family_matches_transformers(name: &str, dev: &Device) -> Result<()> {
    let fx = load(name)?;
    resident_matches(&fx, dev, name)?;
    resident_fused_matches(&fx, dev, name)?;
    streamed_matches(&fx, dev, name)
}

fn hf_llama_4x_layout_matches_transformers(dev: &Device) -> Result<()> {
    family_matches_transformers("llama-4x", dev)
}
candle_streamer::test_device!(hf_llama_4x_layout_matches_transformers);

fn hf_llama_5x_layout_matches_transformers(dev: &Device) -> Result<()> {
    let (c4, c5) = (load("llama-4x")?.cfg, load("llama-5x")?.cfg);
    ensure!(
        c4 == c5,
        "the two layouts read differently:\n{c4:?}\n{c5:?}"
    );
    family_matches_transformers("llama-5x", dev)
}
candle_streamer::test_device!(hf_llama_5x_layout_matches_transformers);

fn hf_llama31_rope_scaling_and_bias_matches_transformers(dev: &Device) -> Result<()> {
    let fx = load("llama31-bias")?;
    let s = fx.cfg.rope_scaling.as_ref().context("llama3 scaling")?;
    ensure!(s.rope_type == "llama3" && fx.cfg.rope_theta == 500000.0 && fx.cfg.o_bias());
    family_matches_transformers("llama31-bias", dev)
}
candle_streamer::test_device!(hf_llama31_rope_scaling_and_bias_matches_transformers);

fn hf_qwen2_matches_transformers(dev: &Device) -> Result<()> {
    let fx = load("qwen2")?;
    ensure!(fx.cfg.qkv_bias() && !fx.cfg.o_bias() && fx.cfg.sliding_window.is_none());
    family_matches_transformers("qwen2", dev)
}
candle_streamer::test_device!(hf_qwen2_matches_transformers);

fn hf_qwen3_matches_transformers(dev: &Device) -> Result<()> {
    let fx = load("qwen3")?;
    ensure!(fx.cfg.qk_norm() && fx.cfg.head_dim() == 16 && fx.cfg.hidden_size == 32);
    family_matches_transformers("qwen3", dev)
}
candle_streamer::test_device!(hf_qwen3_matches_transformers);

/// Tied head, three shards, bf16 weights: in f32 (the bf16 values upcast, as
/// transformers' reference did) at the f32 bound; computed in bf16, no further
/// from the f32 logits than twice transformers' bf16 logits are.
fn hf_llama_tied_sharded_bf16_matches_transformers(dev: &Device) -> Result<()> {
    let fx = load("llama-tied-sharded-bf16")?;
    ensure!(fx.cfg.tie_word_embeddings && fx.weights.ends_with("model.safetensors.index.json"));
    family_matches_transformers("llama-tied-sharded-bf16", dev)?;
    let (x, _) = fx.inputs(dev, fx.seq()?)?;
    let exact = fx.get("logits")?;
    // transformers' own bf16 logits are this far from its f32 ones (2.8e-2).
    let tol = BF16_FACTOR * rel_err(fx.get("logits_bfloat16")?, exact)?;
    let resident = Llama::load_resident(&[&fx.weights], &fx.cfg, DType::BF16, dev)?;
    check("bf16 resident logits", &resident.forward(&x)?, exact, tol)?;
    let streamed = Llama::from_safetensors(&[&fx.weights], &fx.cfg, stream(dev, DType::BF16))?;
    check("bf16 streamed logits", &streamed.forward(&x)?, exact, tol)?;
    Ok(())
}
candle_streamer::test_device!(hf_llama_tied_sharded_bf16_matches_transformers);

/// Mistral with a window of 16 under a 24-token sequence: transformers' logits,
/// loss and gradients through cqsa's window mask (resident autograd, resident
/// hand-written backward, streamed).
fn hf_mistral_sliding_window_matches_transformers(dev: &Device) -> Result<()> {
    let fx = load("mistral-window16")?;
    ensure!(fx.cfg.model_type == "mistral" && fx.cfg.sliding_window == Some(16));
    ensure!(fx.seq()? > 16, "the window must cut the fixture's sequence");
    family_matches_transformers("mistral-window16", dev)
}
candle_streamer::test_device!(hf_mistral_sliding_window_matches_transformers);

/// The hand-written layer backward (what streamed training runs) against
/// Candle autograd through the layer's ordinary forward, for layer 0 of the
/// families with biases and q/k norms: the input and every weight, f32 and (on
/// CUDA) bf16.
fn family_layer_manual_backward_matches_autograd(dev: &Device) -> Result<()> {
    use streamer_core::Block;
    let mut dts = vec![(DType::F32, 1e-4)];
    if dev.is_cuda() {
        dts.push((DType::BF16, 4e-2));
    }
    for name in ["qwen2", "qwen3", "llama31-bias"] {
        let fx = load(name)?;
        for &(dt, tol) in &dts {
            let vars: HashMap<String, Var> = fx
                .vars(dev)?
                .into_iter()
                .filter_map(|(k, v)| {
                    let local = k.strip_prefix("model.layers.0.")?.to_string();
                    Some((local, v))
                })
                .map(|(k, v)| Ok((k, Var::from_tensor(&v.as_tensor().to_dtype(dt)?)?)))
                .collect::<Result<_>>()?;
            let layer = streamer_models::DecoderLayer::new(
                &fx.cfg,
                crate::common::var_builder(&vars, dt, dev),
            )?;
            let n = 13;
            let extras = streamer_models::Rope::new(&fx.cfg, dt, dev)?.extras(n)?;
            let shape = (2, n, fx.cfg.hidden_size);
            let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, shape, dev)?.to_dtype(dt)?)?;
            let g = Tensor::randn(0f32, 1.0, shape, dev)?.to_dtype(dt)?;
            let y_ref = layer.forward(x.as_tensor(), &extras)?.remove(0);
            let want = (&y_ref * &g)?.to_dtype(DType::F32)?.sum_all()?.backward()?;
            let man = layer
                .manual()
                .context("every layer has a hand-written backward")?;
            let (y, saved) = man.forward_train(&x.as_tensor().detach(), &extras)?;
            check(&format!("{name} {dt:?} output"), &y, &y_ref, tol)?;
            let (dx, grads) = man.backward(saved, &g)?;
            check(
                &format!("{name} {dt:?} dx"),
                &dx,
                want.get(x.as_tensor()).context("dx")?,
                tol,
            )?;
            ensure!(
                grads.len() == vars.len(),
                "{name}: {} gradients for {} weights",
                grads.len(),
                vars.len()
            );
            for (p, v) in &vars {
                let (_, got) = grads
                    .iter()
                    .find(|(w, _)| w.id() == v.as_tensor().id())
                    .with_context(|| format!("{name}: no gradient for {p}"))?;
                let r = want.get(v.as_tensor()).context("reference")?;
                check(&format!("{name} {dt:?} grad {p}"), got, r, tol)?;
            }
        }
    }
    Ok(())
}
candle_streamer::test_device!(family_layer_manual_backward_matches_autograd);

/// Qwen2 with `use_sliding_window` and `max_window_layers = 1`: layer 0 dense,
/// layer 1 a window of 8 under 24 tokens, as transformers 5.x writes it
/// (`layer_types`) and as a 4.x file says it (`max_window_layers` alone):
/// both read the same, and match transformers in every path.
fn hf_qwen2_per_layer_window_matches_transformers(dev: &Device) -> Result<()> {
    let fx = load("qwen2-window8")?;
    ensure!(fx.cfg.layer_window(0).is_none() && fx.cfg.layer_window(1) == Some(8));
    let text = std::fs::read_to_string(fixture("qwen2-window8")?.join("config.json"))?;
    let mut v: serde_json::Value = serde_json::from_str(&text)?;
    v.as_object_mut().context("object")?.remove("layer_types");
    ensure!(
        LlamaConfig::from_json(&v.to_string())? == fx.cfg,
        "4.x reading differs"
    );
    family_matches_transformers("qwen2-window8", dev)
}
candle_streamer::test_device!(hf_qwen2_per_layer_window_matches_transformers);
