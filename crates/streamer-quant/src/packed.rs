//! A quantized tensor as ONE byte buffer: what a streamed layer keeps as its
//! host master and copies to the device. Every f32 section (scales) comes
//! first, so a buffer that starts 4-byte aligned keeps them aligned; the
//! byte sections (codes, packed data) follow, the data 16-byte aligned
//! (zero padding before it):
//!
//! | format | sections, in order |
//! | --- | --- |
//! | 4-bit, plain absmax | absmax `f32 x blocks`, packed `u8 x ceil(n / 2)` |
//! | 4-bit, nested absmax | offset `f32`, map `f32 x 256`, scales `f32 x ceil(blocks / nested)`, codes `u8 x blocks`, packed |
//! | int8 rows | SCB `f32 x rows`, data `i8 x rows * cols` |
//! | fp8 | scales `f32 x (rows or 1)`, data `u8 x rows * cols` |
//!
//! A [`PackedLayout`] describes the buffer without its data (shape and
//! format), so the code that reads it can be made before the bytes exist.
use crate::{elements, Absmax, FourBit, FourBitType, Fp8, Fp8Scale, HostTensor, Int8Rows};
use crate::{NestedAbsmax, QuantError, Result};

/// Values of a double-quantized absmax map (bitsandbytes' dynamic map).
const MAP_LEN: usize = 256;

/// Alignment of the data section within a buffer, in bytes.
const DATA_ALIGN: usize = 16;

/// Which format a packed buffer holds, and its settings.
#[derive(Clone, Debug, PartialEq)]
pub enum PackedFormat {
    /// NF4 or FP4 of `blocksize`; `nested` is the double-quantized absmax's
    /// block size, `None` for plain f32 absmax.
    FourBit {
        /// NF4 or FP4.
        kind: FourBitType,
        /// Elements an absmax covers.
        blocksize: usize,
        /// Absmax values a nested scale covers, when double-quantized.
        nested: Option<usize>,
    },
    /// int8 with one absmax per row.
    Int8,
    /// fp8 e4m3 with one scale per row (`per_row`) or per tensor.
    Fp8 {
        /// One scale per row, else one for the tensor.
        per_row: bool,
    },
}

/// Where the sections of a packed buffer lie, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sections {
    /// Offset of the f32 scales (absmax, SCB, fp8 scales; nested: the
    /// nested scales).
    pub scales: usize,
    /// Number of f32 scales.
    pub scale_count: usize,
    /// Offset of the data (packed nibbles, int8 or e4m3 bytes).
    pub data: usize,
    /// Bytes of data.
    pub data_len: usize,
    /// Nested absmax: offsets of the f32 offset, the f32 map and the u8
    /// codes (one per 4-bit block).
    pub nested: Option<(usize, usize, usize)>,
    /// The buffer's length.
    pub total: usize,
}

/// The shape and format of a packed quantized tensor (see the module
/// documentation for the byte layout).
#[derive(Clone, Debug, PartialEq)]
pub struct PackedLayout {
    name: String,
    shape: Vec<usize>,
    format: PackedFormat,
}

impl PackedLayout {
    /// The layout of tensor `name` of `shape` in `format`, checked: 4-bit
    /// block sizes bitsandbytes takes, int8 and fp8 two-dimensional.
    pub fn new(name: &str, shape: &[usize], format: PackedFormat) -> Result<Self> {
        let unsupported = |field, value: String, supported| QuantError::Unsupported {
            tensor: name.to_string(),
            field,
            value,
            supported,
        };
        match &format {
            PackedFormat::FourBit {
                blocksize, nested, ..
            } => {
                if !crate::BLOCK_SIZES.contains(blocksize) {
                    let s = "32, 64, 128, 256, 512, 1024, 2048 or 4096";
                    return Err(unsupported("blocksize", blocksize.to_string(), s));
                }
                if *nested == Some(0) {
                    let s = "a positive block size (bitsandbytes writes 256)";
                    return Err(unsupported("nested_blocksize", "0".into(), s));
                }
            }
            PackedFormat::Int8 | PackedFormat::Fp8 { .. } if shape.len() != 2 => {
                let s = "two dimensions (rows, cols)";
                return Err(unsupported("shape", format!("{shape:?}"), s));
            }
            _ => {}
        }
        Ok(Self {
            name: name.to_string(),
            shape: shape.to_vec(),
            format,
        })
    }

    /// The tensor's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The dense tensor's shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The format.
    pub fn format(&self) -> &PackedFormat {
        &self.format
    }

    /// Elements of the dense tensor.
    pub fn elements(&self) -> usize {
        elements(&self.shape)
    }

    /// Rows of a 2-D tensor (the first dimension; 1 for a scalar).
    fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }

    /// Where each section lies.
    pub fn sections(&self) -> Sections {
        let n = self.elements();
        let (scale_count, nested, data_len, pre) = match &self.format {
            PackedFormat::FourBit {
                blocksize, nested, ..
            } => {
                let blocks = n.div_ceil(*blocksize);
                match nested {
                    None => (blocks, None, n.div_ceil(2), 0),
                    Some(nb) => {
                        let scales = blocks.div_ceil(*nb);
                        let codes = 4 * (1 + MAP_LEN + scales);
                        (scales, Some((0, 4, codes)), n.div_ceil(2), blocks)
                    }
                }
            }
            PackedFormat::Int8 => (self.rows(), None, n, 0),
            PackedFormat::Fp8 { per_row } => (if *per_row { self.rows() } else { 1 }, None, n, 0),
        };
        let scales = if nested.is_some() {
            4 * (1 + MAP_LEN)
        } else {
            0
        };
        // The data starts 16-byte aligned: the kernels read it 8 or 16 bytes
        // at a time only from aligned addresses.
        let data = (scales + 4 * scale_count + pre).next_multiple_of(DATA_ALIGN);
        Sections {
            scales,
            scale_count,
            data,
            data_len,
            nested,
            total: data + data_len,
        }
    }

    /// Bytes of the packed buffer.
    pub fn bytes(&self) -> usize {
        self.sections().total
    }

    /// Fails unless a buffer of `got` bytes is this layout's length.
    pub fn check_len(&self, got: usize) -> Result<()> {
        QuantError::check_len(
            &self.name,
            "packed buffer (bytes)",
            (got, self.bytes()),
            &self.shape,
        )
    }

    /// The tensor held in `bytes` (checked as its parts are).
    pub fn unpack(&self, bytes: &[u8]) -> Result<HostTensor> {
        self.check_len(bytes.len())?;
        let s = self.sections();
        let f32s = |at: usize, count: usize| -> Vec<f32> {
            (bytes[at..at + 4 * count].chunks_exact(4))
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let data = bytes[s.data..s.data + s.data_len].to_vec();
        let scales = f32s(s.scales, s.scale_count);
        let (name, shape) = (&self.name, &self.shape);
        Ok(match &self.format {
            PackedFormat::FourBit {
                kind,
                blocksize,
                nested,
            } => {
                let absmax = match (nested, s.nested) {
                    (Some(nb), Some((offset, map, codes))) => Absmax::Nested(NestedAbsmax {
                        codes: bytes[codes..codes + block_count(shape, *blocksize)].to_vec(),
                        map: f32s(map, MAP_LEN),
                        absmax: scales,
                        blocksize: *nb,
                        offset: f32s(offset, 1)[0],
                    }),
                    _ => Absmax::Plain(scales),
                };
                let kb = (*kind, *blocksize);
                HostTensor::FourBit(FourBit::new(name, shape, kb, data, absmax)?)
            }
            PackedFormat::Int8 => {
                let data = data.into_iter().map(|b| b as i8).collect();
                HostTensor::Int8(Int8Rows::new(name, (shape[0], shape[1]), data, scales)?)
            }
            PackedFormat::Fp8 { per_row } => {
                let scale = match per_row {
                    true => Fp8Scale::Rows(scales),
                    false => Fp8Scale::Tensor(scales[0]),
                };
                HostTensor::Fp8(Fp8::new(name, (shape[0], shape[1]), data, scale)?)
            }
        })
    }
}

impl HostTensor {
    /// The tensor's layout as one packed buffer.
    pub fn layout(&self) -> PackedLayout {
        let (shape, format) = match self {
            Self::FourBit(q) => {
                let nested = match q.absmax() {
                    Absmax::Plain(_) => None,
                    Absmax::Nested(n) => Some(n.blocksize),
                };
                let format = PackedFormat::FourBit {
                    kind: q.quant_type(),
                    blocksize: q.blocksize(),
                    nested,
                };
                (q.shape().to_vec(), format)
            }
            Self::Int8(q) => (vec![q.dims().0, q.dims().1], PackedFormat::Int8),
            Self::Fp8(q) => {
                let per_row = matches!(q.scale(), Fp8Scale::Rows(_));
                (vec![q.dims().0, q.dims().1], PackedFormat::Fp8 { per_row })
            }
        };
        PackedLayout {
            name: self.name().to_string(),
            shape,
            format,
        }
    }

    /// The tensor as one packed buffer ([`PackedLayout`]'s byte order,
    /// f32 little-endian).
    pub fn to_bytes(&self) -> Vec<u8> {
        let layout = self.layout();
        let mut out = Vec::with_capacity(layout.bytes());
        let put = |out: &mut Vec<u8>, v: &[f32]| out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
        match self {
            Self::FourBit(q) => {
                match q.absmax() {
                    Absmax::Plain(a) => put(&mut out, a),
                    Absmax::Nested(n) => {
                        put(&mut out, &[n.offset]);
                        put(&mut out, &n.map);
                        put(&mut out, &n.absmax);
                        out.extend_from_slice(&n.codes);
                    }
                }
                out.resize(layout.sections().data, 0);
                out.extend_from_slice(q.packed());
            }
            Self::Int8(q) => {
                put(&mut out, q.scb());
                out.resize(layout.sections().data, 0);
                out.extend(q.data().iter().map(|&b| b as u8));
            }
            Self::Fp8(q) => {
                match q.scale() {
                    Fp8Scale::Tensor(s) => put(&mut out, &[*s]),
                    Fp8Scale::Rows(s) => put(&mut out, s),
                }
                out.resize(layout.sections().data, 0);
                out.extend_from_slice(q.data());
            }
        }
        out
    }
}

impl PackedLayout {
    /// A valid buffer of this layout with random codes (SplitMix64 of
    /// `seed`) and every scale set so the dense values lie within about
    /// `±magnitude`: weights of the right size and range for benches, made
    /// without a dense tensor.
    pub fn synthetic(&self, seed: u64, magnitude: f32) -> Vec<u8> {
        let s = self.sections();
        let mut out = vec![0u8; s.total];
        let mut state = seed;
        for chunk in out[s.data..].chunks_mut(8) {
            // SplitMix64.
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
        }
        let scale = match self.format {
            // fp8 bytes below 0x40 in magnitude are at most 1.875 (no NaN).
            PackedFormat::Fp8 { .. } => {
                out[s.data..].iter_mut().for_each(|b| *b &= 0xbf);
                magnitude / 1.875
            }
            PackedFormat::Int8 => magnitude,
            PackedFormat::FourBit { nested: None, .. } => magnitude,
            // Nested: every absmax is the offset (zero nested scales).
            PackedFormat::FourBit {
                nested: Some(_), ..
            } => 0.0,
        };
        let mut put = |at: usize, v: f32| out[at..at + 4].copy_from_slice(&v.to_le_bytes());
        (0..s.scale_count).for_each(|i| put(s.scales + 4 * i, scale));
        if let Some((offset, map, _)) = s.nested {
            put(offset, magnitude);
            for (i, v) in crate::dynamic_map().into_iter().enumerate() {
                put(map + 4 * i, v);
            }
        }
        out
    }
}

/// 4-bit blocks of `blocksize` in a tensor of `shape`.
fn block_count(shape: &[usize], blocksize: usize) -> usize {
    elements(shape).div_ceil(blocksize)
}
