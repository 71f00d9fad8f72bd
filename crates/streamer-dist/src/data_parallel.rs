//! Data-parallel streamed training: one rank per device, one thread per rank,
//! one copy of the weights on the host.
//!
//! Why threads and not processes: the host masters then exist once, in this
//! process, and are page-locked once; every rank's [`TrainableSequential`] is a
//! [`StreamedSequential::replica`] over the same masters with its own window of
//! device slots. NCCL supports one communicator per thread in one process.
//!
//! One [`DataParallel::step`]:
//! 1. checks the batch (divisible by the world size) before any work;
//! 2. every rank (its own thread) moves its micro-batch to its device, runs the
//!    streamed forward, the caller's loss and the streamed backward, whose
//!    weight gradients land in that rank's host gradient buffers;
//! 3. every rank reduces its gradients through its [`Collective`], packed
//!    into buckets of about 64 MiB (one all-reduce each; on its device for
//!    NCCL: the bucket goes up, is all-reduced, and the sum comes back; on the
//!    host collective it is summed in host memory);
//! 4. once every rank succeeded, the optimizer steps each parameter once with
//!    the reduced gradients, on the calling thread (the host optimizers spread
//!    one step over all cores themselves).
//!
//! Not overlapped yet: the reduction starts after the whole backward, and the
//! gradients cross PCIe three times on CUDA (down in the backward, up and down
//! around NCCL). Reducing on the device before the single copy down, block by
//! block during the backward, needs a hook in the trainer's gradient offload.
//!
//! Failure: a rank whose forward, loss, backward or reduction fails aborts the
//! group, so the other ranks stop at their next collective instead of waiting;
//! `step` returns the first failure (the rank and its error) and the optimizer
//! does not run, so the masters and the optimizer state are unchanged. The
//! group is then failed for good: [`DataParallel::save`] refuses to write, and
//! a new `DataParallel` (new collectives) is needed to go on.
use std::path::Path;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{bail, DType, Device, Result, Tensor, Var};
use candle_nn::Optimizer;
use streamer_autograd::{Train, TrainableSequential};
use streamer_core::StreamedSequential;

use crate::Collective;

/// How the per-rank gradients combine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GradReduction {
    /// The mean over ranks: with a per-rank loss that is a mean over its
    /// micro-batch, the gradient of the mean loss over the whole batch.
    #[default]
    Mean,
    /// The plain sum over ranks.
    Sum,
}

/// N replicas of one streamed model, one per rank (see the module docs).
pub struct DataParallel {
    replicas: Vec<TrainableSequential>,
    collectives: Vec<Arc<dyn Collective>>,
    reduction: GradReduction,
    bucket_elems: usize,
}

/// What one [`DataParallel::step`] measured.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// Every rank's loss, in rank order.
    pub losses: Vec<f32>,
    /// The mean of `losses`: the loss of the whole batch for a mean loss.
    pub mean_loss: f32,
}

impl DataParallel {
    /// Replicates `model` onto every rank's device: rank 0 uses `model` itself
    /// (it must compute on `collectives[0].device()`), rank `r > 0` a
    /// [`StreamedSequential::replica`] on `collectives[r].device()`.
    /// `collectives[r]` must be rank `r` of one group of `collectives.len()`.
    pub fn new(
        model: StreamedSequential,
        collectives: Vec<Arc<dyn Collective>>,
        reduction: GradReduction,
    ) -> Result<Self> {
        let world = collectives.len();
        if world == 0 {
            bail!("DataParallel: needs at least one rank, got no collectives")
        }
        for (i, c) in collectives.iter().enumerate() {
            if c.rank() != i || c.world_size() != world {
                bail!(
                    "DataParallel: collectives[{i}] is rank {} of {}, expected rank {i} of {world}",
                    c.rank(),
                    c.world_size()
                )
            }
        }
        let dev0 = collectives[0].device();
        let model_dev = &model.config().device;
        if model_dev.location() != dev0.location() {
            bail!(
                "DataParallel: the model computes on {:?} but rank 0 is on {:?}",
                model_dev.location(),
                dev0.location()
            )
        }
        // Two `Device::new_cuda(0)` are distinct Candle devices (each with its
        // own stream), whose tensors Candle refuses to mix.
        if !model_dev.same_device(dev0) {
            bail!(
                "DataParallel: the model and rank 0 are on the same GPU {:?} but on different Candle devices: build the model on rank 0's device (`collectives[0].device()`), or the collectives on the model's with `NcclCollective::group`",
                dev0.location()
            )
        }
        for (i, c) in collectives.iter().enumerate() {
            for (j, d) in collectives.iter().enumerate().take(i) {
                if c.device().is_cuda() && c.device().location() == d.device().location() {
                    bail!(
                        "DataParallel: ranks {j} and {i} are on the same device {:?}",
                        c.device().location()
                    )
                }
            }
        }
        let mut replicas = Vec::with_capacity(world);
        for c in &collectives[1..] {
            replicas.push(model.replica(c.device())?.train());
        }
        replicas.insert(0, model.train());
        Ok(Self {
            replicas,
            collectives,
            reduction,
            bucket_elems: BUCKET_ELEMS,
        })
    }

    /// Sets the size (elements) of one gradient all-reduce bucket; by default
    /// 16 Mi elements (64 MiB of f32). A weight larger than that is a bucket
    /// of its own. The same on every rank (it belongs to this object).
    pub fn set_bucket_elems(&mut self, elems: usize) -> Result<()> {
        if elems == 0 {
            bail!("DataParallel: the bucket size must be at least 1 element, got 0")
        }
        self.bucket_elems = elems;
        Ok(())
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.replicas.len()
    }

    /// Rank `r`'s model.
    pub fn replica(&self, r: usize) -> &TrainableSequential {
        &self.replicas[r]
    }

    /// The trainable weights (shared by every replica): give these to the
    /// optimizer.
    pub fn trainable_vars(&self) -> Result<Vec<Var>> {
        self.replicas[0].trainable_vars()
    }

    /// One training step on `inputs` and `targets` (dim 0: the batch, split in
    /// `world_size` equal micro-batches in rank order). `loss(rank, output,
    /// targets)` gives a rank's scalar loss from its model output and its
    /// targets (both on its device). After the reduction `opt` steps once.
    pub fn step<O, F>(
        &self,
        inputs: &Tensor,
        targets: &Tensor,
        loss: F,
        opt: &mut O,
    ) -> Result<StepReport>
    where
        O: Optimizer,
        F: Fn(usize, &Tensor, &Tensor) -> Result<Tensor> + Sync,
    {
        let world = self.world_size();
        let b = micro_batch(inputs, targets, world)?;
        if let Some(f) = self.collectives[0].failure() {
            bail!("DataParallel: the group failed in an earlier step ({f}); build a new one")
        }
        let params: Vec<Var> = self.trainable_vars()?;
        let results: Vec<Result<(f32, GradStore)>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|r| {
                    let (params, loss) = (&params, &loss);
                    s.spawn(move || {
                        // A panic must abort the group at once, or the other
                        // ranks would wait for this one until their timeout.
                        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            self.rank_step(r, b, inputs, targets, params, loss)
                        }))
                        .unwrap_or_else(|_| {
                            Err(candle_core::Error::Msg(format!(
                                "DataParallel: rank {r} panicked"
                            )))
                        });
                        if let Err(e) = &out {
                            self.collectives[r].abort(&e.to_string());
                        }
                        out
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(r, h)| {
                    h.join().unwrap_or_else(|_| {
                        Err(candle_core::Error::Msg(format!(
                            "DataParallel: rank {r} panicked"
                        )))
                    })
                })
                .collect()
        });
        let mut losses = Vec::with_capacity(world);
        let mut reduced = None;
        for (r, res) in results.into_iter().enumerate() {
            match res {
                Ok((l, g)) => {
                    losses.push(l);
                    if r == 0 {
                        reduced = Some(g);
                    }
                }
                Err(e) => return Err(self.first_failure(r, e)),
            }
        }
        let grads = reduced
            .ok_or_else(|| candle_core::Error::Msg("DataParallel: no rank 0 result".into()))?;
        opt.step(&grads)?;
        for m in &self.replicas {
            m.zero_grad()?;
        }
        let mean_loss = losses.iter().sum::<f32>() / world as f32;
        Ok(StepReport { losses, mean_loss })
    }

    /// The error `step` returns: the rank whose own work failed first (not one
    /// that only saw the abort), else the error of rank `r`.
    fn first_failure(&self, r: usize, e: candle_core::Error) -> candle_core::Error {
        let why = self.collectives[r].failure().unwrap_or_default();
        candle_core::Error::Msg(format!(
            "DataParallel: step failed; nothing was stepped or written ({why}); rank {r}: {e}"
        ))
    }

    /// Rank `r`'s part of a step: its micro-batch through its replica, then its
    /// gradients reduced. Returns its loss and its `GradStore` with the
    /// gradients of `params` replaced by the reduced ones (host f32 tensors).
    fn rank_step<F>(
        &self,
        r: usize,
        b: usize,
        inputs: &Tensor,
        targets: &Tensor,
        params: &[Var],
        loss: &F,
    ) -> Result<(f32, GradStore)>
    where
        F: Fn(usize, &Tensor, &Tensor) -> Result<Tensor> + Sync,
    {
        let model = &self.replicas[r];
        let coll = &self.collectives[r];
        let dev = coll.device();
        // This rank's rows only (to_device would move the whole batch's storage).
        let x = streamer_device::to_device_compact(&inputs.narrow(0, r * b, b)?, dev)?;
        let t = streamer_device::to_device_compact(&targets.narrow(0, r * b, b)?, dev)?;
        model.zero_grad()?;
        let out = model.forward(&x)?;
        let l = loss(r, &out, &t)?;
        let lv = l.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let mut grads = model.backward(&l)?;
        let scale = match self.reduction {
            GradReduction::Mean => 1.0 / self.world_size() as f64,
            GradReduction::Sum => 1.0,
        };
        let mut local = Vec::with_capacity(params.len());
        for v in params {
            local.push(match grads.get(v.as_tensor()) {
                Some(g) => g.to_dtype(DType::F32)?,
                // A weight this micro-batch did not reach: its gradient is zero
                // here, and the other ranks still need this rank's part.
                None => Tensor::zeros(v.shape(), DType::F32, &Device::Cpu)?,
            });
        }
        for (v, sum) in params.iter().zip(reduce_buckets(
            coll.as_ref(),
            &local,
            scale,
            self.bucket_elems,
        )?) {
            grads.insert(v.as_tensor(), sum);
        }
        Ok((lv, grads))
    }

    /// Writes the weights (`model.safetensors`) and the optimizer state
    /// (`optimizer.safetensors`) into `dir`, the same files as single-device
    /// training, so a run resumes on any world size. Refused, with nothing
    /// written, when the group has failed.
    pub fn save<R: streamer_autograd::UpdateRule>(
        &self,
        dir: &Path,
        opt: &streamer_autograd::HostOptimizer<R>,
    ) -> Result<()> {
        for c in &self.collectives {
            if let Some(f) = c.failure() {
                bail!("DataParallel: not saving to {dir:?}: the group failed ({f})")
            }
        }
        std::fs::create_dir_all(dir).map_err(candle_core::Error::wrap)?;
        self.replicas[0]
            .inner()
            .save_safetensors(dir.join("model.safetensors"))?;
        opt.save(dir.join("optimizer.safetensors"))
    }
}

/// Elements of one all-reduce by default: gradients are packed into buckets
/// of about this size (64 MiB of f32), so a model of many small weights costs
/// a few collectives per step rather than one per weight.
const BUCKET_ELEMS: usize = 16 << 20;

/// The sums over ranks of the host f32 gradients `local`, times `scale`, as
/// host tensors of the same shapes: packed into buckets (consecutive
/// gradients, the same on every rank), each reduced by one all-reduce on the
/// collective's device.
fn reduce_buckets(
    coll: &dyn Collective,
    local: &[Tensor],
    scale: f64,
    bucket: usize,
) -> Result<Vec<Tensor>> {
    let mut out = Vec::with_capacity(local.len());
    let mut start = 0;
    while start < local.len() {
        let mut end = start;
        let mut elems = 0;
        while end < local.len() && (end == start || elems + local[end].elem_count() <= bucket) {
            elems += local[end].elem_count();
            end += 1;
        }
        let flat: Vec<Tensor> = local[start..end]
            .iter()
            .map(|g| g.flatten_all())
            .collect::<Result<_>>()?;
        let sum = coll.all_reduce_sum(&Tensor::cat(&flat, 0)?.to_device(coll.device())?)?;
        let sum = sum.to_device(&Device::Cpu)?.affine(scale, 0.0)?;
        let mut off = 0;
        for g in &local[start..end] {
            out.push(sum.narrow(0, off, g.elem_count())?.reshape(g.shape())?);
            off += g.elem_count();
        }
        start = end;
    }
    Ok(out)
}

/// The rows per rank of a batch, checked: `inputs` and `targets` agree on dim
/// 0 and it splits evenly over `world` ranks.
fn micro_batch(inputs: &Tensor, targets: &Tensor, world: usize) -> Result<usize> {
    let (Some(&n), Some(&nt)) = (inputs.dims().first(), targets.dims().first()) else {
        bail!("DataParallel: inputs and targets need a batch dim, got scalars")
    };
    if n != nt {
        bail!("DataParallel: inputs have a batch of {n} rows but targets have {nt}")
    }
    if n == 0 || n % world != 0 {
        bail!(
            "DataParallel: a batch of {n} rows does not split into {world} equal non-empty \
             micro-batches (world size {world}); use a multiple of {world}"
        )
    }
    Ok(n / world)
}
