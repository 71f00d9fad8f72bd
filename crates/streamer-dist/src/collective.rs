//! The [`Collective`] trait: what every rank of a group can do together, and
//! the rules every implementation keeps (timeouts, failure, error messages).
use std::time::Duration;

use candle_core::{Device, Result, Tensor};

/// The default timeout of one blocking collective operation.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// One rank of a group: its index, the group's size and its device.
#[derive(Clone, Debug)]
pub struct Member {
    /// This rank, `0..world`.
    pub rank: usize,
    /// Number of ranks in the group.
    pub world: usize,
    /// The device this rank computes on.
    pub device: Device,
}

/// Collective operations over the `world_size` ranks of one group.
///
/// Every rank must call the same operations in the same order with tensors of
/// the same shape and dtype (SPMD). Each call blocks until the result is ready
/// (on CUDA: until the device finished it) or fails:
///
/// - after the group's timeout, with an error naming the rank, the operation
///   and its sequence number, and (where known) the ranks not yet arrived;
/// - at once on every rank after any rank called [`Collective::abort`] or timed
///   out: the error names the rank that failed and why.
///
/// A group that failed stays failed (every later call errors); build a new one.
/// Results are on the caller's tensor's device, in its dtype. Sums are taken in
/// rank order on the host collective (deterministic); NCCL picks its own order.
pub trait Collective: Send + Sync {
    /// Which rank of which group this is.
    fn member(&self) -> &Member;

    /// This rank, `0..world_size`.
    fn rank(&self) -> usize {
        self.member().rank
    }

    /// Number of ranks in the group.
    fn world_size(&self) -> usize {
        self.member().world
    }

    /// The device this rank computes on (and its tensors live on, for NCCL).
    fn device(&self) -> &Device {
        &self.member().device
    }

    /// The element-wise sum of `x` over all ranks, on every rank.
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor>;

    /// The sum over all ranks of `x`, split along dim 0 into `world_size` equal
    /// parts: this rank gets part `rank`. Dim 0 must be divisible by `world_size`.
    fn reduce_scatter_sum(&self, x: &Tensor) -> Result<Tensor>;

    /// Every rank's `x` concatenated along dim 0 in rank order, on every rank.
    fn all_gather(&self, x: &Tensor) -> Result<Tensor>;

    /// Sends `x` to rank `(rank + 1) % world_size` and returns what rank
    /// `(rank + world_size - 1) % world_size` sent: one step of a ring.
    fn ring_shift(&self, x: &Tensor) -> Result<Tensor>;

    /// Returns once every rank called it.
    fn barrier(&self) -> Result<()>;

    /// Marks the group failed because of `reason` on this rank: every rank's
    /// waiting and later calls return an error naming this rank and `reason`.
    fn abort(&self, reason: &str);

    /// The failure that ended the group, if any.
    fn failure(&self) -> Option<String>;
}

/// An error of `op` on `rank`, in the crate's format.
pub(crate) fn err(rank: usize, op: &str, msg: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("streamer-dist: rank {rank}: {op}: {msg}"))
}

/// Checks what every collective needs of a rank and a world size.
pub(crate) fn check_rank(rank: usize, world_size: usize) -> Result<()> {
    if world_size == 0 {
        candle_core::bail!("streamer-dist: world size must be at least 1, got 0")
    }
    if rank >= world_size {
        candle_core::bail!("streamer-dist: rank {rank} is outside a world of size {world_size}")
    }
    Ok(())
}

/// Checks that dim 0 of `x` splits into `world` equal parts (reduce-scatter).
pub(crate) fn check_scatter(rank: usize, world: usize, x: &Tensor) -> Result<usize> {
    let Some(&n) = x.dims().first() else {
        return Err(err(
            rank,
            "reduce_scatter_sum",
            "needs a tensor of rank 1 or more, got a scalar",
        ));
    };
    if n % world != 0 {
        return Err(err(
            rank,
            "reduce_scatter_sum",
            format!(
                "dim 0 of {:?} is not divisible by the world size {world}",
                x.dims()
            ),
        ));
    }
    Ok(n / world)
}

/// Checks that `x` has at least one dim (all-gather concatenates along dim 0).
pub(crate) fn check_gather(rank: usize, x: &Tensor) -> Result<()> {
    if x.dims().is_empty() {
        return Err(err(
            rank,
            "all_gather",
            "needs a tensor of rank 1 or more, got a scalar",
        ));
    }
    Ok(())
}
