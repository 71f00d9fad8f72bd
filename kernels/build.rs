//! Compiles every `src/*.cu` with nvcc into a fat binary, only when the `cuda`
//! feature is on: machine code for the GPU of `CUDA_COMPUTE_CAP` (for example
//! `90`) beside the PTX, so that GPU runs the kernels without the driver
//! compiling them at first launch and a newer one can still compile the PTX.
//! The architecture comes from `CUDA_COMPUTE_CAP`, never from a constant here,
//! so the same tree builds for any GPU.
//!
//! Files named `*_hopper.cu` use Hopper-only instructions (`wgmma`): they are
//! compiled for `sm_90a` when `CUDA_COMPUTE_CAP` is 90 and left empty for any
//! other GPU, which could not run them; the launchers fall back to the
//! portable kernels when such a module is empty.
use std::path::PathBuf;
use std::process::Command;

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return Ok(());
    }
    let cap = std::env::var("CUDA_COMPUTE_CAP").map_err(|_| {
        anyhow::anyhow!(
            "CUDA_COMPUTE_CAP is not set: say which GPU to build for (90 for H100/H200); \
             scripts/cuda-toolchain.sh prints an environment that sets it"
        )
    })?;
    let cap: u32 = cap.trim().parse().map_err(|_| {
        anyhow::anyhow!("CUDA_COMPUTE_CAP must be a number such as 90, got {cap:?}")
    })?;
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".to_string());
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let src = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("src");
    let mut kernels: Vec<PathBuf> = std::fs::read_dir(&src)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    kernels.sort();
    for cu in &kernels {
        let stem = cu.file_stem().unwrap().to_string_lossy().to_string();
        let fatbin = out.join(format!("{stem}.fatbin"));
        let arch = if !stem.ends_with("_hopper") {
            cap.to_string()
        } else if cap == 90 {
            "90a".to_string()
        } else {
            std::fs::write(&fatbin, "")?;
            continue;
        };
        let status = Command::new(&nvcc)
            .arg(format!(
                "--generate-code=arch=compute_{arch},code=[sm_{arch},compute_{arch}]"
            ))
            .args(["--fatbin", "-O3", "-std=c++17", "--use_fast_math"])
            .arg("-I")
            .arg(&src)
            .arg("-o")
            .arg(&fatbin)
            .arg(cu)
            .status()
            .map_err(|e| {
                anyhow::anyhow!("could not run {nvcc} (is the CUDA toolkit on PATH?): {e}")
            })?;
        anyhow::ensure!(status.success(), "nvcc failed on {}", cu.display());
    }
    Ok(())
}
