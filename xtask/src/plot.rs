//! SVG line charts (plotters, SVG backend only) for the harness's reports: one or more
//! panels, each a set of named series over a shared x axis, with points that have no
//! value marked by a label (a skipped cell's status) on the x axis.

use std::path::Path;

use anyhow::{Context, Result};
use plotters::prelude::*;

/// One line.
#[derive(Clone, Debug)]
pub struct Series {
    /// Its legend.
    pub name: String,
    /// (x, y) points; they are drawn in x order.
    pub points: Vec<(f64, f64)>,
}

/// A point with no value, marked with a label at its x.
#[derive(Clone, Debug)]
pub struct Mark {
    /// Which series it belongs to (for the label).
    pub series: String,
    /// Where.
    pub x: f64,
    /// What to say (a status).
    pub label: String,
}

/// One chart.
#[derive(Clone, Debug)]
pub struct Panel {
    /// Title.
    pub title: String,
    /// X axis label.
    pub x_label: String,
    /// Y axis label.
    pub y_label: String,
    /// Log-2 x axis (concurrency, prompt lengths).
    pub log_x: bool,
    /// The lines.
    pub series: Vec<Series>,
    /// Points without a value.
    pub marks: Vec<Mark>,
}

const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// Draws `panels` side by side into an SVG at `path`.
pub fn write_svg(path: &Path, panels: &[Panel]) -> Result<()> {
    let width = 560 * panels.len().max(1) as u32;
    let root = SVGBackend::new(path, (width, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
    let areas = root.split_evenly((1, panels.len().max(1)));
    for (panel, area) in panels.iter().zip(areas.iter()) {
        draw(panel, area).with_context(|| format!("drawing {:?}", panel.title))?;
    }
    root.present().map_err(|e| anyhow::anyhow!("{e}")).with_context(|| format!("writing {}", path.display()))
}

fn draw(panel: &Panel, area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>) -> Result<()> {
    let fx = |x: f64| if panel.log_x { x.max(1e-9).log2() } else { x };
    let xs: Vec<f64> = panel
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| fx(p.0)))
        .chain(panel.marks.iter().map(|m| fx(m.x)))
        .collect();
    let ys: Vec<f64> = panel.series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).collect();
    let (x0, x1) = bounds(&xs, false);
    let (_, y1) = bounds(&ys, true);
    let err = |e: DrawingAreaErrorKind<_>| anyhow::anyhow!("{e}");
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(x0..x1, 0.0..y1)
        .map_err(err)?;
    let log_x = panel.log_x;
    let x_fmt = move |v: &f64| if log_x { format!("{:.0}", v.exp2()) } else { format!("{v:.0}") };
    chart
        .configure_mesh()
        .x_desc(panel.x_label.as_str())
        .y_desc(panel.y_label.as_str())
        .x_label_formatter(&x_fmt)
        .draw()
        .map_err(err)?;
    for (i, s) in panel.series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let mut pts: Vec<(f64, f64)> = s.points.iter().map(|&(x, y)| (fx(x), y)).collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(err)?
            .label(s.name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled()))).map_err(err)?;
    }
    for m in &panel.marks {
        let i = panel.series.iter().position(|s| s.name == m.series).unwrap_or(0);
        let color = PALETTE[i % PALETTE.len()];
        let x = fx(m.x);
        chart.draw_series(std::iter::once(Cross::new((x, 0.0), 5, color.stroke_width(2)))).map_err(err)?;
        let y = y1 * (0.06 + 0.06 * i as f64);
        chart
            .draw_series(std::iter::once(Text::new(
                m.label.clone(),
                (x, y),
                ("sans-serif", 11).into_font().color(&color),
            )))
            .map_err(err)?;
    }
    if !panel.series.is_empty() {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(err)?;
    }
    Ok(())
}

/// A padded range over `v`; from zero when `from_zero`.
fn bounds(v: &[f64], from_zero: bool) -> (f64, f64) {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if !lo.is_finite() || !hi.is_finite() {
        return (0.0, 1.0);
    }
    let lo = if from_zero { 0.0 } else { lo };
    let pad = ((hi - lo).abs() * 0.08).max(if from_zero { hi.abs() * 0.1 } else { 0.5 }).max(1e-9);
    (if from_zero { 0.0 } else { lo - pad }, hi + pad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_with_lines_and_marks_is_an_svg_naming_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.svg");
        let panel = Panel {
            title: "decode".into(),
            x_label: "prompt tokens".into(),
            y_label: "tok/s".into(),
            log_x: true,
            series: vec![Series {
                name: "synthetic:tiny".into(),
                points: vec![(128.0, 50.0), (512.0, 40.0)],
            }],
            marks: vec![Mark { series: "synthetic:tiny".into(), x: 2048.0, label: "SKIP:oom".into() }],
        };
        write_svg(&path, &[panel.clone(), Panel { series: vec![], ..panel }]).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..80.min(svg.len())]);
        for needle in ["synthetic:tiny", "SKIP:oom", "prompt tokens", "decode", "2048"] {
            assert!(svg.contains(needle), "the SVG lacks {needle}");
        }
    }
}
