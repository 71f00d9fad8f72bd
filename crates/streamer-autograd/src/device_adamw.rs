//! `DeviceAdamW`: AdamW whose moments live on the GPU, one fused kernel per
//! parameter (`kernels/src/optim.cu`), rounding exactly as [`crate::CpuAdamW`]:
//! f32 moments (8 bytes per parameter) or bf16 moments rounded stochastically
//! with `CpuAdamW`'s bits (4 bytes per parameter, which is what lets a
//! 14B-class model's moments share an 141 GB GPU with its activations).
//!
//! Two uses. Resident parameters (CUDA `Var`s) step in place through
//! candle-nn's `Optimizer` trait, one pass instead of candle-nn AdamW's
//! dozen element-wise ops. Streamed parameters (host masters) step inside
//! [`crate::TrainableSequential::backward_step_device`]: while a block's
//! masters are staged on the device for its backward, they are stepped there
//! and copied back by the D2H that would otherwise carry their gradients, so
//! the host does no optimizer work at all (12 bytes of DMA per parameter and
//! step, 8 bytes of moments per parameter on the device).
//!
//! On the CPU device the moments are host vectors and the update is
//! `CpuAdamW`'s kernel, so the same code runs in CI. The saved state is
//! `CpuAdamW`'s format: either optimizer loads the other's files.
use candle_core::backprop::GradStore;
use candle_core::{bail, DType, Device, Result, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};

use crate::adamw::{check_adamw_params, AdamConsts, AdamKernel, AdamWUpdate, ADAMW};
use crate::host_optim::{MetaValue, UpdateRule};
use crate::host_update::{first_non_finite_tensor, update_param};
use crate::optim_state::{self, SavedState, StateWriter};
use crate::state::{Noise, StateBuf, StateDtype};

const WHAT: &str = "DeviceAdamW";

/// One parameter's first and second moments.
enum Moments {
    Host(Vec<StateBuf>),
    #[cfg(feature = "cuda")]
    Cuda(DeviceState, DeviceState),
}

/// One moment buffer on the device, in the optimizer's state dtype (bf16 as
/// its bits).
#[cfg(feature = "cuda")]
enum DeviceState {
    F32(cudarc::driver::CudaSlice<f32>),
    Bf16(cudarc::driver::CudaSlice<u16>),
}

#[cfg(feature = "cuda")]
impl DeviceState {
    fn zeros(
        s: &std::sync::Arc<cudarc::driver::CudaStream>,
        dt: StateDtype,
        n: usize,
    ) -> Result<Self> {
        let w = candle_core::Error::wrap;
        Ok(match dt {
            StateDtype::F32 => Self::F32(s.alloc_zeros::<f32>(n).map_err(w)?),
            StateDtype::Bf16 => Self::Bf16(s.alloc_zeros::<u16>(n).map_err(w)?),
        })
    }

    fn upload(s: &std::sync::Arc<cudarc::driver::CudaStream>, buf: &StateBuf) -> Result<Self> {
        let w = candle_core::Error::wrap;
        Ok(match buf {
            StateBuf::F32(v) => Self::F32(s.clone_htod(v).map_err(w)?),
            StateBuf::Bf16(v) => {
                let bits: Vec<u16> = v.iter().map(|x| x.to_bits()).collect();
                Self::Bf16(s.clone_htod(&bits).map_err(w)?)
            }
        })
    }

    fn download(&self, s: &std::sync::Arc<cudarc::driver::CudaStream>) -> Result<StateBuf> {
        let w = candle_core::Error::wrap;
        Ok(match self {
            Self::F32(d) => StateBuf::F32(s.clone_dtoh(d).map_err(w)?),
            Self::Bf16(d) => StateBuf::Bf16(
                s.clone_dtoh(d)
                    .map_err(w)?
                    .into_iter()
                    .map(half::bf16::from_bits)
                    .collect(),
            ),
        })
    }

    /// The buffer's device address and element dtype, for reading.
    fn address_ref(&self, s: &std::sync::Arc<cudarc::driver::CudaStream>) -> (u64, DType) {
        use cudarc::driver::DevicePtr;
        match self {
            Self::F32(d) => (d.device_ptr(s).0, DType::F32),
            Self::Bf16(d) => (d.device_ptr(s).0, DType::BF16),
        }
    }

    /// The buffer's device address and element dtype.
    fn address(&mut self, s: &std::sync::Arc<cudarc::driver::CudaStream>) -> (u64, DType) {
        use cudarc::driver::DevicePtrMut;
        match self {
            Self::F32(d) => (d.device_ptr_mut(s).0, DType::F32),
            Self::Bf16(d) => (d.device_ptr_mut(s).0, DType::BF16),
        }
    }
}

/// AdamW with its state on the device (see the module docs).
///
/// ```
/// use candle_core::{Device, Var};
/// use candle_nn::{Optimizer, ParamsAdamW};
/// use streamer_autograd::DeviceAdamW;
/// let w = Var::new(&[1f32, 2., 3.], &Device::Cpu)?;
/// let params = ParamsAdamW { lr: 0.1, ..Default::default() };
/// let mut opt = DeviceAdamW::new(vec![w.clone()], params, &Device::Cpu)?;
/// let loss = w.as_tensor().sqr()?.sum_all()?;
/// opt.step(&loss.backward()?)?;
/// assert!(w.as_tensor().to_vec1::<f32>()?[0] < 1.0);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub struct DeviceAdamW {
    vars: Vec<Var>,
    names: Vec<String>,
    params: ParamsAdamW,
    t: usize,
    last_step: Vec<usize>,
    device: Device,
    /// The moments' element type.
    state: StateDtype,
    /// Allocated (zeroed) up front, so the memory they take is in use before
    /// an activation budget or the first step measures what is free.
    moments: Vec<Moments>,
    /// Per param, set on the device by a non-finite gradient (CUDA).
    #[cfg(feature = "cuda")]
    flags: Option<cudarc::driver::CudaSlice<u32>>,
}

impl std::fmt::Debug for DeviceAdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(WHAT)
            .field("params", &self.params)
            .field("vars", &self.vars.len())
            .field("t", &self.t)
            .field("device", &self.device.location())
            .finish()
    }
}

impl DeviceAdamW {
    /// AdamW over `vars` with its moments on `device`. Each var is a
    /// contiguous f32, bf16 or f16 tensor on `device` (stepped by
    /// [`Optimizer::step`]) or, for a CUDA `device`, a host master of a
    /// streamed model (stepped by `backward_step_device`). f32 moments.
    pub fn new(vars: Vec<Var>, params: ParamsAdamW, device: &Device) -> Result<Self> {
        Self::with_state_dtype(vars, params, device, StateDtype::F32)
    }

    /// [`Self::new`] with moments of `state`: bf16 halves their memory and
    /// rounds them as `CpuAdamW::with_state_dtype` does, bit for bit.
    pub fn with_state_dtype(
        vars: Vec<Var>,
        params: ParamsAdamW,
        device: &Device,
        state: StateDtype,
    ) -> Result<Self> {
        check_adamw_params(WHAT, &params)?;
        for (i, v) in vars.iter().enumerate() {
            if !matches!(v.dtype(), DType::F32 | DType::BF16 | DType::F16) || !v.is_contiguous() {
                bail!(
                    "{WHAT}: param {i} (shape {:?}, {:?}) must be a contiguous f32, bf16 or f16 tensor",
                    v.dims(),
                    v.dtype()
                )
            }
            if !v.device().same_device(device) && !v.device().is_cpu() {
                bail!(
                    "{WHAT}: param {i} (shape {:?}) is on {:?}; the moments are on {:?}",
                    v.dims(),
                    v.device().location(),
                    device.location()
                )
            }
        }
        let n = vars.len();
        let moments = vars
            .iter()
            .map(|v| zero_moments(device, state, v.elem_count()))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            names: (0..n).map(|i| i.to_string()).collect(),
            moments,
            last_step: vec![0; n],
            vars,
            params,
            t: 0,
            device: device.clone(),
            state,
            #[cfg(feature = "cuda")]
            flags: None,
        })
    }

    /// The moments' element type.
    pub fn state_dtype(&self) -> StateDtype {
        self.state
    }

    /// The parameters, in the order indices refer to.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The device the moments live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The hyper-parameters.
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    /// Replaces the hyper-parameters after checking them.
    pub fn set_params(&mut self, params: ParamsAdamW) -> Result<()> {
        check_adamw_params(WHAT, &params)?;
        self.params = params;
        Ok(())
    }

    /// The number of steps begun so far.
    pub fn step_count(&self) -> usize {
        self.t
    }

    /// The names params are saved under (default: their indices).
    pub fn param_names(&self) -> &[String] {
        &self.names
    }

    /// Sets the names params are saved under: one per param, unique.
    pub fn set_param_names(&mut self, names: Vec<String>) -> Result<()> {
        optim_state::check_names(WHAT, &names, self.vars.len())?;
        self.names = names;
        Ok(())
    }

    /// Starts a step (the bias corrections' `t`) for the per-param updates of
    /// `backward_step_device`.
    pub(crate) fn begin_step(&mut self) -> Result<()> {
        self.zero_flags()?;
        self.t += 1;
        Ok(())
    }

    /// Clears the non-finite flags of the last step (CUDA).
    fn zero_flags(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(f) = &mut self.flags {
            let s = self.device.as_cuda_device()?.cuda_stream();
            s.memset_zeros(f).map_err(candle_core::Error::wrap)?;
        }
        Ok(())
    }

    fn name(&self, i: usize) -> &str {
        self.names.get(i).map(String::as_str).unwrap_or("?")
    }

    /// Checks that param `i` may take gradient `g` in the open step.
    fn check_update(&self, i: usize, g: &Tensor) -> Result<()> {
        if self.t == 0 {
            bail!("{WHAT}: a step must be begun before params are updated")
        }
        let var = &self.vars[i];
        if self.last_step[i] == self.t {
            bail!(
                "{WHAT}: param {i} ({}) was already stepped at step {}",
                self.name(i),
                self.t
            )
        }
        if g.dims() != var.dims() {
            bail!(
                "{WHAT}: gradient shape mismatch for param {i} ({}): param {:?}, gradient {:?}",
                self.name(i),
                var.dims(),
                g.dims()
            )
        }
        streamer_core::faults::check(streamer_core::faults::FaultPoint::OptimizerGradient, || {
            format!("{WHAT}: the gradient of param {i} ({})", self.name(i))
        })
    }

    /// Steps host param `i` (the CPU path) with its gradient, refused whole if
    /// the gradient is not finite.
    pub(crate) fn step_host(&mut self, i: usize, g: &Tensor) -> Result<()> {
        self.check_update(i, g)?;
        let g = self.finite_host_grad(i, g)?;
        self.host_update(i, &g)
    }

    /// `g` as a contiguous f32 CPU tensor, or an error naming param `i` when
    /// it holds a NaN or an infinity.
    fn finite_host_grad(&self, i: usize, g: &Tensor) -> Result<Tensor> {
        let g = g
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .contiguous()?;
        if let Some((j, x)) = first_non_finite_tensor(&g)? {
            bail!(
                "{WHAT}: the gradient of param {i} ({}) is not finite ({x} at element {j}); \
                 the step is refused and no parameter or optimizer state was changed",
                self.name(i)
            )
        }
        Ok(g)
    }

    /// `CpuAdamW`'s kernel on host param `i` with its checked f32 gradient.
    fn host_update(&mut self, i: usize, g: &Tensor) -> Result<()> {
        let first = self.last_step[i] == 0;
        // Without `cuda`, `Host` is the only variant.
        #[allow(clippy::infallible_destructuring_match)]
        let bufs = match &mut self.moments[i] {
            Moments::Host(b) => b,
            #[cfg(feature = "cuda")]
            Moments::Cuda(..) => bail!("{WHAT}: param {i}'s moments are on the device"),
        };
        let k = AdamConsts::new(&self.params, self.t);
        let noise = Noise::new(self.t, i);
        update_param::<AdamKernel>("device-adamw", &self.vars[i], g, bufs, first, (&k, noise))?;
        self.last_step[i] = self.t;
        Ok(())
    }

    /// The moments `(m, v)` of param `idx` copied to the host, in f32
    /// (`None` before its first step).
    pub fn moments(&self, idx: usize) -> Result<Option<(Vec<f32>, Vec<f32>)>> {
        Ok(self
            .state_bufs(idx)?
            .map(|[m, v]| (m.into_f32(), v.into_f32())))
    }

    /// The moments of param `idx` in their own dtype, on the host (`None`
    /// before its first step).
    fn state_bufs(&self, idx: usize) -> Result<Option<[StateBuf; 2]>> {
        if self.last_step.get(idx).is_none_or(|&s| s == 0) {
            return Ok(None);
        }
        Ok(Some(match &self.moments[idx] {
            Moments::Host(b) => [b[0].clone(), b[1].clone()],
            #[cfg(feature = "cuda")]
            Moments::Cuda(m, v) => {
                let stream = self.device.as_cuda_device()?.cuda_stream();
                [m.download(&stream)?, v.download(&stream)?]
            }
        }))
    }

    /// Saves the state in [`crate::CpuAdamW`]'s format (`m.<name>`,
    /// `v.<name>`, per-param last step, step count, hyper-parameters), written
    /// atomically. Params never stepped save zero moments.
    pub fn save<P: AsRef<std::path::Path>>(&self, path: P) -> Result<()> {
        let host: Vec<[StateBuf; 2]> = (0..self.vars.len())
            .map(|i| {
                let n = self.vars[i].elem_count();
                Ok(self
                    .state_bufs(i)?
                    .unwrap_or_else(|| [0, 1].map(|_| StateBuf::zeros(self.state, n))))
            })
            .collect::<Result<_>>()?;
        let mut w = StateWriter::new(ADAMW, self.t, &self.last_step);
        for (key, value) in AdamWUpdate::to_meta(&self.params) {
            if let MetaValue::F64(v) = value {
                w.meta(key, v)
            }
        }
        for (k, prefix) in ["m", "v"].iter().enumerate() {
            for ((name, var), bufs) in self.names.iter().zip(&self.vars).zip(&host) {
                w.state(format!("{prefix}.{name}"), var.dims(), &bufs[k]);
            }
        }
        w.write(path.as_ref())
    }

    /// Loads state written by [`Self::save`] or by `CpuAdamW::save`, checked
    /// whole (kind, param count, hyper-parameters, every tensor's shape)
    /// before anything changes.
    pub fn load<P: AsRef<std::path::Path>>(&mut self, path: P) -> Result<()> {
        let saved = SavedState::read(path.as_ref(), ADAMW, self.vars.len())?;
        let meta = |key: &str, _: bool| Ok(MetaValue::F64(saved.meta_f64(key)?));
        let params = saved.blame(AdamWUpdate::from_meta(&meta))?;
        saved.blame(check_adamw_params(WHAT, &params))?;
        let st = saved.tensors()?;
        let mut bufs = Vec::with_capacity(self.vars.len());
        for (name, var) in self.names.iter().zip(&self.vars) {
            // Either optimizer's f32 or bf16 state loads into either state
            // dtype (into bf16 from f32 rounded to nearest, else exactly).
            let read =
                |b: &str| saved.state_tensor(&st, &format!("{b}.{name}"), var.dims(), self.state);
            let (m, v) = (read("m")?, read("v")?);
            bufs.push((m, v));
        }
        drop(st);
        let moments = bufs
            .into_iter()
            .map(|(m, v)| self.upload(m, v))
            .collect::<Result<Vec<_>>>()?;
        self.moments = moments;
        self.last_step = saved.last_step;
        self.t = saved.step;
        self.params = params;
        Ok(())
    }

    fn upload(&self, m: StateBuf, v: StateBuf) -> Result<Moments> {
        match &self.device {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                let s = d.cuda_stream();
                Ok(Moments::Cuda(
                    DeviceState::upload(&s, &m)?,
                    DeviceState::upload(&s, &v)?,
                ))
            }
            _ => Ok(Moments::Host(vec![m, v])),
        }
    }
}

/// Zeroed moments of `n` elements of `state` on `device`.
fn zero_moments(device: &Device, state: StateDtype, n: usize) -> Result<Moments> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            let s = d.cuda_stream();
            Ok(Moments::Cuda(
                DeviceState::zeros(&s, state, n)?,
                DeviceState::zeros(&s, state, n)?,
            ))
        }
        _ => Ok(Moments::Host(
            (0..2).map(|_| StateBuf::zeros(state, n)).collect(),
        )),
    }
}

impl Optimizer for DeviceAdamW {
    type Config = ParamsAdamW;

    /// Moments on the device of the first var (the CPU if there is none).
    fn new(vars: Vec<Var>, params: ParamsAdamW) -> Result<Self> {
        let device = vars
            .first()
            .map(|v| v.device().clone())
            .unwrap_or(Device::Cpu);
        DeviceAdamW::new(vars, params, &device)
    }

    /// Steps every param that has a gradient in `grads`. Every gradient is
    /// checked (shape, device, finite) before any param changes; on error
    /// nothing changed, the step count included.
    fn step(&mut self, grads: &GradStore) -> Result<()> {
        check_adamw_params(WHAT, &self.params)?;
        let updates: Vec<(usize, Tensor)> = (0..self.vars.len())
            .filter_map(|i| grads.get(self.vars[i].as_tensor()).map(|g| (i, g.clone())))
            .collect();
        self.step_resident(&updates)
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr
    }
}

impl DeviceAdamW {
    /// [`Optimizer::step`]'s body: open a step, validate everything, update.
    fn step_resident(&mut self, updates: &[(usize, Tensor)]) -> Result<()> {
        self.t += 1;
        let r = self.step_open(updates);
        if r.is_err() {
            self.t -= 1;
        }
        r
    }

    /// Steps the params `which` that have a gradient in `grads` within the
    /// step `backward_step_device` opened (the weights outside the streamed
    /// layers: an embedding, a head), validated whole first.
    pub fn step_params(&mut self, grads: &GradStore, which: &[usize]) -> Result<()> {
        let mut updates = Vec::with_capacity(which.len());
        for &i in which {
            let Some(var) = self.vars.get(i) else {
                bail!(
                    "{WHAT}: param index {i} out of range ({} params)",
                    self.vars.len()
                )
            };
            if let Some(g) = grads.get(var.as_tensor()) {
                updates.push((i, g.clone()));
            }
        }
        self.step_open(&updates)
    }

    /// Validates every update (nothing changes on error), then applies them.
    /// Host params with moments on the device go up, step there, and come back.
    fn step_open(&mut self, updates: &[(usize, Tensor)]) -> Result<()> {
        let updates = self.validate_resident(updates)?;
        for (i, g) in &updates {
            match &self.device {
                #[cfg(feature = "cuda")]
                Device::Cuda(_) => {
                    let var = self.vars[*i].clone();
                    let p = var.as_tensor().to_device(&self.device)?;
                    let mem = streamer_device::CudaMemory::of(&p)?;
                    let addr = mem.address()?;
                    // SAFETY: `addr` is `p`'s memory (contiguous): the var's
                    // own when it lives on the device (written only on the
                    // compute stream, in order with every Candle op on it), or
                    // a fresh copy of a host var.
                    unsafe { self.launch_update(*i, addr.get(), var.dtype(), g)? };
                    drop(addr);
                    drop(mem);
                    if var.device().is_cpu() {
                        var.set(&p.to_device(&Device::Cpu)?)?;
                    }
                }
                _ => self.host_update(*i, g)?,
            }
        }
        Ok(())
    }

    /// Checks every update at the open step count (shapes, devices, kernel
    /// dtypes and, in one device round trip, that every gradient is finite)
    /// and returns the gradients ready for the update: contiguous on the
    /// device, f32 on the CPU.
    fn validate_resident(&mut self, updates: &[(usize, Tensor)]) -> Result<Vec<(usize, Tensor)>> {
        self.zero_flags()?;
        let mut out = Vec::with_capacity(updates.len());
        for (i, g) in updates {
            self.check_update(*i, g)?;
            let var = &self.vars[*i];
            if !var.device().same_device(&self.device) && !var.device().is_cpu() {
                bail!(
                    "{WHAT}: param {i} ({}) is on {:?}; the moments are on {:?}",
                    self.name(*i),
                    var.device().location(),
                    self.device.location()
                )
            }
            let g = if self.device.is_cpu() {
                self.finite_host_grad(*i, g)?
            } else {
                g.to_device(&self.device)?.contiguous()?
            };
            out.push((*i, g));
        }
        #[cfg(feature = "cuda")]
        if self.device.is_cuda() {
            for (i, g) in &out {
                check_kernel(self.vars[*i].dtype(), g.dtype())?;
                self.flag_nonfinite(*i, g)?;
            }
            if let Some(i) = self.flagged()?.into_iter().next() {
                bail!(
                    "{WHAT}: the gradient of param {i} ({}) is not finite; the step is refused \
                     and no parameter or optimizer state was changed",
                    self.name(i)
                )
            }
        }
        Ok(out)
    }
}

/// Refuses a param/gradient dtype pair the fused kernel has no instance of.
#[cfg(feature = "cuda")]
fn check_kernel(p: DType, g: DType) -> Result<()> {
    let ok = matches!(
        (p, g),
        (DType::F32, _)
            | (DType::BF16, DType::BF16 | DType::F32)
            | (DType::F16, DType::F16 | DType::F32)
    );
    if !ok {
        bail!("{WHAT}: no kernel for {p:?} params with {g:?} gradients")
    }
    Ok(())
}

#[cfg(feature = "cuda")]
impl DeviceAdamW {
    /// The per-param flags, zeroed when first made.
    fn flags(&mut self) -> Result<&mut cudarc::driver::CudaSlice<u32>> {
        if self.flags.is_none() {
            let s = self.device.as_cuda_device()?.cuda_stream();
            let f = s
                .alloc_zeros::<u32>(self.vars.len().max(1))
                .map_err(candle_core::Error::wrap)?;
            self.flags = Some(f);
        }
        Ok(self.flags.as_mut().expect("made above"))
    }

    /// The device address of param `i`'s flag.
    fn flag_address(&mut self, i: usize) -> Result<u64> {
        use cudarc::driver::DevicePtr;
        let s = self.device.as_cuda_device()?.cuda_stream();
        let f = self.flags()?;
        let (p, _g) = f.device_ptr(&s);
        Ok(p + 4 * i as u64)
    }

    /// Enqueues the finite check of param `i`'s gradient into its flag.
    fn flag_nonfinite(&mut self, i: usize, g: &Tensor) -> Result<()> {
        let g = g.contiguous()?;
        let flag = self.flag_address(i)?;
        let dev = self.device.as_cuda_device()?.clone();
        let mem = streamer_device::CudaMemory::of(&g)?;
        let ga = mem.address()?;
        // SAFETY: `ga` holds g's elements (contiguous, alive until the stream
        // passes the kernel: `g` is dropped after the enqueue, and Candle frees
        // stream-ordered); `flag` lies in `self.flags` (one u32 per param).
        unsafe { crate::device_kernels::nonfinite(&dev, ga.get(), g.dtype(), g.elem_count(), flag) }
    }

    /// The params whose flag is set (waits for the device).
    pub(crate) fn flagged(&mut self) -> Result<Vec<usize>> {
        let s = self.device.as_cuda_device()?.cuda_stream();
        let host = s
            .clone_dtoh(self.flags()?)
            .map_err(candle_core::Error::wrap)?;
        Ok(host
            .iter()
            .enumerate()
            .filter(|(_, &f)| f != 0)
            .map(|(i, _)| i)
            .collect())
    }

    /// The device addresses of param `i`'s moments and their dtype.
    fn moment_addresses(&mut self, i: usize) -> Result<(u64, u64, DType)> {
        let s = self.device.as_cuda_device()?.cuda_stream();
        match &mut self.moments[i] {
            Moments::Cuda(m, v) => {
                let (pm, dt) = m.address(&s);
                let (pv, _) = v.address(&s);
                Ok((pm, pv, dt))
            }
            _ => bail!("{WHAT}: param {i}'s moments are on the host"),
        }
    }

    /// Steps the device copy of param `i` at `p` (its dtype `p_dtype`, the
    /// param's element count) with gradient `g` on the compute stream, after
    /// checking `g` into the param's flag: a non-finite gradient leaves the
    /// copy and the moments unchanged and shows in [`Self::flagged`].
    ///
    /// # Safety
    /// `p` is device memory holding the param's elements in `p_dtype`, alive
    /// and touched by nothing else until the compute stream passes the update.
    pub(crate) unsafe fn step_device_copy(
        &mut self,
        i: usize,
        p: u64,
        p_dtype: DType,
        g: &Tensor,
    ) -> Result<()> {
        self.check_update(i, g)?;
        check_kernel(p_dtype, g.dtype())?;
        let g = g.contiguous()?;
        self.flag_nonfinite(i, &g)?;
        // SAFETY: forwarded from the caller; `g` is contiguous.
        unsafe { self.launch_update(i, p, p_dtype, &g) }
    }

    /// The update of [`Self::step_device_copy`] once `g` (contiguous) is
    /// checked and its finite flag enqueued.
    ///
    /// # Safety
    /// As [`Self::step_device_copy`].
    unsafe fn launch_update(&mut self, i: usize, p: u64, p_dtype: DType, g: &Tensor) -> Result<()> {
        let (m, v, state) = self.moment_addresses(i)?;
        let g_mem = streamer_device::CudaMemory::of(g)?;
        let g_addr = g_mem.address()?;
        let b = crate::device_kernels::AdamBuffers {
            p,
            p_dtype,
            g: g_addr.get(),
            g_dtype: g.dtype(),
            m,
            v,
            state,
            seed: Noise::new(self.t, i).seed,
            skip: self.flag_address(i)?,
            n: self.vars[i].elem_count(),
        };
        let k = AdamConsts::new(&self.params, self.t);
        let dev = self.device.as_cuda_device()?.clone();
        // SAFETY: p per this fn's contract; g is alive until the stream passes
        // (stream-ordered free); m, v and the flag are this optimizer's own.
        unsafe { crate::device_kernels::adamw(&dev, &b, &k)? };
        self.last_step[i] = self.t;
        Ok(())
    }
}

impl DeviceAdamW {
    /// Checks that every parameter and both moments of each are finite (on
    /// the device where they live: one pass, one round trip); the error names
    /// the first offending param and buffer. Call before saving.
    pub fn check_finite(&self) -> Result<()> {
        for (i, var) in self.vars.iter().enumerate() {
            if var.device().is_cpu() {
                if let Some((j, x)) = first_non_finite_tensor(var.as_tensor())? {
                    bail!("{WHAT}: param {i} ({}) is {x} at element {j}", self.name(i))
                }
            }
        }
        match &self.device {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => self.check_finite_on(d),
            _ => {
                for (i, m) in self.moments.iter().enumerate() {
                    // Without `cuda`, `Host` is the only variant.
                    #[allow(irrefutable_let_patterns)]
                    let Moments::Host(b) = m
                    else {
                        continue;
                    };
                    for (k, label) in ["first moment m", "second moment v"].iter().enumerate() {
                        if let Some((j, x)) = b[k].first_non_finite() {
                            bail!(
                                "{WHAT}: {label} of param {i} ({}) is {x} at element {j}",
                                self.name(i)
                            )
                        }
                    }
                }
                Ok(())
            }
        }
    }

    /// [`Self::check_finite`]'s device part: device params and all moments,
    /// three flags per param.
    #[cfg(feature = "cuda")]
    fn check_finite_on(&self, d: &candle_core::CudaDevice) -> Result<()> {
        use cudarc::driver::DevicePtr;
        let s = d.cuda_stream();
        let w = candle_core::Error::wrap;
        let flags = s
            .alloc_zeros::<u32>(3 * self.vars.len().max(1))
            .map_err(w)?;
        let (base, _g) = flags.device_ptr(&s);
        for (i, (var, m)) in self.vars.iter().zip(&self.moments).enumerate() {
            let n = var.elem_count();
            let at = |k: u64| base + 4 * (3 * i as u64 + k);
            if var.device().is_cuda() {
                let mem = streamer_device::CudaMemory::of(var.as_tensor())?;
                let p = mem.address()?;
                // SAFETY: the var's own contiguous memory and this call's flags.
                unsafe { crate::device_kernels::nonfinite(d, p.get(), var.dtype(), n, at(0))? };
            }
            if let Moments::Cuda(mm, vv) = m {
                let (pm, dt) = mm.address_ref(&s);
                let (pv, _) = vv.address_ref(&s);
                // SAFETY: the moments (n elements of dt each) and this call's flags.
                unsafe { crate::device_kernels::nonfinite(d, pm, dt, n, at(1))? };
                unsafe { crate::device_kernels::nonfinite(d, pv, dt, n, at(2))? };
            }
        }
        drop(_g);
        let host = s.clone_dtoh(&flags).map_err(w)?;
        if let Some(k) = host.iter().position(|&f| f != 0) {
            let label = [
                "is",
                "has a first moment m that is",
                "has a second moment v that is",
            ][k % 3];
            bail!(
                "{WHAT}: param {} ({}) {label} not finite",
                k / 3,
                self.name(k / 3)
            )
        }
        Ok(())
    }
}
