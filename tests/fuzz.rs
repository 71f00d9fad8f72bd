//! Fuzzing the loaders we wrote, on stable Rust: `config.json`
//! (`LlamaConfig::from_json_file`), a shard index (`expand_paths` on a
//! `model.safetensors.index.json`), `checkpoint.json` (`CheckpointFiles::read`),
//! optimizer state (`CpuAdamW::load`, `CpuSgd::load`: safetensors and its
//! metadata) and the command-line parsers (`parse_bytes`, `cli::parse_dtype`,
//! `LlamaConfig::preset`).
//!
//! Each case takes a valid seed (written by the project's own save code where it
//! has one) and applies one to three mutations drawn through
//! `arbitrary::Unstructured` from a seeded RNG: truncation, bit flips, inserted
//! and deleted bytes, interesting integers over 8 bytes, raw JSON tokens (`1e400`,
//! `18446744073709551616`, `NaN`, unbalanced brackets), and structural JSON edits
//! (a value replaced by one of the wrong type or a huge number, keys removed or
//! added, deep nesting), the safetensors header edited as JSON and re-framed.
//! Every case runs under `catch_unwind` on a worker thread with a time limit: a
//! panic, a hang or a broken property (a failed load that changed the optimizer,
//! a shard or checkpoint file outside its folder, a parse that disagrees with the
//! reference) is a failure; an error is the expected answer to bad input.
//!
//! CI runs a few hundred cases per target (`STREAMER_FUZZ_CASES`); the bench
//! `cargo bench --bench fuzz` runs 10^5 per target and writes
//! `benches/results/fuzz-cpu.json` (it includes this file as a module).
#![allow(dead_code)]
use anyhow::{bail, ensure, Context, Result};
use arbitrary::Unstructured;
use candle_core::{Device, Tensor, Var};
use candle_nn::ParamsAdamW;
use candle_streamer::streamer_autograd::{CpuAdamW, CpuSgd, ParamsSgd};
use rand::{rngs::StdRng, RngCore, SeedableRng};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use streamer_models::LlamaConfig;

/// The targets, by name.
pub const TARGETS: [&str; 7] = [
    "config_json",
    "shard_index",
    "checkpoint_json",
    "adamw_state",
    "sgd_state",
    "parse_bytes",
    "cli_flags",
];

/// What a loader said to one input.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Verdict {
    Accepted,
    Rejected,
}

type Check = Box<dyn FnMut(&[u8]) -> Result<Verdict> + Send>;

/// One loader with its valid seeds and how to mutate them.
pub struct Target {
    pub name: &'static str,
    seeds: Vec<Vec<u8>>,
    /// The seeds are safetensors files (header mutations apply).
    safetensors: bool,
    check: Check,
    dir: PathBuf,
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Counts of one target's run.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub name: String,
    pub cases: usize,
    pub accepted: usize,
    pub rejected: usize,
    /// Panics and broken properties: (input, message), the first few.
    pub failures: Vec<(String, String)>,
    pub failed: usize,
    pub max_case_ms: f64,
    pub seconds: f64,
}

fn temp_dir(name: &str) -> Result<PathBuf> {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let k = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let d = std::env::temp_dir().join(format!("streamer-fuzz-{name}-{}-{k}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

/// Builds the target `name` with its seeds, in a fresh temporary folder.
pub fn target(name: &str) -> Result<Target> {
    let dir = temp_dir(name)?;
    let (name, seeds, safetensors, check): (&'static str, _, _, Check) = match name {
        "config_json" => ("config_json", config_seeds()?, false, config_check(&dir)),
        "shard_index" => ("shard_index", index_seeds(), false, index_check(&dir)),
        "checkpoint_json" => (
            "checkpoint_json",
            checkpoint_seeds()?,
            false,
            checkpoint_check(&dir),
        ),
        "adamw_state" => {
            let (seeds, check) = adamw_target(&dir)?;
            ("adamw_state", seeds, true, check)
        }
        "sgd_state" => {
            let (seeds, check) = sgd_target(&dir)?;
            ("sgd_state", seeds, true, check)
        }
        "parse_bytes" => ("parse_bytes", bytes_seeds(), false, Box::new(bytes_check)),
        "cli_flags" => ("cli_flags", flag_seeds(), false, Box::new(flags_check)),
        _ => bail!("unknown fuzz target {name:?} (one of {TARGETS:?})"),
    };
    Ok(Target {
        name,
        seeds,
        safetensors,
        check,
        dir,
    })
}

// ---- config.json ---------------------------------------------------------

fn config_seeds() -> Result<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    for p in ["tiny", "350m", "1b", "3b"] {
        out.push(LlamaConfig::preset(p)?.to_json()?.into_bytes());
    }
    // A Hugging Face file as published (extra fields, llama3 rope scaling).
    out.push(
        json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
            "tie_word_embeddings": true, "torch_dtype": "bfloat16", "hidden_act": "silu",
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}
        })
        .to_string()
        .into_bytes(),
    );
    Ok(out)
}

fn config_check(dir: &Path) -> Check {
    let path = dir.join("config.json");
    Box::new(move |bytes| {
        std::fs::write(&path, bytes)?;
        match LlamaConfig::from_json_file(&path) {
            Ok(cfg) => {
                // What it accepts validates and survives its own writer.
                cfg.validate()?;
                let again = LlamaConfig::from_json(&cfg.to_json()?)?;
                ensure!(
                    serde_json::to_value(&cfg)? == serde_json::to_value(&again)?,
                    "to_json/from_json changed {cfg:?} into {again:?}"
                );
                Ok(Verdict::Accepted)
            }
            Err(_) => Ok(Verdict::Rejected),
        }
    })
}

/// Found by the fuzzer and fixed with serde_json's `float_roundtrip` feature
/// (workspace Cargo.toml): a config written by `to_json` reads back bit for
/// bit, so a checkpoint's `rope_theta` no longer drifts by one ulp per save.
#[test]
fn config_json_floats_round_trip_exactly() -> Result<()> {
    let cfg = LlamaConfig {
        rope_theta: 5.3821420888137005e17,
        ..LlamaConfig::tiny()
    };
    let again = LlamaConfig::from_json(&cfg.to_json()?)?;
    ensure!(
        again.rope_theta.to_bits() == cfg.rope_theta.to_bits(),
        "rope_theta {:e} reads back as {:e}",
        cfg.rope_theta,
        again.rope_theta
    );
    Ok(())
}

/// Also found and fixed: `validate` bounded no size, so a `config.json` of
/// 10^12 layers or a 2^40-wide model was accepted, and then `weight_shapes`
/// looped for hours and `num_params` overflowed. Now each is an error naming
/// the field and the value.
#[test]
fn config_json_absurd_sizes_are_refused() -> Result<()> {
    let base = serde_json::to_value(LlamaConfig::tiny())?;
    for (field, value) in [
        ("num_hidden_layers", json!(1_000_000_000_000u64)),
        ("vocab_size", json!(1u64 << 40)),
        ("intermediate_size", json!(1u64 << 40)),
    ] {
        let mut v = base.clone();
        v[field] = value.clone();
        match LlamaConfig::from_json(&v.to_string()) {
            Ok(_) => anyhow::bail!("a config with {field} = {value} is accepted"),
            Err(e) => {
                let msg = e.to_string();
                ensure!(
                    msg.contains(field) && msg.contains(&value.to_string()),
                    "the error for {field} = {value} names neither: {msg}"
                );
            }
        }
    }
    Ok(())
}

// ---- model.safetensors.index.json ----------------------------------------

fn index_seeds() -> Vec<Vec<u8>> {
    let names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ];
    let map = |shards: usize| -> Value {
        let m: serde_json::Map<String, Value> = names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let s = format!("model-{:05}-of-{shards:05}.safetensors", i % shards + 1);
                (n.to_string(), json!(s))
            })
            .collect();
        json!({"metadata": {"total_size": 123456}, "weight_map": m})
    };
    [1, 2, 3]
        .into_iter()
        .map(|k| serde_json::to_vec_pretty(&map(k)).unwrap_or_default())
        .collect()
}

fn index_check(dir: &Path) -> Check {
    let path = dir.join("model.safetensors.index.json");
    let dir = dir.to_path_buf();
    Box::new(move |bytes| {
        std::fs::write(&path, bytes)?;
        match streamer_core::expand_paths(&[&path]) {
            Ok(files) => {
                ensure!(!files.is_empty(), "an accepted index named no shards");
                for f in &files {
                    ensure!(
                        f.parent() == Some(dir.as_path()) && f.file_name().is_some(),
                        "shard {} is outside the index's folder",
                        f.display()
                    );
                }
                Ok(Verdict::Accepted)
            }
            Err(_) => Ok(Verdict::Rejected),
        }
    })
}

// ---- checkpoint.json -----------------------------------------------------

/// `checkpoint.json` as `LmTrainer::save` writes it (a micro model saved once).
fn checkpoint_seeds() -> Result<Vec<Vec<u8>>> {
    let cfg = LlamaConfig {
        max_position_embeddings: 8,
        ..LlamaConfig::bytes(8, 1, 1, 1)
    };
    let dir = temp_dir("checkpoint-seed")?;
    let weights = streamer_models::init_weights(&cfg, 0)?;
    let model = streamer_models::Llama::from_tensors(weights, &cfg, Default::default())?;
    streamer_models::LmTrainer::new(model, ParamsAdamW::default())?.save(&dir)?;
    let real = std::fs::read(dir.join("checkpoint.json"))?;
    let _ = std::fs::remove_dir_all(&dir);
    let big = json!({"step": 123456789, "config": "config.json",
        "weights": "weights-123456789.safetensors", "optimizer": "optimizer-123456789.safetensors"});
    Ok(vec![real, big.to_string().into_bytes()])
}

fn checkpoint_check(dir: &Path) -> Check {
    let dir = dir.to_path_buf();
    Box::new(move |bytes| {
        std::fs::write(dir.join("checkpoint.json"), bytes)?;
        match streamer_models::CheckpointFiles::read(&dir) {
            Ok(f) => {
                for p in [&f.config, &f.weights, &f.optimizer] {
                    ensure!(
                        p.parent() == Some(dir.as_path()),
                        "checkpoint file {} is outside the checkpoint folder",
                        p.display()
                    );
                }
                Ok(Verdict::Accepted)
            }
            Err(_) => Ok(Verdict::Rejected),
        }
    })
}

// ---- optimizer state -----------------------------------------------------

/// Small params with the names a model would give them.
fn optimizer_vars() -> Result<(Vec<Var>, Vec<String>)> {
    let shapes: [&[usize]; 3] = [&[3], &[2, 4], &[5]];
    let vars = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n: usize = s.iter().product();
            let v: Vec<f32> = (0..n).map(|j| (j as f32 * 0.3 + i as f32).sin()).collect();
            Ok(Var::from_vec(v, *s, &Device::Cpu)?)
        })
        .collect::<Result<Vec<_>>>()?;
    let names = ["embed.weight", "layers.0.w", "norm.weight"];
    Ok((vars, names.iter().map(|s| s.to_string()).collect()))
}

/// Gradients for every var (so each param's state is non-zero after a step).
fn grads_of(vars: &[Var]) -> Result<candle_core::backprop::GradStore> {
    let mut loss = Tensor::zeros((), candle_core::DType::F32, &Device::Cpu)?;
    for v in vars {
        loss = (loss + v.as_tensor().sqr()?.sum_all()?)?;
    }
    Ok(loss.backward()?)
}

fn adamw_target(dir: &Path) -> Result<(Vec<Vec<u8>>, Check)> {
    let (vars, names) = optimizer_vars()?;
    let params = ParamsAdamW {
        weight_decay: 0.01,
        ..Default::default()
    };
    let fresh = {
        let (vars, names, params) = (vars.clone(), names.clone(), params.clone());
        move || -> Result<CpuAdamW> {
            let mut o = CpuAdamW::new(vars.clone(), params.clone())?;
            o.set_param_names(names.clone())?;
            Ok(o)
        }
    };
    let mut seeds = Vec::new();
    let seed_path = dir.join("seed.safetensors");
    let mut o = fresh()?;
    for _ in 0..2 {
        o.step(&grads_of(&vars)?)?;
        seeds.push(saved_bytes(&seed_path, |p| o.save(p))?);
    }
    let path = dir.join("adamw.safetensors");
    let check = Box::new(move |bytes: &[u8]| {
        std::fs::write(&path, bytes)?;
        let mut o = fresh()?;
        let zero = |o: &CpuAdamW| {
            (0..o.vars().len()).all(|i| {
                o.moments(i)
                    .is_some_and(|(m, v)| m.iter().chain(v.iter()).all(|&x| x == 0.0))
            })
        };
        match o.load(&path) {
            Ok(()) => Ok(Verdict::Accepted),
            Err(e) => {
                ensure!(
                    o.step_count() == 0 && zero(&o),
                    "a failed load ({e}) changed the optimizer"
                );
                Ok(Verdict::Rejected)
            }
        }
    });
    Ok((seeds, check))
}

/// The bytes that `save` writes to `path`.
fn saved_bytes(
    path: &Path,
    save: impl FnOnce(&Path) -> candle_core::Result<()>,
) -> Result<Vec<u8>> {
    save(path)?;
    Ok(std::fs::read(path)?)
}

fn sgd_target(dir: &Path) -> Result<(Vec<Vec<u8>>, Check)> {
    let (vars, names) = optimizer_vars()?;
    let fresh = {
        let (vars, names) = (vars.clone(), names.clone());
        move |momentum: f64| -> Result<CpuSgd> {
            let params = ParamsSgd {
                lr: 0.1,
                momentum,
                dampening: 0.0,
                weight_decay: 0.0,
                nesterov: momentum > 0.0,
            };
            let mut o = CpuSgd::new(vars.clone(), params)?;
            o.set_param_names(names.clone())?;
            Ok(o)
        }
    };
    let mut seeds = Vec::new();
    let seed_path = dir.join("seed.safetensors");
    for momentum in [0.9, 0.0] {
        let mut o = fresh(momentum)?;
        o.step(&grads_of(&vars)?)?;
        seeds.push(saved_bytes(&seed_path, |p| o.save(p))?);
    }
    let path = dir.join("sgd.safetensors");
    let check = Box::new(move |bytes: &[u8]| {
        std::fs::write(&path, bytes)?;
        let mut o = fresh(0.9)?;
        match o.load(&path) {
            Ok(()) => Ok(Verdict::Accepted),
            Err(e) => {
                let untouched = (0..o.vars().len()).all(|i| {
                    o.momentum_buffer(i)
                        .is_some_and(|b| b.iter().all(|&x| x == 0.0))
                });
                ensure!(
                    o.step_count() == 0 && o.params().momentum == 0.9 && untouched,
                    "a failed load ({e}) changed the optimizer"
                );
                Ok(Verdict::Rejected)
            }
        }
    });
    Ok((seeds, check))
}

// ---- command-line parsers ------------------------------------------------

fn bytes_seeds() -> Vec<Vec<u8>> {
    [
        "2GiB", "1.5G", "4096", " 10 MiB ", "0", "3TiB", "7kb", "512M", "1.25ki",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}

/// The reference for a plain `<digits><unit>` input (a whole number of units),
/// in exact integer arithmetic; `None` for any other input.
fn bytes_reference(s: &str) -> Option<Option<usize>> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() || num.len() > 15 {
        return None;
    }
    let n: u128 = num.parse().ok()?;
    let mult: u128 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1000,
        "m" | "mb" => 1000u128.pow(2),
        "g" | "gb" => 1000u128.pow(3),
        "ki" | "kib" => 1 << 10,
        "mi" | "mib" => 1 << 20,
        "gi" | "gib" => 1 << 30,
        _ => return None,
    };
    // Exact below 2^53, where f64 holds every integer.
    let want = n * mult;
    (want < 1 << 53).then_some(usize::try_from(want).ok())
}

fn bytes_check(bytes: &[u8]) -> Result<Verdict> {
    let s = String::from_utf8_lossy(bytes);
    let got = streamer_models::parse_bytes(&s);
    if let Some(want) = bytes_reference(&s) {
        ensure!(
            got.as_ref().ok() == want.as_ref(),
            "parse_bytes({s:?}) = {got:?}, the reference {want:?}"
        );
    }
    Ok(if got.is_ok() {
        Verdict::Accepted
    } else {
        Verdict::Rejected
    })
}

fn flag_seeds() -> Vec<Vec<u8>> {
    ["f32", "bf16", "f16", "tiny", "350m", "1b", "3b"]
        .iter()
        .map(|s| s.as_bytes().to_vec())
        .collect()
}

/// `--dtype` and `--preset`: exactly their documented values parse.
fn flags_check(bytes: &[u8]) -> Result<Verdict> {
    let s = String::from_utf8_lossy(bytes);
    let dtype = candle_streamer::cli::parse_dtype(&s);
    ensure!(
        dtype.is_ok() == ["f32", "bf16", "f16"].contains(&&*s),
        "parse_dtype({s:?}) = {dtype:?}"
    );
    let preset = LlamaConfig::preset(&s);
    ensure!(
        preset.is_ok() == ["tiny", "350m", "1b", "3b"].contains(&&*s),
        "preset({s:?}) is {}",
        if preset.is_ok() {
            "accepted"
        } else {
            "refused"
        }
    );
    Ok(if dtype.is_ok() || preset.is_ok() {
        Verdict::Accepted
    } else {
        Verdict::Rejected
    })
}

// ---- mutations -----------------------------------------------------------

/// JSON tokens that are valid or nearly so and stress number and type handling.
const RAW_TOKENS: [&str; 18] = [
    "1e400",
    "-1e400",
    "18446744073709551616",
    "-9223372036854775809",
    "NaN",
    "Infinity",
    "-0",
    "0.0000000000000000000001",
    "\"\\u0000\"",
    "\"\\ud800\"",
    "null",
    "[",
    "]",
    "{",
    "}",
    ",",
    "\"",
    ":",
];

/// A JSON value of a surprising type or size.
fn junk_value(u: &mut Unstructured) -> arbitrary::Result<Value> {
    Ok(match u.int_in_range(0..=17)? {
        0 => json!(u64::MAX),
        1 => json!(-1),
        2 => json!(i64::MIN),
        3 => json!(1e300),
        4 => json!(0),
        5 => json!(0.5),
        6 => json!("NaN"),
        7 => json!("inf"),
        8 => json!("99999999999999999999"),
        9 => json!(""),
        10 => json!(true),
        11 => Value::Null,
        12 => json!([]),
        13 => json!({}),
        14 => {
            let depth = u.int_in_range(10..=300)?;
            serde_json::from_str(&format!("{}{}", "[".repeat(depth), "]".repeat(depth)))
                .unwrap_or(Value::Null)
        }
        15 => json!(u.arbitrary::<String>()?),
        16 => json!(u.arbitrary::<i64>()?),
        _ => json!("../../../etc/passwd"),
    })
}

/// JSON pointers of every node under `v`.
fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let p = format!("{at}/{}", k.replace('~', "~0").replace('/', "~1"));
                pointers(x, p, out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                pointers(x, format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
    out.push(at);
}

/// One structural edit of a JSON value: replace a node, remove it, or add a key.
fn mutate_value(v: &mut Value, u: &mut Unstructured) -> arbitrary::Result<()> {
    let mut ptrs = Vec::new();
    pointers(v, String::new(), &mut ptrs);
    let p = u.choose(&ptrs)?.clone();
    match u.int_in_range(0..=2)? {
        0 => {
            let junk = junk_value(u)?;
            if let Some(node) = v.pointer_mut(&p) {
                *node = junk;
            }
        }
        1 => {
            let (parent, key) = p.rsplit_once('/').unwrap_or(("", ""));
            let key = key.replace("~1", "/").replace("~0", "~");
            match v.pointer_mut(parent) {
                Some(Value::Object(m)) => {
                    m.remove(&key);
                }
                Some(Value::Array(a)) => {
                    if let Ok(i) = key.parse::<usize>() {
                        if i < a.len() {
                            a.remove(i);
                        }
                    }
                }
                _ => {}
            }
        }
        _ => {
            let (key, junk) = (u.arbitrary::<String>()?, junk_value(u)?);
            if let Some(Value::Object(m)) = v.pointer_mut(&p) {
                m.insert(key, junk);
            }
        }
    }
    Ok(())
}

/// One byte-level edit.
fn mutate_bytes(b: &mut Vec<u8>, u: &mut Unstructured) -> arbitrary::Result<()> {
    let len = b.len();
    let at = u.int_in_range(0..=len)?;
    match u.int_in_range(0..=6)? {
        0 => b.truncate(at),
        1 if len > 0 => {
            let i = at.min(len - 1);
            b[i] ^= 1 << u.int_in_range(0..=7)?;
        }
        2 if len > 0 => {
            let i = at.min(len - 1);
            b[i] = *u.choose(&[0u8, 0xff, 0x7f, 0x80, b'"', b'{', b'9', b'-'])?;
        }
        3 => {
            let extra: Vec<u8> = u.arbitrary()?;
            b.splice(at..at, extra.into_iter().take(64));
        }
        4 => {
            let end = u.int_in_range(at..=len.min(at + 64))?;
            b.drain(at..end);
        }
        5 => {
            let tok = u.choose(&RAW_TOKENS)?;
            b.splice(at..at, tok.bytes());
        }
        _ => {
            let x = *u.choose(&[0u64, u64::MAX, i64::MAX as u64, 1 << 32, len as u64 + 1])?;
            let end = (at + 8).min(len);
            b.splice(at..end, x.to_le_bytes());
        }
    }
    Ok(())
}

/// A structural edit of a safetensors header (tensor dtypes, shapes, offsets,
/// `__metadata__` values), re-framed with its length prefix (sometimes a wrong one).
fn mutate_safetensors(b: &mut Vec<u8>, u: &mut Unstructured) -> arbitrary::Result<()> {
    let n = b
        .get(..8)
        .and_then(|h| h.try_into().ok())
        .map(u64::from_le_bytes)
        .and_then(|n| usize::try_from(n).ok())
        .filter(|&n| n <= b.len().saturating_sub(8));
    let Some(n) = n else {
        return mutate_bytes(b, u);
    };
    let Ok(mut header) = serde_json::from_slice::<Value>(&b[8..8 + n]) else {
        return mutate_bytes(b, u);
    };
    if u.ratio(1, 3)? {
        let dtype = json!(*u.choose(&["F16", "BF16", "I64", "BOOL", "U8", "F64", "X9"])?);
        let ptrs: Vec<String> = header
            .as_object()
            .map(|m| {
                m.keys()
                    .map(|k| format!("/{}/dtype", k.replace('~', "~0").replace('/', "~1")))
                    .collect()
            })
            .unwrap_or_default();
        if let Some(node) = u.choose(&ptrs).ok().and_then(|p| header.pointer_mut(p)) {
            *node = dtype;
        }
    } else {
        mutate_value(&mut header, u)?;
    }
    let text = serde_json::to_vec(&header).unwrap_or_default();
    let len = match u.int_in_range(0..=7)? {
        0 => text.len() as u64 + 1,
        1 => text.len().saturating_sub(1) as u64,
        _ => text.len() as u64,
    };
    let data = b[8 + n..].to_vec();
    b.clear();
    b.extend(len.to_le_bytes());
    b.extend(text);
    b.extend(data);
    Ok(())
}

/// One to three mutations of `seed`.
fn mutate(seed: &[u8], safetensors: bool, u: &mut Unstructured) -> arbitrary::Result<Vec<u8>> {
    let mut b = seed.to_vec();
    for _ in 0..u.int_in_range(1..=3)? {
        match u.int_in_range(0..=3)? {
            0 | 1 if safetensors => mutate_safetensors(&mut b, u)?,
            0 | 1 => match serde_json::from_slice::<Value>(&b) {
                Ok(mut v) => {
                    mutate_value(&mut v, u)?;
                    b = serde_json::to_vec(&v).unwrap_or_default();
                }
                Err(_) => mutate_bytes(&mut b, u)?,
            },
            _ => mutate_bytes(&mut b, u)?,
        }
    }
    Ok(b)
}

// ---- the runner ----------------------------------------------------------

/// A short printable form of an input.
fn show(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(&b[..b.len().min(300)]).into_owned();
    if b.len() > 300 {
        format!("{s:?}... ({} bytes)", b.len())
    } else {
        format!("{s:?}")
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(non-string panic)".into())
}

/// Runs `cases` cases of `target` (its seeds unmutated first, each of which
/// must be accepted) on a worker thread. A case that takes longer than `limit`
/// is a hang: the run stops with an error naming the input.
pub fn run(mut target: Target, cases: usize, seed: u64, limit: Duration) -> Result<Report> {
    let name = target.name;
    let current = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = mpsc::channel();
    let cur = current.clone();
    let worker = std::thread::spawn(move || {
        let mut rng = StdRng::seed_from_u64(seed ^ fnv(target.name));
        let mut noise = vec![0u8; 1024];
        for i in 0..cases {
            let input = match target.seeds.get(i) {
                Some(s) => s.clone(),
                None => {
                    rng.fill_bytes(&mut noise);
                    let mut u = Unstructured::new(&noise);
                    let s = u.choose(&target.seeds).cloned().unwrap_or_default();
                    mutate(&s, target.safetensors, &mut u).unwrap_or(s)
                }
            };
            if let Ok(mut c) = cur.lock() {
                c.clone_from(&input);
            }
            let t = Instant::now();
            let r =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (target.check)(&input)));
            let r = r.map_err(|p| format!("panic: {}", panic_message(&*p)));
            let is_seed = i < target.seeds.len();
            if tx.send((is_seed, input, r, t.elapsed())).is_err() {
                break;
            }
        }
        drop(target);
    });
    let report = collect(name, cases, &rx, limit, &current)?;
    worker
        .join()
        .map_err(|_| anyhow::anyhow!("{name}: the worker died"))?;
    Ok(report)
}

type CaseResult = (
    bool,
    Vec<u8>,
    std::result::Result<Result<Verdict>, String>,
    Duration,
);

fn collect(
    name: &str,
    cases: usize,
    rx: &mpsc::Receiver<CaseResult>,
    limit: Duration,
    current: &Mutex<Vec<u8>>,
) -> Result<Report> {
    let t0 = Instant::now();
    let mut r = Report {
        name: name.to_string(),
        ..Default::default()
    };
    for i in 0..cases {
        let (is_seed, input, out, took) = match rx.recv_timeout(limit) {
            Ok(x) => x,
            Err(_) => {
                let input = current.lock().map(|c| show(&c)).unwrap_or_default();
                bail!("{name}: case {i} did not finish within {limit:?} (a hang): input {input}")
            }
        };
        r.cases += 1;
        r.max_case_ms = r.max_case_ms.max(took.as_secs_f64() * 1e3);
        let failure = match out {
            Ok(Ok(Verdict::Accepted)) => {
                r.accepted += 1;
                None
            }
            Ok(Ok(Verdict::Rejected)) if is_seed => Some("a valid seed was rejected".to_string()),
            Ok(Ok(Verdict::Rejected)) => {
                r.rejected += 1;
                None
            }
            Ok(Err(e)) => Some(format!("{e:#}")),
            Err(p) => Some(p),
        };
        if let Some(msg) = failure {
            r.failed += 1;
            if r.failures.len() < 5 {
                r.failures.push((show(&input), msg));
            }
        }
    }
    r.seconds = t0.elapsed().as_secs_f64();
    Ok(r)
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

// ---- the CI seed set -----------------------------------------------------

/// A short run of one target: no panic, no hang, no broken property; the seeds
/// load and some mutants are refused.
fn seed_set(name: &str) -> Result<()> {
    let cases = std::env::var("STREAMER_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let t = target(name)?;
    let r = run(t, cases, 1, Duration::from_secs(30)).context(name.to_string())?;
    ensure!(
        r.failed == 0,
        "{name}: {} failures: {:#?}",
        r.failed,
        r.failures
    );
    ensure!(r.rejected > 0, "{name}: no mutant was refused: {r:?}");
    ensure!(r.cases == cases, "{name}: {r:?}");
    Ok(())
}

/// One test a seed set: `name: "target"` runs [`seed_set`] on the target.
macro_rules! seed_set_tests {
    ($($name:ident: $target:literal,)*) => {
        $(
            #[test]
            fn $name() -> Result<()> {
                seed_set($target)
            }
        )*
    };
}

seed_set_tests! {
    fuzz_config_json_only_errors: "config_json",
    fuzz_shard_index_only_errors: "shard_index",
    fuzz_checkpoint_json_only_errors: "checkpoint_json",
    fuzz_adamw_state_only_errors: "adamw_state",
    fuzz_sgd_state_only_errors: "sgd_state",
    fuzz_parse_bytes_only_errors: "parse_bytes",
    fuzz_cli_flags_only_errors: "cli_flags",
}
