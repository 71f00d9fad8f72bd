//! Timing a device's work by the host clock: the median of a few runs, each
//! ended by a device synchronise. The calibration and the merge measurements
//! share it.
use std::time::Instant;

use candle_core::{Device, Result};

/// Median seconds of `reps` runs of `f` after one warm-up, each timed by the
/// host clock to the end of a device synchronise.
pub(crate) fn time_median(
    dev: &Device,
    reps: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    time_median_prepared(dev, reps, || Ok(()), |()| f())
}

/// As [`time_median`], with `prepare` run untimed before each run to make the
/// input that `f` consumes.
pub(crate) fn time_median_prepared<I>(
    dev: &Device,
    reps: usize,
    mut prepare: impl FnMut() -> Result<I>,
    mut f: impl FnMut(I) -> Result<()>,
) -> Result<f64> {
    f(prepare()?)?;
    dev.synchronize()?;
    let mut t = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        let input = prepare()?;
        let s = Instant::now();
        f(input)?;
        dev.synchronize()?;
        t.push(s.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2].max(1e-9))
}
