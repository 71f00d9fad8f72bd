//! Quantized tensors in GPU memory and the launches of the dequantization
//! kernels (`streamer_kernels::DEQUANT`): the packed bytes and scales are
//! copied up as they are stored; each dequantization writes a new bf16
//! tensor.
use crate::{Absmax, FourBitType, Fp8Scale, HostTensor, PackedFormat, PackedLayout};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{CudaDevice, Result, Storage, Tensor};
use cudarc::driver::{CudaSlice, CudaView, DevicePtr, PushKernelArg};
use half::bf16;
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
        offset: CudaSlice<f32>,
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
                        offset: up(&[n.offset])?,
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
        let k = Kernels {
            dev: &self.dev,
            n: self.elements(),
            cols: self.cols(),
        };
        let data = self.data.slice(..);
        let out = match &self.format {
            Format::FourBit {
                scales,
                fp4,
                blocksize,
            } => match scales {
                Scales::Plain(a) => k.four_bit(&data, &a.slice(..), *fp4, *blocksize)?,
                Scales::Nested {
                    codes,
                    map,
                    scales,
                    offset,
                    per_scale,
                } => {
                    let nested = (&codes.slice(..), &map.slice(..), &scales.slice(..));
                    let absmax = k.nested_absmax(nested, &offset.slice(..), *per_scale)?;
                    k.four_bit(&data, &absmax.slice(..), *fp4, *blocksize)?
                }
            },
            Format::Int8(scb) => k.rows("dequant_int8_bf16", &data, &scb.slice(..), None)?,
            Format::Fp8 { scales, per_row } => {
                k.rows("dequant_fp8_bf16", &data, &scales.slice(..), Some(*per_row))?
            }
        };
        k.wrap(out, &self.shape)
    }
}

/// The dequantization kernels' launches for one tensor of `n` elements
/// (`cols` a row for int8 and fp8), on the device's stream. Their buffers
/// are views: the [`DeviceTensor`]'s own slices, or sections of one packed
/// buffer ([`dequantize_packed`]).
struct Kernels<'a> {
    dev: &'a CudaDevice,
    n: usize,
    cols: usize,
}

impl Kernels<'_> {
    fn function(&self, name: &str) -> Result<streamer_kernels::Kernel> {
        streamer_kernels::function(self.dev, &streamer_kernels::DEQUANT, name)
    }

    /// A bf16 buffer of the n elements, written in full by the caller's kernel.
    fn alloc_out(&self) -> Result<CudaSlice<bf16>> {
        // SAFETY: every caller's kernel writes all n elements before anything
        // reads them (same stream).
        unsafe { self.dev.cuda_stream().alloc::<bf16>(self.n.max(1)) }.map_err(wrap)
    }

    /// 4-bit codes (two a byte) times their block's f32 absmax.
    fn four_bit(
        &self,
        packed: &CudaView<u8>,
        absmax: &CudaView<f32>,
        fp4: i32,
        blocksize: u32,
    ) -> Result<CudaSlice<bf16>> {
        let n = self.n;
        let bs = blocksize as usize;
        if packed.len() < n.div_ceil(2) || absmax.len() < n.div_ceil(bs) || bs % 2 != 0 {
            candle_core::bail!("4-bit dequantization: buffers too short for {n} elements");
        }
        let mut out = self.alloc_out()?;
        let func = self.function("dequant_4bit_bf16")?;
        let stream = self.dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(packed).arg(absmax).arg(&fp4).arg(&mut out);
        b.arg(&n).arg(&blocksize);
        // SAFETY: checked above: ceil(n / 2) packed bytes, one absmax per
        // block of an even size; out holds n.
        // 16 elements a thread on the kernels' vector path.
        unsafe { b.launch(grid_stride(n.div_ceil(16))) }.map_err(wrap)?;
        Ok(out)
    }

    /// Row-scaled bytes: int8 (`per_row` None: one scale a row) or fp8
    /// (`Some(per_row)`: a scale a row, or one for the tensor).
    fn rows(
        &self,
        kernel: &str,
        data: &CudaView<u8>,
        scales: &CudaView<f32>,
        per_row: Option<i32>,
    ) -> Result<CudaSlice<bf16>> {
        let (n, cols) = (self.n, self.cols);
        let need = match per_row {
            Some(0) => 1,
            _ => n.div_ceil(cols),
        };
        if data.len() < n || scales.len() < need {
            candle_core::bail!("{kernel}: buffers too short for {n} elements");
        }
        let mut out = self.alloc_out()?;
        let func = self.function(kernel)?;
        let stream = self.dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(data).arg(scales);
        if let Some(p) = &per_row {
            b.arg(p);
        }
        b.arg(&mut out).arg(&n).arg(&cols);
        // SAFETY: checked above: n bytes and a scale for every row (or one);
        // out holds n.
        unsafe { b.launch(grid_stride(n.div_ceil(16))) }.map_err(wrap)?;
        Ok(out)
    }

    /// Double-quantized absmax (`codes`, `map`, `scales`) in f32.
    fn nested_absmax(
        &self,
        (codes, map, scales): (&CudaView<u8>, &CudaView<f32>, &CudaView<f32>),
        offset: &CudaView<f32>,
        per_scale: u32,
    ) -> Result<CudaSlice<f32>> {
        let blocks = codes.len();
        if offset.is_empty()
            || map.len() < 256
            || per_scale == 0
            || scales.len() < blocks.div_ceil(per_scale as usize)
        {
            candle_core::bail!("nested absmax: buffers too short for {blocks} codes");
        }
        let stream = self.dev.cuda_stream();
        // SAFETY: the kernel below writes every one of the `blocks` values.
        let mut out = unsafe { stream.alloc::<f32>(blocks.max(1)) }.map_err(wrap)?;
        let func = self.function("dequant_absmax")?;
        let mut b = stream.launch_builder(&func);
        b.arg(codes).arg(map).arg(scales).arg(offset);
        b.arg(&mut out).arg(&blocks).arg(&per_scale);
        // SAFETY: checked above: the offset, the map's 256 values and a scale per
        // `per_scale` codes; out holds `blocks`.
        unsafe { b.launch(grid_stride(blocks)) }.map_err(wrap)?;
        Ok(out)
    }

    /// `out` as a Candle tensor of `shape`.
    fn wrap(&self, out: CudaSlice<bf16>, shape: &[usize]) -> Result<Tensor> {
        Ok(streamer_device::slice_tensor(out, self.dev, shape))
    }
}

/// `count` f32 values from byte `at` of `buf`, a packed buffer that starts
/// 4-byte aligned.
fn f32_section<'a>(
    buf: &CudaView<'a, u8>,
    at: usize,
    count: usize,
    name: &str,
) -> Result<CudaView<'a, f32>> {
    if at % 4 != 0 || at + 4 * count > buf.len() {
        candle_core::bail!("{name}: f32 section at byte {at} of {count} values is misplaced");
    }
    let bytes = buf.slice(at..at + 4 * count);
    // SAFETY: the section lies inside `buf` (checked above), starts 4-byte
    // aligned (the buffer does, and `at` is a multiple of 4) and every bit
    // pattern is a valid f32.
    unsafe { bytes.transmute::<f32>(count) }
        .ok_or_else(|| candle_core::Error::Msg(format!("{name}: short f32 section")))
}

/// [`crate::dequantize`] on CUDA: the kernels read the sections of the
/// packed buffer in place.
pub(crate) fn dequantize_packed(bytes: &Tensor, layout: &PackedLayout) -> Result<Tensor> {
    let (storage, l) = bytes.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        candle_core::bail!(
            "{}: the packed buffer is not on a CUDA device",
            layout.name()
        );
    };
    let CudaStorageSlice::U8(all) = &cs.slice else {
        candle_core::bail!("{}: the packed buffer is not u8", layout.name());
    };
    let s = layout.sections();
    let buf = all.slice(l.start_offset()..l.start_offset() + s.total);
    let dev = cs.device();
    let stream = dev.cuda_stream();
    {
        let (ptr, _guard) = buf.device_ptr(&stream);
        if ptr % 4 != 0 {
            candle_core::bail!(
                "{}: the packed buffer starts at a device address not aligned to 4 bytes",
                layout.name()
            );
        }
    }
    let f32s = |at, count| f32_section(&buf, at, count, layout.name());
    let k = Kernels {
        dev,
        n: layout.elements(),
        cols: layout.shape().last().copied().unwrap_or(1).max(1),
    };
    let data = buf.slice(s.data..s.data + s.data_len);
    let scales = f32s(s.scales, s.scale_count)?;
    let out = match layout.format() {
        PackedFormat::FourBit {
            kind,
            blocksize,
            nested,
        } => {
            let fp4 = i32::from(*kind == FourBitType::Fp4);
            match (nested, s.nested) {
                (Some(nb), Some((offset, map, codes))) => {
                    let offset = f32s(offset, 1)?;
                    let codes = buf.slice(codes..codes + k.n.div_ceil(*blocksize));
                    let map = f32s(map, 256)?;
                    let absmax = k.nested_absmax((&codes, &map, &scales), &offset, *nb as u32)?;
                    k.four_bit(&data, &absmax.slice(..), fp4, *blocksize as u32)?
                }
                _ => k.four_bit(&data, &scales, fp4, *blocksize as u32)?,
            }
        }
        PackedFormat::Int8 => k.rows("dequant_int8_bf16", &data, &scales, None)?,
        PackedFormat::Fp8 { per_row } => k.rows(
            "dequant_fp8_bf16",
            &data,
            &scales,
            Some(i32::from(*per_row)),
        )?,
    };
    k.wrap(out, layout.shape())
}
