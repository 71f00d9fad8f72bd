//! The kinds of failure a caller can tell apart without reading the message:
//! [`Error`], carried inside a `candle_core::Error` and read back with
//! [`Error::find`].
//!
//! The workspace's functions return `candle_core::Result`, as Candle's own do,
//! so that `?` mixes them with tensor operations. Where a failure has a kind a
//! caller may act on (out of memory: shrink the batch; a bad checkpoint: pick
//! another file; a bad configuration field: fix that field), the error is an
//! [`Error`] converted into `candle_core::Error` with `.into()` or `?`; its
//! message is the same text a string error would have had.
//!
//! ```
//! use streamer_device::Error;
//!
//! fn parse_layers(v: i64) -> candle_core::Result<usize> {
//!     if v <= 0 {
//!         return Err(Error::Config {
//!             field: "num_hidden_layers".into(),
//!             reason: format!("must be positive, got {v}"),
//!         }
//!         .into());
//!     }
//!     Ok(v as usize)
//! }
//!
//! let e = parse_layers(0).unwrap_err();
//! // Through candle's context layers too.
//! let e = e.context("reading config.json");
//! match Error::find(&e) {
//!     Some(Error::Config { field, .. }) => assert_eq!(field, "num_hidden_layers"),
//!     other => panic!("expected a config error, got {other:?}"),
//! }
//! assert!(e.to_string().contains("config field num_hidden_layers must be positive, got 0"));
//! ```
use std::path::PathBuf;

use candle_core::DType;

/// A failure of a kind callers match on. Convert it into `candle_core::Error`
/// with `.into()` (or `?`); find it again with [`Error::find`].
///
/// Inside `candle_core::Error` it travels in the `Cuda` variant's box, the only
/// one of candle's variants that keeps a `std::error::Error` that can be
/// downcast (its `Wrapped` keeps only `Display`): match with [`Error::find`],
/// not on `candle_core::Error::Cuda`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Something does not fit the memory it must fit (device or host): an
    /// allocation the driver refused, a plan larger than its budget, an
    /// injected fault. Bytes are 0 where they are not known.
    #[error("{what}")]
    OutOfMemory {
        /// Bytes that were asked for.
        needed: usize,
        /// Bytes that were available for it.
        free: usize,
        /// What did not fit, with its sizes for a person and what would make
        /// it fit: the whole message.
        what: String,
    },
    /// A tensor of the wrong shape for what it is used as.
    #[error("{what}: shape {got:?}, expected {expected}")]
    Shape {
        /// The tensor or argument (with the function or weight it belongs to).
        what: String,
        /// Its shape.
        got: Vec<usize>,
        /// The shape it must have, or the rule it breaks.
        expected: String,
    },
    /// A tensor of the wrong dtype for what it is used as.
    #[error("{what}: dtype {got:?}, expected {expected}")]
    Dtype {
        /// The tensor or argument (with the function or weight it belongs to).
        what: String,
        /// Its dtype.
        got: DType,
        /// The dtypes it may have.
        expected: String,
    },
    /// A checkpoint or state file that cannot be read, written, or used:
    /// missing, truncated, of another kind, or disagreeing with the model.
    #[error("{}: {reason}", path.display())]
    Checkpoint {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A configuration value that is invalid or not supported.
    #[error("config field {field} {reason}")]
    Config {
        /// The field (`num_hidden_layers`, `rope_scaling.factor`,
        /// `StreamConfig.slot_budget_bytes`).
        field: String,
        /// The rest of the sentence after the field's name: its value and
        /// what it must be (`= 0 is not supported (must be positive)`).
        reason: String,
    },
    /// A CUDA driver call that failed other than for lack of memory.
    #[error("CUDA error in {what}: {source}")]
    Cuda {
        /// The call or operation.
        what: String,
        /// The driver's error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        candle_core::Error::Cuda(Box::new(e)).bt()
    }
}

impl Error {
    /// The [`Error`] inside `err`, if there is one: through candle's
    /// `Context`, `WithPath`, `WithBacktrace` and `WrappedContext` layers,
    /// [`Error::prefixed`]'s and any error's `source()` chain. Takes a
    /// `candle_core::Error` (`Error::find(&e)`) or any other error, such as
    /// an `anyhow::Error` (`Error::find(e.as_ref())`).
    pub fn find<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a Error> {
        if let Some(e) = err.downcast_ref::<Error>() {
            return Some(e);
        }
        if let Some(e) = err.downcast_ref::<candle_core::Error>() {
            use candle_core::Error as C;
            return match e {
                C::Cuda(inner) => Self::find(&**inner),
                C::WrappedContext { wrapped, .. } => Self::find(&**wrapped),
                C::Context { inner, .. } | C::WithPath { inner, .. } => Self::find(&**inner),
                C::WithBacktrace { inner, .. } => Self::find(&**inner),
                _ => None,
            };
        }
        Self::find(err.source()?)
    }

    /// Whether `err` is a lack of memory: an [`Error::OutOfMemory`] inside it
    /// (see [`Error::find`]) or, with `cuda`, the driver's
    /// `CUDA_ERROR_OUT_OF_MEMORY` from one of candle's own allocations.
    pub fn is_out_of_memory(err: &candle_core::Error) -> bool {
        if matches!(Self::find(err), Some(Error::OutOfMemory { .. })) {
            return true;
        }
        #[cfg(feature = "cuda")]
        if crate::cuda::driver_error(err)
            .is_some_and(|d| d.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)
        {
            return true;
        }
        false
    }

    /// `Ok` where `got` is `want`; else an [`Error::Shape`] of `got`, with
    /// the `(what, expected)` that `describe` makes (only then).
    pub fn check_shape(
        got: &[usize],
        want: &[usize],
        describe: impl FnOnce() -> (String, String),
    ) -> candle_core::Result<()> {
        if got == want {
            return Ok(());
        }
        let (what, expected) = describe();
        let got = got.to_vec();
        Err(Error::Shape {
            what,
            got,
            expected,
        }
        .into())
    }

    /// `err` with `prefix` in front of its message (`"{prefix}: {err}"`),
    /// keeping the [`Error`] inside it for [`Error::find`]. For the file or
    /// step an error happened in, where candle's own `context` would put the
    /// prefix on a line of its own.
    pub fn prefixed(err: candle_core::Error, prefix: impl std::fmt::Display) -> candle_core::Error {
        candle_core::Error::Cuda(Box::new(Prefixed {
            prefix: prefix.to_string(),
            inner: err,
        }))
    }
}

/// An error with a prefix in front of its message ([`Error::prefixed`]).
#[derive(Debug, thiserror::Error)]
#[error("{prefix}: {inner}")]
struct Prefixed {
    prefix: String,
    #[source]
    inner: candle_core::Error,
}
