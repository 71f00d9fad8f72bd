//! Quantized weight formats (`streamer_quant`): every format's CPU
//! dequantization equals an f64 computation of its algorithm rounded where
//! bitsandbytes' kernels round (so bit for bit), quantization picks the
//! nearest code, packing follows bitsandbytes' nibble order, and malformed
//! tensors are refused with typed errors naming the tensor.
use anyhow::{ensure, Result};
use candle_core::Device;
use half::bf16;
use streamer_quant::{
    dynamic_map, e4m3_to_f32, f32_to_e4m3, Absmax, Dequantize, DequantizeHost, FourBit,
    FourBitType, Fp8, Fp8Scale, Int8Rows, QuantError, FP4_CODE, NF4_CODE,
};

/// Values spread over several orders of magnitude, with signs (SplitMix64).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|i| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            let u = (z >> 11) as f64 / (1u64 << 53) as f64;
            let scale = 10f64.powi((i / 64 % 5) as i32 - 3);
            ((u * 2.0 - 1.0) * scale) as f32
        })
        .collect()
}

fn f32_of(x: f64) -> f32 {
    x as f32
}

/// The block absmax an f64 computation gives for `q` (plain or nested).
fn reference_absmax(q: &FourBit) -> Vec<f32> {
    match q.absmax() {
        Absmax::Plain(a) => a.clone(),
        Absmax::Nested(n) => n
            .codes
            .iter()
            .enumerate()
            .map(|(i, &c)| {
                let scaled = f32_of(n.map[c as usize] as f64 * n.absmax[i / n.blocksize] as f64);
                f32_of(scaled as f64 + n.offset as f64)
            })
            .collect(),
    }
}

/// `code[nibble] * absmax[block]` in f64, rounded once to f32.
pub(crate) fn reference_4bit(q: &FourBit) -> Vec<f32> {
    let code = q.quant_type().code();
    let absmax = reference_absmax(q);
    (0..q.elements())
        .map(|i| {
            let byte = q.packed()[i / 2];
            let nibble = if i % 2 == 0 { byte >> 4 } else { byte & 15 };
            f32_of(code[nibble as usize] as f64 * absmax[i / q.blocksize()] as f64)
        })
        .collect()
}

pub(crate) fn same_bits(a: &[f32], b: &[f32]) -> Result<()> {
    ensure!(
        a.len() == b.len(),
        "{} against {} elements",
        a.len(),
        b.len()
    );
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        ensure!(x.to_bits() == y.to_bits(), "element {i}: {x} against {y}");
    }
    Ok(())
}

/// NF4 and FP4, plain and double-quantized absmax, whole and partial last
/// blocks, odd element counts: dequantization equals the f64 reference bit
/// for bit, in f32 and in bf16; every element's code is the nearest to its
/// scaled value; each block's absmax is its largest magnitude.
#[test]
fn four_bit_dequantizes_as_the_reference() -> Result<()> {
    for (qt, bs, n, double) in [
        (FourBitType::Nf4, 64, 64 * 40, false),
        (FourBitType::Nf4, 64, 64 * 600 + 7, true),
        (FourBitType::Fp4, 128, 128 * 9 + 1, false),
        (FourBitType::Fp4, 64, 64 * 300, true),
        (FourBitType::Nf4, 4096, 5000, true),
    ] {
        let v = values(n, n as u64);
        let q = FourBit::quantize(&v, &[n], qt, bs, double)?;
        ensure!(q.packed().len() == n.div_ceil(2));
        let dq = q.dequantize_f32();
        same_bits(&dq, &reference_4bit(&q))?;
        let b16 = q.dequantize_bf16();
        ensure!(b16.iter().zip(&dq).all(|(b, f)| *b == bf16::from_f32(*f)));
        if double {
            continue;
        }
        let code = qt.code();
        for (blk, chunk) in v.chunks(bs).enumerate() {
            let top = chunk.iter().fold(0f32, |m, x| m.max(x.abs()));
            let Absmax::Plain(a) = q.absmax() else {
                unreachable!()
            };
            ensure!(
                a[blk] == top,
                "block {blk}: absmax {} against {top}",
                a[blk]
            );
            for (j, &x) in chunk.iter().enumerate() {
                let i = blk * bs + j;
                let scaled = (x * (1.0 / top)) as f64;
                let byte = q.packed()[i / 2];
                let got = code[(if i % 2 == 0 { byte >> 4 } else { byte & 15 }) as usize] as f64;
                let best = code
                    .iter()
                    .map(|&c| (c as f64 - scaled).abs())
                    .fold(f64::MAX, f64::min);
                ensure!(
                    (got - scaled).abs() <= best + 1e-7,
                    "element {i}: {scaled} coded {got}"
                );
            }
        }
    }
    Ok(())
}

/// Packing: values that are code points times a power of two quantize to
/// exactly those codes, first element in the high nibble.
#[test]
fn four_bit_packing_order() -> Result<()> {
    for qt in [FourBitType::Nf4, FourBitType::Fp4] {
        let idx: Vec<u8> = (0..64usize).map(|i| ((i * 7 + 3) % 16) as u8).collect();
        let mut v: Vec<f32> = idx.iter().map(|&k| qt.code()[k as usize] * 2.0).collect();
        // The block's absmax must be exactly 2: put a code of magnitude 1 in.
        let one = qt
            .code()
            .iter()
            .position(|c| *c == 1.0)
            .expect("1 is a code") as u8;
        v[5] = 2.0;
        let mut want = idx.clone();
        want[5] = one;
        let q = FourBit::quantize(&v, &[1, 64], qt, 64, false)?;
        for (i, p) in q.packed().iter().enumerate() {
            let (hi, lo) = (want[2 * i], want[2 * i + 1]);
            // -0.0 and 0.0 are the same value: either code is exact.
            let zero = |k: u8| qt.code()[k as usize] == 0.0;
            let ok = |got: u8, w: u8| got == w || (zero(got) && zero(w));
            ensure!(
                ok(p >> 4, hi) && ok(p & 15, lo),
                "{qt:?} byte {i}: {p:#04x}, want {hi:x}{lo:x}"
            );
        }
        // Exact values: the codes times 2 (-0.0 equals 0.0).
        ensure!(q.dequantize_f32() == v, "{qt:?}");
    }
    ensure!(NF4_CODE.windows(2).all(|w| w[0] < w[1]));
    ensure!(FP4_CODE[3] == 1.0 && FP4_CODE[11] == -1.0);
    Ok(())
}

/// bitsandbytes' signed dynamic map: 256 ascending values from about -1 to
/// 1 with 0 and 1 in it; double-quantized absmax values stay within the
/// map's resolution of the originals.
#[test]
fn nested_absmax_map() -> Result<()> {
    let m = dynamic_map();
    ensure!(m.windows(2).all(|w| w[0] < w[1]), "ascending");
    ensure!(m.contains(&0.0) && m[255] == 1.0 && m[0] > -1.0 && m[0] < -0.9);
    ensure!(m.iter().filter(|v| **v > 0.0).count() == 128);
    let v = values(64 * 2000, 7);
    let plain = FourBit::quantize(&v, &[v.len()], FourBitType::Nf4, 64, false)?;
    let nested = FourBit::quantize(&v, &[v.len()], FourBitType::Nf4, 64, true)?;
    let (a, b) = (plain.absmax_f32(), nested.absmax_f32());
    let spread = a.iter().fold(0f32, |x, y| x.max(*y));
    for (x, y) in a.iter().zip(b.iter()) {
        // The map's widest step near 1 is 0.9/64/2 of a nested block's scale.
        ensure!((x - y).abs() <= spread * 0.9 / 64.0, "{x} against {y}");
    }
    ensure!(nested.stored_bytes() < plain.stored_bytes());
    Ok(())
}

/// `(q * SCB) * (1/127)` in f64, rounded to f32 where bitsandbytes rounds
/// (after the product, at the end).
pub(crate) fn reference_int8(q: &Int8Rows) -> Vec<f32> {
    let inv = 7.874015718698502e-3f64 as f32 as f64;
    let cols = q.dims().1;
    q.data()
        .iter()
        .enumerate()
        .map(|(i, &d)| f32_of(f32_of(d as f64 * q.scb()[i / cols] as f64) as f64 * inv))
        .collect()
}

/// int8 rows: `(q * SCB) * (1/127)` in f32, as the f64 reference rounded
/// at the same two points; quantization rounds to nearest.
#[test]
fn int8_rows_dequantize_as_the_reference() -> Result<()> {
    let (rows, cols) = (37, 96);
    let v = values(rows * cols, 3);
    let q = Int8Rows::quantize(&v, (rows, cols))?;
    same_bits(&q.dequantize_f32(), &reference_int8(&q))?;
    for (i, (&x, &d)) in v.iter().zip(q.data()).enumerate() {
        let exact = x as f64 * 127.0 / q.scb()[i / cols] as f64;
        ensure!(
            (exact - d as f64).abs() <= 0.5 + 1e-5,
            "element {i}: {exact} coded {d}"
        );
    }
    Ok(())
}

/// e4m3: every byte decodes to the f64 formula (NaN for 0x7f and 0xff);
/// every finite value encodes back to its byte; encoding rounds to the
/// nearest value; per-row and per-tensor dequantization equal the reference.
#[test]
fn fp8_e4m3_as_the_reference() -> Result<()> {
    for b in 0..=255u8 {
        let (s, e, m) = ((b >> 7) as i32, ((b >> 3) & 15) as i32, (b & 7) as f64);
        let got = e4m3_to_f32(b);
        if e == 15 && m == 7.0 {
            ensure!(got.is_nan(), "{b:#04x}");
            continue;
        }
        let mag = if e == 0 {
            m / 8.0 * 2f64.powi(-6)
        } else {
            (1.0 + m / 8.0) * 2f64.powi(e - 7)
        };
        let want = if s == 1 { -mag } else { mag };
        ensure!(got as f64 == want, "{b:#04x}: {got} against {want}");
        ensure!(got == 0.0 || f32_to_e4m3(got) == b, "{b:#04x} round trip");
    }
    let finite: Vec<f64> = (0..0x7fu8).map(|b| e4m3_to_f32(b) as f64).collect();
    for x in values(4096, 11).iter().map(|x| x * 300.0) {
        let got = e4m3_to_f32(f32_to_e4m3(x)) as f64;
        let best = finite
            .iter()
            .map(|f| (f - (x as f64).abs()).abs())
            .fold(f64::MAX, f64::min);
        ensure!(
            ((got.abs() - (x as f64).abs()).abs() - best).abs() < 1e-9,
            "{x} -> {got}"
        );
    }
    let (rows, cols) = (16, 40);
    let v = values(rows * cols, 5);
    for per_row in [true, false] {
        let q = Fp8::quantize(&v, (rows, cols), per_row)?;
        let want: Vec<f32> = q
            .data()
            .iter()
            .enumerate()
            .map(|(i, &b)| f32_of(e4m3_to_f32(b) as f64 * q.row_scale(i / cols) as f64))
            .collect();
        same_bits(&q.dequantize_f32(), &want)?;
        ensure!(matches!(q.scale(), Fp8Scale::Rows(_)) == per_row);
    }
    Ok(())
}

/// Malformed tensors: truncated packed data, absmax of the wrong length, an
/// unknown quant type or block size, a non-finite scale, int8 and fp8 scales
/// of the wrong length; each refused with its variant and the tensor's name.
#[test]
fn quantized_bad_inputs() -> Result<()> {
    let name = "model.layers.0.mlp.down_proj.weight";
    let nf4 = (FourBitType::Nf4, 64);
    let len = |r: Result<FourBit, QuantError>| match r {
        Err(QuantError::Length {
            tensor,
            part,
            got,
            expected,
            ..
        }) => Ok((tensor, part, got, expected)),
        other => Err(anyhow::anyhow!("expected a length error, got {other:?}")),
    };
    // A (128, 2) NF4 tensor of `packed` bytes and `absmax` scales.
    let nf4_of = |packed: usize, absmax: usize| {
        FourBit::new(
            name,
            &[128, 2],
            nf4,
            vec![0; packed],
            Absmax::Plain(vec![1.0; absmax]),
        )
    };
    let (t, part, got, want) = len(nf4_of(127, 4))?;
    ensure!(t == name && part == "packed data" && got == 127 && want == 128);
    let (_, part, got, want) = len(nf4_of(128, 3))?;
    ensure!(part == "absmax" && got == 3 && want == 4);
    let err = FourBit::new(
        name,
        &[128],
        (FourBitType::Nf4, 48),
        vec![0; 64],
        Absmax::Plain(vec![1.0; 3]),
    );
    ensure!(
        matches!(
            &err,
            Err(QuantError::Unsupported {
                field: "blocksize",
                ..
            })
        ),
        "{err:?}"
    );
    let err = FourBitType::parse(name, "nf5");
    ensure!(
        matches!(&err, Err(QuantError::Unsupported { field: "quant_type", tensor, .. }) if tensor == name),
        "{err:?}"
    );
    let err = FourBit::new(
        name,
        &[128],
        nf4,
        vec![0; 64],
        Absmax::Plain(vec![1.0, f32::NAN]),
    );
    ensure!(
        matches!(&err, Err(QuantError::NonFinite { index: 1, .. })),
        "{err:?}"
    );
    let err = Int8Rows::new(name, (4, 8), vec![0; 32], vec![1.0; 3]);
    ensure!(
        matches!(
            &err,
            Err(QuantError::Length {
                part: "SCB (row absmax)",
                ..
            })
        ),
        "{err:?}"
    );
    let err = Fp8::new(name, (4, 8), vec![0; 32], Fp8Scale::Rows(vec![1.0; 5]));
    ensure!(
        matches!(
            &err,
            Err(QuantError::Length {
                part: "weight_scale",
                ..
            })
        ),
        "{err:?}"
    );
    let msg = Fp8::new(name, (4, 8), vec![0; 31], Fp8Scale::Tensor(1.0))
        .unwrap_err()
        .to_string();
    ensure!(
        msg.contains(name) && msg.contains("31") && msg.contains("32"),
        "{msg}"
    );
    Ok(())
}

/// On a device every format dequantizes to the CPU reference's bf16 bits
/// (on the GPU: the kernels of `kernels/src/dequant.cu`), of the tensor's
/// shape, for NF4 and FP4 with plain and nested absmax and a partial last
/// block, int8 rows and fp8 with row and tensor scales. Each format runs at
/// a shape the kernels take 16 elements a thread (whole, aligned vectors)
/// and at one they take element by element.
fn dequantized_on_device_equals_reference(dev: &Device) -> Result<()> {
    let bits = |t: candle_core::Tensor| -> Result<Vec<u16>> {
        Ok(t.flatten_all()?
            .to_vec1::<bf16>()?
            .iter()
            .map(|b| b.to_bits())
            .collect())
    };
    let want = |v: Vec<bf16>| v.iter().map(|b| b.to_bits()).collect::<Vec<u16>>();
    for (rows, cols) in [(130, 67), (96, 128)] {
        for (qt, double) in [
            (FourBitType::Nf4, false),
            (FourBitType::Nf4, true),
            (FourBitType::Fp4, true),
        ] {
            let v = values(rows * cols, 17);
            let q = FourBit::quantize(&v, &[rows, cols], qt, 64, double)?;
            let t = q.dequantize_on(dev)?;
            ensure!(t.dims() == [rows, cols], "{:?}", t.dims());
            ensure!(
                bits(t)? == want(q.dequantize_bf16()),
                "{qt:?} double {double} at {rows}x{cols}"
            );
        }
    }
    for (rows, cols) in [(48, 80), (47, 81)] {
        let v = values(rows * cols, 19);
        let q = Int8Rows::quantize(&v, (rows, cols))?;
        ensure!(
            bits(q.dequantize_on(dev)?)? == want(q.dequantize_bf16()),
            "int8 at {rows}x{cols}"
        );
        for per_row in [true, false] {
            let q = Fp8::quantize(&v, (rows, cols), per_row)?;
            ensure!(
                bits(q.dequantize_on(dev)?)? == want(q.dequantize_bf16()),
                "fp8 per_row {per_row} at {rows}x{cols}"
            );
        }
    }
    Ok(())
}
candle_streamer::test_device!(dequantized_on_device_equals_reference);
