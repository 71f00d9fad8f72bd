//! Quantized tensors in GPU memory and the launches of the dequantization
//! kernels (`streamer_kernels::DEQUANT`): the packed bytes and scales are
//! copied up as they are stored; each dequantization writes a new bf16
//! tensor.
use crate::{Absmax, FourBitType, Fp8Scale, HostTensor};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, Result, Storage, Tensor};
use cudarc::driver::{CudaSlice, CudaStream, PushKernelArg};
use half::bf16;
use std::sync::Arc;
use streamer_device::grid_stride;

fn wrap<E: std::error::Error + Send + Sync + 'static>(e: E) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// Block scales on the device.
enum Scales {
    Plain(CudaSlice<f32>),
    Nested {
        codes: CudaSlice<u8>,
        map: CudaSlice<f32>,
        scales: CudaSlice<f32>,
        offset: f32,
        per_scale: u32,
    },
}

/// The formats' device buffers and what the kernels need to know.
enum Format {
    FourBit {
        scales: Scales,
        fp4: i32,
        blocksize: u32,
    },
    Int8(CudaSlice<f32>),
    Fp8 {
        scales: CudaSlice<f32>,
        per_row: i32,
    },
}

/// A quantized tensor in device memory.
pub struct DeviceTensor {
    dev: CudaDevice,
    data: CudaSlice<u8>,
    format: Format,
    shape: Vec<usize>,
}

impl DeviceTensor {
    /// `host` copied to `dev` as it is stored.
    pub(crate) fn new(dev: &CudaDevice, host: &HostTensor) -> Result<Self> {
        let s = dev.cuda_stream();
        let up = |v: &[f32]| s.clone_htod(v).map_err(wrap);
        let (data, format, shape) = match host {
            HostTensor::FourBit(q) => {
                let scales = match q.absmax() {
                    Absmax::Plain(a) => Scales::Plain(up(a)?),
                    Absmax::Nested(n) => Scales::Nested {
                        codes: s.clone_htod(&n.codes).map_err(wrap)?,
                        map: up(&n.map)?,
                        scales: up(&n.absmax)?,
                        offset: n.offset,
                        per_scale: n.blocksize as u32,
                    },
                };
                let fp4 = i32::from(q.quant_type() == FourBitType::Fp4);
                let blocksize = q.blocksize() as u32;
                let f = Format::FourBit {
                    scales,
                    fp4,
                    blocksize,
                };
                (
                    s.clone_htod(q.packed()).map_err(wrap)?,
                    f,
                    q.shape().to_vec(),
                )
            }
            HostTensor::Int8(q) => {
                // int8 travels as its bytes; the kernel reads them as int8.
                let bytes: Vec<u8> = q.data().iter().map(|&b| b as u8).collect();
                let (r, c) = q.dims();
                (
                    s.clone_htod(&bytes).map_err(wrap)?,
                    Format::Int8(up(q.scb())?),
                    vec![r, c],
                )
            }
            HostTensor::Fp8(q) => {
                let (scales, per_row) = match q.scale() {
                    Fp8Scale::Tensor(v) => (vec![*v], 0),
                    Fp8Scale::Rows(v) => (v.clone(), 1),
                };
                let (r, c) = q.dims();
                let f = Format::Fp8 {
                    scales: up(&scales)?,
                    per_row,
                };
                (s.clone_htod(q.data()).map_err(wrap)?, f, vec![r, c])
            }
        };
        Ok(Self {
            dev: dev.clone(),
            data,
            format,
            shape,
        })
    }

    fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// Columns of a 2-D tensor (int8 and fp8 rows).
    fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(1).max(1)
    }

    /// The dense bf16 tensor.
    pub fn dequantize(&self) -> Result<Tensor> {
        let stream = self.dev.cuda_stream();
        let n = self.elements();
        // SAFETY: every kernel below writes all n elements before anything
        // reads them (same stream).
        let mut out = unsafe { stream.alloc::<bf16>(n.max(1)) }.map_err(wrap)?;
        match &self.format {
            Format::FourBit {
                scales,
                fp4,
                blocksize,
            } => {
                let nested;
                let absmax = match scales {
                    Scales::Plain(a) => a,
                    Scales::Nested { .. } => {
                        nested = self.nested_absmax(&stream, scales)?;
                        &nested
                    }
                };
                let func = self.function("dequant_4bit_bf16")?;
                let mut b = stream.launch_builder(&func);
                b.arg(&self.data)
                    .arg(absmax)
                    .arg(fp4)
                    .arg(&mut out)
                    .arg(&n)
                    .arg(blocksize);
                // SAFETY: `FourBit::new` checked the packed bytes (ceil(n / 2))
                // and one absmax per block of an even size; out holds n.
                unsafe { b.launch(grid_stride(n.div_ceil(16))) }.map_err(wrap)?;
            }
            Format::Int8(scb) => {
                let func = self.function("dequant_int8_bf16")?;
                let cols = self.cols();
                let mut b = stream.launch_builder(&func);
                b.arg(&self.data).arg(scb).arg(&mut out).arg(&n).arg(&cols);
                // SAFETY: `Int8Rows::new` checked rows x cols bytes and one
                // scale a row; out holds n.
                unsafe { b.launch(grid_stride(n.div_ceil(16))) }.map_err(wrap)?;
            }
            Format::Fp8 { scales, per_row } => {
                let func = self.function("dequant_fp8_bf16")?;
                let cols = self.cols();
                let mut b = stream.launch_builder(&func);
                b.arg(&self.data)
                    .arg(scales)
                    .arg(per_row)
                    .arg(&mut out)
                    .arg(&n)
                    .arg(&cols);
                // SAFETY: `Fp8::new` checked rows x cols bytes and one scale a
                // row (or one); out holds n.
                unsafe { b.launch(grid_stride(n.div_ceil(16))) }.map_err(wrap)?;
            }
        }
        let storage = CudaStorage::wrap_cuda_slice(out, self.dev.clone());
        Ok(Tensor::from_storage(
            Storage::Cuda(storage),
            self.shape.as_slice(),
            BackpropOp::none(),
            false,
        ))
    }

    /// Nested absmax dequantized into f32 on the device.
    fn nested_absmax(&self, stream: &Arc<CudaStream>, scales: &Scales) -> Result<CudaSlice<f32>> {
        let Scales::Nested {
            codes,
            map,
            scales,
            offset,
            per_scale,
        } = scales
        else {
            candle_core::bail!("plain absmax needs no dequantization");
        };
        let blocks = codes.len();
        // SAFETY: the kernel below writes every one of the `blocks` values.
        let mut out = unsafe { stream.alloc::<f32>(blocks.max(1)) }.map_err(wrap)?;
        let func = self.function("dequant_absmax")?;
        let mut b = stream.launch_builder(&func);
        b.arg(codes).arg(map).arg(scales).arg(offset);
        b.arg(&mut out).arg(&blocks).arg(per_scale);
        // SAFETY: `FourBit::new` checked the codes (one a block), the map
        // (256) and one scale per `per_scale` codes; out holds `blocks`.
        unsafe { b.launch(grid_stride(blocks)) }.map_err(wrap)?;
        Ok(out)
    }

    fn function(&self, name: &str) -> Result<streamer_kernels::Kernel> {
        streamer_kernels::function(&self.dev, &streamer_kernels::DEQUANT, name)
    }
}
