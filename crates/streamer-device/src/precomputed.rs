//! A graph node for a result computed outside Candle's autograd, with a
//! hand-written backward: [`with_backward3`].
//!
//! A result assembled from many calls (documents of a packed attention call,
//! for example) would otherwise reach its inputs through autograd of every
//! `narrow` and `cat` on the way, and Candle's backward of `narrow` builds a
//! zero-padded gradient of the whole input for each piece and adds them up.
//! Here the backward returns each input's whole gradient once.
use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};

/// The backward of [`with_backward3`]: the gradients of the three inputs for
/// the gradient of the result (`None`: no gradient reaches that input).
pub type Backward3 =
    dyn Fn(&Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> + Send + Sync;

struct Precomputed {
    name: &'static str,
    /// The result until the forward copies it out (then dropped, so that the
    /// graph does not keep a second copy alive).
    out: Mutex<Option<Tensor>>,
    backward: Box<Backward3>,
}

impl Precomputed {
    /// The stored result, taken: a forward runs once per node.
    fn take(&self) -> Result<Tensor> {
        let out = self.out.lock().unwrap_or_else(|p| p.into_inner()).take();
        out.ok_or_else(|| candle_core::Error::Msg(format!("{}: forward ran twice", self.name)))
    }

    /// The forward on either device: a copy of the taken result's storage,
    /// which `own` picks out when it is of the inputs' `device` kind.
    fn forward<S>(
        &self,
        device: &str,
        own: impl FnOnce(&Storage, &Layout) -> Option<Result<S>>,
    ) -> Result<(S, Shape)> {
        let out = self.take()?;
        let (s, l) = out.storage_and_layout();
        match own(&s, l) {
            Some(copy) => Ok((copy?, l.shape().clone())),
            None => bail!(
                "{}: the precomputed result is not on the inputs' device ({device})",
                self.name
            ),
        }
    }
}

impl CustomOp3 for Precomputed {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.forward("CPU", |s, l| match s {
            Storage::Cpu(c) => Some(c.try_clone(l)),
            _ => None,
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.forward("CUDA", |s, l| match s {
            Storage::Cuda(c) => Some(c.try_clone(l)),
            _ => None,
        })
    }

    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        (self.backward)(grad_res)
    }
}

/// `out` (computed from `a`, `b`, `c` outside autograd) as a node of the graph
/// with inputs `a`, `b`, `c`, whose backward is `backward`. The result has
/// `out`'s shape, dtype and elements (a copy, on the inputs' device, where `out`
/// must be); `name` names the op in errors.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
///
/// let dev = Device::Cpu;
/// let (a, b, c) = (Var::new(&[1f32, 2.], &dev)?, Var::new(&[3f32], &dev)?, Var::new(&[4f32], &dev)?);
/// // y = 2 a, computed outside the graph; its backward says so.
/// let out = (a.as_tensor().detach() * 2.0)?;
/// let y = streamer_device::with_backward3("double", a.as_tensor(), b.as_tensor(), c.as_tensor(), out, |g| {
///     Ok((Some((g * 2.0)?), None, None))
/// })?;
/// let grads = y.sum_all()?.backward()?;
/// assert_eq!(grads.get(&a).unwrap().to_vec1::<f32>()?, [2., 2.]);
/// assert!(grads.get(&b).is_none());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn with_backward3(
    name: &'static str,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    out: Tensor,
    backward: impl Fn(&Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)>
        + Send
        + Sync
        + 'static,
) -> Result<Tensor> {
    if !out.device().same_device(a.device()) {
        bail!(
            "{name}: the precomputed result is on {:?}, the inputs on {:?}",
            out.device(),
            a.device()
        )
    }
    let op = Precomputed {
        name,
        out: Mutex::new(Some(out)),
        backward: Box::new(backward),
    };
    a.apply_op3_arc(b, c, Arc::new(Box::new(op)))
}
