//! What streamed training keeps of each block's forward for its backward.
//!
//! Recomputing a block's forward in backward costs a third of a compute-bound
//! step; keeping its activations costs device memory. The weights are streamed
//! either way, so a model far bigger than the GPU trains without recompute
//! whenever its activations fit. Only blocks with a hand-written backward
//! ([`streamer_core::ManualBackward`]) can keep theirs: a Candle autograd graph
//! would hold the block's weights, whose slots are refilled before backward.
use candle_core::{Device, Result};

/// Where a training forward left a block's activations for its backward
/// ([`crate::TrainableSequential::activation_places`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivationPlace {
    /// Not kept: the backward recomputes the block from its input.
    Recomputed,
    /// Kept in device memory.
    Device,
    /// Spilled to page-locked host memory ([`ActivationPolicy::Spill`]).
    Host,
}

/// The activation policy of a [`crate::TrainableSequential`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ActivationPolicy {
    /// Keep only each block's input; recompute every block in backward.
    Recompute,
    /// Keep the activations of blocks with a hand-written backward, last
    /// blocks first (their backward comes first, so the device holds them
    /// for the shortest time and spills, under [`Self::Spill`], go to early
    /// blocks), while their total stays within `device_bytes`; recompute the
    /// others.
    Keep {
        /// Device bytes the kept activations may take.
        device_bytes: usize,
    },
    /// [`Self::Keep`] with a budget of `fraction` of the device memory free
    /// when each training forward starts. On the CPU this is `Recompute`.
    Auto {
        /// Share of the free device memory, in (0, 1].
        fraction: f64,
    },
    /// Recompute every block, with each block's saved input (after the first,
    /// which is the caller's) in page-locked host memory: copied out on its
    /// own stream while the next block runs, and back while the block after
    /// it in reverse order runs its backward. For models whose saved inputs
    /// alone do not fit on the device. Same gradients as `Recompute`.
    OffloadInputs,
    /// [`Self::Keep`] within `device_bytes` (the last blocks), then, from the
    /// first block on, activations in page-locked host memory while their
    /// total stays within `host_bytes`: copied out on the offload stream
    /// while the next blocks run their forward and back while the block after
    /// it runs its backward, so they are not recomputed; the rest are
    /// recomputed. No two blocks in a row spill (a spill's copies drain while
    /// the next block runs, which recomputes or keeps on the device). The
    /// spilled blocks being early ones, their copies out have the rest of the
    /// forward to finish and their copies back come last. With the spills
    /// on the last blocks instead (bundle 430a448), LoRA on an NF4 8B base at
    /// 8 x 2,048 tokens on an H100 ran slower spilling than recomputing
    /// (5,989 tokens/s against 7,155, `benches/results/quantized-h100.json`).
    /// Beyond `device_bytes`, the device holds the activations of up to two
    /// spilled blocks in flight.
    Spill {
        /// Device bytes the kept activations may take.
        device_bytes: usize,
        /// Host bytes the spilled activations may take.
        host_bytes: usize,
    },
}

impl Default for ActivationPolicy {
    /// Keep what fits in half of the free device memory, recompute the rest.
    fn default() -> Self {
        Self::Auto { fraction: 0.5 }
    }
}

impl std::str::FromStr for ActivationPolicy {
    type Err = candle_core::Error;

    /// `recompute`, `keep:BYTES` (e.g. `keep:8GiB`, `keep:1000000`),
    /// `auto[:FRACTION]`, `offload` or `spill:DEVICE:HOST` (e.g.
    /// `spill:8GiB:32GiB`).
    fn from_str(s: &str) -> Result<Self> {
        let (name, arg) = s.split_once(':').map_or((s, None), |(a, b)| (a, Some(b)));
        match (name, arg) {
            ("recompute", None) => Ok(Self::Recompute),
            ("offload", None) => Ok(Self::OffloadInputs),
            ("auto", None) => Ok(Self::default()),
            ("auto", Some(f)) => {
                let fraction = f.parse::<f64>().map_err(|_| {
                    candle_core::Error::Msg(format!(
                        "activation policy {s:?}: {f:?} is not a number"
                    ))
                })?;
                Ok(Self::Auto { fraction })
            }
            ("keep", Some(b)) => Ok(Self::Keep {
                device_bytes: size_in(s, b)?,
            }),
            ("spill", Some(sizes)) => match sizes.split_once(':') {
                Some((d, h)) => Ok(Self::Spill {
                    device_bytes: size_in(s, d)?,
                    host_bytes: size_in(s, h)?,
                }),
                None => candle_core::bail!(
                    "activation policy {s:?}: expected spill:DEVICE:HOST (e.g. spill:8GiB:32GiB)"
                ),
            },
            _ => candle_core::bail!(
                "unknown activation policy {s:?}: expected recompute, keep:BYTES (e.g. keep:8GiB), \
                 auto[:FRACTION], offload or spill:DEVICE:HOST"
            ),
        }
    }
}

/// Refuses a spill of `host_bytes` that the host's `available` memory
/// (when known) cannot hold: the spilled activations are page-locked.
fn check_host(host_bytes: usize, available: Option<usize>) -> Result<()> {
    match available {
        Some(avail) if host_bytes > avail => candle_core::bail!(
            "ActivationPolicy::Spill of {host_bytes} host bytes ({:.2} GiB) exceeds the {avail} \
             bytes ({:.2} GiB) of host memory available",
            host_bytes as f64 / (1u64 << 30) as f64,
            avail as f64 / (1u64 << 30) as f64
        ),
        _ => Ok(()),
    }
}

/// The size `b` of the policy `s`, or an error naming both.
fn size_in(s: &str, b: &str) -> Result<usize> {
    parse_size(b).ok_or_else(|| {
        candle_core::Error::Msg(format!(
            "activation policy {s:?}: {b:?} is not a size (like 8GiB)"
        ))
    })
}

/// `123`, `4KiB`, `8MiB`, `2GiB` (binary units; `KB`/`MB`/`GB` decimal).
fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let mult: f64 = match unit.trim() {
        "" | "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1024f64.powi(2),
        "GiB" => 1024f64.powi(3),
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        _ => return None,
    };
    let v = num.parse::<f64>().ok()? * mult;
    (v.is_finite() && v >= 0.0 && v < usize::MAX as f64).then_some(v as usize)
}

impl ActivationPolicy {
    /// Rejects a policy that cannot hold on `device`, naming the value.
    pub fn validate(&self, device: &Device) -> Result<()> {
        match *self {
            Self::Recompute | Self::OffloadInputs => Ok(()),
            Self::Keep { device_bytes: 0 } => candle_core::bail!(
                "ActivationPolicy::Keep with a budget of 0 bytes keeps nothing: use Recompute"
            ),
            Self::Keep { device_bytes } => match streamer_device::free_device_memory(device)? {
                Some(free) if device_bytes > free => candle_core::bail!(
                    "ActivationPolicy::Keep budget of {device_bytes} bytes ({:.2} GiB) exceeds the \
                     {free} bytes ({:.2} GiB) free on the device",
                    device_bytes as f64 / (1u64 << 30) as f64,
                    free as f64 / (1u64 << 30) as f64
                ),
                _ => Ok(()),
            },
            Self::Auto { fraction } if !(fraction > 0.0 && fraction <= 1.0) => {
                candle_core::bail!(
                    "ActivationPolicy::Auto fraction must be in (0, 1], got {fraction}"
                )
            }
            Self::Auto { .. } => Ok(()),
            Self::Spill { host_bytes: 0, .. } => candle_core::bail!(
                "ActivationPolicy::Spill with 0 host bytes spills nothing: use Keep"
            ),
            Self::Spill {
                device_bytes,
                host_bytes,
            } => {
                check_host(host_bytes, streamer_device::host_available_memory())?;
                match device_bytes {
                    0 => Ok(()),
                    _ => Self::Keep { device_bytes }.validate(device),
                }
            }
        }
    }

    /// The byte budget for one training forward on `device` (0: keep nothing).
    pub(crate) fn budget(&self, device: &Device) -> Result<usize> {
        Ok(match *self {
            Self::Recompute | Self::OffloadInputs => 0,
            Self::Keep { device_bytes } | Self::Spill { device_bytes, .. } => device_bytes,
            Self::Auto { fraction } => streamer_device::free_device_memory(device)?
                .map_or(0, |free| (free as f64 * fraction) as usize),
        })
    }

    /// The host bytes spilled activations may take in one training forward.
    pub(crate) fn host_budget(&self) -> usize {
        match *self {
            Self::Spill { host_bytes, .. } => host_bytes,
            _ => 0,
        }
    }
}
