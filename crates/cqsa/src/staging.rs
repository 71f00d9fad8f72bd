//! The page-locked staging buffers that a streamed call's results come back
//! through, kept between calls.
//!
//! Allocating page-locked memory is slow: a streamed call with 131,072-row
//! chunks stages about 1 GiB, and allocating it took 0.36-0.5 s on the H200
//! machine (1.05 s with the host's memory nearly full), freeing it 0.1-0.2 s
//! more, in every call before this cache. PyTorch's caching host allocator
//! keeps such buffers for the same reason. Idle buffers are kept per device,
//! up to `CQSA_STAGING_CACHE_GIB` (default 8; 0 keeps none) of them, until
//! [`release`] frees them. The planner counts what the cache already holds as
//! free ([`crate::estimate`]).
//!
//! A buffer is in the cache only while no copy targets it: a call takes it out
//! before issuing a copy into it and gives it back after that copy is over.

/// The environment variable that caps the cached bytes (GiB, a number >= 0).
pub const CACHE_ENV: &str = "CQSA_STAGING_CACHE_GIB";

/// The cap when [`CACHE_ENV`] is not set.
pub const DEFAULT_CACHE_GIB: f64 = 8.0;

/// The cap on cached bytes, from [`CACHE_ENV`]; an error names the variable and
/// its value when that is not a number >= 0.
pub fn cap_bytes() -> candle_core::Result<usize> {
    let gib = match std::env::var(CACHE_ENV) {
        Err(_) => DEFAULT_CACHE_GIB,
        Ok(s) => match s.trim().parse::<f64>() {
            Ok(g) if g.is_finite() && g >= 0.0 => g,
            _ => candle_core::bail!(
                "cqsa: {CACHE_ENV}={s:?} is not a number of GiB >= 0 (it caps the page-locked \
                 staging kept between streamed calls)"
            ),
        },
    };
    Ok((gib * (1u64 << 30) as f64) as usize)
}

/// Bytes of idle staging buffers kept for CUDA device `ordinal` (0 without CUDA).
pub fn cached_bytes(ordinal: usize) -> usize {
    imp::cached_bytes(ordinal)
}

/// Frees every idle staging buffer kept, of every device; returns their bytes.
pub fn release() -> usize {
    imp::release()
}

/// Bytes of the f32 buffers of `lens` elements (requested in order) that the
/// cache of device `ordinal` would not serve: what a call would allocate.
pub(crate) fn unserved_bytes(ordinal: usize, lens: &[usize]) -> usize {
    imp::unserved_bytes(ordinal, lens)
}

#[cfg(feature = "cuda")]
pub(crate) use imp::{give, take};

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::{Arc, Mutex, OnceLock};

    use candle_core::cuda_backend::cudarc::driver::{CudaContext, PinnedHostSlice};

    /// The idle buffers, of every device (each knows its context).
    fn cache() -> &'static Mutex<Vec<PinnedHostSlice<f32>>> {
        static CACHE: OnceLock<Mutex<Vec<PinnedHostSlice<f32>>>> = OnceLock::new();
        CACHE.get_or_init(|| Mutex::new(Vec::new()))
    }

    /// The cache's buffers; a panic while it was held left only whole buffers.
    fn lock() -> std::sync::MutexGuard<'static, Vec<PinnedHostSlice<f32>>> {
        cache().lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The smallest idle buffer of `ctx` holding at least `len` f32s, if any.
    pub(crate) fn take(ctx: &Arc<CudaContext>, len: usize) -> Option<PinnedHostSlice<f32>> {
        let mut c = lock();
        let i = (0..c.len())
            .filter(|&i| Arc::ptr_eq(c[i].context(), ctx) && c[i].len() >= len)
            .min_by_key(|&i| c[i].len())?;
        Some(c.swap_remove(i))
    }

    /// Keeps `buf`, which no copy targets any more, for later calls, or frees it
    /// when the cache would pass its cap.
    pub(crate) fn give(buf: PinnedHostSlice<f32>) {
        let cap = super::cap_bytes().unwrap_or(0);
        let mut c = lock();
        let held: usize = c.iter().map(|b| b.num_bytes()).sum();
        if held + buf.num_bytes() <= cap {
            c.push(buf);
        } else {
            drop(c);
            drop(buf); // freed outside the lock (it synchronizes)
        }
    }

    pub(super) fn cached_bytes(ordinal: usize) -> usize {
        lock()
            .iter()
            .filter(|b| b.context().ordinal() == ordinal)
            .map(|b| b.num_bytes())
            .sum()
    }

    pub(super) fn release() -> usize {
        let all = std::mem::take(&mut *lock());
        all.iter().map(|b| b.num_bytes()).sum()
    }

    pub(super) fn unserved_bytes(ordinal: usize, lens: &[usize]) -> usize {
        let mut idle: Vec<usize> = lock()
            .iter()
            .filter(|b| b.context().ordinal() == ordinal)
            .map(|b| b.len())
            .collect();
        let mut unserved = 0;
        for &len in lens {
            let fit = (0..idle.len())
                .filter(|&i| idle[i] >= len)
                .min_by_key(|&i| idle[i]);
            match fit {
                Some(i) => {
                    idle.swap_remove(i);
                }
                None => unserved += len * 4,
            }
        }
        unserved
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    pub(super) fn cached_bytes(_ordinal: usize) -> usize {
        0
    }

    pub(super) fn release() -> usize {
        0
    }

    pub(super) fn unserved_bytes(_ordinal: usize, lens: &[usize]) -> usize {
        lens.iter().map(|l| l * 4).sum()
    }
}
