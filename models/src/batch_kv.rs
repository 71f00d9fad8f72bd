//! The kv cache of a batched decode ([`crate::batch_generate`]), packed so
//! that a step's attention is one call per layer whatever the batch.
//!
//! Per layer, the keys (and the values) of every sequence slot live in one
//! tensor `(1, kv_heads, slots * capacity, head_dim)`: slot `s` holds its
//! positions at rows `s * capacity ..`. A step writes each sequence's new rows
//! after its cached ones (one scatter for all one-row sequences, a copy per
//! prompt), then attends with `cu_seqlens` whose documents are the slots' used
//! rows, the unused rows between them being documents without queries, which
//! cost nothing. The tensors start as zeros, so rows past a slot's length hold
//! finite values (zeros, or an earlier sequence's keys), which the masks give
//! weight 0.
//!
//! Memory: `2 x layers x slots x capacity x kv_heads x head_dim` elements. The
//! capacity is the longest sequence in flight (prompt and `max_tokens`, at most
//! the context), or twice the longest one so far when a request's end is not in
//! sight, so a slot wastes at most the difference between its sequence and the
//! longest one (at most half the capacity in the second case).
use candle_core::{bail, DType, Device, Result, Tensor};

/// One layer's keys and values.
type Layer = Option<(Tensor, Tensor)>;

/// The rows a step writes: `(slot, rows)` in row order, slots ascending.
pub(crate) type Step = Vec<(usize, usize)>;

#[derive(Debug)]
pub(crate) struct BatchKv {
    layers: Vec<Layer>,
    /// Positions held by each slot (advanced when a step completes).
    lens: Vec<usize>,
    /// Rows per slot; a layer's tensors grow to it at that layer's next write.
    capacity: usize,
    /// The step in flight (empty: none).
    step: Step,
    /// The step's scatter of one-row sequences, made at its first layer:
    /// `(source rows of the packed call, destination index)`.
    scatter: Option<(Tensor, Tensor)>,
}

/// What one layer's attention over the packed cache needs.
pub(crate) struct Packed {
    pub(crate) k: Tensor,
    pub(crate) v: Tensor,
    pub(crate) cu_seqlens_q: Vec<usize>,
    pub(crate) cu_seqlens_k: Vec<usize>,
}

impl BatchKv {
    pub(crate) fn new(layers: usize, slots: usize) -> Self {
        Self {
            layers: vec![None; layers],
            lens: vec![0; slots],
            capacity: 0,
            step: Vec::new(),
            scatter: None,
        }
    }

    /// Positions held by `slot`.
    pub(crate) fn len(&self, slot: usize) -> Result<usize> {
        match self.lens.get(slot) {
            Some(&n) => Ok(n),
            None => bail!("kv cache: no batch slot {slot} (of {})", self.lens.len()),
        }
    }

    /// Empties `slot` for the next sequence.
    pub(crate) fn clear(&mut self, slot: usize) -> Result<()> {
        self.len(slot)?;
        self.lens[slot] = 0;
        Ok(())
    }

    /// Makes room for `need` positions in every slot; `hint` is how long the
    /// sequences in flight may grow (see the module's documentation).
    pub(crate) fn reserve(&mut self, need: usize, hint: usize) {
        if need > self.capacity {
            self.capacity = need.max(hint.min(2 * need)).next_multiple_of(16);
        }
    }

    /// Starts a step writing `step`'s rows (slots ascending, each within the
    /// capacity).
    pub(crate) fn begin_step(&mut self, step: Step) -> Result<()> {
        let mut last = None;
        for &(slot, n) in &step {
            let len = self.len(slot)?;
            if last.is_some_and(|l| l >= slot) {
                bail!("kv cache: a batched step's slots must ascend, got {step:?}")
            }
            if len + n > self.capacity {
                bail!(
                    "kv cache: slot {slot} holds {len} positions and gets {n} more, past its \
                     capacity of {} (reserve first)",
                    self.capacity
                )
            }
            last = Some(slot);
        }
        self.step = step;
        self.scatter = None;
        Ok(())
    }

    /// Ends the step; a completed one (`done`) advances the slots' lengths,
    /// a failed one leaves them as they were (its rows are unused).
    pub(crate) fn end_step(&mut self, done: bool) {
        if done {
            for &(slot, n) in &self.step {
                self.lens[slot] += n;
            }
        }
        self.step.clear();
        self.scatter = None;
    }

    /// The step in flight, if any.
    pub(crate) fn step(&self) -> Option<Step> {
        (!self.step.is_empty()).then(|| self.step.clone())
    }

    /// Writes layer `layer`'s new keys and values `(1, kv_heads, rows,
    /// head_dim)` of the step in flight and returns the packed cache with the
    /// step's documents.
    pub(crate) fn extend(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<Packed> {
        let (_, heads, rows, d) = k.dims4()?;
        let total: usize = self.step.iter().map(|s| s.1).sum();
        if rows != total {
            bail!("kv cache: a batched step of {total} rows got keys of {rows}")
        }
        let (ck, cv) = self.layer(layer, (heads, d), k.dtype(), k.device())?;
        self.write(&ck, k)?;
        self.write(&cv, v)?;
        let (cu_seqlens_q, cu_seqlens_k) = self.documents();
        Ok(Packed {
            k: ck,
            v: cv,
            cu_seqlens_q,
            cu_seqlens_k,
        })
    }

    /// Layer `layer`'s tensors at the current capacity (grown, keeping what
    /// they hold, or made).
    fn layer(
        &mut self,
        layer: usize,
        (heads, d): (usize, usize),
        dtype: DType,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let (slots, cap) = (self.lens.len(), self.capacity);
        let Some(entry) = self.layers.get_mut(layer) else {
            bail!("kv cache has no layer {layer}")
        };
        let grown = |old: Option<&Tensor>| -> Result<Tensor> {
            let t = Tensor::zeros((heads, slots, cap, d), dtype, dev)?;
            if let Some(old) = old {
                let old_cap = old.dim(2)? / slots;
                t.slice_set(&old.reshape((heads, slots, old_cap, d))?, 2, 0)?;
            }
            t.reshape((1, heads, slots * cap, d))
        };
        let fresh = match entry.as_ref() {
            Some((k, _)) => k.dim(2)? < slots * cap,
            None => true,
        };
        if fresh {
            let old = entry.take();
            let k = grown(old.as_ref().map(|o| &o.0))?;
            let v = grown(old.as_ref().map(|o| &o.1))?;
            *entry = Some((k, v));
        }
        Ok(entry.clone().expect("set above"))
    }

    /// Writes the step's rows of `new` into `cache`: one scatter for the
    /// one-row sequences, a copy for each longer one.
    fn write(&mut self, cache: &Tensor, new: &Tensor) -> Result<()> {
        let (_, heads, _, d) = new.dims4()?;
        let cap = self.capacity;
        if self.scatter.is_none() {
            let (mut src, mut dst) = (Vec::new(), Vec::new());
            let mut at = 0u32;
            for &(slot, n) in &self.step {
                if n == 1 {
                    src.push(at);
                    dst.push((slot * cap + self.lens[slot]) as u32);
                }
                at += n as u32;
            }
            let dev = new.device();
            let m = dst.len();
            let dst = Tensor::new(dst, dev)?
                .reshape((1, 1, m, 1))?
                .broadcast_as((1, heads, m, d))?
                .contiguous()?;
            self.scatter = Some((Tensor::new(src, dev)?, dst));
        }
        let (src, dst) = self.scatter.as_ref().expect("made above");
        if dst.dim(2)? > 0 {
            let rows = match dst.dim(2)? == new.dim(2)? {
                true => new.contiguous()?,
                false => new.index_select(src, 2)?,
            };
            cache.scatter_set(dst, &rows, 2)?;
        }
        let mut at = 0;
        for &(slot, n) in &self.step {
            if n > 1 {
                let rows = new.narrow(2, at, n)?.contiguous()?;
                cache.slice_set(&rows, 2, slot * cap + self.lens[slot])?;
            }
            at += n;
        }
        Ok(())
    }

    /// The step's documents over the packed cache: each sequence's new rows
    /// against its slot's positions (cached and new), and between them
    /// documents of unused rows without queries.
    fn documents(&self) -> (Vec<usize>, Vec<usize>) {
        let cap = self.capacity;
        let (mut cq, mut ck) = (vec![0], vec![0]);
        let mut at = 0;
        for &(slot, n) in &self.step {
            if slot * cap > *ck.last().expect("starts at 0") {
                cq.push(at);
                ck.push(slot * cap);
            }
            at += n;
            cq.push(at);
            ck.push(slot * cap + self.lens[slot] + n);
        }
        let end = self.lens.len() * cap;
        if *ck.last().expect("starts at 0") < end {
            cq.push(at);
            ck.push(end);
        }
        (cq, ck)
    }
}
