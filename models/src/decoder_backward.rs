//! The decoder layer's training forward and backward written out, so streamed
//! training runs them without Candle autograd.
//!
//! Under autograd every intermediate gradient is added into a fresh zero
//! tensor, the block output needs a surrogate loss, and each op's backward is
//! a chain of generic element-wise kernels: on the H200 a `1b` layer spent
//! three quarters of its GPU time outside the GEMMs and attention
//! (`benches/results/lm-layer-ncu-h200-before.txt`). Here each gradient is produced once:
//!
//! - forward keeps `x`, the second norm's output, the rotated `q`, `k`, `v`,
//!   the attention output (once, in cqsa's head-major layout: its row-major
//!   copy for the output projection's weight gradient is remade in backward)
//!   and its log-sum-exp, the residual `x_mid`, and `gate` and `up` (and the
//!   call's rotary tables). Two tensors backward needs are made again there
//!   instead, each one element-wise pass with the forward's own kernel (so
//!   the same bits): `silu(gate) * up`, for the down projection's weight
//!   gradient, and the first norm's output, for q/k/v's. At Llama 3.1 8B's
//!   shapes they were 27 % of what a layer kept;
//! - backward is the GEMMs of each projection (input and weight gradient),
//!   cqsa's attention backward from the kept log-sum-exp, RMSNorm's closed
//!   form, RoPE's inverse rotation and SwiGLU's derivative.
//!
//! On CUDA the SwiGLU product and its derivative, the residual add with the
//! norm after it, and the RMSNorm gradients with the residual's gradient
//! added are fused kernels (`kernels/src/decoder.cu`, one pass each);
//! elsewhere Candle ops in f32.
//!
//! Sums of gradients from two branches (residuals, q/k/v into the norm) are
//! single adds. Weight gradients are in the weights' dtype, as autograd gives,
//! and only for the projections' weights that are variables (or computed from
//! one): a frozen base's are never consumed, so their GEMMs are skipped.
//!
//! Every family is covered: q/k/v/o biases (their gradients are the output
//! gradients summed over rows, in f32) and Qwen3's per-head q/k RMSNorms
//! (forward keeps the projections before them; backward runs RMSNorm's closed
//! form over `(rows * heads, head_dim)` after the inverse rotation).
//!
//! LoRA adapters too: each adapted projection adds `s (m x) A^T B^T` (`m` the
//! dropout's scaled mask, drawn as the autograd forward draws it); forward
//! keeps `A`, `B`, `u = (m x) A^T` and the mask's kept elements (a byte
//! each), and backward returns the gradients of `A` and `B` keyed by the
//! extras that carried them.
use crate::llama::DecoderLayer;
use crate::lora::{LoraLayout, LoraSaved};
use crate::ops::fused::{add_rms_norm, norm_backward, swiglu};
use candle_core::{bail, DType, Result, Shape, Tensor};
use streamer_core::{ManualBackward, SavedActivations};

/// `x W^T` for a row-major `x (rows, in)` and `w (out, in)`.
///
/// Weights are used detached throughout this file: in a backward they are
/// autograd variables (the pool's), and every product with one would record a
/// Candle graph node holding its inputs. The input gradient handed to the
/// previous layer would then keep every layer's backward temporaries alive
/// until the end of the step (84 GiB at `1b`, 16 x 2048 tokens, on the H200).
fn mm_t(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.matmul(&w.detach().t()?)
}

/// The activations every layer keeps, in order (see the module docs); a layer
/// with q/k norms keeps the normalised projections' inputs after them.
const SAVED: usize = 12;

/// Elements a layer keeps per row of its input (the module docs' list; its
/// softmax statistics, in f32, apart): `hidden` wide (x, x_mid, h2), `q`
/// wide (q, o), `kv` wide (k, v), `m` wide (gate, up), and with q/k norms the
/// projections before them. The decoder layer's `saved_bytes` and the device
/// plan count it.
pub(crate) fn kept_elems_per_row(
    hidden: usize,
    (q, kv): (usize, usize),
    m: usize,
    qk_norm: bool,
) -> usize {
    let pre = if qk_norm { q + kv } else { 0 };
    3 * hidden + 2 * q + 2 * kv + 2 * m + pre
}

/// `x W^T + b` with the bias (when the layer has one) broadcast over rows.
fn linear(x: &Tensor, l: &candle_nn::Linear) -> Result<Tensor> {
    let y = mm_t(x, l.weight())?;
    match l.bias() {
        Some(b) => y.broadcast_add(&b.detach()),
        None => Ok(y),
    }
}

/// `(bias, d bias)` for a layer's bias: the output gradient summed over rows
/// (in f32, then the bias's dtype).
fn bias_grad(l: &candle_nn::Linear, g: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
    let Some(b) = l.bias().filter(|b| wants_grad(b)) else {
        return Ok(None);
    };
    let db = g.to_dtype(DType::F32)?.sum(0)?.to_dtype(b.dtype())?;
    Ok(Some((b.clone(), db)))
}

impl DecoderLayer {
    /// The input norm's output `h1`, the same kernel in forward and backward
    /// (so backward's is the forward's, bit for bit).
    fn input_norm(&self, x2: &Tensor) -> Result<Tensor> {
        let n1 = &self.input_layernorm;
        candle_nn::ops::rms_norm(x2, &n1.weight.detach().contiguous()?, n1.eps as f32)
    }

    fn rope_tables<'a>(&self, extras: &'a [Tensor]) -> Result<(&'a Tensor, &'a Tensor)> {
        match extras {
            [cos, sin] => Ok((cos, sin)),
            _ => bail!(
                "a Llama decoder layer trains with extras [cos, sin] (no kv cache), got {} tensors",
                extras.len()
            ),
        }
    }

    /// `(b, heads, n, d)` back to `(b * n, heads * d)`.
    fn rows(&self, t: &Tensor, b: usize, n: usize) -> Result<Tensor> {
        let heads = t.dim(1)?;
        t.transpose(1, 2)?
            .reshape((b * n, heads * self.head_dim))?
            .contiguous()
    }

    /// A `(b * n, heads * d)` projection with each head RMS-normalised by
    /// `norm` when given (Qwen3's q/k norms), still in rows.
    fn normed_rows(&self, p: &Tensor, norm: Option<&crate::llama::RmsNorm>) -> Result<Tensor> {
        let Some(nm) = norm else {
            return Ok(p.clone());
        };
        let (rows, width) = p.dims2()?;
        let heads = width / self.head_dim;
        let flat = p.reshape((rows * heads, self.head_dim))?;
        candle_nn::ops::rms_norm(&flat, &nm.weight.detach().contiguous()?, nm.eps as f32)?
            .reshape((rows, width))
    }

    /// A `(b * n, heads * d)` projection (normalised as [`Self::normed_rows`])
    /// rotated into `(b, heads, n, d)`: one pass on CUDA, no transpose copy.
    fn rotated_heads(
        &self,
        p: &Tensor,
        (b, n): (usize, usize),
        norm: Option<&crate::llama::RmsNorm>,
        (cos, sin): (&Tensor, &Tensor),
    ) -> Result<Tensor> {
        let heads = p.dim(1)? / self.head_dim;
        crate::ops::fused::rope_into_heads(&self.normed_rows(p, norm)?, (b, n, heads), cos, sin)
    }

    /// The q/k norms, if the layer has them.
    fn qk_norms(
        &self,
    ) -> (
        Option<&crate::llama::RmsNorm>,
        Option<&crate::llama::RmsNorm>,
    ) {
        match &self.qk_norm {
            Some((q, k)) => (Some(q), Some(k)),
            None => (None, None),
        }
    }

    /// Backward of `x_mid -> y` (post-attention norm, SwiGLU MLP, residual):
    /// `d x_mid`, the MLP's and the norm's gradients pushed to `grads`.
    fn mlp_backward(
        &self,
        dy: Tensor,
        [x_mid, h2, gate, up]: [Tensor; 4],
        lora: &LoraTerms,
        grads: &mut Vec<(Tensor, Tensor)>,
    ) -> Result<Tensor> {
        // y = x_mid + act W_down^T, act made again as the forward made it.
        let act = swiglu(&gate, &up)?;
        let (d_act, gw) = linear_grads(&dy, &act, self.down_proj.weight())?;
        grads.extend(gw);
        let d_act = lora.add(6, &act, &dy, d_act, grads)?;
        let (d_gate, d_up) = swiglu_backward(&d_act, &gate, &up)?;
        let (dh2_g, gw) = linear_grads(&d_gate, &h2, self.gate_proj.weight())?;
        grads.extend(gw);
        let dh2_g = lora.add(4, &h2, &d_gate, dh2_g, grads)?;
        let (dh2_u, gw) = linear_grads(&d_up, &h2, self.up_proj.weight())?;
        grads.extend(gw);
        let dh2_u = lora.add(5, &h2, &d_up, dh2_u, grads)?;
        // d x_mid = dy (the residual) + the norm's input gradient, one pass.
        let n2 = &self.post_attention_layernorm;
        let dh2 = (dh2_g + dh2_u)?;
        let (d_mid, dw2) = norm_backward(&x_mid, &n2.weight.detach(), &dh2, Some(&dy), n2.eps)?;
        grads.push((n2.weight.clone(), dw2));
        Ok(d_mid)
    }

    /// A rotated (and maybe normalised) projection's gradient `(b, heads, n,
    /// d)` back to its GEMM output `(b * n, heads * d)`: inverse rotation, then
    /// the per-head norm's backward (its weight gradient pushed) from the kept
    /// projection `pre`.
    fn unrotate(
        &self,
        d: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        norm: Option<(&crate::llama::RmsNorm, &Tensor)>,
        grads: &mut Vec<(Tensor, Tensor)>,
    ) -> Result<Tensor> {
        let (b, n) = (d.dim(0)?, d.dim(2)?);
        let d = crate::ops::fused::rope_into_rows(d, cos, sin)?;
        let Some((nm, pre)) = norm else { return Ok(d) };
        let width = d.dim(1)?;
        let rows = (b * n * width / self.head_dim, self.head_dim);
        let (dx, dw) = norm_backward(
            &pre.reshape(rows)?,
            &nm.weight.detach(),
            &d.reshape(rows)?,
            None,
            nm.eps,
        )?;
        grads.push((nm.weight.clone(), dw));
        dx.reshape((b * n, width))
    }
}

impl DecoderLayer {
    /// The training forward (see the module docs): the output when `output`,
    /// and what backward needs.
    fn train_forward(
        &self,
        x: &Tensor,
        extras: &[Tensor],
        output: bool,
    ) -> Result<(Option<Tensor>, SavedActivations)> {
        let (own, lora) = self.split_lora(extras)?;
        let (cos, sin) = self.rope_tables(own)?;
        let (b, n, hidden) = x.dims3()?;
        let x2 = x.reshape((b * n, hidden))?.contiguous()?;
        // Projection `t` of LORA_TARGETS from its base output, with its
        // adapter's term when it has one (in forward_kv's order, so dropout
        // masks are drawn as there).
        let mut kept: Vec<LoraSaved> = Vec::new();
        let mut proj = |t: usize, h: &Tensor, base: Tensor| -> Result<Tensor> {
            let Some((layout, ab)) = &lora else {
                return Ok(base);
            };
            let (y, s) = layout.apply_saved(t, h, base, ab)?;
            kept.extend(s);
            Ok(y)
        };
        let h1 = self.input_norm(&x2)?;
        let (qn, kn) = self.qk_norms();
        let q_pre = proj(0, &h1, linear(&h1, &self.q_proj)?)?;
        let k_pre = proj(1, &h1, linear(&h1, &self.k_proj)?)?;
        let q = self.rotated_heads(&q_pre, (b, n), qn, (cos, sin))?;
        let k = self.rotated_heads(&k_pre, (b, n), kn, (cos, sin))?;
        let v = proj(2, &h1, linear(&h1, &self.v_proj)?)?;
        let v = self.heads(v, b, n, self.kv_heads)?;
        let (o, lse) = cqsa::attention_forward_with(&q, &k, &v, &self.scores())?;
        let o2 = self.rows(&o, b, n)?;
        let attn = proj(3, &o2, linear(&o2, &self.o_proj)?)?;
        // x_mid = x + attn and its norm h2 in one pass (fused on CUDA).
        let n2 = &self.post_attention_layernorm;
        let (x_mid, h2) = add_rms_norm(&x2, &attn, &n2.weight.detach(), n2.eps)?;
        drop(attn);
        let gate = proj(4, &h2, mm_t(&h2, self.gate_proj.weight())?)?;
        let up = proj(5, &h2, mm_t(&h2, self.up_proj.weight())?)?;
        // The output (skipped for a recompute, unless down_proj's adapter must
        // save its part).
        let down_adapted = lora.as_ref().is_some_and(|(l, _)| l.targets.contains(&6));
        let y = if output || down_adapted {
            let act = swiglu(&gate, &up)?;
            Some((&x_mid + proj(6, &act, mm_t(&act, self.down_proj.weight())?)?)?)
        } else {
            None
        };
        let (cos, sin) = (cos.clone(), sin.clone());
        drop(o2);
        drop(h1);
        let mut saved = vec![x2, q, k, v, o, lse, x_mid, h2, gate, up, cos, sin];
        if self.qk_norm.is_some() {
            saved.extend([q_pre, k_pre]);
        }
        // The adapters' part last: A, B, u (and the kept elements) per
        // adapted target.
        for k in kept {
            saved.extend([k.a, k.b, k.u]);
            saved.extend(k.keep);
        }
        let y = y.map(|y| y.reshape((b, n, hidden))).transpose()?;
        Ok((y, SavedActivations(saved)))
    }
}

impl ManualBackward for DecoderLayer {
    fn forward_train(&self, x: &Tensor, extras: &[Tensor]) -> Result<(Tensor, SavedActivations)> {
        let (y, saved) = self.train_forward(x, extras, true)?;
        let y = y.ok_or_else(|| candle_core::Error::Msg("decoder layer: no output".into()))?;
        Ok((y, saved))
    }

    /// Backward never reads the layer's output: the recompute skips the down
    /// projection (a seventh of the layer's GEMM FLOPs at Llama's shapes)
    /// unless an adapter on it must save its part.
    fn recompute_ctx(
        &self,
        x: &Tensor,
        extras: &[Tensor],
        _ctx: &streamer_core::BlockCtx,
    ) -> Result<SavedActivations> {
        Ok(self.train_forward(x, extras, false)?.1)
    }

    fn saved_bytes(&self, x: &Shape, dtype: DType) -> usize {
        let hidden = x.dims().last().copied().unwrap_or(1).max(1);
        let rows = x.elem_count() / hidden;
        let (q, kv) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
        let m = self.gate_proj.weight().dim(0).unwrap_or(0);
        // lse in f32 apart.
        let per_row = kept_elems_per_row(hidden, (q, kv), m, self.qk_norm.is_some());
        let (lora, masks) = self.lora_elems(rows);
        (rows * per_row + lora) * dtype.size_in_bytes() + masks + rows * self.heads * 4
    }

    fn backward(
        &self,
        saved: SavedActivations,
        grad: &Tensor,
    ) -> Result<(Tensor, Vec<(Tensor, Tensor)>)> {
        let mut acts = saved.0;
        let lora = self.lora_terms(&mut acts)?;
        let want = SAVED + if self.qk_norm.is_some() { 2 } else { 0 };
        if acts.len() != want {
            bail!(
                "decoder layer: backward needs the {want} saved activations of its forward, got {}",
                acts.len()
            );
        }
        // The projections before the q/k norms come last (None without norms).
        let pre = if self.qk_norm.is_some() {
            let k_pre = acts.pop();
            (acts.pop(), k_pre)
        } else {
            (None, None)
        };
        let acts: [Tensor; SAVED] = acts
            .try_into()
            .map_err(|_| candle_core::Error::Msg("decoder layer: saved activations".into()))?;
        let [x2, q, k, v, o, lse, x_mid, h2, gate, up, cos, sin] = acts;
        let (b, n) = (q.dim(0)?, q.dim(2)?);
        let hidden = x2.dim(1)?;
        if grad.dims() != [b, n, hidden] || grad.dtype() != x2.dtype() {
            bail!(
                "decoder layer: output gradient {:?} {:?} does not match the forward's output [{b}, {n}, {hidden}] {:?}",
                grad.dims(),
                grad.dtype(),
                x2.dtype()
            );
        }
        let dy = grad.reshape((b * n, hidden))?.contiguous()?;
        let mut grads = Vec::with_capacity(16);
        let d_mid = self.mlp_backward(dy, [x_mid, h2, gate, up], &lora, &mut grads)?;
        // x_mid = x + o2 W_o^T (+ b_o)
        let o2 = self.rows(&o, b, n)?;
        let (d_o2, gw) = linear_grads(&d_mid, &o2, self.o_proj.weight())?;
        let d_o2 = lora.add(3, &o2, &d_mid, d_o2, &mut grads)?;
        drop(o2);
        grads.extend(gw);
        grads.extend(bias_grad(&self.o_proj, &d_mid)?);
        let d_o = self.heads(d_o2, b, n, self.heads)?;
        let (dq, dk, dv) =
            cqsa::attention_backward_with(&q, &k, &v, &o, &d_o, &lse, &self.scores())?;
        drop((o, lse));
        let (qn, kn) = self.qk_norms();
        let tables = (&cos, &sin);
        let dq = self.unrotate(&dq, tables, qn.zip(pre.0.as_ref()), &mut grads)?;
        let dk = self.unrotate(&dk, tables, kn.zip(pre.1.as_ref()), &mut grads)?;
        let dv = self.rows(&dv, b, n)?;
        let ds = [&dq, &dk, &dv];
        let projs = [&self.q_proj, &self.k_proj, &self.v_proj];
        let mut dh1 = qkv_input_grad(ds, projs.map(|l| l.weight()))?;
        // The q/k/v inputs, made again as the forward made them.
        let h1 = self.input_norm(&x2)?;
        for (t, (d, l)) in ds.into_iter().zip(projs).enumerate() {
            grads.extend(weight_grad(d, &h1, l.weight())?);
            grads.extend(bias_grad(l, d)?);
            dh1 = lora.add(t, &h1, d, dh1, &mut grads)?;
        }
        // dx = d_mid (the residual) + the input norm's gradient, one pass.
        let n1 = &self.input_layernorm;
        let (dx, dw1) = norm_backward(&x2, &n1.weight.detach(), &dh1, Some(&d_mid), n1.eps)?;
        drop(d_mid);
        grads.push((n1.weight.clone(), dw1));
        Ok((dx.reshape((b, n, hidden))?, grads))
    }
}

/// The adapters' saved forward, by target (`LORA_TARGETS` order), with
/// their layout; empty without adapters.
struct LoraTerms {
    layout: Option<LoraLayout>,
    saved: [Option<LoraSaved>; 7],
}

impl LoraTerms {
    /// `dx` plus adapter `t`'s term of the input gradient (its `A`, `B`
    /// gradients pushed), or `dx` itself when `t` has no adapter.
    fn add(
        &self,
        t: usize,
        x: &Tensor,
        dy: &Tensor,
        dx: Tensor,
        grads: &mut Vec<(Tensor, Tensor)>,
    ) -> Result<Tensor> {
        match (&self.layout, &self.saved[t]) {
            (Some(layout), Some(s)) => dx + layout.backward_term(s, x, dy, grads)?,
            _ => Ok(dx),
        }
    }
}

impl DecoderLayer {
    /// Elements the adapters add to the saved activations: `u` (rows x r)
    /// per target, and bytes: with dropout, its kept elements (rows x the
    /// target's inputs, u8).
    fn lora_elems(&self, rows: usize) -> (usize, usize) {
        let Ok(Some((layout, r))) = self.lora_layout() else {
            return (0, 0);
        };
        let hidden = self.q_proj.weight().dim(1).unwrap_or(0);
        let (attn, m) = (
            self.heads * self.head_dim,
            self.gate_proj.weight().dim(0).unwrap_or(0),
        );
        let inputs = |t: usize| match t {
            3 => attn,
            6 => m,
            _ => hidden,
        };
        let masks: usize = if layout.drops() {
            layout.targets.iter().map(|&t| inputs(t)).sum()
        } else {
            0
        };
        (rows * r * layout.targets.len(), rows * masks)
    }

    /// Takes the adapters' part off the end of the saved activations (see
    /// `forward_train`): `A, B, u` and, with dropout, the mask, per target.
    fn lora_terms(&self, acts: &mut Vec<Tensor>) -> Result<LoraTerms> {
        let mut saved: [Option<LoraSaved>; 7] = Default::default();
        let Some((layout, _)) = self.lora_layout()? else {
            return Ok(LoraTerms {
                layout: None,
                saved,
            });
        };
        let per = if layout.drops() { 4 } else { 3 };
        let len = per * layout.targets.len();
        let Some(start) = acts.len().checked_sub(len) else {
            bail!(
                "decoder layer: backward needs {len} saved adapter tensors, got {}",
                acts.len()
            );
        };
        let mut tail = acts.split_off(start).into_iter();
        for &t in &layout.targets {
            let mut next = || {
                tail.next()
                    .ok_or_else(|| candle_core::Error::Msg("decoder layer: adapter tensors".into()))
            };
            let (a, b, u) = (next()?, next()?, next()?);
            let keep = if per == 4 { Some(next()?) } else { None };
            saved[t] = Some(LoraSaved { a, b, u, keep });
        }
        Ok(LoraTerms {
            layout: Some(layout),
            saved,
        })
    }
}

/// For `y = a W^T`: `dL/da = g W` and, when [`wants_grad`]`(W)`,
/// `(W, dL/dW = g^T a)`.
fn linear_grads(g: &Tensor, a: &Tensor, w: &Tensor) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
    Ok((g.matmul(&w.detach())?, weight_grad(g, a, w)?))
}

/// `(w, g^T a)`: the gradient of the weight of `y = a w^T`, when anything can
/// use one (see [`wants_grad`]).
fn weight_grad(g: &Tensor, a: &Tensor, w: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
    if !wants_grad(w) {
        return Ok(None);
    }
    Ok(Some((w.clone(), g.t()?.matmul(a)?)))
}

/// q, k and v's part of the layer's input gradient, `dq Wq + dk Wk + dv Wv`,
/// as one GEMM over the concatenated gradients and weights (K = q+k+v): at the
/// `1b` and `3b` shapes on the H200 that GEMM is 1.8-2.3x faster than three
/// and their sums (`benches/results/gemm-h200.json`, the q/k/v rows). The
/// concatenations cost one pass over the gradients and over the weights.
fn qkv_input_grad(d: [&Tensor; 3], w: [&Tensor; 3]) -> Result<Tensor> {
    let g = Tensor::cat(&d, 1)?;
    let w = Tensor::cat(&[w[0].detach(), w[1].detach(), w[2].detach()], 0)?;
    g.matmul(&w)
}

/// Whether anything can use a gradient of weight `w`: a variable, or a
/// tensor computed from one, as Candle autograd would give one to. A constant
/// (a frozen streamed weight is a plain view of a pool slot) gets none, which
/// skips its weight-gradient GEMM: a third of the layer's backward GEMMs on
/// a LoRA fine-tune's frozen base.
fn wants_grad(w: &Tensor) -> bool {
    w.is_variable() || w.track_op()
}

/// For `act = silu(gate) * up`: `(d gate, d up)`, the derivative in f32:
/// `silu'(z) = s (1 + z (1 - s))` with `s = sigmoid(z)`.
fn swiglu_backward(d_act: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if d_act.device().is_cuda() {
        return crate::ops::decoder::swiglu_backward(d_act, gate, up);
    }
    let dt = d_act.dtype();
    let (da, z, u) = (
        d_act.to_dtype(DType::F32)?,
        gate.to_dtype(DType::F32)?,
        up.to_dtype(DType::F32)?,
    );
    let s = candle_nn::ops::sigmoid(&z)?;
    let silu = (&z * &s)?;
    let dsilu = (&s * (s.affine(-1.0, 1.0)? * &z)?.affine(1.0, 1.0)?)?;
    let d_gate = ((&da * u)? * dsilu)?;
    let d_up = (da * silu)?;
    Ok((d_gate.to_dtype(dt)?, d_up.to_dtype(dt)?))
}
