//! Weights in and out: strict checks of a checkpoint against a configuration,
//! seeded initial weights, and sizes (byte budgets, streaming windows).
use crate::config::LlamaConfig;
use candle_core::{bail, DType, Device, Result, Tensor};
use std::collections::{BTreeSet, HashMap};
use streamer_core::WeightSource;

/// Checks that `src` holds exactly the tensors `cfg` implies, with the right
/// shapes and float dtypes, before anything is loaded. Errors name the tensor
/// and the config fields its shape comes from; unexpected layers are reported
/// against `num_hidden_layers`. A tied model's `lm_head.weight`, when present,
/// is allowed and ignored (some published checkpoints store it). A tensor of
/// the wrong shape or dtype is a [`streamer_device::Error::Shape`] or
/// [`streamer_device::Error::Dtype`]; loading from files, every mismatch is a
/// [`streamer_device::Error::Checkpoint`] naming the file.
pub fn check_weights(src: &WeightSource, cfg: &LlamaConfig) -> Result<()> {
    check_weights_except(src, cfg, &[])
}

/// [`check_weights`] with the names in `packed` (quantized weights, checked
/// on their own by `QuantizedWeights::check`, and the layers' images that
/// hold them) left out of the shape, dtype and unknown-name checks.
pub(crate) fn check_weights_except(
    src: &WeightSource,
    cfg: &LlamaConfig,
    packed: &[String],
) -> Result<()> {
    let expected = cfg.weight_shapes();
    let mut missing = Vec::new();
    for (name, shape, fields) in &expected {
        if packed.contains(name) {
            continue;
        }
        if !src.contains(name) {
            missing.push(format!("{name} {shape:?}"));
            continue;
        }
        let (got, dt) = src.meta(name)?;
        streamer_device::Error::check_shape(got.dims(), shape, || {
            let what = format!("the config does not match the weights: tensor {name:?}");
            (what, format!("{shape:?}, as the config ({fields}) implies"))
        })?;
        if !dt.is_float() {
            return Err(streamer_device::Error::Dtype {
                what: format!("weight {name:?}"),
                got: dt,
                expected: "f16, bf16, f32 or f64".into(),
            }
            .into());
        }
    }
    if !missing.is_empty() {
        bail!(
            "the weights lack {} tensor(s) the config needs (num_hidden_layers = {}, \
             tie_word_embeddings = {}): {}",
            missing.len(),
            cfg.num_hidden_layers,
            cfg.tie_word_embeddings,
            list(&missing)
        );
    }
    let known: BTreeSet<&str> = expected.iter().map(|(n, _, _)| n.as_str()).collect();
    let extra: Vec<String> = src
        .names()
        .into_iter()
        .filter(|n| !known.contains(n.as_str()) && !packed.contains(n))
        .filter(|n| !(cfg.tie_word_embeddings && n == "lm_head.weight"))
        .collect();
    if !extra.is_empty() {
        let deepest = extra
            .iter()
            .filter_map(|n| crate::config::split_layer_name(n).map(|(i, _)| i))
            .max();
        let hint = match deepest {
            Some(l) if l >= cfg.num_hidden_layers => format!(
                " (the weights have layers up to {l} but the config's num_hidden_layers is {})",
                cfg.num_hidden_layers
            ),
            _ => String::new(),
        };
        bail!(
            "the weights hold {} tensor(s) this Llama config does not use{hint}: {}",
            extra.len(),
            list(&extra)
        );
    }
    Ok(())
}

fn list(names: &[String]) -> String {
    let mut s = names.iter().take(6).cloned().collect::<Vec<_>>().join(", ");
    if names.len() > 6 {
        s += &format!(", ... ({} more)", names.len() - 6);
    }
    s
}

/// A small deterministic generator (SplitMix64) for initial weights and data:
/// Candle's CPU generator cannot be seeded.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

/// SplitMix64's increment: its state after `k` draws is `seed + k * GAMMA`.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

impl SplitMix64 {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The generator of `seed` after `draws` draws, without making them
    /// (its state moves by a constant a draw).
    pub fn after(seed: u64, draws: u64) -> Self {
        Self(seed.wrapping_add(draws.wrapping_mul(GAMMA)))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

fn hash_name(seed: u64, name: &str) -> u64 {
    // FNV-1a over the name, mixed with the seed: each tensor's values depend only
    // on (seed, name), not on the order tensors are created in.
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed.wrapping_mul(0x100_0000_01b3);
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// Seeded initial weights in f32 on the host, Hugging Face names: normal with
/// standard deviation 0.02 (`initializer_range`), the layers' output
/// projections (`o_proj`, `down_proj`) scaled by `1 / sqrt(2 * layers)`, norms
/// at one. Each tensor depends only on `seed` and its name.
pub fn init_weights(cfg: &LlamaConfig, seed: u64) -> Result<HashMap<String, Tensor>> {
    init_weights_where(cfg, seed, |_| true)
}

/// [`init_weights`] of the weights whose names `keep` accepts only (each
/// the same as `init_weights` makes it): the dense rest of a model whose
/// linear weights are quantized, without the dense model in memory.
pub fn init_weights_where(
    cfg: &LlamaConfig,
    seed: u64,
    keep: impl Fn(&str) -> bool + Sync,
) -> Result<HashMap<String, Tensor>> {
    cfg.validate()?;
    let out_scale = 1.0 / (2.0 * cfg.num_hidden_layers as f64).sqrt();
    // Tensors are independent (each has its own generator), so they are made in
    // parallel: a 3b model is 3e9 normals.
    use rayon::prelude::*;
    cfg.weight_shapes()
        .into_par_iter()
        .filter(|(name, _, _)| keep(name))
        .map(|(name, shape, _)| {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = if name.ends_with("norm.weight") {
                vec![1.0; n]
            } else {
                let std = if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
                    0.02 * out_scale
                } else {
                    0.02
                };
                normals(hash_name(seed, &name), n, std)
            };
            Ok((name, Tensor::from_vec(data, shape, &Device::Cpu)?))
        })
        .collect()
}

/// `n` normals of standard deviation `std` from one SplitMix64 stream of
/// `seed` (what [`init_weights`] draws for a tensor): Box-Muller, two
/// normals from each pair of uniforms, so element `i` comes from draws
/// `2 (i / 2)` and the one after. Made in pieces on every core, each piece's
/// generator started at its first draw: the values of one sequential stream
/// (a tensor is up to a billion of them).
pub fn normals(seed: u64, n: usize, std: f64) -> Vec<f32> {
    use rayon::prelude::*;
    // Even, so that no pair straddles two pieces.
    const PIECE: usize = 1 << 16;
    let mut v = vec![0f32; n];
    v.par_chunks_mut(PIECE).enumerate().for_each(|(p, out)| {
        let mut rng = SplitMix64::after(seed, (p * PIECE) as u64);
        for pair in out.chunks_mut(2) {
            let u1 = rng.uniform().max(1e-300);
            let u2 = rng.uniform();
            let r = (-2.0 * u1.ln()).sqrt() * std;
            let a = 2.0 * std::f64::consts::PI * u2;
            pair[0] = (r * a.cos()) as f32;
            if let Some(second) = pair.get_mut(1) {
                *second = (r * a.sin()) as f32;
            }
        }
    });
    v
}

/// Parses a byte count: a plain number, or a number with `K`, `M`, `G`, `T`
/// (powers of 1000) or `KiB`, `MiB`, `GiB`, `TiB` (powers of 1024); `B` optional.
pub fn parse_bytes(s: &str) -> Result<usize> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let x: f64 = num
        .parse()
        .map_err(|_| candle_core::Error::Msg(format!("cannot parse byte count {s:?}")))?;
    let mult = match unit.trim().to_ascii_lowercase().trim_end_matches('b') {
        "" => 1.0,
        "k" => 1e3,
        "m" => 1e6,
        "g" => 1e9,
        "t" => 1e12,
        "ki" => 1024.0,
        "mi" => 1024.0 * 1024.0,
        "gi" => 1024.0 * 1024.0 * 1024.0,
        "ti" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => bail!("unknown unit in byte count {s:?} (K, M, G, T, KiB, MiB, GiB, TiB)"),
    };
    let bytes = x * mult;
    // `x` has only digits and dots, so it is finite or +inf (hundreds of digits).
    if !bytes.is_finite() || bytes >= usize::MAX as f64 {
        bail!(
            "byte count {s:?} is too large (at most {} bytes)",
            usize::MAX
        );
    }
    Ok(bytes as usize)
}

/// Bytes of one decoder layer's weights in `dtype` (one device slot).
pub fn layer_bytes(cfg: &LlamaConfig, dtype: DType) -> usize {
    cfg.layer_params() * dtype.size_in_bytes()
}

/// How many layers ahead to prefetch so that the window (`prefetch + 1`
/// layers' weights in `dtype`) fits in `budget` bytes of device memory for
/// layer weights. At least one layer must fit; the window is capped at the
/// number of layers.
pub fn prefetch_for_budget(cfg: &LlamaConfig, dtype: DType, budget: usize) -> Result<usize> {
    let per = layer_bytes(cfg, dtype);
    let window = budget / per;
    if window == 0 {
        bail!(
            "a GPU weight budget of {budget} bytes holds no decoder layer: one layer is {per} \
             bytes in {dtype:?}"
        );
    }
    Ok(window.min(cfg.num_hidden_layers) - 1)
}

/// For inference under a budget of `budget` bytes for decoder-layer weights
/// that does not hold every layer: `(prefetch, resident)`, the first
/// `resident` layers kept on the device and the rest streamed with `prefetch`
/// layers loaded ahead ([`crate::Llama::streamed_keeping`]). All but a window
/// of two stay resident: a step copies only the layers that do not fit,
/// where a window as wide as the budget copies every layer every step. A
/// budget of one or two layers streams them all through its window.
pub fn split_for_budget(cfg: &LlamaConfig, dtype: DType, budget: usize) -> Result<(usize, usize)> {
    let window = prefetch_for_budget(cfg, dtype, budget)? + 1;
    if window < 3 || window >= cfg.num_hidden_layers {
        return Ok((window - 1, 0));
    }
    Ok((1, window - 2))
}
