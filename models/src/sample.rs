//! Sampling text from a [`Llama`]: temperature and nucleus (top-p) sampling.
use crate::checkpoint::SplitMix64;
use crate::llama::Llama;
use candle_core::{bail, DType, Result, Tensor};

/// How one sequence picks its next token: greedy when `temperature <= 0`,
/// otherwise from `softmax(logits / temperature)` restricted to the smallest
/// set of most likely tokens whose probability reaches `top_p`, drawn with
/// `rng`.
pub struct Sampling<'a> {
    /// Softmax temperature (`<= 0`: greedy).
    pub temperature: f64,
    /// Nucleus mass.
    pub top_p: f64,
    /// The sequence's own random stream.
    pub rng: &'a mut SplitMix64,
}

/// Picks a token from `logits` of shape `(vocab,)`: greedy when
/// `temperature <= 0`, otherwise from `softmax(logits / temperature)` restricted
/// to the smallest set of most likely tokens whose probability reaches `top_p`.
/// One row of [`sample_rows`].
pub fn sample_token(
    logits: &Tensor,
    temperature: f64,
    top_p: f64,
    rng: &mut SplitMix64,
) -> Result<u32> {
    if logits.rank() != 1 {
        bail!(
            "sample_token: logits of shape {:?}, expected (vocab,)",
            logits.dims()
        );
    }
    let s = Sampling {
        temperature,
        top_p,
        rng,
    };
    Ok(sample_rows(&logits.unsqueeze(0)?, &mut [s])?[0])
}

/// Picks one token for each row of `logits` `(rows, vocab)`, row `r` as
/// `rows[r]` says. A batched decode step calls it once: the greedy rows'
/// argmax is taken on the logits' device and only the other rows' logits are
/// copied to the host (one copy each way for the whole step, not one per
/// sequence). Greedy picks the largest logit (equal ones are told apart by
/// Candle's `argmax` on the device, so the same logits give the same token).
pub fn sample_rows(logits: &Tensor, rows: &mut [Sampling]) -> Result<Vec<u32>> {
    let (n, vocab) = logits.dims2()?;
    if n != rows.len() {
        bail!(
            "sample_rows: {n} rows of logits for {} samplers",
            rows.len()
        );
    }
    if vocab == 0 {
        bail!("sample_rows: empty logits");
    }
    let mut out: Vec<u32> = logits.argmax(1)?.to_vec1()?;
    let drawn: Vec<usize> = (0..n).filter(|&r| rows[r].temperature > 0.0).collect();
    if drawn.is_empty() {
        return Ok(out);
    }
    let ids = Tensor::new(
        drawn.iter().map(|&r| r as u32).collect::<Vec<_>>(),
        logits.device(),
    )?;
    let host: Vec<Vec<f32>> = logits
        .index_select(&ids, 0)?
        .to_dtype(DType::F32)?
        .to_vec2()?;
    for (&r, l) in drawn.iter().zip(&host) {
        let s = &mut rows[r];
        out[r] = sample_nucleus(l, s.temperature, s.top_p, s.rng);
    }
    Ok(out)
}

/// A draw from `softmax(l / temperature)` cut to nucleus mass `top_p`.
fn sample_nucleus(l: &[f32], temperature: f64, top_p: f64, rng: &mut SplitMix64) -> u32 {
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
            return i as u32;
        }
    }
    p[keep - 1].0 as u32
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
    let mut rng = SplitMix64::new(seed);
    let sampling = Sampling {
        temperature,
        top_p,
        rng: &mut rng,
    };
    let r = model
        .clear_cache()
        .and_then(|()| sample_loop(model, prompt, max_new, sampling, &mut on_token));
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
    s: Sampling<'_>,
    on_token: &mut impl FnMut(u32),
) -> Result<Vec<u32>> {
    let ctx = model.config().max_position_embeddings;
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
        let t = sample_token(&last, s.temperature, s.top_p, s.rng)?;
        on_token(t);
        all.push(t);
        out.push(t);
    }
    Ok(out)
}
