//! Where weights come from: in-memory tensors or safetensors files (single files,
//! several shards, or a `model.safetensors.index.json`), read through mmap.
use candle_core::{
    safetensors::MmapedSafetensors, CpuStorage, DType, Device, Result, Shape, Storage, Tensor, Var,
};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use streamer_device::sibling_file;

/// A named collection of tensors the masters are read from.
pub enum WeightSource {
    /// Tensors already in memory (any device); tensors sharing storage are tied.
    Tensors(HashMap<String, Tensor>),
    /// Memory-mapped safetensors files.
    Safetensors(MmapedSafetensors),
}

impl WeightSource {
    /// Opens safetensors files. A path ending in `.json` is read as a Hugging Face
    /// `model.safetensors.index.json` and expands to the shards it names.
    pub fn safetensors<P: AsRef<Path>>(paths: &[P]) -> Result<Self> {
        let files = expand_paths(paths)?;
        // SAFETY: the files are mapped read-only; the caller must not truncate them
        // while the model is being built (the same contract as candle's VarBuilder).
        let st = unsafe { MmapedSafetensors::multi(&files) }.map_err(|e| match e {
            // Candle names the file that failed: name it once.
            candle_core::Error::WithPath { inner, path } => {
                bad_file(&path, format!("cannot read it as safetensors: {inner}"))
            }
            e => bad_file(
                files[0].parent().unwrap_or(Path::new(".")),
                format!("cannot read the safetensors files {files:?}: {e}"),
            ),
        })?;
        Ok(Self::Safetensors(st))
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> BTreeSet<String> {
        match self {
            Self::Tensors(m) => m.keys().cloned().collect(),
            Self::Safetensors(st) => st.tensors().into_iter().map(|(n, _)| n).collect(),
        }
    }

    /// Whether a tensor of that name exists.
    pub fn contains(&self, name: &str) -> bool {
        match self {
            Self::Tensors(m) => m.contains_key(name),
            Self::Safetensors(st) => st.get(name).is_ok(),
        }
    }

    /// The shape and dtype of a tensor, without reading its data.
    pub fn meta(&self, name: &str) -> Result<(Shape, DType)> {
        match self {
            Self::Tensors(m) => {
                let t = m.get(name).ok_or_else(|| missing(name))?;
                Ok((t.shape().clone(), t.dtype()))
            }
            Self::Safetensors(st) => {
                let v = st.get(name).map_err(|_| missing(name))?;
                let dt: DType = v.dtype().try_into()?;
                Ok((Shape::from(v.shape().to_vec()), dt))
            }
        }
    }

    /// Reads a tensor onto the host, contiguous, in `dtype`, with storage of
    /// its own; packed bytes asked for as they are stay shared (they are
    /// never written in place, and a 70B model's would not fit the host
    /// twice).
    pub fn load(&self, name: &str, dtype: DType) -> Result<Tensor> {
        if let Some(t) = self.owned_from_file(name, dtype, false)? {
            return Ok(t);
        }
        let t = self.read(name)?;
        if crate::packed::is_packed(t.dtype()) && dtype == t.dtype() && t.is_contiguous() {
            return Ok(t);
        }
        owned(&t, dtype, false)
    }

    /// Reads a tensor into a new host master in `dtype`: storage of its own
    /// (optimizers write masters in place), never a view into a caller's
    /// tensor, made by one copy spread over the cores; packed bytes held in
    /// a variable are shared instead.
    pub fn load_master(&self, name: &str, dtype: DType) -> Result<Var> {
        if let Some(t) = self.owned_from_file(name, dtype, true)? {
            return Var::from_tensor(&t);
        }
        let t = self.read(name)?;
        if crate::packed::is_packed(t.dtype()) && dtype == t.dtype() && t.is_contiguous() {
            // Never written in place: a variable's packed bytes are shared
            // (`Var::from_tensor` copies only what is not one already).
            return Var::from_tensor(&t);
        }
        let t = owned(&t, dtype, true)?;
        // A variable's tensor becomes a `Var` without another copy.
        Var::from_tensor(&t)
    }

    /// A file's tensor in `dtype` made straight from the mapped bytes in one
    /// pass by all cores (a variable's when `variable`), for the dtypes
    /// [`owned`] converts itself; `None` for other pairs and for in-memory
    /// sources (Candle would read the bytes on one thread first).
    fn owned_from_file(&self, name: &str, dtype: DType, variable: bool) -> Result<Option<Tensor>> {
        use half::{bf16, f16};
        use safetensors::Dtype as F;
        let Self::Safetensors(st) = self else {
            return Ok(None);
        };
        let view = st.get(name)?;
        let w = match view.dtype() {
            F::U8 => 1,
            F::BF16 | F::F16 => 2,
            F::F32 => 4,
            _ => return Ok(None),
        };
        let bytes = view.data();
        let shape = Shape::from(view.shape().to_vec());
        let n = shape.elem_count();
        if bytes.len() != n * w {
            candle_core::bail!(
                "{name}: {} bytes for {n} elements of {:?}",
                bytes.len(),
                view.dtype()
            );
        }
        macro_rules! decode {
            ($f:expr) => {
                par_fill(n, |i| $f(&bytes[i * w..(i + 1) * w]))
            };
        }
        let le2 = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]);
        let le4 = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let t = match (view.dtype(), dtype) {
            (F::U8, DType::U8) => wrap(decode!(|b: &[u8]| b[0]), &shape, variable),
            (F::F32, DType::F32) => wrap(decode!(le4), &shape, variable),
            (F::BF16, DType::BF16) => wrap(decode!(|b| bf16::from_bits(le2(b))), &shape, variable),
            (F::F16, DType::F16) => wrap(decode!(|b| f16::from_bits(le2(b))), &shape, variable),
            (F::BF16, DType::F32) => wrap(
                decode!(|b| bf16::from_bits(le2(b)).to_f32()),
                &shape,
                variable,
            ),
            (F::F16, DType::F32) => wrap(
                decode!(|b| f16::from_bits(le2(b)).to_f32()),
                &shape,
                variable,
            ),
            (F::F32, DType::BF16) => wrap(decode!(|b| bf16::from_f32(le4(b))), &shape, variable),
            (F::F32, DType::F16) => wrap(decode!(|b| f16::from_f32(le4(b))), &shape, variable),
            _ => return Ok(None),
        };
        t.map(Some)
    }

    /// The tensor as the source holds it, on the host: an in-memory CPU
    /// tensor shared, not copied (for a view of the weights; a master needs
    /// [`Self::load_master`]).
    pub fn read(&self, name: &str) -> Result<Tensor> {
        match self {
            Self::Tensors(m) => m
                .get(name)
                .ok_or_else(|| missing(name))?
                .to_device(&Device::Cpu),
            Self::Safetensors(st) => st.load(name, &Device::Cpu),
        }
    }

    /// A key equal for two names that are the same tensor (tied in memory).
    pub(crate) fn identity(&self, name: &str) -> Option<(usize, usize, Vec<usize>)> {
        match self {
            Self::Tensors(m) => {
                let t = m.get(name)?;
                let (s, l) = t.storage_and_layout();
                let key = &*s as *const candle_core::Storage as usize;
                Some((key, l.start_offset(), t.dims().to_vec()))
            }
            Self::Safetensors(_) => None,
        }
    }
}

/// Host tensor `t` in `dtype`, with storage of its own (a variable's when
/// `variable`), converted and copied in one pass by all cores: a fresh
/// allocation's pages are first touched by that pass, which from one thread
/// runs at about 6 GB/s (`scripts/pin-probe.py`), and Candle converts dtypes
/// on one thread; for a big model's masters that was tens of seconds. The
/// conversions are Candle's own (`half`'s rounding), so the values are
/// bit-identical to `to_dtype`; pairs not listed go through `to_dtype`.
fn owned(t: &Tensor, dtype: DType, variable: bool) -> Result<Tensor> {
    let t = t.contiguous()?;
    let (s, l) = t.storage_and_layout();
    let Storage::Cpu(cs) = &*s else {
        candle_core::bail!(
            "a host copy needs a host tensor, found {:?}",
            t.device().location()
        );
    };
    let range = l.start_offset()..l.start_offset() + t.elem_count();
    let shape = t.shape();
    macro_rules! map {
        ($from:ty, $f:expr) => {{
            wrap(
                par_map(&cs.as_slice::<$from>()?[range], $f),
                shape,
                variable,
            )
        }};
    }
    use half::{bf16, f16};
    match (cs, dtype) {
        (CpuStorage::U8(_), DType::U8) => map!(u8, |x| x),
        (CpuStorage::U32(_), DType::U32) => map!(u32, |x| x),
        (CpuStorage::I64(_), DType::I64) => map!(i64, |x| x),
        (CpuStorage::BF16(_), DType::BF16) => map!(bf16, |x| x),
        (CpuStorage::F16(_), DType::F16) => map!(f16, |x| x),
        (CpuStorage::F32(_), DType::F32) => map!(f32, |x| x),
        (CpuStorage::F64(_), DType::F64) => map!(f64, |x| x),
        (CpuStorage::BF16(_), DType::F32) => map!(bf16, bf16::to_f32),
        (CpuStorage::F16(_), DType::F32) => map!(f16, f16::to_f32),
        (CpuStorage::F32(_), DType::BF16) => map!(f32, bf16::from_f32),
        (CpuStorage::F32(_), DType::F16) => map!(f32, f16::from_f32),
        _ if t.dtype() != dtype => {
            let converted = t.to_dtype(dtype)?;
            owned(&converted, dtype, variable)
        }
        _ => candle_core::bail!("no host master of dtype {:?}", t.dtype()),
    }
}

/// `v` as a host tensor of `shape`, a variable's when `variable`.
fn wrap<D: candle_core::WithDType>(v: Vec<D>, shape: &Shape, variable: bool) -> Result<Tensor> {
    match variable {
        true => Var::from_vec(v, shape, &Device::Cpu).map(Var::into_inner),
        false => Tensor::from_vec(v, shape, &Device::Cpu),
    }
}

/// `f` of every element of `src` into a new vector, by all cores.
fn par_map<S, D>(src: &[S], f: impl Fn(S) -> D + Sync) -> Vec<D>
where
    S: Copy + Sync,
    D: Send,
{
    par_fill(src.len(), |i| f(src[i]))
}

/// The vector of `f(0), .., f(n - 1)`, chunks of it by different cores.
fn par_fill<D: Send>(n: usize, f: impl Fn(usize) -> D + Sync) -> Vec<D> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 18;
    let mut out = Vec::with_capacity(n);
    out.spare_capacity_mut()[..n]
        .par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(c, dst)| {
            for (j, d) in dst.iter_mut().enumerate() {
                d.write(f(c * CHUNK + j));
            }
        });
    // SAFETY: the loop above wrote every one of the first `n` elements
    // (chunk `c` holds elements `c * CHUNK ..`).
    unsafe { out.set_len(n) };
    out
}

fn missing(name: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!("no tensor named {name:?} in the weights"))
}

/// Expands `*.index.json` files into the shard files they list (relative to the
/// index's folder), keeping other paths as they are. Every value of the index's
/// `weight_map` must be a plain file name in that folder (no separators, no
/// `..`): an index that names anything else is refused with the offending entry.
pub fn expand_paths<P: AsRef<Path>>(paths: &[P]) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for p in paths {
        let p = p.as_ref();
        if p.extension().is_some_and(|e| e == "json") {
            let text = std::fs::read_to_string(p)
                .map_err(|e| bad_file(p, format!("cannot read the index: {e}")))?;
            out.extend(parse_index(p, &text)?);
        } else {
            out.push(p.to_path_buf());
        }
    }
    if out.is_empty() {
        candle_core::bail!("no safetensors files given");
    }
    Ok(out)
}

/// The shard files named by the text of the index file `index`, sorted and
/// without repeats.
fn parse_index(index: &Path, text: &str) -> Result<Vec<PathBuf>> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| bad_file(index, format!("not valid JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad_file(index, "no \"weight_map\" object".into()))?;
    let what = format!("{}: weight_map", index.display());
    let mut shards = BTreeSet::new();
    for (tensor, shard) in map {
        let Some(name) = shard.as_str() else {
            return Err(bad_file(
                index,
                format!("weight_map: tensor {tensor:?} maps to {shard}, which is not a file name string"),
            ));
        };
        shards.insert(name);
    }
    if shards.is_empty() {
        return Err(bad_file(
            index,
            "weight_map is empty: the index names no shard files".into(),
        ));
    }
    let dir = index.parent().unwrap_or(Path::new("."));
    shards
        .into_iter()
        .map(|s| sibling_file(dir, s, &what))
        .collect()
}

/// A weights file or index that cannot be read or used.
fn bad_file(path: &Path, reason: String) -> candle_core::Error {
    streamer_device::Error::Checkpoint {
        path: path.to_path_buf(),
        reason,
    }
    .into()
}
