//! The long-format table of an attention bench report (`report["table"]`): one
//! row per system and case, with at least `system` (`"cqsa"`, `"naive"`, and
//! PyTorch SDPA's `"flash"` and `"cudnn"` from `attention_torch.py`'s JSON of the
//! same run), `n`, `causal`, `d`, `mask` (`"none"`, `"window:4096"`...),
//! `fwd_tflops` and `fwdbwd_tflops`; cqsa's rows also carry their ratios to
//! cuDNN's row of the same case (`vs_cudnn_fwd`, `vs_cudnn_fwdbwd`), and the
//! out-of-core row, when the report has one, its own figures.
//!
//! `CQSA_BENCH_RETABLE=1` rebuilds the table of an existing report (the bench's
//! `CQSA_BENCH_OUT`, beside `CQSA_BENCH_TORCH_JSON`) without measuring anything,
//! so a report written before the table existed can carry one.
use anyhow::{Context, Result};
use serde_json::{json, Value};

/// One row of the table.
fn row(system: &str, r: &Value, mask: &str, fwd: &Value, fwdbwd: &Value) -> Value {
    json!({
        "system": system, "n": r["n"], "b": r["b"], "causal": r["causal"], "d": r["d"], "mask": mask,
        "fwd_tflops": fwd, "fwdbwd_tflops": fwdbwd,
    })
}

/// Whether two rows describe the same case.
fn same_case(a: &Value, b: &Value) -> bool {
    ["n", "b", "causal", "d", "mask"]
        .iter()
        .all(|k| a[*k] == b[*k])
}

/// The table of `report`, with PyTorch's rows from `torch` (its `rows`, each with
/// `backend`, `fwd_tflops` and `fwd_bwd_tflops`) when given.
pub fn table(report: &Value, torch: Option<&Value>) -> Value {
    let none = Vec::new();
    let list = |v: &Value| v.as_array().unwrap_or(&none).clone();
    let mut rows = Vec::new();
    for r in list(&report["rows"]) {
        rows.push(row(
            "cqsa",
            &r,
            "none",
            &r["cqsa_fwd_tflops"],
            &r["cqsa_fwd_bwd_tflops"],
        ));
        rows.push(row(
            "naive",
            &r,
            "none",
            &r["naive_fwd_tflops"],
            &r["naive_fwd_bwd_tflops"],
        ));
    }
    for r in list(&report["masked"]["rows"])
        .into_iter()
        .chain(list(&report["varlen"]["rows"]))
    {
        let mask = r["mask"].as_str().unwrap_or("none");
        rows.push(row("cqsa", &r, mask, &r["fwd_tflops"], &r["fwdbwd_tflops"]));
    }
    for r in torch.map(|t| list(&t["rows"])).unwrap_or_default() {
        let system = r["backend"].as_str().unwrap_or("torch");
        let mask = r["mask"].as_str().unwrap_or("none");
        rows.push(row(
            system,
            &r,
            mask,
            &r["fwd_tflops"],
            &r["fwd_bwd_tflops"],
        ));
    }
    let peers: Vec<Value> = rows
        .iter()
        .filter(|r| r["system"] == "cudnn")
        .cloned()
        .collect();
    for r in rows.iter_mut().filter(|r| r["system"] == "cqsa") {
        if let Some(p) = peers.iter().find(|p| same_case(r, p)) {
            for (ours, theirs, key) in [
                ("fwd_tflops", "fwd_tflops", "vs_cudnn_fwd"),
                ("fwdbwd_tflops", "fwdbwd_tflops", "vs_cudnn_fwdbwd"),
            ] {
                if let (Some(a), Some(b)) = (r[ours].as_f64(), p[theirs].as_f64()) {
                    r[key] = json!(a / b);
                }
            }
        }
    }
    if let Some(o) = report.get("out_of_core") {
        let mut r = json!({ "system": "cqsa", "mask": "none", "out_of_core": true });
        for k in [
            "n",
            "causal",
            "d",
            "seconds",
            "tflops",
            "peak_device_gib",
            "peak_host_gib",
            "predicted_seconds",
        ] {
            r[k] = o[k].clone();
        }
        r["fwd_tflops"] = o["tflops"].clone();
        rows.push(r);
    }
    Value::Array(rows)
}

/// Reads a JSON file, or `None` when it is missing.
pub fn read(path: &str) -> Result<Option<Value>> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(
            serde_json::from_str(&text).with_context(|| format!("parsing {path}"))?,
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {path}")),
    }
}

/// `CQSA_BENCH_RETABLE=1`: the table of the report at `out` (beside the PyTorch
/// results at `torch`), written back into it.
pub fn retable(out: &str, torch: &str) -> Result<()> {
    let mut report =
        read(out)?.with_context(|| format!("no report at {out} to rebuild the table of"))?;
    report["table"] = table(&report, read(torch)?.as_ref());
    std::fs::write(out, serde_json::to_string_pretty(&report)?)?;
    println!("rebuilt the table of {out}");
    Ok(())
}
