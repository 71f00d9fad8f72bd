//! [`NcclCollective`]: the ranks are threads of one process, one per GPU, and
//! talk over NCCL (cudarc's bindings) on each device's Candle stream.
//!
//! Timeouts: NCCL calls only enqueue work; a rank whose peer never arrives
//! would spin in a kernel forever. So every operation records an event after
//! its NCCL call and polls it until it completes, the group's timeout passes,
//! or another rank of the group failed; in the last two cases this rank's
//! communicator is aborted (`ncclCommAbort`, which ends its kernels) and the
//! call returns an error naming the rank, the operation and the cause.
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::cuda::CudaDType;
use candle_core::{CudaDevice, DType, Device, Result, Storage, Tensor};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::{Comm, ReduceOp};

use crate::collective::{check_gather, check_scatter, err, Collective, Member};

/// Calls `$body` (an NCCL call) with `src` (a view of the input), `dst` and
/// the element type bound, for whichever type `typed` holds; its error
/// becomes a message.
macro_rules! each_type {
    ($typed:expr, |$src:ident, $dst:ident| $body:expr) => {
        each_type!(@arms $typed, $src, $dst, $body; F32 F64 F16 BF16)
    };
    (@arms $typed:expr, $src:ident, $dst:ident, $body:expr; $($ty:ident)*) => {
        match $typed {
            $(Typed::$ty(s, r, $dst) => {
                let $src = s.slice(r);
                ($body).map(|_| ()).map_err(nccl_err)
            })*
        }
    };
}

/// One rank of an NCCL group in this process (see [`NcclCollective::group`]).
pub struct NcclCollective {
    member: Member,
    cuda: CudaDevice,
    comm: Mutex<Option<CommCell>>,
    shared: Arc<Mutex<Option<String>>>,
    timeout: Duration,
    seq: Mutex<u64>,
}

/// The communicator, movable between threads.
struct CommCell(Comm);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on
// it do not overlap; every use goes through the `Mutex` in `NcclCollective`.
unsafe impl Send for CommCell {}

fn nccl_err(e: cudarc::nccl::result::NcclError) -> String {
    format!("NCCL error {:?}", e.0)
}

impl NcclCollective {
    /// The number of GPUs this process sees.
    pub fn visible_gpus() -> Result<usize> {
        Ok(CudaContext::device_count().map_err(candle_core::Error::wrap)? as usize)
    }

    /// One rank per GPU `0..world_size`, each device with its own stream.
    /// Errors naming the counts when fewer GPUs are visible.
    pub fn with_world_size(world_size: usize, timeout: Duration) -> Result<Vec<Self>> {
        let visible = Self::visible_gpus()?;
        if world_size == 0 || world_size > visible {
            candle_core::bail!(
                "streamer-dist: world size {world_size} needs {world_size} GPUs, {visible} visible \
                 (CUDA_VISIBLE_DEVICES limits them)"
            )
        }
        let devices = (0..world_size)
            .map(|i| Ok(Device::Cuda(CudaDevice::new_with_stream(i)?)))
            .collect::<Result<Vec<_>>>()?;
        Self::group(&devices, timeout)
    }

    /// A group with rank `r` on `devices[r]`: distinct CUDA devices of one GPU
    /// model (mixed models are refused: NCCL would run at the slowest one's
    /// pace, and the streamed replicas would not balance). NCCL talks on each
    /// device's Candle stream, so its work is ordered with Candle's.
    pub fn group(devices: &[Device], timeout: Duration) -> Result<Vec<Self>> {
        let cuda = check_devices(devices)?;
        if timeout.is_zero() {
            candle_core::bail!("streamer-dist: the collective timeout must be positive, got 0")
        }
        let streams: Vec<Arc<CudaStream>> = cuda.iter().map(|d| d.cuda_stream()).collect();
        let comms = Comm::from_devices(streams).map_err(|e| {
            candle_core::Error::Msg(format!("streamer-dist: NCCL init failed: {}", nccl_err(e)))
        })?;
        let shared = Arc::new(Mutex::new(None));
        let world = devices.len();
        Ok(comms
            .into_iter()
            .zip(cuda)
            .enumerate()
            .map(|(rank, (comm, cuda))| Self {
                member: Member {
                    rank,
                    world,
                    device: Device::Cuda(cuda.clone()),
                },
                cuda,
                comm: Mutex::new(Some(CommCell(comm))),
                shared: shared.clone(),
                timeout,
                seq: Mutex::new(0),
            })
            .collect())
    }

    fn failed(&self) -> MutexGuard<'_, Option<String>> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Aborts this rank's communicator (ends its kernels); idempotent.
    fn abort_comm(comm: &mut Option<CommCell>) {
        if let Some(c) = comm.take() {
            // cudarc's Drop aborts and panics if the abort fails: the group is
            // dead either way, so a panic there must not take the caller down.
            let _ = std::panic::catch_unwind(AssertUnwindSafe(|| drop(c)));
        }
    }

    /// Runs `issue` (which enqueues NCCL work) and waits for it with the
    /// timeout, the failure checks of the module docs around it.
    fn run<T>(
        &self,
        op: &'static str,
        issue: impl FnOnce(&Comm) -> std::result::Result<T, String>,
    ) -> Result<T> {
        let seq = {
            let mut s = self.seq.lock().unwrap_or_else(|p| p.into_inner());
            *s += 1;
            *s
        };
        let mut comm = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = self.failed().clone() {
            Self::abort_comm(&mut comm);
            return Err(err(
                self.member.rank,
                op,
                format!("the group failed earlier: {f}"),
            ));
        }
        let Some(c) = comm.as_ref() else {
            return Err(err(self.member.rank, op, "the communicator was aborted"));
        };
        let out = match issue(&c.0) {
            Ok(out) => out,
            Err(e) => {
                self.fail(format!(
                    "rank {}: {op} (#{seq}) failed: {e}",
                    self.member.rank
                ));
                Self::abort_comm(&mut comm);
                return Err(err(self.member.rank, op, e));
            }
        };
        match self.wait(op, seq) {
            Ok(()) => Ok(out),
            Err(why) => {
                Self::abort_comm(&mut comm);
                Err(err(self.member.rank, op, why))
            }
        }
    }

    fn fail(&self, why: String) {
        let mut f = self.failed();
        if f.is_none() {
            *f = Some(why);
        }
    }

    /// Polls an event recorded after the enqueued work (see the module docs).
    fn wait(&self, op: &str, seq: u64) -> std::result::Result<(), String> {
        let stream = self.cuda.cuda_stream();
        let ev = stream
            .record_event(None)
            .map_err(|e| format!("recording an event: {e:?}"))?;
        let deadline = Instant::now() + self.timeout;
        let mut pause = Duration::from_micros(20);
        loop {
            match ev.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    let why = format!(
                        "rank {}: {op} (#{seq}) failed on the device: {e:?}",
                        self.member.rank
                    );
                    self.fail(why.clone());
                    return Err(why);
                }
            }
            if let Some(f) = self.failed().clone() {
                return Err(format!("#{seq} aborted: {f}"));
            }
            if Instant::now() >= deadline {
                let why = format!(
                    "rank {} timed out in {op} (#{seq}) after {:.1} s (a peer never joined, or failed)",
                    self.member.rank,
                    self.timeout.as_secs_f64()
                );
                self.fail(why.clone());
                return Err(why);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// Checks `x` for `op` (on this rank's device, a type NCCL reduces, not
    /// empty, the same count and dtype on every rank) and returns it
    /// contiguous, ready for [`Self::launch`].
    fn checked(&self, op: &'static str, x: &Tensor) -> Result<Checked> {
        if !x.device().same_device(&self.member.device) {
            return Err(err(
                self.member.rank,
                op,
                format!(
                    "the tensor is on {:?}, this rank is on {:?}",
                    x.device().location(),
                    self.member.device.location()
                ),
            ));
        }
        if !matches!(
            x.dtype(),
            DType::F32 | DType::F16 | DType::BF16 | DType::F64
        ) {
            return Err(err(
                self.member.rank,
                op,
                format!(
                    "dtype {:?} is not supported (f32, f16, bf16, f64)",
                    x.dtype()
                ),
            ));
        }
        if x.elem_count() == 0 {
            return Err(err(self.member.rank, op, "empty tensors are not supported"));
        }
        let x = Checked {
            op,
            x: x.contiguous()?,
        };
        self.agree(&x)?;
        Ok(x)
    }

    /// Applies `f` to the checked tensor's slice (offset and length in
    /// elements) with `out` elements of output, for the tensor's dtype.
    fn launch(
        &self,
        Checked { op, x }: Checked,
        out: usize,
        f: &dyn Fn(&Comm, Typed<'_>) -> std::result::Result<(), String>,
    ) -> Result<Tensor> {
        let (s, l) = x.storage_and_layout();
        let Storage::Cuda(cs) = &*s else {
            return Err(err(
                self.member.rank,
                op,
                "internal error: not CUDA storage",
            ));
        };
        let range = l.start_offset()..l.start_offset() + x.elem_count();
        let stream = self.cuda.cuda_stream();
        macro_rules! typed {
            ($t:ty, $variant:ident) => {{
                let src = cs.as_cuda_slice::<$t>()?;
                let mut dst = alloc::<$t>(&stream, out)?;
                self.run(op, |c| f(c, Typed::$variant(src, range.clone(), &mut dst)))?;
                dst_tensor(dst, &self.cuda)
            }};
        }
        match x.dtype() {
            DType::F32 => typed!(f32, F32),
            DType::F64 => typed!(f64, F64),
            DType::F16 => typed!(half::f16, F16),
            DType::BF16 => typed!(half::bf16, BF16),
            d => Err(err(
                self.member.rank,
                op,
                format!("dtype {d:?} is not supported"),
            )),
        }
    }
}

/// A tensor [`NcclCollective::checked`] found fit for NCCL's `op`.
struct Checked {
    op: &'static str,
    x: Tensor,
}

impl NcclCollective {
    /// Checks that every rank calls the same operation with the same element
    /// count and dtype before the real call: NCCL trusts the counts, and a rank
    /// with a different one would read or write past a buffer. One all-gather
    /// of three numbers per operation; a mismatch fails every rank.
    fn agree(&self, checked: &Checked) -> Result<()> {
        let (op, x) = (checked.op, &checked.x);
        let code = OPS.iter().position(|o| *o == op).unwrap_or(OPS.len()) as f64;
        let mine = [
            code,
            x.elem_count() as f64,
            x.dtype().size_in_bytes() as f64 + 10.0 * dtype_code(x.dtype()),
        ];
        let header = Tensor::new(&mine, &self.member.device)?;
        let n = 3 * self.member.world;
        // The header is contiguous, on this device, and of the same count
        // everywhere: it needs no agreement of its own.
        let header = Checked { op, x: header };
        let all = self.launch(header, n, &|c, t| {
            each_type!(t, |src, dst| c.all_gather(&src, dst))
        })?;
        let all = all.narrow(0, 0, n)?.to_vec1::<f64>()?;
        for (r, theirs) in all.chunks(3).enumerate() {
            if theirs != mine {
                let name = |c: f64| OPS.get(c as usize).copied().unwrap_or("?");
                let why = format!(
                    "rank {} called {op} with {} elements, rank {r} called {} with {} (dtype codes {} and {})",
                    self.member.rank, mine[1], name(theirs[0]), theirs[1], mine[2], theirs[2]
                );
                self.fail(why.clone());
                let mut comm = self.comm.lock().unwrap_or_else(|p| p.into_inner());
                Self::abort_comm(&mut comm);
                return Err(err(self.member.rank, op, why));
            }
        }
        Ok(())
    }
}

const OPS: [&str; 4] = [
    "all_reduce_sum",
    "reduce_scatter_sum",
    "all_gather",
    "ring_shift",
];

fn dtype_code(d: DType) -> f64 {
    match d {
        DType::F32 => 1.0,
        DType::F64 => 2.0,
        DType::F16 => 3.0,
        DType::BF16 => 4.0,
        _ => 0.0,
    }
}

/// A source slice with its element range and an output slice, of one type.
enum Typed<'a> {
    F32(
        &'a CudaSlice<f32>,
        std::ops::Range<usize>,
        &'a mut CudaSlice<f32>,
    ),
    F64(
        &'a CudaSlice<f64>,
        std::ops::Range<usize>,
        &'a mut CudaSlice<f64>,
    ),
    F16(
        &'a CudaSlice<half::f16>,
        std::ops::Range<usize>,
        &'a mut CudaSlice<half::f16>,
    ),
    BF16(
        &'a CudaSlice<half::bf16>,
        std::ops::Range<usize>,
        &'a mut CudaSlice<half::bf16>,
    ),
}

fn alloc<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    n: usize,
) -> Result<CudaSlice<T>> {
    stream.alloc_zeros::<T>(n).map_err(candle_core::Error::wrap)
}

fn dst_tensor<T: CudaDType>(dst: CudaSlice<T>, dev: &CudaDevice) -> Result<Tensor> {
    let n = dst.len();
    Ok(streamer_device::slice_tensor(dst, dev, n))
}

fn check_devices(devices: &[Device]) -> Result<Vec<CudaDevice>> {
    if devices.is_empty() {
        candle_core::bail!("streamer-dist: an NCCL group needs at least one device")
    }
    let visible = NcclCollective::visible_gpus()?;
    if devices.len() > visible {
        candle_core::bail!(
            "streamer-dist: world size {} is larger than the {visible} visible GPUs",
            devices.len()
        )
    }
    let mut cuda = Vec::new();
    let mut names: Vec<(usize, String)> = Vec::new();
    for (r, d) in devices.iter().enumerate() {
        let Device::Cuda(c) = d else {
            candle_core::bail!(
                "streamer-dist: NCCL rank {r} is on {:?}, not a CUDA device",
                d.location()
            )
        };
        let ctx = c.cuda_stream().context().clone();
        let ordinal = ctx.ordinal();
        if let Some(j) = cuda
            .iter()
            .position(|o: &CudaDevice| o.cuda_stream().context().ordinal() == ordinal)
        {
            candle_core::bail!("streamer-dist: NCCL ranks {j} and {r} are both on GPU {ordinal}")
        }
        let name = ctx.name().map_err(candle_core::Error::wrap)?;
        if let Some((j, other)) = names.first() {
            if *other != name {
                candle_core::bail!(
                    "streamer-dist: mixed GPU models: rank {j} is a {other}, rank {r} a {name}; \
                     use GPUs of one model (CUDA_VISIBLE_DEVICES)"
                )
            }
        }
        names.push((r, name));
        cuda.push(c.clone());
    }
    Ok(cuda)
}

impl Collective for NcclCollective {
    fn member(&self) -> &Member {
        &self.member
    }

    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        let n = x.elem_count();
        let out = self.launch(self.checked("all_reduce_sum", x)?, n, &|c, t| {
            each_type!(t, |src, dst| c.all_reduce(&src, dst, &ReduceOp::Sum))
        })?;
        out.narrow(0, 0, n)?.reshape(x.shape())
    }

    fn reduce_scatter_sum(&self, x: &Tensor) -> Result<Tensor> {
        let rows = check_scatter(self.member.rank, self.member.world, x)?;
        let n = x.elem_count() / self.member.world;
        let out = self.launch(self.checked("reduce_scatter_sum", x)?, n, &|c, t| {
            each_type!(t, |src, dst| c.reduce_scatter(&src, dst, &ReduceOp::Sum))
        })?;
        let mut dims = x.dims().to_vec();
        dims[0] = rows;
        out.narrow(0, 0, n)?.reshape(dims)
    }

    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        check_gather(self.member.rank, x)?;
        let n = x.elem_count() * self.member.world;
        let out = self.launch(self.checked("all_gather", x)?, n, &|c, t| {
            each_type!(t, |src, dst| c.all_gather(&src, dst))
        })?;
        let mut dims = x.dims().to_vec();
        dims[0] *= self.member.world;
        out.narrow(0, 0, n)?.reshape(dims)
    }

    fn ring_shift(&self, x: &Tensor) -> Result<Tensor> {
        let n = x.elem_count();
        let (next, prev) = (
            (self.member.rank + 1) % self.member.world,
            (self.member.rank + self.member.world - 1) % self.member.world,
        );
        let out = self.launch(self.checked("ring_shift", x)?, n, &|c, t| {
            // One group: the send and the receive proceed together (a lone
            // blocking send around a ring would deadlock).
            cudarc::nccl::group_start().map_err(nccl_err)?;
            let r = each_type!(t, |src, dst| c
                .send(&src, next as i32)
                .and_then(|_| c.recv(dst, prev as i32)));
            let end = cudarc::nccl::group_end().map(|_| ()).map_err(nccl_err);
            r.and(end)
        })?;
        out.narrow(0, 0, n)?.reshape(x.shape())
    }

    fn barrier(&self) -> Result<()> {
        let one = Tensor::zeros(1, DType::F32, &self.member.device)?;
        self.all_reduce_sum(&one).map(|_| ())
    }

    fn abort(&self, reason: &str) {
        self.fail(format!("rank {} failed: {reason}", self.member.rank));
        let mut comm = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        Self::abort_comm(&mut comm);
    }

    fn failure(&self) -> Option<String> {
        self.failed().clone()
    }
}
