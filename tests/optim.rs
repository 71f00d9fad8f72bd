//! Host optimizers (`CpuAdamW`, `CpuSgd`) against candle-nn and f64 references,
//! state save/load/resume, and the all-or-nothing validation of a step.
//!
//! Parameters always live on the CPU; gradients are made on `dev` (so the CUDA
//! variant checks the device-to-host conversion of gradients).

use anyhow::Result;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, SGD};
use candle_streamer::streamer_autograd::{
    CpuAdamW, CpuSgd, DeviceAdamW, HostOptimizer, ParamsSgd, UpdateRule,
};

/// Shapes covering a scalar-ish bias, a small matrix, and one larger than the
/// optimizers' 64K-element parallel chunk (so the chunked path runs).
const SHAPES: [&[usize]; 3] = [&[7], &[13, 5], &[300, 230]];

fn make_vars(seed_scale: f64) -> Result<Vec<Var>> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n: usize = s.iter().product();
            let data: Vec<f32> = (0..n)
                .map(|j| ((j as f64 * 0.37 + i as f64).sin() * seed_scale) as f32)
                .collect();
            Ok(Var::from_vec(data, *s, &Device::Cpu)?)
        })
        .collect()
}

fn clone_vars(vars: &[Var]) -> Result<Vec<Var>> {
    vars.iter()
        .map(|v| Ok(Var::from_tensor(&v.as_tensor().copy()?)?))
        .collect()
}

/// Gradients for `vars`, made on `dev`, deterministic in `step`.
fn make_grads(vars: &[Var], step: usize, dev: &Device) -> Result<Vec<Tensor>> {
    vars.iter()
        .enumerate()
        .map(|(i, v)| {
            let n = v.elem_count();
            let data: Vec<f32> = (0..n)
                .map(|j| {
                    ((j * 7 + i * 13 + step * 31) as f32 * 0.173).cos() * (1.0 + step as f32 * 0.1)
                })
                .collect();
            Ok(Tensor::from_vec(data, v.shape(), dev)?)
        })
        .collect()
}

fn store(vars: &[Var], grads: &[Tensor], dev: &Device) -> Result<GradStore> {
    let mut s = GradStore::default();
    for (v, g) in vars.iter().zip(grads) {
        s.insert(v.as_tensor(), g.to_device(dev)?);
    }
    Ok(s)
}

fn values(vars: &[Var]) -> Result<Vec<Vec<f32>>> {
    vars.iter()
        .map(|v| Ok(v.as_tensor().flatten_all()?.to_vec1::<f32>()?))
        .collect()
}

/// Max over elements of |a - b| / max(|b|, 1e-6).
fn max_rel(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(&x, &y)| (x as f64 - y as f64).abs() / (y as f64).abs().max(1e-6))
        .fold(0.0, f64::max)
}

fn adamw_params() -> ParamsAdamW {
    ParamsAdamW {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.1,
    }
}

/// Steps `a` (over `va`) and `b` (over `vb`) with the same gradients, those
/// of `steps` made on `dev`, each stored on the device given beside it.
fn step_together<A: Optimizer, B: Optimizer>(
    (a, va, da): (&mut A, &[Var], &Device),
    (b, vb, db): (&mut B, &[Var], &Device),
    steps: std::ops::Range<usize>,
    dev: &Device,
) -> Result<()> {
    for step in steps {
        let g = make_grads(va, step, dev)?;
        a.step(&store(va, &g, da)?)?;
        b.step(&store(vb, &g, db)?)?;
    }
    Ok(())
}

/// SGD with momentum 0.9 over `vars`.
fn momentum_sgd(vars: &[Var]) -> Result<CpuSgd> {
    let params = ParamsSgd {
        momentum: 0.9,
        ..Default::default()
    };
    Ok(CpuSgd::new(vars.to_vec(), params)?)
}

fn cpu_adamw_matches_candle_nn_adamw_20_steps(dev: &Device) -> Result<()> {
    let ours = make_vars(1.0)?;
    let theirs = clone_vars(&ours)?;
    let mut a = CpuAdamW::new(ours.clone(), adamw_params())?;
    let mut b = AdamW::new(theirs.clone(), adamw_params())?;
    let cpu = &Device::Cpu;
    step_together((&mut a, &ours, dev), (&mut b, &theirs, cpu), 0..20, dev)?;
    let rel = max_rel(&values(&ours)?, &values(&theirs)?);
    assert!(rel <= 1e-6, "CpuAdamW vs candle-nn AdamW: max rel {rel}");
    assert_eq!(a.step_count(), 20);
    Ok(())
}
candle_streamer::test_device!(cpu_adamw_matches_candle_nn_adamw_20_steps);

fn cpu_adamw_bf16_master_tracks_f32(dev: &Device) -> Result<()> {
    let f32_vars = make_vars(1.0)?;
    let bf16_vars: Vec<Var> = f32_vars
        .iter()
        .map(|v| Ok(Var::from_tensor(&v.as_tensor().to_dtype(DType::BF16)?)?))
        .collect::<Result<_>>()?;
    let mut a = CpuAdamW::new(f32_vars.clone(), adamw_params())?;
    let mut b = CpuAdamW::new(bf16_vars.clone(), adamw_params())?;
    for step in 0..5 {
        let g = make_grads(&f32_vars, step, dev)?;
        a.step(&store(&f32_vars, &g, dev)?)?;
        let gb: Vec<Tensor> = g
            .iter()
            .map(|g| g.to_dtype(DType::BF16))
            .collect::<candle_core::Result<_>>()?;
        b.step(&store(&bf16_vars, &gb, dev)?)?;
    }
    for (x, y) in f32_vars.iter().zip(&bf16_vars) {
        let d = (x.as_tensor() - y.as_tensor().to_dtype(DType::F32)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        // bf16 keeps 8 bits of mantissa: |p| <= ~1.1 here.
        assert!(d <= 0.02, "bf16 master drifted by {d}");
    }
    Ok(())
}
candle_streamer::test_device!(cpu_adamw_bf16_master_tracks_f32);

fn cpu_sgd_plain_matches_candle_nn_sgd(dev: &Device) -> Result<()> {
    let ours = make_vars(1.0)?;
    let theirs = clone_vars(&ours)?;
    let params = ParamsSgd {
        lr: 0.05,
        ..Default::default()
    };
    let mut a = CpuSgd::new(ours.clone(), params)?;
    let mut b = SGD::new(theirs.clone(), 0.05)?;
    let cpu = &Device::Cpu;
    step_together((&mut a, &ours, dev), (&mut b, &theirs, cpu), 0..10, dev)?;
    let rel = max_rel(&values(&ours)?, &values(&theirs)?);
    assert!(rel <= 1e-6, "CpuSgd vs candle-nn SGD: max rel {rel}");
    Ok(())
}
candle_streamer::test_device!(cpu_sgd_plain_matches_candle_nn_sgd);

/// PyTorch's SGD in f64, element by element.
fn sgd_reference(p: &mut [f64], buf: &mut [f64], g: &[f64], first: bool, c: &ParamsSgd) {
    for i in 0..p.len() {
        let mut d = g[i] + c.weight_decay * p[i];
        if c.momentum != 0.0 {
            buf[i] = if first {
                d
            } else {
                c.momentum * buf[i] + (1.0 - c.dampening) * d
            };
            d = if c.nesterov {
                d + c.momentum * buf[i]
            } else {
                buf[i]
            };
        }
        p[i] -= c.lr * d;
    }
}

fn cpu_sgd_momentum_matches_f64_reference(dev: &Device) -> Result<()> {
    let configs = [
        ParamsSgd {
            lr: 0.02,
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 0.01,
            nesterov: false,
        },
        ParamsSgd {
            lr: 0.02,
            momentum: 0.8,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: true,
        },
    ];
    for c in configs {
        let vars = make_vars(1.0)?;
        let mut refp: Vec<Vec<f64>> = values(&vars)?
            .into_iter()
            .map(|v| v.into_iter().map(f64::from).collect())
            .collect();
        let mut refb: Vec<Vec<f64>> = refp.iter().map(|p| vec![0.0; p.len()]).collect();
        let mut opt = CpuSgd::new(vars.clone(), c.clone())?;
        for step in 0..10 {
            let g = make_grads(&vars, step, dev)?;
            opt.step(&store(&vars, &g, dev)?)?;
            for (i, g) in g.iter().enumerate() {
                let g: Vec<f64> = g
                    .flatten_all()?
                    .to_vec1::<f32>()?
                    .into_iter()
                    .map(f64::from)
                    .collect();
                sgd_reference(&mut refp[i], &mut refb[i], &g, step == 0, &c);
            }
        }
        let got = values(&vars)?;
        for (x, y) in got.iter().flatten().zip(refp.iter().flatten()) {
            let err = (*x as f64 - y).abs();
            assert!(err <= 1e-5 * (1.0 + y.abs()), "{c:?}: {x} vs f64 {y}");
        }
    }
    Ok(())
}
candle_streamer::test_device!(cpu_sgd_momentum_matches_f64_reference);

fn dev_tag(dev: &Device) -> &'static str {
    if dev.is_cpu() {
        "cpu"
    } else {
        "dev"
    }
}

fn temp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("optim-{}-{name}.safetensors", std::process::id()))
}

/// Steps `opt` (over `vars`) `steps` times with the test gradients, then
/// saves its state to the temporary file `name`; returns its path.
fn step_and_save<R: UpdateRule>(
    opt: &mut HostOptimizer<R>,
    vars: &[Var],
    steps: usize,
    name: &str,
    dev: &Device,
) -> Result<std::path::PathBuf> {
    for step in 0..steps {
        opt.step(&store(vars, &make_grads(vars, step, dev)?, dev)?)?;
    }
    let path = temp_path(name);
    opt.save(&path)?;
    Ok(path)
}

/// Steps `a` (over `first`) and `b` (over `second`) with the same gradient,
/// that of step `step`: the parameters agree exactly.
fn step_both_agree<R: UpdateRule>(
    (a, first): (&mut HostOptimizer<R>, &[Var]),
    (b, second): (&mut HostOptimizer<R>, &[Var]),
    step: usize,
    dev: &Device,
) -> Result<()> {
    let g = make_grads(first, step, dev)?;
    a.step(&store(first, &g, dev)?)?;
    b.step(&store(second, &g, dev)?)?;
    assert_eq!(values(first)?, values(second)?);
    Ok(())
}

fn cpu_adamw_state_resume_gives_same_next_step(dev: &Device) -> Result<()> {
    let names: Vec<String> = ["bias", "small.weight", "big.weight"]
        .map(String::from)
        .to_vec();
    let first = make_vars(1.0)?;
    let mut a = CpuAdamW::new(first.clone(), adamw_params())?;
    a.set_param_names(names.clone())?;
    let path = step_and_save(&mut a, &first, 5, &format!("adamw-{}", dev_tag(dev)), dev)?;

    // A fresh optimizer over a copy of the params, with other hyper-params:
    // load restores the saved ones.
    let second = clone_vars(&first)?;
    let mut b = CpuAdamW::new(second.clone(), ParamsAdamW::default())?;
    b.set_param_names(names)?;
    b.load(&path)?;
    assert_eq!(b.step_count(), 5);
    assert_eq!(b.params().weight_decay, 0.1);

    step_both_agree((&mut a, &first), (&mut b, &second), 5, dev)?;
    for i in 0..first.len() {
        assert_eq!(a.moments(i), b.moments(i));
    }

    // A file for other shapes is refused, naming the tensor, and nothing changes.
    let other = vec![
        Var::zeros(7, DType::F32, &Device::Cpu)?,
        Var::zeros((13, 5), DType::F32, &Device::Cpu)?,
        Var::zeros((230, 300), DType::F32, &Device::Cpu)?,
    ];
    let mut c = CpuAdamW::new(other, adamw_params())?;
    c.set_param_names(
        ["bias", "small.weight", "big.weight"]
            .map(String::from)
            .to_vec(),
    )?;
    // Each refusal is a bad checkpoint naming the file, and the reason.
    let bad_file = |e: candle_core::Error, why: &str| {
        assert!(
            matches!(streamer_device::Error::find(&e),
                Some(streamer_device::Error::Checkpoint { path: p, reason })
                    if p == &path && reason.contains(why)),
            "{e}"
        );
    };
    bad_file(c.load(&path).unwrap_err(), "m.big.weight");
    assert_eq!(c.step_count(), 0);
    // Wrong kind and wrong count are refused too.
    let mut s = CpuSgd::new(make_vars(1.0)?, ParamsSgd::default())?;
    bad_file(s.load(&path).unwrap_err(), "CpuAdamW");
    let mut d = CpuAdamW::new(make_vars(1.0)?[..2].to_vec(), adamw_params())?;
    bad_file(d.load(&path).unwrap_err(), "3 params");
    std::fs::remove_file(&path)?;
    Ok(())
}
candle_streamer::test_device!(cpu_adamw_state_resume_gives_same_next_step);

fn cpu_sgd_state_resume_gives_same_next_step(dev: &Device) -> Result<()> {
    let params = ParamsSgd {
        lr: 0.02,
        momentum: 0.9,
        ..Default::default()
    };
    let first = make_vars(1.0)?;
    let mut a = CpuSgd::new(first.clone(), params.clone())?;
    let path = step_and_save(&mut a, &first, 3, &format!("sgd-{}", dev_tag(dev)), dev)?;
    let second = clone_vars(&first)?;
    let mut b = CpuSgd::new(second.clone(), ParamsSgd::default())?;
    b.load(&path)?;
    assert_eq!(b.params(), &params);
    step_both_agree((&mut a, &first), (&mut b, &second), 3, dev)?;
    std::fs::remove_file(&path)?;
    Ok(())
}
candle_streamer::test_device!(cpu_sgd_state_resume_gives_same_next_step);

fn shape_mismatch_errors_and_leaves_params_untouched(dev: &Device) -> Result<()> {
    let vars = make_vars(1.0)?;
    let before = values(&vars)?;
    let mut g = make_grads(&vars, 0, dev)?;
    g[2] = Tensor::zeros((230, 300), DType::F32, dev)?;
    let grads = store(&vars, &g, dev)?;

    let mut a = CpuAdamW::new(vars.clone(), adamw_params())?;
    let err = a.step(&grads).unwrap_err().to_string();
    assert!(
        err.contains("param 2") && err.contains("[300, 230]") && err.contains("[230, 300]"),
        "{err}"
    );
    assert_eq!(values(&vars)?, before);
    assert_eq!(a.step_count(), 0);
    assert!(a
        .moments(0)
        .is_some_and(|(m, _)| m.iter().all(|&x| x == 0.0)));

    let mut s = momentum_sgd(&vars)?;
    let err = s.step(&grads).unwrap_err().to_string();
    assert!(err.contains("param 2"), "{err}");
    assert_eq!(values(&vars)?, before);
    Ok(())
}
candle_streamer::test_device!(shape_mismatch_errors_and_leaves_params_untouched);

fn missing_grads_are_skipped_like_candle_nn(dev: &Device) -> Result<()> {
    let ours = make_vars(1.0)?;
    let theirs = clone_vars(&ours)?;
    let before = values(&ours)?;
    let mut a = CpuAdamW::new(ours.clone(), adamw_params())?;
    let mut b = AdamW::new(theirs.clone(), adamw_params())?;
    for step in 0..3 {
        // Only params 0 and 2 get gradients.
        let g = make_grads(&ours, step, dev)?;
        let mut ga = GradStore::default();
        let mut gb = GradStore::default();
        for i in [0, 2] {
            ga.insert(ours[i].as_tensor(), g[i].clone());
            gb.insert(theirs[i].as_tensor(), g[i].to_device(&Device::Cpu)?);
        }
        a.step(&ga)?;
        b.step(&gb)?;
    }
    let after = values(&ours)?;
    assert_eq!(after[1], before[1]);
    assert_ne!(after[0], before[0]);
    assert!(max_rel(&after, &values(&theirs)?) <= 1e-6);
    Ok(())
}
candle_streamer::test_device!(missing_grads_are_skipped_like_candle_nn);

fn subset_steps_equal_one_full_step(dev: &Device) -> Result<()> {
    let full = make_vars(1.0)?;
    let split = clone_vars(&full)?;
    let mut a = CpuAdamW::new(full.clone(), adamw_params())?;
    let mut b = CpuAdamW::new(split.clone(), adamw_params())?;
    for step in 0..3 {
        let g = make_grads(&full, step, dev)?;
        a.step(&store(&full, &g, dev)?)?;
        // The overlapped order: last block's params first, as backward produces them.
        let gs = store(&split, &g, dev)?;
        b.begin_step();
        b.step_params(&gs, &[2])?;
        b.step_tensors(&[(1, &g[1]), (0, &g[0])])?;
        let err = b.step_params(&gs, &[0]).unwrap_err().to_string();
        assert!(err.contains("already stepped"), "{err}");
    }
    assert_eq!(values(&full)?, values(&split)?);
    Ok(())
}
candle_streamer::test_device!(subset_steps_equal_one_full_step);

/// Every bit of the params, the AdamW moments and the step count.
/// Params' bits, moments' bits, step count.
type Snapshot = (Vec<Vec<u32>>, Vec<Vec<u32>>, usize);

fn adamw_snapshot(vars: &[Var], a: &CpuAdamW) -> Result<Snapshot> {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let params = values(vars)?.iter().map(|v| bits(v)).collect();
    let moments = (0..vars.len())
        .flat_map(|i| {
            let (m, v) = a.moments(i).expect("moments");
            [bits(&m), bits(&v)]
        })
        .collect();
    Ok((params, moments, a.step_count()))
}

fn non_finite_gradient_is_refused_and_changes_nothing(dev: &Device) -> Result<()> {
    let vars = make_vars(1.0)?;
    let mut a = CpuAdamW::new(vars.clone(), adamw_params())?;
    a.set_param_names(vec!["bias".into(), "small".into(), "big".into()])?;
    let twin = clone_vars(&vars)?;
    let mut b = CpuAdamW::new(twin.clone(), adamw_params())?;
    b.set_param_names(a.param_names().to_vec())?;
    step_together((&mut a, &vars, dev), (&mut b, &twin, dev), 0..3, dev)?;
    // The bad value in the small param, and in the last 64K chunk of the big one.
    for (param, elem) in [(1usize, 3usize), (2, 300 * 230 - 5)] {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let before = adamw_snapshot(&vars, &a)?;
            let mut g = make_grads(&vars, 3, dev)?;
            let mut flat = g[param].flatten_all()?.to_vec1::<f32>()?;
            flat[elem] = bad;
            g[param] = Tensor::from_vec(flat, g[param].shape(), dev)?;
            let e = a.step(&store(&vars, &g, dev)?).unwrap_err().to_string();
            let name = ["bias", "small", "big"][param];
            assert!(
                e.contains(&format!("param {param} ({name})"))
                    && e.contains(&format!("{bad}"))
                    && e.contains(&format!("element {elem}")),
                "{e}"
            );
            assert!(
                adamw_snapshot(&vars, &a)? == before,
                "a refused step changed state"
            );
            // The overlapped path (a subset within begun step) refuses too.
            a.begin_step();
            let e = a
                .step_tensors(&[(param, &g[param])])
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("param {param}")), "{e}");
            let (p, m, _) = adamw_snapshot(&vars, &a)?;
            assert!(
                p == before.0 && m == before.1,
                "a refused subset step changed state"
            );
            // Undo the begun step by reloading (the documented way back).
            let path = temp_path(&format!("nan-{param}-{}-{}", bad.is_nan(), dev_tag(dev)));
            b.save(&path)?;
            a.load(&path)?;
            let _ = std::fs::remove_file(&path);
        }
    }
    // The next good step is the one a run that never saw a bad gradient takes.
    step_together((&mut a, &vars, dev), (&mut b, &twin, dev), 3..4, dev)?;
    assert!(adamw_snapshot(&vars, &a)? == adamw_snapshot(&twin, &b)?);
    a.check_finite()?;

    let mut s = momentum_sgd(&vars)?;
    let mut g = make_grads(&vars, 0, dev)?;
    g[0] = g[0].affine(0.0, f64::NAN)?;
    let before = values(&vars)?;
    let e = s.step(&store(&vars, &g, dev)?).unwrap_err().to_string();
    assert!(e.contains("param 0") && e.contains("NaN"), "{e}");
    assert_eq!(s.step_count(), 0);
    assert!(values(&vars)?
        .iter()
        .flatten()
        .zip(before.iter().flatten())
        .all(|(x, y)| x.to_bits() == y.to_bits()));
    Ok(())
}
candle_streamer::test_device!(non_finite_gradient_is_refused_and_changes_nothing);

fn non_finite_hyper_parameters_are_refused(dev: &Device) -> Result<()> {
    let vars = make_vars(1.0)?;
    for (lr, wd, want) in [
        (f64::NAN, 0.0, "learning rate"),
        (f64::INFINITY, 0.0, "learning rate"),
        (-1e-3, 0.0, "learning rate"),
        (1e-3, f64::NAN, "weight_decay"),
        (0.5, 2.0, "weight_decay"),
    ] {
        let p = ParamsAdamW {
            lr,
            weight_decay: wd,
            ..adamw_params()
        };
        let e = CpuAdamW::new(vars.clone(), p).unwrap_err().to_string();
        assert!(e.contains(want), "lr {lr} wd {wd}: {e}");
        let p = ParamsSgd {
            lr,
            weight_decay: wd,
            ..Default::default()
        };
        // (SGD's coupled decay has no 1 / lr bound.)
        if !(lr.is_finite() && lr >= 0.0 && wd.is_finite()) {
            let e = CpuSgd::new(vars.clone(), p).unwrap_err().to_string();
            assert!(e.contains(want), "sgd lr {lr} wd {wd}: {e}");
        }
    }
    // A learning rate set to NaN later is refused at the step, before any change.
    let mut a = CpuAdamW::new(vars.clone(), adamw_params())?;
    let grads = store(&vars, &make_grads(&vars, 0, dev)?, dev)?;
    a.step(&grads)?;
    let before = adamw_snapshot(&vars, &a)?;
    a.set_learning_rate(f64::NAN);
    let e = a.step(&grads).unwrap_err().to_string();
    assert!(e.contains("learning rate") && e.contains("NaN"), "{e}");
    assert!(adamw_snapshot(&vars, &a)? == before);
    let mut s = CpuSgd::new(vars.clone(), ParamsSgd::default())?;
    s.set_learning_rate(f64::NAN);
    let e = s.step(&grads).unwrap_err().to_string();
    assert!(e.contains("learning rate") && e.contains("NaN"), "{e}");
    assert!(adamw_snapshot(&vars, &a)? == before);
    // A NaN put into a parameter by other code is found before a save.
    vars[1].set(&vars[1].as_tensor().affine(1.0, f64::NAN)?)?;
    let e = a.check_finite().unwrap_err().to_string();
    assert!(e.contains("param 1") && e.contains("NaN"), "{e}");
    let e = s.check_finite().unwrap_err().to_string();
    assert!(e.contains("param 1"), "{e}");
    Ok(())
}
candle_streamer::test_device!(non_finite_hyper_parameters_are_refused);

/// A state file in the documented format (`crate::optim_state`: f32 buffers
/// `<buffer>.<name>`, an i64 `last_step`, metadata `kind`, `num_params`,
/// `step` and the hyper-parameters), written here with the safetensors crate
/// rather than by the optimizers, as files saved before the optimizers shared
/// one skeleton were: both load it exactly, and a buffer the hyper-parameters
/// do not use is refused.
fn state_files_of_the_documented_format_load(dev: &Device) -> Result<()> {
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;
    let vars = make_vars(1.0)?;
    let n: Vec<usize> = vars.iter().map(|v| v.elem_count()).collect();
    let buf = |k: usize, i: usize| -> Vec<u8> {
        (0..n[i])
            .flat_map(|j| ((j * 7 + i * 3 + k) as f32 * 0.001).to_le_bytes())
            .collect()
    };
    let last: Vec<u8> = [5i64, 0, 4].iter().flat_map(|x| x.to_le_bytes()).collect();
    let write = |path: &std::path::Path, prefixes: &[&str], meta: &[(&str, &str)]| -> Result<()> {
        let mut data = vec![("last_step".to_string(), Dtype::I64, vec![3], last.clone())];
        for (k, p) in prefixes.iter().enumerate() {
            for (i, v) in vars.iter().enumerate() {
                data.push((format!("{p}.{i}"), Dtype::F32, v.dims().to_vec(), buf(k, i)));
            }
        }
        let views: Vec<(String, TensorView)> = data
            .iter()
            .map(|(name, dt, shape, bytes)| {
                Ok((name.clone(), TensorView::new(*dt, shape.clone(), bytes)?))
            })
            .collect::<Result<_>>()?;
        let mut m: std::collections::HashMap<String, String> = meta
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        m.insert("num_params".into(), "3".into());
        m.insert("step".into(), "5".into());
        safetensors::serialize_to_file(views, Some(m), path)?;
        Ok(())
    };
    let f32s = |bytes: Vec<u8>| -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    };
    let path = temp_path(&format!("format-adamw-{}", dev_tag(dev)));
    let adam_meta = [
        ("kind", "CpuAdamW"),
        ("lr", "0.001"),
        ("beta1", "0.9"),
        ("beta2", "0.999"),
        ("eps", "1e-8"),
        ("weight_decay", "0.01"),
    ];
    write(&path, &["m", "v"], &adam_meta)?;
    let mut a = CpuAdamW::new(vars.clone(), ParamsAdamW::default())?;
    a.load(&path)?;
    assert_eq!(a.step_count(), 5);
    assert_eq!(a.params().weight_decay, 0.01);
    for i in 0..3 {
        let (m, v) = a.moments(i).expect("moments");
        assert!(m == f32s(buf(0, i)) && v == f32s(buf(1, i)), "param {i}");
    }
    let sgd_meta = [
        ("kind", "CpuSgd"),
        ("lr", "0.01"),
        ("momentum", "0.9"),
        ("dampening", "0"),
        ("weight_decay", "0"),
        ("nesterov", "true"),
    ];
    write(&path, &["momentum"], &sgd_meta)?;
    let mut s = CpuSgd::new(vars.clone(), ParamsSgd::default())?;
    s.load(&path)?;
    assert!(s.params().nesterov && s.params().momentum == 0.9 && s.step_count() == 5);
    for i in 0..3 {
        assert!(
            s.momentum_buffer(i).as_deref() == Some(&f32s(buf(0, i))[..]),
            "param {i}"
        );
    }
    // Momentum 0 with a momentum buffer in the file: refused, nothing changes.
    let no_momentum = [
        ("kind", "CpuSgd"),
        ("lr", "0.01"),
        ("momentum", "0"),
        ("dampening", "0"),
        ("weight_decay", "0"),
        ("nesterov", "false"),
    ];
    write(&path, &["momentum"], &no_momentum)?;
    let e = s.load(&path).unwrap_err().to_string();
    assert!(e.contains("\"momentum.0\""), "{e}");
    assert!(
        s.params().momentum == 0.9 && s.momentum_buffer(0).as_deref() == Some(&f32s(buf(0, 0))[..])
    );
    std::fs::remove_file(&path)?;
    Ok(())
}
candle_streamer::test_device!(state_files_of_the_documented_format_load);

/// Copies of `vars` on `dev`.
fn copies_on(vars: &[Var], dev: &Device) -> Result<Vec<Var>> {
    vars.iter()
        .map(|v| Ok(Var::from_tensor(&v.as_tensor().to_device(dev)?)?))
        .collect()
}

/// `DeviceAdamW` on params living on `dev` (f32 and bf16) against `CpuAdamW`
/// on host copies, 10 steps: its kernel rounds each operation as the host
/// optimizer does, so f32 params agree to 1e-6 relative (bit-equal in
/// practice) and bf16 params to one bf16 rounding (2^-8 relative).
fn device_adamw_matches_cpu_adamw(dev: &Device) -> Result<()> {
    for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 1.0 / 256.0)] {
        let host = make_vars(1.0)?
            .iter()
            .map(|v| Ok(Var::from_tensor(&v.as_tensor().to_dtype(dtype)?)?))
            .collect::<Result<Vec<_>>>()?;
        let on_dev = copies_on(&host, dev)?;
        let mut a = CpuAdamW::new(host.clone(), adamw_params())?;
        let mut b = DeviceAdamW::new(on_dev.clone(), adamw_params(), dev)?;
        let cpu = &Device::Cpu;
        step_together((&mut a, &host, cpu), (&mut b, &on_dev, dev), 0..10, dev)?;
        let f32s = |vs: &[Var]| -> Result<Vec<Vec<f32>>> {
            vs.iter()
                .map(|v| {
                    Ok(v.as_tensor()
                        .to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1::<f32>()?)
                })
                .collect()
        };
        let rel = max_rel(&f32s(&on_dev)?, &f32s(&host)?);
        assert!(
            rel <= tol,
            "DeviceAdamW {dtype:?} vs CpuAdamW: max rel {rel}"
        );
        assert_eq!(b.step_count(), 10);
    }
    Ok(())
}
candle_streamer::test_device!(device_adamw_matches_cpu_adamw);

/// A NaN in one gradient refuses the whole `DeviceAdamW` step, naming the
/// param; no param, moment or step count changes.
fn device_adamw_refuses_non_finite_and_changes_nothing(dev: &Device) -> Result<()> {
    let vars = copies_on(&make_vars(1.0)?, dev)?;
    let mut opt = DeviceAdamW::new(vars.clone(), adamw_params(), dev)?;
    opt.step(&store(&vars, &make_grads(&vars, 0, dev)?, dev)?)?;
    let before = values(&vars)?;
    let moments = (0..vars.len())
        .map(|i| opt.moments(i))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let mut g = make_grads(&vars, 1, dev)?;
    let mut bad = g[2].flatten_all()?.to_vec1::<f32>()?;
    bad[77] = f32::NAN;
    g[2] = Tensor::from_vec(bad, g[2].shape(), dev)?;
    let err = opt.step(&store(&vars, &g, dev)?).unwrap_err().to_string();
    assert!(
        err.contains("param 2") && err.contains("not finite"),
        "{err}"
    );
    assert_eq!(values(&vars)?, before, "params changed");
    for (i, m) in moments.iter().enumerate() {
        assert_eq!(&opt.moments(i)?, m, "moments of param {i} changed");
    }
    assert_eq!(opt.step_count(), 1);
    Ok(())
}
candle_streamer::test_device!(device_adamw_refuses_non_finite_and_changes_nothing);

/// `DeviceAdamW` saves `CpuAdamW`'s format: state saved by either resumes in
/// the other, and the next step agrees (1e-6 relative).
fn device_adamw_state_interchanges_with_cpu_adamw(dev: &Device) -> Result<()> {
    let host = make_vars(1.0)?;
    let on_dev = copies_on(&host, dev)?;
    let mut a = CpuAdamW::new(host.clone(), adamw_params())?;
    let mut b = DeviceAdamW::new(on_dev.clone(), adamw_params(), dev)?;
    let cpu = &Device::Cpu;
    step_together((&mut a, &host, cpu), (&mut b, &on_dev, dev), 0..3, dev)?;
    let (pa, pb) = (
        temp_path(&format!("xchg-a-{}", dev_tag(dev))),
        temp_path(&format!("xchg-b-{}", dev_tag(dev))),
    );
    a.save(&pa)?;
    b.save(&pb)?;
    // Cross-load: the CPU optimizer takes the device one's file and vice versa.
    let host2 = clone_vars(&host)?;
    let dev2 = on_dev
        .iter()
        .map(|v| Ok(Var::from_tensor(&v.as_tensor().copy()?)?))
        .collect::<Result<Vec<_>>>()?;
    let mut a2 = CpuAdamW::new(host2.clone(), ParamsAdamW::default())?;
    a2.load(&pb)?;
    let mut b2 = DeviceAdamW::new(dev2.clone(), ParamsAdamW::default(), dev)?;
    b2.load(&pa)?;
    assert_eq!((a2.step_count(), b2.step_count()), (3, 3));
    step_together((&mut a2, &host2, cpu), (&mut b2, &dev2, dev), 3..4, dev)?;
    let rel = max_rel(&values(&dev2)?, &values(&host2)?);
    assert!(rel <= 1e-6, "resumed across optimizers: max rel {rel}");
    std::fs::remove_file(pa)?;
    std::fs::remove_file(pb)?;
    Ok(())
}
candle_streamer::test_device!(device_adamw_state_interchanges_with_cpu_adamw);
