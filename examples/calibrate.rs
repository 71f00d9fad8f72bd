//! `calibrate`: measures this device's attention rates (`cqsa::calibrate`) and
//! stores them in the cache file the planner reads.
//!
//! ```sh
//! cargo run --release --example calibrate                   # the CPU
//! cargo run --release --features cuda --example calibrate   # GPU 0 (about a minute)
//! cargo run --release --example calibrate -- --show         # print the cached rates
//! ```
//!
//! The cache goes to `$CQSA_CALIBRATION_DIR`, else
//! `$XDG_CACHE_HOME/candle-streamer`, else `~/.cache/candle-streamer`, in a file
//! named by the device and the kernel version. Afterwards the example prints the
//! plan of large causal calls (`--estimate-n`, default N = 1M; bf16, H = 16,
//! D = 128, 16 GiB budget) with its rates' source, as `cqsa::estimate` now
//! sees it (with `--show`, from the cached rates).
use anyhow::Result;
use candle_core::{DType, Device};
use clap::Parser;
use cqsa::calibrate::{cache_path, device_name, CalibrateOptions, Calibration};
use cqsa::{AttentionShape, Budget};

#[derive(Parser, Debug)]
#[command(about = "Measure this device's attention rates for cqsa's planner")]
struct Args {
    /// Print the cached calibration of the device; measure nothing.
    #[arg(long)]
    show: bool,
    /// Tiny sizes (seconds; noisy rates): to try the command.
    #[arg(long)]
    quick: bool,
    /// Calibrate the CPU even in a CUDA build.
    #[arg(long)]
    cpu: bool,
    /// Sequence lengths whose causal plan is printed afterwards.
    #[arg(long, value_delimiter = ',', default_value = "1048576")]
    estimate_n: Vec<usize>,
}

fn device(cpu: bool) -> Result<Device> {
    #[cfg(feature = "cuda")]
    if !cpu {
        use anyhow::Context;
        return Device::new_cuda(0).context("no usable CUDA device 0 (try --cpu)");
    }
    let _ = cpu;
    Ok(Device::Cpu)
}

fn print(cal: &Calibration) {
    let r = &cal.rates;
    println!(
        "{} (kernel version {}), measured in {:.1} s",
        cal.device, cal.kernel_version, cal.seconds
    );
    println!(
        "  {:<8} {:>4} {:>7} {:>8} {:>12}",
        "dtype", "d", "causal", "tokens", "TFLOP/s"
    );
    for k in &r.kernels {
        println!(
            "  {:<8} {:>4} {:>7} {:>8} {:>12.3}",
            k.dtype,
            k.head_dim,
            k.causal,
            k.tokens,
            k.forward_flops_per_s / 1e12
        );
    }
    let gbs = |x: f64| format!("{:.2} GB/s", x / 1e9);
    println!("  host to device            {}", gbs(r.h2d_bytes_per_s));
    println!("  device to host            {}", gbs(r.d2h_bytes_per_s));
    match r.pin_bytes_per_s {
        Some(p) => println!("  page-locking in place     {}", gbs(p)),
        None => println!("  page-locking in place     (not used on this device)"),
    }
    match r.pinned_alloc_bytes_per_s {
        Some(p) => println!("  page-locked allocation    {}", gbs(p)),
        None => println!("  page-locked allocation    (not used on this device)"),
    }
    println!(
        "  device merge (f32 out)    {}",
        gbs(r.device_merge_bytes_per_s)
    );
    println!(
        "  host landing (f32)        {}",
        gbs(r.host_merge_bytes_per_s)
    );
    println!(
        "  host landing (to bf16)    {}",
        gbs(r.host_land_converted_bytes_per_s)
    );
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = device(args.cpu)?;
    let name = device_name(&dev)?;
    let path = cache_path(&dev)?;
    if args.show {
        let cal = Calibration::load(&path, &name)?;
        println!("{}", path.display());
        print(&cal);
        return estimates(&args.estimate_n);
    }
    let mut opts = if args.quick {
        CalibrateOptions::quick()
    } else {
        CalibrateOptions::for_device(&dev)
    };
    opts.verbose = true;
    println!("calibrating {name} ...");
    let cal = cqsa::calibrate(&dev, &opts)?;
    let path = cal.store()?;
    print(&cal);
    println!("wrote {}", path.display());
    estimates(&args.estimate_n)
}

/// Prints the planner's causal bf16 H=16 D=128 plan at each of `ns` tokens
/// under 16 GiB of device memory.
fn estimates(ns: &[usize]) -> Result<()> {
    // Host memory unbounded: this is the plan, whether or not this host could hold it.
    let budget = Budget {
        device_bytes: 16 << 30,
        host_bytes: usize::MAX,
    };
    for &n in ns {
        let shape = AttentionShape {
            b: 1,
            hq: 16,
            hkv: 16,
            nq: n,
            nk: n,
            d: 128,
            dtype: DType::BF16,
            causal: true,
        };
        let plan = cqsa::estimate(&shape, &budget)?;
        println!("estimate, causal bf16 N={n} H=16 D=128 under 16 GiB of device memory: {plan}");
    }
    Ok(())
}
