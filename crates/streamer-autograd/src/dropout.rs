//! Dropout that a recompute can replay: masks are drawn from a seed the trainer
//! sets for each block, so the backward pass's recompute sees the very masks the
//! forward pass used. Candle's own dropout draws from the device RNG, which the
//! CPU device cannot seed; use this one in streamed blocks.
//!
//! Replayed masks never touch the device's own generator (the one
//! `Tensor::rand` and `Device::set_seed` use): on the CPU they come from a
//! xorshift stream of the seed, on CUDA from a Philox generator of this
//! module's own, reseeded for each mask, so the caller's random streams go on
//! as if no dropout had run.
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

/// One Philox generator per CUDA context, made at its first mask and kept
/// (with the context) for the process, reseeded for every mask: Philox's
/// output depends only on its seed and offset, so a reseeded generator gives
/// what a fresh one would. Made and destroyed for each mask, generators
/// were thousands of driver calls a step. (They were not why the LoRA
/// budget test runs out of memory with dropout on: it still does with this
/// generator, `benches/results/cuda-tests-h100.txt`.)
#[cfg(feature = "cuda")]
mod philox {
    use candle_core::cuda_backend::cudarc::curand::{result, sys};
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    use candle_core::Result;
    use std::sync::{Arc, Mutex};

    struct Generator {
        raw: sys::curandGenerator_t,
        // Kept alive, so that the generator's context outlives it and no
        // other context can take its address (the key below).
        ctx: Arc<CudaContext>,
    }

    // SAFETY: a curand generator may be used from any thread, one call at a
    // time; every use goes through `GENERATORS`' lock.
    unsafe impl Send for Generator {}

    static GENERATORS: Mutex<Vec<Generator>> = Mutex::new(Vec::new());

    fn w(e: result::CurandError) -> candle_core::Error {
        candle_core::Error::Msg(format!("curand: {e:?}"))
    }

    /// Runs `f` with `ctx`'s generator, seeded with `seed` at offset 0 and
    /// set to `stream`, under the lock.
    pub(super) fn with_seeded<T>(
        ctx: &Arc<CudaContext>,
        stream: sys::cudaStream_t,
        seed: u64,
        f: impl FnOnce(sys::curandGenerator_t) -> Result<T>,
    ) -> Result<T> {
        let mut all = GENERATORS
            .lock()
            .map_err(|_| candle_core::Error::Msg("dropout generators poisoned".into()))?;
        let at = match all.iter().position(|g| Arc::ptr_eq(&g.ctx, ctx)) {
            Some(i) => i,
            None => {
                ctx.bind_to_thread().map_err(candle_core::Error::wrap)?;
                let raw = result::create_generator_kind(
                    sys::curandRngType_t::CURAND_RNG_PSEUDO_PHILOX4_32_10,
                )
                .map_err(w)?;
                all.push(Generator {
                    raw,
                    ctx: ctx.clone(),
                });
                all.len() - 1
            }
        };
        let raw = all[at].raw;
        // SAFETY: `raw` is a live generator (never destroyed), used under the
        // lock; work enqueued with an earlier seed keeps its parameters
        // (Philox keeps no state on the device).
        unsafe {
            result::set_seed(raw, seed).map_err(w)?;
            result::set_offset(raw, 0).map_err(w)?;
            result::set_stream(raw, stream).map_err(w)?;
        }
        f(raw)
    }
}

/// Uniform [0, 1) f32 noise of `shape` on `dev`'s stream from a Philox
/// generator seeded with `seed`: the same seed gives the same noise, and the
/// device's own generator is left as it was.
#[cfg(feature = "cuda")]
fn cuda_uniform(dev: &candle_core::CudaDevice, seed: u64, shape: &[usize]) -> Result<Tensor> {
    use candle_core::cuda_backend::cudarc::curand::{result, sys};
    use candle_core::cuda_backend::cudarc::driver::DevicePtrMut;
    let n: usize = shape.iter().product();
    if n == 0 {
        return Tensor::zeros(shape, candle_core::DType::F32, &Device::Cuda(dev.clone()));
    }
    let stream = dev.cuda_stream();
    // SAFETY: every one of the n elements is written by the generator below,
    // on this stream, before any later kernel on it reads them.
    let mut slice = unsafe { stream.alloc::<f32>(n) }.map_err(candle_core::Error::wrap)?;
    let raw_stream = stream.cu_stream() as sys::cudaStream_t;
    philox::with_seeded(stream.context(), raw_stream, seed, |gen| {
        let (ptr, _record) = slice.device_ptr_mut(&stream);
        // SAFETY: `ptr` holds n f32s of a live allocation, enqueued on `stream`.
        unsafe { result::generate::uniform_f32(gen, ptr as *mut f32, n) }
            .map_err(|e| candle_core::Error::Msg(format!("curand: {e:?}")))
    })?;
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
