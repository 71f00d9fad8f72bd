//! Reporting helpers shared by the examples and benches: line plots as SVG
//! (through `plotters`' SVG backend), and training progress that a person can
//! read anywhere: an indicatif bar on a terminal, a plain line every N steps
//! when stderr is a file or a pipe (where the bar hides itself).
use indicatif::{ProgressBar, ProgressStyle};
use plotters::prelude::*;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// The series of a plot: `(name, points (x, y))`.
pub type Series = [(String, Vec<(f64, f64)>)];

/// A line plot as SVG: one line (with point markers up to 100 points) per series over a log2 x
/// axis (`log_x`) or a linear one, y from 0 (or the smallest negative value).
/// Drawing errors (which plotters reports for degenerate input) give an SVG
/// that shows the error instead.
pub fn svg_plot_axes(
    log_x: bool,
    title: &str,
    xlabel: &str,
    ylabel: &str,
    series: &Series,
) -> String {
    try_svg_plot_axes(log_x, title, xlabel, ylabel, series).unwrap_or_else(|e| {
        format!(
            "<svg xmlns='http://www.w3.org/2000/svg' width='640' height='80'>\
             <text x='10' y='40'>{}: {}</text></svg>",
            escape(title),
            escape(&e)
        )
    })
}

/// [`svg_plot_axes`] with a log2 x axis (sizes, token counts).
pub fn svg_plot(title: &str, xlabel: &str, ylabel: &str, series: &Series) -> String {
    svg_plot_axes(true, title, xlabel, ylabel, series)
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The x and y ranges of every finite point (x positive on a log axis).
fn bounds(log_x: bool, series: &Series) -> (f64, f64, f64, f64) {
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, 0.0f64, f64::MIN);
    let pts = series.iter().flat_map(|s| s.1.iter());
    for &(x, y) in pts.filter(|(x, y)| x.is_finite() && y.is_finite() && (!log_x || *x > 0.0)) {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1) = (1.0, 2.0);
    }
    if x1 <= x0 {
        x1 = if log_x { x0 * 2.0 } else { x0 + 1.0 };
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    (x0, x1, y0, y0 + (y1 - y0) * 1.1)
}

/// [`svg_plot_axes`], with plotters' error as text.
pub fn try_svg_plot_axes(
    log_x: bool,
    title: &str,
    xlabel: &str,
    ylabel: &str,
    series: &Series,
) -> Result<String, String> {
    let (x0, x1, y0, y1) = bounds(log_x, series);
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (640, 400)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut chart = ChartBuilder::on(&root);
        chart
            .caption(title, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(64);
        let labels = (xlabel, ylabel);
        if log_x {
            let c = chart
                .build_cartesian_2d((x0..x1).log_scale().base(2.0), y0..y1)
                .map_err(|e| e.to_string())?;
            draw(c, labels, series, log_x)?;
        } else {
            let c = chart
                .build_cartesian_2d(x0..x1, y0..y1)
                .map_err(|e| e.to_string())?;
            draw(c, labels, series, log_x)?;
        }
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(out)
}

const COLORS: [RGBColor; 6] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x8c, 0x56, 0x4b),
];

/// Series longer than this are drawn without point markers (a loss curve of
/// thousands of steps).
const MAX_MARKERS: usize = 100;

/// Mesh, one line and its markers per series, and the legend.
fn draw<'a, X>(
    mut chart: ChartContext<
        'a,
        SVGBackend<'a>,
        Cartesian2d<X, plotters::coord::types::RangedCoordf64>,
    >,
    (xlabel, ylabel): (&str, &str),
    series: &Series,
    log_x: bool,
) -> Result<(), String>
where
    X: Ranged<ValueType = f64> + plotters::coord::ranged1d::ValueFormatter<f64>,
{
    chart
        .configure_mesh()
        .x_desc(xlabel)
        .y_desc(ylabel)
        .x_label_formatter(&|x| tick(*x))
        .y_label_formatter(&|y| tick(*y))
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let pts: Vec<(f64, f64)> = pts
            .iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite() && (!log_x || *x > 0.0))
            .collect();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        if pts.len() <= MAX_MARKERS {
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled())))
                .map_err(|e| e.to_string())?;
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| e.to_string())
}

/// A tick label readable at any scale.
fn tick(v: f64) -> String {
    if v == v.round() && v.abs() < 1e9 {
        format!("{v:.0}")
    } else if (1e-2..1e4).contains(&v.abs()) {
        let s = format!("{v:.2}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        format!("{v:.1e}")
    }
}

/// `1h02m03s`, `4m05s` or `6s` (whole seconds).
///
/// ```
/// use candle_streamer::report::format_duration;
/// use std::time::Duration;
/// assert_eq!(format_duration(Duration::from_secs(3723)), "1h02m03s");
/// assert_eq!(format_duration(Duration::from_secs(245)), "4m05s");
/// assert_eq!(format_duration(Duration::from_millis(6400)), "6s");
/// ```
pub fn format_duration(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, m, sec) => format!("{m}m{sec:02}s"),
        (h, m, sec) => format!("{h}h{m:02}m{sec:02}s"),
    }
}

/// One plain progress line: `step 40/200  loss 2.3456  1234 tokens/s  elapsed
/// 12s  eta 48s`. `done` of the run's `total` steps, `first` the step it
/// started from (a resumed run), `elapsed` since then: the ETA extrapolates
/// the steps done in this run.
pub fn progress_line(
    step: usize,
    total: usize,
    first: usize,
    loss: f32,
    tokens_per_s: f64,
    elapsed: Duration,
) -> String {
    let done = step.saturating_sub(first);
    let left = total.saturating_sub(step);
    let eta = if done == 0 {
        "?".to_string()
    } else {
        format_duration(elapsed.mul_f64(left as f64 / done as f64))
    };
    format!(
        "step {step}/{total}  loss {loss:.4}  {tokens_per_s:.0} tokens/s  elapsed {}  eta {eta}",
        format_duration(elapsed)
    )
}

/// Training progress: a bar when stderr is a terminal, otherwise a plain
/// [`progress_line`] on stderr every `every` steps (and at the last step), so
/// that a log shows how a run goes.
pub struct Progress {
    bar: Option<ProgressBar>,
    every: usize,
    first: usize,
    total: usize,
    t0: Instant,
}

impl Progress {
    /// Progress over steps `first..total`; `every` 0 picks about 20 lines a run.
    pub fn new(first: usize, total: usize, every: usize) -> Self {
        Self::with_terminal(first, total, every, std::io::stderr().is_terminal())
    }

    /// [`Progress::new`] with the terminal test given (`false`: plain lines).
    pub fn with_terminal(first: usize, total: usize, every: usize, terminal: bool) -> Self {
        let bar = terminal.then(|| {
            let b = ProgressBar::new(total.saturating_sub(first) as u64);
            if let Ok(style) = ProgressStyle::with_template(
                "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
            ) {
                b.set_style(style);
            }
            b
        });
        let every = if every == 0 {
            total.saturating_sub(first).div_ceil(20).max(1)
        } else {
            every
        };
        Self {
            bar,
            every,
            first,
            total,
            t0: Instant::now(),
        }
    }

    /// Steps between plain lines.
    pub fn every(&self) -> usize {
        self.every
    }

    /// After step `step` (1-based, counted over the whole run): the plain
    /// line it prints, if any (the bar is updated instead on a terminal).
    pub fn update(&self, step: usize, loss: f32, tokens_per_s: f64) -> Option<String> {
        if let Some(b) = &self.bar {
            b.set_message(format!("loss {loss:.4}  {tokens_per_s:.0} tokens/s"));
            b.set_position(step.saturating_sub(self.first) as u64);
            return None;
        }
        if !step.is_multiple_of(self.every) && step != self.total {
            return None;
        }
        let line = progress_line(
            step,
            self.total,
            self.first,
            loss,
            tokens_per_s,
            self.t0.elapsed(),
        );
        eprintln!("{line}");
        Some(line)
    }

    /// A message above the bar, or on its own line.
    pub fn println(&self, msg: &str) {
        match &self.bar {
            Some(b) => b.println(msg),
            None => eprintln!("{msg}"),
        }
    }

    /// Ends the bar.
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish();
        }
    }
}

/// A plain line for setup event `e` of the model named `label`, when one is
/// due: the weights quantized and the masters at every quarter of their
/// count, the start of page-locking, and the end with each phase's time.
pub fn setup_line(label: &str, e: &streamer_core::SetupEvent) -> Option<String> {
    use streamer_core::SetupEvent;
    let due =
        |done: usize, total: usize| done.is_multiple_of(total.div_ceil(4).max(1)) || done == total;
    match *e {
        SetupEvent::Quantized { done, total } => {
            due(done, total).then(|| format!("{label}: quantized {done}/{total} weights"))
        }
        SetupEvent::Masters { done, total } => {
            due(done, total).then(|| format!("{label}: host masters of {done}/{total} blocks"))
        }
        SetupEvent::PageLock { bytes } => Some(format!(
            "{label}: page-locking {:.1} GiB of host masters",
            bytes as f64 / (1u64 << 30) as f64
        )),
        SetupEvent::Built(t) => Some(format!(
            "{label}: built (host masters {:.1} s, page-locked {:.1} s)",
            t.masters_s, t.pin_s
        )),
    }
}

/// A [`streamer_core::SetupHook`] that shows a model's setup: a bar over the
/// weights it quantizes, if it does, then one over its blocks' masters when
/// stderr is a terminal, else the [`setup_line`]s on stderr; the end is one
/// line either way.
pub fn setup_progress(label: &str) -> streamer_core::SetupHook {
    use streamer_core::SetupEvent;
    let label = label.to_string();
    // The bar of the phase under way, by the unit it counts.
    let bar: std::sync::Mutex<Option<(&'static str, ProgressBar)>> = std::sync::Mutex::new(None);
    let terminal = std::io::stderr().is_terminal();
    streamer_core::SetupHook::new(move |e| {
        if !terminal {
            if let Some(line) = setup_line(&label, &e) {
                eprintln!("{line}");
            }
            return;
        }
        let mut bar = bar.lock().unwrap_or_else(|p| p.into_inner());
        match e {
            SetupEvent::Quantized { done, total } => {
                let what = format!("{label}: quantizing");
                phase_bar(&mut bar, "weights", total, &what).set_position(done as u64);
            }
            SetupEvent::Masters { done, total } => {
                let what = format!("{label}: host masters");
                phase_bar(&mut bar, "blocks", total, &what).set_position(done as u64);
            }
            SetupEvent::PageLock { .. } => {
                if let (Some((_, b)), Some(line)) = (bar.as_ref(), setup_line(&label, &e)) {
                    b.set_message(line);
                }
            }
            SetupEvent::Built(_) => {
                if let Some((_, b)) = bar.take() {
                    b.finish_and_clear();
                }
                if let Some(line) = setup_line(&label, &e) {
                    eprintln!("{line}");
                }
            }
        }
    })
}

/// The bar counting `unit` (`total` of them, titled `what`): the one in
/// `slot` if it counts that, else a new one in place of the last phase's.
fn phase_bar<'a>(
    slot: &'a mut Option<(&'static str, ProgressBar)>,
    unit: &'static str,
    total: usize,
    what: &str,
) -> &'a ProgressBar {
    if slot.as_ref().is_some_and(|(u, _)| *u != unit) {
        if let Some((_, b)) = slot.take() {
            b.finish_and_clear();
        }
    }
    let (_, b) = slot.get_or_insert_with(|| {
        let b = ProgressBar::new(total as u64);
        let template = format!("{{msg}} {{bar:30}} {{pos}}/{{len}} {unit} [{{elapsed_precise}}]");
        if let Ok(style) = ProgressStyle::with_template(&template) {
            b.set_style(style);
        }
        b.set_message(what.to_string());
        (unit, b)
    });
    b
}
