//! Quantized checkpoints in and out (`streamer_models::{read_quantized,
//! save_bnb}`, `QuantizationConfig`): bitsandbytes 4-bit and 8-bit folders
//! written here read back to the same bytes and the same dequantized values;
//! fp8 checkpoints in the fbgemm, fine-grained and compressed-tensors layouts
//! read to the e4m3 bytes and scales written; every unsupported
//! `quantization_config` field and every malformed tensor is refused with an
//! error naming it.
use crate::common::temp_dir;
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::collections::HashMap;
use std::path::Path;
use streamer_device::Error as TypedError;
use streamer_models::{
    init_weights, read_quantized, save_bnb, Fp8Layout, LlamaConfig, QuantMethod,
    QuantizationConfig, QuantizedCheckpoint,
};
use streamer_quant::{Absmax, DequantizeHost, FourBitType, Fp8, HostTensor};

/// A 2-layer byte Llama of width 64 (q_proj: 4096 elements, 64 blocks).
pub(crate) fn tiny() -> LlamaConfig {
    LlamaConfig {
        max_position_embeddings: 32,
        ..LlamaConfig::bytes(64, 2, 4, 2)
    }
}

/// A 4-bit or 8-bit bitsandbytes config keeping `lm_head` dense.
pub(crate) fn bnb(method: QuantMethod) -> QuantizationConfig {
    QuantizationConfig {
        method,
        skip_modules: None,
    }
}

pub(crate) fn four_bit(quant_type: FourBitType, double_quant: bool) -> QuantMethod {
    QuantMethod::FourBit {
        quant_type,
        double_quant,
        compute_dtype: DType::BF16,
    }
}

/// Seeded bf16 weights of `cfg`, quantized on load as `method` says.
pub(crate) fn quantized_model(
    cfg: &LlamaConfig,
    method: &QuantMethod,
) -> Result<QuantizedCheckpoint> {
    let mut weights = init_weights(cfg, 7)?;
    for t in weights.values_mut() {
        *t = t.to_dtype(DType::BF16)?;
    }
    Ok(QuantizedCheckpoint::quantize(
        weights,
        &bnb(method.clone()),
    )?)
}

/// Reads the folder `dir` as its `config.json` says.
pub(crate) fn read_dir(dir: &Path) -> Result<(QuantizationConfig, QuantizedCheckpoint)> {
    let text = std::fs::read_to_string(dir.join("config.json"))?;
    let qc = QuantizationConfig::from_config_json(&text)?.context("no quantization_config")?;
    let w = read_quantized(&[dir.join("model.safetensors")], &qc)?;
    Ok((qc, w))
}

/// Every element of a quantized tensor in f32.
pub(crate) fn dequantized(q: &HostTensor) -> Vec<f32> {
    match q {
        HostTensor::FourBit(q) => q.dequantize_f32(),
        HostTensor::Int8(q) => q.dequantize_f32(),
        HostTensor::Fp8(q) => q.dequantize_f32(),
    }
}

fn same_dense(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> Result<()> {
    ensure!(
        a.len() == b.len(),
        "{} dense tensors against {}",
        a.len(),
        b.len()
    );
    for (name, t) in a {
        let u = b
            .get(name)
            .with_context(|| format!("{name} not read back"))?;
        let f32s = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
        let (x, y) = (f32s(t)?, f32s(u)?);
        ensure!(x == y, "{name} differs");
    }
    Ok(())
}

/// bitsandbytes NF4 (plain and double-quantized absmax), FP4 and int8
/// folders: saved, read back to equal tensors (packed bytes, scales, names)
/// and equal dequantized values, the config's `quantization_config` read
/// back to the one written, and a second save of what was read is the same
/// file, byte for byte.
#[test]
fn bnb_save_read_round_trip() -> Result<()> {
    let cfg = tiny();
    for method in [
        four_bit(FourBitType::Nf4, true),
        four_bit(FourBitType::Nf4, false),
        four_bit(FourBitType::Fp4, true),
        QuantMethod::Int8,
    ] {
        let qc = bnb(method.clone());
        let w = quantized_model(&cfg, &method)?;
        ensure!(w.quantized.len() == 14, "{} quantized", w.quantized.len());
        w.check(&cfg)?;
        let dir = temp_dir("quant_checkpoint", "round_trip")?;
        save_bnb(&dir, &cfg, &qc, &w)?;
        let (qc2, back) = read_dir(&dir)?;
        ensure!(qc2 == qc, "{qc2:?} against {qc:?}");
        back.check(&cfg)?;
        ensure!(back.weight_dtype == w.weight_dtype || method == QuantMethod::Int8);
        ensure!(back.quantized.len() == w.quantized.len());
        for (name, q) in &w.quantized {
            let r = back.quantized.get(name).context("missing")?;
            ensure!(
                format!("{q:?}") == format!("{r:?}"),
                "{name} differs ({method:?})"
            );
            let (a, b) = (dequantized(q), dequantized(r));
            ensure!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{name}"
            );
        }
        same_dense(&w.dense, &back.dense)?;
        let again = temp_dir("quant_checkpoint", "round_trip_again")?;
        save_bnb(&again, &cfg, &qc, &back)?;
        let bytes = |d: &Path| std::fs::read(d.join("model.safetensors"));
        ensure!(
            bytes(&dir)? == bytes(&again)?,
            "{method:?}: the second save differs"
        );
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&again);
    }
    Ok(())
}

/// The tensors and quant state of a double-quantized NF4 weight have
/// bitsandbytes' names, dtypes and shapes, and the quant state is the JSON
/// text bitsandbytes writes (Python's `json.dumps` spacing, its field
/// order); an int8 weight has its `SCB` and a `weight_format` of 0.
#[test]
fn bnb_layout_names_and_quant_state() -> Result<()> {
    let cfg = tiny();
    let dir = temp_dir("quant_checkpoint", "layout")?;
    let method = four_bit(FourBitType::Nf4, true);
    let w = quantized_model(&cfg, &method)?;
    save_bnb(&dir, &cfg, &bnb(method), &w)?;
    let bytes = std::fs::read(dir.join("model.safetensors"))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    let q = "model.layers.1.mlp.down_proj.weight"; // [64, 256]: 256 blocks
    let want: [(&str, Dtype, &[usize]); 5] = [
        ("", Dtype::U8, &[8192, 1]),
        (".absmax", Dtype::U8, &[256]),
        (".quant_map", Dtype::F32, &[16]),
        (".nested_absmax", Dtype::F32, &[1]),
        (".nested_quant_map", Dtype::F32, &[256]),
    ];
    for (suffix, dtype, shape) in want {
        let v = st.tensor(&format!("{q}{suffix}"))?;
        ensure!(
            v.dtype() == dtype && v.shape() == shape,
            "{q}{suffix}: {:?} {:?}",
            v.dtype(),
            v.shape()
        );
    }
    let HostTensor::FourBit(fb) = &w.quantized[q] else {
        anyhow::bail!("not 4-bit")
    };
    let Absmax::Nested(n) = fb.absmax() else {
        anyhow::bail!("not nested")
    };
    let text = format!(
        "{{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"bfloat16\", \"shape\": [64, 256], \
         \"nested_blocksize\": 256, \"nested_dtype\": \"float32\", \"nested_offset\": {}}}",
        // Shortest round-trip digits, as Python's repr (Rust's Display
        // rounds a tie in the 17th digit up where both round it to even).
        serde_json::to_string(&(n.offset as f64))?
    );
    let state = st.tensor(&format!("{q}.quant_state.bitsandbytes__nf4"))?;
    ensure!(
        state.data() == text.as_bytes(),
        "{} against {text}",
        String::from_utf8_lossy(state.data())
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let qcj = &config["quantization_config"];
    ensure!(qcj["quant_method"] == "bitsandbytes" && qcj["load_in_4bit"] == true);
    ensure!(qcj["bnb_4bit_quant_type"] == "nf4" && qcj["bnb_4bit_use_double_quant"] == true);
    ensure!(config["torch_dtype"] == "bfloat16");
    let dir8 = temp_dir("quant_checkpoint", "layout8")?;
    save_bnb(
        &dir8,
        &cfg,
        &bnb(QuantMethod::Int8),
        &quantized_model(&cfg, &QuantMethod::Int8)?,
    )?;
    let bytes = std::fs::read(dir8.join("model.safetensors"))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    let m = "model.layers.0.self_attn.k_proj";
    let (w8, scb, fmt) = (
        st.tensor(&format!("{m}.weight"))?,
        st.tensor(&format!("{m}.SCB"))?,
        st.tensor(&format!("{m}.weight_format"))?,
    );
    ensure!(w8.dtype() == Dtype::I8 && w8.shape() == [32, 64]);
    ensure!(scb.dtype() == Dtype::F32 && scb.shape() == [32]);
    ensure!(fmt.dtype() == Dtype::U8 && fmt.shape().is_empty() && fmt.data() == [0]);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&dir8);
    Ok(())
}

/// The config error of `text`'s `quantization_config`, with its field.
fn config_field_error(text: &str) -> Result<String> {
    let e = QuantizationConfig::from_config_json(text)
        .err()
        .context("accepted")?;
    match TypedError::find(&e) {
        Some(TypedError::Config { field, .. }) => Ok(field.clone()),
        other => anyhow::bail!("not a config error: {other:?} ({e})"),
    }
}

fn with_qc(qc: serde_json::Value) -> String {
    serde_json::json!({ "model_type": "llama", "quantization_config": qc }).to_string()
}

/// What transformers' `BitsAndBytesConfig` writes reads as the config it
/// describes; the fp8 methods read per-row and per-tensor layouts; every
/// field whose math is not implemented, or a value not supported, is an
/// error naming that field.
#[test]
fn quantization_config_fields() -> Result<()> {
    let written = serde_json::json!({
        "_load_in_4bit": true, "_load_in_8bit": false, "bnb_4bit_compute_dtype": "bfloat16",
        "bnb_4bit_quant_storage": "uint8", "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": true, "llm_int8_enable_fp32_cpu_offload": false,
        "llm_int8_has_fp16_weight": false, "llm_int8_skip_modules": null,
        "llm_int8_threshold": 6.0, "load_in_4bit": true, "load_in_8bit": false,
        "quant_method": "bitsandbytes"
    });
    let qc = QuantizationConfig::from_config_json(&with_qc(written.clone()))?.context("none")?;
    ensure!(qc == bnb(four_bit(FourBitType::Nf4, true)), "{qc:?}");
    ensure!(qc.to_bnb_json()? == written, "{}", qc.to_bnb_json()?);
    ensure!(QuantizationConfig::from_config_json("{\"model_type\": \"llama\"}")?.is_none());
    let fp8 = |v: serde_json::Value| -> Result<QuantMethod> {
        Ok(QuantizationConfig::from_config_json(&with_qc(v))?
            .context("none")?
            .method)
    };
    let m = fp8(serde_json::json!({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}))?;
    ensure!(m == QuantMethod::Fp8(Fp8Layout::Fbgemm));
    let m = fp8(serde_json::json!({"quant_method": "fp8", "weight_block_size": [1, 4096]}))?;
    ensure!(
        m == QuantMethod::Fp8(Fp8Layout::FineGrained {
            block: Some([1, 4096])
        })
    );
    let mut bad = Vec::new();
    let field = |patch: serde_json::Value| -> Result<String> {
        let mut v = written.clone();
        for (k, x) in patch.as_object().context("patch")? {
            v[k] = x.clone();
        }
        config_field_error(&with_qc(v))
    };
    bad.push((
        field(serde_json::json!({"bnb_4bit_quant_storage": "bfloat16"}))?,
        "bnb_4bit_quant_storage",
    ));
    bad.push((
        field(serde_json::json!({"bnb_4bit_quant_type": "int4"}))?,
        "bnb_4bit_quant_type",
    ));
    bad.push((
        field(serde_json::json!({"load_in_8bit": true, "_load_in_8bit": true}))?,
        "load_in_4bit",
    ));
    bad.push((
        field(serde_json::json!({"_load_in_4bit": false}))?,
        "_load_in_4bit",
    ));
    bad.push((
        field(serde_json::json!({"llm_int8_has_fp16_weight": true}))?,
        "llm_int8_has_fp16_weight",
    ));
    bad.push((
        field(serde_json::json!({"bnb_4bit_rotation": true}))?,
        "bnb_4bit_rotation",
    ));
    bad.push((
        field(serde_json::json!({"quant_method": "gptq"}))?,
        "quant_method",
    ));
    let ct = |weights: serde_json::Value, input: serde_json::Value| {
        with_qc(serde_json::json!({
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": input}}
        }))
    };
    let w = serde_json::json!({"num_bits": 8, "type": "float", "symmetric": true, "dynamic": false, "strategy": "channel"});
    let q =
        QuantizationConfig::from_config_json(&ct(w.clone(), serde_json::json!({"dynamic": true})))?;
    ensure!(
        q.context("none")?.method
            == QuantMethod::Fp8(Fp8Layout::CompressedTensors { per_channel: true })
    );
    bad.push((
        config_field_error(&ct(w.clone(), serde_json::json!({"dynamic": false})))?,
        "config_groups.group_0.input_activations.dynamic",
    ));
    let mut blocked = w.clone();
    blocked["strategy"] = "block".into();
    bad.push((
        config_field_error(&ct(blocked, serde_json::Value::Null))?,
        "config_groups.group_0.weights.strategy",
    ));
    let fp8_block =
        with_qc(serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128]}));
    bad.push((config_field_error(&fp8_block)?, "weight_block_size"));
    let static_fp8 =
        with_qc(serde_json::json!({"quant_method": "fp8", "activation_scheme": "static"}));
    bad.push((config_field_error(&static_fp8)?, "activation_scheme"));
    for (got, want) in bad {
        ensure!(
            got == format!("quantization_config.{want}"),
            "{got} against {want}"
        );
    }
    Ok(())
}

/// The error of reading `tensors` (rewritten from a good NF4 folder) as
/// double-quantized NF4, as a string.
fn read_error(tensors: &HashMap<String, Tensor>, qc: &QuantizationConfig) -> Result<String> {
    let dir = temp_dir("quant_checkpoint", "bad")?;
    let file = dir.join("model.safetensors");
    candle_core::safetensors::save(tensors, &file)?;
    let e = read_quantized(&[&file], qc).err().context("accepted")?;
    let _ = std::fs::remove_dir_all(&dir);
    ensure!(
        matches!(
            TypedError::find(&e),
            Some(TypedError::Checkpoint { .. } | TypedError::Config { .. })
        ),
        "untyped: {e}"
    );
    Ok(e.to_string())
}

fn quant_state(
    tensors: &mut HashMap<String, Tensor>,
    name: &str,
    edit: impl Fn(&mut serde_json::Value),
) -> Result<()> {
    let key = format!("{name}.quant_state.bitsandbytes__nf4");
    let bytes = tensors[&key].to_vec1::<u8>()?;
    let mut v: serde_json::Value = serde_json::from_slice(&bytes)?;
    edit(&mut v);
    let text = v.to_string().into_bytes();
    let n = text.len();
    tensors.insert(key, Tensor::from_vec(text, n, &Device::Cpu)?);
    Ok(())
}

/// A truncated packed tensor, absmax of the wrong length, an unknown quant
/// type or block size, a missing quant map, a quant state that disagrees with
/// the config, a uint8 tensor without a quant state: each an error naming the
/// tensor (or the config field), before any weight is copied; weights that
/// do not match the model's config are refused by `QuantizedCheckpoint::check`.
#[test]
fn quantized_checkpoint_bad_inputs() -> Result<()> {
    let cfg = tiny();
    let method = four_bit(FourBitType::Nf4, true);
    let qc = bnb(method.clone());
    let dir = temp_dir("quant_checkpoint", "good")?;
    save_bnb(&dir, &cfg, &qc, &quantized_model(&cfg, &method)?)?;
    let good = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?;
    let w = "model.layers.0.self_attn.q_proj.weight";
    let mut cases: Vec<(HashMap<String, Tensor>, String)> = Vec::new();
    let mut t = good.clone();
    t.insert(w.into(), good[w].narrow(0, 0, 2047)?);
    cases.push((t, format!("{w}: packed data has 2047 elements")));
    let mut t = good.clone();
    let absmax = format!("{w}.absmax");
    t.insert(absmax.clone(), good[&absmax].narrow(0, 0, 63)?);
    cases.push((t, format!("{absmax}: 63 elements")));
    let mut t = good.clone();
    quant_state(&mut t, w, |v| v["quant_type"] = "nf5".into())?;
    cases.push((t, format!("{w}: quant_type nf5 is not supported")));
    let mut t = good.clone();
    quant_state(&mut t, w, |v| v["blocksize"] = 48.into())?;
    cases.push((t, format!("{w}: blocksize 48 is not supported")));
    let mut t = good.clone();
    quant_state(&mut t, w, |v| v["extra"] = 1.into())?;
    cases.push((t, "unknown field `extra`".into()));
    let mut t = good.clone();
    t.remove(&format!("{w}.quant_map"));
    cases.push((t, format!("{w}: no tensor \"{w}.quant_map\"")));
    let mut t = good.clone();
    t.insert(
        "model.extra.weight".into(),
        Tensor::zeros(4, DType::U8, &Device::Cpu)?,
    );
    cases.push((
        t,
        "model.extra.weight: dtype U8 but no part of a quantized weight".into(),
    ));
    for (tensors, want) in &cases {
        let got = read_error(tensors, &qc)?;
        ensure!(got.contains(want.as_str()), "{got:?} lacks {want:?}");
    }
    let plain = bnb(four_bit(FourBitType::Nf4, false));
    let got = read_error(&good, &plain)?;
    ensure!(
        got.contains("quantization_config.bnb_4bit_use_double_quant"),
        "{got}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Writes `tensors` (name, dtype, shape, bytes) as a safetensors file.
fn write_raw(file: &Path, tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) -> Result<()> {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| Ok((n.clone(), TensorView::new(*d, s.clone(), b)?)))
        .collect::<Result<_>>()?;
    safetensors::serialize_to_file(views, None, file)?;
    Ok(())
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// fp8 checkpoints: fbgemm's per-row `weight_scale` (with its
/// `input_scale_ub`), the fine-grained `weight_scale_inv` of `[1, n]`
/// blocks, compressed-tensors' per-tensor bf16 scale: each reads to the
/// e4m3 bytes and scales written, a dense norm beside it stays dense, and a
/// scale of another shape is an error naming it.
#[test]
fn fp8_checkpoints_read() -> Result<()> {
    let (rows, cols) = (24, 40);
    let v: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
        .collect();
    let w = "model.layers.0.mlp.up_proj.weight";
    let norm = (
        "model.norm.weight".to_string(),
        Dtype::F32,
        vec![cols],
        f32_bytes(&vec![1.0; cols]),
    );
    let dir = temp_dir("quant_checkpoint", "fp8")?;
    let file = dir.join("model.safetensors");
    let layouts = [
        (Fp8Layout::Fbgemm, ".weight_scale", true),
        (
            Fp8Layout::FineGrained {
                block: Some([1, 128]),
            },
            ".weight_scale_inv",
            true,
        ),
        (
            Fp8Layout::CompressedTensors { per_channel: false },
            ".weight_scale",
            false,
        ),
    ];
    for (layout, suffix, per_row) in layouts {
        let q = Fp8::quantize(&v, (rows, cols), per_row)?;
        let module = w.trim_end_matches(".weight");
        let scale = match q.scale() {
            streamer_quant::Fp8Scale::Rows(s) => (Dtype::F32, vec![rows, 1], f32_bytes(s)),
            streamer_quant::Fp8Scale::Tensor(s) => {
                // bf16 on purpose: compressed-tensors often stores scales so.
                let b = half::bf16::from_f32(*s);
                (Dtype::BF16, vec![1], b.to_le_bytes().to_vec())
            }
        };
        let want = Fp8::new(
            w,
            (rows, cols),
            q.data().to_vec(),
            match &scale.0 {
                Dtype::BF16 => streamer_quant::Fp8Scale::Tensor(
                    half::bf16::from_le_bytes([scale.2[0], scale.2[1]]).to_f32(),
                ),
                _ => q.scale().clone(),
            },
        )?;
        let mut tensors = vec![
            (
                w.to_string(),
                Dtype::F8_E4M3,
                vec![rows, cols],
                q.data().to_vec(),
            ),
            (
                format!("{module}{suffix}"),
                scale.0,
                scale.1.clone(),
                scale.2.clone(),
            ),
            norm.clone(),
        ];
        if layout == Fp8Layout::Fbgemm {
            tensors.push((
                format!("{module}.input_scale_ub"),
                Dtype::F32,
                vec![1],
                f32_bytes(&[1200.0]),
            ));
        }
        write_raw(&file, &tensors)?;
        let qc = QuantizationConfig {
            method: QuantMethod::Fp8(layout),
            skip_modules: None,
        };
        let back = read_quantized(&[&file], &qc)?;
        let HostTensor::Fp8(got) = &back.quantized[w] else {
            anyhow::bail!("not fp8")
        };
        ensure!(got == &want, "{layout:?}: {got:?}");
        ensure!(
            back.dense.len() == 1 && back.dense.contains_key("model.norm.weight"),
            "{layout:?}"
        );
        // A scale per 8 columns: a block layout, refused.
        tensors[1].2 = vec![rows, cols / 8];
        tensors[1].3 = f32_bytes(&vec![1.0; rows * cols / 8]);
        tensors[1].1 = Dtype::F32;
        write_raw(&file, &tensors)?;
        let e = read_quantized(&[&file], &qc)
            .err()
            .context("block scales accepted")?;
        ensure!(e.to_string().contains(&tensors[1].0), "{e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A bitsandbytes folder loads through `Llama::from_pretrained` as a streamed
/// model over its packed weights: its logits equal (exactly, the same
/// dequantized values through the same code) those of the streamed model
/// built from the dense tensors and the quantized ones dequantized on the
/// CPU. `LayerFootprint::of_base` reads from its config the bytes its layers
/// stream. A resident placement, or quantizing it again (loading or
/// planning), is refused naming `quantization_config`.
#[test]
fn quantized_folder_loads_streamed() -> Result<()> {
    use streamer_core::WeightSource;
    use streamer_models::{LayerFootprint, Llama, Placement, QuantizedWeights};
    let cfg = tiny();
    let dev = Device::Cpu;
    let stream = crate::common::stream(&dev, DType::F32, 1);
    let nf4 = streamer_quant::QuantScheme::parse("nf4")?;
    let ids: Vec<u32> = (0..32u32).map(|i| (i * 37 + 11) % 256).collect();
    let x = Tensor::from_vec(ids, (2, 16), &dev)?;
    for method in [four_bit(FourBitType::Nf4, true), QuantMethod::Int8] {
        let w = quantized_model(&cfg, &method)?;
        let dir = temp_dir("quant_checkpoint", "from_pretrained")?;
        save_bnb(&dir, &cfg, &bnb(method.clone()), &w)?;
        let loaded = Llama::from_pretrained(&dir, Placement::Streamed(stream.clone()))?.model;
        // The plan's layer bytes, read from the config alone, are what the
        // loaded layers stream.
        let footprint = LayerFootprint::of_base(&cfg, DType::F32, Some(&dir), None)?;
        let streamed = loaded
            .streamed_layers()
            .context("streamed")?
            .masters()
            .bytes();
        ensure!(
            footprint.slot * cfg.num_hidden_layers == streamed && footprint.quantized,
            "{method:?}: {footprint:?} a layer against {streamed} bytes for {} layers",
            cfg.num_hidden_layers
        );
        let again = LayerFootprint::of_base(&cfg, DType::F32, Some(&dir), Some(nf4))
            .err()
            .context("a plan quantizing a quantized folder again")?;
        ensure!(
            matches!(TypedError::find(&again), Some(TypedError::Config { field, .. }) if field == "quantization_config"),
            "{again}"
        );
        let mut dense = w.dense.clone();
        for (name, t) in QuantizedWeights::from_host(w.quantized.clone())?.dequantized()? {
            dense.insert(name, t);
        }
        let reference = Llama::streamed(&WeightSource::Tensors(dense), &cfg, stream.clone())?;
        let d = (loaded.forward(&x)? - reference.forward(&x)?)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        ensure!(d == 0.0, "{method:?}: logits differ by {d}");
        let resident = Placement::Resident {
            device: dev.clone(),
            dtype: DType::F32,
        };
        let e = Llama::from_pretrained(&dir, resident)
            .err()
            .context("a resident quantized folder was accepted")?;
        ensure!(
            matches!(TypedError::find(&e), Some(TypedError::Config { field, .. }) if field == "quantization_config"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir)?;
    }
    Ok(())
}
