//! Small reporting helpers shared by the examples and benches: an SVG line plot
//! (no plotting dependency needed for a loss curve or a ratio chart).

/// A small line plot as SVG: one polyline per series over a log2 x axis
/// (`log_x`) or a linear one.
pub fn svg_plot_axes(
    log_x: bool,
    title: &str,
    xlabel: &str,
    ylabel: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> String {
    let (w, h, m) = (640.0, 400.0, 60.0);
    let fx = |x: f64| if log_x { x.log2() } else { x };
    let pts = series.iter().flat_map(|s| s.1.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, 0.0f64, f64::MIN);
    for &(x, y) in pts {
        x0 = x0.min(fx(x));
        x1 = x1.max(fx(x));
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    y1 = y1.max(y0 + 1e-9) * 1.1;
    let sx = |x: f64| m + (fx(x) - x0) / (x1 - x0) * (w - 2.0 * m);
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
            "<text x='{}' y='{}' text-anchor='end'>{}</text>",
            m - 5.0,
            sy(y) + 4.0,
            tick(y)
        );
    }
    let mut xs: Vec<f64> = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.0))
        .collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    if xs.len() > 10 {
        // Label about eight evenly spaced points, not every one.
        let step = xs.len().div_ceil(8);
        xs = xs.into_iter().step_by(step).collect();
    }
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

/// [`svg_plot_axes`] with a log2 x axis (sizes, token counts).
pub fn svg_plot(
    title: &str,
    xlabel: &str,
    ylabel: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> String {
    svg_plot_axes(true, title, xlabel, ylabel, series)
}

/// A tick label readable at any scale.
fn tick(v: f64) -> String {
    if v == 0.0 || (1e-2..1e4).contains(&v.abs()) {
        format!("{v:.2}")
    } else {
        format!("{v:.1e}")
    }
}
