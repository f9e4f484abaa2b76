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
mod model;
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
#[cfg(test)]
pub use model::Scale;
pub use model::{Axis, Mark, Panel, Point, RefLine, Series};
pub use render::render;
pub use style::escape;

/// Renders `panels` and writes the SVG to `path` atomically (a temporary file beside it,
/// then a rename), so a reader never sees half a picture. A rule the picture breaks
/// anyway (data the layout did not foresee) is a warning naming the file.
pub fn write_svg(path: &Path, panels: &[Panel]) -> Result<Layout> {
    let (svg, layout) = render(panels);
    crate::fsx::write_atomic(path, svg.as_bytes())?;
    for p in layout.problems() {
        eprintln!("warning: {}: {p}", path.display());
    }
    Ok(layout)
}

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
