//! Fault injection into streamed training: the device running out of memory
//! in the forward, in the backward (the recompute, Candle's backward through a
//! block, the gradient offload, the weight loads) and in the optimizer step, a
//! block that panics, and a panic that escapes the library while it holds the
//! pool (a panicking observer poisons its locks).
//!
//! Every case trains a 4-block model (Linear, replayable dropout, tanh, then an
//! identity op whose backward can fail) one step, breaks the second, and
//! checks: the error names what failed; the host masters, the AdamW moments
//! and the step count are bit-identical to before the failed step; no block is
//! left loaded in the pool; and retrying the step, then one more, gives weights
//! and optimizer state bit-identical to a run that never failed (the reference,
//! an independent model instance). The blocks raise their own errors through a
//! per-test plan; the library's allocation points fail through
//! `streamer_core::faults` (per thread, so parallel tests do not interfere).
//!
//! The decoder trainer (`LmTrainer::step`) gets the same treatment through the
//! library's allocation points; with its optimizer overlapped with backward,
//! where layers may be stepped before a later failure, the trainer must
//! instead refuse every further step and save, saying why.
//!
//! On CUDA a last case makes the device really run out: it fills the GPU's
//! memory with a tensor until little is free, steps (an out-of-memory error),
//! frees the tensor and steps again.
//!
//! `benches/reliability.rs` runs the same cases and counts them
//! ([`run_all`]).
#![allow(dead_code)]

use anyhow::{bail, ensure, Context, Result};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Device, Layout, Module, Shape, Tensor};
use candle_nn::{Linear, ParamsAdamW, VarBuilder};
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use streamer_autograd::{dropout, CpuAdamW, Train, TrainableSequential};
use streamer_core::faults::{self, FaultPoint};
use streamer_core::{BlockSpec, StreamConfig, StreamedSequential};
use streamer_models::{init_weights, Llama, LlamaConfig, LmTrainer};

/// The model's shape.
#[derive(Clone, Copy, Debug)]
pub struct Net {
    pub width: usize,
    pub batch: usize,
    pub blocks: usize,
}

/// The CPU cases' model: 4 blocks of width 16, batch 8, prefetch 1 (a window
/// of 2 slots: 8 weight loads and 8 gradient offloads per step).
pub const SMALL: Net = Net {
    width: 16,
    batch: 8,
    blocks: 4,
};

/// What breaks, and where.
#[derive(Clone, Copy, Debug)]
pub enum Fault {
    /// The test block `block` fails (out of memory, or a panic) at its
    /// `call`-th forward after arming: 0 is the training forward, 1 the
    /// backward's recompute.
    BlockForward {
        block: usize,
        call: usize,
        panic: bool,
    },
    /// Candle's backward through block `block` fails (out of memory, or a
    /// panic) in the block's last op.
    BlockBackward { block: usize, panic: bool },
    /// A library allocation point fails after `after` passes.
    Library { point: FaultPoint, after: usize },
    /// The pool's observer panics at the `after`-th residency transition: the
    /// panic escapes the library and poisons the pool's and the trainer's locks.
    ObserverPanic { after: usize },
}

impl Fault {
    /// The kind it counts under in the reliability table.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::BlockForward {
                call: 0,
                panic: false,
                ..
            } => "oom_forward",
            Self::BlockForward { panic: false, .. } => "oom_backward_recompute",
            Self::BlockBackward { panic: false, .. } => "oom_backward_autograd",
            Self::Library {
                point: FaultPoint::WeightLoad,
                ..
            } => "oom_weight_load",
            Self::Library {
                point: FaultPoint::GradientOffload,
                ..
            } => "oom_gradient_offload",
            Self::Library {
                point: FaultPoint::OptimizerGradient,
                ..
            } => "oom_optimizer_step",
            Self::BlockForward { panic: true, .. } => "panic_block_forward",
            Self::BlockBackward { panic: true, .. } => "panic_block_backward",
            Self::ObserverPanic { .. } => "panic_escaping_poisons_pool",
        }
    }

    /// Words the error (or the escaped panic) must contain.
    fn expected(&self) -> Vec<String> {
        let block = |b: usize| format!("\"layers.{b}\"");
        match *self {
            Self::BlockForward {
                block: b,
                call,
                panic,
            } => vec![
                if panic { "panicked" } else { "out of memory" }.into(),
                format!(
                    "in the {} of block {}",
                    if call == 0 { "forward" } else { "backward" },
                    block(b)
                ),
            ],
            Self::BlockBackward { block: b, panic } => vec![
                if panic { "panicked" } else { "out of memory" }.into(),
                format!("in the backward of block {}", block(b)),
            ],
            Self::Library { point, .. } => vec!["out of memory".into(), point.to_string()],
            Self::ObserverPanic { .. } => vec!["escaped panic: observer test panic".into()],
        }
    }
}

/// Every case this module runs, by kind.
pub fn cases() -> Vec<Fault> {
    use Fault::*;
    use FaultPoint::*;
    let mut v = Vec::new();
    for block in [0, 2, 3] {
        v.push(BlockForward {
            block,
            call: 0,
            panic: false,
        });
    }
    for block in [3, 1, 0] {
        v.push(BlockForward {
            block,
            call: 1,
            panic: false,
        });
        v.push(BlockBackward {
            block,
            panic: false,
        });
    }
    // Loads 0-3 are the forward's, 4-5 its prefetch for backward, 6-7 backward's.
    for after in [0, 3, 4, 6, 7] {
        v.push(Library {
            point: WeightLoad,
            after,
        });
    }
    for after in [0, 3, 7] {
        v.push(Library {
            point: GradientOffload,
            after,
        });
    }
    for after in [0, 5] {
        v.push(Library {
            point: OptimizerGradient,
            after,
        });
    }
    v.push(BlockForward {
        block: 1,
        call: 0,
        panic: true,
    });
    v.push(BlockForward {
        block: 2,
        call: 1,
        panic: true,
    });
    for block in [0, 3] {
        v.push(BlockBackward { block, panic: true });
    }
    // Transition 0 is the forward's first load; 16 falls in the backward.
    for after in [0, 16] {
        v.push(ObserverPanic { after });
    }
    v
}

// ---- the test block and its plan ---------------------------------------------

/// The fault a test armed in its blocks.
#[derive(Clone, Copy, Debug)]
struct Armed {
    block: usize,
    backward: bool,
    skip: usize,
    panic: bool,
}

/// Shared by one model's blocks: at most one armed fault, fired once.
#[derive(Default)]
struct Plan {
    armed: Mutex<Option<Armed>>,
}

impl Plan {
    fn arm(&self, a: Armed) {
        *self.armed.lock().unwrap_or_else(|p| p.into_inner()) = Some(a);
    }

    /// A pass of block `block` through its forward (or, with `backward`, its
    /// backward): fails if the armed fault is due here.
    fn hit(&self, block: usize, backward: bool) -> candle_core::Result<()> {
        let fire = {
            let mut armed = self.armed.lock().unwrap_or_else(|p| p.into_inner());
            match *armed {
                Some(mut a) if a.block == block && a.backward == backward => {
                    if a.skip > 0 {
                        a.skip -= 1;
                        *armed = Some(a);
                        None
                    } else {
                        *armed = None;
                        Some(a.panic)
                    }
                }
                _ => None,
            }
        };
        let stage = if backward { "backward" } else { "forward" };
        match fire {
            None => Ok(()),
            Some(true) => panic!("test panic in block {block}'s {stage}"),
            Some(false) => Err(candle_core::Error::Msg(format!(
                "out of memory (the test's block {block} in its {stage})"
            ))),
        }
    }
}

/// `Linear`, replayable dropout, tanh, then [`BackwardFault`].
struct Layer {
    lin: Linear,
    plan: Arc<Plan>,
    index: usize,
}

impl Module for Layer {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.plan.hit(self.index, false)?;
        let y = dropout(&self.lin.forward(x)?, 0.25)?.tanh()?;
        y.apply_op1(BackwardFault {
            plan: self.plan.clone(),
            index: self.index,
        })
    }
}

/// The identity, whose backward passes the gradient through unless the plan
/// makes it fail.
struct BackwardFault {
    plan: Arc<Plan>,
    index: usize,
}

fn whole(l: &Layout) -> candle_core::Result<()> {
    if !l.is_contiguous() || l.start_offset() != 0 {
        candle_core::bail!("backward-fault: needs a fresh contiguous input, got {l:?}")
    }
    Ok(())
}

impl CustomOp1 for BackwardFault {
    fn name(&self) -> &'static str {
        "backward-fault"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        whole(l)?;
        Ok((s.try_clone(l)?, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        whole(l)?;
        Ok((s.try_clone(l)?, l.shape().clone()))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        self.plan.hit(self.index, true)?;
        Ok(Some(grad.clone()))
    }
}

// ---- the model, its steps and its state --------------------------------------

/// Deterministic weights (fresh tensors each call: two models never share).
fn weights(net: &Net) -> Result<HashMap<String, Tensor>> {
    let w = net.width;
    let scale = 1.0 / (w as f64).sqrt();
    let mut m = HashMap::new();
    for i in 0..net.blocks {
        let val = |j: usize, k: f64| ((j as f64 * 0.618 + i as f64 * 1.7 + k).sin() * scale) as f32;
        let wt: Vec<f32> = (0..w * w).map(|j| val(j, 0.0)).collect();
        let b: Vec<f32> = (0..w).map(|j| val(j, 0.5) * 0.1).collect();
        m.insert(
            format!("layers.{i}.weight"),
            Tensor::from_vec(wt, (w, w), &Device::Cpu)?,
        );
        m.insert(
            format!("layers.{i}.bias"),
            Tensor::from_vec(b, w, &Device::Cpu)?,
        );
    }
    Ok(m)
}

fn model(dev: &Device, net: &Net, plan: &Arc<Plan>) -> Result<TrainableSequential> {
    let blocks = (0..net.blocks)
        .map(|i| {
            let (plan, w) = (plan.clone(), net.width);
            BlockSpec::module(format!("layers.{i}"), move |vb: VarBuilder| {
                Ok(Layer {
                    lin: candle_nn::linear(w, w, vb)?,
                    plan: plan.clone(),
                    index: i,
                })
            })
        })
        .collect();
    let cfg = StreamConfig {
        device: dev.clone(),
        prefetch_ahead: 1,
        ..Default::default()
    };
    let m = StreamedSequential::from_tensors(weights(net)?, blocks, cfg)?.train();
    m.set_seed(0x00C0_FFEE);
    Ok(m)
}

fn optimizer(m: &TrainableSequential) -> Result<CpuAdamW> {
    let p = ParamsAdamW {
        lr: 1e-2,
        weight_decay: 0.01,
        ..Default::default()
    };
    Ok(CpuAdamW::new(m.trainable_vars()?, p)?)
}

/// Batch `k`: inputs and targets, deterministic, on `dev`.
fn batch(net: &Net, k: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
    let n = net.batch * net.width;
    let x: Vec<f32> = (0..n)
        .map(|j| ((j * 7 + k * 13) as f32 * 0.01).sin())
        .collect();
    let t: Vec<f32> = (0..n)
        .map(|j| ((j * 3 + k) as f32 * 0.02).cos() * 0.5)
        .collect();
    let shape = (net.batch, net.width);
    Ok((
        Tensor::from_vec(x, shape, dev)?,
        Tensor::from_vec(t, shape, dev)?,
    ))
}

/// One training step on batch `k` (forward, backward, AdamW); the gradients
/// are zeroed whether it worked or not, as `LmTrainer::step` does.
fn step(m: &TrainableSequential, opt: &mut CpuAdamW, net: &Net, k: usize) -> Result<f32> {
    let (x, t) = batch(net, k, &m.inner().config().device)?;
    let r = (|| -> candle_core::Result<f32> {
        let loss = m.forward(&x)?.sub(&t)?.sqr()?.mean_all()?;
        let value = loss.to_scalar::<f32>()?;
        let grads = m.backward(&loss)?;
        if let Err(e) = opt.step(&grads) {
            // Forward and backward went through: their dropout seeds are
            // given back only on request (a failed forward or backward gives
            // them back itself).
            m.rewind_dropout_seeds()?;
            return Err(e);
        }
        Ok(value)
    })();
    m.zero_grad()?;
    Ok(r?)
}

/// Every bit of the masters and moments, and the step count.
#[derive(PartialEq)]
struct Snapshot(Vec<Vec<u32>>, usize);

fn snapshot(opt: &CpuAdamW) -> Result<Snapshot> {
    let mut bits = Vec::new();
    for (i, v) in opt.vars().iter().enumerate() {
        let p: Vec<f32> = v.as_tensor().flatten_all()?.to_vec1()?;
        bits.push(p.iter().map(|x| x.to_bits()).collect());
        let (m, s) = opt.moments(i).context("moments")?;
        bits.push(m.iter().chain(s.iter()).map(|x| x.to_bits()).collect());
    }
    Ok(Snapshot(bits, opt.step_count()))
}

/// CUDA cases share the device; the real out-of-memory case fills it.
static DEVICE_LOCK: Mutex<()> = Mutex::new(());

fn device_lock(dev: &Device) -> Option<std::sync::MutexGuard<'static, ()>> {
    dev.is_cuda()
        .then(|| DEVICE_LOCK.lock().unwrap_or_else(|p| p.into_inner()))
}

/// The state after three uninterrupted steps.
fn reference(dev: &Device, net: &Net) -> Result<Snapshot> {
    let m = model(dev, net, &Arc::new(Plan::default()))?;
    let mut opt = optimizer(&m)?;
    for k in 0..3 {
        step(&m, &mut opt, net, k)?;
    }
    snapshot(&opt)
}

fn arm(fault: Fault, plan: &Plan, m: &TrainableSequential) -> Result<()> {
    match fault {
        Fault::BlockForward { block, call, panic } => plan.arm(Armed {
            block,
            backward: false,
            skip: call,
            panic,
        }),
        Fault::BlockBackward { block, panic } => plan.arm(Armed {
            block,
            backward: true,
            skip: 0,
            panic,
        }),
        Fault::Library { point, after } => faults::inject_out_of_memory(point, after),
        Fault::ObserverPanic { after } => {
            let seen = AtomicUsize::new(0);
            m.inner().set_observer(Some(Arc::new(move |_| {
                if seen.fetch_add(1, Ordering::SeqCst) == after {
                    panic!("observer test panic");
                }
            })))?;
        }
    }
    Ok(())
}

/// Runs `f`, returning its error (or escaped panic) as text, or an error if it
/// succeeded.
fn must_fail(what: &str, f: impl FnOnce() -> Result<f32>) -> Result<String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(loss)) => bail!("{what}: the step succeeded (loss {loss})"),
        Ok(Err(e)) => Ok(format!("{e:#}")),
        Err(p) => Ok(format!(
            "escaped panic: {}",
            faults::panic_message(p.as_ref())
        )),
    }
}

/// After a failed step: nothing changed, nothing left loaded, then the retried
/// step and one more match the uninterrupted run bit for bit.
fn check_recovery(
    what: &str,
    m: &TrainableSequential,
    opt: &mut CpuAdamW,
    net: &Net,
    before: &Snapshot,
    want: &Snapshot,
) -> Result<()> {
    ensure!(
        snapshot(opt)? == *before,
        "{what}: the failed step changed the masters or the optimizer state"
    );
    {
        let pool = m.inner().lock_pool()?;
        let loaded: Vec<usize> = (0..pool.len()).filter(|&b| pool.is_loaded(b)).collect();
        ensure!(loaded.is_empty(), "{what}: blocks {loaded:?} left loaded");
    }
    step(m, opt, net, 1).with_context(|| format!("{what}: retrying the step"))?;
    step(m, opt, net, 2).with_context(|| format!("{what}: the step after"))?;
    ensure!(
        snapshot(opt)? == *want,
        "{what}: after the retry the state differs from the uninterrupted run"
    );
    Ok(())
}

/// One case: step, fail the next step with `fault`, check, retry. Returns
/// the error the failed step gave.
pub fn survive(dev: &Device, net: &Net, fault: Fault) -> Result<String> {
    let _gpu = device_lock(dev);
    let want = reference(dev, net)?;
    let plan = Arc::new(Plan::default());
    let m = model(dev, net, &plan)?;
    let mut opt = optimizer(&m)?;
    step(&m, &mut opt, net, 0)?;
    let before = snapshot(&opt)?;
    let what = format!("{fault:?}");
    arm(fault, &plan, &m)?;
    let err = must_fail(&what, || step(&m, &mut opt, net, 1));
    faults::clear_injected_faults();
    m.inner().set_observer(None)?;
    let err = err?;
    for word in fault.expected() {
        ensure!(
            err.contains(&word),
            "{what}: the error does not say {word:?}: {err}"
        );
    }
    check_recovery(&what, &m, &mut opt, net, &before, &want)?;
    Ok(err)
}

fn survive_kind(dev: &Device, kind: &str) -> Result<()> {
    let cases: Vec<Fault> = cases().into_iter().filter(|f| f.kind() == kind).collect();
    ensure!(!cases.is_empty(), "no case of kind {kind}");
    for f in cases {
        survive(dev, &SMALL, f)?;
    }
    Ok(())
}

/// One row of the reliability table.
pub struct KindReport {
    pub kind: &'static str,
    pub injected: usize,
    pub survived: usize,
    pub failures: Vec<String>,
}

/// Every case on `dev` (and on CUDA the real out-of-memory case), by kind.
pub fn run_all(dev: &Device) -> Vec<KindReport> {
    let mut rows: Vec<KindReport> = Vec::new();
    let mut record = |kind: &'static str, r: Result<String>| {
        let i = match rows.iter().position(|r| r.kind == kind) {
            Some(i) => i,
            None => {
                rows.push(KindReport {
                    kind,
                    injected: 0,
                    survived: 0,
                    failures: Vec::new(),
                });
                rows.len() - 1
            }
        };
        rows[i].injected += 1;
        match r {
            Ok(_) => rows[i].survived += 1,
            Err(e) => rows[i].failures.push(format!("{e:#}")),
        }
    };
    for f in cases() {
        record(f.kind(), survive(dev, &SMALL, f));
    }
    for (kind, point, after) in lm_cases() {
        record(kind, lm_survive(dev, point, after));
    }
    record(
        "oom_lm_trainer_overlapped_refuses",
        lm_overlapped_refuses(dev),
    );
    #[cfg(feature = "cuda")]
    if dev.is_cuda() {
        record("oom_real_device_full", real_out_of_memory(dev));
    }
    rows
}

// ---- the tests ------------------------------------------------------------------

/// A test on every device per fault kind: the run survives the fault
/// (`survive_kind`).
macro_rules! survive_tests {
    ($($name:ident: $kind:literal,)*) => {
        $(
            fn $name(dev: &Device) -> Result<()> {
                survive_kind(dev, $kind)
            }
            candle_streamer::test_device!($name);
        )*
    };
}

survive_tests! {
    oom_in_forward_changes_nothing_and_retry_matches: "oom_forward",
    oom_in_backward_recompute_changes_nothing_and_retry_matches: "oom_backward_recompute",
    oom_in_block_backward_changes_nothing_and_retry_matches: "oom_backward_autograd",
    oom_in_weight_loads_changes_nothing_and_retry_matches: "oom_weight_load",
    oom_in_gradient_offload_changes_nothing_and_retry_matches: "oom_gradient_offload",
    oom_in_optimizer_step_changes_nothing_and_retry_matches: "oom_optimizer_step",
    block_panic_in_forward_is_reported_and_model_recovers: "panic_block_forward",
    block_panic_in_backward_is_reported_and_model_recovers: "panic_block_backward",
    escaped_panic_poisons_pool_and_next_call_resets_it: "panic_escaping_poisons_pool",
}

/// The injection points themselves: one-shot, per thread, and counted.
#[test]
fn injected_faults_fire_once_on_their_thread_only() -> Result<()> {
    let before = faults::injected_fault_count();
    faults::inject_out_of_memory(FaultPoint::WeightLoad, 1);
    let other = std::thread::spawn(|| faults::check(FaultPoint::WeightLoad, String::new).is_ok());
    ensure!(other.join().map_err(|_| anyhow::anyhow!("thread"))?);
    ensure!(faults::check(FaultPoint::GradientOffload, String::new).is_ok());
    ensure!(faults::check(FaultPoint::WeightLoad, String::new).is_ok());
    ensure!(faults::check(FaultPoint::WeightLoad, String::new).is_err());
    ensure!(faults::check(FaultPoint::WeightLoad, String::new).is_ok());
    ensure!(faults::injected_fault_count() == before + 1);
    Ok(())
}

/// An injected out-of-memory reaches the caller of a training step as
/// `streamer_device::Error::OutOfMemory`, whichever allocation point failed.
fn injected_out_of_memory_is_typed(dev: &Device) -> Result<()> {
    let _gpu = device_lock(dev);
    for point in [
        FaultPoint::WeightLoad,
        FaultPoint::GradientOffload,
        FaultPoint::OptimizerGradient,
    ] {
        let m = model(dev, &SMALL, &Arc::new(Plan::default()))?;
        let mut opt = optimizer(&m)?;
        faults::inject_out_of_memory(point, 0);
        let r = step(&m, &mut opt, &SMALL, 0);
        faults::clear_injected_faults();
        let e = r.err().context("the step must fail")?;
        ensure!(
            streamer_device::Error::find(e.as_ref())
                .is_some_and(|e| matches!(e, streamer_device::Error::OutOfMemory { .. })),
            "{point}: {e:#}"
        );
    }
    Ok(())
}
candle_streamer::test_device!(injected_out_of_memory_is_typed);

// ---- the decoder trainer ----------------------------------------------------------

/// `LmTrainer` on a micro decoder (2 layers of width 16), streamed on `dev`.
fn lm_trainer(dev: &Device, overlap: bool) -> Result<LmTrainer> {
    let cfg = LlamaConfig {
        max_position_embeddings: 16,
        ..LlamaConfig::bytes(16, 2, 2, 1)
    };
    let stream = StreamConfig {
        device: dev.clone(),
        prefetch_ahead: 1,
        master_dtype: Some(candle_core::DType::F32),
        ..Default::default()
    };
    let model = Llama::from_tensors(init_weights(&cfg, 3)?, &cfg, stream)?;
    let params = ParamsAdamW {
        lr: 3e-3,
        weight_decay: 0.01,
        ..Default::default()
    };
    let mut t = LmTrainer::new(model, params)?;
    t.set_overlap(overlap);
    Ok(t)
}

/// Step `k`'s tokens and next-token targets, `(2, 12)` u32 bytes.
fn lm_batch(k: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
    let ids: Vec<u32> = (0..26).map(|j| ((j * 31 + k * 7) % 256) as u32).collect();
    let rows =
        |off: usize| -> Vec<u32> { [&ids[off..off + 12], &ids[13 + off..25 + off]].concat() };
    Ok((
        Tensor::from_vec(rows(0), (2, 12), dev)?,
        Tensor::from_vec(rows(1), (2, 12), dev)?,
    ))
}

fn lm_step(t: &mut LmTrainer, k: usize, dev: &Device) -> Result<f32> {
    let (x, y) = lm_batch(k, dev)?;
    Ok(t.step(&x, &y)?)
}

/// The decoder trainer's step (`LmTrainer::step`, optimizer after backward)
/// with an allocation point failing: an error, nothing changed, and the retry
/// and the next step match an uninterrupted trainer bit for bit.
pub fn lm_survive(dev: &Device, point: FaultPoint, after: usize) -> Result<String> {
    let _gpu = device_lock(dev);
    let mut r = lm_trainer(dev, false)?;
    for k in 0..3 {
        lm_step(&mut r, k, dev)?;
    }
    let want = snapshot(r.optimizer().expect("host optimizer"))?;
    let mut t = lm_trainer(dev, false)?;
    lm_step(&mut t, 0, dev)?;
    let before = snapshot(t.optimizer().expect("host optimizer"))?;
    faults::inject_out_of_memory(point, after);
    let what = format!("LmTrainer, {point} after {after}");
    let err = must_fail(&what, || lm_step(&mut t, 1, dev));
    faults::clear_injected_faults();
    let err = err?;
    ensure!(
        err.contains("out of memory") && err.contains(&point.to_string()),
        "{what}: {err}"
    );
    ensure!(
        snapshot(t.optimizer().expect("host optimizer"))? == before && t.steps_done() == 1,
        "{what}: the failed step changed the trainer"
    );
    lm_step(&mut t, 1, dev).with_context(|| format!("{what}: retrying"))?;
    lm_step(&mut t, 2, dev)?;
    ensure!(
        snapshot(t.optimizer().expect("host optimizer"))? == want,
        "{what}: the retried run differs from the uninterrupted one"
    );
    Ok(err)
}

/// With the optimizer overlapped with backward, layers may be stepped before
/// a later gradient's offload fails: the step errors, and the trainer then
/// refuses every further step and save with an error that says so.
pub fn lm_overlapped_refuses(dev: &Device) -> Result<String> {
    let _gpu = device_lock(dev);
    let mut t = lm_trainer(dev, true)?;
    lm_step(&mut t, 0, dev)?;
    faults::inject_out_of_memory(FaultPoint::GradientOffload, 3);
    let err = must_fail("overlapped LmTrainer", || lm_step(&mut t, 1, dev));
    faults::clear_injected_faults();
    let err = err?;
    ensure!(err.contains("out of memory"), "overlapped: {err}");
    let next = must_fail("the step after", || lm_step(&mut t, 2, dev))?;
    ensure!(
        next.contains("failed part-way"),
        "the step after a part-way failure: {next}"
    );
    let dir = std::env::temp_dir().join(format!("faults-overlap-{}", std::process::id()));
    let saved = t.save(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    match saved {
        Ok(()) => bail!("a trainer part-way through a step saved a checkpoint"),
        Err(e) => ensure!(e.to_string().contains("failed part-way"), "save: {e}"),
    }
    Ok(err)
}

/// The decoder trainer's cases, as `(kind, case)`.
fn lm_cases() -> Vec<(&'static str, FaultPoint, usize)> {
    vec![
        ("oom_lm_trainer_step", FaultPoint::WeightLoad, 2),
        ("oom_lm_trainer_step", FaultPoint::GradientOffload, 3),
        ("oom_lm_trainer_step", FaultPoint::OptimizerGradient, 4),
    ]
}

fn lm_trainer_step_survives_injected_oom(dev: &Device) -> Result<()> {
    for (_, point, after) in lm_cases() {
        lm_survive(dev, point, after)?;
    }
    Ok(())
}
candle_streamer::test_device!(lm_trainer_step_survives_injected_oom);

fn lm_trainer_overlapped_failure_refuses_steps_and_saves(dev: &Device) -> Result<()> {
    lm_overlapped_refuses(dev).map(drop)
}
candle_streamer::test_device!(lm_trainer_overlapped_failure_refuses_steps_and_saves);

// ---- the real thing (CUDA) -------------------------------------------------------

/// Allocates device memory until at most `leave` bytes stay free.
#[cfg(feature = "cuda")]
fn fill_device(dev: &Device, leave: usize) -> Result<Vec<Tensor>> {
    use candle_core::DType;
    streamer_core::trim_device_memory(dev)?;
    let mut held = Vec::new();
    let mut chunk = 1usize << 34;
    // Bounded: each pass allocates or halves the chunk.
    for _ in 0..4096 {
        let free = streamer_core::free_device_memory(dev)?.unwrap_or(0);
        if free <= leave + (1 << 20) {
            break;
        }
        let bytes = (free - leave).min(chunk);
        match Tensor::zeros(bytes / 4, DType::F32, dev) {
            Ok(t) => held.push(t),
            Err(_) if chunk > 1 << 22 => chunk /= 2,
            Err(_) => break,
        }
    }
    dev.synchronize()?;
    Ok(held)
}

/// Fills the GPU, steps (out of memory), frees, steps again: the state matches
/// a run that never failed.
#[cfg(feature = "cuda")]
pub fn real_out_of_memory(dev: &Device) -> Result<String> {
    let _gpu = device_lock(dev);
    // Activations of 16 MiB per block output: far more than the 2 MiB left.
    let net = Net {
        width: 1024,
        batch: 4096,
        blocks: 4,
    };
    let want = reference(dev, &net)?;
    let m = model(dev, &net, &Arc::new(Plan::default()))?;
    let mut opt = optimizer(&m)?;
    step(&m, &mut opt, &net, 0)?;
    let before = snapshot(&opt)?;
    let filler = fill_device(dev, 2 << 20)?;
    let free = streamer_core::free_device_memory(dev)?.unwrap_or(0);
    let err = must_fail(&format!("device full ({free} bytes free)"), || {
        step(&m, &mut opt, &net, 1)
    });
    drop(filler);
    // Hand the freed memory back to the driver: a pool that keeps freed
    // blocks (as the benches ask) would still starve allocations made
    // outside it, such as cuRAND's (seen on the H200 in the reliability bench).
    dev.synchronize()?;
    streamer_core::trim_device_memory(dev)?;
    let err = err?;
    let lower = err.to_lowercase();
    ensure!(
        lower.contains("out of memory")
            || lower.contains("out_of_memory")
            || lower.contains("alloc"),
        "the failed step's error does not say out of memory: {err}"
    );
    check_recovery("device full", &m, &mut opt, &net, &before, &want)?;
    Ok(err)
}

#[cfg(feature = "cuda")]
#[test]
fn real_device_oom_after_filling_memory_then_retry_matches() -> Result<()> {
    let dev = candle_streamer::test_utils::cuda_device()?;
    let err = real_out_of_memory(&dev)?;
    eprintln!("device full: {err}");
    Ok(())
}
