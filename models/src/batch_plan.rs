//! The device memory of a batched decode ([`crate::generate_batch`]) and the
//! number of sequences a device budget holds, so that `generate --prompts
//! --device-budget` can choose its batch before anything loads.
//!
//! What a streamed batched decode keeps on the device: the layer window's
//! weights (a quantized base's packed bytes, and the layer it computes
//! dequantized: [`LayerFootprint`]), the embedding, final norm and head
//! (copied once for the batch), the packed kv cache (`crate::batch_kv`:
//! every slot reserves the longest sequence's rows), and one step's
//! activations (at most `step_rows` rows through a decoder layer, and the
//! logits of every sequence), plus a margin for cuBLAS workspaces and the
//! allocator. A streamed decode looks an untied embedding's rows up in host
//! memory (`Llama`'s host embedding), so a streamed plan does not count it:
//! under a 24 GiB driver cap the plans that counted it peaked 3.3-3.4 GiB
//! below their estimate (8B bf16 and 70B NF4 on an H100), more than the
//! 2.1 GB a 70B embedding takes, and the 70B NF4 plan without it peaked at
//! 21.0 GiB against 23.3 planned (`benches/results/generate-nf4-h100.json`).
//!
//! Sequences beyond those whose kv cache the device holds can keep theirs in
//! page-locked host memory (`crate::host_kv`): each step copies their whole
//! cache up beside the weights, layer by layer, so a host sequence costs
//! PCIe time every step. [`plan_batch`] adds them where the rates say that
//! raises the generated tokens/s, within the host memory the run allows.
use candle_core::{DType, Device, Result, Tensor};
use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use crate::checkpoint::layer_bytes;
use crate::quantization_config::QuantizationConfig;
use crate::quantized_weights::{image_offsets, is_quantizable, QUANTIZABLE};
use crate::{BatchLimits, LlamaConfig, PretrainedFiles};
use streamer_quant::QuantScheme;

/// The device bytes of one decoder layer's weights: in a window slot, and
/// beside the window while the layer computes (a quantized layer's linear
/// weights dequantized into the compute dtype for its GEMMs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerFootprint {
    /// Bytes of a layer in a slot (what a streamed step copies over PCIe).
    pub slot: usize,
    /// Bytes the computing layer holds besides its slot.
    pub scratch: usize,
    /// Packed quantized weights: the layers can only stream.
    pub quantized: bool,
}

impl LayerFootprint {
    /// Every weight dense in `dtype`.
    pub fn dense(cfg: &LlamaConfig, dtype: DType) -> Self {
        Self {
            slot: layer_bytes(cfg, dtype),
            scratch: 0,
            quantized: false,
        }
    }

    /// The linear weights packed as `scheme` (but those `keep_dense` names,
    /// e.g. a checkpoint's `skip_modules`), the rest dense in `dtype`.
    pub fn quantized(
        cfg: &LlamaConfig,
        dtype: DType,
        scheme: QuantScheme,
        keep_dense: impl Fn(&str) -> bool,
    ) -> Result<Self> {
        let e = dtype.size_in_bytes();
        let (mut slot, mut scratch) = (0, 0);
        let mut packed = HashMap::new();
        for (name, shape, _) in cfg.layer_weights(0) {
            let dense = shape.iter().product::<usize>() * e;
            if is_quantizable(&name) && !keep_dense(&name) {
                let layout = scheme
                    .layout(&name, &shape)
                    .map_err(candle_core::Error::wrap)?;
                packed.insert(name, layout.bytes());
                scratch += dense;
            } else {
                slot += dense;
            }
        }
        // All seven packed: one image of the layer, with its alignment.
        slot += match packed.len() == QUANTIZABLE.len() {
            true => {
                let local = |l: &str| packed[&format!("model.layers.0.{l}")];
                image_offsets(QUANTIZABLE.iter().map(|l| local(l))).1
            }
            false => packed.values().sum(),
        };
        Ok(Self {
            slot,
            scratch,
            quantized: true,
        })
    }

    /// The layers of the base a command loads: packed as the
    /// `quantization_config` of `folder`'s `config.json` says (its
    /// `skip_modules` dense), or as `scheme` (quantized on load; refused for
    /// a folder already quantized, as loading it would be), else dense in
    /// `dtype`. Reads only the config, so a plan can be made before the
    /// weights load.
    pub fn of_base(
        cfg: &LlamaConfig,
        dtype: DType,
        folder: Option<&Path>,
        scheme: Option<QuantScheme>,
    ) -> Result<Self> {
        let qc = match folder {
            Some(dir) => {
                let files = PretrainedFiles::in_dir(dir)?;
                let text = std::fs::read_to_string(&files.config).map_err(|e| {
                    candle_core::Error::Msg(format!("cannot read {}: {e}", files.config.display()))
                })?;
                QuantizationConfig::from_config_json(&text)?
            }
            None => None,
        };
        match (qc, scheme) {
            (Some(_), Some(_)) => Err(crate::pretrained::quantized_placement(
                "quantizing again on load (--quantize)",
            )),
            (Some(qc), None) => Self::quantized(cfg, dtype, qc.method.scheme(), |n| qc.skips(n)),
            (None, Some(scheme)) => Self::quantized(cfg, dtype, scheme, |_| false),
            (None, None) => Ok(Self::dense(cfg, dtype)),
        }
    }

    /// The device bytes of `window` layers in their slots and one computing.
    fn device_bytes(&self, window: usize) -> usize {
        window * self.slot + self.scratch
    }
}

/// A margin for what the estimate does not count (cuBLAS workspaces, kernels
/// loaded at first use, the allocator's rounding): 1 GiB, plus 1/20 of the kv
/// cache and activations. On the H200 (generate bench, bundle 84cb761) a
/// decode of 256 sequences held 1.35 GiB beyond its cache, step and weights,
/// 64 sequences 1.16 GiB: the part beyond 1 GiB grows with the cache.
const MARGIN: usize = 1 << 30;
const MARGIN_SHARE: usize = 20;

/// The device bytes of a batched decode, by kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchMemory {
    /// The layer window and the outer weights.
    pub weights: usize,
    /// The packed kv cache.
    pub kv: usize,
    /// One step's activations and logits.
    pub activations: usize,
    /// Three layers of the host sequences' kv cache on their way through
    /// the device (`crate::host_kv`'s buffers; 0 without host sequences).
    pub kv_staging: usize,
    /// What the estimate does not count: 1 GiB and 1/20 of the kv cache and
    /// activations.
    pub margin: usize,
}

/// The shape of a batched decode: sequences in flight, rows a slot reserves
/// (prompt and new tokens of the longest sequence), rows a step computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchShape {
    /// Sequences in flight.
    pub sequences: usize,
    /// Of those, sequences whose kv cache lives in host memory.
    pub host_sequences: usize,
    /// Positions each slot reserves.
    pub capacity: usize,
    /// Rows a step computes at most.
    pub step_rows: usize,
}

impl BatchMemory {
    /// The estimate for `cfg` computing in `dtype` with layers of `layer`
    /// placed as `placement` says (see the module docs for what it counts).
    pub fn of(
        cfg: &LlamaConfig,
        dtype: DType,
        (placement, layer): (BatchPlacement, LayerFootprint),
        shape: BatchShape,
    ) -> Self {
        let e = dtype.size_in_bytes();
        let window = placement.window(cfg);
        let outer: usize = cfg
            .outer_weights()
            .iter()
            .filter(|(name, ..)| !host_embedding(cfg, placement, name))
            .map(|(_, dims, _)| dims.iter().product::<usize>())
            .sum();
        let (h, i, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
        let qkv = (cfg.num_attention_heads + 2 * cfg.num_kv_heads()) * d;
        // The residual, its norm, attention's output and the MLP's input and
        // output (4 h), gate, up and their product (3 i), q, k and v.
        let per_row = (4 * h + 3 * i + qkv) * e;
        let per_sequence = kv_bytes_per_sequence(cfg, dtype, shape.capacity);
        let host = shape.host_sequences.min(shape.sequences);
        let kv = (shape.sequences - host) * per_sequence;
        let kv_staging = 3 * host * per_sequence / cfg.num_hidden_layers.max(1);
        let activations = shape.step_rows * per_row + 2 * shape.sequences * cfg.vocab_size * e;
        Self {
            weights: layer.device_bytes(window) + outer * e,
            kv,
            activations,
            kv_staging,
            margin: MARGIN + (kv + kv_staging + activations) / MARGIN_SHARE,
        }
    }

    /// Every kind together.
    pub fn total(&self) -> usize {
        self.weights + self.kv + self.kv_staging + self.activations + self.margin
    }
}

impl std::fmt::Display for BatchMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = |b: usize| b as f64 / (1u64 << 30) as f64;
        write!(
            f,
            "{:.1} GiB: weights {:.1}, kv cache {:.1}",
            g(self.total()),
            g(self.weights),
            g(self.kv),
        )?;
        if self.kv_staging > 0 {
            write!(
                f,
                ", host kv cache passing through {:.1}",
                g(self.kv_staging)
            )?;
        }
        write!(
            f,
            ", activations {:.1}, margin {:.1}",
            g(self.activations),
            g(self.margin)
        )
    }
}

/// Whether outer weight `name` stays in host memory during a decode placed
/// as `placement`: a streamed decode's untied embedding, whose rows are
/// looked up on the host (a tied one is the head, on the device).
fn host_embedding(cfg: &LlamaConfig, placement: BatchPlacement, name: &str) -> bool {
    matches!(placement, BatchPlacement::Streamed { .. })
        && !cfg.tie_word_embeddings
        && name == "model.embed_tokens.weight"
}

/// Keys and values of one slot of `capacity` positions (rounded up to 16, as
/// the cache reserves them), every layer.
pub fn kv_bytes_per_sequence(cfg: &LlamaConfig, dtype: DType, capacity: usize) -> usize {
    let rows = capacity.next_multiple_of(16);
    2 * cfg.num_hidden_layers * cfg.num_kv_heads() * cfg.head_dim() * rows * dtype.size_in_bytes()
}

/// The most sequences (at most `max`) whose batched decode with layers of
/// `layer` placed as `placement` says fits `budget` bytes; an error naming
/// the smallest budget that holds one when none fits.
pub fn sequences_for_budget(
    cfg: &LlamaConfig,
    dtype: DType,
    window: (BatchPlacement, LayerFootprint),
    (capacity, step_rows, max): (usize, usize, usize),
    budget: usize,
) -> Result<usize> {
    device_sequences(cfg, dtype, window, (capacity, step_rows, max), (budget, 0))
}

/// [`sequences_for_budget`] beside `host` sequences whose kv cache is in host
/// memory: the most sequences (at most `max`) with theirs on the device.
fn device_sequences(
    cfg: &LlamaConfig,
    dtype: DType,
    window: (BatchPlacement, LayerFootprint),
    (capacity, step_rows, max): (usize, usize, usize),
    (budget, host): (usize, usize),
) -> Result<usize> {
    let shape = |sequences| BatchShape {
        sequences: sequences + host,
        host_sequences: host,
        capacity,
        step_rows,
    };
    let fits = |n| BatchMemory::of(cfg, dtype, window, shape(n)).total() <= budget;
    if !fits(1) {
        let one = BatchMemory::of(cfg, dtype, window, shape(1));
        return Err(streamer_device::Error::OutOfMemory {
            needed: one.total(),
            free: budget,
            what: format!(
                "a device budget of {:.2} GiB holds no sequence of {capacity} positions: one needs \
                 {one} (lower the step's rows or the window, or raise the budget)",
                budget as f64 / (1u64 << 30) as f64
            ),
        }
        .into());
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

impl std::fmt::Display for BatchPlacement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Self::Resident => write!(f, "resident"),
            Self::Streamed {
                window,
                resident: 0,
            } => write!(f, "streamed, window {window}"),
            Self::Streamed { window, resident } => write!(
                f,
                "{resident} layers resident, the rest streamed through a window of {window}"
            ),
        }
    }
}

/// The placements [`plan_batch`] chooses among.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlacementChoice {
    /// Every layer resident, the first ones resident and the rest streamed,
    /// or every layer streamed.
    Any,
    /// At least one layer streamed every step.
    Streaming,
    /// Every layer streamed.
    AllStreamed,
}

/// Where a batched decode keeps the decoder layers' weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchPlacement {
    /// Every layer on the device, copied once.
    Resident,
    /// The first `resident` layers on the device (copied once,
    /// [`crate::Llama::streamed_keeping`]), the others streamed from host
    /// memory through a window of `window` layers, each copied once a step.
    Streamed {
        /// Streamed layers on the device at once.
        window: usize,
        /// Layers kept on the device (0: every layer streams).
        resident: usize,
    },
}

impl BatchPlacement {
    /// Decoder layers on the device at once.
    pub fn window(self, cfg: &LlamaConfig) -> usize {
        match self {
            Self::Resident => cfg.num_hidden_layers,
            Self::Streamed { window, resident } => (window + resident).min(cfg.num_hidden_layers),
        }
    }

    /// Decoder layers copied over PCIe every step.
    pub fn streamed_layers(self, cfg: &LlamaConfig) -> usize {
        match self {
            Self::Resident => 0,
            Self::Streamed { resident, .. } => cfg.num_hidden_layers.saturating_sub(resident),
        }
    }
}

/// The speeds a batched decode's expected tokens/s is made of, measured on
/// the device that will decode.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeRates {
    /// Host-to-device copies from page-locked memory, bytes/s.
    pub h2d_bytes_per_s: f64,
    /// A resident weight read by a GEMM of few rows, bytes/s: a decode step
    /// reads every resident weight once at about this rate.
    pub device_bytes_per_s: f64,
    /// A dense GEMM of the MLP's shape over 4096 rows, FLOP/s (an upper
    /// bound on what a step's kernels reach).
    pub flops_per_s: f64,
}

impl DecodeRates {
    /// Probes `device` (256 MiB of copies up, GEMMs of the MLP's weight
    /// against 4096 rows and against 64, freed before returning; medians
    /// after a warm-up). The weight's read rate is timed over 16 GEMMs of 64
    /// rows, each too short to time alone. (A device-to-device copy stood
    /// for it before: 522 GB/s on the H200, where the resident 8B decode in
    /// 24 GiB ran at 1.40x the prediction made from such a probe.)
    pub fn measure(cfg: &LlamaConfig, dtype: DType, device: &Device) -> Result<Self> {
        const READS: usize = 16;
        let h2d = streamer_device::measure_h2d_gbps(device, 256 << 20, 5)? * 1e9;
        let rows = |n: usize| -> Result<Tensor> {
            Tensor::randn(0f32, 1.0, (n, cfg.hidden_size), device)?.to_dtype(dtype)
        };
        let (a, thin) = (rows(4096)?, rows(64)?);
        let b = Tensor::randn(0f32, 1.0, (cfg.hidden_size, cfg.intermediate_size), device)?
            .to_dtype(dtype)?;
        let gemm = median_secs(device, || a.matmul(&b).map(drop))?;
        let reads = median_secs(device, || {
            (0..READS).try_for_each(|_| thin.matmul(&b).map(drop))
        })?;
        let weight = (b.elem_count() * dtype.size_in_bytes() * READS) as f64;
        Ok(Self {
            h2d_bytes_per_s: h2d,
            device_bytes_per_s: weight / reads,
            flops_per_s: 2.0 * (4096 * cfg.hidden_size * cfg.intermediate_size) as f64 / gemm,
        })
    }
}

/// The median of 5 timed runs of `f` after 2 untimed ones.
fn median_secs(device: &Device, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut times = Vec::with_capacity(5);
    for i in 0..7 {
        device.synchronize()?;
        let t = Instant::now();
        f()?;
        device.synchronize()?;
        if i >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2].max(1e-9))
}

/// FLOPs of one request of `prompt` tokens and `new` generated ones: the
/// layers' GEMMs on every row fed, attention over each row's context, the
/// head on each generated token's row.
pub fn request_flops(cfg: &LlamaConfig, prompt: usize, new: usize) -> f64 {
    let rows = (prompt + new).saturating_sub(1) as f64;
    let layers = cfg.num_hidden_layers as f64;
    let width = (cfg.num_attention_heads * cfg.head_dim()) as f64;
    // Row i attends to i + 1 keys: q k^T and p v, 2 FLOPs a multiply-add.
    let context = rows * (rows + 1.0) / 2.0;
    let attention = 4.0 * layers * width * context;
    let head = 2.0 * (new * cfg.hidden_size * cfg.vocab_size) as f64;
    2.0 * cfg.layer_params() as f64 * layers * rows + attention + head
}

/// A batched run to plan: the longest request's positions, the step's rows,
/// the most sequences worth having (e.g. the number of requests) and the
/// requests' mean lengths.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchRun {
    /// Positions each slot reserves (the longest prompt and output).
    pub capacity: usize,
    /// Rows a step computes at most (a streamed plan may take fewer:
    /// [`plan_batch`]).
    pub step_rows: usize,
    /// Sequences in flight at most.
    pub most: usize,
    /// Mean prompt tokens of a request.
    pub prompt_len: f64,
    /// Mean tokens a request generates.
    pub new_tokens: f64,
    /// Host memory the kv cache of sequences kept there may take (0: every
    /// sequence keeps its cache on the device).
    pub host_kv_bytes: usize,
}

/// A batched decode's plan: where the weights live, how many sequences run
/// together, the device memory that takes, and the generated tokens/s the
/// rates predict (an estimate for choosing between plans: every step at the
/// probe GEMM's rate, every copy hidden; on the H200 the resident 8B plan for
/// 24 GiB predicted 1,068 and ran at 1,500, the streamed one 986 and ran at
/// 712, `benches/results/generate-h200.json`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchPlan {
    /// Where the decoder layers live.
    pub placement: BatchPlacement,
    /// Sequences in flight.
    pub sequences: usize,
    /// Of those, sequences whose kv cache lives in host memory.
    pub host_sequences: usize,
    /// Device memory by kind.
    pub memory: BatchMemory,
    /// Predicted generated tokens/s.
    pub tokens_per_s: f64,
    /// Rows a step computes at most: the run's, or a streamed plan's steps
    /// as many as a step's copies hide at the GEMM rate (see [`plan_batch`]).
    pub step_rows: usize,
}

impl std::fmt::Display for BatchPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}, {} sequences", self.placement, self.sequences)?;
        if self.host_sequences > 0 {
            write!(
                f,
                " ({} with their kv cache in host memory)",
                self.host_sequences
            )?;
        }
        write!(
            f,
            ", steps of at most {} rows, {}; {:.0} generated tokens/s predicted",
            self.step_rows, self.memory, self.tokens_per_s
        )
    }
}

impl BatchPlan {
    /// The plan of `placement` with `host` sequences' kv cache in host
    /// memory and the most sequences besides them that `budget` holds.
    fn of(
        cfg: &LlamaConfig,
        (dtype, layer): (DType, LayerFootprint),
        (placement, budget, host): (BatchPlacement, usize, usize),
        run: BatchRun,
        rates: &DecodeRates,
    ) -> Result<Self> {
        // A step's floors: the streamed layers and the host sequences' kv
        // cache copied over PCIe (hidden behind compute) and the resident
        // layers read from device memory.
        let streamed = placement.streamed_layers(cfg);
        let host_kv = host * kv_bytes_per_sequence(cfg, dtype, run.capacity);
        let copy_floor = (streamed * layer.slot + host_kv) as f64 / rates.h2d_bytes_per_s;
        let read_floor =
            ((cfg.num_hidden_layers - streamed) * layer.slot) as f64 / rates.device_bytes_per_s;
        let run = BatchRun {
            step_rows: step_rows(cfg, placement, run, copy_floor * rates.flops_per_s),
            ..run
        };
        let window = (placement, layer);
        let most = (run.capacity, run.step_rows, run.most.saturating_sub(host));
        let sequences = host + device_sequences(cfg, dtype, window, most, (budget, host))?;
        let shape = BatchShape {
            sequences,
            host_sequences: host,
            capacity: run.capacity,
            step_rows: run.step_rows,
        };
        let memory = BatchMemory::of(cfg, dtype, window, shape);
        // Per request: the resident layers' part of its FLOPs and its share of
        // their reads, then the streamed layers' part of its FLOPs or its share
        // of their copies, whichever is longer. A step runs its resident layers
        // first, while at most the window's copies run ahead, so their time
        // adds to the streamed part's: 8B bf16 in 24 GiB on the H200 kept 17
        // layers resident at 776 generated tokens/s against 754 all streamed,
        // where the two overlapped would have predicted 1,585
        // (`benches/results/generate-h200.json`).
        let (p, g) = (run.prompt_len, run.new_tokens);
        let compute =
            request_flops(cfg, p.round() as usize, g.round() as usize) / rates.flops_per_s;
        // A step generates a token for each sequence, but its rows also feed
        // the prompts that replace finished sequences: in a long run, g of
        // every p + g rows are generated tokens.
        let per_step = (sequences as f64).min(run.step_rows as f64 * g / (p + g).max(1.0));
        let share = g / per_step.max(1.0);
        let part = streamed as f64 / cfg.num_hidden_layers.max(1) as f64;
        let request_s =
            compute * (1.0 - part) + share * read_floor + (compute * part).max(share * copy_floor);
        Ok(Self {
            placement,
            sequences,
            host_sequences: host,
            memory,
            tokens_per_s: g / request_s.max(1e-12),
            step_rows: run.step_rows,
        })
    }

    /// The limits [`crate::generate_batch`] runs this plan with.
    pub fn limits(&self) -> BatchLimits {
        BatchLimits {
            sequences: self.sequences,
            step_rows: self.step_rows,
            host_kv: self.host_sequences,
        }
    }
}

/// The share of a streamed step's copy time its rows may take at the probe
/// GEMM's rate. The rest goes to what that rate leaves out (norms, rotary,
/// attention, the GEMMs' lower rate at these shapes) and to the host's work
/// between steps, which a step longer than its copies cannot hide: 8B bf16
/// in 24 GiB on an H100 computed its 10,003-row steps for 313 ms where the
/// GEMM rate predicts 256, with about 50 ms between steps, against 257 ms of
/// copies; those steps took 360 ms, the copy-bound ones 270, 864.3
/// generated tokens/s. With this share every step computed for about 168 ms
/// and took about 283: 923.6 for a longer job
/// (`benches/results/generate-24gib-h100.json`, calls A and B).
pub const STEP_COMPUTE_SHARE: f64 = 0.65;

/// The rows a step of `placement` computes at most: `run.step_rows` when
/// resident; when streamed, as many as the GEMM rate computes in
/// [`STEP_COMPUTE_SHARE`] of a step's copy time (`copy_flops`, the FLOPs the
/// GEMM rate does in the whole of it), so a step that also feeds new
/// prompts stays as long as its copies (at least one whole request: a
/// prompt is admitted whole).
fn step_rows(
    cfg: &LlamaConfig,
    placement: BatchPlacement,
    run: BatchRun,
    copy_flops: f64,
) -> usize {
    let BatchPlacement::Streamed { .. } = placement else {
        return run.step_rows;
    };
    let row_flops = 2.0 * (cfg.layer_params() * cfg.num_hidden_layers) as f64;
    let hidden = (STEP_COMPUTE_SHARE * copy_flops / row_flops) as usize;
    hidden.clamp(run.capacity.min(run.step_rows), run.step_rows)
}

/// The placement (resident, or streamed through `window` layers) and the
/// batch that `budget` bytes hold with the most generated tokens/s `rates`
/// predict, for layers of `layer` computing in `dtype` and steps of at most
/// `run.step_rows` rows (a streamed plan's steps at most as many as the GEMM
/// rate computes in [`STEP_COMPUTE_SHARE`] of the time a step's layers take
/// to copy: larger steps of prompts outlast their copies, and the decode
/// steps after them cannot make up for it; 70B NF4 in 24 GiB on an H100 ran
/// at 85 generated tokens/s with steps of 8,192 rows, each prefilling for
/// 1.7 s against 0.7 s of copies, and at 114.9 with 3,426, the whole copy
/// time's rows, `benches/results/generate-nf4-h100.json`; fewer rows also
/// leave more of the budget to the kv cache);
/// `choice` says which placements may be chosen (a quantized base's packed
/// layers only stream, every one of them). A split keeps as many of the
/// first layers resident as is fastest: fewer bytes a step to copy, less
/// room for the kv cache. Ties go to resident, then to more resident
/// layers. An error names what the smallest streamed plan needs when none
/// fits.
pub fn plan_batch(
    cfg: &LlamaConfig,
    (dtype, layer): (DType, LayerFootprint),
    (budget, window, choice): (usize, usize, PlacementChoice),
    run: BatchRun,
    rates: &DecodeRates,
) -> Result<BatchPlan> {
    let streamed = |resident| BatchPlacement::Streamed { window, resident };
    let choice = if layer.quantized {
        PlacementChoice::AllStreamed
    } else {
        choice
    };
    // The plan with every layer streamed comes last: when nothing fits, its
    // error (the smallest plan's) is the one returned.
    let most_kept = match choice {
        PlacementChoice::AllStreamed => 0,
        _ => cfg.num_hidden_layers - 1,
    };
    let mut placements: Vec<BatchPlacement> = (0..=most_kept).rev().map(streamed).collect();
    if choice == PlacementChoice::Any {
        placements.insert(0, BatchPlacement::Resident);
    }
    let mut best: Option<Result<BatchPlan>> = None;
    for placement in placements {
        for host in host_choices(cfg, dtype, placement, run) {
            let p = BatchPlan::of(cfg, (dtype, layer), (placement, budget, host), run, rates);
            best = Some(match (best, p) {
                (Some(Ok(b)), Ok(p)) if p.tokens_per_s <= b.tokens_per_s => Ok(b),
                (Some(Ok(b)), Err(_)) => Ok(b),
                (_, p) => p,
            });
        }
    }
    best.expect("one placement at least is tried")
}

/// The counts of host-memory kv caches [`plan_batch`] tries with `placement`:
/// none, and for a streamed placement up to what `run.host_kv_bytes` holds
/// (at most `run.most`) in 16 even steps.
fn host_choices(
    cfg: &LlamaConfig,
    dtype: DType,
    placement: BatchPlacement,
    run: BatchRun,
) -> Vec<usize> {
    const STEPS: usize = 16;
    let per_sequence = kv_bytes_per_sequence(cfg, dtype, run.capacity).max(1);
    let most = match placement {
        BatchPlacement::Resident => 0,
        BatchPlacement::Streamed { .. } => (run.host_kv_bytes / per_sequence).min(run.most),
    };
    let mut choices: Vec<usize> = (0..=STEPS).map(|i| most * i / STEPS).collect();
    choices.dedup();
    choices
}
