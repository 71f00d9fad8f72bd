//! Where weights come from: in-memory tensors or safetensors files (single files,
//! several shards, or a `model.safetensors.index.json`), read through mmap.
use candle_core::{safetensors::MmapedSafetensors, DType, Device, Result, Shape, Tensor};
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

    /// Reads a tensor onto the host, contiguous, in `dtype`.
    pub fn load(&self, name: &str, dtype: DType) -> Result<Tensor> {
        let t = match self {
            Self::Tensors(m) => m
                .get(name)
                .ok_or_else(|| missing(name))?
                .to_device(&Device::Cpu)?,
            Self::Safetensors(st) => st.load(name, &Device::Cpu)?,
        };
        if crate::packed::is_packed(t.dtype()) && dtype == t.dtype() && t.is_contiguous() {
            // Packed bytes are never written in place: share them (a 70B
            // model's would not fit the host twice).
            return Ok(t);
        }
        let t = if t.dtype() == dtype {
            t
        } else {
            t.to_dtype(dtype)?
        };
        // Masters are written in place by optimizers: give each its own storage,
        // never a view into a caller's tensor.
        t.contiguous()?.copy()
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
