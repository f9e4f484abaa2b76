//! Where [`super::render`] put everything, in SVG pixels, and the checks a reader would
//! make of the picture: ticks readable and in order, the legend clear of the data, every
//! point inside its plot, one look per series.

use std::collections::HashSet;

use super::model::Scale;
use super::style::Marker;

/// An axis-aligned rectangle.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rect {
    /// Left.
    pub x: f64,
    /// Top.
    pub y: f64,
    /// Width.
    pub w: f64,
    /// Height.
    pub h: f64,
}

impl Rect {
    /// Whether (x, y) lies inside or on the edge.
    pub fn contains(&self, x: f64, y: f64) -> bool {
        x >= self.x - 1e-6 && x <= self.x + self.w + 1e-6 && y >= self.y - 1e-6 && y <= self.y + self.h + 1e-6
    }
    /// Whether the two overlap (touching edges do not).
    pub fn overlaps(&self, o: &Rect) -> bool {
        self.x < o.x + o.w && o.x < self.x + self.w && self.y < o.y + o.h && o.y < self.y + self.h
    }
}

/// One tick: its value, label, pixel position along the axis, and the label's box.
#[derive(Clone, Debug)]
pub struct Tick {
    /// The value.
    pub value: f64,
    /// What it says.
    pub label: String,
    /// Pixel x (x axis) or y (y axis).
    pub at: f64,
    /// The label's box.
    pub rect: Rect,
}

/// Where one series went.
#[derive(Clone, Debug)]
pub struct SeriesLayout {
    /// Its name.
    pub name: String,
    /// The colour every element of it was drawn in.
    pub colour: String,
    /// Its marker.
    pub marker: Marker,
    /// Its dash pattern.
    pub dash: String,
    /// The colour of each element as written, to check it is `colour`.
    pub element_colours: Vec<String>,
    /// Marker centres of its points.
    pub points: Vec<(f64, f64)>,
    /// Its samples' centres.
    pub samples: Vec<(f64, f64)>,
    /// Error bars: (x, top, bottom).
    pub intervals: Vec<(f64, f64, f64)>,
    /// The line's vertices, when joined.
    pub line: Option<Vec<(f64, f64)>>,
    /// Marks (cells without a value) on the axis.
    pub marks: Vec<(f64, f64)>,
}

/// One drawn panel.
#[derive(Clone, Debug)]
pub struct PanelLayout {
    /// Title as drawn.
    pub title: String,
    /// The data area.
    pub plot: Rect,
    /// The x axis's scale.
    pub x_scale: Scale,
    /// The y axis's scale.
    pub y_scale: Scale,
    /// X ticks, left to right.
    pub x_ticks: Vec<Tick>,
    /// Y ticks, bottom to top.
    pub y_ticks: Vec<Tick>,
    /// The x values that occur (points, samples, marks).
    pub occurring_x: Vec<f64>,
    /// The legend's box.
    pub legend: Option<Rect>,
    /// Its entries, series then reference lines.
    pub legend_entries: Vec<String>,
    /// Reference lines: name and pixel y.
    pub refs: Vec<(String, f64)>,
    /// Every series.
    pub series: Vec<SeriesLayout>,
    /// Notes below the plot (the cells without a value), with their boxes.
    pub notes: Vec<(String, Rect)>,
}

/// The whole picture.
#[derive(Clone, Debug)]
pub struct Layout {
    /// Width in pixels.
    pub width: f64,
    /// Height in pixels.
    pub height: f64,
    /// The panels, row by row.
    pub panels: Vec<PanelLayout>,
}

impl Layout {
    /// Every rule the picture breaks, one line each; empty when it reads right.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        let page = Rect { x: 0.0, y: 0.0, w: self.width, h: self.height };
        for (pi, p) in self.panels.iter().enumerate() {
            let mut say = |m: String| out.push(format!("panel {pi} ({}): {m}", p.title));
            for (axis, ticks, scale) in [("x", &p.x_ticks, p.x_scale), ("y", &p.y_ticks, p.y_scale)] {
                if ticks.len() < 2 && !(axis == "x" && p.occurring_x.len() == 1 && ticks.len() == 1) {
                    say(format!("{axis} axis has {} tick(s)", ticks.len()));
                }
                let labels: HashSet<&str> = ticks.iter().map(|t| t.label.as_str()).collect();
                if labels.len() != ticks.len() {
                    say(format!(
                        "{axis} tick labels repeat: {:?}",
                        ticks.iter().map(|t| &t.label).collect::<Vec<_>>()
                    ));
                }
                for w in ticks.windows(2) {
                    if w[1].value <= w[0].value {
                        say(format!("{axis} ticks not increasing: {} then {}", w[0].label, w[1].label));
                    }
                    let moved = if axis == "x" { w[1].at > w[0].at } else { w[1].at < w[0].at };
                    if !moved {
                        say(format!(
                            "{axis} ticks {} and {} not in order on the page",
                            w[0].label, w[1].label
                        ));
                    }
                    if w[0].rect.overlaps(&w[1].rect) {
                        say(format!("{axis} tick labels {} and {} overlap", w[0].label, w[1].label));
                    }
                }
                for t in ticks.iter() {
                    if scale == Scale::Category {
                        if t.label.trim().is_empty() || t.value.fract() != 0.0 {
                            say(format!("{axis} category tick at {} has no name", t.value));
                        }
                    } else if t
                        .label
                        .parse::<f64>()
                        .map_or(true, |v| (v - t.value).abs() > 1e-6 * t.value.abs().max(1.0))
                    {
                        say(format!("{axis} tick label {:?} does not say its value {}", t.label, t.value));
                    }
                    if scale == Scale::Integer && t.value.fract() != 0.0 {
                        say(format!("{axis} axis is of whole numbers but has a tick at {}", t.value));
                    }
                    if !page.contains(t.rect.x, t.rect.y)
                        || !page.contains(t.rect.x + t.rect.w, t.rect.y + t.rect.h)
                    {
                        say(format!("{axis} tick label {} is off the picture", t.label));
                    }
                }
            }
            if p.x_scale == Scale::Log && p.occurring_x.len() <= 8 {
                for v in &p.occurring_x {
                    if !p.x_ticks.iter().any(|t| (t.value - v).abs() <= 1e-9 * v.abs().max(1.0)) {
                        say(format!("log x axis has no tick at the value {v} that occurs"));
                    }
                }
            }
            if let Some(l) = &p.legend {
                if l.overlaps(&p.plot) {
                    say("the legend overlaps the data area".into());
                }
                if !page.contains(l.x, l.y) || !page.contains(l.x + l.w, l.y + l.h) {
                    say("the legend is off the picture".into());
                }
            }
            let mut looks = HashSet::new();
            for s in &p.series {
                if !looks.insert((s.colour.clone(), s.marker, s.dash.clone())) {
                    say(format!("series {} looks like another series", s.name));
                }
                if let Some(c) = s.element_colours.iter().find(|c| **c != s.colour) {
                    say(format!("series {} has an element drawn in {c}, not its {}", s.name, s.colour));
                }
                let inside = s.points.iter().chain(&s.samples).chain(&s.marks).chain(s.line.iter().flatten());
                for &(x, y) in inside {
                    if !p.plot.contains(x, y) {
                        say(format!(
                            "series {} has a point at ({x:.1}, {y:.1}) outside the plot area",
                            s.name
                        ));
                    }
                }
                for &(x, top, bottom) in &s.intervals {
                    if !p.plot.contains(x, top) || !p.plot.contains(x, bottom) {
                        say(format!("series {} has an error bar outside the plot area", s.name));
                    }
                }
                if let Some(l) = &p.legend {
                    for &(x, y) in s.points.iter().chain(&s.samples) {
                        if l.contains(x, y) {
                            say(format!("the legend covers a point of {}", s.name));
                        }
                    }
                }
            }
            let names: HashSet<&str> =
                p.series.iter().map(|s| s.name.as_str()).chain(p.refs.iter().map(|r| r.0.as_str())).collect();
            for e in &p.legend_entries {
                if !names.contains(e.as_str()) {
                    say(format!("legend entry {e:?} is not a series"));
                }
            }
            for (i, (a, ra)) in p.notes.iter().enumerate() {
                for (b, rb) in &p.notes[i + 1..] {
                    if ra.overlaps(rb) {
                        say(format!("notes {a:?} and {b:?} overlap"));
                    }
                }
                if ra.overlaps(&p.plot) {
                    say(format!("note {a:?} is on the data area"));
                }
            }
        }
        for (i, a) in self.panels.iter().enumerate() {
            for b in &self.panels[i + 1..] {
                if a.plot.overlaps(&b.plot) || a.legend.zip(Some(b.plot)).is_some_and(|(l, p)| l.overlaps(&p))
                {
                    out.push(format!("panels {:?} and {:?} overlap", a.title, b.title));
                }
            }
        }
        out
    }
}
