//! The reliability table (issue 12): faults injected and survived per kind
//! (the cases of `tests/faults.rs`, run here on the bench's device, plus the
//! real device-full case on CUDA), bad inputs tried and refused (those of
//! `tests/bad_inputs.rs`, run here),
//! and, from the result files of their own runs in the same folder, the
//! SIGKILL crash test's kills and recoveries (`crash-<device>.json`), the
//! fuzz cases per target (`fuzz-<device>.json`) and the soak's length and
//! memory growth (`soak-<device>.json`). Writes
//! `benches/results/reliability-<device>.json`; exits non-zero if a fault was
//! not survived, a bad input was accepted, or a source reports a failure.
//!
//!     STREAMER_CRASH_REPORT=$PWD/benches/results/crash-cpu.json \
//!         cargo test --release --test integration crash::
//!     cargo bench --bench fuzz && cargo bench --bench soak
//!     cargo bench --bench reliability
use anyhow::{bail, Result};
use serde_json::{json, Value};

#[path = "../tests/bad_inputs.rs"]
mod bad_inputs;
mod common;
#[path = "../tests/faults.rs"]
mod faults;

/// A result file of another run in this folder, or `null` with how to make it.
fn source(name: &str, how: &str) -> Value {
    let path = common::results_path(name);
    match std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
    {
        Some(v) => v,
        None => json!({"missing": format!("{} not found: run {how}", path.display())}),
    }
}

fn summaries(tag: &str) -> (Value, Value, Value, bool) {
    let crash = source(
        &format!("crash-{tag}.json"),
        &format!("STREAMER_CRASH_REPORT=<this folder>/crash-{tag}.json cargo test --release --test integration crash::"),
    );
    let fuzz = source(&format!("fuzz-{tag}.json"), "cargo bench --bench fuzz");
    let soak = source(&format!("soak-{tag}.json"), "cargo bench --bench soak");
    let fuzz_rows: Vec<Value> = fuzz["targets"]
        .as_array()
        .map(|t| {
            t.iter()
                .map(|r| json!({"target": r["target"], "cases": r["cases"], "failed": r["failed"]}))
                .collect()
        })
        .unwrap_or_default();
    let fuzz_ok = !fuzz_rows.is_empty() && fuzz_rows.iter().all(|r| r["failed"] == 0);
    let soak_row = json!({
        "steps": soak["steps"], "warmup_steps": soak["warmup_steps"], "model": soak["model"],
        "host_rss_growth_frac": soak["host_rss"]["growth_frac"],
        "device_used_growth_frac": soak["device_used"]["growth_frac"],
        "device_live_growth_frac": soak["device_live"]["growth_frac"],
        "pool_peak_demand_growth_frac": soak["pool_peak_demand"]["growth_frac"],
        "criterion": soak["criterion"], "criterion_growth_frac": soak["worst_growth_frac"],
        "raw_worst_growth_frac": soak["raw_worst_growth_frac"], "checkpoints": soak["checkpoints"],
        "target_growth_frac": soak["target_growth_frac"], "pass": soak["pass"], "command": soak["command"],
    });
    let crash_ok = crash["kills"].as_u64().is_some_and(|k| k > 0);
    let ok = crash_ok && fuzz_ok && soak["pass"] == true;
    let fuzz_out = json!({"targets": fuzz_rows, "command": fuzz["command"], "seed": fuzz["seed"], "missing": fuzz["missing"]});
    (crash, fuzz_out, soak_row, ok)
}

fn main() -> Result<()> {
    let dev = common::device();
    let tag = common::device_tag(&dev);
    println!("faults on {:?}:", dev.location());
    let rows = faults::run_all(&dev);
    let mut kinds = Vec::new();
    let (mut injected, mut survived) = (0, 0);
    for r in &rows {
        println!(
            "  {:<30} injected {:>3} survived {:>3}",
            r.kind, r.injected, r.survived
        );
        for f in &r.failures {
            println!("    FAILED: {f}");
        }
        injected += r.injected;
        survived += r.survived;
        kinds.push(json!({"kind": r.kind, "injected": r.injected, "survived": r.survived, "failures": r.failures}));
    }
    println!("bad inputs:");
    let bad = bad_inputs::bad_inputs();
    let (crash, fuzz, soak, sources_ok) = summaries(&tag);
    let out = json!({
        "device": format!("{:?}", dev.location()),
        "command": format!("cargo bench --bench reliability{}", if dev.is_cuda() { " --features cuda" } else { "" }),
        "faults": {
            "injected": injected, "survived": survived, "kinds": kinds,
            "survived_means": "error names what failed; masters, AdamW moments and step count bit-identical to before; nothing left loaded in the pool; retry and next step bit-identical to a run that never failed",
        },
        "crash": crash,
        "fuzz": fuzz,
        "soak": soak,
        "bad_inputs": bad,
    });
    let path = common::write_json(&format!("reliability-{tag}.json"), &out)?;
    println!(
        "faults survived {survived}/{injected}; bad inputs refused {}/{}; crash kills {}, recoveries {}; soak {} steps, pass {}: growth host RSS {}, device live {} (criterion), driver's used device memory {} (reported)",
        out["bad_inputs"]["refused"], out["bad_inputs"]["tried"], out["crash"]["kills"],
        out["crash"]["recoveries_verified_bit_identical"], out["soak"]["steps"],
        out["soak"]["pass"], out["soak"]["host_rss_growth_frac"],
        out["soak"]["device_live_growth_frac"], out["soak"]["device_used_growth_frac"]
    );
    println!("wrote {}", path.display());
    if survived != injected
        || out["bad_inputs"]["refused"] != out["bad_inputs"]["tried"]
        || !sources_ok
    {
        bail!("reliability: a fault was not survived, a bad input was accepted, or a source is missing or failed");
    }
    Ok(())
}
