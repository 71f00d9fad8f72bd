//! Sets `CQSA_KERNEL_VERSION`: the crate version and a hash of the sources that
//! decide the attention kernels' speed (the CUDA kernels, their launches, the
//! CPU kernels). A calibration measured with other kernels is refused by it.
use std::path::Path;

fn main() {
    let files = [
        "../../kernels/src/attention.cu",
        "../../kernels/src/attention_common.cuh",
        "../../kernels/src/attention_hopper.cu",
        "../../kernels/src/wgmma.cuh",
        "src/cuda.rs",
        "src/hopper.rs",
        "src/cpu.rs",
    ];
    // FNV-1a, 64 bits: stable across Rust versions, unlike std's hasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for f in files {
        println!("cargo:rerun-if-changed={f}");
        let bytes = std::fs::read(Path::new(f)).unwrap_or_default();
        for b in f.bytes().chain(bytes) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_default();
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    let version = std::env::var("CARGO_PKG_VERSION").unwrap_or_default();
    let cap = if cap.is_empty() {
        String::new()
    } else {
        format!("-sm{cap}")
    };
    println!("cargo:rustc-env=CQSA_KERNEL_VERSION={version}-{h:016x}{cap}");
}
