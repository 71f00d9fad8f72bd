//! Installation checks of the attention kernels, for the `doctor` example: every
//! kernel family the device would pick (on CUDA: the Hopper kernels where the
//! GPU has them, the portable tensor-core kernels, with and without
//! soft-capping, and the simple kernels; on the CPU: the CPU path),
//! plain, causal, windowed and soft-capped, forward and backward, on a small
//! case against an f64 reference computed here on the host.
use candle_core::{DType, Device, Result, Tensor};

use crate::{attention_backward_with, attention_forward_with, AttentionShape, Scores};

/// One check: what ran, its largest error relative to the reference's largest
/// value (over o, dq, dk, dv), and the tolerance it had to meet.
#[derive(Debug, Clone)]
pub struct KernelCheck {
    /// The kernel family and case, such as `cuda tensor-core bf16 d128 causal+window`.
    pub name: String,
    /// Largest relative error.
    pub error: f64,
    /// The tolerance for this dtype.
    pub tol: f64,
}

impl KernelCheck {
    /// Whether the error is within the tolerance (and not NaN).
    pub fn ok(&self) -> bool {
        self.error <= self.tol
    }
}

/// A mask of the checks: its name, the band `(lo, hi)` and the soft-cap.
type MaskCase = (&'static str, Option<i64>, Option<i64>, Option<f32>);

/// The masks: plain, causal, a causal window, a two-sided soft-capped window.
const MASKS: [MaskCase; 4] = [
    ("plain", None, None, None),
    ("causal", None, Some(0), None),
    ("causal+window", Some(-17), Some(0), None),
    ("window+softcap", Some(-17), Some(5), Some(5.0)),
];

/// The cases: (dtype, head dim) pairs covering every CUDA family (head dim 256:
/// the Hopper forward with the simple backward, or the simple kernels).
const CASES: &[(DType, usize)] = &[
    (DType::BF16, 64),
    (DType::F16, 128),
    (DType::BF16, 128),
    (DType::F16, 64),
    (DType::F32, 40),
    (DType::BF16, 256),
];

/// The family of kernels `dev` runs for `dtype`, head dim `d` and `scores`,
/// with the Hopper kernels on or off.
fn family(dev: &Device, dtype: DType, d: usize, scores: &Scores, hopper: bool) -> String {
    if dev.is_cpu() {
        return "cpu".into();
    }
    let half = matches!(dtype, DType::F16 | DType::BF16);
    let cap = if scores.softcap.is_some() {
        " softcap"
    } else {
        ""
    };
    if hopper && half && matches!(d, 64 | 128 | 256) {
        format!("cuda hopper{cap}")
    } else if half && matches!(d, 64 | 128) {
        format!("cuda tensor-core{cap}")
    } else {
        "cuda simple".into()
    }
}

/// Runs every check on `dev` and returns them all (failures included); errors
/// only when a kernel call itself fails, with the case in the message.
///
/// Where the GPU has the Hopper kernels, each f16/bf16 case runs with them and
/// with the portable ones ([`crate::set_hopper_kernels`], put back as found
/// after each).
pub fn check_kernels(dev: &Device) -> Result<Vec<KernelCheck>> {
    let (nq, nk) = (150, 150);
    let hopper_too = crate::hopper_kernels_available(dev)?;
    let default = crate::hopper_kernels_enabled();
    let mut out = Vec::new();
    for &(dtype, d) in CASES {
        for &(mask, lo, hi, softcap) in &MASKS {
            let scores = Scores {
                lo,
                hi,
                softcap,
                ..Scores::dense(1.0 / (d as f32).sqrt())
            };
            // Only f16/bf16 have Hopper kernels: the other dtypes run once.
            let half = matches!(dtype, DType::F16 | DType::BF16);
            for hopper in if hopper_too && half {
                &[true, false][..]
            } else {
                &[false][..]
            } {
                let name = format!(
                    "{} {dtype:?} d{d} {mask}",
                    family(dev, dtype, d, &scores, *hopper)
                );
                crate::set_hopper_kernels(*hopper);
                let error = run_case(dev, dtype, (nq, nk, d), &scores);
                crate::set_hopper_kernels(default);
                let error = error
                    .map_err(|e| candle_core::Error::Msg(format!("cqsa doctor: {name}: {e}")))?;
                let tol = match dtype {
                    DType::F32 => 1e-4,
                    DType::F16 => 1e-2,
                    _ => 5e-2,
                };
                out.push(KernelCheck { name, error, tol });
            }
        }
    }
    Ok(out)
}

/// Deterministic values in [-1, 1) (a small LCG), as a `(1, h, n, d)` tensor.
fn values(h: usize, n: usize, d: usize, seed: u64, dtype: DType, dev: &Device) -> Result<Tensor> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let v: Vec<f32> = (0..h * n * d)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, (1, h, n, d), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(dev)
}

fn host(t: &Tensor) -> Result<Vec<f64>> {
    t.to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()
}

/// One case on `dev`: forward and backward against the f64 reference; the
/// largest relative error over o, dq, dk, dv (NaN counts as infinite).
fn run_case(
    dev: &Device,
    dtype: DType,
    (nq, nk, d): (usize, usize, usize),
    sc: &Scores,
) -> Result<f64> {
    let (hq, hkv) = (2, 1);
    let q = values(hq, nq, d, 1, dtype, dev)?;
    let k = values(hkv, nk, d, 2, dtype, dev)?;
    let v = values(hkv, nk, d, 3, dtype, dev)?;
    let g = values(hq, nq, d, 4, dtype, dev)?;
    let (o, lse) = attention_forward_with(&q, &k, &v, sc)?;
    let (dq, dk, dv) = attention_backward_with(&q, &k, &v, &o, &g, &lse, sc)?;
    let shape = AttentionShape::of(&q, &k, &v, sc.hi.is_some())?;
    let want = reference(&[host(&q)?, host(&k)?, host(&v)?, host(&g)?], &shape, sc);
    let mut worst = 0f64;
    for (got, want) in [&o, &dq, &dk, &dv].iter().zip(&want) {
        let got = host(got)?;
        let scale = want.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
        let err = got.iter().zip(want).fold(0f64, |m, (a, b)| {
            if (a - b).is_nan() {
                f64::INFINITY
            } else {
                m.max((a - b).abs())
            }
        });
        worst = worst.max(err / scale);
    }
    Ok(worst)
}

/// f64 attention forward and backward of `[q, k, v, grad_o]` under `sc`:
/// `[o, dq, dk, dv]`.
fn reference(x: &[Vec<f64>; 4], s: &AttentionShape, sc: &Scores) -> [Vec<f64>; 4] {
    let [q, k, v, g] = x;
    let (d, nq, nk, group) = (s.d, s.nq, s.nk, s.hq / s.hkv);
    let mut o = vec![0f64; q.len()];
    let mut dq = vec![0f64; q.len()];
    let (mut dk, mut dv) = (vec![0f64; k.len()], vec![0f64; v.len()]);
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    for h in 0..s.hq {
        let kh = h / group;
        for i in 0..nq {
            let (j0, j1) = sc.keys(i, nk);
            if j1 == j0 {
                continue;
            }
            let row = (h * nq + i) * d;
            let (qi, gi) = (&q[row..row + d], &g[row..row + d]);
            let key = |j: usize| (kh * nk + j) * d;
            // Scores, soft-capped, and d s / d (scale x).
            let (s_, dsdx): (Vec<f64>, Vec<f64>) = (j0..j1)
                .map(|j| {
                    let x = dot(qi, &k[key(j)..key(j) + d]) * sc.scale as f64;
                    match sc.softcap {
                        None => (x, 1.0),
                        Some(c) => {
                            let t = (x / c as f64).tanh();
                            (c as f64 * t, 1.0 - t * t)
                        }
                    }
                })
                .unzip();
            let m = s_.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let l: f64 = s_.iter().map(|x| (x - m).exp()).sum();
            let p: Vec<f64> = s_.iter().map(|x| (x - m).exp() / l).collect();
            for (c, j) in (j0..j1).enumerate() {
                for x in 0..d {
                    o[row + x] += p[c] * v[key(j) + x];
                }
            }
            let delta = dot(gi, &o[row..row + d]);
            for (c, j) in (j0..j1).enumerate() {
                let dp = dot(gi, &v[key(j)..key(j) + d]);
                let ds = p[c] * (dp - delta) * dsdx[c] * sc.scale as f64;
                for x in 0..d {
                    dq[row + x] += ds * k[key(j) + x];
                    dk[key(j) + x] += ds * qi[x];
                    dv[key(j) + x] += p[c] * gi[x];
                }
            }
        }
    }
    [o, dq, dk, dv]
}
