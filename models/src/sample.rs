//! Sampling text from a [`Llama`]: temperature and nucleus (top-p) sampling.
use crate::checkpoint::SplitMix64;
use crate::llama::Llama;
use candle_core::{bail, DType, Result, Tensor};

/// Picks a token from `logits` of shape `(vocab,)`: greedy when
/// `temperature <= 0`, otherwise from `softmax(logits / temperature)` restricted
/// to the smallest set of most likely tokens whose probability reaches `top_p`.
pub fn sample_token(
    logits: &Tensor,
    temperature: f64,
    top_p: f64,
    rng: &mut SplitMix64,
) -> Result<u32> {
    let l: Vec<f32> = logits.to_dtype(DType::F32)?.to_vec1()?;
    if l.is_empty() {
        bail!("sample_token: empty logits");
    }
    let argmax = || {
        l.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .unwrap_or(0)
    };
    if temperature <= 0.0 {
        return Ok(argmax());
    }
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut p: Vec<(usize, f64)> = l
        .iter()
        .enumerate()
        .map(|(i, &x)| (i, ((x - m) as f64 / temperature).exp()))
        .collect();
    let z: f64 = p.iter().map(|x| x.1).sum();
    p.iter_mut().for_each(|x| x.1 /= z);
    p.sort_by(|a, b| b.1.total_cmp(&a.1));
    let top_p = top_p.clamp(0.0, 1.0);
    let mut keep = 0;
    let mut mass = 0.0;
    while keep < p.len() && (keep == 0 || mass < top_p) {
        mass += p[keep].1;
        keep += 1;
    }
    let r = rng.uniform() * mass;
    let mut acc = 0.0;
    for &(i, q) in &p[..keep] {
        acc += q;
        if r < acc {
            return Ok(i as u32);
        }
    }
    Ok(p[keep - 1].0 as u32)
}

/// Continues `prompt` by `max_new` tokens. `on_token` sees each new token as it
/// is chosen. Returns the new tokens.
///
/// While prompt and output fit in `max_position_embeddings`, the model's kv cache
/// holds their keys and values, so each step feeds only the newest token. Past
/// that, each step runs the model over the last `max_position_embeddings` tokens
/// (the window slides, so every position moves and nothing cached can be reused).
/// The cache is emptied before and after.
pub fn generate(
    model: &Llama,
    prompt: &[u32],
    max_new: usize,
    temperature: f64,
    top_p: f64,
    seed: u64,
    mut on_token: impl FnMut(u32),
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        bail!("generate: the prompt is empty");
    }
    let was_training = model.is_training();
    model.set_training(false);
    let r = model.clear_cache().and_then(|()| {
        sample_loop(
            model,
            prompt,
            max_new,
            temperature,
            top_p,
            seed,
            &mut on_token,
        )
    });
    let cleared = model.clear_cache();
    model.set_training(was_training);
    let out = r?;
    cleared?;
    Ok(out)
}

fn sample_loop(
    model: &Llama,
    prompt: &[u32],
    max_new: usize,
    temperature: f64,
    top_p: f64,
    seed: u64,
    on_token: &mut impl FnMut(u32),
) -> Result<Vec<u32>> {
    let ctx = model.config().max_position_embeddings;
    let mut rng = SplitMix64::new(seed);
    let mut all = prompt.to_vec();
    let mut out = Vec::with_capacity(max_new);
    // Tokens of `all` whose keys and values are in the model's cache.
    let mut cached = 0;
    for _ in 0..max_new {
        let last = if all.len() <= ctx {
            let new = &all[cached..];
            let tokens = Tensor::new(new, model.device())?.unsqueeze(0)?;
            let logits = model.forward_cached(&tokens).map_err(|e| {
                e.context(format!(
                    "generating: the forward of positions {cached}..{}",
                    all.len()
                ))
            })?;
            cached = all.len();
            logits.get(0)?.get(new.len() - 1)?
        } else {
            let window = &all[all.len() - ctx..];
            let tokens = Tensor::new(window, model.device())?.unsqueeze(0)?;
            let logits = model.forward(&tokens)?;
            logits.get(0)?.get(window.len() - 1)?
        };
        let t = sample_token(&last, temperature, top_p, &mut rng)?;
        on_token(t);
        all.push(t);
        out.push(t);
    }
    Ok(out)
}
