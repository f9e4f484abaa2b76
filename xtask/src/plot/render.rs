//! Draws panels to SVG and records where everything went ([`Layout`]): the small
//! multiples, each panel's axes and ticks, its series, its legend to the right of the
//! data and its notes (cells without a value) below.

use std::fmt::Write as _;

use super::layout::{Layout, PanelLayout, Rect, SeriesLayout, Tick};
use super::model::{Axis, Mark, Panel, Scale, Series};
use super::style::{FONT, Look, escape, look, marker_svg, text_width};
use super::ticks;

const PLOT_W: f64 = 420.0;
const PLOT_W_MAX: f64 = 900.0;
const PLOT_H: f64 = 250.0;
const TITLE_H: f64 = 28.0;
const TICK_FONT: f64 = 11.0;
const LEGEND_ROW: f64 = 17.0;
const NOTE_ROW: f64 = 15.0;
const MARKER_R: f64 = 4.5;
const SAMPLE_R: f64 = 2.6;
const PANELS_PER_ROW: usize = 3;

/// One panel as drawn: the source panel and which of its series (with their index there,
/// which fixes their look) it shows.
struct Cell<'a> {
    title: String,
    panel: &'a Panel,
    series: Vec<(usize, &'a Series)>,
    marks: Vec<&'a Mark>,
}

/// Whether `p`'s series differ by more than 10x (median of each series' values).
pub fn spread(p: &Panel) -> bool {
    let typical: Vec<f64> = p
        .series
        .iter()
        .filter_map(|s| {
            let mut v: Vec<f64> =
                s.points.iter().map(|q| q.y.abs()).filter(|y| y.is_finite() && *y > 0.0).collect();
            v.sort_by(f64::total_cmp);
            (!v.is_empty()).then(|| v[v.len() / 2])
        })
        .collect();
    let (lo, hi) = typical.iter().fold((f64::INFINITY, 0f64), |(a, b), v| (a.min(*v), b.max(*v)));
    typical.len() > 1 && hi > 10.0 * lo
}

/// The rows of cells: every panel in one row (wrapped at three) unless one is split into
/// small multiples, then each panel is its own row of them.
fn cells(panels: &[Panel]) -> Vec<Vec<Cell<'_>>> {
    fn whole(p: &Panel) -> Cell<'_> {
        Cell {
            title: p.title.clone(),
            panel: p,
            series: p.series.iter().enumerate().collect(),
            marks: p.marks.iter().collect(),
        }
    }
    let split: Vec<bool> = panels.iter().map(|p| p.split_when_spread && spread(p)).collect();
    if !split.iter().any(|s| *s) {
        let all: Vec<Cell> = panels.iter().map(whole).collect();
        let mut rows = Vec::new();
        let mut it = all.into_iter().peekable();
        while it.peek().is_some() {
            rows.push(it.by_ref().take(PANELS_PER_ROW).collect());
        }
        return rows;
    }
    // A split panel is a row of its own; the panels between are packed three to a row.
    let mut rows: Vec<Vec<Cell>> = Vec::new();
    let mut packed: Vec<Cell> = Vec::new();
    for (p, split) in panels.iter().zip(split) {
        if !split {
            packed.push(whole(p));
            if packed.len() == PANELS_PER_ROW {
                rows.push(std::mem::take(&mut packed));
            }
            continue;
        }
        if !packed.is_empty() {
            rows.push(std::mem::take(&mut packed));
        }
        rows.push(
            p.series
                .iter()
                .enumerate()
                .filter(|(_, s)| !s.points.is_empty() || p.marks.iter().any(|m| m.series == s.name))
                .map(|(i, s)| Cell {
                    title: format!("{}: {}", p.title, s.name),
                    panel: p,
                    series: vec![(i, s)],
                    marks: p.marks.iter().filter(|m| m.series == s.name).collect(),
                })
                .collect(),
        );
    }
    if !packed.is_empty() {
        rows.push(packed);
    }
    rows
}

/// An axis's range (in data values) and tick values.
struct Map {
    scale: Scale,
    lo: f64,
    hi: f64,
    ticks: Vec<f64>,
}

impl Map {
    fn new(ax: &Axis, values: &[f64], label_occurring: bool) -> Map {
        let log = ax.scale == Scale::Log;
        let v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite() && (!log || *x > 0.0)).collect();
        let (mut lo, mut hi) =
            v.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| (a.min(*x), b.max(*x)));
        if !lo.is_finite() {
            (lo, hi) = if log { (1.0, 10.0) } else { (0.0, 1.0) };
        }
        if log {
            if hi <= lo {
                (lo, hi) = (lo / 2.0, hi * 2.0);
            }
            let f = (hi / lo).powf(0.06).max(1.12);
            let (a, b) = (lo / f, hi * f);
            let mut occurring = v.clone();
            occurring.sort_by(f64::total_cmp);
            occurring.dedup_by(|a, b| (*a - *b).abs() <= 1e-9 * b.abs());
            let ticks = if label_occurring && !ax.decades && !occurring.is_empty() && occurring.len() <= 24 {
                occurring
            } else {
                ticks::decades(a, b)
            };
            return Map { scale: Scale::Log, lo: a, hi: b, ticks };
        }
        if ax.scale == Scale::Category {
            let n = ax.categories.len().max(1) as f64;
            return Map {
                scale: Scale::Category,
                lo: -0.5,
                hi: n - 0.5,
                ticks: (0..ax.categories.len()).map(|i| i as f64).collect(),
            };
        }
        let integer = ax.scale == Scale::Integer;
        if ax.from_zero {
            lo = lo.min(0.0);
            hi = hi.max(0.0);
        }
        if hi - lo <= 1e-12 * hi.abs().max(1.0) {
            let d = if integer {
                1.0
            } else if hi.abs() > 0.0 {
                hi.abs() * 0.1
            } else {
                1.0
            };
            (lo, hi) = if ax.from_zero && lo == 0.0 && hi == 0.0 { (0.0, 1.0) } else { (lo - d, hi + d) };
            if ax.from_zero && values.iter().all(|x| *x >= 0.0) {
                lo = lo.max(0.0);
            }
        }
        let pad = if integer { 0.5 } else { 0.05 * (hi - lo) };
        let a = if ax.from_zero && lo == 0.0 { 0.0 } else { lo - pad };
        let b = hi + pad;
        let mut step = if integer { ticks::integer_step(b - a, 6) } else { ticks::nice_step(b - a, 6) };
        let mut t = ticks::multiples(a, b, step);
        for _ in 0..10 {
            if t.len() >= 4 || (integer && step <= 1.0) {
                break;
            }
            step = if integer { ticks::integer_step(step, 2) } else { ticks::nice_step(step, 2) };
            t = ticks::multiples(a, b, step);
        }
        Map { scale: ax.scale, lo: a, hi: b, ticks: t }
    }

    /// Where `v` falls, 0 at `lo` to 1 at `hi`.
    fn frac(&self, v: f64) -> f64 {
        if self.scale == Scale::Log {
            (v.ln() - self.lo.ln()) / (self.hi.ln() - self.lo.ln())
        } else {
            (v - self.lo) / (self.hi - self.lo)
        }
    }
}

/// What one cell needs measured before it is placed.
struct Measured<'a> {
    cell: Cell<'a>,
    xm: Map,
    ym: Map,
    x_labels: Vec<String>,
    y_labels: Vec<String>,
    plot_w: f64,
    left: f64,
    legend: Vec<(String, Entry)>,
    legend_w: f64,
    notes: Vec<(String, Look)>,
    clip: bool,
    width: f64,
    height: f64,
}

#[derive(Clone, Copy)]
enum Entry {
    Series(Look, bool),
    Ref,
}

fn measure(cell: Cell<'_>) -> Measured<'_> {
    let p = cell.panel;
    let finite = |q: &&super::Point| q.x.is_finite() && q.y.is_finite();
    let xs: Vec<f64> = cell
        .series
        .iter()
        .flat_map(|(_, s)| s.points.iter().filter(finite).map(|q| q.x).chain(s.samples.iter().map(|q| q.0)))
        .chain(cell.marks.iter().map(|m| m.x))
        .collect();
    // A rate's interval reaching below zero (two repetitions far apart) is cut at the
    // axis, whose zero stays at the bottom.
    let clip = p.y.from_zero && cell.series.iter().all(|(_, s)| s.points.iter().all(|q| q.y >= 0.0));
    let ys: Vec<f64> = cell
        .series
        .iter()
        .flat_map(|(_, s)| {
            s.points
                .iter()
                .filter(finite)
                .flat_map(|q| {
                    [
                        Some(q.y),
                        q.interval.map(|i| if clip { i.0.max(0.0) } else { i.0 }),
                        q.interval.map(|i| i.1),
                    ]
                })
                .flatten()
                .chain(s.samples.iter().map(|q| q.1))
        })
        .chain(p.refs.iter().map(|r| r.y))
        .collect();
    let xm = Map::new(&p.x, &xs, true);
    let ym = Map::new(&p.y, &ys, false);
    let labels = |ax: &Axis, m: &Map| match ax.scale {
        Scale::Category => ax.categories.clone(),
        Scale::Log => ticks::log_labels(&m.ticks),
        _ => ticks::labels(&m.ticks),
    };
    let x_labels = labels(&p.x, &xm);
    let y_labels = labels(&p.y, &ym);
    // A log x axis labelled at the values that occur gets the width its labels need.
    let mut plot_w = PLOT_W;
    for (w, l) in xm.ticks.windows(2).zip(x_labels.windows(2)) {
        let gap = xm.frac(w[1]) - xm.frac(w[0]);
        let need = (text_width(&l[0], TICK_FONT) + text_width(&l[1], TICK_FONT)) / 2.0 + 8.0;
        if gap > 0.0 {
            plot_w = plot_w.max((need / gap).min(PLOT_W_MAX));
        }
    }
    let left = 24.0 + y_labels.iter().map(|l| text_width(l, TICK_FONT)).fold(0.0, f64::max) + 10.0;
    let mut legend: Vec<(String, Entry)> = cell
        .series
        .iter()
        .filter(|(_, s)| {
            !s.points.is_empty() || !s.samples.is_empty() || cell.marks.iter().any(|m| m.series == s.name)
        })
        .map(|(i, s)| (s.name.clone(), Entry::Series(look(*i), s.join)))
        .collect();
    legend.extend(p.refs.iter().map(|r| (r.name.clone(), Entry::Ref)));
    let legend_w = 40.0 + legend.iter().map(|(n, _)| text_width(n, TICK_FONT)).fold(0.0, f64::max);
    let notes = notes(&cell);
    let note_w = notes.iter().map(|(n, _)| 30.0 + text_width(n, TICK_FONT)).fold(0.0, f64::max);
    let legend_h = if legend.is_empty() { 0.0 } else { 8.0 + LEGEND_ROW * legend.len() as f64 };
    let width =
        (left + plot_w + if legend.is_empty() { 20.0 } else { 16.0 + legend_w + 14.0 }).max(note_w + 16.0);
    let height = TITLE_H + PLOT_H.max(legend_h) + 48.0 + NOTE_ROW * notes.len() as f64 + 8.0;
    Measured { cell, xm, ym, x_labels, y_labels, plot_w, left, legend, legend_w, notes, clip, width, height }
}

/// One line per (series, status) of the cells without a value: `model: SKIP:oom at 2048, 8192`.
fn notes(cell: &Cell<'_>) -> Vec<(String, Look)> {
    let mut out: Vec<(String, Look, Vec<f64>)> = Vec::new();
    for m in &cell.marks {
        let idx = cell.series.iter().find(|(_, s)| s.name == m.series).map(|(i, _)| *i);
        let lk = idx.map_or(look(0), look);
        let head = format!("{}: {}", m.series, m.label);
        match out.iter_mut().find(|(h, _, _)| *h == head) {
            Some(e) => e.2.push(m.x),
            None => out.push((head, lk, vec![m.x])),
        }
    }
    out.into_iter()
        .map(|(head, lk, mut xs)| {
            xs.sort_by(f64::total_cmp);
            xs.dedup();
            let at: Vec<String> = ticks::labels(&xs);
            (format!("{head} at {}", at.join(", ")), lk)
        })
        .collect()
}

/// Renders `panels` to an SVG document and the layout of everything in it.
pub fn render(panels: &[Panel]) -> (String, Layout) {
    let rows: Vec<Vec<Measured>> =
        cells(panels).into_iter().map(|r| r.into_iter().map(measure).collect()).collect();
    let width = rows.iter().map(|r| r.iter().map(|m| m.width).sum::<f64>()).fold(200.0, f64::max).ceil();
    let height =
        rows.iter().map(|r| r.iter().map(|m| m.height).fold(0.0, f64::max)).sum::<f64>().max(100.0).ceil();
    let mut body = String::new();
    let mut layouts = Vec::new();
    let mut oy = 0.0;
    for row in &rows {
        let mut ox = 0.0;
        for m in row {
            layouts.push(draw(&mut body, m, ox, oy));
            ox += m.width;
        }
        oy += row.iter().map(|m| m.height).fold(0.0, f64::max);
    }
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="{FONT}">"#
    );
    let _ = writeln!(svg, r##"<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>"##);
    svg.push_str(&body);
    svg.push_str("</svg>\n");
    (svg, Layout { width, height, panels: layouts })
}

fn text(out: &mut String, x: f64, y: f64, anchor: &str, size: f64, extra: &str, s: &str) {
    let _ = writeln!(
        out,
        r##"<text x="{x:.2}" y="{y:.2}" text-anchor="{anchor}" font-size="{size}" fill="#222222"{extra}>{}</text>"##,
        escape(s)
    );
}

/// Keeps the ticks whose labels do not collide, the first and the last always.
fn thin(ticks: Vec<Tick>, horizontal: bool) -> Vec<Tick> {
    let gap = |a: &Rect, b: &Rect| {
        let grown = if horizontal {
            Rect { x: a.x - 4.0, w: a.w + 8.0, ..*a }
        } else {
            Rect { y: a.y - 2.0, h: a.h + 4.0, ..*a }
        };
        grown.overlaps(b)
    };
    let Some(last) = ticks.last().cloned() else { return ticks };
    let mut kept: Vec<Tick> = Vec::new();
    for t in ticks {
        if kept.last().is_none_or(|k| !gap(&k.rect, &t.rect)) {
            kept.push(t);
        }
    }
    if kept.last().is_some_and(|k| k.value != last.value) {
        while kept.len() > 1 && kept.last().is_some_and(|k| gap(&k.rect, &last.rect)) {
            kept.pop();
        }
        kept.push(last);
    }
    kept
}

fn draw(out: &mut String, m: &Measured<'_>, ox: f64, oy: f64) -> PanelLayout {
    let plot = Rect { x: ox + m.left, y: oy + TITLE_H, w: m.plot_w, h: PLOT_H };
    let px = |v: f64| plot.x + m.xm.frac(v) * plot.w;
    let py = |v: f64| plot.y + plot.h - m.ym.frac(v) * plot.h;
    let bottom = plot.y + plot.h;
    text(out, plot.x + plot.w / 2.0, oy + 18.0, "middle", 13.0, r#" font-weight="bold""#, &m.cell.title);
    let _ = writeln!(
        out,
        r##"<rect x="{:.2}" y="{:.2}" width="{:.2}" height="{:.2}" fill="#ffffff" stroke="#999999"/>"##,
        plot.x, plot.y, plot.w, plot.h
    );
    // Ticks, thinned where labels would collide, then gridlines and labels.
    let x_ticks = thin(
        m.xm.ticks
            .iter()
            .zip(&m.x_labels)
            .map(|(v, l)| {
                let (at, w) = (px(*v), text_width(l, TICK_FONT));
                Tick {
                    value: *v,
                    label: l.clone(),
                    at,
                    rect: Rect { x: at - w / 2.0, y: bottom + 5.0, w, h: 12.0 },
                }
            })
            .collect(),
        true,
    );
    let y_ticks = thin(
        m.ym.ticks
            .iter()
            .zip(&m.y_labels)
            .map(|(v, l)| {
                let (at, w) = (py(*v), text_width(l, TICK_FONT));
                Tick {
                    value: *v,
                    label: l.clone(),
                    at,
                    rect: Rect { x: plot.x - 7.0 - w, y: at - 6.0, w, h: 12.0 },
                }
            })
            .collect(),
        false,
    );
    for t in &x_ticks {
        let _ = writeln!(
            out,
            r##"<line x1="{0:.2}" y1="{1:.2}" x2="{0:.2}" y2="{2:.2}" stroke="#e4e4e4"/><line x1="{0:.2}" y1="{2:.2}" x2="{0:.2}" y2="{3:.2}" stroke="#666666"/>"##,
            t.at,
            plot.y,
            bottom,
            bottom + 4.0
        );
        text(out, t.at, bottom + 15.0, "middle", TICK_FONT, "", &t.label);
    }
    for t in &y_ticks {
        let _ = writeln!(
            out,
            r##"<line x1="{0:.2}" y1="{2:.2}" x2="{1:.2}" y2="{2:.2}" stroke="#e4e4e4"/><line x1="{3:.2}" y1="{2:.2}" x2="{0:.2}" y2="{2:.2}" stroke="#666666"/>"##,
            plot.x,
            plot.x + plot.w,
            t.at,
            plot.x - 4.0
        );
        text(out, plot.x - 7.0, t.at + 4.0, "end", TICK_FONT, "", &t.label);
    }
    text(out, plot.x + plot.w / 2.0, bottom + 34.0, "middle", 12.0, "", &m.cell.panel.x.label);
    let (lx, ly) = (ox + 15.0, plot.y + plot.h / 2.0);
    text(
        out,
        lx,
        ly,
        "middle",
        12.0,
        &format!(r#" transform="rotate(-90 {lx:.2} {ly:.2})""#),
        &m.cell.panel.y.label,
    );
    // Reference lines under the data.
    let mut refs = Vec::new();
    for r in &m.cell.panel.refs {
        let y = py(r.y);
        let _ = writeln!(
            out,
            r##"<line x1="{:.2}" y1="{y:.2}" x2="{:.2}" y2="{y:.2}" stroke="#555555" stroke-width="1.2" stroke-dasharray="5 4"/>"##,
            plot.x,
            plot.x + plot.w
        );
        refs.push((r.name.clone(), y));
    }
    // Series that carry intervals are set a little apart, so their error bars do not hide
    // each other.
    let with_intervals: Vec<usize> = m
        .cell
        .series
        .iter()
        .filter(|(_, s)| s.points.iter().any(|q| q.interval.is_some()))
        .map(|(i, _)| *i)
        .collect();
    let dodge = |i: usize| match with_intervals.iter().position(|j| *j == i) {
        Some(k) if with_intervals.len() > 1 => (k as f64 - (with_intervals.len() - 1) as f64 / 2.0) * 6.0,
        _ => 0.0,
    };
    let log_y = m.ym.scale == Scale::Log;
    let drawable = |x: f64, y: f64| {
        x.is_finite() && y.is_finite() && (!log_y || y > 0.0) && (m.xm.scale != Scale::Log || x > 0.0)
    };
    let mut series_layouts = Vec::new();
    // Lines and error bars first, markers over them.
    let mut layers: Vec<String> = vec![String::new(), String::new()];
    for (i, s) in &m.cell.series {
        let lk = look(*i);
        let c = lk.colour;
        let d = dodge(*i);
        let mut sl = SeriesLayout {
            name: s.name.clone(),
            colour: c.to_string(),
            marker: lk.marker,
            dash: lk.dash.to_string(),
            element_colours: Vec::new(),
            points: Vec::new(),
            samples: Vec::new(),
            intervals: Vec::new(),
            line: None,
            marks: Vec::new(),
        };
        let mut pts: Vec<&super::Point> = s.points.iter().filter(|q| drawable(q.x, q.y)).collect();
        pts.sort_by(|a, b| a.x.total_cmp(&b.x));
        if s.join && pts.len() > 1 {
            let v: Vec<(f64, f64)> = pts.iter().map(|q| (px(q.x) + d, py(q.y))).collect();
            let path: Vec<String> = v.iter().map(|(x, y)| format!("{x:.2},{y:.2}")).collect();
            let dash = if lk.dash.is_empty() {
                String::new()
            } else {
                format!(r#" stroke-dasharray="{}""#, lk.dash)
            };
            let _ = writeln!(
                layers[0],
                r#"<polyline points="{}" fill="none" stroke="{c}" stroke-width="2"{dash}/>"#,
                path.join(" ")
            );
            sl.element_colours.push(c.to_string());
            sl.line = Some(v);
        }
        for q in &pts {
            if let Some((lo, hi)) = q.interval.filter(|(lo, hi)| drawable(q.x, *lo) && drawable(q.x, *hi)) {
                let (lo, hi) = (lo.min(hi), lo.max(hi));
                let cut = m.clip && lo < 0.0;
                let (x, top, bot) = (px(q.x) + d, py(hi), py(if cut { 0.0 } else { lo }));
                // A bar cut at the axis has no cap there: it goes on below.
                let low_cap =
                    if cut { String::new() } else { format!("M{:.2},{bot:.2}H{:.2}", x - 4.0, x + 4.0) };
                let _ = writeln!(
                    layers[0],
                    r#"<path d="M{x:.2},{top:.2}V{bot:.2}M{:.2},{top:.2}H{:.2}{low_cap}" stroke="{c}" stroke-width="1.6" fill="none"/>"#,
                    x - 4.0,
                    x + 4.0,
                );
                sl.element_colours.push(c.to_string());
                sl.intervals.push((x, top, bot));
            }
        }
        for &(x, y) in s.samples.iter().filter(|(x, y)| drawable(*x, *y)) {
            let (x, y) = (px(x) + d, py(y));
            let mut e = String::new();
            marker_svg(&mut e, lk.marker, x, y, SAMPLE_R, c, c);
            layers[1].push_str(&e.replace("/>", r#" fill-opacity="0.45" stroke-opacity="0.7"/>"#));
            sl.element_colours.push(c.to_string());
            sl.samples.push((x, y));
        }
        for q in &pts {
            let (x, y) = (px(q.x) + d, py(q.y));
            marker_svg(&mut layers[1], lk.marker, x, y, MARKER_R, c, "#ffffff");
            sl.element_colours.push(c.to_string());
            sl.points.push((x, y));
        }
        series_layouts.push(sl);
    }
    // Cells without a value: a hollow marker on the axis, stacked when several share an x.
    let mut stacked: Vec<(f64, usize)> = Vec::new();
    for mk in &m.cell.marks {
        let Some(si) = m.cell.series.iter().position(|(_, s)| s.name == mk.series) else { continue };
        if !drawable(mk.x, 1.0) {
            continue;
        }
        let x = px(mk.x);
        let k = match stacked.iter_mut().find(|(sx, _)| (*sx - x).abs() < 1.0) {
            Some(e) => {
                e.1 += 1;
                e.1
            }
            None => {
                stacked.push((x, 0));
                0
            }
        };
        // On the axis line itself, where no value can sit: nothing was measured.
        let y = bottom - 11.0 * k as f64;
        let lk = look(m.cell.series[si].0);
        marker_svg(&mut layers[1], lk.marker, x, y, MARKER_R, "#ffffff", lk.colour);
        series_layouts[si].element_colours.push(lk.colour.to_string());
        series_layouts[si].marks.push((x, y));
    }
    out.push_str(&layers[0]);
    out.push_str(&layers[1]);
    if series_layouts.iter().all(|s| s.points.is_empty() && s.samples.is_empty()) {
        text(
            out,
            plot.x + plot.w / 2.0,
            plot.y + plot.h / 2.0,
            "middle",
            12.0,
            r##" fill-opacity="0.6""##,
            "no measured value",
        );
    }
    // The legend, right of the data area.
    let legend = (!m.legend.is_empty()).then_some(Rect {
        x: plot.x + plot.w + 16.0,
        y: plot.y,
        w: m.legend_w,
        h: 8.0 + LEGEND_ROW * m.legend.len() as f64,
    });
    if let Some(l) = legend {
        let _ = writeln!(
            out,
            r##"<rect x="{:.2}" y="{:.2}" width="{:.2}" height="{:.2}" fill="#ffffff" stroke="#bbbbbb"/>"##,
            l.x, l.y, l.w, l.h
        );
        for (k, (name, entry)) in m.legend.iter().enumerate() {
            let y = l.y + 4.0 + LEGEND_ROW * (k as f64 + 0.5);
            let (x0, x1) = (l.x + 6.0, l.x + 28.0);
            match entry {
                Entry::Series(lk, joined) => {
                    if *joined {
                        let dash = if lk.dash.is_empty() {
                            String::new()
                        } else {
                            format!(r#" stroke-dasharray="{}""#, lk.dash)
                        };
                        let _ = writeln!(
                            out,
                            r#"<line x1="{x0:.2}" y1="{y:.2}" x2="{x1:.2}" y2="{y:.2}" stroke="{}" stroke-width="2"{dash}/>"#,
                            lk.colour
                        );
                    }
                    marker_svg(out, lk.marker, (x0 + x1) / 2.0, y, MARKER_R, lk.colour, "#ffffff");
                    if let Some(sl) = series_layouts.iter_mut().find(|s| s.name == *name) {
                        sl.element_colours.push(lk.colour.to_string());
                    }
                }
                Entry::Ref => {
                    let _ = writeln!(
                        out,
                        r##"<line x1="{x0:.2}" y1="{y:.2}" x2="{x1:.2}" y2="{y:.2}" stroke="#555555" stroke-width="1.2" stroke-dasharray="5 4"/>"##
                    );
                }
            }
            text(out, x1 + 6.0, y + 4.0, "start", TICK_FONT, "", name);
        }
    }
    // Notes below the axis label.
    let mut notes = Vec::new();
    for (k, (note, lk)) in m.notes.iter().enumerate() {
        let y = bottom + 52.0 + NOTE_ROW * k as f64;
        let x = ox + 14.0;
        marker_svg(out, lk.marker, x, y - 4.0, 4.0, "#ffffff", lk.colour);
        text(out, x + 10.0, y, "start", TICK_FONT, "", note);
        notes
            .push((note.clone(), Rect { x: x + 10.0, y: y - 10.0, w: text_width(note, TICK_FONT), h: 13.0 }));
    }
    let mut occurring: Vec<f64> = Vec::new();
    for (_, s) in &m.cell.series {
        occurring.extend(s.points.iter().filter(|q| drawable(q.x, q.y)).map(|q| q.x));
        occurring.extend(s.samples.iter().map(|q| q.0));
    }
    occurring.extend(m.cell.marks.iter().map(|mk| mk.x));
    occurring.sort_by(f64::total_cmp);
    occurring.dedup();
    if m.cell.panel.x.decades {
        // A continuum labelled at decades promises no tick at the values that occur.
        occurring.clear();
    }
    PanelLayout {
        title: m.cell.title.clone(),
        plot,
        x_scale: m.xm.scale,
        y_scale: m.ym.scale,
        x_ticks,
        y_ticks,
        occurring_x: occurring,
        legend,
        legend_entries: m.legend.iter().map(|(n, _)| n.clone()).collect(),
        refs,
        series: series_layouts,
        notes,
    }
}
