//! The shape of a training step, which both the device plan's estimates and
//! the measured step rates are taken at.
use candle_core::DType;

/// A step's shape: sequences, tokens each, compute dtype.
#[derive(Clone, Copy, Debug)]
pub struct StepShape {
    /// Sequences a step.
    pub rows: usize,
    /// Tokens a sequence.
    pub seq: usize,
    /// Compute dtype.
    pub dtype: DType,
}
