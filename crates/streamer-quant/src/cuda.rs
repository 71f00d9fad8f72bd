//! Launches of the dequantization kernels (`streamer_kernels::DEQUANT`): the
//! packed bytes and scales are copied up as they are stored, the kernels
//! write a bf16 tensor.
use crate::{Absmax, FourBit, FourBitType, Fp8, Fp8Scale, Int8Rows};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, Result, Shape, Storage, Tensor};
use cudarc::driver::{CudaSlice, CudaStream, PushKernelArg};
use half::bf16;
use std::sync::Arc;
use streamer_device::grid_stride;

fn wrap<E: std::error::Error + Send + Sync + 'static>(e: E) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// A bf16 buffer of `n` elements every element of which the next kernel on
/// `stream` writes.
fn output(stream: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<bf16>> {
    // SAFETY: the dequantization kernels write all n elements before anything
    // reads them (same stream).
    unsafe { stream.alloc::<bf16>(n.max(1)) }.map_err(wrap)
}

fn tensor(dev: &CudaDevice, out: CudaSlice<bf16>, shape: impl Into<Shape>) -> Tensor {
    let storage = CudaStorage::wrap_cuda_slice(out, dev.clone());
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
}

/// The block absmax in f32 on the device (dequantized there when nested).
fn absmax(dev: &CudaDevice, stream: &Arc<CudaStream>, a: &Absmax) -> Result<CudaSlice<f32>> {
    let nested = match a {
        Absmax::Plain(v) => return stream.memcpy_stod(v).map_err(wrap),
        Absmax::Nested(n) => n,
    };
    let codes = stream.memcpy_stod(&nested.codes).map_err(wrap)?;
    let map = stream.memcpy_stod(&nested.map).map_err(wrap)?;
    let scales = stream.memcpy_stod(&nested.absmax).map_err(wrap)?;
    let blocks = nested.codes.len();
    // SAFETY: the kernel below writes every one of the `blocks` values.
    let mut out = unsafe { stream.alloc::<f32>(blocks.max(1)) }.map_err(wrap)?;
    let func = streamer_kernels::function(dev, &streamer_kernels::DEQUANT, "dequant_absmax")?;
    let per_scale = nested.blocksize as u32;
    let mut b = stream.launch_builder(&func);
    b.arg(&codes).arg(&map).arg(&scales).arg(&nested.offset);
    b.arg(&mut out).arg(&blocks).arg(&per_scale);
    // SAFETY: `FourBit::new` checked that codes has `blocks` entries, map 256
    // and scales one per `per_scale` codes; out holds `blocks` f32.
    unsafe { b.launch(grid_stride(blocks)) }.map_err(wrap)?;
    Ok(out)
}

pub(crate) fn four_bit(dev: &CudaDevice, q: &FourBit) -> Result<Tensor> {
    let stream = dev.cuda_stream();
    let n = q.elements();
    let packed = stream.memcpy_stod(q.packed()).map_err(wrap)?;
    let scales = absmax(dev, &stream, q.absmax())?;
    let mut out = output(&stream, n)?;
    let func = streamer_kernels::function(dev, &streamer_kernels::DEQUANT, "dequant_4bit_bf16")?;
    let fp4 = i32::from(q.quant_type() == FourBitType::Fp4);
    let blocksize = q.blocksize() as u32;
    let mut b = stream.launch_builder(&func);
    b.arg(&packed)
        .arg(&scales)
        .arg(&fp4)
        .arg(&mut out)
        .arg(&n)
        .arg(&blocksize);
    // SAFETY: `FourBit::new` checked packed holds ceil(n / 2) bytes and one
    // absmax per block of an even block size; out holds n bf16.
    unsafe { b.launch(grid_stride(n.div_ceil(2))) }.map_err(wrap)?;
    Ok(tensor(dev, out, q.shape()))
}

pub(crate) fn int8_rows(dev: &CudaDevice, q: &Int8Rows) -> Result<Tensor> {
    let stream = dev.cuda_stream();
    let (rows, cols) = q.dims();
    let n = rows * cols;
    let data = stream.memcpy_stod(q.data()).map_err(wrap)?;
    let scb = stream.memcpy_stod(q.scb()).map_err(wrap)?;
    let mut out = output(&stream, n)?;
    let func = streamer_kernels::function(dev, &streamer_kernels::DEQUANT, "dequant_int8_bf16")?;
    let cols_arg = cols.max(1);
    let mut b = stream.launch_builder(&func);
    b.arg(&data).arg(&scb).arg(&mut out).arg(&n).arg(&cols_arg);
    // SAFETY: `Int8Rows::new` checked data holds rows x cols and scb rows
    // values; out holds n bf16.
    unsafe { b.launch(grid_stride(n)) }.map_err(wrap)?;
    Ok(tensor(dev, out, (rows, cols)))
}

pub(crate) fn fp8(dev: &CudaDevice, q: &Fp8) -> Result<Tensor> {
    let stream = dev.cuda_stream();
    let (rows, cols) = q.dims();
    let n = rows * cols;
    let data = stream.memcpy_stod(q.data()).map_err(wrap)?;
    let (scales, per_row) = match q.scale() {
        Fp8Scale::Tensor(s) => (vec![*s], 0i32),
        Fp8Scale::Rows(s) => (s.clone(), 1),
    };
    let scales = stream.memcpy_stod(&scales).map_err(wrap)?;
    let mut out = output(&stream, n)?;
    let func = streamer_kernels::function(dev, &streamer_kernels::DEQUANT, "dequant_fp8_bf16")?;
    let cols_arg = cols.max(1);
    let mut b = stream.launch_builder(&func);
    b.arg(&data)
        .arg(&scales)
        .arg(&per_row)
        .arg(&mut out)
        .arg(&n)
        .arg(&cols_arg);
    // SAFETY: `Fp8::new` checked data holds rows x cols bytes and the scales
    // one per row (or one); out holds n bf16.
    unsafe { b.launch(grid_stride(n)) }.map_err(wrap)?;
    Ok(tensor(dev, out, (rows, cols)))
}
