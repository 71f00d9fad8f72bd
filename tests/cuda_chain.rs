//! The build chain end to end: a kernel from `kernels/` launched through the
//! pool's conversion path, and a Candle matmul, each checked against the CPU.
use candle_core::{DType, Device, Tensor};

/// Converts f32 -> bf16/f16 -> f32 through `streamer_core::convert` (our own
/// cast kernel on CUDA) and compares with Candle's own `to_dtype` on the CPU,
/// which must agree bit for bit (both round to nearest even).
fn cast_kernel_matches_candle(dev: &Device) -> anyhow::Result<()> {
    // An odd length so the grid-stride loop's tail is exercised.
    let n = 100_003;
    let x = Tensor::randn(0f32, 3.0, n, &Device::Cpu)?;
    for dt in [DType::BF16, DType::F16] {
        let want = x.to_dtype(dt)?;
        let got = streamer_core::convert(&x.to_device(dev)?, dt)?;
        assert_eq!(got.dtype(), dt);
        assert_eq!(got.device().location(), dev.location());
        let diff = (got.to_device(&Device::Cpu)?.to_dtype(DType::F32)?
            - want.to_dtype(DType::F32)?)?
        .abs()?
        .max(0)?
        .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0, "f32 -> {dt:?} differs from Candle's conversion");
        // And back to f32: exact, since every bf16/f16 value is an f32.
        let back = streamer_core::convert(&got, DType::F32)?;
        let diff = (back.to_device(&Device::Cpu)? - want.to_dtype(DType::F32)?)?
            .abs()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0, "{dt:?} -> f32 is not exact");
    }
    Ok(())
}
candle_streamer::test_device!(cast_kernel_matches_candle);

/// A matmul on the device against an f64 computation on the CPU.
fn matmul_matches_f64(dev: &Device) -> anyhow::Result<()> {
    let a = Tensor::randn(0f32, 1.0, (67, 129), &Device::Cpu)?;
    let b = Tensor::randn(0f32, 1.0, (129, 33), &Device::Cpu)?;
    let want = a.to_dtype(DType::F64)?.matmul(&b.to_dtype(DType::F64)?)?;
    let got = a.to_device(dev)?.matmul(&b.to_device(dev)?)?;
    let got = got.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let err = (got - &want)?
        .abs()?
        .max_keepdim(0)?
        .max(1)?
        .squeeze(0)?
        .to_scalar::<f64>()?;
    let scale = want
        .abs()?
        .max_keepdim(0)?
        .max(1)?
        .squeeze(0)?
        .to_scalar::<f64>()?;
    // cuBLAS may use TF32 for f32 matmuls: 1e-2 relative covers that; CPU is far tighter.
    let tol = if dev.is_cuda() { 1e-2 } else { 1e-5 };
    assert!(err <= tol * scale, "matmul error {err} > {tol} * {scale}");
    Ok(())
}
candle_streamer::test_device!(matmul_matches_f64);

/// `streamer_core::to_device_compact` moves a view's own elements: one head
/// narrowed out of a larger host tensor arrives on `dev` with its values, as a
/// tensor that is its whole storage (Candle's `to_device` would move all four
/// heads), and comes back the same way; `covers_storage` tells a view from a
/// whole tensor.
fn compact_transfer_moves_only_the_view(dev: &Device) -> anyhow::Result<()> {
    use streamer_core::{covers_storage, to_device_compact};
    let host = Tensor::arange(0f32, 192.0, &Device::Cpu)?.reshape((1, 4, 6, 8))?;
    anyhow::ensure!(covers_storage(&host), "a fresh tensor is its whole storage");
    let view = host.narrow(1, 2, 1)?.narrow(2, 1, 3)?;
    anyhow::ensure!(!covers_storage(&view), "a narrowed view is not");
    anyhow::ensure!(
        !covers_storage(&host.transpose(2, 3)?),
        "a transposed view is not"
    );
    let moved = to_device_compact(&view, dev)?;
    let want = view.flatten_all()?.to_vec1::<f32>()?;
    let got = moved
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    anyhow::ensure!(got == want, "moved values {got:?}, want {want:?}");
    anyhow::ensure!(
        moved.dims() == [1, 1, 3, 8],
        "moved shape {:?}",
        moved.dims()
    );
    // A strided view moves as it is (the test checks the values only).
    let t = to_device_compact(&view.transpose(2, 3)?, dev)?;
    anyhow::ensure!(
        t.transpose(2, 3)?.flatten_all()?.to_vec1::<f32>()? == want,
        "a transposed view moved with other values"
    );
    let part = moved.narrow(2, 1, 2)?;
    let back = to_device_compact(&part, &Device::Cpu)?;
    anyhow::ensure!(
        back.flatten_all()?.to_vec1::<f32>()? == want[8..],
        "the slice came back with other values"
    );
    if !dev.is_cpu() {
        anyhow::ensure!(
            covers_storage(&moved),
            "the device copy holds more than the view"
        );
        anyhow::ensure!(
            covers_storage(&back),
            "the host copy holds more than the slice"
        );
    }
    Ok(())
}
candle_streamer::test_device!(compact_transfer_moves_only_the_view);
