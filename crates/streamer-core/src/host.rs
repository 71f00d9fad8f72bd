//! Host masters: one host tensor per distinct weight, in the master dtype,
//! allocated once, page-locked in place when the pool streams to a CUDA device.
use crate::source::WeightSource;
use candle_core::{DType, Result, Shape, Var};
use std::collections::HashMap;

/// One distinct weight on the host.
pub struct Master {
    // Declared first so it is dropped first: the pages are unregistered before
    // the memory they belong to can be freed.
    #[cfg(feature = "cuda")]
    pub(crate) pin: Option<crate::pages::PinnedRegion>,
    /// Canonical name (the first name it was found under).
    pub name: String,
    /// The host tensor, contiguous, in the master dtype. Optimizers update it in place.
    pub var: Var,
    /// Every name it is known by (more than one when tied).
    pub names: Vec<String>,
}

impl Master {
    /// The master's shape.
    pub fn shape(&self) -> &Shape {
        self.var.shape()
    }

    /// Whether the master is packed bytes (a quantized weight, never
    /// trainable; see `is_packed`).
    pub fn is_packed(&self) -> bool {
        crate::packed::is_packed(self.var.dtype())
    }

    /// Elements of a slot of `dtype` the master occupies.
    pub fn slot_elems(&self, dtype: DType) -> usize {
        match self.is_packed() {
            true => crate::packed::packed_elems(self.bytes(), dtype),
            false => self.var.elem_count(),
        }
    }

    /// Bytes of the master as stored on the host.
    pub fn bytes(&self) -> usize {
        self.var.elem_count() * self.var.dtype().size_in_bytes()
    }

    /// Whether the host memory is page-locked (copies from it are asynchronous DMA).
    pub fn is_pinned(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.pin.is_some()
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }
}

/// All masters of a model, found by name.
#[derive(Default)]
pub struct HostMasters {
    pub(crate) masters: Vec<Master>,
    by_name: HashMap<String, usize>,
    by_identity: HashMap<(usize, usize, Vec<usize>), usize>,
    aliases: HashMap<String, String>,
}

impl HostMasters {
    pub(crate) fn new(aliases: &[(String, String)]) -> Self {
        Self {
            aliases: aliases.iter().cloned().collect(),
            ..Default::default()
        }
    }

    /// Number of distinct masters.
    pub fn len(&self) -> usize {
        self.masters.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.masters.is_empty()
    }

    /// The masters, in load order.
    pub fn iter(&self) -> impl Iterator<Item = &Master> {
        self.masters.iter()
    }

    /// A master by index.
    pub fn get(&self, i: usize) -> &Master {
        &self.masters[i]
    }

    /// The index of the master a name resolves to, if loaded.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// Total host bytes of the masters.
    pub fn bytes(&self) -> usize {
        self.masters.iter().map(Master::bytes).sum()
    }

    /// Finds or loads the master for `name`, resolving ties (aliases, shared
    /// in-memory storage) so a tied weight is stored once.
    pub(crate) fn resolve(
        &mut self,
        src: &WeightSource,
        name: &str,
        dtype: DType,
    ) -> Result<usize> {
        if let Some(&i) = self.by_name.get(name) {
            return Ok(i);
        }
        let canonical = self.aliases.get(name).cloned();
        let idx = if let Some(c) = canonical {
            self.resolve(src, &c, dtype)?
        } else if let Some(&i) = src
            .identity(name)
            .as_ref()
            .and_then(|k| self.by_identity.get(k))
        {
            i
        } else {
            // Packed (u8) weights stay bytes; everything else is a master
            // in the master dtype.
            let dtype = match src.meta(name)?.1 {
                DType::U8 => DType::U8,
                _ => dtype,
            };
            let var = src.load_master(name, dtype)?;
            if let Some(k) = src.identity(name) {
                self.by_identity.insert(k, self.masters.len());
            }
            self.masters.push(Master {
                name: name.to_string(),
                var,
                names: Vec::new(),
                #[cfg(feature = "cuda")]
                pin: None,
            });
            self.masters.len() - 1
        };
        self.masters[idx].names.push(name.to_string());
        self.by_name.insert(name.to_string(), idx);
        Ok(idx)
    }

    /// Page-locks every master in place (registers its pages with the driver) so
    /// copies from it are asynchronous DMA at full bandwidth. The masters are
    /// registered on all cores at once: the kernel pins each page in turn, and
    /// for an 8B model's 32 GB of f32 masters one thread took most of a minute.
    #[cfg(feature = "cuda")]
    pub(crate) fn pin(&mut self, ctx: &std::sync::Arc<cudarc::driver::CudaContext>) -> Result<()> {
        use rayon::prelude::*;
        self.masters
            .par_iter_mut()
            .filter(|m| m.pin.is_none())
            .try_for_each(|m| {
                let (ptr, bytes) = host_bytes(m.var.as_tensor())?;
                // SAFETY: the range is the master's own storage, which the
                // master's `var` keeps alive; `pin` is declared before `var`, so
                // it is unregistered before the memory can be freed.
                m.pin =
                    unsafe { crate::pages::PinnedRegion::register(ctx, ptr as *mut u8, bytes)? };
                Ok(())
            })
    }
}

/// A host tensor's pages locked in place (registered with the driver), so
/// copies between it and a device are DMA; unregistered when this is
/// dropped, before the tensor it holds can free the memory.
#[cfg(feature = "cuda")]
pub struct PinnedHost {
    // Declared first so it is dropped first.
    region: Option<crate::pages::PinnedRegion>,
    tensor: candle_core::Tensor,
}

#[cfg(feature = "cuda")]
impl PinnedHost {
    /// Locks the pages of `t` (a contiguous CPU tensor; a variable's tensor
    /// pins the variable) for copies with `device`'s context. A registration
    /// the driver refuses leaves it pageable: its copies are slower, not
    /// wrong ([`Self::is_pinned`] says which).
    pub fn new(device: &candle_core::CudaDevice, t: &candle_core::Tensor) -> Result<Self> {
        let (ptr, bytes) = host_bytes(t)?;
        // SAFETY: the range is `t`'s own storage, which the clone kept below
        // holds alive until after the registration is dropped (declared
        // first).
        let region = unsafe {
            crate::pages::PinnedRegion::register(
                device.cuda_stream().context(),
                ptr as *mut u8,
                bytes,
            )?
        };
        Ok(Self {
            region,
            tensor: t.clone(),
        })
    }

    /// Whether the driver locked the pages.
    pub fn is_pinned(&self) -> bool {
        self.region.is_some()
    }

    /// The pinned tensor.
    pub fn tensor(&self) -> &candle_core::Tensor {
        &self.tensor
    }

    /// A copy of the tensor on `device` (same shape and dtype), complete when
    /// this returns. Only the tensor's whole pages are registered, and one
    /// copy spanning them and the pageable bytes around them runs at the
    /// pageable rate (Candle's `to_device` does that: 4.2 GB of an 8B model's
    /// embedding and head took 0.40 s on an H100, where DMA takes 0.08 s), so
    /// the copy is split at page boundaries.
    pub fn to_device(&self, device: &candle_core::CudaDevice) -> Result<candle_core::Tensor> {
        let t = &self.tensor;
        let (host, n) = host_bytes(t)?;
        // SAFETY: the range is this guard's tensor's own storage, which it
        // keeps alive and unchanged while the upload runs.
        let bytes = unsafe { std::slice::from_raw_parts(host, n) };
        upload(bytes, t.shape(), t.dtype(), device)
    }
}

/// A tensor of `shape` and `dtype` on `device` holding `bytes` (host memory,
/// its layout's bytes), complete when this returns. Copied in page-sized
/// pieces on the compute stream: DMA where the pages are locked.
#[cfg(feature = "cuda")]
pub fn upload(
    bytes: &[u8],
    shape: &candle_core::Shape,
    dtype: candle_core::DType,
    device: &candle_core::CudaDevice,
) -> Result<candle_core::Tensor> {
    let n = shape.elem_count() * dtype.size_in_bytes();
    if bytes.len() != n {
        candle_core::bail!(
            "upload: {} bytes for a {dtype:?} tensor of shape {shape:?} ({n} bytes)",
            bytes.len()
        );
    }
    let dst = candle_core::Tensor::zeros(shape, dtype, &candle_core::Device::Cuda(device.clone()))?;
    let stream = device.cuda_stream();
    let copied = {
        let mem = streamer_device::CudaMemory::of(&dst)?;
        let at = mem.address()?;
        // SAFETY: `dst` holds `n` bytes, allocated and zeroed on `stream`,
        // which runs the copy after that and is synchronized below (also
        // when a piece failed to enqueue), before `dst` can be used or
        // dropped and before `bytes`' borrow ends.
        unsafe { crate::cuda::htod_async(at.get(), bytes.as_ptr(), n, &stream) }
    };
    stream.synchronize().map_err(candle_core::Error::wrap)?;
    copied?;
    Ok(dst)
}

/// The host address and byte length of a contiguous CPU tensor's data (valid
/// while the tensor lives).
#[cfg(feature = "cuda")]
pub fn host_bytes(t: &candle_core::Tensor) -> Result<(*const u8, usize)> {
    use candle_core::{CpuStorage, Storage};
    let (s, l) = t.storage_and_layout();
    if !l.is_contiguous() {
        candle_core::bail!("host master must be contiguous");
    }
    let Storage::Cpu(cs) = &*s else {
        candle_core::bail!(
            "host master must be on the CPU, found {:?}",
            t.device().location()
        )
    };
    let es = t.dtype().size_in_bytes();
    let base: *const u8 = match cs {
        CpuStorage::U8(v) => v.as_ptr(),
        CpuStorage::U32(v) => v.as_ptr() as *const u8,
        CpuStorage::I64(v) => v.as_ptr() as *const u8,
        CpuStorage::BF16(v) => v.as_ptr() as *const u8,
        CpuStorage::F16(v) => v.as_ptr() as *const u8,
        CpuStorage::F32(v) => v.as_ptr() as *const u8,
        CpuStorage::F64(v) => v.as_ptr() as *const u8,
        _ => candle_core::bail!("unsupported host dtype {:?}", t.dtype()),
    };
    // SAFETY: start_offset is within the storage by the layout's invariant.
    let ptr = unsafe { base.add(l.start_offset() * es) };
    Ok((ptr, t.elem_count() * es))
}

impl HostMasters {
    /// Whether `name` is declared as an alias of another weight.
    pub fn has_alias(&self, name: &str) -> bool {
        self.aliases.contains_key(name)
    }
}
