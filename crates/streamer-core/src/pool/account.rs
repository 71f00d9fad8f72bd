//! The pool's statistics and timeline: what both engines measured, added up
//! in one place, and the host spans beside it.
use super::{ResidencyPool, Timing};
use crate::stats::{Observer, StreamStats, Transition, TransitionKind};
use crate::timeline::{Timeline, TraceKind};
use candle_core::Result;
use std::time::{Duration, Instant};

impl ResidencyPool {
    /// With the timeline on: maps the host clock onto the timeline's (on
    /// CUDA, an event on the compute stream, which this waits for).
    pub(super) fn calibrate_host_clock(&mut self) -> Result<()> {
        if self.timeline.is_some() {
            self.host_ref = self.engine.clock()?;
        }
        Ok(())
    }

    /// Whether a timeline is being recorded (host spans cost nothing when not:
    /// callers take their instants only when this is true).
    pub fn timeline_on(&self) -> bool {
        self.timeline.is_some()
    }

    /// Now, when a timeline is recorded: the start of a host span for
    /// [`Self::span_end`]. `None` otherwise, so that nothing is measured.
    pub fn span_start(&self) -> Option<Instant> {
        self.timeline.is_some().then(Instant::now)
    }

    /// Records the host span from `start` ([`Self::span_start`]) to now,
    /// naming it by `name` (called only then); nothing for `None`.
    pub fn span_end(&mut self, start: Option<Instant>, name: impl FnOnce() -> String) {
        if let Some(t0) = start {
            self.host_span(&name(), t0, Instant::now());
        }
    }

    /// Records a span of host time (`start..end`, on the calling thread) on
    /// the timeline's host lane, on the same time axis as the copies and
    /// compute (within tens of microseconds on CUDA). Does nothing when the
    /// timeline is off.
    pub fn host_span(&mut self, name: &str, start: Instant, end: Instant) {
        let Some(tl) = &mut self.timeline else {
            return;
        };
        let (at, us) = self.host_ref;
        let rel = |t: Instant| match t.checked_duration_since(at) {
            Some(d) => us + d.as_secs_f64() * 1e6,
            None => us - at.duration_since(t).as_secs_f64() * 1e6,
        };
        let ts = rel(start);
        tl.push(TraceKind::Host, name, ts, (rel(end) - ts).max(0.0));
    }

    /// Sets the function called on every residency transition.
    pub fn set_observer(&mut self, observer: Option<Observer>) {
        self.observer = observer;
    }

    pub(super) fn transition(&mut self, block: usize, slot: usize, kind: TransitionKind) {
        let t = Transition {
            block,
            slot,
            kind,
            resident_blocks: self.stats.resident_blocks,
            resident_bytes: self.stats.resident_bytes,
        };
        self.stats.push(t);
        if let Some(o) = &self.observer {
            o(&t);
        }
    }

    /// Statistics so far (on CUDA this waits for the timing events issued so far).
    pub fn stats(&mut self) -> Result<StreamStats> {
        self.take_deferred()?;
        self.resolve_timings(true)?;
        Ok(self.stats.clone())
    }

    /// Clears the statistics counters and the transition log.
    pub fn reset_stats(&mut self) -> Result<()> {
        self.resolve_timings(true)?;
        self.stats.reset();
        if let Some(tl) = &mut self.timeline {
            tl.clear();
        }
        self.calibrate_host_clock()
    }

    /// The recorded timeline, if enabled (on CUDA this waits for its events).
    pub fn timeline(&mut self) -> Result<Option<&Timeline>> {
        self.resolve_timings(true)?;
        Ok(self.timeline.as_ref())
    }

    /// Folds finished timings into the statistics. With `all`, waits for all.
    pub(crate) fn resolve_timings(&mut self, all: bool) -> Result<()> {
        let (stats, mut timeline, names) = (&mut self.stats, self.timeline.as_mut(), &self.names);
        self.engine.resolve(all, &mut |t| {
            add_timing(stats, timeline.as_deref_mut(), names, t)
        })
    }

    /// Adds device-to-host traffic (gradients) to the statistics.
    pub fn add_d2h(&mut self, bytes: u64, seconds: f64) {
        self.stats.d2h_bytes += bytes;
        self.stats.d2h_seconds += seconds;
    }

    /// Adds host time spent blocked on the pool's work.
    pub fn add_host_wait(&mut self, seconds: f64) {
        self.stats.host_wait_seconds += seconds;
    }
}

/// Adds a copy's or a compute's timing to the statistics and the timeline:
/// one place for both engines.
pub(super) fn add_timing(
    stats: &mut StreamStats,
    timeline: Option<&mut Timeline>,
    names: &[String],
    t: Timing,
) {
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    match t {
        Timing::Transfer { block, ts, took } => {
            stats.h2d_seconds += took.as_secs_f64();
            if let Some(tl) = timeline {
                tl.push(TraceKind::Transfer, &names[block], ts, us(took));
            }
        }
        Timing::Compute {
            block,
            ts,
            stall,
            took,
        } => {
            stats.stall_seconds += stall.as_secs_f64();
            stats.compute_seconds += took.as_secs_f64();
            if let Some(tl) = timeline {
                let name = &names[block];
                if us(stall) > 0.0 {
                    tl.push(TraceKind::Stall, name, ts, us(stall));
                }
                tl.push(TraceKind::Compute, name, ts + us(stall), us(took));
            }
        }
    }
}
