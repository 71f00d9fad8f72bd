//! What can be wrong with a quantized tensor: each error names the tensor
//! (its name when it came from a file, else what was asked) and the numbers.
use thiserror::Error;

/// A quantized tensor that cannot be used as given.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum QuantError {
    /// A buffer's length disagrees with the shape it stands for.
    #[error("{tensor}: {part} has {got} elements where {shape:?} needs {expected}")]
    Length {
        /// The tensor.
        tensor: String,
        /// Which buffer (packed data, absmax, scales).
        part: &'static str,
        /// Elements present.
        got: usize,
        /// Elements the shape needs.
        expected: usize,
        /// The tensor's shape.
        shape: Vec<usize>,
    },
    /// A setting this crate does not implement (it would change the math).
    #[error("{tensor}: {field} {value} is not supported ({supported})")]
    Unsupported {
        /// The tensor.
        tensor: String,
        /// The setting.
        field: &'static str,
        /// Its value.
        value: String,
        /// What is.
        supported: &'static str,
    },
    /// A packed buffer that is not a contiguous 1-D u8 tensor.
    #[error("{tensor}: a packed buffer must be a contiguous 1-D u8 tensor, got {dtype} of shape {shape:?}")]
    NotBytes {
        /// The tensor.
        tensor: String,
        /// The buffer's dtype.
        dtype: String,
        /// The buffer's shape.
        shape: Vec<usize>,
    },
    /// A value that cannot scale a block (NaN or infinite).
    #[error("{tensor}: {part} holds a non-finite value at {index}")]
    NonFinite {
        /// The tensor.
        tensor: String,
        /// Which buffer.
        part: &'static str,
        /// Its index.
        index: usize,
    },
}

impl QuantError {
    /// A [`QuantError::Length`] unless `got == expected`.
    pub(crate) fn check_len(
        tensor: &str,
        part: &'static str,
        (got, expected): (usize, usize),
        shape: &[usize],
    ) -> Result<(), Self> {
        if got == expected {
            return Ok(());
        }
        Err(Self::Length {
            tensor: tensor.to_string(),
            part,
            got,
            expected,
            shape: shape.to_vec(),
        })
    }

    /// The first non-finite value of `values`, as an error.
    pub(crate) fn check_finite(
        tensor: &str,
        part: &'static str,
        values: &[f32],
    ) -> Result<(), Self> {
        match values.iter().position(|v| !v.is_finite()) {
            None => Ok(()),
            Some(index) => Err(Self::NonFinite {
                tensor: tensor.to_string(),
                part,
                index,
            }),
        }
    }
}
