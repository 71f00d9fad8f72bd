//! The device memory of a batched decode ([`crate::generate_batch`]) and the
//! number of sequences a device budget holds, so that `generate --prompts
//! --device-budget` can choose its batch before anything loads.
//!
//! What a streamed batched decode keeps on the device: the layer window's
//! weights, the embedding, final norm and head (copied once for the batch),
//! the packed kv cache (`crate::batch_kv`: every slot reserves the longest
//! sequence's rows), and one step's activations (at most `step_rows` rows
//! through a decoder layer, and the logits of every sequence), plus a fixed
//! margin for cuBLAS workspaces and the allocator.
use candle_core::{bail, DType, Result};

use crate::checkpoint::layer_bytes;
use crate::LlamaConfig;

/// A margin for what the estimate does not count (cuBLAS workspaces, the
/// allocator's rounding): 1 GiB.
const MARGIN: usize = 1 << 30;

/// The device bytes of a batched decode, by kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchMemory {
    /// The layer window and the outer weights.
    pub weights: usize,
    /// The packed kv cache.
    pub kv: usize,
    /// One step's activations and logits.
    pub activations: usize,
    /// A fixed 1 GiB for what the estimate does not count.
    pub margin: usize,
}

/// The shape of a batched decode: sequences in flight, rows a slot reserves
/// (prompt and new tokens of the longest sequence), rows a step computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchShape {
    /// Sequences in flight.
    pub sequences: usize,
    /// Positions each slot reserves.
    pub capacity: usize,
    /// Rows a step computes at most.
    pub step_rows: usize,
}

impl BatchMemory {
    /// The estimate for `cfg` computing in `dtype` with `window` layers on the
    /// device (all of them when resident).
    pub fn of(cfg: &LlamaConfig, dtype: DType, window: usize, shape: BatchShape) -> Self {
        let e = dtype.size_in_bytes();
        let outer: usize = cfg
            .outer_weights()
            .iter()
            .map(|(_, dims, _)| dims.iter().product::<usize>())
            .sum();
        let (h, i, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
        let qkv = (cfg.num_attention_heads + 2 * cfg.num_kv_heads()) * d;
        // The residual, its norm, attention's output and the MLP's input and
        // output (4 h), gate, up and their product (3 i), q, k and v.
        let per_row = (4 * h + 3 * i + qkv) * e;
        Self {
            weights: window * layer_bytes(cfg, dtype) + outer * e,
            kv: shape.sequences * kv_bytes_per_sequence(cfg, dtype, shape.capacity),
            activations: shape.step_rows * per_row + 2 * shape.sequences * cfg.vocab_size * e,
            margin: MARGIN,
        }
    }

    /// Every kind together.
    pub fn total(&self) -> usize {
        self.weights + self.kv + self.activations + self.margin
    }
}

impl std::fmt::Display for BatchMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = |b: usize| b as f64 / (1u64 << 30) as f64;
        write!(
            f,
            "{:.1} GiB: weights {:.1}, kv cache {:.1}, activations {:.1}, margin {:.1}",
            g(self.total()),
            g(self.weights),
            g(self.kv),
            g(self.activations),
            g(self.margin)
        )
    }
}

/// Keys and values of one slot of `capacity` positions (rounded up to 16, as
/// the cache reserves them), every layer.
pub fn kv_bytes_per_sequence(cfg: &LlamaConfig, dtype: DType, capacity: usize) -> usize {
    let rows = capacity.next_multiple_of(16);
    2 * cfg.num_hidden_layers * cfg.num_kv_heads() * cfg.head_dim() * rows * dtype.size_in_bytes()
}

/// The most sequences (at most `max`) whose batched decode fits `budget`
/// bytes; an error naming the smallest budget that holds one when none fits.
pub fn sequences_for_budget(
    cfg: &LlamaConfig,
    dtype: DType,
    window: usize,
    (capacity, step_rows, max): (usize, usize, usize),
    budget: usize,
) -> Result<usize> {
    let shape = |sequences| BatchShape {
        sequences,
        capacity,
        step_rows,
    };
    let fits = |n| BatchMemory::of(cfg, dtype, window, shape(n)).total() <= budget;
    if !fits(1) {
        let one = BatchMemory::of(cfg, dtype, window, shape(1));
        bail!(
            "a device budget of {:.2} GiB holds no sequence of {capacity} positions: one needs {one} \
             (lower the step's rows or the window, or raise the budget)",
            budget as f64 / (1u64 << 30) as f64
        );
    }
    // `fits` is monotone in the count: bisect.
    let (mut lo, mut hi) = (1, max.max(1));
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Ok(lo)
}
