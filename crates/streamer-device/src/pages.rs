//! Host pages, one implementation for every crate that page-locks memory (the
//! pool's masters, the gradient offload, cqsa's streamed attention): the OS page
//! size, the whole pages inside a byte range, the pieces a copy must be split
//! into, and (with `cuda`) registering whole pages with the driver.
//!
//! Only whole pages are ever registered. The partial pages at either end of an
//! allocation may hold other allocations: a registered page makes every copy to
//! or from it asynchronous, and Candle's own copies into ordinary `Vec`s rely on
//! pageable copies being synchronous. So the page size must be the OS's (64 KiB
//! on some aarch64 systems such as GH200), never assumed.
//!
//! ```
//! let page = streamer_device::pages::page_size();
//! assert!(page.is_power_of_two());
//! // A range from inside the first page to inside the fourth holds two whole pages.
//! let (lo, hi) = streamer_device::pages::whole_pages(page + 1, 3 * page).unwrap();
//! assert_eq!((lo, hi), (2 * page, 4 * page));
//! ```
use std::sync::OnceLock;

/// The host's page size in bytes, from the OS (`sysconf(_SC_PAGESIZE)`), read once.
pub fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(os_page_size)
}

#[cfg(unix)]
fn os_page_size() -> usize {
    // SAFETY: sysconf only reads a system constant.
    let r = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    // A failure (-1) never happens for _SC_PAGESIZE on Linux; if it did, the
    // largest page size in use (64 KiB) keeps registration within allocations.
    if r > 0 {
        r as usize
    } else {
        65536
    }
}

#[cfg(not(unix))]
fn os_page_size() -> usize {
    65536
}

/// The whole pages inside `[ptr, ptr + bytes)`, as `(first byte, end)`, or `None`
/// when the range holds no whole page.
pub fn whole_pages(ptr: usize, bytes: usize) -> Option<(usize, usize)> {
    let page = page_size();
    let (lo, hi) = (ptr.div_ceil(page) * page, (ptr + bytes) / page * page);
    (hi > lo).then_some((lo, hi))
}

/// Splits a host range into the part before its first page boundary, its whole
/// pages (which `PinnedRegion` (CUDA builds) page-locks, so copies from them are
/// asynchronous DMA), and the part after its last page boundary (pageable). A
/// copy may not span registered and unregistered memory, so each piece is
/// copied on its own. Yields `(offset, len, whole_pages)`, empty pieces left out.
pub fn page_pieces(host: usize, bytes: usize) -> impl Iterator<Item = (usize, usize, bool)> {
    let page = page_size();
    let end = host + bytes;
    let first = (host.div_ceil(page) * page).min(end);
    let last = (end / page * page).max(first);
    [
        (host, first, false),
        (first, last, true),
        (last, end, false),
    ]
    .into_iter()
    .filter(|(a, b, _)| b > a)
    .map(move |(a, b, whole)| (a - host, b - a, whole))
}

#[cfg(feature = "cuda")]
pub use pinned::{alloc_readable, PinnedRegion};

#[cfg(feature = "cuda")]
mod pinned {
    use candle_core::Result;
    use cudarc::driver::{sys, CudaContext, PinnedHostSlice};
    use std::sync::Arc;

    /// Page-locked host memory for `len` values that the host reads back
    /// (copies' destinations, caches it reads and writes), with flags 0:
    /// cudarc's default, write-combined memory, is uncached for the host's
    /// reads (very slow).
    ///
    /// # Safety
    /// The memory is uninitialised: read none of it before something wrote it.
    pub unsafe fn alloc_readable<T: cudarc::driver::DeviceRepr>(
        ctx: &Arc<CudaContext>,
        len: usize,
    ) -> Result<PinnedHostSlice<T>> {
        // SAFETY: forwarded to the caller (uninitialised memory).
        unsafe { ctx.alloc_pinned_with_flags::<T>(len, 0) }
            .map_err(|e| candle_core::Error::Cuda(Box::new(e)))
    }

    /// Host pages registered with the driver (page-locked in place); unregistered
    /// on drop.
    pub struct PinnedRegion {
        base: *mut std::ffi::c_void,
        ctx: Arc<CudaContext>,
    }

    // SAFETY: the region is only a registration handle; the memory it names is
    // owned by a host buffer that outlives it (`register`'s contract), and
    // unregistering works from any thread.
    unsafe impl Send for PinnedRegion {}
    // SAFETY: as above; no method reads or writes the memory.
    unsafe impl Sync for PinnedRegion {}

    impl PinnedRegion {
        /// Registers the whole pages inside `[ptr, ptr + bytes)` (see the module
        /// docs for why only those). Returns `None` when the range holds no whole
        /// page (a small buffer stays pageable), when registration fails (another
        /// component registered these pages, or the driver's page-lock limit:
        /// copies stay correct, only slower and synchronous), or when
        /// `STREAMER_PIN=0` asks for pageable memory (diagnostics).
        ///
        /// # Safety
        /// `[ptr, ptr + bytes)` must lie inside one live host allocation that is
        /// not freed before the returned region is dropped.
        pub unsafe fn register(
            ctx: &Arc<CudaContext>,
            ptr: *mut u8,
            bytes: usize,
        ) -> Result<Option<Self>> {
            if std::env::var("STREAMER_PIN").is_ok_and(|v| v == "0") {
                return Ok(None);
            }
            ctx.bind_to_thread().map_err(candle_core::Error::wrap)?;
            let Some((lo, hi)) = super::whole_pages(ptr as usize, bytes) else {
                return Ok(None);
            };
            // SAFETY: the pages lie inside the caller's live allocation, which
            // outlives this registration (the contract); registering does not
            // change the memory's contents.
            let r = unsafe {
                sys::cuMemHostRegister_v2(lo as *mut _, hi - lo, sys::CU_MEMHOSTREGISTER_PORTABLE)
            };
            Ok((r == sys::CUresult::CUDA_SUCCESS).then(|| Self {
                base: lo as *mut _,
                ctx: ctx.clone(),
            }))
        }
    }

    impl Drop for PinnedRegion {
        /// Unregisters; a failure is recorded on the context (cudarc's
        /// `check_err` surfaces it).
        fn drop(&mut self) {
            if self.ctx.bind_to_thread().is_ok() {
                // SAFETY: `base` is exactly the pointer registered in `register`.
                let r = unsafe { sys::cuMemHostUnregister(self.base) };
                if r != sys::CUresult::CUDA_SUCCESS {
                    self.ctx
                        .record_err::<()>(Err(cudarc::driver::DriverError(r)));
                }
            }
        }
    }
}
