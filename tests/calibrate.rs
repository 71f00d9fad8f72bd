//! `cqsa::calibrate`: a short calibration, the cache file's round trip, the
//! refusal of bad or stale files, and the planner reading the cache (in a child
//! process, whose cache directory is set by the environment).
use anyhow::{ensure, Result};
use candle_core::{DType, Device};
use cqsa::calibrate::{
    cache_path_for, calibrate, device_name, CalibrateOptions, Calibration, KernelRate, Rates,
    CACHE_DIR_ENV, FORMAT, KERNEL_VERSION,
};
use cqsa::{estimate, estimate_with, AttentionShape, Budget, RatesSource};
#[cfg(feature = "cuda")]
use cqsa::{AttentionOpts, Mode};

fn temp_dir(tag: &str) -> Result<std::path::PathBuf> {
    let d = std::env::temp_dir().join(format!("cqsa-cal-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

/// A quick calibration measures every rate it should (each a positive,
/// finite number, the kernel rates no faster than the whole calibration's time
/// allows), and the file written reads back equal.
fn calibration_round_trips(dev: &Device) -> Result<()> {
    let cal = calibrate(dev, &CalibrateOptions::quick())?;
    ensure!(cal.device == device_name(dev)? && cal.kernel_version == KERNEL_VERSION);
    ensure!(cal.rates.kernels.len() == 2, "{:?}", cal.rates.kernels);
    for causal in [false, true] {
        let k = cal.rates.kernels.iter().find(|k| k.causal == causal);
        let Some(k) = k else {
            anyhow::bail!("no kernel rate for causal = {causal}")
        };
        ensure!(
            k.dtype == "f32" && k.head_dim == 16 && k.tokens == 64,
            "{k:?}"
        );
        // Two timed calls at least took place within `seconds`.
        let flops = 4.0 * 64.0 * 64.0 * 16.0 / if causal { 2.0 } else { 1.0 };
        ensure!(
            k.forward_flops_per_s.is_finite() && k.forward_flops_per_s >= flops / cal.seconds,
            "{k:?} in {} s",
            cal.seconds
        );
    }
    let r = &cal.rates;
    for v in [
        r.h2d_bytes_per_s,
        r.d2h_bytes_per_s,
        r.device_merge_bytes_per_s,
        r.host_merge_bytes_per_s,
        r.host_land_converted_bytes_per_s,
    ] {
        ensure!(v.is_finite() && v > 0.0, "{r:?}");
    }
    ensure!(r.pin_bytes_per_s.is_some() == dev.is_cuda(), "{r:?}");
    ensure!(
        r.pinned_alloc_bytes_per_s.is_some() == dev.is_cuda()
            && r.pinned_alloc_bytes_per_s
                .is_none_or(|v| v.is_finite() && v > 0.0),
        "{r:?}"
    );
    let path = temp_dir("round")?.join("cal.json");
    cal.save(&path)?;
    let back = Calibration::load(&path, &cal.device)?;
    ensure!(back == cal, "{back:?} != {cal:?}");
    std::fs::remove_file(&path)?;
    Ok(())
}
candle_streamer::test_device!(calibration_round_trips);

/// A calibration with made-up rates, for the file and planner tests.
fn made_up(device: &str) -> Calibration {
    let kernel = |causal: bool, rate: f64| KernelRate {
        dtype: "bf16".into(),
        head_dim: 64,
        causal,
        tokens: 1024,
        forward_flops_per_s: rate,
    };
    Calibration {
        format: FORMAT,
        device: device.into(),
        kernel_version: KERNEL_VERSION.into(),
        created_unix: 0,
        seconds: 1.0,
        rates: Rates {
            kernels: vec![kernel(false, 2e12), kernel(true, 1e12)],
            h2d_bytes_per_s: 1e9,
            d2h_bytes_per_s: 2e9,
            pin_bytes_per_s: Some(4e9),
            // Slow enough that the staging outlasts the first chunk's compute.
            pinned_alloc_bytes_per_s: Some(1e5),
            device_merge_bytes_per_s: 8e9,
            host_merge_bytes_per_s: 5e8,
            host_land_converted_bytes_per_s: 2.5e8,
        },
    }
}

/// The kernel rate at a length: the measured one at a measured length, linear
/// in the logarithm of the length between two, the nearest one's outside
/// them, whatever the entries' order; other kinds of call do not mix in.
#[test]
fn kernel_rate_interpolates_in_log_length() -> Result<()> {
    let mut r = made_up("GPU A").rates;
    let at = |tokens: usize, causal: bool, rate: f64| KernelRate {
        dtype: "bf16".into(),
        head_dim: 64,
        causal,
        tokens,
        forward_flops_per_s: rate,
    };
    // Dense at 16384 (3e12) before 1024 (2e12, from made_up); causal at 1024 only.
    r.kernels.insert(0, at(16384, false, 3e12));
    r.kernels.push(KernelRate {
        head_dim: 128,
        ..at(4096, false, 9e12)
    });
    let dense = |t: f64| r.kernel(DType::BF16, 64, false, t);
    for (tokens, want) in [
        (1.0, 2e12),
        (512.0, 2e12),
        (1024.0, 2e12),
        (2048.0, 2.25e12),
        (4096.0, 2.5e12),
        (16384.0, 3e12),
        (1e7, 3e12),
    ] {
        let got = dense(tokens).unwrap_or(f64::NAN);
        ensure!(close(got, want), "{tokens} tokens: {got} != {want}");
    }
    ensure!(r.kernel(DType::BF16, 64, true, 8192.0) == Some(1e12));
    ensure!(r.kernel(DType::BF16, 128, false, 1024.0) == Some(9e12));
    ensure!(r.kernel(DType::F16, 64, false, 1024.0).is_none());
    ensure!(r.kernel(DType::BF16, 32, true, 1024.0).is_none());
    Ok(())
}

fn expect_refused(path: &std::path::Path, device: &str, words: &[&str]) -> Result<()> {
    match Calibration::load(path, device) {
        Ok(c) => anyhow::bail!("accepted {c:?}"),
        Err(e) => {
            let msg = e.to_string();
            for w in words.iter().chain(&["refused"]) {
                ensure!(msg.contains(w), "{msg:?} does not say {w:?}");
            }
            ensure!(msg.contains(&path.display().to_string()), "{msg}");
            Ok(())
        }
    }
}

/// Garbage, a truncated file, another device, another kernel version, another
/// format and a non-positive rate are each refused, naming the file and why.
#[test]
fn calibration_refuses_bad_and_stale_files() -> Result<()> {
    let dir = temp_dir("bad")?;
    let path = dir.join("cal.json");
    let good = made_up("GPU A");
    good.save(&path)?;
    ensure!(Calibration::load(&path, "GPU A")? == good);
    expect_refused(&path, "GPU B", &["measured on \"GPU A\"", "GPU B"])?;
    std::fs::write(&path, b"\x00\xffnot json")?;
    expect_refused(&path, "GPU A", &["not a calibration file"])?;
    let text = serde_json::to_string(&good)?;
    std::fs::write(&path, &text[..text.len() / 2])?;
    expect_refused(&path, "GPU A", &["not a calibration file"])?;
    let stale = Calibration {
        kernel_version: "0.0.0-0000000000000000".into(),
        ..good.clone()
    };
    stale.save(&path)?;
    expect_refused(
        &path,
        "GPU A",
        &["kernel version", "0.0.0-0000000000000000"],
    )?;
    let old = Calibration {
        format: FORMAT + 1,
        ..good.clone()
    };
    old.save(&path)?;
    expect_refused(&path, "GPU A", &["format"])?;
    let mut bad = good.clone();
    bad.rates.h2d_bytes_per_s = -1.0;
    bad.save(&path)?;
    expect_refused(&path, "GPU A", &["h2d_bytes_per_s", "-1"])?;
    let mut bad = good.clone();
    bad.rates.pinned_alloc_bytes_per_s = Some(0.0);
    bad.save(&path)?;
    expect_refused(&path, "GPU A", &["pinned_alloc_bytes_per_s", "0"])?;
    let mut bad = good.clone();
    bad.rates.kernels[0].dtype = "u8".into();
    bad.save(&path)?;
    expect_refused(&path, "GPU A", &["dtype", "u8"])?;
    expect_refused(&dir.join("missing.json"), "GPU A", &["cannot read"])?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// Set in the child's environment: run the planner checks.
const CHILD: &str = "CQSA_CALIBRATE_CHILD";

/// The device `estimate` keys its calibration by in this build.
fn build_device() -> Result<Device> {
    #[cfg(feature = "cuda")]
    return Ok(candle_streamer::test_utils::cuda_device()?);
    #[cfg(not(feature = "cuda"))]
    Ok(Device::Cpu)
}

fn shape(nq: usize, causal: bool) -> AttentionShape {
    AttentionShape {
        b: 1,
        hq: 2,
        hkv: 2,
        nq,
        nk: nq,
        d: 64,
        dtype: DType::BF16,
        causal,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs()
}

/// The planner's checks, in a child whose cache directory is empty at first.
fn planner_checks(dir: &std::path::Path) -> Result<()> {
    let name = device_name(&build_device()?)?;
    let path = cache_path_for(&name)?;
    ensure!(
        path.starts_with(dir),
        "{} not under {}",
        path.display(),
        dir.display()
    );
    ensure!(path.to_string_lossy().contains(KERNEL_VERSION));
    let budget = Budget {
        device_bytes: 1 << 40,
        host_bytes: 1 << 40,
    };
    // No cache: the defaults, saying so.
    let p = estimate(&shape(1024, true), &budget)?;
    let RatesSource::Defaults(why) = &p.rates else {
        anyhow::bail!("{p}")
    };
    ensure!(
        why.contains("no calibration") && why.contains(&path.display().to_string()),
        "{why}"
    );
    // A calibration: the resident time is the FLOPs at its rate.
    let cal = made_up(&name);
    ensure!(cal.store()? == path);
    for causal in [false, true] {
        let s = shape(1024, causal);
        let p = estimate(&s, &budget)?;
        let rate = if causal { 1e12 } else { 2e12 };
        ensure!(p.rates == RatesSource::Calibrated(path.clone()), "{p}");
        ensure!(close(p.forward_seconds, s.forward_flops() / rate), "{p}");
    }
    streamed_check(&name, &path, &budget)?;
    // Rates at two lengths: a call between them at the rate interpolated in
    // the logarithm of its length (2048 is halfway from 1024 to 4096).
    let mut two = made_up(&name);
    two.rates.kernels.push(KernelRate {
        tokens: 4096,
        forward_flops_per_s: 4e12,
        ..two.rates.kernels[0].clone()
    });
    two.store()?;
    let s = shape(2048, false);
    let p = estimate(&s, &budget)?;
    ensure!(close(p.forward_seconds, s.forward_flops() / 3e12), "{p}");
    made_up(&name).store()?;
    // A head dim the file has no rate for: its other rates, the built-in kernel rate.
    let p = estimate(
        &AttentionShape {
            d: 32,
            ..shape(1024, true)
        },
        &budget,
    )?;
    ensure!(
        matches!(p.rates, RatesSource::CalibratedExceptKernel { .. }),
        "{p}"
    );
    // A stale file at the cache path: ignored, with the reason.
    Calibration {
        kernel_version: "0.0.0-stale".into(),
        ..made_up(&name)
    }
    .save(&path)?;
    let p = estimate(&shape(1024, true), &budget)?;
    let RatesSource::Defaults(why) = &p.rates else {
        anyhow::bail!("stale calibration used: {p}")
    };
    ensure!(
        why.contains("kernel version") && why.contains("0.0.0-stale"),
        "{why}"
    );
    std::fs::write(&path, "{}")?;
    let p = estimate(&shape(1024, true), &budget)?;
    ensure!(
        matches!(&p.rates, RatesSource::Defaults(w) if w.contains("not a calibration file")),
        "{p}"
    );
    Ok(())
}

/// A streamed, non-causal plan of one query chunk and two key chunks, against
/// the time model of `cqsa::plan`'s docs worked out by hand from the made-up
/// rates.
fn streamed_check(name: &str, path: &std::path::Path, budget: &Budget) -> Result<()> {
    let s = shape(1024, false);
    let opts = crate::common::streamed_opts(false, (1024, 512));
    let p = estimate_with(&s, &opts, budget)?;
    ensure!(
        p.subproblems == 2 && p.rates == RatesSource::Calibrated(path.to_path_buf()),
        "{p}"
    );
    let (n, h, d, e): (f64, f64, f64, f64) = (1024.0, 2.0, 64.0, 2.0);
    let kernels = 4.0 * h * d * n * n / 2e12; // the one query chunk's two subproblems
    let compute = kernels + n * h * d * 4.0 / 8e9; // one merge
    let h2d = (2.0 * 512.0 * h * d * 2.0 * e + n * h * d * e) / 1e9;
    let results = n * h * (d + 1.0) * 4.0;
    // The bf16 output lands converted (2.5e8), the log-sum-exp in f32 (5e8).
    let land = n * h * d * 4.0 / 2.5e8 + n * h * 4.0 / 5e8;
    let want = if cfg!(feature = "cuda") {
        let inputs = 3.0 * n * h * d * e;
        let first = (n * h + 2.0 * 512.0 * h) * d * e;
        let steady = compute.max(h2d).max(results / 2e9).max(land);
        // One query chunk with two subproblems: one chunk's results staged,
        // the chunk's kernels hiding as much of the allocation.
        let staging = results / 1e5 - kernels;
        inputs / 4e9 + staging + steady + first / 1e9 + results / 2e9 + land
    } else {
        compute + 2.0 * h2d + results / 2e9 + land
    };
    ensure!(
        close(p.forward_seconds, want),
        "{p}: want {want} s ({name})"
    );
    Ok(())
}

/// Child mode: does nothing unless `CQSA_CALIBRATE_CHILD` is set; then runs the
/// planner checks with the cache directory the parent set.
#[test]
fn calibrate_child_mode() -> Result<()> {
    if std::env::var(CHILD).is_err() {
        return Ok(());
    }
    let dir = std::path::PathBuf::from(std::env::var(CACHE_DIR_ENV)?);
    planner_checks(&dir)?;
    println!("CALIBRATE-CHILD-OK");
    Ok(())
}

/// `estimate` uses the cached calibration of this build's device, says where
/// its rates came from, and falls back to the defaults (with the reason) when
/// the cache is missing, stale or garbage. In a child process, since the cache
/// directory comes from the environment.
#[test]
fn estimate_uses_the_calibration_cache() -> Result<()> {
    let dir = temp_dir("planner")?;
    let done = run_child(
        "calibrate::calibrate_child_mode",
        &[
            (CHILD, Some("1".as_ref())),
            (CACHE_DIR_ENV, Some(dir.as_os_str())),
        ],
        "CALIBRATE-CHILD-OK",
    );
    std::fs::remove_dir_all(&dir)?;
    done
}

/// Runs test `name` of this binary alone in a child process with the
/// environment changes `env` (`None` removes the variable), and checks that it
/// passed and printed `marker`.
fn run_child(name: &str, env: &[(&str, Option<&std::ffi::OsStr>)], marker: &str) -> Result<()> {
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1", "-q"]);
    for (k, v) in env {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let out = cmd.output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success() && text.contains(marker),
        "the child {name} failed (status {}): {text}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Set in the child's environment: run the staging cache checks.
#[cfg(feature = "cuda")]
const STAGING_CHILD: &str = "CQSA_STAGING_CHILD";

/// A small causal streamed call of 1 x 2 x 1024 x 64 (f32) in chunks of 256.
#[cfg(feature = "cuda")]
fn streamed_call(dev: &Device, mode: Mode) -> candle_core::Result<candle_core::Tensor> {
    let t = |seed: u64| -> candle_core::Result<candle_core::Tensor> {
        let x: Vec<f32> = (0..2 * 1024 * 64)
            .map(|i| (((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0) - 1.0)
            .collect();
        candle_core::Tensor::from_vec(x, (1, 2, 1024, 64), dev)
    };
    let opts = AttentionOpts {
        causal: true,
        mode,
        q_chunk: Some(256),
        kv_chunk: Some(256),
        ..Default::default()
    };
    cqsa::attention(&t(1)?, &t(2)?, &t(3)?, &opts)
}

/// The staging cache's checks, in a child process: its cache starts empty and
/// its environment is its own.
#[cfg(feature = "cuda")]
fn staging_checks() -> Result<()> {
    use cqsa::staging::{cached_bytes, release, CACHE_ENV};
    let dev = candle_streamer::test_utils::cuda_device()?;
    ensure!(
        cached_bytes(0) == 0,
        "{} bytes cached at start",
        cached_bytes(0)
    );
    let o1 = streamed_call(&dev, Mode::Streamed)?;
    // One query chunk's f32 output and log-sum-exp at least are kept.
    let held = cached_bytes(0);
    ensure!(held >= 256 * 2 * 65 * 4, "{held} bytes cached after a call");
    // The planner counts cached staging as free: an empty cache predicts longer.
    let shape = AttentionShape {
        b: 1,
        hq: 2,
        hkv: 2,
        nq: 1024,
        nk: 1024,
        d: 64,
        dtype: DType::F32,
        causal: true,
    };
    let opts = crate::common::streamed_opts(true, (256, 256));
    let budget = Budget::new(1 << 40);
    let warm = estimate_with(&shape, &opts, &budget)?.forward_seconds;
    // The second call reuses the buffers (no more are kept) and gives the same bits.
    let o2 = streamed_call(&dev, Mode::Streamed)?;
    ensure!(cached_bytes(0) == held, "{} != {held}", cached_bytes(0));
    let diff = (&o1 - &o2)?.abs()?.max_all()?.to_scalar::<f32>()?;
    ensure!(diff == 0.0, "second call differs by {diff}");
    let resident = streamed_call(&dev, Mode::Resident)?;
    let err = (&o1 - &resident)?.abs()?.max_all()?.to_scalar::<f32>()?;
    ensure!(err <= 1e-5, "streamed vs resident {err}");
    ensure!(release() == held && cached_bytes(0) == 0);
    let cold = estimate_with(&shape, &opts, &budget)?.forward_seconds;
    ensure!(cold > warm, "cold cache {cold} s, warm {warm} s");
    // A cap of 0 keeps nothing; a cap that is not a number is refused, named.
    std::env::set_var(CACHE_ENV, "0");
    streamed_call(&dev, Mode::Streamed)?;
    ensure!(
        cached_bytes(0) == 0,
        "{} bytes kept at cap 0",
        cached_bytes(0)
    );
    std::env::set_var(CACHE_ENV, "lots");
    match streamed_call(&dev, Mode::Streamed) {
        Ok(_) => anyhow::bail!("a cap of \"lots\" was accepted"),
        Err(e) => ensure!(
            e.to_string().contains(CACHE_ENV) && e.to_string().contains("lots"),
            "{e}"
        ),
    }
    Ok(())
}

/// Child mode of the staging checks: does nothing unless `CQSA_STAGING_CHILD` is set.
#[cfg(feature = "cuda")]
#[test]
fn staging_child_mode() -> Result<()> {
    if std::env::var(STAGING_CHILD).is_err() {
        return Ok(());
    }
    staging_checks()?;
    println!("STAGING-CHILD-OK");
    Ok(())
}

/// A streamed call keeps its page-locked staging for the next call, which
/// reuses it and gives the same result as the first and as a resident call;
/// `staging::release` frees it; the planner counts cached staging as free; the
/// cap's variable is honoured and checked. In a child process (its own cache
/// and environment).
#[cfg(feature = "cuda")]
#[test]
fn streamed_calls_reuse_their_staging() -> Result<()> {
    run_child(
        "calibrate::staging_child_mode",
        &[
            (STAGING_CHILD, Some("1".as_ref())),
            (cqsa::staging::CACHE_ENV, None),
        ],
        "STAGING-CHILD-OK",
    )
}
