//! `doctor`: checks an installation and prints a readable report.
//!
//! ```sh
//! cargo run --release --example doctor                   # CPU build: the CPU paths
//! cargo run --release --features cuda --example doctor   # and the GPU
//! ```
//!
//! Checks, each printed as `ok`, `FAIL` or `skip` with what it measured: the
//! build (features, the compute capability the kernels were compiled for); the
//! CUDA driver and device (name, compute capability, memory); page-locked host
//! allocation; host-to-device and device-to-host bandwidth from page-locked
//! memory (256 MiB, best of 3); every attention kernel family, forward and
//! backward, plain, causal, windowed and soft-capped, against an f64 reference
//! (`cqsa::doctor`); cuBLASLt (a `FusedLinear` with its bias+GELU epilogue
//! against the unfused ops); the calibration cache. The exit code is 1 when a
//! check failed, and the failures are named at the end.
use anyhow::Result;
use candle_core::Device;

/// The outcome of one check.
enum Status {
    Ok,
    Fail,
    Skip,
}

/// The report: one line per check, failures remembered for the summary.
#[derive(Default)]
struct Report {
    failed: Vec<String>,
}

impl Report {
    fn line(&mut self, status: Status, what: &str, detail: &str) {
        let tag = match status {
            Status::Ok => "ok  ",
            Status::Fail => {
                self.failed.push(what.to_string());
                "FAIL"
            }
            Status::Skip => "skip",
        };
        println!("[{tag}] {what:<44} {detail}");
    }

    /// `Ok` or `Fail` from a result, with the error as the detail.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn check<T>(
        &mut self,
        what: &str,
        r: Result<T>,
        detail: impl FnOnce(&T) -> String,
    ) -> Option<T> {
        match r {
            Ok(v) => {
                let d = detail(&v);
                self.line(Status::Ok, what, &d);
                Some(v)
            }
            Err(e) => {
                self.line(Status::Fail, what, &format!("{e:#}"));
                None
            }
        }
    }
}

fn main() {
    println!("candle-streamer doctor\n");
    let mut report = Report::default();
    build(&mut report);
    kernels(&mut report, &Device::Cpu, "CPU");
    #[cfg(feature = "cuda")]
    gpu::run(&mut report);
    #[cfg(not(feature = "cuda"))]
    report.line(
        Status::Skip,
        "CUDA",
        "built without the `cuda` feature: rebuild with --features cuda to check the GPU",
    );
    calibration(&mut report);
    println!();
    if report.failed.is_empty() {
        println!("everything checked works");
    } else {
        println!("{} check(s) failed:", report.failed.len());
        for f in &report.failed {
            println!("  - {f}");
        }
        std::process::exit(1);
    }
}

fn build(report: &mut Report) {
    let cap = option_env!("CUDA_COMPUTE_CAP").unwrap_or("unset");
    let detail = if cfg!(feature = "cuda") {
        format!("cuda feature on, kernels compiled for compute capability {cap}")
    } else {
        "cuda feature off (CPU only)".to_string()
    };
    report.line(Status::Ok, "build", &detail);
    let threads = std::thread::available_parallelism().map_or(0, |n| n.get());
    report.line(Status::Ok, "CPU threads", &threads.to_string());
}

/// Every attention kernel family of `dev` against the f64 reference.
fn kernels(report: &mut Report, dev: &Device, label: &str) {
    match cqsa::doctor::check_kernels(dev) {
        Ok(checks) => {
            for c in checks {
                let status = if c.ok() { Status::Ok } else { Status::Fail };
                let detail = format!("error {:.2e} (tolerance {:.0e})", c.error, c.tol);
                report.line(status, &format!("attention {label}: {}", c.name), &detail);
            }
        }
        Err(e) => report.line(Status::Fail, &format!("attention {label}"), &e.to_string()),
    }
}

/// The planner's rates: the calibration cache of each device checked (ok when
/// valid, skip when there is none, FAIL when a file is there but refused).
fn calibration(report: &mut Report) {
    #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
    let mut devices: Vec<(&str, candle_core::Result<Device>)> = vec![("CPU", Ok(Device::Cpu))];
    #[cfg(feature = "cuda")]
    devices.push(("CUDA", Device::new_cuda(0)));
    for (label, dev) in devices {
        let what = format!("calibration cache ({label})");
        let Ok(dev) = dev else {
            report.line(Status::Skip, &what, "no device");
            continue;
        };
        let found = cqsa::calibrate::cache_path(&dev).and_then(|p| {
            let name = cqsa::calibrate::device_name(&dev)?;
            Ok((p.exists(), p, name))
        });
        match found {
            Ok((false, path, _)) => report.line(
                Status::Skip,
                &what,
                &format!(
                    "none at {}: the planner uses its built-in rates (run the `calibrate` example)",
                    path.display()
                ),
            ),
            Ok((true, path, name)) => match cqsa::Calibration::load(&path, &name) {
                Ok(c) => report.line(
                    Status::Ok,
                    &what,
                    &format!(
                        "{} ({} kernel rates)",
                        path.display(),
                        c.rates.kernels.len()
                    ),
                ),
                Err(e) => report.line(Status::Fail, &what, &e.to_string()),
            },
            Err(e) => report.line(Status::Fail, &what, &e.to_string()),
        }
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::{kernels, Report};
    use anyhow::{ensure, Context, Result};
    use candle_core::{DType, Device, Module, Tensor};
    use std::time::Instant;

    pub(super) fn run(report: &mut Report) {
        let Some(dev) = report.check(
            "CUDA device 0",
            Device::new_cuda(0).context("no usable CUDA device (driver installed? GPU visible?)"),
            |_| String::new(),
        ) else {
            return;
        };
        let Device::Cuda(cuda) = &dev else { return };
        report.check("CUDA driver and device", describe(cuda), |s| s.clone());
        report.check(
            "page-locked allocation (64 MiB)",
            pinned(cuda, 64 << 20),
            |_| "allocated, written and read back".to_string(),
        );
        report.check(
            "H2D / D2H bandwidth (page-locked, 256 MiB)",
            bandwidth(cuda),
            |(h, d)| format!("{h:.1} / {d:.1} GB/s"),
        );
        kernels(report, &dev, "CUDA");
        report.check("cuBLASLt (FusedLinear bias+GELU)", cublaslt(&dev), |e| {
            format!("error {e:.2e} against the unfused ops (tolerance 2e-2)")
        });
    }

    fn describe(cuda: &candle_core::CudaDevice) -> Result<String> {
        let ctx = cuda.cuda_stream().context().clone();
        let mut version = 0i32;
        // SAFETY: cuDriverGetVersion writes one int through a valid pointer.
        let r = unsafe {
            candle_core::cuda_backend::cudarc::driver::sys::cuDriverGetVersion(&mut version)
        };
        r.result()?;
        let (major, minor) = ctx.compute_capability()?;
        let (free, total) = ctx.mem_get_info()?;
        Ok(format!(
            "{}, compute capability {major}.{minor}, driver {}.{}, {:.1} GiB free of {:.1}",
            ctx.name()?,
            version / 1000,
            version % 1000 / 10,
            free as f64 / (1u64 << 30) as f64,
            total as f64 / (1u64 << 30) as f64
        ))
    }

    fn pinned(cuda: &candle_core::CudaDevice, bytes: usize) -> Result<()> {
        let ctx = cuda.cuda_stream().context().clone();
        // SAFETY: the buffer is written in full below before any read.
        let mut buf = unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }?;
        let s = buf.as_mut_slice()?;
        for (i, x) in s.iter_mut().enumerate() {
            *x = i as u8;
        }
        let s = buf.as_slice()?;
        ensure!(
            s.iter().enumerate().all(|(i, &x)| x == i as u8),
            "page-locked memory does not read back what was written"
        );
        Ok(())
    }

    /// Best of 3 of each direction; the data must survive the round trip.
    fn bandwidth(cuda: &candle_core::CudaDevice) -> Result<(f64, f64)> {
        const N: usize = 64 << 20; // f32s: 256 MiB
        let stream = cuda.cuda_stream();
        let ctx = stream.context().clone();
        // SAFETY: `src` is written in full before the first copy reads it; `back`
        // is read only after the copies into it are synchronised.
        let mut src = unsafe { ctx.alloc_pinned_with_flags::<f32>(N, 0) }?;
        let mut back = unsafe { ctx.alloc_pinned_with_flags::<f32>(N, 0) }?;
        for (i, x) in src.as_mut_slice()?.iter_mut().enumerate() {
            *x = (i % 1000) as f32;
        }
        // SAFETY: every element is written by the first copy before it is read.
        let mut dst = unsafe { stream.alloc::<f32>(N) }?;
        let gbs = |secs: f64| (N * 4) as f64 / secs / 1e9;
        let (mut h2d, mut d2h) = (0f64, 0f64);
        for _ in 0..3 {
            let t = Instant::now();
            stream.memcpy_htod(&src, &mut dst)?;
            stream.synchronize()?;
            h2d = h2d.max(gbs(t.elapsed().as_secs_f64()));
            let t = Instant::now();
            stream.memcpy_dtoh(&dst, &mut back)?;
            stream.synchronize()?;
            d2h = d2h.max(gbs(t.elapsed().as_secs_f64()));
        }
        ensure!(
            back.as_slice()? == src.as_slice()?,
            "data changed on the round trip host -> device -> host"
        );
        Ok((h2d, d2h))
    }

    /// A bf16 FusedLinear (cuBLASLt with its bias+GELU epilogue) against the
    /// same math in Candle ops; the largest error relative to the largest value.
    fn cublaslt(dev: &Device) -> Result<f64> {
        use streamer_models::fused_linear::{Epilogue, FusedLinear};
        let w = (Tensor::randn(0f32, 1.0, (96, 64), dev)? * 0.1)?.to_dtype(DType::BF16)?;
        let b = Tensor::randn(0f32, 1.0, 96, dev)?.to_dtype(DType::BF16)?;
        let x = Tensor::randn(0f32, 1.0, (32, 64), dev)?.to_dtype(DType::BF16)?;
        let lin = FusedLinear::new(w, b, Epilogue::BiasGelu)?;
        let f = |t: Tensor| -> Result<Vec<f32>> {
            Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
        };
        let (got, want) = (f(lin.forward(&x)?)?, f(lin.forward_unfused(&x)?)?);
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
        let err = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
            / scale;
        ensure!(
            err.is_finite() && err <= 2e-2,
            "FusedLinear differs from the unfused ops by {err:e}"
        );
        Ok(err as f64)
    }
}
