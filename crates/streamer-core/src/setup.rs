//! What building a streamed model takes: its phases' times, and the events a
//! caller can watch while it runs ([`crate::StreamConfig::on_setup`]) to show
//! progress on a big model.
use std::sync::Arc;

/// How long building a [`crate::StreamedSequential`] took, by phase: what a
/// user of a big model waits for before the first step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SetupTimes {
    /// Seconds to read or copy every weight into its host master.
    pub masters_s: f64,
    /// Seconds to page-lock the masters (zero on the CPU, or for a replica,
    /// which shares its first model's locked masters).
    pub pin_s: f64,
}

/// A step of building a model, in order: for a base quantized as it loads,
/// its weights read and quantized; every block's masters, then (on a CUDA
/// device) page-locking them, then the end.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SetupEvent {
    /// `done` of `total` weights read and quantized (a base quantized as it
    /// loads, before its blocks' masters).
    Quantized {
        /// Weights done.
        done: usize,
        /// Weights in all.
        total: usize,
    },
    /// `done` of `total` blocks have their host masters.
    Masters {
        /// Blocks done.
        done: usize,
        /// Blocks in all.
        total: usize,
    },
    /// Page-locking `bytes` of host masters begins.
    PageLock {
        /// Bytes of the masters.
        bytes: usize,
    },
    /// Built, in these times.
    Built(SetupTimes),
}

/// A callback that receives [`SetupEvent`]s on the building thread.
#[derive(Clone)]
pub struct SetupHook(pub Arc<dyn Fn(SetupEvent) + Send + Sync>);

impl SetupHook {
    /// A hook calling `f`.
    pub fn new(f: impl Fn(SetupEvent) + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    /// Hands `e` to the callback.
    pub fn emit(&self, e: SetupEvent) {
        (self.0)(e)
    }
}

impl std::fmt::Debug for SetupHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SetupHook(..)")
    }
}
