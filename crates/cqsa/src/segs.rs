//! A packed (varlen) call's work tables for one launch of the tensor-core
//! kernels, Hopper and portable alike: one `Seg` (`kernels/src/attention_common.cuh`)
//! per block, giving the block's document (its rows, keys and band) and its
//! query or key block in it, and for the Hopper backward the tiles of 64
//! queries of its statistics and dq accumulator (`hopper::tile_rows`), each
//! document padded apart.
//!
//! The tables are a few i32 per block, copied from pageable host memory onto
//! the compute stream before the launch that reads them.
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};

use crate::launch::kernel_band;
use crate::packed::Fused;

/// A table the kernels read on the device: `len` entries of `width` i32 each.
pub(crate) struct Table {
    pub(crate) table: CudaSlice<i32>,
    pub(crate) len: usize,
}

impl Table {
    fn upload(dev: &CudaDevice, data: Vec<i32>, width: usize) -> Result<Self> {
        let len = data.len() / width;
        // An empty table still needs an allocation to pass; no kernel reads it.
        let data = if data.is_empty() { vec![0] } else { data };
        let table = dev.cuda_stream().clone_htod(&data).w()?;
        Ok(Self { table, len })
    }
}

/// One launch's Segs (8 i32 each) and how many: the launch's blocks in x.
pub(crate) struct Segs {
    pub(crate) table: CudaSlice<i32>,
    pub(crate) blocks: usize,
}

/// Document `i`'s band as the kernels take it.
fn band(f: &Fused, i: usize) -> (i32, i32) {
    let ((q0, q1), (k0, k1)) = f.docs[i];
    kernel_band(q1 - q0, k1 - k0, f.bands[i].0, f.bands[i].1)
}

/// One Seg: document `i`'s rows, keys and band, the block, its first tile (all
/// below the call's sizes, which `KernelArgs::new` checked fit an i32).
fn seg(f: &Fused, i: usize, blk: usize, tile0: usize) -> [i32; 8] {
    let ((q0, q1), (k0, k1)) = f.docs[i];
    let (lo, hi) = band(f, i);
    let [q0, nq, k0, nk, blk, tile0] = [q0, q1 - q0, k0, k1 - k0, blk, tile0].map(|x| x as i32);
    [q0, nq, k0, nk, lo, hi, blk, tile0]
}

/// How many tiles of `step` positions the range `start..end` (clamped to
/// `0..n`, its start rounded down to a tile) touches: the host's copy of the
/// forward kernels' count, used only to put the heaviest blocks first.
fn reach(start: i64, end: i64, n: usize, step: usize) -> usize {
    let (a, b) = (
        start.clamp(0, n as i64) as usize,
        end.clamp(0, n as i64) as usize,
    );
    let a = a / step * step;
    if b > a {
        (b - a).div_ceil(step)
    } else {
        0
    }
}

impl Segs {
    /// The forward's: a block of `rows` queries (visiting key tiles of `keys`)
    /// per query block of every document with rows (a document without keys
    /// too: its block writes zeros), the heaviest first.
    pub(crate) fn forward(
        dev: &CudaDevice,
        f: &Fused,
        (rows, keys): (usize, usize),
    ) -> Result<Self> {
        let mut work = Vec::new();
        for (i, &((q0, q1), (k0, k1))) in f.docs.iter().enumerate() {
            let (nq, nk) = (q1 - q0, k1 - k0);
            let (lo, hi) = band(f, i);
            for blk in 0..nq.div_ceil(rows) {
                let r0 = (blk * rows) as i64;
                let cost = reach(r0 + lo as i64, r0 + rows as i64 + hi as i64, nk, keys);
                work.push((cost, seg(f, i, blk, 0)));
            }
        }
        work.sort_by_key(|w| std::cmp::Reverse(w.0));
        Self::upload(dev, work.into_iter().map(|w| w.1).collect())
    }

    /// The backward's: a block of `keys` keys per key block of every document
    /// with keys, in order, so that the blocks that run at once share their
    /// documents' queries in L2 (one whose keys no row sees writes zeros).
    /// With `tiles` (the Hopper backward), Seg.tile0 is the document's first
    /// tile of `tiles` queries, and the second table lists every tile.
    pub(crate) fn backward(
        dev: &CudaDevice,
        f: &Fused,
        keys: usize,
        tiles: Option<usize>,
    ) -> Result<(Self, Option<Table>)> {
        let (mut segs, mut list) = (Vec::new(), Vec::new());
        for (i, &((q0, q1), (k0, k1))) in f.docs.iter().enumerate() {
            let tile0 = list.len() / 2;
            if let Some(step) = tiles {
                for r0 in (0..q1 - q0).step_by(step) {
                    let rows = (q1 - q0 - r0).min(step);
                    list.extend([(q0 + r0) as i32, rows as i32]);
                }
            }
            for blk in 0..(k1 - k0).div_ceil(keys) {
                segs.push(seg(f, i, blk, tile0));
            }
        }
        let list = tiles.map(|_| Table::upload(dev, list, 2)).transpose()?;
        Ok((Self::upload(dev, segs)?, list))
    }

    fn upload(dev: &CudaDevice, segs: Vec<[i32; 8]>) -> Result<Self> {
        let blocks = segs.len();
        let t = Table::upload(dev, segs.into_iter().flatten().collect(), 8)?;
        Ok(Self {
            table: t.table,
            blocks,
        })
    }
}
