//! A device-memory cap: all of a GPU's memory beyond a budget is held back
//! from the process, so that it behaves as a GPU of that size. Whatever does
//! not fit then fails with the driver's out-of-memory error instead of
//! quietly using more (`train_lm --device-budget`, the benches' caps).
use candle_core::{bail, Device, Result};
#[cfg(feature = "cuda")]
use streamer_device::Error::{self, OutOfMemory};

/// Device memory held back until dropped.
pub struct DeviceCap {
    #[cfg(feature = "cuda")]
    _held: Option<cudarc::driver::CudaSlice<u8>>,
    held: usize,
}

fn gib(b: usize) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

impl DeviceCap {
    /// No cap.
    pub fn none() -> Self {
        Self {
            #[cfg(feature = "cuda")]
            _held: None,
            held: 0,
        }
    }

    /// Holds back all of `device`'s memory beyond `budget` bytes in use by
    /// this process (as the driver counts it: the CUDA context and what is
    /// allocated already included). A budget larger than the device, or not
    /// above what is in use already, is an error naming both; so is a budget
    /// on the CPU.
    pub fn hold(device: &Device, budget: usize) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = device {
            crate::trim_device_memory(device)?;
            let (free, total) = streamer_device::cuda::memory_info(d)?;
            if budget > total {
                return Err(OutOfMemory {
                    needed: budget,
                    free: total,
                    what: format!(
                        "device budget {:.1} GiB is larger than the device ({:.1} GiB)",
                        gib(budget),
                        gib(total)
                    ),
                }
                .into());
            }
            let used = total - free;
            if budget <= used {
                return Err(OutOfMemory {
                    needed: used,
                    free: budget,
                    what: format!(
                        "device budget {:.1} GiB is not above the {:.1} GiB the process uses already",
                        gib(budget),
                        gib(used)
                    ),
                }
                .into());
            }
            let held = free - (budget - used);
            let slice = d
                .cuda_stream()
                .alloc_zeros::<u8>(held.max(1))
                .map_err(|e| Error::from_driver(e, "holding back device memory", held.max(1)))?;
            return Ok(Self {
                _held: Some(slice),
                held,
            });
        }
        bail!(
            "a device budget ({:.1} GiB) needs a CUDA device, not {:?}",
            gib(budget),
            device.location()
        )
    }

    /// Bytes held back.
    pub fn held(&self) -> usize {
        self.held
    }
}
