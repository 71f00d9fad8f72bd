//! The CPU engine: slots are host tensors and a load is a memory copy, done
//! (and measured) before `load` returns. It is the reference the CUDA engine
//! behaves like, and what CI tests.
use super::engine::{Engine, Parts, Timing};
use crate::config::StreamConfig;
use crate::stats::StreamStats;
use candle_core::{Device, Result, Tensor};
use std::time::{Duration, Instant};

pub(super) struct CpuEngine {
    /// Time zero of the timeline.
    epoch: Instant,
    /// When the compute of each slot's block began (`begin_compute`).
    started: Vec<Option<Instant>>,
    /// `StreamConfig::transfer_delay`: each copy takes at least this long.
    delay: Option<Duration>,
}

impl CpuEngine {
    /// The engine and its `cfg.window()` slots of `elems` elements each.
    pub(super) fn new(cfg: &StreamConfig, elems: usize) -> Result<(Self, Vec<Tensor>)> {
        let window = cfg.window();
        let flats = (0..window)
            .map(|_| Tensor::zeros(elems, cfg.dtype, &Device::Cpu))
            .collect::<Result<Vec<_>>>()?;
        let engine = Self {
            epoch: Instant::now(),
            started: vec![None; window],
            delay: cfg.transfer_delay,
        };
        Ok((engine, flats))
    }

    /// µs from the epoch to `t`, on the timeline's axis.
    fn us(&self, t: Instant) -> f64 {
        (t - self.epoch).as_secs_f64() * 1e6
    }
}

impl Engine for CpuEngine {
    fn copy_in(
        &mut self,
        (block, _slot, flat): (usize, usize, &Tensor),
        p: Parts,
        _stats: &mut StreamStats,
    ) -> Result<(u64, Option<Timing>)> {
        let mut bytes = 0u64;
        let t0 = Instant::now();
        for &(m, off) in &p.layouts[block].unique {
            let master = p.masters.get(m).var.as_tensor();
            bytes += (master.elem_count() * master.dtype().size_in_bytes()) as u64;
            let src = match p.masters.get(m).is_packed() {
                // Raw bytes, never converted.
                true => crate::packed::bytes_as(&master.flatten_all()?.to_vec1::<u8>()?, p.dtype)?,
                false => master.flatten_all()?.to_dtype(p.dtype)?,
            };
            flat.slice_set(&src, 0, off)?;
        }
        if let Some(d) = self.delay {
            std::thread::sleep(d);
        }
        let (ts, took) = (self.us(t0), t0.elapsed());
        Ok((bytes, Some(Timing::Transfer { block, ts, took })))
    }

    fn begin_compute(&mut self, slot: usize) -> Result<()> {
        self.started[slot] = Some(Instant::now());
        Ok(())
    }

    fn end_compute(&mut self, block: usize, slot: usize, _p: Parts) -> Result<Option<Timing>> {
        // The compute ran on this thread between acquire and release: no stall.
        Ok(self.started[slot].take().map(|t0| Timing::Compute {
            block,
            ts: self.us(t0),
            stall: Duration::ZERO,
            took: t0.elapsed(),
        }))
    }

    fn synchronize(&mut self) -> Result<()> {
        Ok(()) // every copy finished before `load` returned
    }

    fn resolve(&mut self, _all: bool, _sink: &mut dyn FnMut(Timing)) -> Result<()> {
        Ok(()) // every timing was handed out as it was measured
    }

    fn unresolved(&self) -> usize {
        0
    }

    fn clock(&self) -> Result<(Instant, f64)> {
        Ok((self.epoch, 0.0))
    }

    fn reset(&mut self) {
        self.started.iter_mut().for_each(|s| *s = None);
    }

    fn record_dropped(&self, _err: &candle_core::Error) {
        // Unreachable: `synchronize` cannot fail, and `settle` keeps no error.
    }
}
