//! The examples' reporting: the plain progress line a log gets when stderr is
//! not a terminal (step, loss, tokens/s, elapsed, ETA extrapolated from this
//! run's steps), how often it prints, and the SVG plots drawn by plotters.
use anyhow::{ensure, Result};
use candle_core::Device;
use candle_streamer::report::{
    format_duration, progress_line, setup_line, svg_plot, svg_plot_axes, try_svg_plot_axes,
    Progress,
};
use std::time::Duration;

fn report_progress_line_has_step_loss_rate_and_eta(_dev: &Device) -> Result<()> {
    // 40 of 200 steps in 12 s: 160 left at 0.3 s each.
    let l = progress_line(40, 200, 0, 2.345_67, 1234.4, Duration::from_secs(12));
    ensure!(
        l == "step 40/200  loss 2.3457  1234 tokens/s  elapsed 12s  eta 48s",
        "{l}"
    );
    // A resumed run extrapolates its own steps only: 50..60 in 20 s, 40 left.
    let l = progress_line(60, 100, 50, 1.0, 10.0, Duration::from_secs(20));
    ensure!(l.ends_with("elapsed 20s  eta 1m20s"), "{l}");
    // Nothing done yet: no ETA to give.
    let l = progress_line(50, 100, 50, 1.0, 0.0, Duration::ZERO);
    ensure!(l.ends_with("eta ?"), "{l}");
    ensure!(format_duration(Duration::from_secs(7322)) == "2h02m02s");
    ensure!(format_duration(Duration::from_secs(59)) == "59s");
    Ok(())
}
candle_streamer::test_device!(report_progress_line_has_step_loss_rate_and_eta);

fn report_plain_lines_every_n_steps_and_at_the_end(_dev: &Device) -> Result<()> {
    let p = Progress::with_terminal(0, 25, 10, false);
    let printed: Vec<usize> = (1..=25)
        .filter(|&s| p.update(s, 0.5, 100.0).is_some())
        .collect();
    ensure!(printed == vec![10, 20, 25], "{printed:?}");
    // 0 picks about 20 lines a run; a resumed run counts from its start.
    let p = Progress::with_terminal(100, 300, 0, false);
    ensure!(p.every() == 10, "every {}", p.every());
    let line = p.update(110, 0.25, 5.0).expect("a line at step 110");
    ensure!(
        line.starts_with("step 110/300  loss 0.2500  5 tokens/s"),
        "{line}"
    );
    ensure!(p.update(111, 0.25, 5.0).is_none());
    // On a terminal the bar shows progress and no line is printed.
    let bar = Progress::with_terminal(0, 10, 1, true);
    ensure!((1..=10).all(|s| bar.update(s, 0.1, 1.0).is_none()));
    bar.finish();
    Ok(())
}
candle_streamer::test_device!(report_plain_lines_every_n_steps_and_at_the_end);

fn report_svg_plots_every_series(_dev: &Device) -> Result<()> {
    let series = vec![
        (
            "train".to_string(),
            vec![(1.0, 3.0), (2.0, 2.5), (4.0, 1.25)],
        ),
        ("eval <b>".to_string(), vec![(1.0, 3.5), (8.0, 2.0)]),
    ];
    for log_x in [false, true] {
        let svg = try_svg_plot_axes(log_x, "loss & steps", "step", "nats", &series)
            .map_err(anyhow::Error::msg)?;
        ensure!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        for text in [
            "loss &amp; steps",
            "step",
            "nats",
            "train",
            "eval &lt;b&gt;",
        ] {
            ensure!(svg.contains(text), "log_x {log_x}: no {text:?} in the SVG");
        }
        // One line per series, one marker per point (legend marks are paths).
        ensure!(svg.matches("<polyline").count() >= 2, "lines: {svg}");
        ensure!(svg.matches("<circle").count() == 5, "markers");
    }
    // Degenerate input (one point, non-finite values) still draws.
    let one = vec![("x".to_string(), vec![(3.0, f64::NAN), (3.0, 1.0)])];
    ensure!(svg_plot("t", "n", "y", &one).contains("<circle"));
    ensure!(svg_plot_axes(false, "empty", "x", "y", &[]).contains("empty"));
    Ok(())
}
candle_streamer::test_device!(report_svg_plots_every_series);

/// A model's setup as plain lines: the weights it quantizes and its masters
/// at each quarter of their count and the last, page-locking with its size,
/// the end with each phase's time.
fn report_setup_lines(_dev: &Device) -> Result<()> {
    use streamer_core::{SetupEvent, SetupTimes};
    let lines: Vec<usize> = (1..=10)
        .filter(|&done| setup_line("m", &SetupEvent::Masters { done, total: 10 }).is_some())
        .collect();
    ensure!(lines == [3, 6, 9, 10], "{lines:?}");
    let quantized: Vec<usize> = (1..=7)
        .filter(|&done| setup_line("m", &SetupEvent::Quantized { done, total: 7 }).is_some())
        .collect();
    ensure!(quantized == [2, 4, 6, 7], "{quantized:?}");
    let l = setup_line("m", &SetupEvent::Quantized { done: 4, total: 7 });
    ensure!(l.as_deref() == Some("m: quantized 4/7 weights"), "{l:?}");
    let l = setup_line("m", &SetupEvent::Masters { done: 3, total: 10 });
    ensure!(
        l.as_deref() == Some("m: host masters of 3/10 blocks"),
        "{l:?}"
    );
    let l = setup_line("m", &SetupEvent::PageLock { bytes: 3 << 29 });
    ensure!(
        l.as_deref() == Some("m: page-locking 1.5 GiB of host masters"),
        "{l:?}"
    );
    let t = SetupTimes {
        masters_s: 12.34,
        pin_s: 1.6,
    };
    let l = setup_line("m", &SetupEvent::Built(t));
    ensure!(
        l.as_deref() == Some("m: built (host masters 12.3 s, page-locked 1.6 s)"),
        "{l:?}"
    );
    Ok(())
}
candle_streamer::test_device!(report_setup_lines);
