//! SVG plots: latency by percentile (one line per path) and throughput over time.

use std::path::Path;

use anyhow::anyhow;
use plotters::prelude::*;

use crate::stats::LatencySummary;

const SIZE: (u32, u32) = (960, 540);

fn color(i: usize) -> RGBAColor {
    const COLORS: [RGBColor; 8] = [
        RGBColor(0x1f, 0x77, 0xb4),
        RGBColor(0xff, 0x7f, 0x0e),
        RGBColor(0x2c, 0xa0, 0x2c),
        RGBColor(0xd6, 0x27, 0x28),
        RGBColor(0x94, 0x67, 0xbd),
        RGBColor(0x8c, 0x56, 0x4b),
        RGBColor(0xe3, 0x77, 0xc2),
        RGBColor(0x7f, 0x7f, 0x7f),
    ];
    COLORS[i % COLORS.len()].to_rgba()
}

/// Label of a "nines" abscissa: 0 → 0%, 1 → 90%, 2 → 99%, 3 → 99.9%, …
fn nines_label(x: f64) -> String {
    let q = (1.0 - 10f64.powf(-x)) * 100.0;
    let digits = (x.round() as usize).saturating_sub(2);
    format!("{q:.digits$}%")
}

/// Plots each run's latency against its percentile, on a log latency axis.
pub fn latency_svg(
    path: &Path,
    title: &str,
    runs: &[(&str, &LatencySummary)],
) -> anyhow::Result<()> {
    let points = runs.iter().flat_map(|(_, s)| s.curve.iter());
    let xmax = points.clone().map(|p| p.0).fold(1.0, f64::max).ceil();
    let ymax = points.clone().map(|p| p.1).fold(0.001, f64::max) * 1.5;
    let ymin = points.map(|p| p.1).fold(ymax, f64::min).max(0.001) / 1.5;
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..xmax, (ymin..ymax).log_scale())
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc("percentile")
        .y_desc("latency (ms, log scale)")
        .x_labels((xmax as usize) + 1)
        .x_label_formatter(&|x| nines_label(*x))
        .y_label_formatter(&|y| format!("{y:.3}"))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    for (i, (label, summary)) in runs.iter().enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(
                summary.curve.iter().copied(),
                c.stroke_width(2),
            ))
            .map_err(|e| anyhow!("{e}"))?
            .label(*label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

/// One run's timeline: a rate per bucket of `interval_ms`.
#[derive(Debug, Clone, Copy)]
pub struct Timeline<'a> {
    /// The run's name in the legend.
    pub label: &'a str,
    /// Width of each bucket.
    pub interval_ms: u64,
    /// The rate in each bucket.
    pub points: &'a [f64],
    /// What the rate counts (the axis names the first run's).
    pub unit: &'a str,
}

/// Plots each run's timeline (rate per bucket) against time in seconds. Runs with different units share the
/// plot; the axis names the first unit.
pub fn timeline_svg(path: &Path, title: &str, runs: &[Timeline<'_>]) -> anyhow::Result<()> {
    let series: Vec<(&str, Vec<(f64, f64)>)> = runs
        .iter()
        .map(|r| {
            let dt = r.interval_ms.max(1) as f64 / 1000.0;
            let pts = r
                .points
                .iter()
                .enumerate()
                .map(|(i, v)| ((i as f64 + 0.5) * dt, *v))
                .collect();
            (r.label, pts)
        })
        .collect();
    let all = series.iter().flat_map(|(_, p)| p.iter());
    let xmax = all.clone().map(|p| p.0).fold(0.1, f64::max) * 1.02;
    let ymax = all.map(|p| p.1).fold(1.0, f64::max) * 1.1;
    let unit = runs.first().map_or("", |r| r.unit);
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(0f64..xmax, 0f64..ymax)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc("time (s)")
        .y_desc(unit)
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    for (i, (label, pts)) in series.into_iter().enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))
            .map_err(|e| anyhow!("{e}"))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nines_are_labelled_as_percentiles() {
        assert_eq!(nines_label(0.0), "0%");
        assert_eq!(nines_label(1.0), "90%");
        assert_eq!(nines_label(2.0), "99%");
        assert_eq!(nines_label(3.0), "99.9%");
        assert_eq!(nines_label(4.0), "99.99%");
    }
}
