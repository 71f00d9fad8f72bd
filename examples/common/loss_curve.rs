//! The training examples' loss curve in their output folder: `loss.csv`
//! (`step,loss` rows) and its plot, `loss.svg`.
use anyhow::{Context, Result};
use std::io::Write;
use std::path::Path;

/// The plot's title, its y axis and the name of its line.
pub struct CurveLabels<'a> {
    /// The plot's title.
    pub title: &'a str,
    /// What the loss is (the y axis).
    pub ylabel: &'a str,
    /// The line's name in the legend.
    pub series: &'a str,
}

/// Writes `losses` as `out/loss.csv` and plots them in `out/loss.svg`.
pub fn write_curve(out: &Path, losses: &[(usize, f32)], labels: &CurveLabels) -> Result<()> {
    let mut csv = std::fs::File::create(out.join("loss.csv"))?;
    writeln!(csv, "step,loss")?;
    for (s, l) in losses {
        writeln!(csv, "{s},{l}")?;
    }
    let pts = losses.iter().map(|&(s, l)| (s as f64, l as f64)).collect();
    let svg = candle_streamer::report::svg_plot_axes(
        false,
        labels.title,
        "step",
        labels.ylabel,
        &[(labels.series.into(), pts)],
    );
    std::fs::write(out.join("loss.svg"), svg)?;
    Ok(())
}

/// The rows of the `loss.csv` at `path` up to step `upto` (a save writes the
/// curve before the state it belongs to, so later rows may be ahead of it);
/// none when there is no such file.
pub fn read_losses(path: &Path, upto: usize) -> Result<Vec<(usize, f32)>> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let all: Vec<(usize, f32)> = text
        .lines()
        .skip(1)
        .map(|l| -> Result<(usize, f32)> {
            let (s, v) = l.split_once(',').context("malformed loss.csv line")?;
            Ok((s.parse()?, v.parse()?))
        })
        .collect::<Result<_>>()?;
    Ok(all.into_iter().filter(|(s, _)| *s <= upto).collect())
}
