//! A packed (variable-length) call as the kernels take it: its documents and
//! their bands. Its own module, so that the op and the launchers read it
//! without depending on `varlen`, which builds it and calls the op.

/// One document: its query rows `q0..q1` and keys `k0..k1`.
pub(crate) type Document = ((usize, usize), (usize, usize));

/// A packed call that one launch of the tensor-core kernels serves: the documents
/// and each one's band `(lo, hi)` (as in [`crate::Scores`]) relative to its own rows
/// and keys, the call's masks aligned bottom-right to it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by the CUDA launches
pub(crate) struct Fused {
    pub(crate) docs: Vec<Document>,
    pub(crate) bands: Vec<(Option<i64>, Option<i64>)>,
}
