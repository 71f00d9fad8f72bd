//! A timeline of copies and compute, written as a Chrome-trace / Perfetto JSON
//! file (open it at ui.perfetto.dev or chrome://tracing) to see the overlap.
use serde::Serialize;
use std::path::Path;

/// Which lane an interval belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceKind {
    /// A block's host-to-device copy (transfer stream).
    Transfer,
    /// A block's compute (compute stream).
    Compute,
    /// Compute waiting for a block's copy to land.
    Stall,
    /// A gradient's device-to-host copy.
    Offload,
    /// Host time of the thread issuing the work (`ResidencyPool::host_span`).
    Host,
}

/// One interval, in microseconds from the pool's creation.
#[derive(Debug, Clone, Serialize)]
pub struct TraceEvent {
    /// What ran (the block's name).
    pub name: String,
    /// Lane: "h2d", "compute", "stall", "d2h" or "host".
    pub cat: &'static str,
    /// Chrome-trace phase: complete event.
    pub ph: &'static str,
    /// Start, microseconds.
    pub ts: f64,
    /// Duration, microseconds.
    pub dur: f64,
    /// Process id (always 0).
    pub pid: u32,
    /// Thread id: the lane (0 transfers, 1 compute, 2 offload, 3 host).
    pub tid: u32,
}

/// The recorded intervals.
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    /// Intervals in the order they were resolved.
    pub events: Vec<TraceEvent>,
}

impl Timeline {
    pub(crate) fn push(&mut self, kind: TraceKind, name: &str, ts_us: f64, dur_us: f64) {
        let (cat, tid) = match kind {
            TraceKind::Transfer => ("h2d", 0),
            TraceKind::Compute => ("compute", 1),
            TraceKind::Stall => ("stall", 1),
            TraceKind::Offload => ("d2h", 2),
            TraceKind::Host => ("host", 3),
        };
        self.events.push(TraceEvent {
            name: name.to_string(),
            cat,
            ph: "X",
            ts: ts_us,
            dur: dur_us,
            pid: 0,
            tid,
        });
    }

    pub(crate) fn clear(&mut self) {
        self.events.clear();
    }

    /// The trace as Chrome-trace JSON text.
    pub fn to_json(&self) -> candle_core::Result<String> {
        #[derive(Serialize)]
        struct Meta {
            name: &'static str,
            ph: &'static str,
            pid: u32,
            tid: u32,
            args: serde_json::Value,
        }
        let lanes = [
            (0, "h2d (transfer stream)"),
            (1, "compute"),
            (2, "d2h (gradients)"),
            (3, "host (issuing thread)"),
        ];
        let mut all: Vec<serde_json::Value> = lanes
            .iter()
            .map(|&(tid, name)| {
                serde_json::to_value(Meta {
                    name: "thread_name",
                    ph: "M",
                    pid: 0,
                    tid,
                    args: serde_json::json!({ "name": name }),
                })
            })
            .collect::<Result<_, _>>()
            .map_err(candle_core::Error::wrap)?;
        for e in &self.events {
            all.push(serde_json::to_value(e).map_err(candle_core::Error::wrap)?);
        }
        serde_json::to_string(&serde_json::json!({ "traceEvents": all, "displayTimeUnit": "ms" }))
            .map_err(candle_core::Error::wrap)
    }

    /// Writes the trace to `path`, creating its folder if it does not exist.
    pub fn write(&self, path: impl AsRef<Path>) -> candle_core::Result<()> {
        let path = path.as_ref();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| {
                candle_core::Error::Msg(format!(
                    "cannot create {} for a timeline: {e}",
                    dir.display()
                ))
            })?;
        }
        std::fs::write(path, self.to_json()?).map_err(|e| {
            candle_core::Error::Msg(format!("cannot write timeline {}: {e}", path.display()))
        })
    }
}
