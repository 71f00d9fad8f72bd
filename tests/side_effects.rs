//! Context-wide side effects: building and training a model leaves the CUDA
//! context's event tracking, the device's random generator and the cuBLASLt
//! handles as the caller had them (or frees what it made), unless the caller
//! opts in explicitly.
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use streamer_autograd::{dropout, with_seed, Train};
use streamer_core::{cuda_event_tracking, StreamConfig, StreamedSequential};

use crate::pool::{mlp_blocks, mlp_weights};

fn cfg(dev: &Device) -> StreamConfig {
    StreamConfig {
        device: dev.clone(),
        prefetch_ahead: 1,
        dtype: DType::F32,
        ..Default::default()
    }
}

const HIDDEN: [usize; 3] = [12, 20, 8];

/// Builds a 3-block model of `weights`, runs a training forward and backward;
/// returns the loss.
fn train_once(dev: &Device, weights: &HashMap<String, Tensor>) -> Result<f32> {
    let blocks = mlp_blocks(8, &HIDDEN);
    let model = StreamedSequential::from_tensors(weights.clone(), blocks, cfg(dev))?.train();
    let x = Tensor::ones((4, 8), DType::F32, dev)?;
    let loss = model.forward(&x)?.sqr()?.sum_all()?;
    model.backward(&loss)?;
    Ok(loss.to_scalar::<f32>()?)
}

fn building_a_model_leaves_event_tracking_alone(dev: &Device) -> Result<()> {
    let before = cuda_event_tracking(dev);
    if dev.is_cuda() {
        // cudarc's default for a fresh context (the test device is one).
        ensure!(
            before == Some(true),
            "a fresh context tracks events, got {before:?}"
        );
    } else {
        ensure!(
            before.is_none(),
            "the CPU has no CUDA context, got {before:?}"
        );
    }
    let weights = mlp_weights(8, &HIDDEN)?;
    let tracked = train_once(dev, &weights)?;
    let after = cuda_event_tracking(dev);
    ensure!(
        after == before,
        "building and training a model changed event tracking from {before:?} to {after:?}"
    );
    // The explicit opt-in does switch it off, and the pool is just as exact.
    // SAFETY: this test's device (its own context object) runs only the pool's
    // work, which orders its streams with its own events.
    unsafe { streamer_core::disable_cuda_event_tracking(dev)? };
    let off = cuda_event_tracking(dev);
    ensure!(
        off == before.map(|_| false),
        "after the opt-in, tracking is {off:?} (expected off on CUDA, none on the CPU)"
    );
    let untracked = train_once(dev, &weights)?;
    ensure!(
        (tracked - untracked).abs() <= 1e-6 * tracked.abs(),
        "loss {untracked} without event tracking, {tracked} with"
    );
    Ok(())
}
candle_streamer::test_device!(building_a_model_leaves_event_tracking_alone);

/// A replayed mask as a vector (`x` of ones, so the values are 0 or 1/(1-p)).
fn mask(dev: &Device, seed: u64) -> Result<Vec<f32>> {
    let x = Tensor::ones(4096, DType::F32, dev)?;
    Ok(with_seed(seed, || dropout(&x, 0.5))?.to_vec1::<f32>()?)
}

fn dropout_leaves_the_device_generator_alone(dev: &Device) -> Result<()> {
    // Replay: same seed, same mask; another seed, another mask.
    let a = mask(dev, 11)?;
    ensure!(a == mask(dev, 11)?, "the same seed gave two masks");
    ensure!(a != mask(dev, 12)?, "seeds 11 and 12 gave the same mask");
    let kept = a.iter().filter(|v| **v > 0.0).count();
    ensure!(
        (1700..2400).contains(&kept),
        "p = 0.5 kept {kept} of 4096 elements"
    );
    if dev.is_cuda() {
        // The caller's stream of random numbers is the same with or without a
        // replayed dropout drawn in between (the CPU generator cannot be seeded).
        dev.set_seed(2024)?;
        let want = Tensor::rand(0f32, 1f32, 256, dev)?.to_vec1::<f32>()?;
        dev.set_seed(2024)?;
        mask(dev, 11)?;
        let got = Tensor::rand(0f32, 1f32, 256, dev)?.to_vec1::<f32>()?;
        ensure!(
            got == want,
            "a replayed dropout changed the device generator's next draws"
        );
    }
    Ok(())
}
candle_streamer::test_device!(dropout_leaves_the_device_generator_alone);

/// The cuBLASLt handle (and its 32 MiB workspace) made for a stream is freed
/// once every device and tensor of that stream is gone.
#[cfg(feature = "cuda")]
#[test]
fn cublaslt_handle_is_freed_with_its_stream() -> Result<()> {
    use candle_core::Module;
    use streamer_models::{Epilogue, FusedLinear};
    let dev = candle_streamer::test_utils::cuda_device()?;
    let Device::Cuda(cuda) = &dev else {
        anyhow::bail!("cuda_device gave {:?}", dev.location())
    };
    let probe = streamer_models::cublaslt_handle_probe(cuda)?;
    let w = Tensor::randn(0f32, 0.1, (16, 24), &dev)?.to_dtype(DType::BF16)?;
    let b = Tensor::zeros(16, DType::BF16, &dev)?;
    let lin = FusedLinear::new(w, b, Epilogue::BiasGelu)?;
    let y = lin.forward(&Tensor::ones((8, 24), DType::BF16, &dev)?)?;
    y.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?;
    streamer_models::cached_cublaslt_handles()?;
    ensure!(
        probe.upgrade().is_some(),
        "the handle of a live stream was freed"
    );
    drop((y, lin));
    drop(dev);
    streamer_models::cached_cublaslt_handles()?;
    ensure!(
        probe.upgrade().is_none(),
        "the cuBLASLt handle outlived every device and tensor of its stream"
    );
    Ok(())
}

/// The page size as the OS reports it to a shell (`getconf PAGESIZE`).
fn getconf_page_size() -> Result<usize> {
    let out = std::process::Command::new("getconf")
        .arg("PAGESIZE")
        .output()?;
    ensure!(out.status.success(), "getconf PAGESIZE failed: {out:?}");
    Ok(String::from_utf8(out.stdout)?.trim().parse()?)
}

/// Page-locking (streamer-core's masters and offload buffers, cqsa's streamed
/// inputs: one implementation, `streamer_core::pages`) registers whole pages of
/// the OS page size, so it never touches a neighbouring allocation's page.
#[test]
fn pinning_uses_the_os_page_size() -> Result<()> {
    use streamer_core::pages::{page_pieces, page_size, whole_pages};
    let page = getconf_page_size()?;
    ensure!(
        page_size() == page,
        "page_size() = {} but the OS says {page}",
        page_size()
    );
    ensure!(
        whole_pages(3 * page + 1, 2 * page) == Some((4 * page, 5 * page)),
        "whole pages of [3p+1, 5p+1) with p = {page}: {:?}",
        whole_pages(3 * page + 1, 2 * page)
    );
    ensure!(
        whole_pages(page + 1, page).is_none(),
        "a range within two partial pages has no whole page"
    );
    // The pieces of a copy cover the range once, and only the middle one is
    // (page-aligned) whole pages.
    let (start, len) = (5 * page - 7, 3 * page + 11);
    let pieces: Vec<_> = page_pieces(start, len).collect();
    ensure!(
        pieces.iter().map(|p| p.1).sum::<usize>() == len,
        "{pieces:?}"
    );
    for &(off, n, whole) in &pieces {
        let aligned = (start + off) % page == 0 && n % page == 0;
        ensure!(
            aligned == whole,
            "piece {off}+{n} of {pieces:?} (page {page})"
        );
    }
    // No crate keeps a page size of its own.
    let mut dirs: Vec<std::path::PathBuf> = [
        "crates/streamer-device/src",
        "crates/streamer-core/src",
        "crates/cqsa/src",
        "crates/streamer-autograd/src",
    ]
    .map(Into::into)
    .to_vec();
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let text = std::fs::read_to_string(&path)?;
            ensure!(
                !text.contains("const PAGE"),
                "{} defines its own page size",
                path.display()
            );
        }
    }
    Ok(())
}
