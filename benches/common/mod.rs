//! Shared by the bench binaries: device choice, timing, results files and plots.
#![allow(dead_code)]
use candle_core::Device;
use std::path::PathBuf;
use std::time::Instant;

/// The first CUDA GPU when built with `cuda` and one is present, else the CPU.
pub fn device() -> Device {
    #[cfg(feature = "cuda")]
    if let Ok(d) = Device::new_cuda_with_stream(0) {
        return d;
    }
    Device::Cpu
}

/// A short tag for file names: "h200" for an H200, "cpu" otherwise.
pub fn device_tag(dev: &Device) -> String {
    if dev.is_cuda() {
        std::env::var("BENCH_DEVICE_TAG").unwrap_or_else(|_| "h200".into())
    } else {
        "cpu".into()
    }
}

/// Median seconds of `iters` runs of `f` after `warmup` runs, synchronizing the
/// device before each timer starts and stops.
pub fn time_median(
    dev: &Device,
    warmup: usize,
    iters: usize,
    mut f: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    dev.synchronize()?;
    let mut t = Vec::with_capacity(iters);
    for _ in 0..iters {
        dev.synchronize()?;
        let s = Instant::now();
        f()?;
        dev.synchronize()?;
        t.push(s.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// Where a result file goes: `$BENCH_RESULTS_DIR` or `benches/results`.
pub fn results_path(name: &str) -> PathBuf {
    let dir = std::env::var("BENCH_RESULTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("benches")
                .join("results")
        });
    let _ = std::fs::create_dir_all(&dir);
    dir.join(name)
}

/// A small line plot as SVG: one polyline per series over a log2 x axis.
pub fn svg_plot(
    title: &str,
    xlabel: &str,
    ylabel: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> String {
    let (w, h, m) = (640.0, 400.0, 60.0);
    let pts = series.iter().flat_map(|s| s.1.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, 0.0f64, f64::MIN);
    for &(x, y) in pts {
        x0 = x0.min(x.log2());
        x1 = x1.max(x.log2());
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    y1 = y1.max(y0 + 1e-9) * 1.1;
    let sx = |x: f64| m + (x.log2() - x0) / (x1 - x0) * (w - 2.0 * m);
    let sy = |y: f64| h - m - (y - y0) / (y1 - y0) * (h - 2.0 * m);
    let colors = [
        "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
    ];
    let mut s = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' font-size='12'>\
         <rect width='100%' height='100%' fill='white'/>\
         <text x='{}' y='20' text-anchor='middle' font-size='14'>{title}</text>\
         <line x1='{m}' y1='{}' x2='{}' y2='{}' stroke='black'/><line x1='{m}' y1='{m}' x2='{m}' y2='{}' stroke='black'/>\
         <text x='{}' y='{}' text-anchor='middle'>{xlabel}</text>\
         <text x='15' y='{}' transform='rotate(-90 15 {})' text-anchor='middle'>{ylabel}</text>",
        w / 2.0, h - m, w - m, h - m, h - m, w / 2.0, h - 15.0, h / 2.0, h / 2.0
    );
    for i in 0..=4 {
        let y = y0 + (y1 - y0) * i as f64 / 4.0;
        s += &format!(
            "<text x='{}' y='{}' text-anchor='end'>{y:.2}</text>",
            m - 5.0,
            sy(y) + 4.0
        );
    }
    let mut xs: Vec<f64> = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.0))
        .collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    for x in xs {
        s += &format!(
            "<text x='{}' y='{}' text-anchor='middle'>{x}</text>",
            sx(x),
            h - m + 15.0
        );
    }
    for (i, (name, p)) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        let line: Vec<String> = p
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        s += &format!(
            "<polyline fill='none' stroke='{c}' stroke-width='2' points='{}'/>",
            line.join(" ")
        );
        for &(x, y) in p {
            s += &format!(
                "<circle cx='{:.1}' cy='{:.1}' r='3' fill='{c}'/>",
                sx(x),
                sy(y)
            );
        }
        s += &format!(
            "<text x='{}' y='{}' fill='{c}'>{name}</text>",
            w - m - 150.0,
            m + 15.0 * i as f64
        );
    }
    s + "</svg>"
}
