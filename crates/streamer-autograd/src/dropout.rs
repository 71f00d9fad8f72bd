//! Dropout that a recompute can replay: masks are drawn from a seed the trainer
//! sets for each block, so the backward pass's recompute sees the very masks the
//! forward pass used. Candle's own dropout draws from the device RNG, which the
//! CPU device cannot seed; use this one in streamed blocks.
//!
//! Replayed masks never touch the device's own generator (the one
//! `Tensor::rand` and `Device::set_seed` use): on the CPU they come from a
//! xorshift stream of the seed, on CUDA from a Philox generator created for the
//! one mask and destroyed after it, so the caller's random streams go on as if
//! no dropout had run.
use candle_core::{DType, Device, Module, Result, Tensor};
use std::cell::Cell;

thread_local! {
    /// (seed of the running block, draws so far in it); None outside a block.
    static BLOCK_SEED: Cell<Option<(u64, u64)>> = const { Cell::new(None) };
}

/// Runs `f` with dropout masks drawn from `seed`: the same seed replays the same
/// masks. The trainer wraps every block's forward and recompute in this.
pub fn with_seed<T>(seed: u64, f: impl FnOnce() -> T) -> T {
    let prev = BLOCK_SEED.with(|s| s.replace(Some((seed, 0))));
    let out = f();
    BLOCK_SEED.with(|s| s.set(prev));
    out
}

/// Sets (or clears) the block seed directly; for drivers that cannot wrap a
/// block's forward in a closure (the forward loop sets it per block).
pub(crate) fn set_seed(seed: Option<u64>) {
    BLOCK_SEED.with(|s| s.set(seed.map(|s| (s, 0))));
}

fn next_seed() -> Option<u64> {
    BLOCK_SEED.with(|s| {
        s.get().map(|(seed, n)| {
            s.set(Some((seed, n + 1)));
            // Independent streams per draw.
            streamer_core::mix_seed(seed, n)
        })
    })
}

/// Uniform [0, 1) noise of `shape` on `device`, from the current block seed when
/// there is one (replayable), else from the device's RNG.
fn uniform(shape: &[usize], device: &Device) -> Result<Tensor> {
    match next_seed() {
        None => Tensor::rand(0f32, 1f32, shape, device),
        Some(seed) => match device {
            Device::Cpu => {
                let n: usize = shape.iter().product();
                let mut state = seed | 1;
                let v: Vec<f32> = (0..n)
                    .map(|_| {
                        // xorshift64*: fast and good enough for dropout masks.
                        state ^= state >> 12;
                        state ^= state << 25;
                        state ^= state >> 27;
                        let r = state.wrapping_mul(0x2545_F491_4F6C_DD1D);
                        (r >> 40) as f32 / (1u64 << 24) as f32
                    })
                    .collect();
                Tensor::from_vec(v, shape, device)
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => cuda_uniform(dev, seed, shape),
            other => candle_core::bail!(
                "replayable dropout supports the CPU and CUDA, not {:?}",
                other.location()
            ),
        },
    }
}

/// A curand generator owned by one mask, destroyed on drop.
#[cfg(feature = "cuda")]
struct Philox(candle_core::cuda_backend::cudarc::curand::sys::curandGenerator_t);

#[cfg(feature = "cuda")]
impl Drop for Philox {
    fn drop(&mut self) {
        use candle_core::cuda_backend::cudarc::curand::result;
        // SAFETY: created once in `cuda_uniform` and destroyed once, here; work
        // already enqueued with it keeps its parameters (Philox has no device
        // state), as with cudarc's own `CudaRng`, which drops the same way.
        let _ = unsafe { result::destroy_generator(self.0) };
    }
}

/// Uniform [0, 1) f32 noise of `shape` on `dev`'s stream from a Philox
/// generator seeded with `seed`: the same seed gives the same noise, and the
/// device's own generator is left as it was.
#[cfg(feature = "cuda")]
fn cuda_uniform(dev: &candle_core::CudaDevice, seed: u64, shape: &[usize]) -> Result<Tensor> {
    use candle_core::cuda_backend::cudarc::curand::{result, sys};
    use candle_core::cuda_backend::cudarc::driver::DevicePtrMut;
    let w = |e: result::CurandError| candle_core::Error::Msg(format!("curand: {e:?}"));
    let n: usize = shape.iter().product();
    if n == 0 {
        return Tensor::zeros(shape, candle_core::DType::F32, &Device::Cuda(dev.clone()));
    }
    let stream = dev.cuda_stream();
    let gen = Philox(
        result::create_generator_kind(sys::curandRngType_t::CURAND_RNG_PSEUDO_PHILOX4_32_10)
            .map_err(w)?,
    );
    // SAFETY: `gen.0` is a live generator; the stream outlives this call's
    // enqueued work (the output slice below holds it).
    unsafe {
        result::set_seed(gen.0, seed).map_err(w)?;
        result::set_stream(gen.0, stream.cu_stream() as sys::cudaStream_t).map_err(w)?;
    }
    // SAFETY: every one of the n elements is written by the generator below,
    // on this stream, before any later kernel on it reads them.
    let mut slice = unsafe { stream.alloc::<f32>(n) }.map_err(candle_core::Error::wrap)?;
    {
        let (ptr, _record) = slice.device_ptr_mut(&stream);
        // SAFETY: `ptr` holds n f32s of a live allocation, enqueued on `stream`.
        unsafe { result::generate::uniform_f32(gen.0, ptr as *mut f32, n) }.map_err(w)?;
    }
    Ok(streamer_device::slice_tensor(slice, dev, shape))
}

/// Inverted dropout with probability `p` (kept values scaled by `1 / (1 - p)`),
/// replayable under [`with_seed`].
pub fn dropout(xs: &Tensor, p: f32) -> Result<Tensor> {
    if p == 0.0 {
        return Ok(xs.clone());
    }
    let keep = dropout_keep(xs.dims(), p, xs.device())?;
    xs.mul(&dropout_scale(&keep, p, xs.dtype())?)
}

/// The elements [`dropout`] with probability `p` keeps over `dims`, as u8
/// (1 kept, 0 dropped): the same draw as `dropout` at this point, a byte an
/// element (a saved mask a quarter of an f32 one).
pub fn dropout_keep(dims: &[usize], p: f32, device: &Device) -> Result<Tensor> {
    if !(0.0..1.0).contains(&p) {
        candle_core::bail!("dropout probability must be in [0, 1), got {p}");
    }
    uniform(dims, device)?.ge(p as f64)
}

/// The scaled mask `dropout` multiplies by, in `dtype`, from its kept
/// elements ([`dropout_keep`]): the same bits as `dropout` uses.
pub fn dropout_scale(keep: &Tensor, p: f32, dtype: DType) -> Result<Tensor> {
    keep.to_dtype(dtype)?.affine(1.0 / (1.0 - p as f64), 0.0)
}

/// Inverted dropout of the mask site `key` of a block call: identity outside
/// training, else masks from [`streamer_core::BlockCtx::seed_for`], so the
/// forward and its recompute agree whichever thread draws them (rayon work
/// inside a block included). Pick one `key` per dropout site of the block.
pub fn dropout_ctx(xs: &Tensor, p: f32, ctx: &streamer_core::BlockCtx, key: u64) -> Result<Tensor> {
    if !(0.0..1.0).contains(&p) {
        candle_core::bail!("dropout probability must be in [0, 1), got {p}");
    }
    match ctx.seed_for(key) {
        Some(seed) if ctx.training && p > 0.0 => with_seed(seed, || dropout(xs, p)),
        _ => Ok(xs.clone()),
    }
}

/// A dropout layer (like candle-nn's `Dropout`) whose masks replay under
/// [`with_seed`]. As a `Module` it is always active; build it with `p = 0` for
/// evaluation.
#[derive(Debug, Clone, Copy)]
pub struct Dropout {
    p: f32,
}

impl Dropout {
    /// Dropout with drop probability `p`.
    pub fn new(p: f32) -> Self {
        Self { p }
    }
}

impl Module for Dropout {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        dropout(xs, self.p)
    }
}
