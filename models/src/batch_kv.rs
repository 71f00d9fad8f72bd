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
//!
//! The last `host_slots` slots keep their keys and values in host memory
//! ([`crate::host_kv`]): at each layer of a step their part comes to the
//! device, takes the step's rows and is attended over in a second call, and
//! the new rows go back to the host. The step's rows are ordered by slot, so
//! the host slots' rows are the step's last ones.
use candle_core::{bail, DType, Device, Result, Tensor};
use std::ops::Range;

use crate::host_kv::{HostKv, KvUpload};

/// One layer's keys and values.
type Layer = Option<(Tensor, Tensor)>;

/// The rows a step writes: `(slot, rows)` in row order, slots ascending.
pub(crate) type Step = Vec<(usize, usize)>;

pub(crate) struct BatchKv {
    /// The device slots' keys and values, per layer.
    layers: Vec<Layer>,
    /// Positions held by each slot (advanced when a step completes).
    lens: Vec<usize>,
    /// Slots `0..device_slots` keep their keys and values on the device, the
    /// others in `host`.
    device_slots: usize,
    /// Rows per slot; a layer's tensors grow to it at that layer's next write.
    capacity: usize,
    /// The step in flight (empty: none).
    step: Step,
    /// The step's sequences in the device slots and in the host ones.
    parts: [Part; 2],
    /// The step's scatter of one-row sequences per part (device, host), made
    /// at its first layer: `(source rows of the part, destination index)`.
    scatter: [Option<(Tensor, Tensor)>; 2],
    host: HostKv,
    /// Bytes of the host part copied to the device so far.
    host_copied: usize,
}

/// What one attention call over a part of the packed cache needs: the rows
/// of the step it answers, the part's keys and values, its documents.
pub(crate) struct Packed {
    pub(crate) rows: Range<usize>,
    pub(crate) k: Tensor,
    pub(crate) v: Tensor,
    pub(crate) cu_seqlens_q: Vec<usize>,
    pub(crate) cu_seqlens_k: Vec<usize>,
}

/// The step's sequences within one part of the slots: `(slot relative to the
/// part, new rows, positions held before the step)`, and the step's rows they
/// take.
#[derive(Default)]
struct Part {
    seqs: Vec<(usize, usize, usize)>,
    rows: Range<usize>,
}

impl Part {
    /// Slots up to the last one in the step, and the positions of the
    /// longest of them after the step.
    fn extent(&self) -> (usize, usize) {
        let slots = self.seqs.iter().map(|s| s.0 + 1).max().unwrap_or(0);
        let len = self.seqs.iter().map(|s| s.1 + s.2).max().unwrap_or(0);
        (slots, len)
    }
}

impl BatchKv {
    /// `slots` sequence slots, the last `host_slots` of them in host memory.
    pub(crate) fn new(layers: usize, slots: usize, host_slots: usize) -> Result<Self> {
        if host_slots > slots {
            bail!("kv cache: {host_slots} host slots of only {slots}");
        }
        Ok(Self {
            layers: vec![None; layers],
            lens: vec![0; slots],
            device_slots: slots - host_slots,
            capacity: 0,
            step: Vec::new(),
            parts: Default::default(),
            scatter: [None, None],
            host: HostKv::new(layers, host_slots),
            host_copied: 0,
        })
    }

    /// Bytes of the host slots' caches copied to the device so far.
    pub(crate) fn host_bytes_copied(&self) -> usize {
        self.host_copied
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
    pub(crate) fn reserve(&mut self, need: usize, hint: usize) -> Result<()> {
        if need > self.capacity {
            let capacity = need.max(hint.min(2 * need)).next_multiple_of(16);
            self.host.grow(capacity)?;
            self.capacity = capacity;
        }
        Ok(())
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
        self.parts = [self.part(false), self.part(true)];
        let placed = self.parts[1].seqs.iter().map(|&(j, n, len)| (j, len, n));
        // The previous step's host rows reach their slots before this step
        // reads them.
        self.host.begin_step(placed.collect())?;
        self.scatter = [None, None];
        Ok(())
    }

    /// Ends the step; a completed one (`done`) advances the slots' lengths,
    /// a failed one leaves them as they were (its rows are unused).
    pub(crate) fn end_step(&mut self, done: bool) {
        if done {
            for &(slot, n) in &self.step {
                self.lens[slot] += n;
            }
        } else {
            self.host.discard();
        }
        self.step.clear();
        self.parts = Default::default();
        self.scatter = [None, None];
    }

    /// The step in flight, if any.
    pub(crate) fn step(&self) -> Option<Step> {
        (!self.step.is_empty()).then(|| self.step.clone())
    }

    /// Writes layer `layer`'s new keys and values `(1, kv_heads, rows,
    /// head_dim)` of the step in flight and returns the parts of the packed
    /// cache to attend over (the device slots', the host slots'), each with
    /// the step's rows it answers and its documents; a part without rows in
    /// this step is left out.
    pub(crate) fn extend(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<Vec<Packed>> {
        let rows = k.dim(2)?;
        let total = self.parts[0].rows.len() + self.parts[1].rows.len();
        if rows != total {
            bail!("kv cache: a batched step of {total} rows got keys of {rows}")
        }
        // Taken out while the layer's tensors are made and written.
        let parts = std::mem::take(&mut self.parts);
        let out = (0..2)
            .filter(|&p| !parts[p].rows.is_empty())
            .map(|p| self.extend_part(layer, (&parts[p], p == 1), (k, v)))
            .collect();
        self.parts = parts;
        out
    }

    /// [`BatchKv::extend`] for one part (`host`: the host slots').
    fn extend_part(
        &mut self,
        layer: usize,
        (part, host): (&Part, bool),
        (k, v): (&Tensor, &Tensor),
    ) -> Result<Packed> {
        let (_, heads, _, d) = k.dims4()?;
        let (at, n) = (part.rows.start, part.rows.len());
        let (pk, pv) = (
            k.narrow(2, at, n)?.contiguous()?,
            v.narrow(2, at, n)?.contiguous()?,
        );
        // The host part comes up as far as this step needs: its slots up to
        // the last one in the step, each to the longest's positions.
        let (slots, cap) = match host {
            false => (self.device_slots, self.capacity),
            true => part.extent(),
        };
        let (ck, cv) = match host {
            false => self.layer(layer, (heads, d), k.dtype(), k.device())?,
            true => {
                let step = KvUpload {
                    slots,
                    len: cap,
                    heads,
                    d,
                    dtype: k.dtype(),
                    device: k.device().clone(),
                    capacity: self.capacity,
                };
                let kv = self.host.upload(layer, &step)?;
                self.host_copied += 2 * kv.0.elem_count() * k.dtype().size_in_bytes();
                kv
            }
        };
        let scatter = &mut self.scatter[host as usize];
        write(&ck, &pk, (&part.seqs, cap), scatter)?;
        write(&cv, &pv, (&part.seqs, cap), scatter)?;
        if host {
            self.host.keep_new_rows(layer, (&pk, &pv))?;
        }
        let (cu_seqlens_q, cu_seqlens_k) = documents(&part.seqs, slots, cap);
        Ok(Packed {
            rows: part.rows.clone(),
            k: ck,
            v: cv,
            cu_seqlens_q,
            cu_seqlens_k,
        })
    }

    /// The step's sequences in the device slots (`host` false) or the host
    /// ones, with their slots counted from the part's first.
    fn part(&self, host: bool) -> Part {
        let (base, mut at) = (if host { self.device_slots } else { 0 }, 0);
        let mut seqs = Vec::new();
        let mut start = None;
        for &(slot, n) in &self.step {
            if (slot >= self.device_slots) == host {
                start.get_or_insert(at);
                seqs.push((slot - base, n, self.lens[slot]));
            }
            at += n;
        }
        let rows: usize = seqs.iter().map(|s| s.1).sum();
        let start = start.unwrap_or(0);
        Part {
            seqs,
            rows: start..start + rows,
        }
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
        let (slots, cap) = (self.device_slots, self.capacity);
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
}

/// Writes a part's rows `new` `(1, heads, rows, d)` into its packed `cache`
/// of `cap` rows a slot: one scatter for the one-row sequences (its indices
/// made at the step's first layer, kept in `scatter`), a copy for each longer
/// one. `seqs`: `(slot, new rows, positions held)` in row order.
fn write(
    cache: &Tensor,
    new: &Tensor,
    (seqs, cap): (&[(usize, usize, usize)], usize),
    scatter: &mut Option<(Tensor, Tensor)>,
) -> Result<()> {
    let (_, heads, _, d) = new.dims4()?;
    if scatter.is_none() {
        let (mut src, mut dst) = (Vec::new(), Vec::new());
        let mut at = 0u32;
        for &(slot, n, len) in seqs {
            if n == 1 {
                src.push(at);
                dst.push((slot * cap + len) as u32);
            }
            at += n as u32;
        }
        let dev = new.device();
        let m = dst.len();
        let dst = Tensor::new(dst, dev)?
            .reshape((1, 1, m, 1))?
            .broadcast_as((1, heads, m, d))?
            .contiguous()?;
        *scatter = Some((Tensor::new(src, dev)?, dst));
    }
    let (src, dst) = scatter.as_ref().expect("made above");
    if dst.dim(2)? > 0 {
        let rows = match dst.dim(2)? == new.dim(2)? {
            true => new.contiguous()?,
            false => new.index_select(src, 2)?,
        };
        cache.scatter_set(dst, &rows, 2)?;
    }
    let mut at = 0;
    for &(slot, n, len) in seqs {
        if n > 1 {
            let rows = new.narrow(2, at, n)?.contiguous()?;
            cache.slice_set(&rows, 2, slot * cap + len)?;
        }
        at += n;
    }
    Ok(())
}

/// A part's documents over its packed cache of `slots` slots of `cap` rows:
/// each sequence's new rows against its slot's positions (cached and new),
/// and between them documents of unused rows without queries.
fn documents(seqs: &[(usize, usize, usize)], slots: usize, cap: usize) -> (Vec<usize>, Vec<usize>) {
    let (mut cq, mut ck) = (vec![0], vec![0]);
    let mut at = 0;
    for &(slot, n, len) in seqs {
        if slot * cap > *ck.last().expect("starts at 0") {
            cq.push(at);
            ck.push(slot * cap);
        }
        at += n;
        cq.push(at);
        ck.push(slot * cap + len + n);
    }
    let end = slots * cap;
    if *ck.last().expect("starts at 0") < end {
        cq.push(at);
        ck.push(end);
    }
    (cq, ck)
}
