//! Saving and loading host-optimizer state as safetensors.
//!
//! A state file holds f32 tensors named by the optimizer (`m.<param>`,
//! `v.<param>` for [`crate::CpuAdamW`], `momentum.<param>` for
//! [`crate::CpuSgd`]), an i64 tensor `last_step` (per param, the step at which
//! it was last updated, 0 if never) and string metadata: `kind`, `num_params`,
//! `step` and the hyper-parameters (f64 written so they read back exactly).

use std::borrow::Cow;

use crate::state::{StateBuf, StateDtype};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use candle_core::{bail, Error, Result};
use safetensors::{Dtype, SafeTensors, View};

/// Checks a list of param names: one per param, unique, non-empty.
pub(crate) fn check_names(what: &str, names: &[String], n: usize) -> Result<()> {
    if names.len() != n {
        bail!("{what}: {} param names given for {n} params", names.len())
    }
    let mut seen = HashSet::new();
    for (i, name) in names.iter().enumerate() {
        if name.is_empty() {
            bail!("{what}: param name {i} is empty")
        }
        if !seen.insert(name.as_str()) {
            bail!("{what}: param name {name:?} (param {i}) is used twice")
        }
    }
    Ok(())
}

/// A tensor to write: borrowed f32 data or owned bytes.
struct Entry<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Cow<'a, [u8]>,
}

impl View for &Entry<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn f32_bytes(data: &[f32]) -> Cow<'_, [u8]> {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: f32 has no padding and no invalid bit patterns as bytes; u8
        // has alignment 1; the byte slice covers exactly the same memory and
        // borrows `data` for its lifetime. On little-endian targets these are
        // the little-endian bytes safetensors stores.
        Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data))
        })
    }
    #[cfg(not(target_endian = "little"))]
    {
        Cow::Owned(data.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// Collects an optimizer's state and writes it atomically.
pub(crate) struct StateWriter<'a> {
    entries: Vec<(String, Entry<'a>)>,
    meta: HashMap<String, String>,
}

impl<'a> StateWriter<'a> {
    pub(crate) fn new(kind: &str, step: usize, last_step: &[usize]) -> Self {
        let mut meta = HashMap::new();
        meta.insert("kind".to_string(), kind.to_string());
        meta.insert("num_params".to_string(), last_step.len().to_string());
        meta.insert("step".to_string(), step.to_string());
        let bytes: Vec<u8> = last_step
            .iter()
            .flat_map(|&s| (s as i64).to_le_bytes())
            .collect();
        let entries = vec![(
            "last_step".to_string(),
            Entry {
                dtype: Dtype::I64,
                shape: vec![last_step.len()],
                data: Cow::Owned(bytes),
            },
        )];
        Self { entries, meta }
    }

    pub(crate) fn meta(&mut self, key: &str, value: f64) {
        // `{:?}` of an f64 is the shortest string that parses back exactly.
        self.meta.insert(key.to_string(), format!("{value:?}"));
    }

    pub(crate) fn meta_str(&mut self, key: &str, value: String) {
        self.meta.insert(key.to_string(), value);
    }

    /// A state buffer in its own dtype (bf16 state is saved as bf16).
    pub(crate) fn state(&mut self, name: String, shape: &[usize], buf: &'a StateBuf) {
        let (dtype, data) = match buf {
            StateBuf::F32(v) => (Dtype::F32, f32_bytes(v)),
            StateBuf::Bf16(v) => (
                Dtype::BF16,
                Cow::Owned(v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()),
            ),
        };
        self.entries.push((
            name,
            Entry {
                dtype,
                shape: shape.to_vec(),
                data,
            },
        ));
    }

    /// Writes to `<path>.tmp`, then renames over `path` ([`streamer_device::replace_atomic`]).
    pub(crate) fn write(self, path: &Path) -> Result<()> {
        let views = self.entries.iter().map(|(n, e)| (n.as_str(), e));
        streamer_device::replace_atomic(path, |tmp| {
            safetensors::serialize_to_file(views, Some(self.meta), tmp)
                .map_err(|e| bad_state(tmp, format!("optimizer state: {e}")))
        })
    }
}

/// A state file read into memory and checked for kind and param count.
pub(crate) struct SavedState {
    path: PathBuf,
    bytes: Vec<u8>,
    meta: HashMap<String, String>,
    /// The `step` metadata.
    pub(crate) step: usize,
    /// The `last_step` tensor.
    pub(crate) last_step: Vec<usize>,
}

/// A state file that cannot be read, written or used: a
/// [`streamer_device::Error::Checkpoint`] naming `path`.
pub(crate) fn bad_state(path: &Path, reason: String) -> Error {
    streamer_device::Error::Checkpoint {
        path: path.to_path_buf(),
        reason,
    }
    .into()
}

impl SavedState {
    /// A problem with this file ([`bad_state`]).
    pub(crate) fn bad(&self, reason: String) -> Error {
        bad_state(&self.path, reason)
    }

    /// `r`, with an error that is not typed yet (a hyper-parameter the file
    /// holds, checked elsewhere) turned into a problem with this file.
    pub(crate) fn blame<T>(&self, r: Result<T>) -> Result<T> {
        r.map_err(|e| match streamer_device::Error::find(&e) {
            Some(_) => e,
            None => self.bad(format!("optimizer state: {e}")),
        })
    }

    pub(crate) fn read(path: &Path, kind: &str, num_params: usize) -> Result<Self> {
        let bytes = std::fs::read(path)
            .map_err(|e| bad_state(path, format!("cannot read the optimizer state: {e}")))?;
        let (_, metadata) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| bad_state(path, format!("cannot parse the optimizer state: {e}")))?;
        let meta = metadata.metadata().clone().unwrap_or_default();
        let mut s = Self {
            path: path.to_path_buf(),
            bytes,
            meta,
            step: 0,
            last_step: Vec::new(),
        };
        let found = s.meta_str("kind")?;
        if found != kind {
            return Err(s.bad(format!("optimizer state is for {found}, not {kind}")));
        }
        let n: usize = s.parse("num_params")?;
        if n != num_params {
            return Err(s.bad(format!(
                "optimizer state has {n} params, the optimizer {num_params}"
            )));
        }
        s.step = s.parse("step")?;
        if s.step > i64::MAX as usize {
            return Err(s.bad(format!(
                "optimizer state: metadata \"step\" = {} is beyond {} (steps are counted in i64)",
                s.step,
                i64::MAX
            )));
        }
        let st = s.tensors()?;
        let view = s.view(&st, "last_step", Dtype::I64, &[num_params])?;
        let last_step: Vec<usize> = view
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
            .map(|x| usize::try_from(x).unwrap_or(usize::MAX))
            .collect();
        if let Some(bad) = last_step.iter().position(|&x| x > s.step) {
            return Err(s.bad(format!(
                "optimizer state: last_step[{bad}] = {} is beyond step {}",
                last_step[bad], s.step
            )));
        }
        s.last_step = last_step;
        Ok(s)
    }

    /// The parsed tensors (parse once, then look up many).
    pub(crate) fn tensors(&self) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(&self.bytes)
            .map_err(|e| self.bad(format!("cannot parse the optimizer state: {e}")))
    }

    fn view<'b>(
        &self,
        st: &SafeTensors<'b>,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
    ) -> Result<&'b [u8]> {
        let view = st
            .tensor(name)
            .map_err(|e| self.bad(format!("optimizer state: tensor {name:?}: {e}")))?;
        if view.dtype() != dtype || view.shape() != shape {
            return Err(self.bad(format!(
                "optimizer state: tensor {name:?} is {:?} {:?}, expected {dtype:?} {shape:?}",
                view.dtype(),
                view.shape()
            )));
        }
        Ok(view.data())
    }

    /// The metadata string `key`.
    pub(crate) fn meta_str(&self, key: &str) -> Result<String> {
        match self.meta.get(key) {
            Some(v) => Ok(v.clone()),
            None => Err(self.bad(format!("optimizer state: metadata {key:?} is missing"))),
        }
    }

    fn parse<T: std::str::FromStr>(&self, key: &str) -> Result<T> {
        let s = self.meta_str(key)?;
        match s.parse() {
            Ok(v) => Ok(v),
            Err(_) => Err(self.bad(format!(
                "optimizer state: metadata {key:?} = {s:?} does not parse"
            ))),
        }
    }

    /// The metadata `key` as a finite f64 (hyper-parameters are never NaN or
    /// infinite).
    pub(crate) fn meta_f64(&self, key: &str) -> Result<f64> {
        let v: f64 = self.parse(key)?;
        if !v.is_finite() {
            return Err(self.bad(format!(
                "optimizer state: metadata {key:?} = {v} is not a finite number"
            )));
        }
        Ok(v)
    }

    /// Whether the file holds a tensor `name`.
    pub(crate) fn has_tensor(st: &SafeTensors<'_>, name: &str) -> bool {
        st.names().contains(&name)
    }

    /// The f32 tensor `name`, which must have `shape`.
    pub(crate) fn f32_tensor(
        &self,
        st: &SafeTensors<'_>,
        name: &str,
        shape: &[usize],
    ) -> Result<Vec<f32>> {
        let data = self.view(st, name, Dtype::F32, shape)?;
        Ok(data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// A state buffer saved as f32 or bf16, as `dtype` (f32 saved state
    /// loads into bf16 state rounded to nearest; bf16 into f32 exactly).
    pub(crate) fn state_tensor(
        &self,
        st: &SafeTensors<'_>,
        name: &str,
        shape: &[usize],
        dtype: StateDtype,
    ) -> Result<StateBuf> {
        let saved_bf16 = st.tensor(name).is_ok_and(|v| v.dtype() == Dtype::BF16);
        if !saved_bf16 {
            return Ok(StateBuf::from_f32(dtype, self.f32_tensor(st, name, shape)?));
        }
        let data = self.view(st, name, Dtype::BF16, shape)?;
        let v = data
            .chunks_exact(2)
            .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])));
        Ok(match dtype {
            StateDtype::Bf16 => StateBuf::Bf16(v.collect()),
            StateDtype::F32 => StateBuf::F32(v.map(|x| x.to_f32()).collect()),
        })
    }
}
