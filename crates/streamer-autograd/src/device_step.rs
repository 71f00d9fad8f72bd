//! The device optimizer step inside a streamed backward
//! ([`crate::TrainableSequential::backward_step_device`]): which optimizer
//! parameter each master is, the partial sums of weights shared by several
//! blocks, and the step of each weight once its gradient is complete.
use std::collections::HashMap;

use candle_core::{bail, DType, Result, Tensor, TensorId};
use streamer_core::{HostMasters, ResidencyPool};

use crate::DeviceAdamW;

pub(crate) struct DeviceStep<'o> {
    opt: &'o mut DeviceAdamW,
    /// Master index -> optimizer param index.
    index: HashMap<usize, usize>,
    /// Gradients of weights used by blocks still to come (f32, device).
    partial: HashMap<usize, Tensor>,
}

impl<'o> DeviceStep<'o> {
    /// Maps every master to its optimizer param and opens the step; every
    /// trainable master must be one of the optimizer's params.
    pub(crate) fn new(
        opt: &'o mut DeviceAdamW,
        masters: &HostMasters,
        trainable: &[bool],
    ) -> Result<Self> {
        let by_id: HashMap<TensorId, usize> = opt
            .vars()
            .iter()
            .enumerate()
            .map(|(i, v)| (v.as_tensor().id(), i))
            .collect();
        let index = masters
            .iter()
            .enumerate()
            .filter_map(|(m, master)| by_id.get(&master.var.as_tensor().id()).map(|&i| (m, i)))
            .collect::<HashMap<usize, usize>>();
        if let Some(m) = (0..masters.len()).find(|&m| trainable[m] && !index.contains_key(&m)) {
            bail!(
                "backward_step_device: streamed weight {:?} is trainable but not in the \
                 DeviceAdamW (build it over trainable_vars())",
                masters.get(m).name
            )
        }
        opt.begin_step()?;
        Ok(Self {
            opt,
            index,
            partial: HashMap::new(),
        })
    }

    /// Steps the weights block `i` completed (`last_user[m] == i`) with their
    /// gradients `grads` (`(master, gradient)`); gradients of weights that
    /// earlier blocks also use are summed until then. On CUDA the staged
    /// master copies are stepped and written back; on the CPU the host
    /// masters are stepped directly.
    pub(crate) fn step_block(
        &mut self,
        pool: &mut ResidencyPool,
        i: usize,
        grads: &[(usize, Tensor)],
        last_user: &[usize],
    ) -> Result<()> {
        let mut done = Vec::new();
        for (m, g) in grads {
            let Some(&idx) = self.index.get(m) else {
                bail!(
                    "backward_step_device: streamed weight {:?} is trainable but not in the \
                     DeviceAdamW (build it over trainable_vars())",
                    pool.masters().get(*m).name
                )
            };
            let g = match self.partial.remove(m) {
                Some(p) => p.add(&g.to_dtype(DType::F32)?)?,
                None => g.clone(),
            };
            if last_user[*m] != i {
                self.partial.insert(*m, g.to_dtype(DType::F32)?);
                continue;
            }
            if pool.device().is_cpu() {
                self.opt.step_host(idx, &g)?;
                continue;
            }
            let dm = pool.device_masters(i, &[*m])?[0];
            // SAFETY: `dm` is master m's device copy for block i, acquired for
            // this backward and not refilled before `release(i)`, which the
            // caller issues after this on the same compute stream.
            unsafe { self.step_copy(idx, dm, &g)? };
            done.push(*m);
        }
        if !done.is_empty() {
            // SAFETY: nothing reads these masters before the pool synchronizes
            // at the end of this backward (or on its error path): later loads
            // in this backward are of other blocks' weights (a shared weight is
            // stepped only after its lowest-index user), and the caller may not
            // use the parameters during `backward_step_device`.
            unsafe { pool.write_back_masters(i, &done)? };
        }
        Ok(())
    }

    /// Steps the device copy `dm` of parameter `idx` with gradient `g`; the
    /// caller keeps `dm` alive and untouched until the step has run.
    unsafe fn step_copy(
        &mut self,
        idx: usize,
        dm: streamer_core::DeviceMaster,
        g: &Tensor,
    ) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            // SAFETY: forwarded from the caller.
            unsafe { self.opt.step_device_copy(idx, dm.address, dm.dtype, g) }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (idx, dm, g);
            bail!("backward_step_device: a device copy without the cuda feature")
        }
    }

    /// After the backward (the pool synchronised): fails if a weight was left
    /// unstepped or was skipped for a non-finite gradient, naming it.
    pub(crate) fn finish(self, masters: &HostMasters) -> Result<()> {
        if let Some(m) = self.partial.keys().next() {
            bail!(
                "backward_step_device: weight {:?} got part of its gradient but was never stepped",
                masters.get(*m).name
            )
        }
        #[cfg(feature = "cuda")]
        if self.opt.device().is_cuda() {
            let bad = self.opt.flagged()?;
            if !bad.is_empty() {
                let names: Vec<&str> = bad
                    .iter()
                    .map(|&i| self.opt.param_names()[i].as_str())
                    .collect();
                bail!(
                    "backward_step_device: the gradients of params {names:?} are not finite; \
                     they and their moments were left unchanged, the other streamed weights \
                     were stepped"
                )
            }
        }
        Ok(())
    }
}
