//! bitsandbytes as the reference: folders that transformers + bitsandbytes
//! saved (`scripts/bnb-fixtures.py` on the GPU machine, found through the
//! `BNB_FIXTURES` variable) read with `read_quantized` and dequantized here
//! (on the CPU, and with `--features cuda` on the GPU) to bitsandbytes'
//! own `dequantize_4bit` / `int8_vectorwise_dequant` values, bit for bit;
//! their logits against a dense model of the dequantized weights.
//!
//! The same comparison always runs on fixtures written here in the same
//! layout, their reference values from the f64 computation of the algorithm
//! (`tests/quant.rs`), so the test checks something without the variable.
//!
//! Fixture layout: `<dir>/<variant>/` (`nf4-double`, `nf4`, `fp4`, `int8`)
//! is a saved model folder (`config.json`, `model.safetensors`) plus
//! `dequantized.safetensors` (every quantized weight by its HF name, in the
//! dtype bitsandbytes dequantizes to: the quant state's dtype for 4-bit,
//! f32 for int8) and, from the script, `logits.safetensors` (`tokens` and
//! `logits`, f32).
use crate::common::{rel_err, temp_dir};
use crate::quant::{reference_4bit, reference_int8, same_bits};
use crate::quant_checkpoint::{bnb, dequantized, four_bit, quantized_model, read_dir, tiny};
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use half::bf16;
use std::collections::HashMap;
use std::path::Path;
use streamer_models::{save_bnb, Llama, LlamaConfig, QuantMethod, QuantizedCheckpoint};
use streamer_quant::{Dequantize, FourBitType, HostTensor};

/// Largest relative logit difference against bitsandbytes' 4-bit model: it
/// computes in bf16 (`bnb_4bit_compute_dtype`), we in f32 from the same
/// dequantized weights, so bf16 rounding of every activation is the gap.
const LOGITS_TOL_4BIT: f64 = 3e-2;
/// The same for int8: bitsandbytes' int8 matmul also quantizes the
/// activations (rows to int8, outliers above `llm_int8_threshold` in f16);
/// ours is weight-only.
const LOGITS_TOL_INT8: f64 = 8e-2;

const VARIANTS: [&str; 4] = ["nf4-double", "nf4", "fp4", "int8"];

fn method(variant: &str) -> QuantMethod {
    match variant {
        "nf4-double" => four_bit(FourBitType::Nf4, true),
        "nf4" => four_bit(FourBitType::Nf4, false),
        "fp4" => four_bit(FourBitType::Fp4, false),
        _ => QuantMethod::Int8,
    }
}

/// The reference values of `q` in the dtype bitsandbytes gives.
fn reference(q: &HostTensor) -> Result<Tensor> {
    Ok(match q {
        HostTensor::FourBit(q) => {
            let v: Vec<bf16> = reference_4bit(q).into_iter().map(bf16::from_f32).collect();
            Tensor::from_vec(v, q.shape(), &Device::Cpu)?
        }
        HostTensor::Int8(q) => Tensor::from_vec(reference_int8(q), q.dims(), &Device::Cpu)?,
        HostTensor::Fp8(_) => anyhow::bail!("no fp8 fixtures"),
    })
}

/// Fixtures in the script's layout, made here; their logits those of the
/// dense model of the reference values (which exercises the comparison's
/// reading of tokens, config and weights; the script's come from
/// bitsandbytes' model).
fn write_fixtures(dir: &Path) -> Result<()> {
    let cfg = tiny();
    for variant in VARIANTS {
        let m = method(variant);
        let w = quantized_model(&cfg, &m)?;
        let d = dir.join(variant);
        save_bnb(&d, &cfg, &bnb(m), &w)?;
        let mut want = HashMap::new();
        for (name, q) in &w.quantized {
            want.insert(name.clone(), reference(q)?);
        }
        candle_core::safetensors::save(&want, d.join("dequantized.safetensors"))?;
        let ids: Vec<i64> = (0..16).map(|i| (i * 53 + 7) % 256).collect();
        let tokens = Tensor::from_vec(ids, (2, 8), &Device::Cpu)?;
        let vb =
            candle_nn::VarBuilder::from_tensors(dense_model(&w, &want)?, DType::F32, &Device::Cpu);
        let logits = Llama::resident(vb, &cfg)?.forward(&tokens.to_dtype(DType::U32)?)?;
        let saved = HashMap::from([
            ("tokens".to_string(), tokens),
            ("logits".to_string(), logits),
        ]);
        candle_core::safetensors::save(&saved, d.join("logits.safetensors"))?;
    }
    Ok(())
}

fn bf16_bits(t: &Tensor) -> Result<Vec<u16>> {
    let v = t
        .flatten_all()?
        .to_device(&Device::Cpu)?
        .to_vec1::<bf16>()?;
    Ok(v.into_iter().map(bf16::to_bits).collect())
}

/// `q` dequantized here equals bitsandbytes' `want` bit for bit: in bf16 on
/// `dev`, and for f32 references also in f32 on the CPU.
fn compare(name: &str, q: &HostTensor, want: &Tensor, dev: &Device) -> Result<()> {
    let up = match q {
        HostTensor::FourBit(q) => q.dequantize_on(dev)?,
        HostTensor::Int8(q) => q.dequantize_on(dev)?,
        HostTensor::Fp8(q) => q.dequantize_on(dev)?,
    };
    ensure!(
        up.dims() == want.dims(),
        "{name}: {:?} against {:?}",
        up.dims(),
        want.dims()
    );
    if want.dtype() == DType::F32 {
        let w = want.flatten_all()?.to_vec1::<f32>()?;
        same_bits(&dequantized(q), &w).with_context(|| format!("{name} in f32"))?;
    }
    let same = bf16_bits(&up)? == bf16_bits(&want.to_dtype(DType::BF16)?)?;
    ensure!(same, "{name}: bf16 dequantization on {dev:?} differs");
    Ok(())
}

/// The quantized weights and dense tensors as one dense f32 map of the
/// values bitsandbytes dequantizes to.
fn dense_model(
    w: &QuantizedCheckpoint,
    want: &HashMap<String, Tensor>,
) -> Result<HashMap<String, Tensor>> {
    let mut all = HashMap::new();
    for (name, t) in w.dense.iter().chain(want) {
        all.insert(name.clone(), t.to_dtype(DType::F32)?);
    }
    Ok(all)
}

/// Logits of the dense model (on the CPU, the reference whatever device
/// dequantized) against the script's, within the stated tolerance; the
/// relative error measured.
fn compare_logits(d: &Path, all: HashMap<String, Tensor>, tol: f64) -> Result<f64> {
    let dev = &Device::Cpu;
    let saved = candle_core::safetensors::load(d.join("logits.safetensors"), &Device::Cpu)?;
    let cfg = LlamaConfig::from_json_file(d.join("config.json"))?;
    let vb = candle_nn::VarBuilder::from_tensors(all, DType::F32, dev);
    let model = Llama::resident(vb, &cfg)?;
    let tokens = saved["tokens"].to_dtype(DType::U32)?.to_device(dev)?;
    let got = model.forward(&tokens)?;
    let err = rel_err(&got, &saved["logits"])?;
    ensure!(
        err <= tol,
        "{}: logits differ by {err:.3e} (tolerance {tol:.0e})",
        d.display()
    );
    Ok(err)
}

/// Every variant under `dir`: weights checked against its config and
/// compared, logits where present. With
/// `resave`, each folder read is saved again into `<variant>/resaved` (for
/// the script's transformers round trip). The tensors compared.
fn check_fixtures(dir: &Path, dev: &Device, resave: bool) -> Result<usize> {
    let mut compared = 0;
    for variant in VARIANTS {
        let d = dir.join(variant);
        if !d.is_dir() {
            continue;
        }
        let (qc, w) = read_dir(&d)?;
        let cfg = LlamaConfig::from_json_file(d.join("config.json"))?;
        w.check(&cfg).with_context(|| variant.to_string())?;
        let want = candle_core::safetensors::load(d.join("dequantized.safetensors"), &Device::Cpu)?;
        ensure!(
            want.len() == w.quantized.len(),
            "{variant}: {} references for {} weights",
            want.len(),
            w.quantized.len()
        );
        for (name, q) in &w.quantized {
            let t = want
                .get(name)
                .with_context(|| format!("{variant}: no reference for {name}"))?;
            compare(name, q, t, dev).with_context(|| variant.to_string())?;
            compared += 1;
        }
        if d.join("logits.safetensors").is_file() {
            let tol = if variant == "int8" {
                LOGITS_TOL_INT8
            } else {
                LOGITS_TOL_4BIT
            };
            let err = compare_logits(&d, dense_model(&w, &want)?, tol)?;
            println!("{variant}: logits within {err:.3e} of the fixture's (tolerance {tol:.0e})");
        }
        if resave {
            save_bnb(d.join("resaved"), &cfg, &qc, &w)?;
        }
    }
    Ok(compared)
}

/// Our dequantization equals bitsandbytes' on fixtures made here and, when
/// `BNB_FIXTURES` names a folder the script wrote, on bitsandbytes' own.
fn bnb_fixtures_dequantize_as_bitsandbytes(dev: &Device) -> Result<()> {
    let dir = temp_dir("bnb_fixtures", "rust")?;
    write_fixtures(&dir)?;
    let n = check_fixtures(&dir, dev, false)?;
    ensure!(n == 4 * 14, "{n} tensors compared");
    let _ = std::fs::remove_dir_all(&dir);
    match std::env::var_os("BNB_FIXTURES") {
        Some(d) => {
            let n = check_fixtures(Path::new(&d), dev, !dev.is_cuda())?;
            ensure!(n > 0, "{}: no fixture folders", Path::new(&d).display());
            println!("bitsandbytes fixtures: {n} tensors equal bit for bit");
        }
        None => println!(
            "BNB_FIXTURES not set: bitsandbytes' own fixtures skipped \
             (scripts/bnb-fixtures.py writes them; docs/development.md)"
        ),
    }
    Ok(())
}
candle_streamer::test_device!(bnb_fixtures_dequantize_as_bitsandbytes);
