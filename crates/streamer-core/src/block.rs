//! What a streamed block is: a name, the prefix of its weights, and a builder
//! that turns a `VarBuilder` over the block's resident weights into a module.
use candle_core::{Device, Module, Result, Tensor};
use candle_nn::VarBuilder;
use std::sync::Arc;

/// What one call of a block runs under, handed to [`Block::forward_ctx`]:
/// whether it trains, the seed its dropout masks come from, whether its
/// activations are kept, the device whose compute stream its work goes to.
///
/// The seed is derived per key ([`BlockCtx::seed_for`]), never per draw
/// order, so a block that draws masks from rayon threads gets the same masks
/// in its forward and in its recompute (the thread-local seed that
/// `streamer_autograd::dropout` reads is lost on other threads).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct BlockCtx {
    /// The block's index in its model.
    pub index: usize,
    /// A training call (the forward of a training step or its recompute).
    pub training: bool,
    /// This call's dropout seed (training calls); the recompute gets the same.
    pub seed: Option<u64>,
    /// Whether this training forward keeps its activations (no recompute).
    pub keeps_activations: bool,
    /// Use and extend the block's kv cache (inference of blocks that keep
    /// one, e.g. incremental decoding).
    pub kv_cache: bool,
    /// The compute device; its (single) stream is the one the pool orders
    /// the block's weights against.
    pub device: Device,
}

impl BlockCtx {
    /// An inference call of block `index` on `device`.
    pub fn inference(index: usize, device: &Device) -> Self {
        Self {
            index,
            training: false,
            seed: None,
            keeps_activations: false,
            kv_cache: false,
            device: device.clone(),
        }
    }

    /// The same call with the kv cache asked for (or not).
    pub fn with_kv_cache(mut self, on: bool) -> Self {
        self.kv_cache = on;
        self
    }

    /// A training call of block `index` with dropout seed `seed`.
    pub fn training(index: usize, device: &Device, seed: u64, keeps_activations: bool) -> Self {
        Self {
            index,
            training: true,
            seed: Some(seed),
            keeps_activations,
            kv_cache: false,
            device: device.clone(),
        }
    }

    /// The seed of the mask named `key` (any number the block picks, one per
    /// dropout site) in this call: the same in the forward and its recompute,
    /// different across keys and blocks. `None` outside training.
    pub fn seed_for(&self, key: u64) -> Option<u64> {
        // Offset by one so that site 0 does not reuse the call's own seed.
        self.seed.map(|seed| mix_seed(seed, key.wrapping_add(1)))
    }
}

/// SplitMix64's finalizer of `(seed, n)`: independent seeds for the `n`-th
/// stream of a seed (dropout masks per site or per draw).
pub fn mix_seed(seed: u64, n: u64) -> u64 {
    let mut z = seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A block's computation once its weights are bound.
///
/// `x` is the previous block's first output (or the model input); `extras` are the
/// tensors handed to every block (a mask, positions). A block returns one or more
/// tensors: the first is passed on to the next block; the last block's outputs are
/// all returned.
///
/// The weights a block is built with are the pool's device copies, valid for one
/// call: the pool refills their slot once the block is dropped. A block must not
/// stash them (in a static, or an `Arc` its builder shares) for later calls;
/// outputs that alias them are copied for you.
pub trait Block {
    /// Runs the block.
    fn forward(&self, x: &Tensor, extras: &[Tensor]) -> Result<Vec<Tensor>>;

    /// Runs the block with its call's context; what the pool and the trainer
    /// call. The default ignores the context and runs [`Block::forward`].
    fn forward_ctx(&self, x: &Tensor, extras: &[Tensor], ctx: &BlockCtx) -> Result<Vec<Tensor>> {
        let _ = ctx;
        self.forward(x, extras)
    }

    /// The block's hand-written backward, if it has one. Training then runs
    /// [`ManualBackward::forward_train`] and [`ManualBackward::backward`]
    /// instead of Candle's autograd, and may keep the saved activations from
    /// the first forward instead of recomputing them.
    fn manual(&self) -> Option<&dyn ManualBackward> {
        None
    }
}

/// Activations a [`ManualBackward`] block keeps between its forward and its
/// backward. They must not include the block's weights: those live in pool
/// slots that are refilled in between (the trainer checks the tensor ids).
#[derive(Debug)]
pub struct SavedActivations(pub Vec<Tensor>);

/// A block that computes its own gradients, in the spirit of a
/// `torch.autograd.Function`: one output, no gradient into the extras.
///
/// Both calls run on a block built over the same weights (the backward's block
/// is rebuilt from freshly loaded copies), so `backward` reads the weights from
/// `self`, never from `saved`.
pub trait ManualBackward {
    /// The forward, returning the output and what `backward` needs.
    fn forward_train(&self, x: &Tensor, extras: &[Tensor]) -> Result<(Tensor, SavedActivations)>;

    /// [`ManualBackward::forward_train`] with the call's context (what the
    /// trainer calls); the default ignores it.
    fn forward_train_ctx(
        &self,
        x: &Tensor,
        extras: &[Tensor],
        ctx: &BlockCtx,
    ) -> Result<(Tensor, SavedActivations)> {
        let _ = ctx;
        self.forward_train(x, extras)
    }

    /// What [`Self::backward`] needs, recomputed for a block whose training
    /// forward did not keep it (the trainer's recompute-and-refetch backward).
    /// The default is [`Self::forward_train_ctx`] without its output; a block
    /// whose output costs work `backward` never reads (a last projection)
    /// skips that work here. Must save exactly what `forward_train_ctx` saves.
    fn recompute_ctx(
        &self,
        x: &Tensor,
        extras: &[Tensor],
        ctx: &BlockCtx,
    ) -> Result<SavedActivations> {
        Ok(self.forward_train_ctx(x, extras, ctx)?.1)
    }

    /// Device bytes [`Self::forward_train`] keeps for an input of shape `x`
    /// and dtype `dtype` (used to fit kept activations into a budget).
    fn saved_bytes(&self, x: &candle_core::Shape, dtype: candle_core::DType) -> usize;

    /// Given `grad = dL/d(output)`, returns `dL/dx` and the gradient of each
    /// weight, keyed by the weight tensor the block got from its `VarBuilder`
    /// (or by an extra tensor it was given, for a gradient that flows back
    /// into that extra: a LoRA layer's adapters).
    fn backward(
        &self,
        saved: SavedActivations,
        grad: &Tensor,
    ) -> Result<(Tensor, Vec<(Tensor, Tensor)>)>;
}

/// Adapts any `candle_core::Module` (every candle-nn layer) into a [`Block`].
pub struct ModuleBlock<M: Module>(pub M);

impl<M: Module> Block for ModuleBlock<M> {
    fn forward(&self, x: &Tensor, _extras: &[Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![self.0.forward(x)?])
    }
}

type Builder = dyn Fn(VarBuilder) -> Result<Box<dyn Block>> + Send + Sync;

/// A block of a streamed sequence: the weights named `"{prefix}.*"` plus a builder.
///
/// The builder receives a `VarBuilder` rooted at the prefix (so `vb.get(.., "w")`
/// finds `"{prefix}.w"`), exactly as candle-nn code expects. It is called once at
/// construction (on the host, to learn and check which weights the block uses,
/// with zero-cost stand-ins of the right shapes and dtypes: see
/// [`crate::discovering`]) and then on every call with the block's
/// device-resident weights; building candle-nn layers only clones `Arc`s, so
/// this is cheap.
#[derive(Clone)]
pub struct BlockSpec {
    pub(crate) name: String,
    pub(crate) prefix: String,
    pub(crate) build: Arc<Builder>,
}

impl BlockSpec {
    /// A block whose builder returns a [`Block`] (extra inputs, several outputs).
    pub fn new<B, F>(prefix: impl Into<String>, build: F) -> Self
    where
        B: Block + 'static,
        F: Fn(VarBuilder) -> Result<B> + Send + Sync + 'static,
    {
        let prefix = prefix.into();
        Self {
            name: prefix.clone(),
            prefix,
            build: Arc::new(move |vb| Ok(Box::new(build(vb)?) as Box<dyn Block>)),
        }
    }

    /// A block whose builder returns any `candle_core::Module`.
    pub fn module<M, F>(prefix: impl Into<String>, build: F) -> Self
    where
        M: Module + 'static,
        F: Fn(VarBuilder) -> Result<M> + Send + Sync + 'static,
    {
        Self::new(prefix, move |vb| Ok(ModuleBlock(build(vb)?)))
    }

    /// Renames the block in messages and statistics (defaults to its prefix).
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The block's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The prefix of the block's weight names.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Builds the block's module over the given `VarBuilder`.
    pub fn build(&self, vb: VarBuilder) -> Result<Box<dyn Block>> {
        (self.build)(vb)
    }
}

impl std::fmt::Debug for BlockSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockSpec")
            .field("name", &self.name)
            .field("prefix", &self.prefix)
            .finish()
    }
}
