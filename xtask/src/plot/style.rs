//! How series look: the Okabe-Ito palette (safe for the common colour-vision
//! deficiencies), a marker per series that differs as well (so a black-and-white print
//! still tells series apart), a dash pattern once colours repeat, and text metrics.

use std::fmt::Write as _;

/// Okabe and Ito's eight colours, the pale yellow last.
pub const PALETTE: [&str; 8] =
    ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442"];

/// Marker shapes; seven, so with eight colours the (colour, marker) pair is unique for the
/// first 56 series.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Marker {
    Circle,
    Square,
    TriangleUp,
    Diamond,
    TriangleDown,
    Plus,
    Cross,
}

const MARKERS: [Marker; 7] = [
    Marker::Circle,
    Marker::Square,
    Marker::TriangleUp,
    Marker::Diamond,
    Marker::TriangleDown,
    Marker::Plus,
    Marker::Cross,
];

/// Line dash patterns, changed each time the palette wraps.
const DASHES: [&str; 4] = ["", "7 3", "2 3", "7 3 2 3"];

/// The look of series number `i` of a panel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Look {
    /// `#rrggbb`.
    pub colour: &'static str,
    /// Its marker.
    pub marker: Marker,
    /// `stroke-dasharray`, empty for solid.
    pub dash: &'static str,
}

/// Series `i`'s look.
pub fn look(i: usize) -> Look {
    Look {
        colour: PALETTE[i % PALETTE.len()],
        marker: MARKERS[i % MARKERS.len()],
        dash: DASHES[(i / PALETTE.len()) % DASHES.len()],
    }
}

/// The font every text element uses.
pub const FONT: &str = "DejaVu Sans, Verdana, Arial, Helvetica, sans-serif";

/// An upper estimate of a text's width in pixels at `size` (DejaVu Sans averages about
/// 0.6 em per character; wide capitals and digits reach 0.7).
pub fn text_width(text: &str, size: f64) -> f64 {
    text.chars().count() as f64 * size * 0.64
}

/// `text` safe inside SVG or HTML text and attributes.
pub fn escape(text: &str) -> String {
    let mut s = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => s.push_str("&amp;"),
            '<' => s.push_str("&lt;"),
            '>' => s.push_str("&gt;"),
            '"' => s.push_str("&quot;"),
            '\'' => s.push_str("&#39;"),
            c if c.is_control() => s.push(' '),
            c => s.push(c),
        }
    }
    s
}

/// SVG for `marker` centred at (x, y) with radius `r`; filled with `fill`, outlined with
/// `stroke`.
pub fn marker_svg(out: &mut String, marker: Marker, x: f64, y: f64, r: f64, fill: &str, stroke: &str) {
    let poly = |out: &mut String, pts: &[(f64, f64)]| {
        let p: Vec<String> = pts.iter().map(|(a, b)| format!("{:.2},{:.2}", x + a * r, y + b * r)).collect();
        let _ = writeln!(
            out,
            r#"<polygon points="{}" fill="{fill}" stroke="{stroke}" stroke-width="1"/>"#,
            p.join(" ")
        );
    };
    match marker {
        Marker::Circle => {
            let _ = writeln!(
                out,
                r#"<circle cx="{x:.2}" cy="{y:.2}" r="{r:.2}" fill="{fill}" stroke="{stroke}" stroke-width="1"/>"#
            );
        }
        Marker::Square => poly(out, &[(-0.85, -0.85), (0.85, -0.85), (0.85, 0.85), (-0.85, 0.85)]),
        Marker::TriangleUp => poly(out, &[(0.0, -1.2), (1.05, 0.65), (-1.05, 0.65)]),
        Marker::TriangleDown => poly(out, &[(0.0, 1.2), (1.05, -0.65), (-1.05, -0.65)]),
        Marker::Diamond => poly(out, &[(0.0, -1.25), (1.0, 0.0), (0.0, 1.25), (-1.0, 0.0)]),
        Marker::Plus | Marker::Cross => {
            // A hollow marker (fill white) keeps its outline colour: the strokes carry it.
            let colour = if fill == "#ffffff" { stroke } else { fill };
            let d = if marker == Marker::Plus {
                format!(
                    "M{:.2},{y:.2}H{:.2}M{x:.2},{:.2}V{:.2}",
                    x - r * 1.1,
                    x + r * 1.1,
                    y - r * 1.1,
                    y + r * 1.1
                )
            } else {
                let k = r * 0.85;
                format!(
                    "M{:.2},{:.2}L{:.2},{:.2}M{:.2},{:.2}L{:.2},{:.2}",
                    x - k,
                    y - k,
                    x + k,
                    y + k,
                    x - k,
                    y + k,
                    x + k,
                    y - k
                )
            };
            let _ = writeln!(out, r#"<path d="{d}" stroke="{colour}" stroke-width="2.6" fill="none"/>"#);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_looks_are_unique_well_past_the_palette() {
        let mut seen = std::collections::HashSet::new();
        for i in 0..56 {
            assert!(seen.insert((look(i).colour, look(i).marker)), "series {i} repeats a colour and marker");
        }
        // Within one palette round the markers alone tell series apart (black and white).
        let markers: std::collections::HashSet<_> = (0..7).map(|i| look(i).marker).collect();
        assert_eq!(markers.len(), 7);
        // 16 series: colours repeat, but the second round is dashed.
        assert_ne!(look(3).dash, look(11).dash);
    }

    #[test]
    fn text_from_data_is_escaped() {
        assert_eq!(escape(r#"<a href="x">&'"#), "&lt;a href=&quot;x&quot;&gt;&amp;&#39;");
    }
}
