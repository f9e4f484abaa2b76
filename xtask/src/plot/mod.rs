//! The harness's plots, one module for every task: panels of named series drawn to a
//! self-contained SVG with the rules that keep a picture honest (axes in the data's own
//! units, log axes labelled at the values that occur, whole-number ticks on integer axes,
//! unique tick labels, the legend outside the data, intervals as error bars in their
//! series' colour, repetitions as unjoined points, one panel per series when series
//! differ by more than 10x, and a colour-blind-safe palette whose markers also differ).
//!
//! [`render`] returns the SVG with a [`Layout`]: where every tick, legend, point and
//! error bar went, so tests check the picture as a reader would ([`Layout::problems`]).
//! The SVG is written here rather than through plotters: plotters' SVG backend neither
//! places a legend outside the chart nor says where it put anything, and these checks
//! need both.

mod layout;
mod render;
mod style;
mod ticks;

#[cfg(test)]
pub mod raster;

use std::path::Path;

use anyhow::Result;

pub use layout::Layout;
#[cfg(test)]
pub use layout::{PanelLayout, Rect};
pub use render::render;
pub use style::escape;

/// How an axis maps values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scale {
    /// Linear, ticks at 1, 2, 2.5 or 5 times a power of ten.
    Linear,
    /// Linear, ticks at whole numbers only (boots, repetitions).
    Integer,
    /// Logarithmic; an x axis is labelled at the values that occur (the ladder's lengths,
    /// the concurrency levels), a y axis at powers of ten.
    Log,
    /// Named categories (schemes) at 0, 1, 2, ..., labelled with their names.
    Category,
}

/// One axis: its label (with the unit) and scale.
#[derive(Clone, Debug)]
pub struct Axis {
    /// What the axis measures and in which unit, e.g. `decode (tok/s)`.
    pub label: String,
    /// How values map.
    pub scale: Scale,
    /// Start a linear axis at zero (rates, times), so a bar of the eye reads a ratio.
    pub from_zero: bool,
    /// The names of a [`Scale::Category`] axis, value `i` being `categories[i]`.
    pub categories: Vec<String>,
}

impl Axis {
    /// A linear axis.
    pub fn linear(label: impl Into<String>) -> Axis {
        Axis { label: label.into(), scale: Scale::Linear, from_zero: false, categories: Vec::new() }
    }
    /// A linear axis from zero.
    pub fn from_zero(label: impl Into<String>) -> Axis {
        Axis { from_zero: true, ..Axis::linear(label) }
    }
    /// An axis of whole numbers.
    pub fn integer(label: impl Into<String>) -> Axis {
        Axis { scale: Scale::Integer, ..Axis::linear(label) }
    }
    /// A log axis.
    pub fn log(label: impl Into<String>) -> Axis {
        Axis { scale: Scale::Log, ..Axis::linear(label) }
    }
    /// An axis of named categories.
    pub fn categories(label: impl Into<String>, names: Vec<String>) -> Axis {
        Axis { scale: Scale::Category, categories: names, ..Axis::linear(label) }
    }
}

/// One measured value, with its interval (a 95% interval of the mean, say) when known.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Point {
    /// Where.
    pub x: f64,
    /// The value.
    pub y: f64,
    /// `(low, high)`, drawn as an error bar.
    pub interval: Option<(f64, f64)>,
}

impl From<(f64, f64)> for Point {
    fn from((x, y): (f64, f64)) -> Point {
        Point { x, y, interval: None }
    }
}

/// One series: its points, joined in x order when `join`, and the single measurements
/// behind them (repetitions, windows), drawn as small unjoined points.
#[derive(Clone, Debug)]
pub struct Series {
    /// Its legend entry.
    pub name: String,
    /// The values (means, when there are samples).
    pub points: Vec<Point>,
    /// Join the points with a line (a trend over x); false for boots and arms.
    pub join: bool,
    /// The single measurements, never joined.
    pub samples: Vec<(f64, f64)>,
}

impl Series {
    /// A line through `points`.
    pub fn line(name: impl Into<String>, points: Vec<(f64, f64)>) -> Series {
        Series {
            name: name.into(),
            points: points.into_iter().map(Point::from).collect(),
            join: true,
            samples: Vec::new(),
        }
    }
    /// Unjoined points.
    pub fn points(name: impl Into<String>, points: Vec<Point>) -> Series {
        Series { name: name.into(), points, join: false, samples: Vec::new() }
    }
}

/// A cell that has no value (skipped, failed), marked on the x axis and listed below the
/// plot with its label.
#[derive(Clone, Debug)]
pub struct Mark {
    /// Which series it belongs to.
    pub series: String,
    /// Where.
    pub x: f64,
    /// What to say (a status).
    pub label: String,
}

/// A horizontal reference (no tax at 1), dashed grey, named in the legend.
#[derive(Clone, Debug)]
pub struct RefLine {
    /// The value.
    pub y: f64,
    /// Its legend entry.
    pub name: String,
}

/// One chart.
#[derive(Clone, Debug)]
pub struct Panel {
    /// Title.
    pub title: String,
    /// The x axis.
    pub x: Axis,
    /// The y axis.
    pub y: Axis,
    /// The series.
    pub series: Vec<Series>,
    /// Cells without a value.
    pub marks: Vec<Mark>,
    /// Reference lines.
    pub refs: Vec<RefLine>,
    /// Draw one panel per series when the series' typical values differ by more than
    /// 10x (models of very different speeds), instead of flattening the slow ones.
    pub split_when_spread: bool,
}

impl Panel {
    /// A panel with no series yet.
    pub fn new(title: impl Into<String>, x: Axis, y: Axis) -> Panel {
        Panel {
            title: title.into(),
            x,
            y,
            series: Vec::new(),
            marks: Vec::new(),
            refs: Vec::new(),
            split_when_spread: false,
        }
    }
}

/// Renders `panels` and writes the SVG to `path` atomically (a temporary file beside it,
/// then a rename), so a reader never sees half a picture. A rule the picture breaks
/// anyway (data the layout did not foresee) is a warning naming the file.
pub fn write_svg(path: &Path, panels: &[Panel]) -> Result<Layout> {
    let (svg, layout) = render(panels);
    write_atomically(path, svg.as_bytes())?;
    for p in layout.problems() {
        eprintln!("warning: {}: {p}", path.display());
    }
    Ok(layout)
}

/// Writes a file atomically ([`crate::fsx::write_atomic`]), under the name the pages use.
pub use crate::fsx::write_atomic as write_atomically;

#[cfg(test)]
mod tests {
    use super::*;

    fn ladder_panel(series: Vec<Series>, marks: Vec<Mark>) -> Panel {
        Panel {
            series,
            marks,
            split_when_spread: true,
            ..Panel::new("decode", Axis::log("prompt length (tokens)"), Axis::from_zero("decode (tok/s)"))
        }
    }

    #[test]
    fn a_log_axis_is_labelled_at_the_ladder_lengths() {
        let s = Series::line(
            "synthetic:tiny",
            vec![(128.0, 50.0), (512.0, 40.0), (2048.0, 30.0), (32768.0, 10.0)],
        );
        let l = raster::check("log-axis", &[ladder_panel(vec![s], vec![])]);
        let labels: Vec<&str> = l.panels[0].x_ticks.iter().map(|t| t.label.as_str()).collect();
        assert_eq!(labels, ["128", "512", "2048", "32768"]);
    }

    #[test]
    fn series_ten_times_apart_get_a_panel_each_and_keep_their_look() {
        let tiny = Series::line("synthetic:tiny", vec![(128.0, 3500.0), (512.0, 3000.0)]);
        let real = Series::line("synthetic:qwen2.5-0.5b", vec![(128.0, 20.0), (512.0, 18.0)]);
        let l = raster::check("small-multiples", &[ladder_panel(vec![tiny.clone(), real.clone()], vec![])]);
        assert_eq!(l.panels.len(), 2);
        assert_eq!(l.panels[1].title, "decode: synthetic:qwen2.5-0.5b");
        // The slow model fills its own panel's height instead of lying on the axis.
        let p = &l.panels[1];
        let (top, bottom) =
            p.series[0].points.iter().fold((f64::MAX, 0f64), |(a, b), q| (a.min(q.1), b.max(q.1)));
        assert!(bottom - top > 0.0 && top < p.plot.y + p.plot.h * 0.3, "{top} {bottom} {:?}", p.plot);
        assert_eq!(l.panels[1].series[0].colour, style::look(1).colour);
        // Within 10x they share a panel.
        let near = Series::line("b", vec![(128.0, 400.0), (512.0, 380.0)]);
        assert_eq!(render(&[ladder_panel(vec![tiny, near], vec![])]).1.panels.len(), 1);
    }

    #[test]
    fn a_lone_point_is_clear_of_the_legend_and_skips_are_listed_not_stacked() {
        let s = Series::line("synthetic:qwen2.5-0.5b", vec![(128.0, 20.0)]);
        let marks = ["512", "2048", "8192"]
            .iter()
            .flat_map(|x| {
                ["synthetic:qwen2.5-0.5b", "synthetic:llama-3.1-8b"].map(|m| Mark {
                    series: m.into(),
                    x: x.parse().unwrap(),
                    label: "SKIP:oom_estimate".into(),
                })
            })
            .collect();
        let other = Series::line("synthetic:llama-3.1-8b", vec![]);
        let l = raster::check("skips", &[ladder_panel(vec![s, other], marks)]);
        let p = &l.panels[0];
        assert_eq!(p.notes.len(), 2, "{:?}", p.notes);
        assert_eq!(p.notes[0].0, "synthetic:qwen2.5-0.5b: SKIP:oom_estimate at 512, 2048, 8192");
        assert_eq!(p.series[1].marks.len(), 3);
        assert!(!p.legend.unwrap().overlaps(&p.plot));
    }

    #[test]
    fn intervals_are_error_bars_in_their_series_colour_not_series() {
        let ratio = |name: &str, k: f64| Series {
            name: name.into(),
            points: [1.0, 2.0, 4.0, 8.0, 16.0]
                .iter()
                .map(|&b| Point {
                    x: b,
                    y: 1.0 + k * b / 100.0,
                    interval: Some((0.97 + k * b / 100.0, 1.03 + k * b / 100.0)),
                })
                .collect(),
            join: true,
            samples: Vec::new(),
        };
        let panel = Panel {
            series: vec![ratio("tok/s", 1.0), ratio("TPOT", -1.0)],
            refs: vec![RefLine { y: 1.0, name: "no tax (1)".into() }],
            ..Panel::new("pin tax", Axis::log("concurrent streams B"), Axis::linear("narrow / wide"))
        };
        let l = raster::check("intervals", &[panel]);
        let p = &l.panels[0];
        assert_eq!(p.legend_entries, ["tok/s", "TPOT", "no tax (1)"]);
        assert_eq!(
            p.x_ticks.iter().map(|t| t.label.as_str()).collect::<Vec<_>>(),
            ["1", "2", "4", "8", "16"]
        );
        for s in &p.series {
            assert_eq!(s.intervals.len(), 5);
            assert!(s.element_colours.iter().all(|c| *c == s.colour));
        }
        // Set apart so both bars show.
        assert_ne!(p.series[0].intervals[0].0, p.series[1].intervals[0].0);
    }

    #[test]
    fn boots_are_unjoined_points_on_a_whole_number_axis() {
        let arm = |name: &str, boots: &[f64], v: f64| Series {
            samples: boots.iter().flat_map(|b| [(*b, v - 1.0), (*b, v + 1.0)]).collect(),
            ..Series::points(name, boots.iter().map(|b| Point::from((*b, v))).collect())
        };
        let panel = Panel {
            series: vec![arm("A", &[1.0, 4.0], 30.0), arm("B", &[2.0, 3.0], 31.0)],
            ..Panel::new("classic", Axis::integer("boot"), Axis::from_zero("tok/s per stream"))
        };
        let l = raster::check("boots", &[panel]);
        let p = &l.panels[0];
        assert!(p.series.iter().all(|s| s.line.is_none()));
        assert_eq!(p.x_ticks.iter().map(|t| t.label.as_str()).collect::<Vec<_>>(), ["1", "2", "3", "4"]);
        assert_eq!(p.series[0].samples.len(), 4);
    }

    #[test]
    fn sixteen_series_look_different_from_each_other() {
        let series = (0..16)
            .map(|i| Series::line(format!("s{i}"), vec![(1.0, i as f64), (2.0, i as f64 + 0.5)]))
            .collect();
        let panel = Panel { series, ..Panel::new("many", Axis::linear("x"), Axis::linear("y")) };
        raster::check("sixteen", &[panel]);
    }

    #[test]
    fn the_checks_catch_a_picture_that_misleads() {
        let s = Series::line("a", vec![(128.0, 50.0), (512.0, 40.0)]);
        let (_, good) = render(&[ladder_panel(vec![s], vec![])]);
        assert!(good.problems().is_empty(), "{:?}", good.problems());
        let bad = |f: &dyn Fn(&mut PanelLayout), want: &str| {
            let mut l = good.clone();
            f(&mut l.panels[0]);
            let p = l.problems();
            assert!(p.iter().any(|m| m.contains(want)), "{want}: {p:?}");
        };
        bad(&|p| p.x_ticks[1].label = p.x_ticks[0].label.clone(), "tick labels repeat");
        bad(&|p| p.legend = Some(Rect { x: p.plot.x + 5.0, ..p.legend.unwrap() }), "legend overlaps");
        bad(&|p| p.series[0].points[0].0 = p.plot.x - 3.0, "outside the plot area");
        bad(&|p| p.series[0].element_colours.push("#123456".into()), "drawn in #123456");
        bad(&|p| drop(p.x_ticks.remove(0)), "no tick at the value 128");
        bad(&|p| p.x_ticks.swap(0, 1), "not increasing");
    }

    #[test]
    fn data_text_is_escaped_and_the_file_replaced_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.svg");
        let s = Series::line("<model & \"x\">", vec![(1.0, 1.0), (2.0, 2.0)]);
        write_svg(
            &path,
            &[Panel { series: vec![s], ..Panel::new("t<", Axis::linear("x"), Axis::linear("y")) }],
        )
        .unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.contains("&lt;model &amp; &quot;x&quot;&gt;") && !svg.contains("<model"));
        raster::rasterize(&svg);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "no temporary file is left");
    }
}
