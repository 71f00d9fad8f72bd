//! Optimizer state in f32 or bf16. bf16 state halves the host memory of
//! AdamW's moments (8 to 4 bytes per parameter), which is what lets an 8B
//! full fine-tune's state fit a 128 GiB host. The update math stays f32; each
//! state element is rounded to bf16 *stochastically* when stored (rounded up
//! with probability equal to the dropped fraction), so a moment whose
//! per-step change is below half a bf16 ulp (AdamW's `v` moves by 0.1 % of
//! itself per step at beta2 = 0.999, under bf16's 0.39 % resolution) still
//! follows its f32 value in expectation instead of freezing.
use std::borrow::Cow;

use candle_core::{bail, Result};
use half::bf16;

/// The element type of an optimizer's state buffers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StateDtype {
    /// 4 bytes per element (the default; exact with respect to candle-nn).
    #[default]
    F32,
    /// 2 bytes per element, stochastically rounded at every store.
    Bf16,
}

impl StateDtype {
    /// Bytes per state element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }
}

impl std::str::FromStr for StateDtype {
    type Err = candle_core::Error;

    /// `f32` or `bf16`.
    fn from_str(s: &str) -> Result<Self> {
        parse_choice(
            "optimizer state dtype",
            s,
            &[("f32", Self::F32), ("bf16", Self::Bf16)],
        )
    }
}

/// `s` as the value of the choice of that name in `choices`; anything else is
/// an error naming `what`, the value and the names expected.
pub(crate) fn parse_choice<T: Copy>(what: &str, s: &str, choices: &[(&str, T)]) -> Result<T> {
    match choices.iter().find(|(name, _)| *name == s) {
        Some(&(_, value)) => Ok(value),
        None => {
            let names: Vec<&str> = choices.iter().map(|(name, _)| *name).collect();
            bail!("{what} {s:?}: expected {}", names.join(" or "))
        }
    }
}

/// One state buffer of one parameter.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum StateBuf {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl StateBuf {
    /// Zeros from the allocator's zeroed pages (no pass over the memory: an
    /// 8B model's bf16 moments are 32 GB).
    pub(crate) fn zeros(dtype: StateDtype, n: usize) -> Self {
        use half::vec::HalfBitsVecExt;
        match dtype {
            StateDtype::F32 => Self::F32(vec![0f32; n]),
            StateDtype::Bf16 => Self::Bf16(vec![0u16; n].reinterpret_into()),
        }
    }

    /// `values` stored as `dtype` (bf16: rounded to nearest, as a load is
    /// done once and needs no stochastic rounding to be unbiased over steps).
    pub(crate) fn from_f32(dtype: StateDtype, values: Vec<f32>) -> Self {
        match dtype {
            StateDtype::F32 => Self::F32(values),
            StateDtype::Bf16 => Self::Bf16(values.into_iter().map(bf16::from_f32).collect()),
        }
    }

    pub(crate) fn as_f32_mut(&mut self) -> Option<&mut [f32]> {
        match self {
            Self::F32(v) => Some(v),
            Self::Bf16(_) => None,
        }
    }

    pub(crate) fn as_bf16_mut(&mut self) -> Option<&mut [bf16]> {
        match self {
            Self::Bf16(v) => Some(v),
            Self::F32(_) => None,
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Bf16(v) => v.len(),
        }
    }

    /// The values in f32 (borrowed when they are f32).
    pub(crate) fn to_f32(&self) -> Cow<'_, [f32]> {
        match self {
            Self::F32(v) => Cow::Borrowed(v),
            Self::Bf16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
        }
    }

    /// The values in f32, consuming the buffer.
    pub(crate) fn into_f32(self) -> Vec<f32> {
        match self {
            Self::F32(v) => v,
            Self::Bf16(v) => v.into_iter().map(|x| x.to_f32()).collect(),
        }
    }
}

/// A state element the update kernels read and write; the math is f32.
pub(crate) trait StateElem: Copy + Send + Sync {
    fn load(self) -> f32;
    /// `x` stored; `noise` holds 16 random bits (low half) for stochastic rounding.
    fn store(x: f32, noise: u32) -> Self;
}

impl StateElem for f32 {
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store(x: f32, _noise: u32) -> Self {
        x
    }
}

impl StateElem for bf16 {
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    /// Adds 16 random bits below bf16's last mantissa bit, then truncates:
    /// rounds up with probability (dropped bits) / 2^16. Infinities keep
    /// their bits; NaN stays NaN.
    #[inline(always)]
    fn store(x: f32, noise: u32) -> Self {
        let bits = x.to_bits();
        let add = (noise & 0xFFFF) * u32::from(x.is_finite());
        let r = (bits.wrapping_add(add) >> 16) as u16;
        bf16::from_bits(if x.is_nan() { 0x7FC0 } else { r })
    }
}

/// Random bits for element `i` of a state buffer at a given seed (a mix of
/// the step and the parameter): murmur3's finaliser over the index, cheap
/// enough to vectorise beside the update.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Noise {
    pub(crate) seed: u32,
    /// The index of the chunk's first element within its parameter.
    pub(crate) offset: usize,
}

impl Noise {
    pub(crate) fn new(step: usize, param: usize) -> Self {
        let seed =
            (step as u32).wrapping_mul(0x9E37_79B1) ^ (param as u32).wrapping_mul(0x85EB_CA6B);
        Self { seed, offset: 0 }
    }

    pub(crate) fn at_offset(self, offset: usize) -> Self {
        Self { offset, ..self }
    }

    /// 32 random bits for element `i` of the chunk.
    #[inline(always)]
    pub(crate) fn bits(self, i: usize) -> u32 {
        let mut h = ((self.offset + i) as u32).wrapping_mul(0x9E37_79B1) ^ self.seed;
        h ^= h >> 16;
        h = h.wrapping_mul(0x85EB_CA6B);
        h ^= h >> 13;
        h = h.wrapping_mul(0xC2B2_AE35);
        h ^ (h >> 16)
    }
}
