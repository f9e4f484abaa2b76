//! Test support: draws a plot to pixels with resvg and checks it as a reader would, from
//! its layout (readable ticks, the legend clear of the data, points inside, one look per
//! series) and from the picture itself (every point is there, in its series' colour).
//! With `KILN_TEST_PLOT_DIR` set, each checked plot is also saved there as SVG and PNG.

use resvg::tiny_skia::{Pixmap, Transform};
use resvg::usvg::{Options, Tree};

use super::{Layout, Panel, render};

/// The SVG drawn to pixels, fonts from the system where there are any.
pub fn rasterize(svg: &str) -> Pixmap {
    let mut opt = Options::default();
    opt.fontdb_mut().load_system_fonts();
    let tree = Tree::from_str(svg, &opt).expect("the plot is an SVG resvg reads");
    let size = tree.size().to_int_size();
    let mut pixmap = Pixmap::new(size.width(), size.height()).expect("a non-empty picture");
    resvg::render(&tree, Transform::default(), &mut pixmap.as_mut());
    pixmap
}

fn rgb(hex: &str) -> [u8; 3] {
    let v = u32::from_str_radix(hex.trim_start_matches('#'), 16).expect("#rrggbb");
    [(v >> 16) as u8, (v >> 8) as u8, v as u8]
}

/// Renders `panels`, asserts the layout has no problem and the picture shows every
/// point in its series' colour, and returns the layout for the caller's own checks.
pub fn check(name: &str, panels: &[Panel]) -> Layout {
    let (svg, layout) = render(panels);
    let problems = layout.problems();
    assert!(problems.is_empty(), "{name}: the plot breaks its rules:\n{}", problems.join("\n"));
    let pixmap = rasterize(&svg);
    if let Some(dir) = std::env::var_os("KILN_TEST_PLOT_DIR") {
        let dir = std::path::Path::new(&dir);
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(format!("{name}.svg")), &svg).unwrap();
        pixmap.save_png(dir.join(format!("{name}.png"))).unwrap();
    }
    let at = |x: f64, y: f64| {
        let p = pixmap.pixel(x.floor() as u32, y.floor() as u32).expect("the point is on the picture");
        [p.red(), p.green(), p.blue()]
    };
    let mut background = 0;
    for p in &layout.panels {
        for s in &p.series {
            let want = rgb(&s.colour);
            for &(x, y) in s.points.iter().chain(&s.marks) {
                let got = at(x, y);
                let is_mark = s.marks.contains(&(x, y));
                assert!(
                    got != [255, 255, 255] || is_mark,
                    "{name}: nothing drawn at {s:?}'s point ({x:.1}, {y:.1})",
                    s = s.name
                );
                // Another series' marker on top may hide the colour; check it where none is near.
                let crowded = p.series.iter().filter(|o| o.name != s.name).any(|o| {
                    o.points
                        .iter()
                        .chain(&o.samples)
                        .chain(&o.marks)
                        .any(|&(ox, oy)| (ox - x).hypot(oy - y) < 11.0)
                });
                if !crowded && !is_mark {
                    let close = got.iter().zip(want).all(|(g, w)| (*g as i32 - w as i32).abs() <= 48);
                    assert!(
                        close,
                        "{name}: {}'s point at ({x:.1}, {y:.1}) is {got:?}, not its colour {want:?}",
                        s.name
                    );
                }
            }
        }
        let r = p.plot;
        for yy in (r.y as u32 + 2)..((r.y + r.h) as u32 - 2) {
            for xx in (r.x as u32 + 2)..((r.x + r.w) as u32 - 2) {
                let px = pixmap.pixel(xx, yy).unwrap();
                if px.red() > 250 && px.green() > 250 && px.blue() > 250 {
                    background += 1;
                }
            }
        }
    }
    assert!(background > 0, "{name}: the plot areas are filled: nothing is readable");
    layout
}
