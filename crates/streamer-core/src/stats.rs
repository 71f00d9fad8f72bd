//! Cumulative streaming statistics and the residency transition log.
use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;

/// How many residency transitions the log keeps (the oldest are dropped first).
pub const TRANSITION_LOG_LEN: usize = 4096;

/// What happened to a block's residency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransitionKind {
    /// A copy of the block's weights into a device slot was issued.
    LoadIssued,
    /// Compute on the block is about to start (its copy is ordered before it).
    ComputeStart,
    /// Compute on the block has been issued; its slot may be refilled after it.
    Evicted,
}

/// One residency transition, as seen by the host when it issued the work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    /// Index of the block in the sequence.
    pub block: usize,
    /// Slot the block occupies.
    pub slot: usize,
    /// What happened.
    pub kind: TransitionKind,
    /// Blocks holding device state right after this transition (copies in flight count).
    pub resident_blocks: usize,
    /// Bytes of block weights on the device right after this transition.
    pub resident_bytes: usize,
}

/// Called on every residency transition (for tests, logging, assertions).
pub type Observer = Arc<dyn Fn(&Transition) + Send + Sync>;

/// Cumulative statistics of a pool, resettable with `reset`.
#[derive(Debug, Clone, Default)]
pub struct StreamStats {
    /// Number of block loads (host to device copies of a whole block).
    pub loads: u64,
    /// Loads served without a copy by a slot that still held the block's
    /// device-stepped masters, each checked against the host masters
    /// (`StreamConfig::reuse_stepped_blocks`).
    pub reused_loads: u64,
    /// Calls run again because a block lent that way differed from its host
    /// masters (they had changed after the step).
    pub stale_reuses: u64,
    /// Host to device bytes copied to check lent blocks (not in `h2d_bytes`).
    pub verify_bytes: u64,
    /// Bytes copied host to device.
    pub h2d_bytes: u64,
    /// Time the transfer stream spent copying (device time on CUDA), seconds.
    pub h2d_seconds: f64,
    /// Time compute waited for a block's weights to arrive, seconds.
    pub stall_seconds: f64,
    /// Time the host thread was blocked by the pool (waiting for a slot to free), seconds.
    pub host_wait_seconds: f64,
    /// Time spent computing blocks (device time on CUDA), seconds.
    pub compute_seconds: f64,
    /// Blocks whose state is on the device now.
    pub resident_blocks: usize,
    /// Most blocks ever on the device at once.
    pub peak_resident_blocks: usize,
    /// Bytes of block weights on the device now.
    pub resident_bytes: usize,
    /// Most bytes of block weights ever on the device at once.
    pub peak_resident_bytes: usize,
    /// Bytes of device memory the slots occupy (allocated once).
    pub slot_bytes: usize,
    /// Device to host bytes (gradients, when training).
    pub d2h_bytes: u64,
    /// Device to host time, seconds.
    pub d2h_seconds: f64,
    /// The last [`TRANSITION_LOG_LEN`] transitions.
    pub transitions: VecDeque<Transition>,
}

impl StreamStats {
    /// Achieved host-to-device bandwidth in GB/s (0 when nothing was copied).
    pub fn h2d_gbps(&self) -> f64 {
        if self.h2d_seconds > 0.0 {
            self.h2d_bytes as f64 / self.h2d_seconds / 1e9
        } else {
            0.0
        }
    }

    pub(crate) fn push(&mut self, t: Transition) {
        if self.transitions.len() == TRANSITION_LOG_LEN {
            self.transitions.pop_front();
        }
        self.transitions.push_back(t);
    }

    /// Clears the counters and the log; residency (current state) is kept.
    pub fn reset(&mut self) {
        let resident_blocks = self.resident_blocks;
        let resident_bytes = self.resident_bytes;
        let slot_bytes = self.slot_bytes;
        *self = StreamStats {
            resident_blocks,
            peak_resident_blocks: resident_blocks,
            resident_bytes,
            peak_resident_bytes: resident_bytes,
            slot_bytes,
            ..Default::default()
        };
    }
}

fn mib(b: f64) -> f64 {
    b / (1024.0 * 1024.0)
}

impl fmt::Display for StreamStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "streaming statistics")?;
        writeln!(
            f,
            "  h2d      {} loads, {:.1} MiB in {:.3} ms ({:.1} GB/s)",
            self.loads,
            mib(self.h2d_bytes as f64),
            self.h2d_seconds * 1e3,
            self.h2d_gbps()
        )?;
        if self.d2h_bytes > 0 {
            writeln!(
                f,
                "  d2h      {:.1} MiB in {:.3} ms",
                mib(self.d2h_bytes as f64),
                self.d2h_seconds * 1e3
            )?;
        }
        if self.reused_loads > 0 {
            writeln!(
                f,
                "  reused   {} stepped blocks without a copy ({} stale, run again), {:.1} MiB copied to check them",
                self.reused_loads,
                self.stale_reuses,
                mib(self.verify_bytes as f64)
            )?;
        }
        writeln!(f, "  compute  {:.3} ms", self.compute_seconds * 1e3)?;
        writeln!(
            f,
            "  stalls   compute waited {:.3} ms for weights, host waited {:.3} ms",
            self.stall_seconds * 1e3,
            self.host_wait_seconds * 1e3
        )?;
        write!(
            f,
            "  resident {} blocks now ({:.1} MiB), peak {} blocks ({:.1} MiB), slots {:.1} MiB",
            self.resident_blocks,
            mib(self.resident_bytes as f64),
            self.peak_resident_blocks,
            mib(self.peak_resident_bytes as f64),
            mib(self.slot_bytes as f64)
        )
    }
}
