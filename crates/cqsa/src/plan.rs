//! The planner: resident or streamed, and the chunk sizes, from a memory budget
//! and a simple cost model. [`estimate`] runs it without allocating anything.
//!
//! Device bytes counted (`e` = bytes per element of the dtype):
//! - resident (forward and backward of one call, inputs included): q, k, v, o,
//!   grad_o, dq, dk, dv at `e` bytes, plus f32 log-sum-exp, delta and a f32 dq
//!   accumulator;
//! - streamed, per subproblem of `q_chunk` query rows and `kv_chunk` keys: the same
//!   quantities restricted to the chunks, plus f32 accumulators for the merged
//!   output, dq, dk and dv and the merge's temporaries, plus the next subproblem's
//!   chunks, which are copied while the current one computes, and the f32 results
//!   still being copied back to the host meanwhile.
//!
//! Predicted time, from this device's calibration ([`crate::calibrate`]) or,
//! without one, from built-in rates ([`Plan::rates`] says which). Resident:
//! forward FLOPs (`4 b hq nq nk d`, halved when causal; `4 b hq d` per visible
//! pair with a window) at the kernel's rate for the dtype, head dim, masking
//! and call length ([`Rates::kernel`]). Streamed: the dense subproblems at the
//! dense kernel's rate and the masked ones (a causal diagonal, a window's edge)
//! at the masked kernel's, both at the subproblems' length,
//! plus the device-side merges of partial outputs; on CUDA that compute, the
//! host-to-device copies, the device-to-host copies of the f32 results and the
//! host's landing of them overlap (the slowest sets the pace), and the
//! page-locking of the inputs, the allocation of page-locked staging for the
//! results, the first subproblem's copies and the last results' return and
//! landing add to it; on the CPU nothing overlaps. Results land in f32 (the
//! log-sum-exp) or converted to the inputs' f16/bf16 (the output). Staging
//! already kept from earlier calls ([`crate::staging`]) costs nothing. The
//! built-in rates: the tensor-core kernels at the H200's measured 300 TFLOP/s
//! (forward at D=128), the other kernels rough guesses, 25 GB/s each way,
//! 10 GB/s page-locking and page-locked allocation, 5 GB/s host landing;
//! uncalibrated figures rank plans and warn of long calls, they are not exact.
use std::fmt;
use std::path::PathBuf;

use candle_core::{bail, DType, Device, Result};

use crate::calibrate::{nominal_flops, Rates, RatesSource};
use crate::mask::Coverage;
use crate::{AttentionOpts, AttentionShape, Scores};

/// How a call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Let the planner choose (the default).
    #[default]
    Auto,
    /// One kernel launch over the whole problem, everything on the device.
    Resident,
    /// Query and key chunks moved to the device one subproblem at a time, partial
    /// results merged by their log-sum-exp.
    Streamed,
}

impl AttentionShape {
    fn elem(&self) -> usize {
        self.dtype.size_in_bytes()
    }

    /// Device bytes of a resident call, forward and backward, inputs included.
    pub fn resident_bytes(&self) -> usize {
        self.chunk_bytes(self.nq, self.nk, false)
    }

    /// Device bytes of one streamed subproblem of `cq` query rows and `ck` keys.
    fn chunk_bytes(&self, cq: usize, ck: usize, streamed: bool) -> usize {
        let e = self.elem();
        let (b, d) = (self.b, self.d);
        // q, o, grad_o, dq at e bytes; lse and delta f32; f32 dq accumulator.
        let mut per_q = b * self.hq * (d * (4 * e + 4) + 8);
        // k, v, dk, dv at e bytes.
        let mut per_k = b * self.hkv * d * 4 * e;
        if streamed {
            // f32 merged output, partial in f32, merge temporaries; f32 dk/dv; the
            // next subproblem's q, o, grad_o, lse and k, v (prefetched copies); and
            // the f32 results (o or dq, dk, dv) still being copied back while the
            // next subproblem computes.
            per_q += b * self.hq * (d * (16 + 3 * e) + 24);
            per_k += b * self.hkv * d * (16 + 2 * e);
        }
        cq * per_q + ck * per_k
    }
}

/// How much memory a call may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Bytes the call may allocate on the compute device.
    pub device_bytes: usize,
    /// Bytes the call may use in host memory (inputs kept there in streamed mode).
    pub host_bytes: usize,
}

impl Budget {
    /// A budget of `device_bytes` on the device and all available host memory.
    pub fn new(device_bytes: usize) -> Self {
        Self {
            device_bytes,
            host_bytes: host_available(),
        }
    }

    /// The free memory of `device` now (for the CPU, the available host memory),
    /// less a 10% reserve for other allocations.
    pub fn detect(device: &Device) -> Result<Self> {
        Ok(Self {
            device_bytes: Self::usable(Self::free_bytes(device)?),
            host_bytes: host_available(),
        })
    }

    /// Whether a resident call of `shape` fits the budget [`Budget::detect`]
    /// would give (`inputs` bytes already on `device` counted as available),
    /// asking first only CUDA's pool, which answers in a microsecond: the
    /// planner's resident choice without the driver's memory query, host
    /// memory or the calibration, which only a streamed plan needs.
    pub(crate) fn fits_resident(
        device: &Device,
        shape: &AttentionShape,
        inputs: usize,
    ) -> Result<bool> {
        shape.check()?;
        let need = shape.resident_bytes();
        if device.is_cuda() {
            let idle = streamer_device::pooled_idle_bytes(device).unwrap_or(0);
            if Self::usable(idle) + inputs >= need {
                return Ok(true);
            }
        }
        Ok(Self::usable(Self::free_bytes(device)?) + inputs >= need)
    }

    /// `free` less the 10% reserve.
    fn usable(free: usize) -> usize {
        free / 10 * 9
    }

    /// The bytes `device` could allocate now.
    fn free_bytes(device: &Device) -> Result<usize> {
        Ok(match device {
            Device::Cpu => host_available(),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => {
                let (free, _total) = streamer_device::cuda::memory_info(c)?;
                // Memory CUDA's default pool keeps for reuse (Candle allocates
                // from it) but no tensor uses: `cuMemGetInfo` counts it as taken,
                // yet our allocations get it. Zero when the query fails (an older
                // driver): the budget is then only smaller.
                free + streamer_device::pooled_idle_bytes(device).unwrap_or(0)
            }
            #[allow(unreachable_patterns)]
            other => bail!(
                "cqsa: cannot detect memory of device {:?}",
                other.location()
            ),
        })
    }
}

/// `MemAvailable` from `/proc/meminfo`, or a large default where that is missing.
fn host_available() -> usize {
    streamer_device::host_available_memory().unwrap_or(64 << 30)
}

/// What the planner decided for one call.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Resident or streamed (never `Auto`).
    pub mode: Mode,
    /// Query rows per subproblem (`nq` when resident).
    pub q_chunk: usize,
    /// Keys per subproblem (`nk` when resident).
    pub kv_chunk: usize,
    /// Subproblems of the forward (causal pairs that see nothing are skipped).
    pub subproblems: usize,
    /// Predicted peak device bytes.
    pub device_bytes: usize,
    /// Device bytes a resident run would need.
    pub resident_bytes: usize,
    /// Host bytes a streamed forward holds: Q/K/V, the output (in its own
    /// dtype), the log-sum-exp and, on CUDA, page-locked staging for results;
    /// 0 when resident.
    pub host_bytes: usize,
    /// Host bytes a streamed backward adds: the output's gradient, dQ/dK/dV
    /// and dQ's f32 sum; 0 when resident.
    pub backward_host_bytes: usize,
    /// Predicted forward seconds (see the module docs for the time model).
    pub forward_seconds: f64,
    /// Where the rates behind `forward_seconds` came from: a calibration file
    /// ([`crate::calibrate()`]) or the built-in defaults, with the reason.
    pub rates: RatesSource,
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        write!(
            f,
            "{:?}: q_chunk {} kv_chunk {}, {} subproblems, device {:.3} GiB (resident would need {:.3} GiB), host {:.3} GiB (+{:.3} GiB for a backward), forward ~{:.3} s (rates: {})",
            self.mode,
            self.q_chunk,
            self.kv_chunk,
            self.subproblems,
            gib(self.device_bytes),
            gib(self.resident_bytes),
            gib(self.host_bytes),
            gib(self.backward_host_bytes),
            self.forward_seconds,
            self.rates
        )
    }
}

/// The chunk pairs of a streamed forward and their work.
#[derive(Debug, Default)]
struct Pairs {
    /// Pairs that see at least one key (the subproblems).
    subproblems: usize,
    /// Visible (query, key) pairs in subproblems that see every key of their
    /// chunk (the dense kernel runs them).
    dense: u64,
    /// Visible (query, key) pairs in subproblems that see part of their chunk
    /// (the masked kernel runs them).
    masked: u64,
    /// Query rows merged with an earlier partial result, summed over subproblems.
    merged_rows: u64,
    /// Visible pairs of the first query chunk's dense and masked subproblems:
    /// the device's work queued when its results need their staging.
    first_dense: u64,
    first_masked: u64,
    /// Whether a query chunk after the first has a single subproblem: its result
    /// is then copied back before the previous chunk's has landed, and a streamed
    /// call stages two chunks' results at once instead of one.
    double_staged: bool,
}

/// The subproblems of chunks `cq` x `ck` and their work.
fn count_pairs(s: &AttentionShape, sc: &Scores, cq: usize, ck: usize) -> Pairs {
    let mut p = Pairs::default();
    for i0 in (0..s.nq).step_by(cq) {
        let i1 = (i0 + cq).min(s.nq);
        let mut seen = 0u64;
        for j0 in (0..s.nk).step_by(ck) {
            let j1 = (j0 + ck).min(s.nk);
            let band = sc.shifted(i0, j0);
            match band.coverage(i1 - i0, j1 - j0) {
                Coverage::Nothing => continue,
                Coverage::Everything => p.dense += ((i1 - i0) * (j1 - j0)) as u64,
                Coverage::Part => p.masked += band.visible_pairs(i1 - i0, j1 - j0),
            }
            p.subproblems += 1;
            seen += 1;
        }
        if i0 == 0 {
            (p.first_dense, p.first_masked) = (p.dense, p.masked);
        }
        p.double_staged |= i0 > 0 && seen == 1;
        p.merged_rows += seen.saturating_sub(1) * (i1 - i0) as u64;
    }
    p
}

/// Forward FLOPs of the call: [`AttentionShape::forward_flops`] for unmasked and
/// causal calls, `4 b hq d` per visible (query, key) pair with a window.
fn work_flops(s: &AttentionShape, sc: &Scores) -> f64 {
    if sc.lo.is_none() && (sc.hi.is_none() || s.causal) {
        s.forward_flops()
    } else {
        4.0 * (s.b * s.hq * s.d) as f64 * sc.visible_pairs(s.nq, s.nk) as f64
    }
}

/// The band of a call of shape `s` without options: causal or nothing.
fn shape_scores(s: &AttentionShape) -> Scores {
    Scores {
        hi: s.causal.then_some(s.nk as i64 - s.nq as i64),
        ..Scores::dense(1.0)
    }
}

/// The rates of one plan's time model: a calibration's, or the defaults.
pub(crate) struct Model {
    cuda: bool,
    /// The CUDA device's ordinal, whose cached staging ([`crate::staging`]) a
    /// streamed call would reuse.
    ordinal: usize,
    rates: Rates,
    /// The calibration file, when the rates are from one.
    file: Option<PathBuf>,
    /// Why the defaults are used, when they are.
    reason: String,
}

impl Model {
    /// The built-in rates (see the module docs), for `reason`.
    fn defaults(cuda: bool, reason: String) -> Self {
        let rates = Rates {
            kernels: Vec::new(),
            h2d_bytes_per_s: 25e9,
            d2h_bytes_per_s: 25e9,
            pin_bytes_per_s: cuda.then_some(10e9),
            pinned_alloc_bytes_per_s: cuda.then_some(10e9),
            device_merge_bytes_per_s: if cuda { 500e9 } else { 2e9 },
            host_merge_bytes_per_s: 5e9,
            host_land_converted_bytes_per_s: 5e9,
        };
        Self {
            cuda,
            ordinal: 0,
            rates,
            file: None,
            reason,
        }
    }

    /// The rates for the device named `device` (a CUDA one when `cuda`): its
    /// cached calibration, or the defaults and why.
    fn named(device: std::result::Result<String, String>, cuda: bool) -> Self {
        match device.and_then(|d| crate::calibrate::cached(&d)) {
            Ok((cal, path)) => Self {
                cuda,
                ordinal: 0,
                rates: cal.rates,
                file: Some(path),
                reason: String::new(),
            },
            Err(why) => Self::defaults(cuda, why),
        }
    }

    /// The rates of the compute device `dev`.
    pub(crate) fn for_device(dev: &Device) -> Self {
        let name = crate::calibrate::device_name(dev).map_err(|e| e.to_string());
        let ordinal = match dev.location() {
            candle_core::DeviceLocation::Cuda { gpu_id } => gpu_id,
            _ => 0,
        };
        Self {
            ordinal,
            ..Self::named(name, dev.is_cuda())
        }
    }

    /// The rates [`estimate`] assumes: CUDA device 0 when built with the `cuda`
    /// feature, the CPU otherwise.
    fn for_build() -> Self {
        #[cfg(feature = "cuda")]
        {
            static NAME: std::sync::OnceLock<std::result::Result<String, String>> =
                std::sync::OnceLock::new();
            let name = NAME.get_or_init(|| {
                let ctx = cudarc::driver::CudaContext::new(0)
                    .map_err(|e| format!("no CUDA device 0 to key the calibration by ({e})"))?;
                ctx.name()
                    .map_err(|e| format!("cannot name CUDA device 0 ({e})"))
            });
            Self::named(name.clone(), true)
        }
        #[cfg(not(feature = "cuda"))]
        Self::for_device(&Device::Cpu)
    }

    /// Forward FLOP/s of the kernel for shape `s` (`masked`: with a causal or
    /// window band) on calls of `nq` queries and `nk` keys, and whether it was
    /// calibrated.
    fn kernel(&self, s: &AttentionShape, masked: bool, nq: usize, nk: usize) -> (f64, bool) {
        let tokens = ((nq * nk) as f64).sqrt();
        match self.rates.kernel(s.dtype, s.d, masked, tokens) {
            Some(r) => (r, true),
            None => (nominal_flops(s, self.cuda), false),
        }
    }

    /// Where the rates of a plan for shape `s` come from, when it runs the
    /// kernels for the maskings in `kinds` (`true`: masked).
    fn source(&self, s: &AttentionShape, kinds: &[bool]) -> RatesSource {
        let missing = kinds.iter().find(|&&m| !self.kernel(s, m, s.nq, s.nk).1);
        match (&self.file, missing) {
            (Some(p), None) => RatesSource::Calibrated(p.clone()),
            (Some(p), Some(&masked)) => RatesSource::CalibratedExceptKernel {
                path: p.clone(),
                kernel: format!(
                    "{} d={} {}",
                    s.dtype.as_str(),
                    s.d,
                    if masked { "masked" } else { "dense" }
                ),
            },
            (None, _) => RatesSource::Defaults(self.reason.clone()),
        }
    }

    /// Predicted seconds of a streamed forward with chunks `cq` x `ck` whose
    /// subproblems are `p` (see the module docs).
    fn streamed_seconds(&self, s: &AttentionShape, p: &Pairs, cq: usize, ck: usize) -> f64 {
        let r = &self.rates;
        let (e, b, d) = (s.elem() as f64, s.b as f64, s.d as f64);
        let per_pair = 4.0 * b * s.hq as f64 * d;
        // Each subproblem is a kernel call of (up to) cq queries and ck keys.
        let (cq, ck) = (cq.min(s.nq), ck.min(s.nk));
        let compute = p.dense as f64 * per_pair / self.kernel(s, false, cq, ck).0
            + p.masked as f64 * per_pair / self.kernel(s, true, cq, ck).0
            + p.merged_rows as f64 * b * s.hq as f64 * d * 4.0 / r.device_merge_bytes_per_s;
        // Every subproblem moves its key chunk; every query chunk moves once.
        let h2d = (p.subproblems * ck * s.b * s.hkv * s.d * 2) as f64 * e
            + (s.nq * s.b * s.hq * s.d) as f64 * e;
        // The merged output and log-sum-exp come back once, in f32; the output
        // lands converted to the dtype (f16, bf16), the log-sum-exp as it is.
        let results = (s.nq * s.b * s.hq * (s.d + 1) * 4) as f64;
        let land = |rows: usize| {
            let (out, lse) = (
                (rows * s.b * s.hq * s.d * 4) as f64,
                (rows * s.b * s.hq * 4) as f64,
            );
            let out_rate = if s.dtype == DType::F32 {
                r.host_merge_bytes_per_s
            } else {
                r.host_land_converted_bytes_per_s
            };
            out / out_rate + lse / r.host_merge_bytes_per_s
        };
        let (t_h2d, t_d2h, t_land) = (
            h2d / r.h2d_bytes_per_s,
            results / r.d2h_bytes_per_s,
            land(s.nq),
        );
        if !self.cuda {
            // Nothing overlaps on the CPU; each input chunk is copied twice
            // (gathered, then made a tensor).
            return compute + 2.0 * t_h2d + t_d2h + t_land;
        }
        let inputs = ((s.nq * s.hq + 2 * s.nk * s.hkv) * s.b * s.d) as f64 * e;
        let pin = r.pin_bytes_per_s.map_or(0.0, |rate| inputs / rate);
        let staging = self.staging_seconds(s, p, (cq, ck));
        // Copies, compute and the host's landing overlap one subproblem apart:
        // the slowest sets the pace; the first inputs and the last results
        // are not hidden.
        let steady = compute.max(t_h2d).max(t_d2h).max(t_land);
        let first = ((cq * s.hq + 2 * ck * s.hkv) * s.b * s.d) as f64 * e;
        let last = (cq * s.b * s.hq * (s.d + 1) * 4) as f64;
        let ends = first / r.h2d_bytes_per_s + last / r.d2h_bytes_per_s + land(cq);
        pin + staging + steady + ends
    }

    /// Seconds a streamed forward waits for page-locked staging: a query
    /// chunk's f32 output and log-sum-exp (two chunks' when `double_staged`)
    /// that the cache ([`crate::staging`]) cannot serve, allocated when the first
    /// results come back while the device computes the first query chunk,
    /// whose time hides as much.
    fn staging_seconds(&self, s: &AttentionShape, p: &Pairs, (cq, ck): (usize, usize)) -> f64 {
        let Some(rate) = self.rates.pinned_alloc_bytes_per_s else {
            return 0.0;
        };
        let (out, lse) = (cq * s.b * s.hq * s.d, cq * s.b * s.hq);
        let lens: Vec<usize> = [out, lse].repeat(1 + p.double_staged as usize);
        let alloc = crate::staging::unserved_bytes(self.ordinal, &lens) as f64 / rate;
        let per_pair = 4.0 * (s.b * s.hq * s.d) as f64;
        let first = p.first_dense as f64 * per_pair / self.kernel(s, false, cq, ck).0
            + p.first_masked as f64 * per_pair / self.kernel(s, true, cq, ck).0;
        (alloc - first).max(0.0)
    }
}

fn streamed_with(s: &AttentionShape, sc: &Scores, cq: usize, ck: usize, m: &Model) -> Plan {
    let cq = cq.clamp(1, s.nq);
    let ck = ck.clamp(1, s.nk);
    let pairs = count_pairs(s, sc, cq, ck);
    let kinds: Vec<bool> = [(pairs.dense > 0, false), (pairs.masked > 0, true)]
        .into_iter()
        .filter_map(|(used, masked)| used.then_some(masked))
        .collect();
    let e = s.elem();
    let (q_el, kv_el) = (s.b * s.d * s.hq * s.nq, s.b * s.d * s.hkv * s.nk);
    let forward = (2 * q_el + 2 * kv_el) * e + s.b * s.hq * s.nq * 4;
    // The output's gradient, dq, dk, dv in the dtype, and dq's f32 sum.
    let backward = (2 * q_el + 2 * kv_el) * e + q_el * 4;
    // Page-locked staging for results on their way back: two of each kind.
    let staging = if m.cuda {
        2 * 4 * s.b * s.d * (s.hq * cq + 2 * s.hkv * ck)
    } else {
        0
    };
    Plan {
        mode: Mode::Streamed,
        q_chunk: cq,
        kv_chunk: ck,
        subproblems: pairs.subproblems,
        device_bytes: s.chunk_bytes(cq, ck, true),
        resident_bytes: s.resident_bytes(),
        host_bytes: forward + staging,
        backward_host_bytes: backward,
        forward_seconds: m.streamed_seconds(s, &pairs, cq, ck),
        rates: m.source(s, &kinds),
    }
}

/// Picks the mode and chunks of a call of shape `s` within `budget`. Resident when
/// it fits; otherwise the largest chunks that fit, halving the larger of the two
/// (keys first on ties) from the full sizes. Errors with the sizes when even
/// 16-row chunks do not fit, or when the host cannot hold the streamed forward
/// (and, with `backward`, the backward after it).
fn choose(
    s: &AttentionShape,
    sc: &Scores,
    budget: &Budget,
    model: &Model,
    (opts, backward): (Option<&AttentionOpts>, bool),
) -> Result<Plan> {
    s.check()?;
    let forced = opts
        .is_some_and(|o| o.mode == Mode::Streamed || o.q_chunk.is_some() || o.kv_chunk.is_some());
    if !forced && s.resident_bytes() <= budget.device_bytes {
        return Ok(resident_plan(s, sc, model));
    }
    let fixed = (opts.and_then(|o| o.q_chunk), opts.and_then(|o| o.kv_chunk));
    let (cq, ck) = fit_chunks(s, budget, fixed)?;
    // Round chunks down to a multiple of 64 (a kernel tile) when large enough.
    let round = |c: usize| if c > 64 { c / 64 * 64 } else { c };
    let plan = streamed_with(s, sc, round(cq), round(ck), model);
    check_host_fits(&plan, budget, backward)?;
    Ok(plan)
}

/// The plan of a call of shape `s` that runs whole on the device: one
/// subproblem, nothing held on the host.
fn resident_plan(s: &AttentionShape, sc: &Scores, model: &Model) -> Plan {
    let resident = s.resident_bytes();
    let masked = sc.lo.is_some() || sc.hi.is_some();
    Plan {
        mode: Mode::Resident,
        q_chunk: s.nq,
        kv_chunk: s.nk,
        subproblems: 1,
        device_bytes: resident,
        resident_bytes: resident,
        host_bytes: 0,
        backward_host_bytes: 0,
        forward_seconds: work_flops(s, sc) / model.kernel(s, masked, s.nq, s.nk).0,
        rates: model.source(s, &[masked]),
    }
}

/// The streamed chunks `(q, kv)` of a call of shape `s` whose subproblem fits
/// `budget`'s device bytes: the `fixed` sizes where given, else the largest
/// found by halving the larger of the two (keys first on ties) from the full
/// sizes, down to 16 rows. Errors with the sizes when even that does not fit.
fn fit_chunks(
    s: &AttentionShape,
    budget: &Budget,
    (fixed_q, fixed_k): (Option<usize>, Option<usize>),
) -> Result<(usize, usize)> {
    let resident = s.resident_bytes();
    let (mut cq, mut ck) = (s.nq, s.nk);
    if let Some(c) = fixed_q {
        cq = c;
    }
    if let Some(c) = fixed_k {
        ck = c;
    }
    const MIN: usize = 16;
    loop {
        if s.chunk_bytes(cq.min(s.nq), ck.min(s.nk), true) <= budget.device_bytes
            || (fixed_q.is_some() && fixed_k.is_some())
        {
            return Ok((cq, ck));
        }
        let can_q = fixed_q.is_none() && cq > MIN;
        let can_k = fixed_k.is_none() && ck > MIN;
        if can_k && (ck >= cq || !can_q) {
            ck = ck.div_ceil(2);
        } else if can_q {
            cq = cq.div_ceil(2);
        } else {
            let needed = s.chunk_bytes(cq, ck, true);
            let what = format!(
                "cqsa: nothing fits: a resident call needs {resident} device bytes and the smallest \
                 streamed subproblem ({cq} query rows x {ck} keys) needs {needed} bytes, the budget \
                 is {} bytes (shape b={} hq={} hkv={} nq={} nk={} d={} {:?})",
                budget.device_bytes,
                s.b,
                s.hq,
                s.hkv,
                s.nq,
                s.nk,
                s.d,
                s.dtype
            );
            return Err(streamer_device::Error::OutOfMemory {
                needed,
                free: budget.device_bytes,
                what,
            }
            .into());
        }
    }
}

/// Fails when the host cannot hold `plan`'s streamed forward (and, with
/// `backward`, the backward after it) within `budget`'s host bytes.
fn check_host_fits(plan: &Plan, budget: &Budget, backward: bool) -> Result<()> {
    let host = plan.host_bytes
        + if backward {
            plan.backward_host_bytes
        } else {
            0
        };
    if host > budget.host_bytes {
        let what = format!(
            "cqsa: nothing fits: streamed mode holds {host} host bytes ({} for the forward{}), \
             the host budget is {} bytes",
            plan.host_bytes,
            if backward {
                format!(", {} more for the backward", plan.backward_host_bytes)
            } else {
                String::new()
            },
            budget.host_bytes
        );
        return Err(streamer_device::Error::OutOfMemory {
            needed: host,
            free: budget.host_bytes,
            what,
        }
        .into());
    }
    Ok(())
}

/// The plan of a call of shape `s` under `budget`: mode, chunk sizes, predicted
/// device and host bytes and forward time. Allocates nothing. Errors with the
/// sizes when nothing fits. The time model is that of CUDA device 0 when the
/// crate is built with the `cuda` feature, of the CPU otherwise, with that
/// device's calibration ([`crate::calibrate()`]) when its cache file exists and
/// is valid, and the built-in rates otherwise; [`Plan::rates`] says which and
/// why. The host check is the forward's ([`Plan::host_bytes`]); a call whose
/// inputs a gradient can reach also holds [`Plan::backward_host_bytes`], which
/// [`crate::attention`] checks too.
pub fn estimate(s: &AttentionShape, budget: &Budget) -> Result<Plan> {
    choose(
        s,
        &shape_scores(s),
        budget,
        &Model::for_build(),
        (None, false),
    )
}

/// [`estimate`] for a call with the options `opts` (masks, mode, chunk
/// overrides): a sliding window counts only the chunk pairs it sees and
/// predicts the time of its visible (query, key) pairs. Errors on bad options
/// as [`crate::attention`] does.
pub fn estimate_with(s: &AttentionShape, opts: &AttentionOpts, budget: &Budget) -> Result<Plan> {
    s.check()?;
    let scores = Scores::of(opts, s)?;
    choose(s, &scores, budget, &Model::for_build(), (Some(opts), false))
}

/// The plan [`crate::attention`] uses for `opts` on its compute device `exec`;
/// `backward`: whether a gradient of the inputs may be asked for.
pub(crate) fn plan(
    s: &AttentionShape,
    sc: &Scores,
    budget: &Budget,
    (opts, backward): (&AttentionOpts, bool),
    exec: &Device,
) -> Result<Plan> {
    choose(
        s,
        sc,
        budget,
        &Model::for_device(exec),
        (Some(opts), backward),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(n: usize) -> AttentionShape {
        AttentionShape {
            b: 1,
            hq: 2,
            hkv: 2,
            nq: n,
            nk: n,
            d: 64,
            dtype: DType::F32,
            causal: true,
        }
    }

    /// The default mode's fast check says resident when the planner would
    /// under the budget `Budget::detect` gives, and not for a call of 2^30
    /// tokens (5 TB resident), which the planner's resident branch refuses.
    #[test]
    fn fits_resident_agrees_with_the_planner() -> Result<()> {
        let dev = Device::Cpu;
        let small = shape(256);
        let plan = choose(
            &small,
            &shape_scores(&small),
            &Budget::detect(&dev)?,
            &Model::for_device(&dev),
            (None, false),
        )?;
        assert_eq!(plan.mode, Mode::Resident);
        assert!(Budget::fits_resident(&dev, &small, 0)?);
        let huge = shape(1 << 30);
        assert!(huge.resident_bytes() > Budget::detect(&dev)?.device_bytes);
        assert!(!Budget::fits_resident(&dev, &huge, 0)?);
        // Inputs already on the device count as available.
        assert!(Budget::fits_resident(&dev, &huge, huge.resident_bytes())?);
        Ok(())
    }
}
