//! Faults: a block's panic turned into an error that names the block, and
//! out-of-memory failures injected at the library's own allocation points so
//! tests can check that a failed step changes nothing.
//!
//! Injection exists only with the `fault-injection` feature (the workspace's
//! tests and benches turn it on; a library user's build cannot arm a fault,
//! and there [`check`] is free). It is per thread (tests run in parallel in
//! one process) and costs one thread-local read where nothing is armed. A
//! point fails as the device running out of memory would: with an error,
//! before the operation changes any state.
//!
//! ```
//! # #[cfg(feature = "fault-injection")] {
//! use streamer_core::faults::{check, inject_out_of_memory, FaultPoint};
//! inject_out_of_memory(FaultPoint::GradientOffload, 1); // the second pass fails
//! assert!(check(FaultPoint::GradientOffload, || "first".into()).is_ok());
//! let e = check(FaultPoint::GradientOffload, || "weight 3".into()).unwrap_err();
//! assert!(streamer_device::Error::is_out_of_memory(&e));
//! assert!(e.to_string().contains("weight 3"));
//! assert!(check(FaultPoint::GradientOffload, || "again".into()).is_ok()); // one-shot
//! # }
//! ```
use std::any::Any;
#[cfg(feature = "fault-injection")]
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

use candle_core::{Error, Result};

/// A place in the library where a device allocation can fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultPoint {
    /// Issuing the copy of a block's weights into a slot (`ResidencyPool::load`).
    WeightLoad,
    /// Sending a weight gradient to its host buffer (the backward's offload,
    /// which converts it on the device first).
    GradientOffload,
    /// A host optimizer converting a gradient for its update (before any
    /// parameter changes).
    OptimizerGradient,
}

impl std::fmt::Display for FaultPoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::WeightLoad => "weight load",
            Self::GradientOffload => "gradient offload",
            Self::OptimizerGradient => "optimizer gradient conversion",
        })
    }
}

#[cfg(feature = "fault-injection")]
thread_local! {
    /// The armed point and how many passes through it still succeed.
    static ARMED: Cell<Option<(FaultPoint, usize)>> = const { Cell::new(None) };
    /// Faults fired on this thread so far.
    static FIRED: Cell<usize> = const { Cell::new(0) };
}

/// Arms `point` on this thread: `after` passes through it succeed, the next
/// fails with an out-of-memory error, then the point is disarmed (one fault).
/// Replaces whatever was armed before.
#[cfg(feature = "fault-injection")]
pub fn inject_out_of_memory(point: FaultPoint, after: usize) {
    ARMED.with(|a| a.set(Some((point, after))));
}

/// Disarms whatever [`inject_out_of_memory`] armed on this thread.
#[cfg(feature = "fault-injection")]
pub fn clear_injected_faults() {
    ARMED.with(|a| a.set(None));
}

/// Faults fired on this thread so far.
#[cfg(feature = "fault-injection")]
pub fn injected_fault_count() -> usize {
    FIRED.with(Cell::get)
}

/// A pass through `point`: fails if it is armed on this thread and its count
/// has run out, with an error naming the point and `what()` (called only
/// then). The library calls it before each allocation point changes state.
#[cfg(feature = "fault-injection")]
pub fn check(point: FaultPoint, what: impl FnOnce() -> String) -> Result<()> {
    let fire = ARMED.with(|a| match a.get() {
        Some((p, 0)) if p == point => {
            a.set(None);
            true
        }
        Some((p, n)) if p == point => {
            a.set(Some((p, n - 1)));
            false
        }
        _ => false,
    });
    if !fire {
        return Ok(());
    }
    FIRED.with(|f| f.set(f.get() + 1));
    Err(streamer_device::Error::OutOfMemory {
        needed: 0,
        free: 0,
        what: format!("out of memory (injected fault at the {point}: {})", what()),
    }
    .into())
}

/// A pass through `point`: without the `fault-injection` feature nothing can
/// be armed, so it always succeeds.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub fn check(_point: FaultPoint, _what: impl FnOnce() -> String) -> Result<()> {
    Ok(())
}

/// Runs `f`, turning a panic into an error naming `block` and `stage` (the
/// caller then releases the block's slot as after any error, so the pool is
/// never left with a half-released window).
pub fn catch_block_panic<T>(block: &str, stage: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => Err(Error::Msg(format!(
            "block {block:?} panicked during {stage}: {}; the call was abandoned and its \
             slots released (the model stays usable)",
            panic_message(payload.as_ref())
        ))),
    }
}

/// The message of a panic payload (a `&str` or a `String`; otherwise a
/// placeholder).
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(a panic without a message)".to_string()
    }
}
