//! Bad inputs, each of which must be refused with an error naming it: the
//! examples' flag validators (`src/cli.rs`), byte counts, `config.json`
//! fields, optimizer hyper-parameters, non-finite gradients and a garbage
//! optimizer-state file. `benches/reliability.rs` counts them for the
//! reliability table; the test here runs them all.
#![allow(dead_code)]

use candle_core::{Device, Tensor, Var};
use candle_nn::ParamsAdamW;
use candle_streamer::cli;
use serde_json::{json, Value};
use streamer_autograd::{CpuAdamW, CpuSgd, ParamsSgd};
use streamer_models::{parse_bytes, LlamaConfig};

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
pub fn bad_inputs() -> Value {
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

#[test]
fn every_bad_input_is_refused() -> anyhow::Result<()> {
    let r = bad_inputs();
    let accepted: Vec<&Value> = r["cases"]
        .as_array()
        .map(|c| c.iter().filter(|c| c["refused"] != true).collect())
        .unwrap_or_default();
    anyhow::ensure!(
        r["tried"].as_u64().is_some_and(|n| n >= 30),
        "too few cases: {r}"
    );
    anyhow::ensure!(accepted.is_empty(), "accepted: {accepted:?}");
    Ok(())
}
