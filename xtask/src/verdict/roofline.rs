//! The roofline of a run, as data: the machine's roofs measured in the run (the read
//! bandwidth and the compute roof, per thread count) and where each kernel or cell sits
//! under them. Which roof bounds a point and its share of that roof are decided here
//! once, by [`Roofline::place`]; the kernel report, `readings.json` and report.html's
//! plot print these values and never place a point again.
//!
//! A point of operational intensity `I` (operations per byte read) can run at most
//! `min(C, I * B)` operations per second under a compute roof `C` and a read bandwidth
//! `B`. Below the ridge point `I = C / B` the bandwidth bounds it, above it the compute
//! roof; its share is its operations per second over that bound (for a
//! bandwidth-bound point, the same as its bytes per second over `B`). Operations count a
//! multiply-accumulate as two.

use serde::{Deserialize, Serialize};

/// Which roof bounds a point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Bound {
    /// The read bandwidth: the point does fewer operations per byte than the ridge.
    Bandwidth,
    /// The compute roof.
    Compute,
}

impl Bound {
    /// `bandwidth` or `compute`.
    pub fn as_str(self) -> &'static str {
        match self {
            Bound::Bandwidth => "bandwidth",
            Bound::Compute => "compute",
        }
    }
}

/// One measured roof.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Roof {
    /// What was measured: `read bandwidth`, or the probe's name (`int8_avx512_vnni`).
    pub name: String,
    /// Threads that ran it at once.
    pub threads: usize,
    /// Bytes per second for the bandwidth, operations per second for a compute roof.
    pub value: f64,
    /// How every page prints it (`41.7 GB/s`, `1.37 TOPS`).
    pub text: String,
}

impl Roof {
    /// The read bandwidth at `threads`, from bytes per second.
    pub fn bandwidth(threads: usize, bytes_per_s: f64) -> Roof {
        Roof { name: "read bandwidth".into(), threads, value: bytes_per_s, text: gb_s_text(bytes_per_s) }
    }

    /// A compute roof at `threads`, from operations per second.
    pub fn compute(name: impl Into<String>, threads: usize, ops_per_s: f64) -> Roof {
        Roof { name: name.into(), threads, value: ops_per_s, text: ops_text(ops_per_s) }
    }
}

/// A kernel or a cell under the roofs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Point {
    /// What ran (a benchmark id, a cell's phase).
    pub name: String,
    /// The series it is drawn in (`qmv`, `prefill`), so points of one kind share a marker.
    pub series: String,
    /// Threads it ran on: the roofs of this thread count hold it.
    pub threads: usize,
    /// Operations per byte read.
    pub intensity: f64,
    /// Operations per second it reached.
    pub ops_per_s: f64,
    /// The roof that bounds it; `None` when a roof of its thread count was not measured.
    pub bound: Option<Bound>,
    /// Its operations per second over that bound's limit at its intensity.
    pub share: Option<f64>,
    /// How every page prints the bound and share (`bandwidth, 63%`).
    pub text: String,
}

/// The roofs of a run and the points under them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Roofline {
    /// The read bandwidth per thread count.
    pub bandwidth: Vec<Roof>,
    /// The compute roof a point is held to, per thread count: the highest int8
    /// multiply-accumulate rate measured (the quantized kernels' integer dots).
    pub compute: Vec<Roof>,
    /// Every compute probe measured, for the table of roofs.
    pub probes: Vec<Roof>,
    /// The points, in the order they were placed.
    pub points: Vec<Point>,
    /// What the operations count, for the legend.
    pub counted: String,
}

fn roof_at(roofs: &[Roof], threads: usize) -> Option<f64> {
    roofs.iter().find(|r| r.threads == threads).map(|r| r.value)
}

/// Which roof bounds a point of `intensity` and its share of it, under a compute roof
/// and a bandwidth; `None` for a share that cannot be taken (no positive roof).
pub fn place(intensity: f64, ops_per_s: f64, compute: f64, bandwidth: f64) -> Option<(Bound, f64)> {
    if !(compute > 0.0 && bandwidth > 0.0 && intensity > 0.0 && ops_per_s.is_finite()) {
        return None;
    }
    let by_bandwidth = intensity * bandwidth;
    Some(if by_bandwidth < compute {
        (Bound::Bandwidth, ops_per_s / by_bandwidth)
    } else {
        (Bound::Compute, ops_per_s / compute)
    })
}

impl Roofline {
    /// The ridge point at `threads`: the intensity where the two roofs meet.
    pub fn ridge(&self, threads: usize) -> Option<f64> {
        Some(roof_at(&self.compute, threads)? / roof_at(&self.bandwidth, threads)?)
    }

    /// Places a point that did `ops` operations reading `bytes` in `secs` seconds on
    /// `threads` threads, and returns it.
    pub fn place(
        &mut self,
        name: impl Into<String>,
        series: impl Into<String>,
        threads: usize,
        ops: f64,
        bytes: f64,
        secs: f64,
    ) -> &Point {
        let intensity = ops / bytes;
        let ops_per_s = ops / secs;
        let placed = match (roof_at(&self.compute, threads), roof_at(&self.bandwidth, threads)) {
            (Some(c), Some(b)) => place(intensity, ops_per_s, c, b),
            _ => None,
        };
        let text = match placed {
            Some((bound, share)) => share_text(bound, share),
            None => "n/a (roofs not measured at this thread count)".into(),
        };
        self.points.push(Point {
            name: name.into(),
            series: series.into(),
            threads,
            intensity,
            ops_per_s,
            bound: placed.map(|p| p.0),
            share: placed.map(|p| p.1),
            text,
        });
        self.points.last().expect("a point was just pushed")
    }
}

/// `bandwidth, 63%`; a share over 100% is not one (the roof measured low under load, or
/// the bytes came from cache), and says so.
pub fn share_text(bound: Bound, share: f64) -> String {
    let pct = 100.0 * share;
    if pct > 100.0 {
        format!("{}, {pct:.0}% (over 100%: the roof measured low, not a share)", bound.as_str())
    } else if pct < 1.0 {
        format!("{}, {pct:.2}%", bound.as_str())
    } else {
        format!("{}, {pct:.0}%", bound.as_str())
    }
}

/// Operations per second as a page prints them: `1.37 TOPS`, `152 GOPS`.
pub fn ops_text(ops_per_s: f64) -> String {
    if ops_per_s >= 1e12 {
        format!("{:.2} TOPS", ops_per_s / 1e12)
    } else {
        format!("{:.1} GOPS", ops_per_s / 1e9)
    }
}

/// Bytes per second as a page prints them: `41.7 GB/s`.
pub fn gb_s_text(bytes_per_s: f64) -> String {
    format!("{:.1} GB/s", bytes_per_s / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn below_the_ridge_the_bandwidth_bounds_above_it_the_compute_roof() {
        // 1 TOPS over 40 GB/s: the ridge is at 25 operations per byte.
        let mut r = Roofline {
            bandwidth: vec![Roof::bandwidth(2, 40e9)],
            compute: vec![Roof::compute("int8_avx512_vnni", 2, 1e12)],
            ..Roofline::default()
        };
        assert_eq!(r.ridge(2), Some(25.0));
        assert_eq!(r.ridge(1), None);
        // qmv at M = 1 on 4-bit weights: about 3.6 operations per byte, read at 30 GB/s.
        let qmv = r.place("qmv", "qmv", 2, 3.6e9, 1e9, 1.0 / 30.0).clone();
        assert_eq!(qmv.bound, Some(Bound::Bandwidth));
        assert!((qmv.share.unwrap() - 0.75).abs() < 1e-12, "{qmv:?}");
        assert_eq!(qmv.text, "bandwidth, 75%");
        // A prefill at 100 operations per byte and 0.15 TOPS: 15% of the compute roof.
        let prefill = r.place("prefill", "prefill", 2, 1.5e11, 1.5e9, 1.0).clone();
        assert_eq!((prefill.bound, prefill.text.as_str()), (Some(Bound::Compute), "compute, 15%"));
        // On the ridge, both roofs give the same limit; the compute roof is named.
        assert_eq!(place(25.0, 5e11, 1e12, 40e9), Some((Bound::Compute, 0.5)));
        // A thread count without roofs places the point without a bound.
        let lone = r.place("x", "qmv", 1, 1.0, 1.0, 1.0);
        assert_eq!((lone.bound, lone.share), (None, None));
        assert!(place(1.0, 1.0, 0.0, 1.0).is_none());
    }

    #[test]
    fn a_share_over_the_roof_says_it_is_not_one() {
        assert_eq!(
            share_text(Bound::Bandwidth, 1.4),
            "bandwidth, 140% (over 100%: the roof measured low, not a share)"
        );
        assert_eq!(share_text(Bound::Compute, 0.0031), "compute, 0.31%");
        assert_eq!(ops_text(1.37e12), "1.37 TOPS");
        assert_eq!(ops_text(1.52e11), "152.0 GOPS");
    }
}
