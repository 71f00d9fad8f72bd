//! Loads a [`Module`] once per device context and finds kernels in it.
use crate::Module;
use candle_core::{CudaDevice, Result};
use cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchArgs};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Modules loaded so far, by context and name. Each holds its context alive
/// (`CudaModule` keeps an `Arc` of it), so a context's address is never
/// reused while its entry exists.
type Loaded = HashMap<(usize, &'static str), Arc<CudaModule>>;

static LOADED: Mutex<Option<Loaded>> = Mutex::new(None);

/// A kernel and the stream of the device it was loaded for (as Candle's
/// `CudaFunc` pairs them): [`Kernel::builder`] launches on that stream.
#[derive(Debug, Clone)]
pub struct Kernel {
    func: CudaFunction,
    stream: Arc<CudaStream>,
}

impl Kernel {
    /// A launch of this kernel on its device's stream.
    pub fn builder(&self) -> LaunchArgs<'_> {
        self.stream.launch_builder(&self.func)
    }

    /// The function alone (for launches on another stream).
    pub fn into_function(self) -> CudaFunction {
        self.func
    }
}

impl std::ops::Deref for Kernel {
    type Target = CudaFunction;

    fn deref(&self) -> &CudaFunction {
        &self.func
    }
}

/// The kernel `name` of `module` on `dev`'s context, loading the module on
/// first use (the driver reads the machine code for this GPU from the fat
/// binary, or compiles its PTX for another). An empty module, or a name it
/// does not hold, is an error naming both.
pub fn function(dev: &CudaDevice, module: &Module, name: &str) -> Result<Kernel> {
    if module.is_empty() {
        candle_core::bail!(
            "kernel {name}: module {} was not built for this GPU's compute capability",
            module.name
        );
    }
    let func = load(dev, module)?.load_function(name).map_err(|e| {
        candle_core::Error::wrap(e).context(format!("kernel {name} in module {}", module.name))
    })?;
    Ok(Kernel {
        func,
        stream: dev.cuda_stream(),
    })
}

fn load(dev: &CudaDevice, module: &Module) -> Result<Arc<CudaModule>> {
    let ctx = dev.cuda_stream().context().clone();
    let key = (ctx.cu_ctx() as usize, module.name);
    // A poisoned lock only means another thread panicked while loading: the
    // map itself is always whole.
    let mut guard = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    if let Some(m) = map.get(&key) {
        return Ok(m.clone());
    }
    let m = ctx
        .load_module(Ptx::from_binary(module.image.to_vec()))
        .map_err(|e| {
            candle_core::Error::wrap(e).context(format!("loading module {}", module.name))
        })?;
    map.insert(key, m.clone());
    Ok(m)
}
