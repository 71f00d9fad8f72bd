//! `calibrate`: measures this device's attention rates and keeps them in a
//! cache file that the planner ([`crate::estimate`]) reads.
//!
//! Measured, in about a minute on a GPU (seconds on the CPU): the resident
//! forward kernel's sustained FLOP/s per dtype, head dim and causality, at a
//! short and a long call ([`Rates::kernel`] interpolates between them);
//! host-to-device and device-to-host bandwidth from page-locked memory; the
//! rates of page-locking host memory in place (what a streamed call pays
//! first) and of allocating page-locked staging (what its first results pay);
//! the device-side merge of partial outputs by their log-sum-exp; and the
//! host's landing of f32 results into fresh buffers, as they are and converted
//! to bf16.
//!
//! The cache file is JSON, one per device and kernel version:
//! `<dir>/cqsa-<device>-<kernel version>.json`, `<dir>` being
//! `$CQSA_CALIBRATION_DIR`, else `$XDG_CACHE_HOME/candle-streamer`, else
//! `$HOME/.cache/candle-streamer`. The device is the GPU's name (or, for the
//! CPU, its model and Rayon's thread count); the kernel version is the crate
//! version and a hash of the kernel sources ([`KERNEL_VERSION`]). A file that
//! does not parse, or was measured on another device, with other kernels or in
//! another format, is refused by [`Calibration::load`] with the reason; the
//! planner then uses its defaults and says why in [`crate::Plan::rates`].
//!
//! ```
//! use candle_core::Device;
//! use cqsa::calibrate::{calibrate, CalibrateOptions, Calibration};
//!
//! let dev = Device::Cpu;
//! let cal = calibrate(&dev, &CalibrateOptions::quick())?;
//! let path = std::env::temp_dir().join(format!("cqsa-doc-{}.json", std::process::id()));
//! cal.save(&path)?;
//! let back = Calibration::load(&path, &cqsa::calibrate::device_name(&dev)?)?;
//! assert_eq!(back, cal);
//! # std::fs::remove_file(&path).ok();
//! # Ok::<(), candle_core::Error>(())
//! ```
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Instant, SystemTime};

use candle_core::{bail, DType, Device, Result, Tensor};
use serde::{Deserialize, Serialize};

use crate::timing::time_median;
use crate::{attention_forward_with, AttentionShape, Scores};

/// The cache file format this build reads and writes.
pub const FORMAT: u32 = 2;

/// The crate version and a hash of the sources that decide the kernels' speed
/// (set by `build.rs`); a calibration made with other kernels is refused.
pub const KERNEL_VERSION: &str = env!("CQSA_KERNEL_VERSION");

/// The environment variable that overrides the cache directory.
pub const CACHE_DIR_ENV: &str = "CQSA_CALIBRATION_DIR";

/// The measured forward rate of the resident kernel for one kind of call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KernelRate {
    /// `"f32"`, `"f16"` or `"bf16"`.
    pub dtype: String,
    /// Head dimension.
    pub head_dim: usize,
    /// Causal (the lower triangle) or dense.
    pub causal: bool,
    /// Sequence length it was measured at (queries = keys).
    pub tokens: usize,
    /// Forward FLOP/s (`4 b h n^2 d`, halved when causal).
    pub forward_flops_per_s: f64,
}

/// What the planner's time model needs (all rates per second).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rates {
    /// One entry per measured (dtype, head dim, causality).
    pub kernels: Vec<KernelRate>,
    /// Bytes per second host to device (page-locked; on the CPU a memory copy).
    pub h2d_bytes_per_s: f64,
    /// Bytes per second device to host (page-locked; on the CPU a memory copy).
    pub d2h_bytes_per_s: f64,
    /// Bytes per second of host memory page-locked in place (and unlocked);
    /// `None` where nothing is page-locked (the CPU).
    pub pin_bytes_per_s: Option<f64>,
    /// Bytes per second of allocating page-locked staging memory, which a
    /// streamed call's results come back through (the free is not timed: the
    /// buffers are kept between calls, see [`crate::staging`]); `None` where
    /// nothing is page-locked (the CPU). New in format 2.
    pub pinned_alloc_bytes_per_s: Option<f64>,
    /// Output bytes (f32) per second of merging two partial results by their
    /// log-sum-exp on the compute device, the partial's conversion included.
    pub device_merge_bytes_per_s: f64,
    /// Bytes (f32) per second of landing results in fresh f32 host buffers
    /// (first touch of their pages included), as a streamed call lands its
    /// log-sum-exp and gradients.
    pub host_merge_bytes_per_s: f64,
    /// f32 bytes per second of landing results converted to bf16 in fresh host
    /// buffers, as a streamed forward lands its f16 or bf16 output. New in
    /// format 2 (format 1 timed a separate conversion pass, which the forward
    /// has not made since its output lands converted).
    pub host_land_converted_bytes_per_s: f64,
}

impl Rates {
    /// The forward FLOP/s of the kernel for `dtype`, head dim `d` and causality
    /// at calls of about `tokens` queries and keys: the measured rate at the
    /// nearest measured length, interpolated linearly in the logarithm of the
    /// length between two (a kernel runs faster on longer calls, whose blocks
    /// amortise their start and end over more tiles), the nearest one's outside
    /// them. `None` when no length of that kind was measured.
    pub fn kernel(&self, dtype: DType, d: usize, causal: bool, tokens: f64) -> Option<f64> {
        let mut at: Vec<(f64, f64)> = self
            .kernels
            .iter()
            .filter(|k| k.dtype == dtype.as_str() && k.head_dim == d && k.causal == causal)
            .map(|k| ((k.tokens.max(1) as f64).ln(), k.forward_flops_per_s))
            .collect();
        at.sort_by(|a, b| a.0.total_cmp(&b.0));
        let x = tokens.max(1.0).ln();
        let (first, last) = (at.first()?, at.last()?);
        if x <= first.0 {
            return Some(first.1);
        }
        if x >= last.0 {
            return Some(last.1);
        }
        let i = at.partition_point(|p| p.0 <= x);
        let ((x0, r0), (x1, r1)) = (at[i - 1], at[i]);
        Some(r0 + (r1 - r0) * (x - x0) / (x1 - x0))
    }

    /// Every rate, named, for validation and display.
    fn named(&self) -> Vec<(String, f64)> {
        let mut v = vec![
            ("h2d_bytes_per_s".to_string(), self.h2d_bytes_per_s),
            ("d2h_bytes_per_s".to_string(), self.d2h_bytes_per_s),
            (
                "device_merge_bytes_per_s".to_string(),
                self.device_merge_bytes_per_s,
            ),
            (
                "host_merge_bytes_per_s".to_string(),
                self.host_merge_bytes_per_s,
            ),
            (
                "host_land_converted_bytes_per_s".to_string(),
                self.host_land_converted_bytes_per_s,
            ),
        ];
        if let Some(p) = self.pin_bytes_per_s {
            v.push(("pin_bytes_per_s".to_string(), p));
        }
        if let Some(p) = self.pinned_alloc_bytes_per_s {
            v.push(("pinned_alloc_bytes_per_s".to_string(), p));
        }
        for k in &self.kernels {
            let name = format!(
                "kernel {} d={} {} N={}",
                k.dtype,
                k.head_dim,
                if k.causal { "causal" } else { "dense" },
                k.tokens
            );
            v.push((name, k.forward_flops_per_s));
        }
        v
    }
}

/// A calibration: the rates measured on one device with one kernel version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// [`FORMAT`] of the file.
    pub format: u32,
    /// [`device_name`] of the device measured.
    pub device: String,
    /// [`KERNEL_VERSION`] of the build that measured.
    pub kernel_version: String,
    /// Seconds since the Unix epoch when it was measured.
    pub created_unix: u64,
    /// Seconds the measurement took.
    pub seconds: f64,
    /// The rates.
    pub rates: Rates,
}

/// Where the planner's rates came from.
#[derive(Debug, Clone, PartialEq)]
pub enum RatesSource {
    /// Every rate from this calibration file.
    Calibrated(PathBuf),
    /// The calibration file's transfer and host rates, but the built-in kernel
    /// rate: the file has none for this kind of call (named).
    CalibratedExceptKernel {
        /// The calibration file.
        path: PathBuf,
        /// The kind of call it has no rate for.
        kernel: String,
    },
    /// The built-in nominal rates, and why no calibration was used.
    Defaults(String),
}

impl std::fmt::Display for RatesSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Calibrated(p) => write!(f, "calibrated ({})", p.display()),
            Self::CalibratedExceptKernel { path, kernel } => write!(
                f,
                "calibrated ({}), built-in kernel rate: none measured for {kernel}",
                path.display()
            ),
            Self::Defaults(why) => write!(f, "built-in defaults: {why}"),
        }
    }
}

/// What [`calibrate`] measures, and at which sizes.
#[derive(Debug, Clone)]
pub struct CalibrateOptions {
    /// Dtypes of the kernels measured.
    pub dtypes: Vec<DType>,
    /// Head dims of the kernels measured.
    pub head_dims: Vec<usize>,
    /// Heads (batch 1) of the kernel calls.
    pub heads: usize,
    /// The longest sequence a kernel is measured at; each kind of call runs at
    /// the lengths whose calls take about each of `call_seconds` (the first at
    /// the default rate, the others at the rate measured before), up to this,
    /// rounded down to a multiple of 64 (at least 64).
    pub max_tokens: usize,
    /// Target seconds of the timed kernel calls (see `max_tokens`): one length
    /// per entry, so that the planner knows the rate of short calls and of the
    /// long subproblems of a streamed call (see [`Rates::kernel`]).
    pub call_seconds: Vec<f64>,
    /// Seconds each kernel runs back to back before it is timed. A GPU under
    /// sustained load lowers its clock to its power limit (the H200 by 3-8 %
    /// within half a second), so a long out-of-core call runs at the sustained
    /// rate, not at a cold burst's.
    pub sustain_seconds: f64,
    /// Bytes of each timed copy, page-locking, merge and landing.
    pub bytes: usize,
    /// Timed repeats of each measurement (the median counts), after one warm-up.
    pub reps: usize,
    /// Print each rate to stderr as it is measured.
    pub verbose: bool,
}

impl CalibrateOptions {
    /// The full calibration for `dev`: on CUDA bf16, f16 and f32 at head dims
    /// 64, 128 and 256, 16 heads, each kernel at two lengths (calls of about
    /// 0.02 s and 0.25 s, up to 131,072 tokens: the 4M-token plan's
    /// subproblems are 131,072 x 131,072), timed after half a second of load,
    /// 256 MiB copies, 5 repeats (about a minute); on the CPU f32 and bf16 at
    /// head dims 64 and 128, 2 heads.
    pub fn for_device(dev: &Device) -> Self {
        if dev.is_cuda() {
            Self {
                dtypes: vec![DType::BF16, DType::F16, DType::F32],
                head_dims: vec![64, 128, 256],
                heads: 16,
                max_tokens: 131072,
                call_seconds: vec![0.02, 0.25],
                sustain_seconds: 0.5,
                bytes: 256 << 20,
                reps: 5,
                verbose: false,
            }
        } else {
            Self {
                dtypes: vec![DType::F32, DType::BF16],
                head_dims: vec![64, 128],
                heads: 2,
                max_tokens: 4096,
                call_seconds: vec![0.05],
                sustain_seconds: 0.0,
                bytes: 64 << 20,
                reps: 3,
                verbose: false,
            }
        }
    }

    /// Tiny sizes (f32, head dim 16, 64 tokens, 1 MiB): for tests; the rates
    /// are real measurements, only noisy.
    pub fn quick() -> Self {
        Self {
            dtypes: vec![DType::F32],
            head_dims: vec![16],
            heads: 1,
            max_tokens: 64,
            call_seconds: vec![0.0],
            sustain_seconds: 0.0,
            bytes: 1 << 20,
            reps: 1,
            verbose: false,
        }
    }
}

/// The name a calibration is keyed by: the GPU's name for a CUDA device; for
/// the CPU its model (from `/proc/cpuinfo`) and Rayon's thread count, which
/// the CPU kernels' speed depends on. Names are read once per device (the
/// planner asks for every call).
pub fn device_name(dev: &Device) -> Result<String> {
    match dev {
        Device::Cpu => Ok(format!(
            "CPU {}, {} threads",
            cpu_model(),
            rayon::current_num_threads()
        )),
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            static NAMES: OnceLock<Mutex<HashMap<usize, String>>> = OnceLock::new();
            let ctx = d.cuda_stream().context().clone();
            let ordinal = ctx.ordinal();
            let names = NAMES.get_or_init(|| Mutex::new(HashMap::new()));
            let mut names = names
                .lock()
                .map_err(|_| candle_core::Error::Msg("cqsa: device names poisoned".into()))?;
            if let Some(n) = names.get(&ordinal) {
                return Ok(n.clone());
            }
            let name = ctx
                .name()
                .map_err(|e| candle_core::Error::Cuda(Box::new(e)))?;
            names.insert(ordinal, name.clone());
            Ok(name)
        }
        #[allow(unreachable_patterns)]
        other => bail!(
            "cqsa: cannot calibrate device {:?}: only the CPU and CUDA are supported",
            other.location()
        ),
    }
}

fn cpu_model() -> &'static str {
    static MODEL: OnceLock<String> = OnceLock::new();
    MODEL.get_or_init(|| {
        std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|t| {
                t.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|m| m.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".to_string())
    })
}

/// The directory of the cache files: `$CQSA_CALIBRATION_DIR`, else
/// `$XDG_CACHE_HOME/candle-streamer`, else `$HOME/.cache/candle-streamer`.
pub fn cache_dir() -> Result<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(d) = var(CACHE_DIR_ENV) {
        return Ok(PathBuf::from(d));
    }
    if let Some(d) = var("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(d).join("candle-streamer"));
    }
    if let Some(h) = var("HOME") {
        return Ok(PathBuf::from(h).join(".cache").join("candle-streamer"));
    }
    bail!("cqsa: no cache directory: set {CACHE_DIR_ENV}, XDG_CACHE_HOME or HOME")
}

/// The cache file of the device named `device` with this build's kernels.
pub fn cache_path_for(device: &str) -> Result<PathBuf> {
    let slug: String = device
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    let slug = slug
        .split('-')
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("-");
    Ok(cache_dir()?.join(format!("cqsa-{slug}-{KERNEL_VERSION}.json")))
}

/// The cache file of `dev` with this build's kernels.
pub fn cache_path(dev: &Device) -> Result<PathBuf> {
    cache_path_for(&device_name(dev)?)
}

impl Calibration {
    /// Writes the calibration to `path` (atomically; the folder is created).
    pub fn save(&self, path: &Path) -> Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| {
                candle_core::Error::Msg(format!("cqsa: cannot create {}: {e}", dir.display()))
            })?;
        }
        let text = serde_json::to_string_pretty(self).map_err(candle_core::Error::wrap)?;
        streamer_device::replace_atomic(path, |tmp| {
            std::fs::write(tmp, text.as_bytes()).map_err(candle_core::Error::wrap)
        })?;
        forget(path);
        Ok(())
    }

    /// Writes the calibration to its device's cache file ([`cache_path_for`]),
    /// which the planner reads from then on; returns the path.
    pub fn store(&self) -> Result<PathBuf> {
        let path = cache_path_for(&self.device)?;
        self.save(&path)?;
        Ok(path)
    }

    /// Reads the calibration at `path` for the device named `device`. Errors,
    /// naming the file and the reason, when it cannot be read, is not a
    /// calibration, has another format, was measured on another device or
    /// with another kernel version, or holds a rate that is not a positive
    /// finite number.
    pub fn load(path: &Path, device: &str) -> Result<Self> {
        let fail = |why: String| -> Result<Self> {
            bail!(
                "cqsa: calibration {} refused: {why}; run `cargo run --release --example calibrate` \
                 to measure this device again",
                path.display()
            )
        };
        let bytes = match std::fs::read(path) {
            Ok(t) => t,
            Err(e) => return fail(format!("cannot read it ({e})")),
        };
        let cal: Calibration = match serde_json::from_slice(&bytes) {
            Ok(c) => c,
            Err(e) => return fail(format!("not a calibration file ({e})")),
        };
        if cal.format != FORMAT {
            return fail(format!(
                "format {} (this build reads format {FORMAT})",
                cal.format
            ));
        }
        if cal.device != device {
            return fail(format!(
                "measured on {:?}, this device is {device:?}",
                cal.device
            ));
        }
        if cal.kernel_version != KERNEL_VERSION {
            return fail(format!(
                "measured with kernel version {:?}, this build has {KERNEL_VERSION:?}",
                cal.kernel_version
            ));
        }
        for k in &cal.rates.kernels {
            let float = matches!(
                k.dtype.parse::<DType>(),
                Ok(DType::F32 | DType::F16 | DType::BF16)
            );
            if !float || k.head_dim == 0 {
                return fail(format!(
                    "kernel entry with dtype {:?} and head dim {}",
                    k.dtype, k.head_dim
                ));
            }
        }
        for (name, v) in cal.rates.named() {
            if !(v.is_finite() && v > 0.0) {
                return fail(format!("rate {name} is {v}, not a positive number"));
            }
        }
        Ok(cal)
    }
}

/// What identifies one version of a file: its modification time and length.
type Stamp = (Option<SystemTime>, u64);

/// Calibrations already read, by path, with the file's stamp, so that the
/// planner reads a file once and sees a new one written since (saves through
/// [`Calibration::save`] also drop the entry).
type Loaded = HashMap<(PathBuf, String), (Stamp, std::result::Result<Calibration, String>)>;

fn loaded() -> &'static Mutex<Loaded> {
    static LOADED: OnceLock<Mutex<Loaded>> = OnceLock::new();
    LOADED.get_or_init(|| Mutex::new(HashMap::new()))
}

fn forget(path: &Path) {
    if let Ok(mut m) = loaded().lock() {
        m.retain(|(p, _), _| p != path);
    }
}

/// The calibration the planner uses for the device named `device`, or why it
/// uses none: `Err(reason)` for a missing, unreadable or refused cache file.
pub(crate) fn cached(device: &str) -> std::result::Result<(Calibration, PathBuf), String> {
    let path = cache_path_for(device).map_err(|e| e.to_string())?;
    let stamp = match std::fs::metadata(&path) {
        Ok(m) => (m.modified().ok(), m.len()),
        Err(_) => {
            return Err(format!(
            "no calibration for {device:?} at {} (run `cargo run --release --example calibrate`)",
            path.display()
        ))
        }
    };
    let mut m = loaded()
        .lock()
        .map_err(|_| "calibration cache poisoned".to_string())?;
    // By device too: two device names can share a file name.
    let key = (path.clone(), device.to_string());
    if m.get(&key).is_none_or(|(t, _)| *t != stamp) {
        let r = Calibration::load(&path, device).map_err(|e| e.to_string());
        m.insert(key.clone(), (stamp, r));
    }
    match &m[&key].1 {
        Ok(c) => Ok((c.clone(), path)),
        Err(e) => Err(e.clone()),
    }
}

/// Measures the rates of `dev` as `opts` says (see the module docs). Errors on
/// empty dtype or head-dim lists, zero sizes, or a failed measurement.
pub fn calibrate(dev: &Device, opts: &CalibrateOptions) -> Result<Calibration> {
    if opts.dtypes.is_empty() || opts.head_dims.is_empty() {
        bail!("cqsa: calibrate needs at least one dtype and one head dim, got {opts:?}")
    }
    if opts.heads == 0 || opts.max_tokens == 0 || opts.bytes < 4096 {
        bail!("cqsa: calibrate needs heads, max_tokens > 0 and bytes >= 4096, got {opts:?}")
    }
    if opts.call_seconds.is_empty()
        || opts
            .call_seconds
            .iter()
            .any(|s| !(s.is_finite() && *s >= 0.0))
    {
        bail!(
            "cqsa: calibrate needs call_seconds, each a finite number >= 0, got {:?}",
            opts.call_seconds
        )
    }
    let t0 = Instant::now();
    let device = device_name(dev)?;
    let say = |what: &str, v: f64, unit: &str| {
        if opts.verbose {
            eprintln!("cqsa calibrate: {what:<36} {:>10.2} {unit}", v);
        }
    };
    let mut kernels = Vec::new();
    for &dtype in &opts.dtypes {
        for &d in &opts.head_dims {
            for causal in [false, true] {
                for k in kernel_rates(dev, opts, dtype, d, causal)? {
                    let what = format!("kernel {dtype:?} d={d} causal={causal} N={}", k.tokens);
                    say(&what, k.forward_flops_per_s / 1e9, "GFLOP/s");
                    kernels.push(k);
                }
            }
        }
    }
    let reps = opts.reps.max(1);
    use streamer_device::CopyDirection::{DeviceToHost, HostToDevice};
    let h2d = streamer_device::measure_copy_gbps(dev, HostToDevice, opts.bytes, reps)? * 1e9;
    say("host to device", h2d / 1e9, "GB/s");
    let d2h = streamer_device::measure_copy_gbps(dev, DeviceToHost, opts.bytes, reps)? * 1e9;
    say("device to host", d2h / 1e9, "GB/s");
    let pin = streamer_device::measure_pin_gbps(dev, opts.bytes, reps)?.map(|g| g * 1e9);
    if let Some(p) = pin {
        say("page-locking in place", p / 1e9, "GB/s");
    }
    let alloc = streamer_device::measure_pinned_alloc_gbps(dev, opts.bytes, reps)?.map(|g| g * 1e9);
    if let Some(a) = alloc {
        say("page-locked allocation", a / 1e9, "GB/s");
    }
    let (dm, hm, hc) = crate::stream::measure_merges(dev, opts.bytes, reps)?;
    say("device merge (f32 output)", dm / 1e9, "GB/s");
    say("host landing (fresh f32 buffers)", hm / 1e9, "GB/s");
    say("host landing converted to bf16", hc / 1e9, "GB/s");
    Ok(Calibration {
        format: FORMAT,
        device,
        kernel_version: KERNEL_VERSION.to_string(),
        created_unix: SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        seconds: t0.elapsed().as_secs_f64(),
        rates: Rates {
            kernels,
            h2d_bytes_per_s: h2d,
            d2h_bytes_per_s: d2h,
            pin_bytes_per_s: pin,
            pinned_alloc_bytes_per_s: alloc,
            device_merge_bytes_per_s: dm,
            host_merge_bytes_per_s: hm,
            host_land_converted_bytes_per_s: hc,
        },
    })
}

/// Nominal forward FLOP/s of a device for a dtype: the plan's rates where no
/// calibration exists (see the `plan` module docs), and the first guess of a
/// calibration's call length.
pub(crate) fn nominal_flops(s: &AttentionShape, cuda: bool) -> f64 {
    match (cuda, s.dtype) {
        // The tensor-core kernels (f16/bf16 at the tuned head dims).
        (true, DType::F16 | DType::BF16) if s.d == 64 || s.d == 128 => 300e12,
        // The simple kernels: guesses, never measured.
        (true, DType::F32) => 15e12,
        (true, _) => 50e12,
        (false, _) => 4e9 * rayon::current_num_threads() as f64,
    }
}

/// The length (a multiple of 64 from 64 to `max_tokens`) whose call of `shape`
/// takes about `seconds` at `flops_per_s`.
fn call_length(shape: &AttentionShape, flops_per_s: f64, seconds: f64, max_tokens: usize) -> usize {
    let per_token2 = 4.0 * (shape.hq * shape.d) as f64 / if shape.causal { 2.0 } else { 1.0 };
    let n = (flops_per_s * seconds / per_token2).sqrt() as usize;
    (n / 64 * 64).clamp(64, max_tokens.max(64))
}

/// The resident forward kernel's rates for one kind of call, at the lengths
/// whose calls take about each of `opts.call_seconds` (shortest first; the
/// first length from the default rate, each later one from the rate just
/// measured, so that a slow kernel does not run for minutes), each measured
/// once, after `opts.sustain_seconds` of the same calls.
fn kernel_rates(
    dev: &Device,
    opts: &CalibrateOptions,
    dtype: DType,
    d: usize,
    causal: bool,
) -> Result<Vec<KernelRate>> {
    let h = opts.heads;
    let shape = AttentionShape {
        b: 1,
        hq: h,
        hkv: h,
        nq: 64,
        nk: 64,
        d,
        dtype,
        causal,
    };
    let mut rate = nominal_flops(&shape, dev.is_cuda());
    let mut seconds = opts.call_seconds.clone();
    seconds.sort_by(f64::total_cmp);
    let mut rates: Vec<KernelRate> = Vec::new();
    for s in seconds {
        let n = call_length(&shape, rate, s, opts.max_tokens);
        if rates.iter().any(|r| r.tokens == n) {
            continue;
        }
        let shape = AttentionShape {
            nq: n,
            nk: n,
            ..shape
        };
        rate = shape.forward_flops() / time_kernel(dev, opts, &shape)?;
        rates.push(KernelRate {
            dtype: dtype.as_str().to_string(),
            head_dim: d,
            causal,
            tokens: n,
            forward_flops_per_s: rate,
        });
    }
    Ok(rates)
}

/// Median seconds of one resident forward of `shape` (batch 1, as many key as
/// query heads), after `opts.sustain_seconds` of the same calls.
fn time_kernel(dev: &Device, opts: &CalibrateOptions, shape: &AttentionShape) -> Result<f64> {
    let (h, n, d) = (shape.hq, shape.nq, shape.d);
    let rnd =
        || -> Result<Tensor> { Tensor::randn(0f32, 1.0, (1, h, n, d), dev)?.to_dtype(shape.dtype) };
    let (q, k, v) = (rnd()?, rnd()?, rnd()?);
    let scores = Scores {
        hi: shape.causal.then_some(0),
        ..Scores::dense(crate::resolve_scale(None, d))
    };
    let call = || attention_forward_with(&q, &k, &v, &scores).map(|_| ());
    let t = Instant::now();
    while t.elapsed().as_secs_f64() < opts.sustain_seconds {
        call()?;
        dev.synchronize()?;
    }
    time_median(dev, opts.reps, call)
}
