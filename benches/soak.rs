//! Soak: trains a small streamed MLP for many steps (the run of `tests/soak.rs`:
//! forward, MSE, backward through the pool, `CpuAdamW`, a checkpoint of weights
//! and optimizer state every few hundred steps) and reports how host RSS and
//! device memory grew from the first sample after warm-up to the last.
//! Target: under 0.1 % for the criterion's measures, host RSS and the device
//! memory held at step boundaries (`tests/soak.rs` says why the driver's used
//! memory, which includes the stream-ordered pool's idle reservation, is
//! reported but not counted). Writes `benches/results/soak-<device>.json`
//! (`soak-cpu.json` here, `soak-h200.json` on the GPU) with the criterion's
//! figures and the raw ones (every measure, after and during the warm-up), and
//! exits non-zero when the target is missed.
//!
//!     cargo bench --bench soak                     # CPU: 1,200 steps, 300 warm-up
//!     SOAK_STEPS=5000 SOAK_WARMUP=500 cargo bench --bench soak
//!     # GPU bundle: 10,000 steps of 4 blocks w512 h2048, 1024 tokens, bf16
use anyhow::{bail, Result};

mod common;
#[path = "../tests/soak.rs"]
mod soak;

/// The growth allowed over the run, as a fraction of the first sample.
const TARGET_GROWTH: f64 = 0.001;

fn env_or(key: &str, default: usize) -> Result<usize> {
    match std::env::var(key) {
        Ok(v) => match v.parse() {
            Ok(x) => Ok(x),
            Err(_) => bail!("{key}={v:?} is not a count"),
        },
        Err(_) => Ok(default),
    }
}

/// Each measure's growth after the warm-up (criterion or reported) and over it.
fn print_growth(r: &soak::SoakReport) {
    let rows = [
        ("host RSS", &r.host_rss, true),
        ("device live", &r.device_live, true),
        ("device used", &r.device_used, false),
        ("pool reserved", &r.pool_reserved, false),
        ("pool peak", &r.pool_peak, false),
    ];
    for (name, g, counted) in rows {
        let tag = if counted { "criterion" } else { "reported" };
        println!(
            "{name:<13} first {:>14} last {:>14} max {:>14}  growth {:+.4} % (peak {:+.4} %) [{tag}]",
            g.first,
            g.last,
            g.max,
            g.growth_frac * 100.0,
            g.peak_growth_frac * 100.0
        );
    }
    for (name, g) in &r.warmup_growth {
        println!(
            "warm-up {name:<16} {:>14} -> {:>14}  {:+.4} %",
            g.first,
            g.last,
            g.growth_frac * 100.0
        );
    }
}

fn main() -> Result<()> {
    let dev = common::device();
    let d = soak::SoakOptions::for_device(&dev);
    let steps = env_or("SOAK_STEPS", d.steps)?;
    let o = soak::SoakOptions {
        steps,
        warmup: env_or("SOAK_WARMUP", d.warmup.min(steps / 4))?,
        sample_every: env_or("SOAK_SAMPLE_EVERY", (steps / 200).max(1))?,
        checkpoint_every: env_or("SOAK_CHECKPOINT_EVERY", d.checkpoint_every)?,
        ..d
    };
    println!("soak on {:?}: {o:?}", dev.location());
    println!(
        "{:>7} {:>8} {:>10} {:>14} {:>16} {:>16}",
        "step", "seconds", "loss", "host RSS", "device used", "device live"
    );
    let every = (o.steps / 20).max(1);
    let r = soak::run(&dev, &o, |s| {
        if s.step % every == 0 || s.step + 1 == o.steps {
            println!(
                "{:>7} {:>8.1} {:>10.5} {:>14} {:>16} {:>16}",
                s.step,
                s.seconds,
                s.loss,
                s.host_rss_bytes,
                s.device_used_bytes,
                s.device_live_bytes
            );
        }
    })?;
    print_growth(&r);
    let pass = r.worst_growth() < TARGET_GROWTH;
    println!(
        "{} steps in {:.1} s ({} checkpoints), loss {:.5} -> {:.5}; criterion growth {:+.4} % (target < {} %): {}; raw worst {:+.4} %",
        r.steps,
        r.seconds,
        r.checkpoints,
        r.loss_first,
        r.loss_last,
        r.worst_growth() * 100.0,
        TARGET_GROWTH * 100.0,
        if pass { "PASS" } else { "FAIL" },
        r.raw_worst_growth() * 100.0
    );
    let tag = common::device_tag(&dev);
    let mut json = r.to_json();
    json["device"] = format!("{:?}", dev.location()).into();
    json["command"] = format!(
        "SOAK_STEPS={} SOAK_WARMUP={} SOAK_CHECKPOINT_EVERY={} cargo bench --bench soak{}",
        o.steps,
        o.warmup,
        o.checkpoint_every,
        if dev.is_cuda() {
            " --features cuda"
        } else {
            ""
        }
    )
    .into();
    json["model"] = serde_json::json!({
        "blocks": o.blocks, "width": o.width, "hidden": o.hidden, "batch_rows": o.batch,
        "prefetch_ahead": 1, "compute_dtype": if dev.is_cuda() { "bf16" } else { "f32" },
        "master_dtype": "f32", "optimizer": "CpuAdamW lr 1e-3",
        "checkpoint_every": o.checkpoint_every,
    });
    // When the driver's figure and the pool's reservation moved, and by how
    // much: a cache stepping up once reads differently from a steady climb.
    let changes = |f: fn(&soak::Sample) -> usize| -> Vec<serde_json::Value> {
        r.samples
            .windows(2)
            .filter(|w| f(&w[0]) != f(&w[1]))
            .map(|w| serde_json::json!({"step": w[1].step, "delta_bytes": f(&w[1]) as i64 - f(&w[0]) as i64}))
            .collect()
    };
    json["device_used_changes"] = changes(|s| s.device_used_bytes).into();
    json["pool_reserved_changes"] = changes(|s| s.pool_reserved_bytes).into();
    json["target_growth_frac"] = TARGET_GROWTH.into();
    json["pass"] = pass.into();
    let path = common::results_path(&format!("soak-{tag}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&json)?)?;
    println!("wrote {}", path.display());
    if !pass {
        bail!(
            "memory grew {:.4} % over the soak",
            r.worst_growth() * 100.0
        );
    }
    Ok(())
}
