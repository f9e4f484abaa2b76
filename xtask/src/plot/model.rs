//! What a plot shows, as data: panels of series of points (with intervals and samples),
//! marks for cells without a value, reference lines and the axes' scales. Every task
//! builds these; the renderer and the layout checks read them.

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
    /// A log axis labelled at powers of ten (or 1-2-5) even on x, where the values are a
    /// continuum (operational intensities) rather than a ladder that occurs.
    pub decades: bool,
}

impl Axis {
    /// A linear axis.
    pub fn linear(label: impl Into<String>) -> Axis {
        Axis {
            label: label.into(),
            scale: Scale::Linear,
            from_zero: false,
            categories: Vec::new(),
            decades: false,
        }
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
    /// A log axis labelled at decades whatever the values (see [`Axis::decades`]).
    pub fn log_decades(label: impl Into<String>) -> Axis {
        Axis { decades: true, ..Axis::log(label) }
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
