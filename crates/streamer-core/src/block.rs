//! What a streamed block is: a name, the prefix of its weights, and a builder
//! that turns a `VarBuilder` over the block's resident weights into a module.
use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;
use std::sync::Arc;

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

    /// Device bytes [`Self::forward_train`] keeps for an input of shape `x`
    /// and dtype `dtype` (used to fit kept activations into a budget).
    fn saved_bytes(&self, x: &candle_core::Shape, dtype: candle_core::DType) -> usize;

    /// Given `grad = dL/d(output)`, returns `dL/dx` and the gradient of each
    /// weight, keyed by the weight tensor the block got from its `VarBuilder`.
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
/// construction (on the host, to learn and check which weights the block uses) and
/// then on every call with the block's device-resident weights; building candle-nn
/// layers only clones `Arc`s, so this is cheap.
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
