//! The reliability table (issue 12): faults injected and survived per kind
//! (the cases of `tests/faults.rs`, run here on the bench's device, plus the
//! real device-full case on CUDA), bad inputs tried and refused (run here),
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
use candle_core::{Device, Tensor, Var};
use candle_nn::ParamsAdamW;
use candle_streamer::cli;
use serde_json::{json, Value};
use streamer_autograd::{CpuAdamW, CpuSgd, ParamsSgd};
use streamer_models::{parse_bytes, LlamaConfig};

mod common;
#[path = "../tests/faults.rs"]
mod faults;

/// One bad input: what it is, and the call that must refuse it.
type BadInput = (String, Box<dyn Fn() -> candle_core::Result<()>>);

fn cli_inputs() -> Vec<BadInput> {
    let mut v: Vec<BadInput> = Vec::new();
    for lr in [f64::NAN, f64::INFINITY, -1e-3, 0.0] {
        v.push((
            format!("--lr {lr}"),
            Box::new(move || cli::learning_rate("--lr", lr).map(drop)),
        ));
    }
    for (wd, lr) in [(f64::NAN, 1e-3), (-0.1, 1e-3), (2000.0, 1e-3)] {
        v.push((
            format!("--weight-decay {wd} with --lr {lr}"),
            Box::new(move || cli::weight_decay("--weight-decay", wd, lr).map(drop)),
        ));
    }
    for x in [0.0, 1.5, f64::NAN] {
        v.push((
            format!("fraction {x}"),
            Box::new(move || cli::fraction("--auto", x).map(drop)),
        ));
    }
    for (n, max) in [(0usize, 1_000_000usize), (1 << 40, 1 << 20)] {
        v.push((
            format!("--steps {n} (max {max})"),
            Box::new(move || cli::count("--steps", n, max).map(drop)),
        ));
    }
    v.push((
        "--prefetch 8 with 4 blocks".into(),
        Box::new(|| cli::prefetch("--prefetch", Some(8), 4).map(drop)),
    ));
    v.push((
        "--seq 100000 on a 512 context".into(),
        Box::new(|| cli::seq_len(Some(100_000), 256, 512).map(drop)),
    ));
    for d in ["f8", ""] {
        v.push((
            format!("--dtype {d:?}"),
            Box::new(move || cli::parse_dtype(d).map(drop)),
        ));
    }
    v.push((
        "--device tpu".into(),
        Box::new(|| cli::device(Some("tpu")).map(drop)),
    ));
    for b in ["12XB", "-5GiB", "99999999999999999999GiB", "", "1.5.2G"] {
        v.push((
            format!("byte count {b:?}"),
            Box::new(move || parse_bytes(b).map(drop)),
        ));
    }
    v
}

fn config_inputs() -> Vec<BadInput> {
    let base = serde_json::to_value(LlamaConfig::tiny()).unwrap_or(Value::Null);
    let mut v: Vec<BadInput> = Vec::new();
    for (field, value) in [
        ("num_hidden_layers", json!(1_000_000_000_000u64)),
        ("vocab_size", json!(1u64 << 40)),
        ("intermediate_size", json!(1u64 << 40)),
        ("hidden_size", json!(0)),
        ("rms_norm_eps", json!(-1.0)),
        ("rope_theta", json!(0.5)),
        ("hidden_act", json!("gelu")),
        ("num_key_value_heads", json!(3)),
    ] {
        let mut c = base.clone();
        c[field] = value.clone();
        let text = c.to_string();
        v.push((
            format!("config.json {field} = {value}"),
            Box::new(move || LlamaConfig::from_json(&text).map(drop)),
        ));
    }
    let cut = base.to_string();
    let cut = cut[..cut.len() / 2].to_string();
    v.push((
        "config.json cut in half".into(),
        Box::new(move || LlamaConfig::from_json(&cut).map(drop)),
    ));
    v
}

fn optimizer_inputs() -> Vec<BadInput> {
    let var = || Var::new(&[1f32, 2., 3.], &Device::Cpu);
    let mut v: Vec<BadInput> = Vec::new();
    for (what, p) in [
        (
            "lr NaN",
            ParamsAdamW {
                lr: f64::NAN,
                ..Default::default()
            },
        ),
        (
            "beta1 1",
            ParamsAdamW {
                beta1: 1.0,
                ..Default::default()
            },
        ),
        (
            "eps 0",
            ParamsAdamW {
                eps: 0.0,
                ..Default::default()
            },
        ),
        (
            "weight_decay inf",
            ParamsAdamW {
                weight_decay: f64::INFINITY,
                ..Default::default()
            },
        ),
    ] {
        v.push((
            format!("AdamW {what}"),
            Box::new(move || CpuAdamW::new(vec![var()?], p.clone()).map(drop)),
        ));
    }
    v.push((
        "SGD nesterov without momentum".into(),
        Box::new(move || {
            CpuSgd::new(
                vec![var()?],
                ParamsSgd {
                    nesterov: true,
                    ..Default::default()
                },
            )
            .map(drop)
        }),
    ));
    for g in [f32::NAN, f32::INFINITY] {
        v.push((
            format!("AdamW step with a {g} gradient"),
            Box::new(move || {
                let w = var()?;
                let mut opt = CpuAdamW::new(vec![w.clone()], ParamsAdamW::default())?;
                opt.begin_step();
                opt.step_tensors(&[(0, &Tensor::new(&[0f32, g, 1.], &Device::Cpu)?)])
            }),
        ));
    }
    v.push((
        "AdamW state from a file of garbage".into(),
        Box::new(move || {
            let path =
                std::env::temp_dir().join(format!("reliability-garbage-{}", std::process::id()));
            std::fs::write(&path, b"\x08\0\0\0\0\0\0\0{garbage}")
                .map_err(candle_core::Error::wrap)?;
            let mut opt = CpuAdamW::new(vec![var()?], ParamsAdamW::default())?;
            let r = opt.load(&path);
            let _ = std::fs::remove_file(&path);
            r
        }),
    ));
    v
}

/// Every bad input: each must be refused with an error.
fn bad_inputs() -> Value {
    let all: Vec<BadInput> = [cli_inputs(), config_inputs(), optimizer_inputs()]
        .into_iter()
        .flatten()
        .collect();
    let mut cases = Vec::new();
    let mut refused = 0;
    for (what, f) in &all {
        let (ok, msg) = match f() {
            Ok(()) => (false, "ACCEPTED".to_string()),
            Err(e) => (true, e.to_string().lines().next().unwrap_or("").to_string()),
        };
        refused += usize::from(ok);
        println!(
            "  {} {what}: {msg}",
            if ok { "refused " } else { "ACCEPTED" }
        );
        cases.push(json!({"input": what, "refused": ok, "error": msg}));
    }
    json!({"tried": all.len(), "refused": refused, "cases": cases})
}

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
    let bad = bad_inputs();
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
    let path = common::results_path(&format!("reliability-{tag}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&out)?)?;
    println!(
        "faults survived {survived}/{injected}; bad inputs refused {}/{}; crash kills {}, recoveries {}; soak {} steps, growth host {} device {}",
        out["bad_inputs"]["refused"], out["bad_inputs"]["tried"], out["crash"]["kills"],
        out["crash"]["recoveries_verified_bit_identical"], out["soak"]["steps"],
        out["soak"]["host_rss_growth_frac"], out["soak"]["device_used_growth_frac"]
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
